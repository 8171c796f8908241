"""A flood of pushes nobody reserved for, from identities anyone can mint, on a real
nats-server with UCX between the agents: the flood gets its bounded share and no more, and
a push to a reservation and a pull between two honest agents still land at once.

Each flooder is a real Agent in this process with its own key and instance id (announced,
so alive), pushing whole requests to the decode agent before any reservation exists.
"""

from __future__ import annotations

import contextlib

import anyio
import pytest
import torch

from kvstream import Agent, TransferError
from kvstream.engine.book import Held
from tests.fakes import cache, small_layout
from tests.integration.agents import LAYERED, agent_pair, cfg, meet

pytest.importorskip("ucxx")

pytestmark = pytest.mark.anyio

FLOODERS = 6
LAY = small_layout(layers=4)
RUN = [0, 1, 2, 3]  # each flooder's push: one run of blocks, staged whole at the decode side
# UCX only: a same-host path would read the source's memory and never stage honest traffic.
# The flooders stream layer by layer (LAYERED): each push is exactly its blocks' bytes.
PATHS = {"paths": ("ucx",)}


def _same(p: Agent, d: Agent, src: list[int], dst: list[int]) -> bool:
    assert p.memory is not None and d.memory is not None
    return all(torch.equal(p.memory.read_block(layer, a), d.memory.read_block(layer, b))
               for layer in range(LAY.num_layers) for a, b in zip(src, dst, strict=True))


async def test_a_minted_identity_flood_does_not_stop_an_honest_push_or_pull(nats_server):
    push_bytes = LAY.num_layers * len(RUN) * LAY.block_bytes
    # Shares (AgentConfig defaults): all unsolicited pushes 1/2 of the pool, one sender
    # 1/8 (one flooder push), so the flood holds at most 4 pushes' worth.
    pool = 8 * push_bytes
    d_kw = {"staging_bytes": pool, "max_transfers": 16, **PATHS}
    async with agent_pair(nats_server, "p-honest", "d-honest", LAY, 16, p_kw=PATHS,
                          d_kw=d_kw) as (p, d), contextlib.AsyncExitStack() as stack:
        flooders = [await stack.enter_async_context(Agent(
            cfg(f"mint-{i}", nats_server, staging_wait_s=0.2, **PATHS, **LAYERED), layout=LAY,
            kv_caches=cache(LAY, 8, fill=True))) for i in range(FLOODERS)]
        await meet(p, d, *flooders)
        staged, refused = 0, 0
        for attempt in range(2):  # each flooder twice: its second is beyond its own share
            for i, mint in enumerate(flooders):
                try:
                    tx = await mint.push(f"flood-{i}-{attempt}", "d-honest", RUN, mode="eager")
                except TransferError as exc:
                    assert "busy" in str(exc)
                    refused += 1
                    continue
                tx.all_ready()
                with anyio.fail_after(20):  # a staged push is done once it is all staged
                    assert (await tx.wait()).ok
                staged += 1
        limit = pool // 2
        book = d._core.book
        assert staged == limit // push_bytes and refused == 2 * FLOODERS - staged
        assert book.unsolicited() == Held(staged, limit) and d.staging.in_use == limit
        assert all(book.unsolicited(f.instance_id).nbytes <= push_bytes for f in flooders)
        # Counted per answer "busy" (a refused sender retries for its staging_wait_s).
        stats = d.statistics()
        assert stats.refused_unsolicited >= refused
        assert stats.refused_unsolicited_sender >= staged  # their second pushes
        # The honest pair: a push to a reservation and a pull, both through staging
        # (scattered blocks), well inside the flood's reservation_timeout_s (60 s): they
        # take the half of the pool the flood cannot.
        rx = d.expect("reserved", [1, 5, 9], src="p-honest")
        tx = await p.push("reserved", "d-honest", [2, 6, 10], mode="eager")
        tx.all_ready()
        offer = p.offer("pulled", [0, 3, 7])
        offer.all_ready()
        with anyio.fail_after(30):
            assert (await rx.wait()).ok and (await tx.wait()).ok
            pulled = await d.pull("pulled", "p-honest", [4, 11, 14], secret=offer.secret)
            assert (await pulled.wait()).ok
        assert _same(p, d, [2, 6, 10], [1, 5, 9]) and _same(p, d, [0, 3, 7], [4, 11, 14])
        assert d.staging.peak > limit  # through staging, beside the flood ...
        assert book.unsolicited() == Held(staged, limit)  # ... which still held its share
