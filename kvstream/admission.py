"""Admission: what the decode side does with a manifest (the offer of a push).

A mixin of ``Agent``, one job: check the offer against registered memory and the
layout, then bind it to the engine's reservation, or hold it whole in the bounded
staging pool until ``expect()`` claims it, or refuse it with a clear reason.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from opentelemetry.trace import SpanKind

from kvstream import telemetry
from kvstream._exceptions import ConfigError
from kvstream.control import messages as m
from kvstream.control.subjects import Subjects
from kvstream.dataplane import wire
from kvstream.dataplane.memory import is_run
from kvstream.handles import ReceiveHandle
from kvstream.prefix import skipped_indices
from kvstream.pulling import shrink, without
from kvstream.quant.scheme import wire_layer_bytes
from kvstream.streams import RecvStream, single_message_for
from kvstream.transfer import Side, Transfer

if TYPE_CHECKING:
    import torch

    from kvstream.agent import Agent

__all__ = ["Admission"]

log = logging.getLogger("kvstream.agent")


def _trace(t: Transfer, msg: m.Manifest, headers: dict[str, str] | None) -> None:
    """The receive side's span, a child of the sender's push span (NATS headers)."""
    telemetry.trace_transfer(t, telemetry.open_span(
        "kvstream.receive", parent=telemetry.context_from(headers), kind=SpanKind.CONSUMER,
        request_id=msg.request_id, transfer_id=msg.transfer_id, side="recv", peer=msg.src,
        mode=msg.mode, codec=msg.codec, blocks=len(msg.src_blocks)))


class Admission:
    async def _on_manifest(self: Agent, msg: m.Manifest,
                           headers: dict[str, str] | None = None) -> m.ControlMessage:
        def reject(code: m.RejectCode, reason: str) -> m.Reject:
            log.warning("rejected transfer %s from %s: %s", msg.transfer_id, msg.src, reason)
            return m.Reject(transfer_id=msg.transfer_id, code=code, reason=reason)

        mem = self.memory
        if mem is None:
            return reject("no_reservation", f"{self.instance_id} has no registered KV memory")
        if msg.codec not in self.config.accept_codecs:
            return reject("incompatible", f"codec {msg.codec!r} is not accepted here "
                          f"(AgentConfig.accept_codecs: {', '.join(self.config.accept_codecs)})")
        if (why := mem.layout_mismatch(msg.fingerprint, msg.num_layers, msg.codec,
                                       msg.cache_scales)) is not None:
            return reject("incompatible", why)
        if msg.transfer_id in self._streams:
            return reject("duplicate", f"transfer {msg.transfer_id} is already running")
        if msg.request_id in self._unclaimed:
            return reject("duplicate", f"request {msg.request_id!r} already has a staged push")
        try:
            Subjects.check_instance_id(msg.src)
        except ConfigError as exc:
            return reject("malformed", str(exc))
        if not msg.src_blocks or len(msg.src_blocks) > mem.num_blocks:
            return reject("invalid_blocks", f"{len(msg.src_blocks)} blocks per layer cannot land "
                          f"in {mem.num_blocks} registered blocks")
        if len(msg.block_hashes) > len(msg.src_blocks):
            return reject("malformed", f"{len(msg.block_hashes)} block hashes for "
                          f"{len(msg.src_blocks)} blocks")
        skip: list[int] = []
        accepted: list[int] = []  # the reserved blocks, in manifest order, skipped ones too
        handle = self._reservations.get(msg.request_id)
        staged: dict[int, torch.Tensor] | None = None
        if handle is None:
            # No reservation yet: hold the whole push in staging until the engine claims it
            # with expect(), or refuse at once when the bounded pool has no room (the sender
            # backs off and retries for staging_wait_s).
            single = single_message_for(mem, is_run(msg.src_blocks), False, msg.codec)
            layer_bytes = wire_layer_bytes(mem.layout, msg.codec, len(msg.src_blocks))
            slots = self.staging.try_acquire_all(
                [layer_bytes + (wire.HEADER_CAPACITY if single else 0)] * msg.num_layers)
            if slots is None:
                return reject("busy", f"no reservation for {msg.request_id!r} and the staging "
                              f"pool is full ({self.staging.in_use} of {self.staging.max_bytes} B)")
            staged = dict(enumerate(slots))
            t = Transfer(transfer_id=msg.transfer_id, request_id=msg.request_id, side=Side.RECV,
                         peer=msg.src, num_layers=msg.num_layers, layer_bytes=layer_bytes)
            t.codec = msg.codec
            _trace(t, msg, headers)
            handle = ReceiveHandle(t, lambda reason: self._abort(t, reason), blocks=None)
        else:
            if len(msg.src_blocks) != len(handle.blocks) or (  # type: ignore[arg-type]
                    msg.dst_blocks and msg.dst_blocks != handle.blocks.ids):  # type: ignore[union-attr]
                return reject("invalid_blocks", f"{len(msg.src_blocks)} source blocks do not map "
                              f"onto the {len(handle.blocks)} blocks reserved for "  # type: ignore[arg-type]
                              f"{msg.request_id!r}")
            del self._reservations[msg.request_id]
            t = handle.transfer
            t.transfer_id, t.peer, t.codec = msg.transfer_id, msg.src, msg.codec
            t.layer_bytes = wire_layer_bytes(mem.layout, msg.codec, len(msg.src_blocks))
            _trace(t, msg, headers)
            t.started_at = time.monotonic()  # the transfer deadline counts from the offer
            full = handle.blocks
            assert full is not None  # a reservation always has its blocks
            accepted = full.ids
            skip = skipped_indices(msg.block_hashes, handle.have)
            if skip:
                handle.blocks = full.without(skip)
                shrink(t, mem, len(full), len(handle.blocks))
                self._count("bytes_skipped", t.bytes_skipped)
                if not handle.blocks:
                    self._complete_empty(t, handle)
                    return m.Accept(transfer_id=msg.transfer_id, dst_tag=0,
                                    dst_address=self.worker_address, dst_blocks=full.ids,
                                    skip=skip)
        t.deadline_s = msg.deadline_s  # the sender's deadline holds on both sides
        self.registry.contact(msg.src)
        dst_tag = wire.next_xfer_tag()
        src_kept = without(msg.src_blocks, skip)
        stream = RecvStream(self._env(), handle, peer_address=msg.src_address,
                            src_tag=msg.src_tag, dst_tag=dst_tag,
                            src_contiguous=is_run(src_kept), nblocks=len(src_kept),
                            staged_slots=staged)
        if staged is not None:
            self._unclaimed[msg.request_id] = (stream, list(msg.dst_blocks))
        self._run_stream(msg.transfer_id, stream)
        return m.Accept(transfer_id=msg.transfer_id, dst_tag=dst_tag,
                        dst_address=self.worker_address,
                        # A staged push answers [] so both sides derive the same framing.
                        dst_blocks=accepted, skip=skip)
