"""Liveness: heartbeats (registry announcements) and the one timer of the engine.

One job: noticing dead peers and what is overdue, and ending it. The book says when its
next deadline is (an expiry, a transfer deadline, a renewal); the timer sleeps until
then, or until the next heartbeat, or until a watched peer's silence would exceed the
peer timeout, or until someone opened something sooner (``wake``). No polling loop.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING

import anyio

from kvstream._exceptions import KVStreamError
from kvstream.control import messages as m
from kvstream.control.identity import SENDER, SUBJECT
from kvstream.engine.book import Renew

if TYPE_CHECKING:
    from kvstream.engine.core import Core
    from kvstream.engine.keeper import Keeper
    from kvstream.layout import KVLayout

__all__ = ["Liveness"]

log = logging.getLogger("kvstream.agent")


class Liveness:
    def __init__(self, core: Core, keeper: Keeper, layout: KVLayout | None) -> None:
        self.core = core
        self.keeper = keeper
        self.layout = layout
        self._seq = 0
        self._forgot_seen: dict[str, int] = {}  # peer -> its count of forgetting us
        self._last_hello = -math.inf
        self._hello_due = False  # a hello held back by the rate, sent once it allows
        self._wake = anyio.Event()
        core.wake = self._wake.set

    async def on_registry(self, msg: m.ControlUnion, headers: dict[str, str]) -> None:
        core = self.core
        iid = getattr(msg, "instance_id", None)
        if iid != headers.get(SENDER) or not isinstance(iid, str) or \
                headers.get(SUBJECT) != core.subjects.registry_prefix + iid:
            core.count("forbidden", 1)  # signed by, or sent on the subject of, another
            return None
        match msg:
            case m.Announce() if msg.instance_id != core.instance_id:
                self._forgotten_by(msg)
                before = core.registry.announced(iid)
                if before is not None and (before.shared != msg.shared or
                                           before.cuda_ipc != msg.cuda_ipc):
                    core.paths.forget(iid, before.shared)  # its KV moved: unmap the old
                if before is None:
                    self._hello()
                core.registry.observe(msg)
            case m.Leave() if msg.instance_id != core.instance_id:
                core.registry.leave(msg.instance_id)
                self.fail_peer(msg.instance_id)
        return None

    def _forgotten_by(self, msg: m.Announce) -> None:
        """The peer aborted its endpoint to us (it held us dead, or our sends stuck): ours
        to it is half dead, so drop it; the next transfer opens a fresh one. The first
        announcement we see of a peer only sets the count (an old incarnation's)."""
        core, peer = self.core, msg.instance_id
        count = msg.forgot.get(core.instance_id, 0)
        seen = self._forgot_seen.get(peer)
        if seen is None and len(self._forgot_seen) >= core.registry.max_peers:
            self._forgot_seen.pop(next(iter(self._forgot_seen)))
        self._forgot_seen[peer] = count
        if seen is not None and count > seen and \
                not core.registry.address_shared(msg.worker_address, peer):
            log.info("%s dropped its endpoint to us; dropping ours to it", peer)
            core.transport.forget_peer(msg.worker_address)

    def _hello(self) -> None:
        """A peer we had not heard announce: announce back now, so that a peer that
        started after our last announcement knows us (our data paths, our memory) within a
        round trip, not a heartbeat. At most four times a heartbeat, whoever joins: a peer
        that joins within that quarter is greeted once it is over (one hello for all of
        them), not left to the next heartbeat (an instance that leaves before that would
        never have been known to it)."""
        now = self.core.clock()
        gap = self.core.config.heartbeat_s / 4
        if now - self._last_hello >= gap:
            self._last_hello = now
            self.core.spawn(self.announce_soon)
        elif not self._hello_due:
            self._hello_due = True
            self.core.spawn(self._hello_later, self._last_hello + gap - now)

    async def _hello_later(self, delay: float) -> None:
        await anyio.sleep(delay)
        self._hello_due = False
        self._last_hello = self.core.clock()
        await self.announce_soon()

    async def announce_soon(self) -> None:
        """Announce now, not at the next heartbeat (what peers may map has changed)."""
        with contextlib.suppress(KVStreamError):
            await self.announce()

    async def announce(self) -> None:
        core = self.core
        self._seq += 1
        mem = core.memory
        await core.control.publish(core.subjects.registry(core.instance_id), m.Announce(
            instance_id=core.instance_id, role=core.config.role,
            worker_address=core.transport.address, layout=mem.layout if mem else self.layout,
            num_blocks=mem.num_blocks if mem else 0, load=float(len(core.book.streams)),
            heartbeat_s=core.config.heartbeat_s, seq=self._seq, endpoint=core.config.endpoint,
            forgot=dict(core.forgot), host=core.paths.host, tcp=core.paths.tcp_address,
            shared=core.paths.shared, cuda_ipc=core.paths.ipc.offer, tp=core.config.tp,
            kv_device="cpu" if mem and mem.device.type == "cpu" else "cuda" if mem else "",
            requests=core.requests, kv_used=core.kv_used, kv_epoch=core.kv_epoch,
            kv_seq=core.kv_seq, kv_events=core.kv_events_state))

    def fail_peer(self, peer: str) -> None:
        core = self.core
        before = core.registry.announced(peer)
        core.paths.forget(peer, before.shared if before is not None else None)
        why = core.registry.why_dead(peer)
        core.perform(core.book.peer_lost(peer, why, core.registry.alive))

    def _peer_deadline(self) -> float:
        """When the first peer something here depends on would count as dead."""
        registry = self.core.registry
        times = [math.inf]
        for peer in self.core.book.peers():
            info = registry.get(peer)
            if info is not None and registry.alive(peer):  # the dead are the book's already
                times.append(info.last_seen + registry.peer_timeout_s)
        return min(times)

    def tick(self) -> None:
        core = self.core
        actions = core.book.tick(core.clock(), core.registry.alive, core.registry.why_dead)
        core.perform([a for a in actions if not isinstance(a, Renew)])
        for action in actions:
            if isinstance(action, Renew):
                core.spawn(self.keeper.renew, action.src, action.request_ids, action.secrets)

    async def run(self) -> None:
        """The engine's one timer: heartbeats, expiries, deadlines, dead peers, renewals."""
        core = self.core
        next_beat = core.clock() + core.config.heartbeat_s
        while True:
            now = core.clock()
            if now >= next_beat:
                next_beat = now + core.config.heartbeat_s
                try:
                    await self.announce()
                except KVStreamError as exc:
                    log.warning("heartbeat not sent: %s", exc)
                core.sweep()
                live = core.registry.instances()
                core.paths.prune({a.shared.pid for a in live if a.shared is not None},
                                 {a.instance_id for a in live})
            self.tick()
            due = min(next_beat, core.book.next_deadline(), self._peer_deadline())
            core.timer_due = due
            # A deadline just passed is handled at the next turn; a tiny margin keeps the
            # clock comparison (now > deadline) from spinning on equality.
            wait = max(0.0, due - core.clock()) + 1e-3
            self._wake = anyio.Event()
            core.wake = self._wake.set
            with anyio.move_on_after(wait):
                await self._wake.wait()
