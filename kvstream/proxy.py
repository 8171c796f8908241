"""``kvstream proxy``: an OpenAI-compatible prefill/decode proxy over the kvstream registry.

Each completion request runs in two legs, exactly as vLLM's toy P/D proxy
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``) does them, so engines
behind either proxy see the same thing:

* **P leg**: the client's body with ``kv_transfer_params`` asking for a remote decode,
  ``stream: false``, ``max_tokens: 1``; the prefill engine answers with the
  ``kv_transfer_params`` that name its held KV (engine id, request id, blocks).
* **D leg**: the client's body plus those params, streamed back as it arrives.

Both legs carry the same ``X-Request-Id``. Instances come from the registry (agents
announce their ``endpoint``) and from static URLs; the least loaded gets each leg
(``kvstream.routing``). What the toy proxy does not do: when the D leg fails before the
decode engine could have pulled, the proxy tells the prefill instance to drop its offer
now (``release_offer``) instead of letting the blocks wait for the lease to expire.

**Decode-only** (``ProxyConfig.no_prefill="decode"``, the default): with no live prefill
instance, or when the P leg cannot reach its engine (it died between two registry
heartbeats), the request goes to a decode instance unchanged and without
``kv_transfer_params``, and that engine runs it whole (prompt included). Such responses
carry ``X-KVStream-Route: decode-only`` (P/D ones ``prefill-decode``); one WARNING marks
each change into this mode, ``ProxyStatistics.decode_only`` counts the requests.
``"reject"`` answers 503 instead.

aiohttp is the optional extra ``kvstream[proxy]``; nothing else imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal

import anyio
import msgspec

from kvstream._exceptions import ConfigError, ProxyError
from kvstream.control.aborts import release_offer
from kvstream.control.bus import ControlBus
from kvstream.control.nats_server import DEFAULT_NATS_URL
from kvstream.control.subjects import Subjects
from kvstream.routing import Directory, Instance, LegRole, pick

try:
    import aiohttp
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ConfigError("kvstream proxy needs aiohttp: pip install 'kvstream[proxy]'") from exc

__all__ = ["ROUTE_HEADER", "NoPrefill", "Proxy", "ProxyConfig", "ProxyStatistics", "decode_body",
           "decode_only_body", "prefill_body"]

log = logging.getLogger("kvstream.proxy")

# What the P leg asks of the prefill engine: keep the KV for a remote decode (vLLM's keys).
PREFILL_PARAMS: Final = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_request_id": None, "remote_host": None,
    "remote_port": None,
}
# Dropped from the P leg: streaming options, and minimums a one-token prefill cannot meet.
_NOT_FOR_PREFILL: Final = ("stream_options", "min_tokens", "min_completion_tokens")
_HTTP_ERRORS: Final = (aiohttp.ClientError, asyncio.TimeoutError)
# The engine could not be reached at all: nothing was sent, try it again later only.
# (ConnectionTimeoutError, the sock_connect timeout, is aiohttp >= 3.10.)
_UNREACHABLE: Final = (aiohttp.ClientConnectorError, getattr(aiohttp, "ConnectionTimeoutError",
                                                             aiohttp.ClientConnectorError))
# The connection broke: the engine may have died (or a kept-alive connection was stale).
# Read and total timeouts are not among these: that engine may still be working.
_CONNECTION_LOST: Final = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
# Which response header says how a completion was served.
ROUTE_HEADER: Final = "X-KVStream-Route"
NoPrefill = Literal["decode", "reject"]


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of one proxy. Times are seconds."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (``Proxy.url`` says which)
    # The registry's NATS; None: static instances only, and no early release of offers.
    nats_url: str | None = DEFAULT_NATS_URL
    namespace: str = "default"
    prefill: tuple[str, ...] = ()  # static engine URLs, for engines that do not announce
    decode: tuple[str, ...] = ()
    proxy_id: str = ""  # "" -> "proxy-<8 hex>"; names the sender of its aborts
    peer_timeout_s: float = 2.0  # an instance silent this long is not routed to
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 600.0  # the whole P leg (a long prompt's prefill)
    decode_read_timeout_s: float = 600.0  # longest silence of the D leg (first token included)
    abort_timeout_s: float = 2.0  # how long a release waits for the prefill side's ack
    max_body_bytes: int = 64 << 20  # client request bodies (token-id prompts can be large)
    # No live prefill instance, or the P leg could not reach its engine: "decode" sends the
    # request whole to a decode instance (it prefills itself), "reject" answers 503 (502).
    no_prefill: NoPrefill = "decode"

    def __post_init__(self) -> None:
        Subjects(self.namespace)
        if self.no_prefill not in ("decode", "reject"):
            raise ConfigError(f"no_prefill must be 'decode' or 'reject', not {self.no_prefill!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is not a TCP port")
        if self.proxy_id:
            Subjects.check_instance_id(self.proxy_id)
        for name in ("peer_timeout_s", "connect_timeout_s", "prefill_timeout_s",
                     "decode_read_timeout_s", "abort_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.nats_url is None and not (self.prefill and self.decode):
            raise ConfigError("without NATS the proxy needs static --prefill and --decode URLs")


class ProxyStatistics(msgspec.Struct, frozen=True, kw_only=True):
    requests: int  # completion requests received
    prefill_errors: int  # P legs that failed (502, or decode-only if the engine was unreachable)
    decode_errors: int  # D legs that failed (before or while streaming)
    offers_released: int  # prefill offers dropped early on a D failure (acknowledged)
    inflight: dict[str, int]  # legs in flight per engine URL
    decode_only: int = 0  # requests sent whole to a decode instance (no usable prefill)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The P leg's body: one token, no streaming, KV kept for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The D leg's body: the client's, plus what the prefill engine returned (if anything)."""
    out = dict(body)
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def decode_only_body(body: dict[str, Any]) -> dict[str, Any]:
    """A decode-only request's body: the client's, minus ``kv_transfer_params`` (those are
    the proxy's business; a client's could make the engine wait for KV nobody holds)."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def _one_line(data: bytes, limit: int = 500) -> str:
    """An engine's error body for a log line and an error message: no line breaks."""
    return " ".join(data[:limit].decode(errors="replace").split())


