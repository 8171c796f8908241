"""Pushes, the prefill side: offer the manifest, then stream on acceptance.

One job: validate a push here, offer it to the destination (retrying while it answers
"busy"), map its answer (accept, skip list, reject) and start the send stream.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import stamina
from opentelemetry.trace import SpanKind

from kvstream import telemetry
from kvstream._exceptions import (
    InvalidBlockError,
    NoPeerError,
    ProtocolError,
    TransferAbortedError,
    TransferError,
)
from kvstream.config import check_timeout
from kvstream.control import messages as m
from kvstream.control.subjects import Subjects
from kvstream.dataplane.reshape import layer_bytes_of
from kvstream.dataplane.send import SendStream
from kvstream.dataplane.stream import frame_layers_for
from kvstream.engine.rules import (
    PUSH_MODES,
    REJECT_ERRORS,
    check_hashes,
    check_mode,
    check_skip,
    needs_reshape,
    reshape_between,
    shrink,
    without,
)
from kvstream.memory import is_run
from kvstream.quant.scheme import effective_codec, wire_fingerprint
from kvstream.transfer.handles import SendHandle
from kvstream.transfer.plan import Reshape, TpInfo
from kvstream.transfer.state import EndCause, Side, Transfer, TransferState

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from kvstream.control.registry import Registry
    from kvstream.dataplane.transport import Transport
    from kvstream.engine.core import Core

__all__ = ["Pusher"]


class _Busy(Exception):
    """A destination's "busy" answer, retried with backoff (internal)."""


