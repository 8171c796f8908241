"""Why kvstream ships int8 next to fp8_e4m3: attention-output cosine on the trained tiny
Llama's real KV (``kvstream.bench.accuracy.tiny_llama_kv``) for 8-bit schemes simulated in
torch: e4m3 at every scale granularity, int8 at a few, and the mixes.

    python benchmarks/codec_granularity.py

e4m3 is a float format: scaling a group by a power of two changes no rounding (only the
subnormal range), so per-token, per-channel or centred scales give e4m3 the same error as
kvstream's per-(block, head) scale. int8 spends its 8 bits on the group's range instead.
The rows marked * are what the codecs put on the wire (the real codecs are measured by
``kvstream bench --accuracy``; these simulations agree with them).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvstream.bench.accuracy import _attention, _kv_heads, tiny_llama_kv

BLOCK = 16
Codec = Callable[[torch.Tensor], torch.Tensor]  # [heads, tokens, d] -> decoded, float32


def _blocks(x: torch.Tensor) -> torch.Tensor:
    h, t, d = x.shape
    return x.view(h, t // BLOCK, BLOCK, d)


def _pow2(amax: torch.Tensor) -> torch.Tensor:
    m, k = torch.frexp(amax)
    return torch.ldexp(torch.ones_like(amax), (k - 9 + (m > 0.875).int()).clamp(-126, 126))


def e4m3(reduce: tuple[int, ...], pow2: bool = True) -> Codec:
    def f(x: torch.Tensor) -> torch.Tensor:
        xb = _blocks(x)
        a = xb.abs().amax(dim=reduce, keepdim=True)
        s = _pow2(a) if pow2 else (a / 448).clamp_min(2.0 ** -126)
        return ((xb / s).to(torch.float8_e4m3fn).float() * s).reshape(x.shape)
    return f


def int8(reduce: tuple[int, ...]) -> Codec:
    def f(x: torch.Tensor) -> torch.Tensor:
        xb = _blocks(x)
        s = xb.abs().amax(dim=reduce, keepdim=True).clamp_min(2.0 ** -120) / 127
        return ((xb / s).round().clamp(-127, 127) * s).reshape(x.shape)
    return f


def centred(inner: Codec) -> Codec:
    """Subtract each block's per-channel mean (sent in fp16) before ``inner``."""
    def f(x: torch.Tensor) -> torch.Tensor:
        mu = _blocks(x).mean(2, keepdim=True).half().float()
        return (_blocks(inner((_blocks(x) - mu).reshape(x.shape))) + mu).reshape(x.shape)
    return f


def hadamard(inner: Codec) -> Codec:
    """Rotate head_dim by a normalised Hadamard matrix before ``inner`` and back after."""
    def f(x: torch.Tensor) -> torch.Tensor:
        h = torch.ones(1, 1)
        while h.shape[0] < x.shape[-1]:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = h / math.sqrt(x.shape[-1])
        return inner(x @ h) @ h.T
    return f


def same(x: torch.Tensor) -> torch.Tensor:
    return x


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


BLOCK_HEAD, TOKEN, CHANNEL = (2, 3), (3,), (2,)
SCHEMES: dict[str, tuple[Codec, Codec]] = {
    "* fp8_e4m3: pow2 scale per (block, head)": (e4m3(BLOCK_HEAD), e4m3(BLOCK_HEAD)),
    "  e4m3, exact (non-pow2) scale per (block, head)": (e4m3(BLOCK_HEAD, False),) * 2,
    "  e4m3, scale per token": (e4m3(TOKEN), e4m3(TOKEN)),
    "  e4m3, K scale per channel": (e4m3(CHANNEL), e4m3(BLOCK_HEAD)),
    "  e4m3, K centred per block and channel": (centred(e4m3(BLOCK_HEAD)), e4m3(BLOCK_HEAD)),
    "  e4m3, K Hadamard-rotated": (hadamard(e4m3(BLOCK_HEAD)), e4m3(BLOCK_HEAD)),
    "  e4m3 K, fp16 V": (e4m3(BLOCK_HEAD), same),
    "  fp16 K, e4m3 V (0.75 of the bytes)": (same, e4m3(BLOCK_HEAD)),
    "* int8: scale absmax/127 per (block, head)": (int8(BLOCK_HEAD), int8(BLOCK_HEAD)),
    "  int8, scale per token": (int8(TOKEN), int8(TOKEN)),
    "  int8, K per channel, V per token (KIVI)": (int8(CHANNEL), int8(TOKEN)),
    "  bf16 cache": (bf16, bf16),
}


def main() -> None:
    layout, layers, queries = tiny_llama_kv(dtype="float16")
    kv = [_kv_heads(layout, t) for t in layers]
    print(f"trained tiny Llama, {layout.describe()}, queries of the last 16 tokens")
    print(f"{'scheme':52s} {'cos mean':>9s} {'cos min':>9s}")
    for name, (fk, fv) in SCHEMES.items():
        cos = []
        for q, (k, v) in zip(queries, kv, strict=True):
            want = _attention(q, k, v)
            got = _attention(q, fk(k).half().float(), fv(v).half().float())
            cos.append(torch.nn.functional.cosine_similarity(want, got, dim=-1).flatten())
        c = torch.cat(cos)
        print(f"{name:52s} {float(c.mean()):9.6f} {float(c.min()):9.6f}")


if __name__ == "__main__":
    main()
