"""The proxy's two legs over HTTP: P to a prefill engine, D to a decode engine, relayed.

``Legs`` is the part of ``kvstream.proxy.server.Proxy`` that talks to engines: choosing an
instance for a leg, the P leg, the D leg and its relay, and releasing a prefill offer that
nobody will pull. It holds no state of its own; ``Proxy`` sets the attributes declared here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Final

import anyio

from kvstream._exceptions import ConfigError, ProxyError
from kvstream.control.aborts import release_offer
from kvstream.control.bus import ControlBus
from kvstream.proxy.config import ROUTE_HEADER, ProxyConfig, prefill_body
from kvstream.proxy.inflight import Inflight
from kvstream.proxy.push import PushPlan, prefill_push
from kvstream.proxy.usage import SSEPatcher, patch_json
from kvstream.routing.directory import Directory, Instance, LegRole, pick

try:
    import aiohttp
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ConfigError("kvstream proxy needs aiohttp: pip install 'kvstream[proxy]'") from exc

__all__ = ["HTTP_ERRORS", "Legs", "PrefillUnreachable"]

log = logging.getLogger("kvstream.proxy")

# The prefill's own cache hits, waiting at most the given seconds for its answer (None: unknown)
Cached = Callable[[float], Awaitable[int | None]]
# How long a JSON answer may wait for the prefill's figure; a stream never waits (an event
# passes unpatched until the prefill has answered).
USAGE_WAIT_S: Final = 2.0

HTTP_ERRORS: Final = (aiohttp.ClientError, asyncio.TimeoutError)
# The engine could not be reached at all: nothing was sent, try it again later only.
# (ConnectionTimeoutError, the sock_connect timeout, is aiohttp >= 3.10.)
_UNREACHABLE: Final = (aiohttp.ClientConnectorError, getattr(aiohttp, "ConnectionTimeoutError",
                                                             aiohttp.ClientConnectorError))
# The connection broke: the engine may have died (or a kept-alive connection was stale).
# Read and total timeouts are not among these: that engine may still be working.
_CONNECTION_LOST: Final = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


def _one_line(data: bytes, limit: int = 500) -> str:
    """An engine's error body for a log line and an error message: no line breaks."""
    return " ".join(data[:limit].decode(errors="replace").split())


