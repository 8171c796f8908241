"""Offers, the source side of a pull: hold blocks under a lease, serve the pull, renew.

One job: ``offer()`` holds a request's blocks; a ``Pull`` is checked and answered with
the manifest, then the send stream runs; ``Renew`` keeps offers alive; an ``Abort`` by
request id ends an offer. Expiry and dead keepers are the book's rules (``tick``).
"""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
from opentelemetry.trace import SpanKind

from kvstream import telemetry
from kvstream._exceptions import CapacityError, ConfigError, ProtocolError
from kvstream.control import messages as m
from kvstream.dataplane.send import SendStream
from kvstream.dataplane.stream import frame_layers_for
from kvstream.engine.book import Kind, secret_matches
from kvstream.engine.rules import (
    PUSH_MODES,
    check_hashes,
    check_mode,
    layout_mismatch,
    part_mismatch,
    peer_refusal,
    shrink,
    without,
)
from kvstream.memory import is_run
from kvstream.prefix import skipped_indices
from kvstream.quant.scheme import effective_codec, wire_fingerprint
from kvstream.transfer.handles import SendHandle
from kvstream.transfer.plan import TpInfo
from kvstream.transfer.state import EndCause, Side, Transfer, TransferState

if TYPE_CHECKING:
    from kvstream.engine.core import Core
    from kvstream.engine.entry import Entry

__all__ = ["MIN_SECRET", "Offers", "check_secret"]

MIN_SECRET = 16  # characters: a caller's own secret is at least 16 (ours: 22, 128 bits)


def check_secret(secret: str) -> str:
    if not isinstance(secret, str) or not MIN_SECRET <= len(secret) <= 256:
        raise ConfigError(f"an offer's secret is a string of {MIN_SECRET} to 256 characters")
    return secret

log = logging.getLogger("kvstream.agent")


