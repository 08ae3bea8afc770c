"""The FP4 grouped (MoE) GEMM kernel (pallas_kernels/fp4_grouped_gemm.py) against an independent float64 numpy
reference (nibbles unpacked with a lookup table here, not with ``jds.ops.quant.fp4_dequant``) and the XLA path.

Kernel tests run as ``interpret`` (Mosaic GPU interpret mode on the CPU) and ``native`` (marked ``gpu``,
skipped unless jax.default_backend() == "gpu"). Every element of fresh random inputs is checked:

* Both paths multiply exact products (bf16 x times a dequantised FP4 weight: 8 x 2 significant bits, exact in
  fp32) and sum K of them in fp32, so |y_fp32 - ref| <= rtol * sum_k |x_k W_k| with rtol = (2 sqrt(K) + 8) 2^-24
  in interpret mode (fp32 round-off, random-walk growth) and K 2^-23 natively (the worst case of K fp32 adds
  that may truncate: wgmma's internal accumulation order and rounding are not documented).
* bf16 out: plus half a bf16 ulp of the result (one rounding of the fp32 sum); fp32 out: half an fp32 ulp.
* Rows past sum(sizes) must be exactly 0.
* Exact data (integer x, weights on a 1/4 grid: every partial sum exact in fp32): bit-equal to the reference
  and to the XLA path, natively too. This pins addressing: which expert, which rows, which columns, which
  scale block. The impulse test (x = identity) names the weight column a wrong output row read instead.
* Native tests also run the "bf16" dequantisation route (bf16 subnormals: GPU only) and the model's shapes.

A CPU-only test lowers the kernel for CUDA (Mosaic GPU's layout, TMA and wgmma rules) without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.ops.dispatch import Unsupported
from pallas_kernels import fp4_grouped_gemm as G
from pallas_kernels import grouped_rows

from tests.kernel_modes import KERNEL_PRIMITIVES, MODES, ON_GPU, interpret_for
from tests.tolerances import ulp

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


# ----- reference -----------------------------------------------------------------------------------------
def ref_weights(wp, ws) -> np.ndarray:
    """float64 W [E, N, K]: low nibble = even column, e8m0 byte b = 2^(b - 127) per 32 columns."""
    wp, ws = np.asarray(wp), np.asarray(ws)
    e, n, kh = wp.shape
    w = np.empty((e, n, 2 * kh), np.float64)
    w[..., 0::2] = E2M1[wp & 0xF]
    w[..., 1::2] = E2M1[wp >> 4]
    return w * np.repeat(np.exp2(ws.astype(np.float64) - 127), 32, axis=-1)


def reference(x, sizes, wp, ws) -> tuple[np.ndarray, np.ndarray]:
    """(y [M, N], sum_k |x_k W_k| [M, N]) in float64; rows past sum(sizes) 0. Dequantises one expert with rows
    at a time (the model-shape stacks would be gigabytes in float64)."""
    xf = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    wp, ws = np.asarray(wp), np.asarray(ws)
    m, n = xf.shape[0], wp.shape[1]
    y, ab = np.zeros((m, n)), np.zeros((m, n))
    r = 0
    for e, s in enumerate(np.asarray(sizes)):
        if s:
            w = ref_weights(wp[e:e + 1], ws[e:e + 1])[0]
            y[r:r + s] = xf[r:r + s] @ w.T
            ab[r:r + s] = np.abs(xf[r:r + s]) @ np.abs(w).T
        r += s
    return y, ab


def rtol(mode: str, k: int) -> float:
    return (2 * np.sqrt(k) + 8) * 2.0 ** -24 if mode == "interpret" else k * 2.0 ** -23


def quantized(x):
    """act_quant's (e4m3 x, float32 scales per 128) of x, and the float32 x they stand for."""
    from jds.ops import quant

    xq, sx = quant.act_quant(x, G.X_BLOCK, "ue8m0")
    return xq, sx, quant.dequant(xq, sx, G.X_BLOCK)


def rtol_fp8(mode: str, k: int) -> float:
    """Interpret: exact products, fp32 sums (as ``rtol``). Natively the fp8 wgmma's own accumulation inside a
    32-column block is not fp32 (about 2^-14 relative per add, as the FP8 GEMM's tests found), promoted to fp32
    per block: 32 adds of it bound the block's error."""
    return rtol(mode, k) if mode == "interpret" else 32 * 2.0 ** -14 + rtol(mode, k)


