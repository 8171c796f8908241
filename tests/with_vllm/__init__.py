"""Tests against real vLLM engines (skipped where vLLM is not installed)."""
