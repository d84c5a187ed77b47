#!/usr/bin/env bash
# One call on the GPU machine: the whole GPU tier, then the benchmark set of docs/PERF.md,
# each step under its own timeout, logs and JSON under $OUT (default ./gpu-session-out). Run
# from the repository root; a step that fails or times out is reported and the next one still
# runs.
#
#   EPGEN_COMMIT=<commit> benchmarks/gpu_session.sh [tests|bench|all|formats|latency|latency-nvfp4|trace|batch-ab|format-variants|profile|recv-ab|split-ab|block-ab|geometry|graph-ab|p2p|combine|sanitizer]
#
# (default all; "formats": the quantising formats' GPU tests, quantiser sweep and round trips;
# "latency": the round trip from 1 to 128 tokens per rank, stream launches and graph replays
# ("latency-nvfp4": NVFP4's, about a minute); "trace": the trace rings' GPU tests and
# `epgen run --trace FILE.json` timelines (and Perfetto files) of decode calls, then "latency-nvfp4" (about 4 minutes);
# "batch-ab": every rank's grid in one launch against one launch per rank, its GPU tests,
# decode and prefill A/B arms and a batched timeline (about 5 minutes); "format-variants":
# the quantising formats' ORD-R, ep_send_join_named, fused and final+prod round trips at
# prefill, streams, graphs and batched (about 5 minutes); "profile": Nsight Compute on
# NVFP4's dispatch_async, where ncu exists;
# "recv-ab": the quantising formats at other message alignments (about 2 minutes);
# "split-ab": 1 and 4 warps sharing a token at decode (--tune send_warps_per_token_max),
# with their GPU tests (about 6 minutes);
# "block-ab": the block-staged broadcast as BF16's, MXFP8's and BlockwiseFP8's prefill send
# path against the warp path (--tune block_broadcast_min_tokens_per_block), with its GPU
# tests, then "latency-nvfp4" (about 5 minutes);
# "geometry": prefill at 66 blocks x 256 threads per rank against the preset's 33 x 512, every
# BF16 variant and each quantising format (about 4 minutes);
# "graph-ab": the round trip as a CUDA-graph replay against stream launches, its GPU tests
# first (about 6 minutes); "p2p": on a multi-GPU machine, the
# P2P tests, `epgen run --world p2p` and the P2P benchmark on every GPU, about 2 minutes on
# two GPUs); "combine": the combine's GPU tests (the CUDA graph of dispatch + combine and the
# 1000-call loop included), `epgen run --combine` on streams and as graph replays, then
# `epgen bench --op combine` and `--op moe` at decode and prefill, streams and graphs (about 5
# minutes); "sanitizer": compute-sanitizer's memcheck over one dispatch + combine call of
# every single-GPU variant and format of the small preset (benchmarks/sanitizer_runs.py lists
# them: 16 runs), racecheck, initcheck and synccheck over its --slow subset (BF16, NVFP4,
# final+prod, fused: 4 runs each), each run under `timeout`, its errors counted into
# $OUT/sanitizer-summary.txt; exit 1 on any error, timeout, failed run or run left out by the
# time budget (SANITIZER_BUDGET_S, default 450 s for the whole mode, each run at most
# SANITIZER_LIMIT, default 90 s; SANITIZER_RUNS="small fused" restricts the runs by name,
# SANITIZER_TOOLS="racecheck synccheck" the tools, e.g. for a second call when the budget
# left runs out): at most about 8 minutes on one H200. A/B arms of settled choices go with their
# experiment (docs/PERF.md records what each measured); an arm of a choice still worth
# switching sets it with ``--tune``.
#
# About 14 minutes for "all" on one H200 (tests ~5.5 min, benchmarks ~9 min); under a 10-minute
# limit per command, run "tests" then "bench" (each under `timeout 590`).
set -u
OUT=${OUT:-gpu-session-out}
# every log and JSON goes under $OUT/files, and the end of the script packs them into one
# $OUT/<mode>.tar.gz (one file to copy off the machine)
FINAL_OUT=$OUT
OUT=$FINAL_OUT/files
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
what=${1:-all}
status=0

