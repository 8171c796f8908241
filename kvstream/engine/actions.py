"""What the transfer book asks the async layer to do; plain values, performed by ``Core``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstream.transfer.state import EndCause, TransferState

if TYPE_CHECKING:
    from kvstream.engine.entry import Entry

__all__ = ["Action", "Finish", "LoseLease", "Renew", "Stop", "TellKeeper"]


@dataclass(frozen=True)
class Stop:
    """Stop the stream running for ``entry``; it finishes the transfer when it has."""

    entry: Entry
    state: TransferState
    reason: str
    cause: EndCause
    peer_dead: bool = False


@dataclass(frozen=True)
class Finish:
    """End ``entry``'s transfer now (no stream runs for it)."""

    entry: Entry
    state: TransferState
    reason: str
    cause: EndCause


@dataclass(frozen=True)
class TellKeeper:
    """``keeper`` renewed an offer that just ended: tell it now, not at its next renewal."""

    keeper: str
    request_id: str
    reason: str


@dataclass(frozen=True)
class LoseLease:
    """A lease kept at a source is gone (the entry already left the book)."""

    entry: Entry
    reason: str
    cause: EndCause  # PEER_LOST, PEER_ABORT or LEASE_EXPIRED


@dataclass(frozen=True)
class Renew:
    """Renew these requests at ``src`` now; report back with ``renewed``."""

    src: str
    request_ids: tuple[str, ...]
    # Each one's offer secret, taken with the ids (an entry may end before the send).
    secrets: tuple[str, ...] = field(default=(), compare=False)


Action = Stop | Finish | TellKeeper | LoseLease | Renew
