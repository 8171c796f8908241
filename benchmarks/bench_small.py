"""Short transfers: latency, throughput and CPU per transfer, per path and size.

    .venv/bin/python benchmarks/bench_small.py [--paths shm,ucx,tcp] [--blocks 1,8,64]
        [--n 200] [--inflight 1,8,32] [--framing whole,layered] [--json OUT]

Two agents in two processes (a prefill and a decode) on one host, a Llama-8B-like layout
(32 layers x 8 KV heads x 128, fp16, block 16: 2 MiB per block over all layers), KV in
shared memory, every transfer verified complete. For each framing, path and size:

* ``push``: the decode reserves ``--n`` requests up front, the prefill pushes them one
  after another (eager, all layers ready), timing each from ``push()`` to its end (the
  decode's Done); ``pull``: the prefill offers them up front, the decode pulls them one
  after another, timing each from ``pull()`` to its last byte;
* CPU milliseconds per transfer of each process (``time.process_time``: all threads)
  over the sequential loop;
* ``--inflight`` k: 1-block pushes with k in flight at once, transfers per second.

``--framing layered`` sets ``whole_frame_bytes`` 0 (every layer its own frame, how every
transfer moved before short ones became one frame): the same-run baseline.
``tcp`` is what two hosts would use (the agents announce different host ids).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16
PATHS = {"shm": ("shm", "ucx"), "ucx": ("ucx",), "tcp": ("tcp", "ucx")}


def _worker(role: str, path: str, framing: str, nats_url: str, nblocks: int, cmds: Any,
            out: Any) -> None:
    import anyio
    import torch

    from kvstream import Agent, AgentConfig, KVLayout
    from kvstream.shm import SharedKV

    layout = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_size=BLOCK)
    me, peer = (f"p-{path}", f"d-{path}") if role == "prefill" else (f"d-{path}", f"p-{path}")

    async def main() -> None:
        kv = SharedKV.create(layout, nblocks)
        if role == "prefill":
            for t in kv.layers:
                t.copy_(torch.randn(t.shape).to(t.dtype))
        layered = {"whole_frame_bytes": 0} if framing == "layered" else {}
        cfg = AgentConfig(  # type: ignore[arg-type]
            instance_id=me, role=role, nats_url=nats_url, staging_bytes=1 << 30,
            paths=PATHS[path], host_id=f"host-{role}" if path == "tcp" else "", **layered)
        async with Agent(cfg, layout=layout, kv_caches=kv.layers) as agent:
            while agent.registry.announced(peer) is None:
                await anyio.sleep(0.05)
            out.put(("up", role))
            while True:
                cmd = await anyio.to_thread.run_sync(cmds.get)
                if cmd[0] == "stop":
                    break
                out.put(await _run(agent, role, peer, *cmd[1:]))

    async def _run(agent: Any, role: str, peer: str, op: str, size: int, n: int,
                   inflight: int, tag: str) -> tuple[Any, ...]:
        blocks = list(range(size))
        rids = [f"{tag}-{i}" for i in range(n)]
        # Set up: reservations (push) or offers (pull), then both sides meet at a barrier.
        held: list[Any] = []
        if op == "push" and role == "decode":
            held = [agent.expect(rid, blocks, src=peer) for rid in rids]
        if op == "pull" and role == "prefill":
            held = [agent.offer(rid, blocks) for rid in rids]
            for h in held:
                h.all_ready()
            out.put(("secrets", [h.secret for h in held]))
        secrets = (await anyio.to_thread.run_sync(cmds.get))[1] if op == "pull" and \
            role == "decode" else []
        out.put(("ready", role))
        await anyio.to_thread.run_sync(cmds.get)  # go
        cpu0, wall0, times = time.process_time(), time.perf_counter(), []
        active = (op == "push" and role == "prefill") or (op == "pull" and role == "decode")
        if active:
            async def one(i: int) -> None:
                t0 = time.perf_counter()
                if op == "push":
                    h = await agent.push(rids[i], peer, blocks, mode="eager")
                    h.all_ready()
                else:
                    h = await agent.pull(rids[i], peer, blocks, secret=secrets[i])
                result = await h.wait()
                if not result.ok:
                    raise SystemExit(f"{role}: {rids[i]} {result.status}: {result.reason}")
                times.append(time.perf_counter() - t0)

            async def lane(k: int) -> None:
                for i in range(k, n, inflight):
                    await one(i)

            async with anyio.create_task_group() as tg:
                for k in range(inflight):
                    tg.start_soon(lane, k)
        else:
            for h in held:
                result = await h.wait()
                if not result.ok:
                    raise SystemExit(f"{role}: {result.status}: {result.reason}")
        return ("done", role, time.process_time() - cpu0, time.perf_counter() - wall0, times)

    anyio.run(main)


class Pair:
    """A prefill and a decode process for one path and framing."""

    def __init__(self, path: str, framing: str, nats_url: str, nblocks: int) -> None:
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.cmds = {r: ctx.Queue() for r in ("prefill", "decode")}
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, path, framing, nats_url, nblocks, self.cmds[r],
                                        self.out)) for r in ("decode", "prefill")]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self.out.get(timeout=120)
        self.runs = 0

    def run(self, op: str, size: int, n: int, inflight: int = 1) -> dict[str, Any]:
        self.runs += 1
        tag = f"{op}-{size}-{inflight}-{self.runs}"
        for q in self.cmds.values():
            q.put(("run", op, size, n, inflight, tag))
        ready, done = 0, {}
        while len(done) < 2:
            msg = self.out.get(timeout=600)
            if msg[0] == "secrets":
                self.cmds["decode"].put(msg)
            elif msg[0] == "ready":
                ready += 1
                if ready == 2:
                    for q in self.cmds.values():
                        q.put(("go",))
            else:
                done[msg[1]] = msg
        active = "prefill" if op == "push" else "decode"
        times = sorted(done[active][4])
        wall = done[active][3]
        return {"p50_ms": statistics.median(times) * 1e3,
                "p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3,
                "per_s": n / wall,
                "cpu_ms": {r: done[r][2] / n * 1e3 for r in done}}

    def close(self) -> None:
        for q in self.cmds.values():
            q.put(("stop",))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="shm,ucx,tcp")
    ap.add_argument("--blocks", default="1,8,64")
    ap.add_argument("--n", type=int, default=200, help="transfers per measurement")
    ap.add_argument("--inflight", default="1,8,32")
    ap.add_argument("--framing", default="whole,layered")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    from kvstream.control.nats_server import EmbeddedNats

    sizes = [int(x) for x in args.blocks.split(",")]
    results: list[dict[str, Any]] = []
    with EmbeddedNats() as nats:
        for framing in args.framing.split(","):
            for path in args.paths.split(","):
                pair = Pair(path, framing, nats.url, max(sizes))
                try:
                    for size in sizes:
                        pair.run("push", size, 10)  # warm-up: endpoints, pages, kernels
                        n = max(20, args.n // size)
                        for op in ("push", "pull"):
                            r = pair.run(op, size, n)
                            results.append({"framing": framing, "path": path, "op": op,
                                            "blocks": size, "inflight": 1, **r})
                            _show(results[-1])
                    for k in (int(x) for x in args.inflight.split(",")):
                        if k == 1:
                            continue
                        r = pair.run("push", 1, max(args.n, 4 * k), inflight=k)
                        results.append({"framing": framing, "path": path, "op": "push",
                                        "blocks": 1, "inflight": k, **r})
                        _show(results[-1])
                finally:
                    pair.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _show(r: dict[str, Any]) -> None:
    cpu = r["cpu_ms"]
    print(f"{r['framing']:8} {r['path']:4} {r['op']:4} {r['blocks']:3} blocks "
          f"x{r['inflight']:<3} p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  "
          f"{r['per_s']:7.0f}/s  CPU/transfer prefill {cpu['prefill']:6.2f} ms "
          f"decode {cpu['decode']:6.2f} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
