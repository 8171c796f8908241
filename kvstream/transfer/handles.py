"""What the engine holds for a transfer in flight: a send or a receive handle.

The handle is the engine's view: mark layers ready (send side), await a layer
or the whole transfer (receive side), abort. The agent drives it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from kvstream import telemetry
from kvstream._exceptions import (
    LeaseExpiredError,
    PeerLostError,
    TransferAbortedError,
    TransferError,
    TransferTimeout,
)
from kvstream.transfer.state import EndCause, Transfer, TransferResult, TransferState

if TYPE_CHECKING:
    from kvstream.memory import BlockMap

__all__ = ["ReceiveHandle", "SendHandle", "error_for"]


class LayerFlags:
    """One flag per layer, with an event made only for a layer someone waits on (a
    transfer of 80 layers that nobody waits on per layer makes none)."""

    def __init__(self, n: int) -> None:
        self.flags = [False] * n
        self._events: dict[int, anyio.Event] = {}
        self._woken = False  # every wait returns from now on (the transfer ended)

    def is_set(self, layer: int) -> bool:
        return self.flags[layer]

    def set(self, layer: int) -> None:
        self.flags[layer] = True
        event = self._events.pop(layer, None)
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        """Return every wait, now and later, whether its flag is set or not."""
        self._woken = True
        events, self._events = self._events, {}
        for event in events.values():
            event.set()

    async def wait(self, layer: int) -> None:
        if self.flags[layer] or self._woken:
            return
        event = self._events.get(layer)
        if event is None:
            event = self._events[layer] = anyio.Event()
        await event.wait()


def error_for(result: TransferResult) -> TransferError:
    """The exception that stands for a non-completed result."""
    kind: type[TransferError] = {
        TransferState.ABORTED.value: TransferAbortedError,
        TransferState.TIMED_OUT.value: TransferTimeout,
        TransferState.EXPIRED.value: LeaseExpiredError,
    }.get(result.status, TransferError)
    if result.status == TransferState.FAILED.value and (
            result.cause == EndCause.PEER_LOST or result.reason.startswith("peer lost")):
        kind = PeerLostError
    return kind(f"transfer {result.transfer_id} for request {result.request_id} "
                f"{result.status}: {result.reason}", request_id=result.request_id, peer=result.peer)


class Waitable:
    """``wait()`` on top of a ``result()``: shared by local and sidecar handles."""

    async def result(self) -> TransferResult:
        raise NotImplementedError

    async def wait(self) -> TransferResult:
        """Wait for completion; raises the matching ``TransferError`` otherwise."""
        result = await self.result()
        if not result.ok:
            raise error_for(result)
        return result


class _Handle(Waitable):
    def __init__(self, transfer: Transfer, aborter: Callable[[str], Awaitable[None]]) -> None:
        self.transfer = transfer
        self._aborter = aborter
        self._finished = anyio.Event()
        transfer.on_release(self._finished.set)

    @property
    def transfer_id(self) -> str:
        return self.transfer.transfer_id

    @property
    def request_id(self) -> str:
        return self.transfer.request_id

    @property
    def num_layers(self) -> int:
        return self.transfer.num_layers

    @property
    def done(self) -> bool:
        return self.transfer.terminal

    async def result(self) -> TransferResult:
        """Wait for the terminal outcome; never raises for a failed transfer."""
        await self._finished.wait()
        return self.transfer.result()

    async def abort(self, reason: str = "aborted by the engine") -> TransferResult:
        """Stop the transfer on both sides; returns once this side has released everything."""
        if not self.transfer.terminal:
            await self._aborter(reason)
        return await self.result()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.transfer!r}>"


class SendHandle(_Handle):
    """Prefill side: tell kvstream which layers are computed."""

    def __init__(self, transfer: Transfer, aborter: Callable[[str], Awaitable[None]],
                 *, eager: bool, blocks: BlockMap) -> None:
        super().__init__(transfer, aborter)
        self.eager = eager
        self.blocks = blocks
        self._ready = LayerFlags(transfer.num_layers)
        self._all_ready = anyio.Event()
        self._ready_count = 0
        self.last_ready_at: float | None = None
        self.block_hashes: list[int] = []  # prefix hashes of ``blocks`` (incremental)
        # Offered for a pull: held until the lease (renewed by the puller) runs out.
        self.lease_s = 0.0
        self.lease_until = 0.0
        self.keepers: set[str] = set()  # instances that renewed the lease
        # An offer's secret: a pull (or keep, renewal, abort) of it must present it.
        self.secret = ""
        self._readers: list[SendHandle] = []  # a shared offer's (``reader``)

    def reader(self, transfer: Transfer, aborter: Callable[[str], Awaitable[None]]
               ) -> SendHandle:
        """The handle of one reader of this shared offer: its own transfer, this offer's
        blocks and layer readiness (the engine marks layers on the offer's handle only)."""
        h = SendHandle(transfer, aborter, eager=self.eager, blocks=self.blocks)
        h._ready, h._all_ready = self._ready, self._all_ready
        h.block_hashes, h.secret = self.block_hashes, self.secret
        self._readers.append(h)
        return h

    def layer_ready(self, layer: int) -> None:
        """Layer ``layer``'s KV is final and may leave (pipelined mode sends it now)."""
        if not 0 <= layer < self.transfer.num_layers:
            raise ValueError(f"layer {layer} out of range 0..{self.transfer.num_layers - 1}")
        if self._ready.is_set(layer):
            return
        self._ready.set(layer)
        self._ready_count += 1
        if self._ready_count == self.transfer.num_layers:
            self.last_ready_at = time.monotonic()
            self._all_ready.set()
            for h in (self, *self._readers):  # each reader's trace has its exposed time
                telemetry.all_layers_ready(h.transfer)

    def all_ready(self) -> None:
        for layer in range(self.transfer.num_layers):
            self.layer_ready(layer)

    async def until_sendable(self, layer: int) -> None:
        if self.eager:
            await self._all_ready.wait()
        else:
            await self._ready.wait(layer)


class ReceiveHandle(_Handle):
    """Decode side: await layers as they land in the reserved blocks."""

    def __init__(self, transfer: Transfer, aborter: Callable[[str], Awaitable[None]],
                 *, blocks: BlockMap | None, have: frozenset[int] = frozenset(),
                 lazy: bool = False, lookahead: int = 1) -> None:
        super().__init__(transfer, aborter)
        # None while a push that arrived before the reservation waits in staging.
        self.blocks = blocks
        self.have = have  # prefix hashes already here: those blocks are not sent
        self.lazy = lazy
        self.lookahead = max(0, lookahead)
        # Layers the engine asked for so far (lazy); the receiver posts no further.
        self.requested = 0 if lazy else transfer.num_layers
        self._requested_changed = anyio.Event()
        self._landed = LayerFlags(transfer.num_layers)
        transfer.on_release(self._wake_all)

    def _wake_all(self) -> None:
        self._landed.wake_all()
        self._requested_changed.set()

    def fetch(self, layer: int) -> None:
        """Lazy mode: fetch layers up to ``layer`` (plus ``lookahead`` more) now.

        Layers arrive in order, so asking for layer L brings every layer before it too.
        """
        if not 0 <= layer < self.transfer.num_layers:
            raise ValueError(f"layer {layer} out of range 0..{self.transfer.num_layers - 1}")
        want = min(self.transfer.num_layers, layer + 1 + self.lookahead)
        if want > self.requested:
            self.requested = want
            self._requested_changed.set()
            self._requested_changed = anyio.Event()

    async def until_requested(self, layer: int) -> None:
        while self.requested <= layer and not self.transfer.terminal:
            await self._requested_changed.wait()

    def mark_layer(self, layer: int) -> None:
        if self.transfer.layer_done(layer):
            self._landed.set(layer)

    def layer_landed(self, layer: int) -> bool:
        return self.transfer.layers_done[layer]

    async def wait_layer(self, layer: int) -> None:
        """Return once ``layer`` is in the reserved blocks; raises if the transfer failed first.

        On a lazy pull this is also the fetch: the layer is requested now if it was not."""
        if self.lazy:  # even when it landed already: the lookahead moves on
            self.fetch(layer)
        if self.transfer.layers_done[layer]:
            return
        start = time.time_ns()  # the engine waits: traced and measured (kvstream.layer.wait)
        await self.wait_landed(layer)
        telemetry.record_wait(self.transfer, layer, start)

    async def wait_landed(self, layer: int) -> None:
        """``wait_layer`` without fetching (an observer must not make a lazy pull eager)."""
        if not self.transfer.layers_done[layer]:
            await self._landed.wait(layer)
        if not self.transfer.layers_done[layer]:
            raise error_for(self.transfer.result())
