"""The whole engine, two Agents, over the in-memory seams: no NATS, no UCX.

Every mode end to end, and cancellation in the middle of a transfer from either side:
afterwards nothing is held (book, staging, reservations) on either agent. An offer's
secret: a pull, keep or abort without it is refused and the offer stays the right puller's.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest
import torch

from kvstream import Agent, AgentConfig, ForbiddenError, TransferState
from kvstream._exceptions import (
    ConfigError,
    DuplicateRequestError,
    LeaseExpiredError,
    TransferError,
)
from kvstream.control.aborts import release_offer
from kvstream.control.identity import Identity
from kvstream.control.memory import MemoryBus, MemoryHub
from kvstream.dataplane.loopback import LoopbackFabric, LoopbackTransport
from kvstream.prefix import block_hashes
from kvstream.transfer import EndCause, Side
from tests.fakes import cache, small_layout

pytestmark = pytest.mark.anyio

NBLOCKS = 16


# Streams layer by layer however short (the default sends a short transfer as one frame).
LAYERED = {"whole_frame_bytes": 0}


def _cfg(instance_id: str, **kw: object) -> AgentConfig:
    kw = {"heartbeat_s": 0.2, "peer_timeout_s": 1.0, "request_timeout_s": 1.0, **kw}
    return AgentConfig(instance_id=instance_id, nats_url="memory://", **kw)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def _pair(p_kw: dict | None = None, d_kw: dict | None = None,
                layers: int = 4) -> AsyncIterator[tuple[Agent, Agent, LoopbackFabric]]:
    lay = small_layout(layers=layers)
    fabric = LoopbackFabric()
    async with MemoryHub() as hub:
        p = Agent(_cfg("p", **(p_kw or {})), layout=lay, kv_caches=cache(lay, NBLOCKS, fill=True),
                  control=await hub.connect("p"), transport=LoopbackTransport(fabric))
        d = Agent(_cfg("d", **(d_kw or {})), layout=lay,
                  kv_caches=cache(lay, NBLOCKS, fill=False),
                  control=await hub.connect("d"), transport=LoopbackTransport(fabric))
        async with p, d:
            await _meet(p, d)
            yield p, d, fabric


async def _meet(*agents: Agent) -> None:
    with anyio.fail_after(5):
        while any(len(a.peers()) < len(agents) - 1 for a in agents):
            await anyio.sleep(0.01)


def _same(p: Agent, d: Agent, src: list[int], dst: list[int]) -> bool:
    """The destination blocks hold the source blocks' bytes (flash_nhd: K/V planes first)."""
    assert p.memory is not None and d.memory is not None
    return all(torch.equal(a[:, src], b[:, dst])
               for a, b in zip(p.memory.layers, d.memory.layers, strict=True))


async def _at_rest(*agents: Agent) -> None:
    """Nothing held: the book is empty, staging is free, no stream runs."""
    with anyio.fail_after(5):
        while any(a._core.book.live for a in agents):
            await anyio.sleep(0.01)
    for a in agents:
        s = a.statistics()
        assert (s.transfers_active, s.reservations_active, s.staging_bytes_in_use,
                s.held_active, s.leases_active, s.staged_transfers) == (0, 0, 0, 0, 0, 0), s


@pytest.mark.parametrize("mode", ["pipelined", "eager"])
@pytest.mark.parametrize("src,dst", [([1, 5, 9], [2, 3, 11]), ([4, 5, 6], [8, 9, 10])])
async def test_push_every_mode_lands_exact_bytes(mode, src, dst):
    async with _pair() as (p, d, fabric):
        rx = d.expect("r", dst, src=p.instance_id)
        tx = await p.push("r", "d", src, dst_blocks=dst, mode=mode)
        for layer in range(4):
            tx.layer_ready(layer)
        with anyio.fail_after(5):
            sent, got = await tx.wait(), await rx.wait()
        assert (sent.side, got.side) == (Side.SEND, Side.RECV)
        assert got.status is TransferState.COMPLETED and got.cause is EndCause.COMPLETED
        assert _same(p, d, src, dst) and fabric.bytes_delivered >= got.bytes > 0
        await _at_rest(p, d)
        assert (p.statistics().completed, d.statistics().completed) == (1, 1)


