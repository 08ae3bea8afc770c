"""The Pallas radix-select top-k kernel (pallas_kernels/topk_select.py) against ``jax.lax.top_k``: every
index and value, in order, with the row kinds of tests/test_radix_select.py (normal, heavy ties, -inf runs,
signed zeros); tau against ``jds.ops.select.kth_largest_key``; both paths of the prefilter (candidate
buffer, and the fall back to the row); the indexer's ``topk_algorithm="pallas_radix"``; argument errors;
and the Triton lowering / sm_90a compile at the real shape (64 x 64K, k = 2048).

Each kernel test runs in ``interpret`` mode (CPU) and ``native`` (marked ``gpu``). Shapes are small and
one call holds rows of every kind, so each case compiles once.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.ops.select import kth_largest_key, ordered_key
from pallas_kernels import fused_insert_common as C
from pallas_kernels.sparse_indexer import IndexerKernelConfig, topk_from_logits
from pallas_kernels.topk_select import (PATHS, TopkSelectConfig, _top_rank, _warp_room, select_unsorted,
                                        topk_select)
from tests.kernel_modes import MODES, interpret_for
from tests.test_radix_select import _rows

KINDS = ("normal", "ties", "neginf", "zeros")
SMALL = TopkSelectConfig(block=256, hist_block=128, sample=256)  # small tiles: several blocks per row


def _mixed(n: int, rng: np.random.Generator, per_kind: int = 2) -> np.ndarray:
    """Rows of every kind, ``per_kind`` of each."""
    return np.concatenate([_rows(kind, per_kind, n, rng) for kind in KINDS])


# the reference tau compiled (one program per shape and k): eagerly, every primitive of the radix select and of the
# key ordering compiled on its own, seconds per case on the CPU; integer keys, so the same result either way
_tau = jax.jit(lambda x, k: kth_largest_key(ordered_key(x), k), static_argnums=1)


def _check(x: np.ndarray, k: int, interpret: bool, config: TopkSelectConfig | None = None,
           paths: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """topk_select == lax.top_k (indices and values, in order) and tau == kth_largest_key; returns the
    kernel's per-row candidate counts (and, with ``paths``, its per-row path codes)."""
    xj = jnp.asarray(x)
    want_v, want_i = jax.lax.top_k(xj, k)
    got_v, got_i = topk_select(xj, k, interpret=interpret, config=config)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i), err_msg=f"n={x.shape[1]} k={k}")
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    assert got_v.dtype == xj.dtype and got_i.dtype == jnp.int32
    idx, tau, cand, path = select_unsorted(xj, k, interpret=interpret, config=config)
    np.testing.assert_array_equal(np.asarray(tau), np.asarray(_tau(xj, k)))
    np.testing.assert_array_equal(np.sort(np.asarray(idx), axis=1), np.asarray(idx))  # column order
    return (np.asarray(cand), np.asarray(path)) if paths else np.asarray(cand)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,k,bits", [(300, 37, 4), (100, 100, 2), (1000, 1, 4), (129, 128, 1)])
def test_direct_matches_lax_top_k(mode: str, n: int, k: int, bits: int) -> None:
    """No prefilter: N not a multiple of the block, k not a multiple of it, k = N, k = 1; digit widths."""
    cfg = TopkSelectConfig(bits=bits, hist_block=128, capacity=0)
    cand = _check(_mixed(n, np.random.default_rng(n + k)), k, interpret_for(mode), cfg)
    assert (cand == n).all()


@pytest.mark.parametrize("mode", MODES)
def test_prefilter_buffer_and_fallback(mode: str) -> None:
    """With the prefilter (N = 3000, k = 50, buffer 400): random rows read the candidate buffer. Rows whose
    pivot is a heavy tie overflow it, and rows where only the sampled columns hold large values leave fewer
    than k candidates: both fall back to the row, with the same result."""
    n, k = 3000, 50
    cfg = TopkSelectConfig(block=256, hist_block=128, sample=256, capacity=400)
    rng = np.random.default_rng(7)
    skewed = rng.standard_normal((2, n)).astype(np.float32)
    skewed[:, (np.arange(256) * n) // 256] += 100.0  # the sampled columns: the pivot lands among them
    x = np.concatenate([_mixed(n, rng), skewed, rng.standard_normal((2, n)).astype(np.float32)])
    cand = _check(x, k, interpret_for(mode), cfg)
    buffered = (cand >= k) & (cand <= 400)
    assert buffered[[0, 1, 8, 9, 10, 11]].tolist() == [True, True, False, False, True, True], cand  # normal + random
    assert (cand[2:4] > 400).all(), cand  # ties: the pivot's value is shared by ~1/6 of the row
    assert (cand[8:10] < k).all(), cand  # skewed sample


@pytest.mark.parametrize("mode", MODES)
def test_short_rows_skip_the_row_passes(mode: str) -> None:
    """Rows with few finite logits and -inf after them (a short request in a decode batch), and an all -inf
    row: the sampled pivot is -inf, and the prefilter keeps only the keys above it. With fewer than k of them, the
    pivot is tau and the row goes straight to the compaction (which stops at k kept keys); with k to capacity,
    finite head first or last, the buffer holds exactly the finite keys. The same rows with a finite tail value
    (-10, a heavy tie): the pivot is that value, shared by more keys than the buffer holds; with fewer than k keys
    above it it is tau; with k to capacity above it, all in the buffer (the head comes first), the buffer serves as
    it is; with the head after the tie (the buffer filled before it), a second pass refills it. Same result as
    lax.top_k every time; rows with a random pivot keep the buffer."""
    n, k, cap = 3000, 50, 400
    cfg = TopkSelectConfig(block=256, hist_block=128, sample=256, capacity=cap)
    rng = np.random.default_rng(13)
    finite = [0, 1, 10, 49, 50, 60, 120, 3000, 60, 120]
    x = rng.standard_normal((len(finite), n)).astype(np.float32)
    x[np.arange(n)[None, :] >= np.array(finite)[:, None]] = -np.inf
    x[8:] = x[8:, ::-1]  # the finite keys last: a fill of keys >= the pivot would hold -inf keys when they come
    x[2, 3] = x[2, 4] = np.float32(0.5)  # a tie among the finite keys
    x[5, 3] = x[5, 40] = np.float32(9.0)  # a tie at the top
    tied = np.where(np.isinf(x), np.float32(-10.0), x)
    cand, path = _check(np.concatenate([x, tied]), k, interpret_for(mode), cfg, paths=True)
    names = [PATHS[p] for p in path]
    assert names[:4] == ["pivot is tau"] * 4, (names, cand)
    assert names[4:10] == ["buffer"] * 6, (names, cand)
    np.testing.assert_array_equal(cand[:10], [0, 1, 10, 49, 50, 60, 120, cand[7], 60, 120])  # the finite keys alone
    assert names[10:14] == ["pivot is tau"] * 4, (names, cand)
    assert names[14:17] == ["overflowed buffer"] * 3, (names, cand)
    assert names[17] == "buffer", (names, cand)
    assert names[18:] == ["refilled buffer"] * 2, (names, cand)


@pytest.mark.parametrize("mode", MODES)
# CI time: shrink behind the prefilter runs on the CPU in the split form (test_unroll_same_result); here the row path
@pytest.mark.parametrize("splits,capacity", [pytest.param(1, 400, marks=pytest.mark.slow),
                                             pytest.param(4, 400, marks=pytest.mark.slow), (1, 0)])
def test_shrink_same_result(mode: str, splits: int, capacity: int) -> None:
    """``shrink=True`` (the counting passes move to a one-block scratch row once at most hist_block candidates
    remain): the same result as lax.top_k on every row kind and path (buffer, split buffers, the row, short rows,
    the pivot as tau), k below and above hist_block; and below it with the shrunk block held in registers
    (hold_shrunk)."""
    n = 3000
    cfg = TopkSelectConfig(block=256, hist_block=128, sample=256, capacity=capacity, splits=splits, shrink=True)
    rng = np.random.default_rng(31)
    short = rng.standard_normal((2, n)).astype(np.float32)
    short[np.arange(n)[None, :] >= np.array([10, 60])[:, None]] = -np.inf
    x = np.concatenate([_mixed(n, rng, 1), short, rng.standard_normal((2, n)).astype(np.float32)])
    for k in (50, 300):
        _check(x, k, interpret_for(mode), cfg)
    _check(x, 50, interpret_for(mode), dataclasses.replace(cfg, hold_shrunk=True))


def _nan_rows(n: int, rng: np.random.Generator) -> np.ndarray:
    """Rows with NaNs of both signs: a few, all, more than k, negative ones, in a short row, every other key, and all
    of the lowest one (0xFFFFFFFF, whose key ties with the kernel's padding lanes past n)."""
    x = rng.standard_normal((7, n)).astype(np.float32)
    neg_nan = np.uint32(0xFFC00001).view(np.float32)
    x[0, rng.choice(n, 5, replace=False)] = np.nan
    x[1] = np.nan
    x[2, rng.choice(n, 200, replace=False)] = np.nan
    x[3, rng.choice(n, 30, replace=False)] = neg_nan
    x[4, 20:] = -np.inf
    x[4, 3] = np.nan
    x[5, ::2] = np.nan
    x[6] = np.uint32(0xFFFFFFFF).view(np.float32)
    return x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_nan_total_order(mode: str, implementation: str) -> None:
    """NaN logits are ordered by their bits, as IEEE's total order (and lax.top_k on the CPU) orders them: a NaN
    with the sign bit clear above +inf, one with it set below -inf; equal keys by ascending index. Both
    implementations, the one-kernel path and the indexer's split form, against an independent numpy order of
    the keys' bit patterns (values compared bit for bit)."""
    if implementation == "xla" and mode != "interpret":
        pytest.skip("the XLA implementation has no kernel mode")
    n, k = 3001, 50  # a partial last block: padding lanes
    x = _nan_rows(n, np.random.default_rng(53))
    bits = x.view(np.uint32).astype(np.int64)
    key = np.where(bits >> 31 == 1, 0xFFFFFFFF - bits, bits | (1 << 31))  # the float order of the bit patterns
    want = np.argsort(-key, axis=1, kind="stable")[:, :k]
    base = TopkSelectConfig(block=256, hist_block=128, sample=256, capacity=1200, unroll=2, shrink=True,
                            hold_shrunk=True, range_margin=1, prefetch=True)
    configs = [dataclasses.replace(base, splits=4, split_finish=True, bucket_blocks=2, bucket_resolutions=3)]
    configs += [base, dataclasses.replace(configs[0], fill_layout="warp", fill_warps=2)] \
        if implementation == "pallas" else []
    for cfg in configs:
        kw = dict(config=cfg, interpret=interpret_for(mode)) if implementation == "pallas" else {}
        vals, idx = topk_select(jnp.asarray(x), k, implementation=implementation, **kw)
        np.testing.assert_array_equal(np.asarray(idx), want, err_msg=str(cfg))
        np.testing.assert_array_equal(np.asarray(vals).view(np.uint32), np.take_along_axis(x, want, 1).view(np.uint32))


@pytest.mark.parametrize("mode", MODES)
def test_exit_at_one_same_result(mode: str) -> None:
    """``exit_at_one`` (the counting from the pivot ends once the k-th key's digit holds one key, tau then that
    key's u by a masked max): the same indices, tau, candidates and paths as counting to the last bit, in the
    one-kernel path (buffer, and the row from the whole key space: every key one value), the split path's
    one-program finish (its shrunk block held, or read from the scratch row) and the split finish (its bucket
    loaded a pass, held whole, its first block held), k = 50 and 300; rows of every kind, ties at tau, k-th keys
    far above the sample, NaN rows (one of the lowest NaN throughout, tied with the padding lanes)."""
    n = 3000
    rng = np.random.default_rng(59)
    far = rng.standard_normal((1, n)).astype(np.float32)
    far[0, rng.choice(n, 60, replace=False)] += np.float32(1e30)
    tied = np.round(rng.standard_normal((1, n)) * 4).astype(np.float32) / 4
    x = jnp.asarray(np.concatenate([_mixed(n, rng, 1), far, tied, _nan_rows(n, rng)]))
    one = TopkSelectConfig(block=256, hist_block=128, sample=256, capacity=1200, unroll=2, shrink=True,
                           hold_shrunk=True, range_margin=1, prefetch=True)
    split = dataclasses.replace(one, splits=4)
    finish = dataclasses.replace(split, split_finish=True, bucket_blocks=2, bucket_resolutions=3)
    for base, k in ((one, 50), (split, 50), (dataclasses.replace(split, hold_shrunk=False), 300), (finish, 50),
                    (finish, 300),
                    (dataclasses.replace(finish, hold_bucket=True), 300),
                    (dataclasses.replace(finish, hold_bucket_head=True), 300)):
        want = select_unsorted(x, k, config=base, interpret=interpret_for(mode))
        got = select_unsorted(x, k, config=dataclasses.replace(base, exit_at_one=True), interpret=interpret_for(mode))
        for name, g, w in zip(("indices", "tau", "candidates", "paths"), got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name} {base} k={k}")
    with pytest.raises(ValueError, match="exit_at_one needs range_margin"):
        TopkSelectConfig(exit_at_one=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits,capacity,unroll,shrink", [
    (4, 400, 2, True),  # the indexer's form; 3 prefilter blocks per split: the second step's last block is the next's
    pytest.param(1, 400, 4, True, marks=pytest.mark.slow),  # CI time: the one-kernel path's loops are the same code
    (1, 0, 8, False)])  # the row path
