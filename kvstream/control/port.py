"""What an agent needs of its control plane, so a test can hand it ``MemoryBus`` instead
of a NATS ``ControlBus``.

``Handler`` is defined here, not imported from ``bus``: this module stays free of nats
and ``bus`` may import it one day without making a circle. It is the same alias.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from kvstream.control import messages as m
from kvstream.control.identity import Seal
from kvstream.control.stream import StreamSpec

__all__ = ["ControlPort", "Handler"]

# A handler gets a decoded message and its headers; what it returns is the reply.
Handler = Callable[[m.ControlUnion, dict[str, str]], Awaitable[m.ControlMessage | None]]


class ControlPort(Protocol):
    """The surface of ``ControlBus`` an agent uses (``ControlBus`` matches it as is)."""

    malformed: int  # messages served here that did not decode
    seal: Seal  # signs what is sent, checks what arrives, once its owner sets it up
    # Is that peer alive (the registry's view)? Requests wait out an unsigned "no
    # responders" for a live peer (None: believed at once).
    peer_alive: Callable[[str], bool] | None

    async def request(
        self, subject: str, msg: m.ControlMessage, *, timeout: float,
        headers: dict[str, str] | None = None, peer: str | None = None,
    ) -> m.ControlUnion:
        """The first reply that opens as ``peer``'s (others are dropped and counted);
        ``NoPeerError`` when nobody subscribes or nobody answers in time. Boxed for ``peer``."""
        ...

    async def publish(
        self, subject: str, msg: m.ControlMessage, headers: dict[str, str] | None = None,
        *, peer: str | None = None,
    ) -> None:
        """Publish ``msg``; boxed for ``peer`` when given and its key is known."""
        ...

    async def serve(self, subject: str, handler: Handler,
                    spawn: Callable[..., object] | None = None, queue: str = "") -> None:
        """Subscribe ``handler`` (``subject`` may hold wildcards); with ``spawn`` each message
        is handled in its own task, without it in order; ``queue``: one subscriber of that
        queue group gets each message."""
        ...

    async def persist(self, subject: str, msg: m.ControlMessage, stream: StreamSpec, *,
                      rollup: bool = False) -> int:
        """Publish ``msg`` into ``stream`` (JetStream), its stream sequence once stored;
        ``ControlPlaneError`` if it was not. ``rollup``: the subject's earlier messages go."""
        ...

    async def flush(self, timeout: float = 2.0) -> None:
        """Return once what was sent so far (subscriptions included) has reached the server."""
        ...

    async def close(self) -> None: ...
