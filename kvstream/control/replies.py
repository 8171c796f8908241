"""Opening what arrives, and requests' replies on one wildcard inbox.

NATS delivers to a request's reply subject whatever anyone publishes there, and on a bus
without permissions anyone can read that subject off the request. So a reply ends a
request only when it opens as the asked peer's (boxed for us by it, or signed by it);
anything else is dropped and counted (``Seal.forged``) and the request waits on for the
genuine answer until its timeout. A "no responders" status carries no signature either:
it is believed at once only when the registry holds the peer dead (or has no view),
else the request waits until the peer is held dead or the genuine answer comes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Final

import anyio
import nats.errors

from kvstream._exceptions import ControlPlaneError, MessageDecodeError, NoPeerError
from kvstream.control import messages as m
from kvstream.control.identity import BOX, Seal

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

__all__ = ["KEY_POLL_S", "Replies", "Waiter", "key_for", "open_message"]

KEY_POLL_S: Final = 0.02  # how often a request to a peer not yet announced looks again
ALIVE_POLL_S: Final = 0.1  # how often a "no responders" request looks at the peer's liveness
_STATUS: Final = "Status"
_NO_RESPONDERS: Final = "503"

Opened = tuple[m.ControlUnion, dict[str, str]]


def open_message(seal: Seal, subject: str, data: bytes, headers: Mapping[str, str] | None
                 ) -> Opened | MessageDecodeError | None:
    """A message as a handler gets it, decoded, with its checked headers; None: refused
    (unsigned, forged, not for us); a ``MessageDecodeError``: it does not decode. A signed
    message is decoded first (garbage costs no signature check); a boxed one is opened
    first (its bytes are ciphertext)."""
    if headers and BOX in headers:
        opened = seal.incoming(subject, data, headers)
        if opened is None:
            return None
        try:
            return m.decode(opened[0]), opened[1]
        except MessageDecodeError as exc:
            return exc
    try:
        decoded = m.decode(data)
    except MessageDecodeError as exc:
        return exc
    checked = seal.incoming(subject, data, headers)
    return None if checked is None else (decoded, checked[1])


async def key_for(seal: Seal, peer: str | None) -> bytes | None:
    """The key to box a message for ``peer`` under; waits while it is unknown (the peer's
    announcement not seen yet), up to ``seal.key_wait_s``, then ``NoPeerError`` (nothing
    was sent: ``no_responders``); the caller bounds the wait too. None: nothing to box
    for (no peer, or a bus without an identity or a key book)."""
    if peer is None or seal.identity is None or seal.key_of is None:
        return None
    since = anyio.current_time()
    while (key := seal.peer_key(peer)) is None:
        if seal.key_wait_s is not None and anyio.current_time() - since >= seal.key_wait_s:
            raise NoPeerError(f"{peer} is not announced: nobody to send to", peer=peer,
                              no_responders=True)
        await anyio.sleep(KEY_POLL_S)
    return key


class Waiter:
    """One request waiting on its own inbox subject."""

    def __init__(self, inbox: str, peer: str | None) -> None:
        self.inbox = inbox
        self.peer = peer
        self.reply: m.ControlUnion | None = None
        self.no_responders = False
        self.changed = anyio.Event()

    def _wake(self) -> None:
        self.changed.set()

    async def wait(self, subject: str, alive: Callable[[str], bool] | None) -> m.ControlUnion:
        """The genuine reply; ``NoPeerError(no_responders=True)`` once "no responders" came
        and the peer is held dead (or liveness is not known here). The caller bounds it."""
        while True:
            if self.reply is not None:
                return self.reply
            if self.no_responders:
                if alive is None or self.peer is None or not alive(self.peer):
                    raise NoPeerError(f"no instance answers on {subject}", peer=self.peer,
                                      no_responders=True)
                with anyio.move_on_after(ALIVE_POLL_S):
                    await self.changed.wait()
            else:
                await self.changed.wait()
            self.changed = anyio.Event()


class Replies:
    """Every request of one connection answered on ``<inbox>.<n>``, one subscription."""

    def __init__(self, seal: Seal) -> None:
        self.seal = seal
        self.malformed = 0
        self._prefix = ""
        self._sub: Subscription | None = None
        self._lock = anyio.Lock()
        self._count = itertools.count()
        self._waiting: dict[str, Waiter] = {}

    async def start(self, nc: NatsClient) -> None:
        """Subscribe the inbox, once (later calls return at once)."""
        if self._sub is not None:
            return
        async with self._lock:
            if self._sub is not None:
                return
            prefix = nc.new_inbox() + "."
            try:
                self._sub = await nc.subscribe(prefix + "*", cb=self._on_msg)
            except nats.errors.Error as exc:
                raise ControlPlaneError(f"cannot subscribe to the reply inbox: {exc}") from exc
            self._prefix = prefix

    def open(self, peer: str | None) -> Waiter:
        """A waiter on a fresh inbox subject (after ``start``); ``close`` it when done."""
        token = str(next(self._count))
        waiter = Waiter(self._prefix + token, peer)
        self._waiting[token] = waiter
        return waiter

    def close(self, waiter: Waiter) -> None:
        self._waiting.pop(waiter.inbox[len(self._prefix):], None)

    async def _on_msg(self, msg: Msg) -> None:
        waiter = self._waiting.get(msg.subject[len(self._prefix):])
        if waiter is None or waiter.reply is not None:
            return  # late, or a second answer
        if msg.headers and msg.headers.get(_STATUS) == _NO_RESPONDERS and not msg.data:
            waiter.no_responders = True
            waiter._wake()
            return
        opened = self.seal.reply_from(msg.subject, msg.data, msg.headers, waiter.peer)
        if opened is None:
            return  # not the asked peer's: counted in seal.forged, waited past
        try:
            waiter.reply = m.decode(opened[0])
        except MessageDecodeError:
            self.malformed += 1
            return
        waiter._wake()

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
