"""The FP8 block-scaled linear kernel (pallas_kernels/fp8_gemm.py) against the pure-JAX path
(jds.ops.quant.fp8_linear: dequantise both operands to fp32, one HIGHEST matmul).

Every kernel test runs twice: ``interpret`` (Mosaic GPU interpret mode on the CPU) and ``native`` (marked
``gpu``, skipped unless jax.default_backend() == "gpu"). Both paths quantise x with the same ``act_quant``,
so they multiply identical operands and differ only in summation order (and, natively, in the FP8 MMA's
accumulator precision). Checks, on every element of fresh random inputs (rows and weight rows of spread
magnitudes), both activation scale formats, weight scales of both kinds, fp32 and bf16 outputs, every tile
path (64/128-row tiles, 64/128/256 columns, split-K with full and trimmed partials):

* fp32 out: |y - ref| <= rtol * sum_k |x_k W_k| (dequantised operands). rtol, interpret: fp32 summation
  round-off, (2 sqrt(K) + 8) 2^-24 (both sides sum K products of magnitude <= the abs-sum; random-walk
  growth, plus the per-block scale products). Native: 2^-9, the Hopper e4m3 wgmma's accumulator keeps about
  14 bits inside each 128-long chain (DeepGEMM; the kernel promotes to fp32 every 128).
* bf16 out: both sides round their fp32 result once, so they may differ by the fp32 bound plus one bf16 ulp.
* exact data (small integers, power-of-two scales: every product and partial sum exact even at the FP8
  MMA's accumulator precision): bit-equal, natively too: this pins addressing and scale placement.

A CPU-only test lowers the compiled kernel for CUDA (Mosaic GPU's layout, TMA and wgmma rules) without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.ops import quant
from jds.ops.dispatch import Unsupported
from pallas_kernels import fp8_gemm as G

from tests.kernel_modes import KERNEL_PRIMITIVES, MODES, ON_GPU, interpret_for
from tests.tolerances import ulp

FP8 = jnp.float8_e4m3fn


# interpret mode runs the staged / ring scales with one row tile as the GPU does: the tests' CPU thread pool is large
# enough for their barrier waits (``tests/conftest.py``)
pytestmark = pytest.mark.usefixtures("interpret_barrier_forms")


def _rtol(mode: str, k: int) -> float:
    return (2 * np.sqrt(k) + 8) * 2.0 ** -24 if mode == "interpret" else 2.0 ** -9


def make_case(m: int, k: int, n: int, seed: int, w_fmt: str = "amax", x_dtype=jnp.bfloat16, lead=()):
    """(x [*lead, m, k], wq [n, k], w_scale): weight rows and x rows with magnitudes spread over ~2 decades
    (so blocks get different scales), weight blocks quantised with ``w_fmt`` scales."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * rng.uniform(0.05, 5.0, (n, 1)) * rng.uniform(0.2, 2.0, (1, k))
    wq, ws = quant.quantize_weight_blocks_jax(jnp.asarray(w, jnp.float32), 128, w_fmt)
    x = rng.standard_normal((*lead, m, k)) * rng.uniform(0.05, 5.0, (*lead, m, 1))
    return jnp.asarray(x, x_dtype), wq, ws


def reference(x, wq, ws, scale_fmt):
    """(fp32 reference y, sum_k |x_k W_k| of the dequantised operands)."""
    y = G.fp8_linear(x, wq, ws, out_dtype=jnp.float32, scale_fmt=scale_fmt, implementation="xla")
    xd = quant.fake_quant(x, 128, scale_fmt)
    wd = quant.dequant_weight_blocks(wq, ws)
    abssum = jnp.einsum("...i,oi->...o", jnp.abs(xd), jnp.abs(wd), precision=jax.lax.Precision.HIGHEST)
    return np.asarray(y, np.float64), np.asarray(abssum, np.float64)


def check(got, ref, abssum, rtol: float, out_dtype) -> float:
    """Every element within the bound; returns the worst err / bound."""
    g = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert g.shape == ref.shape and np.isfinite(g).all()
    bound = rtol * abssum + 1e-30
    want = ref
    if jnp.dtype(out_dtype) == jnp.bfloat16:
        want = np.asarray(jnp.asarray(ref, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
        bound = bound + ulp(np.maximum(np.abs(g), np.abs(want)), "bfloat16")
    err = np.abs(g - want)
    worst = float((err / bound).max())
    assert (err <= bound).all(), f"{int((err > bound).sum())} of {err.size} elements out of bound, worst ratio {worst:.2f}"
    return worst


# (m, k, n, out_dtype, tile kwargs): every tile path of the kernel
CASES = [
    (1, 512, 384, jnp.bfloat16, {}),  # decode: 64 x 128 tiles, split-K with trimmed partials
    (7, 512, 384, jnp.float32, dict(block_n=64, split_k=2)),  # 32-column warpgroup halves, trimmed partials
    (128, 256, 512, jnp.float32, dict(block_n=256, split_k=1)),  # 2 column chunks per warpgroup
    (300, 512, 128, jnp.bfloat16, dict(split_k=1)),  # 128-row tiles (warpgroups over rows), padded last one
    # (2 K blocks, no split, 64-row tile: test_leading_dims_and_auto)
    (200, 512, 256, jnp.float32, {}),  # auto: split-K with full-row partials (2 M tiles)
    (70, 256, 512, jnp.bfloat16, dict(block_m=64, block_n=256, split_k=1, stages=2)),  # 2 M tiles of 64, ring 2 < 4
]


def _both_modes(scale_fmt: str, case: int, slow: bool = False, slow_interpret: bool = False) -> list:
    """(scale_fmt, case, mode) for interpret mode and natively (marked gpu); ``slow``: both slow;
    ``slow_interpret``: only the interpret-mode run slow (the native run stays in the GPU default run)."""
    return [pytest.param(scale_fmt, case, "interpret", id=f"{scale_fmt}-{case}-interpret",
                         marks=[pytest.mark.slow] if slow or slow_interpret else []),
            pytest.param(scale_fmt, case, "native", id=f"{scale_fmt}-{case}-native",
                         marks=[pytest.mark.gpu] + ([pytest.mark.slow] if slow else []))]


# two tile paths (decode split-K, 128-row tiles) with ue8m0 scales by default, the rest slow (CI's 10-minute
# budget: interpret mode runs the whole kernel in Python). ("amax", 0) runs natively by default, in interpret mode
# only in the slow set: its tile path is ("ue8m0", 0)'s, amax activation scales through the kernel's act_quant are
# test_quantize_rows_equals_act_quant[7-384-64-amax] and test_quantize_x_in_the_kernel_equals_act_quant[5-...-amax],
# and UE8M0 weight scales test_exact_data_bit_equal's.
@pytest.mark.parametrize("scale_fmt,case,mode", _both_modes("ue8m0", 0) + _both_modes("ue8m0", 3)
                         + _both_modes("amax", 0, slow_interpret=True)
                         + [p for c in (1, 2, 4, 5) for p in _both_modes("ue8m0", c, slow=True)]
                         + [p for c in range(1, len(CASES)) for p in _both_modes("amax", c, slow=True)])
def test_matches_xla(mode: str, scale_fmt: str, case: int) -> None:
    interpret = interpret_for(mode)
    m, k, n, out_dtype, tiles = CASES[case]
    # weight scales: amax floats with ue8m0 activations and powers of two with amax activations (both kinds
    # of each side are covered; ue8m0 x ue8m0 is the exact test below)
    x, wq, ws = make_case(m, k, n, seed=case, w_fmt="amax" if scale_fmt == "ue8m0" else "ue8m0")
    got = G.fp8_linear(x, wq, ws, out_dtype=out_dtype, scale_fmt=scale_fmt, implementation="pallas",
                       interpret=interpret, **tiles)
    assert got.dtype == jnp.dtype(out_dtype) and got.shape == (m, n)
    ref, abssum = reference(x, wq, ws, scale_fmt)
    check(got, ref, abssum, _rtol(mode, k), out_dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tiles", [{}, dict(block_m=128, block_n=256, split_k=2),
                                   dict(stage_scales=True),  # the scales through SMEM (decode, split-K)
                                   pytest.param(dict(block_m=128, block_n=256, split_k=2, stage_scales=True),
                                                marks=pytest.mark.slow)])
def test_exact_data_bit_equal(mode: str, tiles: dict) -> None:
    """x, W in {-2, -1, 0, 1, 2} with a +-2 in every block and UE8M0 scales on both sides: xq, Wq in
    {0, +-128, +-256}, every product a multiple of 2^14 below 2^17 and every partial sum below 2^24, so any
    summation order at >= 11 bits of accumulator precision is exact: the kernel must equal the reference."""
    x, w, wq, ws = _exact_case(130, 512, 256, seed=11)
    got = G.fp8_linear(jnp.asarray(x, jnp.bfloat16), wq, ws, out_dtype=jnp.float32, implementation="pallas",
                       interpret=interpret_for(mode), **tiles)
    np.testing.assert_array_equal(np.asarray(got), x @ w.T)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,block_n,block_m", [(5, 192, None), (13, 128, None), (64, 192, None), (128, 192, 128),
                                               (40, 128, 128)])
