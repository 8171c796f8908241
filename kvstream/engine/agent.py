"""The Agent: a facade over the engine's parts, its control and data ports, its memory.

An Agent is an async context manager owning one task group; everything it runs in the
background (the timer, each transfer's stream) lives there and ends with it. It opens
NATS and UCX itself unless handed ports (``control=``, ``transport=``: an in-memory bus
and a loopback transport make it testable without either).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import anyio
from opentelemetry.metrics import Observation

from kvstream import telemetry
from kvstream._exceptions import ConfigError, KVStreamError
from kvstream.control import messages as m
from kvstream.control.identity import SENDER
from kvstream.control.registry import Registry
from kvstream.control.subjects import Subjects
from kvstream.dataplane.send import SendStream
from kvstream.dataplane.staging import StagingPool
from kvstream.engine.admission import Admission
from kvstream.engine.core import Core
from kvstream.engine.gather import Gatherer
from kvstream.engine.keeper import Keeper, RemoteLease
from kvstream.engine.kv_events import KVEventLog
from kvstream.engine.liveness import Liveness
from kvstream.engine.offers import Offers
from kvstream.engine.ports import open_control, open_tcp, open_transport
from kvstream.engine.pull import Puller
from kvstream.engine.push import Pusher
from kvstream.engine.rules import claimed_sender
from kvstream.engine.stats import AgentStatistics, snapshot
from kvstream.memory import RegisteredKV
from kvstream.transfer.state import EndCause, TransferState

if TYPE_CHECKING:
    import torch
    from opentelemetry.context import Context

    from kvstream.config import AgentConfig
    from kvstream.control.port import ControlPort
    from kvstream.dataplane.transport import Transport
    from kvstream.layout import KVLayout
    from kvstream.transfer.gathered import GatherHandle
    from kvstream.transfer.handles import ReceiveHandle, SendHandle

__all__ = ["Agent", "AgentStatistics"]

log = logging.getLogger("kvstream.agent")


def _check_topic(topic: str) -> None:
    if not isinstance(topic, str) or not re.fullmatch(r"[a-z][a-z0-9_.-]{0,63}", topic):
        raise ConfigError(f"a note's topic is [a-z][a-z0-9_.-]{{0,63}}, got {topic!r}")


class Agent:
    """Moves KV blocks for one engine. Use ``async with Agent(config) as agent``."""

    def __init__(self, config: AgentConfig, *, layout: KVLayout | None = None,
                 kv_caches: Sequence[torch.Tensor] | None = None,
                 control: ControlPort | None = None, transport: Transport | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.registry = Registry(peer_timeout_s=config.peer_timeout_s, clock=clock)
        self.staging = StagingPool(config.staging_bytes)
        self._core = core = Core(config, registry=self.registry, staging=self.staging,
                                 clock=clock)
        self.subjects = core.subjects
        self._pusher, self._admission = Pusher(core), Admission(core)
        self._offers, self._puller, self._keeper = Offers(core), Puller(core), Keeper(core)
        self._gatherer = Gatherer(core, self._puller)
        self._liveness = Liveness(core, self._keeper, layout)
        self._ports = (control, transport)
        self._notes: dict[str, Callable[[str, bytes], None]] = {}
        self._events: KVEventLog | None = None
        self._stack = contextlib.AsyncExitStack()
        self.nats_url = ""
        if kv_caches is not None:
            if layout is None:
                raise ConfigError("kv_caches need their layout")
            self.register_kv(layout, kv_caches)

    # -- lifecycle -------------------------------------------------------------------
    async def __aenter__(self) -> Agent:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _start(self) -> None:
        cfg, (control, transport) = self.config, self._ports
        if control is None:
            control, self.nats_url = await open_control(cfg, self._stack)
        if transport is None:
            mem = self._core.memory
            transport = await open_transport(
                cfg, self._stack,
                cuda_device=mem.device.index if mem is not None and mem.device.type == "cuda"
                else None)
            self._core.paths.tcp = await open_tcp(cfg, self._stack, self.nats_url)
        tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._core.attach(control, transport, tg.start_soon)
        self._stack.push_async_callback(self._shutdown, tg)
        await control.serve(self.subjects.control(cfg.instance_id), self._on_control,
                            spawn=tg.start_soon)
        await control.serve(self.subjects.registry_all, self._liveness.on_registry)
        await self._liveness.announce()
        await control.flush()
        self._stack.callback(telemetry.observe_staging(self._staging_observation))
        tg.start_soon(self._liveness.run)

    async def _shutdown(self, tg: anyio.abc.TaskGroup) -> None:
        """Abort what is in flight (peers are told), say goodbye, stop background tasks."""
        core = self._core
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.config.request_timeout_s):
                async with anyio.create_task_group() as leases:
                    for entry in list(core.book.leases.values()):
                        leases.start_soon(entry.handle.release, "agent shutting down")
            await core.end_all("agent shutting down", self.config.request_timeout_s * 2)
            core.paths.close()
            with contextlib.suppress(KVStreamError):
                await core.control.publish(self.subjects.registry(self.instance_id),
                                           m.Leave(instance_id=self.instance_id))
            tg.cancel_scope.cancel()

    # -- memory ----------------------------------------------------------------------
    def register_kv(self, layout: KVLayout, layers: Sequence[torch.Tensor], *,
                    cache_scales: Sequence[float] | None = None) -> RegisteredKV:
        """Register the engine's per-layer KV tensors; block ids are checked against them.

        ``cache_scales``: an FP8 cache's (k_scale, v_scale) per layer (or one pair); they
        travel with its blocks and a destination with other scales refuses them.
        """
        self._liveness.layout = layout
        mem = self._core.register(RegisteredKV(layout, layers, cache_scales=cache_scales))
        if self._core.started:
            self._core.spawn(self._liveness.announce_soon)  # peers learn what they may map
        return mem

    async def unregister_kv(self, reason: str = "KV memory unregistered") -> None:
        """Abort every transfer and reservation, then drop the memory (and staging buffers).

        Returns once nothing can write into the old memory any more."""
        await self._core.end_all(reason)
        self._core.memory = None
        self._core.paths.unregister()
        self.staging.clear()
        await self._liveness.announce_soon()

    @property
    def memory(self) -> RegisteredKV | None:
        return self._core.memory

    @property
    def instance_id(self) -> str:
        return self.config.instance_id

    @property
    def worker_address(self) -> bytes:
        return self._core.transport.address

    # -- the public calls: kvstream.client_api.TransferClient documents them; the Agent's
    # take the same arguments (a test checks), and expect/offer do no I/O, so are plain.
    def expect(self, request_id: str, blocks: Sequence[int], *, src: str,
               have: Iterable[int] = ()) -> ReceiveHandle:
        return self._admission.expect(request_id, blocks, have=have, src=src)

    async def push(self, request_id: str, dst: str, src_blocks: Sequence[int], *,
                   dst_blocks: Sequence[int] | None = None, mode: str = "pipelined",
                   block_hashes: Sequence[int] | None = None, codec: str | None = None,
                   timeout: float | None = None, trace_context: Context | None = None,
                   tokens: int | None = None) -> SendHandle:
        """``tokens``: how many tokens the blocks hold (the last may be partial), needed
        only when the destination's block size differs (default: what both ends hold)."""
        return await self._pusher.push(
            request_id, dst, src_blocks, dst_blocks=dst_blocks, mode=mode,
            timeout=timeout, block_hashes=block_hashes, codec=codec, trace_context=trace_context,
            tokens=tokens)

    def offer(self, request_id: str, src_blocks: Sequence[int], *,
              block_hashes: Sequence[int] | None = None, mode: str = "pipelined",
              lease_s: float | None = None, secret: str | None = None,
              readers: int | None = None) -> SendHandle:
        return self._offers.offer(request_id, src_blocks, block_hashes=block_hashes,
                                  mode=mode, lease_s=lease_s, secret=secret, readers=readers)

    async def pull(self, request_id: str, src: str | Sequence[str], dst_blocks: Sequence[int],
                   *, mode: str = "eager", have: Iterable[int] = (), lookahead: int = 1,
                   codec: str | None = None, timeout: float | None = None,
                   trace_context: Context | None = None, secret: str | Sequence[str] = "",
                   tokens: int | None = None, readers: int = 1) -> ReceiveHandle | GatherHandle:
        """``tokens``: how many tokens the blocks are to hold, needed only when the
        source's block size differs (default: all they hold; the source may send fewer,
        what its offer holds). ``src`` a list: gather this rank's heads from several
        sources (prefill TP > decode TP) as one request, each sending the heads it holds;
        then ``secret`` may be a list, each source's offer secret in order. ``readers``:
        how many destinations pull this one offer, each its own heads (decode TP above
        prefill TP: the decode ranks sharing the source rank); all must say the same."""
        if not isinstance(src, str):
            if readers != 1:
                raise ConfigError("readers= is for one source's shared offer; a gather's "
                                  "sources are each pulled by this rank alone")
            return await self._gatherer.gather(
                request_id, list(src), dst_blocks, mode=mode, lookahead=lookahead, codec=codec,
                timeout=timeout, trace_context=trace_context, secret=secret, tokens=tokens,
                have=list(have))
        if not isinstance(secret, str):
            raise ConfigError("one source, one secret: a list of secrets is for a gather")
        return await self._puller.pull(
            request_id, src, dst_blocks, mode=mode, have=have, lookahead=lookahead,
            timeout=timeout, codec=codec, trace_context=trace_context, secret=secret,
            tokens=tokens, readers=readers)

    async def keep(self, request_id: str, src_instance: str, secret: str = "") -> RemoteLease:
        return await self._keeper.keep(request_id, src_instance, secret)

    async def release(self, request_id: str, src_instance: str,
                      reason: str = "the destination no longer wants it",
                      secret: str = "") -> bool:
        return await self._keeper.release(request_id, src_instance, reason, secret)

    # -- KV events and load, for routers (issue 20) ----------------------------------------
    def kv_events(self, block_size: int | None = None) -> KVEventLog:
        """This instance's KV event log (``stored``, ``removed``, ``cleared``: what its
        prefix cache did, by ``kvstream.prefix`` hashes), published for routers; made and
        started on the first call, at ``block_size`` (default: the registered layout's)."""
        if self._events is None:
            mem = self._core.memory
            size = block_size or (mem.layout.block_size if mem is not None else 0)
            if not size:
                raise ConfigError("kv_events needs a block_size (no KV is registered)")
            self._events = KVEventLog(self._core, size)
            self._core.spawn(self._events.run)
        elif block_size not in (None, self._events.block_size):
            raise ConfigError(f"the KV event log's block size is {self._events.block_size}")
        return self._events

    def report_load(self, *, requests: int, kv_used: int = 0) -> None:
        """The engine's load as routers weigh it: requests it serves, KV blocks in use
        (sent with the next heartbeat)."""
        if requests < 0 or kv_used < 0:
            raise ConfigError("a load is not negative")
        self._core.requests, self._core.kv_used = int(requests), int(kv_used)

    def report_kv_events(self, state: m.KVEventsState) -> None:
        """Whether the engine's KV events reach ``kv_events()`` (sent with the next
        heartbeat, shown by routers and the proxy): "ok", "waiting" (nothing stored yet),
        "missing" (blocks were stored and no event followed), "off" (none published)."""
        if state not in ("", "ok", "waiting", "missing", "off"):
            raise ConfigError(f"unknown KV events state {state!r}")
        self._core.kv_events_state = state

    # -- adapters' notes ------------------------------------------------------------------
    def on_note(self, topic: str, handler: Callable[[str, bytes], None] | None) -> None:
        """Call ``handler(sender, body)`` on the agent's loop for every ``Note`` of ``topic``
        (the sender's signature checked; the body is the handler's to validate, and it
        must not block). None removes it; notes of a topic nobody handles are dropped."""
        _check_topic(topic)
        if handler is None:
            self._notes.pop(topic, None)
        else:
            self._notes[topic] = handler

    async def note(self, peer: str, topic: str, body: bytes) -> None:
        """Send ``body`` (at most ``MAX_NOTE`` bytes) to ``peer``'s handler of ``topic``,
        boxed for it, at most once (nobody listening: it is lost; ``NatsConnectError`` if the
        control plane is down)."""
        Subjects.check_instance_id(peer)
        _check_topic(topic)
        if not isinstance(body, bytes) or len(body) > m.MAX_NOTE:
            raise ConfigError(f"a note's body is bytes, at most {m.MAX_NOTE}")
        core = self._core
        await core.control.publish(core.subjects.control(peer), m.Note(topic=topic, body=body),
                                   peer=peer)

    def _on_note(self, msg: m.Note, sender: str) -> None:
        handler = self._notes.get(msg.topic)
        if handler is None or not sender:
            self._core.count("notes_dropped", 1)
            return
        try:
            handler(sender, msg.body)
        except Exception:  # an adapter's bug must not take the agent down
            log.exception("the handler of note %r from %s failed", msg.topic, sender)

    # -- control plane -----------------------------------------------------------------
    async def _on_control(self, msg: m.ControlUnion, headers: dict[str, str]
                          ) -> m.ControlMessage | None:
        # The bus checked the signature; a request must also come from whom it names.
        sender = headers.get(SENDER, "")
        if claimed_sender(msg) not in (None, sender):
            return self._forbidden(msg, sender, f"it names {claimed_sender(msg)} as sender")
        match msg:
            case m.Manifest():
                return await self._admission.on_manifest(msg, headers)
            case m.Abort():
                return await self._on_abort(msg)
            case m.Pull():
                return await self._offers.on_pull(msg, headers)
            case m.Renew():
                return self._offers.on_renew(msg)
            case m.Note():
                self._on_note(msg, sender)
                return None
            case m.KVResync():
                if self._events is not None and msg.instance_id == self._core.instance_id:
                    self._events.resync(f"{sender}: {msg.reason[:200]}")
                return None
            case m.Done():
                entry = self._core.book.lookup(msg.transfer_id)
                if entry is not None and entry.peer != sender:
                    return self._forbidden(msg, sender, f"the transfer's peer is {entry.peer}")
                if entry is not None and isinstance(entry.runner, SendStream):
                    entry.runner.on_remote_done(msg.status, msg.reason)
                return None
            case _:
                return m.Reject(transfer_id="", code="malformed",
                                reason=f"{type(msg).__name__} is not a control request")

    def _forbidden(self, msg: m.ControlUnion, sender: str, why: str) -> m.Reject:
        self._core.count("forbidden", 1)
        log.warning("refused %s from %s: %s", type(msg).__name__, sender or "?", why)
        return m.Reject(transfer_id=getattr(msg, "transfer_id", ""), code="forbidden",
                        reason=f"{type(msg).__name__} refused: {why}")

    async def _on_abort(self, msg: m.Abort) -> m.ControlMessage:
        core = self._core
        entry = core.book.lookup(msg.transfer_id) if msg.transfer_id else None
        if entry is not None and entry.peer != msg.by:  # msg.by is the checked sender
            return self._forbidden(msg, msg.by, f"the transfer's peer is {entry.peer}")
        if entry is None:
            # No running transfer by that id: an offer or a lease by request id, or already
            # over here; either way nothing of ours is in flight for it after this.
            served = core.book.offers.get(msg.request_id)
            acted = self._offers.on_abort(msg)
            self._keeper.on_abort(msg)
            if acted and served is not None and not msg.transfer_id:
                runners = [e.runner for e in [served, *served.children] if e.runner is not None]
                with anyio.move_on_after(self.config.request_timeout_s):
                    for runner in runners:
                        await runner.quiesced.wait()
            return m.AbortAck(transfer_id=msg.transfer_id)
        core.registry.contact(msg.by)
        core.end(entry, TransferState.ABORTED, f"aborted by {msg.by}: {msg.reason}",
                 EndCause.PEER_ABORT)
        if entry.runner is not None:
            with anyio.move_on_after(self.config.request_timeout_s):
                await entry.runner.quiesced.wait()
        return m.AbortAck(transfer_id=msg.transfer_id)

    # -- introspection -----------------------------------------------------------------
    def _staging_observation(self) -> list[Observation]:
        return [Observation(self.staging.in_use, {"kvstream.instance": self.instance_id})]

    def statistics(self) -> AgentStatistics:
        control = self._core._control
        if control is None:
            return snapshot(self._core, 0)
        return snapshot(self._core, control.malformed, control.seal.forged)

    def peers(self, role: str | None = None) -> list[m.Announce]:
        """Live instances from the registry (optionally of one role)."""
        return self.registry.instances(role)

