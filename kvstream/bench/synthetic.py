"""Synthetic KV caches.

``pattern`` data makes every 8 bytes distinct, so a misplaced byte cannot pass the
bit-exact check. A lossy codec needs values instead of bit patterns: ``kv`` data is
normal with a few outlier channels per head (as real K caches have), checked against
the codec's error bound.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import msgspec

from kvstream.layout import KVLayout

if TYPE_CHECKING:
    import torch

__all__ = ["BenchSpec", "fill_layer", "make_cache", "pick_blocks"]


class BenchSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one benchmark moves; both processes derive identical data from it."""

    layout: KVLayout
    tokens: int = 4096
    cache_blocks: int = 0  # 0: twice the blocks the prompt needs
    seed: int = 0
    scattered: bool = True
    progress_mode: str = "thread"
    namespace: str = "bench"
    prefix_hit: float = 0.0  # share of the prompt's blocks already at the destination
    data: str = "pattern"  # "pattern" (bit-exact check) or "kv" (values; codec runs)
    transport: str = ""  # UCX_TLS of the benchmark processes ("tcp": a slow link)
    trace_dir: str = ""  # tracing on: each process writes its spans to <dir>/<role>.jsonl
    # The data-plane path the agents may take ("": any, as a deployment's would; "shm",
    # "tcp" or "ucx": that one, UCX as the fallback); host KV is in shared memory either way.
    path: str = ""
    host_ids: bool = False  # each side its own host id: same-host paths off (two "hosts")
    # Every layer its own data-plane frame however short the transfer (whole_frame_bytes 0):
    # how per-layer pipelining and per-layer spans are seen on a small prompt.
    layered: bool = False
    decode_netns: str = ""  # run the decode process in this network namespace (bench/netns.py)

    @property
    def block_hashes(self) -> list[int]:
        """The prompt's prefix-chain hashes (tokens 0..n-1), as both engines compute them."""
        from kvstream.prefix import block_hashes

        return block_hashes(range(self.tokens), self.layout.block_size)

    @property
    def hit_blocks(self) -> int:
        return min(len(self.block_hashes), round(self.prefix_hit * self.blocks))

    @property
    def blocks(self) -> int:
        return self.layout.blocks_for_tokens(self.tokens)

    @property
    def num_cache_blocks(self) -> int:
        return self.cache_blocks or 2 * self.blocks

    @property
    def payload_bytes(self) -> int:
        return self.blocks * self.layout.block_bytes * self.layout.num_layers


def fill_layer(t: torch.Tensor, layer: int, data: str = "pattern", seed: int = 0) -> None:
    """Write the layer's data: int64 counters offset by layer, or KV-like values."""
    import torch

    if data == "kv":
        gen = torch.Generator().manual_seed(seed * 1000 + layer)
        x = torch.randn(t.shape, generator=gen)
        x[..., :4] *= 30.0  # outlier channels
        t.copy_(x)
        return
    flat = t.view(torch.uint8).view(torch.int64).view(-1)
    n = flat.numel()
    torch.arange(layer * n, (layer + 1) * n, dtype=torch.int64, out=flat)


def make_cache(spec: BenchSpec, *, fill: bool, shared: bool = False) -> list[torch.Tensor]:
    """The cache of one side; ``shared``: in sealed shared memory (``SharedKV``), as an
    engine allocates host KV that same-host peers may read in one copy."""
    import torch

    lay = spec.layout
    if shared:
        from kvstream.shm import SharedKV

        layers = SharedKV.create(lay, spec.num_cache_blocks).layers
    else:
        shape = lay.tensor_shape(spec.num_cache_blocks)
        layers = [torch.empty(shape, dtype=getattr(torch, lay.dtype))
                  for _ in range(lay.num_layers)]
    for i, t in enumerate(layers):
        if fill:
            fill_layer(t, i, spec.data, spec.seed)
        else:
            t.view(torch.uint8).zero_()  # touch every page before timing
    return layers


def pick_blocks(spec: BenchSpec, salt: int) -> list[int]:
    """Block ids as a paged cache hands them out: scattered, or one run when not."""
    if not spec.scattered:
        return list(range(spec.blocks))
    rng = random.Random(spec.seed * 1000 + salt)
    return rng.sample(range(spec.num_cache_blocks), spec.blocks)
