"""KV-aware routing's pure parts and the KV event log on the in-memory seams: the prefix
index (ordered batches, gaps, epochs, resets, bounds), the cost (overlap against load,
ties round robin), and ``Agent.kv_events`` (numbered batches, a reset first, a listing
afresh after a batch the stream did not take and on ``KVResync``, bounded)."""

from __future__ import annotations

import anyio
import pytest

from kvstream import Agent, AgentConfig, ConfigError, ControlPlaneError, MessageDecodeError
from kvstream.control import messages as m
from kvstream.control.identity import Identity
from kvstream.control.memory import MemoryBus, MemoryHub
from kvstream.dataplane.loopback import LoopbackFabric, LoopbackTransport
from kvstream.routing.cost import Candidate, choose
from kvstream.routing.index import PrefixIndex
from tests.fakes import cache, small_layout


def _batch(seq: int, *events: m.KVEvent, epoch: str = "epoch-one", reset: bool = False,
           iid: str = "a", block_size: int = 8) -> m.KVEvents:
    return m.KVEvents(instance_id=iid, epoch=epoch, seq=seq, block_size=block_size,
                      events=list(events), reset=reset)


def test_batches_in_order_rebuild_the_prefix_and_overlap_counts_from_the_first_block():
    idx = PrefixIndex()
    assert idx.apply(_batch(1, m.Stored([1, 2, 3]), reset=True)) == "applied"
    assert idx.apply(_batch(2, m.Stored([4]), m.Removed([2]))) == "applied"
    assert idx.overlap("a", [1, 3, 4]) == 3 and idx.overlap("a", [1, 2, 3]) == 1
    assert idx.overlap("a", [9, 1]) == 0 and idx.overlap("nobody", [1]) == 0
    assert idx.apply(_batch(2, m.Stored([7]))) == "duplicate"  # a replay's overlap
    assert idx.overlap("a", [7]) == 0
    assert idx.apply(_batch(3, m.Cleared(), m.Stored([5]))) == "applied"
    assert idx.view("a").held == {5}


def test_a_gap_marks_the_view_stale_until_a_reset_and_a_new_epoch_starts_afresh():
    idx = PrefixIndex()
    idx.apply(_batch(1, m.Stored([1]), reset=True))
    assert idx.apply(_batch(3, m.Stored([2]))) == "gap"  # batch 2 is missing
    assert idx.view("a").stale and idx.overlap("a", [1, 2]) == 2  # still routes
    assert idx.apply(_batch(4, m.Stored([8, 9]), reset=True)) == "applied"
    assert not idx.view("a").stale and idx.view("a").held == {8, 9}
    # A restart: a new epoch from 1 replaces the view; the old epoch's late batches are
    # ignored, not flip-flopped back to.
    assert idx.apply(_batch(1, m.Stored([5]), epoch="epoch-two", reset=True)) == "applied"
    assert idx.view("a").held == {5}
    assert idx.apply(_batch(5, m.Stored([6]))) == "duplicate"
    assert idx.view("a").held == {5} and idx.view("a").epoch == "epoch-two"
    # First seen mid-epoch (the stream lost its start): a gap.
    assert idx.apply(_batch(7, m.Stored([1]), iid="b")) == "gap"


def test_the_index_is_bounded_and_makes_room_by_the_view_updated_longest_ago():
    idx = PrefixIndex(max_blocks=3, max_instances=2, max_total=5)
    idx.apply(_batch(1, m.Stored([1, 2, 3, 4, 5]), reset=True))
    assert idx.view("a").held == {1, 2, 3} and idx.view("a").overflow == 2
    idx.apply(_batch(1, m.Stored([7]), reset=True, iid="b"))
    idx.apply(_batch(1, reset=True, iid="c"))  # a third instance: a, updated first, goes
    assert sorted(idx.instances()) == ["b", "c"] and idx.evicted == 1
    idx.apply(_batch(2, m.Stored([8, 9, 10]), iid="c"))  # within the budget (1 + 3 of 5)
    idx.apply(_batch(2, m.Stored([11, 12]), iid="b"))  # over it: c goes, b keeps 3
    assert idx.instances() == ["b"] and idx.view("b").held == {7, 11, 12}
    idx.forget("b")
    idx.apply(_batch(1, m.Stored([1, 2, 3]), reset=True, iid="d"))
    assert idx.view("d").held == {1, 2, 3}  # forgetting gave the budget back


def test_the_cost_weighs_missing_blocks_against_load_and_ties_go_round_robin():
    hot = Candidate(url="http://h:1", blocks=20, overlap=18, load=1)
    cold = Candidate(url="http://c:1", blocks=20, overlap=0, load=0)
    # 2 + 0.5 * 1 * 20 = 12 against 20: the prefix wins.
    assert choose([hot, cold], load_weight=0.5).candidate is hot
    # 2 + 2 * 20 = 42 against 20: the load wins.
    assert choose([hot, cold], load_weight=2.0).candidate is cold
    a, b = Candidate(url="http://a:1", blocks=4), Candidate(url="http://b:1", blocks=4)
    assert [choose([b, a], turn=t).candidate.url for t in range(3)] == [
        "http://a:1", "http://b:1", "http://a:1"]
    assert choose([Candidate(url="http://a:1", kv_used=9), Candidate(url="http://b:1")]
                  ).candidate.url == "http://b:1"  # fewer blocks in use breaks a tie
    assert choose([]) is None


