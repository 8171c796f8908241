"""Data-plane paths (issue 17) between real processes: the same-host one-copy read, TCP
streams, UCX; bytes verified, the path visible, the failure rules on each."""

from __future__ import annotations

import multiprocessing as mp
import time

import anyio
import msgspec
import pytest
import torch

from kvstream import Agent, AgentConfig, PeerLostError, SharedKV
from kvstream.bench.harness import MODES
from kvstream.bench.runner import Harness
from kvstream.bench.synthetic import BenchSpec
from kvstream.layout import KVLayout
from tests.fakes import small_layout
from tests.integration.agents import LAYERED, assert_at_rest, cfg, settle
from tests.integration.peers import prefill_peer

pytestmark = pytest.mark.anyio

EXPECTED = {"shm": "shm", "tcp": "tcp", "ucx": "ucx_shm"}


@pytest.mark.parametrize("path", ["shm", "tcp", "ucx"])
def test_bit_exact_on_every_path(nats_server, path):
    """Every mode, both arrangements' framing, bytes verified; each transfer says its path."""
    lay = KVLayout(num_layers=6, num_kv_heads=2, head_dim=64, block_size=16)
    spec = BenchSpec(layout=lay, tokens=16 * 24, path=path, host_ids=path == "tcp")
    with Harness(spec, nats_url=nats_server.url, timeout_s=60) as h:
        for mode in MODES:
            run = h.run_kv(mode=mode, compute_ms=1.0)
            assert run.status == "completed", (mode, run.reason)
            assert run.verified, f"{path} {mode}: bytes differ"
            assert run.path == EXPECTED[path], (mode, run.path)
        stats = h.last_stats
    for side in stats.values():
        assert side["transfers_active"] == side["staging_bytes_in_use"] == 0
        taken = {k: v for k, v in side.items() if k.startswith("path.")}
        assert taken == {f"path.{EXPECTED[path]}": len(MODES)}, taken


def _shared(lay: KVLayout, n: int, *, fill: bool) -> SharedKV:
    kv = SharedKV.create(lay, n)
    if fill:
        gen = torch.Generator().manual_seed(3)
        for t in kv.layers:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return kv


async def _pair(nats_server, lay, n, **kw):
    p_kv, d_kv = _shared(lay, n, fill=True), _shared(lay, n, fill=False)
    p = Agent(cfg("p-shm", nats_server, **kw), layout=lay, kv_caches=p_kv.layers)
    d = Agent(cfg("d-shm", nats_server, **kw), layout=lay, kv_caches=d_kv.layers)
    return p, d


def _same(p: Agent, d: Agent, src: list[int], dst: list[int]) -> bool:
    assert p.memory is not None and d.memory is not None
    return all(torch.equal(p.memory.read_block(layer, s), d.memory.read_block(layer, t))
               for layer in range(p.memory.layout.num_layers)
               for s, t in zip(src, dst, strict=True))


async def test_shm_staged_push_lazy_pull_and_abort(nats_server):
    """A push before its reservation lands in staging and is claimed; a lazy pull reads
    layer by layer; an abort mid-way ends both sides; nothing stays mapped or held."""
    lay = small_layout(layers=6)
    p, d = await _pair(nats_server, lay, 32, **LAYERED)
    async with p, d:
        with anyio.fail_after(5):
            while not d.peers() or not p.peers():
                await anyio.sleep(0.05)
        tx = await p.push("staged", "d-shm", [4, 9, 1], mode="eager")
        for layer in range(lay.num_layers):
            tx.layer_ready(layer)
        with anyio.fail_after(10):
            while d.statistics().staged_transfers == 0 or d.statistics().bytes_received == 0:
                await anyio.sleep(0.02)
        rx = d.expect("staged", [30, 2, 17], src=p.instance_id)
        with anyio.fail_after(10):
            result = await rx.result()
        assert result.ok and result.path == "shm", result
        assert _same(p, d, [4, 9, 1], [30, 2, 17])

        offer = p.offer("lazy", [10, 11, 12, 13])
        for layer in range(lay.num_layers):
            offer.layer_ready(layer)
        rx = await d.pull("lazy", "p-shm", [20, 5, 6, 0], mode="lazy", secret=offer.secret)
        for layer in range(lay.num_layers):
            with anyio.fail_after(10):
                await rx.wait_layer(layer)
        assert (await rx.result()).path == "shm"
        assert _same(p, d, [10, 11, 12, 13], [20, 5, 6, 0])

        rx = d.expect("cut", [7, 8], src=p.instance_id)
        tx = await p.push("cut", "d-shm", [14, 15])
        tx.layer_ready(0)
        with anyio.fail_after(10):
            await rx.wait_layer(0)
        await tx.abort("the engine changed its mind")
        with anyio.fail_after(10):
            assert (await rx.result()).status == "aborted"
        await settle(p, d)
        assert_at_rest(p, d)
        assert d.statistics().paths == {"shm": 3}
    assert d._core.paths.maps.mapped_bytes == 0  # unmapped at shutdown


