"""Processes for the fault suite (tests/integration/test_faults.py): an agent in a child
process driven by JSON lines, a nats-server that can be killed and started again, and
network namespaces with a bridge between them.

A child runs ``python -m tests.integration.fault_peers SPEC`` (SPEC: JSON with the agent's
id, NATS URL, layout, block count, whether its KV is filled, and AgentConfig overrides).
It reads one command per line on stdin (``{"id": n, "op": ..., ...}``; ops ``expect``,
``push``, ``ready``, ``landed``, ``rest``, ``peers``, ``verify``, ``stuck``) and answers
each with one line ``{"re": n, ...}``; each transfer's end comes as ``{"ev": "end", "rid":
..., "status": ..., "t": <monotonic>}``. CLOCK_MONOTONIC is one clock for every process of
the host (network namespaces do not change it), so the test compares those times with its
own. The child dies with its stdin: a test that goes away takes its peers with it. Its
stderr (kvstream's log; ``KVSF_LOG=DEBUG`` for more) goes to a file in the test's tmp_path.

The parent side is ``AgentProc`` (an async context manager that owns the reader task and
reaps the process on every path), ``NatsProc`` and ``Netns``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from kvstream.layout import KVLayout

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------- the child


def same_blocks(mine: Sequence[Any], theirs: Sequence[Any], dst: Sequence[int],
                src: Sequence[int]) -> bool:
    """Does ``mine`` hold in blocks ``dst`` what ``theirs`` holds in ``src``, every layer?
    (flash_nhd: block ids index dimension 1.)"""
    import torch

    return all(torch.equal(m[:, d], s[:, b]) for m, s in zip(mine, theirs, strict=True)
               for d, b in zip(dst, src, strict=True))


def _child(spec: dict[str, Any]) -> None:
    import importlib
    import logging

    import kvstream.dataplane.ucx  # noqa: F401  (sets UCX's environment defaults)
    from kvstream import KVStreamError
    from kvstream.config import AgentConfig
    from kvstream.engine.agent import Agent
    from tests.fakes import cache

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kvstream").setLevel(os.environ.get("KVSF_LOG", "WARNING"))  # DEBUG
    importlib.import_module("ucxx")  # now, not when the agent starts (a spare starts fast)
    layout = msgspec.json.decode(json.dumps(spec["layout"]), type=KVLayout)
    nblocks = spec["nblocks"]
    config = AgentConfig(instance_id=spec["id"], nats_url=spec["nats"], **spec.get("cfg", {}))
    kv = cache(layout, nblocks, fill=spec["fill"])
    handles: dict[str, Any] = {}

    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    async def watch(rid: str, handle: Any) -> None:
        r = await handle.result()
        emit({"ev": "end", "rid": rid, "status": str(r.status), "cause": str(r.cause),
              "reason": r.reason, "t": r.ended_at})

    async def run(agent: Agent, tg: anyio.abc.TaskGroup, cmd: dict[str, Any]) -> None:
        op, out = cmd["op"], {"re": cmd["id"]}
        try:
            if op == "expect":
                rx = handles[cmd["rid"]] = agent.expect(cmd["rid"], cmd["blocks"],
                                                        src=cmd["src"])
                tg.start_soon(watch, cmd["rid"], rx)
            elif op == "push":
                tx = handles[cmd["rid"]] = await agent.push(cmd["rid"], cmd["dst"], cmd["blocks"],
                                                            timeout=cmd.get("timeout"))
                for layer in range(cmd.get("ready", 0)):
                    tx.layer_ready(layer)
                tg.start_soon(watch, cmd["rid"], tx)
            elif op == "ready":  # layers < upto are computed
                for layer in range(cmd["upto"]):
                    handles[cmd["rid"]].layer_ready(layer)
            elif op == "landed":
                with anyio.fail_after(cmd.get("wait", 20)):
                    await handles[cmd["rid"]].wait_landed(cmd["layer"])
            elif op == "rest":  # wait until nothing is held, or say what still is
                with anyio.move_on_after(cmd.get("wait", 10)):
                    while not at_rest(agent.statistics()):
                        await anyio.sleep(0.02)
                out["stats"] = msgspec.to_builtins(agent.statistics())
            elif op == "peers":
                out["peers"] = [a.instance_id for a in agent.peers()]
            elif op == "verify":  # my dst blocks hold what a filled cache has in src blocks
                out["ok"] = same_blocks(kv, cache(layout, nblocks, fill=True), cmd["dst"],
                                        cmd["src"])
            elif op == "stuck":  # where each of the agent's tasks waits (diagnosis)
                out["stuck"] = stuck_tasks()
            else:
                out["error"] = f"unknown op {op!r}"
        except (KVStreamError, TimeoutError, KeyError, ValueError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        emit(out)

    async def main() -> None:
        stdin = anyio.wrap_file(sys.stdin)
        if spec.get("hold") and not await stdin.readline():  # a spare: imported, not started
            return
        async with Agent(config, layout=layout, kv_caches=kv) as agent, \
                anyio.create_task_group() as tg:
            emit({"ev": "up", "pid": os.getpid(), "t": time.monotonic()})
            while line := await stdin.readline():  # "" once the test is gone
                tg.start_soon(run, agent, tg, json.loads(line))
            tg.cancel_scope.cancel()

    anyio.run(main)


def stuck_tasks() -> list[str]:
    """The innermost frames each pending kvstream task awaits in, one line per task."""
    import asyncio

    lines: list[str] = []
    for task in asyncio.all_tasks():
        if not task.get_name().startswith("kvstream."):
            continue
        frames: list[str] = []
        coro: Any = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                frames.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        lines.append(f"{task.get_name()}: {' > '.join(frames[-3:])}")
    return sorted(lines)


def at_rest(stats: Any) -> bool:
    s = stats if isinstance(stats, dict) else msgspec.to_builtins(stats)
    return not any(s[k] for k in ("transfers_active", "reservations_active",
                                  "staging_bytes_in_use", "held_active", "leases_active",
                                  "staged_transfers"))


# --------------------------------------------------------------------------- the parent


async def reap(proc: anyio.abc.Process, timeout: float = 10.0) -> None:
    """Kill (a stopped process too: SIGKILL needs no SIGCONT) and wait for it."""
    with anyio.CancelScope(shield=True):
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        with anyio.fail_after(timeout):
            await proc.wait()


class AgentProc:
    """An agent in a child process (see the module docstring), driven from the test."""

    def __init__(self, instance_id: str, nats_url: str, layout: KVLayout, nblocks: int, *,
                 fill: bool, log_dir: Path, cfg: dict[str, Any] | None = None,
                 prefix: Sequence[str] = (), env: dict[str, str] | None = None,
                 hold: bool = False) -> None:
        """``hold``: a spare, whose agent starts only at ``go()`` (the imports, seconds on
        this machine, are done by then); otherwise ``started()`` waits for it."""
        spec = {"id": instance_id, "nats": nats_url, "layout": msgspec.to_builtins(layout),
                "nblocks": nblocks, "fill": fill, "cfg": cfg or {}, "hold": hold}
        self.instance_id = instance_id
        self.argv = [*prefix, sys.executable, "-m", "tests.integration.fault_peers",
                     json.dumps(spec)]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.log_path = log_dir / f"{instance_id}-{time.monotonic_ns()}.log"
        self.proc: anyio.abc.Process | None = None
        self.pid = 0
        self.events: list[dict[str, Any]] = []
        self._replies: dict[int, dict[str, Any]] = {}
        self._changed = anyio.Event()
        self._seq = 0
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> AgentProc:
        try:
            with open(self.log_path, "wb") as log:
                self.proc = await anyio.open_process(self.argv, stdin=subprocess.PIPE,
                                                     stdout=subprocess.PIPE, stderr=log,
                                                     env=self.env, cwd=ROOT)
            self._stack.push_async_callback(reap, self.proc)
            tg = await self._stack.enter_async_context(anyio.create_task_group())
            self._stack.callback(tg.cancel_scope.cancel)
            tg.start_soon(self._read)
            self.pid = self.proc.pid  # `ip netns exec` execs: the same process
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        lines = BufferedByteReceiveStream(self.proc.stdout)
        with contextlib.suppress(anyio.EndOfStream, anyio.IncompleteRead,
                                 anyio.ClosedResourceError, anyio.BrokenResourceError):
            while True:
                msg = json.loads(await lines.receive_until(b"\n", 1 << 24))
                if "re" in msg:
                    self._replies[msg["re"]] = msg
                else:
                    self.events.append(msg)
                self._changed.set()
                self._changed = anyio.Event()
        self._changed.set()  # the child is gone: waiters look once more, then fail

    async def go(self) -> None:
        """Start a spare's agent and wait until it is up."""
        assert self.proc is not None and self.proc.stdin is not None
        await self.proc.stdin.send(b"go\n")
        await self.event("up", timeout=60)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    async def _until(self, found: Any, what: str, timeout: float) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            while (hit := found()) is None:
                if self.proc is None or self.proc.returncode is not None:
                    raise AssertionError(f"{self.instance_id} exited waiting for {what}:\n"
                                         f"{self.log()}")
                await self._changed.wait()
        return hit

    async def call(self, op: str, within: float = 30.0, **kw: Any) -> dict[str, Any]:
        """Send a command; return its answer within ``within`` seconds (raises if the child
        reported an error). ``rest`` and ``landed`` take ``wait``: how long the child waits."""
        assert self.proc is not None and self.proc.stdin is not None
        self._seq += 1
        seq = self._seq
        await self.proc.stdin.send((json.dumps({"id": seq, "op": op, **kw}) + "\n").encode())
        reply = await self._until(lambda: self._replies.pop(seq, None), op, within)
        if "error" in reply:
            raise AssertionError(f"{self.instance_id} {op}: {reply['error']}")
        return reply

    async def post(self, op: str, **kw: Any) -> None:
        """Send a command without waiting (it is read when the child next runs)."""
        assert self.proc is not None and self.proc.stdin is not None
        self._seq += 1
        await self.proc.stdin.send((json.dumps({"id": self._seq, "op": op, **kw}) + "\n")
                                   .encode())

    async def event(self, ev: str, rid: str | None = None, timeout: float = 30.0
                    ) -> dict[str, Any]:
        """The first event ``ev`` (of request ``rid``); fails after ``timeout``."""
        return await self._until(
            lambda: next((e for e in self.events
                          if e["ev"] == ev and (rid is None or e.get("rid") == rid)), None),
            f"{ev} {rid or ''}", timeout)

    async def maybe_event(self, ev: str, rid: str, timeout: float) -> dict[str, Any] | None:
        """The same, or None after ``timeout`` (for a test that checks more first)."""
        with anyio.move_on_after(timeout):
            return await self.event(ev, rid, timeout=math.inf)
        return None

    def signal(self, sig: int) -> float:
        """Send ``sig``; returns the monotonic time just before it was sent."""
        t = time.monotonic()
        os.kill(self.pid, sig)
        return t

    async def kill(self) -> float:
        t = self.signal(signal.SIGKILL)
        assert self.proc is not None
        with anyio.fail_after(10):
            await self.proc.wait()
        return t


