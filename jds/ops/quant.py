"""FP8 e4m3 emulation: block activation quantisation (UE8M0 / amax scales), dequantisation,
weight block quantisation and the block-scaled FP8 linear of DeepSeek's reference.

All math is float32; e4m3 rounding is round-to-nearest-even on a value already clamped to
[-448, 448], so the cast can never produce NaN.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0
FP8 = jnp.float8_e4m3fn
ScaleFmt = Literal["ue8m0", "amax"]


def ue8m0_ceil(v: jax.Array) -> jax.Array:
    """2^ceil(log2 v) for positive float32 v, exact (frexp: v = m 2^e, m in [0.5, 1))."""
    m, e = jnp.frexp(v.astype(jnp.float32))
    exp = jnp.where(m == 0.5, e - 1, e)
    return jnp.ldexp(jnp.ones_like(v, jnp.float32), exp)


FLT_MIN = np.float32(np.finfo(np.float32).tiny)


def block_scale(amax: jax.Array, fmt: ScaleFmt, amax_floor: float) -> jax.Array:
    """Scale for one block from its absolute maximum (float32).

    The scale is kept >= FLT_MIN: XLA flushes subnormals to zero, so a subnormal scale (a floor below
    448 * FLT_MIN, e.g. FLT_MIN itself) would become 0 and an all-zero block would quantise to 0/0 = NaN.
    """
    a = jnp.maximum(amax.astype(jnp.float32), np.float32(amax_floor))
    v = jnp.maximum(a * np.float32(1.0 / FP8_MAX), FLT_MIN)
    return ue8m0_ceil(v) if fmt == "ue8m0" else v


def quantize_e4m3(x_over_s: jax.Array) -> jax.Array:
    """Clamp to +-448 then round-to-nearest-even into float8_e4m3fn."""
    return jnp.clip(x_over_s.astype(jnp.float32), -FP8_MAX, FP8_MAX).astype(FP8)


def true_divide(x: jax.Array, d: jax.Array | float) -> jax.Array:
    """IEEE (correctly rounded) x / d with d broadcast to x's shape.

    XLA's algebraic simplifier rewrites ``x / broadcast(d)`` as ``x * broadcast(1 / d)``, which is off by
    an ulp for about half of all inputs when d is not a power of two; that flips e4m3 rounding ties. The
    optimization barrier keeps the divisor a full-shape operand, so the division stays a division.
    """
    d = jnp.broadcast_to(jnp.asarray(d, jnp.float32), x.shape)
    return x.astype(jnp.float32) / jax.lax.optimization_barrier(d)


def act_quant(x: jax.Array, block: int = 128, fmt: ScaleFmt = "ue8m0",
              amax_floor: float = 1e-4) -> tuple[jax.Array, jax.Array]:
    """Quantise along the last axis in blocks: returns (q e4m3 [..., n], s float32 [..., n/block])."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"act_quant: last dim {n} is not a multiple of block {block}")
    xb = x.astype(jnp.float32).reshape(x.shape[:-1] + (n // block, block))
    s = block_scale(jnp.max(jnp.abs(xb), axis=-1), fmt, amax_floor)
    # power-of-two scales divide exactly either way; amax scales need a true division (see true_divide)
    xs = xb / s[..., None] if fmt == "ue8m0" else true_divide(xb, s[..., None])
    q = quantize_e4m3(xs).reshape(x.shape)
    return q, s


FP4_MAX = 6.0


def fp4_quant(x: jax.Array, block: int = 32, amax_floor: float = 1e-4) -> tuple[jax.Array, jax.Array]:
    """MXFP4 along the last axis: (e2m1 values as float32 [..., n], power-of-two scales [..., n/block]).

    Per block: s = 2^ceil(log2(max(amax, floor) / 6)); q = e2m1_RNE(clip(x / s, +-6)) (x / s is exact: s is a
    power of two). DeepSeek-V4's indexer q / compressed-key quantisation (spec section 3.5; the amax floor is
    taken from its FP8 quantiser, UNVERIFIED for FP4).
    """
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"fp4_quant: last dim {n} is not a multiple of block {block}")
    xb = x.astype(jnp.float32).reshape(x.shape[:-1] + (n // block, block))
    a = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), np.float32(amax_floor))
    s = ue8m0_ceil(a * np.float32(1.0 / FP4_MAX))
    q = jnp.clip(xb / s[..., None], -FP4_MAX, FP4_MAX).astype(jnp.float4_e2m1fn).astype(jnp.float32)
    return q.reshape(x.shape), s


def fp4_roundtrip(x: jax.Array, block: int = 32) -> jax.Array:
    """Quantise-dequantise through MXFP4 (float32): what a reader of the FP4 indexer values sees."""
    q, s = fp4_quant(x, block)
    return dequant(q, s, block)


def dequant(q: jax.Array, s: jax.Array, block: int = 128) -> jax.Array:
    """float32 q * s, with one scale per ``block`` of the last axis."""
    n = q.shape[-1]
    qb = q.astype(jnp.float32).reshape(q.shape[:-1] + (n // block, block))
    return (qb * s[..., None].astype(jnp.float32)).reshape(q.shape)


def fake_quant(x: jax.Array, block: int, fmt: ScaleFmt = "ue8m0", amax_floor: float = 1e-4) -> jax.Array:
    """Quantise-dequantise round trip (float32 result)."""
    q, s = act_quant(x, block, fmt, amax_floor)
    return dequant(q, s, block)


def quantize_weight_blocks(w: np.ndarray, block: int = 128, fmt: ScaleFmt = "amax") -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float weight -> (e4m3 weight, float32 scale [ceil(out/b), ceil(in/b)]) as numpy arrays, amax/448
    per block (``fmt="ue8m0"``: the next power of two, as V4's checkpoints store them): ``quantize_weight_blocks_jax``
    on the host's arrays."""
    q, s = quantize_weight_blocks_jax(jnp.asarray(w, jnp.float32), block, fmt)
    return np.asarray(q), np.asarray(s)


def quantize_weight_blocks_jax(w: jax.Array, block: int = 128, fmt: ScaleFmt = "amax") -> tuple[jax.Array, jax.Array]:
    """``quantize_weight_blocks`` in jnp, bit for bit (IEEE divisions, RNE into e4m3), so that a model with FP8
    linears can be built under ``jax.eval_shape`` / ``nnx.eval_shape`` (abstract shapes, no host round trip)."""
    w = jnp.asarray(w, jnp.float32)
    o, i = w.shape
    ob, ib = -(-o // block), -(-i // block)
    blocks = jnp.pad(w, ((0, ob * block - o), (0, ib * block - i))).reshape(ob, block, ib, block)
    amax = jnp.max(jnp.abs(blocks), axis=(1, 3))
    s = true_divide(jnp.maximum(amax, np.float32(1e-4)), FP8_MAX)
    if fmt == "ue8m0":
        s = ue8m0_ceil(s)
    q = jnp.clip(true_divide(blocks, s[:, None, :, None]), -FP8_MAX, FP8_MAX)
    return q.reshape(ob * block, ib * block)[:o, :i].astype(FP8), s


def dequant_weight_blocks(wq: jax.Array, scale: jax.Array, block: int = 128) -> jax.Array:
    """float32 W = Wq * S[i//b, j//b]."""
    o, i = wq.shape
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block, axis=0)[:o], block, axis=1)[:, :i]
    return wq.astype(jnp.float32) * s


def fp8_linear(x: jax.Array, wq: jax.Array, scale: jax.Array, out_dtype: jnp.dtype,
               scale_fmt: ScaleFmt = "ue8m0") -> jax.Array:
    """DeepSeek's ``linear()`` with an FP8 weight: re-quantise x per 128 (``scale_fmt`` scales), fp32 accumulation.

    x_deq = q*s: one float32 matmul of the dequantised operands equals the block-sum of fp8 MMAs up to
    float32 summation order (exactly so for power-of-two scales; amax/448 scales round q*s once).
    """
    xq, sx = act_quant(x, 128, scale_fmt)
    xd = dequant(xq, sx, 128)
    w = dequant_weight_blocks(wq, scale)
    y = jnp.einsum("...i,oi->...o", xd, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)
