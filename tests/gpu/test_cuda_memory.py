"""GPU-resident KV: transfers between two agents while the GPU is busy, and a sidecar that
maps an engine's device KV through CUDA IPC (runs where CUDA exists).

The engine side writes its KV on a stream of its own and says a layer is ready only after
an event on that stream; the default stream is kept busy with matrix products all along.
kvstream's gathers and scatters queue behind that work, so a copy that were not fenced
before UCX sends (or before a staging slot is reused) would move stale bytes: every byte
is compared."""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

import anyio
import pytest
import torch

from kvstream import Agent, AgentConfig
from tests.fakes import small_layout

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]

BLOCKS = 64


def _engine_kv(lay: Any, seed: int) -> list[torch.Tensor]:
    """KV written on the engine's own stream, ready only once its event has completed."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kv = [torch.randn(lay.tensor_shape(BLOCKS), device="cuda", generator=gen).half()
              for _ in range(lay.num_layers)]
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()
    return kv


class Busy:
    """Matrix products on the default stream until stopped (the engine's forward, say)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        while not self.stop.is_set():
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.current_stream().synchronize()

    def __enter__(self) -> Busy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.mark.parametrize("how", ["push", "pull"])
async def test_scattered_blocks_move_whole_while_the_gpu_is_busy(nats_server, how):
    lay = small_layout(layers=4)
    src = _engine_kv(lay, 1)
    dst = [torch.zeros(lay.tensor_shape(BLOCKS), device="cuda").half() for _ in range(4)]
    cfg = {"nats_url": nats_server.url, "heartbeat_s": 0.25, "peer_timeout_s": 2.0}
    requests = {"scattered": ([3, 1, 7, 40, 22, 9], [0, 50, 4, 33, 12, 63]),
                "run": ([4, 5, 6], [10, 11, 12])}
    with Busy():
        async with Agent(AgentConfig(instance_id="gp", **cfg), layout=lay, kv_caches=src) as p, \
                Agent(AgentConfig(instance_id="gd", **cfg), layout=lay, kv_caches=dst) as d:
            for rid, (sb, db) in requests.items():
                for _ in range(3):  # reused staging slots, each time behind the busy stream
                    for t in dst:
                        t.zero_()
                    if how == "push":
                        rx = d.expect(rid, db, src=p.instance_id)
                        tx = await p.push(rid, "gd", sb)
                        tx.all_ready()
                    else:
                        tx = p.offer(rid, sb)
                        tx.all_ready()
                        rx = await d.pull(rid, "gp", db, secret=tx.secret)
                    with anyio.fail_after(60):
                        assert (await rx.result()).ok
                        await tx.wait()
                    torch.cuda.synchronize()
                    for layer in range(4):
                        for a, b in zip(sb, db, strict=True):
                            assert torch.equal(p.memory.read_block(layer, a),
                                               d.memory.read_block(layer, b)), (rid, layer, a)


def _sidecars(url: str, root: str, ready: Any, stop: Any) -> None:
    """Both sidecars, in a process of their own: CUDA refuses a process its own handles."""
    from kvstream import Sidecar

    async def main() -> None:
        cfg = {"nats_url": url, "heartbeat_s": 0.25, "peer_timeout_s": 2.0}
        async with anyio.create_task_group() as tg:
            for name in ("gsp", "gsd"):
                await tg.start(Sidecar(AgentConfig(instance_id=name, **cfg),
                                       f"{root}/{name}.sock").serve)
            ready.set()
            await anyio.to_thread.run_sync(stop.wait, 300)
            tg.cancel_scope.cancel()

    anyio.run(main)


async def test_sidecar_maps_cuda_kv_through_ipc(tmp_path, nats_server):
    from kvstream import Client

    lay = small_layout(layers=4)
    src = _engine_kv(lay, 2)
    dst = [torch.zeros(lay.tensor_shape(BLOCKS), device="cuda").half() for _ in range(4)]
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_sidecars, args=(nats_server.url, str(tmp_path), ready, stop),
                        daemon=True)
    child.start()
    try:
        assert await anyio.to_thread.run_sync(ready.wait, 60)
        async with Client.connect(str(tmp_path / "gsp.sock")) as p, \
                Client.connect(str(tmp_path / "gsd.sock")) as d:
            await p.register_kv(lay, src)
            await d.register_kv(lay, dst)
            rx = await d.expect("r", [0, 5], src="gsp")
            tx = await p.push("r", "gsd", [3, 9])
            tx.all_ready()
            with anyio.fail_after(30):
                await rx.wait()
            torch.cuda.synchronize()
            for layer in range(4):
                assert torch.equal(src[layer][:, 3], dst[layer][:, 0])
                assert torch.equal(src[layer][:, 9], dst[layer][:, 5])
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()
