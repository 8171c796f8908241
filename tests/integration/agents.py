"""Two in-process agents on a real nats-server (UCX between them is real too)."""

from __future__ import annotations

import contextlib

import anyio

from kvstream import Agent, AgentConfig
from tests.fakes import cache

# A sender's config that streams layer by layer however short the transfer (the default
# sends a short one as a single frame): for tests that act between two layers.
LAYERED = {"whole_frame_bytes": 0}


def cfg(instance_id: str, nats_server, **kw) -> AgentConfig:
    return AgentConfig(instance_id=instance_id, nats_url=nats_server.url, heartbeat_s=0.25,
                       peer_timeout_s=1.0, request_timeout_s=1.0, **kw)


@contextlib.asynccontextmanager
async def agent_pair(nats_server, p_id: str, d_id: str, lay, nblocks: int, *,
                     p_kw: dict | None = None, d_kw: dict | None = None):
    """A prefill agent with filled KV and a decode agent with zeroed KV, same layout."""
    async with Agent(cfg(p_id, nats_server, **(p_kw or {})), layout=lay,
                     kv_caches=cache(lay, nblocks, fill=True)) as p, \
            Agent(cfg(d_id, nats_server, **(d_kw or {})), layout=lay,
                  kv_caches=cache(lay, nblocks, fill=False)) as d:
        yield p, d


def assert_at_rest(*agents: Agent) -> None:
    for a in agents:
        s = a.statistics()
        assert (s.transfers_active, s.reservations_active, s.staging_bytes_in_use,
                s.held_active, s.leases_active, s.staged_transfers) == (0, 0, 0, 0, 0, 0), s


async def settle(*agents: Agent, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while any(a.statistics().transfers_active for a in agents):
            await anyio.sleep(0.02)


async def meet(*agents: Agent, timeout: float = 10.0) -> None:
    """Until every agent has seen every other's announcement (layouts, TP shares)."""
    with anyio.fail_after(timeout):
        while any(len(a.peers()) < len(agents) - 1 for a in agents):
            await anyio.sleep(0.02)
