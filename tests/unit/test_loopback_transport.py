"""LoopbackTransport keeps the UCX tag semantics streams rely on; UcxWorker and it match
the Transport protocol."""

from __future__ import annotations

import inspect
import subprocess
import sys
import typing
from typing import TYPE_CHECKING

import anyio
import numpy as np
import pytest
import torch

from kvstream._exceptions import DataPlaneError
from kvstream.dataplane import wire
from kvstream.dataplane.loopback import LoopbackFabric, LoopbackRecv, LoopbackTransport
from kvstream.dataplane.transport import PostedReceive, Transport
from kvstream.dataplane.ucx import PostedRecv, UcxWorker

if TYPE_CHECKING:  # mypy: all of them fit the protocols
    def _fits(a: UcxWorker, b: LoopbackTransport, c: PostedRecv,
              d: LoopbackRecv) -> tuple[Transport, Transport, PostedReceive, PostedReceive]:
        return a, b, c, d

METHODS = ["send", "post_recv", "drain", "forget_peer", "close", "sweep", "check_address"]


def _shape(cls: type, name: str) -> tuple[object, ...]:
    fn = getattr(cls, name)
    hints = typing.get_type_hints(fn)
    params = [(p.name, p.kind, p.default, hints.get(p.name))
              for p in inspect.signature(fn).parameters.values()]
    ret = None if name == "post_recv" else hints.get("return")  # each has its own receive type
    return inspect.iscoroutinefunction(fn), params, ret


@pytest.mark.parametrize("impl", [UcxWorker, LoopbackTransport])
@pytest.mark.parametrize("name", METHODS)
def test_transports_match_the_protocol(impl, name):
    assert _shape(impl, name) == _shape(Transport, name)


@pytest.mark.parametrize("impl", [UcxWorker, LoopbackTransport, PostedRecv, LoopbackRecv])
def test_properties_and_receives_match(impl):
    proto = PostedReceive if "Recv" in impl.__name__ else Transport
    for name, member in vars(proto).items():
        if isinstance(member, property):
            assert isinstance(getattr(impl, name), property)
            assert (typing.get_type_hints(getattr(impl, name).fget)["return"]
                    == typing.get_type_hints(member.fget)["return"])
    if proto is PostedReceive:
        assert _shape(impl, "wait") == _shape(PostedReceive, "wait")
        assert typing.get_type_hints(PostedReceive)["tag"] is int
    assert PostedRecv(object(), 5).tag == 5
    members = {n for n, v in vars(Transport).items()
               if (callable(v) or isinstance(v, property)) and not n.startswith("_")}
    assert members == {*METHODS, "address"}


def test_importing_ucx_does_not_import_ucxx():
    code = "import sys, kvstream.dataplane.ucx; assert 'ucxx' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _pair() -> tuple[LoopbackFabric, LoopbackTransport, LoopbackTransport]:
    fabric = LoopbackFabric()
    return fabric, LoopbackTransport(fabric), LoopbackTransport(fabric)


def _msg(n: int, value: int) -> np.ndarray:
    return np.full(n, value, dtype=np.uint8)


@pytest.mark.anyio
async def test_a_receive_completes_only_on_its_exact_64_bit_tag():
    fabric, a, b = _pair()
    assert a.address != b.address
    high, low = (1 << 63) | 5, 5
    r_low, r_high = b.post_recv(np.zeros(4, np.uint8), low), b.post_recv(np.zeros(4, np.uint8), high)
    await a.send(b.address, _msg(4, 7), high)
    assert r_high.completed and not r_low.completed
    await r_high.wait()
    assert r_high.nbytes == 4 and fabric.bytes_delivered == 4
    with pytest.raises(DataPlaneError, match="64 bits"):
        b.post_recv(np.zeros(4, np.uint8), 1 << 64)


@pytest.mark.anyio
async def test_oldest_posted_receive_takes_the_first_message():
    _, a, b = _pair()
    bufs = [np.zeros(2, np.uint8) for _ in range(3)]
    recvs = [b.post_recv(buf, 9) for buf in bufs]
    for value in (1, 2):
        await a.send(b.address, _msg(2, value), 9)
    assert [r.completed for r in recvs] == [True, True, False]
    assert [int(buf[0]) for buf in bufs] == [1, 2, 0]


@pytest.mark.anyio
async def test_unexpected_messages_wait_in_order_per_tag():
    _, a, b = _pair()
    for value, tag in ((1, 3), (2, 4), (3, 3)):
        await a.send(b.address, _msg(2, value), tag)
    firsts = [b.post_recv(np.zeros(2, np.uint8), 3) for _ in range(2)]
    other = b.post_recv(np.zeros(2, np.uint8), 4)
    late = b.post_recv(np.zeros(2, np.uint8), 3)
    assert all(r.completed for r in (*firsts, other)) and not late.completed
    got = [bytes(r._view)[0] for r in (*firsts, other)]
    assert got == [1, 3, 2]


