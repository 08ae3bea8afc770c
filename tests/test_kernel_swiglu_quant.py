"""pallas_kernels.swiglu_quant: the MLP's activation quantised for the FP8 down projection.

Every element of h against a float64 silu(gate) * up within its two bf16 roundings (the silu's, then the
product's); (q, s) against ``act_quant`` of the kernel's own h bit for bit (same ops on the same values: exact by
construction); the padded rows as ``quantize_rows`` writes them; the XLA form equal to ``swiglu`` then
``act_quant`` bit for bit; the MLP on the path equal to its plain form on "xla"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jds.ops.quant import ACT_AMAX_FLOOR, QuantizedRows, act_quant, block_scale, quantize_rows_xla
from pallas_kernels import swiglu_quant as SQ
from tests.kernel_modes import MODES, interpret_for
from tests.tolerances import act_quant_on_cpu, ulp


def _inputs(seed: int, m: int, cols: int) -> jax.Array:
    return (jax.random.normal(jax.random.key(seed), (m, cols), jnp.float32) * 3).astype(jnp.bfloat16)


def _bits(a) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]))


def _check(xq: QuantizedRows, h, gate, up, fmt: str, mp: int) -> None:
    m, width = h.shape
    g, u = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    sil = g / (1 + np.exp(-g))
    ref = sil * u
    # two roundings to bf16: silu's (half its ulp, times |up|), then the product's (half the product's ulp), plus
    # the float32 work's few ulps (exp, the division)
    big = 1 + 2.0 ** -7  # a rounding may carry into the next binade
    tol = (0.5 * ulp(np.abs(sil) * big, jnp.bfloat16) * np.abs(u) + 0.5 * ulp(np.abs(ref) * big ** 2, jnp.bfloat16)
           + 8 * 2.0 ** -24 * np.abs(ref))
    got = np.asarray(h, np.float64)
    bad = np.abs(got - ref) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} off, worst {np.abs(got - ref).max()}"
    q_want, s_want = act_quant_on_cpu(h, 128, fmt)  # of the kernel's own h: exact by construction
    q, s = xq.unpadded()
    np.testing.assert_array_equal(_bits(q), _bits(q_want))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_want))
    pad = quantize_rows_xla(jnp.zeros((0, width), jnp.bfloat16), mp - m, fmt)  # rows past M: zero rows
    np.testing.assert_array_equal(_bits(xq.q[m:]), _bits(pad.q))
    np.testing.assert_array_equal(np.asarray(xq.st[:, m:]), np.asarray(pad.st))
    assert xq.q.shape == (mp, width) and xq.st.shape == (width // 128, mp) and xq.rows == m


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,width,chunk,fmt", [
    (5, 384, 16, "ue8m0"),  # 3 blocks in a 4-block tile; rows padded to 64
    (72, 1280, 4, "amax"),  # 10 blocks over 3 programs a row (the last one part-masked); 128 rows
])
def test_matches_float64(mode, m, width, chunk, fmt):
    """gate and up as the two halves of one fused projection (read in place)."""
    interpret = interpret_for(mode)
    x = _inputs(m + width, m, 2 * width)
    xq, h = SQ.swiglu_quant(x, x, width=width, up_col=width, scale_fmt=fmt, want_h=True, chunk=chunk,
                            implementation="pallas", interpret=interpret or None)
    _check(xq, h, x[:, :width], x[:, width:], fmt, SQ.padded_rows(m))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 128, 2048])
@pytest.mark.parametrize("width,fmt", [(18432, "ue8m0"), (2048, "amax")])
def test_model_shapes_native(m, width, fmt):
    """V3.2's dense MLP (18432) and a small intermediate in the amax format; gate and up as separate arrays."""
    interpret_for("native")
    g, u = _inputs(m, m, width), _inputs(m + 1, m, width)
    f = jax.jit(lambda g, u: SQ.swiglu_quant(g, u, scale_fmt=fmt, want_h=True, implementation="pallas"))
    xq, h = f(g, u)
    _check(xq, h, g, u, fmt, SQ.padded_rows(m))


@pytest.mark.parametrize("fmt", ["ue8m0", "amax"])
def test_xla_form_is_swiglu_then_act_quant(fmt):
    """Bit for bit: the path off the kernel equals the MLP's activation and ``act_quant``."""
    g, u = _inputs(1, 9, 256), _inputs(2, 9, 256)
    xq, h = SQ.swiglu_quant(g, u, scale_fmt=fmt, want_h=True, implementation="xla")
    want = jax.nn.silu(g.astype(jnp.float32)).astype(jnp.bfloat16) * u
    np.testing.assert_array_equal(_bits(h), _bits(want))
    q, s = act_quant(want, 128, fmt)
    qx, sx = xq.unpadded()
    np.testing.assert_array_equal(_bits(qx), _bits(q))
    np.testing.assert_array_equal(np.asarray(sx), np.asarray(s))


