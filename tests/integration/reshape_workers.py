"""Long-lived worker processes for ``test_reshape_procs.py``: one holds every TP rank of the
prefill side, the other the decode rank, each driven over ``multiprocessing`` queues so
that process start-up (torch, UCX) happens once per module, not once per example.

A worker runs one command at a time from its queue, ``(op, kwargs)``, and answers
``("ok", value)`` or ``("error", traceback)``. The agents of one example live in their own
task (``_hold``), so a command may time out without unwinding a task group it did not
enter. Cache contents are a pure function of a seed (``contents``): the test regenerates
them to check the destination, so no source tensor travels back. ``Workers`` is the
test's end: it starts both, sends commands, waits for answers (naming a worker that died
or hung) and, after a failed example, starts both afresh.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from kvstream.layout import KVLayout

# Counters that are 0 on an agent with nothing live (tests/integration/agents.py).
AT_REST = ("transfers_active", "reservations_active", "staging_bytes_in_use", "held_active",
           "leases_active", "staged_transfers")
OP_TIMEOUT_S = 30.0
REPLY_S = 45.0


@dataclass(frozen=True)
class Side:
    """One engine's agents: the layout each rank holds, its TP degree over ``total`` KV
    heads, the ranks that run (name, rank, contents seed) and blocks per cache."""

    layout: KVLayout
    tp: int
    total: int
    ranks: tuple[tuple[str, int, int], ...]
    num_blocks: int


def contents(layout: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Every tensor of one cache, N(0, 1) in its dtype, fixed by ``seed``, in the order the
    agent registers them: one per layer, or a split layout's K of every layer, then V."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, layout.dtype)
    return [torch.randn(layout.tensor_shape(num_blocks), generator=gen).to(dtype)
            for _ in range(layout.num_layers * layout.tensors_per_layer)]


def _cfg(name: str, nats_url: str, tp: Any) -> Any:
    from kvstream.config import AgentConfig

    return AgentConfig(instance_id=name, nats_url=nats_url, heartbeat_s=0.25,
                       peer_timeout_s=5.0, request_timeout_s=3.0, tp=tp)


def _stats(agent: Any) -> dict[str, Any]:
    s = agent.statistics()
    return {"name": agent.instance_id, "paths": dict(s.paths), "failed": s.failed,
            **{k: getattr(s, k) for k in AT_REST}}


class _Worker:
    """The agents of the current example and what was started with them."""

    def __init__(self, nats_url: str, tg: anyio.abc.TaskGroup) -> None:
        self.nats_url, self.tg = nats_url, tg
        self.agents: dict[str, Any] = {}
        self.handles: list[tuple[str, Any]] = []
        self.receive: Any = None
        self._close = anyio.Event()
        self._closed = anyio.Event()

    async def _hold(self, side: Side, *, task_status: Any) -> None:
        from kvstream import Agent
        from kvstream.transfer.plan import TpInfo

        try:
            async with contextlib.AsyncExitStack() as stack:
                for name, rank, seed in side.ranks:
                    tp = TpInfo(rank=rank, size=side.tp, total_kv_heads=side.total)
                    agent = Agent(_cfg(name, self.nats_url, tp), layout=side.layout,
                                  kv_caches=contents(side.layout, side.num_blocks, seed))
                    self.agents[name] = await stack.enter_async_context(agent)
                task_status.started()
                await self._close.wait()
        finally:
            self.agents = {}
            self._closed.set()

    # -- commands --------------------------------------------------------------------
    async def open(self, side: Side, peers: list[str]) -> None:
        """Start ``side``'s agents; return once each sees every agent in ``peers``."""
        if self.agents:
            raise RuntimeError("the previous example's agents are still open")
        self.handles, self.receive = [], None
        self._close, self._closed = anyio.Event(), anyio.Event()
        await self.tg.start(self._hold, side)
        with anyio.fail_after(10):
            for agent in self.agents.values():
                while not set(peers) <= {a.instance_id for a in agent.peers()}:
                    await anyio.sleep(0.02)

    async def offer(self, request_id: str, blocks: dict[str, list[int]],
                    secrets: dict[str, str]) -> None:
        for name, ids in blocks.items():
            h = self.agents[name].offer(request_id, ids, secret=secrets[name])
            h.all_ready()
            self.handles.append((name, h))

    async def push(self, request_id: str, src: str, dst: str, blocks: list[int], tokens: int,
                   mode: str) -> None:
        h = await self.agents[src].push(request_id, dst, blocks, tokens=tokens, mode=mode)
        h.all_ready()
        self.handles.append((src, h))

    async def results(self) -> list[tuple[str, bool, str]]:
        """How every offer or push of this example ended."""
        out = []
        for name, h in self.handles:
            r = await h.result()
            out.append((name, r.ok, r.reason))
        return out

    async def pull(self, request_id: str, src: str | list[str], blocks: list[int],
                   secret: str | list[str], tokens: int, mode: str) -> tuple[bool, str, str]:
        (agent,) = self.agents.values()
        rx = await agent.pull(request_id, src, blocks, mode=mode, secret=secret, tokens=tokens)
        if mode == "lazy":
            for layer in range(agent.memory.layout.num_layers):
                await rx.wait_layer(layer)
                if not rx.layer_landed(layer):
                    raise RuntimeError(f"layer {layer} waited for but not landed")
        r = await rx.result()
        return r.ok, r.reason, r.peer

    async def release(self, request_id: str, secrets: dict[str, str]) -> list[bool]:
        """Let go of sources a gather did not use (the caller's part, not the gather's)."""
        (agent,) = self.agents.values()
        return [await agent.release(request_id, name, "not needed by this rank", secret=s)
                for name, s in secrets.items()]

    async def expect(self, request_id: str, blocks: list[int], staged: bool, src: str) -> None:
        """Reserve ``blocks`` for a push from ``src``; ``staged``: only once a push waits in
        staging for them."""
        (agent,) = self.agents.values()
        while staged and agent.statistics().staged_transfers == 0:
            await anyio.sleep(0.01)
        self.receive = agent.expect(request_id, blocks, src=src)

    async def received(self) -> tuple[bool, str, str]:
        r = await self.receive.result()
        return r.ok, r.reason, r.peer

    async def dump(self) -> list[tuple[str, tuple[int, ...], bytes]]:
        """The destination's whole cache, every registered tensor (a split layout's K of
        every layer, then V), as (dtype, shape, bytes)."""
        (agent,) = self.agents.values()
        return [(str(t.dtype).removeprefix("torch."), tuple(t.shape),
                 t.contiguous().view(torch.uint8).numpy().tobytes())
                for t in agent.memory.layers]

    async def close(self) -> list[dict[str, Any]]:
        """Wait until every agent is at rest (5 s at most), report, close them."""
        agents = list(self.agents.values())
        with anyio.move_on_after(5):
            while any(_stats(a)[k] for a in agents for k in AT_REST):
                await anyio.sleep(0.02)
        stats = [_stats(a) for a in agents]
        self._close.set()
        await self._closed.wait()
        return stats


