"""An instance that joins learns of the instances already running within a round trip of
its own announcement, not at their next heartbeat: each greets a newcomer back, at most
four times a heartbeat, and a newcomer that came within that quarter is greeted once it
is over (an instance that left before its next heartbeat would otherwise never have been
known to it: SGLang's prefill ranks keep a decode's notes until they know who sent them).
"""

from __future__ import annotations

import anyio
import pytest

from kvstream import Agent
from kvstream.config import AgentConfig
from tests.fakes import cache, small_layout

pytestmark = pytest.mark.anyio

HEARTBEAT_S = 20.0  # the old instance's: a newcomer must not have to wait for it


async def test_newcomers_within_one_hello_window_are_all_greeted(nats_server):
    lay = small_layout()

    def agent(name: str, heartbeat_s: float = 0.25) -> Agent:
        config = AgentConfig(instance_id=name, nats_url=nats_server.url, heartbeat_s=heartbeat_s,
                             peer_timeout_s=3 * heartbeat_s, request_timeout_s=1.0)
        return Agent(config, layout=lay, kv_caches=cache(lay, 4, fill=False))

    async with agent("hello-old", heartbeat_s=HEARTBEAT_S) as old:
        await anyio.sleep(0.5)  # its own announcement is past: nobody heard it
        async with agent("hello-b") as b, agent("hello-c") as c:
            # b's arrival is greeted at once, c's (within the same quarter heartbeat) once
            # it is over: both know the old instance within HEARTBEAT_S / 4 (+ round trips),
            # far before its next heartbeat at HEARTBEAT_S.
            with anyio.fail_after(HEARTBEAT_S / 4 + 5):
                while not all(any(p.instance_id == "hello-old" for p in x.peers())
                              for x in (b, c)):
                    await anyio.sleep(0.05)
            assert old.registry.announced("hello-c") is not None
