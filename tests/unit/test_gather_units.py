"""A gather's pure parts (issue 18): the combined result keeps a lost peer's error type,
and decode ranks that replicate a head are planned onto different sources."""

from __future__ import annotations

from kvstream import PeerLostError
from kvstream.layout import KVLayout
from kvstream.transfer.gathered import combine
from kvstream.transfer.handles import error_for
from kvstream.transfer.plan import TpInfo, parts_for
from kvstream.transfer.state import EndCause, Side, TransferResult, TransferState


def _result(peer: str, status: TransferState, reason: str, cause: EndCause,
            ended: float) -> TransferResult:
    return TransferResult(transfer_id=f"t-{peer}", request_id="r", side=Side.RECV, peer=peer,
                          status=status, reason=reason, bytes=10, layers=1, started_at=0.0,
                          ended_at=ended, cause=cause)


def test_a_part_whose_source_died_raises_peer_lost_like_a_single_pull():
    """A single pull whose source dies raises ``PeerLostError`` (error_for reads the
    reason's "peer lost" prefix); a gather's combined reason starts "part from ...", so
    the engine's ``wait()`` gets a bare ``TransferError`` for the same death (the cause,
    PEER_LOST, is kept, the exception type is not)."""
    dead = _result("p1", TransferState.FAILED, "peer lost: p1 went silent",
                   EndCause.PEER_LOST, 1.0)
    assert isinstance(error_for(dead), PeerLostError)
    aborted = _result("p0", TransferState.ABORTED, "gathered part from p1 failed: ...",
                      EndCause.ENGINE_ABORT, 2.0)
    both = combine("r", [aborted, dead])
    assert both.cause is EndCause.PEER_LOST
    assert isinstance(error_for(both), PeerLostError), error_for(both)


def test_decode_ranks_that_replicate_a_head_are_planned_onto_different_sources():
    """Prefill TP 8 over 2 KV heads (ranks 0-3 hold head 0, 4-7 head 1) -> decode TP 4
    (ranks 0, 1 hold head 0). "A replicated head comes from the first" source: both
    decode ranks plan prefill rank 0, and an offer is pulled once, so the second decode
    rank's gather is refused ("holds no KV") although ranks 1-3 hold the same head."""
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=16)
    sources = [TpInfo(rank=r, size=8, total_kv_heads=2).shard(lay) for r in range(8)]
    picked = [[i for i, _ in parts_for(TpInfo(rank=d, size=4, total_kv_heads=2).shard(lay),
                                       sources, tokens=16)] for d in range(4)]
    assert len({tuple(p) for p in picked}) == 4, picked
