"""The receiving side of the TCP data plane: the listener, the handshake, one reader
thread per authenticated connection, and the tag table those threads and the event loop
share.

One thread (the acceptor) polls the listener and every connection still in the handshake
(dataplane.tcp_conn describes it): a stranger costs an fd and a small buffer for at most
``auth_timeout_s``, never a thread, and no byte it sends reaches the tag table. A reader
thread starts only for a connection whose hello proved it holds a token we issued.

Tag rules as with UCX and the loopback (dataplane.tcp explains the bounds and why).
A receive taken out of the table by a reader is being written into: nobody else may
complete it; if its frame is cut short it goes back to the head of its tag's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import anyio

from kvstream._exceptions import DataPlaneError
from kvstream.dataplane.tcp_conn import (
    ACCEPTED,
    AUTH_MAGIC,
    BUSY,
    CHALLENGE,
    HEADER,
    HELLO_HEAD,
    HELLO_MAGIC,
    MAC_BYTES,
    MAGIC,
    MAX_ID_BYTES,
    REPLY,
    Conn,
    RecvStalled,
    TcpLimits,
    hello_mac,
    limit,
    make_token,
    tune,
)

__all__ = ["Inbox", "TcpRecv", "TcpStatistics"]

JOIN_S: Final = 5.0  # close() waits this long for the threads to end
_ACCEPT_BATCH: Final = 64  # accepts per wake-up, so handshakes in flight still get turns


@dataclass(frozen=True)
class TcpStatistics:
    accepted: int  # connections authenticated and admitted since open
    refused: int  # authenticated, told BUSY and closed: max_connections were open
    connections: int  # authenticated connections open now
    bad_frames: int  # connections closed for a bad magic, flags or length
    truncated: int  # receives failed by a longer frame
    dropped_unread: int  # unexpected frames dropped: too large, or no room to wait
    waiting: int  # unexpected messages waiting for a receive
    waiting_bytes: int
    refused_per_ip: int  # as ``refused``: max_connections_per_ip from its address open
    timed_out: int  # authenticated connections closed: a frame stalled idle_timeout_s
    authenticating: int  # connections in the handshake now
    # Closed before authenticating: a bad or wrong hello, none within auth_timeout_s,
    # a hang-up, or evicted by a newer connection (counted in ``evicted`` too).
    unauthenticated: int
    evicted: int  # in the handshake when its max_unauthenticated(_per_ip) bound was full


class _Pending:
    """A connection in the handshake (acceptor thread only): what of its hello is here."""

    __slots__ = ("buf", "challenge", "deadline", "ip", "need", "sock")

    def __init__(self, sock: socket.socket, ip: str, deadline: float, challenge: bytes) -> None:
        self.sock, self.ip, self.deadline, self.challenge = sock, ip, deadline, challenge
        self.buf = bytearray()
        self.need = HELLO_HEAD.size  # then the whole hello, once its head tells the length


class TcpRecv:
    """A posted receive; ``nbytes`` is what its message wrote (0 for a drain)."""

    def __init__(self, views: list[memoryview], tag: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.tag = tag
        self.nbytes = 0
        self._views = views  # one message fills them in order
        self._capacity = sum(len(v) for v in views)
        self._loop = loop
        self._done = anyio.Event()
        self._completed = False
        self._error: str | None = None

    @property
    def completed(self) -> bool:
        return self._completed

    async def wait(self) -> None:
        await self._done.wait()
        if self._error is not None:
            raise DataPlaneError(f"TCP receive (tag {self.tag:#x}) failed: {self._error}")

    def _finish(self, nbytes: int, error: str | None = None) -> None:
        """Once, from any thread, by whoever took it out of the table."""
        self.nbytes, self._error, self._completed = nbytes, error, True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits now
            self._loop.call_soon_threadsafe(self._done.set)

    def _truncate(self, length: int) -> None:
        self._finish(0, f"message truncated: {length} bytes for a {self._capacity}-byte buffer")

    def _fill(self, data: bytearray) -> None:
        if len(data) > self._capacity:
            self._truncate(len(data))
            return
        offset = 0
        for view in limit(self._views, len(data)):
            view[:] = data[offset:offset + len(view)]
            offset += len(view)
        self._finish(len(data))


class Inbox:
    """What arrives at one listening socket, matched against the receives posted here."""

    def __init__(self, listener: socket.socket, limits: TcpLimits,
                 loop: asyncio.AbstractEventLoop, address: bytes) -> None:
        self.limits = limits
        self.loop = loop
        self._listener = listener
        self._address = address  # what hellos are bound to
        self._secret = secrets.token_bytes(32)  # tokens die with this transport
        listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the acceptor
        self._lock = threading.Lock()  # everything below; reader threads share it
        self._posted: dict[int, deque[TcpRecv]] = {}
        self._unexpected: dict[int, deque[bytearray]] = {}
        self._waiting = self._waiting_bytes = 0
        self._incoming: dict[Conn, threading.Thread] = {}  # authenticated, with readers
        self._per_ip: dict[str, int] = {}  # authenticated connections open, by address
        self._accepted = self._refused = self._bad_frames = self._truncated = 0
        self._refused_per_ip = self._timed_out = 0
        self._authenticating = self._unauthenticated = self._evicted = 0
        self.dropped_unread = 0
        self.closed = False
        self._name = f"kvstream-tcp-{listener.getsockname()[1]}"
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"{self._name}-accept")
        self._acceptor.start()

    def statistics(self) -> TcpStatistics:
        with self._lock:
            return TcpStatistics(self._accepted, self._refused, len(self._incoming),
                                 self._bad_frames, self._truncated, self.dropped_unread,
                                 self._waiting, self._waiting_bytes, self._refused_per_ip,
                                 self._timed_out, self._authenticating,
                                 self._unauthenticated, self._evicted)

    def token_for(self, peer_id: bytes) -> bytes:
        return make_token(self._secret, peer_id)

    def check_open(self, what: str) -> None:
        if self.closed:
            raise DataPlaneError(f"TCP transport {what} is closed")

    def post(self, recv: TcpRecv, what: str) -> None:
        with self._lock:
            self.check_open(what)
            data = self._pop_waiting(recv.tag)
            if data is None:
                self._posted.setdefault(recv.tag, deque()).append(recv)
                return
        recv._fill(data)

    def drain(self, tag: int, what: str) -> None:
        """The oldest posted receive completes unwritten; with none free, a zero-byte
        message waits instead (UCX's self-send would): it completes the receive a reader
        holds if that one's frame is cut short and comes back."""
        with self._lock:
            self.check_open(what)
            recv = self._claim(tag)
            if recv is None:
                self._keep(tag, bytearray())
        if recv is not None:
            recv._finish(0)

    def sweep(self, is_live: Callable[[int], bool], max_messages: int) -> int:
        with self._lock:
            tags = list(self._unexpected)
        dead = [tag for tag in tags if not is_live(tag)]  # not under our lock: foreign code
        dropped = 0
        with self._lock:
            for tag in dead:
                while dropped < max_messages and self._pop_waiting(tag) is not None:
                    dropped += 1
        return dropped

    def close(self) -> None:
        """Fail posted receives and stop every thread (blocking, bounded: a worker thread)."""
        with self._lock:
            self.closed = True
            posted = [recv for queue in self._posted.values() for recv in queue]
            self._posted.clear()
            self._unexpected.clear()
            self._waiting = self._waiting_bytes = 0
        for recv in posted:
            recv._finish(0, "transport closed")
        deadline = time.monotonic() + JOIN_S
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._acceptor.join(JOIN_S)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        with self._lock:
            incoming = list(self._incoming.items())
        for conn, _ in incoming:
            conn.shutdown()
        for _, thread in incoming:
            thread.join(max(0.0, deadline - time.monotonic()))

    # --- the table (lock held) ---------------------------------------------------------

    def _claim(self, tag: int) -> TcpRecv | None:
        queue = self._posted.get(tag)
        if not queue:
            return None
        recv = queue.popleft()
        if not queue:
            del self._posted[tag]
        return recv

    def _pop_waiting(self, tag: int) -> bytearray | None:
        queue = self._unexpected.get(tag)
        if not queue:
            return None
        data = queue.popleft()
        if not queue:
            del self._unexpected[tag]
        self._waiting -= 1
        self._waiting_bytes -= len(data)
        return data

    def _keep(self, tag: int, data: bytearray) -> None:
        limits = self.limits
        if self._waiting >= limits.unexpected_messages or \
                self._waiting_bytes + len(data) > limits.unexpected_bytes:
            self.dropped_unread += 1
            return
        self._unexpected.setdefault(tag, deque()).append(data)
        self._waiting += 1
        self._waiting_bytes += len(data)

    # --- threads ----------------------------------------------------------------------

    def _repost(self, recv: TcpRecv) -> None:
        with self._lock:
            data = None if self.closed else self._pop_waiting(recv.tag)
            if data is None and not self.closed:
                self._posted.setdefault(recv.tag, deque()).appendleft(recv)
                return
        if data is None:
            recv._finish(0, "transport closed")
        else:
            recv._fill(data)

    def _accept_loop(self) -> None:
        """Accept, and carry every connection in the handshake forward as its bytes come
        (non-blocking sockets, one poll); admitted ones get a reader thread."""
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        pending: dict[int, _Pending] = {}  # by fd, in accept order: oldest deadline first
        try:
            while not self.closed:
                timeout = None
                if pending:
                    left = next(iter(pending.values())).deadline - time.monotonic()
                    timeout = max(0, int(left * 1000) + 1)  # ms, rounded up
                for fd, _ in poller.poll(timeout):
                    if fd == self._listener.fileno():
                        self._accept_some(poller, pending)
                    elif (p := pending.get(fd)) is not None:
                        self._advance(poller, pending, p)
                now = time.monotonic()
                for p in [p for p in pending.values() if p.deadline <= now]:
                    self._drop(poller, pending, p)
        finally:
            for p in list(pending.values()):
                self._drop(poller, pending, p)

    def _accept_some(self, poller: select.poll, pending: dict[int, _Pending]) -> None:
        limits = self.limits
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:
                if not self.closed:
                    time.sleep(0.05)  # out of fds, or an aborted handshake: try again
                return
            ip = str(peer[0])
            mine = [p for p in pending.values() if p.ip == ip]
            if len(mine) >= limits.max_unauthenticated_per_ip:
                self._drop(poller, pending, mine[0], evicted=True)
            elif len(pending) >= limits.max_unauthenticated:
                self._drop(poller, pending, next(iter(pending.values())), evicted=True)
            challenge = secrets.token_bytes(16)
            try:
                sock.setblocking(False)
                sock.send(CHALLENGE.pack(AUTH_MAGIC, challenge))  # an empty buffer takes it
            except OSError:
                sock.close()
                with self._lock:
                    self._unauthenticated += 1
                continue
            p = _Pending(sock, ip, time.monotonic() + limits.auth_timeout_s, challenge)
            pending[sock.fileno()] = p
            poller.register(sock, select.POLLIN)
            with self._lock:
                self._authenticating += 1

    def _drop(self, poller: select.poll, pending: dict[int, _Pending], p: _Pending, *,
              evicted: bool = False, admitted: bool = False) -> None:
        """Take ``p`` out of the handshake; close it unless it was ``admitted``."""
        del pending[p.sock.fileno()]
        poller.unregister(p.sock)
        with self._lock:
            self._authenticating -= 1
            if not admitted:
                self._unauthenticated += 1
                self._evicted += evicted
        if not admitted:
            p.sock.close()

    def _advance(self, poller: select.poll, pending: dict[int, _Pending], p: _Pending) -> None:
        """Read what is there of ``p``'s hello (never past it: frames follow); judge it
        once whole."""
        while True:
            try:
                chunk = p.sock.recv(p.need - len(p.buf))
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._drop(poller, pending, p)
                return
            p.buf += chunk
            if len(p.buf) < p.need:
                continue
            if p.need == HELLO_HEAD.size:
                magic, n = HELLO_HEAD.unpack(p.buf)
                if magic != HELLO_MAGIC or not 1 <= n <= MAX_ID_BYTES:
                    self._drop(poller, pending, p)
                    return
                p.need += n + MAC_BYTES
                continue
            peer_id = bytes(p.buf[HELLO_HEAD.size:-MAC_BYTES])
            want = hello_mac(self.token_for(peer_id), p.challenge, peer_id, self._address)
            if not hmac.compare_digest(want, bytes(p.buf[-MAC_BYTES:])):
                self._drop(poller, pending, p)
                return
            self._drop(poller, pending, p, admitted=True)
            self._admit(p.sock, p.ip)
            return

    def _admit(self, sock: socket.socket, ip: str) -> None:
        """An authenticated connection: a reader thread, if the caps leave room."""
        limits = self.limits
        conn = Conn(sock)
        conn.acquire()  # the reader's own reference
        thread = threading.Thread(target=self._read_loop, args=(conn, ip), daemon=True,
                                  name=f"{self._name}-read")
        with self._lock:
            full = len(self._incoming) >= limits.max_connections
            crowded = self._per_ip.get(ip, 0) >= limits.max_connections_per_ip
            admit = not self.closed and not full and not crowded
            if admit:
                self._incoming[conn] = thread
                self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
                self._accepted += 1
            elif full or not crowded:
                self._refused += 1
            else:
                self._refused_per_ip += 1
        with contextlib.suppress(OSError):  # a fresh socket's empty buffer takes it
            sock.send(REPLY.pack(ACCEPTED if admit else BUSY))
        if admit:
            sock.setblocking(True)
            tune(sock, limits)
            thread.start()
        else:
            conn.shutdown()
            conn.release()

    def _read_loop(self, conn: Conn, ip: str) -> None:
        head = bytearray(HEADER.size)
        view = memoryview(head)
        try:
            conn.set_recv_timeout(self.limits.idle_timeout_s)
            while self._read_header(conn, view):
                magic, flags, tag, length = HEADER.unpack(head)
                if magic != MAGIC or flags or length > self.limits.max_frame_bytes:
                    with self._lock:
                        self._bad_frames += 1
                    return
                if not self._read_frame(conn, tag, length):
                    return
        except RecvStalled:
            with self._lock:
                self._timed_out += 1
        except OSError:
            return  # reset, or shut down by close(): this connection only
        finally:
            conn.shutdown()
            conn.release()
            with self._lock:
                self._incoming.pop(conn, None)
                left = self._per_ip.pop(ip) - 1
                if left:
                    self._per_ip[ip] = left

    def _read_header(self, conn: Conn, view: memoryview) -> bool:
        """A whole frame header; False on EOF first. Between frames the connection may
        idle for ever (it is reused), but a header begun must go on: ``RecvStalled``
        when it stalls."""
        got = 0
        while got < len(view):
            try:
                n = conn.recv_some(view[got:])
            except RecvStalled:
                if got:
                    raise
                continue  # idle between frames: one wake-up per idle_timeout_s
            if n == 0:
                return False
            got += n
        return True

    def _read_frame(self, conn: Conn, tag: int, length: int) -> bool:
        """One frame's payload; False if the connection ended inside it."""
        with self._lock:
            recv = self._claim(tag)
        if recv is None:
            return self._read_unexpected(conn, tag, length)
        if length > recv._capacity:
            with self._lock:
                self._truncated += 1
            recv._truncate(length)
            return conn.discard(length)
        try:
            views = recv._views if length == recv._capacity else limit(recv._views, length)
            got = conn.recv_views(views)
        except BaseException:
            self._repost(recv)
            raise
        if got < length:
            self._repost(recv)
            return False
        recv._finish(length)
        return True

    def _read_unexpected(self, conn: Conn, tag: int, length: int) -> bool:
        if length > self.limits.unexpected_message_bytes:
            with self._lock:
                self.dropped_unread += 1
            return conn.discard(length)
        data = bytearray(length)
        if conn.recv_exact(memoryview(data)) < length:
            return False
        with self._lock:
            recv = self._claim(tag)  # posted while the payload arrived
            if recv is None:
                self._keep(tag, data)
                return True
        recv._fill(data)
        return True
