"""How a transfer is cut into data-plane frames: what the sender picks, what the receiver
takes."""

from __future__ import annotations

import anyio
import pytest

from kvstream import AgentConfig
from kvstream.dataplane.stream import frame_layers_for, frame_refusal, frames_of
from kvstream.dataplane.wire import HEADER_CAPACITY
from kvstream.transfer.handles import LayerFlags

CFG = AgentConfig(instance_id="x", whole_frame_bytes=8 << 20, staging_bytes=256 << 20)


def test_short_transfers_between_host_memories_are_one_frame():
    assert frame_layers_for(CFG, 32, 2 << 20, host_memory=True) == 32
    assert frame_layers_for(CFG, 80, 8 << 20, host_memory=True) == 80


@pytest.mark.parametrize(("payload", "host", "lazy"), [
    ((8 << 20) + 1, True, False),  # longer than whole_frame_bytes
    (2 << 20, False, False),  # device KV on either end
    (2 << 20, True, True),  # fetched layer by layer
    (0, True, False),  # nothing to send
])
def test_anything_else_streams_layer_by_layer(payload, host, lazy):
    assert frame_layers_for(CFG, 32, payload, host_memory=host, lazy=lazy) == 1


def test_whole_frames_stay_within_a_quarter_of_staging_and_can_be_off():
    small = AgentConfig(instance_id="x", staging_bytes=4 << 20)  # default whole_frame_bytes
    assert frame_layers_for(small, 32, 1 << 20, host_memory=True) == 32
    assert frame_layers_for(small, 32, (1 << 20) + 1, host_memory=True) == 1
    off = AgentConfig(instance_id="x", whole_frame_bytes=0)
    assert frame_layers_for(off, 32, 1, host_memory=True) == 1


def test_frames_cover_every_layer_once_in_order():
    assert frames_of(4, 1) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert frames_of(80, 80) == [range(0, 80)]
    assert [layer for f in frames_of(7, 3) for layer in f] == list(range(7))


def test_the_receiver_refuses_framing_it_cannot_take():
    kw = {"host_memory": True, "lazy": False, "frame_bytes": 1 << 20,
          "staging_bytes": 256 << 20}
    assert frame_refusal(1, 32, **{**kw, "host_memory": False}) is None  # per layer: always
    assert frame_refusal(32, 32, **kw) is None
    assert "of 32 layers" in frame_refusal(8, 32, **kw)
    assert "GPU" in frame_refusal(32, 32, **{**kw, "host_memory": False})
    assert "lazy" in frame_refusal(32, 32, **{**kw, "lazy": True})
    assert "staging" in frame_refusal(32, 32, **{**kw, "staging_bytes": (1 << 20)
                                                  + HEADER_CAPACITY - 1})


@pytest.mark.anyio
async def test_layer_flags_make_events_only_for_waiters_and_wake_all_for_ever():
    flags = LayerFlags(80)
    flags.set(3)
    await flags.wait(3)  # set already: no event
    assert flags._events == {}
    got = []

    async def waiter(layer: int) -> None:
        await flags.wait(layer)
        got.append(layer)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, 5)
        tg.start_soon(waiter, 6)
        await anyio.sleep(0.01)
        assert set(flags._events) == {5, 6}
        flags.set(5)
        await anyio.sleep(0.01)
        assert got == [5]
        flags.wake_all()  # the transfer ended: 6 returns, unset
    assert got == [5, 6] and not flags.is_set(6)
    with anyio.fail_after(1):
        await flags.wait(7)  # and so does every later wait
