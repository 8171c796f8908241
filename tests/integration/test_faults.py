"""The fault suite: each fault injected into real processes (kill -9 of a prefill, a decode,
a sidecar and the nats-server; SIGSTOP/SIGCONT; a cut link between network namespaces).
Each test prints

    FAULT <name>: detected after X.XX s; stats: ...

(run with ``-s``) and asserts how the survivors ended, that they are at rest, and that the
next transfer moves the right bytes. docs/faults.md has the measured table and the bugs.

Bounds come from the configuration, never from a time this machine happened to measure:

* A dead or silent peer is noticed by heartbeat silence. Its last heartbeat left no later
  than the fault; the observing agent's timer wakes exactly when that silence passes
  ``PEER_TIMEOUT`` (engine/liveness.py), and a transfer whose peer is dead ends without
  asking the peer anything (dataplane/stream.py). So it ends within ``PEER_TIMEOUT`` of the
  fault; we allow one ``HB`` more for a heartbeat delayed in flight and ``SLACK`` for
  scheduling: ``DETECT = PEER_TIMEOUT + HB + SLACK``.
* ``SLACK`` = 1.0 s: no step of an end path sleeps, so this is only the event loops and UCX
  threads of up to four processes getting one of two cores, on a host that other test
  runs share (load averages of 10 happen here): a few task hops, each a scheduling wait.
* Other bounds (a deadline, a reconnection, a TCP retransmission) are derived where used.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import anyio
import msgspec
import pytest
import torch

from kvstream import Agent, AgentConfig, KVLayout
from kvstream.client import Client, SidecarLostError
from kvstream.control.nats_server import free_port
from kvstream.shm import SharedKV
from tests.fakes import cache
from tests.integration.agents import assert_at_rest, settle
from tests.integration.fault_peers import (
    AgentProc,
    NatsProc,
    Netns,
    at_rest,
    reap,
    same_blocks,
    started,
)

pytestmark = pytest.mark.anyio

HB = 0.25  # heartbeat_s of every agent here (as tests/integration/agents.py)
PEER_TIMEOUT = 1.0  # peer_timeout_s
REQUEST_TIMEOUT = 1.0  # request_timeout_s: the longest one control request waits
SLACK = 1.0
DETECT = PEER_TIMEOUT + HB + SLACK
TEST_LIMIT = 60  # anyio.fail_after around each whole test: nothing may hang
# Every fault here strikes mid-stream: transfers go layer by layer however short (the
# default sends one this short as a single frame).
LAYERED: dict[str, Any] = {"whole_frame_bytes": 0}
FAST: dict[str, Any] = {"heartbeat_s": HB, "peer_timeout_s": PEER_TIMEOUT,
                        "request_timeout_s": REQUEST_TIMEOUT, **LAYERED}  # the children's

# 6 layers; 8 KiB per block and plane, so one layer plane of a transfer (8 blocks, 64 KiB)
# goes as a UCX rendezvous, not an eager copy: a sender can have data in flight at a fault.
LAY = KVLayout(num_layers=6, num_kv_heads=4, head_dim=64, block_size=16, dtype="float16",
               arrangement="flash_nhd")
NB = 32
SRC = [1, 3, 5, 7, 9, 11, 13, 15]  # scattered: gathered into staging
DST = list(range(16, 24))  # contiguous: received straight into the engine's blocks
EXPECTED = cache(LAY, NB, fill=True)  # what every filled cache holds (seeded)


class SenderStuck(AssertionError):
    """kvstream bug 1 (docs/faults.md): a sender's transfer that does not end by its bound
    (its deadline plus END_GRACE at the latest), or at all."""


class EndpointOrphaned(AssertionError):
    """kvstream bug 2 (docs/faults.md, fixed): after one side alone held the other dead
    (and aborted its UCX endpoint), a push between the two live agents failed."""


def ended(end: dict[str, Any] | None, latest: float, stuck: list[str]) -> dict[str, Any]:
    if end is None or end["t"] > latest:
        raise SenderStuck(f"the prefill had not ended its transfer by its bound ({end}); "
                          f"it waits in {stuck}")
    assert end["status"] != "completed", end
    return end


def cfg(instance_id: str, nats_url: str) -> AgentConfig:
    return AgentConfig(instance_id=instance_id, nats_url=nats_url, heartbeat_s=HB,
                       peer_timeout_s=PEER_TIMEOUT, request_timeout_s=REQUEST_TIMEOUT,
                       **LAYERED)


def brief(stats: Any) -> dict[str, Any]:
    """The non-zero figures of a statistics() snapshot (struct or dict)."""
    s = stats if isinstance(stats, dict) else msgspec.to_builtins(stats)
    return {k: v for k, v in s.items() if v and k not in ("instance_id", "kv_registered_bytes",
                                                          "staging_bytes_peak")}


def report(name: str, detected: float, **stats: Any) -> None:
    parts = "; ".join(f"{who} {brief(s)}" for who, s in stats.items())
    print(f"\nFAULT {name}: detected after {detected:.2f} s; stats: {parts}")


def zero_blocks(kv: list[torch.Tensor], blocks: list[int], layers: range) -> bool:
    return all(kv[layer][:, b].count_nonzero() == 0 for layer in layers for b in blocks)


def snapshot(kv: list[torch.Tensor], blocks: list[int]) -> list[torch.Tensor]:
    return [t[:, blocks].clone() for t in kv]


def unchanged(kv: list[torch.Tensor], blocks: list[int], before: list[torch.Tensor]) -> bool:
    return all(torch.equal(t[:, blocks], b) for t, b in zip(kv, before, strict=True))


async def try_push(d: Agent, dkv: list[torch.Tensor], p: AgentProc, rid: str
                   ) -> tuple[Any, dict[str, Any] | None, bool]:
    """A whole push from the child ``p`` into ``d``'s zeroed DST blocks: the decode result,
    the prefill's end (None if it had none within a request timeout more) and whether
    the bytes are right. Raises nothing, so that a test can say all of it first."""
    for t in dkv:
        t[:, DST] = 0  # what an earlier transfer left there does not count
    h = d.expect(rid, DST, src=p.instance_id)
    await p.call("push", rid=rid, dst=d.instance_id, blocks=SRC, ready=LAY.num_layers)
    with anyio.fail_after(20):
        r = await h.result()
    end = await p.maybe_event("end", rid, REQUEST_TIMEOUT + SLACK)
    return r, end, r.ok and same_blocks(dkv, EXPECTED, DST, SRC)


async def push_and_verify(d: Agent, dkv: list[torch.Tensor], p: AgentProc, rid: str) -> None:
    r, end, verified = await try_push(d, dkv, p, rid)
    assert r.ok and verified, r
    assert end is not None and end["status"] == "completed", end


# -- (1) kill -9 of the prefill process mid-transfer -------------------------------------------

async def test_kill9_prefill_mid_transfer(nats_server, tmp_path):
    with anyio.fail_after(TEST_LIMIT):
        dkv = cache(LAY, NB, fill=False)
        async with Agent(cfg("fd1", nats_server.url), layout=LAY, kv_caches=dkv) as d, \
                AgentProc("fp1", nats_server.url, LAY, NB, fill=True, log_dir=tmp_path,
                          cfg=FAST) as p, \
                AgentProc("fp1", nats_server.url, LAY, NB, fill=True, log_dir=tmp_path,
                          cfg=FAST, hold=True) as fresh:  # the restarted engine, same id
            await started(p)
            h = d.expect("f1", DST, src=p.instance_id)
            await p.call("push", rid="f1", dst="fd1", blocks=SRC, ready=2)
            with anyio.fail_after(20):
                await h.wait_layer(1)
            t_kill = await p.kill()
            with anyio.fail_after(DETECT + 5):
                r = await h.result()
            detected = r.ended_at - t_kill
            assert (r.status, r.cause) == ("failed", "peer_lost"), r
            assert detected <= DETECT, r
            assert not h.layer_landed(2) and zero_blocks(dkv, DST, range(2, LAY.num_layers))
            await settle(d)
            assert_at_rest(d)
            after_fault = d.statistics()
            await fresh.go()
            await push_and_verify(d, dkv, fresh, "f1-next")
            p_stats = (await fresh.call("rest"))["stats"]
            assert at_rest(p_stats) and p_stats["completed"] == 1
            await settle(d)
            assert_at_rest(d)
            s = d.statistics()
            assert (s.failed, s.completed) == (1, 1)
    report("kill9-prefill", detected, decode=after_fault, decode_after_next=s,
           fresh_prefill=p_stats)


# -- (2) kill -9 of the decode process mid-transfer --------------------------------------------

async def test_kill9_decode_mid_transfer(nats_server, tmp_path):
    with anyio.fail_after(TEST_LIMIT):
        async with Agent(cfg("fp2", nats_server.url), layout=LAY,
                         kv_caches=cache(LAY, NB, fill=True)) as p, \
                AgentProc("fd2", nats_server.url, LAY, NB, fill=False, log_dir=tmp_path,
                          cfg=FAST) as d, \
                AgentProc("fd2", nats_server.url, LAY, NB, fill=False, log_dir=tmp_path,
                          cfg=FAST, hold=True) as fresh:
            await started(d)
            await d.call("expect", rid="f2", blocks=DST, src=p.instance_id)
            h = await p.push("f2", "fd2", SRC)
            h.layer_ready(0)
            h.layer_ready(1)
            await d.call("landed", rid="f2", layer=1)
            t_kill = await d.kill()
            with anyio.fail_after(DETECT + 5):
                r = await h.result()
            detected = r.ended_at - t_kill
            assert (r.status, r.cause) == ("failed", "peer_lost"), r
            assert detected <= DETECT, r
            await settle(p)
            assert_at_rest(p)
            after_fault = p.statistics()
            await fresh.go()
            await fresh.call("expect", rid="f2-next", blocks=DST, src=p.instance_id)
            h2 = await p.push("f2-next", "fd2", SRC)
            h2.all_ready()
            with anyio.fail_after(20):
                await h2.wait()
            assert (await fresh.event("end", "f2-next"))["status"] == "completed"
            assert (await fresh.call("verify", src=SRC, dst=DST))["ok"]
            d_stats = (await fresh.call("rest"))["stats"]
            assert at_rest(d_stats) and d_stats["completed"] == 1
            await settle(p)
            assert_at_rest(p)
            s = p.statistics()
            assert (s.failed, s.completed) == (1, 1)
    report("kill9-decode", detected, prefill=after_fault, prefill_after_next=s,
           fresh_decode=d_stats)


# -- (3) kill -9 of a sidecar process ----------------------------------------------------------

async def spawn_sidecar(instance_id: str, nats_url: str, tmp_path) -> tuple[Any, str]:
    """``kvstream sidecar`` as its own process (as tests/integration/test_sidecar.py runs it)."""
    sock = str(tmp_path / f"{instance_id}.sock")
    with open(tmp_path / f"{instance_id}.log", "ab") as log:
        proc = await anyio.open_process(
            [sys.executable, "-m", "kvstream.tools.cli", "sidecar", "--instance-id", instance_id,
             "--socket", sock, "--nats-url", nats_url, "--log-level", "warning",
             "--whole-frame-bytes", "0"],
            stdout=subprocess.DEVNULL, stderr=log)
    return proc, sock


async def serving(proc: Any, sock: str, timeout: float = 60) -> None:
    with anyio.fail_after(timeout):
        while not os.path.exists(sock):
            assert proc.returncode is None, f"sidecar for {sock} exited"
            await anyio.sleep(0.05)


def shared_filled() -> SharedKV:
    shared = SharedKV.create(LAY, NB)
    for mine, want in zip(shared.layers, EXPECTED, strict=True):
        mine.copy_(want)
    return shared


async def test_kill9_sidecar(nats_server, tmp_path):
    """The prefill engine's sidecar dies mid-push: the engine's client learns it from its
    socket, the decode agent from the sidecar's missing heartbeats. A second sidecar (the
    replacement, started beside the first) then serves the same engine memory."""
    procs = [await spawn_sidecar(iid, nats_server.url, tmp_path) for iid in ("fs3", "fs3b")]
    try:
        with anyio.fail_after(TEST_LIMIT):
            for proc, sock in procs:
                await serving(proc, sock)
            (proc, sock), (_, sock_b) = procs
            dkv = cache(LAY, NB, fill=False)
            async with Agent(cfg("fd3", nats_server.url), layout=LAY, kv_caches=dkv) as d:
                h = d.expect("f3", DST, src="fs3")
                async with Client.connect(sock) as client:
                    await client.register_kv(LAY, shared_filled())
                    tx = await client.push("f3", "fd3", SRC)
                    tx.layer_ready(0)
                    tx.layer_ready(1)
                    with anyio.fail_after(20):
                        await h.wait_layer(1)
                    t_kill = time.monotonic()
                    proc.kill()
                    # No timer on the engine side: the socket's end fails every handle at
                    # once (client.py, _lose), so within SLACK.
                    with anyio.fail_after(SLACK + 5):
                        mine = await tx.result()
                    client_s = mine.ended_at - t_kill
                    with pytest.raises(SidecarLostError):
                        await client.push("f3-after", "fd3", SRC)
                    with anyio.fail_after(DETECT + 5):
                        r = await h.result()
                detected = r.ended_at - t_kill
                assert (mine.status, mine.cause) == ("failed", "peer_lost"), mine
                assert "sidecar lost" in mine.reason and client_s <= SLACK, mine
                assert (r.status, r.cause) == ("failed", "peer_lost"), r
                assert detected <= DETECT, r
                await settle(d)
                assert_at_rest(d)
                after_fault = d.statistics()
                for t in dkv:
                    t[:, DST] = 0
                async with Client.connect(sock_b) as client:
                    await client.register_kv(LAY, shared_filled())
                    h2 = d.expect("f3-next", DST, src="fs3b")  # the replacement
                    tx2 = await client.push("f3-next", "fd3", SRC)
                    tx2.all_ready()
                    with anyio.fail_after(20):
                        await h2.wait()
                        await tx2.wait()
                    sidecar_stats = await client.statistics()
                assert same_blocks(dkv, EXPECTED, DST, SRC)
                assert at_rest(sidecar_stats) and sidecar_stats["completed"] == 1
                await settle(d)
                assert_at_rest(d)
    finally:
        for proc, _ in procs:
            await reap(proc)
    report("kill9-sidecar", detected, decode=after_fault, new_sidecar=sidecar_stats)
    print(f"FAULT kill9-sidecar: the engine's client failed its push after {client_s:.3f} s "
          f"({mine.reason})")


# -- (4) kill -9 of the (single) nats-server ---------------------------------------------------

# nats-py retries a lost server every reconnect_time_wait (0.2 s, control/bus.py) for ever;
# once it is back, each agent's next heartbeat (within HB) reaches the other.
RECONNECT = 0.2 + HB + SLACK


async def test_kill9_nats_server(tmp_path):
    """Two pushes in flight when NATS dies: the prefill keeps computing one of them (its
    last layers become ready after the kill); the other gets no more layers."""
    nats = NatsProc("127.0.0.1", free_port(), tmp_path).start()
    dkv = cache(LAY, NB, fill=False)
    other = list(range(24, 32))  # the second push's blocks at the destination
    try:
        with anyio.fail_after(TEST_LIMIT):
            async with Agent(cfg("fd4", nats.url), layout=LAY, kv_caches=dkv) as d, \
                    AgentProc("fp4", nats.url, LAY, NB, fill=True, log_dir=tmp_path,
                              cfg=FAST) as p:
                try:
                    await started(p)
                    ha = d.expect("f4a", DST, src=p.instance_id)
                    hb = d.expect("f4b", other, src=p.instance_id)
                    await p.call("push", rid="f4a", dst="fd4", blocks=SRC, ready=2)
                    await p.call("push", rid="f4b", dst="fd4", blocks=SRC, ready=2)
                    with anyio.fail_after(20):
                        await ha.wait_layer(1)
                        await hb.wait_layer(1)
                    t_kill = nats.kill()
                    await p.call("ready", rid="f4a", upto=LAY.num_layers)
                    with anyio.fail_after(DETECT + 5):
                        ra, rb = await ha.result(), await hb.result()
                    pa = await p.event("end", "f4a", timeout=DETECT + 5)
                    pb = await p.event("end", "f4b", timeout=DETECT + 5)
                    # The data plane does not need NATS: f4a's last layers still arrive and
                    # the decode side completes it (its Done cannot reach the prefill).
                    assert ra.status == "completed", ra
                    assert same_blocks(dkv, EXPECTED, DST, SRC)
                    # Heartbeats stop both ways at the kill: the rest fails as "peer lost".
                    for end in (pa, pb, msgspec.to_builtins(rb)):
                        assert (end["status"], end["cause"]) == ("failed", "peer_lost"), end
                    detected = max(rb.ended_at, pa["t"], pb["t"]) - t_kill
                    assert detected <= DETECT, (rb, pa, pb)
                    assert zero_blocks(dkv, other, range(2, LAY.num_layers))
                    await settle(d)
                    assert_at_rest(d)
                    p_fault = (await p.call("rest"))["stats"]
                    assert at_rest(p_fault), p_fault
                    d_fault = d.statistics()
                    await anyio.sleep(max(0.0, t_kill + 2.0 - time.monotonic()))  # down 2 s
                    t_up = time.monotonic()
                    await anyio.to_thread.run_sync(nats.start)
                    with anyio.fail_after(RECONNECT + 5):
                        while "fp4" not in {a.instance_id for a in d.peers()} or \
                                "fd4" not in (await p.call("peers"))["peers"]:
                            await anyio.sleep(0.02)
                    reconnected = time.monotonic() - t_up
                    assert reconnected <= RECONNECT
                    await push_and_verify(d, dkv, p, "f4-next")
                    await settle(d)
                    assert_at_rest(d)
                    p_stats = (await p.call("rest"))["stats"]
                    assert at_rest(p_stats) and p_stats["completed"] == 1
                finally:
                    # An agent that closes while its server is down raises from its exit
                    # (docs/faults.md, bug 3): a failing test must show its own error.
                    if nats.proc is None or nats.proc.poll() is not None:
                        await anyio.to_thread.run_sync(nats.start)
    finally:
        nats.stop()
    report("kill9-nats", detected, decode=d_fault, prefill=p_fault, prefill_after_next=p_stats)
    print(f"FAULT kill9-nats: both agents saw each other again {reconnected:.2f} s after the "
          "restart on the same port")


# -- (5) SIGSTOP of a peer for longer than peer_timeout_s, then SIGCONT -----------------------

P_DEADLINE = 3.5  # the stopped prefill's transfer_timeout_s: after SIGCONT (~1.8 s in)
# A transfer that has begun to end gives its sends in flight 2 x request_timeout_s, then
# cancels them (dataplane/send.py, SendStream._unstick): the longest its end may take.
END_GRACE = 2 * REQUEST_TIMEOUT

# The decode side aborts its endpoint to the prefill it held dead; the prefill, which never
# held the decode side dead, drops its own when the decode side's announcements say so
# (``Announce.forgot``), so the next push builds a fresh pair.
QUIET = pytest.param(4.0, False, id="one-sided-quiet")


@pytest.mark.parametrize(("own_timeout", "late"), [
    pytest.param(PEER_TIMEOUT, True, id="both-sides"),
    pytest.param(4.0, True, id="one-sided"),
    QUIET,
])
async def test_sigstop_prefill_then_sigcont(nats_server, tmp_path, own_timeout, late):
    """The prefill process is stopped for PEER_TIMEOUT + 2 HB with 2 of 6 layers sent.
    ``both-sides``: its peer_timeout_s is the decode side's, so on SIGCONT it finds the
    decode side silent too. ``one-sided``: its peer_timeout_s (4 s) is longer than the
    stop, so it still holds the decode side alive (as a prefill does whose pause only its
    peer noticed). With ``late``, its last 4 layers become ready the moment it runs again,
    so it sends them to a transfer the decode side has ended; ``-quiet``: it sends none."""
    with anyio.fail_after(TEST_LIMIT):
        dkv = cache(LAY, NB, fill=False)
        pcfg = {**FAST, "peer_timeout_s": own_timeout, "transfer_timeout_s": P_DEADLINE}
        async with Agent(cfg("fd5", nats_server.url), layout=LAY, kv_caches=dkv) as d, \
                AgentProc("fp5", nats_server.url, LAY, NB, fill=True, log_dir=tmp_path,
                          cfg=pcfg) as p:
            await started(p)
            h = d.expect("f5", DST, src=p.instance_id)
            t_push = time.monotonic()
            await p.call("push", rid="f5", dst="fd5", blocks=SRC, ready=2)
            with anyio.fail_after(20):
                await h.wait_layer(1)
            t_stop = p.signal(signal.SIGSTOP)
            try:
                if late:
                    await p.post("ready", rid="f5", upto=LAY.num_layers)  # read after SIGCONT
                with anyio.fail_after(DETECT + 5):
                    r = await h.result()
                detected = r.ended_at - t_stop
                assert (r.status, r.cause) == ("failed", "peer_lost"), r
                assert detected <= DETECT, r
                await settle(d)
                assert_at_rest(d)
                landed = snapshot(dkv, DST)  # layers 0 and 1; the rest still zero
                assert zero_blocks(dkv, DST, range(2, LAY.num_layers))
                after_fault = d.statistics()
                await anyio.sleep(max(0.0, t_stop + PEER_TIMEOUT + 2 * HB - time.monotonic()))
            finally:
                t_cont = p.signal(signal.SIGCONT)
            stopped_s = t_cont - t_stop
            both = own_timeout < stopped_s
            # The resumed prefill must end its transfer. both-sides: its timer's first turn
            # finds the decode side silent for longer than its peer_timeout_s (SLACK).
            # one-sided: nothing tells it (the decode side does not talk to a peer it holds
            # dead), so its own deadline, t_push + P_DEADLINE, then END_GRACE and SLACK.
            latest = t_cont + SLACK if both else t_push + P_DEADLINE + END_GRACE + SLACK
            end = await p.maybe_event("end", "f5", timeout=latest - time.monotonic())
            await anyio.sleep(2 * HB)
            # Whatever the prefill did since, nothing of it landed in the decode side's blocks.
            assert unchanged(dkv, DST, landed)
            # The next transfer between the same two agents, into the same blocks.
            nxt, nxt_end, verified = await try_push(d, dkv, p, "f5-next")
            await settle(d)
            assert_at_rest(d)
            s = d.statistics()
            p_stats = (await p.call("rest", wait=1))["stats"]
            stuck = [t for t in (await p.call("stuck"))["stuck"] if "send" in t]
            final = end or await p.maybe_event("end", "f5", timeout=0.1)
            name = f"sigstop-prefill-{'both-sides' if both else 'one-sided'}" \
                f"{'' if late else '-quiet'}"
            report(name, detected, decode=after_fault, decode_after_next=s, prefill=p_stats)
            print(f"FAULT {name}: stopped {stopped_s:.2f} s; the resumed prefill ended f5 "
                  f"{final and (final['status'], final['reason'], round(final['t'] - t_cont, 2))}"
                  f" s after SIGCONT (bound {latest - t_cont:.2f} s); "
                  f"next push: decode {nxt.status} ({nxt.reason}), prefill "
                  f"{nxt_end and nxt_end['status']}; prefill waits in {stuck}")
            ended(end, latest, stuck)
            if not nxt.ok:
                raise EndpointOrphaned(f"next push: {nxt.status} ({nxt.reason})")
            assert verified
            assert nxt_end is not None and nxt_end["status"] == "completed", nxt_end
            assert at_rest(p_stats), (p_stats, stuck)


# -- (6) a network partition between two network namespaces ----------------------------------

D_DEADLINE = 3.0  # transfer_timeout_s in the partition test: what ends a data-plane-only cut
# A NATS connection stalled by the cut moves again at its next TCP retransmission: the
# first retransmission timeout is Linux's minimum, 0.2 s, at these microsecond RTTs, and it
# doubles while the link is down, so the next one after the link is back is at most the
# outage plus that minimum away. Then each side's next heartbeat (HB), and SLACK.
RTO_MIN = 0.2


@pytest.fixture
def netns():
    why = Netns.available()
    if why:
        pytest.skip(why)
    net = Netns()
    try:
        yield net.open()
    finally:
        net.close()


async def both_see_each_other(p: AgentProc, d: AgentProc, timeout: float) -> float:
    t = time.monotonic()
    with anyio.fail_after(timeout):
        while d.instance_id not in (await p.call("peers"))["peers"] or \
                p.instance_id not in (await d.call("peers"))["peers"]:
            await anyio.sleep(0.05)
    return time.monotonic() - t


async def cross_push(p: AgentProc, d: AgentProc, rid: str, timeout: float | None = None
                     ) -> None:
    await d.call("expect", rid=rid, blocks=DST, src=p.instance_id)
    await p.call("push", rid=rid, dst=d.instance_id, blocks=SRC, ready=LAY.num_layers,
                 timeout=timeout)
    for side in (p, d):
        assert (await side.event("end", rid, timeout=40))["status"] == "completed"
    assert (await d.call("verify", src=SRC, dst=DST))["ok"]


@pytest.mark.parametrize("cut", ["cable", "dataplane"])
async def test_network_partition(netns, tmp_path, cut):
    """Prefill in namespace a, decode in b, nats-server in n (their bridge); UCX over TCP on
    the veths. ``cable``: b's port on the bridge goes down, b loses NATS and a at once.
    ``dataplane``: the bridge isolates a from b; both still reach NATS."""
    nats = NatsProc(Netns.ADDR["n"], 4222, tmp_path, prefix=netns.exec_prefix("n")).start()
    ucx = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "v0"}
    pcfg = {**FAST, "transfer_timeout_s": D_DEADLINE}
    try:
        with anyio.fail_after(TEST_LIMIT):
            async with AgentProc("fp6", nats.url, LAY, NB, fill=True, log_dir=tmp_path,
                                 cfg=pcfg, prefix=netns.exec_prefix("a"), env=ucx) as p, \
                    AgentProc("fd6", nats.url, LAY, NB, fill=False, log_dir=tmp_path,
                              cfg=pcfg, prefix=netns.exec_prefix("b"), env=ucx) as d:
                await started(p, d)
                await both_see_each_other(p, d, timeout=10)
                await cross_push(p, d, "f6-before")  # the path works before the cut
                await d.call("expect", rid="f6", blocks=DST, src=p.instance_id)
                t_push = time.monotonic()
                await p.call("push", rid="f6", dst="fd6", blocks=SRC, ready=2)
                await d.call("landed", rid="f6", layer=1)
                t_cut = time.monotonic()
                netns.cable("b", up=False) if cut == "cable" else netns.isolate(True)
                await p.call("ready", rid="f6", upto=LAY.num_layers)  # into the cut link
                # cable: heartbeats stop both ways ("peer lost"). dataplane: they go on; the
                # transfer's deadline (both sides share it) ends it, and the prefill's sends
                # stuck in the cut link are cancelled END_GRACE later.
                latest = t_cut + DETECT if cut == "cable" else \
                    t_push + D_DEADLINE + END_GRACE + SLACK
                de = await d.event("end", "f6", timeout=latest - time.monotonic() + 5)
                # Both sides must end while the link is still cut.
                pe = await p.maybe_event("end", "f6", timeout=latest - time.monotonic() + 1)
                stuck = [t for t in (await p.call("stuck"))["stuck"] if "send" in t]
                detected = de["t"] - t_cut
                t_restore = time.monotonic()
                netns.cable("b", up=True) if cut == "cable" else netns.isolate(False)
                outage = t_restore - t_cut
                recovered = await both_see_each_other(
                    p, d, timeout=outage + RTO_MIN + HB + SLACK + 5)
                d_stats = (await d.call("rest", wait=2))["stats"]
                # UCX over TCP reconnects after the cut in its own time, which nothing
                # bounds: this push gets 20 s, not the 3 s deadline of the one cut.
                await cross_push(p, d, "f6-after", timeout=20.0)
                p_stats = (await p.call("rest", wait=1))["stats"]
                late = pe or await p.maybe_event("end", "f6", timeout=0.1)
                report(f"partition-{cut}", detected, decode=d_stats, prefill=p_stats)
                print(f"FAULT partition-{cut}: decode ended {de['status']} ({de['reason']}); "
                      "prefill ended "
                      f"{late and (late['status'], late['reason'], round(late['t'] - t_cut, 2))}"
                      f" s after the cut; the link was back after {outage:.2f} s, both saw "
                      f"each other {recovered:.2f} s later; the prefill waited in {stuck}")
                assert de["status"] != "completed" and de["t"] <= latest, de
                assert at_rest(d_stats), d_stats
                assert recovered <= outage + RTO_MIN + HB + SLACK
                pe = ended(pe, latest, stuck)
                assert at_rest(p_stats), (p_stats, stuck)
                if cut == "cable":
                    assert (de["cause"], pe["cause"]) == ("peer_lost", "peer_lost")
    finally:
        nats.stop()
