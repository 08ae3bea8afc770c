"""Exact top-k of rows held whole in registers (Pallas on GPU, Triton lowering): for rows where k is a large part of
the row, the indexer's decode up to 16K context (k = 2048 of 4096 logits a token at 4K).

``topk_rows(x, k)`` keeps each row's k largest values in IEEE's total order (``jds.ops.select.ordered_key``: -0.0
below +0.0; equal values by the lower column), the set ``lax.top_k`` keeps on the CPU (XLA's GPU sort can rank -0.0
level with +0.0), returned in ascending column order with the kept values. One program per row loads the row once
into registers as order-preserving int32 keys (as power-of-two chunks: ``chunks``), finds the k-th largest key tau
by a search over its 32 bits from the top (a compare and a sum of the row per candidate: ``count(key >= candidate)
>= k`` decides it; ``bits`` of them a round), and stores every key > tau and the first ``k - count(key > tau)``
keys == tau at their rank among the kept (exclusive prefix sums of the masks).

Why: at these shapes the radix select (``pallas_kernels.topk_select``) has no prefilter to apply (it is built for
k << N) and its counting passes re-read the row from memory; on an H100 it was no faster than ``lax.top_k``, whose
sort of the whole row is 27 µs a layer of V3.2's decode step at batch 64 (docs/perf-log.md, sixty-seventh
session). Backend: the Triton lowering, as ``topk_select`` (its kept keys are stored at data-dependent slots, a
scatter Mosaic GPU cannot express on Hopper); rows up to ``MAX_COLS`` columns (else ``Unsupported``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jds.ops.dispatch import Unsupported, check_array
from pallas_kernels import fused_insert_common as C
from pallas_kernels.topk_select import _SIGN, I32, _key_s  # the radix select's keys: s, and u = s ^ _SIGN

MAX_COLS = 17408  # a row in registers: 16K keys plus a 1K tail over 16 warps (ptxas, sm_90a: a few bytes spilled)
CHUNK_ALIGN = 64  # the row is rounded up to this and held as its binary decomposition's power-of-two chunks


def chunks(n: int) -> list[tuple[int, int]]:
    """(start, width) of the power-of-two column blocks that hold a row of ``n`` columns, widest first: the binary
    decomposition of n rounded up to ``CHUNK_ALIGN``. The indexer's rows are a tile past a power of two (4096
    visible logits arrive as 4160 columns): 4096 + 64 keys in registers instead of the next power of two's 8192."""
    m, out, start = -(-n // CHUNK_ALIGN) * CHUNK_ALIGN, [], 0
    for bit in range(m.bit_length() - 1, -1, -1):
        if m >> bit & 1:
            out.append((start, 1 << bit))
            start += 1 << bit
    return out


def default_warps(t: int, n: int) -> int:
    """8 warps a row up to 8K columns and a tile, 16 above (the widest rows' keys need them to stay in registers);
    4 from 1024 rows, where more rows share an SM (the GPU timeline on an H100, ``topk_small.py --rows-warps``)."""
    if n > 8192 + CHUNK_ALIGN:
        return 16
    return 4 if t >= 1024 else 8


def _kernel(xb_ref, x_ref, idx_ref, val_ref, *, t: int, n: int, k: int, bits: int, interpret: bool):
    row = pl.program_id(0)
    parts = []  # (columns [1, w], inside [1, w], keys s [1, w]) per chunk
    for start, w in chunks(n):
        col = start + C.iota((1, w), 1)
        inside = col < n
        parts.append((col, inside, _key_s(C.load(xb_ref, (row, col), (1, w), mask=inside, other=-1))))
    # tau: the largest u (u = s ^ sign, the unsigned order) with count(u >= tau) >= k, ``bits`` of it a round from the
    # top: the round counts the keys >= each of the digit's 2^bits candidates in one reduction (Triton's shapes are
    # powers of two: digit 0, which holds by the invariant, is counted too), and the digit is how many of those
    # counts reach k, less one (they fall as the digit grows)
    prefix = jnp.zeros((), I32)  # tau's bits decided so far, as u's bit pattern
    top = 32
    while top > 0:
        b = min(bits, top)
        shift = top - b
        if b == 1:  # one candidate: the count alone decides the bit
            cand = prefix | int(np.uint32(1 << shift).view(np.int32))
            count = sum(jnp.sum((s >= (cand ^ _SIGN)).astype(I32)) for _, _, s in parts)
            prefix = jnp.where(count >= k, cand, prefix)
            top = shift
            continue
        digit = C.iota((1 << b, 1), 0)
        cand = (prefix | lax.shift_left(digit, jnp.full(digit.shape, shift, I32))) ^ _SIGN  # in s's order
        count = sum(jnp.sum((s >= cand).astype(I32), axis=1) for _, _, s in parts)  # [2^b]
        prefix = prefix | lax.shift_left(jnp.sum((count >= k).astype(I32)) - 1, jnp.asarray(shift, I32))
        top = shift
    tau = prefix ^ _SIGN
    need = k - sum(jnp.sum((s > tau).astype(I32)) for _, _, s in parts)
    eq_before = kept_before = jnp.zeros((), I32)  # equal / kept keys in the chunks to the left
    for col, inside, s in parts:
        gt, eq = (s > tau).astype(I32), (s == tau).astype(I32)
        keep = (gt == 1) | ((eq == 1) & (eq_before + jnp.cumsum(eq, axis=1) - eq < need))
        ki = keep.astype(I32)
        slot = kept_before + jnp.cumsum(ki, axis=1) - ki
        eq_before, kept_before = eq_before + jnp.sum(eq), kept_before + jnp.sum(ki)
        # interpret mode bounds-checks every lane's index: the dropped lanes point one past the rows (natively the
        # mask alone keeps them from memory)
        at = (jnp.where(keep, row, t), jnp.where(keep, slot, 0)) if interpret else (row, slot)
        C.store(idx_ref, at, col, keep)
        C.store(val_ref, at, C.load(x_ref, (row, col), col.shape, mask=inside, other=0.0), keep)


def topk_rows(x: jax.Array, k: int, *, interpret: bool | None = None,
              num_warps: int | None = None, bits: int = 1) -> tuple[jax.Array, jax.Array]:
    """(values float32 [T, k], columns int32 [T, k]) of each row's top k in IEEE's total order, in ascending column
    order. x: float [T, N] with k <= N <= ``MAX_COLS``. ``num_warps``: None = ``default_warps``.
    ``bits``: the k-th key's bits decided a round (1-4; a round is one reduction of 2^bits counts). 1 is the
    default: 2 halves the rounds but measured slower at every indexer shape but V4's decode one (64 x 1024 : 512),
    where one run had it slightly faster (docs/perf-log.md, seventieth session)."""
    check_array("topk_rows: x", x, (("T", None), ("N", None)), "float")
    t, n = x.shape
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n:
        raise ValueError(f"topk_rows: k must be an int in [1, N = {n}], got {k!r}")
    if bits not in (1, 2, 3, 4):
        raise ValueError(f"topk_rows: bits must be 1, 2, 3 or 4, got {bits!r}")
    if n > MAX_COLS:
        raise Unsupported(f"topk_rows: rows of {n} columns > MAX_COLS {MAX_COLS} (held in registers)")
    if t == 0:
        return jnp.zeros((0, k), jnp.float32), jnp.zeros((0, k), I32)
    xf = x.astype(jnp.float32)
    interpret = C.resolve_interpret(interpret)
    kernel = functools.partial(_kernel, t=t, n=n, k=int(k), bits=bits, interpret=interpret)
    out_shape = (jax.ShapeDtypeStruct((t, k), I32), jax.ShapeDtypeStruct((t, k), jnp.float32))
    idx, vals = C.pallas_call(kernel, out_shape=out_shape, grid=(t,), aliases={},
                              interpret=interpret, name="topk_rows",
                              num_warps=num_warps or default_warps(t, n))(
        lax.bitcast_convert_type(xf, I32), xf)
    return vals, idx
