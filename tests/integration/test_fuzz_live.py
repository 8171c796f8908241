"""A real attack while transfers run (processes: nats-server, prefill, decode, attacker).

The attacker uses only what any NATS client and any UCX worker can: it learns instance
ids and worker addresses from the registry (what the documented permissions layout lets
any tenant read; with KVSTREAM_FUZZ_SNIFF=1 it also sniffs control subjects and inboxes,
as on a server without per-subject permissions, where data-plane tags and secrets travel
in the clear and injected layers can land: docs/architecture.md says so), then sprays N
fuzzed control messages and M garbage tagged UCX messages (tests/integration/attacker.py
says what they are), and at the end dies (SIGKILL) with rendezvous sends in flight.
Honest pushes and pulls run all along, three at a time; every completed one's bytes are
checked at the destination.

After the attack: both agents alive, a fresh push, pull and staged push complete with the
right bytes, RSS grew less than 50 MB, nothing is left held, both exit 0, and every honest
transfer either completed with the right bytes or ended cleanly (never "completed" with
wrong bytes, never hung). Every failed check is collected, so one run reports them all;
``-s`` prints the figures (messages, rates, RSS, statistics, outcomes).

Environment (CI runs the defaults):

    KVSTREAM_FUZZ_CONTROL=20000   fuzzed control messages (the full bar: 100000)
    KVSTREAM_FUZZ_DATA=2000       garbage UCX messages (the full bar: 10000)
    KVSTREAM_FUZZ_SNIFF=0         1: the attacker also reads control subjects and inboxes
    KVSTREAM_FUZZ_RATE=10000      control messages per second (0: as fast as it can)
    KVSTREAM_FUZZ_SEED=1
    KVSTREAM_FUZZ_ONLY=           to bisect: label prefixes, e.g. forged_manifest,replay
                                  (attacker.LABELS lists them)
    KVSTREAM_FUZZ_KEEP_ADDRESS_VERSION=0   1: forged addresses keep the byte UCX asserts on
    KVSTREAM_FUZZ_ATTACKER_CRASH=1         0: the attacker exits quietly at the end

    KVSTREAM_FUZZ_CONTROL=100000 KVSTREAM_FUZZ_DATA=10000 \
        pytest tests/integration/test_fuzz_live.py -s        # the full bar
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import os
import queue
import random
import signal
import threading
import time
from typing import Any

import pytest

from tests.fakes import small_layout
from tests.integration.attacker import Fleet, Plan, attacker_process

N_CONTROL = int(os.environ.get("KVSTREAM_FUZZ_CONTROL", "20000"))
M_DATA = int(os.environ.get("KVSTREAM_FUZZ_DATA", "2000"))
SNIFF = os.environ.get("KVSTREAM_FUZZ_SNIFF", "0") != "0"
RATE = float(os.environ.get("KVSTREAM_FUZZ_RATE", "10000"))  # control messages/s; 0: flat out
SEED = int(os.environ.get("KVSTREAM_FUZZ_SEED", "1"))
ONLY = tuple(k for k in os.environ.get("KVSTREAM_FUZZ_ONLY", "").split(",") if k)
KEEP_VERSION = os.environ.get("KVSTREAM_FUZZ_KEEP_ADDRESS_VERSION", "0") == "1"
CRASH_AT_END = os.environ.get("KVSTREAM_FUZZ_ATTACKER_CRASH", "1") != "0"
RSS_GROWTH_LIMIT = 50 << 20
ATTACK_LIMIT_S = 900.0  # the attack (all N and M) must be over by then
NBLOCKS, LANES, LANE_BLOCKS = 64, 3, 20
P, D = "fuzz-prefill", "fuzz-decode"
AT_REST = ("transfers_active", "reservations_active", "staging_bytes_in_use", "held_active",
           "leases_active", "staged_transfers")


# -- factories (one place to update when the configuration or the API changes) -----------

def agent_config(instance_id: str, nats_url: str, **kw: Any) -> dict[str, Any]:
    """AgentConfig fields of the agents under attack (short timeouts: a transfer the
    attack breaks must end within seconds, not at the 60 s default)."""
    return dict(instance_id=instance_id, nats_url=nats_url, heartbeat_s=0.25,
                peer_timeout_s=1.5, request_timeout_s=1.0, transfer_timeout_s=8.0,
                reservation_timeout_s=4.0, lease_s=3.0, staging_wait_s=1.0, **kw)


def plan(rng: random.Random, lane: int, n: int) -> dict[str, Any]:
    """One honest transfer: push (reserved first, or staged first) or pull of an offer.
    Each lane owns destination blocks of its own; sources are shared (only read)."""
    nb = rng.randint(1, 6)
    lo = lane * LANE_BLOCKS
    if rng.random() < 0.3:  # a contiguous run: the direct (zero-copy) framing
        start = rng.randrange(lo, lo + LANE_BLOCKS - nb + 1)
        dst = list(range(start, start + nb))
    else:
        dst = rng.sample(range(lo, lo + LANE_BLOCKS), nb)
    if rng.random() < 0.3:
        start = rng.randrange(NBLOCKS - nb + 1)
        src = list(range(start, start + nb))
    else:
        src = rng.sample(range(NBLOCKS), nb)
    kind = rng.choice(["push", "push", "push_staged", "pull", "pull"])
    return dict(kind=kind, rid=f"h{lane}-{n}", src=src, dst=dst,
                mode=rng.choice(["pipelined", "eager"]), pull_mode=rng.choice(["eager", "lazy"]))


def pass_on(started: tuple[Any, ...]) -> dict[str, Any]:
    """What the first side's handle gives the second (protocol 2: an offer's secret)."""
    extras = started[2] if len(started) > 2 else {}
    return {"secret": extras["secret"]} if extras.get("secret") else {}


def request_id_hints() -> list[str]:
    """What an attacker guesses without sniffing: predictable request ids."""
    return [f"h{lane}-{n}" for lane in range(LANES) for n in range(400)]


# -- honest transfers ---------------------------------------------------------------------

class Tally:
    """Outcomes of honest transfers; what must never happen is also kept in ``problems``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        self.completed = self.total = 0

    def add(self, p: dict[str, Any], src: tuple[Any, ...] | None, dst: tuple[Any, ...] | None
            ) -> None:
        src_status = src[2] if src else "no answer"
        dst_status = dst[2] if dst else "no answer"
        with self.lock:
            self.total += 1
            self.outcomes[f"{p['kind']}: src {src_status} / dst {dst_status}"] += 1
            if dst and dst[2] == "completed":
                if dst[4]:
                    self.completed += 1
                else:
                    self.problems.append(f"WRONG BYTES: {p} completed at the destination with "
                                         "bytes that are not the source's")
            for side, msg in (("source", src), ("destination", dst)):
                if msg is not None and msg[2] in ("died", "killed"):
                    continue  # the process died: PROCESS DEATH says so
                if msg is None:
                    self.problems.append(f"HUNG: {p}: no outcome from the {side}")
                elif msg[2] in ("HUNG", "ERROR"):
                    self.problems.append(f"{msg[2]}: {p} at the {side}: {msg[3]}")


