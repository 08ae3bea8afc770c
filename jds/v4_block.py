"""DeepSeek-V4's decoder block around an arbitrary attention: hyper-connections (HC) and the V4 MoE.

Why a separate module: V4 does not keep one residual stream per token but ``hc_mult`` of them, and mixes
them before and after every sub-layer with per-token weights computed from the streams themselves. Its MoE
also differs from V3's (scoring, bias, hash-routed first layers, clamped SwiGLU). Everything here is pure
JAX/Flax NNX and takes the attention as a function, so it can be tested in isolation and wired into
``jds.model.Decoder`` later.

Reference semantics followed (DeepSeek's V4-Flash release, ``inference/model.py`` and ``inference/kernel.py``;
read in two public copies, the V4-Flash mirror ``Mockingjay1316/deepseek-v4-flash-spark`` at its first
real-file commit and the V4-Pro copy ``Nicooo-Wang/DeepSeek-V4-Pro-code``):

* ``sinkhorn_split``  -> kernel.py ``hc_split_sinkhorn`` (and its tilelang kernel): the split of the
  ``(2 + hc) * hc`` mixes into pre / post / comb, the softmax + eps start and the alternating row / column
  normalisation, ending on a column step.
* ``HyperConnection.pre`` / ``.post`` -> model.py ``Block.hc_pre`` / ``Block.hc_post``.
* ``HCHead``          -> model.py ``ParallelHead.hc_head`` (the final reduction of the streams before
  ``norm`` and the LM head; sigmoid weights, no Sinkhorn).
* ``expand_streams``  -> model.py ``Transformer.forward`` (the embedding repeated into ``hc_mult`` streams).
* ``router_scores`` / ``V4Gate`` -> model.py ``Gate.forward``: fp32 logits, sqrtsoftplus (or sigmoid /
  softmax), the bias added for the top-k *selection only*, weights gathered from the unbiased scores,
  renormalised (not for softmax) and multiplied by ``route_scale``; hash layers (``layer_id <
  n_hash_layers``) take the experts from ``tid2eid[token]`` and have no bias.
* ``swiglu`` / ``V4MoE`` -> model.py ``Expert.forward`` / ``MoE.forward``: the gate and up projections
  rounded to the activation dtype and computed on in fp32, ``up`` clamped to [-limit, limit] and ``gate``
  clamped from above only, the routing weight applied to the hidden activation *before* ``w2``, expert
  outputs summed in fp32 with the shared expert, one final rounding.
  The shared expert's clamp: the release's first revision (the Mockingjay mirror) built it without
  ``swiglu_limit``; the later revision (the Nicooo-Wang copy; a third-party audit of the HF history names
  this as the only change to model.py between the two) clamps it like the routed experts.
  ``V4BlockConfig.shared_swiglu_limit`` picks; the default is the later revision.
* ``V4Block``         -> model.py ``Block.forward``: hc_pre -> attn_norm -> attention -> hc_post, then the
  same around ffn_norm -> MoE.

Wired into ``jds.model.Decoder`` by ``ModelConfig.block = "v4"`` (``V4DecoderLayer``, ``V4Embedding``,
``V4Head``), and the importer maps the release's ``hc_*``, ``gate.bias``, ``gate.tid2eid`` and per-expert
tensors onto these parameters (``jds.hf_import``).

FP4 routed experts (``V4BlockConfig.experts_fp4`` <- ``Numerics.experts_fp4``): the release stores w1/w2/w3 as
packed e2m1 (int8 [out, in/2], low nibble first) with a float8_e8m0fnu scale per 1x32 block along the input dim
(``<name>.scale`` [out, in/32]); convert.py keeps them (or casts them losslessly to e4m3 with 128x128 scales,
``--expert-dtype fp8``), and model.py's ``linear()`` quantises the expert's input to e4m3 per 128 (ue8m0 scales)
then runs ``fp4_gemm`` (kernel.py: the FP4 values cast to FP8, FP8 x FP8 MMAs per 32-wide K step, both scales
applied to each step's float32 partial sum, output in the default dtype, bf16). ``FP4Experts`` holds the packed
bytes and e8m0 exponent bytes; the step dequantises them (exactly, to the activation dtype) and multiplies the
dequantised e4m3 input with float32 accumulation: the same products, float32 summation order aside.

Not done yet (later steps of issue 22):
* The shared expert runs bf16 (the release's is an FP8 linear).
* A GPU grouped (FP4) GEMM kernel: the XLA ``ragged`` path is the only grouped path, and with FP4 experts it
  dequantises every expert's weights each step (transient [E, out, in] activation-dtype copies).
* (The MTP module is ``jds.mtp``: a ``V4DecoderLayer`` with its input mixer and own HC head.)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jds.nn import Linear
from jds.ops.norms import rms_norm
from jds.ops.quant import FP4_WEIGHT_BLOCK, act_quant, fake_quant, fp4_dequant, random_fp4_weight
from pallas_kernels.fp4_grouped_gemm import fp4_grouped_linear

HIGHEST = jax.lax.Precision.HIGHEST
ACT_BLOCK = 128  # the release's act_quant block of an FP8 / FP4 linear's input
SCORINGS = ("sqrtsoftplus", "sigmoid", "softmax")
MOE_IMPLS = ("ragged", "gather")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class V4BlockConfig:
    """The block's hyper-parameters; defaults are V4-Flash's (``inference/config.json``).

    ``swiglu_limit`` 0 disables the clamp (as in the reference). ``moe_impl``: ``ragged`` sorts the
    token-expert pairs by expert and runs grouped GEMMs (prefill); ``gather`` fetches each pair's expert
    weights (decode: reads only the selected experts). ``dtype`` is the activation / weight dtype."""

    hidden_size: int = 4096
    vocab_size: int = 129280
    norm_eps: float = 1e-6
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    moe_topk: int = 6
    moe_intermediate_size: int = 2048
    route_scale: float = 1.5
    scoring: str = "sqrtsoftplus"
    n_hash_layers: int = 3
    swiglu_limit: float = 10.0
    shared_swiglu_limit: bool = True
    dtype: str = "bfloat16"
    moe_impl: str = "ragged"
    experts_fp4: bool = False  # routed experts as released: packed e2m1 + e8m0 scales (Numerics.experts_fp4)
    shared_fp8: bool = False  # the shared expert's linears FP8 block-scaled, as released (Numerics.fp8_linear)
    # FP4 experts at e4m3 rows: w1 and w3 in one grouped GEMM call (``FP4Experts.ragged_pair``), the same values;
    # faster than two calls at 1 and 8 tokens on the H200
    # (benchmarks/results/archive/fp4_tiles_time_h200_2026-12-03.json)
    gate_up_one_call: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts",
                     "moe_topk", "moe_intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("n_shared_experts", "n_hash_layers"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if self.n_shared_experts > 1:
            raise ValueError(f"n_shared_experts must be 0 or 1 (V4 has one shared expert of "
                             f"moe_intermediate_size), got {self.n_shared_experts}")
        if self.moe_topk > self.n_routed_experts:
            raise ValueError(f"moe_topk ({self.moe_topk}) must be <= n_routed_experts ({self.n_routed_experts})")
        for name, lo_ok in (("norm_eps", False), ("hc_eps", True), ("route_scale", False), ("swiglu_limit", True)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
                    or v < 0 or (v == 0 and not lo_ok):
                raise ValueError(f"{name} must be a finite number {'>= 0' if lo_ok else '> 0'}, got {v!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if not isinstance(self.shared_swiglu_limit, bool):
            raise ValueError(f"shared_swiglu_limit must be a bool, got {self.shared_swiglu_limit!r}")
        if not isinstance(self.experts_fp4, bool):
            raise ValueError(f"experts_fp4 must be a bool, got {self.experts_fp4!r}")
        if self.experts_fp4:
            for name in ("hidden_size", "moe_intermediate_size"):
                if getattr(self, name) % ACT_BLOCK:
                    raise ValueError(f"{name} must be a multiple of {ACT_BLOCK} with experts_fp4 (the experts' inputs "
                                     f"are quantised per {ACT_BLOCK}, their weights per {FP4_WEIGHT_BLOCK}), got "
                                     f"{getattr(self, name)}")

    @property
    def jdtype(self) -> jnp.dtype:
        return DTYPES[self.dtype]

    @property
    def mix_hc(self) -> int:
        """Rows of an HC mixing matrix: hc pre weights, hc post weights, hc x hc comb."""
        return (2 + self.hc_mult) * self.hc_mult

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.n_hash_layers

    @classmethod
    def tiny(cls, **overrides) -> "V4BlockConfig":
        """A CPU-test size with V4-Flash's structure (hc 4, 20 iterations, sqrtsoftplus, hash layers)."""
        base = dict(hidden_size=64, vocab_size=97, n_routed_experts=16, moe_topk=4, moe_intermediate_size=32,
                    n_hash_layers=1)
        base.update(overrides)
        return cls(**base)


