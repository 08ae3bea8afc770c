"""Grouped (MoE) GEMM with FP8 expert weights as DeepSeek-V3 / V3.2 store them, on Hopper (Pallas Mosaic GPU),
with the pure-JAX path (``implementation="xla"``: dequantise, one float32 ``lax.ragged_dot_general``) as reference.

    y[r, :] = sum_kb sx[r, kb] sw[e(r), n // 128, kb] * (sum_{k in kb} xq[r, k] Wq[e(r), n, k])
    xq, sx = act_quant(x, 128, scale_fmt)          rows r of x [M, K] grouped by expert in order, ``sizes`` [E]
    Wq float8_e4m3fn [E, N, K], sw float32 [E, N/128, K/128]   (128 x 128 weight blocks, as the checkpoint)

DeepSeek's ``linear()`` for every routed expert: the input re-quantised per 1 x 128 group, the FP8 products
summed per 128-column block in float32 and promoted with both scales. Rows past sum(sizes) come out as 0.

The kernel is the FP4 grouped GEMM's design (``fp4_grouped_gemm``) with e4m3 weights; what differs:
- Roles swapped (y^T = W x^T) as there: the weights are wgmma's A operand from registers, 64 rows per compute
  warpgroup, the token rows B from SMEM. e4m3 -> float16 is one ``cvt`` per two weights and exact, and the
  quantised x (e4m3 values) is exact in float16 too, so the float16 MMA multiplies the FP8 values exactly
  (Hopper's FP8 wgmma would need both operands K-major in SMEM, i.e. the weights through SMEM, and its
  accumulation is reduced precision: DeepGEMM promotes every 128 for that reason).
- Scales: per 128-column block, a fresh MMA accumulator [64, block_t], then acc += blk * sx[token] * sw: the
  weight scale is one scalar per warpgroup (64 rows lie in one 128-row scale block), the activation scales a
  vector over the accumulator's columns (tokens). A CTA's scales (its weight-scale row over its K range, and
  sx^T for its token tile) arrive once, by TMA, before the pipeline (the weight scales as 8 rows that hold the
  CTA's: a TMA copy from a warpgroup moves a multiple of 128 bytes; ``fp8_gemm.pad_weight_scales`` pads only
  stacks of fewer than 8 rows, never the model's): the FP8 GEMM's profile (2026-12-01) put
  a fifth of its stalls on a scale loaded from global memory inside the K loop.
- Work items (expert, token tile), the 8-row-aligned padded copy of x, the output gather, split-K: as the FP4
  kernel (``grouped_rows``). A split holds whole 512-column chunks (the TMA rows of the scales: 4 floats).
Limits: N a multiple of 128, K of 512 (else ``Unsupported``; "auto" runs XLA); ``block_t`` <= 128.
``interpret=None`` runs GPU interpret mode off-GPU (tests only); there the register-A MMA is a ``jnp.dot`` of
the same float16 operands with float32 accumulation, everything else is the kernel's.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jds.ops import quant
from jds.ops.dispatch import Implementation, Unsupported, num_sms, run_op
from pallas_kernels import grouped_rows
from pallas_kernels.fp8_gemm import SW_ROWS, fence_slot_reads, pad_weight_scales, scale_window

BLOCK = 128  # weight-scale block (both dims) and activation-scale group
K_ALIGN = 512  # K per split: whole 16-byte TMA rows of float32 scales
SMEM_BUDGET = 220 * 1024
SCALE_FMTS = ("ue8m0", "amax")
PERSISTENT_MAX_WAVES = 4  # persistent=None: the persistent kernel up to this many waves of work units
_RAGGED_DN = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def fp8_grouped_linear(x: jax.Array, sizes: jax.Array, wq: jax.Array, w_scale: jax.Array, *,
                       out_dtype: jnp.dtype = jnp.bfloat16, scale_fmt: quant.ScaleFmt = "ue8m0",
                       implementation: Implementation = "auto",
                       interpret: bool | plgpu.InterpretGPUParams | None = None, block_t: int | None = None,
                       block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                       stages: int = 4, layout: str = "auto", persistent: bool | None = None) -> jax.Array:
    """y [M, N] (``out_dtype``): row r of x [M, K] times expert e(r)'s FP8 weight, rows grouped by expert in order
    (``sizes`` int [E], sum <= M; rows past the sum give 0), W = ``wq`` (float8_e4m3fn [E, N, K]) with
    ``w_scale`` (float32 [E, N/128, K/128]); x re-quantised per 1 x 128 with ``scale_fmt`` scales.

    ``implementation``: "xla" = dequantise + float32 ``ragged_dot_general``; "pallas" = the kernel
    (``Unsupported`` for N not a multiple of 128 or K not a multiple of 512); "auto" = the kernel where it
    applies, else XLA. Tiles (kernel only; ``_pick_tiles`` has the defaults): ``block_t`` token rows per work
    item (8..128, a power of two), ``block_n`` weight rows per CTA (64 or 128), ``block_k`` input columns per
    pipeline step (128 or 256), ``split_k`` K splits, ``stages`` TMA ring depth. ``layout``: the rows'
    bookkeeping in XLA (about eight small kernels) or in one kernel, "pallas" (``grouped_rows.row_layout``), which
    shortened the decode call at every measured shape on the H200
    (benchmarks/results/fp8g_decode_ncu_sweep_h200_2026-12-02.json); "auto": "pallas" natively, "xla" in
    interpret mode; "fused": that kernel also copies the quantised rows and their scales into the padded layout
    (two XLA gathers fewer). ``persistent``: the kernel as one CTA per SM looping over the work units with one TMA ring
    for all of them, scales included (``_build_persistent_call``), or one CTA per unit (False); None = persistent
    natively where the static unit bound is at most ``PERSISTENT_MAX_WAVES`` waves of CTAs: exact kernel times
    (fp8g_decode_ncu_sweep_h200_2026-12-02.json) had it faster at 1 token (3.8 waves at most), slower at 8 and
    64 tokens of w1 (17 and 141 waves), where the per-CTA grid's waves are full anyway.
    ``interpret``: GPU interpret mode (True or an ``InterpretGPUParams``); None = whenever the default backend
    is not a GPU.
    """
    _check_inputs(x, sizes, wq, w_scale, scale_fmt)
    return run_op("fp8_grouped_linear", implementation, {
        "xla": lambda: _xla(x, sizes, wq, w_scale, out_dtype, scale_fmt),
        "pallas": lambda: _pallas(x, sizes, wq, w_scale, out_dtype=out_dtype, scale_fmt=scale_fmt,
                                  interpret=interpret, block_t=block_t, block_n=block_n, block_k=block_k,
                                  split_k=split_k, stages=stages, layout=layout, persistent=persistent)})


def _check_inputs(x, sizes, wq, w_scale, scale_fmt) -> None:
    """Input errors of both implementations (ValueError naming the argument)."""
    if wq.ndim != 3 or jnp.dtype(wq.dtype) != jnp.float8_e4m3fn:
        raise ValueError(f"wq must be float8_e4m3fn [E, N, K], got {wq.dtype} {wq.shape}")
    e, n, k = wq.shape
    want = (e, -(-n // BLOCK), -(-k // BLOCK))
    if w_scale.shape != want or not jnp.issubdtype(w_scale.dtype, jnp.floating):
        raise ValueError(f"w_scale must be float {want} for wq {wq.shape}, got {w_scale.dtype} {w_scale.shape}")
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] (K = wq.shape[-1]), got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a float array, got {x.dtype}")
    if k % BLOCK:
        raise ValueError(f"wq: K = {k} must be a multiple of {BLOCK} (the activation-scale group)")
    if sizes.shape != (e,) or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(f"sizes must be an int32 [{e}] (one group size per expert), got {sizes.dtype} {sizes.shape}")
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")


def _xla(x, sizes, wq, w_scale, out_dtype, scale_fmt) -> jax.Array:
    """The reference: both operands dequantised to float32, one ragged dot at float32 precision (the block
    sums of FP8 products up to float32 summation order; exactly so for power-of-two scales)."""
    xq, sx = quant.act_quant(x, BLOCK, scale_fmt)
    w = jax.vmap(quant.dequant_weight_blocks)(wq, w_scale)
    y = lax.ragged_dot_general(quant.dequant(xq, sx, BLOCK), w, sizes.astype(jnp.int32), _RAGGED_DN,
                               precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def supports(n: int, k: int) -> bool:
    """Whether the kernel takes expert weights of [n, k] (out, in)."""
    return n > 0 and k > 0 and n % BLOCK == 0 and k % K_ALIGN == 0


def _check_tiles(block_t, block_n, block_k, split_k, stages) -> None:
    grouped_rows.check_tiles(block_t, block_n, block_k, split_k, stages, (128, 256))


def _pick_tiles(m: int, e: int, n: int, k: int, block_t: int | None, block_n: int | None,
                block_k: int | None, split_k: int | None) -> tuple[int, int, int, int]:
    """(block_t, block_n, block_k, split_k): the given ones, defaults for the rest (``grouped_rows.pick_tiles``;
    a split holds whole ``K_ALIGN``-column chunks)."""
    return grouped_rows.pick_tiles(m, e, n, k, block_t, block_n, block_k, split_k, K_ALIGN)


def _fit_stages(stages: int, bt: int, bn: int, bk: int, kps: int) -> int:
    """The ring depth that fits SMEM next to the scales (ValueError when not even one stage fits)."""
    per_stage = bt * bk * 2 + bn * bk  # float16 token tile + e4m3 weight tile
    fit = (SMEM_BUDGET - (bn // 64) * 4 * kps * (bt + SW_ROWS)) // per_stage
    if fit < 1:
        raise ValueError(f"block_t {bt} x block_k {bk} (block_n {bn}) does not fit shared memory")
    return max(1, min(stages, kps * BLOCK // bk, fit))


def _pallas(x, sizes, wq, w_scale, *, out_dtype, scale_fmt, interpret, block_t, block_n, block_k, split_k, stages,
            layout="auto", persistent=None):
    _check_tiles(block_t, block_n, block_k, split_k, stages)
    if persistent is not None and not isinstance(persistent, bool):
        raise ValueError(f"persistent must be a bool or None, got {persistent!r}")
    e, n, k = wq.shape
    m = x.shape[0]
    if not supports(n, k):
        raise Unsupported(f"fp8_grouped_linear kernel: N = {n} must be a multiple of {BLOCK} and K = {k} a "
                          f"multiple of {K_ALIGN} (wq shape {wq.shape})")
    out_dtype = jnp.dtype(out_dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    xq, sx = quant.act_quant(x, BLOCK, scale_fmt)
    xh = xq.astype(jnp.float16)  # e4m3 values are exact in float16
    p = grouped_rows.plan(sizes, m, e, n, k, block_t, block_n, block_k, split_k, K_ALIGN, interpret, layout,
                          rows=(xh, sx) if layout == "fused" else None)
    xp, sxt = grouped_rows.padded_x(xh, sx, p)  # rows between groups: zeros with scale 0; scales [K/128, rows]
    kps = k // BLOCK // p.splits
    # a CTA copies SW_ROWS weight-scale rows holding its own (a TMA copy moves a multiple of 128 bytes)
    ws = pad_weight_scales(w_scale.astype(jnp.float32))
    odt = out_dtype if p.splits == 1 else jnp.dtype(jnp.float32)
    if persistent is None:
        units = p.items * p.splits * (n // p.block_n)
        persistent = p.interpret is None and units <= PERSISTENT_MAX_WAVES * num_sms()
    if persistent:
        call = _build_persistent_call(n=n, k=k, items=p.items, bt=p.block_t, bn=p.block_n, bk=p.block_k,
                                      splits=p.splits, stages=stages, out_dtype=odt, interpret=p.interpret)
        return grouped_rows.finish(call(p.count, p.info, xp, sxt, wq, ws), p, out_dtype)
    call = _build_call(n=n, k=k, items=p.items, bt=p.block_t, bn=p.block_n, bk=p.block_k, splits=p.splits,
                       stages=_fit_stages(stages, p.block_t, p.block_n, p.block_k, kps), out_dtype=odt,
                       interpret=p.interpret)
    return grouped_rows.finish(call(p.info, xp, sxt, wq, ws), p, out_dtype)


@functools.lru_cache(maxsize=None)
def _build_call(*, n: int, k: int, items: int, bt: int, bn: int, bk: int, splits: int, stages: int,
                out_dtype: jnp.dtype, interpret: plgpu.InterpretGPUParams | None):
    emulate_mma = interpret is not None
    sw_rows = max(n // BLOCK, SW_ROWS)  # rows of the (padded) weight scales
    kps = k // BLOCK // splits  # K blocks per CTA
    kc = kps * BLOCK
    steps = kc // bk
    bps = bk // BLOCK  # K blocks per pipeline step
    n_tiles = n // bn
    nwg = bn // 64
    L = plgpu.Layout.WGMMA
    COL = L.reduce(0)  # a [bt] vector along the accumulator's columns (tokens)
    x_tf = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))  # 16 float16 = one 32-byte swizzle row
    w_tf = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(128))  # 128 e4m3 = one 128-byte row

    def kernel(info_ref, x_ref, sxt_ref, w_ref, sw_ref, o_ref, sw_s, sx_s, bar):
        item, si, ex, row0, n0 = grouped_rows.cta_work(info_ref, items, n_tiles, bn)
        sw0 = scale_window(n0 // BLOCK, sw_rows)  # the copied weight-scale rows; this CTA's is row sw_row
        sw_row = n0 // BLOCK - sw0

        def body(idx, x_s, w_s, acc):
            (step,) = idx
            wg = lax.axis_index("wg")
            tile = plgpu.load(w_s.at[pl.ds(wg * 64, 64)], layout=L)  # e4m3 [64, bk]
            for j in range(bps):
                kb = step * bps + j  # K block inside this CTA's range
                blk = _block_product(tile, x_s, j, bt, emulate_mma)
                sxv = plgpu.load(sx_s.at[wg, kb], layout=COL, optimized=False)  # [bt]
                acc = acc + blk * lax.broadcast_in_dim(sxv * sw_s[wg, sw_row, kb], (64, bt), [1])
            return acc

        def compute(run_pipeline):
            wg = lax.axis_index("wg")
            plgpu.copy_gmem_to_smem(sw_ref.at[ex, pl.ds(sw0, SW_ROWS), pl.ds(si * kps, kps)], sw_s.at[wg],
                                    bar.at[wg])
            plgpu.copy_gmem_to_smem(sxt_ref.at[pl.ds(si * kps, kps), pl.ds(row0, bt)], sx_s.at[wg], bar.at[wg])
            plgpu.barrier_wait(bar.at[wg])
            acc = run_pipeline(plgpu.layout_cast(jnp.full((64, bt), 0.0, jnp.float32), L))
            dst = o_ref.at[pl.ds(n0 + wg * 64, 64), pl.ds(item * bt, bt)] if splits == 1 else \
                o_ref.at[si, pl.ds(n0 + wg * 64, 64), pl.ds(item * bt, bt)]
            dst[...] = acc.astype(dst.dtype)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            fence_slot_reads(body, interpret), grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=nwg,
            max_concurrent_steps=stages, compute_context=compute,
            in_specs=[plgpu.BlockSpec((bt, bk), lambda s: (0, s), transforms=x_tf),
                      plgpu.BlockSpec((bn, bk), lambda s: (0, s), transforms=w_tf)])

        @pl.when(ex >= 0)
        def _():
            pipeline(x_ref.at[pl.ds(row0, bt), pl.ds(si * kc, kc)],
                     w_ref.at[ex, pl.ds(n0, bn), pl.ds(si * kc, kc)])

    out_shape = (n, items * bt) if splits == 1 else (splits, n, items * bt)
    scratch = [plgpu.SMEM((nwg, SW_ROWS, kps), jnp.float32), plgpu.SMEM((nwg, kps, bt), jnp.float32),
               plgpu.Barrier(num_arrivals=2, num_barriers=nwg)]
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
                        grid=(splits * n_tiles * items,), grid_names=("cta",), num_threads=nwg + 1,
                        thread_name="wg", scratch_types=scratch, compiler_params=params,
                        interpret=interpret if interpret is not None else False)


@functools.lru_cache(maxsize=None)
def _build_persistent_call(*, n: int, k: int, items: int, bt: int, bn: int, bk: int, splits: int, stages: int,
                           out_dtype: jnp.dtype, interpret: plgpu.InterpretGPUParams | None):
    """``persistent=True``: one CTA per SM (3 in interpret mode, so that a CTA runs several units) and one pipeline
    per CTA over the (unit, step) pairs of its units (split, N tile, item; item fastest), a dynamic grid whose
    index maps find each step's unit, as the FP4 kernel's "flat" ring. Everything a step reads is in the ring: the
    token tile, the weight tile, the weight-scale rows (the ``SW_ROWS`` rows holding the tile's, 4 K blocks: a
    128-byte copy) and the tokens' x scales of the 512-column chunk holding the step. A unit's last step stores its
    columns and restarts the accumulator."""
    emulate_mma = interpret is not None
    sw_rows = max(n // BLOCK, SW_ROWS)  # rows of the (padded) weight scales
    kc = k // splits  # input columns per unit
    steps = kc // bk
    bps = bk // BLOCK  # K blocks per pipeline step
    ch = K_ALIGN // BLOCK  # K blocks per scale chunk
    n_tiles = n // bn
    nwg = bn // 64
    ctas = min(splits * n_tiles * items, num_sms() if interpret is None else 3)
    per_stage = bt * bk * 2 + bn * bk + SW_ROWS * ch * 4 + ch * bt * 4
    st = min(stages, SMEM_BUDGET // per_stage)
    if st < 1:
        raise ValueError(f"block_t {bt} x block_k {bk} (block_n {bn}) does not fit shared memory")
    L = plgpu.Layout.WGMMA
    COL = L.reduce(0)  # a [bt] vector along the accumulator's columns (tokens)
    x_tf = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))  # 16 float16 = one 32-byte swizzle row
    w_tf = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(128))  # 128 e4m3 = one 128-byte row

    def kernel(count_ref, info_ref, x_ref, sxt_ref, w_ref, sw_ref, o_ref):
        sc = grouped_rows.flat_schedule(count_ref, info_ref, ctas=ctas, splits=splits, n_tiles=n_tiles,
                                        steps=steps, kc=kc, bk=bk)
        col = lambda s: sc.unit(s)[4]  # noqa: E731 - the step's first input column
        sw0 = lambda s: scale_window(sc.unit(s)[1] * bn // BLOCK, sw_rows)  # noqa: E731 - its scale rows' first
        specs = [plgpu.BlockSpec((pl.Element(bt), bk), lambda s: (sc.row0(s), col(s) // bk), transforms=x_tf),
                 plgpu.BlockSpec((ch, pl.Element(bt)), lambda s: (col(s) // K_ALIGN, sc.row0(s))),
                 plgpu.BlockSpec((None, bn, bk), lambda s: (sc.expert(s), sc.unit(s)[1], col(s) // bk),
                                 transforms=w_tf),
                 plgpu.BlockSpec((None, pl.Element(SW_ROWS), ch), lambda s: (sc.expert(s), sw0(s), col(s) // K_ALIGN))]

        def body(idx, x_s, sx_s, w_s, sw_s, acc):
            t, ks = sc.unit(idx[0])[1], sc.unit(idx[0])[3]
            wg = lax.axis_index("wg")
            sw_row = t * bn // BLOCK - sw0(idx[0])
            tile = plgpu.load(w_s.at[pl.ds(wg * 64, 64)], layout=L)  # e4m3 [64, bk]
            for j in range(bps):
                kb = (ks * bps + j) % ch  # the K block inside the step's 512-column chunk
                blk = _block_product(tile, x_s, j, bt, emulate_mma)
                sxv = plgpu.load(sx_s.at[kb], layout=COL, optimized=False)  # [bt]
                acc = acc + blk * lax.broadcast_in_dim(sxv * sw_s[sw_row, kb], (64, bt), [1])
            return grouped_rows.store_unit(o_ref, acc, sc, idx[0], steps=steps, block_n=bn, block_t=bt, splits=splits)

        grouped_rows.flat_pipeline(fence_slot_reads(body, interpret), sc, stages=st, in_specs=specs,
                                   num_compute_wgs=nwg, block_t=bt)(
            x_ref, sxt_ref, w_ref, sw_ref)

    out_shape = (n, items * bt) if splits == 1 else (splits, n, items * bt)
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype), grid=(ctas,),
                        grid_names=("cta",), num_threads=nwg + 1, thread_name="wg", compiler_params=params,
                        interpret=interpret if interpret is not None else False)


def _block_product(tile: jax.Array, x_s, j: int, bt: int, emulate_mma: bool) -> jax.Array:
    """The [64, bt] float32 product of K block ``j`` of a step: the warpgroup's e4m3 weight rows (registers,
    widened to float16 16 columns at a time: the MMA's A operand) times the token tile's float16 columns (SMEM)."""
    a = [tile[:, BLOCK * j + 16 * c:BLOCK * j + 16 * c + 16].astype(jnp.float16) for c in range(8)]
    b = [x_s.at[:, pl.ds(BLOCK * j + 16 * c, 16)].T for c in range(8)]
    if emulate_mma:  # the interpreter's wgmma takes SMEM operands only
        return sum(jnp.dot(ai, bi[...], preferred_element_type=jnp.float32) for ai, bi in zip(a, b))

    def mma(blk_ref):
        for ai, bi in zip(a, b):
            plgpu.wgmma(blk_ref, ai, bi)
        plgpu.wgmma_wait(0)
        return blk_ref[...]

    return pl.run_scoped(mma, plgpu.ACC((64, bt), jnp.float32))
