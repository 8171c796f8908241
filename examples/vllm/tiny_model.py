"""A tiny *trained* Llama for trying kvstream with vLLM (CPU, ~20-35 s, no hub):
``python examples/vllm/tiny_model.py DIR``. The model is ``kvstream.bench.tiny_llama``'s
(greedy decoding copies the prompt from 32 tokens back); see its docstring."""

from __future__ import annotations

import sys
import time

from kvstream.bench.tiny_llama import make_model

__all__ = ["make_model"]

if __name__ == "__main__":
    t = time.time()
    print(make_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"), f"{time.time() - t:.1f}s")
