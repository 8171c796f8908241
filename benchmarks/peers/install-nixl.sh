#!/usr/bin/env bash
# Make (or refresh) the virtual environment benchmarks/peers/nixl_peer.py runs in.
#
#   bash benchmarks/peers/install-nixl.sh [DIR]     (default DIR: .venv-nixl in the repo root)
#
# NVIDIA NIXL 1.5.1 from PyPI, which runs on a CPU-only host over UCX (shared memory,
# cma). The recipe that works (shared/PERF.md): the CPU torch first, then the CUDA-12
# build `nixl-cu12` (the real library), then the `nixl` meta package without its
# dependencies: it provides the `nixl` module, but its own dependencies want a cu13
# build as well. kvstream itself is not installed here: the peer scripts need only
# torch and numpy. Idempotent: a DIR built from the same recipe is left as it is.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.venv-nixl}
PYTHON=${PYTHON:-python3}
RECIPE="torch==2.13.0 numpy nixl-cu12==1.5.1 | --no-deps nixl==1.5.1"
KEY=$(echo "$RECIPE" | sha256sum | cut -c1-16)
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [[ "$(cat "$DIR/.peers-key" 2>/dev/null)" == "$KEY" ]] \
        && "$DIR/bin/python" -c "import nixl._api, torch, numpy" 2>/dev/null; then
    echo "$DIR: NIXL already installed ($RECIPE)"
    exit 0
fi
rm -rf "${DIR:?}"/* "$DIR"/.peers-key 2>/dev/null || true
"$PYTHON" -m venv "$DIR"
echo '*' > "$DIR/.gitignore"  # git leaves the venv alone wherever it is made
"$DIR/bin/pip" install -q torch==2.13.0  # alone first: with others pip may pick a CUDA build
"$DIR/bin/pip" install -q torch==2.13.0 numpy nixl-cu12==1.5.1
"$DIR/bin/pip" install -q --no-deps nixl==1.5.1
"$DIR/bin/python" -c "import nixl._api, torch, numpy; print('nixl', nixl.__file__)"
echo "$KEY" > "$DIR/.peers-key"
echo "$DIR: NIXL installed ($RECIPE)"
