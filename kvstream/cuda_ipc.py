"""CUDA IPC: device memory one process shares with another on the same host.

Two users, one mechanism (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``):

* **Peers' KV (issue 17's same-host GPU path).** The source of a transfer exports where its
  device KV lies (``DeviceExport``: one ``IpcHandle`` per layer), the destination maps it and
  copies blocks out with ``CudaBlockCopy`` (one copy; ``kvstream.dataplane.peerdev``).
* **The sidecar.** ``CudaTensorHandle`` carries exactly what ``torch.multiprocessing``
  exchanges for a CUDA tensor (``storage._share_cuda_()`` plus the tensor's geometry) as a
  msgspec struct, without pickle on the socket; the sidecar rebuilds a tensor over the same
  memory, so it sends straight from GPU memory and the engine keeps ownership.

``cudaIpcGetMemHandle`` names a whole allocation: one ``cudaMalloc``, or one segment of
torch's caching allocator, which may hold many tensors; the peer's ``cudaIpcOpenMemHandle``
maps that allocation's base. So an ``IpcHandle`` carries the base's handle, where the exported
memory lies in the allocation (``offset``, ``size``), the allocation's size, and the device's
ordinal and UUID (ordinals differ between processes with other ``CUDA_VISIBLE_DEVICES``).
The opener checks every field, maps the allocation lazily enabling peer access, and checks
that the mapping is as large as the handle claims before handing out a pointer.

The exporter keeps the memory allocated while any peer has it open (torch's caching allocator
may otherwise hand the same bytes to another tensor). A handle is opened in another process
than the one that exported it (CUDA refuses the exporter's own), and opening one handle
twice in a process maps it once (counted; the last ``close`` unmaps). Memory from torch's
``expandable_segments`` allocator or ``cudaMallocAsync`` pools cannot be exported this way.

cupy (``pip install 'kvstream[cu12]' or '[cu13]'``) is imported on first use; the allocation's range
comes from the driver's ``cuMemGetAddressRange``, which cupy does not wrap (ctypes).

Evolution of ``IpcHandle`` (a wire type): new fields get defaults and go last, no type
changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import threading
from typing import TYPE_CHECKING, Annotated, Any, Final

import msgspec

from kvstream._exceptions import ConfigError, DataPlaneError, LayoutError, ProtocolError

if TYPE_CHECKING:
    import torch

__all__ = ["HANDLE_BYTES", "CudaTensorHandle", "DeviceExport", "DeviceOffer", "IpcHandle",
           "IpcMapping",
           "can_read", "check_handle", "export_cuda", "export_memory", "export_tensor",
           "import_cuda", "local_device", "open_handle", "visible_gpus"]

HANDLE_BYTES: Final = 64  # sizeof(cudaIpcMemHandle_t)
UUID_BYTES: Final = 16
_LAZY_ENABLE_PEER_ACCESS: Final = 1  # cudaIpcMemLazyEnablePeerAccess
_MEMORY_TYPE_DEVICE: Final = 2  # cudaMemoryTypeDevice

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class IpcHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Device memory another process can map: the allocation's IPC handle and where the
    exported bytes lie in it."""

    # cudaIpcMemHandle_t of the allocation's base, HANDLE_BYTES long
    handle: Annotated[bytes, msgspec.Meta(max_length=HANDLE_BYTES)]
    offset: _NonNegative  # the exported bytes start this far from the allocation's base
    size: _NonNegative  # the exported bytes
    alloc_size: _NonNegative  # the whole allocation (cuMemGetAddressRange)
    device: _NonNegative  # the exporter's device ordinal (used only without a UUID)
    device_uuid: Annotated[bytes, msgspec.Meta(max_length=UUID_BYTES)] = b""  # the GPU's UUID


class DeviceExport(msgspec.Struct, frozen=True, kw_only=True):
    """A process's registered device KV, for a same-host peer to map: layer i is
    ``layers[i]`` (``num_blocks`` blocks of the layout's block size). A capability (whoever
    opens a handle can read and write that memory, as with UCX's cuda_ipc rkeys): sent in
    the manifest of one transfer to its destination only, never announced."""

    pid: Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
    layers: Annotated[list[IpcHandle], msgspec.Meta(max_length=4096)]
    epoch: Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)] = 0  # new at each registration

    @property
    def offer(self) -> DeviceOffer:
        return DeviceOffer(pid=self.pid, epoch=self.epoch,
                           gpu=self.layers[0].device_uuid if self.layers else b"")


class DeviceOffer(msgspec.Struct, frozen=True, kw_only=True):
    """What an agent announces of its ``DeviceExport`` (not a capability): whose it is,
    which registration (a new epoch: peers close what they opened of the old), which GPU
    (a peer that cannot see it, or reach it from its own, does not try)."""

    pid: Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
    epoch: Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)] = 0
    gpu: Annotated[bytes, msgspec.Meta(max_length=UUID_BYTES)] = b""


