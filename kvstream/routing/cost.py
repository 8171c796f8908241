"""Where one leg of a request goes: the prompt blocks each candidate would still have to
compute (prefill) or receive (decode), weighed against its load (pure).

    cost = (blocks - overlap) + load_weight * load * blocks

``overlap``: the prompt's blocks, from its first, the candidate's prefix cache holds;
``load``: the requests it is serving (the larger of what it announced and what the
asking proxy has in flight there). Each request ahead of this one delays it by about one
prompt's worth of work, so ``load_weight`` 1 prices a queued request as a prompt
computed; lower values favour prefix hits more. Ties go round robin.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["Candidate", "Scored", "choose"]


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One routable engine for one leg: its URL, its kvstream instances (TP ranks), the
    prompt blocks at its block size and how many of them it holds, its load."""

    url: str
    instance_ids: tuple[str, ...] = ()
    blocks: int = 0
    overlap: int = 0
    load: float = 0.0
    kv_used: int = 0


class Scored(msgspec.Struct, frozen=True, kw_only=True):
    candidate: Candidate
    cost: float


def score(c: Candidate, load_weight: float) -> float:
    return (c.blocks - c.overlap) + load_weight * c.load * max(1, c.blocks)


def choose(candidates: Sequence[Candidate], *, load_weight: float = 0.5,
           turn: int = 0) -> Scored | None:
    """The cheapest candidate (None if there is none); among equal costs, fewer KV blocks
    in use, then round robin by ``turn`` over the URLs in order."""
    if not candidates:
        return None
    scored = [Scored(candidate=c, cost=score(c, load_weight)) for c in candidates]
    best = min((s.cost, s.candidate.kv_used) for s in scored)
    ties = sorted((s for s in scored if (s.cost, s.candidate.kv_used) == best),
                  key=lambda s: s.candidate.url)
    return ties[turn % len(ties)]
