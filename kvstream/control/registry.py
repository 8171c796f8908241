"""Instance registry with liveness, fed by the announcements every agent publishes.

Heartbeats double as the registry: an instance is alive while its
announcements keep coming. This is what notices a dead peer on shared-memory
UCX endpoints, which run without UCX's own error handling (PERF.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from kvstream.control.messages import Announce

__all__ = ["PeerInfo", "Registry"]


class PeerInfo(msgspec.Struct, kw_only=True):
    announce: Announce | None
    last_seen: float
    left: bool = False


class Registry:
    """What this agent knows of the other instances; pure bookkeeping, the clock injected."""

    def __init__(self, *, peer_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.peer_timeout_s = peer_timeout_s
        self._clock = clock
        self._peers: dict[str, PeerInfo] = {}

    def observe(self, announce: Announce) -> None:
        self._peers[announce.instance_id] = PeerInfo(announce=announce, last_seen=self._clock())

    def contact(self, instance_id: str) -> None:
        """Any message from a peer proves it alive (and starts watching it)."""
        info = self._peers.get(instance_id)
        if info is None:
            self._peers[instance_id] = PeerInfo(announce=None, last_seen=self._clock())
        elif not info.left:
            info.last_seen = self._clock()

    def leave(self, instance_id: str) -> None:
        info = self._peers.get(instance_id)
        if info is not None:
            info.left = True

    def get(self, instance_id: str) -> PeerInfo | None:
        return self._peers.get(instance_id)

    def alive(self, instance_id: str) -> bool:
        info = self._peers.get(instance_id)
        if info is None or info.left:
            return False
        return self._clock() - info.last_seen <= self.peer_timeout_s

    def why_dead(self, instance_id: str) -> str:
        info = self._peers.get(instance_id)
        if info is None:
            return f"instance {instance_id} never announced itself"
        if info.left:
            return f"instance {instance_id} shut down"
        silent = self._clock() - info.last_seen
        return f"instance {instance_id} silent for {silent:.1f}s (limit {self.peer_timeout_s}s)"

    def instances(self, role: str | None = None) -> list[Announce]:
        return [
            p.announce for iid, p in self._peers.items()
            if p.announce is not None and self.alive(iid)
            and (role is None or p.announce.role in (role, "both"))
        ]
