"""The int8 codec's CPU kernel (csrc/fp8_cpu.c, kvs_i8_*) against the torch reference, bit for
bit: codes, scales and decoded values, called through ctypes as ``codec._CpuBackend`` does."""

from __future__ import annotations

import pytest
import torch

from kvstream import KVLayout
from kvstream._exceptions import QuantizationError
from kvstream.memory import RegisteredKV
from kvstream.quant import cpu, reference
from kvstream.quant.codec import LayerCodec
from kvstream.quant.cpu import DTYPE_CODES
from kvstream.quant.scheme import scale_groups

ARRANGEMENTS = ["flash_nhd", "flash_hnd", "blocks_first_nhd", "cpu_hnbc", "mla"]
DTYPES = ["float16", "bfloat16", "float32"]
NB = 12
IDS = [7, 1, 2, 11, 0, 5, 3, 4]  # scattered; 1-4 are the special blocks of hard_values


@pytest.fixture(scope="module", params=["simd", "portable"])
def kernel(request) -> cpu.CpuKernel:
    if request.param == "portable":
        k = cpu.CpuKernel(cpu.build(simd=False))
        assert not k.simd
        return k
    k = cpu.load()
    if k is None:
        pytest.skip("no C compiler (cc): apt-get install gcc builds the CPU codec kernel")
    return k


def layout(arrangement: str = "flash_nhd", dtype: str = "float16", head_dim: int = 44,
           heads: int = 3, block_size: int = 5) -> KVLayout:
    # head_dim 44 = 32 + 8 + 4: rows run the 32-wide loop, the 8-wide one and the scalar tail.
    return KVLayout(num_layers=1, num_kv_heads=1 if arrangement == "mla" else heads,
                    head_dim=head_dim, block_size=block_size, dtype=dtype, arrangement=arrangement)


def block(t: torch.Tensor, lay: KVLayout, i: int) -> torch.Tensor:
    return t[:, i] if lay.chunks_per_block == 2 else t[i]


