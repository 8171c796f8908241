"""Same-host reads (issue 17): what may be mapped, what is refused, when mappings go,
and the destination's choice of path."""

from __future__ import annotations

import fcntl
import gc
import os

import msgspec
import pytest
import torch

from kvstream import shm
from kvstream._exceptions import LayoutError
from kvstream.dataplane.paths import choose, host_identity, label
from kvstream.dataplane.peermem import MappedSource, PeerMaps
from kvstream.shm import Segment, SharedExport, SharedKV, export
from tests.fakes import small_layout


def _shared(num_blocks: int = 8) -> tuple[SharedKV, SharedExport]:
    lay = small_layout()
    kv = SharedKV.create(lay, num_blocks)
    for i, t in enumerate(kv.layers):
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.arange(flat.numel(), dtype=torch.int64).add(i * 7).remainder(251)
                   .to(torch.uint8))
    ex = export(kv.layers, num_blocks)
    assert ex is not None
    return kv, ex


def test_shared_kv_is_sealed_and_exported() -> None:
    kv, ex = _shared()
    seg = ex.segments[0]
    assert ex.pid == os.getpid() and len(ex.segments) == 1 and len(ex.layers) == len(kv.layers)
    assert [off for _, off in ex.layers] == [i * kv.spec.layer_bytes for i in range(len(kv.layers))]
    seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    with pytest.raises(PermissionError):
        os.ftruncate(seg.fd, 0)  # nobody can shrink it under a reader
    kv.close()
    assert export(kv.layers, 8) is None or not kv.layers


def test_plain_tensors_are_not_exported() -> None:
    lay = small_layout()
    assert export([torch.zeros(lay.tensor_shape(4), dtype=torch.float16)], 4) is None


def test_segment_lives_as_long_as_its_tensors() -> None:
    lay = small_layout()
    layers = SharedKV.create(lay, 4).layers  # the SharedKV object itself is dropped
    gc.collect()
    assert export(layers, 4) is not None
    ex = export(layers, 4)
    fd = ex.segments[0].fd
    del layers
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with its last tensor: peers cannot open it any more


def test_mapped_source_copies_scattered_blocks_bit_for_bit() -> None:
    kv, ex = _shared(16)
    lay = kv.spec.layout
    maps = PeerMaps()
    peer = maps.acquire(ex, kv.spec.layer_bytes, lay.num_layers)
    src_ids, dst_ids = [5, 0, 9, 15], [2, 11, 3, 7]
    planes = lay.chunks_per_block
    source = MappedSource(maps, peer, src_ids, planes=planes, chunk_bytes=lay.chunk_bytes)
    dst = [torch.zeros_like(t) for t in kv.layers]
    for layer, t in enumerate(dst):
        source.copy_layer(layer, t.data_ptr(), t.numel() * t.element_size(),
                          source.dst_offsets(16, dst_ids))
        s = kv.layers[layer].view(torch.uint8).view(planes, 16, -1)
        d = t.view(torch.uint8).view(planes, 16, -1)
        for sb, db in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(s[:, sb], d[:, db])
        untouched = [b for b in range(16) if b not in dst_ids]
        assert not d[:, untouched].any()
    source.release()
    maps.drop()
    assert maps.mapped_bytes == 0


def test_out_of_range_source_blocks_are_refused() -> None:
    kv, ex = _shared(8)
    maps = PeerMaps()
    peer = maps.acquire(ex, kv.spec.layer_bytes, kv.spec.layout.num_layers)
    with pytest.raises(LayoutError, match="outside"):
        MappedSource(maps, peer, [1, 8], planes=kv.spec.layout.chunks_per_block,
                     chunk_bytes=kv.spec.layout.chunk_bytes)
    maps.release(peer)


@pytest.mark.parametrize("forge", ["inode", "size", "fd", "pid", "layers", "offset"])
def test_forged_exports_are_refused(forge: str) -> None:
    kv, ex = _shared(8)
    seg = ex.segments[0]
    bad = {
        "inode": lambda: msgspec.structs.replace(ex, segments=[Segment(seg.fd, seg.inode + 1,
                                                                       seg.size)]),
        "size": lambda: msgspec.structs.replace(ex, segments=[Segment(seg.fd, seg.inode,
                                                                      seg.size * 2)]),
        "fd": lambda: msgspec.structs.replace(ex, segments=[Segment(0, seg.inode, seg.size)]),
        "pid": lambda: msgspec.structs.replace(ex, pid=(1 << 22) + 12345),
        "layers": lambda: msgspec.structs.replace(ex, layers=ex.layers[:-1]),
        "offset": lambda: msgspec.structs.replace(ex, layers=[(0, seg.size)] * len(ex.layers)),
    }[forge]()
    maps = PeerMaps()
    with pytest.raises(LayoutError):
        maps.acquire(bad, kv.spec.layer_bytes, kv.spec.layout.num_layers)
    assert maps.mapped_bytes == 0


def test_an_unsealed_file_is_refused(tmp_path) -> None:
    """A segment that could shrink would turn a read into SIGBUS: never mapped."""
    path = tmp_path / "kv"
    path.write_bytes(b"\0" * 4096)
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(LayoutError, match="seal"):
            shm.open_segment(os.getpid(), Segment(fd, os.fstat(fd).st_ino, 4096), writable=False)
        memfd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
        os.ftruncate(memfd, 4096)
        with pytest.raises(LayoutError, match="sealed"):
            shm.open_segment(os.getpid(), Segment(memfd, os.fstat(memfd).st_ino, 4096),
                             writable=False)
        os.close(memfd)
    finally:
        os.close(fd)


