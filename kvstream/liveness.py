"""Liveness: the agent's heartbeats (= registry announcements) and its watchdog.

A mixin of ``Agent``, kept apart because it is one job: noticing dead peers and overdue
transfers and ending them, whatever the transfer is doing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import anyio

from kvstream._exceptions import KVStreamError, PeerLostError
from kvstream.control import messages as m
from kvstream.streams import RecvStream
from kvstream.transfer import TransferState

if TYPE_CHECKING:
    from kvstream.agent import Agent

__all__ = ["Liveness"]

log = logging.getLogger("kvstream.agent")


class Liveness:
    async def _on_registry(self: Agent, msg: m.ControlUnion, headers: dict[str, str]) -> None:
        match msg:
            case m.Announce() if msg.instance_id != self.instance_id:
                self.registry.observe(msg)
            case m.Leave() if msg.instance_id != self.instance_id:
                self.registry.leave(msg.instance_id)
                self._fail_peer(msg.instance_id)
        return None

    async def _announce(self: Agent) -> None:
        self._seq += 1
        mem = self.memory
        await self._bus_().publish(self.subjects.registry(self.instance_id), m.Announce(
            instance_id=self.instance_id, role=self.config.role,
            worker_address=self.worker_address, layout=mem.layout if mem else self._layout,
            num_blocks=mem.num_blocks if mem else 0, load=float(len(self._streams)),
            heartbeat_s=self.config.heartbeat_s, seq=self._seq, endpoint=self.config.endpoint))

    async def _heartbeat_loop(self: Agent) -> None:
        while True:
            await anyio.sleep(self.config.heartbeat_s)
            try:
                await self._announce()
            except KVStreamError as exc:
                log.warning("heartbeat not sent: %s", exc)

    def _fail_peer(self: Agent, peer: str) -> None:
        reason = f"peer lost: {self.registry.why_dead(peer)}"
        self._lose_wanted(peer, [rid for src, rid in self._wanted if src == peer],
                          PeerLostError(reason, peer=peer), peer_dead=True)
        self._release_orphaned_offers()
        for stream in list(self._streams.values()):
            if stream.peer == peer and not (isinstance(stream, RecvStream) and stream.all_received):
                log.warning("%r: %s", stream.handle.transfer, reason)
                stream.stop(TransferState.FAILED, reason, peer_dead=True)

    async def _watchdog_loop(self: Agent) -> None:
        period = min(self.config.heartbeat_s, 0.25)
        while True:
            await anyio.sleep(period)
            now = time.monotonic()
            self._expire_leases(now)
            for src in {src for src, _ in self._wanted}:
                if not self.registry.alive(src):
                    self._fail_peer(src)
            for stream in list(self._streams.values()):
                t = stream.handle.transfer
                received = isinstance(stream, RecvStream) and stream.all_received
                if not received and not self.registry.alive(stream.peer):
                    self._fail_peer(stream.peer)
                elif now - t.started_at > (limit := t.deadline_s or self.config.transfer_timeout_s):
                    stream.stop(TransferState.TIMED_OUT, f"not done after {limit}s")
            for request_id, (stream, _) in list(self._unclaimed.items()):
                t = stream.handle.transfer
                if now - t.started_at > self.config.reservation_timeout_s:
                    del self._unclaimed[request_id]
                    self._count("staged_dropped", 1)
                    stream.stop(TransferState.TIMED_OUT, "staged push never claimed within "
                                f"{self.config.reservation_timeout_s}s; dropped")
            for handle in list(self._reservations.values()):
                if now - handle.transfer.started_at > self.config.reservation_timeout_s:
                    self._end_reservation(handle, TransferState.TIMED_OUT,
                                          f"no manifest within {self.config.reservation_timeout_s}s")

