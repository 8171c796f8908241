"""Short transfers as one data-plane frame, on every path, between real agents over a real
nats-server: one header and at most one copy job per side, whatever the layer count; a
longer transfer still streams layer by layer."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

from kvstream import Agent, SharedKV
from kvstream.layout import KVLayout
from tests.integration.agents import assert_at_rest, cfg, meet, settle

pytest.importorskip("ucxx")

pytestmark = pytest.mark.anyio

PATHS: dict[str, dict[str, Any]] = {  # how a pair is configured for each path
    "shm": {"paths": ("shm", "ucx")},
    "ucx": {"paths": ("ucx",)},
    "tcp": {"paths": ("tcp", "ucx")},
}
COUNTS = ("frames_sent", "frames_received", "copy_jobs")


def _layout(layers: int) -> KVLayout:
    return KVLayout(num_layers=layers, num_kv_heads=2, head_dim=64, block_size=16)


@contextlib.asynccontextmanager
async def _pair(nats_server: Any, path: str, layers: int, **kw: Any
                ) -> AsyncIterator[tuple[Agent, Agent]]:
    lay, n = _layout(layers), 8
    p_kv, d_kv = SharedKV.create(lay, n), SharedKV.create(lay, n)
    gen = torch.Generator().manual_seed(layers)
    for t in p_kv.layers:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    hosts = path == "tcp"  # TCP is chosen between hosts
    async with Agent(cfg(f"p-{path}-{layers}", nats_server, **PATHS[path], **kw,
                         host_id="host-p" if hosts else ""), layout=lay,
                     kv_caches=p_kv.layers) as p, \
            Agent(cfg(f"d-{path}-{layers}", nats_server, **PATHS[path], **kw,
                      host_id="host-d" if hosts else ""), layout=lay,
                  kv_caches=d_kv.layers) as d:
        await meet(p, d)
        yield p, d


def _counts(a: Agent) -> dict[str, int]:
    s = a.statistics()
    return {k: getattr(s, k) for k in COUNTS}


def _delta(before: dict[str, int], a: Agent) -> dict[str, int]:
    now = _counts(a)
    return {k: now[k] - before[k] for k in COUNTS}


def _same(p: Agent, d: Agent, src: list[int], dst: list[int]) -> bool:
    assert p.memory is not None and d.memory is not None
    return all(torch.equal(p.memory.read_block(layer, a), d.memory.read_block(layer, b))
               for layer in range(p.memory.layout.num_layers)
               for a, b in zip(src, dst, strict=True))


@pytest.mark.parametrize("layers", [32, 80])
@pytest.mark.parametrize("path", sorted(PATHS))
async def test_one_block_is_one_frame_and_one_copy_per_side(nats_server: Any, path: str,
                                                            layers: int) -> None:
    """A 1-block pipelined push, a 1-block pull, and a 1-block push staged before its
    reservation: each one header and at most one copy job on each side (the staged one
    two at the destination)."""
    async with _pair(nats_server, path, layers) as (p, d):
        cases = []
        p0, d0 = _counts(p), _counts(d)
        rx = d.expect("push", [5], src=p.instance_id)
        tx = await p.push("push", d.instance_id, [2])  # pipelined, but short: one frame
        for layer in range(layers):
            tx.layer_ready(layer)
        with anyio.fail_after(20):
            res = await rx.result()
            assert res.ok and (await tx.result()).ok, res
        assert res.path.startswith(path), res
        cases.append(("push", _delta(p0, p), _delta(d0, d), [2], [5]))

        p0, d0 = _counts(p), _counts(d)
        offer = p.offer("pull", [3])
        offer.all_ready()
        rx = await d.pull("pull", p.instance_id, [6], secret=offer.secret)
        with anyio.fail_after(20):
            assert (await rx.result()).ok and (await offer.result()).ok
        cases.append(("pull", _delta(p0, p), _delta(d0, d), [3], [6]))

        p0, d0 = _counts(p), _counts(d)
        tx = await p.push("staged", d.instance_id, [4], mode="eager")
        tx.all_ready()
        with anyio.fail_after(20):
            assert (await tx.result()).ok  # whole in the decode's staging
        rx = d.expect("staged", [7], src=p.instance_id)
        with anyio.fail_after(20):
            assert (await rx.result()).ok
        cases.append(("staged", _delta(p0, p), _delta(d0, d), [4], [7]))

        for name, sent, received, src, dst in cases:
            assert _same(p, d, src, dst), f"{name}: bytes differ"
            assert sent["frames_sent"] == 1 and received["frames_received"] == 1, \
                (name, sent, received)
            # A staged push is copied twice here: into staging, then into the blocks the
            # engine reserves later.
            copies = 2 if name == "staged" else 1
            assert sent["copy_jobs"] <= 1 and received["copy_jobs"] <= copies, \
                (name, sent, received)
        await settle(p, d)
        assert_at_rest(p, d)


async def test_a_long_transfer_still_streams_layer_by_layer(nats_server: Any) -> None:
    """Over ``whole_frame_bytes`` a pipelined push sends each layer as it is ready."""
    layers = 8
    async with _pair(nats_server, "ucx", layers, whole_frame_bytes=1024) as (p, d):
        before = _counts(p)
        rx = d.expect("long", [1, 3], src=p.instance_id)
        tx = await p.push("long", d.instance_id, [2, 4])
        tx.layer_ready(0)
        with anyio.fail_after(20):
            await rx.wait_layer(0)  # before any other layer is ready
        tx.all_ready()
        with anyio.fail_after(20):
            assert (await rx.result()).ok and (await tx.result()).ok
        assert _same(p, d, [2, 4], [1, 3])
        assert _delta(before, p)["frames_sent"] == layers
