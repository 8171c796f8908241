"""What every part of the engine shares: the book, both ports, memory, the clock.

Each part (``push``, ``admission``, ``offers``, ``pull``, ``keeper``, ``liveness``)
gets one ``Core`` through its constructor and nothing else of the agent. The core
performs the book's actions and runs streams, so that every transfer is tracked by the
book from its first event to its end, and ends exactly once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from kvstream._exceptions import ClosedError, ConfigError, KVStreamError
from kvstream.control import messages as m
from kvstream.control.aborts import request_abort
from kvstream.control.identity import Identity
from kvstream.control.subjects import Subjects
from kvstream.dataplane import wire
from kvstream.dataplane.stream import Stream, StreamEnv
from kvstream.engine.book import Action, Book, Entry, Finish, LoseLease, Stop, TellKeeper
from kvstream.engine.paths import DataPaths
from kvstream.transfer.state import EndCause, TransferResult, TransferState

if TYPE_CHECKING:
    from kvstream.config import AgentConfig
    from kvstream.control.port import ControlPort
    from kvstream.control.registry import Registry
    from kvstream.dataplane.staging import StagingPool
    from kvstream.dataplane.transport import Transport
    from kvstream.memory import RegisteredKV
    from kvstream.transfer.handles import ReceiveHandle
    from kvstream.transfer.state import Transfer

__all__ = ["Core"]

log = logging.getLogger("kvstream.agent")

Spawn = Callable[..., Any]


def _prepare_codec(mem: RegisteredKV) -> None:
    from kvstream.quant.codec import prepare

    try:
        prepare(mem)
    except Exception as exc:  # the first FP8 transfer reports it properly
        log.warning("preparing the codec kernel failed: %s", exc)


def _prepare_blockcopy(transpose: bool) -> None:
    """Build the C block copy the same-host path reads with, and the transpose vLLM CPU
    blocks are reshaped with (gcc: up to a second each on a cold cache, which would
    otherwise land on the first transfer's exposed time)."""
    from kvstream.dataplane.blockcopy import load

    load()  # a failure falls back to memmove, with its own warning
    if transpose:
        from kvstream.transfer import transpose as tr

        tr.load()  # a failure falls back to torch, with its own warning


class Core:
    def __init__(self, config: AgentConfig, *, registry: Registry, staging: StagingPool,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.instance_id = config.instance_id
        self.subjects = Subjects(config.namespace)
        self.registry = registry
        self.staging = staging
        self.clock = clock
        self.book = Book(max_transfers=config.max_transfers,
                         reservation_timeout_s=config.reservation_timeout_s,
                         transfer_timeout_s=config.transfer_timeout_s, lease_s=config.lease_s)
        self.memory: RegisteredKV | None = None
        self.identity = Identity(config.instance_id)
        self.paths = DataPaths(config, registry)
        self.forgot: dict[str, int] = {}  # peer -> how often we aborted our endpoint to it
        self.requests = self.kv_used = 0  # the engine's load, as it reports it (routers)
        self.kv_epoch, self.kv_seq = "", 0  # its KV events' latest batch (kv_events.py)
        self.kv_events_state: m.KVEventsState = ""  # whether they flow, as the engine says
        self._control: ControlPort | None = None
        self._transport: Transport | None = None
        self._spawn: Spawn | None = None
        self.wake: Callable[[], None] = lambda: None  # the timer: a deadline may be sooner
        self.timer_due = -math.inf  # when the timer wakes by itself next (liveness sets it)
        self.lease_lost: Callable[[LoseLease], None] = lambda action: None  # the keeper's

    def attach(self, control: ControlPort, transport: Transport, spawn: Spawn) -> None:
        self._control, self._transport, self._spawn = control, transport, spawn
        control.seal.identity, control.seal.trust = self.identity, self.trusts
        control.seal.key_of = self.registry.key_of
        control.seal.registry_prefix = self.subjects.registry_prefix
        # Every agent announces when it starts and every heartbeat, and greets a newcomer:
        # a live peer's key is here within a heartbeat; two, and it is taken as absent.
        control.seal.key_wait_s = 2 * self.config.heartbeat_s
        control.peer_alive = self.registry.alive

    def pair_key(self, peer: str) -> bytes | None:
        """The key this agent shares with ``peer`` (data-plane MACs derive from it)."""
        key = self.identity.public_key if peer == self.instance_id else \
            self.registry.key_of(peer)
        return self.identity.pair_key(key) if key is not None else None

    def trusts(self, instance_id: str, key: bytes, announced: bool) -> bool:
        """Is ``key`` that instance's? Our own id only with our own key."""
        if instance_id == self.instance_id:
            return key == self.identity.public_key
        return self.registry.bind_key(instance_id, key, announced)

    def sweep(self) -> None:
        """Drop what waits in the data plane on no live tag (late, stray or forged)."""
        for transport in (self.transport, self.paths.tcp):
            if transport is None:
                continue
            try:
                self.count("data_discarded", transport.sweep(wire.is_live))
            except KVStreamError as exc:
                log.warning("data-plane sweep: %s", exc)

    def new_tag(self, transfer: Transfer) -> int:
        """A fresh data-plane tag prefix for ``transfer``, live until it ends."""
        tag = wire.new_xfer_tag()
        transfer.on_release(lambda: wire.release_xfer_tag(tag))
        return tag

    @property
    def started(self) -> bool:
        return self._spawn is not None

    @property
    def control(self) -> ControlPort:
        if self._control is None:
            raise ClosedError("the agent is not started (use it as an async context manager)")
        return self._control

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            raise ClosedError("the agent is not started (use it as an async context manager)")
        return self._transport

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._spawn is None:
            raise ClosedError("the agent is not started (use it as an async context manager)")
        self._spawn(fn, *args)

    def register(self, mem: RegisteredKV) -> RegisteredKV:
        if self.memory is not None:
            raise ConfigError("KV memory is already registered with this agent")
        self.config.tp.shard(mem.layout)  # LayoutError: the layout is not this TP share's
        self.memory = mem
        self.paths.register(mem)
        self.staging.device = str(mem.device)
        if self.config.codec != "none" or set(self.config.accept_codecs) - {"none"}:
            # Build the codec kernel now, off the event loop, not under the first transfer.
            threading.Thread(target=_prepare_codec, args=(mem,), daemon=True,
                             name="kvstream-codec-build").start()
        if mem.device.type == "cpu":  # a same-host peer's KV may be read with it
            threading.Thread(target=_prepare_blockcopy,
                             args=(mem.layout.arrangement == "cpu_hnbc",), daemon=True,
                             name="kvstream-blockcopy-build").start()
        return mem

    async def end_all(self, reason: str, timeout: float = math.inf) -> None:
        """Abort everything but kept leases; return once every stream has stopped."""
        streams = [e.runner for e in self.book.live if e.runner is not None]
        self.perform(self.book.end_all(reason, EndCause.SHUTDOWN))
        with anyio.move_on_after(timeout):
            for stream in streams:
                await stream.stopped.wait()

    def mem(self) -> RegisteredKV:
        if self.memory is None:
            raise ConfigError("register KV memory (Agent.register_kv) before transferring")
        return self.memory

    # -- the book's actions ------------------------------------------------------------
    def track(self, entry: Entry, handle: Any) -> None:
        """Bind ``handle``'s transfer to ``entry``: when it ends, the book learns, once."""
        entry.handle = handle
        transfer: Transfer = handle.transfer
        def ended() -> None:
            if self.book.finished(entry, transfer.state) and entry.parent is not None:
                self.perform(self.book.reader_finished(entry, transfer.state, transfer.reason,
                                                       transfer.cause))

        transfer.on_release(ended)
        self.wake_for(entry)

    def wake_for(self, entry: Entry) -> None:
        """Wake the timer if ``entry`` is due before it would wake by itself (each wake
        looks at every entry: waking per transfer would cost O(entries) each)."""
        if entry.due() < self.timer_due:
            self.wake()

    def end(self, entry: Entry, state: TransferState, reason: str,
            cause: EndCause | None = None, **kw: Any) -> None:
        self.perform(self.book.end(entry, state, reason, cause, **kw))

    def perform(self, actions: Sequence[Action]) -> None:
        for action in actions:
            match action:
                case Stop(entry=entry, state=state, reason=reason, cause=cause):
                    entry.runner.stop(state, reason, peer_dead=action.peer_dead, cause=cause,
                                      by_peer=cause is EndCause.PEER_ABORT)
                case Finish(entry=entry, state=state, reason=reason, cause=cause):
                    if entry.handle is None:
                        # A pull still negotiating: no transfer exists to count (its caller
                        # gets the error); out of the book, uncounted, like ``drop``.
                        self.book.drop(entry)
                    else:
                        if entry.children and state is TransferState.COMPLETED:
                            for layer in range(entry.handle.transfer.num_layers):
                                entry.handle.transfer.layer_done(layer)  # every reader's
                        entry.handle.transfer.finish(state, reason, cause)
                case TellKeeper():
                    self.spawn(self._tell_keeper, action)
                case LoseLease():
                    self.lease_lost(action)
                case _:  # Renew is the timer's
                    raise AssertionError(f"{action} is not the core's to perform")

    async def _tell_keeper(self, action: TellKeeper) -> None:
        with contextlib.suppress(KVStreamError):
            await self.control.publish(self.subjects.control(action.keeper), m.Abort(
                transfer_id="", request_id=action.request_id, reason=action.reason,
                by=self.instance_id), peer=action.keeper)

    # -- peers ---------------------------------------------------------------------------
    async def request_abort(self, peer: str, transfer_id: str, reason: str, *,
                            request_id: str = "", secret: str = "") -> bool:
        return await request_abort(self.control, self.subjects, peer, reason=reason,
                                   by=self.instance_id, timeout=self.config.request_timeout_s,
                                   transfer_id=transfer_id, request_id=request_id,
                                   secret=secret)

    async def publish_done(self, peer: str, result: TransferResult) -> None:
        with contextlib.suppress(KVStreamError):
            await self.control.publish(self.subjects.control(peer), m.Done(
                transfer_id=result.transfer_id, request_id=result.request_id,
                status=result.status.value,  # type: ignore[arg-type]  # terminal: a Status
                reason=result.reason, bytes=result.bytes,
                layers=result.layers, bytes_skipped=result.bytes_skipped), peer=peer)

    # -- streams ---------------------------------------------------------------------------
    def count(self, key: str, n: int) -> None:
        self.book.counts[key] = self.book.counts.get(key, 0) + n

    def env(self, path: str = "ucx") -> StreamEnv:
        """What a stream on ``path`` needs (its transport: TCP's, or the base one)."""
        transport = self.paths.transport(path, self.transport)
        return StreamEnv(config=self.config, transport=transport, memory=self.mem(),
                         staging=self.staging, request_abort=self.request_abort,
                         publish_done=self.publish_done, count=self.count,
                         peer_alive=self.registry.alive, peer_on_cpu=self.peer_on_cpu,
                         address_shared=self.registry.address_shared,
                         forget=lambda peer, address: self.forget(peer, address, transport),
                         pair_key=self.pair_key)

    def peer_on_cpu(self, peer: str) -> bool:
        """Whether ``peer`` announces its KV in host memory (not announced: assumed so)."""
        ann = self.registry.announced(peer)
        return ann is None or ann.kv_device in ("", "cpu")

    def forget(self, peer: str, address: bytes, transport: Transport | None = None) -> None:
        """Abort our endpoint to ``peer`` and say so in our announcements (``forgot``):
        the peer, if it is only slow, drops its endpoint to us in turn."""
        (transport or self.transport).forget_peer(address)
        self.forgot[peer] = self.forgot.pop(peer, 0) + 1  # most recent last
        while len(self.forgot) > m.MAX_FORGOT:
            del self.forgot[next(iter(self.forgot))]

    def run_stream(self, entry: Entry, stream: Stream, deadline_s: float | None) -> None:
        """Start ``stream`` for ``entry``; whatever happens to it, its transfer ends."""
        t = stream.transfer
        entry.runner = stream
        if t.path:
            self.count(f"path:{t.path}", 1)
        self.book.streaming(entry, t.transfer_id, self.clock(), deadline_s)
        stream.on_received = lambda: self.book.received_all(entry)
        self.wake_for(entry)

        async def run() -> None:
            try:
                await stream.run()
            except Exception:  # one transfer's bug must not take the agent down
                log.exception("%r ended with an unexpected error", t)
            finally:
                t.finish(TransferState.FAILED, "stream ended without an outcome")

        self.spawn(run)

    def complete_empty(self, t: Transfer, handle: ReceiveHandle | None = None) -> None:
        """Every block was already at the destination: done without moving a byte."""
        for layer in range(t.num_layers):
            if handle is not None:
                handle.mark_layer(layer)
            else:
                t.layer_done(layer)
        t.finish(TransferState.COMPLETED, "every block already at the destination")

    def aborter(self, entry: Entry) -> Callable[[str], Awaitable[None]]:
        """What a handle's ``abort()`` does: end its entry here, wait for its stream."""
        return lambda reason: self.stop_and_wait(entry, TransferState.ABORTED, reason,
                                                 EndCause.ENGINE_ABORT)

    async def stop_and_wait(self, entry: Entry, state: TransferState, reason: str,
                            cause: EndCause | None = None) -> None:
        """End ``entry`` and return once its stream (if any) has stopped."""
        self.end(entry, state, reason, cause)
        if entry.runner is not None:
            await entry.runner.stopped.wait()
