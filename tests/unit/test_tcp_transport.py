"""TcpTransport keeps the loopback/UCX tag rules over real sockets on 127.0.0.1, bounds
what strangers can make it hold, and leaves no thread or fd behind. Senders authenticate
(``_trust``); tests/unit/test_tcp_auth.py tests the handshake itself."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
import typing
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio
import numpy as np
import pytest
import torch

from kvstream._exceptions import ConfigError, DataPlaneError, ProtocolError
from kvstream.dataplane import wire
from kvstream.dataplane.tcp import TcpLimits, TcpRecv, TcpTransport
from kvstream.dataplane.tcp_conn import (
    ACCEPTED,
    AUTH_MAGIC,
    CHALLENGE,
    HEADER,
    HELLO_HEAD,
    MAGIC,
    REPLY,
    check_tcp_address,
    client_handshake,
)
from kvstream.dataplane.transport import PostedReceive, Transport
from tests.unit.test_loopback_transport import METHODS, _shape

if TYPE_CHECKING:  # mypy: it fits the protocols
    def _fits(a: TcpTransport, b: TcpRecv) -> tuple[Transport, PostedReceive]:
        return a, b

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

XFER = 0x2BCD_0000_0001  # bit 63 of its tags clear


def _tag(layer: int, kind: int = wire.KIND_DATA, xfer: int = XFER) -> int:
    return wire.make_tag(xfer, layer, kind)


def _msg(n: int, value: int) -> np.ndarray:
    return np.full(n, value, dtype=np.uint8)


def _our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvstream-tcp")]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _exchange(a, dst, srcs: list[np.ndarray]) -> None:
    """Send every buffer from ``a`` to ``dst`` at once, each on its own tag: all land intact."""
    bufs = [np.zeros_like(src) for src in srcs]
    recvs = [dst.post_recv(buf, _tag(i)) for i, buf in enumerate(bufs)]
    async with anyio.create_task_group() as tg:
        for i, src in enumerate(srcs):
            tg.start_soon(a.send, dst.address, src, _tag(i))
    with anyio.fail_after(10):
        for r in recvs:
            await r.wait()
    assert all(np.array_equal(x, y) for x, y in zip(srcs, bufs, strict=True))


async def _until(cond: Callable[[], bool]) -> None:
    """A reader thread's work shows up a moment after a send returns."""
    with anyio.fail_after(10):
        while not cond():
            await anyio.sleep(0.005)


def _trust(sender: TcpTransport, receiver: TcpTransport, sender_id: str = "a") -> None:
    """What the agents do over the control plane: the receiver issues, the sender sets."""
    sender.set_credentials(receiver.address, sender_id, receiver.token_for(sender_id))


@contextlib.asynccontextmanager
async def _pair(**kw: typing.Any) -> AsyncIterator[tuple[TcpTransport, TcpTransport]]:
    """Two transports, each able to send to the other and to itself."""
    a = await TcpTransport.open("127.0.0.1", **kw)
    b = await TcpTransport.open("127.0.0.1", **kw)
    for sender, receiver in ((a, b), (b, a), (a, a), (b, b)):
        _trust(sender, receiver)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


def _raw(address: bytes, source: str = "127.0.0.1") -> socket.socket:
    """A plain connection, not authenticated: a stranger's."""
    host, port = address.decode()[4:].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))


def _authed(t: TcpTransport, source: str = "127.0.0.1", sender_id: str = "raw") -> socket.socket:
    """A plain connection that passed ``t``'s handshake: it may write frames by hand."""
    s = _raw(t.address, source)
    try:
        client_handshake(s, t.address, sender_id.encode(), t.token_for(sender_id),
                         time.monotonic() + 5)
        s.settimeout(5)
    except BaseException:
        s.close()
        raise
    return s


