"""The processes of the live fuzz test (test_fuzz_live.py) and of benchmarks/soak.py.

* ``agent_process``: one Agent in a child process, driven by commands on a queue (push,
  expect, offer, pull, abort, stats, stop), answering on a shared queue; a destination
  checks every completed transfer's bytes against the seeded source KV.
* ``Fleet``: the parent's side of those processes (start, kill, restart, call, wait).
* ``attacker_process``: an outsider with nothing but a NATS connection and a UCX worker.
  It learns instance ids and worker addresses from the registry (and, unless told not to,
  sniffs control subjects and reply inboxes, which a NATS account without per-subject
  permissions allows), then sprays control subjects, registry subjects and reply inboxes
  with fuzzed messages, and the agents' UCX workers with garbage tagged messages.

The attacker builds messages from ``kvstream.control.messages`` (the wire schema is
public) through ``build`` only, so new fields and a signing step need no change here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import math
import os
import queue
import random
import signal
import threading
import time
import typing
from typing import Any

import msgspec

__all__ = ["Fleet", "agent_process", "attacker_process", "fd_count", "rss_bytes"]

SENTINEL = -7777.0  # what destination blocks hold before a transfer
HANG_S = 40.0  # a command with no outcome after this long is reported as hung


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def fd_count(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# == the agents under attack: an Agent in a child process, driven by commands ==============

def agent_process(name: str, cfg_kw: dict[str, Any], layout_blob: bytes, nblocks: int,
                  cmd_q: Any, out_q: Any) -> None:
    """Run an Agent until "stop"; every command's outcome goes to ``out_q`` as a tuple
    ``(kind, token, ...)``. kvstream's log records are counted, not printed (an attack
    makes thousands); errors are kept, the first few whole, for ``statistics``."""
    import faulthandler

    import anyio

    faulthandler.enable()  # a crash prints where (Python's side of the stack) to stderr
    faulthandler.register(signal.SIGUSR1)  # and so does SIGUSR1 (Fleet: a stuck start)
    logging.getLogger("kvstream").addHandler(_LOG)
    logging.getLogger("kvstream").propagate = False
    anyio.run(_serve, name, cfg_kw, layout_blob, nblocks, cmd_q, out_q)


class _Counting(logging.Handler):
    """Counts log records by level (and errors by message); keeps the first errors."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[record.levelname] += 1
        if record.levelno >= logging.ERROR:
            self.counts[f"error: {record.getMessage()[:60]}"] += 1
            if len(self.errors) < 5:
                self.errors.append(self.format(record)[-3000:])


_LOG = _Counting()


def _blocks(t: Any, ids: list[int], kv_outer: bool) -> Any:
    return t[:, ids] if kv_outer else t[ids]


async def _serve(name: str, cfg_kw: dict[str, Any], layout_blob: bytes, nblocks: int,
                 cmd_q: Any, out_q: Any) -> None:
    import anyio

    from kvstream import Agent, AgentConfig, KVLayout
    from tests.fakes import cache

    layout = msgspec.msgpack.decode(layout_blob, type=KVLayout)
    kv = cache(layout, nblocks, fill=True)  # seeded: every process holds the same source KV
    ref = cache(layout, nblocks, fill=True)
    handles: dict[str, Any] = {}
    async with Agent(AgentConfig(**cfg_kw), layout=layout, kv_caches=kv) as agent:
        out_q.put(("up", name, agent.worker_address, os.getpid()))
        async with anyio.create_task_group() as tg:
            while True:
                try:
                    cmd = await anyio.to_thread.run_sync(cmd_q.get, True, 0.5)
                except queue.Empty:
                    if os.getppid() == 1:
                        break  # the parent is gone
                    continue
                if cmd[0] == "stop":
                    break
                tg.start_soon(_command, agent, kv, ref, layout, handles, cmd, out_q)
            tg.cancel_scope.cancel()
    out_q.put(("down", name, os.getpid()))


def statistics(agent: Any) -> dict[str, Any]:
    out = msgspec.structs.asdict(agent.statistics())
    out.update(rss=rss_bytes(), fds=fd_count(), threads=len(os.listdir("/proc/self/task")),
               log_counts=dict(_LOG.counts), log_errors=list(_LOG.errors))
    try:  # a diagnostic only (private state): UCX endpoints the process keeps open
        from kvstream.dataplane import ucx

        out["ucx_endpoints"] = len(ucx._Shared.endpoints)
    except (ImportError, AttributeError):
        pass
    return out


async def _feed(handle: Any, layers: int, rng: random.Random) -> None:
    """Mark ``layers`` layers ready as a prefill engine would, one by one with a little
    compute (fewer than all: the transfer waits for the rest until its deadline)."""
    import anyio

    for layer in range(layers):
        handle.layer_ready(layer)
        await anyio.sleep(rng.choice([0, 0, 0.001, 0.003]))


