"""Exact top-k by radix selection in one Pallas GPU kernel (issue 7: the indexer's top-2048).

``topk_select(x, k)`` returns what ``jax.lax.top_k(x, k)`` returns for rows of float logits: values descending,
equal values by ascending index, in IEEE's total order (+0.0 above -0.0; NaN by its sign bit above +inf or below
-inf, as ``jds.ops.select`` orders it). Pure-JAX reference:
``jds.ops.select.radix_topk`` (``implementation="xla"``), whose definitions the kernel follows: the ordered
key, the k-th largest key tau (``kth_largest_key``) and the kept set (every key > tau, plus the lowest-index
keys == tau up to exactly k). XLA then sorts only the k survivors, as radix_topk does.

Why a kernel: the XLA radix select reduces a [T, 2^bits, N] comparison per counting pass and compacts
with full-row cumsums and a scatter. Here one program per row streams its row in blocks; the largest
intermediate is a [2^bits, hist_block] tile of per-lane counters ([2^bits, sample] for the pivot), and
each survivor is stored straight to its output slot. Per row:

1. Prefilter (rows with N >= 8k by default, ``TopkSelectConfig.capacity``): the r-th largest key of an
   evenly spaced sample of the row is a pivot below tau with high probability (r: ``_sample_rank``; an
   expected 1.8 x k keys reach it for k = 2048 of 64K random values). One streaming pass copies the keys
   >= pivot with their columns, in column order, into a per-row candidate buffer. When it holds between k
   and ``capacity`` keys it contains every key >= tau (tau >= pivot), so steps 2-3 read the buffer instead
   of the row. When more than ``capacity`` keys reach the pivot, its value is shared by many keys (the -inf
   tail of a short row: few finite logits; or a heavy tie). With at least k keys strictly above it, tau is
   above the pivot: if every such key landed in the buffer (a short row's finite head comes before its -inf
   tail) the buffer serves as it is ("overflowed buffer"), else with at most ``capacity`` of them a second pass
   fills the buffer with those alone; with fewer than k above it, the pivot is tau itself, and the row goes
   straight to step 3 (one pass instead of the counting passes).
   Otherwise (a skewed sample: fewer than k keys reach the pivot) steps 2-3 read the row: slower, same result.
2. Counting: 32 / bits digit passes, most significant first. ``ge[d]`` = candidates (decided high bits ==
   prefix) whose current digit is >= d: compare-and-sum over the 2^bits digit values into per-lane
   counters, one cross-lane reduction per pass (no atomics). The largest d with ``ge[d] >= k'`` extends the
   prefix, and k' drops by ``ge[d + 1]``. After the last pass the prefix is tau and k' = ``need``, the
   number of keys == tau to keep (>= 1). The prefilter's pivot is the same computation on the sample.
   With ``TopkSelectConfig.range_margin`` the passes over the buffer count digits of u - pivot instead, the
   first ones a fraction of the span up to the sample's largest key, so the first pass splits the candidates
   finely where the whole key space's first digits are shared by almost all of them (``_kth_key``). With
   ``packed_counts`` a lane counts its keys per digit value in packed 4-bit fields (``_count_steps``), a shift
   and an add a key per word instead of a compare and an add per digit value.
3. Compaction: one more loop keeps key > tau, and key == tau while fewer than ``need`` equal keys came
   before; an exclusive prefix sum of the kept mask within the block plus the count so far is each
   survivor's slot in the [T, k] output (a masked scatter store). It stops when k keys are kept, so a short
   row (pivot = tau = -inf) reads its head, not its whole -inf tail: that row had read itself twice and
   set a mixed batch's time (BENCHMARKS.md, kernels_select).

Split prefilter (``TopkSelectConfig.splits`` > 1; ``split_for`` picks one per batch): one program per row
streams the row on one SM, so a batch of 16 rows reads its logits on 16 of 132 SMs. With splits, a first
kernel runs ``splits`` programs per row, each over a contiguous range of whole blocks, filling its own buffer
of ``capacity`` keys (all of them compute the row's sample pivot); a second kernel, one program per row, runs
steps 2-3 on the buffers' union where it lies, one source per split in column order (or on the row, under the
same conditions as above; a heavy tie past a full buffer reads the row instead of refilling).
The indexer's default (``IndexerKernelConfig.topk_splits=None``: ``split_for``): on the H200 it was faster than
one program per row on batches of 16 rows, full or mixed, and level with it at 64 rows (BENCHMARKS.md).
``TopkSelectConfig.split_finish`` spreads the second kernel's work over the row's split programs too: the fill
kernel also counts its buffer's first-pass digits (from the pivot, ``range_margin``), a bucket kernel copies the
keys of the k-th key's digit (``bucket_blocks`` blocks at most) to a scratch row, and a finish kernel of ``splits``
programs per row finds tau in it (each program the same) and compacts its own buffer into its own output slots.
Rows whose bucket exceeds the scratch, or that take another path, run the one-program finish in their first split's
program (a row whose pivot is tau without the counting passes). ``fill_layout="warp"`` streams a split's range as
one consecutive part a warp, each into its own scratch buffer, and copies their first ``capacity`` keys to the
split's buffer after the pass: the pass's slots and counts then stay within a warp, with no CTA barrier in its loop.
With the ``lengths`` hint (rows -inf from lengths[t] on: a decode batch's logits past each request's context) the
splits cut the row's head instead of the whole row, and its sample is drawn from the head: a short request's keys
are otherwise all in its first split, and its sample mostly -inf.

Backend: the Triton lowering (conventions of ``pallas_kernels/fused_insert_common.py``), not Mosaic GPU.
The prefilter and the compaction store each kept key at a data-dependent position, a vector scatter, and
Mosaic GPU rejects vector indices on Hopper (TMA scatter is sm100 only). Triton expresses it as a masked
store through a pointer tensor and lowers ``cumsum`` to ``tt.scan``; its lowering runs on a CPU-only
machine (``check_triton_lowering``), so the CPU tests run interpret mode and lower the kernel for an H200.
The candidate buffer is a kernel output in GPU memory: the native kernel places a CTA barrier
(``debug_barrier``) between writing it and reading it back from other threads.

Keys stay int32 in the kernel: ``s`` = the signed image of the float bits (``bits ^ 0x7fffffff`` for
negative floats), ordered as the floats are; ``u = s ^ 0x80000000`` is ``jds.ops.select.ordered_key``'s
uint32 key as a bit pattern, whose digits are taken with logical shifts. Padding lanes (past N, past the
buffer's fill) get u = 0, below every float but the negative NaN 0xFFFFFFFF, which ties with them (-inf has
u = 0x007fffff): they come after every real key in column order, so they never change tau nor get kept (k <= N).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jds.ops.dispatch import Implementation, check_int, run_op
from jds.ops.select import ordered_key, radix_topk
from pallas_kernels import fused_insert_common as C

I32 = jnp.int32
_SIGN = -(1 << 31)  # 0x80000000 as int32: s <-> u
_CHUNK = 128  # fill_layout="warp": a warp's keys a chunk (4 consecutive keys a lane: one 16-byte load)
_FLOAT_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))  # exact in float32


@dataclasses.dataclass(frozen=True)
class TopkSelectConfig:
    """Tuning knobs of the kernel (static). Every setting gives the same result."""

    bits: int = 4  # digit width (1, 2 or 4): 32 / bits counting passes of 2^bits compares per key
    block: int = 2048  # keys per step of the streaming loops over the row (prefilter)
    hist_block: int = 256  # keys per step of the counting / compaction loops ([2^bits, hist_block] counters;
    #                        512 spilled in ptxas for sm_90a without the prefilter)
    sample: int = 1024  # evenly spaced row keys that pick the prefilter pivot
    # leading key bits the pivot resolves (a multiple of bits): fewer bits, fewer counting passes over the sample, and a
    # pivot rounded down to its bucket's floor (more candidates, never a different result: any pivot is exact)
    pivot_bits: int = 32
    capacity: int | None = None  # candidate buffer per row; None: 4 k when N >= 8 k, else no prefilter; 0: none
    num_warps: int = 8
    # programs per row for the prefilter's streaming pass (a power of 2; 1: one kernel, one program per row). A
    # batch of few rows otherwise streams on as many SMs as it has rows; each split fills its own buffer of
    # ``capacity`` keys, and a second kernel (one program per row) counts and compacts their union
    splits: int = 1
    # copy the counting passes' candidates to a one-block scratch row once at most hist_block remain, and count that
    # block in the passes after (same counts); off here, on in the indexer's split config (select_config_for)
    shrink: bool = False
    # blocks whose loads a streaming loop (prefilter, counting, compaction) issues together before using any: one
    # wait on memory per ``unroll`` blocks instead of one per block (the profile showed 2 warps per scheduler with
    # no eligible warp most cycles); blocks past a source's end are masked out, so every count is unchanged; 1 here,
    # 2 in the indexer's split config (select_config_for)
    unroll: int = 1
    # with shrink: the shrunk block stays in registers across the remaining counting passes (loaded once after the
    # copy) instead of each pass reloading the scratch row: one dependent load fewer per pass
    hold_shrunk: bool = False
    # None: the counting passes over the candidate buffers start from the whole key space (8 passes of 4-bit digits,
    # the first ones shared by almost every candidate: normal logits' top 4K lie within two exponents). m >= 0: they
    # start from the pivot, with digits 2^-(bits + m) of the span between the pivot and the sample's largest key
    # (keys above it count in the top digit), so the first pass already splits the candidates finely: about 300 of
    # the 3.8K of a 64K row remain after it instead of 2.3K, and fit the shrunk block from the second pass on
    range_margin: int | None = None
    # the prefilter's streaming pass keeps the next step's blocks in flight while it works on the current ones, and
    # the split kernel issues its first step's loads before the sample pivot (_fill's ``prefetch``)
    prefetch: bool = False
    # with splits > 1 and range_margin: the finish as three kernels of ``splits`` programs per row. The prefilter also
    # counts its buffer's first-pass digits; a second kernel copies the k-th key's bucket (at most bucket_blocks x
    # hist_block keys) to a scratch row; the third finds tau there and compacts each buffer in its own program. A row
    # whose bucket is larger, or that takes another path, runs the one-program finish in its first split's program
    split_finish: bool = False
    # with split_finish: the scratch bucket's size in hist_block blocks; a row whose k-th key's first-pass bucket holds
    # more keys runs the one-program finish (in its first split's program), so a larger one keeps more rows on the
    # parallel finish, whose programs then count the bucket's blocks in each pass instead of one held block
    bucket_blocks: int = 1
    # with split_finish: first passes at this many resolutions, digits 2^-(bits + m) of the span for m from
    # range_margin + 2 - bucket_resolutions to range_margin + 1; the finest whose bucket fits is used. The digits are a
    # power of two wide, so one resolution's bucket varies twice over with the span's rounding; a coarser one reaches
    # further, where the k-th key lies in the finer one's clamped top digit (scripts/diag/topk_passes.py)
    bucket_resolutions: int = 2
    # the compaction writes -1 for kept -inf keys instead of their column: the indexer's invisible keys, so that a
    # caller wanting the visible columns alone (the indexer's set order) needs no gather of the kept values after it
    minus_one_for_neg_inf: bool = False
    # the counting passes count each lane's keys of a several-block source in packed 4-bit fields, a shift and an add
    # a key per word instead of a compare and an add per digit value (``_kth_key``'s ``packed``); the sample pivot
    # then holds its sample as 256-key blocks, several keys a lane
    packed_counts: bool = False
    # warps of the split prefilter's programs (None: num_warps). One program per SM streams a 64-row batch's rows (64 x
    # 2 splits on 132 SMs); its loop waits on barriers, shuffles and shared memory with 2 warps per scheduler at 8
    fill_warps: int | None = None
    # the register layout of the prefilter's streaming loop. Triton gives a store whose addresses depend on the data
    # one key a lane; with vectorised loads (4 keys a lane, "vector") the stores' pointers, values and masks go through
    # shared memory to that layout, barrier by barrier, in every block (pip triton's TTGIR and SASS:
    # scripts/diag/triton_sass.py). "lane": the loads take one key a lane too (``_lanes``), so nothing is converted,
    # but the scan runs one warp scan per key a lane holds (8 at 2048-key blocks and 8 warps). "group": a block is
    # [4, block / 4] with column 4 c + r at [r, c] (``_row_keys``' ``groups``): a lane loads its 4 consecutive keys in
    # one instruction, and the stores' one-key-a-lane layout of that shape gives each lane the same 4 keys, so nothing
    # is converted either; the prefix runs along the group in the lane, then one warp scan per 4 keys (``_col_prefix``).
    # "warp" (split prefilter only): each warp streams its own contiguous part of the split's range into its own
    # scratch buffer (``_warp_fill``), so the loop's prefix and counts stay within a warp: no CTA barrier a block,
    # where the other forms' cross-warp scan and reduction wait on barriers several times a block; "vector" here,
    # "warp" in the indexer's split config (select_config_for)
    fill_layout: Literal["vector", "lane", "group", "warp"] = "vector"
    # the loads of the counting, copy and compaction loops after the prefilter (buffers, bucket, scratch and row:
    # 512-key blocks, 2 keys a lane) take one key a lane, as "lane" above
    finish_lane_loads: bool = False
    # with split_finish and bucket_blocks > 1: the finish loads the whole bucket once, as one [1, bucket_blocks x
    # hist_block] block held in registers through its counting passes and the tally, instead of loading it from the
    # scratch row block by block in each pass (a dependent L2 load a pass; 4 keys a lane for a 2-block bucket)
    hold_bucket: bool = False
    # with split_finish and bucket_blocks > 1: the bucket's first hist_block keys are loaded once and held in registers
    # through the counting passes (the tally loads them again, with their columns); only a bucket past one block loads
    # its further blocks in each pass.
    # The finish's bucket mostly fits one block, which otherwise comes from the scratch row again in every pass (a
    # dependent L2 load a pass, five or six passes); ``hold_bucket`` holds the whole bucket, and counts twice the keys.
    # pip triton's finish kernel at 8 x 128K then spills 64 bytes at its 128 registers (none without)
    hold_bucket_head: bool = False
    # with split_finish: no bucket kernel; each finish program copies every split's bucket keys to its own part of a
    # scratch row itself (the copy's pass over the row's candidates, one kernel and its dependent loads fewer a call)
    fuse_bucket: bool = False
    # fill_layout="warp": the warps' scratch chunks copied to the split's buffer per step of the copy loop, all their
    # loads issued before their stores. Each step waits on its L2 loads, and the loop runs as many steps as the
    # fullest warp's chunks: a short row's finite keys all lie in its first split's first warp's part
    copy_unroll: int = 1
    # fill_layout="warp": the warps' scratch copied as one sequence spread over every warp of the CTA (a warp's 128
    # slots of the split's buffer a step, read from whichever warps' scratch holds them), so the loop runs as many
    # steps as the split's kept keys fill the CTA's lanes, not as the fullest warp's chunks: a short row's finite
    # keys, all in one warp's part, cost one step instead of eight
    copy_spread: bool = False
    # with range_margin: the counting's range from the pivot reaches up to the sample's key at rank
    # m - range_top_sigma sqrt(m) - 4 (m = sample k / n: the sampled keys expected at or above tau; ``_top_rank``),
    # resolved to ``range_top_bits`` leading bits (its bucket's top), where that rank exceeds 1 and the range from a
    # finite pivot crosses the sign (``_crosses_sign``); the sample's largest key elsewhere (None: always). Why: a
    # short row's tau lies among its bulk, so its pivot is negative and its sample's largest key positive; the span
    # then crosses the sign, the first digits are 2^25-2^27 keys of u wide, and the k-th key's bucket holds hundreds
    # of keys (or overflows the split finish's scratch). Keys above the range's top count in the top digit, so
    # every top gives the same result
    range_top_sigma: float | None = None
    range_top_bits: int = 12
    # with split_finish: where the range from the pivot crosses the sign, the first pass counts the keys with the
    # magnitudes below 2^-zero_band of the smaller of the pivot's and the range top's as one value (``_zero_band``):
    # the ordered keys of the floats near zero span most of the key space (every exponent down to the smallest), so
    # a tau near zero (a request of about 2 k tokens) otherwise shares its first-pass digit with most of the row's
    # bulk, whose bucket then overflows the scratch. None: off
    zero_band: int | None = None
    # fill_layout="warp" with the ``lengths`` hint: the splits cut a row's head in units of a 128-key chunk a warp
    # (1024 columns at 8 warps), not whole blocks, so a short request's keys spread over more splits (3000 tokens:
    # 3 splits, not 2): less of its fill, copy and bucket in one program. A full row whose length divides into
    # splits x block is cut as before
    fine_splits: bool = False
    # with the ``lengths`` hint and the split prefilter: the sample's and the first step's loads are issued at a full
    # row's columns before the row's length arrives, and only a row shorter than n loads them again at its own
    # (``_speculated``). Without it they wait on the length's load: the hinted prefilter's first loads came after it
    # in pip triton's SASS, where the unhinted one issues them at once
    speculate_full: bool = False
    # the finish's counting from the pivot (``range_margin``) stops once a pass leaves one key in the k-th key's digit:
    # that key is tau, taken by a masked max over the blocks in one more pass (``_kth_key``'s ``exit_one``). In the
    # replay a bucket's digit holds one key after 2-3 of its 5-6 passes, full rows and short ones alike
    exit_at_one: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (1, 2, 4):  # 8 would need [256, hist_block] counters: spills
            raise ValueError(f"bits must be 1, 2 or 4, got {self.bits}")
        for name in ("block", "hist_block", "sample", "num_warps", "splits", "unroll"):
            if not C.is_pow2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of 2, got {getattr(self, name)}")
        if self.fill_layout not in ("vector", "lane", "group", "warp"):
            raise ValueError(f'fill_layout must be "vector", "lane", "group" or "warp", got {self.fill_layout!r}')
        if self.fill_layout == "group" and self.block < 4 * 32:
            raise ValueError(f'fill_layout="group" needs block >= 128 (4 keys a lane of a warp), got {self.block}')
        if self.fill_layout == "warp":
            if self.splits == 1:
                raise ValueError('fill_layout="warp" is a form of the split prefilter: it needs splits > 1')
            warps = self.fill_warps or self.num_warps
            if self.block < _CHUNK * warps:
                raise ValueError(f'fill_layout="warp" needs block >= {_CHUNK} x the prefilter\'s {warps} warps (a '
                                 f'{_CHUNK}-key chunk a warp a block), got {self.block}')
        if not (C.is_pow2(self.copy_unroll) and self.copy_unroll <= 8):
            raise ValueError(f"copy_unroll must be a power of 2 up to 8, got {self.copy_unroll}")
        if self.copy_unroll > 1 and self.fill_layout != "warp":
            raise ValueError(f'copy_unroll={self.copy_unroll} is a form of fill_layout="warp" (its scratch copy), '
                             f'got fill_layout={self.fill_layout!r}')
        if self.exit_at_one and self.range_margin is None:
            raise ValueError("exit_at_one needs range_margin (it ends the counting from the pivot)")
        if self.speculate_full and self.splits == 1:
            raise ValueError("speculate_full is a form of the split prefilter (its first loads): it needs splits > 1")
        if self.fine_splits and self.fill_layout != "warp":
            raise ValueError(f'fine_splits is a form of fill_layout="warp" (its parts), got {self.fill_layout!r}')
        if self.copy_spread and self.fill_layout != "warp":
            raise ValueError(f'copy_spread is a form of fill_layout="warp" (its scratch copy), '
                             f'got fill_layout={self.fill_layout!r}')
        if self.fill_warps is not None and not C.is_pow2(self.fill_warps):
            raise ValueError(f"fill_warps must be None or a power of 2, got {self.fill_warps}")
        if self.unroll > 8:
            raise ValueError(f"unroll must be at most 8, got {self.unroll}")
        if not (0 < self.pivot_bits <= 32 and self.pivot_bits % self.bits == 0):
            raise ValueError(f"pivot_bits must be a multiple of bits={self.bits} in 1..32, got {self.pivot_bits}")
        if self.hist_block >= 1 << 15:  # the compaction packs two per-block counts <= hist_block into one int32
            raise ValueError(f"hist_block must be < 32768, got {self.hist_block}")
        if self.capacity is not None and self.capacity < 0:
            raise ValueError(f"capacity must be >= 0 or None, got {self.capacity}")
        if self.range_margin is not None and not 0 <= self.range_margin <= 8:
            raise ValueError(f"range_margin must be None or in 0..8, got {self.range_margin}")
        if self.range_top_sigma is not None:
            if self.range_margin is None:
                raise ValueError("range_top_sigma needs range_margin (it sets the top of the counting's range)")
            if not 0 <= self.range_top_sigma <= 16:
                raise ValueError(f"range_top_sigma must be None or in [0, 16], got {self.range_top_sigma}")
        if self.zero_band is not None:
            if not self.split_finish:
                raise ValueError("zero_band needs split_finish (it changes the split finish's first pass)")
            if isinstance(self.zero_band, bool) or not 1 <= self.zero_band <= 32:
                raise ValueError(f"zero_band must be None or an int in 1..32, got {self.zero_band!r}")
        if not (0 < self.range_top_bits <= 32 and self.range_top_bits % self.bits == 0):
            raise ValueError(f"range_top_bits must be a multiple of bits={self.bits} in 1..32, "
                             f"got {self.range_top_bits}")
        if self.split_finish and self.range_margin is None:
            raise ValueError("split_finish needs range_margin (its first pass counts from the pivot)")
        if self.hold_bucket and self.hold_bucket_head:
            raise ValueError("hold_bucket holds the whole bucket; hold_bucket_head its first block: one of them")
        for name in ("hold_bucket", "hold_bucket_head", "fuse_bucket"):
            if getattr(self, name) and not self.split_finish:
                raise ValueError(f"{name} needs split_finish (it changes the split finish's bucket)")
        if not (C.is_pow2(self.bucket_blocks) and self.bucket_blocks <= 8):
            raise ValueError(f"bucket_blocks must be a power of 2 up to 8, got {self.bucket_blocks}")
        if self.bucket_resolutions not in (1, 2, 3):
            raise ValueError(f"bucket_resolutions must be 1, 2 or 3, got {self.bucket_resolutions}")
        if self.range_margin is not None and self.range_margin + 2 - self.bucket_resolutions < 0:
            raise ValueError(f"bucket_resolutions={self.bucket_resolutions} needs range_margin >= "
                             f"{self.bucket_resolutions - 2} (its coarsest first pass), got {self.range_margin}")

    def bucket_margins(self) -> tuple[int, ...]:
        """The split finish's first-pass margins, coarsest first (``bucket_resolutions``)."""
        top = (self.range_margin or 0) + 1
        return tuple(range(top + 1 - self.bucket_resolutions, top + 1))

    def buffer_capacity(self, n: int, k: int) -> int:
        """Candidate buffer length per row for rows of n and this k (0: no prefilter)."""
        cap = (4 * k if n >= 8 * k else 0) if self.capacity is None else self.capacity
        return cap if k <= cap < n and self.sample <= n else 0


