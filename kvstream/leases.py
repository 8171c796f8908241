"""Leases: an offer held for a puller, kept alive by batched renewals.

A mixin of ``Agent``, one job, both ends of a lease. Source: renew on request, expire
what nobody renewed, release offers whose keepers died, tell keepers when an offer ends.
Destination: ``keep()`` and every pull in progress renew their source every quarter of
its shortest lease, one ``Renew`` per source, not per request.
"""


from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import anyio

from kvstream._exceptions import (
    DuplicateRequestError,
    IncompatiblePeerError,
    InvalidBlockError,
    KVStreamError,
    LeaseExpiredError,
    NoPeerError,
    PeerLostError,
    ProtocolError,
    TransferAbortedError,
)
from kvstream.control import messages as m
from kvstream.control.subjects import Subjects
from kvstream.streams import RecvStream
from kvstream.transfer import TransferState

if TYPE_CHECKING:

    from kvstream.agent import Agent


PULL_MODES = ("eager", "lazy")

# What a peer's Reject code means to the engine (push and pull alike).
REJECT_ERRORS: dict[str, type[KVStreamError]] = {
    "incompatible": IncompatiblePeerError,
    "invalid_blocks": InvalidBlockError,
    "malformed": ProtocolError,
}



__all__ = ["Leases", "RemoteLease"]

log = logging.getLogger("kvstream.agent")


class RemoteLease:
    """Destination side: a source holds a request's blocks for us while this is active.

    The agent renews it with the source until ``release()`` or until a ``pull()`` of the
    same request takes it over; ``lost()`` returns the error once the source lets go
    (expired, aborted, died).
    """

    def __init__(self, agent: Agent, src: str, request_id: str) -> None:
        self._agent = agent
        self.src = src
        self.request_id = request_id
        self.error: KVStreamError | None = None
        self.released = False
        self._lost = anyio.Event()

    @property
    def active(self) -> bool:
        return self.error is None and not self.released

    def _lose(self, error: KVStreamError) -> None:
        if self.error is None and not self.released:
            self.error = error
            self._lost.set()

    def _hand_over(self) -> None:
        """A pull of the same request took the lease over: this object's job is done."""
        self.released = True
        self._lost.set()

    async def lost(self) -> KVStreamError | None:
        """Wait until the source no longer holds the blocks for this lease; returns why
        (None: released, or taken over by a pull)."""
        await self._lost.wait()
        return self.error

    async def release(self, reason: str = "the destination no longer wants it") -> None:
        """Stop renewing and tell the source it may free the blocks now."""
        if self.released:
            return
        self.released = True
        self._lost.set()
        agent = self._agent
        if agent._wanted.get((self.src, self.request_id)) is self:
            del agent._wanted[(self.src, self.request_id)]
            if self.error is None:
                await agent._request_abort(self.src, "", reason, request_id=self.request_id)

    def __repr__(self) -> str:
        state = "active" if self.active else ("released" if self.released else "lost")
        return f"<RemoteLease {self.request_id} at {self.src} {state}>"