async def test_push_before_expect_is_staged_then_claimed():
    async with _pair() as (p, d, _):
        tx = await p.push("r", "d", [0, 2], mode="eager")
        tx.all_ready()
        with anyio.fail_after(5):
            while d.statistics().staged_transfers == 0:
                await anyio.sleep(0.01)
        rx = d.expect("r", [7, 3], src=p.instance_id)
        with anyio.fail_after(5):
            await rx.wait()
            await tx.wait()
        assert _same(p, d, [0, 2], [7, 3])
        await _at_rest(p, d)


@pytest.mark.parametrize("mode", ["eager", "lazy"])
async def test_pull_every_mode_and_incremental(mode):
    async with _pair() as (p, d, _):
        tokens = list(range(3 * 8))
        hashes = block_hashes(tokens, 8)
        offer = p.offer("r", [1, 2, 3], block_hashes=hashes)
        offer.all_ready()
        rx = await d.pull("r", "p", [4, 5, 6], mode=mode, have=hashes[:1],
                          secret=offer.secret)
        with anyio.fail_after(5):
            for layer in range(4):
                await rx.wait_layer(layer)
            got = await rx.wait()
            await offer.wait()
        assert got.bytes_skipped > 0 and _same(p, d, [2, 3], [5, 6])
        assert not _same(p, d, [1], [4])  # the block it had was not sent
        await _at_rest(p, d)


async def test_kept_lease_outlives_its_period_and_is_taken_over():
    async with _pair() as (p, d, _):
        offer = p.offer("r", [1], lease_s=0.4)
        offer.all_ready()
        lease = await d.keep("r", "p", secret=offer.secret)
        await anyio.sleep(1.2)  # three lease periods: renewals keep it
        assert p.statistics().held_active == 1 and lease.active
        rx = await d.pull("r", "p", [2], secret=offer.secret)
        with anyio.fail_after(5):
            await rx.wait()
        assert await lease.lost() is None and not lease.active
        await _at_rest(p, d)


async def test_unrenewed_offer_expires_on_time():
    async with _pair() as (p, d, _):
        offer = p.offer("r", [1], lease_s=0.2)
        with anyio.fail_after(2):
            result = await offer.result()
        assert result.status is TransferState.EXPIRED and result.cause is EndCause.LEASE_EXPIRED
        with pytest.raises(TransferError, match="holds no KV"):
            await d.pull("r", "p", [2], secret=offer.secret)
        with pytest.raises(LeaseExpiredError):
            await d.keep("r", "p", secret=offer.secret)
        await _at_rest(p, d)


@pytest.mark.parametrize("who", ["sender", "receiver"])
async def test_abort_mid_push_releases_everything(who):
    async with _pair(p_kw=LAYERED) as (p, d, _):
        rx = d.expect("r", [1, 3, 5], src=p.instance_id)  # scattered: staging buffers on both sides
        tx = await p.push("r", "d", [2, 4, 6], mode="pipelined")
        tx.layer_ready(0)
        tx.layer_ready(1)
        with anyio.fail_after(5):
            await rx.wait_layer(1)  # half way
        ender, other = (tx, rx) if who == "sender" else (rx, tx)
        ended = await ender.abort("test: stop half way")
        with anyio.fail_after(5):
            seen = await other.result()
        assert ended.status is TransferState.ABORTED and ended.cause is EndCause.ENGINE_ABORT
        assert seen.status is TransferState.ABORTED and seen.cause is EndCause.PEER_ABORT
        assert 0 < seen.layers < 4
        await _at_rest(p, d)


async def test_abort_mid_lazy_pull_releases_the_offer():
    # Liveness is not under test: both agents share one event loop, and a stall of the
    # process longer than _cfg's 1s peer timeout (a loaded machine) would make either hold
    # the other dead mid-pull (PeerLostError, a FAILED offer, or d's first renewal answered
    # "p no longer holds the KV"). Timeouts far past any stall; the waits stay bounded.
    patient = {"peer_timeout_s": 60.0, "request_timeout_s": 10.0}
    async with _pair(p_kw=patient, d_kw=patient) as (p, d, _):
        offer = p.offer("r", [1, 2])
        offer.all_ready()
        rx = await d.pull("r", "p", [3, 4], mode="lazy", lookahead=0, secret=offer.secret)
        with anyio.fail_after(5):
            await rx.wait_layer(0)
        await rx.abort("engine gave up")
        with anyio.fail_after(5):
            served = await offer.result()
        assert served.status is TransferState.ABORTED
        await _at_rest(p, d)