def test_unroll_same_result(mode: str, splits: int, capacity: int, unroll: int, shrink: bool) -> None:
    """``unroll`` (each loop step loads that many blocks before using any; blocks past a source's end masked out):
    the same result, candidates and paths as ``unroll=1`` and as lax.top_k, on every row kind and path, with block
    counts that are no multiple of the unroll. With shrink the shrunk block is held in registers
    (``hold_shrunk``). And with ``prefetch`` (the next step's blocks loaded during this one's work), also with the
    prefilter's blocks as column groups."""
    n, k = 3000, 50
    base = TopkSelectConfig(block=256, hist_block=128, sample=256, capacity=capacity, splits=splits, shrink=shrink)
    rng = np.random.default_rng(37)
    finite = [10, 60, 120, 120]
    short = rng.standard_normal((len(finite), n)).astype(np.float32)
    short[np.arange(n)[None, :] >= np.array(finite)[:, None]] = -np.inf
    short[3] = short[3, ::-1]  # the finite keys last: the refilled buffer
    x = np.concatenate([_mixed(n, rng, 1), short])
    want = _check(x, k, interpret_for(mode), base, paths=True)
    got = _check(x, k, interpret_for(mode), dataclasses.replace(base, unroll=unroll, hold_shrunk=shrink), paths=True)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    # the next step's loads in flight (prefetch): the same candidates and paths
    got = _check(x, k, interpret_for(mode), dataclasses.replace(base, unroll=unroll, prefetch=True), paths=True)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    # ... with the prefilter's blocks as column groups (fill_layout="group": its slots from a two-level prefix)
    got = _check(x, k, interpret_for(mode), dataclasses.replace(base, unroll=unroll, prefetch=True,
                                                                fill_layout="group"), paths=True)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    if splits > 1:  # ... with each warp streaming its own part of the split (fill_layout="warp")
        got = _check(x, k, interpret_for(mode), dataclasses.replace(base, unroll=unroll, prefetch=True,
                                                                    fill_layout="warp", fill_warps=2), paths=True)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="fill_layout"):
        TopkSelectConfig(fill_layout="rows")
    with pytest.raises(ValueError, match="splits > 1"):
        TopkSelectConfig(fill_layout="warp")
    with pytest.raises(ValueError, match="block >= 128 x the prefilter's 8 warps"):
        TopkSelectConfig(fill_layout="warp", splits=2, block=512)
    with pytest.raises(ValueError, match="unroll"):
        TopkSelectConfig(unroll=3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits", [1, pytest.param(4, marks=pytest.mark.slow)])  # CI time: the pivot is the same code
def test_coarse_pivot_same_result(mode: str, splits: int) -> None:
    """``pivot_bits=12``: the sample's pivot resolved to its 12 leading bits (3 of the 8 counting passes), then the
    smallest sampled key at or above its bucket's floor: the same result as lax.top_k on every row kind, from at
    least as many candidates per row as the exact pivot keeps. Short rows (a finite head, -inf after) take the
    exact pivot's paths ("pivot is tau", "overflowed buffer"), not the whole row: with the bucket's floor as the
    pivot (below -inf) they read the row, and the H200's mixed decode batches took 2-3.5x a full batch's time."""
    n, k, cap = 3000, 50, 400
    exact = TopkSelectConfig(block=256, hist_block=128, sample=256, capacity=cap, splits=splits)
    rng = np.random.default_rng(29)
    short = rng.standard_normal((3, n)).astype(np.float32)
    short[np.arange(n)[None, :] >= np.array([10, 60, 0])[:, None]] = -np.inf
    x = np.concatenate([_mixed(n, rng, 1), short, rng.standard_normal((2, n)).astype(np.float32) * 1e-3 + 1.0])
    coarse, coarse_path = _check(x, k, interpret_for(mode), dataclasses.replace(exact, pivot_bits=12), paths=True)
    want, want_path = _check(x, k, interpret_for(mode), exact, paths=True)
    assert (coarse >= want).all()
    short_rows = slice(len(KINDS), len(KINDS) + 3)
    assert [PATHS[p] for p in coarse_path[short_rows]] == ["pivot is tau", "buffer", "pivot is tau"]
    np.testing.assert_array_equal(coarse_path[short_rows], want_path[short_rows])
    with pytest.raises(ValueError, match="pivot_bits"):
        TopkSelectConfig(pivot_bits=6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits,margin,fast", [
    (4, 1, True),  # the indexer's form (unroll 2, shrink, held block)
    (1, 0, False),  # one kernel per row
    pytest.param(4, 2, False, marks=pytest.mark.slow), pytest.param(1, 3, True, marks=pytest.mark.slow)])