async def _command(agent: Any, kv: Any, ref: Any, layout: Any, handles: dict[str, Any],
                   cmd: tuple[Any, ...], out_q: Any) -> None:
    """One command: ``(op, token, options)``. Transfers answer ("started", token) once they
    have a handle and ("result", token, status, reason, bytes_ok) at their end; a
    destination's bytes_ok says whether the blocks hold exactly the source's KV."""
    import anyio

    from kvstream import KVStreamError

    op, token, o = cmd
    rng = random.Random(token)
    kv_outer = layout.chunks_per_block == 2
    handle = None

    def verify(dst: list[int], src: list[int]) -> bool:
        return all(bool((_blocks(kv[i], dst, kv_outer) == _blocks(ref[i], src, kv_outer)).all())
                   for i in range(layout.num_layers))

    def poison(dst: list[int]) -> None:
        for i in range(layout.num_layers):
            if kv_outer:
                kv[i][:, dst] = SENTINEL
            else:
                kv[i][dst] = SENTINEL

    try:
        with anyio.fail_after(HANG_S):
            match op:
                case "stats":
                    out_q.put(("stats", token, statistics(agent)))
                    return
                case "abort":
                    target = handles.get(o["token"])
                    if target is not None and not target.done:
                        await target.abort(o.get("reason", "random abort"))
                    return
                case "push":
                    handle = await agent.push(o["rid"], o["peer"], o["src"], mode=o["mode"],
                                              timeout=o.get("timeout"))
                case "offer":
                    handle = agent.offer(o["rid"], o["src"], mode=o["mode"],
                                         lease_s=o.get("lease_s"))
                case "expect":
                    poison(o["dst"])
                    handle = agent.expect(o["rid"], o["dst"], src=o["peer"])  # the pusher
                case "pull":
                    poison(o["dst"])
                    # protocol 2: the offer's secret, handed over with the request id
                    extra = {"secret": o["secret"]} if o.get("secret") else {}
                    handle = await agent.pull(o["rid"], o["peer"], o["dst"], mode=o["mode"],
                                              timeout=o.get("timeout"), **extra)
                case _:
                    raise ValueError(f"unknown command {op!r}")
            handles[token] = handle
            out_q.put(("started", token, {"secret": getattr(handle, "secret", "") or ""}))
            if op in ("push", "offer"):
                await _feed(handle, o.get("ready", layout.num_layers), rng)
            elif op == "pull" and o["mode"] == "lazy":
                with contextlib.suppress(KVStreamError):
                    for layer in range(layout.num_layers):
                        await handle.wait_layer(layer)
            result = await handle.result()
            ok = None
            if op in ("expect", "pull") and result.status.value == "completed":
                ok = verify(o["dst"], o["src"])
            out_q.put(("result", token, result.status.value, result.reason, ok))
    except KVStreamError as exc:
        out_q.put(("result", token, "refused", f"{type(exc).__name__}: {exc}", None))
    except TimeoutError:
        out_q.put(("result", token, "HUNG", f"no outcome within {HANG_S}s: {handle!r}", None))
        if handle is not None:
            with anyio.move_on_after(5, shield=True), contextlib.suppress(KVStreamError):
                await handle.abort("hung")
    except Exception as exc:  # a bug in the harness or kvstream: say so, keep serving
        out_q.put(("result", token, "ERROR", f"{type(exc).__name__}: {exc}", None))
    finally:
        handles.pop(token, None)


class Fleet:
    """The parent's side: agent processes by name, their commands and answers."""

    def __init__(self, ctx: Any, layout: Any, nblocks: int) -> None:
        self.ctx = ctx
        self.layout_blob = msgspec.msgpack.encode(layout)
        self.nblocks = nblocks
        self.out_q = ctx.Queue()
        self.procs: dict[str, Any] = {}
        self.cmd_qs: dict[str, Any] = {}
        self.cfgs: dict[str, dict[str, Any]] = {}
        self.info: dict[str, tuple[bytes, int]] = {}  # name -> (worker address, pid)
        self.events: list[tuple[Any, ...]] = []  # "up"/"down" and stray answers
        self._waiting: dict[str, queue.Queue[tuple[Any, ...]]] = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._reaped: set[str] = set()
        self._router = threading.Thread(target=self._route, daemon=True)
        self._closed = False
        self._router.start()

    def _route(self) -> None:
        while not self._closed:
            try:
                msg = self.out_q.get(timeout=0.2)
            except (queue.Empty, OSError, EOFError):
                self._reap()
                continue
            if msg[0] in ("up", "down"):
                with self._lock:
                    self.events.append(msg)
                    if msg[0] == "up":
                        self.info[msg[1]] = (msg[2], msg[3])
                continue
            with self._lock:
                box = self._waiting.get(msg[1])
            if box is not None:
                box.put(msg)
            else:
                with self._lock:
                    self.events.append(msg)

    def _reap(self) -> None:
        """A process that died by itself: what waits for it is answered "died"."""
        for name, proc in list(self.procs.items()):
            if proc.exitcode is not None and name not in self._reaped:
                self._reaped.add(name)
                self._answer_all(name, "died", f"{name} died (exit code {proc.exitcode})")

    def _answer_all(self, name: str, status: str, reason: str) -> None:
        with self._lock:
            boxes = [box for token, box in self._waiting.items()
                     if token.startswith(f"{name}:")]
        for box in boxes:
            box.put(("result", "", status, reason, None))

    def start(self, name: str, cfg_kw: dict[str, Any], timeout: float = 60.0) -> None:
        self.cfgs[name] = cfg_kw
        self.cmd_qs[name] = q = self.ctx.Queue()
        with self._lock:
            self.info.pop(name, None)
        proc = self.ctx.Process(target=agent_process, name=name, daemon=True,
                                args=(name, cfg_kw, self.layout_blob, self.nblocks, q, self.out_q))
        proc.start()
        self.procs[name] = proc
        self._reaped.discard(name)
        deadline = time.monotonic() + timeout
        while name not in self.info:
            if not proc.is_alive() or time.monotonic() > deadline:
                if proc.is_alive():  # where is it stuck? (its stack goes to stderr)
                    os.kill(proc.pid, signal.SIGUSR1)
                    time.sleep(1)
                raise RuntimeError(f"agent {name} did not come up within {timeout:g}s "
                                   f"(exit code {proc.exitcode})")
            time.sleep(0.05)

    def kill(self, name: str) -> None:
        """SIGKILL; every command still waiting for that process is answered "killed"."""
        proc = self.procs[name]
        self._reaped.add(name)
        proc.kill()
        proc.join(10)
        self._answer_all(name, "killed", f"{name} was killed")

    def restart(self, name: str) -> None:
        self.kill(name)
        self.start(name, self.cfgs[name])

    def address(self, name: str) -> bytes:
        return self.info[name][0]

    def pid(self, name: str) -> int:
        return self.info[name][1]

    def send(self, name: str, op: str, **options: Any) -> str:
        token = f"{name}:{op}:{next(self._tokens)}"
        box: queue.Queue[tuple[Any, ...]] = queue.Queue()
        with self._lock:
            self._waiting[token] = box
        if not self.procs[name].is_alive():
            box.put(("result", token, "killed", f"{name} is not running", None))
        else:
            self.cmd_qs[name].put((op, token, options))
        return token

    def wait(self, token: str, kinds: tuple[str, ...] = ("result",),
             timeout: float = HANG_S + 10) -> tuple[Any, ...] | None:
        """The next answer of one of ``kinds`` for ``token`` (None: none in time)."""
        with self._lock:
            box = self._waiting[token]
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = box.get(timeout=left)
            except queue.Empty:
                break
            if msg[0] in kinds:
                return msg
        return None

    def forget(self, token: str) -> None:
        with self._lock:
            self._waiting.pop(token, None)

    def stats(self, name: str, timeout: float = 20.0) -> dict[str, Any] | None:
        token = self.send(name, "stats")
        msg = self.wait(token, ("stats",), timeout)
        self.forget(token)
        return None if msg is None else msg[2]

    def stop(self, name: str, timeout: float = 30.0) -> int | None:
        """Ask for a clean exit; the exit code (None: still running after ``timeout``)."""
        proc = self.procs[name]
        if proc.is_alive():
            self.cmd_qs[name].put(("stop", "", {}))
        proc.join(timeout)
        return proc.exitcode

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._closed = True
        self._router.join(2)


