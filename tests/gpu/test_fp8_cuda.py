"""The CUDA kernels of the 8-bit codecs (csrc/fp8.cu: fp8_e4m3 and int8) against the torch
reference on the same GPU, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvstream._exceptions import QuantizationError
from kvstream.layout import KVLayout
from kvstream.memory import RegisteredKV
from kvstream.quant.codec import LayerCodec

pytestmark = [pytest.mark.gpu]

ARRANGEMENTS = ("flash_nhd", "flash_hnd", "blocks_first_nhd", "cpu_hnbc", "mla")
DTYPES = ("float16", "bfloat16", "float32")
CODECS = ("fp8_e4m3", "int8")
NUM_BLOCKS = 9


@pytest.fixture(autouse=True)
def _needs_cupy() -> None:
    pytest.importorskip("cupy")


def _layout(arrangement: str, dtype: str) -> KVLayout:
    heads = 1 if arrangement == "mla" else 3
    return KVLayout(num_layers=2, num_kv_heads=heads, head_dim=40, block_size=5, dtype=dtype,
                    arrangement=arrangement)


def _kv(layout: KVLayout, seed: int) -> list[torch.Tensor]:
    """Log-normal magnitudes (outliers) with zeros, negative zeros, values in the dtype's
    subnormal range, +-max, a block of subnormals only and an all-zero block."""
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, layout.dtype)
    fi = torch.finfo(dt)
    shape = layout.tensor_shape(NUM_BLOCKS)
    layers = []
    for _ in range(layout.num_layers):
        x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 4)
        flat = x.view(-1)
        idx = torch.randperm(flat.numel(), generator=gen)
        k = flat.numel() // 20
        flat[idx[:k]] = 0.0
        flat[idx[k:2 * k]] = -0.0
        flat[idx[2 * k:3 * k]] *= fi.tiny * 4
        flat[idx[3 * k:3 * k + 4]] = torch.tensor([fi.max, -fi.max, fi.max, -fi.max])
        x = x.clamp(-fi.max, fi.max).to(dt)
        chunks = x.view(layout.chunks_per_block, NUM_BLOCKS, -1)
        chunks[:, 2] = (torch.randn(chunks[:, 2].shape, generator=gen) * fi.tiny / 3).to(dt)
        chunks[:, 5] = 0.0
        chunks[:, 5, ::3] = -0.0
        layers.append(x.cuda())
    return layers


def _codec(mem: RegisteredKV, name: str) -> LayerCodec:
    codec = LayerCodec(mem, name)
    assert codec.backend.name == "cuda"
    return codec


def _buffer(codec: LayerCodec, nblocks: int) -> torch.Tensor:
    return torch.zeros(codec.layer_bytes(nblocks), dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_kernels_match_reference_bit_for_bit(arrangement: str, dtype: str, codec: str) -> None:
    lay = _layout(arrangement, dtype)
    layers = _kv(lay, seed=ARRANGEMENTS.index(arrangement) * 3 + DTYPES.index(dtype))
    mem = RegisteredKV(lay, layers)
    cuda, ref = _codec(mem, codec), LayerCodec(mem, codec, backend="torch")
    for ids in ([7, 2, 5, 0, 8], [3, 4, 5]):
        blocks = mem.block_map(ids)
        for layer in range(lay.num_layers):
            got, want = _buffer(cuda, len(ids)), _buffer(ref, len(ids))
            cuda.encode(layer, blocks, got)
            ref.encode(layer, blocks, want)
            assert torch.equal(got, want), (ids, layer, (got != want).nonzero()[:8].flatten().tolist())

            dst_ids = [1, 8, 0, 6, 4][:len(ids)]
            out_cuda = [torch.zeros_like(t) for t in layers]
            out_ref = [torch.zeros_like(t) for t in layers]
            mem_cuda, mem_ref = RegisteredKV(lay, out_cuda), RegisteredKV(lay, out_ref)
            _codec(mem_cuda, codec).decode(layer, mem_cuda.block_map(dst_ids), want)
            LayerCodec(mem_ref, codec, backend="torch").decode(
                layer, mem_ref.block_map(dst_ids), want)
            assert torch.equal(out_cuda[layer].view(torch.uint8), out_ref[layer].view(torch.uint8))
            assert bool(out_cuda[layer].any())


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_kv_raises(dtype: str, codec: str) -> None:
    lay = _layout("flash_nhd", dtype)
    for bad in (float("nan"), float("inf"), float("-inf")):
        layers = _kv(lay, seed=1)
        layers[0][1, 6, 2, 1, 3] = bad
        mem = RegisteredKV(lay, layers)
        lc = _codec(mem, codec)
        with pytest.raises(QuantizationError, match=f"inf or NaN in 1 scale groups: {codec}"):
            lc.encode(0, mem.block_map([6, 0]), _buffer(lc, 2))
        lc.encode(1, mem.block_map([6, 0]), _buffer(lc, 2))  # other layers still encode


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -0.0, -0.5])
def test_bad_scale_fails_decode_untouched(bad: float, codec: str) -> None:
    lay = _layout("blocks_first_nhd", "bfloat16")
    mem = RegisteredKV(lay, _kv(lay, seed=2))
    lc = _codec(mem, codec)
    buf = _buffer(lc, 3)
    lc.encode(0, mem.block_map([1, 2, 3]), buf)
    _codes, scales = lc._split(buf, 3)
    scales[scales.numel() // 2] = bad

    dst = [torch.full_like(t, 1.5) for t in mem.layers]
    before = [t.clone() for t in dst]
    mem_dst = RegisteredKV(lay, dst)
    with pytest.raises(QuantizationError, match=f"1 {codec} scales from the peer"):
        _codec(mem_dst, codec).decode(0, mem_dst.block_map([4, 0, 8]), buf)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))
