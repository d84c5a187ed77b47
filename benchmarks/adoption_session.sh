#!/usr/bin/env bash
# The GPU runs of the adoption features (DeepEP's API, the SHMEM warp puts, rank masks, the
# per-rank deduplicated dispatch, the FP8 and partial-reduce combines), one mode per call,
# each fitting a 10-minute command; logs and JSON under $OUT/<mode>/ and a tally in
# $OUT/<mode>/summary.txt. Run from the repository root:
#
#   EPGEN_COMMIT=<commit> timeout 590 benchmarks/adoption_session.sh MODE
#
# MODE (each step under its own bound; the bounds of a mode add up to 590 s or less):
#   tests    one process: the DeepEP API on an EmulatedGroup (low-latency, engines' call
#            patterns, CUDA graphs), the deduplicated dispatch and the FP8 combine
#   tests2   one process: the partial-reduce combine, DeepEP's normal mode, rank masks and
#            masked slots, the BlockwiseFP8Pow2 format, the combine benchmark's tests
#   mps      MPS on (when this machine has it and we are root), the tests that launch one
#            process per PE with 2 and 4 PEs (EPGEN_SHMEM_PES), then MPS off
#   mps2     the same: DeepEP's normal mode on a process group, rank masks on ShmemWorld with
#            a PE killed between calls, in its dispatch and in its combine, and DeepEP's
#            shrink test on a process group (ranks killed at dispatch and combine)
#   mps8     the same for the warp put-with-signal kernels' tests with 8 PEs
#   bench    the FP8 combine against the BF16 one at decode (128 tokens per rank) as built
#            (the reduce shared by up to 8 warps a token, the FP8 send by up to 4 warps a
#            row), with one warp a row in the FP8 send
#            (Tuning.combine_fp8_partial_send_warps_per_row=1) and with one warp a token in
#            the reduce (Tuning.reduce_warps_per_token_max=1); at prefill (4096) as built and
#            with one warp a row
#   bench2   the same for the partial-reduce combine against the plain one after the same
#            deduplicated dispatch
#   core     when one call is all a session gets: the DeepEP API on an EmulatedGroup, the
#            deduplicated dispatch against today's, then under MPS rank masks with a PE
#            killed and DeepEP's normal mode and shrink test on process groups (shorter
#            bounds than the modes they come from)
#   figures  the deduplicated dispatch against today's and the rank mask's cost in one run;
#            the DeepEP API's host and round-trip times at decode and prefill (BF16, FP8)
# docs/PERF.md "Open items" says which goal each figure answers.
set -u
cd "$(dirname "$0")/.."
what=${1:-tests}
OUT=${OUT:-adoption-out}/$what
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
status=0
echo "commit ${EPGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}; mode $what" | tee "$SUMMARY"
nvidia-smi -L 2>&1 | tee -a "$SUMMARY"

. benchmarks/step.sh      # step NAME SECONDS COMMAND...

show() {   # show NAME: the tallies and timed rows of step NAME's log, into the summary
    grep -E "passed|failed|^FAILED|^ERROR|round trip|combine|speed|link" "$OUT/$1.log" \
        | tail -12 | sed 's/^/    /' | tee -a "$SUMMARY"
}

gpu_tests() {   # gpu_tests NAME SECONDS PYTEST ARGS...
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs "$@"
    show "$name"
}

case "$what" in
tests)
    gpu_tests deepep 200 tests/gpu/test_deepep_gpu.py -k "not process_group"
    gpu_tests dedup-fp8 330 tests/gpu/test_rank_dedup_gpu.py tests/gpu/test_combine_fp8_gpu.py \
        -k "not shmem_transport"
    ;;
tests2)
    gpu_tests partial-normal 300 tests/gpu/test_partial_reduce_gpu.py \
        tests/gpu/test_deepep_normal_gpu.py -k "not process_group"
    gpu_tests rank-mask-pow2 240 tests/gpu/test_rank_mask_gpu.py \
        tests/gpu/test_masked_slots_gpu.py tests/gpu/test_formats_gpu.py \
        tests/gpu/test_bench_combine_gpu.py -k "BlockwiseFP8Pow2 or bench_ or mask or masked"
    ;;
mps)
    LOG="$SUMMARY"
    . benchmarks/mps.sh        # MPS when available; stop_mps on exit
    export NVSHMEM_REMOTE_TRANSPORT=none EPGEN_SHMEM_PES=${EPGEN_SHMEM_PES:-2,4}
    gpu_tests shmem-warp-puts 200 tests/gpu/test_shmem_gpu.py -x
    gpu_tests shmem-features 330 tests/gpu/test_deepep_gpu.py tests/gpu/test_shmem_session_gpu.py \
        tests/gpu/test_rank_dedup_gpu.py tests/gpu/test_bench_worlds_gpu.py \
        -k "(process_group or two_formats or shmem_transport or shmem_bench) and not killed"
    stop_mps
    ;;