async def test_deadline_ends_a_stalled_push_on_both_sides():
    async with _pair() as (p, d, _):
        rx = d.expect("r", [1], src=p.instance_id)
        tx = await p.push("r", "d", [1], timeout=0.3)  # no layer ever ready
        with anyio.fail_after(5):
            sent, got = await tx.result(), await rx.result()
        # The manifest carries the deadline: either side may reach it first, and the other
        # then hears an abort from it.
        causes = {sent.cause, got.cause}
        assert causes in ({EndCause.DEADLINE}, {EndCause.DEADLINE, EndCause.PEER_ABORT}), causes
        await _at_rest(p, d)


async def test_dead_peer_fails_its_transfers_and_frees_them():
    async with _pair(p_kw=LAYERED) as (p, d, fabric):
        rx = d.expect("r", [1, 2], src=p.instance_id)
        tx = await p.push("r", "d", [1, 2])
        tx.layer_ready(0)
        with anyio.fail_after(5):
            await rx.wait_layer(0)
        fabric.kill(p.worker_address)
        p._core.registry.leave("d")  # p stops hearing d: both sides see the other gone
        d._core.registry.leave("p")
        d._liveness.fail_peer("p")
        with anyio.fail_after(5):
            got = await rx.result()
        assert got.status is TransferState.FAILED and got.cause is EndCause.PEER_LOST
        await tx.abort("test over")
        await _at_rest(d)


async def test_shutdown_mid_transfer_ends_everything_once():
    lay = small_layout()
    fabric = LoopbackFabric()
    async with MemoryHub() as hub:
        async with Agent(_cfg("p", **LAYERED), layout=lay, kv_caches=cache(lay, NBLOCKS, fill=True),
                         control=await hub.connect("p"),
                         transport=LoopbackTransport(fabric)) as p:
            async with Agent(_cfg("d"), layout=lay, kv_caches=cache(lay, NBLOCKS, fill=False),
                             control=await hub.connect("d"),
                             transport=LoopbackTransport(fabric)) as d:
                await _meet(p, d)
                rx = d.expect("r", [1, 2], src=p.instance_id)
                tx = await p.push("r", "d", [1, 2])
                held = p.offer("o", [5])
                tx.layer_ready(0)
                with anyio.fail_after(5):
                    await rx.wait_layer(0)
            # d closed mid-transfer: its side ended (aborted), p's side learnt it
            assert (await rx.result()).cause is EndCause.SHUTDOWN
            assert not d._core.book.live and d.staging.in_use == 0
            with anyio.fail_after(5):
                assert (await tx.result()).status is TransferState.ABORTED
        assert (await held.result()).cause is EndCause.SHUTDOWN
        assert not p._core.book.live and p.staging.in_use == 0


async def test_duplicates_and_capacity_are_distinct_errors():
    from kvstream import CapacityError

    async with _pair(d_kw={"max_transfers": 2}) as (p, d, _):
        d.expect("a", [1], src=p.instance_id)
        with pytest.raises(DuplicateRequestError):
            d.expect("a", [2], src=p.instance_id)
        d.expect("b", [2], src=p.instance_id)
        with pytest.raises(CapacityError):
            d.expect("c", [3], src=p.instance_id)
        p.offer("x", [1])
        with pytest.raises(DuplicateRequestError):
            p.offer("x", [2])


async def test_given_ports_mean_no_nats_and_no_ucx(monkeypatch):
    """With both ports handed in, the agent opens neither NATS nor UCX."""
    import kvstream.engine.agent as agent_module

    def refuse(*args: object) -> None:
        raise AssertionError("the agent opened a production port")

    monkeypatch.setattr(agent_module, "open_control", refuse)
    monkeypatch.setattr(agent_module, "open_transport", refuse)
    async with _pair() as (p, d, _):
        rx = d.expect("r", [1], src=p.instance_id)
        tx = await p.push("r", "d", [2], mode="eager")
        tx.all_ready()
        with anyio.fail_after(5):
            assert (await rx.wait()).ok
        assert p.nats_url == "" and _same(p, d, [2], [1])


# -- an offer's secret: only the puller it was handed to gets the blocks ------------------
WRONG = "not-the-offer-secret-0123"


async def _raw_bus(p: Agent, name: str, *, signed: bool = True) -> MemoryBus:
    """A bus on ``p``'s hub that is no Agent (like the proxy's): it signs as ``name``."""
    bus = p._core.control
    assert isinstance(bus, MemoryBus)
    raw = await bus.hub.connect(name)
    if signed:
        raw.seal.identity = Identity(name)
    return raw


