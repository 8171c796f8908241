"""Signed control messages: who may speak for an instance (control/identity.py, the
registry's key book), and the in-memory bus refusing what does not check out."""

from __future__ import annotations

import anyio
import pytest

from kvstream.control import messages as m
from kvstream.control.identity import (
    BOX,
    FROM,
    KEY,
    SENDER,
    SIG,
    SUBJECT,
    Identity,
    Seal,
    open_sealed,
)
from kvstream.control.memory import MemoryBus, MemoryHub
from kvstream.control.registry import Registry

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_signature_checks_only_for_that_subject_sender_and_payload():
    me = Identity("p")
    headers = me.seal("kvs.x.inst.d.ctl", b"payload", {"traceparent": "t"})
    assert headers["traceparent"] == "t" and headers[FROM] == "p"
    anyone = lambda iid, key, announced: True  # noqa: E731
    assert open_sealed("kvs.x.inst.d.ctl", b"payload", headers, anyone) == "p"
    assert open_sealed("kvs.x.inst.e.ctl", b"payload", headers, anyone) is None  # redirected
    assert open_sealed("kvs.x.inst.d.ctl", b"payloaD", headers, anyone) is None  # tampered
    assert open_sealed("kvs.x.inst.d.ctl", b"payload", {**headers, FROM: "q"}, anyone) is None
    assert open_sealed("kvs.x.inst.d.ctl", b"payload", {}, anyone) is None  # unsigned
    for bad in ({SIG: "!!"}, {KEY: "A" * 10_000}, {SIG: ""}, {FROM: "x" * 2000}):
        assert open_sealed("kvs.x.inst.d.ctl", b"payload", {**headers, **bad}, anyone) is None
    assert open_sealed("kvs.x.inst.d.ctl", b"payload", headers, lambda i, k, a: False) is None


def test_the_first_key_of_an_id_holds_until_that_incarnation_left_or_went_silent():
    clock = Clock()
    reg = Registry(peer_timeout_s=1.0, clock=clock)
    old, new = Identity("p").public_key, Identity("p").public_key
    assert reg.bind_key("p", old) and reg.bind_key("p", old)
    assert not reg.bind_key("p", new) and reg.keys_refused == 1  # a forger, or too early
    clock.now = 0.9
    reg.contact("p")  # a checked message from the bound key keeps it alive
    clock.now = 1.5
    assert not reg.bind_key("p", new)
    clock.now = 2.0  # silent for more than the peer timeout: a restart takes over
    assert reg.bind_key("p", new) and not reg.bind_key("p", old)
    reg.leave("p")  # a signed leave: the next incarnation may bind at once
    assert reg.bind_key("p", old)


def test_an_announced_key_beats_a_squatter_and_a_tentative_key_never_replaces_it():
    """A key first seen off the registry (a squatter spamming requests under an id that has
    not announced yet) is only tentative: the real instance's announcement, on its own
    registry subject (which NATS permissions keep for it), takes the id at once; after
    that no key seen elsewhere replaces it, dead or alive, only a later announcement of a
    restart once the old incarnation left or went silent."""
    clock = Clock()
    reg = Registry(peer_timeout_s=1.0, clock=clock)
    squat, real, restart = (Identity("p").public_key for _ in range(3))
    assert reg.bind_key("p", squat)  # tentative
    assert reg.bind_key("p", real, announced=True)  # the real one takes it at once
    assert not reg.bind_key("p", squat) and not reg.bind_key("p", restart, announced=True)
    clock.now = 5.0  # the real one is silent: still no takeover from off the registry
    assert not reg.bind_key("p", squat)
    assert reg.bind_key("p", restart, announced=True)  # a restart announces itself
    assert reg.bind_key("p", restart)


def test_open_sealed_says_whether_the_key_was_announced():
    me = Identity("p")
    seen: list[bool] = []

    def trust(iid, key, announced):
        seen.append(announced)
        return True

    for subject in ("kvs.n.registry.p", "kvs.n.registry.q", "kvs.n.inst.p.ctl"):
        assert open_sealed(subject, b"x", me.seal(subject, b"x"), trust, "kvs.n.registry.")
    assert seen == [True, False, False]


