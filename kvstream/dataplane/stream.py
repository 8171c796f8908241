"""What a data-plane stream is: the base both halves share, and what it needs from its agent.

Flow per layer L (receiver-driven, so every send meets a posted receive):

    D: post header + part receives for L (into engine blocks or staging)
    D -> P: credit "layers < L+1 may come"               (8-byte tagged message)
    P: wait until L is ready (pipelined) or all are (eager), and credited
    P: gather L's blocks (or use them in place), send header, send parts
    D: check header, scatter out of staging, mark L landed

The send half is ``dataplane.send``, the receive half ``dataplane.recv``; both move bytes
through a ``Transport`` (UCX in production, a loopback in unit tests).

Ending rules (docs/architecture.md, "ending a transfer"): the receiver never
releases a buffer with a receive still posted on it. A receive is completed by
data, or drained with a zero-byte self-send, and draining happens only once the
sender has promised to send nothing more (its AbortAck) or is gone (endpoint
aborted). A sender acks an abort only after its in-flight sends completed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from kvstream.dataplane.wire import HEADER_CAPACITY, FrameMac
from kvstream.memory import run_copy
from kvstream.transfer.state import EndCause, TransferState

if TYPE_CHECKING:
    from kvstream.config import AgentConfig
    from kvstream.dataplane.staging import StagingPool
    from kvstream.dataplane.transport import Transport
    from kvstream.memory import RegisteredKV
    from kvstream.transfer.state import Transfer

__all__ = ["Stream", "StreamEnv", "frame_layers_for", "frame_refusal", "frame_regions",
           "frames_of", "single_message_for"]

log = logging.getLogger("kvstream.transfer")


@dataclass
class StreamEnv:
    """What a stream needs from its agent (callbacks, so the data plane imports no engine)."""

    config: AgentConfig
    transport: Transport
    memory: RegisteredKV
    staging: StagingPool
    # Ask the peer to abort; True if it acknowledged (nothing of ours is in flight there).
    request_abort: Callable[[str, str, str], Awaitable[bool]]
    publish_done: Callable[[str, Any], Awaitable[None]]
    count: Callable[[str, int], None]
    peer_alive: Callable[[str], bool]
    # (address, peer) -> does a live instance other than that peer use this address?
    address_shared: Callable[[bytes, str], bool] = lambda address, peer: False
    # Drop the endpoint to a peer held dead or stuck, and let that peer know (it must drop
    # its own, or its next send into the aborted endpoint is cancelled).
    forget: Callable[[str, bytes], None] = lambda peer, address: None
    # Does the peer announce its KV in host memory (unknown: yes)? Both ends frame alike.
    peer_on_cpu: Callable[[str], bool] = lambda peer: True
    # The key this agent shares with a peer (None: unknown): each transfer's frame MACs
    # derive from it (wire.FrameMac).
    pair_key: Callable[[str], bytes | None] = lambda peer: None


def single_message_for(memory: RegisteredKV, src_contiguous: bool, dst_contiguous: bool,
                       codec: str = "none", path: str = "ucx", peer_on_cpu: bool = True
                       ) -> bool:
    """Framing both sides derive alike: when both ends gather/scatter anyway, a layer travels
    as one message ``[header | payload]`` out of one staging buffer into another (one
    rendezvous instead of one per plane plus a header); otherwise as a header message plus
    one message per plane, so a contiguous end moves its blocks in place. One message needs
    both ends' KV in host memory (``peer_on_cpu``: the peer's, as it announces it): a GPU
    end stages per plane, and a CPU end facing it must frame the same way. A codec always
    stages on both ends and sends a header plus one part (scales, then codes), whatever
    each end's device, so a CPU end and a GPU end frame alike."""
    if codec != "none":
        return False
    if path == "tcp":  # a byte stream: each end splits its [header | payload] as it likes
        return memory.device.type == "cpu"
    return not src_contiguous and not dst_contiguous and memory.device.type == "cpu" \
        and peer_on_cpu


