"""Real nats-server, real UCX endpoints, agents in separate processes."""

from __future__ import annotations

import multiprocessing as mp
import time

import anyio
import msgspec
import nats
import pytest
import torch

from kvstream import (
    Agent,
    AgentConfig,
    IncompatiblePeerError,
    InvalidBlockError,
    KVLayout,
    NoPeerError,
    PeerLostError,
    TransferAbortedError,
    TransferError,
)
from kvstream.bench.runner import Harness
from kvstream.bench.synthetic import BenchSpec
from kvstream.control import messages as m
from kvstream.control.subjects import Subjects
from tests.fakes import cache, small_layout
from tests.integration.agents import LAYERED, agent_pair, assert_at_rest, cfg, settle
from tests.integration.peers import decode_peer, prefill_peer

pytestmark = pytest.mark.anyio


# -- bit-exact between two processes (the benchmark's own harness) --------------------------

@pytest.mark.parametrize("arrangement,scattered", [("flash_nhd", True), ("flash_nhd", False),
                                                    ("cpu_hnbc", True)])
def test_bit_exact_between_processes(nats_server, arrangement, scattered):
    lay = KVLayout(num_layers=6, num_kv_heads=2, head_dim=64, block_size=16,
                   arrangement=arrangement)
    spec = BenchSpec(layout=lay, tokens=16 * 24, scattered=scattered)
    with Harness(spec, nats_url=nats_server.url, timeout_s=60) as h:
        for mode in ("pipelined", "eager"):
            run = h.run_kv(mode=mode, compute_ms=1.0)
            assert run.status == "completed", run.reason
            assert run.verified, f"{mode}: bytes differ"
        stats = h.last_stats
    assert stats["decode"]["bytes_received"] == 2 * spec.payload_bytes
    assert stats["prefill"]["bytes_sent"] == 2 * spec.payload_bytes
    for side in stats.values():
        assert side["transfers_active"] == side["staging_bytes_in_use"] == 0


# -- a decode agent that is missing or dies --------------------------------------------------

async def test_missing_decode_agent_fails_fast(nats_server):
    lay = small_layout()
    async with Agent(cfg("p-missing", nats_server), layout=lay,
                     kv_caches=cache(lay, 8, fill=True)) as p:
        t = time.monotonic()
        with pytest.raises(NoPeerError):
            await p.push("r", "nobody-here", [1, 2])
        assert time.monotonic() - t < 1.5
        assert p.statistics().failed == 1
        assert_at_rest(p)


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, q), daemon=True)
    proc.start()
    return proc, q


async def _get(q, timeout=30.0):
    return await anyio.to_thread.run_sync(lambda: q.get(timeout=timeout))


async def test_killed_decode_agent_fails_the_push(nats_server):
    lay = small_layout(layers=6)
    proc, q = _spawn(decode_peer, msgspec.msgpack.encode(lay), nats_server.url, "r-kill",
                     [3, 9, 4], "p-kill")
    try:
        assert await _get(q) == "ready"
        async with Agent(cfg("p-kill", nats_server), layout=lay,
                         kv_caches=cache(lay, 16, fill=True)) as p:
            handle = await p.push("r-kill", "peer-decode", [1, 5, 7])
            handle.layer_ready(0)
            await anyio.sleep(0.3)
            proc.kill()
            t = time.monotonic()
            with anyio.fail_after(10):
                result = await handle.result()
            assert result.status == "failed" and result.reason.startswith("peer lost"), result
            assert time.monotonic() - t < 5.0
            with pytest.raises(PeerLostError):
                await handle.wait()
            await settle(p)
            assert_at_rest(p)
    finally:
        proc.kill()
        proc.join(5)


async def test_killed_prefill_agent_fails_the_receive(nats_server):
    lay = small_layout(layers=6)
    async with Agent(cfg("d-kill", nats_server), layout=lay,
                     kv_caches=cache(lay, 16, fill=False)) as d:
        handle = d.expect("r-pkill", [0, 1, 2], src="peer-prefill")
        proc, q = _spawn(prefill_peer, msgspec.msgpack.encode(lay), nats_server.url, "r-pkill",
                         "d-kill", [4, 8, 12], 2)
        try:
            assert await _get(q) == "pushed"
            with anyio.fail_after(10):
                await handle.wait_layer(1)
            proc.kill()
            with pytest.raises(PeerLostError), anyio.fail_after(10):
                await handle.wait()
            assert handle.layer_landed(1) and not handle.layer_landed(5)
            await settle(d)
            assert_at_rest(d)
        finally:
            proc.kill()
            proc.join(5)


