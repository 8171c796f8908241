"""Who may do what to an agent, on the in-memory seams: a third party with a valid key of
its own (any signer) cannot fill a reservation expected from someone else, squat another
instance's id, announce under another id, or tie up the agent with aborts it may not make.
(These were found by review as working attacks; each test is the attack, now refused.)"""

from __future__ import annotations

import contextlib

import anyio
import pytest
import torch

from kvstream import Agent, ForbiddenError
from kvstream.control import messages as m
from kvstream.control.identity import Identity
from kvstream.control.subjects import Subjects
from kvstream.dataplane.loopback import LoopbackTransport
from tests.fakes import cache, small_layout
from tests.unit.test_engine_loopback import NBLOCKS, _cfg, _meet, _pair, _same

pytestmark = pytest.mark.anyio


async def test_a_reservation_expected_from_one_source_takes_no_other_push():
    async with _pair() as (p, d, fabric):
        lay = small_layout(layers=4)
        evil_kv = cache(lay, NBLOCKS, fill=True)
        for layer in evil_kv:
            layer.fill_(7.0)
        evil = Agent(_cfg("evil"), layout=lay, kv_caches=evil_kv,
                     control=await d._core.control.hub.connect("evil"),  # type: ignore[attr-defined]
                     transport=LoopbackTransport(fabric))
        async with evil:
            await _meet(p, d, evil)
            rx = d.expect("r", [3, 4], src="p")
            with pytest.raises(ForbiddenError, match="expected from p"):
                await evil.push("r", "d", [0, 1], mode="eager")
            tx = await p.push("r", "d", [0, 1], mode="eager")
            tx.all_ready()
            with anyio.fail_after(5):
                got = await rx.wait()
            assert got.ok and got.peer == "p" and _same(p, d, [0, 1], [3, 4])
            # A push staged before the reservation, by another source than expected, is
            # dropped when the engine expects the request from its real source.
            stx = await evil.push("s", "d", [2], mode="eager")
            stx.all_ready()
            with anyio.fail_after(5):
                while not d.statistics().staged_transfers:
                    await anyio.sleep(0.01)
            rx = d.expect("s", [5], src="p")
            assert not torch.any(d.memory.layers[0][:, 5] == 7.0)  # type: ignore[union-attr]
            tx = await p.push("s", "d", [2], mode="eager")
            tx.all_ready()
            with anyio.fail_after(5):
                assert (await rx.wait()).ok and _same(p, d, [2], [5])
            assert d.statistics().forbidden_requests >= 2


async def test_a_manifest_or_pull_for_another_instance_is_refused():
    async with _pair() as (p, d, _fabric):
        bus = await d._core.control.hub.connect("evil")  # type: ignore[attr-defined]
        bus.seal.identity = Identity("evil")
        lay = small_layout(layers=4)
        manifest = m.Manifest(transfer_id="t" * 32, request_id="r", src="evil", dst="someone",
                              src_address=p.worker_address, src_tag=1,
                              fingerprint=lay.fingerprint, num_layers=4, src_blocks=[1])
        reply = await bus.request(Subjects("default").control("d"), manifest, timeout=1.0)
        assert isinstance(reply, m.Reject) and reply.code == "forbidden"
        offer = p.offer("r", [1])
        pull = m.Pull(request_id="r", src="other", dst="evil", dst_address=d.worker_address,
                      dst_tag=1, fingerprint=lay.fingerprint, num_layers=4, dst_blocks=[2],
                      secret=offer.secret)
        reply = await bus.request(Subjects("default").control("p"), pull, timeout=1.0)
        assert isinstance(reply, m.Reject) and reply.code == "forbidden"


async def test_a_squatter_of_an_unannounced_id_loses_it_to_the_real_instance():
    """A third party binds "p2" (its own key) before p2 starts and keeps it warm with empty
    renewals; the real p2's announcement, on its own registry subject, takes the id."""
    async with _pair() as (_p, d, fabric):
        hub = d._core.control.hub  # type: ignore[attr-defined]
        squat = await hub.connect("squatter")
        squat.seal.identity = Identity("p2")

        async def keep_warm() -> None:
            while True:
                with contextlib.suppress(Exception):  # refused once the real one holds it
                    await squat.request(Subjects("default").control("d"),
                                        m.Renew(by="p2", request_ids=[]), timeout=0.5)
                await anyio.sleep(0.1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_warm)
            await anyio.sleep(0.3)
            lay = small_layout(layers=4)
            p2 = Agent(_cfg("p2"), layout=lay, kv_caches=cache(lay, NBLOCKS, fill=True),
                       control=await hub.connect("p2"), transport=LoopbackTransport(fabric))
            async with p2:
                await _meet(d, p2)
                offer = p2.offer("r", [0])
                offer.all_ready()
                rx = await d.pull("r", "p2", [1], secret=offer.secret)
                with anyio.fail_after(5):
                    assert (await rx.wait()).ok
                assert _same(p2, d, [0], [1])
            tg.cancel_scope.cancel()


async def test_an_announcement_counts_only_on_the_announcers_own_registry_subject():
    async with _pair() as (_p, d, _fabric):
        bus = await d._core.control.hub.connect("evil")  # type: ignore[attr-defined]
        bus.seal.identity = Identity("prefill-9")
        ann = m.Announce(instance_id="prefill-9", role="prefill", worker_address=b"loopback-x",
                         endpoint="http://attacker:8000")
        before = d.statistics().forbidden_requests
        await bus.publish(Subjects("default").registry("evil"), ann)  # its subject is "evil"
        await anyio.sleep(0.1)
        assert "prefill-9" not in [a.instance_id for a in d.peers()]
        assert d.statistics().forbidden_requests == before + 1


async def test_aborts_without_the_secret_answer_at_once_and_starve_nobody():
    """Aborts of a served offer by parties who may not end it are refused at once (they
    used to wait for the stream to go quiet, holding the agent's in-flight room). The
    source's request_timeout_s is 30 s, the wait a regression would bring back; the lazy
    stream never goes quiet before the fetch below; 10 s leaves a loaded machine room."""
    async with _pair(p_kw={"request_timeout_s": 30.0}) as (p, d, _fabric):
        hub = p._core.control.hub  # type: ignore[attr-defined]
        offer = p.offer("r", [1, 2, 3, 4])
        offer.all_ready()
        rx = await d.pull("r", "p", [5, 6, 7, 8], secret=offer.secret, mode="lazy",
                          lookahead=0)
        buses = []
        for i in range(4):
            bus = await hub.connect(f"evil{i}")
            bus.seal.identity = Identity(f"evil{i}")
            buses.append(bus)

        async def abort(bus, i: int) -> None:
            with anyio.fail_after(10):  # under the source's 30 s: no wait for quiescence
                reply = await bus.request(Subjects("default").control("p"), m.Abort(
                    transfer_id="", request_id="r", reason="x", by=f"evil{i}"), timeout=20.0)
            assert isinstance(reply, m.AbortAck)

        offer2 = p.offer("r2", [9])
        offer2.all_ready()
        async with anyio.create_task_group() as tg:
            for i, bus in enumerate(buses):
                for _ in range(32):
                    tg.start_soon(abort, bus, i)
            rx2 = await d.pull("r2", "p", [10], secret=offer2.secret)
        with anyio.fail_after(5):
            assert (await rx2.wait()).ok
            rx.fetch(3)
            assert (await rx.wait()).ok
        assert _same(p, d, [1, 2, 3, 4], [5, 6, 7, 8])
