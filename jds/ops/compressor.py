"""DeepSeek-V4's KV compressor: gated per-channel softmax pooling of r-token blocks over a paged state cache.

Shared by the main C4/C128 compressors (d = head_dim) and the C4 indexer's key compressor (d = 128, r = 4).

Per token at position p the layer projects ``kv, z`` (fp32, c*d wide each; c = 2 iff r == 4) and this
module stores the state row ``[kv | z + ape[p % r]]`` (fp32, 2*c*d) at the token's slot of a
``FloatRows(2*c*d, block_size)`` cache, every token, through ``paging.write_records`` (slot -1 = padding
writes nothing). A token with (p + 1) % r == 0 closes block b = p // r; its entry is, per channel j < d,

    softmax over candidates s of score[s, j], weighted sum of kv[s, j]

where the candidates are block b's r tokens (channels [d:2d] when overlapping, else [0:d]) and, at r = 4,
block b-1's r tokens on channels [0:d] (score -inf when b = 0). All candidate states are read back from
the cache through the block table, so earlier chunks/steps of a request (chunked prefill, decode) are
seen exactly like tokens of the current step. The pooled vector is RMSNorm'ed (learned weight) and
RoPE'd (interleaved, last ``rope_dim`` dims) at position b*r, and goes to compressed-cache slot
``global_slots(block_tables, req, b, block_size // r)``; every other row of the output has slot -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jds.ops.norms import rms_norm
from jds.ops.paging import global_slots, read_records, write_records
from jds.ops.records import FloatRows
from jds.ops.rope import rope_cos_sin, rope_part


def overlap_factor(ratio: int) -> int:
    """c: 2 for the overlapping ratio-4 compressor, else 1."""
    return 2 if ratio == 4 else 1


def state_format(ratio: int, d: int, block_size: int) -> FloatRows:
    """Per-token fp32 state rows [kv (c*d) | score + ape (c*d)], one row per token slot."""
    return FloatRows(2 * overlap_factor(ratio) * d, block_size, jnp.float32)


def max_closing(num_tokens: int, num_reqs: int, ratio: int) -> int:
    """Static bound on the block-closing tokens of a step whose requests each contribute consecutive
    positions: a run of n positions closes at most n // r + 1 blocks, and sum(n_i // r) <= T // r."""
    return max(1, min(num_tokens, num_tokens // ratio + num_reqs))


def state_rows(kv: jax.Array, score: jax.Array, ape: jax.Array, positions: jax.Array) -> jax.Array:
    """[T, c*d] kv and gate projections + ape [r, c*d] -> fp32 state rows [T, 2*c*d]."""
    r = ape.shape[0]
    s = score.astype(jnp.float32) + ape.astype(jnp.float32)[positions % r]
    return jnp.concatenate([kv.astype(jnp.float32), s], axis=-1)


def closing_tokens(positions: jax.Array, slot_mapping: jax.Array, ratio: int, max_out: int) -> jax.Array:
    """Indices (into the step's tokens) of the real tokens that close a block, -1 filled to ``max_out``."""
    closes = ((positions + 1) % ratio == 0) & (slot_mapping >= 0)
    (idx,) = jnp.nonzero(closes, size=max_out, fill_value=-1)
    return idx.astype(jnp.int32)


def pool_blocks(state_cache: jax.Array, block_tables: jax.Array, req: jax.Array, blocks: jax.Array, *,
                ratio: int, d: int, block_size: int) -> jax.Array:
    """Softmax-pool block ``blocks[n]`` of request row ``req[n]`` (block < 0: ignored row) -> [N, d] fp32."""
    c = overlap_factor(ratio)
    fmt = state_format(ratio, d, block_size)
    j = jnp.arange(ratio, dtype=jnp.int32)

    def gather(b: jax.Array) -> tuple[jax.Array, jax.Array]:
        local = jnp.where((b >= 0)[:, None], b[:, None] * ratio + j, -1)  # [N, r] token positions
        rows = read_records(state_cache, fmt, global_slots(block_tables, req, local, block_size))
        return rows, local >= 0

    cur, _ = gather(blocks)
    kv = cur[..., (c - 1) * d: c * d]
    sc = cur[..., c * d + (c - 1) * d:]
    if c == 2:
        prev, ok = gather(jnp.where(blocks >= 1, blocks - 1, -1))
        kv = jnp.concatenate([prev[..., :d], kv], axis=1)
        sc = jnp.concatenate([jnp.where(ok[..., None], prev[..., c * d: c * d + d], -jnp.inf), sc], axis=1)
    a = jax.nn.softmax(sc, axis=1)  # per channel, over the c*r candidates
    return jnp.sum(a * kv, axis=1)


def write_state_xla(state_cache: jax.Array, proj: jax.Array, ape: jax.Array, positions: jax.Array,
                    slot_mapping: jax.Array, *, ratio: int, d: int, block_size: int) -> jax.Array:
    """Save this step's state rows (``state_rows`` of the projection ``proj`` = [kv | score] [T, 2*c*d]) at
    ``slot_mapping`` (-1 writes nothing). The XLA implementation of pallas_kernels.compressor_pool.write_state."""
    rows = state_rows(*jnp.split(proj, 2, axis=-1), ape, positions)
    return write_records(state_cache, state_format(ratio, d, block_size), slot_mapping, rows)


def closing_blocks(positions: jax.Array, req_idx: jax.Array, slot_mapping: jax.Array, ratio: int,
                   max_out: int) -> tuple[jax.Array, jax.Array]:
    """The blocks this step's tokens close: (request row [max_out] int32, block [max_out] int32, -1 for unused
    rows), the inputs of ``pool_norm_rope`` (pallas_kernels.compressor_pool) and of the entries' cache slots.
    Where ``max_out`` covers every token (decode: one token a request), row t is token t's, no compaction."""
    t = positions.shape[0]
    if max_out >= t:
        closes = ((positions + 1) % ratio == 0) & (slot_mapping >= 0)
        req = jnp.pad(req_idx.astype(jnp.int32), (0, max_out - t))
        return req, jnp.pad(jnp.where(closes, positions // ratio, -1).astype(jnp.int32), (0, max_out - t),
                            constant_values=-1)
    idx = closing_tokens(positions, slot_mapping, ratio, max_out)
    tok = jnp.maximum(idx, 0)
    return req_idx[tok], jnp.where(idx >= 0, positions[tok] // ratio, -1)


def entry_rope(inv_freqs: np.ndarray, blocks: jax.Array, ratio: int) -> tuple[jax.Array, jax.Array]:
    """cos / sin [N, rope_dim / 2] of each entry's position (its block's first token, b * r)."""
    return rope_cos_sin(inv_freqs, jnp.maximum(blocks, 0) * ratio)


def pool_norm_rope_xla(state_cache: jax.Array, block_tables: jax.Array, req: jax.Array, blocks: jax.Array,
                       norm_weight: jax.Array, cos: jax.Array, sin: jax.Array, *, ratio: int, d: int,
                       block_size: int, eps: float, dtype: jnp.dtype) -> jax.Array:
    """The entries [N, d] in ``dtype``: each block pooled (``pool_blocks``), RMSNorm'ed and RoPE'd (interleaved,
    last 2 * cos.shape[-1] dims). The XLA implementation of pallas_kernels.compressor_pool.pool_norm_rope; rows
    with block < 0 hold values that the caller must not write (their slot is -1)."""
    pooled = pool_blocks(state_cache, block_tables, req, blocks, ratio=ratio, d=d, block_size=block_size)
    return norm_rope(pooled, norm_weight, cos, sin, eps=eps, dtype=dtype)


def norm_rope(pooled: jax.Array, norm_weight: jax.Array, cos: jax.Array, sin: jax.Array, *, eps: float,
              dtype: jnp.dtype) -> jax.Array:
    """Pooled blocks [N, d] -> entries: RMSNorm (rounded to ``dtype``), then interleaved RoPE on the last
    2 * cos.shape[-1] dims."""
    entry = rms_norm(pooled, norm_weight, eps, dtype)
    return rope_part(entry, cos, sin, rope_dim=2 * cos.shape[-1], first=False, interleaved=True)
