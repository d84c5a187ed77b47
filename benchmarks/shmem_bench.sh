#!/usr/bin/env bash
# The SHMEM put path against the direct-store path on one GPU machine (docs/PERF.md, "SHMEM
# puts against direct stores"): MPS on (when nvidia-cuda-mps-control exists and we are root),
# then for every PE count, shape and op one launch of
#
#   epgen launch -n N --mps-share -- epgen bench --world shmem --op OP --compare-p2p 1,N ...
#
# (every peer by NVSHMEM puts against every peer by nvshmem_ptr stores, in one run), each
# under a timeout; MPS off. Logs and rank 0's JSON in $OUT (shmem-<shape>-<N>pe-<op>.json).
#
#   EPGEN_COMMIT=<commit> timeout 590 benchmarks/shmem_bench.sh [decode|prefill|all]
#
# (default all). PES (default "2 4"), OPS (default "dispatch combine moe") and ITERS
# (default 50) narrow or change a call. FLAGS (default "-") lists the builds each launch is
# made for, one after the other: "-" the configuration as below, or comma-separated boolean
# flags each added as `--set FLAG=true` (the SHMEM benchmark takes no --variant), e.g.
# FLAGS="- ep_rank_dedup" times every shape, PE count and op without and then with the
# per-rank deduplicated dispatch, under the same MPS daemon; a flagged launch's files are
# named shmem-<shape>-<N>pe-<op>-<flags>. The shapes: the decode preset's H=7168, K=8, BF16
# with 7 local experts per PE (n_experts = 7 N) on 8 blocks of 512 threads per PE, at 128 tokens
# per rank (decode) and 4096 (prefill; its symmetric heap need, up to 5.1 GiB per PE at 4 PEs,
# is why NVSHMEM_SYMMETRIC_SIZE is 8 GiB here; its runs skip the checks, --no-post-check, as
# the reference combine of a prefill shape takes tens of seconds per PE: CHECK_PREFILL=1 keeps
# them). COMBINE_ARGS (default empty) is added to the combine launches only: e.g.
# COMBINE_ARGS="--combine-fp8" times the FP8 combine, COMBINE_ARGS="--combine-partial" (with
# FLAGS=ep_rank_dedup) the partial-reduce one, after the plain combine in the same launch
# (a "combine_fp8" / "combine_partial" row under each world, its speed-up over the plain
# combine). ARGS (default empty) is added to every launch: e.g. OPS=dispatch
# ARGS="--copy-rate" also times the bare copy of each shape's dispatch bytes by stores, warp
# puts and warp puts with a signal (a "T=... copy rate" line). Each launch runs under its own bound (120 s at decode, 240 s at prefill); not yet run
# on a GPU, so how many launches fit one call is not known: split by mode, PES or OPS.
set -u
cd "$(dirname "$0")/.."
MODE=${1:-all}
case "$MODE" in decode|prefill|all) ;; *) echo "usage: $0 [decode|prefill|all]" >&2; exit 2;; esac
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
LOG="$OUT/shmem_bench.log"
PY=${PYTHON:-python3}
export PYTHONPATH=.
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-8589934592}
PES=${PES:-"2 4"}
OPS=${OPS:-"dispatch combine moe"}
ITERS=${ITERS:-50}
FLAGS=${FLAGS:--}
COMBINE_ARGS=${COMBINE_ARGS:-}
ARGS=${ARGS:-}
echo "commit ${EPGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}; mode $MODE; logs in $OUT" | tee "$LOG"
nvidia-smi -L 2>&1 | tee -a "$LOG"

. "$(dirname "${BASH_SOURCE[0]}")/mps.sh"    # MPS when available; stop_mps on exit

status=0
shapes=$([ "$MODE" = all ] && echo "decode prefill" || echo "$MODE")
for shape in $shapes; do
    if [ "$shape" = decode ]; then tokens=128; check=(); limit=120
    else tokens=4096; limit=240
        if [ "${CHECK_PREFILL:-0}" = 1 ]; then check=(); else check=(--no-post-check); fi
    fi
    for n in $PES; do
        for op in $OPS; do
            for flags in $FLAGS; do
                name="shmem-$shape-${n}pe-$op"
                sets=()
                extra=()
                [ "$op" = combine ] && [ -n "$COMBINE_ARGS" ] && read -ra extra <<< "$COMBINE_ARGS"
                [ -n "$ARGS" ] && read -ra more <<< "$ARGS" && extra+=("${more[@]}")
                if [ "$flags" != - ]; then
                    name="$name-${flags//,/+}"
                    for f in ${flags//,/ }; do sets+=(--set "$f=true"); done
                fi
                echo "== $name ==" | tee -a "$LOG"
                timeout $((limit + 30)) "$PY" -m epgen launch -n "$n" --timeout "$limit" \
                    $( [ "$MPS" = 1 ] && echo --mps-share ) -- \
                    "$PY" -m epgen bench --world shmem --op "$op" --preset decode \
                    --set n_ranks="$n" --set n_experts=$((7 * n)) --set n_sms=8 \
                    --set use_shmem=true ${sets[@]+"${sets[@]}"} --tokens "$tokens" \
                    --compare-p2p "1,$n" --iters "$ITERS" ${check[@]+"${check[@]}"} \
                    ${extra[@]+"${extra[@]}"} --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
                rc=$?
                grep -E '^\[rank 0\] (shape|T=|decode|prefill|FAILED| +combine_)' "$OUT/$name.log" | tee -a "$LOG"
                if [ "$rc" != 0 ]; then
                    status=1
                    echo "$name: exit $rc" | tee -a "$LOG"
                    tail -20 "$OUT/$name.log" | tee -a "$LOG"
                fi
            done
        done
    done
done
stop_mps
echo "status $status" | tee -a "$LOG"
exit $status