def test_an_engines_load_is_the_proxys_own_plus_what_others_send_it():
    """The announcement counts every proxy's requests as of its last heartbeat: only what
    it holds beyond the most this proxy had there lately is another proxy's. A next turn
    sent as the last one ended is not priced against its own last turn, still announced."""
    from kvstream.proxy.inflight import Inflight
    from kvstream.routing.service import engine_load

    assert engine_load([1], own=0, recent=1) == 0.0  # our own turn, announced late
    assert engine_load([3], own=0, recent=1) == 2.0  # two of another proxy's
    assert engine_load([3, 5], own=1, recent=2) == 4.0  # the busiest rank counts
    assert engine_load([], own=2, recent=0) == 2.0
    assert engine_load([4], own=1, recent=0) == 4.0  # an older proxy: the larger
    now = [0.0]
    inflight = Inflight(window_s=3.0, clock=lambda: now[0])
    inflight["a"] += 1
    inflight["a"] += 1
    inflight["a"] -= 2
    assert inflight["a"] == 0 and inflight.recent("a") == 2 and inflight.peaks() == {"a": 2}
    twin = inflight.copy()  # a Counter's own methods still work
    assert twin["a"] == 0 and twin.recent("a") == 0
    now[0] = 3.5
    assert inflight.recent("a") == 0 and inflight.peaks() == {}
    assert inflight.recent("never") == 0
    assert not inflight._marks  # nothing kept past the window for an idle URL


def test_kv_event_and_route_messages_are_bounded():
    with pytest.raises(MessageDecodeError):
        m.decode(m.encode(m.KVEvents(instance_id="a", epoch="short", seq=1, block_size=16)))
    with pytest.raises(MessageDecodeError):
        m.decode(m.encode(_batch(1, m.Stored([-1]))))
    with pytest.raises(MessageDecodeError):
        m.decode(m.encode(_batch(0)))
    big = m.Route(hashes={16: list(range(m.MAX_ROUTE_BLOCKS + 1))})
    with pytest.raises(MessageDecodeError):
        m.decode(m.encode(big))


# -- the agent's KV event log, over the in-memory bus ------------------------------------
class _FlakyBus(MemoryBus):
    """Refuses to store the first ``fail`` batches (JetStream down)."""

    fail = 0

    async def persist(self, subject, msg, stream, *, rollup=False):
        if self.fail:
            self.fail -= 1
            raise ControlPlaneError("no JetStream")
        return await super().persist(subject, msg, stream, rollup=rollup)


def _cfg(name: str) -> AgentConfig:
    return AgentConfig(instance_id=name, nats_url="memory://", heartbeat_s=0.2,
                       peer_timeout_s=1.0, request_timeout_s=1.0)


def _kept(hub: MemoryHub) -> list[m.KVEvents]:
    return [msg for _, msg in hub.kept.get("KVS_default_KVEVENTS", [])]


@pytest.mark.anyio
async def test_the_log_numbers_batches_resets_first_and_relists_after_a_lost_batch():
    lay = small_layout()
    async with MemoryHub() as hub:
        bus = _FlakyBus(hub, "a")
        async with Agent(_cfg("a"), layout=lay, kv_caches=cache(lay, 4, fill=False),
                         control=bus, transport=LoopbackTransport(LoopbackFabric())) as agent:
            log = agent.kv_events()
            assert agent.kv_events() is log and log.block_size == lay.block_size
            with pytest.raises(ConfigError):
                agent.kv_events(block_size=lay.block_size + 1)
            with pytest.raises(ConfigError):
                log.stored([1 << 63])
            log.stored([1, 2, 3])
            log.removed([2])
            with anyio.fail_after(5):
                while not _kept(hub):
                    await anyio.sleep(0.01)
            # The first batch is a reset: what is held by then (the events before it are
            # in it, not after it).
            assert _kept(hub)[0] == _batch(1, m.Stored([1, 3]), epoch=log.epoch, reset=True)
            log.stored([5])
            with anyio.fail_after(5):
                while len(_kept(hub)) < 2:
                    await anyio.sleep(0.01)
            assert _kept(hub)[1] == _batch(2, m.Stored([5]), epoch=log.epoch)
            bus.fail = 1  # the next batch is lost: its number is spent, a listing follows
            log.stored([4])
            with anyio.fail_after(5):
                while _kept(hub)[-1].seq < 4:
                    await anyio.sleep(0.01)
            assert log.failed == 1
            # The listing rolled the subject up: the stream keeps it alone.
            assert _kept(hub) == [_batch(4, m.Stored([1, 3, 5, 4]), epoch=log.epoch,
                                         reset=True)]
            idx = PrefixIndex()
            assert [idx.apply(b) for b in _kept(hub)] == ["applied"]
            assert idx.view("a").held == {1, 3, 4, 5}
            # A router's KVResync: listed afresh once; a second within the pause is not.
            other = await hub.connect("router")
            other.seal.identity = Identity("router")  # agents obey only signed messages
            seq = _kept(hub)[-1].seq
            for _ in range(2):
                await other.publish(agent.subjects.control("a"), m.KVResync(instance_id="a"))
            with anyio.fail_after(5):
                while _kept(hub)[-1].seq == seq:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.3)
            # One listing for both (it rolled the subject up: the stream keeps it alone).
            assert [(b.seq, b.reset) for b in _kept(hub)] == [(seq + 1, True)]
            # A request within the pause is not lost: it waits the pause out.
            await other.publish(agent.subjects.control("a"), m.KVResync(instance_id="a"))
            await anyio.sleep(0.3)
            assert _kept(hub)[-1].seq == seq + 1 and log._resync_due is not None
            agent.report_load(requests=3, kv_used=7)
            with pytest.raises(ConfigError):
                agent.report_load(requests=-1)
