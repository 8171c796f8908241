"""The socket half of the TCP data plane: addresses, the handshake, framing, one
connection's I/O.

A connection begins with a challenge-response handshake (little endian throughout):

* server -> client ``CHALLENGE``: ``AUTH_MAGIC`` and 16 random bytes;
* client -> server ``HELLO_HEAD`` (``HELLO_MAGIC``, length of the sender id), the id
  (1..``MAX_ID_BYTES`` bytes of UTF-8) and a 32-byte MAC: keyed BLAKE2b under the token
  the server issued for that id (``make_token``), over the challenge, the id and the
  server's advertised address (``hello_mac``);
* server -> client ``REPLY``: ``ACCEPTED``, or ``BUSY`` (its connection caps are full);
  a hello it does not accept gets no reply, only a close.

The challenge is fresh per connection, so a captured hello is worthless on another one;
the address binds it to the server it was meant for. The client waits for the reply
before its first frame: credentials gone stale (the peer restarted with a new secret)
then fail the send at once, instead of frames vanishing into a socket the peer closes.

Then frames: ``HEADER`` (magic, flags, 64-bit tag, 64-bit length) and exactly ``length``
payload bytes. Everything here is blocking socket code meant to run on threads: CPython
releases the GIL inside ``sendmsg`` and ``recv_into``, so the kernel copies straight
between the socket and the caller's buffer while the event loop runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import math
import re
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from kvstream._exceptions import ConfigError, DataPlaneError, ProtocolError

__all__ = ["ACCEPTED", "AUTH_MAGIC", "BUSY", "CHALLENGE", "HEADER", "HELLO_HEAD", "HELLO_MAGIC",
           "IOV_MAX", "MAC_BYTES", "MAGIC", "MAX_ID_BYTES", "REPLY", "TOKEN_BYTES", "Conn",
           "RecvStalled", "TcpLimits", "byte_view", "byte_views", "check_tcp_address",
           "client_handshake", "format_address", "hello", "hello_mac", "limit", "make_token",
           "parse_address", "peer_id_bytes", "tune"]

MAGIC: Final = 0x3154_564B  # b"KVT1" read as little-endian u32
HEADER: Final = struct.Struct("<IIQQ")  # magic, flags (0), tag, payload length
AUTH_MAGIC: Final = 0x3141_564B  # b"KVA1": the challenge (and handshake version)
HELLO_MAGIC: Final = 0x3148_564B  # b"KVH1"
ACCEPTED: Final = 0x4B4F_564B  # b"KVOK"
BUSY: Final = 0x5942_564B  # b"KVBY"
CHALLENGE: Final = struct.Struct("<I16s")  # magic, random challenge
HELLO_HEAD: Final = struct.Struct("<IH")  # magic, sender id length; then the id, the MAC
REPLY: Final = struct.Struct("<I")
TOKEN_BYTES: Final = 32
MAC_BYTES: Final = 32
MAX_ID_BYTES: Final = 1024
_TOKEN_PERSON: Final = b"kvs-tcp-token"
_HELLO_PERSON: Final = b"kvs-tcp-hello"
MAX_ADDRESS_BYTES: Final = 64  # "tcp:[" + the longest IPv6 literal + "]:65535" fits
_PREFIX: Final = b"tcp:"
_PORT = re.compile(r"[1-9][0-9]{0,4}")
_DISCARD_CHUNK: Final = 256 * 1024
IOV_MAX: Final = 1024  # buffers per sendmsg / recvmsg_into (Linux's UIO_MAXIOV)
_TIMEVAL: Final = struct.Struct("@ll")  # struct timeval (Linux): seconds, microseconds
# A peer host that vanished without a FIN would hold its reader thread and a connection
# slot for ever; keepalive probes of idle connections end those within about a minute.
_KEEPALIVE: Final = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))


@dataclass(frozen=True)
class TcpLimits:
    """The bounds that keep a peer (honest, late or forged) from growing our memory,
    threads or fds without limit; defaults suit a few dozen peers."""

    # Authenticated connections held at once; one over it is told BUSY and closed.
    max_connections: int = 256
    # Of those, from one remote address. An honest agent holds at most its ``lanes``
    # (<= MAX_LANES, 64) connections to us, so one agent never meets this whatever its
    # lanes, and 16 agents sharing a host at the default 4 lanes fit too; one host alone
    # takes at most a quarter of max_connections. Only authenticated ones count: a
    # stranger cannot fill it.
    max_connections_per_ip: int = 64
    # Connections still in the handshake, in all and from one address. They cost an fd
    # and a few hundred bytes (no thread: one poll loop serves them all); when a bound is
    # full a new connection evicts the oldest one it covers, so a stranger who keeps them
    # full delays an honest handshake (well under a millisecond) only if it opens more
    # than these in that time, and one address never evicts another's.
    max_unauthenticated: int = 64
    max_unauthenticated_per_ip: int = 8
    # The whole handshake must be done this long after accept, or the connection is closed:
    # an honest client answers within a round trip; this leaves room for a retransmission.
    auth_timeout_s: float = 2.0
    max_frame_bytes: int = 1 << 30  # a longer announced frame closes its connection
    unexpected_message_bytes: int = 8 * 1024  # larger unexpected frames are read and dropped
    unexpected_messages: int = 4096
    unexpected_bytes: int = 4 << 20
    connect_timeout_s: float = 5.0  # connect and handshake, from the sending side
    # A frame begun must not go this long without a byte (seen after one to two times it:
    # Conn.set_recv_timeout). Idle time between frames is unbounded: connections are
    # reused, only authenticated peers hold one, keepalive ends dead ones. Far over TCP's
    # retransmission backoff on a working link and over peer_timeout_s (an honest
    # transfer stalled this long has failed anyway); under keepalive's minute.
    idle_timeout_s: float = 10.0
    # SO_SNDBUF / SO_RCVBUF; None keeps Linux's autotuning, which a fixed size turns off.
    socket_buffer_bytes: int | None = None

    def __post_init__(self) -> None:
        counts = (self.max_connections, self.max_connections_per_ip, self.max_frame_bytes,
                  self.unexpected_messages, self.max_unauthenticated,
                  self.max_unauthenticated_per_ip)
        buffer = self.socket_buffer_bytes
        finite = (self.idle_timeout_s, self.auth_timeout_s)
        if min(counts) < 1 or min(self.unexpected_message_bytes, self.unexpected_bytes) < 0 \
                or not self.connect_timeout_s > 0 or (buffer is not None and buffer < 1) \
                or not all(t > 0 and math.isfinite(t) for t in finite):
            raise ConfigError(f"TCP limits must be positive: {self}")


class RecvStalled(TimeoutError):
    """No byte arrived for the receive timeout (``Conn.set_recv_timeout``). Internal: it
    never leaves a reader thread; a keepalive failure (ETIMEDOUT) is another OSError."""


def byte_view(buf: Any, *, writable: bool = False) -> memoryview:
    """The raw bytes of a numpy array, CPU torch tensor, bytes or memoryview, uncopied."""
    if type(buf) is not np.ndarray:  # numpy first and fast: a vectored layer has many
        if hasattr(buf, "__cuda_array_interface__") or getattr(buf, "is_cuda", False):
            raise DataPlaneError("the TCP transport moves CPU memory only")
        if hasattr(buf, "numpy") and hasattr(buf, "detach"):  # torch, bfloat16 included
            import torch

            tensor = buf.detach()
            if not tensor.is_contiguous():
                raise DataPlaneError("TCP transport buffers must be contiguous")
            buf = tensor.reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(buf).cast("B")
    except (TypeError, ValueError) as exc:
        raise DataPlaneError(f"not a contiguous CPU buffer: {exc}") from exc
    if writable and view.readonly:
        raise DataPlaneError("cannot receive into read-only memory")
    return view


def byte_views(buf: Any, *, writable: bool = False) -> list[memoryview]:
    """``byte_view`` of one buffer, or of each of a list or tuple of them: one message
    laid over all of them in order (``TcpTransport.vectored``)."""
    if isinstance(buf, list | tuple):
        return [byte_view(b, writable=writable) for b in buf]
    return [byte_view(buf, writable=writable)]


def _skip(parts: list[memoryview], i: int, n: int) -> int:
    """Past ``n`` more bytes from ``parts[i]`` on (and past empty parts): the index of the
    first part with bytes left, which is cut down to them."""
    while i < len(parts) and n >= len(parts[i]):
        n -= len(parts[i])
        i += 1
    if n:
        parts[i] = parts[i][n:]
    return i


def limit(parts: list[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``parts``."""
    out = []
    for p in parts:
        if n <= 0:
            break
        out.append(p[:n])
        n -= len(out[-1])
    return out


