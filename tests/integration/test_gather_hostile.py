"""A gather (issue 18) against a careful user's mistakes and an attacker's messages, over
real NATS and UCX: a cancelled gather leaves no part running; it never releases sources
another decode rank needs; FP8 parts with other cache scales are refused (single pulls
too); with a secret per rank, one rank cannot pull another's offer; a crafted part is
refused at the source and a forged answer at the destination; other token counts and a
source that does not answer fail the gather whole and leave nothing held; aborting twice
is safe."""

from __future__ import annotations

import secrets

import anyio
import msgspec
import pytest
import torch

from kvstream import Agent, IncompatiblePeerError, KVStreamError, TransferError
from kvstream.control import messages as m
from kvstream.dataplane import wire
from kvstream.layout import KVLayout
from kvstream.transfer.plan import Reshape, TpInfo
from tests.integration.agents import assert_at_rest, cfg, meet, settle

pytestmark = pytest.mark.anyio

BASE = {"num_layers": 2, "head_dim": 16, "dtype": "float16"}


def _cache(lay: KVLayout, n: int, seed: int | None) -> list[torch.Tensor]:
    dtype = getattr(torch, lay.dtype)
    if seed is None:
        return [torch.zeros(lay.tensor_shape(n), dtype=dtype) for _ in range(lay.num_layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(lay.tensor_shape(n), generator=gen).to(dtype)
            for _ in range(lay.num_layers)]


def _agent(name, nats_server, tp: TpInfo, heads: int, block: int, *, seed, dtype="float16",
           scales=None):
    lay = KVLayout(**{**BASE, "dtype": dtype}, num_kv_heads=heads, block_size=block)
    a = Agent(cfg(name, nats_server, tp=tp), layout=lay)
    a.register_kv(lay, _cache(lay, 8, seed), cache_scales=scales)
    return a



def _slow_pulls(agent: Agent, delay: float) -> None:
    """``agent`` answers every Pull ``delay`` seconds late (a slow or loaded source)."""
    real = agent._offers.on_pull

    async def slow(msg, headers=None):
        await anyio.sleep(delay)
        return await real(msg, headers)

    agent._offers.on_pull = slow  # type: ignore[method-assign]


# -- problems ------------------------------------------------------------------------


async def test_a_cancelled_gather_leaves_no_part_running(nats_server):
    """The caller cancels the gather (its own deadline, a disconnect) while one source
    has answered and the other not yet: the part already started is aborted before the
    cancellation goes on (lazy here; an eager part would otherwise go on writing into
    blocks the caller was told are not being filled)."""
    total = TpInfo(size=2, total_kv_heads=4)
    async with _agent("cx0", nats_server, msgspec.structs.replace(total, rank=0), 2, 16,
                      seed=0) as p0, \
            _agent("cx1", nats_server, msgspec.structs.replace(total, rank=1), 2, 16,
                   seed=1) as p1, \
            _agent("cxd", nats_server, TpInfo(), 4, 32, seed=None) as d:
        await meet(p0, p1, d)
        secret = secrets.token_urlsafe(16)
        offers = [p.offer("r", [0, 1, 2, 3], secret=secret) for p in (p0, p1)]
        for o in offers:
            o.all_ready()
        _slow_pulls(p1, 0.6)
        with anyio.move_on_after(0.3) as scope:
            await d.pull("r", ["cx0", "cx1"], [4, 5], mode="lazy", secret=secret, tokens=64)
        assert scope.cancelled_caught
        # A leaked part would run until its 60 s transfer timeout.
        with anyio.fail_after(10):
            while (d.statistics().transfers_active, p0.statistics().transfers_active) != (0, 0):
                await anyio.sleep(0.02)


async def test_a_gather_does_not_release_sources_another_rank_needs(nats_server):
    """Prefill TP 4 (one head each) -> decode TP 2 (two heads each). Each decode rank
    names the whole prefill group; rank 0 pulls ranks 0 and 1 and leaves ranks 2 and 3
    alone, so decode rank 1's gather, which needs exactly those, finds them offered."""
    tp4 = [TpInfo(rank=r, size=4, total_kv_heads=4) for r in range(4)]
    tp2 = [TpInfo(rank=r, size=2, total_kv_heads=4) for r in range(2)]
    names = [f"sr{r}" for r in range(4)]
    async with _agent(names[0], nats_server, tp4[0], 1, 16, seed=0) as p0, \
            _agent(names[1], nats_server, tp4[1], 1, 16, seed=1) as p1, \
            _agent(names[2], nats_server, tp4[2], 1, 16, seed=2) as p2, \
            _agent(names[3], nats_server, tp4[3], 1, 16, seed=3) as p3, \
            _agent("srd0", nats_server, tp2[0], 2, 16, seed=None) as d0, \
            _agent("srd1", nats_server, tp2[1], 2, 16, seed=None) as d1:
        prefill = [p0, p1, p2, p3]
        await meet(*prefill, d0, d1)
        secret = secrets.token_urlsafe(16)
        offers = [p.offer("r", [0, 1], secret=secret) for p in prefill]
        for o in offers:
            o.all_ready()
        with anyio.fail_after(20):
            assert (await (await d0.pull("r", names, [2, 3], secret=secret)).wait()).ok
        assert not offers[2].done and not offers[3].done, \
            [(await o.result()).reason for o in offers[2:]]
        with anyio.fail_after(20):
            assert (await (await d1.pull("r", names, [2, 3], secret=secret)).wait()).ok


async def test_fp8_parts_with_other_cache_scales_are_refused(nats_server):
    """FP8 bytes scaled 1.0 must not land in a cache scaled 4.0 (they would mean other
    values): every part of a gather is refused, as a push between unequal layouts is."""
    tp = [TpInfo(rank=r, size=2, total_kv_heads=4) for r in range(2)]
    fp8 = "float8_e4m3fn"
    async with _agent("fs0", nats_server, tp[0], 2, 16, seed=0, dtype=fp8,
                      scales=[1.0, 1.0]) as p0, \
            _agent("fs1", nats_server, tp[1], 2, 16, seed=1, dtype=fp8,
                   scales=[1.0, 1.0]) as p1, \
            _agent("fsd", nats_server, TpInfo(), 4, 32, seed=None, dtype=fp8,
                   scales=[4.0, 4.0]) as d:
        await meet(p0, p1, d)
        secret = secrets.token_urlsafe(16)
        offers = [p.offer("r", [0, 1, 2, 3], secret=secret) for p in (p0, p1)]
        for o in offers:
            o.all_ready()
        with anyio.fail_after(20), pytest.raises(IncompatiblePeerError, match="FP8 cache scales"):
            await d.pull("r", ["fs0", "fs1"], [4, 5], secret=secret)
        await settle(p0, p1, d)
        assert_at_rest(p0, p1, d)


# -- claims that hold ------------------------------------------------------------------


async def test_crafted_parts_are_refused_by_the_source(nats_server):
    """A destination holding the secret crafts Pulls: heads past the source's, a part
    whose heads are other model heads, another wire dtype, a lying TP share, huge
    tokens. Each is refused; the source lives on and the honest gather then works."""
    tp = [TpInfo(rank=r, size=2, total_kv_heads=4) for r in range(2)]
    async with _agent("mp0", nats_server, tp[0], 2, 16, seed=0) as p0, \
            _agent("mp1", nats_server, tp[1], 2, 16, seed=1) as p1, \
            _agent("mpd", nats_server, TpInfo(), 4, 32, seed=None) as d:
        await meet(p0, p1, d)
        secret = secrets.token_urlsafe(16)
        offers = [p.offer("r", [0, 1, 2, 3], secret=secret) for p in (p0, p1)]
        for o in offers:
            o.all_ready()
        core, lay = d._core, d.memory.layout
        good = Reshape(tokens=64, src_head=0, dst_head=2, heads=2, dtype="float16")

        async def ask(rid: str, r: Reshape, dst_tp: TpInfo | None = None,
                      dst_layout: KVLayout | None = None):
            tag = wire.new_xfer_tag()
            try:
                return await core.control.request(
                    core.subjects.control("mp1"),
                    m.Pull(request_id=rid, src="mp1", dst="mpd",
                           dst_address=core.transport.address, dst_tag=tag,
                           fingerprint=lay.fingerprint, num_layers=lay.num_layers,
                           dst_blocks=[4, 5], secret=secret, reshape=r,
                           dst_layout=dst_layout or lay, dst_tp=dst_tp or TpInfo()),
                    timeout=2.0, peer="mp1")
            finally:
                wire.release_xfer_tag(tag)

        for r in (msgspec.structs.replace(good, src_head=1),  # past the source's heads
                  msgspec.structs.replace(good, dst_head=0),  # other model heads
                  msgspec.structs.replace(good, dtype="float32"),
                  msgspec.structs.replace(good, heads=1 << 20)):
            reply = await ask("r", r)
            assert isinstance(reply, m.Reject) and reply.code == "incompatible", (r, reply)
        # A TP share that does not fit the layout it comes with.
        reply = await ask("r", msgspec.structs.replace(good, dst_head=0),
                          TpInfo(rank=0, size=2, total_kv_heads=4))
        assert isinstance(reply, m.Reject) and reply.code == "incompatible", reply
        assert not offers[1].done
        with anyio.fail_after(20):
            rx = await d.pull("r", ["mp0", "mp1"], [4, 5], secret=secret)
            assert (await rx.result()).ok
        # Huge tokens: clamped to what the offer holds (64), read within its blocks.
        huge = p1.offer("h", [0, 1, 2, 3], secret=secret)
        reply = await ask("h", msgspec.structs.replace(good, tokens=1 << 24))
        assert isinstance(reply, m.Manifest) and reply.reshape.tokens == 64, reply
        await core.request_abort("mp1", reply.transfer_id, "test over")
        with anyio.fail_after(10):
            assert not (await huge.result()).ok
        await settle(p0, p1, d)
        assert_at_rest(p0, p1, d)


async def test_a_forged_answer_fails_the_gather_whole(nats_server):
    """The rank-1 source answers with another part than asked (its heads landing on the
    rank-0 part's): refused, both parts end, nothing is left held anywhere."""
    tp = [TpInfo(rank=r, size=2, total_kv_heads=4) for r in range(2)]
    async with _agent("fa0", nats_server, tp[0], 2, 16, seed=0) as p0, \
            _agent("fa1", nats_server, tp[1], 2, 16, seed=1) as p1, \
            _agent("fad", nats_server, TpInfo(), 4, 32, seed=None) as d:
        await meet(p0, p1, d)
        real = p1._offers.on_pull

        async def forge(msg, headers=None):
            reply = await real(msg, headers)
            if isinstance(reply, m.Manifest) and reply.reshape is not None:
                reply = msgspec.structs.replace(
                    reply, reshape=msgspec.structs.replace(reply.reshape, dst_head=0),
                    src_tp=TpInfo(rank=0, size=2, total_kv_heads=4))
            return reply

        p1._offers.on_pull = forge  # type: ignore[method-assign]
        secret = secrets.token_urlsafe(16)
        offers = [p.offer("r", [0, 1, 2, 3], secret=secret) for p in (p0, p1)]
        for o in offers:
            o.all_ready()
        with pytest.raises(KVStreamError, match="asked"):
            await d.pull("r", ["fa0", "fa1"], [4, 5], mode="lazy", secret=secret)
        with anyio.fail_after(20):
            assert not any([(await o.result()).ok for o in offers])
        await settle(p0, p1, d)
        assert_at_rest(p0, p1, d)


async def test_other_token_counts_and_a_silent_source_fail_whole(nats_server):
    tp = [TpInfo(rank=r, size=2, total_kv_heads=4) for r in range(2)]
    async with _agent("ft0", nats_server, tp[0], 2, 16, seed=0) as p0, \
            _agent("ft1", nats_server, tp[1], 2, 16, seed=1) as p1, \
            _agent("ftd", nats_server, TpInfo(), 4, 32, seed=None) as d:
        await meet(p0, p1, d)
        secret = secrets.token_urlsafe(16)
        # Rank 1 holds 48 tokens (3 blocks of 16), rank 0 64: both fit 2 blocks of 32.
        offers = [p0.offer("r", [0, 1, 2, 3], secret=secret),
                  p1.offer("r", [0, 1, 2], secret=secret)]
        for o in offers:
            o.all_ready()
        with pytest.raises(KVStreamError, match="tokens"):
            await d.pull("r", ["ft0", "ft1"], [4, 5], mode="lazy", secret=secret)
        with anyio.fail_after(20):
            assert not any([(await o.result()).ok for o in offers])
        await settle(p0, p1, d)
        assert_at_rest(p0, p1, d)

        # Rank 1 does not answer within the request timeout (1 s here).
        _slow_pulls(p1, 1.5)
        offers = [p.offer("q", [0, 1, 2, 3], secret=secret) for p in (p0, p1)]
        for o in offers:
            o.all_ready()
        with pytest.raises(KVStreamError):
            await d.pull("q", ["ft0", "ft1"], [4, 5], mode="lazy", secret=secret)
        with anyio.fail_after(20):
            assert not any([(await o.result()).ok for o in offers])
        await anyio.sleep(2.0)  # the late answer finds the offer gone
        await settle(p0, p1, d)
        assert_at_rest(p0, p1, d)


async def test_abort_twice_and_the_result_after(nats_server):
    tp = [TpInfo(rank=r, size=2, total_kv_heads=4) for r in range(2)]
    async with _agent("ab0", nats_server, tp[0], 2, 16, seed=0) as p0, \
            _agent("ab1", nats_server, tp[1], 2, 16, seed=1) as p1, \
            _agent("abd", nats_server, TpInfo(), 4, 32, seed=None) as d:
        await meet(p0, p1, d)
        secret = secrets.token_urlsafe(16)
        offers = [p.offer("r", [0, 1, 2, 3], secret=secret) for p in (p0, p1)]
        for o in offers:
            o.all_ready()
        rx = await d.pull("r", ["ab0", "ab1"], [4, 5], mode="lazy", secret=secret)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(rx.abort, "first")
                tg.start_soon(rx.abort, "second")
            res = await rx.abort("third")
        assert not res.ok and res.status == "aborted" and rx.done
        with pytest.raises(TransferError):
            await rx.wait_layer(0)
        with pytest.raises(TransferError):
            await rx.wait()
        await settle(p0, p1, d)
        assert_at_rest(p0, p1, d)


async def test_fp8_single_reshaped_pull_with_other_cache_scales_is_refused(nats_server):
    """The same without a gather: one source, block 16 -> block 32, FP8 scaled 1.0 into
    a cache scaled 4.0, refused as a push of the same is."""
    fp8 = "float8_e4m3fn"
    async with _agent("f1s", nats_server, TpInfo(), 4, 16, seed=0, dtype=fp8,
                      scales=[1.0, 1.0]) as p, \
            _agent("f1d", nats_server, TpInfo(), 4, 32, seed=None, dtype=fp8,
                   scales=[4.0, 4.0]) as d:
        await meet(p, d)
        secret = secrets.token_urlsafe(16)
        o = p.offer("r", [0, 1, 2, 3], secret=secret)
        o.all_ready()
        with anyio.fail_after(20), pytest.raises(IncompatiblePeerError, match="FP8 cache scales"):
            await d.pull("r", "f1s", [4, 5], secret=secret)
        await settle(p, d)
        assert_at_rest(p, d)


async def test_one_source_cannot_use_the_gather_secret_at_another(nats_server):
    """With one secret per rank (a list for the gather), a malicious (or compromised) rank
    0 learns only its own (here from the lease renewals of ``keep``) and cannot pull rank
    1's heads for itself; the engine's gather then completes."""
    tp = [TpInfo(rank=r, size=2, total_kv_heads=4) for r in range(2)]
    async with _agent("ss0", nats_server, tp[0], 2, 16, seed=0) as p0, \
            _agent("ss1", nats_server, tp[1], 2, 16, seed=1) as p1, \
            _agent("ssd", nats_server, TpInfo(), 4, 32, seed=None) as d:
        await meet(p0, p1, d)
        stolen: list[m.ControlMessage] = []
        real = p0._offers.on_renew
        core = p0._core

        async def steal(rid: str, secret: str) -> None:
            lay = KVLayout(**BASE, num_kv_heads=2, block_size=16)
            tag = wire.new_xfer_tag()
            try:
                stolen.append(await core.control.request(
                    core.subjects.control("ss1"),
                    m.Pull(request_id=rid, src="ss1", dst="ss0",
                           dst_address=core.transport.address, dst_tag=tag,
                           fingerprint=lay.fingerprint, num_layers=lay.num_layers,
                           dst_blocks=[4, 5, 6, 7], secret=secret,
                           reshape=Reshape(tokens=64, src_head=0, dst_head=0, heads=2,
                                           dtype="float16"),
                           dst_layout=lay, dst_tp=tp[1]),
                    timeout=2.0, peer="ss1"))
            finally:
                wire.release_xfer_tag(tag)
            if isinstance(stolen[-1], m.Manifest):
                await core.request_abort("ss1", stolen[-1].transfer_id, "done stealing")

        def renew(msg):
            for rid, sec in zip(msg.request_ids, msg.secrets, strict=False):
                core.spawn(steal, rid, sec)
            return real(msg)

        p0._offers.on_renew = renew  # type: ignore[method-assign]
        # One secret per rank (Agent.pull takes a list for a gather): rank 0 learns only
        # its own.
        keys = [secrets.token_urlsafe(16) for _ in range(2)]
        offers = [p.offer("r", [0, 1, 2, 3], secret=k) for p, k in zip((p0, p1), keys, strict=True)]
        for o in offers:
            o.all_ready()
        for name, k in zip(("ss0", "ss1"), keys, strict=True):
            await d.keep("r", name, secret=k)
        with anyio.fail_after(10):  # the steal runs when rank 0 sees the renewal
            while not stolen:
                await anyio.sleep(0.02)
        assert not isinstance(stolen[0], m.Manifest), \
            "rank 0 pulled rank 1's offer with the secret the gather's keep sent it"
        with anyio.fail_after(20):
            rx = await d.pull("r", ["ss0", "ss1"], [4, 5], secret=keys)
            assert (await rx.result()).ok
