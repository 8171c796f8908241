"""What a codec puts on the wire: names, scale groups, sizes, compatibility, error bound.

``fp8_e4m3`` keeps one scale per (block, K/V, head): a chunk of a layer (one plane
of one block, see ``dataplane.memory``) is viewed as ``[P, Q, R, S]`` and every
``(p, r)`` is a scale group reduced over ``(q, s)``. Why this granularity:

* per block, because blocks are what moves and what a prefix cache shares; a
  block's scales travel in the same message as its bytes, so a block can never
  land with another block's scales;
* per head and per K/V, because KV outliers are concentrated in a few heads and
  channels (K especially): one scale per block would spend the e4m3 range of
  every head on the worst one;
* not per token, which would cost 4 bytes per 128 values (3 % more wire) for
  accuracy the attention output does not need (docs/architecture.md, measured).

Scales are powers of two (the OCP MX formats' choice): scaling is an exact
multiplication in every implementation, so the CPU kernel, the CUDA kernel and
the torch reference agree bit for bit, and the error bound is clean. A power of
two leaves at most one binade of e4m3's 18 unused, at the small end.

``int8`` has the same scale groups and wire size: codes are symmetric int8 with the
scale ``absmax / 127`` (not a power of two: that would waste up to a bit of 7). Why a
second 8-bit codec: e4m3 keeps 3 mantissa bits on *every* value, so a key's error is
~3 % of itself at any scale granularity, and a sharp attention head (a trained model's
copy or induction head) turns that into a different softmax. int8 spends its 8 bits on
the group's range: the large entries that dominate ``q . k`` come back ~16x closer.
Measured on the trained tiny Llama's real KV (docs/architecture.md): attention cosine
0.9999 for int8 against 0.997 for e4m3, whatever e4m3's scale granularity. fp8_e4m3
stays for engines that keep an e4m3 cache or compute attention in FP8.
"""

from __future__ import annotations

import hashlib
from typing import Final

from kvstream._exceptions import ConfigError
from kvstream.layout import FP8_DTYPES as LAYOUT_FP8_DTYPES
from kvstream.layout import KVLayout

__all__ = [
    "CODECS",
    "CODEC_DTYPES",
    "E4M3_MAX",
    "FP8_DTYPES",
    "SCALE_LAYOUT",
    "SCALE_LAYOUTS",
    "Geometry",
    "check_codec",
    "effective_codec",
    "error_bound",
    "scale_groups",
    "wire_fingerprint",
    "wire_layer_bytes",
]

CODECS: Final = ("none", "fp8_e4m3", "int8")
E4M3_MAX: Final = 448.0
# An engine whose cache already holds one of these sends it as-is (codec "none").
FP8_DTYPES: Final = LAYOUT_FP8_DTYPES  # the layout's; re-exported here for codec code
# What the 8-bit codecs encode from and decode into; anything else moves verbatim.
CODEC_DTYPES: Final = frozenset({"float16", "bfloat16", "float32"})
# Names each codec's scale layout in the compatibility hash: change it when it changes.
SCALE_LAYOUTS: Final = {
    "fp8_e4m3": "pow2-f32/block-plane-head/2",  # 2: cpu_hnbc groups K and V rows
    "int8": "absmax127-f32/block-plane-head/1",
}
SCALE_LAYOUT: Final = SCALE_LAYOUTS["fp8_e4m3"]
SCALE_BYTES: Final = 4
ALIGN: Final = 64


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise ConfigError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    return codec


def effective_codec(requested: str, layout: KVLayout) -> str:
    """The codec a source actually uses: an FP8 cache (or opaque bytes) goes as it is,
    never re-quantized."""
    check_codec(requested)
    return requested if layout.dtype in CODEC_DTYPES else "none"


