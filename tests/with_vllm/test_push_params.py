"""The push's inputs from outside, checked before use (no engine): a client may write
``kv_transfer_params``, and any signed peer may send a note."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="needs a real vLLM: bash .ci/vllm-env && .venv-vllm/bin/python -m "
                           "pytest tests/with_vllm (README command 3)")

from kvstream.adapters.vllm.common import push_request
from kvstream.adapters.vllm.push import PushNote, decode_note
from kvstream.proxy.config import prefill_body
from kvstream.proxy.push import PushPlan, decode_params, prefill_push

GOOD = {"push_to": "vllm-d", "push_id": "push-0123456789abcdef", "secret": "s" * 22}


def test_the_proxys_params_ask_for_a_push():
    plan = PushPlan(prefill="vllm-p", decode="vllm-d", tp_size=2, block_size=32,
                    push_id="push-0123456789abcdef", secret="x" * 22)
    body = prefill_push(prefill_body({"model": "m", "prompt": [1, 2]}), plan)
    assert push_request(body["kv_transfer_params"]["kvstream"]) == (
        "vllm-d", "push-0123456789abcdef", "x" * 22)
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    d = decode_params(plan)
    assert d["remote_request_id"] == plan.push_id and d["tp_size"] == 2


@pytest.mark.parametrize("bad", [
    None, "push", [GOOD], {},
    {**GOOD, "push_to": "vllm.d"},            # a NATS subject token
    {**GOOD, "push_to": "x" * 129},
    {**GOOD, "push_to": 7},
    {**GOOD, "push_id": "short"},
    {**GOOD, "push_id": "push-../../etc"},
    {**GOOD, "push_id": None},
    {**GOOD, "secret": 12345},
    {**GOOD, "secret": "s" * 129},
])
def test_malformed_push_params_ask_for_none(bad):
    assert push_request(bad) is None


def test_notes_are_validated_before_use():
    ok = msgspec.json.encode(PushNote(push_id="push-0123456789abcdef", state="failed",
                                      reason="why"))
    assert decode_note(ok) == PushNote(push_id="push-0123456789abcdef", state="failed",
                                       reason="why")
    for bad in (b"", b"{}", b"\xff" * 10, b'{"push_id": "push-0123456789abcdef"}',
                b'{"push_id": "push-0123456789abcdef", "state": "eaten"}',
                b'{"push_id": "x", "state": "failed"}',
                b'{"push_id": "push-0123456789abcdef", "state": "failed", "extra": 1}',
                msgspec.json.encode({"push_id": "push-0123456789abcdef", "state": "failed",
                                     "reason": "r" * 600})):
        assert decode_note(bad) is None, bad
