"""Data-plane framing: UCX tag layout and the per-layer header.

Tag (64 bits): ``xfer_tag`` (48) | ``layer`` (12) | ``kind`` (4). ``xfer_tag`` is
chosen by the side that *receives* on it, at random (``secrets``) and unique among the
live ones of this process (one UCX worker per process). UCX's tag matching says nothing
about who sent a message, so the tag is the data plane's capability: only the peer the
control plane told it to (in a signed manifest or accept) can address a live transfer,
and anything on a tag that is not live is discarded unread (``is_live``, the sweep in
dataplane/ucx.py). Kinds: header, credit, then one data part per chunk plane of the
layout (K and V planes for ``kv_outer`` arrangements).

Per layer the sender sends a header then the parts; the header carries the
trace context and lets the receiver check it got what the manifest promised.
"""

from __future__ import annotations

import secrets
import struct
from typing import Final

import msgspec

from kvstream._exceptions import ProtocolError

__all__ = [
    "HEADER_CAPACITY",
    "KIND_CREDIT",
    "KIND_DATA",
    "KIND_HEADER",
    "LayerHeader",
    "decode_credit",
    "decode_header",
    "encode_credit",
    "encode_header",
    "is_live",
    "make_tag",
    "new_xfer_tag",
    "release_xfer_tag",
]

KIND_HEADER: Final = 0
KIND_CREDIT: Final = 1
KIND_DATA: Final = 2  # + part index
MAX_LAYERS: Final = (1 << 12) - 1  # the highest layer index (messages.MAX_LAYERS layers)
MAX_KIND: Final = (1 << 4) - 1
XFER_BITS: Final = 48
HEADER_CAPACITY: Final = 512

_live: set[int] = set()


def new_xfer_tag() -> int:
    """A random 48-bit tag prefix no live transfer of this process uses; live until
    ``release_xfer_tag``."""
    while True:
        tag = secrets.randbits(XFER_BITS)
        if tag and tag not in _live:
            _live.add(tag)
            return tag


def release_xfer_tag(tag: int) -> None:
    _live.discard(tag)


def is_live(tag: int) -> bool:
    """Does this full 64-bit tag belong to a live transfer of this process? (The bench's
    raw-UCX baseline posts its receives before its sender starts: nothing of it waits.)"""
    return (tag >> 16) in _live


def make_tag(xfer_tag: int, layer: int, kind: int) -> int:
    if not 0 <= layer <= MAX_LAYERS:
        raise ProtocolError(f"layer {layer} does not fit the tag layout")
    if not 0 <= kind <= MAX_KIND:
        raise ProtocolError(f"message kind {kind} does not fit the tag layout")
    return (xfer_tag << 16) | (layer << 4) | kind


class LayerHeader(msgspec.Struct, array_like=True, frozen=True):
    xfer_tag: int
    layer: int
    nbytes: int
    parts: int
    codec: str = "none"
    traceparent: str = ""


_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(LayerHeader)
_LEN: Final = struct.Struct("<H")


def encode_header(header: LayerHeader, out: memoryview) -> int:
    """Write length-prefixed header bytes into ``out``; returns bytes used."""
    body = _encoder.encode(header)
    size = _LEN.size + len(body)
    if size > len(out):
        raise ProtocolError(f"layer header of {size} bytes exceeds {len(out)}")
    _LEN.pack_into(out, 0, len(body))
    out[_LEN.size:size] = body
    return size


def decode_header(buf: memoryview) -> LayerHeader:
    if len(buf) < _LEN.size:
        raise ProtocolError(f"layer header buffer of {len(buf)} bytes is too short")
    (length,) = _LEN.unpack_from(buf, 0)
    if length > len(buf) - _LEN.size:
        raise ProtocolError(f"layer header claims {length} bytes, buffer holds {len(buf)}")
    try:
        return _decoder.decode(buf[_LEN.size:_LEN.size + length])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed layer header: {exc}") from exc


_CREDIT: Final = struct.Struct("<q")


def encode_credit(granted_layers: int) -> bytes:
    return _CREDIT.pack(granted_layers)


def decode_credit(buf: memoryview | bytes) -> int:
    if len(buf) < _CREDIT.size:
        raise ProtocolError(f"a credit is {_CREDIT.size} bytes, got {len(buf)}")
    return int(_CREDIT.unpack_from(buf, 0)[0])
