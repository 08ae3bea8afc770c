"""DeepSeek-V4 producer kernel (vLLM's ``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``), Pallas on GPU.

``fused_qnorm_rope_kv_insert_v4`` in one launch:
* q [T, H, D] (after wq_b): weightless per-head RMSNorm, interleaved RoPE on the last rope dims;
* window kv [T, D] (before kv_norm): weighted RMSNorm, interleaved RoPE on the last rope dims, then the
  584-byte ``fp8_ds_mla`` record (448 e4m3 NoPE in 64-wide UE8M0 blocks | 64 bf16 rope | 7 exponent
  bytes + 1 zero pad, data and scales segregated per page) or bf16/f32 rows, written in place at
  ``slot_mapping`` (slot -1 writes nothing).
Grid: (token blocks, head blocks + 1); the last program column does the kv insert.
XLA implementation: ``jds.ops.fused_insert.qnorm_rope_kv_insert_v4_xla``; ``implementation``: jds.ops.dispatch.
Backend and layout rules: pallas_kernels/fused_insert_common.py (Triton lowering; why not Mosaic GPU).
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jds.ops.dispatch import Implementation, Unsupported, check_array, run_op
from jds.ops.fused_insert import qnorm_rope_kv_insert_v4_xla
from jds.ops.paging import RecordFormat, check_cache
from jds.ops.records import MlaRecord584
from pallas_kernels import fused_insert_common as C

F32 = jnp.float32


# the XLA implementation: jds.ops.fused_insert.qnorm_rope_kv_insert_v4_xla (this name is kept for the tests)
fused_qnorm_rope_kv_insert_v4_reference = qnorm_rope_kv_insert_v4_xla


def _v4_kernel(q_ref, kv_ref, cos_ref, sin_ref, slot_ref, w_ref, _cache_in, q_out, c_out, *, T, BT, H, HB, nhb,
               D, rd, eps, dtype, fmt, interpret, kc):
    pid, jh = pl.program_id(0), pl.program_id(1)
    col = C.iota((1, D), 1)
    in_rope, pcol, fcol, first = C.rope_partner(col, D - rd, rd, True)

    @pl.when(jh < nhb)
    def _q():
        """The rows' norm over the whole row, stored outside the rope slice; the rope slice as its (even, odd)
        pairs [rows, rd / 2], rotated and stored apart: full-width partner / cos / sin rows held about three
        times the registers (fewer programs per SM) for the 1/8 of the row that rotates."""
        r = C.iota((BT * HB, 1), 0)
        tok = pid * BT + jax.lax.shift_right_logical(r, C.log2(HB))
        head = jh * HB + (r & (HB - 1))
        ok = (tok < T) & (head < H)
        tc, hc = jnp.minimum(tok, T - 1), jnp.minimum(head, H - 1)
        tok_out = jnp.where(ok, tok, T)
        x = C.load(q_ref, (tc, hc, col), (BT * HB, D)).astype(F32)
        r_ = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
        C.store(q_out, (tok_out, hc, col), (x * r_).astype(dtype), ok & ~in_rope)
        j = C.iota((1, rd // 2), 1)  # pair j: columns (D - rd + 2j, D - rd + 2j + 1), frequency j
        cr = D - rd + C.iota((1, rd), 1)  # the rope slice: one contiguous load and store, split in registers
        pairs = (BT * HB, rd // 2)
        u, v = C.split_pairs((C.load(q_ref, (tc, hc, cr), (BT * HB, rd)).astype(F32) * r_).astype(dtype).astype(F32))
        even, odd = C.rope_pair(u, v, *C.cos_sin(cos_ref, sin_ref, tc, j, pairs, pid, T, BT))
        C.store(q_out, (tok_out, hc, cr), C.join_pairs(even.astype(dtype), odd.astype(dtype)), ok)

    @pl.when(jh == nhb)
    def _kv():
        t = pid * BT + C.iota((BT, 1), 0)
        tc = jnp.minimum(t, T - 1)
        slot = C.load(slot_ref, (tc,), (BT, 1))
        ok = (t < T) & (slot >= 0)
        shape = (BT, D)
        x = C.load(kv_ref, (tc, kc + col), shape).astype(F32)  # kc: the rows' first column in kv
        xp = C.load(kv_ref, (tc, kc + pcol), shape, mask=in_rope).astype(F32)
        r_ = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
        y = (x * r_ * C.load(w_ref, (col,), (1, D))).astype(dtype).astype(F32)
        yp = (xp * r_ * C.load(w_ref, (pcol,), (1, D))).astype(dtype).astype(F32)
        cs, sn = C.load(cos_ref, (tc, fcol), shape), C.load(sin_ref, (tc, fcol), shape)
        k = C.rope_rows(y, yp, cs, sn, first, in_rope).astype(dtype)  # [BT, D]

        C.store_kv_record(c_out, k, slot, ok, fmt, interpret)


def supports(head_dim: int, rope_dim: int) -> bool:
    """Whether the kernel takes these dims (Triton blocks are powers of two); otherwise it raises
    ``Unsupported`` and ``implementation="auto"`` runs the XLA implementation."""
    return C.is_pow2(head_dim) and C.is_pow2(rope_dim)


def fused_qnorm_rope_kv_insert_v4(q, kv, cos, sin, slot_mapping, window_cache, kv_norm_w, *,
                                  window_format: RecordFormat, eps: float, dtype,
                                  implementation: Implementation = "pallas", interpret: bool | None = None,
                                  rows_per_program: int | None = None, num_warps: int | None = None,
                                  heads_per_program: int | None = None, kv_col: int | None = None):
    """Same inputs/outputs as ``fused_qnorm_rope_kv_insert_v4_reference``.

    q [T, H, D], kv [T, D] in ``dtype``; cos/sin [T, rd/2] float32; slot_mapping [T] int32 (-1 = padding);
    window_cache [num_blocks, page_elems] (donate it: it is updated in place). ``kv_col``: kv holds the rows in
    its columns [kv_col, kv_col + D): the layer's fused input projection passed whole, which the kernel reads in
    place (a slice passed instead is a copy XLA makes before the kernel). None: kv is the rows.
    Tiling: a q program normalises ``rows_per_program`` (token, head) rows. ``heads_per_program=h``: h
    heads of ``rows_per_program // h`` tokens (a token's heads are contiguous in memory, so h > 1 reads
    longer runs); ``heads_per_program=None`` with ``rows_per_program`` given: one token's heads when
    T < ``rows_per_program``, else that many tokens of one head (the tiling before 2026-11-29).
    All None: 8 heads x 1 token, 8 warps at every T: the fastest tiling of the T = 8192 sweep on the GPU
    timeline once the q rows' rope went to (even, odd) pairs (fewer registers; 16 heads and 4 warps were
    fastest before), bit-identical to the other tilings
    (``benchmarks/results/kernels_fused_insert_*.json``, rows with ``tiles``; issue 6)."""
    check_array("fused_qnorm_rope_kv_insert_v4: q", q, (("T", None), ("H", None), ("D", None)), "float")
    kv_rows = C.columns("kv", "kv_col", kv, kv_col, q.shape[-1])
    tail = (cos, sin, slot_mapping, window_cache, kv_norm_w)
    _check_inputs(q, kv_rows, *tail, window_format=window_format)
    kw = dict(window_format=window_format, eps=eps, dtype=dtype)
    return run_op("fused_qnorm_rope_kv_insert_v4", implementation, {
        "xla": lambda: qnorm_rope_kv_insert_v4_xla(q, kv_rows, *tail, **kw),
        "pallas": lambda: _pallas(q, kv, *tail, **kw, interpret=interpret, rows_per_program=rows_per_program,
                                  num_warps=num_warps, heads_per_program=heads_per_program, kv_col=kv_col or 0)})


def _check_inputs(q, kv, cos, sin, slot_mapping, window_cache, kv_norm_w, *, window_format) -> None:
    """Input errors of every implementation (ValueError naming the argument; static shapes and dtypes only)."""
    op = "fused_qnorm_rope_kv_insert_v4"
    check_array(f"{op}: q", q, (("T", None), ("H", None), ("D", None)), "float")
    t, _, d = q.shape
    check_array(f"{op}: kv", kv, (("T", t), ("D", d)), "float")
    rd = C.check_rope_tables(op, cos, sin, t)
    if rd > d:
        raise ValueError(f"{op}: head dim {d} must be at least the rope dim {rd} (2 * cos.shape[-1])")
    check_array(f"{op}: slot_mapping", slot_mapping, (("T", t),), "int")
    width = check_cache(f"{op}: window_cache", window_cache, window_format, "window_format")
    if width != d:
        raise ValueError(f"{op}: head dim {d} must equal window_format's row width {width} ({window_format})")
    check_array(f"{op}: kv_norm_w", kv_norm_w, (("D", d),), "float")


def _pallas(q, kv, cos, sin, slot_mapping, window_cache, kv_norm_w, *, window_format, eps, dtype, interpret,
            rows_per_program, num_warps, heads_per_program, kv_col=0):
    interpret = C.resolve_interpret(interpret)
    t, h, d = q.shape
    rd = 2 * cos.shape[-1]
    if rows_per_program is None and heads_per_program is None:
        rows_per_program = heads_per_program = 8
    rows_per_program = rows_per_program or 8
    num_warps = num_warps or 8
    for name, n in (("rows_per_program", rows_per_program), ("heads_per_program", heads_per_program or 1),
                    ("num_warps", num_warps)):
        if not C.is_pow2(n):  # a tile setting, not a shape: an error under "auto" too
            raise ValueError(f"fused_qnorm_rope_kv_insert_v4: {name} must be a power of 2 (or None), got {n!r}")
    for name, n in (("head dim", d), ("rope dim", rd)):
        if not C.is_pow2(n):
            raise Unsupported(f"fused_qnorm_rope_kv_insert_v4: {name} {n} is not a power of 2")
    if isinstance(window_format, MlaRecord584):
        f = window_format
        if f.nope_dim + f.rope_dim != d or f.rope_dim != rd or d % f.block or d // f.block < f.scale_bytes:
            raise ValueError(f"window_format {f} does not fit head dim {d} / rope dim {rd}")
    if t == 0:  # no tokens: nothing to write (and no empty grid)
        return jnp.zeros((0, h, d), dtype), window_cache
    hp = C.next_pow2(h)
    # decode (few tokens): one token per program, heads spread over programs; prefill: more tokens each
    if heads_per_program is None:
        bt = 1 if t < rows_per_program else rows_per_program
        hb = min(hp, max(1, rows_per_program // bt))
    else:
        hb = min(hp, heads_per_program)
        bt = max(1, rows_per_program // hb)
    nhb = -(-h // hb)
    dt = jnp.dtype(dtype)
    kernel = functools.partial(_v4_kernel, T=t, BT=bt, H=h, HB=hb, nhb=nhb, D=d, rd=rd, eps=eps, dtype=dt,
                               fmt=window_format, interpret=interpret, kc=kv_col)
    out_shape = (jax.ShapeDtypeStruct((t, h, d), dt), jax.ShapeDtypeStruct(window_cache.shape, window_cache.dtype))
    args = [q, kv, cos.astype(F32), sin.astype(F32), slot_mapping.astype(jnp.int32), kv_norm_w.astype(F32),
            window_cache]
    return C.pallas_call(kernel, out_shape=out_shape, grid=(pl.cdiv(t, bt), nhb + 1), aliases={6: 1},
                         interpret=interpret, name="v4_qnorm_rope_kv_insert", num_warps=num_warps)(*args)
