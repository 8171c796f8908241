"""Agents run in child processes for the integration tests (spawned, killed at will)."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec

from kvstream.layout import KVLayout


def _cfg(instance_id: str, nats_url: str) -> Any:
    from kvstream.config import AgentConfig

    # Layer by layer however short: these peers are killed or stopped between layers.
    return AgentConfig(instance_id=instance_id, nats_url=nats_url, heartbeat_s=0.25,
                       peer_timeout_s=1.0, request_timeout_s=1.0, whole_frame_bytes=0)


def decode_peer(layout_blob: bytes, nats_url: str, request_id: str, blocks: list[int],
                src: str, q: Any) -> None:
    """Reserve ``blocks`` for ``request_id`` (a push from ``src`` only), report, and wait
    for the transfer."""
    from kvstream.engine.agent import Agent
    from tests.fakes import cache

    layout = msgspec.msgpack.decode(layout_blob, type=KVLayout)

    async def main() -> None:
        async with Agent(_cfg("peer-decode", nats_url), layout=layout,
                         kv_caches=cache(layout, 32, fill=False)) as agent:
            handle = agent.expect(request_id, blocks, src=src)
            q.put("ready")
            result = await handle.result()
            q.put(result.status)
            await anyio.sleep(0.5)

    anyio.run(main)


def prefill_peer(layout_blob: bytes, nats_url: str, request_id: str, dst: str,
                 blocks: list[int], ready_layers: int, q: Any, shared: bool = False) -> None:
    """Push to ``dst``, mark only ``ready_layers`` layers ready, then hang (to be killed).
    ``shared``: its KV in shared memory (a same-host destination reads it directly)."""
    from kvstream.engine.agent import Agent
    from tests.fakes import cache

    layout = msgspec.msgpack.decode(layout_blob, type=KVLayout)

    async def main() -> None:
        kv = cache(layout, 32, fill=True)
        if shared:
            from kvstream.shm import SharedKV

            mem = SharedKV.create(layout, 32)
            for t, src in zip(mem.layers, kv, strict=True):
                t.copy_(src)
            kv = mem.layers
        async with Agent(_cfg("peer-prefill", nats_url), layout=layout,
                         kv_caches=kv) as agent:
            handle = await agent.push(request_id, dst, blocks)
            for layer in range(ready_layers):
                handle.layer_ready(layer)
            q.put("pushed")
            await handle.result()
            q.put("ended")
            await anyio.sleep(60)

    anyio.run(main)


def offering_peer(layout_blob: bytes, nats_url: str, request_id: str, blocks: list[int],
                  ready_layers: int, q: Any) -> None:
    """Offer ``blocks`` for a pull, mark only ``ready_layers`` layers ready, then hang.

    Puts ``("offered", secret)`` on ``q``: the secret the test's pull must present."""
    from kvstream.engine.agent import Agent
    from tests.fakes import cache

    layout = msgspec.msgpack.decode(layout_blob, type=KVLayout)

    async def main() -> None:
        async with Agent(_cfg("peer-offer", nats_url), layout=layout,
                         kv_caches=cache(layout, 32, fill=True)) as agent:
            handle = agent.offer(request_id, blocks)
            for layer in range(ready_layers):
                handle.layer_ready(layer)
            q.put(("offered", handle.secret))
            await anyio.sleep(60)

    anyio.run(main)


def offer_secret(request_id: str) -> str:
    """The secret ``random_source_peer`` offers ``request_id`` with (the test's pulls
    present it, as a destination told by the router would)."""
    return f"random-source-secret-{request_id}"


def random_source_peer(layout_blob: bytes, nats_url: str, dst: str, seed: int, q: Any) -> None:
    """Push to ``dst`` and offer for pulls, requests k0, k1, ... at random, until killed.

    Each offer's secret is ``offer_secret(request_id)``."""
    import random

    from kvstream import KVStreamError
    from kvstream.engine.agent import Agent
    from tests.fakes import cache

    layout = msgspec.msgpack.decode(layout_blob, type=KVLayout)
    rng = random.Random(seed)

    async def main() -> None:
        cfg = _cfg("peer-random", nats_url)
        cfg = msgspec.structs.replace(cfg, lease_s=1.0, staging_wait_s=0.2)
        async with Agent(cfg, layout=layout, kv_caches=cache(layout, 64, fill=True)) as agent:
            q.put("up")
            handles = []
            for n in range(100_000):
                blocks = rng.sample(range(64), 2)
                try:
                    if rng.random() < 0.5:
                        handles.append(await agent.push(f"k{n}", dst, blocks))
                    else:
                        handles.append(agent.offer(f"k{n}", blocks,
                                                   secret=offer_secret(f"k{n}")))
                except KVStreamError:
                    pass
                for h in rng.sample(handles, min(3, len(handles))):
                    if not h.done:
                        h.layer_ready(rng.randrange(layout.num_layers))
                handles = [h for h in handles if not h.done]
                await anyio.sleep(0.01)

    anyio.run(main)


def keeping_peer(nats_url: str, request_id: str, src: str, secret: str, q: Any) -> None:
    """Keep a lease on ``request_id`` at ``src`` (whose offer's secret is ``secret``), then
    hang (to be killed)."""
    from kvstream.engine.agent import Agent

    async def main() -> None:
        async with Agent(_cfg("peer-keeper", nats_url)) as agent:
            await agent.keep(request_id, src, secret=secret)
            q.put("kept")
            await anyio.sleep(60)

    anyio.run(main)
