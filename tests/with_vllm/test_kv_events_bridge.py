"""vLLM's own KV cache events bridged onto kvstream's (issue 20), with vLLM's real event
classes and its real ZMQ publisher: stored blocks become kvstream's chained hashes (the
ones transfers and routers use), a block with extra keys or an unknown parent is not
bridged (nor its descendants), removals and clears map through, a gap in vLLM's sequence
clears the view."""

from __future__ import annotations

import time

import msgspec
import pytest

pytest.importorskip("vllm.distributed.kv_events",
                    reason="needs a real vLLM: bash .ci/vllm-env && .venv-vllm/bin/python -m "
                           "pytest tests/with_vllm (README command 3)")

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from kvstream.adapters.vllm.kv_events import (
    EventBridge,
    EventsWatch,
    HashBridge,
    publisher_binds,
    subscriber,
)
from kvstream.control.nats_server import free_port
from kvstream.prefix import block_hashes

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks


def stored(theirs, parent, tokens, extra=None):
    return BlockStored(block_hashes=theirs, parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=extra)


def test_stored_blocks_become_kvstream_hashes_across_events_and_removals_map_through():
    bridge = HashBridge(BS)
    ours = block_hashes(TOKENS, BS)
    got = []
    sink = lambda kind, hashes: got.append((kind, hashes))  # noqa: E731
    bridge.apply(KVEventBatch(ts=0.0, events=[
        stored([b"v0", b"v1"], None, TOKENS[:8]),
        stored([b"v2", b"v3"], b"v1", TOKENS[8:16]),  # continues the chain
        stored([b"x0"], b"unknown", TOKENS[16:20]),  # its parent was never bridged
        stored([b"v4", b"v5"], b"v3", TOKENS[16:24], extra=[None, ("salt",)]),
        BlockRemoved(block_hashes=[b"v1", b"nope"], medium="GPU"),
    ]), sink)
    assert got == [("stored", ours[:2]), ("stored", ours[2:4]), ("stored", ours[4:5]),
                   ("removed", [ours[1]])]
    assert bridge.skipped == 2  # x0, and v5 (extra keys)
    bridge.apply(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]), sink)
    assert got[-1] == ("cleared", [])
    bridge.apply(KVEventBatch(ts=0.0, events=[stored([b"v3b"], b"v2", TOKENS[12:16])]), sink)
    assert got[-1] == ("cleared", [])  # after a clear the old parents are unknown


@pytest.mark.parametrize("kind", ["wildcard", "loopback", "ipc"])
def test_the_bridge_follows_vllms_publisher_and_a_gap_clears_the_view(kind, tmp_path):
    """vLLM binds a wildcard or ipc endpoint and connects to any other address (a
    loopback one too): the bridge meets it either way, and says which it did."""
    port = free_port()
    endpoint = {"wildcard": f"tcp://*:{port}", "loopback": f"tcp://127.0.0.1:{port}",
                "ipc": f"ipc://{tmp_path}/kv-events"}[kind]
    where, bind = subscriber(endpoint)
    assert bind == (kind == "loopback") == (not publisher_binds(endpoint))
    assert bind == (not ZmqEventPublisher._is_bind_endpoint(endpoint))  # vLLM's own rule
    got: list = []
    # The bridge first when it binds (vLLM's connecting socket then reaches it).
    bridge = EventBridge(where, "kv", BS, lambda kind, hashes: got.append((kind, hashes)),
                         bind=bind) if bind else None
    pub = ZmqEventPublisher(0, endpoint=endpoint, topic="kv")
    if bridge is None:
        bridge = EventBridge(where, "kv", BS, lambda kind, hashes: got.append((kind, hashes)))
    try:
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:  # until the subscription is live
            pub.publish(KVEventBatch(ts=time.time(), events=[
                stored([b"v0", b"v1"], None, TOKENS[:8])]))
            time.sleep(0.1)
        assert got and got[0] == ("stored", block_hashes(TOKENS[:8], BS))
        assert bridge.state(time.monotonic()) == "ok"
    finally:
        bridge.close()
        pub.shutdown()
    # A gap (batches missed): the view is cleared, then the next batch applies. On a
    # bridge of its own (no publisher: nothing races the frames handed to it here).
    got.clear()
    quiet = EventBridge(f"tcp://127.0.0.1:{free_port()}", "kv", BS,
                        lambda kind, hashes: got.append((kind, hashes)))
    try:
        def frame(seq: int, *events) -> list[bytes]:
            return [b"kv", seq.to_bytes(8, "big"),
                    msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=list(events)))]

        quiet._handle(frame(1, stored([b"v0"], None, TOKENS[:4])))
        quiet._handle(frame(6, stored([b"w0"], None, TOKENS[4:8])))
        assert got == [("stored", block_hashes(TOKENS[:4], BS)), ("cleared", []),
                       ("stored", block_hashes(TOKENS[4:8], BS))]
        assert quiet.gaps == 1
        quiet._handle([b"kv", b"short", b""])
        quiet._handle([b"kv", (7).to_bytes(8, "big"), b"\xc1"])
        assert quiet.malformed == 2
    finally:
        quiet.close()


def test_the_watch_says_missing_when_filled_blocks_bring_no_event():
    watch = EventsWatch(after_s=10.0)
    assert watch.state(0.0) == "waiting"
    watch.filled(0, 1.0)  # a step that filled nothing expects nothing
    assert watch.state(50.0) == "waiting"
    watch.filled(2, 100.0)
    watch.filled(1, 105.0)  # the first unheard fill counts
    assert watch.state(109.9) == "waiting" and watch.state(110.0) == "missing"
    watch.batch()
    assert watch.state(111.0) == "ok"
    watch.filled(1, 200.0)  # events stop later on
    assert watch.state(205.0) == "ok" and watch.state(210.0) == "missing"
    watch.batch()
    assert watch.state(210.0) == "ok"


def test_blocks_filled_counts_the_blocks_a_step_completes():
    from types import SimpleNamespace

    from kvstream.adapters.vllm.scheduler import blocks_filled

    out = SimpleNamespace(
        num_scheduled_tokens={"a": 70, "b": 1, "c": 1, "d": 5},
        scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=0),
                            SimpleNamespace(req_id="d", num_computed_tokens=32)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["b", "c"], num_computed_tokens=[31, 40]))
    # a: 0 -> 70 fills 2 blocks of 32; b: 31 -> 32 fills 1; c: 40 -> 41 none; d: 32 -> 37 none
    assert blocks_filled(out, 32) == 3  # type: ignore[arg-type]