def split_for(t: int, n: int, cfg: TopkSelectConfig | None = None, sms: int = 132) -> int:
    """A ``splits`` for [t, n] rows: the largest power of 2 (at most 16) that keeps t x splits programs within
    one wave of ``sms`` and each split at least 4 streaming blocks: 2 for 64 rows, 1 (no split) from 67 rows."""
    cfg = cfg or TopkSelectConfig()
    s = 1
    while s < 16 and t * s * 2 <= sms and n >= s * 2 * 4 * cfg.block:
        s *= 2
    return s


def select_config_for(t: int, n: int, sms: int = 132, split_finish: bool = True) -> TopkSelectConfig:
    """The indexer's config for [t, n] rows (``IndexerKernelConfig.topk_splits=None``): ``split_for``'s splits, and
    where it splits, the loads of 2 blocks issued together, the counting shrunk to one block once few candidates
    remain, 512-key counting / compaction steps (half the steps over the candidate buffers), and a pivot resolved
    to its 16 leading bits (half the sample's counting passes, a third of the prefilter's instructions; its bucket's
    floor keeps a few more candidates). On the H200's timeline (benchmarks/results/topk_knobs_h200_*.json) the
    512-key steps were the fastest of the sets tried at 64 x 64K, 16 x 128K and 16 x 32K, and second at 64 x 128K;
    the 16-bit pivot was faster again at 64 x 64K and 16 x 128K; more programs per row were slower. Holding the
    shrunk block in registers through the finish passes won at all four shapes (topk_knobs_cols_h200_*.json);
    column-only split buffers (the finish reading each key back from the row) lost at all four and were removed.
    The finish's counting from the pivot (range_margin 1) with the prefilter's next loads in flight (prefetch) won
    at all four, full and mixed-length batches (archive/topk_knobs_range_*h200_2026-12-05.json).
    ``split_finish`` (where it splits; ``IndexerKernelConfig.topk_split_finish``): the finish spread over the row's
    split programs, with a 2-block bucket and three first-pass resolutions. On the timeline it was faster than the
    one-program finish at every batch timed in the thirty-eighth session, 5 shapes full and 4 mixed
    (archive/topk_knobs_sf_h200_2026-12-05.json; 64 x 128K in archive/topk_knobs_bucket_h200_2026-12-05.json), and
    in the layers' decode select at 16 x 32K and 16 x 128K, full and mixed, its fourth kernel included
    (archive/kernels_select_h200_2026-12-05_partial.json). 32 x 128K is untimed.
    The prefilter streams a split as one part a warp (``fill_layout="warp"``): its kernel was faster at each of the
    seven shapes timed, full and mixed (at 8 x 128K mixed by less than full), the other kernels unchanged (an H100's
    timeline, fortieth and forty-third sessions: archive/topk_knobs_warp_h100_2026-12-05.json,
    archive/topk_knobs_warp_shapes_h100_2026-12-05.json, archive/topk_knobs_shapes_h100_2026-12-05_partial.json).
    Its scratch copy is spread over every warp of the CTA (``copy_spread``): a mixed batch's short row (its finite keys
    all in one warp's part) then costs the prefilter no more than a full row, where the copy of its own warp's chunks
    a step made it slower (8 x 128K, 16 x 128K, 32 x 32K); on full rows it was level or slightly slower at the six
    shapes timed (an H100's timeline, forty-fourth session: archive/topk_knobs_spread_h100_2026-12-05.json).
    The split finish's first pass counts the keys near zero as one value where the range from the pivot crosses the
    sign (``zero_band``, magnitudes 3 binades under the pivot's or the top's), and with the lengths hint a short
    request's head is cut into the splits a 128-key chunk a warp at a time (``fine_splits``): a decode batch with a
    request of 2500-5000 tokens then ran its top-k 1.7-3.2 us over a full batch's, where the band of 8 binades and the
    counting range's top at a lower sampled key (``range_top_sigma``, the default before) left it 3-9 us over; the
    full batch was 0.3 us faster (an H100's timeline, 8 x 128K and 32 x 32K, forty-sixth session:
    archive/topk_knobs_band_h100_2026-12-05.json). The split finish's counting ends once the k-th key's digit holds
    one key, a masked max then taking it (``exit_at_one``), with the bucket's first block held in registers through
    the passes (``hold_bucket_head``): 1.1-2.3 us faster on full batches and 1.2-3.6 us on mixed ones at 8 x 128K,
    32 x 32K and 64 x 64K, a request of 3000 / 4500 tokens then within 0.5 us of a full batch except 32 x 32K with
    4500 (+1.9) (an H100's timeline, forty-seventh session: topk_knobs_spec_h100_2026-12-05.json)."""
    sp = split_for(t, n, sms=sms)
    if sp == 1:
        return TopkSelectConfig()
    finish = (dict(split_finish=True, bucket_blocks=2, bucket_resolutions=3, zero_band=3, hold_bucket_head=True,
                   exit_at_one=True) if split_finish else {})
    return TopkSelectConfig(splits=sp, unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                            range_margin=1, prefetch=True, fill_layout="warp", copy_spread=True, fine_splits=True,
                            **finish)


def _sample_rank(n: int | jax.Array, k: int, sample: int) -> int | jax.Array:
    """Rank r of the pivot in the sample. About m = sample * k / n sampled keys reach tau; r = m + 4 sqrt(m) + 4
    puts the pivot below tau unless the sample holds >= r of the row's top k, a ~4-sigma event for a sample
    of randomly ordered values (e.g. k = 2048, n = 64K: m = 32, r = 59, ~3.8K candidates expected). A traced n
    (int32 scalar, n >= k: the lengths hint): the same formula in float32 (a rank one off where m + 4 sqrt(m) + 4
    lies within float32's rounding of an integer changes the pivot, never the result)."""
    if isinstance(n, int):
        m = sample * k / n
        return min(sample, math.ceil(m + 4 * math.sqrt(m) + 4))
    m = jnp.float32(sample * k) / n.astype(jnp.float32)
    return jnp.minimum(jnp.ceil(m + 4 * jnp.sqrt(m) + 4).astype(I32), sample)


def _top_rank(n: int | jax.Array, k: int, sample: int, sigma: float) -> int | jax.Array:
    """Rank of the counting range's top in the sample (``TopkSelectConfig.range_top_sigma``): floor(m - sigma
    sqrt(m) - 4), m = sample k / n, at least 1 (1: the sample's largest key). Traced n: the same in float32."""
    if isinstance(n, int):
        m = sample * k / n
        return max(1, math.floor(m - sigma * math.sqrt(m) - 4))
    m = jnp.float32(sample * k) / n.astype(jnp.float32)
    return jnp.maximum(jnp.floor(m - sigma * jnp.sqrt(m) - 4).astype(I32), 1)


