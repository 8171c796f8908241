"""The SGLang backend's pure parts (no SGLang needed): its notes decoded with bounds, its
view of SGLang's raw KV buffers, and the aux row written with the room last."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvstream import AdapterError
from kvstream.adapters.sglang import notes
from kvstream.adapters.sglang.memory import AuxRows, kv_buffers, kvs_layout


def test_notes_round_trip_and_garbage_is_none():
    want = notes.Want(room=2**63 + 5, pages=3, prefix_len=16, tp_rank=1, tp_size=2)
    assert notes.decode(notes.WANT, notes.encode(want)) == want
    ready = notes.Ready(room=7, secret="s" * 16, tokens=40, pages=3, aux=[b"a" * 64])
    assert notes.decode(notes.READY, notes.encode(ready)) == ready
    assert notes.decode(notes.READY, notes.encode(want)) is None  # another note's body
    assert notes.decode(notes.WANT, b"\xff\x00garbage") is None
    assert notes.decode("sglang.other", notes.encode(want)) is None
    big = notes.Ready(room=7, secret="s" * 16, tokens=1, pages=1,
                      aux=[b"x" * (notes.MAX_AUX_BYTES // 2 + 1)] * 2)
    assert notes.decode(notes.READY, notes.encode(big)) is None
    neg = notes.encode(notes.Drop(room=1)).replace(b"\x01", b"\xff", 1)
    assert notes.decode(notes.DROP, neg) is None  # room -1


def test_pools_described_by_their_bytes():
    # MHA: 2 layers, K then V, 4 pages of 16 tokens x 2 heads x 8 fp16 (256-byte rows)
    lay, pages = kvs_layout([4 * 16 * 256] * 4, [16 * 256] * 4, 16, mla=False)
    assert (lay.num_layers, lay.head_dim, lay.block_size, lay.arrangement, pages) == \
        (2, 256, 16, "split_nhd", 4)
    mla, n = kvs_layout([5 * 64 * 576] * 3, [64 * 576] * 3, 64, mla=True)
    assert (mla.num_layers, mla.arrangement, n) == (3, "mla", 5)
    for bad in (([100] * 4, [16 * 256] * 4), ([4096] * 3, [4096] * 3),
                ([4096, 4096, 4096, 8192], [4096, 4096, 4096, 8192])):
        with pytest.raises(AdapterError):
            kvs_layout(*bad, 16, mla=False)
    bufs = [torch.arange(4 * 16 * 256, dtype=torch.int32).to(torch.uint8) for _ in range(4)]
    views = kv_buffers([b.data_ptr() for b in bufs], [b.nbytes for b in bufs], lay, pages, "cpu")
    views[1][17, 0, 3] = 201  # page 1, token 1, byte 3 of K of layer 1
    assert bufs[1][17 * 256 + 3] == 201 and views[1].shape == (64, 1, 256)


def test_the_aux_row_lands_with_the_room_last():
    rows, room = 4, 0x1122334455667788
    bufs = [torch.zeros(rows, 16, dtype=torch.int32), torch.zeros(rows, 8, dtype=torch.int64)]
    aux = AuxRows([b.data_ptr() for b in bufs], [b.nbytes for b in bufs],
                  [b[0].nbytes for b in bufs])
    src = [bytes(range(64)), room.to_bytes(8, "little") + bytes(56)]
    order: list[int] = []
    real = ctypes.memmove

    def spy(dst, src_, n):  # which buffer each write lands in, in order
        order.append(next(i for i, b in enumerate(bufs)
                          if b.data_ptr() <= dst < b.data_ptr() + b.nbytes) * 100 + n)
        return real(dst, src_, n)

    ctypes.memmove = spy  # type: ignore[assignment]
    try:
        aux.write(2, src, room)
    finally:
        ctypes.memmove = real  # type: ignore[assignment]
    assert order == [64, 156, 108]  # the other buffer, the room row's rest, the room itself
    assert aux.read(2) == src and not bufs[0][1].any() and bufs[1][2, 0] == room
    with pytest.raises(AdapterError, match="outside"):
        aux.read(rows)
    with pytest.raises(AdapterError, match="no aux buffer row starts with the room"):
        aux.write(1, src, room + 1)
    with pytest.raises(AdapterError):
        aux.write(1, [b"x" * 63, src[1]], room)
    assert not bufs[0][1].any()


def test_side_state_split_decides_what_moves_between_tp_degrees():
    """SGLang's own rules (its mooncake backend): an MLA model's side state is the same on
    every rank; an MHA model's SWA sub-pool is pages of KV heads (NHD only); Mamba state
    and MHA block scales are a rank's own bytes of a split kvstream does not know."""
    import types

    from kvstream.adapters.sglang.state import HEADS, ITEM, REPLICATED, side_groups, split_of

    assert split_of("dsa", mla=True, heads=0, swa_layout=None) == REPLICATED
    assert split_of("mamba", mla=True, heads=0, swa_layout=None) == ITEM
    assert split_of("swa", mla=False, heads=2, swa_layout="nhd") == HEADS
    assert split_of("swa", mla=False, heads=2, swa_layout="hnd") == ITEM
    assert split_of("swa", mla=False, heads=0, swa_layout="nhd") == ITEM  # heads unknown
    assert split_of("block_scale", mla=False, heads=2, swa_layout="nhd") == ITEM

    page = 16 * 2 * 8 * 2  # 16 tokens x 2 heads x 8 fp16
    swa = [torch.zeros(3 * page, dtype=torch.uint8) for _ in range(4)]  # 2 layers, K then V
    odd = torch.zeros(5 * 96, dtype=torch.uint8)  # pages of another size than the main's
    args = types.SimpleNamespace(
        state_types=["swa", "block_scale"], page_size=16, kv_item_lens=[page] * 6,
        state_data_ptrs=[[t.data_ptr() for t in swa], [odd.data_ptr()]],
        state_data_lens=[[t.nbytes for t in swa], [odd.nbytes]],
        state_item_lens=[[page] * 4, [96]], swa_kv_cache_layout="nhd")
    kinds, groups = side_groups(args, "cpu", heads=2)
    assert kinds == ["swa", "block_scale"]
    (g_swa, g_scale) = groups
    assert (g_swa.split, g_swa.items, g_swa.layout.arrangement, g_swa.layout.num_kv_heads,
            g_swa.layout.num_layers, g_swa.layout.block_size) == (HEADS, 3, "split_nhd", 2, 2, 16)
    assert (g_scale.split, g_scale.items, g_scale.layout.head_dim) == (ITEM, 5, 96)
    # SWA pages of another size than the main pool's (other heads): verbatim, equal TP only
    args.kv_item_lens = [2 * page] * 6
    assert side_groups(args, "cpu", heads=2)[1][0].split == ITEM
    # MLA: everything but Mamba is the same on every rank
    args.kv_item_lens = [page] * 6
    assert {g.split for g in side_groups(args, "cpu", mla=True)[1]} == {REPLICATED}


def test_a_gpu_pool_is_wrapped_without_cupy():
    """SGLang's device pools become tensors through the CUDA array interface (torch alone:
    the sglang extra needs no cupy)."""
    from kvstream.adapters.sglang.memory import DeviceBuffer

    assert DeviceBuffer(0x7F0000001000, 4096).__cuda_array_interface__ == {
        "shape": (4096,), "typestr": "|u1", "data": (0x7F0000001000, False), "strides": None,
        "version": 3}
