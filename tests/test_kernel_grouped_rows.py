"""The grouped GEMMs' row layout (``pallas_kernels.grouped_rows.row_layout``): the one-kernel form equals the XLA
form integer for integer (expert sizes with empty experts, rows past the groups, expert counts that are not a
power of two, several programs), and lowers / compiles for an H200 at the models' shapes.

The XLA form itself is checked against hand-derived positions in ``tests/test_kernel_fp4_grouped_gemm.py``
(``test_layout``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fused_insert_common as C
from pallas_kernels import grouped_rows as G
from tests.kernel_modes import MODES, interpret_for


def _sizes(ne: int, m: int, rng: np.random.Generator, routed: int | None = None) -> np.ndarray:
    """Expert sizes of ``routed`` rows (default m) spread at random over ``ne`` experts (many empty)."""
    sizes = np.zeros(ne, np.int32)
    np.add.at(sizes, rng.integers(0, ne, size=m if routed is None else routed), 1)
    return sizes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ne,m,bt,routed", [(5, 30, 8, 28), (256, 6, 8, None), (7, 100, 16, None),
                                            (256, 512, 8, 500), (3, 1, 8, None), (40, 80, 32, 0)])
def test_layout_kernel_equals_xla(mode: str, ne: int, m: int, bt: int, routed: int | None) -> None:
    sizes = jnp.asarray(_sizes(ne, m, np.random.default_rng(ne * m + bt), routed))
    items, n_pad = G.n_items(m, ne, bt), G.padded_rows(m, ne, bt)
    want = G.row_layout(sizes, m, items, n_pad, bt, implementation="xla")
    got = G.row_layout(sizes, m, items, n_pad, bt, implementation="pallas", interpret=interpret_for(mode))
    for name, w, g in zip(("items", "src", "col", "valid", "count"), want, got, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ne,m,bt,routed", [(5, 30, 8, 28), (256, 512, 8, 500)])
def test_layout_kernel_unpacked_equals_xla(monkeypatch, mode: str, ne: int, m: int, bt: int, routed: int) -> None:
    """The kernel's form without packed sums (rows past ``PACK_LIMIT``: long prefills), here forced at small shapes."""
    monkeypatch.setattr(G, "PACK_LIMIT", 0)
    test_layout_kernel_equals_xla(mode, ne, m, bt, routed)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ne,m,bt,routed,split_pairs", [(5, 30, 8, 28, True), (256, 6, 8, None, True),
                                                        (7, 20, 16, None, False)])
def test_fused_layout_copies_rows(mode: str, ne: int, m: int, bt: int, routed: int | None, split_pairs: bool) -> None:
    """Layout "fused": the kernel's padded copies of x (uint8, and float16 as the FP8 GEMM passes it) and of its
    scales equal ``tile_rows`` of them (x's columns permuted as the FP4 GEMM's ``_permute_k`` for ``split_pairs``),
    byte for byte; its bookkeeping equals the XLA form's."""
    from pallas_kernels.fp4_grouped_gemm import _permute_k
    rng = np.random.default_rng(ne + m)
    sizes = jnp.asarray(_sizes(ne, m, rng, routed))
    k = 1024
    x = jnp.asarray(rng.integers(0, 256, (m, k)), jnp.uint8) if split_pairs else \
        jnp.asarray(rng.standard_normal((m, k)), jnp.float16)
    sc = jnp.asarray(rng.standard_normal((m, k // 128)), jnp.float32)
    p = G.plan(sizes, m, ne, 256, k, bt, None, None, 1, 512, interpret_for(mode), "fused", rows=(x, sc),
               split_pairs=split_pairs)
    q = G.plan(sizes, m, ne, 256, k, bt, None, None, 1, 512, True, "xla")
    for name in ("info", "src", "col", "valid", "count"):
        np.testing.assert_array_equal(np.asarray(getattr(p, name)), np.asarray(getattr(q, name)), err_msg=name)
    xw = _permute_k(x, "fp8") if split_pairs else x
    np.testing.assert_array_equal(np.asarray(p.xp), np.asarray(G.tile_rows(xw, q)))
    np.testing.assert_array_equal(np.asarray(p.sxt), np.asarray(G.tile_rows(sc, q).T))
    assert G.padded_x(x, sc, p)[0] is p.xp


def test_fused_layout_errors() -> None:
    with pytest.raises(ValueError, match="layout"):
        G.plan(jnp.ones(4, jnp.int32), 4, 4, 256, 512, 8, None, None, 1, 512, True, "triton")
    with pytest.raises(ValueError, match="x_scale"):
        G.plan(jnp.ones(4, jnp.int32), 4, 4, 256, 512, 8, None, None, 1, 512, True, "fused")


def test_layout_implementation_errors() -> None:
    with pytest.raises(ValueError, match="implementation"):
        G.row_layout(jnp.ones(4, jnp.int32), 4, 8, 64, 8, implementation="triton")


# V4-Flash (256 experts, top-6) and V3.2 (256, top-8): decode at 1 and 64 tokens, a 4096-token prefill
SHAPES = [(256, 6, 8), (256, 512, 8), (256, 32768, 128)]


@pytest.mark.parametrize("ne,m,bt", SHAPES)
def test_layout_lowers_for_cuda(ne: int, m: int, bt: int) -> None:
    fn = functools.partial(G.row_layout, m=m, n_items=G.n_items(m, ne, bt), n_padded=G.padded_rows(m, ne, bt), bt=bt,
                           implementation="pallas", interpret=False)
    assert "__gpu$xla.gpu.triton" in C.check_triton_lowering(fn, jax.ShapeDtypeStruct((ne,), jnp.int32))


@pytest.mark.parametrize("ne,m,bt,k", [(256, 6, 8, 4096), (256, 512, 8, 2048)])
def test_fused_layout_lowers_and_compiles(ne: int, m: int, bt: int, k: int) -> None:
    """Layout "fused" (V4-Flash's FP4 w1 input at 1 token, w2's at 64): lowers, and ptxas spills nothing."""
    items, n_pad = G.n_items(m, ne, bt), G.padded_rows(m, ne, bt)
    fn = functools.partial(G._row_layout_pallas, m=m, n_items=items, n_padded=n_pad, bt=bt, interpret=False,
                           split_pairs=True)
    args = (jax.ShapeDtypeStruct((ne,), jnp.int32),
            (jax.ShapeDtypeStruct((m, k), jnp.uint8), jax.ShapeDtypeStruct((m, k // 128), jnp.float32)))
    assert "__gpu$xla.gpu.triton" in C.check_triton_lowering(lambda s, r: fn(s, rows=r), *args)
    pytest.importorskip("triton")
    for rep in C.compile_sm90_report(lambda s, r: fn(s, rows=r), *args):
        assert rep["spill_bytes"] == 0, rep


@pytest.mark.parametrize("ne,m,bt", SHAPES)
def test_layout_sm90_compile_no_spills(ne: int, m: int, bt: int) -> None:
    pytest.importorskip("triton")
    fn = functools.partial(G.row_layout, m=m, n_items=G.n_items(m, ne, bt), n_padded=G.padded_rows(m, ne, bt), bt=bt,
                           implementation="pallas", interpret=False)
    for k in C.compile_sm90_report(fn, jax.ShapeDtypeStruct((ne,), jnp.int32)):
        assert k["spill_bytes"] == 0, k
