"""Engine <-> sidecar messages on the local socket: one tagged union, length-prefixed frames.

Same evolution rules as the control plane (new fields last with defaults, tags never
reused). Requests carry an ``id`` the reply echoes; events (layer landed, transfer
finished) carry the handle they are about. ``LayerReady`` has no reply: it is the
per-layer hot path.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Final, Literal

import anyio
import msgspec

from kvstream._exceptions import FieldValue, MessageDecodeError
from kvstream.cuda_ipc import CudaTensorHandle
from kvstream.layout import KVLayout
from kvstream.shm import SharedKVSpec
from kvstream.transfer import TransferResult

__all__ = [
    "MAX_FRAME",
    "Abort",
    "Error",
    "Expect",
    "Fetch",
    "Finished",
    "Hello",
    "LayerLanded",
    "LayerReady",
    "LocalMessage",
    "LocalUnion",
    "Offer",
    "Ok",
    "Pull",
    "Push",
    "RegisterKV",
    "Stats",
    "decode",
    "encode",
    "frame",
]

MAX_FRAME: Final = 1 << 20
_LEN: Final = struct.Struct("<I")


class LocalMessage(msgspec.Struct, tag_field="op", frozen=True, kw_only=True):
    id: int = 0


class Hello(LocalMessage, tag="hello", frozen=True):
    pid: int
    version: int = 1


class RegisterKV(LocalMessage, tag="register_kv", frozen=True):
    """Host KV in shared memory by name; device KV through CUDA IPC handles (``cuda``,
    one per layer, with ``layout``)."""

    shared: SharedKVSpec | None = None
    cuda: list[CudaTensorHandle] = []
    layout: KVLayout | None = None
    cache_scales: list[float] | None = None  # an FP8 cache's (k, v) scales


class Expect(LocalMessage, tag="expect", frozen=True):
    request_id: str
    blocks: list[int]
    src: str  # only this instance's push may land (required: see Agent.expect)
    have: list[int] = []


class Push(LocalMessage, tag="push", frozen=True):
    request_id: str
    dst: str
    src_blocks: list[int]
    dst_blocks: list[int] | None = None
    mode: Literal["pipelined", "eager"] = "pipelined"
    block_hashes: list[int] = []
    codec: str | None = None
    traceparent: str = ""  # the engine's request span: the transfer's trace nests under it
    timeout: float | None = None  # None: the agent's transfer_timeout_s
    tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] | None = None  # unequal layouts


Readers = Annotated[int, msgspec.Meta(ge=1, le=1024)]  # control.messages.MAX_READERS


class Offer(LocalMessage, tag="offer", frozen=True):
    request_id: str
    src_blocks: list[int]
    block_hashes: list[int] = []
    mode: Literal["pipelined", "eager"] = "pipelined"
    lease_s: float | None = None
    secret: str | None = None  # None: the agent makes one (returned in ``Ok.secret``)
    readers: Readers | None = None  # destinations that pull it (None: the first pull says)


class Pull(LocalMessage, tag="pull", frozen=True):
    request_id: str
    src: str | list[str]  # several: a gather (Agent.pull)
    dst_blocks: list[int]
    mode: Literal["eager", "lazy"] = "eager"
    have: list[int] = []
    lookahead: int = 1
    codec: str | None = None
    traceparent: str = ""
    timeout: float | None = None
    secret: str | list[str] = ""  # the offer's secret, as its source handed it out (a
    # gather: one per source, or one for all)
    tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] | None = None  # unequal layouts
    readers: Readers = 1  # destinations that pull the one offer (Agent.pull)


class Fetch(LocalMessage, tag="fetch", frozen=True):
    """Lazy pull: bring layers up to ``layer`` (no reply, like ``LayerReady``)."""

    handle: int
    layer: int


class LayerReady(LocalMessage, tag="layer_ready", frozen=True):
    handle: int
    layer: int


class Abort(LocalMessage, tag="abort", frozen=True):
    handle: int
    reason: str


class Stats(LocalMessage, tag="stats", frozen=True):
    pass


class Ok(LocalMessage, tag="ok", frozen=True):
    handle: int = 0
    num_layers: int = 0
    stats: dict[str, int] = {}
    instance_id: str = ""
    secret: str = ""  # an offer's secret (answer to ``Offer``)


class Error(LocalMessage, tag="error", frozen=True):
    kind: str
    message: str
    fields: dict[str, FieldValue] = {}  # the error's structured fields (KVStreamError.fields)


class LayerLanded(LocalMessage, tag="layer_landed", frozen=True):
    handle: int
    layer: int


class Finished(LocalMessage, tag="finished", frozen=True):
    handle: int
    result: TransferResult


LocalUnion = (Hello | RegisterKV | Expect | Push | LayerReady | Abort | Stats | Ok | Error
              | LayerLanded | Finished | Offer | Pull | Fetch)

_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(LocalUnion)


def encode(msg: LocalMessage) -> bytes:
    return _encoder.encode(msg)


def frame(msg: LocalMessage) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def frame_length(prefix: bytes) -> int:
    (n,) = _LEN.unpack(prefix)
    if n > MAX_FRAME:
        raise MessageDecodeError(f"local frame of {n} bytes exceeds {MAX_FRAME}")
    return int(n)


def decode(data: bytes) -> LocalUnion:
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageDecodeError(f"malformed local message: {exc}") from exc


async def read_frame(stream: Any) -> LocalUnion | None:
    """One message from the stream; None at a clean end of stream."""
    try:
        prefix = await _read_exact(stream, 4)
    except anyio.EndOfStream:
        return None
    body = await _read_exact(stream, frame_length(prefix))
    return decode(body)


async def _read_exact(stream: Any, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = await stream.receive(n - got)
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
