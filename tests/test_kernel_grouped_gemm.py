"""The grouped (MoE) block-scaled linear kernel (pallas_kernels/fp8_gemm.py ``grouped_linear``) against its
XLA path (dequantise x and every expert's weight to fp32, one HIGHEST ``ragged_dot``), for both weight
formats: "fp8" (e4m3 [G, N, K] with 128 x 128 float32 scales, V3.2) and "fp4" (packed e2m1 [G, N, K/2] with
e8m0 bytes per 1 x 32, V4-Flash's ``FP4Experts``).

Every kernel test runs in ``interpret`` mode (Mosaic GPU interpret mode on the CPU) and ``native`` (marked
``gpu``). Checked on every element of the [M, N] output (rows of every group, empty groups, the zero rows of
a padded tail): fp32 out within rtol * sum_k |x_k W_k| of the reference (interpret: fp32 summation
round-off; native: 2^-9, the FP8 kernel's native bound), bf16 out one bf16 ulp more; exact data (small
integers, power-of-two scales) bit-equal. Heavier interpret cases are ``slow``.
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
HIGHEST = jax.lax.Precision.HIGHEST


def _rtol(mode: str, k: int) -> float:
    return (2 * np.sqrt(k) + 8) * 2.0 ** -24 if mode == "interpret" else 2.0 ** -9


def make_weights(fmt: str, g: int, n: int, k: int, seed: int, w_fmt: str = "amax"):
    """(w, w_scale) of ``g`` experts [n, k]: fp8 blocks quantised with ``w_fmt`` scales from rows / columns of
    spread magnitudes; fp4 random codes with per-block scales 2^{-1, 0, 1} around ~ 1 / sqrt(k)."""
    if fmt == "fp4":
        return quant.random_fp4_weight(jax.random.key(seed), (g, n, k), k ** -0.5)
    rng = np.random.default_rng(seed)
    ws, ss = [], []
    for _ in range(g):
        w = rng.standard_normal((n, k)) * rng.uniform(0.05, 5.0, (n, 1)) * rng.uniform(0.2, 2.0, (1, k))
        q, s = quant.quantize_weight_blocks_jax(jnp.asarray(w, jnp.float32), 128, w_fmt)
        ws.append(q)
        ss.append(s)
    return jnp.stack(ws), jnp.stack(ss)


def make_x(m: int, k: int, seed: int, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed + 1000)
    x = rng.standard_normal((m, k)) * rng.uniform(0.05, 5.0, (m, 1))
    return jnp.asarray(x, dtype)


def dequant_w(fmt: str, w, s):
    if fmt == "fp4":
        return quant.fp4_dequant(w, s, jnp.float32)
    g, n, k = w.shape
    return jnp.stack([quant.dequant_weight_blocks(w[i], s[i]) for i in range(g)])


def reference(fmt, x, w, s, sizes, scale_fmt):
    """(fp32 reference y, sum_k |x_k W_k| per element, zero past the sum of sizes)."""
    y = G.grouped_linear(x, w, s, sizes, weight_format=fmt, out_dtype=jnp.float32, scale_fmt=scale_fmt,
                         implementation="xla")
    xd = quant.fake_quant(x, 128, scale_fmt)
    abssum = jax.lax.ragged_dot(jnp.abs(xd), jnp.swapaxes(jnp.abs(dequant_w(fmt, w, s)), 1, 2), sizes,
                                precision=HIGHEST, preferred_element_type=jnp.float32)
    return np.asarray(y, np.float64), np.asarray(abssum, np.float64)


def check(got, ref, abssum, rtol: float, out_dtype, n_valid: int) -> None:
    """Every element within the bound; the padded tail rows exactly zero."""
    g = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert g.shape == ref.shape and np.isfinite(g).all()
    assert (g[n_valid:] == 0).all(), "padding rows must be zero"
    bound = rtol * abssum + 1e-30
    want = ref
    if jnp.dtype(out_dtype) == jnp.bfloat16:
        want = np.asarray(jnp.asarray(ref, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
        bound = bound + ulp(np.maximum(np.abs(g), np.abs(want)), "bfloat16")
    err = np.abs(g - want)
    worst = float((err / bound).max())
    assert (err <= bound).all(), f"{int((err > bound).sum())} of {err.size} elements out of bound, worst ratio {worst:.2f}"


# (fmt, m, sizes, n, k, out_dtype, scale_fmt, tiles, slow)
CASES = [
    ("fp8", 1, [0, 1, 0, 0], 128, 256, jnp.bfloat16, "ue8m0", {}, False),  # decode: one row, 3 empty experts
    ("fp8", 70, [0, 30, 0, 25, 10], 128, 256, jnp.float32, "amax", dict(block_n=64), True),  # 5-row padded tail
    ("fp8", 300, [130, 0, 150], 256, 256, jnp.bfloat16, "ue8m0", dict(block_m=128, block_n=256), True),
    ("fp8", 200, [64, 64, 64], 128, 384, jnp.float32, "ue8m0", dict(block_m=64, stages=2), True),  # aligned groups
    ("fp4", 1, [0, 0, 1, 0], 128, 256, jnp.bfloat16, "ue8m0", {}, False),  # decode: 8-token tile
    ("fp4", 45, [0, 17, 3, 0, 20, 0], 256, 256, jnp.float32, "ue8m0", dict(block_m=16), True),
    ("fp4", 300, [0, 200, 90], 128, 384, jnp.bfloat16, "ue8m0", dict(block_m=64, stages=2), True),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [pytest.param(i, marks=pytest.mark.slow) if c[-1] else i for i, c in enumerate(CASES)])
def test_matches_xla(mode: str, case: int) -> None:
    interpret = interpret_for(mode)
    fmt, m, sizes, n, k, out_dtype, scale_fmt, tiles, _ = CASES[case]
    w, s = make_weights(fmt, len(sizes), n, k, seed=case, w_fmt="ue8m0" if scale_fmt == "amax" else "amax")
    x = make_x(m, k, seed=case)
    gs = jnp.asarray(sizes, jnp.int32)
    got = G.grouped_linear(x, w, s, gs, weight_format=fmt, out_dtype=out_dtype, scale_fmt=scale_fmt,
                           implementation="pallas", interpret=interpret, **tiles)
    assert got.dtype == jnp.dtype(out_dtype) and got.shape == (m, n)
    ref, abssum = reference(fmt, x, w, s, gs, scale_fmt)
    check(got, ref, abssum, _rtol(mode, k), out_dtype, sum(sizes))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_exact_data_bit_equal(mode: str, fmt: str) -> None:
    """Small-integer x (a +-2 in every 128 block: ue8m0 scale 2^-6 exactly) and weights whose every product
    and partial sum is exact at any accumulator precision >= 11 bits: the kernel must equal the reference
    bit for bit (addressing of rows, groups, K blocks / 32-blocks and both nibbles, scale placement)."""
    interpret = interpret_for(mode)
    m, k, n, sizes = 40, 256, 128, [5, 0, 21, 9]  # 5 padding rows
    rng = np.random.default_rng(7)
    x = rng.integers(-2, 3, (m, k)).astype(np.float32)
    x[:, ::128] = 2.0
    if fmt == "fp8":
        wf = rng.integers(-2, 3, (len(sizes), n, k)).astype(np.float32)
        wf[:, :, ::128] = -2.0
        qs = [quant.quantize_weight_blocks_jax(jnp.asarray(wf[i]), 128, "ue8m0") for i in range(len(sizes))]
        w, s = jnp.stack([q for q, _ in qs]), jnp.stack([t for _, t in qs])
    else:
        codes = rng.integers(0, 16, (len(sizes), n, k)).astype(np.uint8)
        w = jnp.asarray(codes[..., 0::2] | (codes[..., 1::2] << 4))
        s = jnp.asarray(rng.integers(125, 130, (len(sizes), n, k // 32)).astype(np.uint8))  # 2^-2 .. 2^2
    gs = jnp.asarray(sizes, jnp.int32)
    got = G.grouped_linear(jnp.asarray(x, jnp.bfloat16), w, s, gs, weight_format=fmt, out_dtype=jnp.float32,
                           implementation="pallas", interpret=interpret)
    want = G.grouped_linear(jnp.asarray(x, jnp.bfloat16), w, s, gs, weight_format=fmt, out_dtype=jnp.float32,
                            implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (np.asarray(got)[sum(sizes):] == 0).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["fp8", pytest.param("fp4", marks=pytest.mark.slow)])
def test_auto_runs_kernel_under_jit(mode: str, fmt: str) -> None:
    """"auto" takes the kernel for supported shapes, under jit with traced group sizes (fp8 with amax
    activation scales)."""
    interpret = interpret_for(mode)
    w, s = make_weights(fmt, 3, 128, 128, seed=3)
    x = make_x(9, 128, seed=3)
    gs = jnp.asarray([4, 0, 3], jnp.int32)
    scale_fmt = "amax" if fmt == "fp8" else "ue8m0"
    f = jax.jit(functools.partial(G.grouped_linear, weight_format=fmt, out_dtype=jnp.float32, scale_fmt=scale_fmt,
                                  implementation="auto", interpret=interpret))
    ref, abssum = reference(fmt, x, w, s, gs, scale_fmt)
    check(f(x, w, s, gs), ref, abssum, _rtol(mode, 128), jnp.float32, 7)
    text = str(jax.make_jaxpr(f)(x, w, s, gs))
    assert any(p + "[" in text for p in KERNEL_PRIMITIVES), "auto did not run the kernel"


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="GPU interpret mode's race detector runs on the CPU")
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_no_races(fmt: str) -> None:
    """Interpret mode's race detector over the warp-specialised TMA ring (producer vs 2 consumers, slot reuse
    over 3 K steps with a 2-deep ring) and, for fp4, each warpgroup's SMEM A-fragment buffer."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    w, s = make_weights(fmt, 3, 128, 384, seed=9)
    y = G.grouped_linear(make_x(20, 384, seed=9), w, s, jnp.asarray([6, 0, 11], jnp.int32), weight_format=fmt,
                         out_dtype=jnp.float32, implementation="pallas", stages=2,
                         interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(y)
    assert not gpu_callbacks.get_races().races_found


def test_xla_fp4_matches_v4_moe_math() -> None:
    """The XLA reference is V4MoE's FP4 expert GEMM (``_expert_input`` + dequantised weights in the activation
    dtype + ragged_dot with fp32 accumulation): same products, fp32 summation order aside."""
    from jds.v4_block import _expert_input, _ragged_linear

    w, s = make_weights("fp4", 4, 128, 256, seed=4)
    x = make_x(30, 256, seed=4)
    gs = jnp.asarray([7, 0, 12, 8], jnp.int32)
    model = _ragged_linear(_expert_input(x, True), quant.fp4_dequant(w, s, x.dtype), gs, jnp.float32)
    ref, abssum = reference("fp4", x, w, s, gs, "ue8m0")
    check(model, ref, abssum, _rtol("interpret", 256), jnp.float32, 27)


def test_empty_m() -> None:
    w, s = make_weights("fp8", 2, 128, 128, seed=0)
    y = G.grouped_linear(jnp.zeros((0, 128), jnp.bfloat16), w, s, jnp.zeros((2,), jnp.int32), weight_format="fp8",
                         implementation="pallas")
    assert y.shape == (0, 128) and y.dtype == jnp.bfloat16


def test_work_tables() -> None:
    """Items = (group, first row) tiles of each group's rows in order; every valid row maps to its slot row."""
    sizes = jnp.asarray([0, 5, 0, 9, 1], jnp.int32)
    m, bm = 17, 4
    items = G._num_items(m, 5, bm)
    table, src, valid = G._work_tables(sizes, m, bm, items)
    t = np.asarray(table)
    want = [(1, 1, 0), (1, 1, 4), (1, 3, 5), (1, 3, 9), (1, 3, 13), (1, 4, 14)]
    assert [tuple(r) for r in t[:len(want)]] == want and (t[len(want):, 0] == 0).all()
    assert list(np.asarray(valid)) == [True] * 15 + [False] * 2
    assert list(np.asarray(src)[:15]) == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20]


