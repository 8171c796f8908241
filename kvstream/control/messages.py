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
  2 - every message signed by its sender (control/identity.py, in NATS headers);
      data-plane tag prefixes random and 48 bits wide (dataplane/wire.py); an offer's
      secret in ``Pull.secret``, ``Renew.secrets`` and ``Abort.secret``; reject codes
      "unauthenticated" and "forbidden". Version 1 peers are refused (they do not sign).
      Then, compatibly: the data-plane path of a transfer (issue 17) chosen by the
      destination (``Accept.path``, ``Pull.path``, echoed in the pull's ``Manifest.path``;
      "ucx" from older peers) and what each side needs for it: a host identity, a TCP
      data address, shared KV segments (``host``, ``tcp``, ``shared`` in ``Announce``;
      ``src_*`` in ``Manifest``, ``dst_*`` in ``Pull`` and ``Accept``). KV events and
      routing (issue 20): ``KVEvents`` (an instance's prefix blocks stored and removed, on
      its own events subject, kept in JetStream), ``KVResync`` (a router asks an instance
      to publish its blocks afresh), ``Route``/``Routed`` (a proxy asks the routers'
      queue group where a request goes); ``Announce.requests`` and ``Announce.kv_used``
      (the load a router weighs; 0 from older peers), ``Announce.kv_epoch``/``kv_seq``
      (the instance's latest stored KV events batch).
  3 - a message for one peer (requests to it, replies, notes, done) boxed for it
      (control/identity.py), so nothing secret travels readable; data-plane headers and
      credits carry a MAC under the transfer's key (dataplane/wire.py); the token a TCP
      data connection authenticates with (``Accept.tcp_token``, ``Pull.tcp_token``).
      Version 2 peers are refused (they can neither open nor make boxes).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from kvstream._exceptions import MessageDecodeError
from kvstream.cuda_ipc import DeviceExport, DeviceOffer
from kvstream.layout import KVLayout
from kvstream.shm import SharedExport
from kvstream.transfer.plan import Reshape, TpInfo

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
    "KVEvents",
    "KVResync",
    "Leave",
    "Manifest",
    "Note",
    "Pull",
    "Reject",
    "Renew",
    "RenewAck",
    "Route",
    "Routed",
    "decode",
    "encode",
]

PROTOCOL_VERSION: Final = 3
MIN_PROTOCOL_VERSION: Final = 3

Role = Literal["prefill", "decode", "both"]
# "", "ok", "waiting", "missing", "off"; a bounded string on the wire, so a state added
# later does not make older peers refuse the whole announcement (they read it as "")
KVEventsState = Annotated[str, msgspec.Meta(max_length=16)]
Mode = Literal["pipelined", "eager"]
PullMode = Literal["eager", "lazy"]
Status = Literal["completed", "failed", "aborted", "timed_out", "expired"]
MAX_NOTE: Final = 64 << 10  # bytes of a Note's body
MAX_READERS: Final = 1024  # destinations one offer is pulled by (TP degrees, at most)

RejectCode = Literal[
    "malformed", "incompatible", "invalid_blocks", "no_reservation", "busy", "duplicate",
    "unknown_transfer", "unknown_request", "unauthenticated", "forbidden",
]


# Bounds on everything a peer sends (decoding refuses more, as malformed): a forged
# message cannot make an agent hold or walk arbitrarily much. Generous for real use: a
# request's blocks at block size 1 for a 1M-token prompt, 4096 layers, 64 KiB addresses.
MAX_BLOCKS: Final = 1 << 20
MAX_FORGOT: Final = 64  # entries of Announce.forgot
MAX_LAYERS: Final = 4096
Id = Annotated[str, msgspec.Meta(max_length=1024)]  # transfer, request and instance ids
Text = Annotated[str, msgspec.Meta(max_length=8192)]  # reasons, fingerprints, codecs, URLs
Address = Annotated[bytes, msgspec.Meta(max_length=64 << 10)]  # a UCX worker address
Tag = Annotated[int, msgspec.Meta(ge=0, lt=1 << 48)]  # a transfer's 48-bit tag prefix (wire.py)
Secret = Annotated[str, msgspec.Meta(max_length=256)]  # an offer's secret (offers.py)
Count = Annotated[int, msgspec.Meta(ge=0)]
Layers = Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)]
BlockIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]],
                     msgspec.Meta(max_length=MAX_BLOCKS)]
