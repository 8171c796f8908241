"""Prefix-chain block hashes: what makes a transfer incremental.

A block's hash covers its tokens and its parent's hash, as vLLM's prefix cache
does, so equal hashes mean equal prefixes up to and including that block, and a
destination that holds a block by hash holds exactly that KV. Only full blocks
get a hash; a partial last block is always sent.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence

__all__ = ["block_hashes", "skipped_indices"]

_MASK = (1 << 63) - 1  # fits a signed 64-bit MessagePack int everywhere


def block_hashes(token_ids: Sequence[int], block_size: int, *, parent: int = 0,
                 extra: bytes = b"") -> list[int]:
    """One 63-bit hash per *full* block of ``token_ids``.

    ``parent`` continues a chain (the hash of the block before ``token_ids[0]``);
    ``extra`` keys the chain (model name, LoRA id, cache salt) so two models never share.
    """
    if block_size < 1:
        raise ValueError("block_size must be positive")
    tokens = array("i", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()  # hash little-endian everywhere: hashes cross machines
    data = memoryview(tokens).cast("B")
    step = block_size * tokens.itemsize
    out: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(digest_size=8, key=extra[:64])
        h.update(parent.to_bytes(8, "little"))
        h.update(data[start * tokens.itemsize:start * tokens.itemsize + step])
        parent = int.from_bytes(h.digest(), "little") & _MASK
        out.append(parent)
    return out


def skipped_indices(hashes: Sequence[int], have: Iterable[int]) -> list[int]:
    """Indices of blocks whose hash the destination already holds (they are not sent)."""
    held = set(have)
    return [i for i, h in enumerate(hashes) if h in held] if held else []
