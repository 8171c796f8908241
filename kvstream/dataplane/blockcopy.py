"""The batched block copy (issue 17): n equal-size items from scattered source offsets to
scattered destination offsets, in one call (CPU) or one kernel launch (GPU).

The same-host "one copy" path maps the source's KV memory (host: shared memory mapped
read-only; GPU: CUDA IPC, ``kvstream.cuda_ipc``) and copies the blocks of a
layer straight from the source's rows into the destination's: one copy, no staging.
``layer_items`` turns block ids into the items' byte offsets; ``copy_blocks`` copies on the
CPU (csrc/blockcopy.c); ``CudaBlockCopy`` launches csrc/blockcopy.cu.

Every item is checked against both buffers before any byte moves (here with numpy, and
again in C and in the kernel): one out of bounds raises ``InvalidBlockError`` naming the
items, and nothing is written. The C library is built on first use (``kvstream.native``,
``-O3 -march=native`` on x86-64) and called through ctypes, which releases the GIL, so a
caller may split a batch across its own threads. Without a C compiler (the sources ship
in the package, ``kvstream/csrc/``) the copy falls back to one ``ctypes.memmove`` per item, with
a warning once. cupy (``pip install 'kvstream[cu12]' or '[cu13]'``) is imported only by ``CudaBlockCopy``.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from kvstream import native
from kvstream._exceptions import ConfigError, DataPlaneError, InvalidBlockError

__all__ = ["STRATEGIES", "CpuBlockCopy", "CudaBlockCopy", "check_items", "copy_blocks",
           "cuda_source_path", "layer_items", "load", "source_path"]

log = logging.getLogger("kvstream.dataplane")

# kvs_copy_blocks_with's strategies (blockcopy.c); "python" is the ctypes.memmove fallback.
STRATEGIES: Final = {"auto": 0, "memcpy": 1, "stream": 2, "python": -1}
# blockcopy.cu: its __launch_bounds__, and the bytes of an item one thread moves per tile.
MAX_THREADS: Final = 256
TILE_PER_THREAD: Final = 64
_MAX_GRID: Final = 2 ** 31 - 1
_ARGS: list[Any] = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]



def source_path() -> Path:
    return native.csrc_path("blockcopy.c")


def cuda_source_path() -> Path:
    return native.csrc_path("blockcopy.cu")


def _offsets(off: Any, what: str) -> np.ndarray:
    arr = np.ascontiguousarray(off, dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidBlockError(f"{what} offsets must be one-dimensional, got shape {arr.shape}")
    return arr


_FEW = 64  # offsets checked in Python below this many


def check_items(dst_size: int, dst_off: Any, src_size: int, src_off: Any,
                nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The offsets as contiguous int64 arrays, every item checked: ``0 <= off`` and
    ``off + nbytes <= size`` on both sides. Raises ``InvalidBlockError`` (its ``block_ids``
    are the bad items' indices, ``limit`` the size they overrun) before anything is copied."""
    d, s = _offsets(dst_off, "destination"), _offsets(src_off, "source")
    if len(d) != len(s):
        raise InvalidBlockError(f"{len(d)} destination offsets for {len(s)} source offsets")
    if nbytes < 0 or dst_size < 0 or src_size < 0:
        raise InvalidBlockError(f"negative item size or buffer size (nbytes {nbytes}, "
                                f"dst_size {dst_size}, src_size {src_size})")
    for off, size, side in ((d, dst_size, "destination"), (s, src_size, "source")):
        # min/max first: the common, valid batch costs two reductions and no temporaries
        # (in Python for a few items, where numpy's per-call cost is the larger one).
        if len(off) <= _FEW:
            items = off.tolist()
            low, high = (min(items), max(items)) if items else (0, 0)
        else:
            low, high = int(off.min()), int(off.max())
        if len(off) and (low < 0 or high > size - nbytes):
            bad = np.flatnonzero((off < 0) | (off > size - nbytes))
            raise InvalidBlockError(
                f"{len(bad)} items of {nbytes} bytes outside the {side} buffer of {size} bytes "
                f"(items {bad[:8].tolist()}{'...' if len(bad) > 8 else ''}, offsets "
                f"{off[bad[:8]].tolist()})", block_ids=bad[:64].tolist(), limit=size)
    return d, s


