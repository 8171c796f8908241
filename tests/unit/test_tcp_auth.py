"""TcpTransport reads frames only from connections that answered its challenge with a
MAC under a token it issued: strangers, wrong tokens, wrong ids and replayed hellos are
closed and counted, hold a handshake slot for ``auth_timeout_s`` at most, and never
lock an authenticated sender on their address out. Real sockets and threads on
127.0.0.0/8.

Time bounds are derived from the limits set here, not measured: a connection must be
gone twice ``auth_timeout_s`` after its connect began (the acceptor cuts it at
``auth_timeout_s`` after accept, polling with that deadline).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np
import pytest

from kvstream._exceptions import DataPlaneError, ProtocolError
from kvstream.dataplane.tcp import TcpLimits, TcpTransport
from kvstream.dataplane.tcp_conn import (
    ACCEPTED,
    CHALLENGE,
    HEADER,
    HELLO_HEAD,
    HELLO_MAGIC,
    MAGIC,
    REPLY,
    client_handshake,
    hello,
)
from tests.unit.test_tcp_transport import _msg, _raw, _tag, _trust, _until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

STRANGERS = 72  # more than the per-address cap of 64 the attack filled before
FRAME = HEADER.pack(MAGIC, 0, _tag(9), 8) + b"abcdefgh"  # a valid 24-byte header, 8 bytes


@contextlib.asynccontextmanager
async def _open(**kw: Any) -> AsyncIterator[TcpTransport]:
    t = await TcpTransport.open("127.0.0.1", **kw)
    try:
        yield t
    finally:
        await t.close()


def _closed_by(socks: list[socket.socket], deadlines: list[float]) -> list[float | None]:
    """When each socket saw its peer close (EOF or reset), reading what came first; None
    for one still open at its deadline."""
    closed: list[float | None] = [None] * len(socks)
    with selectors.DefaultSelector() as sel:
        for i, s in enumerate(socks):
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, i)
        left = len(socks)
        while left and time.monotonic() < max(deadlines):
            for key, _ in sel.select(max(deadlines) - time.monotonic()):
                i = key.data
                try:
                    if socks[i].recv(4096):
                        continue
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    pass
                closed[i] = time.monotonic()
                sel.unregister(socks[i])
                left -= 1
    return closed


def _refused(s: socket.socket) -> bool:
    """The server hung up without a reply (what a hello it rejects gets)."""
    s.settimeout(5)
    with contextlib.suppress(ConnectionResetError):
        return s.recv(REPLY.size) == b""
    return True


@pytest.mark.parametrize("sent", [pytest.param(b"", id="silent"),
                                  pytest.param(FRAME, id="frame-header")])
async def test_strangers_cannot_lock_an_authenticated_sender_on_their_address_out(sent):
    """The reported attack: 72 connections from 127.0.0.1, each silent or sending a valid
    frame header and its 8 bytes, then idle. Meanwhile a's frame from 127.0.0.1 lands
    (its address may hold a single authenticated connection: strangers never count); no
    stranger's frame does; each stranger is gone by twice auth_timeout_s after its
    connect; all are counted."""
    auth_s = 1.0
    limits = TcpLimits(auth_timeout_s=auth_s, max_connections_per_ip=1)
    async with _open(lanes=1) as a, _open(limits=limits) as b:
        _trust(a, b)
        stranger_recv = b.post_recv(np.zeros(8, np.uint8), _tag(9))
        starts: list[float] = []

        def attack() -> list[socket.socket]:
            socks = []
            for _ in range(STRANGERS):
                starts.append(time.monotonic())
                s = _raw(b.address)
                with contextlib.suppress(OSError):  # b may hang up at once
                    s.sendall(sent)
                socks.append(s)
            return socks

        socks = await anyio.to_thread.run_sync(attack)
        try:
            if not sent:  # each address holds 8 in the handshake; newer ones evict older
                await _until(lambda: (b.statistics().evicted, b.statistics().authenticating)
                             == (STRANGERS - 8, 8))
            buf = np.zeros(4, np.uint8)
            r = b.post_recv(buf, _tag(0))
            await a.send(b.address, _msg(4, 7), _tag(0))
            with anyio.fail_after(10):
                await r.wait()
            assert (buf == 7).all()
            if not sent:  # a came while all 8 were held: it evicted the oldest
                assert b.statistics().evicted == STRANGERS - 7
            deadlines = [t + 2 * auth_s for t in starts]
            closed = await anyio.to_thread.run_sync(_closed_by, socks, deadlines)
        finally:
            for s in socks:
                s.close()
        late = [i for i, (t, d) in enumerate(zip(closed, deadlines, strict=True))
                if t is None or t > d]
        assert not late
        await _until(lambda: b.statistics().authenticating == 0)
        stats = b.statistics()
        assert stats.unauthenticated == STRANGERS and stats.accepted == stats.connections == 1
        assert stats.refused_per_ip == stats.refused == 0 and stats.bad_frames == 0
        assert not stranger_recv.completed and stats.waiting == 0


async def test_one_address_evicts_only_its_own_handshakes_until_all_are_full():
    """127.0.0.2's ten connections evict only its own (2 per address may be in the
    handshake); 127.0.0.3's stays until the bound in all (4) is full, then goes first."""
    limits = TcpLimits(max_unauthenticated=4, max_unauthenticated_per_ip=2, auth_timeout_s=30)

    def counts() -> tuple[int, int]:
        stats = b.statistics()
        return stats.evicted, stats.authenticating

    async with _open(limits=limits) as b:
        with contextlib.ExitStack() as stack:
            try:
                other = stack.enter_context(_raw(b.address, "127.0.0.3"))
            except OSError as exc:
                pytest.skip(f"cannot connect from 127.0.0.3: {exc}")
            await _until(lambda: counts() == (0, 1))
            for _ in range(10):
                stack.enter_context(_raw(b.address, "127.0.0.2"))
            await _until(lambda: counts() == (8, 3))
            for _ in range(2):
                stack.enter_context(_raw(b.address, "127.0.0.4"))
            await _until(lambda: counts() == (9, 4))
            assert len(other.recv(CHALLENGE.size, socket.MSG_WAITALL)) == CHALLENGE.size
            assert await anyio.to_thread.run_sync(_refused, other)


