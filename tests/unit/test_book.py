"""Property-based tests of ``kvstream.engine.book``: the transfer book's rules under random events.

A ``RuleBasedStateMachine`` plays the async layer against one ``Book`` with a fake clock: it
opens every kind of entry, binds, serves, streams, renews, lets time pass (past leases and
deadlines too), kills and revives peers, ticks, ends and tears down, and performs every
action the book returns the way the layer does:

* ``Finish(entry, state)``: the transfer ends now, so its release hook calls
  ``book.finished(entry, state)`` at once;
* ``Stop(entry, state)``: the stream is told to stop; it finishes later (a rule), with that
  state or with its own outcome; a stream may also finish on its own, without any Stop;
* ``LoseLease``: the lease already left the book; ``TellKeeper``: recorded;
* ``Renew(src, rids)``: a renewal is in flight until a rule answers it (``renewed``).

After every step the invariants of the module's docstring are checked against a model kept
here; a few plain examples follow for paths random sequences rarely reach.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstream._exceptions import CapacityError, DuplicateRequestError
from kvstream.engine.book import (
    Action,
    Book,
    Entry,
    Finish,
    Held,
    Kind,
    LoseLease,
    Renew,
    Stop,
    TellKeeper,
)
from kvstream.transfer.state import EndCause, TransferState

S = TransferState
PEERS = ("a", "b", "c", "d")
RIDS = ("r0", "r1", "r2")
END_STATES = (S.COMPLETED, S.FAILED, S.ABORTED, S.TIMED_OUT, S.EXPIRED)
COUNTED = ("completed", "failed", "aborted", "timed_out", "expired")
RECV_KINDS = (Kind.RESERVATION, Kind.STAGED, Kind.RECEIVE)
OFFER_KINDS = (Kind.OFFER, Kind.SERVE)
STREAMABLE = (Kind.STAGED, Kind.RECEIVE, Kind.PUSH, Kind.SERVE, Kind.PULL)
REASONS = ("engine abort", "peer lost: it went silent", "operator said so")

pick = st.integers(0, 2**16)
peer_st = st.sampled_from(PEERS)
rid_st = st.sampled_from(RIDS)
# Small steps, the limits themselves (boundaries: ``now > limit`` ends, ``now == limit`` not)
# and big jumps past every lease and deadline.
dt_st = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 10.0]),
                  st.floats(0.0, 25.0, allow_nan=False, allow_infinity=False))


def needs_peer(e: Entry) -> bool:
    """Whether ``e``'s peer dying should end it: a lease the source confirmed, a stream
    still moving bytes."""
    if e.kind is Kind.LEASE:
        return e.confirmed
    return e.streaming and not e.received


def choose(cands: list[Entry], i: int) -> Entry:
    return cands[i % len(cands)]


class BookMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.now = 100.0
        self.entries: list[Entry] = []
        self.finished_model: set[Entry] = set()  # entries out of the book, by what we saw
        self.fin_true: dict[Entry, int] = {}  # how often ``finished`` returned True
        self.ended: set[Entry] = set()  # an end action (Stop/Finish/LoseLease) was returned
        self.stopped: dict[Entry, S] = {}  # told to stop, stream still running
        self.told: list[TellKeeper] = []
        self.told_dead: set[Entry] = set()  # its stream was told (once) that the peer is dead
        self.lease_until: dict[Entry, float] = {}  # offers and serves: when the lease runs out
        self.dead: set[str] = set()
        self.inflight: set[str] = set()  # sources with a Renew not yet answered
        self.renew_issued: dict[str, float] = {}
        self.peer_lease: dict[str, float] = {}
        self.noted: dict[str, float] = {}  # leases learnt while a renewal was in flight
        self.non_lease_finished = 0  # through ``finished`` (counted)
        self.dropped = 0  # pulls let go through ``drop`` (uncounted, by design)
        self.staged_dropped = 0
        self.renewals_sent = 0
        self.tids = 0

    @initialize(max_transfers=st.integers(2, 8), res=st.sampled_from([1.0, 5.0]),
                xfer=st.sampled_from([2.0, 10.0]), lease=st.sampled_from([1.0, 4.0]),
                every=st.sampled_from([0.25, 0.5, 1.0]), max_staged=st.integers(1, 4),
                per_peer=st.integers(1, 3))
    def setup(self, max_transfers: int, res: float, xfer: float, lease: float, every: float,
              max_staged: int, per_peer: int) -> None:
        self.max = max_transfers
        self.book = Book(max_transfers=max_transfers, reservation_timeout_s=res,
                         transfer_timeout_s=xfer, lease_s=lease, renew_every=every,
                         max_staged=max_staged, max_staged_per_peer=per_peer)
        self.ready = True

    # -- helpers -------------------------------------------------------------------------
    def alive(self, peer: str) -> bool:
        return peer not in self.dead

    @staticmethod
    def why_dead(peer: str) -> str:
        return f"{peer} missed its heartbeats"

    def new_tid(self) -> str:
        self.tids += 1
        return f"t{self.tids}"

    def live(self) -> list[Entry]:
        return [e for e in self.entries if e not in self.finished_model]

    def open_live(self) -> list[Entry]:
        """Live and no end decided yet."""
        return [e for e in self.entries if e not in self.finished_model and e not in self.ended]

    def active(self) -> int:
        """What counts against ``max_transfers``: staged pushes count apart."""
        return sum(e.kind not in (Kind.LEASE, Kind.STAGED) for e in self.live())

    def staged(self, peer: str | None = None) -> list[Entry]:
        return [e for e in self.live()
                if e.kind is Kind.STAGED and (peer is None or e.peer == peer)]

    def held(self, kinds: tuple[Kind, ...], keyed: bool = False) -> set[Any]:
        return {(e.peer, e.request_id) if keyed else e.request_id
                for e in self.open_live() if e.kind in kinds}

    def renew_at(self, src: str) -> float:
        period = self.peer_lease.get(src, self.book.lease_s) * self.book.renew_every
        return self.renew_issued.get(src, -math.inf) + period

    def wanted(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for src, rid in [*self.book.leases, *self.book.pulls]:
            out.setdefault(src, set()).add(rid)
        return out

    def finish(self, entry: Entry, state: S) -> None:
        """The transfer's release hook: ``finished`` exactly once per transfer."""
        assert entry.kind is not Kind.LEASE
        assert entry not in self.finished_model
        ok = self.book.finished(entry, state)
        assert ok, f"first finished of live {entry} returned False"
        self.fin_true[entry] = self.fin_true.get(entry, 0) + 1
        self.finished_model.add(entry)
        self.stopped.pop(entry, None)
        self.non_lease_finished += 1

    def perform(self, actions: list[Action]) -> None:
        for a in actions:  # nothing may name an entry that finished before the call
            if isinstance(a, Stop | Finish | LoseLease):
                assert a.entry not in self.finished_model, f"{a} names an already finished entry"
        for a in actions:
            if isinstance(a, Renew):
                assert a.src not in self.inflight, f"second Renew to {a.src} while one is in flight"
                self.inflight.add(a.src)
                self.renew_issued[a.src] = self.now
                continue
            if isinstance(a, TellKeeper):
                self.told.append(a)
                continue
            e = a.entry
            if e in self.ended:  # a later decision: only a stop escalated to "peer dead", once
                assert isinstance(a, Stop) and a.peer_dead, f"{a}: {e} already had its end"
                assert e.streaming and e not in self.told_dead, f"{e} told its peer died twice"
                self.told_dead.add(e)
                continue
            self.ended.add(e)
            assert e.ending is not None
            if isinstance(a, LoseLease):
                assert e.kind is Kind.LEASE and e.finished
                self.finished_model.add(e)
            elif isinstance(a, Stop):
                assert e.kind is not Kind.LEASE and e.streaming
                self.stopped[e] = a.state
                if a.peer_dead:
                    self.told_dead.add(e)
            else:
                assert e.kind is not Kind.LEASE and not e.streaming
                self.finish(e, a.state)

    def opening(self, fn: Callable[[], Entry], *, dup: bool, counts: bool = True,
                full: bool | None = None) -> Entry | None:
        """Open an entry, expecting DuplicateRequestError / CapacityError where due."""
        live_before = set(self.book.live)
        if full is None:
            full = counts and self.active() >= self.max
        if dup or full:
            errors: Any = (DuplicateRequestError, CapacityError) if dup and full else (
                DuplicateRequestError if dup else CapacityError)
            with pytest.raises(errors):
                fn()
            assert set(self.book.live) == live_before
            return None
        entry = fn()
        assert entry not in live_before and entry in self.book.live
        assert entry.opened_at == self.now and entry.ending is None and not entry.finished
        self.entries.append(entry)
        return entry

    # -- opening -------------------------------------------------------------------------
    @rule(rid=rid_st)
    def reserve(self, rid: str) -> None:
        dup = rid in self.held(RECV_KINDS)
        e = self.opening(lambda: self.book.reserve(rid, self.now), dup=dup)
        if e is not None:
            assert e.kind is Kind.RESERVATION
            assert e.claim_by == self.now + self.book.reservation_timeout_s

    @rule(rid=rid_st, peer=peer_st, promised=st.lists(st.integers(0, 99), max_size=3))
    def stage(self, rid: str, peer: str, promised: list[int]) -> None:
        dup = rid in self.held(RECV_KINDS)
        tid = self.new_tid()
        full = len(self.staged()) >= self.book.max_staged or \
            len(self.staged(peer)) >= self.book.max_staged_per_peer
        e = self.opening(lambda: self.book.stage(rid, tid, peer, self.now, promised,
                                                 nbytes=len(promised) + 1), dup=dup, full=full)
        if e is not None:
            assert e.kind is Kind.STAGED and e.promised == promised and e.peer == peer
            assert e.claim_by == self.now + self.book.reservation_timeout_s

    @rule(rid=rid_st, peer=peer_st)
    def push(self, rid: str, peer: str) -> None:
        e = self.opening(lambda: self.book.push(rid, self.new_tid(), peer, self.now), dup=False)
        if e is not None:
            assert e in self.book.pushes

    @rule(rid=rid_st, lease_s=st.sampled_from([1.0, 2.0, 4.0, 8.0]),
          keepers=st.lists(peer_st, max_size=3, unique=True),
          pulled_by=st.one_of(st.none(), peer_st))
    def offer(self, rid: str, lease_s: float, keepers: list[str], pulled_by: str | None) -> None:
        """An offer; destinations may start keeping it at once (their first renewal), and
        one may pull it at once."""
        dup = rid in self.held(OFFER_KINDS)
        e = self.opening(lambda: self.book.offer(rid, self.new_tid(), lease_s, self.now), dup=dup)
        if e is not None:
            self.lease_until[e] = self.now + lease_s
            assert e.lease_until == self.lease_until[e]
            for k in keepers:
                if k not in self.dead:
                    self.renew_check(k, [rid])
            if pulled_by is not None:
                self.serve_check(e, pulled_by)

    @rule(src=peer_st, rid=rid_st)
    def pull(self, src: str, rid: str) -> None:
        dup = (src, rid) in self.held((Kind.PULL,), keyed=True)
        self.opening(lambda: self.book.pull(src, rid, self.now), dup=dup)

    @rule(src=peer_st, rid=rid_st)
    def keep(self, src: str, rid: str) -> None:
        dup = (src, rid) in self.held((Kind.PULL, Kind.LEASE), keyed=True)
        self.opening(lambda: self.book.keep(src, rid, self.now), dup=dup, counts=False)

    # -- progress ------------------------------------------------------------------------
    def bindable(self) -> list[Entry]:
        return [e for e in self.open_live() if e.kind in (Kind.RESERVATION, Kind.STAGED)]

    @precondition(lambda self: self.ready and bool(self.bindable()))
    @rule(i=pick, peer=peer_st)
    def bind(self, i: int, peer: str) -> None:
        e = choose(self.bindable(), i)
        if e.kind is Kind.STAGED:  # the engine claims the push that landed: same transfer
            tid, peer = e.transfer_id, e.peer
            if self.active() >= self.max:  # claimed, it counts against max_transfers
                with pytest.raises(CapacityError):
                    self.book.bind(e, tid, peer)
                assert e.kind is Kind.STAGED and self.book.receiving[e.request_id] is e
                return
        else:
            tid = self.new_tid()
        self.book.bind(e, tid, peer)
        assert e.kind is Kind.RECEIVE and e.claim_by == math.inf
        assert (e.transfer_id, e.peer) == (tid, peer) and self.book.receiving[e.request_id] is e

    def servable(self) -> list[Entry]:
        return [e for e in self.open_live() if e.kind is Kind.OFFER]

    @precondition(lambda self: self.ready and bool(self.servable()))
    @rule(i=pick, peer=peer_st)
    def serve(self, i: int, peer: str) -> None:
        self.serve_check(choose(self.servable(), i), peer)

    def serve_check(self, e: Entry, peer: str) -> None:
        self.book.serve(e, peer, self.now)
        self.lease_until[e] = self.now + e.lease_s
        assert e.kind is Kind.SERVE and e.peer == peer and self.book.offers[e.request_id] is e

    def streamable(self) -> list[Entry]:
        return [e for e in self.live() if e.kind in STREAMABLE and not e.streaming]

    @precondition(lambda self: self.ready and bool(self.streamable()))
    @rule(i=pick, deadline_s=st.sampled_from([None, 0.0, 1.0, 3.0, 20.0]))
    def streaming(self, i: int, deadline_s: float | None) -> None:
        e = choose(self.streamable(), i)
        tid = e.transfer_id or self.new_tid()
        self.book.streaming(e, tid, self.now, deadline_s)
        limit = deadline_s or self.book.transfer_timeout_s
        assert e.streaming and e.deadline == self.now + limit
        assert self.book.lookup(tid) is e

    def streams(self) -> list[Entry]:
        return [e for e in self.live() if e.streaming]

    @precondition(lambda self: self.ready and any(not e.received for e in self.streams()))
    @rule(i=pick)
    def received_all(self, i: int) -> None:
        e = choose([e for e in self.streams() if not e.received], i)
        self.book.received_all(e)

    @precondition(lambda self: self.ready and bool(self.streams()))
    @rule(i=pick, outcome=st.sampled_from(["as told", S.COMPLETED, S.FAILED]))
    def stream_ends(self, i: int, outcome: Any) -> None:
        """A stream finishes: as its Stop said, or with its own outcome (told or not)."""
        e = choose(self.streams(), i)
        state = self.stopped.get(e, S.COMPLETED) if outcome == "as told" else outcome
        self.finish(e, state)

    @precondition(lambda self: self.ready and bool(self.finished_model))
    @rule(i=pick, state=st.sampled_from(END_STATES))
    def finished_again(self, i: int, state: S) -> None:
        e = choose(sorted(self.finished_model, key=self.entries.index), i)
        counts = dict(self.book.counts)
        assert self.book.finished(e, state) is False
        assert self.book.counts == counts

    # -- leases --------------------------------------------------------------------------
    @rule(by=peer_st, rids=st.lists(rid_st, max_size=3, unique=True))
    def renew(self, by: str, rids: list[str]) -> None:
        """A keeper renews some request ids at this source (offered here or not)."""
        if by in self.dead:  # a dead keeper renews nothing
            return
        self.renew_check(by, rids)

    def offered(self) -> list[Entry]:
        return [e for e in self.open_live() if e.kind in OFFER_KINDS]

    @precondition(lambda self: self.ready and bool(self.offered()))
    @rule(i=pick, by=peer_st)
    def renew_offered(self, i: int, by: str) -> None:
        """A (live) keeper renews one offer held here."""
        alive = [p for p in PEERS if p not in self.dead]
        if alive:
            self.renew_check(alive[PEERS.index(by) % len(alive)], [choose(self.offered(), i).request_id])

    def renew_check(self, by: str, rids: list[str]) -> None:
        # an offer whose lease ran out is not revived by a late renewal (the next tick ends it)
        offers = {e.request_id: e for e in self.open_live()
                  if e.kind in OFFER_KINDS and self.now <= self.lease_until[e]}
        unknown, shortest = self.book.renew(by, rids, [], self.now)
        assert unknown == [r for r in rids if r not in offers]
        known = [offers[r] for r in rids if r in offers]
        assert shortest == min((e.lease_s for e in known), default=self.book.lease_s)
        for e in known:
            self.lease_until[e] = self.now + e.lease_s
            assert by in e.keepers

    @rule(src=peer_st, lease_s=st.sampled_from([0.0, 1.0, 2.0, 8.0]))
    def note_lease(self, src: str, lease_s: float) -> None:
        self.book.note_lease(src, lease_s)
        self._note(src, lease_s)

    def _note(self, src: str, lease_s: float) -> None:
        lease = lease_s or self.book.lease_s
        self.peer_lease[src] = min(self.peer_lease.get(src, lease), lease)
        if src in self.inflight:  # the answer in flight may not cover it: the shorter holds
            self.noted[src] = min(self.noted.get(src, lease), lease)

    def unconfirmed(self) -> list[Entry]:
        return [e for e in self.open_live() if e.kind is Kind.LEASE and not e.confirmed]

    @precondition(lambda self: self.ready and bool(self.unconfirmed()))
    @rule(i=pick, lease_s=st.sampled_from([0.0, 1.0, 2.0, 8.0]))
    def confirmed_lease(self, i: int, lease_s: float) -> None:
        """The source answered ``keep``: its death now loses the lease."""
        e = choose(self.unconfirmed(), i)
        self.book.confirmed_lease(e, lease_s)
        assert e.confirmed and e.peer in self.book.peers()
        self._note(e.peer, lease_s)

    @precondition(lambda self: self.ready and bool(self.inflight))
    @rule(i=st.integers(0, 7), answer=st.sampled_from([None, None, 0.0, 1.0, 4.0]))
    def renewed(self, i: int, answer: float | None) -> None:
        src = sorted(self.inflight)[i % len(self.inflight)]
        self.book.renewed(src, self.now, answer)
        self.inflight.discard(src)
        noted = self.noted.pop(src, math.inf)
        if answer is not None:
            self.renewals_sent += 1
            self.peer_lease[src] = min(answer or self.book.lease_s, noted)
        elif noted < math.inf:
            self.peer_lease[src] = min(self.peer_lease.get(src, noted), noted)

    def lease_entries(self) -> list[Entry]:
        return [e for e in self.entries if e.kind is Kind.LEASE]

    @precondition(lambda self: self.ready and bool(self.lease_entries()))
    @rule(i=pick)
    def release_lease(self, i: int) -> None:
        e = choose(self.lease_entries(), i)
        gone = e in self.finished_model
        assert self.book.release_lease(e) is (not gone)
        assert e.finished and e not in self.book.live
        self.finished_model.add(e)

    # -- ending --------------------------------------------------------------------------
    @precondition(lambda self: self.ready and bool(self.entries))
    @rule(i=pick, state=st.sampled_from(END_STATES), reason=st.sampled_from(REASONS),
          cause=st.one_of(st.none(), st.sampled_from(list(EndCause))), peer_dead=st.booleans(),
          tell=st.booleans())
    def end(self, i: int, state: S, reason: str, cause: EndCause | None, peer_dead: bool,
            tell: bool) -> None:
        e = choose(self.entries, i)
        was_finished, was_ending = e in self.finished_model, e.ending is not None
        was_dead = e.peer_dead
        keepers = sorted(e.keepers)
        actions = self.book.end(e, state, reason, cause, peer_dead=peer_dead, tell=tell)
        if was_finished:
            assert actions == []
        elif was_ending:
            assert not any(isinstance(a, Finish) for a in actions)
            if peer_dead and e.streaming and not was_dead:  # escalated once
                assert [type(a) for a in actions] == [Stop] and actions[0].peer_dead  # type: ignore[union-attr]
            else:
                assert actions == []
        else:
            want_cause = cause or EndCause.of(state, reason)
            assert e.ending == (state, reason)
            last = actions[-1]
            if e.kind is Kind.LEASE:
                assert actions == [LoseLease(e, reason, want_cause)]
            else:
                assert isinstance(last, Stop if e.streaming else Finish)
                assert (last.entry, last.state, last.reason, last.cause) == (e, state, reason, want_cause)
                tells = keepers if tell and e.kind is Kind.OFFER else []
                assert actions[:-1] == [TellKeeper(k, e.request_id, reason) for k in tells]
        self.perform(actions)

    @rule(leases=st.booleans(), now=st.integers(0, 3))
    def end_all(self, leases: bool, now: int) -> None:
        if now:  # rarely: it wipes the book, and the teardown does it anyway
            return
        kept = [e for e in self.live() if e.kind is Kind.LEASE]
        actions = self.book.end_all("agent closing", leases=leases)
        assert all(a.state is S.ABORTED for a in actions if isinstance(a, Stop | Finish))
        self.perform(actions)
        for e in self.live():
            assert e.ending is not None or (e.kind is Kind.LEASE and not leases)
        if not leases:
            assert all(e in self.book.live for e in kept)

    # -- peers and time ------------------------------------------------------------------
    @rule(peer=peer_st, report=st.booleans(), aim=st.booleans(), i=pick)
    def kill(self, peer: str, report: bool, aim: bool, i: int) -> None:
        """A peer dies (at random, or one the book watches); the layer reports it at once,
        or the next tick finds out."""
        watched = sorted(self.book.peers() - self.dead)
        if aim and watched:
            peer = watched[i % len(watched)]
        self.dead.add(peer)
        if not report:
            return
        before = {e for e in self.open_live() if e.peer == peer and needs_peer(e)}
        received = {e for e in self.open_live() if e.peer == peer and not needs_peer(e)}
        still_kept = {e for e in self.open_live() if e.kind is Kind.OFFER and e.keepers
                      and any(self.alive(k) for k in e.keepers)}
        actions = self.book.peer_lost(peer, "connection reset", self.alive)
        for a in actions:
            if isinstance(a, Stop):
                assert a.peer_dead and a.state is S.FAILED and a.cause is EndCause.PEER_LOST
            if isinstance(a, LoseLease):
                assert a.cause is EndCause.PEER_LOST
        self.perform(actions)
        assert all(e in self.ended for e in before)
        assert not any(e in self.ended for e in received if e.kind not in OFFER_KINDS)
        assert not any(e in self.ended for e in still_kept), "an offer some live keeper keeps ended"
        self.check_no_orphans()
        self.check_dead_peers_told({peer})

    def kept_offers(self) -> list[Entry]:
        return [e for e in self.open_live() if e.kind is Kind.OFFER and e.keepers]

    @precondition(lambda self: self.ready and bool(self.kept_offers()))
    @rule(i=pick, every=st.booleans())
    def keepers_die(self, i: int, every: bool) -> None:
        """The keepers of an offer die (all of them, or all but one); a tick follows."""
        keepers = sorted(choose(self.kept_offers(), i).keepers)
        self.dead.update(keepers if every else keepers[1:])
        self.do_tick(self.now)

    @rule(peer=peer_st)
    def revive(self, peer: str) -> None:
        self.dead.discard(peer)

    @rule(dt=dt_st)
    def advance(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.ready)
    @rule(dt=dt_st)
    def advance_and_tick(self, dt: float) -> None:
        self.now += dt
        self.do_tick(self.now)

    def check_no_orphans(self) -> None:
        for e in self.open_live():
            if e.kind is Kind.OFFER and e.keepers:
                assert any(self.alive(k) for k in e.keepers), f"{e} kept only by dead peers lives on"

    def check_dead_peers_told(self, dead: set[str]) -> None:
        """After a tick (or peer_lost of one peer): every stream still moving bytes with a
        dead peer, open or already stopping, has been told the peer is dead (abort the
        endpoint)."""
        for e in self.live():
            if e.streaming and not e.received and e.peer in dead:
                assert e in self.told_dead, f"{e}: its peer {e.peer} is dead and nobody said so"

    def expected_end(self, e: Entry, now: float) -> S | None:
        """What a tick at ``now`` must decide for ``e`` (open before it), by the book's rules."""
        if e.kind is Kind.OFFER and e.keepers and not any(self.alive(k) for k in e.keepers):
            return S.FAILED
        if e.peer and needs_peer(e) and not self.alive(e.peer):
            return S.FAILED
        if e.kind in OFFER_KINDS and now > self.lease_until[e]:
            return S.EXPIRED
        if now > e.claim_by or now > e.deadline:
            return S.TIMED_OUT
        return None

    def do_tick(self, now: float) -> list[Action]:
        before = self.open_live()
        expect = {e: self.expected_end(e, now) for e in before}
        dropped = sum(e.kind is Kind.STAGED and expect[e] is S.TIMED_OUT and now > e.claim_by
                      for e in before)
        inflight = set(self.inflight)
        actions = self.book.tick(now, self.alive, self.why_dead)
        # renewals: once per source per period, never while one is in flight
        wanted = self.wanted()
        renews = [a for a in actions if isinstance(a, Renew)]
        assert sorted(a.src for a in renews) == sorted(
            s for s in wanted if s not in inflight and now >= self.renew_at(s))
        for a in renews:
            assert set(a.request_ids) == wanted[a.src]
        self.perform(actions)
        self.staged_dropped += dropped
        for e in before:
            if expect[e] is None:
                assert e not in self.ended, f"tick at {now} ended {e} ({e.ending}) before it was due"
            else:
                assert e in self.ended, f"tick at {now} left {e} open: should be {expect[e]}"
                assert e.ending is not None and e.ending[0] is expect[e], (e, e.ending, expect[e])
        # nothing overdue survives a tick
        for e in self.open_live():
            assert e.deadline >= now and e.claim_by >= now, e
            if e.kind in OFFER_KINDS:
                assert e.lease_until >= now, e
        self.check_no_orphans()
        self.check_dead_peers_told(self.dead)
        return actions

    @precondition(lambda self: self.ready)
    @rule()
    def tick(self) -> None:
        self.do_tick(self.now)

    @precondition(lambda self: self.ready and self.now < self.book.next_deadline() < math.inf)
    @rule(past=st.sampled_from([0.0, 0.0, 1e-3, 0.5]))
    def tick_at_deadline(self, past: float) -> None:
        """The timer's own move: wake at ``next_deadline()`` (or just after) and tick. At the
        very instant nothing with a ``now > limit`` rule is due yet."""
        self.now = self.book.next_deadline() + past
        self.do_tick(self.now)

    @precondition(lambda self: self.ready)
    @rule(frac=st.floats(0.0, 1.0, exclude_max=True))
    def tick_early(self, frac: float) -> None:
        """A tick strictly before ``next_deadline()`` has nothing to do (peers alive)."""
        nd = self.book.next_deadline()
        if nd <= self.now:
            return
        t = self.now + (min(nd, self.now + 30.0) - self.now) * frac
        self.now = t if t < nd else self.now
        quiet = not (self.book.peers() & self.dead)
        actions = self.do_tick(self.now)
        if quiet:
            assert actions == [], f"tick at {self.now} < next_deadline {nd}: {actions}"
        else:
            assert not any(isinstance(a, Renew) for a in actions)
            assert all(a.state is S.FAILED for a in actions if isinstance(a, Stop | Finish))

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not self.ready:
            return
        b = self.book
        live = self.live()
        assert {e for e in self.entries if e.finished} == self.finished_model
        assert set(b.live) == set(live)
        if isinstance(b.live, dict):  # kept in the order the entries opened
            assert list(b.live) == live
        assert all(n <= 1 for n in self.fin_true.values())
        for e in self.finished_model:
            assert e not in b.pushes and b.streams.get(e.transfer_id) is not e
            assert e not in b.receiving.values() and e not in b.offers.values()
            assert e not in b.pulls.values() and e not in b.leases.values()

        def table(kinds: tuple[Kind, ...], keyed: bool) -> dict[Any, Entry]:
            out: dict[Any, Entry] = {}
            for e in live:
                if e.kind in kinds and e.ending is None:
                    key = (e.peer, e.request_id) if keyed else e.request_id
                    assert key not in out, f"two open entries for {key}: {out[key]}, {e}"
                    out[key] = e
            return out

        assert b.receiving == table(RECV_KINDS, False)
        assert b.offers == table(OFFER_KINDS, False)
        assert b.pulls == table((Kind.PULL,), True)
        assert b.leases == table((Kind.LEASE,), True)
        assert b.pushes == {e for e in live if e.kind is Kind.PUSH}
        assert b.streams == {e.transfer_id: e for e in live if e.streaming}
        for e in live:  # ending: out of every request table, still live, its stream told
            assert (e.ending is not None) == (e in self.ended)
            if e.ending is not None:
                assert e.streaming and e in self.stopped
                assert e.peer_dead == (e in self.told_dead)
        counts = b.counts
        assert sum(counts[k] for k in COUNTED) == self.non_lease_finished
        assert self.non_lease_finished + self.dropped == sum(
            e.kind is not Kind.LEASE for e in self.finished_model)
        assert counts["staged_dropped"] == self.staged_dropped
        assert counts["renewals_sent"] == self.renewals_sent
        assert b.active == self.active() <= self.max
        staged = self.staged()
        assert len(staged) <= b.max_staged
        assert b.unsolicited() == Held(len(staged), sum(e.staged_bytes for e in staged))
        for peer in PEERS:
            mine = self.staged(peer)
            assert len(mine) <= b.max_staged_per_peer
            assert b.unsolicited(peer) == Held(len(mine), sum(e.staged_bytes for e in mine))
        nd = b.next_deadline()
        needed: set[str] = set()
        for e in self.open_live():
            assert nd <= e.deadline and nd <= e.claim_by
            if e.kind in OFFER_KINDS:
                assert e.lease_until == self.lease_until[e] and nd <= e.lease_until
            if e.kind is Kind.OFFER:
                needed |= e.keepers
            if e.peer and needs_peer(e):
                needed.add(e.peer)
        for src in self.wanted():
            if src not in self.inflight:
                assert nd <= self.renew_at(src)
        assert needed <= b.peers()

    def teardown(self) -> None:
        if not self.ready or sys.exc_info()[0] is not None:
            return  # a failing step is the report; do not bury it
        self.perform(self.book.end_all("agent closed", leases=True))
        for e in list(self.stopped):
            self.finish(e, self.stopped[e])
        b = self.book
        assert not b.live and not b.receiving and not b.offers and not b.pulls
        assert not b.leases and not b.pushes and not b.streams
        assert b.active == 0 and b.next_deadline() == math.inf


