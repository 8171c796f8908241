"""Transfer plans between unequal layouts (issue 18), in memory: random layout pairs (TP
1/2/4/8 either side, 1-16 KV heads, block sizes 1-128 including non-multiples, every
arrangement, fp16/bf16/fp32), every destination element checked against the model-wide
truth, read back by an independent reader of each arrangement (``bench.sources``; a split
layout's K and V tensors by their rows, written out here)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream._exceptions import LayoutError
from kvstream.bench.sources import _kv_heads
from kvstream.layout import KVLayout
from kvstream.transfer.plan import Shard, incompatibility, pack, plan, plane_views, unpack

ARRANGEMENTS = ["flash_nhd", "flash_hnd", "blocks_first_nhd", "cpu_hnbc", "split_nhd"]
DTYPES = ["float16", "bfloat16", "float32"]

# One layer's cache: its tensor, or a split layout's (K, V).
Cache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _cache(lay: KVLayout, num_blocks: int, make: Callable[[tuple[int, ...]], torch.Tensor]
           ) -> Cache:
    """One layer's cache of ``num_blocks`` blocks, each tensor made by ``make(shape)``."""
    shape = lay.tensor_shape(num_blocks)
    return (make(shape), make(shape)) if lay.split else make(shape)


def _flat(t: Cache) -> torch.Tensor:
    """Every element of one layer (split: K's, then V's), flat, as a copy."""
    return torch.cat([x.reshape(-1) for x in t]) if isinstance(t, tuple) else t.reshape(-1)


