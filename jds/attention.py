"""What the V3.2 and V4 attention layers share above the primitives: the result type, the stage order of a
forward pass, and every stage the two models do alike (input checks, the indexer's cache format, the
indexer's query side, top-k selection). The subclasses fill in small hooks: which caches a layer has
(``cache_formats``), how many indexer keys a token sees (``visible_keys``) and how many a page holds
(``index_entries_per_page``).

Stage order (the boundary runner calls the same stages one by one):
  project_in -> prepare (producers: norms, RoPE, cache inserts) -> consume (select + attend) -> project_out
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jds.batch import PagedBatch, validate_batch
from jds.config import Numerics
from jds.nn import Linear, jdtype
from jds.ops.dispatch import Implementation, op_implementation, resolve_layer_implementation
from jds.ops.indexer import dequant_index_q
from jds.ops.paging import RecordFormat, empty_cache
from jds.ops.records import FloatRows, IndexerRecord132, IndexerRecordFP4
from pallas_kernels.sparse_indexer import indexer_topk

__all__ = ["AttentionResult", "Implementation", "Indexer", "Query", "StagedAttention", "resolve_implementation"]

resolve_implementation = resolve_layer_implementation  # the layers' "auto" / "pallas" / "xla" (jds.ops.dispatch)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionResult:
    y: jax.Array  # [T, hidden]
    cache: Any  # the layer's cache pytree after this step's inserts
    topk: jax.Array  # [T, index_topk] request-local indices (-1 padded); [T, 0] for layers without an indexer


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Query:
    """What ``prepare`` hands the consumers, alike in both models: ``attend`` reads ``q``, ``select`` the rest."""

    q: jax.Array  # V3.2: absorbed [T, H, kv_lora] or MHA [T, H, nope + rope]; V4: [T, H, head_dim]
    # [T, Hi, Di]: e4m3 with ``index_q_scale`` (indexer_fp8: q as the model quantised it), else float32 (FP4
    # round-tripped with indexer_fp4); [T, 0, 0] without an indexer
    index_q: jax.Array
    index_w: jax.Array  # [T, Hi] float32, constant scales folded in; [T, 0] without an indexer
    # V3.2 absorbed: the roped [T, H, rope] apart (the query's row is q then q_rope; the sparse MQA reads the two
    # into one tile, so no op writes their concatenation); else None
    q_rope: jax.Array | None = None
    index_q_scale: jax.Array | None = None  # [T, Hi] float32: index_q's FP8 scales; None: index_q is float

    def indexer_q(self) -> jax.Array:
        """The indexer's q as real numbers, float32 [T, Hi, Di] (dequantised where FP8)."""
        if self.index_q_scale is None:
            return self.index_q
        return dequant_index_q(self.index_q, self.index_q_scale)

    def full_q(self) -> jax.Array:
        """The query's whole row, [T, H, Dk]."""
        return self.q if self.q_rope is None else jnp.concatenate([self.q, self.q_rope.astype(self.q.dtype)], -1)


def weights_proj_dtype(numerics: Numerics) -> jnp.dtype:
    """The indexer's ``weights_proj`` dtype: float32 with ``Numerics.weights_proj_float32`` or float32 activations,
    else the activation dtype (as the checkpoints store it)."""
    return jnp.dtype(jnp.float32) if numerics.weights_proj_float32 else jnp.dtype(jdtype(numerics.dtype))


class Indexer(nnx.Module):
    """The lightning indexer's query side, alike in both models: ``wq_b`` from the q latent and fp32 head
    weights from x. Subclasses add the key side (V3.2: a per-token ``wk`` + LayerNorm; V4: a compressor)
    and build the modules in their checkpoint's order (which fixes the random init)."""

    def _wq_b(self, cfg: Any, numerics: Numerics, rngs: nnx.Rngs) -> Linear:
        dt, fp8 = jdtype(numerics.dtype), numerics.fp8_linear
        return Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, dtype=dt, fp8=fp8, rngs=rngs,
                      scale_fmt=numerics.act_scale_fmt)

    def _weights_proj(self, cfg: Any, numerics: Numerics, rngs: nnx.Rngs) -> Linear:
        return Linear(cfg.hidden_size, cfg.index_n_heads, dtype=weights_proj_dtype(numerics), fp8=False, rngs=rngs)

    def head_weights(self, x: jax.Array) -> jax.Array:
        """[T, Hi] float32 head weights (before the constant scales): x (the activation dtype) times the weight
        in its held dtype, fp32 accumulation (exact products either way)."""
        return self.weights_proj(x, jnp.float32)

    def project_q(self, q_c: jax.Array, cfg: Any) -> jax.Array:
        """[T, Hi, Di] indexer queries from the normalised q latent (before RoPE)."""
        return self.wq_b(q_c).reshape(-1, cfg.index_n_heads, cfg.index_head_dim)


