"""The token-level sparse MQA kernel (pallas_kernels/sparse_mqa.py) against the pure-JAX path
(``implementation="xla"``: read_records + jds.ops.sparse_mqa) over the paged caches.

Every kernel test runs twice: ``interpret`` (Mosaic GPU interpret mode on the CPU, small shapes) and ``native``
(marked ``gpu``: the compiled kernel, skipped unless jax.default_backend() == "gpu"; larger, real shapes).
Cases: V3.2 656-byte records (UE8M0 and vLLM amax scales), V4 584-byte records over two caches (window +
compressed, different entries per page) with the sink, bf16 FloatRows (576 and 512 wide), padded heads
(4 -> 64, 72 -> 128), candidate splits merged in JAX, rows with no valid candidate (zeros, never NaN), and
the V3.2 / V4 layers' ``attend`` switched to the kernel. A CPU-only test lowers the kernel for CUDA at the
real shapes (no GPU needed) to catch Mosaic layout / TMA / wgmma / shared-memory rule errors.

Tolerance (every element): |kernel - xla| <= TOL * max|V| with V the dequantised value rows. The xla path
multiplies in fp32; the kernel feeds the tensor cores bf16 q, K, V and P with fp32 accumulation. The test
q is bf16-exact and K/V are bf16-exact for bf16 rows and for power-of-two scales (e4m3 * 2^k has 4 significant
bits), so the one rounding left is P -> bf16: p_i (1 + e_i), |e_i| <= 2^-9, moves o = sum p_i v_i / sum p_i by
at most 2^-9 max|v_i - o| <= 2^-8 max|V| (the fp32 l sum, exp2.approx and fp32 MMA accumulation order add
~1e-6 relative). With vLLM's amax scales (not powers of two) K/V themselves round to bf16 (2^-9 relative),
adding at most 2^-9 max|V| to the values and a logit error that is a sum of independent roundings (about
2^-9 * scale * |q| |k| / sqrt(d) ~ 1e-3 here): 2^-7 max|V| covers both.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh

from jds.batch import Chunk, make_batch
from jds.config import Numerics, V32Config, V4Config
from jds.ops.paging import empty_cache, read_records, write_records
from jds.ops.sparse_mqa import sparse_mqa as sparse_mqa_reference
from jds.ops.records import FloatRows, MlaRecord584, MlaRecord656
from jds.v32 import V32Attention
from jds.v4 import V4Attention
from pallas_kernels import sparse_mqa as mqa

from tests.kernel_modes import MODES, ON_GPU, interpret_for, pallas_calls
TOL_EXACT_KV = 2.0 ** -8
# Peaked softmaxes (logits of tens) turn K's bf16 rounding (2^-9 relative) into probability shifts of a few
# percent; the H200 measured 2.3% of max|V| on test_v32_fp8[amax] (2026-11-29), hence 2^-4 vs fp32 K.
TOL_AMAX_VS_F32 = 2.0 ** -4
# a bf16 output: with candidate splits each split's normalised rows are rounded to bf16 too (2^-9 relative each
# time, at most max|V|), then the merged row once more
TOL_BF16_OUT = TOL_EXACT_KV + 2.0 ** -8


_interpret = interpret_for


def _bf16_exact(x: np.ndarray) -> jax.Array:
    return jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


def _cache(fmt, num_blocks: int, dim: int, rng: np.random.Generator, spread: float = 1.0) -> jax.Array:
    """A full cache of random rows (per-row magnitudes vary so the FP8 scales differ)."""
    n = num_blocks * fmt.entries_per_page
    rows = rng.standard_normal((n, dim)).astype(np.float32) * np.exp(spread * rng.standard_normal((n, 1)))
    return _write_all(fmt, num_blocks, jnp.asarray(rows))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _write_all(fmt, num_blocks: int, rows: jax.Array) -> jax.Array:
    """Every slot of an empty cache written (one compiled program, not an eager op per step of write_records)."""
    return write_records(empty_cache(fmt, num_blocks), fmt, jnp.arange(rows.shape[0], dtype=jnp.int32), rows)


def _slots(rng, t: int, k: int, n: int, p_masked: float, empty_rows=()) -> jax.Array:
    s = np.where(rng.random((t, k)) < p_masked, -1, rng.integers(0, n, (t, k))).astype(np.int32)
    for r in empty_rows:
        s[r] = -1
    return jnp.asarray(s)


def _bf16_k_reference(q, caches, fmts, slots, *, scale, v_dim, sink):
    """The pure-JAX attention over K/V rows rounded to bf16, as the kernel feeds its tensor cores (with
    vLLM's amax scales the dequantised K is not bf16-exact; with UE8M0 scales it is)."""
    rows = jnp.concatenate([read_records(c, f, s) for c, f, s in zip(caches, fmts, slots)], axis=1)
    valid = jnp.concatenate([s >= 0 for s in slots], axis=1)
    rows = rows.astype(jnp.bfloat16).astype(jnp.float32)
    return sparse_mqa_reference(q, rows, valid, scale=scale, v_dim=v_dim, sink=sink)


# without excess precision (as the runner compiles): the bf16 rounding of K in _bf16_k_reference stays
@functools.partial(jax.jit, static_argnames=("fmts", "scale", "v_dim", "bf16_k"),
                   compiler_options={"xla_allow_excess_precision": False})
def _reference(q, caches, fmts, slots, sink, *, scale, v_dim, bf16_k):
    """(the pure-JAX attention, max|V| over the candidate rows) in one compiled program (eagerly, every op of
    read_records and the softmax would compile on its own, per shape)."""
    if bf16_k:
        want = _bf16_k_reference(q, caches, fmts, slots, scale=scale, v_dim=v_dim, sink=sink)
    else:
        want = mqa.sparse_mqa(q, caches, fmts, slots, scale=scale, v_dim=v_dim, sink=sink, implementation="xla")
    vmax = jnp.max(jnp.stack([jnp.abs(read_records(c, f, jnp.maximum(s, 0))[..., :v_dim]).max()
                              for c, f, s in zip(caches, fmts, slots)]))
    return want, vmax


def _check(q, caches, fmts, slots, *, scale, v_dim, sink, tol, interpret, num_splits=None, bf16_k=False, **kw):
    got = mqa.sparse_mqa(q, caches, fmts, slots, scale=scale, v_dim=v_dim, sink=sink, num_splits=num_splits,
                         interpret=interpret, **kw)
    want, vmax = _reference(q, tuple(caches), tuple(fmts), tuple(slots), sink, scale=scale, v_dim=v_dim,
                            bf16_k=bf16_k)
    got, want, vmax = np.asarray(got).astype(np.float32), np.asarray(want), float(vmax)
    assert got.shape == want.shape == (q.shape[0], q.shape[1], v_dim)
    assert np.isfinite(got).all()
    err = np.abs(got - want)
    assert err.max() <= tol * vmax, f"max err {err.max():.3g} > {tol:.3g} * max|V| {vmax:.3g}"
    return got


# ----- V3.2: absorbed MLA over the 656-byte record ------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale_fmt", ["ue8m0", pytest.param("amax", marks=pytest.mark.slow)])
def test_v32_fp8(mode, scale_fmt):
    interpret = _interpret(mode)
    rng = np.random.default_rng(1)
    if interpret:  # 4 heads (padded to 64), 2 blocks of candidates, one row fully masked
        t, h, k, nblk, epp = 3, 4, 100, 8, 16
    else:  # V3.2 decode shape: 128 heads, top-2048
        t, h, k, nblk, epp = 4, 128, 2048, 96, 64
    fmt = MlaRecord656(epp, scale_fmt)
    cache = _cache(fmt, nblk, 576, rng)
    slots = _slots(rng, t, k, nblk * epp, 0.2, empty_rows=(1,))
    q = _bf16_exact(rng.standard_normal((t, h, 576)))
    for producer in (None,) if interpret else (None, "tma"):  # natively None is the register producer
        out = _check(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, sink=None, tol=TOL_EXACT_KV,
                     interpret=interpret, bf16_k=scale_fmt == "amax", producer=producer)
    if scale_fmt == "amax":  # against the fp32-K attention: the bf16 rounding of K is all that differs
        _check(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, sink=None, tol=TOL_AMAX_VS_F32, interpret=interpret)
    assert np.all(out[1] == 0.0)  # no valid candidate -> zeros


@pytest.mark.parametrize("mode", MODES)
def test_q_rope_apart(mode):
    """q's last 64 columns passed apart (``q_rope``, V3.2's absorbed form) give the very rows of the whole q: the
    same values land in the same q tile. Natively also with the cluster merge (whose q multicast takes a whole q),
    the TMA producer and bf16 rows stored through the q tile. Also the XLA path, and bad arguments."""
    interpret = _interpret(mode)
    rng = np.random.default_rng(11)
    t, h, k, nblk, epp = (3, 4, 100, 8, 16) if interpret else (4, 128, 2048, 96, 64)
    fmt = MlaRecord656(epp, "ue8m0")
    cache = _cache(fmt, nblk, 576, rng)
    slots = _slots(rng, t, k, nblk * epp, 0.2, empty_rows=(1,))
    q = _bf16_exact(rng.standard_normal((t, h, 576))).astype(jnp.bfloat16)
    forms = [dict()]
    if not interpret:
        forms += [dict(num_splits=2, merge="cluster"), dict(producer="tma"), dict(out_dtype=jnp.bfloat16)]
    for impl, kw in [("pallas", kw) for kw in forms] + [("xla", {})]:
        args = dict(scale=0.06, v_dim=512, implementation=impl, interpret=interpret, **kw)
        whole = mqa.sparse_mqa(q, [cache], [fmt], [slots], **args)
        apart = mqa.sparse_mqa(q[..., :512], [cache], [fmt], [slots], q_rope=q[..., 512:], **args)
        np.testing.assert_array_equal(np.asarray(apart), np.asarray(whole), err_msg=f"{impl} {kw}")
    with pytest.raises(ValueError, match="q_rope"):
        mqa.sparse_mqa(q[..., :512], [cache], [fmt], [slots], q_rope=q[:1, :, 512:], scale=0.06, v_dim=512)
    if not interpret:
        with pytest.raises(ValueError, match="q_multicast=True takes a whole q"):
            mqa.sparse_mqa(q[..., :512], [cache], [fmt], [slots], q_rope=q[..., 512:], scale=0.06, v_dim=512,
                           num_splits=2, merge="cluster", q_multicast=True)
    with pytest.raises(ValueError, match="q_rope's columns included"):
        mqa.sparse_mqa(q[..., :512], [cache], [fmt], [slots], q_rope=q[..., 480:], scale=0.06, v_dim=512)


@pytest.mark.parametrize("mode", MODES)
def test_v32_padded_heads_and_splits(mode):
    """72 heads -> two 64-head tiles (56 padded heads); 3 candidate blocks (the middle one fully masked, so
    2 live blocks) cut into 2 and 3 splits (the third split has no block: it contributes nothing)."""
    interpret = _interpret(mode)
    rng = np.random.default_rng(2)
    t, h, k, epp = (1, 72, 150, 8) if interpret else (3, 200, 1000, 8)
    fmt = MlaRecord656(epp, "ue8m0")
    cache = _cache(fmt, 12, 576, rng)
    slots = _slots(rng, t, k, 12 * epp, 0.3).at[0, 64:128].set(-1)  # a dead middle block is skipped
    q = _bf16_exact(rng.standard_normal((t, h, 576)))
    for s in (2, 3):
        _check(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, sink=None, tol=TOL_EXACT_KV,
               interpret=interpret, num_splits=s)
    # a bf16 output merged from fp32 split rows (the default) and from bf16 ones (``split_dtype``)
    for sd in (None, jnp.bfloat16):
        _check(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, sink=None, tol=TOL_BF16_OUT, interpret=interpret,
               num_splits=2, out_dtype=jnp.bfloat16, split_dtype=sd)
    # bf16 rows stored through the q tile and TMA copies (``out_store``, the default for bf16 rows): one split and
    # bf16 split rows; and each thread's own stores ("direct")
    for splits in (1, 2):
        _check(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, sink=None, tol=TOL_BF16_OUT, interpret=interpret,
               num_splits=splits, out_dtype=jnp.bfloat16, split_dtype=jnp.bfloat16, out_store="tma")
    _check(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, sink=None, tol=TOL_BF16_OUT, interpret=interpret,
           num_splits=1, out_dtype=jnp.bfloat16, out_store="direct")


def _v32_masked_row_splits(interpret, heads: int, rng: np.random.Generator, **kw):
    """V3.2's records, row 1 fully masked (zeros), at one and two splits: interpret mode 2 tokens x 4 heads over
    300 candidates (5 blocks), natively 4 tokens x ``heads`` over 2048; -> (cache, fmt, slots, q)."""
    t, h, k, nblk, epp = (2, 4, 300, 8, 16) if interpret else (4, heads, 2048, 96, 64)
    fmt = MlaRecord656(epp, "ue8m0")
    cache = _cache(fmt, nblk, 576, rng)
    slots = _slots(rng, t, k, nblk * epp, 0.2, empty_rows=(1,))
    q = _bf16_exact(rng.standard_normal((t, h, 576)))
    for splits in (1, 2):
        out = _check(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, sink=None, tol=TOL_EXACT_KV,
                     interpret=interpret, num_splits=splits, **kw)
        assert np.all(out[1] == 0.0)
    return cache, fmt, slots, q


@pytest.mark.parametrize("producer", ["registers"] + [pytest.param(p, marks=pytest.mark.gpu) for p in (
    "registers_p1", "registers_p2", "registers_ovl4", "registers_nokpre", "registers_pf2")])
@pytest.mark.parametrize("mode", MODES)
def test_v32_register_producer(mode, producer):
    """producer="registers": a third warpgroup fills two K tiles in turn (natively by per-thread loads and
    dequantisation in registers, ``record_gather``; interpret mode emulates it with the staged rows), so blocks
    0..4 cycle through both tiles (natively the coalesced loads, by default in two rounds, each issued before
    the previous one is converted: ``producer_overlap``). Native only: "registers_p1", one round, not
    overlapped (the default before 2026-12-06); "registers_p2", two rounds, not overlapped; "registers_ovl4",
    four overlapped rounds; "registers_nokpre", the keys unscaled in the K tile (``k_prescale=False``, the
    default before 2026-12-06); "registers_pf2", records prefetched two blocks ahead. A fully masked row gives
    zeros; 2 splits (one with 2 blocks, one with 3); interpret mode also runs the race detector over the full /
    free protocol.

    Interpret mode runs each warpgroup as an XLA CPU computation whose barrier waits block a thread of XLA's
    intra-op pool (one per CPU): with fewer CPUs than warpgroups a producer never runs."""
    if _interpret(mode) and producer != "registers":
        pytest.skip("native only")
    kw = {"registers_p1": dict(producer="registers", producer_phases=1, producer_overlap=False, producer_regs=144),
          "registers_p2": dict(producer="registers", producer_phases=2, producer_overlap=False),
          "registers_ovl4": dict(producer="registers", producer_phases=4, producer_overlap=True),
          "registers_nokpre": dict(producer="registers", k_prescale=False),
          "registers_pf2": dict(producer="registers", producer_prefetch=2)}.get(producer, dict(producer="registers"))
    if _interpret(mode) and len(os.sched_getaffinity(0)) < mqa.NUM_WG + 1:
        pytest.skip(f"interpret mode needs a CPU per warpgroup ({mqa.NUM_WG + 1}) for the register "
                    "producer's blocking waits")
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    interpret = plgpu.InterpretGPUParams(detect_races=True) if _interpret(mode) else False
    _v32_masked_row_splits(interpret, 128, np.random.default_rng(5), **kw)
    if interpret:
        assert not gpu_callbacks.get_races().races_found


def test_register_producer_bad_inputs():
    """producer / producer_regs / producer_phases / split_dtype / combine / out_store / extents errors name
    the argument; bf16 rows are not the register producer's format, and V4's records take it natively only."""
    rng = np.random.default_rng(0)
    fmt = MlaRecord656(16)
    cache = _cache(fmt, 2, 576, rng)
    q, slots = jnp.zeros((1, 4, 576), jnp.bfloat16), jnp.zeros((1, 64), jnp.int32)
    for kw, msg in [(dict(producer="warp"), "producer must be"), (dict(producer="cluster"), "producer must be"),
                    (dict(producer_phases=3), "producer_phases"), (dict(producer_phases=0), "producer_phases"),
                    (dict(producer_regs=100), "producer_regs"), (dict(producer_regs=8), "producer_regs"),
                    (dict(split_dtype=jnp.int8), "split_dtype"), (dict(combine="triton"), "combine"),
                    (dict(out_store="smem"), "out_store"), (dict(out_store="tma"), "out_store"),  # fp32 rows
                    (dict(extents="auto"), "extents"), (dict(extents="kernel"), "extents"),
                    (dict(producer_overlap=1), "producer_overlap"),  # interpret mode: no PTX loop to overlap
                    (dict(producer="registers", producer_overlap=True), "producer_overlap"),
                    (dict(k_prescale=1), "k_prescale"), (dict(k_prescale=True), "k_prescale"),
                    (dict(producer_prefetch=3), "producer_prefetch"),
                    (dict(producer_prefetch=True), "producer_prefetch"),
                    (dict(producer_prefetch=2), "producer_prefetch")]:  # interpret mode: no native producer
        with pytest.raises(ValueError, match=msg):
            mqa.sparse_mqa(q, [cache], [fmt], [slots], scale=0.1, v_dim=512, interpret=True, **kw)
    f4 = MlaRecord584(16)
    with pytest.raises(ValueError, match="native only"):  # interpret mode emulates V3.2's producer alone
        mqa.sparse_mqa(jnp.zeros((1, 4, 512), jnp.bfloat16), [_cache(f4, 2, 512, rng)], [f4], [slots],
                       scale=0.1, v_dim=512, interpret=True, producer="registers")
    fr = FloatRows(512, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match="MlaRecord656"):
        mqa.sparse_mqa(jnp.zeros((1, 4, 512), jnp.bfloat16), [_cache(fr, 2, 512, rng)], [fr], [slots],
                       scale=0.1, v_dim=512, interpret=True, producer="registers")


@pytest.mark.skipif(ON_GPU, reason="interpret mode's race detector")
@pytest.mark.parametrize("scores", ["split", "one"])
@pytest.mark.parametrize("case", ["v4", "v32"])
def test_no_races(case, scores):
    """Interpret mode's race detector over the warpgroups' exchanges: the row maxima and final sums, P's halves
    (``scores="one"``: P, the rescale factors and maxima one way, P's buffer freed the other), the K tile's
    ready / free protocol. "v4": V4's two caches, sink and 2 splits. "v32": V3.2's records over 300 candidates
    (5 blocks), so warpgroup 0 copies block k + 2's slots into the idx slot both warpgroups read block k's
    validity from (a race without the proxy fence before "ready": checked by removing it)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rng = np.random.default_rng(11)
    interpret = plgpu.InterpretGPUParams(detect_races=True)
    if case == "v4":
        fw, fc = MlaRecord584(16), MlaRecord584(8)
        cw, cc = _cache(fw, 2, 512, rng), _cache(fc, 4, 512, rng)
        q = _bf16_exact(rng.standard_normal((1, 4, 512)))
        _check(q, [cw, cc], [fw, fc], [_slots(rng, 1, 64, 32, 0.2), _slots(rng, 1, 100, 32, 0.3)],
               scale=512 ** -0.5, v_dim=512, sink=jnp.asarray(rng.standard_normal(4).astype(np.float32)),
               tol=TOL_EXACT_KV, interpret=interpret, num_splits=2, scores=scores)
    else:
        fmt = MlaRecord656(16, "ue8m0")
        q = _bf16_exact(rng.standard_normal((1, 4, 576)))
        _check(q, [_cache(fmt, 8, 576, rng)], [fmt], [_slots(rng, 1, 300, 128, 0.2)], scale=0.06, v_dim=512,
               sink=None, tol=TOL_EXACT_KV, interpret=interpret, num_splits=1, scores=scores)
    assert not gpu_callbacks.get_races().races_found


# ----- V4: window + compressed, two caches, attention sink ----------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_splits", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_v4_window_compressed_sink(mode, num_splits):
    _v4_window_compressed(_interpret(mode), num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("producer", ["tma", "registers_p2", "registers_ovl2", "registers_ovl4", "registers_nokpre",
                                      "registers_pf2"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_v4_register_producer(num_splits, producer):
    """V4's producers natively beside the default register producer (``test_v4_window_compressed_sink``): the
    TMA producer and the register producer's loads in two rounds, and in two / four rounds each issued before
    the previous is converted (``producer_overlap``), the keys unscaled (``k_prescale=False``), and the records
    prefetched two blocks ahead (``producer_prefetch=2``); the two MlaRecord584
    lists of different pages per block, every block of the loop, the sink, a fully masked row."""
    if not ON_GPU:
        pytest.skip("native only")
    kw = {"tma": dict(producer="tma"), "registers_p2": dict(producer="registers", producer_phases=2),
          "registers_ovl2": dict(producer="registers", producer_phases=2, producer_overlap=True),
          "registers_ovl4": dict(producer="registers", producer_phases=4, producer_overlap=True),
          "registers_nokpre": dict(producer="registers", k_prescale=False),
          "registers_pf2": dict(producer="registers", producer_prefetch=2)}[producer]
    _v4_window_compressed(False, num_splits, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["v4", "v32"])
def test_cluster_merge(arch):
    """merge="cluster": the two splits of each (token, head tile) merge through distributed shared memory.
    V4: window + compressed lists with the sink and a fully masked row, fp32 rows and bf16 rows (direct and
    through TMA). V3.2: 200 heads (two head tiles, padded), a short row whose second split has no block, a
    fully masked row, no sink. GPU interpret mode has no cluster memory: native only."""
    if not ON_GPU:
        pytest.skip("native only")
    if arch == "v4":
        _v4_window_compressed(False, 2, merge="cluster")
        return
    rng = np.random.default_rng(6)
    t, h, k, nblk, epp = 4, 200, 2048, 96, 64
    fmt = MlaRecord656(epp, "ue8m0")
    cache = _cache(fmt, nblk, 576, rng)
    slots = _slots(rng, t, k, nblk * epp, 0.2, empty_rows=(1,)).at[2, 100:].set(-1)
    q = _bf16_exact(rng.standard_normal((t, h, 576)))
    for kw in (dict(), dict(out_dtype=jnp.bfloat16), dict(q_multicast=True)):  # + the pair's q by one multicast
        tol = TOL_BF16_OUT if "out_dtype" in kw else TOL_EXACT_KV
        out = _check(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, sink=None, tol=tol, interpret=False,
                     num_splits=2, merge="cluster", **kw)
        assert np.all(out[1] == 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["v4", "v32"])
def test_kernel_extents(arch):
    """extents="kernel": the lists' live blocks computed in the MQA kernel. Rows with dead tails, a dead window
    with a live compressed list (V4), a row whose only live slot is its list's last, a fully masked row; one
    split, and two merged in a cluster. Native only (the register producer)."""
    if not ON_GPU:
        pytest.skip("native only")
    rng = np.random.default_rng(8)
    if arch == "v4":
        t, h, kw_, kc, ew, ec = 5, 64, 128, 512, 256, 64
        fw, fc = MlaRecord584(ew), MlaRecord584(ec)
        caches, fmts = [_cache(fw, 4, 512, rng), _cache(fc, 16, 512, rng)], [fw, fc]
        sw = np.array(_slots(rng, t, kw_, 4 * ew, 0.2))
        sc = np.array(_slots(rng, t, kc, 16 * ec, 0.2))
        sc[0, 100:] = -1  # a dead tail: 2 of 8 compressed blocks live
        sw[1] = -1  # no window, the compressed list live
        sw[3, :-1], sc[3, :-1] = -1, -1  # each list's last slot alone
        sw[4], sc[4] = -1, -1  # fully masked
        slots, dim, sink = [jnp.asarray(sw), jnp.asarray(sc)], 512, jnp.asarray(rng.standard_normal(h), jnp.float32)
    else:
        t, h, k, nblk, epp = 4, 128, 2048, 96, 64
        fmt = MlaRecord656(epp, "ue8m0")
        caches, fmts = [_cache(fmt, nblk, 576, rng)], [fmt]
        s = np.array(_slots(rng, t, k, nblk * epp, 0.2))
        s[0, 300:] = -1
        s[2, :-1] = -1
        s[3] = -1
        slots, dim, sink = [jnp.asarray(s)], 576, None
    q = _bf16_exact(rng.standard_normal((t, h, dim)))
    for splits, kw in ((1, {}), (2, dict(merge="cluster")), (2, dict(merge="cluster", out_dtype=jnp.bfloat16)),
                       (2, dict(merge="cluster", q_multicast=True))):
        tol = TOL_BF16_OUT if kw.get("out_dtype") else TOL_EXACT_KV
        out = _check(q, caches, fmts, slots, scale=dim ** -0.5, v_dim=512, sink=sink, tol=tol, interpret=False,
                     num_splits=splits, extents="kernel", **kw)
        assert np.all(out[t - 1] == 0.0)


@pytest.mark.parametrize("mode", MODES)
def test_scores_split(mode):
    """scores="split" (the default before 2026-12-07; "one", warpgroup 0 scoring all of a block's candidates, is
    the default the other tests run): each compute warpgroup scores its half of the candidates, the two exchange
    row maxima and publish their halves of P. V3.2's records (100 heads: two head tiles, padded) with a fully
    masked row, one and two splits; V4's two lists with the sink and a fully masked row
    (``_v4_window_compressed``), two splits (natively merged in a cluster, and as rows); each case's blocks cycle
    through both K tiles (natively the register producer, in interpret mode the staged copies)."""
    interpret = _interpret(mode)
    rng = np.random.default_rng(12)
    cache, fmt, slots, q = _v32_masked_row_splits(interpret, 100, rng, scores="split")
    for kw in ([dict()] if interpret else [dict(), dict(merge="rows")]):
        _v4_window_compressed(interpret, 2, scores="split", **kw)
    with pytest.raises(ValueError, match="scores"):
        mqa.sparse_mqa(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, interpret=True, scores="two")


def test_cluster_merge_needs_two_native_splits():
    """merge="cluster" is refused, naming the argument, where it cannot run: not two splits, interpret mode."""
    rng = np.random.default_rng(7)
    fmt = MlaRecord656(16, "ue8m0")
    cache = _cache(fmt, 4, 576, rng)
    slots = _slots(rng, 2, 200, 64, 0.2)
    q = _bf16_exact(rng.standard_normal((2, 4, 576)))
    for kw in (dict(num_splits=1, interpret=False), dict(num_splits=2, interpret=True),
               dict(num_splits=2, interpret=False, producer="tma")):
        with pytest.raises(ValueError, match="merge"):
            mqa.sparse_mqa(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, merge="cluster", **kw)
    with pytest.raises(ValueError, match="merge"):
        mqa.sparse_mqa(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, merge="tree", interpret=True)
    with pytest.raises(ValueError, match="q_multicast"):  # only the cluster's pair shares a q tile
        mqa.sparse_mqa(q, [cache], [fmt], [slots], scale=0.06, v_dim=512, merge="rows", q_multicast=True,
                       interpret=True)


def _v4_window_compressed(interpret, num_splits, **kw) -> None:
    rng = np.random.default_rng(3)
    if interpret:  # window list (16 wide) and compressed list (70 wide) -> 1 + 2 blocks
        t, h, kw_, kc, ew, ec = 3, 4, 16, 70, 16, 8
    else:  # V4-Flash decode shape: 64 heads, window 128 + top-512 (C4 page: 64 entries)
        t, h, kw_, kc, ew, ec = 4, 64, 128, 512, 256, 64
    fw, fc = MlaRecord584(ew), MlaRecord584(ec)
    cw, cc = _cache(fw, 4, 512, rng), _cache(fc, 16, 512, rng)
    sw = _slots(rng, t, kw_, 4 * ew, 0.2, empty_rows=(2,))
    sc = _slots(rng, t, kc, 16 * ec, 0.4, empty_rows=(2,))
    q = _bf16_exact(rng.standard_normal((t, h, 512)))
    sink = jnp.asarray(rng.standard_normal(h).astype(np.float32))
    out = _check(q, [cw, cc], [fw, fc], [sw, sc], scale=512 ** -0.5, v_dim=512, sink=sink, tol=TOL_EXACT_KV,
                 interpret=interpret, num_splits=num_splits, **kw)
    assert np.all(out[2] == 0.0)  # only the sink's mass: zero output
    if num_splits > 1:  # as the V4 layer calls it: a bf16 output, merged from the fp32 split rows
        out = _check(q, [cw, cc], [fw, fc], [sw, sc], scale=512 ** -0.5, v_dim=512, sink=sink, tol=TOL_BF16_OUT,
                     interpret=interpret, num_splits=num_splits, out_dtype=jnp.bfloat16, **kw)
        assert np.all(out[2] == 0.0)
    # bf16 rows through the q tile and TMA copies (``out_store``)
    out = _check(q, [cw, cc], [fw, fc], [sw, sc], scale=512 ** -0.5, v_dim=512, sink=sink, tol=TOL_BF16_OUT,
                 interpret=interpret, num_splits=num_splits, out_dtype=jnp.bfloat16, split_dtype=jnp.bfloat16,
                 out_store="tma", **kw)
    assert np.all(out[2] == 0.0)


# ----- bf16 FloatRows caches -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dim", [576, 512])
def test_bf16_rows(mode, dim):
    interpret = _interpret(mode)
    rng = np.random.default_rng(4)
    t, h, k, epp = (2, 4, 90, 16) if interpret else (8, 128 if dim == 576 else 64, 640, 64)
    fmt = FloatRows(dim, epp, jnp.bfloat16)
    cache = _cache(fmt, 8, dim, rng)
    slots = _slots(rng, t, k, 8 * epp, 0.2)
    q = _bf16_exact(rng.standard_normal((t, h, dim)))
    sink = jnp.asarray(rng.standard_normal(h).astype(np.float32)) if dim == 512 else None
    _check(q, [cache], [fmt], [slots], scale=dim ** -0.5, v_dim=512, sink=sink, tol=TOL_EXACT_KV,
           interpret=interpret)


# ----- masked rows -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_all_masked_rows_give_zeros(mode):
    """Every candidate masked, with and without a sink (padded heads have sink -inf): zeros, never NaN."""
    interpret = _interpret(mode)
    rng = np.random.default_rng(5)
    fmt = MlaRecord584(8)
    cache = _cache(fmt, 2, 512, rng)
    slots = jnp.full((2, 10), -1, jnp.int32)
    q = _bf16_exact(rng.standard_normal((2, 4, 512)))
    for sink in (None, jnp.asarray([0.5, -3.0, -jnp.inf, 2.0], jnp.float32)):
        out = np.asarray(mqa.sparse_mqa(q, [cache], [fmt], [slots], scale=0.05, v_dim=512, sink=sink,
                                        interpret=interpret, num_splits=1))
        assert np.all(out == 0.0)


def test_extents_and_block_walk():
    """The wrapper's live blocks per list (``_extents``: up to each list's last block with a valid slot) and the
    kernel's walk over them (``block_of``: list 0's live blocks, then list 1's, ...; past the end a block of the
    last list, in bounds). Random lists with dead tails, dead blocks inside and fully masked rows, against a
    numpy walk."""
    rng = np.random.default_rng(4)
    t, nbs = 9, (3, 5, 2)
    lists = []
    for n in nbs:
        s = rng.integers(0, 1000, (t, n * mqa.BLOCK_K)).astype(np.int32)
        for r in range(t):  # a dead tail of random length, then random dead blocks before it
            s[r, rng.integers(0, n + 1) * mqa.BLOCK_K:] = -1
            s[r, rng.integers(0, n) * mqa.BLOCK_K:][:mqa.BLOCK_K] = -1
        s[rng.random((t, n * mqa.BLOCK_K)) < 0.3] = -1
        lists.append(s)
    lists[1][4] = -1
    exts = [np.asarray(e) for e in mqa._extents([jnp.asarray(s) for s in lists])]
    # the one-kernel form (``extents="pallas"``, interpret mode here) gives the same integers
    for e, k in zip(exts, mqa._extents([jnp.asarray(s) for s in lists], "pallas", interpret=True)):
        assert np.asarray(k).dtype == np.int32 and np.array_equal(np.asarray(k), e)
    pos = np.arange(sum(nbs) + 3)  # 3 past the end
    for r in range(t):
        want, start = [], 0
        for i, (s, n) in enumerate(zip(lists, nbs)):
            live = [b for b in range(n) if (s[r, b * mqa.BLOCK_K:(b + 1) * mqa.BLOCK_K] >= 0).any()]
            assert exts[i].dtype == np.int32 and exts[i][r] == (max(live) + 1 if live else 0)
            want += [start + b for b in range(exts[i][r])]
            start += n
        got = np.asarray(mqa.block_of(jnp.asarray(pos), [e[r] for e in exts], nbs))
        assert got[:len(want)].tolist() == want
        assert np.all((got[len(want):] >= start - nbs[-1]) & (got[len(want):] < start))


def test_supports_and_fallback_formats():
    assert mqa.supports([MlaRecord656(64)], 512)
    assert mqa.supports([MlaRecord584(256), MlaRecord584(64)], 512)
    assert mqa.supports([FloatRows(576, 64, jnp.bfloat16)], 512)
    assert not mqa.supports([MlaRecord584(1)], 512)  # odd entries per page: pages not 16-byte aligned
    assert not mqa.supports([FloatRows(576, 64, jnp.float32)], 512)  # fp32 rows: the layers use the xla path
    assert not mqa.supports([MlaRecord584(64), FloatRows(512, 64, jnp.bfloat16)], 512)  # mixed kinds
    assert not mqa.supports([MlaRecord656(64)], 576)  # v_dim must split into two multiples of 64
    with pytest.raises(NotImplementedError):
        mqa.sparse_mqa(jnp.zeros((1, 4, 512)), [jnp.zeros((2, 584), jnp.uint8)], [MlaRecord584(1)],
                       [jnp.zeros((1, 4), jnp.int32)], scale=1.0, v_dim=512)


# ----- the layers' attend on the kernel ----------------------------------------------------------------------
def _layer_inputs(layer, cfg, rng, lens):
    """Two prefill chunks (every token its own candidate lists) through the layer's own xla prepare/select."""
    nb = 8
    bt = rng.permutation(nb).reshape(2, nb // 2).astype(np.int32)
    cache = layer.init_cache(nb)
    chunks = [Chunk(0, 0, lens[0]), Chunk(1, 0, lens[1])]
    batch = make_batch(chunks, bt, cfg.block_size)
    x = jnp.asarray(rng.standard_normal((batch.num_tokens, cfg.hidden_size)).astype(np.float32))

    @nnx.jit
    def producers(layer, x, batch, cache):
        query, cache = layer.prepare(layer.project_in(x), batch, cache)
        return query, layer.select(query, batch, cache), cache

    query, topk, cache = producers(layer, x, batch, cache)
    return query, topk, batch, cache


def _attend(layer, query, topk, batch, cache):
    return layer.attend(query, topk, batch, cache)


# interpret mode is slow-marked (CI time), as for V4 below: the kernel's own interpret tests stay in the default run
@pytest.mark.parametrize("mode", [pytest.param("interpret", marks=pytest.mark.slow), *MODES[1:]])
def test_v32_layer_attend(mode):
    _interpret(mode)
    cfg = V32Config.tiny()
    layer = V32Attention(cfg, Numerics.serving(), rngs=nnx.Rngs(0), implementation="xla")
    query, topk, batch, cache = _layer_inputs(layer, cfg, np.random.default_rng(6), (5, 3))
    # built with 'xla' explicitly: 'auto' is 'pallas' on a GPU, and the reference would be the kernel itself
    assert pallas_calls(_attend, layer, query, topk, batch, cache) == 0
    want = np.asarray(layer.attend(query, topk, batch, cache).astype(jnp.float32))
    layer.implementation = "pallas"  # same weights, same query/cache: only attend's path changes
    assert pallas_calls(_attend, layer, query, topk, batch, cache) > 0, "the pallas layer did not use the kernel"
    got = np.asarray(layer.attend(query, topk, batch, cache).astype(jnp.float32))
    # bf16 outputs of W_UV(o_lat): the kernel's o_lat error (<= 2^-8 max|V|) passes through a fixed linear map
    # and the bf16 rounding of both paths (one bf16 ulp = 2^-8 relative)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=0)


# interpret mode is slow-marked (CI budget): the V4 kernel's own interpret tests stay in the default run
@pytest.mark.parametrize("mode", [pytest.param("interpret", marks=pytest.mark.slow), *MODES[1:]])
def test_v4_layer_attend(mode):
    _interpret(mode)
    cfg = V4Config.tiny()
    layer = V4Attention(cfg, Numerics.serving(), 1, rngs=nnx.Rngs(0), implementation="xla")  # C4: window + indexer top-k
    query, topk, batch, cache = _layer_inputs(layer, cfg, np.random.default_rng(7), (7, 2))
    assert pallas_calls(_attend, layer, query, topk, batch, cache) == 0  # 'xla' explicitly: see test_v32_layer_attend
    want = np.asarray(layer.attend(query, topk, batch, cache).astype(jnp.float32))
    layer.implementation = "pallas"
    assert pallas_calls(_attend, layer, query, topk, batch, cache) > 0, "the pallas layer did not use the kernel"
    got = np.asarray(layer.attend(query, topk, batch, cache).astype(jnp.float32))
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=0)


