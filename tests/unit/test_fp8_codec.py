"""The FP8 codec: the CPU kernel against the torch reference, bit for bit, and the scheme."""

from __future__ import annotations

import pytest
import torch

from kvstream import AgentConfig, ConfigError, KVLayout
from kvstream._exceptions import QuantizationError
from kvstream.memory import RegisteredKV
from kvstream.quant import cpu, reference
from kvstream.quant.codec import LayerCodec, _CpuBackend
from kvstream.quant.scheme import (
    Geometry,
    effective_codec,
    scale_groups,
    wire_fingerprint,
    wire_layer_bytes,
)

ARRANGEMENTS = ["flash_nhd", "flash_hnd", "blocks_first_nhd", "cpu_hnbc", "mla"]
DTYPES = ["float16", "bfloat16", "float32"]
NB = 12


def layout(arrangement: str = "flash_nhd", dtype: str = "float16") -> KVLayout:
    # head_dim 40: not a multiple of the SIMD width, so the scalar tails run too.
    return KVLayout(num_layers=1, num_kv_heads=1 if arrangement == "mla" else 3, head_dim=40,
                    block_size=5, dtype=dtype, arrangement=arrangement)


def hard_values(lay: KVLayout, seed: int = 0) -> torch.Tensor:
    """Wide dynamic range, zeros, negative zeros, subnormals, an all-zero block, a tiny
    block, values near the dtype's top: what rounding and scaling get wrong first."""
    gen = torch.Generator().manual_seed(seed)
    shape = lay.tensor_shape(NB)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    top = 30000.0 if lay.dtype == "float16" else 1e30
    x = x.clamp(-top, top)
    flat = x.view(-1)
    n = flat.numel()
    pick = torch.randint(0, n, (n // 20,), generator=gen)
    flat[pick[: len(pick) // 4]] = 0.0
    flat[pick[len(pick) // 4: len(pick) // 2]] = -0.0
    flat[pick[len(pick) // 2:]] *= 1e-7  # float16 subnormals, e4m3 subnormals and zeros
    t = x.to(getattr(torch, lay.dtype))
    blocks = t[:, 1] if lay.chunks_per_block == 2 else t[1]
    blocks.zero_()
    tiny = t[:, 2] if lay.chunks_per_block == 2 else t[2]
    tiny.mul_(1e-6 if lay.dtype != "float16" else 1e-3)
    return t


def encode_both(lay: KVLayout, t: torch.Tensor, ids: list[int], kernel: object = None):
    mem = RegisteredKV(lay, [t])
    blocks = mem.block_map(ids)
    fast = LayerCodec(mem, "fp8_e4m3")
    if kernel is not None:
        fast.backend = _CpuBackend(Geometry(mem.layout, mem.num_blocks), kernel, "fp8_e4m3")
    slow = LayerCodec(mem, "fp8_e4m3", backend="torch")
    a = torch.zeros(fast.layer_bytes(len(ids)), dtype=torch.uint8)
    b = torch.zeros_like(a)
    fast.encode(0, blocks, a)
    slow.encode(0, blocks, b)
    return fast, slow, blocks, a, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_cpu_kernel_matches_the_reference_bit_for_bit(arrangement, dtype):
    lay = layout(arrangement, dtype)
    t = hard_values(lay)
    ids = [7, 1, 2, 11, 0, 5]
    fast, slow, blocks, a, b = encode_both(lay, t, ids)
    assert fast.backend.name == "cpu"
    assert torch.equal(a, b)
    outs = []
    for codec in (fast, slow):
        dst = torch.full_like(t, 7.0)
        codec_dst = LayerCodec(RegisteredKV(lay, [dst]), "fp8_e4m3",
                               backend="torch" if codec is slow else None)
        codec_dst.decode(0, blocks, a)
        outs.append(dst)
    assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
    g = scale_groups(lay)
    x = t.view(lay.chunks_per_block, NB, *g)[:, ids]
    y = outs[0].view(lay.chunks_per_block, NB, *g)[:, ids]
    assert reference.within_bound(x, y)
    untouched = [i for i in range(NB) if i not in ids]
    assert bool((outs[0].view(lay.chunks_per_block, NB, -1)[:, untouched] == 7.0).all())


def test_portable_build_matches_the_reference():
    """The C path without SIMD (other CPUs) is exact too."""
    kernel = cpu.CpuKernel(cpu.build(simd=False))
    assert not kernel.simd
    lay = layout("flash_nhd", "bfloat16")
    _, _, _, a, b = encode_both(lay, hard_values(lay, seed=3), [3, 9, 4], kernel)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_decodes_like_torch(dtype):
    """All 256 codes at several scales (16-bit outputs take the lookup-table path)."""
    torch_dtype = getattr(torch, dtype)
    codes = torch.arange(256, dtype=torch.uint8).view(1, 1, 1, 1, 1, 256)
    for scale in (2.0 ** -20, 2.0 ** -3, 1.0, 2.0 ** 7, 2.0 ** 8):
        scales = torch.full((1, 1, 1, 1), scale)
        want = reference.dequantize(codes, scales, torch_dtype).float().view(-1)
        lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=256, block_size=1,
                       dtype=dtype, arrangement="mla")
        dst = torch.zeros(lay.tensor_shape(1), dtype=torch_dtype)
        mem = RegisteredKV(lay, [dst])
        codec = LayerCodec(mem, "fp8_e4m3")
        buf = torch.zeros(codec.layer_bytes(1), dtype=torch.uint8)
        buf[:4].view(torch.float32)[0] = scale
        buf[64:] = codes.view(-1)
        codec.decode(0, mem.block_map([0]), buf)
        got = dst.float().view(-1)
        finite = torch.isfinite(want)
        assert torch.equal(got[finite], want[finite])
        assert bool(torch.isnan(got[~finite]).all())  # 0x7f and 0xff are NaN


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf")])
def test_bad_scales_from_the_wire_write_nothing(backend, bad):
    lay = layout()
    t = hard_values(lay)
    _, _, blocks, a, _ = encode_both(lay, t, [1, 4])
    a[:4].view(torch.float32)[0] = bad
    dst = torch.full_like(t, 3.0)
    codec = LayerCodec(RegisteredKV(lay, [dst]), "fp8_e4m3", backend=backend)
    with pytest.raises(QuantizationError, match="scales"):
        codec.decode(0, blocks, a)
    assert bool((dst == 3.0).all())


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_kv_is_refused(backend, bad):
    lay = layout()
    t = hard_values(lay)
    t[0, 4, 2, 1, 3] = bad
    codec = LayerCodec(RegisteredKV(lay, [t]), "fp8_e4m3", backend=backend)
    buf = torch.zeros(codec.layer_bytes(2), dtype=torch.uint8)
    with pytest.raises(QuantizationError, match="inf or NaN"):
        codec.encode(0, codec.mem.block_map([4, 0]), buf)


def test_wire_is_half_plus_the_scales():
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
    assert wire_layer_bytes(lay, "none", 256) == 256 * lay.block_bytes
    fp8 = wire_layer_bytes(lay, "fp8_e4m3", 256)
    scales = 2 * 256 * 8 * 4  # K and V, per block, per head, float32
    assert fp8 == 256 * lay.block_bytes // 2 + scales


def test_compatibility_hash_covers_codec_not_engine_dtype():
    f16, bf16 = layout(dtype="float16"), layout(dtype="bfloat16")
    assert wire_fingerprint(f16, "none") == f16.fingerprint != bf16.fingerprint
    assert wire_fingerprint(f16, "fp8_e4m3") == wire_fingerprint(bf16, "fp8_e4m3")
    assert wire_fingerprint(f16, "fp8_e4m3") != f16.fingerprint
    assert wire_fingerprint(f16, "fp8_e4m3") != wire_fingerprint(layout("flash_hnd"), "fp8_e4m3")
    assert wire_fingerprint(f16, "int8") == wire_fingerprint(bf16, "int8")
    assert wire_fingerprint(f16, "int8") != wire_fingerprint(f16, "fp8_e4m3")
    # Pinned: a peer built before int8 existed must still match our fp8_e4m3 wire.
    assert wire_fingerprint(f16, "fp8_e4m3") == "6872dcb39989d70c"


def test_fp8_cache_is_never_requantized_and_bad_codecs_are_refused():
    assert effective_codec("fp8_e4m3", layout(dtype="float16")) == "fp8_e4m3"
    fp8 = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype="float8_e4m3fn")
    assert effective_codec("fp8_e4m3", fp8) == "none"
    with pytest.raises(ConfigError, match="unknown codec"):
        effective_codec("int4", fp8)
    with pytest.raises(ConfigError, match="unknown codec"):
        AgentConfig(instance_id="x", codec="fp4")
    with pytest.raises(ConfigError):
        LayerCodec(RegisteredKV(fp8, [torch.zeros(fp8.tensor_shape(2), dtype=torch.float8_e4m3fn)]),
                   "fp8_e4m3")


def test_cache_scales_are_checked_at_registration():
    fp8 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float8_e4m3fn")
    t = [torch.zeros(fp8.tensor_shape(2), dtype=torch.float8_e4m3fn) for _ in range(2)]
    assert RegisteredKV(fp8, t, cache_scales=(0.5, 2.0)).cache_scales == [0.5, 2.0, 0.5, 2.0]
    from kvstream import LayoutError

    with pytest.raises(LayoutError, match="positive"):
        RegisteredKV(fp8, t, cache_scales=(0.5, 0.0))
    with pytest.raises(LayoutError, match="FP8 cache"):
        RegisteredKV(layout(), [torch.zeros(layout().tensor_shape(2)).half()], cache_scales=(1, 1))


def test_bench_verification_holds_the_bound_and_can_fail():
    from kvstream.bench.synthetic import BenchSpec, make_cache
    from kvstream.bench.workers import _verify

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    spec = BenchSpec(layout=lay, tokens=64, data="kv")
    src = RegisteredKV(lay, make_cache(spec, fill=True))
    dst = RegisteredKV(lay, make_cache(spec, fill=False))
    sb, db = [0, 5, 2, 7], [6, 1, 3, 4]
    enc, dec = LayerCodec(src, "fp8_e4m3"), LayerCodec(dst, "fp8_e4m3")
    buf = torch.zeros(enc.layer_bytes(4), dtype=torch.uint8)
    for layer in range(2):
        enc.encode(layer, src.block_map(sb), buf)
        dec.decode(layer, dst.block_map(db), buf)
    assert _verify(spec, dst, sb, db, "fp8_e4m3")
    assert not _verify(spec, dst, sb, db, "none")  # lossy: not bit-exact
    dst.layers[1][1, 3, 5, 1, 9] *= 1.2  # one value of V, block 3, off by 20 %
    assert not _verify(spec, dst, sb, db, "fp8_e4m3")


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_decode_saturates_at_the_dtype_max_instead_of_inf(backend):
    """65,000 in fp16 rounds to the code for 65,536 (inf in fp16): it comes back 65,504."""
    lay = layout("mla", "float16")
    t = torch.full(lay.tensor_shape(NB), 65000.0).half()
    t[3, 0, :4] = torch.tensor([-65000.0, 1.0, -0.5, 61000.0])
    codec = LayerCodec(RegisteredKV(lay, [t]), "fp8_e4m3", backend=backend)
    buf = torch.zeros(codec.layer_bytes(1), dtype=torch.uint8)
    codec.encode(0, codec.mem.block_map([3]), buf)
    dst = torch.zeros_like(t)
    LayerCodec(RegisteredKV(lay, [dst]), "fp8_e4m3", backend=backend).decode(
        0, codec.mem.block_map([0]), buf)
    assert bool(torch.isfinite(dst).all())
    assert dst[0, 0, 0].item() == -65504.0 and dst[0, 0, 4].item() == 65504.0
    g = scale_groups(lay)
    assert reference.within_bound(t[3].view(1, 1, *g), dst[0].view(1, 1, *g))


def test_backend_failures_become_quantization_errors():
    lay = layout()
    codec = LayerCodec(RegisteredKV(lay, [hard_values(lay)]), "fp8_e4m3")

    class Broken:
        name = "broken"

        def encode(self, *args: object) -> None:
            raise RuntimeError("out of memory")

    codec.backend = Broken()  # type: ignore[assignment]
    buf = torch.zeros(codec.layer_bytes(2), dtype=torch.uint8)
    with pytest.raises(QuantizationError, match="out of memory"):
        codec.encode(0, codec.mem.block_map([0, 1]), buf)
    with pytest.raises(QuantizationError, match="cannot hold"):
        codec.encode(0, codec.mem.block_map([0, 1]), buf[:-1])


def test_cpu_layout_scales_k_and_v_rows_apart():
    """vLLM's CPU cache keeps a block's K rows, then its V rows, per head: one scale each."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16",
                   arrangement="cpu_hnbc")
    t = torch.zeros(lay.tensor_shape(3), dtype=torch.float16)
    rows = t.view(3, 2, 2, 4, 8)  # [nb, h, K|V, bs, d] as cpu_attn.py views it
    rows[:, :, 0] = 1.0
    rows[:, :, 1] = 100.0
    codec = LayerCodec(RegisteredKV(lay, [t]), "fp8_e4m3")
    buf = torch.zeros(codec.layer_bytes(1), dtype=torch.uint8)
    codec.encode(0, codec.mem.block_map([1]), buf)
    scales = buf[:16].view(torch.float32)  # block 1: head 0 K, head 0 V, head 1 K, head 1 V
    assert scales[0] == scales[2] and scales[1] == scales[3]
    assert scales[1] / scales[0] == 64  # 100 needs 2^6 more range than 1
