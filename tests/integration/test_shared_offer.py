"""One offer pulled by several destinations (decode TP above prefill TP, issue 18) over
real NATS and UCX: each decode rank takes its own heads of one prefill rank's offer; the
offer completes when every reader has, fails whole with the first reader that fails, and
releases its blocks only after its last reader stopped."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvstream import (
    Agent,
    ConfigError,
    IncompatiblePeerError,
    TransferError,
)
from kvstream.layout import KVLayout
from kvstream.transfer.plan import TpInfo, pack
from tests.integration.agents import assert_at_rest, cfg, meet, settle

pytestmark = pytest.mark.anyio

BASE = {"num_layers": 3, "num_kv_heads": 4, "head_dim": 16, "dtype": "float16"}
WHOLE = KVLayout(**BASE, block_size=16)
HALF = KVLayout(**{**BASE, "num_kv_heads": 2}, block_size=32, arrangement="flash_hnd")
SRC, DST = [4, 0, 7, 2], [[5, 1], [3, 6]]  # 64 tokens: 4 blocks of 16, 2 of 32


def _cache(lay: KVLayout, n: int, *, fill: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(lay.tensor_shape(n), generator=gen).half() if fill
            else torch.zeros(lay.tensor_shape(n), dtype=torch.float16)
            for _ in range(lay.num_layers)]


def _prefill(nats_server, **kw) -> Agent:
    return Agent(cfg("sp", nats_server, **kw), layout=WHOLE,
                 kv_caches=_cache(WHOLE, 10, fill=True))


def _decode(nats_server, rank: int, lay: KVLayout = HALF, **kw) -> Agent:
    tp = TpInfo(rank=rank, size=2) if lay is HALF else TpInfo()
    return Agent(cfg(f"sd{rank}", nats_server, tp=tp, **kw), layout=lay,
                 kv_caches=_cache(lay, 10, fill=False))


def _landed(p: Agent, d: Agent, dst: list[int], heads: range) -> bool:
    assert p.memory is not None and d.memory is not None
    return all(torch.equal(pack(d.memory.layers[i], d.memory.layout, dst, 64),
                           pack(p.memory.layers[i], WHOLE, SRC, 64, heads))
               for i in range(WHOLE.num_layers))


async def test_each_reader_takes_its_heads_and_the_offer_completes_with_the_last(nats_server):
    async with _prefill(nats_server) as p, _decode(nats_server, 0) as d0, \
            _decode(nats_server, 1) as d1:
        await meet(p, d0, d1)
        offer = p.offer("r", SRC)  # readers: as its first pull says
        offer.all_ready()
        first = await d0.pull("r", "sp", DST[0], secret=offer.secret, readers=2)
        with anyio.fail_after(20):
            assert (await first.result()).ok
        await anyio.sleep(0.2)
        assert not offer.done, "the offer ended before its second reader pulled"
        assert p.statistics().held_active == 1  # the offer still holds its blocks
        second = await d1.pull("r", "sp", DST[1], secret=offer.secret, readers=2)
        with anyio.fail_after(20):
            assert (await second.result()).ok
            result = await offer.result()
        assert result.ok, result
        assert _landed(p, d0, DST[0], range(0, 2)) and _landed(p, d1, DST[1], range(2, 4))
        assert p.statistics().completed == 2  # one per reader, not the offer again
        await settle(p, d0, d1)
        assert_at_rest(p, d0, d1)


async def test_equal_layouts_share_an_offer_verbatim(nats_server):
    """MLA's latent, or any KV replicated over decode ranks: readers of equal layouts."""
    async with _prefill(nats_server) as p, _decode(nats_server, 0, WHOLE) as d0, \
            _decode(nats_server, 1, WHOLE) as d1:
        await meet(p, d0, d1)
        offer = p.offer("r", SRC, readers=2)
        offer.all_ready()
        pulls = [await d.pull("r", "sp", [6, 1, 3, 8], secret=offer.secret, readers=2)
                 for d in (d0, d1)]
        with anyio.fail_after(20):
            for h in pulls:
                assert (await h.result()).ok
            assert (await offer.result()).ok
        for d in (d0, d1):
            assert _landed(p, d, [6, 1, 3, 8], range(0, 4))
        await settle(p, d0, d1)
        assert_at_rest(p, d0, d1)


