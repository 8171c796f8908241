"""KV-aware routers over a real nats-server with JetStream and real agents: events
published by ``Agent.kv_events`` rebuild a router's view even when it starts after them
or restarts; two routers in the queue group both serve; a gap is repaired (the instance
lists its blocks afresh on ``KVResync``); forged and unsigned events change nothing."""

from __future__ import annotations

import uuid

import anyio
import nats
import pytest

from kvstream import Agent, ConfigError, ControlPlaneError
from kvstream.control import messages as m
from kvstream.control.bus import ControlBus
from kvstream.control.identity import Identity
from kvstream.control.stream import kv_events_stream
from kvstream.control.subjects import Subjects
from kvstream.prefix import block_hashes
from kvstream.routing.service import Router, RouterConfig
from tests.fakes import cache, small_layout
from tests.integration.agents import cfg

pytestmark = pytest.mark.anyio

LAY = small_layout()  # block size 8
PROMPT_A = list(range(1000, 1160))  # 20 blocks
PROMPT_B = list(range(5000, 5160))


def _ns() -> str:
    return f"rt{uuid.uuid4().hex[:8]}"


def _agent(name: str, ns: str, nats_server, port: int) -> Agent:
    return Agent(cfg(name, nats_server, namespace=ns, role="prefill",
                     endpoint=f"http://127.0.0.1:{port}"),
                 layout=LAY, kv_caches=cache(LAY, 4, fill=False))


async def _ask(bus: ControlBus, ns: str, prompt: list[int], **kw) -> m.Routed:
    req = m.Route(hashes={8: block_hashes(prompt, 8)}, tokens=len(prompt), legs=["prefill"],
                  **kw)
    reply = await bus.request(Subjects(ns).route, req, timeout=5.0)
    assert isinstance(reply, m.Routed), reply
    return reply


async def _until_routed(bus, ns, prompt, url: str, overlap: int | None = None,
                        timeout: float = 10.0) -> m.Decision:
    """Ask until the answer names ``url`` among both agents, with ``overlap`` if given
    (views fill as events and heartbeats arrive)."""
    with anyio.fail_after(timeout):
        while True:
            with anyio.move_on_after(2):
                got = await _ask(bus, ns, prompt)
                d = got.decisions[0] if got.decisions else None
                if d is not None and d.url == url and d.candidates == 2 and \
                        overlap in (None, d.overlap):
                    return d
            await anyio.sleep(0.05)


async def _client(nats_server) -> ControlBus:
    bus = await ControlBus.connect(nats_server.url, name="route-client")
    bus.seal.identity = Identity(f"client-{uuid.uuid4().hex[:6]}")  # routers answer the signed
    return bus


async def test_a_router_started_after_the_events_and_one_restarted_route_by_prefix(nats_server):
    ns = _ns()
    rcfg = RouterConfig(nats_url=nats_server.url, namespace=ns, peer_timeout_s=1.0)
    async with _agent("pa", ns, nats_server, 9101) as a, _agent("pb", ns, nats_server, 9102) as b:
        a.kv_events().stored(block_hashes(PROMPT_A, 8))
        b.kv_events().stored(block_hashes(PROMPT_B, 8))
        with anyio.fail_after(10):  # published before any router runs
            while not (a.kv_events().published and b.kv_events().published):
                await anyio.sleep(0.02)
        bus = await _client(nats_server)
        try:
            async with Router(rcfg) as router:
                d = await _until_routed(bus, ns, PROMPT_A, "http://127.0.0.1:9101", 20)
                assert (d.overlap, d.blocks, d.candidates) == (20, 20, 2)
                await _until_routed(bus, ns, PROMPT_B, "http://127.0.0.1:9102", 20)
                assert router.statistics().gaps == 0
            b.kv_events().removed(block_hashes(PROMPT_B, 8)[10:])  # while no router runs
            async with Router(rcfg):  # a restart: the stream again, from its start
                await _until_routed(bus, ns, PROMPT_A, "http://127.0.0.1:9101", 20)
                # The removal is kept too (flushed within 50 ms).
                await _until_routed(bus, ns, PROMPT_B, "http://127.0.0.1:9102", 10)
        finally:
            await bus.close()


async def test_two_routers_side_by_side_both_serve(nats_server):
    ns = _ns()
    rcfg = RouterConfig(nats_url=nats_server.url, namespace=ns, peer_timeout_s=1.0)
    async with _agent("pa", ns, nats_server, 9111) as a, _agent("pb", ns, nats_server, 9112):
        a.kv_events().stored(block_hashes(PROMPT_A, 8))
        bus = await _client(nats_server)
        try:
            async with Router(rcfg) as r1, Router(rcfg) as r2:
                with anyio.fail_after(10):  # both have both engines and pa's blocks
                    while not all(len(r.directory.instances("prefill")) == 2 and
                                  r.index.overlap("pa", block_hashes(PROMPT_A, 8)) == 20
                                  for r in (r1, r2)):
                        await anyio.sleep(0.05)
                seen = set()
                for _ in range(40):
                    got = await _ask(bus, ns, PROMPT_A)
                    seen.add(got.router_id)
                    assert got.decisions[0].url == "http://127.0.0.1:9111"
                # Each request goes to one of the two at random: both answer some of 40
                # (all 40 to one has odds 2**-39).
                assert seen == {r1.router_id, r2.router_id}
        finally:
            await bus.close()