def transfer(fleet: Fleet, p: dict[str, Any], tally: Tally) -> None:
    """Run one planned transfer to its end on both sides."""
    kind, rid = p["kind"], p["rid"]
    first: tuple[str, str, dict[str, Any]]
    then: tuple[str, str, dict[str, Any]]
    push = (P, "push", dict(rid=rid, peer=D, src=p["src"], mode=p["mode"]))
    expect = (D, "expect", dict(rid=rid, peer=P, dst=p["dst"], src=p["src"]))
    if kind == "push":
        first, then = expect, push
    elif kind == "push_staged":
        first, then = push, expect
    else:
        first = (P, "offer", dict(rid=rid, src=p["src"], mode=p["mode"]))
        then = (D, "pull", dict(rid=rid, peer=P, dst=p["dst"], src=p["src"], mode=p["pull_mode"]))
    t1 = fleet.send(first[0], first[1], **first[2])
    started = fleet.wait(t1, ("started", "result"))
    t2 = None
    if started is not None and started[0] == "started":
        t2 = fleet.send(then[0], then[1], **then[2], **pass_on(started))
    r1 = started if started is not None and started[0] == "result" else fleet.wait(t1)
    r2 = fleet.wait(t2) if t2 is not None else ("result", "", "not asked", "", None)
    fleet.forget(t1)
    if t2 is not None:
        fleet.forget(t2)
    src, dst = (r1, r2) if first[0] == P else (r2, r1)
    tally.add(p, src, dst)


