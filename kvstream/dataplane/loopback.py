"""An in-memory data plane for unit tests, with the UCX tag semantics streams rely on.

* a receive completes with the oldest message sent on exactly its 64-bit tag; a message
  nobody posted for waits in the receiver's unexpected queue (FIFO per tag) and
  completes the next receive posted on that tag at once;
* ``send`` copies the sender's bytes and returns (UCX eager), so the sender may reuse
  its buffer; a longer message than the posted buffer fails that receive (UCX's
  truncation error), a shorter one completes with what it holds;
* ``drain(tag)`` is a zero-byte message to oneself: it completes the oldest receive on
  ``tag`` without writing into it, or waits as unexpected, as with UCX.

Usage (one fabric per test; an agent gets an open transport, or ``fabric.open`` as an
async factory with ``UcxWorker.open``'s shape)::

    fabric = LoopbackFabric()
    a, b = LoopbackTransport(fabric), await fabric.open()
    recv = b.post_recv(np.zeros(16, np.uint8), tag=7)
    await a.send(b.address, np.arange(16, dtype=np.uint8), tag=7)
    await recv.wait()

Buffers are CPU memory: numpy arrays, CPU torch tensors (any dtype, contiguous), bytes
(to send) and memoryviews. Everything runs on one event loop.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from kvstream._exceptions import DataPlaneError, ProtocolError

__all__ = ["LoopbackFabric", "LoopbackRecv", "LoopbackTransport"]

_TAG_LIMIT = 1 << 64


def _byte_view(buf: Any) -> memoryview:
    """The raw bytes of ``buf``, without a copy."""
    if hasattr(buf, "__cuda_array_interface__") or getattr(buf, "is_cuda", False):
        raise DataPlaneError("the loopback transport moves CPU memory only")
    if hasattr(buf, "numpy") and hasattr(buf, "detach"):  # a torch tensor, bfloat16 too
        import torch

        tensor = buf.detach()
        if not tensor.is_contiguous():
            raise DataPlaneError("loopback buffers must be contiguous")
        buf = tensor.reshape(-1).view(torch.uint8).numpy()
    try:
        return memoryview(buf).cast("B")
    except (TypeError, ValueError) as exc:
        raise DataPlaneError(f"not a contiguous CPU buffer: {exc}") from exc


def _check_tag(tag: int) -> None:
    if not 0 <= tag < _TAG_LIMIT:
        raise DataPlaneError(f"tag {tag:#x} does not fit in 64 bits")


class LoopbackRecv:
    """A posted receive; ``nbytes`` is what the message wrote (0 for a drain)."""

    def __init__(self, view: memoryview, tag: int) -> None:
        self.tag = tag
        self.nbytes = 0
        self._view = view
        self._done = anyio.Event()
        self._error: str | None = None

    @property
    def completed(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> None:
        await self._done.wait()
        if self._error is not None:
            raise DataPlaneError(f"loopback receive (tag {self.tag:#x}) failed: {self._error}")

    def _finish(self, data: bytes) -> int:
        """Take one message; the bytes written."""
        if len(data) > len(self._view):
            self._fail(f"message truncated: {len(data)} bytes for a {len(self._view)}-byte buffer")
            return 0
        self._view[:len(data)] = data
        self.nbytes = len(data)
        self._done.set()
        return len(data)

    def _fail(self, reason: str) -> None:
        self._error = reason
        self._done.set()


class LoopbackFabric:
    """The network of one test: addresses, fault injection, what was delivered."""

    def __init__(self) -> None:
        self._transports: dict[bytes, LoopbackTransport] = {}
        self._ids = itertools.count(1)
        self.bytes_delivered = 0  # written into receive buffers
        self.messages_delivered = 0  # receives completed by a message (drains included)

    async def open(self) -> LoopbackTransport:
        return LoopbackTransport(self)

    def kill(self, address: bytes) -> None:
        """The transport at ``address`` vanishes: its receives fail, sends to it raise."""
        transport = self._transports.pop(address, None)
        if transport is None:
            raise DataPlaneError(f"no loopback transport at {address!r}")
        transport._shut("killed")

    def _attach(self, transport: LoopbackTransport) -> bytes:
        address = f"loopback-{next(self._ids)}".encode()
        self._transports[address] = transport
        return address

    def _lookup(self, address: bytes) -> LoopbackTransport:
        transport = self._transports.get(address)
        if transport is None:
            raise DataPlaneError(f"no loopback transport at {address!r} (unknown, closed or killed)")
        return transport


class LoopbackTransport:
    """One agent's worker on a ``LoopbackFabric``; a ``Transport`` like ``UcxWorker``."""

    vectored = False

    def __init__(self, fabric: LoopbackFabric) -> None:
        self.fabric = fabric
        self.forgotten = 0  # forget_peer calls
        self._address = fabric._attach(self)
        self._posted: dict[int, deque[LoopbackRecv]] = {}
        self._unexpected: dict[int, deque[bytes]] = {}
        self._ended: str | None = None

    @property
    def address(self) -> bytes:
        return self._address

    def check_address(self, peer_address: bytes) -> bytes:
        if not peer_address.startswith(b"loopback-"):
            raise ProtocolError(f"not a loopback address: {peer_address[:32]!r}")
        return peer_address

    async def send(self, peer_address: bytes, buf: Any, tag: int) -> None:
        self._check()
        _check_tag(tag)
        data = bytes(_byte_view(buf))  # copied now: the caller may reuse buf at once
        await anyio.lowlevel.checkpoint()  # cancelled here: nothing was sent
        self._check()
        self.fabric._lookup(peer_address)._deliver(data, tag)

    def post_recv(self, buf: Any, tag: int) -> LoopbackRecv:
        self._check()
        _check_tag(tag)
        view = _byte_view(buf)
        if view.readonly:
            raise DataPlaneError("cannot receive into read-only memory")
        recv = LoopbackRecv(view, tag)
        waiting = self._unexpected.get(tag)
        if waiting:
            data = waiting.popleft()
            if not waiting:
                del self._unexpected[tag]
            self._complete(recv, data)
        else:
            self._posted.setdefault(tag, deque()).append(recv)
        return recv

    async def drain(self, tag: int) -> None:
        self._check()
        _check_tag(tag)
        await anyio.lowlevel.checkpoint()
        self._deliver(b"", tag)

    def forget_peer(self, peer_address: bytes) -> None:
        """Nothing to abort: a send never stays in flight here. Counted for tests."""
        self.forgotten += 1

    def sweep(self, is_live: Callable[[int], bool], max_messages: int = 1024) -> int:
        dropped = 0
        for tag in [t for t in self._unexpected if not is_live(t)]:
            if dropped >= max_messages:
                break
            dropped += len(self._unexpected.pop(tag))
        return dropped

    async def close(self) -> None:
        if self._ended is None:
            self._shut("closed")
            self.fabric._transports.pop(self._address, None)

    def _check(self) -> None:
        if self._ended is not None:
            raise DataPlaneError(f"loopback transport {self._address!r} is {self._ended}")

    def _deliver(self, data: bytes, tag: int) -> None:
        posted = self._posted.get(tag)
        if posted:
            recv = posted.popleft()
            if not posted:
                del self._posted[tag]
            self._complete(recv, data)
        else:
            self._unexpected.setdefault(tag, deque()).append(data)

    def _complete(self, recv: LoopbackRecv, data: bytes) -> None:
        written = recv._finish(data)
        if recv._error is None:
            self.fabric.bytes_delivered += written
            self.fabric.messages_delivered += 1

    def _shut(self, reason: str) -> None:
        self._ended = reason
        for posted in self._posted.values():
            for recv in posted:
                recv._fail(f"transport {reason}")
        self._posted.clear()
        self._unexpected.clear()