# ----- errors -------------------------------------------------------------------------------------
def test_unsupported_falls_back() -> None:
    """out = 192 (fp8) and fp4 with amax activation scales: explicit "pallas" raises Unsupported; "auto" runs XLA."""
    w, s = make_weights("fp8", 2, 192, 128, seed=1)
    x = make_x(4, 128, seed=1)
    gs = jnp.asarray([1, 2], jnp.int32)
    with pytest.raises(Unsupported, match="out = 192"):
        G.grouped_linear(x, w, s, gs, weight_format="fp8", implementation="pallas")
    got = G.grouped_linear(x, w, s, gs, weight_format="fp8", out_dtype=jnp.float32, implementation="auto")
    want = G.grouped_linear(x, w, s, gs, weight_format="fp8", out_dtype=jnp.float32, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    w4, s4 = make_weights("fp4", 2, 128, 128, seed=1)
    with pytest.raises(Unsupported, match="scale_fmt"):
        G.grouped_linear(x, w4, s4, gs, weight_format="fp4", scale_fmt="amax", implementation="pallas")
    f = functools.partial(G.grouped_linear, weight_format="fp4", scale_fmt="amax", out_dtype=jnp.float32,
                          implementation="auto")
    text = str(jax.make_jaxpr(f)(x, w4, s4, gs))
    assert not any(p + "[" in text for p in KERNEL_PRIMITIVES)


def _fp8(g=2, n=128, k=256):
    return jnp.zeros((g, n, k), FP8), jnp.ones((g, n // 128, k // 128), jnp.float32)


def _fp4(g=2, n=128, k=256):
    return jnp.zeros((g, n, k // 2), jnp.uint8), jnp.full((g, n, k // 32), 127, jnp.uint8)


X = lambda m=4, k=256: jnp.ones((m, k), jnp.bfloat16)  # noqa: E731
GS = jnp.asarray([1, 2], jnp.int32)


@pytest.mark.parametrize("implementation", ["xla", "pallas", "auto"])
@pytest.mark.parametrize("args,field", [
    (lambda: (X(), *_fp8(), GS, "fp16"), "weight_format"),
    (lambda: (X(), _fp8()[0].astype(jnp.bfloat16), _fp8()[1], GS, "fp8"), "w must"),
    (lambda: (X(), _fp8()[0][0], _fp8()[1], GS, "fp8"), "w must"),
    (lambda: (X(), _fp8()[0], _fp8()[1][:, :, :1], GS, "fp8"), "w_scale"),
    (lambda: (X(), _fp4()[0].astype(jnp.int8), _fp4()[1], GS, "fp4"), "w must"),
    (lambda: (X(), _fp4()[0], _fp4()[1].astype(jnp.float32), GS, "fp4"), "w_scale"),
    (lambda: (X(), _fp4()[0], _fp4()[1][:, :, :4], GS, "fp4"), "w_scale"),
    (lambda: (X(k=128), *_fp4(), GS, "fp4"), "x must"),
    (lambda: (X().astype(jnp.int32), *_fp8(), GS, "fp8"), "x must"),
    (lambda: (X(), *_fp8(), GS[:1], "fp8"), "group_sizes"),
    (lambda: (X(), *_fp8(), GS.astype(jnp.float32), "fp8"), "group_sizes"),
    (lambda: (X(m=2), *_fp8(), GS, "fp8"), "group_sizes"),  # sum 3 > M = 2
    (lambda: (X(), *_fp8(), jnp.asarray([-1, 2], jnp.int32), "fp8"), "group_sizes"),
])
def test_bad_inputs(implementation: str, args, field: str) -> None:
    x, w, s, gs, fmt = args()
    with pytest.raises(ValueError, match=field):
        G.grouped_linear(x, w, s, gs, weight_format=fmt, implementation=implementation)


@pytest.mark.parametrize("fmt,kwargs,field", [
    ("fp8", dict(block_m=32), "block_m"), ("fp8", dict(block_n=96), "block_n"), ("fp8", dict(block_n=256), "block_n"),
    ("fp4", dict(block_m=24), "block_m"), ("fp4", dict(block_n=256), "block_n"), ("fp8", dict(stages=0), "stages"),
    ("fp8", dict(scale_fmt="e5m2"), "scale_fmt"), ("fp8", dict(implementation="cuda"), "implementation"),
])
def test_bad_params(fmt: str, kwargs: dict, field: str) -> None:
    w, s = _fp8(n=384) if fmt == "fp8" else _fp4(n=384)  # out = 384: block_n 256 does not divide it
    with pytest.raises(ValueError, match=field):
        G.grouped_linear(X(), w, s, GS, weight_format=fmt, **{"implementation": "pallas", **kwargs})


# ----- lowering for CUDA on the CPU ---------------------------------------------------------------
@pytest.mark.skipif(ON_GPU, reason="CPU-only cross-lowering smoke test (the gpu tests compile for real)")
@pytest.mark.parametrize("fmt,m,g,k,n,tiles", [
    ("fp8", 64, 256, 7168, 2048, {}), ("fp8", 300, 8, 512, 512, dict(block_m=128, block_n=256)),
    ("fp4", 48, 256, 4096, 2048, {}), ("fp4", 300, 8, 512, 256, dict(block_m=128)),
])
def test_lowers_for_cuda(fmt: str, m: int, g: int, k: int, n: int, tiles: dict) -> None:
    """The compiled kernels pass Mosaic GPU's lowering (wgmma operand rules, TMA, layouts, register decode)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    f = jax.jit(functools.partial(G.grouped_linear, weight_format=fmt, out_dtype=jnp.bfloat16,
                                  implementation="pallas", interpret=False, **tiles))
    if fmt == "fp8":
        wt = (jax.ShapeDtypeStruct((g, n, k), FP8), jax.ShapeDtypeStruct((g, n // 128, k // 128), jnp.float32))
    else:
        wt = (jax.ShapeDtypeStruct((g, n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((g, n, k // 32), jnp.uint8))
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), *wt, jax.ShapeDtypeStruct((g,), jnp.int32))
    dev = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=dev)):
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and (".f32.e4m3.e4m3" if fmt == "fp8" else ".f32.bf16.bf16") in text
