"""The C transpose (csrc/transpose.c) that reshapes vLLM CPU blocks' K: bit for bit what the
torch views give, every dtype size and edge of its tiles, both ways; items outside a buffer
refused before a byte is written; the torch path where the kernel is not there."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvstream.layout import KVLayout
from kvstream.transfer import plan as P
from kvstream.transfer import transpose as tr

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _layout(dtype: torch.dtype, heads: int, d: int, bs: int) -> KVLayout:
    return KVLayout(num_layers=1, num_kv_heads=heads, head_dim=d, block_size=bs,
                    dtype=str(dtype).removeprefix("torch."), arrangement="cpu_hnbc")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "d", "bs"), [(2, 8, 16), (3, 12, 5), (1, 64, 32),
                                                 (4, 9, 7), (2, 16, 1)])
def test_both_ways_bit_for_bit_against_the_torch_views(dtype, heads, d, bs):
    assert tr.load() is not None, "the C transpose must build on CI machines"
    lay = _layout(dtype, heads, d, bs)
    gen = torch.Generator().manual_seed(heads * 1000 + d * 10 + bs)
    nb, ids = 6, [4, 0, 5]
    cache = torch.randint(0, 256, (nb * heads * bs * 2 * d * dtype.itemsize,), generator=gen,
                          dtype=torch.uint8).view(dtype).view(lay.tensor_shape(nb))
    k = P.plane_views(cache, lay)[0]  # [nb, bs, h, d]: the reference
    for start, n in ((0, heads), (heads - 1, 1)):
        wire = torch.empty((len(ids) * bs, n, d), dtype=dtype)
        assert tr.k_blocks(cache, wire, torch.tensor(ids), num_heads=heads, head=start,
                           block_size=bs, head_dim=d, to_wire=True)
        want = k[ids][:, :, start:start + n].reshape(-1, n, d)
        assert torch.equal(_bits(wire), _bits(want.contiguous()))
        into = torch.zeros_like(cache)
        assert tr.k_blocks(into, wire, torch.tensor(ids), num_heads=heads, head=start,
                           block_size=bs, head_dim=d, to_wire=False)
        got = P.plane_views(into, lay)[0]
        assert torch.equal(_bits(got[ids][:, :, start:start + n].reshape(-1, n, d)),
                           _bits(want.contiguous()))
        untouched = torch.ones(nb, dtype=torch.bool)
        untouched[ids] = False
        assert not _bits(into[untouched]).any()  # no other block written
        assert not _bits(P.plane_views(into, lay)[1]).any()  # nor any V


def test_items_outside_a_buffer_are_refused_before_any_write():
    lib = tr.load()
    assert lib is not None
    src = np.arange(64, dtype=np.int16)
    dst = np.zeros(64, dtype=np.int16)
    good, bad = np.array([0], dtype=np.int64), np.array([0, 120], dtype=np.int64)
    offs = np.array([0, 0], dtype=np.int64)
    args = (dst.ctypes.data, dst.nbytes)
    # two 8 x 8 items; the second's destination starts at byte 120 of 128: outside
    assert lib.fn(*args, bad.ctypes.data, src.ctypes.data, src.nbytes, offs.ctypes.data, 2,
                  8, 8, 8, 8, 2) == -2
    assert not dst.any()
    assert lib.fn(*args, good.ctypes.data, src.ctypes.data, src.nbytes,
                  np.array([8], dtype=np.int64).ctypes.data, 1, 8, 8, 8, 8, 2) == -3
    assert lib.fn(*args, good.ctypes.data, src.ctypes.data, src.nbytes, good.ctypes.data, 1,
                  8, 8, 4, 8, 2) == -1  # a row stride shorter than a row
    assert not dst.any()
    assert lib.fn(*args, good.ctypes.data, src.ctypes.data, src.nbytes, good.ctypes.data, 1,
                  8, 8, 8, 8, 2) == 0
    assert np.array_equal(dst.reshape(8, 8), src.reshape(8, 8).T)
    assert ctypes.sizeof(ctypes.c_int64) == 8


def test_pack_and_unpack_without_the_kernel_give_the_same_bits(monkeypatch):
    lay = _layout(torch.float16, 2, 16, 8)
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(lay.tensor_shape(5), generator=gen).half()
    blocks, tokens = [3, 1, 4], 21  # a partial last block
    fast = P.pack(cache, lay, blocks, tokens)
    into_fast = torch.zeros_like(cache)
    P.unpack(fast, into_fast, lay, blocks)
    monkeypatch.setattr(tr, "load", lambda: None)
    slow = P.pack(cache, lay, blocks, tokens)
    into_slow = torch.zeros_like(cache)
    P.unpack(slow, into_slow, lay, blocks)
    assert torch.equal(_bits(fast), _bits(slow))
    assert torch.equal(_bits(into_fast), _bits(into_slow))
    assert not tr.k_blocks(cache[:, :1], torch.empty(16, 1, 16).half(), torch.tensor([0, 1]),
                           num_heads=2, head=0, block_size=8, head_dim=16, to_wire=True)
