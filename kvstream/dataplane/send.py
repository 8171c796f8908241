"""The send half of a transfer on the data plane: credits in, layers out.

With a codec (``Transfer.codec`` != "none") the gather is gather + quantize
(``quant.codec.LayerCodec``) on the copy threads, so encoding layer L+1 overlaps
sending L. The flow and ending rules are in ``dataplane.stream``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from kvstream import telemetry
from kvstream._exceptions import KVStreamError
from kvstream.dataplane import wire
from kvstream.dataplane.reshape import layer_bytes_of, single_for, transfer_codec
from kvstream.dataplane.stream import Stream, StreamEnv, frame_regions, frames_of
from kvstream.transfer.state import TransferState

if TYPE_CHECKING:
    import torch
    from opentelemetry.trace import Span

    from kvstream.dataplane.transport import PostedReceive
    from kvstream.transfer.handles import SendHandle

__all__ = ["SendStream"]

log = logging.getLogger("kvstream.transfer")


class SendStream(Stream):
    io_cancel_is_safe = False
    def __init__(self, env: StreamEnv, handle: SendHandle, *, peer_address: bytes,
                 src_tag: int, dst_tag: int, dst_contiguous: bool, mapped: bool = False,
                 path: str = "ucx") -> None:
        super().__init__(env, handle.transfer, peer_address)
        # Same host, one copy: the destination reads each layer out of our memory once
        # told it is ready (a header, no payload); our blocks stay put until its Done.
        self.mapped = mapped
        self.handle = handle
        self.src_tag = src_tag
        self.dst_tag = dst_tag
        self.mac = self._frame_mac(src_tag, dst_tag)
        t = handle.transfer
        self.codec = transfer_codec(env.memory, t)
        self.layer_bytes = layer_bytes_of(env.memory, t, len(handle.blocks))
        self.frames = frames_of(t.num_layers, t.frame_layers)
        # A frame of several layers is always one message [header | payload].
        self.single = not mapped and (t.frame_layers > 1 or single_for(
            env.memory, t, handle.blocks.contiguous_start is not None, dst_contiguous, path,
            env.peer_on_cpu(t.peer)))
        # A byte-stream transport sends the blocks where they lie: no gather (unless they
        # are encoded or reshaped on the way).
        self.vectored = self.single and env.transport.vectored and self.codec is None
        self.granted = 0
        self._credit_changed = anyio.Event()
        self._credit_recv: PostedReceive | None = None
        self.remote_done = anyio.Event()
        self.remote_status: tuple[str, str] = ("", "")

    async def _unstick(self) -> None:
        """Once the transfer is ending, give sends in flight a bound: a peer that is alive
        but takes none of them (stopped receiving, or a receive taken by someone else)
        would otherwise hold this transfer, its buffers and the agent's stop() for ever.
        Aborting the endpoint cancels them in UCX, so no buffer is freed under a send, even
        when another live instance shares that endpoint (its transfers fail and retry on a
        fresh one: a leak of one request's KV into another's would be worse)."""
        await self.stopping.wait()
        with anyio.move_on_after(2 * self.env.config.request_timeout_s):
            await self.quiesced.wait()
            return
        log.warning("%r: sends still in flight %.1fs after it ended; the peer takes none: "
                    "cancelling them", self.transfer, 2 * self.env.config.request_timeout_s)
        self.env.forget(self.peer, self.peer_address)
        self._peer_dead = True
        self._io_scope.cancel()
        self._loop_scope.cancel()

    def on_remote_done(self, status: str, reason: str) -> None:
        self.remote_status = (status, reason)
        self.remote_done.set()

    async def _credit_loop(self) -> None:
        buf = np.zeros(wire.CREDIT_BYTES, dtype=np.uint8)
        tag = wire.make_tag(self.src_tag, 0, wire.KIND_CREDIT)
        n = len(self.frames)
        while self.granted < n:
            self._credit_recv = self.env.transport.post_recv(buf, tag)
            try:
                await self._credit_recv.wait()
            except KVStreamError as exc:  # a task error must end this transfer, not the agent
                self.stop(TransferState.FAILED, f"credit receive: {exc}")
                return
            self._credit_recv = None
            if self._outcome is not None:
                return
            granted = self.mac.credit_of(tag, buf.data)
            if granted is None:  # not the destination's: grants nothing
                self.env.count("forged_frames", 1)
                continue
            self.granted = max(self.granted, granted)
            self._credit_changed.set()
            self._credit_changed = anyio.Event()

    async def _send_frame(self, frame: int, parts: list[torch.Tensor], slot: torch.Tensor | None,
                          limiter: anyio.Semaphore, span: Span | None = None) -> None:
        env, t = self.env, self.handle.transfer
        layers = self.frames[frame]
        try:
            nbytes = self.layer_bytes * len(layers)
            header = self.mac.header(self.dst_tag, frame, nbytes,
                                     1 if self.vectored else len(parts), codec=t.codec,
                                     traceparent=telemetry.traceparent_of(span))
            if self.vectored:
                hdr = np.zeros(wire.HEADER_CAPACITY, dtype=np.uint8)
                wire.encode_header(header, hdr.data)
                messages: list[tuple[Any, int]] = [([hdr, *parts], wire.KIND_DATA)]
            elif self.single:
                assert slot is not None  # single framing stages, unless vectored
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
                await env.transport.send(self.peer_address, buf,
                                         wire.make_tag(self.dst_tag, frame, kind))
            env.count("frames_sent", 1)
            for layer in layers:
                t.layer_done(layer)
            env.count("bytes_sent", nbytes)
        except KVStreamError as exc:  # a task error must end this transfer, not the agent
            self.stop(TransferState.FAILED, f"layer {layers[0]}: {exc}")
        finally:
            if slot is not None:
                env.staging.release(slot)
            limiter.release()
            telemetry.end_layer(span, t.layers_done[layers[-1]])

    def _pack(self, layers: range, blocks: Any, slot: torch.Tensor) -> None:
        """Gather (or encode) each layer of a frame into its place in ``slot`` (on a copy
        thread: one job per frame)."""
        mem = self.env.memory
        for layer, region in frame_regions(slot, layers, self.layer_bytes):
            if self.codec is not None:
                self.codec.encode(layer, blocks, region)
            else:
                mem.gather(layer, blocks, mem.staging_view(region, len(blocks)))

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
        direct = (blocks.contiguous_start is not None or self.mapped) and self.codec is None \
            and not self.single
        prefix = wire.HEADER_CAPACITY if self.single else 0
        for frame, layers in enumerate(self.frames):
            await h.until_sendable(layers[-1])
            for layer in layers[:-1]:  # pipelined: every layer of the frame
                await h.until_sendable(layer)
            while self.granted <= frame:
                await self._credit_changed.wait()
            await limiter.acquire()
            slot = None
            nbytes = self.layer_bytes * len(layers)
            span = telemetry.layer_span(t, "kvstream.layer.send", layers[0], bytes=nbytes,
                                        blocks=len(blocks), codec=t.codec)
            try:
                if self.mapped:
                    parts = []  # the peer reads them
                elif self.vectored:
                    parts = [row for layer in layers for row in mem.rows(layer, blocks)]
                elif direct:
                    runs = [mem.direct_run(layers[0], p, blocks) for p in range(mem.planes)]
                    parts = [run for run in runs if run is not None]  # all: the run is direct
                else:
                    slot = await env.staging.acquire(prefix + nbytes,
                                                     timeout=env.config.transfer_timeout_s)
                    await self._copy(self._pack, layers, blocks, slot[prefix:])
                    if self.codec is not None or self.single:
                        parts = [slot[prefix:prefix + nbytes]]
                    else:  # one layer, one message per plane
                        view = mem.staging_view(slot[prefix:], len(blocks))
                        parts = [view[p] for p in range(mem.planes)]
            except BaseException:
                if slot is not None:
                    env.staging.release(slot)
                limiter.release()
                telemetry.end_layer(span, False)
                raise
            sends.start_soon(self._send_frame, frame, parts, slot, limiter, span)

    async def run(self) -> None:
        _env, t = self.env, self.handle.transfer
        t.streaming()
        try:
            with self._io_scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._credit_loop)
                    tg.start_soon(self._unstick)
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
                            self._outcome = (TransferState(status), reason, None)
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
        state, reason, _ = self._ending()
        if state is not TransferState.COMPLETED:
            await self._tell_peer(state, reason)
        if self._credit_recv is not None and not self._credit_recv.completed:
            try:
                await env.transport.drain(self._credit_recv.tag)
            except KVStreamError as exc:
                log.warning("%r: %s", t, exc)
        self._end()
        self.quiesced.set()
        self.stopped.set()


