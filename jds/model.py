"""The decoder the server runs: embedding -> L x [RMSNorm -> attention -> RMSNorm -> FFN] -> RMSNorm -> head.

With ``ModelConfig.block == "v4"`` the layers are DeepSeek-V4's block instead (``jds.v4_block``): the embedding
is repeated into ``hc_mult`` residual streams, every layer mixes them with hyper-connections around the V4
attention and the V4 MoE, and the head reduces the streams before its norm. The hidden state is then a
``V4Hidden`` (streams + token ids) wherever the V3-style decoder passes a [T, D] array.

Attention is V3.2 (every layer alike) or V4 (per-layer window-only / C4 / C128 from compress_ratios).
The FFN is a SwiGLU MLP or a DeepSeek-style MoE (sigmoid-scored routed top-k experts + a shared expert)
so step times carry the real structure. Weights are random from a seed unless loaded.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jds.batch import PagedBatch
from jds.config import ModelConfig, preset  # noqa: F401  (defined in jds.config; re-exported here)
from jds.nn import Linear, RMSNorm, jdtype, norm_into, swiglu_into
from pallas_kernels.fp8_grouped_gemm import fp8_grouped_linear
from jds.ops.dispatch import op_implementation
from jds.ops.quant import QuantizedRows, random_fp8_weight
from jds.v4_block import FP4Experts, HCHead, HyperConnection, V4Block, V4BlockConfig, expand_streams


class MLP(nnx.Module):
    def __init__(self, hidden: int, inter: int, dtype: jnp.dtype, fp8: bool, rngs: nnx.Rngs,
                 scale_fmt: str = "ue8m0"):
        self.w1 = Linear(hidden, inter, dtype=dtype, fp8=fp8, rngs=rngs, scale_fmt=scale_fmt)
        self.w3 = Linear(hidden, inter, dtype=dtype, fp8=fp8, rngs=rngs, scale_fmt=scale_fmt)
        self.w2 = Linear(inter, hidden, dtype=dtype, fp8=fp8, rngs=rngs, scale_fmt=scale_fmt)

    def __call__(self, x: jax.Array | QuantizedRows) -> jax.Array:
        """x [T, hidden] in the activation dtype, or quantised for FP8 ``w1`` / ``w3`` (``norm_into``). With an FP8
        ``w2`` the activation is quantised where it is made (``swiglu_into``)."""
        return self.w2(swiglu_into(self.w1(x), self.w3(x), self.w2))


class FP8Experts(nnx.Module):
    """A stack of FP8 expert matrices as a DeepSeek-V3 / V3.2 checkpoint stores them: ``weight``
    float8_e4m3fn [E, out, in] and ``scale`` float32 [E, out/128, in/128] (one per 128 x 128 block; the
    checkpoint's ``weight_scale_inv``). ``ragged`` multiplies them with the grouped FP8 GEMM
    (``pallas_kernels.fp8_grouped_gemm``), the inputs re-quantised per 1 x 128 with ``scale_fmt`` scales as
    DeepSeek's ``linear()`` does. Exported as ``<name>`` / ``<name>.scale``."""

    _flat_export = True  # names: ffn.w1 and ffn.w1.scale, not ffn.w1.weight

    def __init__(self, shape: tuple[int, int, int], fan_in: int, rngs: nnx.Rngs, scale_fmt: str = "ue8m0",
                 implementation: str = "xla"):
        """``implementation`` ("xla", "pallas" or "auto") is set by a ``Decoder`` as for its FP8 linears."""
        wq, scale = random_fp8_weight(rngs.params(), shape, fan_in ** -0.5)
        self.weight = nnx.Param(wq)
        self.scale = nnx.Param(scale)
        self.scale_fmt = scale_fmt
        self.implementation = implementation

    def ragged(self, x: jax.Array, sizes: jax.Array) -> jax.Array:
        """Rows of x [M, in] grouped by expert (``sizes`` [E]) times their expert's W^T: float32 [M, out]."""
        return fp8_grouped_linear(x, sizes, self.weight[...], self.scale[...], out_dtype=jnp.float32,
                                  scale_fmt=self.scale_fmt, implementation=self.implementation)


class MoE(nnx.Module):
    """Routed experts (sigmoid scores, normalised top-k weights) + shared expert, via ragged_dot.

    Routed experts are activation-dtype ``[E, in, out]`` stacks, or with ``numerics.experts_fp8``
    ``FP8Experts`` as an FP8 checkpoint stores them ([E, out, in] e4m3 + block scales, the grouped FP8 GEMM)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.topk, self.n_experts = cfg.moe_topk, e
        self.gate = Linear(h, e, dtype=jnp.float32, fp8=False, rngs=rngs)
        if cfg.numerics.experts_fp8:
            fmt = cfg.numerics.act_scale_fmt
            self.w1 = FP8Experts((e, f, h), h, rngs, fmt)
            self.w3 = FP8Experts((e, f, h), h, rngs, fmt)
            self.w2 = FP8Experts((e, h, f), f, rngs, fmt)
        else:
            init = lambda shape, fan_in: nnx.Param(  # noqa: E731
                (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in ** -0.5).astype(dtype))
            self.w1 = init((e, h, f), h)
            self.w3 = init((e, h, f), h)
            self.w2 = init((e, f, h), f)
        self.shared = MLP(h, f * cfg.n_shared_experts, dtype, False, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        t = x.shape[0]
        scores = jax.nn.sigmoid(self.gate(x.astype(jnp.float32), jnp.float32))
        w, idx = jax.lax.top_k(scores, self.topk)
        w = w / jnp.sum(w, axis=-1, keepdims=True)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat)
        xs = jnp.repeat(x, self.topk, axis=0)[order]
        sizes = jnp.bincount(flat, length=self.n_experts).astype(jnp.int32)
        if isinstance(self.w1, FP8Experts):
            mm = lambda a, w: w.ragged(a, sizes)  # noqa: E731
        else:
            # float32 weights: full-precision products (a GPU's DEFAULT precision would be TF32)
            prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
            mm = lambda a, w: jax.lax.ragged_dot(a, w[...], sizes, precision=prec,  # noqa: E731
                                                 preferred_element_type=jnp.float32)
        g, u = mm(xs, self.w1), mm(xs, self.w3)
        a = (jax.nn.silu(g) * u).astype(x.dtype)
        y = mm(a, self.w2)
        y = jnp.zeros_like(y).at[order].set(y).reshape(t, self.topk, -1)
        routed = jnp.einsum("tk,tkh->th", w, y, precision=jax.lax.Precision.HIGHEST)
        return (routed + self.shared(x).astype(jnp.float32)).astype(x.dtype)


def make_attention(cfg: ModelConfig, layer_id: int, implementation: str, rngs: nnx.Rngs,
                   indexer_config: Any = None) -> nnx.Module:
    if cfg.arch == "v32":
        from jds.v32 import V32Attention
        return V32Attention(cfg.attn, cfg.numerics, rngs=rngs, implementation=implementation,
                            indexer_config=indexer_config)
    from jds.v4 import V4Attention
    return V4Attention(cfg.attn, cfg.numerics, layer_id, rngs=rngs, implementation=implementation,
                       indexer_config=indexer_config)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, implementation: str, rngs: nnx.Rngs,
                 indexer_config: Any = None):
        dt = jdtype(cfg.numerics.dtype)
        eps = cfg.attn.rms_norm_eps
        self.attn_norm = RMSNorm(cfg.hidden_size, eps=eps, rngs=rngs)
        self.attn = make_attention(cfg, layer_id, implementation, rngs, indexer_config)
        self.ffn_norm = RMSNorm(cfg.hidden_size, eps=eps, rngs=rngs)
        self.ffn = (MoE(cfg, dt, rngs) if cfg.n_routed_experts
                    else MLP(cfg.hidden_size, cfg.intermediate_size, dt, cfg.numerics.fp8_linear, rngs,
                             cfg.numerics.act_scale_fmt))

    # The two halves the boundary runner places around the attention consumers. Each norm ahead of FP8 linears
    # quantises its output for them (``norm_into``); the FFN's also takes the residual add.
    def pre_attention(self, h: jax.Array) -> Any:
        nq, xq = norm_into(self.attn_norm, h, self.attn.input_linears())
        return self.attn.project_in(nq.y, xq=xq)

    def post_attention(self, h: jax.Array, o: jax.Array) -> jax.Array:
        a = self.attn.project_out(o).astype(h.dtype)
        if isinstance(self.ffn, MLP):
            nq, x = norm_into(self.ffn_norm, h, (self.ffn.w1, self.ffn.w3), residual=a, want_y=False)
            return nq.h + self.ffn(x).astype(h.dtype)
        h = h + a
        return h + self.ffn(self.ffn_norm(h)).astype(h.dtype)

    def __call__(self, h: jax.Array, batch: PagedBatch, cache: Any) -> tuple[jax.Array, Any]:
        inp = self.pre_attention(h)
        query, cache = self.attn.prepare(inp, batch, cache)
        o, _ = self.attn.consume(query, batch, cache)
        return self.post_attention(h, o), cache


class V4Hidden(NamedTuple):
    """The hidden state between the layers of a ``block="v4"`` decoder (and across the runner's segments).

    ``streams`` [T, hc_mult, D] are V4's residual streams. ``tokens`` [T] int32 ride along because the
    hash-routed layers pick their experts from the token ids in the FFN half (``post_attention``), which the
    boundary runner calls with the hidden state and the attention output only."""

    streams: jax.Array
    tokens: jax.Array


def v4_block_config(cfg: ModelConfig) -> V4BlockConfig:
    """The ``jds.v4_block`` config of a ``block="v4"`` model."""
    return V4BlockConfig(
        hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, norm_eps=cfg.attn.rms_norm_eps, hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, moe_topk=cfg.moe_topk, moe_intermediate_size=cfg.moe_intermediate_size,
        route_scale=cfg.route_scale, scoring=cfg.scoring, n_hash_layers=cfg.n_hash_layers,
        swiglu_limit=cfg.swiglu_limit, shared_swiglu_limit=cfg.shared_swiglu_limit, dtype=cfg.numerics.dtype,
        moe_impl=cfg.moe_impl, experts_fp4=cfg.numerics.experts_fp4, shared_fp8=_shared_fp8(cfg))


def _shared_fp8(cfg: ModelConfig) -> bool:
    """The V4 shared expert is FP8 with the model's other linears, where its 128-wide scale blocks fit (every
    released width does); a test-size expert narrower than a block stays in ``dtype`` (docs/DESIGN.md)."""
    return cfg.numerics.fp8_linear and cfg.hidden_size % 128 == 0 and cfg.moe_intermediate_size % 128 == 0


class V4DecoderLayer(DecoderLayer, V4Block):
    """A ``block="v4"`` layer: V4's hyper-connections and MoE (``V4Block``) around jds's V4 attention stages.

    Same interface as ``DecoderLayer`` (its ``__call__`` is inherited), with the hidden state a ``V4Hidden``.
    Parameter names: ``attn.*`` as in the V3-style layer, ``attn_norm`` / ``ffn_norm``, ``hc_attn.{fn,base,scale}``,
    ``hc_ffn.*``, ``ffn.gate.{weight,bias|tid2eid}``, ``ffn.w1/w3/w2`` [E, out, in], ``ffn.shared.w1/w3/w2``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, implementation: str, rngs: nnx.Rngs,
                 indexer_config: Any = None):
        V4Block.__init__(self, v4_block_config(cfg), layer_id, rngs)
        self.attn = make_attention(cfg, layer_id, implementation, rngs, indexer_config)

    def pre_attention(self, h: V4Hidden) -> Any:
        # V4Block.pre_attention's mix and norm, the norm quantised for the attention's FP8 input linears (norm_into)
        x, _, _ = self.hc_attn.pre(h.streams)
        nq, xq = norm_into((self.attn_norm[...], self.cfg.norm_eps), x, self.attn.input_linears())
        return self.attn.project_in(nq.y, xq=xq)

    def post_attention(self, h: V4Hidden, o: jax.Array) -> V4Hidden:
        # The attention half's (post, comb) mixing weights are recomputed from the same streams (same ops, so
        # the same values) rather than carried: the runner hands post_attention only (h, o), and the mix is a
        # [T, hc*D] x [hc*D, (2+hc)*hc] product, small next to the layer.
        _, mix = V4Block.pre_attention(self, h.streams)
        attn_out = self.attn.project_out(o).astype(h.streams.dtype)
        return V4Hidden(V4Block.post_attention(self, h.streams, attn_out, mix, h.tokens), h.tokens)


