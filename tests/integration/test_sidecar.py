"""Engines and sidecars in separate processes, real NATS, real UCX."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time

import anyio
import msgspec
import pytest
import torch

from kvstream import Agent, AgentConfig, KVLayout, LayoutError, TransferError
from kvstream.blocking import BlockingClient
from kvstream.client import Client, SidecarLostError
from kvstream.shm import SharedKV
from kvstream.sidecar import protocol as lp
from tests.fakes import cache, small_layout

pytestmark = pytest.mark.anyio


def start_sidecar(tmp_path, nats_server, instance_id: str, *extra: str) -> tuple[subprocess.Popen, str]:
    sock = str(tmp_path / f"{instance_id}.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstream.tools.cli", "sidecar", "--instance-id", instance_id,
         "--socket", sock, "--nats-url", nats_server.url, *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        if proc.poll() is not None:
            raise AssertionError(f"sidecar exited: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("sidecar did not come up")
        time.sleep(0.05)
    return proc, sock


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    if proc.stderr:
        proc.stderr.close()


@pytest.fixture
def sidecars(tmp_path, nats_server):
    procs = []

    def make(instance_id: str, *extra: str) -> tuple[subprocess.Popen, str]:
        proc, sock = start_sidecar(tmp_path, nats_server, instance_id, *extra)
        procs.append(proc)
        return proc, sock

    yield make
    for proc in procs:
        stop(proc)


def fill(shared: SharedKV) -> None:
    gen = torch.Generator().manual_seed(1)
    for t in shared.layers:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


async def test_transfer_through_two_sidecars_is_bit_exact(sidecars):
    lay = small_layout(layers=6)
    _, psock = sidecars("sc-p")
    _, dsock = sidecars("sc-d")
    src, dst = SharedKV.create(lay, 32), SharedKV.create(lay, 32)
    fill(src)
    async with Client.connect(psock) as p, Client.connect(dsock) as d:
        await p.register_kv(lay, src)
        await d.register_kv(lay, dst)
        for rid, sb, db, mode in (("scattered", [3, 17, 5], [30, 2, 11], "pipelined"),
                                  ("runs", [4, 5, 6], [20, 21, 22], "eager")):
            rx = await d.expect(rid, db, src="sc-p")
            tx = await p.push(rid, "sc-d", sb, mode=mode)
            for layer in range(lay.num_layers):
                tx.layer_ready(layer)
            with anyio.fail_after(20):
                await rx.wait_layer(0)
                assert rx.layer_landed(0)
                await rx.wait()
                await tx.wait()
            for layer in range(lay.num_layers):
                for a, b in zip(sb, db, strict=True):
                    assert torch.equal(src.layers[layer][:, a], dst.layers[layer][:, b])
        stats = await d.statistics()
        assert stats["completed"] == 2 and stats["transfers_active"] == 0
        assert stats["kv_registered_bytes"] == 32 * lay.block_bytes * lay.num_layers


async def test_push_timeout_reaches_the_sidecar(sidecars):
    """A push's own deadline travels to the sidecar's agent (it used to be dropped), and a
    deadline that could never pass is refused before anything is sent."""
    import math

    from kvstream import ConfigError, TransferError

    lay = small_layout(layers=2)
    _, psock = sidecars("sc-tp")
    _, dsock = sidecars("sc-td")
    src, dst = SharedKV.create(lay, 8), SharedKV.create(lay, 8)
    async with Client.connect(psock) as p, Client.connect(dsock) as d:
        await p.register_kv(lay, src)
        await d.register_kv(lay, dst)
        for bad in (math.nan, math.inf, -1.0):
            with pytest.raises(ConfigError, match="timeout"):
                await p.push("never", "sc-td", [1], timeout=bad)
        rx = await d.expect("late", [2], src="sc-tp")
        tx = await p.push("late", "sc-td", [1], timeout=0.5)  # no layer is ever marked ready
        t0 = anyio.current_time()
        with anyio.fail_after(20), pytest.raises(TransferError):
            await tx.wait()
        assert anyio.current_time() - t0 < 10  # the 0.5 s deadline, not the 60 s default
        with anyio.fail_after(20), pytest.raises(TransferError):
            await rx.wait()
        # The manifest carries the deadline, so either side may time out first and the
        # other then sees the peer's abort.
        ends = {(await tx.result()).status, (await rx.result()).status}
        assert "timed_out" in ends and ends <= {"timed_out", "aborted"}, ends
        assert (await p.statistics())["transfers_active"] == 0


async def test_agent_errors_arrive_with_their_fields(sidecars):
    from kvstream import DuplicateRequestError, InvalidBlockError

    lay = small_layout(layers=2)
    _, dsock = sidecars("sc-err")
    dst = SharedKV.create(lay, 8)
    async with Client.connect(dsock) as d:
        await d.register_kv(lay, dst)
        await d.expect("twice", [1], src="prefill")
        with pytest.raises(DuplicateRequestError) as dup:
            await d.expect("twice", [2], src="prefill")
        assert dup.value.request_id == "twice"
        with pytest.raises(InvalidBlockError) as bad:
            await d.expect("outside", [3, 99], src="prefill")
        assert 99 in bad.value.block_ids


async def test_lazy_incremental_pull_through_two_sidecars(sidecars):
    from kvstream import block_hashes

    lay = small_layout(layers=6)
    _, psock = sidecars("sc-pull-p")
    _, dsock = sidecars("sc-pull-d")
    src, dst = SharedKV.create(lay, 32), SharedKV.create(lay, 32)
    fill(src)
    sb, db = [3, 17, 5, 9], [30, 2, 11, 14]
    hashes = block_hashes(range(4 * lay.block_size), lay.block_size)
    async with Client.connect(psock) as p, Client.connect(dsock) as d:
        await p.register_kv(lay, src)
        await d.register_kv(lay, dst)
        tx = await p.offer("pulled", sb, block_hashes=hashes)
        tx.all_ready()
        assert len(tx.secret) >= 16  # the sidecar hands the offer's secret to its engine
        rx = await d.pull("pulled", "sc-pull-p", db, mode="lazy", have=hashes[:1], lookahead=0,
                          secret=tx.secret)
        await anyio.sleep(0.3)
        assert not rx.layer_landed(0)  # lazy: nothing moves before the engine asks
        with anyio.fail_after(20):
            for layer in range(lay.num_layers):
                await rx.wait_layer(layer)
            done = await rx.wait()
            await tx.wait()
        assert done.bytes_skipped == lay.block_bytes * lay.num_layers
        for layer in range(lay.num_layers):
            for a, b in zip(sb[1:], db[1:], strict=True):
                assert torch.equal(src.layers[layer][:, a], dst.layers[layer][:, b])
            assert dst.layers[layer][:, db[0]].count_nonzero() == 0  # held: not sent
        stats = await d.statistics()
        assert stats["bytes_received"] == 3 * lay.block_bytes * lay.num_layers
        assert stats["transfers_active"] == 0


def _engine_that_hangs(sock: str, layout_blob: bytes, q) -> None:
    """A prefill engine that starts a push, marks one layer ready, then stalls (to be killed)."""
    layout = msgspec.msgpack.decode(layout_blob, type=KVLayout)

    async def main() -> None:
        shared = SharedKV.create(layout, 16)
        async with Client.connect(sock) as client:
            await client.register_kv(layout, shared)
            handle = await client.push("r-eng", "eng-peer", [1, 2, 3])
            handle.layer_ready(0)
            q.put("pushed")
            await anyio.sleep(120)

    anyio.run(main)


async def test_engine_killed_mid_transfer_releases_everything(sidecars, nats_server):
    lay = small_layout(layers=6)
    _, sock = sidecars("sc-eng", "--whole-frame-bytes", "0")  # killed between two layers
    cfg = AgentConfig(instance_id="eng-peer", nats_url=nats_server.url, heartbeat_s=0.25,
                      peer_timeout_s=1.0, request_timeout_s=1.0)
    async with Agent(cfg, layout=lay, kv_caches=cache(lay, 16, fill=False)) as peer:
        rx = peer.expect("r-eng", [7, 8, 9], src="sc-eng")
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        engine = ctx.Process(target=_engine_that_hangs, args=(sock, msgspec.msgpack.encode(lay), q))
        engine.start()
        try:
            assert await anyio.to_thread.run_sync(lambda: q.get(timeout=60)) == "pushed"
            with anyio.fail_after(10):
                await rx.wait_layer(0)
            engine.kill()
            with anyio.fail_after(10):
                result = await rx.result()
            assert result.status == "aborted" and "engine disconnected" in result.reason
        finally:
            engine.kill()
            engine.join(5)
        async with Client.connect(sock) as probe:
            with anyio.fail_after(10):
                while (stats := await probe.statistics())["kv_registered_bytes"]:
                    await anyio.sleep(0.05)
        assert stats["transfers_active"] == 0 and stats["staging_bytes_in_use"] == 0
        assert stats["aborted"] == 1
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvstream-{engine.pid}-")]


async def test_sidecar_killed_gives_a_clear_error(sidecars):
    lay = small_layout()
    proc, sock = sidecars("sc-kill")
    shared = SharedKV.create(lay, 8)
    async with Client.connect(sock) as client:
        await client.register_kv(lay, shared)
        handle = await client.expect("r", [1, 2], src="prefill")
        proc.kill()
        with anyio.fail_after(10):
            with pytest.raises(TransferError, match="sidecar lost"):
                await handle.wait()
            with pytest.raises(SidecarLostError):
                await client.expect("r2", [3], src="prefill")


async def test_no_sidecar_is_a_clear_error(tmp_path):
    with pytest.raises(SidecarLostError, match="no kvstream sidecar"):
        async with Client.connect(str(tmp_path / "nothing.sock"), timeout=2):
            pass


async def test_layout_mismatch_at_registration_is_refused(sidecars):
    _, sock = sidecars("sc-lay", "--model", "llama-3-8b")
    lay = small_layout()
    shared = SharedKV.create(lay, 8)
    async with Client.connect(sock) as client:
        with pytest.raises(LayoutError, match="this sidecar serves"):
            await client.register_kv(lay, shared)
        # Segments that do not hold what the stated layout needs are refused too.
        other = SharedKV.create(lay, 8)
        wrong = msgspec.structs.replace(other.spec, num_blocks=9)
        with pytest.raises(LayoutError):
            await client.request(lp.RegisterKV(shared=wrong))
        other.close()
        stats = await client.statistics()
        assert stats["kv_registered_bytes"] == 0


def test_blocking_client_fast_path(sidecars, nats_server):
    lay = small_layout(layers=4)
    _, psock = sidecars("bl-p")
    _, dsock = sidecars("bl-d")
    src, dst = SharedKV.create(lay, 16), SharedKV.create(lay, 16)
    fill(src)
    with BlockingClient(psock) as p, BlockingClient(dsock) as d:
        p.register_kv(lay, src)
        d.register_kv(lay, dst)
        rx = d.expect("b", [1, 5], src="bl-p")
        tx = p.push("b", "bl-d", [2, 9])
        for layer in range(lay.num_layers):
            tx.layer_ready(layer)
        assert rx.wait().ok and tx.wait().ok
        rx.wait_layer(3)  # landed already: answered locally (the bench reports its cost)
        assert rx.layer_landed(3) and rx.done and tx.done
        assert torch.equal(src.layers[3][:, 9], dst.layers[3][:, 5])


async def test_sigterm_aborts_in_flight_transfers_and_exits_cleanly(sidecars, nats_server):
    import signal

    lay = small_layout(layers=6)
    proc, sock = sidecars("sc-term", "--whole-frame-bytes", "0")  # ended between two layers
    cfg = AgentConfig(instance_id="term-peer", nats_url=nats_server.url, heartbeat_s=0.25,
                      peer_timeout_s=1.0, request_timeout_s=1.0)
    async with Agent(cfg, layout=lay, kv_caches=cache(lay, 16, fill=False)) as peer:
        rx = peer.expect("r-term", [7, 8], src="sc-term")
        shared = SharedKV.create(lay, 16)
        async with Client.connect(sock) as client:
            await client.register_kv(lay, shared)
            tx = await client.push("r-term", "term-peer", [1, 2])
            tx.layer_ready(0)
            with anyio.fail_after(10):
                await rx.wait_layer(0)
            proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                peer_result = await rx.result()
                mine = await tx.result()
            assert peer_result.status == "aborted", peer_result
            assert mine.status in ("aborted", "failed")
        assert await anyio.to_thread.run_sync(proc.wait, 15) == 0
        assert "aborting in-flight transfers" in proc.stderr.read()


async def test_gather_through_sidecars_of_two_prefill_ranks(sidecars):
    """Prefill TP 2 (two sidecars, each rank's layout: 2 of 4 heads, block 16) -> decode
    TP 1 (block 32): the decode engine gathers the request from both ranks in one pull."""
    half = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=16, dtype="float16")
    whole = KVLayout(num_layers=3, num_kv_heads=4, head_dim=32, block_size=32, dtype="float16")
    socks = [sidecars(f"sc-g-p{r}", "--tp-rank", str(r), "--tp-size", "2")[1] for r in (0, 1)]
    _, dsock = sidecars("sc-g-d")
    srcs = [SharedKV.create(half, 8) for _ in socks]
    dst = SharedKV.create(whole, 8)
    for rank, s in enumerate(srcs):
        fill(s)
        for t in s.layers:
            t.add_(rank * 4)  # the two ranks' heads differ: a swap would show
    sb, db, tokens = [5, 0, 3], [6, 1], 40
    async with Client.connect(socks[0]) as p0, Client.connect(socks[1]) as p1, \
            Client.connect(dsock) as d:
        for client, lay, shared in ((p0, half, srcs[0]), (p1, half, srcs[1]), (d, whole, dst)):
            await client.register_kv(lay, shared)
        with anyio.fail_after(20):
            tx0 = await p0.offer("g", sb)
            tx1 = await p1.offer("g", sb, secret=tx0.secret)
            tx0.all_ready()
            tx1.all_ready()
            rx = await d.pull("g", ["sc-g-p0", "sc-g-p1"], db, secret=tx0.secret, tokens=tokens)
            done = await rx.wait()
            await tx0.wait()
            await tx1.wait()
        assert done.peer == "sc-g-p0,sc-g-p1" and rx.layer_landed(2)
    from kvstream.transfer.plan import pack

    for layer in range(3):
        got = pack(dst.layers[layer], whole, db, tokens)
        for rank, s in enumerate(srcs):
            want = pack(s.layers[layer], half, sb, tokens)
            assert torch.equal(got[:, :, 2 * rank:2 * rank + 2], want), (layer, rank)


async def test_two_decode_rank_sidecars_read_one_offer(sidecars):
    """Prefill TP 1 (4 heads, block 32) -> decode TP 2 (two sidecars, 2 heads each, block
    16): both ranks pull their heads of the prefill's one offer (``readers=2``); the offer
    completes once both did."""
    whole = KVLayout(num_layers=3, num_kv_heads=4, head_dim=32, block_size=32, dtype="float16")
    half = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=16, dtype="float16")
    _, psock = sidecars("sc-r-p")
    dsocks = [sidecars(f"sc-r-d{r}", "--tp-rank", str(r), "--tp-size", "2")[1] for r in (0, 1)]
    src = SharedKV.create(whole, 8)
    dsts = [SharedKV.create(half, 8) for _ in dsocks]
    fill(src)
    sb, db, tokens = [6, 1], [[5, 0, 3], [2, 7, 4]], 40
    async with Client.connect(psock) as p, Client.connect(dsocks[0]) as d0, \
            Client.connect(dsocks[1]) as d1:
        for client, lay, shared in ((p, whole, src), (d0, half, dsts[0]), (d1, half, dsts[1])):
            await client.register_kv(lay, shared)
        with anyio.fail_after(20):
            tx = await p.offer("r", sb, readers=2)
            tx.all_ready()
            rxs = [await d.pull("r", "sc-r-p", db[i], secret=tx.secret, tokens=tokens,
                                readers=2) for i, d in enumerate((d0, d1))]
            for rx in rxs:
                await rx.wait()
            await tx.wait()
    from kvstream.transfer.plan import pack

    for layer in range(3):
        want = pack(src.layers[layer], whole, sb, tokens)
        for rank, d in enumerate(dsts):
            got = pack(d.layers[layer], half, db[rank], tokens)
            assert torch.equal(got, want[:, :, 2 * rank:2 * rank + 2]), (layer, rank)
