"""Serving on several local devices: a ("data", "tensor", "expert") mesh and the partition rules.

The runner places every parameter and cache page pool with a ``NamedSharding`` from these rules and pins
the caches and the hidden state inside its executables; XLA's SPMD partitioner derives the rest (the
collectives included), so the model code carries no sharding of its own.

Layout (Megatron-style, as vLLM / MaxText split DeepSeek):
  tensor  attention heads: the q up-projection (``wq_b``), the MLA ``wkv_b`` (so the absorbed W_UK / W_UV
          are per head) and the V4 attention sinks split by rows; the output projection (``wo``, V4's
          ``wo_b``) by columns, which makes one all-reduce per layer. V4's grouped ``wo_a`` splits by
          groups when ``o_groups`` divides by the tensor size, else it stays whole. Dense MLP and the
          shared expert: ``w1`` / ``w3`` by rows, ``w2`` by columns; routed experts' width likewise.
          Embedding and LM head by vocabulary rows.
  expert  the routed experts' leading dimension.
  data    the token rows of the hidden state (dense compute is data parallel) and the KV page pool.
Replicated over ``tensor``: the MLA latent cache and the indexer cache and weights. MLA keeps one latent
per token shared by all heads (MQA), so splitting heads leaves nothing to split in the cache: each tensor
rank holds the whole pool (vLLM does the same for DeepSeek MLA), a cost of ``tensor_parallel`` x the pool
in total. The indexer's top-k must be the same on every rank, which replication gives by construction.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jds.config import ModelConfig, RunnerConfig

AXES: tuple[str, str, str] = ("data", "tensor", "expert")


def mesh_shape(config: RunnerConfig) -> tuple[int, int, int]:
    return (config.data_parallel, config.tensor_parallel, config.expert_parallel)


def uses_mesh(config: RunnerConfig) -> bool:
    """Whether the runner needs a mesh at all (all sizes 1: plain single-device placement)."""
    return mesh_shape(config) != (1, 1, 1)


def make_mesh(config: RunnerConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The first ``data x tensor x expert`` local devices as a mesh (``devices`` default: this process's).

    Only the axes of size > 1 are in the mesh (the rules drop the others): XLA may otherwise name a size-1
    axis in the sharding it reports for a replicated output (``P('tensor', None)``), which differs from the
    input's ``P()`` in jit's cache key and compiles the step a second time."""
    devices = list(jax.local_devices() if devices is None else devices)
    shape = mesh_shape(config)
    n = int(np.prod(shape))
    if n > len(devices):
        raise ValueError(f"data_parallel x tensor_parallel x expert_parallel = {' x '.join(map(str, shape))} = {n} "
                         f"devices, but only {len(devices)} are available")
    axes = tuple(a for a, k in zip(AXES, shape) if k > 1)
    return Mesh(np.array(devices[:n], dtype=object).reshape([k for k in shape if k > 1]), axes)


def _size(mesh: Any, axis: str) -> int:
    return dict(mesh.shape).get(axis, 1)


def check_divisible(model: ModelConfig, config: RunnerConfig, token_buckets: Sequence[int] = ()) -> None:
    """ValueErrors naming the setting when a dimension the layout splits does not divide."""
    tp, dp, ep = config.tensor_parallel, config.data_parallel, config.expert_parallel

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{field}: {what}")

    heads = model.attn.n_heads
    need(heads % tp == 0, "tensor_parallel", f"{tp} does not divide the {heads} attention heads")
    if model.n_routed_experts:
        e, f = model.n_routed_experts, model.moe_intermediate_size
        need(e % ep == 0, "expert_parallel", f"{ep} does not divide the {e} routed experts")
        need(f % tp == 0, "tensor_parallel", f"{tp} does not divide moe_intermediate_size={f}")
        shared = f * model.n_shared_experts
        need(shared % tp == 0, "tensor_parallel", f"{tp} does not divide the shared expert width {shared}")
    else:
        need(ep == 1, "expert_parallel", f"{ep} needs a MoE model (n_routed_experts > 0)")
        f = model.intermediate_size
        need(f % tp == 0, "tensor_parallel", f"{tp} does not divide intermediate_size={f}")
    need(config.num_blocks % dp == 0, "num_blocks",
         f"{config.num_blocks} pages do not divide over data_parallel={dp}")
    bad = [b for b in token_buckets if b % dp]
    need(not bad, "token_buckets", f"{bad} do not divide over data_parallel={dp} (each rank takes equal rows)")