@pytest.mark.anyio
async def test_send_copies_at_once_and_takes_tensors_bytes_and_views():
    fabric, a, b = _pair()
    src = _msg(4, 1)
    recv_np = np.zeros(8, np.uint8)
    await a.send(b.address, src, 1)  # unexpected: the copy must not alias src
    src[:] = 99
    b.post_recv(recv_np, 1)
    assert recv_np.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]  # a shorter message is fine

    bf16 = torch.arange(4, dtype=torch.bfloat16)
    dst = torch.zeros(4, dtype=torch.bfloat16)
    r = b.post_recv(dst, 2)
    await a.send(b.address, bf16, 2)
    await r.wait()
    assert torch.equal(dst, bf16) and r.nbytes == 8

    view = memoryview(bytearray(8))
    b.post_recv(view, 3)
    await a.send(b.address, wire.encode_credit(5), 3)  # credits travel as bytes
    assert wire.decode_credit(view) == 5
    assert fabric.bytes_delivered == 4 + 8 + len(wire.encode_credit(5))
    with pytest.raises(DataPlaneError, match="read-only"):
        b.post_recv(b"12345678", 4)
    with pytest.raises(DataPlaneError, match="contiguous"):
        await a.send(b.address, np.zeros((4, 4), np.uint8)[:, 1], 4)


@pytest.mark.anyio
async def test_a_longer_message_fails_the_receive_as_truncated():
    fabric, a, b = _pair()
    buf = np.zeros(8, np.uint8)
    r = b.post_recv(buf, 1)
    await a.send(b.address, _msg(16, 5), 1)
    assert r.completed
    with pytest.raises(DataPlaneError, match="truncated"):
        await r.wait()
    assert not buf.any() and fabric.bytes_delivered == 0
    ok = b.post_recv(buf, 1)  # the failed message was consumed, the tag works on
    await a.send(b.address, _msg(8, 6), 1)
    await ok.wait()
    assert (buf == 6).all()


@pytest.mark.anyio
async def test_drain_completes_the_oldest_receive_without_writing():
    _, a, b = _pair()
    first, second = _msg(4, 0xAB), _msg(4, 0xCD)
    r1, r2 = b.post_recv(first, 7), b.post_recv(second, 7)
    await b.drain(7)
    assert r1.completed and not r2.completed
    await r1.wait()
    assert r1.nbytes == 0 and (first == 0xAB).all()

    await b.drain(8)  # nothing posted: waits as a zero-byte unexpected message
    buf = _msg(4, 0xEF)
    r3 = b.post_recv(buf, 8)
    assert r3.completed and (buf == 0xEF).all()
    await a.send(b.address, _msg(4, 1), 8)  # and did not swallow the next real message
    r4 = b.post_recv(buf, 8)
    assert r4.completed and (buf == 1).all()


@pytest.mark.anyio
async def test_kill_fails_receives_and_sends_to_it():
    fabric, a, b = _pair()
    r = b.post_recv(np.zeros(4, np.uint8), 1)
    fabric.kill(b.address)
    assert r.completed
    with pytest.raises(DataPlaneError, match="killed"):
        await r.wait()
    with pytest.raises(DataPlaneError, match="no loopback transport"):
        await a.send(b.address, _msg(4, 1), 1)
    with pytest.raises(DataPlaneError, match="killed"):
        b.post_recv(np.zeros(4, np.uint8), 1)
    with pytest.raises(DataPlaneError):
        fabric.kill(b.address)


@pytest.mark.anyio
async def test_close_fails_pending_receives_and_refuses_use():
    _, a, b = _pair()
    r = b.post_recv(np.zeros(4, np.uint8), 1)
    await b.close()
    await b.close()  # idempotent, like UcxWorker
    with pytest.raises(DataPlaneError, match="closed"):
        await r.wait()
    with pytest.raises(DataPlaneError):
        await a.send(b.address, _msg(4, 1), 1)
    for use in (b.send(a.address, _msg(1, 1), 1), b.drain(1)):
        with pytest.raises(DataPlaneError, match="closed"):
            await use
    with pytest.raises(DataPlaneError, match="closed"):
        b.post_recv(np.zeros(1, np.uint8), 1)
    with pytest.raises(DataPlaneError, match="no loopback transport"):
        await a.send(b"nowhere", _msg(1, 1), 1)


@pytest.mark.anyio
async def test_forget_peer_only_counts_and_a_waiting_receive_wakes():
    fabric, a, b = _pair()
    b2 = await fabric.open()
    a.forget_peer(b.address)
    assert a.forgotten == 1
    buf = np.zeros(2, np.uint8)
    r = b2.post_recv(buf, 1)

    async def later() -> None:
        await anyio.sleep(0.01)
        await a.send(b2.address, _msg(2, 4), 1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        with anyio.fail_after(1):
            await r.wait()
    assert (buf == 4).all() and fabric.messages_delivered == 1


@pytest.mark.anyio
async def test_a_sweep_drops_only_what_waits_on_no_live_tag():
    """Late, stray or forged messages on tags nobody will post for are dropped unread; one
    that came early for a live transfer stays for its receive."""
    fabric = LoopbackFabric()
    a, b = await fabric.open(), await fabric.open()
    live = {7 << 16}
    for tag in (1 << 16, 2 << 16, 7 << 16, 2 << 16):
        await b.send(a.address, np.frombuffer(b"x" * 8, dtype=np.uint8), tag)
    assert a.sweep(lambda t: t in live) == 3 and a.sweep(lambda t: t in live) == 0
    buf = np.zeros(8, dtype=np.uint8)
    await a.post_recv(buf, 7 << 16).wait()
    assert bytes(buf) == b"x" * 8