def lanes(fleet: Fleet, tally: Tally, stop: threading.Event, seed: int, *,
          count: int | None = None) -> list[threading.Thread]:
    """LANES threads running transfers one after another until ``stop`` (or ``count`` each)."""
    def run(lane: int) -> None:
        rng = random.Random(seed * 100 + lane)
        for n in range(count or 10**9):
            if stop.is_set() or not all(fleet.procs[x].is_alive() for x in (P, D)):
                return
            transfer(fleet, plan(rng, lane, seed * 10_000 + n), tally)

    threads = [threading.Thread(target=run, args=(lane,), daemon=True) for lane in range(LANES)]
    for t in threads:
        t.start()
    return threads


def _death(proc: Any) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _at_rest(stats: dict[str, Any] | None) -> bool:
    return stats is not None and all(stats[k] == 0 for k in AT_REST)


# -- the test -------------------------------------------------------------------------------

@pytest.mark.timeout(1800)
def test_agents_survive_a_live_attack(nats_server):
    ctx = mp.get_context("spawn")
    lay = small_layout(layers=4)
    fleet = Fleet(ctx, lay, NBLOCKS)
    problems: list[str] = []
    cmd_q, out_q = ctx.Queue(), ctx.Queue()
    attack = Plan(nats_url=nats_server.url, victims=[P, D], n_control=N_CONTROL, n_data=M_DATA,
                  seed=SEED, sniff=SNIFF, rate=RATE, request_hints=request_id_hints(), only=ONLY,
                  keep_version=KEEP_VERSION, crash_at_end=CRASH_AT_END)
    attacker = ctx.Process(target=attacker_process, args=(attack, cmd_q, out_q), daemon=True,
                           name="attacker")
    figures: dict[str, Any] = {}
    try:
        fleet.start(P, agent_config(P, nats_server.url))
        fleet.start(D, agent_config(D, nats_server.url))
        warm = Tally()
        for t in lanes(fleet, warm, threading.Event(), seed=0, count=10):
            t.join(300)
        assert warm.completed == warm.total == 10 * LANES, (warm.outcomes, warm.problems)
        before = {name: fleet.stats(name) for name in (P, D)}

        tally, stop = Tally(), threading.Event()
        attacker.start()
        kind, *ready = out_q.get(timeout=60)
        assert kind == "ready" and set(ready[0]) >= {P, D}, (kind, ready)
        t0 = time.monotonic()
        honest = lanes(fleet, tally, stop, seed=SEED)
        peak = {P: 0, D: 0}
        done = None
        while done is None and time.monotonic() - t0 < ATTACK_LIMIT_S:
            with contextlib.suppress(queue.Empty):
                done = out_q.get(timeout=1.0)
            for name in (P, D):
                if fleet.procs[name].is_alive():
                    peak[name] = max(peak[name], _rss(fleet.pid(name)))
            if not all(fleet.procs[n].is_alive() for n in (P, D)) or not attacker.is_alive():
                break
        attack_s = time.monotonic() - t0
        figures["attack"] = done[1] if done is not None else (
            "the attacker did not finish" + ("" if attacker.is_alive() else
                                              f" (it died: {_death(attacker)})"))
        if done is None and (not attacker.is_alive() or attack_s >= ATTACK_LIMIT_S):
            problems.append(f"HARNESS: {figures['attack']} within {attack_s:.0f} s")
        time.sleep(3.0)  # honest traffic goes on a little after the last forged message
        stop.set()
        for t in honest:
            t.join(120)
            if t.is_alive():
                problems.append("an honest lane is still waiting after 120 s")
        problems += tally.problems
        dead = [f"{n} died ({_death(fleet.procs[n])})" for n in (P, D)
                if not fleet.procs[n].is_alive()]
        problems += [f"PROCESS DEATH: {d}" for d in dead]

        after: dict[str, Any] = {}
        if not dead:
            settled = time.monotonic() + 40
            while time.monotonic() < settled:
                after = {name: fleet.stats(name) for name in (P, D)}
                if all(_at_rest(s) for s in after.values()):
                    break
                time.sleep(0.5)
            for name, s in after.items():
                if not _at_rest(s):
                    problems.append(f"NOT AT REST 40 s after the attack: {name} " + (
                        str({k: s[k] for k in AT_REST}) if s else "gave no statistics"))
            fresh = Tally()
            for i, kind_ in enumerate(["push", "pull", "push_staged"]):
                p = plan(random.Random(i), 0, 900_000 + i)
                transfer(fleet, {**p, "kind": kind_}, fresh)
            if fresh.completed != 3:
                problems.append(f"FRESH TRANSFERS after the attack: {dict(fresh.outcomes)} "
                                f"{fresh.problems}")
            after = {name: fleet.stats(name) for name in (P, D)}
            for name in (P, D):
                b, a = before[name], after[name]
                if a is None:
                    problems.append(f"{name} gave no statistics after the attack")
                elif a["rss"] - b["rss"] >= RSS_GROWTH_LIMIT:
                    problems.append(f"RSS GROWTH: {name} {b['rss'] >> 20} -> {a['rss'] >> 20} MiB "
                                    f"(peak {peak[name] >> 20} MiB; limit +50 MB)")
        cmd_q.put(("stop",))
        attacker.join(30)
        for name in (P, D):
            if fleet.procs[name].is_alive():
                code = fleet.stop(name)
                if code != 0:
                    problems.append(f"UNCLEAN EXIT: {name} {_death(fleet.procs[name])}")
        _print_figures(figures, attack_s, before, after, peak, tally, warm)
    finally:
        if attacker.is_alive():
            attacker.kill()
        fleet.close()
    assert not problems, "\n".join(problems)


