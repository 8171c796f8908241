"""UCX hygiene between real processes: garbage tagged messages are swept, and our own
drain endpoint survives a forged peer carrying our address.

Process A (``_receiver``) opens a ``UcxWorker``; process B (``_garbage_sender``)
connects to A's address and floods it with tagged messages nobody receives: empty and
small eager ones, eager ones in several fragments, rendezvous ones up to 8 MB. Both are
children, so a UCX abort fails the test instead of killing pytest, and A's RSS is its
own.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import time
from typing import Any

import anyio
import numpy as np
import pytest

ROUNDS = 5
SMALL_PER_ROUND = 2_000  # 10,000 small messages swept in all
SMALL_BYTES = 1_024
EMPTY_PER_ROUND = 10  # zero-byte ones too, as drain sends
LARGE_BYTES = 8 << 20  # one per round: rendezvous on every transport here
# One each per round, between the two: eager in several fragments, below and above
# the 64 KiB sweep scratch (a truncated multi-fragment message must drop its tail too).
MEDIUM_BYTES = (40_000, 100_000, 1 << 20)
PER_ROUND = SMALL_PER_ROUND + EMPTY_PER_ROUND + len(MEDIUM_BYTES) + 1
FRESH_TAG = 0x5EED_0000_0000_0001
POISON = b"poison!!" * 128
PAYLOAD = bytes(range(256)) * 4

# What UCX keeps per unexpected eager message: one receive segment. Between two local
# processes that is the shared-memory FIFO's copy-out segment (UCX_MM_SEG_SIZE, 8256
# bytes by default in UCX 1.21), whatever the payload; plus a descriptor header.
HELD_PER_MESSAGE = 8256 + 256
# UCX's pools keep segments once grown, so A's RSS settles at one round's peak. Later
# rounds may add only this: Python objects, allocator slack. Measured: < 0.5 MiB.
RSS_MARGIN = 3 << 20

pytestmark = pytest.mark.timeout(180)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _head() -> Any:
    """The oldest unexpected message, left in place."""
    import ucxx
    from ucxx.types import Tag, TagMask

    return ucxx.core._get_ctx().worker.tag_probe(Tag(0), TagMask(0), remove=False)


def _receiver(to_b: Any, from_b: Any, out: Any) -> None:
    """Process A: sweep every round, then take a message on a fresh tag, then drain."""
    from kvstream.dataplane import ucx as ucx_mod
    from kvstream.dataplane.ucx import UcxWorker

    async def expect(word: str) -> None:
        assert await anyio.to_thread.run_sync(from_b.get, True, 60) == word

    async def sweep_all() -> dict[str, Any]:
        held, t0, swept, calls = _rss(), time.perf_counter(), 0, 0
        reqs: dict[int, Any] = {}
        while (n := w.sweep(lambda tag: False)) > 0:
            swept, calls = swept + n, calls + 1
            reqs.update((id(r), r) for r in ucx_mod._Shared.discards)
        took = time.perf_counter() - t0
        empty = not _head().matched
        with anyio.fail_after(30):
            while not all(r.completed for r in reqs.values()):
                await anyio.sleep(0.01)
        truncated = sum(r.status != 0 for r in reqs.values())
        return dict(swept=swept, calls=calls, seconds=took, empty=empty, truncated=truncated,
                    held=held, after=_rss())

    async def main() -> None:
        nonlocal w
        w = await UcxWorker.open()
        try:
            # Warm up what is kept anyway: the self endpoint and the sweep scratch.
            warm = w.post_recv(np.empty(8, np.uint8), 0x77)
            await w.drain(0x77)
            with anyio.fail_after(10):
                await warm.wait()
            w.sweep(lambda tag: False)
            rss_start = _rss()
            to_b.put(w.address)
            rounds = []
            for _ in range(ROUNDS):
                await expect("sent")
                rounds.append(await sweep_all())
                to_b.put("swept")
            # Control: two rounds' worth held at once grows RSS past the settled peak.
            await expect("sent-twice")
            unswept = _rss()
            control = await sweep_all()
            to_b.put("swept")
            # Sweeping while B floods: UCX's progress thread delivers meanwhile.
            await expect("flooding")
            during = 0
            while True:
                during += w.sweep(lambda tag: False)
                try:
                    done = from_b.get_nowait() == "flooded"
                except queue.Empty:
                    done = False
                if done:
                    break
                await anyio.sleep(0.001)
            await anyio.sleep(0.3)
            while (n := w.sweep(lambda tag: False)) > 0:
                during += n
            during_empty = not _head().matched
            to_b.put("swept")
            # A live tag stops the sweep and keeps its message for its own receive.
            await expect("sent-live")
            kept = w.sweep(lambda tag: tag == FRESH_TAG + 1)
            head = _head()
            live_kept = head.matched and int(head.sender_tag.value) == FRESH_TAG + 1
            live = w.post_recv(np.empty(SMALL_BYTES, np.uint8), FRESH_TAG + 1)
            with anyio.fail_after(30):
                await live.wait()
            # B poisons FRESH_TAG before anyone owns it; the sweep removes that, and the
            # receive posted on it afterwards gets exactly B's real message.
            await expect("poisoned")
            poison_swept = w.sweep(lambda tag: False)
            buf = np.zeros(len(PAYLOAD), np.uint8)
            posted = w.post_recv(buf, FRESH_TAG)
            to_b.put("posted")
            with anyio.fail_after(30):
                await posted.wait()
            # A forged peer naming our address: an endpoint cached for it, then forgotten.
            await w.send(w.address, np.zeros(8, np.uint8), FRESH_TAG + 2)
            w.forget_peer(w.address)
            drained = 0
            for tag in (0x1001, 0x1002):
                r = w.post_recv(np.empty(8, np.uint8), tag)
                await w.drain(tag)
                with anyio.fail_after(10):
                    await r.wait()
                drained += 1
            out.put(dict(rss_start=rss_start, rounds=rounds, unswept=unswept, control=control,
                         during=during, during_empty=during_empty,
                         kept=kept, live_kept=live_kept, poison_swept=poison_swept,
                         fresh_ok=buf.tobytes() == PAYLOAD, drained=drained))
        finally:
            await w.close()

    w: Any = None
    anyio.run(main)


def _garbage_sender(from_a: Any, to_a: Any, out: Any) -> None:
    """Process B: floods A with tags nobody owns, then sends one real message."""
    from kvstream.dataplane.ucx import UcxWorker

    async def main() -> None:
        rng = random.Random(7)
        w = await UcxWorker.open()
        big_done = 0

        async def send_big(peer: bytes, large: np.ndarray) -> None:
            nonlocal big_done
            with anyio.move_on_after(1.0):  # A's sweep dequeues it unread: it never completes
                await w.send(peer, large, rng.getrandbits(64) | 1 << 63)
                big_done += 1

        async def expect(word: str) -> None:
            assert await anyio.to_thread.run_sync(from_a.get, True, 60) == word

        try:
            peer = await anyio.to_thread.run_sync(from_a.get, True, 60)
            small = np.frombuffer(rng.randbytes(SMALL_BYTES), np.uint8)
            large = np.zeros(LARGE_BYTES, np.uint8)
            for smalls, word in [(SMALL_PER_ROUND, "sent")] * ROUNDS + [
                    (2 * SMALL_PER_ROUND, "sent-twice")]:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(send_big, peer, large)
                    for n in MEDIUM_BYTES:
                        tg.start_soon(send_big, peer, large[:n])
                    for _ in range(smalls):
                        await w.send(peer, small, rng.getrandbits(63))
                    for _ in range(EMPTY_PER_ROUND):
                        await w.send(peer, small[:0], rng.getrandbits(63))
                    await anyio.sleep(0.3)  # let the last eager sends land
                    to_a.put(word)
                    await expect("swept")
            to_a.put("flooding")
            for _ in range(SMALL_PER_ROUND):
                await w.send(peer, small, rng.getrandbits(63))
            to_a.put("flooded")
            await expect("swept")
            await w.send(peer, small, FRESH_TAG + 1)
            await anyio.sleep(0.5)
            to_a.put("sent-live")
            await w.send(peer, np.frombuffer(POISON, np.uint8), FRESH_TAG)
            await anyio.sleep(0.2)
            to_a.put("poisoned")
            await expect("posted")
            await w.send(peer, np.frombuffer(PAYLOAD, np.uint8), FRESH_TAG)
            out.put(dict(big_done=big_done))
            await anyio.sleep(1)  # A may still be reading
        finally:
            await w.close()

    anyio.run(main)


def _result(q: Any, procs: tuple[Any, ...], timeout: float) -> Any:
    """The next result on ``q``; fails at once when a child died instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a child process died: exit codes {dead}"
    raise AssertionError(f"no result in {timeout} s")


