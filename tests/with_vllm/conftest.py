"""Shared by the vLLM tests: the trained tiny model (kvstream.bench.tiny_llama), trained
once per machine and environment (~20-35 s), then cached."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from kvstream.bench.tiny_llama import cached_model

    return cached_model()