mps2)
    LOG="$SUMMARY"
    . benchmarks/mps.sh
    export NVSHMEM_REMOTE_TRANSPORT=none EPGEN_SHMEM_PES=${EPGEN_SHMEM_PES:-2,4}
    gpu_tests normal-shrink-pg 240 tests/gpu/test_deepep_normal_gpu.py tests/gpu/test_deepep_gpu.py \
        -k "process_group and (normal or shrink)"
    gpu_tests rank-mask-pg 320 tests/gpu/test_rank_mask_shmem_gpu.py
    stop_mps
    ;;
mps8)
    LOG="$SUMMARY"
    . benchmarks/mps.sh
    export NVSHMEM_REMOTE_TRANSPORT=none EPGEN_SHMEM_PES=8
    gpu_tests shmem-8pe 540 tests/gpu/test_shmem_gpu.py
    stop_mps
    ;;
bench)
    step combine-fp8-decode 200 "$PY" -m epgen bench --op combine --combine-fp8 --tokens 128 \
        --variant default --variant send1=tune.combine_fp8_partial_send_warps_per_row:1 \
        --variant one=tune.reduce_warps_per_token_max:1 \
        --no-post-check --json "$OUT/combine-fp8-decode.json"
    show combine-fp8-decode
    step combine-fp8-prefill 280 "$PY" -m epgen bench --op combine --combine-fp8 --tokens 4096 \
        --variant default --variant send1=tune.combine_fp8_partial_send_warps_per_row:1 \
        --no-post-check --json "$OUT/combine-fp8-prefill.json"
    show combine-fp8-prefill
    ;;
bench2)
    step combine-partial-decode 200 "$PY" -m epgen bench --op combine --combine-partial \
        --tokens 128 --variant dedup=ep_rank_dedup \
        --variant dedup_send1=ep_rank_dedup,tune.combine_fp8_partial_send_warps_per_row:1 \
        --variant dedup_one=ep_rank_dedup,tune.reduce_warps_per_token_max:1 \
        --no-post-check --json "$OUT/combine-partial-decode.json"
    show combine-partial-decode
    step combine-partial-prefill 280 "$PY" -m epgen bench --op combine --combine-partial \
        --tokens 4096 --variant dedup=ep_rank_dedup \
        --variant dedup_send1=ep_rank_dedup,tune.combine_fp8_partial_send_warps_per_row:1 \
        --no-post-check --json "$OUT/combine-partial-prefill.json"
    show combine-partial-prefill
    ;;
core)
    gpu_tests deepep 90 tests/gpu/test_deepep_gpu.py -k "not process_group"
    step dedup 150 "$PY" -m epgen bench --tokens 128,4096 --variant default \
        --variant dedup=ep_rank_dedup --no-post-check --json "$OUT/dedup.json"
    show dedup
    LOG="$SUMMARY"
    . benchmarks/mps.sh
    export NVSHMEM_REMOTE_TRANSPORT=none EPGEN_SHMEM_PES=${EPGEN_SHMEM_PES:-2,4}
    gpu_tests rank-mask-pg 170 tests/gpu/test_rank_mask_shmem_gpu.py
    gpu_tests normal-shrink-pg 150 tests/gpu/test_deepep_normal_gpu.py \
        tests/gpu/test_deepep_gpu.py -k "process_group and (normal or shrink)"
    stop_mps
    ;;
figures)
    step dedup 200 "$PY" -m epgen bench --tokens 128,4096 --variant default \
        --variant dedup=ep_rank_dedup --variant mask=ep_rank_mask --no-post-check \
        --json "$OUT/dedup.json"
    show dedup
    step deepep-api 150 "$PY" -m epgen bench --preset decode --tokens 128 --api deepep \
        --json "$OUT/deepep-api.json"
    show deepep-api
    # DeepEP's layout reserves R * T rows per local expert: 4096 tokens do not fit a GPU
    step deepep-api-prefill 200 "$PY" -m epgen bench --preset prefill --tokens 512 \
        --api deepep --json "$OUT/deepep-api-prefill.json"
    show deepep-api-prefill
    ;;
*)
    echo "usage: $0 [tests|tests2|mps|mps2|mps8|bench|bench2|core|figures]" >&2
    exit 2
    ;;
esac
echo "status $status" | tee -a "$SUMMARY"
exit $status
