"""TcpTransport frees the slots of connections that send nothing, stop inside a frame
header or stall inside a payload, caps the connections one address holds, and leaves an
honest connection idle between frames alone. Real sockets and threads on 127.0.0.0/8.

Waits are bounded: ``_until`` gives up after 10 s and a raw socket's read after 5 s,
25 to 50 times the 0.2 s ``idle_timeout_s`` used here (a stall is seen within twice it).
"""

from __future__ import annotations

import contextlib
import math
import socket
import time

import anyio
import numpy as np
import pytest

from kvstream._exceptions import ConfigError
from kvstream.dataplane.tcp import TcpLimits, TcpTransport
from kvstream.dataplane.tcp_conn import HEADER, MAGIC
from tests.unit.test_tcp_transport import _exchange, _msg, _pair, _tag, _until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

IDLE_S = 0.2
QUICK = TcpLimits(idle_timeout_s=IDLE_S)


def _connect(address: bytes, source: str = "127.0.0.1") -> socket.socket:
    host, port = address.decode()[4:].rsplit(":", 1)
    try:
        return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))
    except OSError as exc:
        if source == "127.0.0.1":
            raise
        pytest.skip(f"cannot connect from {source}: {exc}")


def _hung_up(s: socket.socket) -> bool:
    """The other end closed: EOF or a reset (socket.timeout after 5 s if it did not)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_new_limits_are_checked():
    for bad in ({"max_connections_per_ip": 0}, {"idle_timeout_s": 0.0},
                {"idle_timeout_s": -1.0}, {"idle_timeout_s": math.inf},
                {"idle_timeout_s": math.nan}):
        with pytest.raises(ConfigError, match="positive"):
            TcpLimits(**bad)
    assert TcpLimits().max_connections_per_ip == 64 and TcpLimits().idle_timeout_s == 10.0


async def test_a_silent_connection_is_closed_and_its_slot_reused():
    async with _pair(lanes=1, limits=TcpLimits(max_connections=1, idle_timeout_s=IDLE_S)) \
            as (a, b):
        with _connect(b.address) as silent:
            await _until(lambda: b.statistics().connections == 1)
            with _connect(b.address) as second:  # the slot is held: refused
                await _until(lambda: b.statistics().refused == 1)
                assert await anyio.to_thread.run_sync(_hung_up, second)
            assert await anyio.to_thread.run_sync(_hung_up, silent)
        await _until(lambda: b.statistics().connections == 0)
        assert b.statistics().timed_out == 1
        buf = np.zeros(4, np.uint8)
        r = b.post_recv(buf, _tag(0))
        await a.send(b.address, _msg(4, 7), _tag(0))
        with anyio.fail_after(10):
            await r.wait()
        assert (buf == 7).all() and b.statistics().accepted == 2


FRAME = HEADER.pack(MAGIC, 0, _tag(9), 4) + b"abcd"  # small, unexpected: it waits
CUT = HEADER.pack(MAGIC, 0, _tag(1), 1000)  # on the receive posted below


@pytest.mark.parametrize("sent", [
    pytest.param(b"", id="nothing"),
    pytest.param(CUT[:10], id="first-header-cut"),
    pytest.param(FRAME + CUT[:10], id="later-header-cut"),
    pytest.param(FRAME + CUT + b"y" * 500, id="payload-cut"),
])
async def test_a_stalled_connection_is_closed_and_its_receive_stays_posted(sent):
    async with _pair(limits=QUICK) as (a, b):
        buf = np.zeros(1000, np.uint8)
        r = b.post_recv(buf, _tag(1))
        with _connect(b.address) as s:
            s.sendall(sent)
            assert await anyio.to_thread.run_sync(_hung_up, s)
        await _until(lambda: b.statistics().connections == 0)
        assert b.statistics().timed_out == 1 and b.statistics().bad_frames == 0
        assert b.statistics().waiting == (1 if sent.startswith(FRAME) else 0)
        assert not r.completed  # a reader held it in the payload case: it went back
        await a.send(b.address, _msg(1000, 9), _tag(1))
        with anyio.fail_after(10):
            await r.wait()
        assert (buf == 9).all() and b.statistics().timed_out == 1


async def test_the_first_header_has_a_deadline_however_its_bytes_trickle():
    """A byte every 0.05 s never lets a recv wait out the timeout, but the header cannot
    be whole before 1.15 s, long past its deadline of 0.2 s after accept."""
    async with _pair(limits=QUICK) as (_, b):
        with _connect(b.address) as s:

            def trickle() -> None:
                with contextlib.suppress(OSError):  # b hangs up half-way
                    for byte in CUT:
                        s.send(bytes([byte]))
                        time.sleep(0.05)

            await anyio.to_thread.run_sync(trickle)
        await _until(lambda: b.statistics().connections == 0)
        assert b.statistics().timed_out == 1 and b.statistics().bad_frames == 0


async def test_one_address_holds_at_most_its_cap_and_others_still_get_through():
    """Three held from 127.0.0.2, the fourth refused; a's three lanes from 127.0.0.1 fit
    their own cap, and a fourth from there is refused too. No idle timeout in reach."""
    limits = TcpLimits(max_connections_per_ip=3, idle_timeout_s=60.0)
    async with _pair(lanes=3, limits=limits) as (a, b), contextlib.AsyncExitStack() as stack:
        held = [stack.enter_context(_connect(b.address, "127.0.0.2")) for _ in range(3)]
        await _until(lambda: b.statistics().connections == 3)
        with _connect(b.address, "127.0.0.2") as extra:
            await _until(lambda: b.statistics().refused_per_ip == 1)
            assert await anyio.to_thread.run_sync(_hung_up, extra)
        await _exchange(a, b, [np.full(10_000, i, np.uint8) for i in range(12)])
        await _until(lambda: b.statistics().connections == 6)  # a's three lanes too
        with _connect(b.address) as extra:
            await _until(lambda: b.statistics().refused_per_ip == 2)
            assert await anyio.to_thread.run_sync(_hung_up, extra)
        for s in held:
            s.close()
        await _until(lambda: b.statistics().connections == 3)
        stats = b.statistics()
        assert stats.accepted == 6 and stats.refused == 0 and stats.timed_out == 0


async def test_an_established_connection_may_idle_between_frames():
    """Idle 1 s between frames, five times idle_timeout_s (a stall is seen within two):
    the second frame comes on the same connection, and nothing was timed out."""
    async with _pair(lanes=1, limits=QUICK) as (a, b):
        for value in (1, 2):
            buf = np.zeros(4, np.uint8)
            r = b.post_recv(buf, _tag(0))
            await a.send(b.address, _msg(4, value), _tag(0))
            with anyio.fail_after(10):
                await r.wait()
            assert (buf == value).all()
            if value == 1:
                await anyio.sleep(5 * IDLE_S)
        stats = b.statistics()
        assert stats.accepted == 1 and stats.connections == 1 and stats.timed_out == 0


async def test_statistics_count_from_zero():
    t = await TcpTransport.open("127.0.0.1")
    try:
        stats = t.statistics()
        assert stats.refused_per_ip == 0 and stats.timed_out == 0
    finally:
        await t.close()
