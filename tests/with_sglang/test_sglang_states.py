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

K = b"decode key"  # the key a decode instance signs its notes with


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
        self.prefill_info_table = {"127.0.0.1:9": types.SimpleNamespace(
            tp_size=1, dp_size=1, mla=False, page_size=16, total_kv_heads=2)}
        self.device = "cpu"
        self.opaque, self.total_kv_heads, self.is_mla = None, 2, False
        self.side = None
        self.kv_dtype, self.page_size = "auto/auto", 16
        self.keys: dict = {}  # instance -> the key it announced (default K)
        self.tps: dict = {}  # instance -> the (rank, size) it announced
        self.unannounced: set = set()

    def claim_early(self, room):
        return []

    def key_of(self, sender):
        return self.keys.get(sender, K)

    def rank_of(self, sender):
        return self.tps.get(sender)

    def decode_role(self, sender):
        return None if sender in self.unannounced else sender.startswith("dec")

    def send_note(self, peer, note):
        self.sent.append((peer, note))

    def alive(self, instance):
        return True


def test_sender_states_before_and_after_init():
    mgr = _Mgr()
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=5)
    assert s.poll() == KVPoll.Bootstrapping
    s.heard("dec", notes.Want(room=5, pages=3, prefix_len=32), K)
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
    """Without a head count (SGLang told none), only equal TP degrees move."""
    mgr = _Mgr()
    mgr.opaque = "SGLang told this rank no KV head count (kv_head_num)"
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=6)
    s.heard("dec", notes.Want(room=6, pages=1, tp_rank=1, tp_size=2, readers=2), K)
    assert s.poll() == KVPoll.Failed and "equal TP" in s.failure and "kv_head_num" in s.failure
    assert mgr.sent and mgr.sent[0][0] == "dec"


def test_wants_that_do_not_fit_the_rank_plan_are_dropped():
    """A decode rank of TP 2 reads its head of this TP 1 rank's offer, one of 2 readers:
    a Want that says otherwise (readers, the role, a rank past its TP, a peer that is no
    decode instance, other page counts than the first reader's) is dropped, not obeyed."""
    mgr = _Mgr()
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=16)
    for bad in (notes.Want(room=16, pages=2, tp_rank=0, tp_size=2, readers=1),
                notes.Want(room=16, pages=2, tp_rank=0, tp_size=2, readers=2, read=False),
                notes.Want(room=16, pages=2, tp_rank=2, tp_size=2, readers=2)):
        s.heard("dec0", bad, K)
    s.heard("prefill-x", notes.Want(room=16, pages=2, tp_rank=0, tp_size=2, readers=2), K)
    assert mgr.dropped == 4 and s.poll() == KVPoll.Bootstrapping
    s.heard("dec0", notes.Want(room=16, pages=2, tp_rank=0, tp_size=2, readers=2), K)
    s.heard("dec1", notes.Want(room=16, pages=3, tp_rank=1, tp_size=2, readers=2), K)
    assert mgr.dropped == 5 and list(s.wants) == ["dec0"]
    s.heard("dec1", notes.Want(room=16, pages=2, tp_rank=1, tp_size=2, readers=2), K)
    assert list(s.wants) == ["dec0", "dec1"] and s.poll() == KVPoll.WaitingForInput


def test_a_decode_of_another_kv_dtype_fails_the_request():
    mgr = _Mgr()
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=17)
    s.heard("dec", notes.Want(room=17, pages=1, kv_dtype="fp8_e4m3/auto"), K)
    assert s.poll() == KVPoll.Failed and "fp8_e4m3/auto" in s.failure


def test_a_rank_asked_but_not_read_succeeds_once_computed():
    """MLA over prefill TP 2, decode TP 1: rank 1's latent is not read; it is done once
    its last chunk is in (nothing offered, nothing told)."""
    mgr = _Mgr()
    mgr.tp_size, mgr.rank, mgr.is_mla, mgr.total_kv_heads = 2, 1, True, 0
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=18)
    s.heard("dec", notes.Want(room=18, pages=2, read=False), K)
    assert s.poll() == KVPoll.WaitingForInput
    s.init(2, 0)
    s.send([3, 4], [], num_kv_tokens=20)
    assert s.poll() == KVPoll.Success and mgr.sent == []


