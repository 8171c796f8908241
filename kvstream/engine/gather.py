"""Gathers, a destination pulling one request's heads from several sources (issue 18).

One job: from the sources' announced layouts and TP shares, plan which source sends
which of this rank's heads (``transfer.plan.parts_for``), pull every part at once into
the same blocks, and hand the engine one ``GatherHandle``. A source the plan does not
use (a replica of heads another source sends) is left alone: a sibling decode rank may
pull it; the caller releases it or lets its lease run out. A part that fails to start,
or a cancelled gather, stops the parts already started; one that fails later aborts the
rest (``GatherHandle.watch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio

from kvstream._exceptions import (
    ConfigError,
    IncompatiblePeerError,
    InvalidBlockError,
    KVStreamError,
    LayoutError,
    NoPeerError,
    ProtocolError,
)
from kvstream.config import check_timeout
from kvstream.control.subjects import Subjects
from kvstream.transfer.gathered import GatherHandle
from kvstream.transfer.plan import Reshape, Shard, TpInfo, parts_for

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from kvstream.engine.core import Core
    from kvstream.engine.pull import Puller
    from kvstream.transfer.handles import ReceiveHandle

__all__ = ["MAX_SOURCES", "Gatherer"]

MAX_SOURCES = 64  # ranks one destination gathers from (TP degrees in use are <= 16)


class Gatherer:
    def __init__(self, core: Core, puller: Puller) -> None:
        self.core, self.puller = core, puller

    def _shards(self, sources: Sequence[str]) -> list[Shard]:
        registry = self.core.registry
        out = []
        for src in sources:
            ann = registry.announced(src)
            if ann is None or ann.layout is None:
                raise NoPeerError(f"{src} is not announced with a KV layout: a gather plans "
                                  "from every source's layout", peer=src)
            try:
                out.append((ann.tp or TpInfo()).shard(ann.layout))
            except LayoutError as exc:
                raise IncompatiblePeerError(f"{src} announces a TP share that does not fit its "
                                            f"layout: {exc}") from None
        return out

    def plan(self, sources: Sequence[str], nblocks: int,
             tokens: int | None) -> list[tuple[str, Reshape]]:
        """(source, part) per source that sends; ``IncompatiblePeerError`` naming the
        layouts if the sources cannot fill this rank's heads."""
        core = self.core
        mem = core.mem()
        if not 1 <= len(sources) <= MAX_SOURCES or len(set(sources)) != len(sources):
            raise ConfigError(f"a gather names 1 to {MAX_SOURCES} distinct sources, "
                              f"got {list(sources)[:8]}")
        for src in sources:
            Subjects.check_instance_id(src)
        have = nblocks * mem.layout.block_size
        tokens = have if tokens is None else tokens
        if not 0 < tokens <= have or mem.layout.blocks_for_tokens(tokens) != nblocks:
            raise InvalidBlockError(f"{nblocks} blocks of {mem.layout.block_size} do not hold "
                                    f"exactly {tokens} tokens")
        try:
            parts = parts_for(core.config.tp.shard(mem.layout), self._shards(sources), tokens)
        except LayoutError as exc:
            raise IncompatiblePeerError(str(exc)) from None
        return [(sources[i], r) for i, r in parts]

    async def gather(self, request_id: str, sources: Sequence[str], dst_blocks: Sequence[int],
                     *, mode: str = "eager", lookahead: int = 1, codec: str | None = None,
                     timeout: float | None = None, trace_context: Context | None = None,
                     secret: str | Sequence[str] = "", tokens: int | None = None,
                     have: Sequence[int] = ()) -> GatherHandle:
        """``secret``: each source's offer secret, in the order of ``sources``; one string
        for all when the ranks of one engine share it (then any of them could present it
        at another)."""
        core = self.core
        secrets = [secret] * len(sources) if isinstance(secret, str) else list(secret)
        if len(secrets) != len(sources):
            raise ConfigError(f"{len(secrets)} secrets for {len(sources)} sources")
        if have:
            raise ConfigError("a gather moves between unequal shares: no prefix skipping "
                              "(have=)")
        if codec not in (None, "none"):
            raise ConfigError(f"codec {codec!r}: a gather moves the source's dtype (codec 'none')")
        check_timeout(timeout)
        blocks = core.mem().block_map(dst_blocks, what="destination block")
        parts = self.plan(sources, len(blocks), tokens)
        secret_of = dict(zip(sources, secrets, strict=True))
        handles: dict[str, ReceiveHandle] = {}
        failed: list[BaseException] = []

        async def start(src: str, part: Reshape) -> None:
            try:
                handles[src] = await self.puller.pull(
                    request_id, src, blocks.ids, mode=mode, lookahead=lookahead,
                    timeout=timeout, codec="none", trace_context=trace_context,
                    secret=secret_of[src], part=part)
            except Exception as exc:  # the whole gather fails with it
                failed.append(exc)

        try:
            async with anyio.create_task_group() as tg:
                for src, part in parts:
                    tg.start_soon(start, src, part)
        except BaseException:  # cancelled: no part may go on writing into the blocks
            with anyio.CancelScope(shield=True), \
                    anyio.move_on_after(core.config.request_timeout_s * 2):
                await self._abort_all(list(handles.values()), "the gather was cancelled")
            raise
        started = [handles[src] for src, _ in parts if src in handles]
        if not failed:
            got = {h.transfer.reshape.tokens if h.transfer.reshape else -1 for h in started}
            if len(got) != 1:  # a source holds fewer tokens than the others
                failed.append(ProtocolError(f"the sources of {request_id!r} answered with "
                                            f"{sorted(got)} tokens: not one request's KV"))
        if failed:
            with anyio.CancelScope(shield=True):
                await self._abort_all(started, f"another part of the gather failed: {failed[0]}")
            first = failed[0]
            if isinstance(first, KVStreamError):
                raise first
            raise ProtocolError(f"gather of {request_id!r} failed: {first!r}") from first
        handle = GatherHandle(request_id, started)
        core.spawn(handle.watch)
        return handle

    @staticmethod
    async def _abort_all(handles: Sequence[ReceiveHandle], reason: str) -> None:
        async with anyio.create_task_group() as tg:
            for h in handles:
                tg.start_soon(h.abort, reason)