def test_one_split_trimmed_rows_bit_equal(mode: str, m: int, block_n: int, block_m: int | None) -> None:
    """One split of a single row tile (decode): only the first round_up(M, 8) rows are stored, in out_dtype
    through SMEM and TMA stores (bf16 chunks of 32 and 64 columns; in a 128-row tile each warpgroup its own 64
    rows, the second none when M <= 64); exact data, so the output is the exact product rounded once to bf16."""
    x, w, wq, ws = _exact_case(m, 256, 768, seed=m)
    got = G.fp8_linear(jnp.asarray(x, jnp.bfloat16), wq, ws, out_dtype=jnp.bfloat16, implementation="pallas",
                       interpret=interpret_for(mode), block_n=block_n, block_m=block_m, split_k=1)
    assert got.shape == (m, 768)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(jnp.asarray(x @ w.T).astype(jnp.bfloat16), np.float32))


def _exact_case(m: int, k: int, n: int, seed: int):
    """(x, w float32, wq, ws): test_exact_data_bit_equal's data, any summation order exact."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, (m, k)).astype(np.float32)
    w = rng.integers(-2, 3, (n, k)).astype(np.float32)
    x[:, ::128] = 2.0
    w[:, ::128] = -2.0
    w[::128, :] = 2.0
    wq, ws = quant.quantize_weight_blocks_jax(jnp.asarray(w), 128, "ue8m0")
    return x, w, wq, ws


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,tiles", [(130, dict(block_m=128, split_k=1)),  # 64-column chunks, 2 row tiles
                                     (100, dict(block_m=128, split_k=1, stage_scales=True)),  # scale window
                                     (7, dict(block_m=64, split_k=2, stage_scales=False))])  # 32-column chunks
def test_192_wide_tiles_bit_equal(mode: str, m: int, tiles: dict) -> None:
    """block_n 192: tiles start at 0, 192, 384, 576 of 768 columns, so half of them straddle a weight-scale
    block (each accumulator chunk stays inside one); exact data, the reference bit for bit."""
    x, w, wq, ws = _exact_case(m, 256, 768, seed=m)
    got = G.fp8_linear(jnp.asarray(x, jnp.bfloat16), wq, ws, out_dtype=jnp.float32, implementation="pallas",
                       interpret=interpret_for(mode), block_n=192, **tiles)
    np.testing.assert_array_equal(np.asarray(got), x @ w.T)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,n,tiles", [(130, 1152, dict(block_m=128, block_n=144, split_k=1)),  # 2 chunks of 72
                                       (100, 1152, dict(block_m=128, block_n=144, stage_scales=True)),  # one row tile
                                       (7, 384, dict(block_m=64, block_n=48, split_k=2, stage_scales=False)),
                                       (9, 1152, dict(block_n=144, stream_k=True)),  # units across tiles
                                       (5, 640, dict(block_n=80, quantize_x=True, split_k=1)),  # 40 columns
                                       # column_scales: 192-wide tiles in 96-column chunks across scale blocks
                                       (64, 768, dict(block_n=192, column_scales=True, split_k=1)),  # q_b 64 rows
                                       (130, 768, dict(block_m=128, block_n=192, column_scales=True, split_k=1)),
                                       (100, 768, dict(block_m=128, block_n=192, column_scales=True,
                                                       stage_scales=True)),  # q_b 128 rows: one row tile
                                       # two K blocks a step with per-column scales: 192 (q_b's), 144 (mlp's)
                                       (130, 768, dict(block_m=64, block_n=192, column_scales=True, ring_scales=True,
                                                       k_pairs=True, split_k=1)),
                                       (130, 1152, dict(block_m=64, block_n=144, ring_scales=True, k_pairs=True,
                                                        split_k=1))])
def test_ragged_tiles_bit_equal(mode: str, m: int, n: int, tiles: dict) -> None:
    """Tiles whose width is no multiple of 64 (144: mlp's 18432 columns in 128 tiles) start inside weight-scale
    blocks, so a chunk takes each column's weight scale (as any width does with ``column_scales``). Weight scales
    differ per (row block, K block) here (powers of two: exact data), so a column scaled by its neighbour block's
    scale changes the result."""
    x, w, _, _ = _exact_case(m, 256, n, seed=m)
    w = w * 2.0 ** ((np.arange(n) // 128) % 3)[:, None] * 2.0 ** ((np.arange(256) // 128) % 2)[None, :]
    wq, ws = quant.quantize_weight_blocks_jax(jnp.asarray(w, jnp.float32), 128, "ue8m0")
    assert len(np.unique(np.asarray(ws))) > 2
    got = G.fp8_linear(jnp.asarray(x, jnp.bfloat16), wq, ws, out_dtype=jnp.float32, implementation="pallas",
                       interpret=interpret_for(mode), swap_ab=False, **tiles)
    np.testing.assert_array_equal(np.asarray(got), x @ w.T)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tiles", [dict(ring_scales=True, block_n=192),
                                   dict(ring_scales=True, k_pairs=True, block_n=128),  # 192 wide: 32-column chunks
                                   dict(column_scales=True, ring_scales=True, k_pairs=True, block_n=192)])
def test_ring_one_row_tile_bit_equal(tiles: dict, mode: str) -> None:
    """The scales through the ring with one 64-row tile (decode: the trimmed SMEM epilogue), and two K blocks a step
    where a warpgroup's columns make one chunk: q_b's 192-wide tiles (128 wide for K pairs without column_scales),
    exact data, per-block scales."""
    interpret = interpret_for(mode)
    x, w, _, _ = _exact_case(40, 256, 768, seed=40)
    w = w * 2.0 ** ((np.arange(768) // 128) % 3)[:, None] * 2.0 ** ((np.arange(256) // 128) % 2)[None, :]
    wq, ws = quant.quantize_weight_blocks_jax(jnp.asarray(w, jnp.float32), 128, "ue8m0")
    got = G.fp8_linear(jnp.asarray(x, jnp.bfloat16), wq, ws, out_dtype=jnp.float32, implementation="pallas",
                       interpret=interpret, swap_ab=False, block_m=64, split_k=1, **tiles)
    np.testing.assert_array_equal(np.asarray(got), x @ w.T)


def test_ragged_chunks() -> None:
    """A ragged tile's chunks: the fewest of at most 128 columns and a multiple of 8 (wgmma's N) per warpgroup."""
    assert [G._chunk_cols(128, bn) for bn in (144, 112, 48, 240)] == [72, 112, 48, 120]
    assert [G._chunk_cols(64, bn) for bn in (144, 112, 48, 80)] == [72, 56, 24, 40]
    assert [G._chunk_cols(128, bn) for bn in (64, 128, 192, 256)] == [64, 128, 64, 128]  # aligned: unchanged
    # column_scales: any width as the ragged ones (192 wide: one 96-column chunk a warpgroup at 64 rows, two at 128)
    assert [G._chunk_cols(64, bn, True) for bn in (128, 192, 256)] == [64, 96, 128]
    assert [G._chunk_cols(128, bn, True) for bn in (128, 192, 256)] == [128, 96, 128]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,out_dtype,tiles", [(1, jnp.bfloat16, {}),  # 192-wide tiles: three compute warpgroups
                                               (8, jnp.float32, dict(block_n=128, split_k=2)),  # fp32 partials
                                               (5, jnp.bfloat16, dict(block_n=192, split_k=1)),  # rows out directly
                                               (6, jnp.float32, dict(stage_scales=False)),  # scales from GMEM
                                               (24, jnp.bfloat16,  # y^T, transposed after
                                                dict(block_n=128, split_k=2, swap_store="transpose")),
                                               (40, jnp.bfloat16, dict(block_n=64)),  # one compute warpgroup
                                               (128, jnp.float32, dict(block_n=192, stages=2))])
def test_swap_ab_bit_equal(mode: str, m: int, out_dtype, tiles: dict) -> None:
    """swap_ab (y^T = W x^T, wgmma N = round_up(M, 8)): tiles of 64-row warpgroups that straddle weight-scale
    blocks (192 wide), K splits, 1 to 128 rows, y stored directly (M <= 8), through SMEM (the default above) or
    as y^T; exact data, so the output is
    the exact product rounded once."""
    x, w, wq, ws = _exact_case(m, 512, 768, seed=m + 1)
    got = G.fp8_linear(jnp.asarray(x, jnp.bfloat16), wq, ws, out_dtype=out_dtype, implementation="pallas",
                       interpret=interpret_for(mode), swap_ab=True, **tiles)
    assert got.shape == (m, 768) and got.dtype == jnp.dtype(out_dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(jnp.asarray(x @ w.T).astype(out_dtype), np.float32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,out_dtype,tiles", [(16, jnp.bfloat16, dict(block_n=192, split_k=1)),  # 3 warpgroups
                                               (5, jnp.bfloat16, dict(block_n=128, split_k=1)),  # 5 rows of 8 kept
                                               (24, jnp.bfloat16, dict(block_n=128, split_k=2)),  # fp32 partials
                                               (40, jnp.float32, dict(block_n=64, split_k=1, stage_scales=False))])
def test_swap_store_smem_bit_equal(mode: str, m: int, out_dtype, tiles: dict) -> None:
    """swap_store="smem": each warpgroup's accumulator written into its SMEM tile through the transposed view and
    stored as y's block by TMA; exact data, the exact product rounded once, as the other stores."""
    x, w, wq, ws = _exact_case(m, 512, 768, seed=m + 3)
    got = G.fp8_linear(jnp.asarray(x, jnp.bfloat16), wq, ws, out_dtype=out_dtype, implementation="pallas",
                       interpret=interpret_for(mode), swap_ab=True, swap_store="smem", **tiles)
    assert got.shape == (m, 768) and got.dtype == jnp.dtype(out_dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(jnp.asarray(x @ w.T).astype(out_dtype), np.float32))


