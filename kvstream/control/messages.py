"""Control-plane messages (NATS), one tagged union, MessagePack on the wire.

Evolution rules (msgspec's schema-evolution guidance):
  * new fields get a default and go last; never change a field's type;
  * never reuse a tag; unknown fields are ignored (no ``forbid_unknown_fields``);
  * bump ``PROTOCOL_VERSION`` when the meaning of a message changes and keep
    ``MIN_PROTOCOL_VERSION`` at the oldest peer still understood.

History:
  1 - first release: announce/leave, manifest/accept/reject, done, abort/abort-ack;
      then, compatibly (new tags, new defaulted fields): pull, renew/renew-ack, block
      hashes and skipped blocks (incremental), the "expired" status; the codec of a
      pull (``Pull.codec``, ``Pull.wire_fingerprint``) and an FP8 cache's own scales
      (``Manifest.cache_scales``); the engine's HTTP base URL in ``Announce.endpoint``
      (read by ``kvstream proxy``; "" from older peers).
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from kvstream._exceptions import MessageDecodeError
from kvstream.layout import KVLayout

__all__ = [
    "MIN_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "Abort",
    "AbortAck",
    "Accept",
    "Announce",
    "ControlMessage",
    "ControlUnion",
    "Done",
    "Leave",
    "Manifest",
    "Pull",
    "Reject",
    "Renew",
    "RenewAck",
    "decode",
    "encode",
]

PROTOCOL_VERSION: Final = 1
MIN_PROTOCOL_VERSION: Final = 1

Role = Literal["prefill", "decode", "both"]
Mode = Literal["pipelined", "eager"]
PullMode = Literal["eager", "lazy"]
Status = Literal["completed", "failed", "aborted", "timed_out", "expired"]
RejectCode = Literal[
    "malformed", "incompatible", "invalid_blocks", "no_reservation", "busy", "duplicate",
    "unknown_transfer", "unknown_request",
]


class ControlMessage(msgspec.Struct, tag_field="op", frozen=True, kw_only=True):
    """Base of every control message; ``v`` is the sender's protocol version."""

    v: int = PROTOCOL_VERSION


class Announce(ControlMessage, tag="kv.announce", frozen=True):
    """Periodic registry entry and heartbeat of one instance."""

    instance_id: str
    role: Role
    worker_address: bytes
    layout: KVLayout | None = None
    load: float = 0.0
    num_blocks: int = 0
    heartbeat_s: float = 0.5
    seq: int = 0
    # The engine's OpenAI-compatible HTTP base URL, for the proxy; "" = not routable.
    endpoint: str = ""


class Leave(ControlMessage, tag="kv.leave", frozen=True):
    """Sent once by an instance that shuts down cleanly; peers fail its transfers now."""

    instance_id: str


class Manifest(ControlMessage, tag="kv.manifest", frozen=True):
    """The source's description of a transfer: a push offer, or the answer to a ``Pull``.

    ``src_blocks[i]`` lands in ``dst_blocks[i]`` in every layer, except the indices in
    ``skip`` (blocks the destination already holds). An empty ``dst_blocks`` means
    "the blocks you reserved for ``request_id``". ``block_hashes[i]`` is block i's
    prefix-chain hash, when the source knows it (incremental transfers).
    """

    transfer_id: str
    request_id: str
    src: str
    dst: str
    src_address: bytes
    src_tag: int
    fingerprint: str
    num_layers: int
    src_blocks: list[int]
    dst_blocks: list[int] = []
    mode: Mode = "pipelined"
    codec: str = "none"
    payload_bytes: int = 0
    deadline_s: float = 30.0
    block_hashes: list[int] = []
    skip: list[int] = []
    skipped_bytes: int = 0
    lease_s: float = 0.0
    # An engine's own FP8 cache moves verbatim (codec "none") with its per-layer K/V
    # scales; the destination refuses it unless its own scales are the same.
    cache_scales: list[float] = []


class Accept(ControlMessage, tag="kv.accept", frozen=True):
    """The destination reserved receive state; ``dst_tag`` prefixes its data-plane tags."""

    transfer_id: str
    dst_tag: int
    dst_address: bytes
    dst_blocks: list[int]
    # Indices into the manifest's blocks the destination already holds: not sent.
    skip: list[int] = []


class Pull(ControlMessage, tag="kv.pull", frozen=True):
    """The destination asks the source for ``request_id``'s KV (held under a lease).

    The answer is a ``Manifest`` (with ``skip`` worked out from ``have``) or a ``Reject``.
    """

    request_id: str
    src: str
    dst: str
    dst_address: bytes
    dst_tag: int
    fingerprint: str
    num_layers: int
    dst_blocks: list[int]
    have: list[int] = []  # prefix hashes the destination already holds
    mode: PullMode = "eager"
    deadline_s: float = 30.0
    # The codec the destination asks for and its compatibility hash for it
    # (``quant.scheme.wire_fingerprint``); the source may answer "none" (an FP8 cache).
    codec: str = "none"
    wire_fingerprint: str = ""


class Renew(ControlMessage, tag="kv.renew", frozen=True):
    """Keep holding these for me: one message per peer per renewal period, not per block."""

    by: str
    request_ids: list[str]


class RenewAck(ControlMessage, tag="kv.renew_ack", frozen=True):
    """``unknown``: ids the source no longer holds (expired, aborted or never offered)."""

    unknown: list[str] = []
    lease_s: float = 0.0  # the shortest lease among the renewed ones


class Reject(ControlMessage, tag="kv.reject", frozen=True):
    transfer_id: str
    code: RejectCode
    reason: str


class Done(ControlMessage, tag="kv.done", frozen=True):
    """Terminal outcome as one side saw it, sent to the other side once."""

    transfer_id: str
    request_id: str
    status: Status
    reason: str = ""
    bytes: int = 0
    layers: int = 0
    bytes_skipped: int = 0


class Abort(ControlMessage, tag="kv.abort", frozen=True):
    """Stop the transfer; the receiver answers with AbortAck once nothing is in flight."""

    transfer_id: str
    request_id: str
    reason: str
    by: str


class AbortAck(ControlMessage, tag="kv.abort_ack", frozen=True):
    transfer_id: str


ControlUnion = (Announce | Leave | Manifest | Accept | Reject | Done | Abort | AbortAck | Pull
                | Renew | RenewAck)

_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(ControlUnion)


def encode(msg: ControlMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> ControlUnion:
    """Decode one control message; anything malformed is a ``MessageDecodeError``."""
    try:
        msg = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageDecodeError(f"malformed control message: {exc}") from exc
    except Exception as exc:  # a Struct's __post_init__ (e.g. a bad KVLayout)
        raise MessageDecodeError(f"invalid control message: {exc}") from exc
    if msg.v < MIN_PROTOCOL_VERSION:
        raise MessageDecodeError(
            f"protocol version {msg.v} is older than the oldest supported ({MIN_PROTOCOL_VERSION})"
        )
    return msg
