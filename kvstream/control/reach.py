"""Why a NATS server cannot be reached, in words a user can act on.

nats-py retries an unreachable server for as long as reconnects are allowed and, once
the caller gives up, what is left is a bare ``TimeoutError``. This module names the real
cause of each failed attempt (refused, timed out, DNS, authentication, TLS) so that
``ControlBus.connect`` can fail at once when every server has failed for a definite
reason, and ``kvstream doctor`` can say what it found without a NATS client at all.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from typing import Final
from urllib.parse import urlsplit

import msgspec

__all__ = ["CAUSES", "ServerProbe", "classify", "probe", "servers_of"]

# One word per cause; ``other`` is anything not recognised (its text says what).
CAUSES: Final = ("refused", "timeout", "dns", "auth", "tls", "other")


class ServerProbe(msgspec.Struct, frozen=True, kw_only=True):
    """What a plain TCP look at one NATS server found (no credentials sent)."""

    server: str  # host:port
    reachable: bool
    cause: str = ""  # one of CAUSES when not reachable (or when INFO was not NATS's)
    detail: str = ""
    connect_ms: float | None = None
    version: str = ""  # from the server's INFO line
    auth_required: bool = False
    tls_required: bool = False
    jetstream: bool = False


def servers_of(url: str) -> list[tuple[str, int]]:
    """``(host, port)`` of each server in a NATS URL or comma-separated URL list."""
    out = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        split = urlsplit(part if "://" in part else f"nats://{part}")
        try:
            port = split.port or 4222
        except ValueError:  # a non-numeric port: let the connect attempt say so
            port = 4222
        out.append((split.hostname or "127.0.0.1", port))
    return out


def classify(exc: BaseException) -> tuple[str, str]:
    """``(cause, words)`` for one failed connection attempt (nats-py's or a socket's)."""
    import nats.errors

    if isinstance(exc, ConnectionRefusedError):
        return "refused", "connection refused (nothing listens on that port)"
    if isinstance(exc, socket.gaierror):
        return "dns", f"cannot resolve the host name ({exc.strerror or exc})"
    if isinstance(exc, ssl.SSLError | ssl.CertificateError):
        return "tls", f"TLS handshake failed ({exc})"
    if isinstance(exc, nats.errors.AuthorizationError) or "authorization" in str(exc).lower() \
            or "authentication" in str(exc).lower():
        return "auth", "authentication failed (the server refused these credentials)"
    if isinstance(exc, TimeoutError | asyncio.TimeoutError | nats.errors.TimeoutError):
        return "timeout", "timed out (no answer: a firewall, a wrong address, or a host down)"
    if isinstance(exc, ConnectionResetError | BrokenPipeError):
        return "other", f"connection reset by the server ({exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return "other", exc.strerror
    return "other", str(exc) or type(exc).__name__


async def _probe_one(host: str, port: int, timeout: float) -> ServerProbe:
    server = f"{host}:{port}"
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        cause, words = classify(exc)
        return ServerProbe(server=server, reachable=False, cause=cause, detail=words)
    connect_ms = (time.perf_counter() - t0) * 1e3
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        cause, words = classify(exc)
        return ServerProbe(server=server, reachable=False, cause=cause,
                           detail=f"connected, but no NATS greeting: {words}")
    finally:
        writer.close()
    if not line.startswith(b"INFO "):
        return ServerProbe(server=server, reachable=False, cause="other", connect_ms=connect_ms,
                           detail=f"connected, but that is not a NATS server (it sent {line[:40]!r})")
    try:
        info = json.loads(line[5:])
    except ValueError:
        info = {}
    return ServerProbe(server=server, reachable=True, connect_ms=round(connect_ms, 3),
                       version=str(info.get("version", "")),
                       auth_required=bool(info.get("auth_required")),
                       tls_required=bool(info.get("tls_required")),
                       jetstream=bool(info.get("jetstream")))


async def probe(url: str, timeout: float = 1.0) -> list[ServerProbe]:
    """Look at every server of ``url`` at once: TCP connect and NATS's INFO greeting,
    each within ``timeout`` seconds. Sends nothing, so it needs no credentials."""
    return list(await asyncio.gather(*(_probe_one(h, p, timeout) for h, p in servers_of(url))))
