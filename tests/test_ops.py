"""Every op's public entry point (jds.ops.dispatch) at the same cases for every implementation
(tests/op_cases.py): ``"xla"`` and ``"pallas"`` against one reference; ``"auto"`` takes the kernel where it
fits and the XLA implementation (bit for bit) where the kernel raises ``Unsupported``; an explicit
``"pallas"`` surfaces that error; a bad ``implementation`` is a ValueError naming the field.

The per-kernel files (tests/test_kernel_*.py) hold the wider shape and format sweeps of each kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.ops import fused_insert as fi
from jds.ops.dispatch import H200_SMS, Unsupported, check_implementation, num_sms, op_implementation
from jds.ops import compressor as comp
from jds.ops.indexer import prepare_indexer_k, prepare_indexer_q
from jds.ops.paging import empty_cache, gather_request_rows, read_records, write_records
from jds.ops.records import FloatRows, IndexerRecord132, MlaRecord584, MlaRecord656
from pallas_kernels.compressor_pool import insert_entries, insert_index_keys, pool_norm_rope, write_state
from pallas_kernels.fused_insert_v32 import fused_kv_insert_v32, fused_q_v32
from pallas_kernels.fused_insert_v4 import fused_qnorm_rope_kv_insert_v4
from pallas_kernels.sparse_indexer import indexer_topk
from pallas_kernels.sparse_mqa import sparse_mqa
from pallas_kernels.topk_select import topk_select
from tests.kernel_modes import interpret_for
from tests.op_cases import IMPLEMENTATIONS, OpCase, call, kernel_count
from tests.test_kernel_fused_insert import assert_cache_match, assert_q_match
from tests.test_kernel_sparse_indexer import _rtol as _indexer_rtol

BF16, F32 = jnp.bfloat16, jnp.float32
T = 7
# the cases' cache building and decoding compiled, not an eager op per primitive (inputs and references only)
_write = jax.jit(write_records, static_argnums=1)
_read = jax.jit(read_records, static_argnums=1)
_gather = jax.jit(gather_request_rows, static_argnums=(1, 3))
_prep_q = jax.jit(prepare_indexer_q, static_argnames=("head_dim", "n_heads", "fp8", "hadamard", "dtype"))


def _compiled(fn):
    """The fused ops' references (their XLA definitions) compiled with the case's static keywords, as the layers run
    them: eagerly, every primitive of the reference compiled on its own (seconds per case on the CPU)."""
    jitted: dict = {}

    def reference(args: tuple, kw: dict):
        names = tuple(sorted(kw))
        if names not in jitted:
            jitted[names] = jax.jit(fn, static_argnames=names)
        return jitted[names](*args, **kw)

    return reference


def _rope(t: int, rd: int, seed: int) -> tuple[jax.Array, jax.Array]:
    theta = np.random.default_rng(seed).uniform(0, 2 * np.pi, (t, rd // 2))
    return jnp.asarray(np.cos(theta), F32), jnp.asarray(np.sin(theta), F32)


def _slots(t: int, n: int, seed: int) -> jax.Array:
    s = np.random.default_rng(seed).permutation(n)[:t].astype(np.int32)
    s[1] = -1  # a padding token writes nothing
    return jnp.asarray(s)


def _exact(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def _check_exact(got, want, args, kw, impl) -> None:
    """Every implementation bit for bit (the compressor's record writers: the same packing, the same sums)."""
    _exact(got, want)


# ----- fused insert V3.2: caches ---------------------------------------------------------------------------
def _kv32(lat: int, kv_fmt, idx_fmt) -> tuple[tuple, dict]:
    rng = np.random.default_rng(0)
    cos, sin = _rope(T, 64, 1)
    args = (jnp.asarray(rng.normal(size=(T, lat + 64)), BF16), jnp.asarray(rng.normal(size=(T, 128)), BF16), cos, sin,
            _slots(T, 32, 2), empty_cache(kv_fmt, 2), empty_cache(idx_fmt, 2),
            jnp.asarray(1 + 0.1 * rng.normal(size=lat), F32), jnp.asarray(1 + 0.1 * rng.normal(size=128), F32),
            jnp.asarray(0.1 * rng.normal(size=128), F32))
    return args, dict(kv_format=kv_fmt, index_format=idx_fmt, eps=1e-6, dtype=BF16, indexer_interleave=False,
                      hadamard=True)


def _check_kv32(got, want, args, kw, impl) -> None:
    if impl == "xla":
        return _exact(got, want)
    slots = np.asarray(args[4])
    assert_cache_match(kw["kv_format"], got[0], want[0], slots, False, "MLA cache")
    assert_cache_match(kw["index_format"], got[1], want[1], slots, False, "indexer cache")


# ----- fused insert V3.2: q side --------------------------------------------------------------------------
def _q32(rd: int) -> tuple[tuple, dict]:
    rng = np.random.default_rng(3)
    cos, sin = _rope(T, rd, 4)
    args = (jnp.asarray(rng.normal(size=(T, 4, 128 + rd)), BF16), jnp.asarray(rng.normal(size=(T, 4, 128)), BF16),
            jnp.asarray(rng.normal(size=(T, 4)), F32), cos, sin)
    return args, dict(nope_dim=128, dtype=BF16, indexer_interleave=False, hadamard=True, fp8=True)


def _check_q32(got, want, args, kw, impl) -> None:
    if impl == "xla":
        return _exact(got, want)
    assert_q_match(got[0], want[0], False, "q_pe", 2e-2)
    deq = lambda q, s: np.asarray(q.astype(F32)) * np.asarray(s)[..., None]
    g, w = deq(got[1], got[2]), deq(want[1], want[2])
    np.testing.assert_allclose(g, w, rtol=0.13, atol=2e-2 * np.abs(w).max(), err_msg="dequantised index q")


# ----- fused insert V4 ------------------------------------------------------------------------------------
def _v4(d: int, fmt) -> tuple[tuple, dict]:
    rng = np.random.default_rng(5)
    cos, sin = _rope(T, 64, 6)
    args = (jnp.asarray(rng.normal(size=(T, 4, d)), BF16), jnp.asarray(rng.normal(size=(T, d)), BF16), cos, sin,
            _slots(T, 32, 7), empty_cache(fmt, 2), jnp.asarray(1 + 0.1 * rng.normal(size=d), F32))
    return args, dict(window_format=fmt, eps=1e-6, dtype=BF16)


def _check_v4(got, want, args, kw, impl) -> None:
    if impl == "xla":
        return _exact(got, want)
    assert_q_match(got[0], want[0], False, "q", 2e-2)
    assert_cache_match(kw["window_format"], got[1], want[1], np.asarray(args[4]), False, "window")


# ----- indexer top-k --------------------------------------------------------------------------------------
def _indexer(fmt, nblk: int = 3, seed: int = 8, nvis: tuple = (3, 10, 20, 39, 40, 5, 30, 50, 69, 70)
             ) -> tuple[tuple, dict]:
    """Two requests of 40 and 70 keys on shuffled pages; 5 tokens of each (some see fewer keys than k).
    (``nblk`` pages a request, ``seed`` and ``nvis``: scripts/diag/indexer_logits_check.py's variants.)"""
    rng = np.random.default_rng(seed)
    epp = fmt.entries_per_page
    bt = rng.permutation(2 * nblk + 1)[: 2 * nblk].reshape(2, nblk).astype(np.int32)
    n = (2 * nblk + 1) * epp
    cache = _write(empty_cache(fmt, 2 * nblk + 1), fmt, jnp.arange(n, dtype=jnp.int32),
                   jnp.asarray(rng.normal(size=(n, 128)) * rng.uniform(0.1, 3, (n, 1)), F32))
    q = jnp.asarray(rng.normal(size=(10, 8, 128)), F32)
    qd, wf = _prep_q(q, jnp.asarray(rng.normal(size=(10, 8)), F32), head_dim=128, n_heads=8, fp8=True,
                     hadamard=False, dtype=F32)
    req = jnp.asarray([0] * 5 + [1] * 5, jnp.int32)
    return (qd, wf, cache, jnp.asarray(bt), req, jnp.asarray(nvis, jnp.int32)), dict(fmt=fmt, k=16)


def _indexer_op(q, w, cache, bt, req, nvis, *, fmt, k, **kw):
    """indexer_topk with its static format and k as keywords (bound under jit)."""
    return indexer_topk(q, w, cache, fmt, bt, req, nvis, k, **kw)


def _indexer_reference(args, kw):
    """float64 scores of every visible key (numpy over the decoded keys), and each score's abs-sum
    sum_h |w_h| sum_d |q_hd k_d| (the scale of its rounding error)."""
    qd, wf, cache, bt, req, nvis = args
    fmt = kw["fmt"]
    keys = np.asarray(_gather(cache, fmt, bt, bt.shape[1] * fmt.entries_per_page), np.float64)[np.asarray(req)]
    q, w = np.asarray(qd, np.float64), np.asarray(wf, np.float64)
    dots = np.einsum("thd,tnd->thn", q, keys)
    scores = np.einsum("th,thn->tn", w, np.maximum(dots, 0))
    abssum = np.einsum("th,thn->tn", np.abs(w), np.einsum("thd,tnd->thn", np.abs(q), np.abs(keys)))
    return np.where(np.arange(scores.shape[1])[None] < np.asarray(nvis)[:, None], scores, -np.inf), abssum


def _check_indexer(got, want, args, kw, impl) -> None:
    """Each row: min(k, visible) distinct visible keys, then -1; every chosen key scores at least the k-th
    best, up to the score's rounding error (ties at the boundary may go either way): fp32 for XLA; for the
    kernel, the H200's FP8 wgmma accumulator (test_kernel_sparse_indexer._rtol, of the score's abs-sum)."""
    scores, abssum = want
    rtol = 1e-5 if impl == "xla" else _indexer_rtol("native")
    k, got = kw["k"], np.asarray(got)
    for t, row in enumerate(got):
        n = int(np.isfinite(scores[t]).sum())
        m = min(k, n)
        assert (row[m:] == -1).all() and (row[:m] >= 0).all() and len(set(row[:m])) == m, (t, row)
        if m:
            order = np.argsort(-np.where(np.isfinite(scores[t]), scores[t], -np.inf), kind="stable")
            kth = scores[t][order[m - 1]]
            tol = rtol * (abssum[t][row[:m]] + abssum[t][order[m - 1]])
            assert (scores[t][row[:m]] >= kth - tol).all(), (t, row, scores[t][row[:m]], kth)


# ----- top-k select ---------------------------------------------------------------------------------------
def _topk() -> tuple[tuple, dict]:
    rng = np.random.default_rng(9)
    x = rng.normal(size=(4, 300)).astype(np.float32)
    x[1, ::3] = 0.5  # ties: the lower index first
    x[2, 100:] = -np.inf
    return (jnp.asarray(x),), {"k": 37}


def _topk_reference(args, kw):
    return jax.lax.top_k(args[0], kw["k"])


def _check_topk(got, want, args, kw, impl) -> None:
    _exact(got, want)  # exact by construction: same values, same order, for every implementation


def _topk_op(x, *, k, **kw):
    return topk_select(x, k, **kw)


# ----- sparse MQA -----------------------------------------------------------------------------------------
def _mqa(fmt, dim: int, v_dim: int) -> tuple[tuple, dict]:
    rng = np.random.default_rng(10)
    n = 8 * fmt.entries_per_page
    cache = _write(empty_cache(fmt, 8), fmt, jnp.arange(n, dtype=jnp.int32),
                   jnp.asarray(rng.normal(size=(n, dim)), F32))
    slots = np.where(rng.random((3, 100)) < 0.2, -1, rng.integers(0, n, (3, 100))).astype(np.int32)
    slots[1] = -1  # no valid candidate: zeros
    q = jnp.asarray(rng.normal(size=(3, 4, dim)), F32).astype(BF16).astype(F32)
    return (q, (cache,), (jnp.asarray(slots),)), dict(formats=(fmt,), scale=0.06, v_dim=v_dim)


def _mqa_op(q, caches, slots, *, formats, **kw):
    """sparse_mqa with its static formats as a keyword (bound under jit)."""
    return sparse_mqa(q, caches, formats, slots, **kw)


def _mqa_reference(args, kw):
    """float64 softmax over each token's valid decoded rows (numpy)."""
    q, (cache,), (slots,) = args
    (fmt,) = kw["formats"]
    rows = np.asarray(_read(cache, fmt, slots), np.float64)
    valid = np.asarray(slots) >= 0
    logits = np.einsum("thd,tkd->thk", np.asarray(q, np.float64), rows) * kw["scale"]
    logits = np.where(valid[:, None], logits, -np.inf)
    m = np.max(logits, -1, keepdims=True)
    p = np.exp(logits - np.where(np.isfinite(m), m, 0))
    den = p.sum(-1, keepdims=True)
    out = np.einsum("thk,tkd->thd", p, rows[..., : kw["v_dim"]])
    return np.where(den > 0, out / np.where(den > 0, den, 1), 0), np.abs(rows[..., : kw["v_dim"]]).max()


def _check_mqa(got, want, args, kw, impl) -> None:
    """XLA: fp32 vs float64 (1e-5 of max|V|); the kernel: 2^-8 max|V| (P rounded to bf16, see
    tests/test_kernel_sparse_mqa.py)."""
    ref, vmax = want
    got = np.asarray(got)
    assert got.shape == ref.shape and np.isfinite(got).all() and (got[1] == 0).all()
    tol = 1e-5 if impl == "xla" else 2.0 ** -8
    assert np.abs(got - ref).max() <= tol * vmax


# ----- V4 compressor -------------------------------------------------------------------------------------
def _state(d: int) -> tuple[tuple, dict]:
    rng = np.random.default_rng(11)
    fmt = comp.state_format(4, d, 16)
    args = (jnp.asarray(rng.normal(size=(3, fmt.page_elems)), F32), jnp.asarray(rng.normal(size=(T, 4 * d)), F32),
            jnp.asarray(rng.normal(size=(4, 2 * d)), F32), jnp.asarray(rng.integers(0, 50, T), jnp.int32),
            _slots(T, 48, 12))
    return args, dict(ratio=4, d=d, block_size=16)


def _pool(d: int) -> tuple[tuple, dict]:
    rng = np.random.default_rng(13)
    fmt = comp.state_format(4, d, 16)
    blocks = rng.integers(0, 16, T).astype(np.int32)
    blocks[[1, 4]] = -1
    cos, sin = _rope(T, 16, 14)
    args = (jnp.asarray(rng.normal(size=(9, fmt.page_elems)), F32),
            jnp.asarray(rng.permutation(9)[:8].reshape(2, 4), jnp.int32), jnp.asarray(rng.integers(0, 2, T), jnp.int32),
            jnp.asarray(blocks), jnp.asarray(1 + 0.1 * rng.normal(size=d), F32), cos, sin)
    return args, dict(ratio=4, d=d, block_size=16, eps=1e-6, dtype=BF16)


def _check_pool(got, want, args, kw, impl) -> None:
    """Rows that close a block (the others go nowhere: slot -1); the kernel's float32 sums in another order may flip
    a bf16 rounding of the norm's output, which the rotation carries."""
    ok = np.asarray(args[3]) >= 0
    g, w = (np.asarray(x.astype(F32))[ok] for x in (got, want))
    if impl == "xla":
        return np.testing.assert_array_equal(g, w)
    np.testing.assert_allclose(g, w, rtol=2.0 ** -7, atol=2.0 ** -7 * np.abs(w).max())


def _entries(d: int, fmt) -> tuple[tuple, dict]:
    rng = np.random.default_rng(15)
    args = (jnp.asarray(rng.integers(0, 256, (2, fmt.page_elems)), fmt.dtype) if jnp.dtype(fmt.dtype) == jnp.uint8
            else jnp.asarray(rng.normal(size=(2, fmt.page_elems)), fmt.dtype),
            jnp.asarray(rng.normal(size=(T, d)), BF16), _slots(T, 2 * fmt.entries_per_page, 16))
    return args, dict(fmt=fmt)


def _index_keys(hadamard: bool) -> tuple[tuple, dict]:
    (cache, _, slots), _ = _entries(128, IndexerRecord132(8))
    keys = jnp.asarray(np.random.default_rng(17).normal(size=(T, 128)), F32)
    return (cache, keys, slots), dict(fmt=IndexerRecord132(8), hadamard=hadamard, dtype=BF16)


CASES = [
    OpCase("fused_kv_insert_v32", fused_kv_insert_v32,
           lambda: _kv32(512, MlaRecord656(16), IndexerRecord132(16)), _compiled(fi.kv_insert_v32_xla),
           _check_kv32, unsupported=lambda: _kv32(384, FloatRows(448, 16, BF16), FloatRows(128, 16, BF16))),
    OpCase("fused_q_v32", fused_q_v32, lambda: _q32(64), _compiled(fi.q_v32_xla), _check_q32,
           unsupported=lambda: _q32(48)),
    OpCase("fused_qnorm_rope_kv_insert_v4", fused_qnorm_rope_kv_insert_v4, lambda: _v4(512, MlaRecord584(16)),
           _compiled(fi.qnorm_rope_kv_insert_v4_xla), _check_v4,
           unsupported=lambda: _v4(384, FloatRows(384, 16, BF16))),
    OpCase("indexer_topk", _indexer_op, lambda: _indexer(IndexerRecord132(32)), _indexer_reference,
           _check_indexer, unsupported=lambda: _indexer(FloatRows(128, 32, F32))),
    OpCase("topk_select", _topk_op, _topk, _topk_reference, _check_topk),
    OpCase("sparse_mqa", _mqa_op, lambda: _mqa(MlaRecord656(16), 576, 512), _mqa_reference, _check_mqa,
           unsupported=lambda: _mqa(MlaRecord584(1), 512, 512)),
    OpCase("write_state", write_state, lambda: _state(64), _compiled(comp.write_state_xla), _check_exact,
           unsupported=lambda: _state(48)),
    OpCase("pool_norm_rope", pool_norm_rope, lambda: _pool(64), _compiled(comp.pool_norm_rope_xla), _check_pool,
           unsupported=lambda: _pool(48)),
    OpCase("insert_entries", insert_entries, lambda: _entries(512, MlaRecord584(4)),
           lambda args, kw: _write(args[0], kw["fmt"], args[2], args[1]), _check_exact,
           unsupported=lambda: _entries(48, FloatRows(48, 4, BF16))),
    OpCase("insert_index_keys", insert_index_keys, lambda: _index_keys(False),
           lambda args, kw: _write(args[0], kw["fmt"], args[2], prepare_indexer_k(args[1], hadamard=kw["hadamard"],
                                                                                  dtype=kw["dtype"])), _check_exact,
           unsupported=lambda: _index_keys(True)),
]
_ids = [c.name for c in CASES]


@pytest.mark.parametrize("impl,mode", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow_interpret else [])
                                  for c in CASES])
