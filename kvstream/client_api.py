"""The client surface, written once: what ``Client.local(agent)`` and
``Client.connect(socket)`` both offer an engine, with the same names, parameters and
defaults (a test compares their signatures with this Protocol's).

``Agent`` itself offers the same transfers with synchronous ``expect``/``offer`` and a
struct from ``statistics()``; the client is the engine-facing form of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from opentelemetry.context import Context

    from kvstream.layout import KVLayout
    from kvstream.shm import SharedKV

__all__ = ["TransferClient"]


class TransferClient(Protocol):
    """An engine's handle on its agent, wherever the agent runs. Every call raises
    kvstream errors only (``ConfigError``, ``InvalidBlockError``, ``NoPeerError``,
    ``IncompatiblePeerError``, ``TransferError``, ``SidecarLostError`` ...)."""

    async def register_kv(self, layout: KVLayout, layers: Sequence[torch.Tensor] | SharedKV,
                          *, cache_scales: Sequence[float] | None = None) -> None:
        """Hand the engine's KV memory to the agent (once)."""

    async def expect(self, request_id: str, blocks: Sequence[int], *, src: str,
                     have: Sequence[int] = ()) -> Any:
        """Reserve ``blocks`` for ``src``'s push of ``request_id``; a receive handle. Only
        that instance's push lands here: any other is refused "forbidden" before a byte
        lands (``src`` is required: on a shared bus, "whoever pushes first" would let any
        agent fill the reservation with its own KV)."""

    async def push(self, request_id: str, dst: str, src_blocks: Sequence[int], *,
                   dst_blocks: Sequence[int] | None = None, mode: str = "pipelined",
                   block_hashes: Sequence[int] | None = None, codec: str | None = None,
                   timeout: float | None = None, trace_context: Context | None = None,
                   tokens: int | None = None) -> Any:
        """Send ``src_blocks`` to instance ``dst``; a send handle (mark layers ready).
        ``tokens``: what the blocks hold, for a destination of another block size."""

    async def offer(self, request_id: str, src_blocks: Sequence[int], *,
                    block_hashes: Sequence[int] | None = None, mode: str = "pipelined",
                    lease_s: float | None = None, secret: str | None = None,
                    readers: int | None = None) -> Any:
        """Hold ``src_blocks`` under a lease for a destination's pull; a send handle. Only
        a pull presenting the handle's ``secret`` (``secret``, or one made here) gets them.
        ``readers``: how many destinations pull it, each once (None: the first pull says)."""

    async def pull(self, request_id: str, src: str | Sequence[str], dst_blocks: Sequence[int],
                   *, mode: str = "eager", have: Sequence[int] = (), lookahead: int = 1,
                   codec: str | None = None, timeout: float | None = None,
                   trace_context: Context | None = None, secret: str | Sequence[str] = "",
                   tokens: int | None = None, readers: int = 1) -> Any:
        """Fetch what ``src`` offered for ``request_id`` into ``dst_blocks``; ``secret`` is
        the offer's, as the source handed it out; ``tokens`` as for ``push``. A list of
        sources: gather this rank's KV heads from the ranks holding them, as one request
        (complete when every part landed, failed whole if one fails). ``readers``: the
        destinations sharing the one offer (decode TP above prefill TP), all saying so."""

    async def statistics(self) -> dict[str, int]:
        """The agent's counters (``AgentStatistics``' integer fields)."""