def check(got, ref, abssum, rt: float, sizes, bn: int = 64) -> float:
    """Every element within rt * abssum + half an ulp of the output dtype; rows past sum(sizes) exactly 0.
    On failure, names the (expert, 64-column tile) blocks that are off, to locate a wrong tile."""
    dt = jnp.asarray(got).dtype
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert g.shape == ref.shape and np.isfinite(g).all()
    total = int(np.sum(sizes))
    assert (g[total:] == 0).all(), "rows past sum(sizes) are not 0"
    bound = rt * abssum + 0.5 * ulp(np.maximum(np.abs(g), np.abs(ref)), dt.name) + 1e-300
    err = np.abs(g - ref)
    bad = err > bound
    if bad.any():
        ex = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
        rows, cols = np.nonzero(bad[:total])
        blocks = sorted({(int(ex[r]), int(c) // bn) for r, c in zip(rows, cols)})
        pytest.fail(f"{int(bad.sum())} of {bad.size} elements out of bound (worst ratio "
                    f"{float((err / bound).max()):.2f}); (expert, {bn}-column tile) blocks off: {blocks[:20]}")
    return float((err / bound).max())


def make_case(sizes, n: int, k: int, extra_rows: int = 0, seed: int = 0):
    """x [sum(sizes) + extra_rows, k] bf16 with row magnitudes spread over ~2 decades; random FP4 experts
    (``quant.random_fp4_weight``: uniform codes, scales jittered per block)."""
    from jds.ops import quant

    rng = np.random.default_rng(seed)
    m = int(np.sum(sizes)) + extra_rows
    x = rng.standard_normal((m, k)) * rng.uniform(0.05, 5.0, (m, 1))
    wp, ws = quant.random_fp4_weight(jax.random.key(seed), (len(sizes), n, k), k ** -0.5)
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(sizes, jnp.int32), wp, ws


def exact_case(sizes, n: int, k: int, seed: int = 0):
    """Integer x in [-3, 3] and scale bytes 126..128 (weights multiples of 1/4, |W| <= 12): every partial sum
    is a multiple of 1/4 below 2^18 (K <= 4096), exact in fp32 in any order."""
    rng = np.random.default_rng(seed)
    e, m = len(sizes), int(np.sum(sizes))
    x = rng.integers(-3, 4, (m, k)).astype(np.float32)
    wp = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
    ws = rng.integers(126, 129, (e, n, k // 32), dtype=np.uint8)
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(sizes, jnp.int32), jnp.asarray(wp), jnp.asarray(ws)


# ----- kernel vs reference (interpret mode on the CPU, native on a GPU) -----------------------------------
# (sizes, n, k, extra rows past sum(sizes), out_dtype, tiles)
CASES = [
    # uneven groups with 0-row experts, 2 rows past the sum; default tiles (block_t 8, one 128-row N tile)
    ([3, 0, 5, 1, 0, 2], 128, 512, 2, jnp.bfloat16, {}),
    # one expert holds all rows, 13 > block_t 8: two token tiles of one expert; fp32 out
    ([0, 13, 0], 128, 512, 0, jnp.float32, dict(block_t=8)),
    # split-K (fp32 partials summed by XLA), one compute warpgroup (block_n 64), 4 steps of 128 per split;
    # a group of 20 rows in token tiles of 16 (its second tile starts at padded row 16)
    ([20, 0, 7], 128, 1024, 1, jnp.bfloat16, dict(block_t=16, block_n=64, block_k=128, split_k=2)),
    # a 128-row token tile (prefill tile), 2 N tiles, block_k 512 (two 128-byte swizzle tiles per packed row)
    ([130, 5], 256, 1024, 3, jnp.float32, dict(block_t=128, block_k=512)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case,x_e4m3", [(0, False), (2, False), (2, True)] + [
    pytest.param(c, x, marks=pytest.mark.slow) for c, x in ((1, False), (3, False), (0, True), (1, True), (3, True))])
def test_matches_reference(mode: str, case: int, x_e4m3: bool) -> None:
    """bf16 x, or e4m3 x with its scales (``x_e4m3``: the release's FP8 x FP4 GEMM, the "fp8" route; its XLA path
    too) against the float64 product of what x stands for."""
    interpret = interpret_for(mode)
    sizes, n, k, extra, out_dtype, tiles = CASES[case]
    x, sz, wp, ws = make_case(sizes, n, k, extra, seed=case)
    kw, rt = {}, rtol(mode, k)
    if x_e4m3:
        x, sx, xf = quantized(x)
        kw, rt = dict(x_scale=sx), rtol_fp8(mode, k)
    got = G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=out_dtype, implementation="pallas", interpret=interpret,
                               **tiles, **kw)
    assert got.dtype == jnp.dtype(out_dtype) and got.shape == (x.shape[0], n)
    ref, ab = reference(xf if x_e4m3 else x, sizes, wp, ws)
    check(got, ref, ab, rt, sizes, bn=tiles.get("block_n", 64))
    if x_e4m3:
        want = G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=jnp.float32, implementation="xla", **kw)
        check(want, ref, ab, rtol("interpret", k), sizes)


@pytest.mark.parametrize("mode,layout", [
    pytest.param("interpret", "xla", marks=pytest.mark.slow),  # CI time: the non-default layout, natively below
    ("interpret", "pallas"),
    pytest.param("native", "xla", marks=pytest.mark.gpu), pytest.param("native", "pallas", marks=pytest.mark.gpu)])
def test_exact_data_bit_equal(mode: str, layout: str) -> None:
    """Exact data: kernel == float64 reference == XLA path, bit for bit. The rows' bookkeeping
    in XLA or in its kernel (``layout``)."""
    interpret = interpret_for(mode)
    sizes = [2, 0, 9, 1]
    x, sz, wp, ws = exact_case(sizes, 128, 512, seed=3)
    got = G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=jnp.float32, implementation="pallas", interpret=interpret,
                               layout=layout)
    want = G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=jnp.float32, implementation="xla")
    ref, _ = reference(x, sizes, wp, ws)
    np.testing.assert_array_equal(np.asarray(got, np.float64), ref)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_xla_matches_reference() -> None:
    """The XLA path (the "auto" fallback and the benchmark's baseline) against the float64 reference."""
    sizes = [4, 0, 3, 6]
    x, sz, wp, ws = make_case(sizes, 96, 256, extra_rows=2, seed=7)
    got = G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=jnp.float32, implementation="xla")
    ref, ab = reference(x, sizes, wp, ws)
    check(got, ref, ab, rtol("native" if ON_GPU else "interpret", 256), sizes)


@pytest.mark.parametrize("mode", MODES)
def test_auto_runs_kernel(mode: str) -> None:
    interpret = interpret_for(mode)
    x, sz, wp, ws = make_case([1, 2], 64, 512, seed=5)
    f = functools.partial(G.fp4_grouped_linear, implementation="auto", interpret=interpret)
    text = str(jax.make_jaxpr(f)(x, sz, wp, ws))
    assert any(p + "[" in text for p in KERNEL_PRIMITIVES), "auto did not run the kernel"


