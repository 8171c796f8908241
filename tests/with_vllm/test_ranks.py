"""Which prefill ranks a decode rank answers for and pulls from (adapters/vllm/ranks.py),
over every pair of TP degrees up to 8 and KV head counts up to 16: pure arithmetic, so
every case is checked."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="needs a real vLLM: bash .ci/vllm-env && .venv-vllm/bin/python -m "
                           "pytest tests/with_vllm (README command 3)")

from kvstream.adapters.vllm import ranks


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
    assert ranks.instance("pf", 1, 2) == "pf-tp1" and ranks.instance("pf", 0, 1) == "pf"
