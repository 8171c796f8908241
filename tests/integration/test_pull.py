"""Pull (eager and lazy), incremental transfers and leases: real NATS, real UCX."""

from __future__ import annotations

import multiprocessing as mp
import time

import anyio
import msgspec
import pytest
import torch

from kvstream import (
    LeaseExpiredError,
    PeerLostError,
    TransferAbortedError,
    TransferError,
    block_hashes,
)
from tests.fakes import small_layout
from tests.integration.agents import LAYERED, agent_pair, assert_at_rest, settle
from tests.integration.peers import keeping_peer, offering_peer

pytestmark = pytest.mark.anyio


def same_blocks(p, d, pairs, layers) -> bool:
    return all(torch.equal(p.memory.read_block(layer, a), d.memory.read_block(layer, b))
               for layer in layers for a, b in pairs)


@pytest.mark.parametrize("scattered", [True, False])
async def test_pull_eager_is_bit_exact(nats_server, scattered):
    lay = small_layout(layers=6)
    src, dst = ([3, 9, 1], [7, 2, 12]) if scattered else ([4, 5, 6], [10, 11, 12])
    async with agent_pair(nats_server, f"p-pe{scattered}", f"d-pe{scattered}", lay, 16) as (p, d):
        held = p.offer("r1", src)
        held.all_ready()
        rx = await d.pull("r1", f"p-pe{scattered}", dst, secret=held.secret)
        with anyio.fail_after(10):
            await rx.wait()
            assert (await held.wait()).ok  # the source learns the pull finished and releases
        assert same_blocks(p, d, zip(src, dst, strict=True), range(lay.num_layers))
        await settle(p, d)
        assert_at_rest(p, d)


async def test_pull_while_prefill_still_computes(nats_server):
    """Pipelined pull: layers leave as the source marks them ready."""
    lay = small_layout(layers=6)
    async with agent_pair(nats_server, "p-pp", "d-pp", lay, 16, p_kw=LAYERED) as (p, d):
        held = p.offer("r", [1, 5])
        rx = await d.pull("r", "p-pp", [2, 3], secret=held.secret)
        held.layer_ready(0)
        held.layer_ready(1)
        with anyio.fail_after(10):
            await rx.wait_layer(1)
        assert not rx.layer_landed(2)
        held.all_ready()
        with anyio.fail_after(10):
            await rx.wait()
        assert same_blocks(p, d, [(1, 2), (5, 3)], range(lay.num_layers))


async def test_lazy_pull_fetches_a_layer_when_asked(nats_server):
    lay = small_layout(layers=8)
    async with agent_pair(nats_server, "p-lz", "d-lz", lay, 16) as (p, d):
        held = p.offer("r", [3, 1, 7])
        held.all_ready()
        rx = await d.pull("r", "p-lz", [0, 9, 4], mode="lazy", lookahead=1,
                          secret=held.secret)
        await anyio.sleep(0.3)
        assert d.statistics().bytes_received == 0  # nothing asked for, nothing moved
        with anyio.fail_after(10):
            await rx.wait_layer(2)  # brings 0..2, and layer 3 as lookahead
            while not rx.layer_landed(3):
                await anyio.sleep(0.01)
        await anyio.sleep(0.2)
        assert not rx.layer_landed(4)
        assert d.statistics().bytes_received == 4 * lay.block_bytes * 3
        for layer in range(4, lay.num_layers):
            with anyio.fail_after(10):
                await rx.wait_layer(layer)
        with anyio.fail_after(10):
            await rx.wait()
            await held.wait()
        assert same_blocks(p, d, [(3, 0), (1, 9), (7, 4)], range(lay.num_layers))
        await settle(p, d)
        assert_at_rest(p, d)


def _prefix(lay, blocks: int, salt: int = 0) -> list[int]:
    tokens = list(range(salt, salt + lay.block_size * blocks))
    return block_hashes(tokens, lay.block_size)


@pytest.mark.parametrize("direction", ["push", "pull"])
async def test_incremental_skips_blocks_the_destination_holds(nats_server, direction):
    lay = small_layout(layers=4)
    src, dst = [5, 1, 9, 3], [0, 6, 2, 8]
    hashes = _prefix(lay, 4)
    async with agent_pair(nats_server, f"p-inc-{direction}", f"d-inc-{direction}", lay,
                          16) as (p, d):
        have = hashes[:2]  # the destination's prefix cache holds the first two blocks
        if direction == "push":
            rx = d.expect("r", dst, have=have, src=p.instance_id)
            tx = await p.push("r", f"d-inc-{direction}", src, block_hashes=hashes)
            tx.all_ready()
        else:
            tx = p.offer("r", src, block_hashes=hashes)
            tx.all_ready()
            rx = await d.pull("r", f"p-inc-{direction}", dst, have=have, secret=tx.secret)
        with anyio.fail_after(10):
            done = await rx.wait()
            sent = await tx.wait()
        block = lay.block_bytes
        assert done.bytes_skipped == sent.bytes_skipped == 2 * block * lay.num_layers
        assert d.statistics().bytes_received == 2 * block * lay.num_layers
        assert same_blocks(p, d, [(9, 2), (3, 8)], range(lay.num_layers))
        # The held blocks were not touched (still zero here: this test's cache is empty).
        assert all(d.memory.read_block(layer, b).count_nonzero() == 0
                   for layer in range(lay.num_layers) for b in (0, 6))
        await settle(p, d)
        assert_at_rest(p, d)


