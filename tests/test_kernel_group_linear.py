"""pallas_kernels.group_linear (V4's grouped ``wo_a``, bf16): every element against a float64 reference within one
bf16 rounding plus float32 accumulation's bound, at the model's shape natively (``gpu``) and on small shapes in
interpret mode; exact data (every partial sum representable) bit for bit against the XLA form; the dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.ops.dispatch import Unsupported
from pallas_kernels import group_linear as GL
from tests.kernel_modes import MODES, interpret_for
from tests.tolerances import ulp


def _inputs(seed: int, lead: tuple[int, ...], g: int, n: int, k: int, dtype=jnp.bfloat16):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (*lead, g, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (g * n, k), jnp.float32) * k ** -0.5).astype(dtype)
    return x, w


def _check_close(y, x, w) -> None:
    """|y - ref| <= half a bf16 ulp of the float32 sum + the float32 sum's bound, k * 2^-24 * sum |x||w|."""
    g, k = x.shape[-2:]
    xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64).reshape(g, -1, k)
    ref = np.einsum("...gi,goi->...go", xf, wf)
    bound = k * 2.0 ** -24 * np.einsum("...gi,goi->...go", np.abs(xf), np.abs(wf))
    tol = 0.5 * ulp(np.abs(ref) + bound, y.dtype) + bound
    got = np.asarray(y, np.float64)
    assert got.shape == ref.shape
    bad = np.abs(got - ref) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements off, worst {np.abs(got - ref).max()}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lead,g,n,k,tiles", [
    ((5,), 2, 128, 256, dict(block_n=64, block_k=128)),  # rows padded to one 64-row tile
    ((2, 65), 1, 64, 128, dict(block_n=32, block_k=64)),  # leading dims; two warpgroups, rows padded to 128
    ((130,), 2, 32, 128, dict(block_n=16, block_k=64, stages=1)),  # two row tiles, a one-stage ring
])
def test_matches_float64(mode, lead, g, n, k, tiles):
    interpret = interpret_for(mode)
    x, w = _inputs(sum(lead) + n, lead, g, n, k)
    y = GL.group_linear(x, w, implementation="pallas", interpret=interpret or None, **tiles)
    assert y.dtype == jnp.bfloat16
    _check_close(y, x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 128, 200, 256])
@pytest.mark.parametrize("block_n", [None, 32, 128])
def test_v4_wo_a_native(rows, block_n):
    """V4-Flash's ``wo_a``: 8 groups of [1024, 4096], at decode / prefill row counts (two row tiles from 129)."""
    interpret_for("native")
    x, w = _inputs(rows, (rows,), 8, 1024, 4096)
    y = jax.jit(lambda x, w: GL.group_linear(x, w, implementation="pallas", block_n=block_n))(x, w)
    _check_close(y, x, w)


@pytest.mark.parametrize("mode", MODES)
def test_exact_data_bit_equal(mode):
    """Small integers times powers of two: every partial sum is exact in float32, so any summation order gives
    the XLA form's bits."""
    interpret = interpret_for(mode)
    rng = np.random.default_rng(3)
    g, n, k = 2, 64, 256
    x = jnp.asarray(rng.integers(-8, 9, (70, g, k)) * 0.25, jnp.bfloat16)
    w = jnp.asarray(rng.integers(-8, 9, (g * n, k)) * 0.125, jnp.bfloat16)
    for out_dtype in (jnp.bfloat16, jnp.float32):
        got = GL.group_linear(x, w, out_dtype=out_dtype, implementation="pallas", interpret=interpret or None,
                              block_n=32)
        want = GL.group_linear_xla(x, w, out_dtype)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_dispatch_and_errors():
    x, w = _inputs(0, (3,), 2, 64, 128)
    with pytest.raises(ValueError, match="x must be"):
        GL.group_linear(x[0, 0], w)
    with pytest.raises(ValueError, match="group_linear: w"):
        GL.group_linear(x, w[:, :64])
    with pytest.raises(ValueError, match="not a multiple of x's 2 groups"):
        GL.group_linear(x, w[:127])
    with pytest.raises(Unsupported, match="16-bit"):
        GL.group_linear(x.astype(jnp.float32), w.astype(jnp.float32), implementation="pallas")
    with pytest.raises(Unsupported, match="block_n"):
        GL.group_linear(x, w, implementation="pallas", block_n=48)
    big, wb = _inputs(1, (GL.MAX_ROWS + 1,), 1, 64, 128)
    with pytest.raises(Unsupported, match="MAX_ROWS"):
        GL.group_linear(big, wb, implementation="pallas")
    # "auto" past the kernel's limits, or where it measured slower (rows that need padding), is the XLA form
    for xx, ww in ((big, wb), (x, w)):
        np.testing.assert_array_equal(np.asarray(GL.group_linear(xx, ww)),
                                      np.asarray(GL.group_linear_xla(xx, ww, jnp.bfloat16)))
    assert [r for r in range(1, 300) if GL.kernel_wins(r)] == [64, 128, 256]


def test_default_block_n_fills_the_sms():
    assert GL.default_block_n(128, 8, 1024) == 64  # 8 x 16 = 128 CTAs (one row tile)
    assert GL.default_block_n(64, 8, 1024) == 64
    assert GL.default_block_n(256, 8, 1024) == 128  # two row tiles: 2 x 8 x 8 = 128
    assert GL.default_block_n(1, 1, 64) == 16  # never below 16
