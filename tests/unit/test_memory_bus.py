"""MemoryBus keeps the NATS behaviour ControlBus gives an agent, and both match ControlPort."""

from __future__ import annotations

import functools
import inspect
import logging
import typing
from typing import TYPE_CHECKING

import anyio
import pytest

from kvstream._exceptions import ControlPlaneError, NoPeerError
from kvstream.control import messages as m
from kvstream.control.bus import ControlBus
from kvstream.control.identity import SUBJECT
from kvstream.control.memory import MemoryBus, MemoryHub, _matches
from kvstream.control.port import ControlPort
from kvstream.control.subjects import Subjects

if TYPE_CHECKING:  # mypy: both are ControlPorts
    def _ports(a: ControlBus, b: MemoryBus) -> tuple[ControlPort, ControlPort]:
        return a, b

S = Subjects("ns")


def _leave(who: str = "a") -> m.Leave:
    return m.Leave(instance_id=who)


def _done(i: int) -> m.Done:
    return m.Done(transfer_id=f"t{i}", request_id=f"r{i}", status="completed", bytes=i)


def _shape(cls: type, name: str) -> tuple[object, ...]:
    fn = getattr(cls, name)
    hints = typing.get_type_hints(fn)
    params = [(p.name, p.kind, p.default, hints.get(p.name))
              for p in inspect.signature(fn).parameters.values()]
    return inspect.iscoroutinefunction(fn), params, hints.get("return")


METHODS = ["request", "publish", "serve", "persist", "flush", "close"]


@pytest.mark.parametrize("impl", [ControlBus, MemoryBus])
@pytest.mark.parametrize("name", METHODS)
def test_buses_match_control_port(impl, name):
    assert _shape(impl, name) == _shape(ControlPort, name)


def test_control_port_surface_is_what_an_agent_uses():
    members = {n for n, v in vars(ControlPort).items() if callable(v) and not n.startswith("_")}
    assert members == set(METHODS)
    assert typing.get_type_hints(ControlPort)["malformed"] is int
    assert ControlBus(nc=object()).malformed == 0  # type: ignore[arg-type]
    assert MemoryBus(MemoryHub(), "x").malformed == 0


@pytest.mark.parametrize(("pattern", "subject", "hit"), [
    ("a.b.c", "a.b.c", True), ("a.b.c", "a.b", False), ("a.b", "a.b.c", False),
    ("a.*.c", "a.x.c", True), ("a.*", "a.x.c", False), ("a.*.c", "a.x.d", False),
    ("a.>", "a.x", True), ("a.>", "a.x.y.z", True), ("a.>", "a", False), (">", "a", True),
])
def test_nats_subject_matching(pattern, subject, hit):
    assert _matches(pattern.split("."), subject.split(".")) is hit


@pytest.mark.anyio
async def test_registry_wildcard_and_control_subjects_deliver_decoded_copies():
    got: dict[str, list[tuple[m.ControlUnion, dict[str, str]]]] = {"reg": [], "ctl": [], "all": []}

    def rec(key: str):
        async def handler(msg, headers):
            got[key].append((msg, headers))
            return None
        return handler

    async with MemoryHub() as hub:
        a, b = MemoryBus(hub, "a"), MemoryBus(hub, "b")
        await a.serve(S.registry_all, rec("reg"))
        await a.serve(S.control("a"), rec("ctl"))
        await b.serve(f"{S.prefix}.>", rec("all"))
        leave = _leave("b")
        await b.publish(S.registry("b"), leave, headers={"traceparent": "x"})
        await b.publish(S.control("a"), _done(1))
        await b.publish(f"{S.prefix}.registry.b.extra", _done(2))  # '*' is one token only
        await b.publish("other.registry.b", _done(3))
        await anyio.sleep(0.01)
    (msg, headers), = got["reg"]
    assert msg == leave and msg is not leave
    assert headers == {"traceparent": "x", SUBJECT: S.registry("b")}  # the subject it came on
    assert [x for x, _ in got["ctl"]] == [_done(1)]
    assert len(got["all"]) == 3  # b's own subscription hears b's messages (NATS echo)


