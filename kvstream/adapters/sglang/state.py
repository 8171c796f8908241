"""SGLang's side state (``KVArgs.state_*``): buffers indexed apart from the KV pages.

Hybrid and quantized models keep per-request state beside their KV: Mamba's conv and
temporal state (one slot per request), a sliding-window sub-pool's pages, MXFP8 block
scales (one item per page), a DSA indexer's pages, a request row. SGLang lists them as
components (``state_types[i]``, its buffers ``state_data_*[i]``, an item per index) and
passes each request's indices per component with the last chunk (prefill) and with its
metadata (decode), the same components in the same order on both sides.

An agent registers one KV memory of one block mapping, so each component's buffers of
one item size (and count) are a layout of their own (``Group``: a "layer" per buffer, a
"block" per item) registered by an agent of their own on the manager's loop
(``AgentRuntime.add``, instance ``<rank's instance>-s<g>``). The prefill offers each
group's items under the request's id, the decode pulls them into its indices, and the
decode reports ``Success`` only once the pages and every group have landed.

What moves between other TP degrees depends on how a component splits over the ranks
(``Group.split``, SGLang's own rules for its mooncake backend): an MLA model's side state
is the same on every rank (``REPLICATED``: read whole from the one rank its latent comes
from); an MHA model's SWA sub-pool holds K/V pages like the main pool's (``HEADS``: each
rank's KV heads, through the same transfer plans, NHD pages only); the rest (Mamba state,
sliced by SGLang by heads and channels; an MHA model's block scales) is a rank's own bytes
of a split kvstream does not know (``ITEM``): verbatim between equal TP degrees only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import msgspec

from kvstream._exceptions import AdapterError
from kvstream.adapters.sglang.memory import kv_buffers, kvs_layout, wrap
from kvstream.layout import KVLayout
from kvstream.transfer.plan import TpInfo

if TYPE_CHECKING:
    import torch

    from kvstream.adapters.runtime import AgentRuntime
    from kvstream.config import AgentConfig
    from kvstream.engine.agent import Agent

__all__ = ["EXACT", "HEADS", "ITEM", "MOVED", "REPLICATED", "Group", "SideState",
           "group_instance", "side_groups", "split_of", "state_lists"]

# Components whose indices name items one to one (SGLang's own backends move the same
# through their generic and Mamba paths). The rest (DSA_TAIL's ring descriptor, QSA,
# MiniMax, DeepSeek-V4's rings) index otherwise: refused by name.
MOVED: Final = frozenset({"mamba", "swa", "dsa", "block_scale", "block_scale_swa",
                          "request_row"})
# Position- or request-indexed: both sides' index counts must agree. Paged ones (SWA,
# DSA, block scales) may differ by a page at the window's edge: the shorter count moves,
# as SGLang's own backends do.
EXACT: Final = frozenset({"mamba", "request_row"})
MAX_COMPONENTS: Final = 16
MAX_GROUPS: Final = 32  # each one agent; a Ready names at most 64
# How a component's items split over the TP ranks (what may move between TP degrees)
ITEM: Final = "item"  # a rank's own bytes, split some way kvstream does not know
REPLICATED: Final = "replicated"  # the same bytes on every rank
HEADS: Final = "heads"  # K/V pages of NHD token rows, the rank's KV heads of them


@dataclass(frozen=True)
class Group:
    """One component's buffers of one item size and count: one agent's KV memory."""

    component: int
    kind: str
    layout: KVLayout
    tensors: list[torch.Tensor]
    items: int
    split: str = ITEM


def _kind(t: Any) -> str:
    return str(getattr(t, "value", t))


def split_of(kind: str, *, mla: bool, heads: int, swa_layout: str | None) -> str:
    """How SGLang splits component ``kind`` over TP: an MLA model's side state is the same
    on every rank (Mamba's aside: SGLang slices it by heads and channels); an MHA model's
    SWA pages hold its ``heads`` KV heads per token row (known, NHD order only)."""
    if kind == "mamba":
        return ITEM
    if mla:
        return REPLICATED
    if kind == "swa" and heads > 0 and swa_layout in (None, "nhd"):
        return HEADS
    return ITEM


def side_groups(args: Any, device: str, gpu_id: int = 0, *, mla: bool = False,
                heads: int = 0) -> tuple[list[str], list[Group]]:
    """The components' kinds and their groups, SGLang's order (equal on both sides).
    Buffers of no bytes (a layer without that state) are left out, on both sides alike.
    ``heads``: the KV heads a token row of this rank's main pages holds (0: unknown)."""
    kinds = [_kind(t) for t in (getattr(args, "state_types", None) or [])]
    if len(kinds) > MAX_COMPONENTS:
        raise AdapterError(f"{len(kinds)} side-state components (at most {MAX_COMPONENTS})")
    other = sorted(set(kinds) - MOVED)
    if other:
        raise AdapterError(f"kvstream's SGLang backend does not move side state {other} yet "
                           f"(it moves {sorted(MOVED)})")
    swa_layout = getattr(args, "swa_kv_cache_layout", None)
    kv_item = int(next(iter(getattr(args, "kv_item_lens", None) or [0])))
    groups: list[Group] = []
    for i, kind in enumerate(kinds):
        ptrs, lens, items = (list(args.state_data_ptrs[i]), list(args.state_data_lens[i]),
                             list(args.state_item_lens[i]))
        if not len(ptrs) == len(lens) == len(items):
            raise AdapterError(f"side state {kind}: pointers, lengths and item sizes disagree")
        split = split_of(kind, mla=mla, heads=heads, swa_layout=swa_layout)
        if split == HEADS:
            group = _paged(i, kind, ptrs, lens, items, int(args.page_size), heads, kv_item,
                           device, gpu_id)
            if group is not None:
                groups.append(group)
                continue
            split = ITEM  # not pages like the main pool's: verbatim, equal TP only
        by: dict[tuple[int, int], list[torch.Tensor]] = {}
        for ptr, ln, item in zip(ptrs, lens, items, strict=True):
            if not ln or not item:
                continue
            if item < 0 or ln % item:
                raise AdapterError(f"side state {kind}: a buffer of {ln} bytes is not whole "
                                   f"items of {item}")
            by.setdefault((item, ln // item), []).append(
                wrap(ptr, ln, device, gpu_id).view(ln // item, 1, item))
        for (item, n), tensors in by.items():
            layout = KVLayout(num_layers=len(tensors), num_kv_heads=1, head_dim=item,
                              block_size=1, dtype="uint8", arrangement="mla")
            groups.append(Group(component=i, kind=kind, layout=layout, tensors=tensors,
                                items=n, split=split))
    if len(groups) > MAX_GROUPS:
        raise AdapterError(f"side state in {len(groups)} buffer groups (at most {MAX_GROUPS}: "
                           "each is an agent of its own)")
    return kinds, groups


def _paged(component: int, kind: str, ptrs: list[int], lens: list[int], items: list[int],
           page_size: int, heads: int, kv_item: int, device: str, gpu_id: int) -> Group | None:
    """A component laid out as the main pool is (K of each layer, then V; pages of the main
    pool's size, so of its heads), as one group sliced by heads; None if it is not."""
    if not ptrs or 0 in lens or set(items) != {kv_item}:
        return None
    try:
        layout, pages = kvs_layout(lens, items, page_size, False, heads=heads)
    except AdapterError:
        return None
    tensors = kv_buffers(ptrs, lens, layout, pages, device, gpu_id)
    # a "block" is a page of block_size tokens: its items are the SGLang pages
    return Group(component=component, kind=kind, layout=layout, tensors=tensors, items=pages,
                 split=HEADS)


def group_instance(instance: str, group: int) -> str:
    return f"{instance}-s{group}"


def state_lists(state_indices: Any, components: int) -> list[list[int]]:
    """SGLang's per-component indices (arrays, lists, a Mamba slot wrapped in a list, None
    for a component it has nothing for) as lists of ints, one per component."""
    if state_indices is None or (components == 0 and not state_indices):
        return [[] for _ in range(components)]
    import numpy as np

    if len(state_indices) != components:
        raise AdapterError(f"side state indices for {len(state_indices)} components, "
                           f"{components} registered")
    out: list[list[int]] = []
    for x in state_indices:
        if x is None:
            out.append([])
            continue
        try:
            out.append([int(v) for v in np.asarray(x, dtype=np.int64).reshape(-1)])
        except (TypeError, ValueError) as exc:
            raise AdapterError(f"side state indices {x!r} are not integers") from exc
    return out


def moved_counts(kinds: list[str], mine: list[list[int]], theirs: list[int]) -> list[int]:
    """How many items of each component move: both counts for position-indexed kinds
    (else AdapterError), the shorter for paged ones."""
    if len(theirs) != len(mine):
        raise AdapterError(f"side state of {len(theirs)} components there, {len(mine)} here")
    out = []
    for kind, idx, n in zip(kinds, mine, theirs, strict=True):
        if kind in EXACT and len(idx) != n:
            raise AdapterError(f"side state {kind}: {len(idx)} items here, {n} there")
        out.append(min(len(idx), n))
    return out


class SideState:
    """A manager's side-state groups, each registered by an agent on its loop."""

    def __init__(self, rt: AgentRuntime, config: AgentConfig, kinds: list[str],
                 groups: list[Group]) -> None:
        self.kinds, self.groups = kinds, groups
        # ITEM and REPLICATED groups: one opaque "latent" per item, read whole (an ITEM
        # group only from the same rank of an equal TP degree: checked by both sides
        # before a byte moves); HEADS groups: the main pool's heads, planned like its pages.
        tp = config.tp or TpInfo()
        whole = TpInfo(rank=tp.rank, size=tp.size, total_kv_heads=0)
        self.agents: list[Agent] = [
            rt.add(msgspec.structs.replace(config, instance_id=group_instance(
                config.instance_id, g), tp=tp if grp.split == HEADS else whole),
                grp.layout, grp.tensors)
            for g, grp in enumerate(groups)]

    def equal_tp_only(self) -> list[str]:
        """The kinds whose items move only between equal TP degrees."""
        return sorted({g.kind for g in self.groups if g.split == ITEM})

    def describe(self) -> str:
        return ", ".join(f"{g.kind} ({g.split}): {g.layout.num_layers} x {g.items} items of "
                         f"{g.layout.block_bytes} B" for g in self.groups)
