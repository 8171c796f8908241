"""vLLM 0.32's GPU KV tensors, built on the CPU by vLLM's own allocation code
(``allocate_kv_cache``, the per-layer views of one shared int8 buffer, in the KV cache
layout the connector asks for), read by kvstream as the attention backend says, and moved
between them and the CPU backend's layout through real agents (NATS, UCX): block 16 <-> 32
and TP 1 <-> 2, both ways, FlashAttention, FlashInfer, MLA, fp8 with its scales.

Every element is checked against K and V as vLLM's kernels read them, with readers written
here from vLLM's attention code (FlashAttention splits ``kv_cache.transpose(1, 2)`` along
the last dimension; the CPU backend keeps K transposed per block and head), not with
kvstream's layout code: two sides misread alike would fail here."""

from __future__ import annotations

import anyio
import pytest
import torch

pytest.importorskip("vllm.v1.worker.utils",
                    reason="needs a real vLLM: bash .ci/vllm-env && .venv-vllm/bin/python -m "
                           "pytest tests/with_vllm (README command 3)")

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvstream import AdapterError, Agent, IncompatiblePeerError
from kvstream.adapters.vllm.caches import Attention, layout_of_vllm_caches
from kvstream.transfer.plan import TpInfo
from tests.integration.agents import assert_at_rest, cfg, meet, settle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

LAYERS, HEADS, DIM, BLOCKS = 3, 4, 32, 12
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
TOKENS = 70  # a partial last block at block size 16 and 32
FLASH = Attention(backend="FLASH_ATTN", kv_layout="LBHNC")
CPU = Attention(backend="CPU_ATTN", kv_layout="LBHNC")


def vllm_caches(block: int, heads: int = HEADS, *, dtype: torch.dtype = torch.float16,
                layout: KVCacheLayout = KVCacheLayout.LBHNC, mla: bool = False,
                seed: int | None = None) -> dict[str, torch.Tensor]:
    """The dict vLLM's worker hands ``register_kv_caches``, allocated by vLLM's own code
    on the CPU (random bytes when ``seed`` is given)."""
    spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=DIM, dtype=dtype,
                            cache_dtype_str="auto") if mla else \
        FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=DIM, dtype=dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    config = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)],
        kv_cache_tensors=[KVCacheTensor(size=LAYERS * BLOCKS * spec.page_size_bytes,
                                        layers=NAMES, layer_stride=layer_stride,
                                        block_stride=block_stride)])
    caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    if seed is not None:  # the one int8 buffer under every layer's view
        gen = torch.Generator().manual_seed(seed)
        store = caches[NAMES[0]].untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(store)
        raw.copy_(torch.randint(0, 255, raw.shape, generator=gen, dtype=torch.uint8)
                  & 0x3F)  # finite values in every float dtype here
    return caches


