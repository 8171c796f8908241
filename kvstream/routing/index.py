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
    """Views of up to ``max_instances`` instances, each of at most ``max_blocks`` hashes
    (a peer's flood of stores is bounded: the extra ones are counted, not kept)."""

    def __init__(self, *, max_blocks: int = 1 << 20, max_instances: int = 4096) -> None:
        self.max_blocks, self.max_instances = max_blocks, max_instances
        self._views: OrderedDict[str, View] = OrderedDict()
        self._retired: dict[str, list[str]] = {}
        self.refused = 0

    def apply(self, batch: m.KVEvents) -> Applied:
        """Apply one batch. ``gap``: applied, but a batch before it is missing (repair)."""
        iid = batch.instance_id
        view = self._views.get(iid)
        if view is None or view.epoch != batch.epoch:
            if batch.epoch in self._retired.get(iid, ()):
                return "duplicate"  # a late batch of an incarnation that is over
            if view is None and iid not in self._views and \
                    len(self._views) >= self.max_instances:
                self.refused += 1
                return "refused"
            if view is not None:
                retired = self._retired.setdefault(iid, [])
                retired.append(view.epoch)
                del retired[:-MAX_RETIRED]
            view = self._views[iid] = View(batch.epoch, batch.block_size)
        elif batch.seq <= view.seq:
            return "duplicate"
        gap = batch.seq != view.seq + 1 and not batch.reset
        if batch.reset:
            view.held.clear()
            view.stale = False
        view.seq, view.block_size = batch.seq, batch.block_size
        view.stale = view.stale or gap
        for event in batch.events:
            self._event(view, event)
        self._views.move_to_end(iid)
        return "gap" if gap else "applied"

    def _event(self, view: View, event: m.KVEvent) -> None:
        if isinstance(event, m.Stored):
            room = self.max_blocks - len(view.held)
            if len(event.hashes) > room:
                view.overflow += len(event.hashes) - max(0, room)
            view.held.update(event.hashes[:max(0, room)])
        elif isinstance(event, m.Removed):
            view.held.difference_update(event.hashes)
        else:
            view.held.clear()

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
        self._views.pop(instance_id, None)

    def instances(self) -> list[str]:
        return list(self._views)

    def __len__(self) -> int:
        return len(self._views)
