"""The one exception tree of kvstream.

Every error kvstream raises is a ``KVStreamError``; foreign errors (nats, ucxx,
msgspec, torch) are translated at the module that talks to them, with
``raise ... from exc`` so the cause stays visible::

    KVStreamError
    ├── ConfigError                 bad settings, unknown preset, bad CLI argument
    │   ├── CapacityError           a bounded table is full (max_transfers ...)
    │   ├── DuplicateRequestError   the request already has a reservation, offer or pull
    │   └── ClosedError             the agent is not started, or closed
    ├── LayoutError                 memory that does not match its KVLayout
    ├── ProtocolError               a message we cannot accept
    │   ├── MessageDecodeError      malformed bytes or wrong field types
    │   ├── IncompatiblePeerError   protocol version or layout fingerprint mismatch
    │   └── ForbiddenError          unsigned, forged, or without the offer's secret
    ├── ControlPlaneError           NATS trouble
    │   ├── NatsConnectError        the first connection failed: refused, timed out, auth, TLS, DNS
    │   ├── NoPeerError             nobody answers for that instance (no responders)
    │   └── SidecarLostError        the local sidecar went away (kvstream.client)
    ├── DataPlaneError              UCX trouble (endpoint error, worker setup)
    ├── InvalidBlockError           block ids outside registered memory
    ├── TransferError               a transfer ended without completing
    │   ├── TransferAbortedError    aborted by either side
    │   ├── PeerLostError           the peer died (missed heartbeats, UCX error)
    │   ├── TransferTimeout         deadline passed (also a ``TimeoutError``)
    │   └── LeaseExpiredError       held blocks released: nobody renewed the lease
    ├── QuantizationError
    ├── AdapterError
    └── ProxyError                  ``kvstream proxy`` could not serve a request (HTTP status)

Every error carries its structured fields as attributes (request id, peer, block ids,
limit ...); ``fields()`` lists them, so an error crossing the sidecar socket arrives
whole (``from_fields`` rebuilds it on the engine's side).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

# What a structured field may hold on the wire (the sidecar protocol carries them).
FieldValue: TypeAlias = str | int | float | bool | list[int] | None

__all__ = [
    "AdapterError",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "ControlPlaneError",
    "DataPlaneError",
    "DuplicateRequestError",
    "FieldValue",
    "ForbiddenError",
    "IncompatiblePeerError",
    "InvalidBlockError",
    "KVStreamError",
    "LayoutError",
    "LeaseExpiredError",
    "MessageDecodeError",
    "NatsConnectError",
    "NoPeerError",
    "PeerLostError",
    "ProtocolError",
    "ProxyError",
    "QuantizationError",
    "TransferAbortedError",
    "TransferError",
    "TransferTimeout",
]


class KVStreamError(Exception):
    """Root of every kvstream error."""

    def fields(self) -> dict[str, FieldValue]:
        """The structured fields (public attributes of wire-safe types), by name."""
        out: dict[str, FieldValue] = {}
        for name, value in vars(self).items():
            if name.startswith("_"):
                continue
            if isinstance(value, tuple | list) and all(type(v) is int for v in value):
                out[name] = list(value)
            elif value is None or isinstance(value, str | int | float | bool):
                out[name] = value
        return out

    @classmethod
    def from_fields(cls, message: str, fields: dict[str, FieldValue]) -> KVStreamError:
        """The error as its raiser had it, without running a constructor (their keyword
        arguments differ); list fields come back as tuples, as the constructors keep them."""
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        for name, value in fields.items():
            if not name.startswith("_"):
                setattr(exc, name, tuple(value) if isinstance(value, list) else value)
        return exc


class ConfigError(KVStreamError):
    """A setting, preset name or argument is invalid."""


class CapacityError(ConfigError):
    """A bounded table or pool is full; ``what`` it is and its ``limit``. (A ConfigError
    too: code that caught that before still does.)"""

    def __init__(self, message: str, *, what: str = "", limit: int = 0) -> None:
        super().__init__(message)
        self.what = what
        self.limit = limit


class DuplicateRequestError(ConfigError):
    """``request_id`` already has a reservation, an offer or a pull here."""

    def __init__(self, message: str, *, request_id: str = "", peer: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.peer = peer


class ClosedError(ConfigError):
    """The resource (``what``) is not started, or already closed."""

    def __init__(self, message: str, *, what: str = "agent") -> None:
        super().__init__(message)
        self.what = what


class LayoutError(KVStreamError):
    """Tensors handed to kvstream do not match the declared KV layout."""


class ProtocolError(KVStreamError):
    """A control or data-plane message could not be accepted."""


class MessageDecodeError(ProtocolError):
    """Bytes that are not a valid message of the expected plane."""


class IncompatiblePeerError(ProtocolError):
    """The peer speaks another protocol version or holds another KV layout."""

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class ForbiddenError(ProtocolError):
    """The peer refused us: the message was not signed by the instance it names, or
    it lacked the offer's secret (a pull, keep or abort of someone else's offer)."""


class ControlPlaneError(KVStreamError):
    """NATS could not be reached or did not deliver."""


class NatsConnectError(ControlPlaneError):
    """No server of ``url`` took the first connection; ``cause`` says why, in one word
    (``refused``, ``timeout``, ``dns``, ``auth``, ``tls`` or ``other``), ``detail`` in words."""

    def __init__(self, message: str, *, url: str, cause: str, detail: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.cause = cause
        self.detail = detail


class NoPeerError(ControlPlaneError):
    """No instance answers on the subject (NATS no-responders or timeout)."""

    def __init__(self, message: str, *, peer: str | None = None,
                 no_responders: bool = False) -> None:
        super().__init__(message)
        self.peer = peer
        # True: nobody is subscribed (the process is gone); False: it did not answer in time.
        self.no_responders = no_responders


class DataPlaneError(KVStreamError):
    """UCX could not be set up or an endpoint failed."""


class InvalidBlockError(KVStreamError):
    """Block ids that fall outside the registered KV memory."""

    def __init__(self, message: str, *, block_ids: Sequence[int] = (), limit: int = 0) -> None:
        super().__init__(message)
        self.block_ids = tuple(block_ids)
        self.limit = limit


class TransferError(KVStreamError):
    """A transfer ended in a state other than completed."""

    def __init__(self, message: str, *, request_id: str | None = None, peer: str | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.peer = peer


class TransferAbortedError(TransferError):
    """One side aborted the transfer."""


class PeerLostError(TransferError):
    """The peer stopped answering (dead process, lost heartbeats, UCX error)."""


class TransferTimeout(TransferError, TimeoutError):
    """The transfer's deadline passed before it completed."""


class LeaseExpiredError(TransferError):
    """The source released blocks held for a pull: the lease was not renewed in time."""


class QuantizationError(KVStreamError):
    """A codec could not encode or decode a block."""


class AdapterError(KVStreamError):
    """An engine adapter was misconfigured or its engine is missing."""


class ProxyError(KVStreamError):
    """The proxy could not serve a request; ``status`` is the HTTP status the client gets
    (503: no instance of a role, 502: an engine failed) and ``code`` names the cause."""

    def __init__(self, message: str, *, status: int, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
