"""Which prefill ranks a decode rank answers for, pulls from and asks (transfer/ranks.py),
over every pair of TP degrees up to 8 and KV head counts up to 16: pure arithmetic, so
every case is checked."""

from __future__ import annotations

import pytest

from kvstream.transfer import ranks


@pytest.mark.parametrize("total", [1, 2, 4, 8, 16])
def test_every_prefill_rank_has_one_owner_and_the_sources_hold_the_heads(total):
    for p in (1, 2, 4, 8):
        for d in (1, 2, 4, 8):
            for p_rank in range(p):
                owners = [r for r in range(d) if p_rank in ranks.owned(r, p, d)]
                assert len(owners) == 1, (p, d, p_rank, owners)
            why = ranks.refusal(p, d, total)
            assert why is None, (p, d, total, why)
            for r in range(d):
                held = {h for s in ranks.sources(r, p, d) for h in ranks.heads(s, p, total)}
                assert set(ranks.heads(r, d, total)) <= held, (p, d, total, r)
                if d > p:  # the owner of a prefill rank is one of its readers
                    assert set(ranks.owned(r, p, d)) <= set(ranks.sources(r, p, d))
            # Every decode rank reads one prefill rank at D > P, or its owned ones: the
            # readers of each prefill rank are exactly the decode ranks pulling it.
            for p_rank in range(p):
                pulling = sum(p_rank in ranks.sources(r, p, d) for r in range(d))
                assert ranks.readers(p_rank, p, d) == pulling == (d // p if d > p else 1)


def test_splits_that_do_not_cover_are_refused():
    assert "holds KV heads" in (ranks.refusal(3, 2, 6) or "")
    assert "not a multiple" in (ranks.refusal(2, 3, 6) or "")


@pytest.mark.parametrize("total", [0, 1, 2, 4, 8, 16])  # 0: MLA
def test_every_prefill_rank_is_asked_and_each_head_read_once(total):
    """SGLang's prefill ranks each wait to be asked: every one is (read, or told it is not
    needed), its readers are the decode ranks that read it, and every decode rank reads
    each of its heads from exactly one prefill rank that holds it."""
    for p in (1, 2, 4, 8):
        for d in (1, 2, 4, 8):
            asked = [ranks.asks(r, p, d, total) for r in range(d)]
            for p_rank in range(p):
                assert any(p_rank in a for a in asked), (p, d, total, p_rank)
                reading = sum(a.get(p_rank, False) for a in asked)
                assert reading in (0, ranks.readers(p_rank, p, d)), (p, d, total, p_rank)
            for r, a in enumerate(asked):
                read = [s for s, yes in a.items() if yes]
                assert read and set(read) <= set(ranks.sources(r, p, d)), (p, d, total, r)
                if total == 0:
                    assert len(read) == 1  # one latent, read once
                    continue
                held = [h for s in read for h in ranks.heads(s, p, total)]
                mine = set(ranks.heads(r, d, total))
                assert mine <= set(held), (p, d, total, r, read)
                # A rank read for nothing of this decode rank's would be a wasted transfer.
                assert all(mine & set(ranks.heads(s, p, total)) for s in read)


def test_a_replica_the_plan_does_not_use_is_told_not_read():
    # 2 KV heads over prefill TP 4: ranks 0, 1 hold head 0, ranks 2, 3 head 1.
    assert ranks.asks(0, 4, 1, 2) == {0: True, 1: False, 2: True, 3: False}
    assert ranks.asks(0, 4, 1, 0) == {0: True, 1: False, 2: False, 3: False}  # MLA
    assert ranks.asks(1, 1, 2, 8) == {0: True}  # D > P: a reader of rank 0's shared offer