def test_range_start_same_result(mode: str, splits: int, margin: int, fast: bool) -> None:
    """``range_margin`` (the counting passes over the candidate buffers start from the pivot, their first digits
    a fraction of the span up to the sample's largest key): lax.top_k's result, the same candidates and the same
    path on every row kind and path as the whole-key-space start; k below and above hist_block (shrunk or not);
    rows whose k-th key lies above the sample's largest (it falls in the clamped top digit: 60 keys of 100 off the
    sample's columns); rows whose k-th key equals the pivot (ties), short rows."""
    n = 3000
    base = TopkSelectConfig(block=256, hist_block=128, sample=256, capacity=1200, splits=splits)
    if fast:
        base = dataclasses.replace(base, unroll=2, shrink=True, hold_shrunk=True)
    rng = np.random.default_rng(41 + margin)
    above = rng.standard_normal((2, n)).astype(np.float32)
    off = np.setdiff1d(np.arange(n), (np.arange(256) * n) // 256)
    above[0, rng.choice(off, 60, replace=False)] += np.float32(100.0)
    above[1, rng.choice(off, 60, replace=False)] = np.float32(1e30)  # the top digit's bucket reaches 2^32
    short = rng.standard_normal((2, n)).astype(np.float32)
    short[np.arange(n)[None, :] >= np.array([10, 120])[:, None]] = -np.inf
    x = np.concatenate([_mixed(n, rng, 1), above, short, rng.standard_normal((2, n)).astype(np.float32) * 1e-3 + 1.0])
    for k in (50, 300):
        want = _check(x, k, interpret_for(mode), base, paths=True)
        got = _check(x, k, interpret_for(mode), dataclasses.replace(base, range_margin=margin), paths=True)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert [PATHS[p] for p in got[1][len(KINDS):len(KINDS) + 2]] == ["buffer", "buffer"], got
    with pytest.raises(ValueError, match="range_margin"):
        TopkSelectConfig(range_margin=-1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits,unroll", [(4, 1), (4, 2), pytest.param(2, 1, marks=pytest.mark.slow),
                                         pytest.param(1, 2, marks=pytest.mark.slow)])
def test_packed_counts_same_result(mode: str, bits: int, unroll: int) -> None:
    """``packed_counts`` (a source's keys counted per digit value in packed 4-bit fields, flushed before one can
    overflow): lax.top_k's result, the same tau, candidates and paths as the plain counts. The row path with
    32-key blocks (94 a row: several flushes, the last group short; a row of one repeated value puts 15 keys a
    lane in one field), and the indexer's form (split buffers, the range start, the shrunk block held; a 1024-key
    sample, counted as four 256-key blocks), with the split finish (whose fill kernel counts its buffer's first pass
    too): the same pivots, so the same candidates."""
    n = 3000
    rng = np.random.default_rng(53 + bits)
    same = np.full((1, n), 0.5, np.float32)  # every key the same digit in every pass
    x = np.concatenate([_mixed(n, rng, 1), same, rng.standard_normal((2, n)).astype(np.float32)])
    row = TopkSelectConfig(bits=bits, hist_block=32, capacity=0, unroll=unroll)
    split = TopkSelectConfig(bits=bits, block=256, hist_block=128, sample=1024, capacity=1200, splits=4, unroll=unroll,
                             shrink=True, hold_shrunk=True, range_margin=1)
    for base, k in ((row, 37), (split, 50), (split, 300), (dataclasses.replace(split, split_finish=True), 50)):
        want = _check(x, k, interpret_for(mode), base, paths=True)
        got = _check(x, k, interpret_for(mode), dataclasses.replace(base, packed_counts=True), paths=True)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="fill_warps"):
        TopkSelectConfig(fill_warps=12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits,unroll,finish", [
    pytest.param(4, 2, {}, id="4-2-b1r2"),
    pytest.param(4, 1, dict(bucket_blocks=2, bucket_resolutions=3), id="4-1-b2r3"),  # the indexer's form
    pytest.param(4, 2, dict(bucket_blocks=2, bucket_resolutions=3, hold_bucket=True), id="4-2-b2r3-hold"),
    # ... its first block held, the second loaded a pass where the bucket has one
    pytest.param(4, 1, dict(bucket_blocks=2, bucket_resolutions=3, hold_bucket_head=True), id="4-1-b2r3-head"),
    pytest.param(4, 2, dict(bucket_blocks=2, bucket_resolutions=3, hold_bucket=True, fuse_bucket=True),
                 id="4-2-b2r3-hold-fuse"),  # no bucket kernel
    pytest.param(4, 1, dict(fuse_bucket=True), id="4-1-b1r2-fuse"),
    pytest.param(4, 2, dict(fill_layout="group"), id="4-2-b1r2-group"),  # the prefilter's blocks as column groups
    pytest.param(2, 1, {}, id="2-1-b1r2", marks=pytest.mark.slow),
    pytest.param(2, 2, dict(bucket_blocks=4, bucket_resolutions=1), id="2-2-b4r1", marks=pytest.mark.slow)])
def test_split_finish_same_result(mode: str, splits: int, unroll: int, finish: dict) -> None:
    """``split_finish`` (the finish as a bucket copy and a per-split compaction where the k-th key's first-pass
    bucket fits the scratch; the one-program finish elsewhere): lax.top_k's result in column order, the same
    candidates and paths as the one-program finish, on every row kind, short rows (pivot is tau), heavy ties at the
    pivot (overflowed buffers), k-th keys far above the sample's largest, ties at tau across splits; k = 50 (most
    buckets fit the 128-key block) and k = 300 (many do not); with a bucket of several blocks (counted block by
    block, held whole in registers: ``hold_bucket``, or its first block held: ``hold_bucket_head``) and one or three
    first-pass resolutions; with each finish program copying the bucket itself (``fuse_bucket``)."""
    n = 3000
    base = TopkSelectConfig(block=256, hist_block=128, sample=256, capacity=1200, splits=splits, unroll=unroll,
                            shrink=True, hold_shrunk=True, range_margin=1)
    rng = np.random.default_rng(43)
    off = np.setdiff1d(np.arange(n), (np.arange(256) * n) // 256)
    above = rng.standard_normal((2, n)).astype(np.float32)
    above[0, rng.choice(off, 60, replace=False)] += np.float32(100.0)
    above[1, rng.choice(off, 60, replace=False)] = np.float32(1e30)
    short = rng.standard_normal((2, n)).astype(np.float32)
    short[np.arange(n)[None, :] >= np.array([10, 120])[:, None]] = -np.inf
    tied = np.round(rng.standard_normal((2, n)) * 4).astype(np.float32) / 4  # ties at tau, spread over the splits
    tail = np.where(np.isinf(short), np.float32(-10.0), short)
    x = np.concatenate([_mixed(n, rng, 1), above, short, tied, tail, rng.standard_normal((2, n)).astype(np.float32)])
    for k in (50, 300):
        want = _check(x, k, interpret_for(mode), base, paths=True)
        got = _check(x, k, interpret_for(mode), dataclasses.replace(base, split_finish=True, **finish), paths=True)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="split_finish"):
        TopkSelectConfig(split_finish=True)
    with pytest.raises(ValueError, match="hold_bucket needs split_finish"):
        TopkSelectConfig(hold_bucket=True)
    with pytest.raises(ValueError, match="hold_bucket_head needs split_finish"):
        TopkSelectConfig(hold_bucket_head=True)
    with pytest.raises(ValueError, match="one of them"):
        TopkSelectConfig(range_margin=1, split_finish=True, hold_bucket=True, hold_bucket_head=True)
    with pytest.raises(ValueError, match="fuse_bucket needs split_finish"):
        TopkSelectConfig(fuse_bucket=True)
    with pytest.raises(ValueError, match="bucket_resolutions=3 needs range_margin >= 1"):
        TopkSelectConfig(range_margin=0, split_finish=True, bucket_resolutions=3)
    with pytest.raises(ValueError, match="bucket_blocks"):
        TopkSelectConfig(bucket_blocks=3)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_split_finish_random_configs(mode: str) -> None:
    """Random configs of the split path with the range start, the split finish and prefetch (splits, margins,
    blocks, unroll, capacity, pivot bits, packed counts, the prefilter's warps) on random rows of every kind, with
    far keys off the sample: the same kept set as lax.top_k. (An unseeded form of this ran 179 configs in interpret
    mode, thirty-fourth session.)"""
    rng = np.random.default_rng(47)
    for _ in range(8):
        n = int(rng.integers(1200, 5000))
        k = int(rng.integers(1, n // 8))
        cfg = TopkSelectConfig(block=128, hist_block=int(rng.choice([64, 128])), sample=256,
                               capacity=int(rng.integers(4 * k, n - 1)), splits=int(rng.choice([2, 4, 8])),
                               unroll=int(rng.choice([1, 2])), shrink=True, hold_shrunk=bool(rng.integers(2)),
                               range_margin=int(rng.integers(0, 4)), split_finish=True, prefetch=bool(rng.integers(2)),
                               pivot_bits=int(rng.choice([12, 16, 32])), packed_counts=bool(rng.integers(2)),
                               bucket_blocks=int(rng.choice([1, 2, 4])))
        cfg = dataclasses.replace(cfg, bucket_resolutions=int(rng.integers(1, min(cfg.range_margin + 2, 3) + 1)))
        x = np.concatenate([_rows(kind, 1, n, rng) for kind in rng.choice(KINDS, 4)])
        x[0, rng.choice(n, 20)] += np.float32(1e6)
        cfg = dataclasses.replace(cfg, fill_warps=[None, 16][int(rng.integers(2))])  # the prefilter's own warps
        # the prefilter's register layout ("lane" and the finish's lane loads act natively only; "group" changes the
        # blocks' shape and prefix everywhere), the bucket held and the bucket kernel fused
        layout = str(rng.choice(["vector", "lane", "group", "warp"]))
        # "warp": a 128-key chunk a warp a block, so as many warps as the 128-key blocks allow
        hold = int(rng.integers(3))  # the bucket: loaded a pass, held whole, its first block held
        cfg = dataclasses.replace(cfg, fill_layout=layout, finish_lane_loads=bool(rng.integers(2)),
                                  hold_bucket=hold == 1, hold_bucket_head=hold == 2, fuse_bucket=bool(rng.integers(2)),
                                  exit_at_one=bool(rng.integers(2)),
                                  **(dict(fill_warps=1, copy_unroll=int(rng.choice([1, 2, 4])),
                                          copy_spread=bool(rng.integers(2)))
                                     if layout == "warp" else {}))
        xj = jnp.asarray(x)
        idx = select_unsorted(xj, k, config=cfg, interpret=interpret_for(mode))[0]
        np.testing.assert_array_equal(np.asarray(idx), np.sort(np.asarray(jax.lax.top_k(xj, k)[1]), axis=1),
                                      err_msg=str(cfg))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tiles", [
    pytest.param(dict(split_finish=True, bucket_blocks=2, bucket_resolutions=3), id="sf"),  # the indexer's form
    pytest.param(dict(prefetch=False, unroll=1), id="plain", marks=pytest.mark.slow),
    pytest.param(dict(fill_warps=4, split_finish=True), id="w4", marks=pytest.mark.slow)])