class Pusher:
    def __init__(self, core: Core) -> None:
        self.core = core

    async def push(
        self, request_id: str, dst_instance: str, src_blocks: Sequence[int], *,
        dst_blocks: Sequence[int] | None = None, mode: str = "pipelined",
        timeout: float | None = None, block_hashes: Sequence[int] | None = None,
        codec: str | None = None, trace_context: Context | None = None,
        tokens: int | None = None,
    ) -> SendHandle:
        core = self.core
        mem = core.mem()
        check_mode(mode, PUSH_MODES)
        Subjects.check_instance_id(dst_instance)
        check_timeout(timeout)
        blocks = mem.block_map(src_blocks, what="source block")
        if dst_blocks is not None and len(dst_blocks) != len(blocks):
            raise InvalidBlockError(f"{len(blocks)} source blocks but {len(dst_blocks)} destination"
                                    " blocks", block_ids=list(dst_blocks))
        hashes = check_hashes(block_hashes, len(blocks))
        wire_codec = effective_codec(codec or core.config.codec, mem.layout)
        reshape = self._reshape(dst_instance, blocks.ids, dst_blocks, tokens, wire_codec)
        if reshape is not None:
            hashes = []  # prefix hashes are per block size: no incremental skip across them
        transfer_id = uuid.uuid4().hex
        entry = core.book.push(request_id, transfer_id, dst_instance, core.clock())
        transfer = Transfer(transfer_id=transfer_id, request_id=request_id, side=Side.SEND,
                            peer=dst_instance, num_layers=mem.layout.num_layers,
                            layer_bytes=0, clock=core.clock)
        transfer.reshape = reshape
        transfer.deadline_s = timeout
        transfer.codec = wire_codec
        transfer.layer_bytes = layer_bytes_of(mem, transfer, len(blocks))
        transfer.frame_layers = frame_layers_for(
            core.config, transfer.num_layers, transfer.layer_bytes * transfer.num_layers,
            host_memory=mem.device.type == "cpu" and core.peer_on_cpu(dst_instance))
        if transfer.frame_layers > 1:
            mode = "eager"  # short: streaming it layer by layer costs more than it hides
        span = telemetry.trace_transfer(transfer, telemetry.open_span(
            "kvstream.push", parent=trace_context, kind=SpanKind.PRODUCER,
            request_id=request_id, transfer_id=transfer.transfer_id, side="send",
            peer=dst_instance, mode=mode, codec=wire_codec, blocks=len(blocks)))
        handle = SendHandle(transfer, core.aborter(entry),
                            eager=mode == "eager", blocks=blocks)
        core.track(entry, handle)
        src_tag = core.new_tag(transfer)
        verbatim = wire_codec == "none" and reshape is None  # the mapped paths copy blocks as is
        manifest = m.Manifest(
            transfer_id=transfer.transfer_id, request_id=request_id, src=core.instance_id,
            dst=dst_instance, src_address=core.transport.address, src_tag=src_tag,
            fingerprint=wire_fingerprint(mem.layout, wire_codec), num_layers=mem.layout.num_layers,
            src_blocks=list(blocks.ids), dst_blocks=list(dst_blocks or []),
            mode=mode,  # type: ignore[arg-type]  # checked: one of PUSH_MODES
            frame_layers=transfer.frame_layers,
            codec=wire_codec, payload_bytes=transfer.layer_bytes * transfer.num_layers,
            deadline_s=timeout or core.config.transfer_timeout_s, block_hashes=hashes,
            cache_scales=mem.cache_scales if wire_codec == "none" else [],
            src_host=core.paths.host, src_tcp=core.paths.tcp_address,
            tcp_token=core.paths.tcp_token(dst_instance),
            src_shared=core.paths.shared if verbatim else None,
            src_secrets=core.paths.proofs(dst_instance, transfer.transfer_id)
            if verbatim else [],
            src_device=core.paths.device_for(dst_instance, codec=wire_codec)
            if verbatim else None,
            reshape=reshape, src_layout=mem.layout if reshape else None,
            src_tp=core.config.tp if reshape else None,
        )
        reply: m.ControlUnion | None = None
        try:
            with telemetry.step(span, "kvstream.manifest", peer=dst_instance):
                reply = await self._offer(manifest, dst_instance, telemetry.headers_of(span))
            self._check_reply(reply, transfer, dst_instance, core.registry, core.transport)
            assert isinstance(reply, m.Accept)
        except BaseException as exc:  # cancelled too: the transfer must still end, once
            _fail(transfer, exc)
            refused = isinstance(reply, m.Reject) or (
                isinstance(exc, NoPeerError) and exc.no_responders)
            if not refused:
                # The manifest may have arrived and only its answer been lost (a NATS node
                # failing over, a bad answer): the destination would wait for bytes until
                # the deadline. Tell it, shielded and bounded.
                with anyio.CancelScope(shield=True), \
                        anyio.move_on_after(core.config.request_timeout_s):
                    await core.request_abort(dst_instance, transfer.transfer_id,
                                             f"push failed: {exc!r}")
            raise
        core.registry.contact(dst_instance)
        announced = core.registry.announced(dst_instance)
        peer_host = announced.host if announced is not None else ""  # "": not same-host
        try:
            check_skip(reply.skip, len(blocks))
            if (why := core.paths.refusal(reply.path, peer=dst_instance, peer_tcp=reply.dst_tcp,
                                          codec=wire_codec,
                                          sent_device=manifest.src_device is not None)):
                raise ProtocolError(f"{dst_instance} chose a path this instance refuses: {why}")
            if reply.path == "tcp":
                core.paths.trust_tcp(dst_instance, reply.dst_tcp, reply.tcp_token)
            if entry.ending is not None:  # ended while negotiating (shutdown, abort)
                raise TransferAbortedError(f"push of {request_id!r} ended: {entry.ending[1]}",
                                           request_id=request_id, peer=dst_instance)
        except (ProtocolError, TransferAbortedError) as exc:
            await core.request_abort(dst_instance, transfer.transfer_id, str(exc))
            _fail(transfer, exc)
            raise
        if reply.skip:
            handle.blocks = blocks.without(reply.skip)
            shrink(transfer, mem, len(blocks), len(handle.blocks))
            core.count("bytes_skipped", transfer.bytes_skipped)
            if not handle.blocks:
                core.complete_empty(transfer)
                return handle
        core.paths.record(transfer, reply.path, peer_host)
        stream = SendStream(core.env(reply.path), handle,
                            peer_address=reply.dst_tcp if reply.path == "tcp" else reply.dst_address,
                            src_tag=src_tag, dst_tag=reply.dst_tag,
                            dst_contiguous=is_run(without(reply.dst_blocks, reply.skip)),
                            mapped=reply.path in ("shm", "cuda_ipc"), path=reply.path)
        core.run_stream(entry, stream, timeout)
        return handle

    def _reshape(self, dst: str, src_ids: list[int], dst_blocks: Sequence[int] | None,
                 tokens: int | None, codec: str) -> Reshape | None:
        """The plan into a destination whose layout or TP share differs (None: equal).
        ``tokens`` defaults to what both ends' blocks hold."""
        core = self.core
        mem = core.mem()
        ann = core.registry.announced(dst)
        if ann is None or ann.layout is None or \
                not needs_reshape(mem.layout, core.config.tp, ann.layout, ann.tp or TpInfo()):
            if tokens is not None and tokens > len(src_ids) * mem.layout.block_size:
                raise InvalidBlockError(f"{tokens} tokens do not fit in {len(src_ids)} blocks")
            return None
        if codec != "none":
            # A codec's wire has its own fingerprint (any engine dtype of one layout
            # decodes it); the destination checks it, as between equal layouts.
            return None
        have = len(src_ids) * mem.layout.block_size
        if tokens is None:
            tokens = have if dst_blocks is None else \
                min(have, len(dst_blocks) * ann.layout.block_size)
        if not 0 < tokens <= have or mem.layout.blocks_for_tokens(tokens) != len(src_ids):
            raise InvalidBlockError(f"{len(src_ids)} blocks of {mem.layout.block_size} do not "
                                    f"hold exactly {tokens} tokens", block_ids=src_ids)
        return reshape_between(mem.layout, core.config.tp, ann.layout, ann.tp or TpInfo(),
                               tokens, single=mem.device.type == "cpu" and ann.kv_device == "cpu")

    @staticmethod
    def _check_reply(reply: m.ControlUnion, transfer: Transfer, dst: str,
                     registry: Registry, transport: Transport) -> None:
        if isinstance(reply, m.Reject):
            raise REJECT_ERRORS.get(reply.code, TransferError)(
                f"{dst} refused transfer for {transfer.request_id!r}: {reply.reason}")
        if not isinstance(reply, m.Accept) or reply.transfer_id != transfer.transfer_id:
            raise ProtocolError(f"unexpected answer to a manifest: {type(reply).__name__}")
        transport.check_address(reply.dst_address)  # ProtocolError: before UCX sees it
        if not registry.address_ok(dst, reply.dst_address):
            raise ProtocolError(f"{dst} accepted with another worker address than it announces")

    async def _offer(self, manifest: m.Manifest, dst: str,
                     headers: dict[str, str] | None = None) -> m.ControlUnion:
        """Send the manifest; while the destination answers "busy" (no reservation yet and a
        full staging pool) back off and retry, for at most ``staging_wait_s``."""
        core = self.core

        async def ask() -> m.ControlUnion:
            return await core.control.request(
                core.subjects.control(dst), manifest, timeout=core.config.request_timeout_s,
                peer=dst, headers=headers)

        if core.config.staging_wait_s > 0:  # the common case, without a retry loop's setup
            first = await ask()
            if not (isinstance(first, m.Reject) and first.code == "busy"):
                return first
        reply: m.ControlUnion | None = None
        try:
            async for attempt in stamina.retry_context(
                    on=_Busy, attempts=None, timeout=core.config.staging_wait_s,
                    wait_initial=0.01, wait_max=0.25, wait_jitter=0.01):
                with attempt:
                    reply = await ask()
                    if isinstance(reply, m.Reject) and reply.code == "busy":
                        raise _Busy(reply.reason)
        except _Busy as exc:
            raise TransferError(f"{dst} stayed busy for {core.config.staging_wait_s}s: {exc}",
                                request_id=manifest.request_id, peer=dst) from None
        if reply is None:  # stamina ran no attempt (a zero staging_wait_s)
            raise TransferError(f"{dst} was not asked: staging_wait_s is 0",
                                request_id=manifest.request_id, peer=dst)
        return reply


def _fail(transfer: Transfer, exc: BaseException) -> None:
    """End a push that never streamed; the caller's exception says why."""
    if isinstance(exc, Exception):
        cause = EndCause.REFUSED if isinstance(exc, TransferError) and "refused" in str(exc) \
            else EndCause.ERROR
        transfer.finish(TransferState.FAILED, str(exc), cause)
    else:
        transfer.finish(TransferState.FAILED, str(TransferAbortedError(
            "push cancelled by the caller")), EndCause.ENGINE_ABORT)

