"""Liveness: heartbeats (registry announcements) and the one timer of the engine.

One job: noticing dead peers and what is overdue, and ending it. The book says when its
next deadline is (an expiry, a transfer deadline, a renewal); the timer sleeps until
then, or until the next heartbeat, or until a watched peer's silence would exceed the
peer timeout, or until someone opened something sooner (``wake``). No polling loop.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import anyio

from kvstream._exceptions import KVStreamError
from kvstream.control import messages as m
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
        self._wake = anyio.Event()
        core.wake = self._wake.set

    async def on_registry(self, msg: m.ControlUnion, headers: dict[str, str]) -> None:
        core = self.core
        match msg:
            case m.Announce() if msg.instance_id != core.instance_id:
                core.registry.observe(msg)
            case m.Leave() if msg.instance_id != core.instance_id:
                core.registry.leave(msg.instance_id)
                self.fail_peer(msg.instance_id)
        return None

    async def announce(self) -> None:
        core = self.core
        self._seq += 1
        mem = core.memory
        await core.control.publish(core.subjects.registry(core.instance_id), m.Announce(
            instance_id=core.instance_id, role=core.config.role,
            worker_address=core.transport.address, layout=mem.layout if mem else self.layout,
            num_blocks=mem.num_blocks if mem else 0, load=float(len(core.book.streams)),
            heartbeat_s=core.config.heartbeat_s, seq=self._seq, endpoint=core.config.endpoint))

    def fail_peer(self, peer: str) -> None:
        core = self.core
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
                core.spawn(self.keeper.renew, action.src, action.request_ids)

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
            self.tick()
            due = min(next_beat, core.book.next_deadline(), self._peer_deadline())
            # A deadline just passed is handled at the next turn; a tiny margin keeps the
            # clock comparison (now > deadline) from spinning on equality.
            wait = max(0.0, due - core.clock()) + 1e-3
            self._wake = anyio.Event()
            core.wake = self._wake.set
            with anyio.move_on_after(wait):
                await self._wake.wait()
