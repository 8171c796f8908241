"""The control plane's flood bounds (control/limits.py)."""

from __future__ import annotations

import logging

from kvstream.control.limits import InFlight, Throttle


def test_in_flight_is_bounded_per_sender_and_in_all():
    f = InFlight(per_sender=2, total=3)
    assert f.enter("a") and f.enter("a") and not f.enter("a")  # a's share is used up
    assert f.enter("b") and not f.enter("c") and len(f) == 3  # so is the total
    assert f.refused == 2
    f.leave("a")
    assert f.enter("c") and not f.enter("a")
    for who in ("a", "b", "c"):
        f.leave(who)
    assert len(f) == 0 and f.enter("a") and f.enter("a")


def test_a_flood_of_warnings_is_one_line_per_interval(caplog):
    now = [0.0]
    t = Throttle(logging.getLogger("kvstream.test"), every_s=1.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvstream.test"):
        for _ in range(1000):
            t.warning("bad", "bad message %s", "x")
        now[0] = 1.5
        t.warning("bad", "bad message %s", "y")
        t.warning("other", "other kind")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad message x", "bad message y (and 999 more since the last report)",
                     "other kind"]
