"""The CUDA kernels of the 8-bit codecs (csrc/fp8.cu: fp8_e4m3 and int8): compiled once per
process by cupy's NVRTC, launched on torch's current stream.

Gather + quantize reads the blocks by id straight out of the engine's layer tensor into the
wire buffer, and dequantize + scatter writes them straight back: no staging copy and no
per-step float32 tensors (what makes the torch reference slow). Every call waits for its
stream before returning, because the caller hands the buffer to UCX right after. Without
cupy (``pip install 'kvstream[cu12]' or '[cu13]'``) or a CUDA device, ``load()`` returns None and the
codec uses the torch reference on the GPU.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from kvstream import native
from kvstream._exceptions import QuantizationError

if TYPE_CHECKING:
    import torch

    from kvstream.memory import BlockMap
    from kvstream.quant.scheme import Geometry

__all__ = ["KERNEL_NAMES", "CudaBackend", "Kernels", "load", "source_path"]

log = logging.getLogger("kvstream.quant")

_SUFFIXES: Final = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
# Wire codec -> the prefix of its entry points in fp8.cu.
_PREFIXES: Final = {"fp8_e4m3": "kvs_fp8", "int8": "kvs_i8"}
KERNEL_NAMES: Final = tuple(f"{pre}_{op}_{s}" for pre in _PREFIXES.values()
                            for op in ("quantize", "dequantize") for s in _SUFFIXES.values())
# KVS_THREADS in fp8.cu (its __launch_bounds__); a block is whole warps up to this.
MAX_THREADS: Final = 256
# Subnormals must survive and no multiply may become an FMA: the torch reference does neither.
_OPTIONS: Final = ("--ftz=false", "--fmad=false")

_lock = threading.Lock()
_loaded: Kernels | None = None
_tried = False


def source_path() -> Path:
    return native.csrc_path("fp8.cu")


class Kernels:
    """The entry points of fp8.cu by codec, then engine dtype (cupy ``RawKernel``s, cached per
    device): ``quantize["int8"]["bfloat16"]``."""

    def __init__(self, module: Any) -> None:
        self.quantize = {c: {dt: module.get_function(f"{pre}_quantize_{s}") for dt, s in _SUFFIXES.items()}
                         for c, pre in _PREFIXES.items()}
        self.dequantize = {c: {dt: module.get_function(f"{pre}_dequantize_{s}")
                               for dt, s in _SUFFIXES.items()}
                           for c, pre in _PREFIXES.items()}


def _compile(device: int) -> Kernels | None:
    try:
        import cupy
    except ImportError:
        log.info("cupy not installed (pip install 'kvstream[cu12]' or '[cu13]'): the codecs "
                 "use the torch path on the GPU")
        return None
    src = source_path()
    try:
        if not src.exists():
            raise QuantizationError(f"{src} not found (kvstream installed without its kernel sources)")
        # The KV's device, never this thread's current one: a build thread's is device 0,
        # and a context made there costs every TP rank memory on GPU 0.
        with cupy.cuda.Device(device):
            # get_function compiles and loads, so a broken kernel fails here and not mid-transfer.
            return Kernels(cupy.RawModule(code=src.read_text(), options=_OPTIONS))
    except Exception as exc:  # cupy's compile, NVRTC and driver errors share no base class
        log.warning("CUDA codec kernels unavailable, using the torch path on the GPU: %s", exc)
        return None


def load(device: int | None = None) -> Kernels | None:
    """The kernels, compiled once per process on CUDA device ``device`` (the KV's; default:
    the current one), None where cupy or CUDA is missing. cupy loads the compiled module
    onto another device when a kernel is launched there."""
    global _loaded, _tried
    with _lock:
        if not _tried:
            _tried = True
            if device is None:
                import torch

                device = torch.cuda.current_device()
            _loaded = _compile(device)
        return _loaded


def _same_device(codec: str, kv: torch.Tensor, *others: torch.Tensor) -> None:
    # A host pointer handed to a kernel is an illegal address, which kills the CUDA context.
    for t in others:
        if t.device != kv.device:
            raise QuantizationError(f"the CUDA {codec} kernels need every buffer on {kv.device}, "
                                    f"got one on {t.device}")


def _launch(kernel: Any, device: torch.device, grid: int, threads: int, args: tuple[int, ...]) -> None:
    """Run ``kernel`` on torch's current stream of ``device`` and wait for it."""
    import cupy
    import torch

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream, device.index):
        kernel((grid,), (threads,), args)
    stream.synchronize()


class CudaBackend:
    """Fused gather + quantize and dequantize + scatter on the KV's GPU, one CUDA block per
    scale group; same results as the CPU kernel and the torch reference, bit for bit."""

    name = "cuda"

    def __init__(self, geo: Geometry, kernels: Kernels, codec: str) -> None:
        if codec not in _PREFIXES:
            raise QuantizationError(f"no CUDA kernels for codec {codec!r}")
        if geo.dtype not in _SUFFIXES:
            raise QuantizationError(f"no CUDA {codec} kernel for a {geo.dtype} cache")
        if geo.chunk >= 2 ** 31:
            raise QuantizationError(f"chunks of {geo.chunk} elements exceed the CUDA {codec} "
                                    "kernels' 32-bit offsets")
        self.geo = geo
        self.codec = codec
        self._quantize = kernels.quantize[codec][geo.dtype]
        self._dequantize = kernels.dequantize[codec][geo.dtype]
        _p, q, _r, s = geo.groups
        # Enough whole warps to give each thread one element of a group, up to MAX_THREADS.
        self.threads = min(MAX_THREADS, -(-q * s // 32) * 32)

    def encode(self, src: torch.Tensor, blocks: BlockMap, codes: torch.Tensor,
               scales: torch.Tensor) -> None:
        import torch

        g, n = self.geo, len(blocks)
        _same_device(self.codec, src, codes, scales, blocks.index)
        if n == 0:  # cupy would launch one block for a grid of 0, reading ids[0]
            return
        p, q, r, s = g.groups
        bad = torch.zeros(1, dtype=torch.int64, device=src.device)
        _launch(self._quantize, src.device, g.planes * n * p * r, self.threads,
                (src.data_ptr(), g.num_blocks, blocks.index.data_ptr(), n, p, q, r, s,
                 codes.data_ptr(), scales.data_ptr(), bad.data_ptr()))
        nbad = int(bad.item())
        if nbad:
            raise QuantizationError(f"KV holds inf or NaN in {nbad} scale groups: {self.codec} "
                                    "cannot encode it")

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dst: torch.Tensor,
               blocks: BlockMap) -> None:
        import torch

        g, n = self.geo, len(blocks)
        _same_device(self.codec, dst, codes, scales, blocks.index)
        # Scales come off the wire: any that is not finite and positive fails the call before a
        # byte is written. Tested on the bits as fp8_cpu.c does: as int32, a set sign bit
        # (negatives, -0.0) or +0.0 is <= 0, and inf and NaN are >= 0x7f800000.
        bits = scales.view(torch.int32)
        nbad = int(((bits <= 0) | (bits >= 0x7F800000)).sum())
        if nbad:
            raise QuantizationError(f"{nbad} {self.codec} scales from the peer are not finite "
                                    "and positive")
        if n == 0:
            return
        p, q, r, s = g.groups
        _launch(self._dequantize, dst.device, g.planes * n * p * r, self.threads,
                (codes.data_ptr(), scales.data_ptr(), n, p, q, r, s,
                 dst.data_ptr(), g.num_blocks, blocks.index.data_ptr()))