class _PrefillUnreachable(ProxyError):
    """The P leg's engine could not be reached or dropped the connection: nothing holds KV
    for this request that the proxy could name, so it may run decode-only."""


async def _bounded(close: Callable[[], Awaitable[None]], timeout: float = 5.0) -> None:
    with anyio.move_on_after(timeout):
        await close()


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": code, "code": status}},
                             status=status)


class Proxy:
    """The proxy's HTTP server, its engine client and its registry subscription.

    ``async with Proxy(config) as proxy``: listening on ``proxy.url`` once entered;
    leaving closes the server, the engine connections and NATS. Raises
    ``ControlPlaneError`` if NATS cannot be reached, ``ConfigError`` if it cannot listen.
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.proxy_id = config.proxy_id or f"proxy-{uuid.uuid4().hex[:8]}"
        self.directory = Directory(prefill=config.prefill, decode=config.decode,
                                   peer_timeout_s=config.peer_timeout_s)
        self.url = ""
        self._bus: ControlBus | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stack = contextlib.AsyncExitStack()
        self._inflight: Counter[str] = Counter()
        self._turn: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._degraded = False  # serving decode-only because no prefill instance is live

    async def __aenter__(self) -> Proxy:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self._stack.aclose()

    async def _start(self) -> None:
        cfg = self.config
        if cfg.nats_url is not None:
            self._bus = await ControlBus.connect(cfg.nats_url, name=f"kvstream-{self.proxy_id}")
            self._stack.push_async_callback(_bounded, self._bus.close)

            async def on_registry(msg: Any, headers: dict[str, str]) -> None:
                self.directory.observe(msg)

            await self._bus.serve(Subjects(cfg.namespace).registry_all, on_registry)
            await self._bus.flush()
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._stack.push_async_callback(_bounded, self._session.close)
        app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[_errors])
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        # Leaving waits up to aiohttp's shutdown_timeout (60 s) for responses in flight.
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._stack.push_async_callback(runner.cleanup)
        try:
            await web.TCPSite(runner, cfg.host, cfg.port).start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from exc
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

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

    def _set_degraded(self, degraded: bool, why: str) -> None:
        """Log the changes into and out of decode-only mode, not every request in it."""
        if degraded and not self._degraded:
            log.warning("serving requests decode-only (the decode engine prefills them "
                        "itself) until a prefill instance answers: %s", why)
        elif self._degraded and not degraded:
            log.info("serving requests prefill/decode again: %s", why)
        self._degraded = degraded

    def _headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    # -- handlers -----------------------------------------------------------------------
    async def _completion(self, request: web.Request) -> web.StreamResponse:
        self._counts["requests"] += 1
        try:
            body = await request.json()
        except ValueError as exc:
            raise ProxyError(f"the request body is not JSON: {exc}", status=400,
                             code="invalid_request") from exc
        if not isinstance(body, dict):
            raise ProxyError("the request body must be a JSON object", status=400,
                             code="invalid_request")
        request_id = request.headers.get("X-Request-Id") or str(uuid.uuid4())
        headers = self._headers(request, request_id)
        if not self.directory.instances("decode"):  # refuse before a prefill nobody decodes
            raise ProxyError("no decode instance available", status=503, code="no_decode")
        started = time.monotonic()
        p = self._pick("prefill")
        if p is None:
            if self.config.no_prefill == "reject":
                raise ProxyError("no prefill instance available", status=503, code="no_prefill")
            return await self._decode_only(request, body, headers, started,
                                           "no live prefill instance")
        try:
            params = await self._prefill(p, request.path, body, headers)
        except _PrefillUnreachable as exc:
            if self.config.no_prefill == "reject":
                raise
            return await self._decode_only(request, body, headers, started, str(exc))
        self._set_degraded(False, f"prefill {p.url} answered")
        prefill_ms = (time.monotonic() - started) * 1e3
        response, d = await self._decode(request, decode_body(body, params), params, headers,
                                         "prefill-decode")
        log.info("%s %s: prefill %s (%.0f ms) -> decode %s: %d (%.0f ms in all)", request_id,
                 request.path, p.url, prefill_ms, d.url, response.status,
                 (time.monotonic() - started) * 1e3)
        return response

    async def _decode_only(self, request: web.Request, body: dict[str, Any],
                           headers: dict[str, str], started: float,
                           why: str) -> web.StreamResponse:
        """The whole request on a decode instance: it prefills the prompt itself."""
        self._set_degraded(True, why)
        self._counts["decode_only"] += 1
        response, d = await self._decode(request, decode_only_body(body), None, headers,
                                         "decode-only")
        log.info("%s %s: decode-only (%s) -> decode %s: %d (%.0f ms)", headers["X-Request-Id"],
                 request.path, why, d.url, response.status, (time.monotonic() - started) * 1e3)
        return response

    async def _prefill(self, p: Instance, path: str, body: dict[str, Any],
                       headers: dict[str, str]) -> dict[str, Any] | None:
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.prefill_timeout_s,
                                        sock_connect=cfg.connect_timeout_s)
        assert self._session is not None  # started; not input validation
        self._inflight[p.url] += 1
        try:
            async with self._session.post(p.url + path, json=prefill_body(body), headers=headers,
                                          timeout=timeout) as resp:
                status, data = resp.status, await resp.read()
        except _HTTP_ERRORS as exc:
            self._counts["prefill_errors"] += 1
            why = f"prefill {p.url} failed: {str(exc) or type(exc).__name__}"
            if isinstance(exc, _UNREACHABLE):
                self.directory.mark_unreachable(p.url)  # until its next chance
            if isinstance(exc, (*_UNREACHABLE, *_CONNECTION_LOST)):
                raise _PrefillUnreachable(why, status=502, code="prefill_failed") from exc
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
                      route: str) -> tuple[web.StreamResponse, Instance]:
        """The D leg with ``d_body``; ``params``: the P leg's offer, released if D fails."""
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s,
                                        sock_read=cfg.decode_read_timeout_s)
        assert self._session is not None
        try:
            d = self._choose("decode")
        except ProxyError as exc:  # the decode instance vanished during the prefill
            await self._release(params, str(exc))
            raise
        self._inflight[d.url] += 1
        try:
            try:
                resp = await self._session.post(d.url + request.path, json=d_body,
                                                headers=headers, timeout=timeout)
            except _HTTP_ERRORS as exc:
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
                    with contextlib.suppress(*_HTTP_ERRORS):
                        data = await resp.read()
                    await self._release(params, f"decode {d.url} answered {resp.status}")
                    return web.Response(status=resp.status, body=data,
                                        content_type=resp.content_type,
                                        headers={"X-Request-Id": headers["X-Request-Id"],
                                                 ROUTE_HEADER: route}), d
                return await self._relay(request, resp, d, headers["X-Request-Id"], route), d
        finally:
            self._inflight[d.url] -= 1

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse, d: Instance,
                     request_id: str, route: str) -> web.StreamResponse:
        """Pass the D leg's body through chunk by chunk (SSE events as they come)."""
        out = web.StreamResponse(status=resp.status)
        out.content_type = resp.content_type
        if resp.charset:
            out.charset = resp.charset
        out.headers["X-Request-Id"] = request_id
        out.headers[ROUTE_HEADER] = route
        if resp.content_length is not None:
            out.content_length = resp.content_length
        await out.prepare(request)
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except ConnectionResetError:  # the client left; closing resp tells the engine
            log.info("%s: the client went away mid-stream", request_id)
            return out
        except _HTTP_ERRORS as exc:
            # D accepted the request, so its connector owns the offer's fate (it keeps the
            # lease or pulls; P notices a dead keeper). The status is sent: cut the
            # connection so the client sees a truncated body, not a clean end.
            self._counts["decode_errors"] += 1
            log.warning("decode %s failed mid-stream: %s", d.url, str(exc) or type(exc).__name__)
            if request.transport is not None:
                request.transport.close()
            return out
        await out.write_eof()
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

        async def one(src: str) -> None:
            if await release_offer(bus, cfg.namespace, src, rid, reason, by=self.proxy_id,
                                   timeout=cfg.abort_timeout_s):
                self._counts["offers_released"] += 1
                log.info("released %s's offer of %s: %s", src, rid, reason)

        # Shielded: a client that hangs up must not leave the blocks held until the lease.
        with anyio.CancelScope(shield=True), anyio.move_on_after(cfg.abort_timeout_s * 2):
            async with anyio.create_task_group() as tg:
                for src in targets:
                    tg.start_soon(one, src)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        d = self._choose("decode")
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.connect_timeout_s * 2)
        try:
            async with self._session.get(d.url + "/v1/models", headers=self._headers(
                    request, request.headers.get("X-Request-Id") or str(uuid.uuid4())),
                    timeout=timeout) as resp:
                return web.Response(status=resp.status, body=await resp.read(),
                                    content_type=resp.content_type)
        except _HTTP_ERRORS as exc:
            raise ProxyError(f"decode {d.url} failed: {str(exc) or type(exc).__name__}",
                             status=502, code="decode_failed") from exc

    async def _health(self, request: web.Request) -> web.StreamResponse:
        def describe(role: LegRole) -> list[dict[str, Any]]:
            return [{"url": i.url, "instances": list(i.instance_ids), "load": i.load,
                     "inflight": self._inflight[i.url]} for i in self.directory.instances(role)]

        prefill, decode = describe("prefill"), describe("decode")
        decode_only = bool(decode) and not prefill and self.config.no_prefill == "decode"
        stats = msgspec.structs.asdict(self.statistics())
        del stats["inflight"]  # per instance above
        return web.json_response({"status": "ok", "proxy_id": self.proxy_id,
                                  "ready": bool(prefill and decode) or decode_only,
                                  "decode_only": decode_only, "nats": self._bus is not None,
                                  "prefill": prefill, "decode": decode, "counts": stats})

    def statistics(self) -> ProxyStatistics:
        c = self._counts
        return ProxyStatistics(requests=c["requests"], prefill_errors=c["prefill_errors"],
                               decode_errors=c["decode_errors"],
                               offers_released=c["offers_released"],
                               inflight={u: n for u, n in self._inflight.items() if n},
                               decode_only=c["decode_only"])


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A ``ProxyError`` becomes an OpenAI-style JSON error with its status."""
    try:
        return await handler(request)
    except ProxyError as exc:
        log.warning("%s %s: %d %s", request.headers.get("X-Request-Id", "-"), request.path,
                    exc.status, exc)
        return _error(exc.status, exc.code, str(exc))