Hashes = Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCKS)]
Deadline = Annotated[float, msgspec.Meta(gt=0, le=1e7)]  # seconds; NaN and inf refused
Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e7)]
Load = Annotated[float, msgspec.Meta(ge=0, le=1e12)]
Scales = Annotated[list[float], msgspec.Meta(max_length=2 * MAX_LAYERS)]
Ids = Annotated[list[Id], msgspec.Meta(max_length=1 << 16)]
# The data-plane path of one transfer (dataplane/paths.py): UCX, kvstream's TCP streams,
# a same-host read of the source's shared KV, CUDA IPC.
DataPath = Literal["ucx", "tcp", "shm", "cuda_ipc"]
HostId = Annotated[str, msgspec.Meta(max_length=256)]
TcpAddress = Annotated[bytes, msgspec.Meta(max_length=256)]
# What a TCP data connection to the receiver authenticates with (its token for this
# sender, TcpTransport.token_for); travels only boxed.
TcpToken = Annotated[bytes, msgspec.Meta(max_length=64)]


class ControlMessage(msgspec.Struct, tag_field="op", frozen=True, kw_only=True):
    """Base of every control message; ``v`` is the sender's protocol version."""

    v: int = PROTOCOL_VERSION


class Announce(ControlMessage, tag="kv.announce", frozen=True):
    """Periodic registry entry and heartbeat of one instance."""

    instance_id: Id
    role: Role
    worker_address: Address
    layout: KVLayout | None = None
    load: Load = 0.0
    num_blocks: Count = 0
    heartbeat_s: Seconds = 0.5
    seq: Count = 0
    # The engine's OpenAI-compatible HTTP base URL, for the proxy; "" = not routable.
    endpoint: Text = ""
    # Peers whose UCX endpoint this instance aborted (held dead), with a count that grows
    # each time: a peer that finds itself here with a higher count drops its endpoint too.
    forgot: Annotated[dict[Id, Count], msgspec.Meta(max_length=64)] = {}
    # What other data-plane paths need (issue 17): which host (same host: shared memory,
    # CUDA IPC), the TCP data address, the registered KV's shared segments.
    host: HostId = ""
    tcp: TcpAddress = b""
    shared: SharedExport | None = None
    # Its device KV offered over CUDA IPC to same-host peers (whose, which registration,
    # which GPU); the handles themselves go in one transfer's manifest only
    # (``Manifest.src_device``).
    cuda_ipc: DeviceOffer | None = None
    # Its share of its engine's tensor parallelism (issue 18: which heads its layout holds),
    # and where its KV lives ("cpu", "cuda"; "": not registered).
    tp: TpInfo | None = None
    kv_device: Literal["", "cpu", "cuda"] = ""
    # What a router weighs (issue 20), as the engine reports it (``Agent.report_load``):
    # requests it is serving, KV blocks in use.
    requests: Count = 0
    kv_used: Count = 0
    # Its KV events' latest stored batch ("" / 0: none), so a router that lacks it repairs.
    kv_epoch: Annotated[str, msgspec.Meta(max_length=64)] = ""
    kv_seq: Count = 0
    # Whether its engine's KV events reach the stream, as the instance sees it: "ok"
    # (arriving), "waiting" (none yet, nothing stored yet), "missing" (the engine stored
    # blocks and no event followed), "off" (the engine publishes none); "": not said.
    kv_events: KVEventsState = ""


class Leave(ControlMessage, tag="kv.leave", frozen=True):
    """Sent once by an instance that shuts down cleanly; peers fail its transfers now."""

    instance_id: Id