def hard_values(lay: KVLayout, seed: int = 0) -> torch.Tensor:
    """Wide dynamic range, zeros, negative zeros, subnormals; block 1 all zero, block 2 tiny,
    block 3 up to the dtype's largest finite value, block 4 below the 2^-119 scale floor."""
    gen = torch.Generator().manual_seed(seed)
    shape = lay.tensor_shape(NB)
    dt = getattr(torch, lay.dtype)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    x = x.clamp(-30000.0, 30000.0)
    flat = x.view(-1)
    n = flat.numel()
    pick = torch.randint(0, n, (n // 20,), generator=gen)
    flat[pick[: len(pick) // 4]] = 0.0
    flat[pick[len(pick) // 4: len(pick) // 2]] = -0.0
    flat[pick[len(pick) // 2:]] *= 1e-7  # float16 subnormals
    t = x.to(dt)
    block(t, lay, 1).zero_()
    block(t, lay, 2).mul_(1e-3 if lay.dtype == "float16" else 1e-6)
    top = torch.finfo(dt).max
    big = block(t, lay, 3)
    near = (torch.randn(big.numel(), generator=gen, dtype=torch.float64) * top / 3).clamp(-top, top)
    near[::7] = top
    near[3::11] = -top
    big.copy_(near.view(big.shape).to(dt))
    if lay.dtype != "float16":  # float32 subnormal inputs (bf16 has them too): a = 2^-119
        block(t, lay, 4).mul_(1e-40)
    return t


def geometry(lay: KVLayout):
    return lay.chunks_per_block, lay.chunk_bytes // lay.dtype_bytes, scale_groups(lay)


def encode(k: cpu.CpuKernel, lay: KVLayout, t: torch.Tensor, ids: list[int]):
    """(bad groups, codes [planes, n, P, Q, R, S], scales [planes, n, P, R]) from the kernel."""
    mem = RegisteredKV(lay, [t])
    blocks = mem.block_map(ids)
    planes, chunk, g = geometry(lay)
    n = len(ids)
    codes = torch.full((planes * n * chunk,), 0xA5, dtype=torch.uint8)
    scales = torch.full((planes * n * g[0] * g[2],), -3.0)
    quantize, _ = k.ops("int8")
    bad = quantize(t.data_ptr(), DTYPE_CODES[lay.dtype], mem.num_blocks, planes,
                   blocks.index.data_ptr(), n, *g, codes.data_ptr(), scales.data_ptr())
    return bad, codes.view(planes, n, *g), scales.view(planes, n, g[0], g[2])


def decode(k: cpu.CpuKernel, lay: KVLayout, codes: torch.Tensor, scales: torch.Tensor,
           dst: torch.Tensor, ids: list[int]) -> int:
    mem = RegisteredKV(lay, [dst])
    blocks = mem.block_map(ids)
    planes, _, g = geometry(lay)
    _, dequantize = k.ops("int8")
    return dequantize(codes.data_ptr(), scales.data_ptr(), len(ids), planes, *g,
                      dst.data_ptr(), DTYPE_CODES[lay.dtype], mem.num_blocks,
                      blocks.index.data_ptr())


def gathered(lay: KVLayout, t: torch.Tensor, ids: list[int]) -> torch.Tensor:
    planes, _, g = geometry(lay)
    return t.view(planes, NB, *g)[:, ids]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_kernel_matches_the_reference_bit_for_bit(kernel, arrangement, dtype):
    lay = layout(arrangement, dtype)
    t = hard_values(lay)
    bad, codes, scales = encode(kernel, lay, t, IDS)
    assert bad == 0
    x = gathered(lay, t, IDS)
    want_codes, want_scales = reference.quantize(x, "int8")
    assert same_bits(codes, want_codes)
    assert same_bits(scales, want_scales)
    assert bool((scales[:, IDS.index(1)] == torch.tensor(2.0 ** -119) / 127).all())  # the floor

    dst = torch.full_like(t, 7.0)
    assert decode(kernel, lay, codes, scales, dst, IDS) == 0
    y = gathered(lay, dst, IDS)
    assert same_bits(y, reference.dequantize(codes, scales, t.dtype, "int8"))
    assert bool(torch.isfinite(y).all())
    assert reference.within_bound(x, y, "int8")
    planes = lay.chunks_per_block
    untouched = [i for i in range(NB) if i not in IDS]
    assert bool((dst.view(planes, NB, -1)[:, untouched] == 7.0).all())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rounding_edges_match(kernel, dtype):
    """Values whose x * inv lands on, or an ulp either side of, k + 0.5: a scale or inverse
    one ulp off the reference's (127 / a computed as a.reciprocal() * 127, say) changes codes."""
    lay = layout("flash_nhd", dtype, heads=16, block_size=2)
    gen = torch.Generator().manual_seed(5)
    planes, _, g = geometry(lay)
    shape = (planes, NB, g[0], g[1], g[2], g[3])
    amax = torch.exp(torch.randn(planes, NB, g[0], 1, g[2], 1, generator=gen) * 8).to(getattr(torch, dtype))
    a = amax.float()
    inv = torch.full_like(a, 127.0) / a  # the reference's: one true division
    k = torch.randint(-127, 127, shape, generator=gen).float() + 0.5
    x = k / inv
    x = torch.where(torch.rand(shape, generator=gen) < 0.5, x.nextafter(x * 2), x)
    x = torch.where(torch.rand(shape, generator=gen) < 0.5, x.nextafter(torch.zeros_like(x)), x)
    x = x.clamp(-a, a)
    x[..., 0, :, 0] = a[..., 0, :, 0]  # each group's absmax is exactly a
    t = x.to(getattr(torch, dtype)).view(lay.tensor_shape(NB))
    ids = list(range(NB))[::-1]
    bad, codes, scales = encode(kernel, lay, t, ids)
    assert bad == 0
    want_codes, want_scales = reference.quantize(gathered(lay, t, ids), "int8")
    assert same_bits(scales, want_scales)
    assert same_bits(codes, want_codes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_decodes_like_the_reference(kernel, dtype):
    """All 256 codes (0x80 = -128 too, which encode never writes) at awkward scales: the
    floor's subnormal, non powers of two, and ones that overflow the dtype (saturate)."""
    torch_dtype = getattr(torch, dtype)
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=263, block_size=1, dtype=dtype,
                   arrangement="mla")
    codes = torch.cat([torch.arange(256), torch.tensor([0x80, 0x7F, 0x81, 1, 0xFF, 0, 0x40])])
    codes = codes.to(torch.uint8).view(1, 1, 1, 1, 1, 263)
    f32max = torch.finfo(torch.float32).max
    for scale in (2.0 ** -126 / 127, 1e-30, 0.1, 1.0 / 127, 3.0, 515.77, 1e36, f32max / 127,
                  f32max):
        scales = torch.full((1, 1, 1, 1), scale)
        dst = torch.zeros(lay.tensor_shape(1), dtype=torch_dtype)
        assert decode(kernel, lay, codes, scales, dst, [0]) == 0
        want = reference.dequantize(codes, scales, torch_dtype, "int8")
        assert same_bits(dst.view(want.shape), want), scale
        assert bool(torch.isfinite(dst).all())


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), -0.0])
def test_bad_scales_write_nothing(kernel, bad):
    lay = layout("flash_hnd", "float16")
    t = hard_values(lay)
    _, codes, scales = encode(kernel, lay, t, IDS)
    scales.view(-1)[3] = bad
    scales.view(-1)[-1] = bad
    dst = torch.full_like(t, 3.0)
    assert decode(kernel, lay, codes, scales, dst, IDS) == 2
    assert bool((dst == 3.0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_kv_is_counted(kernel, dtype, value):
    """Each group holding inf or NaN counts once and gets scale 1; the others are exact."""
    lay = layout("flash_nhd", dtype)
    t = hard_values(lay)
    t[0, 4, 2, 1, 3] = value  # K, block 4, group (head 1)
    t[0, 4, 0, 1, 43] = value  # the same group
    t[1, 0, 4, 2, 0] = value  # V, block 0, head 2
    ids = [4, 0, 6]
    bad, codes, scales = encode(kernel, lay, t, ids)
    assert bad == 2
    bad_groups = [(0, 0, 0, 1), (1, 1, 0, 2)]
    for grp in bad_groups:
        assert scales[grp].item() == 1.0
    want_codes, want_scales = reference.quantize(gathered(lay, t.nan_to_num(0.0, 0.0, 0.0), ids),
                                                 "int8")
    good = torch.ones(scales.shape, dtype=torch.bool)
    for grp in bad_groups:
        good[grp] = False
    assert same_bits(scales[good], want_scales[good])
    good_codes = good.unsqueeze(-2).unsqueeze(-1).expand(codes.shape)
    assert same_bits(codes[good_codes], want_codes[good_codes])


def test_ops_names_the_codecs():
    k = cpu.load()
    if k is None:
        pytest.skip("no C compiler (cc): apt-get install gcc builds the CPU codec kernel")
    assert k.ops("fp8_e4m3") == (k.quantize, k.dequantize)
    assert [f.__name__ for f in k.ops("int8")] == ["kvs_i8_quantize", "kvs_i8_dequantize"]
    for name in ("none", "int4", "INT8"):
        with pytest.raises(QuantizationError, match="no codec"):
            k.ops(name)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_flush_to_zero_never_zeroes_a_scale(backend):
    """A library may turn on flush-to-zero in the thread that encodes: the floor keeps every
    scale normal, so an all-zero group still decodes (a subnormal scale would flush to 0,
    which the receiver must refuse)."""
    lay = layout("flash_nhd", "float32")
    t = torch.zeros(lay.tensor_shape(NB))
    block(t, lay, 2).fill_(1e-39)  # float32 subnormals, below the floor
    mem = RegisteredKV(lay, [t])
    codec = LayerCodec(mem, "int8", backend=backend)
    buf = torch.zeros(codec.layer_bytes(3), dtype=torch.uint8)
    blocks = mem.block_map([0, 1, 2])
    dst = torch.full_like(t, 7.0)
    out = LayerCodec(RegisteredKV(lay, [dst]), "int8", backend=backend)
    supported = torch.set_flush_denormal(True)
    try:
        codec.encode(0, blocks, buf)
        out.decode(0, blocks, buf)
    finally:
        torch.set_flush_denormal(False)
    assert supported  # this CPU has FTZ, so the test exercised it
    got = dst.view(2, NB, -1)[:, :3]
    assert bool((got[:, :2] == 0).all())
    assert bool((got[:, 2].abs() <= 2.0 ** -119 / 254 * 1.01).all())
