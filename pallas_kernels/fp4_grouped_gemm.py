"""Grouped (MoE) GEMM with FP4 expert weights as DeepSeek-V4-Flash stores them, on Hopper (Pallas Mosaic GPU),
with the pure-JAX path (``implementation="xla"``: dequantise the stack, ``lax.ragged_dot_general``) as reference.

    y[r, :] = x[r, :] @ W[e(r)]^T        rows r of x [M, K] grouped by expert in order, ``sizes`` [E]
    W[e] = e2m1(w_packed[e]) * 2^(w_scale[e] - 127)   packed uint8 [E, N, K/2] (low nibble = even column),
                                                     e8m0 bytes uint8 [E, N, K/32] (one per 1 x 32 block)

Rows past sum(sizes) come out as 0.

Hopper has no FP4 tensor cores, so the kernel dequantises in registers and multiplies with bf16 wgmma (fp32
accumulation). Dequantisation is exact: an e2m1 value times a power of two has 2 significant bits. Decode is
weight-read bound (1-4 rows per expert), so the design moves the weights once through HBM -> SMEM -> registers:

- Roles are swapped (y^T = W x^T): the weights are wgmma's A operand, *in registers* (64 weight rows per
  compute warpgroup), the token rows are B (from SMEM, N = ``block_t`` >= 8 tokens). Dequantised weights
  never touch SMEM (a bf16 SMEM copy would cost 4x the packed bytes of SMEM bandwidth), and the MMA's N is the
  few tokens an expert has, not a 64-row tile padded with zeros.
- Work items: (expert, token tile of ``block_t`` rows) pairs of the experts that have rows, listed in XLA
  (at most min(E, M) + M // block_t of them, a static bound). Grid = (K split, N tile, work item), work item
  fastest, so the token tiles of one expert run next to each other and share its weight tile in L2. Items past
  the list exit at once: an expert without rows never reads its weights, and the grid does not scale with E.
- Per CTA: ``plgpu.emit_pipeline_warp_specialized`` streams the packed weight tile [block_n, block_k / 2]
  (uint8, swizzled so that the 8 rows a warp reads hit different banks) and the token tile [block_t, block_k]
  (bf16, 32-byte swizzle) through a ``stages``-deep ring filled by a producer warpgroup; the CTA's e8m0 scales
  [block_n, K_split / 32] arrive once, by TMA, at the start, as [64, 16]-byte tiles (16 bytes between the rows
  a warp reads: no bank conflicts).
- Token rows: the wrapper copies x (one XLA gather, fused with the column permutation below) into a padded x
  where every group starts on an 8-row boundary. The token tile's TMA start is data dependent, and Mosaic
  splits a start on the tile's 8-row SMEM tiling into (row // 8, row % 8): only a multiple of 8 addresses the
  intended rows (a misaligned start fetches the wrong rows natively, which interpret mode, working on logical
  arrays, would not show). One token tile of slack at the end keeps the last tile in bounds; rows of the next
  group inside a tile only produce output columns nobody reads.
- Dequantisation per 32-column scale block and warpgroup: the packed bytes load in the WGMMA register layout
  ([64, block_k / 2], sliced per block); the low and the high nibbles become two [64, 16] bf16 A operands.
  Column order: the wrapper permutes x's columns inside each 32-column block to (even columns, odd columns), so
  the low-nibble operand meets x's even columns and the high-nibble operand its odd ones (a dot product does
  not care about K order). The scale is applied to A (a bf16 multiply by the block's power of two, exact), so
  the MMA chain runs over the whole K range with no fp32 promotion. A nibble s e1 e0 m becomes a 16-bit
  pattern with s at bit 15 (``dequant_bits``); e = 0 codes (0, 0.5) land on subnormals, which is what makes
  the placement linear. Three routes (``dequant``):
  "lop3" (natively, decode tiles): the packed tile loads in the 8-bit WGMMA layout, so a thread holds one
  32-bit word (8 nibbles) of a row per block; four pairs of PTX and / shift / lop3 per word put each nibble's
  sign at bit 15 and e1 e0 m at bits 8..6 of a bf16 half (``_dequant_lop3``): bf16 e2m1 * 2^-126, which are
  written straight into the A operands' registers in the order ``LOP3_PERM`` (x is permuted to match, and
  scaled by 2^32 so that one bf16 multiply by 2^(byte - 33) per pair of weights is exact). About 2.5
  instructions per weight against about 8 for the routes below (Nsight Compute, 2026-12-01). Exact for
  scale bytes 27..160 (|scale| in [2^-100, 2^33]) and |x| < 2^96. Native only (inline PTX).
  "f16" (interpret mode; natively for prefill tiles, where it measured faster): e1 e0 m at bits 11..9, a
  float16 equal to e2m1 * 2^-14, converted float16 -> float32 -> bf16 (conversions keep float16 subnormals:
  they are normal in float32) and times 2^(byte - 113). Runs in interpret mode too (XLA on the CPU flushes
  float32 / bf16 subnormals in arithmetic, not in conversions).
  "bf16": e1 e0 m at bits 8..6, a bf16 equal to e2m1 * 2^-126, times 2^126 then 2^(byte - 127): no conversion
  instructions, but it needs bf16 subnormal inputs, which the GPU's bf16 multiply keeps and XLA on the CPU
  does not: native only. "f16" and "bf16" work on 16-bit vectors of the 16-bit WGMMA layout and are exact
  for scale bytes 2..240 (|W| < 2^114; a checkpoint's scales sit near 127).
- e4m3 x (``x_scale`` given: act_quant's x and its float32 scale per row and 128 columns, what the release's
  ``fp4_gemm`` multiplies): the "fp8" route. The token tile is e4m3 in SMEM (32-byte swizzle: one 32-column scale
  block per swizzle row); each packed [64, 16]-byte block becomes an e4m3 [64, 32] A operand in registers by PTX
  on the thread's two 32-bit words (``_to_e4m3``: 7 instructions per 8 weights, e2m1 * 2^-6 for every code), in
  (low nibbles, high nibbles) order, x's columns (even, odd) per block as for "f16". One e4m3 wgmma (K = 32) per
  scale block into a fresh accumulator, ``mma_group`` of them in flight per wait, each promoted in fp32 by its
  weight scale (times 2^6) per row, and each 128 columns by the tokens' x scales: the release kernel's per-block
  summation. Fewer instructions than any bf16 route (no scale multiply of the weights, half the MMAs); on the
  H200 faster at 1 to 4096 tokens (benchmarks/results/archive/kernels_fp4_grouped_h200_2026-12-02_fourteenth.json),
  so the V4 MoE uses it at every size. Exact for scale bytes up to 248. The tensor cores' own accumulation
  inside a 32-column block is not fp32 (about 2^-14 of the block's partial sums), which the release's kernel
  shares. The route's kernel is persistent (``_build_fp8_call``): one CTA per SM loops over the work units,
  and consecutive units continue one TMA ring, so no unit waits for its first loads (the per-CTA ring lost a
  DRAM round trip per unit and left the last wave part-empty); the scales travel in the ring too.
- Output: each work item owns ``block_t`` columns of y^T [N, items * block_t] (bf16, or fp32 partials per K
  split that XLA sums); the wrapper gathers each row's column and transposes. A neighbouring expert's rows are
  never written: every item writes only its own columns.
- Decode split-K: with few experts active there are few (item, N tile) pairs, so the K range is cut until
  about 2 CTAs per SM stream weights (``_pick_tiles``); a split holds whole 512-column chunks (the scale
  slab's TMA rows are 16 bytes).
Cost model: per weight the kernel moves half a byte from HBM and spends CUDA-core operations on
dequantisation, so at decode that ALU work, not HBM, bounds it (an Nsight Compute profile of 8 tokens,
2026-12-01, docs/perf-log.md: issue slots mostly busy with "f16"/"bf16"; "lop3" cut the instructions, and what
remains is spread over the dequantisation, the scale multiplies and the wgmma descriptors' uniform-datapath arithmetic
of one m64n8k16 MMA per 16 columns).
Limits: N multiple of 64, K multiple of 512 (else ``Unsupported``; "auto" runs XLA); ``block_t`` <= 128.
``interpret=None`` runs GPU interpret mode off-GPU (the same kernel on the CPU, slow: tests only). The
interpreter's wgmma takes SMEM operands only, so there the register-A MMA is a ``jnp.dot`` of the same bf16
operands with fp32 accumulation; everything else (TMA, ring, loads, dequantisation, stores) is the kernel's.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Literal

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.pallas.mosaic_gpu import pipeline as _mgpu_pipeline

from jds.ops import quant
from jds.ops.dispatch import Implementation, Unsupported, num_sms, run_op
from pallas_kernels import grouped_rows
from pallas_kernels.fp8_gemm import fence_slot_reads

Dequant = Literal["auto", "lop3", "f16", "bf16", "fp8"]
DEQUANTS = ("lop3", "f16", "bf16")  # bf16 x; "auto": "lop3" natively at decode tiles, else "f16"
X_BLOCK = 128  # e4m3 x (``x_scale`` given): one scale per row and 128 columns, as ``act_quant``
FP8_EXP = 6  # the "fp8" route's e4m3 weight code is e2m1 * 2^-6 (see ``_to_e4m3``)
NATIVE_ONLY = ("lop3", "bf16")
X_SCALE_LOG2 = 32  # the "lop3" route: x * 2^32 and the weights' scale / 2^32 (see ``_scale_exp_bias``)
SCALE_BLOCK = quant.FP4_WEIGHT_BLOCK  # 32 input columns per e8m0 scale
K_ALIGN = 512  # K per split: whole 16-byte rows of scale bytes for the TMA
SMEM_BUDGET = 220 * 1024  # of the H100/H200's 227 KiB per CTA (the rest: barriers, alignment)
_RAGGED_DN = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


REGISTER_FILE = 64 * 1024  # 32-bit registers per SM (sm_90)
MEMORY_REGISTERS = 40  # the producer warpgroup's setmaxnreg (CUTLASS's value for a TMA-only producer)


def compute_registers(num_compute_wgs: int, memory_registers: int = MEMORY_REGISTERS) -> int:
    """setmaxnreg for each compute warpgroup: what the CTA's launch allocation holds once the producer keeps
    ``memory_registers``. A CTA of w warpgroups launches with floor8(64K / 128w) registers a thread, and
    setmaxnreg only moves registers within that pool: asking for more blocks forever. Mosaic's own split
    (``pipeline._compute_registers``) divides 512 a thread, which fits 3 warpgroups (168 x 3 = 504) but not 5
    (96 x 5 = 480): four compute warpgroups hung natively at its 112 (twenty-fourth session)."""
    wgs = num_compute_wgs + 1
    pool = REGISTER_FILE // (128 * wgs) // 8 * 8 * wgs
    return min(256, (pool - memory_registers) // num_compute_wgs // 8 * 8)


@contextlib.contextmanager
def _launch_pool_registers() -> Iterator[None]:
    """Trace ``emit_pipeline_warp_specialized`` with ``compute_registers``' split (the function has no argument
    for it). Checked by tests/test_kernel_fp4_grouped_gemm.py: the private name must exist, and for two compute
    warpgroups both splits agree."""
    saved = _mgpu_pipeline._compute_registers
    _mgpu_pipeline._compute_registers = lambda memory_registers, num_compute_wgs: compute_registers(
        num_compute_wgs, memory_registers)
    try:
        yield
    finally:
        _mgpu_pipeline._compute_registers = saved

# ----------------------------------------------------------------------------------------------------
# public entry point
Weights = jax.Array | tuple[jax.Array, ...]  # one expert stack, or several of one shape (``fp4_grouped_linear``)


def fp4_grouped_linear(x: jax.Array, sizes: jax.Array, w_packed: Weights, w_scale: Weights, *,
                       out_dtype: jnp.dtype = jnp.bfloat16, implementation: Implementation = "auto",
                       interpret: bool | plgpu.InterpretGPUParams | None = None, block_t: int | None = None,
                       block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                       stages: int = 4, dequant: Dequant = "auto", layout: str = "auto",
                       x_scale: jax.Array | None = None, mma_group: int | None = None,
                       profile_dir: str | None = None) -> jax.Array:
    """y [M, N] (``out_dtype``): row r of x [M, K] (bfloat16) times W[e(r)]^T, rows grouped by expert in order
    (``sizes`` int32 [E], sum <= M; rows past the sum give 0), W = ``w_packed`` (uint8 [E, N, K/2], two e2m1
    codes a byte, low nibble first) with ``w_scale`` (uint8 [E, N, K/32] e8m0 exponents).
    Tuples of S stacks of one shape (an MoE's w1 and w3) give y [M, S * N], set i in columns [i N, (i + 1) N):
    on the e4m3-x route one kernel call streams them all (its units cover every set's N tiles: one row layout,
    one gather of x, and twice the units to spread at decode); the other routes run a call per set.

    ``implementation``: "xla" = dequantise + ``ragged_dot_general`` (fp32 accumulation); "pallas" = the
    kernel (``Unsupported`` for N not a multiple of 64 or K not a multiple of 512); "auto" = the kernel
    where it applies, else XLA.
    Tiles (kernel only; ``_pick_tiles`` has the defaults): ``block_t`` token rows per work item (8..128, a
    power of two), ``block_n`` weight rows per CTA (64 or 128: one or two compute warpgroups; e4m3 x also 256:
    four, for more warps converting weights per SM where that work bounds the kernel), ``block_k``
    input columns per pipeline step (128, 256 or 512), ``split_k`` K splits, ``stages`` TMA ring depth,
    ``dequant`` the nibble -> bf16 route ("lop3": 8 nibbles of a 32-bit word at a time in PTX, native only;
    "f16": through float16 subnormals and two conversions, runs anywhere; "bf16": bf16 subnormals times
    2^126, no conversions, native only: XLA on the CPU flushes them; "auto": "lop3" natively for token tiles
    up to 32 rows (decode), else "f16", which measured faster with 128-row prefill tiles). ``layout``: where the
    rows' bookkeeping is computed (``grouped_rows.row_layout``: "xla", about eight small kernels, or "pallas",
    one, which shortened the decode call on the H200:
    benchmarks/results/archive/fp4_decode_ncu_sweep_h200_2026-12-02.json); "auto": "pallas" natively, "xla" in
    interpret mode; "fused", e4m3 x only: that kernel also copies x's rows, permuted, and their scales into the
    padded layout, two XLA kernels fewer per call; on the H200 its call was shorter for w2 at 1 token and longer
    for w1 (benchmarks/results/fp4_tiles_time_h200_2026-12-04.json), so "auto" does not pick it.
    ``interpret``: GPU interpret mode (True or an ``InterpretGPUParams``); None = whenever the default
    backend is not a GPU.
    ``x_scale``: x given quantised, as the release's ``fp4_gemm`` takes it: x float8_e4m3fn [M, K] and
    ``x_scale`` float32 [M, K/128] (``act_quant``'s pair; x = x * x_scale per 128 columns). The kernel then runs
    the "fp8" route (the only one for e4m3 x): weights to e4m3 in registers, fp8 wgmma per 32-column scale
    block, promoted in fp32 with the weight and x scales, the release's kernel's summation.
    ``mma_group``: the "fp8" route's wgmmas in flight per wait (a divisor of block_k / 32; default 4 up to 32-row
    token tiles, fewer for larger ones: their accumulators take block_t / 2 registers each).
    ``profile_dir`` (diagnostic; e4m3 x, native): Mosaic GPU's profiler writes a trace of the kernel's named
    regions per warpgroup there (each work unit's ``unit``, inside it the compute warpgroups' ``step`` bodies
    and ``store``): whether the compute warpgroups work or wait (``scripts/diag/fp4_regions.py``).
    """
    w_packed, w_scale = _weight_sets(w_packed, w_scale)
    _check_inputs(x, sizes, w_packed[0], w_scale[0], x_scale)
    return run_op("fp4_grouped_linear", implementation, {
        "xla": lambda: jnp.concatenate([_xla(x, sizes, w, sc, out_dtype, x_scale)
                                        for w, sc in zip(w_packed, w_scale)], axis=1),
        "pallas": lambda: _pallas(x, sizes, w_packed, w_scale, out_dtype=out_dtype, interpret=interpret,
                                  block_t=block_t, block_n=block_n, block_k=block_k, split_k=split_k,
                                  stages=stages, dequant=dequant, layout=layout, x_scale=x_scale,
                                  mma_group=mma_group, profile_dir=profile_dir)})


def _weight_sets(w_packed: Weights, w_scale: Weights) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """(packed stacks, scale stacks) as equal-length tuples of one shape each (ValueError naming the argument)."""
    ws = tuple(w_packed) if isinstance(w_packed, (tuple, list)) else (w_packed,)
    ss = tuple(w_scale) if isinstance(w_scale, (tuple, list)) else (w_scale,)
    if not ws or len(ws) != len(ss):
        raise ValueError(f"w_packed and w_scale must be one stack each or tuples of equal length, got {len(ws)} "
                         f"and {len(ss)}")
    for name, group in (("w_packed", ws), ("w_scale", ss)):
        if any(a.shape != group[0].shape or a.dtype != group[0].dtype for a in group):
            raise ValueError(f"{name}: the sets must share one shape and dtype, got "
                             f"{[(str(a.dtype), a.shape) for a in group]}")
    return ws, ss


def _check_inputs(x, sizes, w_packed, w_scale, x_scale=None) -> None:
    """Input errors of both implementations (ValueError naming the argument)."""
    if w_packed.ndim != 3 or jnp.dtype(w_packed.dtype) != jnp.uint8:
        raise ValueError(f"w_packed must be uint8 [E, N, K/2], got {w_packed.dtype} {w_packed.shape}")
    e, n, kh = w_packed.shape
    k = 2 * kh
    if k % SCALE_BLOCK:
        raise ValueError(f"w_packed: K = {k} must be a multiple of {SCALE_BLOCK} (the scale block)")
    if jnp.dtype(w_scale.dtype) != jnp.uint8 or w_scale.shape != (e, n, k // SCALE_BLOCK):
        raise ValueError(f"w_scale must be uint8 {(e, n, k // SCALE_BLOCK)} for w_packed {w_packed.shape}, "
                         f"got {w_scale.dtype} {w_scale.shape}")
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] (K = 2 * w_packed.shape[-1]), got shape {x.shape}")
    if x_scale is None and jnp.dtype(x.dtype) != jnp.bfloat16:
        raise ValueError(f"x must be bfloat16 (or float8_e4m3fn with x_scale), got {x.dtype}")
    if x_scale is not None:
        if jnp.dtype(x.dtype) != jnp.float8_e4m3fn:
            raise ValueError(f"x must be float8_e4m3fn when x_scale is given, got {x.dtype}")
        if k % X_BLOCK or jnp.dtype(x_scale.dtype) != jnp.float32 or x_scale.shape != (x.shape[0], k // X_BLOCK):
            raise ValueError(f"x_scale must be float32 [{x.shape[0]}, {k // X_BLOCK}] (one scale per row and "
                             f"{X_BLOCK} columns of x [{x.shape[0]}, {k}]), got {x_scale.dtype} {x_scale.shape}")
    if sizes.shape != (e,) or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(f"sizes must be an int32 [{e}] (one group size per expert), got {sizes.dtype} {sizes.shape}")


def _xla(x, sizes, w_packed, w_scale, out_dtype, x_scale=None) -> jax.Array:
    """The reference: dequantise the whole stack (exact in bf16) and one ragged dot with fp32 accumulation; e4m3
    x (``x_scale``) dequantised to float32 (any scale) and multiplied at float32 precision."""
    if x_scale is not None:
        xf = quant.dequant(x, x_scale, X_BLOCK)
        w = quant.fp4_dequant(w_packed, w_scale, jnp.float32)
        y = lax.ragged_dot_general(xf, w, sizes.astype(jnp.int32), _RAGGED_DN, precision=lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)
        return y.astype(out_dtype)
    w = quant.fp4_dequant(w_packed, w_scale, jnp.bfloat16)
    y = lax.ragged_dot_general(x, w, sizes.astype(jnp.int32), _RAGGED_DN, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def supports(n: int, k: int) -> bool:
    """Whether the kernel takes expert weights of [n, k] (out, in)."""
    return n > 0 and k > 0 and n % 64 == 0 and k % K_ALIGN == 0


def _check_tiles(block_t, block_n, block_k, split_k, stages, fp8: bool = False) -> None:
    """The "fp8" route (e4m3 x) also takes block_n 256: four compute warpgroups (see ``_build_fp8_call``)."""
    grouped_rows.check_tiles(block_t, block_n, block_k, split_k, stages, (128, 256, 512),
                             (64, 128, 256) if fp8 else (64, 128))


def _pick_tiles(m: int, e: int, n: int, k: int, block_t: int | None, block_n: int | None,
                block_k: int | None, split_k: int | None, fp8: bool = False) -> tuple[int, int, int, int]:
    """(block_t, block_n, block_k, split_k): the given ones, defaults for the rest (``grouped_rows.pick_tiles``;
    a split holds whole ``K_ALIGN``-column chunks). The "fp8" route (e4m3 x) steps 512 columns at token tiles
    up to 32 rows: faster than 256 at 1, 8 and 64 tokens on the H200 (Nsight Compute,
    benchmarks/results/archive/fp4_decode_ncu_sweep_h200_2026-12-02.json). Its default split leaves at least two steps
    per work unit where the K range allows: the ring's depth divides a unit's steps (``fp8_stages``), and a
    one-step unit would leave a ring of one stage (the split rule, counting 128-row tiles, cuts 256-row tiles'
    K range twice as often)."""
    bt, bn, bk, s = grouped_rows.pick_tiles(m, e, n, k, block_t, block_n, block_k, split_k, K_ALIGN)
    if fp8 and block_k is None and bt <= 32:
        bk = K_ALIGN
    if fp8 and split_k is None:
        chunks = k // K_ALIGN
        while s > 1 and k // s // bk < 2:
            s = max(d for d in range(1, s) if chunks % d == 0)
    return bt, bn, bk, s


def _fit_stages(stages: int, bt: int, bn: int, bk: int, kc: int) -> int:
    """The bf16-x routes' ring depth that fits SMEM: ``stages`` (at most the number of steps), fewer where the
    token tile is large; ValueError when not even one stage fits (the "fp8" route: ``fp8_stages``)."""
    per_stage = bt * bk * 2 + bn * bk // 2  # token tile + packed weight tile
    fixed = bn * kc // SCALE_BLOCK
    fit = (SMEM_BUDGET - fixed) // per_stage
    if fit < 1:
        raise ValueError(f"block_t {bt} x block_k {bk} (block_n {bn}) does not fit shared memory")
    return max(1, min(stages, kc // bk, fit))


def _permute_k(x: jax.Array, dequant: Dequant) -> jax.Array:
    """x's columns reordered inside each 32-column scale block to the order the kernel's dequantised A
    operands hold the weights (a dot product does not care about K order).

    "f16" / "bf16" / "fp8": (16 even, 16 odd): the low-nibble operand (the first 16 columns of "fp8"'s e4m3
    operand) holds a block's even columns, the high-nibble one its odd columns. "lop3": ``LOP3_PERM``
    (``_dequant_lop3``), and x times 2^32 (exact for |x| < 2^96) to balance the weights' scale / 2^32 that keeps
    the scale a normal bf16 (``_scale_exp_bias``)."""
    m, k = x.shape
    if dequant == "lop3":
        return (x.reshape(m, k // 32, 32)[:, :, LOP3_PERM] * jnp.asarray(2.0 ** X_SCALE_LOG2, x.dtype)).reshape(m, k)
    return x.reshape(m, k // 32, 16, 2).swapaxes(-1, -2).reshape(m, k)


def _pallas(x, sizes, w_packed, w_scale, *, out_dtype, interpret, block_t, block_n, block_k, split_k, stages,
            dequant, layout="auto", x_scale=None, mma_group=None, profile_dir=None):
    """The kernel path; ``w_packed`` / ``w_scale``: tuples of stacks (``_weight_sets``)."""
    if len(w_packed) > 1 and x_scale is None:  # the bf16 routes: a call per set
        return jnp.concatenate([_pallas(x, sizes, (w,), (sc,), out_dtype=out_dtype, interpret=interpret,
                                        block_t=block_t, block_n=block_n, block_k=block_k, split_k=split_k,
                                        stages=stages, dequant=dequant, layout=layout, profile_dir=profile_dir)
                                for w, sc in zip(w_packed, w_scale)], axis=1)
    _check_tiles(block_t, block_n, block_k, split_k, stages, fp8=x_scale is not None)
    if dequant not in ("auto", "fp8", *DEQUANTS):
        raise ValueError(f"dequant must be one of {('auto', 'fp8', *DEQUANTS)}, got {dequant!r}")
    if x_scale is not None and dequant not in ("auto", "fp8"):
        raise ValueError(f'dequant="{dequant}" takes bf16 x; e4m3 x (x_scale given) runs dequant="fp8"')
    if x_scale is None and dequant == "fp8":
        raise ValueError('dequant="fp8" needs e4m3 x with its x_scale')
    if x_scale is None and mma_group is not None:
        raise ValueError("mma_group applies to e4m3 x (x_scale given) only")
    if mma_group is not None and mma_group < 1:
        raise ValueError(f"mma_group must be a positive divisor of block_k / 32, got {mma_group}")
    e, n, kh = w_packed[0].shape
    k = 2 * kh
    m = x.shape[0]
    if not supports(n, k):
        raise Unsupported(f"fp4_grouped_linear kernel: N = {n} must be a multiple of 64 and K = {k} a multiple "
                          f"of {K_ALIGN} (w_packed shape {w_packed[0].shape})")
    out_dtype = jnp.dtype(out_dtype)
    if m == 0:
        return jnp.zeros((0, len(w_packed) * n), out_dtype)
    if x_scale is not None:  # "fp8": 512-column steps at decode tiles, >= 2 steps per unit (_pick_tiles)
        _, _, block_k, split_k = _pick_tiles(m, e, n, k, block_t, block_n, block_k, split_k, fp8=True)
    fused = layout == "fused" and x_scale is not None  # e4m3 bytes and scales copied by the layout kernel
    p = grouped_rows.plan(sizes, m, e, n, k, block_t, block_n, block_k, split_k, K_ALIGN, interpret, layout,
                          rows=(lax.bitcast_convert_type(x, jnp.uint8), x_scale) if fused else None,
                          split_pairs=fused)
    if x_scale is not None:
        dequant = "fp8"
    elif dequant == "auto":  # "lop3" where dequantisation bounds the kernel (decode tiles); see the docstring
        dequant = "f16" if p.interpret or p.block_t > 32 else "lop3"
    if p.interpret and dequant in NATIVE_ONLY:
        raise ValueError(f'dequant="{dequant}" runs natively only (interpret mode: "bf16" needs bf16 subnormal '
                         'arithmetic, which XLA on the CPU flushes; "lop3" is PTX); use dequant="f16" there')
    xp = None if fused else grouped_rows.tile_rows(_permute_k(x, dequant), p)  # groups padded to 8 rows
    st = stages if x_scale is not None else _fit_stages(stages, p.block_t, p.block_n, p.block_k, k // p.splits)
    call = _build_call(n=n, k=k, items=p.items, bt=p.block_t, bn=p.block_n, bk=p.block_k, splits=p.splits,
                       stages=st, dequant=dequant,
                       out_dtype=out_dtype if p.splits == 1 else jnp.dtype(jnp.float32), interpret=p.interpret,
                       mma_group=mma_group, profile_dir=profile_dir, sets=len(w_packed))
    weights = [a for pair in zip(w_packed, w_scale) for a in pair]  # w_0, s_0, w_1, s_1, ...
    if x_scale is None:
        return grouped_rows.finish(call(p.info, xp, *weights), p, out_dtype)
    # the padded rows' scales [K/128, rows] (a token tile's per 128-column block); "fused": the layout kernel's
    # copies of the permuted e4m3 rows and of the scales
    xp, sxt = ((lax.bitcast_convert_type(p.xp, jnp.float8_e4m3fn), p.sxt) if fused
               else (xp, grouped_rows.tile_rows(x_scale, p).T))
    return grouped_rows.finish(call(p.count, p.info, xp, sxt, *weights), p, out_dtype)


# ----------------------------------------------------------------------------------------------------
# the kernel
def dequant_bits(packed, nibble: int, dequant: Dequant):
    """The 16-bit pattern of the low (``nibble`` 0) or high (1) e2m1 code of each byte of ``packed`` (uint16
    holding one byte each; numpy or jax): the code's sign to bit 15, its e1 e0 m bits to bits 11..9 (``"f16"``:
    the float16 e2m1 * 2^-14) or 8..6 (``"bf16"``: the bf16 e2m1 * 2^-126). e = 0 lands on a subnormal in both."""
    sign, mag = (8, 7) if nibble == 0 else (0x80, 0x70)
    low = 9 if dequant == "f16" else 6
    return ((packed & sign) << (12 - 4 * nibble)) | ((packed & mag) << (low - 4 * nibble))


def _dequant(packed: jax.Array, nibble: int, scale: jax.Array, dequant: Dequant) -> jax.Array:
    """bf16 weights from the packed bytes (uint16, one byte each) and their bf16 ``scale``, 2^(byte - 113) for
    ``"f16"`` and 2^(byte - 127) for ``"bf16"``; exact either way (see the module docstring)."""
    bits = dequant_bits(packed, nibble, dequant)
    if dequant == "f16":
        h = lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32).astype(jnp.bfloat16)
    else:
        h = lax.bitcast_convert_type(bits, jnp.bfloat16) * jnp.bfloat16(2.0 ** 126)
    return h * scale


# "lop3": which column of a 32-column block each position of the dequantised A operands holds. Thread q of a
# row quad loads word q (nibbles n0..n7 = block columns 8q..8q+7) and makes four bf16 pairs of it, pair s =
# (n[3 - s], n[7 - s]); WGMMA-layout register (row, 8-column group s) of that thread holds columns 8s + 2q, +1.
LOP3_PERM = np.array([8 * q + 3 - s + 4 * t for s in range(4) for q in range(4) for t in range(2)], np.int32)
_LOP3_ASM = """{{
.reg .b32 q, m, t;
{shift}
and.b32 m, q, 0x70007000;
shr.b32 t, m, 6;
lop3.b32 $0, q, t, 0x80008000, 0xEC;
}}"""


def _dequant_lop3(packed: jax.Array) -> jax.Array:
    """bf16 [64, 2C] = e2m1 * 2^-126 from packed uint8 [64, C] loaded in the ``WGMMA_8BIT`` layout (a thread
    holds 4 bytes of a row per 16-byte block: one 32-bit word, 8 nibbles), in the WGMMA layout with columns in
    ``LOP3_PERM`` order per 32-column block. Per pair of nibbles at the top of the word's two 16-bit halves
    (the word shifted left by 4 s): and, shift, lop3: sign stays at bit 15, e1 e0 m moves to bits 8..6, so the
    bf16 is a subnormal for e = 0 and e2m1 * 2^-126 throughout (the "bf16" route's placement, 2 instructions
    per weight instead of about 8 on 16-bit vectors). Native only (inline PTX)."""
    import jax.experimental.mosaic.gpu as mgpu  # noqa: PLC0415 - lowering-time imports
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.lib.mlir.dialects import llvm  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415

    rows, c = packed.shape

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,),
                       return_type=plgpu.ShapeDtypeStruct((rows, 2 * c), jnp.bfloat16, layout=plgpu.Layout.WGMMA))
    def f(_, p):
        i32 = ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        in_shape = fa.WGMMA_LAYOUT_8BIT.registers_shape((rows, c))
        out_shape = fa.WGMMA_LAYOUT.registers_shape((rows, 2 * c))
        # registers: [.., 16-byte block (dim 1), .., row half (dim 4), ..] in and [.., 8-column group, ..] out
        assert p.registers.shape == in_shape and in_shape[1] * 4 == out_shape[1], (in_shape, out_shape)
        out = np.empty(out_shape, dtype=object)
        for idx, reg in np.ndenumerate(p.registers):
            word = mgpu_utils.bitcast(reg, i32)
            for sh in range(4):
                shift = "mov.b32 q, $1;" if sh == 0 else f"shl.b32 q, $1, {4 * sh};"
                bits = llvm.inline_asm(i32, [word], _LOP3_ASM.format(shift=shift), "=r,r")
                o = list(idx)
                o[1] = 4 * idx[1] + sh
                out[tuple(o)] = mgpu_utils.bitcast(bits, pair)
        return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return f(packed)


# The "fp8" route's nibble -> e4m3 byte, on a 32-bit word of 4 packed bytes: the low nibbles (s e1 e0 m at
# bits 3..0 of each byte) go to s at bit 7 and e1 e0 m at bits 4..2 (the exponent's low two bits and the
# mantissa's top bit), the high nibbles likewise from bits 7..4. An e4m3 with exponent field e1 e0 and mantissa
# m00 is e2m1 * 2^-6 for every code (e = 0 lands on the e4m3 subnormals), so the conversion is linear and exact.
_E4M3_LO_ASM = """{{
.reg .b32 a, b;
shl.b32 a, $1, 2;
and.b32 a, a, 0x1C1C1C1C;
shl.b32 b, $1, 4;
lop3.b32 $0, a, b, 0x80808080, 0xF8;
}}"""
_E4M3_HI_ASM = """{{
.reg .b32 a;
shr.b32 a, $1, 2;
and.b32 a, a, 0x1C1C1C1C;
lop3.b32 $0, a, $1, 0x80808080, 0xF8;
}}"""


def e4m3_codes(packed):
    """The "fp8" route's e4m3 bytes (uint8 [.., 2C]; numpy or jax) of packed bytes [.., C]: the low nibbles'
    codes, then the high nibbles' (columns (even, odd) of each 32-column block after ``_permute_k``); each is
    e2m1 * 2^-6. What the PTX of ``_to_e4m3`` computes on 4 bytes at a time."""
    lo = ((packed & 7) << 2) | ((packed & 8) << 4)
    hi = ((packed >> 2) & 0x1C) | (packed & 0x80)
    cat = np.concatenate if isinstance(packed, np.ndarray) else jnp.concatenate
    return cat([lo, hi], axis=-1)


def _to_e4m3(packed: jax.Array, native: bool) -> jax.Array:
    """float8_e4m3fn [64, 32] A operand (``WGMMA_8BIT`` layout) = e2m1 * 2^-6 of the 16 packed bytes of a
    32-column block per row (uint8 [64, 16], ``WGMMA_8BIT`` layout: a thread holds bytes 4q..4q+3 of rows g and
    g + 8, one 32-bit word each). Natively (inline PTX) each word gives the thread's low-nibble word (columns
    4q..4q+3 of the operand) and its high-nibble word (columns 16 + 4q..): 7 instructions per 8 weights, no data
    exchange between threads. Interpret mode: the same bytes through ``e4m3_codes``."""
    if not native:
        return lax.bitcast_convert_type(e4m3_codes(packed), jnp.float8_e4m3fn)
    import jax.experimental.mosaic.gpu as mgpu  # noqa: PLC0415 - lowering-time imports
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.lib.mlir.dialects import llvm  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415

    rows, c = packed.shape
    assert c == 16, packed.shape  # one 32-column block: its low-nibble half, then its high-nibble half

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,),
                       return_type=plgpu.ShapeDtypeStruct((rows, 2 * c), jnp.float8_e4m3fn,
                                                          layout=plgpu.Layout.WGMMA_8BIT))
    def f(_, p):
        i32 = ir.IntegerType.get_signless(32)
        quad = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
        in_shape = fa.WGMMA_LAYOUT_8BIT.registers_shape((rows, c))
        out_shape = fa.WGMMA_LAYOUT_8BIT.registers_shape((rows, 2 * c))
        # registers: [.., 16-column block (dim 1), .., row half (dim 4), ..]: the input's one block -> block 0
        # (low nibbles) and block 1 (high nibbles) of the output
        assert p.registers.shape == in_shape and out_shape[1] == 2 * in_shape[1] == 2, (in_shape, out_shape)
        out = np.empty(out_shape, dtype=object)
        for idx, reg in np.ndenumerate(p.registers):
            word = mgpu_utils.bitcast(reg, i32)
            for half, asm in ((0, _E4M3_LO_ASM), (1, _E4M3_HI_ASM)):
                o = list(idx)
                o[1] = idx[1] + half * in_shape[1]
                out[tuple(o)] = mgpu_utils.bitcast(llvm.inline_asm(i32, [word], asm, "=r,r"), quad)
        return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=None)

    return f(packed)


def _scale_words(ref) -> list[jax.Array]:
    """The 16 e8m0 scale bytes of each of 64 weight rows (uint8 [64, 16] in SMEM, rows 16 bytes apart) as four
    uint32 [64] arrays in the WGMMA row layout: array j holds bytes 4j..4j+3 of the row, the lowest byte first.
    A thread reads its two rows with one 16-byte shared load each, where a byte load per row and scale block
    took 32 loads and as many conversions per 512-column step. Native only (PTX pointer loads)."""
    import jax.experimental.mosaic.gpu as mgpu  # noqa: PLC0415 - lowering-time imports
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.lib.mlir.dialects import llvm, vector  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415

    rows, cols = ref.shape
    assert (rows, cols) == (64, FP8_SCALE_COLS), ref.shape
    words = cols // 4
    row = plgpu.Layout.WGMMA.reduce(1)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=[plgpu.ShapeDtypeStruct((rows,), jnp.uint32, layout=row)] * words)
    def f(_, r):
        i32 = ir.IntegerType.get_signless(32)
        layout = fa.WGMMA_ROW_LAYOUT
        shape = layout.registers_shape((rows,))
        out = [np.empty(shape, dtype=object) for _ in range(words)]
        for idx, (ri,) in zip(np.ndindex(shape), layout.thread_idxs((rows,))):
            ptr = mgpu_utils.memref_ptr(mgpu_utils.memref_slice(r, (ri, slice(None))))
            quad = llvm.load(ir.VectorType.get((words,), i32), ptr)  # 16-byte aligned: one ld.shared.v4
            for j in range(words):
                out[j][idx] = vector.broadcast(ir.VectorType.get((1,), i32), vector.extract(quad, [], [j]))
        return [mgpu.FragmentedArray(_registers=o, _layout=layout, _is_signed=False) for o in out]

    return f(ref)


def _scale_exp_bias(dequant: Dequant) -> int:
    """The scale byte's offset: the scale multiplied into a dequantised weight is 2^(byte + bias - 127), as a
    bf16 (a normal one: bytes 27..160 for "lop3", whose x is scaled by 2^32; 1..240 for the others), and
    undoes the route's placement: float16 e2m1 * 2^-14 ("f16": 2^(byte - 113)), bf16 e2m1 * 2^-126 times
    2^126 ("bf16": 2^(byte - 127)), bf16 e2m1 * 2^-126 with x * 2^32 ("lop3": 2^(byte + 126 - 127 - 32))."""
    return {"f16": 14, "bf16": 0, "lop3": 126 - X_SCALE_LOG2}[dequant]


@functools.lru_cache(maxsize=None)
def _build_call(*, n: int, k: int, items: int, bt: int, bn: int, bk: int, splits: int, stages: int,
                dequant: Dequant, out_dtype: jnp.dtype, interpret: plgpu.InterpretGPUParams | None,
                mma_group: int | None = None, profile_dir: str | None = None, sets: int = 1):
    emulate_mma = interpret is not None
    if dequant == "fp8":
        return _build_fp8_call(n=n, k=k, items=items, bt=bt, bn=bn, bk=bk, splits=splits, stages=stages,
                               out_dtype=out_dtype, interpret=interpret, mma_group=mma_group,
                               profile_dir=profile_dir, sets=sets)
    if sets != 1:
        raise ValueError("several weight sets in one call: the e4m3-x route only")
    if profile_dir is not None:
        raise ValueError("profile_dir: the profiled regions are the e4m3-x route's (pass x_scale)")
    exp_bias = _scale_exp_bias(dequant)
    lop3 = dequant == "lop3"
    kc = k // splits  # input columns per CTA
    steps = kc // bk
    nsc = kc // SCALE_BLOCK  # scale bytes per weight row per CTA
    blocks = bk // SCALE_BLOCK  # scale blocks per pipeline step
    n_tiles = n // bn
    nwg = bn // 64
    L = plgpu.Layout.WGMMA
    ROW = L.reduce(1)
    x_tf = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))  # one 32-byte swizzle row: 16 bf16
    wsw = min(128, bk // 2)  # packed bytes: swizzled, so the 8 rows a warp loads hit different banks
    w_tf = (plgpu.TilingTransform((8, wsw)), plgpu.SwizzleTransform(wsw))

    def kernel(info_ref, x_ref, w_ref, s_ref, o_ref, sc_s, bar):
        item, si, ex, row0, n0 = grouped_rows.cta_work(info_ref, items, n_tiles, bn)

        def body(idx, x_s, w_s, acc):
            (step,) = idx
            wg = lax.axis_index("wg")

            def operands():
                """(A, B) pairs of this step: dequantised [64, 16] weights (registers), [16, bt] token slices."""
                # uint8 [64, bk / 2]; "lop3": a 32-bit word of a row per thread and block
                packed = plgpu.load(w_s.at[pl.ds(wg * 64, 64)], layout=plgpu.Layout.WGMMA_8BIT if lop3 else L)
                for c in range(blocks):
                    kb = step * blocks + c
                    sb = plgpu.load(sc_s.at[wg, kb // 16, :, kb % 16], layout=ROW, optimized=False)
                    sf = lax.bitcast_convert_type((sb.astype(jnp.uint32) + exp_bias) << 23, jnp.float32)
                    xa, xb = x_s.at[:, pl.ds(32 * c, 16)].T, x_s.at[:, pl.ds(32 * c + 16, 16)].T
                    if lop3:  # one block at a time: a whole step's bf16 weights would hold bk / 2 registers
                        a = _dequant_lop3(packed[:, 16 * c:16 * c + 16])
                        a = a * lax.broadcast_in_dim(sf.astype(jnp.bfloat16), (64, 32), [0])
                        yield a[:, :16], xa
                        yield a[:, 16:], xb
                        continue
                    sv = lax.broadcast_in_dim(sf.astype(jnp.bfloat16), (64, 16), [0])
                    p16 = packed[:, 16 * c:16 * c + 16].astype(jnp.uint16)
                    yield _dequant(p16, 0, sv, dequant), xa
                    yield _dequant(p16, 1, sv, dequant), xb

            if emulate_mma:  # the interpreter's wgmma takes SMEM operands only: same products, one dot each
                for a, b in operands():
                    acc = acc + jnp.dot(a, b[...], preferred_element_type=jnp.float32)
                return acc
            for a, b in operands():  # natively the accumulator lives in registers for the whole K range
                plgpu.wgmma(acc_ref[0], a, b)
            plgpu.wgmma_wait(0)  # this step's SMEM slots are released when the body returns
            return acc

        acc_ref = []  # the native accumulator, allocated by ``compute`` around the pipeline

        def compute(run_pipeline):
            wg = lax.axis_index("wg")
            for g in range(nsc // 16):  # [64, 16]-byte tiles: the 8 rows a warp reads are 16 bytes apart
                plgpu.copy_gmem_to_smem(s_ref.at[ex, pl.ds(n0 + wg * 64, 64), pl.ds(si * nsc + 16 * g, 16)],
                                        sc_s.at[wg, g], bar.at[wg])
            plgpu.barrier_wait(bar.at[wg])
            if emulate_mma:
                acc = run_pipeline(plgpu.layout_cast(jnp.full((64, bt), 0.0, jnp.float32), L))
            else:
                def run(ref):
                    acc_ref.append(ref)
                    run_pipeline(())
                    return ref[...]

                acc = pl.run_scoped(run, plgpu.ACC((64, bt), jnp.float32))
            dst = o_ref.at[pl.ds(n0 + wg * 64, 64), pl.ds(item * bt, bt)] if splits == 1 else \
                o_ref.at[si, pl.ds(n0 + wg * 64, 64), pl.ds(item * bt, bt)]
            dst[...] = acc.astype(dst.dtype)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            fence_slot_reads(body, interpret), grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=nwg,
            max_concurrent_steps=stages, compute_context=compute,
            in_specs=[plgpu.BlockSpec((bt, bk), lambda s: (0, s), transforms=x_tf),
                      plgpu.BlockSpec((bn, bk // 2), lambda s: (0, s), transforms=w_tf)])

        @pl.when(ex >= 0)
        def _():
            pipeline(x_ref.at[pl.ds(row0, bt), pl.ds(si * kc, kc)],
                     w_ref.at[ex, pl.ds(n0, bn), pl.ds(si * kc // 2, kc // 2)])

    out_shape = (n, items * bt) if splits == 1 else (splits, n, items * bt)
    scratch = [plgpu.SMEM((nwg, nsc // 16, 64, 16), jnp.uint8),
               plgpu.Barrier(num_arrivals=nsc // 16, num_barriers=nwg)]
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
                        grid=(splits * n_tiles * items,), grid_names=("cta",), num_threads=nwg + 1,
                        thread_name="wg", scratch_types=scratch, compiler_params=params,
                        interpret=interpret if interpret is not None else False)


PROFILE_RANGES = 512  # per warpgroup and call: ``profile_dir``'s events (past it the trace is truncated)
FP8_SCALE_COLS = 16  # the "fp8" route's weight-scale block per pipeline step: [block_n, 16] bytes (TMA rows >= 16 B)


def fp8_stages(stages: int, steps: int, bt: int, bn: int, bk: int) -> int:
    """The "fp8" route's ring depth: at most ``stages``, what fits SMEM, and a divisor of the steps per work
    unit (consecutive units' pipelines continue one ring, whose slots must line up at unit boundaries). One
    pipeline per CTA over all its units' steps, of any depth (the "flat" ring, which the FP8 grouped kernel's
    persistent form uses), measured no faster at 1 to 64 tokens
    (benchmarks/results/archive/fp4_decode_ncu_sweep_h200_2026-12-02.json, run 3)."""
    per_stage = bt * bk + bn * bk // 2 + bn * FP8_SCALE_COLS + K_ALIGN // X_BLOCK * bt * 4
    fit = min(stages, steps, SMEM_BUDGET // per_stage)
    if fit < 1:
        raise ValueError(f"block_t {bt} x block_k {bk} (block_n {bn}) does not fit shared memory")
    return max(d for d in range(1, fit + 1) if steps % d == 0)


@functools.lru_cache(maxsize=None)
def _build_fp8_call(*, n: int, k: int, items: int, bt: int, bn: int, bk: int, splits: int, stages: int,
                    out_dtype: jnp.dtype, interpret: plgpu.InterpretGPUParams | None, mma_group: int | None,
                    profile_dir: str | None = None, sets: int = 1):
    """The "fp8" route (e4m3 x) as a persistent kernel: one CTA per SM loops over the work units (K split, N
    tile, item), and consecutive units continue one TMA ring (``pipeline_state``), so a unit's first loads are
    in flight while the previous unit's last steps compute: at decode a unit is 2-8 steps, and a ring refilled
    per CTA left the tensor and CUDA cores idle for a DRAM round trip per unit. Everything a step reads is in
    the ring: the token tile, the packed weights, their e8m0 scales ([block_n, 16] bytes) and the tokens' x
    scales ([4, block_t] float32), both those of the 512-column chunk holding the step (re-read from L2 by the
    steps of one chunk): a TMA row is at least 16 bytes, and Mosaic's native copies at least 128 bytes.
    ``bn`` 256 runs four compute warpgroups (``compute_registers``: 104 registers each beside the producer's 40)
    instead of two, for more warps converting per SM; it timed level with two (docs/perf-log.md, twenty-fourth
    session). ``sets`` weight sets of one shape (w1 and w3 of an MoE: arguments w_0, s_0, w_1, s_1, ...) share
    the call: their N tiles are one list of units, the output rows of set i start at i * n, so at decode one
    call streams both weights with twice the units to balance over the CTAs."""
    emulate_mma = interpret is not None
    kc = k // splits  # input columns per unit
    steps = kc // bk
    blocks = bk // SCALE_BLOCK  # scale blocks per pipeline step
    per_x = X_BLOCK // SCALE_BLOCK  # scale blocks per x-scale block
    xb = K_ALIGN // X_BLOCK  # x-scale rows in the ring: a 512-column chunk's (a TMA copy of >= 128 bytes)
    n_tiles = n // bn
    nwg = bn // 64
    # at most one CTA per SM (and per unit); interpret mode: 3, so that a CTA runs several units
    ctas = min(splits * sets * n_tiles * items, num_sms() if interpret is None else 3)
    st = fp8_stages(stages, steps, bt, bn, bk)
    L = plgpu.Layout.WGMMA
    ROW, COL = L.reduce(1), L.reduce(0)  # [64] along the accumulator's rows (weights), [bt] along its columns
    group = min(blocks, mma_group or max(1, min(4, 128 // bt)))  # MMAs in flight per wait: bt / 2 registers each
    if blocks % group:
        raise ValueError(f"mma_group {group} must divide the {blocks} scale blocks of a step (block_k {bk})")
    wsw = min(128, bk // 2)  # packed bytes: swizzled, so the 8 rows a warp loads hit different banks
    cw = wsw if nwg == 4 else bk // 2  # packed columns loaded at once (``step_acc``)
    specs = [plgpu.BlockSpec((bt, bk), lambda s: (0, s),  # e4m3 tokens: a 32-byte swizzle row = one scale block
                             transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(32))),
             plgpu.BlockSpec((xb, bt), lambda s: (s * bk // K_ALIGN, 0)),
             plgpu.BlockSpec((bn, bk // 2), lambda s: (0, s),
                             transforms=(plgpu.TilingTransform((8, wsw)), plgpu.SwizzleTransform(wsw))),
             plgpu.BlockSpec((bn, FP8_SCALE_COLS), lambda s: (0, s * blocks // FP8_SCALE_COLS))]

    def step_acc(step, x_s, sx_s, w_s, s_s, acc):
        """Step ``step`` of a work unit: per 32-column block an e4m3 x e4m3 wgmma (K = 32) into a fresh
        accumulator, promoted in fp32 with the block's weight scale (per row, times 2^6) and, per 128 columns, the
        tokens' x scale: the release's per-block summation. ``group`` MMAs are in flight per wait, and the next
        group's weights are converted (this group's scales loaded) while they run: the warps waited on
        shared-memory loads for most of their stalls when conversion came after the wait, and the overlap was no
        slower anywhere
        (benchmarks/results/archive/fp4_decode_ncu_sweep_h200_2026-12-02.json)."""
        wg = lax.axis_index("wg")
        groups = [list(range(c0, c0 + group)) for c0 in range(0, blocks, group)]
        col0 = step * blocks % FP8_SCALE_COLS  # the step's first scale column in the ring's 16
        chunks = {}  # the packed weights, uint8 [64, cw]: the whole step's, or (four warpgroups) a swizzle tile's

        def load_for(cs):
            """Load the packed columns of this warpgroup's rows that blocks ``cs`` lie in (at the step's level, not
            inside an MMA scope, whose values cannot be used by the next). Four warpgroups (``compute_registers``
            each) load one swizzle tile at a time (wsw / 4 registers per thread), not the whole step (bk / 8)."""
            for j in sorted({16 * c // cw for c in cs}):
                if j not in chunks:
                    chunks[j] = plgpu.load(w_s.at[pl.ds(wg * 64, 64), pl.ds(j * cw, cw)],
                                           layout=plgpu.Layout.WGMMA_8BIT)

        def packed(c):
            j = 16 * c // cw
            return chunks[j][:, 16 * c - j * cw:16 * c - j * cw + 16]  # block c's bytes [64, 16]

        def convert(cs):
            return [_to_e4m3(packed(c), native=not emulate_mma) for c in cs]

        def scales(cs):
            """Per block of ``cs`` its weight scales (times 2^6) per row; per x-scale block it ends, the
            tokens' x scales."""
            sws, xss = [], {}
            for c in cs:
                if words is not None:
                    sb = (words[c // 4] >> (8 * (c % 4))) & 0xFF
                else:
                    sb = plgpu.load(s_s.at[pl.ds(wg * 64, 64), col0 + c], layout=ROW, optimized=False)
                    sb = sb.astype(jnp.uint32)
                sws.append(lax.bitcast_convert_type((sb + FP8_EXP) << 23, jnp.float32))
                if c % per_x == per_x - 1:
                    xss[c] = plgpu.load(sx_s.at[step * bk // X_BLOCK % xb + c // per_x], layout=COL,
                                        optimized=False)
            return sws, xss

        # a step's 16 scale columns per row in four 32-bit words (natively, at 512-column steps)
        words = _scale_words(s_s.at[pl.ds(wg * 64, 64)]) if blocks == FP8_SCALE_COLS and not emulate_mma else None
        inner = {}
        load_for(groups[0])
        a_next = convert(groups[0])
        for i, cs in enumerate(groups):
            a, b = a_next, [x_s.at[:, pl.ds(32 * c, 32)].T for c in cs]
            last = i + 1 == len(groups)
            if not last:
                load_for(groups[i + 1])
            if emulate_mma:  # the interpreter's wgmma takes SMEM operands only
                blks = [jnp.dot(ai.astype(jnp.float32), bi[...].astype(jnp.float32),
                                preferred_element_type=jnp.float32) for ai, bi in zip(a, b)]
                (sws, xss), a_next = scales(cs), (None if last else convert(groups[i + 1]))
            else:
                def mma(*refs, a=a, b=b, cs=cs, i=i, last=last):
                    for r, ai, bi in zip(refs, a, b):
                        plgpu.wgmma(r, ai, bi)
                    sc = scales(cs)  # loaded, and the next group converted, while the tensor cores run
                    nxt = None if last else convert(groups[i + 1])
                    plgpu.wgmma_wait(0)
                    return [r[...] for r in refs], sc, nxt

                blks, (sws, xss), a_next = pl.run_scoped(mma, *[plgpu.ACC((64, bt), jnp.float32) for _ in cs])
            for c, blk, sw in zip(cs, blks, sws):
                t = blk * lax.broadcast_in_dim(sw, (64, bt), [0])
                g = c // per_x
                inner[g] = t if g not in inner else inner[g] + t
                if c % per_x == per_x - 1:  # the x-scale block is complete
                    acc = acc + inner.pop(g) * lax.broadcast_in_dim(xss[c], (64, bt), [1])
        return acc

    def body(idx, x_s, sx_s, w_s, s_s, acc):
        with jax.named_scope("step"):  # regions of the Mosaic GPU profiler (``profile_dir``)
            return step_acc(idx[0], x_s, sx_s, w_s, s_s, acc)

    def unit_refs(x_ref, sxt_ref, w_ref, s_ref, ex, row0, n0, si):
        return (x_ref.at[pl.ds(row0, bt), pl.ds(si * kc, kc)],
                sxt_ref.at[pl.ds(si * (kc // X_BLOCK), kc // X_BLOCK), pl.ds(row0, bt)],
                w_ref.at[ex, pl.ds(n0, bn), pl.ds(si * kc // 2, kc // 2)],
                s_ref.at[ex, pl.ds(n0, bn), pl.ds(si * kc // SCALE_BLOCK, kc // SCALE_BLOCK)])

    def make_pipeline(body_fn, context, state):
        return plgpu.emit_pipeline_warp_specialized(
            fence_slot_reads(body_fn, interpret), grid=(steps,), memory_registers=MEMORY_REGISTERS, wg_axis="wg",
            num_compute_wgs=nwg, max_concurrent_steps=st, compute_context=context, in_specs=specs,
            pipeline_state=state)

    def kernel(*refs):
        with _launch_pool_registers():
            kernel_body(*refs)

    def kernel_body(count_ref, info_ref, x_ref, sxt_ref, *rest):
        *ws_refs, o_ref = rest  # w_0, s_0, w_1, s_1, ...: the weight sets
        ignore = lambda *_, **__: None  # noqa: E731 - the allocations depend on the specs and shapes only
        allocs = make_pipeline(ignore, ignore, None).get_allocations(
            *unit_refs(x_ref, sxt_ref, ws_refs[0], ws_refs[1], 0, 0, 0, 0))
        n_items = count_ref[0]

        @functools.partial(pl.run_scoped, allocs=allocs, collective_axes="wg")
        def _(allocs):
            cta = lax.axis_index("cta")
            units = splits * sets * n_tiles * n_items
            n_local = jnp.maximum(units - cta + ctas - 1, 0) // ctas  # CTA c runs units c, c + ctas, ...

            def unit(j, carry):
                """This CTA's unit j: (split, set and N tile, item), item fastest. The CTA's first unit starts the
                ring, its last drains it, the ones between continue it; a CTA with one unit runs a whole pipeline.
                One division by the dynamic item count per unit, the rest by constants: ``nd_loop``'s remainder and
                quotient by the unit count and two more divisions by the item count (Mosaic emits each as a
                reciprocal-based sequence every warp runs) made the call slower at 1 token
                (benchmarks/results/archive/fp4_tiles_time_h200_2026-12-04_twentyeighth.json)."""
                u = cta + j * ctas
                q = u // n_items
                item = u - q * n_items
                tile, si = q % (sets * n_tiles), q // (sets * n_tiles)
                ex, row0 = info_ref[0, item], info_ref[1, item]
                ws_i, n0 = tile // n_tiles, tile % n_tiles * bn  # weight set, first row in it

                def context(run_pipeline):
                    acc = run_pipeline(plgpu.layout_cast(jnp.full((64, bt), 0.0, jnp.float32), L))
                    r0 = ws_i * n + n0 + lax.axis_index("wg") * 64  # the output row of this warpgroup's first
                    dst = o_ref.at[pl.ds(r0, 64), pl.ds(item * bt, bt)] if splits == 1 else \
                        o_ref.at[si, pl.ds(r0, 64), pl.ds(item * bt, bt)]
                    with jax.named_scope("store"):
                        dst[...] = acc.astype(dst.dtype)

                last = n_local - 1
                P = plgpu.PipelinePipeline
                for i in range(sets):  # one pipeline per weight set: a set's refs are static in its TMA copies
                    refs = unit_refs(x_ref, sxt_ref, ws_refs[2 * i], ws_refs[2 * i + 1], ex, row0, n0, si)

                    @pl.when((ws_i == i) & (last == 0))
                    def _(refs=refs):
                        with jax.named_scope("unit"):
                            make_pipeline(body, context, None)(*refs, allocations=allocs)

                    @pl.when((ws_i == i) & (last > 0))
                    def _(refs=refs):
                        state = jnp.where(j == 0, P.START, jnp.where(j == last, P.STOP, P.STEADY))
                        with jax.named_scope("unit"):
                            make_pipeline(body, context, state)(*refs, allocations=allocs)
                return carry

            lax.fori_loop(0, n_local, unit, None)

    out_shape = (sets * n, items * bt) if splits == 1 else (splits, sets * n, items * bt)
    if profile_dir is not None and interpret is not None:
        raise ValueError("profile_dir: Mosaic GPU's profiler runs natively only (interpret mode has no trace)")
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                  **(dict(profile_space=PROFILE_RANGES, profile_dir=profile_dir,
                                          profile_bounds_check=True) if profile_dir else {}))
    return plgpu.kernel(kernel,
                        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype), grid=(ctas,), grid_names=("cta",),
                        num_threads=nwg + 1, thread_name="wg", compiler_params=params,
                        interpret=interpret if interpret is not None else False)
