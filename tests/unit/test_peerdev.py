"""The same-host GPU path (issue 17) without a GPU: ``PeerDevMaps`` over a fake opener and
the CPU block copy, what is refused, when openings close, and the destination's choice of
``cuda_ipc`` (the real CUDA run is tests/gpu/test_cuda_ipc_path.py)."""

from __future__ import annotations

import os
import time
import types

import anyio
import msgspec
import pytest
import torch

from kvstream._exceptions import DataPlaneError, LayoutError, MessageDecodeError, ProtocolError
from kvstream.config import AgentConfig
from kvstream.control import messages as m
from kvstream.control.registry import Registry
from kvstream.cuda_ipc import DeviceExport, DeviceOffer, IpcHandle
from kvstream.dataplane.blockcopy import copy_blocks
from kvstream.dataplane.peerdev import PeerDevMaps
from kvstream.dataplane.peermem import MappedSource
from kvstream.engine.paths import DataPaths
from tests.fakes import cache, small_layout

UUID = bytes(range(16))


class FakeMapping:
    def __init__(self, tensor: torch.Tensor, h: IpcHandle, device: int, log: list) -> None:
        self.ptr, self.size, self.device = tensor.data_ptr() + h.offset, h.size, device
        self._log = log
        self.closed = False

    def close(self) -> None:
        assert not self.closed
        self.closed = True
        self._log.append(("close", self.ptr))


class Opener:
    """Handles name CPU tensors by index (handle bytes = the index, padded)."""

    def __init__(self, tensors: list[torch.Tensor], fail_at: int | None = None) -> None:
        self.tensors, self.fail_at = tensors, fail_at
        self.log: list = []
        self.open: list[FakeMapping] = []

    def __call__(self, h: IpcHandle, device: int) -> FakeMapping:
        i = int.from_bytes(h.handle[:4], "little")
        if i == self.fail_at:
            raise DataPlaneError("cudaIpcOpenMemHandle failed (fake)")
        mm = FakeMapping(self.tensors[i], h, device, self.log)
        self.log.append(("open", i, device))
        self.open.append(mm)
        return mm

    @property
    def still_open(self) -> int:
        return sum(not mm.closed for mm in self.open)


def _copier(dst_ptr, dst_size, dst_off, src_ptr, src_size, src_off, nbytes, device) -> None:
    copy_blocks(dst_ptr, dst_size, dst_off, src_ptr, src_size, src_off, nbytes)


def _export(tensors: list[torch.Tensor], num_blocks: int, **kw) -> DeviceExport:
    layers = []
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        fields = {"handle": i.to_bytes(4, "little") * 16, "offset": 0, "size": nbytes,
                  "alloc_size": nbytes, "device": 0, "device_uuid": UUID}
        fields.update(kw.get("layer", {}).get(i, {}))
        layers.append(IpcHandle(**fields))
    return DeviceExport(pid=kw.get("pid", 4242), num_blocks=num_blocks, layers=layers,
                        epoch=kw.get("epoch", 0))


def _setup(num_blocks: int = 16, fail_at: int | None = None):
    lay = small_layout()
    src = cache(lay, num_blocks, fill=True)
    opener = Opener(src, fail_at)
    maps = PeerDevMaps(opener=opener, copier=_copier, background_close=False)
    maps.use_device(3)
    return lay, src, opener, maps


