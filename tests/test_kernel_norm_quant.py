"""pallas_kernels.norm_quant: the norm whose output the FP8 linears take quantised.

Every element of y against a float64 RMSNorm of the (bf16-rounded) sum within one bf16 rounding plus the float32
work's bound; (q, s) against ``act_quant`` of the kernel's own y bit for bit (same ops on the same values: exact
by construction); the padded rows as ``quantize_rows`` writes them; h = x + residual bit for bit; the XLA form
equal to ``rms_norm`` then ``act_quant`` bit for bit; ``fp8_linear`` with the quantised rows equal to it on y, in
both of its implementations; the model's layers on the path, against the plain norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.ops.norms import rms_norm
from jds.ops.quant import QuantizedRows, act_quant, quantize_rows_xla, random_fp8_weight
from pallas_kernels import norm_quant as NQ
from pallas_kernels.fp8_gemm import fp8_linear
from tests.kernel_modes import MODES, interpret_for
from tests.tolerances import act_quant_on_cpu, assert_within_ulps, ulp

EPS = 1e-6


def _inputs(seed: int, m: int, w: int, width: int, residual: bool):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(k[0], (m, w), jnp.float32) * 2).astype(jnp.bfloat16)
    r = jax.random.normal(k[1], (m, width), jnp.float32).astype(jnp.bfloat16) if residual else None
    wt = 1 + 0.1 * jax.random.normal(k[2], (width,), jnp.float32)
    return x, r, wt


def _bits(a) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8 if a.dtype.itemsize == 1 else jnp.uint32)
                      if a.dtype.itemsize in (1, 4) else jax.lax.bitcast_convert_type(a, jnp.uint16))


def _check(nq: NQ.NormQuant, x, r, wt, col: int, width: int, fmt: str, mp: int) -> None:
    m = x.shape[0]
    src = np.asarray(x, np.float64)[:, col:col + width]
    if r is not None:
        h_want = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(jnp.bfloat16)  # one rounding of the sum
        np.testing.assert_array_equal(_bits(nq.h), _bits(h_want))
        src = np.asarray(h_want, np.float64)
    # float64 reference: |y - ref| <= half a bf16 ulp of the value + the float32 work's bound (sum of squares,
    # rsqrt, two products: a few float32 ulps of |ref|)
    ref = src / np.sqrt(np.mean(src * src, axis=1, keepdims=True) + EPS) * np.asarray(wt, np.float64)
    tol = 0.5 * ulp(np.abs(ref) * (1 + 2.0 ** -20), jnp.bfloat16) + 8 * 2.0 ** -24 * np.abs(ref)
    y = np.asarray(nq.y, np.float64)
    bad = np.abs(y - ref) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} off, worst {np.abs(y - ref).max()}"
    q_want, s_want = act_quant_on_cpu(nq.y, 128, fmt)  # of the kernel's own y: exact by construction
    q, s = nq.x.unpadded()
    np.testing.assert_array_equal(_bits(q), _bits(q_want))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_want))
    pad = quantize_rows_xla(jnp.zeros((0, width), jnp.bfloat16), mp - m, fmt)  # rows past M: zero rows
    np.testing.assert_array_equal(_bits(nq.x.q[m:]), _bits(pad.q))
    np.testing.assert_array_equal(np.asarray(nq.x.st[:, m:]), np.asarray(pad.st))
    assert nq.x.q.shape == (mp, width) and nq.x.st.shape == (width // 128, mp) and nq.x.rows == m


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,w,col,width,residual,fmt", [
    (5, 384, 0, None, True, "ue8m0"),  # 3 blocks held as 4; residual; rows padded to 64
    (72, 640, 128, 384, False, "amax"),  # a column range of a wider x (a fused projection's part); 128 rows
])
def test_matches_float64(mode, m, w, col, width, residual, fmt):
    interpret = interpret_for(mode)
    width = width or w
    x, r, wt = _inputs(m + w, m, w, width, residual)
    nq = NQ.rms_norm_quant(x, wt, EPS, residual=r, col=col, width=width if col or width != w else None,
                           scale_fmt=fmt, implementation="pallas", interpret=interpret or None)
    _check(nq, x, r, wt, col, width, fmt, NQ.padded_rows(m))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 128, 2048])
@pytest.mark.parametrize("case", ["v4_hidden_residual", "v32_hidden", "v32_q_latent", "v4_q_latent_amax"])
def test_model_shapes_native(m, case):
    """The norms the model quantises: V4's / V3.2's hidden state (with the residual add), the q latents read in place
    from the fused projection."""
    interpret_for("native")
    w, col, width, residual, fmt = {"v4_hidden_residual": (4096, 0, 4096, True, "ue8m0"),
                                    "v32_hidden": (7168, 0, 7168, False, "ue8m0"),
                                    "v32_q_latent": (2112, 0, 1536, False, "ue8m0"),
                                    "v4_q_latent_amax": (1536, 0, 1024, False, "amax")}[case]
    x, r, wt = _inputs(m, m, w, width, residual)
    f = jax.jit(lambda x, r, wt: NQ.rms_norm_quant(x, wt, EPS, residual=r, col=col, width=width, scale_fmt=fmt,
                                                   implementation="pallas"))
    _check(f(x, r, wt), x, r, wt, col, width, fmt, NQ.padded_rows(m))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fmt", ["ue8m0", "amax"])
def test_xla_form_is_norm_then_act_quant(residual, fmt):
    """Bit for bit: the model's path off the kernel equals the plain norm (after x + residual) and ``act_quant``."""
    x, r, wt = _inputs(3, 9, 256, 256, residual)
    nq = NQ.rms_norm_quant(x, wt, EPS, residual=r, scale_fmt=fmt, implementation="xla")
    h = x + r if residual else x
    y = rms_norm(h, wt, EPS)
    np.testing.assert_array_equal(_bits(nq.y), _bits(y))
    q, s = act_quant(y, 128, fmt)
    qx, sx = nq.x.unpadded()
    np.testing.assert_array_equal(_bits(qx), _bits(q))
    np.testing.assert_array_equal(np.asarray(sx), np.asarray(s))