def test_another_ranks_failure_stops_this_rank_and_says_so():
    mgr = _Mgr()
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=7)
    s.heard("dec", notes.Want(room=7, pages=1), K)
    with pytest.raises(Exception, match="another rank") as info:
        s.failure_exception()  # this rank saw no failure: the all-reduce did
    assert info.value.is_from_another_rank is True
    assert s.poll() == KVPoll.Failed


def test_a_concluded_success_is_not_failed_by_a_late_drop():
    mgr = _Mgr()
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=8)
    s.heard("dec", notes.Want(room=8, pages=1), K)
    s.init(1, 0)
    s.result = object()  # the offer completed
    assert s.poll() == KVPoll.Success
    s.dropped("dec", "late")
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
    r2.readied(r2.srcs[0], notes.Ready(room=10, secret="s" * 16, tokens=1, pages=1))  # early
    assert r2.ready is None and r2.poll() == KVPoll.WaitingForInput


def test_abort_and_failure_exception_after_a_success_return_at_once():
    """SGLang may abort a request whose transfer already succeeded: nothing moves, so
    nothing is waited for (``drain_timeout_s`` would be spent otherwise)."""
    mgr = _Mgr()
    mgr.drain_timeout_s = 30.0
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=20)
    s.heard("dec", notes.Want(room=20, pages=1), K)
    s.init(1, 0)
    s.result = object()
    assert s.poll() == KVPoll.Success
    s.abort()
    assert s.stopped.is_set() and s.poll() == KVPoll.Success and mgr.sent == []


def test_a_refused_decode_tells_every_prefill_rank():
    """Another page size: refused at init, and both prefill ranks (TP 2) hear it, not only
    the one this rank would have read."""
    mgr = _Mgr()
    mgr.prefill_info_table["127.0.0.1:9"] = types.SimpleNamespace(
        tp_size=2, dp_size=1, mla=False, page_size=32, total_kv_heads=2)
    r = KVStreamKVReceiver(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=21)
    r.init(0)
    assert r.poll() == KVPoll.Failed and "page size" in r.failure
    told = sorted(peer for peer, n in mgr.sent if isinstance(n, notes.Drop))
    assert len(told) == 2 and told[0].endswith("tp0") and told[1].endswith("tp1")


def test_an_opaque_prefill_heeds_a_drop_from_another_tp_degree():
    mgr = _Mgr()
    mgr.opaque = "the pages carry speculative draft KV too"
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=22)
    s.heard("dec", notes.Drop(room=22, reason="refused", tp_rank=1, tp_size=2), K)
    assert s.poll() == KVPoll.Failed and "refused" in s.failure and mgr.dropped == 0


def test_a_want_after_the_failure_is_answered_with_a_drop():
    """Decode TP 2 over this TP 1 rank: rank 0 gave up before rank 1 asked; rank 1 hears
    it at once instead of waiting for its timeout."""
    mgr = _Mgr()
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=23)
    s.heard("dec0", notes.Want(room=23, pages=2, tp_rank=0, tp_size=2, readers=2), K)
    s.heard("dec0", notes.Drop(room=23, reason="aborted", tp_rank=0, tp_size=2), K)
    assert s.failure and mgr.sent == []  # dec0 knows
    s.heard("dec1", notes.Want(room=23, pages=2, tp_rank=1, tp_size=2, readers=2), K)
    assert [(p, type(n).__name__) for p, n in mgr.sent] == [("dec1", "Drop")]