def test_device_source_copies_scattered_blocks_bit_for_bit() -> None:
    lay, src, opener, maps = _setup()
    ex = _export(src, 16)
    kv = maps.acquire(ex, 16 * lay.block_bytes, lay.num_layers)
    assert [e for e in opener.log if e[0] == "open"] == [("open", i, 3) for i in range(4)]
    src_ids, dst_ids = [5, 0, 9, 15], [2, 11, 3, 7]
    planes = lay.chunks_per_block
    source = MappedSource(maps, kv, src_ids, planes=planes, chunk_bytes=lay.chunk_bytes)
    dst = cache(lay, 12, fill=False)
    for layer, t in enumerate(dst):
        source.copy_layer(layer, t.data_ptr(), t.numel() * t.element_size(),
                          source.dst_offsets(12, dst_ids))
        s = src[layer].view(torch.uint8).view(planes, 16, -1)
        d = t.view(torch.uint8).view(planes, 12, -1)
        for sb, db in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(s[:, sb], d[:, db])
        assert not d[:, [b for b in range(12) if b not in dst_ids]].any()
    source.release()
    with pytest.raises(LayoutError, match="ended before"):
        source.copy_layer(0, dst[0].data_ptr(), dst[0].nbytes, source.dst_offsets(12, dst_ids))
    assert opener.still_open == 4  # cached for the next transfer
    maps.drop()
    assert opener.still_open == 0 and maps.mapped_bytes == 0


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"layer": {2: {"size": 100, "alloc_size": 100}}}, LayoutError, "another size"),
    ({"layer": {1: {"device_uuid": b"\xff" * 16}}}, LayoutError, "several GPUs"),
    ({"layer": {0: {"handle": b"short"}}}, ProtocolError, "5-byte handle"),
    ({"layer": {3: {"offset": 8}}}, ProtocolError, "outside an allocation"),
])
def test_bad_exports_are_refused_before_anything_is_opened(kw, error, match) -> None:
    lay, src, opener, maps = _setup()
    with pytest.raises(error, match=match):
        maps.acquire(_export(src, 16, **kw), 16 * lay.block_bytes, lay.num_layers)
    assert not opener.log and maps.mapped_bytes == 0


def test_layer_count_and_block_ids_are_checked() -> None:
    lay, src, _opener, maps = _setup()
    with pytest.raises(LayoutError, match="layers"):
        maps.acquire(_export(src[:3], 16), 16 * lay.block_bytes, lay.num_layers)
    kv = maps.acquire(_export(src, 16), 16 * lay.block_bytes, lay.num_layers)
    with pytest.raises(LayoutError, match="outside"):
        MappedSource(maps, kv, [3, 16], planes=lay.chunks_per_block, chunk_bytes=lay.chunk_bytes)
    maps.release(kv)


def test_a_failed_open_closes_what_it_opened_and_keeps_nothing() -> None:
    lay, src, opener, maps = _setup(fail_at=2)
    with pytest.raises(DataPlaneError, match="fake"):
        maps.acquire(_export(src, 16), 16 * lay.block_bytes, lay.num_layers)
    assert len(opener.open) == 2 and opener.still_open == 0 and maps.mapped_bytes == 0


def test_openings_are_shared_counted_and_closed_once_unused() -> None:
    lay, src, opener, maps = _setup()
    ex = _export(src, 16)
    a = maps.acquire(ex, 16 * lay.block_bytes, lay.num_layers)
    b = maps.acquire(ex, 16 * lay.block_bytes, lay.num_layers)
    assert a is b and len(opener.open) == 4
    maps.drop(ex.pid)  # the peer left: closed once its last transfer is done
    assert opener.still_open == 4
    maps.release(a)
    assert opener.still_open == 4
    maps.release(b)
    assert opener.still_open == 0
    c = maps.acquire(ex, 16 * lay.block_bytes, lay.num_layers)
    maps.release(c)
    maps.use_device(5)  # our KV moved to another GPU: nothing opened for the old stays
    assert opener.still_open == 0 and maps.device == 5


def test_openings_close_on_a_thread_of_their_own() -> None:
    lay, src, opener, _ = _setup()
    maps = PeerDevMaps(opener=opener, copier=_copier)  # closes in the background
    maps.release(maps.acquire(_export(src, 16), 16 * lay.block_bytes, lay.num_layers))
    maps.drop()
    deadline = time.monotonic() + 10  # a thread's hop, with a wide margin
    while opener.still_open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert opener.still_open == 0


def test_the_bound_on_peers_holds() -> None:
    lay, src, opener, _ = _setup()
    maps = PeerDevMaps(max_peers=1, opener=opener, copier=_copier, background_close=False)
    held = maps.acquire(_export(src, 16, pid=1), 16 * lay.block_bytes, lay.num_layers)
    with pytest.raises(LayoutError, match="too much"):
        maps.acquire(_export(src, 16, pid=2), 16 * lay.block_bytes, lay.num_layers)
    maps.release(held)  # idle now: evicted for the next peer
    maps.release(maps.acquire(_export(src, 16, pid=2), 16 * lay.block_bytes, lay.num_layers))


