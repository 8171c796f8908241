"""The book's shared offers (decode TP above prefill TP: several readers of one offer),
played the way the async layer plays them: a ``Finish`` finishes at once, a ``Stop``
finishes when the test says, and every finished reader reports ``reader_finished``."""

from __future__ import annotations

import pytest

from kvstream._exceptions import CapacityError, DuplicateRequestError
from kvstream.engine.book import Action, Book, Entry, Finish, Kind, Stop, TellKeeper
from kvstream.transfer.state import EndCause, TransferState

S = TransferState


class Layer:
    """The async layer: performs actions, finishes entries, reports readers."""

    def __init__(self, max_transfers: int = 8) -> None:
        self.book = Book(max_transfers=max_transfers, reservation_timeout_s=5.0,
                         transfer_timeout_s=10.0, lease_s=4.0)
        self.finished: dict[Entry, S] = {}
        self.stopping: dict[Entry, S] = {}
        self.told: list[TellKeeper] = []

    def perform(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Stop | Finish):
                assert a.entry not in self.finished, f"{a} names a finished entry"
            if isinstance(a, TellKeeper):
                self.told.append(a)
            elif isinstance(a, Stop):
                self.stopping[a.entry] = a.state
            elif isinstance(a, Finish):
                self.finish(a.entry, a.state)

    def finish(self, entry: Entry, state: S, reason: str = "done",
               cause: EndCause | None = None) -> None:
        assert self.book.finished(entry, state)
        self.finished[entry] = state
        self.stopping.pop(entry, None)
        if entry.parent is not None:
            self.perform(self.book.reader_finished(entry, state, reason,
                                                   cause or EndCause.of(state, reason)))

    def offer(self, readers: int = 2) -> Entry:
        return self.book.offer("r", "t0", 4.0, 0.0, "s" * 16, readers=readers)

    def reader(self, offer: Entry, peer: str, now: float = 1.0) -> Entry:
        child = self.book.serve_reader(offer, peer, f"t-{peer}", now, offer.readers)
        self.book.streaming(child, child.transfer_id, now, None)
        return child


def test_the_offer_completes_with_its_last_reader():
    lay = Layer()
    offer = lay.offer()
    a = lay.reader(offer, "a")
    assert lay.book.active == 1 and offer.kind is Kind.OFFER  # a took the offer's slot
    assert lay.book.offers["r"] is offer and offer.lease_until == 1.0 + 4.0
    lay.finish(a, S.COMPLETED)
    assert offer not in lay.finished and offer.ending is None
    b = lay.reader(offer, "b", now=2.0)
    lay.finish(b, S.COMPLETED)
    assert lay.finished[offer] is S.COMPLETED
    assert lay.book.counts["completed"] == 2  # the readers; the offer is not a transfer
    assert lay.book.active == 0 and not lay.book.live and not lay.book.offers


def test_a_failed_reader_stops_the_others_and_the_offer_finishes_after_them():
    lay = Layer()
    offer = lay.offer(readers=3)
    a, b, c = (lay.reader(offer, p) for p in "abc")
    lay.finish(a, S.FAILED, "peer lost: a went silent")
    assert offer.ending is not None and offer.ending[0] is S.FAILED and "a" in offer.ending[1]
    assert set(lay.stopping) == {b, c} and offer not in lay.finished
    assert "r" not in lay.book.offers  # a new offer of the request may start
    lay.finish(b, S.FAILED)
    assert offer not in lay.finished  # c still reads its blocks
    lay.finish(c, S.COMPLETED)  # finished on its own, racing the stop
    assert lay.finished[offer] is S.FAILED
    assert lay.book.active == 0 and not lay.book.live


def test_ending_the_offer_waits_for_every_reader():
    lay = Layer()
    offer = lay.offer()
    a = lay.reader(offer, "a")
    lay.perform(lay.book.end(offer, S.ABORTED, "the engine dropped it", EndCause.ENGINE_ABORT))
    assert lay.stopping == {a: S.ABORTED} and offer not in lay.finished
    lay.finish(a, S.ABORTED)
    assert lay.finished[offer] is S.ABORTED and offer.cause is EndCause.ENGINE_ABORT
    assert lay.book.counts["aborted"] == 1  # the reader's; the offer's end is its