@pytest.mark.parametrize("mode", MODES)
def test_fp8_linear_takes_quantized_rows(mode):
    """fp8_linear(QuantizedRows) equals fp8_linear(y) bit for bit, the kernel (decode: the swapped tiles at 5 rows,
    64-row tiles at 64, 128-row tiles at 72) and the XLA form."""
    interpret = interpret_for(mode)
    k = jax.random.split(jax.random.key(7), 2)
    wq, ws = random_fp8_weight(k[0], (384, 256), 0.06)
    for m in (5, 64, 72):
        x, _, wt = _inputs(m, m, 256, 256, False)
        nq = NQ.rms_norm_quant(x, wt, EPS, implementation="xla")
        for impl in ("xla", "pallas"):
            kw = dict(implementation=impl, interpret=(interpret or None) if impl == "pallas" else None)
            a, b = fp8_linear(nq.y, wq, ws, **kw), fp8_linear(nq.x, wq, ws, **kw)
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{impl} at {m} rows")


def test_fp8_linear_refits_other_row_counts():
    """A QuantizedRows padded to other than the kernel's rows goes in as a padded or cut copy (same result)."""
    k = jax.random.split(jax.random.key(8), 2)
    wq, ws = random_fp8_weight(k[0], (256, 256), 0.06)
    x, _, wt = _inputs(4, 72, 256, 256, False)
    y = rms_norm(x, wt, EPS)
    want = fp8_linear(y, wq, ws, implementation="xla")
    for mp in (72, 256):
        xq = quantize_rows_xla(y, mp, "ue8m0")
        np.testing.assert_array_equal(_bits(fp8_linear(xq, wq, ws, implementation="xla")), _bits(want))


