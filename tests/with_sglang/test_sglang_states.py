"""The backend's sender and receiver against SGLang 0.5.23's rules for poll values, with
a manager stand-in (no agent: what these states do not reach): a sender reports only
Bootstrapping, WaitingForInput or Failed before ``init`` and never Bootstrapping after;
a receiver only Bootstrapping, WaitingForInput or Failed before ``send_metadata``; a
failure another rank decided raises with ``is_from_another_rank``; a concluded success
stays one; a zero-page last chunk is still sent; wrong page counts fail."""

from __future__ import annotations

import threading
import types

import pytest

pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="needs SGLang")

from sglang.srt.disaggregation.base.conn import KVPoll

from kvstream.adapters.sglang import notes
from kvstream.adapters.sglang.conn import KVStreamKVReceiver, KVStreamKVSender


class _Rt:
    def on_loop(self) -> bool:
        return True

    def spawn(self, fn, *args):  # nothing here streams
        raise AssertionError("no task expected")

    def call(self, fn, *args):
        return fn(*args)


class _Mgr:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rt = _Rt()
        self.senders: dict = {}
        self.receivers: dict = {}
        self.sent: list = []
        self.dropped = 0
        self.tp_size, self.rank = 1, 0
        self.bootstrap_timeout_s = self.waiting_timeout_s = 300.0
        self.drain_timeout_s = 1.0
        self.prefill_info_table = {"127.0.0.1:9": types.SimpleNamespace(tp_size=1, dp_size=1)}
        self.device = "cpu"

    def claim_want(self, room):
        return None

    def send_note(self, peer, note):
        self.sent.append((peer, note))

    def alive(self, instance):
        return True


def test_sender_states_before_and_after_init():
    mgr = _Mgr()
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=5)
    assert s.poll() == KVPoll.Bootstrapping
    s.wanted("dec", notes.Want(room=5, pages=3, prefix_len=32))
    assert s.poll() == KVPoll.WaitingForInput and s.pop_decode_prefix_len() == 32
    s.init(3, 0)
    assert s.poll() == KVPoll.WaitingForInput  # computing; never Bootstrapping again
    assert s.should_send_kv_chunk(0, True) and not s.should_send_kv_chunk(0, False)
    s.send([4, 5], None, num_kv_tokens=32)
    assert s.poll() == KVPoll.WaitingForInput and s.failure is None
    s.send([], [], num_kv_tokens=0)  # the last chunk short of a page: fails, tells the peer
    assert s.poll() == KVPoll.Failed and "2 pages sent for 3" in s.failure
    assert [type(n).__name__ for _, n in mgr.sent] == ["Drop"]
    with pytest.raises(Exception, match="2 pages sent for 3") as info:
        s.failure_exception()
    assert info.value.is_from_another_rank is False
    assert 5 not in mgr.senders  # cleared with its failure


def test_a_want_from_another_tp_degree_is_answered_with_drop():
    mgr = _Mgr()
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=6)
    s.wanted("dec", notes.Want(room=6, pages=1, tp_rank=1, tp_size=2))
    assert s.poll() == KVPoll.Failed and "equal TP" in s.failure
    assert mgr.sent and mgr.sent[0][0] == "dec"


def test_another_ranks_failure_stops_this_rank_and_says_so():
    mgr = _Mgr()
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=7)
    s.wanted("dec", notes.Want(room=7, pages=1))
    with pytest.raises(Exception, match="another rank") as info:
        s.failure_exception()  # this rank saw no failure: the all-reduce did
    assert info.value.is_from_another_rank is True
    assert s.poll() == KVPoll.Failed


def test_a_concluded_success_is_not_failed_by_a_late_drop():
    mgr = _Mgr()
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=8)
    s.wanted("dec", notes.Want(room=8, pages=1))
    s.init(1, 0)
    s.result = object()  # the offer completed
    assert s.poll() == KVPoll.Success
    s.dropped("late")
    assert s.poll() == KVPoll.Success and s.failure is None


def test_receiver_states_before_metadata_and_a_drop_from_a_stranger():
    mgr = _Mgr()
    r = KVStreamKVReceiver(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=9)
    assert r.poll() == KVPoll.Bootstrapping and r.kv_mgr is mgr and not r.require_staging
    r.init(0)
    assert r.poll() == KVPoll.WaitingForInput and r.conclude_state is None
    r.abort()
    assert r.poll() == KVPoll.Failed  # nothing streamed: stopped at once
    r2 = KVStreamKVReceiver(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=10)
    r2.init(0)
    r2.readied(notes.Ready(room=10, secret="s" * 16, tokens=1, pages=1))  # before metadata
    assert r2.ready is None and r2.poll() == KVPoll.WaitingForInput