@pytest.mark.skipif(ON_GPU, reason="GPU interpret mode's race detector runs on the CPU")
@pytest.mark.slow
def test_no_races() -> None:
    """Interpret mode's race detector over the warp-specialised ring (producer vs 2 consumers, 4 steps on 2
    slots) and the scale slab's TMA. The compute warpgroups read their weight tiles through the generic proxy
    (``plgpu.load``), so a slot's reuse is a race without the step's proxy fence (``fp8_gemm.fence_slot_reads``;
    checked by removing it)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    x, sz, wp, ws = make_case([3, 9], 128, 1024, seed=9)
    y = G.fp4_grouped_linear(x, sz, wp, ws, implementation="pallas", block_k=128, split_k=2, stages=2,
                             interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(y)
    assert not gpu_callbacks.get_races().races_found


def test_empty() -> None:
    _, sz, wp, ws = make_case([0, 0], 64, 512)
    y = G.fp4_grouped_linear(jnp.zeros((0, 512), jnp.bfloat16), sz, wp, ws, implementation="pallas")
    assert y.shape == (0, 64) and y.dtype == jnp.bfloat16


# ----- work-item bookkeeping (pure XLA) -------------------------------------------------------------------
def test_layout() -> None:
    """Work items start on 8-row boundaries of the padded x (a TMA start on its 8-row tiling must be
    tile-aligned: interpret mode would not notice a misaligned one), padded rows copy the right rows of x,
    and every row of y reads its own column of y^T."""
    sizes = jnp.asarray([3, 0, 17, 8, 0], jnp.int32)
    bt, m = 8, 30
    items, n_pad = grouped_rows.n_items(m, 5, bt), grouped_rows.padded_rows(m, 5, bt)
    info, src, col, valid, count = map(np.asarray, grouped_rows.row_layout(sizes, m, items, n_pad, bt))
    assert count.tolist() == [5]
    # expert 0: 1 tile, expert 2: 3 tiles, expert 3: 1 tile; groups padded to 8, 24 and 8 rows
    np.testing.assert_array_equal(info[0, :5], [0, 2, 2, 2, 3])
    np.testing.assert_array_equal(info[1, :5], [0, 8, 16, 24, 32])
    assert (info[0, 5:] == -1).all() and (info[1] % 8 == 0).all()
    want_src = np.full(n_pad, m)
    want_src[0:3], want_src[8:25], want_src[32:40] = range(0, 3), range(3, 20), range(20, 28)
    np.testing.assert_array_equal(src, want_src)
    want = [0, 1, 2] + [8 + i for i in range(17)] + [32 + i for i in range(8)]
    np.testing.assert_array_equal(col[:28], want)
    assert valid[:28].all() and not valid[28:].any()


@pytest.mark.parametrize("dequant,view,bias", [("f16", np.float16, 14), ("bf16", "bfloat16", 126)])
def test_dequant_bits(dequant: str, view, bias: int) -> None:
    """Every byte's low and high nibble placed by ``dequant_bits`` reads (as float16 / bf16, subnormals kept:
    numpy, not XLA) as the e2m1 value times 2^-bias: the placement both kernel routes rely on."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if view == "bfloat16" else np.dtype(view)
    b = np.arange(256, dtype=np.uint16)
    for nibble, code in ((0, b & 0xF), (1, b >> 4)):
        bits = G.dequant_bits(b, nibble, dequant).astype(np.uint16)
        got = bits.view(dt).astype(np.float64) * 2.0 ** bias
        np.testing.assert_array_equal(got, E2M1[code])
        np.testing.assert_array_equal(np.signbit(got), code >= 8)


def _ptx_lop3(a: np.ndarray, b: np.ndarray, c: int, lut: int) -> np.ndarray:
    """PTX ``lop3.b32``: bit i of the result is bit (4 a_i + 2 b_i + c_i) of ``lut`` (0xF0 / 0xCC / 0xAA)."""
    out = np.zeros_like(a)
    for i in range(8):
        if (lut >> i) & 1:
            out |= ((a if (0xF0 >> i) & 1 else ~a) & (b if (0xCC >> i) & 1 else ~b)
                    & (np.uint32(c) if (0xAA >> i) & 1 else ~np.uint32(c)))
    return out


def test_lop3_route_placement_and_column_order() -> None:
    """The "lop3" route emulated word by word from its PTX text (masks, shifts, LUT parsed from
    ``_LOP3_ASM``) over every byte value: the bf16 at operand column f of a 32-column block is the e2m1 weight
    of block column ``LOP3_PERM[f]`` times 2^-126, with the WGMMA-layout placement the kernel assigns (thread q
    of a row quad: word q, pair s -> columns 8 s + 2 q, +1); and ``_permute_k`` gives x the same order."""
    import re

    import ml_dtypes

    asm = G._LOP3_ASM
    and_mask = int(re.search(r"and.b32 m, q, (0x[0-9a-fA-F]+)", asm)[1], 16)
    shr = int(re.search(r"shr.b32 t, m, (\d+)", asm)[1])
    lut_c, lut = (int(v, 16) for v in re.search(r"lop3.b32 \$0, q, t, (0x[0-9a-fA-F]+), (0x[0-9a-fA-F]+)", asm).groups())
    packed = np.arange(256, dtype=np.uint8).reshape(16, 16)  # 16 rows x one 16-byte block: every byte value
    got = np.zeros((16, 32))
    for q in range(4):
        word = packed[:, 4 * q:4 * q + 4].copy().view("<u4")[:, 0]
        for s in range(4):
            qq = (word << np.uint32(4 * s)).astype(np.uint32)
            bits = _ptx_lop3(qq, (qq & np.uint32(and_mask)) >> np.uint32(shr), lut_c, lut)
            for t, half in enumerate((bits & 0xFFFF, bits >> 16)):
                got[:, 8 * s + 2 * q + t] = half.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    codes = np.empty((16, 32), np.int64)
    codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4
    np.testing.assert_array_equal(got * 2.0 ** 126, E2M1[codes[:, G.LOP3_PERM]])
    np.testing.assert_array_equal(np.sort(G.LOP3_PERM), np.arange(32))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.bfloat16)
    want = np.asarray(x, np.float64).reshape(3, 2, 32)[:, :, G.LOP3_PERM].reshape(3, 64) * 2.0 ** G.X_SCALE_LOG2
    np.testing.assert_array_equal(np.asarray(G._permute_k(x, "lop3"), np.float64), want)


