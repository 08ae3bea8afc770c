"""Exact top-k by radix selection: the indexer's top-k without a full sort.

Why: XLA's GPU TopK sorts for large k, so at k = 2048 it takes many times one read of the logits
(``benchmarks/results/kernels_sparse_indexer_*.json``, rows ``topk_k2048_b*_c*``: ``median_us`` against
``bytes`` / ``bandwidth_frac``; this module's own rows, ``..._radix``, in
``archive/kernels_sparse_indexer_h200_2026-11-29.json``). Radix selection finds each
row's k-th largest value in ``32 / bits`` counting passes over the row. Each pass is one fused
compare-and-reduce that reads the row once. It then keeps the elements above that value, plus the
lowest-index elements equal to it, compacts them with a prefix sum and sorts only those k.

Result: the same values and indices, in the same order, as ``jax.lax.top_k``: values descending, equal
values by ascending index (the tie rule of every jds top-k). Like lax.top_k (checked on the CPU backend),
it ranks by IEEE's total order of the bit patterns: +0.0 above -0.0, a NaN with the sign bit clear above +inf and
one with it set below -inf (``ordered_key``; tests/test_kernel_topk_select.py ``test_nan_total_order``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def ordered_key(x: jax.Array) -> jax.Array:
    """uint32 image of float32 ``x`` in IEEE total order (key(a) < key(b) iff a < b; -0.0 below +0.0)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    neg = (bits >> 31) == 1
    return jnp.where(neg, ~bits, bits | jnp.uint32(0x80000000))


def kth_largest_key(key: jax.Array, k: int, bits: int = 4) -> jax.Array:
    """The k-th largest key of each row (k <= row length): uint32 [T].

    Digit by digit from the top, each pass counts, for every candidate digit d, the elements whose top
    bits are >= (prefix, d). The largest d with count >= k extends the prefix. The invariant "at least k
    elements have top bits >= prefix" holds from the first pass on.

    Each pass is a reduction over a [T, 2^bits, N] comparison. The CPU backend materialises it (277 MB of
    temporaries at bits = 4 for 64 x 64K); a GPU reduction fusion should not. The benchmark times
    bits = 1, 2 and 4 so the choice rests on measurement.
    """
    if 32 % bits:
        raise ValueError(f"bits must divide 32, got {bits}")
    t = key.shape[0]
    digits = jnp.arange(1 << bits, dtype=jnp.uint32)
    prefix = jnp.zeros((t,), jnp.uint32)
    for shift in range(32 - bits, -1, -bits):
        thr = (prefix[:, None] << bits) | digits[None, :]  # [T, 2^bits], in the shifted domain
        top = key >> shift if shift else key
        # [T, 2^bits, N] reduced over its minor dim: a row reduction, XLA GPU's best-vectorised kind
        count = jnp.sum((top[:, None, :] >= thr[:, :, None]).astype(jnp.int32), axis=2)  # [T, 2^bits]
        digit = jnp.sum((count >= k).astype(jnp.uint32), axis=1) - 1  # d = 0 always qualifies
        prefix = (prefix << bits) | digit
    return prefix


def radix_topk(x: jax.Array, k: int, bits: int = 4) -> tuple[jax.Array, jax.Array]:
    """(values, int32 indices) of the k largest entries of each row of ``x`` [T, N], k <= N: identical
    to ``lax.top_k(x, k)`` (NaN included: the module's total order)."""
    t, n = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] for rows of {n}, got {k}")
    key = ordered_key(x)
    tau = kth_largest_key(key, k, bits)[:, None]
    above = key > tau
    equal = key == tau
    need = k - jnp.sum(above.astype(jnp.int32), axis=1, keepdims=True)  # >= 1 by the choice of tau
    keep = above | (equal & (jnp.cumsum(equal.astype(jnp.int32), axis=1) <= need))  # exactly k per row
    pos = jnp.where(keep, jnp.cumsum(keep.astype(jnp.int32), axis=1) - 1, k)  # k = out of bounds: dropped
    col = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (t, n))
    rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, n))
    idx = jnp.zeros((t, k), jnp.int32).at[rows, pos].set(col, mode="drop")
    sel_key = jnp.take_along_axis(key, idx, axis=1)
    _, idx = lax.sort((~sel_key, idx), dimension=1, num_keys=2)  # key descending, then index ascending
    return jnp.take_along_axis(x, idx, axis=1), idx
