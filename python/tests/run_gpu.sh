#!/usr/bin/env bash
# The Python tests and the MoE example on the CUDA backend (the GPU machine): build
# libepx.so with CUDA, then run the single-process tests, the multi-rank tests (normal
# and low-latency mode) on 1, 2 and 4 ranks, epx.deep_ep's on 2 virtual nodes of 2 ranks,
# and examples/moe_layer.py (torch, forward +
# backward) on 2 and 4 ranks. scripts/gpu-check runs it (`test`, on its own build).
# Several ranks share one GPU under CUDA MPS (epx launch --mps).
#
#   PYTHON=/opt/torch/.venv/bin/python python/tests/run_gpu.sh [build|test|all|wheel]
#
# wheel: the installed package instead of the checkout. Builds a wheel of ./python with
# PYTHON through setuptools' PEP 517 backend (what `pip wheel --no-build-isolation` runs;
# no network, and no pip needed there; PYTHON's environment must have setuptools, and
# nvidia-nvshmem-cu13 so that the NVSHMEM plugin is built and bundled),
# installs it into a fresh environment that also sees PYTHON's packages (torch, numpy,
# ml_dtypes, pytest, nvidia-nvshmem-cu13), and from a directory outside the repository
# runs the bundled `epx` command: doctor's nvshmem.plugin line, examples/moe_layer.py
# with torch on 2 ranks, the Python tests (normal and low-latency mode) on 2 ranks, and
# `epx bench --mode ll --check` on 8 ranks, all on the CUDA backend. Work in
# $GPU_CHECK_BUILD_DIR/wheel.
#
# WHEELS=dir: install missing numpy/ml_dtypes/pytest from wheel files there (no network).
# GPU_CHECK_BUILD_DIR: the build (default build-gpu/).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
build="${GPU_CHECK_BUILD_DIR:-$root/build-gpu}"
# Absolute: the wheel step runs from python/.
mkdir -p "$build" && build="$(cd "$build" && pwd)"
what="${1:-all}"

missing=()
for module in numpy ml_dtypes pytest; do
    "$py" -c "import $module" 2>/dev/null || missing+=("$module")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ -n "${WHEELS:-}" ]; then
        "$py" -m pip install -q --no-index --find-links "$WHEELS" "${missing[@]}"
    else
        echo "run_gpu.sh: missing ${missing[*]} (set WHEELS=dir of wheel files)" >&2
        exit 1
    fi
fi

