"""Which prefix blocks each instance holds, from its KV events (pure bookkeeping).

An instance publishes numbered batches (``KVEvents``: ``seq`` from 1 per ``epoch``, one
epoch per incarnation). Applied in order they rebuild its prefix cache's hashes exactly;
a missing batch (``gap``) leaves the view possibly wrong until it is repaired, by
reading the batches again or by a ``reset`` batch (the instance lists what it holds).
A stale view still routes (a wrong overlap costs a recompute, never a wrong token).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from kvstream.control import messages as m

__all__ = ["Applied", "PrefixIndex", "View"]

Applied = Literal["applied", "duplicate", "gap", "refused"]
MAX_RETIRED = 8  # epochs of one instance remembered as over (their late batches ignored)


class View:
    """One instance's prefix blocks as its events say, up to batch ``seq`` of ``epoch``."""

    def __init__(self, epoch: str, block_size: int) -> None:
        self.epoch, self.block_size = epoch, block_size
        self.seq = 0
        self.held: set[int] = set()
        self.stale = False  # a batch is missing: the view may be wrong until repaired
        self.overflow = 0  # stored hashes not kept (the view's bound)


class PrefixIndex:
    """Views of at most ``max_instances`` instances, each of at most ``max_blocks``
    hashes, ``max_total`` in all: a peer's flood of stores is bounded (the extra ones
    are counted, not kept), and when the table is full the view updated longest ago
    goes (instances come and go: a departed one's view must not crowd out a live one)."""

    def __init__(self, *, max_blocks: int = 1 << 20, max_instances: int = 4096,
                 max_total: int = 1 << 22) -> None:
        self.max_blocks, self.max_instances, self.max_total = max_blocks, max_instances, max_total
        self._views: OrderedDict[str, View] = OrderedDict()  # least recently updated first
        self._retired: OrderedDict[str, list[str]] = OrderedDict()
        self._total = 0  # hashes held over all views (but the one being applied)
        self.refused = 0  # hashes not kept (a view's or the index's bound)
        self.evicted = 0  # views dropped for room

    def apply(self, batch: m.KVEvents) -> Applied:
        """Apply one batch. ``gap``: applied, but a batch before it is missing (repair)."""
        iid = batch.instance_id
        view = self._views.get(iid)
        if view is None or view.epoch != batch.epoch:
            if batch.epoch in self._retired.get(iid, ()):
                return "duplicate"  # a late batch of an incarnation that is over
            if view is not None:
                self.forget(iid)
                retired = self._retired.setdefault(iid, [])
                retired.append(view.epoch)
                del retired[:-MAX_RETIRED]
                self._retired.move_to_end(iid)
                while len(self._retired) > self.max_instances:
                    self._retired.popitem(last=False)
            elif len(self._views) >= self.max_instances:
                self._evict()
            view = self._views[iid] = View(batch.epoch, batch.block_size)
        elif batch.seq <= view.seq:
            return "duplicate"
        gap = batch.seq != view.seq + 1 and not batch.reset
        self._views.move_to_end(iid)
        self._total -= len(view.held)  # counted again below
        if batch.reset:
            view.held.clear()
            view.stale = False
        view.seq, view.block_size = batch.seq, batch.block_size
        view.stale = view.stale or gap
        for event in batch.events:
            self._event(view, event)
        self._total += len(view.held)
        return "gap" if gap else "applied"

    def _event(self, view: View, event: m.KVEvent) -> None:
        if isinstance(event, m.Stored):
            new = [h for h in event.hashes if h not in view.held]
            while self._total + len(view.held) + len(new) > self.max_total and \
                    self._evict(but=view):
                pass
            room = min(self.max_blocks - len(view.held),
                       self.max_total - self._total - len(view.held))
            take = new[:max(0, room)]
            view.overflow += len(new) - len(take)
            self.refused += len(new) - len(take)
            view.held.update(take)
        elif isinstance(event, m.Removed):
            view.held.difference_update(event.hashes)
        else:
            view.held.clear()

    def _evict(self, but: View | None = None) -> bool:
        """Drop the view updated longest ago (not ``but``); False if there is none."""
        for iid, view in self._views.items():
            if view is not but:
                self.forget(iid)
                self.evicted += 1
                return True
        return False

    def retired(self, instance_id: str) -> list[str]:
        """The epochs of ``instance_id`` this index saw end (their batches are ignored)."""
        return list(self._retired.get(instance_id, ()))

    def overlap(self, instance_id: str, hashes: Sequence[int]) -> int:
        """How many of a prompt's blocks, from its first, ``instance_id`` holds (a prefix
        cache reuses a contiguous prefix only)."""
        view = self._views.get(instance_id)
        if view is None:
            return 0
        held = view.held
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def view(self, instance_id: str) -> View | None:
        return self._views.get(instance_id)

    def forget(self, instance_id: str) -> None:
        """Drop an instance's view (it left; or a repair rebuilds it from the stream)."""
        view = self._views.pop(instance_id, None)
        if view is not None:
            self._total -= len(view.held)

    def instances(self) -> list[str]:
        return list(self._views)

    def __len__(self) -> int:
        return len(self._views)
