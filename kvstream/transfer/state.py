"""The transfer lifecycle as pure, synchronous bookkeeping.

No I/O and no awaiting here: the async layer (``handles``, the data plane's
streams) performs the I/O and reports events. What this module
guarantees, and tests check directly: a transfer reaches exactly one terminal
state, the first report wins, and the release hooks run exactly once.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import msgspec

from kvstream import telemetry

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from kvstream.transfer.plan import Reshape

__all__ = ["TERMINAL", "EndCause", "Side", "Transfer", "TransferResult", "TransferState"]


class _Named(str, enum.Enum):
    """A string enum: equal to its value, printed as its value, encoded by msgspec as it."""

    def __str__(self) -> str:
        return str(self.value)


class TransferState(_Named):
    NEGOTIATING = "negotiating"
    STREAMING = "streaming"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"
    TIMED_OUT = "timed_out"
    EXPIRED = "expired"  # held under a lease nobody renewed


TERMINAL: Final = frozenset(
    {TransferState.COMPLETED, TransferState.FAILED, TransferState.ABORTED, TransferState.TIMED_OUT,
     TransferState.EXPIRED}
)


class Side(_Named):
    SEND = "send"
    RECV = "recv"


class EndCause(_Named):
    """Why a transfer ended, as a value a program can branch on (``reason`` is for people)."""

    COMPLETED = "completed"
    ENGINE_ABORT = "engine_abort"  # this side's engine aborted it
    PEER_ABORT = "peer_abort"  # the peer (or an operator, e.g. the proxy) ended it
    PEER_LOST = "peer_lost"  # the peer died or went silent
    DEADLINE = "deadline"  # not done (or not claimed, or never offered) in time
    LEASE_EXPIRED = "lease_expired"  # an offer nobody renewed
    REFUSED = "refused"  # the peer refused it before any byte moved
    SHUTDOWN = "shutdown"  # this agent closed or its KV memory was unregistered
    ERROR = "error"  # a data-plane, protocol or local error

    @classmethod
    def of(cls, state: TransferState, reason: str = "") -> EndCause:
        """The cause a terminal state implies when the ender named none."""
        if state is TransferState.FAILED and reason.startswith("peer lost"):
            return cls.PEER_LOST
        return _CAUSE_OF[state]


class TransferResult(msgspec.Struct, frozen=True, kw_only=True):
    """The one terminal outcome of a transfer, as one side saw it."""

    transfer_id: str
    request_id: str
    side: Side
    peer: str
    status: TransferState
    reason: str
    bytes: int
    layers: int
    started_at: float
    ended_at: float
    bytes_skipped: int = 0  # already at the destination (incremental)
    codec: str = "none"  # how the bytes travelled; ``bytes`` counts wire bytes
    cause: EndCause = EndCause.COMPLETED  # why it ended (meaningful once it has)
    # The data-plane path (dataplane/paths.py: shm, cuda_ipc, tcp, ucx_shm, ucx_rdma,
    # ucx_tcp); "" when no byte had to move.
    path: str = ""

    @property
    def seconds(self) -> float:
        return self.ended_at - self.started_at

    @property
    def ok(self) -> bool:
        return self.status == TransferState.COMPLETED


class Transfer:
    """State of one transfer on one side."""

    def __init__(
        self, *, transfer_id: str, request_id: str, side: Side, peer: str, num_layers: int,
        layer_bytes: int, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.side = side
        self.peer = peer
        self.num_layers = num_layers
        self.layer_bytes = layer_bytes
        self._clock = clock
        self.state = TransferState.NEGOTIATING
        self.reason = ""
        self.cause = EndCause.COMPLETED
        self.started_at = clock()
        self.ended_at: float | None = None
        self.layers_done = [False] * num_layers
        self.done_count = 0
        self.bytes_skipped = 0
        self.codec = "none"
        self.frame_layers = 1  # layers per data-plane frame (the manifest's frame_layers)
        self.path = ""  # the data-plane path, once chosen (engine/paths.py)
        self.reshape: Reshape | None = None  # between unequal layouts (transfer/plan.py)
        self.deadline_s: float | None = None  # None: the agent's transfer_timeout_s
        self._release: list[Callable[[], None]] = []
        self.span: Span | None = None  # its trace (kvstream.telemetry), when one is open
        self.streamed = False  # reached STREAMING (an idle offer or reservation never does)
        self.shared = False  # a shared offer's: its readers' transfers carry the metrics
        telemetry.transfer_started(self)

    def __repr__(self) -> str:
        return (f"<Transfer {self.transfer_id[:8]} {self.side.value} peer={self.peer} "
                f"{self.state.value} {self.done_count}/{self.num_layers} layers>")

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def bytes_done(self) -> int:
        return self.done_count * self.layer_bytes

    def on_release(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when the transfer ends (at once if it already has)."""
        if self.terminal:
            hook()
        else:
            self._release.append(hook)

    def streaming(self) -> None:
        if self.state is TransferState.NEGOTIATING:
            self.state = TransferState.STREAMING
            self.streamed = True

    def layer_done(self, layer: int) -> bool:
        """Record layer completion; False if already recorded or the transfer has ended."""
        if self.terminal or self.layers_done[layer]:
            return False
        self.layers_done[layer] = True
        self.done_count += 1
        return True

    @property
    def all_layers_done(self) -> bool:
        return self.done_count == self.num_layers

    def finish(self, state: TransferState, reason: str = "", cause: EndCause | None = None) -> bool:
        """Enter a terminal state; only the first call counts and runs the release hooks."""
        if state not in TERMINAL:
            raise ValueError(f"{state} is not terminal")
        if self.terminal:
            return False
        self.state = state
        self.reason = reason
        self.cause = cause or EndCause.of(state, reason)
        self.ended_at = self._clock()
        hooks, self._release = self._release, []
        for hook in hooks:
            hook()
        telemetry.transfer_ended(self)  # last, and it never raises: releases come first
        return True

    def result(self) -> TransferResult:
        return TransferResult(
            transfer_id=self.transfer_id,
            request_id=self.request_id,
            side=self.side,
            peer=self.peer,
            status=self.state,
            reason=self.reason,
            bytes=self.bytes_done,
            layers=self.done_count,
            started_at=self.started_at,
            ended_at=self.ended_at if self.ended_at is not None else self._clock(),
            bytes_skipped=self.bytes_skipped,
            codec=self.codec,
            cause=self.cause,
            path=self.path,
        )


_CAUSE_OF: Final = {
    TransferState.COMPLETED: EndCause.COMPLETED, TransferState.FAILED: EndCause.ERROR,
    TransferState.ABORTED: EndCause.ENGINE_ABORT, TransferState.TIMED_OUT: EndCause.DEADLINE,
    TransferState.EXPIRED: EndCause.LEASE_EXPIRED,
    # not terminal; a result read before the end says "completed" only as a placeholder
    TransferState.NEGOTIATING: EndCause.COMPLETED, TransferState.STREAMING: EndCause.COMPLETED,
}
