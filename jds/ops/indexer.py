"""The lightning-indexer score and top-k selection shared by V3.2 (keys = tokens) and V4 C4
(keys = compressed entries). Pure-JAX reference of pallas_kernels/sparse_indexer.py.

Score: I(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]) in float32, where q and k are the
*dequantised* FP8 values. Because the FP8 scales are powers of two, this equals the kernel form
k_scale[s] * sum_h (w * q_scale)[t, h] * relu(q8 . k8) exactly (barring overflow).

Tie rule (all implementations): among equal scores the lower key index wins (jax.lax.top_k's order).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jds.ops.hadamard import hadamard_rotate
from jds.ops.paging import RecordFormat, gather_request_rows
from jds.ops.quant import act_quant, fp4_roundtrip


def prepare_indexer_q(q: jax.Array, w: jax.Array, *, head_dim: int, n_heads: int, fp8: bool,
                      hadamard: bool, dtype: jnp.dtype, scale_fmt: str = "ue8m0", fp4: bool = False
                      ) -> tuple[jax.Array, jax.Array]:
    """Roped indexer q [T, Hi, Di] and raw head weights [T, Hi] -> (q for scoring, folded weights).

    Weights fold the constant scales Di^-1/2 * Hi^-1/2 (the FP8 q scale stays in the dequantised q).
    """
    if fp8 and not fp4:
        q8, s, wf = prepare_indexer_q8(q, w, head_dim=head_dim, n_heads=n_heads, hadamard=hadamard, dtype=dtype,
                                       scale_fmt=scale_fmt)
        return dequant_index_q(q8, s), wf
    q = q.astype(dtype)
    if hadamard:
        q = hadamard_rotate(q)
    if fp4:  # MXFP4 (V4 as released): the q values carry their own scales; the weights are not q-scaled
        q = fp4_roundtrip(q)
    return q.astype(jnp.float32), fold_index_weights(w, head_dim, n_heads)


def prepare_indexer_q8(q: jax.Array, w: jax.Array, *, head_dim: int, n_heads: int, hadamard: bool,
                       dtype: jnp.dtype, scale_fmt: str = "ue8m0") -> tuple[jax.Array, jax.Array, jax.Array]:
    """The FP8 indexer q as the model quantises it: (q8 e4m3 [T, Hi, Di], its scales float32 [T, Hi], folded
    weights [T, Hi]). The layers hand these to ``indexer_topk`` (``index_q_scale``): its kernel scores q8 with the
    scale folded into the weights, so q is quantised once (a dequantised q would be quantised again there, which
    with amax scales is a second rounding)."""
    q = q.astype(dtype)
    if hadamard:
        q = hadamard_rotate(q)
    q8, s = act_quant(q, head_dim, scale_fmt, 1e-4)
    return q8, s[..., 0], fold_index_weights(w, head_dim, n_heads)


def dequant_index_q(q8: jax.Array, s: jax.Array) -> jax.Array:
    """float32 q = q8 * s, one scale per (token, head)."""
    return q8.astype(jnp.float32) * s.astype(jnp.float32)[..., None]


def fold_index_weights(w: jax.Array, head_dim: int, n_heads: int) -> jax.Array:
    """The indexer's head weights with the constant scales Di^-1/2 * Hi^-1/2 folded in, float32."""
    return w.astype(jnp.float32) * (head_dim ** -0.5) * (n_heads ** -0.5)


def prepare_indexer_k(k: jax.Array, *, hadamard: bool, dtype: jnp.dtype) -> jax.Array:
    """Roped indexer key rows -> the rows handed to the cache writer (which quantises if FP8)."""
    k = k.astype(dtype)
    return hadamard_rotate(k) if hadamard else k