# -- bad input ---------------------------------------------------------------------------------

async def test_invalid_block_ids_are_rejected_before_any_byte_moves(nats_server):
    lay = small_layout()
    async with agent_pair(nats_server, "p-bad", "d-bad", lay, 8) as (p, d):
        with pytest.raises(InvalidBlockError):
            d.expect("r0", [1, 8], src=p.instance_id)  # 8 is past the end
        handle = d.expect("r1", [1, 2, 3], src=p.instance_id)
        with pytest.raises(InvalidBlockError):
            await p.push("r1", "d-bad", [1, 2, 99])  # source side
        with pytest.raises(InvalidBlockError):
            await p.push("r1", "d-bad", [1, 2])  # does not map onto the reservation
        with pytest.raises(InvalidBlockError):
            await p.push("r1", "d-bad", [1, 2, 3], dst_blocks=[1, 2, 4])
        assert d.statistics().bytes_received == 0 and p.statistics().bytes_sent == 0
        assert d.statistics().reservations_active == 1  # the reservation survives bad offers
        await handle.abort("test over")
        assert_at_rest(p, d)


async def test_layout_mismatch_is_refused(nats_server):
    """Another arrangement is converted on the way (tests/integration/test_reshape.py);
    another head_dim cannot be: refused, naming both layouts, before a byte moves."""
    lay = small_layout()
    other = KVLayout(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                     head_dim=2 * lay.head_dim, block_size=lay.block_size)
    async with Agent(cfg("p-lay", nats_server), layout=lay, kv_caches=cache(lay, 8, fill=True)) as p, \
            Agent(cfg("d-lay", nats_server), layout=other,
                  kv_caches=cache(other, 8, fill=False)) as d:
        d.expect("r", [0, 1], src=p.instance_id)
        with anyio.fail_after(10):
            while not p.peers():
                await anyio.sleep(0.02)
        with pytest.raises(IncompatiblePeerError, match=f"head_dim {lay.head_dim} against "
                                                        f"{other.head_dim}"):
            await p.push("r", "d-lay", [0, 1])
        assert d.statistics().bytes_received == 0


async def test_malformed_control_message_is_survived(nats_server):
    lay = small_layout()
    async with agent_pair(nats_server, "p-mal", "d-mal", lay, 8) as (p, d):
        nc = await nats.connect(nats_server.url)
        try:
            subj = Subjects("default")
            reply = await nc.request(subj.control("d-mal"), b"\xc1garbage", timeout=2)
            rejected = m.decode(reply.data)
            assert isinstance(rejected, m.Reject) and rejected.code == "malformed"
            wrong = msgspec.msgpack.encode({"op": "kv.manifest", "v": 1, "transfer_id": 3})
            reply = await nc.request(subj.control("d-mal"), wrong, timeout=2)
            assert m.decode(reply.data).code == "malformed"
            await nc.publish(subj.registry("x"), b"not msgpack at all")
            await nc.flush()
        finally:
            await nc.close()
        # ... and it keeps serving: a real transfer still lands bit for bit.
        rx = d.expect("r", [4, 2], src=p.instance_id)
        tx = await p.push("r", "d-mal", [0, 6])
        tx.all_ready()
        with anyio.fail_after(10):
            await rx.wait()
            await tx.wait()
        for layer in range(lay.num_layers):
            assert torch.equal(p.memory.read_block(layer, 0), d.memory.read_block(layer, 4))
            assert torch.equal(p.memory.read_block(layer, 6), d.memory.read_block(layer, 2))
        assert d.statistics().malformed_messages >= 2
        await settle(p, d)
        assert_at_rest(p, d)


# -- aborts --------------------------------------------------------------------------------------

@pytest.mark.parametrize("who", ["decode", "prefill"])
async def test_abort_mid_push_releases_both_sides(nats_server, who):
    lay = small_layout(layers=8)
    async with agent_pair(nats_server, f"p-ab-{who}", f"d-ab-{who}", lay, 16,
                          p_kw=LAYERED) as (p, d):
        rx = d.expect("r", [9, 3, 5], src=p.instance_id)
        tx = await p.push("r", f"d-ab-{who}", [1, 2, 4])
        tx.layer_ready(0)
        tx.layer_ready(1)
        with anyio.fail_after(10):
            await rx.wait_layer(1)
        aborter = rx if who == "decode" else tx
        with anyio.fail_after(10):
            mine = await aborter.abort("changed my mind")
            other = await (tx if who == "decode" else rx).result()
        assert mine.status == other.status == "aborted"
        with pytest.raises(TransferAbortedError):
            await rx.wait()
        # Layers after the abort never land.
        tx.all_ready()
        await anyio.sleep(0.2)
        assert not rx.layer_landed(7)
        assert d.memory.read_block(7, 9).count_nonzero() == 0
        await settle(p, d)
        assert_at_rest(p, d)
        assert p.statistics().aborted == d.statistics().aborted == 1


