#!/usr/bin/env bash
# ShmemWorld on one GPU machine: MPS on (when nvidia-cuda-mps-control exists and we are
# root), tests/gpu/test_shmem_gpu.py for 2, 4 and 8 PEs (each PE's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
# floor(100/N), so the shares sum to <= 100), MPS off; everything under timeouts, logs in $OUT.
#
#   EPGEN_COMMIT=<commit> timeout 590 benchmarks/shmem_session.sh
#
# Run from the repository root. One GPU is enough: every PE shares it; with more GPUs PE k
# runs on GPU k % (number of GPUs).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
LOG="$OUT/shmem_session.log"
PY=${PYTHON:-python3}
export PYTHONPATH=.
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NVLS=1
export EPGEN_SHMEM_TIMEOUT=${EPGEN_SHMEM_TIMEOUT:-150}
echo "commit ${EPGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}; logs in $OUT" | tee "$LOG"
nvidia-smi -L 2>&1 | tee -a "$LOG"
timeout 30 "$PY" -c "from backends.cuda import nvshmem_host as n; h = n.NvshmemHost(); print('NVSHMEM', h.version(), h.path)" 2>&1 | tee -a "$LOG"

. "$(dirname "${BASH_SOURCE[0]}")/mps.sh"    # MPS when available; stop_mps on exit

status=0
for n in 2 4 8; do
    echo "== $n PEs ==" | tee -a "$LOG"
    # tests/gpu/test_shmem_gpu.py passes --mps-share to epgen launch when CUDA_MPS_PIPE_DIRECTORY is set
    EPGEN_SHMEM_PES=$n timeout 400 "$PY" -m pytest -m gpu -q -p no:cacheprovider -x \
        tests/gpu/test_shmem_gpu.py -k "every_peer or p2p_groups" -rA 2>&1 | tee "$OUT/pes-$n.log" | tail -5 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
echo "== formats, ORD-R, fused, dead peer, 1000 calls (2 and 4 PEs) ==" | tee -a "$LOG"
EPGEN_SHMEM_PES=2,4 timeout 500 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    tests/gpu/test_shmem_gpu.py -k "not every_peer and not p2p_groups" -rA 2>&1 \
    | tee "$OUT/rest.log" | tail -8 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "== epgen launch, by hand ==" | tee -a "$LOG"
timeout 200 "$PY" -m epgen launch -n 2 --timeout 180 $( [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo --mps-share ) -- \
    "$PY" -m epgen run --world shmem --preset small --set use_shmem=true --set p2p_world_size=1 --calls 3 \
    2>&1 | tee "$OUT/run-2.log" | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 200 "$PY" -m epgen launch -n 2 --timeout 180 $( [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo --mps-share ) -- \
    "$PY" -m epgen bench --world shmem --preset small --set use_shmem=true --set p2p_world_size=1 --iters 50 \
    2>&1 | tee "$OUT/bench-2.log" | tee -a "$LOG"
stop_mps
echo "status $status" | tee -a "$LOG"
exit $status
