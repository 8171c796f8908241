"""K and V in separate per-layer buffers with a page size (SGLang's MHA token-to-KV pool:
``split_nhd``, issue 18) over real NATS and UCX: registered as K of every layer then V,
moved verbatim and through the int8 codec between two such pools, and reshaped to and from
vLLM's layouts with another block size, every element checked."""

from __future__ import annotations

import secrets

import anyio
import pytest
import torch

from kvstream import Agent, KVLayout, LayoutError
from kvstream.memory import RegisteredKV
from kvstream.transfer.plan import pack
from tests.integration.agents import assert_at_rest, cfg, meet, settle

pytestmark = pytest.mark.anyio

PAGES = 12
BASE = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 32, "dtype": "float16"}


def _pool(lay: KVLayout, *, seed: int | None) -> list[torch.Tensor]:
    """A split pool's tensors: SGLang's k_buffer then v_buffer, [pages * page, heads, dim]."""
    n = lay.num_layers * lay.tensors_per_layer
    shape = lay.tensor_shape(PAGES)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.float16) for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.float16) for _ in range(n)]


def _wire(agent: Agent, layer: int, blocks: list[int], tokens: int) -> torch.Tensor:
    mem = agent.memory
    assert mem is not None
    return pack(mem.layer_tensors(layer), mem.layout, blocks, tokens)



def test_a_split_pool_registers_k_then_v_whole_pages_only():
    lay = KVLayout(**BASE, block_size=16, arrangement="split_nhd")
    k_then_v = _pool(lay, seed=0)
    mem = RegisteredKV(lay, k_then_v)
    assert mem.num_blocks == PAGES and mem.layer_tensors(1) == (k_then_v[1], k_then_v[4])
    assert torch.equal(mem.read_block(2, 5)[:lay.chunk_bytes],
                       k_then_v[2][5 * 16:6 * 16].contiguous().view(torch.uint8).flatten())
    with pytest.raises(LayoutError, match="K of every layer, then V"):
        RegisteredKV(lay, k_then_v[:3])
    with pytest.raises(LayoutError, match="does not match"):
        RegisteredKV(lay, [t[:-1] for t in k_then_v])  # not whole pages


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_between_two_split_pools(nats_server, codec):
    """Verbatim, every byte equal; int8, exactly what the same KV decodes to between two
    FlashAttention NHD caches (the chunks and scale groups are the same: [page, h, d])."""
    lay = KVLayout(**BASE, block_size=16, arrangement="split_nhd")
    src, dst = [4, 0, 9], [7, 2, 11]
    async with Agent(cfg("sp", nats_server), layout=lay, kv_caches=_pool(lay, seed=1)) as p, \
            Agent(cfg("sd", nats_server), layout=lay, kv_caches=_pool(lay, seed=None)) as d:
        await meet(p, d)
        rx = d.expect("r", dst, src=p.instance_id)
        tx = await p.push("r", "sd", src, codec=codec)
        tx.all_ready()
        with anyio.fail_after(20):
            assert (await rx.wait()).codec == codec
        nhd = KVLayout(**BASE, block_size=16)
        ref_src = [torch.stack([k.view(PAGES, 16, 2, 32), v.view(PAGES, 16, 2, 32)])
                   for k, v in (p.memory.layer_tensors(i) for i in range(3))]
        async with Agent(cfg("np", nats_server), layout=nhd, kv_caches=ref_src) as np_, \
                Agent(cfg("nd", nats_server), layout=nhd,
                      kv_caches=[torch.zeros_like(t) for t in ref_src]) as nd:
            await meet(p, d, np_, nd)
            rx2 = nd.expect("r", dst, src=np_.instance_id)
            tx2 = await np_.push("r", "nd", src, codec=codec)
            tx2.all_ready()
            with anyio.fail_after(20):
                await rx2.wait()
            for layer in range(3):
                got = _wire(d, layer, dst, 48)
                assert torch.equal(got, pack(nd.memory.layers[layer], nhd, dst, 48)), layer
                if codec == "none":
                    assert torch.equal(got, _wire(p, layer, src, 48)), layer
                else:
                    assert not torch.equal(got, _wire(p, layer, src, 48))
            await settle(np_, nd)
            assert_at_rest(np_, nd)
        await settle(p, d)
        assert_at_rest(p, d)


@pytest.mark.parametrize("direction", ["sglang->vllm", "vllm->sglang"])
async def test_split_pool_to_and_from_vllm_layouts(nats_server, direction):
    """Page 16 split pool <-> block 32 HND (and the CPU layout), 40 tokens (a partial last
    page and block), pulled; the slots past the last token stay untouched."""
    split = KVLayout(**BASE, block_size=16, arrangement="split_nhd")
    other = KVLayout(**BASE, block_size=32,
                     arrangement="flash_hnd" if direction == "sglang->vllm" else "cpu_hnbc")
    p_lay, d_lay = (split, other) if direction == "sglang->vllm" else (other, split)

    def kv(lay: KVLayout, seed: int | None) -> list[torch.Tensor]:
        if lay.split:
            return _pool(lay, seed=seed)
        gen = torch.Generator().manual_seed(seed or 0)
        return [torch.randn(lay.tensor_shape(PAGES), generator=gen).half() if seed is not None
                else torch.zeros(lay.tensor_shape(PAGES), dtype=torch.float16) for _ in range(3)]

    tokens = 40
    src = [5, 1, 8][:p_lay.blocks_for_tokens(tokens)]
    dst = [3, 10, 6][:d_lay.blocks_for_tokens(tokens)]
    async with Agent(cfg("xp", nats_server), layout=p_lay, kv_caches=kv(p_lay, 2)) as p, \
            Agent(cfg("xd", nats_server), layout=d_lay, kv_caches=kv(d_lay, None)) as d:
        await meet(p, d)
        secret = secrets.token_urlsafe(16)
        offer = p.offer("r", src, secret=secret)
        offer.all_ready()
        rx = await d.pull("r", "xp", dst, secret=secret, tokens=tokens)
        with anyio.fail_after(20):
            await rx.wait()
        for layer in range(3):
            assert torch.equal(_wire(d, layer, dst, tokens), _wire(p, layer, src, tokens))
            full = len(dst) * d_lay.block_size
            assert not _wire(d, layer, dst, full)[:, tokens:].any()
        await settle(p, d)
        assert_at_rest(p, d)


def test_tensors_that_share_memory_are_refused():
    lay = KVLayout(**BASE, block_size=16, arrangement="split_nhd")
    k_then_v = _pool(lay, seed=0)
    with pytest.raises(LayoutError, match="share memory"):
        RegisteredKV(lay, [*k_then_v[:3], *k_then_v[:3]])  # K registered as V too
    nhd = KVLayout(**BASE, block_size=16)
    one = torch.zeros(nhd.tensor_shape(4), dtype=torch.float16)
    with pytest.raises(LayoutError, match="tensors 0 and 1 share memory"):
        RegisteredKV(nhd, [one, one, torch.zeros_like(one)])