# == the attacker ==========================================================================

def build(cls: type, **fields: Any) -> Any:
    """A ``cls`` message: the given fields it has, every other required one filled in.
    No validation: a forgery carries what it likes (the receiver must refuse it)."""
    names, required = _schema(cls)
    kw = {k: v for k, v in fields.items() if k in names}
    for name, filler in required.items():
        kw.setdefault(name, filler)
    return cls(**kw)


@functools.cache
def _schema(cls: type) -> tuple[frozenset[str], dict[str, Any]]:
    from msgspec import inspect as mi

    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return (frozenset(f.name for f in info.fields),
            {f.name: _filler(f.type) for f in info.fields if f.required})


def _filler(t: Any) -> Any:
    from msgspec import inspect as mi

    match t:
        case mi.IntType():
            return t.ge or 0
        case mi.FloatType():
            return 1.0
        case mi.StrType():
            return "x"
        case mi.BytesType():
            return b"x"
        case mi.LiteralType():
            return t.values[0]
        case mi.ListType():
            return []
        case mi.DictType():
            return {}
    return None


class Intel:
    """What the attacker learned: instances and addresses, and (sniffing) live traffic."""

    def __init__(self) -> None:
        self.announces: dict[str, Any] = {}  # instance id -> Announce
        self.raw: collections.deque[tuple[str, bytes, dict[str, str], str]] = \
            collections.deque(maxlen=4000)  # (subject, data, headers, reply) as observed
        self.inboxes: collections.deque[str] = collections.deque(maxlen=200)
        self.request_ids: collections.deque[str] = collections.deque(maxlen=500)
        self.transfer_ids: collections.deque[str] = collections.deque(maxlen=500)
        self.secrets: collections.deque[str] = collections.deque(maxlen=200)  # offers' (pulls)
        # (worker address that receives on it, tag prefix, blocks per layer, when seen)
        self.tags: collections.deque[tuple[bytes, int, int, float]] = \
            collections.deque(maxlen=500)
        self.fresh_tags: asyncio.Queue[tuple[bytes, int, int]] = asyncio.Queue(maxsize=1000)
        self.layout: Any = None
        self.observed = 0

    def learn(self, subject: str, data: bytes, headers: dict[str, str], reply: str) -> None:
        from kvstream.control import messages as m

        self.observed += 1
        self.raw.append((subject, data, headers, reply))
        if reply:
            self.inboxes.append(reply)
        if subject.startswith("_INBOX."):
            self.inboxes.append(subject)
        try:
            msg = m.decode(data)
        except Exception:
            return
        if getattr(msg, "request_id", ""):
            self.request_ids.append(msg.request_id)
        if getattr(msg, "transfer_id", ""):
            self.transfer_ids.append(msg.transfer_id)
        self.request_ids.extend((getattr(msg, "request_ids", None) or [])[:8])
        if getattr(msg, "secret", ""):
            self.secrets.append(msg.secret)
        self.secrets.extend(s for s in (getattr(msg, "secrets", None) or [])[:8] if s)
        match msg:
            case m.Announce():
                self.announces[msg.instance_id] = msg
                if msg.layout is not None and self.layout is None:
                    self.layout = msg.layout  # the first, honest one (forgeries come later)
            case m.Accept() | m.Pull():
                self._tag(msg.dst_address, msg.dst_tag, len(msg.dst_blocks) - len(
                    getattr(msg, "skip", [])))
            case m.Manifest():
                self._tag(msg.src_address, msg.src_tag, len(msg.src_blocks) - len(msg.skip))

    def _tag(self, address: bytes, prefix: int, nblocks: int) -> None:
        self.tags.append((address, prefix, max(nblocks, 0), time.monotonic()))
        with contextlib.suppress(asyncio.QueueFull):
            self.fresh_tags.put_nowait((address, prefix, max(nblocks, 0)))


ODD_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -1.0, 5e-324, 1e-3, 1e7, 1e7 + 1, 1e308)
ODD_INTS = (-1, 0, 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 48) - 1, 1 << 48, (1 << 63) - 1,
            (1 << 64) - 1, -(1 << 63))


KINDS = ("random", "msgpack", "wrong_shape", "truncated", "flipped", "forged", "replay")
KIND_WEIGHTS = tuple(itertools.accumulate((10, 10, 15, 10, 10, 35, 10)))
FORGED = ("announce", "announce_new", "leave", "manifest", "pull", "abort", "done", "renew",
          "accept", "reject", "abort_ack", "renew_ack")