def test_device_exports_travel_in_manifests_and_are_bounded() -> None:
    _lay, src, _, _ = _setup()
    ex = _export(src, 16)
    man = m.Manifest(transfer_id="t", request_id="r", src="p", dst="d", src_address=b"a",
                     src_tag=1, fingerprint="f", num_layers=4, src_blocks=[1], path="cuda_ipc",
                     src_device=ex)
    assert m.decode(m.encode(man)) == man
    old = m.decode(m.encode(msgspec.structs.replace(man, src_device=None)))
    assert old.src_device is None
    raw = msgspec.msgpack.decode(m.encode(man))
    raw["src_device"]["layers"][0]["handle"] = b"x" * 65
    with pytest.raises(MessageDecodeError, match="length"):
        m.decode(msgspec.msgpack.encode(raw))
    ann = m.Announce(instance_id="p", role="prefill", worker_address=b"a", cuda_ipc=ex.offer)
    assert m.decode(m.encode(ann)).cuda_ipc == ex.offer


# ---- the destination's choice and the source's refusal ----

def _offer(pid: int = 4242, epoch: int = 1) -> DeviceOffer:
    return DeviceOffer(pid=pid, epoch=epoch, gpu=UUID)


def _paths(opener: Opener | None = None, host: str = "h1", **kw) -> DataPaths:
    cfg = AgentConfig(instance_id="me", host_id=host, tcp_listen="off", **kw)
    paths = DataPaths(cfg, Registry(peer_timeout_s=1.0))
    paths.ipc.reachable = lambda gpu: gpu == UUID  # type: ignore[method-assign]
    if opener is not None:
        paths.ipc.maps = PeerDevMaps(opener=opener, copier=_copier, background_close=False)
    return paths


def _cuda_mem(lay) -> types.SimpleNamespace:
    return types.SimpleNamespace(device=torch.device("cuda", 0), layout=lay, num_blocks=16)


def _choose(paths: DataPaths, mem, **kw) -> str:
    async def go() -> str:
        choice = await paths.choose(peer="p", peer_host=kw.pop("peer_host", "h1"),
                                    peer_tcp=b"", peer_shared=None, mem=mem,
                                    codec=kw.pop("codec", "none"), **kw)
        choice.release()
        return choice.path
    return anyio.run(go)


def test_cuda_ipc_is_chosen_for_same_host_device_kv_only() -> None:
    lay = small_layout()
    paths, mem = _paths(), _cuda_mem(lay)
    assert _choose(paths, mem, peer_offer=_offer()) == "cuda_ipc"  # a pull: opened later
    assert _choose(paths, mem, peer_offer=None) == "ucx"  # the peer offers none
    assert _choose(paths, mem, peer_offer=_offer(pid=os.getpid())) == "ucx"  # our own process
    assert _choose(paths, mem, peer_offer=_offer(), peer_host="h2") == "ucx"
    assert _choose(paths, mem, peer_offer=_offer(), codec="int8") == "ucx"
    far = DeviceOffer(pid=4242, epoch=1, gpu=b"\xee" * 16)  # not visible or not reachable
    assert _choose(paths, mem, peer_offer=far) == "ucx"
    cpu = types.SimpleNamespace(device=torch.device("cpu"), layout=lay, num_blocks=16)
    assert _choose(paths, cpu, peer_offer=_offer()) == "ucx"
    assert _choose(_paths(paths=("shm", "tcp", "ucx")), mem, peer_offer=_offer()) == "ucx"


