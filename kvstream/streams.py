"""The two halves of a push transfer on the data plane: SendStream and RecvStream.

Flow per layer L (receiver-driven, so every send meets a posted receive):

    D: post header + part receives for L (into engine blocks or staging)
    D -> P: credit "layers < L+1 may come"               (8-byte tagged message)
    P: wait until L is ready (pipelined) or all are (eager), and credited
    P: gather L's blocks (or use them in place), send header, send parts
    D: check header, scatter out of staging, mark L landed

With a codec (``Transfer.codec`` != "none") the gather is gather + quantize and the
scatter dequantize + scatter (``quant.codec.LayerCodec``), both on the copy threads, so
encoding layer L+1 overlaps sending L and decoding L overlaps receiving L+1.

Ending rules (docs/architecture.md, "ending a transfer"): the receiver never
releases a buffer with a receive still posted on it. A receive is completed by
data, or drained with a zero-byte self-send, and draining happens only once the
sender has promised to send nothing more (its AbortAck) or is gone (endpoint
aborted). A sender acks an abort only after its in-flight sends completed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import numpy as np

from kvstream import telemetry
from kvstream._exceptions import KVStreamError, ProtocolError
from kvstream.dataplane import wire
from kvstream.dataplane.memory import run_copy
from kvstream.handles import ReceiveHandle, SendHandle
from kvstream.quant.codec import make_codec
from kvstream.quant.scheme import wire_layer_bytes
from kvstream.transfer import TransferState

if TYPE_CHECKING:
    import torch
    from opentelemetry.trace import Span

    from kvstream.config import AgentConfig
    from kvstream.dataplane.memory import BlockMap, RegisteredKV
    from kvstream.dataplane.staging import StagingPool
    from kvstream.dataplane.ucx import PostedRecv, UcxWorker

__all__ = ["RecvStream", "SendStream", "StreamEnv", "single_message_for"]

log = logging.getLogger("kvstream.transfer")


@dataclass
class StreamEnv:
    """What a stream needs from its agent."""

    config: AgentConfig
    worker: UcxWorker
    memory: RegisteredKV
    staging: StagingPool
    # Ask the peer to abort; True if it acknowledged (nothing of ours is in flight there).
    request_abort: Callable[[str, str, str], Awaitable[bool]]
    publish_done: Callable[[str, Any], Awaitable[None]]
    count: Callable[[str, int], None]
    peer_alive: Callable[[str], bool]


def single_message_for(memory: RegisteredKV, src_contiguous: bool, dst_contiguous: bool,
                       codec: str = "none") -> bool:
    """Framing both sides derive alike: when both ends gather/scatter anyway, a layer travels
    as one message ``[header | payload]`` out of one staging buffer into another (one
    rendezvous instead of one per plane plus a header); otherwise as a header message plus
    one message per plane, so a contiguous end moves its blocks in place. A codec always
    stages on both ends and sends a header plus one part (scales, then codes), whatever
    each end's device, so a CPU end and a GPU end frame alike."""
    if codec != "none":
        return False
    return not src_contiguous and not dst_contiguous and memory.device.type == "cpu"


class _Stream:
    def __init__(self, env: StreamEnv, peer: str, peer_address: bytes) -> None:
        self.env = env
        self.peer = peer
        self.peer_address = peer_address
        self._outcome: tuple[TransferState, str] | None = None
        self._peer_initiated = False
        self._peer_dead = False
        self._loop_scope = anyio.CancelScope()
        self._io_scope = anyio.CancelScope()
        self.stopped = anyio.Event()
        # Set once nothing of ours is in flight toward the peer (what an AbortAck promises).
        self.quiesced = anyio.Event()

    def stop(self, state: TransferState, reason: str, *, by_peer: bool = False,
             peer_dead: bool = False) -> None:
        """Begin ending the transfer; the first outcome reported wins."""
        if self._outcome is None:
            self._outcome = (state, reason)
            self._peer_initiated = by_peer
        if peer_dead and not self._peer_dead:
            self._peer_dead = True
            # The endpoint is shared by every transfer with that peer: abort it only when
            # the peer is really gone, not merely slow to acknowledge one abort.
            if not self.env.peer_alive(self.peer):
                self.env.worker.forget_peer(self.peer_address)
            self._io_scope.cancel()
        self._loop_scope.cancel()

    async def _tell_peer(self, state: TransferState, reason: str) -> None:
        """Unless the peer started the ending or is gone, get its promise to send nothing more."""
        if self._peer_initiated or self._peer_dead:
            return
        t = self.handle.transfer  # type: ignore[attr-defined]
        if not await self.env.request_abort(self.peer, t.transfer_id, reason):
            self.stop(state, reason, peer_dead=True)


