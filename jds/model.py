"""The decoder the server runs: embedding -> L x [RMSNorm -> attention -> RMSNorm -> FFN] -> RMSNorm -> head.

Attention is V3.2 (every layer alike) or V4 (per-layer window-only / C4 / C128 from compress_ratios).
The FFN is a SwiGLU MLP or a DeepSeek-style MoE (sigmoid-scored routed top-k experts + a shared expert)
so step times carry the real structure. Weights are random from a seed unless loaded.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jds.batch import PagedBatch
from jds.config import ModelConfig, preset  # noqa: F401  (defined in jds.config; re-exported here)
from jds.nn import Linear, RMSNorm, jdtype


class MLP(nnx.Module):
    def __init__(self, hidden: int, inter: int, dtype: jnp.dtype, fp8: bool, rngs: nnx.Rngs):
        self.w1 = Linear(hidden, inter, dtype=dtype, fp8=fp8, rngs=rngs)
        self.w3 = Linear(hidden, inter, dtype=dtype, fp8=fp8, rngs=rngs)
        self.w2 = Linear(inter, hidden, dtype=dtype, fp8=fp8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(jax.nn.silu(self.w1(x).astype(jnp.float32)).astype(x.dtype) * self.w3(x))


class MoE(nnx.Module):
    """Routed experts (sigmoid scores, normalised top-k weights) + shared expert, via ragged_dot."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.topk = cfg.moe_topk
        self.gate = Linear(h, e, dtype=jnp.float32, fp8=False, rngs=rngs)
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
        sizes = jnp.bincount(flat, length=self.w1.shape[0]).astype(jnp.int32)
        g = jax.lax.ragged_dot(xs, self.w1[...], sizes, preferred_element_type=jnp.float32)
        u = jax.lax.ragged_dot(xs, self.w3[...], sizes, preferred_element_type=jnp.float32)
        a = (jax.nn.silu(g) * u).astype(x.dtype)
        y = jax.lax.ragged_dot(a, self.w2[...], sizes, preferred_element_type=jnp.float32)
        y = jnp.zeros_like(y).at[order].set(y).reshape(t, self.topk, -1)
        routed = jnp.einsum("tk,tkh->th", w, y)
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
                    else MLP(cfg.hidden_size, cfg.intermediate_size, dt, cfg.numerics.fp8_linear, rngs))

    # The two halves the boundary runner places around the attention consumers.
    def pre_attention(self, h: jax.Array) -> Any:
        return self.attn.project_in(self.attn_norm(h))

    def post_attention(self, h: jax.Array, o: jax.Array) -> jax.Array:
        h = h + self.attn.project_out(o).astype(h.dtype)
        return h + self.ffn(self.ffn_norm(h)).astype(h.dtype)

    def __call__(self, h: jax.Array, batch: PagedBatch, cache: Any) -> tuple[jax.Array, Any]:
        inp = self.pre_attention(h)
        query, cache = self.attn.prepare(inp, batch, cache)
        o, _ = self.attn.consume(query, batch, cache)
        return self.post_attention(h, o), cache


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
        self.embed = Embedding(cfg, rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, implementation, rngs, indexer_config)
                                for i in range(cfg.n_layers)])
        self.head = Head(cfg, rngs)

    def init_caches(self, num_blocks: int) -> list[Any]:
        return [layer.attn.init_cache(num_blocks) for layer in self.layers]

    def __call__(self, tokens: jax.Array, batch: PagedBatch, caches: list[Any],
                 logits_indices: jax.Array) -> tuple[jax.Array, list[Any]]:
        """The whole step (the ``fused`` executable): logits [S, vocab] float32 and the new caches."""
        h = self.embed(tokens)
        new_caches = []
        for layer, cache in zip(self.layers, caches):
            h, cache = layer(h, batch, cache)
            new_caches.append(cache)
        return self.head(h, logits_indices), new_caches
