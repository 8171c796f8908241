"""Transfer plans between layouts that differ (issue 18): which source ranks feed which
destination heads, and the conversion between each side's cache and one canonical wire.

The **wire order** of one layer is ``[kv, tokens, heads, head_dim]`` (K then V; MLA has
``kv = 1``), tokens counted from the request's first token, in the sender's dtype. Each
side converts only between its own layout and the wire (``pack`` / ``unpack``), so any
block size, arrangement and head slice meets any other; equal layouts keep the verbatim
block path and never come here.

A ``Shard`` is what one instance holds: its per-rank ``KVLayout`` plus the model-wide KV
head count and its tensor-parallel rank and degree, from which its head range follows
as vLLM and SGLang split heads: with ``tp <= total`` rank ``r`` holds heads
``[r * total / tp, (r + 1) * total / tp)``; with ``tp > total`` each head is replicated over
``tp / total`` ranks and rank ``r`` holds head ``r * total // tp``. MLA's one latent is on
every rank. ``plan`` says, for one destination shard, which source shard sends which of
its heads (one source per head, the lowest rank holding it), or why it cannot
(``incompatibility``: different layer counts, head dims, model head counts, MLA against
K/V, a dtype that cannot be converted): refused before any byte moves.

Pure: torch views and copies, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from kvstream._exceptions import LayoutError
from kvstream.layout import DTYPE_BYTES, FP8_DTYPES, KVLayout

if TYPE_CHECKING:
    import torch

__all__ = ["Part", "Reshape", "Shard", "TpInfo", "incompatibility", "pack", "plan",
           "reshape_for", "token_view", "unpack"]

_Small = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]


class TpInfo(msgspec.Struct, frozen=True, kw_only=True):
    """An instance's place in its engine's tensor parallelism, as announced.
    ``total_kv_heads`` 0: the layout's heads times ``size`` (no replication)."""

    rank: _Small = 0
    size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 1
    total_kv_heads: _Small = 0

    def shard(self, layout: KVLayout) -> Shard:
        """``LayoutError`` if the layout does not fit this share of the model."""
        total = self.total_kv_heads or (1 if layout.kv_factor == 1
                                        else layout.num_kv_heads * self.size)
        return Shard(layout=layout, total_kv_heads=total, tp_rank=self.rank,
                     tp_size=self.size)


