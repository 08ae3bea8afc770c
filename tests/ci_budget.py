"""What `make test` (CI) runs of the kernels' GPU interpret mode, within its budget (10 minutes on 2 cores).

Interpret mode simulates every GPU thread of a Pallas kernel on the CPU: a kernel test costs seconds there,
and the kernel files' interpret-mode runs were over a third of the suite's time (2026-12-03). Their native
runs (``gpu``) are what establishes a kernel, on the H200. In CI each kernel keeps the interpret-mode runs listed
here: its default form on exact data (any summation order exact, so equal to the reference bit for bit) or
against its reference, and the forms the model runs by default; ``tests/test_ops.py`` runs every op's kernel
once more in interpret mode against the op's reference. ``tests/conftest.py`` marks every other
interpret-mode run of ``tests/test_kernel_*.py`` ``slow`` (``make test-all`` runs them), so a new kernel test
is out of CI until it is listed here.
"""

from __future__ import annotations

CI_INTERPRET: frozenset[str] = frozenset({
    # FP4 grouped GEMM: the e4m3-x route (V4's experts), its weight sets (gate + up in one call), the bf16-x route
    "test_kernel_fp4_grouped_gemm.py::test_fp8_route_exact_bit_equal[interpret-None-256]",
    "test_kernel_fp4_grouped_gemm.py::test_fp8_route_weight_sets[tiles0-interpret]",
    "test_kernel_fp4_grouped_gemm.py::test_exact_data_bit_equal[interpret-pallas]",
    "test_kernel_fp4_grouped_gemm.py::test_auto_runs_kernel[interpret]",
    # bf16 grouped linear (V4's wo_a): padded rows, leading dims with two warpgroups, two row tiles; exact data
    # the norm that quantises for the FP8 linears: a residual and a column range, both scale formats
    "test_kernel_norm_quant.py::test_matches_float64[5-384-0-None-True-ue8m0-interpret]",
    "test_kernel_norm_quant.py::test_matches_float64[72-640-128-384-False-amax-interpret]",
    "test_kernel_norm_quant.py::test_fp8_linear_takes_quantized_rows[interpret]",
    # the MLP's activation quantised for w2: a part-masked tile, several programs a row, both scale formats
    "test_kernel_swiglu_quant.py::test_matches_float64[5-384-16-ue8m0-interpret]",
    "test_kernel_swiglu_quant.py::test_matches_float64[72-1280-4-amax-interpret]",
    "test_kernel_group_linear.py::test_matches_float64[lead0-2-128-256-tiles0-interpret]",
    "test_kernel_group_linear.py::test_matches_float64[lead1-1-64-128-tiles1-interpret]",
    "test_kernel_group_linear.py::test_matches_float64[lead2-2-32-128-tiles2-interpret]",
    "test_kernel_group_linear.py::test_exact_data_bit_equal[interpret]",
    # top-k with the row in registers: every edge case (a few seconds in all)
    "test_kernel_topk_rows.py::test_same_set_as_lax[1-5-300-128-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[1-4-64-1-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[1-4-64-64-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[1-6-4096-2048-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[1-4-1400-700-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[2-5-300-128-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[2-4-64-1-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[2-4-64-64-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[2-6-4096-2048-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[2-4-1400-700-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[3-5-300-128-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[3-4-64-1-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[3-4-64-64-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[3-6-4096-2048-interpret]",
    "test_kernel_topk_rows.py::test_same_set_as_lax[3-4-1400-700-interpret]",
    "test_kernel_topk_rows.py::test_through_topk_from_logits[interpret]",
    # FP8 GEMM: split-K decode tiles, one split with trimmed rows (64- and 128-row tiles), the one-kernel act_quant, leading dims / auto
    "test_kernel_fp8_gemm.py::test_exact_data_bit_equal[tiles0-interpret]",
    "test_kernel_fp8_gemm.py::test_one_split_trimmed_rows_bit_equal[5-192-None-interpret]",
    "test_kernel_fp8_gemm.py::test_ragged_tiles_bit_equal[130-1152-tiles0-interpret]",  # 144 wide: 2 chunks of 72
    "test_kernel_fp8_gemm.py::test_ragged_tiles_bit_equal[9-1152-tiles3-interpret]",  # stream-K across ragged tiles
    "test_kernel_fp8_gemm.py::test_one_split_trimmed_rows_bit_equal[128-192-128-interpret]",
    "test_kernel_fp8_gemm.py::test_quantize_rows_equals_act_quant[1-256-64-ue8m0-interpret]",
    "test_kernel_fp8_gemm.py::test_leading_dims_and_auto[interpret]",
    "test_kernel_fp8_gemm.py::test_swap_ab_bit_equal[1-bfloat16-tiles0-interpret]",
    "test_kernel_fp8_gemm.py::test_swap_ab_bit_equal[8-float32-tiles1-interpret]",
    "test_kernel_fp8_gemm.py::test_swap_store_smem_bit_equal[16-bfloat16-tiles0-interpret]",  # the default above 8 rows
    "test_kernel_fp8_gemm.py::test_swap_ab_matches_xla[amax-xla-interpret]",
    # ... and its large-M forms, bit for bit: the persistent loop with per-tile ring scales (q_b, mlp), the ring
    # with two K blocks a step (wo)
    "test_kernel_fp8_gemm.py::test_persistent_and_ring_exact_data_bit_equal[tiles1-interpret]",
    "test_kernel_fp8_gemm.py::test_persistent_and_ring_exact_data_bit_equal[tiles3-interpret]",
    "test_kernel_fp8_gemm.py::test_ring_one_row_tile_bit_equal[tiles2-interpret]",  # decode ring, one chunk a warpgroup
    # FP8 grouped GEMM: the persistent schedule and the default layout
    "test_kernel_fp8_grouped_gemm.py::test_persistent_exact_bit_equal[sizes2-tiles2-interpret]",
    "test_kernel_fp8_grouped_gemm.py::test_exact_data_bit_equal[interpret-pallas]",
    "test_kernel_fp8_grouped_gemm.py::test_linear_grouped_on_the_kernel[interpret]",  # V4's grouped wo_a with FP8
    # the grouped GEMMs' row layout
    "test_kernel_grouped_rows.py::test_layout_kernel_equals_xla[7-100-16-None-interpret]",
    "test_kernel_grouped_rows.py::test_layout_kernel_unpacked_equals_xla[5-30-8-28-interpret]",  # long prefills' form
    "test_kernel_grouped_rows.py::test_fused_layout_copies_rows[7-20-16-None-False-interpret]",
    # top-k: the indexer's split form (prefilter, shrink, unroll) and the direct one
    "test_kernel_topk_select.py::test_unroll_same_result[4-400-2-True-interpret]",
    "test_kernel_topk_select.py::test_direct_matches_lax_top_k[300-37-4-interpret]",
    "test_kernel_topk_select.py::test_range_start_same_result[4-1-True-interpret]",  # the one-program finish
    "test_kernel_topk_select.py::test_split_finish_same_result[4-1-b2r3-interpret]",  # the indexer's split finish
    "test_kernel_topk_select.py::test_warp_fill_same_result[sf-interpret]",  # each warp its own part of the split
    "test_kernel_topk_select.py::test_warp_copy_forms_same_result[spread_cu2-interpret]",  # ... its scratch copy
    "test_kernel_topk_select.py::test_lengths_hint_same_result[warp-interpret]",  # the rows' -inf tails as a hint
    "test_kernel_topk_select.py::test_range_top_same_result[hint-interpret]",  # ... a short row's range below zero
    "test_kernel_topk_select.py::test_nan_total_order[pallas-interpret]",  # NaN rows, both paths
    "test_kernel_topk_select.py::test_nan_total_order[xla-interpret]",  # ... and the XLA implementation
    # short rows' paths (a mixed decode batch's time): the coarse pivot, the split form's -inf pivot
    "test_kernel_topk_select.py::test_coarse_pivot_same_result[1-interpret]",
    "test_kernel_topk_select.py::test_split_prefilter_matches_lax_top_k[interpret]",
    # sparse MQA: V4 window + compressed + sink (V3.2's FP8 records: tests/test_ops.py)
    "test_kernel_sparse_mqa.py::test_v4_window_compressed_sink[1-interpret]",
    # fused inserts: both layers' prepare stage (each kernel alone: tests/test_ops.py)
    "test_kernel_fused_insert.py::test_v32_layer_prepare[serving-interpret]",
    "test_kernel_fused_insert.py::test_v4_layer_prepare[swa-interpret]",
    "test_kernel_fused_insert.py::test_v4_layer_prepare[c4-interpret]",  # ... with the compressors' kernels
    "test_kernel_fused_insert.py::test_v4_layer_prepare[c128-interpret]",
    "test_kernel_fused_insert.py::test_v4_kv_insert_reads_columns_in_place[interpret]",  # kv read in place
    # V4 compressor (each op alone: tests/test_ops.py): ratio 128's rows over channel programs against float64,
    # every tiling against XLA
    "test_kernel_compressor_pool.py::test_pool_norm_rope[bfloat16-128-64-16-128-interpret]",
    "test_kernel_compressor_pool.py::test_pool_norm_rope_matches_xla[interpret]",
    "test_kernel_fused_insert.py::test_v32_kv_insert_hadamard_halves[interpret]",  # the large grids' Hadamard form
    # sparse indexer: gathered decode logits, exact ties
    "test_kernel_sparse_indexer.py::test_logits_match_reference[gathered_decode-interpret]",
    "test_kernel_sparse_indexer.py::test_exact_ties_lower_index_wins[interpret]",
    "test_kernel_sparse_indexer.py::test_q_padded_by_the_caller[interpret]",
    "test_kernel_sparse_indexer.py::test_layer_select_wiring[interpret-v32-amax]",
})