def parse_address(address: bytes) -> tuple[str, int]:
    """(host, port) of ``tcp:<IPv4>:<port>`` or ``tcp:[<IPv6>]:<port>``; ``ProtocolError``
    for anything else (the address comes from the network)."""
    if not isinstance(address, bytes) or len(address) > MAX_ADDRESS_BYTES \
            or not address.startswith(_PREFIX):
        raise ProtocolError(f"not a kvstream TCP address: {bytes(address)[:MAX_ADDRESS_BYTES]!r}")
    try:
        text = address[len(_PREFIX):].decode("ascii")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"TCP address is not ASCII: {address!r}") from exc
    bracketed = text.startswith("[")
    host, sep, port = text[1:].partition("]:") if bracketed else text.partition(":")
    if not sep or not _PORT.fullmatch(port) or int(port) > 65535:
        raise ProtocolError(f"TCP address needs <host>:<port 1..65535>: {address!r}")
    try:
        ip = ipaddress.ip_address(host)  # refuses names, scopes stay textual: refused below
    except ValueError as exc:
        raise ProtocolError(f"TCP address host is not an IP literal: {address!r}") from exc
    if bracketed != (ip.version == 6) or "%" in host or ip.is_unspecified or ip.is_multicast:
        raise ProtocolError(f"TCP address host not usable as a peer: {address!r}")
    return host, int(port)


