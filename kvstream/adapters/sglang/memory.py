"""SGLang's buffers, as ``KVArgs`` describes them (raw pointers), as kvstream sees them.

SGLang hands a backend ``(ptr, total_len, item_len)`` per buffer: MHA pools one K buffer
per layer, then one V buffer per layer (``2 * L``), MLA pools one per layer, an item one
page of ``page_size`` tokens (``memory_pool.get_contiguous_buf_infos``); the aux
(metadata) buffers are host tensors with one row per request. A backend is told the heads
a rank holds (``kv_head_num``, MHA) but not the dtype, so a page is described by its
bytes: a token's row of one buffer is ``item_len / page_size`` bytes, ``kv_head_num``
"heads" of ``uint8`` (``kvs_layout``). Equal pools on both sides move verbatim; a decode
of another TP degree takes its heads through kvstream's transfer plans, byte for byte
(the two sides' dtypes are checked to agree: ``notes.Want.kv_dtype``); any other pair
has another fingerprint or head size: refused before a byte moves, never misread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from kvstream._exceptions import AdapterError
from kvstream.layout import KVLayout

__all__ = ["AuxRows", "DeviceBuffer", "kv_buffers", "kvs_layout", "wrap"]


class DeviceBuffer:
    """``nbytes`` of device memory at ``ptr``, described by the CUDA array interface (what
    ``torch.as_tensor`` wraps without a copy, no cupy needed); not owned."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "strides": None, "version": 3}


def wrap(ptr: int, nbytes: int, device: str, gpu_id: int = 0) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``ptr`` (not owned: SGLang keeps the memory)."""
    if not isinstance(ptr, int) or not isinstance(nbytes, int) or ptr <= 0 or nbytes <= 0:
        raise AdapterError(f"bad buffer: pointer {ptr!r}, {nbytes!r} bytes")
    if device == "cpu":
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return torch.frombuffer(raw, dtype=torch.uint8, count=nbytes)
    return torch.as_tensor(DeviceBuffer(ptr, nbytes), device=f"cuda:{gpu_id}")


def kvs_layout(lens: Sequence[int], item_lens: Sequence[int], page_size: int,
               mla: bool, heads: int = 1) -> tuple[KVLayout, int]:
    """The layout of SGLang's KV buffers (MHA: ``heads`` per token row) and how many pages
    each holds."""
    n = len(lens)
    if n == 0 or len(item_lens) != n or (not mla and n % 2):
        raise AdapterError(f"{n} KV buffers ({'MLA' if mla else 'MHA: K and V per layer'})")
    if len(set(item_lens)) != 1:
        raise AdapterError(f"KV buffers with pages of {sorted(set(item_lens))} bytes (K and V "
                           "of other sizes, or layers that differ) are not supported yet")
    item = item_lens[0]
    if page_size < 1 or item % page_size:
        raise AdapterError(f"a page of {item} bytes does not hold {page_size} token rows")
    pages = {ln // item for ln in lens}
    if len(pages) != 1 or any(ln % item for ln in lens):
        raise AdapterError(f"KV buffers of {sorted(set(lens))} bytes are not whole pages of "
                           f"{item}")
    row = item // page_size
    heads = 1 if mla else heads
    if heads < 1 or row % heads:
        raise AdapterError(f"a token row of {row} bytes does not hold {heads} KV heads")
    layers = n if mla else n // 2
    layout = KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=row // heads,
                      block_size=page_size, dtype="uint8",
                      arrangement="mla" if mla else "split_nhd")
    return layout, pages.pop()


def kv_buffers(ptrs: Sequence[int], lens: Sequence[int], layout: KVLayout, pages: int,
               device: str, gpu_id: int = 0) -> list[torch.Tensor]:
    """The buffers as the layout's tensors (``register_kv``'s order: SGLang's)."""
    shape = layout.tensor_shape(pages)
    return [wrap(p, ln, device, gpu_id).view(shape) for p, ln in zip(ptrs, lens, strict=True)]


class AuxRows:
    """SGLang's metadata buffers (host memory): read one request's row of each, write one.

    The decode side treats a non-zero ``bootstrap_room`` in its row as "the aux row has
    landed", so ``write`` puts the room last: the rows of every other buffer, then the rest
    of the room buffer's row (the buffer whose row starts with the room, as a uint64),
    then the room itself."""

    def __init__(self, ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int]) -> None:
        if not len(ptrs) == len(lens) == len(item_lens):
            raise AdapterError("aux buffers: pointers, lengths and row sizes disagree")
        for p, ln, it in zip(ptrs, lens, item_lens, strict=True):
            if p <= 0 or it <= 0 or ln < it:
                raise AdapterError(f"bad aux buffer: pointer {p}, {ln} bytes, rows of {it}")
        self.bufs = list(zip(ptrs, lens, item_lens, strict=True))

    @property
    def row_bytes(self) -> list[int]:
        return [it for _, _, it in self.bufs]

    def _at(self, k: int, row: int) -> int:
        p, ln, it = self.bufs[k]
        if not isinstance(row, int) or row < 0 or (row + 1) * it > ln:
            raise AdapterError(f"aux row {row!r} outside a buffer of {ln // it} rows")
        return p + row * it

    def read(self, row: int) -> list[bytes]:
        return [ctypes.string_at(self._at(k, row), it) for k, (_, _, it) in enumerate(self.bufs)]

    def write(self, row: int, data: Sequence[Any], room: int) -> None:
        if len(data) != len(self.bufs) or any(
                not isinstance(d, bytes) or len(d) != it
                for d, (_, _, it) in zip(data, self.bufs, strict=True)):
            raise AdapterError(f"an aux row of {[len(d) for d in data]} bytes for buffers of "
                               f"{self.row_bytes}")
        addrs = [self._at(k, row) for k in range(len(self.bufs))]  # all checked first
        tag = int(room).to_bytes(8, "little")
        rooms = [k for k, d in enumerate(data) if d[:8] == tag]
        if not rooms:
            raise AdapterError(f"no aux buffer row starts with the room {room}")
        for k, (addr, d) in enumerate(zip(addrs, data, strict=True)):
            if k not in rooms:
                ctypes.memmove(addr, d, len(d))
        for k in rooms:
            ctypes.memmove(addrs[k] + 8, data[k][8:], len(data[k]) - 8)
        for k in rooms:
            ctypes.memmove(addrs[k], data[k], 8)
