#!/usr/bin/env bash
# One call on the one-GPU machine for the combine and the torch API: their GPU tests, the
# ShmemWorld combine under MPS (2 and 4 PEs), then `epgen bench --op combine --api torch`
# and `--op moe` at decode and prefill; each step under its own timeout (about 9 minutes at
# most), logs and JSON under $OUT.
#
#   OUT=dir benchmarks/combine_session.sh
#
# (TESTS_K / SHMEM_K / SHMEM_PES and the *_S step limits narrow it when device time is short;
# the defaults leave out the decode-shape combine tests, which the benches check anyway.)
set -u
OUT=${OUT:-combine-session-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NVLS=1
step() {   # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "[$((SECONDS - t0))s] $name: exit $?"
    grep -E "passed|failed|^FAILED|^ERROR|torch api|combine|moe|copy" "$OUT/$name.log" \
        | tail -25 | sed 's/^/    /'
}
step tests "${TESTS_S:-140}" python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 100 \
    -rfE -s tests/gpu/test_torch_api_gpu.py tests/gpu/test_interop_gpu.py \
    tests/gpu/test_combine_graph_gpu.py tests/gpu/test_bench_combine_gpu.py \
    tests/gpu/test_combine_stress_gpu.py tests/gpu/test_combine_gpu.py \
    -k "${TESTS_K:-not decode}"
if command -v nvidia-cuda-mps-control >/dev/null && [ "$(id -u)" = 0 ]; then
    export CUDA_MPS_PIPE_DIRECTORY="$OUT/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$OUT/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    timeout 30 nvidia-cuda-mps-control -d && echo "MPS started"
fi
EPGEN_SHMEM_PES=${SHMEM_PES:-2,4} EPGEN_SHMEM_TIMEOUT=120 step shmem "${SHMEM_S:-180}" \
    python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/gpu/test_shmem_gpu.py \
    -k "${SHMEM_K:-combine}"
[ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo quit | timeout 30 nvidia-cuda-mps-control
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
step combine-bench "${BENCH_S:-130}" python3 -m epgen bench --op combine --tokens 128,4096 --api torch \
    --json "$OUT/combine-bench.json"
step moe-bench "${BENCH_S:-140}" python3 -m epgen bench --op moe --tokens 128,4096 --variant default \
    --variant final=ep_final_layout,ep_prod_reserve --variant graph=graph \
    --json "$OUT/moe-bench.json"
