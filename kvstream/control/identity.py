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

A message meant for one peer (a request with ``peer``, a reply, a note) is *boxed* instead:
encrypted and authenticated (XChaCha20-Poly1305) under the key the two agents share
(``Identity.pair_key``: X25519 over their Ed25519 keys, derived once per peer and cached),
with the subject, the sender and the recipient as associated data. Nobody else on the bus
reads it (offer secrets, data-plane tags, TCP tokens, same-host proofs travel only boxed),
and opening it proves the sender holds the key it names, at a few microseconds instead of
an Ed25519 signature and check. Broadcasts (announcements, KV events, routing) are signed.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import os
from collections.abc import Callable, Mapping
from typing import Final

import nacl.bindings
import nacl.exceptions
import nacl.signing

__all__ = ["BOX", "FROM", "KEY", "SENDER", "SENDER_KEY", "SIG", "SUBJECT", "Identity", "KeyOf",
           "Seal", "Trust", "key_in", "open_sealed"]

FROM: Final = "Kvs-From"
KEY: Final = "Kvs-Key"
SIG: Final = "Kvs-Sig"
BOX: Final = "Kvs-Box"  # names the recipient of a boxed message
SENDER: Final = ":sender"  # set by the bus after checking; never on the wire
SUBJECT: Final = ":subject"  # the subject it came on, likewise
SENDER_KEY: Final = ":sender-key"  # the checked sender's key (base64), likewise
_LOCAL: Final = (SENDER, SUBJECT, SENDER_KEY)

# (instance id, public key, announced) -> is this that instance's key? Binds a new one
# (``announced``: it came on the instance's own registry subject).
Trust = Callable[[str, bytes, bool], bool]

# instance id -> the public key it signs with, as the key book holds it (None: unknown).
KeyOf = Callable[[str], "bytes | None"]

_MAX_ID: Final = 1024
_NONCE: Final = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES
_PAIR_KEYS: Final = 1 << 14  # peers' shared keys cached per identity


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

        self._x25519 = bytes(self._key.to_curve25519_private_key())
        self._pairs: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()

    def pair_key(self, peer_key: bytes) -> bytes | None:
        """The 32-byte key this agent shares with the holder of ``peer_key`` (an Ed25519
        public key), the same from both ends; None for a key that is no curve point.
        Cached: the X25519 step (~0.1 ms) runs once per peer incarnation."""
        key = self._pairs.get(peer_key)
        if key is not None:
            self._pairs.move_to_end(peer_key)
            return key
        try:
            peer_x = bytes(nacl.signing.VerifyKey(peer_key).to_curve25519_public_key())
            shared = nacl.bindings.crypto_scalarmult(self._x25519, peer_x)
        except (nacl.exceptions.CryptoError, ValueError, TypeError):
            return None
        low, high = sorted((self.public_key, peer_key))
        key = hashlib.blake2b(shared + low + high, digest_size=32,
                              person=b"kvs-pair-key").digest()
        self._pairs[peer_key] = key
        if len(self._pairs) > _PAIR_KEYS:
            self._pairs.popitem(last=False)
        return key

    def box(self, subject: str, data: bytes, to: str, to_key: bytes,
            headers: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, str]] | None:
        """``data`` encrypted for instance ``to`` (holding ``to_key``), and the headers to
        send it with; None if ``to_key`` is unusable."""
        key = self.pair_key(to_key)
        if key is None:
            return None
        nonce = os.urandom(_NONCE)
        sealed = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_encrypt(
            data, _aad(subject, self.instance_id, to), nonce, key)
        out = {k: v for k, v in (headers or {}).items()
               if k not in (FROM, KEY, SIG, BOX, SENDER)}
        out.update({FROM: self.instance_id, KEY: self._key_text, BOX: to})
        return nonce + sealed, out

    def unbox(self, subject: str, data: bytes, sender: str, sender_key: bytes) -> bytes | None:
        """The plaintext of a message boxed for us by ``sender`` under ``sender_key``;
        None if it does not open (forged, tampered, or for someone else)."""
        key = self.pair_key(sender_key)
        if key is None or len(data) < _NONCE:
            return None
        try:
            return bytes(nacl.bindings.crypto_aead_xchacha20poly1305_ietf_decrypt(
                data[_NONCE:], _aad(subject, sender, self.instance_id), data[:_NONCE], key))
        except (nacl.exceptions.CryptoError, ValueError, TypeError):
            return None

    def seal(self, subject: str, data: bytes,
             headers: Mapping[str, str] | None = None) -> dict[str, str]:
        """``headers`` plus the three that prove this message is ours."""
        sig = self._key.sign(_signed(subject, self.instance_id, data)).signature
        out = {k: v for k, v in (headers or {}).items()
               if k not in (FROM, KEY, SIG, BOX, SENDER)}
        out.update({FROM: self.instance_id, KEY: self._key_text, SIG: _b64(sig)})
        return out


