"""The 128-wide Hadamard rotation DeepSeek applies to indexer q and k before FP8 quantisation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix in natural order (scipy.linalg.hadamard), float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard_rotate(x: jax.Array) -> jax.Array:
    """y = x @ H_n * n^-1/2 over the last axis, float32 math, one rounding to x.dtype.

    The fp32-then-round precision of fast_hadamard_transform's CUDA kernel is UNVERIFIED (spec §3);
    we round once, which is the most accurate choice.
    """
    n = x.shape[-1]
    h = jnp.asarray(hadamard_matrix(n))
    y = jnp.einsum("...i,ij->...j", x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST)
    return (y * np.float32(n ** -0.5)).astype(x.dtype)
