"""The radix select's knobs at the indexer's shapes: the default against single and combined knobs, one call.

    python scripts/diag/topk_knobs.py [--shapes 64x65536 16x131072 ...] [--knobs default u2 u4 ...] [--out F]

Why: the bench's knob rows (jds.bench.kernels_sparse_indexer, ``topk_pallas``) time one knob at a time at two
shapes, in a call that also times every other top-k row. This times only the set-order split select
(``split_for``'s splits, as the indexer runs it) with each knob set named below, at any shapes, full batches and
(``--mixed``) one short row, checking each set against ``lax.top_k``'s, so a knob can become the default from one
short call. ``--lax`` also times ``lax.top_k``; the knob set ``single`` is one program per row (no split). Each row
carries the GPU timeline's device time per call (``profile_span_us``, and per kernel ``profile_kernel_us``) beside
the pipelined median.
(``--mixed --lax --knobs single default`` is the former scripts/diag/topk_split_mixed.py.)
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jds.bench.results import measured_row, save_rows
from jds.bench.timing import profiled_device_us, time_fn
from pallas_kernels.topk_select import TopkSelectConfig, select_unsorted, split_for, topk_select

K = 2048
# the indexer's config where it splits (select_config_for): the split finish, a 2-block bucket, three resolutions
_SF = dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True, range_margin=1, prefetch=True,
           split_finish=True, bucket_blocks=2, bucket_resolutions=3)
KNOBS = {"default": {}, "single": dict(splits=1), "u2": dict(unroll=2), "u4": dict(unroll=4), "b2": dict(bits=2),
         "u2_b2": dict(unroll=2, bits=2), "u2_blk4096": dict(unroll=2, block=4096),
         "u2_shrink": dict(unroll=2, shrink=True), "blk4096": dict(block=4096), "shrink": dict(shrink=True),
         # splits_x: that many times split_for's programs per row (more CTAs per SM to hide the streaming loads' latency)
         "x2_u2_shrink": dict(splits_x=2, unroll=2, shrink=True), "x4_u2_shrink": dict(splits_x=4, unroll=2, shrink=True),
         "x2_shrink": dict(splits_x=2, shrink=True), "u4_shrink": dict(unroll=4, shrink=True),
         # wider counting / compaction steps: fewer latency-bound loop steps over the candidate buffers
         "u2_shrink_h512": dict(unroll=2, shrink=True, hist_block=512),
         "u2_shrink_h1024_w16": dict(unroll=2, shrink=True, hist_block=1024, num_warps=16),
         "x2_u2_shrink_h512": dict(splits_x=2, unroll=2, shrink=True, hist_block=512),
         # the 512-key form with less pivot work per program: a 16- or 8-bit pivot (half / a quarter of the sample's
         # counting passes; more candidates), a 512-key sample, 4 warps (h512_p16 is the indexer's config now)
         "h512_p16": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16),
         "h512_p8": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=8),
         "h512_s512": dict(unroll=2, shrink=True, hist_block=512, sample=512),
         "h512_p16_s512": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, sample=512),
         "h512_w4": dict(unroll=2, shrink=True, hist_block=512, num_warps=4),
         # the indexer's config with the shrunk block held in registers (its config since the twelfth session; the
         # column-only split buffers it was timed against lost and were removed)
         "h512_p16_hold": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True),
         # the indexer's config (h512_p16_hold, twelfth session) with a coarser pivot: 3 or 2 of the sample's 4
         # counting passes, more candidates for the finish
         "h512_p12_hold": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=12, hold_shrunk=True),
         "h512_p8_hold": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=8, hold_shrunk=True),
         # the indexer's config with the finish's counting from the pivot (range_margin; thirty-fourth session): the
         # first pass's digits 2^-(4 + m) of the span up to the sample's largest key (scripts/diag/topk_passes.py
         # gives the passes over the buffers before the shrink: 4 -> 1 at 64 x 64K for m = 1)
         "h512_p16_hold_r0": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                  range_margin=0),
         "h512_p16_hold_r1": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                  range_margin=1),
         "h512_p16_hold_r2": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                  range_margin=2),
         # a 12-bit pivot lost to the 16-bit one when every candidate cost the finish 8 passes' worth of reads; from
         # the pivot the finish reads them about 3 times whatever their number, so the prefilter's saved pass may win
         "h512_p12_hold_r1": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=12, hold_shrunk=True,
                                  range_margin=1),
         # the prefilter's streaming pass waits on memory (16 KB in flight per SM with unroll 2): more of it in flight,
         # by twice the programs per row (2 CTAs per SM at 127 registers; more sources for the finish, which now reads
         # them about 3 times, not 6) or 4 blocks a step
         "x2_h512_p16_hold_r1": dict(splits_x=2, unroll=2, shrink=True, hist_block=512, pivot_bits=16,
                                     hold_shrunk=True, range_margin=1),
         "u4_h512_p16_hold_r1": dict(unroll=4, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                     range_margin=1),
         "x2_u4_h512_p16_hold_r1": dict(splits_x=2, unroll=4, shrink=True, hist_block=512, pivot_bits=16,
                                        hold_shrunk=True, range_margin=1),
         # or the next step's blocks loaded during this one's work, the first step's during the sample pivot
         # (prefetch; 128 registers, 8 bytes of spill with pip triton 3.8)
         "h512_p16_hold_r1_pf": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                     range_margin=1, prefetch=True),
         "x2_h512_p16_hold_r1_pf": dict(splits_x=2, unroll=2, shrink=True, hist_block=512, pivot_bits=16,
                                        hold_shrunk=True, range_margin=1, prefetch=True),
         # the finish as a bucket copy and a compaction per split (split_finish): the first pass counted by the
         # prefilter, the finish's rows spread over the row's split programs
         "h512_p16_hold_r1_sf": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                     range_margin=1, split_finish=True),
         "x2_h512_p16_hold_r1_sf": dict(splits_x=2, unroll=2, shrink=True, hist_block=512, pivot_bits=16,
                                        hold_shrunk=True, range_margin=1, split_finish=True),
         "h512_p16_hold_r1_pf_sf": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                        range_margin=1, prefetch=True, split_finish=True),
         # ... with the rows whose k-th key's bucket exceeds 512 keys kept on the parallel finish: a third, coarser
         # first pass (r3), and a 1024-key bucket counted as two blocks (b2); the replay (scripts/diag/topk_passes.py)
         # fits 254 / 256 of 256 rows at 128K, against 253 with the pair of 512-key resolutions. H200, 2026-12-05
         # (archive/topk_knobs_bucket_h200_2026-12-05.json): b2r3 faster than _pf on the timeline at 7 of 8 batches;
         # since then the split finish skips the counting passes of rows whose pivot is tau (mixed batches)
         "h512_p16_hold_r1_pf_sf_r3": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                           range_margin=1, prefetch=True, split_finish=True, bucket_resolutions=3),
         "h512_p16_hold_r1_pf_sf_b2r3": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                             range_margin=1, prefetch=True, split_finish=True, bucket_blocks=2,
                                             bucket_resolutions=3),
         # ... the kernel writing -1 for kept -inf keys (the indexer's invisible keys; topk_invisible_in_kernel): the
         # call is select_unsorted's columns alone, no gather of the kept values after the kernels
         "h512_p16_hold_r1_pf_inv": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                         range_margin=1, prefetch=True, minus_one_for_neg_inf=True),
         "h512_p16_hold_r1_pf_sf_b2r3_inv": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16,
                                                 hold_shrunk=True, range_margin=1, prefetch=True, split_finish=True,
                                                 bucket_blocks=2, bucket_resolutions=3, minus_one_for_neg_inf=True),
         # the counting passes' per-lane counts in packed 4-bit fields (packed_counts; thirty-fifth session): the
         # count step over 512-key blocks 265 -> 114 SASS instructions for 4 keys a thread (pip triton, sm_90a)
         "h512_p16_hold_pk": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                  packed_counts=True),
         "h512_p16_hold_r1_pk": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                     range_margin=1, packed_counts=True),
         "h512_p16_hold_r1_sf_pk": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                        range_margin=1, split_finish=True, packed_counts=True),
         # the prefilter with 16 warps a program (fill_warps): 4 warps a scheduler to hide its loop's barrier, shuffle
         # and shared-memory latency (64 x 64K: one program an SM), 8 keys a thread a step; or twice the programs
         "h512_p16_hold_r1_pk_w16": dict(unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                                         range_margin=1, packed_counts=True, fill_warps=16),
         # ... on the indexer's default (the split finish, thirty-eighth session): the prefilter, 28 of 48 µs at
         # 64 x 64K, issues at about 0.3 instructions a cycle a scheduler with 2 warps each (eleventh session's ncu)
         "sf_w16": {**_SF, "fill_warps": 16}, "sf_pk": {**_SF, "packed_counts": True},
         "sf_pk_w16": {**_SF, "packed_counts": True, "fill_warps": 16},
         # two first-pass resolutions, margins 0 and 1 (the replay, topk_passes.py, fits 256 of 256 rows at 64K with
         # 1024 keys at margin 0 alone): one resolution's counts fewer in the prefilter
         "sf_m0r2": {**_SF, "range_margin": 0, "bucket_resolutions": 2},
         # the prefilter's loop without layout conversions before its stores (thirty-ninth session; fill_layout):
         # pip triton's SASS a step (2 blocks of 2048 keys) at 64 x 64K, vector -> lane / group: 944 -> 1382 / 892
         # instructions, BAR 32 -> 12 / 12, shared loads + stores 76 -> 56 / 20. finish_lane_loads: the finish's
         # conversions 52 -> 18. hold_bucket: the 2-block bucket held in registers through the finish's passes (no
         # loads in its pass loop); fuse_bucket: no bucket kernel, each finish program copies the bucket itself
         "sf_group": {**_SF, "fill_layout": "group"},
         "sf_lane": {**_SF, "fill_layout": "lane", "finish_lane_loads": True},
         "sf_lane_fin": {**_SF, "finish_lane_loads": True},
         "sf_group_fin": {**_SF, "fill_layout": "group", "finish_lane_loads": True},
         "sf_group_w16": {**_SF, "fill_layout": "group", "fill_warps": 16},
         # group + 16 warps: 64 registers (pip triton), so two prefilter programs fit an SM: twice the splits; or
         # 4096-key blocks (one scan and one reduction per 4096 keys; 120 registers)
         "sf_group_w16_x2": {**_SF, "fill_layout": "group", "fill_warps": 16, "splits_x": 2},
         "sf_group_b4k_w16": {**_SF, "fill_layout": "group", "fill_warps": 16, "block": 4096},
         "sf_lane_w16": {**_SF, "fill_layout": "lane", "finish_lane_loads": True, "fill_warps": 16},
         "sf_hold": {**_SF, "hold_bucket": True},
         "sf_fuse": {**_SF, "hold_bucket": True, "fuse_bucket": True},
         "sf_group_fuse": {**_SF, "fill_layout": "group", "finish_lane_loads": True, "hold_bucket": True,
                           "fuse_bucket": True},
         "sf_lane_fuse": {**_SF, "fill_layout": "lane", "finish_lane_loads": True, "hold_bucket": True,
                          "fuse_bucket": True},
         # ... with the counting passes' packed counts (the held bucket's per-digit totals in wide fields)
         "sf_group_fuse_pk": {**_SF, "fill_layout": "group", "finish_lane_loads": True, "hold_bucket": True,
                              "fuse_bucket": True, "packed_counts": True},
         # ... with the sample pivot resolved to 12 bits (3 of its 4 passes over the sample; a bucket a sixteenth of
         # a binade wide, so a few more candidates)
         "sf_group_fuse_p12": {**_SF, "fill_layout": "group", "finish_lane_loads": True, "hold_bucket": True,
                               "fuse_bucket": True, "pivot_bits": 12},
         # each warp streams its own part of the split into its own scratch (fortieth session; fill_layout="warp"):
         # pip triton's SASS a 4096-key step at 64 x 64K 488 instructions without a barrier or a shared-memory
         # access (vector 925 with 32 barriers, group 793 with 12); 16 warps: 252; 125 registers at 8 warps, so two
         # programs fit an SM (x2: twice the splits)
         "sf_warp": {**_SF, "fill_layout": "warp"},
         "sf_warp_w16": {**_SF, "fill_layout": "warp", "fill_warps": 16},
         # the warps' scratch copied 2 / 4 chunks a step, loads first (forty-third session: on an H100 a mixed batch
         # at 8 x 128K ran the warp fill's prefilter 1.9 us longer than the full one; a short row's finite keys all
         # lie in one warp's part, and the copy loop takes as many steps as that warp's chunks: the suspected cause)
         "sf_warp_cu2": {**_SF, "fill_layout": "warp", "copy_unroll": 2},
         "sf_warp_cu4": {**_SF, "fill_layout": "warp", "copy_unroll": 4},
         # the copy spread over every warp of the CTA (forty-fourth session; the indexer's default since): a mixed
         # batch level with a full one at the six shapes timed on an H100, the full rows level or 0-3% slower
         "sf_warp_sp": {**_SF, "fill_layout": "warp", "copy_spread": True},
         # ... with the rows' finite counts as the lengths hint (forty-fourth session): the splits cut a short row's
         # head, not the whole row
         "sf_warp_sp_len": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True},
         # ... with 8-block (4096-key) buckets: every short row's bucket fits in topk_passes.py --short's replay, so it
         # takes the split finish, not the one-program one (a row whose finest bucket fits 2 blocks takes it either way)
         "sf_warp_sp_b8": {**_SF, "fill_layout": "warp", "copy_spread": True, "bucket_blocks": 8},
         "sf_warp_sp_len_b8": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True, "bucket_blocks": 8},
         # ... with the 2-block bucket held in registers through the finish's passes (forty-fifth session: with the
         # hint a row of 3000 keys takes the split finish's fast path, yet its finish ran 20 us against 12.5 on an
         # H200; its pivot is negative and its sample's top positive, so the bucket's range is wide: more passes)
         "sf_warp_sp_len_hold": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                 "hold_bucket": True},
         # ... with the counting range's top at the sample's key of rank m - 6 sqrt(m) - 4, not its largest key
         # (range_top_sigma) where the range crosses the sign: a short row's range then stays below zero, and its
         # bucket holds tens of keys, not hundreds (the indexer's default since; archive/topk_knobs_top_h100_*.json
         # ran it on every row whose rank exceeded 1, before the sign test)
         "sf_warp_sp_len_top": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                "range_top_sigma": 6.0},
         # ... and the first pass's keys near zero as one value (zero_band, forty-fifth session; the indexer's
         # default since: 4500 tokens at 8 x 128K twice as fast on an H100, full level): a request
         # of 3500-5000 tokens has its tau near zero, where the ordered keys of every tiny magnitude share the k-th
         # key's first-pass digit (topk_passes.py --short: 4500 tokens fit 0 of 20 rows, with --zero-band 8 all)
         "sf_warp_sp_len_top_zb": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                   "range_top_sigma": 6.0, "zero_band": 8},
         # ... with the splits cutting a short row's head by a chunk a warp (1024 columns), not by 2048-key blocks
         # (fine_splits, forty-fifth session, untimed): a request of 3000 tokens over 3 splits, not 2
         "sf_warp_sp_len_top_zb_fine": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                        "range_top_sigma": 6.0, "zero_band": 8, "fine_splits": True},
         # ... the zero band without the range top (no extra sample passes: in topk_passes.py --short's replay with
         # --zero-band 8 alone every short row's bucket fits too, with a few hundred keys instead of tens at 2100-3000)
         "sf_warp_sp_len_zb": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True, "zero_band": 8},
         # ... with the range top resolved to 8 leading bits (two sample passes instead of three: the short row's
         # prefilter took 2.3 us longer than a full row's with 12 bits on an H100; the replay's buckets barely grow)
         "sf_warp_sp_len_top8_zb": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                    "range_top_sigma": 6.0, "range_top_bits": 8, "zero_band": 8},
         # ... the band 3 / 4 binades under the smaller magnitude, with fine splits, with and without the range top
         # (forty-sixth session: in topk_passes.py --short's replay a band of 8 binades left a request of 4500-5000
         # tokens a bucket of up to 651-1196 keys, two blocks through six passes; 3 binades: at most 180-446)
         "sf_warp_sp_len_zb_fine": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                    "zero_band": 8, "fine_splits": True},
         "sf_warp_sp_len_zb4_fine": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                     "zero_band": 4, "fine_splits": True},
         "sf_warp_sp_len_zb3_fine": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                     "zero_band": 3, "fine_splits": True},
         "sf_warp_sp_len_top_zb3_fine": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                         "range_top_sigma": 6.0, "zero_band": 3, "fine_splits": True},
         # the indexer's default since the forty-sixth session without the lengths hint (fine_splits acts only with it;
         # the hint cost full batches 0.6-0.8 us on both cards) and with a full row's first loads issued before its
         # length arrives (speculate_full: pip triton's SASS then issues them at once, where the hinted prefilter's
         # sample and first step waited on the length's load)
         "sf_warp_sp_zb3_fine": {**_SF, "fill_layout": "warp", "copy_spread": True, "zero_band": 3,
                                 "fine_splits": True},
         "sf_warp_sp_len_zb3_fine_spec": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                          "zero_band": 3, "fine_splits": True, "speculate_full": True},
         # ... with the bucket's first block held through the finish's passes (hold_bucket_head): no L2 load a pass
         # where the bucket fits one block (most rows), where hold_bucket counted two blocks a pass
         "sf_warp_sp_len_zb3_fine_head": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                          "zero_band": 3, "fine_splits": True, "hold_bucket_head": True},
         # ... the finish's counting ended once the k-th key's digit holds one key (exit_at_one: tau by a masked max;
         # topk_passes.py's replay: 2-3 counting passes then the max, against 5-6 counting passes), alone and with
         # the bucket's first block held (the indexer's default since the forty-seventh session: faster than the one
         # before at 8 x 128K, 32 x 32K and 64 x 64K, full and mixed; topk_knobs_spec_h100_2026-12-05.json)
         "sf_warp_sp_len_zb3_fine_exit": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                          "zero_band": 3, "fine_splits": True, "exit_at_one": True},
         "sf_warp_sp_len_zb3_fine_head_exit": {**_SF, "fill_layout": "warp", "copy_spread": True, "lengths": True,
                                               "zero_band": 3, "fine_splits": True, "hold_bucket_head": True,
                                               "exit_at_one": True},
         # ... without the lengths hint (its cost on full batches under the default finish)
         "sf_warp_sp_zb3_fine_head_exit": {**_SF, "fill_layout": "warp", "copy_spread": True, "zero_band": 3,
                                           "fine_splits": True, "hold_bucket_head": True, "exit_at_one": True},
         "sf_warp_sp_hold": {**_SF, "fill_layout": "warp", "copy_spread": True, "hold_bucket": True},
         "sf_warp_sp_cu2": {**_SF, "fill_layout": "warp", "copy_spread": True, "copy_unroll": 2},
         # ... writing -1 for kept -inf keys (IndexerKernelConfig.topk_invisible_in_kernel): no gather of the kept
         # values after the kernels (the loop_select_fusion kernel on the timeline)
         "sf_warp_sp_inv": {**_SF, "fill_layout": "warp", "copy_spread": True, "minus_one_for_neg_inf": True},
         "sf_warp_x2": {**_SF, "fill_layout": "warp", "splits_x": 2},
         "sf_warp_fuse": {**_SF, "fill_layout": "warp", "finish_lane_loads": True, "hold_bucket": True,
                          "fuse_bucket": True},
         # ... with packed counts: the sample's passes 481 -> 289 instructions, the buffer's first-pass counts 331 ->
         # 99 a step (pip triton): with the streaming loop halved, they were a third of the prefilter's instructions
         "sf_warp_pk": {**_SF, "fill_layout": "warp", "packed_counts": True},
         "sf_warp_fuse_pk": {**_SF, "fill_layout": "warp", "finish_lane_loads": True, "hold_bucket": True,
                             "fuse_bucket": True, "packed_counts": True},
         "x2_h512_p16_hold_r1_pk": dict(splits_x=2, unroll=2, shrink=True, hist_block=512, pivot_bits=16,
                                        hold_shrunk=True, range_margin=1, packed_counts=True),
         # 1024-key counting / compaction steps over packed counts (half the finish's steps and a 1024-key held
         # block; 168 registers with pip triton, no spills): the finish's loops wait on latency, not issue
         "h1024_p16_hold_r1_pk": dict(unroll=2, shrink=True, hist_block=1024, pivot_bits=16, hold_shrunk=True,
                                      range_margin=1, packed_counts=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["64x65536", "16x131072", "16x32768", "64x131072"])
    ap.add_argument("--knobs", nargs="+", default=list(KNOBS), choices=list(KNOBS))
    ap.add_argument("--mixed", action="store_true", help="also a batch with one short row (1000 finite logits)")
    ap.add_argument("--short", type=int, nargs="+", default=[1000],
                    help="with --mixed: the short row's finite logits, one batch each (tag _mixed for 1000, else "
                         "_mixedN)")
    ap.add_argument("--lax", action="store_true", help="also time lax.top_k")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lax_topk = jax.jit(jax.lax.top_k, static_argnums=1)
    rows: list[dict] = []
    knobs = {n: KNOBS[n] for n in a.knobs}
    save = functools.partial(save_rows, a.out, rows, False, knobs=knobs)  # after every row: a cut run keeps its rows
    for shape in a.shapes:
        b, c = (int(v) for v in shape.split("x"))
        sp = split_for(b, c)
        lg = jax.random.normal(jax.random.key(b * c), (b, c), jnp.float32)
        batches = [("", lg, c)] + ([("_mixed" if m == 1000 else f"_mixed{m}", lg.at[0, m:].set(-jnp.inf), m)
                                     for m in a.short] if a.mixed else [])
        wants = []
        for tag, x, _ in batches:
            lv, li = lax_topk(x, K)
            want = np.sort(np.asarray(li), axis=1)
            want_inv = np.sort(np.where(np.asarray(lv) > -np.inf, np.asarray(li), -1), axis=1)  # -1: -inf keys
            wants.append((want, want_inv))
            if a.lax:
                rows.append({"case": f"topk_b{b}_c{c}{tag}_lax", **time_fn(lax_topk, x, K, warmup=5, iters=30),
                             **profiled_device_us(lax_topk, x, K)})
                print(json.dumps(rows[-1]), flush=True)
                save()
        for name in a.knobs:  # one executable a knob for the batches (a compile takes tens of seconds)
            kn = dict(KNOBS[name])
            hint = kn.pop("lengths", False)  # the rows' finite counts as topk_select's lengths hint
            cfg = TopkSelectConfig(**{"splits": sp * kn.pop("splits_x", 1), **kn})
            if cfg.minus_one_for_neg_inf:  # the kernels' columns alone (topk_select would gather at -1)
                f = jax.jit(lambda x, k, ln, cfg=cfg: (select_unsorted(x, k, config=cfg, lengths=ln)[0],) * 2,
                            static_argnums=1)
            else:
                f = jax.jit(lambda x, k, ln, cfg=cfg: topk_select(x, k, sort=False, config=cfg, lengths=ln),
                            static_argnums=1)
            for (tag, x, short), (want, want_inv) in zip(batches, wants):
                case = f"topk_b{b}_c{c}{tag}_split{cfg.splits}_set_{name}"
                ln = jnp.asarray([short] + [c] * (b - 1), jnp.int32) if hint else None

                def measure(f=f, x=x, ln=ln, want=want_inv if cfg.minus_one_for_neg_inf else want) -> dict:
                    got = np.sort(np.asarray(f(x, K, ln)[1]), axis=1)
                    return {"same_set_as_lax": bool((got == want).all()), **time_fn(f, x, K, ln, warmup=5, iters=30),
                            **profiled_device_us(f, x, K, ln, by_kernel=True)}

                rows.append(measured_row({"case": case}, measure))
                save()
    save_rows(a.out, rows, True, knobs=knobs)


if __name__ == "__main__":
    main()
