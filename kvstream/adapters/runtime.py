"""An ``Agent`` on its own event-loop thread, for engines that call from plain threads.

Engine adapters live inside the engine's worker process and are called from its
(synchronous) model-runner thread: they cannot await. The agent runs in a daemon thread
behind an anyio ``BlockingPortal``; the engine thread submits per-request work (an offer, a
pull: well under a millisecond each) and never blocks on a transfer. Results come back
through a thread-safe queue the engine drains at its own pace.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

import anyio
import anyio.abc
import anyio.from_thread

from kvstream._exceptions import AdapterError
from kvstream.engine.agent import Agent

if TYPE_CHECKING:
    import torch

    from kvstream.config import AgentConfig
    from kvstream.layout import KVLayout

__all__ = ["AgentRuntime"]

log = logging.getLogger("kvstream.adapters")

T = TypeVar("T")


class AgentRuntime:
    """Starts an agent with the engine's KV registered; ``close()`` stops it."""

    def __init__(self, config: AgentConfig, layout: KVLayout, layers: Sequence[torch.Tensor], *,
                 start_timeout_s: float = 30.0,
                 notes: Mapping[str, Callable[[str, bytes], None]] | None = None,
                 cache_scales: Sequence[float] | None = None) -> None:
        """``notes``: handlers of adapters' notes by topic, in place before the agent
        announces itself (a peer that sees the announcement may send one at once);
        ``cache_scales``: an FP8 cache's (``Agent.register_kv``)."""
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        self._stop: anyio.Event | None = None
        self.agent: Agent | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop_thread = 0
        ready: concurrent.futures.Future[Agent] = concurrent.futures.Future()

        async def main() -> None:
            self._stop = anyio.Event()
            self._loop_thread = threading.get_ident()
            try:
                # Tasks started on the loop (``spawn`` from there) end before the loop does.
                first = Agent(config, layout=layout)
                first.register_kv(layout, layers, cache_scales=cache_scales)
                for topic, handler in (notes or {}).items():
                    first.on_note(topic, handler)
                async with anyio.create_task_group() as tg, first as agent:
                    self._tg = tg
                    ready.set_result(agent)
                    await self._stop.wait()
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)
                raise

        self._main = self.portal.start_task_soon(main)
        try:
            self.agent = ready.result(timeout=start_timeout_s)
        except concurrent.futures.TimeoutError:
            self._portal_cm.__exit__(None, None, None)
            raise AdapterError(f"the kvstream agent did not start within {start_timeout_s} s "
                               f"(NATS at {config.nats_url or 'the default URL'}?)") from None
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    @overload
    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T: ...

    @overload
    def call(self, fn: Callable[..., T], *args: Any) -> T: ...

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on the agent's loop and wait for it (keep it short); a coroutine
        function's result is awaited there (as ``BlockingPortal.call`` does)."""
        return self.portal.call(fn, *args)

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any
              ) -> concurrent.futures.Future[Any] | None:
        """Start ``fn`` on the agent's loop without waiting, from the engine's thread (its
        future) or from the loop itself (a note handler, a task: None)."""
        if self.on_loop():
            if self._tg is None:
                raise AdapterError("the agent's loop is not running")

            async def guarded() -> None:  # a task's bug must not cancel the agent
                try:
                    await fn(*args)
                except Exception:
                    log.exception("a kvstream adapter task failed")

            self._tg.start_soon(guarded)
            return None
        return self.portal.start_task_soon(fn, *args)

    def add(self, config: AgentConfig, layout: KVLayout, layers: Sequence[torch.Tensor], *,
            start_timeout_s: float = 30.0) -> Agent:
        """Another agent on this loop, for another KV memory of the same engine (SGLang's
        side state: buffers indexed apart from its pages); it stops with the first. Its
        failure after it started is logged, never taken to the first agent."""
        ready: concurrent.futures.Future[Agent] = concurrent.futures.Future()

        async def run() -> None:
            stop = self._stop
            try:
                async with Agent(config, layout=layout, kv_caches=layers) as agent:
                    ready.set_result(agent)
                    if stop is not None:
                        await stop.wait()
            except Exception as exc:
                if not ready.done():
                    ready.set_exception(exc)
                else:
                    log.exception("kvstream agent %s failed", config.instance_id)

        def start() -> None:
            if self._tg is None or self.agent is None:
                raise AdapterError("the agent's loop is not running")
            self._tg.start_soon(run)

        self.portal.call(start)
        try:
            return ready.result(timeout=start_timeout_s)
        except concurrent.futures.TimeoutError:
            raise AdapterError(f"the kvstream agent {config.instance_id} did not start within "
                               f"{start_timeout_s} s") from None

    def on_loop(self) -> bool:
        """Is this the agent's loop thread (where ``call`` would deadlock)?"""
        return threading.get_ident() == self._loop_thread

    def close(self, timeout: float = 10.0) -> None:
        """Abort what is in flight (peers are told), leave the registry, stop the thread."""
        if self.agent is None:
            return
        self.agent = None
        stop = self._stop
        if stop is not None:
            try:
                self.portal.call(stop.set)
                self._main.result(timeout=timeout)
            except Exception as exc:  # closing must not raise into engine shutdown
                log.warning("kvstream agent did not stop cleanly: %r", exc)
        self._portal_cm.__exit__(None, None, None)
