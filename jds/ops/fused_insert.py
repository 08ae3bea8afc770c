"""XLA implementations of the producer ops: norms, RoPE and cache inserts of the V3.2 / V4 ``prepare``.

Each is the pure-JAX form of one fused kernel in pallas_kernels/ (fused_insert_v32.py,
fused_insert_v4.py), whose entry points dispatch here for ``implementation="xla"``; the layers call
only those entry points, so the XLA path is written once.
"""

from __future__ import annotations

import jax.numpy as jnp

from jds.ops.hadamard import hadamard_rotate
from jds.ops.indexer import fold_index_weights, prepare_indexer_k
from jds.ops.norms import layer_norm, rms_norm
from jds.ops.paging import RecordFormat, write_records
from jds.ops.quant import act_quant
from jds.ops.rope import rope_part

F32 = jnp.float32


def kv_insert_v32_xla(kv, index_k, cos, sin, slot_mapping, kv_cache, index_cache, kv_norm_w, k_norm_w, k_norm_b,
                      *, kv_format: RecordFormat, index_format: RecordFormat, eps: float, dtype,
                      indexer_interleave: bool, hadamard: bool):
    """kv [T, kv_lora + rope] and index_k [T, Di] (activation dtype, before norms) -> (kv cache, index cache).

    The cache half of V3.2's ``prepare``: latent RMSNorm + interleaved RoPE on k_pe into the MLA cache;
    indexer key LayerNorm -> RoPE on the first rope dims -> (Hadamard) into the indexer cache."""
    rd = 2 * cos.shape[-1]
    lat = kv.shape[-1] - rd
    c = rms_norm(kv[:, :lat], kv_norm_w, eps, dtype)
    k_pe = rope_part(kv[:, lat:], cos, sin, rope_dim=rd, first=False, interleaved=True)
    kv_cache = write_records(kv_cache, kv_format, slot_mapping, jnp.concatenate([c, k_pe], -1))
    ki = layer_norm(index_k, k_norm_w, k_norm_b, eps, dtype)
    ki = rope_part(ki, cos, sin, rope_dim=rd, first=True, interleaved=indexer_interleave)
    ki = prepare_indexer_k(ki, hadamard=hadamard, dtype=dtype)
    index_cache = write_records(index_cache, index_format, slot_mapping, ki)
    return kv_cache, index_cache


def q_v32_xla(q, index_q, index_w, cos, sin, *, nope_dim: int, dtype, indexer_interleave: bool, hadamard: bool,
              fp8: bool, scale_fmt: str = "ue8m0"):
    """q [T, H, nope + rd] and index_q [T, Hi, Di] (``dtype``, after wq_b), index_w [T, Hi] float32 ->

    (q_pe [T, H, rd] roped, index_q [T, Hi, Di] e4m3 (``fp8``) or ``dtype``, index_scale [T, Hi] float32
    (1 without ``fp8``), index_w [T, Hi] float32 = w * Di^-1/2 * Hi^-1/2 * index_scale).
    Dequantised q = index_q * index_scale is what jds.ops.indexer.prepare_indexer_q returns."""
    rd = 2 * cos.shape[-1]
    hi, di = index_q.shape[1:]
    q_pe = rope_part(q[..., nope_dim:], cos, sin, rope_dim=rd, first=False, interleaved=True)
    qi = rope_part(index_q, cos, sin, rope_dim=rd, first=True, interleaved=indexer_interleave).astype(dtype)
    if hadamard:
        qi = hadamard_rotate(qi)
    wf = fold_index_weights(index_w, di, hi)
    if fp8:
        qi, s = act_quant(qi, di, scale_fmt, 1e-4)
        s = s[..., 0]
        return q_pe, qi, s, wf * s
    return q_pe, qi, jnp.ones(wf.shape, F32), wf


def qnorm_rope_kv_insert_v4_xla(q, kv, cos, sin, slot_mapping, window_cache, kv_norm_w, *,
                                window_format: RecordFormat, eps: float, dtype):
    """(q normed + roped [T, H, D] in ``dtype``, updated window cache): the q / window half of V4's
    ``prepare`` (weightless per-head RMSNorm on q; window K = V, written before attention reads it)."""
    rd = 2 * cos.shape[-1]
    q = rms_norm(q, None, eps, dtype)
    q = rope_part(q, cos, sin, rope_dim=rd, first=False, interleaved=True)
    k = rope_part(rms_norm(kv, kv_norm_w, eps, dtype), cos, sin, rope_dim=rd, first=False, interleaved=True)
    return q, write_records(window_cache, window_format, slot_mapping, k)
