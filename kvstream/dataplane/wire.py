"""Data-plane framing: UCX tag layout and the per-layer header.

Tag (64 bits): ``xfer_tag`` (32) | ``layer`` (24) | ``kind`` (8). ``xfer_tag`` is
chosen by the side that *receives* on it, from a per-process counter, so tags
never collide inside one UCX worker. Kinds: header, credit, then one data part
per chunk plane of the layout (K and V planes for ``kv_outer`` arrangements).

Per layer the sender sends a header then the parts; the header carries the
trace context and lets the receiver check it got what the manifest promised.
"""

from __future__ import annotations

import itertools
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
    "make_tag",
    "next_xfer_tag",
]

KIND_HEADER: Final = 0
KIND_CREDIT: Final = 1
KIND_DATA: Final = 2  # + part index
MAX_LAYERS: Final = (1 << 24) - 1
HEADER_CAPACITY: Final = 512

_counter = itertools.count(1)


def next_xfer_tag() -> int:
    """A 32-bit tag prefix unique within this process (wraps after 4e9 transfers)."""
    tag = next(_counter) & 0xFFFFFFFF
    return tag or next_xfer_tag()


def make_tag(xfer_tag: int, layer: int, kind: int) -> int:
    if not 0 <= layer <= MAX_LAYERS:
        raise ProtocolError(f"layer {layer} does not fit the tag layout")
    return (xfer_tag << 32) | (layer << 8) | kind


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
    return int(_CREDIT.unpack_from(buf, 0)[0])