async def _serve(nats_url: str, cmd_q: Any, out_q: Any) -> None:
    async with anyio.create_task_group() as tg:
        worker = _Worker(nats_url, tg)
        out_q.put(("ok", "up"))
        while (cmd := await anyio.to_thread.run_sync(cmd_q.get)) is not None:
            op, kwargs = cmd
            try:
                with anyio.fail_after(OP_TIMEOUT_S):
                    out_q.put(("ok", await getattr(worker, op)(**kwargs)))
            except Exception:
                out_q.put(("error", f"{op} failed in the worker:\n{traceback.format_exc()}"))
        if worker.agents:
            await worker.close()
        tg.cancel_scope.cancel()


def worker_process(nats_url: str, cmd_q: Any, out_q: Any) -> None:
    """Entry point of a spawned worker: serve commands until ``None`` arrives."""
    anyio.run(_serve, nats_url, cmd_q, out_q)


# -- the test's side -------------------------------------------------------------------------

class WorkerError(AssertionError):
    """A worker answered with an error, died, or did not answer in time."""


class Workers:
    """The two spawned workers, "src" (every prefill rank) and "dst" (the decode rank)."""

    def __init__(self, nats_url: str) -> None:
        self.ctx, self.url = mp.get_context("spawn"), nats_url
        self.procs: dict[str, Any] = {}
        self.cmd: dict[str, Any] = {}
        self.out: dict[str, Any] = {}

    def start(self) -> None:
        for role in ("src", "dst"):
            self.cmd[role], self.out[role] = self.ctx.Queue(), self.ctx.Queue()
            self.procs[role] = self.ctx.Process(
                target=worker_process, args=(self.url, self.cmd[role], self.out[role]),
                daemon=True, name=f"reshape-{role}")
            self.procs[role].start()
        for role in ("src", "dst"):
            assert self.reply(role, 90) == "up"

    def stop(self) -> None:
        for role, proc in self.procs.items():
            if proc.is_alive():
                self.cmd[role].put(None)
        for proc in self.procs.values():
            proc.join(15)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.procs.clear()

    def restart(self) -> None:
        """After a failed example: whatever it left (agents, late replies) goes with it."""
        for proc in self.procs.values():
            proc.kill()
            proc.join(5)
        self.procs.clear()
        self.start()

    def send(self, role: str, op: str, **kwargs: Any) -> None:
        self.cmd[role].put((op, kwargs))

    def reply(self, role: str, timeout: float = REPLY_S) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, value = self.out[role].get(timeout=0.5)
                break
            except queue.Empty:
                proc = self.procs[role]
                if not proc.is_alive():
                    raise WorkerError(f"the {role} worker died (exit code {proc.exitcode})"
                                      ) from None
                if time.monotonic() > deadline:
                    raise WorkerError(f"the {role} worker did not answer in {timeout:g} s"
                                      ) from None
        if status == "error":
            raise WorkerError(value)
        return value

    def ask(self, role: str, op: str, **kwargs: Any) -> Any:
        self.send(role, op, **kwargs)
        return self.reply(role)
