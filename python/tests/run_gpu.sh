#!/usr/bin/env bash
# The Python tests and the MoE example on the CUDA backend (the GPU machine): build
# libepx.so with CUDA, then run the single-process tests, the multi-rank tests (normal
# and low-latency mode) on 1, 2 and 4 ranks and examples/moe_layer.py (torch, forward +
# backward) on 2 and 4 ranks. scripts/gpu-check runs it (`test`, on its own build).
# Several ranks share one GPU under CUDA MPS (epx launch --mps).
#
#   PYTHON=/opt/torch/.venv/bin/python python/tests/run_gpu.sh [build|test|all]
#
# WHEELS=dir: install missing numpy/ml_dtypes/pytest from wheel files there (no network).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
build="${GPU_CHECK_BUILD_DIR:-$root/build-gpu}"
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

if [ "$what" != test ]; then
    cmake -S "$root" -B "$build" -DEPX_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$build" -j "$(nproc)" --target epx epx_tool
fi
[ "$what" = build ] && exit 0

export EPX_LIBRARY="$build/libepx.so" PYTHONPATH="$root/python"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 EPXTEST_BACKEND=cuda
tests="$root/python/tests"
status=0
"$py" -m pytest -p no:cacheprovider -q "$tests/test_capi.py" "$tests/test_dlpack.py" || status=1
for n in ${RANKS:-1 2 4}; do
    echo "== multi-rank tests, $n ranks, CUDA backend"
    "$build/epx" launch --mps -n "$n" -- "$py" -m pytest -p no:cacheprovider -q \
        "$tests/test_buffer.py" "$tests/test_bad_input.py" "$tests/test_group.py" \
        "$tests/test_low_latency.py" "$tests/test_deep_ep.py" || status=1
done
for n in ${EXAMPLE_RANKS:-2 4}; do
    echo "== examples/moe_layer.py, $n ranks, torch on the CUDA backend"
    EPX_BACKEND=cuda "$build/epx" launch --mps -n "$n" -- "$py" "$root/examples/moe_layer.py" \
        --framework torch || status=1
done
exit $status