# ----- lowering for the H200 without a GPU --------------------------------------------------------------------
@pytest.mark.skipif(ON_GPU, reason="the native tests compile the kernel")
@pytest.mark.parametrize("case", ["v32_fp8", "v32_fp8_splits", "v4_fp8", "v32_bf16", "v4_bf16", "v32_fp8_tma",
                                  "v32_fp8_registers_p2", "v4_fp8_tma",
                                  "v4_fp8_registers_p2", "v4_fp8_splits_bf16", "v32_fp8_out_tma",
                                  "v4_fp8_splits_out_tma", "v4_fp8_extents_pallas", "v4_fp8_cluster",
                                  "v4_fp8_cluster_out_tma", "v32_fp8_cluster", "v4_fp8_extents_kernel",
                                  "v4_fp8_cluster_extents_kernel", "v32_fp8_extents_kernel",
                                  "v4_fp8_cluster_q_multicast", "v32_fp8_cluster_q_multicast",
                                  "v4_fp8_overlap_p2", "v4_fp8_overlap_p4", "v32_fp8_overlap_p2",
                                  "v4_fp8_cluster_overlap_p2", "v4_fp8_no_k_prescale",
                                  "v4_fp8_cluster_no_k_prescale", "v32u_fp8_no_k_prescale", "v32u_fp8",
                                  "v4_fp8_prefetch2", "v4_fp8_cluster_prefetch2", "v32_fp8_prefetch2",
                                  "v4_fp8_cluster_scores_split", "v4_fp8_scores_split", "v32_fp8_scores_split",
                                  "v32_fp8_cluster_scores_split", "v4_fp8_tma_scores_split", "v32_fp8_q_rope",
                                  "v32_fp8_cluster_q_rope", "v32_fp8_tma_q_rope", "v32_fp8_out_tma_q_rope"])
