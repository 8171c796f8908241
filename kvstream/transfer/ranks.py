"""Which prefill ranks hold a decode rank's KV heads, with tensor parallelism on both sides.

Pure arithmetic over the two TP degrees and the model's KV head count; the head ranges
are those ``TpInfo.shard`` derives (split as vLLM and SGLang split them, replicated when
TP exceeds the head count), so the adapters and the engine agree. Both engines run a
request on every rank: each prefill rank offers its heads of the prompt, each decode
rank fetches its own. The prefill frees its blocks only once every rank's transfer ended,
so each prefill rank has exactly one decode rank that answers for it (``owned``): vLLM's
keeps its lease while the request queues, then pulls from it or releases it; SGLang's
asks it for the KV or tells it none is needed (``asks``).

* decode TP ``D`` == prefill TP ``P``: decode rank r pulls from prefill rank r.
* ``D < P``: decode rank r gathers from the prefill ranks p with ``p * D // P == r`` (one
  request-level pull of several parts; the worker releases the replicas it did not use).
* ``D > P``: decode rank r's heads lie on prefill rank ``r * P // D``, which holds them
  for ``D / P`` decode ranks (``readers``): each pulls its heads of that rank's one
  offer, which completes when all did; the first of them answers for its hold.
"""

from __future__ import annotations

from kvstream._exceptions import LayoutError
from kvstream.layout import KVLayout
from kvstream.transfer.plan import Shard, TpInfo, plan

__all__ = ["MAX_TP", "asks", "heads", "owned", "readers", "refusal", "sources"]

MAX_TP = 1024  # the TP degrees a peer may name (notes, announcements)


def heads(rank: int, size: int, total_kv_heads: int) -> range:
    """The model-wide KV heads rank ``rank`` of TP ``size`` holds (``LayoutError`` if
    ``total_kv_heads`` does not split over ``size``)."""
    return _shard(rank, size, total_kv_heads).heads


def _owner(p: int, prefill_tp: int, decode_tp: int) -> int:
    if decode_tp <= prefill_tp:
        return p * decode_tp // prefill_tp
    return -(-p * decode_tp // prefill_tp)  # the first decode rank reading prefill rank p


def owned(rank: int, prefill_tp: int, decode_tp: int) -> list[int]:
    """The prefill ranks decode rank ``rank`` answers for (keeps, pulls or releases)."""
    return [p for p in range(prefill_tp) if _owner(p, prefill_tp, decode_tp) == rank]


def sources(rank: int, prefill_tp: int, decode_tp: int) -> list[int]:
    """The prefill ranks decode rank ``rank`` pulls its heads from (several: a gather)."""
    if decode_tp > prefill_tp:
        return [rank * prefill_tp // decode_tp]
    return owned(rank, prefill_tp, decode_tp)


def readers(prefill_rank: int, prefill_tp: int, decode_tp: int) -> int:
    """How many decode ranks pull prefill rank ``prefill_rank``'s offer (each its heads)."""
    return sum(prefill_rank in sources(d, prefill_tp, decode_tp) for d in range(decode_tp))


def refusal(prefill_tp: int, decode_tp: int, total_kv_heads: int) -> str | None:
    """Why decode ranks cannot take their heads from this prefill engine's ranks (None:
    they can), the same answer on every rank."""
    if prefill_tp < 1 or decode_tp < 1:
        return f"TP degrees {prefill_tp} (prefill) and {decode_tp} (decode)"
    if decode_tp > prefill_tp and decode_tp % prefill_tp:
        return (f"decode TP {decode_tp} is not a multiple of prefill TP {prefill_tp}: a "
                "decode rank would need heads of two prefill ranks that other ranks share")
    try:
        for d in range(decode_tp):
            mine = heads(d, decode_tp, total_kv_heads)
            ranks = sources(d, prefill_tp, decode_tp)
            held = {h for p in ranks for h in heads(p, prefill_tp, total_kv_heads)}
            if not set(mine) <= held:
                return (f"decode rank {d} of TP {decode_tp} holds KV heads [{mine.start}, "
                        f"{mine.stop}) of {total_kv_heads}; its prefill ranks {ranks} of TP "
                        f"{prefill_tp} hold {sorted(held)}")
    except LayoutError as exc:
        return f"{total_kv_heads} KV heads over TP {prefill_tp} (prefill) and {decode_tp}: {exc}"
    return None


def asks(rank: int, prefill_tp: int, decode_tp: int, total_kv_heads: int) -> dict[int, bool]:
    """The prefill ranks decode rank ``rank`` turns to, each with whether it reads that
    rank's KV (True) or only tells it none of its KV is needed (False): every prefill rank
    hears from its owner at least, so each knows when it is done. ``total_kv_heads`` 0:
    MLA (one latent, the same on every rank: read from one rank only). The plan is
    ``transfer.plan.plan``'s, so a gather's parts are exactly the ranks read here."""
    mine = sources(rank, prefill_tp, decode_tp)
    told = dict.fromkeys(owned(rank, prefill_tp, decode_tp), False)
    if total_kv_heads == 0:
        return told | {mine[0]: True}
    dst = _shard(rank, decode_tp, total_kv_heads)
    parts = plan(dst, [_shard(p, prefill_tp, total_kv_heads) for p in mine])
    return told | {mine[part.source]: True for part in parts}


def _shard(rank: int, size: int, total_kv_heads: int) -> Shard:
    per_rank = KVLayout(num_layers=1, num_kv_heads=max(1, total_kv_heads // size), head_dim=1,
                        block_size=1, dtype="float32")
    return TpInfo(rank=rank, size=size, total_kv_heads=total_kv_heads).shard(per_rank)
