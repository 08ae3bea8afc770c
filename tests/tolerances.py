"""Tolerances derived from the number formats' unit in the last place (ulp), shared by the tests.

Why: two float computations of the same value on different code paths (a Pallas kernel in interpret mode vs
the XLA reference, a jitted vs an eager graph, another CPU's vector ISA or fusion choices) may round their
float32 intermediates differently (reduction order, FMA contraction). Such a difference of one float32 ulp
flips the final rounding to bf16 / e4m3 now and then, so the stored results differ by ONE step of the
storage format. Bit-equality is only asserted where it holds by construction (integers, identical op order on
the same path); elsewhere the tests use these bounds, which accept one rounding step and nothing more.

Formats (significand bits p including the implicit one; ulp(x) = 2^(floor(log2|x|) - (p - 1))):
* float32: p = 24, relative ulp 2^-23 .. 2^-24;
* bfloat16: p = 8, so one ulp is at most 2^-7 and at least 2^-8 of |x| (2^-8 relative is the half-ulp of a
  correct rounding); min normal 2^-126 as in float32;
* float8_e4m3fn: p = 4, one step is at most 2^-3 of |x|; min normal 2^-6, subnormal step 2^-9 (of the
  block's scale in a quantised record).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jds.ops.quant import act_quant

# (significand bits incl. the implicit one, exponent of the smallest normal)
_FORMATS = {
    "float32": (24, -126),
    "bfloat16": (8, -126),
    "float16": (11, -14),
    "float8_e4m3fn": (4, -6),
}


def _fmt(dtype) -> tuple[int, int]:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _FORMATS:
        raise ValueError(f"dtype: no ulp rule for {name!r}")
    return _FORMATS[name]


def ulp(x: np.ndarray, dtype) -> np.ndarray:
    """The spacing of ``dtype`` values at |x| (float64): 2^(max(floor(log2|x|), emin) - (p - 1))."""
    p, emin = _fmt(dtype)
    a = np.abs(np.asarray(x, np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.where(a > 0, np.maximum(e, emin), emin)
    return np.exp2(e - (p - 1))


def assert_within_ulps(got, want, dtype, n: int = 1, what: str = "", max_frac: float | None = None) -> None:
    """|got - want| <= n ulps of ``dtype`` at max(|got|, |want|), elementwise; NaN / inf patterns equal.

    ``max_frac``: if given, at most this fraction of the elements may differ at all (rounding flips are
    rare; a systematic off-by-one-ulp would be a bug the bound alone lets through)."""
    g = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(want).astype(jnp.float32), np.float64)
    assert g.shape == w.shape, f"{what}: shape {g.shape} vs {w.shape}"
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{what}: NaN pattern")
    inf = np.isinf(w) | np.isinf(g)
    np.testing.assert_array_equal(g[inf], w[inf], err_msg=f"{what}: inf pattern")
    fin = ~(np.isnan(w) | inf)
    g, w = g[fin], w[fin]
    err = np.abs(g - w)
    bound = n * ulp(np.maximum(np.abs(g), np.abs(w)), dtype)
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {g.size} elements off by more than {n} {dtype} ulp; "
                           f"worst {err[bad].max():.3e} (bound there {bound[bad][np.argmax(err[bad])]:.3e})")
    if max_frac is not None and g.size:
        frac = float((err > 0).mean())
        assert frac <= max_frac, f"{what}: {frac:.3%} of elements differ (rounding flips should be rare)"


def assert_rounded_from(low, high, dtype, what: str = "", high_dtype=np.float32, n_high: int = 2) -> None:
    """``low`` (in ``dtype``) is ``high`` rounded once to ``dtype``, up to the input of that rounding having
    moved by <= ``n_high`` ulps of ``high_dtype`` on another code path: where ``low`` != round(high), the
    element must be a 1-ulp flip AND ``high`` must lie within n_high high-precision ulps of a rounding
    midpoint (so only a different last-bit of the float32 intermediate can explain it)."""
    lo = np.asarray(jnp.asarray(low).astype(jnp.float32), np.float64)
    hi = np.asarray(high, np.float32)
    want = np.asarray(hi.astype(_np_dtype(dtype)).astype(np.float32), np.float64)
    diff = lo != want
    if not diff.any():
        return
    hi64 = hi.astype(np.float64)[diff]
    a, b = lo[diff], want[diff]
    assert (np.abs(a - b) <= ulp(np.maximum(np.abs(a), np.abs(b)), dtype)).all(), f"{what}: more than a 1-ulp flip"
    mid = (a + b) / 2  # the rounding boundary between the two candidates
    near = np.abs(hi64 - mid) <= n_high * ulp(hi64, high_dtype)
    assert near.all(), (f"{what}: {int((~near).sum())} elements rounded differently although their float32 "
                        f"input is not within {n_high} ulp of a rounding boundary")


def _np_dtype(dtype) -> np.dtype:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    return np.dtype(getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else name)


def record_segments(fmt) -> list[tuple[int, int, str, int]]:
    """(start, stop, storage dtype, quantisation block) of a decoded record row of a jds cache format; block 0
    for plain float parts. Used to bound decoded values by one step of their storage format."""
    from jds.ops.records import FloatRows, IndexerRecord132, MlaRecord584, MlaRecord656

    if isinstance(fmt, FloatRows):
        return [(0, fmt.dim, np.dtype(fmt.dtype).name, 0)]
    if isinstance(fmt, MlaRecord656):
        return [(0, fmt.latent_dim, "float8_e4m3fn", 128),
                (fmt.latent_dim, fmt.latent_dim + fmt.rope_dim, "bfloat16", 0)]
    if isinstance(fmt, IndexerRecord132):
        return [(0, fmt.dim, "float8_e4m3fn", fmt.dim)]
    if isinstance(fmt, MlaRecord584):
        return [(0, fmt.nope_dim, "float8_e4m3fn", fmt.block),
                (fmt.nope_dim, fmt.nope_dim + fmt.rope_dim, "bfloat16", 0)]
    raise ValueError(f"fmt: unknown record format {type(fmt).__name__}")


E4M3_MAX = 448.0


def assert_decoded_within_step(fmt, got, want, what: str = "", max_frac: float | None = None) -> None:
    """Decoded records ``got`` vs ``want`` ([..., row]) within one step of their storage format.

    Plain float parts: one ulp of their dtype. e4m3 parts (value = q * s, s the block scale): one e4m3 step,
    i.e. at most 2^-3 of the larger magnitude (p = 4), floored by the subnormal step 2^-9 * s. s is bounded
    by 2 * amax / 448 (a UE8M0 scale rounds amax / 448 up to a power of two; an amax scale is amax / 448),
    with amax the block's larger absolute value of the two sides: if the rounding of the record's bf16
    input flipped, the block amax and so its scale may differ between the sides."""
    g = np.asarray(got, np.float64)
    w = np.asarray(want, np.float64)
    assert g.shape == w.shape, f"{what}: shape {g.shape} vs {w.shape}"
    for start, stop, dt, block in record_segments(fmt):
        gs, ws = g[..., start:stop], w[..., start:stop]
        if block == 0:
            assert_within_ulps(gs, ws, dt, 1, f"{what}[{start}:{stop}]", max_frac)
            continue
        assert_e4m3_within_step(gs, ws, block, f"{what}[{start}:{stop}]", max_frac)


def assert_e4m3_within_step(got, want, block: int, what: str = "", max_frac: float | None = None) -> None:
    """Dequantised e4m3 values (q * s, one scale s per ``block`` consecutive values of the last axis) within
    one e4m3 step: at most 2^-3 of the larger magnitude (p = 4), floored by the subnormal step 2^-9 * s, with
    s <= 2 * amax / 448 (a UE8M0 scale rounds amax / 448 up to a power of two; an amax scale is amax / 448)
    and amax the block's larger absolute value of the two sides: if the rounding of the quantiser's input
    flipped, the block amax and so its scale may differ between the sides."""
    g = np.asarray(got, np.float64)
    w = np.asarray(want, np.float64)
    assert g.shape == w.shape and g.shape[-1] % block == 0, f"{what}: shape {g.shape} vs {w.shape}"
    shp = g.shape[:-1] + (g.shape[-1] // block, block)
    gb, wb = g.reshape(shp), w.reshape(shp)
    amax = np.maximum(np.abs(gb).max(-1, keepdims=True), np.abs(wb).max(-1, keepdims=True))
    s_max = 2.0 * amax / E4M3_MAX
    bound = np.maximum(2.0 ** -3 * np.maximum(np.abs(gb), np.abs(wb)), 2.0 ** -9 * s_max)
    err = np.abs(gb - wb)
    bad = err > bound * (1 + 1e-9)
    assert not bad.any(), (f"{what}: {int(bad.sum())} decoded e4m3 values off by more than one step; "
                           f"worst {err[bad].max():.3e}")
    if max_frac is not None and gb.size:
        frac = float((err > 0).mean())
        assert frac <= max_frac, f"{what}: {frac:.3%} of values differ (rounding flips should be rare)"


def act_quant_on_cpu(x, block: int, fmt: str):
    """``jds.ops.quant.act_quant`` of x computed by XLA's CPU backend: the reference for the kernels that quantise,
    independent of XLA's GPU conversion to float8_e4m3fn, which goes through float16 and rounded twice before
    ``quant.round_to_grid`` (docs/perf-log.md, seventy-first and seventy-second sessions)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return act_quant(jax.device_put(x, cpu), block, fmt)
