"""Attacks on a live pair from the same NATS server, as an attacker would run them.

Real parts only: the session's nats-server (no permissions: any client reads and
publishes every subject), two honest agents in this process, and an attacker in its own
process (tests/integration/attackers.py): a *sniffer* (a plain nats-py connection on
``>``) and, where the attack needs one, an *insider* (a legitimate Agent with its own
key and instance id). Each test asserts the attack fails: the honest transfer ends with
the prefill's exact bytes, the attacker gets nothing, the agents stay alive, a push, a
pull and a staged push between the pair still verify afterwards, and the counter that
notes the refusal grew.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing as mp
import queue
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

from kvstream import Agent, BlockingClient, Client, KVStreamError, SharedKV
from kvstream.layout import KVLayout
from tests.fakes import cache, small_layout
from tests.integration.agents import assert_at_rest, cfg, meet, settle
from tests.integration.attackers import Plan, run

pytest.importorskip("ucxx")

pytestmark = pytest.mark.anyio


# == the honest pair and what they must still do ===========================================

def same(p: Agent, d: Agent, src: list[int], dst: list[int]) -> bool:
    assert p.memory is not None and d.memory is not None
    return all(torch.equal(p.memory.read_block(layer, a), d.memory.read_block(layer, b))
               for layer in range(p.memory.layout.num_layers)
               for a, b in zip(src, dst, strict=True))


def reserve(d: Agent, rid: str, blocks: list[int], src: str) -> Any:
    """``expect`` as an engine writes it: without naming the source where the API still
    lets it (that is the opening attack A uses), else with the source it waits for."""
    try:
        return d.expect(rid, blocks)  # type: ignore[call-arg]
    except TypeError:
        return d.expect(rid, blocks, src=src)


def ok(*results: Any) -> None:
    """Every transfer completed (else say how each ended, and why)."""
    assert all(r.ok for r in results), \
        [f"{r.side.value} {r.request_id}: {r.status.value} ({r.reason})" for r in results]


async def still_works(p: Agent, d: Agent, tag: str) -> None:
    """A push, a pull and a staged push between the pair, each verified byte for byte;
    then both at rest and alive to each other."""
    pid = p.instance_id
    rx = d.expect(f"{tag}-push", [9, 4], src=pid)
    tx = await p.push(f"{tag}-push", d.instance_id, [1, 6])
    tx.all_ready()
    with anyio.fail_after(10):
        ok(await rx.result(), await tx.result())
    assert same(p, d, [1, 6], [9, 4])

    held = p.offer(f"{tag}-pull", [2, 7])
    held.all_ready()
    rx = await d.pull(f"{tag}-pull", pid, [10, 5], secret=held.secret)
    with anyio.fail_after(10):
        ok(await rx.result(), await held.result())
    assert same(p, d, [2, 7], [10, 5])

    tx = await p.push(f"{tag}-staged", d.instance_id, [3, 8])  # before its reservation
    tx.all_ready()
    with anyio.fail_after(10):
        ok(await tx.result())  # whole in the decode's staging
    rx = d.expect(f"{tag}-staged", [11, 12], src=pid)
    with anyio.fail_after(10):
        ok(await rx.result())
    assert same(p, d, [3, 8], [11, 12])
    await settle(p, d)
    assert_at_rest(p, d)
    assert p.registry.alive(d.instance_id) and d.registry.alive(pid)


@contextlib.asynccontextmanager
async def pair(nats_server: Any, tag: str, lay: KVLayout, *, shared: bool = False,
               p_kw: dict[str, Any] | None = None, d_kw: dict[str, Any] | None = None
               ) -> AsyncIterator[tuple[Agent, Agent]]:
    """A prefill with seeded KV and a zeroed decode (``shared``: KV in shared memory, so a
    same-host decode may read the prefill's directly), met."""
    n = 16
    if shared:
        p_mem, d_mem = SharedKV.create(lay, n), SharedKV.create(lay, n)
        for t, src in zip(p_mem.layers, cache(lay, n, fill=True), strict=True):
            t.copy_(src)
        p_kv, d_kv = p_mem.layers, d_mem.layers
    else:
        p_kv, d_kv = cache(lay, n, fill=True), cache(lay, n, fill=False)
    async with Agent(cfg(f"p-{tag}", nats_server, **(p_kw or {})), layout=lay,
                     kv_caches=p_kv) as p, \
            Agent(cfg(f"d-{tag}", nats_server, **(d_kw or {})), layout=lay,
                  kv_caches=d_kv) as d:
        await meet(p, d)
        yield p, d


# == the attacker's process ================================================================

class Attacker:
    """The parent's side of one attacker process: its cues and its report."""

    def __init__(self, plan: Plan) -> None:
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        self.go_ev, self.stop_ev = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=run, args=(plan, self.q, self.go_ev, self.stop_ev),
                                daemon=True)

    async def next(self, kind: str, timeout: float = 30.0) -> dict[str, Any]:
        try:
            got, body = await anyio.to_thread.run_sync(self.q.get, True, timeout)
        except queue.Empty:
            raise AssertionError(f"the attacker sent no {kind} within {timeout:g}s "
                                 f"(exit code {self.proc.exitcode})") from None
        assert "error" not in body, f"the attacker broke: {body['error']}"
        assert got == kind, (got, body)
        return body

    def go(self) -> None:
        self.go_ev.set()

    def stop(self) -> None:
        self.stop_ev.set()