FORGED_WEIGHTS = tuple(itertools.accumulate((2, 1, 1, 2, 2, 2, 1, 1, 1, 1, 1, 1)))
# Every label a control message gets (what KVSTREAM_FUZZ_ONLY selects by prefix).
LABELS = tuple(f"{k}_{f}" if k in ("forged", "wrong_shape") else k for k in KINDS
               for f in (FORGED if k in ("forged", "wrong_shape") else ("",)))


class Forger:
    """Fuzzed control messages: (label, subject, payload, reply, headers)."""

    def __init__(self, intel: Intel, rng: random.Random, namespace: str, victims: list[str],
                 request_hints: list[str], my_inbox: str, keep_version: bool = False) -> None:
        from kvstream.control import messages as m
        from kvstream.control.subjects import Subjects

        self.m = m
        self.intel, self.rng, self.victims = intel, rng, victims
        self.subjects = Subjects(namespace)
        self.hints = request_hints
        self.my_inbox = my_inbox
        self.keep_version = keep_version
        try:  # protocol 2 signs messages; the attacker signs with a key of its own
            from kvstream.control.identity import Identity
        except ImportError:
            Identity = None
        self.identity = Identity
        self.keys: dict[str, Any] = {}
        self.types = typing.get_args(m.ControlUnion)
        # The victims' real addresses, as announced before the attack (the registry carries
        # the attacker's own forgeries afterwards).
        self.real = [a.worker_address for v, a in intel.announces.items()
                     if v in victims and a.worker_address] or [b"\x00" * 64]
        self.counts: collections.Counter[str] = collections.Counter()

    # -- values ---------------------------------------------------------------------------
    def address(self) -> bytes:
        """A UCX worker address gone wrong (or a real one, another instance's)."""
        r = self.rng
        base = r.choice(self.real)
        made = self.pick(
            base, lambda: _flip(r, base, 1), lambda: _flip(r, base, r.randint(2, 16)),
            b"\xff" * len(base), b"\x00" * len(base), lambda: base[: r.randrange(len(base))],
            lambda: base + r.randbytes(r.randint(1, 64)), b"",
            lambda: r.randbytes(r.choice([1, 8, 100, 4096, 64 << 10])),
            lambda: r.randbytes(len(base)))
        if self.keep_version and made and made[0] != base[0]:
            # UCX asserts on the version byte (address.c: SIGABRT): keep it, to look past it
            made = base[:1] + made[1:]
        return typing.cast(bytes, made)

    def instance(self) -> str:
        r = self.rng
        return r.choice([*self.victims, *self.victims, "attacker", f"ghost-{r.randrange(1 << 30)}",
                         "", "x" * 1024, "x" * 1025, "a.b", "*", "é", "kvs>"])

    def request_id(self) -> str:
        r = self.rng
        pool = [*self.intel.request_ids, *self.hints]
        if pool and r.random() < 0.8:
            return r.choice(pool)
        return r.choice(["", "r" * 1024, f"r{r.randrange(1000)}", "\x00"])

    def transfer_id(self) -> str:
        pool = list(self.intel.transfer_ids)
        if pool and self.rng.random() < 0.8:
            return self.rng.choice(pool)
        return self.rng.randbytes(16).hex()

    def pick(self, *makers: Any) -> Any:
        """One of ``makers`` (a value, or a function making it: big ones are made only
        when picked)."""
        made = self.rng.choice(makers)
        return made() if callable(made) else made

    def blocks(self) -> list[int]:
        r = self.rng
        return typing.cast(list[int], self.pick(
            [], [0], lambda: r.sample(range(64), r.randint(1, 8)),
            lambda: r.sample(range(64), r.randint(1, 8)), [3, 3], [10**9], [-1], [1 << 31],
            lambda: list(range(r.randint(1000, 200_000))), lambda: [r.randrange(64)] * 10_000))

    def tag(self) -> int:
        r = self.rng
        if self.intel.tags and r.random() < 0.5:
            return r.choice(self.intel.tags)[1]  # a live transfer's (sniffed)
        return r.choice([*ODD_INTS, r.randrange(1, 1001), r.getrandbits(48)])

    def floats(self) -> float:
        return self.rng.choice([*ODD_FLOATS, self.rng.uniform(0, 60)])

    def layout_fields(self) -> dict[str, Any]:
        lay = self.intel.layout
        if lay is None or self.rng.random() < 0.2:
            return {"fingerprint": self.rng.choice(["", "f" * 8192, "nope"]),
                    "num_layers": self.rng.choice([1, 4096, 4097, 0])}
        return {"fingerprint": lay.fingerprint, "num_layers": lay.num_layers}

    def odd(self, depth: int = 0) -> Any:
        """Any MessagePack value, the odd ones weighted in."""
        r = self.rng
        k = r.randrange(12 if depth < 2 else 9)
        return [
            lambda: None, lambda: r.random() < 0.5, lambda: r.choice(ODD_INTS),
            lambda: r.choice(ODD_FLOATS), lambda: r.randbytes(r.randint(0, 40)).decode("latin-1"),
            lambda: r.randbytes(r.randint(0, 40)), lambda: "x" * r.choice([1025, 8193, 70_000]),
            lambda: r.getrandbits(64), lambda: -r.getrandbits(63),
            lambda: [self.odd(depth + 1) for _ in range(r.randint(0, 4))],
            lambda: {r.choice(["op", "v", "", "transfer_id", r.randbytes(4).hex()]):
                     self.odd(depth + 1) for _ in range(r.randint(0, 4))},
            lambda: [0] * r.choice([70_000, (1 << 16) + 1, 200_000]),
        ][k]()

    # -- messages -------------------------------------------------------------------------
    def forged(self, kind: str = "") -> tuple[str, Any, str]:
        """(label, message, subject): a plausible message in other instances' names (their
        ids, their addresses, ids and tags seen in traffic), then, more often than not, one
        to three fields made odd (flipped addresses, huge lists, NaN deadlines, ...), so
        that both the checks and what lies behind them are reached."""
        m, r, s = self.m, self.rng, self.subjects
        victim = r.choice(self.victims)
        other = r.choice([v for v in self.victims if v != victim] or self.victims)
        ctl = s.control(victim)
        kind = kind or r.choices(FORGED, cum_weights=FORGED_WEIGHTS)[0]
        lay = self.intel.layout
        fp, layers = (lay.fingerprint, lay.num_layers) if lay is not None else ("f", 4)
        nb = r.randint(1, 6)
        small = r.sample(range(64), nb)
        fresh = f"r{r.getrandbits(32):x}"
        subject = ctl
        ids = lambda: [self.request_id() for _ in range(r.randint(1, 8))]  # noqa: E731
        plausible: dict[str, Any]
        odd: dict[str, Any]  # field -> value, or a function making one
        match kind:
            case "announce" | "announce_new":
                iid = other if kind == "announce" else f"ghost-{r.getrandbits(40):x}"
                cls, subject = m.Announce, s.registry(iid)
                plausible = dict(instance_id=iid, role=r.choice(["prefill", "decode", "both"]),
                                 worker_address=r.choice(self.real), layout=lay, seq=r.randrange(9))
                odd = dict(instance_id=self.instance, worker_address=self.address,
                           layout=None, load=self.floats, num_blocks=lambda: r.choice(ODD_INTS),
                           heartbeat_s=self.floats, seq=lambda: r.choice(ODD_INTS),
                           endpoint=lambda: r.choice(["http://x:1", "h" * 8192, "h" * 9000]),
                           # protocol 2: "these peers' endpoints I dropped" (drop yours too)
                           forgot=lambda: self.pick(
                               {v: r.choice(ODD_INTS) for v in self.victims},
                               lambda: {f"g{i}": i for i in range(r.choice([64, 65, 1000]))}))
                if kind == "announce_new":  # a flood of new names, every field at its largest
                    plausible.update(worker_address=r.randbytes(64 << 10), role="decode",
                                     endpoint="http://" + "h" * 8000)
                    odd = {}
            case "leave":
                cls, subject = m.Leave, s.registry(r.choice([other, other, victim]))
                plausible, odd = dict(instance_id=other), dict(instance_id=self.instance)
            case "manifest":
                cls = m.Manifest
                plausible = dict(transfer_id=r.randbytes(16).hex(),
                                 request_id=r.choice([fresh, self.request_id()]), src=other,
                                 dst=victim, src_address=r.choice(self.real), src_tag=self.tag(),
                                 fingerprint=fp, num_layers=layers, src_blocks=small,
                                 deadline_s=r.choice([1.0, 5.0]))
                odd = dict(transfer_id=self.transfer_id, src=self.instance, dst=self.instance,
                           src_address=self.address, src_tag=self.tag,
                           fingerprint=lambda: r.choice(["", "f" * 8192]),
                           num_layers=lambda: r.choice([1, 4096, 4097, 0]), src_blocks=self.blocks,
                           dst_blocks=self.blocks, mode="bogus",
                           codec=lambda: r.choice(["fp8_e4m3", "int8", "zstd", ""]),
                           payload_bytes=lambda: r.choice(ODD_INTS), deadline_s=self.floats,
                           block_hashes=lambda: self.pick(list(range(-5, 5)), [0] * 300_000),
                           skip=lambda: r.choice([[0], [0, 0], [10**6], list(range(nb))]),
                           lease_s=self.floats,
                           cache_scales=lambda: r.choice([[math.nan] * 8, [1.0] * 8]))
            case "pull":
                cls = m.Pull
                plausible = dict(request_id=self.request_id(), src=victim, dst=other,
                                 dst_address=r.choice(self.real), dst_tag=self.tag(),
                                 fingerprint=fp, num_layers=layers, dst_blocks=small,
                                 deadline_s=r.choice([1.0, 5.0]))
                odd = dict(request_id=lambda: r.choice(["", "r" * 1025, fresh]), src=self.instance,
                           dst=self.instance, dst_address=self.address, dst_tag=self.tag,
                           fingerprint=lambda: r.choice(["", "f" * 8192]),
                           num_layers=lambda: r.choice([1, 4096, 0]), dst_blocks=self.blocks,
                           have=lambda: self.pick(list(range(100)), [0] * 200_000),
                           mode=lambda: r.choice(["lazy", "bogus"]), deadline_s=self.floats,
                           codec=lambda: r.choice(["fp8_e4m3", "int8", "zstd"]),
                           secret=lambda: r.choice([r.randbytes(16).hex(), "s" * 257]))
                if self.intel.secrets and r.random() < 0.5:  # sniffed: the offer's own
                    plausible["secret"] = r.choice(self.intel.secrets)
            case "abort":
                cls = m.Abort
                plausible = dict(transfer_id=r.choice(["", self.transfer_id()]),
                                 request_id=self.request_id(), reason="fuzz", by=other,
                                 secret=r.choice([*self.intel.secrets, ""]))
                odd = dict(by=self.instance, reason=lambda: "x" * 9000,
                           secret=lambda: r.randbytes(16).hex(), transfer_id=self.transfer_id)
            case "done":
                cls = m.Done
                plausible = dict(transfer_id=self.transfer_id(), request_id=self.request_id(),
                                 status=r.choice(["completed", "failed", "aborted"]))
                odd = dict(status=lambda: r.choice(["timed_out", "expired", "bogus"]),
                           bytes=lambda: r.choice(ODD_INTS), layers=lambda: r.choice(ODD_INTS))
            case "renew":
                cls = m.Renew
                plausible = dict(by=other, request_ids=ids())
                odd = dict(by=self.instance, request_ids=lambda: [self.request_id()] * r.choice(
                    [1 << 16, (1 << 16) + 1]), secrets=lambda: ["s"] * 8)
            case "accept":
                cls, subject = m.Accept, self.reply_subject() or ctl
                plausible = dict(transfer_id=self.transfer_id(), dst_tag=self.tag(),
                                 dst_address=r.choice(self.real), dst_blocks=small)
                odd = dict(dst_address=self.address, dst_blocks=self.blocks, dst_tag=self.tag,
                           skip=lambda: r.choice([[0], [0, 0], [10**6]]))
            case "reject":
                cls, subject = m.Reject, self.reply_subject() or ctl
                plausible = dict(transfer_id=self.transfer_id(),
                                 code=r.choice(["busy", "malformed", "duplicate"]), reason="fuzz")
                odd = dict(code="bogus", reason=lambda: "x" * 9000)
            case "abort_ack":
                cls, subject = m.AbortAck, self.reply_subject() or ctl
                plausible, odd = dict(transfer_id=self.transfer_id()), {}
            case _:
                cls, subject = m.RenewAck, self.reply_subject() or ctl
                plausible = dict(unknown=ids(), lease_s=r.choice([0.5, 30.0]))
                odd = dict(lease_s=self.floats, unknown=lambda: [""] * 70_000)
        if odd and r.random() < 0.6:
            for name in r.sample(sorted(odd), min(len(odd), r.choice([1, 1, 2, 3]))):
                value = odd[name]
                plausible[name] = value() if callable(value) else value
        return kind, build(cls, **plausible), subject

    def reply_subject(self) -> str:
        """A reply-ish subject: an inbox seen in traffic, or one under its prefix."""
        inboxes = list(self.intel.inboxes)
        if not inboxes:
            return ""
        box = self.rng.choice(inboxes)
        if self.rng.random() < 0.5:
            return box
        return box.rsplit(".", 1)[0] + "." + self.rng.randbytes(6).hex()

    def subject(self) -> str:
        r, s = self.rng, self.subjects
        victim = r.choice(self.victims)
        return r.choice([s.control(victim), s.control(victim), s.registry(victim),
                         s.registry(r.choice(self.victims)), s.registry(f"ghost-{r.randrange(99)}"),
                         s.control(f"ghost-{r.randrange(99)}"), self.reply_subject() or
                         s.control(victim)])

    def headers(self, subject: str, data: bytes, claim: str) -> dict[str, str] | None:
        """Unsigned, garbage headers, or (protocol 2) signed with the attacker's own key,
        claiming ``claim`` or its own name."""
        r = self.rng
        choice = r.randrange(8)
        if choice < 4 or (self.identity is None and choice > 5):
            return None
        if choice < 6:
            return {"Kvs-From": claim, "Kvs-Key": r.randbytes(40).hex(), "Kvs-Sig": "A" * 88,
                    "traceparent": "00-" + "f" * 32 + "-" + "f" * 16 + "-01",
                    "X-Junk": "j" * r.choice([1, 4000])}
        who = claim if choice == 6 else "attacker"
        if who not in self.keys:
            self.keys[who] = self.identity(who)
        return typing.cast(dict[str, str], self.keys[who].seal(subject, data))

    def next(self, only: tuple[str, ...] = ()) -> tuple[str, str, bytes, str,
                                                        dict[str, str] | None]:
        """One fuzzed control message: (label, subject, payload, reply, headers); with
        ``only``, one whose label starts with one of those (to bisect)."""
        if not only:
            kind = self.rng.choices(KINDS, cum_weights=KIND_WEIGHTS)[0]
            return self._next(kind, "")
        labels = [label for label in LABELS if label.startswith(only)]
        if not labels:
            raise ValueError(f"no message kind starts with any of {only}; kinds: {LABELS}")
        label = self.rng.choice(labels)
        for kind in ("forged", "wrong_shape"):
            if label.startswith(kind + "_"):
                return self._next(kind, label[len(kind) + 1:])
        return self._next(label, "")

    def _next(self, kind: str, sub: str) -> tuple[str, str, bytes, str, dict[str, str] | None]:
        m, r = self.m, self.rng
        subject = self.subject()
        claim = r.choice(self.victims)
        reply = r.choice(["", "", self.my_inbox, self.reply_subject()])
        seen = list(self.intel.raw)[-500:]
        if kind == "random":
            data = r.randbytes(r.choice([0, 1, 2, 7, 64, 300, 4096, 60_000]))
        elif kind == "msgpack":
            data = _encode(self.odd())
        elif kind == "wrong_shape":
            label, msg, subject = self.forged(sub)
            doc = msgspec.to_builtins(msg, builtin_types=(bytes,))
            doc[r.choice(sorted(doc))] = self.odd()
            if r.random() < 0.3:
                doc.pop(r.choice(sorted(doc)), None)
            if r.random() < 0.2:
                doc["op"] = r.choice([c.__struct_config__.tag for c in self.types])
            data = _encode(doc)
            kind = f"wrong_shape_{label}"
        elif kind in ("truncated", "flipped", "replay") and seen:
            ctl = [x for x in seen[-200:] if ".inst." in x[0]]  # requests, not heartbeats
            subject0, data, headers0, reply0 = r.choice(ctl if ctl and r.random() < 0.7
                                                        else seen)
            if kind == "truncated":
                data = data[: r.randrange(max(1, len(data)))]
            elif kind == "flipped":
                b = bytearray(data or b"\x00")
                for _ in range(r.randint(1, 8)):
                    b[r.randrange(len(b))] ^= 1 << r.randrange(8)
                data = bytes(b)
            else:  # verbatim, with the original (possibly valid) signature
                self.counts[kind] += 1
                target = subject0 if not subject0.startswith("_INBOX.") else subject
                return kind, target, data, reply0 if r.random() < 0.5 else reply, headers0
        else:
            label, msg, subject = self.forged(sub)
            data = m.encode(msg)
            kind = f"forged_{label}"
        self.counts["wrong_shape" if kind.startswith("wrong") else kind] += 1
        return kind, subject, data, reply, self.headers(subject, data, claim)


