"""The proxy's HTTP server: its endpoints, its engine session and its registry feed.

The legs themselves are ``kvstream.proxy.forwarding.Legs``; the settings and bodies,
``kvstream.proxy.config``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec

from kvstream._exceptions import ConfigError, KVStreamError, ProxyError
from kvstream.control import messages as m
from kvstream.control.bus import ControlBus
from kvstream.control.identity import SENDER, SUBJECT, Identity
from kvstream.control.messages import Announce, Leave
from kvstream.control.registry import Registry
from kvstream.control.subjects import Subjects
from kvstream.proxy.config import (
    Mode,
    ProxyConfig,
    ProxyStatistics,
    decode_body,
    decode_only_body,
)
from kvstream.proxy.forwarding import HTTP_ERRORS, Legs, PrefillUnreachable
from kvstream.proxy.inflight import Inflight
from kvstream.proxy.kv_route import block_sizes, prompt_tokens, route_request
from kvstream.proxy.push import PushPlan, decode_params, note_failed, push_plan
from kvstream.proxy.usage import prefill_cached
from kvstream.routing.directory import Directory, Instance, LegRole
from kvstream.telemetry import open_span, route_decided

try:
    import aiohttp
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ConfigError("kvstream proxy needs aiohttp: pip install 'kvstream[proxy]'") from exc

__all__ = ["Proxy"]

log = logging.getLogger("kvstream.proxy")


async def _bounded(close: Callable[[], Awaitable[None]], timeout: float = 5.0) -> None:
    with anyio.move_on_after(timeout):
        await close()


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": code, "code": status}},
                             status=status)


class Proxy(Legs):
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
        self._inflight = Inflight()
        self._turn: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._degraded = False  # serving decode-only because no prefill instance is live
        self._subjects = Subjects(config.namespace)

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
            self._bus = await ControlBus.connect(cfg.nats_url, name=f"kvstream-{self.proxy_id}",
                                                 auth=cfg.nats_auth)
            self._stack.push_async_callback(_bounded, self._bus.close)
            # Signed like an agent (its releases are obeyed only so), and it routes only to
            # announcements signed by the instance they name: a forged one could otherwise
            # steer prompts to an attacker's endpoint.
            keys = Registry(peer_timeout_s=cfg.peer_timeout_s)
            subjects = Subjects(cfg.namespace)
            self._bus.seal.identity = Identity(self.proxy_id)
            self._bus.seal.trust = keys.bind_key
            self._bus.seal.key_of = keys.key_of  # what goes to one instance is boxed for it
            self._bus.peer_alive = keys.alive
            self._bus.seal.registry_prefix = subjects.registry_prefix

            async def on_registry(msg: Any, headers: dict[str, str]) -> None:
                iid = getattr(msg, "instance_id", None)
                if iid != headers.get(SENDER) or not isinstance(iid, str) or \
                        headers.get(SUBJECT) != subjects.registry_prefix + iid:
                    return
                if isinstance(msg, Announce):
                    keys.observe(msg)
                elif isinstance(msg, Leave):
                    keys.leave(msg.instance_id)
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
        app.router.add_get("/ready", self._ready)
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
        placed = await self._kv_route(request.path, body, headers)
        p = self._placed("prefill", placed) or self._pick("prefill")
        if p is None:
            if self.config.no_prefill == "reject":
                raise ProxyError("no prefill instance available", status=503, code="no_prefill")
            return await self._decode_only(request, body, headers, started,
                                           "no live prefill instance",
                                           self._placed("decode", placed))
        if self.config.transfer == "push":
            d = self._placed("decode", placed) or self._pick("decode")
            plan = push_plan(p, d, self.directory.registry) if d is not None else None
            if plan is not None and d is not None:
                return await self._push_legs(request, body, headers, p, d, plan, started)
            self._counts["push_declined"] += 1
        try:
            params = await self._prefill(p, request.path, body, headers)
        except PrefillUnreachable as exc:
            if self.config.no_prefill == "reject":
                raise
            return await self._decode_only(request, body, headers, started, str(exc),
                                           self._placed("decode", placed))
        self._set_degraded(False, f"prefill {p.url} answered")
        prefill_ms = (time.monotonic() - started) * 1e3
        response, d = await self._decode(request, decode_body(body, params), params, headers,
                                         "prefill-decode", self._placed("decode", placed))
        log.info("%s %s: prefill %s (%.0f ms) -> decode %s: %d (%.0f ms in all)", request_id,
                 request.path, p.url, prefill_ms, d.url, response.status,
                 (time.monotonic() - started) * 1e3)
        return response

    async def _push_legs(self, request: web.Request, body: dict[str, Any],
                         headers: dict[str, str], p: Instance, d: Instance, plan: PushPlan,
                         started: float) -> web.StreamResponse:
        """Both legs at once: the decode engine allocates and expects while the prefill
        computes and pushes each layer into it (its connector pulls, or vLLM recomputes,
        if the push fails; push.py in the vLLM adapter)."""
        self._counts["pushed"] += 1
        d_params = decode_params(plan, by=self.proxy_id)
        rid = headers["X-Request-Id"]

        async def p_leg() -> int | None:  # the prefill's own cache hits, or its errors
            try:
                return prefill_cached(await self._prefill(p, request.path, body, headers,
                                                          plan))
            except Exception as exc:  # whatever it was, the decode ranks must hear of it
                self._counts["push_failed"] += 1
                # An engine never reached offered nothing: the decode recomputes at once
                # (a pull would wait for an answer from a dead engine).
                offered = not (isinstance(exc, PrefillUnreachable) and not exc.sent)
                log.warning("%s: the prefill leg of a push failed (%s); the decode engine "
                            "%s", rid, exc, "pulls or recomputes" if offered else "recomputes")
                if self._bus is not None:
                    with anyio.move_on_after(self.config.abort_timeout_s):
                        await note_failed(self._bus, self._subjects, plan, str(exc),
                                          offered=offered)
                return None

        prefill = asyncio.ensure_future(p_leg())

        async def cached(wait: float) -> int | None:
            # The prefill has almost always answered by the decode's usage (its forward
            # came before the decode's first token); a decode that recomputed may finish
            # first: its answer is never held for more than ``wait``.
            if not prefill.done():
                await asyncio.wait({prefill}, timeout=wait)
            if not prefill.done() or prefill.cancelled():
                return None
            return prefill.result()

        # ``d_params`` name the prefill's offer of the push: released if D fails.
        try:
            response, d = await self._decode(request, decode_body(body, d_params), d_params,
                                             headers, "prefill-decode-push", d, cached)
        except BaseException:  # D failed or the client left: stop computing for nobody
            prefill.cancel()
            raise
        with contextlib.suppress(Exception):
            await prefill  # its errors were logged
        log.info("%s %s: prefill %s || decode %s (push %s): %d (%.0f ms in all)",
                 headers["X-Request-Id"], request.path, p.url, d.url, plan.push_id,
                 response.status, (time.monotonic() - started) * 1e3)
        return response

    async def _decode_only(self, request: web.Request, body: dict[str, Any],
                           headers: dict[str, str], started: float,
                           why: str, chosen: Instance | None = None) -> web.StreamResponse:
        """The whole request on a decode instance: it prefills the prompt itself."""
        self._set_degraded(True, why)
        self._counts["decode_only"] += 1
        response, d = await self._decode(request, decode_only_body(body), None, headers,
                                         "decode-only", chosen)
        log.info("%s %s: decode-only (%s) -> decode %s: %d (%.0f ms)", headers["X-Request-Id"],
                 request.path, why, d.url, response.status, (time.monotonic() - started) * 1e3)
        return response

    # -- KV-aware routing (routing = "kv") -------------------------------------------------
    async def _kv_route(self, path: str, body: dict[str, Any],
                        headers: dict[str, str]) -> dict[str, m.Decision]:
        """The routers' decisions per leg; {} (least loaded, counted) when none is had."""
        cfg = self.config
        if cfg.routing != "kv" or self._bus is None or self._session is None:
            return {}
        engines = self.directory.instances("prefill") or self.directory.instances("decode")
        if not engines:
            return {}
        span = open_span("kvstream.proxy.route", request_id=headers["X-Request-Id"])
        try:
            engine = engines[self._turn["tokenize"] % len(engines)]
            self._turn["tokenize"] += 1
            tokens = await prompt_tokens(self._session, engine, path, body,
                                         self._headers_out(headers), cfg.connect_timeout_s)
            if tokens is None:
                return self._unrouted(span, "the prompt's tokens are unknown")
            req = route_request(tokens, block_sizes(self.directory), self._inflight,
                                headers["X-Request-Id"], self._inflight.peaks())
            try:
                reply = await self._bus.request(self._subjects.route, req,
                                                timeout=cfg.route_timeout_s)
            except KVStreamError as exc:
                return self._unrouted(span, f"no router answered: {exc}")
            if not isinstance(reply, m.Routed) or not reply.decisions:
                return self._unrouted(span, "the router placed nothing")
            self._counts["kv_routed"] += 1
            span.set_attribute("kvstream.router", reply.router_id)
            span.set_attribute("kvstream.tokens", len(tokens))
            placed: dict[str, m.Decision] = {}
            for d in reply.decisions:
                placed[d.role] = d
                self._counts[f"blocks_{d.role}"] += d.blocks
                self._counts[f"hits_{d.role}"] += d.overlap
                route_decided(d.role, d.blocks, d.overlap)
                for key, value in (("url", d.url), ("overlap", d.overlap),
                                   ("blocks", d.blocks), ("load", d.load),
                                   ("cost", d.cost), ("candidates", d.candidates)):
                    span.set_attribute(f"kvstream.{d.role}.{key}", value)
            return placed
        finally:
            span.end()

    def _unrouted(self, span: Any, why: str) -> dict[str, m.Decision]:
        self._counts["kv_fallbacks"] += 1
        span.set_attribute("kvstream.fallback", why)
        log.debug("routing least-loaded: %s", why)
        return {}

    def _placed(self, role: LegRole, placed: dict[str, m.Decision]) -> Instance | None:
        """The live instance a router chose for ``role``'s leg (None: choose here)."""
        d = placed.get(role)
        if d is None:
            return None
        return next((i for i in self.directory.instances(role) if i.url == d.url), None)

    @staticmethod
    def _headers_out(headers: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in headers.items() if k in ("Authorization", "X-Request-Id")}

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
        except HTTP_ERRORS as exc:
            raise ProxyError(f"decode {d.url} failed: {str(exc) or type(exc).__name__}",
                             status=502, code="decode_failed") from exc

    def readiness(self) -> tuple[bool, Mode]:
        """Whether a load balancer should send requests here, and how they would be served:
        ready with a live prefill and decode instance; with a decode instance alone only
        if ``ready_decode_only`` (decode-only serving is then the operator's choice)."""
        has_p = bool(self.directory.instances("prefill"))
        has_d = bool(self.directory.instances("decode"))
        if has_p and has_d:
            return True, "prefill-decode"
        if has_d and self.config.no_prefill == "decode":
            return self.config.ready_decode_only, "decode-only"
        return False, "unavailable"

    async def _ready(self, request: web.Request) -> web.StreamResponse:
        ready, mode = self.readiness()
        return web.json_response({"ready": ready, "mode": mode}, status=200 if ready else 503)

    async def _health(self, request: web.Request) -> web.StreamResponse:
        def describe(role: LegRole) -> list[dict[str, Any]]:
            return [{"url": i.url, "instances": list(i.instance_ids), "load": i.load,
                     "inflight": self._inflight[i.url], "kv_events": i.kv_events}
                    for i in self.directory.instances(role)]

        prefill, decode = describe("prefill"), describe("decode")
        ready, mode = self.readiness()
        stats = msgspec.structs.asdict(self.statistics())
        del stats["inflight"]  # per instance above
        # Engines whose KV events no router gets: routing by prefix is blind to them.
        blind = sorted({i["url"] for i in (*prefill, *decode)
                        if i["kv_events"] in ("missing", "off")})
        return web.json_response({"status": "ok", "proxy_id": self.proxy_id, "ready": ready,
                                  "mode": mode, "decode_only": mode == "decode-only",
                                  "nats": self._bus is not None, "prefill": prefill,
                                  "decode": decode, "kv_events_missing": blind,
                                  "counts": stats})

    def statistics(self) -> ProxyStatistics:
        c = self._counts
        return ProxyStatistics(requests=c["requests"], prefill_errors=c["prefill_errors"],
                               decode_errors=c["decode_errors"],
                               offers_released=c["offers_released"],
                               inflight={u: n for u, n in self._inflight.items() if n},
                               decode_only=c["decode_only"], kv_routed=c["kv_routed"],
                               kv_fallbacks=c["kv_fallbacks"],
                               prompt_blocks={r: c[f"blocks_{r}"] for r in ("prefill", "decode")},
                               hit_blocks={r: c[f"hits_{r}"] for r in ("prefill", "decode")},
                               pushed=c["pushed"], push_declined=c["push_declined"],
                               push_failed=c["push_failed"])


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A ``ProxyError`` becomes an OpenAI-style JSON error with its status."""
    try:
        return await handler(request)
    except ProxyError as exc:
        log.warning("%s %s: %d %s", request.headers.get("X-Request-Id", "-"), request.path,
                    exc.status, exc)
        return _error(exc.status, exc.code, str(exc))