def _rows(lay: KVLayout, blocks: list[int], tokens: int) -> torch.Tensor:
    """Token ``p`` sits at slot ``p % bs`` of block ``blocks[p // bs]``: of a split
    layout's K or V ``[nb * bs, h, d]``, the row ``blocks[p // bs] * bs + p % bs``."""
    bs = lay.block_size
    return torch.tensor([blocks[p // bs] * bs + p % bs for p in range(tokens)],
                        dtype=torch.int64)


def _read(shard: Shard, t: Cache, blocks: list[int], tokens: int) -> torch.Tensor:
    """``[kv, tokens, heads, d]`` of the request, through the independent reader."""
    lay = shard.layout
    if lay.split:
        assert isinstance(t, tuple)
        k, v = t  # each [nb * bs, h, d]
        rows = _rows(lay, blocks, tokens)
        return torch.stack([k[rows], v[rows]]).float()
    assert isinstance(t, torch.Tensor)
    if lay.kv_factor == 1:
        flat = t.reshape(-1, lay.head_dim)
        rows = [blocks[p // lay.block_size] * lay.block_size + p % lay.block_size
                for p in range(tokens)]
        return flat[rows].float()[None, :, None, :]
    k, v = _kv_heads(lay, t)  # [h, all tokens in block order, d]
    rows = _rows(lay, blocks, tokens)
    return torch.stack([k[:, rows].transpose(0, 1), v[:, rows].transpose(0, 1)])


def _shards(total: int, tp: int, layers: int, d: int, bs: int, arr: str, dtype: str
            ) -> list[Shard]:
    heads = max(1, total // tp)
    lay = KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=d, block_size=bs,
                   dtype=dtype, arrangement=arr)
    return [Shard(layout=lay, total_kv_heads=total, tp_rank=r, tp_size=tp) for r in range(tp)]


def _blocks(gen: torch.Generator, tokens: int, bs: int) -> tuple[list[int], int]:
    need = -(-tokens // bs)
    num_blocks = need + 3
    return torch.randperm(num_blocks, generator=gen)[:need].tolist(), num_blocks


def _move(src: list[Shard], dst: list[Shard], tokens: int, seed: int) -> None:
    """Every source rank holds its heads of one model-wide truth; every destination rank
    is filled from the plan; each is checked element by element."""
    gen = torch.Generator().manual_seed(seed)
    kv, d, total = src[0].layout.kv_factor, src[0].layout.head_dim, src[0].total_kv_heads
    truth = torch.randn(kv, tokens, total, d, generator=gen)
    src_caches = []
    for s in src:
        blocks, n = _blocks(gen, tokens, s.layout.block_size)
        dtype = getattr(torch, s.layout.dtype)
        t = _cache(s.layout, n, lambda shape, dt=dtype: torch.zeros(shape, dtype=dt))
        unpack(truth[:, :, s.heads.start:s.heads.stop].contiguous(), t, s.layout, blocks)
        src_caches.append((t, blocks))
        assert torch.equal(_read(s, t, blocks, tokens),
                           truth[:, :, s.heads.start:s.heads.stop].to(dtype).float())
    for r in dst:
        blocks, n = _blocks(gen, tokens, r.layout.block_size)
        dtype = getattr(torch, r.layout.dtype)
        t = _cache(r.layout, n, lambda shape, dt=dtype: torch.zeros(shape, dtype=dt))
        for part in plan(r, src):
            st_, sb = src_caches[part.source]
            wire = pack(st_, src[part.source].layout, sb, tokens,
                        range(part.src_head, part.src_head + part.heads))
            unpack(wire, t, r.layout, blocks, part.dst_head)
        want = truth[:, :, r.heads.start:r.heads.stop].to(getattr(torch, src[0].layout.dtype))
        assert torch.equal(_read(r, t, blocks, tokens), want.to(dtype).float()), r.describe()
        # The slots past the last token of the last block are untouched.
        pad = -tokens % r.layout.block_size
        if pad:
            whole = _read(r, t, blocks, tokens + pad)
            assert not whole[:, tokens:].any()


def _tp_for(total: int) -> st.SearchStrategy[int]:
    return st.sampled_from([tp for tp in (1, 2, 4, 8) if total % tp == 0 or tp % total == 0])


@st.composite
def layout_pairs(draw: st.DrawFn):
    total = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    d = draw(st.sampled_from([8, 16, 24]))
    layers = 1
    sides = []
    for _ in range(2):
        sides.append(_shards(total, draw(_tp_for(total)), layers, d,
                             draw(st.integers(1, 128)), draw(st.sampled_from(ARRANGEMENTS)),
                             draw(st.sampled_from(DTYPES))))
    tokens = draw(st.integers(1, 300))
    return sides[0], sides[1], tokens, draw(st.integers(0, 2 ** 16))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs())
def test_random_layout_pairs_move_every_element(pair) -> None:
    src, dst, tokens, seed = pair
    _move(src, dst, tokens, seed)


@pytest.mark.parametrize(("src_bs", "dst_bs"), [(16, 128), (128, 16), (48, 32), (1, 7)])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1), (4, 8), (8, 2)])
def test_block_sizes_and_tp_both_ways(src_bs, dst_bs, src_tp, dst_tp) -> None:
    _move(_shards(4, src_tp, 1, 16, src_bs, "flash_nhd", "float16"),
          _shards(4, dst_tp, 1, 16, dst_bs, "flash_hnd", "float16"), tokens=133, seed=1)


def test_mla_latent_moves_from_one_rank() -> None:
    src = [Shard(layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, block_size=16,
                                 arrangement="mla"), total_kv_heads=1, tp_rank=r, tp_size=2)
           for r in range(2)]
    dst = [Shard(layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, block_size=64,
                                 arrangement="mla"), total_kv_heads=1, tp_rank=r, tp_size=4)
           for r in range(4)]
    # One source per destination rank; sibling ranks spread over the replicas.
    assert [[p.source for p in plan(r, src)] for r in dst] == [[0], [1], [0], [1]]
    _move(src, dst, tokens=100, seed=2)


def test_replicated_heads_take_one_source_each() -> None:
    src = _shards(2, 8, 1, 8, 16, "flash_nhd", "float16")  # 4 ranks per head
    assert [s.head_start for s in src] == [0, 0, 0, 0, 1, 1, 1, 1]
    dst = _shards(2, 1, 1, 8, 16, "flash_nhd", "float16")[0]
    assert [(p.source, p.dst_head) for p in plan(dst, src)] == [(0, 0), (4, 1)]


