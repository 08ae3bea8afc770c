"""Token-level sparse MQA over gathered candidate rows, shared by V3.2 (absorbed MLA over
[latent; rope], V = latent) and V4 (K = V = 512, window + compressed, attention sink).
Pure-JAX reference of pallas_kernels/sparse_mqa.py.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from jds.ops.paging import RecordFormat, read_records


def sparse_mqa(q: jax.Array, rows: jax.Array, valid: jax.Array, *, scale: float, v_dim: int,
               sink: jax.Array | None = None) -> jax.Array:
    """q [T, H, Dk]; rows [T, K, Dk] (one shared KV head); valid [T, K] bool.

    out[t, h] = sum_s p[t, h, s] * rows[t, s, :v_dim] with a float32 softmax over valid s; the
    optional per-head ``sink`` [H] adds exp(sink) mass to the denominator with a zero value.
    A row with no valid candidate (and no sink) returns zeros, never NaN. Returns float32 [T, H, v_dim].
    """
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32), rows.astype(jnp.float32), precision=hp) * scale
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)
    if sink is not None:
        m = jnp.maximum(m, sink.astype(jnp.float32)[None, :])
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m_safe[..., None])
    denom = jnp.sum(p, axis=-1)
    if sink is not None:
        denom = denom + jnp.exp(sink.astype(jnp.float32)[None, :] - m_safe)
    out = jnp.einsum("thk,tkd->thd", p, rows[..., :v_dim].astype(jnp.float32), precision=hp)
    return jnp.where(denom[..., None] > 0, out / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)


def paged_sparse_mqa_xla(q: jax.Array, caches: Sequence[jax.Array], formats: Sequence[RecordFormat],
                         slots: Sequence[jax.Array], *, scale: float, v_dim: int,
                         sink: jax.Array | None = None) -> jax.Array:
    """``sparse_mqa`` over candidate lists ``slots[i]`` [T, K_i] (global slots of ``caches[i]`` in
    ``formats[i]``, -1 = masked), gathered and dequantised with ``read_records``, one softmax over all
    lists: the XLA implementation of pallas_kernels.sparse_mqa.sparse_mqa. float32 [T, H, v_dim]."""
    rows = [read_records(c, f, s) for c, f, s in zip(caches, formats, slots)]
    valid = [s >= 0 for s in slots]
    rows = jnp.concatenate(rows, axis=1) if len(rows) > 1 else rows[0]
    valid = jnp.concatenate(valid, axis=1) if len(valid) > 1 else valid[0]
    return sparse_mqa(q, rows, valid, scale=scale, v_dim=v_dim, sink=sink)
