"""A ``Transport`` over plain TCP sockets, for hosts that UCX reaches only through its tcp
transport (0.3-1.2 GB/s where a Python socket stream moves 2.5-4 GB/s).

Why it looks like this (measured with benchmarks/bench_tcp.py on a 2-core VM):

* Blocking sockets on threads. A reader thread per accepted connection reads a frame
  header, takes the receive posted on its tag and lets ``recv_into`` write the payload
  straight into that buffer; a send hands ``[header, payload]`` to the writer thread of
  its connection, which writes it with ``sendmsg`` (dataplane.tcp_send says why).
  CPython releases the GIL in both, so the kernel copies between socket and tensor while
  the event loop runs, and Python copies nothing. Threads: one per accepted connection
  (at most ``TcpLimits.max_connections``) and one per connection we opened (lanes x peers).
* Vectored (``vectored = True``): a list of buffers is one message laid over them in
  order, on both sides, so the streams send a layer's blocks where they lie and receive
  into the reserved blocks (no gather, no scatter). Each piece costs Python work when
  posted and sent (~0.5-2.5 us): 512 pieces of 32 KiB per 16 MiB layer measured 1.16x a
  plain stream, 4096 of 4 KiB 0.48x.
* Lanes: up to ``lanes`` connections per peer, opened on first use. A message's lane is a
  function of its tag's layer and transfer bits, so every message on one tag travels on
  one connection, in order, while a transfer's layers spread over all of them (one lane
  measured 0.95-0.99x a plain one-connection stream, four 1.2-1.7x).
* Connections are one-way: we send on those we opened and read those we accepted. A
  connection's death fails the sends on it, never a receive: a receive whose frame was
  cut short is posted again, and stays posted until data, ``drain`` or ``close``. A send
  is not cancellable once the kernel reads its buffer; ``forget_peer`` and ``close`` end
  a blocked one (what aborting a UCX endpoint does). Keepalive ends connections to a
  host that vanished without a word.
* Tag rules as with UCX and the loopback: a receive completes with the oldest message
  on exactly its 64-bit tag; a message nobody posted for waits, but only if it is small
  (``TcpLimits.unexpected_message_bytes``) and the waiting queue has room. The stream
  protocol posts (and credits) every large receive before its data is sent, so a large
  unexpected frame is a stray, a late or a forged one: it is read and dropped
  (``dropped_unread``). ``drain`` completes the oldest posted receive locally; one being
  written into at that moment is left to its frame, and a zero-byte message waits in its
  stead, as UCX's self-send would.
* Everything is bounded (``TcpLimits``): connections in the handshake (in all and from
  one address, each for ``auth_timeout_s`` at most), authenticated connections (in all
  and from one address), the waiting queue, frame length, connect time, and how long a
  frame begun may go without a byte (``idle_timeout_s``). A bad magic, an absurd length
  or a stall closes only that connection, and a receive its frame was being read into is
  posted again (``statistics()``: ``bad_frames``, ``timed_out``; ``refused``,
  ``refused_per_ip`` count authenticated ones turned away at the caps).

Security: every connection is authenticated before any of its bytes is read as a frame.
``open`` draws a random secret; ``token_for(peer_id)`` derives that peer's token from it
(keyed BLAKE2b), which the agent hands the peer over the encrypted control plane; the
peer's ``set_credentials`` makes each connection it opens answer our random challenge
with a MAC under that token, over the challenge, its id and our address
(dataplane.tcp_conn has the wire format). A captured hello fails on any other connection,
and a restart of this transport (a new secret) voids every token it issued. A stranger
gets a challenge and nothing more: it holds one of ``max_unauthenticated`` handshake
slots (``max_unauthenticated_per_ip`` from one address), an fd and no thread, for
``auth_timeout_s`` at most, and is evicted sooner by newer connections when they are
full; it never counts toward ``max_connections_per_ip``, so it cannot lock an honest
sender on its address out (``unauthenticated``, ``evicted`` count them). Idle time
between frames on an authenticated connection is not bounded, on purpose: lanes are
reused across transfers and may idle long between them, only a peer that got a token
through the control plane can hold one, the caps count it, and keepalive ends those to
a vanished host. What the handshake does not give: frames are neither encrypted nor
MACed, so their payload's confidentiality and integrity rest on the network (an on-path
attacker can read or alter them, or hijack an authenticated connection). Run it on a
network you trust, or use UCX with its own security. Within it, the tag still decides
where a frame lands: a receive posted on its exact tag (48 random bits per transfer,
``wire.new_xfer_tag``), or the bounded waiting queue until ``sweep`` drops it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

import anyio
import anyio.lowlevel

from kvstream._exceptions import ConfigError, DataPlaneError, ProtocolError
from kvstream.dataplane.tcp_conn import (
    HEADER,
    MAGIC,
    TOKEN_BYTES,
    Conn,
    TcpLimits,
    byte_views,
    check_tcp_address,
    client_handshake,
    format_address,
    parse_address,
    peer_id_bytes,
    tune,
)
from kvstream.dataplane.tcp_recv import JOIN_S, Inbox, TcpRecv, TcpStatistics
from kvstream.dataplane.tcp_send import Lane, Sender, SendJob

__all__ = ["TcpLimits", "TcpRecv", "TcpStatistics", "TcpTransport"]

_TAG_LIMIT: Final = 1 << 64
MAX_LANES: Final = 64
MAX_CREDENTIALS: Final = 4096  # peers' addresses we hold tokens for (most recent kept)


def _check_tag(tag: int) -> None:
    if not 0 <= tag < _TAG_LIMIT:
        raise DataPlaneError(f"tag {tag:#x} does not fit in 64 bits")


class TcpTransport:
    """Tagged messages over TCP; ``await TcpTransport.open(...)`` inside the event loop."""

    # ``send`` and ``post_recv`` take a list of buffers too: one message over all of them,
    # written with one sendmsg, read straight into each (no gather, no scatter).
    vectored = True

    def __init__(self, inbox: Inbox, address: bytes, lanes: int) -> None:
        self.limits = inbox.limits
        self._inbox = inbox
        self._address = address
        self._what = address.decode()
        self._lanes = lanes
        # Event-loop thread only, like the counter of sends in flight.
        self._peers: dict[bytes, list[Lane]] = {}
        # address: (our id, its token for us), least recently set first
        self._credentials: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        self._senders: list[Sender] = []  # every writer thread not yet joined
        self._sending = 0

    @classmethod
    async def open(cls, host: str = "0.0.0.0", port: int = 0, *, advertise: str | None = None,
                   lanes: int = 4, limits: TcpLimits | None = None) -> TcpTransport:
        """Listen on ``host:port`` (0: any free port). The address peers get names
        ``advertise``, else ``host`` unless it is a wildcard, else the loopback.
        ``ConfigError`` for bad settings, ``DataPlaneError`` if the port cannot be bound."""
        limits = limits or TcpLimits()
        if not 1 <= lanes <= MAX_LANES:
            raise ConfigError(f"lanes must be 1..{MAX_LANES}, got {lanes}")
        try:
            ip = ipaddress.ip_address(host)
            shown = ipaddress.ip_address(advertise) if advertise is not None else ip
        except ValueError as exc:
            raise ConfigError(f"TCP host and advertise must be IP literals: {exc}") from exc
        if shown.is_unspecified:
            shown = ipaddress.ip_address("::1" if ip.version == 6 else "127.0.0.1")
        listener = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune(listener, limits)  # accepted sockets inherit it, window scale included
            listener.bind((str(ip), port))
            listener.listen(min(limits.max_connections, 128))
            address = check_tcp_address(format_address(str(shown), listener.getsockname()[1]))
        except OSError as exc:
            listener.close()
            raise DataPlaneError(f"cannot listen on {host}:{port}: {exc}") from exc
        except ProtocolError as exc:
            listener.close()
            raise ConfigError(f"advertised TCP address unusable: {exc}") from exc
        return cls(Inbox(listener, limits, asyncio.get_running_loop(), address), address, lanes)

    @property
    def address(self) -> bytes:
        return self._address

    @property
    def dropped_unread(self) -> int:
        """Unexpected frames read and dropped (too large to wait, or no room), as UCX's."""
        return self._inbox.dropped_unread

    def statistics(self) -> TcpStatistics:
        return self._inbox.statistics()

    def check_address(self, peer_address: bytes) -> bytes:
        return check_tcp_address(peer_address)

    def token_for(self, peer_id: str) -> bytes:
        """The 32-byte token that lets ``peer_id`` open connections to us (its
        ``set_credentials``). Hand it over a confidential, authenticated channel only:
        whoever holds it can send frames here. Derived from this transport's secret, so
        the same id always gets the same token until the transport is closed; nothing is
        stored. ``ProtocolError`` for an empty or over-long (1024-byte) id."""
        return self._inbox.token_for(peer_id_bytes(peer_id))

    def set_credentials(self, peer_address: bytes, sender_id: str, token: bytes) -> None:
        """Authenticate as ``sender_id`` with ``token`` (the peer's ``token_for(sender_id)``)
        on every connection opened to ``peer_address`` from now on; connections already
        open stay (the peer accepted them). Kept until ``close`` (``forget_peer`` keeps
        them: a later send reconnects with them) for the last ``MAX_CREDENTIALS`` peers
        set; set again when the peer restarts.
        ``ProtocolError`` for a malformed address, id or token (they come from the
        network)."""
        check_tcp_address(peer_address)
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
            raise ProtocolError(f"a TCP token must be {TOKEN_BYTES} bytes")
        self._credentials[peer_address] = (peer_id_bytes(sender_id), token)
        self._credentials.move_to_end(peer_address)
        while len(self._credentials) > MAX_CREDENTIALS:
            self._credentials.popitem(last=False)

    async def send(self, peer_address: bytes, buf: Any, tag: int) -> None:
        """Returns once the kernel holds the whole frame (the caller may reuse ``buf``).
        ``ProtocolError`` for a malformed address, ``DataPlaneError`` without credentials
        for it (``set_credentials``), or if the connection cannot be made, is refused
        (stale credentials) or breaks. Cancelled before its frame is being written,
        nothing is sent; after, it returns only once the frame is out (``SendJob.wait``)."""
        self._inbox.check_open(self._what)
        _check_tag(tag)
        if peer_address not in self._credentials:
            check_tcp_address(peer_address)
            raise DataPlaneError(f"no credentials for {peer_address!r}: set_credentials "
                                 "with the token it issued us first")
        views = byte_views(buf)
        nbytes = sum(len(v) for v in views)
        if nbytes > self.limits.max_frame_bytes:
            raise DataPlaneError(f"message of {nbytes} bytes exceeds the TCP frame limit "
                                 f"{self.limits.max_frame_bytes}")
        lanes = self._peers.get(peer_address)
        if lanes is None:
            host, port = parse_address(peer_address)
            lanes = self._peers[peer_address] = [Lane(peer_address, host, port)
                                                 for _ in range(self._lanes)]
        lane = lanes[((tag >> 4) + (tag >> 16)) % len(lanes)]  # layer and transfer bits
        parts = [memoryview(HEADER.pack(MAGIC, 0, tag, nbytes)), *views]
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._sending += 1
        try:
            job = await self._submit(lane, parts)
            if job is not None:
                await job.wait()
        finally:
            self._sending -= 1

    def post_recv(self, buf: Any, tag: int) -> TcpRecv:
        _check_tag(tag)
        recv = TcpRecv(byte_views(buf, writable=True), tag, self._inbox.loop)
        self._inbox.post(recv, self._what)
        return recv

    async def drain(self, tag: int) -> None:
        _check_tag(tag)
        await anyio.lowlevel.checkpoint()
        self._inbox.drain(tag, self._what)

    def forget_peer(self, peer_address: bytes) -> None:
        """Close our connections to that peer, failing sends in flight on them."""
        for lane in self._peers.pop(peer_address, ()):
            lane.drop()

    def sweep(self, is_live: Callable[[int], bool], max_messages: int = 1024) -> int:
        """Drop waiting messages on tags ``is_live`` disowns (every tag is looked at,
        oldest message first per tag, up to ``max_messages``); returns how many."""
        return self._inbox.sweep(is_live, max_messages)

    async def close(self) -> None:
        """Fail posted receives; stop the listener, every connection and thread."""
        if self._inbox.closed:
            return
        self._inbox.closed = True  # refuses new sends and posts at once
        for lanes in self._peers.values():
            for lane in lanes:
                lane.drop()
        self._peers.clear()
        self._credentials.clear()
        with anyio.move_on_after(JOIN_S):
            while self._sending:  # their frames failed above, or a connect is ending
                await anyio.sleep(0.005)
        senders, self._senders = self._senders, []
        await anyio.to_thread.run_sync(self._join, senders)

    # --- the send side ----------------------------------------------------------------

    def _join(self, senders: list[Sender]) -> None:
        deadline = time.monotonic() + JOIN_S
        for sender in senders:
            sender.stop()
        self._inbox.close()
        for sender in senders:
            sender.thread.join(max(0.0, deadline - time.monotonic()))

    async def _submit(self, lane: Lane, parts: list[memoryview]) -> SendJob | None:
        """Hand the frame to the lane's sender, connecting first if it has none that works;
        frames keep the order of their send calls, across a connect too."""
        sender = lane.ready()
        if sender is None:
            lane.connecting += 1
            try:
                async with lane.lock:
                    sender = lane.sender
                    if sender is None or not sender.usable():
                        sender = lane.sender = await self._connect(lane)
                    return self._hand(lane, sender, parts)
            finally:
                lane.connecting -= 1
        return self._hand(lane, sender, parts)

    def _hand(self, lane: Lane, sender: Sender, parts: list[memoryview]) -> SendJob | None:
        if lane.dropped or self._inbox.closed:
            raise DataPlaneError(f"connection to {lane.host}:{lane.port} was dropped "
                                 "(peer forgotten or transport closed)")
        try:
            return sender.submit(parts)
        except OSError as exc:
            raise DataPlaneError(f"TCP send to {lane.host}:{lane.port} failed: {exc}") from exc

    async def _connect(self, lane: Lane) -> Sender:
        host, port = lane.host, lane.port
        if lane.dropped or self._inbox.closed:
            raise DataPlaneError(f"connection to {host}:{port} was dropped")
        held = self._credentials.get(lane.address)  # send() checked; since evicted?
        if held is None:
            raise DataPlaneError(f"no credentials for {host}:{port} any more")
        sender_id, token = held

        def connect() -> Conn:
            """Connect and authenticate, all within connect_timeout_s."""
            deadline = time.monotonic() + self.limits.connect_timeout_s
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            try:
                tune(sock, self.limits)
                sock.settimeout(self.limits.connect_timeout_s)
                sock.connect((host, port))
                client_handshake(sock, lane.address, sender_id, token, deadline)
                sock.settimeout(None)
            except BaseException:
                sock.close()
                raise
            return Conn(sock)

        try:
            conn = await anyio.to_thread.run_sync(connect)
        except OSError as exc:
            raise DataPlaneError(f"cannot connect to {host}:{port}: {exc}") from exc
        except DataPlaneError as exc:
            raise DataPlaneError(f"TCP peer {host}:{port} {exc}") from exc
        sender = Sender(conn, self._inbox.loop, f"kvstream-tcp-{port}-send")
        self._senders = [s for s in self._senders if s.thread.is_alive()]
        self._senders.append(sender)
        if lane.dropped or self._inbox.closed:
            sender.stop()  # forgotten or closed while connecting
            raise DataPlaneError(f"connection to {host}:{port} was dropped")
        return sender