. "$(dirname "${BASH_SOURCE[0]}")/step.sh"    # step NAME SECONDS COMMAND...

bench() {  # bench NAME SECONDS ARGS...: epgen bench with JSON, then its table rows
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" python3 -m epgen bench "$@" --json "$OUT/$name.json"
    grep -E "round trip|dispatch_|torch" "$OUT/$name.log" | sed 's/^/    /'
}

gpu_tests() {  # gpu_tests NAME SECONDS PYTEST ARGS...: GPU tests (each under LIMIT seconds
               # where pytest-timeout is installed, as on the GPU machine; default 150),
               # then their tally
    local name=$1 limit=$2
    shift 2
    local per_test
    per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout ${LIMIT:-150}")
    # shellcheck disable=SC2086
    step "$name" "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider $per_test "$@"
    grep -E "passed|failed|skipped|^FAILED|^ERROR" "$OUT/$name.log" | tail -15 | sed 's/^/    /'
}

arm() {    # arm NAME SECONDS BENCH ARGS...: one A/B arm (its choices as --tune), with JSON,
           # then its round-trip, phase and baseline rows
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" python3 -m epgen "$@" --json "$OUT/$name.json"
    grep -E "^(decode|prefill) .*(round|dispatch|torch)" "$OUT/$name.log" | sed 's/^/    /'
}

if [ "$what" = tests ] || [ "$what" = all ]; then
    gpu_tests gpu-tests 420 tests/gpu
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    # every variant as stream launches, as a replay of its captured CUDA graph ("graph") and
    # with every rank's grid in one launch ("batched")
    bench bf16 260 --tokens 128,4096 --variant default --variant graph=graph --variant fused \
        --variant fused_graph=fused,graph --variant batched=batched \
        --variant batched_fused=batched,fused \
        --variant prod=ep_final_layout,ep_prod_reserve,alignment:16 \
        --variant prod_graph=ep_final_layout,ep_prod_reserve,alignment:16,graph \
        --variant prod_batched=ep_final_layout,ep_prod_reserve,alignment:16,batched \
        --no-post-check
    bench flags-prefill 100 --tokens 4096 --variant ord_r=ep_ord_r,has_rank_flag \
        --variant ord_r_graph=ep_ord_r,has_rank_flag,graph \
        --variant send_join_named=ep_send_join_named \
        --variant send_join_named_graph=ep_send_join_named,graph --no-post-check --no-baseline
    for fmt in NVFP4 BlockwiseFP8 MXFP8; do
        bench "$fmt" 130 --set format=$fmt --tokens 128,4096 --variant default \
            --variant graph=graph --variant fused_graph=fused,graph --variant batched=batched \
            --variant batched_fused=batched,fused --no-baseline --no-post-check
    done
    bench zipf 100 --tokens 4096 --routing zipf --variant default --variant graph=graph \
        --variant prod=ep_final_layout,ep_prod_reserve,alignment:16 --no-post-check
fi
if [ "$what" = formats ]; then
    # the quantising formats alone: their GPU tests, the quantiser's broadcast pattern with
    # 1, 2 and 4 items in flight (no protocol), then their round trips
    gpu_tests formats-tests 200 tests/gpu/test_formats_gpu.py
    step broadcast-formats 120 python3 benchmarks/experiments/broadcast_bw.py \
        --format NVFP4 --format BlockwiseFP8 --json "$OUT/broadcast-formats.json"
    sed 's/^/    /' "$OUT/broadcast-formats.log"
    for fmt in NVFP4 BlockwiseFP8; do
        bench "$fmt" 90 --set format=$fmt --tokens 128,4096 --no-baseline --no-post-check
    done
