"""Engine adapters (vLLM, SGLang), found lazily through a registry of "module:Class" strings."""