async def test_pull_without_the_secret_is_forbidden_and_the_offer_stays():
    async with _pair() as (p, d, _):
        offer = p.offer("r", [1, 5, 9])
        offer.all_ready()
        assert len(offer.secret) >= 16
        for wrong in ("", WRONG):
            before = p.statistics().forbidden_requests
            with pytest.raises(ForbiddenError, match="secret"):
                await d.pull("r", "p", [2, 3, 4], secret=wrong)
            # (>: the pull's own renewal, if the timer sent one meanwhile, is refused too)
            assert p.statistics().forbidden_requests > before
        s = p.statistics()
        assert s.held_active == 1 and s.transfers_active == 0 and not offer.done
        assert not _same(p, d, [1, 5, 9], [2, 3, 4])  # nothing was sent
        # Still the right puller's, whole: it pulls and the bytes are the source's.
        rx = await d.pull("r", "p", [2, 3, 4], secret=offer.secret)
        with anyio.fail_after(5):
            got, served = await rx.wait(), await offer.wait()
        assert got.ok and served.ok and _same(p, d, [1, 5, 9], [2, 3, 4])
        await _at_rest(p, d)


async def test_a_callers_own_secret_is_the_one_to_present():
    async with _pair() as (p, d, _):
        mine = "a-secret-of-my-own-making"
        offer = p.offer("r", [1], secret=mine)
        offer.all_ready()
        assert offer.secret == mine
        with pytest.raises(ConfigError):
            p.offer("short", [2], secret="too-short")
        rx = await d.pull("r", "p", [2], secret=mine)
        with anyio.fail_after(5):
            assert (await rx.wait()).ok
        assert _same(p, d, [1], [2])
        await _at_rest(p, d)


async def test_keep_with_a_wrong_secret_does_not_extend_the_lease():
    async with _pair() as (p, d, _):
        lease_s = 1.0
        start = anyio.current_time()
        offer = p.offer("r", [1], lease_s=lease_s)
        await anyio.sleep(lease_s / 2)
        for wrong in (WRONG, ""):
            before = p.statistics().forbidden_requests
            with pytest.raises(LeaseExpiredError):  # answered like an offer that is not there
                await d.keep("r", "p", secret=wrong)
            assert p.statistics().forbidden_requests > before
        with anyio.fail_after(3):
            result = await offer.result()
        # A renewal at lease_s / 2 would have moved expiry to 1.5 * lease_s.
        elapsed = anyio.current_time() - start
        assert result.status is TransferState.EXPIRED and result.cause is EndCause.LEASE_EXPIRED
        assert elapsed < 1.4 * lease_s, elapsed
        await _at_rest(p, d)


async def test_abort_by_request_id_needs_the_secret():
    async with _pair() as (p, d, _):
        offer = p.offer("r", [1, 2])
        offer.all_ready()
        ns = p.config.namespace
        # The destination releasing what it never kept, without / with a wrong secret.
        assert await d.release("r", "p", "no secret")  # acknowledged, but refused
        assert await d.release("r", "p", "wrong secret", secret=WRONG)
        # A signed bus that is no agent (like the proxy's), without the secret.
        proxy = await _raw_bus(p, "proxy")
        assert await release_offer(proxy, ns, "p", "r", "routing failed", by="proxy")
        # An unsigned one is not even heard.
        unsigned = await _raw_bus(p, "anon", signed=False)
        assert not await release_offer(unsigned, ns, "p", "r", "routing failed", by="anon",
                                       secret=offer.secret, timeout=0.5)
        s = p.statistics()
        assert s.forbidden_requests == 3 and s.unauthenticated_messages >= 1
        assert s.held_active == 1 and not offer.done
        rx = await d.pull("r", "p", [3, 4], secret=offer.secret)
        with anyio.fail_after(5):
            got, served = await rx.wait(), await offer.wait()
        assert got.ok and served.ok and _same(p, d, [1, 2], [3, 4])
        await _at_rest(p, d)


async def test_abort_by_request_id_with_the_secret_ends_the_offer():
    async with _pair() as (p, d, _):
        offer = p.offer("r", [1])
        proxy = await _raw_bus(p, "proxy")
        assert await release_offer(proxy, p.config.namespace, "p", "r", "routing failed",
                                   by="proxy", secret=offer.secret)
        with anyio.fail_after(5):
            result = await offer.result()
        assert result.status is TransferState.ABORTED and result.cause is EndCause.PEER_ABORT
        assert "proxy" in result.reason and p.statistics().forbidden_requests == 0
        with pytest.raises(TransferError, match="holds no KV"):
            await d.pull("r", "p", [2], secret=offer.secret)
        await _at_rest(p, d)
