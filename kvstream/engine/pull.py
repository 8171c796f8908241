"""Pulls, the destination side: ask the source, check its manifest, receive.

One job: send the ``Pull``, check the manifest the source answers with, take over a lease
kept for the same request, and start the receive stream (eager, or lazy: a layer when
the engine waits for it). The data moves exactly as in a push; only who sends the
manifest differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import anyio
import msgspec
from opentelemetry.trace import SpanKind

from kvstream import telemetry
from kvstream._exceptions import (
    ConfigError,
    IncompatiblePeerError,
    InvalidBlockError,
    KVStreamError,
    NoPeerError,
    ProtocolError,
    TransferAbortedError,
    TransferError,
)
from kvstream.config import check_timeout
from kvstream.control import messages as m
from kvstream.control.subjects import Subjects
from kvstream.dataplane import wire
from kvstream.dataplane.recv import RecvStream
from kvstream.dataplane.stream import frame_refusal
from kvstream.engine.rules import (
    PULL_MODES,
    REJECT_ERRORS,
    check_mode,
    check_skip,
    layout_mismatch,
    needs_reshape,
    part_mismatch,
    reshape_between,
    shrink,
    without,
)
from kvstream.layout import FP8_DTYPES
from kvstream.memory import is_run
from kvstream.quant.scheme import effective_codec, wire_fingerprint, wire_layer_bytes
from kvstream.transfer.handles import ReceiveHandle
from kvstream.transfer.plan import Reshape, TpInfo
from kvstream.transfer.state import Side, Transfer, TransferState

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from kvstream.engine.book import Entry
    from kvstream.engine.core import Core
    from kvstream.engine.paths import Choice
    from kvstream.memory import BlockMap
    from kvstream.shm import SharedExport

__all__ = ["Puller"]


class Puller:
    def __init__(self, core: Core) -> None:
        self.core = core

    async def pull(self, request_id: str, src_instance: str, dst_blocks: Sequence[int],
                   *, mode: str = "eager", have: Iterable[int] = (), lookahead: int = 1,
                   timeout: float | None = None, codec: str | None = None,
                   trace_context: Context | None = None, secret: str = "",
                   tokens: int | None = None, part: Reshape | None = None,
                   readers: int = 1) -> ReceiveHandle:
        """``part``: the heads to ask for, one part of a gather (engine/gather.py);
        ``readers``: how many destinations pull the offer (engine/offers.py)."""
        core = self.core
        mem = core.mem()
        if isinstance(readers, bool) or not isinstance(readers, int) or \
                not 1 <= readers <= m.MAX_READERS:
            raise ConfigError(f"readers is 1 to {m.MAX_READERS}, got {readers!r}")
        want_codec = effective_codec(codec or core.config.codec, mem.layout)
        if want_codec not in core.config.accept_codecs:
            raise ConfigError(f"codec {want_codec!r} is not in this agent's accept_codecs "
                              f"({', '.join(core.config.accept_codecs)})")
        check_mode(mode, PULL_MODES)
        Subjects.check_instance_id(src_instance)
        check_timeout(timeout)
        blocks = mem.block_map(dst_blocks, what="destination block")
        reshape = self._reshape(src_instance, len(blocks), tokens, want_codec) \
            if part is None else self._part(src_instance, part, len(blocks))
        entry = core.book.pull(src_instance, request_id, core.clock(), secret)
        entry.readers = readers  # of the offer at the source
        span = telemetry.open_span("kvstream.pull", parent=trace_context, kind=SpanKind.CONSUMER,
                                   request_id=request_id, side="recv", peer=src_instance,
                                   mode=mode, codec=want_codec, blocks=len(blocks))
        try:
            return await self._pull(entry, span, blocks, mode, [] if reshape else list(have),
                                    lookahead, timeout or core.config.transfer_timeout_s,
                                    want_codec, reshape)
        except BaseException as exc:
            telemetry.end_untracked(span, exc)
            core.book.drop(entry)  # never got its transfer (or it already ended)
            raise

    def _reshape(self, src: str, nblocks: int, tokens: int | None,
                 codec: str) -> Reshape | None:
        """The plan from a source whose layout or TP share differs (None: equal)."""
        core = self.core
        mem = core.mem()
        ann = core.registry.announced(src)
        if ann is None or ann.layout is None or \
                not needs_reshape(ann.layout, ann.tp or TpInfo(), mem.layout, core.config.tp):
            return None
        if codec != "none":
            # A codec's wire has its own fingerprint (any engine dtype of one layout
            # decodes it); the destination checks it, as between equal layouts.
            return None
        have = nblocks * mem.layout.block_size
        tokens = have if tokens is None else tokens
        if not 0 < tokens <= have or mem.layout.blocks_for_tokens(tokens) != nblocks:
            raise InvalidBlockError(f"{nblocks} blocks of {mem.layout.block_size} do not hold "
                                    f"exactly {tokens} tokens")
        return reshape_between(ann.layout, ann.tp or TpInfo(), mem.layout, core.config.tp,
                               tokens, single=mem.device.type == "cpu" and ann.kv_device == "cpu")

    def _part(self, src: str, part: Reshape, nblocks: int) -> Reshape:
        """A gather's part, checked against what ``src`` announces, with its framing."""
        core = self.core
        mem = core.mem()
        ann = core.registry.announced(src)
        if ann is None or ann.layout is None:
            raise NoPeerError(f"{src} announces no KV layout", peer=src)
        if mem.layout.blocks_for_tokens(part.tokens) != nblocks:
            raise InvalidBlockError(f"{nblocks} blocks of {mem.layout.block_size} do not hold "
                                    f"exactly {part.tokens} tokens")
        why = part_mismatch(part, ann.layout, ann.tp or TpInfo(), mem.layout, core.config.tp)
        if why is not None:
            raise IncompatiblePeerError(why)
        return msgspec.structs.replace(
            part, single=mem.device.type == "cpu" and ann.kv_device == "cpu")

    async def _ask(self, entry: Entry, span: Span, blocks: BlockMap, mode: str,
                   have: list[int], deadline: float, want_codec: str,
                   dst_tag: int, path: str, reshape: Reshape | None) -> m.ControlUnion:
        core = self.core
        mem = core.mem()
        src = entry.peer
        try:
            with telemetry.step(span, "kvstream.manifest", peer=src):
                return await core.control.request(
                    core.subjects.control(src),
                    m.Pull(request_id=entry.request_id, src=src, dst=core.instance_id,
                           dst_address=core.transport.address, dst_tag=dst_tag,
                           fingerprint=mem.layout.fingerprint, num_layers=mem.layout.num_layers,
                           dst_blocks=blocks.ids, have=have, mode=mode,  # type: ignore[arg-type]
                           deadline_s=deadline, codec=want_codec,
                           wire_fingerprint=wire_fingerprint(mem.layout, want_codec),
                           secret=entry.secret, path=path,  # type: ignore[arg-type]
                           dst_host=core.paths.host, dst_tcp=core.paths.tcp_address,
                           tcp_token=core.paths.tcp_token(src) if path == "tcp" else b"",
                           reshape=reshape, dst_layout=mem.layout if reshape else None,
                           dst_tp=core.config.tp if reshape else None,
                           readers=max(1, entry.readers)),
                    timeout=core.config.request_timeout_s, peer=src,
                    headers=telemetry.headers_of(span))
        except BaseException as exc:
            # The source may have started sending anyway: stop it (and the offer) rather than
            # leave it waiting for credits that never come.
            if not (isinstance(exc, NoPeerError) and exc.no_responders):
                with anyio.CancelScope(shield=True), \
                        anyio.move_on_after(core.config.request_timeout_s):
                    await core.request_abort(src, "", f"pull failed: {exc!r}",
                                             request_id=entry.request_id, secret=entry.secret)
            raise

    def _check(self, reply: m.ControlUnion, entry: Entry, nblocks: int,
               want_codec: str, reshape: Reshape | None) -> m.Manifest:
        core, src, rid = self.core, entry.peer, entry.request_id
        if isinstance(reply, m.Reject):
            telemetry.count_refused("recv", reply.code)
            kind = REJECT_ERRORS.get(reply.code, TransferError)
            raise kind(f"{src} refused the pull of {rid!r}: {reply.reason}")
        if not isinstance(reply, m.Manifest) or reply.request_id != rid \
                or reply.dst != core.instance_id or not reply.transfer_id \
                or (len(reply.src_blocks) != nblocks and reshape is None):
            raise ProtocolError(f"unexpected answer to a pull: {type(reply).__name__}")
        core.transport.check_address(reply.src_address)  # ProtocolError: before UCX sees it
        if not core.registry.address_ok(src, reply.src_address):
            raise ProtocolError(f"{src} answered with another worker address than it announces")
        if reshape is not None or reply.reshape is not None:
            return self._check_reshape(reply, entry, nblocks, reshape)
        check_skip(reply.skip, nblocks)
        asked = reply.codec in (want_codec, "none")
        why = layout_mismatch(core.mem(), reply.fingerprint, reply.num_layers, reply.codec,
                                         reply.cache_scales)
        if not asked or reply.codec not in core.config.accept_codecs or why:
            raise IncompatiblePeerError(
                f"{src} answered the pull of {rid!r} with codec {reply.codec!r}: "
                f"{why if asked else 'not asked for'}")
        if entry.ending is not None:  # ended while asking (shutdown, unregister)
            raise TransferAbortedError(f"pull of {rid!r} ended: {entry.ending[1]}",
                                       request_id=rid, peer=src)
        return reply

    def _check_frames(self, manifest: m.Manifest, lazy: bool, nblocks: int) -> None:
        """The source's framing, if this side can take it."""
        core = self.core
        mem = core.mem()
        layer_bytes = manifest.reshape.layer_bytes(mem.layout) if manifest.reshape else \
            wire_layer_bytes(mem.layout, manifest.codec, nblocks)
        why = frame_refusal(manifest.frame_layers, mem.layout.num_layers,
                            host_memory=mem.device.type == "cpu", lazy=lazy,
                            frame_bytes=layer_bytes * mem.layout.num_layers,
                            staging_bytes=core.staging.max_bytes)
        if why is not None:
            raise IncompatiblePeerError(f"{manifest.src} answered with framing this side "
                                        f"cannot take: {why}")

    def _check_reshape(self, reply: m.Manifest, entry: Entry, nblocks: int,
                       asked: Reshape | None) -> m.Manifest:
        """A reshaped answer: the plan this side derives for the tokens the source holds."""
        core, src = self.core, entry.peer
        mem, r = core.mem(), reply.reshape
        why = None
        if asked is None or r is None or reply.src_layout is None:
            why = "a reshape neither asked for nor answered"
        elif reply.skip or reply.codec != "none" or r.tokens > asked.tokens or \
                mem.layout.blocks_for_tokens(r.tokens) != nblocks:
            why = f"the plan {r} does not fill the {nblocks} blocks asked for {asked.tokens} tokens"
        elif reply.num_layers != mem.layout.num_layers:
            why = f"{reply.num_layers} layers against {mem.layout.num_layers}"
        elif mem.layout.dtype in FP8_DTYPES and list(reply.cache_scales) != mem.cache_scales:
            why = "other FP8 cache scales than here: the bytes would mean other values"
        elif msgspec.structs.replace(r, tokens=asked.tokens, single=asked.single) != asked:
            why = f"the plan {r}, asked {asked}"
        else:
            why = part_mismatch(r, reply.src_layout, reply.src_tp or TpInfo(), mem.layout,
                                core.config.tp)
            if why is None and r.single and mem.device.type != "cpu":
                why = "one-message framing, with KV on a GPU here"
        if why is not None:
            raise IncompatiblePeerError(f"{src} answered the pull of {entry.request_id!r} "
                                        f"with {why}")
        if entry.ending is not None:
            raise TransferAbortedError(f"pull of {entry.request_id!r} ended: {entry.ending[1]}",
                                       request_id=entry.request_id, peer=src)
        return reply

    def _path(self, manifest: m.Manifest, choice: Choice,
              mapped: SharedExport | None) -> tuple[str, bytes]:
        """The path the source answered (ours, or plain UCX) and the address to use on it."""
        path = manifest.path
        if path != choice.path and path != "ucx":
            raise ProtocolError(f"{manifest.src} answered on path {path!r}, asked {choice.path!r}")
        if path == "shm":
            if manifest.src_shared != mapped or not choice.holds(
                    manifest.src_secrets, manifest.src, manifest.dst, manifest.transfer_id):
                raise ProtocolError(f"{manifest.src}'s shared KV is not what it announced, "
                                    "or not its own")
            if (why := choice.refusal(manifest.src_blocks)) is not None:
                raise ProtocolError(why)
        if path == "tcp":
            if manifest.src_tcp != choice.tcp:
                raise ProtocolError(f"{manifest.src} answered with another TCP address")
            self.core.paths.trust_tcp(manifest.src, choice.tcp, manifest.tcp_token)
            return path, choice.tcp
        return path, manifest.src_address

    async def _pull(self, entry: Entry, span: Span, blocks: BlockMap, mode: str,
                    have: list[int], lookahead: int, deadline: float,
                    want_codec: str, reshape: Reshape | None) -> ReceiveHandle:
        core = self.core
        src = entry.peer
        ann = core.registry.announced(src)
        choice = await core.paths.choose(
            peer=src, peer_host=ann.host if ann else "", peer_tcp=ann.tcp if ann else b"",
            peer_shared=ann.shared if ann else None, mem=core.mem(),
            codec="reshape" if reshape else want_codec,  # a reshape stages: no mapped path
            peer_offer=ann.cuda_ipc if ann else None)
        try:
            return await self._stream(entry, span, blocks, mode, have, lookahead, deadline,
                                      want_codec, choice, ann.shared if ann else None, reshape)
        finally:
            choice.release()  # unless the stream took it

    async def _stream(self, entry: Entry, span: Span, blocks: BlockMap, mode: str,
                      have: list[int], lookahead: int, deadline: float, want_codec: str,
                      choice: Choice, mapped: SharedExport | None,
                      reshape: Reshape | None) -> ReceiveHandle:
        core = self.core
        src, request_id = entry.peer, entry.request_id
        dst_tag = wire.new_xfer_tag()
        try:
            reply = await self._ask(entry, span, blocks, mode, have, deadline, want_codec,
                                    dst_tag, choice.path, reshape)
            try:
                manifest = self._check(reply, entry, len(blocks), want_codec, reshape)
                self._check_frames(manifest, mode == "lazy", len(blocks))
                path, peer_address = self._path(manifest, choice, mapped)
                if path == "cuda_ipc":
                    mem = core.mem()
                    ann = core.registry.announced(src)
                    await choice.open(src, manifest.src_device, ann.cuda_ipc if ann else None, mem)
                    if (why := choice.refusal(manifest.src_blocks)) is not None:
                        raise ProtocolError(why)
                    if entry.ending is not None or core.memory is not mem:
                        raise TransferAbortedError(f"pull of {request_id!r} ended while its "
                                                   "source was opened", request_id=request_id,
                                                   peer=src)
            except KVStreamError:  # a bad answer, or the source's device KV not opened here
                if isinstance(reply, m.Manifest) and reply.transfer_id:
                    await core.request_abort(src, reply.transfer_id, "bad pull answer")
                raise
            mem = core.mem()
            t = Transfer(transfer_id=manifest.transfer_id, request_id=request_id,
                         side=Side.RECV, peer=src, num_layers=mem.layout.num_layers,
                         layer_bytes=0, clock=core.clock)
        except BaseException:
            wire.release_xfer_tag(dst_tag)
            raise
        t.on_release(lambda: wire.release_xfer_tag(dst_tag))  # from here on the tag is t's
        kept_lease = core.book.leases.get((src, request_id))
        if kept_lease is not None:  # kept before or during the pull: taken over
            core.book.release_lease(kept_lease)
            kept_lease.handle._hand_over()
        core.book.note_lease(src, manifest.lease_s)
        core.registry.contact(src)
        kept = blocks.without(manifest.skip)
        t.codec = manifest.codec
        t.reshape = manifest.reshape
        t.frame_layers = manifest.frame_layers
        telemetry.trace_transfer(t, span)
        span.set_attribute("kvstream.transfer_id", t.transfer_id)
        shrink(t, mem, len(blocks), len(kept))
        t.deadline_s = deadline
        core.count("bytes_skipped", t.bytes_skipped)
        handle = ReceiveHandle(t, core.aborter(entry), blocks=kept, lazy=mode == "lazy",
                               lookahead=lookahead)
        core.track(entry, handle)
        if not kept:
            core.complete_empty(t, handle)
            return handle
        core.paths.record(t, path, manifest.src_host)
        try:
            src_kept = without(manifest.src_blocks, manifest.skip)
            source = choice.source(src_kept, mem) if path in ("shm", "cuda_ipc") else None
            if source is not None:
                t.on_release(source.release)
            stream = RecvStream(core.env(path), handle, peer_address=peer_address,
                                src_tag=manifest.src_tag, dst_tag=dst_tag,
                                src_contiguous=is_run(src_kept), nblocks=len(kept),
                                source=source, path=path)
        except Exception as exc:  # e.g. the memory was unregistered meanwhile
            t.finish(TransferState.FAILED, str(exc))
            await core.request_abort(src, t.transfer_id, str(exc))
            raise
        core.run_stream(entry, stream, deadline)
        return handle
