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
from typing import Any, Final

__all__ = ["WINDOW_S", "Inflight"]

WINDOW_S: Final = 3.0  # how far back "lately" reaches: an announcement's age, bounded
MAX_MARKS: Final = 1024  # changes remembered per URL (more within the window: a lower peak)


class Inflight(collections.Counter[str]):
    """A ``Counter`` of legs in flight per URL that also remembers its recent values."""

    def __init__(self, *args: Any, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic, **kw: int) -> None:
        self._window, self._clock = window_s, clock
        self._marks: dict[str, collections.deque[tuple[float, int]]] = {}
        super().__init__(*args, **kw)  # Counter's signature (``copy`` calls it so)

    def __setitem__(self, url: str, n: int) -> None:
        super().__setitem__(url, n)
        marks = self._marks.get(url)
        if marks is None:
            marks = self._marks[url] = collections.deque(maxlen=MAX_MARKS)
        marks.append((self._clock(), n))
        self._prune(url)

    def _prune(self, url: str) -> None:
        """Marks older than the window go; a URL with none and nothing in flight too."""
        marks, cut = self._marks.get(url), self._clock() - self._window
        while marks and marks[0][0] < cut:
            marks.popleft()
        if not marks and not self[url]:
            self._marks.pop(url, None)

    def recent(self, url: str) -> int:
        """The most legs in flight at ``url`` within the window (now included)."""
        self._prune(url)
        return max([n for _, n in self._marks.get(url, ())] + [self[url]])

    def peaks(self) -> dict[str, int]:
        """``recent`` of every URL with one above zero."""
        return {u: p for u in list(self._marks) if (p := self.recent(u)) > 0}