async def test_agent_without_url_uses_or_starts_nats_on_the_default_url():
    from kvstream.control.nats_server import DEFAULT_NATS_URL, is_listening

    was_listening = is_listening(DEFAULT_NATS_URL)
    lay = small_layout()
    async with Agent(AgentConfig(instance_id="no-url", heartbeat_s=0.25, peer_timeout_s=1.0),
                     layout=lay, kv_caches=cache(lay, 4, fill=False)) as a, \
            Agent(AgentConfig(instance_id="no-url-2", heartbeat_s=0.25, peer_timeout_s=1.0),
                  layout=lay, kv_caches=cache(lay, 4, fill=False)) as b:
        assert a.nats_url == b.nats_url == DEFAULT_NATS_URL
        with anyio.fail_after(5):
            while not any(p.instance_id == "no-url" for p in b.peers()):
                await anyio.sleep(0.05)
    # An embedded server belongs to the agent that started it and ends with it.
    assert is_listening(DEFAULT_NATS_URL) == was_listening


# -- pushes that arrive before the reservation -------------------------------------------------

def _layer_bytes(lay, nblocks: int) -> int:
    return lay.block_bytes * nblocks


@pytest.mark.parametrize("claim_after", [0, 3, 8])
async def test_push_before_reservation_is_staged_then_claimed(nats_server, claim_after):
    lay = small_layout(layers=8)
    async with agent_pair(nats_server, f"p-early{claim_after}", f"d-early{claim_after}", lay,
                          16, p_kw=LAYERED) as (p, d):
        tx = await p.push("early", f"d-early{claim_after}", [3, 1, 12])  # nothing reserved yet
        for layer in range(claim_after):
            tx.layer_ready(layer)
        with anyio.fail_after(10):
            while d.statistics().bytes_received < claim_after * _layer_bytes(lay, 3):
                await anyio.sleep(0.01)
        assert d.statistics().staged_transfers == 1
        assert d.statistics().staging_bytes_in_use > 0
        # the engine reserves: staged layers move in
        rx = d.expect("early", [0, 9, 4], src=p.instance_id)
        tx.all_ready()
        with anyio.fail_after(10):
            await rx.wait()
            await tx.wait()
        for layer in range(lay.num_layers):
            for a, b in ((3, 0), (1, 9), (12, 4)):
                assert torch.equal(p.memory.read_block(layer, a), d.memory.read_block(layer, b))
        await settle(p, d)
        assert_at_rest(p, d)
        assert d.statistics().staged_transfers == 0


async def test_unclaimed_staged_push_is_dropped_and_counted(nats_server):
    lay = small_layout()
    async with agent_pair(nats_server, "p-drop", "d-drop", lay, 8,
                          d_kw=dict(reservation_timeout_s=0.5)) as (p, d):
        tx = await p.push("never-claimed", "d-drop", [1, 2])
        tx.all_ready()
        with anyio.fail_after(10):
            # The sender is done as soon as everything is staged: it releases its blocks.
            assert (await tx.wait()).ok
            while d.statistics().staged_dropped == 0:
                await anyio.sleep(0.05)
        await settle(d)
        s = d.statistics()
        assert (s.staged_transfers, s.timed_out, s.staging_bytes_in_use) == (0, 1, 0)
        assert d.memory.read_block(0, 1).count_nonzero() == 0  # nothing was written anywhere


async def test_full_staging_pool_gives_bounded_backpressure(nats_server):
    lay = small_layout()
    one_push = lay.num_layers * (_layer_bytes(lay, 2) + 512)
    # The whole pool may go to pushes nobody reserved for (by default only half may, and
    # an eighth per sender: this one would never be staged).
    unbounded = dict(unsolicited_staging_share=1.0, unsolicited_sender_share=1.0)
    async with agent_pair(nats_server, "p-full", "d-full", lay, 8, p_kw=dict(staging_wait_s=0.6),
                          d_kw=dict(staging_bytes=one_push, **unbounded)) as (p, d):
        first = await p.push("a", "d-full", [1, 5])
        first.all_ready()
        t = time.monotonic()
        with pytest.raises(TransferError, match="busy"):
            await p.push("b", "d-full", [2, 6])  # no room to stage it: waits, then gives up
        # It waited, boundedly: the retries stop before a back-off would pass
        # staging_wait_s, so at least 0.6 s less one back-off (at most 0.25 + 0.01 s).
        assert 0.6 - 0.26 <= time.monotonic() - t < 15
        d.expect("a", [0, 3], src=p.instance_id)  # claiming the first frees the pool ...

        async def claim_later() -> None:
            await anyio.sleep(0.2)
            rx = d.expect("c", [4, 7], src=p.instance_id)
            await rx.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(claim_later)
            third = await p.push("c", "d-full", [2, 6])  # ... so this one gets in
            third.all_ready()
            with anyio.fail_after(10):
                await third.wait()
        await settle(p, d)
        assert_at_rest(p, d)