RSS_GROWTH_MB = 50  # what an attack may add to the honest agents' process, at most


def rss_mb() -> float:
    """This process's resident memory now (the honest agents live in it)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@contextlib.asynccontextmanager
async def attacker(plan: Plan, *, sees: Sequence[Agent] = ()) -> AsyncIterator[Attacker]:
    """Started, ready (listening; its insider seen by ``sees``), stopped and reaped; the
    honest process grew by less than ``RSS_GROWTH_MB`` meanwhile."""
    a = Attacker(plan)
    before = rss_mb()
    a.proc.start()
    try:
        await a.next("ready")
        if plan.insider_id:
            with anyio.fail_after(10):
                while not all(x.registry.alive(plan.insider_id) for x in sees):
                    await anyio.sleep(0.02)
        yield a
    finally:
        a.stop()
        await anyio.to_thread.run_sync(a.proc.join, 5)
        if a.proc.is_alive():
            a.proc.kill()
            a.proc.join(5)
    grew = rss_mb() - before
    assert grew < RSS_GROWTH_MB, f"the honest agents grew by {grew:.0f} MB under the attack"


def plan(nats_server: Any, lay: KVLayout, mode: str, victim: str, rid: str,
         **kw: Any) -> Plan:
    return Plan(mode=mode, nats_url=nats_server.url, layout_blob=msgspec.msgpack.encode(lay),
                victim=victim, request_id=rid, **kw)  # type: ignore[arg-type]


# == A: expect without src ================================================================

def _faces(d: Agent) -> dict[str, Callable[..., Any]]:
    return {"agent": d.expect, "local client": Client.local(d).expect,
            "sidecar client": Client.connect("/nonexistent/kvs.sock").expect,
            "blocking client": BlockingClient("/nonexistent/kvs.sock").expect}


@pytest.mark.parametrize("face", ["agent", "local client", "sidecar client",
                                  "blocking client"])
async def test_expect_without_src_is_a_type_error(nats_server: Any, face: str) -> None:
    """A reservation that names no source lets any signed peer's push land in it: every
    face of ``expect`` refuses the call before anything is reserved."""
    lay = small_layout(layers=2)
    async with Agent(cfg(f"d-src-{face[:5]}", nats_server), layout=lay,
                     kv_caches=cache(lay, 4, fill=False)) as d:
        fn = _faces(d)[face]
        try:
            call = fn("r", [1])  # raises on the call itself: no coroutine, no reservation
        except TypeError as exc:
            assert "src" in str(exc), exc
        except Exception as exc:  # the body ran: the call was taken
            pytest.fail(f"{face}: expect() without src was taken (then failed: {exc!r})")
        else:
            if inspect.iscoroutine(call):
                call.close()
            pytest.fail(f"{face}: expect() without src was taken")
        assert d.statistics().reservations_active == 0
        src = inspect.signature(fn).parameters["src"]
        assert src.kind is inspect.Parameter.KEYWORD_ONLY and src.default is src.empty, src


async def test_insider_pushing_first_is_refused(nats_server: Any) -> None:
    """An insider that knows a request id pushes its own KV to the decode before the real
    prefill does: refused (forbidden), and the prefill's push then lands exactly."""
    lay = small_layout(layers=4)
    async with pair(nats_server, "ins", lay) as (p, d), \
            attacker(plan(nats_server, lay, "insider_push", d.instance_id, "r-ins",
                          blocks=[1, 2], insider_id="mal-ins"), sees=[d]) as mal:
        before = d.statistics().forbidden_requests
        rx = reserve(d, "r-ins", [5, 6], p.instance_id)
        mal.go()
        insider = await mal.next("report")
        assert insider["status"] == "refused" and "forbidden" in insider["reason"].lower(), \
            f"the insider's push was taken: {insider}"
        tx = await p.push("r-ins", d.instance_id, [1, 2])
        tx.all_ready()
        with anyio.fail_after(10):
            res, sres = await rx.result(), await tx.result()
        ok(res, sres)
        assert same(p, d, [1, 2], [5, 6]), "the decode holds other bytes than the prefill's"
        assert d.statistics().forbidden_requests > before
        await still_works(p, d, "ins")


