"""The split-softmax merge (``pallas_kernels.split_combine``): kernel and XLA form against a float64 numpy
re-derivation, on fresh random inputs, every element checked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_mqa import M_INIT
from pallas_kernels.split_combine import LOG2E, split_combine
from tests.kernel_modes import MODES, interpret_for

F32_ULP = 2.0 ** -24


def _reference(o, m, l, sink, heads) -> np.ndarray:
    o, m, l = (np.asarray(a, np.float64)[:, :, :heads] for a in (o, m, l))
    mx = m.max(axis=0)
    if sink is not None:
        mx = np.maximum(mx, np.asarray(sink, np.float64) * LOG2E)
    w = np.exp2(m - mx) * l
    den = w.sum(axis=0) + (0.0 if sink is None else np.exp2(np.asarray(sink, np.float64) * LOG2E - mx))
    share = np.where(den > 0, w / np.where(den > 0, den, 1.0), 0.0)
    return (share[..., None] * o).sum(axis=0)


def _inputs(key, s, t, hp, d, heads, part_dtype, with_sink):
    ko, km, kl, ks, kd = jax.random.split(key, 5)
    o = jax.random.normal(ko, (s, t, hp, d), jnp.float32).astype(part_dtype)
    m = jax.random.normal(km, (s, t, hp), jnp.float32) * 4
    l = jax.random.uniform(kl, (s, t, hp), jnp.float32, 0.5, 64.0)
    # rows with no mass in some splits (the kernel's empty split: m = M_INIT, l = 0), and a row with none at all
    dead = jax.random.bernoulli(kd, 0.2, (s, t, hp))
    m, l = jnp.where(dead, M_INIT, m), jnp.where(dead, 0.0, l)
    m, l = m.at[:, 0, 0].set(M_INIT), l.at[:, 0, 0].set(0.0)
    sink = jax.random.normal(ks, (heads,), jnp.float32) if with_sink else None
    return o, m, l, sink


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits,part_dtype,out_dtype,with_sink", [
    (2, jnp.float32, jnp.float32, True),  # V4 decode, fp32 output
    (2, jnp.bfloat16, jnp.bfloat16, True),  # V4 layers: bf16 split rows and output
    (3, jnp.float32, jnp.float32, False),  # V3.2 (no sink), an odd split count
    (4, jnp.bfloat16, jnp.float32, False),
    (13, jnp.bfloat16, jnp.bfloat16, False)])  # V3.2 at batch 1 runs 16: a padded split axis
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_matches_float64(mode, splits, part_dtype, out_dtype, with_sink, implementation):
    interpret = interpret_for(mode)
    t, hp, d, heads = 5, 64, 512, 40  # padded heads, a partial last head block (2 splits: 16 a program)
    o, m, l, sink = _inputs(jax.random.key(splits), splits, t, hp, d, heads, part_dtype, with_sink)
    got = split_combine(o, m, l, sink, heads=heads, out_dtype=out_dtype, implementation=implementation,
                        interpret=interpret)
    assert got.shape == (t, heads, d) and got.dtype == jnp.dtype(out_dtype)
    want = _reference(o, m, l, sink, heads)
    scale = np.abs(np.asarray(o, np.float64)).max()
    # fp32 shares (exp2, a division, products) and a sum of ``splits`` terms: a few ulp of the largest row value;
    # a bf16 output adds its rounding (half an ulp of 2^-8 relative)
    tol = 16 * splits * F32_ULP * scale + (2.0 ** -8 * np.abs(want) if out_dtype == jnp.bfloat16 else 0.0)
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= tol), float((err - tol).max())
    assert np.all(np.asarray(got)[0, 0] == 0)  # a row with no mass


def test_bad_shapes_name_the_field():
    o, m, l = jnp.zeros((2, 3, 64, 512)), jnp.zeros((2, 3, 64)), jnp.zeros((2, 3, 64))
    with pytest.raises(ValueError, match="heads"):
        split_combine(o, m, l, None, heads=65, out_dtype=jnp.float32, implementation="xla")
    with pytest.raises(ValueError, match="sink"):
        split_combine(o, m, l, jnp.zeros((8,)), heads=64, out_dtype=jnp.float32, implementation="xla")
    with pytest.raises(ValueError, match="m, l"):
        split_combine(o, m[:, :2], l, None, heads=64, out_dtype=jnp.float32, implementation="xla")
