"""The batched block copy (kvstream.dataplane.blockcopy, csrc/blockcopy.c) against the torch
reference ``dst[dst_idx] = src[src_idx]`` bit for bit, its refusals, layer_items, the
ctypes.memmove fallback; and kvstream.cuda_ipc's handle checks over a fake cupy."""

from __future__ import annotations

import contextlib
import logging
import sys
import types

import msgspec
import numpy as np
import pytest
import torch

from kvstream import cuda_ipc
from kvstream._exceptions import ConfigError, DataPlaneError, InvalidBlockError, LayoutError, ProtocolError
from kvstream.dataplane import blockcopy
from kvstream.memory import RegisteredKV
from tests.fakes import cache, small_layout

STRATEGIES = ("auto", "memcpy", "stream", "python")
# (items, bytes each): single bytes, odd sizes, under and over a vector, 32 KiB blocks, and
# 80 x 32 KiB (2.5 MiB: past the L2 of the machines here, so "auto" streams).
CASES = ((1, 1), (7, 3), (33, 17), (20, 64), (12, 1000), (16, 4096), (9, 32768 + 5), (80, 32768))


def reference(dst: torch.Tensor, src: torch.Tensor, dst_off: np.ndarray, src_off: np.ndarray,
              nbytes: int) -> torch.Tensor:
    """dst[dst_idx] = src[src_idx] with the items' byte indices."""
    out = dst.clone()
    k = torch.arange(nbytes)
    out[torch.from_numpy(dst_off)[:, None] + k] = src[torch.from_numpy(src_off)[:, None] + k]
    return out


def scattered(rng: np.random.Generator, n: int, nbytes: int, aligned: bool) -> tuple[np.ndarray, int]:
    """n offsets of disjoint items in shuffled slots, at odd shifts unless ``aligned``;
    and the buffer size they need."""
    slot = nbytes + (0 if aligned else 13)
    shift = 0 if aligned else rng.integers(0, 13, n)
    return (rng.permutation(n) * slot + shift).astype(np.int64), n * slot


def buffers(rng: np.random.Generator, n: int, nbytes: int, aligned: bool):
    dst_off, dst_size = scattered(rng, n, nbytes, aligned)
    src_off, src_size = scattered(rng, n + 3, nbytes, aligned)
    src_off = src_off[:n]
    src = torch.from_numpy(rng.integers(0, 256, src_size + 5, dtype=np.uint8))
    dst = torch.from_numpy(rng.integers(0, 256, dst_size + 5, dtype=np.uint8))
    return dst, dst_off, src, src_off


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("n", "nbytes"), CASES)
def test_matches_torch_reference(n: int, nbytes: int, strategy: str) -> None:
    rng = np.random.default_rng(n * 7919 + nbytes)
    for aligned in (True, False):
        dst, dst_off, src, src_off = buffers(rng, n, nbytes, aligned)
        # The unaligned case also starts both buffers at odd addresses (base + 5 and + 3).
        db, sb = (0, 0) if aligned else (5, 3)
        want = dst.clone()
        want[db:] = reference(dst[db:], src[sb:], dst_off, src_off, nbytes)
        blockcopy.copy_blocks(dst.data_ptr() + db, dst.nbytes - db, dst_off, src.data_ptr() + sb,
                              src.nbytes - sb, src_off, nbytes, strategy=strategy)
        assert torch.equal(dst, want), (aligned, int((dst != want).sum()))


def test_the_c_library_builds_here() -> None:
    """CI has a compiler: the fallback must not hide a broken kernel."""
    lib = blockcopy.load()
    assert lib is not None
    assert lib.stream_threshold > 0


def test_items_at_the_very_end_fit() -> None:
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    off = np.array([64 - 8, 0], dtype=np.int64)
    blockcopy.copy_blocks(dst.data_ptr(), 64, off, src.data_ptr(), 64, off[::-1].copy(), 8)
    assert dst[56:].tolist() == list(range(8)) and dst[:8].tolist() == list(range(56, 64))


BAD = {  # side, offset of the last of four items
    "dst_negative": ("dst", -1),
    "dst_one_past": ("dst", 4096 - 63),
    "src_one_past": ("src", 4096 - 63),
    "src_negative": ("src", -4096),
    "dst_overflowing": ("dst", 2 ** 63 - 10),  # off + nbytes wraps in int64
    "src_huge": ("src", 2 ** 40),
}


