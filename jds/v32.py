"""DeepSeek-V3.2 attention: MLA + lightning indexer + top-k sparse attention, over paged caches.

Stages (the boundary runner in jds/runner.py cuts between them):
  project_in   x -> raw q latent, raw kv (latent + rope key), raw indexer key, indexer head weights
  prepare      norms, RoPE, W_UK absorption, indexer q prep, and the MLA/indexer cache inserts
  select       indexer logits over each token's keys 0..p + top-k          (eager in vLLM)
  attend       sparse MQA over the selected cache rows, then W_UV           (eager in vLLM)
  project_out  wo
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jds.attention import Implementation, Indexer, Query, StagedAttention, resolve_implementation
from jds.batch import PagedBatch
from jds.config import Numerics, V32Config
from jds.nn import FusedLinear, Linear, LayerNorm, RMSNorm, jdtype, norm_into
from jds.ops.dispatch import on_gpu
from jds.ops.indexer import fold_index_weights
from jds.ops.paging import RecordFormat, global_slots, read_records
from jds.ops.records import FloatRows, MlaRecord656
from jds.ops.quant import QuantizedRows
from jds.ops.rope import cached_inv_freqs as _inv_freqs
from jds.ops.rope import rope_cos_sin
from pallas_kernels.fused_insert_v32 import fused_kv_insert_v32, fused_q_v32
from pallas_kernels.sparse_mqa import sparse_mqa

AttnForm = Literal["absorbed", "mha"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class V32Cache:
    kv: jax.Array  # MLA latent + rope key, one record per token
    index_k: jax.Array  # indexer keys, one record per token


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class V32Inputs:
    """Outputs of the input projections (always inside the captured region)."""

    # [T, >= q_lora + Di + kv_lora + rope]: the fused input projection's output, whole, with an FP8 weight's zero
    # rows (its parts, by ``V32Attention.wq_a_wk_wkv_a.row_ranges()``: the q latent before q_norm, the indexer
    # key before LayerNorm / RoPE, kv before kv_norm / RoPE). Whole, because the kv insert reads its parts in
    # place: sliced out (or trimmed), each would be a copy before the kernel
    proj: jax.Array
    index_w: jax.Array  # [T, Hi] float32 head weights


V32Query = Query  # q, q_rope (absorbed form), index_q, index_w: see jds.attention.Query


class V32Indexer(Indexer):
    """Key side: one key per token, ``wk`` then LayerNorm. ``wk`` shares x with wq_a and wkv_a, so its rows are
    stored in the layer's fused input projection (``V32Attention.wq_a_wk_wkv_a``), exported as ``indexer.wk``."""

    def __init__(self, cfg: V32Config, numerics: Numerics, rngs: nnx.Rngs):
        self.wq_b = self._wq_b(cfg, numerics, rngs)
        self.k_norm = LayerNorm(cfg.index_head_dim, eps=cfg.rms_norm_eps, rngs=rngs)
        self.weights_proj = self._weights_proj(cfg, numerics, rngs)


class AbsorbedHeads(nnx.Variable):
    """W_UK and W_UV [2, H, 128, kv_lora] in the activation dtype, dequantised from an FP8 ``wkv_b`` once
    (``V32Attention.hold_absorbed``). Derived, not a parameter: never exported, loaded or checkpointed."""


