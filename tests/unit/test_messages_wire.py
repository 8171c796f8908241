from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest

from kvstream import KVLayout, MessageDecodeError, ProtocolError
from kvstream.control import messages as m
from kvstream.dataplane import wire

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)

SAMPLES = [
    m.Announce(instance_id="a", role="decode", worker_address=b"\x01\x02", layout=LAYOUT),
    m.Leave(instance_id="a"),
    m.Manifest(transfer_id="t", request_id="r", src="p", dst="d", src_address=b"x", src_tag=7,
               fingerprint="f", num_layers=2, src_blocks=[1, 2], dst_blocks=[3, 4]),
    m.Accept(transfer_id="t", dst_tag=9, dst_address=b"y", dst_blocks=[3, 4]),
    m.Reject(transfer_id="t", code="invalid_blocks", reason="no"),
    m.Done(transfer_id="t", request_id="r", status="completed", bytes=10, layers=2),
    m.Abort(transfer_id="t", request_id="r", reason="why", by="d"),
    m.AbortAck(transfer_id="t"),
    m.Pull(request_id="r", src="p", dst="d", dst_address=b"y", dst_tag=9, fingerprint="f",
           num_layers=2, dst_blocks=[3, 4], have=[11], mode="lazy"),
    m.Pull(request_id="r", src="p", dst="d", dst_address=b"y", dst_tag=9, fingerprint="f",
           num_layers=2, dst_blocks=[3, 4], codec="fp8_e4m3", wire_fingerprint="w"),
    m.Manifest(transfer_id="t", request_id="r", src="p", dst="d", src_address=b"x", src_tag=7,
               fingerprint="w", num_layers=2, src_blocks=[1, 2], codec="fp8_e4m3"),
    m.Manifest(transfer_id="t", request_id="r", src="p", dst="d", src_address=b"x", src_tag=7,
               fingerprint="f", num_layers=2, src_blocks=[1, 2], cache_scales=[0.5, 0.25]),
    m.Renew(by="d", request_ids=["r", "s"]),
    m.RenewAck(unknown=["s"], lease_s=30.0),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    assert m.decode(m.encode(msg)) == msg


def test_tags_are_stable():
    # Tags are wire contract: renaming one breaks every deployed peer.
    tags = {type(s).__name__: s.__struct_config__.tag for s in SAMPLES}
    assert tags == {"Announce": "kv.announce", "Leave": "kv.leave", "Manifest": "kv.manifest",
                    "Accept": "kv.accept", "Reject": "kv.reject", "Done": "kv.done",
                    "Abort": "kv.abort", "AbortAck": "kv.abort_ack", "Pull": "kv.pull",
                    "Renew": "kv.renew", "RenewAck": "kv.renew_ack"}


def test_older_peers_are_refused_clearly():
    # Bytes as a protocol-1 peer sends them (recorded). Version 2 signed every message;
    # version 3 boxes what goes to one peer and MACs data-plane frames: older peers are
    # refused with a clear reason.
    old = bytes.fromhex("83a26f70a76b762e646f6e65a17601ab7472616e736665725f6964a174")
    raw = msgspec.msgpack.decode(old)
    assert raw == {"op": "kv.done", "v": 1, "transfer_id": "t"}
    full = msgspec.msgpack.encode({**raw, "request_id": "r", "status": "aborted"})
    with pytest.raises(MessageDecodeError, match="protocol version 1 is older"):
        m.decode(full)
    v2 = msgspec.msgpack.encode({**raw, "v": 2, "request_id": "r", "status": "aborted"})
    with pytest.raises(MessageDecodeError, match="protocol version 2 is older"):
        m.decode(v2)
    v3 = msgspec.msgpack.encode({**raw, "v": 3, "request_id": "r", "status": "aborted"})
    assert m.decode(v3) == m.Done(transfer_id="t", request_id="r", status="aborted")


def test_unknown_fields_are_ignored():
    data = msgspec.msgpack.encode({"op": "kv.leave", "v": 3, "instance_id": "a", "future": [1]})
    assert m.decode(data) == m.Leave(instance_id="a")


@pytest.mark.parametrize("payload", [
    b"\xff\x00garbage",
    msgspec.msgpack.encode({"op": "kv.nope", "v": 1}),
    msgspec.msgpack.encode({"op": "kv.leave", "v": 1, "instance_id": 5}),
    msgspec.msgpack.encode({"op": "kv.manifest", "v": 1, "transfer_id": "t"}),
    msgspec.msgpack.encode({"op": "kv.leave", "v": 0, "instance_id": "a"}),
    msgspec.msgpack.encode({"op": "kv.announce", "v": 1, "instance_id": "a", "role": "decode",
                            "worker_address": b"", "layout": {"num_layers": -1,
                            "num_kv_heads": 1, "head_dim": 1, "block_size": 1}}),
])
def test_malformed_is_a_clear_error(payload):
    with pytest.raises(MessageDecodeError):
        m.decode(payload)


def test_tag_layout():
    tag = wire.make_tag(0xABCD, 5, wire.KIND_DATA + 1)
    assert tag >> 16 == 0xABCD and (tag >> 4) & 0xFFF == 5 and tag & 0xF == 3
    assert wire.make_tag((1 << 48) - 1, wire.MAX_LAYERS, wire.MAX_KIND) == (1 << 64) - 1
    with pytest.raises(ProtocolError):
        wire.make_tag(1, wire.MAX_LAYERS + 1, 0)
    with pytest.raises(ProtocolError):
        wire.make_tag(1, 0, wire.MAX_KIND + 1)


def test_tags_are_random_unique_and_live_until_released():
    tags = [wire.new_xfer_tag() for _ in range(1000)]
    try:
        assert len(set(tags)) == 1000 and all(0 < t < 1 << 48 for t in tags)
        # Random, not a counter: consecutive tags are not neighbours (a counter's would be
        # 1 apart every time; random ones are with probability 1000 / 2**48).
        assert sum(abs(a - b) == 1 for a, b in itertools.pairwise(tags)) == 0
        assert all(wire.is_live(wire.make_tag(t, 7, wire.KIND_DATA)) for t in tags)
    finally:
        for t in tags:
            wire.release_xfer_tag(t)
    assert not any(wire.is_live(wire.make_tag(t, 0, 0)) for t in tags)


def test_header_round_trip_and_bounds():
    buf = np.zeros(wire.HEADER_CAPACITY, dtype=np.uint8)
    h = wire.LayerHeader(7, 3, 4096, 2, "none", "00-abc-def-01")
    n = wire.encode_header(h, buf.data)
    assert 0 < n < wire.HEADER_CAPACITY
    assert wire.decode_header(buf.data) == h
    with pytest.raises(ProtocolError):
        wire.encode_header(wire.LayerHeader(1, 1, 1, 1, "x" * 600), buf.data)
    bad = np.full(16, 0xFF, dtype=np.uint8)
    with pytest.raises(ProtocolError):
        wire.decode_header(bad.data)
    assert wire.decode_credit(wire.encode_credit(12)) == 12


def test_block_hashes_are_a_prefix_chain():
    from kvstream import block_hashes
    from kvstream.prefix import skipped_indices

    a = block_hashes(list(range(64)), 16)
    b = block_hashes(list(range(32)) + [0] * 32, 16)
    assert len(a) == 4 and a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]
    assert block_hashes(list(range(70)), 16) == a  # a partial last block gets no hash
    assert block_hashes(list(range(64)), 16, extra=b"other-model") != a  # keyed chains
    assert all(0 <= h < 2**63 for h in a)
    assert skipped_indices(a, b[:2]) == [0, 1] and skipped_indices(a, []) == []


