"""Real SGLang servers with the kvstream backend on a GPU (issue 19): a prefill and a decode
server (``--disaggregation-transfer-backend kvstream``) and a colocated one serve the tiny
Llama (``kvstream.bench.tiny_llama``); the decode server's greedy tokens for each prompt,
driven the way SGLang's router drives a P/D pair (the same request, with one bootstrap
room, to both servers at once), equal the colocated server's.

Needs a GPU machine with ``pip install 'kvstream[sglang]'`` (SGLang's full install); the
CPU-only CI machines skip it (SGLang's server cannot start there).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="needs SGLang's full install")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvstream import EmbeddedNats  # noqa: E402
from kvstream.bench.tiny_llama import cached_model  # noqa: E402

NEW = 16
BOOTSTRAP_PORT = 18998


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _serve(model: Path, port: int, log: Path, env: dict, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
           "--port", str(port), "--host", "127.0.0.1", "--mem-fraction-static", "0.1",
           "--disable-cuda-graph", "--dtype", "float16", *extra]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _ready(port: int, proc: subprocess.Popen, log: Path, timeout: float = 600.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise AssertionError(f"server on {port} not ready: {log.read_text()[-4000:]}")


def test_decode_tokens_equal_a_colocated_servers(tmp_path):
    model = cached_model()
    prompts = [[random.Random(i).randrange(1, 1000) for _ in range(n)]
               for i, n in enumerate((40, 130, 300))]
    with EmbeddedNats() as nats:
        env = {**os.environ, "KVSTREAM_NATS_URL": nats.url, "KVSTREAM_SGLANG_HOST": "127.0.0.1"}
        procs = {
            "colocated": (31000, []),
            "prefill": (31001, ["--disaggregation-mode", "prefill",
                                "--disaggregation-transfer-backend", "kvstream",
                                "--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]),
            "decode": (31002, ["--disaggregation-mode", "decode",
                               "--disaggregation-transfer-backend", "kvstream",
                               "--base-gpu-id", "0"]),
        }
        running = {name: _serve(model, port, tmp_path / f"{name}.log", env, *extra)
                   for name, (port, extra) in procs.items()}
        try:
            for name, (port, _) in procs.items():
                _ready(port, running[name], tmp_path / f"{name}.log")
            params = {"temperature": 0.0, "max_new_tokens": NEW}
            for i, ids in enumerate(prompts):
                want = _post("http://127.0.0.1:31000/generate",
                             {"input_ids": ids, "sampling_params": params})
                room = random.Random(100 + i).randrange(1, 2**63)
                body = {"input_ids": ids, "sampling_params": params,
                        "bootstrap_host": "127.0.0.1", "bootstrap_port": BOOTSTRAP_PORT,
                        "bootstrap_room": room}
                with concurrent.futures.ThreadPoolExecutor(2) as ex:
                    pre = ex.submit(_post, "http://127.0.0.1:31001/generate", body)
                    dec = ex.submit(_post, "http://127.0.0.1:31002/generate", body)
                    got, _ = dec.result(), pre.result()
                assert got["output_ids"] == want["output_ids"], (i, got, want)
                assert len(set(want["output_ids"])) > 2, "the model must not repeat one token"
        finally:
            for proc in running.values():
                proc.terminate()
            for proc in running.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
