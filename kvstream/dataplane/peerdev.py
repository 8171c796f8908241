"""Same-host peers' device KV, opened through CUDA IPC: what the ``cuda_ipc`` path reads.

The GPU twin of ``peermem``: the destination opens the handles of the source's
``DeviceExport`` (``kvstream.cuda_ipc``), checks that every layer's handle spans exactly the
source's blocks, and copies the source's blocks of a layer straight into its own with
``CudaBlockCopy`` (one launch per layer, NVLink or the GPU's own memory: one copy, no
staging). Each copy is waited for before the layer counts, so when the receiver says it
is quiet nothing of the source's is read any more. Openings are shared by the transfers
of one export, counted, bounded, and closed once the peer is gone and nothing reads them.
``opener`` and ``copier`` are the seams unit tests replace (no GPU needed there).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from kvstream import cuda_ipc
from kvstream._exceptions import KVStreamError, LayoutError
from kvstream.cuda_ipc import DeviceExport, IpcHandle, IpcMapping
from kvstream.dataplane.peermem import MapCache, Mapped

__all__ = ["PeerDevKV", "PeerDevMaps"]

MAX_OPENED_BYTES: Final = 1 << 44  # address space: the memory is the peer's

# (dst_ptr, dst_size, dst_off, src_ptr, src_size, src_off, nbytes, device): one batched
# copy on that device, finished when it returns.
Copier = Callable[[int, int, np.ndarray, int, int, np.ndarray, int, int], None]
# (handle, the device whose kernels will read it) -> the mapping
Opener = Callable[[IpcHandle, int], IpcMapping]

_kernels: dict[int, tuple[Any, Any]] = {}  # device -> (CudaBlockCopy, its stream)
_closer: concurrent.futures.ThreadPoolExecutor | None = None


def cuda_copy(dst_ptr: int, dst_size: int, dst_off: np.ndarray, src_ptr: int, src_size: int,
              src_off: np.ndarray, nbytes: int, device: int) -> None:
    """``CudaBlockCopy`` on a stream of our own on ``device``, waited for (a copy thread).
    Non-blocking: the legacy default stream would wait for the engine's queued kernels
    and hold them up in turn."""
    import cupy

    from kvstream.dataplane.blockcopy import CudaBlockCopy

    with cupy.cuda.Device(device):
        made = _kernels.get(device)
        if made is None:
            made = _kernels[device] = (CudaBlockCopy(), cupy.cuda.Stream(non_blocking=True))
        kernel, stream = made
        kernel.copy(dst_ptr, dst_size, dst_off, src_ptr, src_size, src_off, nbytes,
                    stream=stream, wait=True)


class PeerDevKV(Mapped):
    """One peer's registered device KV, its layers' handles opened here."""

    def __init__(self, export: DeviceExport, layer_bytes: int, maps: list[IpcMapping],
                 copier: Copier) -> None:
        super().__init__(export, layer_bytes)
        self._maps = maps
        self._copier = copier
        self.device = maps[0].device

    @property
    def nbytes(self) -> int:
        return sum(mm.size for mm in self._maps)

    def layer(self, i: int) -> int:
        return self._maps[i].ptr

    def copy(self, layer: int, src_off: np.ndarray, dst_ptr: int, dst_size: int,
             dst_off: np.ndarray, nbytes: int) -> None:
        self._copier(dst_ptr, dst_size, dst_off, self.layer(layer), self.layer_bytes, src_off,
                     nbytes, self.device)

    def close(self) -> None:
        maps, self._maps = self._maps, []
        for mm in maps:
            with contextlib.suppress(KVStreamError):
                mm.close()


class PeerDevMaps(MapCache[PeerDevKV]):
    """Same-host peers' device KV, opened through CUDA IPC."""

    def __init__(self, max_bytes: int = MAX_OPENED_BYTES, max_peers: int = 256, *,
                 opener: Opener = cuda_ipc.open_handle, copier: Copier = cuda_copy,
                 background_close: bool = True) -> None:
        super().__init__(max_bytes, max_peers)
        self._opener = opener
        self._copier = copier
        self._background = background_close
        self.device = 0  # ours: the GPU of our KV, whose kernels read the peers' memory

    def use_device(self, device: int) -> None:
        """Our KV moved to ``device``: what was opened for the old one goes."""
        if device != self.device:
            self.drop()
            self.device = device

    def _dispose(self, kv: PeerDevKV) -> None:
        """``cudaIpcCloseMemHandle`` may wait for the device: never on the event loop
        (releases run there), one closer thread in order."""
        global _closer
        if not self._background:
            kv.close()
            return
        if _closer is None:
            _closer = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvstream-ipc-close")
        _closer.submit(kv.close)

    def _check(self, export: DeviceExport, layer_bytes: int, num_layers: int) -> None:
        bad = [i for i, h in enumerate(export.layers) if h.size != layer_bytes]
        if bad:  # layer_bytes: the export's blocks in this transfer's layout
            raise LayoutError(f"the peer's device KV names layers {bad[:8]} of another size "
                              f"than {layer_bytes} bytes")
        devices = {(h.device_uuid, h.device) for h in export.layers}
        if len(devices) != 1:
            raise LayoutError("the peer's device KV spans several GPUs")
        for h in export.layers:
            cuda_ipc.check_handle(h)

    def _size(self, export: DeviceExport) -> int:
        return sum(h.size for h in export.layers)

    def _open(self, export: DeviceExport, layer_bytes: int) -> PeerDevKV:
        maps: list[IpcMapping] = []
        try:
            for h in export.layers:
                maps.append(self._opener(h, self.device))
        except BaseException:
            for mm in maps:
                with contextlib.suppress(KVStreamError):
                    mm.close()
            raise
        return PeerDevKV(export, layer_bytes, maps, self._copier)

    def acquire(self, export: DeviceExport, layer_bytes: int, num_layers: int) -> PeerDevKV:
        """The peer's layers opened (blocking: run it off the event loop), counted as used
        until ``release``. ``LayoutError`` for an export that does not hold ``num_layers``
        layers of ``layer_bytes`` on one GPU; ``ProtocolError`` / ``DataPlaneError`` when a
        handle is malformed or CUDA refuses it."""
        return self._acquire(export, layer_bytes, num_layers)
