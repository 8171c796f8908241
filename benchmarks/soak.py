"""A long soak: thousands of transfers between two real agent processes, with random
aborts, timeouts, expiring offers and peer restarts; memory and file descriptors sampled.

    python benchmarks/soak.py --transfers 5000 --sample-every 250
    python benchmarks/soak.py --transfers 600 --sample-every 100 --restart-every 200  # short

A prefill process pushes and offers, a decode process expects and pulls (the processes of
tests/integration/attacker.py: each Agent runs in its own process, driven over a queue,
and a destination checks every completed transfer's bytes). Every ``--sample-every``
transfers the RSS and open file descriptors (/proc/<pid>/fd) of both are sampled; the
decode process is SIGKILLed and restarted every ``--restart-every`` transfers (the
prefill lives through every restart, so its figures cover the whole run; each decode
incarnation is judged on its own samples). Exit status 1 when a process' last samples
exceed a bound derived from its first ones (``--rss-slack-mb``, ``--fd-slack``), when a
completed transfer carried wrong bytes, when a transfer never ended, or when something is
still held at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the agent processes live with the test suite
    sys.path.insert(0, str(ROOT))

from kvstream import EmbeddedNats  # noqa: E402
from tests.fakes import small_layout  # noqa: E402
from tests.integration.attacker import Fleet, fd_count, rss_bytes  # noqa: E402

P, D = "soak-prefill", "soak-decode"
NBLOCKS, LANE_BLOCKS = 64, 16
AT_REST = ("transfers_active", "reservations_active", "staging_bytes_in_use", "held_active",
           "leases_active", "staged_transfers")
KINDS = ("push", "push_staged", "pull", "abort", "timeout", "expire")


def agent_config(instance_id: str, nats_url: str) -> dict[str, Any]:
    return dict(instance_id=instance_id, nats_url=nats_url, heartbeat_s=0.25,
                peer_timeout_s=1.0, request_timeout_s=1.0, transfer_timeout_s=5.0,
                reservation_timeout_s=2.0, lease_s=2.0, staging_wait_s=0.5)


class Soak:
    def __init__(self, args: argparse.Namespace, fleet: Fleet) -> None:
        self.args, self.fleet = args, fleet
        self.lock = threading.Lock()
        self.done = 0
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        self.samples: list[dict[str, Any]] = []
        self.incarnation = {P: 0, D: 0}
        self.gate = threading.Event()  # cleared while a peer restarts
        self.gate.set()
        self.t0 = time.monotonic()

    # -- one transfer -----------------------------------------------------------------------
    def transfer(self, rng: random.Random, lane: int, n: int) -> None:
        f, layers = self.fleet, 4
        kind = rng.choices(KINDS, weights=self.args.weights)[0]
        nb = rng.randint(1, 6)
        lo = lane * LANE_BLOCKS
        dst = rng.sample(range(lo, lo + LANE_BLOCKS), nb) if rng.random() < 0.7 else \
            list(range(lo, lo + nb))
        src = rng.sample(range(NBLOCKS), nb)
        rid, mode = f"s{lane}-{n}", rng.choice(["pipelined", "eager"])
        push = dict(rid=rid, peer=D, src=src, mode=mode)
        expect = dict(rid=rid, peer=P, dst=dst, src=src)  # peer: the only one that may push
        pull_base = kind == "pull" or (kind == "abort" and rng.random() < 0.5)
        if kind == "timeout":  # a prefill that never finishes: the deadline ends it
            push.update(mode="pipelined", ready=rng.randrange(layers), timeout=0.3)
        if kind == "expire":
            t = f.send(P, "offer", rid=rid, src=src, mode=mode, lease_s=0.2)
            self.record(kind, f.wait(t), ("result", "", "not asked", "", None))
            f.forget(t)
            return
        if pull_base:
            first = (P, "offer", dict(rid=rid, src=src, mode=mode))
            then = (D, "pull", dict(rid=rid, peer=P, dst=dst, src=src,
                                    mode=rng.choice(["eager", "lazy"])))
        elif kind == "push_staged":
            first, then = (P, "push", push), (D, "expect", expect)
        else:
            first, then = (D, "expect", expect), (P, "push", push)
        t1 = f.send(first[0], first[1], **first[2])
        started = f.wait(t1, ("started", "result"))
        t2 = None
        if started is not None and started[0] == "started":
            extras = started[2] if len(started) > 2 else {}
            if extras.get("secret"):  # protocol 2: the offer's secret goes with the pull
                then[2]["secret"] = extras["secret"]
            t2 = f.send(then[0], then[1], **then[2])
            if kind == "abort":
                time.sleep(rng.choice([0, 0.001, 0.005, 0.02]))
                victim = rng.choice([first[0], then[0]])
                f.forget(f.send(victim, "abort", token=t1 if victim == first[0] else t2))
        r1 = started if started is not None and started[0] == "result" else f.wait(t1)
        r2 = f.wait(t2) if t2 is not None else ("result", "", "not asked", "", None)
        for t in (t1, t2):
            if t is not None:
                f.forget(t)
        src_r, dst_r = (r1, r2) if first[0] == P else (r2, r1)
        self.record(kind, src_r, dst_r)

    def record(self, kind: str, src: tuple[Any, ...] | None, dst: tuple[Any, ...] | None) -> None:
        with self.lock:
            self.done += 1
            s = src[2] if src else "no answer"
            d = dst[2] if dst else "no answer"
            self.outcomes[f"{kind}: {s} / {d}"] += 1
            if dst and dst[2] == "completed" and not dst[4]:
                self.problems.append(f"wrong bytes: {kind} {dst}")
            for msg in (src, dst):
                if msg is None or msg[2] in ("HUNG", "ERROR"):
                    self.problems.append(f"never ended or failed oddly: {kind} {msg}")

    # -- the run ------------------------------------------------------------------------------
    def lane(self, lane: int) -> None:
        rng = random.Random(self.args.seed * 1000 + lane)
        n = 0
        while True:
            self.gate.wait()
            with self.lock:
                if self.done >= self.args.transfers:
                    return
            self.transfer(rng, lane, n)
            n += 1

    def sample(self, label: str = "") -> dict[str, Any]:
        row: dict[str, Any] = {"transfers": self.done, "t": round(time.monotonic() - self.t0, 1),
                               "label": label}
        for name in (P, D):
            pid = self.fleet.pid(name)
            try:
                row[name] = dict(rss=rss_bytes(pid), fds=fd_count(pid),
                                 incarnation=self.incarnation[name])
            except OSError:
                row[name] = dict(rss=0, fds=0, incarnation=self.incarnation[name])
        self.samples.append(row)
        return row

    def run(self) -> None:
        a = self.args
        lanes = [threading.Thread(target=self.lane, args=(i,), daemon=True)
                 for i in range(a.lanes)]
        for t in lanes:
            t.start()
        next_sample, next_restart = a.sample_every, a.restart_every or 10**12
        print(_header(), flush=True)
        self.print_row(self.sample("start"))
        while any(t.is_alive() for t in lanes):
            time.sleep(0.05)
            if self.done >= next_sample:
                next_sample += a.sample_every
                self.print_row(self.sample())
            if self.done >= next_restart and self.done < a.transfers:
                next_restart += a.restart_every
                self.gate.clear()
                time.sleep(rng_delay(self.done))
                self.fleet.restart(D)  # mid-flight: whatever it had in progress is lost
                self.incarnation[D] += 1
                self.gate.set()
                self.print_row(self.sample("restarted decode"))

    def print_row(self, row: dict[str, Any]) -> None:
        p, d = row[P], row[D]
        c = self.outcomes
        ok = sum(v for k, v in c.items() if k.endswith("completed / completed"))
        print(f"{row['transfers']:9d} {row['t']:7.1f} {p['rss'] >> 20:8d} {p['fds']:6d} "
              f"{d['rss'] >> 20:8d} {d['fds']:6d} {d['incarnation']:4d} {ok:8d}  {row['label']}",
              flush=True)


def rng_delay(n: int) -> float:
    return random.Random(n).choice([0.0, 0.002, 0.01])


def _header() -> str:
    return (f"{'transfers':>9s} {'t (s)':>7s} {'P MiB':>8s} {'P fds':>6s} {'D MiB':>8s} "
            f"{'D fds':>6s} {'D #':>4s} {'both ok':>8s}")


def judge(samples: list[dict[str, Any]], name: str, rss_slack: int, fd_slack: int,
          first: int = 3, last: int = 3) -> list[str]:
    """Per incarnation with enough samples: the bound is the highest of its first samples
    (after the one taken at its start, still warming up) plus the slack; the last samples
    must stay under it."""
    out = []
    by: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in samples:
        by[row[name]["incarnation"]].append(row[name])
    for inc, rows in by.items():
        rows = [r for r in rows if r["rss"]]
        if len(rows) < first + last + 1:
            continue
        head, tail = rows[1:first + 1], rows[-last:]
        rss_bound = max(r["rss"] for r in head) + rss_slack
        fd_bound = max(r["fds"] for r in head) + fd_slack
        rss_end, fd_end = statistics.median(r["rss"] for r in tail), max(r["fds"] for r in tail)
        if rss_end > rss_bound:
            out.append(f"{name} #{inc}: RSS grew to {rss_end / 2**20:.0f} MiB "
                       f"(bound {rss_bound / 2**20:.0f} MiB from its first samples)")
        if fd_end > fd_bound:
            out.append(f"{name} #{inc}: {fd_end} open fds (bound {fd_bound})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transfers", type=int, default=5000)
    ap.add_argument("--sample-every", type=int, default=250)
    ap.add_argument("--restart-every", type=int, default=1000,
                    help="SIGKILL and restart the decode process every N transfers (0: never)")
    ap.add_argument("--lanes", type=int, default=3, help="transfers in flight at once")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--weights", type=float, nargs=len(KINDS), default=[30, 15, 30, 10, 8, 7],
                    metavar="W", help=f"how often each kind of transfer runs: {', '.join(KINDS)}")
    ap.add_argument("--rss-slack-mb", type=float, default=30.0)
    ap.add_argument("--fd-slack", type=int, default=8)
    ap.add_argument("--json", action="store_true", help="also print the samples as JSON")
    args = ap.parse_args()
    if args.lanes * LANE_BLOCKS > NBLOCKS:
        ap.error(f"at most {NBLOCKS // LANE_BLOCKS} lanes")
    lay = small_layout(layers=4)
    rest: dict[str, Any] = {}
    with EmbeddedNats() as nats:
        fleet = Fleet(mp.get_context("spawn"), lay, NBLOCKS)
        soak = Soak(args, fleet)
        try:
            fleet.start(P, agent_config(P, nats.url))
            fleet.start(D, agent_config(D, nats.url))
            soak.t0 = time.monotonic()
            soak.run()
            for _ in range(40):  # what the last transfers hold ends within its deadlines
                rest = {n: fleet.stats(n) for n in (P, D)}
                if all(s and all(s[k] == 0 for k in AT_REST) for s in rest.values()):
                    break
                time.sleep(0.25)
            soak.print_row(soak.sample("end"))
            problems = list(soak.problems)
            for name, s in rest.items():
                if not s or any(s[k] for k in AT_REST):
                    problems.append(f"{name} not at rest at the end: "
                                    f"{ {k: s[k] for k in AT_REST} if s else 'no answer'}")
            slack = int(args.rss_slack_mb * 2**20)
            problems += judge(soak.samples, P, slack, args.fd_slack)
            problems += judge(soak.samples, D, slack, args.fd_slack)
            for name in (P, D):
                code = fleet.stop(name)
                if code != 0:
                    problems.append(f"{name} exited with {code}")
        finally:
            fleet.close()
    elapsed = time.monotonic() - soak.t0
    print(f"\n{soak.done} transfers in {elapsed:.1f} s ({soak.done / elapsed:.0f}/s), "
          f"decode restarted {soak.incarnation[D]} times")
    for outcome, n in sorted(soak.outcomes.items()):
        print(f"  {n:6d}  {outcome}")
    for name in (P, D):
        s = rest.get(name) or {}
        print(f"{name}: " + ", ".join(f"{k}={s.get(k)}" for k in (
            "completed", "failed", "aborted", "timed_out", "expired", "staged_dropped",
            "malformed_messages", *AT_REST, "ucx_endpoints") if k in s))
    if args.json:
        print(json.dumps(soak.samples))
    for p in problems[:50]:
        print(f"PROBLEM: {p}")
    print("soak: " + ("FAILED" if problems else "ok"))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
