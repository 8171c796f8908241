from __future__ import annotations

import random

import pytest

from kvstream.transfer import TERMINAL, Side, Transfer, TransferState
from tests.fakes import FakeClock


def make(clock=None) -> Transfer:
    return Transfer(transfer_id="t1", request_id="r1", side=Side.RECV, peer="p", num_layers=3,
                    layer_bytes=100, clock=clock or FakeClock())


def test_first_terminal_state_wins_and_hooks_run_once():
    t = make()
    calls = []
    t.on_release(lambda: calls.append("a"))
    t.streaming()
    assert t.finish(TransferState.ABORTED, "x")
    assert not t.finish(TransferState.COMPLETED)
    assert not t.finish(TransferState.FAILED, "y")
    assert t.state is TransferState.ABORTED and t.reason == "x"
    assert calls == ["a"]
    late = []
    t.on_release(lambda: late.append(1))
    assert late == [1]


def test_layers_and_result():
    clock = FakeClock()
    t = make(clock)
    assert t.layer_done(0) and not t.layer_done(0)
    t.layer_done(2)
    clock.advance(2.5)
    t.finish(TransferState.FAILED, "peer lost")
    assert not t.layer_done(1)  # nothing after the end
    r = t.result()
    assert (r.layers, r.bytes, r.status, r.seconds) == (2, 200, "failed", 2.5)
    assert not r.ok


def test_non_terminal_finish_is_a_bug():
    with pytest.raises(ValueError):
        make().finish(TransferState.STREAMING)


def test_random_event_sequences_end_exactly_once():
    rng = random.Random(7)
    states = list(TERMINAL)
    for _ in range(2000):
        t = make()
        released = []
        t.on_release(lambda released=released: released.append(1))
        ends = 0
        for _ in range(rng.randint(1, 12)):
            op = rng.random()
            if op < 0.5:
                t.layer_done(rng.randrange(3))
            else:
                ends += t.finish(rng.choice(states), "r")
        if t.all_layers_done and not t.terminal:
            ends += t.finish(TransferState.COMPLETED)
        assert ends <= 1 and len(released) == ends
        assert repr(t).startswith("<Transfer t1")


def test_end_reasons_fall_into_few_classes():
    from kvstream.telemetry import reason_class

    assert reason_class("completed", "") == "completed"
    assert reason_class("expired", "lease of 30s expired") == "expired"
    assert reason_class("failed", "peer lost: no heartbeat for 2.0s") == "peer_lost"
    assert reason_class("timed_out", "transfer deadline of 60s passed") == "timeout"
    assert reason_class("failed", "layer 3: KV holds inf or NaN in 2 scale groups") == "codec"
    assert reason_class("failed", "wire codec encode failed: RuntimeError('oom')") == "codec"
    assert reason_class("failed", "the cpu int8 backend is not available here") == "codec"
    assert reason_class("aborted", "agent shutting down") == "shutdown"
    assert reason_class("aborted", "aborted by the engine") == "aborted"
    assert reason_class("aborted", "aborted by decode-3: gave up") == "aborted_by_peer"
    assert reason_class("failed", "something new") == "failed"
