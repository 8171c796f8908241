"""The CPU kernel (csrc/fp8_cpu.c): compiled on first use, cached, called through ctypes.

One library holds every 8-bit codec: ``CpuKernel.ops(codec)`` gives the
``(quantize, dequantize)`` entry points of ``fp8_e4m3`` or ``int8`` (same arguments).

ctypes releases the GIL for the call, so a layer quantizes on a copy thread while
the event loop keeps sending. The library is built for this CPU (``-march=native``:
20-25 % faster than plain ``-mavx2`` on the EPYC here) when it has AVX2 and F16C,
and as portable C otherwise; the cache key covers the source, the flags, the
compiler and the CPU (``kvstream.native`` builds and caches it), so a changed kernel,
or a cache shared across machines, never loads a mismatched build. Without a
C compiler (the sources ship in the package: ``kvstream/csrc/``), ``load()`` returns
None and callers fall back to the torch reference, with a warning.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from collections.abc import Callable
from pathlib import Path

from kvstream import native
from kvstream._exceptions import QuantizationError
from kvstream.native import cache_dir

__all__ = ["CpuKernel", "build", "cache_dir", "load", "source_path"]

log = logging.getLogger("kvstream.quant")


DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}


def source_path() -> Path:
    return native.csrc_path("fp8_cpu.c")


def _simd_flags() -> list[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = native.cpu_id()
    return ["-march=native"] if " avx2" in flags and " f16c" in flags else []


def build(src: Path | None = None, *, simd: bool = True) -> Path:
    """Compile (or find in the cache) the kernel; ``simd=False`` builds the portable C."""
    flags = ["-O3", "-shared", "-fPIC", "-fno-math-errno", *(_simd_flags() if simd else [])]
    return native.build(src or source_path(), flags, libs=("-lm",), error=QuantizationError,
                        what="the CPU codec kernel")


_QUANTIZE_ARGS = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_int64] * 2, ctypes.c_void_p,
                  *[ctypes.c_int64] * 5, ctypes.c_void_p, ctypes.c_void_p]
_DEQUANTIZE_ARGS = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 6, ctypes.c_void_p,
                    ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
# An entry point: ctypes function returning its count of bad groups (or scales).
_Op = Callable[..., int]
# codec -> the C symbols' prefix
_PREFIXES = {"fp8_e4m3": "kvs_fp8", "int8": "kvs_i8"}


class CpuKernel:
    """Typed entry points of the built library. ``quantize`` / ``dequantize`` are
    fp8_e4m3's; ``ops(codec)`` any codec's."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self._ops: dict[str, tuple[_Op, _Op]] = {}
        for codec, prefix in _PREFIXES.items():
            quantize = getattr(lib, f"{prefix}_quantize")
            quantize.restype, quantize.argtypes = ctypes.c_int64, _QUANTIZE_ARGS
            dequantize = getattr(lib, f"{prefix}_dequantize")
            dequantize.restype, dequantize.argtypes = ctypes.c_int64, _DEQUANTIZE_ARGS
            self._ops[codec] = (quantize, dequantize)
        self.quantize, self.dequantize = self._ops["fp8_e4m3"]
        self.simd = bool(lib.kvs_fp8_has_simd())
        self.path = path

    def ops(self, codec: str) -> tuple[_Op, _Op]:
        """``(quantize, dequantize)`` of ``codec``; both return the number of bad groups
        (non-finite KV) or bad scales (from the wire; nothing is then written)."""
        try:
            return self._ops[codec]
        except KeyError:
            raise QuantizationError(f"the CPU kernel has no codec {codec!r}") from None


def _make() -> CpuKernel:
    src = source_path()
    if not src.exists():
        raise QuantizationError(f"{src} not found (kvstream installed without csrc/)")
    return CpuKernel(build(src))


_load = native.Once(_make, (QuantizationError, OSError),
                    "CPU codec kernel unavailable, using the slow torch path: %s", log)


def load() -> CpuKernel | None:
    """The kernel, built once per process (None where it cannot be built)."""
    return _load()