async def started(*procs: AgentProc) -> None:
    """Wait until every one of ``procs`` has its agent up (they start side by side)."""
    for proc in procs:
        await proc.event("up", timeout=60)


class NatsProc:
    """A nats-server (no JetStream) on a fixed address, killed and started again at will."""

    def __init__(self, host: str, port: int, log_dir: Path, prefix: Sequence[str] = ()) -> None:
        from kvstream.control.nats_server import find_nats_server

        self.host, self.port = host, port
        self.url = f"nats://{host}:{port}"
        self.argv = [*prefix, find_nats_server(), "-a", host, "-p", str(port)]
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 10.0) -> NatsProc:
        self.starts += 1
        log = self.log_dir / f"nats-{self.port}-{self.starts}.log"
        self.proc = subprocess.Popen([*self.argv, "-l", str(log)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while "Server is ready" not in (log.read_text(errors="replace") if log.exists() else ""):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"nats-server did not start: {log.read_text()[-800:]}")
            time.sleep(0.02)
        return self

    def kill(self) -> float:
        assert self.proc is not None
        t = time.monotonic()
        self.proc.kill()
        self.proc.wait(10)
        return t

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Netns:
    """Three network namespaces made for one test: ``n`` holds a bridge (198.18.0.1/24) and
    the nats-server; ``a`` (198.18.0.2, device ``v0``) and ``b`` (198.18.0.3, ``v0``) hang
    off it, each through a veth pair whose bridge end is ``pa`` / ``pb`` in ``n``.
    198.18.0.0/15 is the benchmarking range (RFC 2544): nothing real answers there. Only
    these namespaces are touched, and ``close`` deletes them (their veths go with them)."""

    ADDR = {"n": "198.18.0.1", "a": "198.18.0.2", "b": "198.18.0.3"}

    def __init__(self) -> None:
        tag = f"{os.getpid()}-{time.monotonic_ns() % 10**8}"
        self.names = {k: f"kvsf-{tag}-{k}" for k in "nab"}
        self.made: list[str] = []

    @staticmethod
    def available() -> str:
        """Why the namespaces cannot be made here, or "" if they can."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        try:
            subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"`ip netns` is unavailable: {exc}"
        return ""

    def ip(self, *args: str, ns: str | None = None) -> None:
        argv = ["ip", *(["-n", self.names[ns]] if ns else []), *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        if done.returncode:
            raise AssertionError(f"{' '.join(argv)}: {done.stderr.strip()}")

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[ns]]

    @staticmethod
    def remove_stale() -> None:
        """Delete namespaces this class made in a test process that is gone (killed before
        its ``close``); a live process's are left alone."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                timeout=10).stdout
        for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
            parts = name.split("-")
            if len(parts) == 4 and parts[0] == "kvsf" and parts[1].isdigit() and \
                    not Path(f"/proc/{parts[1]}").exists():
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)

    def open(self) -> Netns:
        self.remove_stale()
        for ns in self.names.values():
            self.ip("netns", "add", ns)
            self.made.append(ns)
        for k in "nab":
            self.ip("link", "set", "lo", "up", ns=k)
        self.ip("link", "add", "br0", "type", "bridge", ns="n")
        self.ip("addr", "add", f"{self.ADDR['n']}/24", "dev", "br0", ns="n")
        self.ip("link", "set", "br0", "up", ns="n")
        for k in "ab":
            self.ip("link", "add", f"p{k}", "netns", self.names["n"], "type", "veth",
                    "peer", "name", "v0", "netns", self.names[k])
            self.ip("link", "set", f"p{k}", "master", "br0", "up", ns="n")
            self.ip("addr", "add", f"{self.ADDR[k]}/24", "dev", "v0", ns=k)
            self.ip("link", "set", "v0", "up", ns=k)
        return self

    def cable(self, k: str, up: bool) -> None:
        """Pull (or plug back) the cable of ``k`` at the bridge: both planes of ``k`` cut.
        ``k``'s own device keeps its address (it only loses carrier), so its worker can
        still reach itself."""
        self.ip("link", "set", f"p{k}", "up" if up else "down", ns="n")

    def isolate(self, on: bool) -> None:
        """Bridge port isolation: ``a`` and ``b`` cannot reach each other, but both still
        reach the bridge's own address (NATS): the data plane alone is cut."""
        for k in "ab":
            argv = ["bridge", "-n", self.names["n"], "link", "set", "dev", f"p{k}",
                    "isolated", "on" if on else "off"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            if done.returncode:
                raise AssertionError(f"{' '.join(argv)}: {done.stderr.strip()}")

    def close(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.made.clear()


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # ucxx's threads must not hold up the exit