@pytest.mark.parametrize("strategy", ("auto", "python"))
@pytest.mark.parametrize("case", BAD)
def test_out_of_bounds_is_refused_and_nothing_written(case: str, strategy: str) -> None:
    side, bad = BAD[case]
    src = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    dst = torch.full((4096,), 0xA5, dtype=torch.uint8)
    good = np.array([0, 128, 256, 512], dtype=np.int64)
    dst_off, src_off = good.copy(), good[::-1].copy()
    (dst_off if side == "dst" else src_off)[3] = bad
    with pytest.raises(InvalidBlockError, match="outside the") as err:
        blockcopy.copy_blocks(dst.data_ptr(), 4096, dst_off, src.data_ptr(), 4096, src_off, 64,
                              strategy=strategy)
    assert err.value.block_ids == (3,) and err.value.limit == 4096
    assert bool((dst == 0xA5).all())


def test_the_c_kernel_checks_every_item_before_copying() -> None:
    """Past the Python checks, C refuses the same batches by itself: nothing written."""
    lib = blockcopy.load()
    assert lib is not None
    src = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    ok = np.array([0, 64, 128], dtype=np.int64)
    for d_last, s_last, nbytes, rc in ((193, 0, 64, -2), (0, 2 ** 63 - 1, 64, -3), (-1, 0, 64, -2),
                                       (0, 0, -1, -1)):
        d, s = ok.copy(), ok.copy()
        d[2], s[2] = d_last, s_last
        assert lib.copy(dst.data_ptr(), 256, d, src.data_ptr(), 256, s, nbytes) == rc
        assert bool((dst == 0).all())
    assert lib.copy(dst.data_ptr(), 256, ok, src.data_ptr(), 256, ok[::-1].copy(), 64) == 0
    assert torch.equal(dst[:192], torch.cat([src[128:192], src[64:128], src[:64]]))


def test_empty_batches_copy_nothing() -> None:
    none = np.zeros(0, dtype=np.int64)
    blockcopy.copy_blocks(0, 0, none, 0, 0, none, 4096)  # no pointer is touched
    blockcopy.copy_blocks(0, 0, [0, 0], 0, 0, [0, 0], 0)
    lib = blockcopy.load()
    assert lib is not None and lib.copy(0, 0, none, 0, 0, none, 64) == 0


def test_malformed_arguments() -> None:
    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(InvalidBlockError, match="one-dimensional"):
        blockcopy.copy_blocks(0, 8, np.zeros((1, 1), dtype=np.int64), 0, 8, one, 1)
    with pytest.raises(InvalidBlockError, match="2 destination offsets for 1"):
        blockcopy.copy_blocks(0, 8, [0, 1], 0, 8, one, 1)
    with pytest.raises(InvalidBlockError, match="negative"):
        blockcopy.copy_blocks(0, 8, one, 0, 8, one, -1)
    with pytest.raises(ConfigError, match="unknown block copy strategy"):
        blockcopy.copy_blocks(0, 8, one, 0, 8, one, 1, strategy="dma")


def test_layer_items_copy_a_layer_between_caches_of_other_sizes() -> None:
    lay = small_layout(layers=2)
    src = RegisteredKV(lay, cache(lay, 12, fill=True))
    dst = RegisteredKV(lay, cache(lay, 7, fill=False))
    sids, dids = [11, 0, 5, 3], [6, 2, 0, 4]
    for layer in range(2):
        s_off, d_off = blockcopy.layer_items(lay.chunks_per_block, lay.chunk_bytes, 12, sids, 7, dids)
        assert len(s_off) == len(d_off) == lay.chunks_per_block * len(sids)
        s, d = src.layers[layer], dst.layers[layer]
        blockcopy.copy_blocks(d.data_ptr(), d.nbytes, d_off, s.data_ptr(), s.nbytes, s_off,
                              lay.chunk_bytes)
        for a, b in zip(sids, dids, strict=True):
            assert torch.equal(dst.read_block(layer, b), src.read_block(layer, a))
        for b in {1, 3, 5}:
            assert not bool(dst.read_block(layer, b).any())


def test_layer_items_offsets() -> None:
    s, d = blockcopy.layer_items(2, 100, 10, np.array([3, 9]), 4, [1, 0])
    assert s.tolist() == [300, 900, 1300, 1900] and d.tolist() == [100, 0, 500, 400]
    assert s.dtype == d.dtype == np.int64 and s.flags.c_contiguous


