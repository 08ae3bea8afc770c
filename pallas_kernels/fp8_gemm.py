"""DeepSeek's FP8 block-scaled linear y = x W^T on Hopper (Pallas Mosaic GPU), with the pure-JAX path
(``implementation="xla"``: ``jds.ops.quant.fp8_linear``) as reference (issue 19 item 3).

    W  = Wq * sw[n // 128, k // 128]      Wq float8_e4m3fn [N, K], sw float32 [ceil(N/128), ceil(K/128)]
    x ~= xq * sx[m, k // 128]             xq, sx = act_quant(x, 128, scale_fmt) (XLA, before the kernel)
    y[m, n] = sum_kb sx[m, kb] sw[n // 128, kb] * (sum_{k in kb} xq[m, k] Wq[n, k])    -> out_dtype

Scales: ``scale_fmt`` is the activation scale format ("ue8m0": powers of two; "amax": amax / 448), as in
``act_quant``; the weight scales are whatever the checkpoint holds (powers of two or amax / 448 floats).
The activation quantisation stays outside the kernel (by default in XLA: three small kernels with the padding
and the transposed scales; ``act_quant="kernel"``: one, ``quantize_rows``); the kernel takes xq e4m3 [M, K] and
sx^T float32 [K/128, M].

Kernel (``plgpu.kernel``, Lane lowering semantics, 3 warpgroups per CTA: 2 compute + 1 TMA producer):
- CTA = (K split s, M tile, N tile): a [block_m, block_n] output tile over the K blocks [s*kps, (s+1)*kps) of
  128. Output tiles are rasterised in groups of ``group_m`` M tiles (M fastest inside a group), so the CTAs
  resident at once share a few x row tiles and a band of weight tiles in L2 (large M).
  ``plgpu.emit_pipeline_warp_specialized`` runs a ``stages``-deep TMA ring: the producer warpgroup copies
  the xq tile [block_m, 128] and the Wq tile [block_n, 128] of each K block into 128-byte-swizzled SMEM
  (tiling (8, 128): one swizzle atom row is one K block of e4m3), the compute warpgroups consume them.
- Per K block, each compute warpgroup issues e4m3 x e4m3 -> fp32 wgmma into a fresh [64, <=128]
  accumulator (A = its 64 rows of the xq tile, B = a Wq tile slice^T: both operands K-major in SMEM, which is
  what 8-bit wgmma needs; Hopper has no transpose bit for 8-bit types), loads the block's scales while the
  MMA runs (sx^T[kb, rows] as a [64] vector in the accumulator's row layout straight from GMEM, sw[nb, kb]
  as one scalar; both L2 hits), waits, and promotes: acc += blk * (sx[m, kb] * sw[nb, kb]). That is
  DeepGEMM's scheme: an fp8 MMA chain never spans more than one 128-wide K block, the running sum is fp32
  on the CUDA cores. The two compute warpgroups interleave (one promotes while the other's MMA runs).
  ``stage_scales=True`` (the default up to 128 rows where it fits SMEM, measured faster there: docs/perf-log.md)
  copies a warpgroup's sx^T rows for the CTA's K range and 8 weight-scale rows by TMA into SMEM before the pipeline, so
  that the promotion reads SMEM:
  an Nsight Compute profile of the decode call (2026-12-01) put a fifth of the warps' stall samples on the
  promotion waiting for the weight scale loaded from global memory.
- Warpgroup split: block_m = 128 -> each warpgroup owns 64 rows x block_n columns; block_m = 64 (small M,
  wgmma's minimum M) -> the 64 rows x block_n / 2 columns. A warpgroup's columns are processed in chunks of
  <= 128 (one MMA accumulator + the running sums: block_n = 256 with 128-row tiles keeps 2 x 64 fp32 running
  registers + one 64-register MMA tile per thread); a chunk lies in one weight-scale block (one sw scalar), except
  with tile widths that are no multiple of 64 (``_ragged``: 144, so that mlp's 18432 columns make 128 tiles, one
  wave), where a chunk may cross into a second block and takes a [chunk] vector of per-column weight scales.
- Output: ``split_k`` == 1 stores acc as out_dtype straight from registers to GMEM ([Mp, N], padded rows
  sliced away), except a single 64-row tile of fewer real rows: its first round_up(M, 8) rows go out through
  SMEM and a TMA store, as the decode partials below. ``split_k`` > 1 stores fp32 partials [split_k, rows, N]
  that XLA sums and casts; with a single 64-row tile (decode) only the first round_up(M, 8) rows go out,
  through SMEM and a TMA store (fp32 partials of 64 rows per split would be as many bytes as the weights).
  Split-K is the decode path: with M <= 64 there are only N / block_n output tiles (12 for the 7168->1536
  q_a projection) and the call is weight-read bound, so the K range is cut until one wave of CTAs (one per
  SM) fills most SMs (``_auto_split_k``).
- ``quantize_x=True`` (decode tiles: bfloat16 x, M <= 64): the pipeline streams bfloat16 x tiles instead of
  e4m3 ones, and each compute warpgroup quantises the K block's tile in registers (row amax, ``row_scales``,
  clamp, RNE cast) into its own e4m3 SMEM tile right before its MMA; the row scales stay in registers for the
  promotion. The call then has no XLA kernels for act_quant, its padding and the transposed scales (three of
  the decode call's kernels, several µs of its timeline: docs/perf-log.md; what remains around the kernel is the
  split-K sum, where there is one). Same operands as act_quant's, bit for bit (tests). Off: the quantisation
  between each K block's TMA wait and its MMA made the kernel several times slower (Nsight Compute, 2026-12-01;
  docs/perf-log.md).
  ``act_quant="kernel"`` (``quantize_rows``, the default up to 128 rows) does the same quantisation in one kernel
  before the GEMM instead.
- ``stream_k=True`` (decode, one 64- or 128-row tile): the kernel holds one CTA per SM (its registers and SMEM), so a
  grid of whole tiles or K splits that is not a multiple of the SMs leaves a tail wave (mlp's 144 tiles on 132
  SMs: 1.09 waves). Instead min(132, units) CTAs take the (column tile, K block) units in equal contiguous runs
  (K fastest): one pipeline per CTA whose blocks follow its run; where the run leaves a tile the CTA stores its
  [mr, block_n] fp32 partial for that tile into slot j (its rank among the tile's CTAs, ``stream_k_layout``)
  of a [J, mr, N] output and restarts at 0; one XLA reduction (masking the slots no CTA wrote) sums them, as
  split-K's does. On by default up to 128 rows where the column tiles alone exceed one wave (``_auto_stream_k``).
- ``swap_ab`` (decode, the default up to ``SWAP_AB_UP_TO`` rows: ``_build_swapped_call``): the roles swapped,
  y^T = W x^T. The weight tile is the wgmma's A (64 rows per compute warpgroup, ``block_n`` / 64 warpgroups) and
  x's round_up(M, 8) rows its N, so a 1-row call no longer multiplies a 64-row x tile of zeros per K block (the
  regions had put q_b's steps as long as the ring's arrival interval). Up to 8 rows y is stored directly (each
  row a masked sum over the accumulator's columns); above that the accumulator goes through a transposed view of
  an SMEM tile and TMA stores y's rows (``swap_store="smem"``: no kernel after the call without split-K).
- Padding: M is padded to block_m (zero xq rows and scales). With ``quantize_x`` x is not padded (no XLA kernel
  at all before the call): the x tile's TMA box runs past its M rows, which TMA fills with zeros, and rows past
  M only feed output rows that are dropped (an MMA row depends on its own row of x alone). K must be a multiple of 128
  (``Unsupported`` otherwise); an N that is not is padded with zero weight rows to whole 128-row scale blocks
  (``pad_out_rows``: one copy of the weight per call) and y's extra columns sliced off.

Numerics. Interpret mode multiplies the e4m3 tiles exactly in fp32 (numpy), so the only difference to the
XLA path (dequantise both operands to fp32, one HIGHEST matmul) is fp32 summation order and the rounding
of the per-block scale products (none at all for power-of-two scales on both sides). On the H200 the e4m3
wgmma accumulates inside its K = 128 chain with reduced precision (about 2^-14 relative to the block's
partial sums, the reason DeepGEMM and this kernel promote every 128), so native results differ from the
fp32 reference by more than fp32 round-off: the native tests (K <= 512) allow 2^-9 of sum_k |x_k W_k| per
element, and data whose every partial sum is exact at that precision must come out bit-equal. At the model's
K (7168-16384) the benchmark's err_abssum_max is larger than that bound and equal, shape for shape, to
cuBLAS's blockwise FP8 GEMM (torch ``_scaled_mm``) on the same operands in the same run: the hardware's
accumulation, not this kernel's order (benchmarks/results/kernels_fp8_gemm_*).

Why Mosaic GPU: fp8 wgmma with K-major operands, TMA and warp specialisation are all expressible (the Triton
backend is deprecated since jax 0.11). Limits: Mosaic GPU's Hopper wgmma takes at most N = 256 per
instruction and needs M = 64 k; block_m 64 wastes the padded rows' MMA work in decode, which is weight
bound anyway.
``interpret=None`` runs GPU interpret mode off-GPU (the same kernel on the CPU, slow: tests only).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from jds.ops import quant
from jds.ops.dispatch import Implementation, Unsupported, mosaic_interpret, run_op

BLOCK = 128  # quantisation block (both operands) = kernel K step
SW_ROWS = 8  # staged scales: weight-scale rows a CTA copies (8 x a multiple of 4 floats = 128-byte multiples)
NUM_SMS = 132  # H100 / H200; only steers the automatic split_k
WAVE_FILL = 0.72  # the automatic split_k's target: CTAs >= this share of NUM_SMS (95 CTAs)
_X_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))
_SCALE_FMTS = ("ue8m0", "amax")


# 128-byte-swizzled SMEM tiles of one K block: 128 e4m3 or 64 bf16 per 128-byte row
_SWZ8 = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(128))
_SWZ16 = (plgpu.TilingTransform((8, BLOCK // 2)), plgpu.SwizzleTransform(128))

STAGE_SCALES_BELOW = 129  # rows (M) below which stage_scales=None stages the scales in SMEM (if they fit)
STREAM_K_ROWS_PER_K = 32  # stream_k=None needs M <= K / this (_auto_stream_k: q_b's 1536 -> 48 rows, mlp's 7168 -> 224)
WIDE_TILE_MAX_K = 2048  # in-features up to which decode rows default to 256-wide tiles (_default_block_n)
ACT_QUANT_KERNEL_UP_TO = 128  # rows (M) up to which (and from LARGE_M_FROM) act_quant=None quantises x in one kernel
SMEM_BYTES = 227 * 1024  # a Hopper CTA's shared memory
SWAP_ROWS_OUT_UP_TO = 8  # swap_ab stores y [M, N] itself up to this many rows (M masked row sums), else via SMEM
SWAP_BLOCK_N = (64, 128, 192)  # swap_ab's tile widths: a compute warpgroup per 64 weight rows, at most three
SWAP_AB_UP_TO = 32  # rows (M) up to which swap_ab=None swaps the roles (``_auto_swap_ab``)
SWAP_STORES = ("rows", "transpose", "smem")  # swap_ab's ways to store y (``fp8_linear``'s ``swap_store``)
STAGES = 4  # TMA ring depth (stages=None)
GROUP_M = 16  # fp8_linear's group_m: M tiles per rasterisation group (8 before; archive/fp8_tile_scales_h100_*)
SWAP_RING_BYTES = 104 * 1024  # swap_ab, stages=None: ring bytes in flight per CTA (``_swapped_stages``)
LARGE_M_FROM = 1024  # rows from which persistent / ring_scales = None may turn on (``_auto_large_m``), act_quant's kernel
PERSISTENT_MAX_KBLOCKS = 64  # in / 128 up to which persistent=None loops over tiles there (q_b's 12, mlp's 56)
K_PAIRS_MIN_KBLOCKS = 64  # k_pairs=None: on with ring_scales from this many K blocks per CTA
RING_SCALE_COLS = 32  # ring_scales: weight scales per stage in multiples of this (128 bytes; ``ring_weight_scales``)
GEMM_KERNEL = "fp8_gemm"  # the GEMM kernels' name (both forms); on the GPU timeline "<name>_mosaic_gpu_kernel"
QUANTIZE_KERNEL = "fp8_quantize_rows"  # quantize_rows' kernel: named apart so that a profile splits a call's time
PROFILE_RANGES = 256  # per warpgroup and call: ``profile_dir``'s events (a region per K block, a few more)
# GPU interpret mode runs a kernel's simulated threads on XLA's CPU thread pool, whose barrier waits hold pool threads:
# the staged / ring scales with one row tile (the trimmed SMEM epilogue) and swap_ab's staged scales deadlock where
# the pool is small (one thread per core unless NPROC sets it; 2026-12-06). fp8_linear refuses those forms in
# interpret mode while this holds; a caller that has sized the pool (the tests: NPROC >= 32) may clear it.
INTERPRET_REFUSES_BARRIER_FORMS = True


# ----------------------------------------------------------------------------------------------------
# public entry points
def fp8_linear(x: jax.Array | quant.QuantizedRows, wq: jax.Array, w_scale: jax.Array, *,
               out_dtype: jnp.dtype = jnp.bfloat16,
               scale_fmt: quant.ScaleFmt = "ue8m0", implementation: Implementation = "auto",
               interpret: bool | plgpu.InterpretGPUParams | None = None, block_m: int | None = None,
               block_n: int | None = None, split_k: int | None = None, stages: int | None = None,
               group_m: int = GROUP_M, stage_scales: bool | None = None, quantize_x: bool = False,
               stream_k: bool | None = None, act_quant: str | None = None, swap_ab: bool | None = None,
               swap_store: str | None = None, persistent: bool | None = None,
               ring_scales: bool | None = None, k_pairs: bool | None = None,
               store_overlap: bool | None = None, column_scales: bool = False,
               profile_dir: str | None = None) -> jax.Array:
    """y = x W^T with W = ``wq`` (float8_e4m3fn [out, in]) * ``w_scale`` (float32 [ceil(out/128),
    ceil(in/128)] per 128 x 128 block), x [..., in] re-quantised per 1 x 128 group (``scale_fmt``);
    [..., out] in ``out_dtype``. x may come quantised already (``quant.QuantizedRows`` [M, in] with the same
    ``scale_fmt``, e.g. from ``pallas_kernels.norm_quant``): no quantisation kernel then, and linears that read one
    x share it (the kernel reads its ``q`` / ``st`` as they are where they have ``padded_x_rows(M)`` rows,
    the default tiles' padding, else a padded or cut copy).

    ``implementation``: "xla" = ``jds.ops.quant.fp8_linear``; "pallas" = the kernel (in a multiple of 128,
    else ``Unsupported``; an out that is not runs on zero-padded weight rows); "auto" = the kernel where it
    applies, else XLA.
    Tiles (kernel only, see ``_pick_tiles`` for the defaults): ``block_m`` 64 or 128, ``block_n`` a multiple of 16
    up to 256 dividing out, padded to whole 128-row blocks (192: one wave of 128-row tiles where 128-wide ones
    leave a tail, q_b's 24576 columns;
    a width that is no multiple of 64, e.g. 144 for mlp's 18432 columns in 128 tiles, scales each column: ``_ragged``),
    ``split_k`` K splits (a divisor of in/128), ``stages`` TMA ring depth (None: ``STAGES``, or with ``swap_ab``
    about ``SWAP_RING_BYTES`` of ring, ``_swapped_stages``), ``group_m`` M tiles per rasterisation
    group (L2 reuse at large M). ``stage_scales``: copy a CTA's scales into SMEM by
    TMA before the pipeline instead of loading each K block's from GMEM inside the loop (at decode those loads'
    latency stalls the promotion); None: on up to 128 rows (M), where it measured faster, if it fits SMEM.
    ``quantize_x``: the kernel quantises x itself, per K block as it streams (decode
    tiles: bfloat16 x, 64-row tiles, M <= 64), so the call has no XLA kernels for the activation quantisation
    and its scales; off by default (slower: BENCHMARKS.md). ``stream_k`` (M <= 128 in one row tile, unstaged
    scales, no ``split_k``): one wave of CTAs shares the (column tile, K block) units evenly instead of whole
    tiles or K splits, so no tail wave idles SMs whatever the shape; one XLA reduction sums the partials; None
    (``_auto_stream_k``): on where the column tiles alone exceed one wave, up to 128 rows. ``act_quant``: where x
    is quantised when the kernel does not do it itself: "xla" (``quant.act_quant`` plus the padding and transposed
    scales: three XLA kernels) or "kernel" (``quantize_rows``: one kernel; bfloat16 x, M < 8 or a multiple of 8,
    else XLA); None: "kernel" up to ``ACT_QUANT_KERNEL_UP_TO`` rows (``_auto_act_quant``).
    ``swap_ab`` (M <= 128, ``block_n`` 64, 128 or 192; scales staged unless ``stage_scales=False``): the roles
    swapped, y^T = W x^T, so that the wgmma's N is round_up(M, 8) instead of a padded 64- or 128-row x tile
    (``_build_swapped_call``); None: on up to ``SWAP_AB_UP_TO`` rows where no other choice excludes it
    (``_auto_swap_ab``). ``swap_store`` (with ``swap_ab``): how y leaves the kernel. "rows": y [M, N] itself, each
    row a masked sum over the accumulator's columns (M reductions); "transpose": y^T [N, round_up(M, 8)] from
    registers and a transposing XLA fusion after the call; "smem": y^T written into each warpgroup's SMEM tile
    through a transposed view, so that the tile is y's [round_up(M, 8), 64] block, and stored as y by TMA (no
    reductions, no kernel after the call). None: "rows" up to ``SWAP_ROWS_OUT_UP_TO`` rows, else "smem".
    ``persistent`` (several row tiles, no ``split_k``, unstaged scales): one CTA per SM loops over whole output
    tiles through one TMA ring, and each finished tile leaves through SMEM by TMA stores while the next one's
    blocks stream in, instead of a CTA per tile that fills its ring, runs its K blocks and stores its
    accumulators from registers (a 128-row tile's uncoalesced register stores were the longest part of a CTA's
    tail in the regions profile, and at q_b's 12 K blocks a tile's fill and store are a large part of it).
    None (``_auto_large_m``): from ``LARGE_M_FROM`` rows where nothing else excludes it, for a short K (at most
    ``PERSISTENT_MAX_KBLOCKS`` K blocks).
    ``ring_scales`` (unstaged scales, x quantised outside, no ``stream_k``): each K block's row scales (sx^T[kb,
    the tile's rows]) and its weight scales (sw^T[kb, :] padded; in the persistent loop the tile's own,
    ``ring_weight_scales``) travel through the TMA ring with the block's tiles, so the promotion reads them from
    SMEM (each step then ends with a proxy fence, ``fence_slot_reads``): the compute warpgroups issue no global
    loads (where they load them from GMEM, even a step ahead, the step copies the loaded registers before it
    ends, which waits for the load: the SASS of a native dump). None (``_auto_large_m``): on from
    ``LARGE_M_FROM`` rows where nothing else excludes it.
    ``k_pairs`` (with ``ring_scales``, tiles whose warpgroup columns are one accumulator chunk, an even number of
    K blocks per CTA): each pipeline step carries two K blocks; a compute warpgroup issues both MMAs into two
    accumulators and promotes the first while the second runs (only every second promotion leaves its MMAs
    idle). The ring keeps as many stages of two blocks as fit SMEM, at most ``stages``. None (``_auto_k_pairs``):
    on with ``ring_scales`` where the tile allows it, from ``K_PAIRS_MIN_KBLOCKS`` K blocks per CTA.
    ``store_overlap`` (``persistent``, one K block a step): a finished tile's accumulators leave (SMEM, TMA store)
    while the next tile's first MMA runs, instead of before it is issued; the CTA's last tile leaves after the
    loop. None: on wherever it applies (faster at q_b and mlp, the persistent shapes).
    ``column_scales`` (unswapped kernel): every tile width takes the per-column weight scales of ``_ragged``
    widths, so that a warpgroup's columns make the fewest chunks of at most 128 (a 192-wide tile: one 96-column
    chunk a warpgroup at 64 rows, two at 128) instead of chunks inside one weight-scale block (32 / 64 columns
    there, each its own MMA, wait and promotion); with one chunk a warpgroup ``k_pairs`` can take the tile. Off by
    default (not yet timed natively).
    ``profile_dir`` (diagnostic, native): Mosaic GPU's profiler writes a trace of the kernel's named regions per
    warpgroup there: ``all`` (the pipeline, every warpgroup), the compute warpgroups' ``scales`` (staging wait),
    ``loop``, its ``step`` bodies and ``store`` (``scripts/diag/fp8_regions.py``).
    ``interpret``: GPU interpret mode (True or an ``InterpretGPUParams``); None = whenever the default
    backend is not a GPU.
    """
    _check_common(x, wq, w_scale, scale_fmt)
    return run_op("fp8_linear", implementation, {
        "xla": lambda: quant.fp8_linear(x, wq, w_scale, out_dtype, scale_fmt),
        "pallas": lambda: _pallas(x, wq, w_scale, out_dtype=out_dtype, scale_fmt=scale_fmt, interpret=interpret,
                                  block_m=block_m, block_n=block_n, split_k=split_k, stages=stages,
                                  group_m=group_m, stage_scales=stage_scales, quantize_x=quantize_x,
                                  stream_k=stream_k, act_quant=act_quant, swap_ab=swap_ab,
                                  swap_store=swap_store, persistent=persistent,
                                  ring_scales=ring_scales, k_pairs=k_pairs, store_overlap=store_overlap,
                                  column_scales=column_scales, profile_dir=profile_dir)})


def _check_common(x, wq, w_scale, scale_fmt) -> None:
    """Input errors of both implementations (ValueError naming the argument)."""
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {_SCALE_FMTS}, got {scale_fmt!r}")
    if wq.ndim != 2:
        raise ValueError(f"wq must be [out, in], got shape {wq.shape}")
    if jnp.dtype(wq.dtype) != jnp.dtype(quant.FP8):
        raise ValueError(f"wq must be float8_e4m3fn, got {wq.dtype}")
    n, k = wq.shape
    want = (-(-n // BLOCK), -(-k // BLOCK))
    if w_scale.shape != want:
        raise ValueError(f"w_scale must have shape {want} for wq {wq.shape}, got {w_scale.shape}")
    if not jnp.issubdtype(w_scale.dtype, jnp.floating):
        raise ValueError(f"w_scale must be a float array (float32 block scales), got {w_scale.dtype}")
    if isinstance(x, quant.QuantizedRows):
        if x.scale_fmt != scale_fmt:
            raise ValueError(f"x: quantised with scale_fmt {x.scale_fmt!r}, the linear's is {scale_fmt!r}")
        mp = x.q.shape[0]
        if (x.q.ndim != 2 or x.q.shape[1] != k or jnp.dtype(x.q.dtype) != jnp.dtype(quant.FP8) or mp < x.rows
                or x.st.shape != (k // BLOCK, mp)):
            raise ValueError(f"x: QuantizedRows of {x.rows} rows for wq {wq.shape} needs q float8_e4m3fn [mp >= "
                             f"{x.rows}, {k}] and st [{k // BLOCK}, mp], got q {x.q.dtype} {x.q.shape}, "
                             f"st {x.st.shape}")
    elif x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}] for wq {wq.shape}, got shape {x.shape}")
    if k % BLOCK:
        raise ValueError(f"wq: in = {k} must be a multiple of {BLOCK} (x is re-quantised per 1 x {BLOCK} group)")
    if not isinstance(x, quant.QuantizedRows) and jnp.dtype(x.dtype) not in _X_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")


def _check_tiles(block_m: int | None, block_n: int | None, split_k: int | None, stages: int, group_m: int) -> None:
    if block_m not in (None, 64, 128):
        raise ValueError(f"block_m must be 64 or 128 (or None), got {block_m}")
    if block_n is not None and (not isinstance(block_n, int) or block_n % 16 or not 16 <= block_n <= 256):
        raise ValueError(f"block_n must be a multiple of 16 from 16 to 256 (or None), got {block_n}")
    for name, v in (("split_k", 1 if split_k is None else split_k), ("stages", stages), ("group_m", group_m)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v}")


def default_block_m(m: int) -> int:
    """The default row tile: 64 rows (wgmma's minimum M) up to 64 rows, 128 above."""
    return 64 if m <= 64 else 128


def padded_x_rows(m: int) -> int:
    """The rows the kernel reads x padded to with the default tiles (whole ``default_block_m`` tiles, at least one):
    a ``quant.QuantizedRows`` of this many rows goes in without a copy."""
    return max(1, -(-m // default_block_m(m))) * default_block_m(m)


def _pick_tiles(m: int, n: int, nk: int, block_m: int | None, block_n: int | None,
                split_k: int | None) -> tuple[int, int, int]:
    """(block_m, block_n, split_k): the given ones, defaults for the rest.

    Defaults: M <= 64 (decode, weight-read bound): 64 x 128 tiles (wgmma's minimum M) and split-K until one
    wave of CTAs fills most SMs (``_auto_split_k``). Larger M: 128 x 128 tiles (+ split-K if too few). Decode
    rows with more 128-wide column tiles than SMs: 192- or 256-wide tiles (``_default_block_n``). 256-wide
    tiles halve the SMEM / L2 traffic per FLOP but were slower at M = 2048 in the tile sweep
    (``jds.bench.kernels_fp8_gemm --sweep``): a 256-wide warpgroup chunk doubles the promotion registers and
    leaves room for fewer TMA stages."""
    bm = block_m or default_block_m(m)
    mt = -(-m // bm)
    if block_n is None:
        block_n = _default_block_n(m, n, nk, bm)
    if n % block_n:
        raise ValueError(f"block_n {block_n} must divide out = {n}")
    if split_k is not None and nk % split_k:
        raise ValueError(f"split_k must divide in / {BLOCK} = {nk}, got {split_k}")
    return bm, block_n, split_k or _auto_split_k(mt * (n // block_n), nk)


def supports(n: int, k: int) -> bool:
    """Whether the kernel takes a weight of [n, k] (out, in): ``in`` whole 128-column quantisation groups; any
    ``out`` (one that is no multiple of 128 is padded to whole 128-row scale blocks per call: ``pad_out_rows``)."""
    return k % BLOCK == 0 and n > 0 and k > 0


def pad_out_rows(wq: jax.Array) -> jax.Array:
    """The weight with zero rows up to a multiple of 128 (its last scale block's rows past ``out``), so that the
    tiles see whole scale blocks; the caller slices the zero columns off y. Its scales already have ceil(out / 128)
    rows.

    Why: V3.2's wkv_a (576 out) otherwise left the kernel for XLA's path, which dequantises the weight to fp32
    every call. ``jds.nn.Linear`` stores such a weight padded by this once; ``fp8_linear`` pads an unpadded one per
    call (one copy of the weight)."""
    pad = -wq.shape[0] % BLOCK
    return jnp.pad(wq, ((0, pad), (0, 0))) if pad else wq


def _auto_large_m(m: int, nk: int, split_k: int | None, stage_scales: bool | None, quantize_x: bool,
                  stream_k: bool | None, swap_ab: bool | None) -> tuple[bool, bool]:
    """(persistent, ring_scales) where the caller leaves them None: off below ``LARGE_M_FROM`` rows and wherever
    the caller asked for staged scales, quantize_x, stream_k or swap_ab; there, ``ring_scales``, with
    ``persistent`` for at most ``PERSISTENT_MAX_KBLOCKS`` K blocks (no split_k).

    Why: with a short K a tile's ring fill and accumulator store are a large share of its time, which the
    persistent loop overlaps with the next tile's blocks; with a long K that loop's smaller ring (its SMEM
    output tiles take room) costs more than it saves (H100, 2048 rows: persistent faster at q_b's 12 K blocks and,
    once its steps stopped computing the tile's indices, at mlp's 56; slower at wo's 128:
    benchmarks/results/archive/fp8_tile_scales_h100_2026-12-06.json). The scales
    through the ring were faster than loading them from GMEM a step ahead (``prefetch_scales``, the default
    before, since removed) or in the step, at all three
    (benchmarks/results/archive/fp8_large_kernels_kpairs_h100_2026-12-06.json)."""
    if m < LARGE_M_FROM or stage_scales or quantize_x or stream_k or swap_ab:
        return False, False
    return nk <= PERSISTENT_MAX_KBLOCKS and split_k in (None, 1), True


def _auto_k_pairs(bm: int, bn: int, kps: int) -> bool:
    """k_pairs=None with ring_scales: on where the tile allows it (one accumulator chunk per warpgroup, an even
    number of K blocks per CTA) and the CTA runs at least ``K_PAIRS_MIN_KBLOCKS`` K blocks.

    Why: a step of two blocks takes twice the SMEM, so a CTA's ring holds half the steps and fills later before
    its first MMA; over a long K the second accumulator's overlap repays it. H100, 2048 rows: faster at wo (128 K
    blocks), slower at mlp (56 K blocks, 17 waves of CTAs) (benchmarks/results/archive/fp8_k_pairs_h100_2026-12-06.json)
    and, once the persistent loop's steps stopped computing the tile's indices, at q_b (12 K blocks, persistent;
    benchmarks/results/archive/fp8_tile_scales_h100_2026-12-06.json)."""
    return _k_pairs_fit(bm, bn, kps) and kps >= K_PAIRS_MIN_KBLOCKS


def _k_pairs_fit(bm: int, bn: int, kps: int, column_scales: bool = False) -> bool:
    """Whether k_pairs can take these tiles: one accumulator chunk per warpgroup (``_chunk_cols``; with per-column
    weight scales where the width is ragged or ``column_scales``) and an even number of K blocks per CTA."""
    return _chunk_cols(bm, bn, column_scales) == (bn if bm == 128 else bn // 2) and kps % 2 == 0


def _auto_split_k(tiles: int, nk: int) -> int:
    """Smallest divisor s of nk with tiles * s >= ``WAVE_FILL`` * NUM_SMS (one wave that fills most SMs),
    keeping >= 2 K blocks per CTA; 1 when the output tiles alone reach it.

    Why one wave: the kernel holds one CTA per SM (its registers and SMEM), so each further wave repeats a
    CTA's prologue (scales, pipeline fill) with the SM's memory stream idle, and more splits also add fp32
    partials to write and sum. The earlier rule (about 2 CTAs per SM, 448 CTAs for wo) was slower at every
    measured decode shape (benchmarks/results/archive/fp8_decode_ncu_sweep_h200_2026-12-01.json)."""
    if tiles >= WAVE_FILL * NUM_SMS:
        return 1
    divs = [d for d in range(1, nk + 1) if nk % d == 0 and nk // d >= 2] or [1]
    bigger = [d for d in divs if tiles * d >= WAVE_FILL * NUM_SMS]
    return bigger[0] if bigger else divs[-1]


def _default_block_n(m: int, n: int, nk: int, bm: int) -> int:
    """Decode rows (one row tile, M <= 128) whose 128-wide column tiles exceed one wave (q_b's 192, mlp's 144
    on 132 SMs), where whole tiles leave a tail wave. Above ``SWAP_AB_UP_TO`` rows (the unswapped kernel): the
    narrowest multiple of 16 dividing n whose tiles fit one wave (``_one_wave_width``: q_b 192, 128 tiles; mlp
    144, 128 tiles, where 192 made 96). Up to it (the widths swap_ab takes, and the unswapped kernel where a
    choice excludes the swap): 192-wide tiles where they make one wave (each accumulator chunk inside one
    weight-scale block); else 256-wide for one 64-row tile of a short K (<= ``WIDE_TILE_MAX_K``), where
    stream-K's fp32 partials cost too much beside the weight read; else 128.

    Measured: 192-wide tiles beat the earlier defaults at q_b 64 / 128 rows and mlp 1, 64 and 128 rows, level
    at q_b 1 row (ncu, archive/fp8_decode_ncu_sweep_h200_2026-12-03.json); 256 beat 128 at 1 and 64 rows
    (archive/fp8_decode_ncu_sweep_h200_2026-12-02.json); mlp's 144 against 192 on an H100, the kernel on the
    GPU timeline: faster at 48 to 96 rows, level at 128 (benchmarks/results/archive/
    fp8_tiles_time_wave_h100_2026-12-05.json, fp8_tiles_time_ragged*_h100_2026-12-05.json; docs/perf-log.md,
    forty-third session)."""
    if m <= min(bm, 128) and n // BLOCK > NUM_SMS:
        if m > SWAP_AB_UP_TO and (w := _one_wave_width(n)):
            return w
        if n % 192 == 0 and n // 192 <= NUM_SMS:
            return 192
        if bm == 64 and n % 256 == 0 and nk * BLOCK <= WIDE_TILE_MAX_K:
            return 256
    return 128


def _one_wave_width(n: int) -> int | None:
    """The narrowest tile width from 128 to 192 (the widths measured at these rows), a multiple of 16 (two
    compute warpgroups' chunks of a multiple of wgmma's N step of 8), that divides n into at most ``NUM_SMS``
    tiles; None if none does."""
    return next((w for w in range(max(128, -(-n // NUM_SMS) + 15) // 16 * 16, 193, 16)
                 if n % w == 0 and n // w <= NUM_SMS), None)


def _auto_stream_k(m: int, n: int, nk: int, block_m: int | None, block_n: int | None, split_k: int | None,
                   stage_scales: bool | None) -> bool:
    """stream_k=None: on for decode rows (M <= 128 in one 64- or 128-row tile, no tile choices that exclude it)
    whose column tiles alone exceed one wave (mlp's 144 on 132 SMs, q_b's 192), where whole tiles leave a tail
    wave; the one-wave K split covers the shapes with fewer tiles (wo, q_a), and there stream-K measured slower
    (BENCHMARKS.md, kernels_fp8_gemm: 1, 64 and 128 rows).

    Off where the fp32 partials cost too much beside the weight read: a shared tile's partial is written and
    summed (8 M bytes per column, in two kernels) against its K weight bytes per column, so stream-K needs
    M <= K / ``STREAM_K_ROWS_PER_K``. Exact kernel times (ncu, archive/fp8_decode_ncu_sweep_h200_2026-12-02.json):
    q_b (K = 1536) was faster without stream-K at 64 and 128 rows and level at 1; mlp (K = 7168) faster with
    it at 64 and 128."""
    if m > 128 or block_m not in (None, default_block_m(m)) or split_k is not None or stage_scales:
        return False
    bn = block_n or _default_block_n(m, n, nk, block_m or default_block_m(m))
    return n % bn == 0 and n // bn > NUM_SMS and nk >= 2 and m * STREAM_K_ROWS_PER_K <= nk * BLOCK


def _auto_swap_ab(m: int, block_m: int | None, block_n: int | None, quantize_x: bool, stream_k: bool | None) -> bool:
    """swap_ab=None: on up to ``SWAP_AB_UP_TO`` rows unless a choice excludes it (block_m, block_n 256, quantize_x,
    stream_k=True). Exact kernel times (ncu, 2026-12-04,
    benchmarks/results/fp8_decode_ncu_sweep_h200_2026-12-04.json): faster at 1 to 32 rows of q_a, q_b, wo and mlp.
    Above 8 rows the whole call with y stored through SMEM (``swap_store="smem"``) was faster than the unswapped
    call at 16 and 32 rows of q_b and mlp and 16 of wo, slower at 64 (whole-call GPU timeline, 2026-12-05,
    benchmarks/results/archive/fp8_tiles_time_smem_h200_2026-12-05.json); the y^T + transposing fusion form had been
    slower than the unswapped call there."""
    return (m <= SWAP_AB_UP_TO and block_m is None and block_n in (None, *SWAP_BLOCK_N) and not quantize_x
            and not stream_k)


def _auto_act_quant(m: int) -> str:
    """act_quant=None: "kernel" (``quantize_rows``) up to ``ACT_QUANT_KERNEL_UP_TO`` rows and from ``LARGE_M_FROM``,
    else "xla". In one executable (the model's step, one command buffer) the one kernel's call was as fast or
    faster at 1 and 64 rows (wo, mlp: scripts/diag/fp8_call_gap.py), and its kernels were busy for less time at
    128 (q_b, wo, mlp); a single waited call shows an idle gap between the two Mosaic kernels that chained calls
    do not. At 2048 rows it was faster than XLA's kernels at q_b, wo and mlp (which read x twice;
    benchmarks/results/archive/fp8_large_kernels_kpairs_h100_2026-12-06.json). Unmeasured in between."""
    return "kernel" if m <= ACT_QUANT_KERNEL_UP_TO or m >= LARGE_M_FROM else "xla"


def _ragged(bn: int) -> bool:
    """Whether ``bn``-wide tiles start inside weight-scale blocks at widths no whole chunk fits (not a multiple of
    64: 144, mlp's 18432 columns in 128 tiles): the chunks then take a weight scale per column
    (``_chunk_cols``)."""
    return bn % 64 != 0


def _chunk_cols(bm: int, bn: int, column_scales: bool = False) -> int:
    """Columns of a compute warpgroup's accumulator chunk: at most 128, inside one weight-scale block wherever the
    tile starts (a 192-wide tile at column 192 spans blocks 1 and 2: 64-column chunks). ``_ragged`` widths (and
    any width with ``column_scales``): the fewest equal chunks of at most 128 columns and a multiple of 8 (wgmma's
    N), each spanning at most two weight-scale blocks, scaled per column."""
    wn = bn if bm == 128 else bn // 2
    if not (_ragged(bn) or column_scales):
        return math.gcd(bn, BLOCK) if bm == 128 else math.gcd(wn, BLOCK, bn)
    q = -(-wn // BLOCK)
    while wn % q or (wn // q) % 8:
        q += 1
    return wn // q


def _ring_fit(stages: int, stage_bytes: int, fixed: int) -> int:
    """``stages``, fewer where a ring of ``stage_bytes`` stages beside ``fixed`` bytes of other buffers (scales,
    output tiles) would pass a CTA's SMEM (2 KB kept for barriers): a Mosaic GPU kernel over it does not compile."""
    fit = (SMEM_BYTES - 2048 - fixed) // stage_bytes
    if fit < 1:
        raise Unsupported(f"fp8_linear kernel: {fixed} bytes of scales and output tiles leave no SMEM for a "
                          f"{stage_bytes}-byte ring stage")
    return min(stages, fit)


def _staged_scale_bytes(nk: int, kps: int, row_scales: bool = True) -> int:
    """SMEM bytes of the staged scales: per compute warpgroup the row scales of the CTA's K range (``row_scales``:
    not with ``quantize_x``, which keeps them in registers) and the weight-scale rows."""
    return (2 * kps * 64 * 4 if row_scales else 0) + 2 * SW_ROWS * (nk + -nk % 4) * 4


def _staged_smem(bm: int, bn: int, nk: int, kps: int, stages: int, ep_bytes: int) -> int:
    """SMEM bytes of the staged-scales kernel: the TMA ring, the staged scales (``_staged_scale_bytes``) and
    ``ep_bytes`` of trimmed-epilogue staging tiles."""
    return stages * (bm + bn) * BLOCK + _staged_scale_bytes(nk, kps) + ep_bytes


def pad_weight_scales(sw: jax.Array) -> jax.Array:
    """Weight scales [..., rows, cols] (float32) as a kernel that copies ``SW_ROWS`` whole rows by TMA needs
    them: at least ``SW_ROWS`` rows and a multiple of 4 columns (16-byte rows). A no-op for the model's
    shapes (N >= 1024, K a multiple of 512), so it costs nothing per call there."""
    rows, cols = sw.shape[-2:]
    pad = ((0, max(0, SW_ROWS - rows)), (0, -cols % 4))
    return sw if pad == ((0, 0), (0, 0)) else jnp.pad(sw, ((0, 0),) * (sw.ndim - 2) + pad)


def ring_weight_scales(sw: jax.Array, bn: int | None = None) -> jax.Array:
    """Weight scales [N / 128, K / 128] as ``ring_scales`` streams them. ``bn`` None: sw^T [K / 128, N / 128 padded
    to a multiple of ``RING_SCALE_COLS``], a stage carrying its K block's whole row. ``bn`` given (the persistent
    loop's ``bn``-wide tiles): [K / 128, N / bn * ``RING_SCALE_COLS``], tile t's columns the scales of the blocks
    from the one holding its first column (floor(t bn / 128)) on, zero past the last block (a tile spans at most
    three). A copy moves multiples of 128 bytes (32 floats).

    Why per tile in the persistent loop: a compute warpgroup then indexes a step's scales by its columns' place in
    the tile, a constant where ``bn`` is a multiple of 128, instead of by the tile's index, which there was
    per-step arithmetic between the MMA issues. A CTA with one tile computes that index once; there the whole
    rows measured faster (mlp, 2048 rows, on an H100:
    benchmarks/results/archive/fp8_tile_scales_h100_2026-12-06.json)."""
    nb, nk = sw.shape
    if bn is None:
        return jnp.pad(sw.T, ((0, 0), (0, ring_weight_scales_cols(nb * BLOCK) - nb)))
    n_tiles = nb * BLOCK // bn
    idx = (np.arange(n_tiles) * bn // BLOCK)[:, None] + np.arange(RING_SCALE_COLS)[None]
    tiles = sw.T[:, np.minimum(idx, nb - 1)]  # [K / 128, tiles, 32]
    return jnp.where(jnp.asarray(idx < nb), tiles, 0.0).reshape(nk, n_tiles * RING_SCALE_COLS)


def ring_weight_scales_cols(n: int, per_tile: bool = False) -> int:
    """Columns of a ring stage's weight scales (``ring_weight_scales``) for n output features: ``RING_SCALE_COLS``
    per tile, else the whole row, ceil(n / 128) rounded up to ``RING_SCALE_COLS``."""
    if per_tile:
        return RING_SCALE_COLS
    blocks = -(-n // BLOCK)
    return -(-blocks // RING_SCALE_COLS) * RING_SCALE_COLS


def fence_slot_reads(body: Callable, interpret: bool | plgpu.InterpretGPUParams | None = None) -> Callable:
    """``body`` of ``plgpu.emit_pipeline_warp_specialized`` followed by a proxy fence in every thread, for compute
    warpgroups that read their slots through the generic proxy (``plgpu.load``: scales, tiles dequantised in
    registers; wgmma's operand reads are async-proxy reads).

    Why: the producer's next TMA write of a released slot is an async-proxy write, which the PTX memory model
    orders after those reads only across fence.proxy.async; the pipeline's consumed barrier alone does not (GPU
    interpret mode's race detector reports each such read against the slot's next write without the fence).
    Natively the fence is ``fence.proxy.async.shared::cta`` alone: under Lane semantics every thread arrives on
    the consumed barrier itself, so each thread's fence before its own release suffices, and ``commit_smem``'s
    warpgroup barrier would only add a rendezvous per step, which measured slower (benchmarks/results/archive/
    fence_proxy_h100_2026-12-06.json). In interpret mode (``interpret`` neither None nor False) the fence is
    ``commit_smem``, the one the interpreter models."""
    @functools.wraps(body)
    def fenced(*args):
        out = body(*args)
        generic_reads_fence(interpret)
        return out

    return fenced


def generic_reads_fence(interpret: bool | plgpu.InterpretGPUParams | None) -> None:
    """Orders the calling thread's generic-proxy SMEM reads before later async-proxy writes (TMA) of the same
    memory: natively ``proxy_fence`` (each thread then arrives on the barrier that releases the memory itself,
    Lane semantics), in interpret mode (``interpret`` neither None nor False) ``commit_smem``, the fence the
    interpreter models."""
    if interpret:
        plgpu.commit_smem()
    else:
        proxy_fence()


def proxy_fence() -> None:
    """``fence.proxy.async.shared::cta`` in the calling thread (native only: interpret mode cannot run it)."""
    @plgpu.inline_mgpu()
    def fence(_):
        from jax._src.lib.mlir.dialects import nvvm  # noqa: PLC0415 - lowering-time import
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

    fence()


def scale_window(first_row: jax.Array, rows: int) -> jax.Array:
    """The first of the ``SW_ROWS`` weight-scale rows a CTA copies to hold ``first_row`` (and the next ones
    its tile needs): ``first_row`` itself, moved back so the window ends inside the ``rows`` rows."""
    return jnp.minimum(first_row, rows - SW_ROWS)


def _pallas(x, wq, w_scale, *, block_n, **kw):
    """The kernel on any out: one that is no multiple of 128 runs on zero-padded weight rows (``pad_out_rows``), y's
    extra columns sliced off; a ``block_n`` must divide the padded out."""
    n = wq.shape[0]
    if n % BLOCK == 0:
        return _pallas_blocks(x, wq, w_scale, block_n=block_n, **kw)
    if isinstance(block_n, int) and block_n > 0 and (n + -n % BLOCK) % block_n:  # (other values: _check_tiles)
        raise ValueError(f"block_n {block_n} must divide out = {n} padded to whole 128-row scale blocks "
                         f"({n + -n % BLOCK})")
    return _pallas_blocks(x, pad_out_rows(wq), w_scale, block_n=block_n, **kw)[..., :n]


def _pallas_blocks(x, wq, w_scale, *, out_dtype, scale_fmt, interpret, block_m, block_n, split_k, stages, group_m,
                   stage_scales, quantize_x=False, stream_k=None, act_quant=None, swap_ab=None, swap_store=None,
                   persistent=None, ring_scales=None, k_pairs=None, store_overlap=None, column_scales=False,
                   profile_dir=None):
    _check_tiles(block_m, block_n, split_k, STAGES if stages is None else stages, group_m)
    if swap_ab is not None and not isinstance(swap_ab, bool):
        raise ValueError(f"swap_ab must be a bool or None, got {swap_ab!r}")
    if stage_scales is not None and not isinstance(stage_scales, bool):
        raise ValueError(f"stage_scales must be a bool or None, got {stage_scales!r}")
    for name, v in (("quantize_x", quantize_x), ("column_scales", column_scales)):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be a bool, got {v!r}")
    if stream_k is not None and not isinstance(stream_k, bool):
        raise ValueError(f"stream_k must be a bool or None, got {stream_k!r}")
    for name, v in (("persistent", persistent), ("ring_scales", ring_scales), ("k_pairs", k_pairs),
                    ("store_overlap", store_overlap)):
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{name} must be a bool or None, got {v!r}")
    if profile_dir is not None and interpret:
        raise ValueError("profile_dir: Mosaic GPU's profiler runs natively only (interpret mode has no trace)")
    if act_quant not in (None, "xla", "kernel"):
        raise ValueError(f"act_quant must be 'xla', 'kernel' or None, got {act_quant!r}")
    if swap_store not in (None,) + SWAP_STORES:
        raise ValueError(f"swap_store must be one of {SWAP_STORES} or None, got {swap_store!r}")
    n, k = wq.shape
    if not supports(n, k):
        raise Unsupported(f"fp8_linear kernel: in = {k} (wq shape) must be a multiple of {BLOCK}")
    given = isinstance(x, quant.QuantizedRows)
    if given and quantize_x:
        raise ValueError("quantize_x=True quantises x in the kernel: pass x itself, not a QuantizedRows")
    lead = x.shape[:-1]
    m = math.prod(lead)
    out_dtype = jnp.dtype(out_dtype)
    if m == 0:
        return jnp.zeros((*lead, n), out_dtype)
    nk = k // BLOCK
    act_quant = act_quant or _auto_act_quant(m)
    interpret = mosaic_interpret(interpret)
    auto_persistent, auto_ring = _auto_large_m(m, nk, split_k, stage_scales, quantize_x, stream_k, swap_ab)
    persistent = auto_persistent if persistent is None else persistent
    ring_scales = auto_ring if ring_scales is None else ring_scales
    if swap_ab is None:
        swap_ab = (_auto_swap_ab(m, block_m, block_n, quantize_x, stream_k)
                   and not (persistent or ring_scales or column_scales))
    elif swap_ab and (persistent or ring_scales or column_scales):
        raise Unsupported("fp8_linear kernel: swap_ab has no persistent, ring_scales or column_scales form")
    if swap_store is not None and not swap_ab:
        raise ValueError(f"swap_store={swap_store!r} is the swapped form's output (swap_ab), which this call does not "
                         f"use ({m} rows, swap_ab={swap_ab})")
    xm = x if given else x.reshape(m, k)
    if swap_ab:
        return _pallas_swapped(xm, wq, w_scale, out_dtype=out_dtype, scale_fmt=scale_fmt,
                               interpret=interpret, block_m=block_m, block_n=block_n, split_k=split_k, stages=stages,
                               stage_scales=stage_scales, quantize_x=quantize_x, stream_k=stream_k,
                               act_quant=act_quant, swap_store=swap_store,
                               profile_dir=profile_dir).reshape(*lead, n)
    stages = STAGES if stages is None else stages
    if stream_k is None:
        stream_k = _auto_stream_k(m, n, nk, block_m, block_n, split_k, stage_scales) and not (persistent or ring_scales)
    if (persistent or ring_scales) and (stage_scales or quantize_x):
        raise Unsupported(f"fp8_linear kernel: persistent and ring_scales take the scales from GMEM with x quantised "
                          f"outside (got stage_scales={stage_scales}, quantize_x={quantize_x})")
    if ring_scales and stream_k:
        raise Unsupported("fp8_linear kernel: ring_scales has no stream_k form")
    if k_pairs and not ring_scales:
        raise Unsupported("fp8_linear kernel: k_pairs reads both K blocks' scales from the ring: it needs ring_scales")
    if persistent and (stream_k or split_k not in (None, 1)):
        raise Unsupported(f"fp8_linear kernel: persistent takes whole tiles, no stream_k or split_k (got stream_k="
                          f"{stream_k}, split_k={split_k})")
    if stream_k and (m > 128 or split_k is not None or stage_scales or (block_m or default_block_m(m)) < m):
        raise Unsupported(f"fp8_linear kernel: stream_k takes at most 128 rows in one row tile, with unstaged "
                          f"scales and no split_k (got {m} rows, block_m {block_m}, split_k {split_k}, "
                          f"stage_scales {stage_scales})")
    bm, bn, s = _pick_tiles(m, n, nk, block_m, block_n, 1 if stream_k or persistent else split_k)
    if persistent and m <= bm:
        raise Unsupported(f"fp8_linear kernel: persistent loops over several row tiles ({m} rows in {bm}-row tiles "
                          "is one; the decode forms cover it)")
    if quantize_x and (bm != 64 or m > 64 or jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16)):
        raise Unsupported(f"fp8_linear kernel: quantize_x takes bfloat16 x of at most 64 rows in 64-row tiles "
                          f"(got {x.dtype}, {m} rows, block_m {bm})")
    mp = -(-m // bm) * bm
    mr = min(mp, -(-m // 8) * 8)
    trim = _trimmed(mp // bm, bm, s)
    # staged / ring scales with the trimmed epilogue can deadlock in interpret mode (INTERPRET_REFUSES_BARRIER_FORMS),
    # so there the default keeps the unstaged kernel (the GPU runs it: native tests and the benchmark)
    refuse = interpret and trim and INTERPRET_REFUSES_BARRIER_FORMS
    ctas = stream_k_ctas(n // bn, nk) if stream_k else 0
    # the output's staging tiles in SMEM: the trimmed epilogue's [64, chunk] per compute warpgroup (fp32 partials with
    # split_k / stream_k), the persistent loop's one per warpgroup and chunk
    ep_cols = ((bn if bm == 128 else bn // 2) if persistent
               else _chunk_cols(bm, bn, column_scales) if trim or ctas else 0)
    ep_bytes = 2 * 64 * ep_cols * (4 if s > 1 or ctas else out_dtype.itemsize)
    if stage_scales is None:
        stage_scales = (m < STAGE_SCALES_BELOW and not refuse
                        and _staged_smem(bm, bn, nk, nk // s, stages, ep_bytes) <= SMEM_BYTES)
    elif stage_scales and refuse:
        raise Unsupported("fp8_linear kernel: stage_scales=True with one row tile (the trimmed SMEM epilogue) hangs "
                          "in interpret mode on a small CPU thread pool; pass stage_scales=False (or None) there, "
                          "or run on the GPU")
    if ring_scales and refuse:
        raise Unsupported("fp8_linear kernel: ring_scales with one row tile (the trimmed SMEM epilogue) hangs in "
                          "interpret mode on a small CPU thread pool; pass more rows, or run on the GPU")
    if stream_k or persistent or ring_scales:
        stage_scales = False
    if k_pairs is None:  # decided with the tiles
        k_pairs = bool(ring_scales) and _auto_k_pairs(bm, bn, nk // s)
    kstep = 2 if k_pairs else 1
    if store_overlap is None:  # wherever it applies (faster at q_b and mlp, H100, 2048 rows:
        # benchmarks/results/archive/store_overlap_h100_2026-12-06.json)
        store_overlap = bool(persistent) and not k_pairs
    if store_overlap and (not persistent or k_pairs):
        raise Unsupported(f"fp8_linear kernel: store_overlap is a form of the persistent loop with one K block a step "
                          f"(got persistent={persistent}, k_pairs={k_pairs})")
    # a ring stage: the x and weight tiles of its K blocks, with ring_scales their row scales and weight-scale rows
    ring_bytes = 4 * (bm + ring_weight_scales_cols(n, persistent)) if ring_scales else 0  # its scales
    stage_bytes = kstep * ((bm + bn) * BLOCK + ring_bytes)
    if k_pairs and not _k_pairs_fit(bm, bn, nk // s, column_scales):
        raise Unsupported(f"fp8_linear kernel: k_pairs needs one accumulator chunk per warpgroup ({bm} x {bn} tiles "
                          f"make {_chunk_cols(bm, bn, column_scales)}-column chunks) and an even number of K blocks "
                          f"per CTA ({nk // s})")
    # beside the ring: the output's staging tiles, quantize_x's quantised x and the staged scales
    fixed = ep_bytes + (2 * 64 * BLOCK if quantize_x else 0)
    if stage_scales:
        fixed += _staged_scale_bytes(nk, nk // s, row_scales=not quantize_x)
    stages = _ring_fit(stages, stage_bytes, fixed)
    call = _build_call(mr=mr, mp=mp, n=n, k=k, bm=bm, bn=bn, splits=s, stages=stages, group_m=group_m,
                       out_dtype=out_dtype if s == 1 and not stream_k else jnp.dtype(jnp.float32),
                       interpret=interpret or None, stage_scales=stage_scales,
                       quantize_x=scale_fmt if quantize_x else None, stream_k=ctas,
                       persistent=min(NUM_SMS, (mp // bm) * (n // bn)) if persistent else 0,
                       ring_scales=ring_scales, k_pairs=k_pairs, store_overlap=store_overlap,
                       column_scales=column_scales, profile_dir=profile_dir)
    sw = w_scale.astype(jnp.float32)
    if stage_scales:
        sw = pad_weight_scales(sw)
    elif ring_scales:
        sw = ring_weight_scales(sw, bn if persistent else None)
    if quantize_x:
        y = call(xm, wq, sw)
    else:
        y = call(*_x_operands(xm, scale_fmt, act_quant, interpret, mp, mp, mp), wq, sw)
    if stream_k:  # a tile's j-th CTA wrote slot j; slots no CTA wrote hold whatever was there: masked
        _, _, written = stream_k_layout(n // bn, nk, ctas)
        y = jnp.where(jnp.asarray(np.repeat(written, bn, axis=1))[:, None, :], y, 0.0).sum(axis=0)
    elif s > 1:
        y = jnp.sum(y, axis=0)
    return y[:m].astype(out_dtype).reshape(*lead, n)


def _pallas_swapped(x, wq, w_scale, *, out_dtype, scale_fmt, interpret, block_m, block_n, split_k, stages,
                    stage_scales, quantize_x, stream_k, act_quant, swap_store, profile_dir):
    """``swap_ab=True``: x [M, K] -> y [M, N] through ``_build_swapped_call`` (x quantised by ``quantize_rows`` or
    XLA as ``act_quant`` says; the tiles' defaults are the 64-row decode ones of ``_pick_tiles``)."""
    m, k = x.shape
    n, nk = wq.shape[0], k // BLOCK
    if m > 128 or block_m is not None or quantize_x or stream_k:
        raise Unsupported(f"fp8_linear kernel: swap_ab takes at most 128 rows, and no block_m, quantize_x or "
                          f"stream_k (got {m} rows, block_m {block_m}, quantize_x {quantize_x}, stream_k {stream_k})")
    if block_n not in (None, *SWAP_BLOCK_N):
        raise Unsupported(f"fp8_linear kernel: swap_ab takes block_n 64, 128 or 192 (a compute warpgroup per 64 "
                          f"weight rows, at most three), got {block_n}")
    wide = _default_block_n(1, n, nk, 64)  # the decode default, but at most three compute warpgroups
    _, bn, s = _pick_tiles(min(m, 64), n, nk, 64, block_n or (128 if wide == 256 else wide), split_k)
    mr = -(-m // 8) * 8
    # the staged scales can deadlock in interpret mode here too (INTERPRET_REFUSES_BARRIER_FORMS): there the default
    # loads each K block's scales from GMEM
    refuse = interpret and INTERPRET_REFUSES_BARRIER_FORMS
    if stage_scales and refuse:
        raise Unsupported("fp8_linear kernel: swap_ab with stage_scales=True hangs in interpret mode on a small CPU "
                          "thread pool; pass stage_scales=None or False there, or run on the GPU")
    staged = not refuse if stage_scales is None else stage_scales
    store = swap_store or ("rows" if m <= SWAP_ROWS_OUT_UP_TO else "smem")
    y_dtype = jnp.dtype(out_dtype) if s == 1 else jnp.dtype(jnp.float32)
    y_tiles = (bn // 64) * mr * 64 * y_dtype.itemsize if store == "smem" else 0
    stages = _swapped_stages(stages, mr, bn, nk, nk // s, staged, y_tiles)
    call = _build_swapped_call(mr=mr, n=n, k=k, bn=bn, splits=s, stages=stages, out_dtype=y_dtype,
                               interpret=interpret or None, rows_out=m if store == "rows" else 0, stage_scales=staged,
                               smem_out=store == "smem", profile_dir=profile_dir)
    sw = w_scale.astype(jnp.float32)
    sw = pad_weight_scales(sw) if staged else sw
    y = call(*_x_operands(x, scale_fmt, act_quant, interpret, -(-m // 64) * 64, mr, swapped_scale_cols(mr)), wq, sw)
    y = y if s == 1 else jnp.sum(y, axis=0)
    if store == "smem":  # [mr, N]: the padded rows dropped
        y = y[:m]
    elif store == "transpose":  # y^T [N, mr]
        y = y[:, :m].T
    return y.astype(out_dtype)


def _x_operands(x: jax.Array | quant.QuantizedRows, scale_fmt: quant.ScaleFmt, act_quant: str, interpret, mp: int,
                rows: int, cols: int) -> tuple[jax.Array, jax.Array]:
    """x [M, K] as both kernel forms read it: (xq e4m3, sx^T float32 [K / 128, .]; a CTA's row scales of one K
    block contiguous). ``quantize_rows`` (``mp`` rows, a multiple of 64) where ``act_quant`` is "kernel" and it
    applies (bfloat16, M < 8 or a multiple of 8), else XLA's ``act_quant`` padded to ``rows`` rows of xq and ``cols``
    columns of sx^T. A ``QuantizedRows`` goes in as ``quantize_rows`` would have made it: ``mp`` rows of both (a
    padded or cut copy where it has another count)."""
    if isinstance(x, quant.QuantizedRows):
        q, st = x.q, x.st
        if q.shape[0] != mp:
            q = q[:mp] if q.shape[0] > mp else jnp.pad(q, ((0, mp - q.shape[0]), (0, 0)))
            # a padded row's scale is never read into y (its q is zero): 1.0
            st = st[:, :mp] if st.shape[1] > mp else jnp.pad(st, ((0, 0), (0, mp - st.shape[1])), constant_values=1.0)
        return q, st
    m = x.shape[0]
    if act_quant == "kernel" and jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16) and (m <= 8 or m % 8 == 0):
        return quantize_rows(x, mp, scale_fmt, interpret=interpret or False)
    xq, sx = quant.act_quant(x, BLOCK, scale_fmt)
    return jnp.pad(xq, ((0, rows - m), (0, 0))), jnp.pad(sx.T, ((0, 0), (0, cols - m)))


def swapped_scale_cols(mr: int) -> int:
    """Columns of sx^T the swapped kernel stages per K block: mr rounded up to 32 (a warpgroup's copy moves a
    multiple of 128 bytes)."""
    return -(-mr // 32) * 32


def _swapped_stages(stages: int | None, mr: int, bn: int, nk: int, kps: int, staged: bool = True,
                    y_tiles: int = 0) -> int:
    """The swapped kernel's ring depth: ``stages``, fewer where the ring and the staged scales would pass SMEM.
    None: about ``SWAP_RING_BYTES`` in flight, at least ``STAGES`` (a stage is only (mr + bn) x 128 bytes here: wo's
    128-wide tiles take 6 stages for it, faster than 4 in most pairs at 1 and 8 rows, while q_b's and mlp's
    192-wide tiles were slower with 6 than with 4;
    archive/fp8_decode_ncu_sweep_h200_2026-12-04_raw.json, runs 5, 9, 10)."""
    if stages is None:
        stages = max(STAGES, SWAP_RING_BYTES // ((mr + bn) * BLOCK))
    fixed = (kps * swapped_scale_cols(mr) * 4 + SW_ROWS * (nk + -nk % 4) * 4 if staged else 0) + y_tiles
    return max(1, min(_ring_fit(stages, (mr + bn) * BLOCK, fixed), kps))


def row_scales(amax: jax.Array, scale_fmt: quant.ScaleFmt) -> jax.Array:
    """``quant.block_scale`` (act_quant's floor) in operations a Mosaic GPU kernel has: the "ue8m0" power of two
    from the float32 exponent bits (``quant.ue8m0_scale_bits``) instead of frexp / ldexp. Equal to it bit for
    bit (tests/test_kernel_fp8_gemm.py)."""
    if scale_fmt == "amax":
        return quant.block_scale(amax, "amax", quant.ACT_AMAX_FLOOR)
    return quant.ue8m0_scale_bits(amax, quant.ACT_AMAX_FLOOR)[0]


def _quantize_tile(xv: jax.Array, scale_fmt: quant.ScaleFmt) -> tuple[jax.Array, jax.Array]:
    """act_quant of a float32 [64, 128] register tile (one K block of 64 rows): (e4m3 tile, row scales)."""
    sx = row_scales(jnp.max(jnp.abs(xv), axis=1), scale_fmt)
    xq = jnp.clip(xv / lax.broadcast_in_dim(sx, xv.shape, [0]), -quant.FP8_MAX, quant.FP8_MAX)
    return xq.astype(quant.FP8), sx


def quantize_rows(x: jax.Array, mp: int, scale_fmt: quant.ScaleFmt, *,
                  interpret: bool | plgpu.InterpretGPUParams | None = None) -> tuple[jax.Array, jax.Array]:
    """act_quant of x [M, K] (bfloat16) in the layout the GEMM kernel reads, in one kernel: (xq e4m3 [mp, K]
    with zero rows past M, sx^T float32 [K / 128, mp]). XLA spends three kernels on it (the amax reduction,
    the padded e4m3 x, the padded transposed scales), each near the launch floor at decode sizes.

    One CTA (one warpgroup) per (64-row tile, K block): the x tile arrives by TMA (rows past M zero-filled by
    TMA's bounds: x is not padded), is quantised in registers as in the GEMM's ``quantize_x`` (``row_scales``)
    and leaves by TMA as e4m3 plus its 64 row scales. Same values as ``quant.act_quant``, bit for bit (tests)."""
    m, k = x.shape
    if (jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16) or k % BLOCK or mp % 64 or mp < m
            or (m > 8 and m % 8)):
        # TMA boxes past the rows need the row count below or a multiple of the 8-row tiling
        raise Unsupported(f"quantize_rows: bfloat16 x with in a multiple of {BLOCK}, M < 8 or a multiple of 8, "
                          f"and mp a multiple of 64 >= M (got {x.dtype}, {x.shape}, mp {mp})")
    interpret = mosaic_interpret(interpret)
    return _build_quantize_rows(m=m, mp=mp, k=k, scale_fmt=scale_fmt, interpret=interpret)(x)


@functools.lru_cache(maxsize=None)
def _build_quantize_rows(*, m: int, mp: int, k: int, scale_fmt: quant.ScaleFmt,
                         interpret: plgpu.InterpretGPUParams | None):
    nk = k // BLOCK
    L = plgpu.Layout.WGMMA

    def kernel(x_ref, xq_ref, sxt_ref, x_s, xq_s, sx_s, bar):
        pid = lax.axis_index("cta")
        rows, cols = pl.ds((pid // nk) * 64, 64), pl.ds((pid % nk) * BLOCK, BLOCK)
        plgpu.copy_gmem_to_smem(x_ref.at[rows, cols], x_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        xq_s[...], sx_s[...] = _quantize_tile(plgpu.load(x_s, layout=L).astype(jnp.float32), scale_fmt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(xq_s, xq_ref.at[rows, cols])
        plgpu.copy_smem_to_gmem(sx_s, sxt_ref.at[pid % nk, rows])
        plgpu.wait_smem_to_gmem(0)

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=(jax.ShapeDtypeStruct((mp, k), quant.FP8),
                                          jax.ShapeDtypeStruct((nk, mp), jnp.float32)),
                        grid=(mp // 64 * nk,), grid_names=("cta",), compiler_params=params,
                        scratch_types=[plgpu.SMEM((64, BLOCK), jnp.bfloat16, transforms=_SWZ16),
                                       plgpu.SMEM((64, BLOCK), quant.FP8, transforms=_SWZ8),
                                       plgpu.SMEM((64,), jnp.float32), plgpu.Barrier(num_barriers=1)],
                        interpret=interpret if interpret is not None else False, kernel_name=QUANTIZE_KERNEL)


def stream_k_ctas(n_tiles: int, nk: int) -> int:
    """CTAs of a stream-K call: one wave (one per SM), fewer only when there are fewer units."""
    return min(NUM_SMS, n_tiles * nk)


def stream_k_owner(u, units: int, ctas: int):
    """The CTA whose run holds unit u: the largest c with c U // P <= u (numpy or traced integers)."""
    return ((u + 1) * ctas - 1) // units


def stream_k_layout(n_tiles: int, nk: int, ctas: int) -> tuple[int, int, np.ndarray]:
    """Stream-K over ``n_tiles`` column tiles x ``nk`` K blocks on ``ctas`` CTAs (CTA c takes the units
    [c U / P, (c + 1) U / P), K fastest): (steps per CTA, J = the most CTAs sharing one tile, ``written``
    bool [J, n_tiles]: whether a tile has a j-th CTA). The j-th CTA of tile t (counted from the owner of its
    first unit) writes its partial to slot j of the [J, rows, N] output. Every tile's units are shared: whole
    tiles first and only the remainder shared (so that the fixup reads fewer partials) made mlp's kernel as slow
    as no stream-K at 64 and 128 rows (archive/fp8_decode_ncu_sweep_h200_2026-12-02.json, runs 0 and 1), and was
    reverted; why is not measured (one guess: every CTA then starts its tile at K block 0 at once)."""
    units = n_tiles * nk
    t = np.arange(n_tiles)
    count = stream_k_owner((t + 1) * nk - 1, units, ctas) - stream_k_owner(t * nk, units, ctas) + 1
    return -(-units // ctas), int(count.max()), np.arange(count.max())[:, None] < count[None, :]


def _trimmed(m_tiles: int, bm: int, splits: int) -> bool:
    """One row tile (decode, M <= 128) stores only its first round_up(M, 8) rows, through SMEM and TMA stores.
    Stored from registers, the padded rows of a one-row q_b call are 3 MB of writes beside 38 MB of weights, in
    half-used 32-byte sectors (Nsight Compute, 2026-12-03), and a full 128-row tile's uncoalesced register stores
    were the longest part of its CTAs' tail (``scripts/diag/fp8_regions.py``, 2026-12-04). Not a 128-row tile's
    split-K partials: their fp32 staging tiles (64 KB) would push wo's staged scales out of SMEM."""
    return m_tiles == 1 and (bm == 64 or splits == 1)


# ----------------------------------------------------------------------------------------------------
# the kernel
@functools.lru_cache(maxsize=None)
def _build_call(*, mr: int, mp: int, n: int, k: int, bm: int, bn: int, splits: int, stages: int, group_m: int,
                out_dtype: jnp.dtype, interpret: plgpu.InterpretGPUParams | None, stage_scales: bool = False,
                quantize_x: quant.ScaleFmt | None = None, stream_k: int = 0, persistent: int = 0,
                ring_scales: bool = False, k_pairs: bool = False, store_overlap: bool = False,
                column_scales: bool = False, profile_dir: str | None = None):
    """``quantize_x`` (a scale format; 64-row tiles only): the kernel takes bfloat16 x [Mp, K] and no scales of
    it, and each compute warpgroup quantises the K block's x tile into its own e4m3 SMEM tile before its MMA
    (the row scales stay in registers for the promotion): x (arguments x, w, sw), else (xq, sx^T, w, sw).
    ``stream_k`` = P > 0 (one 64- or 128-row tile, unstaged scales): P CTAs split the (column tile, K block)
    units evenly, each a contiguous run that may span tiles; at each tile's end in its run a CTA stores its fp32
    partial [mr, bn] into slot j of [J, mr, N] at the tile's columns, j = its rank among the tile's CTAs
    (``stream_k_layout``).
    ``persistent`` = P > 0 (several row tiles, one split, unstaged scales): P CTAs loop over whole output tiles,
    CTA c taking tiles c, c + P, ... in the rasterised order, through one pipeline of (tile, K block) steps; at a
    tile's last K block each compute warpgroup writes its rows into an SMEM tile per chunk and TMA stores them,
    and the ring keeps streaming the next tile's blocks meanwhile; a CTA's step count is traced (its own tiles).
    ``ring_scales`` (unstaged scales, x quantised outside, no stream_k; the weight scales given as
    ``ring_weight_scales``' form: whole rows, per-tile rows when ``persistent``): the ring's stages also carry each
    step's sx^T[kb, the tile's rows] and the weight scales at kb, which the promotion reads from SMEM; each step
    ends with a proxy fence (``fence_slot_reads``).
    ``k_pairs`` (with ``ring_scales``, one accumulator chunk per warpgroup, an even K range): a pipeline step is
    two K blocks; each compute warpgroup issues both blocks' MMAs into two accumulators, then promotes the first
    while the second runs, so that only every second promotion leaves its warpgroup's MMAs idle.
    ``store_overlap`` (``persistent``, no ``k_pairs``): a tile's accumulators are carried into the next tile's
    first step and stored (``flush``) between that step's MMA issue and its wait; the last tile after the loop."""
    nk = k // BLOCK
    sw_cols = ring_weight_scales_cols(n, bool(persistent))  # ring_scales: a stage's weight scales
    sw_rows = max(-(-n // BLOCK), SW_ROWS)  # rows of the (padded) weight scales, when staged
    kps = nk // splits  # K blocks per CTA
    m_tiles, n_tiles = mp // bm, n // bn
    tiles = m_tiles * n_tiles
    split_m = bm == 128  # warpgroups split the tile's rows (128) or its columns (64-row tiles)
    wn = bn if split_m else bn // 2  # output columns per warpgroup
    cw = _chunk_cols(bm, bn, column_scales)
    nch = wn // cw
    L = plgpu.Layout.WGMMA
    ROW, COL = L.reduce(1), L.reduce(0)
    ragged = _ragged(bn) or column_scales  # per-column weight scales (``_chunk_cols``)
    # one row tile (decode) keeps only the first mr = round_up(M, 8) rows (``_trimmed``): fp32 partials of all 64
    # rows would be written and read back once per split (as many bytes as the weights); one split's output in
    # out_dtype, its padded rows never written
    trim = _trimmed(m_tiles, bm, splits) or stream_k > 0
    ep_dtype = jnp.dtype(jnp.float32) if splits > 1 or stream_k else jnp.dtype(out_dtype)
    if stream_k and (m_tiles != 1 or stage_scales or splits != 1):
        raise ValueError("stream_k needs one row tile, unstaged scales and no split_k")
    units = n_tiles * nk
    spc, slots = stream_k_layout(n_tiles, nk, stream_k)[:2] if stream_k else (kps, 1)
    swz, swz16 = _SWZ8, _SWZ16
    if quantize_x and bm != 64:
        raise ValueError("quantize_x needs 64-row tiles")
    if persistent and (m_tiles < 2 or splits != 1 or stage_scales or quantize_x or stream_k):
        raise ValueError("persistent needs several row tiles, one split, unstaged scales and x quantised outside")
    if ring_scales and (stage_scales or quantize_x or stream_k):
        raise ValueError("ring_scales needs unstaged scales, x quantised outside and no stream_k")
    kstep = 2 if k_pairs else 1  # K blocks per pipeline step
    if store_overlap and (not persistent or k_pairs):
        raise ValueError("store_overlap needs the persistent loop and one K block a step")
    if k_pairs and (not ring_scales or nch != 1 or kps % 2 or nk % 2 or stream_k):
        raise ValueError("k_pairs needs ring_scales, one accumulator chunk per warpgroup, an even number of K "
                         "blocks per CTA and no stream_k")
    if persistent:  # the most steps a persistent CTA runs: its tiles' K blocks (the first tiles % P CTAs one tile more)
        spc = -(-tiles // persistent) * nk
    spc //= kstep
    nks = nk // kstep  # pipeline steps per whole K range

    def tile_of(t):
        """Output tile t (of one split) -> (mi, ni): groups of ``group_m`` M tiles, M fastest inside a group,
        so that the CTAs resident at once share a few x row tiles and a band of weight tiles in L2."""
        g = min(group_m, m_tiles)  # a group of more M tiles than there are is all of them
        per_group = g * n_tiles
        first = (t // per_group) * g
        # every group full: a constant divisor, so the steps that call this (the persistent loop's, every step of
        # both compute warpgroups) do no integer division (the SASS of q_b's ring kernel had one per step)
        size = g if m_tiles % g == 0 else jnp.minimum(m_tiles - first, g)
        r = t % per_group
        return first + r % size, r // size

    def kernel(*refs):
        if quantize_x:
            (x_ref, w_ref, sw_ref, o_ref), sxt_ref, rest = refs[:4], None, list(refs[4:])
        else:
            (x_ref, sxt_ref, w_ref, sw_ref, o_ref), rest = refs[:5], list(refs[5:])
        ep_s = rest.pop(0) if trim or persistent else None
        xq_s = rest.pop(0) if quantize_x else None  # [2, 64, 128] e4m3: each compute warpgroup's quantised x
        sx_s = rest.pop(0) if stage_scales and not quantize_x else None
        sw_s, bar = (rest.pop(0), rest.pop(0)) if stage_scales else (None, None)
        pid = lax.axis_index("cta")
        si = pid // tiles
        mi, ni = tile_of(pid % tiles)
        m0, n0, kb0 = mi * bm, ni * bn, si * kps
        # unit(step) -> (row tile, column tile, K block, live) of a pipeline step; a step that is not live repeats
        # a unit of the CTA's (in-bounds loads) and adds nothing
        if stream_k:  # this CTA's units [u0, u0 + n_units): (column tile, K block) pairs, K fastest
            u0 = pid * units // stream_k
            n_units = (pid + 1) * units // stream_k - u0

            def unit(step):  # steps past the CTA's units repeat its last one
                u = u0 + jnp.minimum(step, n_units - 1)
                return mi, u // nk, u % nk, step < n_units
        elif persistent:
            def unit(step):  # round j: tile pid + j P (the CTA's pipeline runs only its own tiles' steps)
                tmi, tni = tile_of(pid + (step // nks) * persistent)
                return tmi, tni, step % nks * kstep, True
        else:
            def unit(step):
                return mi, ni, kb0 + step * kstep, True

        # the pipeline's steps in this CTA: a persistent CTA's own tiles' K blocks (a traced count: the CTAs past
        # tiles % P have one tile fewer and stop, where a static count would have them repeat a tile for nothing)
        steps = (tiles - pid + persistent - 1) // persistent * nks if persistent else spc

        def trimmed_rows():
            """(warpgroup, first output row, rows) of each warpgroup that stores real rows of a trimmed tile (in a
            128-row tile with at most 64 real rows, the second warpgroup's are all padding)."""
            spans = [(w, w * 64, min(64, mr - w * 64)) if split_m else (w, 0, mr) for w in range(2)]
            return [sp for sp in spans if sp[2] > 0]

        def wg_cols(wg, tile=None):  # first output column of this warpgroup's accumulator
            base = (ni if tile is None else tile) * bn
            return base if split_m else base + wg * wn

        def body(idx, x_s, w_s, *rest):
            with jax.named_scope("step"):  # regions of the Mosaic GPU profiler (``profile_dir``)
                # ring_scales: the step's row scales [kstep, bm] and its tile's weight scales [kstep, 32] in SMEM
                ring = rest[:2] if ring_scales else None
                return step_body(idx, x_s, w_s, rest[-1], ring)

        if ring_scales:  # the promotion reads the slots' scales through the generic proxy
            body = fence_slot_reads(body, interpret)

        def w_scale(wg, tile, kb, col0, live, ring=None, h=0):
            """The weight scale at K block kb of the chunk from column ``col0`` (of this CTA's tile when staged): one
            scalar, or with ``ragged`` tiles a [cw] vector along the accumulator's columns (two blocks' scales,
            split where the chunk crosses into the second); 0 for a repeated stream-K unit (not ``live``: it adds
            nothing)."""
            def get(b):
                if ring is not None:  # row h of the step's K blocks (persistent: b counts from the tile's first block)
                    return ring[1][h, b]
                return sw_s[wg, b - scale_window(n0 // BLOCK, sw_rows), kb] if stage_scales else sw_ref[b, kb]

            if ring is not None and persistent:  # columns from the tile's first block (no tile index for bn % 128 == 0)
                col0 = (0 if bn % BLOCK == 0 else tile * bn % BLOCK) + (0 if split_m else wg * wn) + col0
            else:
                col0 = (wg_cols(wg) if stage_scales else wg_cols(wg, tile)) + col0
            b0 = col0 // BLOCK
            if not ragged:
                v = get(b0)
            else:
                s0, s1 = get(b0), get((col0 + cw - 1) // BLOCK)  # the blocks of its first and last columns
                col = col0 + plgpu.broadcasted_iota(jnp.int32, (cw,), 0, layout=COL)
                v = jnp.where(col < (b0 + 1) * BLOCK, s0, s1)
            return v * live.astype(jnp.float32) if stream_k else v

        def promote(blk, sx, sw):
            """A [64, cw] block times its scales: the row scales ``sx`` [64] times the weight scale ``sw`` (one, or
            with ``ragged`` tiles one per column [cw]), broadcast only here, as the block is promoted."""
            if ragged:
                return blk * (lax.broadcast_in_dim(sx, blk.shape, [0]) * lax.broadcast_in_dim(sw, blk.shape, [1]))
            return blk * lax.broadcast_in_dim(sx * sw, blk.shape, [0])

        def pair_body(step, x_s, w_s, acc, ring):
            """``k_pairs``: the step's two K blocks into two accumulators; the first promoted while the second runs."""
            tmi, tile, kb, live = unit(step)
            wg = lax.axis_index("wg")
            a = x_s.at[pl.ds(wg * 64, 64)] if split_m else x_s
            c0 = 0 if split_m else wg * wn
            rows = pl.ds(wg * 64 if split_m else 0, 64)

            def mma(acc_a, acc_b):
                for h, acc_h in enumerate((acc_a, acc_b)):
                    plgpu.wgmma(acc_h, a.at[:, pl.ds(h * BLOCK, BLOCK)], w_s.at[pl.ds(c0, cw), pl.ds(h * BLOCK, BLOCK)].T)
                sv = [(plgpu.load(ring[0].at[h, rows], layout=ROW, optimized=False),  # loaded while the MMAs run
                       w_scale(wg, tile, kb + h, 0, live, ring, h)) for h in range(2)]
                out = acc[0] + promote(plgpu.wgmma_accumulator_load(acc_a, wait_n=1), *sv[0])
                return out + promote(acc_b[...], *sv[1])

            return (pl.run_scoped(mma, plgpu.ACC((64, cw), jnp.float32), plgpu.ACC((64, cw), jnp.float32)),)

        def step_body(idx, x_s, w_s, acc, ring):
            (step,) = idx
            out = (pair_body if k_pairs else block_body)(step, x_s, w_s, acc, ring)
            if persistent and not store_overlap:  # the tile's last step stores it (TMA, asynchronous), next at 0;
                # the tile's indices only in that branch
                out = lax.cond(unit(step)[2] == nk - kstep, lambda o: flush(*unit(step)[:2], o), lambda o: o, out)
            return out

        def block_body(step, x_s, w_s, acc, ring):
            """One K block a step (``k_pairs`` off)."""
            tmi, tile, kb, live = unit(step)
            wg = lax.axis_index("wg")
            a = x_s.at[pl.ds(wg * 64, 64)] if split_m else x_s
            r0 = tmi * bm + wg * 64 if split_m else tmi * bm
            c0 = 0 if split_m else wg * wn  # first column of this warpgroup inside the W tile
            out, sxv = [], None
            if quantize_x:  # act_quant of this K block's 64 rows, in registers, into the warpgroup's e4m3 tile
                xq, sxq = _quantize_tile(plgpu.load(a, layout=L).astype(jnp.float32), quantize_x)
                xq_s.at[wg][...] = xq
                plgpu.commit_smem()
                a = xq_s.at[wg]

            for c in range(nch):  # chunks run one after the other: one [64, cw] MMA accumulator at a time
                def mma(blk_ref, c=c, acc=acc):
                    plgpu.wgmma(blk_ref, a, w_s.at[pl.ds(c0 + c * cw, cw)].T)
                    # the block's scales load while the MMA runs (from SMEM when staged or through the ring)
                    if quantize_x or c:  # the row scales are already in registers
                        sx_c = None
                    elif ring is not None:
                        sx_c = plgpu.load(ring[0].at[0, pl.ds(wg * 64 if split_m else 0, 64)], layout=ROW,
                                          optimized=False)
                    elif stage_scales:
                        sx_c = plgpu.load(sx_s.at[wg, step], layout=ROW, optimized=False)
                    else:
                        sx_c = plgpu.load(sxt_ref.at[kb, pl.ds(r0, 64)], layout=ROW, optimized=False)
                    sw_c = w_scale(wg, tile, kb, c * cw, live, ring)
                    if store_overlap and c == 0:  # the tile finished a step ago leaves while this MMA runs
                        acc = lax.cond((kb == 0) & (step > 0), lambda o: flush(*unit(step - 1)[:2], o),
                                       lambda o: o, acc)
                    plgpu.wgmma_wait(0)
                    return blk_ref[...], sx_c, sw_c, acc

                blk, sx_c, sw_c, acc = pl.run_scoped(mma, plgpu.ACC((64, cw), jnp.float32))
                if c == 0:
                    sxv = sxq if quantize_x else sx_c
                out.append(acc[c] + promote(blk, sxv, sw_c))
            if stream_k:  # the run leaves this tile: store the partial (slot = its rank in the tile), start the next at 0
                done = live & ((kb == nk - 1) | (step == n_units - 1))
                for w, r0w, rows_w in trimmed_rows():
                    @pl.when(done & (wg == w))
                    def _(w=w, r0w=r0w, rows_w=rows_w):
                        for c in range(nch):
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            ep_s.at[w][...] = out[c]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(ep_s.at[w, pl.ds(0, rows_w)],
                                                    o_ref.at[pid - stream_k_owner(tile * nk, units, stream_k),
                                                             pl.ds(r0w, rows_w), pl.ds(wg_cols(w, tile) + c * cw, cw)])
                keep = 1.0 - done.astype(jnp.float32)
                out = [o * keep for o in out]
            return tuple(out)

        def flush(tmi, tile, out):
            """``persistent``: this warpgroup's rows of a finished tile into its SMEM tiles (one per chunk; the
            previous tile's stores, a whole tile of K blocks ago, have read them) and out by TMA stores that the
            next tile's MMAs need not wait for; returns the zeroed accumulators."""
            wg = lax.axis_index("wg")
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            for c in range(nch):
                ep_s.at[wg, c][...] = out[c].astype(ep_dtype)
            plgpu.commit_smem()
            rows = pl.ds(tmi * bm + wg * 64, 64) if split_m else pl.ds(tmi * bm, 64)
            for c in range(nch):
                plgpu.copy_smem_to_gmem(ep_s.at[wg, c], o_ref.at[rows, pl.ds(wg_cols(wg, tile) + c * cw, cw)])
            return tuple(plgpu.layout_cast(jnp.full((64, cw), 0.0, jnp.float32), L) for _ in range(nch))

        def compute(run_pipeline):
            with jax.named_scope("scales"):
                stage()
            with jax.named_scope("loop"):
                zeros = tuple(plgpu.layout_cast(jnp.full((64, cw), 0.0, jnp.float32), L) for _ in range(nch))
                acc = run_pipeline(zeros)
                if store_overlap:  # the CTA's last tile (every persistent CTA has at least one)
                    flush(*unit(steps - 1)[:2], acc)
            with jax.named_scope("store"):
                store(acc)

        def stage():
            if stage_scales:  # this warpgroup's row scales over the CTA's K range, and SW_ROWS weight-scale rows
                w = lax.axis_index("wg")
                rows = pl.ds(m0 + w * 64, 64) if split_m else pl.ds(m0, 64)
                if not quantize_x:
                    plgpu.copy_gmem_to_smem(sxt_ref.at[pl.ds(kb0, kps), rows], sx_s.at[w], bar.at[w])
                plgpu.copy_gmem_to_smem(sw_ref.at[pl.ds(scale_window(n0 // BLOCK, sw_rows), SW_ROWS)], sw_s.at[w],
                                        bar.at[w])
                plgpu.barrier_wait(bar.at[w])

        def store(acc):
            wg = lax.axis_index("wg")
            if stream_k or persistent:  # the tiles or partials went out in the body
                plgpu.wait_smem_to_gmem(0)
                return
            if trim:  # one row tile: only the first mr rows, through SMEM and a TMA store
                for w, r0w, rows_w in trimmed_rows():
                    @pl.when(wg == w)
                    def _(w=w, r0w=r0w, rows_w=rows_w):
                        for c in range(nch):
                            if c:
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            ep_s.at[w][...] = acc[c].astype(ep_dtype)
                            plgpu.commit_smem()
                            cols = pl.ds(wg_cols(w) + c * cw, cw)
                            plgpu.copy_smem_to_gmem(ep_s.at[w, pl.ds(0, rows_w)],
                                                    o_ref.at[si, pl.ds(r0w, rows_w), cols] if splits > 1 else
                                                    o_ref.at[pl.ds(r0w, rows_w), cols])
                        plgpu.wait_smem_to_gmem(0)
                return
            rows = pl.ds(m0 + wg * 64, 64) if split_m else pl.ds(m0, 64)
            for c in range(nch):
                cols = pl.ds(wg_cols(wg) + c * cw, cw)
                if splits == 1:
                    o_ref.at[rows, cols][...] = acc[c].astype(out_dtype)
                else:
                    o_ref.at[si, rows, cols][...] = acc[c]

        x_tf = swz16 if quantize_x else swz
        kw = kstep * BLOCK  # a step's K width
        if stream_k or persistent:  # whole arrays: the blocks follow the CTA's units
            ring_specs = [plgpu.BlockSpec((kstep, bm), lambda s: (unit(s)[2] // kstep, unit(s)[0])),
                          plgpu.BlockSpec((kstep, sw_cols), lambda s: (unit(s)[2] // kstep, unit(s)[1]))
                          ] if ring_scales else []
            pipeline = plgpu.emit_pipeline_warp_specialized(
                body, grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
                max_concurrent_steps=min(stages, spc), compute_context=compute,
                in_specs=[plgpu.BlockSpec((bm, kw), lambda s: (unit(s)[0], unit(s)[2] // kstep), transforms=x_tf),
                          plgpu.BlockSpec((bn, kw), lambda s: (unit(s)[1], unit(s)[2] // kstep), transforms=swz),
                          *ring_specs])
            with jax.named_scope("all"):
                pipeline(x_ref, w_ref, *((sxt_ref, sw_ref) if ring_scales else ()))
            return
        ring_specs = [plgpu.BlockSpec((kstep, bm), lambda s: (s, 0)),
                      plgpu.BlockSpec((kstep, sw_cols), lambda s: (s, 0))] if ring_scales else []
        pipeline = plgpu.emit_pipeline_warp_specialized(
            body, grid=(kps // kstep,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=min(stages, kps // kstep), compute_context=compute,
            in_specs=[plgpu.BlockSpec((bm, kw), lambda s: (0, s), transforms=x_tf),
                      plgpu.BlockSpec((bn, kw), lambda s: (0, s), transforms=swz), *ring_specs])
        ring_refs = (sxt_ref.at[pl.ds(kb0, kps), pl.ds(m0, bm)], sw_ref.at[pl.ds(kb0, kps)]) if ring_scales else ()
        with jax.named_scope("all"):
            pipeline((x_ref.at[:, pl.ds(kb0 * BLOCK, kps * BLOCK)] if quantize_x and x_ref.shape[0] < bm else
                      x_ref.at[pl.ds(m0, bm), pl.ds(kb0 * BLOCK, kps * BLOCK)]),
                     w_ref.at[pl.ds(n0, bn), pl.ds(kb0 * BLOCK, kps * BLOCK)], *ring_refs)

    rows_out = mr if trim else mp
    out_shape = (rows_out, n) if splits == 1 else (splits, rows_out, n)
    if stream_k:
        out_shape = (slots, mr, n)
    # the [64, cw] staging tile of each compute warpgroup's output (fp32 partials, else out_dtype), swizzled by
    # its row's bytes up to 128 (a ``_ragged`` chunk's rows by what divides them; 144 bytes of bf16: plain rows)
    ep_swz = next((sz for sz in (128, 64, 32) if cw * ep_dtype.itemsize % sz == 0), 0)
    ep_tf = (plgpu.TilingTransform((8, ep_swz // ep_dtype.itemsize)), plgpu.SwizzleTransform(ep_swz)) if ep_swz else ()
    scratch = [plgpu.SMEM((2, 64, cw), ep_dtype, transforms=ep_tf)] if trim else []
    if persistent:  # a tile per compute warpgroup and chunk: a tile's stores need not wait for each other
        scratch = [plgpu.SMEM((2, nch, 64, cw), ep_dtype, transforms=ep_tf)]
    if quantize_x:
        scratch += [plgpu.SMEM((2, 64, BLOCK), quant.FP8, transforms=swz)]
    if stage_scales:
        scratch += [plgpu.SMEM((2, kps, 64), jnp.float32)] if not quantize_x else []
        scratch += [plgpu.SMEM((2, SW_ROWS, nk + -nk % 4), jnp.float32),
                    plgpu.Barrier(num_arrivals=1 if quantize_x else 2, num_barriers=2)]
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                  **(dict(profile_space=PROFILE_RANGES, profile_dir=profile_dir,
                                          profile_bounds_check=True) if profile_dir else {}))
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
                        grid=(stream_k or persistent or splits * tiles,),
                        scratch_types=scratch, grid_names=("cta",), num_threads=3, thread_name="wg", compiler_params=params,
                        interpret=interpret if interpret is not None else False, kernel_name=GEMM_KERNEL)


# ----------------------------------------------------------------------------------------------------
# roles swapped: y^T = W x^T (decode rows)
@functools.lru_cache(maxsize=None)
def _build_swapped_call(*, mr: int, n: int, k: int, bn: int, splits: int, stages: int, out_dtype: jnp.dtype,
                        interpret: plgpu.InterpretGPUParams | None, rows_out: int = 0, stage_scales: bool = True,
                        smem_out: bool = False, profile_dir: str | None = None):
    """``swap_ab``: y^T [N, mr] = W x^T for at most 128 rows (mr = round_up(M, 8)): the weight tile is the e4m3
    wgmma's A operand (64 weight rows per compute warpgroup, ``bn`` / 64 of them) and x's mr rows its B operand
    (N = mr), both K-major in SMEM as 8-bit wgmma needs. The other form's A is a 64-row x tile, so a 1-row call
    multiplies 63 zero rows per K block: for q_b its compute warpgroups' steps were as long as the TMA ring's
    arrival interval (``scripts/diag/fp8_regions.py``, 2026-12-04); here one MMA of 64 x mr per warpgroup and K block.
    Scales as DeepGEMM: per K block a fresh accumulator, promoted in fp32 by the weight scale (one scalar per
    warpgroup: its 64 rows lie in one 128-row block) times the rows' activation scales (a vector along the
    accumulator's columns). ``stage_scales``: a CTA's scales are staged by TMA before the pipeline (sx^T [kps, mr]
    and the ``SW_ROWS`` weight-scale rows holding its tile's), else each K block's load from GMEM (L2). Output:
    one split's tile in out_dtype, or fp32 partials that XLA sums; ``rows_out`` = M > 0: y [M, N] itself
    ([splits, M, N]), each real row taken out of the accumulator's columns by a masked row sum and stored as 64
    contiguous values (no transposing kernel after the call; M cheap reductions for small M only); 0: y^T [N, mr]
    from registers, which the wrapper transposes; ``smem_out``: y [mr, N] ([splits, mr, N]): each warpgroup writes
    its accumulator into its [mr, 64] SMEM tile through the tile's transposed view, and a TMA copy stores the tile
    as y's block (no reductions and no transposing kernel, at any M)."""
    nk = k // BLOCK
    kps = nk // splits
    n_tiles = n // bn
    nwg = bn // 64
    sw_rows = max(-(-n // BLOCK), SW_ROWS)
    sxc = swapped_scale_cols(mr)
    L = plgpu.Layout.WGMMA
    COL = L.reduce(0)  # [mr] along the accumulator's columns (x rows)

    def kernel(x_ref, sxt_ref, w_ref, sw_ref, o_ref, *scratch):
        sx_s, sw_s, bar = scratch[:3] if stage_scales else (None, None, None)
        y_s = scratch[-1] if smem_out else None
        pid = lax.axis_index("cta")
        si, ni = pid // n_tiles, pid % n_tiles
        n0, kb0 = ni * bn, si * kps
        win = scale_window(n0 // BLOCK, sw_rows)

        def body(idx, x_s, w_s, acc):
            with jax.named_scope("step"):  # regions of the Mosaic GPU profiler (``profile_dir``)
                (step,) = idx
                wg = lax.axis_index("wg")

                def mma(blk_ref):
                    plgpu.wgmma(blk_ref, w_s.at[pl.ds(wg * 64, 64)], x_s.T)
                    if stage_scales:  # loaded while the MMA runs
                        sx = plgpu.load(sx_s.at[step, pl.ds(0, mr)], layout=COL, optimized=False)
                        sw = sw_s[(n0 + wg * 64) // BLOCK - win, kb0 + step]
                    else:
                        sx = plgpu.load(sxt_ref.at[kb0 + step, pl.ds(0, mr)], layout=COL, optimized=False)
                        sw = sw_ref[(n0 + wg * 64) // BLOCK, kb0 + step]
                    plgpu.wgmma_wait(0)
                    return blk_ref[...], sx, sw

                blk, sx, sw = pl.run_scoped(mma, plgpu.ACC((64, mr), jnp.float32))
                return acc + blk * lax.broadcast_in_dim(sx * sw, (64, mr), [1])

        def compute(run_pipeline):
            wg = lax.axis_index("wg")
            with jax.named_scope("scales"):
                if stage_scales:
                    @pl.when(wg == 0)
                    def _():
                        plgpu.copy_gmem_to_smem(sxt_ref.at[pl.ds(kb0, kps), pl.ds(0, sxc)], sx_s, bar.at[0])
                        plgpu.copy_gmem_to_smem(sw_ref.at[pl.ds(win, SW_ROWS)], sw_s, bar.at[0])

                    plgpu.barrier_wait(bar.at[0])
            with jax.named_scope("loop"):
                acc = run_pipeline(plgpu.layout_cast(jnp.full((64, mr), 0.0, jnp.float32), L))
            with jax.named_scope("store"):
                rows = pl.ds(n0 + wg * 64, 64)
                if smem_out:  # the accumulator [64, mr] is y's [mr, 64] block transposed
                    tile = y_s.at[wg]
                    # in the transposed register layout (a shuffle and a permute per register) each thread's pairs
                    # run along the view's contiguous axis; stored from the WGMMA layout, a 32-bit y does not lower
                    tile.T[...] = plgpu.layout_cast(acc.astype(tile.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
                    plgpu.commit_smem()
                    dst = o_ref.at[pl.ds(0, mr), rows] if splits == 1 else o_ref.at[si, pl.ds(0, mr), rows]
                    plgpu.copy_smem_to_gmem(tile, dst)
                    plgpu.wait_smem_to_gmem(0)
                elif rows_out:
                    col = plgpu.broadcasted_iota(jnp.int32, (64, mr), 1, layout=L)
                    for i in range(rows_out):
                        dst = o_ref.at[i, rows] if splits == 1 else o_ref.at[si, i, rows]
                        dst[...] = jnp.sum(jnp.where(col == i, acc, 0.0), axis=1).astype(dst.dtype)
                else:
                    dst = o_ref.at[rows] if splits == 1 else o_ref.at[si, rows]
                    dst[...] = acc.astype(dst.dtype)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            body, grid=(kps,), memory_registers=40, wg_axis="wg", num_compute_wgs=nwg,
            max_concurrent_steps=min(stages, kps), compute_context=compute,
            in_specs=[plgpu.BlockSpec((mr, BLOCK), lambda s: (0, s), transforms=_SWZ8),
                      plgpu.BlockSpec((bn, BLOCK), lambda s: (0, s), transforms=_SWZ8)])
        with jax.named_scope("all"):
            pipeline(x_ref.at[pl.ds(0, mr), pl.ds(kb0 * BLOCK, kps * BLOCK)],
                     w_ref.at[pl.ds(n0, bn), pl.ds(kb0 * BLOCK, kps * BLOCK)])

    out_shape = (rows_out, n) if rows_out else (mr, n) if smem_out else (n, mr)
    out_shape = out_shape if splits == 1 else (splits, *out_shape)
    scratch = [plgpu.SMEM((kps, sxc), jnp.float32), plgpu.SMEM((SW_ROWS, nk + -nk % 4), jnp.float32),
               plgpu.Barrier(num_arrivals=2, num_barriers=1)] if stage_scales else []
    scratch += [plgpu.SMEM((nwg, mr, 64), out_dtype)] if smem_out else []
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                  **(dict(profile_space=PROFILE_RANGES, profile_dir=profile_dir,
                                          profile_bounds_check=True) if profile_dir else {}))
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype), grid=(splits * n_tiles,),
                        scratch_types=scratch, grid_names=("cta",), num_threads=nwg + 1, thread_name="wg",
                        compiler_params=params, interpret=interpret if interpret is not None else False,
                        kernel_name=GEMM_KERNEL)