def test_a_push_opens_only_the_announced_device_kv() -> None:
    lay, src, opener, _ = _setup()
    paths, mem = _paths(opener), _cuda_mem(lay)
    ex = _export(src, 16)  # pid 4242, epoch 0
    assert _choose(paths, mem, peer_device=ex, peer_offer=None) == "ucx"
    assert _choose(paths, mem, peer_device=ex, peer_offer=_offer(epoch=5)) == "ucx"
    assert _choose(paths, mem, peer_device=ex, peer_offer=_offer(pid=7, epoch=0)) == "ucx"
    assert not opener.log  # someone else's memory, or an old registration: never opened
    assert _choose(paths, mem, peer_device=ex, peer_offer=ex.offer) == "cuda_ipc"
    assert opener.still_open == 4  # released by the choice, cached for the next push
    paths.forget("p", None)  # the peer left, or announced another registration
    assert opener.still_open == 0


def test_a_registration_that_failed_to_open_is_not_tried_again() -> None:
    lay, src, _, _ = _setup()
    failing = Opener(src, fail_at=0)
    paths, mem = _paths(failing), _cuda_mem(lay)
    ex = _export(src, 16, pid=99)
    assert _choose(paths, mem, peer_device=ex, peer_offer=ex.offer) == "ucx"
    assert _choose(paths, mem, peer_offer=ex.offer) == "ucx"  # a pull does not pick it
    assert _choose(paths, mem, peer_offer=_offer(pid=99, epoch=9)) == "cuda_ipc"  # re-registered
    paths.forget("p", None)
    assert _choose(paths, mem, peer_offer=ex.offer) == "cuda_ipc"  # forgotten with the peer


def test_a_full_table_is_not_held_against_the_peer() -> None:
    lay, src, opener, _ = _setup()
    paths, mem = _paths(), _cuda_mem(lay)
    paths.ipc.maps = PeerDevMaps(max_bytes=1, opener=opener, copier=_copier,
                                 background_close=False)
    ex = _export(src, 16)
    assert _choose(paths, mem, peer_device=ex, peer_offer=ex.offer) == "ucx"  # too much open
    assert _choose(paths, mem, peer_offer=ex.offer) == "cuda_ipc"


def _announce(paths: DataPaths, peer: str, host: str, offer: DeviceOffer | None) -> None:
    paths.registry.observe(m.Announce(instance_id=peer, role="decode", worker_address=b"a",
                                      host=host, cuda_ipc=offer))


def test_the_source_sends_handles_only_to_same_host_cuda_ipc_peers() -> None:
    _lay, src, _, _ = _setup()
    paths = _paths()
    _announce(paths, "d", "h1", _offer())
    assert paths.refusal("cuda_ipc", peer="d", peer_tcp=b"", codec="none") \
        is not None  # nothing exported (host KV here)
    paths.ipc.export = _export(src, 16, pid=os.getpid())
    assert paths.ipc.offer == paths.ipc.export.offer
    assert paths.refusal("cuda_ipc", peer="d", peer_tcp=b"", codec="none") is None
    assert paths.refusal("cuda_ipc", peer="d", peer_tcp=b"", codec="none", sent_device=False)
    assert paths.refusal("cuda_ipc", peer="d", peer_tcp=b"", codec="fp8_e4m3")
    assert paths.device_for("d") is paths.ipc.export
    assert paths.device_for("d", codec="int8") is None
    assert paths.device_for("d", path="ucx") is None
    assert paths.device_for("nobody") is None  # not announced: no host to trust
    for peer, host, offer in (("far", "h2", _offer()), ("plain", "h1", None),
                              ("self", "h1", _offer(pid=os.getpid()))):
        _announce(paths, peer, host, offer)
        assert paths.device_for(peer) is None, peer
        assert paths.refusal("cuda_ipc", peer=peer, peer_tcp=b"", codec="none"), peer
    paths.unregister()
    assert paths.ipc.export is None and paths.ipc.offer is None


def test_prune_closes_the_device_kv_of_silent_peers() -> None:
    lay, src, opener, _ = _setup()
    paths, mem = _paths(opener), _cuda_mem(lay)
    ex = _export(src, 16)
    assert _choose(paths, mem, peer_device=ex, peer_offer=ex.offer) == "cuda_ipc"
    paths.prune(set(), {"p"})
    assert opener.still_open == 4
    paths.prune(set(), set())
    assert opener.still_open == 0
