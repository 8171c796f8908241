"""csrc/blockcopy.cu on a GPU against the torch reference dst[dst_idx] = src[src_idx], bit for
bit; and the same-host one-copy path end to end: process A exports a tensor over CUDA IPC,
process B maps it and copies scattered blocks into its own tensor with the kernel."""

from __future__ import annotations

import multiprocessing

import msgspec
import numpy as np
import pytest
import torch

from kvstream import cuda_ipc
from kvstream._exceptions import InvalidBlockError
from kvstream.dataplane import blockcopy

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _needs_cupy() -> None:
    pytest.importorskip("cupy")


def _reference(dst: torch.Tensor, src: torch.Tensor, dst_off: np.ndarray, src_off: np.ndarray,
               nbytes: int) -> torch.Tensor:
    out = dst.clone()
    k = torch.arange(nbytes, device=dst.device)
    d = torch.from_numpy(dst_off).to(dst.device)[:, None] + k
    s = torch.from_numpy(src_off).to(dst.device)[:, None] + k
    out[d] = src[s]
    return out


def _scattered(gen: np.random.Generator, n: int, nbytes: int, shift: int) -> tuple[np.ndarray, int]:
    slot = nbytes + 16
    off = gen.permutation(n + 3)[:n] * slot + (gen.integers(0, 16, n) if shift else 0)
    return off.astype(np.int64), (n + 3) * slot


# (items, bytes each, shifted): 64 KiB and 32 KiB blocks, odd sizes at odd addresses.
CASES = [(512, 65536, False), (1000, 32768, False), (37, 40000 + 3, True), (300, 17, True),
         (64, 4096, True)]


@pytest.mark.parametrize(("n", "nbytes", "shift"), CASES)
def test_kernel_matches_torch_reference(n: int, nbytes: int, shift: bool) -> None:
    gen = np.random.default_rng(n)
    dst_off, dst_size = _scattered(gen, n, nbytes, shift)
    src_off, src_size = _scattered(gen, n, nbytes, shift)
    src = torch.randint(0, 256, (src_size,), dtype=torch.uint8, device="cuda")
    dst = torch.randint(0, 256, (dst_size,), dtype=torch.uint8, device="cuda")
    want = _reference(dst, src, dst_off, src_off, nbytes)
    stream = torch.cuda.current_stream()
    blockcopy.CudaBlockCopy().copy(dst.data_ptr(), dst.nbytes, dst_off, src.data_ptr(), src.nbytes,
                                   src_off, nbytes, stream=stream)
    assert torch.equal(dst, want)


def test_out_of_bounds_is_refused_before_launch() -> None:
    src = torch.arange(4096, device="cuda").to(torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    with pytest.raises(InvalidBlockError):
        blockcopy.CudaBlockCopy().copy(dst.data_ptr(), 4096, [0, 4096 - 63], src.data_ptr(), 4096,
                                       [0, 64], 64)
    torch.cuda.synchronize()
    assert not bool(dst.any())


N, NBYTES, SEED = 96, 8192, 11


def _items(n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(SEED)
    return blockcopy.layer_items(2, NBYTES, n_blocks, gen.permutation(n_blocks)[:N // 2],
                                 N, gen.permutation(N)[:N // 2])


def _peer(wire: bytes, n_blocks: int, out: multiprocessing.Queue) -> None:
    """Process B: map A's tensor, copy its scattered blocks into a tensor of its own."""
    try:
        h = msgspec.msgpack.decode(wire, type=cuda_ipc.IpcHandle)
        src_off, dst_off = _items(n_blocks)
        with cuda_ipc.open_handle(h) as mapping:
            torch.cuda.set_device(mapping.device)
            dst = torch.zeros(2 * N * NBYTES, dtype=torch.uint8, device="cuda")
            blockcopy.CudaBlockCopy().copy(dst.data_ptr(), dst.nbytes, dst_off, mapping.ptr, mapping.size,
                                           src_off, NBYTES, stream=torch.cuda.current_stream())
            out.put(("ok", dst.cpu().numpy().tobytes()))
    except Exception as exc:  # reported to the test, which fails with it
        out.put(("error", repr(exc)))


def test_two_processes_copy_over_cuda_ipc() -> None:
    n_blocks = 80
    gen = torch.Generator().manual_seed(SEED)
    # Exported as a view 4 KiB into a larger tensor: the handle names the allocation's base.
    pool = torch.zeros(2 * n_blocks * NBYTES + 8192, dtype=torch.uint8, device="cuda")
    src = pool[4096:4096 + 2 * n_blocks * NBYTES]
    src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8, generator=gen).cuda())
    torch.cuda.synchronize()
    h = cuda_ipc.export_tensor(src)
    assert h.offset >= 4096 and h.size == src.numel() and h.offset + h.size <= h.alloc_size
    assert len(h.handle) == cuda_ipc.HANDLE_BYTES

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_peer, args=(msgspec.msgpack.encode(h), n_blocks, out))
    proc.start()
    try:
        status, payload = out.get(timeout=180)
    finally:
        proc.join(timeout=60)
    assert status == "ok", payload
    got = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    src_off, dst_off = _items(n_blocks)
    want = _reference(torch.zeros_like(got), src.cpu(), dst_off, src_off, NBYTES)
    assert torch.equal(got, want)
    assert proc.exitcode == 0