def test_lowers_for_cuda(case):
    """jax.export for CUDA runs Mosaic GPU's layout inference and dialect lowering (TMA, wgmma, swizzle and
    shared-memory limits for sm90) on the CPU at the real shapes."""
    t = 8
    if case.startswith("v32"):
        h, lists, v, dim = 128, [2048], 512, 576
        fmts = [MlaRecord656(64, "ue8m0" if case.startswith("v32u") else "fp32") if "fp8" in case
                else FloatRows(576, 64, jnp.bfloat16)]
    else:
        h, lists, v, dim = 64, [128, 512], 512, 512
        fmts = ([MlaRecord584(256), MlaRecord584(64)] if "fp8" in case
                else [FloatRows(512, 256, jnp.bfloat16), FloatRows(512, 64, jnp.bfloat16)])
    caches = [jax.ShapeDtypeStruct((64, f.page_elems), f.dtype) for f in fmts]
    slots = [jax.ShapeDtypeStruct((t, k), jnp.int32) for k in lists]
    sink = jax.ShapeDtypeStruct((h,), jnp.float32) if case.startswith("v4") else None
    splits = 4 if "splits" in case else 2 if "cluster" in case else 1
    # v32_fp8 / v4_fp8: the register producer (the default natively for fp8 records)
    kw = {"v32_fp8_tma": dict(producer="tma"), "v4_fp8_tma": dict(producer="tma"),
          "v32_fp8_registers_p2": dict(producer="registers", producer_phases=2),
          "v4_fp8_registers_p2": dict(producer="registers", producer_phases=2),
          "v4_fp8_splits_bf16": dict(out_dtype=jnp.bfloat16, split_dtype=jnp.bfloat16),
          # bf16 rows through the q tile and a TMA store
          "v32_fp8_out_tma": dict(out_dtype=jnp.bfloat16, out_store="tma"),
          "v4_fp8_splits_out_tma": dict(out_dtype=jnp.bfloat16, split_dtype=jnp.bfloat16,
                                        out_store="tma"),
          "v4_fp8_extents_pallas": dict(extents="pallas"),
          # two splits merged through distributed shared memory (fp32 rows stored directly, bf16 by TMA)
          "v4_fp8_cluster": dict(merge="cluster"), "v32_fp8_cluster": dict(merge="cluster"),
          "v4_fp8_cluster_out_tma": dict(merge="cluster", out_dtype=jnp.bfloat16),
          # the lists' live blocks computed in the MQA kernel (no extents kernel before it)
          "v4_fp8_extents_kernel": dict(extents="kernel"), "v32_fp8_extents_kernel": dict(extents="kernel"),
          "v4_fp8_cluster_extents_kernel": dict(merge="cluster", extents="kernel"),
          # the pair's q tile by one multicast TMA
          "v4_fp8_cluster_q_multicast": dict(merge="cluster", q_multicast=True),
          "v32_fp8_cluster_q_multicast": dict(merge="cluster", q_multicast=True),
          # the register producer's rounds of loads issued one ahead of their conversion
          "v4_fp8_overlap_p2": dict(producer_phases=2, producer_overlap=True),
          "v4_fp8_overlap_p4": dict(producer_phases=4, producer_overlap=True),
          "v32_fp8_overlap_p2": dict(producer_phases=2, producer_overlap=True),
          "v4_fp8_cluster_overlap_p2": dict(merge="cluster", producer_phases=2, producer_overlap=True),
          # the keys unscaled in the K tile (the default scales them by 2^-60 and its scores and rows back)
          "v4_fp8_no_k_prescale": dict(k_prescale=False),
          "v4_fp8_cluster_no_k_prescale": dict(merge="cluster", k_prescale=False),
          "v32u_fp8_no_k_prescale": dict(k_prescale=False),
          # the records prefetched into L2 two blocks ahead
          "v4_fp8_prefetch2": dict(producer_prefetch=2), "v32_fp8_prefetch2": dict(producer_prefetch=2),
          "v4_fp8_cluster_prefetch2": dict(merge="cluster", producer_prefetch=2),
          # each compute warpgroup scores half of a block's candidates (the default: warpgroup 0 scores all)
          "v4_fp8_cluster_scores_split": dict(merge="cluster", scores="split"),
          "v4_fp8_scores_split": dict(scores="split"), "v32_fp8_scores_split": dict(scores="split"),
          "v32_fp8_cluster_scores_split": dict(merge="cluster", scores="split"),
          "v4_fp8_tma_scores_split": dict(producer="tma", scores="split"),
          # q's roped columns apart, copied into their columns of the q tile
          "v32_fp8_cluster_q_rope": dict(merge="cluster"),
          "v32_fp8_out_tma_q_rope": dict(out_dtype=jnp.bfloat16, out_store="tma"),
          "v32_fp8_tma_q_rope": dict(producer="tma")}.get(case, {})

    def f(q, caches, slots, sink):
        if "q_rope" in case:
            kw["q_rope"], q = q[..., 512:], q[..., :512]
        return mqa.sparse_mqa(q, caches, fmts, slots, scale=0.07, v_dim=v, sink=sink, num_splits=splits,
                              interpret=False, **kw)

    # an abstract H200: the splits' merge is a Triton kernel, whose lowering asks for a GPU's compute capability
    dev = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=dev)):
        exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            jax.ShapeDtypeStruct((t, h, dim), jnp.bfloat16), caches, slots, sink)
    assert "mosaic_gpu" in exp.mlir_module()
    assert ("split_combine" in exp.mlir_module()) == (splits > 1 and "cluster" not in case)
    # V4's two lists: their extents by one Triton kernel before the MQA, unless the MQA computes them (the default
    # with the register producer)
    in_kernel = kw.get("extents", "kernel" if "fp8" in case and kw.get("producer") != "tma" else None) == "kernel"
    assert ("mqa_extents" in exp.mlir_module()) == (case.startswith("v4") and not in_kernel)