@pytest.mark.parametrize(("change", "match"), [
    ({"num_layers": 3}, "2 layers against 3"),
    ({"head_dim": 32}, "head_dim 16 against 32"),
    ({"dtype": "float8_e4m3fn"}, "FP8"),
])
def test_what_cannot_be_mapped_is_refused_naming_both(change, match) -> None:
    base = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "block_size": 16}
    a = Shard(layout=KVLayout(**base), total_kv_heads=4)
    b = Shard(layout=KVLayout(**{**base, **change}), total_kv_heads=4)
    why = incompatibility(a, b)
    assert why is not None and match in why and "TP rank 0/1" in why
    with pytest.raises(LayoutError, match=match):
        plan(b, [a])


def test_other_model_head_counts_mla_and_missing_heads_are_refused() -> None:
    a = _shards(8, 2, 1, 16, 16, "flash_nhd", "float16")
    b = _shards(4, 1, 1, 16, 16, "flash_nhd", "float16")
    assert "8 and 4 KV heads" in (incompatibility(a[0], b[0]) or "")
    mla = Shard(layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16,
                                arrangement="mla"), total_kv_heads=1)
    assert "MLA" in (incompatibility(mla, _shards(1, 1, 1, 16, 16, "flash_nhd", "float16")[0])
                     or "")
    with pytest.raises(LayoutError, match="no source holds KV head 4"):
        plan(_shards(8, 1, 1, 16, 16, "flash_nhd", "float16")[0], a[:1])


def test_shards_must_match_their_tp_split() -> None:
    lay = KVLayout(num_layers=1, num_kv_heads=4, head_dim=16, block_size=16)
    with pytest.raises(LayoutError, match="holds 2"):
        Shard(layout=lay, total_kv_heads=8, tp_rank=0, tp_size=4)
    with pytest.raises(LayoutError, match="do not split"):
        Shard(layout=lay, total_kv_heads=6, tp_rank=0, tp_size=4)
    with pytest.raises(LayoutError, match="rank 2 of 2"):
        Shard(layout=lay, total_kv_heads=8, tp_rank=2, tp_size=2)


def test_tp_info_derives_the_shard_and_reshape_for_takes_one_source() -> None:
    from kvstream.transfer.plan import Reshape, TpInfo, reshape_for

    lay4 = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, block_size=16)
    lay2 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=32,
                    arrangement="flash_hnd")
    assert TpInfo().shard(lay4).heads == range(0, 4)
    assert TpInfo(rank=1, size=2).shard(lay2).heads == range(2, 4)  # 2 x 2 = 4 heads
    with pytest.raises(LayoutError, match="holds 1"):
        TpInfo(rank=0, size=4, total_kv_heads=4).shard(lay2)
    r = reshape_for(TpInfo().shard(lay4), TpInfo(rank=1, size=2).shard(lay2), 70)
    assert r == Reshape(tokens=70, src_head=2, dst_head=0, heads=2, dtype="float16")
    assert r.layer_bytes(lay2) == 2 * 70 * 2 * 16 * 2
    with pytest.raises(LayoutError, match="several sources"):
        reshape_for(TpInfo(rank=1, size=2).shard(lay2), TpInfo().shard(lay4), 70)