def _manifest(**kw):
    base = dict(transfer_id="t", request_id="r", src="p", dst="d", src_address=b"a",
                src_tag=7, fingerprint="f", num_layers=4, src_blocks=[1, 2], deadline_s=5.0)
    return m.Manifest(**{**base, **kw})


@pytest.mark.parametrize("bad", [
    {"deadline_s": float("nan")}, {"deadline_s": float("inf")}, {"deadline_s": 0.0},
    {"src_blocks": [-1]}, {"src_blocks": list(range(m.MAX_BLOCKS + 1))},
    {"src_tag": 1 << 48}, {"num_layers": 0}, {"num_layers": m.MAX_LAYERS + 1},
    {"src_address": b"x" * ((64 << 10) + 1)}, {"request_id": "r" * 1025},
    {"cache_scales": [1.0] * (2 * m.MAX_LAYERS + 1)}, {"payload_bytes": -5},
])
def test_a_peer_cannot_send_unbounded_or_impossible_values(bad) -> None:
    """Bounds hold at decoding: what a forged message carries is refused as malformed
    before any agent walks or stores it (the sender's side is not checked: a forgery is
    built by hand anyway)."""
    with pytest.raises(MessageDecodeError):
        m.decode(m.encode(_manifest(**bad)))


def test_bounded_messages_still_carry_real_sizes() -> None:
    big = _manifest(src_blocks=list(range(200_000)), block_hashes=list(range(-5, 5)),
                    request_id="cmpl-" + "x" * 200, cache_scales=[0.5] * 2 * 4)
    assert m.decode(m.encode(big)) == big
    renew = m.Renew(by="d", request_ids=[f"r{i}" for i in range(10_000)])
    assert m.decode(m.encode(renew)) == renew
