"""Randomized lifecycles: thousands of seeded operations, then nothing may be outstanding.

Operations: reserve, push (reserved or staged), offer, keep, pull (eager or lazy), layer
ready, fetch, abort from either side, lease release, waiting out leases, and a source
process killed mid-way. Every transfer must reach exactly one terminal state, and both
agents' ``statistics()`` must show nothing held.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from typing import Any

import anyio
import msgspec
import pytest

from kvstream import ConfigError, KVStreamError
from kvstream.transfer import Side, Transfer
from tests.fakes import small_layout
from tests.integration.agents import agent_pair, assert_at_rest, settle
from tests.integration.peers import offer_secret, random_source_peer

pytestmark = pytest.mark.anyio

NBLOCKS = 64


@pytest.fixture
def audit(monkeypatch):
    """Every Transfer made during the test, and how many times each entered a terminal state."""
    made: list[Transfer] = []
    ends: dict[int, int] = {}
    init, finish = Transfer.__init__, Transfer.finish

    def _init(self, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        made.append(self)

    def _finish(self, *a: Any, **kw: Any) -> bool:
        first = finish(self, *a, **kw)
        if first:
            ends[id(self)] = ends.get(id(self), 0) + 1
        return first

    monkeypatch.setattr(Transfer, "__init__", _init)
    monkeypatch.setattr(Transfer, "finish", _finish)
    return made, ends


def _ended(agent) -> int:
    s = agent.statistics()
    return s.completed + s.failed + s.aborted + s.timed_out + s.expired


class Random:
    """One side's random operations against live handles."""

    def __init__(self, rng: random.Random, layers: int) -> None:
        self.rng = rng
        self.layers = layers
        self.sends: list[Any] = []
        self.recvs: list[Any] = []
        self.leases: list[Any] = []
        self.expected_errors = 0

    def blocks(self, n: int) -> list[int]:
        return self.rng.sample(range(NBLOCKS), n)

    def live(self, pool: list[Any]) -> Any | None:
        alive = [h for h in pool if not getattr(h, "done", False)]
        return self.rng.choice(alive) if alive else None


async def _op(r: Random, p, d, n: int) -> None:
    rng = r.rng
    rid = f"q{n}"
    nb = rng.randint(1, 4)
    op = rng.choices(
        ["push", "push_staged", "offer", "keep", "pull", "ready", "all_ready", "fetch",
         "abort_send", "abort_recv", "release", "expect_staged", "sleep"],
        weights=[8, 3, 8, 3, 8, 20, 6, 6, 4, 4, 2, 3, 2])[0]
    mode = rng.choice(["pipelined", "eager"])
    match op:
        case "push":
            r.recvs.append(d.expect(rid, r.blocks(nb), src=p.instance_id))
            r.sends.append(await p.push(rid, d.instance_id, r.blocks(nb), mode=mode))
        case "push_staged":
            r.sends.append(await p.push(rid, d.instance_id, r.blocks(nb), mode=mode))
            r.staged.append((rid, nb))
        case "expect_staged" if r.staged:
            srid, snb = r.staged.pop(rng.randrange(len(r.staged)))
            r.recvs.append(d.expect(srid, r.blocks(snb), src=p.instance_id))
        case "offer":
            held = p.offer(rid, r.blocks(nb), mode=mode, lease_s=rng.choice([0.3, 1.0, 5.0]))
            r.sends.append(held)
            r.offered.append((rid, nb, held.secret))
        case "keep" if r.offered:
            orid, _, secret = rng.choice(r.offered)
            r.leases.append(await d.keep(orid, p.instance_id, secret=secret))
        case "pull" if r.offered:
            orid, onb, secret = r.offered.pop(rng.randrange(len(r.offered)))
            r.recvs.append(await d.pull(orid, p.instance_id, r.blocks(onb),
                                        mode=rng.choice(["eager", "lazy"]), secret=secret))
        case "ready" if (h := r.live(r.sends)) is not None:
            h.layer_ready(rng.randrange(r.layers))
        case "all_ready" if (h := r.live(r.sends)) is not None:
            h.all_ready()
        case "fetch" if (h := r.live(r.recvs)) is not None and h.lazy:
            h.fetch(rng.randrange(r.layers))
        case "abort_send" if (h := r.live(r.sends)) is not None:
            await h.abort("random abort (source)")
        case "abort_recv" if (h := r.live(r.recvs)) is not None:
            await h.abort("random abort (destination)")
        case "release" if r.leases:
            await r.leases.pop(rng.randrange(len(r.leases))).release()
        case "sleep":
            await anyio.sleep(rng.choice([0.0, 0.01, 0.05]))