class Manifest(ControlMessage, tag="kv.manifest", frozen=True):
    """The source's description of a transfer: a push offer, or the answer to a ``Pull``.

    ``src_blocks[i]`` lands in ``dst_blocks[i]`` in every layer, except the indices in
    ``skip`` (blocks the destination already holds). An empty ``dst_blocks`` means
    "the blocks you reserved for ``request_id``". ``block_hashes[i]`` is block i's
    prefix-chain hash, when the source knows it (incremental transfers).
    """

    transfer_id: Id
    request_id: Id
    src: Id
    dst: Id
    src_address: Address
    src_tag: Tag
    fingerprint: Text
    num_layers: Layers
    src_blocks: BlockIds
    dst_blocks: BlockIds = []
    mode: Mode = "pipelined"
    codec: Text = "none"
    payload_bytes: Count = 0
    deadline_s: Deadline = 30.0
    block_hashes: Hashes = []
    skip: BlockIds = []
    skipped_bytes: Count = 0
    lease_s: Seconds = 0.0
    # An engine's own FP8 cache moves verbatim (codec "none") with its per-layer K/V
    # scales; the destination refuses it unless its own scales are the same.
    cache_scales: Scales = []
    # Layers per data-plane frame, the sender's choice both ends follow: 1 (each layer
    # its own header and copy) or num_layers (the whole transfer as one frame).
    frame_layers: Layers = 1
    # The path of a pull (the puller chose it); a push's destination answers in Accept.
    path: DataPath = "ucx"
    src_host: HostId = ""
    src_tcp: TcpAddress = b""
    # The source's token for this destination's connections to src_tcp (its credits on
    # a push, its data on a pull): boxed, for the destination's eyes only.
    tcp_token: TcpToken = b""
    src_shared: SharedExport | None = None
    # Proofs that the sender holds src_shared's segments, bound to this sender, destination
    # and transfer (shm.segment_proof).
    src_secrets: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=64)]],
                           msgspec.Meta(max_length=64)] = []
    # path "cuda_ipc": the source's device KV, for this destination to open (same host).
    src_device: DeviceExport | None = None
    # Between unequal layouts: the source's layout and TP share, and the plan
    # both ends derive (the destination refuses one it would not derive itself).
    reshape: Reshape | None = None
    src_layout: KVLayout | None = None
    src_tp: TpInfo | None = None


class Accept(ControlMessage, tag="kv.accept", frozen=True):
    """The destination reserved receive state; ``dst_tag`` prefixes its data-plane tags."""

    transfer_id: Id
    dst_tag: Tag
    dst_address: Address
    dst_blocks: BlockIds
    # Indices into the manifest's blocks the destination already holds: not sent.
    skip: BlockIds = []
    path: DataPath = "ucx"
    dst_tcp: TcpAddress = b""
    tcp_token: TcpToken = b""


class Pull(ControlMessage, tag="kv.pull", frozen=True):
    """The destination asks the source for ``request_id``'s KV (held under a lease).

    The answer is a ``Manifest`` (with ``skip`` worked out from ``have``) or a ``Reject``.
    """

    request_id: Id
    src: Id
    dst: Id
    dst_address: Address
    dst_tag: Tag
    fingerprint: Text
    num_layers: Layers
    dst_blocks: BlockIds
    have: Hashes = []  # prefix hashes the destination already holds
    mode: PullMode = "eager"
    deadline_s: Deadline = 30.0
    # The codec the destination asks for and its compatibility hash for it
    # (``quant.scheme.wire_fingerprint``); the source may answer "none" (an FP8 cache).
    codec: Text = "none"
    wire_fingerprint: Text = ""
    # The offer's secret, as the source handed it out (``SendHandle.secret``).
    secret: Secret = ""
    path: DataPath = "ucx"
    dst_host: HostId = ""
    dst_tcp: TcpAddress = b""
    # Between unequal layouts: the puller's plan (the source may answer with
    # fewer tokens, what its offer holds) and its layout and TP share.
    reshape: Reshape | None = None
    dst_layout: KVLayout | None = None
    dst_tp: TpInfo | None = None
    # How many destinations pull this one offer, each once (decode TP above prefill TP:
    # the decode ranks sharing a prefill rank); every pull of it must say the same.
    readers: Annotated[int, msgspec.Meta(ge=1, le=MAX_READERS)] = 1
    tcp_token: TcpToken = b""


class Renew(ControlMessage, tag="kv.renew", frozen=True):
    """Keep holding these for me: one message per peer per renewal period, not per block."""

    by: Id
    request_ids: Ids
    secrets: Annotated[list[Secret], msgspec.Meta(max_length=1 << 16)] = []  # one per id


class RenewAck(ControlMessage, tag="kv.renew_ack", frozen=True):
    """``unknown``: ids the source no longer holds (expired, aborted or never offered)."""

    unknown: Ids = []
    lease_s: Seconds = 0.0  # the shortest lease among the renewed ones


class Reject(ControlMessage, tag="kv.reject", frozen=True):
    transfer_id: Id
    code: RejectCode
    reason: Text


class Done(ControlMessage, tag="kv.done", frozen=True):
    """Terminal outcome as one side saw it, sent to the other side once."""

    transfer_id: Id
    request_id: Id
    status: Status
    reason: Text = ""
    bytes: Count = 0
    layers: Count = 0
    bytes_skipped: Count = 0


class Abort(ControlMessage, tag="kv.abort", frozen=True):
    """Stop the transfer; the receiver answers with AbortAck once nothing is in flight."""

    transfer_id: Id
    request_id: Id
    reason: Text
    by: Id
    secret: Secret = ""  # an offer's secret, when the abort names an offer or a lease