@pytest.mark.parametrize(("args", "match"), [
    ((2, 8, 10, [3, 10], 4, [0, 1]), r"source block ids \[10\] outside 10"),
    ((2, 8, 10, [3, 1], 4, [0, -1]), r"destination block ids \[-1\]"),
    ((2, 8, 10, [3, 1], 4, [2, 2]), "duplicate destination"),
    ((2, 8, 10, [3, 1, 2], 4, [2, 0]), "3 source blocks for 2"),
    ((0, 8, 10, [3], 4, [2]), "bad layer geometry"),
    ((1, 8, 10, [1.5], 4, [2]), "flat list of integers"),
])
def test_layer_items_refuses(args: tuple, match: str) -> None:
    with pytest.raises(InvalidBlockError, match=match):
        blockcopy.layer_items(*args)


def test_fallback_without_the_source_warns_once(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setattr(blockcopy, "source_path", lambda: tmp_path / "missing.c")
    monkeypatch.setattr(blockcopy._load, "_tried", False)
    monkeypatch.setattr(blockcopy._load, "_value", None)
    rng = np.random.default_rng(3)
    dst, dst_off, src, src_off = buffers(rng, 5, 300, aligned=False)
    want = reference(dst, src, dst_off, src_off, 300)
    with caplog.at_level(logging.WARNING, logger="kvstream.dataplane"):
        for _ in range(2):
            blockcopy.copy_blocks(dst.data_ptr(), dst.nbytes, dst_off, src.data_ptr(), src.nbytes,
                                  src_off, 300)
    assert torch.equal(dst, want)
    assert [r.message for r in caplog.records].count(
        "C block copy unavailable, copying with ctypes.memmove: "
        f"{tmp_path / 'missing.c'} not found (kvstream installed without csrc/)") == 1
    assert len(caplog.records) == 1


def test_fallback_without_a_compiler(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVSTREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(blockcopy._load, "_tried", False)
    monkeypatch.setattr(blockcopy._load, "_value", None)
    with caplog.at_level(logging.WARNING, logger="kvstream.dataplane"):
        assert blockcopy.load() is None
    assert "C block copy unavailable" in caplog.text


# ---- kvstream.cuda_ipc over a fake cupy runtime ----

BASE, ALLOC = 0x7F0000000000, 1 << 21
UUID = bytes(range(16))


def handle(**kw) -> cuda_ipc.IpcHandle:
    fields = {"handle": b"h" * 64, "offset": 4096, "size": 8192, "alloc_size": ALLOC, "device": 0,
              "device_uuid": UUID, **kw}
    return cuda_ipc.IpcHandle(**fields)


class FakeRuntime:
    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self) -> None:
        self.opened: list[bytes] = []
        self.closed: list[int] = []
        self.memory_type = 2

    def pointerGetAttributes(self, ptr: int):
        return types.SimpleNamespace(device=0, type=self.memory_type)

    def free(self, ptr: int) -> None:
        pass

    def ipcGetMemHandle(self, ptr: int) -> bytes:
        assert ptr == BASE  # the allocation's base, not the tensor's pointer
        return b"x" * 64

    def getDeviceProperties(self, device: int) -> dict:
        return {"uuid": UUID if device == 1 else b"\xff" * 16}

    def getDeviceCount(self) -> int:
        return 2

    def ipcOpenMemHandle(self, h: bytes, flags: int) -> int:
        assert flags == 1  # cudaIpcMemLazyEnablePeerAccess
        self.opened.append(h)
        return BASE

    def ipcCloseMemHandle(self, ptr: int) -> None:
        self.closed.append(ptr)


@pytest.fixture
def runtime(monkeypatch) -> FakeRuntime:
    rt = FakeRuntime()
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=rt, Device=lambda d: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(cuda_ipc, "_address_range", lambda ptr: (BASE, ALLOC))
    monkeypatch.setattr(cuda_ipc, "_uuid", lambda d: UUID if d == 1 else b"\xff" * 16)
    monkeypatch.setattr(cuda_ipc, "_opened", {})
    monkeypatch.setattr(cuda_ipc, "_gpus", None)
    return rt


def test_handles_round_trip_and_refuse_negative_fields() -> None:
    h = handle()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(h), type=cuda_ipc.IpcHandle) == h
    bad = msgspec.msgpack.encode({**msgspec.structs.asdict(h), "offset": -1})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(bad, type=cuda_ipc.IpcHandle)


@pytest.mark.parametrize(("kw", "match"), [
    ({"handle": b"h" * 63}, "63-byte handle"),
    ({"device_uuid": b"u" * 3}, "3-byte device UUID"),
    ({"offset": ALLOC - 100, "size": 101}, "outside an allocation"),
    ({"alloc_size": 0, "offset": 0, "size": 0}, "empty allocation"),
    ({"offset": -5}, "negative"),
])
def test_malformed_handles_are_refused(kw: dict, match: str, runtime: FakeRuntime) -> None:
    with pytest.raises(ProtocolError, match=match):
        cuda_ipc.open_handle(handle(**kw))
    assert not runtime.opened