def _ids(ids: Sequence[int] | np.ndarray, num_blocks: int, side: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (len(arr) and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidBlockError(f"{side} block ids must be a flat list of integers")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero((arr < 0) | (arr >= num_blocks))
    if len(bad):
        raise InvalidBlockError(f"{side} block ids {arr[bad[:8]].tolist()} outside {num_blocks} "
                                "blocks", block_ids=arr[bad[:64]].tolist(), limit=num_blocks)
    return arr


def layer_items(planes: int, chunk_bytes: int, src_num_blocks: int, src_ids: Sequence[int] | np.ndarray,
                dst_num_blocks: int, dst_ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(src_off, dst_off)`` of one layer's copy, items of ``chunk_bytes``: a layer tensor is
    ``[planes, num_blocks, chunk]`` (``kvstream.memory``), each side with its own num_blocks,
    and block ``src_ids[j]`` of every plane goes to block ``dst_ids[j]`` of the same plane.
    Plane-major order (plane 0's blocks first). Raises ``InvalidBlockError`` for ids outside
    either side, lists of different lengths, or a destination id given twice."""
    if planes < 1 or chunk_bytes < 0 or src_num_blocks < 0 or dst_num_blocks < 0:
        raise InvalidBlockError(f"bad layer geometry: {planes} planes, chunks of {chunk_bytes} "
                                f"bytes, {src_num_blocks} / {dst_num_blocks} blocks")
    src, dst = _ids(src_ids, src_num_blocks, "source"), _ids(dst_ids, dst_num_blocks, "destination")
    if len(src) != len(dst):
        raise InvalidBlockError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    if len(np.unique(dst)) != len(dst):
        raise InvalidBlockError("duplicate destination block ids", block_ids=dst.tolist(),
                                limit=dst_num_blocks)
    plane = np.arange(planes, dtype=np.int64)[:, None]
    src_off = (plane * src_num_blocks + src[None, :]) * chunk_bytes
    dst_off = (plane * dst_num_blocks + dst[None, :]) * chunk_bytes
    return src_off.reshape(-1), dst_off.reshape(-1)


class CpuBlockCopy:
    """The built csrc/blockcopy.c (``load()`` gives the process's one)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self._with = lib.kvs_copy_blocks_with
        self._with.restype, self._with.argtypes = ctypes.c_int64, [*_ARGS, ctypes.c_int]
        lib.kvs_copy_blocks.restype, lib.kvs_copy_blocks.argtypes = ctypes.c_int64, _ARGS
        lib.kvs_copy_blocks_stream_threshold.restype = ctypes.c_int64
        self.vector_bytes = int(lib.kvs_copy_blocks_vector_bytes())
        self.stream_threshold = int(lib.kvs_copy_blocks_stream_threshold())
        self.path = path

    def copy(self, dst_ptr: int, dst_size: int, dst_off: np.ndarray, src_ptr: int, src_size: int,
             src_off: np.ndarray, nbytes: int, strategy: int = 0) -> int:
        """The C call on checked int64 offsets (``check_items``): 0, or its negative code."""
        return int(self._with(dst_ptr, dst_size, dst_off.ctypes.data, src_ptr, src_size,
                              src_off.ctypes.data, len(dst_off), nbytes, strategy))


def _flags() -> list[str]:
    # -march=native: AVX-512 streaming stores where the CPU has them (the key holds the CPU).
    native_flags = ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []
    return ["-O3", "-shared", "-fPIC", *native_flags]


def _make() -> CpuBlockCopy:
    src = source_path()
    if not src.exists():
        raise DataPlaneError(f"{src} not found (kvstream installed without csrc/)")
    return CpuBlockCopy(native.build(src, _flags(), error=DataPlaneError,
                                     what="the block copy kernel"))


_load = native.Once(_make, (DataPlaneError, OSError, AttributeError),
                    "C block copy unavailable, copying with ctypes.memmove: %s", log)


def load() -> CpuBlockCopy | None:
    """The C library, built once per process (None where it cannot be: ``copy_blocks`` then
    uses ``ctypes.memmove``)."""
    return _load()


def copy_blocks(dst_ptr: int, dst_size: int, dst_off: Any, src_ptr: int, src_size: int, src_off: Any,
                nbytes: int, *, strategy: str = "auto") -> None:
    """Copy item i, ``nbytes`` from ``src_ptr + src_off[i]``, to ``dst_ptr + dst_off[i]``, for
    every i, on this thread (the GIL released). The buffers are host memory of ``dst_size`` /
    ``src_size`` bytes (``t.data_ptr()``, ``t.nbytes`` of a CPU tensor) that must not overlap.
    ``strategy`` is for benchmarks (``STRATEGIES``; ``"auto"`` is the measured best). Raises
    ``InvalidBlockError`` when any item falls outside its buffer; nothing is then copied."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown block copy strategy {strategy!r} (one of {sorted(STRATEGIES)})")
    d, s = check_items(dst_size, dst_off, src_size, src_off, nbytes)
    if not len(d) or not nbytes:
        return
    lib = load() if strategy != "python" else None
    if lib is None:
        memmove = ctypes.memmove
        for do, so in zip(d.tolist(), s.tolist(), strict=True):
            memmove(dst_ptr + do, src_ptr + so, nbytes)
        return
    rc = lib.copy(dst_ptr, dst_size, d, src_ptr, src_size, s, nbytes, STRATEGIES[strategy])
    if rc:  # check_items has refused whatever the C checks refuse
        raise InvalidBlockError(f"kvs_copy_blocks refused the batch (code {rc})")


def _stream_handle(stream: Any) -> int | None:
    if stream is None or isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise ConfigError(f"not a CUDA stream: {stream!r} (an int handle, a torch or cupy stream)")


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise ConfigError("the CUDA block copy needs cupy: pip install 'kvstream[cu12]' or '[cu13]'") from exc
    return cupy


class CudaBlockCopy:
    """csrc/blockcopy.cu's ``kvs_copy_blocks`` on a GPU: one launch copies every item.

    ``module`` is a compiled module of blockcopy.cu (default: cupy's ``RawModule``, compiled
    by NVRTC on the current device; tests pass an emulation). ``threads`` is the CUDA block
    size (whole warps, at most ``MAX_THREADS``). Raises ``ConfigError`` without cupy and
    ``DataPlaneError`` when the kernel does not compile or load."""

    def __init__(self, module: Any = None, *, threads: int = MAX_THREADS) -> None:
        if not 32 <= threads <= MAX_THREADS or threads % 32:
            raise ConfigError(f"threads must be whole warps up to {MAX_THREADS}, got {threads}")
        if module is None:
            cupy = _cupy()
            try:
                module = cupy.RawModule(code=cuda_source_path().read_text())
            except OSError as exc:
                raise DataPlaneError(f"{cuda_source_path()} not found (installed without csrc/)") from exc
        try:
            # get_function compiles and loads: a broken kernel fails here, not mid-transfer.
            self._kernel = module.get_function("kvs_copy_blocks")
        except Exception as exc:  # cupy's compile, NVRTC and driver errors share no base class
            raise DataPlaneError(f"the CUDA block copy kernel did not load: {exc}") from exc
        self.threads = threads

    def grid(self, n: int, nbytes: int) -> int:
        """CUDA blocks of a launch: every tile of every item (capped; the kernel strides)."""
        tile = self.threads * TILE_PER_THREAD
        return min(n * max(1, -(-nbytes // tile)), _MAX_GRID)

    def copy(self, dst_ptr: int, dst_size: int, dst_off: Any, src_ptr: int, src_size: int,
             src_off: Any, nbytes: int, *, stream: Any = None, wait: bool = True) -> None:
        """Copy item i, ``nbytes`` from ``src_ptr + src_off[i]``, to ``dst_ptr + dst_off[i]``
        (device pointers of one GPU, the current device; the source may be a CUDA IPC
        mapping), in one launch on ``stream`` (an int handle, a torch or cupy stream; None:
        cupy's current stream). The offsets are host arrays: checked (``check_items``, which
        raises ``InvalidBlockError`` before anything is launched), then copied to the device
        on the same stream. ``wait`` (default) returns once the copy is done; without it the
        caller synchronizes the stream."""
        d, s = check_items(dst_size, dst_off, src_size, src_off, nbytes)
        n = len(d)
        if not n or not nbytes:  # a grid of 0 blocks is an invalid launch
            return
        cupy = _cupy()
        handle = _stream_handle(stream)
        ctx = cupy.cuda.ExternalStream(handle) if handle is not None else cupy.cuda.get_current_stream()
        with ctx:
            # One upload of both offset arrays; cupy's pool is stream-ordered, so the array's
            # memory is not reused before the kernel on this stream has read it.
            offsets = cupy.asarray(np.concatenate([d, s]))
            base = int(offsets.data.ptr)
            self._kernel((self.grid(n, nbytes),), (self.threads,),
                         (int(dst_ptr), int(dst_size), base, int(src_ptr), int(src_size),
                          base + 8 * n, n, int(nbytes), 0))
            if wait:
                ctx.synchronize()
