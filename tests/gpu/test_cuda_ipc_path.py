"""The same-host GPU path end to end (issue 17): a prefill agent in another process with its
KV on the GPU; the decode agent here opens its device KV through CUDA IPC and copies the
blocks with the batched kernel. Push (pipelined, eager), pull (eager, lazy); bytes
verified, every transfer on ``cuda_ipc``, nothing left open at shutdown. (CUDA refuses a
process its own handles, hence two processes.)"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import anyio
import pytest
import torch

from kvstream import Agent, AgentConfig
from tests.fakes import small_layout

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]



@pytest.fixture(autouse=True)
def _needs_cupy() -> None:
    pytest.importorskip("cupy")  # the export, the opening and the kernel


NUM_BLOCKS = 32
REQUESTS = {  # request -> (source blocks, destination blocks, how)
    "push-pipelined": ([3, 1, 7, 20], [0, 9, 4, 31], "push:pipelined"),
    "push-eager": ([4, 5, 6], [10, 11, 12], "push:eager"),
    "pull-eager": ([8, 2, 30], [13, 14, 1], "pull:eager"),
    "pull-lazy": ([9, 10, 11, 12], [20, 5, 6, 2], "pull:lazy"),
}


def _cfg(name: str, url: str) -> AgentConfig:
    return AgentConfig(instance_id=name, nats_url=url, heartbeat_s=0.25, peer_timeout_s=2.0)


def _fill(layout: Any) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(layout.tensor_shape(NUM_BLOCKS), generator=gen).half().cuda()
            for _ in range(layout.num_layers)]


def _prefill(url: str, q: Any, done: Any) -> None:
    async def main() -> None:
        lay = small_layout(layers=4)
        async with Agent(_cfg("g-prefill", url), layout=lay, kv_caches=_fill(lay)) as p:
            with anyio.fail_after(20):
                while "g-decode" not in {a.instance_id for a in p.peers()}:
                    await anyio.sleep(0.05)
            offers = {}
            for rid, (src, _dst, how) in REQUESTS.items():
                if how.startswith("pull"):
                    offers[rid] = p.offer(rid, src)
                    offers[rid].all_ready()
            q.put({rid: o.secret for rid, o in offers.items()})
            for rid, (src, _dst, how) in REQUESTS.items():
                if how.startswith("push"):
                    tx = await p.push(rid, "g-decode", src, mode=how.split(":")[1])
                    tx.all_ready()
                    with anyio.fail_after(30):
                        await tx.wait()
            await anyio.to_thread.run_sync(done.wait, 60)

    anyio.run(main)


async def test_push_and_pull_between_gpu_processes_take_cuda_ipc(nats_server):
    lay = small_layout(layers=4)
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_prefill, args=(nats_server.url, q, done), daemon=True)
    dst = [torch.zeros(lay.tensor_shape(NUM_BLOCKS), device="cuda").half()
           for _ in range(lay.num_layers)]
    try:
        async with Agent(_cfg("g-decode", nats_server.url), layout=lay, kv_caches=dst) as d:
            rx = {rid: d.expect(rid, db, src="g-prefill")
                  for rid, (_s, db, how) in REQUESTS.items() if how.startswith("push")}
            child.start()
            secrets = await anyio.to_thread.run_sync(q.get, True, 60)
            with anyio.fail_after(20):  # its announcement says it offers CUDA IPC
                while not any(a.instance_id == "g-prefill" and a.cuda_ipc is not None
                              for a in d.peers()):
                    await anyio.sleep(0.05)
            for rid, (_src, db, how) in REQUESTS.items():
                if how.startswith("pull"):
                    rx[rid] = await d.pull(rid, "g-prefill", db, mode=how.split(":")[1],
                                           secret=secrets[rid])
                    if how.endswith("lazy"):
                        for layer in range(lay.num_layers):
                            with anyio.fail_after(30):
                                await rx[rid].wait_layer(layer)
            for rid, handle in rx.items():
                with anyio.fail_after(30):
                    result = await handle.result()
                assert result.ok and result.path == "cuda_ipc", (rid, result)
            torch.cuda.synchronize()
            want = _fill(lay)
            for rid, (src, db, _how) in REQUESTS.items():
                for layer in range(lay.num_layers):
                    for s, t in zip(src, db, strict=True):
                        assert torch.equal(want[layer][:, s], dst[layer][:, t]), (rid, layer)
            assert d.statistics().paths == {"cuda_ipc": len(REQUESTS)}
            assert d._core.paths.ipc.maps.mapped_bytes > 0  # cached while the peer lives
        assert d._core.paths.ipc.maps.mapped_bytes == 0  # closed at shutdown
    finally:
        done.set()
        child.join(30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