async def test_wrong_tokens_ids_addresses_and_replays_are_refused_and_counted():
    """Each is closed without a reply, long before auth_timeout_s (60 s here), and a frame
    written right behind a refused hello never lands; the right hello is accepted."""
    async with _open(limits=TcpLimits(auth_timeout_s=60)) as b, _open() as c:
        r = b.post_recv(np.zeros(8, np.uint8), _tag(9))
        token = b.token_for("a")

        def attempts() -> list[bool]:
            refused = []
            for address, sender_id, key in ((b.address, b"a", c.token_for("a")),  # c's token
                                            (b.address, b"b", token),  # a's token, b's id
                                            (c.address, b"a", token)):  # meant for c
                with _raw(b.address) as s:
                    challenge = CHALLENGE.unpack(s.recv(CHALLENGE.size, socket.MSG_WAITALL))[1]
                    s.sendall(hello(key, challenge, sender_id, address) + FRAME)
                    refused.append(_refused(s))
            with _raw(b.address) as s:  # the right one, captured ...
                challenge = CHALLENGE.unpack(s.recv(CHALLENGE.size, socket.MSG_WAITALL))[1]
                captured = hello(token, challenge, b"a", b.address)
                s.sendall(captured)
                assert s.recv(REPLY.size, socket.MSG_WAITALL) == REPLY.pack(ACCEPTED)
            with _raw(b.address) as s:  # ... and replayed: another challenge, refused
                again = CHALLENGE.unpack(s.recv(CHALLENGE.size, socket.MSG_WAITALL))[1]
                assert again != challenge
                s.sendall(captured + FRAME)
                refused.append(_refused(s))
            for head in (HELLO_HEAD.pack(HELLO_MAGIC ^ 1, 1),  # bad magic
                         HELLO_HEAD.pack(HELLO_MAGIC, 1025),  # id over 1024 bytes
                         HELLO_HEAD.pack(HELLO_MAGIC, 0),  # no id
                         FRAME):  # a frame instead of a hello
                with _raw(b.address) as s:
                    s.recv(CHALLENGE.size, socket.MSG_WAITALL)
                    s.sendall(head)
                    refused.append(_refused(s))
            return refused

        assert await anyio.to_thread.run_sync(attempts) == [True] * 8
        await _until(lambda: b.statistics().unauthenticated == 8)
        stats = b.statistics()
        assert stats.accepted == 1 and stats.evicted == 0 and stats.waiting == 0
        assert not r.completed


