"""Shared fixtures: a real nats-server per session, anyio on asyncio, the gpu marker."""

from __future__ import annotations

import pytest

from kvstream.control.nats_server import EmbeddedNats


@pytest.fixture(scope="session")
def nats_server():
    """A real nats-server on a free loopback port, up until the session ends."""
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run on a GPU host after "
                                   "pip install -e '.[cu13]' (or '.[cu12]')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