def test_a_seal_counts_what_it_refuses_and_hands_the_checked_sender():
    reg = Registry(peer_timeout_s=1.0)
    seal = Seal()
    assert seal.incoming("s", b"x", {SENDER: "forged"}) == (b"x", {SUBJECT: "s"})  # off
    seal.trust = reg.bind_key
    signed = Identity("p").seal("s", b"x")
    opened = seal.incoming("s", b"x", signed)
    assert opened is not None and opened[1][SENDER] == "p"
    assert seal.incoming("s", b"x", {SENDER: "p"}) is None and seal.forged == 1
    assert seal.incoming("s", b"x", Identity("p").seal("s", b"x")) is None  # another key
    assert seal.forged == 2
    assert not seal.reply_from("s", b"x", signed, peer="q")  # a reply by the wrong peer
    assert seal.reply_from("s", b"x", signed, peer="p")


def test_a_boxed_message_opens_only_for_its_recipient_and_proves_its_sender():
    p, d, x = Identity("p"), Identity("d"), Identity("x")
    assert p.pair_key(d.public_key) == d.pair_key(p.public_key) != p.pair_key(x.public_key)
    assert p.pair_key(b"\0" * 31 + b"\x80") is None  # no curve point: refused, not raised
    data, headers = p.box("kvs.n.inst.d.ctl", b"secret", "d", d.public_key)
    assert b"secret" not in data and BOX in headers and SIG not in headers
    reg = Registry(peer_timeout_s=1.0)
    seal = Seal()
    seal.identity, seal.trust = d, reg.bind_key
    opened = seal.incoming("kvs.n.inst.d.ctl", data, headers)
    assert opened is not None and opened[0] == b"secret" and opened[1][SENDER] == "p"
    # Another subject, a flipped bit, another claimed sender, another recipient: refused.
    assert seal.incoming("kvs.n.inst.e.ctl", data, headers) is None
    assert seal.incoming("kvs.n.inst.d.ctl", data[:-1] + bytes([data[-1] ^ 1]), headers) is None
    assert seal.incoming("kvs.n.inst.d.ctl", data, {**headers, FROM: "q"}) is None
    other = Seal()
    other.identity, other.trust = x, Registry(peer_timeout_s=1.0).bind_key
    assert other.incoming("kvs.n.inst.d.ctl", data, headers) is None
    # An insider boxing under its own key while naming p: p's key is bound, so refused.
    forged, fh = x.box("kvs.n.inst.d.ctl", b"evil", "d", d.public_key)
    assert seal.incoming("kvs.n.inst.d.ctl", forged, {**fh, FROM: "p"}) is None
    assert seal.forged == 4 and other.forged == 1
    # A bus with no identity cannot open what is boxed: refused, counted.
    blind = Seal()
    assert blind.incoming("kvs.n.inst.d.ctl", data, headers) is None and blind.forged == 1


async def test_the_memory_bus_signs_and_refuses_like_nats():
    got: list[tuple[str, str]] = []

    async def handler(msg, headers):
        got.append((type(msg).__name__, headers.get(SENDER, "")))
        return m.AbortAck(transfer_id="t")

    async with MemoryHub() as hub:
        d, p, x = MemoryBus(hub, "d"), MemoryBus(hub, "p"), MemoryBus(hub, "x")
        reg_d, reg_p = Registry(peer_timeout_s=1.0), Registry(peer_timeout_s=1.0)
        d.seal.identity, d.seal.trust = Identity("d"), reg_d.bind_key
        p.seal.identity, p.seal.trust = Identity("p"), reg_p.bind_key
        await d.serve("kvs.t.inst.d.ctl", handler)
        abort = m.Abort(transfer_id="t", request_id="r", reason="x", by="p")
        reply = await p.request("kvs.t.inst.d.ctl", abort, timeout=1.0, peer="d")
        assert isinstance(reply, m.AbortAck)
        reply = await x.request("kvs.t.inst.d.ctl", abort, timeout=1.0)  # unsigned
        assert isinstance(reply, m.Reject) and reply.code == "unauthenticated"
        await anyio.sleep(0)
        assert got == [("Abort", "p")] and d.seal.forged == 1