def test_errors_name_the_field():
    g = _inputs(3, 4, 256)
    with pytest.raises(ValueError, match="multiple of 128"):
        SQ.swiglu_quant(g, g, width=200)
    with pytest.raises(ValueError, match=r"up columns \[128, 128 \+ 256\) outside its 256"):
        SQ.swiglu_quant(g, g, up_col=128)
    with pytest.raises(ValueError, match="mp = 2 < M = 4"):
        SQ.swiglu_quant(g, g, mp=2)
    with pytest.raises(ValueError, match="scale_fmt"):
        SQ.swiglu_quant(g, g, scale_fmt="e8m0")
    with pytest.raises(ValueError, match="up"):
        SQ.swiglu_quant(g, g[:3])
    with pytest.raises(ValueError, match="chunk"):
        SQ.swiglu_quant(g, g, chunk=3)


def test_mlp_quantizes_for_fp8_w2_only():
    """``jds.nn.swiglu_into`` in the MLP: an FP8 ``w2`` takes the QuantizedRows (the MLP's output on "xla" equal to
    its plain form bit for bit); a bf16 ``w2``, or off "xla" where the kernel does not win (more rows than
    ``AUTO_MAX_ROWS``, narrower than ``MIN_WIDTH``), takes the bf16 rows."""
    from flax import nnx

    from jds.model import MLP
    from jds.nn import swiglu_into

    for fp8 in (True, False):
        mlp = MLP(256, 384, jnp.bfloat16, fp8, nnx.Rngs(0))
        x = _inputs(4, 6, 256)
        g, u = mlp.w1(x), mlp.w3(x)
        plain = mlp.w2(SQ.swiglu(g, u, jnp.bfloat16))
        assert isinstance(swiglu_into(g, u, mlp.w2), QuantizedRows) == fp8
        np.testing.assert_array_equal(_bits(mlp(x)), _bits(plain))
    w = SQ.MIN_WIDTH
    w2 = type(mlp.w2)(w, 128, dtype=jnp.bfloat16, fp8=True, rngs=nnx.Rngs(1), implementation="auto")
    for rows, width, quantised in ((3, w, True), (SQ.AUTO_MAX_ROWS + 1, w, False), (3, w - 128, False)):
        x = jnp.zeros((rows, width), jnp.bfloat16)
        assert isinstance(swiglu_into(x, x, w2), QuantizedRows) == quantised, (rows, width)
    assert SQ.kernel_wins(64, 18432) and not SQ.kernel_wins(64, 2048)  # V3.2's dense MLP, V4's bench MLP


@pytest.mark.parametrize("fmt", ["ue8m0", "amax"])
def test_reference_is_numpys_single_rounding(fmt):
    """The kernels' quantisation reference (``act_quant`` on XLA's CPU backend) equals a direct float32 derivation in
    numpy (the scale by ``block_scale``, one correctly rounded quotient, one RNE conversion to e4m3), on the h of a
    native failure: there XLA's GPU backend rounded h / s = -3.4999998 steps of 2^-9 through float16 to code 132
    (-4 steps); once rounded it is 131 (-3 steps)."""
    with jax.default_device(jax.devices("cpu")[0]):  # the same h on any machine
        h = SQ.swiglu(_inputs(64, 64, 2048), _inputs(65, 64, 2048), jnp.bfloat16)
    q, s = act_quant_on_cpu(h, 128, fmt)
    blocks = np.asarray(h, np.float32).reshape(64, 16, 128)
    s_np = np.asarray(block_scale(jnp.asarray(np.abs(blocks).max(axis=-1)), fmt, ACT_AMAX_FLOOR))
    np.testing.assert_array_equal(np.asarray(s), s_np)
    quot = (blocks / s_np[..., None]).astype(np.float32)  # numpy: one correctly rounded float32 division
    want = np.clip(quot, -448, 448).astype(ml_dtypes.float8_e4m3fn).reshape(64, 2048).view(np.uint8)
    np.testing.assert_array_equal(_bits(q), want)
    if fmt == "amax":
        assert want[59, 1380] == 131
