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

Headers and credits are authenticated (``FrameMac``): each carries a 16-byte keyed
BLAKE2b MAC under the transfer's own key, derived from the key the two agents share and
the transfer's id and tags, so only the two ends can make one. A header that does not
verify is never taken as "layer ready" (the same-host paths read the layer only after
it), and a credit that does not verify grants nothing; both are counted. Payload bytes
are not MACed: on UCX, shared memory and CUDA IPC they are protected by the secrecy of
the tags and keys (which travel only boxed on the control plane), not by a MAC per byte.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Final

import msgspec

from kvstream._exceptions import ProtocolError

__all__ = [
    "CREDIT_BYTES",
    "HEADER_CAPACITY",
    "KIND_CREDIT",
    "KIND_DATA",
    "KIND_HEADER",
    "FrameMac",
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
    mac: bytes = b""  # FrameMac.header's, over every field above


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
MAC_BYTES: Final = 16
CREDIT_BYTES: Final = _CREDIT.size + MAC_BYTES  # an authenticated credit
_MACED: Final = struct.Struct("<Qq")  # a credit's tag and count, as MACed


def encode_credit(granted_layers: int) -> bytes:
    return _CREDIT.pack(granted_layers)


def decode_credit(buf: memoryview | bytes) -> int:
    if len(buf) < _CREDIT.size:
        raise ProtocolError(f"a credit is {_CREDIT.size} bytes, got {len(buf)}")
    return int(_CREDIT.unpack_from(buf, 0)[0])


class FrameMac:
    """One transfer's MAC key: what makes its headers and credits, and checks them.

    ``derive`` gives both ends the same key from the key their agents share
    (``Identity.pair_key``) and the transfer's id and tags; nobody else can compute it.
    A MAC is keyed BLAKE2b (about a microsecond), checked in constant time."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def derive(cls, pair_key: bytes, transfer_id: str, src_tag: int, dst_tag: int) -> FrameMac:
        data = b"%s\0%d\0%d" % (transfer_id.encode(), src_tag, dst_tag)
        return cls(hashlib.blake2b(data, key=pair_key, digest_size=32,
                                   person=b"kvs-xfer-key").digest())

    def _mac(self, data: bytes) -> bytes:
        return hashlib.blake2b(data, key=self._key, digest_size=MAC_BYTES).digest()

    def header(self, xfer_tag: int, layer: int, nbytes: int, parts: int, codec: str = "none",
               traceparent: str = "") -> LayerHeader:
        """A layer header carrying its MAC."""
        mac = self._mac(_encoder.encode((xfer_tag, layer, nbytes, parts, codec, traceparent)))
        return LayerHeader(xfer_tag, layer, nbytes, parts, codec, traceparent, mac)

    def header_ok(self, h: LayerHeader) -> bool:
        want = self._mac(_encoder.encode((h.xfer_tag, h.layer, h.nbytes, h.parts, h.codec,
                                          h.traceparent)))
        return hmac.compare_digest(want, h.mac)

    def credit(self, tag: int, granted_layers: int) -> bytes:
        """An authenticated credit for ``tag`` (``CREDIT_BYTES``)."""
        body = _CREDIT.pack(granted_layers)
        return body + self._mac(_MACED.pack(tag, granted_layers))

    def credit_of(self, tag: int, buf: memoryview | bytes) -> int | None:
        """The layers a credit on ``tag`` grants; None when it does not verify."""
        if len(buf) < CREDIT_BYTES:
            return None
        granted = int(_CREDIT.unpack_from(buf, 0)[0])
        mac = bytes(buf[_CREDIT.size:CREDIT_BYTES])
        if not hmac.compare_digest(self._mac(_MACED.pack(tag, granted)), mac):
            return None
        return granted