def index_scores(q: jax.Array, w: jax.Array, keys: jax.Array) -> jax.Array:
    """q [T, Hi, D], w [T, Hi], keys [T, N, D] (each token's own request's keys) -> [T, N] float32."""
    dots = jnp.einsum("thd,tnd->thn", q.astype(jnp.float32), keys.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("th,thn->tn", w, jax.nn.relu(dots), precision=jax.lax.Precision.HIGHEST)


def topk_visible(scores: jax.Array, n_visible: jax.Array, k: int) -> jax.Array:
    """Top-k over the first ``n_visible[t]`` entries of each row; int32 [T, k], -1 where fewer exist.

    Returns request-local key indices (order within the set carries no meaning).
    """
    n = scores.shape[-1]
    kk = min(k, n)
    col = jnp.arange(n, dtype=jnp.int32)
    masked = jnp.where(col[None, :] < n_visible[:, None], scores, -jnp.inf)
    return visible_topk_indices(*jax.lax.top_k(masked, kk), k)


def visible_topk_indices(vals: jax.Array, idx: jax.Array, k: int) -> jax.Array:
    """A top-k selection's (values, indices) [T, kk] -> int32 [T, k]: -1 where the value is -inf (an
    invisible key) and in the columns beyond kk (rows shorter than k)."""
    idx = jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)
    if idx.shape[1] < k:
        idx = jnp.pad(idx, ((0, 0), (0, k - idx.shape[1])), constant_values=-1)
    return idx


def masked_index_logits(index_q: jax.Array, index_w: jax.Array, cache: jax.Array, fmt: RecordFormat,
                        block_tables: jax.Array, req_idx: jax.Array, n_visible: jax.Array) -> jax.Array:
    """Every token's scores against its own request's paged keys, -inf past ``n_visible``:
    fp32 [T, block_tables.shape[1] * entries_per_page] (the reference of the logits kernel)."""
    max_keys = block_tables.shape[1] * fmt.entries_per_page
    keys = gather_request_rows(cache, fmt, block_tables, max_keys)
    scores = index_scores(index_q, index_w, keys[req_idx])
    col = jnp.arange(max_keys, dtype=jnp.int32)
    return jnp.where(col[None, :] < n_visible[:, None], scores, -jnp.inf)


def map_token_chunks(fn: Callable[..., jax.Array], t: int, chunk: int, arrays: tuple[jax.Array, ...],
                     pad_values: tuple) -> jax.Array:
    """``fn`` over token chunks of ``chunk`` rows (lax.map, so one chunk's workspace lives at a time)."""
    if t <= chunk:
        return fn(*arrays)
    n = -(-t // chunk)
    padded = [jnp.pad(a, [(0, n * chunk - t)] + [(0, 0)] * (a.ndim - 1), constant_values=v)
              for a, v in zip(arrays, pad_values)]
    stacked = [a.reshape((n, chunk) + a.shape[1:]) for a in padded]
    out = jax.lax.map(lambda xs: fn(*xs), stacked)
    return out.reshape((n * chunk,) + out.shape[2:])[:t]


def indexer_topk_xla(index_q: jax.Array, index_w: jax.Array, cache: jax.Array, fmt: RecordFormat,
                     block_tables: jax.Array, req_idx: jax.Array, n_visible: jax.Array, k: int, *,
                     max_workspace_bytes: int | None = None) -> jax.Array:
    """Top-k request-local key indices [T, k] int32 (-1 padded) among each token's first ``n_visible`` paged
    keys: the XLA implementation of pallas_kernels.sparse_indexer.indexer_topk.

    ``max_workspace_bytes``: tokens go in chunks whose gathered fp32 keys plus logits fit it (None: one chunk).
    """
    t = index_q.shape[0]
    n_cols = block_tables.shape[1] * fmt.entries_per_page
    chunk = t if max_workspace_bytes is None else max(1, max_workspace_bytes // (4 * n_cols * (index_q.shape[-1] + 1)))

    def fn(q: jax.Array, w: jax.Array, r: jax.Array, nv: jax.Array) -> jax.Array:
        keys = gather_request_rows(cache, fmt, block_tables, n_cols)
        return topk_visible(index_scores(q, w, keys[r]), nv, k)

    return map_token_chunks(fn, t, chunk, (index_q, index_w, req_idx, n_visible), (0, 0, 0, 0))
