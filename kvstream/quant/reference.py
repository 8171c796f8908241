"""The torch reference of the 8-bit wire codecs (and the "naive" baseline the bench
measures against).

Every kernel (csrc/fp8_cpu.c, csrc/fp8.cu) must match ``quantize`` and ``dequantize``
bit for bit, for each codec. They work on chunks already gathered: ``x`` is
``[..., P, Q, R, S]`` in the engine dtype, the scales ``[..., P, R]``. Written for
clarity, not speed: each step round-trips through float32 tensors, which is what
makes it slow on CPU.

``fp8_e4m3``: power-of-two scale, codes are float8_e4m3fn. ``int8``: scale
``a / 127`` with ``a = max(absmax, 2^-119)``, codes ``clamp(rint(x * (127 / a)), ±127)``
as int8 bytes; every step is one IEEE float32 operation (both quotients true divisions:
torch's ``127.0 / a`` would be ``a.reciprocal() * 127``, two roundings, and on CUDA its
``a / 127.0`` a multiply), so C and CUDA reproduce it on any device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstream._exceptions import QuantizationError

if TYPE_CHECKING:
    import torch

__all__ = ["dequantize", "pow2_scales", "quantize", "within_bound"]

# The int8 scale's floor: 127 / a stays finite (127 * 2^119 < 2^127) and a / 127 normal
# (>= 2^-126), so flush-to-zero (FTZ/DAZ, which a library may set) never zeroes a scale.
INT8_FLOOR = 2.0 ** -119


def _check(codec: str) -> str:
    if codec not in ("fp8_e4m3", "int8"):
        raise QuantizationError(f"{codec!r} is not an 8-bit codec (fp8_e4m3, int8)")
    return codec


def pow2_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, 1/scale)``: the smallest power of two with amax <= 448 * scale."""
    import torch

    m, k = torch.frexp(amax)
    e = (k - 9 + (m > 0.875).to(k.dtype)).clamp(-126, 126).to(torch.int32)
    scale = ((e + 127) << 23).view(torch.float32)
    inv = ((127 - e) << 23).view(torch.float32)
    return scale, inv


def quantize(x: torch.Tensor, codec: str = "fp8_e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., P, Q, R, S]`` -> ``(codes uint8 like x, scales float32 [..., P, R])``."""
    import torch

    _check(codec)
    xf = x.float()
    amax = xf.abs().amax(dim=(-3, -1))
    if not bool(torch.isfinite(amax).all()):
        raise QuantizationError(f"KV holds inf or NaN: {codec} cannot encode it")
    if codec == "int8":
        a = amax.clamp_min(INT8_FLOOR)
        c = torch.full_like(a, 127.0)
        scale, inv = a / c, c / a
        q = (xf * inv.unsqueeze(-2).unsqueeze(-1)).round().clamp(-127, 127)
        return q.to(torch.int8).view(torch.uint8), scale
    scale, inv = pow2_scales(amax)
    codes = (xf * inv.unsqueeze(-2).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
               codec: str = "fp8_e4m3") -> torch.Tensor:
    """Inverse of ``quantize`` into the engine ``dtype`` (round to nearest even), saturating
    at the dtype's largest finite value: near the top of the range a code can round up
    past it (65,000 in fp16 comes back as 65,536), which must not become inf."""
    import torch

    xf = codes.view(torch.int8 if _check(codec) == "int8" else torch.float8_e4m3fn).float()
    top = torch.finfo(dtype).max
    return (xf * scales.unsqueeze(-2).unsqueeze(-1)).clamp(-top, top).to(dtype)


def within_bound(x: torch.Tensor, y: torch.Tensor, codec: str = "fp8_e4m3") -> bool:
    """Whether decoded ``y`` is within the codec's documented bound of the original ``x``
    (``quant.scheme.error_bound``); both ``[..., P, Q, R, S]``, any float dtype."""
    from kvstream.quant.scheme import error_bound

    rel, frac = error_bound(str(y.dtype).removeprefix("torch."), codec)
    xf, yf = x.float(), y.float()
    gmax = xf.abs().amax(dim=(-3, -1), keepdim=True)
    tol = rel * xf.abs() + frac * gmax + 2.0 ** -24
    return bool(((yf - xf).abs() <= tol).all())