def test_every_implementation_matches_the_reference(case: OpCase, impl: str, mode: str) -> None:
    if impl != "xla":
        interpret_for(mode)  # skips the mode that does not apply on this backend, before any work
    args, kw = case.make()
    want = case.reference(args, kw)
    case.check(call(case, impl, mode, args, kw), want, args, kw, impl)


@pytest.mark.parametrize("case", [c for c in CASES if c.unsupported], ids=[c.name for c in CASES if c.unsupported])
def test_auto_falls_back_where_the_kernel_cannot_take_the_config(case: OpCase) -> None:
    args, kw = case.unsupported()
    with pytest.raises(Unsupported):
        call(case, "pallas", "interpret", args, kw)
    assert kernel_count(case, "auto", args, kw) == 0
    _exact(call(case, "auto", "interpret", args, kw), call(case, "xla", "-", args, kw))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_auto_takes_the_kernel_where_it_fits(case: OpCase) -> None:
    args, kw = case.make()
    assert kernel_count(case, "xla", args, kw) == 0
    assert kernel_count(case, "auto", args, kw) == kernel_count(case, "pallas", args, kw) > 0


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_bad_implementation_is_a_value_error_naming_the_field(case: OpCase) -> None:
    args, kw = case.make()
    with pytest.raises(ValueError, match="implementation must be one of 'auto', 'pallas', 'xla', got 'fast'"):
        case.op(*args, **kw, implementation="fast")


def test_unsupported_is_both_not_implemented_and_value_error() -> None:
    """"auto" catches NotImplementedError; an explicit "pallas" caller sees a ValueError (bad input)."""
    assert issubclass(Unsupported, NotImplementedError) and issubclass(Unsupported, ValueError)


def test_validation_and_layer_mapping() -> None:
    with pytest.raises(ValueError, match="^kind must be one of 'auto', 'pallas', 'xla', got 'gpu'$"):
        check_implementation("gpu", "kind")
    assert op_implementation("xla") == "xla" and op_implementation("pallas") == "auto"
    assert op_implementation("auto") == ("auto" if jax.default_backend() == "gpu" else "xla")


def test_num_sms() -> None:
    """The default GPU's SM count (a persistent kernel's grid); off-GPU the H200's."""
    d = jax.devices()[0]
    assert num_sms() == (d.core_count if d.platform == "gpu" else H200_SMS) > 0