BookMachine.TestCase.settings = settings(
    max_examples=500, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestBookMachine = BookMachine.TestCase


# -- examples ------------------------------------------------------------------------------

def make(**kw: Any) -> Book:
    args: dict[str, Any] = dict(max_transfers=8, reservation_timeout_s=5.0, transfer_timeout_s=10.0,
                                lease_s=4.0, renew_every=0.25)
    args.update(kw)
    return Book(**args)


def everyone(peer: str) -> bool:
    return True


def nobody(peer: str) -> bool:
    return False


def why(peer: str) -> str:
    return "gone"


def test_staged_push_unclaimed_past_reservation_timeout_is_timed_out_and_dropped() -> None:
    book = make()
    e = book.stage("r", "t1", "src", 0.0, promised=[1, 2])
    assert book.next_deadline() == 5.0
    assert book.tick(5.0, everyone, why) == []  # at the limit: not yet
    actions = book.tick(5.001, everyone, why)
    assert actions == [Finish(e, S.TIMED_OUT, "staged push never claimed within 5.0s; dropped",
                              EndCause.DEADLINE)]
    assert book.counts["staged_dropped"] == 1
    assert "r" not in book.receiving and e in book.live
    assert book.finished(e, S.TIMED_OUT)
    assert book.counts["timed_out"] == 1 and not book.live


def test_streaming_staged_push_unclaimed_is_stopped() -> None:
    book = make()
    e = book.stage("r", "t1", "src", 0.0, nbytes=100)
    book.streaming(e, "t1", 0.0, None)
    [stop] = book.tick(6.0, everyone, why)
    assert isinstance(stop, Stop) and stop.state is S.TIMED_OUT and book.counts["staged_dropped"] == 1
    # Until its stream has stopped it still holds its buffers: counted, apart from max_transfers.
    assert e in book.live and book.active == 0 and book.unsolicited("src") == Held(1, 100)
    assert book.finished(e, S.TIMED_OUT) and not book.live
    assert book.unsolicited() == book.unsolicited("src") == Held()


def test_claimed_staged_push_is_not_dropped() -> None:
    book = make()
    e = book.stage("r", "t1", "src", 0.0)
    book.bind(e, "t1", "src")
    assert book.tick(50.0, everyone, why) == [] and book.counts["staged_dropped"] == 0


def test_reservation_without_manifest_times_out() -> None:
    book = make()
    e = book.reserve("r", 0.0)
    [fin] = book.tick(5.5, everyone, why)
    assert fin == Finish(e, S.TIMED_OUT, "no manifest within 5.0s", EndCause.DEADLINE)
    assert book.counts["staged_dropped"] == 0


def test_peer_lost_fails_streaming_entries_and_loses_leases_but_spares_received_ones() -> None:
    book = make()
    recv = book.reserve("r1", 0.0)
    book.bind(recv, "t1", "p")
    book.streaming(recv, "t1", 0.0, None)
    done = book.pull("p", "r2", 0.0)
    book.streaming(done, "t2", 0.0, None)
    book.received_all(done)
    idle = book.pull("p", "r3", 0.0)  # not streaming yet: nothing moves that needs the peer
    lease = book.keep("p", "r4", 0.0)
    book.confirmed_lease(lease, 2.0)
    asked = book.keep("p", "r6", 0.0)  # not confirmed yet: only a question in flight
    other = book.push("r5", "t5", "q", 0.0)
    book.streaming(other, "t5", 0.0, None)
    actions = book.peer_lost("p", "missed heartbeats", lambda peer: peer != "p")
    reason = "peer lost: missed heartbeats"
    # (the order follows opened_at; these were all opened at once)
    assert sorted(actions, key=repr) == [LoseLease(lease, reason, EndCause.PEER_LOST),
                                         Stop(recv, S.FAILED, reason, EndCause.PEER_LOST, peer_dead=True)]
    assert recv.ending is not None and "r1" not in book.receiving and recv in book.live
    assert lease.finished and ("p", "r4") not in book.leases
    assert not asked.finished and book.leases == {("p", "r6"): asked}
    assert done.ending is None and idle.ending is None and other.ending is None
    assert book.pulls == {("p", "r2"): done, ("p", "r3"): idle}
    # reported again (the tick finds it dead too): no second end, and the stop already
    # knows the peer is dead (escalated once)
    assert book.peer_lost("p", "still dead", lambda peer: peer != "p") == []
    assert book.finished(recv, S.FAILED) and book.counts["failed"] == 1


def test_tick_finds_a_dead_peer() -> None:
    book = make()
    push = book.push("r", "t1", "p", 0.0)
    book.streaming(push, "t1", 0.0, None)
    assert "p" in book.peers()
    [stop] = book.tick(1.0, lambda peer: peer != "p", lambda peer: f"{peer} silent")
    assert stop == Stop(push, S.FAILED, "peer lost: p silent", EndCause.PEER_LOST, peer_dead=True)


def test_tick_escalates_stopping_streams_of_a_dead_peer_alongside_open_ones() -> None:
    book = make()
    old = book.push("r1", "t1", "p", 0.0)
    book.streaming(old, "t1", 0.0, None)
    book.end(old, S.ABORTED, "engine abort")  # told to stop, not yet stopped
    new = book.push("r2", "t2", "p", 0.5)
    book.streaming(new, "t2", 0.5, None)
    actions = book.tick(1.0, lambda peer: peer != "p", why)
    assert [(a.entry, a.peer_dead) for a in actions] == [(old, True), (new, True)]  # type: ignore[union-attr]


def test_tick_escalates_a_stopping_stream_whose_peer_died() -> None:
    book = make()
    e = book.push("r", "t1", "p", 0.0)
    book.streaming(e, "t1", 0.0, None)
    [stop] = book.end(e, S.ABORTED, "engine abort")
    assert not stop.peer_dead  # type: ignore[union-attr]
    assert book.peers() == {"p"}  # the timer watches p for this entry ...
    # ... and when p is found dead, the tick escalates the stop to "the peer is dead" (abort
    # the endpoint) even though p has no open entry left; once, not at every tick.
    actions = book.tick(1.0, lambda peer: peer != "p", why)
    assert [(type(a), a.entry, a.peer_dead) for a in actions] == [(Stop, e, True)]  # type: ignore[union-attr]
    assert book.tick(2.0, lambda peer: peer != "p", why) == []


def test_offer_whose_every_keeper_is_dead_fails_without_telling_anyone() -> None:
    book = make()
    e = book.offer("r", "t1", 10.0, 0.0)
    book.renew("k1", ["r"], [], 1.0)
    book.renew("k2", ["r"], [], 1.0)
    assert book.peers() == {"k1", "k2"}
    assert book.tick(2.0, lambda peer: peer != "k1", why) == []  # k2 still keeps it
    [fin] = book.tick(3.0, nobody, why)
    assert isinstance(fin, Finish) and fin.entry is e
    assert fin.state is S.FAILED and fin.cause is EndCause.PEER_LOST
    assert "every instance keeping its lease (k1, k2) is gone" in fin.reason


def test_offer_orphaned_via_peer_lost() -> None:
    book = make()
    e = book.offer("r", "t1", 10.0, 0.0)
    book.renew("k", ["r"], [], 1.0)
    actions = book.peer_lost("k", "gone", nobody)
    assert [type(a) for a in actions] == [Finish] and actions[0].entry is e  # type: ignore[union-attr]


def test_ending_an_offer_tells_each_keeper() -> None:
    book = make()
    e = book.offer("r", "t1", 10.0, 0.0)
    for k in ("k2", "k1", "k3"):
        book.renew(k, ["r"], [], 1.0)
    actions = book.end(e, S.ABORTED, "engine abort")
    assert actions == [TellKeeper("k1", "r", "engine abort"), TellKeeper("k2", "r", "engine abort"),
                       TellKeeper("k3", "r", "engine abort"),
                       Finish(e, S.ABORTED, "engine abort", EndCause.ENGINE_ABORT)]
    assert book.end(e, S.FAILED, "again") == []


def test_expired_offer_tells_its_keepers() -> None:
    book = make()
    e = book.offer("r", "t1", 2.0, 0.0)
    book.renew("k", ["r"], [], 1.0)
    assert book.tick(3.0, everyone, why) == []  # renewed at 1: good until 3
    actions = book.tick(3.01, everyone, why)
    assert [type(a) for a in actions] == [TellKeeper, Finish]
    assert actions[1] == Finish(e, S.EXPIRED, "lease of 2.0s expired: nobody pulled or renewed it",
                                EndCause.LEASE_EXPIRED)


def test_serve_lease_expires_mid_pull_unless_renewed() -> None:
    book = make()
    e = book.offer("r", "t1", 2.0, 0.0)
    book.serve(e, "dst", 1.0)
    book.streaming(e, "t1", 1.0, None)
    assert book.renew("dst", ["r"], [], 2.5) == ([], 2.0)
    assert book.tick(4.5, everyone, why) == []
    [stop] = book.tick(4.6, everyone, why)
    assert stop == Stop(e, S.EXPIRED, "lease of 2.0s expired mid-pull", EndCause.LEASE_EXPIRED)


def test_renew_once_per_period_and_never_while_in_flight() -> None:
    book = make(lease_s=4.0, renew_every=0.25)
    book.keep("src", "r1", 0.0)
    book.pull("src", "r2", 0.0)
    book.keep("other", "r3", 0.0)
    assert book.next_deadline() == -math.inf  # never renewed: due at once
    actions = book.tick(0.0, everyone, why)
    assert sorted(actions, key=str) == [Renew("other", ("r3",)), Renew("src", ("r1", "r2"))]
    # in flight: not again, however long it takes, and the timer does not wait on it
    assert book.next_deadline() == math.inf
    assert book.tick(100.0, everyone, why) == []
    book.renewed("src", 100.0, 2.0)  # answered: the shortest lease there is now 2s
    book.renewed("other", 100.0, None)  # not answered: no lease learnt, renew again
    assert book.counts["renewals_sent"] == 1
    # the period counts from when the renewal was sent (0.0): both are overdue
    assert book.next_deadline() == 0.5
    assert sorted(book.tick(100.0, everyone, why), key=str) == [Renew("other", ("r3",)),
                                                                Renew("src", ("r1", "r2"))]
    book.renewed("src", 100.1, 2.0)
    assert book.next_deadline() == 100.5  # 0.25 * 2s after it was sent
    assert book.tick(100.49, everyone, why) == []
    assert book.tick(100.5, everyone, why) == [Renew("src", ("r1", "r2"))]


def test_note_lease_keeps_the_shortest() -> None:
    book = make(lease_s=4.0, renew_every=0.5)
    book.note_lease("src", 8.0)
    book.note_lease("src", 2.0)
    book.note_lease("src", 0.0)  # "the default": 4s, longer than 2s
    book.keep("src", "r", 0.0)
    assert book.tick(0.0, everyone, why) == [Renew("src", ("r",))]
    book.renewed("src", 0.1, None)
    assert book.next_deadline() == 1.0


def test_a_shorter_lease_learnt_while_a_renewal_is_in_flight_is_kept() -> None:
    book = make(lease_s=4.0, renew_every=0.25)
    a = book.keep("src", "A", 0.0)
    book.confirmed_lease(a, 8.0)
    assert book.tick(0.0, everyone, why) == [Renew("src", ("A",))]  # in flight, for A only
    b = book.keep("src", "B", 0.1)
    book.confirmed_lease(b, 1.0)  # src holds B for 1s: renew it every 0.25s
    book.renewed("src", 0.2, 8.0)  # the answer about A
    # B must be renewed before src drops it at 1.1: the period stays 0.25 * 1s, not 0.25 * 8s
    assert book.next_deadline() <= 0.25


def test_no_renewals_for_a_source_nothing_is_kept_at() -> None:
    book = make()
    lease = book.keep("src", "r", 0.0)
    assert book.release_lease(lease) is True
    assert book.release_lease(lease) is False
    assert book.tick(0.0, everyone, why) == [] and book.next_deadline() == math.inf


@pytest.mark.parametrize("opener", ["reserve", "stage", "offer", "pull", "keep"])
def test_duplicate_request_refused_while_live_allowed_once_ending(opener: str) -> None:
    book = make(max_staged_per_peer=2)  # the ending staged push holds its sender's first
    opens: dict[str, Callable[[], Entry]] = {
        "reserve": lambda: book.reserve("r", 0.0),
        "stage": lambda: book.stage("r", "t", "src", 0.0),
        "offer": lambda: book.offer("r", "t", 4.0, 0.0),
        "pull": lambda: book.pull("src", "r", 0.0),
        "keep": lambda: book.keep("src", "r", 0.0),
    }
    first = opens[opener]()
    if first.kind is not Kind.LEASE:
        book.streaming(first, "t0", 0.0, None)  # so that ending leaves it live (a Stop)
    with pytest.raises(DuplicateRequestError):
        opens[opener]()
    actions = book.end(first, S.ABORTED, "engine abort")
    assert first.ending is not None
    second = opens[opener]()
    assert second is not first
    if first.kind is not Kind.LEASE:
        assert [type(a) for a in actions] == [Stop] and first in book.live
        assert book.finished(first, S.ABORTED)  # the old one finishing leaves the new one be
        assert second in book.live and first not in book.live
        held = [*book.receiving.values(), *book.offers.values(), *book.pulls.values()]
        assert second in held
    else:
        assert [type(a) for a in actions] == [LoseLease]
        assert book.leases == {("src", "r"): second}


def test_reserve_and_stage_share_the_request_table() -> None:
    book = make()
    book.stage("r", "t", "src", 0.0)
    with pytest.raises(DuplicateRequestError):
        book.reserve("r", 0.0)


def test_keep_refused_while_pulled_and_pull_may_take_over_a_lease() -> None:
    book = make()
    lease = book.keep("src", "r", 0.0)
    pull = book.pull("src", "r", 0.0)  # a pull takes the lease over ...
    assert book.release_lease(lease)  # ... and the lease is released
    with pytest.raises(DuplicateRequestError):
        book.keep("src", "r", 0.0)
    assert book.pulls == {("src", "r"): pull} and not book.leases


def test_capacity_counts_ending_entries_until_finished() -> None:
    book = make(max_transfers=2)
    a = book.push("r1", "t1", "p", 0.0)
    book.streaming(a, "t1", 0.0, None)
    book.reserve("r2", 0.0)
    book.keep("src", "r3", 0.0)  # leases do not count
    with pytest.raises(CapacityError):
        book.offer("r4", "t4", 4.0, 0.0)
    book.end(a, S.ABORTED, "engine abort")
    with pytest.raises(CapacityError):  # still stopping: its stream may hold memory
        book.offer("r4", "t4", 4.0, 0.0)
    assert book.finished(a, S.ABORTED)
    book.offer("r4", "t4", 4.0, 0.0)
    assert book.active == 2


def test_end_all_then_finishing_everything_leaves_an_empty_book() -> None:
    book = make()
    s = book.push("r1", "t1", "p", 0.0)
    book.streaming(s, "t1", 0.0, None)
    book.reserve("r2", 0.0)
    o = book.offer("r3", "t3", 4.0, 0.0)
    book.renew("k", ["r3"], [], 0.0)
    book.keep("src", "r4", 0.0)
    actions = book.end_all("closing")
    assert book.leases  # not asked to
    assert sum(isinstance(a, TellKeeper) for a in actions) == 1
    actions += book.end_all("closing", leases=True)
    for a in actions:
        if isinstance(a, Stop | Finish):
            assert book.finished(a.entry, a.state)
    assert not (book.live or book.receiving or book.offers or book.pulls or book.leases
                or book.pushes or book.streams)
    assert book.counts["aborted"] == 3 and o.finished


def test_a_renewal_after_the_lease_ran_out_revives_nothing() -> None:
    book = make()
    e = book.offer("r", "t1", 1.0, 0.0)
    assert book.renew("k", ["r"], [], 1.5) == (["r"], book.lease_s)  # late: unknown to the keeper
    [fin] = book.tick(1.5, everyone, why)
    assert isinstance(fin, Finish) and fin.entry is e and fin.state is S.EXPIRED


def test_a_lease_and_its_pull_are_renewed_under_one_request_id() -> None:
    book = make()
    lease = book.keep("src", "r", 0.0)
    book.confirmed_lease(lease, 4.0)
    book.pull("src", "r", 0.0)  # negotiating while the lease is still kept
    assert book.tick(0.0, everyone, why) == [Renew("src", ("r",))]


def test_renewal_needs_the_offers_secret():
    """A keeper without the offer's secret renews nothing and learns nothing: it is answered
    as for an offer that does not exist, and counted."""
    book = Book(max_transfers=4, reservation_timeout_s=1.0, transfer_timeout_s=1.0, lease_s=2.0)
    book.offer("r", "t", 2.0, 0.0, secret="s" * 22)
    assert book.renew("thief", ["r"], ["wrong"], 1.0) == (["r"], 2.0)
    assert book.renew("thief", ["r"], [], 1.0) == (["r"], 2.0)
    assert book.counts["forbidden"] == 2
    assert book.offers["r"].lease_until == 2.0 and not book.offers["r"].keepers
    assert book.renew("dst", ["r"], ["s" * 22], 1.5) == ([], 2.0)
    assert book.offers["r"].lease_until == 3.5 and book.offers["r"].keepers == {"dst"}
