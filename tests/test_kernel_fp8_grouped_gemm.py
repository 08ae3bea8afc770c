"""The FP8 grouped (MoE) GEMM kernel (pallas_kernels/fp8_grouped_gemm.py) against a float64 numpy reference and
the XLA path.

The activation quantisation (``quant.act_quant``, tested on its own) is shared: the reference takes its xq, sx
and computes sum_k (xq sx)(Wq sw) in float64, with the weight blocks expanded here in numpy. Kernel tests run as
``interpret`` (Mosaic GPU interpret mode on the CPU) and ``native`` (marked ``gpu``). Every element of fresh
random inputs is checked:

* Products of e4m3 values are exact in float32; the kernel sums 128 of them per block in float32, then adds
  blk * (sx * sw) to a float32 running sum (three roundings per block). So |y - ref| <= rtol * sum_k |x_k W_k|
  with rtol = (2 sqrt(K) + 8 + 4 K/128) 2^-24 in interpret mode (random-walk growth) and
  (K + 4 K/128) 2^-23 natively (worst case), plus half an ulp of the output dtype.
* Rows past sum(sizes) must be exactly 0.
* Exact data (x integers in [-3, 3], so the ue8m0 quantisation is exact; weights small integers with power-of-two
  block scales): every partial sum is exact in float32, so kernel == XLA == reference bit for bit, natively too.

A CPU-only test lowers the kernel for CUDA (Mosaic GPU's layout, TMA and wgmma rules) without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.ops import quant
from jds.ops.dispatch import Unsupported
from pallas_kernels import fp8_grouped_gemm as G

from tests.kernel_modes import MODES, ON_GPU, interpret_for
from tests.tolerances import ulp


def reference(x, sizes, wq, ws, scale_fmt: str = "ue8m0") -> tuple[np.ndarray, np.ndarray]:
    """(y [M, N], sum_k |x_k W_k| [M, N]) in float64 from act_quant's xq, sx; rows past sum(sizes) 0. One expert
    at a time (the model-shape stacks would be gigabytes in float64)."""
    xq, sx = quant.act_quant(jnp.asarray(x), 128, scale_fmt)
    xd = np.asarray(xq.astype(jnp.float32), np.float64) * np.repeat(np.asarray(sx, np.float64), 128, axis=-1)
    wq, ws = np.asarray(wq.astype(jnp.float32), np.float64), np.asarray(ws, np.float64)
    m, n = xd.shape[0], wq.shape[1]
    y, ab = np.zeros((m, n)), np.zeros((m, n))
    r = 0
    for e, s in enumerate(np.asarray(sizes)):
        if s:
            w = wq[e] * np.repeat(np.repeat(ws[e], 128, axis=0), 128, axis=1)
            y[r:r + s] = xd[r:r + s] @ w.T
            ab[r:r + s] = np.abs(xd[r:r + s]) @ np.abs(w).T
        r += s
    return y, ab


def rtol(mode: str, k: int) -> float:
    nk = k // 128
    return (2 * np.sqrt(k) + 8 + 4 * nk) * 2.0 ** -24 if mode == "interpret" else (k + 4 * nk) * 2.0 ** -23


def check(got, ref, abssum, rt: float, sizes) -> None:
    dt = jnp.asarray(got).dtype
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert g.shape == ref.shape and np.isfinite(g).all()
    total = int(np.sum(sizes))
    assert (g[total:] == 0).all(), "rows past sum(sizes) are not 0"
    bound = rt * abssum + 0.5 * ulp(np.maximum(np.abs(g), np.abs(ref)), dt.name) + 1e-300
    bad = np.abs(g - ref) > bound
    if bad.any():
        ex = np.repeat(np.arange(len(sizes)), np.asarray(sizes))
        rows, cols = np.nonzero(bad[:total])
        blocks = sorted({(int(ex[r]), int(c) // 64) for r, c in zip(rows, cols)})
        pytest.fail(f"{int(bad.sum())} of {bad.size} elements out of bound; (expert, 64-column tile) blocks off: "
                    f"{blocks[:20]}")


def make_case(sizes, n: int, k: int, extra_rows: int = 0, seed: int = 0):
    """x [sum(sizes) + extra_rows, k] bf16 with row magnitudes over ~2 decades; FP8 experts quantised per
    128 x 128 block with amax / 448 scales from random normal weights (a checkpoint's format)."""
    rng = np.random.default_rng(seed)
    m = int(np.sum(sizes)) + extra_rows
    x = rng.standard_normal((m, k)) * rng.uniform(0.05, 5.0, (m, 1))
    w = rng.standard_normal((len(sizes), n, k)).astype(np.float32) * k ** -0.5 * rng.uniform(0.3, 3, (len(sizes), 1, 1))
    wq, ws = zip(*(quant.quantize_weight_blocks(we) for we in w))
    return (jnp.asarray(x, jnp.bfloat16), jnp.asarray(sizes, jnp.int32), jnp.asarray(np.stack(wq)),
            jnp.asarray(np.stack(ws), jnp.float32))


def exact_case(sizes, n: int, k: int, seed: int = 0):
    """Integer x in [-3, 3] (ue8m0 act_quant exact: x / 2^-7 is e4m3), integer weights in [-8, 8] with block
    scales 2^-4..2^-6: every partial sum is exact in float32 in any order."""
    rng = np.random.default_rng(seed)
    e, m = len(sizes), int(np.sum(sizes))
    x = rng.integers(-3, 4, (m, k)).astype(np.float32)
    wq = rng.integers(-8, 9, (e, n, k)).astype(np.float32)
    ws = np.exp2(-rng.integers(4, 7, (e, n // 128, k // 128))).astype(np.float32)
    return (jnp.asarray(x, jnp.bfloat16), jnp.asarray(sizes, jnp.int32), jnp.asarray(wq, jnp.float8_e4m3fn),
            jnp.asarray(ws))


# (sizes, n, k, extra rows past sum(sizes), out_dtype, scale_fmt, tiles)
CASES = [
    # uneven groups with 0-row experts, 2 rows past the sum; default tiles (block_t 8, one 128-row N tile)
    ([3, 0, 5, 1, 0, 2], 128, 512, 2, jnp.bfloat16, "ue8m0", {}),
    # split-K (fp32 partials summed by XLA), one compute warpgroup, 2 N tiles, a 20-row group in 16-row tiles;
    # amax / 448 activation scales
    ([20, 0, 7], 256, 1024, 1, jnp.bfloat16, "amax", dict(block_t=16, block_n=64, block_k=128, split_k=2)),
    # one expert with all rows: two token tiles; fp32 out; 256-wide steps (two K blocks per step)
    ([0, 13, 0], 128, 1024, 0, jnp.float32, "ue8m0", dict(block_t=8, block_k=256)),
    # a 128-row token tile (prefill tile), 2 N tiles
    ([130, 5], 256, 512, 3, jnp.float32, "ue8m0", dict(block_t=128)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [0] + [pytest.param(c, marks=pytest.mark.slow) for c in (1, 2, 3)])
def test_matches_reference(mode: str, case: int) -> None:
    interpret = interpret_for(mode)
    sizes, n, k, extra, out_dtype, fmt, tiles = CASES[case]
    x, sz, wq, ws = make_case(sizes, n, k, extra, seed=case)
    got = G.fp8_grouped_linear(x, sz, wq, ws, out_dtype=out_dtype, scale_fmt=fmt, implementation="pallas",
                               interpret=interpret, **tiles)
    ref, ab = reference(x, sizes, wq, ws, fmt)
    check(got, ref, ab, rtol(mode, k), sizes)


@pytest.mark.parametrize("mode,layout", [
    pytest.param("interpret", "xla", marks=pytest.mark.slow),  # CI time: the non-default layout, natively below
    ("interpret", "pallas"), ("interpret", "fused"),
    pytest.param("native", "xla", marks=pytest.mark.gpu), pytest.param("native", "pallas", marks=pytest.mark.gpu),
    pytest.param("native", "fused", marks=pytest.mark.gpu)])
def test_exact_data_bit_equal(mode: str, layout: str) -> None:
    """Exact data: kernel == XLA == reference bit for bit (addressing: expert, rows, columns, scale blocks). The
    rows' bookkeeping in XLA or in its kernel (``layout``)."""
    interpret = interpret_for(mode)
    sizes = [4, 0, 9, 1]
    x, sz, wq, ws = exact_case(sizes, 256, 1024, seed=3)
    got = G.fp8_grouped_linear(x, sz, wq, ws, out_dtype=jnp.float32, implementation="pallas", interpret=interpret,
                               layout=layout)
    want = G.fp8_grouped_linear(x, sz, wq, ws, out_dtype=jnp.float32, implementation="xla")
    ref, _ = reference(x, sizes, wq, ws)
    np.testing.assert_array_equal(np.asarray(got, np.float64), ref)
    np.testing.assert_array_equal(np.asarray(want, np.float64), ref)


def test_xla_matches_reference() -> None:
    sizes = [5, 0, 3]
    x, sz, wq, ws = make_case(sizes, 256, 512, extra_rows=1, seed=7)
    for fmt in G.SCALE_FMTS:
        got = G.fp8_grouped_linear(x, sz, wq, ws, out_dtype=jnp.float32, scale_fmt=fmt, implementation="xla")
        ref, ab = reference(x, sizes, wq, ws, fmt)
        check(got, ref, ab, rtol("native", 512), sizes)


def test_empty() -> None:
    x, sz, wq, ws = make_case([0, 0], 128, 512)
    y = G.fp8_grouped_linear(x, sz, wq, ws, implementation="pallas", interpret=True)
    assert y.shape == (0, 128)


def _args(e=2, n=128, k=512, m=4):
    return (jnp.zeros((m, k), jnp.bfloat16), jnp.asarray([m] + [0] * (e - 1), jnp.int32),
            jnp.zeros((e, n, k), jnp.float8_e4m3fn), jnp.ones((e, n // 128, k // 128), jnp.float32))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("change,field", [
    (lambda a: (a[0], a[1], a[2].astype(jnp.bfloat16), a[3]), "wq"),
    (lambda a: (a[0], a[1], a[2], a[3][:, :, :2]), "w_scale"),
    (lambda a: (a[0][:, :256], a[1], a[2], a[3]), "x"),
    (lambda a: (a[0].astype(jnp.int32), a[1], a[2], a[3]), "x"),
    (lambda a: (a[0], a[1][:1], a[2], a[3]), "sizes"),
])
def test_bad_inputs(implementation: str, change, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        G.fp8_grouped_linear(*change(_args()), implementation=implementation, interpret=True)


@pytest.mark.parametrize("mode", ["interpret", pytest.param("native", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("sizes,tiles", [
    ([4, 0, 9, 1], {}),  # split-K units over 3 CTAs (interpret mode)
    ([0, 5, 0, 0], dict(block_n=64, split_k=1)),  # two units (N tiles)
    ([0, 0, 0, 0], {}),  # no rows in the groups: no units
    ([9, 1, 17, 0], dict(block_t=16, block_k=256)),  # items at 8-row offsets of x, two K blocks per step
    ([130, 5, 0, 0], dict(block_t=128)),  # a prefill token tile
])
def test_persistent_exact_bit_equal(mode: str, sizes: list[int], tiles: dict) -> None:
    """``persistent=True``: CTAs with several units, one or none, exact data: kernel == reference bit for bit
    (the ring's scale chunks and the units' stores), and 3 rows past the groups give 0."""
    x, sz, wq, ws = exact_case(sizes, 256, 1024, seed=len(sizes) + sum(sizes))
    x = jnp.concatenate([x, jnp.ones((3, 1024), x.dtype)])
    got = G.fp8_grouped_linear(x, sz, wq, ws, out_dtype=jnp.float32, implementation="pallas",
                               interpret=interpret_for(mode), persistent=True, **tiles)
    ref, _ = reference(x[:sum(sizes)], sizes, wq, ws)
    np.testing.assert_array_equal(np.asarray(got, np.float64)[:sum(sizes)], ref)
    assert (np.asarray(got)[sum(sizes):] == 0).all()


@pytest.mark.skipif(ON_GPU, reason="GPU interpret mode's race detector runs on the CPU")
@pytest.mark.parametrize("persistent", [False, True])
def test_no_races(persistent: bool) -> None:
    """Interpret mode's race detector over both forms' rings with slots reused (K = 1024 in 128-wide steps on 2
    stages): the compute warpgroups read their weight tiles and scales through the generic proxy, a race against
    the slot's next TMA write without the step's proxy fence (``fp8_gemm.fence_slot_reads``; checked by removing
    it)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    x, sz, wq, ws = make_case([5, 0, 9], 256, 1024, seed=4)
    y = G.fp8_grouped_linear(x, sz, wq, ws, implementation="pallas", block_k=128, split_k=1, stages=2,
                             persistent=persistent, interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(y)
    assert not gpu_callbacks.get_races().races_found


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_t=12), "block_t"), (dict(block_n=256), "block_n"), (dict(block_k=512), "block_k"),
    (dict(split_k=3), "split_k"), (dict(stages=0), "stages"), (dict(scale_fmt="e8m0"), "scale_fmt"),
    (dict(implementation="cuda"), "implementation"), (dict(persistent=1), "persistent"),
])
def test_bad_params(kwargs: dict, field: str) -> None:
    kw = dict(implementation="pallas", interpret=True) | kwargs
    with pytest.raises(ValueError, match=field):
        G.fp8_grouped_linear(*_args(), **kw)


def test_unsupported_falls_back() -> None:
    """K not a multiple of 512: the kernel refuses, "auto" runs XLA."""
    x, sz, wq, ws = make_case([3, 2], 128, 384)
    with pytest.raises(Unsupported, match="K = 384"):
        G.fp8_grouped_linear(x, sz, wq, ws, implementation="pallas", interpret=True)
    got = G.fp8_grouped_linear(x, sz, wq, ws, out_dtype=jnp.float32, implementation="auto", interpret=True)
    want = G.fp8_grouped_linear(x, sz, wq, ws, out_dtype=jnp.float32, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _lower_for_cuda(m: int, e: int, n: int, k: int, **tiles) -> str:
    from jax.sharding import AbstractDevice, AbstractMesh

    f = jax.jit(functools.partial(G.fp8_grouped_linear, implementation="pallas", interpret=False, **tiles))
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((e,), jnp.int32),
            jax.ShapeDtypeStruct((e, n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((e, n // 128, k // 128), jnp.float32))
    dev = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=dev)):
        return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(ON_GPU, reason="CPU-only cross-lowering smoke test (the gpu tests compile for real)")
@pytest.mark.parametrize("m,e,n,k,tiles", [
    (8, 256, 2048, 7168, {}),  # V3.2 w1 / w3 decode, one token x top-8: split-K
    (64, 256, 7168, 2048, {}),  # w2 decode, 8 tokens
    pytest.param(32768, 256, 2048, 7168, {}, marks=pytest.mark.slow),  # prefill: 128-row token tiles
    (40, 8, 256, 1024, dict(block_t=16, block_n=64, block_k=128, split_k=2)),
    (8, 256, 2048, 7168, dict(persistent=True)),
    (64, 256, 7168, 2048, dict(persistent=True, block_k=256)),
])
def test_lowers_for_cuda(m: int, e: int, n: int, k: int, tiles: dict) -> None:
    """The kernel passes Mosaic GPU's lowering (register-A float16 wgmma, TMA of the scales, layouts) for CUDA."""
    text = _lower_for_cuda(m, e, n, k, **tiles)
    assert "mosaic_gpu" in text and ".f32.f16.f16" in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="native kernel needs a CUDA GPU")
@pytest.mark.parametrize("k,n", [(7168, 2048), (2048, 7168)])  # V3.2 w1 / w3 and w2
@pytest.mark.parametrize("e,regime", [(32, "decode"), (16, "prefill")])
def test_native_model_shapes(k: int, n: int, e: int, regime: str) -> None:
    """Decode: 1-4 rows on some experts, none on the rest; prefill: one group of 300 rows among small ones."""
    rng = np.random.default_rng(k + e)
    sizes = [0] * e
    for i in rng.choice(e, e // 2, replace=False):
        sizes[i] = int(rng.integers(1, 5))
    if regime == "prefill":
        sizes[3] = 300
    x, sz, wq, ws = make_case(sizes, n, k, extra_rows=2, seed=e)
    got = G.fp8_grouped_linear(x, sz, wq, ws, out_dtype=jnp.float32, implementation="pallas")
    ref, ab = reference(x, sizes, wq, ws)
    check(got, ref, ab, rtol("native", k), sizes)
    xe, sze, wqe, wse = exact_case(sizes, n, k, seed=e)
    got = G.fp8_grouped_linear(xe, sze, wqe, wse, out_dtype=jnp.float32, implementation="pallas")
    np.testing.assert_array_equal(np.asarray(got, np.float64), reference(xe, sizes, wqe, wse)[0])


@pytest.mark.parametrize("mode", MODES)
def test_linear_grouped_on_the_kernel(mode: str) -> None:
    """``Linear.grouped`` with an FP8 weight (V4's grouped ``wo_a``) off the "xla" implementation runs this kernel,
    its groups as experts of T rows each: on exact data it equals the XLA form (dequantised float32 batched dot) bit
    for bit, which checks the group-major copy of x, the weight and scale views per group and the way back."""
    from flax import nnx

    from jds.nn import Linear

    interpret_for(mode)  # the kernel's own default: interpret mode off-GPU
    g, t, k, n = 3, 5, 512, 128
    lin = Linear(k, g * n, dtype=jnp.bfloat16, fp8=True, rngs=nnx.Rngs(0))
    _, _, wq, ws = exact_case([1] * g, n, k, seed=5)
    lin.weight[...] = wq.reshape(g * n, k)
    lin.scale[...] = ws.reshape(g * n // 128, k // 128)
    x = jnp.asarray(np.random.default_rng(6).integers(-3, 4, (2, t, g, k)), jnp.float32)  # [..., G, in]
    lin.implementation = "xla"
    want = lin.grouped(x, jnp.float32)
    lin.implementation = "pallas"
    got = lin.grouped(x, jnp.float32)
    assert got.shape == want.shape == (2, t, g, n)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
