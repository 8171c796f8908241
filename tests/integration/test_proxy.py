"""``kvstream proxy`` against fake OpenAI engines (aiohttp apps in this process), a real
nats-server and real agents announcing the engines' endpoints."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from kvstream import Agent, TransferAbortedError
from kvstream.control import ControlBus, release_offer
from kvstream.control.identity import Identity
from kvstream.control.nats_server import free_port
from kvstream.proxy import ROUTE_HEADER, Proxy, ProxyConfig
from tests.fakes import cache, small_layout
from tests.integration.agents import agent_pair, assert_at_rest, cfg

pytestmark = pytest.mark.anyio

# The P leg's params: the toy proxy's keys (what vLLM P/D setups send), plus remote_request_id.
EXPECTED_P_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_request_id": None, "remote_host": None,
    "remote_port": None,
}
SSE = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
       b"data: [DONE]\n\n"]


class FakeEngine:
    """An OpenAI server that records each request and answers as a P or D engine would.

    ``offer(x_request_id)`` makes the P answer's ``kv_transfer_params`` (a real agent's
    offer, say); ``hold(body)`` says whether to wait for ``release`` before answering;
    ``gate`` holds back the last SSE event; ``die_mid_stream`` drops the connection instead.
    """

    def __init__(self, name: str, *, status: int = 200,
                 offer: Callable[[str], dict[str, Any]] | None = None,
                 hold: Callable[[dict[str, Any]], bool] | None = None) -> None:
        self.name = name
        self.status = status
        self.offer = offer
        self.hold = hold
        self.release = anyio.Event()
        self.gate: anyio.Event | None = None
        self.eof_gate: anyio.Event | None = None  # holds the end of a stream after [DONE]
        self.usage: dict[str, Any] | None = None  # the D answer's usage, if any
        self.die_mid_stream = False
        self.received: list[tuple[str, dict[str, Any], Mapping[str, str]]] = []
        self.url = ""

    def bodies(self) -> list[dict[str, Any]]:
        return [body for _, body, _ in self.received]

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append((request.path, body, request.headers.copy()))
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} refuses"}},
                                     status=self.status)
        if self.hold is not None and self.hold(body):
            await self.release.wait()
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            rid = request.headers["X-Request-Id"]
            params = self.offer(rid) if self.offer else {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0",
                "remote_request_id": f"cmpl-{rid}-0", "remote_block_ids": [[1, 2]],
                "remote_host": "127.0.0.1", "remote_port": 5600}
            return web.json_response({"choices": [{"text": "P"}], "kv_transfer_params": params})
        if body.get("stream"):
            out = web.StreamResponse()
            out.content_type = "text/event-stream"
            await out.prepare(request)
            for event in SSE[:-1]:
                await out.write(event)
            if self.die_mid_stream and request.transport is not None:
                await anyio.sleep(0.05)
                request.transport.close()
                return out
            if self.gate is not None:
                await self.gate.wait()
            if self.usage is not None:
                await out.write(b"data: " + json.dumps({"choices": [],
                                                        "usage": self.usage}).encode() + b"\n\n")
            await out.write(SSE[-1])
            if self.eof_gate is not None:
                await self.eof_gate.wait()
            await out.write_eof()
            return out
        answer: dict[str, Any] = {"choices": [{"text": f"decoded by {self.name}"}]}
        if self.usage is not None:
            answer["usage"] = self.usage
        return web.json_response(answer)

    async def models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": f"model-of-{self.name}"}]})


def offers_from(agent: Agent, handles: dict[str, Any], blocks: list[int]):
    """A P engine hook: hold the prompt's blocks in ``agent`` and answer with params
    naming them, and the offer's secret, as the vLLM connector's ``request_finished``
    does."""
    def offer(rid: str) -> dict[str, Any]:
        handles[rid] = held = agent.offer(f"cmpl-{rid}-0", blocks)
        held.all_ready()
        return {"do_remote_prefill": True, "remote_engine_id": agent.instance_id,
                "remote_request_id": f"cmpl-{rid}-0", "remote_block_ids": [blocks],
                "kvstream": {"instance": agent.instance_id, "secret": held.secret}}
    return offer


@contextlib.asynccontextmanager
async def serving(*engines: FakeEngine):
    runners = []
    try:
        for engine in engines:
            app = web.Application()
            app.router.add_post("/v1/completions", engine.completion)
            app.router.add_post("/v1/chat/completions", engine.completion)
            app.router.add_get("/v1/models", engine.models)
            if hasattr(engine, "tokenize"):  # test_proxy_kv_routing's engines
                app.router.add_post("/tokenize", engine.tokenize)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            engine.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        yield engines
    finally:
        for engine in engines:  # nothing may wait on a failed test's teardown
            engine.release.set()
            for gate in (engine.gate, engine.eof_gate):
                if gate is not None:
                    gate.set()
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def proxy_and_client(**kw):
    config = ProxyConfig(port=0, peer_timeout_s=1.0, abort_timeout_s=1.0, **kw)
    async with Proxy(config) as proxy, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=10)) as client:
        yield proxy, client


async def until_routable(proxy: Proxy, prefill: int, decode: int) -> None:
    with anyio.fail_after(5):
        while (len(proxy.directory.instances("prefill")),
               len(proxy.directory.instances("decode"))) != (prefill, decode):
            await anyio.sleep(0.02)


async def test_discovered_engines_get_the_toy_proxy_legs(nats_server):
    lay = small_layout()
    handles: dict[str, Any] = {}
    p_eng, d_eng = FakeEngine("p"), FakeEngine("d")
    async with serving(p_eng, d_eng), \
            proxy_and_client(nats_url=nats_server.url, namespace="px-legs") as (proxy, client), \
            Agent(cfg("px-p", nats_server, namespace="px-legs", role="prefill",
                      endpoint=p_eng.url), layout=lay,
                  kv_caches=cache(lay, 8, fill=True)) as p_agent:
        p_eng.offer = offers_from(p_agent, handles, [1, 2])
        async with Agent(cfg("px-d", nats_server, namespace="px-legs", role="decode",
                             endpoint=d_eng.url)):
            await until_routable(proxy, 1, 1)
            body = {"model": "m", "prompt": "hello", "max_tokens": 20, "min_tokens": 5,
                    "temperature": 0.0}
            async with client.post(proxy.url + "/v1/completions", json=body,
                                   headers={"X-Request-Id": "req-1"}) as resp:
                assert resp.status == 200, await resp.text()
                assert await resp.json() == {"choices": [{"text": "decoded by d"}]}
        (p_path, p_body, p_headers), = p_eng.received
        (d_path, d_body, d_headers), = d_eng.received
        assert p_path == d_path == "/v1/completions"
        assert p_body == {"model": "m", "prompt": "hello", "max_tokens": 1, "temperature": 0.0,
                          "stream": False, "kv_transfer_params": EXPECTED_P_PARAMS}
        assert d_body == {**body, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_engine_id": "px-p",
            "remote_request_id": "cmpl-req-1-0", "remote_block_ids": [[1, 2]],
            "kvstream": {"instance": "px-p", "secret": handles["req-1"].secret}}}
        assert p_headers["X-Request-Id"] == d_headers["X-Request-Id"] == "req-1"
        # The decode leg succeeded: the offer is left for D to pull (no early release).
        assert not handles["req-1"].done and p_agent.statistics().held_active == 1
        assert proxy.statistics().offers_released == 0
        await handles["req-1"].abort()
        # The decode agent left: refused at once, and no prefill is wasted on it.
        await until_routable(proxy, 1, 0)
        async with client.post(proxy.url + "/v1/completions", json=body) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "no_decode"
        assert len(p_eng.received) == 1


async def test_streaming_passes_sse_through_as_it_comes():
    p_eng, d_eng = FakeEngine("p"), FakeEngine("d")
    d_eng.gate = anyio.Event()
    async with serving(p_eng, d_eng), \
            proxy_and_client(nats_url=None, prefill=(p_eng.url,), decode=(d_eng.url,)) \
            as (proxy, client):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}, "max_completion_tokens": 7}
        # The first event must arrive while D still holds back its last one.
        try:
            with anyio.fail_after(5):
                async with client.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200 and resp.content_type == "text/event-stream"
                    first = await resp.content.readline()
                    assert first == SSE[0].rstrip(b"\n") + b"\n"
                    d_eng.gate.set()
                    rest = await resp.content.read()
                    echoed = resp.headers["X-Request-Id"]
        finally:
            d_eng.gate.set()
        assert first + rest == b"".join(SSE)
        (_, p_body, p_headers), = p_eng.received
        (_, d_body, d_headers), = d_eng.received
        assert "stream_options" not in p_body and p_body["stream"] is False
        assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1
        assert d_body["stream"] is True and d_body["stream_options"] == {"include_usage": True}
        assert d_body["max_completion_tokens"] == 7 and "max_tokens" not in d_body
        assert d_body["kv_transfer_params"]["remote_request_id"] == f"cmpl-{echoed}-0"
        assert p_headers["X-Request-Id"] == d_headers["X-Request-Id"] == echoed != ""


async def test_a_client_closing_after_done_is_a_success_not_an_error(caplog):
    """The client reads the stream up to its [DONE] event and hangs up before the proxy
    has ended the response (the engine's end comes later): no ERROR, no traceback, and the
    request's INFO line is there."""
    caplog.set_level(logging.INFO)
    p_eng, d_eng = FakeEngine("p"), FakeEngine("d")
    d_eng.eof_gate = anyio.Event()
    async with serving(p_eng, d_eng), \
            proxy_and_client(nats_url=None, prefill=(p_eng.url,), decode=(d_eng.url,)) \
            as (proxy, client):
        body = {"model": "m", "prompt": "hi", "stream": True}
        with anyio.fail_after(5):
            async with client.post(proxy.url + "/v1/completions", json=body) as resp:
                got = b""
                while not got.endswith(SSE[-1]):
                    got += await resp.content.readany()
                rid = resp.headers["X-Request-Id"]
                assert resp.connection is not None
                resp.connection.transport.close()  # type: ignore[union-attr]
            await anyio.sleep(0.1)  # the proxy sees the client gone
            d_eng.eof_gate.set()
            while not _proxy_records(caplog, logging.INFO, f"{rid} /v1/completions"):
                await anyio.sleep(0.02)
        assert got == b"".join(SSE)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
    line, = _proxy_records(caplog, logging.INFO, f"{rid} /v1/completions")
    assert ": 200 (" in line


async def test_least_loaded_decode_gets_the_next_requests():
    def slow(body: dict[str, Any]) -> bool:
        return body.get("prompt") == "slow" and "kv_transfer_params" in body \
            and not body["kv_transfer_params"].get("do_remote_decode")

    p_eng = FakeEngine("p")
    d1, d2 = FakeEngine("d1", hold=slow), FakeEngine("d2", hold=slow)
    async with serving(p_eng, d1, d2), \
            proxy_and_client(nats_url=None, prefill=(p_eng.url,), decode=(d1.url, d2.url)) \
            as (proxy, client):
        async def post(prompt: str) -> str:
            async with client.post(proxy.url + "/v1/completions",
                                   json={"model": "m", "prompt": prompt}) as resp:
                return (await resp.json())["choices"][0]["text"]

        # Idle and equal: round robin.
        assert {await post("a"), await post("b")} == {"decoded by d1", "decoded by d2"}
        d1.received.clear()
        d2.received.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(post, "slow")
            try:
                with anyio.fail_after(5):
                    while not (d1.received or d2.received):
                        await anyio.sleep(0.01)
                busy, idle = (d1, d2) if d1.received else (d2, d1)
                # Round robin would send every other one to the busy engine.
                for i in range(3):
                    with anyio.fail_after(3):
                        assert await post(f"quick-{i}") == f"decoded by {idle.name}"
                assert [b["prompt"] for b in busy.bodies()] == ["slow"]
            finally:
                d1.release.set()
                d2.release.set()
        assert proxy.statistics().inflight == {}


async def test_failed_decode_releases_the_prefill_offer_at_once(nats_server):
    lay = small_layout()
    handles: dict[str, Any] = {}
    p_eng, refusing = FakeEngine("p"), FakeEngine("d", status=500)
    dead = f"http://127.0.0.1:{free_port()}"
    async with serving(p_eng, refusing), Agent(
            cfg("px-pdead", nats_server, namespace="px-dead", role="prefill"),
            layout=lay, kv_caches=cache(lay, 8, fill=True)) as p_agent:
        p_eng.offer = offers_from(p_agent, handles, [3, 4])  # held for lease_s = 30 s
        for d_url, status in ((dead, 502), (refusing.url, 500)):
            async with proxy_and_client(nats_url=nats_server.url, namespace="px-dead",
                                        prefill=(p_eng.url,), decode=(d_url,)) as (proxy, client):
                rid = f"dead-{status}"
                started = time.monotonic()
                async with client.post(proxy.url + "/v1/completions", headers={"X-Request-Id": rid},
                                       json={"model": "m", "prompt": "x"}) as resp:
                    assert resp.status == status
                    if status == 502:
                        assert (await resp.json())["error"]["type"] == "decode_failed"
                with anyio.fail_after(3):
                    result = await handles[rid].result()
                assert result.status == "aborted" and proxy.proxy_id in result.reason
                assert time.monotonic() - started < 3 < 30
                assert proxy.statistics().offers_released == 1
                assert proxy.statistics().decode_errors == 1
        assert p_agent.statistics().held_active == 0 and p_agent.statistics().aborted == 2


async def test_release_offer_ends_a_kept_offer_and_its_keeper_learns_at_once(nats_server):
    """The helper alone: a sender that is not the lease's keeper, but signs and holds the
    offer's secret, may end a held offer."""
    ns = {"namespace": "px-keep"}
    async with agent_pair(nats_server, "px-pk", "px-dk", small_layout(), 8, p_kw=ns,
                          d_kw=ns) as (p, d):
        held = p.offer("r-kept", [1, 2])
        held.all_ready()
        lease = await d.keep("r-kept", "px-pk", secret=held.secret)
        bus = await ControlBus.connect(nats_server.url, name="px-test")
        bus.seal.identity = Identity("proxy-test")  # not an agent: it signs as the proxy
        try:
            assert await release_offer(bus, "px-keep", "px-pk", "r-kept", "decode leg failed",
                                       by="proxy-test", secret=held.secret)
            assert not await release_offer(bus, "px-keep", "px-nobody", "r-kept", "x",
                                           by="proxy-test", secret=held.secret, timeout=0.5)
        finally:
            await bus.close()
        with anyio.fail_after(2):  # D renews every lease_s / 4 = 7.5 s: that would be too late
            result = await held.result()
            error = await lease.lost()
        assert result.status == "aborted" and "proxy-test" in result.reason
        assert isinstance(error, TransferAbortedError)
        assert_at_rest(p, d)


async def test_decode_dying_mid_stream_cuts_the_client_stream():
    p_eng, d_eng = FakeEngine("p"), FakeEngine("d")
    d_eng.die_mid_stream = True
    async with serving(p_eng, d_eng), \
            proxy_and_client(nats_url=None, prefill=(p_eng.url,), decode=(d_eng.url,)) \
            as (proxy, client):
        async with client.post(proxy.url + "/v1/completions",
                               json={"model": "m", "prompt": "x", "stream": True}) as resp:
            assert resp.status == 200
            assert await resp.content.readline() == SSE[0].rstrip(b"\n") + b"\n"
            # Not a clean end: the client must not take half an answer for a whole one.
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.content.read()
        assert proxy.statistics().decode_errors == 1 and proxy.statistics().inflight == {}


async def test_prefill_failure_bad_input_models_and_health():
    p_bad, d_eng = FakeEngine("p", status=500), FakeEngine("d")
    async with serving(p_bad, d_eng), \
            proxy_and_client(nats_url=None, prefill=(p_bad.url,), decode=(d_eng.url,)) \
            as (proxy, client):
        async with client.post(proxy.url + "/v1/completions",
                               json={"model": "m", "prompt": "x"}) as resp:
            assert resp.status == 502
            err = (await resp.json())["error"]
            assert err["type"] == "prefill_failed" and "answered 500" in err["message"]
        assert d_eng.received == []
        async with client.post(proxy.url + "/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400
        async with client.get(proxy.url + "/v1/models") as resp:
            assert (await resp.json())["data"] == [{"id": "model-of-d"}]
        async with client.get(proxy.url + "/health") as resp:
            health = await resp.json()
        assert health["ready"] is True and health["nats"] is False
        assert [i["url"] for i in health["prefill"]] == [p_bad.url]
        assert [i["url"] for i in health["decode"]] == [d_eng.url]
        assert proxy.statistics().prefill_errors == 1


def _proxy_records(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvstream.proxy"
            and r.levelno == level and text in r.getMessage()]


async def test_no_live_prefill_serves_decode_only_until_one_is_back(nats_server, caplog):
    caplog.set_level(logging.INFO, logger="kvstream.proxy")
    p_eng, d_eng = FakeEngine("p"), FakeEngine("d")
    ns = "px-donly"
    async with serving(p_eng, d_eng), \
            proxy_and_client(nats_url=nats_server.url, namespace=ns) as (proxy, client), \
            Agent(cfg("px-donly-d", nats_server, namespace=ns, role="decode",
                      endpoint=d_eng.url)):
        await until_routable(proxy, 0, 1)
        async with client.get(proxy.url + "/health") as resp:
            health = await resp.json()
        # Serving decode-only, and not ready: a load balancer should prefer a proxy with
        # both legs (the operator opts in with ready_decode_only, below).
        assert health["ready"] is False and health["mode"] == "decode-only"
        assert health["decode_only"] is True
        async with client.get(proxy.url + "/ready") as resp:
            assert resp.status == 503
            assert await resp.json() == {"ready": False, "mode": "decode-only"}
        # The client's own kv_transfer_params must not reach the engine: it would wait for KV.
        body = {"model": "m", "prompt": "hello", "max_tokens": 5,
                "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x"}}
        whole = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        async with client.post(proxy.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers[ROUTE_HEADER] == "decode-only"
            assert await resp.json() == {"choices": [{"text": "decoded by d"}]}
        async with client.post(proxy.url + "/v1/completions",
                               json={**body, "stream": True}) as resp:
            assert resp.status == 200 and resp.headers[ROUTE_HEADER] == "decode-only"
            assert await resp.read() == b"".join(SSE)
        assert d_eng.bodies() == [whole, {**whole, "stream": True}]
        assert p_eng.received == []
        assert proxy.statistics().decode_only == 2 and proxy.statistics().requests == 2
        # One WARNING for the change into decode-only, not one per request.
        assert len(_proxy_records(caplog, logging.WARNING, "decode-only")) == 1
        async with Agent(cfg("px-donly-p", nats_server, namespace=ns, role="prefill",
                             endpoint=p_eng.url)):
            await until_routable(proxy, 1, 1)
            async with client.get(proxy.url + "/ready") as resp:
                assert resp.status == 200
                assert await resp.json() == {"ready": True, "mode": "prefill-decode"}
            async with client.post(proxy.url + "/v1/completions", json=whole) as resp:
                assert resp.status == 200 and resp.headers[ROUTE_HEADER] == "prefill-decode"
            assert len(p_eng.received) == 1
            assert d_eng.bodies()[-1]["kv_transfer_params"]["remote_engine_id"] == "p0"
        assert _proxy_records(caplog, logging.INFO, "prefill/decode again") == [
            f"serving requests prefill/decode again: prefill {p_eng.url} answered"]
        assert proxy.statistics().decode_only == 2


async def test_decode_only_is_ready_when_the_operator_says_so(nats_server):
    d_eng = FakeEngine("d")
    ns = "px-dready"
    async with serving(d_eng), \
            proxy_and_client(nats_url=nats_server.url, namespace=ns, ready_decode_only=True) \
            as (proxy, client):
        async with client.get(proxy.url + "/ready") as resp:  # nothing live yet
            assert resp.status == 503
            assert await resp.json() == {"ready": False, "mode": "unavailable"}
        async with Agent(cfg("px-dready-d", nats_server, namespace=ns, role="decode",
                             endpoint=d_eng.url)):
            await until_routable(proxy, 0, 1)
            async with client.get(proxy.url + "/ready") as resp:
                assert resp.status == 200
                assert await resp.json() == {"ready": True, "mode": "decode-only"}


async def test_no_live_prefill_rejected_when_configured(nats_server):
    d_eng = FakeEngine("d")
    ns = "px-reject"
    async with serving(d_eng), \
            proxy_and_client(nats_url=nats_server.url, namespace=ns, no_prefill="reject") \
            as (proxy, client), \
            Agent(cfg("px-reject-d", nats_server, namespace=ns, role="decode",
                      endpoint=d_eng.url)):
        await until_routable(proxy, 0, 1)
        async with client.post(proxy.url + "/v1/completions",
                               json={"model": "m", "prompt": "x"}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "no_prefill"
        async with client.get(proxy.url + "/health") as resp:
            health = await resp.json()
        assert health["ready"] is False and health["decode_only"] is False
        assert health["mode"] == "unavailable"
        assert d_eng.received == [] and proxy.statistics().decode_only == 0


@pytest.mark.parametrize("no_prefill", ["decode", "reject"])
async def test_unreachable_prefill_engine(no_prefill, caplog):
    """The prefill engine died (nothing listens at its URL): that request runs decode-only
    (or gets the 502 as before), and the URL is not tried again for peer_timeout_s."""
    caplog.set_level(logging.INFO, logger="kvstream.proxy")
    d_eng = FakeEngine("d")
    dead = f"http://127.0.0.1:{free_port()}"
    async with serving(d_eng), \
            proxy_and_client(nats_url=None, prefill=(dead,), decode=(d_eng.url,),
                             no_prefill=no_prefill) as (proxy, client):
        async with client.post(proxy.url + "/v1/completions",
                               json={"model": "m", "prompt": "x"}) as resp:
            if no_prefill == "decode":
                assert resp.status == 200 and resp.headers[ROUTE_HEADER] == "decode-only"
                assert d_eng.bodies() == [{"model": "m", "prompt": "x"}]
                warned, = _proxy_records(caplog, logging.WARNING, "decode-only")
                assert f"prefill {dead} failed: Cannot connect" in warned
            else:
                assert resp.status == 502
                assert (await resp.json())["error"]["type"] == "prefill_failed"
                assert d_eng.received == []
        stats = proxy.statistics()
        assert stats.prefill_errors == 1 and stats.decode_only == (no_prefill == "decode")
        assert proxy.directory.instances("prefill") == []  # marked unreachable for 1 s
        if no_prefill == "decode":  # still decode-only, without trying it, and no new WARNING
            async with client.post(proxy.url + "/v1/completions",
                                   json={"model": "m", "prompt": "y"}) as resp:
                assert resp.status == 200 and resp.headers[ROUTE_HEADER] == "decode-only"
            assert proxy.statistics().prefill_errors == 1
            assert len(_proxy_records(caplog, logging.WARNING, "decode-only")) == 1
        with anyio.fail_after(3):
            while not proxy.directory.instances("prefill"):
                await anyio.sleep(0.05)


@contextlib.asynccontextmanager
async def push_pair(nats_server, namespace: str, ids: tuple[str, str], p_eng: FakeEngine,
                    d_eng: FakeEngine, p_layout, d_layout=None):
    """A ``transfer="push"`` proxy over a fake prefill and decode engine, each announced by a
    real agent (``d_layout``: the decode's, if another): (proxy, client, decode agent)."""
    d_layout = d_layout or p_layout
    async with serving(p_eng, d_eng), \
            proxy_and_client(nats_url=nats_server.url, namespace=namespace,
                             transfer="push") as (proxy, client), \
            Agent(cfg(ids[0], nats_server, namespace=namespace, role="prefill",
                      endpoint=p_eng.url), layout=p_layout,
                  kv_caches=cache(p_layout, 8, fill=False)), \
            Agent(cfg(ids[1], nats_server, namespace=namespace, role="decode",
                      endpoint=d_eng.url), layout=d_layout,
                  kv_caches=cache(d_layout, 8, fill=False)) as decode:
        yield proxy, client, decode


async def test_push_sends_both_legs_at_once_naming_each_engine_to_the_other(nats_server):
    """``transfer="push"``: between engines announcing equal layouts the decode leg leaves
    before the prefill leg has answered, each leg's params name the other engine and one
    push id; an engine of another layout is served prefill-then-pull, counted."""
    lay = small_layout()
    p_eng = FakeEngine("p", hold=lambda body: True)  # answers once D has its leg
    d_eng = FakeEngine("d")
    async with push_pair(nats_server, "px-push", ("px-pp", "px-pd"), p_eng, d_eng,
                         lay) as (proxy, client, _):
        await until_routable(proxy, 1, 1)
        body = {"model": "m", "prompt": "hello", "max_tokens": 20, "temperature": 0.0}

        async def unblock() -> None:
            with anyio.fail_after(5):
                while not d_eng.received:
                    await anyio.sleep(0.01)
            p_eng.release.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(unblock)
            async with client.post(proxy.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers[ROUTE_HEADER] == "prefill-decode-push"
                assert await resp.json() == {"choices": [{"text": "decoded by d"}]}
        (_, p_body, _), = p_eng.received
        (_, d_body, _), = d_eng.received
        ours = p_body["kv_transfer_params"]["kvstream"]
        assert ours["push_to"] == "px-pd" and ours["push_id"].startswith("push-")
        d_params = d_body["kv_transfer_params"]
        assert d_params["transfer_mode"] == "push" and d_params["remote_engine_id"] == "px-pp"
        assert d_params["remote_request_id"] == ours["push_id"]
        assert d_params["kvstream"]["secret"] == ours["secret"] and len(ours["secret"]) >= 16
        assert proxy.statistics().pushed == 1 and proxy.statistics().push_declined == 0
    # Another layout on the decode side: the usual legs, one after the other.
    other = small_layout(layers=lay.num_layers + 1)
    p_eng, d_eng = FakeEngine("p"), FakeEngine("d")
    async with push_pair(nats_server, "px-push2", ("px-pp", "px-pd"), p_eng, d_eng, lay,
                         other) as (proxy, client, _):
        await until_routable(proxy, 1, 1)
        async with client.post(proxy.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200 and resp.headers[ROUTE_HEADER] == "prefill-decode"
        assert "kvstream" not in p_eng.bodies()[0]["kv_transfer_params"]
        assert proxy.statistics().pushed == 0 and proxy.statistics().push_declined == 1


async def _push_noted(proxy: Proxy, client: aiohttp.ClientSession, decode: Agent,
                      d_eng: FakeEngine, notes: list[tuple[str, object]]) -> None:
    """One completion through a push proxy whose decode engine answers once its agent got
    a push note (kept in ``notes`` with its sender)."""
    from kvstream.control.push_notes import PUSH_TOPIC, decode_note

    def on_note(sender: str, body: bytes) -> None:
        notes.append((sender, decode_note(body)))
        d_eng.release.set()

    decode.on_note(PUSH_TOPIC, on_note)
    await until_routable(proxy, 1, 1)
    body = {"model": "m", "prompt": "hello", "max_tokens": 20, "temperature": 0.0}
    with anyio.fail_after(20):
        async with client.post(proxy.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers[ROUTE_HEADER] == "prefill-decode-push"


async def test_a_failed_prefill_leg_of_a_push_tells_every_decode_rank_at_once(nats_server):
    """The P leg of a push fails at the proxy (its engine answers 500: no rank of it ever
    heard of the request, so none will note the push failed): the proxy itself sends the
    decode engine a signed "failed" note for the push id, naming itself in the D leg's
    params as one whose note counts, so the decode rank recomputes now instead of waiting
    out its reservation."""

    lay = small_layout()
    p_eng = FakeEngine("p", status=500)
    d_eng = FakeEngine("d", hold=lambda body: True)  # answers once the note came
    notes: list[tuple[str, object]] = []
    async with push_pair(nats_server, "px-pushf", ("px-fp", "px-fd"), p_eng, d_eng,
                         lay) as (proxy, client, decode):
        await _push_noted(proxy, client, decode, d_eng, notes)
        (_, d_body, _), = d_eng.received
        ours = d_body["kv_transfer_params"]["kvstream"]
        assert ours["by"] == proxy.proxy_id
        (sender, note), = notes
        assert sender == proxy.proxy_id  # signed: the decode agent checked who sent it
        assert note is not None and note.state == "failed"
        assert note.push_id == d_body["kv_transfer_params"]["remote_request_id"]
        assert "500" in note.reason, note
        assert note.offered is True  # the engine had the request: it may have offered
        stats = proxy.statistics()
        assert stats.pushed == 1 and stats.push_failed == 1 and stats.prefill_errors == 1


async def test_a_push_whose_prefill_engine_is_unreachable_is_noted_as_never_offered(
        nats_server):
    """The prefill engine died (its agent still announced, nothing listens at its URL): the
    proxy's note says nothing was offered, so the decode rank recomputes without a pull."""

    lay = small_layout()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens at the prefill's URL
    d_eng = FakeEngine("d", hold=lambda body: True)  # answers once the note came
    notes: list[tuple[str, object]] = []
    ns = "px-pushu"
    async with serving(d_eng), \
            proxy_and_client(nats_url=nats_server.url, namespace=ns, transfer="push") \
            as (proxy, client), \
            Agent(cfg("px-up", nats_server, namespace=ns, role="prefill", endpoint=dead),
                  layout=lay, kv_caches=cache(lay, 8, fill=False)), \
            Agent(cfg("px-ud", nats_server, namespace=ns, role="decode", endpoint=d_eng.url),
                  layout=lay, kv_caches=cache(lay, 8, fill=False)) as decode:
        await _push_noted(proxy, client, decode, d_eng, notes)
        (sender, note), = notes
        assert sender == proxy.proxy_id and note is not None and note.state == "failed"
        assert note.offered is False and "Cannot connect" in note.reason, note
        assert proxy.statistics().push_failed == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_push_reports_the_prefills_own_cache_hits_as_cached_tokens(nats_server,
                                                                          stream):
    """``usage.prompt_tokens_details.cached_tokens`` means the prefill engine's own cache
    hits in both modes (vLLM's meaning): a push's decode engine counts the pushed prompt
    as cached, so the proxy writes the prefill's figure into its answer."""
    lay = small_layout()

    def offer(rid: str) -> dict[str, Any]:
        return {"do_remote_prefill": True, "remote_engine_id": "px-cp",
                "remote_request_id": f"cmpl-{rid}-0", "remote_block_ids": [[1]],
                "remote_prefill_cached_tokens": 7}

    p_eng, d_eng = FakeEngine("p", offer=offer), FakeEngine("d")
    d_eng.usage = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
                   "prompt_tokens_details": {"cached_tokens": 39}}
    async with push_pair(nats_server, f"px-cached{int(stream)}", ("px-cp", "px-cd"), p_eng,
                         d_eng, lay) as (proxy, client, _):
        await until_routable(proxy, 1, 1)
        body = {"model": "m", "prompt": "hello", "max_tokens": 2, "stream": stream}
        async with client.post(proxy.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200 and resp.headers[ROUTE_HEADER] == "prefill-decode-push"
            raw = await resp.read()
    if stream:
        events = [json.loads(line[6:]) for line in raw.split(b"\n")
                  if line.startswith(b"data: {")]
        usage = events[-1]["usage"]
        assert raw.endswith(SSE[-1]) and len(events) == 3
    else:
        usage = json.loads(raw)["usage"]
    assert usage == {**d_eng.usage, "prompt_tokens_details": {"cached_tokens": 7}}
