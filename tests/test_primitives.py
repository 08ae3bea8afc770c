"""CPU checks of the shared primitives in jds/ops against independent references (a few seconds).

Every output element is compared. References are written here, not imported from jds: float64
numpy for the arithmetic, torch's float8_e4m3fn / bfloat16 casts for the rounding (compared as
raw bytes), torch.frexp for UE8M0 scales, and the byte layouts of the spec (V3.2 §7.2/§7.3,
V4 §4) spelled out by hand. Inputs are freshly drawn per test from fixed seeds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from jds.config import RopeConfig, V32Config
from jds.ops.hadamard import hadamard_matrix, hadamard_rotate
from jds.ops.indexer import index_scores, prepare_indexer_q, topk_visible
from jds.ops.norms import layer_norm, rms_norm
from jds.ops.paging import empty_cache, gather_request_rows, global_slots, read_records, write_records
from jds.ops.quant import (
    act_quant,
    dequant,
    dequant_weight_blocks,
    fake_quant,
    fp8_linear,
    quantize_weight_blocks,
    ue8m0_ceil,
)
from jds.ops.records import FloatRows, IndexerRecord132, MlaRecord584, MlaRecord656
from jds.ops.rope import apply_rope, rope_cos_sin, rope_inv_freqs, rope_part
from jds.ops.sparse_mqa import sparse_mqa
from tests.tolerances import assert_rounded_from

F32_TINY = float(np.finfo(np.float32).tiny)
# jitted entry points (one compile per call site instead of one per eager op: keeps the file fast)
write_j = jax.jit(write_records, static_argnums=1)
read_j = jax.jit(read_records, static_argnums=1)
slots_j = jax.jit(global_slots, static_argnums=3)
gather_j = jax.jit(gather_request_rows, static_argnums=(1, 3))
INV448 = np.float32(1.0 / 448.0)


# ------------------------------------------------------------------------------------------
# independent references
# ------------------------------------------------------------------------------------------


def np_(a) -> np.ndarray:
    return np.asarray(a)


def e4m3_bits(y: np.ndarray) -> np.ndarray:
    """torch's float8_e4m3fn cast (RNE) of float32 values already in [-448, 448], as raw bytes."""
    return torch.from_numpy(np.array(y, np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def bits(a) -> np.ndarray:
    """Raw bytes of a jax/ml_dtypes float8 array."""
    return np_(a).view(np.uint8)


def bf16_round(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.array(x, np.float32)).to(torch.bfloat16).float().numpy()


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.array(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def ref_scale(amax: np.ndarray, fmt: str, floor: float) -> np.ndarray:
    """[R] act_quant scale: a = max(amax, floor); v = a * fp32(1/448); ue8m0 -> 2^ceil(log2 v) via frexp."""
    a = torch.clamp_min(torch.from_numpy(np.array(amax, np.float32)), floor)
    v = a * torch.tensor(1.0 / 448.0, dtype=torch.float32)
    if fmt == "ue8m0":
        m, e = torch.frexp(v)  # v = m * 2^e, m in [0.5, 1)
        e = torch.where(m == 0.5, e - 1, e)  # exact power of two: ceil(log2 v) = e - 1
        v = torch.from_numpy(np.ldexp(np.float32(1.0), e.numpy()).astype(np.float32))
    # jds keeps scales normal (XLA flushes subnormals; a 0 scale would give 0/0 = NaN): only bites when
    # the floor is below 448 * FLT_MIN
    return torch.clamp_min(v, F32_TINY).numpy()


def ref_act_quant(x: np.ndarray, block: int, fmt: str, floor: float) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 bytes, scales) of x quantised along the last axis per ``block``.

    float32 subnormal inputs read as (signed) zero: XLA on CPU/GPU flushes them (denormals-are-zero).
    """
    x = np.where(np.abs(x) < F32_TINY, np.copysign(np.float32(0), x), x)
    xb = x.astype(np.float32).reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    s = ref_scale(np.abs(xb).max(-1), fmt, floor)
    y = torch.clamp(torch.from_numpy(xb) / torch.from_numpy(s)[..., None], -448.0, 448.0).numpy()
    return e4m3_bits(y).reshape(x.shape), s


def e4m3_values(b: np.ndarray) -> np.ndarray:
    return b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def exact_ue8m0(amax: np.ndarray) -> np.ndarray:
    """Smallest 2^k with 448 * 2^k >= amax, by exact comparisons (spec V4 §4: 2^ceil(log2(amax/448)))."""
    out = np.empty(amax.shape, np.float64)
    for i, a in np.ndenumerate(amax.astype(np.float64)):
        k = math.ceil(math.log2(a / 448.0))
        while 448.0 * 2.0 ** k < a:
            k += 1
        while 448.0 * 2.0 ** (k - 1) >= a:
            k -= 1
        out[i] = 2.0 ** k
    return out.astype(np.float32)


def magnitudes(rng: np.random.Generator, shape: tuple[int, ...], block: int, lo: float = -6, hi: float = 6) -> np.ndarray:
    """Normal data whose every ``block`` along the last axis has its own magnitude 10^U(lo, hi)."""
    x = rng.standard_normal(shape)
    mag = 10.0 ** rng.uniform(lo, hi, shape[:-1] + (shape[-1] // block, 1))
    return (x.reshape(shape[:-1] + (shape[-1] // block, block)) * mag).reshape(shape).astype(np.float32)


def e4m3_grid() -> np.ndarray:
    """All finite non-negative e4m3 values, ascending."""
    v = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.unique(v[np.isfinite(v) & (v >= 0)])


def edge_blocks(block: int = 128) -> np.ndarray:
    """Blocks of edge inputs (see test_act_quant_edges)."""
    rng = np.random.default_rng(11)
    out = []
    out.append(np.zeros(block))  # floor 1e-4
    z = np.zeros(block)
    z[1::2] = -0.0
    out.append(z)  # signed zeros
    out.append(rng.standard_normal(block) * 1e-7)  # below the floor
    out.append(rng.standard_normal(block) * 1e-41)  # float32 subnormal inputs
    sub = (np.arange(block) - block // 2) * 2.0 ** -10  # e4m3 subnormal grid points, midpoints, below min
    sub[0] = 256.0  # ue8m0 scale 1 -> x/s = x exactly
    out.append(sub)
    sub2 = rng.standard_normal(block) * 2.0 ** -8
    sub2[0] = -300.0
    out.append(sub2)
    g = e4m3_grid()
    mid = (g[:-1].astype(np.float64) + g[1:]) / 2  # every RNE tie of the format (largest 432)
    for sign in (1.0, -1.0):
        t = np.resize(mid, block) * sign
        t[-1] = 1.0
        out.append(t)  # amax 432 -> ue8m0 scale 1: exact ties
    for _ in range(3):  # x / s exactly an RNE tie with a non-power-of-two amax scale (true division)
        a = np.float32(rng.uniform(100.0, 400.0))
        s = np.float64(a * INV448)
        t = rng.choice(mid[mid < a / s], block) * rng.choice([-1.0, 1.0], block)
        t = (t * s).astype(np.float32)
        t[0] = a
        out.append(t)
    big = rng.standard_normal(block) * 1e3
    big[:6] = [449.0, -448.5, 1e4, -3e5, 1e30, -3e38]  # beyond 448, up to near FLT_MAX
    out.append(big)
    out.append(-np.abs(rng.standard_normal(block)) * 7.0)  # all negative
    p2 = np.ldexp(1.0, rng.integers(-20, 20, block)) * rng.choice([-1.0, 1.0], block)
    out.append(p2)  # exact powers of two
    for k in (-3, 0, 5):  # amax exactly 448*2^k, and its float32 neighbours (scale boundary)
        for a in (np.float32(448.0 * 2.0 ** k),
                  np.nextafter(np.float32(448.0 * 2.0 ** k), np.float32(np.inf)),
                  np.nextafter(np.float32(448.0 * 2.0 ** k), np.float32(0))):
            b = rng.standard_normal(block)
            b[3] = -a
            out.append(b)
    a = np.float32(448.0)  # an amax whose fp32 product with fp32(1/448) is exactly a power of two
    while float(a * INV448) != 1.0:
        a = np.nextafter(a, np.float32(np.inf))
    b = rng.standard_normal(block)
    b[7] = a
    out.append(b)
    return np.stack(out).astype(np.float32)


# ------------------------------------------------------------------------------------------
# quant
# ------------------------------------------------------------------------------------------


def test_ue8m0_ceil_powers_of_two() -> None:
    k = np.arange(-30, 30)
    p = np.ldexp(np.float32(1.0), k).astype(np.float32)
    up = np.nextafter(p, np.float32(np.inf))
    down = np.nextafter(p, np.float32(0))
    np.testing.assert_array_equal(np_(ue8m0_ceil(jnp.asarray(p))), p)
    np.testing.assert_array_equal(np_(ue8m0_ceil(jnp.asarray(up))), 2 * p)
    np.testing.assert_array_equal(np_(ue8m0_ceil(jnp.asarray(down))), p)


@pytest.mark.parametrize("fmt", ["ue8m0", "amax"])
@pytest.mark.parametrize("block", [128, 64])
def test_act_quant_random_bitexact(fmt: str, block: int) -> None:
    rng = np.random.default_rng(100 + block + (fmt == "amax"))
    x = magnitudes(rng, (3, 5, 512), block)
    x[0, 0] *= rng.standard_t(1.5, 512).astype(np.float32)  # heavy tails
    q, s = act_quant(jnp.asarray(x), block, fmt, 1e-4)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == jnp.float32 and s.shape == (3, 5, 512 // block)
    qb, sb = ref_act_quant(x, block, fmt, 1e-4)
    np.testing.assert_array_equal(bits(q), qb)
    np.testing.assert_array_equal(np_(s).view(np.uint32), sb.view(np.uint32))


@pytest.mark.parametrize("fmt,floor", [("ue8m0", 1e-4), ("amax", 1e-4), ("amax", F32_TINY)])
def test_act_quant_edges(fmt: str, floor: float) -> None:
    x = edge_blocks()
    q, s = act_quant(jnp.asarray(x), 128, fmt, floor)
    qb, sb = ref_act_quant(x, 128, fmt, floor)
    np.testing.assert_array_equal(bits(q), qb)
    np.testing.assert_array_equal(np_(s).view(np.uint32), sb.view(np.uint32))
    qj, sj = jax.jit(act_quant, static_argnums=(1, 2, 3))(jnp.asarray(x), 128, fmt, floor)  # as inside a layer
    np.testing.assert_array_equal(bits(qj), qb)
    np.testing.assert_array_equal(np_(sj).view(np.uint32), sb.view(np.uint32))
    if fmt == "ue8m0":
        assert float(s[0, 0]) == 2.0 ** -22  # zeros: 1e-4 * fp32(1/448) = 2.2e-7 -> 2^-22
        assert np.all(np.abs(e4m3_values(bits(q))) <= 448)
        assert bits(q)[1, 1] == 0x80 and bits(q)[1, 0] == 0x00  # -0.0 and +0.0 keep their sign bit
        np.testing.assert_array_equal(np_(s)[4:8, 0], 1.0)  # the exact-grid / tie blocks have scale 1


def test_dequant_and_fake_quant() -> None:
    rng = np.random.default_rng(3)
    x = magnitudes(rng, (4, 384), 128, -3, 3)
    for fmt in ("ue8m0", "amax"):
        q, s = act_quant(jnp.asarray(x), 128, fmt)
        expect = (e4m3_values(bits(q)).reshape(4, 3, 128) * np_(s)[..., None]).reshape(4, 384)  # f32 product
        np.testing.assert_array_equal(np_(dequant(q, s, 128)), expect)
        np.testing.assert_array_equal(np_(fake_quant(jnp.asarray(x), 128, fmt)), expect)
    with pytest.raises(ValueError, match="multiple"):
        act_quant(jnp.zeros((2, 100)), 128)


def test_quantize_weight_blocks_roundtrip() -> None:
    rng = np.random.default_rng(4)
    w = magnitudes(rng, (200, 384), 128, -4, 2)
    w[:, 300:] = rng.standard_normal((200, 84)).astype(np.float32) * 1e-3
    w[150:, :128] = 0.0  # an all-zero block: floor scale
    w = w[:, :300]  # in not a multiple of 128: ragged last block column
    wq, s = quantize_weight_blocks(w)
    assert wq.dtype == ml_dtypes.float8_e4m3fn and wq.shape == (200, 300)
    assert s.dtype == np.float32 and s.shape == (2, 3)
    # scales: max(amax, 1e-4) / 448 per 128x128 block (ragged edge blocks included)
    for i in range(2):
        for j in range(3):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert s[i, j] == np.float32(max(np.float32(np.abs(blk).max()), np.float32(1e-4))) / np.float32(448.0)
    srep = np.repeat(np.repeat(s, 128, 0), 128, 1)[:200, :300]
    np.testing.assert_array_equal(wq.view(np.uint8), e4m3_bits(np.clip(w / srep, -448, 448)))
    deq = np_(dequant_weight_blocks(jnp.asarray(wq), jnp.asarray(s)))
    np.testing.assert_array_equal(deq, wq.astype(np.float32) * srep)
    # e4m3 has 3 mantissa bits: |err| <= 2^-4 |w| in the normal range, <= 2^-10 s below it (+ clamp slack)
    err = np.abs(deq.astype(np.float64) - w)
    bound = np.maximum(2.0 ** -4 * np.abs(w.astype(np.float64)), 2.0 ** -10 * srep) * (1 + 1e-6)
    assert np.all(err <= bound)
    assert np.all(np.abs(wq.astype(np.float32)) <= 448)


def test_fp8_linear_matches_block_sum() -> None:
    rng = np.random.default_rng(5)
    x = magnitudes(rng, (3, 5, 384), 128, -2, 2)
    w = (rng.standard_normal((200, 384)) * 384 ** -0.5).astype(np.float32)
    w[:, 128:256] *= 30.0  # blocks of different weight scales
    wq, s = quantize_weight_blocks(w)
    y = np_(fp8_linear(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(s), jnp.float32))
    assert y.shape == (3, 5, 200) and y.dtype == np.float32
    # DeepSeek: y = sum_kb sx[m, kb] * S_W[n // 128, kb] * (xq[m, kb-block] . Wq[n, kb-block]), in float64
    xqb, sx = ref_act_quant(x, 128, "ue8m0", 1e-4)
    xq = e4m3_values(xqb).astype(np.float64).reshape(15, 3, 128)
    wq64 = wq.astype(np.float64).reshape(200, 3, 128)
    sw = np.repeat(s.astype(np.float64), 128, axis=0)[:200]  # [n, kb]
    sx = sx.astype(np.float64).reshape(15, 3)
    part = np.einsum("mkb,nkb->mnk", xq, wq64)
    ref = np.einsum("mk,nk,mnk->mn", sx, sw, part).reshape(3, 5, 200)
    absb = np.einsum("mk,nk,mnk->mn", sx, sw, np.einsum("mkb,nkb->mnk", np.abs(xq), np.abs(wq64))).reshape(3, 5, 200)
    assert np.all(np.abs(y - ref) <= 1e-5 * absb)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    yb = np_(fp8_linear(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(s), jnp.bfloat16)).astype(np.float32)
    assert np.all(np.abs(yb - ref) <= 2.0 ** -8 * np.abs(ref) + 1e-5 * absb)


# ------------------------------------------------------------------------------------------
# rope
# ------------------------------------------------------------------------------------------


def test_rope_inv_freqs_v32_yarn_constants() -> None:
    cfg = V32Config().rope
    assert cfg.yarn and cfg.factor == 40.0 and cfg.theta == 10000.0
    f = rope_inv_freqs(cfg, 64)
    assert f.dtype == np.float32 and f.shape == (32,)
    plain = rope_inv_freqs(RopeConfig(theta=10000.0), 64)
    i = np.arange(32)
    np.testing.assert_allclose(plain, 10000.0 ** (-2.0 * i / 64), rtol=3e-7, atol=0)  # f_i = theta^(-2i/64)
    # spec §1: correction range for dim 64 is low = floor(10.47) = 10, high = ceil(22.51) = 23
    corr = [64 * math.log(4096 / (b * 2 * math.pi)) / (2 * math.log(10000.0)) for b in (32.0, 1.0)]
    assert abs(corr[0] - 10.47) < 5e-3 and abs(corr[1] - 22.51) < 5e-3
    low, high = 10, 23
    np.testing.assert_array_equal(f[: low + 1], plain[: low + 1])  # i <= 10 unchanged
    np.testing.assert_array_equal(f[high:], plain[high:] / np.float32(40.0))  # i >= 23 divided by 40
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    expect = plain.astype(np.float64) / 40.0 * ramp + plain.astype(np.float64) * (1.0 - ramp)
    np.testing.assert_allclose(f, expect, rtol=1e-6, atol=0)
    mid = slice(low + 1, high)
    assert np.all(f[mid] < plain[mid]) and np.all(f[mid] > plain[mid] / 40.0)


def rope_reference(x: np.ndarray, pos: np.ndarray, f: np.ndarray, interleaved: bool, inverse: bool = False) -> np.ndarray:
    """Complex multiplication in float64 by cis(fp32(p) * f_i) (the angle is formed in float32, spec §3)."""
    ang = (pos.astype(np.float32)[:, None] * f[None, :]).astype(np.float64)  # [T, d/2]
    z = np.exp(1j * ang * (-1.0 if inverse else 1.0))[:, None, :]  # broadcast over heads
    x = x.astype(np.float64)
    if interleaved:
        c = (x[..., 0::2] + 1j * x[..., 1::2]) * z
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = c.real, c.imag
        return out
    h = x.shape[-1] // 2
    c = (x[..., :h] + 1j * x[..., h:]) * z
    return np.concatenate([c.real, c.imag], axis=-1)


@pytest.mark.parametrize("interleaved", [True, False])
def test_apply_rope_equals_complex_multiplication(interleaved: bool) -> None:
    rng = np.random.default_rng(6 + interleaved)
    f = rope_inv_freqs(V32Config().rope, 64)
    pos = np.concatenate([[0, 1, 4095, 4096, 163839], rng.integers(0, 163840, 11)]).astype(np.int32)
    x = rng.standard_normal((16, 3, 64)).astype(np.float32)
    cos, sin = rope_cos_sin(f, jnp.asarray(pos))
    ang = pos.astype(np.float32)[:, None] * f[None, :]
    np.testing.assert_allclose(np_(cos), np.cos(ang.astype(np.float64)), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np_(sin), np.sin(ang.astype(np.float64)), rtol=0, atol=1e-6)
    y = np_(apply_rope(jnp.asarray(x), cos, sin, interleaved=interleaved))
    assert y.dtype == np.float32
    tol = 1e-6 * np.abs(x).max()
    np.testing.assert_allclose(y, rope_reference(x, pos, f, interleaved), rtol=0, atol=tol)
    yi = np_(apply_rope(jnp.asarray(x), cos, sin, interleaved=interleaved, inverse=True))
    np.testing.assert_allclose(yi, rope_reference(x, pos, f, interleaved, inverse=True), rtol=0, atol=tol)
    back = np_(apply_rope(jnp.asarray(y), cos, sin, interleaved=interleaved, inverse=True))
    np.testing.assert_allclose(back, x, rtol=0, atol=tol)  # inverse undoes forward
    # bf16 in -> float32 math, one rounding to bf16
    xb = jnp.asarray(x, jnp.bfloat16)
    yb = apply_rope(xb, cos, sin, interleaved=interleaved)
    assert yb.dtype == jnp.bfloat16
    # one rounding of the float32 result; the two calls are separate XLA programs whose float32 values may
    # differ in the last bit (FMA contraction), which can move a bf16 rounding only at a rounding boundary
    assert_rounded_from(yb, np_(apply_rope(xb.astype(jnp.float32), cos, sin, interleaved=interleaved)), "bfloat16",
                        "bf16 rope")


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_part_touches_only_rope_dims(first: bool, interleaved: bool) -> None:
    rng = np.random.default_rng(8 + 2 * first + interleaved)
    f = rope_inv_freqs(V32Config().rope, 64)
    pos = rng.integers(0, 163840, 10).astype(np.int32)
    x = rng.standard_normal((10, 4, 192)).astype(np.float32)
    cos, sin = rope_cos_sin(f, jnp.asarray(pos))
    y = np_(rope_part(jnp.asarray(x), cos, sin, rope_dim=64, first=first, interleaved=interleaved))
    rope_sl, rest = (slice(0, 64), slice(64, None)) if first else (slice(128, None), slice(0, 128))
    np.testing.assert_array_equal(y[..., rest].view(np.uint32), x[..., rest].view(np.uint32))
    np.testing.assert_array_equal(y[..., rope_sl],
                                  np_(apply_rope(jnp.asarray(x[..., rope_sl]), cos, sin, interleaved=interleaved)))
    np.testing.assert_allclose(y[..., rope_sl], rope_reference(x[..., rope_sl], pos, f, interleaved),
                               rtol=0, atol=1e-6 * np.abs(x).max())
    back = np_(rope_part(jnp.asarray(y), cos, sin, rope_dim=64, first=first, interleaved=interleaved, inverse=True))
    np.testing.assert_array_equal(back[..., rest].view(np.uint32), x[..., rest].view(np.uint32))
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-6 * np.abs(x).max())


@pytest.mark.parametrize("in_place", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("first", [True, False])
def test_rope_part_then_matmul_under_jit(first: bool, in_place: bool) -> None:
    """rope_part feeding a matmul, compiled, equals the eager result within float32 rounding. Written as an
    in-place update of the rotated columns over x's, XLA's CPU backend (jax 0.11.2) computed this wrongly (errors
    of order 1: docs/perf-log.md, sixty-sixth session), so rope_part builds a new row unless asked for
    ``in_place`` (GPU only: checked here natively)."""
    if in_place and jax.default_backend() != "gpu":
        pytest.skip("in_place is the GPU's form")
    rng = np.random.default_rng(12 + first)
    x = jnp.asarray(rng.standard_normal((1, 4, 128)), jnp.float32)
    cos, sin = rope_cos_sin(rope_inv_freqs(V32Config().rope, 64), jnp.asarray([20], jnp.int32))
    m = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)

    def f(x, cos, sin):
        y = rope_part(x, cos, sin, rope_dim=64, first=first, interleaved=False, in_place=in_place)
        return jnp.einsum("...i,ij->...j", y, m, precision=jax.lax.Precision.HIGHEST)

    want = np_(f(x, cos, sin))
    np.testing.assert_allclose(np_(jax.jit(f)(x, cos, sin)), want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("first,interleaved,inverse", [(True, False, False), (False, True, True)])
def test_rope_part_in_place_same_values(first: bool, interleaved: bool, inverse: bool) -> None:
    """The in-place form (a dynamic-update-slice of the rotated dims) and the concatenation give the same bits,
    eagerly (the same ops on the same values)."""
    rng = np.random.default_rng(31)
    x = jnp.asarray(rng.standard_normal((3, 2, 96)), jnp.bfloat16)
    cos, sin = rope_cos_sin(rope_inv_freqs(V32Config().rope, 32), jnp.asarray([5, 70, 900], jnp.int32))
    kw = dict(rope_dim=32, first=first, interleaved=interleaved, inverse=inverse)
    np.testing.assert_array_equal(np_(rope_part(x, cos, sin, in_place=True, **kw)), np_(rope_part(x, cos, sin, **kw)))


# ------------------------------------------------------------------------------------------
# norms, hadamard
# ------------------------------------------------------------------------------------------


def norm_inputs(rng: np.random.Generator, d: int) -> np.ndarray:
    x = rng.standard_normal((12, d)) * 10.0 ** rng.uniform(-4, 3, (12, 1))  # eps matters in the 1e-4 rows
    x[0] = 0.0
    x[1] = 3.0  # constant row
    return x.astype(np.float32)


def test_rms_norm_vs_float64() -> None:
    rng = np.random.default_rng(9)
    x = norm_inputs(rng, 512)
    w = (1 + 0.1 * rng.standard_normal(512)).astype(np.float32)
    x64 = x.astype(np.float64)
    base = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-6)
    for weight, ref in ((w, base * w), (None, base)):
        y = np_(rms_norm(jnp.asarray(x), None if weight is None else jnp.asarray(weight), 1e-6))
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, ref, rtol=2e-6, atol=1e-6 * np.abs(ref).max())
    yb = rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6, jnp.bfloat16)
    assert yb.dtype == jnp.bfloat16
    # one rounding of the float32 norm (up to a last-bit difference of the f32 value between the two programs)
    assert_rounded_from(yb, np_(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), "bfloat16", "bf16 rms_norm")
    np.testing.assert_allclose(np_(yb).astype(np.float32), base * w, rtol=2.0 ** -8, atol=1e-30)


def test_layer_norm_vs_float64() -> None:
    rng = np.random.default_rng(10)
    x = norm_inputs(rng, 128)
    x[2] = 50.0 + rng.standard_normal(128)  # large mean
    w = (1 + 0.1 * rng.standard_normal(128)).astype(np.float32)
    b = (0.1 * rng.standard_normal(128)).astype(np.float32)
    x64 = x.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * w + b
    y = np_(layer_norm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), 1e-6))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_array_equal(y[1], b)  # zero variance -> bias exactly


def sylvester(n: int) -> np.ndarray:
    """scipy.linalg.hadamard(n): H[i, j] = (-1)^popcount(i & j)."""
    i = np.arange(n)
    return np.where(np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :]) == 1, -1.0, 1.0)


def test_hadamard_matrix() -> None:
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        h = hadamard_matrix(n)
        np.testing.assert_array_equal(h, sylvester(n))
        np.testing.assert_array_equal(h, h.T)
        np.testing.assert_array_equal(h.astype(np.float64) @ h.T, n * np.eye(n))  # H/sqrt(n) is orthonormal
    for n in (0, 3, 96, 129):
        with pytest.raises(ValueError, match="power of two"):
            hadamard_matrix(n)


def test_hadamard_rotate() -> None:
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((5, 3, 128)) * 10.0 ** rng.uniform(-2, 2, (5, 3, 1))).astype(np.float32)
    ref = x.astype(np.float64) @ sylvester(128) / math.sqrt(128)
    y = np_(hadamard_rotate(jnp.asarray(x)))
    assert y.dtype == np.float32 and y.shape == x.shape
    scale = np.abs(x).max(-1, keepdims=True)
    assert np.all(np.abs(y - ref) <= 1e-6 * scale)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x.astype(np.float64), axis=-1), rtol=1e-6)
    assert np.all(np.abs(np_(hadamard_rotate(jnp.asarray(y))) - x) <= 2e-6 * scale)  # self-inverse
    xb = jnp.asarray(x, jnp.bfloat16)
    yb = hadamard_rotate(xb)
    assert yb.dtype == jnp.bfloat16
    # one rounding of the float32 rotation; its 128-term dot may accumulate in another order in the other
    # program (a few float32 ulps), which can move a bf16 rounding only at a rounding boundary
    assert_rounded_from(yb, np_(hadamard_rotate(xb.astype(jnp.float32))), "bfloat16", "bf16 hadamard", n_high=4)


# ------------------------------------------------------------------------------------------
# records and paging
# ------------------------------------------------------------------------------------------


def latent_rows(rng: np.random.Generator, n: int, d: int, block: int) -> np.ndarray:
    x = magnitudes(rng, (n, d), block, -4, 3)
    x[0, :block] = 0.0  # an all-zero block
    x[1, :block] *= 1e-6  # below the 1e-4 floor
    x[2, block:2 * block] = 0.0
    x[2, (block + 3) % d] = -500.0
    return x


def ref_mla656(rows: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(latent e4m3 bytes, scales, rope bf16 bits) as the spec defines the 656-byte record."""
    lat = rows[:, :512].reshape(-1, 4, 128)
    amax = np.abs(lat).max(-1)
    if fmt == "ue8m0":  # [R-fix]: act_quant ue8m0, floor 1e-4
        s = ref_scale(amax, "ue8m0", 1e-4)
    else:  # vLLM concat_and_cache_ds_mla (spec §7.3): scale = max(amax / 448, FLT_MIN)
        s = torch.clamp_min(torch.from_numpy(amax) / 448.0, F32_TINY).numpy()
    y = torch.clamp(torch.from_numpy(lat) / torch.from_numpy(s)[..., None], -448, 448).numpy()
    return e4m3_bits(y).reshape(-1, 512), s, bf16_bits(rows[:, 512:])


@pytest.mark.parametrize("fmt", ["ue8m0", "amax"])
def test_mla_record_656(fmt: str) -> None:
    rng = np.random.default_rng(13 + (fmt == "amax"))
    rows = np.concatenate([latent_rows(rng, 24, 512, 128), rng.standard_normal((24, 64)).astype(np.float32)], -1)
    rec = MlaRecord656(16, fmt)
    assert rec.record_bytes == 656 and rec.page_elems == 16 * 656
    b = np_(jax.jit(rec.pack)(jnp.asarray(rows)))
    assert b.dtype == np.uint8 and b.shape == (24, 656)
    qb, s, pe = ref_mla656(rows, fmt)
    np.testing.assert_array_equal(b[:, :512], qb)
    scales = np.frombuffer(np.ascontiguousarray(b[:, 512:528]).tobytes(), "<f4").reshape(24, 4)
    np.testing.assert_array_equal(scales.view(np.uint32), s.view(np.uint32))
    rope = np.frombuffer(np.ascontiguousarray(b[:, 528:656]).tobytes(), "<u2").reshape(24, 64)
    np.testing.assert_array_equal(rope, pe)
    if fmt == "amax":
        assert scales[0, 0] == np.float32(F32_TINY)  # zero tile: the FLT_MIN floor, not a subnormal
    out = np_(jax.jit(rec.unpack)(jnp.asarray(b)))
    expect_lat = (e4m3_values(qb).reshape(24, 4, 128) * s[..., None]).reshape(24, 512)
    np.testing.assert_array_equal(out[:, :512], expect_lat)
    np.testing.assert_array_equal(out[:, 512:], bf16_round(rows[:, 512:]))
    # bf16 rows (what the layer writes under bf16 numerics) pack like their float32 values
    rb = bf16_round(rows)
    np.testing.assert_array_equal(np_(rec.pack(jnp.asarray(rb, jnp.bfloat16))), np_(rec.pack(jnp.asarray(rb))))


def test_indexer_record_132() -> None:
    rng = np.random.default_rng(15)
    rows = latent_rows(rng, 20, 128, 128)
    rec = IndexerRecord132(8)
    assert rec.page_elems == 8 * 132
    b = np_(jax.jit(rec.pack)(jnp.asarray(rows)))
    qb, s = ref_act_quant(rows, 128, "ue8m0", 1e-4)
    np.testing.assert_array_equal(b[:, :128], qb)
    np.testing.assert_array_equal(np.frombuffer(np.ascontiguousarray(b[:, 128:]).tobytes(), "<f4"), s[:, 0])
    np.testing.assert_array_equal(np_(jax.jit(rec.unpack)(jnp.asarray(b))), e4m3_values(qb) * s)


def test_mla_record_584() -> None:
    rng = np.random.default_rng(16)
    rows = np.concatenate([latent_rows(rng, 20, 448, 64), rng.standard_normal((20, 64)).astype(np.float32)], -1)
    rows[3, 64:128] = 0.0
    rows[3, 64] = 448.0 * 2.0 ** -3  # amax exactly 448 * 2^k
    rows[4, :64] *= 1e12
    rec = MlaRecord584(16)
    assert rec.data_bytes == 576 and rec.scale_bytes == 8 and rec.page_elems == 16 * 584
    b = np_(jax.jit(rec.pack)(jnp.asarray(rows)))
    assert b.shape == (20, 584) and b.dtype == np.uint8
    nope = bf16_round(rows[:, :448]).reshape(20, 7, 64)  # fp32 -> bf16 -> fp32 before the amax
    s = exact_ue8m0(np.maximum(np.abs(nope).max(-1), np.float32(1e-4)))
    assert s[3, 1] == 2.0 ** -3
    qb = e4m3_bits(np.clip(nope / s[..., None], -448, 448)).reshape(20, 448)
    np.testing.assert_array_equal(b[:, :448], qb)
    np.testing.assert_array_equal(np.frombuffer(np.ascontiguousarray(b[:, 448:576]).tobytes(), "<u2").reshape(20, 64),
                                  bf16_bits(rows[:, 448:]))
    np.testing.assert_array_equal(b[:, 576:583].astype(np.int64), np.log2(s).astype(np.int64) + 127)
    np.testing.assert_array_equal(b[:, 583], 0)
    out = np_(jax.jit(rec.unpack)(jnp.asarray(b)))
    np.testing.assert_array_equal(out[:, :448], (e4m3_values(qb).reshape(20, 7, 64) * s[..., None]).reshape(20, 448))
    np.testing.assert_array_equal(out[:, 448:], bf16_round(rows[:, 448:]))


def test_float_rows() -> None:
    rng = np.random.default_rng(17)
    rows = rng.standard_normal((6, 576)).astype(np.float32)
    for dt in (jnp.float32, jnp.bfloat16):
        rec = FloatRows(576, 16, dt)
        assert rec.page_elems == 16 * 576
        p = rec.pack(jnp.asarray(rows))
        assert p.dtype == dt
        expect = rows if dt == jnp.float32 else bf16_round(rows)
        np.testing.assert_array_equal(np_(rec.unpack(p)), expect)


def record_locations(kind: str, bs: int, slot: int) -> list[tuple[int, int]]:
    """(start, length) byte/element ranges of a slot's record in the flattened cache, from the spec layouts."""
    page, j = divmod(slot, bs)
    if kind == "rows":
        return [(slot * 40, 40)]
    if kind == "656":
        return [(slot * 656, 656)]
    if kind == "132":  # [bs x 128 values][bs x 4 scale bytes] per page
        base = page * bs * 132
        return [(base + j * 128, 128), (base + bs * 128 + 4 * j, 4)]
    base = page * bs * 584  # "584": [bs x 576 data][bs x 8 scale bytes] per page
    return [(base + j * 576, 576), (base + bs * 576 + 8 * j, 8)]


@pytest.mark.parametrize("kind", ["rows", "656", "132", "584"])
def test_write_read_records_shuffled_slots(kind: str) -> None:
    rng = np.random.default_rng(18 + len(kind))
    bs, nb = 8, 5
    fmt, dim = {"rows": (FloatRows(40, bs, jnp.float32), 40), "656": (MlaRecord656(bs), 576),
                "132": (IndexerRecord132(bs), 128), "584": (MlaRecord584(bs), 512)}[kind]
    real = rng.permutation(nb * bs)[:17]
    slots = np.concatenate([real, [-1, -1, -1]]).astype(np.int32)
    order = rng.permutation(len(slots))
    slots = slots[order]
    rows = (rng.standard_normal((len(slots), dim)) * 3).astype(np.float32)
    if kind == "rows":
        cache = rng.standard_normal((nb, fmt.page_elems)).astype(np.float32)
    else:
        cache = rng.integers(0, 256, (nb, fmt.page_elems), dtype=np.uint8)
    assert empty_cache(fmt, nb).shape == cache.shape and empty_cache(fmt, nb).dtype == cache.dtype
    packed = np_(jax.jit(fmt.pack)(jnp.asarray(rows)))
    expect = cache.reshape(-1).copy()
    for n, sl in enumerate(slots):
        if sl < 0:
            continue
        pos = 0
        for start, length in record_locations(kind, bs, int(sl)):
            expect[start:start + length] = packed[n, pos:pos + length]
            pos += length
    new = np_(write_j(jnp.asarray(cache), fmt, jnp.asarray(slots), jnp.asarray(rows)))
    assert new.shape == cache.shape
    np.testing.assert_array_equal(new.reshape(-1), expect)  # -1 rows wrote nothing; other slots untouched
    got = np_(read_j(jnp.asarray(new), fmt, jnp.asarray(slots)))
    ok = slots >= 0
    np.testing.assert_array_equal(got[ok], np_(jax.jit(fmt.unpack)(jnp.asarray(packed)))[ok])
    # reading through a [T, K] slot array keeps the shape
    got2 = np_(read_j(jnp.asarray(new), fmt, jnp.asarray(np.where(ok, slots, 0).reshape(4, 5))))
    np.testing.assert_array_equal(got2.reshape(20, -1)[ok], got[ok])


def test_global_slots_and_request_gather() -> None:
    rng = np.random.default_rng(19)
    nb, r, mb = 12, 3, 4
    for epp in (16, 4, 1):
        bt = rng.permutation(nb)[: r * mb].reshape(r, mb).astype(np.int32)
        req = rng.integers(0, r, 7).astype(np.int32)
        local = rng.integers(-1, mb * epp, (7, 5)).astype(np.int32)
        local[0, 0] = -1
        got = np_(slots_j(jnp.asarray(bt), jnp.asarray(req), jnp.asarray(local), epp))
        expect = np.full(local.shape, -1, np.int64)
        for t in range(7):
            for k in range(5):
                if local[t, k] >= 0:
                    expect[t, k] = bt[req[t], local[t, k] // epp] * epp + local[t, k] % epp
        np.testing.assert_array_equal(got, expect)
    fmt = FloatRows(6, 4, jnp.float32)
    bt = rng.permutation(nb)[: r * mb].reshape(r, mb).astype(np.int32)
    cache = rng.standard_normal((nb, fmt.page_elems)).astype(np.float32)
    out = np_(gather_j(jnp.asarray(cache), fmt, jnp.asarray(bt), 10))
    assert out.shape == (r, 10, 6)
    flat = cache.reshape(nb * 4, 6)
    for i in range(r):
        for e in range(10):
            np.testing.assert_array_equal(out[i, e], flat[bt[i, e // 4] * 4 + e % 4])


# ------------------------------------------------------------------------------------------
# indexer
# ------------------------------------------------------------------------------------------


def test_index_scores_vs_float64() -> None:
    rng = np.random.default_rng(20)
    q = rng.standard_normal((6, 4, 128)).astype(np.float32)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    k = rng.standard_normal((6, 30, 128)).astype(np.float32)
    got = np_(index_scores(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k)))
    dots = np.einsum("thd,tnd->thn", q.astype(np.float64), k.astype(np.float64))
    ref = np.einsum("th,thn->tn", w.astype(np.float64), np.maximum(dots, 0))
    absb = np.einsum("th,thn->tn", np.abs(w.astype(np.float64)),
                     np.einsum("thd,tnd->thn", np.abs(q.astype(np.float64)), np.abs(k.astype(np.float64))))
    assert got.dtype == np.float32 and got.shape == (6, 30)
    assert np.all(np.abs(got - ref) <= 1e-5 * absb)


def test_prepare_indexer_q_folds_scales() -> None:
    rng = np.random.default_rng(21)
    q = rng.standard_normal((5, 4, 128)).astype(np.float32)
    w = rng.standard_normal((5, 4)).astype(np.float32)
    qq, wf = prepare_indexer_q(jnp.asarray(q), jnp.asarray(w), head_dim=128, n_heads=4, fp8=False, hadamard=False,
                               dtype=jnp.float32)
    np.testing.assert_array_equal(np_(qq), q)
    np.testing.assert_allclose(np_(wf), w.astype(np.float64) * 128 ** -0.5 * 4 ** -0.5, rtol=1e-6)
    qq, _ = prepare_indexer_q(jnp.asarray(q), jnp.asarray(w), head_dim=128, n_heads=4, fp8=True, hadamard=True,
                              dtype=jnp.float32)
    rot = np_(hadamard_rotate(jnp.asarray(q)))
    qb, s = ref_act_quant(rot, 128, "ue8m0", 1e-4)
    np.testing.assert_array_equal(np_(qq), e4m3_values(qb) * s)


def ref_topk(scores: np.ndarray, nv: int, k: int) -> list[int]:
    """Top-k of the first nv columns, ties to the lower index."""
    cand = sorted(range(nv), key=lambda j: (-scores[j], j))
    return sorted(cand[:k])


@pytest.mark.parametrize("k", [8, 40])
def test_topk_visible(k: int) -> None:
    rng = np.random.default_rng(22 + k)
    t, n = 9, 30
    scores = rng.standard_normal((t, n)).astype(np.float32)
    scores[4:] = rng.integers(-3, 4, (t - 4, n)).astype(np.float32)  # many exact ties at the cut
    scores[8] = 1.0  # all equal
    nv = np.array([0, 1, 5, 30, 12, 30, 7, 20, 30], np.int32)
    got = np_(topk_visible(jnp.asarray(scores), jnp.asarray(nv), k))
    assert got.shape == (t, k) and got.dtype == np.int32
    for i in range(t):
        sel = got[i][got[i] >= 0]
        assert len(sel) == min(k, nv[i]), i
        assert np.all(got[i][len(sel):] == -1)  # -1 padding after the chosen indices
        assert np.all(sel < nv[i])  # only visible columns
        assert sorted(sel.tolist()) == ref_topk(scores[i], int(nv[i]), k), i


def test_topk_visible_ties_lower_index_wins() -> None:
    scores = np.zeros((2, 10), np.float32)
    scores[0, [2, 5, 7]] = 2.0
    scores[1] = [5, 1, 1, 1, 1, 9, 1, 1, 0, 9]  # col 9 invisible; tie among the 1s at the cut
    got = np_(topk_visible(jnp.asarray(scores), jnp.asarray(np.array([10, 9], np.int32)), 4))
    assert sorted(got[0].tolist()) == [0, 2, 5, 7]  # 3 winners + lowest-index zero
    assert sorted(got[1].tolist()) == [0, 1, 2, 5]


# ------------------------------------------------------------------------------------------
# sparse MQA
# ------------------------------------------------------------------------------------------


def ref_mqa(q, rows, valid, scale, v_dim, sink=None) -> np.ndarray:
    q, rows = q.astype(np.float64), rows.astype(np.float64)
    s = np.einsum("thd,tkd->thk", q, rows) * scale
    s = np.where(valid[:, None, :], s, -np.inf)
    m = s.max(-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink[None, :, None])
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(-1)
    if sink is not None:
        den = den + np.exp(sink[None, :] - m[..., 0])
    num = np.einsum("thk,tkd->thd", p, rows[..., :v_dim])
    return np.where(den[..., None] > 0, num / np.where(den > 0, den, 1)[..., None], 0.0)


def mqa_inputs(seed: int):
    rng = np.random.default_rng(seed)
    t, h, k, dk = 7, 4, 24, 80
    q = rng.standard_normal((t, h, dk)).astype(np.float32)
    rows = rng.standard_normal((t, k, dk)).astype(np.float32)
    valid = rng.random((t, k)) < 0.6
    valid[0] = False  # no valid candidate
    valid[1] = False
    valid[1, 5] = True  # exactly one
    valid[2] = True
    q[3] *= 20.0  # sharp softmax (large logits)
    return q, rows, valid


def test_sparse_mqa_vs_float64() -> None:
    q, rows, valid = mqa_inputs(23)
    scale = 80 ** -0.5
    out = np_(sparse_mqa(jnp.asarray(q), jnp.asarray(rows), jnp.asarray(valid), scale=scale, v_dim=64))
    assert out.shape == (7, 4, 64) and out.dtype == np.float32
    ref = ref_mqa(q, rows, valid, scale, 64)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_allclose(out[1], np.broadcast_to(rows[1, 5, :64], (4, 64)), rtol=1e-6, atol=0)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6 * np.abs(rows).max())


def test_sparse_mqa_sink() -> None:
    q, rows, valid = mqa_inputs(24)
    scale = 80 ** -0.5
    sink = np.array([-30.0, 0.0, 2.5, 60.0], np.float32)
    out = np_(sparse_mqa(jnp.asarray(q), jnp.asarray(rows), jnp.asarray(valid), scale=scale, v_dim=64,
                         sink=jnp.asarray(sink)))
    ref = ref_mqa(q, rows, valid, scale, 64, sink.astype(np.float64))
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[0], 0.0)  # no candidate + sink: zeros, not NaN
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6 * np.abs(rows).max())
    # the sink only adds exp(sink) to the denominator: out_sink = out * S / (S + exp(sink)), S = sum exp(logits)
    plain = np_(sparse_mqa(jnp.asarray(q), jnp.asarray(rows), jnp.asarray(valid), scale=scale, v_dim=64))
    lg = np.where(valid[:, None, :], np.einsum("thd,tkd->thk", q.astype(np.float64), rows.astype(np.float64)) * scale,
                  -np.inf)
    ssum = np.exp(lg).sum(-1)  # logits here are small enough for float64 without shifting
    factor = ssum / (ssum + np.exp(sink.astype(np.float64))[None, :])
    np.testing.assert_allclose(out, plain * factor[..., None], rtol=1e-5, atol=1e-6 * np.abs(rows).max())
    np.testing.assert_allclose(out[2:, 0], plain[2:, 0], rtol=1e-6, atol=1e-7)  # sink -30: no visible effect
