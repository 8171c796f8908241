"""The Agent: one NATS connection, one UCX worker, registered KV memory, transfers.

An Agent is an async context manager owning one task group; everything it
runs in the background (heartbeats, the watchdog, each transfer's stream)
lives there and ends with it. It can run inside the engine process or in a
sidecar.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import anyio
import msgspec
from opentelemetry.metrics import Observation

from kvstream import telemetry
from kvstream._exceptions import (
    ClosedError,
    ConfigError,
    DuplicateRequestError,
    InvalidBlockError,
    KVStreamError,
)
from kvstream.admission import Admission
from kvstream.config import AgentConfig
from kvstream.control import messages as m
from kvstream.control.aborts import request_abort
from kvstream.control.bus import ControlBus
from kvstream.control.nats_server import DEFAULT_NATS_URL, EmbeddedNats, is_listening
from kvstream.control.registry import Registry
from kvstream.control.subjects import Subjects
from kvstream.dataplane.memory import RegisteredKV
from kvstream.dataplane.staging import StagingPool
from kvstream.dataplane.ucx import UcxWorker
from kvstream.handles import ReceiveHandle, SendHandle
from kvstream.layout import KVLayout
from kvstream.leases import Leases, RemoteLease
from kvstream.liveness import Liveness
from kvstream.pulling import Pulling
from kvstream.pushing import Pushing
from kvstream.streams import RecvStream, SendStream, StreamEnv
from kvstream.transfer import Side, Transfer, TransferResult, TransferState

if TYPE_CHECKING:
    import torch

    from kvstream.streams import _Stream

__all__ = ["Agent", "AgentStatistics"]

log = logging.getLogger("kvstream.agent")


class AgentStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What an agent holds and has done; at rest every ``*_active`` figure is 0."""

    instance_id: str
    transfers_active: int
    reservations_active: int
    kv_registered_bytes: int
    staging_bytes_in_use: int
    staging_bytes_peak: int
    completed: int
    failed: int
    aborted: int
    timed_out: int
    bytes_sent: int
    bytes_received: int
    malformed_messages: int
    peers_alive: int
    staged_transfers: int = 0  # pushes held in staging, waiting for their reservation
    staged_dropped: int = 0  # ... that ended without one
    held_active: int = 0  # offers held for a pull (source side)
    leases_active: int = 0  # leases this agent keeps renewing (destination side)
    expired: int = 0  # offers released because nobody renewed their lease
    renewals_sent: int = 0
    bytes_skipped: int = 0  # already at the destination (incremental)


