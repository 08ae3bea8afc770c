"""RMSNorm whose output goes on to FP8 linears, quantised where it is made (Pallas on GPU, Triton lowering):

    h = x (+ residual);  y = weight * h * rsqrt(mean(h^2) + eps)  (``jds.ops.norms.rms_norm``);
    (q, s) = act_quant(y) per 1 x 128, in the FP8 GEMM kernel's layout (``jds.ops.quant.QuantizedRows``)

Why: every FP8 linear re-quantised its input in a kernel of its own (``fp8_gemm.quantize_rows``), a launch near its
floor at serving row counts, and the linears that share an input (MLP ``w1`` / ``w3``, ``wq_b`` and the indexer's
``wq_b``) each ran one. Where a norm feeds them, one kernel here writes y (only if a consumer still reads it in
bf16), its e4m3 copy and the scales, and with ``residual`` the sum h as well (the residual add ahead of the norm).

One program a row, held as one [blocks, 128] tile (the block count rounded up to a power of two): loaded once, kept
in registers between the sum of squares and the normalisation, each block's amax a reduction along the tile's rows
(within a warp; a row of [1, 128] blocks, one after the other, made every reduction a block-wide one through shared
memory and ran several times slower than XLA's norm: docs/perf-log.md, seventieth session). Rows past M (up to the
GEMM's padded row count) are written as zero rows with a zero block's scale, as ``quantize_rows`` writes them.
Backend: the Triton lowering; Mosaic GPU's register layouts hold 64 rows a warpgroup, so at decode (64-128 rows)
one or two CTAs would read all of x for the row sums.
(q, s) equal ``act_quant`` of the y this kernel stores, bit for bit (same ops on the same bf16 values; amax-format
scales divide with IEEE rounding; the tests take that reference from XLA's CPU backend,
``tests.tolerances.act_quant_on_cpu``); y itself may differ from XLA's rms_norm in the last bit (summation order).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jds.ops.dispatch import Implementation, Unsupported, check_array, run_op
from jds.ops.norms import rms_norm
from jds.ops.quant import (ACT_AMAX_FLOOR, FP8, QuantizedRows, ScaleFmt, block_scale, quantize_rows_xla,
                           ue8m0_scale_bits)
from pallas_kernels import fused_insert_common as C
from pallas_kernels.fp8_gemm import padded_x_rows as padded_rows  # the GEMM kernel's padding of x's rows

F32 = jnp.float32
BLOCK = 128
_SCALE_FMTS = ("ue8m0", "amax")


AUTO_MAX_ROWS = 2048  # rows up to which the model quantises in the norm on the kernels (``jds.nn.norm_into``)


class NormQuant(NamedTuple):
    """``rms_norm_quant``'s outputs: ``h`` = x + residual (None without a residual), ``y`` the normed rows (None
    unless asked for), ``x`` y quantised for the FP8 linears (None from a plain norm: ``jds.nn.norm_into``)."""

    h: jax.Array | None
    y: jax.Array | None
    x: QuantizedRows | None


def rms_norm_quant(x: jax.Array, weight: jax.Array, eps: float, *, scale_fmt: ScaleFmt = "ue8m0",
                   residual: jax.Array | None = None, col: int = 0, width: int | None = None,
                   want_y: bool = True, mp: int | None = None, out_dtype: jnp.dtype | None = None,
                   implementation: Implementation = "auto", interpret: bool | None = None,
                   num_warps: int | None = None) -> NormQuant:
    """x [M, W] (its columns ``col`` to ``col + width``, default all: a part of a fused projection read in place),
    ``weight`` [width] float; ``residual`` [M, width] or None (then h = x + residual in x's dtype is normed and
    returned). ``mp``: the quantised rows' padded count (None: ``padded_rows(M)``). ``out_dtype`` (y's dtype, None:
    x's) must be bfloat16 for the kernel; ``want_y``: whether y is written at all (the XLA form always computes it).
    ``num_warps``: the kernel's warps a row (None: ``default_warps``)."""
    check_array("rms_norm_quant: x", x, (("M", None), ("W", None)), "float")
    m, w_all = x.shape
    width = w_all - col if width is None else width
    if col < 0 or width <= 0 or col + width > w_all:
        raise ValueError(f"rms_norm_quant: columns [{col}, {col} + {width}) outside x's {w_all}")
    if width % BLOCK:
        raise ValueError(f"rms_norm_quant: width {width} must be a multiple of {BLOCK} (quantised per 1 x {BLOCK})")
    check_array("rms_norm_quant: weight", weight, (("width", width),), "float")
    if residual is not None:
        check_array("rms_norm_quant: residual", residual, (("M", m), ("width", width)), "float")
        if col or width != w_all:
            raise ValueError("rms_norm_quant: a residual is added to x as a whole (col = 0, width = x's columns)")
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(f"rms_norm_quant: scale_fmt must be one of {_SCALE_FMTS}, got {scale_fmt!r}")
    mp = padded_rows(m) if mp is None else mp
    if mp < m:
        raise ValueError(f"rms_norm_quant: mp = {mp} < M = {m}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    return run_op("rms_norm_quant", implementation, {
        "xla": lambda: _xla(x, weight, eps, scale_fmt, residual, col, width, want_y, mp, out_dtype),
        "pallas": lambda: _pallas(x, weight, eps, scale_fmt, residual, col, width, want_y, mp, out_dtype,
                                  interpret, num_warps)})


