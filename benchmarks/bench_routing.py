"""KV-aware routing against round robin with real vLLM engines (issue 20's first bar).

    .venv-vllm/bin/python benchmarks/bench_routing.py [--conversations 6] [--turns 4]
                                                      [--parallel 1] [--json OUT]

Two prefill and two decode ``vllm serve`` engines (CPU build, the tiny test model, block
32) with KVStreamConnector and their own KV cache events bridged to kvstream, one
``kvstream router``, and two ``kvstream proxy`` processes over the same engines: one
``--routing kv``, one ``--routing load`` (least-loaded: with one request at a time that
is round robin). The same multi-turn workload runs through each, one after the other,
each with its own tokens (no prefix shared between the runs): ``--conversations``
conversations of ``--turns`` turns, ``--parallel`` of them in flight at once; every
prompt starts with a system prompt shared by all conversations of its run, then the
conversation so far (each earlier prompt and the decode engine's answer, as token ids),
then new user tokens.

Reported per run: the prefill engines' prefix-cache hit rate (vLLM's own
``vllm:prefix_cache_hits``/``queries`` counters, prompt tokens), the best hit rate
possible for that workload (every full block of the longest prefix already prefilled
anywhere, on an unbounded cache), their ratio (the bar: kv >= 0.8), the KV bytes on the
wire (the decode engines' pulls, from the connector's event log: a decode engine that
holds the conversation's earlier blocks pulls only the new ones), and whether every
answer equals a colocated run's (the same prompt served whole by one decode engine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvstream.bench.tiny_llama import VOCAB, cached_model
from kvstream.control.nats_server import EmbeddedNats

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
NEW = 8  # tokens each answer generates
SYSTEM, USER = 96, 40  # tokens of the shared system prompt, of each user turn


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen(args, env={**os.environ, **env}, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)


def _get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


def _post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(json.loads(r.read()))


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text()[-3000:]}")
        try:
            _get(url, 2)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not up within {timeout} s: {log.read_text()[-3000:]}")


def _counter(url: str, name: str) -> float:
    text = _get(f"{url}/metrics").decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}_total(?:{{[^}}]*}})? (\S+)$",
                                             text, re.M))


def _pulled_bytes(events: Path) -> int:
    if not events.exists():
        return 0
    total = 0
    for line in events.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "pull_ended" and e.get("ok"):
            total += int(e.get("bytes", 0))
    return total


def _best_hits(prompts: list[list[int]]) -> int:
    """Prompt tokens an unbounded prefix cache could serve: per prompt, the full blocks
    of its longest prefix some earlier prompt had (block-chained, as vLLM caches)."""
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for p in prompts:
        full = len(p) // BLOCK
        n = 0
        while n < full and tuple(p[:(n + 1) * BLOCK]) in seen:
            n += 1
        # vLLM computes at least the last prompt token itself.
        hits += min(n * BLOCK, len(p) - 1)
        for k in range(1, full + 1):
            seen.add(tuple(p[:k * BLOCK]))
    return hits


def _body(model: str, prompt: list[int]) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}


def run_mode(name: str, proxy: str, engines: dict[str, str], model: str, events: Path,
             seed: int, conversations: int, turns: int, parallel: int) -> dict[str, Any]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(SYSTEM)]
    history = [list(system) for _ in range(conversations)]
    prefills = [engines["p0"], engines["p1"]]
    before = {u: (_counter(u, "vllm:prefix_cache_hits"), _counter(u, "vllm:prefix_cache_queries"))
              for u in prefills}
    bytes_before = _pulled_bytes(events)
    prompts, answers = [], []
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        for _ in range(turns):
            turn = [history[c] + [rng.randrange(3, VOCAB) for _ in range(USER)]
                    for c in range(conversations)]
            # ``parallel`` conversations at a time (their requests overlap in the engines).
            got = list(pool.map(lambda p: _post(f"{proxy}/v1/completions", _body(model, p)),
                                turn))
            for c, (prompt, reply) in enumerate(zip(turn, got, strict=True)):
                choice = reply["choices"][0]
                answer = choice.get("token_ids") or [rng.randrange(3, VOCAB)
                                                     for _ in range(NEW)]
                prompts.append(prompt)
                answers.append(choice["text"])
                history[c] = prompt + list(answer)
    seconds = time.monotonic() - started
    time.sleep(1.0)  # the last pulls' events and metrics
    hits = sum(_counter(u, "vllm:prefix_cache_hits") - before[u][0] for u in prefills)
    queries = sum(_counter(u, "vllm:prefix_cache_queries") - before[u][1] for u in prefills)
    best = _best_hits(prompts)
    wire = _pulled_bytes(events) - bytes_before
    # Colocated: every prompt served whole by one decode engine (no transfer).
    same = sum(_post(f"{engines['d0']}/v1/completions", _body(model, p))["choices"][0]["text"]
               == a for p, a in zip(prompts, answers, strict=True))
    return {"mode": name, "requests": len(prompts), "prompt_tokens": int(queries),
            "hit_tokens": int(hits), "hit_rate": hits / queries if queries else 0.0,
            "best_hit_rate": best / sum(len(p) for p in prompts),
            "of_best": (hits / best) if best else 0.0, "wire_bytes": wire,
            "tokens_equal_colocated": f"{same}/{len(prompts)}", "seconds": round(seconds, 1)}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--conversations", type=int, default=6)
    cli.add_argument("--turns", type=int, default=4)
    cli.add_argument("--parallel", type=int, default=1,
                     help="conversations whose turns are in flight at once (1: one request "
                          "at a time, so load never outweighs a prefix)")
    cli.add_argument("--json", help="also write the results here")
    a = cli.parse_args()
    model = str(cached_model())
    root = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    events = root / "events.jsonl"
    kvs = str(Path(sys.executable).parent / "kvstream")
    procs: list[subprocess.Popen[bytes]] = []
    with EmbeddedNats() as nats:
        try:
            engines: dict[str, str] = {}
            for name, role in (("p0", "kv_producer"), ("p1", "kv_producer"),
                               ("d0", "kv_consumer"), ("d1", "kv_consumer")):
                port = _port()
                url = engines[name] = f"http://127.0.0.1:{port}"
                cfg: dict[str, Any] = {
                    "kv_connector": "KVStreamConnector",
                    "kv_connector_module_path": "kvstream.adapters.vllm", "kv_role": role,
                    "kv_connector_extra_config": {"nats_url": nats.url, "heartbeat_s": 1.0,
                                                  "peer_timeout_s": 10.0,
                                                  "instance_id": f"bench-{name}",
                                                  "endpoint": url}}
                if role == "kv_consumer":
                    cfg["kv_load_failure_policy"] = "recompute"
                kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                             "endpoint": f"tcp://*:{_port()}", "topic": "kv"}
                env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                       "VLLM_LOGGING_LEVEL": "WARNING", "KVSTREAM_VLLM_EVENTS": str(events),
                       "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                       "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
                procs.append(_spawn(
                    [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                     model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                     "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "1024",
                     "--max-num-seqs", "8", "--seed", "0",
                     "--kv-transfer-config", json.dumps(cfg),
                     "--kv-events-config", json.dumps(kv_events)], env, root / f"{name}.log"))
            for (name, url), proc in zip(engines.items(), procs, strict=True):
                _wait(f"{url}/health", proc, root / f"{name}.log")
            procs.append(_spawn([kvs, "router", "--nats-url", nats.url], {},
                                root / "router.log"))
            proxies = {}
            for mode, routing in (("round_robin", "load"), ("kv", "kv")):
                port = _port()
                proxies[mode] = f"http://127.0.0.1:{port}"
                procs.append(_spawn([kvs, "proxy", "--port", str(port), "--nats-url", nats.url,
                                     "--routing", routing], {}, root / f"proxy-{mode}.log"))
                _wait(f"{proxies[mode]}/health", procs[-1], root / f"proxy-{mode}.log", 60)
            end = time.monotonic() + 60
            while time.monotonic() < end:
                ready = all(len(h["prefill"]) == 2 and len(h["decode"]) == 2 for h in (
                    json.loads(_get(f"{u}/health")) for u in proxies.values()))
                if ready:
                    break
                time.sleep(0.5)
            time.sleep(2.0)  # the router's registry view too
            results = [run_mode(mode, proxies[mode], engines, model, events, seed,
                                a.conversations, a.turns, a.parallel)
                       for seed, mode in enumerate(("round_robin", "kv"), start=1)]
            kv_health = json.loads(_get(f"{proxies['kv']}/health"))["counts"]
        finally:
            for proc in reversed(procs):
                _stop(proc)
    out = {"conversations": a.conversations, "turns": a.turns, "parallel": a.parallel,
           "block": BLOCK,
           "results": results, "kv_proxy_counts": kv_health, "logs": str(root)}
    print(f"{'mode':<12} {'hit rate':>9} {'best':>6} {'of best':>8} {'wire MiB':>9} "
          f"{'tokens = colocated':>19} {'s':>6}")
    for r in results:
        print(f"{r['mode']:<12} {r['hit_rate']:>9.3f} {r['best_hit_rate']:>6.3f} "
              f"{r['of_best']:>8.3f} {r['wire_bytes'] / 2**20:>9.2f} "
              f"{r['tokens_equal_colocated']:>19} {r['seconds']:>6}")
    print(f"kv proxy: routed {kv_health['kv_routed']}, fallbacks {kv_health['kv_fallbacks']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
