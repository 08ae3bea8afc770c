"""Rows and tiles of a grouped (MoE) GEMM kernel that works on (expert, token tile) items: shared by the FP4
and FP8 grouped expert GEMMs (``fp4_grouped_gemm``, ``fp8_grouped_gemm``).

x's rows come grouped by expert (``sizes``); the kernels read token tiles by TMA from a copy of x in which
every group starts on an 8-row boundary (a data-dependent TMA start on an 8-row SMEM tiling must be
tile-aligned), write y^T [N, items * block_t] per item, and the wrapper gathers each row's column back.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jds.ops.dispatch import Implementation, check_int, describe, mosaic_interpret, resolve_interpret, run_op
from pallas_kernels import fused_insert_common as C

NUM_SMS = 132  # H100 / H200; only steers the automatic split_k
BLOCK_TS = (8, 16, 32, 64, 128)  # token tile = wgmma N; 128 fp32 accumulators per thread at most


def check_tiles(block_t, block_n, block_k, split_k, stages, block_ks: tuple[int, ...],
                block_ns: tuple[int, ...] = (64, 128)) -> None:
    """ValueError naming the tile argument that is not one the kernels take (``block_ks`` / ``block_ns``: its
    block_k / block_n values)."""
    if block_t not in (None, *BLOCK_TS):
        raise ValueError(f"block_t must be one of {BLOCK_TS} (or None), got {block_t}")
    if block_n not in (None, *block_ns):
        raise ValueError(f"block_n must be one of {block_ns} (or None), got {block_n}")
    if block_k not in (None, *block_ks):
        raise ValueError(f"block_k must be one of {block_ks} (or None), got {block_k}")
    for name, v in (("split_k", 1 if split_k is None else split_k), ("stages", stages)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v}")


def token_tile(m: int, e: int) -> int:
    """The default token tile of M rows over E experts: the smallest tile holding the mean rows per active
    expert (M / min(E, M)); 8 at decode."""
    mean = -(-m // max(1, min(e, m)))
    return next((t for t in BLOCK_TS if t >= mean), BLOCK_TS[-1])


def pick_tiles(m: int, e: int, n: int, k: int, block_t: int | None, block_n: int | None, block_k: int | None,
               split_k: int | None, k_align: int) -> tuple[int, int, int, int]:
    """(block_t, block_n, block_k, split_k): the given ones, defaults for the rest.

    block_t: the smallest tile holding the mean rows per active expert (M / min(E, M)): 8 at decode.
    block_n: 128 (two compute warpgroups share the producer) where N allows, else 64.
    split_k: the smallest split into whole ``k_align``-column chunks with >= 2 CTAs per SM, estimating the
    active work items as min(E, M) (each row may be a different expert).
    block_k: 256 for token tiles up to 32 rows, else 128 (both divide a chunk)."""
    bt = block_t or token_tile(m, e)
    bn = block_n or (128 if n % 128 == 0 else 64)
    if n % bn:
        raise ValueError(f"block_n {bn} must divide N = {n}")
    chunks = k // k_align
    if split_k is not None:
        if chunks % split_k:
            raise ValueError(f"split_k must divide K / {k_align} = {chunks}, got {split_k}")
        s = split_k
    else:
        ctas = min(e, m) * (n // bn)
        divs = [d for d in range(1, chunks + 1) if chunks % d == 0]
        s = next((d for d in divs if ctas * d >= 2 * NUM_SMS), divs[-1]) if ctas < 2 * NUM_SMS else 1
    return bt, bn, block_k or (256 if bt <= 32 else 128), s


def n_items(m: int, e: int, bt: int) -> int:
    """Static bound on the work items: sum_e ceil(s_e / bt) <= #(s_e > 0) + sum_e floor(s_e / bt)."""
    return min(e, m) + m // bt