# ----------------------------------------------------------------------------------------------------------
# Hyper-connections


def sinkhorn_split(mixes: jax.Array, scale: jax.Array, base: jax.Array, hc: int, iters: int,
                   eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """mixes [..., (2+hc)*hc] -> pre [..., hc], post [..., hc], comb [..., hc, hc] (all float32).

    pre = sigmoid(.) + eps weights the streams into the sub-layer input; post = 2 sigmoid(.) spreads the
    output over the streams; comb starts as a row softmax + eps and is pushed towards doubly stochastic by
    ``iters`` column normalisations with ``iters - 1`` row normalisations in between (each dividing by
    sum + eps), so its columns sum to 1 - O(eps) and its rows approximately to 1."""
    m = mixes.astype(jnp.float32)
    s = scale.astype(jnp.float32)
    b = base.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :hc] * s[0] + b[:hc]) + eps
    post = 2.0 * jax.nn.sigmoid(m[..., hc:2 * hc] * s[1] + b[hc:2 * hc])
    logits = (m[..., 2 * hc:] * s[2] + b[2 * hc:]).reshape(m.shape[:-1] + (hc, hc))
    comb = jax.nn.softmax(logits, axis=-1) + eps

    def col(c: jax.Array) -> jax.Array:
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def row(c: jax.Array) -> jax.Array:
        return c / (jnp.sum(c, axis=-1, keepdims=True) + eps)

    comb = col(comb)
    comb = jax.lax.fori_loop(0, iters - 1, lambda _, c: col(row(c)), comb)
    return pre, post, comb