def frame_layers_for(config: AgentConfig, num_layers: int, payload_bytes: int, *,
                     host_memory: bool, lazy: bool = False) -> int:
    """Layers per frame a sender picks: the whole transfer as one frame (one header, one
    credit, one copy job per side) when it is at most ``whole_frame_bytes``, both ends hold
    host memory and nothing is fetched layer by layer; else one layer per frame."""
    limit = min(config.whole_frame_bytes, config.staging_bytes // 4)
    if host_memory and not lazy and 0 < payload_bytes <= limit:
        return num_layers
    return 1


def frame_refusal(frame_layers: int, num_layers: int, *, host_memory: bool, lazy: bool,
                  frame_bytes: int, staging_bytes: int) -> str | None:
    """Why a receiver cannot take the sender's framing (None: it can)."""
    if frame_layers == 1:
        return None
    if frame_layers != num_layers:
        return f"frames of {frame_layers} of {num_layers} layers"
    if not host_memory:
        return "one frame for all layers, with KV on a GPU"
    if lazy:
        return "one frame for all layers of a lazy pull"
    if frame_bytes + HEADER_CAPACITY > staging_bytes:
        return f"a {frame_bytes}-byte frame, over the {staging_bytes}-byte staging pool"
    return None


def frame_regions(slot: Any, layers: range, layer_bytes: int) -> Iterator[tuple[int, Any]]:
    """Each layer of a frame and its place in the frame's buffer, in order."""
    for i, layer in enumerate(layers):
        yield layer, slot[i * layer_bytes:(i + 1) * layer_bytes]


def frames_of(num_layers: int, frame_layers: int) -> list[range]:
    """The layers of each frame, in order."""
    return [range(first, min(num_layers, first + frame_layers))
            for first in range(0, num_layers, frame_layers)]


Outcome = tuple[TransferState, str, "EndCause | None"]


class Stream:
    """What both halves share: the first outcome wins, and stopping cancels the I/O loop."""

    # Cancelling the I/O frees no buffer under UCX: true of the receive half (it drains or
    # quarantines what is posted), not of the send half (a send in flight reads its buffer).
    io_cancel_is_safe = True

    def __init__(self, env: StreamEnv, transfer: Transfer, peer_address: bytes) -> None:
        self.env = env
        self.transfer = transfer
        self.peer = transfer.peer
        self.peer_address = peer_address
        self._outcome: Outcome | None = None
        self._peer_initiated = False
        self._peer_dead = False
        self._loop_scope = anyio.CancelScope()
        self._io_scope = anyio.CancelScope()
        self.stopped = anyio.Event()
        self.stopping = anyio.Event()  # an outcome is decided; the I/O is winding down
        # Set once nothing of ours is in flight toward the peer (what an AbortAck promises).
        self.quiesced = anyio.Event()
        # The receive half calls it once every byte is here (the peer's death then no
        # longer matters to this transfer); the agent sets it.
        self.on_received: Callable[[], None] = lambda: None

    async def run(self) -> None:
        """Move the bytes until the transfer ends; always finishes it (``_end``)."""
        raise NotImplementedError

    async def _copy(self, fn: Callable[..., None], *args: Any) -> None:
        """One copy job on the copy threads (counted: ``copy_jobs``)."""
        self.env.count("copy_jobs", 1)
        await run_copy(fn, *args)

    def _frame_mac(self, src_tag: int, dst_tag: int) -> FrameMac:
        """This transfer's MAC key. Without a shared key (the peer's key unknown: it was
        forgotten since the manifest exchange) a random one: no frame of it verifies, so
        the transfer fails on its first header or credit instead of trusting any."""
        pair = self.env.pair_key(self.peer)
        if pair is None:
            log.warning("%r: no key shared with %s; its frames cannot verify", self.transfer,
                        self.peer)
            pair = os.urandom(32)
        return FrameMac.derive(pair, self.transfer.transfer_id, src_tag, dst_tag)

    def stop(self, state: TransferState, reason: str, *, by_peer: bool = False,
             peer_dead: bool = False, cause: EndCause | None = None) -> None:
        """Begin ending the transfer; the first outcome reported wins."""
        if self._outcome is None:
            if by_peer and cause is None:
                cause = EndCause.PEER_ABORT
            self._outcome = (state, reason, cause)
            self._peer_initiated = by_peer
            self.stopping.set()
        if peer_dead and not self._peer_dead:
            self._peer_dead = True
            # The endpoint is shared by every transfer with that peer: abort it only when
            # the peer is really gone, not merely slow to acknowledge one abort.
            # A forged peer naming a live instance's address must not take its endpoint along.
            if not self.env.peer_alive(self.peer) and \
                    not self.env.address_shared(self.peer_address, self.peer):
                self.env.forget(self.peer, self.peer_address)
                self._io_scope.cancel()
            elif self.io_cancel_is_safe:
                self._io_scope.cancel()
            # else (a sender whose endpoint stays): its sends may still read its buffers;
            # they complete, or ``SendStream._unstick`` aborts the endpoint first.
        self._loop_scope.cancel()

    def _ending(self) -> Outcome:
        return self._outcome or (TransferState.FAILED, "stream ended without an outcome", None)

    async def _tell_peer(self, state: TransferState, reason: str) -> None:
        """Unless the peer started the ending or is gone, get its promise to send nothing more."""
        if self._peer_initiated or self._peer_dead:
            return
        if not await self.env.request_abort(self.peer, self.transfer.transfer_id, reason):
            self.stop(state, reason, peer_dead=True)

    def _end(self) -> bool:
        """Finish the transfer with the outcome (its release hooks tell the agent)."""
        state, reason, cause = self._ending()
        return self.transfer.finish(state, reason, cause)