def _bits(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Random fp16 bit patterns, NaNs (signalling ones too) and infinities among them."""
    return torch.randint(-2 ** 15, 2 ** 15, shape, dtype=torch.int16, generator=gen)


def _slots(lay: KVLayout, t: Cache, blocks: list[int], tokens: int) -> torch.Tensor:
    """``[kv, tokens, heads, d]`` indices of the slots of the request's tokens in ``t``
    (one index per element, counted over ``_flat(t)``): a split layout's rows of K, then
    the same rows of V, written out; the others by plane_views, slot by slot."""
    if lay.split:
        assert isinstance(t, tuple)
        k = torch.arange(t[0].numel()).view(t[0].shape)[_rows(lay, blocks, tokens)]
        return torch.stack([k, k + t[0].numel()])
    assert isinstance(t, torch.Tensor)
    where = torch.stack(plane_views(torch.arange(t.numel()).view(t.shape), lay))
    return torch.stack([where[:, blocks[p // lay.block_size], p % lay.block_size]
                        for p in range(tokens)], dim=1)


@pytest.mark.parametrize("arr", [*ARRANGEMENTS, "mla"])
@pytest.mark.parametrize(("tokens", "offset"),
                         [(37, 0), (32, 0), (5, 0), (37, 2), (32, 6), (37, 8)])
def test_unpack_writes_its_tokens_and_heads_bit_for_bit_and_nothing_else(arr, tokens, offset
                                                                         ) -> None:
    """Against a slot-by-slot reference, on random bits: the whole blocks, the partial last
    block's tokens and only them (the slots past the last token, the other heads and
    blocks keep their bits), and pack reads back what unpack wrote. ``offset`` puts the
    wire at that many bytes into a buffer (a single message's ``[header | wire]``), where
    the wide views cannot be taken."""
    heads, d, first, n = (1, 16, 0, 1) if arr == "mla" else (4, 8, 1, 2)
    lay = KVLayout(num_layers=1, num_kv_heads=heads, head_dim=d, block_size=16,
                   arrangement=arr)
    kv = lay.kv_factor
    gen = torch.Generator().manual_seed(tokens * 10 + offset)
    t = _cache(lay, 6, lambda shape: _bits(gen, shape).view(torch.float16))
    blocks = [4, 1, 5][:-(-tokens // 16)]
    buf = torch.zeros(offset + kv * tokens * n * d * 2, dtype=torch.uint8)
    wire = buf[offset:].view(torch.float16).view(kv, tokens, n, d)
    wire.view(torch.int16).copy_(_bits(gen, (kv, tokens, n, d)))
    want = _flat(t).view(torch.int16)
    want[_slots(lay, t, blocks, tokens)[:, :, first:first + n]] = wire.view(torch.int16)
    unpack(wire, t, lay, blocks, first)
    assert torch.equal(_flat(t).view(torch.int16), want)
    back = torch.zeros(buf.numel(), dtype=torch.uint8)[offset:].view(torch.float16)
    packed = pack(t, lay, blocks, tokens, range(first, first + n),
                  out=back.view(kv, tokens, n, d))
    assert torch.equal(packed.view(torch.int16), wire.view(torch.int16))


@pytest.mark.parametrize("arr", ARRANGEMENTS)
def test_unpack_converts_the_dtype_and_leaves_the_tail_slots(arr) -> None:
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=8, dtype="bfloat16",
                   arrangement=arr)
    gen = torch.Generator().manual_seed(3)
    t = _cache(lay, 4, lambda shape: torch.full(shape, 7.0, dtype=torch.bfloat16))
    wire = torch.randn(2, 13, 2, 8, generator=gen)  # float32
    unpack(wire, t, lay, [2, 0])
    slots = _slots(lay, t, [2, 0], 13)
    want = torch.full_like(_flat(t), 7.0)
    want[slots] = wire.to(torch.bfloat16)
    assert torch.equal(_flat(t), want)


@pytest.mark.parametrize("arr", ARRANGEMENTS)
@pytest.mark.parametrize("d", [8, 7])
def test_an_fp8_cache_unpacks_bit_for_bit(arr, d) -> None:
    """CPU ``index_copy_`` has no FP8 kernel: planes that no wider word fits (vLLM CPU's
    transposed K, an odd head_dim) move as same-size integers."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=d, block_size=4,
                   dtype="float8_e4m3fn", arrangement=arr)
    gen = torch.Generator().manual_seed(5)
    t = _cache(lay, 3, lambda shape: torch.zeros(shape, dtype=torch.float8_e4m3fn))
    wire = torch.randn(2, 6, 2, d, generator=gen).to(torch.float8_e4m3fn)
    unpack(wire, t, lay, [2, 0])
    got = _read(Shard(layout=lay, total_kv_heads=2), t, [2, 0], 6)
    assert torch.equal(got, wire.float())
