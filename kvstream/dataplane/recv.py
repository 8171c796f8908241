"""The receive half of a transfer on the data plane: post, credit, land, scatter.

With a codec the scatter is dequantize + scatter on the copy threads, so decoding layer L
overlaps receiving L+1. A push that arrived before its reservation lands in staging and
moves into blocks on ``claim``. The flow and ending rules are in ``dataplane.stream``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import numpy as np

from kvstream import telemetry
from kvstream._exceptions import KVStreamError, ProtocolError
from kvstream.dataplane import wire
from kvstream.dataplane.reshape import layer_bytes_of, single_for, transfer_codec
from kvstream.dataplane.stream import Stream, StreamEnv, frame_regions, frames_of
from kvstream.transfer.state import TransferState

if TYPE_CHECKING:
    import torch
    from opentelemetry.trace import Span

    from kvstream.dataplane.peermem import MappedSource
    from kvstream.dataplane.transport import PostedReceive
    from kvstream.memory import BlockMap
    from kvstream.transfer.handles import ReceiveHandle

__all__ = ["RecvStream"]

log = logging.getLogger("kvstream.transfer")


class RecvStream(Stream):
    """Receive half. Lands layers in the reserved blocks, or, for a push that arrived before
    the reservation (``staged_slots``), keeps them in staging until ``claim``."""

    def __init__(self, env: StreamEnv, handle: ReceiveHandle, *, peer_address: bytes,
                 src_tag: int, dst_tag: int, src_contiguous: bool, nblocks: int,
                 staged_slots: dict[int, torch.Tensor] | None = None,
                 source: MappedSource | None = None, path: str = "ucx") -> None:
        super().__init__(env, handle.transfer, peer_address)
        # Same host, one copy: the sender sends per-layer headers only and each layer is
        # read straight out of its mapped memory into ours (``dataplane.peermem``).
        self.source = source
        self.handle = handle
        self.src_tag = src_tag
        self.dst_tag = dst_tag
        self.mac = self._frame_mac(src_tag, dst_tag)
        self.nblocks = nblocks
        t = handle.transfer
        self.codec = transfer_codec(env.memory, t)
        self.layer_bytes = layer_bytes_of(env.memory, t, nblocks)
        self.frames = frames_of(t.num_layers, t.frame_layers)
        dst_run = handle.blocks is not None and handle.blocks.contiguous_start is not None
        # A frame of several layers is always one message [header | payload].
        self.single = source is None and (t.frame_layers > 1 or single_for(
            env.memory, t, src_contiguous, dst_run, path, env.peer_on_cpu(t.peer)))
        # Never received straight into engine blocks over a byte stream: a frame whose
        # header was read cannot be drained (UCX's can), so a late one could still write
        # after the transfer ended and the engine reused the blocks. It lands in staging
        # (quarantined if cut off) and is scattered; the sender still sends vectored.
        self._posted: dict[int, list[PostedReceive]] = {}
        self._posted_ns: dict[int, int] = {}  # when each layer's receive was posted (traces)
        self._slots: dict[int, torch.Tensor] = dict(staged_slots or {})
        self.prestaged = staged_slots is not None
        self._staged: set[int] = set()  # layers received into staging, not yet in blocks
        self.received = 0
        self._done_sent = False
        self._lands: anyio.abc.TaskGroup | None = None
        self._dst_off: np.ndarray | None = None
        self._released = False
        if source is None:
            self.quiesced.set()  # the receiver sends no data; only credits
        # else set once no copy reads the source's memory any more (_finish)

    @property
    def all_received(self) -> bool:
        return self.received == self.handle.transfer.num_layers

    def _post_frame(self, frame: int, slot: torch.Tensor | None) -> Any:
        """Post this frame's receives now; returns the buffer its header will land in."""
        mem, blocks, transport = self.env.memory, self.handle.blocks, self.env.transport
        layer = frame  # what follows is for one layer per frame
        self._posted_ns[frame] = time.time_ns()
        if self.single:
            assert slot is not None
            self._posted[frame] = [transport.post_recv(slot, wire.make_tag(self.dst_tag, frame,
                                                                        wire.KIND_DATA))]
            return slot[:wire.HEADER_CAPACITY].numpy()
        hdr = np.zeros(wire.HEADER_CAPACITY, dtype=np.uint8)
        if self.source is not None:
            targets = []  # the bytes are read, not received
        elif slot is None:
            assert blocks is not None  # only a reserved, contiguous destination is direct
            targets = [mem.direct_run(layer, p, blocks) for p in range(mem.planes)]
        elif self.codec is not None:
            targets = [slot]
        else:
            view = mem.staging_view(slot, self.nblocks)
            targets = [view[p] for p in range(mem.planes)]
        posted = [transport.post_recv(hdr, wire.make_tag(self.dst_tag, layer, wire.KIND_HEADER))]
        posted += [transport.post_recv(tgt, wire.make_tag(self.dst_tag, layer, wire.KIND_DATA + p))
                   for p, tgt in enumerate(targets)]
        self._posted[layer] = posted
        return hdr

    def _unpack(self, layers: range, blocks: BlockMap, slot: torch.Tensor) -> None:
        """Scatter (or decode) each layer of a frame out of its place in ``slot`` (on a
        copy thread: one job per frame)."""
        mem = self.env.memory
        for layer, region in frame_regions(slot, layers, self.layer_bytes):
            if self.codec is not None:
                self.codec.decode(layer, blocks, region)
            else:
                mem.scatter(layer, blocks, mem.staging_view(region, self.nblocks))

    async def _scatter(self, frame: int) -> None:
        """Staging -> the reserved blocks, then the frame's layers count as landed."""
        env, h = self.env, self.handle
        assert h.blocks is not None
        slot = self._slots.get(frame)
        if slot is not None:
            prefix = wire.HEADER_CAPACITY if self.single else 0
            await self._copy(self._unpack, self.frames[frame], h.blocks, slot[prefix:])
            env.staging.release(self._slots.pop(frame))
        for layer in self.frames[frame]:
            h.mark_layer(layer)
        if h.transfer.all_layers_done:
            self._outcome = self._outcome or (TransferState.COMPLETED, "", None)
            self._loop_scope.cancel()

    async def _read_frame(self, frame: int) -> None:
        """Same host: copy the frame's layers out of the peer's mapped memory, into the
        reserved blocks, or into the frame's staging slot when there is no reservation yet
        (one copy job)."""
        src, mem, h = self.source, self.env.memory, self.handle
        assert src is not None
        reads: list[tuple[int, int, int, Any]] = []  # layer, address, bytes, offsets
        if h.blocks is not None and frame not in self._slots:
            if self._dst_off is None:
                self._dst_off = src.dst_offsets(mem.num_blocks, h.blocks.ids)
            for layer in self.frames[frame]:
                tensor = mem.layers[layer]
                reads.append((layer, tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                              self._dst_off))
        else:
            slot, lb = self._slots[frame], self.layer_bytes
            dst_off = src.dst_offsets(self.nblocks, None)
            reads = [(layer, slot[i * lb:].data_ptr(), lb, dst_off)
                     for i, layer in enumerate(self.frames[frame])]

        def read() -> None:
            for layer, address, nbytes, offsets in reads:
                src.copy_layer(layer, address, nbytes, offsets, lambda: self._outcome is None)

        await self._copy(read)

    async def _land_frame(self, frame: int, hdr: np.ndarray, limiter: anyio.Semaphore) -> None:
        env, h = self.env, self.handle
        layers = self.frames[frame]
        span: Span | None = None
        try:
            for req in self._posted[frame]:
                await req.wait()
            if self._outcome is not None:
                return
            header = wire.decode_header(hdr.data)
            if not self.mac.header_ok(header):  # never taken as "layer ready"
                env.count("forged_frames", 1)
                raise ProtocolError(f"frame {frame}: its header does not verify (forged?)")
            want = self.layer_bytes * len(layers)
            if (header.xfer_tag, header.layer, header.nbytes, header.codec) != \
                    (self.dst_tag, frame, want, h.transfer.codec):
                raise ProtocolError(
                    f"frame {frame}: header says tag {header.xfer_tag:#x} frame {header.layer} "
                    f"{header.nbytes} bytes codec {header.codec}; expected {self.dst_tag:#x}, "
                    f"{frame}, {want}, {h.transfer.codec}")
            del self._posted[frame]
            env.count("frames_received", 1)
            if self.source is not None:
                await self._read_frame(frame)
            span = telemetry.layer_span(
                h.transfer, "kvstream.layer.receive", layers[0],
                start_ns=self._posted_ns.get(frame),
                links=telemetry.link_from(header.traceparent), bytes=want,
                blocks=self.nblocks, codec=h.transfer.codec)
            if span is not None:
                span.add_event("arrived")
            env.count("bytes_received", want)
            self.received += len(layers)
            if self.all_received:
                self.on_received()
            if h.blocks is None:
                self._staged.add(frame)  # no reservation yet: it waits in staging
            else:
                await self._scatter(frame)
            if self.all_received and not self._done_sent:
                # The sender may release its blocks now, claimed or not.
                self._done_sent = True
                await env.publish_done(self.peer, msgspec.structs.replace(
                    h.transfer.result(), status=TransferState.COMPLETED))
        except Exception as exc:  # torch or UCX trouble ends this transfer, not the agent
            self.stop(TransferState.FAILED, f"frame {frame}: {exc}")
        finally:
            posted = self._posted.get(frame)
            # A slot with a receive still posted on it is released after the drain; a staged
            # frame's slot when it is claimed or dropped.
            if (posted is None or all(r.completed for r in posted)) and frame not in self._staged:
                slot = self._slots.pop(frame, None)
                if slot is not None:
                    env.staging.release(slot)
            limiter.release()
            telemetry.end_layer(span, h.transfer.layers_done[layers[-1]] or frame in self._staged)

    def claim(self, blocks: BlockMap) -> None:
        """The engine reserved blocks for a push already (partly) staged: move it in."""
        self.handle.blocks = blocks
        staged, self._staged = sorted(self._staged), set()
        if self._lands is not None:
            self._lands.start_soon(self._land_staged, staged)

    async def _land_staged(self, frames: list[int]) -> None:
        try:
            for frame in frames:
                if self._outcome is not None and self._outcome[0] is not TransferState.COMPLETED:
                    return
                await self._scatter(frame)
        except Exception as exc:
            self.stop(TransferState.FAILED, f"moving staged layers in: {exc}")

    async def _stream(self, lands: anyio.abc.TaskGroup) -> None:
        env, h = self.env, self.handle
        self._lands = lands
        direct = not self.prestaged and h.blocks is not None and self.codec is None and \
            (h.blocks.contiguous_start is not None or self.source is not None) and \
            not self.single
        frames = self.frames
        window = len(frames) if direct or self.prestaged else env.config.max_inflight_layers
        limiter = anyio.Semaphore(window)
        credit_tag = wire.make_tag(self.src_tag, 0, wire.KIND_CREDIT)
        credited = 0

        async def flush_credit(upto: int) -> None:
            nonlocal credited
            if upto > credited:
                # One cumulative credit for every layer posted so far.
                await env.transport.send(self.peer_address, self.mac.credit(credit_tag, upto),
                                         credit_tag)
                credited = upto

        for frame, layers in enumerate(frames):
            if h.requested <= layers[-1]:  # lazy: post (and credit) a layer once asked for
                await flush_credit(frame)
                await h.until_requested(layers[-1])
            try:
                limiter.acquire_nowait()
            except anyio.WouldBlock:
                await flush_credit(frame)
                await limiter.acquire()
            slot = self._slots.get(frame)
            if slot is None and not direct:
                nbytes = self.layer_bytes * len(layers)
                if self.single:
                    nbytes += wire.HEADER_CAPACITY
                try:
                    slot = await env.staging.acquire(nbytes, timeout=env.config.transfer_timeout_s)
                except BaseException:
                    limiter.release()
                    raise
                self._slots[frame] = slot
            hdr = self._post_frame(frame, slot)
            lands.start_soon(self._land_frame, frame, hdr, limiter)
        await flush_credit(len(frames))
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
        state, reason, _ = self._outcome or (TransferState.FAILED, "receive stopped", None)
        await self._tell_peer(state, reason)
        pending = [req for posted in self._posted.values() for req in posted if not req.completed]
        for req in pending:
            try:
                await env.transport.drain(req.tag)
            except KVStreamError as exc:
                log.warning("%r: %s", t, exc)
        with anyio.move_on_after(env.config.request_timeout_s):
            for req in pending:
                with contextlib.suppress(KVStreamError):
                    await req.wait()

    async def _finish(self) -> None:
        env, t = self.env, self.handle.transfer
        if self._posted or self._ending()[0] is not TransferState.COMPLETED:
            # Reached when cancellation skipped the orderly path in run(), or when nothing
            # was posted (a lazy pull between layers): the sender still waits for credits
            # and must hear of the end now, not at its deadline or lease expiry.
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
        self.quiesced.set()  # every copy out of the peer's memory has returned
        if self._end() and t.state is TransferState.COMPLETED and not self._done_sent:
            await env.publish_done(self.peer, t.result())
        self.quiesced.set()
        self.stopped.set()

