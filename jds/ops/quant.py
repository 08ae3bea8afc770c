"""FP8 e4m3 emulation: block activation quantisation (UE8M0 / amax scales), dequantisation,
weight block quantisation and the block-scaled FP8 linear of DeepSeek's reference; MXFP4 (the V4 indexer's
activations) and packed FP4 weights with e8m0 scales (V4's routed experts).

All math is float32; e4m3 rounding is round-to-nearest-even on a value already clamped to
[-448, 448], so the cast can never produce NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
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
ACT_AMAX_FLOOR = 1e-4  # activation blocks' amax floor (act_quant's default; the kernels that quantise apply it too)


def block_scale(amax: jax.Array, fmt: ScaleFmt, amax_floor: float) -> jax.Array:
    """Scale for one block from its absolute maximum (float32).

    The scale is kept >= FLT_MIN: XLA flushes subnormals to zero, so a subnormal scale (a floor below
    448 * FLT_MIN, e.g. FLT_MIN itself) would become 0 and an all-zero block would quantise to 0/0 = NaN.
    """
    a = jnp.maximum(amax.astype(jnp.float32), np.float32(amax_floor))
    v = jnp.maximum(a * np.float32(1.0 / FP8_MAX), FLT_MIN)
    return ue8m0_ceil(v) if fmt == "ue8m0" else v


def ue8m0_scale_bits(amax: jax.Array, amax_floor: float = ACT_AMAX_FLOOR) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``block_scale(amax, "ue8m0", amax_floor)`` by exponent bits, for kernels (no frexp / ldexp there).

    Returns (s, 1/s, biased exponent of s as int32). s = 2^ceil(log2 v) with v = ``block_scale``'s amax-format
    value (normal: >= FLT_MIN), so s has biased exponent E + (mantissa(v) != 0); 1/s is exact, hence
    x * (1/s) == x / s bit for bit.
    """
    v = block_scale(amax, "amax", amax_floor)
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    e = jax.lax.shift_right_logical(bits, 23) + jnp.where((bits & 0x7FFFFF) != 0, 1, 0)
    s = jax.lax.bitcast_convert_type(jax.lax.shift_left(e, 23), jnp.float32)
    inv = jax.lax.bitcast_convert_type(jax.lax.shift_left(254 - e, 23), jnp.float32)
    return s, inv, e


def round_to_grid(x: jax.Array, mantissa_bits: int, min_exp: int) -> jax.Array:
    """float32 x rounded to nearest even onto the grid of a narrow float with ``mantissa_bits`` stored mantissa
    bits and smallest normal exponent ``min_exp`` (e4m3: 3, -6; e2m1: 1, 0), as float32; no clamp.

    Why: XLA's GPU backend converts float32 to float8_e4m3fn through float16, so a value just below a tie rounds
    up to the tie in float16 and then to even: one code off the correct rounding. A value already on the grid
    converts exactly by any path. Normal range: round the float32 bits to ``mantissa_bits`` (the carry into the
    exponent is the correct result); below 2^min_exp the grid is uniform, round(x / step) * step, both exact.
    """
    x = x.astype(jnp.float32)
    drop = 23 - mantissa_bits
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bias = np.uint32((1 << (drop - 1)) - 1) + ((bits >> np.uint32(drop)) & np.uint32(1))
    normal = jax.lax.bitcast_convert_type((bits + bias) & np.uint32(~((1 << drop) - 1) & 0xFFFFFFFF), jnp.float32)
    inv_step = np.float32(2.0 ** (mantissa_bits - min_exp))
    sub = jnp.round(x * inv_step) * np.float32(2.0 ** (min_exp - mantissa_bits))
    return jnp.where(jnp.abs(x) < np.float32(2.0 ** min_exp), sub, jnp.where(jnp.isnan(x), x, normal))


def quantize_e4m3(x_over_s: jax.Array) -> jax.Array:
    """Clamp to +-448 then round-to-nearest-even into float8_e4m3fn (onto the grid first: ``round_to_grid``)."""
    return jnp.clip(round_to_grid(x_over_s, 3, -6), -FP8_MAX, FP8_MAX).astype(FP8)


def true_divide(x: jax.Array, d: jax.Array | float) -> jax.Array:
    """IEEE (correctly rounded) x / d with d broadcast to x's shape.

    XLA's algebraic simplifier rewrites ``x / broadcast(d)`` as ``x * broadcast(1 / d)``, which is off by
    an ulp for about half of all inputs when d is not a power of two; that flips e4m3 rounding ties. The
    optimization barrier keeps the divisor a full-shape operand, so the division stays a division.
    """
    d = jnp.broadcast_to(jnp.asarray(d, jnp.float32), x.shape)
    return x.astype(jnp.float32) / jax.lax.optimization_barrier(d)