class PrefillUnreachable(ProxyError):
    """The P leg's engine could not be reached or dropped the connection: nothing holds KV
    for this request that the proxy could name, so it may run decode-only. ``sent``: False
    when the connection was never made (the engine cannot have offered anything)."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message, status=502, code="prefill_failed")
        self.sent = sent


class Legs:
    """Routing and forwarding of the legs; mixed into ``Proxy``, which owns the state."""

    config: ProxyConfig
    proxy_id: str
    directory: Directory
    _bus: ControlBus | None
    _session: aiohttp.ClientSession | None
    _inflight: Inflight
    _turn: Counter[str]
    _counts: Counter[str]

    # -- routing ------------------------------------------------------------------------
    def _choose(self, role: LegRole) -> Instance:
        chosen = self._pick(role)
        if chosen is None:
            raise ProxyError(f"no {role} instance available", status=503, code=f"no_{role}")
        return chosen

    def _pick(self, role: LegRole) -> Instance | None:
        chosen = pick(self.directory.instances(role), self._inflight, self._turn[role])
        if chosen is not None:
            self._turn[role] += 1
        return chosen

    # -- the legs -----------------------------------------------------------------------
    async def _prefill(self, p: Instance, path: str, body: dict[str, Any],
                       headers: dict[str, str], push: PushPlan | None = None
                       ) -> dict[str, Any] | None:
        """The P leg of the client's ``body``; ``push``: its engine pushes to the decode."""
        cfg = self.config
        p_body = prefill_body(body) if push is None else prefill_push(prefill_body(body), push)
        timeout = aiohttp.ClientTimeout(total=cfg.prefill_timeout_s,
                                        sock_connect=cfg.connect_timeout_s)
        assert self._session is not None  # started; not input validation
        self._inflight[p.url] += 1
        try:
            async with self._session.post(p.url + path, json=p_body, headers=headers,
                                          timeout=timeout) as resp:
                status, data = resp.status, await resp.read()
        except HTTP_ERRORS as exc:
            self._counts["prefill_errors"] += 1
            why = f"prefill {p.url} failed: {str(exc) or type(exc).__name__}"
            if isinstance(exc, _UNREACHABLE):
                self.directory.mark_unreachable(p.url)  # until its next chance
            if isinstance(exc, (*_UNREACHABLE, *_CONNECTION_LOST)):
                raise PrefillUnreachable(why, sent=not isinstance(exc, _UNREACHABLE)) from exc
            raise ProxyError(why, status=502, code="prefill_failed") from exc
        finally:
            self._inflight[p.url] -= 1
        if not 200 <= status < 300:
            self._counts["prefill_errors"] += 1
            raise ProxyError(f"prefill {p.url} answered {status}: {_one_line(data)}", status=502,
                             code="prefill_failed")
        try:
            reply = json.loads(data)
        except ValueError as exc:
            self._counts["prefill_errors"] += 1
            raise ProxyError(f"prefill {p.url} answered with invalid JSON", status=502,
                             code="prefill_failed") from exc
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        return params if isinstance(params, dict) else None

    async def _decode(self, request: web.Request, d_body: dict[str, Any],
                      params: dict[str, Any] | None, headers: dict[str, str],
                      route: str, chosen: Instance | None = None,
                      cached: Cached | None = None) -> tuple[web.StreamResponse, Instance]:
        """The D leg with ``d_body`` (on ``chosen``, else the least loaded); ``params``:
        the P leg's offer, released if D fails; ``cached``: the prefill's own cache hits,
        written into the answer's usage (``usage.py``)."""
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s,
                                        sock_read=cfg.decode_read_timeout_s)
        assert self._session is not None
        try:
            live = chosen is not None and any(
                i.url == chosen.url for i in self.directory.instances("decode"))
            d = chosen if chosen is not None and live else self._choose("decode")
        except ProxyError as exc:  # the decode instance vanished during the prefill
            await self._release(params, str(exc))
            raise
        self._inflight[d.url] += 1
        try:
            try:
                resp = await self._session.post(d.url + request.path, json=d_body,
                                                headers=headers, timeout=timeout)
            except HTTP_ERRORS as exc:
                self._counts["decode_errors"] += 1
                why = f"decode {d.url} failed: {str(exc) or type(exc).__name__}"
                await self._release(params, why)
                raise ProxyError(why, status=502, code="decode_failed") from exc
            async with resp:
                if not 200 <= resp.status < 300:
                    # D refused or failed the request before any output: nothing will pull
                    # the offer now (a pull already running there is not touched: only its
                    # puller can stop that), so free P's blocks instead of waiting.
                    self._counts["decode_errors"] += 1
                    data = b""
                    with contextlib.suppress(*HTTP_ERRORS):
                        data = await resp.read()
                    await self._release(params, f"decode {d.url} answered {resp.status}")
                    return web.Response(status=resp.status, body=data,
                                        content_type=resp.content_type,
                                        headers={"X-Request-Id": headers["X-Request-Id"],
                                                 ROUTE_HEADER: route}), d
                return await self._relay(request, resp, d, headers["X-Request-Id"], route,
                                         cached), d
        finally:
            self._inflight[d.url] -= 1

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse, d: Instance,
                     request_id: str, route: str, cached: Cached | None = None
                     ) -> web.StreamResponse:
        """Pass the D leg's body through chunk by chunk (SSE events as they come)."""
        if cached is not None and resp.content_type == "application/json":
            try:
                body = await resp.read()
            except HTTP_ERRORS as exc:
                self._counts["decode_errors"] += 1
                raise ProxyError(f"decode {d.url} failed: {str(exc) or type(exc).__name__}",
                                 status=502, code="decode_failed") from exc
            hits = await cached(USAGE_WAIT_S) if b'"prompt_tokens_details"' in body else None
            return web.Response(status=resp.status, content_type=resp.content_type,
                                body=body if hits is None else patch_json(body, hits),
                                headers={"X-Request-Id": request_id, ROUTE_HEADER: route})
        sse = SSEPatcher() if cached is not None else None
        out = web.StreamResponse(status=resp.status)
        out.content_type = resp.content_type
        if resp.charset:
            out.charset = resp.charset
        out.headers["X-Request-Id"] = request_id
        out.headers[ROUTE_HEADER] = route
        if resp.content_length is not None and sse is None:
            out.content_length = resp.content_length
        await out.prepare(request)
        try:
            async for chunk in resp.content.iter_any():
                if sse is not None:
                    if sse.cached is None and cached is not None and sse.needs(chunk):
                        sse.cached = await cached(0.0)
                    chunk = sse.feed(chunk)
                await out.write(chunk)
            if sse is not None:
                await out.write(sse.flush())
        except ConnectionResetError:  # the client left; closing resp tells the engine
            log.info("%s: the client went away mid-stream", request_id)
            return out
        except HTTP_ERRORS as exc:
            # D accepted the request, so its connector owns the offer's fate (it keeps the
            # lease or pulls; P notices a dead keeper). The status is sent: cut the
            # connection so the client sees a truncated body, not a clean end.
            self._counts["decode_errors"] += 1
            log.warning("decode %s failed mid-stream: %s", d.url, str(exc) or type(exc).__name__)
            if request.transport is not None:
                request.transport.close()
            return out
        try:
            await out.write_eof()
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one too
            # The client had the whole body (a streamed one ends with its [DONE] event) and
            # closed first: the request succeeded, nothing to report beyond its INFO line.
            log.debug("%s: the client closed before the response's end was written",
                      request_id)
        return out

    async def _release(self, params: dict[str, Any] | None, reason: str) -> None:
        """Tell the prefill instance holding ``params``' KV that nobody will pull it."""
        if self._bus is None or not params:
            return
        engine, rid = params.get("remote_engine_id"), params.get("remote_request_id")
        if not (isinstance(engine, str) and engine and isinstance(rid, str) and rid):
            return
        targets = self.directory.engine_instances(engine)
        extra = params.get("kvstream")
        if isinstance(extra, dict) and isinstance(extra.get("instance"), str):
            targets = sorted({*targets, extra["instance"]})
        bus, cfg = self._bus, self.config
        secret = extra.get("secret", "") if isinstance(extra, dict) else ""
        secret = secret if isinstance(secret, str) else ""

        async def one(src: str) -> None:
            if await release_offer(bus, cfg.namespace, src, rid, reason, by=self.proxy_id,
                                   timeout=cfg.abort_timeout_s, secret=secret):
                self._counts["offers_released"] += 1
                log.info("released %s's offer of %s: %s", src, rid, reason)

        # Shielded: a client that hangs up must not leave the blocks held until the lease.
        with anyio.CancelScope(shield=True), anyio.move_on_after(cfg.abort_timeout_s * 2):
            async with anyio.create_task_group() as tg:
                for src in targets:
                    tg.start_soon(one, src)