class Shard(msgspec.Struct, frozen=True, kw_only=True):
    """One instance's share of a model's KV: its layout (``num_kv_heads`` = heads it holds)
    and where those heads sit among ``total_kv_heads``."""

    layout: KVLayout
    total_kv_heads: int
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        lay, total, tp = self.layout, self.total_kv_heads, self.tp_size
        if not (total >= 1 and tp >= 1 and 0 <= self.tp_rank < tp):
            raise LayoutError(f"bad shard: rank {self.tp_rank} of {tp}, {total} KV heads")
        if lay.kv_factor == 1:
            if total != 1 or lay.num_kv_heads != 1:
                raise LayoutError("an MLA shard holds the one latent: total_kv_heads=1")
            return
        if tp <= total and total % tp:
            raise LayoutError(f"{total} KV heads do not split over TP {tp}")
        if tp > total and tp % total:
            raise LayoutError(f"TP {tp} does not replicate {total} KV heads evenly")
        want = max(1, total // tp)
        if lay.num_kv_heads != want:
            raise LayoutError(f"rank {self.tp_rank} of TP {tp} over {total} KV heads holds "
                              f"{want}, its layout says {lay.num_kv_heads}")

    @property
    def head_start(self) -> int:
        """The first model-wide KV head this rank holds."""
        total, tp = self.total_kv_heads, self.tp_size
        if self.layout.kv_factor == 1:
            return 0
        return self.tp_rank * total // tp if tp > total else self.tp_rank * (total // tp)

    @property
    def heads(self) -> range:
        return range(self.head_start, self.head_start + self.layout.num_kv_heads)

    def describe(self) -> str:
        return (f"TP rank {self.tp_rank}/{self.tp_size} heads [{self.heads.start}, "
                f"{self.heads.stop}) of {self.total_kv_heads}: {self.layout.describe()}")


class Part(msgspec.Struct, frozen=True, kw_only=True):
    """Source ``source`` (an index into the plan's sources) sends its local heads
    ``[src_head, src_head + heads)``, landing at the destination's local ``dst_head``."""

    source: int
    src_head: int
    dst_head: int
    heads: int


_CONVERTIBLE = frozenset({"float16", "bfloat16", "float32"})


def incompatibility(src: Shard, dst: Shard) -> str | None:
    """Why ``src``'s KV cannot feed ``dst`` at all (None: a plan exists), naming both."""
    a, b = src.layout, dst.layout
    why = None
    if a.num_layers != b.num_layers:
        why = f"{a.num_layers} layers against {b.num_layers}"
    elif a.head_dim != b.head_dim:
        why = f"head_dim {a.head_dim} against {b.head_dim}"
    elif a.kv_factor != b.kv_factor:
        why = "an MLA latent cannot become separate K and V (or the reverse)"
    elif src.total_kv_heads != dst.total_kv_heads:
        why = f"the models have {src.total_kv_heads} and {dst.total_kv_heads} KV heads"
    elif a.dtype != b.dtype and not (a.dtype in _CONVERTIBLE and b.dtype in _CONVERTIBLE):
        why = (f"{a.dtype} cannot become {b.dtype}"
               + (" (an FP8 cache moves only into the same FP8 dtype, with its scales)"
                  if {a.dtype, b.dtype} & FP8_DTYPES else ""))
    return None if why is None else \
        f"cannot map {src.describe()} onto {dst.describe()}: {why}"


def plan(dst: Shard, sources: Sequence[Shard]) -> list[Part]:
    """The parts that fill every head ``dst`` holds, one source per head (the first in
    ``sources`` that holds it), runs of heads merged. ``LayoutError`` if a source is
    incompatible or a head is held by none."""
    for src in sources:
        if (why := incompatibility(src, dst)) is not None:
            raise LayoutError(why)
    parts: list[Part] = []
    for local, head in enumerate(dst.heads):
        owner = next((i for i, s in enumerate(sources) if head in s.heads), None)
        if owner is None:
            raise LayoutError(f"no source holds KV head {head} for {dst.describe()} "
                              f"(sources: {[list(s.heads) for s in sources]})")
        src_head = head - sources[owner].head_start
        last = parts[-1] if parts else None
        if last is not None and last.source == owner and \
                last.src_head + last.heads == src_head and last.dst_head + last.heads == local:
            parts[-1] = msgspec.structs.replace(last, heads=last.heads + 1)
        else:
            parts.append(Part(source=owner, src_head=src_head, dst_head=local, heads=1))
    return parts


class Reshape(msgspec.Struct, frozen=True, kw_only=True):
    """One transfer between unequal layouts, as both ends derive it: the request's first
    ``tokens`` tokens, source-local heads ``[src_head, src_head + heads)`` landing at the
    destination's local ``dst_head``, on the wire in ``dtype`` (the source's)."""

    tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]
    src_head: _Small
    dst_head: _Small
    heads: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    dtype: Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "uint8"]
    # One message per layer, [header | wire] (both ends' KV in host memory), rather than a
    # header and the wire: the initiator decides, the other end accepts it only for host KV.
    single: bool = False

    def layer_bytes(self, layout: KVLayout) -> int:
        """Bytes of one layer on the wire (either end's layout: kv and head_dim agree)."""
        return layout.kv_factor * self.tokens * self.heads * layout.head_dim * \
            DTYPE_BYTES[self.dtype]


def reshape_for(src: Shard, dst: Shard, tokens: int) -> Reshape:
    """The one-source transfer that fills every head ``dst`` holds from ``src``;
    ``LayoutError`` if they cannot be mapped, or ``dst`` needs heads of other sources too
    (a destination rank gathering from several prefill ranks: not one transfer)."""
    if (why := incompatibility(src, dst)) is not None:
        raise LayoutError(why)
    if not (src.heads.start <= dst.heads.start and dst.heads.stop <= src.heads.stop):
        raise LayoutError(f"{dst.describe()} needs KV heads of several sources; "
                          f"{src.describe()} holds only some of them")
    parts = plan(dst, [src])
    return Reshape(tokens=tokens, src_head=parts[0].src_head, dst_head=parts[0].dst_head,
                   heads=parts[0].heads, dtype=src.layout.dtype)  # type: ignore[arg-type]  # KVLayout checked it