def test_sweep_empties_the_unexpected_queue_and_keeps_rss_flat():
    ctx = mp.get_context("spawn")
    a_to_b, b_to_a, a_out, b_out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    a = ctx.Process(target=_receiver, args=(a_to_b, b_to_a, a_out), daemon=True)
    b = ctx.Process(target=_garbage_sender, args=(a_to_b, b_to_a, b_out), daemon=True)
    a.start()
    b.start()
    try:
        ra = _result(a_out, (a, b), 150)
        rb = _result(b_out, (a, b), 30)
    finally:
        for p in (a, b):
            p.join(20)
            if p.is_alive():
                p.kill()
    assert a.exitcode == 0 and b.exitcode == 0, (a.exitcode, b.exitcode)
    rounds, control = ra["rounds"], ra["control"]
    for r in [*rounds, control]:
        assert r["empty"], r
        assert r["truncated"] == 0, r  # only messages of at most 8 KiB are received
    assert [r["swept"] for r in rounds] == [PER_ROUND] * ROUNDS
    assert [r["calls"] for r in rounds] == [2] * ROUNDS  # 1024 at most per call
    assert control["swept"] == PER_ROUND + SMALL_PER_ROUND
    # The larger ones were dequeued unread (receiving them reads from their sender, which
    # crashed UCX when it had died meanwhile): their sends never complete.
    assert rb["big_done"] == 0
    # Round 1 keeps one round's segments (no 8 MB allocation for the large message) ...
    first = rounds[0]["after"] - ra["rss_start"]
    assert first <= SMALL_PER_ROUND * HELD_PER_MESSAGE + RSS_MARGIN, (first, ra)
    # ... and after that RSS does not grow with the number of messages swept ...
    grown = rounds[-1]["after"] - rounds[0]["after"]
    assert grown <= RSS_MARGIN, (grown, ra)
    # ... while holding twice as many at once does: the sweep is what bounds it.
    assert ra["unswept"] - rounds[-1]["after"] >= SMALL_PER_ROUND * HELD_PER_MESSAGE // 2, ra
    assert ra["during"] == SMALL_PER_ROUND and ra["during_empty"]
    assert ra["kept"] == 0 and ra["live_kept"]
    assert ra["poison_swept"] == 1
    assert ra["fresh_ok"]
    assert ra["drained"] == 2
    rate = sum(r["swept"] for r in rounds) / sum(r["seconds"] for r in rounds)
    mib = 1 << 20
    print(f"\nsweep {rate:,.0f} messages/s; A's RSS: start {ra['rss_start'] / mib:.1f} MiB, "
          + ", ".join(f"{r['held'] / mib:.1f} -> {r['after'] / mib:.1f}" for r in rounds)
          + f"; twice unswept {ra['unswept'] / mib:.1f} -> {control['after'] / mib:.1f} MiB")