class Offers:
    def __init__(self, core: Core) -> None:
        self.core = core

    def offer(self, request_id: str, src_blocks: Sequence[int], *,
              block_hashes: Sequence[int] | None = None, mode: str = "pipelined",
              lease_s: float | None = None, secret: str | None = None,
              readers: int | None = None) -> SendHandle:
        """Only a pull that presents ``secret`` (made here when not given; the handle's
        ``secret``) gets the blocks: hand it to the destination with the request id.

        ``readers``: how many destinations pull it, each once (decode ranks sharing this
        rank's heads); None: as many as its first pull says. The handle completes when
        every reader has."""
        core = self.core
        secret = secrets.token_urlsafe(16) if secret is None else check_secret(secret)
        mem = core.mem()
        check_mode(mode, PUSH_MODES)
        blocks = mem.block_map(src_blocks, what="source block")
        hashes = check_hashes(block_hashes, len(blocks))
        lease = core.config.lease_s if lease_s is None else lease_s
        if not lease > 0:
            raise ConfigError("lease_s must be positive")
        if readers is not None and (isinstance(readers, bool) or not isinstance(readers, int)
                                    or not 1 <= readers <= m.MAX_READERS):
            raise ConfigError(f"readers is 1 to {m.MAX_READERS}, got {readers!r}")
        transfer_id = uuid.uuid4().hex
        entry = core.book.offer(request_id, transfer_id, lease, core.clock(), secret,
                                readers=readers or 0)
        t = Transfer(transfer_id=transfer_id, request_id=request_id, side=Side.SEND,
                     peer="", num_layers=mem.layout.num_layers,
                     layer_bytes=mem.planes * mem.plane_bytes(len(blocks)), clock=core.clock)
        handle = SendHandle(t, core.aborter(entry), eager=mode == "eager", blocks=blocks)
        handle.block_hashes = hashes
        handle.secret = secret
        core.track(entry, handle)
        return handle

    async def on_pull(self, msg: m.Pull, headers: dict[str, str] | None = None
                      ) -> m.ControlMessage:
        def reject(code: m.RejectCode, reason: str) -> m.Reject:
            log.warning("refused pull of %s by %s: %s", msg.request_id, msg.dst, reason)
            return m.Reject(transfer_id="", code=code, reason=reason)

        core = self.core
        mem = core.memory
        if msg.src != core.instance_id:
            core.count("forbidden", 1)
            return reject("forbidden", f"the pull is for {msg.src}, not for this instance")
        if mem is None:
            return reject("unknown_request", f"{core.instance_id} has no registered KV memory")
        try:
            codec = effective_codec(msg.codec, mem.layout)
        except ConfigError as exc:
            return reject("incompatible", str(exc))
        # Verbatim bytes need the same layout; a codec, the same wire format.
        theirs = msg.fingerprint if codec == "none" else msg.wire_fingerprint
        if msg.reshape is not None:
            if codec != "none" or msg.dst_layout is None or \
                    msg.num_layers != mem.layout.num_layers:
                return reject("incompatible", "a reshaped pull needs codec 'none', the puller's "
                              "layout and as many layers as here")
        elif (why := layout_mismatch(mem, theirs, msg.num_layers, codec)) is not None:
            return reject("incompatible", why)
        refused = peer_refusal(msg.dst, msg.dst_address, core.registry, core.transport, "pull")
        if refused is not None:
            core.count("forbidden", int(refused[0] == "forbidden"))
            return reject(*refused)
        entry = core.book.offers.get(msg.request_id)
        if entry is None or entry.kind is not Kind.OFFER:
            return reject("unknown_request", f"{core.instance_id} holds no KV for "
                          f"{msg.request_id!r} (never offered, expired, aborted or pulled)")
        if not secret_matches(entry, msg.secret):
            core.count("forbidden", 1)
            return reject("forbidden", f"the pull of {msg.request_id!r} does not carry the "
                          "offer's secret")
        if entry.readers and msg.readers != entry.readers:
            return reject("incompatible", f"{msg.request_id!r} is pulled by {entry.readers} "
                          f"readers; this pull says {msg.readers}")
        if entry.readers > 1 and (len(entry.children) >= entry.readers
                                  or any(c.peer == msg.dst for c in entry.children)):
            return reject("duplicate", f"{msg.dst} already pulled {msg.request_id!r}, or all "
                          f"its {entry.readers} readers did")
        offered: SendHandle = entry.handle
        full = offered.blocks
        reshape = None
        if msg.reshape is not None:
            assert msg.dst_layout is not None  # checked above
            # The tokens the offer holds, if fewer than asked (a partial last block).
            tokens = min(msg.reshape.tokens, len(full) * mem.layout.block_size)
            # Any consistent part of a plan: a destination gathering from several sources
            # asks each for only some of its heads.
            reshape = msgspec.structs.replace(
                msg.reshape, tokens=tokens, single=msg.reshape.single and mem.device.type == "cpu")
            why = part_mismatch(reshape, mem.layout, core.config.tp, msg.dst_layout,
                                msg.dst_tp or TpInfo())
            if why is not None:
                return reject("incompatible", why)
            if mem.layout.blocks_for_tokens(tokens) != len(full) or \
                    msg.dst_layout.blocks_for_tokens(tokens) != len(msg.dst_blocks):
                return reject("invalid_blocks", f"{len(full)} blocks offered and "
                              f"{len(msg.dst_blocks)} asked do not both hold {tokens} tokens")
        elif len(msg.dst_blocks) != len(full):
            return reject("invalid_blocks", f"{len(msg.dst_blocks)} destination blocks for the "
                          f"{len(full)} blocks offered for {msg.request_id!r}")
        skip = [] if reshape else skipped_indices(offered.block_hashes, msg.have)
        served = self._serve(entry, msg)
        if isinstance(served, m.Reject):
            return served
        entry, handle = served
        t = handle.transfer
        t.peer = msg.dst
        t.started_at = core.clock()  # the transfer deadline counts from the pull
        t.deadline_s = msg.deadline_s
        t.codec = codec
        t.reshape = reshape
        telemetry.trace_transfer(t, telemetry.open_span(
            "kvstream.serve_pull", parent=telemetry.context_from(headers),
            kind=SpanKind.PRODUCER, request_id=t.request_id, transfer_id=t.transfer_id,
            side="send", peer=msg.dst, codec=codec, blocks=len(full)))
        handle.blocks = full.without(skip)
        shrink(t, mem, len(full), len(handle.blocks))
        t.frame_layers = frame_layers_for(
            core.config, t.num_layers, t.layer_bytes * t.num_layers, lazy=msg.mode == "lazy",
            host_memory=mem.device.type == "cpu" and core.peer_on_cpu(msg.dst))
        if t.frame_layers > 1:
            handle.eager = True  # short: layer by layer costs more than it hides
        core.count("bytes_skipped", t.bytes_skipped)
        src_tag = core.new_tag(t)
        # The puller's pick, unless this instance does not offer it: then plain UCX.
        why = core.paths.refusal(msg.path, peer=msg.dst, peer_tcp=msg.dst_tcp, codec=codec)
        if why is None and msg.path == "tcp":
            try:  # our data goes to its port: with its token
                core.paths.trust_tcp(msg.dst, msg.dst_tcp, msg.tcp_token)
            except ProtocolError as exc:
                why = str(exc)
        if why is not None:
            log.info("the pull of %r asks for path %s: %s; sending over UCX", msg.request_id,
                     msg.path, why)
        if reshape is not None and msg.path in ("shm", "cuda_ipc"):
            why = "a reshape is packed and sent, not read in place"
        path = msg.path if why is None else "ucx"
        core.paths.record(t, path, msg.dst_host)
        manifest = m.Manifest(
            transfer_id=t.transfer_id, request_id=t.request_id, src=core.instance_id,
            dst=msg.dst, src_address=core.transport.address, src_tag=src_tag,
            fingerprint=wire_fingerprint(mem.layout, codec), num_layers=t.num_layers,
            src_blocks=full.ids, dst_blocks=list(msg.dst_blocks),
            mode="eager" if handle.eager else "pipelined", codec=codec,
            frame_layers=t.frame_layers,
            payload_bytes=t.layer_bytes * t.num_layers, deadline_s=msg.deadline_s,
            block_hashes=handle.block_hashes, skip=skip, skipped_bytes=t.bytes_skipped,
            lease_s=entry.lease_s, cache_scales=mem.cache_scales if codec == "none" else [],
            path=path, src_host=core.paths.host, src_tcp=core.paths.tcp_address,
            tcp_token=core.paths.tcp_token(msg.dst) if path == "tcp" else b"",
            src_shared=core.paths.shared if path == "shm" else None,
            src_secrets=core.paths.proofs(msg.dst, t.transfer_id) if path == "shm" else [],
            src_device=core.paths.device_for(msg.dst, path, codec),
            reshape=reshape, src_layout=mem.layout if reshape else None,
            src_tp=core.config.tp if reshape else None)
        core.registry.contact(msg.dst)
        if not handle.blocks:
            core.complete_empty(t)
            return manifest
        stream = SendStream(core.env(path), handle,
                            peer_address=msg.dst_tcp if path == "tcp" else msg.dst_address,
                            src_tag=src_tag, dst_tag=msg.dst_tag,
                            dst_contiguous=is_run(without(msg.dst_blocks, skip)),
                            mapped=path in ("shm", "cuda_ipc"), path=path)
        core.run_stream(entry, stream, msg.deadline_s)
        return manifest

    def _serve(self, entry: Entry, msg: m.Pull) -> tuple[Entry, SendHandle] | m.Reject:
        """The entry and handle that serve this pull: the offer itself, or for a shared
        offer a reader's own (its transfer, tag, blocks and stream; the offer's blocks and
        layer readiness)."""
        core = self.core
        readers = entry.readers or msg.readers
        if readers == 1:
            entry.readers = 1
            core.book.serve(entry, msg.dst, core.clock())
            return entry, entry.handle
        offered: SendHandle = entry.handle
        transfer_id = uuid.uuid4().hex
        try:  # a refused reader fixes nothing: the count is the first served one's
            child = core.book.serve_reader(entry, msg.dst, transfer_id, core.clock(), readers)
        except CapacityError as exc:
            return m.Reject(transfer_id="", code="busy", reason=str(exc))
        offered.transfer.shared = True
        t = Transfer(transfer_id=transfer_id, request_id=entry.request_id, side=Side.SEND,
                     peer=msg.dst, num_layers=offered.transfer.num_layers,
                     layer_bytes=offered.transfer.layer_bytes, clock=core.clock)
        handle = offered.reader(t, core.aborter(child))
        core.track(child, handle)
        return child, handle

    def on_renew(self, msg: m.Renew) -> m.ControlMessage:
        unknown, lease = self.core.book.renew(msg.by, msg.request_ids, msg.secrets,
                                              self.core.clock())
        if len(unknown) < len(msg.request_ids):  # only a keeper that renewed something
            self.core.registry.contact(msg.by)
        return m.RenewAck(unknown=unknown, lease_s=lease)

    def on_abort(self, msg: m.Abort) -> bool:
        """An Abort naming no running transfer, for an offer: its keeper gave it up, a pull
        failed after it was sent, or an operator (the proxy) released it. True if it ended
        the offer (only then is it worth waiting for its stream)."""
        core = self.core
        entry = core.book.offers.get(msg.request_id)
        if entry is None:
            return False
        reason = f"aborted by {msg.by}: {msg.reason}"
        if entry.kind is Kind.OFFER and msg.transfer_id in ("", entry.transfer_id):
            # Whoever holds the secret may end an offer nobody pulls yet; keepers other than
            # the sender learn now, not at their next renewal.
            if not secret_matches(entry, msg.secret):
                core.count("forbidden", 1)
                log.warning("refused an abort of the offer %r by %s: no secret",
                            msg.request_id, msg.by)
                return False
            core.end(entry, TransferState.ABORTED, reason, EndCause.PEER_ABORT,
                     tell=bool(entry.keepers - {msg.by}))
            return True
        if entry.kind is Kind.SERVE and not msg.transfer_id and entry.peer == msg.by:
            core.end(entry, TransferState.ABORTED, reason, EndCause.PEER_ABORT)
            return True
        return False