async def test_the_transport_refuses_to_send_without_or_with_bad_credentials():
    async with _open(lanes=1) as a, _open() as b:
        with pytest.raises(DataPlaneError, match="no credentials"):
            await a.send(b.address, _msg(4, 1), _tag(0))
        with pytest.raises(ProtocolError):
            await a.send(b"tcp:nowhere:1", _msg(4, 1), _tag(0))
        a.set_credentials(b.address, "a", b.token_for("b"))  # a token for someone else
        with pytest.raises(DataPlaneError, match="refused our credentials"):
            await a.send(b.address, _msg(4, 1), _tag(0))
        await _until(lambda: b.statistics().unauthenticated == 1)
        _trust(a, b)
        r = b.post_recv(np.zeros(4, np.uint8), _tag(0))
        await a.send(b.address, _msg(4, 2), _tag(0))
        with anyio.fail_after(10):
            await r.wait()
        assert b.statistics().accepted == 1


async def test_tokens_and_credentials_are_checked():
    async with _open() as a, _open() as b:
        token = a.token_for("prefill-1")
        assert len(token) == 32 and a.token_for("prefill-1") == token
        assert token not in (a.token_for("prefill-2"), b.token_for("prefill-1"))
        assert len(a.token_for("é" * 512)) == 32  # 1024 bytes of UTF-8
        for bad_id in ("", "x" * 1025, "é" * 513, "\udc80"):
            with pytest.raises(ProtocolError, match="sender id"):
                a.token_for(bad_id)
            with pytest.raises(ProtocolError, match="sender id"):
                a.set_credentials(b.address, bad_id, token)
        for bad_token in (b"", token[:31], token + b"x", bytearray(token)):
            with pytest.raises(ProtocolError, match="32 bytes"):
                a.set_credentials(b.address, "a", bad_token)  # type: ignore[arg-type]
        with pytest.raises(ProtocolError):
            a.set_credentials(b"tcp:localhost:1", "a", token)


def _server(behaviour: str) -> tuple[bytes, socket.socket]:
    """A listening socket whose one connection is answered with ``behaviour``."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            s, _ = server.accept()
            with s:
                if behaviour == "garbage":
                    s.sendall(os.urandom(CHALLENGE.size))
                elif behaviour == "silent":
                    s.recv(1)  # until the client gives up
                # "close": hang up at once

    threading.Thread(target=serve, daemon=True).start()
    return f"tcp:127.0.0.1:{server.getsockname()[1]}".encode(), server


@pytest.mark.parametrize(("behaviour", "error"), [
    ("garbage", "not a kvstream TCP data port"),
    ("close", "closed before its challenge"),
    ("silent", "timed out"),
])
async def test_a_client_handshake_fails_clearly_and_within_connect_timeout(behaviour, error):
    connect_s = 0.5
    address, server = _server(behaviour)
    try:
        async with _open(lanes=1, limits=TcpLimits(connect_timeout_s=connect_s)) as a:
            a.set_credentials(address, "a", bytes(32))
            start = time.monotonic()
            with pytest.raises(DataPlaneError, match=error):
                await a.send(address, _msg(4, 1), _tag(0))
            assert time.monotonic() - start < 2 * connect_s
    finally:
        server.close()


async def test_client_handshake_is_what_a_raw_sender_can_use():
    """The helper the transport's lanes use works on a plain socket (tests use it)."""
    async with _open() as b:
        with _raw(b.address) as s:
            await anyio.to_thread.run_sync(client_handshake, s, b.address, b"raw",
                                           b.token_for("raw"), time.monotonic() + 5)
        await _until(lambda: b.statistics().accepted == 1)