def check_handle(h: IpcHandle) -> None:
    """Raises ``ProtocolError`` for a handle no exporter makes: wrong lengths, the exported
    span outside the allocation, an empty allocation."""
    problems = []
    if len(h.handle) != HANDLE_BYTES:
        problems.append(f"a {len(h.handle)}-byte handle (CUDA's are {HANDLE_BYTES})")
    if h.device_uuid and len(h.device_uuid) != UUID_BYTES:
        problems.append(f"a {len(h.device_uuid)}-byte device UUID")
    if min(h.offset, h.size, h.device) < 0 or h.alloc_size <= 0:
        problems.append("negative fields or an empty allocation")
    elif h.offset + h.size > h.alloc_size:
        problems.append(f"bytes [{h.offset}, {h.offset + h.size}) outside an allocation of "
                        f"{h.alloc_size}")
    if problems:
        raise ProtocolError("malformed CUDA IPC handle: " + "; ".join(problems))


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise ConfigError("CUDA IPC needs cupy: pip install 'kvstream[cu12]' or '[cu13]'") from exc
    return cupy


_libcuda: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _libcuda
    if _libcuda is None:
        try:
            _libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DataPlaneError(f"the CUDA driver library is not loadable: {exc}") from exc
    return _libcuda


def _address_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the allocation holding device pointer ``ptr`` (current context)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                           ctypes.c_uint64(ptr))
    if rc:
        raise DataPlaneError(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {rc}")
    return int(base.value), int(size.value)


def uuid_of(raw: ctypes.Array[ctypes.c_ubyte]) -> bytes:
    """A ``CUuuid``'s 16 bytes, zero bytes included (cupy's ``getDeviceProperties()['uuid']``
    cuts a ``char[16]`` at its first zero byte: about one GPU in 16 then had no UUID, so no
    CUDA IPC)."""
    out = bytes(raw)
    if len(out) != UUID_BYTES:
        raise DataPlaneError(f"a CUDA UUID has {UUID_BYTES} bytes, not {len(out)}")
    return out


def _uuid(device: int) -> bytes:
    """The UUID of CUDA device ``device`` (runtime ordinal), from the driver."""
    lib = _driver()
    handle = ctypes.c_int()
    raw = (ctypes.c_ubyte * UUID_BYTES)()
    get = getattr(lib, "cuDeviceGetUuid_v2", None) or getattr(lib, "cuDeviceGetUuid", None)
    if get is None or lib.cuInit(0) or \
            lib.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device)) or get(raw, handle):
        return b""
    return uuid_of(raw)


def export_memory(ptr: int, size: int) -> IpcHandle:
    """The handle of ``size`` bytes of device memory at ``ptr``. Raises ``LayoutError`` when
    that is not plain device memory of one allocation, ``DataPlaneError`` when CUDA refuses."""
    cupy = _cupy()
    rt = cupy.cuda.runtime
    if size < 0:
        raise LayoutError(f"cannot export {size} bytes")
    try:
        attrs = rt.pointerGetAttributes(ptr)
    except rt.CUDARuntimeError as exc:
        raise LayoutError(f"{ptr:#x} is not CUDA memory: {exc}") from exc
    if getattr(attrs, "type", _MEMORY_TYPE_DEVICE) != _MEMORY_TYPE_DEVICE:
        raise LayoutError(f"{ptr:#x} is not device memory (CUDA memory type {attrs.type})")
    device = int(attrs.device)
    with cupy.cuda.Device(device):
        rt.free(0)  # makes the device's primary context current for the driver call below
        base, alloc_size = _address_range(ptr)
        if ptr + size > base + alloc_size:
            raise LayoutError(f"{size} bytes at {ptr:#x} run past their allocation "
                              f"({alloc_size} bytes at {base:#x})")
        try:
            handle = rt.ipcGetMemHandle(base)
        except rt.CUDARuntimeError as exc:
            raise DataPlaneError(f"cudaIpcGetMemHandle refused the allocation at {base:#x} (torch's "
                                 f"expandable segments and async pools have none): {exc}") from exc
        uuid = _uuid(device)
    return IpcHandle(handle=bytes(handle), offset=ptr - base, size=size, alloc_size=alloc_size,
                     device=device, device_uuid=uuid)