def scale_groups(layout: KVLayout) -> tuple[int, int, int, int]:
    """``(P, Q, R, S)`` of one chunk; scale groups are the ``(p, r)`` pairs."""
    bs, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    return {
        "flash_nhd": (1, bs, h, d),          # chunk [bs, h, d]: heads strided
        "flash_hnd": (h, 1, 1, bs * d),      # chunk [h, bs, d]: a head is contiguous
        "blocks_first_nhd": (2, bs, h, d),   # chunk [2, bs, h, d]: K/V and heads
        # chunk [h, bs, 2*d] is [h, 2, bs, d] in memory: vLLM's CPU backend keeps a block's
        # bs K rows, then its bs V rows, per head (cpu_attn.py views it so and chunks dim 2)
        "cpu_hnbc": (2 * h, 1, 1, bs * d),
        "mla": (1, 1, 1, bs * d),            # one latent "head"
        "split_nhd": (1, bs, h, d),          # K's or V's tensor: a page [bs, h, d]
        "hnd_kv": (h, bs, 2, d),             # chunk [h, bs, 2, d]: a group per head and K/V
        "nhd_kv": (1, bs, 2 * h, d),         # chunk [bs, h, 2, d]: likewise, strided
    }[layout.arrangement]


class Geometry:
    """One cache's shape as the codec backends see it: the scale groups of a chunk, chunks
    (K/V planes) per block, blocks, elements per chunk and dtype. Built from the layout and
    the block count alone, so no backend needs the registered memory."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.groups = scale_groups(layout)
        # A split layout's K and V are tensors of their own: a backend sees one at a time.
        self.planes = 1 if layout.split else layout.chunks_per_block
        self.num_blocks = num_blocks
        self.chunk = layout.chunk_bytes // layout.dtype_bytes
        self.dtype = layout.dtype


def groups_per_chunk(layout: KVLayout) -> int:
    p, _q, r, _s = scale_groups(layout)
    return p * r


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def scales_bytes(layout: KVLayout, nblocks: int) -> int:
    """The scales' share of one layer's wire bytes, padded so the payload stays aligned."""
    return _align(layout.chunks_per_block * nblocks * groups_per_chunk(layout) * SCALE_BYTES)


def wire_layer_bytes(layout: KVLayout, codec: str, nblocks: int) -> int:
    """Bytes of one layer of ``nblocks`` blocks on the wire."""
    if check_codec(codec) == "none":
        return nblocks * layout.block_bytes
    elems = nblocks * layout.block_bytes // layout.dtype_bytes
    return scales_bytes(layout, nblocks) + elems


def wire_fingerprint(layout: KVLayout, codec: str) -> str:
    """The compatibility hash two peers compare. Verbatim bytes need the same layout; an
    FP8 wire needs the same shape and scale layout but not the same engine dtype (the
    receiver dequantizes into its own)."""
    if check_codec(codec) == "none":
        return layout.fingerprint
    key = (f"{layout.num_layers}/{layout.num_kv_heads}/{layout.head_dim}/{layout.block_size}"
           f"/{layout.arrangement}/{codec}/{SCALE_LAYOUTS[codec]}")
    return hashlib.sha256(key.encode()).hexdigest()[:16]


# int8: half a step of a/127 (1/254 of the group max, plus float32 rounding), and the
# destination's own rounding of the decoded value, relative, with room to spare (half an ulp
# is 2^-11 in float16, 2^-9 in bfloat16, 2^-24 in float32); below the 2^-119 floor the
# "+ 2^-24" absolute slack covers the step.
_INT8_REL: Final = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -22}
_INT8_FRAC: Final = 1.01 / 254


def error_bound(out_dtype: str, codec: str = "fp8_e4m3") -> tuple[float, float]:
    """``(rel, abs_of_group_max)``: the documented bound of a codec is

        |decoded - x| <= rel * |x| + abs_of_group_max * max|group| (+ 2^-24 into float16)

    int8: rel is the destination dtype's rounding, abs_of_group_max ~1/254 (half a step).
    fp8_e4m3:
    rel = 2^-4 is half an e4m3 ulp (3 mantissa bits); the second term covers values that
    fall into e4m3's subnormals: half the smallest subnormal (2^-10) times the scale, and
    the scale is below max|group| / 224, so under 2^-17.8 * max|group|. bfloat16 and
    float32 hold the decoded value exactly; float16 adds at most 2^-25 in its subnormals.
    """
    if check_codec(codec) == "int8":
        return _INT8_REL.get(out_dtype, 2.0 ** -8), _INT8_FRAC
    if codec == "none":
        raise ConfigError("codec 'none' is exact: it has no error bound")
    return 2.0 ** -4, 2.0 ** -17