class SendStream(_Stream):
    def __init__(self, env: StreamEnv, handle: SendHandle, *, peer_address: bytes,
                 src_tag: int, dst_tag: int, dst_contiguous: bool) -> None:
        super().__init__(env, handle.transfer.peer, peer_address)
        self.handle = handle
        self.src_tag = src_tag
        self.dst_tag = dst_tag
        t = handle.transfer
        self.codec = make_codec(env.memory, t.codec)
        self.layer_bytes = wire_layer_bytes(env.memory.layout, t.codec, len(handle.blocks))
        self.single = single_message_for(env.memory, handle.blocks.contiguous_start is not None,
                                         dst_contiguous, t.codec)
        self.granted = 0
        self._credit_changed = anyio.Event()
        self._credit_recv: PostedRecv | None = None
        self.remote_done = anyio.Event()
        self.remote_status: tuple[str, str] = ("", "")

    def on_remote_done(self, status: str, reason: str) -> None:
        self.remote_status = (status, reason)
        self.remote_done.set()

    async def _credit_loop(self) -> None:
        buf = np.zeros(8, dtype=np.uint8)
        tag = wire.make_tag(self.src_tag, 0, wire.KIND_CREDIT)
        n = self.handle.transfer.num_layers
        while self.granted < n:
            self._credit_recv = self.env.worker.post_recv(buf, tag)
            try:
                await self._credit_recv.wait()
            except KVStreamError as exc:  # a task error must end this transfer, not the agent
                self.stop(TransferState.FAILED, f"credit receive: {exc}")
                return
            self._credit_recv = None
            if self._outcome is not None:
                return
            self.granted = max(self.granted, wire.decode_credit(buf.data))
            self._credit_changed.set()
            self._credit_changed = anyio.Event()

    async def _send_layer(self, layer: int, parts: list[torch.Tensor], slot: torch.Tensor | None,
                          limiter: anyio.Semaphore, span: Span | None = None) -> None:
        env, t = self.env, self.handle.transfer
        try:
            nbytes = self.layer_bytes
            header = wire.LayerHeader(self.dst_tag, layer, nbytes, len(parts), codec=t.codec,
                                      traceparent=telemetry.traceparent_of(span))
            if self.single:
                assert slot is not None  # single framing always stages
                wire.encode_header(header, slot[:wire.HEADER_CAPACITY].numpy().data)
                messages = [(slot, wire.KIND_DATA)]
            else:
                hdr = np.zeros(wire.HEADER_CAPACITY, dtype=np.uint8)
                used = wire.encode_header(header, hdr.data)
                messages = [(hdr[:used], wire.KIND_HEADER)]
                messages += [(part, wire.KIND_DATA + i) for i, part in enumerate(parts)]
            for buf, kind in messages:
                if self._outcome is not None:
                    return  # stopped: send nothing more (what our AbortAck promises)
                await env.worker.send(self.peer_address, buf,
                                      wire.make_tag(self.dst_tag, layer, kind))
            t.layer_done(layer)
            env.count("bytes_sent", nbytes)
        except KVStreamError as exc:  # a task error must end this transfer, not the agent
            self.stop(TransferState.FAILED, f"layer {layer}: {exc}")
        finally:
            if slot is not None:
                env.staging.release(slot)
            limiter.release()
            telemetry.end_layer(span, t.layers_done[layer])

    async def _stream(self, sends: anyio.abc.TaskGroup) -> None:
        try:
            await self._stream_layers(sends)
        except KVStreamError as exc:
            # Stop here, but let sends already in flight complete (the peer's receives
            # are posted for them), so no buffer is released under UCX.
            self.stop(TransferState.FAILED, str(exc))

    async def _stream_layers(self, sends: anyio.abc.TaskGroup) -> None:
        env, h, t = self.env, self.handle, self.handle.transfer
        mem, blocks = env.memory, h.blocks
        limiter = anyio.Semaphore(env.config.max_inflight_layers)
        direct = blocks.contiguous_start is not None and self.codec is None
        prefix = wire.HEADER_CAPACITY if self.single else 0
        for layer in range(t.num_layers):
            await h.until_sendable(layer)
            while self.granted <= layer:
                await self._credit_changed.wait()
            await limiter.acquire()
            slot = None
            span = telemetry.layer_span(t, "kvstream.layer.send", layer, bytes=self.layer_bytes,
                                        blocks=len(blocks), codec=t.codec)
            try:
                if direct:
                    parts = [mem.direct_run(layer, p, blocks) for p in range(mem.planes)]
                else:
                    slot = await env.staging.acquire(prefix + self.layer_bytes,
                                                     timeout=env.config.transfer_timeout_s)
                    if self.codec is not None:
                        await run_copy(self.codec.encode, layer, blocks, slot[prefix:])
                        parts = [slot[prefix:]]
                    else:
                        view = mem.staging_view(slot[prefix:], len(blocks))
                        await run_copy(mem.gather, layer, blocks, view)
                        parts = [view[p] for p in range(mem.planes)]
            except BaseException:
                if slot is not None:
                    env.staging.release(slot)
                limiter.release()
                telemetry.end_layer(span, False)
                raise
            sends.start_soon(self._send_layer, layer, parts, slot, limiter, span)

    async def run(self) -> None:
        _env, t = self.env, self.handle.transfer
        t.streaming()
        try:
            with self._io_scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._credit_loop)
                    async with anyio.create_task_group() as sends:
                        with self._loop_scope:
                            await self._stream(sends)
                    self.quiesced.set()
                    if self._outcome is None:
                        # A fresh scope: stop() cancels whichever loop scope is current.
                        self._loop_scope = anyio.CancelScope()
                        with self._loop_scope:
                            await self.remote_done.wait()
                            status, reason = self.remote_status
                            self._outcome = (TransferState(status), reason)
                            self._peer_initiated = True
                    tg.cancel_scope.cancel()  # the credit loop, if credits are still owed
        except KVStreamError as exc:
            self.stop(TransferState.FAILED, str(exc))
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish()

    async def _finish(self) -> None:
        env, t = self.env, self.handle.transfer
        log.debug("%r: finishing with %s", t, self._outcome)
        state, reason = self._outcome or (TransferState.FAILED, "stream ended without an outcome")
        if state is not TransferState.COMPLETED:
            await self._tell_peer(state, reason)
        if self._credit_recv is not None and not self._credit_recv.completed:
            try:
                await env.worker.drain(self._credit_recv.tag)
            except KVStreamError as exc:
                log.warning("%r: %s", t, exc)
        if t.finish(state, reason):
            env.count(state.value, 1)
        self.quiesced.set()
        self.stopped.set()