fi
if [ "$what" = latency ]; then
    # the round trip's floor: decode-sized calls down to one token per rank
    bench latency 200 --tokens 1,8,32,128 --variant default --variant graph=graph \
        --variant fused --variant fused_graph=fused,graph \
        --variant prod=ep_final_layout,ep_prod_reserve,alignment:16 \
        --variant prod_graph=ep_final_layout,ep_prod_reserve,alignment:16,graph --no-post-check
fi
latency_nvfp4() {   # NVFP4's round trip from 1 to 128 tokens per rank (its decode target
                    # is the one left): the chain's floor against the bytes
    bench latency-nvfp4 150 --set format=NVFP4 --tokens 1,8,32,128 --variant default \
        --variant graph=graph --variant fused_graph=fused,graph --no-baseline --no-post-check
}
if [ "$what" = latency-nvfp4 ]; then
    latency_nvfp4
fi
trace_runs() {   # trace_runs NAME ARGS...: `epgen run --trace FILE` (20 calls), its timeline
    local name=$1
    shift
    step "trace-$name" 120 python3 -m epgen run --trace "$OUT/trace-$name.json" --calls 20 \
        --seed 7 "$@"
    sed -n '/^trace events/,$p' "$OUT/trace-$name.log" | sed 's/^/    /'
}
if [ "$what" = format-variants ]; then
    # the quantising formats' other variants at prefill (every variant must reach 0.85):
    # ORD-R, ep_send_join_named and the fused launch, on streams and as graphs, final+prod
    # on streams and batched
    for fmt in NVFP4 MXFP8 BlockwiseFP8; do
        bench "variants-$fmt" 150 --set format=$fmt --tokens 4096 \
            --variant ord_r=ep_ord_r,has_rank_flag \
            --variant ord_r_graph=ep_ord_r,has_rank_flag,graph \
            --variant send_join_named=ep_send_join_named --variant fused \
            --variant fused_graph=fused,graph \
            --variant prod=ep_final_layout,ep_prod_reserve,alignment:16 \
            --variant prod_batched=ep_final_layout,ep_prod_reserve,alignment:16,batched \
            --no-baseline --no-post-check
    done
fi
if [ "$what" = batch-ab ]; then
    # every rank's grid in one launch (EmulatedWorld(batched=True)) against one launch per
    # rank: its GPU tests, then the same-call A/B at decode (NVFP4, BF16) and prefill (NVFP4,
    # BF16), then the batched NVFP4 decode timeline
    gpu_tests batch-tests 240 tests/gpu/test_rank_batch_gpu.py tests/gpu/test_trace_gpu.py
    arms=(--variant default --variant batched=batched --variant graph=graph
          --variant batched_graph=batched,graph --variant fused_graph=fused,graph
          --variant batched_fused_graph=batched,fused,graph)
    bench batch-nvfp4 150 --set format=NVFP4 --tokens 1,128,4096 "${arms[@]}" \
        --no-baseline --no-post-check
    bench batch-bf16 150 --tokens 128,4096 "${arms[@]}" --no-post-check
    trace_runs nvfp4-batched-fused-graph --preset decode --set format=NVFP4 --batched \
        --fused --graph
fi
if [ "$what" = trace ]; then
    # where the decode round trip's time goes: the trace rings' GPU tests, then the
    # timeline of NVFP4 (the decode target left) and BF16 at decode, and NVFP4 at 1 token
    gpu_tests trace-tests 200 tests/gpu/test_trace_gpu.py
    nvfp4=(--preset decode --set format=NVFP4)
    trace_runs nvfp4-fused-graph "${nvfp4[@]}" --fused --graph
    trace_runs nvfp4-graph "${nvfp4[@]}" --graph
    trace_runs nvfp4-1-fused-graph "${nvfp4[@]}" --tokens 1 --fused --graph
    trace_runs bf16-fused-graph --preset decode --fused --graph
    latency_nvfp4
