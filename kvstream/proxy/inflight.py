"""The legs a proxy has in flight per engine URL, and the most of them lately.

An engine's announced load (``Announce.requests``) counts every proxy's requests, as of
its last heartbeat: up to a heartbeat (plus vLLM's idle second) old. This proxy's own
count is exact and current. The routers estimate an engine's load as this proxy's count
now plus what the announcement holds beyond the most this proxy had there lately (other
proxies' requests): so a conversation's next turn, sent the moment the last one ended,
is not priced against its own last turn still announced (``routing/service.py``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Final

__all__ = ["WINDOW_S", "Inflight"]

WINDOW_S: Final = 3.0  # how far back "lately" reaches: an announcement's age, bounded
MAX_MARKS: Final = 1024  # changes remembered per URL (more within the window: a lower peak)


class Inflight(collections.Counter[str]):
    """A ``Counter`` of legs in flight per URL that also remembers its recent values."""

    def __init__(self, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._window, self._clock = window_s, clock
        self._marks: dict[str, collections.deque[tuple[float, int]]] = {}

    def __setitem__(self, url: str, n: int) -> None:
        super().__setitem__(url, n)
        marks = self._marks.get(url)
        if marks is None:
            marks = self._marks[url] = collections.deque(maxlen=MAX_MARKS)
        marks.append((self._clock(), n))

    def recent(self, url: str) -> int:
        """The most legs in flight at ``url`` within the window (now included)."""
        cut = self._clock() - self._window
        marks = self._marks.get(url, ())
        return max([n for t, n in marks if t >= cut] + [self[url]])

    def peaks(self) -> dict[str, int]:
        """``recent`` of every URL with one above zero."""
        return {u: p for u in list(self._marks) if (p := self.recent(u)) > 0}
