"""Pushes between unequal layouts (issue 18) over real NATS and UCX: another block size,
arrangement, dtype and TP share on each side, every element checked against the source;
what cannot be mapped refused before a byte moves, naming both layouts."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvstream import Agent, IncompatiblePeerError
from kvstream.layout import KVLayout
from kvstream.transfer.plan import TpInfo, pack
from tests.integration.agents import assert_at_rest, cfg, meet, settle

pytestmark = pytest.mark.anyio


def _cache(lay: KVLayout, n: int, *, fill: bool, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, lay.dtype)
    return [torch.randn(lay.tensor_shape(n), generator=gen).to(dtype) if fill
            else torch.zeros(lay.tensor_shape(n), dtype=dtype) for _ in range(lay.num_layers)]



def _same(p: Agent, d: Agent, src: list[int], dst: list[int], tokens: int,
          src_heads: range) -> None:
    assert p.memory is not None and d.memory is not None
    for layer in range(p.memory.layout.num_layers):
        want = pack(p.memory.layers[layer], p.memory.layout, src, tokens, src_heads)
        got = pack(d.memory.layers[layer], d.memory.layout, dst, tokens)
        assert torch.equal(got, want.to(got.dtype)), layer


CASES = {
    # name: (source layout kw, source TP, destination layout kw, destination TP, heads sent)
    "block 16 -> 32, NHD -> HND": (
        {"block_size": 16}, TpInfo(), {"block_size": 32, "arrangement": "flash_hnd"},
        TpInfo(), range(0, 4)),
    "block 48 -> 32, fp16 -> bf16, blocks first": (
        {"block_size": 48}, TpInfo(),
        {"block_size": 32, "dtype": "bfloat16", "arrangement": "blocks_first_nhd"}, TpInfo(),
        range(0, 4)),
    "TP 1 -> rank 1 of TP 2, CPU layout": (
        {"block_size": 16}, TpInfo(), {"num_kv_heads": 2, "block_size": 32,
                                       "arrangement": "cpu_hnbc"},
        TpInfo(rank=1, size=2), range(2, 4)),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_push_between_unequal_layouts_lands_every_element(nats_server, case):
    src_kw, src_tp, dst_kw, dst_tp, heads = CASES[case]
    base = {"num_layers": 3, "num_kv_heads": 4, "head_dim": 32, "dtype": "float16"}
    p_lay, d_lay = KVLayout(**{**base, **src_kw}), KVLayout(**{**base, **dst_kw})
    tokens = 70  # a partial last block on both sides
    src = list(range(p_lay.blocks_for_tokens(tokens)))[::-1]
    dst = [7, 2, 9, 4, 0, 5][:d_lay.blocks_for_tokens(tokens)]
    async with Agent(cfg("rp", nats_server, tp=src_tp), layout=p_lay,
                     kv_caches=_cache(p_lay, 12, fill=True)) as p, \
            Agent(cfg("rd", nats_server, tp=dst_tp), layout=d_lay,
                  kv_caches=_cache(d_lay, 12, fill=False)) as d:
        await meet(p, d)
        rx = d.expect("reserved", dst, src=p.instance_id)
        tx = await p.push("reserved", "rd", src, tokens=tokens)
        tx.all_ready()
        with anyio.fail_after(20):
            result = await rx.result()
            await tx.wait()
        assert result.ok, result
        _same(p, d, src, dst, tokens, heads)

        # Pushed before the destination reserved: staged, then claimed.
        for t in d.memory.layers:
            t.zero_()
        tx = await p.push("staged", "rd", src, tokens=tokens, mode="eager")
        tx.all_ready()
        with anyio.fail_after(20):
            while d.statistics().staged_transfers == 0:
                await anyio.sleep(0.02)
        rx = d.expect("staged", dst, src=p.instance_id)
        with anyio.fail_after(20):
            assert (await rx.result()).ok
        _same(p, d, src, dst, tokens, heads)
        await settle(p, d)
        assert_at_rest(p, d)


async def test_what_cannot_be_mapped_is_refused_before_any_byte(nats_server):
    base = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 32, "block_size": 16}
    async with Agent(cfg("xp", nats_server, tp=TpInfo(rank=0, size=2)),
                     layout=KVLayout(**{**base, "num_kv_heads": 2}),
                     kv_caches=_cache(KVLayout(**{**base, "num_kv_heads": 2}), 8, fill=True)) as p, \
            Agent(cfg("xd", nats_server), layout=KVLayout(**base),
                  kv_caches=_cache(KVLayout(**base), 8, fill=False)) as d, \
            Agent(cfg("xe", nats_server), layout=KVLayout(**{**base, "head_dim": 64}),
                  kv_caches=_cache(KVLayout(**{**base, "head_dim": 64}), 8, fill=False)) as e:
        await meet(p, d, e)
        with pytest.raises(IncompatiblePeerError, match="several sources"):
            await p.push("r", "xd", [0, 1])  # rank 0 of 2 holds half the heads xd needs
        with pytest.raises(IncompatiblePeerError, match="head_dim 32 against 64"):
            await p.push("r", "xe", [0, 1])
        assert d.statistics().bytes_received == e.statistics().bytes_received == 0
        assert_at_rest(p, d, e)


@pytest.mark.parametrize("mode", ["eager", "lazy"])
async def test_pull_between_unequal_layouts(nats_server, mode):
    """Decode (block 32, HND, rank 0 of TP 2) pulls from prefill (block 16, NHD, TP 1); it
    asks for all its 3 blocks hold (96 tokens) and gets the 80 the offer's 5 blocks hold."""
    base = {"num_layers": 3, "num_kv_heads": 4, "head_dim": 32}
    p_lay = KVLayout(**base, block_size=16)
    d_lay = KVLayout(**{**base, "num_kv_heads": 2}, block_size=32, arrangement="flash_hnd")
    src, dst = [3, 0, 8, 5, 1], [6, 2, 9]
    async with Agent(cfg("lp", nats_server), layout=p_lay,
                     kv_caches=_cache(p_lay, 12, fill=True)) as p, \
            Agent(cfg("ld", nats_server, tp=TpInfo(rank=0, size=2)), layout=d_lay,
                  kv_caches=_cache(d_lay, 12, fill=False)) as d:
        await meet(p, d)
        offer = p.offer("r", src)
        offer.all_ready()
        rx = await d.pull("r", "lp", dst, mode=mode, secret=offer.secret)
        if mode == "lazy":
            for layer in range(p_lay.num_layers):
                with anyio.fail_after(20):
                    await rx.wait_layer(layer)
        with anyio.fail_after(20):
            result = await rx.result()
        assert result.ok, result
        with anyio.fail_after(20):
            assert (await offer.result()).ok
        # 80 tokens: the slots past them in the last block stay as they were.
        _same(p, d, src, dst, 80, range(0, 2))
        assert not pack(d.memory.layers[0], d_lay, dst, 96)[:, 80:].any()
        await settle(p, d)
        assert_at_rest(p, d)
