"""The prefill and decode processes of the benchmark and the demo.

Each runs one Agent (or, with ``--sidecar``, an engine talking to a sidecar
process) and obeys commands from the parent over a multiprocessing queue (the
harness's own wiring; kvstream traffic goes over NATS and UCX).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec

from kvstream.bench.synthetic import BenchSpec, make_cache

__all__ = ["Cmd", "Event", "decode_main", "prefill_main", "sidecar_main"]


class Cmd(msgspec.Struct, kw_only=True):
    op: str  # "kv" | "raw" | "stop"
    run: int = 0
    request_id: str = ""
    blocks: list[int] = []
    src_blocks: list[int] = []  # decode side: what to verify against
    peer: str = ""
    peer_address: bytes = b""
    mode: str = "pipelined"  # push: pipelined | eager
    pull: str = ""  # "" (push) | eager | lazy
    hit_blocks: int = 0  # the first blocks are already at the destination (incremental)
    compute_ms: float = 0.0
    codec: str = "none"
    wire: bool = False
    verify: bool = True
    report_layers: bool = False
    tamper: bool = False  # decode side: flip a byte after the transfer (a fault for tests)


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
    overhead_us: list[float] = []  # per-call engine->agent cost (layer_ready / wait_layer)
    waited_s: float = 0.0  # lazy pull: time the decode forward stalled on KV
    wire_bytes: int = 0  # bytes this transfer received over the wire
    codec: str = "none"  # the codec the transfer was negotiated with
    path: str = ""  # the data-plane path it took (dataplane/paths.py)


def _config(instance_id: str, nats_url: str, role: str, spec: BenchSpec) -> Any:
    from kvstream.config import AgentConfig

    paths = ("shm", "cuda_ipc", "tcp", "ucx") if not spec.path else \
        tuple(dict.fromkeys((spec.path, "ucx")))
    config = AgentConfig(instance_id=instance_id, role=role, nats_url=nats_url,  # type: ignore[arg-type]
                         transfer_timeout_s=120.0, progress_mode=spec.progress_mode,
                         namespace=spec.namespace, paths=paths,
                         host_id=f"bench-host-{role}" if spec.host_ids else "")
    return msgspec.structs.replace(config, whole_frame_bytes=0) if spec.layered else config


async def _commands(cmd_q: Any) -> AsyncIterator[Cmd]:
    while True:
        cmd: Cmd = await anyio.to_thread.run_sync(cmd_q.get)
        if cmd.op == "stop":
            return
        yield cmd


def _sender_layers(spec: BenchSpec, mem: Any, src_ids: list[int]) -> Any:
    """Yield (layer, staging view of the sender's src blocks), regenerated here."""
    import msgspec
    import torch

    from kvstream.bench.synthetic import fill_layer
    from kvstream.memory import RegisteredKV

    src_map = mem.block_map(src_ids)
    expect_layer = torch.empty_like(mem.layers[0])
    # The sender's cache has the same shape; one scratch layer stands for each of its layers.
    ref = RegisteredKV(msgspec.structs.replace(spec.layout, num_layers=1), [expect_layer])
    want = torch.empty(mem.planes * mem.plane_bytes(len(src_ids)), dtype=torch.uint8)
    for layer in range(spec.layout.num_layers):
        fill_layer(expect_layer, layer, spec.data, spec.seed)
        ref.gather(0, src_map, ref.staging_view(want, len(src_ids)))
        yield layer, ref.staging_view(want, len(src_ids))


def _verify(spec: BenchSpec, mem: Any, src_ids: list[int], dst_ids: list[int],
            codec: str = "none") -> bool:
    """Compare every destination block with the sender's data, regenerated here: bit for
    bit, or within the codec's documented error bound."""
    import torch

    from kvstream.quant import reference
    from kvstream.quant.scheme import scale_groups

    lay = spec.layout
    dst_map = mem.block_map(dst_ids)
    got = torch.empty(mem.planes * mem.plane_bytes(len(dst_ids)), dtype=torch.uint8)
    for layer, want in _sender_layers(spec, mem, src_ids):
        mem.gather(layer, dst_map, mem.staging_view(got, len(dst_ids)))
        if codec == "none":
            if not torch.equal(got.view(want.dtype).view(want.shape), want):
                return False
            continue
        shape = (lay.chunks_per_block, len(dst_ids), *scale_groups(lay))
        dtype = getattr(torch, lay.dtype)
        if not reference.within_bound(want.contiguous().view(torch.uint8).view(dtype).view(shape),
                                      got.view(dtype).view(shape), codec):
            return False
    return True


def _use_transport(spec: BenchSpec) -> None:
    """Restrict UCX to ``spec.transport`` in this process (read when its context starts)."""
    if spec.transport:
        os.environ["UCX_TLS"] = spec.transport


@contextlib.contextmanager
def _tracing(spec: BenchSpec, role: str) -> Any:
    """With ``spec.trace_dir``, this process exports its spans to ``<dir>/<role>.jsonl``."""
    if not spec.trace_dir:
        yield
        return
    from kvstream.tools.otel import configure

    shutdown = configure(f"kvstream-bench-{role}",
                         span_file=os.path.join(spec.trace_dir, f"{role}.jsonl"), otlp=False)
    try:
        yield
    finally:
        shutdown()


def _prepare(spec: BenchSpec, mem: Any, src_ids: list[int], dst_ids: list[int],
             hit: int) -> None:
    """Zero the destination blocks (a previous run's bytes must not pass verification),
    then put the first ``hit`` blocks' KV there, as a prefix cache hit would have."""
    dst_map = mem.block_map(dst_ids)
    for layer in range(spec.layout.num_layers):
        for p in range(mem.planes):
            mem._planes[layer][p].index_fill_(0, dst_map.index, 0)
    if hit:
        held = mem.block_map(dst_ids[:hit])
        for layer, want in _sender_layers(spec, mem, src_ids[:hit]):
            mem.scatter(layer, held, want)


def _tamper(mem: Any, dst_ids: list[int]) -> None:
    """Flip one byte of the first destination block, as silent corruption would."""
    import torch

    block = mem._planes[0][0][int(mem.block_map(dst_ids[:1]).index[0])]
    flat = block.view(torch.uint8).view(-1)
    flat[0] = flat[0] ^ 0xFF


class _Side:
    """What a command handler works with: a client (in-process or sidecar) and the memory."""

    def __init__(self, client: Any, memory: Any, agent: Any = None, address: bytes = b"") -> None:
        self.client = client
        self.memory = memory
        self.agent = agent  # None when the agent lives in a sidecar (no raw baseline then)
        self.address = address


@contextlib.asynccontextmanager
async def _open_side(spec: BenchSpec, role: str, target: str) -> AsyncIterator[_Side]:
    """``target`` is a NATS URL (agent in this process) or ``unix:<socket>`` (a sidecar)."""
    from kvstream.client import Client
    from kvstream.memory import RegisteredKV

    if target.startswith("unix:"):
        import torch

        from kvstream.bench.synthetic import fill_layer
        from kvstream.shm import SharedKV

        shared = SharedKV.create(spec.layout, spec.num_cache_blocks)
        for i, t in enumerate(shared.layers):
            if role == "prefill":
                fill_layer(t, i, spec.data, spec.seed)
            else:
                t.view(torch.uint8).zero_()  # touch every page before timing, as make_cache does
        async with Client.connect(target[5:]) as client:
            await client.register_kv(spec.layout, shared)
            yield _Side(client, RegisteredKV(spec.layout, shared.layers))
        return
    from kvstream.engine.agent import Agent

    cache = make_cache(spec, fill=role == "prefill", shared=True)
    async with Agent(_config(f"bench-{role}", target, role, spec), layout=spec.layout,
                     kv_caches=cache) as agent:
        yield _Side(Client.local(agent), agent.memory, agent, agent.worker_address)


async def _serve(spec: BenchSpec, target: str, role: str, cmd_q: Any, evt_q: Any,
                 handle_cmd: Any) -> None:
    """One side, one command at a time; a failed command is reported, not fatal."""
    import torch

    torch.set_num_threads(1)  # like a sidecar: these processes only copy blocks
    async with _open_side(spec, role, target) as side:
        evt_q.put(Event(kind="up", address=side.address))
        async for cmd in _commands(cmd_q):
            try:
                evt_q.put(await handle_cmd(side, cmd))
            except Exception as exc:
                evt_q.put(Event(kind="error", run=cmd.run, reason=f"{type(exc).__name__}: {exc}"))


def _secret(request_id: str) -> str:
    """The offer secret both bench sides derive (one harness drives both: nothing to hide
    from each other; a deployment's router passes the source's own instead)."""
    return f"kvstream-bench-{request_id}"


def _us_since(t: int) -> float:
    return (time.perf_counter_ns() - t) / 1e3


def decode_main(spec_bytes: bytes, target: str, cmd_q: Any, evt_q: Any) -> None:
    spec = msgspec.msgpack.decode(spec_bytes, type=BenchSpec)
    if spec.decode_netns:  # "another host": before UCX, NATS or any thread starts
        from kvstream.bench.netns import enter

        enter(spec.decode_netns)
    _use_transport(spec)

    async def handle_cmd(side: _Side, cmd: Cmd) -> Event:
        from kvstream.bench.raw import raw_receive

        def ready() -> None:
            evt_q.put(Event(kind="ready", run=cmd.run))

        if cmd.op == "raw":
            t = await raw_receive(side.memory, side.memory.block_map(cmd.blocks), cmd.run,
                                  wire=cmd.wire, ready=ready)
            return Event(kind="done", run=cmd.run, t=t, status="completed")
        if cmd.verify:
            await anyio.to_thread.run_sync(_prepare, spec, side.memory, cmd.src_blocks,
                                           cmd.blocks, cmd.hit_blocks)
        before = (await side.client.statistics())["bytes_received"]
        have = spec.block_hashes[:cmd.hit_blocks] if cmd.hit_blocks else []
        t0, waited = time.monotonic(), 0.0
        if cmd.pull:
            handle = await side.client.pull(cmd.request_id, cmd.peer, cmd.blocks,
                                            mode=cmd.pull, have=have, codec=cmd.codec,
                                            secret=_secret(cmd.request_id))
            if cmd.pull == "lazy":  # the decode forward: each layer's KV just before it
                for layer in range(spec.layout.num_layers):
                    t = time.monotonic()
                    try:
                        await handle.wait_layer(layer)
                    except Exception:
                        break
                    waited += time.monotonic() - t
                    if cmd.compute_ms:
                        await anyio.sleep(cmd.compute_ms / 1e3)
        else:
            handle = await side.client.expect(cmd.request_id, cmd.blocks, src=cmd.peer,
                                              have=have)
            ready()
        if cmd.report_layers:
            for layer in range(spec.layout.num_layers):
                try:
                    await handle.wait_layer(layer)
                except Exception:
                    break
                evt_q.put(Event(kind="layer", run=cmd.run, layer=layer, t=time.monotonic()))
        result = await handle.result()
        wait_us = []
        if result.ok:  # the engine's per-layer check once a layer is there
            for layer in range(spec.layout.num_layers):
                t = time.perf_counter_ns()
                await handle.wait_layer(layer)
                wait_us.append(_us_since(t))
        verified = False
        if result.ok and cmd.tamper:
            _tamper(side.memory, cmd.blocks)
        if result.ok and cmd.verify:
            verified = await anyio.to_thread.run_sync(
                _verify, spec, side.memory, cmd.src_blocks, cmd.blocks, result.codec)
        stats = await side.client.statistics()
        return Event(kind="done", run=cmd.run, t=result.ended_at, t0=t0, status=result.status,
                     reason=result.reason, verified=verified, stats=stats, overhead_us=wait_us,
                     waited_s=waited, wire_bytes=stats["bytes_received"] - before,
                     codec=result.codec, path=result.path)

    with _tracing(spec, "decode"):
        anyio.run(_serve, spec, target, "decode", cmd_q, evt_q, handle_cmd)


def prefill_main(spec_bytes: bytes, target: str, cmd_q: Any, evt_q: Any) -> None:
    spec = msgspec.msgpack.decode(spec_bytes, type=BenchSpec)
    _use_transport(spec)

    async def handle_cmd(side: _Side, cmd: Cmd) -> Event:
        from kvstream.bench.raw import raw_send

        if cmd.op == "raw":
            t0 = await raw_send(side.memory, side.memory.block_map(cmd.blocks), cmd.run,
                                cmd.peer_address, wire=cmd.wire)
            return Event(kind="done", run=cmd.run, t0=t0, status="completed")
        hashes = spec.block_hashes if spec.prefix_hit else None
        t0 = time.monotonic()
        if cmd.pull:
            handle = await side.client.offer(cmd.request_id, cmd.blocks, mode=cmd.mode,
                                             block_hashes=hashes, secret=_secret(cmd.request_id))
        else:
            handle = await side.client.push(cmd.request_id, cmd.peer, cmd.blocks, mode=cmd.mode,
                                            block_hashes=hashes, codec=cmd.codec)
        ready_us = []
        last_ready = 0.0
        for layer in range(spec.layout.num_layers):
            if cmd.compute_ms:
                await anyio.sleep(cmd.compute_ms / 1e3)  # the GPU computing layer L
            t = time.perf_counter_ns()
            handle.layer_ready(layer)
            ready_us.append(_us_since(t))
            last_ready = time.monotonic()
        if cmd.pull:  # computed and held: the router would now tell decode to pull
            evt_q.put(Event(kind="offered", run=cmd.run, t_last_ready=last_ready))
        result = await handle.result()
        return Event(kind="done", run=cmd.run, t0=t0, t_last_ready=last_ready,
                     status=result.status, reason=result.reason,
                     stats=await side.client.statistics(), overhead_us=ready_us)

    with _tracing(spec, "prefill"):
        anyio.run(_serve, spec, target, "prefill", cmd_q, evt_q, handle_cmd)


def sidecar_main(spec_bytes: bytes, role: str, socket_path: str, nats_url: str) -> None:
    """A sidecar process for the benchmark (what `kvstream sidecar` runs)."""
    from kvstream.sidecar.server import Sidecar

    spec = msgspec.msgpack.decode(spec_bytes, type=BenchSpec)
    _use_transport(spec)
    config = _config(f"bench-{role}", nats_url, role, spec)
    anyio.run(Sidecar(config, socket_path).serve)