async def test_staged_push_with_promised_contiguous_blocks(nats_server):
    """The sender names contiguous destination blocks before the receiver reserved them:
    both sides must still agree on the framing of a staged push."""
    lay = small_layout(layers=4)
    async with agent_pair(nats_server, "p-promise", "d-promise", lay, 16) as (p, d):
        tx = await p.push("promised", "d-promise", [9, 2, 14], dst_blocks=[4, 5, 6])
        tx.all_ready()
        with anyio.fail_after(10):
            assert (await tx.wait()).ok  # all staged
        with pytest.raises(InvalidBlockError):
            # not what was promised: refused, still staged
            d.expect("promised", [4, 5, 7], src=p.instance_id)
        rx = d.expect("promised", [4, 5, 6], src=p.instance_id)
        with anyio.fail_after(10):
            await rx.wait()
        for layer in range(lay.num_layers):
            for a, b in ((9, 4), (2, 5), (14, 6)):
                assert torch.equal(p.memory.read_block(layer, a), d.memory.read_block(layer, b))
        await settle(p, d)
        assert_at_rest(p, d)


async def test_a_staged_push_is_not_claimed_over_blocks_the_engine_has(nats_server):
    """A staged push holds and would write every block: claimed with ``have`` (blocks the
    engine's prefix cache supplied, shared with other requests) it is refused and dropped,
    and nothing is written."""
    from kvstream import InvalidBlockError, block_hashes

    lay = small_layout()
    hashes = block_hashes(range(2 * lay.block_size), lay.block_size)
    async with agent_pair(nats_server, "p-have", "d-have", lay, 8) as (p, d):
        tx = await p.push("cached", "d-have", [1, 2], block_hashes=hashes)
        tx.all_ready()
        with anyio.fail_after(10):
            assert (await tx.wait()).ok
            while not d.statistics().staged_transfers:
                await anyio.sleep(0.02)
        with pytest.raises(InvalidBlockError, match="cannot skip"):
            d.expect("cached", [3, 4], have=hashes[:1], src=p.instance_id)
        await settle(d)
        s = d.statistics()
        assert (s.staged_transfers, s.staging_bytes_in_use) == (0, 0)
        assert d.memory.read_block(0, 3).count_nonzero() == 0
        assert d.memory.read_block(0, 4).count_nonzero() == 0
        assert_at_rest(p, d)


async def test_an_abort_that_overtakes_the_answer_to_a_push_ends_the_push(nats_server):
    """The destination stages a push, its engine drops it at once (claimed over blocks it
    has cached) and tells the sender, and that Abort reaches the sender before the
    answer to its manifest does: the push must end there, not stream into a transfer
    that is gone until its deadline (seen in a real vLLM run: the prefill held the
    request's blocks for it)."""
    from kvstream import InvalidBlockError, TransferAbortedError, block_hashes

    lay = small_layout()
    hashes = block_hashes(range(2 * lay.block_size), lay.block_size)
    async with agent_pair(nats_server, "p-overtake", "d-overtake", lay, 8,
                          p_kw={"transfer_timeout_s": 60.0}) as (p, d):
        admit = d._admission.on_manifest

        async def answer_late(msg, headers=None):
            reply = await admit(msg, headers)  # staged: no reservation yet
            with pytest.raises(InvalidBlockError, match="cannot skip"):
                # dropped; the sender told
                d.expect(msg.request_id, [3, 4], have=hashes[:1], src=p.instance_id)
            await anyio.sleep(0.5)  # the Abort is answered before this answer leaves
            return reply

        d._admission.on_manifest = answer_late
        # Bound: the Abort's round trip and the answer's 0.5 s, far below the 60 s deadline
        # the push would otherwise stream into nothing for.
        with anyio.fail_after(10), pytest.raises(TransferAbortedError, match="aborted by"):
            await p.push("overtaken", "d-overtake", [1, 2], block_hashes=hashes,
                         mode="pipelined")
        await settle(p, d)
        assert_at_rest(p, d)
