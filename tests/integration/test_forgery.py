"""A third client on the same NATS server forges control messages about a live pair's
transfers: each forgery is refused and counted, the honest transfer is untouched.

The attacker knows what logs and traces show (instance ids, request and transfer ids),
but not the pair's signing keys nor the offer's secret. Real nats-server, real UCX.
"""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch

from kvstream import ForbiddenError
from kvstream.control import messages as m
from kvstream.control.bus import ControlBus
from kvstream.control.identity import Identity
from kvstream.control.subjects import Subjects
from tests.fakes import small_layout
from tests.integration.agents import LAYERED, agent_pair, assert_at_rest, settle

pytestmark = pytest.mark.anyio


def same(p, d, pairs, layers) -> bool:
    return all(torch.equal(p.memory.read_block(layer, a), d.memory.read_block(layer, b))
               for layer in layers for a, b in pairs)


async def attacker(nats_server, name: str | None):
    """A raw bus; signed as ``name`` (its own key) or, with None, not signed at all."""
    bus = await ControlBus.connect(nats_server.url, name="mallory")
    if name is not None:
        bus.seal.identity = Identity(name)
    return bus


async def ask(bus: ControlBus, subject: str, msg: m.ControlMessage) -> m.ControlUnion:
    return await bus.request(subject, msg, timeout=2.0)


async def test_forged_requests_about_a_live_pull_are_refused_and_counted(nats_server):
    lay = small_layout(layers=4)
    subjects = Subjects("default")
    async with agent_pair(nats_server, "p-fg", "d-fg", lay, 16, p_kw=LAYERED) as (p, d):
        held = p.offer("r", [1, 2], lease_s=5.0)
        held.layer_ready(0)  # the rest stays back: the pull is live while we forge
        unsigned, mallory = await attacker(nats_server, None), await attacker(nats_server, "mal")
        # Mallory signs with her own key but claims to be d: d's key is bound already.
        impostor = await attacker(nats_server, "d-fg")
        try:
            to_p = subjects.control("p-fg")
            pull = m.Pull(request_id="r", src="p-fg", dst="mal", dst_address=d.worker_address,
                          dst_tag=5, fingerprint=lay.fingerprint, num_layers=lay.num_layers,
                          dst_blocks=[3, 4])
            # 1. a pull without the offer's secret, signed as herself: forbidden
            reply = await ask(mallory, to_p, pull)
            assert isinstance(reply, m.Reject) and reply.code == "forbidden", reply
            # 2. the same unsigned, and signed with a key that is not d's: unauthenticated
            for bus, who in ((unsigned, "mal"), (impostor, "d-fg")):
                reply = await ask(bus, to_p, msgspec.structs.replace(pull, dst=who))
                assert isinstance(reply, m.Reject) and reply.code == "unauthenticated", reply
            # 3. a renewal without the secret: answered "unknown", the lease not extended
            until = p._core.book.offers["r"].lease_until
            reply = await ask(mallory, to_p, m.Renew(by="mal", request_ids=["r"]))
            assert isinstance(reply, m.RenewAck) and reply.unknown == ["r"]
            assert p._core.book.offers["r"].lease_until == until
            # 4. an abort of the offer by request id, without the secret: nothing ends
            reply = await ask(mallory, to_p, m.Abort(transfer_id="", request_id="r",
                                                     reason="x", by="mal"))
            assert not held.transfer.terminal

            # The honest pull, with the secret, while the source still computes.
            rx = await d.pull("r", "p-fg", [3, 4], secret=held.secret)
            tid = rx.transfer.transfer_id
            with anyio.fail_after(10):
                await rx.wait_layer(0)
            # 5. abort, done and a second manifest for the running transfer, by a third
            # party (signed as herself), or claiming to be the peer (unsigned / wrong key)
            to_d = subjects.control("d-fg")
            abort = m.Abort(transfer_id=tid, request_id="r", reason="forged", by="mal")
            done = m.Done(transfer_id=tid, request_id="r", status="completed")
            for bus, target, msg in (
                    (mallory, to_d, abort), (mallory, to_p, abort), (mallory, to_p, done),
                    (unsigned, to_d, msgspec.structs.replace(abort, by="p-fg")),
                    (impostor, to_p, msgspec.structs.replace(abort, by="d-fg"))):
                reply = await ask(bus, target, msg)
                assert isinstance(reply, m.Reject), reply
            await mallory.publish(to_d, done)  # Done is published, not requested
            # 6. a forged leave of d (signed by a key that is not d's): d stays alive for p
            await impostor.publish(subjects.registry("d-fg"), m.Leave(instance_id="d-fg"))
            await unsigned.publish(subjects.registry("p-fg"), m.Leave(instance_id="p-fg"))
            await mallory.flush()
            await impostor.flush()
            await unsigned.flush()
            await anyio.sleep(0.3)
            assert p.registry.alive("d-fg") and d.registry.alive("p-fg")
            assert not rx.transfer.terminal and not held.transfer.terminal

            held.all_ready()
            with anyio.fail_after(10):
                await rx.wait()
                assert (await held.wait()).ok
            assert same(p, d, [(1, 3), (2, 4)], range(lay.num_layers))
            await settle(p, d)
            assert_at_rest(p, d)
            sp, sd = p.statistics(), d.statistics()
            # p: the pull, renewal, abort by request id, abort and done by mal (5); d: abort
            assert sp.forbidden_requests >= 5 and sd.forbidden_requests >= 1, (sp, sd)
            # p: two pulls and one abort unsigned or with d's name on another key, a leave
            assert sp.unauthenticated_messages >= 3 and sd.unauthenticated_messages >= 2, (sp, sd)
            assert sp.completed == sd.completed == 1 and sp.aborted == sd.aborted == 0
        finally:
            for bus in (unsigned, mallory, impostor):
                await bus.close()


