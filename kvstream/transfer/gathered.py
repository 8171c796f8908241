"""One request's KV gathered from several sources: the handle over its parts (issue 18).

A destination rank whose heads are spread over several prefill ranks (prefill TP >
decode TP) pulls each rank's heads as one part, a transfer of its own into the same
blocks. The engine sees one receive: a layer has landed when it landed from every part,
the request completed when every part did, and it fails whole: the first part to fail
aborts the others (``watch``), and the result is that part's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio

from kvstream._exceptions import TransferError
from kvstream.transfer.handles import ReceiveHandle, Waitable, error_for
from kvstream.transfer.state import EndCause, Side, TransferResult, TransferState

if TYPE_CHECKING:
    from kvstream.memory import BlockMap

__all__ = ["GatherHandle", "combine"]


def combine(request_id: str, results: Sequence[TransferResult]) -> TransferResult:
    """The request's outcome from its parts': the first failure (by end time) if any."""
    failed = sorted((r for r in results if not r.ok), key=lambda r: r.ended_at)
    first = failed[0] if failed else results[0]
    parts = ", ".join(f"{r.peer}: {r.status}" for r in results)
    return TransferResult(
        transfer_id="+".join(r.transfer_id for r in results), request_id=request_id,
        side=Side.RECV, peer=",".join(r.peer for r in results),
        status=first.status if failed else TransferState.COMPLETED,
        reason=f"part from {first.peer} {first.status}: {first.reason} ({parts})"
        if failed else "", bytes=sum(r.bytes for r in results),
        layers=min(r.layers for r in results),
        started_at=min(r.started_at for r in results),
        ended_at=max(r.ended_at for r in results),
        bytes_skipped=sum(r.bytes_skipped for r in results), codec=first.codec,
        cause=first.cause if failed else EndCause.COMPLETED,
        path=",".join(sorted({r.path for r in results if r.path})))


class GatherHandle(Waitable):
    """Like a ``ReceiveHandle``, over the parts of one gathered request."""

    def __init__(self, request_id: str, parts: Sequence[ReceiveHandle]) -> None:
        if not parts:
            raise ValueError("a gather has at least one part")
        self.parts = list(parts)
        self._request_id = request_id
        self.lazy = parts[0].lazy
        self.lookahead = parts[0].lookahead

    @property
    def transfer_id(self) -> str:
        return "+".join(p.transfer_id for p in self.parts)

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def num_layers(self) -> int:
        return self.parts[0].num_layers

    @property
    def blocks(self) -> BlockMap | None:
        return self.parts[0].blocks

    @property
    def done(self) -> bool:
        return all(p.done for p in self.parts)

    async def watch(self) -> None:
        """Run until every part ended; the first failure aborts the rest."""
        async def follow(part: ReceiveHandle) -> None:
            res = await part.result()
            if not res.ok:
                for other in self.parts:
                    if other is not part and not other.done:
                        tg.start_soon(other.abort, f"gathered part from {res.peer} "
                                      f"{res.status}: {res.reason}")

        async with anyio.create_task_group() as tg:
            for part in self.parts:
                tg.start_soon(follow, part)

    async def result(self) -> TransferResult:
        return combine(self._request_id, [await p.result() for p in self.parts])

    async def abort(self, reason: str = "aborted by the engine") -> TransferResult:
        async with anyio.create_task_group() as tg:
            for part in self.parts:
                tg.start_soon(part.abort, reason)
        return await self.result()

    def fetch(self, layer: int) -> None:
        for part in self.parts:
            part.fetch(layer)

    def layer_landed(self, layer: int) -> bool:
        return all(p.layer_landed(layer) for p in self.parts)

    async def wait_layer(self, layer: int) -> None:
        """Once ``layer`` landed from every part; raises the gather's error (the first
        part's to fail) if one failed first."""
        if self.lazy:  # every part asked first, so they move together
            self.fetch(layer)
        try:
            for part in self.parts:
                await part.wait_layer(layer)
        except TransferError:
            raise error_for(await self.result()) from None

    async def wait_landed(self, layer: int) -> None:
        try:
            for part in self.parts:
                await part.wait_landed(layer)
        except TransferError:
            raise error_for(await self.result()) from None

    def __repr__(self) -> str:
        return f"<GatherHandle {self._request_id!r} of {len(self.parts)} parts>"