def _row_extent(len_ref, row, n: int, k: int, cfg: TopkSelectConfig) -> jax.Array:
    """The columns of ``row`` the split prefilter streams under the ``lengths`` hint (columns from lengths[row] on
    hold -inf): max(lengths[row], k, sample), at most n. From k on because a row's top k may be -inf keys (the
    first of its -inf tail, by column); from ``sample`` on so that the sample's columns stay distinct."""
    ln = jnp.sum(C.load(len_ref, (row + jnp.zeros((1,), I32),), (1,)))
    return jnp.clip(ln, max(k, cfg.sample), n)


# ----- kernel-side pieces ----------------------------------------------------------------------------
Source = tuple[jax.Array | int, Callable[[jax.Array], tuple[jax.Array, jax.Array]]]  # (blocks, block -> (s, col))


Range = tuple[jax.Array, jax.Array, jax.Array]  # (lo, span, shift): keys lo <= u <= lo + span, digit (u - lo) >> shift


def _bitlen(x: jax.Array) -> jax.Array:
    """Significant bits of x read as uint32 (0 for 0)."""
    return 32 - lax.clz(x)


def _whole_range(bits: int) -> Range:
    """Every key: the plain radix select, the leading ``bits`` of u first."""
    return jnp.zeros((), I32), jnp.full((), -1, I32), jnp.full((), 32 - bits, I32)


def _pivot_range(piv_u: jax.Array, hi_u: jax.Array, bits: int, margin: int) -> Range:
    """Keys at or above the pivot, the first digits 2^-(bits + margin) of the span from the pivot to ``hi_u`` (the
    range's top, ``_sample_pivot``) each; keys past the last digit's bucket count in it (``_kth_key`` clamps the
    digit). The shift stays below what the whole span needs, and at least 1 where the span is 2^31 or more (a digit
    is then always a nonnegative int32)."""
    span = ~piv_u
    need = jnp.maximum(_bitlen(span) - bits, 0)
    return piv_u, span, jnp.minimum(jnp.maximum(_bitlen(hi_u - piv_u) - bits - margin, 1), need)


def _in_range(s: jax.Array, lo: jax.Array, span: jax.Array) -> jax.Array:
    """Where u(s) lies in [lo, lo + span] (uint32): s - (lo ^ SIGN) is u - lo; the compare is unsigned."""
    return ((s - (lo ^ _SIGN)) ^ _SIGN) <= (span ^ _SIGN)


def _range_digit(s: jax.Array, lo: jax.Array, span: jax.Array, shift: jax.Array, nd: int) -> jax.Array:
    """The digit (u - lo) >> shift of keys s in the range, clamped to nd - 1 (keys past the digits' reach count in
    the top one); -1 for keys outside the range (below every digit)."""
    rel = s - (lo ^ _SIGN)  # u - lo
    return jnp.where(_in_range(s, lo, span), jnp.minimum(lax.shift_right_logical(rel, shift), nd - 1), -1)


def _ult(a: jax.Array, b: jax.Array) -> jax.Array:
    """a < b read as uint32."""
    return (a ^ _SIGN) < (b ^ _SIGN)


def _crosses_sign(piv_u: jax.Array, hi_u: jax.Array) -> jax.Array:
    """Where the range from a finite pivot to its top crosses the sign: a negative pivot (u's top bit clear) other
    than -inf (whose row takes the "pivot is tau" path, which counts nothing) under a positive top (bit set)."""
    return (piv_u >= 0) & (hi_u < 0) & (piv_u != _NEG_INF_U)


def _zero_band(piv_u: jax.Array, hi_u: jax.Array, binades: int | None) -> tuple[jax.Array, jax.Array]:
    """(ra, gap) of the split finish's first pass (``TopkSelectConfig.zero_band``), uint32 in int32: the keys u of
    magnitude below w, u in [piv + ra, piv + ra + gap], count as the one value piv + ra. w is a power of 2,
    ``binades`` below the smaller magnitude of the pivot and the range top; (0, 0) where the range does not cross
    the sign (a negative, finite pivot under a positive top) or ``binades`` is None: every key itself."""
    zero = jnp.zeros((), I32)
    if binades is None:
        return zero, zero
    cross = _crosses_sign(piv_u, hi_u)
    mag = jnp.minimum(~piv_u & 0x7FFFFFFF, hi_u & 0x7FFFFFFF)
    bw = lax.shift_left(jnp.maximum(lax.shift_right_logical(mag, 23) - binades, 0), 23)  # w's bits
    return jnp.where(cross, ~(bw | _SIGN) - piv_u, zero), jnp.where(cross, 2 * bw + 1, zero)  # u(-w) - piv, width


def _band_rel(rel: jax.Array, ra: jax.Array, gap: jax.Array) -> jax.Array:
    """u - piv in the first pass's coordinates (``_zero_band``): less the band's width past its start."""
    past = jnp.where(_ult(rel, ra), 0, rel - ra)
    return rel - jnp.where(_ult(past, gap), past, gap)


