"""The transfer book: everything an agent holds for its transfers, as pure bookkeeping.

Synchronous and free of I/O: the engine's parts report events to it with the time passed
in (a reservation made, a manifest bound, a renewal, a peer lost, time going by, an end
decided, a transfer finished) and perform the actions it returns (stop a stream, finish a
transfer that has none, tell a keeper, lose a lease, renew). The book owns the rules:

* an entry ends exactly once: the first end decided wins, and ``finished`` (reported by
  the transfer's release hook) takes it out of every table, once;
* an ending entry leaves its request's table at once (a new reservation, offer or pull of
  the same request may start) but keeps counting against its bound until it has
  finished, because until then its stream may still hold memory;
* a push nobody reserved for yet (STAGED: anyone with a key can send one) counts apart
  from ``max_transfers``, within bounds of its own (``max_staged`` in all,
  ``max_staged_per_peer`` per sender), so strangers never take the room of what this
  agent expects (reservations, its pulls, pushes and offers); claiming it moves it in;
* no action names an entry after it finished;
* ``next_deadline`` says when ``tick`` next has work, so one timer drives it;
* a **shared offer** (``readers`` > 1: decode ranks that each pull their heads of one
  prefill rank's offer) serves each reader as a SERVE entry of its own, its ``parent``;
  the offer completes when every reader completed, fails with the first reader that
  fails (stopping the others: the request's KV is whole or useless), and finishes, so
  releases its blocks, only after its last reader finished.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvstream._exceptions import CapacityError, DuplicateRequestError
from kvstream.engine.actions import Action, Finish, LoseLease, Renew, Stop, TellKeeper
from kvstream.engine.entry import Entry, Kind
from kvstream.transfer.state import EndCause, TransferState

__all__ = ["Action", "Book", "Entry", "Finish", "Held", "Kind", "LoseLease", "Renew", "Stop",
           "TellKeeper", "secret_matches"]

Alive = Callable[[str], bool]


COUNTERS: Final = ("completed", "failed", "aborted", "timed_out", "expired", "bytes_sent",
                   "bytes_received", "bytes_skipped", "staged_dropped", "renewals_sent",
                   "forbidden", "data_discarded", "refused_unsolicited",
                   "refused_unsolicited_sender", "forged_frames", "frames_sent",
                   "frames_received", "copy_jobs")


@dataclass
class Held:
    """What unsolicited (staged) pushes hold: entries in the book, bytes of staging."""

    entries: int = 0
    nbytes: int = 0


def secret_matches(entry: Entry, secret: str) -> bool:
    """Does ``secret`` open this offer? (constant time; an offer made without one is open)"""
    return not entry.secret or hmac.compare_digest(entry.secret.encode(), secret.encode())


class Book:
    def __init__(self, *, max_transfers: int, reservation_timeout_s: float,
                 transfer_timeout_s: float, lease_s: float, renew_every: float = 0.25,
                 max_staged: int | None = None, max_staged_per_peer: int | None = None) -> None:
        """``max_staged`` (default a quarter of ``max_transfers``) and
        ``max_staged_per_peer`` (default a quarter of that): bounds of their own for
        unsolicited pushes, at least 1 each."""
        self.max_transfers = max_transfers
        self.max_staged = max(1, max_staged if max_staged is not None else max_transfers // 4)
        self.max_staged_per_peer = max(1, max_staged_per_peer if max_staged_per_peer
                                       is not None else self.max_staged // 4)
        self._unsolicited = Held()
        self._unsolicited_by: dict[str, Held] = {}  # sender -> what its staged pushes hold
        self.reservation_timeout_s = reservation_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.lease_s = lease_s
        self.renew_every = renew_every  # of the shortest lease a source grants
        self.receiving: dict[str, Entry] = {}  # request id -> RESERVATION | STAGED | RECEIVE
        self.offers: dict[str, Entry] = {}  # request id -> OFFER | SERVE
        self.pulls: dict[tuple[str, str], Entry] = {}  # (source, request id) -> PULL
        self.leases: dict[tuple[str, str], Entry] = {}  # (source, request id) -> LEASE
        self.pushes: set[Entry] = set()
        self.streams: dict[str, Entry] = {}  # transfer id -> entry with a stream
        # transfer id -> a push whose manifest is not answered yet: an Abort from its
        # destination can overtake the answer, and must end it, not be acknowledged idly
        self._negotiating: dict[str, Entry] = {}
        # Every entry not finished yet, ending or not, in the order they opened.
        self.live: dict[Entry, None] = {}
        self._active = 0
        self.peer_lease: dict[str, float] = {}  # source -> the shortest lease it granted
        self._renewed_at: dict[str, float] = {}
        self._renewing: set[str] = set()
        self._noted: dict[str, float] = {}  # leases learnt while a renewal was in flight
        self.counts = dict.fromkeys(COUNTERS, 0)

    # -- opening ---------------------------------------------------------------------
    @property
    def active(self) -> int:
        """What counts against ``max_transfers``: every unfinished entry but leases and
        unsolicited (staged) pushes."""
        return self._active

    def unsolicited(self, peer: str | None = None) -> Held:
        """What unfinished staged pushes hold (ending ones too: their streams may still
        hold buffers): all of them, or ``peer``'s. A copy."""
        held = self._unsolicited if peer is None else self._unsolicited_by.get(peer, Held())
        return Held(held.entries, held.nbytes)

    def _check_room(self) -> None:
        if self.active >= self.max_transfers:
            raise CapacityError(f"max_transfers={self.max_transfers} reached",
                                what="transfers", limit=self.max_transfers)

    def _open(self, entry: Entry) -> Entry:
        if entry.kind is Kind.STAGED:
            self._check_unsolicited(entry.peer)
        elif entry.kind is not Kind.LEASE:
            self._check_room()
        self.live[entry] = None
        entry.slot = entry.kind not in (Kind.LEASE, Kind.STAGED)
        self._active += entry.slot
        if entry.kind is Kind.STAGED:
            self._hold(entry, 1)
        return entry

    def _check_unsolicited(self, peer: str) -> None:
        if self._unsolicited.entries >= self.max_staged:
            raise CapacityError(f"{self.max_staged} pushes nobody reserved for are staged "
                                "already", what="staged transfers", limit=self.max_staged)
        held = self._unsolicited_by.get(peer)
        if held is not None and held.entries >= self.max_staged_per_peer:
            raise CapacityError(f"{peer} has {held.entries} pushes nobody reserved for staged "
                                f"already (at most {self.max_staged_per_peer} per sender)",
                                what="staged transfers per sender",
                                limit=self.max_staged_per_peer)

    def _hold(self, entry: Entry, sign: int) -> None:
        """Count a staged push in (+1) or out (-1) of the unsolicited bounds."""
        for held in (self._unsolicited, self._unsolicited_by.setdefault(entry.peer, Held())):
            held.entries += sign
            held.nbytes += sign * entry.staged_bytes
        if not self._unsolicited_by[entry.peer].entries:
            del self._unsolicited_by[entry.peer]

    def reserve(self, request_id: str, now: float) -> Entry:
        if request_id in self.receiving:
            raise DuplicateRequestError(f"request {request_id!r} already has a reservation",
                                        request_id=request_id)
        entry = self._open(Entry(Kind.RESERVATION, request_id, opened_at=now,
                                 claim_by=now + self.reservation_timeout_s))
        self.receiving[request_id] = entry
        return entry

    def stage(self, request_id: str, transfer_id: str, peer: str, now: float,
              promised: Iterable[int] = (), nbytes: int = 0) -> Entry:
        """A push arrived before its reservation: it waits in staging (``nbytes`` of it),
        unbound, until claimed or ``reservation_timeout_s`` passes. CapacityError when the
        unsolicited bounds (all, or ``peer``'s) are reached."""
        if request_id in self.receiving:
            raise DuplicateRequestError(f"request {request_id!r} already has a staged push",
                                        request_id=request_id)
        entry = self._open(Entry(Kind.STAGED, request_id, peer=peer, transfer_id=transfer_id,
                                 opened_at=now, promised=list(promised), staged_bytes=nbytes,
                                 claim_by=now + self.reservation_timeout_s))
        self.receiving[request_id] = entry
        return entry

    def bind(self, entry: Entry, transfer_id: str, peer: str) -> None:
        """A manifest arrived for a reservation, or the engine claimed a staged push: the
        claimed push is expected now, so it moves into ``max_transfers`` (CapacityError,
        and it stays staged, when that is full of what the engine expects already)."""
        assert entry.kind in (Kind.RESERVATION, Kind.STAGED) and entry.ending is None
        if entry.kind is Kind.STAGED:
            self._check_room()
            self._hold(entry, -1)
            entry.slot = True
            self._active += 1
        entry.kind = Kind.RECEIVE
        entry.transfer_id, entry.peer = transfer_id, peer
        entry.claim_by = math.inf

    def push(self, request_id: str, transfer_id: str, peer: str, now: float) -> Entry:
        entry = self._open(Entry(Kind.PUSH, request_id, peer=peer, transfer_id=transfer_id,
                                 opened_at=now))
        self.pushes.add(entry)
        self._negotiating[transfer_id] = entry
        return entry

    def offer(self, request_id: str, transfer_id: str, lease_s: float, now: float,
              secret: str = "", readers: int = 0) -> Entry:
        if request_id in self.offers:
            raise DuplicateRequestError(f"request {request_id!r} is already offered",
                                        request_id=request_id)
        entry = self._open(Entry(Kind.OFFER, request_id, transfer_id=transfer_id, opened_at=now,
                                 lease_s=lease_s, lease_until=now + lease_s, secret=secret,
                                 readers=readers))
        self.offers[request_id] = entry
        return entry

    def serve(self, entry: Entry, peer: str, now: float) -> None:
        """The offer is being pulled by ``peer``; its lease keeps running."""
        assert entry.kind is Kind.OFFER and entry.ending is None
        entry.kind, entry.peer = Kind.SERVE, peer
        entry.lease_until = now + entry.lease_s

    def serve_reader(self, offer: Entry, peer: str, transfer_id: str, now: float,
                     readers: int) -> Entry:
        """One of ``readers`` readers of a shared offer starts (the first fixes the count):
        a SERVE entry of its own, counted against ``max_transfers`` (the first takes over
        the offer's slot); the offer's lease restarts, as a pull restarts a plain one's."""
        assert offer.kind is Kind.OFFER and offer.ending is None and readers > 1
        assert offer.readers in (0, readers)
        if any(c.peer == peer for c in offer.children):
            raise DuplicateRequestError(f"{peer} already pulled {offer.request_id!r}",
                                        request_id=offer.request_id, peer=peer)
        if len(offer.children) >= readers:
            raise DuplicateRequestError(f"{offer.request_id!r} was pulled by all its "
                                        f"{readers} readers", request_id=offer.request_id)
        handover = offer.slot and not offer.children
        if handover:
            offer.slot, self._active = False, self._active - 1
        try:
            child = self._open(Entry(Kind.SERVE, offer.request_id, peer=peer,
                                     transfer_id=transfer_id, opened_at=now,
                                     lease_s=offer.lease_s, lease_until=now + offer.lease_s,
                                     secret=offer.secret, parent=offer))
        except CapacityError:
            if handover:
                offer.slot, self._active = True, self._active + 1
            raise
        offer.readers = readers
        offer.children.append(child)
        offer.lease_until = now + offer.lease_s
        return child

    def pull(self, src: str, request_id: str, now: float, secret: str = "") -> Entry:
        key = (src, request_id)
        if key in self.pulls:
            raise DuplicateRequestError(f"{request_id!r} at {src} is already being pulled",
                                        request_id=request_id, peer=src)
        entry = self._open(Entry(Kind.PULL, request_id, peer=src, opened_at=now, secret=secret))
        self.pulls[key] = entry
        return entry

    def keep(self, src: str, request_id: str, now: float, secret: str = "") -> Entry:
        key = (src, request_id)
        if key in self.leases or key in self.pulls:
            raise DuplicateRequestError(f"{request_id!r} at {src} is already kept or pulled",
                                        request_id=request_id, peer=src)
        entry = self._open(Entry(Kind.LEASE, request_id, peer=src, opened_at=now, secret=secret))
        self.leases[key] = entry
        return entry

    def streaming(self, entry: Entry, transfer_id: str, now: float,
                  deadline_s: float | None) -> None:
        """A stream now runs for ``entry``; the transfer's deadline counts from ``now``."""
        entry.streaming = True
        if self._negotiating.get(entry.transfer_id) is entry:
            del self._negotiating[entry.transfer_id]
        entry.transfer_id = transfer_id
        entry.limit_s = deadline_s or self.transfer_timeout_s
        entry.deadline = now + entry.limit_s
        if not entry.finished:
            self.streams[transfer_id] = entry

    def received_all(self, entry: Entry) -> None:
        entry.received = True

    # -- leases ----------------------------------------------------------------------
    def renew(self, by: str, request_ids: Sequence[str], secrets: Sequence[str],
              now: float) -> tuple[list[str], float]:
        """Source side: a keeper renewed these offers; returns (unknown, shortest lease).

        A renewal without the offer's secret is refused (counted ``forbidden``) and answered
        like one for an offer that does not exist: the answer tells nothing."""
        unknown: list[str] = []
        leases: list[float] = []
        for i, rid in enumerate(request_ids):
            entry = self.offers.get(rid)
            if entry is None or now > entry.lease_until:  # a late renewal revives nothing
                unknown.append(rid)
                continue
            if not secret_matches(entry, secrets[i] if i < len(secrets) else ""):
                self.counts["forbidden"] += 1
                unknown.append(rid)
                continue
            entry.lease_until = now + entry.lease_s
            entry.keepers.add(by)
            for child in entry.children:  # a reader renews its own serve too
                if child.peer == by and child.ending is None:
                    child.lease_until = now + child.lease_s
            leases.append(entry.lease_s)
        return unknown, min(leases, default=self.lease_s)

    def confirmed_lease(self, entry: Entry, lease_s: float) -> None:
        """The source answered ``keep``: from now on its death loses the lease."""
        entry.confirmed = True
        self.note_lease(entry.peer, lease_s)

    def note_lease(self, src: str, lease_s: float) -> None:
        """Destination side: ``src`` holds what we keep for ``lease_s``; renew in time."""
        lease = lease_s or self.lease_s
        self.peer_lease[src] = min(self.peer_lease.get(src, lease), lease)
        if src in self._renewing:  # the answer in flight may not cover it: keep the shorter
            self._noted[src] = min(self._noted.get(src, lease), lease)

    def renewed(self, src: str, now: float, lease_s: float | None = None) -> None:
        """A renewal at ``src`` is over (answered or not); with its lease if it answered."""
        self._renewing.discard(src)
        noted = self._noted.pop(src, math.inf)
        if lease_s is not None:
            self.counts["renewals_sent"] += 1
            self.peer_lease[src] = min(lease_s or self.lease_s, noted)
        elif noted < math.inf:
            self.peer_lease[src] = min(self.peer_lease.get(src, noted), noted)

    def release_lease(self, entry: Entry) -> bool:
        """Stop keeping a lease (released, or a pull took it over); False if already gone."""
        return self.drop(entry)

    def drop(self, entry: Entry) -> bool:
        """Forget ``entry`` uncounted: a lease let go, a pull that never got a transfer."""
        if entry.finished:
            return False
        self._forget(entry)
        return True

    # -- ending ----------------------------------------------------------------------
    def end(self, entry: Entry, state: TransferState, reason: str,
            cause: EndCause | None = None, *, peer_dead: bool = False,
            tell: bool = True) -> list[Action]:
        """Decide ``entry``'s end. The first decision wins; a later one only escalates a
        stream's stop to "the peer is dead" (its endpoint must be aborted)."""
        if entry.finished:
            return []
        cause = cause or EndCause.of(state, reason)
        if entry.ending is not None:
            if peer_dead and entry.streaming and not entry.peer_dead:
                entry.peer_dead = True
                return [Stop(entry, state, reason, cause, peer_dead=True)]
            return []
        entry.ending = (state, reason)
        entry.cause = cause
        entry.peer_dead = peer_dead
        self._unindex(entry)
        actions: list[Action] = []
        if entry.kind is Kind.LEASE:
            self._forget(entry)
            return [LoseLease(entry, reason, cause)]
        if tell and entry.kind is Kind.OFFER and not (
                entry.children and state is TransferState.COMPLETED):
            # A pull's puller is its peer: it knows (a shared offer's readers too, and a
            # shared offer every reader completed is news to no keeper).
            readers = {c.peer for c in entry.children}
            actions += [TellKeeper(k, entry.request_id, reason)
                        for k in sorted(entry.keepers - readers)]
        live = [c for c in entry.children if not c.finished]
        if live:  # a shared offer: its blocks stay until its last reader has stopped
            # Their peers did not end them (whatever ended the offer): each stream tells its
            # own peer, waits for its answer, and only then lets the blocks go.
            theirs = EndCause.ENGINE_ABORT if cause in (EndCause.PEER_ABORT,
                                                        EndCause.PEER_LOST) else cause
            for child in live:
                actions += self.end(child, state, f"the shared offer ended: {reason}", theirs)
            return actions  # its Finish comes from ``reader_finished``
        if entry.streaming:
            actions.append(Stop(entry, state, reason, cause, peer_dead=peer_dead))
        else:
            actions.append(Finish(entry, state, reason, cause))
        return actions

    def finished(self, entry: Entry, state: TransferState) -> bool:
        """The entry's transfer ended (its release hook): out of the book, counted, once."""
        if entry.finished:
            return False
        self._forget(entry)
        # A shared offer's readers count their own ends; the offer counts only an end none
        # of them had (it expired, or was aborted, with no reader running).
        shared = entry.children and (state is TransferState.COMPLETED or entry.reader_failed)
        if state.value in self.counts and not shared:
            self.counts[state.value] += 1
        return True

    def reader_finished(self, child: Entry, state: TransferState, reason: str,
                        cause: EndCause) -> list[Action]:
        """A reader of a shared offer finished (after ``finished``): the offer completes
        with its last reader, fails with its first failed one, and finishes once none of
        its readers runs."""
        offer = child.parent
        if offer is None or offer.finished:
            return []
        offer.reader_failed |= state is not TransferState.COMPLETED
        if offer.ending is None:
            if state is not TransferState.COMPLETED:
                return self.end(offer, state, f"its reader {child.peer} ended: {reason}", cause)
            offer.served += 1
            if offer.served < offer.readers:
                return []
            return self.end(offer, TransferState.COMPLETED,
                            f"pulled by all its {offer.readers} readers")
        if any(not c.finished for c in offer.children):
            return []
        ending_state, why = offer.ending
        return [Finish(offer, ending_state, why, offer.cause or EndCause.of(ending_state, why))]

    def _unindex(self, entry: Entry) -> None:
        tables: dict[Kind, dict[Any, Entry]] = {
            Kind.OFFER: self.offers, Kind.SERVE: self.offers, Kind.PULL: self.pulls,
            Kind.LEASE: self.leases}
        table = tables.get(entry.kind, self.receiving)
        key = (entry.peer, entry.request_id) if entry.kind in (Kind.PULL, Kind.LEASE) \
            else entry.request_id
        if table.get(key) is entry:
            del table[key]

    def _forget(self, entry: Entry) -> None:
        entry.finished = True
        self._unindex(entry)
        self.pushes.discard(entry)
        if self.streams.get(entry.transfer_id) is entry:
            del self.streams[entry.transfer_id]
        if self._negotiating.get(entry.transfer_id) is entry:
            del self._negotiating[entry.transfer_id]
        if self.live.pop(entry, False) is None:
            self._active -= entry.slot
            if entry.kind is Kind.STAGED:
                self._hold(entry, -1)

    def end_all(self, reason: str, cause: EndCause = EndCause.SHUTDOWN, *,
                leases: bool = False) -> list[Action]:
        """Abort everything (shutdown, memory unregistered); leases too if asked."""
        actions: list[Action] = []
        for entry in list(self.live):
            if entry.kind is not Kind.LEASE or leases:
                actions += self.end(entry, TransferState.ABORTED, reason, cause)
        return actions

    # -- peers and time ----------------------------------------------------------------
    def _needs_peer(self, entry: Entry) -> bool:
        if entry.kind is Kind.LEASE:
            return entry.confirmed
        return entry.streaming and not entry.received

    def peer_lost(self, peer: str, why: str, alive: Alive) -> list[Action]:
        """``peer`` is gone: fail what depends on it, release offers only it kept."""
        reason = f"peer lost: {why}"
        actions: list[Action] = []
        for entry in list(self.live):
            if entry.peer == peer and self._needs_peer(entry):
                actions += self.end(entry, TransferState.FAILED, reason, EndCause.PEER_LOST,
                                    peer_dead=True)
        return actions + self._orphaned(alive)

    def _orphaned(self, alive: Alive) -> list[Action]:
        actions: list[Action] = []
        for entry in list(self.offers.values()):
            reading = any(not c.finished for c in entry.children)  # its readers' own peers
            if entry.kind is Kind.OFFER and entry.keepers and not reading and \
                    not any(alive(k) for k in entry.keepers):
                actions += self.end(
                    entry, TransferState.FAILED, "peer lost: every instance keeping its lease "
                    f"({', '.join(sorted(entry.keepers))}) is gone", EndCause.PEER_LOST,
                    tell=False)
        return actions

    def peers(self) -> set[str]:
        """Peers whose death would end something here (the timer watches these)."""
        out = {e.peer for e in self.live if e.peer and self._needs_peer(e)}
        for entry in self.offers.values():
            out |= entry.keepers
        return out

    def tick(self, now: float, alive: Alive, why_dead: Callable[[str], str]) -> list[Action]:
        """Everything due at ``now``: expiries, deadlines, dead peers, renewals."""
        actions = self._orphaned(alive)
        for entry in list(self.live):
            if entry.ending is not None and (entry.peer_dead or not entry.streaming):
                continue  # a stopping stream still learns that its peer died (once)
            if entry.peer and self._needs_peer(entry) and not alive(entry.peer):
                actions += self.peer_lost(entry.peer, why_dead(entry.peer), alive)
            elif entry.ending is not None:
                continue
            elif entry.kind is Kind.OFFER and now > entry.lease_until:
                actions += self.end(entry, TransferState.EXPIRED, f"lease of {entry.lease_s}s "
                                    "expired: nobody pulled or renewed it")
            elif entry.kind is Kind.SERVE and now > entry.lease_until:
                actions += self.end(entry, TransferState.EXPIRED,
                                    f"lease of {entry.lease_s}s expired mid-pull")
            elif now > entry.claim_by:
                actions += self._unclaimed(entry)
            elif now > entry.deadline:
                actions += self.end(entry, TransferState.TIMED_OUT,
                                    f"not done after {entry.limit_s}s")
        return actions + self._renewals(now)

    def _unclaimed(self, entry: Entry) -> list[Action]:
        limit = self.reservation_timeout_s
        if entry.kind is Kind.STAGED:
            self.counts["staged_dropped"] += 1
            why = f"staged push never claimed within {limit}s; dropped"
        else:
            why = f"no manifest within {limit}s"
        return self.end(entry, TransferState.TIMED_OUT, why)

    def _wanted(self) -> dict[str, dict[str, str]]:
        """Source -> request id -> its secret (a lease and its pull: one request id)."""
        by_src: dict[str, dict[str, str]] = {}
        for (src, rid), entry in [*self.leases.items(), *self.pulls.items()]:
            by_src.setdefault(src, {})[rid] = entry.secret
        return by_src

    def _renew_at(self, src: str) -> float:
        period = self.peer_lease.get(src, self.lease_s) * self.renew_every
        return self._renewed_at.get(src, -math.inf) + period

    def _renewals(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for src, rids in self._wanted().items():
            if src not in self._renewing and now >= self._renew_at(src):
                self._renewed_at[src] = now
                self._renewing.add(src)
                actions.append(Renew(src, tuple(rids), tuple(rids.values())))
        return actions

    def next_deadline(self) -> float:
        """When ``tick`` next has work (inf: nothing is due, ever, until something opens)."""
        times = [math.inf]
        for entry in self.live:
            if entry.ending is None:
                times += [entry.deadline, entry.claim_by]
                if entry.kind in (Kind.OFFER, Kind.SERVE):
                    times.append(entry.lease_until)
        times += [self._renew_at(src) for src in self._wanted() if src not in self._renewing]
        return min(times)

    def lookup(self, transfer_id: str) -> Entry | None:
        """The live transfer ``transfer_id`` names: one streaming, or a push whose manifest
        is not answered yet."""
        return self.streams.get(transfer_id) or self._negotiating.get(transfer_id)
