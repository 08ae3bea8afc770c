#!/usr/bin/env bash
# The H200 runbook. Stages run in the order given; each fits the 10-minute call limit on its own, and
# its outputs land in $OUT as they are produced, so a stage that is cut short keeps what it measured:
#
#   scripts/gpu_session.sh hostpath      # issue 16: graph updates per step (VLOG counts), TTFT variants
#   scripts/gpu_session.sh ttft-fp8      # issue 19: 8-layer V3.2 TTFT, FP8 weights then bf16 weights (fused:device:8)
#   scripts/gpu_session.sh ttft-fp8-pad  # issue 19: the same with wkv_a on XLA's path (vt/nopad), padded per call (vt/percall), fused (main)
#   scripts/gpu_session.sh topk-rows     # the row select natively with bits=2, timed beside bits=1; V3.2 + V4 steps vs vt/base
#   scripts/gpu_session.sh norm-quant    # the norm that quantises for the FP8 linears: native tests, by rows vs XLA, the steps vs vt/base
#   scripts/gpu_session.sh ttft-trees    # the 8-layer TTFT (FP8 weights) of TT_ARCH in each tree of TT_TREES
#   scripts/gpu_session.sh ttft-parts    # issue 16: TTFT's host time per dispatch, preparation in the loop vs alone, put / spin
#   scripts/gpu_session.sh invariance    # issue 23: --batch-invariant under preemption (20 pages)
#   scripts/gpu_session.sh deep          # issue 16: 61 layers, MoE (8 routed experts, top-8)
#   scripts/gpu_session.sh deep61        # issue 16: 61 layers (dense MLP 2048), 16 and 61 segments: the host critical path at depth
#   scripts/gpu_session.sh deep-seg      # issue 16: 61 layers, FP8 weights + experts, 8 / 16 / 32 segments
#   scripts/gpu_session.sh deep-v4       # issue 16: the 43-layer V4-Flash pattern
#   scripts/gpu_session.sh async         # issue 16: the server, async stepping on vs --no-async
#   scripts/gpu_session.sh compare       # issue 18: jds beside the PyTorch comparator, one run, one table (V3.2, 8 layers)
#   scripts/gpu_session.sh compare-fp8   # issue 19: the same with FP8 linears on both sides (torch: blockwise scaled_mm), its gpu tests first
#   scripts/gpu_session.sh torch-profile # issue 18: the comparator's eager step, device time per stage (torch.profiler)
#   scripts/gpu_session.sh fp8gemm       # issue 19: the FP8 block-scaled GEMM kernel: native tests, then the bench
#   scripts/gpu_session.sh fp8grouped    # issue 19: the grouped FP8 expert GEMM (V3.2 MoE): native tests, then the bench
#   scripts/gpu_session.sh fp4gemm       # issue 22: the FP4 grouped expert GEMM: native tests, then the bench
#   scripts/gpu_session.sh ncu           # Nsight Compute on one FP4 (8 tokens) and one FP8 (M = 64) GEMM call: text pages
#   scripts/gpu_session.sh ncu-fp8sweep  # issue 19: FP8 decode calls x tile variants, exact kernel durations (ncu)
#   scripts/gpu_session.sh fp8gap        # issue 19: the gap between two Mosaic kernels, waited call vs 8 calls in one jit
#   scripts/gpu_session.sh ncu-topk      # issue 20: Nsight Compute (full set) on the radix select at 64 x 64K, one and two programs per row
#   scripts/gpu_session.sh ncu-fp4t1     # issue 22: Nsight Compute with SASS stall samples on the FP4 GEMM at 1 token
#   scripts/gpu_session.sh ncu-mqa       # issue 20: Nsight Compute (full set) on the sparse MQA, V3.2 and V4 decode at batch 64
#   scripts/gpu_session.sh mqa-variants  # issue 20: sparse MQA native tests, its switches on the GPU timeline, ncu of the default
#   scripts/gpu_session.sh mqa-loops     # issue 20: the register producer's native tests, then its switch sets timed
#   scripts/gpu_session.sh topk-sf       # issue 20: the top-k's split finish against the indexer's config, native tests first
#   scripts/gpu_session.sh topk-prefilter # issue 20: a warp's own part / layouts without conversions, fused bucket
#   scripts/gpu_session.sh topk-shapes   # issue 20: the default (warp fill) against the CTA-wide fill, 4 more shapes
#   scripts/gpu_session.sh topk-select   # issue 20: the indexer's decode select per top-k choice (the split finish beside)
#   scripts/gpu_session.sh step-kernels  # the 8-layer FP8 steps' kernels by source line, V4 and V3.2, in each tree of SK_TREES
#   scripts/gpu_session.sh mqa-one       # issue 20: scores="one" (warpgroup 0 scores all candidates): native tests, then timed
#   scripts/gpu_session.sh mqa-refresh   # issue 20: every native MQA test; the defaults, V4's splits and output dtypes timed
#   scripts/gpu_session.sh mqa-probe     # issue 20: the MQA's fixed / per-block cost fit, V4's in-kernel regions
#   scripts/gpu_session.sh mqa-rows      # issue 20: the MQA's wall-clock rows beside XLA, the 8-layer V3.2 fused step
#   scripts/gpu_session.sh ncu-fp4sweep  # issue 22: FP4 grouped decode calls x variants (bf16 / e4m3 x), exact kernel durations (ncu)
#   scripts/gpu_session.sh hostprofile   # issue 16: one step's GPU timeline (8 layers, 8 segments), TTFT's readback
#   scripts/gpu_session.sh probe         # host cost of a captured step: preparation vs dispatch, graphs vs none
#   scripts/gpu_session.sh boundary      # bench_boundary, V3.2 + V4, compiled in parallel processes first
#   scripts/gpu_session.sh boundary-v4   # the V4 stack alone (all three modes)
#   scripts/gpu_session.sh boundary-xla  # as boundary, with the pure-JAX attention stages
#   scripts/gpu_session.sh serve         # bench_serve_modes: the server in each mode, c=1 and c=64
#   scripts/gpu_session.sh thunks        # thunk-dump check: graphs, direct launches per step per mode
#   scripts/gpu_session.sh pending       # the twelfth session's open points: the MQA bench rows, then the decode select
#   scripts/gpu_session.sh ncu-fp8gsweep # issue 19: FP8 grouped decode calls x variants (row layout), exact kernel durations (ncu)
#   scripts/gpu_session.sh first         # a session's first call: H200 -> mqa-one + untested gpu tests; H100 -> indexer tests + step-kernels
#   scripts/gpu_session.sh tests-all     # every gpu-marked test, 6 pytest-xdist workers on the one GPU
#   scripts/gpu_session.sh kernels       # fused insert (+ tile sweep) + indexer rows with device_us, top-k variants
#   scripts/gpu_session.sh insert-parts  # issue 20: V3.2's inserts without their Hadamard, a same-size copy, ncu at T = 8192
#   scripts/gpu_session.sh insert-regs   # issue 20: the inserts' registers / shared memory as the GPU build compiles them
#   scripts/gpu_session.sh q-split       # issue 20: the fused q at T = 1024, phases split + 8 warps against the default
#   scripts/gpu_session.sh q-rows        # issue 20: the fused q at two tokens per program (T = 1024 in one wave)
#   scripts/gpu_session.sh fp4-regions   # issue 22: the FP4 kernel's named regions per warpgroup at 1 and 8 tokens (profiler)
#   scripts/gpu_session.sh mosaic-ptx    # a Mosaic kernel's PTX (default: FP4 w2, 1 token) for scripts/diag/mosaic_sass.py
#   scripts/gpu_session.sh fused-layout  # issues 22 / 19: layout "fused", w1 + w3 in one FP4 call, 4-deep rings (tests, timeline, ncu)
#   scripts/gpu_session.sh fp8-192       # issue 19: the FP8 GEMM's 192-wide tiles (q_b at 128 rows in one wave), tests then ncu sweep
#   scripts/gpu_session.sh qb-floor      # issue 19: q_b's weight stream alone (no MMA) against the GEMM, ring depths (ncu)
#   scripts/gpu_session.sh fp8-regions   # issue 19: the FP8 GEMM's named regions per warpgroup at decode (profiler)
#   scripts/gpu_session.sh fp8-trim      # issue 19: every one-row-tile FP8 call stores its rows through SMEM + TMA: tests, ncu
#   scripts/gpu_session.sh fp8-swap      # issue 19: the FP8 GEMM with the roles swapped (y^T = W x^T) at decode: tests, ncu
#   scripts/gpu_session.sh fp8-large     # issue 19: the FP8 GEMM at 2048 / 8192 rows: call and kernel time beside torch, the form before
#   scripts/gpu_session.sh fence-ab      # issue 19: the proxy fence after slot reads: native tests, then against no fence
#   scripts/gpu_session.sh fp8-decode h200-only mqa-refresh  # h200-only: the stages after it only on an H200
#   scripts/gpu_session.sh fp8-decode    # issue 19: decode rows (one graph, rotated weights), q_b's 96-column chunks; tests
#   scripts/gpu_session.sh fp8-smem      # issue 19: swap_ab's y through transposed SMEM tiles (swap_store="smem"), timeline
#   scripts/gpu_session.sh fp8-ragged    # issue 19: tiles of 144 / 112 / 224 columns (one wave at 64-128 rows), tests then timeline
#   scripts/gpu_session.sh key           # one call for a scarce machine: top-k 64 x 64K, FP8 ragged mlp, top-k tests
#   scripts/gpu_session.sh fp4-wg4       # issue 22: the FP4 GEMM's four-warpgroup e4m3-x form, native tests then ncu sweep
#   scripts/gpu_session.sh inserts       # issue 20: the fused inserts alone, GPU timeline + T = 8192 tile sweep
#   scripts/gpu_session.sh topk          # Pallas radix-select top-k: native tests, then the top-k rows
#   scripts/gpu_session.sh topk-tests    # the native top-k + sparse-indexer tests (4 workers)
#   scripts/gpu_session.sh topk-knobs    # top-k native tests + knob sets (unroll, bits, shrink, block) at four shapes
#   scripts/gpu_session.sh topk-pivot    # issue 20: the indexer's top-k config against a 12- and an 8-bit pivot
#   scripts/gpu_session.sh topk-range    # issue 20: the finish from the pivot and the prefilter's loads in flight (knobs)
#   scripts/gpu_session.sh select      # indexer decode select: top-k "auto" against the default lax, and XLA
#   scripts/gpu_session.sh mqa           # MQA decode rows again, now with device_us (b1/b8 sit at the dispatch floor)
#   scripts/gpu_session.sh gather-probe  # issue 20: register gather + dequant into the swizzled K tile (the MQA producer's plan)
#   scripts/gpu_session.sh multigpu      # issue 21, kind nvidia-h200-x2: 8-layer V3.2 TTFT + decode, tp=1 vs tp=2
#
# Every timed process runs alone; every process sets XLA_PYTHON_CLIENT_PREALLOCATE=false so a compile
# helper beside it cannot run the GPU out of memory. Timeouts use SIGINT so pytest prints its summary.
# Every timeout also kills 10 s later (-k 10): a process waiting on a hung kernel ignores SIGTERM / SIGINT, and a
# call whose stage pipes into tail then returns nothing (twenty-fourth session: two calls lost that way).
# Stage limits can be shortened with <STAGE>_TIMEOUT (e.g. BOUNDARY_TIMEOUT=370) to share a call.
# The run tool brings back at most 8 files from $OUT per call: keep what matters in few files.
set -u
OUT=${OUT:-/tmp/jds_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L > "$OUT/device.txt" 2>&1 || true

# ncu_sweep KIND VARIANTS: every (case, tile variant) call of ncu_kernels.py's KINDsweep profiled once (exact kernel
# durations), one profiled process per variant (a process that crashes under ncu loses only its variant: the
# fp8 sweep's process died with SIGSEGV once, 2026-12-01, seventh session), reduced to
# $OUT/KIND_decode_ncu_sweep_h200.json by ncu_sweep_table.py
ncu_sweep() {
  local pairs=() i=0 v
  while read -r v; do
    timeout -k 10 ${NCUS_TIMEOUT:-150} ncu --clock-control none --profile-from-start off --csv --page raw --print-units base \
      --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      python3 scripts/diag/ncu_kernels.py "$1sweep" ${SWEEP_CASES:+--cases $SWEEP_CASES} --variants "[$v]" --order "/tmp/$1sweep_order$i.json" \
      > "/tmp/$1sweep$i.csv" 2>> "$OUT/$1sweep.err"; echo "ncu $1sweep $v rc=$?"
    pairs+=("/tmp/$1sweep$i.csv" "/tmp/$1sweep_order$i.json"); i=$((i + 1))
  done < <(python3 -c 'import json, sys; [print(json.dumps(v)) for v in json.loads(sys.argv[1])]' "$2")
  python3 scripts/diag/ncu_sweep_table.py "${pairs[@]}" > "$OUT/$1_decode_ncu_sweep_h200.json" 2>> "$OUT/$1sweep.err"
  tail -n 30 "$OUT/$1sweep.err" | grep -v "^==" | cut -c1-200
}

[ $# -ge 1 ] || set -- usage
for stage in "$@"; do
case "$stage" in
  hostpath)
    # issue 16. 2026-12-01: graph updates counted from XLA's VLOG: a fresh logits allocation re-recorded the
    # command buffers whenever the previous step's result was alive; the fused device-prep step now writes
    # its logits into a persistent buffer (0 updates since). Next: the top-level thunks of the device-prep
    # executable (--dump: which thunk splits it into 2 command buffers), then TTFT variants.
    timeout -k 10 ${GU_TIMEOUT:-130} python3 -m jds.bench.graph_updates --arch v32 --layers 8 --intermediate 18432 \
      --variants fused:device fused:device:4 --n 20 --timeout 120 --dump /tmp/gu_dump --out "$OUT/graph_updates_h200.json" \
      > "$OUT/graph_updates.log" 2>&1; echo "graph_updates rc=$?"; cut -c1-900 "$OUT/graph_updates.log"
    V="fused:host fused:device fused:device:2 fused:device:4 fused:device:8 narrow:host wide:host wide:device"
    timeout -k 10 ${TTFT_TIMEOUT:-230} python3 -m jds.bench.ttft --arch v32 --layers 8 --intermediate 18432 --variants $V \
      --out "$OUT/ttft_v32_h200.json" > "$OUT/ttft_v32.log" 2>&1; echo "ttft8 rc=$?"; grep '^{' "$OUT/ttft_v32.log" | cut -c1-250
    ;;
  ttft-fp8)
    # issue 19: the 8-layer V3.2 TTFT with FP8 weights (the FP8 GEMM's defaults as they are now), and with bf16
    # weights in the same call for the ratio
    for w in fp8 bf16; do
      timeout -k 10 ${TTFT8_TIMEOUT:-200} python3 -m jds.bench.ttft --arch v32 --layers 8 --intermediate 18432 \
        $([ $w = fp8 ] && echo --fp8-weights) --variants fused:device:8 --n 50 --out "$OUT/ttft_v32_${w}_h200.json" \
        > "$OUT/ttft_v32_$w.log" 2>&1; echo "ttft $w rc=$?"; grep '^{' "$OUT/ttft_v32_$w.log" | cut -c1-300
    done
    ;;
  ttft-fp8-pad)
    # issue 19: V3.2's input projections with FP8 weights, the 8-layer TTFT in several trees: vt/nopad (554fc54:
    # wkv_a on XLA's path, the kernel refused its out), vt/percall (b362dea: the kernel on weight rows padded per
    # call), vt/qkva (b878b7d: wq_a + wkv_a stored fused, zero rows stored: one GEMM) and main (the indexer's wk in
    # that GEMM too). Make each tree with `git archive REV jds pallas_kernels | tar -x -C vt/NAME` (untracked, it
    # travels with the tree); a missing one is skipped. python -m puts the current directory first, so each run
    # starts inside its tree
    R=$(pwd)
    for t in ${TTFTP_TREES:-nopad percall qkva main}; do
      D=$R; [ $t != main ] && D=$R/vt/$t
      [ -d "$D/jds" ] || { echo "ttft fp8 $t: no tree at $D"; continue; }
      (cd "$D" && PYTHONPATH=. timeout -k 10 ${TTFTP_TIMEOUT:-140} python3 -m jds.bench.ttft --arch v32 --layers 8 \
        --intermediate 18432 --fp8-weights --variants fused:device:8 --n 50 --out "$OUT/ttft_v32_fp8_${t}_h200.json" \
        > "$OUT/ttft_pad_$t.log" 2>&1); echo "ttft fp8 $t rc=$?"; grep '^{' "$OUT/ttft_pad_$t.log" | cut -c1-300
    done
    ;;
  step-kernels)
    # where a step's device time goes: scripts/diag/step_kernels.py (fused step, FP8 weights, TTFT 128 and decode
    # 64 at 4K) for each arch of SK_ARCHS in each tree of SK_TREES (main, or vt/NAME made by `git archive REV jds
    # pallas_kernels | tar -x -C vt/NAME`); the script runs from main, the tree's jds is imported (cd + PYTHONPATH=.)
    R=$(pwd)
    for a in ${SK_ARCHS:-v4 v32}; do for t in ${SK_TREES:-main}; do
      D=$R; [ $t != main ] && D=$R/vt/$t
      [ -d "$D/jds" ] || { echo "step kernels $t: no tree at $D"; continue; }
      X=""; [ $a = v32 ] && X="--intermediate 18432"
      (cd "$D" && PYTHONPATH=. timeout -k 10 ${SK_TIMEOUT:-150} python3 "$R/scripts/diag/step_kernels.py" --arch $a $X \
        --fp8-weights --top 60 ${SK_SHAPES:+--shapes $SK_SHAPES} --out "$OUT/step_kernels_${a}_${t}.json" \
        > "$OUT/step_kernels_${a}_${t}.log" 2>&1); echo "step kernels $a $t rc=$?"; grep "^==" "$OUT/step_kernels_${a}_${t}.log"
    done
    # each later tree against the first, by source function (the call returns only its output's tail)
    trees=(${SK_TREES:-main}); first=${trees[0]}
    for t in "${trees[@]:1}"; do
      [ -f "$OUT/step_kernels_${a}_${first}.json" ] && [ -f "$OUT/step_kernels_${a}_${t}.json" ] && {
        echo "-- $a: $first -> $t"; python3 "$R/scripts/diag/step_kernels.py" --diff "$OUT/step_kernels_${a}_${first}.json" \
          "$OUT/step_kernels_${a}_${t}.json" --top ${SK_DIFF_TOP:-10}; }
    done; done
    ;;
  topk-rows)
    # after the sixty-ninth session: topk_rows natively with bits=2 (two bits of the k-th key a round, built on the
    # CPU) beside bits=1 (the default, measured), and the indexer's native decode tests ("auto" runs the row select
    # there now), both forms timed at the indexer's decode widths; then the steps of
    # SK_ARCHS (default v32 v4) in each tree of SK_TREES (default "base main": make vt/base from 9708ac8, before the
    # row select in "auto" and the k >= N shortcut); TR_FUSIONS=1: then V4's compressor projection's fusions (split-K?)
    timeout -k 10 -s INT ${TR_TEST_TIMEOUT:-90} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernel_topk_rows.py \
      tests/test_kernel_sparse_indexer.py -k "topk_rows or native_decode_larger" > "$OUT/topk_rows_tests.log" 2>&1; echo "topk_rows tests rc=$?"; tail -1 "$OUT/topk_rows_tests.log"
    grep -E "^(FAILED|E )" "$OUT/topk_rows_tests.log" | head -8
    timeout -k 10 ${TR_TIMEOUT:-90} python3 scripts/diag/topk_small.py --shapes 1x4096:2048 64x4096:2048 64x8192:2048 \
      64x16384:2048 1024x4096:2048 64x1024:512 --rows-bits 1 2 --out "$OUT/topk_small_bits.json" > "$OUT/topk_small_bits.log" 2>&1
    echo "topk_small rc=$?"; grep '^{' "$OUT/topk_small_bits.log" | python3 -c 'import json, sys; [print(r["shape"], r["form"], r["profile_span_us"], r["same_sets"], (r["error"] or "")[:120]) for r in map(json.loads, sys.stdin)]'
    SK_ARCHS="${SK_ARCHS:-v32 v4}" SK_TREES="${SK_TREES:-base main}" SK_TIMEOUT=${SK_TIMEOUT:-110} SK_DIFF_TOP=${SK_DIFF_TOP:-6} \
      bash "$0" step-kernels
    [ "${TR_FUSIONS:-0}" = 1 ] && {  # the four steps take about 400 s: the fusions' dump in a call of its own
      timeout -k 10 ${SK_TIMEOUT:-110} python3 scripts/diag/step_kernels.py --arch v4 --fp8-weights --top 80 \
        --fusions "${NEXT_FUSIONS:-v4.py:91}" --out "$OUT/step_kernels_v4_fusions.json" > "$OUT/step_kernels_v4_fusions.log" 2>&1
      echo "step kernels v4 fusions rc=$?"; grep "^==" "$OUT/step_kernels_v4_fusions.log"; }
    ;;
  norm-quant)
    # the quantising producers (seventieth / seventy-first sessions): rms_norm_quant's and swiglu_quant's native
    # tests, each kernel against XLA's form + quantize_rows by row count and width (scripts/diag/norm_quant_rows.py,
    # --op norm / swiglu: where their AUTO_MAX_ROWS should sit), then the 8-layer steps of SK_ARCHS in each tree of
    # SK_TREES (default "base main": make vt/base from the tree before the change timed)
    timeout -k 10 -s INT ${NQ_TEST_TIMEOUT:-120} python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider \
      tests/test_kernel_norm_quant.py tests/test_kernel_swiglu_quant.py > "$OUT/norm_quant_tests.log" 2>&1
    echo "norm_quant / swiglu_quant tests rc=$?"; tail -1 "$OUT/norm_quant_tests.log"
    grep -E "^(FAILED|E )" "$OUT/norm_quant_tests.log" | head -8
    for op in norm swiglu; do
      timeout -k 10 ${NQ_TIMEOUT:-150} python3 scripts/diag/norm_quant_rows.py --op $op ${NQ_WARPS:+--warps $NQ_WARPS} \
        --out "$OUT/${op}_quant_rows.json" > "$OUT/${op}_quant_rows.log" 2>&1; echo "${op}_quant_rows rc=$?"
      grep '^{' "$OUT/${op}_quant_rows.log" | cut -c1-220
    done
    SK_ARCHS="${SK_ARCHS:-v4 v32}" SK_TREES="${SK_TREES:-base main}" SK_TIMEOUT=${SK_TIMEOUT:-110} SK_DIFF_TOP=${SK_DIFF_TOP:-8} \
      bash "$0" step-kernels
    ;;
  ttft-trees)
    # the 8-layer TTFT with FP8 weights (fused:device:8, 50 steps) of arch TT_ARCH in each tree of TT_TREES (main,
    # or vt/NAME made by `git archive REV jds pallas_kernels | tar -x -C vt/NAME`), each run inside its tree
    R=$(pwd); A=${TT_ARCH:-v4}; X=""; [ $A = v32 ] && X="--intermediate 18432"
    for t in ${TT_TREES:-main}; do
      D=$R; [ $t != main ] && D=$R/vt/$t
      [ -d "$D/jds" ] || { echo "ttft $A $t: no tree at $D"; continue; }
      (cd "$D" && PYTHONPATH=. timeout -k 10 ${TT_TIMEOUT:-150} python3 -m jds.bench.ttft --arch $A --layers 8 $X \
        --fp8-weights --variants fused:device:8 --n 50 --out "$OUT/ttft_${A}_fp8_${t}.json" > "$OUT/ttft_${A}_$t.log" 2>&1)
      echo "ttft $A $t rc=$?"; grep '^{' "$OUT/ttft_${A}_$t.log" | cut -c1-300
    done
    ;;
  ttft-parts)
    # issue 16: where TTFT's host time goes, per dispatch (seg0..), input preparation in the step loop vs alone;
    # the pinned step buffer + host ids (defaults) against the transfer paths (2026-12-01: spin and freeze lost)
    V=${TTFT_VARIANTS:-"fused:device:8 fused:device:8:transfer:devids fused:device:8:transfer:put:devids fused:device"}
    timeout -k 10 ${TTFT_TIMEOUT:-230} python3 -m jds.bench.ttft --arch v32 --layers 8 --intermediate 18432 --variants $V \
      --out "$OUT/ttft_parts_v32_h200.json" > "$OUT/ttft_parts.log" 2>&1; echo "ttft-parts rc=$?"; grep '^{' "$OUT/ttft_parts.log" | cut -c1-700
    ;;
  invariance)
    # issue 23: --batch-invariant under preemption on the GPU (2026-11-30: 64 pages preempted nothing)
    timeout -k 10 ${INV_TIMEOUT:-240} python3 scripts/bench_batch_invariant.py --preset v32-bench --configs invariant \
      --num-blocks 20 --out "$OUT/batch_invariant_preempt_h200.json" > "$OUT/batch_invariant.log" 2>&1
    echo "invariance rc=$?"; tail -5 "$OUT/batch_invariant.log"
    ;;
  deep)
    # issue 16 item 5: 61 layers, MoE with 8 routed experts (1.2 GB per layer; 16 did not fit the 0.75 default fraction)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 10 ${DEEP_TIMEOUT:-420} python3 -m jds.bench.ttft --arch v32 --layers 61 \
      --moe-experts 8 --moe-topk 8 --n 20 --variants fused:device fused:device:8 \
      --out "$OUT/ttft_v32_61l_h200.json" > "$OUT/ttft_v32_61l.log" 2>&1
    echo "deep rc=$?"; grep '^{' "$OUT/ttft_v32_61l.log" | cut -c1-250
    ;;
  deep61)
    # issue 16: the host critical path at DeepSeek's depth (target <= 1 ms): 61 layers, 16 segments (4 layers in
    # the first), pinned step buffer + host ids (the defaults); dense MLP 2048 keeps memory and compile small
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout -k 10 ${DEEP61_TIMEOUT:-560} python3 -m jds.bench.ttft --arch v32 --layers 61 \
      --intermediate 2048 --n 20 --compile-workers ${DEEP61_WORKERS:-8} --variants ${DEEP61_VARIANTS:-fused:device:16 fused:device:61 fused:device:8} \
      --out "$OUT/ttft_v32_61l_seg_h200.json" \
      > "$OUT/ttft_v32_61l_seg.log" 2>&1; echo "deep61 rc=$?"; grep '^{' "$OUT/ttft_v32_61l_seg.log" | cut -c1-700
    ;;
  deep-seg)
    # issue 16, 61-layer host path (target <= 1 ms): more, shorter segments, so the first launch is short;
    # FP8 linears and experts (as stored: half the expert bytes of bf16, so 16 routed experts fit)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 10 ${DEEPSEG_TIMEOUT:-560} python3 -m jds.bench.ttft --arch v32 --layers 61 \
      --moe-experts 16 --moe-topk 8 --fp8-weights --n 20 --variants fused:device:8 fused:device:16 fused:device:32 \
      --out "$OUT/ttft_v32_61l_seg_h200.json" > "$OUT/ttft_v32_61l_seg.log" 2>&1
    echo "deep-seg rc=$?"; grep '^{' "$OUT/ttft_v32_61l_seg.log" | cut -c1-250
    ;;
  deep-v4)
    # issue 16 item 5: the 43-layer V4-Flash pattern (dense MLP 2048), one executable and 8 segments
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 10 ${DEEP_V4_TIMEOUT:-420} python3 -m jds.bench.ttft --arch v4 --layers 43 \
      --n 20 --variants fused:device fused:device:8 --out "$OUT/ttft_v4_43l_h200.json" > "$OUT/ttft_v4_43l.log" 2>&1
    echo "deep-v4 rc=$?"; grep '^{' "$OUT/ttft_v4_43l.log" | cut -c1-250
    ;;
  async)
    # issue 16 item 4: the server with async stepping on and off, fused mode, c=1 and c=64; then the device-bound
    # decode step of the same stack (10 steps in flight) that c=1's time per output token is compared with
    for flag in "" "--no-async"; do
      name=async; [ -n "$flag" ] && name=sync
      timeout -k 10 ${ASYNC_TIMEOUT:-250} python3 scripts/bench_serve_modes.py --preset v32-bench --modes fused --num-prompts 96 \
        --output-len 64 --num-warmups 8 --out "$OUT/serve_${name}_h200.json" -- --num-blocks 600 --token-buckets 128 2048 \
        --key-block-buckets 4 $flag > "$OUT/serve_$name.log" 2>&1; echo "$name rc=$?"; tail -4 "$OUT/serve_$name.log"
    done
    timeout -k 10 ${DECODE_TIMEOUT:-80} python3 -m jds.bench.ttft --arch v32 --layers 8 --shape decode_b1_ctx512 \
      --variants fused:device --out "$OUT/decode_b1_v32_h200.json" > "$OUT/decode_b1.log" 2>&1
    echo "decode_b1 rc=$?"; grep '^{' "$OUT/decode_b1.log" | cut -c1-300
    ;;
  compare)
    # issue 18: both backends in one process (torch's graphs + the Triton paged indexer-logits kernel), V3.2 8 layers;
    # each step ends at the greedy ids on the host (issue 16's TTFT as the engine reads a token; COMPARE_END=logits: the old end)
    timeout -k 10 -s INT ${COMPARE_TIMEOUT:-540} python3 -m jds.bench.boundary --backend jax torch --arch ${COMPARE_ARCH:-v32} \
      --layers 8 --precompile --torch-indexer ${COMPARE_INDEXER:-triton} --step-end ${COMPARE_END:-ids} --out "$OUT/compare_${COMPARE_ARCH:-v32}_h200.json" \
      > "$OUT/compare.log" 2>&1; echo "compare rc=$?"; tail -14 "$OUT/compare.log"
    ;;
  compare-fp8)
    # issue 19: jds and the torch comparator with the checkpoint's FP8 linears (torch's blockwise scaled_mm, the
    # seventy-third session: untried on a GPU), V3.2 8 layers, jds fused beside torch narrow / full; first the
    # comparator's FP8 gpu tests (the blockwise GEMM against the dequantised one; every mode against jds)
    timeout -k 10 -s INT ${COMPARE_FP8_TEST_TIMEOUT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
      tests/test_compare_torch.py -k "fp8" > "$OUT/gpu_compare_fp8_tests.log" 2>&1
    echo "compare fp8 tests rc=$?"; grep -E "FAILED|ERROR" "$OUT/gpu_compare_fp8_tests.log" | head; tail -1 "$OUT/gpu_compare_fp8_tests.log"
    timeout -k 10 -s INT ${COMPARE_TIMEOUT:-400} python3 -m jds.bench.boundary --backend jax torch --arch v32 --layers 8 \
      --fp8-weights --precompile --modes fused --torch-modes narrow full --torch-indexer triton --step-end ids \
      --out "$OUT/compare_v32_fp8_h200.json" > "$OUT/compare_fp8.log" 2>&1; echo "compare fp8 rc=$?"; tail -14 "$OUT/compare_fp8.log"
    ;;
  torch-profile)
    # issue 18: what each torch stand-in costs on the GPU (the measured side of its docstring's expected gap)
    timeout -k 10 -s INT ${TPROF_TIMEOUT:-240} python3 -m jds.compare.torch_profile --arch v32 --layers 8 \
      --out "$OUT/torch_stages_v32_h200.json" > "$OUT/torch_profile.log" 2>&1; echo "torch-profile rc=$?"
    grep -v "^USDT\|^STAGE:" "$OUT/torch_profile.log" | tail -26
    ;;
  fp8gemm)
    # the native tests (about 120 s; FP8_TESTS=0 skips them), then the table's bench; q_b alone at 5 row counts
    # with every variant row took over 200 s (2026-12-05): FP8_ROWS='pallas xla torch bf16' leaves out the
    # variants (the table's columns)
    if [ "${FP8_TESTS:-1}" != 0 ]; then
      timeout -k 10 -s INT ${FP8T_TIMEOUT:-150} python3 -m pytest -m gpu -q -x --tb=short -p no:cacheprovider \
        tests/test_kernel_fp8_gemm.py > "$OUT/fp8_gemm_tests.log" 2>&1; echo "fp8 tests rc=$?"; tail -15 "$OUT/fp8_gemm_tests.log"
    fi
    timeout -k 10 -s INT ${FP8B_TIMEOUT:-200} python3 -m jds.bench.kernels_fp8_gemm --shapes ${FP8_SHAPES:-wo mlp} \
      --ms ${FP8_MS:-1 64 128 2048 8192} ${FP8_ROWS:+--rows $FP8_ROWS} --out "$OUT/kernels_fp8_gemm_h200.json" \
      > "$OUT/fp8_gemm_bench.log" 2>&1
    echo "fp8 bench rc=$?"; tail -30 "$OUT/fp8_gemm_bench.log" | cut -c1-220
    ;;
  ncu)
    # 2026-12-01: the FP4 kernel was issue-bound (dequantisation, wgmma descriptors), the FP8 decode kernel
    # waited on its scale loads. Reports stay on the machine; their details and SASS pages come back as text.
    for spec in "fp4 --shape w1 --tokens 8" "fp8 --shape wo --m 64"; do
      name=$(echo "$spec" | tr -d ' -' | cut -c1-12)
      timeout -k 10 ${NCU_TIMEOUT:-150} ncu --clock-control none --profile-from-start off --set full --import-source yes -f \
        -o "/tmp/$name" python3 scripts/diag/ncu_kernels.py $spec > /dev/null 2>&1; echo "ncu $name rc=$?"
      ncu -i "/tmp/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
      ncu -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_sass.csv" 2>&1
    done
    ;;
  ncu-fp8sweep)
    # 2026-12-01: split-K for one wave came from this sweep (sixth session), quantize_x's 2-3x slower kernel
    # (seventh); now the defaults against the other stream_k choice and the one-kernel act_quant;
    # FP8SWEEP_VARIANTS narrows it (M = 128 rows: stream_k is Unsupported there, recorded as an error)
    V=${FP8SWEEP_VARIANTS:-'[{}, {"stream_k": true}, {"stream_k": false}, {"act_quant": "xla"}]'}
    ncu_sweep fp8 "$V"
    ;;
  fp8-large)
    # issue 19: large M against the 60% target. Defaults (fifty-fourth session): the scales through the TMA ring
    # (ring_scales; per tile in the persistent loop), two K blocks a step from 64 K blocks (k_pairs), the persistent
    # loop up to 64 K blocks (q_b, mlp) with a tile's store behind the next tile's first MMA (store_overlap, fifty-sixth
    # session), groups of 16 M tiles, act_quant in one kernel. The "before" variant below is
    # the fifty-second session's form (no ring, no pairs, act_quant in XLA).
    # Native tests of the large-M forms first, then the call and kernel device times beside torch's blockwise
    # kernel and the form before (scripts/diag/fp8_large_kernels.py), then the benchmark's rows at 2048 / 8192
    # (serially the tests ran past 150 s on the H200, fifty-ninth session: 8 pytest-xdist workers; carry .whl/)
    python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist
    timeout -k 5 ${FLT_TIMEOUT:-150} python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider tests/test_kernel_fp8_gemm.py \
      -k "persistent or ring or k_pairs or exact_data or large_m" > "$OUT/fp8_large_tests.log" 2>&1
    echo "fp8 large tests rc=$?"; tail -4 "$OUT/fp8_large_tests.log"
    # its log in $OUT: the fifty-ninth session's run ended rc=1 with the log in /tmp, cause unknown
    timeout -k 10 -s KILL ${FLK_TIMEOUT:-200} python3 scripts/diag/fp8_large_kernels.py --shapes ${FL_SHAPES:-q_b wo mlp} \
      --m 2048 --rounds 2 --variants "${FLK_VARIANTS:-[{}, {\"ring_scales\": false, \"k_pairs\": false, \"act_quant\": \"xla\"}]}" \
      --out "$OUT/fp8_large_kernels_h200.json" > "$OUT/fp8_large_kernels.log" 2>&1
    echo "fp8 large kernels rc=$?"; grep '^{' "$OUT/fp8_large_kernels.log" | cut -c1-260; grep -v '^{' "$OUT/fp8_large_kernels.log" | tail -5
    timeout -k 10 -s INT ${FLB_TIMEOUT:-250} python3 -m jds.bench.kernels_fp8_gemm --shapes ${FL_SHAPES:-q_b wo mlp} \
      --ms ${FL_MS:-2048 8192} --rows ${FL_ROWS:-pallas torch} \
      --out "$OUT/kernels_fp8_gemm_large_h200.json" > "$OUT/fp8_large_bench.log" 2>&1
    echo "fp8 large bench rc=$?"; tail -40 "$OUT/fp8_large_bench.log" | cut -c1-220
    ;;
  fp8-decode)
    # issue 19 at 1-128 rows: the decode rows' device time as inside the model's captured step (one CUDA graph a call,
    # the weights cycled through copies spanning twice the L2), q_b / wo / mlp / x_proj at 1 / 64 / 128 rows beside
    # torch: the call's and (the kernels named apart since the sixty-second session) the GEMM kernel's own share of the copy
    # bandwidth, and the call with x handed over quantised (pallas[x=quantized]: the linears behind the model's norms,
    # seventieth session); then the native tests of the decode forms. Forms beside the default: FD_ROWS='pallas
    # pallas[column_scales=True] ...'. Rows are written after each one, so a call cut short keeps them
    set -f  # the row names' brackets are no glob
    timeout -k 10 -s INT ${FD_TIMEOUT:-240} python3 -m jds.bench.kernels_fp8_gemm --shapes ${FD_SHAPES:-q_b wo mlp x_proj} \
      --ms ${FD_MS:-1 64 128} \
      --rows ${FD_ROWS:-pallas pallas[x=quantized] torch} \
      --out "$OUT/kernels_fp8_gemm_decode_h200.json" > "$OUT/fp8_decode.log" 2>&1
    echo "fp8 decode rc=$?"; set +f; grep '^{' "$OUT/fp8_decode.log" | python3 -c 'import json, sys; [print(r["case"], r["impl"], r.get("profile_span_us"), r.get("hbm_frac_profile"), r.get("gemm_kernel_us"), r.get("hbm_frac_kernel"), r.get("quantize_kernel_us"), r.get("profile_weight_copies"), r.get("error", "")[:160]) for r in map(json.loads, sys.stdin)]'
    python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist
    timeout -k 10 -s INT ${FDT_TIMEOUT:-90} python3 -m pytest -m gpu -q -n 8 --tb=short -rfE -p no:cacheprovider \
      tests/test_kernel_fp8_gemm.py -k "${FDT_K:-out_not_a_multiple or ragged or persistent or ring_one_row}" \
      > "$OUT/fp8_decode_tests.log" 2>&1
    echo "fp8 decode tests rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/fp8_decode_tests.log" | head; tail -1 "$OUT/fp8_decode_tests.log"
    ;;
  fence-ab)
    # the proxy fence after generic-proxy slot reads (fp8_gemm.fence_slot_reads; fifty-fifth session, H100: the
    # fence alone costs nothing measurable, commit_smem's form 2-4%): the fenced kernels' native tests, then main
    # against a copy whose fence_slot_reads returns the body unchanged, interleaved. The copy is imported first
    # only where the script's own directory heads sys.path: scripts by path, or python -m run from inside the copy
    # (never python -m / -c from the repo root)
    R=$(pwd)
    timeout -k 10 -s INT ${FAT_TIMEOUT:-300} python3 -m pytest -m gpu -q -n 6 --tb=short -p no:cacheprovider \
      tests/test_kernel_fp8_grouped_gemm.py tests/test_kernel_fp4_grouped_gemm.py tests/test_kernel_fp8_gemm.py \
      -k "not swap and not stream_k" > "$OUT/fence_tests.log" 2>&1
    echo "fence tests rc=$?"; tail -3 "$OUT/fence_tests.log"
    rm -rf vt/nofence && mkdir -p vt/nofence && cp -r pallas_kernels jds vt/nofence/  # (the device's copy: no .git)
    python3 - vt/nofence/pallas_kernels/fp8_gemm.py <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
