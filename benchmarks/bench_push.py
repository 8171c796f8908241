"""Layer-pipelined push against pull with real vLLM engines (issue 20's third bar).

    .venv-vllm/bin/python benchmarks/bench_push.py [--prompts 6] [--tokens 960] [--json OUT]

One prefill and one decode ``vllm serve`` engine (CPU build, the tiny test model, block
32, prefix caching off so every request moves its whole prompt) with KVStreamConnector,
the prefill in connector mode "push", each writing its transfers' spans to a file
(``trace_file``), and two ``kvstream proxy`` processes over them: ``--transfer pull``
(the prefill leg, then the decode engine pulls) and ``--transfer push`` (both legs at
once; the prefill pushes each layer as vLLM saves it into the blocks the decode engine
allocated). The same prompts go through each, alternating, streamed.

Reported per mode, medians over the prompts: the transfer's exposed time after the
prefill's last layer, from the two engines' traces, by kvstream's one definition
(``kvstream.tools.tracefile.exposed_ns``: a push from its ``all_layers_ready`` event to
the end of the decode's receive span; a pull all of its span, the prefill being done
before it starts); the whole transfer's time; the client's time to first token through
the proxy; and whether every answer equals a colocated run's (the prompt served whole by
the prefill engine, no KV params).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvstream.bench.tiny_llama import VOCAB, cached_model
from kvstream.control.nats_server import EmbeddedNats
from kvstream.tools.tracefile import exposed_ns, load_spans

sys.path.insert(0, str(Path(__file__).parent))
from bench_routing import _port, _spawn, _stop, _wait  # the same engine helpers

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
NEW = 8


def _body(model: str, prompt: list[int], stream: bool) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}


def _post(url: str, body: dict[str, Any]) -> tuple[str, float, str]:
    """(text, seconds to the first token, request id) of a streamed completion."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    started, first, text = time.monotonic(), None, []
    with urllib.request.urlopen(req, timeout=300) as r:
        rid = r.headers.get("X-Request-Id", "")
        if not body.get("stream"):
            return json.loads(r.read())["choices"][0]["text"], time.monotonic() - started, rid
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                piece = json.loads(line[6:])["choices"][0]["text"]
                if first is None and piece:
                    first = time.monotonic() - started
                text.append(piece)
    return "".join(text), first if first is not None else float("nan"), rid