async def test_load_outweighs_a_small_overlap_not_a_large_one(nats_server):
    ns = _ns()
    rcfg = RouterConfig(nats_url=nats_server.url, namespace=ns, peer_timeout_s=1.0)
    async with _agent("pa", ns, nats_server, 9121) as a, _agent("pb", ns, nats_server, 9122):
        a.kv_events().stored(block_hashes(PROMPT_A, 8)[:2])  # 2 of 20 blocks
        bus = await _client(nats_server)
        try:
            async with Router(rcfg):
                await _until_routed(bus, ns, PROMPT_A, "http://127.0.0.1:9121", 2)
                # 18 to compute + 0.5 * 1 request * 20 = 28 against 20 blocks on idle pb.
                got = await _ask(bus, ns, PROMPT_A, inflight={"http://127.0.0.1:9121": 1})
                assert got.decisions[0].url == "http://127.0.0.1:9122"
                a.kv_events().stored(block_hashes(PROMPT_A, 8))
                # Now 0 + 10 = 10 against 20: the holder, in spite of its request.
                with anyio.fail_after(10):
                    while (await _ask(bus, ns, PROMPT_A, inflight={
                            "http://127.0.0.1:9121": 1})).decisions[0].overlap != 20:
                        await anyio.sleep(0.05)
        finally:
            await bus.close()


async def test_a_gap_is_repaired_by_a_resync_and_forgeries_change_nothing(nats_server):
    ns = _ns()
    subjects = Subjects(ns)
    rcfg = RouterConfig(nats_url=nats_server.url, namespace=ns, peer_timeout_s=1.0)
    async with _agent("pa", ns, nats_server, 9131) as a, _agent("pb", ns, nats_server, 9132):
        log = a.kv_events()
        log.stored(block_hashes(PROMPT_A, 8)[:5])
        bus = await _client(nats_server)
        raw = await nats.connect(nats_server.url)
        try:
            async with Router(rcfg) as router:
                await _until_routed(bus, ns, PROMPT_A, "http://127.0.0.1:9131", 5)
                # A batch lost on the way (its number taken, never stored): the next shows
                # the gap, the stream cannot fill it, the router asks for a listing.
                log.seq += 1
                log.stored(block_hashes(PROMPT_A, 8)[5:12])
                with anyio.fail_after(15):
                    while True:
                        view = router.index.view("pa")
                        if router.statistics().resyncs and view is not None and \
                                not view.stale and len(view.held) == 12:
                            break
                        await anyio.sleep(0.05)
                assert router.statistics().gaps >= 1
                # Unsigned, and signed by another instance for pb: refused, pb unchanged.
                forged = m.KVEvents(instance_id="pb", epoch="forgedepoch", seq=1,
                                    block_size=8, events=[m.Stored(block_hashes(PROMPT_A, 8))],
                                    reset=True)
                await raw.publish(subjects.kv_events("pb"), m.encode(forged))
                async with Agent(cfg("px", nats_server, namespace=ns)) as px:
                    await px._core.control.persist(subjects.kv_events("pb"), forged,
                                                   a.kv_events()._stream)
                await raw.flush()
                with anyio.fail_after(10):  # the signed one, refused (the unsigned: forged)
                    while not router.statistics().refused:
                        await anyio.sleep(0.05)
                assert router.index.overlap("pb", block_hashes(PROMPT_A, 8)) == 0
                got = await _ask(bus, ns, PROMPT_A)
                assert got.decisions[0].url == "http://127.0.0.1:9131"
        finally:
            await raw.close()
            await bus.close()


async def test_a_restarted_instances_old_events_do_not_count(nats_server):
    """The stream still holds the first incarnation's batches (signed with its key): a
    router started after the restart routes by what the new incarnation holds."""
    ns = _ns()
    rcfg = RouterConfig(nats_url=nats_server.url, namespace=ns, peer_timeout_s=1.0)
    async with _agent("pb", ns, nats_server, 9142):
        async with _agent("pa", ns, nats_server, 9141) as old:
            old.kv_events().stored(block_hashes(PROMPT_A, 8))
            with anyio.fail_after(10):
                while not old.kv_events().published:
                    await anyio.sleep(0.02)
        async with _agent("pa", ns, nats_server, 9141) as new:  # same id, new key, new epoch
            new.kv_events().stored(block_hashes(PROMPT_B, 8))
            with anyio.fail_after(10):
                while not new.kv_events().published:
                    await anyio.sleep(0.02)
            bus = await _client(nats_server)
            try:
                async with Router(rcfg) as router:
                    d = await _until_routed(bus, ns, PROMPT_B, "http://127.0.0.1:9141")
                    with anyio.fail_after(10):
                        while router.index.overlap("pa", block_hashes(PROMPT_B, 8)) != 20:
                            await anyio.sleep(0.05)
                    assert router.index.overlap("pa", block_hashes(PROMPT_A, 8)) == 0
                    assert router.index.view("pa").epoch == new.kv_events().epoch
                    assert d.candidates == 2
            finally:
                await bus.close()