fi
if [ "$what" = graph-ab ]; then
    # the round trip replayed as a captured CUDA graph (RoundTripGraph) against the same
    # variant's stream launches, same call: its GPU tests, then BF16's variants and each
    # quantising format at both shapes
    gpu_tests graph-tests 200 tests/gpu/test_graph_gpu.py
    bench graph-bf16 200 --tokens 128,4096 --variant default --variant graph=graph \
        --variant fused --variant fused_graph=fused,graph \
        --variant prod=ep_final_layout,ep_prod_reserve,alignment:16 \
        --variant prod_graph=ep_final_layout,ep_prod_reserve,alignment:16,graph --no-post-check
    for fmt in NVFP4 MXFP8 BlockwiseFP8; do
        bench "graph-$fmt" 100 --set format=$fmt --tokens 128,4096 --variant default \
            --variant graph=graph --no-baseline --no-post-check
    done
fi
if [ "$what" = profile ]; then
    # where NVFP4's dispatch_async spends its time at prefill, if Nsight Compute is there: one
    # launch of one emulated rank (ncu serialises kernels; every rank's dispatch_async is
    # queued before any dispatch_wait, so none waits on a kernel not yet run)
    if command -v ncu >/dev/null; then
        step profile-nvfp4 240 ncu --kernel-name ep_dispatch_async --launch-skip 8 \
            --launch-count 1 --section SpeedOfLight --section WarpStateStats \
            --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
            python3 -m epgen run --preset decode --set format=NVFP4 \
            --set max_tokens_per_rank=4096 --set recv_block_capacity=256 --calls 2
        grep -vE "^==PROF==|^\s*$" "$OUT/profile-nvfp4.log" | tail -80 | sed 's/^/    /'
    else
        echo "profile: no ncu on this machine ($(ls /usr/local/cuda*/bin 2>/dev/null | \
            grep -cE '^(ncu|nsys)$') Nsight tools under /usr/local/cuda*/bin)"
    fi
fi
ab() {     # ab NAME BENCH ARGS...: one prefill A/B arm (``arm`` at 4096 tokens)
    local name=$1
    shift
    arm "$name" 80 "$@" --tokens 4096 --no-baseline --no-post-check
}
if [ "$what" = recv-ab ]; then
    # the quantising formats as shipped, then at other message alignments (NVFP4 4064 B at
    # 16, 4352 B at 128; BlockwiseFP8 7680 B at 128), same call
    for fmt in NVFP4 BlockwiseFP8; do
        ab "recv-ab-$fmt-shipped" bench --set format=$fmt
    done
    ab recv-ab-NVFP4-align16 bench --set format=NVFP4 --set alignment=16
    ab recv-ab-NVFP4-align128 bench --set format=NVFP4 --set alignment=128
    ab recv-ab-BlockwiseFP8-align128 bench --set format=BlockwiseFP8 --set alignment=128
fi
if [ "$what" = split-ab ]; then
    # warps sharing a token at decode, same call: first their GPU tests, then decode with 1
    # and 4 warps per token (tuning.send_warps_per_token_max) in every format, stream,
    # graph, fused and fused graph
    gpu_tests split-tests 240 tests/gpu/test_token_split_gpu.py
    for fmt in BF16 NVFP4 MXFP8 BlockwiseFP8; do
        for n in 1 4; do
            arm "split-$fmt-$n" 100 bench --tune "send_warps_per_token_max=$n" \
                --set format=$fmt --tokens 128 --variant default --variant graph=graph \
                --variant fused --variant fused_graph=fused,graph --no-baseline --no-post-check
        done
    done
