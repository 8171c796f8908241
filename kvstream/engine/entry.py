"""One thing the transfer book holds, and its kinds."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from kvstream.transfer.state import EndCause, TransferState

__all__ = ["Entry", "Kind"]


class Kind(enum.Enum):
    RESERVATION = "reservation"  # receive side: blocks reserved, no manifest yet
    STAGED = "staged"  # receive side: a push landing in staging, no reservation yet
    RECEIVE = "receive"  # receive side of a push, bound to its reservation
    PUSH = "push"  # send side of a push
    OFFER = "offer"  # send side: blocks held under a lease for a pull
    SERVE = "serve"  # send side: an offer being pulled
    PULL = "pull"  # receive side of a pull
    LEASE = "lease"  # a lease this agent keeps at a source (no transfer here)



@dataclass(eq=False)
class Entry:
    """One thing the book holds. ``handle`` and ``runner`` belong to the async layer (the
    engine's handle, the stream running for it); the book never looks at them."""

    kind: Kind
    request_id: str
    peer: str = ""
    transfer_id: str = ""
    opened_at: float = 0.0
    deadline: float = math.inf  # when its transfer times out (set once it streams)
    limit_s: float = 0.0  # the span behind ``deadline``, for the reason text
    claim_by: float = math.inf  # a reservation's manifest, a staged push's claim, are due
    lease_s: float = 0.0  # offers: how long one renewal holds them
    lease_until: float = math.inf
    keepers: set[str] = field(default_factory=set)  # who renewed an offer
    staged_bytes: int = 0  # a staged push's share of the staging pool
    expect_from: str = ""  # a reservation's only allowed source
    secret: str = ""  # an offer's secret (source side), or the one it was kept/pulled with
    promised: list[int] = field(default_factory=list)  # a staged push's named blocks
    streaming: bool = False  # a stream runs for it: ending goes through ``Stop``
    received: bool = False  # every byte is here: the peer's death no longer matters
    confirmed: bool = False  # a lease the source said it holds (before: a question only)
    peer_dead: bool = False  # its stop was told the peer is gone (abort the endpoint)
    ending: tuple[TransferState, str] | None = None
    cause: EndCause | None = None  # of ``ending`` (a shared offer finishes after its readers)
    # A shared offer (pulled by several destinations, each once; 0: the first pull says
    # how many) and the SERVE entry of each reader, which names it as its ``parent``.
    readers: int = 0
    children: list[Entry] = field(default_factory=list)
    parent: Entry | None = None
    served: int = 0  # a shared offer's readers that completed
    reader_failed: bool = False  # one of them ended otherwise (it counted that end)
    slot: bool = False  # counts against ``max_transfers`` (a shared offer's first reader
    # takes over its offer's slot, so N readers hold N slots, as N plain pulls would)
    finished: bool = False
    handle: Any = None
    runner: Any = None

    def due(self) -> float:
        """When the timer next has something to do about it (inf: never by itself)."""
        return min(self.deadline, self.claim_by, self.lease_until)

    def __repr__(self) -> str:
        state = "finished" if self.finished else (self.ending[0].value if self.ending else "live")
        return f"<Entry {self.kind.value} {self.request_id} peer={self.peer or '-'} {state}>"
