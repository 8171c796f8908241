"""The notes a layer-pipelined push's parties send each other (``Agent.note``, signed).

``declined`` goes from the decode rank to the prefill rank (do not push, or stop);
``failed`` to the decode rank, from the prefill rank (its push will not come) or from the
proxy that planned the push (the prefill leg failed before any rank heard of it): either
way the decode rank pulls or recomputes at once instead of waiting out its reservation.
A ``failed`` note with ``offered=False`` says no offer can exist either (the proxy could not
reach the prefill engine at all): the decode rank then recomputes without trying a pull.
Here, below the vLLM adapter and the proxy, because both send them.
"""

from __future__ import annotations

import re
from typing import Final, Literal

import msgspec

from kvstream.control import messages as m

__all__ = ["PUSH_TOPIC", "PushNote", "decode_note", "encode_note", "note_message"]

PUSH_TOPIC: Final = "kvstream.vllm.push"
_PUSH_ID = re.compile(r"[A-Za-z0-9_-]{8,128}")
MAX_REASON: Final = 512


class PushNote(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
               omit_defaults=True):
    push_id: str
    state: Literal["declined", "failed"]
    reason: str = ""
    # "failed" only: False when nothing could have been offered for a pull (the prefill
    # engine never got the request). Omitted when True, so older peers read the note.
    offered: bool = True


def encode_note(push_id: str, state: Literal["declined", "failed"], reason: str, *,
                offered: bool = True) -> bytes:
    return msgspec.json.encode(PushNote(push_id=push_id, state=state,
                                        reason=reason[:MAX_REASON - 12], offered=offered))


def decode_note(body: bytes) -> PushNote | None:
    """A peer's note, or None when it is malformed (dropped: a note only hurries a fallback
    the bounded waits reach anyway)."""
    try:
        note = msgspec.json.decode(body, type=PushNote)
    except msgspec.DecodeError:
        return None
    return note if _PUSH_ID.fullmatch(note.push_id) and len(note.reason) <= MAX_REASON else None


def note_message(push_id: str, state: Literal["declined", "failed"], reason: str, *,
                 offered: bool = True) -> m.Note:
    """The control message carrying one note (for a sender that is no agent: the proxy)."""
    return m.Note(topic=PUSH_TOPIC, body=encode_note(push_id, state, reason, offered=offered))