# == B: the offer's secret sniffed off renewals ===========================================

async def test_sniffed_renewal_secret_does_not_pull_the_offer(nats_server: Any) -> None:
    """The decode keeps an offer (renewals every quarter of a short lease) and pulls it
    later; a sniffer reads every Renew, Pull and Abort for the offer's secret and an
    insider pulls with what it found. The insider gets nothing; the real pull is exact."""
    lay = small_layout(layers=4)
    async with pair(nats_server, "rnw", lay) as (p, d), \
            attacker(plan(nats_server, lay, "renew_sniffer", p.instance_id, "r-rnw",
                          blocks=[3, 4], insider_id="mal-rnw"), sees=[p]) as mal:
        before = p.statistics().forbidden_requests
        held = p.offer("r-rnw", [1, 2], lease_s=1.0)
        held.all_ready()
        await d.keep("r-rnw", p.instance_id, secret=held.secret)
        stolen = await mal.next("report")
        assert stolen["requests"] >= 1, f"the sniffer saw no renewal: {stolen}"
        assert stolen["status"] != "completed" and not stolen["got"], \
            f"the insider pulled the offer with a sniffed secret: {stolen}"
        assert not held.done
        rx = await d.pull("r-rnw", p.instance_id, [7, 8], secret=held.secret)
        with anyio.fail_after(10):
            res, sres = await rx.result(), await held.result()
        ok(res, sres)
        assert same(p, d, [1, 2], [7, 8])
        assert p.statistics().forbidden_requests > before  # the insider's pull, refused
        await still_works(p, d, "rnw")


# == C: the Accept sniffed, layer data injected on each path ==============================

PATHS = {  # how the pair is configured for each data-plane path
    "ucx": {"shared": False, "kw": {"paths": ("ucx",)}},
    "tcp": {"shared": False, "kw": {"paths": ("tcp", "ucx")}, "hosts": True},
    "shm": {"shared": True, "kw": {"paths": ("shm", "ucx")}},
}


def _blocks(t: torch.Tensor, lay: KVLayout) -> torch.Tensor:
    return t.transpose(0, 1) if lay.chunks_per_block == 2 else t


def _leak(d: Agent, rid: str, path: Path) -> None:
    """Write the decode's live receive's tag and addresses where the attacker reads them."""
    entry = d._core.book.receiving[rid]
    path.write_bytes(msgspec.msgpack.encode({
        "dst_tag": entry.runner.dst_tag, "dst_address": d._core.transport.address,
        "dst_tcp": d._core.paths.tcp_address}))


