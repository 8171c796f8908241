"""Shared by the vLLM tests: the trained tiny model, built once per session (~20-35 s)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from .engines import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")