def test_notes_are_checked_against_the_senders_announcement_and_key():
    """A note kept until its sender announced itself counts only under the key it came
    with; a Want must name the rank its sender announced, and one instance per rank."""
    mgr = _Mgr()
    mgr.unannounced.add("dec0")
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=24)
    s.heard("dec0", notes.Want(room=24, pages=2, tp_rank=0, tp_size=2, readers=2), b"forger")
    assert s.poll() == KVPoll.Bootstrapping and mgr.dropped == 0  # kept
    mgr.unannounced.clear()  # dec0 announced, with K
    assert s.poll() == KVPoll.Bootstrapping and mgr.dropped == 1 and not s.wants
    mgr.tps.update({"dec0": (0, 2), "dec1": (1, 2), "dec9": (1, 2)})
    s.heard("dec0", notes.Want(room=24, pages=2, tp_rank=1, tp_size=2, readers=2), K)
    assert mgr.dropped == 2  # it is rank 0
    s.heard("dec1", notes.Want(room=24, pages=2, tp_rank=1, tp_size=2, readers=2), K)
    s.heard("dec9", notes.Want(room=24, pages=2, tp_rank=1, tp_size=2, readers=2), K)
    s.heard("dec9", notes.Drop(room=24, tp_rank=1, tp_size=2), K)
    assert mgr.dropped == 4 and list(s.wants) == ["dec1"] and s.failure is None


def test_notes_before_the_manager_is_whole_are_held_then_heard_in_order():
    """A decode asks as soon as it sees the prefill's announcement, which comes before the
    manager has started its side-state agents: such notes are held, then heard in order."""
    import types

    from kvstream.adapters.sglang.manager import KVStreamKVManager, _dispatch

    heard: list = []
    mgr = types.SimpleNamespace(
        _held=[], dropped=0,
        on_want=lambda s, n: heard.append(("want", s, n.room)),
        on_ready=lambda s, n: heard.append(("ready", s, n.room)),
        on_drop=lambda s, n: heard.append(("drop", s, n.room)))
    handlers = mgr._handlers = _dispatch(mgr)
    handlers[notes.WANT]("dec", notes.encode(notes.Want(room=1, pages=1)))
    handlers[notes.DROP]("dec", notes.encode(notes.Drop(room=1)))
    handlers[notes.WANT]("dec", b"garbage")
    assert heard == [] and len(mgr._held) == 3
    KVStreamKVManager._hear_held(mgr)
    assert heard == [("want", "dec", 1), ("drop", "dec", 1)] and mgr.dropped == 1
    assert mgr._held is None
    handlers[notes.WANT]("dec", notes.encode(notes.Want(room=2, pages=1)))
    assert heard[-1] == ("want", "dec", 2)


def test_early_wants_are_bounded_per_sender():
    """Wants for rooms whose prefill request is not here yet are kept (they usually come
    first); one decode instance's flood of rooms that never come fills only its share,
    its oldest going first (stale rooms must not block its new ones)."""
    import collections
    import types

    from kvstream.adapters.sglang import manager as mm

    mgr = types.SimpleNamespace(
        _lock=threading.Lock(), senders={}, _early=collections.OrderedDict(),
        _early_count=0, _early_by=collections.Counter(), dropped=0,
        is_decode=lambda s: True, key_of=lambda s: K)
    mgr._forget_early = lambda gone: mm.KVStreamKVManager._forget_early(mgr, gone)
    mgr._drop_oldest_early = lambda s: mm.KVStreamKVManager._drop_oldest_early(mgr, s)
    for room in range(mm.MAX_EARLY_PER_SENDER + 10):
        mm.KVStreamKVManager.on_want(mgr, "flooder", notes.Want(room=room, pages=1))
    mm.KVStreamKVManager.on_want(mgr, "dec", notes.Want(room=10**6, pages=1))
    assert mgr.dropped == 10 and mgr._early_count == mm.MAX_EARLY_PER_SENDER + 1
    assert 9 not in mgr._early and mm.MAX_EARLY_PER_SENDER + 9 in mgr._early
    got = mm.KVStreamKVManager.claim_early(mgr, 10**6)
    assert [s for s, _, _ in got] == ["dec"] and "dec" not in mgr._early_by
    assert mgr._early_by["flooder"] == mm.MAX_EARLY_PER_SENDER