def _transfers(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The transfer spans of both engines by kvstream request id (a pull's is the
    prefill's request id, a push's the proxy's push id)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        if s["name"] in ("kvstream.push", "kvstream.receive", "kvstream.pull"):
            by.setdefault(s["attributes"].get("kvstream.request_id", ""), []).append(s)
    return by


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--prompts", type=int, default=6)
    cli.add_argument("--tokens", type=int, default=960, help="prompt length (< 1024)")
    cli.add_argument("--json", help="also write the results here")
    a = cli.parse_args()
    model = str(cached_model())
    root = Path(tempfile.mkdtemp(prefix="bench-push-"))
    events = root / "events.jsonl"
    kvs = str(Path(sys.executable).parent / "kvstream")
    procs: list[subprocess.Popen[bytes]] = []
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(a.tokens)] for _ in range(a.prompts)]
    rows: dict[str, list[dict[str, Any]]] = {"pull": [], "push": []}
    with EmbeddedNats() as nats:
        try:
            engines: dict[str, str] = {}
            for name, role in (("p", "kv_producer"), ("d", "kv_consumer")):
                port = _port()
                url = engines[name] = f"http://127.0.0.1:{port}"
                extra: dict[str, Any] = {"nats_url": nats.url, "heartbeat_s": 1.0,
                                         "peer_timeout_s": 10.0, "instance_id": f"bench-{name}",
                                         "endpoint": url, "trace_file": str(root / f"{name}.spans")}
                if role == "kv_producer":
                    extra["mode"] = "push"
                cfg: dict[str, Any] = {
                    "kv_connector": "KVStreamConnector",
                    "kv_connector_module_path": "kvstream.adapters.vllm", "kv_role": role,
                    "kv_connector_extra_config": extra}
                if role == "kv_consumer":
                    cfg["kv_load_failure_policy"] = "recompute"
                env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                       "VLLM_LOGGING_LEVEL": "WARNING", "KVSTREAM_VLLM_EVENTS": str(events),
                       "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                       "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
                procs.append(_spawn(
                    [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                     model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                     "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "1024",
                     "--max-num-seqs", "8", "--seed", "0", "--no-enable-prefix-caching",
                     "--kv-transfer-config", json.dumps(cfg)], env, root / f"{name}.log"))
            for (name, url), proc in zip(engines.items(), procs, strict=True):
                _wait(f"{url}/health", proc, root / f"{name}.log")
            proxies = {}
            for mode in ("pull", "push"):
                port = _port()
                proxies[mode] = f"http://127.0.0.1:{port}"
                procs.append(_spawn([kvs, "proxy", "--port", str(port), "--nats-url", nats.url,
                                     "--transfer", mode], {}, root / f"proxy-{mode}.log"))
                _wait(f"{proxies[mode]}/health", procs[-1], root / f"proxy-{mode}.log", 60)
            end = time.monotonic() + 60
            while time.monotonic() < end and not all(
                    (h := json.loads(urllib.request.urlopen(f"{u}/health", timeout=10).read()))
                    ["prefill"] and h["decode"] for u in proxies.values()):
                time.sleep(0.5)
            colocated = [_post(engines["p"], _body(model, p, False))[0] for p in prompts]
            _post(proxies["pull"], _body(model, prompts[0], True))  # warm both paths up
            _post(proxies["push"], _body(model, prompts[0], True))
            for i, p in enumerate(prompts):
                for mode in (("pull", "push") if i % 2 == 0 else ("push", "pull")):
                    text, ttft, rid = _post(proxies[mode], _body(model, p, True))
                    rows[mode].append({"prompt": i, "ttft_s": ttft, "x_request_id": rid,
                                       "equal": text == colocated[i], "t": time.time()})
            counts = {m: json.loads(urllib.request.urlopen(f"{u}/health", timeout=10).read())
                      ["counts"] for m, u in proxies.items()}
            time.sleep(2.0)  # the span files are written as spans end
        finally:
            for proc in reversed(procs):
                _stop(proc)
    spans = load_spans(str(root / "p.spans")) + load_spans(str(root / "d.spans"))
    by = _transfers(spans)
    loads = [e for e in (json.loads(x) for x in events.read_text().splitlines())
             if e["event"] == "pull_ended"]
    # Each measured request's load, in order (the warm-up's two come first).
    measured = loads[2:]
    out: dict[str, Any] = {"prompts": a.prompts, "tokens": a.tokens, "block": BLOCK,
                           "counts": counts, "logs": str(root), "modes": {}}
    for mode in ("pull", "push"):
        mine = [x for x in measured if (x["via"] == "push") == (mode == "push")]
        exposed, whole = [], []
        for x in mine:
            group = by.get(x["remote_request_id"], [])
            e = exposed_ns(group)
            if e is not None:
                exposed.append(e / 1e6)
            if group:
                whole.append((max(s["end_ns"] for s in group)
                              - min(s["start_ns"] for s in group)) / 1e6)
        ttft = [r["ttft_s"] * 1e3 for r in rows[mode]]
        out["modes"][mode] = {
            "loads": len(mine), "loads_ok": sum(x["ok"] for x in mine),
            "via": sorted({x["via"] for x in mine}),
            "bytes": statistics.median(x["bytes"] for x in mine) if mine else 0,
            "exposed_ms": statistics.median(exposed) if exposed else None,
            "exposed_all_ms": [round(v, 2) for v in exposed],
            "transfer_ms": statistics.median(whole) if whole else None,
            "ttft_ms": statistics.median(ttft),
            "tokens_equal_colocated": all(r["equal"] for r in rows[mode])}
    print(f"{'mode':<6} {'loads ok':>9} {'KiB':>7} {'exposed ms':>11} {'transfer ms':>12} "
          f"{'TTFT ms':>8} {'tokens = colocated':>19}")
    for mode, r in out["modes"].items():
        exp = "-" if r["exposed_ms"] is None else f"{r['exposed_ms']:.2f}"
        tr = "-" if r["transfer_ms"] is None else f"{r['transfer_ms']:.2f}"
        print(f"{mode:<6} {r['loads_ok']:>4}/{r['loads']:<4} {r['bytes'] / 1024:>7.0f} "
              f"{exp:>11} {tr:>12} {r['ttft_ms']:>8.1f} {r['tokens_equal_colocated']!s:>19}")
    pull, push = out["modes"]["pull"]["exposed_ms"], out["modes"]["push"]["exposed_ms"]
    if pull and push is not None:
        print(f"exposed after the last layer: push {push:.2f} ms vs pull {pull:.2f} ms "
              f"({push / pull:.2f}x)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
