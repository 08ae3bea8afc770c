"""Merge a split softmax: the sparse MQA's candidate splits (``pallas_kernels.sparse_mqa``, ``num_splits`` > 1)
each write their normalised rows o_i with their base-2 row maximum m_i and sum l_i; the output row is
sum_i share_i o_i, share_i = 2^(m_i - M) l_i / (sum_j 2^(m_j - M) l_j + 2^(sink - M)), M the largest of the m_i
and the sink (all shares 0 where a row has no mass).

``implementation="xla"``: the shares, then the weighted sum, as jnp (the reference). On the H200 XLA ran that
as two or three kernels (the shares' fusions, then the sum: docs/perf-log.md), each a
launch and a DRAM round trip of latency on the decode step's critical path. ``"pallas"``: one kernel; each program takes a token's
block of heads and columns (``tiles``), all splits at once, computes the shares from (m, l) and reads each
split's rows once.

Backend: the Pallas Triton lowering (``fused_insert_common``'s conventions), not Mosaic GPU. A program's tile is
3-D, [splits, heads, columns], reduced over its leading (split) axis, with 1-16 heads and any power-of-2 split
count. Mosaic GPU's register layouts are 2-D warpgroup tiles of 64 or more rows, and a leading-axis reduction
across them is not among its layout transforms. Triton expresses the tile and the reduction directly, and it
lowers on a CPU-only machine, so the CPU tests check it.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jds.ops.dispatch import Implementation, Unsupported, check_array, check_int, describe, run_op
from pallas_kernels import fused_insert_common as C

LOG2E = 1.4426950408889634
F32 = jnp.float32
TILE_ELEMS = 4096  # values of o per program (``tiles``): 32 a thread at 4 warps
LOWEST = float(jnp.finfo(jnp.float32).min)  # a padded split's m: exp2(LOWEST - M) = 0 for any real M


def split_shares(ms: Sequence, ls: Sequence, sink_log2=None) -> list:
    """Each split's share of a row's softmax mass, from its (m, l) (base-2 logits) and the sink (base 2): the
    weights of the splits' normalised rows; all 0 where a row has no mass. The splits are few and static, so
    the steps are unrolled and elementwise (the XLA form; the kernel takes the same steps over a split axis)."""
    mx = functools.reduce(jnp.maximum, ms)
    if sink_log2 is not None:
        mx = jnp.maximum(mx, sink_log2)
    ws = [jnp.exp2(m - mx) * l for m, l in zip(ms, ls)]
    den = functools.reduce(jnp.add, ws)
    if sink_log2 is not None:
        den = den + jnp.exp2(sink_log2 - mx)
    inv = jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)
    return [w * inv for w in ws]


def split_combine(o: jax.Array, m: jax.Array, l: jax.Array, sink: jax.Array | None, *, heads: int,
                  out_dtype: jnp.dtype, implementation: Implementation = "pallas",
                  interpret: bool | None = None) -> jax.Array:
    """[T, heads, D] in ``out_dtype`` from o [S, T, Hp, D] (each split's normalised rows, any float dtype),
    m, l [S, T, Hp] float32 (base-2 maximum and sum) and ``sink`` [heads] (natural-log units) or None. Heads
    past ``heads`` (padding, Hp >= heads) are not read."""
    if o.ndim != 4 or m.shape != o.shape[:3] or l.shape != m.shape:
        raise ValueError(f"o must be [S, T, Hp, D] with m, l [S, T, Hp]; got {o.shape}, {m.shape}, {l.shape}")
    for name, a in (("o", o), ("m", m), ("l", l)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got {describe(a)}")
    if o.shape[0] < 1:
        raise ValueError(f"o must hold at least one split (S >= 1), got {describe(o)}")
    heads = check_int("heads", heads, 1, o.shape[2])
    if sink is not None:
        check_array("sink", sink, (("heads", heads),), "float")
    return run_op("split_combine", implementation, {
        "xla": lambda: _xla(o, m, l, sink, heads).astype(out_dtype),
        "pallas": lambda: _pallas(o, m, l, sink, heads, jnp.dtype(out_dtype), interpret)})


def _xla(o, m, l, sink, heads):
    o, m, l = o[:, :, :heads], m[:, :, :heads], l[:, :, :heads]
    n = o.shape[0]
    shares = split_shares([m[i] for i in range(n)], [l[i] for i in range(n)],
                          None if sink is None else sink.astype(F32)[None, :] * LOG2E)
    return functools.reduce(jnp.add, [shares[i][..., None] * o[i].astype(F32) for i in range(n)])


def _kernel(o_ref, m_ref, l_ref, sink_ref, out_ref, *, S, SP, HB, DC, T, H, has_sink):
    """One program: token t, heads [HB * j, + HB), columns [DC * c, + DC), every split at once (the splits are a
    tile axis, padded to SP: their loads go out together however many there are)."""
    t, hb, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    si = C.iota((SP, 1, 1), 0)
    h = hb * HB + C.iota((1, HB, 1), 1)
    ok = h < H
    hc = jnp.minimum(h, H - 1)
    live = si < S
    sc = jnp.minimum(si, S - 1)
    m = C.load(m_ref, (sc, t, hc), (SP, HB, 1), live, other=LOWEST)
    l = C.load(l_ref, (sc, t, hc), (SP, HB, 1), live, other=0.0)
    d = c * DC + C.iota((1, 1, DC), 2)
    o = C.load(o_ref, (sc, t, hc, d), (SP, HB, DC), live, other=0.0).astype(F32)
    mx = jnp.max(m, axis=0, keepdims=True)
    if has_sink:
        sk = C.load(sink_ref, (hc,), (1, HB, 1)) * LOG2E
        mx = jnp.maximum(mx, sk)
    w = jnp.exp2(m - mx) * l
    den = jnp.sum(w, axis=0, keepdims=True)
    if has_sink:
        den = den + jnp.exp2(sk - mx)
    inv = jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)
    acc = jnp.sum((w * inv) * o, axis=0)  # [HB, DC]
    C.store(out_ref, (jnp.where(ok[0], t, T), hc[0], d[0]), acc.astype(out_ref.dtype), ok[0])


def tiles(splits: int, heads: int, d: int) -> tuple[int, int, int]:
    """(padded splits, heads per program, columns per program): about ``TILE_ELEMS`` values of o per program,
    so that small decode batches (few tokens, many splits) still spread over the GPU and many splits do not
    overflow registers."""
    sp = C.next_pow2(splits)
    dc = min(d, 128)
    hb = max(1, min(16, C.next_pow2(heads), TILE_ELEMS // (sp * dc)))
    return sp, hb, dc


def _pallas(o, m, l, sink, heads, out_dtype, interpret):
    s, t, _, d = o.shape
    if not C.is_pow2(d):
        raise Unsupported(f"split_combine kernel: row width {d} is not a power of 2")
    if t == 0:  # no tokens: no kernel (an empty grid)
        return jnp.zeros((0, heads, d), out_dtype)
    interpret = C.resolve_interpret(interpret)
    has_sink = sink is not None
    sink_a = sink.astype(F32) if has_sink else jnp.zeros((heads,), F32)
    sp, hb, dc = tiles(s, heads, d)
    kernel = functools.partial(_kernel, S=s, SP=sp, HB=hb, DC=dc, T=t, H=heads, has_sink=has_sink)
    return C.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((t, heads, d), out_dtype),
                         grid=(t, -(-heads // hb), d // dc), aliases={}, interpret=interpret,
                         name="split_combine")(o, m.astype(F32), l.astype(F32), sink_a)