old = "        out = body(*args)\n        if interpret:\n            plgpu.commit_smem()\n        else:\n            proxy_fence()\n        return out"
assert old in s, "fence_slot_reads changed: update the fence-ab stage"
open(p, "w").write(s.replace(old, "        return body(*args)"))
PY
    for r in 1 2; do
      for t in vt/nofence .; do
        tag=$(basename "$t" | sed 's/^\.$/main/')
        PYTHONPATH=$t:. timeout -k 10 -s KILL ${FAK_TIMEOUT:-90} python3 scripts/diag/fp8_large_kernels.py \
          --shapes q_b wo mlp --m 2048 --rounds 1 --no-torch --variants '[{}]' --out "/tmp/fence_${tag}_$r.json" \
          > "/tmp/fence_${tag}_$r.log" 2>&1
        echo "fp8 gemm $tag round $r rc=$?"; grep '^{' "/tmp/fence_${tag}_$r.log" | cut -c1-150
        (cd /tmp && tar czf "$OUT/fence_ab.tgz" fence_*.json)  # after every run: a call cut short keeps them
        for b in kernels_fp8_grouped kernels_fp4_grouped; do
          (cd "$t" && PYTHONPATH=.:$R timeout -k 10 -s INT ${FAG_TIMEOUT:-150} python3 -m jds.bench.$b \
            ${FAG_ARGS:---shapes w1 --tokens 8 64} --out "/tmp/fence_${b}_${tag}_$r.json" > "/tmp/fence_${b}_${tag}_$r.log" 2>&1)
          echo "$b $tag round $r rc=$?"; tail -6 "/tmp/fence_${b}_${tag}_$r.log" | cut -c1-200
          (cd /tmp && tar czf "$OUT/fence_ab.tgz" fence_*.json)
        done
      done
    done
    ;;
  fp8-192)
    # issue 19 (twenty-fourth session, built untested): 192-wide tiles, so q_b's 24576 columns at 128 rows run
    # as 128 CTAs (one wave) instead of 192 128-wide tiles on 132 SMs (a tail wave); native tests, then exact
    # kernel times against the default at 128 (and 64) rows
    timeout -k 5 ${F192T_TIMEOUT:-150} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernel_fp8_gemm.py \
      -k "192 or lowers or exact_data" > "$OUT/fp8_192_tests.log" 2>&1; echo "fp8 192 tests rc=$?"
    tail -3 "$OUT/fp8_192_tests.log"
    V=${FP8SWEEP_VARIANTS:-'[{}, {"block_n": 192}, {"block_n": 192, "stages": 5}]'}
    SWEEP_CASES=${SWEEP_CASES:-'q_b:128 mlp:128 q_b:64'} ncu_sweep fp8 "$V"
    ;;
  qb-floor)
    # issue 19 (twenty-sixth session): is q_b's 56% of DRAM peak the GEMM's or its decomposition's? The same CTA
    # grid and TMA ring with no MMA (ncu_kernels.py streamsweep) by ring depth and weight layout, then the GEMM
    # itself at shallower rings (a 5-deep ring was slower than the 4-deep default, twenty-fourth session)
    V=${STREAMSWEEP_VARIANTS:-'[{}, {"stages": 2}, {"stages": 3}, {"stages": 6}, {"layout": "rows_ws"}, {"layout": "tiles"}]'}
    SWEEP_CASES=${SWEEP_CASES:-'q_b:0 mlp:0'} ncu_sweep stream "$V"
    V=${FP8SWEEP_VARIANTS:-'[{}, {"stages": 2}, {"stages": 3}]'}
    SWEEP_CASES=${FP8_CASES:-'q_b:1 q_b:64 q_b:128 mlp:1 mlp:128'} ncu_sweep fp8 "$V"
    ;;
  fp8-regions)
    # issue 19 (twenty-sixth session): the weight stream alone is 2-6 us shorter than the GEMM (qb-floor): does the
    # GEMM lose it in the first fill, in step bodies longer than the arrival interval, or at the end?
    timeout -k 10 -s INT ${FP8RT_TIMEOUT:-120} python3 -m pytest -m gpu -q -x --tb=short -p no:cacheprovider \
      tests/test_kernel_fp8_gemm.py -k "192 or exact_data" > "$OUT/fp8_regions_tests.log" 2>&1
    echo "fp8 tests rc=$?"; tail -2 "$OUT/fp8_regions_tests.log"
    timeout -k 10 ${FP8REG_TIMEOUT:-240} python3 scripts/diag/fp8_regions.py --cases ${FP8REG_CASES:-q_b:1 q_b:64 q_b:128 mlp:1 mlp:128} \
      --variants ${FP8REG_VARIANTS:-'[{}]'} --out "$OUT/fp8_regions_h200.json" > "$OUT/fp8_regions.log" 2>&1
    echo "fp8 regions rc=$?"; grep -v Warning "$OUT/fp8_regions.log" | tail -c 5000
    ;;
  fp8-trim)
    # issue 19 (twenty-sixth session): the regions put a 128-row tile's register stores at 5-7 us of its CTAs' tail
    # (fp8-regions); every one-row-tile call now stores its first round_up(M, 8) rows through SMEM and TMA
    timeout -k 10 -s INT ${FP8T_TIMEOUT:-200} python3 -m pytest -m gpu -q -x --tb=short -p no:cacheprovider \
      tests/test_kernel_fp8_gemm.py > "$OUT/fp8_gemm_tests.log" 2>&1; echo "fp8 tests rc=$?"; tail -2 "$OUT/fp8_gemm_tests.log"
    V=${FP8SWEEP_VARIANTS:-'[{"stages": 4}]'}
    SWEEP_CASES=${FP8_CASES:-'q_b:1 q_b:64 q_b:128 mlp:1 mlp:64 mlp:128 wo:64 wo:128'} ncu_sweep fp8 "$V"
    ;;
  fp8-smem)
    # issue 19 (thirty-fifth session): the swapped form's y through transposed SMEM tiles and TMA (swap_store="smem")
    # against the default call and the y^T + XLA transpose form, whole-call µs on the GPU timeline, cold weights
    timeout -k 10 -s INT ${FP8S_TIMEOUT:-150} python3 -m pytest -m gpu -q -x --tb=short -p no:cacheprovider \
      tests/test_kernel_fp8_gemm.py -k "swap" > "$OUT/fp8_smem_tests.log" 2>&1
    echo "fp8 smem tests rc=$?"; tail -3 "$OUT/fp8_smem_tests.log"
    timeout -k 10 -s INT ${FP8SM_TIMEOUT:-400} python3 scripts/diag/fp8_tiles_time.py \
      --cases ${FP8_CASES:-q_b:16 q_b:32 q_b:64 q_b:128 mlp:16 mlp:32 wo:16 wo:64} \
      --variants '[{}, {"swap_ab": true}, {"swap_ab": true, "swap_store": "smem"}]' --rotations 4 \
      --out "$OUT/fp8_tiles_time_smem_h200.json" > "$OUT/fp8_smem.log" 2>&1; echo "fp8 smem rc=$?"
    grep -v Warning "$OUT/fp8_smem.log" | tail -c 4000
    ;;
  key)
    # the open questions of one call (each piece's output lands in $OUT as it goes). Forty-fourth session: the warp
    # fill's copy forms were decided (copy_spread, on an H100; its native tests run here too); left for an H200: mlp
    # at 64 / 128 rows, the default (144-wide tiles since the forty-third session, measured on an H100 only) against
    # 192; then the native top-k tests unless KEY_TESTS=0
    timeout -k 10 -s INT ${KEY_COPY_TESTS_TIMEOUT:-120} python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider \
      tests/test_kernel_topk_select.py -k "copy_forms or warp_fill" > "$OUT/key_copy_tests.log" 2>&1
    echo "key copy tests rc=$?"; tail -3 "$OUT/key_copy_tests.log"
    # (KEY_FP8_CASES / KEY_FP8_VARIANTS widen it, e.g. wo:128 with {"block_n": 112}: a width that does not divide a
    # case's columns is recorded as that row's error)
    timeout -k 10 -s INT ${KEY_FP8_TIMEOUT:-130} python3 scripts/diag/fp8_tiles_time.py \
      --cases ${KEY_FP8_CASES:-mlp:128 mlp:64} --variants "${KEY_FP8_VARIANTS:-[{\}, {\"block_n\": 192\}]}" \
      --rotations 2 --out "$OUT/fp8_tiles_time_wave_h200.json" \
      > "$OUT/key_fp8.log" 2>&1; echo "key fp8 rc=$?"
    grep '^{' "$OUT/key_fp8.log" | python3 -c 'import json, sys; [print(r["case"], r["tiles"], r.get("kernel_us"), r.get("call_span_us"), r.get("kernel_copy_frac"), r.get("max_abs_diff_vs_xla"), r.get("error", "")[:120]) for r in map(json.loads, sys.stdin)]'
    [ "${KEY_TESTS:-1}" = 0 ] || TOPK_TESTS_TIMEOUT=${KEY_TESTS_TIMEOUT:-180} bash "$0" topk-tests
    ;;
  topk-spec)
    # issue 20 (forty-sixth session): the indexer's top-k default is the lengths hint, the zero band at 3 binades
    # and fine splits (sf_warp_sp_len_zb3_fine); the hint itself cost full batches 0.6-0.8 us (the prefilter's
    # sample and first loads wait on the row's length). The native tests of that default first, then the default
    # against exit_at_one (the finish's counting ended once the k-th key's digit holds one key), the same with the
    # bucket's first block held (hold_bucket_head) and speculate_full (a full row's first loads issued before the
    # length arrives), full and with a request of 3000 / 4500 tokens (TS_SHAPES / TS_SHORT / TS_KNOBS change it:
    # sf_warp_sp_zb3_fine is the default without the hint, sf_warp_sp_len_zb3_fine_head the held block alone;
    # about 8 minutes)
    # (serially they ran past 200 s on the H200, fifty-ninth session: pytest-xdist workers; carry .whl/)
    # (TS_TESTS=0 skips the tests: all 83 native top-k tests passed on the H200 in the fifty-ninth session)
    if [ "${TS_TESTS:-1}" != 0 ]; then
    python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist
    timeout -k 10 -s INT ${TS_TESTS_TIMEOUT:-200} python3 -m pytest -m gpu -n ${GPU_WORKERS:-8} -q --tb=short \
      -p no:cacheprovider tests/test_kernel_topk_select.py tests/test_kernel_sparse_indexer.py \
      -k "lengths or zero_band or fine_splits or visible_counts or indexer_topk_splits or chunking or default or exit_at_one" \
      > "$OUT/topk_spec_tests.log" 2>&1
    echo "topk spec tests rc=$?"; tail -3 "$OUT/topk_spec_tests.log"
    fi
    timeout -k 10 ${TS_KNOBS_TIMEOUT:-380} python3 scripts/diag/topk_knobs.py --mixed --short ${TS_SHORT:-3000 4500} \
      --shapes ${TS_SHAPES:-8x131072 32x32768 64x65536} \
      --knobs ${TS_KNOBS:-sf_warp_sp_len_zb3_fine sf_warp_sp_len_zb3_fine_exit sf_warp_sp_len_zb3_fine_head_exit sf_warp_sp_len_zb3_fine_spec} \
      --out "$OUT/topk_knobs_spec_h200.json" > "$OUT/topk_spec_knobs.log" 2>&1
    echo "topk spec knobs rc=$?"; grep '^{' "$OUT/topk_spec_knobs.log" | python3 -c 'import json, sys; [print(r["case"], r.get("profile_busy_us"), r.get("same_set_as_lax"), r.get("error", "")[:120]) for r in map(json.loads, sys.stdin)]'
    ;;
  topk-lengths-select)
    # the whole decode select (paged logits + top-k) at 8 x 128K with a request of 3000 tokens (TL_SELECT_SHORT), the
    # default (the lengths hint, the range top and the zero band, forty-fifth session) against
    # IndexerKernelConfig(topk_lengths=False) (about 90 s a row on a cold process: compiles)
    timeout -k 10 -s INT ${TL_SELECT_TIMEOUT:-400} python3 scripts/diag/topk_mixed.py --shapes 8x131072 \
      --short ${TL_SELECT_SHORT:-3000} \
      --variants default no_lengths --out "$OUT/topk_mixed_lengths_h200.json" > "$OUT/topk_lengths_select.log" 2>&1
    echo "topk lengths select rc=$?"; grep '^{' "$OUT/topk_lengths_select.log" | cut -c1-300
    ;;
  fp8-ragged)
    # issue 19 (forty-first session): mlp / wo at 64-128 rows ran 96 / 112 CTAs on 132 SMs (192- / 128-wide tiles);
    # tiles of 144 (mlp: 128 tiles) and 112 or 224 (wo: 64 / 32 tiles, split-K 2 / 4) columns start inside
    # weight-scale blocks and scale each column: the native tests, then whole-call and kernel µs on the GPU timeline,
    # cold weights (a variant whose width does not divide a case's columns is recorded as its error)
    timeout -k 10 -s INT ${FP8R_TESTS_TIMEOUT:-180} python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider \
      tests/test_kernel_fp8_gemm.py -k "ragged or exact_data or 192 or matches_xla" > "$OUT/fp8_ragged_tests.log" 2>&1
    echo "fp8 ragged tests rc=$?"; tail -3 "$OUT/fp8_ragged_tests.log"
    V=${FP8R_VARIANTS:-'[{}, {"block_n": 144}, {"block_n": 112}, {"block_n": 224}]'}
    timeout -k 10 -s INT ${FP8R_TIMEOUT:-360} python3 scripts/diag/fp8_tiles_time.py \
      --cases ${FP8_CASES:-mlp:128 wo:128 mlp:64 wo:64} \
      --variants "$V" --rotations 2 \
      --out "$OUT/fp8_tiles_time_ragged_h200.json" > "$OUT/fp8_ragged.log" 2>&1; echo "fp8 ragged rc=$?"
    grep -v Warning "$OUT/fp8_ragged.log" | tail -c 4000
    ;;
  fp8-swap)
    # issue 19 (twenty-seventh session): swap_ab, the weight tile as the wgmma's A and x's round_up(M, 8) rows as its N,
    # against the default (a padded 64-row x tile: the regions put q_b's steps as long as the ring's arrival interval)
    timeout -k 10 -s INT ${FP8S_TIMEOUT:-150} python3 -m pytest -m gpu -q -x --tb=short -p no:cacheprovider \
      tests/test_kernel_fp8_gemm.py -k "${FP8S_K:-swap or exact_data}" > "$OUT/fp8_swap_tests.log" 2>&1
    echo "fp8 swap tests rc=$?"; tail -3 "$OUT/fp8_swap_tests.log"
    V=${FP8SWEEP_VARIANTS:-'[{}, {"swap_ab": true}, {"swap_ab": true, "stages": 6}, {"swap_ab": true, "stages": 8}]'}
    SWEEP_CASES=${FP8_CASES:-'q_b:1 q_b:8 q_b:64 q_b:128 mlp:1 mlp:64 mlp:128 wo:1 wo:64'} ncu_sweep fp8 "$V"
    ;;
  fused-layout)
    # issues 22 / 19 (twenty-fourth session, built untested): layout "fused", the grouped GEMMs' layout kernel
    # also copying x's rows and scales into the padded layout (two XLA gathers fewer per call); native tests, then
    # the FP4 call per GEMM on the timeline with cold weights, then the FP8 grouped call's kernels under ncu
    timeout -k 5 ${FUSEDT_TIMEOUT:-150} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernel_grouped_rows.py \
      tests/test_kernel_fp4_grouped_gemm.py tests/test_kernel_fp8_grouped_gemm.py -k "fused or weight_sets" \
      > "$OUT/fused_tests.log" 2>&1
    echo "fused layout tests rc=$?"; tail -3 "$OUT/fused_tests.log"
    # the FP4 call per GEMM, cold weights: the fused layout, w1 + w3 as one call ("sets": 2, against twice the
    # default's time), and the 4-deep rings (split 2; 256-column steps) against the default's 2-deep one
    timeout -k 10 ${FUSEDTIME_TIMEOUT:-240} python3 scripts/diag/fp4_tiles_time.py --cases w1:1 w1:8 w2:8 \
      --variants '[{}, {"layout": "fused"}, {"sets": 2}, {"sets": 2, "layout": "fused"}, {"split_k": 2}, {"block_k": 256}]' \
      --rotations 4 --out "$OUT/fp4_tiles_time_fused_h200.json" > "$OUT/fused_time.log" 2>&1
    echo "fp4 fused timing rc=$?"
    FP8GSWEEP_VARIANTS='[{}, {"layout": "fused"}]' SWEEP_CASES=${SWEEP_CASES:-'w1:1 w1:8 w2:8'} bash "$0" ncu-fp8gsweep
    ;;
  mosaic-ptx)
    # the PTX (and ptxas -v) of every Mosaic GPU kernel the command compiles, copied to $OUT/mosaic_ptx (the dump
    # directory also gets a large MLIR pass log, left behind); read it here with scripts/diag/mosaic_sass.py
    D=$(mktemp -d); mkdir -p "$OUT/mosaic_ptx"
    CMD=${MOSAIC_PTX_CMD:-"python3 scripts/diag/fp4_tiles_time.py --cases w2:1 --variants '[{}]' --rotations 1"}
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$D" eval timeout -k 10 ${MPTX_TIMEOUT:-150} "$CMD" \
      > "$OUT/mosaic_ptx.log" 2>&1; echo "mosaic-ptx rc=$?"
    cp "$D"/*.ptx "$D"/*.ptxas "$OUT/mosaic_ptx/" 2>/dev/null; ls "$OUT/mosaic_ptx"
    ;;
  fp4-regions)
    # issue 22 (twenty-fourth session, built untested): the FP4 kernel's named regions per warpgroup (Mosaic GPU's
    # profiler): do the compute warpgroups work or wait at 1 token, and what does a unit boundary cost
    timeout -k 10 ${FP4REG_TIMEOUT:-200} python3 scripts/diag/fp4_regions.py --cases ${FP4REG_CASES:-w1:1 w1:8} \
      --variants ${FP4REG_VARIANTS:-'[{}, {"split_k": 2}, {"split_k": 8}]'} --out "$OUT/fp4_regions_h200.json" \
      > "$OUT/fp4_regions.log" 2>&1; echo "fp4 regions rc=$?"; tail -c 3000 "$OUT/fp4_regions.log"
    ;;
  fp8gap)
    # issue 19: the idle gap between act_quant="kernel"'s two Mosaic kernels in a waited call (5-8 µs, seventh
    # session): there too when 8 calls run from one executable (one command buffer)?
    timeout -k 10 ${FP8GAP_TIMEOUT:-200} python3 scripts/diag/fp8_call_gap.py --out "$OUT/fp8_call_gap_h200.json" \
      > "$OUT/fp8_call_gap.log" 2>&1; echo "fp8gap rc=$?"; tail -8 "$OUT/fp8_call_gap.log" | cut -c1-300
    ;;
  ncu-topk)
    # the radix select sits at ~15x one read of its logits at 64 x 64K (BENCHMARKS.md): where its time goes
    # the indexer's config (select_config_for: 2 splits, unroll 2, shrink, 512-key steps, 16-bit pivot) and the
    # split alone
    # NCU_TOPK_SPECS: other TopkSelectConfig specs, separated by ';' (e.g. the range start and the split finish:
    # '{"splits": 2, "unroll": 2, "shrink": true, "hist_block": 512, "pivot_bits": 16, "hold_shrunk": true,
    # "range_margin": 1, "split_finish": true}')
    IFS=';' read -r -a specs <<< "${NCU_TOPK_SPECS:-{\"splits\": 2, \"unroll\": 2, \"shrink\": true, \"hist_block\": 512, \"pivot_bits\": 16\};{\"splits\": 2\}}"
    for spec in "${specs[@]}"; do
      name=topk64x64k_$(echo "$spec" | tr -dc 'a-z0-9' | sed 's/splits/s/; s/unroll/u/; s/shrinktrue/_shrink/;
        s/histblock/_h/; s/pivotbits/_p/; s/holdshrunktrue/_hold/; s/rangemargin/_r/; s/splitfinishtrue/_sf/' | cut -c1-80)
      timeout -k 10 ${NCUT_TIMEOUT:-100} ncu --clock-control none --profile-from-start off --set full --import-source yes -f \
        -o "/tmp/$name" python3 scripts/diag/ncu_kernels.py topk --m 64 --cols 65536 --tiles "$spec" > /dev/null 2>&1
      echo "ncu $name rc=$?"
      ncu -i "/tmp/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
      ncu -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_sass.csv" 2>&1
    done
    ;;
  ncu-fp4t1)
    # issue 22: the FP4 grouped GEMM at 1 token (13.0 µs, 43% of DRAM peak; twenty-second session: 42% of stall
    # cycles on the long scoreboard, global loads using 4 of 32 bytes per sector): which instructions of which
    # warpgroup wait (SASS source page, per-region stall samples)
    timeout -k 10 ${NCUF_TIMEOUT:-150} ncu --clock-control none --profile-from-start off --set full --import-source yes -f \
      -o /tmp/fp4_w1_t1 python3 scripts/diag/ncu_kernels.py fp4 --shape w1 --tokens 1 --tiles '{"x_fp8": true}' \
      > /dev/null 2>&1; echo "ncu fp4 t1 rc=$?"
    ncu -i /tmp/fp4_w1_t1.ncu-rep --page details > "$OUT/fp4_w1_t1_details.txt" 2>&1
    ncu -i /tmp/fp4_w1_t1.ncu-rep --page source --csv --print-source sass > "$OUT/fp4_w1_t1_sass.csv" 2>&1 \
      && python3 scripts/diag/ncu_sass_regions.py "$OUT/fp4_w1_t1_sass.csv" --top 25 > "$OUT/fp4_w1_t1_regions.txt" 2>&1
    tail -40 "$OUT/fp4_w1_t1_regions.txt"
    ;;
  ncu-mqa)
    # stall reasons, pipe and memory utilisation of the sparse MQA (twelfth session: 259 TFLOP/s at V3.2 decode
    # batch 64, target 300; V4 batch 64 at 20% of its roofline, target 50%)
    for arch in ${NCUM_ARCHES:-v32 v4}; do
      name=mqa_${arch}_b64
      timeout -k 10 ${NCUM_TIMEOUT:-150} ncu --clock-control none --profile-from-start off --set full --import-source yes -f \
        -o "/tmp/$name" python3 scripts/diag/ncu_kernels.py mqa --shape "$arch" --m 64 --tiles '{}' > /dev/null 2>&1
      echo "ncu $name rc=$?"
      ncu -i "/tmp/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
      ncu -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_sass.csv" 2>&1 \
        && python3 scripts/diag/ncu_sass_regions.py "$OUT/${name}_sass.csv" --top 15 > "$OUT/${name}_regions.txt" 2>&1
    done
    ;;
  mqa-variants)
    # the sparse MQA's native tests, then its switch sets (scripts/diag/mqa_variants.py VARIANTS; MQAV_VARIANTS, e.g.
    # "default splits1 splits4": V4 batch 64 runs 2 splits and merges them in XLA) on the GPU timeline, then ncu of
    # the default at V3.2 b64 (MQA_NCU=0 skips it)
    python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist
    timeout -k 10 -s INT ${MQA_TESTS_TIMEOUT:-200} python3 -m pytest -m gpu -n 4 -q --tb=short -rfE -p no:cacheprovider \
      tests/test_kernel_sparse_mqa.py > "$OUT/gpu_mqa_tests.log" 2>&1; echo "mqa tests rc=$?"; tail -3 "$OUT/gpu_mqa_tests.log"
    timeout -k 10 ${MQAV_TIMEOUT:-240} python3 scripts/diag/mqa_variants.py --cases ${MQAV_CASES:-v32_decode_64 v4_decode_64} \
      ${MQAV_VARIANTS:+--variants $MQAV_VARIANTS} --out "$OUT/mqa_variants_h200.json" > "$OUT/mqa_variants.log" 2>&1; echo "mqa variants rc=$?"
    grep '^{' "$OUT/mqa_variants.log" | python3 -c 'import json, sys; [print(r["case"], r["variant"], r.get("profile_span_us"), r.get("tflops"), r.get("max_abs_err"), r.get("error", "")[:200]) for r in map(json.loads, sys.stdin)]'
    [ "${MQA_NCU:-1}" = 1 ] || continue  # MQA_NCU=0: tests and variants only
    timeout -k 10 ${NCUM_TIMEOUT:-120} ncu --clock-control none --profile-from-start off --set full --import-source yes -f \
      -o /tmp/mqa_v32_b64 python3 scripts/diag/ncu_kernels.py mqa --shape v32 --m 64 > /dev/null 2>&1; echo "ncu mqa rc=$?"
    ncu -i /tmp/mqa_v32_b64.ncu-rep --page details > "$OUT/mqa_v32_b64_details.txt" 2>&1
    ncu -i /tmp/mqa_v32_b64.ncu-rep --page source --csv --print-source sass > "$OUT/mqa_v32_b64_sass.csv" 2>&1
    ;;
  mqa-loops)
    # the register producer (one software-pipelined loop): each test group and each variant runs in its own
    # process, killed if it hangs, so that one hang hides nothing else
    [ "${MQAL_TESTS:-1}" = 1 ] && for k in "bit_exact" "v32_register_producer or v32_fp8" "v4_register or v4_window"; do
      timeout -k 10 -s KILL ${MQAL_TEST_TIMEOUT:-90} python3 -m pytest -m gpu -q --tb=short -rfE -p no:cacheprovider \
        tests/test_kernel_sparse_mqa.py tests/test_kernel_record_gather.py -k "$k" >> "$OUT/gpu_mqa_loop_tests.log" 2>&1
      echo "mqa loop tests [$k] rc=$?"; tail -1 "$OUT/gpu_mqa_loop_tests.log"
    done
    for v in ${MQAL_VARIANTS:-default tma registers_p1r136 registers_p1r152}; do
      timeout -k 10 -s KILL ${MQAL_TIMEOUT:-100} python3 scripts/diag/mqa_variants.py \
        --cases ${MQAL_CASES:-v32_decode_64 v32_decode_128 v32_prefill_4096} --variants $v \
        --out "$OUT/mqa_variants_loops_${v}_h200.json" >> "$OUT/mqa_variants_loops.log" 2>&1; echo "mqa variant $v rc=$?"
    done
    grep '^{' "$OUT/mqa_variants_loops.log" | python3 -c 'import json, sys; [print(r["case"], r["variant"], r.get("profile_span_us"), r.get("tflops"), r.get("max_abs_err"), r.get("error", "")[:200]) for r in map(json.loads, sys.stdin)]'
    [ "${MQAL_NCU:-0}" = 1 ] || continue  # MQAL_NCU=1: ncu of the loop producer too (about 2.5 more minutes)
    timeout -k 10 -s KILL ${NCUM_TIMEOUT:-150} ncu --clock-control none --profile-from-start off --set full --import-source yes -f \
      -o /tmp/mqa_loop python3 scripts/diag/ncu_kernels.py mqa --shape v32 --m 64 \
      --tiles "${MQAL_NCU_TILES:-{\}}" > /dev/null 2>&1; echo "ncu mqa loop rc=$?"
    ncu -i /tmp/mqa_loop.ncu-rep --page details > "$OUT/mqa_v32_b64_loop_details.txt" 2>&1
    ncu -i /tmp/mqa_loop.ncu-rep --page source --csv --print-source sass > "$OUT/mqa_v32_b64_loop_sass.csv" 2>&1
    python3 scripts/diag/ncu_sass_regions.py "$OUT/mqa_v32_b64_loop_sass.csv" --top 15 | tee "$OUT/mqa_v32_b64_loop_regions.txt" | head -60
    ;;
  mqa-one)
    # issue 20: scores="one" (warpgroup 0 scoring all of a block's candidates and running the softmax alone; the
    # default since 2026-12-07, timed on an H100) against "split" (the default before) on this card: the native
    # tests of the split form beside the producers' and the cluster merge's, then each form (one CUDA graph a
    # call), V4 decode 64 in both output dtypes, V3.2 decode 64, both 4K prefills (v32_fp8: the TMA path's proxy
    # fence natively)
    python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist
    timeout -k 10 -s INT ${MQA1_TEST_TIMEOUT:-150} python3 -m pytest -m gpu -n ${GPU_WORKERS:-8} -q --tb=short -rfE \
      -p no:cacheprovider tests/test_kernel_sparse_mqa.py -k "${MQA1_K:-scores_split or window_compressed or register_producer or cluster_merge or v32_fp8}" \
      > "$OUT/gpu_mqa_one_tests.log" 2>&1
    echo "mqa one tests rc=$?"; grep -E "FAILED|ERROR" "$OUT/gpu_mqa_one_tests.log" | head; tail -1 "$OUT/gpu_mqa_one_tests.log"
    timeout -k 10 -s KILL ${MQA1_TIMEOUT:-150} python3 scripts/diag/mqa_variants.py --cases v4_decode_64 \
      --variants default scores_split bf16_out bf16_out_scores_split --out "$OUT/mqa_variants_scores_one_h200.json" \
      > "$OUT/mqa_one.log" 2>&1; echo "mqa one v4 rc=$?"
    if [ "${MQA1_MORE:-1}" = 1 ]; then  # MQA1_MORE=0: V4 decode 64 alone
    timeout -k 10 -s KILL ${MQA1_MORE_TIMEOUT:-180} python3 scripts/diag/mqa_variants.py --cases v32_decode_64 \
      v4_prefill_4096 v32_prefill_4096 --variants default scores_split --out "$OUT/mqa_variants_scores_one_more_h200.json" \
      >> "$OUT/mqa_one.log" 2>&1; echo "mqa one more rc=$?"
    fi
    grep '^{' "$OUT/mqa_one.log" | python3 -c 'import json, sys; [print(r["case"], r["variant"], r.get("profile_span_us"), r.get("profile_busy_us"), r.get("tflops"), r.get("max_abs_err"), r.get("error", "")[:200]) for r in map(json.loads, sys.stdin)]'
    ;;
  mqa-refresh)
    # the MQA's defaults (2026-12-06: the 2-CTA cluster merge of two splits, the extents in the MQA kernel, the
    # pair's q multicast, V3.2's overlapped producer loads): every native MQA / record-gather test (8 pytest-xdist
    # workers: about 75 s, 2026-12-03), then the defaults (each call one CUDA graph: timing.CAPTURED_OPTIONS)
    # beside the forms before them on this card (V3.2's producer `v32_p1_r144`, the extents kernel
    # `extents_pallas`), the keys unscaled in the K tile (`no_k_pre`, the default before 2026-12-06) and the
    # records prefetched two blocks ahead (`pf2`, off: built 2026-12-06, unrun), V4's splits and output dtypes
    # (to share a call: MQAR_SPLITS=0 leaves those out, an empty MQAR_VARIANTS= the forms beside the defaults)
    python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist
    timeout -k 10 -s INT ${MQAR_TEST_TIMEOUT:-150} python3 -m pytest -m gpu -n ${GPU_WORKERS:-8} -q --tb=short -rfE \
      -p no:cacheprovider tests/test_kernel_sparse_mqa.py tests/test_kernel_record_gather.py > "$OUT/gpu_mqa_tests.log" 2>&1
    echo "mqa tests rc=$?"; grep -E "FAILED|ERROR" "$OUT/gpu_mqa_tests.log" | head; tail -1 "$OUT/gpu_mqa_tests.log"
    timeout -k 10 -s KILL ${MQAR_TIMEOUT:-240} python3 scripts/diag/mqa_variants.py --cases v32_decode_64 v32_decode_128 \
      v32_prefill_4096 v32u_decode_64 v4_decode_64 v4_prefill_4096 --variants default ${MQAR_VARIANTS-v32_p1_r144 extents_pallas no_k_pre pf2} \
      --out "$OUT/mqa_variants_default_h200.json" > "$OUT/mqa_refresh.log" 2>&1; echo "mqa default rc=$?"
    if [ "${MQAR_SPLITS:-1}" = 1 ]; then
      timeout -k 10 -s KILL ${MQAR_TIMEOUT:-180} python3 scripts/diag/mqa_variants.py --cases v4_decode_64 \
        --variants splits1 bf16_out bf16_out_splits1 splits4 --out "$OUT/mqa_variants_v4_splits_h200.json" \
        >> "$OUT/mqa_refresh.log" 2>&1; echo "mqa v4 splits rc=$?"
    fi
    grep '^{' "$OUT/mqa_refresh.log" | python3 -c 'import json, sys; [print(r["case"], r["variant"], r.get("profile_span_us"), r.get("profile_busy_us"), r.get("profile_kernels"), r.get("tflops"), r.get("max_abs_err"), r.get("error", "")[:200]) for r in map(json.loads, sys.stdin)]'
    ;;
  h200-only)
    # a guard between stages: the stages after it run only on an H200 (those whose numbers count only there), so one
    # call that finds an H100 still does the card-independent stages before it (starts are the scarce part)
    nvidia-smi -L 2>/dev/null | grep -q H200 || { echo "h200-only: not an H200, the later stages skipped"; break; }
    ;;
  mqa-probe)
    # where the MQA's per-CTA time goes: the fixed / per-block fit (both archs), then the in-kernel regions of V4
    timeout -k 10 -s KILL ${MQAR_FIT_TIMEOUT:-150} python3 scripts/diag/mqa_fixed_cost.py --out "$OUT/mqa_fixed_cost_h200.json" \
      > "$OUT/mqa_fixed_cost.log" 2>&1; echo "mqa fixed cost rc=$?"; grep -v '^{' "$OUT/mqa_fixed_cost.log" | tail -3
    # where V4's per-CTA time goes: Mosaic GPU's in-kernel profiler over the kernel's named regions
    timeout -k 10 -s KILL ${MQAR_REGIONS_TIMEOUT:-120} python3 scripts/diag/mqa_regions.py --cases v4_decode_64 --splits 2 1 \
      --out "$OUT/mqa_regions_h200.json" > "$OUT/mqa_regions.log" 2>&1; echo "mqa regions rc=$?"; tail -c 1500 "$OUT/mqa_regions.log"
    ;;
  mqa-rows)
    # the MQA's wall-clock rows beside XLA (BENCHMARKS' kernels_sparse_mqa), then the 8-layer V3.2 step with them
    timeout -k 10 ${MQAR_KERNELS_TIMEOUT:-270} python3 -m jds.bench.kernels --only sparse_mqa --cases v32_decode_64 \
      v32_decode_128 v32_prefill_4096 v4_decode_64 v4_prefill_4096 --out "$OUT/kernels_sparse_mqa_h200.json" \
      > "$OUT/mqa_rows.log" 2>&1; echo "mqa rows rc=$?"; tail -8 "$OUT/mqa_rows.log"
    timeout -k 10 ${BOUNDARY_TIMEOUT:-270} python3 -m jds.bench.boundary --arch v32 --layers 8 --modes fused \
      --out "$OUT/boundary_v32_fused_h200.json" >> "$OUT/mqa_rows.log" 2>&1; echo "boundary rc=$?"; tail -8 "$OUT/mqa_rows.log"
    ;;
  ncu-fp4sweep)
    # the e4m3-x route ({"x_fp8": true}: x quantised outside the profiled call, as the V4 MoE's); its kernel is
    # persistent (fourteenth session): the "chained" ring (one pipeline per unit, depth dividing a unit's steps)
    # against split_k 2 and 8 (the "flat" ring lost to it on 2026-12-02 and was removed)
    V=${FP4SWEEP_VARIANTS:-'[{"x_fp8": true}, {"x_fp8": true, "split_k": 2}, {"x_fp8": true, "split_k": 8}]'}
    ncu_sweep fp4 "$V"
    ;;
  hostprofile)
    timeout -k 10 ${HP_TIMEOUT:-170} python3 -m jds.bench.host_profile --arch v32 --layers 8 --intermediate 18432 \
      --mode fused --runner-kw '{"segments": 8}' --steps 10 --out "$OUT/host_profile_h200.json" > "$OUT/hp.log" 2>&1
    echo "hostprofile rc=$?"; grep '^{' "$OUT/hp.log" | cut -c1-1200
    ;;
  fp8grouped)
    timeout -k 10 -s INT ${FP8GT_TIMEOUT:-150} python3 -m pytest -m gpu -q -n 6 --tb=short -p no:cacheprovider \
      tests/test_kernel_fp8_grouped_gemm.py > "$OUT/fp8_grouped_tests.log" 2>&1; echo "fp8 grouped tests rc=$?"
    tail -5 "$OUT/fp8_grouped_tests.log"
    timeout -k 10 -s INT ${FP8GB_TIMEOUT:-300} python3 -m jds.bench.kernels_fp8_grouped ${FP8G_ARGS:-} \
      --out "$OUT/kernels_fp8_grouped_h200.json" > "$OUT/fp8_grouped_bench.log" 2>&1
    echo "fp8 grouped bench rc=$?"; tail -8 "$OUT/fp8_grouped_bench.log" | cut -c1-220
    ;;
  fp4gemm)
    timeout -k 10 -s INT ${FP4T_TIMEOUT:-150} python3 -m pytest -m gpu -q -n 6 --tb=short -p no:cacheprovider \
      tests/test_kernel_fp4_grouped_gemm.py > "$OUT/fp4_grouped_tests.log" 2>&1; echo "fp4 tests rc=$?"; tail -5 "$OUT/fp4_grouped_tests.log"
    timeout -k 10 -s INT ${FP4B_TIMEOUT:-250} python3 -m jds.bench.kernels_fp4_grouped ${FP4_ARGS:-} \
      --out "$OUT/kernels_fp4_grouped_h200.json" > "$OUT/fp4_grouped_bench.log" 2>&1
    echo "fp4 bench rc=$?"; tail -12 "$OUT/fp4_grouped_bench.log" | cut -c1-220
    ;;
  probe)
    # one process per variant (update modes pick XLA's allocator at start-up); fused first: one executable
    # 2026-11-29 at 2 layers: graph updates refuted (docs/perf-log.md); next: 8 layers, preparation split out
    timeout -k 10 ${PROBE_TIMEOUT:-570} python3 scripts/probe_graph_updates.py ${PROBE_ARGS:---layers 8 --modes fused --variants base} \
      --out "$OUT/probe_graph_updates.json" > "$OUT/probe_graph_updates.log" 2>&1
    echo "probe rc=$?"; grep '^{' "$OUT/probe_graph_updates.log" | cut -c1-160
    ;;
  boundary|boundary-xla|boundary-v4)
    impl=auto; [ "$stage" = boundary-xla ] && impl=xla   # auto = the Pallas kernels on the GPU
    archs="v32 v4"; [ "$stage" = boundary-v4 ] && archs=v4
    timeout -k 10 ${BOUNDARY_TIMEOUT:-570} python3 scripts/bench_boundary.py --arch $archs --layers 8 --precompile \
      --implementation $impl ${BOUNDARY_ARGS:-} --out "$OUT/${stage}_$impl.json" > "$OUT/${stage}_$impl.log" 2>&1
    echo "$stage rc=$?"; tail -30 "$OUT/${stage}_$impl.log"
    ;;
  serve)
    timeout -k 10 ${SERVE_TIMEOUT:-570} python3 scripts/bench_serve_modes.py --preset v32-bench --num-prompts 200 \
      --num-warmups 10 --parallel-startup --out "$OUT/serve_v32_h200.json" \
      -- --num-blocks 600 --token-buckets 128 2048 --key-block-buckets 4 ${SERVE_ARGS:-} > "$OUT/bench_serve_modes.log" 2>&1
    echo "serve rc=$?"; tail -12 "$OUT/bench_serve_modes.log"
    ;;
  thunks)
    JDS_GPU_OUT="$OUT" timeout -k 10 -s INT ${THUNKS_TIMEOUT:-290} python3 -m pytest -m gpu -v --tb=short \
      -p no:cacheprovider tests/test_gpu_boundary.py > "$OUT/gpu_boundary_test.log" 2>&1
    echo "thunks rc=$?"; tail -3 "$OUT/gpu_boundary_test.log"
    ;;
  fp4-wg4)
    # issue 22 (twenty-third session, built untested): block_n 256 = four compute warpgroups on the e4m3-x route,
    # aimed at the 1-token kernel whose producer waits on two busy compute warpgroups
    timeout -k 10 ${WG4T_TIMEOUT:-150} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernel_fp4_grouped_gemm.py \
      -k "four_warpgroups or fp8_route" > "$OUT/fp4_wg4_tests.log" 2>&1; echo "fp4 wg4 tests rc=$?"
    tail -3 "$OUT/fp4_wg4_tests.log"
    V=${FP4SWEEP_VARIANTS:-'[{"x_fp8": true}, {"x_fp8": true, "block_n": 256}, {"x_fp8": true, "block_n": 256, "split_k": 2}, {"x_fp8": true, "block_n": 256, "block_k": 256}]'}
    SWEEP_CASES=${SWEEP_CASES:-'w1:1 w1:8 w2:8 w1:64'} ncu_sweep fp4 "$V"
    timeout -k 10 60 ncu --profile-from-start off --section LaunchStats --csv python3 scripts/diag/ncu_kernels.py fp4 \
      --shape w1 --tokens 1 --tiles '{"x_fp8": true, "block_n": 256}' 2>/dev/null \
      | grep -i "Registers Per Thread\|Dynamic Shared\|Local" | awk -F'","' '{print $(NF-2), $NF}'
    ;;
  pending)
    # what the twelfth session left unmeasured, in one call (about 9 minutes): the MQA bench rows (pipelined, beside
    # XLA) with the rebuilt kernel, then the decode select (its eleventh-session run was cut)
    bash "$0" mqa
    bash "$0" select
    ;;
  ncu-fp8gsweep)
    # the FP8 grouped expert GEMM's call (its layout kernel is the default natively since the seventh session): the
    # per-CTA kernel against the persistent one (fourteenth session: built, tested in interpret mode only)
    V=${FP8GSWEEP_VARIANTS:-'[{}, {"persistent": true}]'}
    ncu_sweep fp8g "$V"
    ;;
  gather-probe)
    # the MQA plan's register gather (scripts/diag/gather_probe.py): rows equal cache[slots], device µs against
    # XLA's take and the copy bandwidth; then --dequant, V3.2 records into the MQA's swizzled bf16 K tile
    # against XLA's dequantisation, bit for bit (about 2 minutes)
    for mode in gather dequant; do
      flag=; [ $mode = dequant ] && flag=--dequant
      timeout -k 10 ${GATHER_TIMEOUT:-200} python3 scripts/diag/gather_probe.py $flag --out "$OUT/${mode}_probe_h200.json" \
        > "$OUT/${mode}_probe.log" 2>&1; echo "$mode probe rc=$?"; grep '^{' "$OUT/${mode}_probe.log" | cut -c1-400
      tail -3 "$OUT/${mode}_probe.log" | cut -c1-300
    done
    ;;
  first)
    # a session's first call, whichever card comes (runbook item 00). On an H200: the MQA's scores="one" against
    # "split" at V4 decode 64 (issue 20) with its native tests, then the gpu tests the H200 has not run at today's
    # tree (top-k select + ops; the producers, grid rounding and indexer). On an H100, where the H200's targets
    # cannot be measured: the indexer's native tests (the unpadded decode q), then the 8-layer steps' kernels in
    # vt/base (made beforehand: git archive REV jds pallas_kernels | tar -x -C vt/base) against main
    python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist
    if nvidia-smi -L 2>/dev/null | grep -q H200; then
      MQA1_TEST_TIMEOUT=${MQA1_TEST_TIMEOUT:-150} MQA1_TIMEOUT=${MQA1_TIMEOUT:-130} MQA1_MORE=${MQA1_MORE:-0} bash "$0" mqa-one
      timeout -k 10 -s INT ${FIRST_TESTS_TIMEOUT:-200} python3 -m pytest -m gpu -n 12 -q -p no:cacheprovider -rfE \
        tests/test_kernel_topk_select.py tests/test_ops.py tests/test_kernel_norm_quant.py tests/test_kernel_swiglu_quant.py \
        tests/test_grid_rounding.py tests/test_kernel_sparse_indexer.py > "$OUT/gpu_first_tests.log" 2>&1
      echo "first gpu tests rc=$?"; grep -E "FAILED|ERROR" "$OUT/gpu_first_tests.log" | head; tail -1 "$OUT/gpu_first_tests.log"
    else
      timeout -k 10 -s INT ${FIRST_TESTS_TIMEOUT:-150} python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider -rfE \
        tests/test_kernel_sparse_indexer.py > "$OUT/gpu_first_tests.log" 2>&1
      echo "first gpu tests rc=$?"; grep -E "FAILED|ERROR" "$OUT/gpu_first_tests.log" | head; tail -1 "$OUT/gpu_first_tests.log"
      SK_TREES=${SK_TREES:-base main} bash "$0" step-kernels
    fi
    ;;
  tests-all)
    # every gpu-marked test in one run: pytest-xdist workers share the GPU (the suite is compile-bound;
    # no preallocation). The device image has no xdist: carry .whl/ (pip download pytest-xdist execnet). 12 workers
    # on the 16 cores: about 420-450 s (H100, sixty-second session; test_command_buffers_and_direct_launches 322 s)
    python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist
    JDS_GPU_OUT="$OUT" timeout -k 10 -s INT ${TESTS_TIMEOUT:-570} python3 -m pytest -m gpu -n ${GPU_WORKERS:-12} -v --tb=short -rfE \
      -p no:cacheprovider --durations=15 tests > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "FAILED|ERROR" "$OUT/gpu_tests.log" | head -20; tail -20 "$OUT/gpu_tests.log"
    ;;
  kernels)
    # 2026-11-29 these took about 250 s together; device_us (one more compile per row) and the fused-insert
    # tile sweep add to that, so the stage needs a call of its own
    timeout -k 10 ${INDEXER_TIMEOUT:-330} python3 scripts/bench_kernels.py --only sparse_indexer --cases decode topk \
      --out "$OUT/kernels_indexer.json" > "$OUT/bench_indexer.log" 2>&1; echo "indexer rc=$?"
    timeout -k 10 ${FUSED_TIMEOUT:-230} python3 scripts/bench_kernels.py --only fused_insert --out "$OUT/kernels_fused_insert.json" \
      > "$OUT/bench_fused_insert.log" 2>&1; echo "fused_insert rc=$?"
    ;;
  inserts)
    # issue 20: the fused inserts alone (each row also on the GPU timeline, caches threaded) + the T = 8192 tile sweep
    timeout -k 10 ${FUSED_TIMEOUT:-400} python3 -m jds.bench.kernels --only fused_insert --out "$OUT/kernels_fused_insert.json" \
      > "$OUT/bench_fused_insert.log" 2>&1; echo "fused_insert rc=$?"
    grep '^{' "$OUT/bench_fused_insert.log" | python3 -c 'import json, sys; [print(r["kernel"], r["case"], r["impl"], r.get("profile_span_us"), r.get("profile_bandwidth_frac"), r.get("error", "")[:100]) for r in map(json.loads, sys.stdin)]'
    ;;
  insert-regs)
    # issue 20: registers per thread and shared memory per program as the CUDA plugin's Triton compiles them (pip's
    # Triton on the CPU, compile_sm90_report, gave the kv insert's register rope pairs 96 registers; natively 185)
    for v in 'v32_kv_insert {"rope_pairs":"registers"}' 'v32_kv_insert {"rope_pairs":"loads"}' 'v32_fused_q {}'; do
      set -- $v
      timeout -k 10 60 ncu --profile-from-start off --section LaunchStats --csv python3 scripts/diag/ncu_kernels.py insert \
        --shape $1 --m ${INSERT_REGS_T:-8192} --tiles "$2" 2>/dev/null \
        | grep -i "Registers Per Thread\|Dynamic Shared" | awk -F'","' -v v="$v" '{print v": "$(NF-2), $NF}'
    done
    ;;
  q-rows)
    # issue 20 (twenty-fourth session): the fused q at two tokens per program against one (T = 1024: 1024
    # programs are two waves at 4 a SM; 512 are one), beside a same-size copy, GPU timeline (about 2 minutes)
    timeout -k 10 ${QROWS_TIMEOUT:-180} python3 scripts/diag/insert_parts.py --ts 1024 8192 \
      --variants default q_rows256 q_rows256_w8 --out "$OUT/insert_parts_qrows_h200.json" > "$OUT/q_rows.log" 2>&1
    echo "q rows rc=$?"; grep '^{' "$OUT/q_rows.log" | cut -c1-300
    ;;
  q-split)
    # issue 20: the fused q at T = 1024 with its phases split and 8 warps (64 registers on sm_90a, the one form that
    # lets 8 programs share an SM; each change alone lost on the H200), beside the default and a same-size copy
    timeout -k 10 ${QSPLIT_TIMEOUT:-180} python3 scripts/diag/insert_parts.py --ts 1024 \
      --variants default split_w8 --out "$OUT/insert_parts_split_w8_h200.json" > "$OUT/q_split.log" 2>&1
    echo "q split rc=$?"; grep '^{' "$OUT/q_split.log" | python3 -c 'import json, sys; [print(r["kernel"], r["case"][:8], r["variant"], r.get("profile_span_us"), round(r.get("bandwidth_frac") or 0, 3), r.get("error", "")[:200]) for r in map(json.loads, sys.stdin)]'
    ;;
  insert-parts)
    # issue 20: V3.2's inserts with / without their Hadamard beside a same-size copy (GPU timeline), then Nsight
    # Compute (full set) on both V3.2 kernels at T = 8192
    timeout -k 10 -s KILL ${INSP_TIMEOUT:-200} python3 scripts/diag/insert_parts.py --out "$OUT/insert_parts_h200.json" \
      > "$OUT/insert_parts.log" 2>&1; echo "insert parts rc=$?"
    grep '^{' "$OUT/insert_parts.log" | python3 -c 'import json, sys; [print(r["kernel"], r["case"][:8], r["variant"], r.get("profile_span_us"), round(r.get("bandwidth_frac") or 0, 3), r.get("error", "")[:200]) for r in map(json.loads, sys.stdin)]'
    for kern in v32_kv_insert v32_fused_q; do
      timeout -k 10 ${NCUI_TIMEOUT:-120} ncu --clock-control none --profile-from-start off --set full -f -o "/tmp/$kern" \
        python3 scripts/diag/ncu_kernels.py insert --shape $kern --m 8192 > /dev/null 2>&1; echo "ncu $kern rc=$?"
      ncu -i "/tmp/$kern.ncu-rep" --page details > "$OUT/ncu_${kern}_t8192.txt" 2>&1
    done
    ;;
  topk)
    # the Pallas radix-select kernel: its native tests first (4 workers: one process did not finish them in 240 s,
    # thirty-seventh session), then the top-k rows (lax / Pallas: sorted, set, split, the indexer's config), full
    # and with one short row (_mixed); TOPK_TESTS=0 skips the tests (run by topk-sf in an earlier call), so that the
    # bench's rows fit the call
    if [ "${TOPK_TESTS:-1}" = 1 ]; then bash "$0" topk-tests; fi
    # topk_pallas: without the XLA radix / segment rows, so that all six shapes (64 x 64K: the target) fit (the full
    # topk case was cut at 64 x 32K in 220 s, eighth session); TOPK_CASES=topk for those rows
    timeout -k 10 ${TOPK_TIMEOUT:-420} python3 scripts/bench_kernels.py --only sparse_indexer --cases ${TOPK_CASES:-topk_pallas} \
      --out "$OUT/kernels_topk.json" > "$OUT/bench_topk.log" 2>&1; echo "topk bench rc=$?"
    ;;
  topk-range)
    # the indexer's config against the finish's counting from the pivot (range_margin), packed counts (_pk), the split
    # finish (_sf) and the prefilter's loads in flight (2x programs, prefetch), four full shapes, GPU timeline (about
    # 7 minutes); then the
    # winners with --mixed (TOPK_RANGE_KNOBS, TOPK_RANGE_ARGS=--mixed). TOPK_MAIN=DIR (a copy of main's tree): main's
    # indexer config first, from there (the branch's kernels store with plain indices, so its h512_p16_hold differs)
    if [ -n "${TOPK_MAIN:-}" ]; then
      (cd "$TOPK_MAIN" && PYTHONPATH=. timeout -k 10 120 python3 scripts/diag/topk_knobs.py ${TOPK_RANGE_ARGS:-} \
        --knobs h512_p16_hold --out "$OUT/topk_knobs_range_main_h200.json" > "$OUT/topk_range_main.log" 2>&1)
      echo "topk main rc=$?"; grep '^{' "$OUT/topk_range_main.log" | python3 -c 'import json, sys; [print("main", r["case"], r.get("profile_span_us"), r.get("same_set_as_lax"), r.get("error", "")[:120]) for r in map(json.loads, sys.stdin)]'
    fi
    timeout -k 10 ${KNOBS_TIMEOUT:-480} python3 scripts/diag/topk_knobs.py ${TOPK_RANGE_ARGS:-} --knobs \
      ${TOPK_RANGE_KNOBS:-h512_p16_hold h512_p16_hold_r1 h512_p16_hold_r1_pk h512_p16_hold_r1_sf h512_p16_hold_r1_pf \
      x2_h512_p16_hold_r1 h512_p16_hold_pk} \
      --out "$OUT/topk_knobs_range_h200.json" > "$OUT/topk_range.log" 2>&1; echo "topk range rc=$?"
    grep '^{' "$OUT/topk_range.log" | python3 -c 'import json, sys; [print(r["case"], r.get("profile_span_us"), r.get("same_set_as_lax"), r.get("profile_kernel_us"), r.get("error", "")[:120]) for r in map(json.loads, sys.stdin)]'
    ;;
  topk-sf)
    # issue 20: the split finish (a 1024-key bucket, three first-pass resolutions, rows whose pivot is tau skipping
    # the counting; IndexerKernelConfig.topk_split_finish) and the kernel's -1 for invisible keys (no gather after it;
    # topk_invisible_in_kernel) against the indexer's config: the native tests, then the four sets at the four main
    # shapes, then the split finish at six more, full and with one short row, GPU timeline with per-kernel µs
    bash "$0" topk-tests
    timeout -k 10 ${KNOBS_TIMEOUT:-190} python3 scripts/diag/topk_knobs.py --mixed --shapes 64x65536 16x131072 \
      16x32768 64x131072 --knobs h512_p16_hold_r1_pf h512_p16_hold_r1_pf_inv h512_p16_hold_r1_pf_sf_b2r3 \
      h512_p16_hold_r1_pf_sf_b2r3_inv --out "$OUT/topk_knobs_sf_h200.json" > "$OUT/topk_sf.log" 2>&1
    echo "topk sf rc=$?"
    timeout -k 10 ${KNOBS2_TIMEOUT:-120} python3 scripts/diag/topk_knobs.py --mixed --shapes 8x65536 32x65536 \
      8x131072 32x131072 32x32768 64x32768 --knobs h512_p16_hold_r1_pf h512_p16_hold_r1_pf_sf_b2r3 \
      --out "$OUT/topk_knobs_sf_more_h200.json" >> "$OUT/topk_sf.log" 2>&1; echo "topk sf more rc=$?"
    grep '^{' "$OUT/topk_sf.log" | python3 -c 'import json, sys; [print(r["case"], r.get("profile_span_us"), r.get("profile_busy_us"), r.get("same_set_as_lax"), r.get("profile_kernel_us"), r.get("error", "")[:120]) for r in map(json.loads, sys.stdin)]'
    ;;
  topk-shapes)
    # issue 20: the indexer's default (the split finish and the warp fill, fortieth session: sf_warp) against the split
    # finish with the CTA-wide fill at the shapes no call has reached, full and mixed
    timeout -k 10 ${KNOBS_TIMEOUT:-300} python3 scripts/diag/topk_knobs.py --mixed --shapes 64x32768 32x32768 \
      8x131072 32x131072 --knobs ${SHAPES_KNOBS:-h512_p16_hold_r1_pf_sf_b2r3 sf_warp} \
      --out "$OUT/topk_knobs_shapes_h200.json" > "$OUT/topk_shapes.log" 2>&1; echo "topk shapes rc=$?"
    grep '^{' "$OUT/topk_shapes.log" | python3 -c 'import json, sys; [print(r["case"], r.get("profile_span_us"), r.get("same_set_as_lax"), r.get("error", "")[:120]) for r in map(json.loads, sys.stdin)]'
    ;;
  topk-prefilter)
    # issue 20: the prefilter (28 of 48 µs at 64 x 64K) with 16 warps a program and / or packed sample counts, on the
    # indexer's default (the split finish), four shapes, full and mixed; the top-k tests first unless TOPK_TESTS=0
    [ "${TOPK_TESTS:-1}" = 0 ] || bash "$0" topk-tests
    # PREFILTER_KNOBS: the sets (the fortieth session's: each warp its own part of the split, no barrier in the
    # loop; the thirty-ninth's: the prefilter's loop without layout conversions, the finish's lane loads, the bucket
    # held and no bucket kernel, two prefilter programs an SM; sf_warp_x2, sf_warp_fuse_pk, sf_fuse, sf_group_w16,
    # sf_group_fuse_pk, sf_lane_fuse, sf_w16, sf_lane, sf_lane_fin, sf_lane_w16, sf_group_fin, sf_hold, sf_pk,
    # sf_pk_w16, sf_m0r2 on request). Shapes run in turn, every set at each: a cut run keeps the first shapes (TOPK_TESTS=0
    # KNOBS_TIMEOUT=540 in a call of its own for all)
    timeout -k 10 ${KNOBS_TIMEOUT:-280} python3 scripts/diag/topk_knobs.py --mixed --shapes 64x65536 16x131072 \
      16x32768 64x131072 --knobs ${PREFILTER_KNOBS:-h512_p16_hold_r1_pf_sf_b2r3 sf_warp sf_warp_w16 sf_warp_pk \
      sf_warp_fuse sf_group_fuse sf_group sf_group_w16_x2} \
      --out "$OUT/topk_knobs_prefilter_h200.json" > "$OUT/topk_prefilter.log" 2>&1; echo "topk prefilter rc=$?"
    grep '^{' "$OUT/topk_prefilter.log" | python3 -c 'import json, sys; [print(r["case"], r.get("profile_span_us"), r.get("same_set_as_lax"), r.get("profile_kernel_us"), r.get("error", "")[:120]) for r in map(json.loads, sys.stdin)]'
    ;;
  topk-select)
    # issue 20: the indexer's decode select (paged logits + top-k, as the layers call it) per top-k choice, the split
    # finish beside the split config, at 16 / 64 rows x 32K / 128K, full and mixed (kernels_select rows)
    # SELECT_CASES=select_split: only the default's and the split configs' rows (the whole case ran past 540 s)
    timeout -k 10 ${SELECT_TIMEOUT:-480} python3 -m jds.bench.kernels --only sparse_indexer --cases ${SELECT_CASES:-select} \
      --out "$OUT/kernels_select_h200.json" > "$OUT/select.log" 2>&1; echo "select rc=$?"; tail -5 "$OUT/select.log" | cut -c1-200
    ;;
  topk-tests)
    # the native top-k and sparse-indexer tests, GPU_WORKERS pytest-xdist workers (default 8: with 4, 44 of them
    # filled a 150 s limit on an H100, forty-first session; carry .whl/ for xdist)
    python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist
    timeout -k 10 -s INT ${TOPK_TESTS_TIMEOUT:-270} python3 -m pytest -m gpu -n ${GPU_WORKERS:-8} -q --tb=short -rfE -p no:cacheprovider \
      tests/test_kernel_topk_select.py tests/test_kernel_sparse_indexer.py > "$OUT/gpu_topk_tests.log" 2>&1
    echo "topk tests rc=$?"; tail -3 "$OUT/gpu_topk_tests.log"
    ;;
  topk-knobs)
    # the top-k's native tests, then the default split set select against knob sets (unroll, 2-bit digits, shrink,
    # 4096-key blocks, and combinations) at four shapes (scripts/diag/topk_knobs.py): which knob becomes the default
    bash "$0" topk-tests
    timeout -k 10 ${KNOBS_TIMEOUT:-240} python3 scripts/diag/topk_knobs.py ${KNOBS_ARGS:-} --out "$OUT/topk_knobs_h200.json" \
      > "$OUT/topk_knobs.log" 2>&1; echo "topk knobs rc=$?"; cut -c1-160 "$OUT/topk_knobs.log" | grep -v Warn
    ;;
  topk-pivot)
    # the indexer's config (16-bit pivot, held shrunk block) against a 12- and an 8-bit pivot, GPU timeline, four
    # shapes (about 3 minutes); a winner everywhere goes into select_config_for, then topk-tests
    timeout -k 10 ${KNOBS_TIMEOUT:-300} python3 scripts/diag/topk_knobs.py --knobs h512_p16_hold h512_p12_hold h512_p8_hold \
      --out "$OUT/topk_knobs_pivot12_h200.json" > "$OUT/topk_knobs_pivot12.log" 2>&1; echo "topk pivot rc=$?"
    grep '^{' "$OUT/topk_knobs_pivot12.log" | python3 -c 'import json, sys; [print(r["case"], r.get("profile_span_us"), r.get("same_set_as_lax"), r.get("error", "")[:120]) for r in map(json.loads, sys.stdin)]'
    ;;
  select)
    # the indexer decode select: top-k "auto" (the default since the eighth session) against lax, full and mixed-length batches
    timeout -k 10 ${SELECT_TIMEOUT:-330} python3 scripts/bench_kernels.py --only sparse_indexer --cases select \
      --out "$OUT/kernels_select.json" > "$OUT/bench_select.log" 2>&1; echo "select rc=$?"
    ;;
  mqa)
    timeout -k 10 ${MQA_TIMEOUT:-200} python3 scripts/bench_kernels.py --only sparse_mqa \
      --cases v32_decode_1 v4_decode_1 v32_decode_8 v4_decode_8 v32_decode_64 v4_decode_64 \
      --out "$OUT/kernels_mqa.json" > "$OUT/bench_mqa.log" 2>&1; echo "mqa rc=$?"; tail -6 "$OUT/bench_mqa.log"
    ;;
  multigpu)
    # issue 21 on the nvidia-h200-x2 kind: the same 8-layer V3.2 stack on one GPU and tensor-parallel over two
    # (jds/sharding.py). TTFT of a 128-token prompt (fused, host and device prep), then decode at b1 / b64
    # (bench_boundary --quick, fused). MULTIGPU_ARGS adds flags to every run (e.g. --implementation xla if the
    # Pallas kernels do not partition).
    ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    [ "$ngpu" -ge 2 ] || { echo "multigpu: needs 2 GPUs, found $ngpu"; continue; }
    for tp in 1 2; do
      timeout -k 10 ${MULTIGPU_TTFT_TIMEOUT:-130} python3 -m jds.bench.ttft --arch v32 --layers 8 --intermediate 18432 \
        --tensor-parallel $tp --n 30 --variants fused:host fused:device ${MULTIGPU_ARGS:-} \
        --out "$OUT/ttft_v32_tp$tp.json" > "$OUT/ttft_v32_tp$tp.log" 2>&1
      echo "ttft tp=$tp rc=$?"; grep '^{' "$OUT/ttft_v32_tp$tp.log" | cut -c1-250; tail -3 "$OUT/ttft_v32_tp$tp.log"
    done
    for tp in 1 2; do
      timeout -k 10 ${MULTIGPU_DECODE_TIMEOUT:-150} python3 -m jds.bench.boundary --arch v32 --layers 8 --quick \
        --modes fused --tensor-parallel $tp ${MULTIGPU_ARGS:-} --out "$OUT/decode_v32_tp$tp.json" \
        > "$OUT/decode_v32_tp$tp.log" 2>&1
      echo "decode tp=$tp rc=$?"; grep '^{' "$OUT/decode_v32_tp$tp.log" | cut -c1-400; tail -3 "$OUT/decode_v32_tp$tp.log"
    done
    ;;
  *)
    echo "usage: $0 STAGE... (ncu|hostprofile|deep-seg|fp4gemm|fp8gemm|fp8grouped|probe|boundary|boundary-v4|boundary-xla|serve|thunks|tests-all|kernels|topk|select|mqa|multigpu)" >&2
    exit 2 ;;
esac
done
