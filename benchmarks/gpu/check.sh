#!/usr/bin/env bash
# The project's GPU check: every gpu-marked test and the GPU benchmarks on one GPU host,
# a short summary at the end, stopping itself within its budget (5 minutes by default) so
# a rerun after a fix fits a lease of 15.
#
#   bash benchmarks/gpu/check.sh [--dry] [OUT_DIR]        (OUT_DIR default: $OUT, else a temp dir)
#
# Built for a host with Python 3.12, a CUDA torch and cupy installed and no network: what
# else kvstream needs travels as wheels in .gpu-wheels/ (benchmarks/gpu/fetch-wheels.sh
# fetches them on a machine with a package index; they are installed here offline, with
# --no-deps, into a directory of their own; torch and cupy are never installed). kvstream
# itself runs from this tree. --dry (what CI runs): the GPU phases are reported skipped,
# the benchmark script runs small on the CPU, and the summary is still written.
#
# Phases: install, environment (versions, devices, `kvstream doctor`), tests
# (pytest -m gpu tests/gpu), benchmarks (bench_gpu.py: codec kernels vs torch, a pull of
# scattered device blocks while the default stream is busy; bench_cuda_ipc.py). Files:
# summary.md, env.txt, tests.log, gpu-tests.xml, bench.json, bench.log, cuda-ipc.json (and
# each phase's .err).
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0
if [[ "${1:-}" == "--dry" ]]; then DRY=1; shift; fi
OUTDIR=${1:-${OUT:-$(mktemp -d)}}
BUDGET=${KVSTREAM_GPU_CHECK_S:-300}
START=$(date +%s)
mkdir -p "$OUTDIR"
SUMMARY=$OUTDIR/summary.md
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
say() { echo "$*" | tee -a "$SUMMARY"; }
# run NAME SECONDS LOG CMD...: one phase, bounded by its share and by what the budget has
# left, its output to LOG and its errors to LOG.err ("-": both here)
run() {
    local name=$1 want=$2 log=$3 t0 rc budget
    shift 3
    budget=$(left)
    (( budget > want )) && budget=$want
    if (( budget < 10 )); then say "- $name: skipped (out of time)"; return 0; fi
    t0=$(date +%s)
    if [[ $log == - ]]; then
        timeout --kill-after=5 "$budget" "$@"
    else
        timeout --kill-after=5 "$budget" "$@" > "$log" 2> "$log.err"
    fi
    rc=$?
    say "- $name: $([[ $rc == 0 ]] && echo ok || { [[ $rc == 124 || $rc == 137 ]] && echo "stopped at ${budget} s" || echo "failed (rc=$rc)"; }) in $(( $(date +%s) - t0 )) s"
    return 0
}

: > "$SUMMARY"
say "# kvstream GPU check ($(git rev-parse --short HEAD 2>/dev/null || echo tree), $(date -u +%FT%TZ))"
say ""
if [[ $DRY == 1 ]]; then
    say "dry run: no GPU phase runs"
    for phase in install environment tests benchmarks; do say "- $phase: skipped (dry run)"; done
    run "bench_gpu.py on the CPU (the script itself)" 120 - \
        "$PY" benchmarks/gpu/bench_gpu.py --cpu-smoke --seconds 60 --out "$OUTDIR/bench.json"
    say ""
    say "summary written to $SUMMARY"
    exit 0
fi

# -- install: the carried wheels, offline, beside (never over) torch and cupy --------------
SITE=${KVSTREAM_GPU_SITE:-/tmp/kvstream-site}
if [[ -f .gpu-wheels/SHA256SUMS ]]; then
    run install 120 - bash benchmarks/gpu/fetch-wheels.sh install .gpu-wheels "$SITE"
else
    say "- install: no .gpu-wheels/ (benchmarks/gpu/fetch-wheels.sh), using what is installed"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"

# -- environment ----------------------------------------------------------------------------
{
    command -v nvidia-smi > /dev/null && nvidia-smi -L 2>&1
    timeout 60 "$PY" - <<'EOF' 2>&1
import importlib
for name in ("torch", "cupy", "ucxx", "nats", "msgspec", "nacl", "kvstream"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"{name} MISSING: {type(exc).__name__}: {exc}")
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
    timeout 60 "$PY" -m kvstream.tools.cli doctor 2>&1 | tail -40
} > "$OUTDIR/env.txt"
say "- environment: $(grep -E '^(torch|cupy|ucxx|cuda) ' "$OUTDIR/env.txt" | tr '\n' ';')"
grep -q MISSING "$OUTDIR/env.txt" && say "  missing: $(grep MISSING "$OUTDIR/env.txt" | cut -c1-200 | tr '\n' ';')"

# -- tests: every gpu-marked test -------------------------------------------------------------
run tests 170 "$OUTDIR/tests.log" "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
    -o addopts="-ra" --timeout 120 --junitxml "$OUTDIR/gpu-tests.xml"
say "  $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUTDIR/tests.log" | tail -1)"
grep -E '^(FAILED|ERROR) ' "$OUTDIR/tests.log" | head -20 | sed 's/^/  /' | tee -a "$SUMMARY"

# -- benchmarks -------------------------------------------------------------------------------
run "bench_gpu.py" 100 "$OUTDIR/bench.log" "$PY" benchmarks/gpu/bench_gpu.py --seconds 80 \
    --out "$OUTDIR/bench.json"
[[ -s "$OUTDIR/bench.json" ]] && sed 's/^/    /' "$OUTDIR/bench.json" >> "$SUMMARY"
run "bench_cuda_ipc.py" 60 "$OUTDIR/cuda-ipc.json" "$PY" benchmarks/bench_cuda_ipc.py --json \
    --total-mib 256 --repeat 5
[[ -s "$OUTDIR/cuda-ipc.json" ]] && tail -c 1500 "$OUTDIR/cuda-ipc.json" | sed 's/^/    /' >> "$SUMMARY"
[[ -s "$OUTDIR/cuda-ipc.json.err" ]] && tail -n 3 "$OUTDIR/cuda-ipc.json.err" | sed 's/^/    /' >> "$SUMMARY"
say ""
say "done in $(( $(date +%s) - START )) s of $BUDGET"
exit 0