class V32Attention(StagedAttention):
    """The V3.2 hooks are the base's defaults: an indexer key per token, keys 0..p visible."""

    cache_type = V32Cache

    def __init__(self, cfg: V32Config, numerics: Numerics, *, rngs: nnx.Rngs, form: AttnForm = "absorbed",
                 implementation: Implementation = "auto", indexer_config: Any = None):
        if form not in ("absorbed", "mha"):
            raise ValueError(f"form must be 'absorbed' or 'mha', got {form!r}")
        if numerics.indexer_fp4:
            raise ValueError("numerics.indexer_fp4: DeepSeek-V3.2's indexer quantises to e4m3 (indexer_fp8); "
                             "the MXFP4 indexer is V4's")
        implementation = resolve_implementation(implementation)
        self.cfg, self.numerics, self.form, self.implementation = cfg, numerics, form, implementation
        self.indexer_config = indexer_config  # pallas_kernels.sparse_indexer.IndexerKernelConfig; None: default
        dt, fp8, sf = jdtype(numerics.dtype), numerics.fp8_linear, numerics.act_scale_fmt
        self.dtype = dt
        # wq_a, the indexer's wk and wkv_a share x: stored fused (one GEMM instead of three), exported / loaded as
        # the checkpoint's wq_a, indexer.wk and wkv_a (wkv_a's 576 rows last: with FP8 weights only the last part
        # may end inside a scale block). All three are replicated over ``tensor`` (jds.sharding).
        parts = (("wq_a", cfg.q_lora_rank), ("indexer.wk", cfg.index_head_dim), ("wkv_a", cfg.kv_record_dim))
        self.wq_a_wk_wkv_a = FusedLinear(cfg.hidden_size, parts, dtype=dt, fp8=fp8, rngs=rngs, scale_fmt=sf)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps, rngs=rngs)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.n_heads * cfg.qk_head_dim, dtype=dt, fp8=fp8, rngs=rngs, scale_fmt=sf)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=cfg.rms_norm_eps, rngs=rngs)
        self.wkv_b = Linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype=dt,
                            fp8=fp8, rngs=rngs, scale_fmt=sf)
        self.wo = Linear(cfg.n_heads * cfg.v_head_dim, cfg.hidden_size, dtype=dt, fp8=fp8, rngs=rngs, scale_fmt=sf)
        self.indexer = V32Indexer(cfg, numerics, rngs)
        self.absorbed: AbsorbedHeads | None = nnx.data(None)  # hold_absorbed (a runner's own copy of the model)

    # ----- cache formats -------------------------------------------------------------------------
    @property
    def kv_format(self) -> RecordFormat:
        n = self.numerics
        if n.kv_cache_dtype == "fp8":
            return MlaRecord656(self.cfg.block_size, n.latent_scale_fmt, self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim)
        return FloatRows(self.cfg.kv_record_dim, self.cfg.block_size, jdtype(n.kv_cache_dtype))

    def cache_formats(self) -> dict[str, RecordFormat]:
        return dict(kv=self.kv_format, index_k=self.index_format)

    # ----- forward ----------------------------------------------------------------------------------
    def input_linears(self) -> tuple[Linear, ...]:
        """The linears that read the normed hidden state as ``project_in``'s ``xq``."""
        return (self.wq_a_wk_wkv_a,)

    def project_in(self, x: jax.Array, xq: jax.Array | QuantizedRows | None = None) -> V32Inputs:
        """``xq``: x as the input linears take it (quantised by the norm: ``jds.nn.norm_into``); None: x."""
        x = x.astype(self.dtype)
        return V32Inputs(proj=self.wq_a_wk_wkv_a(x if xq is None else xq, padded=True),
                         index_w=self.indexer.head_weights(x))

    def prepare(self, inp: V32Inputs, batch: PagedBatch, cache: V32Cache) -> tuple[V32Query, V32Cache]:
        """Norms, RoPE, W_UK absorption and the indexer q prep; the MLA and indexer keys are inserted before
        attention reads them. Two ops (pallas_kernels/fused_insert_v32.py): the cache inserts and the q side."""
        cfg, dt, n = self.cfg, self.dtype, self.numerics
        impl = self.op_implementation
        cos, sin = rope_cos_sin(_inv_freqs(cfg.rope, cfg.qk_rope_head_dim), batch.positions)
        (_, q0, q1), (_, i0, _), (_, k0, _) = self.wq_a_wk_wkv_a.row_ranges()
        kv_cache, index_cache = fused_kv_insert_v32(
            inp.proj, inp.proj, cos, sin, batch.slot_mapping, cache.kv, cache.index_k, self.kv_norm.weight[...],
            self.indexer.k_norm.weight[...], self.indexer.k_norm.bias[...], kv_format=self.kv_format,
            index_format=self.index_format, eps=cfg.rms_norm_eps, dtype=dt,
            indexer_interleave=cfg.indexer_rope_interleave, hadamard=n.indexer_hadamard, implementation=impl,
            kv_col=k0, index_col=i0)
        # q_norm, quantised once for wq_b and the indexer's wq_b where they are FP8
        _, q_c = norm_into(self.q_norm, inp.proj, (self.wq_b, self.indexer.wq_b), col=q0, width=q1 - q0,
                           want_y=False, out_dtype=dt)
        q = self.wq_b(q_c).reshape(-1, cfg.n_heads, cfg.qk_head_dim)
        q_pe, qi, qs, _ = fused_q_v32(q, self.indexer.project_q(q_c, cfg), inp.index_w, cos, sin,
                                      nope_dim=cfg.qk_nope_head_dim, dtype=dt,
                                      indexer_interleave=cfg.indexer_rope_interleave, hadamard=n.indexer_hadamard,
                                      fp8=n.indexer_fp8, scale_fmt=n.act_scale_fmt, implementation=impl)
        q_nope = q[..., : cfg.qk_nope_head_dim]
        # absorbed: the latent q and the roped part apart (the sparse MQA reads both into one tile)
        q, q_rope = (self._absorb_uk(q_nope), q_pe) if self.form == "absorbed" else (
            jnp.concatenate([q_nope, q_pe], axis=-1), None)
        # V32Query keeps the e4m3 q with its scales (indexer_fp8) and the constant-scaled weights: the select
        # folds the scales into them itself (the op's 4th output is that product)
        index_q, index_q_scale = (qi, qs) if n.indexer_fp8 else (qi.astype(jnp.float32), None)
        index_w = fold_index_weights(inp.index_w, cfg.index_head_dim, cfg.index_n_heads)
        return (V32Query(q=q, index_q=index_q, index_w=index_w, q_rope=q_rope, index_q_scale=index_q_scale),
                V32Cache(kv=kv_cache, index_k=index_cache))

    def attend(self, query: V32Query, topk: jax.Array, batch: PagedBatch, cache: V32Cache) -> jax.Array:
        """Sparse attention over the selected keys; returns [T, H * v_head_dim] in the activation dtype."""
        cfg = self.cfg
        # at most block_tables.shape[1] * block_size keys exist in this step's bucket: the -1 padding
        # beyond that is static and would only be gathered and masked
        topk = topk[:, : min(topk.shape[1], batch.block_tables.shape[1] * cfg.block_size)]
        slots = global_slots(batch.block_tables, batch.req_idx, topk, cfg.block_size)
        if self.form == "absorbed":
            o_lat = sparse_mqa(query.q, (cache.kv,), (self.kv_format,), (slots,), scale=cfg.softmax_scale,
                               v_dim=cfg.kv_lora_rank, out_dtype=self.dtype, implementation=self.op_implementation,
                               q_rope=query.q_rope)
            o = self._apply_uv(o_lat.astype(self.dtype))
        else:
            o = self._mha(query.q, read_records(cache.kv, self.kv_format, slots), topk >= 0)
        return o.reshape(o.shape[0], -1).astype(self.dtype)

    def project_out(self, o: jax.Array) -> jax.Array:
        return self.wo(o)

    # ----- helpers ----------------------------------------------------------------------------------
    def hold_absorbed(self) -> None:
        """Hold W_UK and W_UV dequantised (``AbsorbedHeads``) where the absorbed form would otherwise dequantise
        an FP8 ``wkv_b`` every step (an FP8 read and a bf16 write of the whole weight a layer). For a runner's
        own copy of the model (``jds.runner``): the values follow ``wkv_b`` only as it is now."""
        if self.form == "absorbed" and self.wkv_b.fp8:
            self.absorbed = AbsorbedHeads(jnp.stack(self._dequant_heads()))

    def _wkv_b_heads(self) -> tuple[jax.Array, jax.Array]:
        """W_UK, W_UV [H, 128, kv_lora] in the activation dtype: held (``hold_absorbed``), else dequantised."""
        if self.absorbed is not None:
            w = self.absorbed[...]
            return w[0], w[1]
        return self._dequant_heads()

    def _dequant_heads(self) -> tuple[jax.Array, jax.Array]:
        """W_UK, W_UV from ``wkv_b``: an FP8 one dequantised and rounded to the activation dtype, as DeepSeek's
        reference does (``weight_dequant`` gives bf16)."""
        cfg = self.cfg
        w = self.wkv_b.dense_weight().astype(self.dtype)
        w = w.reshape(cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    def _per_head(self, spec: str, a: jax.Array, w: jax.Array) -> jax.Array:
        """A per-head matmul of operands in the activation dtype: exact products, fp32 sums, rounded once to it.
        On the GPU a bf16 dot (XLA's GPU dots sum bf16 products in fp32) on the tensor cores, where float32
        operands at precision HIGHEST ran on the CUDA cores; elsewhere the float32 dot of the same values (XLA's
        CPU backend sums a batched bf16 dot in bf16 and has none with an fp32 output)."""
        a = a.astype(self.dtype)
        if self.dtype == jnp.float32 or not on_gpu():
            hp = jax.lax.Precision.HIGHEST
            return jnp.einsum(spec, a.astype(jnp.float32), w.astype(jnp.float32), precision=hp).astype(self.dtype)
        return jnp.einsum(spec, a, w)

    def _absorb_uk(self, q_nope: jax.Array) -> jax.Array:
        """q_nope W_UK: the query's no-rope part in latent space [T, H, kv_lora]."""
        w_uk, _ = self._wkv_b_heads()
        return self._per_head("thd,hdc->thc", q_nope, w_uk)

    def _apply_uv(self, o_lat: jax.Array) -> jax.Array:
        _, w_uv = self._wkv_b_heads()
        return self._per_head("thc,hdc->thd", o_lat, w_uv)

    def _mha(self, q: jax.Array, rows: jax.Array, valid: jax.Array) -> jax.Array:
        """Prefill form: up-project every candidate latent with wkv_b (the fp8 GEMM re-quantises it)."""
        cfg = self.cfg
        c = rows[..., : cfg.kv_lora_rank].astype(self.dtype)
        k_pe = rows[..., cfg.kv_lora_rank:]
        kvb = self.wkv_b(c).reshape(c.shape[:2] + (cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim))
        k_nope, v = kvb[..., : cfg.qk_nope_head_dim], kvb[..., cfg.qk_nope_head_dim:]
        hp = jax.lax.Precision.HIGHEST
        nope = cfg.qk_nope_head_dim
        s = (jnp.einsum("thd,tkhd->thk", q[..., :nope].astype(jnp.float32), k_nope.astype(jnp.float32), precision=hp)
             + jnp.einsum("thr,tkr->thk", q[..., nope:].astype(jnp.float32), k_pe, precision=hp)) * cfg.softmax_scale
        s = jnp.where(valid[:, None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(valid.any(-1)[:, None, None], p, 0.0)
        return jnp.einsum("thk,tkhd->thd", p, v.astype(jnp.float32), precision=hp)