async def test_random_lifecycle_in_process(nats_server, audit):
    made, ends = audit
    lay = small_layout(layers=4)
    rng = random.Random(20261129)
    r = Random(rng, lay.num_layers)
    r.staged, r.offered = [], []  # type: ignore[attr-defined]
    kw = dict(lease_s=1.0, reservation_timeout_s=2.0, transfer_timeout_s=8.0,
              staging_bytes=1 << 20, staging_wait_s=0.2)
    async with agent_pair(nats_server, "p-rand", "d-rand", lay, NBLOCKS, p_kw=kw,
                          d_kw=kw) as (p, d):
        errors = 0
        for n in range(3000):
            try:
                with anyio.fail_after(10):
                    await _op(r, p, d, n)
            except (KVStreamError, ConfigError):
                errors += 1  # refused cleanly (a lease gone, busy, a pool full): allowed
            if n % 50 == 0:
                await anyio.sleep(0)
        # Wind down: finish or abort what is left, drop the leases, wait it all out.
        for h in r.sends:
            if not h.done:
                h.all_ready() if rng.random() < 0.5 else await h.abort("wind down")
        for h in r.recvs:
            if not h.done and h.lazy:
                h.fetch(lay.num_layers - 1)
        for lease in r.leases:
            await lease.release()
        with anyio.fail_after(30):
            for h in (*r.sends, *r.recvs):
                await h.result()
            while p.statistics().held_active or d.statistics().staged_transfers:
                await anyio.sleep(0.05)
        await settle(p, d, timeout=15)
        assert_at_rest(p, d)
        # Exactly one terminal state per transfer, each counted once on its own side.
        assert made and all(t.terminal for t in made)
        assert all(ends.get(id(t)) == 1 for t in made)
        assert _ended(p) == sum(t.side is Side.SEND for t in made)
        assert _ended(d) == sum(t.side is Side.RECV for t in made)
        assert p.statistics().completed > 100 and errors < 1500  # the mix really ran
        statuses = {t.state.value for t in made}
        assert {"completed", "aborted", "expired"} <= statuses, statuses


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_lifecycle_with_a_killed_source(nats_server, seed):
    """A source process runs its own random pushes and offers; it is killed mid-way."""
    lay = small_layout(layers=4)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=random_source_peer,
                       args=(msgspec.msgpack.encode(lay), nats_server.url, f"d-kill{seed}",
                             seed, q), daemon=True)
    proc.start()
    rng = random.Random(seed)
    handles: list[Any] = []
    try:
        async with agent_pair(nats_server, f"p-kill{seed}", f"d-kill{seed}", lay, NBLOCKS,
                              d_kw=dict(reservation_timeout_s=1.5, lease_s=1.0)) as (_p, d):
            assert await anyio.to_thread.run_sync(q.get, True, 60) == "up"
            kill_at = rng.randint(150, 400)
            for n in range(600):
                if n == kill_at:
                    proc.kill()
                rid = f"k{rng.randrange(n + 1)}"
                try:
                    with anyio.fail_after(5):
                        if rng.random() < 0.5:
                            handles.append(d.expect(rid, rng.sample(range(NBLOCKS), 2),
                                                    src="peer-random"))
                        elif rng.random() < 0.5:
                            handles.append(await d.pull(rid, "peer-random", rng.sample(
                                range(NBLOCKS), 2), mode=rng.choice(["eager", "lazy"]),
                                secret=offer_secret(rid)))
                        elif handles:
                            h = rng.choice(handles)
                            if not h.done:
                                await h.abort("random")
                except (KVStreamError, ConfigError):
                    pass
                await anyio.sleep(0.005)
            for h in handles:
                if h.lazy and not h.done:
                    h.fetch(lay.num_layers - 1)
            with anyio.fail_after(30):
                for h in handles:
                    await h.result()  # every one ends: completed, or failed with the peer
                while d.statistics().staged_transfers:
                    await anyio.sleep(0.05)
            await settle(d, timeout=15)
            assert_at_rest(d)
            assert not d.statistics().peers_alive or "peer-random" not in {
                a.instance_id for a in d.peers()}
    finally:
        proc.kill()
        proc.join(5)
