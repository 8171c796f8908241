"""A transformers Llama's KV moved between unequal TP splits (issue 18), over real NATS and
UCX: prefill split over two agents each holding one of the model's two KV heads (like
TP=2) into one decode agent (TP=1), and one prefill agent into two decode agents holding
a head each. The decode side rebuilds the model's cache from what landed; greedy tokens
must equal a colocated run's. Block sizes and arrangements differ on the two sides too
(``test_custom_engine.py::test_the_comparison_can_fail`` shows a wrong cache gives other
tokens)."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import anyio
import pytest
import torch

from kvstream import Agent, KVLayout
from kvstream.transfer.plan import TpInfo, pack, unpack
from tests.integration.agents import assert_at_rest, cfg, meet, settle

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import custom_engine as ce

pytestmark = pytest.mark.anyio

NUM_BLOCKS = 16


def _layout(model, heads: int, block: int, arrangement: str) -> KVLayout:
    c = model.config
    return KVLayout(num_layers=c.num_hidden_layers, num_kv_heads=heads,
                    head_dim=c.hidden_size // c.num_attention_heads, block_size=block,
                    dtype="float32", arrangement=arrangement)


def _zeros(lay: KVLayout) -> list[torch.Tensor]:
    return [torch.zeros(lay.tensor_shape(NUM_BLOCKS)) for _ in range(lay.num_layers)]


@torch.no_grad()
def _prefill(model, prompt: list[int]):
    """The prompt's DynamicCache and the first generated token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    return cache, int(out.logits[0, -1].argmax())


def _store(agent: Agent, cache, blocks: list[int], heads: range) -> None:
    """Write heads ``heads`` of every layer's (1, heads, seq, dim) K/V into the agent's
    paged cache, in its own layout."""
    mem = agent.memory
    for i, layer in enumerate(cache.layers):
        wire = torch.stack([layer.keys[0, heads.start:heads.stop].transpose(0, 1),
                            layer.values[0, heads.start:heads.stop].transpose(0, 1)])
        unpack(wire.contiguous(), mem.layers[i], mem.layout, blocks)


def _load(agents: list[Agent], blocks: list[list[int]], seq: int, model):
    """The model's DynamicCache from the decode ranks' paged caches, heads in rank order."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i in range(model.config.num_hidden_layers):
        wires = [pack(a.memory.layers[i], a.memory.layout, b, seq) for a, b in
                 zip(agents, blocks, strict=True)]
        kv = torch.cat(wires, dim=2)  # [2, seq, heads, dim]
        cache.update(kv[0].transpose(0, 1).unsqueeze(0).contiguous(),
                     kv[1].transpose(0, 1).unsqueeze(0).contiguous(), i)
    return cache



async def test_prefill_tp2_into_decode_tp1(nats_server):
    model, prompt = ce.tiny_llama(), ce.prompt_ids()
    seq = len(prompt)  # 40: a partial last block on both sides
    half = _layout(model, 1, 16, "flash_hnd")
    whole = _layout(model, 2, 32, "flash_nhd")
    src, dst = [7, 2, 11], [9, 4]
    async with Agent(cfg("tp-p0", nats_server, tp=TpInfo(rank=0, size=2)), layout=half,
                     kv_caches=_zeros(half)) as p0, \
            Agent(cfg("tp-p1", nats_server, tp=TpInfo(rank=1, size=2)), layout=half,
                  kv_caches=_zeros(half)) as p1, \
            Agent(cfg("tp-d", nats_server), layout=whole, kv_caches=_zeros(whole)) as d:
        await meet(p0, p1, d)
        cache, first = _prefill(model, prompt)
        secret = secrets.token_urlsafe(16)
        offers = []
        for rank, p in enumerate((p0, p1)):
            _store(p, cache, src, range(rank, rank + 1))
            offers.append(p.offer("req", src, secret=secret))
            offers[-1].all_ready()
        rx = await d.pull("req", ["tp-p0", "tp-p1"], dst, secret=secret, tokens=seq)
        with anyio.fail_after(30):
            await rx.wait()
        tokens = ce.decode_steps(model, _load([d], [dst], seq, model), first, ce.MAX_NEW)
        await settle(p0, p1, d)
        assert_at_rest(p0, p1, d)
    assert len(set(tokens)) > 4, "the test model must not repeat one token"
    assert tokens == ce.colocated(prompt)


async def test_prefill_tp1_into_decode_tp2(nats_server):
    model, prompt = ce.tiny_llama(), ce.prompt_ids()
    seq = len(prompt)
    whole = _layout(model, 2, 16, "flash_nhd")
    half = _layout(model, 1, 32, "cpu_hnbc")
    src, dst = [[3, 8, 1], [[5, 0], [2, 6]]]
    async with Agent(cfg("tq-p", nats_server), layout=whole, kv_caches=_zeros(whole)) as p, \
            Agent(cfg("tq-d0", nats_server, tp=TpInfo(rank=0, size=2)), layout=half,
                  kv_caches=_zeros(half)) as d0, \
            Agent(cfg("tq-d1", nats_server, tp=TpInfo(rank=1, size=2)), layout=half,
                  kv_caches=_zeros(half)) as d1:
        await meet(p, d0, d1)
        cache, first = _prefill(model, prompt)
        _store(p, cache, src, range(2))
        # One offer, two readers: each decode rank pulls its head of it.
        offer = p.offer("req", src)
        offer.all_ready()
        handles = [await d.pull("req", "tq-p", dst[rank], secret=offer.secret, tokens=seq,
                                readers=2) for rank, d in enumerate((d0, d1))]
        with anyio.fail_after(30):
            for h in handles:
                await h.wait()
            await offer.wait()
        tokens = ce.decode_steps(model, _load([d0, d1], dst, seq, model), first, ce.MAX_NEW)
        await settle(p, d0, d1)
        assert_at_rest(p, d0, d1)
    assert len(set(tokens)) > 4
    assert tokens == ce.colocated(prompt)
