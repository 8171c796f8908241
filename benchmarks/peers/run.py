"""kvstream against its peers on one workload, interleaved in one run: the one command.

    python benchmarks/peers/run.py [--rounds 3] [--block-bytes 65536]
        [--blocks-per-layer 256] [--layers 32] [--contiguous]
        [--nixl-python .venv-nixl/bin/python] [--kvstream-arg ARG ...] [--json]

Each round runs, in an order that rotates from round to round so machine noise hits all
alike: ``kvstream bench --json --repeat 1`` (push-pipelined and pull-eager, on a float16
layout whose blocks are ``--block-bytes``), NIXL READ and WRITE (``nixl_peer.py`` in the
NIXL venv; skipped with a note when that venv is missing), raw ucxx (``ucxx_peer.py``)
and a one-thread memcpy (``memcpy_peer.py``), each in fresh processes. Prints each
system's median and best over the rounds, and kvstream's ratios to NIXL READ, NIXL
WRITE, memcpy and raw ucxx; ``--json`` prints one object with every round. Exit status
1 when a system failed or a transfer was not verified, 2 for knobs no layout fits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from workload import KnobError, Workload, kvstream_layout_args  # noqa: E402

__all__ = ["LABELS", "format_report", "kvstream_command", "main", "nixl_choice", "ratios",
           "round_rows", "summarize"]

KVSTREAM_MODES = ("push-pipelined", "pull-eager")
NIXL_VARIANTS = {"read": ("READ", "one request"), "read_per_layer": ("READ", "per layer"),
                 "write": ("WRITE", "one request"), "write_per_layer": ("WRITE", "per layer")}

# Row keys and their labels, in the table's order.
LABELS: dict[str, str] = {
    **{f"kvstream.{m}": f"kvstream {m}" for m in ("push-pipelined", "push-eager",
                                                   "pull-eager", "pull-lazy")},
    **{f"nixl.{v}.pt_{pt}": f"NIXL {op}, {how}, progress thread {pt}"
       for v, (op, how) in NIXL_VARIANTS.items() for pt in ("off", "on")},
    "ucxx.coalesced": "raw ucxx, coalesced per layer",
    "ucxx.wire": "raw ucxx, contiguous buffers (wire only)",
    "ucxx.in_bench": "raw ucxx inside kvstream bench (its baseline)",
    "memcpy.gather": "memcpy gather (index_select), 1 thread",
    "memcpy.memmove": "memcpy per chunk, scattered to scattered, 1 thread",
    "memcpy.gather_scatter": "memcpy gather + scatter (two copies), 1 thread",
    "memcpy.contiguous": "memcpy of the payload, contiguous, 1 thread",
    "memcpy.in_bench": "memcpy gather, one layer, inside kvstream bench",
}
# memcpy's number (the limit): its fastest one-copy form of the scattered workload.
MEMCPY_ONE_COPY = ("memcpy.gather", "memcpy.memmove")

# kvstream's ratios: (name, kvstream row, peer row); "nixl.read" / "nixl.write" /
# "memcpy" stand for that system's best configuration here (``resolve``).
RATIOS = (("kvstream/NIXL-READ", "kvstream", "nixl.read"),
          ("kvstream/NIXL-WRITE", "kvstream", "nixl.write"),
          ("kvstream/memcpy", "kvstream", "memcpy"),
          ("kvstream/ucxx", "kvstream", "ucxx.coalesced"),
          ("kvstream pull-eager/NIXL-READ", "kvstream.pull-eager", "nixl.read"),
          ("kvstream/memcpy-contiguous", "kvstream", "memcpy.contiguous"))


# -- what each system's JSON means, as rows --------------------------------------------

def kvstream_command(python: str, w: Workload, extra: Sequence[str] = ()) -> list[str]:
    """``kvstream bench`` for ``w``; ``extra`` last (its own ``--mode`` replaces ours)."""
    theirs = any(a == "--mode" or a.startswith("--mode=") for a in extra)
    modes = [] if theirs else [a for m in KVSTREAM_MODES for a in ("--mode", m)]
    return [python, "-m", "kvstream.tools.cli", "bench", "--json", "--repeat", "1",
            *kvstream_layout_args(w), *modes, *extra]


def _kvstream_rows(d: dict[str, Any]) -> dict[str, tuple[float, bool]]:
    ok = bool(d.get("verified"))
    rows = {f"kvstream.{m}": (r["gbps"], bool(r.get("verified", ok)))
            for m, r in (d.get("modes") or {}).items()}
    if not rows:
        rows["kvstream.push-pipelined"] = (d["kvstream_gbps"], ok)
    if d.get("ucx_gbps"):
        rows["ucxx.in_bench"] = (d["ucx_gbps"], ok)
    if d.get("memcpy_gbps"):
        rows["memcpy.in_bench"] = (d["memcpy_gbps"], True)
    return rows


def _nixl_rows(d: dict[str, Any]) -> dict[str, tuple[float, bool]]:
    return {f"nixl.{v}.pt_{setting.removeprefix('progress_thread_')}":
            (r["gbps"], bool(r["verified"]))
            for setting, variants in d["settings"].items() for v, r in variants.items()}


def _ucxx_rows(d: dict[str, Any]) -> dict[str, tuple[float, bool]]:
    return {"ucxx.coalesced": (d["gbps"], bool(d["verified"])),
            "ucxx.wire": (d["wire_gbps"], True)}


def _memcpy_rows(d: dict[str, Any]) -> dict[str, tuple[float, bool]]:
    return {f"memcpy.{v}": (r["gbps"], bool(r["verified"])) for v, r in d["variants"].items()}


ROWS: dict[str, Callable[[dict[str, Any]], dict[str, tuple[float, bool]]]] = {
    "kvstream": _kvstream_rows, "nixl": _nixl_rows, "ucxx": _ucxx_rows, "memcpy": _memcpy_rows}


def round_rows(results: dict[str, dict[str, Any]]) -> dict[str, tuple[float, bool]]:
    """One round's systems' JSON (a failed one: ``{"error": ...}``) as row -> (GB/s, verified)."""
    rows: dict[str, tuple[float, bool]] = {}
    for system, d in results.items():
        if "error" not in d:
            rows.update(ROWS[system](d))
    return rows


# -- rounds to a summary and ratios (pure; tests/unit/test_peers_bench.py) --------------

def summarize(rounds: list[dict[str, tuple[float, bool]]]) -> dict[str, dict[str, Any]]:
    """Per row: every round's GB/s (None where it did not run), median and best of those
    that ran, and whether every one was verified."""
    order = {k: i for i, k in enumerate(LABELS)}
    keys = sorted(dict.fromkeys(k for r in rounds for k in r),
                  key=lambda k: order.get(k, len(order)))
    out = {}
    for k in keys:
        runs = [r[k][0] if k in r else None for r in rounds]
        got = [x for x in runs if x is not None]
        out[k] = {"runs": runs, "median": round(statistics.median(got), 3),
                  "best": round(max(got), 3), "verified": all(r[k][1] for r in rounds if k in r)}
    return out


def _fastest(summary: dict[str, dict[str, Any]], keys: Sequence[str]) -> str | None:
    """Of ``keys``, the row with the highest median here (best as tie-break)."""
    keys = [k for k in keys if k in summary]
    return max(keys, key=lambda k: (summary[k]["median"], summary[k]["best"]), default=None)


def nixl_choice(summary: dict[str, dict[str, Any]], op: str) -> str | None:
    """NIXL's number for ``op`` ("read"/"write"): its configuration with the highest
    median here (one request or per layer, progress thread on or off), best as tie-break."""
    return _fastest(summary, [k for k in summary
                              if k.startswith(f"nixl.{op}.") or k.startswith(f"nixl.{op}_")])


def resolve(summary: dict[str, dict[str, Any]], key: str) -> str | None:
    """A row of the summary: "kvstream" is its headline mode (push-pipelined, else the
    first measured); "nixl.read" / "nixl.write" NIXL's best configuration; "memcpy" the
    fastest one-copy memcpy of the scattered blocks."""
    if key == "kvstream":
        modes = [k for k in summary if k.startswith("kvstream.")]
        return "kvstream.push-pipelined" if "kvstream.push-pipelined" in modes else (
            modes[0] if modes else None)
    if key in ("nixl.read", "nixl.write"):
        return nixl_choice(summary, key.split(".")[1])
    if key == "memcpy":
        return _fastest(summary, MEMCPY_ONE_COPY)
    return key if key in summary else None


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """kvstream over each peer: of the medians, and of the bests (None where one is missing)."""
    out = {}
    for name, num, den in RATIOS:
        a, b = resolve(summary, num), resolve(summary, den)
        if a is None or b is None:
            out[name] = {"median": None, "best": None, "of": [a, b]}
            continue
        out[name] = {"median": round(summary[a]["median"] / summary[b]["median"], 3),
                     "best": round(summary[a]["best"] / summary[b]["best"], 3), "of": [a, b]}
    return out


def format_report(w: Workload, summary: dict[str, dict[str, Any]],
                  rats: dict[str, dict[str, Any]], notes: Sequence[str] = ()) -> str:
    """The table, the ratios and the notes, as text."""
    n = max((len(s["runs"]) for s in summary.values()), default=0)
    width = max([len(LABELS.get(k, k)) for k in summary] + [36])
    chosen = {resolve(summary, k) for k in ("nixl.read", "nixl.write", "memcpy")}
    lines = [f"kvstream vs peers: {w.describe()}, {n} rounds interleaved",
             f"{'system':<{width}}  {'median':>6}  {'best':>6}  GB/s per round",
             "-" * (width + 34)]
    for k, s in summary.items():
        runs = " ".join("  -  " if x is None else f"{x:5.2f}" for x in s["runs"])
        flag = "" if s["verified"] else "  NOT VERIFIED"
        mark = " *" if k in chosen else ""
        lines.append(f"{LABELS.get(k, k) + mark:<{width}}  {s['median']:6.2f}  {s['best']:6.2f}"
                     f"  {runs}{flag}")
    lines += ["", "ratios (of medians; of bests)"]
    for name, r in rats.items():
        if r["median"] is None:
            lines.append(f"  {name:<30} -  (not measured)")
            continue
        what = " over ".join(LABELS.get(k, k) for k in r["of"])
        lines.append(f"  {name:<30} {r['median']:5.2f}  {r['best']:5.2f}   ({what})")
    if any(k.startswith(("nixl.", "memcpy.")) for k in summary):
        lines.append("  * the number of NIXL READ, NIXL WRITE and memcpy (one copy of the "
                     "scattered blocks): the variant with the highest median in this run")
    lines += [f"note: {x}" for x in notes]
    return "\n".join(lines)


# -- running the systems ----------------------------------------------------------------

def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            parsed: dict[str, Any] = json.loads(line)
            return parsed
    raise ValueError("no JSON line in its output")


def _run(cmd: list[str], timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", "NIXL_LOG_LEVEL": "WARN"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                           cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s: {' '.join(cmd)}"}
    try:
        if p.returncode:
            raise ValueError(f"exit status {p.returncode}")
        return _last_json(p.stdout)
    except ValueError as exc:
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        return {"error": f"{exc}: {' '.join(cmd)}\n    " + "\n    ".join(tail)}


def _kvstream_python() -> str | None:
    if importlib.util.find_spec("kvstream") is not None:
        return sys.executable
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else None


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-bytes", type=int, default=65536)
    ap.add_argument("--blocks-per-layer", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--contiguous", action="store_true",
                    help="blocks 0..n-1 on both sides instead of seeded scattered ids")
    ap.add_argument("--nixl-python", default=str(ROOT / ".venv-nixl" / "bin" / "python"),
                    help="python of the NIXL venv (benchmarks/peers/install-nixl.sh)")
    ap.add_argument("--nixl-progress-thread", default="off,on",
                    help="NIXL progress thread settings to measure")
    ap.add_argument("--ucxx-progress-mode", default="thread",
                    choices=["thread", "blocking", "polling"])
    ap.add_argument("--kvstream-arg", action="append", default=[], metavar="ARG",
                    help="passed on to kvstream bench (repeatable; --kvstream-arg=--flag)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per system run")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--save", metavar="PATH", help="also write that JSON object to PATH")
    ap.add_argument("--report", metavar="PATH",
                    help="print the table of a run saved with --save (runs nothing)")
    return ap.parse_args(argv)


def _measured(date: str, rev: str, cmdline: str) -> str:
    return f"measured {date}, {os.cpu_count()} CPUs, kvstream at {rev}: {cmdline}"


def _report(path: str) -> int:
    doc = json.loads(Path(path).read_text())
    knobs = {k: doc["workload"][k] for k in ("block_bytes", "blocks_per_layer", "layers",
                                             "scattered", "seed")}
    summary = summarize([round_rows(r["results"]) for r in doc["rounds"]])
    notes = [*doc["notes"], _measured(doc["date"], doc.get("revision", "unknown"),
                                      doc.get("command", "python benchmarks/peers/run.py"))]
    print(format_report(Workload(**knobs), summary, ratios(summary), notes))
    return 0 if doc["verified"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.report:
        return _report(args.report)
    try:
        if args.rounds < 1:
            raise KnobError("rounds must be at least 1")
        w = Workload(block_bytes=args.block_bytes, blocks_per_layer=args.blocks_per_layer,
                     layers=args.layers, scattered=not args.contiguous)
        kvstream_layout_args(w)
    except KnobError as exc:
        print(f"run.py: {exc}", file=sys.stderr)
        return 2
    py = _kvstream_python()
    if py is None:
        print("run.py: kvstream is not importable here and there is no .venv; run this with "
              "the python that has kvstream installed", file=sys.stderr)
        return 2
    notes: list[str] = []
    peer = [*w.as_args()]
    commands = {
        "kvstream": kvstream_command(py, w, args.kvstream_arg),
        "nixl": [args.nixl_python, str(HERE / "nixl_peer.py"), *peer,
                 "--progress-thread", args.nixl_progress_thread],
        "ucxx": [py, str(HERE / "ucxx_peer.py"), *peer,
                 "--progress-mode", args.ucxx_progress_mode],
        "memcpy": [py, str(HERE / "memcpy_peer.py"), *peer],
    }
    if not Path(args.nixl_python).exists():
        del commands["nixl"]
        notes.append(f"NIXL skipped: {args.nixl_python} not found; install it with "
                     f"`bash benchmarks/peers/install-nixl.sh` (a separate venv, .venv-nixl)")
    systems = list(commands)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = systems[i % len(systems):] + systems[:i % len(systems)]
        results: dict[str, dict[str, Any]] = {}
        for system in order:
            if not args.json:
                print(f"... round {i + 1}/{args.rounds}: {system}", file=sys.stderr, flush=True)
            t = time.monotonic()
            results[system] = _run(commands[system], args.timeout)
            results[system]["elapsed_s"] = round(time.monotonic() - t, 1)
            if "error" in results[system]:
                notes.append(f"round {i + 1}: {system} failed: {results[system]['error']}")
        rounds.append({"round": i + 1, "order": order, "results": results})
    paths = sorted({d.get("path", "") for r in rounds for s, d in r["results"].items()
                    if s == "kvstream" and "error" not in d} - {""})
    if paths:
        notes.append(f"kvstream's data-plane path (kvstream bench's JSON): {', '.join(paths)}")
    rows = [round_rows(r["results"]) for r in rounds]
    summary = summarize(rows)
    rats = ratios(summary)
    ok = all(s["verified"] for s in summary.values()) and not any(
        "error" in d for r in rounds for d in r["results"].values())
    date = time.strftime("%Y-%m-%d %H:%M %Z")
    cmdline = " ".join(["python benchmarks/peers/run.py",
                        *(sys.argv[1:] if argv is None else argv)])
    rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                         capture_output=True, text=True).stdout.strip() or "unknown"
    doc = json.dumps({"workload": {**vars(w), "describe": w.describe(),
                                   "payload_bytes": w.payload_bytes},
                      "commands": commands, "rounds": rounds, "summary": summary,
                      "ratios": rats,
                      "nixl": {op: nixl_choice(summary, op) for op in ("read", "write")},
                      "verified": ok, "notes": notes, "date": date, "revision": rev,
                      "command": cmdline})
    if args.save:
        Path(args.save).write_text(doc + "\n")
    if args.json:
        print(doc)
    else:
        print(format_report(w, summary, rats, [*notes, _measured(date, rev, cmdline)]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
