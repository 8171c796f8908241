"""The parts of a gather (``parts_for``) and the check a source applies to a part it is
asked for (``part_refusal``): pure, no I/O."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstream import LayoutError
from kvstream.layout import KVLayout
from kvstream.transfer.plan import Reshape, TpInfo, part_refusal, parts_for

BASE = {"num_layers": 2, "head_dim": 16, "block_size": 16}


def _shard(total: int, rank: int, size: int, **kw):
    heads = max(1, total // size)
    return TpInfo(rank=rank, size=size, total_kv_heads=total).shard(
        KVLayout(**{**BASE, **kw}, num_kv_heads=heads))


@given(total=st.sampled_from([1, 2, 4, 8, 16]), src_tp=st.sampled_from([1, 2, 4, 8]),
       dst_tp=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_the_parts_fill_every_head_once_and_each_passes_the_sources_check(
        total, src_tp, dst_tp, data):
    if (total % src_tp and src_tp < total) or (total % dst_tp and dst_tp < total):
        return
    dst = _shard(total, data.draw(st.integers(0, dst_tp - 1)), dst_tp)
    sources = [_shard(total, r, src_tp) for r in range(src_tp)]
    parts = parts_for(dst, sources, tokens=40)
    filled: list[int] = []
    for i, r in parts:
        assert part_refusal(r, sources[i], dst) is None
        filled += [sources[i].head_start + r.src_head + k for k in range(r.heads)]
        assert r.dst_head + r.heads <= dst.layout.num_kv_heads
    assert sorted(filled) == list(dst.heads)
    assert len({i for i, _ in parts}) == len(parts)  # one part per source


def test_replicas_send_once():
    """TP 4 over 2 heads: ranks 0, 1 hold head 0; 2, 3 head 1. Decode TP 1 needs ranks 0, 2."""
    parts = parts_for(_shard(2, 0, 1), [_shard(2, r, 4) for r in range(4)], tokens=8)
    assert [(i, r.src_head, r.dst_head, r.heads) for i, r in parts] == [(0, 0, 0, 1),
                                                                        (2, 0, 1, 1)]


def test_a_part_that_is_not_the_same_heads_on_both_sides_is_refused():
    src, dst = _shard(4, 1, 2), _shard(4, 0, 1)  # source holds heads 2, 3
    good = Reshape(tokens=8, src_head=0, dst_head=2, heads=2, dtype="float16")
    assert part_refusal(good, src, dst) is None
    for bad, why in (
            (Reshape(tokens=8, src_head=0, dst_head=0, heads=2, dtype="float16"),
             "is not destination head"),
            (Reshape(tokens=8, src_head=1, dst_head=3, heads=2, dtype="float16"), "outside"),
            (Reshape(tokens=8, src_head=0, dst_head=2, heads=2, dtype="bfloat16"),
             "not the source's"),
    ):
        assert why in (part_refusal(bad, src, dst) or ""), bad
    other = _shard(4, 0, 1, head_dim=32)
    assert "head_dim 16 against 32" in (part_refusal(good, src, other) or "")


def test_sources_that_leave_a_head_empty_are_refused():
    with pytest.raises(LayoutError, match="no source holds KV head 2"):
        parts_for(_shard(4, 0, 1), [_shard(4, 0, 2)], tokens=8)
