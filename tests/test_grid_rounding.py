"""jds.ops.quant.round_to_grid: float32 rounded onto e4m3's / e2m1's grid before the conversion, so that XLA's GPU
conversion (float32 -> float16 -> float8, two roundings) gives the correctly rounded code.

Reference: the nearest value of the format's enumerated grid (ml_dtypes' table of all codes), found in float64,
ties to the even code: independent of any conversion routine. Inputs: every midpoint of the grid and its float32
neighbours a few ulps either side (where double rounding bites), the grid itself, and random values across the
range. On the CPU the plain conversion is already correct, so there the check is that the grid rounding changes
nothing; the ``gpu`` test runs the XLA form on the GPU against XLA's CPU backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jds.ops.quant import FP4_MAX, FP8_MAX, act_quant, fp4_quant, quantize_e4m3, round_to_grid
from tests.kernel_modes import ON_GPU
from tests.tolerances import act_quant_on_cpu

FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 3, -6, FP8_MAX), "e2m1": (ml_dtypes.float4_e2m1fn, 1, 0, FP4_MAX)}


def _grid(dtype) -> tuple[np.ndarray, np.ndarray]:
    """(finite non-negative values ascending, their codes) of a narrow float format (ml_dtypes keeps a 4-bit
    format's code in one byte)."""
    bits = 4 if "float4" in np.dtype(dtype).name else 8
    codes = np.arange(1 << (bits - 1), dtype=np.uint8)
    vals = codes.view(dtype).astype(np.float64)
    keep = np.isfinite(vals)
    return vals[keep], codes[keep]


def _nearest_even(x: np.ndarray, dtype, fmax: float) -> np.ndarray:
    """The correctly rounded value of clip(x, +-fmax) on the grid, in float64, ties to the even code."""
    vals, codes = _grid(dtype)
    a = np.minimum(np.abs(x.astype(np.float64)), fmax)
    hi = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo = hi - 1
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    return np.copysign(np.where(up, vals[hi], vals[lo]), x)


def _inputs(dtype, fmax: float, seed: int) -> np.ndarray:
    vals, _ = _grid(dtype)
    mids = ((vals[:-1] + vals[1:]) / 2).astype(np.float32)
    near = [mids]
    up, down = mids.copy(), mids.copy()
    for _ in range(4):
        up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(0))
        near += [up, down]
    # a value just below a midpoint by 2^-12 relative rounds to the midpoint in float16 (the GPU's double rounding)
    near += [(mids * np.float32(1 - 2.0 ** -12)).astype(np.float32), (mids * np.float32(1 + 2.0 ** -12)).astype(np.float32)]
    rng = np.random.default_rng(seed)
    rand = [rng.uniform(-fmax * 1.1, fmax * 1.1, 20000), np.exp(rng.uniform(np.log(1e-6), np.log(fmax), 20000))]
    x = np.concatenate([*near, vals.astype(np.float32), *[r.astype(np.float32) for r in rand]])
    return np.concatenate([x, -x]).astype(np.float32)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_round_to_grid_is_the_nearest_even_grid_value(fmt: str) -> None:
    dtype, mbits, min_exp, fmax = FORMATS[fmt]
    x = _inputs(dtype, fmax, seed=7)
    inside = np.abs(x) <= fmax
    got = np.asarray(round_to_grid(jnp.asarray(x), mbits, min_exp), np.float64)
    np.testing.assert_array_equal(got[inside], _nearest_even(x[inside], dtype, fmax))


def test_round_to_grid_keeps_nan_inf_and_zero_signs() -> None:
    x = jnp.asarray([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30], jnp.float32)
    got = np.asarray(round_to_grid(x, 3, -6))
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf
    np.testing.assert_array_equal(np.signbit(got[3:]), [False, True, False, True])
    np.testing.assert_array_equal(got[3:], 0.0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_conversion_through_float16_is_correct_after_the_grid(fmt: str) -> None:
    """The GPU's path emulated in numpy (float32 -> float16 -> narrow format): off the correct rounding on the inputs
    just below a tie, exact once the values are on the grid."""
    dtype, mbits, min_exp, fmax = FORMATS[fmt]
    x = np.clip(_inputs(dtype, fmax, seed=5), -fmax, fmax)
    want = _nearest_even(x, dtype, fmax)
    twice = x.astype(np.float16).astype(dtype).astype(np.float64)
    assert (twice != want).sum() > 50  # the inputs reach the double rounding
    on_grid = np.asarray(round_to_grid(jnp.asarray(x), mbits, min_exp))
    np.testing.assert_array_equal(on_grid.astype(np.float16).astype(dtype).astype(np.float64), want)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quantize_equals_the_enumerated_reference(fmt: str) -> None:
    """The conversions as the library makes them (clip, grid, cast) on this backend, every input."""
    dtype, _, _, fmax = FORMATS[fmt]
    x = _inputs(dtype, fmax, seed=11)
    want = _nearest_even(x, dtype, fmax)
    if fmt == "e4m3":
        got = np.asarray(quantize_e4m3(jnp.asarray(x)).astype(jnp.float32), np.float64)
    else:  # fp4_quant with a block whose scale is 1: amax 6 (the block max) -> s = 2^ceil(log2(6 / 6)) = 1
        n = (len(x) // 31) * 31
        blocks = np.concatenate([np.clip(x[:n], -fmax, fmax).reshape(-1, 31), np.full((n // 31, 1), fmax, np.float32)], 1)
        q, s = fp4_quant(jnp.asarray(blocks), block=32)
        np.testing.assert_array_equal(np.asarray(s), 1.0)
        got, x, want = np.asarray(q, np.float64)[:, :31].reshape(-1), x[:n], want[:n]
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="XLA's GPU conversion")
@pytest.mark.parametrize("fmt", ["ue8m0", "amax"])
def test_act_quant_on_the_gpu_equals_the_cpu_backend(fmt: str) -> None:
    """``act_quant`` (the XLA form every kernel's ``implementation="xla"`` uses) on the GPU against XLA's CPU
    backend, bit for bit, on inputs whose quotients sit near e4m3's ties (seventy-first session: before the grid
    rounding the GPU was one code off on 1-14 of 0.13-4.2 M values)."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(512, 4096)).astype(np.float32) * 3, jnp.bfloat16)
    q, s = jax.jit(act_quant, static_argnums=(1, 2))(x, 128, fmt)
    q_cpu, s_cpu = act_quant_on_cpu(x, 128, fmt)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_cpu))
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8)),
                                  np.asarray(jax.lax.bitcast_convert_type(q_cpu, jnp.uint8)))
    edge = jnp.asarray(_inputs(ml_dtypes.float8_e4m3fn, FP8_MAX, seed=5))
    got = np.asarray(jax.jit(quantize_e4m3)(edge).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got, _nearest_even(np.asarray(edge), ml_dtypes.float8_e4m3fn, FP8_MAX))
