"""The push's inputs from outside, checked before use (no engine): a client may write
``kv_transfer_params``, and any signed peer may send a note."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                    reason="needs a real vLLM: bash .ci/vllm-env && .venv-vllm/bin/python -m "
                           "pytest tests/with_vllm (README command 3)")

from kvstream.adapters.vllm.common import push_request
from kvstream.adapters.vllm.push import DecodePushes, NoPush, PushNote, decode_note
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
    d = decode_params(plan, by="proxy-1")
    assert d["remote_request_id"] == plan.push_id and d["tp_size"] == 2
    assert d["kvstream"]["by"] == "proxy-1"


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
    never = PushNote(push_id="push-0123456789abcdef", state="failed", offered=False)
    assert decode_note(msgspec.json.encode(never)) == never
    assert b"offered" not in msgspec.json.encode(PushNote(push_id="push-0123456789abcdef",
                                                          state="failed"))  # older peers
    for bad in (b"", b"{}", b"\xff" * 10, b'{"push_id": "push-0123456789abcdef"}',
                b'{"push_id": "push-0123456789abcdef", "state": "eaten"}',
                b'{"push_id": "x", "state": "failed"}',
                b'{"push_id": "push-0123456789abcdef", "state": "failed", "extra": 1}',
                msgspec.json.encode({"push_id": "push-0123456789abcdef", "state": "failed",
                                     "reason": "r" * 600})):
        assert decode_note(bad) is None, bad


class _Reservation:
    """A reservation (``ReceiveHandle``) that ends only when aborted."""

    def __init__(self) -> None:
        import anyio

        self.done, self.why, self._ended = False, "", anyio.Event()

    async def abort(self, why: str) -> None:
        self.done, self.why = True, why
        self._ended.set()

    async def result(self):
        from types import SimpleNamespace

        await self._ended.wait()
        return SimpleNamespace(ok=False, reason=self.why)


class _Agent:
    def __init__(self) -> None:
        self.registry = self
        self.expected: list[_Reservation] = []

    def alive(self, instance: str) -> bool:
        return True

    def expect(self, push_id, blocks, have, src):
        self.expected.append(_Reservation())
        return self.expected[-1]


class _Rt:
    def __init__(self, tg) -> None:
        self.tg = tg

    def spawn(self, fn, *args):
        self.tg.start_soon(fn, *args)


PID = "push-0123456789abcdef"


@pytest.mark.anyio
async def test_a_failed_note_counts_from_the_source_rank_or_the_proxy_that_planned_it():
    """The proxy names itself in the decode params (``by``): its note, as the source
    rank's, ends the wait now (the prefill leg failed before any rank heard of it); a
    note from anyone else is ignored, and the reservation waits on."""
    import anyio

    async with anyio.create_task_group() as tg:
        pushes, agent = DecodePushes(_Rt(tg)), _Agent()
        fail = PushNote(push_id=PID, state="failed", reason="the prefill answered 500")

        async def started(handle) -> None:
            pushes.on_failed("stranger", fail)   # not one who may say so
            await anyio.sleep(0.05)
            assert not handle.done
            pushes.on_failed("proxy-1", fail)

        with anyio.fail_after(10):
            got = await pushes.take(agent, PID, [1, 2], [], "vllm-p", started, by="proxy-1")
        assert "proxy-1" in got.reason and "500" in got.reason
        # A note that comes before the decode rank expects is kept for then: from the proxy
        # it ends the next take at once (a stranger's later one does not hide it), from a
        # stranger it does not.
        pushes.on_failed("stranger", fail)
        pushes.on_failed("proxy-1", PushNote(push_id="push-" + "1" * 16, state="failed"))
        pushes.on_failed("stranger", PushNote(push_id="push-" + "1" * 16, state="failed"))
        with pytest.raises(NoPush, match="proxy-1"):
            await pushes.take(agent, "push-" + "1" * 16, [1], [], "vllm-p", started,
                              by="proxy-1")

        async def src_fails(handle) -> None:
            pushes.on_failed("vllm-p", fail)

        with anyio.fail_after(10):
            got = await pushes.take(agent, PID, [1], [], "vllm-p", src_fails)
        assert "vllm-p" in got.reason
        # The proxy could not reach the prefill engine: nothing was offered, and the take
        # says so (the load recomputes without a pull), whether the note came first or not.
        never = PushNote(push_id=PID, state="failed", reason="Cannot connect", offered=False)

        async def unreachable(handle) -> None:
            pushes.on_failed("proxy-1", never)

        for early in (False, True):
            if early:
                pushes.on_failed("proxy-1", never)
            with anyio.fail_after(10), pytest.raises(NoPush, match="Cannot connect") as err:
                await pushes.take(agent, PID, [1], [], "vllm-p",
                                  (lambda h: anyio.sleep(0)) if early else unreachable,
                                  by="proxy-1")
            assert err.value.offered is False
        tg.cancel_scope.cancel()


def test_the_load_is_announced_each_step_and_zero_once_vllm_idles():
    """Each step's load (requests held, KV blocks in use) goes to the agent when it
    changed; a forward however long is never idle; no step begun within ``IDLE_S`` of the
    last one's end (vLLM holds no request) announces 0."""
    import types

    from kvstream.adapters.vllm.load import IDLE_S, LoadReport

    now = [100.0]
    loads: list[tuple[int, int]] = []
    agent = types.SimpleNamespace(report_load=lambda *, requests, kv_used: loads.append(
        (requests, kv_used)))
    report = LoadReport(types.SimpleNamespace(agent=agent), clock=lambda: now[0])
    report.begin((2, 7))
    report.begin((2, 7))
    assert loads == [(2, 7)]
    now[0] += 10 * IDLE_S  # a long forward: still busy
    report.idle()
    assert loads == [(2, 7)]
    report.end()
    now[0] += IDLE_S / 2
    report.idle()
    assert loads == [(2, 7)]  # the next step is only late
    now[0] += IDLE_S
    report.idle()
    report.idle()
    assert loads == [(2, 7), (0, 0)] and report.reported == (0, 0)
    report.begin(None)  # a step without a load said: nothing to announce
    report.begin((1, 3))
    assert loads == [(2, 7), (0, 0), (1, 3)]


def test_early_failed_notes_are_bounded_per_sender():
    """A signed peer that floods "failed" notes for push ids nobody expects yet fills only
    its own share (its oldest go: stale ones must not block its new ones): the proxy's
    note for a real push is still kept, and counts."""
    from kvstream.adapters.vllm.push import MAX_EARLY_PER_SENDER

    pushes = DecodePushes(_Rt(None))
    for i in range(MAX_EARLY_PER_SENDER + 50):
        pushes.on_failed("flooder", PushNote(push_id=f"push-{i:016d}", state="failed"))
    pushes.on_failed("proxy-1", PushNote(push_id=PID, state="failed", reason="P leg: 502"))
    assert len(pushes._failed) == MAX_EARLY_PER_SENDER + 1
    assert pushes._failed[PID, "proxy-1"].reason == "P leg: 502"
    assert ("push-" + "0" * 16, "flooder") not in pushes._failed  # its oldest went
    assert (f"push-{MAX_EARLY_PER_SENDER + 49:016d}", "flooder") in pushes._failed