def act_quant(x: jax.Array, block: int = 128, fmt: ScaleFmt = "ue8m0",
              amax_floor: float = ACT_AMAX_FLOOR) -> tuple[jax.Array, jax.Array]:
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
    q = jnp.clip(round_to_grid(xb / s[..., None], 1, 0), -FP4_MAX, FP4_MAX).astype(jnp.float4_e2m1fn).astype(jnp.float32)
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
    q = quantize_e4m3(true_divide(blocks, s[:, None, :, None]))
    return q.reshape(ob * block, ib * block)[:o, :i], s


def dequant_weight_blocks(wq: jax.Array, scale: jax.Array, block: int = 128) -> jax.Array:
    """float32 W = Wq * S[i//b, j//b]."""
    o, i = wq.shape
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block, axis=0)[:o], block, axis=1)[:, :i]
    return wq.astype(jnp.float32) * s


def random_fp8_weight(key: jax.Array, shape: tuple[int, ...], std: float, block: int = 128
                      ) -> tuple[jax.Array, jax.Array]:
    """A random weight as an FP8 checkpoint stores it: normal(0, std) values quantised per ``block`` x ``block``
    block of the last two axes with amax / 448 scales: (e4m3 [..., out, in], float32 [..., out/block, in/block])."""
    *lead, o, i = shape
    if o % block or i % block:
        raise ValueError(f"random_fp8_weight: the last two dims {(o, i)} must be multiples of the block {block}")
    w = jax.random.normal(key, (*lead, o // block, block, i // block, block), jnp.float32) * std
    s = jnp.maximum(jnp.max(jnp.abs(w), axis=(-3, -1), keepdims=True), 1e-12) / FP8_MAX
    return quantize_e4m3(w / s).reshape(*lead, o, i), s[..., :, 0, :, 0]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedRows:
    """x [rows, K] already quantised per 1 x 128 (``act_quant`` with ``scale_fmt``), in the layout the FP8 GEMM
    kernel reads: ``q`` e4m3 [mp, K] with zero rows past ``rows``, ``st`` float32 [K / 128, mp] (the scales
    transposed; rows past ``rows`` hold the scale of a zero block). A producer that already holds x (a norm)
    quantises it there, and every FP8 linear reading x takes it as is (``pallas_kernels.fp8_gemm.fp8_linear``),
    instead of a quantisation per linear. ``rows`` and ``scale_fmt`` are static."""

    q: jax.Array
    st: jax.Array
    rows: int = field(metadata=dict(static=True))
    scale_fmt: ScaleFmt = field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the x it stands for: [rows, K]."""
        return (self.rows, int(self.q.shape[-1]))

    def unpadded(self) -> tuple[jax.Array, jax.Array]:
        """(q [rows, K], s [rows, K / 128]): ``act_quant``'s layout."""
        return self.q[: self.rows], self.st[:, : self.rows].T


def quantize_rows_xla(x: jax.Array, mp: int, scale_fmt: ScaleFmt) -> QuantizedRows:
    """``act_quant`` of x [M, K] in ``QuantizedRows``' layout (padded to ``mp`` rows): the reference of the
    kernels that produce one."""
    m = x.shape[0]
    if x.ndim != 2 or mp < m:
        raise ValueError(f"quantize_rows_xla: x must be [M, K] with M <= mp = {mp}, got shape {x.shape}")
    q, s = act_quant(jnp.pad(x, ((0, mp - m), (0, 0))), 128, scale_fmt)
    return QuantizedRows(q=q, st=s.T, rows=m, scale_fmt=scale_fmt)


def fp8_linear(x: jax.Array | QuantizedRows, wq: jax.Array, scale: jax.Array, out_dtype: jnp.dtype,
               scale_fmt: ScaleFmt = "ue8m0") -> jax.Array:
    """DeepSeek's ``linear()`` with an FP8 weight: re-quantise x per 128 (``scale_fmt`` scales), fp32 accumulation.
    x may come quantised already (``QuantizedRows``, with the same ``scale_fmt``).

    x_deq = q*s: one float32 matmul of the dequantised operands equals the block-sum of fp8 MMAs up to
    float32 summation order (exactly so for power-of-two scales; amax/448 scales round q*s once).
    """
    if isinstance(x, QuantizedRows):
        if x.scale_fmt != scale_fmt:
            raise ValueError(f"x: quantised with scale_fmt {x.scale_fmt!r}, the linear's is {scale_fmt!r}")
        xq, sx = x.unpadded()
    else:
        xq, sx = act_quant(x, 128, scale_fmt)
    xd = dequant(xq, sx, 128)
    w = dequant_weight_blocks(wq, scale)
    y = jnp.einsum("...i,oi->...o", xd, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


# ----- packed FP4 (e2m1) weights with e8m0 block scales: DeepSeek-V4's routed experts -------------------------
FP4_WEIGHT_BLOCK = 32  # one e8m0 scale per 1x32 block along the input dim


def e8m0_to_f32(e: jax.Array) -> jax.Array:
    """float8_e8m0fnu bytes (held as uint8 exponents) -> float32 2^(e - 127), exact for e in [1, 254].

    The byte becomes the float32 exponent field (mantissa 0). e = 0 (2^-127, a float32 subnormal) gives 0, as
    XLA's flush-to-zero would anyway; e = 255 (e8m0 NaN) gives +inf: the importer refuses such bytes."""
    return jax.lax.bitcast_convert_type(e.astype(jnp.uint32) << 23, jnp.float32)


def fp4_unpack(packed: jax.Array) -> jax.Array:
    """uint8 [..., n/2] holding two e2m1 codes per byte, LOW nibble first (DeepSeek-V4 ``convert.py``; torch's
    ``float4_e2m1fn_x2``) -> float32 e2m1 values [..., n] in {0, +-0.5, 1, 1.5, 2, 3, 4, 6}.

    Decoded arithmetically (elementwise, so XLA fuses it into the consumer): code = s e1 e0 m; magnitude m/2 for
    e = 0, else (2 + m) 2^(e - 2)."""
    p = packed.astype(jnp.int32)
    codes = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
    e, m = (codes >> 1) & 3, codes & 1
    mag = jnp.where(e == 0, 0.5 * m.astype(jnp.float32), ((2 + m) << e).astype(jnp.float32) * 0.25)
    return jnp.where((codes & 8) != 0, -mag, mag)


def fp4_dequant(packed: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32,
                block: int = FP4_WEIGHT_BLOCK) -> jax.Array:
    """Packed e2m1 [..., n/2] (uint8) with e8m0 exponents [..., n/block] (uint8) -> W [..., n] in ``dtype``.

    Exact in bfloat16 as well as float32: an e2m1 value has 2 significant bits and the scale is a power of two."""
    vals = fp4_unpack(packed)
    n = vals.shape[-1]
    if scale.shape[-1] * block != n or scale.shape[:-1] != vals.shape[:-1]:
        raise ValueError(f"fp4_dequant: scale shape {scale.shape} does not match {n} values per row in blocks of "
                         f"{block} (packed shape {packed.shape})")
    w = vals.reshape(vals.shape[:-1] + (n // block, block)) * e8m0_to_f32(scale)[..., None]
    return w.reshape(vals.shape).astype(dtype)


def random_fp4_weight(key: jax.Array, shape: tuple[int, ...], std: float,
                      block: int = FP4_WEIGHT_BLOCK) -> tuple[jax.Array, jax.Array]:
    """A random weight on the FP4 grid: (packed uint8 [..., n/2], e8m0 exponents uint8 [..., n/block]).

    Codes are uniform over the 16 e2m1 codes (RMS value sqrt(68.5 / 8) ~ 2.93); each block's scale is a random
    factor 2^{-1, 0, 1} (mean square 1.75, so blocks differ and the scale indexing matters) times the power of two
    nearest std / (2.93 sqrt(1.75)): an RMS within a factor sqrt(2) of ``std``."""
    *lead, n = shape
    if n % block:
        raise ValueError(f"random_fp4_weight: last dim {n} is not a multiple of the FP4 block {block}")
    base = int(round(math.log2(std / math.sqrt(68.5 / 8 * 1.75))))
    if not 2 <= base + 127 <= 253:
        raise ValueError(f"random_fp4_weight: std {std} is outside the e8m0 scale range")
    # one draw (one compiled threefry per shape): two uniform codes a byte, then one byte per block whose
    # value mod 3 (0, 1, 2 in the ratio 86 : 85 : 85) is the scale's jitter
    bits = jax.random.bits(key, (*lead, n // 2 + n // block), jnp.uint8)
    packed, jitter = bits[..., : n // 2], bits[..., n // 2:] % 3
    return packed, (base + 126 + jitter).astype(jnp.uint8)