def test_readers_stopped_for_another_reader_tell_their_own_peers():
    """Reader a's peer aborted it: b and c are stopped by this side (their streams tell
    their peers), and no keeper hears of a completion."""
    lay = Layer()
    offer = lay.offer(readers=3)
    offer.keepers |= {"a", "k"}
    a, b, c = (lay.reader(offer, p) for p in "abc")
    stops = lay.book.end(a, S.ABORTED, "aborted by a", EndCause.PEER_ABORT)
    lay.perform(stops)
    lay.finish(a, S.ABORTED, "aborted by a", EndCause.PEER_ABORT)
    assert lay.book.end(b, S.FAILED, "x") == []  # already ending: nothing new
    assert offer.ending is not None and offer.cause is EndCause.PEER_ABORT
    assert b.cause is c.cause is EndCause.ENGINE_ABORT


def test_a_dead_keeper_does_not_end_an_offer_its_readers_read():
    lay = Layer()
    offer = lay.offer()
    offer.keepers.add("k")
    a = lay.reader(offer, "a")
    lay.perform(lay.book.tick(2.0, lambda p: p != "k", str))
    assert a not in lay.stopping and offer.ending is None
    lay.finish(a, S.COMPLETED)  # once nobody reads it, a dead keeper's offer ends
    lay.perform(lay.book.tick(2.1, lambda p: p != "k", str))
    assert lay.finished[offer] is S.FAILED


def test_completion_tells_no_keeper_and_an_abort_only_keepers_that_read_nothing():
    lay = Layer()
    offer = lay.offer()
    offer.keepers |= {"k", "a"}
    a, b = lay.reader(offer, "a"), lay.reader(offer, "b")
    lay.finish(a, S.COMPLETED)
    lay.finish(b, S.COMPLETED)
    assert lay.finished[offer] is S.COMPLETED and lay.told == []
    second = lay.book.offer("r2", "t9", 4.0, 0.0, "s" * 16, readers=2)
    second.keepers |= {"k", "a"}
    c = lay.reader(second, "a")
    lay.perform(lay.book.end(second, S.ABORTED, "dropped", EndCause.ENGINE_ABORT))
    assert [t.keeper for t in lay.told] == ["k"]  # a hears it through its stream
    lay.finish(c, S.ABORTED)
    assert lay.finished[second] is S.ABORTED


def test_readers_are_counted_checked_and_renewed():
    lay = Layer(max_transfers=2)
    offer = lay.offer(readers=3)
    a = lay.reader(offer, "a")
    with pytest.raises(DuplicateRequestError):
        lay.book.serve_reader(offer, "a", "t-again", 1.0, 3)
    lay.reader(offer, "b")  # the first reader took over the offer's slot
    assert lay.book.active == 2
    with pytest.raises(CapacityError):  # two readers fill max_transfers=2
        lay.book.serve_reader(offer, "c", "t-c", 1.0, 3)
    assert len(offer.children) == 2 and lay.book.active == 2 and offer.readers == 3
    unknown, _ = lay.book.renew("a", ["r"], ["s" * 16], 3.0)
    assert unknown == [] and offer.lease_until == a.lease_until == 7.0
    lay.book.renew("k", ["r"], ["s" * 16], 4.0)  # a keeper renews the offer, not a's serve
    assert offer.lease_until == 8.0 and a.lease_until == 7.0


def test_an_offer_whose_readers_never_all_come_expires_after_the_last_one_left():
    lay = Layer()
    offer = lay.offer()
    a = lay.reader(offer, "a")
    lay.finish(a, S.COMPLETED)
    lay.perform(lay.book.tick(offer.lease_until + 0.1, lambda p: True, str))
    assert lay.finished[offer] is S.EXPIRED
    # The reader counted its completion, the offer its expiry (no reader had that end).
    assert lay.book.counts["expired"] == 1 and lay.book.counts["completed"] == 1


def test_end_all_stops_readers_and_then_finishes_the_offer():
    lay = Layer()
    offer = lay.offer()
    a, b = lay.reader(offer, "a"), lay.reader(offer, "b")
    lay.perform(lay.book.end_all("shutdown"))
    assert set(lay.stopping) == {a, b}
    lay.finish(a, S.ABORTED)
    lay.finish(b, S.ABORTED)
    assert lay.finished[offer] is S.ABORTED and not lay.book.live
    assert lay.book.counts["aborted"] == 2  # the readers; the offer had a reader end