async def test_everything_held_completes_without_moving_a_byte(nats_server):
    lay = small_layout(layers=4)
    hashes = _prefix(lay, 2, salt=7)
    async with agent_pair(nats_server, "p-all", "d-all", lay, 8) as (p, d):
        tx = p.offer("r", [1, 2], block_hashes=hashes)
        rx = await d.pull("r", "p-all", [3, 4], have=hashes, secret=tx.secret)
        with anyio.fail_after(5):
            assert (await rx.wait()).ok and (await tx.wait()).ok
        assert d.statistics().bytes_received == 0
        assert_at_rest(p, d)


async def test_never_pulled_offer_expires_and_is_counted(nats_server):
    lay = small_layout()
    async with agent_pair(nats_server, "p-exp", "d-exp", lay, 8) as (p, d):
        held = p.offer("stranded", [1, 2], lease_s=0.5)
        held.all_ready()
        assert p.statistics().held_active == 1
        with anyio.fail_after(5):
            result = await held.result()
        assert result.status == "expired"
        with pytest.raises(LeaseExpiredError):
            await held.wait()
        s = p.statistics()
        assert (s.expired, s.held_active) == (1, 0)
        with pytest.raises(TransferError, match="holds no KV"):
            await d.pull("stranded", "p-exp", [3, 4], secret=held.secret)  # too late
        assert_at_rest(p, d)


async def test_kept_lease_outlives_its_period_and_few_renewals_are_sent(nats_server):
    lay = small_layout()
    async with agent_pair(nats_server, "p-keep", "d-keep", lay, 16) as (p, d):
        helds = [p.offer(f"r{i}", [i], lease_s=0.8) for i in range(6)]
        for h in helds:
            h.all_ready()
        leases = [await d.keep(f"r{i}", "p-keep", secret=h.secret) for i, h in enumerate(helds)]
        sent = d.statistics().renewals_sent
        await anyio.sleep(2.4)  # three lease periods
        assert p.statistics().held_active == 6 and p.statistics().expired == 0
        renewals = d.statistics().renewals_sent - sent
        # One message per source per quarter lease, not one per request or block.
        assert 4 <= renewals <= 16, renewals
        rx = await d.pull("r0", "p-keep", [10], secret=helds[0].secret)  # takes the lease over
        with anyio.fail_after(5):
            await rx.wait()
        assert not leases[0].active and await leases[0].lost() is None  # taken over
        for lease in leases[1:]:
            await lease.release()  # "I no longer want it": the source frees it now
        with anyio.fail_after(5):
            for h in helds[1:]:
                assert (await h.result()).status == "aborted"
        await settle(p, d)
        assert_at_rest(p, d)


async def test_release_frees_the_source_kept_or_not(nats_server):
    """An engine that will never pull (request ended, or its prefix cache had it all) frees
    the source's hold at once, whether it kept a lease on it or not."""
    lay = small_layout()
    async with agent_pair(nats_server, "p-rel", "d-rel", lay, 8,
                          p_kw=dict(lease_s=30.0)) as (p, d):
        kept, unkept = p.offer("kept", [1]), p.offer("unkept", [2])
        lease = await d.keep("kept", "p-rel", secret=kept.secret)
        assert await d.release("kept", "p-rel", "request ended")
        assert await d.release("unkept", "p-rel", "prefix cache hit", secret=unkept.secret)
        with anyio.fail_after(2):  # not at lease expiry (30 s)
            for h in (kept, unkept):
                assert (await h.result()).status == "aborted"
        assert lease.released and not lease.active
        assert await d.release("never-offered", "p-rel")  # idempotent: nothing held after
        assert not await d.release("r", "nobody-here")  # no such source: not acknowledged
        await settle(p, d)
        assert_at_rest(p, d)