@pytest.mark.anyio
async def test_request_reply_no_responders_and_timeout():
    async def answer(msg, headers):
        return m.AbortAck(transfer_id=msg.transfer_id + headers.get("h", ""))

    async def silent(msg, headers):
        return None

    async with MemoryHub() as hub:
        a, b = MemoryBus(hub, "a"), MemoryBus(hub, "b")
        await b.serve(S.control("b"), answer)
        await b.serve(S.control("quiet"), silent)
        abort = m.Abort(transfer_id="t", request_id="r", reason="x", by="a")
        reply = await a.request(S.control("b"), abort, timeout=1, headers={"h": "!"})
        assert reply == m.AbortAck(transfer_id="t!")
        with pytest.raises(NoPeerError) as gone:
            await a.request(S.control("c"), abort, timeout=1, peer="c")
        assert gone.value.no_responders and gone.value.peer == "c"
        with anyio.fail_after(1):
            with pytest.raises(NoPeerError) as late:
                await a.request(S.control("quiet"), abort, timeout=0.05, peer="quiet")
        assert not late.value.no_responders and late.value.peer == "quiet"
        assert "within" in str(late.value)


@pytest.mark.anyio
async def test_malformed_payload_is_counted_and_rejected():
    seen: list[m.ControlUnion] = []

    async def handler(msg, headers):
        seen.append(msg)
        return None

    async with MemoryHub() as hub:
        b = MemoryBus(hub, "b")
        await b.serve(S.control("b"), handler)
        reply = await hub.request_raw(S.control("b"), b"\xc1 not msgpack", timeout=1)
        assert isinstance(reply, m.Reject) and reply.code == "malformed"
        await hub.publish_raw(S.control("b"), m.encode(_leave())[:-2])
        await hub.publish_raw(S.control("b"), m.encode(_leave()))
        await anyio.sleep(0.01)
        assert b.malformed == 2 and seen == [_leave()]


@pytest.mark.anyio
async def test_handler_exception_is_logged_and_survived(caplog):
    calls = 0

    async def flaky(msg, headers):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return m.AbortAck(transfer_id="ok")

    async with MemoryHub() as hub:
        a, b = MemoryBus(hub, "a"), MemoryBus(hub, "b")
        await b.serve(S.control("b"), flaky)
        with (caplog.at_level(logging.ERROR, logger="kvstream.control"),
              pytest.raises(NoPeerError) as exc):
            await a.request(S.control("b"), _leave(), timeout=0.05)
        assert not exc.value.no_responders
        assert "control handler failed" in caplog.text and "boom" in caplog.text
        assert await a.request(S.control("b"), _leave(), timeout=1) == m.AbortAck(transfer_id="ok")


@pytest.mark.anyio
async def test_order_is_kept_and_a_slow_handler_never_holds_the_publisher():
    release = anyio.Event()
    order: list[int] = []

    async def slow(msg, headers):
        if not order:
            await release.wait()
        order.append(msg.bytes)
        return None

    async with MemoryHub() as hub:
        a, b = MemoryBus(hub, "a"), MemoryBus(hub, "b")
        await b.serve(S.control("b"), slow)
        with anyio.fail_after(1):  # 200 publishes while the handler is stuck on the first
            for i in range(200):
                await a.publish(S.control("b"), _done(i))
        await anyio.sleep(0.01)
        assert order == []  # not spawned: one message at a time, in order
        release.set()
        with anyio.fail_after(1):
            while len(order) < 200:
                await anyio.sleep(0.005)
    assert order == list(range(200))


