"""The batched matrix transpose (csrc/transpose.c) for the reshape of vLLM CPU blocks.

vLLM's CPU attention keeps, per block and head, K as ``[head_dim, block_size]``; the wire
has it ``[tokens, heads, head_dim]``. torch copies that transposed view one strided element
at a time; the C kernel moves SSE2 tiles. ``k_blocks`` moves the full blocks' K of one
layer between a contiguous ``cpu_hnbc`` cache tensor and a contiguous wire slice, either
way, or returns False where it cannot (another device, a non-contiguous tensor, no C
compiler: the caller's torch path then runs). Every item is bounds-checked in C before a
byte is written.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from typing import TYPE_CHECKING

import numpy as np

from kvstream import native
from kvstream._exceptions import LayoutError

if TYPE_CHECKING:
    from pathlib import Path

    import torch

__all__ = ["k_blocks", "load"]

log = logging.getLogger("kvstream.transfer")

_I64 = ctypes.c_int64
_P = ctypes.c_void_p


class _Lib:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self.fn = lib.kvs_transpose_items
        self.fn.restype = _I64
        self.fn.argtypes = [_P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64]


def _make() -> _Lib:
    src = native.csrc_path("transpose.c")
    if not src.exists():
        raise LayoutError(f"{src} not found (kvstream installed without csrc/)")
    flags = ["-O3", "-shared", "-fPIC",
             *(["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])]
    return _Lib(native.build(src, flags, error=LayoutError, what="the transpose kernel"))


_load = native.Once(_make, (LayoutError, OSError, AttributeError),
                    "C transpose unavailable, reshaping vLLM CPU blocks with torch: %s", log)


def load() -> _Lib | None:
    return _load()


def k_blocks(cache: torch.Tensor, wire_k: torch.Tensor, ids: torch.Tensor, *,
             num_heads: int, head: int, block_size: int, head_dim: int,
             to_wire: bool) -> bool:
    """Move K of blocks ``ids`` (full blocks, in the request's order), heads ``[head, head
    + n)`` of a ``cpu_hnbc`` cache ``[nb, num_heads, bs, 2 * d]``, from (``to_wire``) or
    into ``wire_k``, ``[len(ids) * bs, n, d]``, both contiguous and of one dtype. False:
    not done (the caller moves it)."""
    if cache.device.type != "cpu" or wire_k.device != cache.device or \
            cache.dtype != wire_k.dtype or not cache.is_contiguous() or \
            not wire_k.is_contiguous() or wire_k.dim() != 3:
        return False
    lib = load()
    if lib is None:
        return False
    nblk, n, bs, d = len(ids), wire_k.shape[1], block_size, head_dim
    if wire_k.shape != (nblk * bs, n, d) or not 0 <= head <= head + n <= num_heads:
        raise LayoutError(f"a K wire of {tuple(wire_k.shape)} for {nblk} blocks of {bs}, heads "
                          f"from {head} of {num_heads}")
    esize = cache.element_size()
    block_ids = ids.numpy().astype(np.int64)[:, None]
    heads = np.arange(n, dtype=np.int64)[None, :]
    # Each (block, head) of the cache: its K run [d, bs]; of the wire: [bs, d], rows n * d apart.
    cache_off = (((block_ids * num_heads + head + heads) * 2) * d * bs * esize).reshape(-1)
    wire_off = ((np.arange(nblk, dtype=np.int64)[:, None] * bs * n + heads) * d
                * esize).reshape(-1)
    if to_wire:  # [d, bs] rows bs apart -> [bs, d] rows n * d apart
        dst, dst_off, src, src_off = wire_k, wire_off, cache, cache_off
        rows, cols, src_stride, dst_stride = d, bs, bs, n * d
    else:
        dst, dst_off, src, src_off = cache, cache_off, wire_k, wire_off
        rows, cols, src_stride, dst_stride = bs, d, n * d, bs
    rc = lib.fn(dst.data_ptr(), dst.numel() * esize, dst_off.ctypes.data, src.data_ptr(),
                src.numel() * esize, src_off.ctypes.data, len(dst_off), rows, cols,
                src_stride, dst_stride, esize)
    if rc:
        raise LayoutError(f"kvs_transpose_items refused the batch (code {rc})")
    return True