def check_tcp_address(address: bytes) -> bytes:
    parse_address(address)
    return address


def format_address(host: str, port: int) -> bytes:
    ip = ipaddress.ip_address(host)
    text = f"[{ip}]" if ip.version == 6 else str(ip)
    return b"tcp:" + f"{text}:{port}".encode()


def peer_id_bytes(peer_id: str) -> bytes:
    """A sender id as the handshake carries it; ``ProtocolError`` if it is empty, longer
    than ``MAX_ID_BYTES`` in UTF-8 or not a string (ids come from the control plane)."""
    if not isinstance(peer_id, str):
        raise ProtocolError(f"a TCP sender id must be a string, got {type(peer_id).__name__}")
    try:
        raw = peer_id.encode()
    except UnicodeEncodeError as exc:  # lone surrogates
        raise ProtocolError(f"TCP sender id is not UTF-8: {exc}") from exc
    if not 1 <= len(raw) <= MAX_ID_BYTES:
        raise ProtocolError(f"a TCP sender id must be 1..{MAX_ID_BYTES} bytes of UTF-8, "
                            f"got {len(raw)}")
    return raw


def make_token(secret: bytes, peer_id: bytes) -> bytes:
    """The token a server with ``secret`` issues to ``peer_id``: recomputed from the id at
    each hello, so the server stores nothing per peer."""
    return hashlib.blake2b(peer_id, key=secret, digest_size=TOKEN_BYTES,
                           person=_TOKEN_PERSON).digest()


def hello_mac(token: bytes, challenge: bytes, peer_id: bytes, server_address: bytes) -> bytes:
    """MAC of a hello: the id is length-prefixed, so id and address cannot trade bytes."""
    mac = hashlib.blake2b(key=token, digest_size=MAC_BYTES, person=_HELLO_PERSON)
    mac.update(challenge)
    mac.update(len(peer_id).to_bytes(2, "little"))
    mac.update(peer_id)
    mac.update(server_address)
    return mac.digest()


def hello(token: bytes, challenge: bytes, peer_id: bytes, server_address: bytes) -> bytes:
    """The client's answer to ``challenge``."""
    return (HELLO_HEAD.pack(HELLO_MAGIC, len(peer_id)) + peer_id
            + hello_mac(token, challenge, peer_id, server_address))


