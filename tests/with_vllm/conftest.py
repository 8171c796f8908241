"""Shared by the vLLM tests: the trained tiny model (kvstream.bench.tiny_llama's committed
weights), saved as a model directory once per environment, then cached."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from kvstream.bench.tiny_llama import cached_model

    return cached_model()
