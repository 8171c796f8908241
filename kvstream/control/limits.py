"""What keeps a flood on the control plane bounded: handlers in flight, and log lines.

A bus spawns one task per message so a slow handler does not hold up the next; without a
bound, a peer (or a forger with a valid key of its own) publishing fast would spawn tasks
without end. ``InFlight`` caps them per checked sender and in all; what is over is refused
at once ("busy"), never queued. ``Throttle`` keeps a flood of bad messages from becoming
a flood of warnings: the first of each kind per interval is logged, the rest counted.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Final

__all__ = ["PER_SENDER", "TOTAL", "InFlight", "Throttle"]

PER_SENDER: Final = 64  # control handlers one instance may have running here at once
TOTAL: Final = 1024  # ... and all instances together


class InFlight:
    def __init__(self, per_sender: int = PER_SENDER, total: int = TOTAL) -> None:
        self.per_sender, self.total = per_sender, total
        self._running: Counter[str] = Counter()
        self._all = 0
        self.refused = 0

    def enter(self, sender: str) -> bool:
        if self._all >= self.total or self._running[sender] >= self.per_sender:
            self.refused += 1
            return False
        self._running[sender] += 1
        self._all += 1
        return True

    def leave(self, sender: str) -> None:
        self._all -= 1
        self._running[sender] -= 1
        if self._running[sender] <= 0:
            del self._running[sender]

    def __len__(self) -> int:
        return self._all


class Throttle:
    """Log ``kind`` at most once per ``every_s``, saying how many were not logged."""

    def __init__(self, log: logging.Logger, every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._every, self._clock = log, every_s, clock
        self._last: dict[str, float] = {}
        self._quiet: Counter[str] = Counter()

    def warning(self, kind: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, kind, msg, *args)

    def log(self, level: int, kind: str, msg: str, *args: object,
            exc_info: bool = False) -> None:
        now = self._clock()
        if now - self._last.get(kind, -self._every) < self._every:
            self._quiet[kind] += 1
            return
        self._last[kind] = now
        quiet = self._quiet.pop(kind, 0)
        suffix = f" (and {quiet} more since the last report)" if quiet else ""
        self._log.log(level, msg + suffix, *args, exc_info=exc_info)
