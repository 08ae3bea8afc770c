"""pallas_kernels.topk_rows: each row's top k in IEEE's total order (a numpy reference), in ascending column order
with its values (integers: exact by construction), on random rows, ties across the k-th value, short rows (-inf
tails), signed zeros, NaNs and the edges k = 1 and k = N, rows of one to three register chunks, one to three bits
a round; through ``topk_from_logits`` in both orders; the lowering for an H200 at the indexer's decode shapes.
Interpret mode on the CPU, natively on a GPU (``gpu``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.ops.dispatch import Unsupported
from pallas_kernels import fused_insert_common as C
from pallas_kernels.sparse_indexer import topk_from_logits
from pallas_kernels.topk_rows import MAX_COLS, topk_rows
from tests.kernel_modes import MODES, interpret_for


def _rows(seed: int, t: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, n)).astype(np.float32)
    if t > 1:
        x[1] = np.round(x[1] * 2) / 2  # heavy ties, one of them across the k-th value
    if t > 2:
        x[2, n // 3:] = -np.inf  # a short row: fewer finite values than k when k > n / 3
    if t > 3:
        x[3, ::2], x[3, 1::2] = 0.0, -0.0  # signed zeros only: +0.0 ranks above -0.0
    if t > 4:  # NaNs by their bits: a positive one above +inf, a negative one (all bits set) below -inf
        x[4, 1::7] = np.float32(np.nan)
        x[4, 3::11] = np.uint32(0xFFFFFFFF).view(np.float32)
    return x


def _want(x: np.ndarray, k: int) -> np.ndarray:
    """Each row's top k columns in IEEE total order, equal keys by the lower column (a stable numpy sort of
    ``ordered_key``'s image). Not ``lax.top_k`` on the device: XLA's GPU sort ranks -0.0 level with +0.0 at 8192
    columns (the H100, 2026-12-07) and below it at 4096."""
    bits = x.view(np.uint32)
    key = np.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000)).astype(np.int64)
    return np.sort(np.argsort(-key, axis=1, kind="stable")[:, :k], axis=1)


def _check(x: np.ndarray, k: int, vals, idx) -> None:
    want = _want(x, k)
    idx, vals = np.asarray(idx), np.asarray(vals)
    for r in range(x.shape[0]):
        np.testing.assert_array_equal(idx[r], want[r], err_msg=f"row {r}")
    np.testing.assert_array_equal(vals.view(np.uint32), np.take_along_axis(x, idx, 1).view(np.uint32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t,n,k", [(5, 300, 128), (4, 64, 1), (4, 64, 64), (6, 4096, 2048), (4, 1400, 700)])
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_same_set_as_lax(mode, t, n, k, bits):
    interpret = interpret_for(mode)
    x = _rows(t * n + k, t, n)
    vals, idx = topk_rows(jnp.asarray(x), k, interpret=interpret, bits=bits)
    assert idx.dtype == jnp.int32 and vals.dtype == jnp.float32 and idx.shape == (t, k)
    _check(x, k, vals, idx)


@pytest.mark.gpu
@pytest.mark.parametrize("t,n,k", [(64, 4096, 2048), (64, 4160, 2048), (64, 4352, 2048), (16, 16384, 2048),
                                   (16, 16448, 2048), (128, 8192, 2048), (8, 8256, 512), (4, 17408, 2048)])
@pytest.mark.parametrize("bits", [1, 2])
def test_decode_shapes_native(t, n, k, bits):
    """The indexer's decode rows (4096 visible logits and a tile past them: two register chunks, 8-16K context)."""
    interpret_for("native")
    x = _rows(n, t, n)
    vals, idx = jax.jit(functools.partial(topk_rows, k=k, bits=bits))(jnp.asarray(x))
    _check(x, k, vals, idx)


@pytest.mark.parametrize("mode", MODES)
def test_through_topk_from_logits(mode):
    """``algorithm="pallas_rows"``: lax's indices in either order, -1 where the value is -inf."""
    interpret_for(mode)
    x = jnp.asarray(_rows(9, 4, 256))
    for order in ("set", "sorted"):
        got = np.asarray(topk_from_logits(x, 128, algorithm="pallas_rows", order=order))
        want = np.asarray(topk_from_logits(x, 128, algorithm="lax", order="sorted"))
        if order == "sorted":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(want, axis=1))


def test_errors():
    x = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="bits must be"):
        topk_rows(x, 4, bits=5)
    with pytest.raises(ValueError, match="k must be"):
        topk_rows(x, 65)
    with pytest.raises(ValueError, match="topk_rows: x"):
        topk_rows(x[0], 4)
    with pytest.raises(Unsupported, match="MAX_COLS"):
        topk_rows(jnp.zeros((1, MAX_COLS + 1), jnp.float32), 4)


@pytest.mark.parametrize("n", [4096, 16384])
def test_triton_lowering(n):
    """Pallas -> Triton IR for an (abstract) H200 at the indexer's decode shapes."""
    hlo = C.check_triton_lowering(functools.partial(topk_rows, k=2048, interpret=False),
                                  jnp.zeros((64, n), jnp.float32))
    assert "__gpu$xla.gpu.triton" in hlo


@pytest.mark.parametrize("n", [4160, 8256])
def test_sm90_compile_no_spills(n):
    """Triton IR -> PTX -> ptxas (sm_90a) with pip triton at the default warps: the row in registers, no spills at
    the indexer's widths to 8K context (at 16K + 64 columns ptxas spills 32 bytes; skipped without triton)."""
    pytest.importorskip("triton")
    for r in C.compile_sm90_report(functools.partial(topk_rows, k=2048, interpret=False),
                                   jnp.zeros((64, n), jnp.float32)):
        assert r["spill_bytes"] == 0, r