if [ "$what" = wheel ]; then
    if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
        export PATH="/usr/local/cuda/bin:$PATH"
    fi
    export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
    work="$build/wheel"
    rm -rf "$work/dist" "$work/v"
    mkdir -p "$work"
    echo "== wheel: setuptools.build_meta.build_wheel of ./python with $py (offline)"
    (cd "$root/python" && EPXPY_BUILD_DIR="$work/cmake" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$py" -c "import sys, setuptools.build_meta as backend; print(backend.build_wheel(sys.argv[1]))" \
        "$work/dist" >"$work/build_wheel.log" 2>&1) || { tail -40 "$work/build_wheel.log"; exit 1; }
    wheel_file="$(ls "$work"/dist/epx-*.whl)"
    "$py" -m zipfile -l "$wheel_file" | grep -E 'epx/_(lib|bin)/' || true
    "$py" -m zipfile -l "$wheel_file" | grep 'epx/_lib/libepx_nvshmem.so' >/dev/null || {
        echo "run_gpu.sh: the wheel has no NVSHMEM plugin (is nvidia-nvshmem-cu13 in $py's environment?)" >&2
        exit 1
    }
    # A fresh environment (its pip from ensurepip: no network) that also sees PYTHON's
    # packages (a .pth file: --system-site-packages would show the base interpreter's,
    # not PYTHON's venv's).
    "$py" -m venv "$work/v" || { echo "run_gpu.sh: $py -m venv failed (no ensurepip?)" >&2; exit 1; }
    purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
    "$py" -c "$purelib" >"$("$work/v/bin/python" -c "$purelib")/_parent_environment.pth"
    "$work/v/bin/pip" install -q --no-index --no-deps "$wheel_file"
    v="$work/v/bin"
    outside="$(mktemp -d)"
    cd "$outside"
    status=0
    "$v/python" -c "import epx, os; print('epx from', epx.__file__, 'library', epx.library_path()); assert os.path.realpath(epx.__file__).startswith(os.path.realpath('$work/v'))" || status=1
    "$v/epx" version || status=1
    # The bundled plugin loads, with NVSHMEM's runtime from this environment.
    "$v/epx" doctor --no-smoke | grep -A1 -E '^\[[a-z-]+\] +nvshmem\.plugin' || status=1
    "$v/epx" doctor --no-smoke --json | "$v/python" -c "
import json, os, sys
line = [c for c in json.load(sys.stdin)['checks'] if c['check'] == 'nvshmem.plugin'][0]
print(line['status'], line['detail'].splitlines()[0])
assert line['status'] == 'pass' and '$work/v' in os.path.realpath(line['detail'].split(' found at ')[1].split(',')[0]), line" || status=1
    echo "== wheel: examples/moe_layer.py, 2 ranks, torch on the CUDA backend"
    EPX_BACKEND=cuda "$v/epx" launch --mps -n 2 -- "$v/python" "$root/examples/moe_layer.py" \
        --framework torch || status=1
    echo "== wheel: Python tests, 2 ranks, CUDA backend (normal and low-latency mode)"
    EPXTEST_BACKEND=cuda "$v/epx" launch --mps -n 2 -- "$v/python" -m pytest -p no:cacheprovider -q \
        "$root/python/tests/test_buffer.py" "$root/python/tests/test_low_latency.py" || status=1
    echo "== wheel: epx bench --mode ll --check, 8 ranks, the bundled command and plugin"
    "$v/epx" launch --mps -n 8 -- "$v/epx" bench --mode ll --check --sms 16 --iters 10 || status=1
    cd "$root"
    rm -rf "$outside"
    exit $status
fi

if [ "$what" != test ]; then
    cmake -S "$root" -B "$build" -DEPX_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$build" -j "$(nproc)" --target epx epx_tool
fi
[ "$what" = build ] && exit 0

export EPX_LIBRARY="$build/libepx.so" PYTHONPATH="$root/python"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 EPXTEST_BACKEND=cuda
tests="$root/python/tests"
status=0
"$py" -m pytest -p no:cacheprovider -q "$tests/test_capi.py" "$tests/test_dlpack.py" \
    "$tests/test_exit.py" || status=1
for n in ${RANKS:-1 2 4}; do
    echo "== multi-rank tests, $n ranks, CUDA backend"
    "$build/epx" launch --mps -n "$n" -- "$py" -m pytest -p no:cacheprovider -q \
        "$tests/test_buffer.py" "$tests/test_bad_input.py" "$tests/test_group.py" \
        "$tests/test_low_latency.py" "$tests/test_deep_ep.py" "$tests/test_elastic.py" || status=1
done
echo "== epx.deep_ep across 2 virtual nodes of 2 ranks, CUDA backend (internode kernels)"
EPX_RANKS_PER_NODE=2 "$build/epx" launch --mps -n 4 -- "$py" -m pytest -p no:cacheprovider -q \
    "$tests/test_deep_ep.py" "$tests/test_elastic.py" || status=1
for n in ${EXAMPLE_RANKS:-2 4}; do
    echo "== examples/moe_layer.py, $n ranks, torch on the CUDA backend"
    EPX_BACKEND=cuda "$build/epx" launch --mps -n "$n" -- "$py" "$root/examples/moe_layer.py" \
        --framework torch || status=1
done
exit $status
