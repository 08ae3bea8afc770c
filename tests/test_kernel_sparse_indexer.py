"""The paged FP8 indexer logits kernel + top-k (pallas_kernels/sparse_indexer.py) against the pure-JAX
indexer (jds.ops.indexer: index_scores over the gathered, dequantised keys + topk_visible).

Every kernel test runs twice: ``interpret`` (Mosaic GPU interpret mode on the CPU, small shapes, the
"views" key source) and ``native`` (marked ``gpu``: the compiled kernel with the "paged" RefUnion SMEM
bitcast, skipped unless jax.default_backend() == "gpu"); some cases use the "gathered" key source.
Checks: logits within fp32 tolerance (native: the Hopper FP8 MMA accumulates with ~2^-14 relative
precision, as DeepGEMM's indexer does), -inf exactly at invisible keys and padding columns, index sets
identical except near-exact ties (the differing keys' reference scores tie with the k-th score), -1
padding, V3.2 and V4 (C4) metadata, shuffled pages. A CPU-only test also lowers the kernel for CUDA (no
GPU needed) to catch Mosaic layout/TMA/wgmma rule errors.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jds.batch import Chunk, make_batch
from jds.config import Numerics, V32Config, V4Config
from jds.ops.indexer import index_scores, prepare_indexer_q, topk_visible
from jds.ops.paging import gather_request_rows
from jds.ops.quant import FP8
from jds.ops.records import FloatRows, IndexerRecord132
from pallas_kernels import sparse_indexer as si

from tests.kernel_modes import MODES, ON_GPU, interpret_for, pallas_calls


_interpret = interpret_for


def _rtol(mode: str) -> float:
    """Interpret mode is exact fp32. On the H200 the e4m3 wgmma accumulates with reduced precision (about
    2^-14 per step of its K = 128 chain, as in DeepGEMM): measured worst error 1.7e-3 of the per-logit
    abs-sum with 64 heads and 6.2e-3 with 4 heads (2026-11-29), so 1e-2 there.
    ``test_native_integer_keys_exact`` separately pins the addressing with data whose dots are exact at
    any accumulator precision (it passes at 1e-6 on the H200)."""
    return 1e-5 if mode == "interpret" else 1e-2


# ----- cases --------------------------------------------------------------------------------------
def paged_keys(epp: int, lens: list[int], nblk: int, seed: int, dup_keys: bool = False, return_rows: bool = False,
               integer: bool = False):
    """An FP8 indexer cache with each request's keys on shuffled, non-contiguous pages (spare pages
    hold other random keys). ``integer``: keys are small integers (|k| <= 3), so every e4m3 value and every
    dot with integer queries is exact. Returns (fmt, cache, block_tables)."""
    rng = np.random.default_rng(seed)
    fmt = IndexerRecord132(epp)
    r = len(lens)
    nb = r * nblk + 3
    bt = rng.permutation(nb)[: r * nblk].reshape(r, nblk).astype(np.int32)
    rows = rng.standard_normal((nb * epp, 128)) * rng.uniform(0.01, 4, (nb * epp, 1))  # spread of k scales
    if integer:
        rows = rng.integers(-3, 4, (nb * epp, 128)).astype(np.float64)
        rows[:, 0] = 3.0  # every key's amax is 3: one UE8M0 scale, exact e4m3 values
    for i, n in enumerate(lens):
        loc = np.arange(n)
        slots = bt[i, loc // epp] * epp + loc % epp
        if dup_keys:
            rows[slots] = rows[slots[0]]
    recs = np.asarray(_pack(fmt, jnp.asarray(rows, jnp.float32)))  # [slots, 132] = 128 e4m3 + fp32 scale
    pages = recs.reshape(nb, epp, 132)
    cache = np.concatenate([pages[:, :, :128].reshape(nb, -1), pages[:, :, 128:].reshape(nb, -1)], axis=1)
    if return_rows:
        return fmt, jnp.asarray(cache), jnp.asarray(bt), rows
    return fmt, jnp.asarray(cache), jnp.asarray(bt)


@functools.partial(jax.jit, static_argnums=0)
def _pack(fmt, rows):
    return fmt.pack(rows)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _prep_q(t: int, hi: int, q: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    return prepare_indexer_q(q, w, head_dim=128, n_heads=hi, fp8=True, hadamard=False, dtype=jnp.float32)


def queries(t: int, hi: int, seed: int, integer: bool = False) -> tuple[jax.Array, jax.Array]:
    """Indexer q / folded weights as the layers hand them over (FP8-dequantised q, signed weights)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((t, hi, 128)) * rng.uniform(0.05, 3, (t, hi, 1)), jnp.float32)
    if integer:
        qi = rng.integers(-3, 4, (t, hi, 128))
        qi[..., 0] = 3
        q = jnp.asarray(qi, jnp.float32)
    w = jnp.asarray(rng.standard_normal((t, hi)), jnp.float32)
    return _prep_q(t, hi, q, w)


