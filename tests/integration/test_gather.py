"""A destination gathering one request's KV heads from several sources (prefill TP >
decode TP, issue 18) over real NATS and UCX: every element checked against its source,
replicas that are not needed released at once, and the request failing whole (every
part ended, nothing left held) when one part fails or the sources cannot fill it."""

from __future__ import annotations

import secrets

import anyio
import pytest
import torch

from kvstream import Agent, ConfigError, IncompatiblePeerError, TransferError
from kvstream.layout import KVLayout
from kvstream.transfer.plan import TpInfo, pack
from tests.integration.agents import assert_at_rest, cfg, meet, settle

pytestmark = pytest.mark.anyio

BASE = {"num_layers": 3, "head_dim": 32, "dtype": "float16"}


def _cache(lay: KVLayout, n: int, *, seed: int | None) -> list[torch.Tensor]:
    dtype = getattr(torch, lay.dtype)
    if seed is None:
        return [torch.zeros(lay.tensor_shape(n), dtype=dtype) for _ in range(lay.num_layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(lay.tensor_shape(n), generator=gen).to(dtype)
            for _ in range(lay.num_layers)]



def _prefill(name: str, nats_server, tp: TpInfo, heads: int, total: int, block: int):
    lay = KVLayout(**BASE, num_kv_heads=heads, block_size=block)
    return Agent(cfg(name, nats_server, tp=TpInfo(rank=tp.rank, size=tp.size,
                                                  total_kv_heads=total)),
                 layout=lay, kv_caches=_cache(lay, 12, seed=tp.rank))


@pytest.mark.parametrize("mode", ["eager", "lazy"])
async def test_decode_gathers_heads_from_two_prefill_ranks(nats_server, mode):
    """Prefill TP 2 (block 16, NHD, 2 of 4 heads each) -> decode TP 1 (block 32, HND):
    one request-level pull, heads [0, 2) from rank 0 and [2, 4) from rank 1."""
    tokens, src, dst = 70, [4, 0, 9, 2, 7], [5, 1, 8]
    d_lay = KVLayout(**BASE, num_kv_heads=4, block_size=32, arrangement="flash_hnd")
    async with _prefill("gp0", nats_server, TpInfo(rank=0, size=2), 2, 4, 16) as p0, \
            _prefill("gp1", nats_server, TpInfo(rank=1, size=2), 2, 4, 16) as p1, \
            Agent(cfg("gd", nats_server), layout=d_lay,
                  kv_caches=_cache(d_lay, 12, seed=None)) as d:
        await meet(p0, p1, d)
        secret = secrets.token_urlsafe(16)
        offers = [p.offer("r", src, secret=secret) for p in (p0, p1)]
        for o in offers:
            o.all_ready()
        rx = await d.pull("r", ["gp0", "gp1"], dst, mode=mode, secret=secret, tokens=tokens)
        if mode == "lazy":
            for layer in range(d_lay.num_layers):
                with anyio.fail_after(20):
                    await rx.wait_layer(layer)
                assert rx.layer_landed(layer)
        with anyio.fail_after(20):
            result = await rx.result()
        assert result.ok, result
        assert result.peer == "gp0,gp1" and len(rx.parts) == 2
        assert result.bytes == sum(r.bytes for r in [await h.result() for h in rx.parts]) > 0
        for o in offers:
            with anyio.fail_after(20):
                assert (await o.result()).ok
        for layer in range(d_lay.num_layers):
            got = pack(d.memory.layers[layer], d_lay, dst, tokens)
            for rank, p in enumerate((p0, p1)):
                want = pack(p.memory.layers[layer], p.memory.layout, src, tokens)
                assert torch.equal(got[:, :, 2 * rank:2 * rank + 2], want), (layer, rank)
            # The last block's slots past the 70 tokens stay as they were.
            assert not pack(d.memory.layers[layer], d_lay, dst, 96)[:, tokens:].any()
        await settle(p0, p1, d)
        assert_at_rest(p0, p1, d)


async def test_replicated_heads_come_from_one_rank_and_the_others_are_left_alone(nats_server):
    """Prefill TP 4 over 2 KV heads (each head on two ranks) -> decode TP 1: ranks 0 and 2
    send; ranks 1 and 3 hold the same heads and keep their offers (a sibling decode rank
    may pull them) until the caller releases them."""
    tokens, src, dst = 48, [3, 1, 6], [2, 0, 5]
    d_lay = KVLayout(**BASE, num_kv_heads=2, block_size=16)
    names = [f"gr{r}" for r in range(4)]
    ranks = [_prefill(n, nats_server, TpInfo(rank=r, size=4), 1, 2, 16)
             for r, n in enumerate(names)]
    async with ranks[0] as p0, ranks[1] as p1, ranks[2] as p2, ranks[3] as p3, \
            Agent(cfg("grd", nats_server), layout=d_lay,
                  kv_caches=_cache(d_lay, 12, seed=None)) as d:
        prefill = [p0, p1, p2, p3]
        await meet(*prefill, d)
        secret = secrets.token_urlsafe(16)
        offers = [p.offer("r", src, secret=secret) for p in prefill]
        for o in offers:
            o.all_ready()
        rx = await d.pull("r", names, dst, secret=secret, tokens=tokens)
        with anyio.fail_after(20):
            assert (await rx.wait()).peer == "gr0,gr2"
            assert (await offers[0].result()).ok and (await offers[2].result()).ok
        assert not offers[1].done and not offers[3].done
        for name in ("gr1", "gr3"):
            assert await d.release("r", name, "not needed", secret=secret)
        with anyio.fail_after(20):
            results = [await o.result() for o in offers[1::2]]
        assert not any(r.ok for r in results) and all("not needed" in r.reason for r in results)
        for layer in range(3):
            got = pack(d.memory.layers[layer], d_lay, dst, tokens)
            for head, p in ((0, p0), (1, p2)):
                want = pack(p.memory.layers[layer], p.memory.layout, src, tokens)
                assert torch.equal(got[:, :, head:head + 1], want), (layer, head)
        await settle(*prefill, d)
        assert_at_rest(*prefill, d)


async def test_one_part_failing_fails_the_whole_gather(nats_server):
    """A lazy gather whose rank-1 source aborts mid-way: the request fails whole, the
    rank-0 part is aborted too, and every transfer on all three agents has ended."""
    tokens, src, dst = 64, [0, 1, 2, 3], [4, 5]
    d_lay = KVLayout(**BASE, num_kv_heads=4, block_size=32)
    async with _prefill("fp0", nats_server, TpInfo(rank=0, size=2), 2, 4, 16) as p0, \
            _prefill("fp1", nats_server, TpInfo(rank=1, size=2), 2, 4, 16) as p1, \
            Agent(cfg("fd", nats_server), layout=d_lay,
                  kv_caches=_cache(d_lay, 8, seed=None)) as d:
        await meet(p0, p1, d)
        secret = secrets.token_urlsafe(16)
        offers = [p.offer("r", src, secret=secret) for p in (p0, p1)]
        for o in offers:
            o.all_ready()
        rx = await d.pull("r", ["fp0", "fp1"], dst, mode="lazy", secret=secret, tokens=tokens)
        with anyio.fail_after(20):
            await rx.wait_layer(0)
            await offers[1].abort("rank 1 gave up")
            result = await rx.result()
        assert not result.ok and "rank 1 gave up" in result.reason, result
        parts = [await h.result() for h in rx.parts]
        assert not any(p.ok for p in parts), parts
        with pytest.raises(TransferError):
            await rx.wait()
        with anyio.fail_after(20):
            assert not (await offers[0].result()).ok
        await settle(p0, p1, d)
        assert_at_rest(p0, p1, d)

        # A source with nothing offered: the gather fails to start, the other part stops.
        offer = p0.offer("q", src, secret=secret)
        offer.all_ready()
        with pytest.raises(TransferError, match="holds no KV"):
            await d.pull("q", ["fp0", "fp1"], dst, secret=secret, tokens=tokens)
        with anyio.fail_after(20):
            assert not (await offer.result()).ok
        await settle(p0, p1, d)
        assert_at_rest(p0, p1, d)


async def test_sources_that_cannot_fill_the_heads_are_refused(nats_server):
    d_lay = KVLayout(**BASE, num_kv_heads=4, block_size=16)
    async with _prefill("cp0", nats_server, TpInfo(rank=0, size=2), 2, 4, 16) as p0, \
            Agent(cfg("cd", nats_server), layout=d_lay,
                  kv_caches=_cache(d_lay, 8, seed=None)) as d:
        await meet(p0, d)
        with pytest.raises(IncompatiblePeerError, match="no source holds KV head 2"):
            await d.pull("r", ["cp0"], [0, 1], tokens=32)
        with pytest.raises(ConfigError, match="distinct sources"):
            await d.pull("r", ["cp0", "cp0"], [0, 1], tokens=32)
        with pytest.raises(ConfigError, match="codec"):
            await d.pull("r", ["cp0"], [0, 1], codec="int8")
        assert d.statistics().bytes_received == 0 and p0.statistics().bytes_sent == 0
        assert_at_rest(p0, d)
