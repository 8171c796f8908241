"""Leases kept at a source, the destination side of a pull.

One job: ``keep()`` asks a source to hold a request's blocks; the book says when each
source is due a renewal (a quarter of its shortest lease) and this part sends one
``Renew`` per source, not per request; a source that lets go loses the leases (and fails
the pulls) that depend on it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio

from kvstream._exceptions import (
    KVStreamError,
    LeaseExpiredError,
    NoPeerError,
    PeerLostError,
    ProtocolError,
    TransferAbortedError,
    TransferError,
)
from kvstream.control import messages as m
from kvstream.control.subjects import Subjects
from kvstream.engine.book import Kind, LoseLease
from kvstream.transfer.state import EndCause, TransferState

if TYPE_CHECKING:
    from kvstream.engine.book import Entry
    from kvstream.engine.core import Core

__all__ = ["Keeper", "RemoteLease"]

log = logging.getLogger("kvstream.agent")

_LOST: dict[EndCause, type[TransferError]] = {
    EndCause.PEER_LOST: PeerLostError, EndCause.PEER_ABORT: TransferAbortedError}


class RemoteLease:
    """Destination side: a source holds a request's blocks for us while this is active.

    The agent renews it with the source until ``release()`` or until a ``pull()`` of the
    same request takes it over; ``lost()`` returns the error once the source lets go
    (expired, aborted, died).
    """

    def __init__(self, keeper: Keeper, entry: Entry) -> None:
        self._keeper = keeper
        self._entry = entry
        self.src = entry.peer
        self.request_id = entry.request_id
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
        core = self._keeper.core
        if core.book.release_lease(self._entry) and self.error is None:
            await core.request_abort(self.src, "", reason, request_id=self.request_id,
                                     secret=self._entry.secret)

    def __repr__(self) -> str:
        state = "active" if self.active else ("released" if self.released else "lost")
        return f"<RemoteLease {self.request_id} at {self.src} {state}>"


class Keeper:
    def __init__(self, core: Core) -> None:
        self.core = core
        core.lease_lost = self._lease_lost

    def _lease_lost(self, action: LoseLease) -> None:
        lease: RemoteLease = action.entry.handle
        kind = _LOST.get(action.cause, LeaseExpiredError)
        lease._lose(kind(action.reason, request_id=lease.request_id, peer=lease.src))

    async def keep(self, request_id: str, src_instance: str, secret: str = "") -> RemoteLease:
        core = self.core
        Subjects.check_instance_id(src_instance)
        entry = core.book.keep(src_instance, request_id, core.clock(), secret)
        lease = entry.handle = RemoteLease(self, entry)
        try:
            reply = await core.control.request(
                core.subjects.control(src_instance),
                m.Renew(by=core.instance_id, request_ids=[request_id], secrets=[secret]),
                timeout=core.config.request_timeout_s, peer=src_instance)
            core.count("renewals_sent", 1)
            if not isinstance(reply, m.RenewAck):
                raise ProtocolError(f"unexpected answer to a renewal: {type(reply).__name__}")
            if request_id in reply.unknown:
                raise LeaseExpiredError(f"{src_instance} holds no KV for {request_id!r}",
                                        request_id=request_id, peer=src_instance)
        except BaseException:
            core.book.drop(entry)
            raise
        core.registry.contact(src_instance)
        core.book.confirmed_lease(entry, reply.lease_s)
        core.wake()
        return lease

    async def release(self, request_id: str, src_instance: str,
                      reason: str = "the destination no longer wants it",
                      secret: str = "") -> bool:
        core = self.core
        Subjects.check_instance_id(src_instance)
        entry = core.book.leases.get((src_instance, request_id))
        if entry is not None:
            await entry.handle.release(reason)
            return True
        return await core.request_abort(src_instance, "", reason, request_id=request_id,
                                        secret=secret)

    def kept(self, src: str, request_id: str) -> RemoteLease | None:
        entry = self.core.book.leases.get((src, request_id))
        return None if entry is None else entry.handle

    async def renew(self, src: str, rids: Sequence[str], secrets: Sequence[str]) -> None:
        core = self.core
        lease: float | None = None
        try:
            reply = await core.control.request(
                core.subjects.control(src),
                m.Renew(by=core.instance_id, request_ids=list(rids), secrets=list(secrets)),
                timeout=core.config.request_timeout_s, peer=src)
        except NoPeerError as exc:
            if exc.no_responders:  # nobody subscribed: the process is gone
                self.lose(src, rids, f"peer lost: {exc}", EndCause.PEER_LOST)
            else:  # slow, not gone: heartbeats decide that
                log.info("renewal with %s: %s", src, exc)
            return
        except KVStreamError as exc:
            log.info("renewal with %s: %s", src, exc)
            return
        else:
            if isinstance(reply, m.RenewAck):
                # The shortest lease among everything we renewed there sets our pace.
                lease = reply.lease_s
                core.registry.contact(src)
                if reply.unknown:
                    self.lose(src, reply.unknown, f"{src} no longer holds the KV (expired or "
                              "aborted there)", EndCause.LEASE_EXPIRED)
        finally:
            core.book.renewed(src, core.clock(), lease)
            core.wake()

    def lose(self, src: str, rids: Sequence[str], reason: str, cause: EndCause) -> None:
        """``src`` no longer holds these: lose their leases, fail their unfinished pulls."""
        core = self.core
        for rid in rids:
            entry = core.book.leases.get((src, rid)) or core.book.pulls.get((src, rid))
            if entry is None or (entry.kind is Kind.PULL and entry.received):
                continue
            core.end(entry, TransferState.FAILED, reason, cause,
                     peer_dead=cause is EndCause.PEER_LOST)

    def on_abort(self, msg: m.Abort) -> None:
        """The source ended what we kept there: the lease is lost now, not at renewal."""
        entry = self.core.book.leases.get((msg.by, msg.request_id))
        if entry is not None:
            self.core.end(entry, TransferState.ABORTED,
                          f"{msg.by} ended {msg.request_id!r}: {msg.reason}",
                          EndCause.PEER_ABORT)