class StagedAttention(nnx.Module):
    """Base of both layers: ``__call__`` is the list of stages every subclass implements.

    Subclasses set ``cfg``, ``numerics``, ``dtype``, ``implementation`` and ``indexer_config`` and define
    ``cache_type``, ``cache_formats``, ``project_in``, ``prepare``, ``attend`` and ``project_out``; the hooks
    below have the V3.2 defaults (an indexer over every token)."""

    cache_type: type

    def __call__(self, x: jax.Array, batch: PagedBatch, cache: Any) -> AttentionResult:
        self.check_inputs(x, batch, cache)
        inp = self.project_in(x)
        query, cache = self.prepare(inp, batch, cache)
        o, topk = self.consume(query, batch, cache)
        return AttentionResult(y=self.project_out(o), cache=cache, topk=topk)

    def consume(self, query: Any, batch: PagedBatch, cache: Any) -> tuple[jax.Array, jax.Array]:
        """The consumers of the prepared query (eager in vLLM): ``select`` then ``attend``.
        Returns (attention output [T, H * v_dim], top-k [T, index_topk])."""
        topk = self.select(query, batch, cache)
        return self.attend(query, topk, batch, cache), topk

    # ----- hooks ----------------------------------------------------------------------------------
    @property
    def has_indexer(self) -> bool:
        return True

    @property
    def index_entries_per_page(self) -> int:
        """Indexer keys per cache page (V3.2: one per token; V4 C4: one per 4 tokens)."""
        return self.cfg.block_size

    def visible_keys(self, positions: jax.Array) -> jax.Array:
        """How many indexer keys a token at ``positions`` sees (V3.2: keys 0..p)."""
        return positions + 1

    def cache_formats(self) -> dict[str, RecordFormat]:
        raise NotImplementedError

    def check_extra(self, batch: PagedBatch) -> None:
        """Model-specific eager checks of a valid batch (V4: the compressor's static bound)."""

    # ----- shared stages --------------------------------------------------------------------------
    @property
    def index_format(self) -> RecordFormat:
        epp, dim = self.index_entries_per_page, self.cfg.index_head_dim
        if self.numerics.indexer_fp4:
            return IndexerRecordFP4(epp, dim)
        if self.numerics.indexer_fp8:
            return IndexerRecord132(epp, dim, scale_fmt=self.numerics.act_scale_fmt)
        return FloatRows(dim, epp, self.dtype)

    def init_cache(self, num_blocks: int) -> Any:
        """Every field of ``cache_type`` in its format; fields this layer kind lacks are [num_blocks, 0]."""
        fmts = self.cache_formats()
        return self.cache_type(**{f.name: empty_cache(fmts[f.name], num_blocks) if f.name in fmts
                                  else jnp.zeros((num_blocks, 0), jnp.float32)
                                  for f in dataclasses.fields(self.cache_type)})

    def select(self, query: Any, batch: PagedBatch, cache: Any) -> jax.Array:
        """Top-k request-local indexer keys among each token's ``visible_keys``: int32 [T, index_topk]
        (-1 padded); [T, 0] for a layer without an indexer."""
        if not self.has_indexer:
            return jnp.zeros((batch.positions.shape[0], 0), jnp.int32)
        return indexer_topk(query.index_q, query.index_w, cache.index_k, self.index_format, batch.block_tables,
                            batch.req_idx, self.visible_keys(batch.positions), self.cfg.index_topk,
                            implementation=self.op_implementation, config=self.indexer_config,
                            index_q_scale=query.index_q_scale)

    @property
    def op_implementation(self) -> Implementation:
        """What this layer asks each op for (read at call time: tests switch ``implementation``)."""
        return op_implementation(self.implementation)

    def check_inputs(self, x: jax.Array, batch: PagedBatch, cache: Any) -> None:
        """Eager validation (skipped under jit, where values are abstract): x's width, every cache field
        against this layer's formats, ``validate_batch``, then ``check_extra``."""
        if isinstance(x, jax.core.Tracer) or isinstance(batch.positions, jax.core.Tracer):
            return
        if x.ndim != 2 or x.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"x must be [T, hidden_size={self.cfg.hidden_size}], got shape {x.shape}")
        fields = [f.name for f in dataclasses.fields(cache)]
        nb = getattr(cache, fields[0]).shape[0]
        fmts = self.cache_formats()
        for name in fields:
            want = (nb, fmts[name].page_elems if name in fmts else 0)
            got = getattr(cache, name).shape
            if got != want:
                shapes = "/".join(str(getattr(cache, n).shape) for n in fields)
                raise ValueError(f"cache.{name} has shape {got}, expected {want}: cache shapes {shapes} do not "
                                 "match this layer's formats")
        validate_batch(batch, num_blocks=nb, block_size=self.cfg.block_size, max_seq_len=self.cfg.max_seq_len,
                       num_tokens=x.shape[0])
        self.check_extra(batch)
