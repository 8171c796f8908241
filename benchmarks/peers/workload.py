"""The workload every peer moves: the knobs, and what ``kvstream bench`` makes of them.

Standard library only: the NIXL venv, the main venv and the unit tests all import it.

``kvstream bench`` moves a vLLM FlashAttention cache (``[2, num_blocks, block_size,
kv_heads, head_dim]`` per layer): each block is two equal chunks, its K half and its V
half, ``num_blocks`` apart, so a layer of ``n`` blocks is ``2 n`` chunks of
``block_bytes / 2``. Both caches hold twice the blocks the prompt needs; the prompt's
blocks are a seeded sample of them on each side (source salt 1, destination salt 2,
``kvstream.bench.synthetic.pick_blocks``), or ``0..n-1`` on both sides when contiguous.
The peers here lay out their buffers and pick their blocks the same way, so a byte goes
from the same source offset to the same destination offset in every system.
"""

from __future__ import annotations

import argparse
import dataclasses
import random

__all__ = ["HEAD_DIM", "KV_HEADS", "PLANES", "KnobError", "Workload", "add_workload_args",
           "kvstream_layout_args", "workload_from_args"]

PLANES = 2  # K and V: a block is two chunks (vLLM's flash layout, what kvstream bench uses)
HEAD_DIM = 128
KV_HEADS = (8, 4, 2, 1)  # preferred first; fewer heads express smaller blocks
DTYPE_BYTES = 2  # float16


class KnobError(ValueError):
    """Knobs that describe no workload ``kvstream bench`` can move; the message says why."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """``layers`` x ``blocks_per_layer`` blocks of ``block_bytes``, scattered or not."""

    block_bytes: int = 65536
    blocks_per_layer: int = 256
    layers: int = 32
    scattered: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("block_bytes", "blocks_per_layer", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise KnobError(f"{name.replace('_', '-')} must be a positive integer, "
                                f"got {value!r}")
        if self.block_bytes % (PLANES * 8):
            raise KnobError(f"block-bytes {self.block_bytes} is not a multiple of 16: a block "
                            f"is a K half and a V half of whole 8-byte words")

    @property
    def chunk_bytes(self) -> int:
        """One half of a block (K or V): the unit that is contiguous in memory."""
        return self.block_bytes // PLANES

    @property
    def cache_blocks(self) -> int:
        """Blocks per layer of each cache: twice the prompt's, as kvstream bench allocates."""
        return 2 * self.blocks_per_layer

    @property
    def payload_bytes(self) -> int:
        return self.layers * self.blocks_per_layer * self.block_bytes

    @property
    def layer_cache_bytes(self) -> int:
        return self.cache_blocks * self.block_bytes

    @property
    def descriptors(self) -> int:
        """Contiguous chunks moved in all: what a one-sided transfer posts, unmerged."""
        return self.layers * PLANES * self.blocks_per_layer

    def _pick(self, salt: int) -> list[int]:
        # kvstream.bench.synthetic.pick_blocks, restated here (no kvstream import in the
        # NIXL venv); tests/unit/test_peers_bench.py holds the two equal.
        if not self.scattered:
            return list(range(self.blocks_per_layer))
        rng = random.Random(self.seed * 1000 + salt)
        return rng.sample(range(self.cache_blocks), self.blocks_per_layer)

    @property
    def src_ids(self) -> list[int]:
        return self._pick(1)

    @property
    def dst_ids(self) -> list[int]:
        return self._pick(2)

    def chunk_index(self, layer: int, plane: int, block: int) -> int:
        """Index of a chunk in a cache of ``layers x PLANES x cache_blocks`` chunks."""
        return (layer * PLANES + plane) * self.cache_blocks + block

    def describe(self) -> str:
        return (f"{self.layers} layers x {self.blocks_per_layer} "
                f"{'scattered' if self.scattered else 'contiguous'} blocks of "
                f"{_size(self.block_bytes)} ({_size(self.payload_bytes)}, "
                f"{self.descriptors} chunks of {_size(self.chunk_bytes)})")

    def as_args(self) -> list[str]:
        """The knobs as the peer scripts' command-line arguments."""
        return ["--block-bytes", str(self.block_bytes), "--blocks-per-layer",
                str(self.blocks_per_layer), "--layers", str(self.layers),
                *([] if self.scattered else ["--contiguous"])]


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The knobs every peer script takes (``Workload.as_args`` writes them)."""
    ap.add_argument("--block-bytes", type=int, default=65536)
    ap.add_argument("--blocks-per-layer", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--contiguous", action="store_true")
    ap.add_argument("--seed", type=int, default=0)


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The ``Workload`` of arguments parsed with ``add_workload_args``."""
    return Workload(block_bytes=args.block_bytes, blocks_per_layer=args.blocks_per_layer,
                    layers=args.layers, scattered=not args.contiguous, seed=args.seed)


def kvstream_layout_args(w: Workload) -> list[str]:
    """``kvstream bench`` arguments for a float16 cache whose blocks are ``w.block_bytes``.

    block_bytes = 2 (K, V) x block_size x kv_heads x head_dim x 2 (float16 bytes), with
    head_dim 128 and 8 KV heads (Llama-3-8B) unless the block is too small or not a
    whole number of such tokens; then fewer heads. ``KnobError`` when no layout fits.
    """
    for heads in KV_HEADS:
        token_bytes = PLANES * heads * HEAD_DIM * DTYPE_BYTES
        if w.block_bytes % token_bytes == 0:
            block_size = w.block_bytes // token_bytes
            return ["--layers", str(w.layers), "--kv-heads", str(heads),
                    "--head-dim", str(HEAD_DIM), "--block-size", str(block_size),
                    "--dtype", "float16", "--tokens", str(block_size * w.blocks_per_layer),
                    *([] if w.scattered else ["--contiguous"])]
    smallest = PLANES * KV_HEADS[-1] * HEAD_DIM * DTYPE_BYTES
    raise KnobError(
        f"block-bytes {w.block_bytes} is not a whole number of float16 tokens of a "
        f"{HEAD_DIM}-dim KV head: kvstream bench cannot move such blocks. Use a multiple "
        f"of {smallest} ({', '.join(str(PLANES * h * HEAD_DIM * DTYPE_BYTES) for h in KV_HEADS)}"
        f" bytes per token for {', '.join(map(str, KV_HEADS))} KV heads)")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n} B"
