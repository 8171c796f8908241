"""``kvstream proxy --routing kv`` over a real nats-server: a router placing both legs on
the engines that hold the prompt's prefix (text prompts tokenized by the engine's own
``/tokenize``, token-id prompts as given), the decisions in the proxy's statistics; with
no router answering, least-loaded routing serves the request all the same."""

from __future__ import annotations

import contextlib
import uuid

import aiohttp
import anyio
import pytest
from aiohttp import web

from kvstream import Agent
from kvstream.prefix import block_hashes
from kvstream.proxy import Proxy, ProxyConfig
from kvstream.routing.service import Router, RouterConfig
from tests.fakes import cache, small_layout
from tests.integration.agents import cfg
from tests.integration.test_proxy import FakeEngine, serving

pytestmark = pytest.mark.anyio

LAY = small_layout()  # block size 8
TEXT = "the quick brown fox jumps over the lazy dog, " * 4  # 180 characters: 22 blocks


def tokens_of(text: str) -> list[int]:
    return [ord(c) for c in text]


class TokenizingEngine(FakeEngine):
    """A fake engine whose ``/tokenize`` gives one token per character (counted)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.tokenized = 0

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.tokenized += 1
        text = body.get("prompt") or "".join(m["content"] for m in body.get("messages", []))
        return web.json_response({"tokens": tokens_of(text), "count": len(text)})


def _agent(name: str, ns: str, nats_server, role: str, url: str) -> Agent:
    return Agent(cfg(name, nats_server, namespace=ns, role=role, endpoint=url),
                 layout=LAY, kv_caches=cache(LAY, 4, fill=False))


async def test_both_legs_go_where_the_prefix_is_and_without_a_router_least_loaded(nats_server):
    ns = f"pk{uuid.uuid4().hex[:8]}"
    engines = [TokenizingEngine(n) for n in ("p1", "p2", "d1", "d2")]
    held = block_hashes(tokens_of(TEXT), 8)
    async with serving(*engines), contextlib.AsyncExitStack() as stack:
        p1, p2, d1, d2 = engines
        agents = {}
        for eng, role in ((p1, "prefill"), (p2, "prefill"), (d1, "decode"), (d2, "decode")):
            agents[eng.name] = await stack.enter_async_context(
                _agent(f"a{eng.name}", ns, nats_server, role, eng.url))
        agents["p2"].kv_events().stored(held)  # the prefill that computed it before
        agents["d1"].kv_events().stored(held[:11])  # a decode holding half of it
        await stack.enter_async_context(
            Router(RouterConfig(nats_url=nats_server.url, namespace=ns, peer_timeout_s=1.0)))
        proxy = await stack.enter_async_context(Proxy(ProxyConfig(
            port=0, nats_url=nats_server.url, namespace=ns, peer_timeout_s=1.0,
            routing="kv", route_timeout_s=5.0)))
        client = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)))
        body = {"model": "m", "prompt": TEXT, "max_tokens": 4}
        with anyio.fail_after(5):
            while (len(proxy.directory.instances("prefill")),
                   len(proxy.directory.instances("decode"))) != (2, 2):
                await anyio.sleep(0.02)
        with anyio.fail_after(30):  # until the router has every announcement and event
            while True:
                before = (len(p2.received), len(d1.received), proxy.statistics())
                async with client.post(proxy.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                now = proxy.statistics()
                if (len(p2.received), len(d1.received)) == (before[0] + 1, before[1] + 1) \
                        and now.hit_blocks["decode"] - before[2].hit_blocks["decode"] == 11:
                    break
                await anyio.sleep(0.1)
        stats = proxy.statistics()
        assert stats.kv_routed >= 1 and p1.tokenized + p2.tokenized >= 1
        # The last request: 22 prompt blocks per leg, all held by p2, 11 by d1.
        for _ in range(3):
            async with client.post(proxy.url + "/v1/completions", json={
                    "model": "m", "prompt": tokens_of(TEXT), "max_tokens": 4}) as resp:
                assert resp.status == 200
        after = proxy.statistics()
        assert after.kv_routed == stats.kv_routed + 3
        assert after.hit_blocks["prefill"] - stats.hit_blocks["prefill"] == 3 * 22
        assert after.hit_blocks["decode"] - stats.hit_blocks["decode"] == 3 * 11
        assert after.prompt_blocks["prefill"] - stats.prompt_blocks["prefill"] == 3 * 22
        # Token-id prompts are not tokenized; every text prompt was, once.
        assert sum(e.tokenized for e in engines) == after.kv_routed - 3 + after.kv_fallbacks

    # No router in this namespace: least loaded, counted as a fallback, served all the same.
    ns2 = f"pk{uuid.uuid4().hex[:8]}"
    p, d = TokenizingEngine("p"), TokenizingEngine("d")
    async with serving(p, d), _agent("np", ns2, nats_server, "prefill", p.url), \
            _agent("nd", ns2, nats_server, "decode", d.url), \
            Proxy(ProxyConfig(port=0, nats_url=nats_server.url, namespace=ns2,
                              peer_timeout_s=1.0, routing="kv",
                              route_timeout_s=0.2)) as proxy, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        with anyio.fail_after(5):
            while not (proxy.directory.instances("prefill") and
                       proxy.directory.instances("decode")):
                await anyio.sleep(0.02)
        async with client.post(proxy.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert await resp.json() == {"choices": [{"text": "decoded by d"}]}
        assert proxy.statistics().kv_fallbacks == 1 and proxy.statistics().kv_routed == 0
