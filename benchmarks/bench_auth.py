"""What authentication costs: boxed control messages and MACed data-plane frames, against
the same transfers with both turned off, in one run.

    .venv/bin/python benchmarks/bench_auth.py [--small 200] [--large 4] [--json OUT]

Two agents in two processes on one host (the default same-host path, ``shm``, KV in
shared memory), a Llama-8B-like layout (32 layers x 8 KV heads x 128, fp16, block 16).
Each variant runs in fresh processes, alternating ``auth`` and ``off`` twice:

* ``auth``: as shipped (messages for one peer boxed, headers and credits MACed);
* ``off``: the worker processes patch both out before their agents start (boxing falls
  back to the Ed25519 signatures every message had before; MACs become constant bytes),
  so the difference is what authentication adds, or saves, per transfer.

Measured: ``--small`` one-block eager pushes (CPU time per transfer of each process,
``time.process_time`` over the loop, and wall time per transfer), then ``--large``
512 MiB eager pushes (the best wall time). The bars: at most 0.2 ms of CPU more per side
per one-block transfer, and at most 5 % more time on 512 MiB.
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
LARGE_BLOCKS = 256  # 4096 tokens: 512 MiB over 32 layers
NUM_BLOCKS = LARGE_BLOCKS + 8


def _patch_off() -> None:
    """Authentication out: boxing falls back to signing, MACs are constant bytes."""
    from kvstream.control.identity import Identity
    from kvstream.dataplane.wire import FrameMac

    Identity.box = lambda self, *a, **k: None  # type: ignore[method-assign]
    FrameMac._mac = lambda self, data: bytes(16)  # type: ignore[method-assign]


def _worker(role: str, auth: bool, nats_url: str, cmds: Any, out: Any) -> None:
    import anyio
    import torch

    if not auth:
        _patch_off()
    from kvstream import Agent, AgentConfig, KVLayout
    from kvstream.shm import SharedKV

    layout = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_size=BLOCK)
    me, peer = ("p", "d") if role == "prefill" else ("d", "p")

    async def main() -> None:
        kv = SharedKV.create(layout, NUM_BLOCKS)
        if role == "prefill":
            for t in kv.layers:
                t.copy_(torch.randn(t.shape).to(t.dtype))
        cfg = AgentConfig(instance_id=me, role=role, nats_url=nats_url,  # type: ignore[arg-type]
                          staging_bytes=1 << 30)
        async with Agent(cfg, layout=layout, kv_caches=kv.layers) as agent:
            while agent.registry.announced(peer) is None:
                await anyio.sleep(0.05)
            out.put(("up", role))
            while True:
                cmd = await anyio.to_thread.run_sync(cmds.get)
                if cmd[0] == "stop":
                    break
                _, kind, n, phase = cmd
                blocks = [0] if kind == "small" else list(range(LARGE_BLOCKS))
                cpu0, times = time.process_time(), []
                for i in range(n):
                    rid = f"{phase}-{kind}-{i}"
                    t0 = time.perf_counter()
                    if role == "decode":
                        handle = agent.expect(rid, blocks, src=peer)
                        out.put(("ready", i))
                        result = await handle.wait()
                    else:
                        await anyio.to_thread.run_sync(cmds.get)  # the decode expects it
                        send = await agent.push(rid, peer, blocks, mode="eager")
                        send.all_ready()
                        result = await send.wait()
                    if not result.ok:
                        raise SystemExit(f"{role}: {rid} {result.status}: {result.reason}")
                    times.append(time.perf_counter() - t0)
                out.put(("done", role, time.process_time() - cpu0, times))

    anyio.run(main)


def _variant(auth: bool, nats_url: str, small: int, large: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cmds = {r: ctx.Queue() for r in ("prefill", "decode")}
    procs = [ctx.Process(target=_worker, args=(r, auth, nats_url, cmds[r], out), daemon=True)
             for r in ("decode", "prefill")]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            out.get(timeout=120)
        res: dict[str, Any] = {}
        # Warm-up first (kernels built, pages touched, endpoints made), then timed.
        phases = (("small", 10, "warm"), ("large", 1, "warm"), ("small", small, "timed"),
                  ("large", large, "timed"))
        for kind, n, phase in phases:
            for r in cmds:
                cmds[r].put(("run", kind, n, phase))
            done: dict[str, Any] = {}
            while len(done) < 2:
                msg = out.get(timeout=600)
                if msg[0] == "ready":
                    cmds["prefill"].put(("go",))
                else:
                    done[msg[1]] = msg
            if phase == "warm":
                continue
            res[kind] = {
                "cpu_ms_per_transfer": {r: done[r][2] / n * 1e3 for r in done},
                "p50_ms": statistics.median(done["prefill"][3]) * 1e3,
                "best_ms": min(done["prefill"][3]) * 1e3,
            }
        for r in cmds:
            cmds[r].put(("stop",))
        return res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", type=int, default=200, help="one-block transfers per variant")
    ap.add_argument("--large", type=int, default=4, help="512 MiB transfers per variant")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    from kvstream.control.nats_server import EmbeddedNats

    runs: dict[str, list[dict[str, Any]]] = {"auth": [], "off": []}
    with EmbeddedNats() as nats:
        for auth in (True, False, True, False):
            runs["auth" if auth else "off"].append(
                _variant(auth, nats.url, args.small, args.large))

    def med(name: str, f: Any) -> float:
        return statistics.median(f(r) for r in runs[name])

    def cpu_of(side: str) -> Any:
        return lambda r: r["small"]["cpu_ms_per_transfer"][side]

    report: dict[str, Any] = {"runs": runs}
    for side in ("prefill", "decode"):
        on, off = med("auth", cpu_of(side)), med("off", cpu_of(side))
        report[f"small_cpu_ms_{side}"] = {"auth": on, "off": off, "added": on - off}
    on = med("auth", lambda r: r["small"]["p50_ms"])
    off = med("off", lambda r: r["small"]["p50_ms"])
    report["small_p50_ms"] = {"auth": on, "off": off}
    on = min(r["large"]["best_ms"] for r in runs["auth"])
    off = min(r["large"]["best_ms"] for r in runs["off"])
    report["large_best_ms"] = {"auth": on, "off": off, "ratio": on / off}
    added = max(report[f"small_cpu_ms_{s}"]["added"] for s in ("prefill", "decode"))
    report["bars"] = {"cpu_added_ms_per_side<=0.2": added <= 0.2,
                      "large_ratio<=1.05": report["large_best_ms"]["ratio"] <= 1.05}
    text = json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(report["bars"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
