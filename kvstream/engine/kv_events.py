"""An instance's KV events: the prefix blocks it stored and removed, published in
numbered batches into the namespace's JetStream stream, for routers (issue 20).

The engine (or its adapter) says what its prefix cache did (``stored``, ``removed``,
``cleared``); the log coalesces, batches and publishes (``KVEvents``: ``seq`` 1, 2, ...
per ``epoch``, one epoch per incarnation, the first batch a ``reset``). It also keeps
the set of hashes held (bounded), so it can list them afresh: after a batch it could not
store, when a router asks (``KVResync``, at most once per ``RESYNC_PAUSE_S``), and when
more has been published since the last listing than twice what is held (compaction). A
listing rolls up the instance's subject in the stream: a router reads what holds now,
not the instance's history. Its latest epoch and batch number go in its heartbeat, so
a router also learns of a lost last batch.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable

import anyio

from kvstream._exceptions import ConfigError, KVStreamError
from kvstream.control import messages as m
from kvstream.control.stream import kv_events_stream
from kvstream.engine.core import Core

__all__ = ["KVEventLog"]

log = logging.getLogger("kvstream.kv_events")

MAX_BATCH_HASHES = 8192  # ~75 KiB of MessagePack: far below NATS's payload limit
RESYNC_PAUSE_S = 5.0
_HASH_MAX = (1 << 63) - 1


def _hashes(hashes: Iterable[int]) -> list[int]:
    out = [int(h) for h in hashes]
    if any(h < 0 or h > _HASH_MAX for h in out):
        raise ConfigError("block hashes are 63-bit non-negative ints (kvstream.prefix)")
    return out


class KVEventLog:
    """Use ``agent.kv_events``. ``stored``/``removed``/``cleared`` return at once; a
    background task publishes every ``flush_s`` (or when ``MAX_BATCH_HASHES`` wait)."""

    def __init__(self, core: Core, block_size: int, *, flush_s: float = 0.05,
                 max_pending: int = 1 << 18, max_held: int = 1 << 20) -> None:
        if not 1 <= block_size <= 1 << 16:
            raise ConfigError(f"block_size {block_size} is not 1..65536")
        self.core, self.block_size, self.flush_s = core, block_size, flush_s
        self.max_pending, self.max_held = max_pending, max_held
        self.epoch = secrets.token_urlsafe(12)
        self.seq = 0
        self.held: dict[int, None] = {}  # insertion-ordered set of the hashes held
        self._pending: list[m.KVEvent] = []
        self._pending_hashes = 0
        self._resync = True  # the first batch: a reset (this incarnation held nothing)
        self._last_resync = -RESYNC_PAUSE_S
        self._resync_due: float | None = None  # a listing asked for, when it may go out
        self._since_reset = 0  # hashes published since the last listing (compaction)
        self._wake = anyio.Event()
        self._stream = kv_events_stream(core.subjects)
        self.published = 0  # batches stored
        self.failed = 0  # batches the stream did not take (a resync followed)
        self.untracked = 0  # stored hashes beyond ``max_held`` (published, not kept)

    # -- what the engine says -------------------------------------------------------
    def stored(self, hashes: Iterable[int]) -> None:
        new = _hashes(hashes)
        for h in new:
            if h not in self.held:
                if len(self.held) < self.max_held:
                    self.held[h] = None
                else:
                    self.untracked += 1
        self._add(m.Stored, new)

    def removed(self, hashes: Iterable[int]) -> None:
        gone = _hashes(hashes)
        for h in gone:
            self.held.pop(h, None)
        self._add(m.Removed, gone)

    def cleared(self) -> None:
        self.held.clear()
        self._pending.clear()
        self._pending_hashes = 0
        self._pending.append(m.Cleared())
        self._wake.set()

    def resync(self, reason: str = "") -> None:
        """List every block held afresh (a ``reset`` batch): at the next flush, or, if
        one was listed less than ``RESYNC_PAUSE_S`` ago, once that pause is over (a
        flood of requests costs one listing per pause, and none is lost)."""
        if self._resync_due is None:
            log.info("%s: listing its %d prefix blocks afresh (%s)", self.core.instance_id,
                     len(self.held), reason or "asked")
            self._resync_due = max(self.core.clock(), self._last_resync + RESYNC_PAUSE_S)
            self._wake.set()

    def _add(self, kind: type[m.Stored] | type[m.Removed], hashes: list[int]) -> None:
        if not hashes:
            return
        if self._pending_hashes + len(hashes) > self.max_pending:
            # More than a router could be told in time: list what is held instead.
            self._pending.clear()
            self._pending_hashes = 0
            self._resync = True
        else:
            for i in range(0, len(hashes), m.MAX_EVENT_HASHES):
                self._pending.append(kind(hashes[i:i + m.MAX_EVENT_HASHES]))
            self._pending_hashes += len(hashes)
        if self._pending_hashes >= MAX_BATCH_HASHES or self._resync:
            self._wake.set()

    # -- publishing -----------------------------------------------------------------
    async def run(self) -> None:
        """Publish until cancelled (the agent's task group); after a batch the stream did
        not take, wait longer each time (0.2 s doubling to 5 s, whatever the engine does
        meanwhile) before the listing that repairs it. Nothing here ends the agent."""
        backoff = 0.0
        while True:
            if backoff:
                await anyio.sleep(backoff)
            else:
                with anyio.move_on_after(self.flush_s):
                    await self._wake.wait()
            self._wake = anyio.Event()
            due = self._resync_due
            if due is not None and due <= self.core.clock():
                self._resync_due = None
                self._last_resync = self.core.clock()
                self._resync = True
            try:
                ok = await self.flush()
            except Exception:  # a bug here must not take the agent down: relist later
                log.exception("%s: publishing KV events failed", self.core.instance_id)
                self._resync, ok = True, False
            backoff = 0.0 if ok else min(5.0, max(0.2, backoff * 2))

    async def flush(self) -> bool:
        """Publish what waits: a ``reset`` listing when due, else the pending events.
        False if the stream did not take a batch (the next flush lists every block)."""
        if self._since_reset > 2 * len(self.held) + MAX_BATCH_HASHES:
            self._resync = True  # compaction: the stream then keeps the listing only
        reset = self._resync
        if reset:
            self._resync = False
            self._since_reset = 0
            self._pending.clear()
            self._pending_hashes = 0
            held = list(self.held)
            events: list[m.KVEvent] = [m.Stored(held[i:i + m.MAX_EVENT_HASHES])
                                       for i in range(0, len(held), m.MAX_EVENT_HASHES)]
        else:
            events, self._pending, self._pending_hashes = self._pending, [], 0
            if not events:
                return True
        for batch in _batches(events):
            self.seq += 1
            msg = m.KVEvents(instance_id=self.core.instance_id, epoch=self.epoch,
                             seq=self.seq, block_size=self.block_size, events=batch,
                             reset=reset)
            reset = False
            try:
                # A reset rolls up the subject: the stream keeps what holds from here on.
                await self.core.control.persist(
                    self.core.subjects.kv_events(self.core.instance_id), msg, self._stream,
                    rollup=msg.reset)
            except KVStreamError as exc:
                # Lost: routers see the gap; the next flush lists everything held.
                self.failed += 1
                self._resync = True
                log.warning("%s: KV events batch %d not stored (%s); listing its blocks "
                            "afresh next", self.core.instance_id, self.seq, exc)
                return False
            self.published += 1
            self._since_reset += sum(len(e.hashes) for e in batch
                                     if isinstance(e, (m.Stored, m.Removed)))
            self.core.kv_epoch, self.core.kv_seq = self.epoch, self.seq  # in the heartbeat
        return True


def _batches(events: list[m.KVEvent]) -> list[list[m.KVEvent]]:
    """At most ``MAX_EVENTS`` events and about ``MAX_BATCH_HASHES`` hashes per batch; at
    least one batch (a reset of nothing is still said)."""
    out: list[list[m.KVEvent]] = [[]]
    count = 0
    for e in events:
        n = len(e.hashes) if isinstance(e, (m.Stored, m.Removed)) else 0
        if out[-1] and (len(out[-1]) >= m.MAX_EVENTS or count + n > MAX_BATCH_HASHES):
            out.append([])
            count = 0
        out[-1].append(e)
        count += n
    return out