fi
if [ "$what" = block-ab ]; then
    # the block-staged broadcast as the staged variants' prefill send path for BF16, MXFP8
    # and BlockwiseFP8 (send_policy.prefers_block_broadcast, shipped): its GPU tests,
    # then each format's default round trip with it and with the warp path (a threshold no
    # call reaches), same call; then NVFP4's latency sweep
    gpu_tests block-tests 150 tests/gpu/test_token_split_gpu.py -k block_broadcast
    for fmt in BF16 MXFP8 BlockwiseFP8; do
        for arm in block:16 warp:1000000; do
            ab "block-$fmt-${arm%%:*}" bench \
                --tune "block_broadcast_min_tokens_per_block=${arm##*:}" --set format=$fmt
        done
    done
    latency_nvfp4
fi
if [ "$what" = geometry ]; then
    # the prefill preset's geometry (33 blocks x 512 threads per rank: two blocks per SM)
    # against 66 x 256 (four per SM, the same warps per SM; 256 is the least num_threads
    # with E=256): every BF16 variant, then each quantising format, each pair in one process
    g=num_threads:256,n_sms:66
    bench geometry-BF16 200 --tokens 4096 --variant default --variant "g256=$g" \
        --variant fused --variant "fused256=fused,$g" \
        --variant named=ep_send_join_named --variant "named256=ep_send_join_named,$g" \
        --variant prod=ep_final_layout,ep_prod_reserve,alignment:16 \
        --variant "prod256=ep_final_layout,ep_prod_reserve,alignment:16,$g" \
        --no-post-check --no-baseline
    for fmt in NVFP4 BlockwiseFP8 MXFP8; do
        bench "geometry-$fmt" 90 --set format=$fmt --tokens 4096 --variant default \
            --variant "g256=$g" --no-baseline --no-post-check
    done
fi
if [ "$what" = p2p ]; then
    # a multi-GPU machine (nvidia-h200-x2/-x4/-x8): topology, every P2P test its GPUs allow
    # (the 1000-call loops included), the CLI, then the benchmark on all of its GPUs with the
    # default preset's shapes (BF16 staged and final layout at both shapes, then the quantising
    # formats at prefill)
    n=$(nvidia-smi -L | wc -l)
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
    head -$((n + 1)) "$OUT/topo.txt" | sed 's/^/    /'
    LIMIT=120 gpu_tests p2p-tests 300 tests/gpu/test_p2p_gpu.py
    step p2p-run 60 python3 -m epgen run --world p2p --preset small --calls 3
    p2p=(--world p2p --preset default --set n_ranks="$n" --set p2p_world_size="$n")
    # a plot where matplotlib is installed
    plot=$(python3 -c "import matplotlib" 2>/dev/null && echo "--plot $OUT/p2p-bench.png")
    # shellcheck disable=SC2086
    step p2p-bench 200 python3 -m epgen bench "${p2p[@]}" --tokens 128,4096 \
        --variant default --variant final=ep_final_layout,ep_prod_reserve \
        --json "$OUT/p2p-bench.json" $plot
    grep -E "^(decode|prefill) |peer copy" "$OUT/p2p-bench.log" | sed 's/^/    /'
    step p2p-formats 150 python3 -m epgen bench "${p2p[@]}" --tokens 4096 \
        --set format=NVFP4 --variant default --variant final=ep_final_layout,ep_prod_reserve \
        --json "$OUT/p2p-formats.json"
    grep -E "^(decode|prefill) |peer copy" "$OUT/p2p-formats.log" | sed 's/^/    /'
fi
if [ "$what" = combine ]; then
    LIMIT=200 gpu_tests combine-tests 300 tests/gpu/test_combine_gpu.py \
        tests/gpu/test_combine_graph_gpu.py tests/gpu/test_combine_stress_gpu.py \
        tests/gpu/test_combine_cli_gpu.py tests/gpu/test_bench_combine_gpu.py
    step combine-run 60 python3 -m epgen run --preset small --calls 3 --combine
    step combine-run-graph 60 python3 -m epgen run --preset small --calls 3 --combine --graph
    grep -E "combine:|MISMATCH" "$OUT/combine-run.log" "$OUT/combine-run-graph.log" \
        | sed 's/^/    /'
    step combine-bench 150 python3 -m epgen bench --op combine --tokens 128,4096 \
        --json "$OUT/combine-bench.json"
    grep -E "combine|torch" "$OUT/combine-bench.log" | sed 's/^/    /'
    step moe-bench 200 python3 -m epgen bench --op moe --tokens 128,4096 --variant default \
        --variant graph=graph --json "$OUT/moe-bench.json"
    grep -E "combine|torch" "$OUT/moe-bench.log" | sed 's/^/    /'