@functools.partial(jax.jit, static_argnums=3)
def _reference(qd, wf, cache, fmt, bt, req, nvis):
    max_keys = bt.shape[1] * fmt.entries_per_page
    keys = gather_request_rows(cache, fmt, bt, max_keys)[req]
    return si.xla_logits(qd, wf, cache, fmt, bt, req, nvis), _abssum(qd, wf, keys)


def reference(qd, wf, cache, fmt, bt, req, nvis):
    """(masked logits, sum of |terms| per logit) from the pure-JAX path."""
    logits, abssum = _reference(qd, wf, cache, fmt, bt, req, nvis)
    return np.asarray(logits), np.asarray(abssum)


def _abssum(qd, wf, keys):
    """sum_h |w_h| sum_d |q_hd k_d|: the scale of rounding errors of one logit (every head counts: a dot
    that is ~0 may land on either side of the relu)."""
    hp = jax.lax.Precision.HIGHEST
    mag = jnp.einsum("thd,tnd->thn", jnp.abs(qd), jnp.abs(keys), precision=hp)
    return jnp.einsum("th,thn->tn", jnp.abs(wf), mag, precision=hp)


def check_logits(out: np.ndarray, ref: np.ndarray, abssum: np.ndarray, rtol: float) -> None:
    n = ref.shape[1]
    assert out.shape[0] == ref.shape[0] and out.shape[1] >= n and out.shape[1] % si.TILE == 0
    assert np.isneginf(out[:, n:]).all(), "padding columns must be -inf"
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(out[:, :n]), fin, err_msg="-inf pattern (visibility) differs")
    assert not np.isnan(out).any()
    err = np.abs(out[:, :n][fin] - ref[fin])
    bound = rtol * abssum[fin] + 1e-30
    assert (err <= bound).all(), f"max err {err.max():.3e}, worst ratio {(err / bound).max():.2f}"


def check_topk(got: np.ndarray, want: np.ndarray, ref: np.ndarray, abssum: np.ndarray, rtol: float) -> int:
    """Same sets except near-exact ties with the k-th reference score; same -1 padding. Returns swaps."""
    assert got.shape == want.shape and got.dtype == np.int32
    swaps = 0
    for t in range(got.shape[0]):
        a, b = got[t][got[t] >= 0], want[t][want[t] >= 0]
        assert len(a) == len(b), f"token {t}: {len(a)} vs {len(b)} selected"
        assert (got[t][len(a):] == -1).all() and len(set(a.tolist())) == len(a)
        sa, sb = set(a.tolist()), set(b.tolist())
        if sa == sb:
            continue
        kth = min(ref[t, i] for i in sb)
        for i in sa ^ sb:
            tol = 2 * rtol * max(abssum[t, i], abssum[t, int(b[np.argmin(ref[t, b])])]) + 1e-30
            assert abs(ref[t, i] - kth) <= tol, f"token {t}: key {i} score {ref[t, i]} vs k-th {kth}: not a tie"
        swaps += 1
    return swaps


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    epp: int
    hi: int
    lens: tuple[int, ...]  # keys per request (written to the cache)
    req: tuple[int, ...]  # request row per token (contiguous runs)
    nvis: tuple[int, ...]  # visible keys per token
    extra_blocks: int = 1
    g: int | None = None
    tpc: int | None = None
    nbuf: int = 3
    source: str = "auto"  # key_source: "auto" = views (interpret) / paged (native)


