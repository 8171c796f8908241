"""Device KV shared with a sidecar through CUDA IPC handles, without pickle on the socket.

The fields are exactly what ``torch.multiprocessing`` exchanges for a CUDA tensor
(``storage._share_cuda_()`` plus the tensor's geometry), carried as a msgspec struct;
the sidecar rebuilds a tensor over the same device memory, so it sends straight from
GPU memory (UCX's CUDA transports) and the engine keeps ownership.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvstream._exceptions import LayoutError

if TYPE_CHECKING:
    import torch

__all__ = ["CudaTensorHandle", "export_cuda", "import_cuda"]


class CudaTensorHandle(msgspec.Struct, frozen=True, kw_only=True):
    size: list[int]
    stride: list[int]
    offset: int
    dtype: str
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None = None
    event_sync_required: bool = False


def export_cuda(tensor: torch.Tensor) -> CudaTensorHandle:
    """IPC handle for a CUDA tensor (the engine keeps the tensor alive while shared)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise LayoutError("only CUDA tensors are shared through IPC handles")
    _, args = reduce_tensor(tensor.detach())
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, size_bytes, offset_bytes,
     _grad, ref_handle, ref_offset, event_handle, event_sync) = args
    return CudaTensorHandle(
        size=list(size), stride=list(stride), offset=int(offset),
        dtype=str(dtype).removeprefix("torch."), device=int(device), handle=bytes(handle),
        storage_size_bytes=int(size_bytes), storage_offset_bytes=int(offset_bytes),
        ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle) if event_handle is not None else None,
        event_sync_required=bool(event_sync))


def import_cuda(h: CudaTensorHandle) -> torch.Tensor:
    """The same device memory, seen from this process."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise LayoutError("CUDA IPC handles need a CUDA device in the sidecar's process")
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(h.size), tuple(h.stride), h.offset, torch.storage.TypedStorage,
        getattr(torch, h.dtype), h.device, h.handle, h.storage_size_bytes,
        h.storage_offset_bytes, False, h.ref_counter_handle, h.ref_counter_offset,
        h.event_handle, h.event_sync_required)
