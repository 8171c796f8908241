"""Admission, the decode side of a push: reservations and what arrives for them.

One job: ``expect()`` reserves blocks for a request; a manifest (the offer of a push) is
checked against registered memory and the layout, then bound to its reservation, or held
whole in the bounded staging pool until ``expect()`` claims it, or refused with a reason.

A push nobody reserved for ("unsolicited") may come from anyone with a key, and keys are
free to mint: what such pushes hold is bounded apart from what this agent expects (table
entries in the book, staging bytes here; in all and per sender), so reservations, pulls and
pushes never wait for, or fail because of, strangers' staged pushes.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from opentelemetry.trace import SpanKind

from kvstream import telemetry
from kvstream._exceptions import CapacityError, InvalidBlockError, ProtocolError
from kvstream.control import messages as m
from kvstream.control.subjects import Subjects
from kvstream.dataplane import wire
from kvstream.dataplane.recv import RecvStream
from kvstream.dataplane.reshape import layer_bytes_of
from kvstream.dataplane.stream import frame_refusal, frames_of, single_message_for
from kvstream.engine.book import Kind
from kvstream.engine.rules import (
    layout_mismatch,
    peer_refusal,
    reshape_refusal,
    shrink,
    without,
)
from kvstream.memory import is_run
from kvstream.prefix import skipped_indices
from kvstream.quant.scheme import wire_layer_bytes
from kvstream.transfer.handles import ReceiveHandle
from kvstream.transfer.state import EndCause, Side, Transfer, TransferState

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from kvstream.engine.book import Entry
    from kvstream.engine.core import Core
    from kvstream.engine.paths import Choice
    from kvstream.memory import RegisteredKV

    Reject = Callable[[m.RejectCode, str], m.Reject]

__all__ = ["Admission"]

log = logging.getLogger("kvstream.agent")


def _trace(t: Transfer, msg: m.Manifest, headers: dict[str, str] | None) -> None:
    """The receive side's span, a child of the sender's push span (NATS headers)."""
    telemetry.trace_transfer(t, telemetry.open_span(
        "kvstream.receive", parent=telemetry.context_from(headers), kind=SpanKind.CONSUMER,
        request_id=msg.request_id, transfer_id=msg.transfer_id, side="recv", peer=msg.src,
        mode=msg.mode, codec=msg.codec, blocks=len(msg.src_blocks)))


# Transfer ids of the manifests taken lately: a replayed one (a copy of a signed message
# someone captured) is refused as a duplicate, not staged again.
SEEN_TRANSFERS = 1 << 16


class Admission:
    def __init__(self, core: Core) -> None:
        self.core = core
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        cfg, book = core.config, core.book
        # The book's own bounds for unsolicited pushes, from the config (AgentConfig says why).
        book.max_staged = max(1, int(cfg.max_transfers * cfg.unsolicited_transfers_share))
        book.max_staged_per_peer = max(1, int(book.max_staged * cfg.unsolicited_sender_share
                                              / cfg.unsolicited_staging_share))

    def _unsolicited_refusal(self, src: str, need: int) -> str | None:
        """Why a push from ``src`` nobody reserved for, needing ``need`` bytes of staging,
        may not be staged now (counted), if so: beyond the share of all unsolicited pushes,
        or beyond ``src``'s own share (its first may be larger, within the share of all)."""
        core = self.core
        pool = core.staging.max_bytes
        limit = int(pool * core.config.unsolicited_staging_share)
        mine = core.book.unsolicited(src).nbytes
        if mine and mine + need > int(pool * core.config.unsolicited_sender_share):
            core.count("refused_unsolicited_sender", 1)
            why = (f"{src} already holds {mine} B of staging here without reservations (at "
                   f"most {core.config.unsolicited_sender_share:.1%} of {pool} B per sender)")
        elif core.book.unsolicited().nbytes + need > limit:
            why = (f"pushes nobody reserved for hold {core.book.unsolicited().nbytes} B of "
                   f"staging here; {need} B more would pass their {limit} B share")
        else:
            return None
        core.count("refused_unsolicited", 1)
        return why

    def _taken(self, transfer_id: str) -> None:
        """This manifest was accepted: a copy of it later is a replay."""
        self._seen[transfer_id] = None
        if len(self._seen) > SEEN_TRANSFERS:
            self._seen.popitem(last=False)

    def expect(self, request_id: str, dst_blocks: Sequence[int], *, src: str,
               have: Iterable[int] = ()) -> ReceiveHandle:
        """Only ``src``'s push may land: a push from anyone else is refused."""
        core = self.core
        mem = core.mem()
        Subjects.check_instance_id(src)
        current = core.book.receiving.get(request_id)
        if current is not None and current.kind is Kind.STAGED:
            if current.peer == src and have:
                # A staged push holds every block, and claiming writes them all: it would
                # overwrite the blocks the engine has already (shared, prefix-cached).
                core.end(current, TransferState.ABORTED, "staged whole, but the engine has "
                         "some of its blocks already", EndCause.ENGINE_ABORT)
                raise InvalidBlockError(f"the push staged for {request_id!r} cannot skip the "
                                        "blocks the engine has: dropped")
            if current.peer == src:
                return self._claim(current, mem, dst_blocks)
            core.count("forbidden", 1)  # staged by another source: it never lands here
            core.end(current, TransferState.ABORTED, f"staged by {current.peer}, not by the "
                     f"expected {src}", EndCause.ENGINE_ABORT)
        blocks = mem.block_map(dst_blocks, what="destination block")
        entry = core.book.reserve(request_id, core.clock())
        entry.expect_from = src
        transfer = Transfer(transfer_id="", request_id=request_id, side=Side.RECV, peer="",
                            num_layers=mem.layout.num_layers,
                            layer_bytes=mem.planes * mem.plane_bytes(len(blocks)),
                            clock=core.clock)
        handle = ReceiveHandle(transfer, core.aborter(entry), blocks=blocks,
                               have=frozenset(have))
        core.track(entry, handle)
        return handle

    def _claim(self, entry: Entry, mem: RegisteredKV, dst_blocks: Sequence[int]
               ) -> ReceiveHandle:
        """The engine reserves blocks for a push already (partly) staged: move it in."""
        stream: RecvStream = entry.runner
        blocks = mem.block_map(dst_blocks, what="destination block")
        if len(blocks) != stream.nblocks or (entry.promised and entry.promised != blocks.ids):
            promised = f" for {entry.promised}" if entry.promised else ""
            raise InvalidBlockError(
                f"the push staged for {entry.request_id!r} carries {stream.nblocks} blocks "
                f"per layer{promised}; got {blocks.ids}", block_ids=blocks.ids,
                limit=mem.num_blocks)
        self.core.book.bind(entry, entry.transfer_id, entry.peer)
        stream.claim(blocks)
        return stream.handle

    async def on_manifest(self, msg: m.Manifest,
                          headers: dict[str, str] | None = None) -> m.ControlMessage:
        def reject(code: m.RejectCode, reason: str) -> m.Reject:
            log.warning("rejected transfer %s from %s: %s", msg.transfer_id, msg.src, reason)
            return m.Reject(transfer_id=msg.transfer_id, code=code, reason=reason)

        core = self.core
        mem = core.memory
        if mem is None:
            return reject("no_reservation", f"{core.instance_id} has no registered KV memory")
        if msg.dst != core.instance_id:
            core.count("forbidden", 1)
            return reject("forbidden", f"the manifest is for {msg.dst}, not for this instance")
        if msg.codec not in core.config.accept_codecs:
            return reject("incompatible", f"codec {msg.codec!r} is not accepted here "
                          f"(AgentConfig.accept_codecs: {', '.join(core.config.accept_codecs)})")
        if msg.reshape is not None:
            if (why := reshape_refusal(msg, mem, core.config.tp)) is not None:
                return reject("incompatible", why)
        elif (why := layout_mismatch(mem, msg.fingerprint, msg.num_layers, msg.codec,
                                     msg.cache_scales)) is not None:
            return reject("incompatible", why)
        refused = peer_refusal(msg.src, msg.src_address, core.registry, core.transport,
                               "manifest")
        if refused is not None:
            core.count("forbidden", int(refused[0] == "forbidden"))
            return reject(*refused)
        # Before the book is looked at: the first choice with a peer may map its memory.
        # Only the memory the sender announces as its own is read (and only with its proof).
        announced = core.registry.announced(msg.src)
        shared = msg.src_shared if announced is None or announced.shared == msg.src_shared \
            else None
        choice = await core.paths.choose(peer=msg.src, peer_host=msg.src_host,
                                         peer_tcp=msg.src_tcp, peer_shared=shared,
                                         mem=mem, codec=_framing(msg), proofs=msg.src_secrets,
                                         transfer_id=msg.transfer_id,
                                         peer_device=msg.src_device,
                                         peer_offer=announced.cuda_ipc if announced else None)
        try:
            if core.memory is not mem:
                return reject("no_reservation", f"{core.instance_id}'s KV memory changed")
            if choice.path == "tcp":  # our credits go to its port: with its token
                try:
                    core.paths.trust_tcp(msg.src, choice.tcp, msg.tcp_token)
                except ProtocolError as exc:
                    return reject("incompatible", str(exc))
            return self._admit(msg, headers, mem, choice, reject)
        finally:
            choice.release()  # unless a stream took it

    def _admit(self, msg: m.Manifest, headers: dict[str, str] | None, mem: RegisteredKV,
               choice: Choice, reject: Reject) -> m.ControlMessage:
        core = self.core
        if msg.transfer_id in core.book.streams or msg.transfer_id in self._seen:
            return reject("duplicate", f"transfer {msg.transfer_id} was offered here before")
        entry = core.book.receiving.get(msg.request_id)
        if entry is not None and entry.kind is not Kind.RESERVATION:
            return reject("duplicate", f"request {msg.request_id!r} already has a "
                          f"{'staged ' if entry.kind is Kind.STAGED else ''}push")
        if not msg.src_blocks or (len(msg.src_blocks) > mem.num_blocks and msg.reshape is None):
            return reject("invalid_blocks", f"{len(msg.src_blocks)} blocks per layer cannot land "
                          f"in {mem.num_blocks} registered blocks")
        if len(msg.block_hashes) > len(msg.src_blocks):
            return reject("malformed", f"{len(msg.block_hashes)} block hashes for "
                          f"{len(msg.src_blocks)} blocks")
        if (why := choice.refusal(msg.src_blocks)) is not None:
            return reject("invalid_blocks", why)
        if (why := frame_refusal(msg.frame_layers, msg.num_layers,
                                 host_memory=mem.device.type == "cpu", lazy=False,
                                 frame_bytes=_layer_bytes(msg, mem) * msg.num_layers,
                                 staging_bytes=core.staging.max_bytes)) is not None:
            return reject("incompatible", f"framing: {why}")
        if entry is None:
            return self._stage(msg, headers, mem, choice, reject)
        if msg.src != entry.expect_from:
            core.count("forbidden", 1)
            return reject("forbidden", f"{msg.request_id!r} is expected from "
                          f"{entry.expect_from}, not from {msg.src}")
        handle: ReceiveHandle = entry.handle
        full = handle.blocks
        assert full is not None  # a reservation always has its blocks
        if _dst_count(msg, mem) != len(full) or (msg.dst_blocks and msg.dst_blocks != full.ids):
            return reject("invalid_blocks", f"{len(msg.src_blocks)} source blocks do not map "
                          f"onto the {len(full)} blocks reserved for {msg.request_id!r}")
        core.book.bind(entry, msg.transfer_id, msg.src)
        t = handle.transfer
        t.transfer_id, t.peer, t.codec = msg.transfer_id, msg.src, msg.codec
        t.reshape = msg.reshape
        t.layer_bytes = layer_bytes_of(mem, t, len(msg.src_blocks))
        t.frame_layers = msg.frame_layers
        _trace(t, msg, headers)
        t.started_at = core.clock()  # the transfer deadline counts from the offer
        skip = skipped_indices(msg.block_hashes, handle.have)
        if skip:
            handle.blocks = full.without(skip)
            shrink(t, mem, len(full), len(handle.blocks))
            core.count("bytes_skipped", t.bytes_skipped)
            if not handle.blocks:
                self._taken(msg.transfer_id)
                core.complete_empty(t, handle)
                return m.Accept(transfer_id=msg.transfer_id, dst_tag=0,
                                dst_address=core.transport.address, dst_blocks=full.ids,
                                skip=skip)
        return self._start(entry, msg, handle, full.ids, skip, None, choice)

    def _stage(self, msg: m.Manifest, headers: dict[str, str] | None, mem: RegisteredKV,
               choice: Choice, reject: Reject) -> m.ControlMessage:
        """No reservation yet: hold the whole push in staging until the engine claims it
        with expect(), or refuse at once when the bounded pool has no room (the sender
        backs off and retries for staging_wait_s)."""
        core = self.core
        if msg.reshape is not None:
            single = msg.reshape.single and mem.device.type == "cpu"
        else:
            single = choice.path not in ("shm", "cuda_ipc") and \
                single_message_for(mem, is_run(msg.src_blocks), False, msg.codec, choice.path,
                                   core.peer_on_cpu(msg.src))
        single = single or msg.frame_layers > 1
        layer_bytes = _layer_bytes(msg, mem)
        sizes = [len(frame) * layer_bytes + (wire.HEADER_CAPACITY if single else 0)
                 for frame in frames_of(msg.num_layers, msg.frame_layers)]
        need = sum(sizes)
        # "busy" in every case: the sender backs off and retries for staging_wait_s, in
        # time for the reservation perhaps (a manifest for a reserved request is no longer
        # unsolicited).
        if (why := self._unsolicited_refusal(msg.src, need)) is not None:
            return reject("busy", why)
        try:
            entry = core.book.stage(msg.request_id, msg.transfer_id, msg.src, core.clock(),
                                    promised=msg.dst_blocks, nbytes=need)
        except CapacityError as exc:
            core.count("refused_unsolicited", 1)
            core.count("refused_unsolicited_sender", int(exc.what.endswith("per sender")))
            return reject("busy", str(exc))
        slots = core.staging.try_acquire_all(sizes)  # charged exactly ``need``
        if slots is None:
            core.book.drop(entry)
            core.count("refused_unsolicited", 1)
            return reject("busy", f"no reservation for {msg.request_id!r} and the staging "
                          f"pool is full ({core.staging.in_use} of {core.staging.max_bytes} B)")
        t = Transfer(transfer_id=msg.transfer_id, request_id=msg.request_id, side=Side.RECV,
                     peer=msg.src, num_layers=msg.num_layers, layer_bytes=layer_bytes,
                     clock=core.clock)
        t.codec = msg.codec
        t.reshape = msg.reshape
        t.frame_layers = msg.frame_layers
        _trace(t, msg, headers)
        handle = ReceiveHandle(t, core.aborter(entry), blocks=None)
        core.track(entry, handle)
        return self._start(entry, msg, handle, [], [], dict(enumerate(slots)), choice)

    def _start(self, entry: Entry, msg: m.Manifest, handle: ReceiveHandle,
               accepted: list[int], skip: list[int],
               staged: dict[int, torch.Tensor] | None, choice: Choice) -> m.ControlMessage:
        core = self.core
        t = handle.transfer
        src_kept = without(msg.src_blocks, skip)
        source = choice.source(src_kept, core.mem())  # ids checked by _admit
        if source is not None:
            t.on_release(source.release)
        self._taken(msg.transfer_id)
        t.deadline_s = msg.deadline_s  # the sender's deadline holds on both sides
        core.paths.record(t, choice.path, msg.src_host)
        core.registry.contact(msg.src)
        dst_tag = core.new_tag(t)
        stream = RecvStream(core.env(choice.path), handle,
                            peer_address=choice.tcp if choice.path == "tcp" else msg.src_address,
                            src_tag=msg.src_tag, dst_tag=dst_tag,
                            src_contiguous=is_run(src_kept),
                            nblocks=len(src_kept) if msg.reshape is None else _dst_count(msg, core.mem()),
                            staged_slots=staged, source=source, path=choice.path)
        core.run_stream(entry, stream, msg.deadline_s)
        return m.Accept(transfer_id=msg.transfer_id, dst_tag=dst_tag,
                        dst_address=core.transport.address,
                        # A staged push answers [] so both sides derive the same framing.
                        dst_blocks=accepted, skip=skip, path=choice.path,  # type: ignore[arg-type]
                        dst_tcp=core.paths.tcp_address,
                        tcp_token=core.paths.tcp_token(msg.src) if choice.path == "tcp" else b"")


def _framing(msg: m.Manifest) -> str:
    """The codec the framing and the path choice see: a reshape stages both ends."""
    return "reshape" if msg.reshape is not None else msg.codec


def _layer_bytes(msg: m.Manifest, mem: RegisteredKV) -> int:
    """A layer's bytes on the wire, before any skip."""
    if msg.reshape is not None:
        return msg.reshape.layer_bytes(mem.layout)
    return wire_layer_bytes(mem.layout, msg.codec, len(msg.src_blocks))


def _dst_count(msg: m.Manifest, mem: RegisteredKV) -> int:
    """The destination blocks a manifest fills: one per source block, or as many as the
    reshaped tokens need here."""
    if msg.reshape is not None:
        return mem.layout.blocks_for_tokens(msg.reshape.tokens)
    return len(msg.src_blocks)