class AbortAck(ControlMessage, tag="kv.abort_ack", frozen=True):
    transfer_id: Id


class Note(ControlMessage, tag="kv.note", frozen=True):
    """An adapter's own message to a peer's adapter, on the signed control plane (the
    SGLang backend's "decode allocated" and "KV offered"): ``topic`` picks the handler
    (``Agent.on_note``); the body is the adapter's to validate."""

    topic: Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[a-z][a-z0-9_.-]{0,63}$")]
    body: Annotated[bytes, msgspec.Meta(max_length=MAX_NOTE)]


# -- KV events and routing (issue 20) ------------------------------------------------------
MAX_EVENTS: Final = 1024  # events of one KVEvents batch
MAX_EVENT_HASHES: Final = 4096  # hashes of one event (a batch holds at most 1 MiB of them)
MAX_ROUTE_BLOCKS: Final = 1 << 17  # prompt blocks a route request names, per block size
BlockHash = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # prefix.block_hashes
EventHashes = Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_EVENT_HASHES)]
Epoch = Annotated[str, msgspec.Meta(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]{8,64}$")]
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
LegRole = Literal["prefill", "decode"]


class Stored(msgspec.Struct, tag_field="e", tag="stored", frozen=True):
    """Blocks now held in the prefix cache, by their chained hash (``kvstream.prefix``)."""

    hashes: EventHashes


class Removed(msgspec.Struct, tag_field="e", tag="removed", frozen=True):
    hashes: EventHashes


class Cleared(msgspec.Struct, tag_field="e", tag="cleared", frozen=True):
    """Nothing is held any more (a cache reset)."""


KVEvent = Stored | Removed | Cleared


class KVEvents(ControlMessage, tag="kv.events", frozen=True):
    """One batch of an instance's KV events, on ``Subjects.kv_events(instance_id)``.

    ``seq`` counts the batches of one ``epoch`` (an incarnation of the publisher) from 1
    without a gap: a router that sees one missing repairs its view (it rereads the stream,
    else asks for a ``KVResync``). ``reset``: the instance held nothing before this batch
    (its first batch, and the first of a resync, which then lists every block held)."""

    instance_id: Id
    epoch: Epoch
    seq: Annotated[int, msgspec.Meta(ge=1)]
    block_size: BlockSize
    events: Annotated[list[KVEvent], msgspec.Meta(max_length=MAX_EVENTS)] = []
    reset: bool = False


class KVResync(ControlMessage, tag="kv.resync", frozen=True):
    """A router's request: publish every block held afresh (a ``reset`` batch); its view
    of ``instance_id`` has a gap the stream cannot fill."""

    instance_id: Id
    reason: Text = ""


class Route(ControlMessage, tag="kv.route", frozen=True):
    """A proxy asks the routers where a request goes: its prompt's block hashes for each
    block size the candidates use, and the requests the proxy has in flight per URL."""

    request_id: Id = ""
    hashes: Annotated[dict[BlockSize, Annotated[list[BlockHash], msgspec.Meta(
        max_length=MAX_ROUTE_BLOCKS)]], msgspec.Meta(max_length=8)] = {}
    tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] = 0
    legs: Annotated[list[LegRole], msgspec.Meta(max_length=2)] = msgspec.field(
        default_factory=lambda: ["prefill", "decode"])
    inflight: Annotated[dict[Text, Count], msgspec.Meta(max_length=4096)] = {}
    exclude: Annotated[list[Text], msgspec.Meta(max_length=64)] = []
    # the most the proxy had in flight per URL lately (an announcement's age): what an
    # engine announces beyond it is other proxies' (absent: its count now)
    recent: Annotated[dict[Text, Count], msgspec.Meta(max_length=4096)] = {}


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """Where one leg goes and why: the prompt blocks the engine already holds
    (``overlap`` of ``blocks``), its load, the cost that won among ``candidates``."""

    role: LegRole
    url: Text
    instance_ids: Ids = []
    overlap: Count = 0
    blocks: Count = 0
    load: Load = 0.0
    cost: Load = 0.0
    candidates: Count = 0


class Routed(ControlMessage, tag="kv.routed", frozen=True):
    """A router's answer to ``Route``: one decision per leg it could place."""

    router_id: Id = ""
    decisions: Annotated[list[Decision], msgspec.Meta(max_length=2)] = []


ControlUnion = (Announce | Leave | Manifest | Accept | Reject | Done | Abort | AbortAck | Pull
                | Renew | RenewAck | Note | KVEvents | KVResync | Route | Routed)

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
