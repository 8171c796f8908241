"""``kvstream proxy --transfer push`` when the prefill engine has died: the proxy cannot
reach it, notes the decode engine that nothing was offered, and the decode engine
recomputes at once, without a pull to the dead engine and without waiting out its
liveness check; the requests after it are served decode-only."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="needs a real vLLM: bash .ci/vllm-env && .venv-vllm/bin/python -m "
                           "pytest tests/with_vllm (README command 3)")

from kvstream import EmbeddedNats

try:  # tests/with_vllm as a package, or as a plain directory on sys.path
    from . import engines as E
    from .test_vllm_http import _body, _port, _post, _spawn, _stop, _wait_http
except ImportError:
    import engines as E  # type: ignore[no-redef]
    from test_vllm_http import _body, _port, _post, _spawn, _stop, _wait_http  # type: ignore[no-redef]

pytestmark = pytest.mark.timeout(600)


def _answer(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()), r.headers["X-KVStream-Route"]


def test_a_dead_prefill_in_push_mode_is_recomputed_at_once(tmp_path: Path, tiny_model: Path):
    events = tmp_path / "events.jsonl"
    serve = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    kvs = str(Path(sys.executable).parent / "kvstream")
    procs: dict[str, Any] = {}
    with EmbeddedNats() as nats:
        try:
            ports = {"prefill": _port(), "decode": _port()}
            for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
                url = f"http://127.0.0.1:{ports[role]}"
                mode = {"mode": "push"} if role == "prefill" else {}
                cfg = E.kv_config(kv_role, nats.url, instance_id=f"dead-{role}", endpoint=url,
                                  **mode)
                # The test's decode holds the prefill alive for 10 s without heartbeats
                # (E.kv_config): a recompute sooner than that was not its liveness check.
                procs[role] = _spawn(
                    [*serve, str(tiny_model), "--host", "127.0.0.1", "--port", str(ports[role]),
                     "--dtype", "float32", "--enforce-eager", "--block-size", str(E.BLOCK),
                     "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0",
                     "--kv-transfer-config", json.dumps(cfg)],
                    E.engine_env(events), tmp_path / f"{role}.log")
            for role, proc in procs.items():
                _wait_http(f"http://127.0.0.1:{ports[role]}/health", proc,
                           tmp_path / f"{role}.log")
            port = _port()
            procs["proxy"] = _spawn([kvs, "proxy", "--port", str(port), "--nats-url", nats.url,
                                     "--transfer", "push", "--peer-timeout", "10"], {},
                                    tmp_path / "proxy.log")
            proxy = f"http://127.0.0.1:{port}"
            _wait_http(f"{proxy}/ready", procs["proxy"], tmp_path / "proxy.log", timeout=60)
            model = str(tiny_model)
            warm = E.prompt(70, 301)  # a push that works: both engines know each other
            _, route = _answer(f"{proxy}/v1/completions", _body(model, warm))
            assert route == "prefill-decode-push"

            _stop(procs.pop("prefill"))  # SIGKILL, its engine core and worker too
            prompt = E.prompt(90, 302)
            sent = time.time()
            got, route = _answer(f"{proxy}/v1/completions", _body(model, prompt))
            answered = time.time()
            want = _post(f"http://127.0.0.1:{ports['decode']}/v1/completions",
                         _body(model, prompt))
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert route == "prefill-decode-push"  # the proxy learned of the death with it
            loads = [e for e in E.read_events(events)
                     if e["event"] == "pull_ended" and e["t"] >= sent and e["role"] == "worker"]
            assert len(loads) == 1, loads
            load = loads[0]
            # Told by the proxy that nothing was offered: no pull to the dead engine.
            assert not load["ok"] and load["via"] == "push", load
            assert "no offer to pull" in load["reason"] and "Cannot connect" in load["reason"]
            print(f"\nrecomputed {load['t'] - sent:.3f} s after the request was sent "
                  f"(answered after {answered - sent:.3f} s)")
            # The next request: the proxy no longer routes to the dead engine.
            _, route = _answer(f"{proxy}/v1/completions", _body(model, E.prompt(40, 303)))
            assert route == "decode-only"
            with urllib.request.urlopen(f"{proxy}/health", timeout=5) as r:
                counts = json.loads(r.read())["counts"]
            assert counts["push_failed"] == 1 and counts["decode_only"] == 1, counts
        finally:
            for proc in procs.values():
                _stop(proc)