async def test_pulls_that_disagree_or_repeat_are_refused(nats_server):
    async with _prefill(nats_server) as p, _decode(nats_server, 0) as d0, \
            _decode(nats_server, 1) as d1:
        await meet(p, d0, d1)
        with pytest.raises(ConfigError, match="readers"):
            p.offer("bad", SRC, readers=0)
        with pytest.raises(ConfigError, match="readers"):
            await d0.pull("r", "sp", DST[0], readers=5000)
        offer = p.offer("r", SRC, readers=2)
        offer.all_ready()
        # Refused pulls lose nothing: the offer waits for its two readers.
        with pytest.raises(IncompatiblePeerError, match="2 readers; this pull says 1"):
            await d0.pull("r", "sp", DST[0], secret=offer.secret)
        h = await d0.pull("r", "sp", DST[0], secret=offer.secret, readers=2)
        with anyio.fail_after(20):
            assert (await h.result()).ok
        with pytest.raises(TransferError, match="already pulled"):
            await d0.pull("r", "sp", DST[0], secret=offer.secret, readers=2)
        assert not offer.done
        h = await d1.pull("r", "sp", DST[1], secret=offer.secret, readers=2)
        with anyio.fail_after(20):
            assert (await h.result()).ok
            assert (await offer.result()).ok
        assert _landed(p, d0, DST[0], range(0, 2)) and _landed(p, d1, DST[1], range(2, 4))
        await settle(p, d0, d1)
        assert_at_rest(p, d0, d1)


async def test_a_failed_reader_fails_the_offer_and_stops_the_others(nats_server):
    async with _prefill(nats_server) as p, _decode(nats_server, 0) as d0, \
            _decode(nats_server, 1) as d1:
        await meet(p, d0, d1)
        offer = p.offer("r", SRC, readers=2, mode="pipelined")
        offer.layer_ready(0)  # the rest never becomes ready: both readers stream, waiting
        pulls = [await d.pull("r", "sp", DST[i], secret=offer.secret, readers=2)
                 for i, d in enumerate((d0, d1))]
        with anyio.fail_after(20):
            while p.statistics().transfers_active < 2:  # both readers stream
                await anyio.sleep(0.02)
            await pulls[0].abort("decode rank 0 gave up")
            other = await pulls[1].result()
            result = await offer.result()
        assert not other.ok, other
        assert not result.ok and "sd0" in result.reason, result
        with pytest.raises(TransferError):
            await offer.wait()
        await settle(p, d0, d1)
        assert_at_rest(p, d0, d1)


async def test_the_engine_aborting_a_shared_offer_waits_for_its_readers(nats_server):
    async with _prefill(nats_server) as p, _decode(nats_server, 0) as d0:
        await meet(p, d0)
        offer = p.offer("r", SRC, readers=2, mode="pipelined")
        rx = await d0.pull("r", "sp", DST[0], secret=offer.secret, readers=2)
        with anyio.fail_after(20):
            while p.statistics().transfers_active < 1:
                await anyio.sleep(0.02)
            result = await offer.abort("the prefill engine dropped the request")
            stats = p.statistics()  # the reader stopped first
            assert (stats.transfers_active, stats.held_active) == (0, 0), stats
            assert not (await rx.result()).ok
        assert result.status == "aborted", result
        await settle(p, d0)
        assert_at_rest(p, d0)


async def test_a_reader_that_never_comes_lets_the_lease_expire(nats_server):
    async with _prefill(nats_server, lease_s=1.0) as p, _decode(nats_server, 0) as d0:
        await meet(p, d0)
        offer = p.offer("r", SRC)
        offer.all_ready()
        rx = await d0.pull("r", "sp", DST[0], secret=offer.secret, readers=2)
        with anyio.fail_after(20):
            assert (await rx.result()).ok
            result = await offer.result()
        assert result.status == "expired", result
        assert _landed(p, d0, DST[0], range(0, 2))
        await settle(p, d0)
        assert_at_rest(p, d0)