def test_warp_fill_same_result(mode: str, tiles: dict) -> None:
    """``fill_layout="warp"`` (each warp streams its own part of the split into its own scratch, the first capacity
    keys then copied to the split's buffer): the same columns, tau, candidates and paths as the CTA-wide prefilter,
    and lax.top_k's set, on random rows, rows whose keys above the pivot crowd into one warp's part (more than its
    room: that program's pass runs again the CTA-wide way), short rows and ties."""
    n, k = 4096, 20
    base = dataclasses.replace(TopkSelectConfig(block=512, hist_block=128, sample=256, capacity=100, splits=2,
                                                unroll=2, shrink=True, hold_shrunk=True, range_margin=1,
                                                prefetch=True, fill_warps=2), **tiles)
    rng = np.random.default_rng(61)
    x = rng.standard_normal((6, n)).astype(np.float32)
    x[1] -= 10  # 200 keys at 20 in warp 0's part of split 0 (columns 0-1023), past its room of 50 (a sampled pivot
    x[1, 100:300] = 20.0  # of 20: more than the capacity reach it), 28 unsampled ones at 21 among them: their buffer
    x[1, [c for c in range(101, 131) if c % 16]] = 21.0  # serves as the refilled pass leaves it ("overflowed buffer")
    x[2] -= 10
    x[2, 3000:3040] += 20  # 40: within the room of warp 1 of split 1
    x[3, 700:] = -np.inf
    x[4] = np.round(x[4] * 2) / 2  # ties
    x[5, :2048] -= 5  # the large keys in the second split
    xj = jnp.asarray(x)
    want = select_unsorted(xj, k, config=base, interpret=interpret_for(mode))
    got = select_unsorted(xj, k, config=dataclasses.replace(base, fill_layout="warp"), interpret=interpret_for(mode))
    for name, g, w in zip(("columns", "tau", "candidates", "path"), got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    np.testing.assert_array_equal(np.asarray(got[0]), np.sort(np.asarray(jax.lax.top_k(xj, k)[1]), axis=1))
    assert PATHS[int(got[3][1])] == "overflowed buffer", [PATHS[p] for p in np.asarray(got[3])]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tiles", [
    pytest.param(dict(fill_layout="warp", copy_spread=True), id="warp"),  # the indexer's form
    pytest.param(dict(fill_layout="warp", copy_spread=True, bucket_blocks=8), id="warp_b8"),  # every bucket fits
    # the splits cut the head by a chunk a warp (256 columns here), not by blocks
    pytest.param(dict(fill_layout="warp", copy_spread=True, fine_splits=True, zero_band=3), id="warp_fine"),
    # ... with a full row's first loads issued before the row's length arrives (a short row loads again)
    pytest.param(dict(fill_layout="warp", copy_spread=True, fine_splits=True, zero_band=3, speculate_full=True),
                 id="warp_fine_spec"),
    pytest.param(dict(fill_layout="vector"), id="vector"),
    pytest.param(dict(fill_layout="vector", speculate_full=True), id="vector_spec")])
def test_lengths_hint_same_result(mode: str, tiles: dict) -> None:
    """``lengths`` (rows -inf from lengths[t] on): lax.top_k's set and tau as without the hint, for rows shorter
    than k, at k, shorter than the sample, a block, across the splits, the whole row and past it (read as the row's
    end), and ties; short rows' samples from their heads (fewer candidates); then a row whose columns past its extent
    (max(lengths, k, sample), a whole number of blocks) hold large finite keys: with the hint the split prefilter
    never reads them (the promise broken on purpose), so the result is the top k of the row's first 1024 columns."""
    n, k = 4096, 20
    cfg = dataclasses.replace(TopkSelectConfig(block=512, hist_block=128, sample=256, capacity=400, splits=2,
                                               unroll=2, shrink=True, hold_shrunk=True, range_margin=1, prefetch=True,
                                               fill_warps=2, split_finish=True, bucket_blocks=2,
                                               bucket_resolutions=3), **tiles)
    lens = np.array([0, 5, 20, 100, 700, 1500, 3000, 4096, 9999, 2500])
    rng = np.random.default_rng(71)
    x = rng.standard_normal((len(lens), n)).astype(np.float32)
    x[-1] = np.round(x[-1] * 2) / 2  # ties
    x[np.arange(n)[None, :] >= lens[:, None]] = -np.inf
    xj, lj = jnp.asarray(x), jnp.asarray(lens, jnp.int32)
    want = select_unsorted(xj, k, config=cfg, interpret=interpret_for(mode))
    got = select_unsorted(xj, k, config=cfg, interpret=interpret_for(mode), lengths=lj)
    np.testing.assert_array_equal(np.asarray(got[0]), np.sort(np.asarray(jax.lax.top_k(xj, k)[1]), axis=1))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]), err_msg="tau")
    # with the hint a short row's sample is drawn from its head, not mostly from its -inf tail: a pivot nearer tau
    cand, cand0 = np.asarray(got[2]), np.asarray(want[2])
    assert (cand[3:7] < cand0[3:7]).all() and (cand[7:9] == cand0[7:9]).all(), (cand, cand0)
    vals, idx = topk_select(xj, k, config=cfg, interpret=interpret_for(mode), lengths=lj)
    ref = jax.lax.top_k(xj, k)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref[1]))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref[0]))
    y = rng.standard_normal((2, n)).astype(np.float32)
    y[:, 1024:] = 100.0  # past the extent of lengths 1000 (1024 columns: 2 blocks, one a split)
    got = select_unsorted(jnp.asarray(y), k, config=cfg, interpret=interpret_for(mode),
                          lengths=jnp.asarray([1000, n], jnp.int32))
    head = np.where(np.arange(n) < 1024, y[0], -np.inf)
    np.testing.assert_array_equal(np.asarray(got[0][0]), np.sort(np.argsort(-head, kind="stable")[:k]))
    assert PATHS[int(got[3][0])] == "buffer", PATHS[int(got[3][0])]
    np.testing.assert_array_equal(np.asarray(got[0][1]), np.arange(1024, 1024 + k))  # the hint: the whole row
    with pytest.raises(ValueError, match="lengths"):
        select_unsorted(xj, k, config=cfg, lengths=lj[:3])
    with pytest.raises(ValueError, match="lengths"):
        topk_select(xj, k, config=cfg, lengths=lj.astype(jnp.float32))


# the split finish's form of test_lengths_hint_same_result (k = 20 over 4096 keys: two splits, a 256-key sample)
_SHORT_ROWS = TopkSelectConfig(block=512, hist_block=128, sample=256, capacity=400, splits=2, unroll=2, shrink=True,
                               hold_shrunk=True, range_margin=1, prefetch=True, fill_layout="warp", copy_spread=True,
                               fill_warps=2, split_finish=True, bucket_blocks=2, bucket_resolutions=3, pivot_bits=16)