# (path pattern after the layer index is removed, spec of a 2-D [out, in] weight or of the leaf's own rank)
_TENSOR_ROWS, _TENSOR_COLS = P("tensor", None), P(None, "tensor")
_RULES: tuple[tuple[str, Any], ...] = (
    (r"attn/indexer/", P()),  # replicated: every rank computes the same top-k
    (r"attn/compressor/", P()),  # V4 compressors write the replicated caches
    (r"attn/(wq_b|wkv_b)/(weight|scale)", _TENSOR_ROWS),
    (r"attn/absorbed/", P(None, "tensor")),  # V3.2's held W_UK / W_UV [2, H, 128, kv_lora]: heads, as wkv_b's rows
    (r"attn/wo/(weight|scale)", _TENSOR_COLS),
    (r"attn/attn_sink", P("tensor")),
    (r"attn/wo_a/(weight|scale)", "groups_rows"),
    (r"attn/wo_b/(weight|scale)", "groups_cols"),
    (r"ffn/shared/(w1|w3)/(weight|scale)", _TENSOR_ROWS),
    (r"ffn/shared/w2/(weight|scale)", _TENSOR_COLS),
    (r"ffn/(w1|w3)/(weight|scale)", _TENSOR_ROWS),  # dense MLP (a Linear)
    (r"ffn/w2/(weight|scale)", _TENSOR_COLS),
    (r"^(embed/weight|head/lm_head/weight)", "vocab_rows"),
)


def param_spec(path: str, shape: tuple[int, ...], model: ModelConfig, mesh: Mesh) -> P:
    """The PartitionSpec of one parameter leaf, by its nnx path (``layers/3/attn/wq_b/weight/value``).

    A rule's split is kept only where the dimension divides by the axis size (FP8 scale grids, vocabularies
    and V4 output groups may not); the splits the layout depends on are checked by ``check_divisible``.
    Unmatched leaves (norms, the fused ``wq_a`` + ``indexer.wk`` + ``wkv_a`` (V3.2) or ``wq_a`` + ``wkv`` (V4), the
    MoE gate) are replicated.
    """
    key = re.sub(r"^(layers|mtp)/\d+/", "", path)  # an MTP module (jds.mtp) is laid out like a layer
    spec: Any = P()
    if len(shape) == 3 and re.match(r"ffn/(w1|w2|w3)/", key):
        return _fit(_routed_expert_spec(key, model), shape, mesh)
    for pattern, s in _RULES:
        if re.search(pattern, key):
            spec = s
            break
    tp = _size(mesh, "tensor")
    if spec == "groups_rows" or spec == "groups_cols":
        groups = getattr(model.attn, "o_groups", 1)
        spec = P() if groups % tp else (_TENSOR_ROWS if spec == "groups_rows" else _TENSOR_COLS)
    elif spec == "vocab_rows":
        spec = _TENSOR_ROWS
    return _fit(spec, shape, mesh)


def _routed_expert_spec(key: str, model: ModelConfig) -> P:
    """A routed-expert stack: experts over ``expert``, each expert's width over ``tensor`` (column-parallel
    w1 / w3, row-parallel w2, as the dense MLP). The V3 block stacks them [E, in, out] (for ragged_dot); the V4
    block [E, out, in] as the release stores them, FP4 ones as [E, out, in/2] codes + [E, out, in/32] scales;
    V3 FP8 ones (``numerics.experts_fp8``) [E, out, in] e4m3 + [E, out/128, in/128] scales, as stored."""
    out_in = model.block == "v4" or model.numerics.experts_fp8  # stacks [E, out, in]
    width_in_dim1 = out_in != key.startswith("ffn/w2/")  # [E, out, in] w1 / w3, or [E, in, out] w2: [E, width, ...]
    return P("expert", "tensor", None) if width_in_dim1 else P("expert", None, "tensor")


def _fit(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """``spec`` trimmed to the leaf's rank, with each split over an axis of size 1 (absent from the mesh) or
    that does not divide its dimension dropped."""
    parts = list(spec)[: len(shape)]
    parts += [None] * (len(shape) - len(parts))
    for i, ax in enumerate(parts):
        if ax is not None and (_size(mesh, ax) == 1 or shape[i] % _size(mesh, ax)):
            parts[i] = None
    return P(*parts)


def param_shardings(state: Any, model: ModelConfig, mesh: Mesh) -> Any:
    """A pytree like ``state`` (an nnx.State) of NamedShardings from the rules."""
    def one(path: Any, leaf: Any) -> NamedSharding:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        return NamedSharding(mesh, param_spec(name, tuple(leaf.shape), model, mesh))
    return jax.tree_util.tree_map_with_path(one, state)


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """Every cache leaf is a page pool [num_blocks, page_elems]: pages split over ``data``, whole on each
    tensor / expert rank."""
    return NamedSharding(mesh, P("data" if _size(mesh, "data") > 1 else None, None))


def rows_sharding(mesh: Mesh) -> NamedSharding:
    """Token rows [T, ...] split over ``data``; the trailing dimensions whole."""
    return NamedSharding(mesh, P("data" if _size(mesh, "data") > 1 else None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
