"""A/B of the kvstream/raw-ucxx ratio: a git revision against the working tree, interleaved.

    python benchmarks/compare_revisions.py HEAD --rounds 4

Each round runs ``kvstream bench --json`` once with the revision's package (a temporary
``git worktree`` put first on ``PYTHONPATH``) and once with this tree's, one after the
other, so both see the same machine load; the ratio (kvstream GB/s over raw ucxx GB/s
measured in the same run) is what is compared, not GB/s. Exit status 1 when the tree's
mean ratio is below the revision's by more than ``--tolerance``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench(pythonpath: str | None, module: str, extra: list[str]) -> float:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-m", module, "bench", "--json", *extra],
                         check=True, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    result = json.loads(out.stdout)
    if not result["verified"]:
        raise SystemExit(f"{module}: bytes not verified")
    return float(result["ratio"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="git revision to compare against (e.g. HEAD, main~3)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="how far below the revision's mean ratio still passes")
    ap.add_argument("bench_args", nargs="*", help="passed to kvstream bench (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old),
                        args.rev], check=True)
        try:
            # The CLI module moved with the engine redesign; either path works.
            old_cli = ("kvstream.tools.cli" if (old / "kvstream/tools/cli.py").exists()
                       else "kvstream.cli")
            ratios: dict[str, list[float]] = {"rev": [], "tree": []}
            for i in range(args.rounds):
                ratios["rev"].append(_bench(str(old), old_cli, args.bench_args))
                ratios["tree"].append(_bench(None, "kvstream.tools.cli", args.bench_args))
                print(f"round {i + 1}: {args.rev} {ratios['rev'][-1]:.3f}  "
                      f"tree {ratios['tree'][-1]:.3f}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                           check=False)
    rev, tree = (statistics.mean(ratios[k]) for k in ("rev", "tree"))
    print(json.dumps({"rev": args.rev, "rev_ratios": ratios["rev"], "tree_ratios": ratios["tree"],
                      "rev_mean": round(rev, 3), "tree_mean": round(tree, 3)}))
    return 0 if tree >= rev - args.tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