async def test_a_pull_needs_the_secret_and_a_wrong_one_leaves_the_offer(nats_server):
    lay = small_layout(layers=3)
    async with agent_pair(nats_server, "p-sec", "d-sec", lay, 8) as (p, d):
        held = p.offer("r", [1], lease_s=5.0)
        held.all_ready()
        for wrong in ("", "x" * 22):
            with pytest.raises(ForbiddenError, match="secret"):
                await d.pull("r", "p-sec", [2], secret=wrong)
        assert not held.transfer.terminal
        rx = await d.pull("r", "p-sec", [2], secret=held.secret)
        with anyio.fail_after(10):
            await rx.wait()
        assert same(p, d, [(1, 2)], range(lay.num_layers))
        await settle(p, d)
        assert_at_rest(p, d)
        assert p.statistics().forbidden_requests >= 2  # (and any renewal under a wrong one)


async def test_a_manifest_naming_a_live_peers_address_cannot_break_that_pair(nats_server):
    """A forger that names p's worker address in its own manifest: the push it offers never
    completes, and when it is declared dead p's endpoint (shared by the honest pair)
    survives: the next transfer works. Malformed addresses are refused before UCX."""
    lay = small_layout(layers=2)
    subjects = Subjects("default")
    async with agent_pair(nats_server, "p-ad", "d-ad", lay, 8,
                          d_kw={"transfer_timeout_s": 1.5}) as (p, d):
        mallory = await attacker(nats_server, "mal-ad")
        try:
            manifest = m.Manifest(
                transfer_id="t" * 32, request_id="forged", src="mal-ad", dst="d-ad",
                src_address=p.worker_address, src_tag=77, fingerprint=lay.fingerprint,
                num_layers=lay.num_layers, src_blocks=[1], deadline_s=1.0)
            reply = await ask(mallory, subjects.control("d-ad"), manifest)
            assert isinstance(reply, m.Accept | m.Reject), reply
            # Malformed addresses (they abort a process inside UCX) never reach UCX.
            addr = p.worker_address
            for i, bad in enumerate((bytes([addr[0] ^ 0xFF]) + addr[1:], b"\xff" * len(addr),
                                     addr[:len(addr) // 2], b"")):
                reply = await ask(mallory, subjects.control("d-ad"), msgspec.structs.replace(
                    manifest, transfer_id=f"{i:032x}", request_id=f"bad-{i}", src_address=bad))
                assert isinstance(reply, m.Reject) and reply.code == "malformed", reply
            with anyio.fail_after(15):
                await settle(d)  # the forged push ends by its deadline, nothing lands
            rx = d.expect("honest", [3], src=p.instance_id)
            tx = await p.push("honest", "d-ad", [1])
            tx.all_ready()
            with anyio.fail_after(10):
                await rx.wait()
                assert (await tx.wait()).ok
            assert same(p, d, [(1, 3)], range(lay.num_layers))
        finally:
            await mallory.close()


async def test_a_manifest_flood_from_one_source_leaves_staging_for_the_others(nats_server):
    """Pushes nobody reserved for are staged; one source (here a signed third party that
    floods manifests) may hold at most its sender's share of the pool (its first push may be
    larger), so an honest push still lands."""
    lay = small_layout(layers=2)
    subjects = Subjects("default")
    async with agent_pair(nats_server, "p-fl", "d-fl", lay, 8,
                          d_kw={"staging_bytes": 16 << 10, "reservation_timeout_s": 2.0}) as (p, d):
        mallory = await attacker(nats_server, "mal-fl")
        try:
            answers = []
            for i in range(20):
                answers.append(await ask(mallory, subjects.control("d-fl"), m.Manifest(
                    transfer_id=f"{i:032x}", request_id=f"flood-{i}", src="mal-fl", dst="d-fl",
                    src_address=p.worker_address, src_tag=1000 + i,
                    fingerprint=lay.fingerprint, num_layers=lay.num_layers, src_blocks=[1],
                    deadline_s=2.0)))
            staged = sum(isinstance(a, m.Accept) for a in answers)
            busy = sum(isinstance(a, m.Reject) and a.code == "busy" for a in answers)
            assert staged >= 1 and staged + busy == 20 and busy >= 10, answers
            assert d.staging.in_use <= d.staging.max_bytes // 2 + 4096 + 2 * 512
            # The honest push, unreserved: staged in what is left, claimed, verified.
            tx = await p.push("honest", "d-fl", [2])
            tx.all_ready()
            rx = d.expect("honest", [5], src=p.instance_id)
            with anyio.fail_after(10):
                await rx.wait()
                assert (await tx.wait()).ok
            assert same(p, d, [(2, 5)], range(lay.num_layers))
            with anyio.fail_after(15):
                await settle(d)
                while d.statistics().staged_transfers:
                    await anyio.sleep(0.1)
            assert_at_rest(d)
        finally:
            await mallory.close()