def test_swap_store_limits() -> None:
    """swap_store: an unknown value raises ValueError, and so does a store for a call that does not swap."""
    wq, ws = _weights(768, 512)
    x = jnp.ones((16, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="swap_store"):
        G.fp8_linear(x, wq, ws, implementation="pallas", swap_ab=True, swap_store="tma")
    with pytest.raises(ValueError, match="swap_store"):
        G.fp8_linear(x, wq, ws, implementation="pallas", swap_ab=False, swap_store="smem")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale_fmt,act_quant", [("amax", "xla"), ("ue8m0", "kernel")])
def test_swap_ab_matches_xla(mode: str, scale_fmt: str, act_quant: str) -> None:
    """swap_ab on random data (both activation-scale formats, x quantised by XLA or by ``quantize_rows``, 3 rows
    in leading dims): within the summation-order bound of the unswapped kernel."""
    x, wq, ws = make_case(3, 1024, 384, seed=5, w_fmt="amax" if scale_fmt == "ue8m0" else "ue8m0")
    got = G.fp8_linear(x.reshape(1, 3, 1024), wq, ws, out_dtype=jnp.float32, scale_fmt=scale_fmt,
                       implementation="pallas", interpret=interpret_for(mode), swap_ab=True, act_quant=act_quant)
    ref, abssum = reference(x, wq, ws, scale_fmt)
    check(got.reshape(3, 384), ref, abssum, _rtol(mode, 1024), jnp.float32)


def test_auto_swap_ab() -> None:
    """swap_ab=None: on up to SWAP_AB_UP_TO rows unless a tile choice excludes it."""
    auto = G._auto_swap_ab
    assert [auto(m, None, None, False, None) for m in (1, 8, 9, 32, 33, 64)] == [True, True, True, True, False, False]
    assert not any([auto(1, 64, None, False, None), auto(1, None, 256, False, None),
                    auto(1, None, None, True, None), auto(1, None, None, False, True)])
    assert auto(1, None, 192, False, False)


def test_swap_ab_limits() -> None:
    """swap_ab: more than 128 rows, block_n 256, quantize_x, stream_k or block_m raise Unsupported naming the
    field (its staged scales in interpret mode: ``test_persistent_and_ring_limits``); the ring depth shrinks to fit
    SMEM beside the staged scales."""
    wq, ws = _weights(512, 512)
    for m, kw, field in [(129, {}, "128 rows"), (2, dict(block_n=256), "block_n"),
                         (2, dict(quantize_x=True), "quantize_x"), (2, dict(stream_k=True), "stream_k"),
                         (2, dict(block_m=64), "block_m")]:
        with pytest.raises(Unsupported, match=field):
            G.fp8_linear(jnp.ones((m, 512), jnp.bfloat16), wq, ws, implementation="pallas", swap_ab=True, **kw)
    assert G._swapped_stages(4, 8, 192, 12, 12) == 4
    assert G._swapped_stages(8, 128, 192, 56, 56) == 4  # (128 + 192) x 128 bytes a stage beside 28 KB of scales
    assert G._swapped_stages(4, 8, 128, 12, 2) == 2  # no deeper than the CTA's K blocks
    # None: about SWAP_RING_BYTES in flight: wo's 128-wide tiles 6 stages, q_b's / mlp's 192-wide ones 4
    assert [G._swapped_stages(None, 8, bn, nk, kps) for bn, nk, kps in ((128, 128, 64), (192, 12, 12), (192, 56, 56))] \
        == [6, 4, 4]


@pytest.mark.parametrize("mode", MODES)
def test_leading_dims_and_auto(mode: str) -> None:
    """x [2, 3, k] (leading dims flatten to M = 6, f32 input); "auto" runs the kernel for supported shapes."""
    interpret = interpret_for(mode)
    x, wq, ws = make_case(3, 256, 128, seed=5, x_dtype=jnp.float32, lead=(2,))
    got = G.fp8_linear(x, wq, ws, out_dtype=jnp.float32, implementation="auto", interpret=interpret)
    ref, abssum = reference(x, wq, ws, "ue8m0")
    check(got, ref, abssum, _rtol(mode, 256), jnp.float32)
    f = functools.partial(G.fp8_linear, out_dtype=jnp.float32, implementation="auto", interpret=interpret)
    text = str(jax.make_jaxpr(f)(x, wq, ws))
    assert any(p + "[" in text for p in KERNEL_PRIMITIVES), "auto did not run the kernel"


@pytest.mark.skipif(ON_GPU, reason="GPU interpret mode's race detector runs on the CPU")
@pytest.mark.parametrize("m,n,tiles", [(7, 256, dict(block_n=128, split_k=2)),  # staged scales, trimmed partials
                                       pytest.param(130, 256, dict(block_m=128, block_n=256, split_k=1, stages=2),
                                                    marks=pytest.mark.slow),
                                       # q_b's decode candidate: the ring's scales with one trimmed row tile, two
                                       # K blocks a step in 96-column chunks
                                       (40, 768, dict(block_m=64, block_n=192, split_k=1, column_scales=True,
                                                      ring_scales=True, k_pairs=True)),
                                       # and its staged forms at 64 and 128 rows (one and two chunks a warpgroup)
                                       (40, 768, dict(block_m=64, block_n=192, split_k=1, column_scales=True)),
                                       (100, 768, dict(block_m=128, block_n=192, split_k=1, column_scales=True))])
def test_no_races(m: int, n: int, tiles: dict) -> None:
    """Interpret mode's race detector over the warp-specialised TMA ring (producer vs 2-3 consumers, slot
    reuse) and the trimmed-partial SMEM epilogue."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    x, wq, ws = make_case(m, 512, n, seed=9)
    y = G.fp8_linear(x, wq, ws, out_dtype=jnp.float32, implementation="pallas",
                     interpret=plgpu.InterpretGPUParams(detect_races=True), **tiles)
    jax.block_until_ready(y)
    assert not gpu_callbacks.get_races().races_found


def test_empty_m() -> None:
    _, wq, ws = make_case(1, 256, 128, seed=0)
    y = G.fp8_linear(jnp.zeros((0, 256), jnp.bfloat16), wq, ws, out_dtype=jnp.bfloat16, implementation="pallas")
    assert y.shape == (0, 128) and y.dtype == jnp.bfloat16


# ----- errors -------------------------------------------------------------------------------------
def _weights(n: int, k: int):
    return jnp.zeros((n, k), FP8), jnp.ones((-(-n // 128), -(-k // 128)), jnp.float32)


@pytest.mark.parametrize("m,k,n,mode", [(4, 256, 200, "interpret"), (70, 256, 200, "interpret"),
                                        pytest.param(8, 7168, 576, "native", marks=pytest.mark.gpu),
                                        pytest.param(64, 7168, 576, "native", marks=pytest.mark.gpu),
                                        pytest.param(128, 7168, 576, "native", marks=pytest.mark.gpu)])
def test_out_not_a_multiple_of_128(m: int, k: int, n: int, mode: str) -> None:
    """An out that is no multiple of 128 (V3.2's wkv_a: 576) runs the kernel on zero-padded weight rows, not XLA's
    path: "auto" traces the kernel, and every element of y [m, out] is within the bound of the XLA reference
    (the swapped decode form at 4 / 8 rows, the unswapped one above)."""
    interpret = interpret_for(mode)
    x, wq, ws = make_case(m, k, n, seed=3)
    f = functools.partial(G.fp8_linear, out_dtype=jnp.float32, implementation="auto", interpret=interpret)
    text = str(jax.make_jaxpr(f)(x, wq, ws))
    assert any(p + "[" in text for p in KERNEL_PRIMITIVES)
    ref, abssum = reference(x, wq, ws, "ue8m0")
    check(jax.jit(f)(x, wq, ws), ref, abssum, _rtol(mode, k), jnp.float32)
    if mode == "interpret":  # a tile width is checked against the padded out, which the error names
        with pytest.raises(ValueError, match=r"block_n 48 must divide out = 200 padded .*\(256\)"):
            G.fp8_linear(x, wq, ws, implementation="pallas", block_n=48, interpret=True)


@pytest.mark.parametrize("implementation,m", [("xla", 3), ("pallas", 4)])
def test_linear_stores_padded_fp8_rows(implementation: str, m: int) -> None:
    """``jds.nn.Linear`` keeps an FP8 weight whose out is no multiple of 128 (200 here; V3.2's wkv_a 576) with
    zero rows up to whole scale blocks, so the kernel takes it without a padded copy per call (its jaxpr has no
    pad): export shows the 200 rows only, a load keeps the zero rows, and y [m, 200] is within the bound of the
    XLA reference on the unpadded weight."""
    from flax import nnx

    from jds.nn import Linear, export_weights, load_weights

    class Holder(nnx.Module):  # export names a linear by its attribute: "lin", "lin.scale"
        def __init__(self):
            self.lin = Linear(256, 200, dtype=jnp.float32, fp8=True, rngs=nnx.Rngs(0), implementation=implementation)

    holder = Holder()
    lin = holder.lin
    assert lin.weight[...].shape == (256, 256) and lin.scale[...].shape == (2, 2)
    assert not np.asarray(lin.weight[...][200:].astype(jnp.float32)).any()
    x, wq, ws = make_case(m, 256, 200, seed=5)
    load_weights(holder, {"lin": wq, "lin.scale": ws})
    out = export_weights(holder)
    assert out["lin"].shape == (200, 256) and out["lin"].dtype == wq.dtype
    np.testing.assert_array_equal(out["lin"].view(np.uint8), np.asarray(wq).view(np.uint8))
    assert not np.asarray(lin.weight[...][200:].astype(jnp.float32)).any()
    if implementation == "pallas":
        lin.implementation = "auto"
        text = str(jax.make_jaxpr(lambda v: lin(v))(x))
        assert any(p + "[" in text for p in KERNEL_PRIMITIVES) and "f8_e4m3fn[256,256] = pad[" not in text
        direct = str(jax.make_jaxpr(lambda v: G.fp8_linear(v, wq, ws, implementation="auto", interpret=True))(x))
        assert "f8_e4m3fn[256,256] = pad[" in direct  # (what the stored padding saves)
    ref, abssum = reference(x, wq, ws, "ue8m0")
    check(jax.jit(lambda v: lin(v))(x), ref, abssum, _rtol("interpret", 256), jnp.float32)
    np.testing.assert_array_equal(np.asarray(lin.dense_weight()), np.asarray(quant.dequant_weight_blocks(wq, ws)))


def test_unsupported_in() -> None:
    """in = 200 (not a multiple of the 128 quantisation group): the kernel names it; XLA's act_quant rejects it too."""
    wq, ws = _weights(128, 200)
    x = jnp.ones((2, 200), jnp.bfloat16)
    with pytest.raises(ValueError, match="in = 200"):
        G.fp8_linear(x, wq, ws, implementation="pallas")
    with pytest.raises(ValueError):
        G.fp8_linear(x, wq, ws, implementation="auto")


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_m=32), "block_m"), (dict(block_n=100), "block_n"), (dict(block_n=272), "block_n"),
    (dict(block_n=256), "block_n"),
    (dict(split_k=3), "split_k"), (dict(split_k=0), "split_k"), (dict(stages=0), "stages"),
    (dict(group_m=0), "group_m"), (dict(stage_scales=1), "stage_scales"), (dict(scale_fmt="e5m2"), "scale_fmt"),
    (dict(implementation="cuda"), "implementation"), (dict(swap_ab="yes"), "swap_ab"),
])
def test_bad_params(kwargs: dict, field: str) -> None:
    wq, ws = _weights(384, 512)  # out = 384: block_n 256 does not divide it; in / 128 = 4: split_k 3 does not
    with pytest.raises(ValueError, match=field):
        G.fp8_linear(jnp.ones((2, 512), jnp.bfloat16), wq, ws, **{"implementation": "pallas", **kwargs})


