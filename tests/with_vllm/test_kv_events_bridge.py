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

from kvstream.adapters.vllm.kv_events import EventBridge, HashBridge, subscriber_endpoint
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


def test_the_bridge_follows_vllms_publisher_and_a_gap_clears_the_view():
    port = free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", topic="kv")
    got: list = []
    bridge = EventBridge(subscriber_endpoint(f"tcp://*:{port}"), "kv", BS,
                         lambda kind, hashes: got.append((kind, hashes)))
    try:
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:  # until the subscription is live
            pub.publish(KVEventBatch(ts=time.time(), events=[
                stored([b"v0", b"v1"], None, TOKENS[:8])]))
            time.sleep(0.1)
        assert got and got[0] == ("stored", block_hashes(TOKENS[:8], BS))
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
