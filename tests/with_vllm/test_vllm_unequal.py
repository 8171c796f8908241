"""Disaggregated generation between real vLLM engines that differ in block size and in
tensor parallelism (issue 18).

Three engines, each ``kv_both`` (one engine is the prefill in one test and the decode in
another), one nats-server, UCX between the workers, the trained tiny Llama (2 KV heads):
block 32 TP 1, block 128 TP 1, and block 32 TP 2 (its workers announce ``tp-tp0`` and
``tp-tp1``, one KV head each). The colocated reference is the prefill engine serving the
prompt alone, as in test_vllm_e2e.py.

"Loaded, not recomputed" is checked per request, since a recompute fallback gives the
same tokens: the decode engine reports the whole prompt cached (``num_cached_tokens``; the
prefill's ``remote_prefill_cached_tokens`` is stripped), and the connector's event log
shows one completed pull, from the prefill rank(s) holding this rank's heads, that moved
exactly the K and V of the tokens asked for. Pulling the wrong prompt's KV changes the
tokens, so the loaded KV decides them.

What the connector declines it declines before anything moves, visibly (an event, a log
line), aborting every prefill rank's hold with the reason (no lease runs out), and vLLM
computes the prompt: a decode-side prefix hit between unequal layouts (the load would
rewrite shared cached blocks). Decode TP above prefill TP loads too: the decode ranks
sharing a prefill rank are readers of its one offer. vLLM's CPU attention keeps K
transposed in each block ([head_dim, block_size] per head); the block-size tests load
through that layout, so they prove kvstream reads it.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

# A real vLLM, not a namespace package made of some "vllm" directory (examples/vllm).
pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="needs a real vLLM: bash .ci/vllm-env && .venv-vllm/bin/python -m "
                           "pytest tests/with_vllm (README command 3)")

from kvstream import EmbeddedNats

try:  # tests/with_vllm as a package, or as a plain directory on sys.path
    from . import engines as E
except ImportError:
    import engines as E  # type: ignore[no-redef]

pytestmark = pytest.mark.timeout(600)

NEW = 16
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 32
TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * 4 * LAYERS  # float32 K and V of one token, all layers
ENGINES = {  # name: (block size, TP degree)
    "b32": (32, 1),
    "b128": (128, 1),
    "tp": (32, 2),
}


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Any:
    root = tmp_path_factory.mktemp("vllm-unequal")
    events = root / "events.jsonl"
    env = {**E.engine_env(events), "VLLM_LOGGING_LEVEL": "INFO"}  # the connector's INFO lines
    with EmbeddedNats() as nats:
        # Three engines on 2 cores, and one holding offers keeps stepping (the TP one with
        # three processes): seconds-long stalls happen, so tolerant leases and liveness.
        engines = {name: E.Engine(tiny_model, E.kv_config("kv_both", nats.url, instance_id=name,
                                                          lease_s=120.0, peer_timeout_s=30.0,
                                                          request_timeout_s=20.0),
                                  env=env, log=root / f"{name}.log",
                                  engine_kw={"block_size": bs, "tensor_parallel_size": tp})
                   for name, (bs, tp) in ENGINES.items()}  # all start at once
        try:
            assert all(e.pid for e in engines.values())
            for e in engines.values():  # the first request of an engine is slow: not in a test
                e.generate([{"prompt": E.prompt(40, 1), "max_tokens": 2}])
            yield {"events": events, **engines}
        finally:
            for e in engines.values():
                e.stop()


def _events(trio: dict[str, Any], event: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in E.read_events(trio["events"]) if e["event"] == event
            and all(e.get(k) == v for k, v in match.items())]


def _wait_events(trio: dict[str, Any], event: str, n: int = 1, timeout: float = 30.0,
                 **match: Any) -> list[dict[str, Any]]:
    end = time.monotonic() + timeout
    while len(found := _events(trio, event, **match)) < n and time.monotonic() < end:
        time.sleep(0.1)
    return found


def colocated(engine: E.Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [o["tokens"] for o in engine.generate([{"prompt": p, "max_tokens": NEW}
                                                  for p in prompts])]


def prefill(engine: E.Engine, prompts: list[list[int]]) -> list[dict[str, Any]]:
    out = engine.generate([{"prompt": p, "max_tokens": 1, "params": {"do_remote_decode": True}}
                           for p in prompts])
    params = []
    for o in out:
        kv = dict(o["kv_transfer_params"])
        kv.pop("remote_prefill_cached_tokens")  # it would override the decode's own count
        params.append(kv)
    return params


def decode(engine: E.Engine, prompts: list[list[int]],
           params: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return engine.generate([{"prompt": p, "max_tokens": NEW, "params": kv}
                            for p, kv in zip(prompts, params, strict=True)])


def sources_of(p_name: str) -> list[str]:
    return ["tp-tp0", "tp-tp1"] if ENGINES[p_name][1] == 2 else [p_name]


def assert_loaded(trio: dict[str, Any], prompt: list[int], kv: dict[str, Any], got: dict[str, Any],
                  p_name: str, d_name: str) -> None:
    """The decode engine loaded this prompt's KV over one pull from the prefill rank(s)
    holding its heads, converted from the prefill's layout; nothing was recomputed."""
    (p_bs, _), (d_bs, _) = ENGINES[p_name], ENGINES[d_name]
    assert got["num_cached_tokens"] == len(prompt), "the decode engine recomputed prompt tokens"
    pulled = _wait_events(trio, "pull_ended", remote_request_id=kv["remote_request_id"])
    assert len(pulled) == 1 and pulled[0]["ok"], pulled
    e = pulled[0]
    nblocks = math.ceil(len(prompt) / d_bs)
    # Across block sizes the prompt's tokens; between equal ones whole blocks (heads move
    # as they lie in a block, whatever the backend keeps inside one).
    tokens = len(prompt) if p_bs != d_bs else nblocks * d_bs
    assert e["sources"] == sources_of(p_name) and e["tokens"] == tokens, e
    assert e["blocks"] == nblocks and e["local_blocks"] == 0 and e["skipped"] == 0, e
    assert e["bytes"] == tokens * TOKEN_BYTES, e  # every head's K and V of each token, once
    scheduled = _events(trio, "pull_scheduled", request_id=e["request_id"])
    assert scheduled and scheduled[0]["unequal"], scheduled
    ended = _wait_events(trio, "offer_ended", n=len(e["sources"]),
                         request_id=kv["remote_request_id"])
    assert [x["status"] for x in ended] == ["completed"] * len(e["sources"]), ended