class V4Embedding(nnx.Module):
    """The embedding of a ``block="v4"`` decoder: token rows repeated into ``hc_mult`` streams, with the ids."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = jdtype(cfg.numerics.dtype)
        self.hc_mult = cfg.hc_mult
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32).astype(dt))

    def __call__(self, tokens: jax.Array) -> V4Hidden:
        tokens = tokens.astype(jnp.int32)
        return V4Hidden(expand_streams(self.weight[...][tokens], self.hc_mult), tokens)


class V4Head(nnx.Module):
    """V4's head: the HC reduction of the streams (``hc``), then RMSNorm and the LM head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = jdtype(cfg.numerics.dtype)
        self.hc = HCHead(v4_block_config(cfg), rngs)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.attn.rms_norm_eps, rngs=rngs)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dt, fp8=False, rngs=rngs)

    def __call__(self, h: V4Hidden, logits_indices: jax.Array) -> jax.Array:
        # The reduction is per token, so only the rows whose logits are wanted are reduced.
        return self.lm_head(self.norm(self.hc(h.streams[logits_indices])), jnp.float32)


class Head(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = jdtype(cfg.numerics.dtype)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.attn.rms_norm_eps, rngs=rngs)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dt, fp8=False, rngs=rngs)

    def __call__(self, h: jax.Array, logits_indices: jax.Array) -> jax.Array:
        return self.lm_head(self.norm(h[logits_indices]), jnp.float32)