async def _shielded(close: Callable[[], Awaitable[None]], timeout: float = 5.0) -> None:
    """Run a release step even when the owner is being cancelled, bounded in time."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
        await close()



def _prepare_codec(mem: RegisteredKV) -> None:
    from kvstream.quant.codec import prepare

    try:
        prepare(mem)
    except Exception as exc:  # the first FP8 transfer reports it properly
        log.warning("preparing the codec kernel failed: %s", exc)

class Agent(Admission, Pushing, Pulling, Leases, Liveness):
    """Moves KV blocks for one engine. Use ``async with Agent(config) as agent``."""

    def __init__(self, config: AgentConfig, *, layout: KVLayout | None = None,
                 kv_caches: Sequence[torch.Tensor] | None = None) -> None:
        self.config = config
        self.subjects = Subjects(config.namespace)
        self.registry = Registry(peer_timeout_s=config.peer_timeout_s)
        self.staging = StagingPool(config.staging_bytes)
        self.memory: RegisteredKV | None = None
        if kv_caches is not None:
            if layout is None:
                raise ConfigError("kv_caches need their layout")
            self.register_kv(layout, kv_caches)
        self._layout = layout
        self._bus: ControlBus | None = None
        self._worker: UcxWorker | None = None
        self._nats: EmbeddedNats | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack = contextlib.AsyncExitStack()
        self._streams: dict[str, _Stream] = {}
        self._reservations: dict[str, ReceiveHandle] = {}
        # Pushes that arrived before their reservation: request id -> (stream, promised blocks).
        self._unclaimed: dict[str, tuple[RecvStream, list[int]]] = {}
        # Source side of pulls: offers held by request id, then their running streams.
        self._held: dict[str, SendHandle] = {}
        self._pulled: dict[str, SendStream] = {}
        # Destination side: (source, request id) -> a kept lease or the pull running for it.
        self._wanted: dict[tuple[str, str], RemoteLease | RecvStream] = {}
        self._peer_lease: dict[str, float] = {}
        self._counters = dict.fromkeys(
            ("completed", "failed", "aborted", "timed_out", "expired", "bytes_sent",
             "bytes_received", "bytes_skipped", "staged_dropped", "renewals_sent"), 0)
        self._seq = 0
        self.nats_url = ""

    # -- lifecycle -------------------------------------------------------------------
    async def __aenter__(self) -> Agent:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _start(self) -> None:
        cfg = self.config
        url = cfg.nats_url
        if url is None:
            url = DEFAULT_NATS_URL
            if not is_listening(url):
                self._nats = EmbeddedNats(port=4222).start()
                self._stack.callback(self._nats.stop)
        self.nats_url = url
        self._bus = await ControlBus.connect(url, name=f"kvstream-{cfg.instance_id}")
        self._stack.push_async_callback(_shielded, self._bus.close)
        self._worker = await UcxWorker.open(progress_mode=cfg.progress_mode,
                                            error_handling=cfg.ucx_error_handling)
        self._stack.push_async_callback(_shielded, self._worker.close)
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.push_async_callback(self._shutdown)
        await self._bus.serve(self.subjects.control(cfg.instance_id), self._on_control,
                              spawn=self._tg.start_soon)
        await self._bus.serve(self.subjects.registry_all, self._on_registry)
        await self._announce()
        await self._bus.flush()
        self._stack.callback(telemetry.observe_staging(self._staging_observation))
        self._tg.start_soon(self._heartbeat_loop)
        self._tg.start_soon(self._watchdog_loop)
        self._tg.start_soon(self._lease_loop)

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _shutdown(self) -> None:
        """Abort what is in flight (peers are told), say goodbye, stop background tasks."""
        with anyio.CancelScope(shield=True):
            for handle in list(self._reservations.values()):
                self._end_reservation(handle, TransferState.ABORTED, "agent shutting down")
            for rid in list(self._held):
                self._end_held(rid, TransferState.ABORTED, "agent shutting down")
            with anyio.move_on_after(self.config.request_timeout_s):
                async with anyio.create_task_group() as tg:
                    for lease in [w for w in self._wanted.values() if isinstance(w, RemoteLease)]:
                        tg.start_soon(lease.release, "agent shutting down")
            streams = list(self._streams.values())
            for stream in streams:
                stream.stop(TransferState.ABORTED, "agent shutting down")
            with anyio.move_on_after(self.config.request_timeout_s * 2):
                for stream in streams:
                    await stream.stopped.wait()
            if self._bus is not None:
                with contextlib.suppress(KVStreamError):
                    await self._bus.publish(self.subjects.registry(self.config.instance_id),
                                            m.Leave(instance_id=self.config.instance_id))
            if self._tg is not None:
                self._tg.cancel_scope.cancel()

    # -- memory ----------------------------------------------------------------------
    def register_kv(self, layout: KVLayout, layers: Sequence[torch.Tensor], *,
                    cache_scales: Sequence[float] | None = None) -> RegisteredKV:
        """Register the engine's per-layer KV tensors; block ids are checked against them.

        ``cache_scales``: an FP8 cache's (k_scale, v_scale) per layer (or one pair); they
        travel with its blocks and a destination with other scales refuses them.
        """
        if self.memory is not None:
            raise ConfigError("KV memory is already registered with this agent")
        self.memory = RegisteredKV(layout, layers, cache_scales=cache_scales)
        self._layout = layout
        self.staging.device = str(self.memory.device)
        if self.config.codec != "none" or set(self.config.accept_codecs) - {"none"}:
            # Build the codec kernel now, off the event loop, not under the first transfer.
            threading.Thread(target=_prepare_codec, args=(self.memory,), daemon=True,
                             name="kvstream-codec-build").start()
        return self.memory

    async def unregister_kv(self, reason: str = "KV memory unregistered") -> None:
        """Abort every transfer and reservation, then drop the memory (and staging buffers).

        Returns once nothing can write into the old memory any more.
        """
        for handle in list(self._reservations.values()):
            self._end_reservation(handle, TransferState.ABORTED, reason)
        for rid in list(self._held):
            self._end_held(rid, TransferState.ABORTED, reason)
        self._unclaimed.clear()
        streams = list(self._streams.values())
        for stream in streams:
            stream.stop(TransferState.ABORTED, reason)
        for stream in streams:
            await stream.stopped.wait()
        self.memory = None
        self.staging.clear()

    def _mem(self) -> RegisteredKV:
        if self.memory is None:
            raise ConfigError("register KV memory (Agent.register_kv) before transferring")
        return self.memory

    @property
    def instance_id(self) -> str:
        return self.config.instance_id

    @property
    def worker_address(self) -> bytes:
        if self._worker is None:
            raise ClosedError("the agent is not started (use it as an async context manager)")
        return self._worker.address

    # -- the decode side ---------------------------------------------------------------
    def expect(self, request_id: str, dst_blocks: Sequence[int], *,
               have: Iterable[int] = ()) -> ReceiveHandle:
        """Reserve ``dst_blocks`` for the KV of ``request_id``; a push may land there now.

        ``have``: prefix hashes of blocks already here; a push carrying those hashes skips
        them. Raises ``InvalidBlockError`` for ids outside registered memory. The
        reservation ends, released, when its transfer ends or after
        ``reservation_timeout_s`` without a manifest.
        """
        mem = self._mem()
        if request_id in self._reservations:
            raise DuplicateRequestError(f"request {request_id!r} already has a reservation",
                                        request_id=request_id)
        if request_id in self._unclaimed:
            stream, promised = self._unclaimed[request_id]
            blocks = mem.block_map(dst_blocks, what="destination block")
            if len(blocks) != stream.nblocks or (promised and promised != blocks.ids):
                raise InvalidBlockError(
                    f"the push staged for {request_id!r} carries {stream.nblocks} blocks per "
                    f"layer{f' for {promised}' if promised else ''}; got {blocks.ids}",
                    block_ids=blocks.ids, limit=mem.num_blocks)
            del self._unclaimed[request_id]
            stream.claim(blocks)
            return stream.handle
        self._check_capacity()
        blocks = mem.block_map(dst_blocks, what="destination block")
        transfer = Transfer(transfer_id="", request_id=request_id, side=Side.RECV, peer="",
                            num_layers=mem.layout.num_layers,
                            layer_bytes=mem.planes * mem.plane_bytes(len(blocks)))
        handle = ReceiveHandle(transfer, lambda reason: self._abort(transfer, reason),
                               blocks=blocks, have=frozenset(have))
        self._reservations[request_id] = handle
        return handle

    def _end_reservation(self, handle: ReceiveHandle, state: TransferState, reason: str) -> None:
        self._reservations.pop(handle.request_id, None)
        if handle.transfer.finish(state, reason):
            self._count(state.value, 1)

    # -- transfers ---------------------------------------------------------------------
    def _env(self) -> StreamEnv:
        assert self._worker is not None  # started; not input validation
        return StreamEnv(config=self.config, worker=self._worker, memory=self._mem(),
                         staging=self.staging, request_abort=self._request_abort,
                         publish_done=self._publish_done, count=self._count,
                         peer_alive=self.registry.alive)

    def _run_stream(self, transfer_id: str, stream: _Stream) -> None:
        self._streams[transfer_id] = stream

        async def run() -> None:
            try:
                await stream.run()
            except Exception:  # one transfer's bug must not take the agent down
                log.exception("%r ended with an unexpected error", stream.handle.transfer)
            finally:
                self._streams.pop(transfer_id, None)
                t = stream.handle.transfer
                if self._pulled.get(t.request_id) is stream:
                    del self._pulled[t.request_id]
                if self._wanted.get((stream.peer, t.request_id)) is stream:
                    del self._wanted[(stream.peer, t.request_id)]
                if self._unclaimed.get(t.request_id, (None,))[0] is stream:
                    del self._unclaimed[t.request_id]

        assert self._tg is not None
        self._tg.start_soon(run)

    async def _abort(self, transfer: Transfer, reason: str) -> None:
        if self._held.get(transfer.request_id) is not None and \
                self._held[transfer.request_id].transfer is transfer:
            self._end_held(transfer.request_id, TransferState.ABORTED, reason)
            return
        if transfer.request_id in self._reservations and not transfer.transfer_id:
            self._end_reservation(self._reservations[transfer.request_id],
                                  TransferState.ABORTED, reason)
            return
        stream = self._streams.get(transfer.transfer_id)
        if stream is not None:
            stream.stop(TransferState.ABORTED, reason)
            await stream.stopped.wait()

    async def _request_abort(self, peer: str, transfer_id: str, reason: str, *,
                             request_id: str = "") -> bool:
        return await request_abort(self._bus_(), self.subjects, peer, reason=reason,
                                   by=self.instance_id, timeout=self.config.request_timeout_s,
                                   transfer_id=transfer_id, request_id=request_id)

    async def _publish_done(self, peer: str, result: TransferResult) -> None:
        with contextlib.suppress(KVStreamError):
            await self._bus_().publish(self.subjects.control(peer), m.Done(
                transfer_id=result.transfer_id, request_id=result.request_id,
                status=result.status, reason=result.reason, bytes=result.bytes,
                layers=result.layers, bytes_skipped=result.bytes_skipped))

    async def _on_abort(self, msg: m.Abort) -> m.ControlMessage:
        stream = self._streams.get(msg.transfer_id)
        if stream is None:
            # No running transfer by that id: an offer or a lease by request id, or already
            # over here; either way nothing of ours is in flight for it after this.
            self._on_held_abort(msg)
            if not msg.transfer_id and msg.request_id in self._pulled:
                with anyio.move_on_after(self.config.request_timeout_s):
                    await self._pulled[msg.request_id].quiesced.wait()
            return m.AbortAck(transfer_id=msg.transfer_id)
        self.registry.contact(msg.by)
        stream.stop(TransferState.ABORTED, f"aborted by {msg.by}: {msg.reason}", by_peer=True)
        with anyio.move_on_after(self.config.request_timeout_s):
            await stream.quiesced.wait()
        return m.AbortAck(transfer_id=msg.transfer_id)

    # -- control plane -----------------------------------------------------------------
    def _bus_(self) -> ControlBus:
        if self._bus is None:
            raise ClosedError("the agent is not started (use it as an async context manager)")
        return self._bus

    async def _on_control(self, msg: m.ControlUnion, headers: dict[str, str]) -> m.ControlMessage | None:
        match msg:
            case m.Manifest():
                return await self._on_manifest(msg, headers)
            case m.Abort():
                return await self._on_abort(msg)
            case m.Pull():
                return await self._on_pull(msg, headers)
            case m.Renew():
                return await self._on_renew(msg)
            case m.Done():
                stream = self._streams.get(msg.transfer_id)
                if isinstance(stream, SendStream):
                    stream.on_remote_done(msg.status, msg.reason)
                return None
            case _:
                return m.Reject(transfer_id="", code="malformed",
                                reason=f"{type(msg).__name__} is not a control request")

    # -- introspection -----------------------------------------------------------------
    def _staging_observation(self) -> list[Observation]:
        return [Observation(self.staging.in_use, {"kvstream.instance": self.instance_id})]

    def _count(self, key: str, n: int) -> None:
        self._counters[key] += n

    def statistics(self) -> AgentStatistics:
        c = self._counters
        return AgentStatistics(
            instance_id=self.instance_id,
            transfers_active=len(self._streams),
            held_active=len(self._held),
            leases_active=sum(isinstance(w, RemoteLease) for w in self._wanted.values()),
            expired=c["expired"], renewals_sent=c["renewals_sent"],
            bytes_skipped=c["bytes_skipped"],
            reservations_active=len(self._reservations),
            kv_registered_bytes=self.memory.nbytes if self.memory else 0,
            staging_bytes_in_use=self.staging.in_use,
            staging_bytes_peak=self.staging.peak,
            completed=c["completed"], failed=c["failed"], aborted=c["aborted"],
            timed_out=c["timed_out"], bytes_sent=c["bytes_sent"],
            bytes_received=c["bytes_received"],
            malformed_messages=self._bus.malformed if self._bus else 0,
            peers_alive=len(self.registry.instances()),
            staged_transfers=len(self._unclaimed),
            staged_dropped=c["staged_dropped"],
        )

    def peers(self, role: str | None = None) -> list[m.Announce]:
        """Live instances from the registry (optionally of one role)."""
        return self.registry.instances(role)