def assert_declined(trio: dict[str, Any], prompt: list[int], kv: dict[str, Any],
                    p_name: str, d_name: str, reason: str) -> dict[str, Any]:
    """The decode side declined the load before anything moved and released every prefill
    rank's hold (the decode engine aborted it, naming why; no lease ran out)."""
    rrid = kv["remote_request_id"]
    declined = _events(trio, "load_declined", remote_request_id=rrid)
    assert len(declined) == 1 and reason in declined[0]["reason"], declined
    assert not _events(trio, "pull_scheduled", remote_request_id=rrid)
    n = len(sources_of(p_name))
    ended = _wait_events(trio, "offer_ended", n=n, timeout=40, request_id=rrid)
    assert [e["status"] for e in ended] == ["aborted"] * n, ended
    by = f"aborted by {sources_of(d_name)[0]}: the decode side declined the load: {reason}"
    assert all(e["reason"].startswith(by) for e in ended), (by, ended)
    return declined[0]


BLOCK_PAIRS = [("b32", "b128"), ("b128", "b32"), ("tp", "b128")]


@pytest.mark.parametrize(("p_name", "d_name"), BLOCK_PAIRS)
def test_decode_with_another_block_size_loads_the_prompt(trio, p_name, d_name):
    # partial last blocks on both sides, whole 128-token blocks, a short prompt
    prompts = [E.prompt(n, 100 + 10 * BLOCK_PAIRS.index((p_name, d_name)) + i)
               for i, n in enumerate((100, 256, 45))]
    want = colocated(trio[p_name], prompts)
    assert all(len(set(w)) > 4 for w in want), "the model must not repeat one token"
    params = prefill(trio[p_name], prompts)
    for p, kv in zip(prompts, params, strict=True):
        assert kv["kvstream"]["block_size"] == ENGINES[p_name][0]
        assert len(kv["remote_block_ids"][0]) == math.ceil(len(p) / ENGINES[p_name][0])
    got = decode(trio[d_name], prompts, params)
    assert [g["tokens"] for g in got] == want
    for p, kv, g in zip(prompts, params, got, strict=True):
        assert_loaded(trio, p, kv, g, p_name, d_name)


def test_decode_tp1_gathers_heads_from_prefill_tp2(trio):
    """Prefill TP 2 (one KV head per rank) -> decode TP 1: one request-level pull gathers
    head 0 from rank 0 and head 1 from rank 1; both ranks' offers complete (vLLM frees
    the prefill's blocks only then)."""
    prompts = [E.prompt(n, 300 + i) for i, n in enumerate((100, 256, 45))]
    want = colocated(trio["tp"], prompts)
    assert all(len(set(w)) > 4 for w in want), "the model must not repeat one token"
    params = prefill(trio["tp"], prompts)
    for kv in params:
        assert kv["tp_size"] == 2 and kv["remote_engine_id"] == "tp"
    got = decode(trio["b32"], prompts, params)
    assert [g["tokens"] for g in got] == want
    for p, kv, g in zip(prompts, params, got, strict=True):
        assert_loaded(trio, p, kv, g, "tp", "b32")
        offered = _events(trio, "offered", request_id=kv["remote_request_id"])
        assert sorted(e["instance"] for e in offered) == ["tp-tp0", "tp-tp1"]