def _band_start(piv_u: jax.Array, hi_u: jax.Array, bits: int, margin: int, ra: jax.Array, gap: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """(span, shift) of the first pass with the zero band: ``_pivot_range``'s, over the band's coordinates."""
    span = ~piv_u - gap
    need = jnp.maximum(_bitlen(span) - bits, 0)
    return span, jnp.minimum(jnp.maximum(_bitlen(_band_rel(hi_u - piv_u, ra, gap)) - bits - margin, 1), need)


def _band_digit(s: jax.Array, piv_u: jax.Array, span: jax.Array, shift: jax.Array, ra: jax.Array, gap: jax.Array,
                nd: int) -> jax.Array:
    """``_range_digit`` of keys s over the band's coordinates (every key >= the pivot is in range)."""
    rel = s - (piv_u ^ _SIGN)  # u - piv
    return jnp.where(_in_range(s, piv_u, ~piv_u),
                     jnp.minimum(lax.shift_right_logical(_band_rel(rel, ra, gap), shift), nd - 1), -1)


def _band_bucket(piv_u: jax.Array, span: jax.Array, shift: jax.Array, sel: jax.Array, bits: int, ra: jax.Array,
                 gap: jax.Array) -> Range:
    """Digit ``sel``'s bucket of a zero-band first pass as a range of u (the band's preimage: a bucket reaching
    the band's value holds the whole band), the next passes' start."""
    flo, fspan, _ = _next_range(jnp.zeros((), I32), span, shift, sel, bits, grow=False)
    fhi = flo + fspan
    lo = jnp.where(_ult(ra, flo), flo + gap, flo)
    hi = jnp.where(_ult(fhi, ra), fhi, fhi + gap)
    return piv_u + lo, hi - lo, jnp.maximum(_bitlen(hi - lo) - bits, 0)


_PACKED_FIELDS = 8  # 4-bit digit counters in an int32 word
_PACKED_KEYS = 15  # keys a lane may add to one 4-bit counter
_SAMPLE_BLOCK = 256  # the sample pivot's block with packed counts


def _pack_digit(words: tuple[jax.Array, ...], dig: jax.Array) -> tuple[jax.Array, ...]:
    """Add each lane's key to its packed counter of digit ``dig`` (-1: none): word dig // 8, field dig % 8."""
    inc = lax.shift_left(jnp.ones_like(dig), lax.shift_left(dig & (_PACKED_FIELDS - 1), 2))
    word = lax.shift_right_arithmetic(dig, 3)  # -1 for no digit: no word
    return tuple(w + jnp.where(word == i, inc, 0) for i, w in enumerate(words))


def _count_steps(steps: jax.Array | int, step_digits: Callable[[jax.Array], list[tuple[jax.Array, ...]]],
                 accs: tuple[jax.Array, ...], nd: int, packed: bool, keys_per_step: int = 1, fields: bool = True
                 ) -> tuple[jax.Array, ...]:
    """Add ``steps`` steps' keys to per-lane counters ``accs`` ([nd, width] each): ``step_digits(i)`` gives step
    i's keys, one digit array [1, width] per counter for each (-1: no digit). Plain: counts of digits >= d. Packed
    (``TopkSelectConfig.packed_counts``): counts of each digit value (``_at_or_above`` turns their sums into the
    former), kept in 4-bit fields (``_pack_digit``) and added to ``accs`` every ``_PACKED_KEYS`` keys a lane, before a
    field could overflow; a static single step of one key a lane, or ``fields=False``, counts straight into
    ``accs``."""
    d = C.iota((nd, 1), 0)

    def direct(i, accs):
        for digs in step_digits(i):
            accs = tuple(a + ((dg == d) if packed else (dg >= d)).astype(I32) for a, dg in zip(accs, digs))
        return accs

    if not packed or not fields or (isinstance(steps, int) and steps * keys_per_step <= 1):
        return lax.fori_loop(0, steps, direct, accs)
    per = max(1, _PACKED_KEYS // keys_per_step)
    empty = (jnp.zeros((1, accs[0].shape[1]), I32),) * pl.cdiv(nd, _PACKED_FIELDS)

    def group(g, accs):
        def body(i, words):
            for digs in step_digits(i):
                words = tuple(_pack_digit(w, dg) for w, dg in zip(words, digs))
            return words
        words = lax.fori_loop(g * per, jnp.minimum(g * per + per, steps), body, (empty,) * len(accs))
        return tuple(a + _unpack_digits(w, nd) for a, w in zip(accs, words))
    return lax.fori_loop(0, pl.cdiv(steps, per), group, accs)


def _held_counts(dig: jax.Array, nd: int, width: int) -> jax.Array:
    """[nd] counts of each digit value over one block of keys, one a lane (``dig`` [1, width], -1: none), summed
    across the lanes as two 16-bit fields a word (digit values 2j, 2j + 1 in word j; width < 2^16 keys, so no carry
    between them): nd / 2 reductions instead of nd, and a select a word a lane instead of a compare and an add per
    digit value. (Triton's tensors take power-of-2 shapes, so three 10-bit fields a word would still reduce 8.)"""
    assert width < 1 << 16
    word = lax.shift_right_arithmetic(dig, 1)  # -1 for no digit: no word
    inc = lax.shift_left(jnp.ones_like(dig), lax.shift_left(dig & 1, 4))
    nw = max(1, nd // 2)
    sums = jnp.sum(jnp.where(C.iota((nw, 1), 0) == word, inc, 0), axis=1)  # [nw]
    d1 = C.iota((nd,), 0)
    mine = jnp.sum(jnp.where(lax.shift_right_logical(d1, 1)[:, None] == C.iota((1, nw), 1), sums[None, :], 0),
                   axis=1)
    return lax.shift_right_logical(mine, lax.shift_left(d1 & 1, 4)) & 0xFFFF


def _at_or_above(h: jax.Array) -> jax.Array:
    """[nd] counts of each digit value -> counts of digits >= each value."""
    d1 = C.iota((h.shape[0],), 0)
    return jnp.sum(jnp.where(d1[None, :] >= d1[:, None], h[None, :], 0), axis=1)


def _unpack_digits(words: tuple[jax.Array, ...], nd: int) -> jax.Array:
    """[nd, width] per-lane counts from ``_pack_digit``'s words."""
    d = C.iota((nd, 1), 0)
    w = words[0]
    for i in range(1, len(words)):
        w = jnp.where(lax.shift_right_logical(d, 3) == i, words[i], w)
    return lax.shift_right_logical(w, lax.shift_left(d & (_PACKED_FIELDS - 1), 2)) & 15


def _next_range(lo: jax.Array, span: jax.Array, shift: jax.Array, sel: jax.Array, bits: int, grow: bool = True
                ) -> Range:
    """The range of digit ``sel``'s keys after a pass: its bucket; the top digit's reaches the range's end. Past a
    clamped top digit (``grow``) the next digits are 2^bits times as wide as this pass's, up to what the rest of the
    range needs, not all of it at once."""
    nd = 1 << bits
    base = lax.shift_left(sel, shift)
    rest, bucket = span - base, lax.shift_left(jnp.ones((), I32), shift) - 1
    clamped = (sel == nd - 1) & (lax.shift_right_logical(span, shift) > nd - 1)
    # any digit but the top one ends at its own width or at the range's end, the smaller (uint32)
    span2 = jnp.where((sel == nd - 1) | ((rest >= 0) & (rest < bucket)), rest, bucket)
    shift2 = jnp.maximum(_bitlen(span2) - bits, 0)
    if grow:
        shift2 = jnp.where(clamped, jnp.minimum(shift2, shift + bits), shift2)
    return lo + base, span2, shift2


def _kth_key(sources: list[Source], k: jax.Array | int, bits: int, width: int, key_bits: int = 32,
             shrink: tuple | None = None, unroll: int = 1, hold: bool = False,
             start: Range | None = None, held: jax.Array | None = None, packed: bool = False, lane: bool = False,
             exit_one: bool = False) -> tuple[jax.Array, jax.Array]:
    """(u of the k-th largest key over all sources' blocks [1, width], need = k - #keys above it). With
    ``key_bits`` < 32, only that many leading bits are resolved: u is then the floor of the k-th largest key's
    bucket (its low bits zero), need is relative to that bucket.

    Each pass counts the candidates (keys in the current range [lo, lo + span], as uint32) by digit
    (u - lo) >> shift, clamped to the top digit; the largest digit at which k' or more candidates lie picks the next
    range (that digit's bucket; the top digit's reaches the range's end), k' drops by the keys above it, and the
    next shift leaves ``bits`` bits of digit for the new span. It stops when the span has no bits left above the
    resolved ones. ``start`` (``_whole_range`` if None) is the first range: from the whole key space this is the
    plain radix select, 32 / bits passes; from ``_pivot_range`` the first pass splits the buffers' candidates finely.
    Where the k-th key lies past the first digits' reach (the clamped top digit), the next digits are 2^bits times
    as wide, up to what the rest of the range needs (``scripts/diag/topk_passes.py`` replays this arithmetic).

    ``shrink`` = (scratch ref [T, >= width], row, T, interpret): after the first pass that leaves at most ``width``
    candidates, they are copied to the scratch row, and the remaining passes count that one block instead of every
    source's blocks. The counts are the same (the later passes count only those keys anyway), so u and need are too.

    ``unroll``: each loop step loads that many of a source's blocks before counting any (``TopkSelectConfig.unroll``);
    blocks past the source's count are no candidates, so the counts are unchanged. Sources must load by block index
    (the sample's one block does not: unroll 1 there).

    ``hold`` (with ``shrink``): the shrunk block is loaded once after its copy and carried in registers through the
    remaining passes (``TopkSelectConfig.hold_shrunk``); its counts are added only once it exists, as the scratch
    row's loop runs only then. ``held`` [1, width]: such a block from the start (the candidates of ``start``'s range,
    padded with _SIGN; the split finish's bucket), counted in every pass beside the sources.

    ``packed`` (``TopkSelectConfig.packed_counts``): a pass counts each digit value's keys (not the keys >= each
    value) and, over a source of several blocks, in 4-bit fields of a few words per lane (``_pack_digit``): a shift
    and an add a key per word instead of a compare and an add per digit value. The sums give the same ge.

    ``lane``: the scratch row's loads take one key a lane (``_lanes``), as the sources' do.

    ``exit_one`` (``TopkSelectConfig.exit_at_one``; a ``start`` and all 32 bits only): once a pass leaves one key in
    the k-th key's digit, that key is the k-th key (and need is 1), so the next pass takes the largest key in the
    range (a masked max over the same blocks) instead of resolving the range's remaining bits digit by digit: about
    2-3 counting passes then the max, against 5-6 counting passes (``scripts/diag/topk_passes.py --short``'s
    replay of the split finish's buckets)."""
    exit_one = exit_one and start is not None and key_bits == 32  # the whole key space: a static pass count
    nd = 1 << bits
    d1 = C.iota((nd,), 0)

    def scratch_keys(count):
        def load(b):
            pos = C.iota((1, width), 1)
            inside = pos < count
            s = C.load(shrink[0], (shrink[1], _lanes(pos, lane)), (1, width), mask=inside)
            return jnp.where(inside, s, _SIGN), pos
        return load

    def digit_pass(carry):
        lo, span, shift, k_rem, shrunk, kept, held, _, _ = carry
        prefix = lax.shift_right_logical(lax.shift_right_logical(lo, shift), bits)  # the radix form's decided bits

        def digit(s):
            """The digit of keys s in the current range, -1 (below every d) for the rest."""
            if radix:  # the whole key space: the decided bits == prefix (the same keys, two ops fewer a key)
                top = lax.shift_right_logical(s ^ _SIGN, shift)
                return jnp.where(lax.shift_right_logical(top, bits) == prefix, top & (nd - 1), -1)
            return _range_digit(s, lo, span, shift, nd)

        def digits(load, n_blocks, u, i):
            keys = [load(i * u + j)[0] for j in range(u)]  # every load issued before the first use
            for j, s in enumerate(keys):
                dig = digit(s)
                if u > 1:  # a block past the source's count (its masked lanes would read as u = 0 keys)
                    dig = jnp.where(i * u + j < n_blocks, dig, -1)
                yield dig

        def step(load, n_blocks, u):
            return lambda i: [(dig,) for dig in digits(load, n_blocks, u, i)]

        def counts_all():
            acc = (jnp.zeros((nd, width), I32),)  # per-lane counters, reduced once per pass
            for n_blocks, load in sources:  # without shrink, the trip counts stay as given (static where they are)
                nb = n_blocks if shrink is None else (1 - shrunk) * n_blocks
                acc = _count_steps(pl.cdiv(nb, unroll), step(load, nb, unroll), acc, nd, packed, unroll)
            if (shrink is not None and hold) or held_from_start:
                acc = (acc[0] + shrunk * _count_steps(1, step(lambda b: (held, None), 1, 1),
                                                      (jnp.zeros_like(acc[0]),), nd, packed)[0],)
            elif shrink is not None:  # 0 or 1 steps: no packed fields
                acc = _count_steps(shrunk, step(scratch_keys(kept), 1, 1), acc, nd, packed, fields=False)
            ge = jnp.sum(acc[0], axis=1)
            return _at_or_above(ge) if packed else ge

        def counts_held():  # the held block alone: its per-digit totals summed in wide fields (_held_counts)
            return _at_or_above(_held_counts(digit(held), nd, width))

        if packed and held_from_start and not sources:
            ge = counts_held()
        elif packed and shrink is not None and hold:  # once shrunk, the sources have no blocks left
            ge = lax.cond(shrunk == 1, counts_held, counts_all)
        else:
            ge = counts_all()
        sel = jnp.sum((ge >= k_rem).astype(I32)) - 1  # ge[0] = all candidates >= k_rem
        above = jnp.sum(jnp.where(d1 == sel + 1, ge, 0))  # candidates with a larger digit
        # past a clamped top digit (a start from the pivot whose k-th key lies above the digits' reach) the digits
        # grow; the whole key space never clamps
        lo, span, nxt_shift = _next_range(lo, span, shift, sel, bits, grow=not radix)
        done = (_bitlen(span) <= 32 - key_bits).astype(I32)
        nxt = jnp.sum(jnp.where(d1 == sel, ge, 0)) - above  # the next pass's candidates: this digit == sel
        one = ((nxt == 1) & (done == 0)).astype(I32) if exit_one else zero
        if shrink is not None:
            go = (1 - shrunk) * (nxt <= width).astype(I32) * (1 - done)

            def copy(load):
                def body(b, put):
                    s = load(b)[0]
                    ki = _in_range(s, lo, span).astype(I32)
                    _scatter(shrink[0], shrink[1], shrink[2], put + jnp.cumsum(ki, axis=1) - ki, s, ki == 1)
                    return put + jnp.sum(ki)
                return body

            put = jnp.zeros((), I32)
            for n_blocks, load in sources:
                put = lax.fori_loop(0, go * n_blocks, copy(load), put)
            if not shrink[3]:
                plt.debug_barrier()  # the scratch's stores -> its loads by other threads of the CTA
            if hold:  # the copied block, loaded once (no lane is loaded on the passes without a copy)
                held = jnp.where(go == 1, scratch_keys(go * nxt)(0)[0], held)
            shrunk, kept = shrunk + go, jnp.where(go == 1, nxt, kept)
        return lo, span, nxt_shift, k_rem - above, shrunk, kept, held, one, done

    def max_pass(carry):
        """``exit_one``: the range's one key (its u) as tau, over the blocks a counting pass would count."""
        lo, span, _, k_rem, shrunk, kept, held, one, _ = carry  # one is 1 here
        low = jnp.full((1, width), jnp.iinfo(jnp.int32).min, I32)

        def fold(acc, s):
            return jnp.maximum(acc, jnp.where(_in_range(s, lo, span), s, low))
        acc = low
        for n_blocks, load in sources:
            nb = n_blocks if shrink is None else (1 - shrunk) * n_blocks
            acc = lax.fori_loop(0, nb, lambda b, a, load=load: fold(a, load(b)[0]), acc)
        if (shrink is not None and hold) or held_from_start:
            acc = jnp.where(shrunk == 1, fold(acc, held), acc)
        elif shrink is not None:
            acc = lax.fori_loop(0, shrunk, lambda b, a: fold(a, scratch_keys(kept)(0)[0]), acc)
        # done = one: a computed value (Triton's cond lowering takes no literal output, which jnp.ones would be)
        return jnp.max(acc) ^ _SIGN, zero, zero, k_rem, shrunk, kept, held, one - one, one

    zero = jnp.zeros((), I32)
    held_from_start = held is not None
    held0 = held if held_from_start else jnp.full((1, width), _SIGN, I32)
    shrunk0 = jnp.ones((), I32) if held_from_start else zero
    radix = start is None
    if radix:  # the whole key space: a static number of passes (a dynamic one took the registers of a spill)
        out = lax.fori_loop(0, key_bits // bits, lambda p, c: digit_pass((*c, zero, zero))[:-2],
                            (*_whole_range(bits), jnp.asarray(k, I32), shrunk0, zero, held0))
    else:
        body = (lambda c: lax.cond(c[-2] == 1, max_pass, digit_pass, c)) if exit_one else digit_pass
        out = lax.while_loop(lambda c: c[-1] == 0, body,
                             (*start, jnp.asarray(k, I32), shrunk0, zero, held0, zero, zero))
    return out[0], out[3]


PATHS = ("row", "buffer", "refilled buffer", "pivot is tau", "overflowed buffer")  # select_unsorted's path codes


def _pivot_or_kth(at_pivot: jax.Array, piv_u: jax.Array, need_at_pivot: jax.Array,
                  kth: Callable[[], tuple[jax.Array, jax.Array]], skip: bool) -> tuple[jax.Array, jax.Array]:
    """(tau's u, need): where the pivot is tau, the pivot and the keys at it the row keeps, else ``kth``'s counting.
    ``skip``: such rows do not run the counting passes. A short request's -inf tail has no blocks to count, but the
    passes still run: 8 from the whole key space, each a CTA reduction and barrier; beside the split finish's fast
    rows that set a mixed batch's time on the H200 (its finish slower than a full batch's at 16 x 32K,
    benchmarks/results/archive/topk_knobs_bucket_h200_2026-12-05.json), so the split finish skips them. The other
    finishes run each row in its own program beside full rows' longer counting, and keep their measured code."""
    if skip:
        return lax.cond(at_pivot, lambda: (piv_u, jnp.asarray(need_at_pivot, I32)), kth)
    tau_u, need = kth()
    return jnp.where(at_pivot, piv_u, tau_u), jnp.where(at_pivot, need_at_pivot, need)


def _lanes(idx: jax.Array, lane: bool) -> jax.Array:
    """A load's column index; with ``lane``, passed through an identity Triton cannot see through (a PTX move), so
    that nothing is known of its contiguity: the load then takes one key a lane per instruction, the layout of the
    scatter stores it feeds (``TopkSelectConfig.fill_layout``). Not ``max_contiguous``: its hint sits on the
    index's defining op, which the canonicalizer folds away where the index is x + 0 (split 0's buffer), and one
    vectorisable load of the same shape anywhere in a kernel widens them all (Triton's coalescing takes the widest
    of the related loads). Native only: interpret mode runs no PTX (and has no layouts)."""
    if not lane:
        return idx
    return plt.elementwise_inline_asm("mov.b32 $0, $1;", args=[idx], constraints="=r,r", pack=1,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(idx.shape, idx.dtype)])[0]


def _row_keys(x_ref, row, n: int, lane: bool = False, groups: int = 1) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """(block b, width[, end]) -> (s, column) of the row's keys; padding lanes past n (and past column ``end``,
    unloaded) get s = _SIGN. [1, width], or with ``groups`` g > 1 [g, width / g] holding column b width + g c + r at
    [r, c] (``TopkSelectConfig.fill_layout="group"``). ``lane``: one key a lane per load (``_lanes``)."""
    def x_keys(b, width, end=None):
        col = _block_cols(b, width, groups)
        shape = col.shape
        inside = col < n if end is None else (col < n) & (col < end)
        return _key_s(C.load(x_ref, (row, _lanes(col, lane)), shape, mask=inside, other=-1)), col
    return x_keys


def _key_s(xb: jax.Array) -> jax.Array:
    """s (the order-preserving signed key) of float32 bits ``xb`` (int32): a shift and one three-input logic op a
    key. Bits -1 (the kernels' masked-load value; a NaN's) give ``_SIGN``, below every other key, so a masked lane
    needs no select of its own."""
    return xb ^ (lax.shift_right_arithmetic(xb, 31) & 0x7FFFFFFF)


def _block_cols(b, width: int, groups: int = 1) -> jax.Array:
    """Columns of block b (``width`` keys): [1, width], or [g, width / g] with column b width + g c + r at [r, c]."""
    shape = (groups, width // groups)
    return b * width + groups * C.iota(shape, 1) + C.iota(shape, 0)


def _col_prefix(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(inclusive prefix sums of a block's values in column order, the block's total): along a [1, w] block's row;
    over a [g, w / g] block (column g c + r at [r, c], ``_row_keys``' groups) along each group first (a lane's own
    keys), then over the groups' totals (one scan of w / g values). The total of a grouped block sums those group
    totals, one value a column: summing the [g, w / g] block itself reduced g values a lane across the CTA."""
    if v.shape[0] == 1:
        return jnp.cumsum(v, axis=1), jnp.sum(v)
    tot = jnp.sum(v, axis=0, keepdims=True)
    return jnp.cumsum(v, axis=0) + (jnp.cumsum(tot, axis=1) - tot), jnp.sum(tot)


def _fill_keys(x_ref, row, n: int, cfg: TopkSelectConfig, interpret: bool
               ) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The prefilter's row keys in its ``fill_layout``."""
    groups = 4 if cfg.fill_layout == "group" else 1
    return _row_keys(x_ref, row, n, cfg.fill_layout == "lane" and not interpret, groups)


def _sample_keys(x_ref, row, n: int | jax.Array, cfg: TopkSelectConfig) -> list[jax.Array]:
    """The prefilter's sample: ``cfg.sample`` evenly spaced keys of the row's first ``n`` columns, as blocks."""
    s_n = cfg.sample
    # with packed counts, the sample as blocks of 256 keys held in registers: each lane then counts several keys,
    # through the packed fields, and the per-pass reduction is over 256 lanes, not the whole sample
    w = _SAMPLE_BLOCK if cfg.packed_counts and s_n > _SAMPLE_BLOCK else s_n
    return [_key_s(C.load(x_ref, (row, lax.div((b * w + C.iota((1, w), 1)) * n, s_n)), (1, w)))  # distinct: s_n <= n
            for b in range(s_n // w)]


def _speculated(full: bool | jax.Array, at_full: Callable[[], Any], own: Callable[[], Any]) -> Any:
    """``TopkSelectConfig.speculate_full``: ``at_full()``'s loads (a full row's columns, independent of the row's
    length) issued now; where the row is not ``full``, ``own()``'s in a branch instead. Static ``full``: one of them."""
    if isinstance(full, bool):
        return at_full() if full else own()
    spec = at_full()
    return lax.cond(full, lambda: spec, own)


def _sample_pivot(x_ref, row, n: int | jax.Array, k: int, cfg: TopkSelectConfig,
                  xs: list[jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """(u of the prefilter's pivot: the ``_sample_rank``-th largest key of ``cfg.sample`` evenly spaced keys of the
    row's first ``n`` columns (a traced n: the row's ``lengths`` hint, ``_row_extent``); u of the counting range's
    top where ``cfg.range_margin`` is set, else 0: the sample's largest key, or with ``range_top_sigma`` and a range
    across the sign, the top of the ``_top_rank``-th key's bucket).

    With ``pivot_bits`` < 32 that key is resolved only to its bucket, and the pivot is the smallest sampled key
    in the bucket or above its floor: still at most the exact rank's key (so no fewer candidates), and always a
    key of the row. Why: a short row's sampled pivot is its -inf tail, and the "pivot is tau" path needs the
    pivot to be that value. The bucket's floor lies below -inf, every -inf key counted as above it, and such
    a row streamed its whole length through the counting passes instead (the H200's mixed select batches:
    benchmarks/results/archive/kernels_select_h200_2026-12-04_before_pivot_fix.json). ``xs``: the sample
    (``_sample_keys``) where the caller loaded it."""
    s_n = cfg.sample
    xs = _sample_keys(x_ref, row, n, cfg) if xs is None else xs
    nb, w = len(xs), xs[0].shape[1]

    def block(b):  # b is 0 .. nb - 1 (the one step of an nb-block unroll)
        return functools.reduce(lambda acc, j: jnp.where(b == j, xs[j], acc), range(1, nb), xs[0]), None

    floor_u = _kth_key([(nb, block)], _sample_rank(n, k, s_n), cfg.bits, w, cfg.pivot_bits, unroll=nb,
                       packed=cfg.packed_counts)[0]
    hi_u = functools.reduce(jnp.maximum, [jnp.max(x) for x in xs]) ^ _SIGN
    hi_u = hi_u if cfg.range_margin is not None else jnp.zeros((), I32)
    if cfg.pivot_bits == 32:
        piv_u = floor_u
    else:
        floor_s = floor_u ^ _SIGN
        big = jnp.iinfo(jnp.int32).max
        piv_u = functools.reduce(jnp.minimum, [jnp.min(jnp.where(x >= floor_s, x, big)) for x in xs]) ^ _SIGN
    if cfg.range_margin is not None and cfg.range_top_sigma is not None:
        top = _top_rank(n, k, s_n, cfg.range_top_sigma)
        low = (1 << (32 - cfg.range_top_bits)) - 1 if cfg.range_top_bits < 32 else 0

        def ranked():  # the top-rank key's bucket's top: at least that key, so at least the pivot
            return _kth_key([(nb, block)], top, cfg.bits, w, cfg.range_top_bits, unroll=nb,
                            packed=cfg.packed_counts)[0] | low
        # only where the range crosses the sign; a static rank of 1 (rows of n >= about 64 k: m <= 32) is the
        # sample's largest key already
        if not (isinstance(top, int) and top <= 1):
            hi_u = lax.cond(_crosses_sign(piv_u, hi_u) & (top > 1), ranked, lambda hi_u=hi_u: hi_u)
    return piv_u, hi_u


def _counting_start(cfg: TopkSelectConfig, use_buf: jax.Array, piv_u: jax.Array, hi_u: jax.Array) -> Range | None:
    """The counting passes' first range (``TopkSelectConfig.range_margin``): from the pivot where they read the
    candidate buffers (every candidate is >= the pivot there), the whole key space where they read the row."""
    if cfg.range_margin is None:
        return None
    return tuple(jnp.where(use_buf, p, w) for p, w in zip(_pivot_range(piv_u, hi_u, cfg.bits, cfg.range_margin),
                                                            _whole_range(cfg.bits)))


def _scatter(ref, row, t: int | None, slot: jax.Array, val: jax.Array, ok: jax.Array) -> None:
    """Masked store of ``val`` at [row, slot] where ``ok``. In interpret mode (``t`` = the rows) masked-out lanes
    point one past the first axis, which it drops; natively (``t`` None) the mask alone keeps them from memory, and
    the plain index saves the two selects and the wider address arithmetic a key they cost in the fill's loop."""
    if t is None:
        C.store(ref, (row, slot), val, ok)
    else:
        C.store(ref, (jnp.where(ok, row, t), jnp.where(ok, slot, 0)), val, ok)


_NEG_INF_U = 0x007FFFFF  # u of -inf: below it only padding (u = 0) and no float
_NEG_INF_S = _NEG_INF_U ^ _SIGN  # its s


def _strict_fill(piv_u: jax.Array) -> jax.Array:
    """1 where the row's pivot is -inf, else 0: the prefilter then fills with the keys above -inf only.

    Why: a sampled -inf pivot is a row whose sample is mostly -inf (a short request in a wide decode batch). Every
    key is >= -inf, so a fill of keys >= pivot packs the buffers with the -inf tail, and where k or more finite
    keys exist ("overflowed buffer") the counting passes streamed those buffers, the whole row's worth. Nothing is
    lost by leaving -inf out: with fewer than k finite keys tau is -inf ("pivot is tau", which every key >= -inf
    makes valid, the buffers overflowed or not) and the compaction reads the row; with k or more they are all
    the candidates there are. On the H200 such a request took a batch's select to up to twice a full batch's
    time before (benchmarks/results/topk_mixed_h200_2026-12-04.json, the ``_mixed3000`` rows)."""
    return (piv_u == _NEG_INF_U).astype(I32)


def _fill(x_keys, first_block, n_blocks, piv, cap: int, width: int, strict: bool | jax.Array, put: Callable,
          unroll: int = 1, prefetch: bool = False, first: list[jax.Array] | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The prefilter's streaming pass over blocks ``first_block .. first_block + n_blocks - 1``: keys >= ``piv``
    (> with ``strict``) go in column order to buffer slots < ``cap`` (``put(slot, s, col, ok)``). Returns (keys
    kept or counted, keys > piv, keys > piv that landed in the buffer). The first two counts are packed in one int32 per
    key (kept + (above << 16)), so that one scan gives the slots and one CTA reduction both block counts; the third
    is counted lane by lane only in the block that fills the buffer. Per-lane counters for the other two cost more
    instructions a step and registers (pip triton's SASS for sm_90a, ``scripts/diag/triton_sass.py``).
    ``unroll`` blocks are loaded per step before any is used; one past ``n_blocks`` (another split's, or past the
    row) reads as keys below every pivot. ``strict`` may be an int32 0 / 1 decided per row (``_strict_fill``):
    then the fill keeps keys >= piv + strict, one compare a key either way.

    ``prefetch`` (``TopkSelectConfig.prefetch``): each step issues the next step's loads before using its own, which
    the previous step loaded (its keys carried in registers), so two steps' blocks are in flight; loads past the
    pass's last block are masked out (no memory traffic). ``first``: the first step's keys, loaded by the caller
    (``_step_keys``) before other work, e.g. the sample pivot, so that they are in flight during it. Blocks are
    ``x_keys``' shape: [1, width] or column groups (``_row_keys``; the slots' prefix by ``_col_prefix``)."""
    lo = piv + strict if isinstance(strict, jax.Array) else None
    end = (first_block + n_blocks) * width

    def step(i, carry, blocks):
        filled, above, above_in = carry
        for j, (s, col) in enumerate(blocks):
            if unroll > 1 and not prefetch:  # prefetched loads are masked at the pass's end column already
                s = jnp.where(i * unroll + j < n_blocks, s, _SIGN)
            ki = ((s >= lo) if lo is not None else (s > piv) if strict else (s >= piv)).astype(I32)
            gt = (s > piv).astype(I32)
            both = ki + lax.shift_left(gt, 16)  # one scan and one reduction count both (each <= width < 2^16)
            prefix, tot = _col_prefix(both)
            slot = filled + (prefix & 0xFFFF) - ki
            ok = (ki == 1) & (slot < cap)
            put(slot, s, col, ok)
            n_ki, n_gt = tot & 0xFFFF, lax.shift_right_logical(tot, 16)
            # the keys > piv that landed: all of the block's while the buffer has room for every key it keeps, none
            # once it is full; only the block that fills it counts them lane by lane
            landed = lax.cond((filled < cap) & (filled + n_ki > cap),
                              lambda: jnp.sum(gt * ok.astype(I32)),
                              lambda: jnp.where(filled + n_ki <= cap, n_gt, 0))
            filled, above, above_in = filled + n_ki, above + n_gt, above_in + landed
        return filled, above, above_in

    def cols(i, j, groups):
        return _block_cols(first_block + i * unroll + j, width, groups)

    init = (jnp.zeros((), I32),) * 3
    steps = pl.cdiv(n_blocks, unroll)
    if not prefetch:
        def body(i, carry):  # the loads first
            return step(i, carry, [x_keys(first_block + i * unroll + j, width) for j in range(unroll)])
        filled, above, above_in = lax.fori_loop(0, steps, body, init)
    else:
        def body(i, carry):
            nxt = _step_keys(x_keys, first_block, i + 1, unroll, width, end)  # issued before this step's work
            return (*step(i, carry[:3], [(s, cols(i, j, s.shape[0])) for j, s in enumerate(carry[3:])]), *nxt)
        if first is None:
            first = _step_keys(x_keys, first_block, 0, unroll, width, end)
        filled, above, above_in, *_ = lax.fori_loop(0, steps, body, (*init, *first))
    return filled, above, above_in


def _step_keys(x_keys, first_block, i, unroll: int, width: int, end) -> list[jax.Array]:
    """The keys (s) of a fill's step ``i``: ``unroll`` blocks from ``first_block``, masked at column ``end``."""
    return [x_keys(first_block + i * unroll + j, width, end)[0] for j in range(unroll)]


def _warp_room(cap: int, n: int, cfg: TopkSelectConfig) -> int:
    """fill_layout="warp": each warp's scratch buffer (keys): half the split's buffer, or a warp's whole part where
    that is less (a part holds no more keys than columns). A warp whose part holds more keys at or above the pivot
    than this makes its program fill the split's buffer again the CTA-wide way (``_warp_fill``)."""
    part = pl.cdiv(pl.cdiv(n, cfg.block), cfg.splits) * cfg.block // (cfg.fill_warps or cfg.num_warps)
    return min(cap // 2, part)


def _warp_cols(base: jax.Array, w_len: jax.Array, c, nw: int) -> jax.Array:
    """fill_layout="warp": the columns [4, nw, 32] of chunk ``c`` of every warp's part: warp w's part starts at
    ``base + w w_len``, and lane l holds the chunk's 4 consecutive keys 128 c + 4 l + r at [r, w, l]. That is the
    layout Triton gives the shape by default (a warp a row of dim 1, the lanes along dim 2, dim 0 in registers)
    and the one its coalescing gives the 16-byte loads, so no conversion moves the keys between warps."""
    shape = (_CHUNK // 32, nw, 32)
    return base + C.iota(shape, 1) * w_len + c * _CHUNK + C.iota(shape, 2) * (_CHUNK // 32) + C.iota(shape, 0)


@dataclasses.dataclass(frozen=True)
class _WarpPass:
    """fill_layout="warp": the split's blocks ``first_block ..`` (of ``unit`` columns: a block, or with
    ``fine_splits`` a chunk a warp) cut into ``nw`` equal consecutive parts, one a warp, streamed ``per`` 128-key
    chunks a warp a step."""
    x_ref: Any
    row: jax.Array
    n: int  # the row's keys
    first_block: jax.Array  # the split's units (CTA-wide, as _fill takes them: the refill's)
    n_blocks: jax.Array
    unit: int  # columns a unit
    nw: int
    per: int  # chunks a warp a step
    chunks: jax.Array  # a warp's chunks
    base: jax.Array  # the split's first column
    w_len: jax.Array  # a warp's part (columns)
    end: jax.Array  # the split's end column (or the row's)

    @classmethod
    def of(cls, x_ref, row, n: int, first_block: jax.Array, n_blocks: jax.Array, cfg: TopkSelectConfig,
           nw: int, unit: int | None = None) -> "_WarpPass":
        unit = unit or cfg.block
        per_unit = unit // (_CHUNK * nw)  # chunks a warp a unit
        base = first_block * unit
        return cls(x_ref, row, n, first_block, n_blocks, unit, nw, cfg.unroll * (cfg.block // (_CHUNK * nw)),
                   n_blocks * per_unit, base, n_blocks * (unit // nw), jnp.minimum(base + n_blocks * unit, n))

    @property
    def shape(self) -> tuple[int, int, int]:
        return (_CHUNK // 32, self.nw, 32)

    def steps(self) -> jax.Array:
        return pl.cdiv(self.chunks, self.per)

    def cols(self, c) -> jax.Array:
        return _warp_cols(self.base, self.w_len, c, self.nw)

    def keys(self, c) -> jax.Array:
        """Chunk ``c`` of every warp: s, _SIGN past the part or the row (unloaded)."""
        col = self.cols(c)
        inside = (col < self.end) & (c < self.chunks)
        return _key_s(C.load(self.x_ref, (self.row, col), self.shape, mask=inside, other=-1))

    def step_keys(self, i) -> list[jax.Array]:
        return [self.keys(i * self.per + u) for u in range(self.per)]


def _warp_fill(wp: _WarpPass, piv: jax.Array, strict: jax.Array, cap: int, cfg: TopkSelectConfig, put: Callable,
               put_warp: Callable, get_warp: Callable, first: list[jax.Array] | None, interpret: bool
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``_fill``'s pass and counts in fill_layout="warp" (``_WarpPass``): each warp streams its part into its own
    scratch buffer of ``_warp_room`` keys (``put_warp(slot in the warps' scratch, s, col, ok)``, read back by
    ``get_warp(slot, mask) -> (s, col)``). A chunk's slots are the warp's count so far plus a prefix within the
    lane and one warp scan; its counts one warp reduction. After the pass the warps' buffers, in warp order, hold
    the split's keys >= pivot in column order: their first ``cap`` go to the split's buffer (``put``), as
    ``_fill`` leaves it. Where a warp's part held more than its room, the pass runs again as ``_fill``.
    ``first``: the first step's keys, loaded before the sample pivot (``TopkSelectConfig.prefetch``)."""
    room = _warp_room(cap, wp.n, cfg)
    nw, shape = wp.nw, wp.shape
    warp = C.iota((1, nw, 1), 1)
    lo = piv + strict

    def step(i, carry, blocks):
        fw, aw = carry  # [1, nw, 1]: each warp's keys kept (or counted past its room), and above the pivot
        for u, sk in enumerate(blocks):
            col = wp.cols(i * wp.per + u)
            ki = (sk >= lo).astype(I32)
            both = ki + lax.shift_left((sk > piv).astype(I32), 16)  # as _fill: both counts in one scan
            lane_tot = jnp.sum(both, axis=0, keepdims=True)
            prefix = jnp.cumsum(both, axis=0) + jnp.cumsum(lane_tot, axis=2) - lane_tot  # within the warp
            slot = fw + (prefix & 0xFFFF) - ki
            put_warp(warp * room + slot, sk, col, (ki == 1) & (slot < room))
            tot = jnp.sum(lane_tot, axis=2, keepdims=True)
            fw, aw = fw + (tot & 0xFFFF), aw + lax.shift_right_logical(tot, 16)
        return fw, aw

    init = (jnp.zeros((1, nw, 1), I32),) * 2
    if cfg.prefetch:
        def body(i, carry):
            nxt = wp.step_keys(i + 1)  # issued before this step's work
            return (*step(i, carry[:2], carry[2:]), *nxt)
        fw, aw, *_ = lax.fori_loop(0, wp.steps(), body, (*init, *(first if first is not None else wp.step_keys(0))))
    else:
        fw, aw = lax.fori_loop(0, wp.steps(), lambda i, carry: step(i, carry, wp.step_keys(i)), init)
    if not interpret:
        plt.debug_barrier()  # the warps' scratch stores -> the copy's loads by other lanes
    lost = jnp.max(fw) > room
    filled, above = jnp.sum(fw), jnp.sum(aw)
    fill_w = jnp.minimum(fw, room)
    off = jnp.cumsum(fill_w, axis=1) - fill_w  # each warp's first slot in the split's buffer

    cu = cfg.copy_unroll
    in_chunk = C.iota(shape, 2) * (_CHUNK // 32) + C.iota(shape, 0)  # lane l's 4 keys at 4 l + r of a chunk
    filled_in = jnp.sum(fill_w)  # the warps' kept keys (within their rooms)
    # copy_spread: slot g of the split's buffer (warp w's 128 of each CTA-wide step) comes from the warp whose slots
    # [end of the warp before, its end) hold it; the warps' ends as scalars, one reduction each
    ends = [jnp.sum(jnp.where(warp <= j, fill_w, 0)) for j in range(nw - 1)] if cfg.copy_spread else []

    def moves(c):
        """Step piece c's (slot in the split's buffer, slot in the warps' scratch, loaded, stored) per lane."""
        if not cfg.copy_spread:  # chunk c of each warp's own scratch, after the warps before it
            at = c * _CHUNK + in_chunk
            return off + at, warp * room + at, at < fill_w, (at < fill_w) & (off + at < cap)
        g = (c * nw + warp) * _CHUNK + in_chunk
        src, start = jnp.zeros(shape, I32), jnp.zeros(shape, I32)
        for e in ends:
            past = g >= e
            src, start = src + past.astype(I32), jnp.where(past, e, start)
        return g, src * room + g - start, g < filled_in, g < jnp.minimum(filled_in, cap)

    def copy(i, acc):  # cu pieces a step: a chunk of every warp's scratch, or (copy_spread) 128 slots a warp
        ms = [moves(i * cu + u) for u in range(cu)]
        got = [get_warp(src, loaded) for _, src, loaded, _ in ms]  # every load before the first store
        for (dst, _, _, ok), (sk, col) in zip(ms, got):
            # the stores' slots through _lanes: their contiguity known, Triton gives them a layout of its own (one key
            # a lane, lanes along the 4 consecutive keys) and converts the keys to it through shared memory
            put(_lanes(dst, not interpret), sk, col, ok)
            acc = acc + ((sk > piv) & ok).astype(I32)
        return acc

    if cfg.copy_spread:
        rounds = pl.cdiv(jnp.minimum(filled_in, cap), _CHUNK * nw * cu)
    else:
        rounds = pl.cdiv(jnp.max(fill_w), _CHUNK * cu)
    above_in = jnp.sum(lax.fori_loop(0, jnp.where(lost, 0, rounds), copy, jnp.zeros(shape, I32)))
    # a warp past its room: the CTA-wide pass instead (its counts are the same; it fills the buffer itself)
    again = _fill(_row_keys(wp.x_ref, wp.row, wp.n), wp.first_block, lost.astype(I32) * wp.n_blocks, piv, cap,
                  wp.unit, strict, put, cfg.unroll, cfg.prefetch)
    return filled, above, jnp.where(lost, again[2], above_in)


def _compact(sources: list[Source], tau: jax.Array, need: jax.Array, k: int | jax.Array, out: Callable,
             unroll: int = 1, neg_inf_col: bool = False) -> None:
    """Step 3 over the sources in column order: keys > tau, and == tau while fewer than ``need`` came before,
    each stored by ``out(slot, col, keep)``. Stops once k keys are kept (none can follow): a row whose pivot is
    tau (a short row's -inf tail) then reads its finite keys and the first -inf ones, not the whole row again.
    ``unroll`` blocks are loaded per step before any is used; one past a source's count keeps nothing.
    ``neg_inf_col`` (``TopkSelectConfig.minus_one_for_neg_inf``): a kept -inf key's column is stored as -1."""
    def run(n_blocks, load, carry):
        def body(c):
            b, eq_seen, kept = c
            blocks = [load(b + j) for j in range(unroll)]  # the loads first
            for j, (s, col) in enumerate(blocks):
                if unroll > 1:
                    s = jnp.where(b + j < n_blocks, s, _SIGN)  # below every tau: neither kept nor equal
                eq = (s == tau).astype(I32)
                keep = (s > tau) | ((eq == 1) & (eq_seen + jnp.cumsum(eq, axis=1) - eq < need))
                ki = keep.astype(I32)
                if neg_inf_col:
                    col = jnp.where(s == _NEG_INF_S, -1, col)
                out(kept + jnp.cumsum(ki, axis=1) - ki, col, keep)
                both = jnp.sum(ki + lax.shift_left(eq, 16))  # one cross-warp reduction for both counts (each <= width)
                eq_seen, kept = eq_seen + lax.shift_right_logical(both, 16), kept + (both & 0xFFFF)
            return b + unroll, eq_seen, kept
        return lax.while_loop(lambda c: (c[0] < n_blocks) & (c[2] < k), body, (jnp.zeros((), I32), *carry))[1:]

    carry = (jnp.zeros((), I32), jnp.zeros((), I32))
    for n_blocks, load in sources:  # in column order; sources without blocks pass
        carry = run(n_blocks, load, carry)


def _select_kernel(x_ref, idx_ref, tau_ref, cand_ref, path_ref, *bufs, n: int, k: int, cfg: TopkSelectConfig,
                   cap: int, interpret: bool) -> None:
    row = pl.program_id(0)
    t = idx_ref.shape[0] if interpret else None  # _scatter: masked-out lanes' index (interpret mode only)
    hb = cfg.hist_block
    shrink = (bufs[-1], row, t, interpret) if cfg.shrink else None  # the scratch row comes last
    row11 = row + jnp.zeros((1, 1), I32)  # [1, 1] index of this row's scalar outputs
    one11 = jnp.ones((1, 1), bool)

    x_keys = _fill_keys(x_ref, row, n, cfg, interpret)  # the prefilter's
    lane = cfg.finish_lane_loads and not interpret
    row_keys = _row_keys(x_ref, row, n, lane)  # the counting's and the compaction's

    from_row: Source = (pl.cdiv(n, hb), lambda b: row_keys(b, hb))
    sources = [from_row]
    if cap:
        bkey_ref, bcol_ref = bufs[:2]
        piv_u, hi_u = _sample_pivot(x_ref, row, n, k, cfg)
        piv = piv_u ^ _SIGN

        def put(slot, s, col, ok):
            _scatter(bkey_ref, row, t, slot, s, ok)
            _scatter(bcol_ref, row, t, slot, col, ok)

        blocks = pl.cdiv(n, cfg.block)
        strict = _strict_fill(piv_u)  # a -inf pivot: the keys above it alone
        filled, above, above_in = _fill(x_keys, 0, blocks, piv, cap, cfg.block, strict, put, cfg.unroll, cfg.prefetch)
        if not interpret:
            plt.debug_barrier()  # the buffer's stores -> its loads by other threads of the CTA
        # More than cap keys at or above the pivot: its value is shared by many keys (the -inf tail of a short
        # row, or a heavy tie). With k to cap keys above it, tau is above the pivot: if every one of them landed
        # in the buffer (a short row's finite head before its -inf tail) the buffer's cap keys hold every key
        # >= tau in column order and serve as they are; else a second pass fills the buffer with those alone.
        # With fewer than k above it, the pivot is tau, and the row goes straight to the compaction; a -inf pivot
        # (filled with the keys above it alone, so never over for its tail) is tau whenever fewer than k are above.
        over = filled > cap
        kept_all = over & (above >= k) & (above_in == above)
        refill = over & (above >= k) & (above <= cap) & (above_in < above)
        at_pivot = (over | (strict == 1)) & (above < k)
        _fill(x_keys, 0, refill.astype(I32) * blocks, piv, cap, cfg.block, True, put, cfg.unroll, cfg.prefetch)
        if not interpret:
            plt.debug_barrier()
        count = jnp.where(refill, above, jnp.minimum(filled, cap))  # keys in the buffer
        use_buf = (count >= k) & ((filled <= cap) | refill | kept_all)
        C.store(cand_ref, (row11,), jnp.full((1, 1), filled, I32), one11)
        code = jnp.where(at_pivot, 3, jnp.where(refill, 2, jnp.where(kept_all, 4, use_buf.astype(I32))))
        C.store(path_ref, (row11,), jnp.full((1, 1), code, I32), one11)

        def buf_keys(b):
            j = b * hb + C.iota((1, hb), 1)
            inside = j < count
            jl = _lanes(j, lane)
            s = C.load(bkey_ref, (row, jl), (1, hb), mask=inside)
            return jnp.where(inside, s, _SIGN), C.load(bcol_ref, (row, jl), (1, hb), mask=inside)

        on = use_buf.astype(I32)  # not jnp.where(use_buf, 0, m): Triton lowered those literals as i1
        piv_on = at_pivot.astype(I32)
        sources = [(on * lax.shift_right_logical(count + hb - 1, C.log2(hb)), buf_keys),
                   ((1 - on) * from_row[0], from_row[1])]
        counted = [sources[0], ((1 - on) * (1 - piv_on) * from_row[0], from_row[1])]
        tau_u, need = _pivot_or_kth(at_pivot, piv_u, k - above, lambda: _kth_key(
            counted, k, cfg.bits, hb, shrink=shrink, unroll=cfg.unroll, hold=cfg.hold_shrunk,
            start=_counting_start(cfg, use_buf, piv_u, hi_u), packed=cfg.packed_counts, lane=lane,
            exit_one=cfg.exit_at_one), skip=False)
    else:
        tau_u, need = _kth_key(sources, k, cfg.bits, hb, shrink=shrink, unroll=cfg.unroll, hold=cfg.hold_shrunk,
                               packed=cfg.packed_counts, lane=lane)
    tau = tau_u ^ _SIGN
    C.store(tau_ref, (row11,), jnp.full((1, 1), tau_u, I32), one11)
    if not cap:
        C.store(cand_ref, (row11,), jnp.full((1, 1), n, I32), one11)
        C.store(path_ref, (row11,), jnp.zeros((1, 1), I32), one11)

    _compact(sources, tau, need, k, lambda slot, col, keep: _scatter(idx_ref, row, t, slot, col, keep), cfg.unroll,
             cfg.minus_one_for_neg_inf)


def _split_fill_kernel(x_ref, *refs, n: int, k: int, cfg: TopkSelectConfig, cap: int, interpret: bool,
                       lengths: bool = False) -> None:
    """Program (row, j): the prefilter's pass over the j-th of ``cfg.splits`` column ranges of the row (whole
    blocks; with ``fine_splits`` and the hint, whole 128-key chunks a warp), keys >= the row's sample pivot into
    buffer j ([row, j cap : (j + 1) cap], column order), and its counts: keys >= pivot, keys > pivot, keys > pivot
    that fit the buffer; the pivot's u for the finish kernel and the counting range's top ([row, 0], [row, 1];
    every program of the row writes the same values). With
    ``hist_ref`` (``split_finish``): its buffer's counts ge[d] of first-pass digits >= d from the pivot, at R =
    ``bucket_resolutions`` resolutions r (``_first_pass``), at [row, (R j + r) nd : (R j + r + 1) nd]. With
    fill_layout="warp" the last two outputs are the warps' scratch buffers (keys, columns; ``_warp_fill``).
    ``lengths`` (the first input after x: int32 [T]): the splits cut the row's first ``_row_extent`` columns, not
    all n, and the row's split width (columns) is the pivot output's third column (the finish's split of the
    bucket's keys)."""
    len_ref, refs = (refs[0], refs[1:]) if lengths else (None, refs)
    key_ref, col_ref, filled_ref, above_ref, in_ref, piv_ref, *extra = refs
    row, j = pl.program_id(0), pl.program_id(1)
    t = key_ref.shape[0] if interpret else None
    hist_ref = extra[:1] if cfg.split_finish else ()
    ne = _row_extent(len_ref, row, n, k, cfg) if lengths else n  # the columns the splits cut
    warp = cfg.fill_layout == "warp"
    nw = cfg.fill_warps or cfg.num_warps
    unit = _CHUNK * nw if warp and lengths and cfg.fine_splits else cfg.block  # columns the splits cut by
    full = (ne == n) if lengths and cfg.speculate_full else not lengths  # the row's extent is n (speculate_full)

    def split_range(e):  # this split's first unit and units over a row extent of e columns
        per = pl.cdiv(pl.cdiv(e, unit), cfg.splits)
        return j * per, jnp.clip(pl.cdiv(e, unit) - j * per, 0, per), per

    first_u, nb, per = split_range(ne)
    if warp:
        wp = _WarpPass.of(x_ref, row, n, first_u, nb, cfg, nw, unit)
        first = _speculated(full, lambda: _WarpPass.of(x_ref, row, n, *split_range(n)[:2], cfg, nw, unit).step_keys(0),
                            lambda: wp.step_keys(0)) if cfg.prefetch else None
    else:
        x_keys = _fill_keys(x_ref, row, n, cfg, interpret)

        def first_keys(e):
            f, b, _ = split_range(e)
            return _step_keys(x_keys, f, 0, cfg.unroll, cfg.block, (f + b) * cfg.block)
        first = _speculated(full, lambda: first_keys(n), lambda: first_keys(ne)) if cfg.prefetch else None
    xs = _speculated(full, lambda: _sample_keys(x_ref, row, n, cfg), lambda: _sample_keys(x_ref, row, ne, cfg))
    piv_u, hi_u = _sample_pivot(x_ref, row, ne, k, cfg, xs)

    def put(slot, s, col, ok):
        _scatter(key_ref, row, t, j * cap + slot, s, ok)
        _scatter(col_ref, row, t, j * cap + slot, col, ok)

    if warp:
        wkey_ref, wcol_ref = extra[-2:]
        w0 = j * nw * _warp_room(cap, n, cfg)  # this program's warps' scratch

        def put_warp(slot, s, col, ok):
            _scatter(wkey_ref, row, t, w0 + slot, s, ok)
            _scatter(wcol_ref, row, t, w0 + slot, col, ok)

        def get_warp(slot, mask):
            return tuple(C.load(r, (row, w0 + slot), slot.shape, mask=mask) for r in (wkey_ref, wcol_ref))

        counts = _warp_fill(wp, piv_u ^ _SIGN, _strict_fill(piv_u), cap, cfg, put, put_warp, get_warp, first,
                            interpret)
    else:
        counts = _fill(x_keys, first_u, nb, piv_u ^ _SIGN, cap, cfg.block, _strict_fill(piv_u), put, cfg.unroll,
                       cfg.prefetch, first)
    if hist_ref:  # the split finish's first pass over this buffer, from the pivot (_first_pass sums the splits')
        if not interpret:
            plt.debug_barrier()  # the buffer's stores -> its loads by other threads of the CTA
        nd, hb = 1 << cfg.bits, min(cfg.hist_block, 256)  # R [nd, hb] counters: 256 keys a step
        fj = jnp.minimum(counts[0], cap)
        if cfg.zero_band is None:
            ranges = [_pivot_range(piv_u, hi_u, cfg.bits, m) for m in cfg.bucket_margins()]

            def digit(s, rg):
                return _range_digit(s, *rg, nd)
        else:
            band = _zero_band(piv_u, hi_u, cfg.zero_band)
            ranges = [_band_start(piv_u, hi_u, cfg.bits, m, *band) for m in cfg.bucket_margins()]

            def digit(s, rg):
                return _band_digit(s, piv_u, *rg, *band, nd)
        nr = len(ranges)

        _, own = _buffer_source(key_ref, col_ref, row, j, fj, cap, hb, jnp.ones((), I32))
        u = cfg.unroll  # blocks loaded per step before any is counted (past the buffer's fill: no key, no digit)

        def step(i):
            keys = [own(i * u + b)[0] for b in range(u)]
            return [tuple(digit(s, rg) for rg in ranges) for s in keys]

        accs = _count_steps(pl.cdiv(fj, hb * u), step, (jnp.zeros((nd, hb), I32),) * nr, nd, cfg.packed_counts, u)
        d1 = C.iota((nd,), 0)
        for r, a in enumerate(accs):
            ge = _at_or_above(jnp.sum(a, axis=1)) if cfg.packed_counts else jnp.sum(a, axis=1)
            C.store(hist_ref[0], (row + jnp.zeros((nd,), I32), (nr * j + r) * nd + d1), ge, jnp.ones((nd,), bool))
    at = (row + jnp.zeros((1, 1), I32), j + jnp.zeros((1, 1), I32))
    for ref, v in zip((filled_ref, above_ref, in_ref), counts):
        C.store(ref, at, jnp.full((1, 1), v, I32), jnp.ones((1, 1), bool))
    for c, v in enumerate((piv_u, hi_u) + ((per * unit,) if lengths else ())):
        C.store(piv_ref, (at[0], jnp.full((1, 1), c, I32)), jnp.full((1, 1), v, I32), jnp.ones((1, 1), bool))


@dataclasses.dataclass
class _RowPlan:
    """The split buffers' counts of a row and what they decide (``_row_plan``)."""
    js: jax.Array  # [1, splits] split ids
    fill: jax.Array  # [1, splits] keys in each buffer
    piv_u: jax.Array
    hi_u: jax.Array
    total: jax.Array  # keys at or above the pivot (all splits)
    total_above: jax.Array  # keys above it
    kept_all: jax.Array  # the buffers serve with the keys at the pivot masked out
    at_pivot: jax.Array  # the pivot is tau
    use_buf: jax.Array  # steps 2-3 read the buffers, not the row
    over: jax.Array

    def fill_of(self, j: int | jax.Array) -> jax.Array:
        """Keys in split ``j``'s buffer (a scalar)."""
        return jnp.sum(jnp.where(self.js == j, self.fill, 0))


def _row_plan(filled_ref, above_ref, in_ref, piv_ref, row, k: int, cap: int, sp: int) -> _RowPlan:
    """The finish's decisions from the prefilter's counts (every finish kernel of a row makes the same ones).

    More keys at or above the pivot than one buffer holds, in one split or in all of them together (a short row's
    -inf tail whose splits each fit their buffer): the pivot's value is shared by many keys, as in the one-kernel
    path; the union then serves only with the keys strictly above the pivot (kept_all)."""
    js = C.iota((1, sp), 1)
    filled, above, above_in = (C.load(r, (row, js), (1, sp)) for r in (filled_ref, above_ref, in_ref))
    total, total_above = jnp.sum(filled), jnp.sum(above)
    piv_u, hi_u = (jnp.sum(C.load(piv_ref, (row + jnp.zeros((1, 1), I32), jnp.full((1, 1), c, I32)), (1, 1)))
                   for c in (0, 1))
    over = (jnp.sum((filled > cap).astype(I32)) > 0) | (total > cap)
    kept_all = over & (total_above >= k) & (jnp.sum((above_in < above).astype(I32)) == 0)
    at_pivot = (over | (_strict_fill(piv_u) == 1)) & (total_above < k)  # a -inf pivot: the fill kept keys above it
    use_buf = ((~over) & (total >= k)) | kept_all
    return _RowPlan(js, jnp.minimum(filled, cap), piv_u, hi_u, total, total_above, kept_all, at_pivot, use_buf, over)


def _split_finish_kernel(x_ref, key_ref, col_ref, filled_ref, above_ref, in_ref, piv_ref, idx_ref, tau_ref,
                         path_ref, *scratch, n: int, k: int, cfg: TopkSelectConfig, cap: int,
                         interpret: bool) -> None:
    """Program row: steps 2-3 over the union of the row's split buffers, or over the row (``_finish_row``)."""
    row = pl.program_id(0)
    plan = _row_plan(filled_ref, above_ref, in_ref, piv_ref, row, k, cap, cfg.splits)
    _finish_row(x_ref, key_ref, col_ref, idx_ref, tau_ref, path_ref, scratch, row, plan, n, k, cfg, cap, interpret)


def _buffer_source(key_ref, col_ref, row, jj: int | jax.Array, fj: jax.Array, cap: int, hb: int, on: jax.Array,
                   piv: jax.Array | None = None, strict: jax.Array | None = None, lane: bool = False) -> Source:
    """Split ``jj``'s buffer of ``fj`` keys as a source of ``hb``-key blocks (none unless ``on``); with ``strict``
    (kept_all) the keys at the pivot ``piv`` are no candidates. ``lane``: one key a lane per load (``_lanes``)."""
    def keys(b):
        i = b * hb + C.iota((1, hb), 1)
        inside = i < fj
        at = _lanes(jj * cap + i, lane)
        s = C.load(key_ref, (row, at), (1, hb), mask=inside)
        keep = inside if strict is None else inside & ((s > piv) | (strict == 0))
        return jnp.where(keep, s, _SIGN), C.load(col_ref, (row, at), (1, hb), mask=inside)
    return on * lax.shift_right_logical(fj + hb - 1, C.log2(hb)), keys


def _finish_row(x_ref, key_ref, col_ref, idx_ref, tau_ref, path_ref, scratch, row, plan: _RowPlan, n: int, k: int,
                cfg: TopkSelectConfig, cap: int, interpret: bool) -> None:
    """Steps 2-3 of one row over the union of its split buffers, or over the row.

    The union holds every key >= tau when at least k keys reached the pivot and at most ``cap`` did (one
    buffer's worth, as in the one-kernel path). Steps 2-3 read the buffers where they are, one source per split in
    split order: the splits are consecutive column ranges and each buffer is in column order, so the sources are
    too (no copy into one buffer first). More than ``cap`` keys at the pivot (``_row_plan``): with k or more above
    it, all in their buffers, the buffers serve with the keys at the pivot masked out (tau is above the pivot);
    with fewer than k above it, the pivot is tau (the compaction reads the row, stopping at k). Otherwise (a
    skewed sample, or keys above the pivot past a full buffer) the row is read."""
    t = idx_ref.shape[0] if interpret else None
    hb, sp = cfg.hist_block, cfg.splits
    on, piv_on, strict = plan.use_buf.astype(I32), plan.at_pivot.astype(I32), plan.kept_all.astype(I32)
    piv = plan.piv_u ^ _SIGN
    lane = cfg.finish_lane_loads and not interpret
    bufs = [_buffer_source(key_ref, col_ref, row, jj, plan.fill_of(jj), cap, hb, on, piv, strict, lane)
            for jj in range(sp)]
    x_keys = _row_keys(x_ref, row, n, lane)
    from_row = (pl.cdiv(n, hb), lambda b: x_keys(b, hb))
    shrink = (scratch[0], row, t, interpret) if cfg.shrink else None
    tau_u, need = _pivot_or_kth(plan.at_pivot, plan.piv_u, k - plan.total_above, lambda: _kth_key(
        bufs + [((1 - on) * (1 - piv_on) * from_row[0], from_row[1])], k, cfg.bits, hb, shrink=shrink,
        unroll=cfg.unroll, hold=cfg.hold_shrunk, start=_counting_start(cfg, plan.use_buf, plan.piv_u, plan.hi_u),
        packed=cfg.packed_counts, lane=lane, exit_one=cfg.exit_at_one), skip=cfg.split_finish)
    row11, one11 = row + jnp.zeros((1, 1), I32), jnp.ones((1, 1), bool)
    C.store(tau_ref, (row11,), jnp.full((1, 1), tau_u, I32), one11)
    code = jnp.where(plan.at_pivot, 3, jnp.where(plan.kept_all, 4, on))
    C.store(path_ref, (row11,), jnp.full((1, 1), code, I32), one11)

    _compact(bufs + [((1 - on) * from_row[0], from_row[1])], tau_u ^ _SIGN, need, k,
             lambda slot, col, keep: _scatter(idx_ref, row, t, slot, col, keep), cfg.unroll,
             cfg.minus_one_for_neg_inf)


@dataclasses.dataclass
class _FirstPass:
    """The split finish's first counting pass, summed from the prefilter's per-split counts (``_first_pass``)."""
    ge_up: jax.Array  # [splits]: each split's keys above the k-th key's bucket
    bucket_n: jax.Array  # [splits]: each split's keys in it
    above: jax.Array  # all splits' keys above the bucket
    bucket: jax.Array  # all splits' keys in it
    start: Range  # the bucket's range: the counting's next start
    fast: jax.Array  # the bucket fits the scratch and the buffers serve as they are: the three-kernel finish


def _first_pass(hist_ref, row, plan: _RowPlan, k: int, cfg: TopkSelectConfig) -> _FirstPass:
    """The first pass at ``bucket_resolutions`` resolutions (``bucket_margins``): the finest one where the k-th key's
    bucket fits the scratch (``bucket_blocks`` blocks; any range is exact: a clamped top digit's bucket holds every
    key above it), else the coarsest. Why several: the digits are a power of two wide, so the bucket's population
    varies twice over with the span's rounding; at 128K keys a row, margin 1 alone left 13 of 64 replayed rows over
    a block, margins 1 and 2 one; margins 0..2 with 1024-key buckets none of 256 (``scripts/diag/topk_passes.py
    --margins 1 --n 131072 --rows 256 --bucket-keys 512 1024``)."""
    nd, sp = 1 << cfg.bits, cfg.splits
    margins = cfg.bucket_margins()
    nr, room = len(margins), cfg.bucket_blocks * cfg.hist_block
    dd = C.iota((sp, nd), 1)
    passes = []
    band = None if cfg.zero_band is None else _zero_band(plan.piv_u, plan.hi_u, cfg.zero_band)
    for r, m in enumerate(margins):
        jd = (nr * C.iota((sp, nd), 0) + r) * nd + dd
        tile = C.load(hist_ref, (row + jnp.zeros((sp, nd), I32), jd), (sp, nd))  # [split, d]: keys with digit >= d
        ge = jnp.sum(tile, axis=0)
        sel = jnp.sum((ge >= k).astype(I32)) - 1
        ge_up = jnp.sum(jnp.where(dd == sel + 1, tile, 0), axis=1)
        bucket_n = jnp.sum(jnp.where(dd == sel, tile, 0), axis=1) - ge_up
        start = _next_range(*_pivot_range(plan.piv_u, plan.hi_u, cfg.bits, m), sel, cfg.bits)
        if band is not None:  # rows without the band keep that start (the clamped top digit's digits grow 2^bits-fold)
            banded = _band_bucket(plan.piv_u, *_band_start(plan.piv_u, plan.hi_u, cfg.bits, m, *band), sel, cfg.bits,
                                  *band)
            start = tuple(jnp.where(band[1] == 0, p, b) for p, b in zip(start, banded))
        passes.append((ge_up, bucket_n, *start))
    pick = passes[0]
    for p in passes[1:]:  # finer ones override where they fit
        fits = jnp.sum(p[1]) <= room
        pick = tuple(jnp.where(fits, f, c) for f, c in zip(p, pick))
    ge_up, bucket_n, start = pick[0], pick[1], pick[2:]
    bucket = jnp.sum(bucket_n)
    fast = (~plan.over) & (plan.total >= k) & (bucket <= room)
    return _FirstPass(ge_up, bucket_n, jnp.sum(ge_up), bucket, start, fast)


def _copy_bucket(src: Source, skey_ref, scol_ref, row, t: int | None, fp: _FirstPass, dst: int | jax.Array,
                 unroll: int = 1) -> None:
    """The keys of ``src`` in the k-th key's first-pass bucket, in column order, to the scratch row from column
    ``dst``, keys and columns; ``unroll`` blocks loaded a step before any is used (blocks past the source's count
    hold no keys: _SIGN is in no bucket, since the split finish's fast rows have piv_u > 0)."""
    lo, span, _ = fp.start
    n_blocks, load = src

    def body(i, put):
        blocks = [load(i * unroll + j) for j in range(unroll)]  # the loads first
        for s, col in blocks:
            ki = _in_range(s, lo, span).astype(I32)
            slot = dst + put + jnp.cumsum(ki, axis=1) - ki
            _scatter(skey_ref, row, t, slot, s, ki == 1)
            _scatter(scol_ref, row, t, slot, col, ki == 1)
            put = put + jnp.sum(ki)
        return put

    lax.fori_loop(0, pl.cdiv(n_blocks, unroll), body, jnp.zeros((), I32))


def _all_buffers(key_ref, col_ref, row, plan: _RowPlan, cap: int, hb: int, lane: bool) -> Source:
    """Every split's buffer as one source of ``hb``-key blocks in column order (split 0's blocks, then split 1's,
    ...): a loop over it keeps its loads in flight across the splits (``fuse_bucket``'s copy, where most splits'
    buffers are a block or two). Block b's split and offset come from the buffers' block counts by scalar
    arithmetic; blocks past the last give no keys."""
    nb = lax.shift_right_logical(plan.fill + hb - 1, C.log2(hb))  # [1, splits] blocks a buffer
    ends = jnp.cumsum(nb, axis=1)

    def keys(b):
        jj = jnp.sum((ends <= b).astype(I32))  # block b's split (splits past the last: none)
        mine = plan.js == jj
        i = (b - jnp.sum(jnp.where(mine, ends - nb, 0))) * hb + C.iota((1, hb), 1)
        inside = i < jnp.sum(jnp.where(mine, plan.fill, 0))
        at = _lanes(jj * cap + i, lane)
        s = C.load(key_ref, (row, at), (1, hb), mask=inside)
        return jnp.where(inside, s, _SIGN), C.load(col_ref, (row, at), (1, hb), mask=inside)
    return jnp.sum(nb), keys


def _split_copy_kernel(key_ref, col_ref, filled_ref, above_ref, in_ref, piv_ref, hist_ref, skey_ref, scol_ref, *,
                       k: int, cfg: TopkSelectConfig, cap: int, interpret: bool) -> None:
    """Program (row, j) of the split finish: split j's keys in the k-th key's first-pass bucket, in column order, to
    the row's scratch [row, off_j : off_j + n_j] (off_j: the bucket's keys of the splits before it), keys and
    columns. Nothing where the row takes the one-program finish."""
    row, j = pl.program_id(0), pl.program_id(1)
    plan = _row_plan(filled_ref, above_ref, in_ref, piv_ref, row, k, cap, cfg.splits)
    fp = _first_pass(hist_ref, row, plan, k, cfg)
    off = jnp.sum(jnp.where(C.iota((cfg.splits,), 0) < j, fp.bucket_n, 0))
    own = _buffer_source(key_ref, col_ref, row, j, plan.fill_of(j), cap, cfg.hist_block, fp.fast.astype(I32),
                         lane=cfg.finish_lane_loads and not interpret)
    _copy_bucket(own, skey_ref, scol_ref, row, skey_ref.shape[0] if interpret else None, fp, off)


def _split_finish_parallel_kernel(x_ref, key_ref, col_ref, filled_ref, above_ref, in_ref, piv_ref, hist_ref, *refs,
                                  n: int, k: int, cfg: TopkSelectConfig, cap: int, interpret: bool,
                                  lengths: bool = False) -> None:
    """Program (row, j) of the split finish. Where the bucket fits the scratch row (``_first_pass``): tau from the
    bucket (every program of the row finds the same; one block is held in registers, several are counted block by
    block), then split j's buffer compacted into its own output slots: after the kept keys of the splits before it
    (their keys above the bucket, from the prefilter's counts, and their bucket keys > tau or kept at tau), keeping
    the keys == tau that the row keeps from it (the first ``need`` of the bucket's, in column order). Elsewhere the
    row's first program runs ``_finish_row``.

    ``fuse_bucket``: the bucket is not an input from the copy kernel; each program first copies every split's bucket
    keys into its own scratch row part (``_copy_bucket`` over ``_all_buffers``; outputs after the others:
    [row, j room : (j + 1) room])."""
    if cfg.fuse_bucket:
        idx_ref, tau_ref, path_ref, *scratch, skey_ref, scol_ref = refs
    else:
        skey_ref, scol_ref, idx_ref, tau_ref, path_ref, *scratch = refs
    row, j = pl.program_id(0), pl.program_id(1)
    t = idx_ref.shape[0] if interpret else None
    hb, sp = cfg.hist_block, cfg.splits
    plan = _row_plan(filled_ref, above_ref, in_ref, piv_ref, row, k, cap, sp)
    fp = _first_pass(hist_ref, row, plan, k, cfg)
    if lengths:  # columns per split (the prefilter's ranges): the row's, stored by the fill kernel
        split_cols = jnp.sum(C.load(piv_ref, (row + jnp.zeros((1, 1), I32), jnp.full((1, 1), 2, I32)), (1, 1)))
    else:
        split_cols = jnp.asarray(pl.cdiv(pl.cdiv(n, cfg.block), sp) * cfg.block, I32)
    room = cfg.bucket_blocks * hb
    base = j * room if cfg.fuse_bucket else 0  # this program's bucket in the scratch row
    lane = cfg.finish_lane_loads and not interpret

    @pl.when(fp.fast)
    def _():
        if cfg.fuse_bucket:
            _copy_bucket(_all_buffers(key_ref, col_ref, row, plan, cap, hb, lane), skey_ref, scol_ref, row, t, fp, base,
                         cfg.unroll)
            if not interpret:
                plt.debug_barrier()  # the bucket's stores -> its loads by other threads of the CTA

        def bucket_keys(b, w=hb):  # block b (w keys) of the scratch row's bucket: keys (_SIGN past it), columns, inside
            pos = b * w + C.iota((1, w), 1)
            inside = pos < fp.bucket
            at = _lanes(base + pos, lane)
            s = jnp.where(inside, C.load(skey_ref, (row, at), (1, w), mask=inside), _SIGN)
            return s, C.load(scol_ref, (row, at), (1, w), mask=inside), inside

        held_all = cfg.bucket_blocks == 1 or cfg.hold_bucket
        head = 0 if held_all else int(cfg.hold_bucket_head)  # blocks held before the ones loaded a pass
        if held_all:  # the whole bucket in registers, one load
            hw = cfg.bucket_blocks * hb
            held, hcol, inside = bucket_keys(0, hw)
            tau_u, need = _kth_key([], k - fp.above, cfg.bits, hw, start=fp.start, held=held, packed=cfg.packed_counts,
                                   exit_one=cfg.exit_at_one)
        else:
            nbk = lax.shift_right_logical(fp.bucket + hb - 1, C.log2(hb))
            # hold_bucket_head: the first block's keys loaded once (its columns only for the tally, after the passes)
            tau_u, need = _kth_key([(nbk - head, lambda b: bucket_keys(b + head)[:2])], k - fp.above, cfg.bits, hb,
                                   start=fp.start, held=bucket_keys(0)[0] if head else None, packed=cfg.packed_counts,
                                   exit_one=cfg.exit_at_one)
        tau = tau_u ^ _SIGN
        on_split = C.iota((sp, 1), 0)

        def tally(s, col, inside, eq_seen):
            """A bucket block's kept keys per split and the ties at tau split j keeps (the row keeps the first
            ``need`` keys == tau of the bucket, in column order), after ``eq_seen`` earlier ones."""
            eq = (inside & (s == tau)).astype(I32)
            tie = (eq == 1) & (eq_seen + jnp.cumsum(eq, axis=1) - eq < need)
            keep = (inside & (s > tau)) | tie
            of = lax.div(col, split_cols)  # each bucket key's split
            return (jnp.sum((keep & (of == on_split)).astype(I32), axis=1), jnp.sum((tie & (of == j)).astype(I32)),
                    jnp.sum(eq))

        if held_all:
            kept_b, ties, _ = tally(held, hcol, inside, jnp.zeros((), I32))
        else:
            def body(b, carry):
                kb, tb, eqs = tally(*bucket_keys(b), carry[2])
                return carry[0] + kb, carry[1] + tb, carry[2] + eqs
            kept_b, ties, _ = lax.fori_loop(0, nbk, body, (jnp.zeros((sp,), I32), jnp.zeros((), I32),
                                                          jnp.zeros((), I32)))
        ids = C.iota((sp,), 0)
        kept = fp.ge_up + kept_b  # [split]
        off, mine = jnp.sum(jnp.where(ids < j, kept, 0)), jnp.sum(jnp.where(ids == j, kept, 0))
        own = _buffer_source(key_ref, col_ref, row, j, plan.fill_of(j), cap, hb, jnp.ones((), I32),
                             lane=lane)
        _compact([own], tau, ties, mine, lambda slot, col, kp: _scatter(idx_ref, row, t, off + slot, col, kp),
                 cfg.unroll, cfg.minus_one_for_neg_inf)
        row11, first11 = row + jnp.zeros((1, 1), I32), (j == 0) & jnp.ones((1, 1), bool)
        C.store(tau_ref, (row11,), jnp.full((1, 1), tau_u, I32), first11)
        C.store(path_ref, (row11,), jnp.full((1, 1), 1, I32), first11)

    @pl.when((~fp.fast) & (j == 0))
    def _():
        _finish_row(x_ref, key_ref, col_ref, idx_ref, tau_ref, path_ref, scratch, row, plan, n, k, cfg, cap, interpret)


def _select_split(x: jax.Array, k: int, cfg: TopkSelectConfig, cap: int, interpret: bool,
                  lengths: jax.Array | None = None):
    """select_unsorted with the prefilter's pass split over ``cfg.splits`` programs per row (two kernels)."""
    t, n = x.shape
    sp = cfg.splits
    par = cfg.split_finish
    hint = lengths is not None
    fill = functools.partial(_split_fill_kernel, n=n, k=k, cfg=cfg, cap=cap, interpret=interpret, lengths=hint)
    bufs = [jax.ShapeDtypeStruct((t, sp * cap), I32)] * 2 + [jax.ShapeDtypeStruct((t, sp), I32)] * 3
    # the row's pivot and its sample's largest key (u); with lengths, its split width (columns)
    bufs += [jax.ShapeDtypeStruct((t, 3 if hint else 2), I32)]
    bufs += [jax.ShapeDtypeStruct((t, cfg.bucket_resolutions * sp << cfg.bits), I32)] if par else []  # first passes
    if cfg.fill_layout == "warp":  # the prefilter's warps' scratch buffers: keys, columns
        bufs += [jax.ShapeDtypeStruct((t, sp * (cfg.fill_warps or cfg.num_warps) * _warp_room(cap, n, cfg)), I32)] * 2
    keys, cols, filled, above, above_in, piv, *hist = C.pallas_call(
        fill, out_shape=tuple(bufs), grid=(t, sp), aliases={}, interpret=interpret, name="topk_radix_prefilter",
        num_warps=cfg.fill_warps or cfg.num_warps)(x, *((lengths,) if hint else ()))
    hist = hist[:1] if par else []
    out = [jax.ShapeDtypeStruct((t, k), I32)] + [jax.ShapeDtypeStruct((t,), I32)] * 2
    out += [jax.ShapeDtypeStruct((t, cfg.hist_block), I32)] if cfg.shrink else []  # the counting's scratch row
    counts = (filled, above, above_in, piv)
    if not par:
        finish = functools.partial(_split_finish_kernel, n=n, k=k, cfg=cfg, cap=cap, interpret=interpret)
        idx, tau, path, *_ = C.pallas_call(finish, out_shape=tuple(out), grid=(t,), aliases={}, interpret=interpret,
                                           name="topk_radix_finish", num_warps=cfg.num_warps)(x, keys, cols, *counts)
        return idx, tau, jnp.sum(filled, axis=1), path
    room = cfg.bucket_blocks * cfg.hist_block
    finish = functools.partial(_split_finish_parallel_kernel, n=n, k=k, cfg=cfg, cap=cap, interpret=interpret,
                               lengths=hint)
    if cfg.fuse_bucket:  # each finish program's own bucket: keys, columns
        out += [jax.ShapeDtypeStruct((t, sp * room), I32)] * 2
        bucket = ()
    else:
        copy = functools.partial(_split_copy_kernel, k=k, cfg=cfg, cap=cap, interpret=interpret)
        shapes = (jax.ShapeDtypeStruct((t, room), I32),) * 2  # the row's bucket: keys, columns
        bucket = C.pallas_call(copy, out_shape=shapes, grid=(t, sp), aliases={}, interpret=interpret,
                               name="topk_radix_bucket", num_warps=cfg.num_warps)(keys, cols, *counts, *hist)
    idx, tau, path, *_ = C.pallas_call(finish, out_shape=tuple(out), grid=(t, sp), aliases={}, interpret=interpret,
                                       name="topk_radix_finish", num_warps=cfg.num_warps)(x, keys, cols, *counts, *hist,
                                                                                          *bucket)
    return idx, tau, jnp.sum(filled, axis=1), path


# ----- wrappers --------------------------------------------------------------------------------------
def _check(x: jax.Array, k: int, config: TopkSelectConfig | None = None) -> int:
    if x.ndim != 2:
        raise ValueError(f"x must be a 2-D array [rows, N], got shape {x.shape}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got dtype {x.dtype}")
    if config is not None and not isinstance(config, TopkSelectConfig):
        raise ValueError(f"config must be a TopkSelectConfig or None, got {config!r}")
    k = check_int("k", k)  # a bool is not a k
    n = x.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] for rows of {n}, got {k}")
    return k


def select_unsorted(x: jax.Array, k: int, *, config: TopkSelectConfig | None = None,
                    interpret: bool | None = None, lengths: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The kernel alone: (kept columns int32 [T, k] in ascending order, with ``minus_one_for_neg_inf`` -1 in place
    of -inf keys' columns; tau uint32 [T] = the k-th largest
    ``ordered_key`` of each row, i.e. ``jds.ops.select.kth_largest_key``; candidates int32 [T] = keys the
    prefilter's first pass kept, N without a prefilter; path int32 [T]: how steps 2-3 ran, an index into
    ``PATHS``).

    ``lengths`` (int32 [T], optional): a promise that row t holds -inf from column lengths[t] on (a decode batch's
    logits past each request's context). The split prefilter then cuts only the row's first max(lengths[t], k,
    sample) columns over its programs, so a short request's keys are spread over all of them instead of lying in
    the first, and its -inf tail is not read. The other paths read the whole row; every path gives lax.top_k's
    result where the promise holds."""
    k = _check(x, k, config)
    lengths = _check_lengths(lengths, x.shape[0])
    cfg = config or TopkSelectConfig()
    interpret = C.resolve_interpret(interpret)
    t, n = x.shape
    if t == 0:
        return jnp.zeros((0, k), I32), jnp.zeros((0,), jnp.uint32), jnp.zeros((0,), I32), jnp.zeros((0,), I32)
    cap = cfg.buffer_capacity(n, k)
    if cap and n * cfg.sample >= 1 << 31:
        raise ValueError(f"rows of {n} with sample {cfg.sample}: column * n overflows int32")
    xi = lax.bitcast_convert_type(x.astype(jnp.float32), I32)  # the kernels read the bits (``_key_s``)
    if cap and cfg.splits > 1:
        idx, tau, cand, path = _select_split(xi, k, cfg, cap, interpret, lengths)
        return idx, lax.bitcast_convert_type(tau, jnp.uint32), cand, path
    out_shape = [jax.ShapeDtypeStruct((t, k), I32)] + [jax.ShapeDtypeStruct((t,), I32)] * 3
    out_shape += [jax.ShapeDtypeStruct((t, cap), I32)] * 2 if cap else []  # candidate keys, columns
    out_shape += [jax.ShapeDtypeStruct((t, cfg.hist_block), I32)] if cfg.shrink else []  # the counting's scratch
    kernel = functools.partial(_select_kernel, n=n, k=k, cfg=cfg, cap=cap, interpret=interpret)
    idx, tau, cand, path, *_ = C.pallas_call(kernel, out_shape=tuple(out_shape), grid=(t,), aliases={},
                                             interpret=interpret, name="topk_radix_select",
                                             num_warps=cfg.num_warps)(xi)
    return idx, lax.bitcast_convert_type(tau, jnp.uint32), cand, path


def topk_select(x: jax.Array, k: int, *, implementation: Implementation = "pallas", interpret: bool | None = None,
                config: TopkSelectConfig | None = None, sort: bool = True, lengths: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """(values [T, k] in x's dtype, int32 indices [T, k]) of the k largest entries of each row of ``x``
    [T, N] (float32 / bfloat16 / float16; NaN in the module's total order): identical to ``lax.top_k(x, k)``.

    ``sort=False``: the same entries in ascending index order instead (no sort of the k winners: a consumer that
    takes the set, as the sparse MQA does, skips it). The "xla" implementation always sorts. ``lengths``: the
    promise that row t is -inf from column lengths[t] on (``select_unsorted``); the "xla" implementation reads the
    whole row."""
    k = _check(x, k, config)
    lengths = _check_lengths(lengths, x.shape[0])
    return run_op("topk_select", implementation, {
        "xla": lambda: radix_topk(x, k, (config or TopkSelectConfig()).bits),
        "pallas": lambda: _pallas(x, k, config, interpret, sort, lengths)})


def _check_lengths(lengths: jax.Array | None, t: int) -> jax.Array | None:
    """``lengths`` as int32 [T], or None; a ValueError naming it otherwise. Values past the row are read as the
    row's end, values below k as k (``_row_extent``): the promise is about the row's -inf tail, not a mask."""
    if lengths is None:
        return None
    shape, dtype = jnp.shape(lengths), jnp.result_type(lengths)
    if shape != (t,) or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"lengths must be an integer array of shape ({t},) (one per row), got {dtype} {shape}")
    return jnp.asarray(lengths).astype(I32)


def _pallas(x: jax.Array, k: int, config: TopkSelectConfig | None, interpret: bool | None, sort: bool = True,
            lengths: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    if config is not None and config.minus_one_for_neg_inf:
        raise ValueError("config.minus_one_for_neg_inf: topk_select returns the kept keys' values and columns; "
                         "select_unsorted gives the columns with -1 for -inf keys")
    idx, *_ = select_unsorted(x, k, config=config, interpret=interpret, lengths=lengths)
    sel = jnp.take_along_axis(x, idx, axis=1)
    if not sort:
        return sel, idx
    _, idx, vals = lax.sort((~ordered_key(sel), idx, sel), dimension=1, num_keys=2)  # value desc, index asc
    return vals, idx
