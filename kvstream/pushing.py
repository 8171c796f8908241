"""Push transfers, the prefill side: offer the manifest, then stream on acceptance.

A mixin of ``Agent``, one job: validate a push here, offer it to the destination (retrying
while it answers "busy"), map its answer (accept, skip list, reject) and start the stream.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import stamina
from opentelemetry.trace import SpanKind

from kvstream import telemetry
from kvstream._exceptions import (
    ConfigError,
    InvalidBlockError,
    ProtocolError,
    TransferAbortedError,
    TransferError,
)
from kvstream.config import check_timeout
from kvstream.control import messages as m
from kvstream.control.subjects import Subjects
from kvstream.dataplane import wire
from kvstream.dataplane.memory import is_run
from kvstream.handles import SendHandle
from kvstream.pulling import REJECT_ERRORS, _hashes, check_skip, shrink, without
from kvstream.quant.scheme import effective_codec, wire_fingerprint, wire_layer_bytes
from kvstream.streams import SendStream
from kvstream.transfer import Side, Transfer, TransferState

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from kvstream.agent import Agent

__all__ = ["Pushing"]

class _Busy(Exception):
    """A destination's "busy" answer, retried with backoff (internal)."""


class Pushing:
    async def push(
        self: Agent, request_id: str, dst_instance: str, src_blocks: Sequence[int], *,
        dst_blocks: Sequence[int] | None = None, mode: str = "pipelined",
        timeout: float | None = None, block_hashes: Sequence[int] | None = None,
        codec: str | None = None, trace_context: Context | None = None,
    ) -> SendHandle:
        """Offer ``request_id``'s KV to ``dst_instance``; returns once it accepted.

        ``mode="pipelined"`` sends layer L as soon as ``handle.layer_ready(L)``;
        ``"eager"`` waits for every layer. With ``block_hashes`` (prefix-chain hashes of
        the first blocks) the destination skips blocks it already holds. ``codec``
        (default ``AgentConfig.codec``) is the wire codec; an FP8 cache always goes as it
        is, with its scales. The transfer's trace nests under ``trace_context`` (default:
        the caller's current OpenTelemetry context). Raises
        ``NoPeerError`` (nobody answers), ``InvalidBlockError`` (ids outside memory, here or there),
        ``IncompatiblePeerError`` (other layout) before any byte moves.
        """
        mem = self._mem()
        if mode not in ("pipelined", "eager"):
            raise ConfigError(f"mode must be 'pipelined' or 'eager', got {mode!r}")
        Subjects.check_instance_id(dst_instance)
        check_timeout(timeout)
        blocks = mem.block_map(src_blocks, what="source block")
        if dst_blocks is not None and len(dst_blocks) != len(blocks):
            raise InvalidBlockError(f"{len(blocks)} source blocks but {len(dst_blocks)} destination"
                                    " blocks", block_ids=list(dst_blocks))
        hashes = _hashes(block_hashes, len(blocks))
        wire_codec = effective_codec(codec or self.config.codec, mem.layout)
        self._check_capacity()
        transfer = Transfer(transfer_id=uuid.uuid4().hex, request_id=request_id, side=Side.SEND,
                            peer=dst_instance, num_layers=mem.layout.num_layers,
                            layer_bytes=wire_layer_bytes(mem.layout, wire_codec, len(blocks)))
        transfer.deadline_s = timeout
        transfer.codec = wire_codec
        span = telemetry.trace_transfer(transfer, telemetry.open_span(
            "kvstream.push", parent=trace_context, kind=SpanKind.PRODUCER,
            request_id=request_id, transfer_id=transfer.transfer_id, side="send",
            peer=dst_instance, mode=mode, codec=wire_codec, blocks=len(blocks)))
        handle = SendHandle(transfer, lambda reason: self._abort(transfer, reason),
                            eager=mode == "eager", blocks=blocks)
        src_tag = wire.next_xfer_tag()
        manifest = m.Manifest(
            transfer_id=transfer.transfer_id, request_id=request_id, src=self.instance_id,
            dst=dst_instance, src_address=self.worker_address, src_tag=src_tag,
            fingerprint=wire_fingerprint(mem.layout, wire_codec), num_layers=mem.layout.num_layers,
            src_blocks=list(blocks.ids), dst_blocks=list(dst_blocks or []), mode=mode,
            codec=wire_codec, payload_bytes=transfer.layer_bytes * transfer.num_layers,
            deadline_s=timeout or self.config.transfer_timeout_s, block_hashes=hashes,
            cache_scales=mem.cache_scales if wire_codec == "none" else [],
        )
        try:
            with telemetry.step(span, "kvstream.manifest", peer=dst_instance):
                reply = await self._offer(manifest, dst_instance, telemetry.headers_of(span))
        except BaseException as exc:  # cancelled too: the transfer must still end, once
            self._fail_unstarted(transfer, exc if isinstance(exc, Exception)
                                 else TransferAbortedError("push cancelled by the caller"))
            raise
        if isinstance(reply, m.Reject):
            exc = REJECT_ERRORS.get(reply.code, TransferError)(
                f"{dst_instance} refused transfer for {request_id!r}: {reply.reason}")
            self._fail_unstarted(transfer, exc)
            raise exc
        if not isinstance(reply, m.Accept) or reply.transfer_id != transfer.transfer_id:
            exc = ProtocolError(f"unexpected answer to a manifest: {type(reply).__name__}")
            self._fail_unstarted(transfer, exc)
            raise exc
        self.registry.contact(dst_instance)
        try:
            check_skip(reply.skip, len(blocks))
        except ProtocolError as exc:
            await self._request_abort(dst_instance, transfer.transfer_id, str(exc))
            self._fail_unstarted(transfer, exc)
            raise
        if reply.skip:
            handle.blocks = blocks.without(reply.skip)
            shrink(transfer, mem, len(blocks), len(handle.blocks))
            self._count("bytes_skipped", transfer.bytes_skipped)
            if not handle.blocks:
                self._complete_empty(transfer)
                return handle
        stream = SendStream(self._env(), handle, peer_address=reply.dst_address,
                            src_tag=src_tag, dst_tag=reply.dst_tag,
                            dst_contiguous=is_run(without(reply.dst_blocks, reply.skip)))
        self._run_stream(transfer.transfer_id, stream)
        return handle

    async def _offer(self: Agent, manifest: m.Manifest, dst: str,
                     headers: dict[str, str] | None = None) -> m.ControlUnion:
        """Send the manifest; while the destination answers "busy" (no reservation yet and a
        full staging pool) back off and retry, for at most ``staging_wait_s``."""
        reply: m.ControlUnion | None = None
        try:
            async for attempt in stamina.retry_context(
                    on=_Busy, attempts=None, timeout=self.config.staging_wait_s,
                    wait_initial=0.01, wait_max=0.25, wait_jitter=0.01):
                with attempt:
                    reply = await self._bus_().request(
                        self.subjects.control(dst), manifest,
                        timeout=self.config.request_timeout_s, peer=dst, headers=headers)
                    if isinstance(reply, m.Reject) and reply.code == "busy":
                        raise _Busy(reply.reason)
        except _Busy as exc:
            raise TransferError(f"{dst} stayed busy for {self.config.staging_wait_s}s: {exc}",
                                request_id=manifest.request_id, peer=dst) from None
        assert reply is not None
        return reply

    def _fail_unstarted(self: Agent, transfer: Transfer, exc: Exception) -> None:
        if transfer.finish(TransferState.FAILED, str(exc)):
            self._count("failed", 1)