@pytest.mark.parametrize("implementation", ["xla", "pallas", "auto"])
@pytest.mark.parametrize("args,field", [
    (lambda: (jnp.ones((2, 256)), jnp.zeros((128, 256), jnp.bfloat16), jnp.ones((1, 2))), "wq"),
    (lambda: (jnp.ones((2, 256)), jnp.zeros((128, 256), FP8), jnp.ones((2, 2))), "w_scale"),
    (lambda: (jnp.ones((2, 384)), jnp.zeros((128, 256), FP8), jnp.ones((1, 2))), "x"),
    (lambda: (jnp.ones((2, 256), jnp.int32), jnp.zeros((128, 256), FP8), jnp.ones((1, 2))), "x"),
])
def test_bad_inputs(implementation: str, args, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        G.fp8_linear(*args(), implementation=implementation)


def test_row_scales_equal_block_scale() -> None:
    """The kernel-side scale (float32 bit arithmetic) equals quant.block_scale (frexp / ldexp), bit for bit, for
    both formats: below and at the floor, powers of two and their neighbours, random magnitudes, the e4m3 max."""
    rng = np.random.default_rng(3)
    special = [0.0, 1e-30, 1e-5, 1e-4, np.nextafter(np.float32(1e-4), np.float32(1)), 448.0, 896.0, 447.99997,
               2.0 ** -20, 2.0 ** 20, 3.0 * 2 ** 7]
    a = np.concatenate([np.asarray(special, np.float32), np.float32(2.0) ** rng.uniform(-30, 30, 20000).astype(np.float32),
                        np.ldexp(np.float32(1), np.arange(-14, 40)).astype(np.float32) * np.float32(448)])
    a = jnp.asarray(a, jnp.float32)
    for fmt in ("ue8m0", "amax"):
        want = quant.block_scale(a, fmt, quant.ACT_AMAX_FLOOR)
        np.testing.assert_array_equal(np.asarray(G.row_scales(a, fmt)).view(np.int32), np.asarray(want).view(np.int32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,tiles,scale_fmt", [(1, dict(block_n=128, split_k=1), "ue8m0"),  # staged sw, bf16 out
                                               (5, dict(block_n=128, split_k=2, stage_scales=False), "amax"),
                                               pytest.param(64, dict(block_n=64, split_k=1, stage_scales=True), "ue8m0",
                                                            marks=pytest.mark.slow)])
def test_quantize_x_in_the_kernel_equals_act_quant(mode: str, m: int, tiles: dict, scale_fmt: str) -> None:
    """quantize_x=True (x quantised per K block inside the kernel) gives the kernel's result on act_quant's
    operands bit for bit: the same e4m3 values and scales, the same MMAs and promotions."""
    interpret = interpret_for(mode)
    x, wq, ws = make_case(m, 512, 256, seed=m)
    kw = dict(out_dtype=jnp.float32, scale_fmt=scale_fmt, implementation="pallas", interpret=interpret,
              **tiles)
    got = G.fp8_linear(x, wq, ws, quantize_x=True, **kw)
    want = G.fp8_linear(x, wq, ws, swap_ab=False, **kw)  # the same kernel form (swap_ab's MMAs sum differently)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,k,mp,scale_fmt", [(1, 256, 64, "ue8m0"), (7, 384, 64, "amax"), (64, 256, 64, "amax"),
                                              (72, 256, 128, "ue8m0")])
def test_quantize_rows_equals_act_quant(mode: str, m: int, k: int, mp: int, scale_fmt: str) -> None:
    """The one-kernel act_quant (``quantize_rows``): act_quant's e4m3 values and scales bit for bit, in the
    GEMM's layout (scales transposed), zero rows past M; rows with a zero block take the amax floor's scale."""
    x, _, _ = make_case(m, k, 128, seed=k + m)
    x = x.at[0, :128].set(0)
    xq, sxt = G.quantize_rows(x, mp, scale_fmt, interpret=interpret_for(mode))
    rq, rs = quant.act_quant(x, 128, scale_fmt)
    assert xq.shape == (mp, k) and xq.dtype == FP8 and sxt.shape == (k // 128, mp)
    np.testing.assert_array_equal(np.asarray(xq[:m]).view(np.uint8), np.asarray(rq).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sxt[:, :m]), np.asarray(rs.T))
    assert not np.asarray(xq[m:]).view(np.uint8).any()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,tiles", [(1, {}), (16, dict(split_k=2)), pytest.param(128, {}, marks=pytest.mark.slow)])