def _recv_by(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    data = bytearray()
    while len(data) < n:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise DataPlaneError(what)
        data += chunk
    return bytes(data)


def client_handshake(sock: socket.socket, server_address: bytes, peer_id: bytes, token: bytes,
                     deadline: float) -> None:
    """Authenticate a freshly connected ``sock`` (blocking, by ``deadline``, monotonic).
    ``DataPlaneError`` if the server is no kvstream data port, refuses the credentials or
    is full; ``OSError`` (``TimeoutError`` included) if the connection fails."""
    head = _recv_by(sock, CHALLENGE.size, deadline, "closed before its challenge (at its "
                    "limit of connections in the handshake?)")
    magic, challenge = CHALLENGE.unpack(head)
    if magic != AUTH_MAGIC:
        raise DataPlaneError("not a kvstream TCP data port of this version (bad challenge)")
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.sendall(hello(token, challenge, peer_id, server_address))
    (reply,) = REPLY.unpack(_recv_by(
        sock, REPLY.size, deadline,
        "refused our credentials (stale token: did the peer restart?)"))
    if reply == BUSY:
        raise DataPlaneError("is at its limit of connections")
    if reply != ACCEPTED:
        raise DataPlaneError(f"answered the handshake with {reply:#x}")


def tune(sock: socket.socket, limits: TcpLimits) -> None:
    """Nagle off (a header must not wait behind an ACK), keepalive on; buffers only where
    asked."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE:
            if hasattr(socket, name):  # Linux names; elsewhere the system's defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if limits.socket_buffer_bytes is not None:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):  # capped by net.core.[rw]mem_max
                sock.setsockopt(socket.SOL_SOCKET, opt, limits.socket_buffer_bytes)


class Conn:
    """One socket whose fd is closed only after its last user let go: shutting it down
    wakes a blocked reader or sender at once, but closing the fd under a thread still
    inside a syscall could let a newly opened socket reuse the number and receive its
    bytes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()
        self._users = 1  # the owner's reference, dropped by shutdown()
        self._down = False
        self._poll = select.poll()
        self._poll.register(sock, select.POLLRDHUP)

    @property
    def down(self) -> bool:
        return self._down

    def acquire(self) -> bool:
        with self._lock:
            if self._down:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.sock.close()

    def shutdown(self) -> None:
        with self._lock:
            if self._down:
                return
            self._down = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        self.release()

    def peer_closed(self) -> bool:
        """Did the peer close or reset this send-only connection? (poll, not a peeking
        recv: that waits for the socket lock a concurrent sendmsg holds.)"""
        if not self.acquire():
            return True
        try:
            return bool(self._poll.poll(0))  # only hang-up, reset and error report
        finally:
            self.release()

    def try_send(self, parts: list[memoryview]) -> int:
        """What the kernel takes now without blocking (from the event loop)."""
        if not self.acquire():
            raise ConnectionAbortedError("connection closed")
        try:
            return self.sock.sendmsg(parts[:IOV_MAX], (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        finally:
            self.release()

    def send_rest(self, parts: list[memoryview], sent: int) -> None:
        """Send ``parts`` from byte ``sent`` on, blocking (a worker thread)."""
        parts = list(parts)
        i = _skip(parts, 0, sent)
        while i < len(parts):
            i = _skip(parts, i, self.sock.sendmsg(parts[i:i + IOV_MAX]))

    def set_recv_timeout(self, seconds: float) -> None:
        """SO_RCVTIMEO, not ``settimeout``: that makes the fd non-blocking, and MSG_WAITALL
        would then return whatever is there (a wake-up per segment). With it a blocking
        receive that gets nothing for ``seconds`` fails (``RecvStalled``); one that got
        some bytes returns them when it runs out, and the next call waits anew."""
        sec, usec = divmod(max(1, math.ceil(seconds * 1e6)), 1_000_000)  # 0: none at all
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(sec, usec))

    def recv_some(self, view: memoryview) -> int:
        """One receive into ``view``: all of it, or less at EOF (0) or at the receive
        timeout after some bytes; ``RecvStalled`` if none came in it."""
        try:
            return self.sock.recv_into(view, len(view), socket.MSG_WAITALL)
        except BlockingIOError as exc:  # EAGAIN on a blocking fd: SO_RCVTIMEO ran out
            raise RecvStalled(f"no byte for the receive timeout: {exc}") from exc

    def recv_views(self, views: list[memoryview]) -> int:
        """Fill ``views`` in order; how many bytes arrived before EOF (all normally).
        MSG_WAITALL: one wake-up per call, not one per segment. ``RecvStalled`` if a
        call gets no byte for the receive timeout (if one is set)."""
        views, got, i = list(views), 0, 0
        try:
            while i < len(views):
                if len(views) - i == 1:
                    n = self.sock.recv_into(views[i], len(views[i]), socket.MSG_WAITALL)
                else:
                    n = self.sock.recvmsg_into(views[i:i + IOV_MAX], 0, socket.MSG_WAITALL)[0]
                if n == 0:
                    break
                got += n
                i = _skip(views, i, n)
        except BlockingIOError as exc:
            raise RecvStalled(f"no byte for the receive timeout after {got}: {exc}") from exc
        return got

    def recv_exact(self, view: memoryview) -> int:
        return self.recv_views([view])

    def discard(self, nbytes: int) -> bool:
        """Read ``nbytes`` into a bounded scratch and drop them; False on EOF first."""
        view = memoryview(bytearray(min(nbytes, _DISCARD_CHUNK)))
        while nbytes:
            chunk = min(nbytes, len(view))
            if self.recv_exact(view[:chunk]) < chunk:
                return False
            nbytes -= chunk
        return True
