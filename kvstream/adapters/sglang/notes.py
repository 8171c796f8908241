"""What the SGLang backend's two sides tell each other, as kvstream ``Note`` bodies.

SGLang's flow is decode-first: the decode engine allocates pages for a request (its
``bootstrap_room``) and says so; the prefill engine computes, then its KV moves. Over
kvstream: the decode rank sends ``Want`` (its instance, how many pages, its TP share) to
each prefill rank it reads; the prefill rank, after its last chunk, offers the pages and
answers ``Ready`` (the offer's secret, the tokens, the aux row SGLang wrote); the decode
rank pulls (one source, a gather, or one reader of a shared offer: ``transfer.plan``) and
writes the aux row only once every page has landed. ``Drop`` says a side gave the request
up, so the other fails it now instead of at a timeout. Every body is a peer's: decoded
with bounds, its sender checked by the caller.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

__all__ = ["DROP", "MAX_AUX_BYTES", "READY", "WANT", "Drop", "Ready", "Want", "decode", "encode"]

WANT: Final = "sglang.want"
READY: Final = "sglang.ready"
DROP: Final = "sglang.drop"
MAX_AUX_BYTES: Final = 48 << 10  # one aux row over all of SGLang's metadata buffers

Room = Annotated[int, msgspec.Meta(ge=0)]  # a uint64 (checked in ``decode``)
Small = Annotated[int, msgspec.Meta(ge=0, le=1 << 24)]


Tp = Annotated[int, msgspec.Meta(ge=1, le=1024)]
Kind = Annotated[str, msgspec.Meta(max_length=32)]
Secret = Annotated[str, msgspec.Meta(max_length=256)]


class Want(msgspec.Struct, frozen=True, kw_only=True):
    """Decode rank ``tp_rank`` of ``tp_size`` allocated ``pages`` pages for ``room``, and
    reads this prefill rank's KV (``read``; False: none of it is needed, the rank is done
    once it computed: a replica another rank sends, MLA's latent read elsewhere)."""

    room: Room
    pages: Small
    prefix_len: Small = 0  # tokens the decode's radix cache already holds
    tp_rank: Small = 0
    tp_size: Tp = 1
    readers: Tp = 1  # decode ranks reading this prefill rank (each its heads)
    read: bool = True
    kv_dtype: Annotated[str, msgspec.Meta(max_length=64)] = ""  # SGLang's KV cache dtype
    # Side state (``state.py``): the decode's components and its item count of each
    state_kinds: Annotated[list[Kind], msgspec.Meta(max_length=16)] = []
    state: Annotated[list[Small], msgspec.Meta(max_length=16)] = []


class Ready(msgspec.Struct, frozen=True, kw_only=True):
    """The prefill rank offers ``room``'s pages (``tokens`` tokens) under ``secret``, and
    the aux row SGLang wrote for it, one entry per metadata buffer."""

    room: Room
    secret: Annotated[str, msgspec.Meta(min_length=16, max_length=256)]
    tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)]
    pages: Small
    aux: Annotated[list[bytes], msgspec.Meta(max_length=64)] = []
    # Side state: each group's offer secret ("": nothing of it moves), and how many items
    # of each component move
    state_secrets: Annotated[list[Secret], msgspec.Meta(max_length=64)] = []
    state: Annotated[list[Small], msgspec.Meta(max_length=16)] = []


class Drop(msgspec.Struct, frozen=True, kw_only=True):
    """The sender gave ``room`` up (aborted, failed): fail it at once. From a decode rank,
    its ``tp_rank`` of ``tp_size``: a prefill rank it never asked can check it is one of
    the ranks it would have."""

    room: Room
    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    tp_rank: Small = 0
    tp_size: Tp = 1


_enc: Final = msgspec.msgpack.Encoder()
_dec: Final[dict[str, msgspec.msgpack.Decoder[Any]]] = {
    WANT: msgspec.msgpack.Decoder(Want), READY: msgspec.msgpack.Decoder(Ready),
    DROP: msgspec.msgpack.Decoder(Drop)}


def encode(note: Want | Ready | Drop) -> bytes:
    return _enc.encode(note)


def decode(topic: str, body: bytes) -> Want | Ready | Drop | None:
    """The note, or None if it is not one (a peer's garbage: dropped by the caller)."""
    dec = _dec.get(topic)
    if dec is None:
        return None
    try:
        note: Want | Ready | Drop = dec.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if note.room >= 1 << 64 or (isinstance(note, Ready)
                                and sum(len(a) for a in note.aux) > MAX_AUX_BYTES):
        return None
    return note
