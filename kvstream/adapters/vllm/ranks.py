"""vLLM's side of the rank arithmetic (``transfer/ranks.py``): the instance ids of an
engine's ranks."""

from __future__ import annotations

from kvstream.transfer.ranks import heads, owned, readers, refusal, sources

__all__ = ["heads", "instance", "owned", "readers", "refusal", "sources"]


def instance(base: str, rank: int, tp: int) -> str:
    """The kvstream instance id of one rank of an engine announced as ``base``."""
    return base if tp == 1 else f"{base}-tp{rank}"
