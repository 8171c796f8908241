"""What streams need of the data plane, so a test can hand them ``LoopbackTransport``
instead of a UCX ``UcxWorker`` (which, with ``PostedRecv``, matches these as is).

Tag semantics both keep: a receive completes with the oldest message sent on exactly
its 64-bit tag; a message nobody has posted for waits until someone does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["PostedReceive", "Transport"]


class PostedReceive(Protocol):
    """A receive already posted; ``completed`` is true once it ended, failed ones too."""

    tag: int

    @property
    def completed(self) -> bool: ...

    async def wait(self) -> None:
        """Until the message is in the buffer; ``DataPlaneError`` if the receive failed."""
        ...


class Transport(Protocol):
    """The tagged-message surface of ``UcxWorker`` that streams use."""

    # True if ``send`` and ``post_recv`` also take a list of buffers, sent or filled in
    # order as one message (TCP's sendmsg / recvmsg_into): no gather, no scatter.
    vectored: bool

    @property
    def address(self) -> bytes:
        """This worker's address, as peers pass it to ``send``."""
        ...

    def check_address(self, peer_address: bytes) -> bytes:
        """The address as given if this transport can use it; ``ProtocolError`` if not
        (checked before a peer's address reaches UCX: a malformed one aborts UCX)."""
        ...

    async def send(self, peer_address: bytes, buf: Any, tag: int) -> None: ...

    def post_recv(self, buf: Any, tag: int) -> PostedReceive:
        """Post now (so a credit can follow); await ``.wait()`` later."""
        ...

    async def drain(self, tag: int) -> None:
        """Complete a receive posted on ``tag`` without writing into its buffer."""
        ...

    def forget_peer(self, peer_address: bytes) -> None:
        """Drop a dead peer's endpoint; a later send opens a new one."""
        ...

    def sweep(self, is_live: Callable[[int], bool], max_messages: int = 1024) -> int:
        """Discard unread the messages waiting on tags nobody here will post for
        (``is_live`` false: a late message of an ended transfer, a stray, garbage);
        returns how many. UCX's stops at the first live tag it meets (the oldest
        waiting message first); the loopback's looks at every tag."""
        ...

    async def close(self) -> None: ...