def _rss(pid: int) -> int:
    from tests.integration.attacker import rss_bytes

    try:
        return rss_bytes(pid)
    except OSError:
        return 0


def _print_figures(figures: dict[str, Any], attack_s: float, before: dict[str, Any],
                   after: dict[str, Any], peak: dict[str, int], tally: Tally, warm: Tally) -> None:
    a = figures.get("attack")
    print(f"\n== live fuzz: N={N_CONTROL} control, M={M_DATA} data, sniff={SNIFF}, "
          f"rate={RATE or 'flat out'}, seed={SEED}, only={ONLY or 'all'}"
          + (", forged addresses keep their version byte" if KEEP_VERSION else ""))
    if isinstance(a, dict):
        rate = a.get("control_sent", 0) / max(a.get("control_seconds", 0), 1e-9)
        print(f"attacker: {a.get('control_sent')} control messages in {a.get('control_seconds')}"
              f" s ({rate:,.0f}/s, {a.get('control_errors')} refused by NATS), "
              f"{a.get('data_sent')} UCX messages in {a.get('data_seconds')} s "
              f"({a.get('data_pending')} never received); observed {a.get('observed')}, "
              f"{a.get('tags_sniffed')} tags sniffed, {a.get('replies')} replies")
        print(f"  control kinds: {a.get('kinds')}")
        print(f"  data kinds: {a.get('data_kinds')}")
    else:
        print(f"attacker: {a}")
    print(f"attack phase: {attack_s:.1f} s; honest transfers during it: {tally.total}, "
          f"{tally.completed} completed with verified bytes (warm-up {warm.completed}/{warm.total})")
    for outcome, n in sorted(tally.outcomes.items()):
        print(f"  {n:5d}  {outcome}")
    keys = ("rss", "fds", "threads", "completed", "failed", "aborted", "timed_out", "expired",
            "malformed_messages", "peers_alive", "peers_refused", "staged_dropped", *AT_REST)
    for name, b in before.items():
        s = after.get(name) or {}
        print(f"{name}: peak RSS {peak.get(name, 0) >> 20} MiB")
        for k in keys:
            if k in b:
                bv, av = b[k], s.get(k, "?")
                if k == "rss":
                    bv, av = f"{bv >> 20} MiB", f"{av >> 20} MiB" if isinstance(av, int) else av
                print(f"    {k:22s} {bv!s:>12} -> {av!s:>12}")
        extra = sorted(set(s) - set(keys) - {"instance_id", "log_errors", "log_counts"})
        print("    " + ", ".join(f"{k}={s[k]}" for k in extra if not isinstance(s[k], dict)))
        if s.get("log_counts"):
            print(f"    log: {s['log_counts']}")
        for err in s.get("log_errors", [])[:3]:
            print("    logged error:\n      " + err.replace("\n", "\n      "))
