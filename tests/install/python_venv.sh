#!/bin/sh
# `pip install ./python` into a fresh virtual environment, used from outside the tree:
#   python_venv.sh SOURCE_DIR WORK_DIR PYTHON [WHEELS]
# The environment is WORK_DIR/v (made afresh); the package's CMake build is kept in
# WORK_DIR/cmake between runs (host only: CMAKE_ARGS=-DEPX_WITH_CUDA=OFF). With WHEELS
# (a directory of wheel files) pip uses no index. Then, from an empty directory outside
# the repository: the `epx` console command, examples/moe_layer.py on 2 ranks, and the
# package's tests (single-process, then on 2 ranks) with the installed package.
# Pip failing to get a dependency means the test could not run: exit 77 with a line
# "COULD NOT RUN:", or 1 in CI.
set -u
SOURCE=$1
WORK=$2
PYTHON=$3
WHEELS=${4:-}
OUTSIDE=$(mktemp -d)
trap 'rm -rf "$OUTSIDE"' EXIT

fail() {
    echo "FAIL: $*" >&2
    exit 1
}
could_not_run() {
    echo "COULD NOT RUN: $*"
    case "${CI:-}" in "" | 0 | false | False | FALSE | no) exit 77 ;; *) exit 1 ;; esac
}
# step NAME COMMAND...: run it, output to WORK/NAME.log, shown when it fails.
step() {
    name=$1
    shift
    echo "+ $*"
    if ! "$@" >"$WORK/$name.log" 2>&1; then
        sed "s/^/  $name: /" "$WORK/$name.log" >&2
        fail "$name: $*"
    fi
}

mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
rm -rf "$WORK/v"
step venv "$PYTHON" -m venv "$WORK/v"
V=$WORK/v
set --
if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then
    set -- --no-index --find-links "$WHEELS"
fi
# What pip needs from an index (or WHEELS) comes first: without it the test cannot run.
if ! "$V/bin/pip" install -q --disable-pip-version-check "$@" setuptools wheel numpy ml_dtypes \
    pytest >"$WORK/deps.log" 2>&1; then
    sed 's/^/  pip: /' "$WORK/deps.log"
    could_not_run "pip could not install the package's dependencies ${WHEELS:+from $WHEELS}"
fi
# The package itself: dependencies declared in python/pyproject.toml (numpy, ml_dtypes;
# pytest through the test extra), the library and the epx command built by its setup.py.
start=$(date +%s)
step pip_install env CMAKE_ARGS=-DEPX_WITH_CUDA=OFF EPXPY_BUILD_DIR="$WORK/cmake" \
    "$V/bin/pip" install --disable-pip-version-check --no-build-isolation "$@" "$SOURCE/python[test]"
echo "  (pip install: $(($(date +%s) - start)) s)"
"$V/bin/pip" show epx | grep '^Requires: .*ml.dtypes' >/dev/null || fail "epx does not require ml_dtypes"

cd "$OUTSIDE"
step where "$V/bin/python" -c "
import os, epx, epx._cli
where = os.path.realpath(epx.__file__)
assert where.startswith(os.path.realpath('$V')), where
assert os.path.realpath(epx.library_path()).startswith(os.path.dirname(where)), epx.library_path()
print(where, epx.library_path(), epx._cli.BUNDLED_EXECUTABLE)"
step version "$V/bin/epx" version
grep -q '^epx [0-9]' "$WORK/version.log" || fail "epx version: $(cat "$WORK/version.log")"
step example "$V/bin/epx" launch -n 2 -- "$V/bin/python" "$SOURCE/examples/moe_layer.py"
cat "$WORK/example.log"
TESTS=$SOURCE/python/tests
step unit "$V/bin/python" -m pytest -q -p no:cacheprovider "$TESTS/test_capi.py" \
    "$TESTS/test_dlpack.py" "$TESTS/test_library.py"
tail -n 1 "$WORK/unit.log"
step multirank "$V/bin/epx" launch -n 2 -- "$V/bin/python" -m pytest -q -p no:cacheprovider \
    "$TESTS/test_buffer.py" "$TESTS/test_bad_input.py" "$TESTS/test_group.py" \
    "$TESTS/test_low_latency.py"
grep 'passed' "$WORK/multirank.log" | tail -n 2
echo "PASS: pip install ./python in a fresh environment; the epx command, the example and the tests ran from $OUTSIDE"
