"""TcpTransport closes connections that do not authenticate in time, stop inside a frame
header or stall inside a payload, caps the connections one address holds (authenticated
ones only: strangers cannot fill it), and leaves an honest connection idle between
frames alone. Real sockets and threads on 127.0.0.0/8.

Waits are bounded: ``_until`` gives up after 10 s and a raw socket's read after 5 s,
25 to 50 times the 0.2 s ``idle_timeout_s`` used here (a stall is seen within twice it)
and 10 times the 0.5 s ``auth_timeout_s`` (a handshake is cut at it: the acceptor polls
with that deadline).
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import time

import anyio
import numpy as np
import pytest

from kvstream._exceptions import ConfigError, DataPlaneError
from kvstream.dataplane.tcp import TcpLimits, TcpTransport
from kvstream.dataplane.tcp_conn import CHALLENGE, HEADER, HELLO_HEAD, HELLO_MAGIC, MAGIC
from tests.unit.test_tcp_transport import _authed, _exchange, _msg, _pair, _tag, _until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

IDLE_S = 0.2
AUTH_S = 0.5
QUICK = TcpLimits(idle_timeout_s=IDLE_S, auth_timeout_s=AUTH_S)


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


def _hung_up_by(s: socket.socket, deadline: float) -> bool:
    """Whether the other end closed by ``deadline`` (monotonic); what it sent is read."""
    s.settimeout(max(deadline - time.monotonic(), 0.0))
    with contextlib.suppress(ConnectionResetError):
        while s.recv(4096):
            s.settimeout(max(deadline - time.monotonic(), 0.0))
    return True


def test_the_new_limits_are_checked():
    for bad in ({"max_connections_per_ip": 0}, {"idle_timeout_s": 0.0},
                {"idle_timeout_s": -1.0}, {"idle_timeout_s": math.inf},
                {"idle_timeout_s": math.nan}, {"auth_timeout_s": 0.0},
                {"auth_timeout_s": math.inf}, {"max_unauthenticated": 0},
                {"max_unauthenticated_per_ip": 0}):
        with pytest.raises(ConfigError, match="positive"):
            TcpLimits(**bad)
    d = TcpLimits()
    assert (d.max_connections_per_ip, d.idle_timeout_s, d.auth_timeout_s) == (64, 10.0, 2.0)
    assert (d.max_unauthenticated, d.max_unauthenticated_per_ip) == (64, 8)


async def test_a_silent_stranger_is_closed_at_the_handshake_bound():
    """It gets the challenge and nothing else; it is gone ``auth_timeout_s`` after accept
    (allowed: twice that from before its connect), counted, and never a connection."""
    async with _pair(lanes=1, limits=QUICK) as (a, b):
        start = time.monotonic()
        with _connect(b.address) as silent:
            await _until(lambda: b.statistics().authenticating == 1)
            assert b.statistics().connections == 0
            assert await anyio.to_thread.run_sync(_hung_up_by, silent, start + 2 * AUTH_S)
        await _until(lambda: b.statistics().authenticating == 0)
        assert b.statistics().unauthenticated == 1 and b.statistics().accepted == 0
        buf = np.zeros(4, np.uint8)
        r = b.post_recv(buf, _tag(0))
        await a.send(b.address, _msg(4, 7), _tag(0))
        with anyio.fail_after(10):
            await r.wait()
        assert (buf == 7).all() and b.statistics().accepted == 1


FRAME = HEADER.pack(MAGIC, 0, _tag(9), 4) + b"abcd"  # small, unexpected: it waits
CUT = HEADER.pack(MAGIC, 0, _tag(1), 1000)  # on the receive posted below


@pytest.mark.parametrize("sent", [
    pytest.param(CUT[:10], id="first-header-cut"),
    pytest.param(FRAME + CUT[:10], id="later-header-cut"),
    pytest.param(FRAME + CUT + b"y" * 500, id="payload-cut"),
])
async def test_a_stalled_connection_is_closed_and_its_receive_stays_posted(sent):
    async with _pair(limits=QUICK) as (a, b):
        buf = np.zeros(1000, np.uint8)
        r = b.post_recv(buf, _tag(1))
        with _authed(b) as s:
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


async def test_the_handshake_has_a_deadline_however_its_bytes_trickle():
    """A plausible hello, a byte every 0.05 s: no read ever waits long, but it cannot be
    whole before 52 s; it is cut at its deadline, 0.5 s after accept."""
    async with _pair(limits=QUICK) as (_, b):
        start = time.monotonic()
        with _connect(b.address) as s:
            assert len(s.recv(CHALLENGE.size, socket.MSG_WAITALL)) == CHALLENGE.size
            hello = HELLO_HEAD.pack(HELLO_MAGIC, 1000) + b"x" * 1032

            def trickle() -> float:
                with contextlib.suppress(OSError):  # b hangs up part-way
                    for byte in hello:
                        if select.select([s], [], [], 0)[0]:  # EOF: b closed it
                            break
                        s.send(bytes([byte]))
                        time.sleep(0.05)
                return time.monotonic()

            assert await anyio.to_thread.run_sync(trickle) < start + 2 * AUTH_S
        await _until(lambda: b.statistics().unauthenticated == 1)
        stats = b.statistics()
        assert stats.authenticating == 0 and stats.accepted == 0 and stats.evicted == 0


async def test_one_address_holds_at_most_its_cap_and_others_still_get_through():
    """Three authenticated ones held from 127.0.0.2, the fourth told it is at the limit;
    a's three lanes from 127.0.0.1 fit their own cap, and a fourth from there is refused
    too. No idle timeout in reach."""
    limits = TcpLimits(max_connections_per_ip=3, idle_timeout_s=60.0)
    async with _pair(lanes=3, limits=limits) as (a, b), contextlib.AsyncExitStack() as stack:
        _connect(b.address, "127.0.0.2").close()  # skips where that source is unusable
        await _until(lambda: b.statistics().unauthenticated == 1)
        held = [stack.enter_context(_authed(b, "127.0.0.2")) for _ in range(3)]
        await _until(lambda: b.statistics().connections == 3)
        with pytest.raises(DataPlaneError, match="limit of connections"):
            _authed(b, "127.0.0.2")
        assert b.statistics().refused_per_ip == 1
        await _exchange(a, b, [np.full(10_000, i, np.uint8) for i in range(12)])
        await _until(lambda: b.statistics().connections == 6)  # a's three lanes too
        with pytest.raises(DataPlaneError, match="limit of connections"):
            _authed(b)
        assert b.statistics().refused_per_ip == 2
        for s in held:
            s.close()
        await _until(lambda: b.statistics().connections == 3)
        stats = b.statistics()
        assert stats.accepted == 6 and stats.refused == 0 and stats.timed_out == 0


async def test_an_established_connection_may_idle_between_frames():
    """Idle 1 s between frames, five times idle_timeout_s (a stall is seen within two)
    and twice auth_timeout_s: the second frame comes on the same connection, and nothing
    was timed out; an authenticated connection that never sent a frame stays too."""
    async with _pair(lanes=1, limits=QUICK) as (a, b):
        with _authed(b) as quiet:
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
            assert stats.accepted == 2 and stats.connections == 2 and stats.timed_out == 0
            quiet.sendall(FRAME)  # still served
            await _until(lambda: b.statistics().waiting == 1)


async def test_statistics_count_from_zero():
    t = await TcpTransport.open("127.0.0.1")
    try:
        stats = t.statistics()
        assert stats.refused_per_ip == 0 and stats.timed_out == 0
        assert stats.authenticating == stats.unauthenticated == stats.evicted == 0
    finally:
        await t.close()