class RecvStream(_Stream):
    """Receive half. Lands layers in the reserved blocks, or, for a push that arrived before
    the reservation (``staged_slots``), keeps them in staging until ``claim``."""

    def __init__(self, env: StreamEnv, handle: ReceiveHandle, *, peer_address: bytes,
                 src_tag: int, dst_tag: int, src_contiguous: bool, nblocks: int,
                 staged_slots: dict[int, torch.Tensor] | None = None) -> None:
        super().__init__(env, handle.transfer.peer, peer_address)
        self.handle = handle
        self.src_tag = src_tag
        self.dst_tag = dst_tag
        self.nblocks = nblocks
        t = handle.transfer
        self.codec = make_codec(env.memory, t.codec)
        self.layer_bytes = wire_layer_bytes(env.memory.layout, t.codec, nblocks)
        dst_run = handle.blocks is not None and handle.blocks.contiguous_start is not None
        self.single = single_message_for(env.memory, src_contiguous, dst_run, t.codec)
        self._posted: dict[int, list[PostedRecv]] = {}
        self._posted_ns: dict[int, int] = {}  # when each layer's receive was posted (traces)
        self._slots: dict[int, torch.Tensor] = dict(staged_slots or {})
        self.prestaged = staged_slots is not None
        self._staged: set[int] = set()  # layers received into staging, not yet in blocks
        self.received = 0
        self._done_sent = False
        self._lands: anyio.abc.TaskGroup | None = None
        self._released = False
        self.quiesced.set()  # the receiver sends no data; only credits

    @property
    def all_received(self) -> bool:
        return self.received == self.handle.transfer.num_layers

    def _post_layer(self, layer: int, slot: torch.Tensor | None) -> Any:
        """Post this layer's receives now; returns the buffer its header will land in."""
        mem, blocks, worker = self.env.memory, self.handle.blocks, self.env.worker
        self._posted_ns[layer] = time.time_ns()
        if self.single:
            assert slot is not None  # single framing always stages
            self._posted[layer] = [worker.post_recv(slot, wire.make_tag(self.dst_tag, layer,
                                                                        wire.KIND_DATA))]
            return slot[:wire.HEADER_CAPACITY].numpy()
        hdr = np.zeros(wire.HEADER_CAPACITY, dtype=np.uint8)
        if slot is None:
            assert blocks is not None  # only a reserved, contiguous destination is direct
            targets = [mem.direct_run(layer, p, blocks) for p in range(mem.planes)]
        elif self.codec is not None:
            targets = [slot]
        else:
            view = mem.staging_view(slot, self.nblocks)
            targets = [view[p] for p in range(mem.planes)]
        posted = [worker.post_recv(hdr, wire.make_tag(self.dst_tag, layer, wire.KIND_HEADER))]
        posted += [worker.post_recv(tgt, wire.make_tag(self.dst_tag, layer, wire.KIND_DATA + p))
                   for p, tgt in enumerate(targets)]
        self._posted[layer] = posted
        return hdr

    async def _scatter(self, layer: int) -> None:
        """Staging -> the reserved blocks, then the layer counts as landed."""
        env, h = self.env, self.handle
        assert h.blocks is not None
        slot = self._slots.get(layer)
        if slot is not None:
            prefix = wire.HEADER_CAPACITY if self.single else 0
            if self.codec is not None:
                await run_copy(self.codec.decode, layer, h.blocks, slot[prefix:])
            else:
                view = env.memory.staging_view(slot[prefix:], self.nblocks)
                await run_copy(env.memory.scatter, layer, h.blocks, view)
            env.staging.release(self._slots.pop(layer))
        h.mark_layer(layer)
        if h.transfer.all_layers_done:
            self._outcome = self._outcome or (TransferState.COMPLETED, "")
            self._loop_scope.cancel()

    async def _land_layer(self, layer: int, hdr: np.ndarray, limiter: anyio.Semaphore) -> None:
        env, h = self.env, self.handle
        span: Span | None = None
        try:
            for req in self._posted[layer]:
                await req.wait()
            if self._outcome is not None:
                return
            header = wire.decode_header(hdr.data)
            want = self.layer_bytes
            if (header.xfer_tag, header.layer, header.nbytes, header.codec) != \
                    (self.dst_tag, layer, want, h.transfer.codec):
                raise ProtocolError(
                    f"layer {layer}: header says tag {header.xfer_tag:#x} layer {header.layer} "
                    f"{header.nbytes} bytes codec {header.codec}; expected {self.dst_tag:#x}, "
                    f"{layer}, {want}, {h.transfer.codec}")
            del self._posted[layer]
            span = telemetry.layer_span(
                h.transfer, "kvstream.layer.receive", layer, start_ns=self._posted_ns.get(layer),
                links=telemetry.link_from(header.traceparent), bytes=want,
                blocks=self.nblocks, codec=h.transfer.codec)
            if span is not None:
                span.add_event("arrived")
            env.count("bytes_received", want)
            self.received += 1
            if h.blocks is None:
                self._staged.add(layer)  # no reservation yet: it waits in staging
            else:
                await self._scatter(layer)
            if self.all_received and not self._done_sent:
                # The sender may release its blocks now, claimed or not.
                self._done_sent = True
                await env.publish_done(self.peer, msgspec.structs.replace(
                    h.transfer.result(), status=TransferState.COMPLETED.value))
        except Exception as exc:  # torch or UCX trouble ends this transfer, not the agent
            self.stop(TransferState.FAILED, f"layer {layer}: {exc}")
        finally:
            posted = self._posted.get(layer)
            # A slot with a receive still posted on it is released after the drain; a staged
            # layer's slot when it is claimed or dropped.
            if (posted is None or all(r.completed for r in posted)) and layer not in self._staged:
                slot = self._slots.pop(layer, None)
                if slot is not None:
                    env.staging.release(slot)
            limiter.release()
            telemetry.end_layer(span, h.transfer.layers_done[layer] or layer in self._staged)

    def claim(self, blocks: BlockMap) -> None:
        """The engine reserved blocks for a push already (partly) staged: move it in."""
        self.handle.blocks = blocks
        staged, self._staged = sorted(self._staged), set()
        if self._lands is not None:
            self._lands.start_soon(self._land_staged, staged)

    async def _land_staged(self, layers: list[int]) -> None:
        try:
            for layer in layers:
                if self._outcome is not None and self._outcome[0] is not TransferState.COMPLETED:
                    return
                await self._scatter(layer)
        except Exception as exc:
            self.stop(TransferState.FAILED, f"moving staged layers in: {exc}")

    async def _stream(self, lands: anyio.abc.TaskGroup) -> None:
        env, h, t = self.env, self.handle, self.handle.transfer
        self._lands = lands
        direct = not self.prestaged and h.blocks is not None and \
            h.blocks.contiguous_start is not None and self.codec is None
        window = t.num_layers if direct or self.prestaged else env.config.max_inflight_layers
        limiter = anyio.Semaphore(window)
        credit_tag = wire.make_tag(self.src_tag, 0, wire.KIND_CREDIT)
        nbytes = self.layer_bytes
        if self.single:
            nbytes += wire.HEADER_CAPACITY
        credited = 0

        async def flush_credit(upto: int) -> None:
            nonlocal credited
            if upto > credited:
                # One cumulative credit for every layer posted so far.
                await env.worker.send(self.peer_address, wire.encode_credit(upto), credit_tag)
                credited = upto

        for layer in range(t.num_layers):
            if h.requested <= layer:  # lazy: post (and credit) a layer once it is asked for
                await flush_credit(layer)
                await h.until_requested(layer)
            try:
                limiter.acquire_nowait()
            except anyio.WouldBlock:
                await flush_credit(layer)
                await limiter.acquire()
            slot = self._slots.get(layer)
            if slot is None and not direct:
                try:
                    slot = await env.staging.acquire(nbytes, timeout=env.config.transfer_timeout_s)
                except BaseException:
                    limiter.release()
                    raise
                self._slots[layer] = slot
            hdr = self._post_layer(layer, slot)
            lands.start_soon(self._land_layer, layer, hdr, limiter)
        await flush_credit(t.num_layers)
        await anyio.sleep_forever()  # until the last layer lands (or the transfer stops)

    async def run(self) -> None:
        t = self.handle.transfer
        t.streaming()
        try:
            async with anyio.create_task_group() as lands:
                with self._loop_scope:
                    try:
                        await self._stream(lands)
                    except KVStreamError as exc:
                        self.stop(TransferState.FAILED, str(exc))
                # Landing tasks still wait on posted receives unless the transfer completed.
                if self._posted:
                    await self._release_posted()
                    if self._stuck():
                        lands.cancel_scope.cancel()  # bounded: _finish quarantines their slots
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish()

    def _stuck(self) -> bool:
        return any(not r.completed for posted in self._posted.values() for r in posted)

    async def _release_posted(self) -> None:
        """Make sure no receive stays posted: ask the sender to stop, then drain."""
        if self._released:
            return
        self._released = True
        env, t = self.env, self.handle.transfer
        state, reason = self._outcome or (TransferState.FAILED, "receive stopped")
        await self._tell_peer(state, reason)
        pending = [req for posted in self._posted.values() for req in posted if not req.completed]
        for req in pending:
            try:
                await env.worker.drain(req.tag)
            except KVStreamError as exc:
                log.warning("%r: %s", t, exc)
        with anyio.move_on_after(env.config.request_timeout_s):
            for req in pending:
                with contextlib.suppress(KVStreamError):
                    await req.wait()

    async def _finish(self) -> None:
        env, t = self.env, self.handle.transfer
        if self._posted:
            # Reached when cancellation skipped the orderly path in run().
            await self._release_posted()
        for layer, slot in self._slots.items():
            posted = self._posted.get(layer, [])
            if all(r.completed for r in posted):
                env.staging.release(slot)
            else:
                # A receive we could not drain may still write here: never reuse this buffer.
                log.warning("%r: layer %d's buffer quarantined (receive still posted)", t, layer)
                env.staging.quarantine(slot)
        self._slots.clear()
        self._staged.clear()
        state, reason = self._outcome or (TransferState.FAILED, "stream ended without an outcome")
        if t.finish(state, reason):
            env.count(state.value, 1)
            if state is TransferState.COMPLETED and not self._done_sent:
                await env.publish_done(self.peer, t.result())
        self.quiesced.set()
        self.stopped.set()
