"""A transfer between unequal layouts against one between equal layouts, the same bytes,
interleaved in one run (issue 18's bar: reshaped >= 0.8x homogeneous).

    python benchmarks/bench_reshape.py [--rounds 3] [--layers 32] [--tokens 4096]
                                       [--arrangement flash_hnd] [--micro] [--json]

Two agents in this process over an embedded nats-server and UCX (path forced to ``ucx``,
so both transfers stage through the same transport), pushing pipelined with every layer
ready: the homogeneous pair (block 16, NHD on both ends, scattered blocks) and the
reshaped pair (block 16 NHD into block 32 of ``--arrangement``, NHD by default: another
block size alone; HND also transposes every block). Both move ``layers x tokens x 8 heads x 128
x fp16 x K/V`` bytes; the reshaped one packs into the canonical wire and unpacks at the
other end (``dataplane/reshape.py``) where the homogeneous one gathers and scatters blocks.

``--micro``: no transport, one layer of ``--tokens`` on this thread, every arrangement (or
``--arrangement``): GB/s (median and best of ``--reps``) of the homogeneous gather and
scatter (``RegisteredKV``) against ``pack`` from block 16 NHD, ``unpack`` into block 32 of
the arrangement and ``pack`` from it, the copies each transfer above makes per layer.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import torch

from kvstream import Agent, AgentConfig
from kvstream.control.nats_server import EmbeddedNats
from kvstream.layout import KVLayout
from kvstream.memory import BlockMap, RegisteredKV
from kvstream.transfer.plan import pack, unpack

ARRANGEMENTS = ["flash_nhd", "flash_hnd", "blocks_first_nhd", "cpu_hnbc"]


def _cfg(name: str, url: str) -> AgentConfig:
    return AgentConfig(instance_id=name, nats_url=url, paths=("ucx",), heartbeat_s=0.5,
                       peer_timeout_s=5.0)


async def _one(p: Agent, d: Agent, rid: str, src: list[int], dst: list[int],
               tokens: int) -> float:
    rx = d.expect(rid, dst, src=p.instance_id)
    t0 = time.perf_counter()
    tx = await p.push(rid, d.instance_id, src, tokens=tokens)
    tx.all_ready()
    with anyio.fail_after(300):
        result = await rx.result()
        await tx.wait()
    if not result.ok:
        raise SystemExit(f"{rid}: {result}")
    return time.perf_counter() - t0


async def run(url: str, layers: int, tokens: int, rounds: int, arrangement: str
              ) -> dict[str, Any]:
    base: dict[str, Any] = {"num_layers": layers, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}
    lay16 = KVLayout(**base, block_size=16)
    lay32 = KVLayout(**base, block_size=32, arrangement=arrangement)
    n16, n32 = lay16.blocks_for_tokens(tokens), lay32.blocks_for_tokens(tokens)
    rng = random.Random(0)

    def cache(lay: KVLayout, n: int) -> list[torch.Tensor]:
        return [torch.randn(lay.tensor_shape(2 * n)).half() for _ in range(layers)]

    payload = layers * tokens * lay16.bytes_per_token_per_layer
    out: dict[str, list[float]] = {"homogeneous": [], "reshaped": []}
    async with Agent(_cfg("bp", url), layout=lay16, kv_caches=cache(lay16, n16)) as p, \
            Agent(_cfg("bd", url), layout=lay16, kv_caches=cache(lay16, n16)) as d, \
            Agent(_cfg("br", url), layout=lay32, kv_caches=cache(lay32, n32)) as r:
        with anyio.fail_after(20):
            while len(p.peers()) < 2:
                await anyio.sleep(0.05)
        for i in range(rounds + 1):  # the first round warms both up, not counted
            src = rng.sample(range(2 * n16), n16)
            same = await _one(p, d, f"h{i}", src, rng.sample(range(2 * n16), n16), tokens)
            other = await _one(p, r, f"r{i}", src, rng.sample(range(2 * n32), n32), tokens)
            if i:
                out["homogeneous"].append(payload / same / 1e9)
                out["reshaped"].append(payload / other / 1e9)
    h, r_ = statistics.median(out["homogeneous"]), statistics.median(out["reshaped"])
    return {"payload_bytes": payload, "gbps": out, "ratio_of_medians": round(r_ / h, 3),
            "ratios_per_round": [round(b / a, 3) for a, b in
                                 zip(out["homogeneous"], out["reshaped"], strict=True)]}


def _gbps(nbytes: int, fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(median, best) GB/s of ``fn`` moving ``nbytes``, after one call to warm up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9, nbytes / min(times) / 1e9


def micro(tokens: int, arrangements: list[str], reps: int) -> dict[str, Any]:
    """The per-layer copies of both transfers, each timed alone on this thread."""
    base: dict[str, Any] = {"num_layers": 1, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}
    lay16 = KVLayout(**base, block_size=16)
    n16 = lay16.blocks_for_tokens(tokens)
    rng = random.Random(0)
    src16 = torch.randn(lay16.tensor_shape(2 * n16)).half()
    ids16 = rng.sample(range(2 * n16), n16)
    nbytes = tokens * lay16.bytes_per_token_per_layer
    mem, blocks = RegisteredKV(lay16, [src16]), BlockMap(ids16, src16.device)
    staging = mem.staging_view(torch.empty(mem.planes * mem.plane_bytes(n16), dtype=torch.uint8),
                               n16)
    res: dict[str, Any] = {
        "layer_bytes": nbytes,
        "gather": _gbps(nbytes, lambda: mem.gather(0, blocks, staging), reps),
        "scatter": _gbps(nbytes, lambda: mem.scatter(0, blocks, staging), reps),
    }
    wire = torch.empty(2, tokens, 8, 128, dtype=torch.float16)
    res["pack flash_nhd/16"] = _gbps(nbytes, lambda: pack(src16, lay16, ids16, tokens, out=wire),
                                     reps)
    for arr in arrangements:
        lay = KVLayout(**base, block_size=32, arrangement=arr)
        n = lay.blocks_for_tokens(tokens)
        dst, ids = torch.randn(lay.tensor_shape(2 * n)).half(), rng.sample(range(2 * n), n)
        res[f"unpack {arr}/32"] = _gbps(nbytes, partial(unpack, wire, dst, lay, ids), reps)
        res[f"pack {arr}/32"] = _gbps(nbytes, partial(pack, dst, lay, ids, tokens, out=wire),
                                      reps)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--arrangement", default=None, choices=ARRANGEMENTS,
                    help="block 32's arrangement (flash_nhd; --micro: all of them)")
    ap.add_argument("--micro", action="store_true", help="per-layer copies only, no transport")
    ap.add_argument("--reps", type=int, default=30, help="--micro: timed calls per copy")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.micro:
        m = micro(a.tokens, [a.arrangement] if a.arrangement else ARRANGEMENTS, a.reps)
        if a.json:
            print(json.dumps(m))
            return
        print(f"one layer of {m.pop('layer_bytes') / (1 << 20):.0f} MiB, GB/s median (best) "
              f"of {a.reps}")
        for k, (med, best) in m.items():
            print(f"  {k:26s} {med:6.1f} ({best:.1f})")
        return
    a.arrangement = a.arrangement or "flash_nhd"
    with EmbeddedNats() as nats:
        res = anyio.run(run, nats.url, a.layers, a.tokens, a.rounds, a.arrangement)
    if a.json:
        print(json.dumps(res))
        return
    print(f"{res['payload_bytes'] / (1 << 20):.0f} MiB per transfer, {a.rounds} rounds, "
          f"block 16 NHD -> block 32 {a.arrangement}")
    for k, xs in res["gbps"].items():
        print(f"  {k:12s} GB/s {', '.join(f'{x:.2f}' for x in xs)}")
    print(f"  reshaped / homogeneous {res['ratio_of_medians']} (medians); per round "
          f"{res['ratios_per_round']}")


if __name__ == "__main__":
    main()