def token_view(t: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """One layer's cache as ``[kv, num_blocks, block_size, heads, head_dim]``, a view of
    the same memory (no copy) for every arrangement."""
    nb, bs = layout.num_blocks_of(tuple(t.shape)), layout.block_size
    h, d = layout.num_kv_heads, layout.head_dim
    arr = layout.arrangement
    if arr == "flash_nhd":  # [2, nb, bs, h, d]
        return t
    if arr == "flash_hnd":  # [2, nb, h, bs, d]
        return t.permute(0, 1, 3, 2, 4)
    if arr == "blocks_first_nhd":  # [nb, 2, bs, h, d]
        return t.permute(1, 0, 2, 3, 4)
    if arr == "cpu_hnbc":  # [nb, h, bs, 2d], in memory [nb, h, 2, bs, d]
        return t.view(nb, h, 2, bs, d).permute(2, 0, 3, 1, 4)
    if arr == "mla":  # [nb, bs, d]
        return t.view(1, nb, bs, 1, d)
    raise LayoutError(f"no token view of arrangement {arr!r}")


def _blocks(layout: KVLayout, block_ids: Sequence[int], tokens: int,
            device: torch.device) -> tuple[torch.Tensor, int, int]:
    """The request's block ids as a tensor, how many are full, how many tokens the last
    (partial) one holds."""
    import torch

    bs = layout.block_size
    need = -(-tokens // bs)
    if tokens < 0 or len(block_ids) < need:
        raise LayoutError(f"{tokens} tokens need {need} blocks of {bs}, got {len(block_ids)}")
    ids = torch.as_tensor(list(block_ids[:need]), dtype=torch.int64, device=device)
    return ids, tokens // bs, tokens % bs


def _check_heads(heads: range, layout: KVLayout) -> None:
    if heads.step != 1 or not 0 <= heads.start <= heads.stop <= layout.num_kv_heads:
        raise LayoutError(f"heads {heads} outside the {layout.num_kv_heads} held")


def pack(t: torch.Tensor, layout: KVLayout, block_ids: Sequence[int], tokens: int,
         heads: range | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``tokens`` tokens of a request whose blocks are ``block_ids`` (in order),
    heads ``heads`` (local indices; all by default), in wire order
    ``[kv, tokens, len(heads), head_dim]``: into ``out`` (contiguous, that shape) or a new
    tensor. Whole blocks move as one gather per K/V half, the partial last block apart."""
    import torch

    heads = heads if heads is not None else range(layout.num_kv_heads)
    _check_heads(heads, layout)
    view = token_view(t, layout)[..., heads.start:heads.stop, :]  # [kv, nb, bs, n, d]
    kv, bs = view.shape[0], layout.block_size
    if out is None:
        out = torch.empty((kv, tokens, len(heads), layout.head_dim), dtype=t.dtype,
                          device=t.device)
    ids, full, tail = _blocks(layout, block_ids, tokens, t.device)
    for k in range(kv):
        if full:
            torch.index_select(view[k], 0, ids[:full],
                               out=out[k, :full * bs].view(full, bs, *out.shape[2:]))
        if tail:
            out[k, full * bs:].copy_(view[k, int(ids[full]), :tail])
    return out


def unpack(wire: torch.Tensor, t: torch.Tensor, layout: KVLayout, block_ids: Sequence[int],
           dst_head: int = 0) -> None:
    """Write a wire tensor ``[kv, tokens, n, head_dim]`` into the destination's blocks
    ``block_ids`` at local heads ``[dst_head, dst_head + n)``, converting the dtype; the
    slots past the last token of a partial last block are left as they were."""
    kv, tokens, n, d = wire.shape
    if (kv, d) != (layout.kv_factor, layout.head_dim) or \
            not 0 <= dst_head <= dst_head + n <= layout.num_kv_heads:
        raise LayoutError(f"a wire of {tuple(wire.shape)} does not fit heads from {dst_head} "
                          f"of {layout.describe()}")
    view = token_view(t, layout)[..., dst_head:dst_head + n, :]  # [kv, nb, bs, n, d]
    bs = layout.block_size
    ids, full, tail = _blocks(layout, block_ids, tokens, t.device)
    wire = wire.to(t.dtype)
    for k in range(kv):
        if full:
            view[k].index_copy_(0, ids[:full], wire[k, :full * bs].view(full, bs, n, d))
        if tail:
            view[k, int(ids[full]), :tail].copy_(wire[k, full * bs:])