def test_pick_tiles() -> None:
    assert G._pick_tiles(6, 256, 2048, 4096, None, None, None, None) == (8, 128, 256, 4)  # decode: split-K
    assert G._pick_tiles(384, 256, 2048, 4096, None, None, None, None) == (8, 128, 256, 1)
    assert G._pick_tiles(24576, 256, 4096, 2048, None, None, None, None) == (128, 128, 128, 1)  # prefill
    assert G._fit_stages(4, 128, 128, 256, 2048) < 4  # a 128-row token tile: fewer stages fit SMEM
    assert G._pick_tiles(6, 256, 2048, 4096, None, None, None, None, fp8=True)[2] == 512  # "fp8" decode steps
    assert G._pick_tiles(24576, 256, 4096, 2048, None, None, None, None, fp8=True)[2] == 128
    # "fp8" splits leave >= 2 steps per unit: 1 token, 128-row tiles as before; 256-row tiles 4 (not 8) splits
    assert G._pick_tiles(6, 256, 2048, 4096, None, None, None, None, fp8=True) == (8, 128, 512, 4)
    assert G._pick_tiles(6, 256, 2048, 4096, None, 256, None, None, fp8=True) == (8, 256, 512, 4)
    assert G._pick_tiles(6, 256, 2048, 4096, None, 256, None, 8, fp8=True)[3] == 8  # a given split stands
    assert G._pick_tiles(6, 256, 4096, 2048, None, None, None, None, fp8=True) == (8, 128, 512, 2)
    # the "fp8" ring: its depth divides a unit's steps and fits SMEM
    assert G.fp8_stages(4, 2, 8, 128, 512) == 2 and G.fp8_stages(4, 6, 8, 128, 512) == 3
    assert G.fp8_stages(4, 8, 8, 128, 512) == 4 and G.fp8_stages(8, 10, 8, 128, 512) == 5
    with pytest.raises(ValueError, match="does not fit"):
        G.fp8_stages(4, 4, 128, 128, 4096)


# ----- errors ---------------------------------------------------------------------------------------------
def _inputs(e=2, n=128, k=512, m=4):
    return (jnp.ones((m, k), jnp.bfloat16), jnp.asarray([m] + [0] * (e - 1), jnp.int32),
            jnp.zeros((e, n, k // 2), jnp.uint8), jnp.full((e, n, k // 32), 127, jnp.uint8))


@pytest.mark.parametrize("implementation", ["xla", "pallas", "auto"])
@pytest.mark.parametrize("change,field", [
    (lambda a: (a[0].astype(jnp.float32), *a[1:]), "x"),
    (lambda a: (a[0][None], *a[1:]), "x"),
    (lambda a: (jnp.ones((4, 256), jnp.bfloat16), *a[1:]), "x"),
    (lambda a: (a[0], a[1][:1], a[2], a[3]), "sizes"),
    (lambda a: (a[0], a[1].astype(jnp.float32), a[2], a[3]), "sizes"),
    (lambda a: (a[0], a[1], a[2].astype(jnp.int8), a[3]), "w_packed"),
    (lambda a: (a[0], a[1], a[2][0], a[3]), "w_packed"),
    (lambda a: (a[0], a[1], a[2], a[3][:, :, :8]), "w_scale"),
    (lambda a: (a[0], a[1], a[2], a[3].astype(jnp.float32)), "w_scale"),
])
def test_bad_inputs(implementation: str, change, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        G.fp4_grouped_linear(*change(_inputs()), implementation=implementation)


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_t=12), "block_t"), (dict(block_t=256), "block_t"), (dict(block_n=96), "block_n"),
    (dict(block_k=64), "block_k"), (dict(split_k=3), "split_k"), (dict(split_k=0), "split_k"),
    (dict(stages=0), "stages"), (dict(implementation="cuda"), "implementation"), (dict(dequant="fp8"), "dequant"),
    (dict(dequant="bf16", interpret=True), "dequant"), (dict(dequant="lop3", interpret=True), "dequant"),
])
def test_bad_params(kwargs: dict, field: str) -> None:
    a = _inputs(k=1024)  # K / 512 = 2 chunks: split_k 3 does not divide them
    with pytest.raises(ValueError, match=field):
        G.fp4_grouped_linear(*a, **{"implementation": "pallas", **kwargs})


@pytest.mark.parametrize("n,k,what", [(96, 512, "N = 96"), (128, 256, "K = 256")])
def test_unsupported_falls_back(n: int, k: int, what: str) -> None:
    """N not a multiple of 64 / K not of 512: "pallas" raises Unsupported naming it, "auto" runs XLA."""
    sizes = [3, 2]
    x, sz, wp, ws = make_case(sizes, n, k, seed=4)
    with pytest.raises(Unsupported, match=what):
        G.fp4_grouped_linear(x, sz, wp, ws, implementation="pallas")
    got = G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=jnp.float32, implementation="auto")
    want = G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=jnp.float32, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    f = functools.partial(G.fp4_grouped_linear, implementation="auto")
    text = str(jax.make_jaxpr(f)(x, sz, wp, ws))
    assert not any(p + "[" in text for p in KERNEL_PRIMITIVES)


# ----- lowering for CUDA on the CPU -----------------------------------------------------------------------
def _lower_for_cuda(m: int, e: int, n: int, k: int, **tiles) -> str:
    from jax.sharding import AbstractDevice, AbstractMesh

    f = jax.jit(functools.partial(G.fp4_grouped_linear, implementation="pallas", interpret=False, **tiles))
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((e,), jnp.int32),
            jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((e, n, k // 32), jnp.uint8))
    dev = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=dev)):
        return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(ON_GPU, reason="CPU-only cross-lowering smoke test (the gpu tests compile for real)")
