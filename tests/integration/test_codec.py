"""8-bit codecs on the wire between two agents: negotiated, half the bytes, within the bound,
no leaks."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvstream import Agent, ConfigError, IncompatiblePeerError, KVLayout, TransferError
from kvstream.quant import reference
from kvstream.quant.scheme import scale_groups, wire_layer_bytes
from tests.integration.agents import assert_at_rest, cfg, settle

pytestmark = pytest.mark.anyio

NBLOCKS = 24


def layout(dtype: str = "float16", arrangement: str = "flash_nhd") -> KVLayout:
    return KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=dtype,
                    arrangement=arrangement)


def kv(lay: KVLayout, *, fill: bool, seed: int = 0) -> list[torch.Tensor]:
    """Normal data with outlier channels (like real K caches)."""
    gen = torch.Generator().manual_seed(seed)
    shape = lay.tensor_shape(NBLOCKS)
    out = []
    for _ in range(lay.num_layers):
        if not fill:
            out.append(torch.zeros(shape).to(getattr(torch, lay.dtype)))
            continue
        x = torch.randn(shape, generator=gen)
        x[..., :3] *= 40.0
        out.append(x.to(getattr(torch, lay.dtype)))
    return out


def assert_close(src: Agent, dst: Agent, sb: list[int], db: list[int],
                 codec: str = "fp8_e4m3") -> None:
    lay = src.memory.layout
    groups = scale_groups(lay)
    for layer in range(lay.num_layers):
        x = src.memory.layers[layer].view(lay.chunks_per_block, -1, *groups)[:, sb]
        y = dst.memory.layers[layer].view(lay.chunks_per_block, -1, *groups)[:, db]
        assert reference.within_bound(x, y, codec), f"layer {layer} outside the {codec} bound"
        assert not torch.equal(x.float(), y.float())  # it really went through the codec


SCATTERED, RUN = ([3, 9, 1, 14], [0, 7, 22, 5]), ([4, 5, 6], [10, 11, 12])


@pytest.mark.parametrize("codec,arrangement,sb,db", [
    *[("fp8_e4m3", arr, *blocks) for arr in ("flash_nhd", "cpu_hnbc") for blocks in (SCATTERED, RUN)],
    ("int8", "flash_nhd", *RUN), ("int8", "cpu_hnbc", *SCATTERED)])
async def test_push_8bit_within_bound_half_the_bytes(nats_server, arrangement, sb, db, codec):
    lay = layout(arrangement=arrangement)
    async with Agent(cfg("cp", nats_server), layout=lay, kv_caches=kv(lay, fill=True)) as p, \
            Agent(cfg("cd", nats_server), layout=lay, kv_caches=kv(lay, fill=False)) as d:
        rx = d.expect("r", db, src=p.instance_id)
        tx = await p.push("r", "cd", sb, codec=codec)
        tx.all_ready()
        with anyio.fail_after(20):
            got, sent = await rx.wait(), await tx.wait()
        assert got.ok and sent.ok, (got.reason, sent.reason)
        assert got.codec == sent.codec == codec
        raw = len(sb) * lay.block_bytes * lay.num_layers
        wire = wire_layer_bytes(lay, codec, len(sb)) * lay.num_layers
        assert got.bytes == sent.bytes == wire
        assert raw // 2 < wire <= raw // 2 + 64 * lay.num_layers  # half, plus the scales
        assert_close(p, d, sb, db, codec)
        await settle(p, d)
        assert_at_rest(p, d)


@pytest.mark.parametrize("mode,codec", [("eager", "fp8_e4m3"), ("lazy", "fp8_e4m3"),
                                        ("eager", "int8")])
async def test_pull_8bit_into_another_dtype(nats_server, mode, codec):
    """bf16 prefill, fp16 decode: an 8-bit wire does not carry the engine dtype."""
    src_lay, dst_lay = layout("bfloat16"), layout("float16")
    async with Agent(cfg("cp", nats_server), layout=src_lay,
                     kv_caches=kv(src_lay, fill=True)) as p, \
            Agent(cfg("cd", nats_server, codec=codec), layout=dst_lay,
                  kv_caches=kv(dst_lay, fill=False)) as d:
        sb, db = [2, 8, 3], [1, 19, 4]
        held = p.offer("r", sb)
        held.all_ready()
        rx = await d.pull("r", "cp", db, mode=mode, secret=held.secret)
        with anyio.fail_after(20):
            for layer in range(dst_lay.num_layers):
                await rx.wait_layer(layer)
            got, sent = await rx.wait(), await held.wait()
        assert got.ok and sent.ok and got.codec == codec
        assert_close(p, d, sb, db, codec)
        await settle(p, d)
        assert_at_rest(p, d)


async def test_another_dtype_is_converted_verbatim_and_decoded_by_fp8(nats_server):
    """bf16 into fp16: verbatim, each value is cast on the way (issue 18's reshape); with
    fp8 the codec's wire decodes into either dtype."""
    src_lay, dst_lay = layout("bfloat16"), layout("float16")
    async with Agent(cfg("cp", nats_server), layout=src_lay,
                     kv_caches=kv(src_lay, fill=True)) as p, \
            Agent(cfg("cd", nats_server), layout=dst_lay, kv_caches=kv(dst_lay, fill=False)) as d:
        with anyio.fail_after(10):
            while not p.peers():
                await anyio.sleep(0.02)
        rx = d.expect("r", [0, 1], src=p.instance_id)
        tx = await p.push("r", "cd", [0, 1], codec="none")
        tx.all_ready()
        with anyio.fail_after(20):
            assert (await rx.result()).ok
        for layer in range(src_lay.num_layers):
            assert torch.equal(d.memory.layers[layer][:, :2],
                               p.memory.layers[layer][:, :2].to(torch.float16))
        d.expect("r2", [0, 1], src=p.instance_id)
        tx = await p.push("r2", "cd", [0, 1], codec="fp8_e4m3")
        tx.all_ready()
        with anyio.fail_after(20):
            assert (await tx.wait()).ok
        await settle(p, d)
        assert_at_rest(p, d)


@pytest.mark.parametrize("accept,codec", [(("none",), "fp8_e4m3"),
                                          (("none", "fp8_e4m3"), "int8")])  # an older peer
async def test_destination_refuses_a_codec_it_does_not_accept(nats_server, accept, codec):
    lay = layout()
    async with Agent(cfg("cp", nats_server), layout=lay, kv_caches=kv(lay, fill=True)) as p, \
            Agent(cfg("cd", nats_server, accept_codecs=accept), layout=lay,
                  kv_caches=kv(lay, fill=False)) as d:
        rx = d.expect("r", [0, 1], src=p.instance_id)
        with pytest.raises(IncompatiblePeerError, match="not accepted"):
            await p.push("r", "cd", [0, 1], codec=codec)
        await rx.abort("refused")
        with pytest.raises(ConfigError, match="accept_codecs"):
            await d.pull("r", "cp", [0, 1], codec=codec)
        assert torch.count_nonzero(d.memory.layers[0]) == 0  # nothing landed
        assert_at_rest(p, d)


async def test_fp8_cache_moves_verbatim_with_its_scales(nats_server):
    """An engine's own FP8 cache is never re-quantized; its scales must agree."""
    lay = layout("float8_e4m3fn")
    src = [t.to(torch.float8_e4m3fn) for t in kv(layout(), fill=True)]
    dst = [torch.zeros(lay.tensor_shape(NBLOCKS), dtype=torch.float8_e4m3fn) for _ in range(4)]
    other = [torch.zeros(lay.tensor_shape(NBLOCKS), dtype=torch.float8_e4m3fn) for _ in range(4)]
    async with Agent(cfg("cp", nats_server, codec="fp8_e4m3"), layout=lay) as p, \
            Agent(cfg("cd", nats_server), layout=lay) as d, \
            Agent(cfg("co", nats_server), layout=lay) as o:
        p.register_kv(lay, src, cache_scales=(0.5, 0.25))
        d.register_kv(lay, dst, cache_scales=(0.5, 0.25))
        o.register_kv(lay, other, cache_scales=(1.0, 1.0))
        d.expect("r", [5, 6], src=p.instance_id)
        tx = await p.push("r", "cd", [1, 2])
        tx.all_ready()
        with anyio.fail_after(20):
            sent = await tx.wait()
        assert sent.ok and sent.codec == "none"
        for layer in range(4):
            for a, b in ((1, 5), (2, 6)):
                assert torch.equal(p.memory.read_block(layer, a), d.memory.read_block(layer, b))
        refused = o.expect("r", [0, 1], src=p.instance_id)
        with pytest.raises(IncompatiblePeerError, match="scales differ"):
            await p.push("r", "co", [1, 2])
        await refused.abort("refused")
        held = p.offer("q", [3, 4])
        held.all_ready()
        with pytest.raises(IncompatiblePeerError, match="scales differ"):
            await o.pull("q", "cp", [7, 8], secret=held.secret)
        await held.abort("test over")
        await settle(p, d, o)
        assert_at_rest(p, d, o)


async def test_non_finite_kv_fails_the_transfer_cleanly(nats_server):
    lay = layout()
    src = kv(lay, fill=True)
    src[2][0, 5, 3, 1, 7] = float("inf")  # layer 2, K of block 5
    async with Agent(cfg("cp", nats_server), layout=lay, kv_caches=src) as p, \
            Agent(cfg("cd", nats_server), layout=lay, kv_caches=kv(lay, fill=False)) as d:
        rx = d.expect("r", [0, 1], src=p.instance_id)
        tx = await p.push("r", "cd", [4, 5], codec="fp8_e4m3")
        tx.all_ready()
        with anyio.fail_after(20), pytest.raises(TransferError, match="inf or NaN"):
            await tx.wait()
        with anyio.fail_after(20):
            assert not (await rx.result()).ok
        await settle(p, d)
        assert_at_rest(p, d)


async def test_staged_and_incremental_push_with_fp8(nats_server):
    """A push that arrives before the reservation waits in staging as FP8; held blocks skip."""
    from kvstream import block_hashes

    lay = layout()
    hashes = block_hashes(range(4 * lay.block_size), lay.block_size)
    async with Agent(cfg("cp", nats_server), layout=lay, kv_caches=kv(lay, fill=True)) as p, \
            Agent(cfg("cd", nats_server), layout=lay, kv_caches=kv(lay, fill=False)) as d:
        tx = await p.push("staged", "cd", [3, 1, 7], codec="fp8_e4m3")
        tx.all_ready()
        with anyio.fail_after(20):
            while not d.statistics().staged_transfers:
                await anyio.sleep(0.02)
        rx = d.expect("staged", [9, 10, 2], src=p.instance_id)
        with anyio.fail_after(20):
            assert (await rx.wait()).ok and (await tx.wait()).ok
        assert_close(p, d, [3, 1, 7], [9, 10, 2])
        rx = d.expect("inc", [11, 12, 13, 14], have=hashes[:2], src=p.instance_id)
        tx = await p.push("inc", "cd", [4, 5, 6, 8], block_hashes=hashes, codec="fp8_e4m3")
        tx.all_ready()
        with anyio.fail_after(20):
            got = await rx.wait()
        assert got.ok and got.bytes == wire_layer_bytes(lay, "fp8_e4m3", 2) * lay.num_layers
        assert torch.count_nonzero(d.memory.layers[0][:, 11:13]) == 0  # held: untouched
        assert_close(p, d, [6, 8], [13, 14])
        await settle(p, d)
        assert_at_rest(p, d)
