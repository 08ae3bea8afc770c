"""YaRN RoPE tables and their interleaved (GPT-J) / NeoX application.

One table serves MLA and the V3.2 indexer (same YaRN frequencies); V4 uses one table per layer kind.
Angles are fp32(p) * f_i in float32 as in DeepSeek's reference (precompute_freqs_cis).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jds.config import RopeConfig


def rope_inv_freqs(cfg: RopeConfig, dim: int) -> np.ndarray:
    """The dim/2 float32 frequencies, YaRN-interpolated when ``cfg.yarn``."""
    f = (1.0 / (cfg.theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    if not cfg.yarn:
        return f

    def corr_dim(num_rot: float) -> float:
        return dim * math.log(cfg.original_seq_len / (num_rot * 2 * math.pi)) / (2 * math.log(cfg.theta))

    low = max(math.floor(corr_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(corr_dim(cfg.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    smooth = (1 - ramp).astype(np.float32)
    return (f / np.float32(cfg.factor) * (1 - smooth) + f * smooth).astype(np.float32)


@functools.lru_cache(maxsize=None)
def cached_inv_freqs(cfg: RopeConfig, dim: int) -> np.ndarray:
    """rope_inv_freqs memoised per (config, dim): layers build their tables once, at trace time."""
    f = rope_inv_freqs(cfg, dim)
    f.flags.writeable = False
    return f


def rope_cos_sin(inv_freqs: jax.Array | np.ndarray, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin of angle p * f_i, each [..., dim/2] float32."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freqs, jnp.float32)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool, inverse: bool = False) -> jax.Array:
    """Rotate the whole last axis of ``x`` (the rope slice) in float32, return x.dtype.

    interleaved pairs (x[2i], x[2i+1]); NeoX pairs (x[i], x[i+d/2]). cos/sin broadcast over
    the axes between the token axis and the last axis (e.g. heads). ``inverse`` rotates by -angle.
    """
    xf = x.astype(jnp.float32)
    extra = xf.ndim - cos.ndim
    c = cos.reshape(cos.shape[:-1] + (1,) * extra + cos.shape[-1:])
    s = sin.reshape(sin.shape[:-1] + (1,) * extra + sin.shape[-1:])
    if inverse:
        s = -s
    if interleaved:
        u, v = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([u * c - v * s, u * s + v * c], axis=-1).reshape(xf.shape)
    else:
        half = xf.shape[-1] // 2
        u, v = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([u * c - v * s, u * s + v * c], axis=-1)
    return out.astype(x.dtype)


def rope_part(x: jax.Array, cos: jax.Array, sin: jax.Array, *, rope_dim: int, first: bool, interleaved: bool,
              inverse: bool = False, in_place: bool = False) -> jax.Array:
    """Apply RoPE to the first or last ``rope_dim`` dims of the last axis, leave the rest untouched.

    ``in_place``: the rotated dims written over x's (a dynamic-update-slice: XLA can update x's buffer and copy
    only those dims) rather than a new row by concatenation. GPU only: XLA's CPU backend (jax 0.11.2) computed
    the in-place form wrongly under jit when it fed a dot (docs/perf-log.md, sixty-sixth session)."""
    if in_place:
        start = 0 if first else x.shape[-1] - rope_dim
        part = jax.lax.slice_in_dim(x, start, start + rope_dim, axis=-1)
        rot = apply_rope(part, cos, sin, interleaved=interleaved, inverse=inverse)
        return jax.lax.dynamic_update_slice_in_dim(x, rot, start, axis=-1)
    if first:
        return jnp.concatenate([apply_rope(x[..., :rope_dim], cos, sin, interleaved=interleaved, inverse=inverse),
                                x[..., rope_dim:]], axis=-1)
    return jnp.concatenate([x[..., :-rope_dim],
                            apply_rope(x[..., -rope_dim:], cos, sin, interleaved=interleaved, inverse=inverse)], axis=-1)