@pytest.mark.parametrize("m,e,n,k,tiles", [
    (6, 256, 2048, 4096, {}),  # V4-Flash w1 decode, batch 1 x top-6: split-K
    (24576, 256, 4096, 2048, {}),  # w2 prefill, 4096 tokens x top-6: 128-row token tiles
    pytest.param(384, 256, 4096, 2048, {}, marks=pytest.mark.slow),  # w2 decode, batch 64
    pytest.param(40, 8, 512, 1024, dict(block_t=16, block_n=64, block_k=128, split_k=2), marks=pytest.mark.slow),
    pytest.param(300, 4, 256, 1024, dict(block_t=128, block_k=512), marks=pytest.mark.slow),
    (64, 256, 2048, 4096, dict(dequant="bf16")),  # the conversion-free dequantisation route
])
def test_lowers_for_cuda(m: int, e: int, n: int, k: int, tiles: dict) -> None:
    """The kernel passes Mosaic GPU's lowering (register-A bf16 wgmma, swizzled TMA, layouts) for CUDA."""
    text = _lower_for_cuda(m, e, n, k, **tiles)
    assert "mosaic_gpu" in text and ".f32.bf16.bf16" in text


# ----- native only: the model's shapes --------------------------------------------------------------------
def _routed_sizes(rng, e: int, rows_per_expert: tuple[int, int], active: int) -> list[int]:
    sizes = [0] * e
    for i in rng.choice(e, active, replace=False):
        sizes[i] = int(rng.integers(rows_per_expert[0], rows_per_expert[1] + 1))
    return sizes


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="native kernel needs a CUDA GPU")
@pytest.mark.parametrize("dequant", G.DEQUANTS)
@pytest.mark.parametrize("k,n", [(4096, 2048), (2048, 4096)])  # V4-Flash w1 / w3 and w2
@pytest.mark.parametrize("e,regime", [(8, "decode"), (32, "decode"), (16, "prefill")])
def test_native_model_shapes(k: int, n: int, e: int, regime: str, dequant: str) -> None:
    """Decode: 1-4 rows on most experts, some with none; prefill: one group of 300 rows among small ones."""
    rng = np.random.default_rng(k + e)
    if regime == "decode":
        sizes = _routed_sizes(rng, e, (1, 4), active=max(1, 3 * e // 4))
    else:
        sizes = _routed_sizes(rng, e, (1, 40), active=e // 2)
        sizes[int(np.flatnonzero(sizes)[0])] = 300
    x, sz, wp, ws = make_case(sizes, n, k, extra_rows=3, seed=e)
    got = G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=jnp.float32, implementation="pallas", dequant=dequant)
    ref, ab = reference(x, sizes, wp, ws)
    check(got, ref, ab, rtol("native", k), sizes)
    got16 = G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=jnp.bfloat16, implementation="pallas", dequant=dequant)
    check(got16, ref, ab, rtol("native", k), sizes)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="native kernel needs a CUDA GPU")
@pytest.mark.parametrize("tiles", [{}, dict(block_n=64), dict(block_k=128), dict(block_k=512), dict(split_k=2),
                                   dict(block_t=16), dict(block_t=128), dict(dequant="bf16"),
                                   dict(dequant="bf16", block_n=64, block_k=512)])
def test_native_one_tile(tiles: dict) -> None:
    """One expert, one row, one N tile (64 or 128 rows of W), K = 1024: a wrong tile, column order, scale
    block or nibble shows up alone; exact data, so bit-equal to the reference."""
    sizes = [0, 1]
    x, sz, wp, ws = exact_case(sizes, tiles.get("block_n", 128), 1024, seed=1)
    got = G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=jnp.float32, implementation="pallas", **tiles)
    ref, _ = reference(x, sizes, wp, ws)
    bad = np.nonzero(np.asarray(got, np.float64) != ref)
    assert bad[0].size == 0, f"{bad[0].size} wrong elements; first (row, col): {list(zip(*bad))[:10]}"


@pytest.mark.parametrize("mode,dequant", [("interpret", "f16"),
                                          pytest.param("native", "f16", marks=pytest.mark.gpu),
                                          pytest.param("native", "bf16", marks=pytest.mark.gpu),
                                          pytest.param("native", "lop3", marks=pytest.mark.gpu)])
def test_impulse_columns(mode: str, dequant: str) -> None:
    """x = identity (one expert, K rows): row j of y is column j of W, so a wrong column order, nibble, scale
    block or token row shows up as "row j reads W's column j'" (the message names them)."""
    interpret = interpret_for(mode)
    k, n = 512, 128
    _, _, wp, ws = make_case([1, 1], n, k, seed=2)
    x, sizes = jnp.eye(k, dtype=jnp.bfloat16), [0, k]
    got = np.asarray(G.fp4_grouped_linear(x, jnp.asarray(sizes, jnp.int32), wp, ws, out_dtype=jnp.float32,
                                          implementation="pallas", interpret=interpret, dequant=dequant), np.float64)
    w = ref_weights(wp, ws)[1]  # [n, k]
    bad = [j for j in range(k) if not np.array_equal(got[j], w[:, j])]
    if bad:
        reads = {j: [int(i) for i in np.flatnonzero((w.T == got[j]).all(axis=1))][:3] for j in bad[:8]}
        pytest.fail(f"{len(bad)} of {k} rows wrong; row j -> columns of W it equals: {reads}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="native kernel needs a CUDA GPU")
@pytest.mark.parametrize("dequant", G.DEQUANTS)
@pytest.mark.parametrize("k,n", [(4096, 2048), (2048, 4096)])
def test_native_exact_bit_equal_xla(k: int, n: int, dequant: str) -> None:
    """Exact data at the model's K and N with decode and prefill groups: kernel == XLA path == reference."""
    rng = np.random.default_rng(k)
    sizes = _routed_sizes(rng, 16, (1, 4), active=10)
    sizes[int(np.flatnonzero(sizes)[-1])] = 300
    x, sz, wp, ws = exact_case(sizes, n, k, seed=2)
    got = np.asarray(G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=jnp.float32, implementation="pallas",
                                          dequant=dequant))
    want = np.asarray(G.fp4_grouped_linear(x, sz, wp, ws, out_dtype=jnp.float32, implementation="xla"))
    ref, _ = reference(x, sizes, wp, ws)
    np.testing.assert_array_equal(got.astype(np.float64), ref)
    np.testing.assert_array_equal(got, want)