def test_mappings_are_shared_counted_and_dropped_once_unused() -> None:
    kv, ex = _shared(8)
    maps = PeerMaps()
    a = maps.acquire(ex, kv.spec.layer_bytes, kv.spec.layout.num_layers)
    b = maps.acquire(ex, kv.spec.layer_bytes, kv.spec.layout.num_layers)
    assert a is b and a.users == 2 and maps.mapped_bytes == kv.spec.size
    maps.drop_except(set())  # the peer is gone ...
    assert a.dropped and a.layer(0)  # ... but two transfers still read: still mapped
    maps.release(a)
    maps.release(b)
    assert a.users == 0 and maps.mapped_bytes == 0


def test_mapping_bound_is_enforced() -> None:
    kv, ex = _shared(8)
    maps = PeerMaps(max_bytes=kv.spec.size - 1)
    with pytest.raises(LayoutError, match="too much"):
        maps.acquire(ex, kv.spec.layer_bytes, kv.spec.layout.num_layers)


def test_choice_of_path() -> None:
    every = ("shm", "cuda_ipc", "tcp", "ucx")
    kw = dict(device="cpu", codec="none", peer_tcp=True, own_tcp=True)
    assert choose(every, same_host=True, can_map=True, **kw) == "shm"
    assert choose(every, same_host=True, can_map=False, **kw) == "ucx"
    assert choose(every, same_host=True, can_map=True, **{**kw, "codec": "int8"}) == "ucx"
    assert choose(("tcp", "ucx"), same_host=True, can_map=True, **kw) == "ucx"
    assert choose(every, same_host=False, can_map=False, **kw) == "tcp"
    assert choose(every, same_host=False, can_map=False, **{**kw, "peer_tcp": False}) == "ucx"
    assert choose(("shm", "ucx"), same_host=False, can_map=False, **kw) == "ucx"
    assert label("shm", same_host=True) == "shm"
    assert label("ucx", same_host=False) in ("ucx_tcp", "ucx_rdma")


def test_host_identity() -> None:
    assert host_identity("h1") == "h1"
    mine = host_identity()
    assert mine and mine == host_identity()


def test_a_segment_proves_its_owner_bound_to_one_transfer() -> None:
    """The export is public (announced); the trailer's secret never leaves its processes,
    and a proof binds sender, destination and transfer: a destination cannot replay it."""
    kv, ex = _shared(8)
    ctx = shm.proof_context("a", "m", "t1")
    proofs = shm.proofs_of(ex, ctx)
    assert len(proofs) == 1 and len(proofs[0]) == 32
    maps = PeerMaps()
    peer = maps.acquire(ex, kv.spec.layer_bytes, kv.spec.layout.num_layers, proofs, ctx)
    assert peer.holds(proofs, ctx)
    assert not peer.holds(proofs, shm.proof_context("m", "d2", "t1"))  # replayed by m
    assert not peer.holds(proofs, shm.proof_context("a", "m", "t2"))
    assert not peer.holds([bytes(32)], ctx) and not peer.holds([], ctx)
    maps.release(peer)
    _other, other_ex = _shared(8)  # kept alive: its segment stays listed
    assert shm.proofs_of(other_ex, ctx) != proofs  # one secret per segment


def test_a_forgers_mapping_is_never_kept_for_honest_transfers() -> None:
    """Mapped with another export's layer offsets and a bad proof: refused and dropped,
    so an honest transfer of the same segments later reads its own offsets."""
    kv, ex = _shared(8)
    lay = kv.spec.layout
    ctx = shm.proof_context("a", "d", "t")
    forged = msgspec.structs.replace(ex, layers=list(reversed(ex.layers)))
    maps = PeerMaps()
    with pytest.raises(LayoutError, match="does not hold"):
        maps.acquire(forged, kv.spec.layer_bytes, lay.num_layers, [bytes(32)], ctx)
    assert maps.mapped_bytes == 0
    peer = maps.acquire(ex, kv.spec.layer_bytes, lay.num_layers, shm.proofs_of(ex, ctx), ctx)
    assert [peer.layer(i) - peer.layer(0) for i in range(lay.num_layers)] == \
        [off for _, off in ex.layers]
    maps.release(peer)


def test_fifos_empty_and_unused_segments_are_refused(tmp_path) -> None:
    kv, ex = _shared(8)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    keep = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, no writer: open() would block
    try:
        st = os.stat(fifo)
        with pytest.raises(LayoutError):
            shm.open_segment(os.getpid(), Segment(keep, st.st_ino, st.st_size), writable=False)
    finally:
        os.close(keep)
    maps = PeerMaps()
    empty = msgspec.structs.replace(ex, segments=[Segment(ex.segments[0].fd,
                                                          ex.segments[0].inode, 0)])
    with pytest.raises(LayoutError):
        maps.acquire(empty, 0, kv.spec.layout.num_layers)
    _extra, extra = _shared(8)
    unused = msgspec.structs.replace(ex, segments=[*ex.segments, *extra.segments])
    with pytest.raises(LayoutError, match="no layer"):
        maps.acquire(unused, kv.spec.layer_bytes, kv.spec.layout.num_layers)
    assert maps.mapped_bytes == 0
