#!/usr/bin/env bash
# The H200 runbook, one stage per device call (each fits the 10-minute call limit; outputs land in $OUT,
# written as they are produced so a cut-short stage keeps what it measured):
#
#   scripts/gpu_session.sh tests      # native kernel tests not yet passed on the H200 + thunk-dump check
#   scripts/gpu_session.sh tests-all  # every gpu-marked kernel test
#   scripts/gpu_session.sh kernels    # kernel benchmarks (pipelined timing) incl. radix top-k rows
#   scripts/gpu_session.sh boundary   # bench_boundary, V3.2 + V4, compiled in parallel processes first
#                                     # (boundary-xla: the same with the pure-JAX attention stages)
#   scripts/gpu_session.sh serve      # bench_serve_modes: the server in each mode, c=1 and c=64
#   scripts/gpu_session.sh probe      # host launch cost of a captured step vs input-buffer addresses
#
# Each stage gives every step its own timeout with SIGINT, so pytest still prints its summary.
set -u
OUT=${OUT:-/tmp/jds_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
nvidia-smi -L > "$OUT/device.txt" 2>&1 || true

[ $# -ge 1 ] || set -- usage
for stage in "$@"; do
case "$stage" in
  tests)  # what has not passed on the H200 yet (2026-11-29), then the thunk-dump boundary check; the two
          # pytest runs compile in parallel (no timings here), so neither may preallocate the GPU
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    timeout -s INT 290 python3 -m pytest -m gpu -v --tb=short -rfE -p no:cacheprovider \
      tests/test_kernel_sparse_mqa.py tests/test_kernel_sparse_indexer.py \
      -k "p_in_registers or layer_attend or v4_decode_tiny_heads" > "$OUT/gpu_pending_tests.log" 2>&1 &
    pending=$!
    JDS_GPU_OUT="$OUT" timeout -s INT 290 python3 -m pytest -m gpu -v --tb=short -p no:cacheprovider \
      tests/test_gpu_boundary.py > "$OUT/gpu_boundary_test.log" 2>&1
    echo "boundary test rc=$?"; tail -3 "$OUT/gpu_boundary_test.log"
    wait $pending; echo "pending kernel tests rc=$?"; tail -3 "$OUT/gpu_pending_tests.log"
    unset XLA_PYTHON_CLIENT_PREALLOCATE
    ;;
  tests-all)  # every gpu-marked kernel test (about 10 minutes of compiles: may need two calls)
    timeout -s INT 570 python3 -m pytest -m gpu -v --tb=short -rfE -p no:cacheprovider \
      tests/test_kernel_sparse_mqa.py tests/test_kernel_sparse_indexer.py tests/test_kernel_fused_insert.py \
      > "$OUT/gpu_kernel_tests.log" 2>&1
    echo "kernel tests rc=$?"; tail -3 "$OUT/gpu_kernel_tests.log"
    ;;
  mqa)  # the MQA rows not yet measured on the H200: batch 1 and 8, and the 4K prefill
    timeout 200 python3 scripts/bench_kernels.py --only sparse_mqa \
      --cases v32_decode_1 v32_decode_8 v4_decode_1 v4_decode_8 v32_prefill_4096 v4_prefill_4096 \
      --out "$OUT/kernels_mqa.json" > "$OUT/bench_mqa.log" 2>&1; echo "mqa rc=$?"; tail -12 "$OUT/bench_mqa.log"
    ;;
  kernels)
    timeout 200 python3 scripts/bench_kernels.py --only sparse_indexer --cases decode topk \
      --out "$OUT/kernels_indexer.json" > "$OUT/bench_indexer.log" 2>&1; echo "indexer rc=$?"
    timeout 150 python3 scripts/bench_kernels.py --only fused_insert --out "$OUT/kernels_fused_insert.json" \
      > "$OUT/bench_fused_insert.log" 2>&1; echo "fused_insert rc=$?"
    timeout 200 python3 scripts/bench_kernels.py --only sparse_mqa \
      --cases v32_decode_1 v32_decode_8 v4_decode_1 v4_decode_8 v32_prefill_4096 v4_prefill_4096 \
      --out "$OUT/kernels_mqa.json" > "$OUT/bench_mqa.log" 2>&1; echo "mqa rc=$?"
    ;;
  boundary|boundary-xla)
    impl=auto; [ "$stage" = boundary-xla ] && impl=xla   # auto = the Pallas kernels on the GPU
    timeout ${BOUNDARY_TIMEOUT:-570} python3 scripts/bench_boundary.py --arch v32 v4 --layers 8 --precompile --implementation $impl \
      --out "$OUT/boundary_h200_$impl.json" > "$OUT/bench_boundary_$impl.log" 2>&1; echo "boundary rc=$?"
    tail -30 "$OUT/bench_boundary_$impl.log"
    ;;
  thunks)  # the thunk-dump check alone (captured segments are kCommandBuffer; direct launches per mode)
    JDS_GPU_OUT="$OUT" timeout -s INT ${THUNKS_TIMEOUT:-290} python3 -m pytest -m gpu -v --tb=short -p no:cacheprovider \
      tests/test_gpu_boundary.py > "$OUT/gpu_boundary_test.log" 2>&1
    echo "boundary test rc=$?"; tail -3 "$OUT/gpu_boundary_test.log"
    ;;
  probe)  # does the captured step's launch cost follow input-buffer addresses? (see the script's doc)
    timeout 570 python3 scripts/probe_graph_updates.py --layers 4 --out "$OUT/probe_graph_updates.json" \
      > "$OUT/probe_graph_updates.log" 2>&1; echo "probe rc=$?"; tail -8 "$OUT/probe_graph_updates.log"
    ;;
  serve)
    timeout 570 python3 scripts/bench_serve_modes.py --preset v32-bench --num-prompts 200 --num-warmups 10 \
      --parallel-startup --out "$OUT/serve_v32_h200.json" \
      -- --num-blocks 600 --token-buckets 128 2048 --key-block-buckets 4 > "$OUT/bench_serve_modes.log" 2>&1
    echo "serve rc=$?"; tail -12 "$OUT/bench_serve_modes.log"
    ;;
  *)
    echo "usage: $0 STAGE... (tests|tests-all|kernels|mqa|boundary|boundary-xla|serve|probe)" >&2; exit 2 ;;
esac
done