def _knob_keeps_the_result(x: np.ndarray, lens: np.ndarray, k: int, base: TopkSelectConfig, knob: dict, hint: bool,
                           mode: str, same: tuple[str, ...]) -> None:
    """Rows ``x`` -inf from ``lens`` on: with ``knob`` over ``base``, lax.top_k's set, and the outputs named in
    ``same`` ("tau", "candidates") equal to ``base``'s; the lengths as the hint where ``hint``."""
    x = np.where(np.arange(x.shape[1])[None, :] >= lens[:, None], -np.inf, x).astype(np.float32)
    xj = jnp.asarray(x)
    lj = jnp.asarray(lens, jnp.int32) if hint else None
    want = select_unsorted(xj, k, config=base, interpret=interpret_for(mode), lengths=lj)
    got = select_unsorted(xj, k, config=dataclasses.replace(base, **knob), interpret=interpret_for(mode), lengths=lj)
    np.testing.assert_array_equal(np.asarray(got[0]), np.sort(np.asarray(jax.lax.top_k(xj, k)[1]), axis=1))
    for name in same:
        at = ("tau", "candidates").index(name) + 1
        np.testing.assert_array_equal(np.asarray(got[at]), np.asarray(want[at]), err_msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_fine_splits_refill(mode: str) -> None:
    """``fine_splits`` with the hint where a warp's part holds more candidates than its scratch room: the CTA-wide
    refill of the split (``_warp_fill``'s ``_fill`` over the split's 256-column units) gives lax.top_k's set. Rows
    ascending over their heads put their top keys in the last warp's part."""
    n, k = 4096, 20
    cfg = dataclasses.replace(_SHORT_ROWS, capacity=100, fine_splits=True)
    lens = np.array([700, 900, 1300, 4096])
    x = np.tile(np.linspace(-1.0, 1.0, n, dtype=np.float32), (len(lens), 1))
    x[:, :1300] = np.linspace(-1.0, 1.0, 1300, dtype=np.float32)[None, :]
    x[np.arange(n)[None, :] >= lens[:, None]] = -np.inf
    xj = jnp.asarray(x)
    got = select_unsorted(xj, k, config=cfg, interpret=interpret_for(mode), lengths=jnp.asarray(lens, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got[0]), np.sort(np.asarray(jax.lax.top_k(xj, k)[1]), axis=1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hint", [pytest.param(True, id="hint"), pytest.param(False, id="no_hint")])
def test_range_top_same_result(mode: str, hint: bool) -> None:
    """``range_top_sigma`` (the counting range's top at a sampled key's rank where the range crosses the sign):
    lax.top_k's set and the same tau as the sample's largest key as the top, for rows whose tau lies among their
    bulk (finite lengths from k to a few k: a negative pivot under a positive largest key), shorter than k, full,
    with ties at tau, and with all keys negative or all positive (no crossing)."""
    n, k = 4096, 20
    lens = np.array([5, 20, 22, 26, 30, 40, 60, 4096, 28, 30, 30])
    rng = np.random.default_rng(73)
    x = rng.standard_normal((len(lens), n)).astype(np.float32)
    x[-3] = np.round(x[-3] * 2) / 2  # ties at tau
    x[-2] = -np.abs(x[-2]) - 1  # every key negative
    x[-1] = np.abs(x[-1]) + 1  # every key positive
    # the top sets the counting, not the pivot: the same candidates
    _knob_keeps_the_result(x, lens, k, _SHORT_ROWS, dict(range_top_sigma=6.0), hint, mode, ("tau", "candidates"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("binades,top", [pytest.param(3, None, id="indexer"), pytest.param(8, 6.0, id="b8_top")])
@pytest.mark.parametrize("hint", [pytest.param(True, id="hint"), pytest.param(False, id="no_hint")])
def test_zero_band_same_result(mode: str, binades: int, top: float | None, hint: bool) -> None:
    """``zero_band`` (the split finish's first pass counting the keys near zero as one value where the range
    crosses the sign): lax.top_k's set and the same tau as without it, for rows whose tau lies near zero (about 2 k
    finite keys), in it (many keys at +-0 and tiny magnitudes), at other scales, with ties, and full rows; the
    indexer's band (3 binades, the sample's largest key as the range's top) and 8 binades under the range top."""
    n, k = 4096, 20
    lens = np.array([36, 40, 44, 48, 40, 40, 40, 4096, 60])
    rng = np.random.default_rng(79)
    x = rng.standard_normal((len(lens), n)).astype(np.float32)
    x[1] *= 1e-3  # another scale
    x[2] *= 300.0  # a band wider than 2 (its u-width overflows int32)
    x[4, :40] = np.round(x[4, :40] * 2) / 2  # ties at tau
    x[5, :40:2] = 0.0  # tau at +0, -0 among the keys
    x[5, 1:40:4] = -0.0
    x[6, :40] *= np.float32(2.0) ** rng.integers(-40, 1, 40)  # tiny magnitudes: many keys inside the band
    _knob_keeps_the_result(x, lens, k, dataclasses.replace(_SHORT_ROWS, range_top_sigma=top), dict(zero_band=binades),
                           hint, mode, ("tau",))


@pytest.mark.parametrize("binades", [3, 8])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e3, 1e5])  # 1e5: the band past 2, its width past int32
def test_zero_band_bucket_is_the_digits_preimage(scale: float, binades: int) -> None:
    """The zero band's first pass (``_band_digit``) and its buckets as u ranges (``_band_bucket``): for pivots
    across the sign, every margin and digit, a key lies in digit d's range exactly when its digit is d; the digits
    never decrease with the key; keys within the band share one digit; without a crossing the band is empty."""
    from pallas_kernels.topk_select import _band_bucket, _band_digit, _band_start, _in_range, _zero_band
    rng = np.random.default_rng(83)
    keys = np.sort(np.r_[rng.standard_normal(3000), rng.standard_normal(200) * 1e-6, 0.0, -0.0, 1e-30, -1e-30]
                   ).astype(np.float32) * np.float32(scale)
    u = np.asarray(ordered_key(jnp.asarray(keys)))
    s = jnp.asarray((u ^ np.uint32(1 << 31)).view(np.int32))[None, :]  # the kernels' signed form

    def u_of(v: float) -> jax.Array:  # a key's u as the kernels hold it (uint32 bits in int32)
        return jnp.asarray(np.asarray(ordered_key(jnp.float32(v))).view(np.int32))
    for piv_x, hi_x in ((-0.3, 2.9), (-1.7, 0.05), (-0.01, 3.5)):
        piv_u, hi_u = u_of(piv_x * scale), u_of(hi_x * scale)
        band = _zero_band(piv_u, hi_u, binades)
        assert int(band[1]) != 0
        w = float(np.float32(scale) * min(abs(piv_x), hi_x))
        for m in (0, 1, 2):
            span, shift = _band_start(piv_u, hi_u, 4, m, *band)
            dig = np.asarray(_band_digit(s, piv_u, span, shift, *band, 16))[0]
            inside = keys >= np.float32(piv_x * scale)
            assert (dig[~inside] == -1).all() and (dig[inside] >= 0).all()
            assert (np.diff(dig[inside]) >= 0).all()  # keys are sorted: digits never decrease
            near = inside & (np.abs(keys) < w / 2 ** (binades + 1))  # well inside the band
            assert len(set(dig[near])) <= 1
            for d in range(16):
                lo, sp, _ = _band_bucket(piv_u, span, shift, jnp.int32(d), 4, *band)
                np.testing.assert_array_equal(np.asarray(_in_range(s, lo, sp))[0], dig == d, err_msg=f"{m} {d}")
    plain = _zero_band(u_of(0.2), u_of(3.0), binades)
    assert int(plain[0]) == 0 and int(plain[1]) == 0


def test_top_rank_static_equals_traced() -> None:
    """``_top_rank`` for a static n (no hint) and a traced one (the lengths hint) agree, 1 at least."""
    ns = [1024, 2048, 2500, 3000, 4096, 6000, 32768, 65536, 131072]
    traced = jax.jit(lambda n: _top_rank(n, 2048, 1024, 6.0))
    for n in ns:
        assert int(traced(jnp.int32(n))) == _top_rank(n, 2048, 1024, 6.0), n
    assert _top_rank(131072, 2048, 1024, 6.0) == 1 and _top_rank(3000, 2048, 1024, 6.0) > 500


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", [
    pytest.param(dict(copy_unroll=4), id="cu4"),
    pytest.param(dict(copy_spread=True), id="spread"),
    pytest.param(dict(copy_spread=True, copy_unroll=2), id="spread_cu2")])
def test_warp_copy_forms_same_result(mode: str, form: dict) -> None:
    """The warps' scratch copy's forms: ``copy_unroll`` (several chunks a step, their loads first) and
    ``copy_spread`` (the split's buffer filled a warp's 128 slots at a time from whichever warp's scratch holds
    them): the same columns, tau, candidates and paths as one chunk of its own warp a step, and lax.top_k's set,
    where the copy takes several steps: 700 keys at or above the pivot in a row's first warp's part, its top k in
    the last (6 chunks: two steps of 4, the second partly masked; spread over 2 warps, 3 steps), 300 keys crowding
    one warp, a short row (100 finite keys), random rows and ties."""
    n, k = 4096, 20
    base = TopkSelectConfig(block=512, hist_block=128, sample=256, capacity=1600, splits=2, unroll=2, shrink=True,
                            hold_shrunk=True, range_margin=1, prefetch=True, fill_warps=2, split_finish=True,
                            bucket_blocks=2, bucket_resolutions=3, fill_layout="warp")
    assert _warp_room(1600, n, base) == 800
    rng = np.random.default_rng(67)
    x = rng.standard_normal((5, n)).astype(np.float32)
    x[0, :700] = 20.0
    x[0, 680:700] = 30.0 + rng.standard_normal(20).astype(np.float32)  # the top k in the last chunk
    x[1] -= 10
    x[1, 2100:2400] = 20.0 + rng.standard_normal(300).astype(np.float32)  # split 1's first warp
    x[2] = np.round(x[2] * 2) / 2  # ties
    x[3, 100:] = -np.inf
    xj = jnp.asarray(x)
    want = select_unsorted(xj, k, config=base, interpret=interpret_for(mode))
    got = select_unsorted(xj, k, config=dataclasses.replace(base, **form), interpret=interpret_for(mode))
    for name, g, w in zip(("columns", "tau", "candidates", "path"), got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    np.testing.assert_array_equal(np.asarray(got[0]), np.sort(np.asarray(jax.lax.top_k(xj, k)[1]), axis=1))
    assert int(got[2][0]) == 700, got[2]  # the tied keys, all of them candidates (from the first warp's scratch)
    with pytest.raises(ValueError, match="copy_unroll"):
        TopkSelectConfig(copy_unroll=2)  # a form of the warp fill
    with pytest.raises(ValueError, match="copy_unroll"):
        dataclasses.replace(base, copy_unroll=3)
    with pytest.raises(ValueError, match="copy_spread"):
        TopkSelectConfig(copy_spread=True)


@pytest.mark.parametrize("mode", MODES)
def test_split_prefilter_matches_lax_top_k(mode: str) -> None:
    """``splits`` programs per row stream the prefilter (each into its own buffer), a second kernel counts and
    compacts the buffers' union: lax.top_k's result on every row kind, and each path: buffers (random rows),
    the row (a skewed sample; a heavy tie past a full buffer), pivot is tau and the buffers of the finite keys
    alone (short rows: a finite head, -inf after), and with a finite tail value instead (a heavy tie at the
    pivot) pivot is tau and the overflowed buffers."""
    n, k, cap = 3000, 50, 400
    cfg = TopkSelectConfig(block=256, hist_block=128, sample=256, capacity=cap, splits=4)
    rng = np.random.default_rng(17)
    skewed = rng.standard_normal((1, n)).astype(np.float32)
    skewed[:, (np.arange(256) * n) // 256] += 100.0
    short = rng.standard_normal((3, n)).astype(np.float32)
    short[np.arange(n)[None, :] >= np.array([10, 60, 828])[:, None]] = -np.inf
    short[2, 60:768] = -np.inf  # 60 finite keys at the heads of the first two splits (768 columns each)
    tied = np.where(np.isinf(short), np.float32(-10.0), short)
    x = np.concatenate([_mixed(n, rng, 1), skewed, short, tied, rng.standard_normal((1, n)).astype(np.float32)])
    cand, path = _check(x, k, interpret_for(mode), cfg, paths=True)
    names = [PATHS[p] for p in path]
    assert names[0] == "buffer" and names[-1] == "buffer", (names, cand)  # normal, random
    assert names[4] == "row", (names, cand)  # skewed sample: fewer than k reach the pivot
    assert names[5:8] == ["pivot is tau", "buffer", "buffer"], (names, cand)
    assert names[8:11] == ["pivot is tau", "overflowed buffer", "overflowed buffer"], (names, cand)
    np.testing.assert_array_equal(cand, np.asarray(select_unsorted(jnp.asarray(x), k, interpret=interpret_for(mode),
                                                                   config=dataclasses.replace(cfg, splits=1))[2]))


@pytest.mark.parametrize("mode", MODES)
def test_split_short_rows_whose_splits_each_fit(mode: str) -> None:
    """Splits that each fit their buffer (768 columns, capacity 800) while the row's keys at the pivot do not fit
    one (the H200's 16 x 32K mixed batch: 4 splits of 8K keys, capacity 8K): a short row's -inf pivot is tau (fewer
    than k finite keys) or its finite keys alone fill and serve from the split buffers, never the whole row; with a
    finite tail value instead (a heavy tie at the pivot), the pivot is tau or the overflowed buffers serve."""
    n, k, cap = 3000, 50, 800
    cfg = TopkSelectConfig(block=256, hist_block=128, sample=256, capacity=cap, splits=4)
    rng = np.random.default_rng(19)
    x = rng.standard_normal((5, n)).astype(np.float32)
    x[np.arange(n)[None, :] >= np.array([10, 60, 828, 0, n])[:, None]] = -np.inf
    x[2, 60:768] = -np.inf  # 60 finite keys at the heads of the first two splits
    x[1, 7] = x[1, 30] = np.float32(9.0)  # a tie among the kept keys
    tied = np.where(np.isinf(x), np.float32(-10.0), x)
    cand, path = _check(np.concatenate([x, tied]), k, interpret_for(mode), cfg, paths=True)
    names = [PATHS[p] for p in path]
    assert names[:5] == ["pivot is tau", "buffer", "buffer", "pivot is tau", "buffer"], (names, cand)
    np.testing.assert_array_equal(cand[:4], [10, 60, 120, 0])  # the finite keys alone
    assert names[5:] == ["pivot is tau", "overflowed buffer", "overflowed buffer", "pivot is tau", "buffer"], (names,
                                                                                                                cand)


def test_split_for() -> None:
    from pallas_kernels.topk_select import select_config_for, split_for
    assert [split_for(t, 131072) for t in (1, 4, 16, 64, 128)] == [16, 16, 8, 2, 1]
    assert split_for(16, 8192) == 1  # too short to split (4 blocks of 2048 per split)
    # the indexer's config: the measured unroll, shrink, 512-key counting steps, 16-bit pivot, the finish from the
    # pivot, the prefilter's loads in flight and its parts a warp each (their copy spread over the CTA, a short
    # request's head cut a chunk a warp at a time) where it splits, the defaults where it does not
    one = TopkSelectConfig(splits=2, unroll=2, shrink=True, hist_block=512, pivot_bits=16, hold_shrunk=True,
                           range_margin=1, prefetch=True, fill_layout="warp", copy_spread=True, fine_splits=True)
    assert select_config_for(64, 65536, split_finish=False) == one  # IndexerKernelConfig.topk_split_finish=False
    # the default: the split finish with a 2-block bucket, three first-pass resolutions and the zero band, its
    # counting ended at one key in the k-th key's digit, the bucket's first block held
    assert select_config_for(64, 65536) == dataclasses.replace(one, split_finish=True, bucket_blocks=2,
                                                               bucket_resolutions=3, zero_band=3,
                                                               hold_bucket_head=True, exit_at_one=True)
    assert select_config_for(128, 65536) == TopkSelectConfig()  # no split, no split finish


@pytest.mark.parametrize("mode", MODES)
def test_default_config_and_bf16(mode: str) -> None:
    """The default config at N = 8k (prefilter on) and bf16 input (values come back in bf16)."""
    rng = np.random.default_rng(11)
    x = _mixed(2048, rng, 1)
    cand = _check(x, 256, interpret_for(mode))
    assert ((cand >= 256) & (cand <= 1024))[0], cand  # the normal row uses the buffer
    _check(x.astype(jnp.bfloat16), 256, interpret_for(mode), SMALL)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [5, 64, 300])
def test_indexer_topk_from_logits_pallas_radix(mode: str, k: int) -> None:
    """The indexer's selection with topk_algorithm="pallas_radix" equals the lax path, -1 padding included
    (rows with fewer than k visible keys; k > N pads with -1)."""
    interpret_for(mode)
    rng = np.random.default_rng(k)
    x = jnp.asarray(_rows("neginf", 6, 200, rng))
    np.testing.assert_array_equal(np.asarray(topk_from_logits(x, k, algorithm="pallas_radix")),
                                  np.asarray(topk_from_logits(x, k)))
    assert IndexerKernelConfig(topk_algorithm="pallas_radix").topk_algorithm == "pallas_radix"


@pytest.mark.parametrize("mode", MODES)
def test_indexer_topk_splits(mode: str) -> None:
    """IndexerKernelConfig.topk_splits reaches the kernel: None picks select_config_for (2 programs per row for 2
    rows of 16K with the default blocks, with unroll and shrink), and the selection equals lax's, with the split
    finish too; a bad value names the field."""
    from pallas_kernels.topk_select import select_config_for
    interpret_for(mode)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 16384)).astype(np.float32)
    x[1, 3000:] = -np.inf  # a short row among them
    assert select_config_for(2, 16384).splits == 2
    want = np.sort(np.asarray(topk_from_logits(jnp.asarray(x), 64)), axis=1)
    for split_finish in (False, True):  # IndexerKernelConfig.topk_split_finish
        np.testing.assert_array_equal(np.asarray(topk_from_logits(jnp.asarray(x), 64, algorithm="pallas_radix",
                                                                  order="set", splits=None,
                                                                  split_finish=split_finish)), want)
    # IndexerKernelConfig.topk_lengths: the rows' visible counts as the kernel's lengths hint, both orders' forms
    lengths = jnp.asarray([16384, 3000], jnp.int32)
    for invisible in (False, True):
        got = topk_from_logits(jnp.asarray(x), 64, algorithm="pallas_radix", order="set", splits=None,
                               invisible_in_kernel=invisible, lengths=lengths)
        np.testing.assert_array_equal(np.sort(np.asarray(got), axis=1), want)
    with pytest.raises(ValueError, match="topk_splits"):
        IndexerKernelConfig(topk_splits=3)


