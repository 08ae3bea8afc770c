"""DeepSeek-V4 attention: sliding window + compressed KV (C4 with lightning indexer, C128) + attention sink,
MQA with one shared 512-d K = V and a grouped low-rank output projection, over paged caches.

One class serves the three layer kinds, chosen by ``ratio = cfg.compress_ratios[layer_id]``:
0 = window only, 4 = window + indexer top-k of the C4 entries, 128 = window + every visible C128 entry.

Stages (the same cut as jds.v32; the boundary runner jits them separately):
  project_in   x -> [q latent ; kv] (one fused GEMM), compressor kv/gate (fp32), indexer head weights
  prepare      norms, RoPE, window-cache insert, compressor state save + compressed inserts, indexer q prep
  select       C4: indexer scores over the request's compressed indexer keys + top-k  (eager in vLLM)
  attend       sparse MQA over window + compressed candidates with the sink, then the inverse RoPE of
               the output at p (vLLM fuses it into o_proj; here it is attend's epilogue so that
               project_out(o) keeps V3.2's signature)                                 (eager in vLLM)
  project_out  grouped wo_a (block-diagonal batched einsum), wo_b
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jds.attention import AttentionResult, Implementation, Indexer, Query, StagedAttention, resolve_implementation
from jds.batch import PagedBatch
from jds.config import Numerics, V4Config
from jds.nn import FusedLinear, Linear, RMSNorm, jdtype, norm_into
from jds.ops.quant import QuantizedRows, dequant_weight_blocks, quantize_weight_blocks_jax
from jds.ops import compressor as comp
from jds.ops.indexer import prepare_indexer_q, prepare_indexer_q8
from jds.ops.paging import RecordFormat, global_slots
from jds.ops.records import FloatRows, MlaRecord584
from jds.ops.rope import cached_inv_freqs, rope_cos_sin, rope_part
from pallas_kernels.compressor_pool import insert_entries, insert_index_keys, pool_norm_rope, write_state
from pallas_kernels.fused_insert_v4 import fused_qnorm_rope_kv_insert_v4
from pallas_kernels.sparse_mqa import sparse_mqa

__all__ = ["V4Attention", "V4Cache", "V4Inputs", "V4Query", "V4Compressor", "AttentionResult"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class V4Cache:
    """All paged caches of one V4 layer, [num_blocks, page_elems] each; kinds without a cache hold
    [num_blocks, 0] arrays (so every layer's cache is the same pytree structure)."""

    window: jax.Array  # window K=V, one record per token slot (every kind)
    compressed: jax.Array  # main compressed entries, block_size // ratio per page (C4, C128)
    state: jax.Array  # main compressor fp32 state, one row per token slot (C4, C128)
    index_k: jax.Array  # indexer compressed keys, block_size // 4 per page (C4)
    index_state: jax.Array  # indexer compressor fp32 state, one row per token slot (C4)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class V4Inputs:
    """Outputs of the input projections (absent parts are [T, 0])."""

    # [T, >= q_lora + head_dim]: the fused input projection's output, whole (its parts by
    # ``V4Attention.wq_a_wkv.row_ranges()``: the q latent before q_norm, kv before kv_norm / RoPE). Whole, because
    # the window insert reads kv in place: sliced out, it would be a copy before the kernel
    proj: jax.Array
    comp: jax.Array  # [T, 2*c*head_dim] fp32 main compressor [kv | gate]
    index_comp: jax.Array  # [T, 4*index_head_dim] fp32 indexer compressor [kv | gate]
    index_w: jax.Array  # [T, Hi] fp32 indexer head weights


V4Query = Query  # q, index_q, index_w: see jds.attention.Query


class V4Compressor(nnx.Module):
    """Parameters of one compressor: wkv/wgate [c*d, hidden] (fp32 output), ape [ratio, c*d], norm [d].

    wkv and wgate share x: stored as one [2*c*d, hidden] weight (exported / loaded as the checkpoint's wkv and
    wgate), so that the step runs one GEMM on it as stored instead of concatenating the two weights every call.
    ``dtype``: the weight's (``compressor_dtype``)."""

    def __init__(self, hidden: int, d: int, ratio: int, eps: float, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        c = comp.overlap_factor(ratio)
        self.d, self.ratio = d, ratio
        self.wkv_wgate = FusedLinear(hidden, (("wkv", c * d), ("wgate", c * d)), dtype=dtype, fp8=False, rngs=rngs)
        self.ape = nnx.Param(0.5 * jax.random.normal(rngs.params(), (ratio, c * d), jnp.float32))
        self.norm = RMSNorm(d, eps=eps, rngs=rngs)

    def project(self, x: jax.Array) -> jax.Array:
        """x [T, hidden] -> [kv | gate] [T, 2*c*d] fp32: x in the weight's dtype (a bf16 x is exact in either),
        fp32 accumulation."""
        return self.wkv_wgate(x, jnp.float32)


def compressor_dtype(numerics: Numerics) -> jnp.dtype:
    """The compressors' weight dtype: float32 with ``Numerics.compressor_float32`` or float32 activations, else the
    activation dtype (bf16: their GEMMs on the tensor cores, where float32 ones ran on the CUDA cores)."""
    return jnp.dtype(jnp.float32) if numerics.compressor_float32 else jdtype(numerics.dtype)


class V4Indexer(Indexer):
    """Key side: one key per 4 tokens, from its own 4:1 compressor."""

    def __init__(self, cfg: V4Config, numerics: Numerics, rngs: nnx.Rngs):
        self.wq_b = self._wq_b(cfg, numerics, rngs)
        self.weights_proj = self._weights_proj(cfg, numerics, rngs)
        self.compressor = V4Compressor(cfg.hidden_size, cfg.index_head_dim, 4, cfg.rms_norm_eps, rngs,
                                       compressor_dtype(numerics))


class V4Attention(StagedAttention):
    """Hooks: the caches of this layer kind (``cache_formats``); the indexer (C4 layers only) keys one
    compressed entry per 4 tokens, so a token sees (p + 1) // 4 of them."""

    cache_type = V4Cache

    def __init__(self, cfg: V4Config, numerics: Numerics, layer_id: int, *, rngs: nnx.Rngs,
                 implementation: Implementation = "auto", indexer_config: Any = None):
        implementation = resolve_implementation(implementation)
        self.indexer_config = indexer_config  # pallas_kernels.sparse_indexer.IndexerKernelConfig; None: default
        if not 0 <= layer_id < cfg.n_layers:
            raise ValueError(f"layer_id {layer_id} outside [0, {cfg.n_layers})")
        if numerics.act_scale_fmt != "ue8m0":  # V4's records store e8m0 scale exponents; its checkpoints are ue8m0
            raise ValueError(f"numerics.act_scale_fmt={numerics.act_scale_fmt!r}: DeepSeek-V4 quantises activations "
                             "with 'ue8m0' scales only")
        self.cfg, self.numerics, self.layer_id, self.implementation = cfg, numerics, layer_id, implementation
        self.ratio = int(cfg.compress_ratios[layer_id])
        dt, fp8 = jdtype(numerics.dtype), numerics.fp8_linear
        self.dtype = dt
        hd = cfg.head_dim
        # wq_a and wkv share x: stored fused (one GEMM), exported/loaded as the checkpoint's wq_a and wkv.
        self.wq_a_wkv = FusedLinear(cfg.hidden_size, (("wq_a", cfg.q_lora_rank), ("wkv", hd)), dtype=dt, fp8=fp8,
                                    rngs=rngs)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps, rngs=rngs)
        self.kv_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, rngs=rngs)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.n_heads * hd, dtype=dt, fp8=fp8, rngs=rngs)
        # the release runs wo_a in bf16 (Numerics.wo_a_fp8 departs from it)
        self.wo_a = Linear((cfg.n_heads // cfg.o_groups) * hd, cfg.o_groups * cfg.o_lora_rank, dtype=dt,
                           fp8=fp8 and numerics.wo_a_fp8, rngs=rngs)
        if fp8 and not numerics.wo_a_fp8:
            # random weights as a released checkpoint's: e4m3 with power-of-two block scales, dequantised to bf16
            # (exactly: q * 2^k fits bf16), so a synthetic FP8 export of this model converts back bit for bit
            wq, ws = quantize_weight_blocks_jax(self.wo_a.weight[...], fmt="ue8m0")
            self.wo_a.weight = nnx.Param(dequant_weight_blocks(wq, ws).astype(dt))
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, dtype=dt, fp8=fp8, rngs=rngs)
        self.attn_sink = nnx.Param(jax.random.normal(rngs.params(), (cfg.n_heads,), jnp.float32))
        if self.ratio:
            self.compressor = V4Compressor(cfg.hidden_size, hd, self.ratio, cfg.rms_norm_eps, rngs,
                                           compressor_dtype(numerics))
        if self.has_indexer:
            self.indexer = V4Indexer(cfg, numerics, rngs)

    @property
    def has_indexer(self) -> bool:
        return self.ratio == 4

    @property
    def index_entries_per_page(self) -> int:
        return self.cfg.block_size // 4

    def visible_keys(self, positions: jax.Array) -> jax.Array:
        return (positions + 1) // 4

    # ----- cache formats -------------------------------------------------------------------------
    def _kv_format(self, entries_per_page: int) -> RecordFormat:
        cfg, n = self.cfg, self.numerics
        if n.kv_cache_dtype == "fp8":
            return MlaRecord584(entries_per_page, cfg.head_dim - cfg.rope_head_dim, cfg.rope_head_dim,
                                cfg.quant_block)
        return FloatRows(cfg.head_dim, entries_per_page, jdtype(n.kv_cache_dtype))

    @property
    def window_format(self) -> RecordFormat:
        return self._kv_format(self.cfg.block_size)

    @property
    def compressed_format(self) -> RecordFormat:
        return self._kv_format(self.cfg.block_size // self.ratio)

    def cache_formats(self) -> dict[str, RecordFormat]:
        """Record format of each V4Cache field this layer kind has (the others are [num_blocks, 0])."""
        cfg = self.cfg
        fmts: dict[str, RecordFormat] = dict(window=self.window_format)
        if self.ratio:
            fmts.update(compressed=self.compressed_format,
                        state=comp.state_format(self.ratio, cfg.head_dim, cfg.block_size))
        if self.has_indexer:
            fmts.update(index_k=self.index_format, index_state=comp.state_format(4, cfg.index_head_dim, cfg.block_size))
        return fmts

    # ----- forward ----------------------------------------------------------------------------------
    def input_linears(self) -> tuple[Linear, ...]:
        """The linears that read the normed hidden state as ``project_in``'s ``xq``."""
        return (self.wq_a_wkv,)

    def project_in(self, x: jax.Array, xq: jax.Array | QuantizedRows | None = None) -> V4Inputs:
        """``xq``: x as the input linears take it (quantised by the norm: ``jds.nn.norm_into``); None: x."""
        x = x.astype(self.dtype)
        t = x.shape[0]
        none = jnp.zeros((t, 0), jnp.float32)
        proj = self.wq_a_wkv(x if xq is None else xq, padded=True)
        c = self.compressor.project(x) if self.ratio else none
        if self.has_indexer:
            ic = self.indexer.compressor.project(x)
            iw = self.indexer.head_weights(x)
        else:
            ic, iw = none, none
        return V4Inputs(proj=proj, comp=c, index_comp=ic, index_w=iw)

    def prepare(self, inp: V4Inputs, batch: PagedBatch, cache: V4Cache) -> tuple[V4Query, V4Cache]:
        cfg, dt, rd = self.cfg, self.dtype, self.cfg.rope_head_dim
        freqs = self._freqs()
        cos, sin = rope_cos_sin(freqs, batch.positions)
        # query: q_norm -> wq_b -> weightless per-head RMSNorm -> RoPE (last dims, interleaved)
        (_, q0, q1), (_, k0, _) = self.wq_a_wkv.row_ranges()
        # q_norm, quantised once for wq_b (and the indexer's wq_b) where they are FP8
        readers = (self.wq_b, self.indexer.wq_b) if self.has_indexer else (self.wq_b,)
        _, qr = norm_into(self.q_norm, inp.proj, readers, col=q0, width=q1 - q0, want_y=False, out_dtype=dt)
        q = self.wq_b(qr).reshape(-1, cfg.n_heads, cfg.head_dim)
        # ... and the window K = V (read in place from the projection), inserted before attention reads it (a
        # query sees itself): one op
        q, window = fused_qnorm_rope_kv_insert_v4(q, inp.proj, cos, sin, batch.slot_mapping, cache.window,
                                                  self.kv_norm.weight[...], window_format=self.window_format,
                                                  eps=cfg.rms_norm_eps, dtype=dt, implementation=self.op_implementation,
                                                  kv_col=k0)
        t = q.shape[0]
        compressed, state, index_k, index_state = cache.compressed, cache.state, cache.index_k, cache.index_state
        index_q, index_w = jnp.zeros((t, 0, 0), jnp.float32), jnp.zeros((t, 0), jnp.float32)
        index_q_scale = None
        if self.ratio:
            state, e, slots = self._compress(self.compressor, state, inp.comp, batch)
            compressed = insert_entries(compressed, e, slots, fmt=self.compressed_format,
                                        implementation=self.op_implementation)
        if self.has_indexer:
            index_state, e, slots = self._compress(self.indexer.compressor, index_state, inp.index_comp, batch)
            index_k = insert_index_keys(index_k, e, slots, fmt=self.index_format,
                                        hadamard=self.numerics.indexer_hadamard, dtype=dt,
                                        implementation=self.op_implementation)
            qi = rope_part(self.indexer.project_q(qr, cfg), cos, sin, rope_dim=rd, first=False, interleaved=True)
            kw = dict(head_dim=cfg.index_head_dim, n_heads=cfg.index_n_heads, hadamard=self.numerics.indexer_hadamard,
                      dtype=dt)
            if self.numerics.indexer_fp8 and not self.numerics.indexer_fp4:  # q as quantised, scales apart
                index_q, index_q_scale, index_w = prepare_indexer_q8(qi, inp.index_w, **kw)
            else:
                index_q, index_w = prepare_indexer_q(qi, inp.index_w, fp8=self.numerics.indexer_fp8,
                                                     fp4=self.numerics.indexer_fp4, **kw)
        new = V4Cache(window=window, compressed=compressed, state=state, index_k=index_k, index_state=index_state)
        return V4Query(q=q, index_q=index_q, index_w=index_w, index_q_scale=index_q_scale), new

    def attend(self, query: V4Query, topk: jax.Array, batch: PagedBatch, cache: V4Cache) -> jax.Array:
        """One sparse MQA over [window | compressed] candidates with the sink, then inverse RoPE at p:
        [T, H * head_dim] in the activation dtype."""
        cfg, p = self.cfg, batch.positions
        w_local = p[:, None] - cfg.window_size + 1 + jnp.arange(cfg.window_size, dtype=jnp.int32)
        w_local = jnp.where(w_local >= 0, w_local, -1)
        w_slots = global_slots(batch.block_tables, batch.req_idx, w_local, cfg.block_size)
        lists = [(cache.window, self.window_format, w_slots)]  # (cache, format, slots); slot -1 = masked
        if self.ratio:
            if self.ratio == 4:
                c_local = topk[:, : min(topk.shape[1], self._max_entries(batch))]  # static -1 tail cut
            else:
                n = self._max_entries(batch)
                c_local = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (p.shape[0], n))
                c_local = jnp.where(c_local < ((p + 1) // self.ratio)[:, None], c_local, -1)
            c_slots = global_slots(batch.block_tables, batch.req_idx, c_local, cfg.block_size // self.ratio)
            lists.append((cache.compressed, self.compressed_format, c_slots))
        caches, fmts, slots = (list(x) for x in zip(*lists))
        # window + compressed in one softmax, with the sink
        o = sparse_mqa(query.q, caches, fmts, slots, scale=cfg.softmax_scale, v_dim=cfg.head_dim,
                       sink=self.attn_sink[...], out_dtype=self.dtype, implementation=self.op_implementation)
        # epilogue: inverse RoPE at p on the last dims (kept here, where positions are at hand, so that
        # project_out(o) has the same signature as V3.2's and the model/runner treat both alike)
        cos, sin = rope_cos_sin(self._freqs(), p)
        o = rope_part(o, cos, sin, rope_dim=cfg.rope_head_dim, first=False, interleaved=True, inverse=True)
        return o.reshape(o.shape[0], -1)

    def project_out(self, o: jax.Array) -> jax.Array:
        """o [T, H*head_dim] (already inverse-RoPE'd by attend) -> grouped wo_a (block-diagonal) -> wo_b."""
        cfg = self.cfg
        og = o.reshape(o.shape[0], cfg.o_groups, (cfg.n_heads // cfg.o_groups) * cfg.head_dim)
        z = self.wo_a.grouped(og)
        return self.wo_b(z.reshape(z.shape[0], -1))

    # ----- helpers ----------------------------------------------------------------------------------
    def _freqs(self) -> np.ndarray:
        return cached_inv_freqs(self.cfg.rope_for(self.ratio), self.cfg.rope_head_dim)

    def _max_entries(self, batch: PagedBatch) -> int:
        """Static candidate width: entries a block-table row can address."""
        return batch.block_tables.shape[1] * (self.cfg.block_size // self.ratio)

    def _compress(self, mod: V4Compressor, state: jax.Array, proj: jax.Array, batch: PagedBatch
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Save the step's compressor state, then emit the entries of every block its tokens close: (state,
        entries [max_out, d] normed and roped, compressed-cache slots with -1 for unused rows)."""
        cfg, r, bt, impl = self.cfg, mod.ratio, batch.block_tables, self.op_implementation
        state = write_state(state, proj, mod.ape[...], batch.positions, batch.slot_mapping, ratio=r, d=mod.d,
                            block_size=cfg.block_size, implementation=impl)
        req, block = comp.closing_blocks(batch.positions, batch.req_idx, batch.slot_mapping, r,
                                         comp.max_closing(batch.positions.shape[0], bt.shape[0], r))
        cos, sin = comp.entry_rope(self._freqs(), block, r)
        entries = pool_norm_rope(state, bt, req, block, mod.norm.weight[...], cos, sin, ratio=r, d=mod.d,
                                 block_size=cfg.block_size, eps=cfg.rms_norm_eps, dtype=self.dtype,
                                 implementation=impl)
        return state, entries, global_slots(bt, req, block, cfg.block_size // r)

    def check_extra(self, batch: PagedBatch) -> None:
        """The compressor's static bound on block-closing tokens (each request's tokens at consecutive
        positions)."""
        if self.ratio:
            pos, slot = np.asarray(batch.positions), np.asarray(batch.slot_mapping)
            n = int((((pos + 1) % self.ratio == 0) & (slot >= 0)).sum())
            bound = comp.max_closing(pos.shape[0], batch.block_tables.shape[0], self.ratio)
            if n > bound:
                raise ValueError(f"batch closes {n} compressor blocks but at most {bound} fit the static bound "
                                 "(each request's tokens must be consecutive positions)")
