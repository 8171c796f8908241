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
    key: bytes = b""  # the Ed25519 public key this incarnation signs with (identity.py)
    announced: bool = False  # the key came on the instance's own registry subject


class Registry:
    """What this agent knows of the other instances; pure bookkeeping, the clock injected.

    Bounded: at most ``max_peers`` entries. An instance dead for ``forget_after_s`` (30
    peer timeouts by default) is forgotten when room is needed; when every entry is live
    and the table is full, a new instance is refused and counted (``refused``), so a flood
    of announcements under new names cannot grow an agent without bound.
    """

    def __init__(self, *, peer_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 max_peers: int = 4096, forget_after_s: float | None = None) -> None:
        self.peer_timeout_s = peer_timeout_s
        self.max_peers = max_peers
        self.forget_after_s = 30 * peer_timeout_s if forget_after_s is None else forget_after_s
        self._clock = clock
        self._peers: dict[str, PeerInfo] = {}
        self.refused = 0
        self.keys_refused = 0

    def _room_for(self, instance_id: str) -> bool:
        if instance_id in self._peers or len(self._peers) < self.max_peers:
            return True
        now = self._clock()
        for iid in [i for i, p in self._peers.items()
                    if p.left or now - p.last_seen > self.forget_after_s]:
            del self._peers[iid]
        if len(self._peers) < self.max_peers:
            return True
        self.refused += 1
        return False

    def observe(self, announce: Announce) -> None:
        info = self._peers.get(announce.instance_id)
        if info is not None and not info.left:
            info.announce, info.last_seen = announce, self._clock()
        elif self._room_for(announce.instance_id):
            self._peers[announce.instance_id] = PeerInfo(
                announce=announce, last_seen=self._clock(), key=info.key if info else b"")

    def bind_key(self, instance_id: str, key: bytes, announced: bool = False) -> bool:
        """Is ``key`` the one ``instance_id`` signs with (identity.py)? ``announced``: it
        came on the instance's own registry subject. The first key seen is bound; an
        announced key replaces a tentative one at once, and an announced one once its
        incarnation left or fell silent (a restart); a tentative key never replaces an
        announced one. Refusals are counted (``keys_refused``)."""
        info = self._peers.get(instance_id)
        if info is None:
            if not self._room_for(instance_id):
                return False
            self._peers[instance_id] = PeerInfo(announce=None, last_seen=self._clock(), key=key,
                                                announced=announced)
            return True
        if info.key == key or not info.key:
            info.key = key
            info.announced = info.announced or announced
            return True
        alive = self.alive(instance_id)
        if (not announced and (info.announced or alive)) or (announced and info.announced
                                                             and alive):
            self.keys_refused += 1
            return False
        self._peers[instance_id] = PeerInfo(announce=None, last_seen=self._clock(), key=key,
                                            announced=announced)
        return True

    def key_of(self, instance_id: str) -> bytes | None:
        """The key bound to ``instance_id`` (None: none yet): what a message for it is
        boxed under (identity.py)."""
        info = self._peers.get(instance_id)
        return info.key if info is not None and info.key else None

    def contact(self, instance_id: str) -> None:
        """Any message from a peer proves it alive (and starts watching it)."""
        info = self._peers.get(instance_id)
        if info is None:
            if self._room_for(instance_id):
                self._peers[instance_id] = PeerInfo(announce=None, last_seen=self._clock())
        elif not info.left:
            info.last_seen = self._clock()

    def __len__(self) -> int:
        return len(self._peers)

    def leave(self, instance_id: str) -> None:
        info = self._peers.get(instance_id)
        if info is not None:
            info.left = True

    def address_ok(self, instance_id: str, address: bytes) -> bool:
        """Does a message of ``instance_id`` name the worker address it announces (or has
        it not announced one yet)?"""
        info = self._peers.get(instance_id)
        return info is None or info.announce is None or info.announce.worker_address == address

    def address_shared(self, address: bytes, but: str) -> bool:
        """Does a live instance other than ``but`` announce ``address`` (agents of one
        process share a UCX worker)? Then its endpoint must outlive ``but``."""
        return any(p.announce is not None and p.announce.worker_address == address
                   and self.alive(iid) for iid, p in self._peers.items() if iid != but)

    def get(self, instance_id: str) -> PeerInfo | None:
        return self._peers.get(instance_id)

    def announced(self, instance_id: str) -> Announce | None:
        """The instance's latest announcement (None before its first)."""
        info = self._peers.get(instance_id)
        return info.announce if info is not None else None

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
