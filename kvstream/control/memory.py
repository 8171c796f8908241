"""An in-memory NATS for unit tests: ``MemoryHub`` is the server, ``MemoryBus`` a connection.

It keeps the NATS behaviour an agent relies on, so code tested here behaves the same on
``ControlBus``: subjects with ``*``/``>`` wildcards, every payload encoded and decoded
(a handler sees what NATS would give it), no-responders told apart from a timeout, a
publisher's own subscriptions receive its messages (NATS echo), per-subscriber order.

One hub per test, ``async with MemoryHub() as hub``; an agent gets an open port,
``MemoryBus(hub, name)``, or ``hub.connect`` as an async factory shaped like
``ControlBus.connect``; it closes the port, the hub's exit closes what is left.

Each subscription has a queue of ``BUFFER`` messages; when it is full the publisher
blocks until the handler catches up (NATS would buffer; blocking loses nothing). A
handler that publishes to its own full, non-spawning subscription would deadlock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from kvstream._exceptions import ControlPlaneError, MessageDecodeError, NoPeerError
from kvstream.control import messages as m
from kvstream.control.identity import SENDER, Seal, key_in
from kvstream.control.limits import InFlight, Throttle
from kvstream.control.port import Handler
from kvstream.control.replies import key_for, open_message
from kvstream.control.stream import StreamSpec

__all__ = ["BUFFER", "MAX_KEPT", "DropRule", "MemoryBus", "MemoryHub"]

MAX_KEPT = 1 << 16  # messages a hub's stream keeps (the oldest go first)

log = logging.getLogger("kvstream.control")

BUFFER = 1000

# (subject, message) -> True to lose it; replies are offered as ("_INBOX.<n>", reply).
DropRule = Callable[[str, m.ControlMessage], bool]


class _Reply:
    """A request's inbox: the first answer that opens as the asked peer's wins, as with
    ``ControlBus.request`` (others are dropped and counted in the asker's seal)."""

    def __init__(self, subject: str, seal: Seal, peer: str | None) -> None:
        self.subject = subject
        self.seal, self.peer = seal, peer
        self.data: bytes | None = None
        self.done = anyio.Event()

    def respond(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        if self.data is not None:
            return
        opened = self.seal.reply_from(self.subject, data, headers, self.peer)
        if opened is not None:
            self.data = opened[0]
            self.done.set()


@dataclass(frozen=True)
class _Delivery:
    subject: str
    data: bytes
    headers: dict[str, str]
    reply: _Reply | None


def _tokens(subject: str, *, wildcards: bool) -> list[str]:
    tokens = subject.split(".")
    bad = any(not t or any(c.isspace() for c in t) for t in tokens)
    # '>' only as the last token of a pattern; a published subject has no wildcard
    wild = (">" in tokens[:-1]) if wildcards else ("*" in tokens or ">" in tokens)
    if bad or wild:
        raise ControlPlaneError(f"invalid NATS subject {subject!r}")
    return tokens


def _matches(pattern: list[str], subject: list[str]) -> bool:
    for i, p in enumerate(pattern):
        if p == ">":
            return len(subject) > i  # '>' takes one token or more
        if i >= len(subject) or (p != "*" and p != subject[i]):
            return False
    return len(pattern) == len(subject)


class _Subscription:
    def __init__(self, bus: MemoryBus, subject: str, handler: Handler,
                 spawn: Callable[..., object] | None, queue: str = "") -> None:
        self.bus, self.subject, self.handler, self.spawn = bus, subject, handler, spawn
        self.queue = queue
        self.pattern = _tokens(subject, wildcards=True)
        self.send, self.recv = anyio.create_memory_object_stream[_Delivery](BUFFER)
        self.scope = anyio.CancelScope()

    async def run(self) -> None:
        with self.scope, contextlib.suppress(anyio.ClosedResourceError, anyio.EndOfStream):
            async for d in self.recv:
                await self.admit(d)

    async def admit(self, d: _Delivery) -> None:
        """As ``ControlBus.serve``: malformed and unauthenticated input counted, refused and
        survived, in order; what passes gets a task with ``spawn``, within ``inflight``."""
        bus, hub = self.bus, self.bus.hub
        opened = open_message(bus.seal, d.subject, d.data, d.headers)
        if isinstance(opened, MessageDecodeError):
            bus.malformed += 1
            bus._quiet.warning("malformed", "dropped malformed message on %s: %s",
                               d.subject, opened)
            if d.reply is not None:
                hub._respond(d.reply, m.Reject(transfer_id="", code="malformed",
                                               reason=str(opened)[:1000]), bus.seal)
            return
        if opened is None:
            if d.reply is not None:
                hub._respond(d.reply, m.Reject(
                    transfer_id="", code="unauthenticated",
                    reason="the message is not signed by the instance it names"), bus.seal)
            return
        decoded, headers = opened
        if self.spawn is None or d.reply is None:  # a publish never waits: inline
            await self.handle(decoded, headers, d)
            return
        sender = headers.get(SENDER, "")
        if not bus.inflight.enter(sender):
            if d.reply is not None:
                hub._respond(d.reply, m.Reject(transfer_id="", code="busy",
                                               reason="too many requests in flight"), bus.seal,
                             headers)
            return
        self.spawn(self.counted, decoded, headers, d, sender)

    async def counted(self, decoded: m.ControlUnion, headers: dict[str, str], d: _Delivery,
                      sender: str) -> None:
        try:
            await self.handle(decoded, headers, d)
        finally:
            self.bus.inflight.leave(sender)

    async def handle(self, decoded: m.ControlUnion, headers: dict[str, str],
                     d: _Delivery) -> None:
        try:
            reply = await self.handler(decoded, headers)
        except Exception:
            self.bus._quiet.log(logging.ERROR, "handler", "control handler failed on %s",
                                d.subject, exc_info=True)
            return
        if reply is not None and d.reply is not None:
            self.bus.hub._respond(d.reply, reply, self.bus.seal, headers)

    def close(self) -> None:
        self.scope.cancel()
        self.send.close()
        self.recv.close()  # wakes publishers blocked on a full queue (their message is lost)


class MemoryHub:
    """The in-memory server of one test; its task group runs every subscription's task."""

    def __init__(self) -> None:
        self._subs: list[_Subscription] = []
        self._tg: TaskGroup | None = None
        self._rules: list[DropRule] = []
        self._inbox = itertools.count()
        self.dropped = 0
        self.kept: dict[str, list[tuple[str, m.ControlMessage]]] = {}  # persist(), by stream
        self.kept_seq = 0

    async def __aenter__(self) -> MemoryHub:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        tg, self._tg = self._tg, None
        for sub in self._subs:
            sub.close()
        self._subs.clear()
        assert tg is not None
        return await tg.__aexit__(exc_type, exc, tb)

    async def connect(self, name: str) -> MemoryBus:
        """A new connection, for an agent that takes an async factory."""
        return MemoryBus(self, name)

    def drop(self, rule: DropRule) -> Callable[[], None]:
        """Lose every message ``rule`` picks (requests then time out); call the result to stop."""
        self._rules.append(rule)
        return lambda: self._rules.remove(rule)

    async def publish_raw(self, subject: str, data: bytes,
                          headers: dict[str, str] | None = None) -> None:
        """Publish bytes as they are (a malformed payload, an old peer's message)."""
        await self._send(subject, data, headers, None)

    async def request_raw(self, subject: str, data: bytes, *, timeout: float = 1.0,
                          peer: str | None = None) -> m.ControlUnion:
        return await self._request(subject, data, timeout=timeout, headers=None, peer=peer,
                                   seal=Seal())

    def _lost(self, subject: str, msg: m.ControlMessage) -> bool:
        if any(rule(subject, msg) for rule in self._rules):
            self.dropped += 1
            return True
        return False

    def _subscribe(self, sub: _Subscription) -> None:
        if self._tg is None:
            raise ControlPlaneError("the MemoryHub is not open: use `async with MemoryHub()`")
        self._subs.append(sub)
        self._tg.start_soon(sub.run)

    def _unsubscribe(self, sub: _Subscription) -> None:
        sub.close()
        with contextlib.suppress(ValueError):
            self._subs.remove(sub)

    def _targets(self, subject: str) -> list[_Subscription]:
        """Every matching subscription, but one (at random) per queue group, as NATS does."""
        tokens = _tokens(subject, wildcards=False)
        hits = [s for s in self._subs if _matches(s.pattern, tokens)]
        groups: dict[str, list[_Subscription]] = {}
        for s in hits:
            if s.queue:
                groups.setdefault(s.queue, []).append(s)
        return [s for s in hits if not s.queue] + [random.choice(g) for g in groups.values()]

    async def _send(self, subject: str, data: bytes, headers: dict[str, str] | None,
                    reply: _Reply | None, *, lost: bool = False) -> None:
        targets = self._targets(subject)
        await anyio.lowlevel.checkpoint()
        for sub in [] if lost else targets:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await sub.send.send(_Delivery(subject, data, dict(headers or {}), reply))

    async def _request(self, subject: str, data: bytes, *, timeout: float,
                       headers: dict[str, str] | None, peer: str | None, seal: Seal,
                       lost: bool = False) -> m.ControlUnion:
        if not self._targets(subject):
            raise NoPeerError(f"no instance answers on {subject}", peer=peer, no_responders=True)
        reply = _Reply(f"_INBOX.{next(self._inbox)}", seal, peer)
        with anyio.move_on_after(timeout):
            await self._send(subject, data, headers, reply, lost=lost)
            await reply.done.wait()
        if reply.data is None:
            raise NoPeerError(f"no answer on {subject} within {timeout}s", peer=peer)
        return m.decode(reply.data)

    def _respond(self, reply: _Reply, msg: m.ControlMessage, seal: Seal,
                 asked: dict[str, str] | None = None) -> None:
        """Answer ``reply``: boxed for the checked sender of ``asked`` (the request's
        headers), signed without one."""
        if not self._lost(reply.subject, msg):
            sender = (asked or {}).get(SENDER)
            reply.respond(*seal.outgoing(reply.subject, m.encode(msg), None, to=sender,
                                         to_key=key_in(asked) if asked else None))


class MemoryBus:
    """One agent's connection to a ``MemoryHub``; a ``ControlPort`` like ``ControlBus``."""

    def __init__(self, hub: MemoryHub, name: str = "") -> None:
        self.hub = hub
        self.name = name
        self.malformed = 0
        self.seal = Seal()
        self.peer_alive: Callable[[str], bool] | None = None  # NoPeerError at once here
        self.inflight = InFlight()
        self._quiet = Throttle(log)
        self._subs: list[_Subscription] = []
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise ControlPlaneError(f"control bus {self.name!r} is closed")

    async def request(
        self, subject: str, msg: m.ControlMessage, *, timeout: float,
        headers: dict[str, str] | None = None, peer: str | None = None,
    ) -> m.ControlUnion:
        self._check()
        start = anyio.current_time()
        to_key = None
        with anyio.move_on_after(timeout) as scope:
            to_key = await key_for(self.seal, peer)
        if scope.cancelled_caught:
            raise NoPeerError(f"no answer on {subject} within {timeout}s (no key of {peer})",
                              peer=peer)
        payload, sealed = self.seal.outgoing(subject, m.encode(msg), headers, to=peer,
                                             to_key=to_key)
        left = max(0.0, timeout - (anyio.current_time() - start))
        return await self.hub._request(subject, payload, timeout=left, headers=sealed, peer=peer,
                                       seal=self.seal, lost=self.hub._lost(subject, msg))

    async def publish(
        self, subject: str, msg: m.ControlMessage, headers: dict[str, str] | None = None,
        *, peer: str | None = None,
    ) -> None:
        """Publish ``msg``: boxed for ``peer`` when its key is known, else signed."""
        self._check()
        to_key = self.seal.peer_key(peer) if peer is not None else None
        payload, sealed = self.seal.outgoing(subject, m.encode(msg), headers, to=peer,
                                             to_key=to_key)
        await self.hub._send(subject, payload, sealed, None, lost=self.hub._lost(subject, msg))

    async def serve(self, subject: str, handler: Handler,
                    spawn: Callable[..., object] | None = None, queue: str = "") -> None:
        """Subscribe ``handler``; with ``spawn`` (a task group's ``start_soon``) each message
        gets its own task, without it they are handled in order by this subscription's task.
        ``queue``: one subscriber of that queue group gets each message."""
        self._check()
        sub = _Subscription(self, subject, handler, spawn, queue)
        self.hub._subscribe(sub)
        self._subs.append(sub)

    async def persist(self, subject: str, msg: m.ControlMessage, stream: StreamSpec, *,
                      rollup: bool = False) -> int:
        """Published, and kept in the hub's ``kept[stream.name]`` (the last ``MAX_KEPT``
        of a stream's messages; ``rollup`` drops the subject's earlier ones)."""
        await self.publish(subject, msg)
        kept = self.hub.kept.setdefault(stream.name, [])
        if rollup:
            kept[:] = [(s, k) for s, k in kept if s != subject]
        kept.append((subject, msg))
        del kept[:-MAX_KEPT]
        self.hub.kept_seq += 1
        return self.hub.kept_seq

    async def flush(self, timeout: float = 2.0) -> None:
        """Subscriptions take effect at once here and publishes are queued when they
        return, so there is nothing to wait for."""
        self._check()
        await anyio.lowlevel.checkpoint()

    async def close(self) -> None:
        """Unsubscribe and stop this bus's subscription tasks; tasks already spawned run on."""
        if self._closed:
            return
        self._closed = True
        for sub in self._subs:
            self.hub._unsubscribe(sub)
        self._subs.clear()