def _span(obj: Any) -> tuple[int, int]:
    """(pointer, bytes) of a contiguous CUDA tensor: torch's, or any ``__cuda_array_interface__``."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_cuda"):  # torch, without importing it
        if not obj.is_cuda or not obj.is_contiguous():
            raise LayoutError("only contiguous CUDA tensors are exported through CUDA IPC")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        raise LayoutError(f"not a CUDA array: {type(obj).__name__}")
    shape, itemsize = tuple(cai["shape"]), int(cai["typestr"][2:])
    strides = cai.get("strides")
    if strides is not None:
        want = [itemsize * math.prod(shape[i + 1:]) for i in range(len(shape))]
        if any(n > 1 and s != w for n, s, w in zip(shape, strides, want, strict=True)):
            raise LayoutError("only contiguous CUDA arrays are exported through CUDA IPC")
    return int(cai["data"][0]), itemsize * math.prod(shape)


def export_tensor(tensor: Any) -> IpcHandle:
    """The handle of a contiguous CUDA tensor's bytes (torch, cupy, anything with
    ``__cuda_array_interface__``), which may share its allocation with others."""
    ptr, size = _span(tensor)
    return export_memory(ptr, size)


class IpcMapping:
    """A peer's memory mapped here: ``ptr`` (the exported bytes' start), ``size``, ``device``
    (this process's ordinal of that GPU). ``close()`` (or leaving the ``with``) unmaps it."""

    def __init__(self, key: tuple[int, bytes], base: int, h: IpcHandle, device: int) -> None:
        self._key: tuple[int, bytes] | None = key
        self.base, self.ptr, self.size, self.device = base, base + h.offset, h.size, device

    def close(self) -> None:
        key, self._key = self._key, None
        if key is not None:
            _release(key)

    @property
    def closed(self) -> bool:
        return self._key is None

    def __enter__(self) -> IpcMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.size} bytes at {self.ptr:#x}"
        return f"<IpcMapping on device {self.device}: {state}>"


_open_lock = threading.Lock()
# (device, handle) -> [base, mappings open, bytes the driver says it maps]
_opened: dict[tuple[int, bytes], list[int]] = {}


_gpus: list[bytes] | None = None  # this process's GPUs' UUIDs, by ordinal (asked once)


def visible_gpus() -> list[bytes]:
    """The UUIDs of the GPUs this process sees, by ordinal ([] without cupy or CUDA)."""
    global _gpus
    if _gpus is None:
        try:
            cupy = _cupy()
            _gpus = [_uuid(d) for d in range(int(cupy.cuda.runtime.getDeviceCount()))]
        except Exception:  # no cupy, no driver, no device: nothing is opened here
            _gpus = []
    return _gpus


def local_device(h: IpcHandle) -> int:
    """This process's ordinal of the exporter's GPU; ``DataPlaneError`` if not visible."""
    gpus = visible_gpus()
    if h.device_uuid:
        if h.device_uuid in gpus:
            return gpus.index(h.device_uuid)
        raise DataPlaneError(f"the exporter's GPU {h.device_uuid.hex()} is not visible here")
    if h.device >= len(gpus):
        raise DataPlaneError(f"the exporter's device {h.device} is not visible here "
                             f"({len(gpus)} GPUs)")
    return h.device


def can_read(device: int, peer_device: int) -> bool:
    """Can kernels on ``device`` read memory of ``peer_device`` (the same GPU, or P2P)?"""
    if device == peer_device:
        return True
    try:
        return bool(_cupy().cuda.runtime.deviceCanAccessPeer(device, peer_device))
    except Exception:
        return False


def open_handle(h: IpcHandle, device: int | None = None) -> IpcMapping:
    """Map a peer's exported memory into this process, for kernels on ``device`` (this
    process's ordinal; None: the exporter's GPU itself). Another GPU than the exporter's
    reaches it over NVLink or PCIe: CUDA enables peer access as the mapping is made
    (``cudaIpcMemLazyEnablePeerAccess``). Raises ``ProtocolError`` for a malformed handle
    (``check_handle``, or one whose mapping is smaller than it claims), ``DataPlaneError``
    when the GPU is not visible or CUDA refuses."""
    check_handle(h)
    cupy = _cupy()
    rt = cupy.cuda.runtime
    exporter = local_device(h)  # visible here, or DataPlaneError
    device = exporter if device is None else device
    key = (device, h.handle)
    with _open_lock, cupy.cuda.Device(device):
        entry = _opened.get(key)
        if entry is None:
            try:
                base = int(rt.ipcOpenMemHandle(h.handle, _LAZY_ENABLE_PEER_ACCESS))
            except rt.CUDARuntimeError as exc:
                raise DataPlaneError(f"cudaIpcOpenMemHandle failed (the exporter gone, or this is "
                                     f"its own process?): {exc}") from exc
            try:
                real_base, real_size = _address_range(base)
            except DataPlaneError:
                with contextlib.suppress(Exception):
                    rt.ipcCloseMemHandle(base)
                raise
            if real_base != base:
                real_size = 0  # not the start of an allocation: nothing the handle may claim
            entry = _opened[key] = [base, 0, real_size]
        if h.offset + h.size > entry[2]:
            if not entry[1]:
                del _opened[key]
                with contextlib.suppress(Exception):
                    rt.ipcCloseMemHandle(entry[0])
            raise ProtocolError(f"CUDA IPC handle claims bytes [{h.offset}, {h.offset + h.size}) "
                                f"of an allocation that maps {entry[2]} bytes")
        entry[1] += 1
    return IpcMapping(key, entry[0], h, device)


def _release(key: tuple[int, bytes]) -> None:
    cupy = _cupy()
    with _open_lock:
        entry = _opened[key]
        entry[1] -= 1
        if entry[1]:
            return
        del _opened[key]
        try:
            with cupy.cuda.Device(key[0]):
                cupy.cuda.runtime.ipcCloseMemHandle(entry[0])
        except Exception as exc:  # cupy's runtime errors share no kvstream base
            raise DataPlaneError(f"cudaIpcCloseMemHandle failed: {exc}") from exc


# ---- the sidecar: torch's own IPC exchange, as a msgspec struct ----


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