@pytest.mark.anyio
@pytest.mark.parametrize("spawned", [True, False])
async def test_spawn_handles_each_request_in_its_own_task(spawned):
    """With ``spawn`` each request gets its own task (a slow one holds up no other); a
    publish is handled inline either way (its handler never waits)."""
    release = anyio.Event()
    handled: list[int] = []

    async def handler(msg, headers):
        if msg.bytes == 0:
            await release.wait()
        handled.append(msg.bytes)
        return m.AbortAck(transfer_id="ok")

    async with MemoryHub() as hub, anyio.create_task_group() as tg:
        b = MemoryBus(hub, "b")
        await b.serve(S.control("b"), handler, spawn=tg.start_soon if spawned else None)
        for i in range(3):
            tg.start_soon(functools.partial(b.request, S.control("b"), _done(i), timeout=2.0))
            await anyio.sleep(0.005)
        await anyio.sleep(0.02)
        assert handled == ([1, 2] if spawned else [])
        release.set()
        await anyio.sleep(0.02)
        assert handled == ([1, 2, 0] if spawned else [0, 1, 2])


@pytest.mark.anyio
async def test_close_unsubscribes_and_refuses_use():
    async def answer(msg, headers):
        return m.AbortAck(transfer_id="x")

    async with MemoryHub() as hub:
        a, b = MemoryBus(hub, "a"), MemoryBus(hub, "b")
        await b.serve(S.control("b"), answer)
        await b.flush()
        await b.close()
        await b.close()  # idempotent
        with pytest.raises(NoPeerError) as exc:
            await a.request(S.control("b"), _leave(), timeout=1)
        assert exc.value.no_responders
        for use in (b.publish(S.control("a"), _leave()), b.flush(),
                    b.request(S.control("a"), _leave(), timeout=1),
                    b.serve(S.control("b"), answer)):
            with pytest.raises(ControlPlaneError, match="closed"):
                await use


@pytest.mark.anyio
async def test_drop_rule_loses_messages_until_removed():
    async def answer(msg, headers):
        return m.AbortAck(transfer_id="x")

    async with MemoryHub() as hub:
        a, b = MemoryBus(hub, "a"), MemoryBus(hub, "b")
        await b.serve(S.control("b"), answer)
        undo = hub.drop(lambda subject, msg: isinstance(msg, m.AbortAck))  # lose the reply
        with pytest.raises(NoPeerError) as exc:
            await a.request(S.control("b"), _leave(), timeout=0.05)
        assert not exc.value.no_responders and hub.dropped == 1
        undo()
        assert isinstance(await a.request(S.control("b"), _leave(), timeout=1), m.AbortAck)


@pytest.mark.anyio
async def test_bad_subjects_and_a_closed_hub_are_control_plane_errors():
    async def handler(msg, headers):
        return None

    with pytest.raises(ControlPlaneError, match="not open"):
        await MemoryBus(MemoryHub(), "a").serve("a.b", handler)
    async with MemoryHub() as hub:
        bus = await hub.connect("a")
        for bad in ("a.*", "a.>", "a..b", ""):
            with pytest.raises(ControlPlaneError, match="subject"):
                await bus.publish(bad, _leave())
        with pytest.raises(ControlPlaneError, match="subject"):
            await bus.serve("a.>.b", handler)


@pytest.mark.anyio
async def test_a_queue_group_gets_each_message_once_like_nats():
    counts = {"plain": 0, "q1": 0, "q2": 0}

    def rec(key: str):
        async def handler(msg, headers):
            counts[key] += 1
        return handler

    async with MemoryHub() as hub:
        bus = await hub.connect("a")
        await bus.serve("x.y", rec("plain"))
        await bus.serve("x.y", rec("q1"), queue="q")
        await bus.serve("x.*", rec("q2"), queue="q")
        for _ in range(20):
            await bus.publish("x.y", m.Leave(instance_id="a"))
        with anyio.fail_after(5):
            while counts["plain"] < 20 or counts["q1"] + counts["q2"] < 20:
                await anyio.sleep(0.01)
        await anyio.sleep(0.05)
        assert counts["plain"] == 20 and counts["q1"] + counts["q2"] == 20