def test_act_quant_kernel_gives_the_same_result(mode: str, m: int, tiles: dict) -> None:
    """act_quant="kernel": the GEMM on ``quantize_rows``' operands equals the GEMM on XLA's, bit for bit."""
    interpret = interpret_for(mode)
    x, wq, ws = make_case(m, 512, 256, seed=m + 1)
    kw = dict(out_dtype=jnp.float32, implementation="pallas", interpret=interpret, **tiles)
    np.testing.assert_array_equal(np.asarray(G.fp8_linear(x, wq, ws, act_quant="kernel", **kw)),
                                  np.asarray(G.fp8_linear(x, wq, ws, act_quant="xla", **kw)))


def test_quantize_rows_limits() -> None:
    x = jnp.ones((12, 256), jnp.bfloat16)
    with pytest.raises(Unsupported, match="multiple of 8"):
        G.quantize_rows(x, 64, "ue8m0")  # 12 rows: TMA's 8-row tiling
    with pytest.raises(Unsupported, match="bfloat16"):
        G.quantize_rows(x[:8].astype(jnp.float32), 64, "ue8m0")
    with pytest.raises(ValueError, match="act_quant"):
        G.fp8_linear(x, *_weights(128, 256), implementation="pallas", act_quant="triton")
    wq, ws = _weights(128, 256)  # 12 rows: act_quant="kernel" falls back to XLA's, same result
    kw = dict(out_dtype=jnp.float32, implementation="pallas", interpret=True)
    np.testing.assert_array_equal(np.asarray(G.fp8_linear(x, wq, ws, act_quant="kernel", **kw)),
                                  np.asarray(G.fp8_linear(x, wq, ws, act_quant="xla", **kw)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,k,n,ctas,quantize_x", [(1, 512, 384, 5, False),  # runs span tiles, uneven
                                                   (7, 640, 256, 4, True),
                                                   (100, 512, 256, 3, False)])  # one 128-row tile
def test_stream_k_matches_xla(mode: str, m: int, k: int, n: int, ctas: int, quantize_x: bool, monkeypatch) -> None:
    """stream_k=True: a few CTAs (NUM_SMS patched) share the (column tile, K block) units, so runs start and end
    inside tiles; every element within the fp32 bound of the reference (the partials' sum order differs)."""
    interpret = interpret_for(mode)
    if interpret:
        monkeypatch.setattr(G, "NUM_SMS", ctas)
    x, wq, ws = make_case(m, k, n, seed=k)
    ref, ab = reference(x, wq, ws, "ue8m0")
    got = G.fp8_linear(x, wq, ws, out_dtype=jnp.float32, implementation="pallas", interpret=interpret,
                       stream_k=True, quantize_x=quantize_x)
    check(got, ref, ab, _rtol(mode, k), jnp.float32)
    spc, slots, written = G.stream_k_layout(n // 128, k // 128, ctas)
    assert slots > 1 and written[0].all()  # tiles shared by several CTAs; every tile has a first one


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,k,n,ctas,tiles,out_dtype", [
    (300, 512, 384, 4, {}, jnp.float32),  # 9 tiles on 4 CTAs: 3 rounds, the last with one CTA
    (300, 256, 512, 3, dict(block_n=256), jnp.float32),  # 2 chunks a warpgroup, a 3-deep ring
    (200, 384, 256, 5, dict(block_m=64), jnp.bfloat16),  # warpgroups split the columns
    (200, 256, 1152, 5, dict(block_n=144), jnp.bfloat16),  # ragged chunks: per-column weight scales
    (300, 512, 384, 4, dict(ring_scales=True), jnp.bfloat16),  # the scales through the ring
    (200, 384, 256, 5, dict(block_m=64, ring_scales=True), jnp.float32),
    (200, 256, 1152, 5, dict(block_n=144, ring_scales=True), jnp.float32),
    (300, 512, 384, 4, dict(block_n=192, ring_scales=True), jnp.float32),  # a tile starting mid-block: scales 1, 2
    (256, 512, 384, 4, dict(group_m=2, ring_scales=True), jnp.float32),  # full groups: a constant divisor
    (300, 512, 384, 4, dict(group_m=1), jnp.float32),
    # (above: a tile's store overlapping the next tile's first MMA, the default) a tile's store before the next
    # tile's first MMA: plain, ring scales, 2 chunks, 64-row tiles, ragged
    (300, 512, 384, 4, dict(store_overlap=False), jnp.bfloat16),
    (300, 512, 384, 4, dict(store_overlap=False, ring_scales=True), jnp.float32),
    (300, 256, 512, 3, dict(store_overlap=False, block_n=256, ring_scales=True), jnp.float32),
    (200, 384, 256, 5, dict(store_overlap=False, block_m=64, ring_scales=True), jnp.bfloat16),
    (200, 256, 1152, 5, dict(store_overlap=False, block_n=144, ring_scales=True), jnp.float32),
])
def test_persistent_matches_xla(mode: str, m: int, k: int, n: int, ctas: int, tiles: dict, out_dtype,
                                monkeypatch) -> None:
    """persistent=True: a few CTAs (NUM_SMS patched, natively too: the CTA count is a choice of the kernel's) loop
    over the tiles through one ring and store each through SMEM by TMA, CTAs without a tile in the last round
    stopping a round early (their traced step count); every element within the bound of the reference."""
    interpret = interpret_for(mode)
    monkeypatch.setattr(G, "NUM_SMS", ctas)
    x, wq, ws = make_case(m, k, n, seed=m + k)
    ref, ab = reference(x, wq, ws, "ue8m0")
    got = G.fp8_linear(x, wq, ws, out_dtype=out_dtype, implementation="pallas", interpret=interpret,
                       persistent=True, **tiles)
    assert got.dtype == jnp.dtype(out_dtype) and got.shape == (m, n)
    check(got, ref, ab, _rtol(mode, k), out_dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tiles", [dict(persistent=True),
                                   dict(persistent=True, ring_scales=True), dict(ring_scales=True, split_k=2),
                                   dict(ring_scales=True, k_pairs=True, split_k=2),
                                   dict(persistent=True, ring_scales=True, k_pairs=True),
                                   dict(persistent=True, ring_scales=True, store_overlap=False),
                                   pytest.param(dict(ring_scales=True, block_m=128, block_n=256, split_k=1),
                                                marks=pytest.mark.slow)])
def test_persistent_and_ring_exact_data_bit_equal(mode: str, tiles: dict, monkeypatch) -> None:
    """Exact data (as ``test_exact_data_bit_equal``): the persistent loop (4 tiles on 3 CTAs: one CTA runs
    two tiles, two run one) and the scales through the ring must equal the exact product: this pins the
    tiles' addressing and stores (every block's scale is the same here: the random-data tests pin which scales
    a step uses)."""
    monkeypatch.setattr(G, "NUM_SMS", 3)
    x, w, wq, ws = _exact_case(130, 512, 256, seed=12)
    got = G.fp8_linear(jnp.asarray(x, jnp.bfloat16), wq, ws, out_dtype=jnp.float32, implementation="pallas",
                       interpret=interpret_for(mode), **tiles)
    np.testing.assert_array_equal(np.asarray(got), x @ w.T)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,tiles", [(130, dict(split_k=2)), (130, dict(block_m=64, split_k=1)),
                                     (200, dict(block_n=144, split_k=1))])
def test_ring_scales_matches_xla(mode: str, m: int, tiles: dict) -> None:
    """ring_scales on random data (blocks' scales differ): each step's row scales and weight-scale row come
    through the ring with its tiles, per K split, per warpgroup's rows (128-row tiles) or columns (64-row tiles),
    and per column in ragged chunks. Taking the rows of the wrong tile or another K block's scales fails this."""
    x, wq, ws = make_case(m, 512, 1152 if tiles.get("block_n") == 144 else 384, seed=5)
    ref, ab = reference(x, wq, ws, "ue8m0")
    got = G.fp8_linear(x, wq, ws, out_dtype=jnp.float32, implementation="pallas", interpret=interpret_for(mode),
                       ring_scales=True, **tiles)
    check(got, ref, ab, _rtol(mode, 512), jnp.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,tiles,out_dtype", [(130, dict(split_k=2), jnp.float32),
                                               (130, dict(block_m=64, split_k=1), jnp.float32),
                                               (300, dict(persistent=True), jnp.bfloat16)])