async def test_source_abort_reaches_the_lease_at_once(nats_server):
    lay = small_layout()
    async with agent_pair(nats_server, "p-sab", "d-sab", lay, 8,
                          p_kw=dict(lease_s=8.0)) as (p, d):
        held = p.offer("r", [1])
        lease = await d.keep("r", "p-sab", secret=held.secret)
        await held.abort("prefill preempted")
        with anyio.fail_after(1.0):  # told now, not at the next renewal (2 s away)
            err = await lease.lost()
        assert isinstance(err, TransferAbortedError) and "preempted" in str(err)
        assert_at_rest(p, d)


async def test_dead_keeper_releases_the_offer_before_its_lease_ends(nats_server):
    lay = small_layout()
    async with agent_pair(nats_server, "p-dk", "d-dk-0", lay, 8,
                          p_kw=dict(lease_s=30.0)) as (p, _d):
        held = p.offer("r", [1])
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=keeping_peer, args=(nats_server.url, "r", "p-dk", held.secret, q),
                           daemon=True)
        proc.start()
        try:
            assert await anyio.to_thread.run_sync(q.get, True, 60) == "kept"
            proc.kill()
            with anyio.fail_after(10):  # peer_timeout_s=1 here, the lease is 30 s
                result = await held.result()
            assert result.status == "failed" and "peer lost" in result.reason
        finally:
            proc.kill()
            proc.join(5)
        assert_at_rest(p)


async def test_prefill_dies_mid_pull_fails_fast(nats_server):
    lay = small_layout(layers=8)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    blob = msgspec.msgpack.encode(lay)
    proc = ctx.Process(target=offering_peer, args=(blob, nats_server.url, "dying", [1, 2], 3, q),
                       daemon=True)
    proc.start()
    try:
        said, secret = q.get(timeout=60)
        assert said == "offered"
        async with agent_pair(nats_server, "p-unused", "d-die", lay, 8) as (_p, d):
            rx = await d.pull("dying", "peer-offer", [4, 5], secret=secret)
            with anyio.fail_after(10):
                await rx.wait_layer(2)
            proc.kill()
            t = time.monotonic()
            with anyio.fail_after(10), pytest.raises(PeerLostError):
                await rx.wait()
            assert time.monotonic() - t < 3.0  # peer_timeout_s=1: fails fast, not at a deadline
            await settle(d)
            assert_at_rest(d)
    finally:
        proc.kill()
        proc.join(5)


@pytest.mark.parametrize("how", ["push", "pull"])
async def test_destination_abort_mid_transfer_no_write_after_the_ack(nats_server, how):
    """Once the destination's abort returns (the source acknowledged it), no byte of this
    transfer lands in its memory, however the source carries on."""
    lay = small_layout(layers=16)
    async with agent_pair(nats_server, f"p-nw-{how}", f"d-nw-{how}", lay, 32,
                          p_kw=LAYERED) as (p, d):
        src, dst = [4, 17, 9, 30], [2, 11, 25, 6]
        if how == "push":
            rx = d.expect("r", dst, src=p.instance_id)
            tx = await p.push("r", f"d-nw-{how}", src)
        else:
            tx = p.offer("r", src)
            rx = await d.pull("r", f"p-nw-{how}", dst, secret=tx.secret)

        async def compute() -> None:
            for layer in range(lay.num_layers):
                tx.layer_ready(layer)
                await anyio.sleep(0.005)

        async with anyio.create_task_group() as tg:
            tg.start_soon(compute)
            with anyio.fail_after(10):
                await rx.wait_layer(2)
                await rx.abort("decode gave up")
            snapshot = [t.clone() for t in d.memory.layers]
        await anyio.sleep(0.3)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, d.memory.layers, strict=True))
        with anyio.fail_after(5):
            assert (await tx.result()).status == "aborted"
        sent = p.statistics().bytes_sent
        assert sent < lay.num_layers * lay.block_bytes * 4  # the source stopped sending
        await settle(p, d)
        assert_at_rest(p, d)


@pytest.mark.parametrize("how", ["push", "pull"])
async def test_per_transfer_deadline_holds_on_both_sides(nats_server, how):
    lay = small_layout()
    async with agent_pair(nats_server, f"p-dl-{how}", f"d-dl-{how}", lay, 8) as (p, d):
        if how == "push":
            rx = d.expect("r", [1, 2], src=p.instance_id)
            tx = await p.push("r", f"d-dl-{how}", [3, 4], timeout=0.6)
        else:
            tx = p.offer("r", [3, 4])
            rx = await d.pull("r", f"p-dl-{how}", [1, 2], timeout=0.6, secret=tx.secret)
        # No layer is ever marked ready: the 0.6 s deadline, not the 60 s default, ends it.
        with anyio.fail_after(5):
            ends = {(await rx.result()).status, (await tx.result()).status}
        # Whichever side's watchdog fires first times out and tells the other (an abort).
        assert "timed_out" in ends and ends <= {"timed_out", "aborted"}
        await settle(p, d)
        assert_at_rest(p, d)