async def test_a_lost_last_batch_is_seen_in_the_heartbeat_and_relisted(nats_server):
    """No later batch shows the gap: the instance's heartbeat names its latest batch; the
    stream lacks it, so the router asks for a listing."""
    ns = _ns()
    rcfg = RouterConfig(nats_url=nats_server.url, namespace=ns, peer_timeout_s=1.0)
    async with _agent("pa", ns, nats_server, 9151) as a, _agent("pb", ns, nats_server, 9152):
        log = a.kv_events()
        log.stored(block_hashes(PROMPT_A, 8)[:4])
        async with Router(rcfg) as router:
            with anyio.fail_after(10):
                while router.index.overlap("pa", block_hashes(PROMPT_A, 8)) != 4:
                    await anyio.sleep(0.05)
            # A batch stored in the instance's mind only (its number spent, announced).
            log.seq += 1
            a._core.kv_seq = log.seq
            lost = log.seq
            with anyio.fail_after(20):
                while True:
                    view = router.index.view("pa")
                    if view is not None and view.seq > lost and not view.stale:
                        break
                    await anyio.sleep(0.05)
            assert router.statistics().resyncs >= 1
            assert router.index.overlap("pa", block_hashes(PROMPT_A, 8)) == 4


async def test_kept_reads_all_a_subject_keeps_or_fails(nats_server):
    """A reread is complete: every message kept on the subject, in order, each time (the
    consumer may push some before it says how many are pending); over the limit, an
    error rather than a shorter list."""
    ns = _ns()
    subjects = Subjects(ns)
    async with Agent(cfg("kp", nats_server, namespace=ns)) as agent:
        bus = agent._core.control
        stream = kv_events_stream(subjects)
        for seq in range(1, 31):
            await bus.persist(subjects.kv_events("kp"), m.KVEvents(
                instance_id="kp", epoch="epoch-kept", seq=seq, block_size=8,
                events=[m.Stored([seq])]), stream)
        for _ in range(3):
            got = await bus.kept(subjects.kv_events("kp"), stream)
            assert [msg.seq for msg, _ in got] == list(range(1, 31))
        with pytest.raises(ControlPlaneError):
            await bus.kept(subjects.kv_events("kp"), stream, limit=10)
        assert await bus.kept(subjects.kv_events("nobody"), stream) == []


async def test_an_instance_whose_events_are_missing_is_named_by_the_router_and_the_proxy(
        nats_server, caplog):
    """An engine says its KV events do not arrive (its bridge heard nothing after vLLM
    stored blocks): the router warns once, counts it blind, and the proxy's ``/health``
    names the engine; once its events arrive again, both say so."""
    import logging

    import aiohttp

    from kvstream.proxy import Proxy, ProxyConfig

    caplog.set_level(logging.INFO, logger="kvstream.router")
    ns = _ns()
    rcfg = RouterConfig(nats_url=nats_server.url, namespace=ns, peer_timeout_s=2.0)
    pcfg = ProxyConfig(port=0, nats_url=nats_server.url, namespace=ns, routing="kv")
    async with Router(rcfg) as router, Proxy(pcfg) as proxy, \
            aiohttp.ClientSession() as http, _agent("pm", ns, nats_server, 9111) as a:
        async def health() -> dict:
            async with http.get(proxy.url + "/health") as resp:
                return await resp.json()

        a.report_kv_events("missing")
        with anyio.fail_after(10):
            while router.statistics().blind != 1 or not (await health())["kv_events_missing"]:
                await anyio.sleep(0.05)
        h = await health()
        assert h["kv_events_missing"] == ["http://127.0.0.1:9111"]
        assert h["prefill"][0]["kv_events"] == "missing"
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                  and "pm's KV events are missing" in r.getMessage()]
        assert len(warned) == 1, warned  # once, not every heartbeat
        a.report_kv_events("ok")
        with anyio.fail_after(10):
            while router.statistics().blind or (await health())["kv_events_missing"]:
                await anyio.sleep(0.05)
        assert any("pm's KV events arrive" in r.getMessage() for r in caplog.records)
        with pytest.raises(ConfigError, match="unknown KV events state"):
            a.report_kv_events("fine")  # type: ignore[arg-type]