def test_indexer_passes_visible_counts_as_lengths(monkeypatch) -> None:
    """IndexerKernelConfig(topk_lengths=True) hands each token's n_visible to topk_from_logits as ``lengths`` (the
    paged logits are -inf from there on); the default hands none."""
    from pallas_kernels import sparse_indexer as si
    from tests.test_kernel_sparse_indexer import paged_keys, queries
    fmt, cache, bt = paged_keys(64, [100, 30], 2, 3)
    req, nvis = jnp.asarray([0, 1], jnp.int32), jnp.asarray([100, 30], jnp.int32)
    qd, wf = queries(2, 4, 5)
    seen = []
    real = si.topk_from_logits
    monkeypatch.setattr(si, "topk_from_logits", lambda *a, **kw: seen.append(a[8:]) or real(*a, **kw))
    for on in (False, True):
        si.indexer_topk(qd, wf, cache, fmt, bt, req, nvis, 8, interpret=True,
                        config=IndexerKernelConfig(topk_algorithm="lax", topk_lengths=on))
    assert seen[0] == (None,) and np.asarray(seen[1][0]).tolist() == [100, 30], seen
    with pytest.raises(ValueError, match="topk_lengths"):
        IndexerKernelConfig(topk_lengths=1)


@pytest.mark.parametrize("mode", MODES)
def test_invisible_in_kernel(mode: str) -> None:
    """``minus_one_for_neg_inf`` / ``topk_from_logits(invisible_in_kernel=True)``: the kernel's columns with -1 for
    kept -inf keys, on every path (one program per row over the row and its buffer, the split finish with its
    one-program fallback), equal to the default set order's (which marks them after a gather of the values);
    topk_select refuses the option (its values would be gathered at -1)."""
    interpret_for(mode)
    rng = np.random.default_rng(19)
    n, k = 3000, 300
    x = np.concatenate([_mixed(n, rng, 1), rng.standard_normal((4, n)).astype(np.float32)])
    x[-4:-2, 2500:] = -np.inf  # invisible tails beside k or more visible keys
    x[-3, :40] = -np.inf  # and -inf keys among the visible ones
    x[-2, 100:] = -np.inf  # fewer visible keys than k: the pivot is tau, -inf keys kept
    x[-1, rng.choice(n, n - 250, replace=False)] = -np.inf  # the same, scattered
    xj = jnp.asarray(x)
    want = np.asarray(topk_from_logits(xj, k, algorithm="pallas_radix", order="set", splits=1))
    np.testing.assert_array_equal((want == -1).sum(axis=1)[-2:], [k - 100, k - 250])
    base = dataclasses.replace(SMALL, capacity=1200)
    for cfg in (base, dataclasses.replace(base, splits=4, shrink=True, range_margin=1, split_finish=True,
                                          bucket_blocks=2, bucket_resolutions=3)):
        got = select_unsorted(xj, k, config=dataclasses.replace(cfg, minus_one_for_neg_inf=True),
                              interpret=interpret_for(mode))[0]
        np.testing.assert_array_equal(np.sort(np.asarray(got), axis=1), np.sort(want, axis=1), err_msg=str(cfg))
    got = topk_from_logits(xj, k, algorithm="pallas_radix", order="set", splits=1, invisible_in_kernel=True)
    np.testing.assert_array_equal(np.sort(np.asarray(got), axis=1), np.sort(want, axis=1))
    with pytest.raises(ValueError, match="minus_one_for_neg_inf"):
        topk_select(xj, k, config=TopkSelectConfig(minus_one_for_neg_inf=True))


