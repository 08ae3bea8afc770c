"""DeepSeek-V4's multi-token-prediction (MTP) module: from the main model's final hidden streams at position p and
the embedding of token p+1 it predicts token p+2, as a cheap draft for speculative decoding.

Why a module of its own: the released checkpoints carry it (``mtp.0.*``) and a serving engine drafts with it; it
is one more V4 block (``jds.model.V4DecoderLayer``: hyper-connections, V4 attention with its own paged cache, the
V4 MoE) with an input mixer in front and its own stream reduction behind, sharing the embedding and the LM head
with the main model. V3.2 and V4 share primitives and differ by parameters: nothing here copies a layer.

Release facts (DeepSeek-V4-Flash ``inference/``, read in the public mirror ``Mockingjay1316/deepseek-v4-flash-spark``
at commit 0825add, the first with real files; every fact checked against the V4-Pro copy
``Nicooo-Wang/DeepSeek-V4-Pro-code`` at HEAD 2074660, whose line numbers follow as "Pro"; no code copied):

* Count: ``ModelArgs.n_mtp_layers = 1`` (model.py:48; Pro model.py:60); the HF config.json key is
  ``num_nextn_predict_layers`` (Pro top-level config.json:31, value 1; vLLM's ``deepseek_v4_mtp.py`` reads the
  same key). ``Transformer.__init__`` builds ``MTPBlock(args.n_layers + k, args)`` for k < n_mtp_layers
  (model.py:791-792; Pro 816-817) and sets each one's ``embed`` and ``head`` to the main model's
  (model.py:793-794; Pro 818-819): the embedding and the LM head weight are SHARED, not stored again.
* Layer kind: ``MTPBlock`` subclasses ``Block`` (model.py:739), so it is a whole V4 layer with layer id
  n_layers + k. Its attention kind is ``compress_ratios[n_layers + k]`` (model.py:453; Pro 473): the released
  lists have n_layers + 1 entries and the last is 0 (Flash inference/config.json:5 ``n_layers`` 43, :34 44
  ratios ending in 0; Pro config.json:66 62 ratios for 61 layers ending in 0), i.e. the MTP layer is
  WINDOW-ONLY attention (no compressor, no indexer), with window RoPE (model.py:479: base rope_theta, no YaRN).
  Its router is score-routed with a selection bias (``Gate.hash = layer_id < n_hash_layers``, model.py:556;
  Pro 576; n_layers + k >= n_hash_layers). Its attention owns its own KV buffer (``Attention.kv_cache``,
  model.py:473-474, written at ``start_pos % window`` in decode, :530): the MTP has its own cache.
* Tensors (``mtp.{k}.`` + name; shapes for d = dim, hc = hc_mult): ``e_proj`` / ``h_proj`` [d, d] are plain
  ``Linear(dim, dim)`` (model.py:743-744; Pro 768-769) in the default dtype, i.e. FP8 e4m3 + ``.scale`` in an FP8
  checkpoint (model.py:130, :777); ``enorm`` / ``hnorm`` / ``norm`` RMSNorm [d] (model.py:745-747);
  ``hc_head_fn`` [hc, hc*d], ``hc_head_base`` [hc], ``hc_head_scale`` [1] float32 (model.py:750-753; Pro 775-778);
  and every ``Block`` tensor under the same names as a main layer (``attn.*``, ``attn_norm``, ``ffn_norm``,
  ``hc_attn_{fn,base,scale}``, ``hc_ffn_*``, ``ffn.gate.{weight,bias}``, ``ffn.experts.j.w{1,2,3}`` (FP4 when
  ``expert_dtype`` is fp4), ``ffn.shared_experts.w{1,2,3}``). No fused ``eh_proj`` (V3's name) exists.
  convert.py drops any ``mtp.*`` tensor whose name contains ``emb`` or ends in ``head.weight`` (convert.py:105,
  the same line in Pro): copies of the shared embedding / head are not loaded. Corroboration (third party, not
  authority): a loader's census of the real V4-Flash shard ``model-00046-of-00046.safetensors`` counts 1575
  tensors, all ``mtp.0.*``: exactly the list above for window-only attention (wq_a, wkv, wq_b, wo_a, wo_b +
  scales, q_norm, kv_norm, attn_sink; no compressor / indexer), 256 experts x 3 x (weight, scale), and no
  embedding or head; e_proj / h_proj F8_E4M3 [4096, 4096] with F8_E8M0 [32, 32] scales.
* Input: ``MTPBlock.forward(x, start_pos, input_ids)`` with x the main model's hidden STREAMS [b, s, hc, d]
  (model.py:758-759, comment "x: [b,s,hc,d]"; the streams before the head's HC reduction, which is also what
  vLLM's drafter passes: "pre-hc_head residual"): ``e = enorm(embed(input_ids))``, ``x = hnorm(x)`` (per stream,
  over d), ``x = e_proj(e).unsqueeze(2) + h_proj(x)`` (model.py:761-764; Pro 786-789): the projected embedding
  is added to every stream. The pairing (stream of position p, token p+1) is the DeepSeek-V3 MTP scheme that
  vLLM's proposer implements (target hidden at p, input ids shifted left by one, the last the sampled token).
* Output: ``super().forward(x, start_pos, input_ids)`` (the Block; model.py:765), then
  ``self.head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm)`` (model.py:766; Pro 791):
  the SHARED head's weight with the MTP's OWN HC reduction and final norm; ``get_logits`` keeps the last
  position only (model.py:716-717). So the logits at row p are for token p+2.
* Not in the release: the MTP is never called by generate.py (neither copy); vLLM zeroes the embedding at
  position 0 (``deepseek_v4_mtp.py``, "masking inputs at position 0"), which the release's forward does not do:
  jds follows the release.

jds mapping: ``Decoder.mtp`` is an ``nnx.List`` of ``MTPModule`` (``ModelConfig.mtp_layers``), so parameter names
are ``mtp.{k}.e_proj`` (+ ``.scale``), ``mtp.{k}.enorm`` / ``hnorm`` / ``norm``, ``mtp.{k}.hc_head.{fn,base,scale}``
and the V4 layer's own names (``mtp.{k}.attn.wq_a``, ``mtp.{k}.hc_attn.fn``, ``mtp.{k}.ffn.w1`` ...);
``jds.hf_import`` maps them from / to the release's names. The layer id (attention kind, router kind) is
``ModelConfig.mtp_layer_id(k)`` = the k-th of the last ``mtp_layers`` compress_ratios entries.

What a speculative-decoding engine must pass (one draft token per step, MTP depth 0):
* The MTP runs in the same step, right after the main model, over the main step's tokens at the SAME positions
  with the SAME ``PagedBatch`` geometry (positions, req_idx, block_tables, seq_lens; its own page pool arrays,
  ``init_cache``, sharing the main model's page ids: one block table serves both): row t pairs the main model's
  final hidden streams at position p_t (``Decoder.forward_hidden(...)[0].streams[t]``, before the head) with
  ``next_tokens[t]`` = the token at position p_t + 1 (within a prompt chunk: the next prompt token, including
  the first token of the next chunk; for the last token of a request: the token just sampled / accepted).
  Its logits at row t are the draft for position p_t + 2; ``logits_indices`` selects the rows wanted (the last
  accepted row of each request).
* Cache slots: the MTP writes its window cache at ``batch.slot_mapping[t]``, i.e. the slot of position p_t (slot
  -1 = padding writes nothing). A token at position p reads MTP entries of positions p-window+1..p only.
* Verification step with a draft d for position q+2 (main model runs [t_{q+1}, d] at q+1, q+2): run the MTP
  AFTER verification over the ACCEPTED positions only: accepted: rows (q+1, next d), (q+2, next = the bonus
  token); rejected: row (q+1, next = the corrected token) only, the hidden of q+2 is discarded. Then the MTP
  cache never holds a rejected token's entry. If an engine runs the MTP over a fixed shape anyway, a rejected
  row's entry (at position q+2) is harmless only because it is rewritten when position q+2 is processed again
  with the accepted token before any later position reads it: never let a step read position q+2 from the MTP
  cache before that rewrite (give such rows slot -1 instead). The main model's own cache entries of a rejected
  draft are likewise overwritten when that position is recomputed (the window slot, a compressor state row, a
  closing compressed entry are all keyed by position).
* Deeper drafts (several tokens per step) would feed ``MTPOutput.streams`` back as the next call's hidden (what
  vLLM does with one MTP layer); the release trains one MTP layer, so a second draft token is out of training
  distribution. Not done here: the engine's scheduling and the verification. ``jds.sharding`` lays the
  ``mtp/N/`` parameters out like a layer's (untested on a mesh with an MTP module).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jds.batch import PagedBatch
from jds.config import ModelConfig
from jds.model import DecoderLayer, V4DecoderLayer, V4Embedding, V4Head, V4Hidden, v4_block_config
from jds.nn import Linear, RMSNorm, jdtype
from jds.v4 import V4Cache
from jds.v4_block import HCHead

__all__ = ["MTPModule", "MTPOutput"]


class MTPOutput(NamedTuple):
    """``logits`` [S, vocab] float32 (the drafts for positions p+2 of the rows ``logits_indices``), ``cache`` the
    MTP's updated cache, ``streams`` [T, hc, d] its output streams before the HC head (input of a deeper draft)."""

    logits: jax.Array
    cache: V4Cache
    streams: jax.Array


