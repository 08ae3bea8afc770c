"""Rows of a grouped (MoE) GEMM laid out for a kernel that works on (expert, token tile) items: shared by the
FP4 and FP8 grouped expert GEMMs (``fp4_grouped_gemm``, ``fp8_grouped_gemm``).

x's rows come grouped by expert (``sizes``); the kernels read token tiles by TMA from a copy of x in which
every group starts on an 8-row boundary (a data-dependent TMA start on an 8-row SMEM tiling must be
tile-aligned), write y^T [N, items * block_t] per item, and the wrapper gathers each row's column back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def n_items(m: int, e: int, bt: int) -> int:
    """Static bound on the work items: sum_e ceil(s_e / bt) <= #(s_e > 0) + sum_e floor(s_e / bt)."""
    return min(e, m) + m // bt


def padded_rows(m: int, e: int, bt: int) -> int:
    """Rows of the padded x: every group rounded up to 8 rows (at most 7 extra per expert with rows), plus one
    token tile of slack for the last tile, rounded to 8."""
    return -(-(m + 7 * min(e, m) + bt) // 8) * 8


def row_layout(sizes: jax.Array, m: int, n_items: int, n_padded: int, bt: int):
    """Where everything goes (int32 index arrays, computed in XLA from ``sizes``):

    * items [2, n_items]: (expert, first row in the padded x) of each (expert, token tile) pair of the experts
      with rows, in expert order; expert -1 past the last pair. First rows are multiples of 8: a dynamic TMA
      start on x's 8-row tiling must be tile-aligned (Mosaic splits it into (row // 8, row % 8) and the box
      would run out of its 8-row tile).
    * src [n_padded]: the row of x each padded row copies (m: a zero row).
    * col [m]: the column of y^T holding row r (item * bt + row in tile); valid [m]: r < sum(sizes).
    """
    sizes = sizes.astype(jnp.int32)
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
    return items, src.astype(jnp.int32), col.astype(jnp.int32), valid


def gather_rows(yt: jax.Array, col: jax.Array, valid: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """y [M, N] from the kernel's y^T [N, items * block_t]: row r is column ``col[r]``; rows past the groups
    (``valid`` false) are 0."""
    return jnp.where(valid[:, None], jnp.take(yt, col, axis=1).T, 0).astype(out_dtype)