class Leases:
    async def _on_renew(self: Agent, msg: m.Renew) -> m.ControlMessage:
        now = time.monotonic()
        unknown: list[str] = []
        leases: list[float] = []
        for rid in msg.request_ids:
            handle = self._held.get(rid)
            if handle is None and rid in self._pulled:
                handle = self._pulled[rid].handle
            if handle is None:
                unknown.append(rid)
                continue
            handle.lease_until = now + handle.lease_s
            handle.keepers.add(msg.by)
            leases.append(handle.lease_s)
        self.registry.contact(msg.by)
        return m.RenewAck(unknown=unknown, lease_s=min(leases, default=self.config.lease_s))

    def _expire_leases(self: Agent, now: float) -> None:
        """Release what nobody renewed or whose keepers died (the watchdog calls this)."""
        self._release_orphaned_offers()
        for rid, handle in list(self._held.items()):
            if now > handle.lease_until:
                del self._held[rid]
                if handle.transfer.finish(TransferState.EXPIRED, f"lease of {handle.lease_s}s "
                                          "expired: nobody pulled or renewed it"):
                    self._count("expired", 1)
        for stream in list(self._pulled.values()):
            if now > stream.handle.lease_until:
                stream.stop(TransferState.EXPIRED,
                            f"lease of {stream.handle.lease_s}s expired mid-pull")

    def _end_held(self: Agent, request_id: str, state: TransferState, reason: str, *,
                  tell: bool = True) -> bool:
        handle = self._held.pop(request_id, None)
        if handle is None:
            return False
        if handle.transfer.finish(state, reason):
            self._count(state.value, 1)
        if tell and handle.keepers and self._tg is not None:
            # Whoever keeps a lease on it learns now, not at its next renewal.
            for keeper in handle.keepers:
                self._tg.start_soon(self._tell_keeper, keeper, request_id, reason)
        return True

    async def _tell_keeper(self: Agent, keeper: str, request_id: str, reason: str) -> None:
        with contextlib.suppress(KVStreamError):
            await self._bus_().publish(self.subjects.control(keeper), m.Abort(
                transfer_id="", request_id=request_id, reason=reason, by=self.instance_id))

    def _on_held_abort(self: Agent, msg: m.Abort) -> None:
        """An Abort naming no running transfer: an offer's keeper gave it up, a pull that
        failed after it was sent, or (here as a keeper) the source ended what we kept."""
        held = self._held.get(msg.request_id)
        if held is not None and msg.transfer_id in ("", held.transfer_id):
            # Anyone may end an offer nobody pulls yet (a proxy whose decode leg failed,
            # ``release_offer``); keepers other than the sender learn now, not at renewal.
            self._end_held(msg.request_id, TransferState.ABORTED,
                           f"aborted by {msg.by}: {msg.reason}", tell=bool(held.keepers - {msg.by}))
        pulled = self._pulled.get(msg.request_id)
        if pulled is not None and not msg.transfer_id and pulled.peer == msg.by:
            pulled.stop(TransferState.ABORTED, f"aborted by {msg.by}: {msg.reason}",
                        by_peer=True)
        kept = self._wanted.get((msg.by, msg.request_id))
        if isinstance(kept, RemoteLease):
            del self._wanted[(msg.by, msg.request_id)]
            kept._lose(TransferAbortedError(f"{msg.by} ended {msg.request_id!r}: {msg.reason}",
                                            request_id=msg.request_id, peer=msg.by))

    def _release_orphaned_offers(self: Agent) -> None:
        """Offers whose every keeper died are released now, not at lease expiry."""
        for rid, handle in list(self._held.items()):
            if handle.keepers and not any(self.registry.alive(k) for k in handle.keepers):
                self._end_held(rid, TransferState.FAILED, "peer lost: every instance keeping "
                               f"its lease ({', '.join(sorted(handle.keepers))}) is gone",
                               tell=False)

    # -- the destination side ----------------------------------------------------------

    async def keep(self: Agent, request_id: str, src_instance: str) -> RemoteLease:
        """Ask ``src_instance`` to keep holding ``request_id``'s blocks until we pull.

        Raises ``LeaseExpiredError`` if it no longer holds them and ``NoPeerError`` if
        nobody answers. The agent renews the lease until ``release()`` or a ``pull()``.
        """
        Subjects.check_instance_id(src_instance)
        key = (src_instance, request_id)
        if key in self._wanted:
            raise DuplicateRequestError(f"{request_id!r} at {src_instance} is already kept or pulled",
                                        request_id=request_id, peer=src_instance)
        lease = RemoteLease(self, src_instance, request_id)
        self._wanted[key] = lease
        try:
            reply = await self._bus_().request(
                self.subjects.control(src_instance),
                m.Renew(by=self.instance_id, request_ids=[request_id]),
                timeout=self.config.request_timeout_s, peer=src_instance)
            self._count("renewals_sent", 1)
            if not isinstance(reply, m.RenewAck):
                raise ProtocolError(f"unexpected answer to a renewal: {type(reply).__name__}")
            if request_id in reply.unknown:
                raise LeaseExpiredError(f"{src_instance} holds no KV for {request_id!r}",
                                        request_id=request_id, peer=src_instance)
        except BaseException:
            if self._wanted.get(key) is lease:
                del self._wanted[key]
            raise
        self._note_lease(src_instance, reply.lease_s)
        self.registry.contact(src_instance)
        return lease

    async def release(self: Agent, request_id: str, src_instance: str,
                      reason: str = "the destination no longer wants it") -> bool:
        """Tell ``src_instance`` to free the blocks it holds for ``request_id`` now, whether
        this agent kept a lease on them or not (an engine that will never pull: its request
        ended, or its own prefix cache had every block). Returns whether the source
        acknowledged (it then holds nothing for the request, whatever it held before); a
        running pull is not touched (abort its handle instead)."""
        Subjects.check_instance_id(src_instance)
        wanted = self._wanted.get((src_instance, request_id))
        if isinstance(wanted, RemoteLease):
            await wanted.release(reason)
            return True
        return await self._request_abort(src_instance, "", reason, request_id=request_id)

    async def _lease_loop(self: Agent) -> None:
        """Renew every lease we still want: one message per source per quarter lease."""
        last: dict[str, float] = {}
        busy: set[str] = set()

        async def renew(src: str, rids: list[str]) -> None:
            try:
                await self._renew(src, rids)
            finally:
                busy.discard(src)

        while True:
            await anyio.sleep(min(self.config.heartbeat_s, 0.25))
            now = time.monotonic()
            by_src: dict[str, list[str]] = {}
            for src, rid in self._wanted:
                by_src.setdefault(src, []).append(rid)
            for src, rids in by_src.items():
                period = self._peer_lease.get(src, self.config.lease_s) / 4
                if src not in busy and now - last.get(src, 0.0) >= period:
                    last[src] = now
                    busy.add(src)
                    assert self._tg is not None
                    self._tg.start_soon(renew, src, rids)

    async def _renew(self: Agent, src: str, rids: list[str]) -> None:
        try:
            reply = await self._bus_().request(
                self.subjects.control(src), m.Renew(by=self.instance_id, request_ids=rids),
                timeout=self.config.request_timeout_s, peer=src)
        except NoPeerError as exc:
            if exc.no_responders:  # nobody subscribed: the process is gone
                self._lose_wanted(src, rids, PeerLostError(f"peer lost: {exc}", peer=src),
                                  peer_dead=True)
            else:  # slow, not gone: heartbeats decide that
                log.info("renewal with %s: %s", src, exc)
            return
        except KVStreamError as exc:
            log.info("renewal with %s: %s", src, exc)
            return
        self._count("renewals_sent", 1)
        if isinstance(reply, m.RenewAck):
            # The shortest lease among everything we renewed there sets our pace.
            self._peer_lease[src] = reply.lease_s or self.config.lease_s
            self.registry.contact(src)
            if reply.unknown:
                self._lose_wanted(src, reply.unknown, LeaseExpiredError(
                    f"{src} no longer holds the KV (expired or aborted there)", peer=src))

    def _lose_wanted(self: Agent, src: str, rids: Iterable[str], error: KVStreamError, *,
                     peer_dead: bool = False) -> None:
        for rid in rids:
            item = self._wanted.get((src, rid))
            if isinstance(item, RemoteLease):
                del self._wanted[(src, rid)]
                item._lose(error)
            elif isinstance(item, RecvStream) and not item.all_received:
                item.stop(TransferState.FAILED, str(error), peer_dead=peer_dead)

    def _note_lease(self: Agent, src: str, lease_s: float) -> None:
        lease = lease_s or self.config.lease_s
        self._peer_lease[src] = min(self._peer_lease.get(src, lease), lease)

    # -- shared ------------------------------------------------------------------------
