"""Can this host reach NATS: a plain look at each server, and a real client round trip."""

from __future__ import annotations

import asyncio
import time

import msgspec

from kvstream.control.auth import NatsAuth
from kvstream.control.reach import classify, probe
from kvstream.doctor.report import NatsReport

__all__ = ["check_nats"]


async def _round_trip(url: str, timeout: float, auth: NatsAuth | None) -> tuple[float, float]:
    """Connect the way an agent does, one flush through the server, close; the two times
    in ms. Raises ``NatsConnectError`` (connect) or ``ControlPlaneError`` (flush)."""
    from kvstream.control.bus import ControlBus

    t0 = time.perf_counter()
    bus = await ControlBus.connect(url, name="kvstream-doctor", timeout=timeout, auth=auth)
    t1 = time.perf_counter()
    try:
        await bus.flush(timeout=timeout)
        t2 = time.perf_counter()
    finally:
        await bus.close()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


async def check_nats(url: str, timeout: float, auth: NatsAuth | None = None) -> NatsReport:
    """Both looks at once, each within about ``timeout`` seconds; never raises. A refused
    or unresolvable server answers at once, not after ``timeout``."""
    t0 = time.perf_counter()
    report = await _check(url, timeout, auth)
    return msgspec.structs.replace(report, seconds=round(time.perf_counter() - t0, 3))


async def _check(url: str, timeout: float, auth: NatsAuth | None) -> NatsReport:
    from kvstream._exceptions import ControlPlaneError, NatsConnectError

    servers_task = asyncio.ensure_future(probe(url, timeout))
    try:
        connect_ms, flush_ms = await asyncio.wait_for(_round_trip(url, timeout, auth), 3 * timeout)
    except NatsConnectError as exc:
        return NatsReport(url=url, servers=tuple(await servers_task), connected=False,
                          cause=exc.cause, detail=exc.detail or str(exc))
    except asyncio.TimeoutError:
        return NatsReport(url=url, servers=tuple(await servers_task), connected=False,
                          cause="timeout", detail=f"no connection within {3 * timeout:g}s")
    except (ControlPlaneError, OSError) as exc:  # connected, then the flush failed
        cause, words = classify(exc.__cause__ or exc)
        return NatsReport(url=url, servers=tuple(await servers_task), connected=False,
                          cause=cause, detail=f"connected, but a flush failed: {words}")
    return NatsReport(url=url, servers=tuple(await servers_task), connected=True,
                      connect_ms=round(connect_ms, 3), flush_ms=round(flush_ms, 3))
