"""Who sent a control message: every agent signs what it sends, and checks what it gets.

NATS tells a subscriber nothing about the publisher, and on a shared server any client
allowed to publish on a subject can claim any ``src``. So each agent makes an Ed25519 key
when it starts (``Identity``) and puts three headers on every message: its instance id,
its public key and a signature over the subject, that id and the payload bytes. The
receiver checks the signature, then asks its key book (the registry) whether that key
belongs to that id. A key that arrives on the instance's own registry subject (which NATS
permissions let only that instance publish to) is *announced*: it binds the id, and
replaces an earlier key once that one's incarnation left or went silent (a restart). A
key first seen elsewhere binds only tentatively: an announced key replaces it, and it
never replaces an announced one. Handlers see the checked sender under the header name
``SENDER`` and the subject under ``SUBJECT``, which the wire cannot carry (NATS header
names have no ':').

The payload is signed as sent, not re-encoded: a newer peer's extra fields still check.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from typing import Final

import nacl.exceptions
import nacl.signing

__all__ = ["FROM", "KEY", "SENDER", "SIG", "SUBJECT", "Identity", "Seal", "Trust", "open_sealed"]

FROM: Final = "Kvs-From"
KEY: Final = "Kvs-Key"
SIG: Final = "Kvs-Sig"
SENDER: Final = ":sender"  # set by the bus after checking; never on the wire
SUBJECT: Final = ":subject"  # the subject it came on, likewise

# (instance id, public key, announced) -> is this that instance's key? Binds a new one
# (``announced``: it came on the instance's own registry subject).
Trust = Callable[[str, bytes, bool], bool]

_MAX_ID: Final = 1024


def _signed(subject: str, sender: str, data: bytes) -> bytes:
    return b"%s\0%s\0%s" % (subject.encode(), sender.encode(), data)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


def _unb64(text: str, size: int) -> bytes | None:
    if len(text) > 2 * size:
        return None
    try:
        raw = base64.urlsafe_b64decode(text.encode())
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == size else None


class Identity:
    """This agent's signing key (one per process start; never leaves the process)."""

    def __init__(self, instance_id: str, key: nacl.signing.SigningKey | None = None) -> None:
        self.instance_id = instance_id
        self._key = key or nacl.signing.SigningKey.generate()
        self.public_key = bytes(self._key.verify_key)
        self._key_text = _b64(self.public_key)

    def seal(self, subject: str, data: bytes,
             headers: Mapping[str, str] | None = None) -> dict[str, str]:
        """``headers`` plus the three that prove this message is ours."""
        sig = self._key.sign(_signed(subject, self.instance_id, data)).signature
        out = {k: v for k, v in (headers or {}).items() if k not in (FROM, KEY, SIG, SENDER)}
        out.update({FROM: self.instance_id, KEY: self._key_text, SIG: _b64(sig)})
        return out


def open_sealed(subject: str, data: bytes, headers: Mapping[str, str], trust: Trust,
                registry_prefix: str = "") -> str | None:
    """The sender's instance id when the signature checks and ``trust`` owns (or binds)
    the key to it, else None (unsigned, forged, tampered or an id bound to another key).
    A message on ``registry_prefix + sender`` announces its key."""
    sender = headers.get(FROM, "")
    if not sender or len(sender) > _MAX_ID:
        return None
    key = _unb64(headers.get(KEY, ""), 32)
    sig = _unb64(headers.get(SIG, ""), 64)
    if key is None or sig is None:
        return None
    try:
        nacl.signing.VerifyKey(key).verify(_signed(subject, sender, data), sig)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.CryptoError, ValueError):
        return None
    announced = bool(registry_prefix) and subject == registry_prefix + sender
    return sender if trust(sender, key, announced) else None


class Seal:
    """A bus's signing and checking, off until the agent that owns the bus sets
    ``identity`` and ``trust`` (a bus without them passes messages as they are)."""

    def __init__(self) -> None:
        self.identity: Identity | None = None
        self.trust: Trust | None = None
        self.registry_prefix = ""  # "kvs.<ns>.registry.": where keys are announced
        self.forged = 0  # messages refused: unsigned, bad signature, or a key not theirs

    def outgoing(self, subject: str, data: bytes,
                 headers: Mapping[str, str] | None) -> dict[str, str] | None:
        """The headers to send ``data`` on ``subject`` with: signed once set up."""
        if self.identity is None:
            return dict(headers) if headers else None
        return self.identity.seal(subject, data, headers)

    def incoming(self, subject: str, data: bytes,
                 headers: Mapping[str, str] | None) -> dict[str, str] | None:
        """The headers a handler sees (with ``SENDER`` when checked), or None: refused."""
        out = {k: v for k, v in (headers or {}).items() if k not in (SENDER, SUBJECT)}
        out[SUBJECT] = subject
        if self.trust is None:
            return out
        sender = open_sealed(subject, data, out, self.trust, self.registry_prefix)
        if sender is None:
            self.forged += 1
            return None
        out[SENDER] = sender
        return out

    def reply_from(self, subject: str, data: bytes, headers: Mapping[str, str] | None,
                   peer: str | None) -> bool:
        """Is this reply to a request of ours signed by the peer we asked?"""
        checked = self.incoming(subject, data, headers)
        if checked is None:
            return False
        if self.trust is not None and peer is not None and checked.get(SENDER) != peer:
            self.forged += 1
            return False
        return True