def test_errors_name_the_field():
    x, r, wt = _inputs(1, 4, 256, 256, True)
    with pytest.raises(ValueError, match="multiple of 128"):
        NQ.rms_norm_quant(x, wt[:200], EPS, width=200)
    with pytest.raises(ValueError, match="residual is added to x as a whole"):
        NQ.rms_norm_quant(x, wt[:128], EPS, residual=r[:, :128], col=128, width=128)
    with pytest.raises(ValueError, match="mp = 2 < M = 4"):
        NQ.rms_norm_quant(x, wt, EPS, mp=2)
    with pytest.raises(ValueError, match="scale_fmt"):
        NQ.rms_norm_quant(x, wt, EPS, scale_fmt="e8m0")
    with pytest.raises(ValueError, match="weight"):
        NQ.rms_norm_quant(x, wt[:128], EPS)
    xq = NQ.rms_norm_quant(x, wt, EPS, implementation="xla").x
    wq, ws = random_fp8_weight(jax.random.key(0), (128, 256), 0.06)
    with pytest.raises(ValueError, match="scale_fmt 'ue8m0', the linear's is 'amax'"):
        fp8_linear(xq, wq, ws, scale_fmt="amax", implementation="xla")
    wq2, ws2 = random_fp8_weight(jax.random.key(0), (128, 384), 0.06)
    with pytest.raises(ValueError, match="QuantizedRows of 4 rows"):
        fp8_linear(xq, wq2, ws2, implementation="xla")
    with pytest.raises(ValueError, match="quantize_x=True"):
        fp8_linear(xq, wq, ws, implementation="pallas", quantize_x=True)
    assert isinstance(xq, QuantizedRows) and xq.shape == (4, 256)
    empty = NQ.rms_norm_quant(x[:0], wt, EPS)  # "auto": no rows go to the XLA form
    assert empty.y.shape == (0, 256) and empty.x.q.shape == (64, 256) and empty.x.rows == 0


def test_linear_refuses_quantized_rows_without_fp8_weight():
    from flax import nnx

    from jds.nn import Linear

    lin = Linear(256, 128, dtype=jnp.bfloat16, fp8=False, rngs=nnx.Rngs(0))
    x, _, wt = _inputs(2, 4, 256, 256, False)
    with pytest.raises(ValueError, match="needs an FP8 weight"):
        lin(NQ.rms_norm_quant(x, wt, EPS, implementation="xla").x)


def test_norm_into_quantizes_only_for_fp8_readers():
    """``jds.nn.norm_into``: FP8 readers of one scale format get the QuantizedRows; any bf16 reader (or formats that
    differ) gets the plain norm's output, equal to the module's own call."""
    from flax import nnx

    from jds.nn import Linear, RMSNorm, norm_into

    rngs = nnx.Rngs(0)
    norm = RMSNorm(256, eps=EPS, rngs=rngs)
    fp8 = [Linear(256, 128, dtype=jnp.bfloat16, fp8=True, rngs=rngs, scale_fmt=f) for f in ("ue8m0", "ue8m0", "amax")]
    bf16 = Linear(256, 128, dtype=jnp.bfloat16, fp8=False, rngs=rngs)
    x, r, _ = _inputs(5, 6, 256, 256, True)
    nq, xin = norm_into(norm, x, fp8[:2], residual=r, want_y=False)
    assert isinstance(xin, QuantizedRows) and nq.y is None
    np.testing.assert_array_equal(_bits(nq.h), _bits(x + r))
    for readers in ((fp8[0], bf16), (fp8[0], fp8[2])):
        nq, xin = norm_into(norm, x, readers, residual=r)
        np.testing.assert_array_equal(_bits(xin), _bits(norm(x + r)))
        assert nq.x is None


def test_norm_into_leaves_large_row_counts_to_the_linears():
    """Off "xla", the norm quantises up to ``AUTO_MAX_ROWS`` rows only (measured there); above, the linears quantise
    for themselves as before. On "xla" it always does (the same values either way)."""
    from flax import nnx

    from jds.nn import Linear, RMSNorm, norm_into

    rngs = nnx.Rngs(1)
    norm = RMSNorm(128, eps=EPS, rngs=rngs)
    lin = Linear(128, 128, dtype=jnp.bfloat16, fp8=True, rngs=rngs)
    for rows, impl, quantised in ((NQ.AUTO_MAX_ROWS + 1, "auto", False), (NQ.AUTO_MAX_ROWS + 1, "xla", True),
                                  (3, "auto", True)):
        lin.implementation = impl
        x = jax.random.normal(jax.random.key(rows), (rows, 128), jnp.float32).astype(jnp.bfloat16)
        nq, xin = norm_into(norm, x, (lin,))
        assert isinstance(xin, QuantizedRows) == quantised, (rows, impl)
        assert_within_ulps(np.asarray(nq.y, np.float64), np.asarray(norm(x), np.float64), jnp.bfloat16, n=1,
                           what="y (the kernel on a GPU: summation order)")
