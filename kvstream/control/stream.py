"""What a JetStream stream kvstream keeps is made of (``ControlBus.ensure_stream``)."""

from __future__ import annotations

import msgspec

from kvstream.control.subjects import Subjects

__all__ = ["StreamSpec", "kv_events_stream"]


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A stream's name, subjects and limits. The limits bound the server's disk: the
    oldest messages go first (a router that starts after they went sees an instance's
    blocks stored since, and a gap it repairs with a ``KVResync``)."""

    name: str
    subjects: str
    max_age_s: float = 24 * 3600.0
    max_bytes: int = 1 << 30
    max_msgs_per_subject: int = 1 << 20
    max_msg_size: int = 1 << 20


def kv_events_stream(subjects: Subjects) -> StreamSpec:
    """The namespace's KV events: every instance's batches (``KVEvents``)."""
    return StreamSpec(name=subjects.kv_events_stream, subjects=subjects.kv_events_all)
