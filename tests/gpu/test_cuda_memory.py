"""GPU-resident KV: registration and a transfer between two agents (runs where CUDA exists)."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvstream import Agent, AgentConfig
from tests.fakes import small_layout

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]


async def test_push_between_gpu_caches(nats_server):
    lay = small_layout(layers=4)
    src = [torch.randn(lay.tensor_shape(16), device="cuda").half() for _ in range(4)]
    dst = [torch.zeros(lay.tensor_shape(16), device="cuda").half() for _ in range(4)]
    cfg = {"nats_url": nats_server.url, "heartbeat_s": 0.25, "peer_timeout_s": 1.0}
    async with Agent(AgentConfig(instance_id="gp", **cfg), layout=lay, kv_caches=src) as p, \
            Agent(AgentConfig(instance_id="gd", **cfg), layout=lay, kv_caches=dst) as d:
        for rid, sb, db in (("scattered", [3, 1, 7], [0, 9, 4]), ("run", [4, 5], [10, 11])):
            rx = d.expect(rid, db)
            tx = await p.push(rid, "gd", sb)
            tx.all_ready()
            with anyio.fail_after(30):
                await rx.wait()
                await tx.wait()
            for layer in range(4):
                for a, b in zip(sb, db, strict=True):
                    assert torch.equal(p.memory.read_block(layer, a), d.memory.read_block(layer, b))


async def test_sidecar_maps_cuda_kv_through_ipc(tmp_path, nats_server):
    from kvstream import Client, Sidecar

    lay = small_layout(layers=4)
    src = [torch.randn(lay.tensor_shape(16), device="cuda").half() for _ in range(4)]
    dst = [torch.zeros(lay.tensor_shape(16), device="cuda").half() for _ in range(4)]
    cfg = {"nats_url": nats_server.url, "heartbeat_s": 0.25, "peer_timeout_s": 1.0}
    async with anyio.create_task_group() as tg:
        for name in ("gsp", "gsd"):
            await tg.start(Sidecar(AgentConfig(instance_id=name, **cfg),
                                   str(tmp_path / f"{name}.sock")).serve)
        async with Client.connect(str(tmp_path / "gsp.sock")) as p, \
                Client.connect(str(tmp_path / "gsd.sock")) as d:
            await p.register_kv(lay, src)
            await d.register_kv(lay, dst)
            rx = await d.expect("r", [0, 5])
            tx = await p.push("r", "gsd", [3, 9])
            tx.all_ready()
            with anyio.fail_after(30):
                await rx.wait()
            torch.cuda.synchronize()
            for layer in range(4):
                assert torch.equal(src[layer][:, 3], dst[layer][:, 0])
                assert torch.equal(src[layer][:, 9], dst[layer][:, 5])
        tg.cancel_scope.cancel()