def _aad(subject: str, sender: str, recipient: str) -> bytes:
    return b"%s\0%s\0%s" % (subject.encode(), sender.encode(), recipient.encode())


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
    """A bus's signing, boxing and checking, off until the agent that owns the bus sets
    ``identity`` and ``trust``: without ``trust`` messages pass unchecked (boxed ones
    opened, when there is an ``identity`` to open them with; refused without one)."""

    def __init__(self) -> None:
        self.identity: Identity | None = None
        self.trust: Trust | None = None
        self.key_of: KeyOf | None = None  # peers' keys, for boxing what goes to one peer
        self.registry_prefix = ""  # "kvs.<ns>.registry.": where keys are announced
        # How long a request waits for the key of a peer nobody has announced before the
        # peer is taken as absent (None: the request's whole timeout).
        self.key_wait_s: float | None = None
        self.forged = 0  # messages refused: unsigned, bad signature, or a key not theirs

    def peer_key(self, peer: str) -> bytes | None:
        """The key a message for ``peer`` is boxed under (None: not known yet)."""
        if self.identity is not None and peer == self.identity.instance_id:
            return self.identity.public_key
        return self.key_of(peer) if self.key_of is not None else None

    def outgoing(self, subject: str, data: bytes, headers: Mapping[str, str] | None, *,
                 to: str | None = None, to_key: bytes | None = None
                 ) -> tuple[bytes, dict[str, str] | None]:
        """What to send ``data`` on ``subject`` as: boxed for ``to`` (under ``to_key``)
        when given and set up, else signed once set up."""
        if self.identity is None:
            return data, (dict(headers) if headers else None)
        if to is not None and to_key is not None:
            boxed = self.identity.box(subject, data, to, to_key, headers)
            if boxed is not None:
                return boxed
        return data, self.identity.seal(subject, data, headers)

    def incoming(self, subject: str, data: bytes, headers: Mapping[str, str] | None
                 ) -> tuple[bytes, dict[str, str]] | None:
        """The payload and the headers a handler sees (``SENDER`` and ``SENDER_KEY`` when
        checked), or None: refused (counted in ``forged``)."""
        out = {k: v for k, v in (headers or {}).items() if k not in _LOCAL}
        out[SUBJECT] = subject
        boxed = BOX in out
        if self.identity is None and boxed:
            self.forged += 1  # it cannot be opened here
            return None
        if boxed:
            opened = self._unbox(subject, data, out)
            if opened is None:
                self.forged += 1
            return opened
        if self.trust is None:
            return data, out
        sender = open_sealed(subject, data, out, self.trust, self.registry_prefix)
        if sender is None:
            self.forged += 1
            return None
        out[SENDER] = sender
        out[SENDER_KEY] = out[KEY]
        return data, out

    def _unbox(self, subject: str, data: bytes, out: dict[str, str]
               ) -> tuple[bytes, dict[str, str]] | None:
        assert self.identity is not None
        sender = out.get(FROM, "")
        key = _unb64(out.get(KEY, ""), 32)
        if out.get(BOX) != self.identity.instance_id or not sender or len(sender) > _MAX_ID \
                or key is None:
            return None
        plain = self.identity.unbox(subject, data, sender, key)
        if plain is None or (self.trust is not None and not self.trust(sender, key, False)):
            return None
        out[SENDER] = sender
        out[SENDER_KEY] = out[KEY]
        return plain, out

    def reply_from(self, subject: str, data: bytes, headers: Mapping[str, str] | None,
                   peer: str | None) -> tuple[bytes, dict[str, str]] | None:
        """A reply to a request of ours, opened, when it is boxed or signed by the peer we
        asked (any checked sender when ``peer`` is None); else None."""
        checked = self.incoming(subject, data, headers)
        if checked is None:
            return None
        if self.trust is not None and peer is not None and checked[1].get(SENDER) != peer:
            self.forged += 1
            return None
        return checked


def key_in(headers: Mapping[str, str]) -> bytes | None:
    """The checked sender's public key, from the headers ``Seal.incoming`` returned."""
    return _unb64(headers.get(SENDER_KEY, ""), 32)
