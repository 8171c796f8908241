"""Pushes nobody reserved for ("unsolicited"), from identities anyone can mint: what they
hold is bounded apart from what the agent expects, per sender and in all, and expires.

The book's rules first (pure), then the staging pool's exact charge, then the whole engine
on the in-memory seams: minted senders (each its own key) flood a decode agent with staged
manifests while an honest prefill pushes to a reservation and is pulled from. Every bound
asserted is the one the code promises (shares of the pool and of the table), and every
wait is bounded by the code's own timeouts, not by timing measured here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest

from kvstream import Agent, AgentConfig
from kvstream._exceptions import CapacityError, ConfigError
from kvstream.control import messages as m
from kvstream.control.identity import Identity
from kvstream.control.memory import MemoryBus
from kvstream.control.subjects import Subjects
from kvstream.dataplane.loopback import LoopbackFabric, LoopbackTransport
from kvstream.dataplane.staging import StagingPool
from kvstream.engine.book import Book, Finish, Held, Kind
from kvstream.transfer.state import TransferState
from tests.fakes import small_layout
from tests.unit.test_engine_loopback import _pair, _same

LAYERS = 4
LAY = small_layout(layers=LAYERS)
# A one-block manifest (a run: framed per plane, no header in staging) stages this much.
ONE_BLOCK = LAYERS * LAY.block_bytes
HEARTBEAT_S = 0.2


def _book(**kw: object) -> Book:
    args: dict[str, object] = dict(max_transfers=8, reservation_timeout_s=5.0,
                                   transfer_timeout_s=10.0, lease_s=4.0)
    args.update(kw)
    return Book(**args)  # type: ignore[arg-type]


# -- the book ------------------------------------------------------------------------------

def test_staged_pushes_never_take_the_room_of_expected_transfers() -> None:
    book = _book(max_transfers=4, max_staged=3, max_staged_per_peer=1)
    for i in range(3):  # three minted senders fill the unsolicited table ...
        book.stage(f"s{i}", f"t{i}", f"mint-{i}", 0.0, nbytes=10)
    with pytest.raises(CapacityError) as full:
        book.stage("s3", "t3", "mint-3", 0.0)
    assert full.value.what == "staged transfers" and full.value.limit == 3
    # ... and every kind the agent itself opens still has all of max_transfers.
    book.reserve("r", 0.0)
    book.pull("p", "q", 0.0)
    book.push("x", "tx", "d", 0.0)
    book.offer("o", "to", 4.0, 0.0)
    assert book.active == 4 and book.unsolicited() == Held(3, 30)
    with pytest.raises(CapacityError) as mine:  # the agent's own limit, not the strangers'
        book.reserve("r2", 0.0)
    assert mine.value.what == "transfers"


def test_one_sender_is_refused_beyond_its_share_and_others_are_not() -> None:
    book = _book(max_staged=4, max_staged_per_peer=2)
    book.stage("a", "t1", "mint-0", 0.0, nbytes=5)
    book.stage("b", "t2", "mint-0", 0.0, nbytes=7)
    with pytest.raises(CapacityError) as exc:
        book.stage("c", "t3", "mint-0", 0.0)
    assert exc.value.what == "staged transfers per sender" and exc.value.limit == 2
    book.stage("c", "t3", "honest", 0.0)
    assert book.unsolicited("mint-0") == Held(2, 12)
    assert book.unsolicited("honest") == Held(1, 0) and book.unsolicited() == Held(3, 12)


def test_staged_pushes_expire_and_free_their_slot() -> None:
    book = _book(max_staged=2, max_staged_per_peer=2)
    a = book.stage("a", "t1", "mint-0", 0.0, nbytes=5)
    b = book.stage("b", "t2", "mint-0", 1.0, nbytes=5)
    book.streaming(b, "t2", 1.0, 1000.0)  # its sender's long deadline does not keep it
    with pytest.raises(CapacityError):
        book.stage("c", "t3", "mint-1", 1.0)
    actions = book.tick(5.5, lambda peer: True, str)  # past a's reservation timeout only
    assert actions == [Finish(a, TransferState.TIMED_OUT,
                              "staged push never claimed within 5.0s; dropped", a.cause)]
    assert book.finished(a, TransferState.TIMED_OUT)
    book.stage("c", "t3", "mint-1", 5.5)  # a's slot is free
    [stop] = book.tick(book.next_deadline() + 1e-3, lambda peer: True, str)
    assert stop.entry is b and b.ending is not None  # a stream: its stop is what ends it
    assert book.unsolicited("mint-0") == Held(1, 5)  # its buffers are held until it stopped
    assert book.finished(b, TransferState.TIMED_OUT)
    assert book.unsolicited("mint-0") == Held() and book.counts["staged_dropped"] == 2


def test_a_claimed_push_moves_into_max_transfers() -> None:
    book = _book(max_transfers=1, max_staged=1, max_staged_per_peer=1)
    staged = book.stage("s", "t", "p", 0.0, nbytes=9)
    held = book.reserve("r", 0.0)
    with pytest.raises(CapacityError):  # the engine's own table is full: it stays staged
        book.bind(staged, "t", "p")
    assert staged.kind is Kind.STAGED and book.unsolicited() == Held(1, 9)
    book.end(held, TransferState.ABORTED, "engine abort")
    book.finished(held, TransferState.ABORTED)
    book.bind(staged, "t", "p")
    assert staged.kind is Kind.RECEIVE and book.active == 1 and book.unsolicited() == Held()
    book.stage("s2", "t2", "p", 0.0)  # the unsolicited slot is free again


def test_config_shares_are_validated() -> None:
    cfg = AgentConfig(instance_id="d")
    assert (cfg.unsolicited_staging_share, cfg.unsolicited_sender_share,
            cfg.unsolicited_transfers_share) == (0.5, 0.125, 0.25)
    for bad in ({"unsolicited_staging_share": 0.0}, {"unsolicited_sender_share": 1.5},
                {"unsolicited_transfers_share": float("nan")},
                {"unsolicited_staging_share": 0.25, "unsolicited_sender_share": 0.5}):
        with pytest.raises(ConfigError):
            AgentConfig(instance_id="d", **bad)  # type: ignore[arg-type]


# -- the staging pool ------------------------------------------------------------------------

@pytest.mark.anyio
async def test_a_staged_push_is_charged_exactly_what_it_asked_for() -> None:
    pool = StagingPool(1000)
    big = await pool.acquire(600, timeout=1)
    pool.release(big)  # cached now
    [small] = pool.try_acquire_all([100]) or []
    assert pool.in_use == 100 and small.data_ptr() != big.data_ptr()
    pool.release(small)
    [again] = pool.try_acquire_all([100]) or []  # a cached buffer of that very size: reused
    assert again.data_ptr() == small.data_ptr() and pool.in_use == 100


# -- the engine, flooded by minted identities --------------------------------------------------

class Minted:
    """Senders anyone can make: a key of its own each, announced (so alive, never dropped
    as lost peers), signing manifests for pushes that nobody reserved for (their data never
    comes, so each stays staged until it expires)."""

    def __init__(self, d: Agent, fabric: LoopbackFabric) -> None:
        self.d, self.fabric = d, fabric
        self.buses: list[tuple[str, MemoryBus, LoopbackTransport]] = []
        self.sent = 0

    async def add(self, n: int) -> None:
        hub = self.d._core.control.hub  # type: ignore[attr-defined]
        for _ in range(n):
            name = f"mint-{len(self.buses)}"
            bus = await hub.connect(name)
            bus.seal.identity = Identity(name)
            self.buses.append((name, bus, LoopbackTransport(self.fabric)))
        with anyio.fail_after(5):  # until the agent holds each for a live instance
            while any(not self.d._core.registry.alive(name) for name, _, _ in self.buses):
                await anyio.sleep(0.01)

    async def announce(self) -> None:
        """Heartbeats of every minted sender, as a real instance sends them."""
        seq = 0
        while True:
            seq += 1
            for name, bus, transport in self.buses:
                await bus.publish(Subjects("default").registry(name), m.Announce(
                    instance_id=name, role="prefill", worker_address=transport.address,
                    heartbeat_s=HEARTBEAT_S, seq=seq))
            await anyio.sleep(HEARTBEAT_S)

    async def manifest(self, i: int, blocks: list[int] | None = None) -> m.ControlUnion:
        """One staged manifest from sender ``i``."""
        name, bus, transport = self.buses[i]
        self.sent += 1
        msg = m.Manifest(transfer_id=f"{self.sent:032x}", request_id=f"flood-{self.sent}",
                         src=name, dst=self.d.instance_id, src_address=transport.address,
                         src_tag=self.sent, fingerprint=LAY.fingerprint, num_layers=LAYERS,
                         src_blocks=blocks or [1], deadline_s=600.0)
        return await bus.request(Subjects("default").control(self.d.instance_id), msg,
                                  timeout=5.0)

    async def close(self) -> None:
        for _, bus, _ in self.buses:
            await bus.close()


@contextlib.asynccontextmanager
async def _flooded(d_kw: dict) -> AsyncIterator[tuple[Agent, Agent, Minted]]:
    async with _pair(d_kw={"reservation_timeout_s": 600.0, **d_kw}) as (p, d, fabric):
        minted = Minted(d, fabric)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(minted.announce)
                yield p, d, minted
                tg.cancel_scope.cancel()
        finally:
            await minted.close()


def _accepted(answers: list[m.ControlUnion]) -> int:
    assert all(isinstance(a, m.Accept) or (isinstance(a, m.Reject) and a.code == "busy")
               for a in answers), answers
    return sum(isinstance(a, m.Accept) for a in answers)


POOL = 64 * ONE_BLOCK  # so every share is a whole number of one-block pushes


@pytest.mark.anyio
async def test_one_flooding_sender_is_refused_busy_and_no_one_else_is():
    async with _flooded({"staging_bytes": POOL}) as (p, d, minted):
        await minted.add(2)
        share = int(POOL * d._core.config.unsolicited_sender_share) // ONE_BLOCK  # 8
        answers = [await minted.manifest(0) for _ in range(3 * share)]
        assert _accepted(answers) == share
        counts = d._core.book.counts
        assert counts["refused_unsolicited_sender"] == counts["refused_unsolicited"] == 2 * share
        assert d._core.book.unsolicited("mint-0") == Held(share, share * ONE_BLOCK)
        # Another sender, and an honest push nobody reserved for yet, still get in.
        assert _accepted([await minted.manifest(1)]) == 1
        tx = await p.push("honest", "d", [2, 4], mode="eager")
        tx.all_ready()
        with anyio.fail_after(10):
            while d._core.book.unsolicited("p").entries == 0:
                await anyio.sleep(0.01)
        rx = d.expect("honest", [3, 9], src="p")
        with anyio.fail_after(10):
            assert (await rx.wait()).ok and (await tx.wait()).ok
        assert _same(p, d, [2, 4], [3, 9])


@pytest.mark.anyio
async def test_many_minted_senders_hold_at_most_the_unsolicited_share_and_expected_transfers_proceed():
    async with _flooded({"staging_bytes": POOL}) as (p, d, minted):
        cfg = d._core.config
        await minted.add(24)
        answers = []
        for _ in range(3):  # round robin: the share of all is reached before a sender's own
            answers += [await minted.manifest(i) for i in range(len(minted.buses))]
        limit = int(POOL * cfg.unsolicited_staging_share)
        assert _accepted(answers) == limit // ONE_BLOCK
        flood = d._core.book.unsolicited()
        assert flood == Held(limit // ONE_BLOCK, limit) and d.staging.in_use == limit
        staged = d.statistics().staged_transfers
        # A push this agent reserved for, and a pull it starts, both staged (scattered
        # blocks), find the rest of the pool at once; neither waits for the flood to expire.
        rx = d.expect("reserved", [1, 5, 9], src="p")
        tx = await p.push("reserved", "d", [2, 6, 10], mode="eager")
        tx.all_ready()
        offer = p.offer("pulled", [0, 3, 7])
        offer.all_ready()
        with anyio.fail_after(10):
            assert (await rx.wait()).ok and (await tx.wait()).ok
            pulled = await d.pull("pulled", "p", [4, 11, 14], secret=offer.secret)
            assert (await pulled.wait()).ok
        assert _same(p, d, [2, 6, 10], [1, 5, 9]) and _same(p, d, [0, 3, 7], [4, 11, 14])
        assert d.staging.peak > limit  # they did go through staging, beside the flood
        assert d.statistics().staged_transfers == staged  # which still held its share
        assert d._core.book.unsolicited() == flood


@pytest.mark.anyio
async def test_a_table_full_of_strangers_pushes_never_fails_expect_or_pull():
    max_transfers = 8
    async with _flooded({"max_transfers": max_transfers}) as (p, d, minted):
        await minted.add(12)
        answers = [await minted.manifest(i) for i in range(len(minted.buses))]
        book = d._core.book
        assert book.max_staged == int(max_transfers * d._core.config.unsolicited_transfers_share)
        assert _accepted(answers) == book.max_staged == book.unsolicited().entries
        assert book.counts["refused_unsolicited"] == len(answers) - book.max_staged
        # All of max_transfers is still the engine's: reservations, a push, a pull.
        rxs = [d.expect(f"r{i}", [i], src="p") for i in range(max_transfers - 1)]
        offer = p.offer("q", [3])
        offer.all_ready()
        pulled = await d.pull("q", "p", [12], secret=offer.secret)
        with pytest.raises(CapacityError):  # its own limit: the strangers' slots are apart
            d.expect("one-too-many", [13], src="p")
        tx = await p.push("r0", "d", [5], mode="eager")
        tx.all_ready()
        with anyio.fail_after(10):
            assert (await pulled.wait()).ok and (await rxs[0].wait()).ok
        for rx in rxs[1:]:
            rx.abort()


@pytest.mark.anyio
async def test_staged_floods_expire_and_give_back_their_staging_and_slots():
    reservation_s, request_s = 1.0, 1.0  # _pair's request_timeout_s
    async with _flooded({"staging_bytes": POOL, "max_transfers": 16,
                         "reservation_timeout_s": reservation_s}) as (_p, d, minted):
        book = d._core.book
        await minted.add(2 * book.max_staged)
        first = _accepted([await minted.manifest(i) for i in range(len(minted.buses))])
        assert first == book.max_staged and d.staging.in_use == first * ONE_BLOCK
        # Unclaimed past reservation_timeout_s, each is stopped; its stop asks the silent
        # sender to abort (request_timeout_s), then waits for its receives at most as long.
        with anyio.fail_after(reservation_s + 2 * request_s + 5):
            while book.unsolicited() != Held() or d.staging.in_use:
                await anyio.sleep(0.05)
        s = d.statistics()
        assert (s.staged_transfers, s.staged_dropped, s.staging_bytes_in_use) == (0, first, 0)
        again = _accepted([await minted.manifest(i) for i in range(len(minted.buses))])
        assert again == book.max_staged  # the same room, once more