class MTPModule(V4DecoderLayer):
    """One MTP module (the release's ``MTPBlock``): a V4 decoder layer plus ``enorm`` / ``hnorm`` / ``e_proj`` /
    ``h_proj`` in front and ``hc_head`` / ``norm`` behind; the embedding and the LM head are the caller's.

    Being a ``V4DecoderLayer`` it keeps that interface (``pre_attention`` / ``attn`` stages / ``post_attention`` on
    a ``V4Hidden``) for a runner that splits it; ``__call__`` is the whole MTP step."""

    def __init__(self, cfg: ModelConfig, depth: int, implementation: str, rngs: nnx.Rngs,
                 indexer_config: Any = None):
        if cfg.block != "v4":
            raise ValueError(f"block: the MTP module is DeepSeek-V4's (block 'v4'), got {cfg.block!r}")
        self.depth = depth
        super().__init__(cfg, cfg.mtp_layer_id(depth), implementation, rngs, indexer_config)
        d, eps, dt = cfg.hidden_size, cfg.attn.rms_norm_eps, jdtype(cfg.numerics.dtype)
        fp8, fmt = cfg.numerics.fp8_linear, cfg.numerics.act_scale_fmt
        self.hc_mult = cfg.hc_mult
        self.enorm = RMSNorm(d, eps=eps, rngs=rngs)
        self.hnorm = RMSNorm(d, eps=eps, rngs=rngs)
        # plain Linear(dim, dim) in the release: FP8 in an FP8 checkpoint, like the attention's linears
        self.e_proj = Linear(d, d, dtype=dt, fp8=fp8, rngs=rngs, scale_fmt=fmt)
        self.h_proj = Linear(d, d, dtype=dt, fp8=fp8, rngs=rngs, scale_fmt=fmt)
        self.hc_head = HCHead(v4_block_config(cfg), rngs)
        self.norm = RMSNorm(d, eps=eps, rngs=rngs)

    def init_cache(self, num_blocks: int) -> V4Cache:
        """The MTP's own paged caches (window-only in the release: only ``window`` is non-empty)."""
        return self.attn.init_cache(num_blocks)

    def combine(self, hidden_streams: jax.Array, next_tokens: jax.Array, embed: V4Embedding) -> V4Hidden:
        """The block's input streams: e_proj(enorm(embed(t_{p+1}))) added to h_proj(hnorm(stream_j)) of every stream
        j (each projection rounded to the activation dtype, their sum rounded once, as the release's bf16 add)."""
        t, hc, d = hidden_streams.shape
        if hc != self.hc_mult or d != self.cfg.hidden_size:
            raise ValueError(f"hidden_streams must be [T, {self.hc_mult}, {self.cfg.hidden_size}], got "
                             f"{hidden_streams.shape}")
        if next_tokens.shape != (t,):
            raise ValueError(f"next_tokens must be [T={t}] (one token p+1 per hidden row p), got {next_tokens.shape}")
        tokens = next_tokens.astype(jnp.int32)
        dt = hidden_streams.dtype
        e = self.e_proj(self.enorm(embed.weight[...][tokens]))  # [T, d]
        h = self.h_proj(self.hnorm(hidden_streams))  # [T, hc, d], per stream
        x = e[:, None, :].astype(jnp.float32) + h.astype(jnp.float32)
        return V4Hidden(x.astype(dt), tokens)

    def logits(self, streams: jax.Array, logits_indices: jax.Array, head: V4Head) -> jax.Array:
        """The MTP's own HC reduction and norm, then the shared LM head: [S, vocab] float32."""
        return head.lm_head(self.norm(self.hc_head(streams[logits_indices])), jnp.float32)

    def __call__(self, hidden_streams: jax.Array, next_tokens: jax.Array, batch: PagedBatch, cache: V4Cache,
                 embed: V4Embedding, head: V4Head, logits_indices: jax.Array) -> MTPOutput:
        """One MTP step over the rows of ``batch``: row t = (main model's final streams at position p_t, token
        p_t + 1); writes the MTP cache at p_t's slot; logits of ``logits_indices`` rows predict token p_t + 2."""
        h = self.combine(hidden_streams, next_tokens, embed)
        if not isinstance(h.streams, jax.core.Tracer):
            self.attn.check_inputs(h.streams[:, 0], batch, cache)
        h, cache = DecoderLayer.__call__(self, h, batch, cache)
        return MTPOutput(self.logits(h.streams, logits_indices, head), cache, h.streams)