class Embedding(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = jdtype(cfg.numerics.dtype)
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32).astype(dt))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.weight[...][tokens]


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, seed: int = 0, implementation: str = "auto", indexer_config: Any = None):
        """``indexer_config``: a ``pallas_kernels.sparse_indexer.IndexerKernelConfig`` for every layer's
        indexer kernel (key source, top-k algorithm); None takes the kernel's defaults."""
        rngs = nnx.Rngs(seed)
        self.cfg = cfg
        v4 = cfg.block == "v4"
        self.embed = V4Embedding(cfg, rngs) if v4 else Embedding(cfg, rngs)
        layer_cls = V4DecoderLayer if v4 else DecoderLayer
        self.layers = nnx.List([layer_cls(cfg, i, implementation, rngs, indexer_config)
                                for i in range(cfg.n_layers)])
        self.head = V4Head(cfg, rngs) if v4 else Head(cfg, rngs)
        if cfg.mtp_layers:  # built last, so a model's main weights do not depend on whether it has MTP modules
            from jds.mtp import MTPModule
            self.mtp = nnx.List([MTPModule(cfg, k, implementation, rngs, indexer_config)
                                 for k in range(cfg.mtp_layers)])
        # every FP8 linear and FP4 / FP8 expert stack runs the GEMM the layers' ops run: the kernel where it applies on
        # a GPU, else XLA.
        # Off a GPU the linears stay on XLA even for "pallas" layers: interpret mode (the attention kernels'
        # CPU stand-in) would run every GEMM in Python; tests/test_kernel_fp8_gemm.py covers the kernel there.
        gemm = op_implementation(implementation) if jax.default_backend() == "gpu" else "xla"
        for _, m in nnx.iter_modules(self):
            if isinstance(m, (Linear, FP4Experts, FP8Experts)):
                m.implementation = gemm

    def zero_hidden(self, num_tokens: int) -> Any:
        """A zero hidden state of ``num_tokens`` tokens, shaped as the layers pass it (the runner's segment
        carry): [T, D], or a ``V4Hidden`` for the V4 block."""
        dt = self.embed.weight[...].dtype
        if self.cfg.block == "v4":
            return V4Hidden(jnp.zeros((num_tokens, self.cfg.hc_mult, self.cfg.hidden_size), dt),
                            jnp.zeros((num_tokens,), jnp.int32))
        return jnp.zeros((num_tokens, self.cfg.hidden_size), dt)

    def init_caches(self, num_blocks: int) -> list[Any]:
        return [layer.attn.init_cache(num_blocks) for layer in self.layers]

    def init_mtp_caches(self, num_blocks: int) -> list[Any]:
        """The MTP modules' own caches (``jds.mtp``), one per module; [] without MTP modules."""
        return [m.init_cache(num_blocks) for m in getattr(self, "mtp", [])]

    def forward_hidden(self, tokens: jax.Array, batch: PagedBatch, caches: list[Any]) -> tuple[Any, list[Any]]:
        """The layers without the head: the final hidden state ([T, D], or a ``V4Hidden`` whose streams the MTP
        module takes) and the new caches."""
        h = self.embed(tokens)
        new_caches = []
        for layer, cache in zip(self.layers, caches):
            h, cache = layer(h, batch, cache)
            new_caches.append(cache)
        return h, new_caches

    def __call__(self, tokens: jax.Array, batch: PagedBatch, caches: list[Any],
                 logits_indices: jax.Array) -> tuple[jax.Array, list[Any]]:
        """The whole step (the ``fused`` executable): logits [S, vocab] float32 and the new caches."""
        h, new_caches = self.forward_hidden(tokens, batch, caches)
        return self.head(h, logits_indices), new_caches