def test_k_pairs_matches_xla(mode: str, m: int, tiles: dict, out_dtype, monkeypatch) -> None:
    """k_pairs on random data: two K blocks a step, each into its own accumulator and promoted with its own
    scales (row h of the step's ring scales), per K split, with 64-row tiles, and in the persistent loop (4
    CTAs: a tile's last pair stores it)."""
    monkeypatch.setattr(G, "NUM_SMS", 4)
    x, wq, ws = make_case(m, 512, 384, seed=7)
    ref, ab = reference(x, wq, ws, "ue8m0")
    got = G.fp8_linear(x, wq, ws, out_dtype=out_dtype, implementation="pallas", interpret=interpret_for(mode),
                       ring_scales=True, k_pairs=True, **tiles)
    check(got, ref, ab, _rtol(mode, 512), out_dtype)


def test_ring_weight_scales_rows() -> None:
    """The ring's whole-row weight scales (no persistent loop): sw^T, zero-padded to a multiple of 32 columns."""
    sw = jnp.arange(6 * 3, dtype=jnp.float32).reshape(6, 3)
    got = np.asarray(G.ring_weight_scales(sw))
    assert got.shape == (3, 32)
    np.testing.assert_array_equal(got[:, :6], np.asarray(sw).T)
    assert not got[:, 6:].any()


@pytest.mark.parametrize("bn", [64, 128, 144, 192, 384])
def test_ring_weight_scales_tiles(bn: int) -> None:
    """The persistent loop's per-tile weight scales: tile t's 32 columns at K block kb are sw[floor(t bn / 128) + j,
    kb], zero past the last block, for widths aligned to the blocks and not (64, 144, 192: tiles that start inside
    a block)."""
    nb, nk = 9, 3
    sw = np.arange(nb * nk, dtype=np.float32).reshape(nb, nk) + 1
    got = np.asarray(G.ring_weight_scales(jnp.asarray(sw), bn))
    tiles = nb * 128 // bn
    assert got.shape == (nk, tiles * G.RING_SCALE_COLS)
    for t in range(tiles):
        for j in range(G.RING_SCALE_COLS):
            b = t * bn // 128 + j
            np.testing.assert_array_equal(got[:, t * G.RING_SCALE_COLS + j], sw[b] if b < nb else 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(1024, 1536, 3072), (2048, 7168, 1024), (2048, 8448, 1024)])