def _deaf_server() -> tuple[bytes, Callable[[], None]]:
    """A peer that passes any hello and then never reads: sends to it block. Returns its
    address and a function that closes it."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):  # closed: done
            while True:
                s, _ = server.accept()
                held.append(s)
                s.sendall(CHALLENGE.pack(AUTH_MAGIC, os.urandom(16)))
                _, n = HELLO_HEAD.unpack(s.recv(HELLO_HEAD.size, socket.MSG_WAITALL))
                s.recv(n + 32, socket.MSG_WAITALL)
                s.sendall(REPLY.pack(ACCEPTED))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def close() -> None:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(5)
        for s in held:
            s.close()

    return f"tcp:127.0.0.1:{server.getsockname()[1]}".encode(), close


@pytest.mark.parametrize("name", METHODS)
def test_the_transport_matches_the_protocol(name):
    assert _shape(TcpTransport, name) == _shape(Transport, name)


def test_the_receive_matches_the_protocol():
    assert TcpTransport.vectored is True and typing.get_type_hints(Transport)["vectored"] is bool
    assert _shape(TcpRecv, "wait") == _shape(PostedReceive, "wait")
    assert isinstance(TcpRecv.completed, property)
    assert typing.get_type_hints(TcpRecv.completed.fget)["return"] is bool
    assert isinstance(TcpTransport.address, property)


@pytest.mark.parametrize("address", [
    b"tcp:127.0.0.1:1", b"tcp:198.18.0.2:65535", b"tcp:[::1]:40123", b"tcp:[fe80::1]:9",
])
def test_check_address_accepts_literals(address):
    assert check_tcp_address(address) is address


@pytest.mark.parametrize("address", [
    b"", b"tcp:", b"udp:127.0.0.1:5", b"tcp:127.0.0.1", b"tcp:127.0.0.1:0",
    b"tcp:127.0.0.1:65536", b"tcp:127.0.0.1:080", b"tcp:127.0.0.1:+80", b"tcp:127.0.0.1: 80",
    b"tcp:localhost:80", b"tcp:0.0.0.0:80", b"tcp:[::]:80", b"tcp:224.0.0.1:80",
    b"tcp:::1:80", b"tcp:[127.0.0.1]:80", b"tcp:[fe80::1%eth0]:80", b"tcp:1.2.3.4:5:6",
    b"tcp:01.2.3.4:5", b"tcp:1.2.3.4:5\n", b"tcp:\xff.0.0.1:5", b"tcp:1.2.3.4:" + b"1" * 80,
])
def test_check_address_refuses_everything_else(address):
    with pytest.raises(ProtocolError):
        check_tcp_address(address)


async def test_open_checks_its_settings_and_advertises():
    with pytest.raises(ConfigError, match="lanes"):
        await TcpTransport.open("127.0.0.1", lanes=0)
    with pytest.raises(ConfigError, match="IP literals"):
        await TcpTransport.open("localhost")
    for bad in ({"max_connections": 0}, {"connect_timeout_s": 0.0}, {"socket_buffer_bytes": 0}):
        with pytest.raises(ConfigError, match="positive"):
            TcpLimits(**bad)
    t = await TcpTransport.open("0.0.0.0", advertise="198.18.7.1")
    try:
        assert t.address.startswith(b"tcp:198.18.7.1:")
        assert t.check_address(t.address) is t.address
        with pytest.raises(ProtocolError):
            t.check_address(b"loopback-1")
    finally:
        await t.close()
    t = await TcpTransport.open()  # a wildcard bind advertises the loopback
    try:
        assert t.address.startswith(b"tcp:127.0.0.1:")
    finally:
        await t.close()


async def test_a_receive_completes_only_on_its_exact_64_bit_tag_in_order():
    async with _pair() as (a, b):
        high, low = (1 << 63) | _tag(1), _tag(1)
        assert high != low
        r_low = b.post_recv(np.zeros(4, np.uint8), low)
        bufs = [np.zeros(4, np.uint8) for _ in range(3)]
        r_high = [b.post_recv(buf, high) for buf in bufs]
        for value in (1, 2, 3):
            await a.send(b.address, _msg(4, value), high)
        with anyio.fail_after(10):
            for r in r_high:
                await r.wait()
        assert [int(buf[0]) for buf in bufs] == [1, 2, 3] and not r_low.completed
        assert [r.nbytes for r in r_high] == [4, 4, 4]
        with pytest.raises(DataPlaneError, match="64 bits"):
            b.post_recv(np.zeros(4, np.uint8), 1 << 64)


async def test_many_layers_over_lanes_and_to_itself():
    """Layers spread over the lanes, each lands whole; a transport can send to itself."""
    async with _pair(lanes=3) as (a, b):
        rng = np.random.default_rng(1)
        for dst in (b, a):
            await _exchange(a, dst, [rng.integers(0, 256, 300_000, dtype=np.uint8)
                                     for _ in range(12)])
        assert a.statistics().accepted == 3  # its own three lanes; b got the other three
        assert b.statistics().accepted == 3


async def test_tensors_views_and_bad_buffers():
    async with _pair() as (a, b):
        bf16 = torch.arange(8, dtype=torch.bfloat16)
        dst = torch.zeros(8, dtype=torch.bfloat16)
        r = b.post_recv(dst, _tag(0))
        await a.send(b.address, bf16, _tag(0))
        view = memoryview(bytearray(8))
        r2 = b.post_recv(view, _tag(0, wire.KIND_CREDIT))
        await a.send(b.address, wire.encode_credit(5), _tag(0, wire.KIND_CREDIT))
        with anyio.fail_after(10):
            await r.wait()
            await r2.wait()
        assert torch.equal(dst, bf16) and r.nbytes == 16 and wire.decode_credit(view) == 5
        with pytest.raises(DataPlaneError, match="read-only"):
            b.post_recv(b"12345678", _tag(1))
        with pytest.raises(DataPlaneError, match="contiguous"):
            await a.send(b.address, np.zeros((4, 4), np.uint8)[:, 1], _tag(1))
        with pytest.raises(ProtocolError):
            await a.send(b"tcp:nowhere:1", _msg(1, 1), _tag(1))


async def test_vectored_messages_are_one_byte_stream_over_their_buffers():
    """A list of buffers is one message: cut one way when sent, another when received
    (more than IOV_MAX pieces on both sides too); shorter and longer ones as for one."""
    async with _pair() as (a, b):
        src = np.random.default_rng(3).integers(0, 256, 3 * 4096, dtype=np.uint8)
        plane = src.reshape(12, 1024)  # 2-D rows, as RegisteredKV.rows gives
        pieces = [src[:100], src[100:1024], plane[1:5], torch.from_numpy(src[5 * 1024:9 * 1024].copy()),
                  memoryview(src[9 * 1024:].tobytes())]
        dst = np.zeros(len(src) + 10, np.uint8)
        r = b.post_recv([dst[:7], dst[7:5000].reshape(-1, 1), dst[5000:]], _tag(0))
        await a.send(b.address, pieces, _tag(0))
        many_src = [np.full(3, i % 251, np.uint8) for i in range(3000)]
        many_dst = [np.zeros(3, np.uint8) for _ in range(3000)]
        r_many = b.post_recv(many_dst, _tag(1))
        await a.send(b.address, many_src, _tag(1))
        r_long = b.post_recv([np.zeros(4, np.uint8), np.zeros(4, np.uint8)], _tag(2))
        await a.send(b.address, [_msg(5, 1), _msg(5, 2)], _tag(2))
        with anyio.fail_after(10):
            await r.wait()
            await r_many.wait()
            with pytest.raises(DataPlaneError, match="truncated"):
                await r_long.wait()
        assert r.nbytes == len(src) and np.array_equal(dst[:len(src)], src)
        assert not dst[len(src):].any()
        assert all(np.array_equal(x, y) for x, y in zip(many_src, many_dst, strict=True))
        await a.send(b.address, [_msg(2, 5), _msg(3, 6)], _tag(3))  # unexpected, small
        await _until(lambda: b.statistics().waiting == 1)
        halves = [np.zeros(4, np.uint8), np.zeros(4, np.uint8)]
        r_late = b.post_recv(halves, _tag(3))
        assert r_late.completed and r_late.nbytes == 5
        assert halves[0].tolist() == [5, 5, 6, 6] and halves[1].tolist() == [6, 0, 0, 0]
        with pytest.raises(DataPlaneError, match="read-only"):
            b.post_recv([np.zeros(4, np.uint8), b"1234"], _tag(4))


async def test_small_unexpected_messages_wait_for_their_receive_in_order():
    async with _pair() as (a, b):
        for value, tag in ((1, _tag(3)), (2, _tag(4)), (3, _tag(3))):
            await a.send(b.address, _msg(2, value), tag)
        await _until(lambda: b.statistics().waiting == 3)
        bufs = [np.zeros(2, np.uint8) for _ in range(3)]
        recvs = [b.post_recv(bufs[0], _tag(3)), b.post_recv(bufs[1], _tag(3)),
                 b.post_recv(bufs[2], _tag(4))]
        assert all(r.completed for r in recvs)
        assert [int(x[0]) for x in bufs] == [1, 3, 2]
        assert b.statistics().waiting == 0 and b.statistics().waiting_bytes == 0


async def test_large_unexpected_messages_are_dropped_and_counted():
    async with _pair() as (a, b):
        await a.send(b.address, _msg(64 * 1024, 1), _tag(5))
        await _until(lambda: b.dropped_unread == 1)
        assert b.statistics().waiting == 0
        buf = np.zeros(64 * 1024, np.uint8)
        r = b.post_recv(buf, _tag(5))
        assert not r.completed  # the dropped one does not complete it
        await a.send(b.address, _msg(64 * 1024, 2), _tag(5))
        with anyio.fail_after(10):
            await r.wait()
        assert (buf == 2).all()


async def test_the_waiting_queue_is_bounded():
    async with _pair(limits=TcpLimits(unexpected_messages=2)) as (a, b):
        for value in (1, 2, 3):
            await a.send(b.address, _msg(8, value), _tag(6))
        await _until(lambda: b.dropped_unread == 1)
        assert b.statistics().waiting == 2


async def test_a_longer_frame_fails_only_that_receive():
    async with _pair() as (a, b):
        buf = np.zeros(8, np.uint8)
        r = b.post_recv(buf, _tag(1))
        await a.send(b.address, _msg(100_000, 5), _tag(1))
        with anyio.fail_after(10), pytest.raises(DataPlaneError, match="truncated"):
            await r.wait()
        assert not buf.any() and b.statistics().truncated == 1
        ok = b.post_recv(buf, _tag(1))  # the rest of that frame was read away
        await a.send(b.address, _msg(8, 6), _tag(1))
        with anyio.fail_after(10):
            await ok.wait()
        assert (buf == 6).all() and b.statistics().bad_frames == 0


async def test_garbage_connections_do_not_disturb_an_honest_transfer():
    rng = random.Random(7)
    noise = bytes(rng.randrange(256) for _ in range(4096))
    assert int.from_bytes(noise[:4], "little") != MAGIC
    async with _pair() as (a, b):
        honest = [np.full(1 << 20, i, np.uint8) for i in range(16)]
        bufs = [np.zeros(1 << 20, np.uint8) for _ in honest]
        recvs = [b.post_recv(buf, _tag(i)) for i, buf in enumerate(bufs)]
        cut = np.zeros(1000, np.uint8)
        r_cut = b.post_recv(cut, _tag(0, xfer=XFER + 1))

        def garbage() -> None:
            frames = [noise, HEADER.pack(MAGIC ^ 1, 0, _tag(0), 8) + b"x" * 8,
                      HEADER.pack(MAGIC, 0, _tag(0), 1 << 40), HEADER.pack(MAGIC, 1, _tag(0), 0)]
            for frame in frames:  # b may hang up before it has all of it
                with _raw(b.address) as s, contextlib.suppress(OSError):  # no hello
                    s.sendall(frame)
                with _authed(b) as s, contextlib.suppress(OSError):
                    s.sendall(frame)
            with _authed(b) as s:  # a frame cut short: its receive stays posted
                s.sendall(HEADER.pack(MAGIC, 0, _tag(0, xfer=XFER + 1), 1000) + b"y" * 500)

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, garbage)
            for i, src in enumerate(honest):
                tg.start_soon(a.send, b.address, src, _tag(i))
        with anyio.fail_after(10):
            for r in recvs:
                await r.wait()
        assert all(np.array_equal(x, y) for x, y in zip(honest, bufs, strict=True))
        # Only a's four lanes stay open, so the cut frame's reader has been through it too.
        await _until(lambda: b.statistics().bad_frames == 4 and b.statistics().connections == 4)
        assert b.statistics().unauthenticated == 4  # the strangers' never got to a frame
        assert not r_cut.completed  # a reader took it, the frame broke off, it went back
        await a.send(b.address, _msg(1000, 9), _tag(0, xfer=XFER + 1))
        with anyio.fail_after(10):
            await r_cut.wait()
        assert (cut == 9).all() and b.statistics().truncated == 0


async def test_accepted_connections_are_bounded():
    async with _pair(limits=TcpLimits(max_connections=2)) as (a, b):
        socks = [_authed(b) for _ in range(2)]
        try:
            for _ in range(2):  # authenticated, but no room: told so
                with pytest.raises(DataPlaneError, match="limit of connections"):
                    _authed(b)
            assert b.statistics().refused == 2 and b.statistics().connections == 2
        finally:
            for s in socks:
                s.close()
        await _until(lambda: b.statistics().connections == 0)
        r = b.post_recv(np.zeros(4, np.uint8), _tag(0))  # and it accepts again
        await a.send(b.address, _msg(4, 1), _tag(0))
        with anyio.fail_after(10):
            await r.wait()


async def test_drain_completes_the_oldest_receive_without_writing():
    async with _pair() as (a, b):
        first, second = _msg(4, 0xAB), _msg(4, 0xCD)
        r1, r2 = b.post_recv(first, _tag(7)), b.post_recv(second, _tag(7))
        await b.drain(_tag(7))
        assert r1.completed and not r2.completed
        await r1.wait()
        assert r1.nbytes == 0 and (first == 0xAB).all()
        await b.drain(_tag(7))
        assert r2.completed and r2.nbytes == 0
        await b.drain(_tag(8))  # nothing posted: a zero-byte message waits, as with UCX
        buf = _msg(4, 0xEF)
        r3 = b.post_recv(buf, _tag(8))
        assert r3.completed and r3.nbytes == 0 and (buf == 0xEF).all()
        await a.send(b.address, _msg(4, 1), _tag(7))  # after the drain: unexpected, small
        await _until(lambda: b.statistics().waiting == 1)
        assert (second == 0xCD).all()


async def test_a_sweep_drops_only_what_waits_on_no_live_tag():
    async with _pair() as (a, b):
        live = {_tag(0, xfer=7)}
        for tag in (_tag(0, xfer=1), _tag(0, xfer=2), _tag(0, xfer=7), _tag(0, xfer=2)):
            await a.send(b.address, _msg(8, 0x78), tag)
        await _until(lambda: b.statistics().waiting == 4)
        assert b.sweep(lambda t: t in live, max_messages=2) == 2
        assert b.sweep(lambda t: t in live) == 1 and b.sweep(lambda t: t in live) == 0
        buf = np.zeros(8, np.uint8)
        assert b.post_recv(buf, _tag(0, xfer=7)).completed and (buf == 0x78).all()


async def test_forget_peer_then_send_again_on_new_connections():
    async with _pair(lanes=1) as (a, b):
        for round_ in range(2):
            buf = np.zeros(4, np.uint8)
            r = b.post_recv(buf, _tag(0))
            await a.send(b.address, _msg(4, round_ + 1), _tag(0))
            with anyio.fail_after(10):
                await r.wait()
            assert (buf == round_ + 1).all()
            a.forget_peer(b.address)
        assert b.statistics().accepted == 2
        await _until(lambda: b.statistics().connections == 0)


async def test_a_restarted_peer_gets_a_fresh_connection():
    """The old connection is seen closed before the next send, which reconnects instead
    of writing into it (that message would be lost)."""
    async with _pair(lanes=1) as (a, _):
        c = await TcpTransport.open("127.0.0.1")
        _trust(a, c)
        port = int(c.address.rsplit(b":", 1)[1])
        for value in (1, 2):
            buf = np.zeros(4, np.uint8)
            r = c.post_recv(buf, _tag(0))
            await a.send(c.address, _msg(4, value), _tag(0))
            with anyio.fail_after(10):
                await r.wait()
            assert (buf == value).all() and c.statistics().accepted == 1
            await c.close()
            if value == 1:
                c = await TcpTransport.open("127.0.0.1", port)
                with pytest.raises(DataPlaneError, match="refused our credentials"):
                    await a.send(c.address, _msg(4, value), _tag(0))  # a new secret
                assert c.statistics().unauthenticated == 1
                _trust(a, c)
        with pytest.raises(DataPlaneError, match="cannot connect"):
            await a.send(c.address, _msg(4, 3), _tag(0))


async def test_forget_peer_ends_a_send_the_peer_does_not_read():
    """A peer that takes nothing: a send queued behind the blocked one can be cancelled
    (it is withdrawn unsent, or this would hang), and forget_peer ends the blocked one."""
    address, close_server = _deaf_server()
    errors: list[DataPlaneError] = []

    async def send() -> None:
        try:
            await a.send(address, np.zeros(64 << 20, np.uint8), _tag(0))
        except DataPlaneError as exc:
            errors.append(exc)

    async with _pair(lanes=1) as (a, _), anyio.create_task_group() as tg:
        a.set_credentials(address, "a", bytes(32))
        tg.start_soon(send)
        await anyio.sleep(0.2)  # most likely blocked by then; it fails either way
        with anyio.move_on_after(0.2) as scope:
            await a.send(address, _msg(1 << 20, 1), _tag(0))
        assert scope.cancelled_caught
        a.forget_peer(address)
    close_server()
    assert len(errors) == 1


async def test_close_fails_posted_receives_and_leaks_nothing():
    threads, fds = len(_our_threads()), _fds()
    async with _pair(lanes=2) as (a, b):
        r_done = b.post_recv(np.zeros(1 << 20, np.uint8), _tag(0))
        await a.send(b.address, np.ones(1 << 20, np.uint8), _tag(0))
        await a.send(a.address, _msg(4, 1), _tag(1))  # a small one left waiting at a
        with anyio.fail_after(10):
            await r_done.wait()
        await _until(lambda: a.statistics().waiting == 1)
        pending = b.post_recv(np.zeros(4, np.uint8), _tag(2))
        assert len(_our_threads()) > threads
        await b.close()
        await b.close()  # idempotent
        assert pending.completed
        with pytest.raises(DataPlaneError, match="closed"):
            await pending.wait()
        with pytest.raises(DataPlaneError, match="closed"):
            b.post_recv(np.zeros(4, np.uint8), _tag(2))
        for use in (b.send(a.address, _msg(1, 1), _tag(1)), b.drain(_tag(1))):
            with pytest.raises(DataPlaneError, match="closed"):
                await use
        with pytest.raises(DataPlaneError):
            await a.send(b.address, _msg(4, 1), _tag(3))
    assert len(_our_threads()) == threads
    assert _fds() == fds


async def test_close_ends_a_blocked_send_and_a_cancelled_wait_leaves_the_receive_posted():
    address, close_server = _deaf_server()
    fds = _fds()
    errors: list[DataPlaneError] = []
    a = await TcpTransport.open("127.0.0.1")
    a.set_credentials(address, "a", bytes(32))
    _trust(a, a)

    async def send() -> None:
        try:
            await a.send(address, np.zeros(64 << 20, np.uint8), _tag(0))
        except DataPlaneError as exc:
            errors.append(exc)

    buf = np.zeros(4, np.uint8)
    r = a.post_recv(buf, _tag(1))
    with anyio.move_on_after(0.05) as scope:
        await r.wait()  # nothing comes: cancelled
    assert scope.cancelled_caught and not r.completed
    await a.send(a.address, _msg(4, 3), _tag(1))
    with anyio.fail_after(10):
        await r.wait()  # still posted: the message lands in it
    assert (buf == 3).all()
    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        await anyio.sleep(0.2)
        await a.close()
    close_server()
    assert len(errors) == 1 and _fds() == fds - 1  # the server socket is gone too