# ----- e4m3 x (x_scale): the "fp8" route ------------------------------------------------------------------
def test_e4m3_codes_and_ptx() -> None:
    """Every byte's two nibbles: ``e4m3_codes`` reads (as e4m3) e2m1 * 2^-6; the PTX of ``_to_e4m3``, emulated
    from its text (shifts, masks, LUT parsed from the asm), gives the same bytes word by word; ``_permute_k``
    puts x's even columns of each 32-column block first, as the codes' order."""
    import re

    import ml_dtypes

    b = np.arange(256, dtype=np.uint8)
    codes = G.e4m3_codes(b[None, :])[0]
    val = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** G.FP8_EXP
    np.testing.assert_array_equal(val, np.concatenate([E2M1[b & 0xF], E2M1[b >> 4]]))
    np.testing.assert_array_equal(np.signbit(val), np.concatenate([(b & 0xF) >= 8, (b >> 4) >= 8]))

    def emulate(asm: str, w: np.ndarray) -> np.ndarray:
        ops = re.findall(r"(shl|shr)\.b32 (\w), \$1, (\d+);", asm)
        regs = {r: (w << np.uint32(int(n)) if op == "shl" else w >> np.uint32(int(n))).astype(np.uint32)
                for op, r, n in ops}
        for r, mask in re.findall(r"and\.b32 (\w), \1, (0x[0-9A-Fa-f]+);", asm):
            regs[r] &= np.uint32(int(mask, 16))
        a, bb, c, lut = re.search(r"lop3\.b32 \$0, (\w), (\$1|\w), (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+);", asm).groups()
        return _ptx_lop3(regs[a], w if bb == "$1" else regs[bb], int(c, 16), int(lut, 16))

    words = b.reshape(64, 4).copy().view("<u4")[:, 0]
    lo = emulate(G._E4M3_LO_ASM, words).view(np.uint8).reshape(64, 4)
    hi = emulate(G._E4M3_HI_ASM, words).view(np.uint8).reshape(64, 4)
    np.testing.assert_array_equal(lo.reshape(-1), G.e4m3_codes(b)[:256])
    np.testing.assert_array_equal(hi.reshape(-1), G.e4m3_codes(b)[256:])
    x = jnp.asarray(np.arange(64, dtype=np.float32)[None], jnp.bfloat16)
    perm = np.asarray(G._permute_k(x, "fp8"), np.float64)[0]
    np.testing.assert_array_equal(perm[:32], np.r_[np.arange(0, 32, 2), np.arange(1, 32, 2)])


@pytest.mark.parametrize("mode,group,block_k", [("interpret", None, 256), ("interpret", 2, 256),
                                                pytest.param("interpret", 8, 256, marks=pytest.mark.slow),
                                                pytest.param("interpret", 1, 256, marks=pytest.mark.slow),
                                                pytest.param("native", None, 256, marks=pytest.mark.gpu),
                                                pytest.param("native", 8, 256, marks=pytest.mark.gpu),
                                                pytest.param("native", 2, 256, marks=pytest.mark.gpu),
                                                pytest.param("native", None, 512, marks=pytest.mark.gpu)])
