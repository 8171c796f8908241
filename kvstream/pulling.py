"""Pull transfers and the leases behind them.

A mixin of ``Agent``, one job: the source ``offer()``s a request's blocks and holds them
under a lease; the destination ``keep()``s that lease alive (one ``Renew`` per source per
quarter lease, whatever the number of requests or blocks) and ``pull()``s when it is
ready, eagerly or layer by layer. An offer nobody renews expires and is released; a
source that vanishes fails the destination's leases and pulls at the next renewal.

The data moves exactly as in a push (the same two streams, receiver-driven credits);
only who sends the manifest differs: in a pull the source answers the ``Pull`` with it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import anyio
from opentelemetry.trace import SpanKind

from kvstream import telemetry
from kvstream._exceptions import (
    CapacityError,
    ConfigError,
    DuplicateRequestError,
    IncompatiblePeerError,
    InvalidBlockError,
    KVStreamError,
    NoPeerError,
    ProtocolError,
    TransferError,
)
from kvstream.config import check_timeout
from kvstream.control import messages as m
from kvstream.control.subjects import Subjects
from kvstream.dataplane import wire
from kvstream.dataplane.memory import is_run
from kvstream.handles import ReceiveHandle, SendHandle
from kvstream.leases import RemoteLease
from kvstream.prefix import skipped_indices
from kvstream.quant.scheme import effective_codec, wire_fingerprint, wire_layer_bytes
from kvstream.streams import RecvStream, SendStream
from kvstream.transfer import Side, Transfer, TransferState

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from kvstream.agent import Agent
    from kvstream.dataplane.memory import BlockMap, RegisteredKV

__all__ = ["REJECT_ERRORS", "Pulling", "check_skip", "without"]

log = logging.getLogger("kvstream.agent")

PULL_MODES = ("eager", "lazy")

# What a peer's Reject code means to the engine (push and pull alike).
REJECT_ERRORS: dict[str, type[KVStreamError]] = {
    "incompatible": IncompatiblePeerError,
    "invalid_blocks": InvalidBlockError,
    "malformed": ProtocolError,
}


def without(ids: Sequence[int], skip: Sequence[int]) -> list[int]:
    drop = set(skip)
    return [b for i, b in enumerate(ids) if i not in drop]


def check_skip(skip: Sequence[int], nblocks: int) -> None:
    """A peer's skip list must name distinct positions of this transfer's blocks."""
    if len(set(skip)) != len(skip) or any(not 0 <= i < nblocks for i in skip):
        raise ProtocolError(f"skip list {list(skip)[:8]} does not index {nblocks} blocks")


def shrink(t: Transfer, mem: RegisteredKV, total: int, kept: int) -> None:
    """Account a transfer for only the blocks that move (in wire bytes of its codec); the
    rest counts as skipped (in engine bytes)."""
    t.layer_bytes = wire_layer_bytes(mem.layout, t.codec, kept)
    t.bytes_skipped = mem.planes * mem.plane_bytes(total - kept) * t.num_layers


class Pulling:
    # -- the source side ---------------------------------------------------------------
    def offer(self: Agent, request_id: str, src_blocks: Sequence[int], *,
              block_hashes: Sequence[int] | None = None, mode: str = "pipelined",
              lease_s: float | None = None) -> SendHandle:
        """Hold ``request_id``'s blocks for a destination to ``pull()``.

        Mark layers ready on the handle as they are computed (a pull may start before the
        last one; ``mode="eager"`` makes it wait for all). The blocks stay held until the
        pull completes, either side aborts, or ``lease_s`` passes without a renewal; the
        handle's result says which, and then the engine may reuse them.
        """
        mem = self._mem()
        if mode not in ("pipelined", "eager"):
            raise ConfigError(f"mode must be 'pipelined' or 'eager', got {mode!r}")
        blocks = mem.block_map(src_blocks, what="source block")
        hashes = _hashes(block_hashes, len(blocks))
        lease = self.config.lease_s if lease_s is None else lease_s
        if lease <= 0:
            raise ConfigError("lease_s must be positive")
        if request_id in self._held or request_id in self._pulled:
            raise DuplicateRequestError(f"request {request_id!r} is already offered",
                                        request_id=request_id)
        self._check_capacity()
        t = Transfer(transfer_id=uuid.uuid4().hex, request_id=request_id, side=Side.SEND,
                     peer="", num_layers=mem.layout.num_layers,
                     layer_bytes=mem.planes * mem.plane_bytes(len(blocks)))
        handle = SendHandle(t, lambda reason: self._abort(t, reason), eager=mode == "eager",
                            blocks=blocks)
        handle.block_hashes = hashes
        handle.lease_s = lease
        handle.lease_until = time.monotonic() + lease
        self._held[request_id] = handle
        return handle

    async def _on_pull(self: Agent, msg: m.Pull,
                       headers: dict[str, str] | None = None) -> m.ControlMessage:
        def reject(code: m.RejectCode, reason: str) -> m.Reject:
            log.warning("refused pull of %s by %s: %s", msg.request_id, msg.dst, reason)
            return m.Reject(transfer_id="", code=code, reason=reason)

        mem = self.memory
        if mem is None:
            return reject("unknown_request", f"{self.instance_id} has no registered KV memory")
        try:
            codec = effective_codec(msg.codec, mem.layout)
        except ConfigError as exc:
            return reject("incompatible", str(exc))
        # Verbatim bytes need the same layout; a codec, the same wire format.
        theirs = msg.fingerprint if codec == "none" else msg.wire_fingerprint
        if (why := mem.layout_mismatch(theirs, msg.num_layers, codec)) is not None:
            return reject("incompatible", why)
        try:
            Subjects.check_instance_id(msg.dst)
        except ConfigError as exc:
            return reject("malformed", str(exc))
        handle = self._held.get(msg.request_id)
        if handle is None:
            return reject("unknown_request", f"{self.instance_id} holds no KV for "
                          f"{msg.request_id!r} (never offered, expired, aborted or pulled)")
        full = handle.blocks
        if len(msg.dst_blocks) != len(full):
            return reject("invalid_blocks", f"{len(msg.dst_blocks)} destination blocks for the "
                          f"{len(full)} blocks offered for {msg.request_id!r}")
        skip = skipped_indices(handle.block_hashes, msg.have)
        del self._held[msg.request_id]
        t = handle.transfer
        t.peer = msg.dst
        t.started_at = time.monotonic()  # the transfer deadline counts from the pull
        t.deadline_s = msg.deadline_s
        t.codec = codec
        telemetry.trace_transfer(t, telemetry.open_span(
            "kvstream.serve_pull", parent=telemetry.context_from(headers),
            kind=SpanKind.PRODUCER, request_id=t.request_id, transfer_id=t.transfer_id,
            side="send", peer=msg.dst, codec=codec, blocks=len(full)))
        handle.blocks = full.without(skip)
        shrink(t, mem, len(full), len(handle.blocks))
        self._count("bytes_skipped", t.bytes_skipped)
        src_tag = wire.next_xfer_tag()
        manifest = m.Manifest(
            transfer_id=t.transfer_id, request_id=t.request_id, src=self.instance_id,
            dst=msg.dst, src_address=self.worker_address, src_tag=src_tag,
            fingerprint=wire_fingerprint(mem.layout, codec), num_layers=t.num_layers,
            src_blocks=full.ids, dst_blocks=list(msg.dst_blocks),
            mode="eager" if handle.eager else "pipelined", codec=codec,
            payload_bytes=t.layer_bytes * t.num_layers, deadline_s=msg.deadline_s,
            block_hashes=handle.block_hashes, skip=skip, skipped_bytes=t.bytes_skipped,
            lease_s=handle.lease_s, cache_scales=mem.cache_scales if codec == "none" else [])
        self.registry.contact(msg.dst)
        if not handle.blocks:
            self._complete_empty(t)
            return manifest
        handle.lease_until = time.monotonic() + handle.lease_s
        stream = SendStream(self._env(), handle, peer_address=msg.dst_address, src_tag=src_tag,
                            dst_tag=msg.dst_tag,
                            dst_contiguous=is_run(without(msg.dst_blocks, skip)))
        self._pulled[t.request_id] = stream
        self._run_stream(t.transfer_id, stream)
        return manifest

    async def pull(self: Agent, request_id: str, src_instance: str, dst_blocks: Sequence[int],
                   *, mode: str = "eager", have: Iterable[int] = (), lookahead: int = 1,
                   timeout: float | None = None, codec: str | None = None,
                   trace_context: Context | None = None) -> ReceiveHandle:
        """Fetch ``request_id``'s KV offered at ``src_instance`` into ``dst_blocks``.

        ``mode="eager"`` fetches every layer now; ``"lazy"`` fetches a layer when the engine
        waits for it (``wait_layer`` / ``fetch``), ``lookahead`` layers ahead. ``have``
        holds prefix hashes already here: those blocks are not sent. ``codec`` (default
        ``AgentConfig.codec``) asks for a wire codec; a source whose cache is already FP8
        answers "none" and sends it as it is. The trace nests under ``trace_context``
        (default: the current OpenTelemetry context). Returns once the source answered;
        raises ``TransferError`` if it holds nothing for the request.
        """
        mem = self._mem()
        want_codec = effective_codec(codec or self.config.codec, mem.layout)
        if want_codec not in self.config.accept_codecs:
            raise ConfigError(f"codec {want_codec!r} is not in this agent's accept_codecs "
                              f"({', '.join(self.config.accept_codecs)})")
        if mode not in PULL_MODES:
            raise ConfigError(f"mode must be one of {PULL_MODES}, got {mode!r}")
        Subjects.check_instance_id(src_instance)
        check_timeout(timeout)
        blocks = mem.block_map(dst_blocks, what="destination block")
        key = (src_instance, request_id)
        kept_lease = self._wanted.get(key)
        if kept_lease is not None and not isinstance(kept_lease, RemoteLease):
            raise DuplicateRequestError(f"{request_id!r} at {src_instance} is already being pulled",
                                        request_id=request_id, peer=src_instance)
        self._check_capacity()
        dst_tag = wire.next_xfer_tag()
        deadline = timeout or self.config.transfer_timeout_s
        span = telemetry.open_span("kvstream.pull", parent=trace_context, kind=SpanKind.CONSUMER,
                                   request_id=request_id, side="recv", peer=src_instance,
                                   mode=mode, codec=want_codec, blocks=len(blocks))
        try:
            return await self._pull_with(span, request_id, src_instance, blocks, mode, have,
                                         lookahead, deadline, want_codec, dst_tag)
        except BaseException as exc:
            telemetry.end_untracked(span, exc)
            raise

    async def _pull_with(self: Agent, span: Span, request_id: str, src_instance: str,
                         blocks: BlockMap, mode: str, have: Iterable[int], lookahead: int,
                         deadline: float, want_codec: str, dst_tag: int) -> ReceiveHandle:
        mem = self._mem()
        key = (src_instance, request_id)
        try:
            with telemetry.step(span, "kvstream.manifest", peer=src_instance):
                reply = await self._bus_().request(
                    self.subjects.control(src_instance),
                    m.Pull(request_id=request_id, src=src_instance, dst=self.instance_id,
                           dst_address=self.worker_address, dst_tag=dst_tag,
                           fingerprint=mem.layout.fingerprint, num_layers=mem.layout.num_layers,
                           dst_blocks=blocks.ids, have=list(have), mode=mode,  # type: ignore[arg-type]
                           deadline_s=deadline, codec=want_codec,
                           wire_fingerprint=wire_fingerprint(mem.layout, want_codec)),
                    timeout=self.config.request_timeout_s, peer=src_instance,
                    headers=telemetry.headers_of(span))
        except BaseException as exc:
            # The source may have started sending anyway: stop it (and the offer) rather than
            # leave it waiting for credits that never come.
            if not (isinstance(exc, NoPeerError) and exc.no_responders):
                with anyio.CancelScope(shield=True), \
                        anyio.move_on_after(self.config.request_timeout_s):
                    await self._request_abort(src_instance, "", f"pull failed: {exc!r}",
                                              request_id=request_id)
            raise
        if isinstance(reply, m.Reject):
            telemetry.count_refused("recv", reply.code)
            kind = REJECT_ERRORS.get(reply.code, TransferError)
            raise kind(f"{src_instance} refused the pull of {request_id!r}: {reply.reason}")
        try:
            if not isinstance(reply, m.Manifest) or reply.request_id != request_id \
                    or not reply.transfer_id or len(reply.src_blocks) != len(blocks):
                raise ProtocolError(f"unexpected answer to a pull: {type(reply).__name__}")
            check_skip(reply.skip, len(blocks))
            if reply.codec not in (want_codec, "none") or \
                    reply.codec not in self.config.accept_codecs or (why := mem.layout_mismatch(
                    reply.fingerprint, reply.num_layers, reply.codec, reply.cache_scales)):
                raise IncompatiblePeerError(
                    f"{src_instance} answered the pull of {request_id!r} with codec "
                    f"{reply.codec!r}: {why if reply.codec in (want_codec, 'none') else 'not asked for'}")
        except ProtocolError:
            if isinstance(reply, m.Manifest) and reply.transfer_id:
                await self._request_abort(src_instance, reply.transfer_id, "bad pull answer")
            raise
        current = self._wanted.get(key)
        if isinstance(current, RemoteLease):  # kept before or during the pull: taken over
            del self._wanted[key]
            current._hand_over()
        self._note_lease(src_instance, reply.lease_s)
        self.registry.contact(src_instance)
        kept = blocks.without(reply.skip)
        t = Transfer(transfer_id=reply.transfer_id, request_id=request_id, side=Side.RECV,
                     peer=src_instance, num_layers=mem.layout.num_layers, layer_bytes=0)
        t.codec = reply.codec
        telemetry.trace_transfer(t, span)
        span.set_attribute("kvstream.transfer_id", t.transfer_id)
        shrink(t, mem, len(blocks), len(kept))
        t.deadline_s = deadline
        self._count("bytes_skipped", t.bytes_skipped)
        handle = ReceiveHandle(t, lambda reason: self._abort(t, reason), blocks=kept,
                               lazy=mode == "lazy", lookahead=lookahead)
        if not kept:
            self._complete_empty(t, handle)
            return handle
        try:
            stream = RecvStream(self._env(), handle, peer_address=reply.src_address,
                                src_tag=reply.src_tag, dst_tag=dst_tag,
                                src_contiguous=is_run(without(reply.src_blocks, reply.skip)),
                                nblocks=len(kept))
        except Exception as exc:  # e.g. the memory was unregistered meanwhile
            if t.finish(TransferState.FAILED, str(exc)):
                self._count("failed", 1)
            await self._request_abort(src_instance, t.transfer_id, str(exc))
            raise
        self._wanted[key] = stream
        self._run_stream(t.transfer_id, stream)
        return handle

    def _check_capacity(self: Agent) -> None:
        active = len(self._reservations) + len(self._streams) + len(self._held)
        if active >= self.config.max_transfers:
            raise CapacityError(f"max_transfers={self.config.max_transfers} reached",
                                what="transfers", limit=self.config.max_transfers)

    def _complete_empty(self: Agent, t: Transfer, handle: ReceiveHandle | None = None) -> None:
        """Every block was already at the destination: done without moving a byte."""
        for layer in range(t.num_layers):
            if handle is not None:
                handle.mark_layer(layer)
            else:
                t.layer_done(layer)
        if t.finish(TransferState.COMPLETED, "every block already at the destination"):
            self._count("completed", 1)


def _hashes(block_hashes: Sequence[int] | None, nblocks: int) -> list[int]:
    hashes = list(block_hashes or [])  # the first blocks' (a partial last block has none)
    if len(hashes) > nblocks:
        raise InvalidBlockError(f"{len(hashes)} block hashes for {nblocks} blocks")
    return hashes