@pytest.mark.parametrize("leak", [False, True], ids=["sniffed", "leaked"])
@pytest.mark.parametrize("path", sorted(PATHS))
async def test_sniffed_accept_injects_nothing_that_lands(nats_server: Any, path: str,
                                                        leak: bool, tmp_path: Path) -> None:
    """During a push the sniffer reads the decode's Accept (its tag, worker and TCP
    addresses) and injects every layer before the prefill has computed it: forged data
    (UCX, TCP) or forged "layer ready" headers (shm: the decode would read the prefill's
    memory before it holds the layer). The decode ends with the prefill's bytes or fails
    cleanly; it never completes with other bytes. ``leaked``: the test hands the attacker
    the live tag and addresses (the Accept is boxed, so a sniffer cannot read them): the
    frame MACs (UCX, shm) and the TCP handshake refuse the injection on their own."""
    lay = small_layout(layers=4)
    how = PATHS[path]
    p_kw, d_kw = dict(how["kw"]), dict(how["kw"])
    if how.get("hosts"):
        p_kw["host_id"], d_kw["host_id"] = "host-p", "host-d"
    src, dst = [3, 1], [6, 2]  # not runs: one message per layer on UCX and TCP alike
    leak_file = tmp_path / "accept.msgpack" if leak else None
    async with pair(nats_server, f"inj-{path}-{int(leak)}", lay, shared=bool(how["shared"]),
                    p_kw=p_kw, d_kw=d_kw) as (p, d), \
            attacker(plan(nats_server, lay, "data_injector", d.instance_id, f"r-{path}",
                          path=path, nblocks=len(src),
                          leak_file=str(leak_file or ""))) as mal:
        assert p.memory is not None
        kv = p.memory.layers
        truth = [_blocks(t, lay)[src].clone() for t in kv]
        for t in kv:  # not computed yet
            _blocks(t, lay)[src] = 0
        rx = reserve(d, f"r-{path}", dst, p.instance_id)
        tcp = d._core.paths.tcp
        if leak_file is not None:
            forged_before = d.statistics().forged_frames
            strangers_before = tcp.statistics().unauthenticated if tcp is not None else 0
        tx = await p.push(f"r-{path}", d.instance_id, src)
        if leak_file is not None:
            _leak(d, f"r-{path}", leak_file)
            mal.go()
        sniffed = await mal.next("report")  # the attacker saw the answer and did its worst
        for layer in range(lay.num_layers):  # now the prefill computes each layer
            for i in range(lay.tensors_per_layer):
                j = layer + i * lay.num_layers
                _blocks(kv[j], lay)[src] = truth[j]
            tx.layer_ready(layer)
        with anyio.fail_after(15):
            res = await rx.result()
            await tx.result()
        assert sniffed["answers"] >= 1, f"the sniffer missed the Accept: {sniffed}"
        if res.ok:
            assert same(p, d, src, dst), \
                f"completed with forged bytes ({path}): the sniffer {sniffed}"
            assert res.path.startswith(path), res  # the path under attack was taken
        else:
            assert res.status.value in ("failed", "aborted"), res
        if leak_file is not None and path == "tcp":  # refused at the handshake
            assert tcp is not None  # the attacker's bytes were read as a failed hello
            with anyio.fail_after(5):
                while tcp.statistics().unauthenticated == strangers_before:
                    await anyio.sleep(0.02)
        elif leak_file is not None:  # the forged headers reached the decode and failed
            assert sniffed.get("injected", 0) > 0, sniffed
            with anyio.fail_after(5):
                while d.statistics().forged_frames == forged_before:
                    await anyio.sleep(0.02)
        await still_works(p, d, f"inj-{path}")


# == D: forged Rejects on the manifest's reply subject ====================================

async def test_forged_reject_on_the_reply_subject_is_waited_past(nats_server: Any) -> None:
    """The sniffer answers each manifest to the decode on its reply subject at once with a
    Reject, unsigned and signed by an insider: the prefill waits for the decode's own
    answer, and every push lands. (Several pushes: the forger races the decode's answer,
    and one win is enough to end a push that believes the first answer.)"""
    lay = small_layout(layers=4)
    pushes = 4
    async with pair(nats_server, "rej", lay) as (p, d), \
            attacker(plan(nats_server, lay, "reject_forger", d.instance_id, "r-rej",
                          insider_id="mal-rej"), sees=[p, d]) as mal:
        before = p.statistics().unauthenticated_messages
        for i in range(pushes):
            rx = reserve(d, f"r-rej-{i}", [5 + i, 13 - i], p.instance_id)
            try:
                tx = await p.push(f"r-rej-{i}", d.instance_id, [1 + i, 2 + i])
            except KVStreamError as exc:
                pytest.fail(f"a forged Reject ended push {i}: {type(exc).__name__}: {exc}")
            tx.all_ready()
            with anyio.fail_after(10):
                res, sres = await rx.result(), await tx.result()
            ok(res, sres)
            assert same(p, d, [1 + i, 2 + i], [5 + i, 13 - i])
        mal.stop()
        forged = await mal.next("report")
        assert forged.get("forged", 0) >= 2 * pushes, f"the sniffer forged too little: {forged}"
        # Dropped unread by the prefill (not the decode's, or not signed); counted when it
        # came while the push still waited (one that comes after the answer is not).
        assert p.statistics().unauthenticated_messages > before
        await still_works(p, d, "rej")
