"""RMSNorm and LayerNorm, computed in float32 and rounded to the output dtype (DeepSeek [R])."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """w * x * rsqrt(mean(x^2) + eps) over the last axis; ``weight=None`` is V4's weightless per-head norm."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float,
               out_dtype: jnp.dtype | None = None) -> jax.Array:
    """Standard LayerNorm (biased variance) in float32: the V3.2 indexer's k_norm."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)