def test_a_drop_counts_from_a_decode_that_left_a_want_does_not():
    """A decode that refuses a request tells every prefill rank and may exit at once; a
    rank still starting holds the Drop and hears it after the decode left: it still
    fails the request (not waiting out its bootstrap timeout). A Want from a decode no
    longer alive is ignored (nobody would read the pages)."""
    import collections
    import types

    from kvstream.adapters.sglang import manager as mm

    mgr = types.SimpleNamespace(
        _lock=threading.Lock(), senders={}, _early=collections.OrderedDict(),
        _early_count=0, _early_by=collections.Counter(), dropped=0,
        is_decode=lambda s: False, decode_role=lambda s: True, key_of=lambda s: K)
    mm.KVStreamKVManager.on_want(mgr, "dec", notes.Want(room=5, pages=1))
    assert mgr.dropped == 1 and not mgr._early
    mm.KVStreamKVManager.on_want(mgr, "dec", notes.Drop(room=5, reason="refused"))
    assert mgr.dropped == 1 and [n for _, n, _ in mgr._early[5]] == [
        notes.Drop(room=5, reason="refused")]


class _Side:
    """A manager's side state as the sender and receiver read it: one component."""

    def __init__(self, kind: str, split: str) -> None:
        self.kinds = [kind]
        self.groups = [types.SimpleNamespace(component=0, kind=kind, split=split)]

    from kvstream.adapters.sglang.state import SideState

    equal_tp_only = SideState.equal_tp_only  # the manager's own rule, not a copy of it


def test_a_prefill_refuses_side_state_of_unknown_split_for_another_tp_degree():
    """The prefill checks too (a decode that did not refuse, or lied): Mamba state asked
    by a decode of TP 2 fails at its first Want, naming the kind; SWA pages by heads do
    not."""
    mgr = _Mgr()
    mgr.side = _Side("mamba", "item")
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=30)
    s.heard("dec0", notes.Want(room=30, pages=2, tp_rank=0, tp_size=2, readers=2,
                               state_kinds=["mamba"], state=[1]), K)
    assert s.poll() == KVPoll.Failed and "side state ['mamba'] moves only between equal TP" \
        in s.failure
    mgr.side = _Side("swa", "heads")
    s = KVStreamKVSender(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=31)
    s.heard("dec0", notes.Want(room=31, pages=2, tp_rank=0, tp_size=2, readers=2,
                               state_kinds=["swa"], state=[1]), K)
    assert s.poll() == KVPoll.WaitingForInput and s.failure is None


def test_a_gathers_sources_must_offer_the_same_side_state():
    """Decode TP 1 gathers from prefill ranks 0 and 1: a second Ready with other side state
    counts than the first fails the request rather than pull a mix."""
    mgr = _Mgr()
    mgr.prefill_info_table["127.0.0.1:9"] = types.SimpleNamespace(
        tp_size=2, dp_size=1, mla=False, page_size=16, total_kv_heads=2)
    mgr.side = _Side("swa", "heads")
    r = KVStreamKVReceiver(mgr=mgr, bootstrap_addr="127.0.0.1:9", bootstrap_room=32)
    r.init(0)
    assert len(r.srcs) == 2 and r.failure is None
    r.send_metadata([4, 5], 1, [[7, 8]])
    r.readied(r.srcs[0], notes.Ready(room=32, secret="s" * 16, tokens=20, pages=2,
                                     state_secrets=["t" * 16], state=[2]))
    assert r.failure is None and r.ready is None  # waits for rank 1
    r.readied(r.srcs[1], notes.Ready(room=32, secret="u" * 16, tokens=20, pages=2,
                                     state_secrets=["v" * 16], state=[1]))
    assert r.failure is not None and "side state counts [1]" in r.failure


@pytest.mark.parametrize("knob", [{"enable_kv_cache_sharding": True}, {"dcp_size": 2},
                                  {"enable_dp_attention": True}, {"dp_size": 2}])
def test_parallel_settings_kvstream_does_not_support_are_refused_at_once(knob):
    """KV cache sharding spreads an MLA model's pages and side state over the ranks, and
    decode context parallelism splits tokens: read as whole copies they would be wrong
    bytes, so the manager refuses them before it registers anything."""
    from kvstream import AdapterError
    from kvstream.adapters.sglang.manager import KVStreamKVManager

    with pytest.raises(AdapterError, match=r"does not support|for now"):
        KVStreamKVManager(types.SimpleNamespace(), types.SimpleNamespace(value="prefill"),
                          types.SimpleNamespace(tp_size=2, **knob), True)
