"""Bad input to an op's public entry point is a ValueError naming the argument, raised at trace time from static
shapes and dtypes (the ops run under ``jax.jit``), for every implementation: never an error from deep inside XLA or a
kernel, a silent broadcast or a silently wrong result. Empty batches (T = 0) return empty results.

Every case raises before any computation, or returns without a kernel (the T = 0 paths), so the file runs no
interpret-mode kernel. The valid calls these cases are derived from are tests/test_ops.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.ops.dispatch import check_array, check_int
from jds.ops.paging import check_cache, empty_cache, record_dim
from jds.ops.records import FloatRows, IndexerRecord132, IndexerRecordFP4, MlaRecord584, MlaRecord656
from pallas_kernels.fp8_gemm import fp8_linear
from pallas_kernels.fused_insert_v32 import fused_kv_insert_v32, fused_q_v32
from pallas_kernels.fused_insert_v4 import fused_qnorm_rope_kv_insert_v4
from pallas_kernels.grouped_rows import row_layout
from pallas_kernels.record_gather import dequant_blocks
from pallas_kernels.sparse_indexer import IndexerKernelConfig, indexer_topk
from pallas_kernels.sparse_mqa import sparse_mqa
from pallas_kernels.split_combine import split_combine
from pallas_kernels.topk_select import TopkSelectConfig, select_unsorted, topk_select

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
T = 3


def _replace(args: tuple, i: int, value) -> tuple:
    return args[:i] + (value,) + args[i + 1:]


# ----- shared helpers --------------------------------------------------------------------------------------
def test_check_helpers() -> None:
    check_array("x", jnp.zeros((2, 3), I32), (("T", 2), ("K", None)), "int")
    with pytest.raises(ValueError, match=r"^slots must be int32 \[T=4, K\], got float32 \[4, 8\]$"):
        check_array("slots", jnp.zeros((4, 8), F32), (("T", 4), ("K", None)), "int")
    with pytest.raises(ValueError, match=r"q must be float \[T, H\], got int32 \[2\]"):
        check_array("q", jnp.zeros((2,), I32), (("T", None), ("H", None)), "float")
    with pytest.raises(ValueError, match="slots must be int32"):  # -1 means masked: unsigned slots cannot hold it
        check_array("slots", jnp.zeros((4,), jnp.uint32), (("T", 4),), "int")
    assert check_int("k", np.int64(3), 1) == 3
    for bad in (True, 2.5, "3"):
        with pytest.raises(ValueError, match="k must be an int"):
            check_int("k", bad, 1)
    with pytest.raises(ValueError, match=r"v_dim must be in \[1, 8\], got 9"):
        check_int("v_dim", 9, 1, 8)


@pytest.mark.parametrize("fmt,dim", [(FloatRows(128, 16), 128), (MlaRecord656(16), 576), (MlaRecord584(16), 512),
                                     (IndexerRecord132(32), 128), (IndexerRecordFP4(32), 128)])
def test_record_dim(fmt, dim: int) -> None:
    assert record_dim(fmt) == dim
    assert check_cache("cache", empty_cache(fmt, 2), fmt) == dim


def test_check_cache() -> None:
    fmt = MlaRecord656(16)
    for bad in (jnp.zeros((2, 100), jnp.uint8), jnp.zeros((2, fmt.page_elems), F32), jnp.zeros((2 * fmt.page_elems,),
                jnp.uint8), jnp.zeros((0, fmt.page_elems), jnp.uint8)):
        with pytest.raises(ValueError, match=r"kv_cache must be uint8 \[num_blocks >= 1, 10496\]"):
            check_cache("kv_cache", bad, fmt)
    with pytest.raises(ValueError, match="formats\\[0\\] must be a record format"):
        check_cache("caches[0]", jnp.zeros((2, 4), jnp.uint8), "mla", "formats[0]")


# ----- sparse MQA ------------------------------------------------------------------------------------------
_MQA_FMT = MlaRecord656(16)


def _mqa_args() -> tuple:
    return jnp.ones((T, 4, 576), F32), (empty_cache(_MQA_FMT, 2),), (_MQA_FMT,), (jnp.zeros((T, 20), I32),)


@pytest.mark.parametrize("change,match", [
    (lambda a: _replace(a, 0, a[0][:, 0]), r"q must be float \[T, H, Dk\], got float32 \[3, 576\]"),
    (lambda a: _replace(a, 0, a[0].astype(I32)), r"q must be float"),
    (lambda a: _replace(a, 0, a[0][..., :512]), r"q head dim Dk = 512 must equal the row width of every format"),
    (lambda a: _replace(a, 3, (a[3][0].astype(F32),)), r"slots\[0\] must be int32 \[T=3, K_0\], got float32"),
    (lambda a: _replace(a, 3, (a[3][0][:1],)), r"slots\[0\] must be int32 \[T=3, K_0\], got int32 \[1, 20\]"),
    (lambda a: _replace(a, 3, (a[3][0][0],)), r"slots\[0\] must be int32 \[T=3, K_0\], got int32 \[20\]"),
    (lambda a: _replace(a, 3, (a[3][0].astype(jnp.uint32),)), r"slots\[0\] must be int32"),
    (lambda a: _replace(a, 1, (jnp.zeros((2, 100), jnp.uint8),)),
     r"caches\[0\] must be uint8 \[num_blocks >= 1, 10496\]"),
    (lambda a: _replace(a, 1, (a[1][0].astype(F32),)), r"caches\[0\] must be uint8"),
    (lambda a: _replace(a, 1, (a[1][0].reshape(-1),)), r"caches\[0\] must be uint8"),
    (lambda a: _replace(a, 2, ("mla656",)), r"formats\[0\] must be a record format"),
    (lambda a: _replace(a, 2, (_MQA_FMT, _MQA_FMT)), "same non-zero length, got 1, 2 and 1"),
    # a second list whose rows are narrower, or whose tokens are fewer
    (lambda a: (a[0], a[1] + (empty_cache(FloatRows(512, 16, BF16), 2),), a[2] + (FloatRows(512, 16, BF16),),
                a[3] * 2), r"got widths \[576, 512\]"),
    (lambda a: (a[0], a[1] * 2, a[2] * 2, a[3] + (a[3][0][:1],)), r"slots\[1\] must be int32 \[T=3, K_1\]"),
])
@pytest.mark.parametrize("impl", ["xla", "auto", "pallas"])
def test_sparse_mqa_bad_inputs(change, match: str, impl: str) -> None:
    q, caches, formats, slots = change(_mqa_args())
    with pytest.raises(ValueError, match=match):
        sparse_mqa(q, caches, formats, slots, scale=0.1, v_dim=512, implementation=impl)


@pytest.mark.parametrize("kw,match", [
    (dict(v_dim=600), r"v_dim must be in \[1, 576\], got 600"),  # was: silently 576 columns
    (dict(v_dim=-1), r"v_dim must be in \[1, 576\], got -1"),  # was: silently 575 columns
    (dict(v_dim=0), r"v_dim must be in \[1, 576\], got 0"),
    (dict(v_dim=512.0), "v_dim must be an int"),
    (dict(sink=jnp.zeros((1,), F32)), r"sink must be float \[H=4\], got float32 \[1\]"),  # was: broadcast
    (dict(sink=jnp.zeros((5,), F32)), r"sink must be float \[H=4\]"),
    (dict(sink=jnp.zeros((4,), I32)), r"sink must be float \[H=4\], got int32"),
    (dict(implementation="fast"), "implementation must be one of"),
    (dict(combine="fast"), "combine must be one of"),
    (dict(implementation="pallas", num_splits=0), "num_splits must be >= 1, got 0"),
])
def test_sparse_mqa_bad_settings(kw: dict, match: str) -> None:
    q, caches, formats, slots = _mqa_args()
    kw = {"scale": 0.1, "v_dim": 512, "implementation": "xla", **kw}
    with pytest.raises(ValueError, match=match):
        sparse_mqa(q, caches, formats, slots, **kw)


def test_sparse_mqa_errors_at_trace_time() -> None:
    q, caches, formats, slots = _mqa_args()
    f = jax.jit(lambda q, c, s: sparse_mqa(q, c, formats, s, scale=0.1, v_dim=512, implementation="xla"))
    with pytest.raises(ValueError, match=r"slots\[0\] must be int32 \[T=3, K_0\], got int32 \[1, 20\]"):
        f.trace(q, caches, (slots[0][:1],))


def test_sparse_mqa_empty() -> None:
    """T = 0 gives [0, H, v_dim]; no candidate at all (K = 0) gives zeros, as the kernel does (was: a zero-size
    reduction error in the XLA implementation)."""
    q, caches, formats, slots = _mqa_args()
    out = sparse_mqa(q[:0], caches, formats, (slots[0][:0],), scale=0.1, v_dim=512, implementation="xla")
    assert out.shape == (0, 4, 512)
    for sink in (None, jnp.zeros((4,), F32)):
        out = sparse_mqa(q, caches, formats, (slots[0][:, :0],), scale=0.1, v_dim=512, sink=sink,
                         out_dtype=BF16, implementation="xla")
        assert out.shape == (T, 4, 512) and out.dtype == BF16 and not np.asarray(out, np.float32).any()


# ----- indexer top-k ---------------------------------------------------------------------------------------
_IDX_FMT = IndexerRecord132(32)


def _indexer_args() -> tuple:
    return (jnp.ones((T, 8, 128), F32), jnp.ones((T, 8), F32), empty_cache(_IDX_FMT, 3), _IDX_FMT,
            jnp.zeros((2, 2), I32), jnp.zeros((T,), I32), jnp.full((T,), 10, I32), 16)


@pytest.mark.parametrize("i,value,match", [
    (0, jnp.ones((T, 128), F32), r"index_q must be float \[T, Hi, D\]"),
    (0, jnp.ones((T, 8, 128), I32), r"index_q must be float"),
    (0, jnp.ones((T, 8, 64), F32), "index_q head dim D = 64 must equal the key width 128"),
    (1, jnp.ones((1, 8), F32), r"index_w must be float \[T=3, Hi=8\], got float32 \[1, 8\]"),  # was: broadcast
    (1, jnp.ones((T, 1), F32), r"index_w must be float \[T=3, Hi=8\], got float32 \[3, 1\]"),  # was: broadcast
    (2, jnp.zeros((3, 100), jnp.uint8), r"cache must be uint8 \[num_blocks >= 1, 4224\]"),  # was: silent
    (2, jnp.zeros((3, 4224), F32), r"cache must be uint8"),
    (3, "indexer", "fmt must be a record format"),
    (4, jnp.zeros((2,), I32), r"block_tables must be int32 \[R, max_blocks\]"),
    (4, jnp.zeros((2, 2), F32), r"block_tables must be int32"),
    (4, jnp.zeros((2, 0), I32), "block_tables must have at least one request row and one block column"),
    (4, jnp.zeros((0, 2), I32), "block_tables must have at least one request row and one block column"),
    (5, jnp.zeros((T,), F32), r"req_idx must be int32 \[T=3\], got float32"),
    (5, jnp.zeros((1,), I32), r"req_idx must be int32 \[T=3\], got int32 \[1\]"),  # was: broadcast
    (6, jnp.full((T,), 10.0, F32), r"n_visible must be int32 \[T=3\], got float32"),  # was: silent
    (6, jnp.full((1,), 10, I32), r"n_visible must be int32 \[T=3\], got int32 \[1\]"),  # was: broadcast
    (7, 0, "k must be >= 1, got 0"),
    (7, -1, "k must be >= 1, got -1"),
    (7, 2.5, "k must be an int, got 2.5"),
])
@pytest.mark.parametrize("impl", ["xla", "auto", "pallas"])
def test_indexer_topk_bad_inputs(i: int, value, match: str, impl: str) -> None:
    args = _replace(_indexer_args(), i, value)
    with pytest.raises(ValueError, match=match):
        indexer_topk(*args, implementation=impl)


@pytest.mark.parametrize("impl", ["xla", "auto", "pallas"])
def test_indexer_topk_empty_batch(impl: str) -> None:
    """T = 0: [0, k] int32 (was: ZeroDivisionError on the kernel path)."""
    q, w, cache, fmt, bt, req, nv, k = _indexer_args()
    out = indexer_topk(q[:0], w[:0], cache, fmt, bt, req[:0], nv[:0], k, implementation=impl, interpret=True)
    assert out.shape == (0, k) and out.dtype == I32


@pytest.mark.parametrize("kw,match", [
    (dict(queries_per_cta=1.5), "queries_per_cta must be an int or None, got 1.5"),
    (dict(tiles_per_cta=2.5), "tiles_per_cta must be an int or None"),
    (dict(num_buffers=1.5), "num_buffers must be an int, got 1.5"),
    (dict(max_logits_bytes=1e9), "max_logits_bytes must be an int"),
    (dict(topk_segment=2.5), "topk_segment must be an int or None"),
    (dict(topk_split_finish="no"), "topk_split_finish must be a bool"),
    (dict(topk_invisible_in_kernel=1), "topk_invisible_in_kernel must be a bool"),
])
def test_indexer_config_fields(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        IndexerKernelConfig(**kw)


def test_indexer_config_type() -> None:
    with pytest.raises(ValueError, match="config must be an IndexerKernelConfig or None, got 'fast'"):
        indexer_topk(*_indexer_args(), implementation="xla", config="fast")


# ----- top-k select ----------------------------------------------------------------------------------------
def test_topk_select_config_and_k() -> None:
    x = jnp.zeros((2, 64), F32)
    for impl in ("xla", "pallas"):
        with pytest.raises(ValueError, match="config must be a TopkSelectConfig or None"):
            topk_select(x, 4, implementation=impl, config={"bits": 4})
        with pytest.raises(ValueError, match="k must be an int, got True"):
            topk_select(x, True, implementation=impl)
    with pytest.raises(ValueError, match="config must be a TopkSelectConfig or None"):
        select_unsorted(x, 4, config="fast")
    with pytest.raises(ValueError, match="hist_block must be a power of 2, got 1.5"):  # was: TypeError
        TopkSelectConfig(hist_block=1.5)


# ----- fused inserts ---------------------------------------------------------------------------------------
def _rope(t: int, half: int = 32) -> tuple:
    return jnp.ones((t, half), F32), jnp.zeros((t, half), F32)


def _kv32_args() -> tuple:
    cos, sin = _rope(T)
    return (jnp.ones((T, 576), BF16), jnp.ones((T, 128), BF16), cos, sin, jnp.arange(T, dtype=I32),
            empty_cache(MlaRecord656(16), 2), empty_cache(IndexerRecord132(16), 2), jnp.ones((512,), F32),
            jnp.ones((128,), F32), jnp.zeros((128,), F32))


_KV32_KW = dict(kv_format=MlaRecord656(16), index_format=IndexerRecord132(16), eps=1e-6, dtype=BF16,
                indexer_interleave=False, hadamard=True)


@pytest.mark.parametrize("i,value,match", [
    (0, jnp.ones((T, 576), I32), r"kv must be float \[T, lat \+ rd\]"),
    (0, jnp.ones((T, 512), BF16), "kv width 512 must equal kv_format's row width 576"),
    (1, jnp.ones((1, 128), BF16), r"index_k must be float \[T=3, Di\], got bfloat16 \[1, 128\]"),
    (1, jnp.ones((T, 64), BF16), "index_k head dim 64 must equal index_format's row width 128"),
    (2, jnp.ones((1, 32), F32), r"cos must be float \[T=3, rd/2\], got float32 \[1, 32\]"),  # was: broadcast
    (2, jnp.ones((32,), F32), r"cos must be float \[T=3, rd/2\], got float32 \[32\]"),  # was: broadcast
    (3, jnp.zeros((T, 16), F32), r"sin must be float \[T=3, rd/2=32\]"),
    (4, jnp.arange(T, dtype=F32), r"slot_mapping must be int32 \[T=3\], got float32"),  # was: silent
    (4, jnp.arange(1, dtype=I32), r"slot_mapping must be int32 \[T=3\], got int32 \[1\]"),
    (5, jnp.zeros((2, 100), jnp.uint8), r"kv_cache must be uint8 \[num_blocks >= 1, 10496\]"),
    (5, jnp.zeros((2, 10496), F32), r"kv_cache must be uint8"),  # was: a float cache came back
    (6, jnp.zeros((2, 100), jnp.uint8), r"index_cache must be uint8 \[num_blocks >= 1, 2112\]"),  # was: silent
    (7, jnp.ones((1,), F32), r"kv_norm_w must be float \[lat=512\], got float32 \[1\]"),  # was: broadcast
    (8, jnp.ones((64,), F32), r"k_norm_w must be float \[Di=128\]"),
    (9, jnp.zeros((1,), F32), r"k_norm_b must be float \[Di=128\], got float32 \[1\]"),  # was: broadcast
])
@pytest.mark.parametrize("impl", ["xla", "auto", "pallas"])
def test_fused_kv_insert_v32_bad_inputs(i: int, value, match: str, impl: str) -> None:
    args = _replace(_kv32_args(), i, value)
    with pytest.raises(ValueError, match="fused_kv_insert_v32: " + match):
        fused_kv_insert_v32(*args, **_KV32_KW, implementation=impl)


def test_fused_kv_insert_v32_dims_and_tiles() -> None:
    args = _kv32_args()
    with pytest.raises(ValueError, match="hadamard=True needs a power-of-2 index_k head dim, got 96"):
        fused_kv_insert_v32(*_replace(args, 1, jnp.ones((T, 96), BF16)),
                            **{**_KV32_KW, "index_format": FloatRows(96, 16, BF16)}, implementation="xla")
    with pytest.raises(ValueError, match="index_k head dim 32 must be at least the rope dim 64"):
        fused_kv_insert_v32(*_replace(args, 1, jnp.ones((T, 32), BF16)),
                            **{**_KV32_KW, "index_format": FloatRows(32, 16, BF16), "hadamard": False},
                            implementation="xla")
    for kw, match in ((dict(block_tokens=3), "block_tokens must be a power of 2"),
                      (dict(block_tokens=0), "block_tokens must be a power of 2"),
                      (dict(num_warps=3), "num_warps must be a power of 2")):
        for impl in ("auto", "pallas"):  # a tile setting is no reason for "auto" to fall back
            with pytest.raises(ValueError, match="fused_kv_insert_v32: " + match):
                fused_kv_insert_v32(*args, **_KV32_KW, implementation=impl, interpret=True, **kw)


@pytest.mark.parametrize("impl", ["xla", "auto", "pallas"])
def test_fused_kv_insert_v32_empty_batch(impl: str) -> None:
    """T = 0 writes nothing (was: a gather error on the kernel path)."""
    a = _kv32_args()
    args = (a[0][:0], a[1][:0], a[2][:0], a[3][:0], a[4][:0]) + a[5:]
    kv_cache, index_cache = fused_kv_insert_v32(*args, **_KV32_KW, implementation=impl, interpret=True)
    assert kv_cache.shape == a[5].shape and index_cache.shape == a[6].shape
    assert not np.asarray(kv_cache).any() and not np.asarray(index_cache).any()


def _q32_args() -> tuple:
    cos, sin = _rope(T)
    return jnp.ones((T, 4, 192), BF16), jnp.ones((T, 4, 128), BF16), jnp.ones((T, 4), F32), cos, sin


_Q32_KW = dict(nope_dim=128, dtype=BF16, indexer_interleave=False, hadamard=True, fp8=True)


@pytest.mark.parametrize("i,value,kw,match", [
    (None, None, dict(nope_dim=100), "q head dim 192 must equal nope_dim 100 \\+ the rope dim 64"),  # was: silent
    (None, None, dict(nope_dim=200), "q head dim 192 must equal nope_dim 200 \\+ the rope dim 64"),
    (None, None, dict(scale_fmt="e8m0"), r"scale_fmt must be one of \('ue8m0', 'amax'\), got 'e8m0'"),  # was: silent
    (0, jnp.ones((T, 192), BF16), {}, r"q must be float \[T, H, nope \+ rd\]"),  # was: a silent [T, 64] q_pe
    (1, jnp.ones((1, 4, 128), BF16), {}, r"index_q must be float \[T=3, Hi, Di\]"),
    (1, jnp.ones((T, 4, 100), BF16), {}, "hadamard=True needs a power-of-2 index_q head dim, got 100"),
    (1, jnp.ones((T, 4, 48), BF16), dict(hadamard=False), "index_q head dim 48 must be at least the rope dim 64"),
    (2, jnp.ones((1, 4), F32), {}, r"index_w must be float \[T=3, Hi=4\], got float32 \[1, 4\]"),  # was: broadcast
    (2, jnp.ones((T, 1), F32), {}, r"index_w must be float \[T=3, Hi=4\], got float32 \[3, 1\]"),  # was: broadcast
    (3, jnp.ones((1, 32), F32), {}, r"cos must be float \[T=3, rd/2\]"),  # was: broadcast
])
@pytest.mark.parametrize("impl", ["xla", "auto", "pallas"])
def test_fused_q_v32_bad_inputs(i, value, kw: dict, match: str, impl: str) -> None:
    args = _q32_args() if i is None else _replace(_q32_args(), i, value)
    with pytest.raises(ValueError, match="fused_q_v32: " + match):
        fused_q_v32(*args, **{**_Q32_KW, **kw}, implementation=impl)


@pytest.mark.parametrize("impl", ["xla", "auto", "pallas"])
def test_fused_q_v32_empty_batch(impl: str) -> None:
    """T = 0: empty outputs of the documented shapes (was: a gather error on the kernel path)."""
    args = tuple(a[:0] for a in _q32_args())
    q_pe, qi, s, w = fused_q_v32(*args, **_Q32_KW, implementation=impl, interpret=True)
    assert (q_pe.shape, qi.shape, s.shape, w.shape) == ((0, 4, 64), (0, 4, 128), (0, 4), (0, 4))
    assert qi.dtype == jnp.float8_e4m3fn and q_pe.dtype == BF16


_V4_FMT = MlaRecord584(16)


def _v4_args() -> tuple:
    cos, sin = _rope(T)
    return (jnp.ones((T, 4, 512), BF16), jnp.ones((T, 512), BF16), cos, sin, jnp.arange(T, dtype=I32),
            empty_cache(_V4_FMT, 2), jnp.ones((512,), F32))


@pytest.mark.parametrize("i,value,fmt,match", [
    (0, jnp.ones((T, 512), BF16), None, r"q must be float \[T, H, D\]"),  # was: a silent [T, D] result
    (0, jnp.ones((T, 4, 512), I32), None, r"q must be float"),
    (1, jnp.ones((1, 512), BF16), None, r"kv must be float \[T=3, D=512\], got bfloat16 \[1, 512\]"),
    (1, jnp.ones((T, 256), BF16), None, r"kv must be float \[T=3, D=512\]"),
    (2, jnp.ones((1, 32), F32), None, r"cos must be float \[T=3, rd/2\]"),  # was: broadcast
    (4, jnp.arange(T, dtype=F32), None, r"slot_mapping must be int32 \[T=3\], got float32"),  # was: silent
    (4, jnp.arange(1, dtype=I32), None, r"slot_mapping must be int32 \[T=3\], got int32 \[1\]"),
    (5, jnp.zeros((2, 100), jnp.uint8), None, r"window_cache must be uint8 \[num_blocks >= 1, 9344\]"),
    (5, empty_cache(FloatRows(256, 16, BF16), 2), FloatRows(256, 16, BF16),
     "head dim 512 must equal window_format's row width 256"),  # was: half of each row written, silently
    (6, jnp.ones((1,), F32), None, r"kv_norm_w must be float \[D=512\], got float32 \[1\]"),  # was: broadcast
])
@pytest.mark.parametrize("impl", ["xla", "auto", "pallas"])
def test_fused_v4_bad_inputs(i: int, value, fmt, match: str, impl: str) -> None:
    args = _replace(_v4_args(), i, value)
    with pytest.raises(ValueError, match="fused_qnorm_rope_kv_insert_v4: " + match):
        fused_qnorm_rope_kv_insert_v4(*args, window_format=fmt or _V4_FMT, eps=1e-6, dtype=BF16,
                                      implementation=impl)


def test_fused_v4_tiles() -> None:
    for kw, field in ((dict(rows_per_program=3), "rows_per_program"), (dict(heads_per_program=6), "heads_per_program"),
                      (dict(num_warps=3), "num_warps")):
        for impl in ("auto", "pallas"):  # a tile setting is no reason for "auto" to fall back
            with pytest.raises(ValueError, match=f"fused_qnorm_rope_kv_insert_v4: {field} must be a power of 2"):
                fused_qnorm_rope_kv_insert_v4(*_v4_args(), window_format=_V4_FMT, eps=1e-6, dtype=BF16,
                                              implementation=impl, interpret=True, **kw)


@pytest.mark.parametrize("impl", ["xla", "auto", "pallas"])
def test_fused_v4_empty_batch(impl: str) -> None:
    """T = 0: an empty q and the cache unchanged (was: a gather error on the kernel path)."""
    a = _v4_args()
    args = tuple(x[:0] for x in a[:5]) + a[5:]
    q, cache = fused_qnorm_rope_kv_insert_v4(*args, window_format=_V4_FMT, eps=1e-6, dtype=BF16,
                                             implementation=impl, interpret=True)
    assert q.shape == (0, 4, 512) and q.dtype == BF16 and cache.shape == a[5].shape


# ----- split combine, row layout, record gather, FP8 linear -------------------------------------------------
def _combine_args() -> tuple:
    return jnp.ones((2, T, 8, 64), F32), jnp.zeros((2, T, 8), F32), jnp.ones((2, T, 8), F32)


@pytest.mark.parametrize("change,kw,match", [
    (lambda o, m, l: (o[:0], m[:0], l[:0]), {}, r"o must hold at least one split \(S >= 1\)"),  # was: TypeError
    (lambda o, m, l: (o.astype(I32), m, l), {}, "o must be a float array, got int32"),
    (lambda o, m, l: (o, m.astype(I32), l), {}, "m must be a float array, got int32"),
    (lambda o, m, l: (o, m, l), dict(heads=2.5), "heads must be an int, got 2.5"),  # was: TypeError
    (lambda o, m, l: (o, m, l), dict(sink=jnp.zeros((4,), I32)), r"sink must be float \[heads=4\]"),
])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_split_combine_bad_inputs(change, kw: dict, match: str, impl: str) -> None:
    kw = {"sink": None, "heads": 4, **kw}
    with pytest.raises(ValueError, match=match):
        split_combine(*change(*_combine_args()), kw.pop("sink"), **kw, out_dtype=F32, implementation=impl)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_split_combine_empty_batch(impl: str) -> None:
    """T = 0: [0, heads, D] (was: a gather error on the kernel path)."""
    o, m, l = (a[:, :0] for a in _combine_args())
    out = split_combine(o, m, l, None, heads=4, out_dtype=BF16, implementation=impl, interpret=True)
    assert out.shape == (0, 4, 64) and out.dtype == BF16


def test_row_layout_bad_inputs() -> None:
    sizes = jnp.array([3, 2], I32)
    with pytest.raises(ValueError, match=r"sizes must be int32 \[E\].*got float32 \[2\]"):  # was: silent cast
        row_layout(sizes.astype(F32), 5, 4, 32, 8)
    with pytest.raises(ValueError, match=r"sizes must be int32 \[E\].*got int32 \[1, 2\]"):
        row_layout(sizes[None], 5, 4, 32, 8)
    with pytest.raises(ValueError, match="bt must be >= 1, got 0"):  # was: a division by zero, silently
        row_layout(sizes, 5, 4, 32, 0)


def test_dequant_blocks_slots_rank() -> None:
    with pytest.raises(ValueError, match=r"slots must be int32 \[n, 64\]"):  # was: "not enough values to unpack"
        dequant_blocks(jnp.zeros((4, 656), jnp.uint8), jnp.zeros((64,), I32))


@pytest.mark.parametrize("impl", ["xla", "auto", "pallas"])
def test_fp8_linear_scale_dtype_and_in(impl: str) -> None:
    wq, ws = jnp.zeros((128, 256), jnp.float8_e4m3fn), jnp.ones((1, 2), F32)
    x = jnp.ones((2, 256), BF16)
    with pytest.raises(ValueError, match="w_scale must be a float array"):  # was: int scales taken silently
        fp8_linear(x, wq, ws.astype(I32), implementation=impl)
    wq, ws = jnp.zeros((128, 200), jnp.float8_e4m3fn), jnp.ones((1, 2), F32)
    with pytest.raises(ValueError, match="wq: in = 200 must be a multiple of 128"):  # was: act_quant's "last dim"
        fp8_linear(jnp.ones((2, 200), BF16), wq, ws, implementation=impl)