def test_export_records_the_offset_from_the_allocation_base(runtime: FakeRuntime) -> None:
    h = cuda_ipc.export_memory(BASE + 4096, 8192)
    assert (h.handle, h.offset, h.size, h.alloc_size, h.device) == (b"x" * 64, 4096, 8192, ALLOC, 0)
    with pytest.raises(LayoutError, match="run past their allocation"):
        cuda_ipc.export_memory(BASE + ALLOC - 10, 11)
    runtime.memory_type = 1  # pinned host memory
    with pytest.raises(LayoutError, match="not device memory"):
        cuda_ipc.export_memory(BASE, 10)


def test_export_tensor_takes_cuda_array_interface_spans(runtime: FakeRuntime) -> None:
    arr = types.SimpleNamespace(__cuda_array_interface__={
        "shape": (4, 256), "typestr": "<f8", "data": (BASE + 512, False), "strides": None, "version": 3})
    h = cuda_ipc.export_tensor(arr)
    assert (h.offset, h.size) == (512, 4 * 256 * 8)
    arr.__cuda_array_interface__["strides"] = (8, 32)
    with pytest.raises(LayoutError, match="contiguous"):
        cuda_ipc.export_tensor(arr)
    with pytest.raises(LayoutError, match="only contiguous CUDA tensors"):
        cuda_ipc.export_tensor(torch.zeros(4))


def test_open_maps_once_finds_the_gpu_by_uuid_and_unmaps_on_last_close(runtime: FakeRuntime) -> None:
    a = cuda_ipc.open_handle(handle())
    b = cuda_ipc.open_handle(handle(offset=0, size=4096))  # another tensor of the allocation
    assert (a.ptr, a.size, a.device) == (BASE + 4096, 8192, 1)  # device 1 holds UUID here
    assert b.ptr == BASE and len(runtime.opened) == 1
    a.close()
    a.close()  # idempotent
    assert not runtime.closed and a.closed
    with b:
        pass
    assert runtime.closed == [BASE] and not cuda_ipc._opened


def test_open_refuses_a_handle_larger_than_its_mapping(runtime: FakeRuntime, monkeypatch) -> None:
    monkeypatch.setattr(cuda_ipc, "_address_range", lambda ptr: (BASE, 8192))
    with pytest.raises(ProtocolError, match="maps 8192 bytes"):
        cuda_ipc.open_handle(handle())
    assert runtime.closed == [BASE] and not cuda_ipc._opened  # unmapped, nothing leaked


def test_a_gpu_uuid_keeps_its_zero_bytes(monkeypatch) -> None:
    """The driver's CUuuid, all 16 bytes: cupy's ``getDeviceProperties()['uuid']`` cut a
    UUID at its first zero byte, and that GPU never got CUDA IPC."""
    import ctypes

    uuid = bytes([0x12, 0x00, 0x34] + [0] * 5 + list(range(1, 9)))

    class Driver:
        def cuInit(self, flags) -> int:
            return 0

        def cuDeviceGet(self, out, ordinal) -> int:
            return 0

        def cuDeviceGetUuid_v2(self, raw, dev) -> int:
            ctypes.memmove(raw, uuid, 16)
            return 0

    monkeypatch.setattr(cuda_ipc, "_libcuda", Driver())
    assert cuda_ipc._uuid(0) == uuid and len(cuda_ipc._uuid(0)) == 16
    with pytest.raises(DataPlaneError, match="16 bytes"):
        cuda_ipc.uuid_of((ctypes.c_ubyte * 8)())


def test_open_needs_the_exporters_gpu(runtime: FakeRuntime) -> None:
    with pytest.raises(DataPlaneError, match="not visible here"):
        cuda_ipc.open_handle(handle(device_uuid=b"\x01" * 16))
    with pytest.raises(DataPlaneError, match="device 5 is not visible"):
        cuda_ipc.open_handle(handle(device_uuid=b"", device=5))


def test_without_cupy_the_error_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ConfigError, match=r"kvstream\[cu12\]. or .\[cu13\]"):
        cuda_ipc.open_handle(handle())
    with pytest.raises(ConfigError, match=r"kvstream\[cu12\]. or .\[cu13\]"):
        blockcopy.CudaBlockCopy()
