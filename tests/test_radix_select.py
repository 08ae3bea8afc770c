"""Radix-select top-k (jds.ops.select) is identical to lax.top_k: values, indices and order, including
heavy ties, -inf runs (invisible keys), signed zeros, k = 1 and k = N."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.ops.select import kth_largest_key, ordered_key, radix_topk
from pallas_kernels.sparse_indexer import IndexerKernelConfig, topk_from_logits


def _rows(kind: str, t: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "normal":
        return (rng.standard_normal((t, n)) * rng.uniform(0.01, 100, (t, 1))).astype(np.float32)
    if kind == "ties":  # few distinct values: the k-th value is shared by many keys
        return rng.integers(-3, 3, (t, n)).astype(np.float32)
    if kind == "neginf":  # a visible prefix of random length, -inf after it
        a = rng.standard_normal((t, n)).astype(np.float32)
        a[np.arange(n)[None, :] >= rng.integers(0, n + 1, (t, 1))] = -np.inf
        return a
    if kind == "zeros":  # signed zeros mixed with small values
        a = rng.choice(np.array([0.0, -0.0, 1e-30, -1e-30, 2.0], np.float32), (t, n))
        return a.astype(np.float32)
    raise AssertionError(kind)


# under jit, as the indexer runs it: one compile per shape (eagerly, every primitive of every pass compiles on
# its own, ~240 compiles); the four kinds share the six shapes' executables
_radix_topk = jax.jit(radix_topk, static_argnums=(1, 2))


@pytest.mark.parametrize("bits", [pytest.param(4, marks=pytest.mark.slow), 8])  # 4-bit digits: twice the passes
@pytest.mark.parametrize("kind", ["normal", "ties", "neginf", "zeros"])
def test_matches_lax_top_k(kind: str, bits: int) -> None:
    rng = np.random.default_rng(hash(kind) % 1000 + bits)
    for n, k in [(1, 1), (7, 7), (100, 1), (333, 64), (1000, 999), (4096, 256)]:
        x = jnp.asarray(_rows(kind, 3, n, rng))
        want_v, want_i = jax.lax.top_k(x, k)
        got_v, got_i = _radix_topk(x, k, bits)
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i), err_msg=f"{kind} n={n} k={k}")
        np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


def test_ordered_key_is_monotone_and_kth_is_exact() -> None:
    v = np.array([-np.inf, -3e38, -1.0, -1e-40, -0.0, 0.0, 1e-40, 1.0, 3e38, np.inf], np.float32)
    keys = np.asarray(ordered_key(jnp.asarray(v)))
    assert (np.diff(keys.astype(np.int64)) > 0).all()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 500)).astype(np.float32)
    for k in (1, 17, 500):
        got = np.asarray(kth_largest_key(ordered_key(jnp.asarray(x)), k))
        want = np.asarray(ordered_key(jnp.asarray(np.sort(x, axis=1)[:, -k])))
        np.testing.assert_array_equal(got, want)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k must be"):
        radix_topk(jnp.zeros((2, 5)), 6)
    with pytest.raises(ValueError, match="bits"):
        kth_largest_key(jnp.zeros((2, 5), jnp.uint32), 1, bits=5)
    with pytest.raises(ValueError, match="topk_algorithm"):
        IndexerKernelConfig(topk_algorithm="heap")


@pytest.mark.parametrize("k", [5, 64, 300])
def test_indexer_topk_from_logits_radix(k: int) -> None:
    """The indexer's selection with topk_algorithm="radix" equals the lax path, -1 padding included."""
    rng = np.random.default_rng(k)
    x = jnp.asarray(_rows("neginf", 6, 200, rng))
    np.testing.assert_array_equal(np.asarray(topk_from_logits(x, k, algorithm="radix")),
                                  np.asarray(topk_from_logits(x, k)))