# -- K and V as vLLM's kernels read a layer: [num_blocks, block_size, heads, dim] ------------
def read_flash(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention / FlashInfer (flash_attn.py: ``kv_cache.transpose(1, 2).split``)."""
    k, v = t.transpose(1, 2).split(DIM, dim=-1)
    return k, v


def read_cpu(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU backend: per block and head, K as [dim, block_size], then V [block_size, dim]."""
    nb, h, bs, _ = t.shape
    flat = t.reshape(nb, h, 2 * bs * DIM)
    k = flat[..., :bs * DIM].reshape(nb, h, DIM, bs).permute(0, 3, 1, 2)
    v = flat[..., bs * DIM:].reshape(nb, h, bs, DIM).permute(0, 2, 1, 3)
    return k, v


def read_mla(t: torch.Tensor) -> tuple[torch.Tensor]:
    """MLA (mla_attention.py binds ``kv_cache.squeeze(1)``): one latent per token."""
    return (t.squeeze(1).unsqueeze(2),)


def tokens(planes: tuple[torch.Tensor, ...], blocks: list[int], n: int,
           heads: range | None = None) -> torch.Tensor:
    """The request's first ``n`` tokens, [planes, n, heads, dim]."""
    out = []
    for p in planes:
        seq = torch.cat([p[b] for b in blocks])[:n]
        out.append(seq if heads is None else seq[:, heads.start:heads.stop])
    return torch.stack(out).float()


READERS = {"flash": read_flash, "cpu": read_cpu, "mla": read_mla}


async def _pull(p: Agent, d: Agent, src: list[int], dst: list[int], *, tokens_: int,
                srcs: list[Agent] | None = None, rid: str = "r") -> None:
    sources = srcs or [p]
    offers = [s.offer(rid, src, secret="s" * 22) for s in sources]
    for o in offers:
        o.all_ready()
    names = [s.instance_id for s in sources]
    rx = await d.pull(rid, names[0] if len(names) == 1 else names, dst, secret="s" * 22,
                      tokens=tokens_)
    with anyio.fail_after(30):
        result = await rx.result()
    assert result.ok, result


def _register(name: str, nats_server, caches: dict[str, torch.Tensor], attention: Attention,
              tp: TpInfo | None = None, scales: list[float] | None = None) -> Agent:
    layout, layers = layout_of_vllm_caches(caches, attention=attention)
    agent = Agent(cfg(name, nats_server, tp=tp or TpInfo()), layout=layout)
    agent.register_kv(layout, layers, cache_scales=scales)
    return agent


def test_the_arrangement_comes_from_the_backend_not_the_shape():
    """One CPU-built FlashAttention tensor: read as FlashAttention's when vLLM says
    FLASH_ATTN (the GPU reading), as the CPU backend's only when it says CPU_ATTN."""
    caches = vllm_caches(16)
    assert layout_of_vllm_caches(caches, attention=FLASH)[0].arrangement == "hnd_kv"
    assert layout_of_vllm_caches(caches, attention=Attention(
        backend="FLASHINFER", kv_layout="LBHNC"))[0].arrangement == "hnd_kv"
    assert layout_of_vllm_caches(caches, attention=CPU)[0].arrangement == "cpu_hnbc"
    lay, layers = layout_of_vllm_caches(
        vllm_caches(16, layout=KVCacheLayout.LBNHC),
        attention=Attention(backend="FLASH_ATTN", kv_layout="LBNHC"))
    assert lay.arrangement == "nhd_kv" and all(t.is_contiguous() for t in layers)
    mla, _ = layout_of_vllm_caches(vllm_caches(16, mla=True, dtype=torch.bfloat16),
                                   attention=Attention(backend="FLASHMLA", mla=True))
    assert (mla.arrangement, mla.num_kv_heads, mla.head_dim) == ("mla", 1, DIM)
    fp8, layers = layout_of_vllm_caches(vllm_caches(16, dtype=torch.uint8),
                                        attention=Attention(backend="FLASH_ATTN",
                                                            kv_layout="LBHNC",
                                                            cache_dtype="fp8"))
    assert fp8.dtype == "float8_e4m3fn" and layers[0].dtype == torch.float8_e4m3fn
    with pytest.raises(AdapterError, match="BLHNC"):
        layout_of_vllm_caches(vllm_caches(16, layout=KVCacheLayout.BLHNC),
                              attention=Attention(backend="FLASH_ATTN", kv_layout="BLHNC"))
    with pytest.raises(AdapterError, match="attention backend"):
        layout_of_vllm_caches(caches)


CASES = {
    # name: (source (reader, attention, block), destination (reader, attention, block))
    "CPU block 32 -> FlashAttention block 16": (("cpu", CPU, 32), ("flash", FLASH, 16)),
    "FlashAttention block 16 -> CPU block 32": (("flash", FLASH, 16), ("cpu", CPU, 32)),
    "FlashInfer block 32 -> FlashAttention block 16": (
        ("flash", Attention(backend="FLASHINFER", kv_layout="LBHNC"), 32), ("flash", FLASH, 16)),
    "FlashAttention LBNHC block 16 -> CPU block 16": (
        ("flash", Attention(backend="FLASH_ATTN", kv_layout="LBNHC"), 16), ("cpu", CPU, 16)),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_pull_between_vllm_layouts_lands_every_element(nats_server, case):
    (s_read, s_att, s_block), (d_read, d_att, d_block) = CASES[case]
    lbnhc = s_att.kv_layout == "LBNHC"
    src_caches = vllm_caches(s_block, seed=1,
                             layout=KVCacheLayout.LBNHC if lbnhc else KVCacheLayout.LBHNC)
    dst_caches = vllm_caches(d_block)
    src = list(range(-(-TOKENS // s_block)))[::-1]
    dst = [7, 2, 9, 4, 0, 5][:-(-TOKENS // d_block)]
    async with _register("gp", nats_server, src_caches, s_att) as p, \
            _register("gd", nats_server, dst_caches, d_att) as d:
        await meet(p, d)
        await _pull(p, d, src, dst, tokens_=TOKENS)
        await settle(p, d)
        assert_at_rest(p, d)
    for name in NAMES:
        want = tokens(READERS[s_read](src_caches[name]), src, TOKENS)
        got = tokens(READERS[d_read](dst_caches[name]), dst, TOKENS)
        assert torch.equal(got, want), name


async def test_tp_1_to_2_and_2_to_1_between_vllm_layouts(nats_server):
    """A FlashAttention engine at TP 1 (4 heads) read by two CPU ranks at TP 2 (2 heads
    each, one shared offer), and those two ranks gathered back by a FlashAttention rank at
    TP 1, each element where vLLM reads it."""
    full = vllm_caches(16, seed=2)
    halves = [vllm_caches(32, heads=2) for _ in range(2)]
    back = vllm_caches(16)
    src, mid, dst = [5, 1, 3, 0, 8], [4, 9, 2], [0, 6, 3, 11, 7]
    async with _register("tp1", nats_server, full, FLASH) as p, \
            _register("tp2-0", nats_server, halves[0], CPU, TpInfo(rank=0, size=2,
                                                                    total_kv_heads=HEADS)) as d0, \
            _register("tp2-1", nats_server, halves[1], CPU, TpInfo(rank=1, size=2,
                                                                    total_kv_heads=HEADS)) as d1, \
            _register("tp1b", nats_server, back, FLASH) as b:
        await meet(p, d0, d1, b)
        offer = p.offer("r", src, secret="s" * 22, readers=2)
        offer.all_ready()
        for d in (d0, d1):
            rx = await d.pull("r", "tp1", mid, secret="s" * 22, tokens=TOKENS, readers=2)
            with anyio.fail_after(30):
                assert (await rx.result()).ok
        await _pull(d0, b, mid, dst, tokens_=TOKENS, srcs=[d0, d1], rid="back")
        await settle(p, d0, d1, b)
        assert_at_rest(p, d0, d1, b)
    for name in NAMES:
        want = tokens(read_flash(full[name]), src, TOKENS)
        for rank, half in enumerate(halves):
            got = tokens(read_cpu(half[name]), mid, TOKENS)
            assert torch.equal(got, want[:, :, 2 * rank:2 * rank + 2]), (name, rank)
        assert torch.equal(tokens(read_flash(back[name]), dst, TOKENS), want), name


async def test_mla_between_block_sizes(nats_server):
    src_caches = vllm_caches(32, mla=True, dtype=torch.bfloat16, seed=3)
    dst_caches = vllm_caches(16, mla=True, dtype=torch.bfloat16)
    mla = Attention(backend="FLASHMLA", mla=True)
    src, dst = [2, 0, 1], [3, 8, 1, 0, 6]
    async with _register("mp", nats_server, src_caches, mla) as p, \
            _register("md", nats_server, dst_caches, mla) as d:
        await meet(p, d)
        await _pull(p, d, src, dst, tokens_=TOKENS)
    for name in NAMES:
        assert torch.equal(tokens(read_mla(dst_caches[name]), dst, TOKENS),
                           tokens(read_mla(src_caches[name]), src, TOKENS)), name


async def test_fp8_kv_moves_with_its_scales_and_other_scales_are_refused(nats_server):
    """vLLM allocates an fp8 cache as uint8; kvstream reads it as float8_e4m3fn, moves its
    bytes verbatim with the per-layer (k, v) scales, and a destination whose scales differ
    refuses before a byte lands."""
    fp8 = Attention(backend="FLASH_ATTN", kv_layout="LBHNC", cache_dtype="fp8")
    scales = [0.5, 0.25] * LAYERS
    src_caches = vllm_caches(16, dtype=torch.uint8, seed=4)
    same, other = vllm_caches(16, dtype=torch.uint8), vllm_caches(16, dtype=torch.uint8)
    src, dst = [4, 1, 7, 0, 2], [9, 3, 5, 6, 8]
    async with _register("fp", nats_server, src_caches, fp8, scales=scales) as p, \
            _register("fd", nats_server, same, fp8, scales=scales) as d, \
            _register("fo", nats_server, other, fp8, scales=[1.0, 1.0] * LAYERS) as o:
        await meet(p, d, o)
        await _pull(p, d, src, dst, tokens_=TOKENS)
        offer = p.offer("r2", src, secret="t" * 22)
        offer.all_ready()
        with pytest.raises(IncompatiblePeerError, match="scales"):
            rx = await o.pull("r2", "fp", dst, secret="t" * 22)
            await rx.result()
        assert o.statistics().bytes_received == 0
    for name in NAMES:
        got = tokens(read_flash(same[name]), dst, TOKENS)
        assert torch.equal(got, tokens(read_flash(src_caches[name]), src, TOKENS)), name
        assert not other[name].any()


def test_the_connector_registers_vllms_gpu_tensors_with_their_fp8_scales(nats_server,
                                                                          tiny_model):
    """``KVStreamConnector.register_kv_caches`` in a worker whose attention layers report
    FlashAttention in layout LBHNC, with an fp8 cache: the agent registers vLLM's tensors
    (allocated by vLLM's code) as ``hnd_kv`` in float8_e4m3fn, with every layer's scales."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    from kvstream.adapters.vllm import KVStreamConnector

    try:
        from . import engines as E
    except ImportError:
        import engines as E  # type: ignore[no-redef]

    class Layer(AttentionLayerBase):  # what vLLM's forward context holds, reduced
        def __init__(self, k: float, v: float) -> None:
            self._k_scale_float, self._v_scale_float = k, v

        def get_attn_backend(self):  # type: ignore[override]
            return FlashAttentionBackend

        def get_kv_cache_spec(self, vllm_config):  # type: ignore[override]
            return None

    config = EngineArgs(model=str(tiny_model), dtype="float16", enforce_eager=True,
                        max_model_len=256, block_size=32, kv_cache_dtype="fp8",
                        kv_transfer_config=E.kv_config("kv_producer", nats_server.url,
                                                       instance_id="conn-gpu")
                        ).create_engine_config()
    config.cache_config.kv_cache_layout = "LBHNC"  # as the engine core resolves it
    context = config.compilation_config.static_forward_context
    for i, name in enumerate(NAMES):
        context[name] = Layer(0.5 + i, 0.25 + i)
    caches = vllm_caches(32, heads=2, dtype=torch.uint8)
    connector = KVStreamConnector(config, KVConnectorRole.WORKER, None)
    try:
        connector.register_kv_caches(caches)
        worker = connector._worker
        assert worker is not None and worker._runtime is not None
        agent = worker._runtime.agent
        assert agent is not None and agent.memory is not None
        lay = agent.memory.layout
        assert (lay.arrangement, lay.dtype, lay.num_kv_heads, lay.block_size) == (
            "hnd_kv", "float8_e4m3fn", 2, 32)
        assert agent.memory.cache_scales == [0.5, 0.25, 1.5, 1.25, 2.5, 2.25]
        assert agent.memory.layers[0].data_ptr() == caches[NAMES[0]].data_ptr()  # no copy
    finally:
        connector.shutdown()
        for name in NAMES:
            context.pop(name, None)
