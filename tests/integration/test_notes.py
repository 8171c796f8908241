"""Adapters' notes (``Agent.note`` / ``on_note``) over a real nats-server: delivered signed
with the sender's verified id, bounded, a failing handler never takes the agent down."""

from __future__ import annotations

import anyio
import pytest

from kvstream import Agent, ConfigError
from kvstream.control import messages as m
from tests.integration.agents import cfg, meet

pytestmark = pytest.mark.anyio


async def test_a_note_reaches_its_topic_handler_with_the_sender(nats_server):
    got: list[tuple[str, bytes]] = []
    async with Agent(cfg("np", nats_server)) as p, Agent(cfg("nd", nats_server)) as d:
        await meet(p, d)
        d.on_note("sglang.want", lambda sender, body: got.append((sender, body)))
        d.on_note("bad.handler", lambda sender, body: 1 / 0)
        await p.note("nd", "bad.handler", b"boom")  # raises in the handler: logged only
        await p.note("nd", "nobody.listens", b"x")
        await p.note("nd", "sglang.want", b"\x00" * m.MAX_NOTE)
        with anyio.fail_after(10):
            while not got:
                await anyio.sleep(0.02)
        assert got == [("np", b"\x00" * m.MAX_NOTE)]
        d.on_note("sglang.want", None)
        await p.note("nd", "sglang.want", b"again")
        await anyio.sleep(0.3)
        assert len(got) == 1  # removed
        for topic in ("", "Upper", "x" * 65, "a b"):
            with pytest.raises(ConfigError):
                await p.note("nd", topic, b"")
            with pytest.raises(ConfigError):
                d.on_note(topic, print)
        with pytest.raises(ConfigError):
            await p.note("nd", "sglang.want", b"x" * (m.MAX_NOTE + 1))
        with pytest.raises(ConfigError):
            await p.note("nd.bad", "sglang.want", b"x")
