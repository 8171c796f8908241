"""A layer's trip through a codec: engine blocks -> wire buffer -> engine blocks.

``LayerCodec`` is what the streams call in place of gather/scatter when a
transfer's codec is not "none". One layer on the wire is::

    [ scales: float32 [planes, n, P, R], padded to 64 B | codes: uint8 [planes, n, chunk] ]

so a block's scales always travel in the same message as its codes. Backends,
best first: the CUDA kernels (cupy, KV on a GPU), the CPU kernel (csrc/fp8_cpu.c),
the torch reference (anything else; slow). Each implements every 8-bit codec
(``fp8_e4m3``, ``int8``) with the same scale groups and wire layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from kvstream._exceptions import ConfigError, KVStreamError, QuantizationError
from kvstream.quant import reference
from kvstream.quant.scheme import (
    CODEC_DTYPES,
    Geometry,
    check_codec,
    groups_per_chunk,
    scales_bytes,
    wire_layer_bytes,
)

if TYPE_CHECKING:
    import torch

    from kvstream.memory import BlockMap, RegisteredKV
    from kvstream.quant.cpu import CpuKernel

__all__ = ["LayerCodec", "make_codec", "prepare"]


class _Backend(Protocol):
    name: str

    def encode(self, src: torch.Tensor, blocks: BlockMap, codes: torch.Tensor,
               scales: torch.Tensor) -> None: ...

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dst: torch.Tensor,
               blocks: BlockMap) -> None: ...


class _TorchBackend:
    """The reference on gathered chunks; works on any device torch does."""

    name = "torch"

    def __init__(self, geo: Geometry, codec: str) -> None:
        self.geo = geo
        self.codec = codec

    def _chunks(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.geo.planes, self.geo.num_blocks, self.geo.chunk)

    def encode(self, src: torch.Tensor, blocks: BlockMap, codes: torch.Tensor,
               scales: torch.Tensor) -> None:
        g = self.geo
        x = self._chunks(src).index_select(1, blocks.index).view(g.planes, len(blocks), *g.groups)
        q, s = reference.quantize(x, self.codec)
        codes.copy_(q.reshape(-1))
        scales.copy_(s.reshape(-1))

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dst: torch.Tensor,
               blocks: BlockMap) -> None:
        import torch

        g = self.geo
        if not bool(((scales > 0) & torch.isfinite(scales)).all()):
            raise QuantizationError(f"{self.codec} scales from the peer are not finite and positive")
        n, (p, _q, r, _s) = len(blocks), g.groups
        y = reference.dequantize(codes.view(g.planes, n, *g.groups),
                                 scales.view(g.planes, n, p, r), dst.dtype, self.codec)
        self._chunks(dst).index_copy_(1, blocks.index, y.view(g.planes, n, g.chunk))


class _CpuBackend:
    name = "cpu"

    def __init__(self, geo: Geometry, kernel: CpuKernel, codec: str) -> None:
        from kvstream.quant.cpu import DTYPE_CODES

        self.geo = geo
        self.codec = codec
        self._quantize, self._dequantize = kernel.ops(codec)
        self.dtype_code = DTYPE_CODES[geo.dtype]

    def encode(self, src: torch.Tensor, blocks: BlockMap, codes: torch.Tensor,
               scales: torch.Tensor) -> None:
        g = self.geo
        bad = self._quantize(src.data_ptr(), self.dtype_code, g.num_blocks, g.planes,
                             blocks.index.data_ptr(), len(blocks), *g.groups,
                             codes.data_ptr(), scales.data_ptr())
        if bad:
            raise QuantizationError(f"KV holds inf or NaN in {bad} scale groups: "
                                    f"{self.codec} cannot encode it")

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dst: torch.Tensor,
               blocks: BlockMap) -> None:
        g = self.geo
        bad = self._dequantize(codes.data_ptr(), scales.data_ptr(), len(blocks), g.planes,
                               *g.groups, dst.data_ptr(), self.dtype_code, g.num_blocks,
                               blocks.index.data_ptr())
        if bad:
            raise QuantizationError(f"{bad} {self.codec} scales from the peer are not finite "
                                    "and positive")


def _backend(geo: Geometry, mem: RegisteredKV, codec: str, prefer: str | None) -> _Backend:
    if prefer == "torch":
        return _TorchBackend(geo, codec)
    if mem.device.type == "cuda" and prefer in (None, "cuda"):
        from kvstream.quant import cuda

        kernels = cuda.load(mem.device.index)
        if kernels is not None:
            return cuda.CudaBackend(geo, kernels, codec)
    if mem.device.type == "cpu" and prefer in (None, "cpu"):
        from kvstream.quant import cpu

        kernel = cpu.load()
        if kernel is not None:
            return _CpuBackend(geo, kernel, codec)
    if prefer not in (None, "torch"):
        raise QuantizationError(f"the {prefer} {codec} backend is not available here")
    return _TorchBackend(geo, codec)


class LayerCodec:
    """Encodes and decodes whole layers of one registered memory."""

    def __init__(self, mem: RegisteredKV, codec: str, *, backend: str | None = None) -> None:
        if check_codec(codec) == "none":
            raise ConfigError("codec 'none' moves bytes verbatim: no LayerCodec")
        if mem.layout.dtype not in CODEC_DTYPES:
            raise ConfigError(f"codec {codec} cannot encode a {mem.layout.dtype} cache")
        self.name = codec
        self.mem = mem
        self.geo = Geometry(mem.layout, mem.num_blocks)
        self._prefer = backend
        self._backend: _Backend | None = None

    @property
    def backend(self) -> _Backend:
        """Chosen on first use, on the copy thread that encodes: building the CPU kernel
        (gcc) or the CUDA one (NVRTC) takes up to seconds and must not stall the event
        loop that answers manifests and heartbeats (``prepare`` builds it ahead)."""
        if self._backend is None:
            self._backend = _backend(self.geo, self.mem, self.name, self._prefer)
        return self._backend

    @backend.setter
    def backend(self, value: _Backend) -> None:
        self._backend = value

    def layer_bytes(self, nblocks: int) -> int:
        return wire_layer_bytes(self.mem.layout, self.name, nblocks)

    def _split(self, buf: torch.Tensor, nblocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        if buf.numel() < self.layer_bytes(nblocks) or buf.device != self.mem.device:
            raise QuantizationError(f"a {buf.numel()}-byte buffer on {buf.device} cannot hold "
                                    f"{nblocks} blocks of {self.name} for KV on {self.mem.device}")
        lay = self.mem.layout
        planes = lay.chunks_per_block  # on the wire (a split layout's backend sees one)
        nscales = planes * nblocks * groups_per_chunk(lay)
        head = scales_bytes(lay, nblocks)
        scales = buf[:nscales * 4].view(torch.float32)
        codes = buf[head:head + planes * nblocks * self.geo.chunk]
        return codes, scales

    def _tensors(self, layer: int, codes: torch.Tensor, scales: torch.Tensor
                 ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(cache tensor, its codes, its scales) per tensor of the layer: a split layout's
        K and V each take their plane of the wire (planes are outermost)."""
        ts = self.mem.layer_tensors(layer)
        if len(ts) == 1:
            return [(ts[0], codes, scales)]
        return [(t, codes.view(len(ts), -1)[p], scales.view(len(ts), -1)[p])
                for p, t in enumerate(ts)]

    def encode(self, layer: int, blocks: BlockMap, buf: torch.Tensor) -> None:
        """Gather + quantize the layer's blocks into ``buf`` (uint8, ``layer_bytes``)."""
        codes, scales = self._split(buf, len(blocks))
        with _as_quantization_error("encode"):
            for src, c, s in self._tensors(layer, codes, scales):
                self.backend.encode(src, blocks, c, s)

    def decode(self, layer: int, blocks: BlockMap, buf: torch.Tensor) -> None:
        """Dequantize ``buf`` into the layer's blocks, in the engine dtype."""
        codes, scales = self._split(buf, len(blocks))
        with _as_quantization_error("decode"):
            for dst, c, s in self._tensors(layer, codes, scales):
                self.backend.decode(c, s, dst, blocks)


@contextlib.contextmanager
def _as_quantization_error(what: str) -> Iterator[None]:
    """Any backend failure (torch OOM, a CUDA error) is this transfer's QuantizationError,
    which the streams turn into a failed transfer; never an error that escapes them."""
    try:
        yield
    except KVStreamError:
        raise
    except Exception as exc:
        raise QuantizationError(f"wire codec {what} failed: {exc!r}") from exc


def prepare(mem: RegisteredKV) -> None:
    """Build the kernel this memory's codecs will use (call off the event loop): one
    library (CPU) or module (CUDA) holds every codec."""
    if mem.layout.dtype in CODEC_DTYPES:
        _ = LayerCodec(mem, "fp8_e4m3").backend


def make_codec(mem: RegisteredKV, codec: str) -> LayerCodec | None:
    """None for "none" (the streams move bytes verbatim), else the layer codec."""
    return None if check_codec(codec) == "none" else LayerCodec(mem, codec)
