"""What a sender and a receiver share: the latched failure and when to report it.

SGLang frees a request's pages when its poll says ``Failed`` or ``abort()`` returns, so
a failure first stops the request's stream (on the agent's loop), then tells the peer
(``Drop``), and only then is reported.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from sglang.srt.disaggregation.base.conn import KVPoll

from kvstream._exceptions import AdapterError
from kvstream.adapters.sglang import notes

if TYPE_CHECKING:
    from kvstream.adapters.sglang.manager import KVStreamKVManager

__all__ = ["Side", "rid"]

log = logging.getLogger("kvstream.sglang")


def rid(room: int) -> str:
    """The kvstream request id of SGLang's bootstrap room."""
    return f"sgl-{room}"


class Side:
    """What a sender and a receiver share: the latched failure, and the rule that
    ``Failed`` is reported only once nothing of the request moves any more (SGLang frees
    the pages when it sees ``Failed``): a failure first stops the request's stream
    (``_stop``, on the agent's loop), then tells the peers (``Drop``), then reports."""

    kv_mgr: KVStreamKVManager
    room: int
    side: str  # "prefill" or "decode"

    def _init_side(self) -> None:
        self.failure: str | None = None
        self.conclude_state: int | None = None
        self.stopped = threading.Event()  # set once nothing of the request moves any more
        self.started = time.monotonic()
        self._told = False
        self._gone: set[str] = set()  # peers that gave the request up themselves

    def fail(self, why: str, *, tell: bool = True) -> None:
        """Latch the failure (the first reason wins; a concluded success stays one) and
        stop what runs for it, from either thread."""
        with self.kv_mgr._lock:
            if self.conclude_state == KVPoll.Success:
                self.stopped.set()  # nothing moves after a success: abort() returns at once
                return
            if self.failure is not None:
                return
            self.failure = why
        log.warning("kvstream: room %s failed: %s", self.room, why)
        self._told = not tell
        rt = self.kv_mgr.rt
        if rt.on_loop():
            self._failed_on_loop()
        else:
            try:
                rt.call(self._failed_on_loop)
            except Exception as exc:  # the agent is gone: nothing of ours moves
                log.warning("kvstream: stopping room %s: %r", self.room, exc)
                self.stopped.set()

    def _failed_on_loop(self) -> None:
        if self._streaming():
            self.kv_mgr.rt.spawn(self._stop_then_tell)
        else:
            self.stopped.set()
            self._drop()

    async def _stop_then_tell(self) -> None:
        try:
            await self._stop()
        finally:
            self.stopped.set()
            self._drop()

    def _drop(self) -> None:
        if self._told:
            return
        self._told = True
        mgr = self.kv_mgr
        drop = notes.Drop(room=self.room, reason=(self.failure or "")[:1024],
                          tp_rank=mgr.rank, tp_size=mgr.tp_size)
        for peer in self.peers():
            if peer not in self._gone:
                mgr.send_note(peer, drop)

    def peers(self) -> list[str]:
        """The other side's ranks of this request (those a failure is told to)."""
        raise NotImplementedError

    def _streaming(self) -> bool:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    def _failed_poll(self, in_flight: int) -> int:
        """``Failed`` once stopped; until then what the request was (its stream stops)."""
        if self.stopped.is_set():
            self.conclude_state = KVPoll.Failed
            self.clear()
            return KVPoll.Failed
        return in_flight

    def _wait_stopped(self) -> None:
        if not self.stopped.wait(self.kv_mgr.drain_timeout_s):
            log.error("kvstream: room %s still moving after %s s", self.room,
                      self.kv_mgr.drain_timeout_s)

    def abort(self) -> None:
        """Returns once nothing of the request moves (SGLang frees the pages then),
        concluded ``Failed`` (unless it had succeeded)."""
        self.fail(f"the {self.side} request was aborted")
        self._wait_stopped()
        if self.conclude_state is None and self.failure is not None:
            self.conclude_state = KVPoll.Failed
            self.clear()

    def dropped(self, peer: str, reason: str) -> None:
        """``peer`` gave the request up: fail it, and tell the other peers (a decode rank
        sharing this prefill rank's offer must not wait for it)."""
        self._gone.add(peer)  # it knows
        self.fail(f"{peer} gave the request up: {reason}")

    def failure_exception(self) -> None:
        """SGLang calls this for a ``Failed`` poll, before it frees the pages. A ``Failed``
        another rank decided (the polls are min-all-reduced) stops this rank's transfer
        first."""
        own = self.failure is not None
        if not own:
            self.fail("another rank of this request failed")
        self._wait_stopped()
        self.clear()
        exc = AdapterError(f"kvstream transfer of room {self.room} failed: {self.failure}")
        exc.is_from_another_rank = not own  # type: ignore[attr-defined]  # SGLang reads it
        raise exc

    def clear(self) -> None:
        raise NotImplementedError
