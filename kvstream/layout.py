"""KV layouts: what a block is, in tokens and in bytes.

Both peers must agree on the bytes of a block, so the layout is part of the
protocol: its ``fingerprint`` travels in every manifest and a receiver refuses
a sender whose fingerprint differs (vLLM's NIXL connector compares a
compatibility hash the same way).

A layer's cache tensor is one of a few *arrangements*. What matters for moving
bytes is only where the block index sits:

* ``kv_outer`` arrangements put K/V first (``[2, num_blocks, ...]``), so a block
  is two equal chunks, one in the K half and one in the V half;
* ``block_outer`` arrangements put blocks first (``[num_blocks, ...]``), so a
  block is one contiguous chunk.

The order inside a chunk (NHD vs HND) does not change which bytes move, but it
does change their meaning, so it is part of the fingerprint.
"""

from __future__ import annotations

import hashlib
import math
from typing import Final, Literal

import msgspec

from kvstream._exceptions import ConfigError

__all__ = ["ARRANGEMENTS", "DTYPE_BYTES", "FP8_DTYPES", "Arrangement", "KVLayout"]

DTYPE_BYTES: Final[dict[str, int]] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}

# An FP8 cache: its blocks travel with their scales and no codec re-quantizes them.
FP8_DTYPES: Final = frozenset({"float8_e4m3fn", "float8_e5m2"})

Arrangement = Literal["flash_nhd", "flash_hnd", "blocks_first_nhd", "cpu_hnbc", "mla",
                      "split_nhd", "hnd_kv", "nhd_kv"]

# name -> (block index outermost?, shape builder doc). Shapes use
# nb=num_blocks, bs=block_size, h=num_kv_heads, d=head_dim.
ARRANGEMENTS: Final[dict[str, str]] = {
    "flash_nhd": "[2, nb, bs, h, d]  (vLLM FlashAttention, NHD)",
    "flash_hnd": "[2, nb, h, bs, d]  (vLLM FlashAttention, HND)",
    "blocks_first_nhd": "[nb, 2, bs, h, d]  (FlashInfer / SGLang-style paged)",
    "cpu_hnbc": "[nb, h, bs, 2*d]  (vLLM CPU attention backend; per block and head, K as "
                "[d, bs], then V as [bs, d])",
    "mla": "[nb, bs, d]  (MLA compressed latent; h must be 1, no separate V)",
    "split_nhd": "K and V in separate tensors, each [nb*bs, h, d], registered K of every "
                 "layer first, then V (SGLang's MHA token-to-KV pool: a page is a block)",
    "hnd_kv": "[nb, h, bs, 2*d]  (vLLM 0.32's GPU backends in KV cache layout LBHNC: per "
              "block, head and token, K then V)",
    "nhd_kv": "[nb, bs, h, 2*d]  (the same in vLLM's layout LBNHC: per block, token and head, "
              "K then V)",
}

# K/V first in one tensor, or K and V in tensors of their own: a block is two chunks.
_KV_OUTER: Final = frozenset({"flash_nhd", "flash_hnd", "split_nhd"})


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of one engine's KV cache; equal layouts move bytes verbatim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float16"
    arrangement: str = "flash_nhd"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPE_BYTES)}")
        if self.arrangement not in ARRANGEMENTS:
            raise ConfigError(
                f"unknown arrangement {self.arrangement!r}; known: {sorted(ARRANGEMENTS)}"
            )
        if self.arrangement == "mla" and self.num_kv_heads != 1:
            raise ConfigError("the mla arrangement stores one latent per token: num_kv_heads=1")

    @property
    def split(self) -> bool:
        """K and V live in tensors of their own (2 per layer, registered K first)."""
        return self.arrangement == "split_nhd"

    @property
    def tensors_per_layer(self) -> int:
        return 2 if self.split else 1

    # -- size arithmetic (DESIGN.md) -------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_factor(self) -> int:
        """2 for separate K and V, 1 for MLA's joint latent."""
        return 1 if self.arrangement == "mla" else 2

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.kv_factor * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.bytes_per_token_per_layer * self.num_layers

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer (K and V together)."""
        return self.bytes_per_token_per_layer * self.block_size

    @property
    def chunks_per_block(self) -> int:
        """Contiguous pieces a block is split into inside a layer tensor."""
        return 2 if self.arrangement in _KV_OUTER else 1

    @property
    def chunk_bytes(self) -> int:
        return self.block_bytes // self.chunks_per_block

    def blocks_for_tokens(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor holding ``num_blocks`` blocks (split: each
        of its K and V tensors)."""
        nb, bs, h, d = num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        return {
            "flash_nhd": (2, nb, bs, h, d),
            "flash_hnd": (2, nb, h, bs, d),
            "blocks_first_nhd": (nb, 2, bs, h, d),
            "cpu_hnbc": (nb, h, bs, 2 * d),
            "mla": (nb, bs, d),
            "split_nhd": (nb * bs, h, d),
            "hnd_kv": (nb, h, bs, 2 * d),
            "nhd_kv": (nb, bs, h, 2 * d),
        }[self.arrangement]

    def num_blocks_of(self, shape: tuple[int, ...]) -> int:
        """The block count a layer tensor of ``shape`` holds (inverse of tensor_shape;
        split: whole pages only)."""
        if self.split:
            return shape[0] // self.block_size if shape else 0
        return shape[1] if self.arrangement in _KV_OUTER else shape[0]

    @property
    def fingerprint(self) -> str:
        """Hash over everything two peers must share to move blocks verbatim."""
        key = (
            f"{self.num_layers}/{self.num_kv_heads}/{self.head_dim}/{self.block_size}"
            f"/{self.dtype}/{self.arrangement}"
        )
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x dim {self.head_dim}, "
            f"block {self.block_size} tokens, {self.dtype}, {self.arrangement}"
        )