def v32_prefill_nvis(start: int, n: int) -> tuple[int, ...]:
    return tuple(p + 1 for p in range(start, start + n))


def v4_nvis(start: int, n: int) -> tuple[int, ...]:
    return tuple((p + 1) // 4 for p in range(start, start + n))


CASES = [
    # decode: one token per request, its context = all keys written so far (V3.2: keys = tokens)
    Case("v32_decode", 64, 64, (1, 70, 200), (0, 1, 2), (1, 70, 200), tpc=2),
    # chunked prefill of two requests + a decode + 2 padding tokens (request 0, position 0)
    Case("v32_mixed", 64, 64, (140, 9, 66), (0,) * 5 + (1,) * 9 + (2,) + (0, 0),
         v32_prefill_nvis(135, 5) + v32_prefill_nvis(0, 9) + (66,) + (1, 1), tpc=1),
    # V4 C4: compressed entries (epp = block_size // 4 = 32 in the tiny config), b < (p+1)//4 (0 at p < 3)
    Case("v4_prefill", 32, 64, (40, 12), (0,) * 7 + (1,) * 4, v4_nvis(150, 7) + v4_nvis(0, 4), g=4),
    Case("v4_decode_tiny_heads", 32, 4, (33, 70, 5), (0, 1, 2), (33, 70, 5), extra_blocks=2),
    # big pages (a tile is half a page), G = 3 with a ragged last group
    Case("epp128_g3", 128, 64, (300,), (0,) * 7, v32_prefill_nvis(190, 7), g=3, tpc=2, nbuf=2),
    # heads not a multiple of 64 (padded in the kernel), single buffer
    Case("odd_heads", 64, 72, (130, 64), (0, 1), (130, 64), nbuf=1),
    # the "gathered" key source (contiguous copy of the keys first): decode + V4 prefill metadata
    Case("gathered_decode", 64, 64, (1, 70, 200), (0, 1, 2), (1, 70, 200), tpc=2, source="gathered"),
    Case("gathered_v4", 32, 64, (40, 12), (0,) * 7 + (1,) * 4, v4_nvis(150, 7) + v4_nvis(0, 4), g=4,
         source="gathered"),
]


def _run_case(c: Case, mode: str, seed: int = 0, interpret=None):
    interpret = _interpret(mode) if interpret is None else interpret
    nblk = max(-(-n // c.epp) for n in c.lens) + c.extra_blocks
    fmt, cache, bt = paged_keys(c.epp, list(c.lens), nblk, seed)
    req = jnp.asarray(c.req, jnp.int32)
    nvis = jnp.asarray(c.nvis, jnp.int32)
    qd, wf = queries(len(c.req), c.hi, seed + 1)
    ref, abssum = reference(qd, wf, cache, fmt, bt, req, nvis)
    q8, w8 = si.quantize_q(qd, wf)
    cfg = si.IndexerKernelConfig(queries_per_cta=c.g, tiles_per_cta=c.tpc, num_buffers=c.nbuf, key_source=c.source)
    out = si.paged_logits(q8, w8, cache, bt, req, nvis, entries_per_page=c.epp, config=cfg, interpret=interpret)
    return np.asarray(out), ref, abssum, (qd, wf, cache, fmt, bt, req, nvis)


# ----- tests --------------------------------------------------------------------------------------
def test_cache_builder_matches_write_records() -> None:
    """The numpy test-cache builder lays records out exactly as jds.ops.paging.write_records does."""
    from jds.ops.paging import empty_cache, write_records

    fmt, cache, bt, rows = paged_keys(32, [40, 7], 3, 2, return_rows=True)
    slots = jnp.arange(cache.shape[0] * 32, dtype=jnp.int32)
    again = jax.jit(write_records, static_argnums=1)(empty_cache(fmt, cache.shape[0]), fmt, slots,
                                                      jnp.asarray(rows, jnp.float32))  # compiled, as the layers run it
    np.testing.assert_array_equal(np.asarray(again), np.asarray(cache))


def test_quantize_q_is_exact() -> None:
    """(q8, w * s) scores the same real numbers as the dequantised q (including the s/2 re-scale case)."""
    qd, wf = queries(5, 8, 3)
    q = qd.at[0, 0].set(qd[0, 0] * 0 + 224.0 / 448.0 * 2.0 ** -3)  # |q8| <= 224 everywhere: s' = s / 2
    q8, w8 = si.quantize_q(q, wf)
    s = w8 / wf
    np.testing.assert_array_equal(np.asarray(q8.astype(jnp.float32) * s[..., None]), np.asarray(q))
    assert q8.dtype == FP8


# the default run keeps one case per key source and model (V3.2 decode / mixed prefill, V4 prefill, gathered);
# the other shapes are slow
SLOW_CASES = {"v4_decode_tiny_heads", "epp128_g3", "odd_heads", "gathered_v4"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name in SLOW_CASES else [])
                                  for c in CASES])
def test_logits_match_reference(case: Case, mode: str) -> None:
    out, ref, abssum, _ = _run_case(case, mode)
    check_logits(out, ref, abssum, _rtol(mode))


@pytest.mark.parametrize("mode", MODES)
def test_q_padded_by_the_caller(mode: str) -> None:
    """q quantised from an input the caller padded to ``logits_q_shape`` (as ``indexer_topk`` does, so the pad is
    part of the quantisation's fusion): the logits of the unpadded call bit for bit (the kernel reads the same
    arrays: padded heads and rows are zeros either way). Heads not a multiple of 64 and groups of 2 tokens."""
    c = Case("prepadded", 64, 72, (130, 64), (0,) * 4 + (1,) * 2, (127, 128, 129, 130, 63, 64), g=2)
    out, _, _, (qd, wf, cache, fmt, bt, req, nvis) = _run_case(c, mode)
    cfg = si.IndexerKernelConfig(queries_per_cta=c.g, tiles_per_cta=c.tpc, num_buffers=c.nbuf, key_source=c.source)
    rows, hp = si.logits_q_shape(len(c.req), c.hi, bt.shape[0], cfg)
    assert (rows, hp) == (len(c.req) + 2, 128)
    # one token a group (decode: no more tokens than requests): a group reads its own row only, nothing past T
    assert si.logits_q_shape(3, 64, 3) == (3, 64) and si.logits_q_shape(4, 64, 3) == (4 + 2, 64)
    q8, w8 = si.quantize_q(jnp.pad(qd, ((0, rows - len(c.req)), (0, hp - c.hi), (0, 0))),
                           jnp.pad(wf, ((0, rows - len(c.req)), (0, hp - c.hi))))
    again = si.paged_logits(q8, w8, cache, bt, req, nvis, entries_per_page=c.epp, config=cfg,
                            interpret=_interpret(mode))
    np.testing.assert_array_equal(np.asarray(again), out)


def test_q_rows_other_than_t_or_padded_name_q8() -> None:
    fmt, cache, bt = paged_keys(64, [70], 2, 0)
    qd, wf = queries(4, 64, 1)
    q8, w8 = si.quantize_q(qd, wf)
    req, nvis = jnp.zeros((3,), jnp.int32), jnp.full((3,), 70, jnp.int32)
    with pytest.raises(ValueError, match="q8 must have T = 3 rows"):
        si.paged_logits(q8, w8, cache, bt, req, nvis, entries_per_page=64)


@pytest.mark.skipif(ON_GPU, reason="interpret mode's race detector")
@pytest.mark.parametrize("source", ["auto", "gathered"])
def test_no_races(source: str) -> None:
    """Interpret mode's race detector over the key ring: 5 tiles a CTA through 2 buffers, so each slot is
    refilled after its scales' generic read (a race without the fence before the refill: checked by removing
    it). The tests above run one or two tiles a CTA and never refill."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    c = Case("refill", 64, 64, (1, 70, 300), (0, 1, 2), (1, 70, 300), tpc=5, nbuf=2, source=source)
    out, ref, abssum, _ = _run_case(c, "interpret", interpret=plgpu.InterpretGPUParams(detect_races=True))
    check_logits(out, ref, abssum, _rtol("interpret"))
    assert not gpu_callbacks.get_races().races_found


@pytest.mark.parametrize("mode", MODES)
def test_topk_matches_reference_with_chunking(mode: str) -> None:
    """indexer_topk (logits kernel + lax.top_k) vs topk_visible over the pure-JAX scores, with a workspace
    so small that the tokens run in lax.map chunks; k above and below the visible counts (-1 padding);
    the two-stage and the radix selections, and (natively) the Pallas one without its sort (topk_order="set",
    in interpret mode: tests/test_kernel_topk_select.py::test_set_order_skips_the_sort)."""
    c = CASES[1]
    interpret = _interpret(mode)
    nblk = max(-(-n // c.epp) for n in c.lens) + c.extra_blocks
    fmt, cache, bt = paged_keys(c.epp, list(c.lens), nblk, 7)
    req, nvis = jnp.asarray(c.req, jnp.int32), jnp.asarray(c.nvis, jnp.int32)
    qd, wf = queries(len(c.req), c.hi, 8)
    ref, abssum = reference(qd, wf, cache, fmt, bt, req, nvis)
    # 6 tokens per chunk, two-stage top-k over 64-key segments
    small = si.IndexerKernelConfig(max_logits_bytes=4 * 6 * bt.shape[1] * c.epp, topk_segment=64)
    radix = si.IndexerKernelConfig(max_logits_bytes=4 * 6 * bt.shape[1] * c.epp, topk_algorithm="radix")
    # the Pallas selection without its sort (topk_order="set"): the same sets, ascending key order (-1 padding
    # still last: the invisible keys are the highest); slow in interpret mode, so natively only
    unsorted = si.IndexerKernelConfig(topk_algorithm="pallas_radix", topk_order="set")
    # interpret mode (CI time): the chunked two-stage and the radix selections, k above the visible counts in one
    configs = ((16, small), (100, radix)) if interpret else (
        (16, small), (100, si.IndexerKernelConfig()), (40, radix), (40, unsorted),
        (40, dataclasses.replace(unsorted, topk_lengths=True)))  # n_visible as the kernel's lengths hint
    for k, cfg in configs:
        want = np.asarray(topk_visible(jnp.asarray(np.where(np.isfinite(ref), ref, 0.0)), nvis, k))
        got = np.asarray(si.indexer_topk(qd, wf, cache, fmt, bt, req, nvis, k, config=cfg, interpret=interpret))
        check_topk(got, want, ref, abssum, _rtol(mode))
        # the XLA path with the same chunking: the same logits up to float32 rounding (another program's
        # fusion), so the same sets except keys tying the k-th score within float32 rounding
        got = np.asarray(si.indexer_topk(qd, wf, cache, fmt, bt, req, nvis, k, implementation="xla",
                                         config=si.IndexerKernelConfig(max_logits_bytes=4 * 129 * 3 * 192)))
        check_topk(got, want, ref, abssum, _rtol("interpret"))


@pytest.mark.parametrize("segment", [None, 64, 100, 256])
def test_two_stage_topk_is_exact(segment: int | None) -> None:
    """topk_from_logits with segments returns exactly lax.top_k's indices (ties: lower index first)."""
    rng = np.random.default_rng(3)
    x = rng.integers(-20, 20, (5, 1000)).astype(np.float32)  # many exact ties
    x[1, 300:] = -np.inf  # fewer visible than k
    x[2] = -np.inf
    x = jnp.asarray(x)
    want = np.asarray(si.topk_from_logits(x, 64))
    got = np.asarray(si.topk_from_logits(x, 64, segment))
    np.testing.assert_array_equal(got, want)
    vals, idx = jax.lax.top_k(x, 64)
    np.testing.assert_array_equal(want[0], np.asarray(idx[0]))


@pytest.mark.parametrize("mode", MODES)
def test_exact_ties_lower_index_wins(mode: str) -> None:
    """Identical keys give bit-identical logits; both implementations keep the lowest indices."""
    interpret = _interpret(mode)
    fmt, cache, bt = paged_keys(64, [150], 3, 11, dup_keys=True)
    req, nvis = jnp.asarray([0, 0], jnp.int32), jnp.asarray([150, 90], jnp.int32)
    qd, wf = queries(2, 64, 12)
    for impl in ("pallas", "xla"):
        got = np.asarray(si.indexer_topk(qd, wf, cache, fmt, bt, req, nvis, 32, implementation=impl,
                                         interpret=interpret))
        np.testing.assert_array_equal(got, np.tile(np.arange(32, dtype=np.int32), (2, 1)))
    logits = np.asarray(si.paged_logits(*si.quantize_q(qd, wf), cache, bt, req, nvis, entries_per_page=64,
                                        interpret=interpret))
    assert (logits[0, :150] == logits[0, 0]).all() and (logits[1, :90] == logits[1, 0]).all()


@pytest.mark.parametrize("mode", MODES)
def test_no_visible_keys_gives_minus_one(mode: str) -> None:
    interpret = _interpret(mode)
    fmt, cache, bt = paged_keys(32, [20], 2, 13)
    req, nvis = jnp.asarray([0, 0, 0], jnp.int32), jnp.asarray([0, 0, 1], jnp.int32)  # V4: p = 0, 2, 3
    qd, wf = queries(3, 64, 14)
    got = np.asarray(si.indexer_topk(qd, wf, cache, fmt, bt, req, nvis, 8, interpret=interpret))
    assert (got[:2] == -1).all() and got[2, 0] == 0 and (got[2, 1:] == -1).all()


@pytest.mark.parametrize("mode,arch", [  # V4 interpreted is slow; its metadata is in the kernel tests above
    pytest.param("interpret", "v32", id="interpret-v32"),
    pytest.param("interpret", "v32-amax", id="interpret-v32-amax"),
    pytest.param("interpret", "v4", id="interpret-v4", marks=pytest.mark.slow),
    pytest.param("native", "v32", id="native-v32", marks=pytest.mark.gpu),
    pytest.param("native", "v32-amax", id="native-v32-amax", marks=pytest.mark.gpu),
    pytest.param("native", "v4", id="native-v4", marks=pytest.mark.gpu),
])
def test_layer_select_wiring(mode: str, arch: str, monkeypatch) -> None:
    """V32Attention / V4Attention.select with implementation='pallas' picks the kernel and agrees with the
    XLA path on the same query and cache (V3.2 block_size 32; V4 tiny C4 layer: 32 entries per page).

    The layers are built with implementation='xla' explicitly: 'auto' resolves to 'pallas' on a GPU, so the
    "reference" would be the kernel itself (and switching to 'pallas' would hit the cached trace). That the
    kernel runs is read from a fresh trace (``pallas_calls``), not from a spy that a cached trace bypasses."""
    from jds.v32 import V32Attention
    from jds.v4 import V4Attention

    interpret = _interpret(mode)
    orig = si.paged_logits
    # the layer passes interpret=None (native on a GPU, interpret elsewhere); force this test's mode
    monkeypatch.setattr(si, "paged_logits", lambda *a, **kw: orig(*a, **dict(kw, interpret=interpret)))
    # "v32-amax": amax / 448 activation scales; the kernel scores the layer's e4m3 q with its scales (a q
    # re-quantised with UE8M0 scales, the form before, would round a second time)
    num = dataclasses.replace(Numerics.serving(), act_scale_fmt="amax") if arch == "v32-amax" else Numerics.serving()
    arch = arch.split("-")[0]
    rng = np.random.default_rng(0)
    cfg32 = dataclasses.replace(V32Config.tiny(), block_size=32)
    cfg4 = V4Config.tiny()
    layers = {
        # built under nnx.jit: one compile instead of an eager op per parameter
        "v32": (cfg32, nnx.jit(lambda: V32Attention(cfg32, num, rngs=nnx.Rngs(0), implementation="xla")),
                lambda p: p + 1),
        "v4": (cfg4, nnx.jit(lambda: V4Attention(cfg4, num, 1, rngs=nnx.Rngs(0), implementation="xla")),
               lambda p: (p + 1) // 4),
    }
    layers = [layers[arch]]
    select = nnx.jit(lambda m, q, b, c: m.select(q, b, c))
    sel = lambda m, q, b, c: m.select(q, b, c)
    for cfg, make, vis in layers:
        layer = make()
        assert layer.implementation == "xla"
        nblk = -(-80 // cfg.block_size) + 1
        nb = 2 * nblk + 3
        bt = rng.permutation(nb)[: 2 * nblk].reshape(2, nblk).astype(np.int32)  # shuffled pages
        # two prefills (keys 0..p of their own request) and 2 padding tokens
        batch = make_batch([Chunk(0, 0, 21), Chunk(1, 0, 75)], bt, cfg.block_size, pad_to=98)
        x = jnp.asarray(rng.standard_normal((batch.num_tokens, cfg.hidden_size)), jnp.float32)
        prep = nnx.jit(lambda m, x, b, c: m.prepare(m.project_in(x), b, c))
        query, cache = prep(layer, x, batch, layer.init_cache(nb))
        # the FP8 q as the layer quantised it, scales apart (``Query.index_q_scale``)
        assert query.index_q.dtype == FP8 and query.index_q_scale.shape == query.index_q.shape[:2]
        assert pallas_calls(sel, layer, query, batch, cache) == 0, "the xla layer traced a Pallas kernel"
        want = np.asarray(select(layer, query, batch, cache))
        layer.implementation = "pallas"
        assert pallas_calls(sel, layer, query, batch, cache) > 0, "the pallas layer did not use the kernel"
        got = np.asarray(select(layer, query, batch, cache))
        max_keys = batch.block_tables.shape[1] * layer.index_format.entries_per_page
        keys = gather_request_rows(cache.index_k, layer.index_format, batch.block_tables, max_keys)[batch.req_idx]
        scores = np.asarray(index_scores(query.indexer_q(), query.index_w, keys))
        nv = np.asarray(vis(batch.positions))
        scores = np.where(np.arange(max_keys)[None] < nv[:, None], scores, -np.inf)
        abssum = np.asarray(_abssum(query.indexer_q(), query.index_w, keys))
        check_topk(got, want, scores, abssum, _rtol(mode))


def test_supports_and_validation() -> None:
    assert si.supports(IndexerRecord132(64)) and si.supports(IndexerRecord132(32))
    assert si.supports(IndexerRecord132(128)) and not si.supports(IndexerRecord132(16))
    assert not si.supports(IndexerRecord132(96)) and not si.supports(FloatRows(128, 64))
    with pytest.raises(ValueError):
        si.IndexerKernelConfig(queries_per_cta=5)
    with pytest.raises(ValueError):
        si.IndexerKernelConfig(key_source="copy")
    fmt, cache, bt = paged_keys(64, [10], 1, 0)
    qd, wf = queries(1, 64, 0)
    with pytest.raises(ValueError):
        si.indexer_topk(qd, wf, cache, FloatRows(128, 64), bt, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), 4)


@pytest.mark.skipif(ON_GPU, reason="CPU-only cross-lowering smoke test (the gpu tests compile for real)")
@pytest.mark.parametrize("t,r,hi,epp,g,source", [(64, 64, 64, 64, None, "paged"), (256, 1, 64, 64, 4, "paged"),
                                                   (12, 3, 4, 32, 2, "paged"), (10, 2, 72, 128, 3, "paged"),
                                                   (12, 3, 64, 32, 2, "gathered")])
def test_lowers_for_cuda(t: int, r: int, hi: int, epp: int, g: int | None, source: str) -> None:
    """The compiled kernel passes Mosaic GPU's lowering (layouts, TMA and wgmma rules) for CUDA."""
    cfg = si.IndexerKernelConfig(queries_per_cta=g, key_source=source)
    f = jax.jit(functools.partial(si.paged_logits, entries_per_page=epp, config=cfg, interpret=False))
    nblk = 4096 // epp
    args = (jax.ShapeDtypeStruct((t, hi, 128), FP8), jax.ShapeDtypeStruct((t, hi), jnp.float32),
            jax.ShapeDtypeStruct((r * nblk + 3, epp * 132), jnp.uint8), jax.ShapeDtypeStruct((r, nblk), jnp.int32),
            jax.ShapeDtypeStruct((t,), jnp.int32), jax.ShapeDtypeStruct((t,), jnp.int32))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("source", ["paged", "gathered"])
@pytest.mark.parametrize("b,ctx", [(16, 4096), (4, 16384)])
def test_native_decode_larger(b: int, ctx: int, source: str) -> None:
    """Realistic decode shapes on the GPU: 64 heads, 64-entry pages, shuffled pages, top-2048."""
    cfg = si.IndexerKernelConfig(key_source=source)
    rng = np.random.default_rng(5)
    lens = [int(x) for x in rng.integers(ctx // 2, ctx + 1, b)]
    fmt, cache, bt = paged_keys(64, lens, ctx // 64, 5)
    req, nvis = jnp.arange(b, dtype=jnp.int32), jnp.asarray(lens, jnp.int32)
    qd, wf = queries(b, 64, 6)
    ref, abssum = reference(qd, wf, cache, fmt, bt, req, nvis)
    out = np.asarray(si.paged_logits(*si.quantize_q(qd, wf), cache, bt, req, nvis, entries_per_page=64, config=cfg))
    check_logits(out, ref, abssum, _rtol("native"))
    got = np.asarray(si.indexer_topk(qd, wf, cache, fmt, bt, req, nvis, 2048, config=cfg))
    want = np.asarray(topk_visible(jnp.asarray(np.where(np.isfinite(ref), ref, 0.0)), nvis, 2048))
    check_topk(got, want, ref, abssum, _rtol("native"))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("source", ["paged", "gathered"])
def test_native_integer_keys_exact(source: str) -> None:
    """Integer keys and queries: each head's dot is exact whatever the MMA accumulator keeps, so the kernel
    must match the reference to fp32 rounding of the head sum: this isolates paging/aliasing/masking
    errors from FP8 accumulation precision. Decode rows plus a prefill run, shuffled pages."""
    lens = [1, 70, 200, 1500]
    fmt, cache, bt = paged_keys(64, lens, 24, 11, integer=True)
    req = jnp.asarray([0, 1, 2] + [3] * 9, jnp.int32)
    nvis = jnp.asarray([1, 70, 200] + list(range(1492, 1501)), jnp.int32)
    qd, wf = queries(12, 64, 12, integer=True)
    ref, abssum = reference(qd, wf, cache, fmt, bt, req, nvis)
    cfg = si.IndexerKernelConfig(key_source=source)
    out = np.asarray(si.paged_logits(*si.quantize_q(qd, wf), cache, bt, req, nvis, entries_per_page=64, config=cfg))
    check_logits(out, ref, abssum, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_native_prefill_larger() -> None:
    """A 512-token chunk at positions 1536..2047 of one request plus two decodes, G = 4."""
    lens = [2048, 700, 3000]
    fmt, cache, bt = paged_keys(64, lens, 48, 9)
    req = jnp.asarray([0] * 512 + [1, 2], jnp.int32)
    nvis = jnp.asarray(list(range(1537, 2049)) + [700, 3000], jnp.int32)
    qd, wf = queries(514, 64, 10)
    ref, abssum = reference(qd, wf, cache, fmt, bt, req, nvis)
    out = np.asarray(si.paged_logits(*si.quantize_q(qd, wf), cache, bt, req, nvis, entries_per_page=64))
    check_logits(out, ref, abssum, _rtol("native"))
