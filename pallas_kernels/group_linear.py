"""Block-diagonal (grouped) linear with 16-bit weights on Hopper (Pallas Mosaic GPU), with the XLA batched einsum
(``implementation="xla"``) as reference:

    y[..., g, :] = x[..., g, :] @ W_g^T        x [..., G, K], W = w.reshape(G, N, K), float32 accumulation

This is DeepSeek-V4's grouped output projection ``wo_a`` as released (bf16, 8 groups of [1024, 4096]). At serving
row counts it is a read of the weight, and XLA's batched dot reads it well below the copy rate from 64 rows up
(docs/perf-log.md, sixty-fifth and sixty-eighth sessions). The kernel works on 2-D views, x as [T, G*K] and y as
[T, G*N], so no group-major copy of x is made: CTA (m, g, n) runs one TMA ring over K for its row tile m (64 rows
per compute warpgroup) and its ``block_n`` weight rows of group g, one wgmma per step (x from SMEM as A, the weight
tile transposed as B), and stores its bf16 [rows, block_n] tile from registers. The default ``block_n`` (64 at V4's
shape) gives every SM one CTA; x's tiles are re-read from L2 by each of the group's N / ``block_n`` CTAs (sharing
them by TMA multicast over a cluster measured slower, as did 32- and 128-wide tiles: docs/perf-log.md).

Limits (else ``Unsupported``): 16-bit x and weight of one dtype, K a multiple of ``block_k``, N of ``block_n``, at
most ``MAX_ROWS`` rows (beyond that each row tile re-reads the weight: XLA's GEMM is the better form). Rows are
padded to a whole row tile, 64 rows up to 64, else 128 (a copy of x and of y then). "auto" takes the kernel at
64, 128 and 256 rows (``kernel_wins``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jds.ops.dispatch import Implementation, Unsupported, check_array, mosaic_interpret, num_sms, run_op

MAX_ROWS = 256  # the kernel takes at most this many rows (x's leading dims flattened)
STAGES = 4
SMEM_BUDGET = 220 * 1024  # the ring's bytes at most (Hopper: 227 KB a CTA)
_SWZ16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # 64 16-bit values: one 128-byte row


def group_linear(x: jax.Array, w: jax.Array, *, out_dtype: jnp.dtype | None = None,
                 implementation: Implementation = "auto", interpret: bool | plgpu.InterpretGPUParams | None = None,
                 block_n: int | None = None, block_k: int = 128, stages: int = STAGES) -> jax.Array:
    """y [..., G, N] = per group g, x[..., g, :] @ W_g^T with W_g = w.reshape(G, N, K)[g].

    x: [..., G, K] float; w: [G*N, K] float (a ``Linear``'s weight as stored); ``out_dtype``: None = x's dtype.
    Tiles (kernel only): ``block_n`` weight rows a CTA (a multiple of 8 up to 256 dividing N; None: the largest
    power of two up to 128 that gives at most one CTA per SM, ``default_block_n``), ``block_k`` columns a pipeline
    step (a multiple of 64), ``stages`` TMA ring depth (at most what fits SMEM). ``interpret``: GPU interpret mode
    (None: whenever the default backend is not a GPU)."""
    if getattr(x, "ndim", 0) < 2:
        raise ValueError(f"group_linear: x must be [..., G, K], got shape {getattr(x, 'shape', None)}")
    check_array("group_linear: x", x, (("...", None),) * (x.ndim - 2) + (("G", None), ("K", None)), "float")
    g, k = x.shape[-2:]
    check_array("group_linear: w", w, (("G*N", None), ("K", k)), "float")
    if w.shape[0] % g:
        raise ValueError(f"group_linear: w's {w.shape[0]} rows are not a multiple of x's {g} groups")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if implementation == "auto" and not kernel_wins(math.prod(x.shape[:-2])):
        implementation = "xla"
    return run_op("group_linear", implementation, {
        "xla": lambda: group_linear_xla(x, w, out_dtype),
        "pallas": lambda: _pallas(x, w, out_dtype=out_dtype, interpret=interpret, block_n=block_n, block_k=block_k,
                                  stages=stages)})


_WINS = frozenset((64, 128, 256))


def kernel_wins(rows: int) -> bool:
    """Where "auto" takes the kernel: the row counts where it measured faster than XLA's batched dot at V4's shape on
    an H100 (64, 128, 256). It was slower at 1 to 32 rows, at 192 (padded to two 128-row tiles) and at 200 (the
    padding copies), and level at 96: benchmarks/results/shared_x_gemms_*.json and archive/shared_x_gemms_woa_small_*
    (case woa)."""
    return rows in _WINS


def group_linear_xla(x: jax.Array, w: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """The reference: one batched einsum in x's dtype with float32 accumulation (float32 operands at HIGHEST)."""
    g = x.shape[-2]
    wg = w.reshape(g, w.shape[0] // g, w.shape[1]).astype(x.dtype)
    prec = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.einsum("...gi,goi->...go", x, wg, precision=prec, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def default_block_n(rows: int, g: int, n: int, sms: int | None = None) -> int:
    """The widest power-of-two tile up to 128 dividing N, halved (down to 16) while twice its CTAs (row tiles x
    groups x N / block_n) still fit one wave of ``sms`` (None: ``num_sms()``): at most a wave, as many SMs reading
    as that allows."""
    sms = sms or num_sms()
    m_tiles = -(-rows // 128)
    bn = 128
    while bn > 16 and n % bn:
        bn //= 2
    while bn > 16 and 2 * m_tiles * g * (n // bn) <= sms:
        bn //= 2
    return bn


def _pallas(x, w, *, out_dtype, interpret, block_n, block_k, stages):
    lead, (g, k) = x.shape[:-2], x.shape[-2:]
    n = w.shape[0] // g
    t = math.prod(lead)
    if x.dtype != w.dtype or x.dtype.itemsize != 2:
        raise Unsupported(f"group_linear kernel: x {x.dtype} and w {w.dtype} must be one 16-bit dtype")
    if t > MAX_ROWS:
        raise Unsupported(f"group_linear kernel: {t} rows > MAX_ROWS {MAX_ROWS} (each row tile re-reads the weight)")
    bn = block_n or default_block_n(t, g, n)
    if bn % 8 or not 8 <= bn <= 256 or n % bn:
        raise Unsupported(f"group_linear kernel: block_n {bn} must be a multiple of 8 up to 256 dividing N = {n}")
    if block_k % 64 or k % block_k:
        raise Unsupported(f"group_linear kernel: block_k {block_k} must be a multiple of 64 dividing K = {k}")
    interpret = mosaic_interpret(interpret)
    if t == 0:
        return jnp.zeros((*lead, g, n), out_dtype)
    bm = 128 if t > 64 else 64
    tp = -(-t // bm) * bm
    x2 = x.reshape(t, g * k)
    if tp != t:
        x2 = jnp.pad(x2, ((0, tp - t), (0, 0)))
    ring = min(stages, k // block_k, SMEM_BUDGET // ((bm + bn) * block_k * x.dtype.itemsize))
    if ring < 1:
        raise Unsupported(f"group_linear kernel: one stage of {bm} + {bn} rows x {block_k} does not fit SMEM")
    call = _build(tp=tp, g=g, n=n, k=k, bm=bm, bn=bn, bk=block_k, stages=ring,
                  out_dtype=jnp.dtype(out_dtype), interpret=interpret)
    y = call(x2, w)
    return (y if tp == t else y[:t]).reshape(*lead, g, n)


@functools.lru_cache(maxsize=None)
def _build(*, tp: int, g: int, n: int, k: int, bm: int, bn: int, bk: int, stages: int,
           out_dtype: jnp.dtype, interpret: plgpu.InterpretGPUParams | None):
    nwg = bm // 64
    n_tiles = n // bn
    ctas = (tp // bm) * g * n_tiles

    def kernel(x_ref, w_ref, o_ref):
        pid = lax.axis_index("cta")
        mi, rest = pid // (g * n_tiles), pid % (g * n_tiles)
        gi, ni = rest // n_tiles, rest % n_tiles

        def body(_, x_s, w_s, acc):
            wg = lax.axis_index("wg")

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, x_s.at[pl.ds(wg * 64, 64)], w_s.T)
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            return acc + pl.run_scoped(mma, plgpu.ACC((64, bn), jnp.float32))

        def compute(run_pipeline):
            wg = lax.axis_index("wg")
            acc = run_pipeline(plgpu.layout_cast(jnp.full((64, bn), 0.0, jnp.float32), plgpu.Layout.WGMMA))
            dst = o_ref.at[pl.ds(mi * bm + wg * 64, 64), pl.ds(gi * n + ni * bn, bn)]
            dst[...] = acc.astype(dst.dtype)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // bk,), memory_registers=40, wg_axis="wg", num_compute_wgs=nwg,
            max_concurrent_steps=stages, compute_context=compute,
            in_specs=[plgpu.BlockSpec((bm, bk), lambda s: (0, s), transforms=_SWZ16),
                      plgpu.BlockSpec((bn, bk), lambda s: (0, s), transforms=_SWZ16)])
        pipeline(x_ref.at[pl.ds(mi * bm, bm), pl.ds(gi * k, k)], w_ref.at[pl.ds(gi * n + ni * bn, bn)])

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((tp, g * n), out_dtype), grid=(ctas,),
                        grid_names=("cta",),
                        num_threads=nwg + 1, thread_name="wg", compiler_params=params,
                        interpret=interpret if interpret is not None else False, kernel_name="group_linear")