def test_the_gathered_kv_decides_the_tokens(trio):
    """Decoding prompt B from prompt A's gathered KV (same length) gives other tokens than
    B's own: the equality above is not a recompute in disguise."""
    a, b = E.prompt(150, 311), E.prompt(150, 312)
    want_b = colocated(trio["tp"], [b])[0]
    kv_a = prefill(trio["tp"], [a])[0]
    wrong = decode(trio["b32"], [b], [kv_a])[0]
    pulled = _wait_events(trio, "pull_ended", remote_request_id=kv_a["remote_request_id"])
    assert pulled and pulled[0]["ok"] and pulled[0]["sources"] == ["tp-tp0", "tp-tp1"], pulled
    assert wrong["tokens"] != want_b


def test_prefix_cached_on_decode_between_tp_degrees_is_computed_not_rewritten(trio):
    """The decode engine (TP 1) holds the prompt's first 64 tokens in its prefix cache; the
    prefill runs TP 2. The engine would move the whole prompt (no skipping between unequal
    layouts) into blocks other requests share, so the connector declines the load and vLLM
    computes the uncached tokens."""
    base = E.prompt(64, 321)
    first, second = base + E.prompt(40, 322), base + E.prompt(60, 323)
    want = colocated(trio["tp"], [first, second])
    kv1 = prefill(trio["tp"], [first])[0]
    got1 = decode(trio["b32"], [first], [kv1])[0]
    assert got1["tokens"] == want[0]
    assert_loaded(trio, first, kv1, got1, "tp", "b32")
    kv2 = prefill(trio["tp"], [second])[0]
    got2 = decode(trio["b32"], [second], [kv2])[0]
    assert got2["tokens"] == want[1]
    assert got2["num_cached_tokens"] == 64  # the local hit only
    declined = assert_declined(trio, second, kv2, "tp", "b32",
                               "this engine's prefix cache holds 64 of the prompt's tokens")
    rid, rrid = re.escape(declined["request_id"]), re.escape(kv2["remote_request_id"])
    assert E.log_lines(trio["b32"].log, "INFO", rf"kvstream load {rid} from tp \(request "
                       rf"{rrid}\) declined: this engine's prefix cache holds 64 ")


def test_decode_tp2_loads_each_rank_its_head_of_one_prefill_offer(trio):
    """Decode TP 2 from prefill TP 1: both decode ranks pull the one prefill rank's offer,
    each its own KV head (two readers of one offer); the offer completes once, when both
    did, and the tokens equal the colocated run's with nothing recomputed."""
    prompts = [E.prompt(n, 400 + i) for i, n in enumerate((90, 200))]
    want = colocated(trio["b32"], prompts)
    params = prefill(trio["b32"], prompts)
    got = decode(trio["tp"], prompts, params)
    assert [g["tokens"] for g in got] == want
    for p, kv, g in zip(prompts, params, got, strict=True):
        pulled = _wait_events(trio, "pull_ended", n=2, remote_request_id=kv["remote_request_id"])
        assert g["num_cached_tokens"] == len(p), ("the decode engine recomputed prompt tokens",
                                                  pulled)
        tokens = math.ceil(len(p) / 32) * 32
        assert len(pulled) == 2 and all(e["ok"] and e["sources"] == ["b32"] for e in pulled)
        assert len({e["pid"] for e in pulled}) == 2, pulled  # one pull per decode rank
        assert all(e["bytes"] == tokens * TOKEN_BYTES // KV_HEADS for e in pulled), pulled
        ended = _wait_events(trio, "offer_ended", request_id=kv["remote_request_id"])
        assert [x["status"] for x in ended] == ["completed"], ended


def test_every_transfer_ended_exactly_once(trio):
    """Runs last: each offer (per worker) and each scheduled pull in this module ended
    exactly once."""
    time.sleep(1)
    events = E.read_events(trio["events"])
    offered = [(e["pid"], e["request_id"]) for e in events if e["event"] == "offered"]
    ended = Counter((e["pid"], e["request_id"]) for e in events if e["event"] == "offer_ended")
    assert len(offered) >= 15 and all(ended[o] == 1 for o in offered), (offered, ended)
    scheduled = [e["request_id"] for e in events if e["event"] == "pull_scheduled"]
    # One pull per decode worker (a TP 2 decode engine: two per request).
    pulled = Counter((e["pid"], e["request_id"]) for e in events if e["event"] == "pull_ended")
    by_request = Counter(r for _, r in pulled)
    assert len(scheduled) >= 5 and all(n == 1 for n in pulled.values()), (scheduled, pulled)
    assert all(by_request[r] in (1, 2) for r in scheduled), (scheduled, by_request)