def padded_rows(m: int, e: int, bt: int) -> int:
    """Rows of the padded x: every group rounded up to 8 rows (at most 7 extra per expert with rows), plus one
    token tile of slack for the last tile, rounded to 8."""
    return -(-(m + 7 * min(e, m) + bt) // 8) * 8


def row_layout(sizes: jax.Array, m: int, n_items: int, n_padded: int, bt: int, *,
               implementation: Implementation = "xla", interpret: bool | None = None):
    """Where everything goes (int32 index arrays computed from ``sizes``; ``implementation``: "xla" or "pallas",
    the same integers from one kernel, ``_layout_kernel``):

    * items [2, n_items]: (expert, first row in the padded x) of each (expert, token tile) pair of the experts
      with rows, in expert order; expert -1 past the last pair. First rows are multiples of 8: a dynamic TMA
      start on x's 8-row tiling must be tile-aligned (Mosaic splits it into (row // 8, row % 8) and the box
      would run out of its 8-row tile).
    * src [n_padded]: the row of x each padded row copies (m: a zero row).
    * col [m]: the column of y^T holding row r (item * bt + row in tile); valid [m]: r < sum(sizes).
    * count [1]: the number of work items (a persistent kernel's loop bound).
    """
    if getattr(sizes, "ndim", None) != 1 or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(f"sizes must be int32 [E] (one group size per expert), got {describe(sizes)}")
    bt = check_int("bt", bt, 1)
    sizes = sizes.astype(jnp.int32)
    return run_op("row_layout", implementation, {
        "xla": lambda: _row_layout_xla(sizes, m, n_items, n_padded, bt),
        "pallas": lambda: _row_layout_pallas(sizes, m, n_items, n_padded, bt, resolve_interpret(interpret))})


def _row_layout_xla(sizes: jax.Array, m: int, n_items: int, n_padded: int, bt: int):
    ne = sizes.shape[0]
    tiles = -(-sizes // bt)
    tile_end = jnp.cumsum(tiles)
    row_end = jnp.cumsum(sizes)
    row_off = row_end - sizes
    psize = -(-sizes // 8) * 8
    pend = jnp.cumsum(psize)
    poff = pend - psize
    # work items. searchsorted by comparing against every boundary (an [n, E] compare + sum): the default
    # binary-search "scan" is an XLA while loop, whose iterations a GPU runs one host round trip each
    ss = functools.partial(jnp.searchsorted, side="right", method="compare_all")
    i = jnp.arange(n_items, dtype=jnp.int32)
    ex = jnp.minimum(ss(tile_end, i), ne - 1)
    ok = i < tile_end[-1]
    row0 = poff[ex] + (i - (tile_end[ex] - tiles[ex])) * bt
    items = jnp.stack([jnp.where(ok, ex, -1), jnp.where(ok, row0, 0)]).astype(jnp.int32)
    # output rows, and the padded rows of x: each row of x scattered to its place (a gather that searched
    # per padded row fused the [n_padded, E] search into the copy of x, recomputing it per element)
    r = jnp.arange(m, dtype=jnp.int32)
    re = jnp.minimum(ss(row_end, r), ne - 1)
    local = r - row_off[re]
    valid = r < row_end[-1]
    src = jnp.full((n_padded,), m, jnp.int32).at[jnp.where(valid, poff[re] + local, n_padded)].set(r, mode="drop")
    col = jnp.where(valid, (tile_end[re] - tiles[re] + local // bt) * bt + local % bt, 0)
    count = tile_end[-1:].astype(jnp.int32)
    return items, src.astype(jnp.int32), col.astype(jnp.int32), valid, count


ROW_CHUNK = 512  # columns of x a "fused" layout program copies at once ([8, 512]: 32 bytes a thread for e4m3;
#                  a multiple of 32, the FP4 GEMM's column permutation block)
# items / rows / padded rows per program of the layout kernel (x every expert: [8, E] compares). The programs run
# side by side, so a program's own instruction chain is the kernel's time: at 32 an Nsight Compute profile
# (2026-12-02, FP4 call at 8 tokens) showed 12.4 us for 13 programs, each of ~4.8K instructions per warp issued
# one per ~4 cycles, half the stalls on instruction fetch (the unrolled [32, 256] code). 8 cuts a program's
# element work by 4: 4.2 us in the same calls (benchmarks/results/archive/fp4_decode_ncu_sweep_h200_2026-12-02.json).
LAYOUT_BLOCK = 8
PACK_LIMIT = 1 << 15  # the layout kernel packs two of its values into one int32 where all are below this


def _layout_kernel(sizes_ref, *refs, ne: int, ep: int, m: int, n_items: int, n_padded: int, bt: int,
                   kx: int = 0, ns: int = 0, split_pairs: bool = False) -> None:
    """Program b: items, output rows and padded rows ``b * LAYOUT_BLOCK + [0, LAYOUT_BLOCK)``. Every program
    computes the experts' prefix sums itself (E values); "the expert holding index i" is the count of experts
    ending at or before i, and a value of that expert is read by a one-hot sum over the experts (no gather from
    registers). The padded rows are gathered (each finds its row of x), not scattered, so no store depends on
    another program's. ``kx`` > 0 (layout "fused"): the program also copies its padded rows of x [m, kx] and of
    the row scales [m, ns] (those transposed: [ns, n_padded]), zeros between groups, as ``tile_rows`` would in
    two more XLA kernels; ``split_pairs``: x's columns in each 32-column block as (16 even, 16 odd), the FP4
    GEMM's ``_permute_k`` order."""
    if kx:
        x_ref, s_ref, items_ref, src_ref, col_ref, valid_ref, count_ref, xp_ref, sxt_ref = refs
    else:
        items_ref, src_ref, col_ref, valid_ref, count_ref = refs
    e = C.iota((1, ep), 1)
    s = C.load(sizes_ref, (jnp.minimum(e, ne - 1),), (1, ep), mask=e < ne)
    tiles = (s + (bt - 1)) // bt
    psize = (s + 7) // 8 * 8
    # Every value here is at most n_padded. Below 2^15, two of them share an int32 (hi * 2^16 + lo) through a prefix
    # sum or a one-hot sum without carries: half the scans and cross-warp reductions, whose barriers set the time
    # of this latency-bound kernel (the FP4 / FP8 grouped calls' row layout at decode; on the H200 it took about
    # a fifth less time: benchmarks/results/archive/fp4_layout_ab_h200_2026-12-04.json).
    pack = n_padded < PACK_LIMIT

    def two(f, hi, lo):  # f over hi and lo, in one call where they pack
        if not pack:
            return f(hi), f(lo)
        both = f(lax.shift_left(hi, 16) + lo)
        return lax.shift_right_logical(both, 16), both & 0xFFFF

    row_end, tile_end = two(lambda v: jnp.cumsum(v, axis=1), s, tiles)
    pend = jnp.cumsum(psize, axis=1)
    tile_start, row_off, poff = tile_end - tiles, row_end - s, pend - psize
    total_rows, total_tiles = two(jnp.sum, s, tiles)

    i = pl.program_id(0) * LAYOUT_BLOCK + C.iota((LAYOUT_BLOCK, 1), 0)

    def owners(*ends):  # [B, 1] each: the expert whose range holds i (clamped to the last)
        if not pack or ep >= 1 << 10 or len(ends) > 3:
            counts = [jnp.sum((v <= i).astype(jnp.int32), axis=1, keepdims=True) for v in ends]
        else:  # each count <= ep < 2^10: three in one reduction
            c = jnp.sum(sum(lax.shift_left((v <= i).astype(jnp.int32), 10 * j) for j, v in enumerate(ends)), axis=1,
                        keepdims=True)
            counts = [lax.shift_right_logical(c, 10 * j) & 1023 for j in range(len(ends))]
        return [jnp.minimum(c, ne - 1) for c in counts]

    def at(v, idx):  # v [1, ep] at idx [B, 1] -> [B, 1]
        return jnp.sum(jnp.where(e == idx, v, 0), axis=1, keepdims=True)

    def at2(hi, lo, idx):  # at(hi, idx), at(lo, idx)
        return two(lambda v: at(v, idx), hi, lo)

    ex, re, pe = owners(tile_end, row_end, pend)
    ok = i < total_tiles
    ex_poff, ex_start = at2(poff, tile_start, ex)
    row0 = ex_poff + (i - ex_start) * bt
    # masked-out lanes point one past the first axis (interpret mode's scatter drops them; natively they store nothing)
    inside = i < n_items
    C.store(items_ref, (jnp.where(inside, 0, 2), jnp.where(inside, i, 0)), jnp.where(ok, ex, -1), inside)
    C.store(items_ref, (jnp.where(inside, 1, 2), jnp.where(inside, i, 0)), jnp.where(ok, row0, 0), inside)

    re_off, re_start = at2(row_off, tile_start, re)
    local = i - re_off
    valid = i < total_rows
    col = jnp.where(valid, (re_start + local // bt) * bt + local % bt, 0)
    C.store(col_ref, (jnp.where(i < m, i, m),), col, i < m)
    C.store(valid_ref, (jnp.where(i < m, i, m),), valid.astype(jnp.int32), i < m)

    pe_poff, pe_s = at2(poff, s, pe)
    plocal = i - pe_poff
    src = jnp.where(plocal < pe_s, at(row_off, pe) + plocal, m)
    C.store(src_ref, (jnp.where(i < n_padded, i, n_padded),), src, i < n_padded)
    first = i == 0  # program 0's first lane
    C.store(count_ref, (jnp.where(first, 0, 1),), jnp.broadcast_to(total_tiles, i.shape), first)
    if kx:
        inside, live = i < n_padded, (i < n_padded) & (src < m)
        r_in, r_out = jnp.where(live, src, 0), jnp.where(inside, i, n_padded)
        # whole chunks load as they are: a clamped column hides the chunk's contiguity from Triton, which then
        # loads x a byte at a time (sm_90a SASS: 128 LDG.U8 a thread at 2048 e4m3 columns)
        whole = kx % ROW_CHUNK == 0
        for c0 in range(0, kx, ROW_CHUNK):
            cols = c0 + C.iota((1, ROW_CHUNK), 1)
            v = C.load(x_ref, (r_in, cols if whole else jnp.minimum(cols, kx - 1)), (LAYOUT_BLOCK, ROW_CHUNK),
                       mask=live if whole else live & (cols < kx))
            if split_pairs:  # one contiguous load, the (even, odd) halves made in registers (a transpose)
                v = jnp.swapaxes(v.reshape(LAYOUT_BLOCK, ROW_CHUNK // 32, 16, 2), 2, 3).reshape(LAYOUT_BLOCK,
                                                                                                  ROW_CHUNK)
            C.store(xp_ref, (r_out, cols), v, inside & (cols < kx))
        j = C.iota((1, C.next_pow2(ns)), 1)
        sv = C.load(s_ref, (r_in, jnp.minimum(j, ns - 1)), (LAYOUT_BLOCK, j.shape[1]), mask=live & (j < ns))
        C.store(sxt_ref, (jnp.where(j < ns, j, ns), r_out), sv, inside & (j < ns))


def _row_layout_pallas(sizes: jax.Array, m: int, n_items: int, n_padded: int, bt: int, interpret: bool,
                       rows: tuple[jax.Array, jax.Array] | None = None, split_pairs: bool = False):
    """row_layout as one Pallas kernel: the XLA form is about eight small kernels (prefix sums, searches, a
    scatter, the stacking), each near the launch floor at decode sizes, around every grouped GEMM call.
    ``rows`` = (x [m, K], scales [m, S] float32): the kernel also returns x's padded rows and the scales'
    padded rows transposed (``tile_rows(x)``, ``tile_rows(scales).T``), two XLA gathers fewer per call
    (``split_pairs``: x's columns permuted as the FP4 GEMM reads them, see ``_layout_kernel``).

    Backend: the Triton lowering (as ``topk_select``): the prefix sums over the experts are ``cumsum``
    (Triton's scan); Mosaic GPU has no lowering for a scan, and its vector layouts do not take 1-D index
    vectors of arbitrary length."""
    ne = sizes.shape[0]
    ep = C.next_pow2(max(ne, 2))
    i32 = jnp.int32
    out_shape = [jax.ShapeDtypeStruct((2, n_items), i32), jax.ShapeDtypeStruct((n_padded,), i32),
                 jax.ShapeDtypeStruct((m,), i32), jax.ShapeDtypeStruct((m,), i32), jax.ShapeDtypeStruct((1,), i32)]
    args, kx, ns = [sizes], 0, 0
    if rows is not None:
        x, sc = rows
        kx, ns = x.shape[1], sc.shape[1]
        if x.shape[0] != m or sc.shape[0] != m or sc.dtype != jnp.float32:
            raise ValueError(f"rows must be x [{m}, K] and float32 scales [{m}, S], got {x.shape} {x.dtype} and "
                             f"{sc.shape} {sc.dtype}")
        args += [x, sc]
        out_shape += [jax.ShapeDtypeStruct((n_padded, kx), x.dtype), jax.ShapeDtypeStruct((ns, n_padded), sc.dtype)]
    kernel = functools.partial(_layout_kernel, ne=ne, ep=ep, m=m, n_items=n_items, n_padded=n_padded, bt=bt,
                               kx=kx, ns=ns, split_pairs=split_pairs)
    outs = C.pallas_call(kernel, out_shape=tuple(out_shape),
                         grid=(pl.cdiv(max(n_items, m, n_padded), LAYOUT_BLOCK),), aliases={}, interpret=interpret,
                         name="grouped_row_layout", num_warps=4)(*args)
    items, src, col, valid, count = outs[:5]
    return (items, src, col, valid != 0, count, *outs[5:])


def gather_rows(yt: jax.Array, col: jax.Array, valid: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """y [M, N] from the kernel's y^T [N, items * block_t]: row r is column ``col[r]``; rows past the groups
    (``valid`` false) are 0."""
    return jnp.where(valid[:, None], jnp.take(yt, col, axis=1).T, 0).astype(out_dtype)


class Plan(NamedTuple):
    """A grouped GEMM call's tiles, interpret mode and row layout (``plan``)."""
    block_t: int
    block_n: int
    block_k: int
    splits: int
    interpret: plgpu.InterpretGPUParams | None  # None: native
    items: int  # static bound on the (expert, token tile) work items
    rows: int  # rows of the padded copy of x
    info: jax.Array  # [2, items]: (expert, first padded row) per item
    src: jax.Array  # [rows]: the row of x each padded row copies (m: a zero row)
    col: jax.Array  # [m]: the column of y^T holding row r
    valid: jax.Array  # [m]: r < sum(sizes)
    count: jax.Array  # [1]: the number of work items
    xp: jax.Array | None = None  # layout "fused": x's padded rows (``tile_rows(x)``), from the layout kernel
    sxt: jax.Array | None = None  # layout "fused": the row scales' padded rows, transposed [S, rows]


LAYOUTS = ("auto", "xla", "pallas", "fused")


def plan(sizes: jax.Array, m: int, e: int, n: int, k: int, block_t: int | None, block_n: int | None,
         block_k: int | None, split_k: int | None, k_align: int,
         interpret: bool | plgpu.InterpretGPUParams | None, layout: str = "xla",
         rows: tuple[jax.Array, jax.Array] | None = None, split_pairs: bool = False) -> Plan:
    """Tiles (``pick_tiles``), interpret mode (None: whenever the default backend is not a GPU) and the row
    layout of a call with M = ``m`` rows over E = ``e`` experts of [n, k] weights (``layout``: ``row_layout``'s
    implementation; its kernel runs in interpret mode where the GEMM does; "auto": the kernel where the GEMM
    runs natively, XLA's ops in interpret mode, where the kernel would only be slower to emulate; "fused": the
    kernel, which also copies ``rows`` = (x, its float32 row scales) into the padded layout: ``padded_x``;
    ``split_pairs``: x's columns as the FP4 GEMM reads them)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "fused" and rows is None:
        raise ValueError('layout="fused" copies e4m3 x with its scales: it needs x_scale (bf16 x: "pallas")')
    bt, bn, bk, s = pick_tiles(m, e, n, k, block_t, block_n, block_k, split_k, k_align)
    interpret = mosaic_interpret(interpret)
    items, n_rows = n_items(m, e, bt), padded_rows(m, e, bt)
    if layout == "auto":
        layout = "xla" if interpret else "pallas"
    if layout == "fused":
        return Plan(bt, bn, bk, s, interpret or None, items, n_rows,
                    *_row_layout_pallas(sizes.astype(jnp.int32), m, items, n_rows, bt, bool(interpret), rows,
                                        split_pairs))
    return Plan(bt, bn, bk, s, interpret or None, items, n_rows,
                *row_layout(sizes, m, items, n_rows, bt, implementation=layout, interpret=bool(interpret)))


def tile_rows(a: jax.Array, p: Plan) -> jax.Array:
    """``a`` [m, ...] (x, or its per-row scales) in the padded row layout the kernel reads: padded row i copies
    row ``p.src[i]``, and the rows between groups are zeros."""
    return jnp.take(jnp.pad(a, ((0, 1),) + ((0, 0),) * (a.ndim - 1)), p.src, axis=0)


def padded_x(x: jax.Array, scales: jax.Array, p: Plan) -> tuple[jax.Array, jax.Array]:
    """(x's padded rows, the scales' padded rows transposed [S, rows]): the layout kernel's copies (layout
    "fused") or two XLA gathers."""
    if p.xp is not None:
        return p.xp, p.sxt
    return tile_rows(x, p), tile_rows(scales, p).T


def finish(yt: jax.Array, p: Plan, out_dtype: jnp.dtype) -> jax.Array:
    """y [M, N] from the kernel's output: split-K partials summed, then each row's column gathered."""
    return gather_rows(jnp.sum(yt, axis=0) if p.splits > 1 else yt, p.col, p.valid, out_dtype)


class CtaWork(NamedTuple):
    """What a kernel CTA works on (``cta_work``)."""
    item: int | jax.Array  # work item: (expert, token tile)
    split: jax.Array  # K split
    expert: jax.Array  # -1: past the last item (the CTA exits)
    row0: jax.Array  # first row of the token tile in the padded x
    n0: jax.Array  # first weight row (output column of y^T) of the CTA's N tile


def cta_work(info_ref, items: int, n_tiles: int, block_n: int) -> CtaWork:
    """Inside a kernel with grid ("cta",) = (split, N tile, item), work item fastest (the token tiles of one
    expert run next to each other and share its weight tile in L2): this CTA's item, split and tile."""
    from jax import lax  # noqa: PLC0415 - kernel-side helper

    pid = lax.axis_index("cta")
    item = pid % items
    return CtaWork(item, pid // (items * n_tiles), info_ref[0, item], info_ref[1, item],
                   ((pid // items) % n_tiles) * block_n)


class FlatSchedule(NamedTuple):
    """A persistent kernel's steps (``flat_schedule``): CTA c runs units c, c + P, ... (unit = (split, N tile,
    item), item fastest), all their K steps in one pipeline."""
    steps: jax.Array  # this CTA's pipeline steps (a dynamic grid)
    unit: Callable  # flat step s -> (item, N tile, split, step in the unit, the step's first input column)
    expert: Callable  # flat step s -> its unit's expert
    row0: Callable  # flat step s -> its unit's first row in the padded x


def flat_schedule(count_ref, info_ref, *, ctas: int, splits: int, n_tiles: int, steps: int, kc: int,
                  bk: int) -> FlatSchedule:
    """Inside a kernel with grid ("cta",) of ``ctas`` CTAs: this CTA's units over the row layout's ``count``
    work items (no placeholder items), ``steps`` steps of ``bk`` input columns per unit of ``kc``."""
    from jax import lax  # noqa: PLC0415 - kernel-side helper

    n_items = jnp.maximum(count_ref[0], 1)  # no items: no units (below), the divisions stay defined
    units = splits * n_tiles * count_ref[0]
    cta = lax.axis_index("cta")
    n_local = jnp.maximum(units - cta + ctas - 1, 0) // ctas

    def unit(s):
        u = cta + s // steps * ctas
        si = u // (n_items * n_tiles)
        ks = s % steps
        return u % n_items, u // n_items % n_tiles, si, ks, si * kc + ks * bk

    return FlatSchedule(n_local * steps, unit, lambda s: info_ref[0, unit(s)[0]], lambda s: info_ref[1, unit(s)[0]])


def store_unit(o_ref, acc: jax.Array, sched: FlatSchedule, s, *, steps: int, block_n: int, block_t: int,
               splits: int) -> jax.Array:
    """A flat pipeline body's end of step ``s``: at its unit's last step, the compute warpgroup's [64, block_t]
    accumulator goes to its columns of y^T (fp32 split partials: the split's slab); returns the accumulator the
    next step starts from (zeros after a unit's last step)."""
    import jax.experimental.pallas as pl  # noqa: PLC0415
    from jax import lax  # noqa: PLC0415

    item, t, si, ks, _ = sched.unit(s)
    done = ks == steps - 1

    @pl.when(done)
    def _():
        rows, cols = pl.ds(t * block_n + lax.axis_index("wg") * 64, 64), pl.ds(item * block_t, block_t)
        dst = o_ref.at[rows, cols] if splits == 1 else o_ref.at[si, rows, cols]
        dst[...] = acc.astype(dst.dtype)

    return jnp.where(jnp.full(acc.shape, done), jnp.zeros(acc.shape, jnp.float32), acc)


def flat_pipeline(body: Callable, sched: FlatSchedule, *, stages: int, in_specs: list, num_compute_wgs: int,
                  block_t: int) -> Callable:
    """The warp-specialised pipeline of a ``flat_schedule`` (its steps as a dynamic grid), its compute
    warpgroups' [64, block_t] float32 accumulators starting at zero; call it with the GMEM refs of ``in_specs``."""
    import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: PLC0415

    zero = lambda: plgpu.layout_cast(jnp.full((64, block_t), 0.0, jnp.float32), plgpu.Layout.WGMMA)  # noqa: E731
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(sched.steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=num_compute_wgs,
        max_concurrent_steps=stages, in_specs=in_specs, compute_context=lambda run: run(zero()))
