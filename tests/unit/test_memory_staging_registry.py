from __future__ import annotations

import anyio
import pytest
import torch

from kvstream import InvalidBlockError, LayoutError, TransferTimeout
from kvstream.control.messages import Announce
from kvstream.control.registry import Registry
from kvstream.dataplane.staging import StagingPool
from kvstream.memory import RegisteredKV
from tests.fakes import FakeClock, cache, small_layout

ARRANGEMENTS = ["flash_nhd", "flash_hnd", "blocks_first_nhd", "cpu_hnbc", "mla"]


@pytest.mark.parametrize("arr", ARRANGEMENTS)
def test_gather_scatter_moves_exact_blocks(arr):
    lay = small_layout(arr)
    src = RegisteredKV(lay, cache(lay, 16, fill=True))
    dst = RegisteredKV(lay, cache(lay, 16, fill=False))
    s, d = src.block_map([5, 1, 9]), dst.block_map([0, 15, 7])
    buf = torch.empty(src.planes * src.plane_bytes(3), dtype=torch.uint8)
    for layer in range(lay.num_layers):
        src.gather(layer, s, src.staging_view(buf, 3))
        dst.scatter(layer, d, dst.staging_view(buf, 3))
        for a, b in zip(s.ids, d.ids, strict=True):
            assert torch.equal(src.read_block(layer, a), dst.read_block(layer, b))
        assert dst.read_block(layer, 3).count_nonzero() == 0  # untouched block stays zero


def test_contiguous_runs_are_used_in_place():
    lay = small_layout("flash_nhd")
    mem = RegisteredKV(lay, cache(lay, 8, fill=True))
    run = mem.direct_run(1, 1, mem.block_map([2, 3, 4]))
    assert run is not None and run.numel() * run.element_size() == 3 * lay.chunk_bytes
    assert run.data_ptr() == mem.layers[1][1, 2].data_ptr()
    assert mem.direct_run(1, 0, mem.block_map([2, 4])) is None


def test_block_ids_are_checked():
    lay = small_layout()
    mem = RegisteredKV(lay, cache(lay, 8, fill=False))
    with pytest.raises(InvalidBlockError) as ei:
        mem.block_map([1, 8, -1])
    assert set(ei.value.block_ids) == {8, -1} and ei.value.limit == 8
    with pytest.raises(InvalidBlockError, match="duplicate"):
        mem.block_map([1, 1])
    with pytest.raises(InvalidBlockError, match="empty"):
        mem.block_map([])


def test_registration_refuses_mismatched_memory():
    lay = small_layout()
    good = cache(lay, 8, fill=False)
    with pytest.raises(LayoutError, match="layers"):
        RegisteredKV(lay, good[:2])
    with pytest.raises(LayoutError, match="dtype"):
        RegisteredKV(lay, [t.float() for t in good])
    with pytest.raises(LayoutError, match="shape"):
        RegisteredKV(small_layout("flash_hnd"), good)
    with pytest.raises(LayoutError, match="contiguous"):
        RegisteredKV(lay, [t.transpose(2, 3).contiguous().transpose(2, 3) for t in good])


@pytest.mark.anyio
async def test_staging_pool_is_bounded_and_reused():
    pool = StagingPool(1000)
    a = await pool.acquire(600, timeout=1)
    with pytest.raises(TransferTimeout):
        await pool.acquire(600, timeout=0.05)
    with pytest.raises(Exception, match="does not fit"):
        await pool.acquire(2000, timeout=1)

    async def later():
        await anyio.sleep(0.05)
        pool.release(a)

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        b = await pool.acquire(600, timeout=2)
    assert b.data_ptr() == a.data_ptr()  # the freed buffer was reused
    pool.release(b)
    assert pool.in_use == 0 and pool.peak == 600


def test_registry_liveness():
    clock = FakeClock()
    reg = Registry(peer_timeout_s=2.0, clock=clock)
    reg.observe(Announce(instance_id="d", role="decode", worker_address=b""))
    reg.contact("p")
    assert reg.alive("d") and reg.alive("p") and [a.instance_id for a in reg.instances()] == ["d"]
    clock.advance(1.5)
    reg.contact("p")
    clock.advance(1.0)
    assert not reg.alive("d") and reg.alive("p")
    assert "silent" in reg.why_dead("d")
    reg.leave("p")
    assert not reg.alive("p") and "shut down" in reg.why_dead("p")
    assert "never" in reg.why_dead("x")
    assert reg.instances(role="prefill") == []


def test_registry_is_bounded_and_forgets_the_long_dead():
    clock = FakeClock()
    reg = Registry(peer_timeout_s=1.0, clock=clock, max_peers=3, forget_after_s=10.0)
    for name in ("a", "b", "c"):
        reg.observe(Announce(instance_id=name, role="decode", worker_address=b""))
    reg.observe(Announce(instance_id="flood", role="decode", worker_address=b""))
    reg.contact("flood2")
    assert len(reg) == 3 and reg.refused == 2 and reg.get("flood") is None
    reg.observe(Announce(instance_id="a", role="decode", worker_address=b""))  # known: kept
    clock.advance(5.0)
    reg.observe(Announce(instance_id="a", role="decode", worker_address=b""))
    reg.leave("b")  # left: forgotten as soon as room is needed
    reg.observe(Announce(instance_id="new", role="prefill", worker_address=b""))
    assert reg.get("new") is not None and reg.get("b") is None and len(reg) == 3
    clock.advance(6.0)  # c silent for 11 s > forget_after_s; a for 6 s: kept
    reg.contact("late")
    assert reg.get("late") is not None and reg.get("c") is None and reg.get("a") is not None
    assert reg.refused == 2


@pytest.mark.anyio
async def test_sidecar_registration_needs_shared_or_cuda_memory():
    from kvstream.client import Client
    from kvstream.cuda_ipc import export_cuda

    lay = small_layout()
    client = Client.connect("/nonexistent.sock")  # not connected: the check comes first
    with pytest.raises(LayoutError, match="SharedKV"):
        await client.register_kv(lay, cache(lay, 4, fill=False))
    with pytest.raises(LayoutError, match="CUDA"):
        export_cuda(torch.zeros(4))


@pytest.mark.anyio
async def test_quarantined_buffers_are_never_reused():
    pool = StagingPool(1000)
    a = await pool.acquire(600, timeout=1)
    pool.quarantine(a)
    assert pool.in_use == 0 and len(pool.quarantined) == 1
    b = await pool.acquire(600, timeout=1)  # the capacity is back ...
    assert b.data_ptr() != a.data_ptr()  # ... but not the memory
    pool.release(b)
