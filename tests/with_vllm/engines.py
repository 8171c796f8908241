"""Real vLLM engines in their own processes, driven over a pipe, and the tiny model they serve.

Each ``Engine`` is a process (its own session, so a test can SIGKILL it with its engine
core) holding one ``vllm.LLMEngine`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=1``: the
scheduler-role connector lives in the engine-core process, the worker-role one in the
worker. Commands go over a pipe; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
VOCAB = 1000


def prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]  # no bos/eos inside


def _serve(conn: Any, model: str, kv_config: dict[str, Any] | None, env: dict[str, str],
           log: str | None = None, engine_kw: dict[str, Any] | None = None) -> None:
    os.setsid()  # the test kills the whole group (engine core included)
    os.environ.update(env)
    if log:  # this process's and its children's (engine core, workers) stdout and stderr
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    args = EngineArgs(model=model, dtype="float32", enforce_eager=True, max_model_len=512,
                      max_num_seqs=8, seed=0, kv_transfer_config=kv_config,
                      **{"block_size": BLOCK, **(engine_kw or {})})
    engine = LLMEngine.from_engine_args(args)
    conn.send(("ready", os.getpid()))

    def run(jobs: list[dict[str, Any]], abort_after_add: bool = False) -> list[dict[str, Any]]:
        ids = []
        for i, job in enumerate(jobs):
            rid = f"{job.get('tag', 'r')}-{i}-{time.monotonic_ns()}"
            extra = {"kv_transfer_params": job["params"]} if job.get("params") else None
            sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                                extra_args=extra, logprobs=job.get("logprobs"))
            engine.add_request(rid, TokensPrompt(prompt_token_ids=job["prompt"]), sp)
            ids.append(rid)
        if abort_after_add:
            engine.abort_request(ids)
        out: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + 120
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            for o in engine.step():
                if o.finished:
                    c = o.outputs[0]
                    out[o.request_id] = {"tokens": list(c.token_ids),
                                         "logprobs": [step[t].logprob for t, step in
                                                      zip(c.token_ids, c.logprobs or [], strict=False)],
                                         "kv_transfer_params": o.kv_transfer_params,
                                         "num_cached_tokens": o.num_cached_tokens,
                                         "finish_reason": o.outputs[0].finish_reason}
        # (No idle steps here: step() blocks without requests. The engine core keeps
        # stepping on its own while a connector holds finished requests' blocks.)
        return [out.get(r, {}) for r in ids]

    while True:
        if not conn.poll(600):
            return
        cmd, arg = conn.recv()
        if cmd == "stop":
            conn.send(("ok", None))
            os._exit(0)  # the test kills the rest of the group; vLLM's own exit is slow
        try:
            if cmd == "generate":
                conn.send(("ok", run(arg)))
            elif cmd == "abort_after_add":
                conn.send(("ok", run(arg, abort_after_add=True)))
            else:
                conn.send(("error", f"unknown command {cmd}"))
        except Exception as exc:  # reported to the test, which fails with it
            conn.send(("error", repr(exc)))


class Engine:
    """A vLLM engine process; ``generate([{prompt, max_tokens, params}])`` -> outputs.

    ``log``: a file for the output of the engine's processes (vLLM's log lines and ours).
    ``engine_kw``: more ``EngineArgs`` (``block_size``, ``tensor_parallel_size``).
    """

    def __init__(self, model: Path, kv_config: dict[str, Any] | None, *, env: dict[str, str],
                 start_timeout: float = 240.0, log: Path | None = None,
                 engine_kw: dict[str, Any] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.log = log
        self.proc = ctx.Process(target=_serve, args=(child, str(model), kv_config, env,
                                                     str(log) if log else None, engine_kw),
                                daemon=False)
        self.proc.start()
        self._start_timeout = start_timeout
        self._pid: int | None = None

    @property
    def pid(self) -> int:
        """Waits for the engine to be ready (start several, then read their pids)."""
        if self._pid is None:
            self._pid = self._recv(self._start_timeout)
        return self._pid

    def _recv(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"vLLM engine did not answer within {timeout} s")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"vLLM engine: {value}")
        return value

    def call(self, cmd: str, arg: Any = None, timeout: float = 180.0) -> Any:
        assert self.pid
        self._conn.send((cmd, arg))
        return self._recv(timeout)

    def generate(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.call("generate", jobs)

    def kill(self) -> None:
        """SIGKILL the engine, its engine core and workers (no goodbye to peers)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.join(30)

    def stop(self) -> None:
        if self._pid is not None and self.proc.is_alive():
            with contextlib.suppress(TimeoutError, RuntimeError, OSError, EOFError):
                self.call("stop", timeout=30)
            self.proc.join(5)
        if self._pid is None:
            self.proc.kill()
            self.proc.join(10)
        with contextlib.suppress(ProcessLookupError):  # engine core and workers
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


def kv_config(role: str, nats_url: str, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "kv_connector": "KVStreamConnector",
        "kv_connector_module_path": "kvstream.adapters.vllm",
        "kv_role": role,
        # Two engines and the test share 2 cores: a tolerant liveness timeout.
        "kv_connector_extra_config": {"nats_url": nats_url, "heartbeat_s": 1.0,
                                      "peer_timeout_s": 10.0, **extra},
    }
    if role in ("kv_consumer", "kv_both"):
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def engine_env(events: Path) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
            "KVSTREAM_VLLM_EVENTS": str(events), "TOKENIZERS_PARALLELISM": "false",
            # Two engines share 2 cores: one unbound, passive OpenMP thread each, or an
            # engine stepping while it holds offered blocks starves the other.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
            "OMP_WAIT_POLICY": "PASSIVE"}


# A line of vLLM 0.32's text log format (vllm/logger.py, _FORMAT, no color, no prefix):
# "(<process name> pid=<pid>) <LEVEL> <mm-dd HH:MM:SS> [<file>:<line>] <message>".
VLLM_LOG_LINE = re.compile(r"^\((?P<process>[^()]+) pid=(?P<pid>\d+)\) (?P<level>[A-Z]+) "
                           r"\d\d-\d\d \d\d:\d\d:\d\d \[(?P<file>[\w.]+):\d+\] (?P<message>.*)$")


def log_lines(path: Path, level: str, pattern: str) -> list[re.Match[str]]:
    """The lines of a log file in vLLM's format, at ``level``, whose message matches
    ``pattern`` (from its start); the matches of ``pattern``."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        m = VLLM_LOG_LINE.match(line)
        if m and m["level"] == level and (hit := re.match(pattern, m["message"])):
            found.append(hit)
    return found


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