def residual_norm(x: jax.Array, weight: jax.Array, eps: float, *, residual: jax.Array | None = None, col: int = 0,
                  width: int | None = None, out_dtype: jnp.dtype | None = None) -> tuple[jax.Array | None, jax.Array]:
    """The XLA form's first half, what the model ran before: (h = x + residual in x's dtype, or None without a
    residual; ``rms_norm`` of h, or of x's columns ``col`` to ``col + width``)."""
    h = None if residual is None else x + residual.astype(x.dtype)
    src = h if h is not None else x[:, col:col + (x.shape[1] - col if width is None else width)]
    return h, rms_norm(src, weight, eps, out_dtype)


def _xla(x, weight, eps, scale_fmt, residual, col, width, want_y, mp, out_dtype) -> NormQuant:
    h, y = residual_norm(x, weight, eps, residual=residual, col=col, width=width, out_dtype=out_dtype)
    return NormQuant(h=h, y=y if want_y else None, x=quantize_rows_xla(y, mp, scale_fmt))


def default_warps(width: int) -> int:
    """16 warps a row up to 32 blocks of 128 (V4's 4096-wide hidden state, the q latents), 8 above (V3.2's 7168,
    held as 64 blocks): the fastest of 2 to 16 at those widths on an H100 (docs/perf-log.md, seventieth session)."""
    return 16 if C.next_pow2(width // BLOCK) <= 32 else 8


def _pallas(x, weight, eps, scale_fmt, residual, col, width, want_y, mp, out_dtype, interpret,
            num_warps) -> NormQuant:
    dt = jnp.dtype(x.dtype)
    if dt != jnp.dtype(jnp.bfloat16) or out_dtype != dt or (residual is not None and residual.dtype != dt):
        raise Unsupported(f"rms_norm_quant kernel: bfloat16 x, residual and y (got {x.dtype}, "
                          f"{None if residual is None else residual.dtype}, {out_dtype})")
    m = x.shape[0]
    if m == 0:
        raise Unsupported("rms_norm_quant kernel: no rows (the XLA form returns the empty outputs)")
    interpret = C.resolve_interpret(interpret)
    kernel = functools.partial(_kernel, m=m, col=col, nblk=width // BLOCK, eps=float(eps), scale_fmt=scale_fmt,
                               add=residual is not None, want_y=want_y, interpret=interpret)
    outs = [jax.ShapeDtypeStruct((mp, width), jnp.uint8), jax.ShapeDtypeStruct((width // BLOCK, mp), F32)]
    if want_y:
        outs.append(jax.ShapeDtypeStruct((m, width), dt))
    if residual is not None:
        outs.append(jax.ShapeDtypeStruct((m, width), dt))
    args = (x, weight.astype(F32)) + (() if residual is None else (residual,))
    res = C.pallas_call(kernel, out_shape=tuple(outs), grid=(mp,), aliases={}, interpret=interpret,
                        name="rms_norm_quant", num_warps=num_warps or default_warps(width))(*args)
    q, st, rest = res[0], res[1], list(res[2:])
    y = rest.pop(0) if want_y else None
    h = rest.pop(0) if residual is not None else None
    xq = QuantizedRows(q=jax.lax.bitcast_convert_type(q, FP8), st=st, rows=m, scale_fmt=scale_fmt)
    return NormQuant(h=h, y=y, x=xq)


def _kernel(x_ref, w_ref, *refs, m, col, nblk, eps, scale_fmt, add, want_y, interpret):
    if add:
        r_ref, *refs = refs
    q_ref, st_ref, *outs = refs
    y_ref = outs.pop(0) if want_y else None
    h_ref = outs.pop(0) if add else None
    t = pl.program_id(0)
    live = t < m  # rows past M: a zero row (q 0, a zero block's scale), nothing else written
    tc = jnp.minimum(t, m - 1)
    nb = C.next_pow2(nblk)
    b = C.iota((nb, 1), 0)  # the row as one [blocks, 128] tile: each block's amax is a reduction along its row
    cb = b * BLOCK + C.iota((1, BLOCK), 1)
    ok = b < nblk
    inb = ok & live
    # plain column offsets (the mask keeps blocks past the width from memory): a select on them hides their
    # contiguity from Triton, whose loads then went one element at a time
    x = C.load(x_ref, (tc, col + cb), (nb, BLOCK), mask=inb, other=0.0)
    if add:
        # x + residual rounded to bf16, by explicit conversions: XLA (interpret mode) may skip the rounding of a
        # bf16 add it computes in float32 (excess precision)
        rv = C.load(r_ref, (tc, cb), (nb, BLOCK), mask=inb, other=0.0)
        x = (x.astype(F32) + rv.astype(F32)).astype(jnp.bfloat16)
        C.store(h_ref, (jnp.where(inb, t, m), cb), x, inb)
    xf = x.astype(F32)
    ss = jnp.sum(jnp.sum(xf * xf, axis=1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
    r = jax.lax.rsqrt(C.div_rn(ss, jnp.full(ss.shape, nblk * BLOCK, F32), interpret) + np.float32(eps))
    wv = C.load(w_ref, (cb,), (nb, BLOCK), mask=ok, other=0.0)
    y = (xf * r * wv).astype(jnp.bfloat16)
    if want_y:
        C.store(y_ref, (jnp.where(inb, t, m), cb), y, inb)
    store_quantized(q_ref, st_ref, y, t, b, ok, scale_fmt, interpret)


def store_quantized(q_ref, st_ref, y: jax.Array, t: jax.Array, b: jax.Array, ok: jax.Array, scale_fmt: ScaleFmt,
                    interpret: bool) -> None:
    """Quantise y [nb, 128] (bf16: blocks ``b`` [nb, 1] of row ``t``) per block as ``act_quant`` does and store
    the e4m3 bytes into ``q_ref`` [mp, K] and the scales into ``st_ref`` [K/128, mp] (``QuantizedRows``' layout),
    the blocks where ``ok`` [nb, 1]; a row past the real ones comes in as zeros and leaves a zero block's scale."""
    yf = y.astype(F32)
    amax = jnp.max(jnp.abs(yf), axis=1, keepdims=True)  # [nb, 1]
    if scale_fmt == "ue8m0":
        sc, inv, _ = ue8m0_scale_bits(amax)
        q = C.e4m3_bytes(yf * inv, interpret)
    else:  # the amax format's scale, then a true division
        sc = block_scale(amax, "amax", ACT_AMAX_FLOOR)
        q = C.e4m3_bytes(C.div_rn(yf, jnp.broadcast_to(sc, yf.shape), interpret), interpret)
    cb = b * BLOCK + C.iota((1, BLOCK), 1)
    # masked lanes' indices point past the first axis (interpret mode's scatter drops them)
    C.store(q_ref, (jnp.where(ok, t, q_ref.shape[0]), cb), q, ok)
    C.store(st_ref, (jnp.where(ok, b, st_ref.shape[0]), jnp.full(b.shape, t, jnp.int32)), sc, ok)