@pytest.mark.parametrize("mode", MODES)
def test_set_order_skips_the_sort(mode: str) -> None:
    """order="set" (no sort of the k winners): per row the same keys as lax.top_k, in ascending key order,
    -1 where lax has -1 (invisible keys), counted per row; the indexer's default is the set (with split_for's splits)."""
    interpret_for(mode)
    rng = np.random.default_rng(17)
    x = jnp.asarray(np.concatenate([_rows("neginf", 4, 600, rng), _rows("ties", 2, 600, rng)]))
    k = 64
    want = np.asarray(topk_from_logits(x, k))
    got = np.asarray(topk_from_logits(x, k, algorithm="pallas_radix", order="set"))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.sort(w[w >= 0]), g[g >= 0])  # same keys, ascending
        assert (w < 0).sum() == (g < 0).sum()
    assert IndexerKernelConfig().topk_order == "set" and IndexerKernelConfig().topk_splits is None
    with pytest.raises(ValueError, match="topk_order"):
        IndexerKernelConfig(topk_order="any")


def test_auto_resolution() -> None:
    """"auto" on the GPU: the row-in-registers select up to AUTO_ROWS_TOPK_COLS columns, the radix select from
    AUTO_PALLAS_TOPK_ELEMS elements, lax between; lax off the GPU and when a two-stage segment is asked for. It is
    the default (resolve_topk_algorithm says why)."""
    from pallas_kernels.sparse_indexer import AUTO_PALLAS_TOPK_ELEMS, AUTO_ROWS_TOPK_COLS, resolve_topk_algorithm

    assert IndexerKernelConfig().topk_algorithm == "auto"
    assert IndexerKernelConfig(topk_algorithm="auto").topk_algorithm == "auto"
    assert resolve_topk_algorithm(16, 32768, "gpu") == "pallas_radix" == resolve_topk_algorithm(64, 32768, "gpu")
    assert resolve_topk_algorithm(16, AUTO_ROWS_TOPK_COLS + 1, "gpu") == "lax"
    assert resolve_topk_algorithm(1, 4160, "gpu") == "pallas_rows" == resolve_topk_algorithm(1024, 16448, "gpu")
    assert resolve_topk_algorithm(64, 131072, "cpu") == "lax" == resolve_topk_algorithm(64, 4160, "cpu")
    assert resolve_topk_algorithm(1, AUTO_PALLAS_TOPK_ELEMS, "gpu") == "pallas_radix"
    x = jnp.asarray(_mixed(300, np.random.default_rng(3)))  # lax off the GPU, the row select on it
    np.testing.assert_array_equal(np.asarray(topk_from_logits(x, 20, algorithm="auto")),
                                  np.asarray(topk_from_logits(x, 20)))
    np.testing.assert_array_equal(np.asarray(topk_from_logits(x, 20, 64, algorithm="auto")),
                                  np.asarray(topk_from_logits(x, 20)))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_auto_at_the_decode_size_matches_lax() -> None:
    """At 16 x 65536 (k = 2048) "auto" runs the Pallas kernel; rows of every kind, -1 padding included."""
    from pallas_kernels.sparse_indexer import resolve_topk_algorithm

    assert resolve_topk_algorithm(16, 65536) == "pallas_radix"
    x = jnp.asarray(_mixed(65536, np.random.default_rng(4), per_kind=4))
    np.testing.assert_array_equal(np.asarray(topk_from_logits(x, 2048, algorithm="auto")),
                                  np.asarray(topk_from_logits(x, 2048, algorithm="lax")))


