"""The NATS boundary: connect, request, publish, serve; nats errors become kvstream errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, cast

import anyio
import nats
import nats.errors
import nats.js.errors

from kvstream._exceptions import (
    ControlPlaneError,
    MessageDecodeError,
    NatsConnectError,
    NoPeerError,
)
from kvstream.control import messages as m
from kvstream.control.auth import NatsAuth
from kvstream.control.identity import BOX, SENDER, SUBJECT, Seal, Trust, key_in, open_sealed
from kvstream.control.limits import InFlight, Throttle
from kvstream.control.reach import classify, probe, servers_of
from kvstream.control.replies import Replies, key_for, open_message
from kvstream.control.stream import StreamSpec

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

__all__ = ["ControlBus", "Handler"]

log = logging.getLogger("kvstream.control")

# A handler gets a decoded message and its NATS headers; what it returns is the reply.
Handler = Callable[[m.ControlUnion, dict[str, str]], Awaitable[m.ControlMessage | None]]


class ControlBus:
    """One NATS connection shared by an agent's control traffic."""

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._subs: list[Subscription] = []
        self.malformed = 0
        self.seal = Seal()
        self._replies = Replies(self.seal)
        # Is that peer alive (the registry's view)? A "no responders" status is unsigned:
        # for a live peer it is waited out, not believed (None: believed at once).
        self.peer_alive: Callable[[str], bool] | None = None
        self.inflight = InFlight()
        self._quiet = Throttle(log)

    @classmethod
    async def connect(cls, url: str, *, name: str, timeout: float = 5.0,
                      auth: NatsAuth | None = None, randomize: bool = True,
                      inbox_prefix: str = "_INBOX") -> ControlBus:
        """Connect to ``url`` (one server or a comma-separated list), reconnecting for
        ever once connected.

        The first connection fails with a ``NatsConnectError`` naming the real cause as
        soon as every server of ``url`` failed once (refused and DNS failures at once, a
        silent server after ``connect_timeout``), and in any case after ``timeout``.
        ``randomize=False`` tries the servers in the order given (nats-py shuffles them)."""
        from nats.aio.client import Client as NatsClient

        options = (auth or NatsAuth()).connect_options()
        servers = max(1, len(servers_of(url)))
        failures: list[tuple[str, str]] = []
        connected = False

        async def on_error(exc: Exception) -> None:
            if connected:
                await _log_error(exc)
                return
            failures.append(classify(exc))
            if len(failures) >= servers:  # each server has had its try
                raise _GiveUp  # out of nats-py's connect loop (it catches only its own)

        nc = NatsClient()
        try:
            with anyio.fail_after(timeout):
                # nats-py keeps retrying an unreachable server when reconnects are allowed;
                # on_error stops the first connection once every server has failed.
                # Both times are seconds that nats-py hands to asyncio.wait_for/sleep, so
                # fractions work; its annotations say int (hence the casts).
                await nc.connect(servers=[u.strip() for u in url.split(",") if u.strip()],
                                 name=name, connect_timeout=cast(int, min(timeout, 2.0)),
                                 allow_reconnect=True, max_reconnect_attempts=-1,
                                 reconnect_time_wait=cast(int, 0.2), error_cb=on_error,
                                 dont_randomize=not randomize, inbox_prefix=inbox_prefix,
                                 **options)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await nc.close()
            if not isinstance(exc, Exception):
                raise
            cause, words = failures[-1] if failures else classify(exc)
            if not failures and isinstance(exc, TimeoutError):
                words = f"no connection within {timeout:g}s"
            if cause == "other" and await _requires_auth(url):
                # The server closes after '-ERR Authorization Violation'; under load the
                # close can overtake the error line (a reset discards it), leaving only
                # "connection reset". The server's greeting says why it closed.
                cause, words = "auth", ("authentication failed (the server requires "
                                        f"credentials and closed the connection: {words})")
            raise NatsConnectError(f"cannot connect to NATS at {url}: {words}", url=url,
                                   cause=cause, detail=words) from exc
        connected = True
        return cls(nc)

    @property
    def connected_url(self) -> str | None:
        """The server this connection is on now (None while reconnecting)."""
        url = self._nc.connected_url
        return None if url is None else url.geturl()

    async def request(
        self, subject: str, msg: m.ControlMessage, *, timeout: float,
        headers: dict[str, str] | None = None, peer: str | None = None,
    ) -> m.ControlUnion:
        """The first reply that opens as ``peer``'s (boxed for us, or signed by it): an
        answer by anyone else is dropped and counted (``seal.forged``), and the request
        waits on for the genuine one until ``timeout``. A request to ``peer`` is boxed for
        it, so it waits (within ``timeout``) for the peer's key when it is not known yet."""
        with anyio.move_on_after(timeout) as scope:
            to_key = await key_for(self.seal, peer)
            payload, sealed = self.seal.outgoing(subject, m.encode(msg), headers, to=peer,
                                                 to_key=to_key)
            await self._replies.start(self._nc)
            waiter = self._replies.open(peer)
            try:
                try:
                    await self._nc.publish(subject, payload, reply=waiter.inbox, headers=sealed)
                except nats.errors.Error as exc:
                    raise ControlPlaneError(f"NATS request on {subject} failed: {exc}") from exc
                return await waiter.wait(subject, self.peer_alive)
            finally:
                self._replies.close(waiter)
        assert scope.cancelled_caught
        raise NoPeerError(f"no answer on {subject} within {timeout}s", peer=peer)

    async def publish(
        self, subject: str, msg: m.ControlMessage, headers: dict[str, str] | None = None,
        *, peer: str | None = None,
    ) -> None:
        """Publish ``msg``: boxed for ``peer`` when its key is known, else signed."""
        data = m.encode(msg)
        to_key = self.seal.peer_key(peer) if peer is not None else None
        payload, sealed = self.seal.outgoing(subject, data, headers, to=peer, to_key=to_key)
        try:
            await self._nc.publish(subject, payload, headers=sealed)
        except nats.errors.Error as exc:
            raise ControlPlaneError(f"NATS publish on {subject} failed: {exc}") from exc

    async def serve(self, subject: str, handler: Handler,
                    spawn: Callable[..., object] | None = None, queue: str = "") -> None:
        """Subscribe ``handler``; malformed input is logged, answered if possible, and survived.
        ``queue``: one of the subscribers of that queue group gets each message.

        nats-py runs one subscription's callbacks one after another; with ``spawn`` (a task
        group's ``start_soon``) each message is handled in its own task, so a handler that
        waits (an abort waiting for sends in flight) does not hold up the next message.
        """

        async def on_msg(msg: Msg) -> None:
            # Opening, decoding and the signature check run here, in order and without a
            # task: garbage and forgeries cost no more than that. What passes gets a task
            # when ``spawn`` is given, within the bounds of ``inflight`` (else "busy").
            opened = open_message(self.seal, msg.subject, msg.data, msg.headers)
            if isinstance(opened, MessageDecodeError):
                self._malformed(msg, opened)
                if msg.reply:
                    await self._safe_reply(msg, m.Reject(transfer_id="", code="malformed",
                                                         reason=str(opened)[:1000]))
                return
            if opened is None:
                self._quiet.warning("unauthenticated", "refused an unauthenticated message "
                                    "on %s", msg.subject)
                if msg.reply:
                    await self._safe_reply(msg, m.Reject(
                        transfer_id="", code="unauthenticated",
                        reason="the message is not signed by the instance it names"))
                return
            decoded, headers = opened
            if spawn is None or not msg.reply:  # a publish (done, leave) never waits: inline
                await handle(decoded, headers, msg)
                return
            sender = headers.get(SENDER, "")
            if not self.inflight.enter(sender):
                self._quiet.warning("busy", "too many control messages in flight from %s",
                                    sender or "?")
                if msg.reply:
                    await self._safe_reply(msg, m.Reject(
                        transfer_id="", code="busy", reason="too many requests in flight"),
                        headers)
                return
            spawn(counted, decoded, headers, msg, sender)

        async def counted(decoded: m.ControlUnion, headers: dict[str, str], msg: Msg,
                          sender: str) -> None:
            try:
                await handle(decoded, headers, msg)
            finally:
                self.inflight.leave(sender)

        async def handle(decoded: m.ControlUnion, headers: dict[str, str], msg: Msg) -> None:
            try:
                reply = await handler(decoded, headers)
            except Exception:
                self._quiet.log(logging.ERROR, "handler", "control handler failed on %s",
                                msg.subject, exc_info=True)
                return
            if reply is not None and msg.reply:
                await self._safe_reply(msg, reply, headers)

        try:
            self._subs.append(await self._nc.subscribe(subject, queue=queue, cb=on_msg))
        except nats.errors.Error as exc:
            raise ControlPlaneError(f"cannot subscribe to {subject}: {exc}") from exc

    # -- JetStream: kept messages (KV events) ---------------------------------------------
    async def persist(self, subject: str, msg: m.ControlMessage, stream: StreamSpec, *,
                      rollup: bool = False) -> int:
        """Publish ``msg`` (signed) into ``stream``, creating the stream the first time it
        is missing; the stream's sequence of it once stored (``ControlPlaneError`` if not:
        no stream, no ack, or an answer that is not JetStream's). ``rollup``: the stream
        drops the subject's earlier messages (this one says everything they said)."""
        data = m.encode(msg)
        extra = {"Nats-Rollup": "sub"} if rollup else None
        _, headers = self.seal.outgoing(subject, data, extra)
        js = self._nc.jetstream()
        for attempt in (1, 2):
            try:
                ack = await js.publish(subject, data, timeout=2.0, stream=stream.name,
                                       headers=headers)
                return int(ack.seq)
            except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError) as exc:
                # no stream takes the subject yet
                if attempt == 2:
                    raise ControlPlaneError(f"no JetStream stream stores {subject}") from exc
                await self.ensure_stream(stream)
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                raise ControlPlaneError(f"storing on {subject} failed: {exc!r}") from exc
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                # Anyone subscribed to the subject can answer before the stream does.
                raise ControlPlaneError(f"storing on {subject}: a reply that is no "
                                        f"JetStream ack ({exc!r})") from exc
        raise ControlPlaneError(f"storing on {subject} failed")  # not reached

    async def ensure_stream(self, stream: StreamSpec) -> None:
        """Create ``stream`` unless it exists (an existing one is used as it is)."""
        from nats.js.api import DiscardPolicy, StorageType, StreamConfig

        jsm = self._nc.jsm()
        try:
            await jsm.stream_info(stream.name)
            return
        except nats.js.errors.NotFoundError:
            pass
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise ControlPlaneError(f"JetStream is not available: {exc!r}") from exc
        config = StreamConfig(name=stream.name, subjects=[stream.subjects],
                              max_age=stream.max_age_s, max_bytes=stream.max_bytes,
                              max_msgs_per_subject=stream.max_msgs_per_subject,
                              max_msg_size=stream.max_msg_size, discard=DiscardPolicy.OLD,
                              storage=StorageType.FILE, allow_rollup_hdrs=True)
        try:
            await jsm.add_stream(config)
        except nats.js.errors.BadRequestError as exc:  # made by another agent meanwhile
            if getattr(exc, "err_code", 0) != 10058:  # "stream name already in use"
                raise ControlPlaneError(f"cannot create stream {stream.name}: {exc!r}") from exc
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise ControlPlaneError(f"cannot create stream {stream.name}: {exc!r}") from exc

    async def follow(self, subject: str, stream: StreamSpec, handler: Handler, *,
                     trust: Trust | None = None) -> None:
        """Every message of ``stream`` on ``subject``, from the first kept, then live, in
        order (an ordered consumer: nats-py recreates it after a gap), each decoded and
        its signature checked, by ``trust`` if given (kept messages may be an earlier
        incarnation's: a trust that binds keys would let them bind one); refused ones
        are counted and dropped."""
        await self.ensure_stream(stream)
        js = self._nc.jetstream()

        async def on_msg(msg: Msg) -> None:
            checked = self._check_kept(msg, trust)
            if checked is not None:
                try:
                    await handler(*checked)
                except Exception:
                    self._quiet.log(logging.ERROR, "handler", "handler failed on %s",
                                    msg.subject, exc_info=True)

        from nats.js.api import DeliverPolicy

        try:
            self._subs.append(await js.subscribe(subject, stream=stream.name, cb=on_msg,
                                                 ordered_consumer=True, idle_heartbeat=5.0,
                                                 deliver_policy=DeliverPolicy.ALL))
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise ControlPlaneError(f"cannot follow {subject}: {exc!r}") from exc

    async def kept(self, subject: str, stream: StreamSpec, *, trust: Trust | None = None,
                   timeout: float = 10.0, limit: int = 1 << 16
                   ) -> list[tuple[m.ControlUnion, dict[str, str]]]:
        """What ``stream`` keeps on ``subject`` now, in order, checked like ``follow``'s:
        all of it or ``ControlPlaneError`` (more than ``limit`` messages, not read within
        ``timeout``), never a silently shorter list."""
        js = self._nc.jetstream()
        out: list[tuple[m.ControlUnion, dict[str, str]]] = []
        try:
            sub = await js.subscribe(subject, stream=stream.name, ordered_consumer=True)
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise ControlPlaneError(f"cannot read {subject}: {exc!r}") from exc
        try:
            with anyio.fail_after(timeout):
                # What the consumer has to deliver, and what it delivered already (pushed
                # into this client's buffer before the question was answered).
                info = await sub.consumer_info()
                left = int(info.num_pending or 0) + int(
                    info.delivered.consumer_seq if info.delivered is not None else 0)
                read = 0
                while left > 0:
                    if read >= limit:
                        raise ControlPlaneError(f"{subject} keeps over {limit} messages")
                    msg = await sub.next_msg(timeout=timeout)
                    read += 1
                    checked = self._check_kept(msg, trust)
                    if checked is not None:
                        out.append(checked)
                    # Those stored since count too (the server says how many remain).
                    left = max(left - 1, int(msg.metadata.num_pending))
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise ControlPlaneError(f"reading {subject} took over {timeout} s") from exc
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise ControlPlaneError(f"reading {subject} failed: {exc!r}") from exc
        finally:
            with anyio.move_on_after(2.0, shield=True), \
                    contextlib.suppress(nats.errors.Error, nats.js.errors.Error):
                await sub.unsubscribe()
        return out

    def _malformed(self, msg: Msg, exc: Exception) -> None:
        self.malformed += 1
        self._quiet.warning("malformed", "dropped malformed message on %s: %s", msg.subject, exc)

    def _check_kept(self, msg: Msg, trust: Trust | None
                    ) -> tuple[m.ControlUnion, dict[str, str]] | None:
        try:
            decoded = m.decode(msg.data)
        except MessageDecodeError as exc:
            self._malformed(msg, exc)
            return None
        if trust is None:
            opened = self.seal.incoming(msg.subject, msg.data, msg.headers)
            headers = None if opened is None or BOX in opened[1] else opened[1]
        else:
            headers = {k: v for k, v in (msg.headers or {}).items()
                       if k not in (SENDER, SUBJECT)}
            headers[SUBJECT] = msg.subject
            sender = open_sealed(msg.subject, msg.data, headers, trust)
            if sender is None:
                self.seal.forged += 1
                headers = None
            else:
                headers[SENDER] = sender
        if headers is None:
            self._quiet.warning("unauthenticated", "refused an unauthenticated message "
                                "on %s", msg.subject)
            return None
        return decoded, headers

    async def _safe_reply(self, msg: Msg, reply: m.ControlMessage,
                          asked: dict[str, str] | None = None) -> None:
        """Answer on the request's reply subject: boxed for the checked sender of
        ``asked`` (the request's headers), signed when there is none."""
        sender = (asked or {}).get(SENDER)
        payload, headers = self.seal.outgoing(msg.reply, m.encode(reply), None, to=sender,
                                              to_key=key_in(asked) if asked else None)
        try:
            await self._nc.publish(msg.reply, payload, headers=headers)
        except nats.errors.Error as exc:
            log.warning("could not reply on %s: %s", msg.reply, exc)

    async def flush(self, timeout: float = 2.0) -> None:
        """Return once the server has processed everything sent so far (subscriptions
        included). Not ``nc.flush()``: nats-py writes its PING straight to the socket
        while SUBs still wait in its pending buffer, so the PONG can come back before the
        server has seen them, and a peer's request right after gets "no responders"
        (seen in 1 of ~40 agent starts). A message to ourselves travels in order."""
        try:
            inbox = self._nc.new_inbox()
            sub = await self._nc.subscribe(inbox, max_msgs=1)
            await self._nc.publish(inbox, b"")
            await sub.next_msg(timeout=timeout)
        except (nats.errors.Error, TimeoutError) as exc:
            raise ControlPlaneError(f"NATS flush failed: {exc!r}") from exc

    async def close(self) -> None:
        await self._replies.stop()
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._subs.clear()
        try:
            await self._nc.drain()
        except Exception:  # closing a broken connection must not mask the real error
            try:
                await self._nc.close()
            except asyncio.CancelledError:
                # nats-py cancels its own transport waiter when the server is already gone;
                # only a cancellation of this task goes on.
                task = asyncio.current_task()
                if task is not None and getattr(task, "cancelling", lambda: 1)():
                    raise
            except (OSError, nats.errors.Error) as exc:  # the server is gone: closed anyway
                log.debug("closing a broken NATS connection: %r", exc)


async def _requires_auth(url: str) -> bool:
    try:
        with anyio.fail_after(1.5):
            return any(p.reachable and p.auth_required for p in await probe(url, timeout=1.0))
    except Exception:
        return False


class _GiveUp(Exception):
    """Raised from nats-py's error callback to end its first-connection loop."""


async def _log_error(exc: Exception) -> None:
    log.debug("nats: %s", exc)
