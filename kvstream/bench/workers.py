"""The prefill and decode processes of the benchmark and the demo.

Each runs one Agent and obeys commands from the parent over a multiprocessing
queue (the harness's own wiring; kvstream traffic goes over NATS and UCX).
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import msgspec

from kvstream.bench.synthetic import BenchSpec, make_cache

__all__ = ["Cmd", "Event", "decode_main", "prefill_main"]


class Cmd(msgspec.Struct, kw_only=True):
    op: str  # "kv" | "raw" | "stop"
    run: int = 0
    request_id: str = ""
    blocks: list[int] = []
    src_blocks: list[int] = []  # decode side: what to verify against
    peer: str = ""
    peer_address: bytes = b""
    mode: str = "pipelined"
    compute_ms: float = 0.0
    wire: bool = False
    verify: bool = True
    report_layers: bool = False


class Event(msgspec.Struct, kw_only=True):
    kind: str  # "up" | "ready" | "layer" | "done" | "error"
    run: int = 0
    t: float = 0.0
    t0: float = 0.0
    t_last_ready: float = 0.0
    layer: int = -1
    status: str = ""
    reason: str = ""
    verified: bool = False
    address: bytes = b""
    stats: dict[str, int] = {}


def _config(instance_id: str, nats_url: str, role: str, spec: BenchSpec) -> Any:
    from kvstream.config import AgentConfig

    return AgentConfig(instance_id=instance_id, role=role, nats_url=nats_url,  # type: ignore[arg-type]
                       transfer_timeout_s=120.0, progress_mode=spec.progress_mode)


def _stats(agent: Any) -> dict[str, int]:
    s = agent.statistics()
    return {f: getattr(s, f) for f in s.__struct_fields__ if isinstance(getattr(s, f), int)}


async def _commands(cmd_q: Any):  # type: ignore[no-untyped-def]
    while True:
        cmd: Cmd = await anyio.to_thread.run_sync(cmd_q.get)
        if cmd.op == "stop":
            return
        yield cmd


def _verify(spec: BenchSpec, mem: Any, src_ids: list[int], dst_ids: list[int]) -> bool:
    """Compare every landed block with the sender's pattern, regenerated here."""
    import torch

    from kvstream.bench.synthetic import fill_layer
    from kvstream.dataplane.memory import RegisteredKV

    src_map = mem.block_map(src_ids)
    dst_map = mem.block_map(dst_ids)
    expect_layer = torch.empty_like(mem.layers[0])
    # The sender's cache has the same shape; one scratch tensor stands for each of its layers.
    ref = RegisteredKV(spec.layout, [expect_layer] * spec.layout.num_layers)
    nbytes = mem.planes * mem.plane_bytes(len(dst_ids))
    got = torch.empty(nbytes, dtype=torch.uint8)
    want = torch.empty(nbytes, dtype=torch.uint8)
    for layer in range(spec.layout.num_layers):
        fill_layer(expect_layer, layer)
        ref.gather(layer, src_map, ref.staging_view(want, len(src_ids)))
        mem.gather(layer, dst_map, mem.staging_view(got, len(dst_ids)))
        if not torch.equal(got, want):
            return False
    return True


async def _serve(spec: BenchSpec, nats_url: str, role: str, cmd_q: Any, evt_q: Any,
                 handle_cmd: Any) -> None:
    """One agent, one command at a time; a failed command is reported, not fatal."""
    from kvstream.agent import Agent

    cache = make_cache(spec, fill=role == "prefill")
    async with Agent(_config(f"bench-{role}", nats_url, role, spec), layout=spec.layout,
                     kv_caches=cache) as agent:
        evt_q.put(Event(kind="up", address=agent.worker_address))
        async for cmd in _commands(cmd_q):
            try:
                evt_q.put(await handle_cmd(agent, cmd))
            except Exception as exc:
                evt_q.put(Event(kind="error", run=cmd.run, reason=f"{type(exc).__name__}: {exc}"))


def decode_main(spec_bytes: bytes, nats_url: str, cmd_q: Any, evt_q: Any) -> None:
    spec = msgspec.msgpack.decode(spec_bytes, type=BenchSpec)

    async def handle_cmd(agent: Any, cmd: Cmd) -> Event:
        from kvstream.bench.raw import raw_receive

        def ready() -> None:
            evt_q.put(Event(kind="ready", run=cmd.run))

        if cmd.op == "raw":
            t = await raw_receive(agent.memory, agent.memory.block_map(cmd.blocks), cmd.run,
                                  wire=cmd.wire, ready=ready)
            return Event(kind="done", run=cmd.run, t=t, status="completed")
        handle = agent.expect(cmd.request_id, cmd.blocks)
        ready()
        if cmd.report_layers:
            for layer in range(spec.layout.num_layers):
                try:
                    await handle.wait_layer(layer)
                except Exception:
                    break
                evt_q.put(Event(kind="layer", run=cmd.run, layer=layer, t=time.monotonic()))
        result = await handle.result()
        verified = False
        if result.ok and cmd.verify:
            verified = await anyio.to_thread.run_sync(
                _verify, spec, agent.memory, cmd.src_blocks, cmd.blocks)
        return Event(kind="done", run=cmd.run, t=result.ended_at, status=result.status,
                     reason=result.reason, verified=verified, stats=_stats(agent))

    anyio.run(_serve, spec, nats_url, "decode", cmd_q, evt_q, handle_cmd)


def prefill_main(spec_bytes: bytes, nats_url: str, cmd_q: Any, evt_q: Any) -> None:
    spec = msgspec.msgpack.decode(spec_bytes, type=BenchSpec)

    async def handle_cmd(agent: Any, cmd: Cmd) -> Event:
        from kvstream.bench.raw import raw_send

        if cmd.op == "raw":
            t0 = await raw_send(agent.memory, agent.memory.block_map(cmd.blocks), cmd.run,
                                cmd.peer_address, wire=cmd.wire)
            return Event(kind="done", run=cmd.run, t0=t0, status="completed")
        t0 = time.monotonic()
        handle = await agent.push(cmd.request_id, cmd.peer, cmd.blocks, mode=cmd.mode)
        for layer in range(spec.layout.num_layers):
            if cmd.compute_ms:
                await anyio.sleep(cmd.compute_ms / 1e3)  # the GPU computing layer L
            handle.layer_ready(layer)
        result = await handle.result()
        return Event(kind="done", run=cmd.run, t0=t0, t_last_ready=handle.last_ready_at or 0.0,
                     status=result.status, reason=result.reason, stats=_stats(agent))

    anyio.run(_serve, spec, nats_url, "prefill", cmd_q, evt_q, handle_cmd)