def test_xla_implementation_is_the_reference() -> None:
    x = jnp.asarray(_mixed(300, np.random.default_rng(2)))
    for got, want in zip(topk_select(x, 20, implementation="xla"), jax.lax.top_k(x, 20)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bad_arguments() -> None:
    x = jnp.zeros((2, 5))
    with pytest.raises(ValueError, match="k must be in"):
        topk_select(x, 6)
    with pytest.raises(ValueError, match="k must be in"):
        topk_select(x, 0, implementation="xla")
    with pytest.raises(ValueError, match="k must be an int"):
        topk_select(x, 2.5)
    with pytest.raises(ValueError, match="x must be float32"):
        topk_select(jnp.zeros((2, 5), jnp.int32), 1)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        topk_select(jnp.zeros((5,)), 1)
    with pytest.raises(ValueError, match="implementation"):
        topk_select(x, 1, implementation="cuda")
    with pytest.raises(ValueError, match="bits"):
        TopkSelectConfig(bits=8)
    with pytest.raises(ValueError, match="hist_block"):
        TopkSelectConfig(hist_block=100)
    with pytest.raises(ValueError, match="range_top_sigma needs range_margin"):
        TopkSelectConfig(range_top_sigma=6.0)
    with pytest.raises(ValueError, match="fine_splits"):
        TopkSelectConfig(splits=2, fine_splits=True)
    with pytest.raises(ValueError, match="zero_band needs split_finish"):
        TopkSelectConfig(range_margin=1, zero_band=8)
    with pytest.raises(ValueError, match="speculate_full"):
        TopkSelectConfig(speculate_full=True)  # one program a row: no split prefilter
    with pytest.raises(ValueError, match="range_top_bits"):
        TopkSelectConfig(range_margin=1, range_top_sigma=6.0, range_top_bits=10)
    with pytest.raises(ValueError, match="topk_algorithm"):
        IndexerKernelConfig(topk_algorithm="pallas")


REAL = [pytest.param(64, 65536, None, id="64x64K"), pytest.param(64, 100000, None, id="64x100000"),
        pytest.param(64, 65536, TopkSelectConfig(capacity=0), id="64x64K_direct"),
        pytest.param(16, 131072, TopkSelectConfig(splits=8), id="16x128K_split8")]


@pytest.mark.parametrize("t,n,config", REAL)
def test_lowers_for_cuda(t: int, n: int, config: TopkSelectConfig | None) -> None:
    """Pallas -> Triton IR for an (abstract) H200 at the indexer's shapes, k = 2048."""
    fn = functools.partial(topk_select, k=2048, interpret=False, config=config)
    assert "__gpu$xla.gpu.triton" in C.check_triton_lowering(fn, jax.ShapeDtypeStruct((t, n), jnp.float32))


@pytest.mark.parametrize("t,n,tiles", [
    (64, 65536, {}),
    # the one-program finish (to the 38th)
    (64, 65536, dict(split_finish=False, zero_band=None, hold_bucket_head=False)),
    (64, 65536, dict(range_margin=None, prefetch=False, split_finish=False, range_top_sigma=None, zero_band=None,
                     hold_bucket_head=False, exit_at_one=False)),
    (32, 32768, dict(lengths=True)),  # the lengths hint: a traced extent, the splits cut by a chunk a warp
    (32, 32768, dict(lengths=True, speculate_full=True)),  # ... a full row's first loads before the length's
    (64, 65536, dict(exit_at_one=True)),  # the counting's exit at one key: a cond in the finish's loop
    (64, 65536, dict(minus_one_for_neg_inf=True)),
    (64, 65536, dict(packed_counts=True, fill_warps=16)),
    (64, 65536, dict(fill_layout="lane", copy_spread=False, fine_splits=False, finish_lane_loads=True,
                     hold_bucket=True, hold_bucket_head=False)),
    (64, 65536, dict(fill_layout="group", copy_spread=False, fine_splits=False, finish_lane_loads=True)),
    (64, 65536, dict(finish_lane_loads=True, hold_bucket=True, hold_bucket_head=False, fuse_bucket=True)),
    pytest.param(64, 65536, dict(copy_unroll=4), marks=pytest.mark.slow),  # the warps' scratch copy, 4 chunks a step
    pytest.param(64, 65536, dict(copy_spread=True), marks=pytest.mark.slow),  # ... spread over the CTA's warps
    pytest.param(64, 65536, dict(fill_layout="warp", fill_warps=16), marks=pytest.mark.slow),  # the 8-warp form:
    # test_warp_fill_loop_has_no_barriers
    # the 8-split finish takes ptxas about 40 s on 2 cores: slow
    pytest.param(16, 131072, {}, marks=pytest.mark.slow),
    pytest.param(16, 131072, dict(split_finish=False, zero_band=None, hold_bucket_head=False, packed_counts=True),
                 marks=pytest.mark.slow)])
def test_sm90_compile_indexer_config(t: int, n: int, tiles: dict) -> None:
    """The indexer's config at its shapes (``select_config_for``: split, unroll 2, shrink, 512-key steps, 16-bit
    pivot, the split finish), earlier configs and the options still to be timed, compiles for sm_90a with at most 64
    bytes of spills (a bound, not zero: with pip triton 3.6 the 512-key finish kernel spills 40 bytes at 128
    registers, with 3.8 none; the H200's timeline, with the plugin's own Triton, measured that form faster than the
    256-key one, whatever it spills there)."""
    pytest.importorskip("triton")
    from pallas_kernels.topk_select import select_config_for
    hint = tiles.pop("lengths", False)
    cfg = dataclasses.replace(select_config_for(t, n), **tiles)
    fn = functools.partial(select_unsorted, k=2048, interpret=False, config=cfg)
    args = [jax.ShapeDtypeStruct((t, n), jnp.float32)]
    if hint:
        fn = lambda x, ln, fn=fn: fn(x, lengths=ln)  # noqa: E731
        args.append(jax.ShapeDtypeStruct((t,), jnp.int32))
    for k in C.compile_sm90_report(fn, *args):
        assert k["spill_bytes"] <= 64, k


def test_lane_loads_share_the_stores_layout() -> None:
    """``fill_layout="lane"`` / ``finish_lane_loads`` at 64 x 64K: pip triton's TTGIR keeps the stores' operands in
    the loads' layout. The prefilter's streaming loop had four conversions a block (pointers twice, values, mask) and
    keeps none (what remains are the scalar and per-digit stores after it); the finish keeps the small vectors'.
    ``fill_layout="group"``: the conversions stay in the TTGIR, between layouts that give each lane the same keys, and
    cost nothing: the prefilter's SASS has as many barriers and shared-memory accesses as the lane form's or fewer."""
    pytest.importorskip("triton")
    from pallas_kernels.topk_select import select_config_for
    conv = {}
    for lane in (False, True):
        cfg = dataclasses.replace(select_config_for(64, 65536), fill_layout="lane" if lane else "vector",
                                  copy_spread=False, fine_splits=False, finish_lane_loads=lane)
        fn = functools.partial(select_unsorted, k=2048, interpret=False, config=cfg)
        conv[lane] = {k["name"]: k["layout_conversions"]
                      for k in C.compile_sm90_report(fn, jax.ShapeDtypeStruct((64, 65536), jnp.float32))}
    assert conv[False]["topk_radix_prefilter"] >= conv[True]["topk_radix_prefilter"] + 8, conv  # 2 blocks a step
    assert conv[True]["topk_radix_finish"] * 2 < conv[False]["topk_radix_finish"], conv
    assert conv[True]["topk_radix_bucket"] < conv[False]["topk_radix_bucket"], conv
    shared = {}
    for layout in ("lane", "group"):
        cfg = dataclasses.replace(select_config_for(64, 65536), fill_layout=layout, copy_spread=False,
                                  fine_splits=False)
        fn = functools.partial(select_unsorted, k=2048, interpret=False, config=cfg)
        sass = next(k["sass"] for k in C.compile_sm90_report(fn, jax.ShapeDtypeStruct((64, 65536), jnp.float32),
                                                              sass=True) if k["name"] == "topk_radix_prefilter")
        shared[layout] = [len(re.findall(rf"\b{op}\b", sass)) for op in ("BAR", "LDS", "STS")]
    assert all(g <= la for g, la in zip(shared["group"], shared["lane"])), shared


def test_warp_fill_loop_has_no_barriers() -> None:
    """``fill_layout="warp"`` at 64 x 64K compiles for sm_90a (spills within the indexer config's bound), and in pip
    triton's SASS its streaming loop (the prefilter's first loop with the scatter stores) has no barrier and no
    shared-memory access: each warp's slots and counts stay in the warp (the other forms wait on barriers several
    times a block: 12 to 32 a 4096-key step)."""
    pytest.importorskip("triton")
    from pallas_kernels.topk_select import select_config_for
    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("triton_sass", root / "scripts/diag/triton_sass.py")
    sass_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass_tool)
    cfg = dataclasses.replace(select_config_for(64, 65536), fill_layout="warp")
    fn = functools.partial(select_unsorted, k=2048, interpret=False, config=cfg)
    kernels = C.compile_sm90_report(fn, jax.ShapeDtypeStruct((64, 65536), jnp.float32), sass=True)
    assert all(k["spill_bytes"] <= 64 for k in kernels), [(k["name"], k["spill_bytes"]) for k in kernels]
    pre = next(k for k in kernels if k["name"] == "topk_radix_prefilter")
    fill = next(lp for lp in sass_tool.loops(pre["sass"])[1] if lp["memory_sync"]["STG"] >= 16)
    assert {op: fill["memory_sync"][op] for op in ("BAR", "LDS", "STS")} == {"BAR": 0, "LDS": 0, "STS": 0}, fill


@pytest.mark.parametrize("t,n,config", REAL)
def test_sm90_compile_no_spills(t: int, n: int, config: TopkSelectConfig | None) -> None:
    """Triton IR -> PTX -> ptxas (sm_90a) with pip triton: no register spills (skipped without triton)."""
    pytest.importorskip("triton")
    fn = functools.partial(topk_select, k=2048, interpret=False, config=config)
    for k in C.compile_sm90_report(fn, jax.ShapeDtypeStruct((t, n), jnp.float32)):
        assert k["spill_bytes"] == 0, k
