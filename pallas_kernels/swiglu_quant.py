"""The MLP's gated activation, quantised for the down projection where it is made (Pallas on GPU, Triton lowering):

    h = silu(gate in float32) rounded to x's dtype, times up, in that dtype   (``jds.model.MLP``: ``swiglu``)
    (q, s) = act_quant(h) per 1 x 128, in the FP8 GEMM kernel's layout (``jds.ops.quant.QuantizedRows``)

Why: with FP8 weights the MLP ran XLA's multiply fusion (gate and up read, h written) and then the FP8 GEMM's own
quantisation kernel for ``w2`` (h read again, its e4m3 copy and scales written). One kernel here reads gate and up
once and writes only what ``w2`` reads, so h's bf16 round trip and one launch go.

gate and up are column ranges of arrays (``gate_col`` / ``up_col``): both halves of one fused projection, or two
arrays. Each 128-wide block is quantised on its own, so programs take a [rows, blocks] tile each: program (t, c)
holds ``chunk`` blocks of row t as one [chunk, 128] tile, each block's amax a reduction along the tile's rows (the
same layout as ``pallas_kernels.norm_quant``, whose block quantiser this shares). Rows past M (up to the GEMM's
padded row count) are written as zero rows with a zero block's scale, as ``fp8_gemm.quantize_rows`` writes them.
(q, s) equal ``act_quant`` of the h this kernel computes, bit for bit (the tests take that reference from XLA's
CPU backend, ``tests.tolerances.act_quant_on_cpu``); h itself may differ from XLA's in the last bit (the sigmoid's
exp is Triton's, not XLA's): ``want_h`` returns it for that check.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jds.ops.dispatch import Implementation, Unsupported, check_array, run_op
from jds.ops.quant import FP8, QuantizedRows, ScaleFmt, quantize_rows_xla
from pallas_kernels import fused_insert_common as C
from pallas_kernels.fp8_gemm import NUM_SMS, WAVE_FILL
from pallas_kernels.norm_quant import BLOCK, padded_rows, store_quantized

F32 = jnp.float32
_SCALE_FMTS = ("ue8m0", "amax")
AUTO_MAX_ROWS = 2048  # the model's limits for the kernel (``kernel_wins``, ``jds.nn.swiglu_into``)
MIN_WIDTH = BLOCK * math.ceil(WAVE_FILL * NUM_SMS)
CHUNK = 8  # blocks of 128 a program (1024 columns)
NUM_WARPS = 4


def kernel_wins(rows: int, width: int) -> bool:
    """Where the model quantises in the activation on the kernels: up to ``AUTO_MAX_ROWS`` rows (the kernel alone
    was faster than XLA's activation + ``quantize_rows`` at 64 to 2048 rows at both widths timed), at widths of at
    least ``MIN_WIDTH``, where the 128-wide column tiles of the FP8 GEMMs that make gate and up fill a wave and those
    do not split K. Below it they do, XLA fuses their split-K sums into its activation, and the kernel left them
    as two sum kernels of their own: slower in the step (V4's bench MLP, 2048 wide, on an H100: docs/perf-log.md,
    seventy-first session)."""
    return rows <= AUTO_MAX_ROWS and width >= MIN_WIDTH


def swiglu(gate: jax.Array, up: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The dense MLP's activation as the model computes it: silu in float32, rounded to ``dtype``, times up in
    ``dtype``."""
    return jax.nn.silu(gate.astype(F32)).astype(dtype) * up.astype(dtype)


def swiglu_quant(gate: jax.Array, up: jax.Array, *, width: int | None = None, gate_col: int = 0, up_col: int = 0,
                 scale_fmt: ScaleFmt = "ue8m0", mp: int | None = None, want_h: bool = False,
                 implementation: Implementation = "auto", interpret: bool | None = None,
                 chunk: int = CHUNK, num_warps: int = NUM_WARPS) -> tuple[QuantizedRows, jax.Array | None]:
    """(``swiglu`` of gate's columns ``gate_col`` to ``gate_col + width`` and up's ``up_col`` onwards, quantised as
    ``QuantizedRows`` padded to ``mp`` rows (None: ``padded_rows(M)``); h itself with ``want_h``, else None).
    gate, up: [M, *] bfloat16 for the kernel (the XLA form takes any float; h in gate's dtype). ``width`` (None:
    gate's columns past ``gate_col``) must be a multiple of 128. ``chunk``: 128-wide blocks a program (kernel)."""
    check_array("swiglu_quant: gate", gate, (("M", None), ("W", None)), "float")
    m = gate.shape[0]
    check_array("swiglu_quant: up", up, (("M", m), ("W", None)), "float")
    width = gate.shape[1] - gate_col if width is None else width
    for name, arr, col in (("gate", gate, gate_col), ("up", up, up_col)):
        if col < 0 or width <= 0 or col + width > arr.shape[1]:
            raise ValueError(f"swiglu_quant: {name} columns [{col}, {col} + {width}) outside its {arr.shape[1]}")
    if width % BLOCK:
        raise ValueError(f"swiglu_quant: width {width} must be a multiple of {BLOCK} (quantised per 1 x {BLOCK})")
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(f"swiglu_quant: scale_fmt must be one of {_SCALE_FMTS}, got {scale_fmt!r}")
    mp = padded_rows(m) if mp is None else mp
    if mp < m:
        raise ValueError(f"swiglu_quant: mp = {mp} < M = {m}")
    if not C.is_pow2(chunk):
        raise ValueError(f"swiglu_quant: chunk must be a power of two, got {chunk}")
    return run_op("swiglu_quant", implementation, {
        "xla": lambda: _xla(gate, up, width, gate_col, up_col, scale_fmt, mp, want_h),
        "pallas": lambda: _pallas(gate, up, width, gate_col, up_col, scale_fmt, mp, want_h, interpret, chunk,
                                  num_warps)})


def _xla(gate, up, width, gate_col, up_col, scale_fmt, mp, want_h):
    h = swiglu(gate[:, gate_col:gate_col + width], up[:, up_col:up_col + width], gate.dtype)
    return quantize_rows_xla(h, mp, scale_fmt), (h if want_h else None)


def _pallas(gate, up, width, gate_col, up_col, scale_fmt, mp, want_h, interpret, chunk, num_warps):
    dt = jnp.dtype(jnp.bfloat16)
    if gate.dtype != dt or up.dtype != dt:
        raise Unsupported(f"swiglu_quant kernel: bfloat16 gate and up (got {gate.dtype}, {up.dtype})")
    m = gate.shape[0]
    if m == 0:
        raise Unsupported("swiglu_quant kernel: no rows (the XLA form returns the empty outputs)")
    interpret = C.resolve_interpret(interpret)
    nblk = width // BLOCK
    cb = min(chunk, C.next_pow2(nblk))
    kernel = functools.partial(_kernel, m=m, gate_col=gate_col, up_col=up_col, nblk=nblk, cb=cb,
                               scale_fmt=scale_fmt, want_h=want_h, interpret=interpret)
    outs = [jax.ShapeDtypeStruct((mp, width), jnp.uint8), jax.ShapeDtypeStruct((nblk, mp), F32)]
    if want_h:
        outs.append(jax.ShapeDtypeStruct((m, width), dt))
    res = C.pallas_call(kernel, out_shape=tuple(outs), grid=(mp, -(-nblk // cb)), aliases={}, interpret=interpret,
                        name="swiglu_quant", num_warps=num_warps)(gate, up)
    xq = QuantizedRows(q=jax.lax.bitcast_convert_type(res[0], FP8), st=res[1], rows=m, scale_fmt=scale_fmt)
    return xq, (res[2] if want_h else None)


def _kernel(g_ref, u_ref, q_ref, st_ref, *refs, m, gate_col, up_col, nblk, cb, scale_fmt, want_h, interpret):
    t, c = pl.program_id(0), pl.program_id(1)
    live = t < m  # rows past M: zero rows (q 0, a zero block's scale)
    tc = jnp.minimum(t, m - 1)
    b = c * cb + C.iota((cb, 1), 0)
    cols = b * BLOCK + C.iota((1, BLOCK), 1)
    ok = b < nblk
    inb = ok & live
    # plain column offsets (the mask keeps blocks past the width from memory): contiguous, vectorised loads
    g = C.load(g_ref, (tc, gate_col + cols), (cb, BLOCK), mask=inb, other=0.0).astype(F32)
    u = C.load(u_ref, (tc, up_col + cols), (cb, BLOCK), mask=inb, other=0.0)
    # silu(g) = g * sigmoid(g) as jax.nn.silu writes it, rounded to bf16, then the product rounded to bf16 by explicit
    # conversions (XLA in interpret mode may keep a bf16 product in float32)
    s = (g * jax.nn.sigmoid(g)).astype(jnp.bfloat16)
    h = (s.astype(F32) * u.astype(F32)).astype(jnp.bfloat16)
    if want_h:
        C.store(refs[0], (jnp.where(inb, t, m), cols), h, inb)
    store_quantized(q_ref, st_ref, h, t, b, ok, scale_fmt, interpret)