async def _push_all(p: Agent, d: Agent, rid: str, src: list[int], dst: list[int]) -> str:
    """Reserve, push every layer, wait: the path the destination says it took."""
    rx = d.expect(rid, dst, src=p.instance_id)
    tx = await p.push(rid, d.instance_id, src)
    for layer in range(p.memory.layout.num_layers if p.memory else 0):
        tx.layer_ready(layer)
    with anyio.fail_after(10):
        return (await rx.result()).path


async def test_shm_refused_by_config_falls_back_to_ucx(nats_server):
    lay = small_layout(layers=3)
    p, d = await _pair(nats_server, lay, 8, paths=("tcp", "ucx"))
    async with p, d:
        assert await _push_all(p, d, "r", [3, 4], [1, 2]) == "ucx_shm"
        assert _same(p, d, [3, 4], [1, 2])


async def test_a_manifest_naming_another_agents_memory_is_not_read(nats_server, monkeypatch):
    """A sender that names a same-host victim's shared KV (announced to everyone) without
    a proof that it holds it gets its own bytes moved over UCX; the victim's memory is
    never read. (The sender announces the forged export too: no mismatch to catch.)"""
    lay = small_layout(layers=3)
    p, d = await _pair(nats_server, lay, 8)
    victim_kv = _shared(lay, 8, fill=False)
    for t in victim_kv.layers:
        t.fill_(7.0)  # unlike the sender's bytes
    victim = Agent(cfg("victim", nats_server), layout=lay, kv_caches=victim_kv.layers)
    async with p, d, victim:
        forged = victim._core.paths.shared
        assert forged is not None
        monkeypatch.setattr(p._core.paths, "shared", forged)  # the victim's, announced
        monkeypatch.setattr(p._core.paths, "proofs", lambda dst, tid: [bytes(32)])
        assert await _push_all(p, d, "r", [3, 4], [1, 2]) == "ucx_shm"
        assert _same(p, d, [3, 4], [1, 2])  # the sender's own blocks, not the victim's
        assert not _same(victim, d, [3, 4], [1, 2])


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args[:-1], q, args[-1]), daemon=True)
    proc.start()
    return proc, q


async def test_killed_shm_source_fails_fast_and_is_unmapped(nats_server):
    """The destination reads a process that dies mid-transfer: the transfer fails with
    peer lost (no crash: the pages stay valid while mapped), and the mapping goes."""
    lay = small_layout(layers=6)
    d_kv = _shared(lay, 16, fill=False)
    async with Agent(cfg("d-kill-shm", nats_server), layout=lay, kv_caches=d_kv.layers) as d:
        handle = d.expect("r-kill", [0, 1, 2], src="peer-prefill")
        proc, q = _spawn(prefill_peer, msgspec.msgpack.encode(lay), nats_server.url,
                         "r-kill", "d-kill-shm", [4, 8, 12], 2, True)
        try:
            assert await anyio.to_thread.run_sync(lambda: q.get(timeout=60)) == "pushed"
            with anyio.fail_after(10):
                await handle.wait_layer(1)
            assert d._core.paths.maps.mapped_bytes > 0
            proc.kill()
            t = time.monotonic()
            with pytest.raises(PeerLostError), anyio.fail_after(10):
                await handle.wait()
            assert time.monotonic() - t < 5.0
            assert (await handle.result()).path == "shm"
            await settle(d)
            assert_at_rest(d)
            with anyio.fail_after(10):  # pruned at a heartbeat once nothing reads it
                while d._core.paths.maps.mapped_bytes:
                    await anyio.sleep(0.1)
        finally:
            proc.kill()
            proc.join(5)


async def test_two_host_ids_take_tcp_and_results_say_so(nats_server):
    lay = small_layout(layers=4)
    p_kv, d_kv = _shared(lay, 16, fill=True), _shared(lay, 16, fill=False)
    async with Agent(AgentConfig(instance_id="p-tcp", nats_url=nats_server.url, host_id="a"),
                     layout=lay, kv_caches=p_kv.layers) as p, \
            Agent(AgentConfig(instance_id="d-tcp", nats_url=nats_server.url, host_id="b"),
                  layout=lay, kv_caches=d_kv.layers) as d:
        with anyio.fail_after(5):
            while not d.peers() or not p.peers():
                await anyio.sleep(0.05)
        rx = d.expect("r", [9, 3, 5], src=p.instance_id)
        tx = await p.push("r", "d-tcp", [0, 15, 7])
        for layer in range(lay.num_layers):
            tx.layer_ready(layer)
        with anyio.fail_after(10):
            r, s = await rx.result(), await tx.result()
        assert (r.path, s.path) == ("tcp", "tcp")
        assert _same(p, d, [0, 15, 7], [9, 3, 5])
        assert p.statistics().paths == {"tcp": 1}