def _hc_mixes(streams: jax.Array, fn: jax.Array, norm_eps: float) -> tuple[jax.Array, jax.Array]:
    """The streams as float32 [..., hc, d] and their mixes fn . flat(x) / rms(flat(x)) (float32)."""
    x = streams.astype(jnp.float32)
    flat = x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],))
    rsqrt = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    mixes = jnp.einsum("...i,oi->...o", flat, fn.astype(jnp.float32), precision=HIGHEST,
                       preferred_element_type=jnp.float32) * rsqrt
    return x, mixes


def expand_streams(h: jax.Array, hc_mult: int) -> jax.Array:
    """Embedding output [..., d] -> the initial residual streams [..., hc_mult, d] (identical copies)."""
    return jnp.broadcast_to(h[..., None, :], h.shape[:-1] + (hc_mult, h.shape[-1]))


class HyperConnection(nnx.Module):
    """The HC mixing around one sub-layer. ``fn`` [mix_hc, hc*d], ``base`` [mix_hc], ``scale`` [3], float32.

    Streams are [..., hc, d] in the activation dtype; the sub-layer sees [..., d]."""

    def __init__(self, cfg: V4BlockConfig, rngs: nnx.Rngs):
        hc, d = cfg.hc_mult, cfg.hidden_size
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps
        # Random but well-conditioned: mixes ~ N(0, 1) for normalised streams.
        self.fn = nnx.Param(jax.random.normal(rngs.params(), (cfg.mix_hc, hc * d), jnp.float32) * (hc * d) ** -0.5)
        self.base = nnx.Param(0.5 * jax.random.normal(rngs.params(), (cfg.mix_hc,), jnp.float32))
        self.scale = nnx.Param(0.5 + 0.5 * jax.random.uniform(rngs.params(), (3,), jnp.float32))

    def weights(self, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """pre [..., hc], post [..., hc], comb [..., hc, hc] for these streams (float32)."""
        _, mixes = _hc_mixes(streams, self.fn[...], self.norm_eps)
        return sinkhorn_split(mixes, self.scale[...], self.base[...], self.hc, self.iters, self.hc_eps)

    def pre(self, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The sub-layer input sum_j pre_j x_j (streams' dtype) and the (post, comb) to write back with."""
        x, mixes = _hc_mixes(streams, self.fn[...], self.norm_eps)
        pre, post, comb = sinkhorn_split(mixes, self.scale[...], self.base[...], self.hc, self.iters, self.hc_eps)
        y = jnp.sum(pre[..., None] * x, axis=-2)
        return y.astype(streams.dtype), post, comb

    @staticmethod
    def post(out: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
        """New stream k = post_k * out + sum_j comb[j, k] * stream_j, in float32, rounded to the streams' dtype."""
        o = out.astype(jnp.float32)
        r = streams.astype(jnp.float32)
        y = post[..., None] * o[..., None, :] + jnp.einsum("...jk,...jd->...kd", comb, r, precision=HIGHEST)
        return y.astype(streams.dtype)

    def __call__(self, streams: jax.Array, inner: Callable[[jax.Array], jax.Array]) -> jax.Array:
        x, post, comb = self.pre(streams)
        return self.post(inner(x), streams, post, comb)


class HCHead(nnx.Module):
    """The final reduction of the streams before the LM head's norm: sum_j (sigmoid(.) + hc_eps)_j x_j.

    ``fn`` [hc, hc*d], ``base`` [hc], ``scale`` [1] (float32)."""

    def __init__(self, cfg: V4BlockConfig, rngs: nnx.Rngs):
        hc, d = cfg.hc_mult, cfg.hidden_size
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.norm_eps
        self.fn = nnx.Param(jax.random.normal(rngs.params(), (hc, hc * d), jnp.float32) * (hc * d) ** -0.5)
        self.base = nnx.Param(0.5 * jax.random.normal(rngs.params(), (hc,), jnp.float32))
        self.scale = nnx.Param(0.5 + 0.5 * jax.random.uniform(rngs.params(), (1,), jnp.float32))

    def __call__(self, streams: jax.Array) -> jax.Array:
        x, mixes = _hc_mixes(streams, self.fn[...], self.norm_eps)
        pre = jax.nn.sigmoid(mixes * self.scale[...][0] + self.base[...]) + self.hc_eps
        return jnp.sum(pre[..., None] * x, axis=-2).astype(streams.dtype)


# ----------------------------------------------------------------------------------------------------------
# MoE


def router_scores(logits: jax.Array, scoring: str) -> jax.Array:
    """Expert affinities from the float32 router logits: sqrt(softplus), sigmoid or softmax."""
    z = logits.astype(jnp.float32)
    if scoring == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(z))
    if scoring == "sigmoid":
        return jax.nn.sigmoid(z)
    if scoring == "softmax":
        return jax.nn.softmax(z, axis=-1)
    raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


def routing_weights(scores: jax.Array, indices: jax.Array, scoring: str, route_scale: float) -> jax.Array:
    """The chosen experts' weights: the (unbiased) scores at ``indices``, renormalised to sum 1 unless
    softmax, times ``route_scale``."""
    w = jnp.take_along_axis(scores, indices, axis=-1)
    if scoring != "softmax":
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w * route_scale


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, limit)) * clip(up, -limit, limit) in float32; ``limit`` 0 = no clamp."""
    g = gate.astype(jnp.float32)
    u = up.astype(jnp.float32)
    if limit > 0:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, limit)
    return jax.nn.silu(g) * u


def validate_tid2eid(table: np.ndarray, vocab_size: int, topk: int, n_experts: int) -> None:
    """A hash-routing table must be int [vocab, topk] with expert ids in [0, n_experts)."""
    t = np.asarray(table)
    if t.shape != (vocab_size, topk) or not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"tid2eid must be an integer array of shape {(vocab_size, topk)}, got {t.dtype} {t.shape}")
    if t.size and (t.min() < 0 or t.max() >= n_experts):
        raise ValueError(f"tid2eid: expert ids must lie in [0, {n_experts}), got [{t.min()}, {t.max()}]")


def _check_tokens(tokens: jax.Array, vocab_size: int) -> None:
    """Eager range check of the token ids (skipped under tracing, where the caller's host code checks)."""
    if isinstance(tokens, jax.core.Tracer):
        return
    t = np.asarray(tokens)
    if not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"tokens must be integer ids, got {t.dtype}")
    if t.size and (t.min() < 0 or t.max() >= vocab_size):
        raise ValueError(f"tokens: ids must lie in [0, {vocab_size}), got [{t.min()}, {t.max()}]")


class V4Gate(nnx.Module):
    """The router of one layer: ``weight`` [E, d] (activation dtype, used in float32), then either ``bias``
    [E] float32 (score layers) or ``tid2eid`` [vocab, topk] int32 (hash layers)."""

    def __init__(self, cfg: V4BlockConfig, layer_id: int, rngs: nnx.Rngs):
        e, d = cfg.n_routed_experts, cfg.hidden_size
        self.topk, self.scoring, self.route_scale = cfg.moe_topk, cfg.scoring, cfg.route_scale
        self.vocab_size = cfg.vocab_size
        self.hash = cfg.is_hash_layer(layer_id)
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (e, d), jnp.float32) * d ** -0.5).astype(cfg.jdtype))
        if self.hash:
            # Each token id gets topk distinct experts, like a real table.
            keys = jax.random.split(rngs.params(), cfg.vocab_size)
            table = jax.vmap(lambda k: jax.random.permutation(k, e)[:cfg.moe_topk])(keys)
            self.tid2eid = nnx.Param(table.astype(jnp.int32))
        else:
            self.bias = nnx.Param(0.1 * jax.random.normal(rngs.params(), (e,), jnp.float32))

    def scores(self, x: jax.Array) -> jax.Array:
        """Unbiased affinities [T, E] (float32) of normed activations x [T, d]."""
        logits = jnp.einsum("ti,ei->te", x.astype(jnp.float32), self.weight[...].astype(jnp.float32),
                            precision=HIGHEST, preferred_element_type=jnp.float32)
        return router_scores(logits, self.scoring)

    def __call__(self, x: jax.Array, tokens: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(weights [T, k] float32, expert ids [T, k] int32). ``tokens`` [T] is required on hash layers."""
        scores = self.scores(x)
        if self.hash:
            if tokens is None:
                raise ValueError("tokens: a hash-routed layer needs the token ids")
            _check_tokens(tokens, self.vocab_size)
            indices = self.tid2eid[...][tokens.astype(jnp.int32)]
        else:
            _, indices = jax.lax.top_k(scores + self.bias[...], self.topk)
        indices = indices.astype(jnp.int32)
        return routing_weights(scores, indices, self.scoring, self.route_scale), indices


class V4Expert(nnx.Module):
    """One SwiGLU FFN with [out, in] weights (the shared expert). ``fp8``: its three linears are FP8 block-scaled
    as released (the release builds the shared expert with the default FP8 dtype, model.py ``MoE``; its inputs are
    re-quantised to e4m3 per 128 with ue8m0 scales, as every FP8 ``linear()``)."""

    def __init__(self, d: int, f: int, dtype: jnp.dtype, limit: float, rngs: nnx.Rngs, fp8: bool = False):
        self.w1 = Linear(d, f, dtype=dtype, fp8=fp8, rngs=rngs)
        self.w3 = Linear(d, f, dtype=dtype, fp8=fp8, rngs=rngs)
        self.w2 = Linear(f, d, dtype=dtype, fp8=fp8, rngs=rngs)
        self.limit = limit

    def __call__(self, x: jax.Array) -> jax.Array:
        h = swiglu(self.w1(x, x.dtype), self.w3(x, x.dtype), self.limit)
        return self.w2(h.astype(x.dtype), x.dtype)


_RAGGED_DN = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                               lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _ragged_linear(x: jax.Array, w: jax.Array, sizes: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """Rows of x [M, in] grouped by expert (``sizes`` [E]) times their expert's w [E, out, in]^T."""
    prec = HIGHEST if x.dtype == jnp.float32 else None
    y = jax.lax.ragged_dot_general(x, w.astype(x.dtype), sizes, _RAGGED_DN, precision=prec,
                                   preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


class FP4Experts(nnx.Module):
    """A stack of FP4 expert matrices as the release stores them: ``weight`` uint8 [E, out, in/2] (two e2m1
    codes a byte, low nibble = even input column) and ``scale`` uint8 [E, out, in/32] (the e8m0 exponent byte
    of each 1x32 block along the input dim, value 2^(byte - 127)).

    The scales are kept as their e8m0 bytes, not as float32 powers of two: that is the checkpoint's own bytes
    (import / export round-trip bit for bit), a quarter of float32's memory (0.25 instead of 1 bit per weight
    on top of the 4) and what a GPU FP4 kernel reads; turning a byte into its float32 is one shift and bitcast
    (``jds.ops.quant.e8m0_to_f32``). Exported as ``<name>`` / ``<name>.scale`` (jds's ``W`` / ``W.scale``)."""

    _flat_export = True  # names: ffn.w1 (the packed codes) and ffn.w1.scale, not ffn.w1.weight

    def __init__(self, shape: tuple[int, int, int], fan_in: int, rngs: nnx.Rngs, implementation: str = "xla"):
        """``implementation`` picks the grouped GEMM (``pallas_kernels.fp4_grouped_gemm``: "xla", "pallas" or
        "auto"); a ``Decoder`` sets it from its own, as for its FP8 linears."""
        packed, scale = random_fp4_weight(rngs.params(), shape, fan_in ** -0.5)
        self.weight = nnx.Param(packed)
        self.scale = nnx.Param(scale)
        self.implementation = implementation

    def ragged(self, x: jax.Array, sizes: jax.Array, x_scale: jax.Array | None = None,
               out_dtype: jnp.dtype | None = None) -> jax.Array:
        """Rows of x [M, in] grouped by expert (``sizes`` [E]) times their expert's W^T, in ``out_dtype`` (default
        x.dtype). e4m3 rows with their per-128 ``x_scale`` (the release's FP8 x FP4 ``fp4_gemm``) and bf16 rows run
        the grouped FP4 GEMM (the kernel dequantises in registers, reading only the experts that have rows);
        float32 rows (exact numerics) multiply the dequantised stack in float32."""
        if x_scale is not None:
            return fp4_grouped_linear(x, sizes, self.weight[...], self.scale[...], x_scale=x_scale,
                                      out_dtype=out_dtype or jnp.bfloat16, implementation=self.implementation)
        if x.dtype != jnp.bfloat16:
            return _ragged_linear(x, self.dequant(x.dtype), sizes, out_dtype or x.dtype)
        return fp4_grouped_linear(x, sizes, self.weight[...], self.scale[...], out_dtype=out_dtype or x.dtype,
                                  implementation=self.implementation)

    def ragged_pair(self, other: "FP4Experts", x: jax.Array, sizes: jax.Array, x_scale: jax.Array,
                    out_dtype: jnp.dtype) -> jax.Array:
        """[x W^T, x W_other^T] ([M, 2 out]) of e4m3 rows grouped by expert with their per-128 ``x_scale``: one
        grouped FP4 GEMM call over both stacks (``fp4_grouped_linear`` with weight sets)."""
        return fp4_grouped_linear(x, sizes, (self.weight[...], other.weight[...]),
                                  (self.scale[...], other.scale[...]), x_scale=x_scale, out_dtype=out_dtype,
                                  implementation=self.implementation)

    def dequant(self, dtype: jnp.dtype, index: jax.Array | None = None) -> jax.Array:
        """The float weights [E, out, in] (or those of experts ``index`` [..., out, in]) in ``dtype``: exact,
        since an e2m1 value times a power of two has 2 significant bits."""
        w, s = self.weight[...], self.scale[...]
        if index is not None:
            w, s = w[index], s[index]
        return fp4_dequant(w, s, dtype)


def _expert_input(x: jax.Array, fp4: bool) -> jax.Array:
    """What an expert GEMM multiplies: with FP4 experts the release's ``linear()`` first quantises its input to
    e4m3 per 128 with power-of-two (ue8m0) scales (``act_quant``, amax floor 1e-4); q * s is exact in bf16, so the
    dequantised input times the dequantised weight, accumulated in float32, is the FP8 x FP4 GEMM up to the
    float32 summation order."""
    return fake_quant(x, ACT_BLOCK, "ue8m0").astype(x.dtype) if fp4 else x


class V4MoE(nnx.Module):
    """Routed experts ``w1``/``w3`` [E, f, d], ``w2`` [E, d, f] + shared expert, with the V4 gate. Input:
    ffn-normed activations [T, d] and their token ids [T].

    Routed experts are activation-dtype weights (``nnx.Param``), or with ``cfg.experts_fp4`` ``FP4Experts`` as
    the release stores them, multiplied by the grouped FP4 GEMM (``FP4Experts.ragged``: the kernel on a GPU,
    dequantise + ragged dot in XLA elsewhere; the gather path dequantises the picked experts) with each
    expert GEMM's input re-quantised to e4m3 per 128 as the release does (``_expert_input``)."""

    def __init__(self, cfg: V4BlockConfig, layer_id: int, rngs: nnx.Rngs):
        e, d, f, dt = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.jdtype
        self.cfg = cfg
        self.gate = V4Gate(cfg, layer_id, rngs)
        if cfg.experts_fp4:
            init = lambda shape, fan_in: FP4Experts(shape, fan_in, rngs)  # noqa: E731
        else:
            init = lambda shape, fan_in: nnx.Param(  # noqa: E731
                (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in ** -0.5).astype(dt))
        self.w1 = init((e, f, d), d)
        self.w3 = init((e, f, d), d)
        self.w2 = init((e, d, f), f)
        if cfg.n_shared_experts:
            self.shared = V4Expert(d, f, dt, cfg.swiglu_limit if cfg.shared_swiglu_limit else 0.0, rngs,
                                   fp8=cfg.shared_fp8)

    def expert_weights(self, name: str, dtype: jnp.dtype, index: jax.Array | None = None) -> jax.Array:
        """Routed expert matrix ``name`` (w1 / w3 / w2) as [E, out, in] (or at ``index``) in ``dtype``."""
        w = getattr(self, name)
        if isinstance(w, FP4Experts):
            return w.dequant(dtype, index)
        w = w[...] if index is None else w[...][index]
        return w.astype(dtype)

    def routed(self, x: jax.Array, weights: jax.Array, indices: jax.Array) -> jax.Array:
        """sum_k (expert_{idx_k} with weight_k) (x), float32 [T, d]; each expert's output rounded to x.dtype."""
        if self.cfg.moe_impl == "gather":
            return self._routed_gather(x, weights, indices)
        return self._routed_ragged(x, weights, indices)

    def _grouped(self, name: str, x: jax.Array | tuple[jax.Array, jax.Array], sizes: jax.Array,
                 dt: jnp.dtype) -> jax.Array:
        """Expert matrix ``name`` applied to rows grouped by expert (``_expert_rows``: an array, or FP4 experts'
        (e4m3 rows, scales) pair), in ``dt``."""
        w = getattr(self, name)
        if isinstance(x, tuple):
            return w.ragged(x[0], sizes, x_scale=x[1], out_dtype=dt)
        if isinstance(w, FP4Experts):
            return w.ragged(x, sizes)
        return _ragged_linear(x, self.expert_weights(name, x.dtype), sizes, x.dtype)

    def _gate_up(self, xs: jax.Array | tuple[jax.Array, jax.Array], sizes: jax.Array,
                 dt: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """(w1 rows, w3 rows) of the grouped rows. FP4 experts with e4m3 rows and ``gate_up_one_call``: one
        grouped GEMM call over both weight sets (``FP4Experts.ragged_pair``: one row layout and copy of x, both
        stacks' units spread over the GPU together); the same values as two calls (each output row is the same
        per-set sum)."""
        if (self.cfg.gate_up_one_call and isinstance(xs, tuple) and isinstance(self.w1, FP4Experts)
                and isinstance(self.w3, FP4Experts)):
            f = self.cfg.moe_intermediate_size
            y = self.w1.ragged_pair(self.w3, xs[0], sizes, xs[1], dt)
            return y[:, :f], y[:, f:]
        return self._grouped("w1", xs, sizes, dt), self._grouped("w3", xs, sizes, dt)

    def _expert_rows(self, x: jax.Array, rows: jax.Array | None = None):
        """The expert GEMMs' input (``_expert_input``) at ``rows``. bf16 into FP4 experts: the release's
        ``linear()`` quantisation itself, (e4m3 rows, per-128 scales), which the FP4 kernel takes as they are (the
        release's ``fp4_gemm``; its "fp8" route, faster than bf16 rows of the same values at every measured size,
        1 to 4096 tokens: benchmarks/results/archive/kernels_fp4_grouped_h200_2026-12-02_fourteenth.json);
        quantised per token row before the gather."""
        if self.cfg.experts_fp4 and x.dtype == jnp.bfloat16:
            xq, sx = act_quant(x, ACT_BLOCK, "ue8m0")
            return (xq, sx) if rows is None else (xq[rows], sx[rows])
        xe = _expert_input(x, self.cfg.experts_fp4)
        return xe if rows is None else xe[rows]

    def _routed_gather(self, x: jax.Array, weights: jax.Array, indices: jax.Array) -> jax.Array:
        dt, fp4 = x.dtype, self.cfg.experts_fp4
        prec = HIGHEST if dt == jnp.float32 else None
        mm = lambda a, w, eq: jnp.einsum(eq, a, w, precision=prec,  # noqa: E731
                                         preferred_element_type=jnp.float32).astype(dt)
        w1, w3, w2 = (self.expert_weights(n, dt, indices) for n in ("w1", "w3", "w2"))  # [T, k, ., .]
        xq = _expert_input(x, fp4)
        h = swiglu(mm(xq, w1, "ti,tkoi->tko"), mm(xq, w3, "ti,tkoi->tko"), self.cfg.swiglu_limit)
        h = _expert_input((h * weights[..., None]).astype(dt), fp4)
        y = mm(h, w2, "tki,tkoi->tko")
        return jnp.sum(y.astype(jnp.float32), axis=1)

    def _routed_ragged(self, x: jax.Array, weights: jax.Array, indices: jax.Array) -> jax.Array:
        dt = x.dtype
        t, k = indices.shape
        flat = indices.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        rows = order // k  # token of each sorted (token, slot) pair
        sizes = jnp.bincount(flat, length=self.cfg.n_routed_experts).astype(jnp.int32)
        xs = self._expert_rows(x, rows)  # the quantisation is per token row: done once, before the gather
        h = swiglu(*self._gate_up(xs, sizes, dt), self.cfg.swiglu_limit)
        h = self._expert_rows((h * weights.reshape(-1)[order][:, None]).astype(dt))
        y = self._grouped("w2", h, sizes, dt)
        # Un-sort with a permutation (no scatter-add), then sum the k slots in slot order: deterministic, and
        # the same summation as the gather path.
        y = jnp.zeros_like(y).at[order].set(y).reshape(t, k, -1)
        return jnp.sum(y.astype(jnp.float32), axis=1)

    def __call__(self, x: jax.Array, tokens: jax.Array | None = None) -> jax.Array:
        weights, indices = self.gate(x, tokens)
        y = self.routed(x, weights, indices)
        if self.cfg.n_shared_experts:
            y = y + self.shared(x).astype(jnp.float32)
        return y.astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# The block


class V4Block(nnx.Module):
    """One V4 decoder layer minus its attention, which the caller passes as a function [T, d] -> [T, d].

    ``__call__`` is the whole layer; ``pre_attention`` / ``post_attention`` are its two halves for a runner
    that places the attention's cache work in between (as ``jds.model.DecoderLayer`` is split)."""

    def __init__(self, cfg: V4BlockConfig, layer_id: int, rngs: nnx.Rngs, jitter: float = 0.1):
        d = cfg.hidden_size
        self.cfg, self.layer_id = cfg, layer_id
        self.hc_attn = HyperConnection(cfg, rngs)
        self.hc_ffn = HyperConnection(cfg, rngs)
        self.attn_norm = nnx.Param(1.0 + jitter * jax.random.normal(rngs.params(), (d,), jnp.float32))
        self.ffn_norm = nnx.Param(1.0 + jitter * jax.random.normal(rngs.params(), (d,), jnp.float32))
        self.ffn = V4MoE(cfg, layer_id, rngs)

    def pre_attention(self, streams: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """(attention input = attn_norm(hc pre-mix) [T, d], the (post, comb) that post_attention needs)."""
        x, post, comb = self.hc_attn.pre(streams)
        return rms_norm(x, self.attn_norm[...], self.cfg.norm_eps), (post, comb)

    def post_attention(self, streams: jax.Array, attn_out: jax.Array, mix: tuple[jax.Array, jax.Array],
                       tokens: jax.Array | None) -> jax.Array:
        """Write the attention output back into the streams, then the HC-wrapped MoE."""
        streams = HyperConnection.post(attn_out, streams, *mix)
        x, post, comb = self.hc_ffn.pre(streams)
        y = self.ffn(rms_norm(x, self.ffn_norm[...], self.cfg.norm_eps), tokens)
        return HyperConnection.post(y, streams, post, comb)

    def __call__(self, streams: jax.Array, attn_fn: Callable[[jax.Array], jax.Array],
                 tokens: jax.Array | None = None) -> jax.Array:
        """streams [T, hc, d] -> streams [T, hc, d]; ``tokens`` [T] (needed on hash-routed layers)."""
        if streams.ndim != 3 or streams.shape[1:] != (self.cfg.hc_mult, self.cfg.hidden_size):
            raise ValueError(f"streams must be [T, {self.cfg.hc_mult}, {self.cfg.hidden_size}], got {streams.shape}")
        x, mix = self.pre_attention(streams)
        return self.post_attention(streams, attn_fn(x), mix, tokens)


def block(layer: V4Block, streams: jax.Array, attn_fn: Callable[[jax.Array], jax.Array],
          tokens: jax.Array | None = None) -> jax.Array:
    """Functional spelling of ``layer(streams, attn_fn, tokens)``."""
    return layer(streams, attn_fn, tokens)
