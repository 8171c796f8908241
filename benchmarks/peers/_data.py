"""The peers' caches (torch, CPU): kvstream bench's data pattern, and its check.

A layer is one flat buffer of ``PLANES x cache_blocks`` chunks (plane-major, as vLLM's
flash layout is); the source's layer ``l`` holds int64 ``l * n .. (l + 1) * n - 1``
(``kvstream.bench.synthetic.fill_layer``), so every 8 bytes are distinct and a chunk
that lands anywhere but its own place fails the check.
"""

from __future__ import annotations

import torch
from workload import PLANES, Workload

__all__ = ["chunk_rows", "make_layers", "verify"]


def make_layers(w: Workload, *, fill: bool) -> list[torch.Tensor]:
    """One flat uint8 tensor per layer: the pattern, or zeros (every page touched)."""
    layers = [torch.empty(w.layer_cache_bytes, dtype=torch.uint8) for _ in range(w.layers)]
    for i, t in enumerate(layers):
        if fill:
            flat = t.view(torch.int64)
            n = flat.numel()
            torch.arange(i * n, (i + 1) * n, dtype=torch.int64, out=flat)
        else:
            t.zero_()
    return layers


def chunk_rows(t: torch.Tensor, w: Workload) -> torch.Tensor:
    """A layer as ``[PLANES, cache_blocks, chunk_bytes / 8]`` int64 rows."""
    return t.view(torch.int64).view(PLANES, w.cache_blocks, w.chunk_bytes // 8)


def verify(layers: list[torch.Tensor], w: Workload) -> bool:
    """True if every destination block holds its source block's bytes, bit for bit."""
    src = torch.tensor(w.src_ids, dtype=torch.int64)
    dst = torch.tensor(w.dst_ids, dtype=torch.int64)
    row = w.chunk_bytes // 8
    n = w.layer_cache_bytes // 8
    ar = torch.arange(row, dtype=torch.int64)
    for layer, t in enumerate(layers):
        rows = chunk_rows(t, w)
        for p in range(PLANES):
            want = (layer * n + (p * w.cache_blocks + src) * row)[:, None] + ar[None, :]
            if not torch.equal(rows[p].index_select(0, dst), want):
                return False
    return True