def test_fp8_route_exact_bit_equal(mode: str, group: int | None, block_k: int) -> None:
    """Exact data (integer x, scale 1; weights on a 1/4 grid): every block sum is exact even in the fp8 wgmma's
    accumulator, so kernel == float64 reference == XLA path, bit for bit; plus an impulse of x per 128-block
    scale (x = 2^j on block j) to pin which x scale multiplies which columns. ``group``: MMAs per wait (8: a
    wait spans two x-scale blocks; 2: four groups, each converted during the previous one's MMAs). block_k 512
    (natively): a step's 16 scale columns read as four 32-bit words per row (``_scale_words``)."""
    interpret = interpret_for(mode)
    sizes = [2, 0, 9, 1]
    x, sz, wp, ws = exact_case(sizes, 128, 1024, seed=3)
    x = x * jnp.asarray(np.repeat(2.0 ** np.arange(8), 128), jnp.bfloat16)  # blocks' scales 2^j (ue8m0)
    xq, sx, xf = quantized(x)
    assert np.array_equal(np.asarray(xf), np.asarray(x, np.float32))
    got = G.fp4_grouped_linear(xq, sz, wp, ws, out_dtype=jnp.float32, implementation="pallas", interpret=interpret,
                               x_scale=sx, block_k=block_k, mma_group=group)
    want = G.fp4_grouped_linear(xq, sz, wp, ws, out_dtype=jnp.float32, implementation="xla", x_scale=sx)
    ref, _ = reference(xf, sizes, wp, ws)
    np.testing.assert_array_equal(np.asarray(got, np.float64), ref)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("mode", ["interpret", pytest.param("native", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tiles", [dict(block_n=64, split_k=2, block_k=256),
                                   pytest.param({}, marks=pytest.mark.slow)])  # CI time: the default tiles
def test_fp8_route_weight_sets(mode: str, tiles: dict) -> None:
    """Two weight sets (an MoE's w1 and w3) in one call: y = [x W1^T, x W3^T], each half the float64 reference
    bit for bit on exact data, with the units of both sets spread over the CTAs (interpret mode: 3 CTAs, so the
    ring continues across sets); bf16 x runs a call per set and gives the same."""
    sizes = [3, 0, 6, 1]
    x, sz, wp, ws = exact_case(sizes, 128, 1024, seed=21)
    _, _, wp3, ws3 = exact_case(sizes, 128, 1024, seed=22)
    xq, sx, xf = quantized(x)
    got = G.fp4_grouped_linear(xq, sz, (wp, wp3), (ws, ws3), out_dtype=jnp.float32, implementation="pallas",
                               interpret=interpret_for(mode), x_scale=sx, **tiles)
    assert got.shape == (x.shape[0], 256)
    for half, (w, sc) in enumerate(((wp, ws), (wp3, ws3))):
        ref, _ = reference(xf, sizes, w, sc)
        np.testing.assert_array_equal(np.asarray(got[:, 128 * half:128 * (half + 1)], np.float64), ref)
    want = G.fp4_grouped_linear(xq, sz, [wp, wp3], [ws, ws3], out_dtype=jnp.float32, implementation="xla", x_scale=sx)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_weight_sets_errors() -> None:
    x, sz, wp, ws = _inputs()
    with pytest.raises(ValueError, match="equal length"):
        G.fp4_grouped_linear(x, sz, (wp, wp), (ws,), implementation="xla")
    with pytest.raises(ValueError, match="w_packed: the sets"):
        G.fp4_grouped_linear(x, sz, (wp, wp[:, :64]), (ws, ws), implementation="xla")
    with pytest.raises(ValueError, match="w_scale: the sets"):
        G.fp4_grouped_linear(x, sz, (wp, wp), (ws, ws.astype(jnp.int8)), implementation="xla")


def test_weight_sets_bf16_route_runs_a_call_per_set() -> None:
    """bf16 x with two sets: the kernel per set, concatenated, equal to the single-set calls."""
    sizes = [2, 3]
    x, sz, wp, ws = exact_case(sizes, 64, 512, seed=23)
    one = functools.partial(G.fp4_grouped_linear, out_dtype=jnp.float32, implementation="pallas", interpret=True,
                            dequant="f16")
    got = one(x, sz, (wp, wp[:, ::-1]), (ws, ws[:, ::-1]))
    want = jnp.concatenate([one(x, sz, wp, ws), one(x, sz, wp[:, ::-1], ws[:, ::-1])], axis=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("mode", ["interpret", pytest.param("native", marks=pytest.mark.gpu)])
def test_fp8_route_fused_layout(mode: str) -> None:
    """layout "fused" (the layout kernel copies the permuted e4m3 rows and their scales): the reference bit for
    bit on exact data, with a scale impulse per 128 columns (which scale multiplies which columns), as the
    default layout gives; bf16 x has no scales to copy (ValueError)."""
    sizes = [2, 0, 9, 1]
    x, sz, wp, ws = exact_case(sizes, 128, 1024, seed=5)
    x = x * jnp.asarray(np.repeat(2.0 ** np.arange(8), 128), jnp.bfloat16)
    xq, sx, xf = quantized(x)
    got = G.fp4_grouped_linear(xq, sz, wp, ws, out_dtype=jnp.float32, implementation="pallas",
                               interpret=interpret_for(mode), x_scale=sx, layout="fused")
    ref, _ = reference(xf, sizes, wp, ws)
    np.testing.assert_array_equal(np.asarray(got, np.float64), ref)
    with pytest.raises(ValueError, match="x_scale"):
        G.fp4_grouped_linear(x, sz, wp, ws, implementation="pallas", interpret=True, layout="fused")


@pytest.mark.parametrize("mode", ["interpret", pytest.param("native", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("sizes,tiles", [
    ([0, 5, 0], dict(block_n=64, split_k=1)),  # one work unit: its CTA runs a whole pipeline
    ([0, 0, 0], {}),  # no rows in the groups: no units, zero output
    ([4, 0, 3], dict(block_n=64, split_k=1)),  # two units on two CTAs
    ([9, 1, 17], dict(block_n=64, block_k=128, block_t=16)),  # 8 units of 4 steps over 3 CTAs (interpret)
    ([9, 1, 17], dict(block_n=64, block_k=128, block_t=16, split_k=2))])  # 16 units: split and tile decoded
def test_fp8_route_units_per_cta(mode: str, sizes: list[int], tiles: dict) -> None:
    """The persistent "fp8" route: a CTA with one, several or no work units (the ring started, continued and
    drained across units) gives the float64 reference bit for bit on exact
    data; 3 rows past the groups give 0. block_t 16: items start at 8-row (not 16-row) offsets of x."""
    x, sz, wp, ws = exact_case(sizes, 64, 1024, seed=len(sizes) + sum(sizes))
    x = jnp.concatenate([x, jnp.ones((3, 1024), x.dtype)])
    xq, sx, xf = quantized(x)
    got = G.fp4_grouped_linear(xq, sz, wp, ws, out_dtype=jnp.float32, implementation="pallas",
                               interpret=interpret_for(mode), x_scale=sx, **tiles)
    ref, _ = reference(xf, sizes, wp, ws)
    np.testing.assert_array_equal(np.asarray(got, np.float64), ref)


@pytest.mark.parametrize("mode", ["interpret", pytest.param("native", marks=pytest.mark.gpu)])
def test_fp8_route_four_warpgroups(mode: str) -> None:
    """block_n 256 (e4m3 x only): four compute warpgroups of 64 weight rows share the producer; float64 reference
    bit for bit on exact data, the ring continued over several units per CTA (split_k 2: two 512-column units)."""
    sizes = [3, 0, 6]
    x, sz, wp, ws = exact_case(sizes, 256, 1024, seed=11)
    xq, sx, xf = quantized(x)
    got = G.fp4_grouped_linear(xq, sz, wp, ws, out_dtype=jnp.float32, implementation="pallas",
                               interpret=interpret_for(mode), x_scale=sx, block_n=256, split_k=2, block_k=256)
    ref, _ = reference(xf, sizes, wp, ws)
    np.testing.assert_array_equal(np.asarray(got, np.float64), ref)
    with pytest.raises(ValueError, match="block_n"):  # bf16 x: one or two compute warpgroups only
        G.fp4_grouped_linear(x, sz, wp, ws, implementation="pallas", interpret=True, block_n=256)


def test_compute_registers_fit_the_launch_pool() -> None:
    """setmaxnreg asks stay within the CTA's launch allocation (64K registers, floor8 a thread): Mosaic's own
    split for two compute warpgroups (168 x 3 a thread at launch), ours for four (96 x 5), which Mosaic's
    overshoots (it hung natively). The private function the kernel's trace replaces must still exist."""
    from jax._src.pallas.mosaic_gpu import pipeline
    assert G.compute_registers(2) == pipeline._compute_registers(G.MEMORY_REGISTERS, 2) == 232
    for wgs in (1, 2, 3, 4):
        launch = 65536 // (128 * (wgs + 1)) // 8 * 8
        assert wgs * G.compute_registers(wgs) + G.MEMORY_REGISTERS <= launch * (wgs + 1)
    assert G.compute_registers(4) == 104
    with G._launch_pool_registers():
        assert pipeline._compute_registers(G.MEMORY_REGISTERS, 4) == 104
    assert pipeline._compute_registers(G.MEMORY_REGISTERS, 4) == 112


@pytest.mark.parametrize("kwargs,field", [
    (dict(x_scale=jnp.ones((4, 4), jnp.float32)), "x must be float8_e4m3fn"),
    (dict(dequant="fp8"), "needs e4m3 x"),
    (dict(mma_group=2), "applies to e4m3 x"),
])
def test_fp8_route_bad_inputs(kwargs: dict, field: str) -> None:
    x, sz, wp, ws = _inputs()
    with pytest.raises(ValueError, match=field):
        G.fp4_grouped_linear(x, sz, wp, ws, implementation="pallas", **kwargs)
    xq = x.astype(jnp.float8_e4m3fn)
    for bad in (jnp.ones((4, 3), jnp.float32), jnp.ones((4, 4), jnp.bfloat16)):
        with pytest.raises(ValueError, match="x_scale must be float32"):
            G.fp4_grouped_linear(xq, sz, wp, ws, x_scale=bad)
    with pytest.raises(ValueError, match='takes bf16 x'):
        G.fp4_grouped_linear(xq, sz, wp, ws, implementation="pallas", x_scale=jnp.ones((4, 4), jnp.float32),
                             dequant="lop3")
    for group in (0, 3):  # not positive; not a divisor of block_k / 32 = 8
        with pytest.raises(ValueError, match="mma_group"):
            G.fp4_grouped_linear(xq, sz, wp, ws, implementation="pallas", x_scale=jnp.ones((4, 4), jnp.float32),
                                 mma_group=group, block_k=256, interpret=True)
    with pytest.raises(ValueError, match="natively only"):  # the profiler's trace: native runs only
        G.fp4_grouped_linear(xq, sz, wp, ws, implementation="pallas", x_scale=jnp.ones((4, 4), jnp.float32),
                             interpret=True, profile_dir="/tmp/jds_fp4_profile")
    with pytest.raises(ValueError, match="profile_dir"):  # bf16 x: not the profiled route
        G.fp4_grouped_linear(x, sz, wp, ws, implementation="pallas", interpret=True, dequant="f16",
                             profile_dir="/tmp/jds_fp4_profile")


@pytest.mark.skipif(ON_GPU, reason="CPU-only cross-lowering smoke test (the gpu tests compile for real)")
@pytest.mark.parametrize("m,e,n,k,tiles", [(6, 256, 2048, 4096, {}), (384, 256, 4096, 2048, {}),
                                           (48, 256, 2048, 4096, dict(mma_group=2)),
                                           (6, 256, 2048, 4096, dict(block_n=256, split_k=4)),
                                           pytest.param(24576, 256, 4096, 2048, {}, marks=pytest.mark.slow)])
def test_fp8_route_lowers_for_cuda(m: int, e: int, n: int, k: int, tiles: dict) -> None:
    """The "fp8" route passes Mosaic GPU's lowering (register-A e4m3 wgmma against the e4m3 token tile)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    f = jax.jit(functools.partial(G.fp4_grouped_linear, implementation="pallas", interpret=False, **tiles))
    args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((e,), jnp.int32),
            jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((e, n, k // 32), jnp.uint8))
    dev = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=dev)):
        text = jax.jit(lambda x, s, wp, ws, sx: f(x, s, wp, ws, x_scale=sx)).trace(
            *args, jax.ShapeDtypeStruct((m, k // 128), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.skipif(ON_GPU, reason="CPU-only cross-lowering smoke test (the gpu tests compile for real)")
def test_fp8_route_weight_sets_lower_for_cuda() -> None:
    """V4-Flash's w1 and w3 at 1 token as one call (two weight sets) pass Mosaic GPU's lowering."""
    from jax.sharding import AbstractDevice, AbstractMesh

    m, e, n, k = 6, 256, 2048, 4096
    f = functools.partial(G.fp4_grouped_linear, implementation="pallas", interpret=False)
    w = jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8)
    sc = jax.ShapeDtypeStruct((e, n, k // 32), jnp.uint8)
    args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((e,), jnp.int32), w, sc, w, sc,
            jax.ShapeDtypeStruct((m, k // 128), jnp.float32))
    dev = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=dev)):
        text = jax.jit(lambda x, s, w1, s1, w3, s3, sx: f(x, s, (w1, w3), (s1, s3), x_scale=sx)).trace(
            *args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text

