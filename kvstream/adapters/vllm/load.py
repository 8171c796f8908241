"""The engine's load, announced for KV-aware routers (``Agent.report_load``).

vLLM's scheduler counts the requests it holds and its KV blocks in use each step
(``KVStreamMetadata.load``); each rank's worker hands them to its agent, whose next
heartbeat carries them. A step is the only time a connector hears from vLLM, and vLLM
stops stepping when it holds no request (it steps while it holds any, even one only
waiting for its KV; 0.32 takes one more step after the last finishes, which reports it),
so an engine that stops stepping otherwise (paused) would keep its last load announced:
when no step has begun for ``IDLE_S`` after the last one ended, the load is 0. A step
begins at ``bind_connector_metadata``, before its forward, and ends at ``wait_for_save``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvstream.adapters.runtime import AgentRuntime

__all__ = ["IDLE_S", "LoadReport"]

# vLLM begins its next step within milliseconds of the last (the scheduler's update and
# the next schedule): 1 s without one means it has nothing to step for. A forward in
# progress never counts as idle, however long it runs.
IDLE_S = 1.0


class LoadReport:
    """One rank's load as its agent announces it. ``begin``/``end`` bracket each step on
    vLLM's thread; ``watch`` runs on the agent's loop."""

    def __init__(self, rt: AgentRuntime, clock: Callable[[], float] = time.monotonic) -> None:
        self._rt = rt
        self._clock = clock
        self._reported: tuple[int, int] = (0, 0)
        self._stepping = False
        self._ended = self._clock()

    @property
    def reported(self) -> tuple[int, int]:
        return self._reported

    def begin(self, load: tuple[int, int] | None) -> None:
        """A step begins with the scheduler's ``load`` (None: an older scheduler said none)."""
        self._stepping = True
        if load is not None and load != self._reported:
            self._report(load)

    def end(self) -> None:
        self._stepping = False
        self._ended = self._clock()

    def idle(self) -> None:
        """Called every ``IDLE_S / 4`` (``watch``): an idle engine's load is 0."""
        if self._reported != (0, 0) and not self._stepping and \
                self._clock() - self._ended > IDLE_S:
            self._report((0, 0))

    async def watch(self) -> None:
        while self._rt.agent is not None:
            await anyio.sleep(IDLE_S / 4)
            self.idle()

    def _report(self, load: tuple[int, int]) -> None:
        # Two ints the next heartbeat reads: no hop to the agent's loop. A race with
        # ``idle`` costs at most one step's stale value (the next step reports again).
        agent = self._rt.agent
        if agent is not None:
            self._reported = load
            agent.report_load(requests=load[0], kv_used=load[1])