def _flip(r: random.Random, data: bytes, n: int) -> bytes:
    b = bytearray(data)
    for _ in range(n):
        b[r.randrange(len(b))] ^= 1 << r.randrange(8)
    return bytes(b)


def _encode(value: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except (OverflowError, TypeError, msgspec.EncodeError):
        return b"\xc1"


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """What the attacker does."""

    nats_url: str
    namespace: str = "default"
    victims: list[str]
    n_control: int  # fuzzed control messages
    n_data: int  # garbage tagged UCX messages
    seed: int = 1
    sniff: bool = True  # subscribe to control subjects and inboxes too
    rate: float = 0.0  # control messages per second (0: as fast as it can)
    request_hints: list[str] = []  # request ids it guesses (predictable ones)
    only: tuple[str, ...] = ()  # control message kinds (label prefixes) to send, to bisect
    # Forged worker addresses keep the version byte UCX asserts on (to look past that crash).
    keep_version: bool = False
    # At the end, die (SIGKILL) with a burst of rendezvous sends in flight to the agents.
    crash_at_end: bool = True


def attacker_process(plan: Plan, cmd_q: Any, out_q: Any) -> None:
    """Learn, report ("ready", ...), spray, report ("done", figures), wait for "stop"."""
    asyncio.run(_attack(plan, cmd_q, out_q))


async def _attack(plan: Plan, cmd_q: Any, out_q: Any) -> None:
    import nats
    import ucxx

    from kvstream.control.subjects import Subjects

    rng = random.Random(plan.seed)
    intel = Intel()
    subjects = Subjects(plan.namespace)
    victims = plan.victims
    nc = await nats.connect(plan.nats_url, name="fuzz-attacker", max_reconnect_attempts=-1)
    replies = collections.Counter()

    async def observe(msg: Any) -> None:
        intel.learn(msg.subject, msg.data, dict(msg.headers or {}), msg.reply)

    async def answered(msg: Any) -> None:
        replies["replies"] += 1

    await nc.subscribe(subjects.registry_all, cb=observe)
    if plan.sniff:
        await nc.subscribe(subjects.control_all, cb=observe)
        await nc.subscribe("_INBOX.>", cb=observe)
    my_inbox = nc.new_inbox()
    await nc.subscribe(my_inbox, cb=answered)
    deadline = time.monotonic() + 30
    while not all(v in intel.announces for v in victims) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    ucxx.init(progress_mode="thread", enable_python_future=True)
    out_q.put(("ready", sorted(intel.announces)))
    forger = Forger(intel, rng, plan.namespace, victims, plan.request_hints, my_inbox,
                    plan.keep_version)
    addresses = list(forger.real)
    figures: dict[str, Any] = {}
    t0 = time.monotonic()
    await asyncio.gather(_spray_control(nc, forger, plan, figures),
                         _spray_data(intel, random.Random(plan.seed + 1), addresses,
                                     plan.n_data, figures))
    figures["seconds"] = round(time.monotonic() - t0, 2)
    figures["kinds"] = dict(forger.counts)
    figures["replies"] = replies["replies"]
    figures["observed"] = intel.observed
    figures["tags_sniffed"] = len(intel.tags)
    out_q.put(("done", figures))
    if plan.crash_at_end and plan.n_data:
        # The last act: a burst of rendezvous-sized messages on tags nobody owns, and the
        # attacker dies (SIGKILL) with them in flight, as a crashing peer would.
        await _spray_burst(addresses, rng)
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # stay (endpoints open, rendezvous sends pending) until told to go
        try:
            cmd = await asyncio.to_thread(cmd_q.get, True, 0.5)
        except queue.Empty:
            if os.getppid() == 1:
                break
            continue
        if cmd[0] == "stop":
            break
    with contextlib.suppress(Exception):
        await nc.close()
    os._exit(0)  # no ucxx teardown: pending sends to peers are simply abandoned


async def _spray_control(nc: Any, forger: Forger, plan: Plan, figures: dict[str, Any]) -> None:
    import nats.errors

    sent = errors = 0
    rate = plan.rate
    t0 = time.monotonic()
    for i in range(plan.n_control):
        _kind, subject, data, reply, headers = forger.next(plan.only)
        try:
            await nc.publish(subject, data, reply=reply or "", headers=headers)
            sent += 1
        except (nats.errors.Error, ValueError, TypeError):
            errors += 1  # over max_payload, a subject NATS refuses, ...
        if i % 200 == 199:
            with contextlib.suppress(Exception):
                await nc.flush(timeout=10)
            if rate > 0:
                ahead = (i + 1) / rate - (time.monotonic() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)
    with contextlib.suppress(Exception):
        await nc.flush(timeout=10)
    figures.update(control_sent=sent, control_errors=errors,
                   control_seconds=round(time.monotonic() - t0, 2))


class Shot(typing.NamedTuple):
    """One garbage message: where, on which tag (and what the tag was built from)."""

    what: str  # "raced" (a tag just sniffed), "sniffed", "counter" or "random"
    address: bytes
    prefix: int
    layer: int
    kind: int
    wide: bool  # protocol 2 layout (48|12|4) rather than protocol 1 (32|24|8)
    nblocks: int  # blocks per layer, when sniffed (else a guess)

    @property
    def tag(self) -> int:
        if self.what == "random":
            return self.prefix
        if self.wide:
            return ((self.prefix & (1 << 48) - 1) << 16) | ((self.layer & 0xFFF) << 4) | (
                self.kind & 0xF)
        return ((self.prefix & 0xFFFFFFFF) << 32) | ((self.layer & 0xFFFFFF) << 8) | (
            self.kind & 0xFF)


def _aim(intel: Intel, rng: random.Random, addresses: list[bytes], layers: int) -> Shot:
    layer = rng.randrange(layers + 1) if rng.random() < 0.2 else rng.randrange(layers)
    kind = rng.choice([0, 0, 1, 2, 2, 3, rng.randrange(16)])
    wide = rng.random() < 0.5
    try:
        fresh = intel.fresh_tags.get_nowait() if rng.random() < 0.5 else None
    except asyncio.QueueEmpty:
        fresh = None
    if fresh is not None:  # just sniffed: race the honest sender to it
        address, prefix, nb = fresh
        return Shot("raced", address, prefix, layer, rng.choice([0, 1, 2, 2, 3]), wide, nb)
    if intel.tags and rng.random() < 0.4:
        address, prefix, nb, _ = rng.choice(intel.tags)
        return Shot("sniffed", address, prefix, layer, kind, wide, nb)
    address = rng.choice(addresses)
    if rng.random() < 0.3:
        return Shot("random", address, rng.getrandbits(64), 0, 0, wide, 0)
    return Shot("counter", address, rng.randint(1, 1000), layer, kind, wide, 0)


def _payload(rng: random.Random, intel: Intel, shot: Shot) -> Any:
    """Garbage for ``shot``: of a size a receive of that kind could have posted, and
    sometimes a credit or a layer header that checks out, so that what follows is taken
    for KV."""
    import numpy as np

    from kvstream.dataplane import wire

    lay = intel.layout
    block = lay.block_bytes if lay is not None else 2048
    planes = lay.chunks_per_block if lay is not None else 2
    nb = shot.nblocks or rng.randint(1, 8)
    layer_bytes = block * nb
    size = rng.choice([0, 1, 7, 8, 9, 64, 511, 512, 513, layer_bytes, layer_bytes // planes,
                       wire.HEADER_CAPACITY + layer_bytes, 4096, 8192, 65536,
                       1 << 20 if rng.random() < 0.05 else 100])
    if shot.what in ("raced", "sniffed") and rng.random() < 0.7:  # the sizes that land
        size = {0: 40, 1: 8, 2: rng.choice([wire.HEADER_CAPACITY + layer_bytes,
                                            layer_bytes // planes])}.get(
            shot.kind, layer_bytes // planes)
    buf = np.frombuffer(bytearray(rng.randbytes(size)), dtype=np.uint8).copy()
    header = wire.LayerHeader(shot.prefix, shot.layer, layer_bytes, planes)
    with contextlib.suppress(Exception):
        if shot.kind == 1 and size == 8:
            buf[:] = np.frombuffer(wire.encode_credit(rng.choice([1 << 40, -1, 4, 0, 1])),
                                   np.uint8)
        elif shot.kind == 0 and size >= 8 and rng.random() < 0.8:
            buf = np.zeros(wire.HEADER_CAPACITY, np.uint8)
            buf = buf[:wire.encode_header(header, buf.data)]
        elif size == wire.HEADER_CAPACITY + layer_bytes:  # one message: header, then KV
            wire.encode_header(msgspec.structs.replace(header, parts=1),
                               buf[:wire.HEADER_CAPACITY].data)
    return buf


async def _spray_burst(addresses: list[bytes], rng: random.Random, count: int = 500,
                       size: int = 64 << 10) -> None:
    import numpy as np
    import ucxx

    buf = np.full(size, 0xA5, dtype=np.uint8)
    futs = []
    for address in addresses:
        ep = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=False)
        futs += [asyncio.ensure_future(ep.send(buf, tag=rng.getrandbits(64), force_tag=True))
                 for _ in range(count)]
    await asyncio.wait(futs, timeout=0.05)


async def _spray_data(intel: Intel, rng: random.Random, addresses: list[bytes], n: int,
                      figures: dict[str, Any]) -> None:
    import ucxx

    endpoints: dict[bytes, Any] = {}
    pending: set[asyncio.Future[Any]] = set()
    stuck: set[asyncio.Future[Any]] = set()  # kept referenced (their buffers too), not awaited
    counts: collections.Counter[str] = collections.Counter()
    layers = intel.layout.num_layers if intel.layout is not None else 4

    async def endpoint(address: bytes) -> Any:
        if address not in endpoints:
            endpoints[address] = await ucxx.create_endpoint_from_worker_address(
                ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=False)
        return endpoints[address]

    t0 = time.monotonic()
    for i in range(n):
        shot = _aim(intel, rng, addresses, layers)
        if shot.address not in addresses:
            # Sniffed from a forgery (its own, likely): UCX would abort this process on a
            # bad address, as it aborts an agent (the attacker is no better protected).
            shot = shot._replace(address=rng.choice(addresses))
        try:
            ep = await endpoint(shot.address)
            buf = _payload(rng, intel, shot)
            fut = asyncio.ensure_future(ep.send(buf, tag=shot.tag, force_tag=True))
            pending.add(fut)
            fut.add_done_callback(pending.discard)
            counts[shot.what] += 1
        except Exception as exc:
            counts[f"error {type(exc).__name__}"] += 1
        if i % 50 == 49:
            await asyncio.sleep(0.002)  # let the sends progress, and new tags be sniffed
        while len(pending) > 256:
            done, _ = await asyncio.wait(pending, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
            if not done:  # rendezvous sends nobody receives: they stay pending, uncounted
                stuck.update(pending)
                pending.clear()
    with contextlib.suppress(Exception):
        await asyncio.wait(pending | stuck, timeout=2)
    figures.update(data_sent=sum(v for k, v in counts.items() if not k.startswith("error")),
                   data_kinds=dict(counts),
                   data_pending=sum(not f.done() for f in pending | stuck),
                   data_seconds=round(time.monotonic() - t0, 2))