fi
sanitize() {   # sanitize TOOL SECONDS NAME ARGS...: one `epgen run` under compute-sanitizer
               # TOOL, its verdict and error count appended to the summary table
    local tool=$1 limit=$2 name=$3
    shift 3
    local log="$OUT/sanitizer-$tool-$name.log" t0=$SECONDS
    local left=$((${SANITIZER_BUDGET_S:-450} - (SECONDS - san_t0)))
    [ "$left" -lt "$limit" ] && limit=$left     # the whole mode stays within the budget
    if [ "$limit" -lt 10 ]; then
        printf '%-10s %-32s %6s %5s  %s\n' "$tool" "$name" - 0 "not run: time budget" \
            >>"$san_table"
        status=1
        return
    fi
    timeout "$limit" "$san_bin" --tool "$tool" --print-limit 50 \
        python3 -m epgen run "$@" >"$log" 2>&1
    local rc=$? errors verdict=ok
    # memcheck, initcheck, synccheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK
    # SUMMARY: H hazards displayed (N errors, W warnings)"
    errors=$(grep -oE "ERROR SUMMARY: [0-9]+|SUMMARY: [0-9]+ hazards displayed \([0-9]+ errors" \
        "$log" | tail -1 | grep -oE "[0-9]+( errors)?$" | grep -oE "^[0-9]+")
    if [ $rc -eq 124 ]; then verdict="timed out after ${limit}s"
    elif [ -z "$errors" ]; then verdict="no sanitizer summary (exit $rc)"
    elif [ "$errors" -gt 0 ]; then verdict="$errors errors"
    elif [ $rc -ne 0 ]; then verdict="exit $rc"
    fi
    [ "$verdict" != ok ] && status=1
    printf '%-10s %-32s %6s %5s  %s\n' "$tool" "$name" "${errors:-?}" \
        $((SECONDS - t0)) "$verdict" >>"$san_table"
}
if [ "$what" = sanitizer ]; then
    # compute-sanitizer over every single-GPU variant and format (header); a run that fails
    # shows the tool's report in its log, $OUT/sanitizer-TOOL-NAME.log
    san_bin=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
        2>/dev/null | head -1)
    san_table="$OUT/sanitizer-summary.txt"
    san_t0=$SECONDS
    if [ -z "$san_bin" ]; then
        echo "sanitizer: no compute-sanitizer on this machine (PATH, /usr/local/cuda*/bin)" \
            | tee "$san_table"
        status=1
    else
        printf '%-10s %-32s %6s %5s  %s\n' tool run errors secs verdict >"$san_table"
        for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
            slow=--slow
            [ $tool = memcheck ] && slow=
            # shellcheck disable=SC2086
            while read -r name args; do
                case " ${SANITIZER_RUNS:-$name} " in *" $name "*) ;; *) continue ;; esac
                # shellcheck disable=SC2086
                sanitize "$tool" "${SANITIZER_LIMIT:-90}" "$name" $args
            done < <(python3 benchmarks/sanitizer_runs.py $slow)
        done
        sed 's/^/    /' "$san_table"
        echo "    ($("$san_bin" --version | tail -1); $((SECONDS - san_t0)) s)"
    fi
fi
tar -czf "$FINAL_OUT/$what.tar.gz" -C "$OUT" . && rm -rf "$OUT"
exit $status