def test_large_m_defaults_match_xla(m: int, k: int, n: int) -> None:
    """The defaults from LARGE_M_FROM rows (``_auto_large_m``), natively at the GPU's own CTA count: the scales
    through the ring, with the persistent loop at 12 and 56 K blocks (q_b's and mlp's in-features), without it
    and with K pairs at 66; every element within the bound of the reference, fp32 and bf16 out."""
    if not ON_GPU:
        pytest.skip("native only")
    want = (k // 128 <= G.PERSISTENT_MAX_KBLOCKS, True)
    assert G._auto_large_m(m, k // 128, None, None, False, None, None) == want
    x, wq, ws = make_case(m, k, n, seed=m + k)
    ref, ab = reference(x, wq, ws, "ue8m0")
    for out_dtype in (jnp.float32, jnp.bfloat16):
        got = G.fp8_linear(x, wq, ws, out_dtype=out_dtype, implementation="pallas", interpret=False)
        check(got, ref, ab, _rtol("native", k), out_dtype)


@pytest.mark.skipif(ON_GPU, reason="GPU interpret mode's race detector runs on the CPU")
@pytest.mark.parametrize("tiles", [dict(ring_scales=False), dict(ring_scales=True),
                                   dict(ring_scales=True, k_pairs=True), dict(ring_scales=True, store_overlap=False)])
def test_persistent_no_races(tiles: dict, monkeypatch) -> None:
    """The race detector over the persistent loop: 4 tiles on 3 CTAs, so a CTA's second tile rewrites the SMEM
    output tiles its first one's TMA stores read, and the ring's slots carry on across tiles; with the scales
    through the ring, their generic-proxy reads against the next TMA write of the slot (a race without the
    step's proxy fence, checked by removing it)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    monkeypatch.setattr(G, "NUM_SMS", 3)
    x, wq, ws = make_case(130, 512, 256, seed=10)
    y = G.fp8_linear(x, wq, ws, out_dtype=jnp.bfloat16, implementation="pallas", persistent=True,
                     interpret=plgpu.InterpretGPUParams(detect_races=True), **tiles)
    jax.block_until_ready(y)
    assert not gpu_callbacks.get_races().races_found


def test_persistent_and_ring_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsupported (a ValueError naming the option) where the forms do not apply; non-bool values rejected."""
    x, wq, ws = make_case(130, 512, 256, seed=0)
    kw = dict(implementation="pallas", interpret=True)
    for bad, field in ((dict(persistent=True, split_k=2), "persistent"),
                       (dict(persistent=True, stage_scales=True), "persistent"),
                       (dict(persistent=True, swap_ab=True), "swap_ab"),
                       (dict(ring_scales=True, stage_scales=True), "ring_scales"),
                       (dict(ring_scales=True, stream_k=True), "ring_scales"), (dict(ring_scales=1), "ring_scales"),
                       (dict(k_pairs=True, ring_scales=False), "k_pairs"),
                       (dict(k_pairs=True, ring_scales=True, split_k=4), "k_pairs"),  # one K block a CTA
                       (dict(k_pairs=True, ring_scales=True, block_n=256, block_m=128), "k_pairs"),  # 2 chunks
                       (dict(store_overlap=True), "store_overlap"),  # 130 rows: no persistent loop by default
                       (dict(store_overlap=True, persistent=True, ring_scales=True, k_pairs=True), "store_overlap"),
                       (dict(store_overlap=1, persistent=True), "store_overlap"),
                       (dict(column_scales=None), "column_scales"),
                       (dict(column_scales=True, swap_ab=True), "column_scales"),
                       (dict(persistent=1), "persistent"), (dict(k_pairs="yes"), "k_pairs")):
        with pytest.raises(ValueError, match=field):
            G.fp8_linear(x, wq, ws, **kw, **bad)
    with pytest.raises(Unsupported, match="persistent loops over several row tiles"):
        G.fp8_linear(x[:100], wq, ws, persistent=True, **kw)  # one 128-row tile
    with pytest.raises(Unsupported, match="quantize_x"):
        G.fp8_linear(x[:7], wq, ws, ring_scales=True, quantize_x=True, **kw)
    # the ring's depth against SMEM: as deep as asked where it fits, shallower where not, refused where no stage fits
    assert G._ring_fit(4, 40_000, 10_000) == 4 and G._ring_fit(4, 80_000, 50_000) == 2
    with pytest.raises(Unsupported, match="no SMEM"):
        G._ring_fit(4, 100_000, G.SMEM_BYTES - 50_000)
    # interpret mode where the CPU thread pool may be small (the library's default: it cannot see the pool's size)
    monkeypatch.setattr(G, "INTERPRET_REFUSES_BARRIER_FORMS", True)
    with pytest.raises(Unsupported, match="ring_scales with one row tile"):
        G.fp8_linear(x[:40], wq, ws, ring_scales=True, block_m=64, split_k=1, **kw)
    with pytest.raises(Unsupported, match="stage_scales=True with one row tile"):
        G.fp8_linear(x[:40], wq, ws, stage_scales=True, block_m=64, split_k=1, **kw)
    with pytest.raises(Unsupported, match="swap_ab with stage_scales=True"):
        G.fp8_linear(x[:8], wq, ws, stage_scales=True, swap_ab=True, **kw)


def test_auto_large_m() -> None:
    """persistent / ring_scales = None: off below LARGE_M_FROM rows and beside staged scales, quantize_x,
    stream_k or swap_ab; the scales through the ring there, persistent for a short K without split_k."""
    big, short_k, long_k = G.LARGE_M_FROM, G.PERSISTENT_MAX_KBLOCKS, G.PERSISTENT_MAX_KBLOCKS + 1
    auto = functools.partial(G._auto_large_m, split_k=None, stage_scales=None, quantize_x=False, stream_k=None,
                             swap_ab=None)
    assert auto(big, 12) == (True, True)  # q_b
    assert auto(8192, short_k) == (True, True)
    assert auto(big, 56) == (True, True)  # mlp
    assert auto(big, long_k) == auto(big, 128) == (False, True)  # wo
    assert auto(big - 1, 12) == auto(128, 128) == (False, False)
    assert auto(big, 12, split_k=2) == (False, True)
    for excl in (dict(stage_scales=True), dict(quantize_x=True), dict(stream_k=True), dict(swap_ab=True)):
        assert auto(big, 12, **excl) == auto(big, 128, **excl) == (False, False)


def test_auto_k_pairs() -> None:
    """k_pairs = None (with ring_scales): on for one accumulator chunk per warpgroup and an even K range from
    K_PAIRS_MIN_KBLOCKS K blocks per CTA (q_b's persistent 12 K blocks: off); off for ragged or multi-chunk tiles."""
    long_k = G.K_PAIRS_MIN_KBLOCKS
    assert G._auto_k_pairs(128, 128, 128) and G._auto_k_pairs(128, 128, long_k)  # wo
    assert not G._auto_k_pairs(128, 128, 12)  # q_b
    assert not G._auto_k_pairs(128, 128, 56)  # mlp
    assert not G._auto_k_pairs(128, 128, long_k + 1)  # odd
    assert not G._auto_k_pairs(128, 144, 128)  # ragged
    assert not G._auto_k_pairs(128, 192, 128)  # 64-column chunks
    assert not G._auto_k_pairs(128, 256, 128)  # two chunks
    assert G._auto_k_pairs(64, 256, 128)  # 64-row tile: a warpgroup's 128 columns


def test_large_m_scale_forms_resolved(monkeypatch) -> None:
    """How fp8_linear resolves ring_scales / persistent / k_pairs / store_overlap = None at large M (the kernel
    builder's arguments): the ring by default, off where the caller turns it off; pairs only from
    K_PAIRS_MIN_KBLOCKS; the overlapped store wherever the persistent loop runs one K block a step.
    The spy stops each call at the builder (these forms' results are the interpret tests' and native tests')."""
    seen = []

    class Resolved(Exception):
        pass

    def spy(**kw):
        seen.append((kw["ring_scales"], kw["persistent"] > 0, kw["k_pairs"], kw["store_overlap"]))
        raise Resolved

    def resolve(x, wq, ws, **extra):
        with pytest.raises(Resolved):
            G.fp8_linear(x, wq, ws, implementation="pallas", interpret=True, out_dtype=jnp.float32, **extra)
        return seen[-1]

    monkeypatch.setattr(G, "_build_call", spy)
    monkeypatch.setattr(G, "LARGE_M_FROM", 130)
    monkeypatch.setattr(G, "PERSISTENT_MAX_KBLOCKS", 16)
    x, wq, ws = make_case(130, 2176, 256, seed=1)  # 17 K blocks: no persistent loop by default
    monkeypatch.setattr(G, "K_PAIRS_MIN_KBLOCKS", 18)  # 17 K blocks: odd, so no pairs here by default either
    assert [resolve(x, wq, ws, **extra) for extra in ({}, dict(ring_scales=False),
                                                       dict(ring_scales=False, persistent=True))] == \
        [(True, False, False, False), (False, False, False, False), (False, True, False, True)]
    x, wq, ws = make_case(130, 512, 256, seed=2)  # 4 K blocks, persistent: no pairs by default (short K)
    assert resolve(x, wq, ws, persistent=True) == (True, True, False, True)
    assert resolve(x, wq, ws, persistent=True, store_overlap=False) == (True, True, False, False)
    monkeypatch.setattr(G, "K_PAIRS_MIN_KBLOCKS", 4)  # pairs from 4 K blocks: on in the persistent loop too
    assert resolve(x, wq, ws, persistent=True) == (True, True, True, False)


@pytest.mark.parametrize("n_tiles,nk,ctas", [(3, 4, 5), (56, 128, 132), (144, 56, 132), (2, 3, 6), (7, 2, 3)])
def test_stream_k_layout_counts_each_tiles_ctas(n_tiles: int, nk: int, ctas: int) -> None:
    """stream_k_owner / stream_k_layout against a direct enumeration of the CTAs' runs [c U / P, (c + 1) U / P)."""
    units = n_tiles * nk
    sharing = [set() for _ in range(n_tiles)]
    for c in range(ctas):
        for u in range(c * units // ctas, (c + 1) * units // ctas):
            assert G.stream_k_owner(u, units, ctas) == c
            sharing[u // nk].add(c)
    spc, slots, written = G.stream_k_layout(n_tiles, nk, ctas)
    assert spc == -(-units // ctas) and slots == max(len(s) for s in sharing)
    np.testing.assert_array_equal(written, np.arange(slots)[:, None] < np.array([len(s) for s in sharing]))
    assert all(min(s) == G.stream_k_owner(t * nk, units, ctas) and max(s) - min(s) + 1 == len(s)
               for t, s in enumerate(sharing))


def test_quantize_x_limits() -> None:
    x, wq, ws = make_case(65, 256, 128, seed=0)
    with pytest.raises(Unsupported, match="quantize_x"):
        G.fp8_linear(x, wq, ws, implementation="pallas", quantize_x=True)  # 65 rows
    with pytest.raises(Unsupported, match="quantize_x"):
        G.fp8_linear(x[:4].astype(jnp.float32), wq, ws, implementation="pallas", quantize_x=True)  # fp32 x
    with pytest.raises(ValueError, match="quantize_x"):
        G.fp8_linear(x[:4], wq, ws, implementation="pallas", quantize_x=1)
    with pytest.raises(Unsupported, match="stream_k"):
        G.fp8_linear(jnp.ones((129, 256), jnp.bfloat16), wq, ws, implementation="pallas", stream_k=True)
    with pytest.raises(Unsupported, match="stream_k"):
        G.fp8_linear(x, wq, ws, implementation="pallas", stream_k=True, block_m=64)  # 65 rows in 64-row tiles
    with pytest.raises(Unsupported, match="stream_k"):
        G.fp8_linear(x[:4], wq, ws, implementation="pallas", stream_k=True, split_k=2)
    # "auto" runs XLA where the kernel does not apply
    y = G.fp8_linear(x, wq, ws, out_dtype=jnp.float32, implementation="auto", quantize_x=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(G.fp8_linear(x, wq, ws, out_dtype=jnp.float32,
                                                                          implementation="xla")))


def test_auto_split_k() -> None:
    assert G._auto_split_k(tiles=12, nk=56) == 8  # 7168 -> 1536 decode: 96 CTAs of 7 K blocks
    assert G._auto_split_k(tiles=56, nk=128) == 2  # 16384 -> 7168 (wo): 112 CTAs, one wave
    assert G._auto_split_k(tiles=144, nk=56) == 1  # 7168 -> 18432 (mlp): the tiles alone fill the SMs
    assert G._auto_split_k(tiles=200, nk=56) == 1
    assert G._auto_split_k(tiles=1, nk=2) == 1  # never below 2 K blocks per CTA
    assert G._pick_tiles(8192, 18432, 56, None, None, None) == (128, 128, 1)
    assert G._pick_tiles(1, 1536, 56, None, None, None) == (64, 128, 8)


def test_auto_stream_k_and_staged_scales() -> None:
    """Default tiles for decode rows whose 128-wide column tiles exceed one wave: above swap_ab's rows the
    narrowest width that makes one wave (q_b 192, mlp 144), up to them 192 where that makes one wave, else 256
    wide for a short K. stream_k=None: on for decode rows whose column tiles alone
    still exceed one wave (mlp at 128-wide tiles), off where the K split makes one wave (wo, q_a), above 128
    rows, where the fp32 partials outweigh a short K and wherever a tile choice excludes it. Staged scales by
    default up to 128 rows where they fit SMEM; act_quant in one kernel up to 128 rows and from LARGE_M_FROM."""
    for m in (1, 32, 33, 64, 128):  # one wave each, no stream-K: q_b 128 tiles 192 wide; mlp 96 of 192
        bm = 64 if m <= 64 else 128  # up to swap_ab's rows (its widths), 128 tiles 144 wide above
        assert G._pick_tiles(m, 24576, 12, None, None, None) == (bm, 192, 1)
        assert G._pick_tiles(m, 18432, 56, None, None, None) == (bm, 192 if m <= G.SWAP_AB_UP_TO else 144, 1)
        assert not G._auto_stream_k(m, 24576, 12, None, None, None, None)
        assert not G._auto_stream_k(m, 18432, 56, None, None, None, None)
    assert G._default_block_n(1, 25600, 12, 64) == 256  # not a multiple of 192: 256 wide for a short K
    assert G._default_block_n(1, 25600, 56, 64) == 128
    assert G._default_block_n(129, 24576, 12, 128) == 128  # two row tiles
    assert G._default_block_n(64, 25600, 12, 64) == 256  # no one-wave width from 128 to 192 divides it
    assert [G._one_wave_width(n) for n in (18432, 24576, 25600, 7168)] == [144, 192, None, 128]
    assert G._auto_stream_k(1, 18432, 56, None, 128, None, None)  # mlp: 144 tiles 128 wide
    assert G._auto_stream_k(1, 24576, 12, None, 128, None, None)  # 192 tiles 128 wide, short rows
    assert not G._auto_stream_k(49, 24576, 12, None, 128, None, None)  # K = 1536: partials beside the weights
    assert G._pick_tiles(1, 18432, 56, None, 128, 1) == (64, 128, 1)
    assert not G._auto_stream_k(1, 7168, 128, None, None, None, None)  # wo: 56 tiles, split 2
    assert G._auto_stream_k(128, 18432, 56, None, 128, None, None)  # one 128-row tile
    assert not G._auto_stream_k(129, 18432, 56, None, 128, None, None)
    assert not G._auto_stream_k(100, 18432, 56, 64, 128, None, None)  # two 64-row tiles
    assert not G._auto_stream_k(1, 18432, 56, None, 128, 2, None)
    assert not G._auto_stream_k(1, 18432, 56, None, 128, None, True)
    assert not G._auto_stream_k(1, 18432, 56, 128, 128, None, None)
    assert G._staged_smem(64, 128, 128, 64, 4, 2 * 64 * 64 * 4) <= G.SMEM_BYTES  # wo decode, fp32 partials
    assert G._staged_smem(128, 144, 56, 56, 4, 2 * 64 * 64 * 2) <= G.SMEM_BYTES  # mlp at 128 rows, bf16 out
    assert G._staged_smem(128, 192, 56, 56, 4, 2 * 64 * 64 * 2) <= G.SMEM_BYTES  # (its 192-wide tiles)
    assert G._staged_smem(128, 256, 512, 512, 4, 0) > G.SMEM_BYTES  # in = 65536 unsplit: not staged
    assert [G._chunk_cols(bm, bn) for bm, bn in ((64, 128), (64, 192), (64, 256), (128, 128), (128, 192))] == \
        [64, 32, 128, 128, 64]
    assert G.STAGE_SCALES_BELOW > 128
    assert [G._auto_act_quant(m) for m in (1, 64, 128, 129, G.LARGE_M_FROM - 1)] == ["kernel"] * 3 + ["xla"] * 2
    assert G._auto_act_quant(G.LARGE_M_FROM) == G._auto_act_quant(8192) == "kernel"


# ----- lowering for CUDA on the CPU ---------------------------------------------------------------
@pytest.mark.skipif(ON_GPU, reason="CPU-only cross-lowering smoke test (the gpu tests compile for real)")
@pytest.mark.parametrize("m,k,n,tiles", [(1, 7168, 1536, {}),
                                         pytest.param(300, 512, 384, {}, marks=pytest.mark.slow),
                                         (256, 1024, 512, dict(block_n=256, split_k=1)),
                                         pytest.param(16, 512, 256, dict(block_n=64, split_k=2), marks=pytest.mark.slow),
                                         (64, 16384, 7168, dict(stage_scales=True)),  # wo decode, scales in SMEM
                                         (1, 16384, 7168, dict(quantize_x=True)),  # wo decode, x quantised inside
                                         (64, 7168, 18432, dict(quantize_x=True, stage_scales=False)),
                                         (1, 7168, 18432, dict(stream_k=True, quantize_x=True)),  # mlp decode
                                         (64, 16384, 7168, dict(stream_k=True)),
                                         (128, 7168, 18432, dict(stream_k=True)),  # mlp, one 128-row tile
                                         (128, 7168, 18432, dict(block_n=144)),  # mlp: 128 ragged tiles
                                         (64, 16384, 7168, dict(block_n=112)),  # wo: 56-column chunks, split-K
                                         (1, 16384, 7168, dict(act_quant="kernel")),
                                         (128, 7168, 18432, dict(act_quant="kernel")),
                                         (256, 640, 512, dict(block_n=256, split_k=1, stage_scales=True)),
                                         (128, 1536, 24576, dict(block_n=192)),  # q_b prefill 128: one wave
                                         (64, 1536, 24576, dict(block_n=192, split_k=2)),
                                         (1, 1536, 24576, {}),  # q_b decode: 192 wide, one split, trimmed rows
                                         (5, 7168, 18432, dict(block_n=128, split_k=1)),  # 64-column chunks
                                         (1, 1536, 24576, dict(swap_ab=True)),  # q_b decode, roles swapped
                                         (128, 7168, 18432, dict(swap_ab=True)),  # mlp, N = 128 MMAs
                                         (8, 16384, 7168, dict(swap_ab=True, block_n=64)),  # wo, split-K
                                         (1, 512, 768, dict(swap_ab=True)),  # 2 K blocks a CTA: a 256-byte scale copy
                                         (24, 512, 768, dict(swap_ab=True, block_n=128, split_k=1)),
                                         # y through SMEM tiles and TMA: q_b at 32 rows, 8-row tiles
                                         (32, 1536, 24576, dict(swap_ab=True, swap_store="smem")),
                                         (5, 512, 768, dict(swap_ab=True, swap_store="smem", block_n=128,
                                                            split_k=1)),
                                         (24, 512, 768, dict(swap_ab=True, swap_store="smem", block_n=128,
                                                             split_k=2)),  # fp32 partials
                                         # large M: whole tiles looped over by one CTA per SM, TMA-stored
                                         (2048, 1536, 24576, dict(persistent=True)),  # q_b prefill
                                         (2048, 16384, 7168, dict(persistent=True)),  # wo
                                         (2048, 7168, 18432, dict(persistent=True, block_n=256)),  # 3-deep ring
                                         (2048, 7168, 18432, dict(persistent=True, block_n=144)),  # ragged chunks
                                         (2048, 7168, 18432, dict(persistent=True, block_n=144, ring_scales=True)),
                                         # the scales through the ring: wo, q_b persistent, mlp ragged, 64-row tiles
                                         (2048, 16384, 7168, dict(ring_scales=True)),
                                         (2048, 1536, 24576, dict(persistent=True, ring_scales=True)),
                                         (2048, 7168, 18432, dict(ring_scales=True, block_n=144)),
                                         (256, 7168, 18432, dict(ring_scales=True, block_m=64, split_k=2)),
                                         # two K blocks a step (k_pairs)
                                         (2048, 16384, 7168, dict(ring_scales=True, k_pairs=True)),
                                         (2048, 1536, 24576, dict(store_overlap=False)),  # q_b, stored before
                                         (2048, 1536, 24576, dict(persistent=True, ring_scales=True, k_pairs=True)),
                                         # the defaults at large M: persistent (q_b, mlp), pairs (wo)
                                         (2048, 1536, 24576, {}), (2048, 16384, 7168, {}), (2048, 7168, 18432, {}),
                                         (64, 7168, 18432, dict(stream_k=True)),
                                         # q_b's decode tiles in 96-column chunks (per-column weight scales)
                                         (64, 1536, 24576, dict(column_scales=True)),
                                         (128, 1536, 24576, dict(column_scales=True)),
                                         (64, 1536, 24576, dict(column_scales=True, ring_scales=True, k_pairs=True)),
                                         # the ring fewer stages deep where the SMEM beside it (the trimmed
                                         # epilogue's tiles, fp32 for the benchmark's accuracy call) needs the room
                                         (64, 1536, 24576, dict(column_scales=True, ring_scales=True, k_pairs=True,
                                                                out_dtype=jnp.float32)),
                                         (64, 16384, 7168, dict(ring_scales=True)),
                                         (128, 1536, 24576, dict(block_n=256, out_dtype=jnp.float32)),
                                         # V3.2's wkv_a (576 out: padded to whole scale blocks), swapped and not
                                         (8, 7168, 576, {}), (64, 7168, 576, {}), (128, 7168, 576, {}),
                                         # V3.2's wq_a + indexer.wk + wkv_a as the model stores them (2304)
                                         (1, 7168, 2304, {}), (64, 7168, 2304, {}), (128, 7168, 2304, {}),
                                         (2048, 7168, 2304, {})])
def test_lowers_for_cuda(m: int, k: int, n: int, tiles: dict) -> None:
    """The compiled kernel passes Mosaic GPU's lowering (e4m3 wgmma with K-major operands, TMA, layouts) and its
    shared-memory limit (sm90's 227 KB, checked at lowering)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    f = jax.jit(functools.partial(G.fp8_linear, implementation="pallas", interpret=False,
                                  **{"out_dtype": jnp.bfloat16, **tiles}))
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), FP8),
            jax.ShapeDtypeStruct((-(-n // 128), k // 128), jnp.float32))
    dev = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=dev)):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and ".f32.e4m3.e4m3" in text
    assert f"{G.GEMM_KERNEL}_mosaic_gpu" in text  # named apart from quantize_rows' kernel on the GPU timeline
