"""Import HuggingFace-layout DeepSeek-V3.2 / V4 checkpoints (config.json + *.safetensors) as jds checkpoints.

``convert_hf_checkpoint(src, out)`` maps every tensor of a jds ``Decoder`` to its HF tensor(s), checks
names, shapes and dtypes from the safetensors headers *before* reading any data, then streams tensor by tensor
(memory-mapped reads, see ``jds.safetensors_io``) into an orbax checkpoint (``jds.checkpoint``) written
atomically: on any error there is no output directory. ``export_hf`` is the inverse (used by the tests to
write synthetic HF checkpoints; it also documents the mapping in code).

FP8 weights: an FP8 checkpoint (``quantization_config.quant_method == "fp8"``, 128x128 blocks) stores a linear
as an e4m3 ``weight`` plus a float32 block scale; HF V3.2 calls it ``weight_scale_inv``, V4 calls it ``scale``.
Both are the multiplier (W_real = W_fp8 * s[i//128, j//128]), i.e. exactly jds's ``W.scale``. By default the
e4m3 bits and scales are kept (the model gets ``Numerics.fp8_linear = True``); ``dequantize=True`` multiplies
them out in float32 and rounds once to the activation dtype (bf16), giving ``fp8_linear = False``. Tensors jds
keeps in bf16/fp32 (MoE experts other than V4's FP4 ones and the V3-style block's FP8 ones; a V3.2 checkpoint
whose routed experts are stored e4m3 imports them as stored by default (``Numerics.experts_fp8``, with a
preset-named ``numerics``, hidden and expert widths multiples of 128), stacked into e4m3 [E, out, in] +
float32 scales [E, out/128, in/128], and ``numerics_overrides={"experts_fp8": False}`` dequantises them; the
V3-style block's shared experts, router, head,
norms, indexer weights_proj, V4 compressors) are always dequantised (the V4 block's shared expert stays FP8), and so is V4's ``wo_a``: the release's conversion
dequantises it and its layer runs a plain bf16 einsum (``Numerics.wo_a_fp8`` keeps it FP8 instead, a named
departure). V4's compressor weights are held in the activation dtype, or in float32 where the checkpoint stores
them F32 (``Numerics.compressor_float32``, read from the first compressor's header dtype).

V4 FP4 routed experts (config.json ``expert_dtype: "fp4"``; each ``ffn.experts.j.w{1,2,3}.weight`` I8 [out, in/2],
two e2m1 codes a byte, low nibble first, and ``.scale`` F8_E8M0 [out, in/32], one per 1x32 block along the input
dim): into DeepSeek-V4's block (``block="v4"``) they import AS STORED by default (a preset-named ``numerics`` gets
``Numerics.experts_fp4 = True``; the bytes are stacked into uint8 ``ffn.w1`` [E, out, in/2] and ``ffn.w1.scale``
[E, out, in/32], bit for bit), and ``export_hf`` writes them back the same way. With ``experts_fp4`` off
(``dequantize=True``, ``numerics_overrides={"experts_fp4": False}`` or an explicit Numerics) and in jds's V3-style
block they are dequantised to bf16 (exact: 2 significant bits times a power of two); that model then skips the
release's e4m3 quantisation of the experts' inputs. With it on, every routed expert must be stored FP4 (else a
ValueError names the tensor), and an e8m0 NaN scale byte (0xFF) is refused.

``quantization_config`` is read for both V3.2 and V4 (:func:`quantization_config`): ``quant_method`` (block
fp8), ``fmt`` (e4m3), ``weight_block_size`` ([128, 128]), ``activation_scheme`` (dynamic) and ``scale_fmt``;
any other value is a ValueError naming the field. ``scale_fmt`` says how activations are quantised at run time:
"ue8m0" (power-of-two scales) or absent (DeepSeek's reference then uses plain amax/448 scales); the model's
numerics take it (``Numerics.act_scale_fmt``, and for V3.2 ``latent_scale_fmt``: :func:`apply_scale_fmt`), so
every activation quantiser runs the checkpoint's format. V4 runs "ue8m0" only. The validated values are stored in the converted checkpoint's
``extra["quantization"]`` and logged. ``rope_scaling.mscale_all_dim`` must equal ``mscale`` (jds applies
``mscale`` only, as DeepSeek's reference does), else a ValueError names it.

Name mapping (jds name, DESIGN.md "Weight dictionaries" <- HF tensor), ``i`` = layer, ``j`` = expert:

  V3.2 (HF ``model.`` layout)                         V4 (DeepSeek-native layout of the V4 release)
  embed.weight        <- model.embed_tokens.weight      <- embed.weight
  head.norm           <- model.norm.weight              <- norm.weight
  head.lm_head        <- lm_head.weight                 <- head.weight
  layers.i.attn_norm  <- model.layers.i.input_layernorm.weight           <- layers.i.attn_norm.weight
  layers.i.ffn_norm   <- model.layers.i.post_attention_layernorm.weight  <- layers.i.ffn_norm.weight
  V3.2 attention, prefix model.layers.i.self_attn.:   V4 attention, prefix layers.i.attn. (same names as jds):
    attn.wq_a   <- q_a_proj           attn.kv_norm <- kv_a_layernorm     wq_a, wkv, wq_b, wo_a, wo_b (+ .scale),
    attn.q_norm <- q_a_layernorm      attn.wkv_b   <- kv_b_proj          q_norm, kv_norm, attn_sink (no .weight),
    attn.wq_b   <- q_b_proj           attn.wo      <- o_proj             compressor.{wkv,wgate,norm}, compressor.ape,
    attn.wkv_a  <- kv_a_proj_with_mqa attn.indexer.{wq_b,wk,k_norm,weights_proj} <- indexer.*   indexer.{wq_b,
                                                                         weights_proj}, indexer.compressor.*
  FFN, dense:   ffn.w1 <- mlp.gate_proj, ffn.w3 <- mlp.up_proj, ffn.w2 <- mlp.down_proj   (V4: ffn.w1/w3/w2)
  FFN, MoE:     ffn.gate <- mlp.gate (V4: ffn.gate); ffn.shared.w1/w3/w2 <- mlp.shared_experts.gate/up/down_proj
                (V4: ffn.shared_experts.w1/w3/w2); ffn.w1[j] <- mlp.experts.j.gate_proj.weight TRANSPOSED,
                ffn.w3[j] <- up_proj^T, ffn.w2[j] <- down_proj^T (V4: ffn.experts.j.w1/w3/w2): jds stacks the
                experts as [E, in, out] for ragged_dot, HF stores one [out, in] matrix per expert.
  V4 block (ModelConfig.block == "v4", DeepSeek-V4's own decoder block; names as the release's inference/model.py):
                layers.i.hc_{attn,ffn}.{fn,base,scale} <- layers.i.hc_{attn,ffn}_{fn,base,scale};
                head.hc.{fn,base,scale} <- hc_head_{fn,base,scale}; ffn.gate.weight <- ffn.gate.weight;
                ffn.gate.bias <- ffn.gate.bias (or HF-transformers' ffn.gate.e_score_correction_bias) on score-routed
                layers, ffn.gate.tid2eid <- ffn.gate.tid2eid (integer, ids checked) on the first n_hash_layers;
                ffn.w1/w3/w2[j] <- ffn.experts.j.w1/w3/w2 NOT transposed (the V4 block stacks [E, out, in]), bf16
                or FP8 (dequantised), or packed FP4 (as stored: ffn.w1 + ffn.w1.scale, or dequantised, see above);
                ffn.shared.w1/w3/w2 <- ffn.shared_experts.w1/w3/w2. A V4 config.json with ``hc_mult`` selects
                this block.
  V4 MTP modules (jds.mtp; ModelConfig.mtp_layers <- config.json ``num_nextn_predict_layers`` or the release's
                ``n_mtp_layers``, block v4 only), k < mtp_layers: mtp.k.e_proj / h_proj <- mtp.k.e_proj / h_proj
                (+ .scale, FP8 like the attention's linears); mtp.k.enorm / hnorm / norm <- mtp.k.{enorm,hnorm,
                norm}.weight; mtp.k.hc_head.{fn,base,scale} <- mtp.k.hc_head_{fn,base,scale}; and a whole V4 layer
                of layer id ``mtp_layer_id(k)`` under the main layers' names with the prefix mtp.k. (attn.*, norms,
                hc_attn_* / hc_ffn_*, ffn.gate.*, ffn.experts.j.*, ffn.shared_experts.*; its wo_a dequantised as
                the main layers'). The embedding and the LM head are shared: an ``mtp.k.`` name containing
                ``emb`` or ending in ``head.weight`` is skipped (the release's convert.py drops them); without MTP
                modules (mtp_layers 0, e.g. ``--override mtp_layers=0``) every ``mtp.*`` tensor is skipped with
                ``MTP_REJECTED``.
  Linear tensors are ``<name>.weight`` (+ scale); jds ``W`` / ``W.scale``. V4's fused ``wq_a_wkv`` module
  exports/loads as the separate ``wq_a`` and ``wkv`` tensors already (jds.nn.FusedLinear), so no split here.
  MLA/indexer RoPE layouts need no permutation: HF stores DeepSeek's own layout (DeepSeek's convert.py
  only renames), which is what jds.v32 reads (interleaved MLA rope, NeoX indexer rope).

Skipped HF tensors (reported, never silently): layers >= the converted layer count (``--layers N``) and
V3.2's MTP layer (model.layers.{num_hidden_layers}); V3.2 ``mlp.gate.e_score_correction_bias``;
``rotary_emb.inv_freq``; ``mtp.*`` unless the model has MTP modules (see above). With V4 attention in jds's V3-style block (``block="v3"``) also
``ffn.gate.bias`` / ``ffn.gate.tid2eid`` and the ``hc_*`` tensors (that block has no selection bias, hash
routing or hyper-connections: imported real weights then run a structural decoder, not DeepSeek-V4's forward);
with ``block="v4"`` those are used. Anything else not mapped is an error
(``allow_unexpected`` downgrades it). The report lists every HF tensor as used or skipped with its reason.

Config mapping: attention fields via ``V32Config/V4Config.from_hf_config``; ``num_hidden_layers`` -> n_layers
(or ``layers``), ``vocab_size``, ``intermediate_size``, ``n_routed_experts``, ``num_experts_per_tok`` ->
moe_topk, ``n_shared_experts``, ``moe_intermediate_size``, ``bos/eos_token_id``. jds uses one FFN kind in every
layer, so a MoE checkpoint whose first ``first_k_dense_replace`` layers are dense converts only with
``layers <= first_k_dense_replace`` (all dense); otherwise a ValueError names that field. jds-only fields
(e.g. the cache ``block_size``) take their defaults unless given in ``overrides``.

Sources the names were checked against (no code copied):
  * HF transformers 5.17 (read in the GPU image): ``models/deepseek_v32/modeling_deepseek_v32.py`` module names
    (``self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_proj}``,
    ``self_attn.indexer.{wq_b,wk,k_norm(LayerNorm: weight+bias),weights_proj}``, ``mlp.{gate_proj,up_proj,
    down_proj}``, ``mlp.gate.{weight,e_score_correction_bias}``, ``mlp.shared_experts``, ``input_layernorm``,
    ``post_attention_layernorm``, ``model.embed_tokens``, ``model.norm``, ``lm_head``; model_type
    ``deepseek_v32``) and ``conversion_mapping.py`` (deepseek_v32 uses the per-expert checkpoint layout
    ``mlp.experts.*.{gate,up,down}_proj.weight``; the ``deepseek_v4`` entry renames the released checkpoint's
    names ``embed.weight``, ``head.weight``, ``norm.weight``, ``.attn.``, ``.ffn.``, ``.attn_norm.``,
    ``.ffn_norm.``, ``.attn_sink``, ``.wq_a.``, ``.wkv.``, ``.wq_b.``, ``.wo_a.``, ``.wo_b.``, ``.q_norm.``,
    ``.wgate.``, compressor ``.norm.`` and ``.ape``, ``.indexer.wq_b.``, ``.indexer.weights_proj.``,
    ``.indexer.compressor.``, ``.gate.bias``, ``.shared_experts.w1/w2/w3.``, ``.experts.*.w1.weight``,
    ``hc_*``); ``modeling_deepseek_v4.py`` for shapes (compressor position bias [ratio, coff*d], coff = 2 at
    ratio 4; a hash-routed layer's gate has a ``weight`` and a ``tid2eid`` table; every V4 layer is MoE).
  * vLLM ``vllm/model_executor/models/deepseek_v4.py`` (weights mapper / ``load_weights``): the ``.scale``
    suffix of V4 block scales (float8_e8m0fnu when the experts are FP4, float32 otherwise), ``mtp.*``.
  * DeepSeek-V3/V3.2 ``inference/convert.py`` HF->DeepSeek name table (public copies): gate_proj->w1,
    down_proj->w2, up_proj->w3, weight_scale_inv->scale; MTP layer = ``model.layers.{num_hidden_layers}``.
  * DeepSeek-V4-Flash's release code, read in the public mirror ``Mockingjay1316/deepseek-v4-flash-spark``
    (commit 0825add, the first with real files; ``Nicooo-Wang/DeepSeek-V4-Pro-code`` has the same convert.py):
    ``inference/convert.py`` (``FP4_TABLE`` = e2m1 values by code; ``cast_e2m1fn_to_e4m3fn``: asserts int8
    [out, in/2], unpacks ``low = x & 0x0F`` before ``high = x >> 4`` along the input dim, scale [out, in/32]; the
    scale tensor is the weight's name with ``weight`` -> ``scale``; experts stay FP4 unless ``--expert-dtype
    fp8``), ``inference/model.py`` (``Linear`` for ``float4_e2m1fn_x2``: weight [out, in/2], ``scale`` [out, in/32]
    float8_e8m0fnu; ``linear()`` calls ``act_quant(x, 128, scale_fmt)`` then ``fp4_gemm``; ``MoE`` builds the
    routed experts FP4 when ``expert_dtype == "fp4"``, the shared expert in the default FP8),
    ``inference/kernel.py`` (``fp4_gemm``), ``inference/config.json`` (``"expert_dtype": "fp4"``); the V4-Pro
    copy's top-level HF ``config.json`` carries ``"expert_dtype": "fp4"`` beside the FP8 ``quantization_config``.
  * The safetensors writer/reader was cross-checked against the ``safetensors`` package (0.8.0, GPU image):
    each reads the other's files bit-exactly (F32, BF16, F8_E4M3, F8_E8M0, I8).
UNVERIFIED:
  * V4 dense-FFN names ``layers.N.ffn.w{1,2,3}`` (the released V4 has a MoE in every layer; DeepSeek naming).
  * No real FP4 or real V4 / V3.2 safetensors file was read (the I8 / F8_E8M0 header dtypes of the FP4
    experts come from the reference's asserts and dtypes and from third-party notes, not from a file).
  * V4's ``.scale`` suffix and its dtypes come from vLLM only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal

import logging

import ml_dtypes
import numpy as np

from jds.checkpoint import DEFAULT_SHARD_BYTES, CheckpointWriter
from jds.safetensors_io import INDEX_NAME, SafetensorsDir, read_json, write_safetensors

log = logging.getLogger(__name__)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BLOCK = 128
SCALE_SUFFIX = {"v32": ".weight_scale_inv", "v4": ".scale"}
FLOAT_DTYPES = ("F32", "BF16", "F16")
SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")
FP4_BLOCK = 32
FP4_WEIGHT_DTYPES = ("I8", "U8")  # the release stores int8 (convert.py asserts it); the bytes are what count
EXPERT_DTYPES = (None, "fp4")  # config.json ``expert_dtype`` (the release's ModelArgs: Literal[None, "fp4"])
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
NUMERICS = ("reference", "bf16", "serving", "exact")


# ----- the mapping -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One jds tensor and where it comes from.

    kind ``linear``: HF ``{hf}.weight`` [out, in] (+ the block scale ``{hf}{suffix}``) -> jds ``jds`` (+ ``.scale``)
    kind ``param``:  HF ``{hf}`` as is -> jds ``jds``
    kind ``experts``: HF ``{hf[j]}.weight`` [out, in] for each expert j -> jds ``jds`` [E, in, out] (transposed)
    kind ``experts_oi``: the same stacked as [E, out, in] (the V4 block's experts; no transpose); with FP4 experts
      (``Numerics.experts_fp4``) the packed bytes [E, out, in/2] and ``.scale`` bytes [E, out, in/32] as stored
    kind ``index``: an integer HF tensor (V4's hash-routing table ``tid2eid``) -> jds int32
    A ``param`` with several ``hf`` names takes the first one the checkpoint has (spellings of one tensor).
    """

    jds: str
    hf: tuple[str, ...]
    kind: Literal["linear", "param", "experts", "experts_oi", "index"]


def _lin(j: str, h: str) -> Entry:
    return Entry(j, (h,), "linear")


def _par(j: str, h: str) -> Entry:
    return Entry(j, (h,), "param")


def plan(cfg: Any) -> list[Entry]:
    """Every jds tensor of ``cfg``'s Decoder with its HF source (the mapping table above, in code)."""
    v4 = cfg.arch == "v4"
    if v4:
        out = [_par("embed.weight", "embed.weight")]
    else:
        out = [_par("embed.weight", "model.embed_tokens.weight")]
    for i in range(cfg.n_layers):
        J = f"layers.{i}."
        if v4:
            P = f"layers.{i}."
            out += _v4_attention_layer(cfg, i, J, P)
            F = P + "ffn."
            names = {"w1": "w1", "w3": "w3", "w2": "w2"}
        else:
            P = f"model.layers.{i}."
            A = P + "self_attn."
            out += [_par(J + "attn_norm", P + "input_layernorm.weight"),
                    _par(J + "ffn_norm", P + "post_attention_layernorm.weight")]
            out += [_lin(J + "attn.wq_a", A + "q_a_proj"), _par(J + "attn.q_norm", A + "q_a_layernorm.weight"),
                    _lin(J + "attn.wq_b", A + "q_b_proj"), _lin(J + "attn.wkv_a", A + "kv_a_proj_with_mqa"),
                    _par(J + "attn.kv_norm", A + "kv_a_layernorm.weight"), _lin(J + "attn.wkv_b", A + "kv_b_proj"),
                    _lin(J + "attn.wo", A + "o_proj"),
                    _lin(J + "attn.indexer.wq_b", A + "indexer.wq_b"), _lin(J + "attn.indexer.wk", A + "indexer.wk"),
                    _par(J + "attn.indexer.k_norm.weight", A + "indexer.k_norm.weight"),
                    _par(J + "attn.indexer.k_norm.bias", A + "indexer.k_norm.bias"),
                    _lin(J + "attn.indexer.weights_proj", A + "indexer.weights_proj")]
            F = P + "mlp."
            names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        if v4 and cfg.block == "v4":
            out += _v4_block_layer(cfg, i, J, P)
            continue
        dense = {k: F + v for k, v in names.items()}
        expert = lambda j, k: f"{F}experts.{j}.{names[k]}"  # noqa: E731
        shared = {k: F + "shared_experts." + v for k, v in names.items()}
        gate = F + "gate"
        if cfg.n_routed_experts:
            out.append(_lin(J + "ffn.gate", gate))
            kind = "experts_oi" if cfg.numerics.experts_fp8 else "experts"  # FP8 experts stack [E, out, in]
            for k in ("w1", "w3", "w2"):
                out.append(Entry(J + "ffn." + k, tuple(expert(j, k) for j in range(cfg.n_routed_experts)), kind))
            out += [_lin(J + "ffn.shared." + k, shared[k]) for k in ("w1", "w3", "w2")]
        else:
            out += [_lin(J + "ffn." + k, dense[k]) for k in ("w1", "w3", "w2")]
    if v4:
        out += [_par("head.norm", "norm.weight"), _lin("head.lm_head", "head")]
        if cfg.block == "v4":
            out += [_par("head.hc." + k, "hc_head_" + k) for k in ("fn", "base", "scale")]
        for k in range(cfg.mtp_layers):
            out += _mtp_module(cfg, k)
    else:
        out += [_par("head.norm", "model.norm.weight"), _lin("head.lm_head", "lm_head")]
    return out


def _v4_attention_layer(cfg: Any, layer_id: int, J: str, P: str) -> list[Entry]:
    """A V4 layer's attention tensors and its two norms (kind ``compress_ratios[layer_id]``)."""
    A = P + "attn."
    out = [_par(J + "attn_norm", P + "attn_norm.weight"), _par(J + "ffn_norm", P + "ffn_norm.weight")]
    out += [_lin(J + "attn." + n, A + n) for n in ("wq_a", "wkv", "wq_b", "wo_a", "wo_b")]
    out += [_par(J + "attn.q_norm", A + "q_norm.weight"), _par(J + "attn.kv_norm", A + "kv_norm.weight"),
            _par(J + "attn.attn_sink", A + "attn_sink")]
    ratio = cfg.attn.compress_ratios[layer_id]
    if ratio:
        out += _compressor(J + "attn.compressor.", A + "compressor.")
    if ratio == 4:
        out += [_lin(J + "attn.indexer.wq_b", A + "indexer.wq_b"),
                _lin(J + "attn.indexer.weights_proj", A + "indexer.weights_proj")]
        out += _compressor(J + "attn.indexer.compressor.", A + "indexer.compressor.")
    return out


def _mtp_module(cfg: Any, k: int) -> list[Entry]:
    """MTP module ``k`` (jds.mtp; the release's ``mtp.{k}.``): its input mixer, a whole V4 layer of layer id
    ``cfg.mtp_layer_id(k)`` under the same names as a main layer, and its own HC head and final norm. The
    embedding and the LM head are the main model's (not stored under ``mtp.``)."""
    J = P = f"mtp.{k}."
    out = [_lin(J + "e_proj", P + "e_proj"), _lin(J + "h_proj", P + "h_proj")]
    out += [_par(J + n, P + n + ".weight") for n in ("enorm", "hnorm", "norm")]
    out += [_par(J + "hc_head." + x, P + "hc_head_" + x) for x in ("fn", "base", "scale")]
    layer_id = cfg.mtp_layer_id(k)
    return out + _v4_attention_layer(cfg, layer_id, J, P) + _v4_block_layer(cfg, layer_id, J, P)


def _v4_block_layer(cfg: Any, i: int, J: str, P: str) -> list[Entry]:
    """The V4 block's tensors of layer ``i`` besides attention and norms (names as in DeepSeek's V4 release,
    ``inference/model.py``: ``Block.hc_{attn,ffn}_{fn,base,scale}``, ``Gate.{weight,bias,tid2eid}``,
    ``MoE.experts.j.w{1,2,3}``, ``MoE.shared_experts``)."""
    F = P + "ffn."
    out = [_par(f"{J}hc_{sub}.{k}", f"{P}hc_{sub}_{k}") for sub in ("attn", "ffn") for k in ("fn", "base", "scale")]
    out.append(_par(J + "ffn.gate.weight", F + "gate.weight"))
    if i < cfg.n_hash_layers:
        out.append(Entry(J + "ffn.gate.tid2eid", (F + "gate.tid2eid",), "index"))
    else:  # HF-transformers exports spell the selection bias e_score_correction_bias
        out.append(Entry(J + "ffn.gate.bias", (F + "gate.bias", F + "gate.e_score_correction_bias"), "param"))
    for k in ("w1", "w3", "w2"):
        out.append(Entry(J + "ffn." + k, tuple(f"{F}experts.{j}.{k}" for j in range(cfg.n_routed_experts)),
                         "experts_oi"))
    out += [_lin(J + "ffn.shared." + k, F + "shared_experts." + k) for k in ("w1", "w3", "w2")]
    return out


def _compressor(j: str, h: str) -> list[Entry]:
    return [_lin(j + "wkv", h + "wkv"), _lin(j + "wgate", h + "wgate"), _par(j + "ape", h + "ape"),
            _par(j + "norm", h + "norm.weight")]


MTP_REJECTED = ("MTP module: not imported (the model has mtp_layers=0: config.json has no "
                "num_nextn_predict_layers, or an override set mtp_layers=0)")
MTP_SHARED = ("MTP copy of the shared embedding / LM head (the release's convert.py drops it; jds.mtp uses the "
              "main ones)")


def skip_reason(name: str, arch: str, n_layers: int, block: str = "v3", mtp_layers: int = 0) -> str | None:
    """Why an HF tensor without a jds counterpart may be skipped (None: it may not).

    With the V4 block the hyper-connection, router-bias and hash-table tensors are used, so they are never
    skipped (an unused one is an error). ``mtp.*`` tensors are used when the model has MTP modules
    (``mtp_layers``), except copies of the shared embedding / head; without MTP modules they are skipped with
    ``MTP_REJECTED``."""
    m = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
    if m and int(m.group(1)) >= n_layers:
        return "layer beyond the converted stack (--layers) or an MTP layer"
    if "rotary_emb.inv_freq" in name:
        return "rotary table (recomputed)"
    if arch == "v32":
        if name.endswith(".mlp.gate.e_score_correction_bias"):
            return "MoE routing bias (jds's router has none)"
        return None
    if name.startswith("mtp."):
        if block != "v4":
            return "MTP module"
        m = re.match(r"mtp\.(\d+)\.", name)
        if mtp_layers and m and int(m.group(1)) < mtp_layers:
            # convert.py:105 of the release: mtp names containing "emb" or ending in "head.weight" are not loaded
            return MTP_SHARED if ("emb" in name or name.endswith("head.weight")) else None
        return MTP_REJECTED if not mtp_layers else "MTP module beyond the model's mtp_layers"
    if block == "v4":
        return None
    if re.search(r"(^|\.)hc_", name):
        return "hyper-connection (jds's V4 decoder has none)"
    if re.search(r"\.ffn\.gate\.(bias|tid2eid)$", name):
        return "MoE routing bias / hash table (jds's router has neither)"
    return None


def released_fp8(cfg: Any, name: str) -> bool:
    """Linears an FP8 release stores as e4m3 + scale although the model runs them in bf16 (V4's ``wo_a``:
    dequantised at conversion); the importer dequantises them (the model holds them in bf16)."""
    return (cfg.arch == "v4" and cfg.numerics.fp8_linear and not cfg.numerics.wo_a_fp8
            and re.fullmatch(r"(layers|mtp)\.\d+\.attn\.wo_a", name) is not None)


def target_spec(cfg: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """jds name -> (shape, dtype) of every parameter of ``Decoder(cfg)``, without allocating it
    (``nnx.eval_shape`` of the model itself: its FP8 linears quantise in jnp at init, so they trace)."""
    from flax import nnx

    from jds.model import Decoder
    from jds.nn import _param_paths

    abstract = nnx.eval_shape(lambda: Decoder(cfg))
    spec: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for name, (owner, attr, rows) in _param_paths(abstract).items():
        v = getattr(owner, attr).get_value()
        shape = tuple(v.shape) if rows is None else (rows[1] - rows[0],) + tuple(v.shape[1:])
        spec[name] = (shape, np.dtype(v.dtype))
    return spec


def _check_plan(entries: list[Entry], spec: dict[str, Any]) -> None:
    covered = []
    for e in entries:
        covered.append(e.jds)
        if e.kind in ("linear", "experts_oi") and e.jds + ".scale" in spec:
            covered.append(e.jds + ".scale")
    missing = [n for n in spec if n not in set(covered)]
    unknown = [n for n in covered if n not in spec]
    if missing or unknown or len(covered) != len(set(covered)):
        raise ValueError(f"internal: the HF mapping does not match the jds model (unmapped {missing[:3]}, "
                         f"unknown {unknown[:3]}, {len(covered) - len(set(covered))} duplicates)")


# ----- config.json <-> ModelConfig ---------------------------------------------------------------------
def hf_arch(d: dict[str, Any]) -> str:
    mt = str(d.get("model_type", ""))
    if mt == "deepseek_v4" or (not mt.startswith("deepseek_v3") and "compress_ratios" in d):
        return "v4"
    if mt in ("deepseek_v32", "deepseek_v3_2") or "index_topk" in d:
        return "v32"
    raise ValueError(f"invalid config field 'model_type': {mt!r} is not a DeepSeek-V3.2 or V4 config "
                     "(no index_topk / compress_ratios either)")


_V4_LAYER_TYPE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def normalize_v4_config(d: dict[str, Any]) -> dict[str, Any]:
    """Fold the newer transformers spelling of a V4 config.json into the released one jds.config reads.

    Released V4 configs carry ``compress_ratios`` (0/4/128 per layer, + the MTP layer), ``qk_rope_head_dim``
    and a YaRN ``rope_scaling``; transformers' DeepseekV4Config writes ``layer_types`` (+ ``compress_rates``),
    ``partial_rotary_factor`` and ``rope_parameters = {"main": {...}, "compress": {...}}`` instead.
    """
    from jds.config import _hf_float, _hf_int, _hf_mapping

    d = dict(d)
    if d.get("compress_ratios") is None and d.get("layer_types") is not None:
        if not isinstance(d["layer_types"], list):
            raise ValueError(f"invalid config field 'layer_types': expected a list, got {d['layer_types']!r}")
        rates = dict(_V4_LAYER_TYPE_RATIO)
        compress_rates = _hf_mapping(d, "compress_rates")
        for k in compress_rates:
            rates[k] = _hf_int(compress_rates, k, 0, "compress_rates.")
        ratios = []
        for t in d["layer_types"]:
            if t not in rates:
                raise ValueError(f"invalid config field 'layer_types': unknown V4 layer type {t!r}")
            ratios.append(rates[t])
        d["compress_ratios"] = ratios
    if d.get("qk_rope_head_dim") is None and d.get("partial_rotary_factor") and d.get("head_dim"):
        d["qk_rope_head_dim"] = int(round(_hf_int(d, "head_dim", 0) * _hf_float(d, "partial_rotary_factor", 0.0)))
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        comp, main = rp["compress"], rp.get("main") or {}
        if not isinstance(main, dict):
            raise ValueError(f"invalid config field 'rope_parameters.main': expected a JSON object, got {main!r}")
        if main.get("rope_theta") is not None:
            d.setdefault("rope_theta", main["rope_theta"])
        if comp.get("rope_theta") is not None:
            d.setdefault("compress_rope_theta", comp["rope_theta"])
        if not d.get("rope_scaling") and comp.get("rope_type", comp.get("type")) == "yarn":
            d["rope_scaling"] = {k: v for k, v in comp.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return d


QUANT_METHODS = ("fp8", "deepseek_v4_fp8")
QUANT_FMTS = ("e4m3",)
ACTIVATION_SCHEMES = ("dynamic",)
# scale_fmt spellings: "ue8m0" (power-of-two activation scales, what jds implements) and the plain amax/448
# scales DeepSeek's reference uses when the field is absent or null (``act_quant(..., scale_fmt=None)``).
SCALE_FMTS = ("ue8m0", "amax")
QUANT_KEYS = ("quant_method", "fmt", "scale_fmt", "weight_block_size", "activation_scheme")


def quantization_config(d: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config``, validated and normalised (None for an unquantised checkpoint).

    Returns ``quant_method``, ``fmt``, ``scale_fmt`` ("ue8m0" or "amax"), ``weight_block_size`` and
    ``activation_scheme``. A value jds does not know is a ValueError naming the field; absent fields take
    the meaning DeepSeek's reference gives them (fmt e4m3, dynamic activations, 128x128 blocks, and, for
    ``scale_fmt``, plain amax/448 scales), and ``defaulted`` lists which ones were absent; ``unread`` lists
    other keys (reported by :func:`describe_quantization`, not interpreted).
    """
    qc = d.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"invalid config field 'quantization_config': expected an object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(f"invalid config field 'quantization_config.quant_method': {method!r} is not supported "
                         f"(only block FP8: {', '.join(QUANT_METHODS)})")
    defaulted = [k for k in ("fmt", "scale_fmt", "weight_block_size", "activation_scheme") if qc.get(k) is None]
    fmt = qc.get("fmt") or "e4m3"
    if fmt not in QUANT_FMTS:
        raise ValueError(f"invalid config field 'quantization_config.fmt': {fmt!r}, jds supports "
                         f"{', '.join(QUANT_FMTS)}")
    block = qc.get("weight_block_size")
    block = [BLOCK, BLOCK] if block is None else block
    if not isinstance(block, (list, tuple)) or list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"invalid config field 'quantization_config.weight_block_size': {block!r}, jds needs "
                         f"[{BLOCK}, {BLOCK}]")
    scheme = qc.get("activation_scheme") or "dynamic"
    if scheme not in ACTIVATION_SCHEMES:
        raise ValueError(f"invalid config field 'quantization_config.activation_scheme': {scheme!r}, jds supports "
                         f"{', '.join(ACTIVATION_SCHEMES)} (activations quantised per 1x{BLOCK} group at run time)")
    scale_fmt = qc.get("scale_fmt")
    scale_fmt = "amax" if scale_fmt is None else scale_fmt
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"invalid config field 'quantization_config.scale_fmt': {scale_fmt!r}, expected "
                         "'ue8m0' or absent/null (plain amax/448 scales)")
    unread = sorted(k for k in qc if k not in QUANT_KEYS)
    return {"quant_method": method, "fmt": fmt, "scale_fmt": scale_fmt, "weight_block_size": [BLOCK, BLOCK],
            "activation_scheme": scheme, "defaulted": defaulted, "unread": unread}


def describe_quantization(quant: dict[str, Any] | None) -> str:
    """One line for logs: what the checkpoint says about its quantisation."""
    if quant is None:
        return "unquantised (no quantization_config)"
    text = (f"quantization_config: quant_method={quant['quant_method']} fmt={quant['fmt']} "
            f"scale_fmt={quant['scale_fmt']} weight_block_size={quant['weight_block_size']} "
            f"activation_scheme={quant['activation_scheme']}")
    if quant["defaulted"]:
        text += f" (absent, taken as default: {', '.join(quant['defaulted'])})"
    if quant.get("unread"):
        text += f" (other keys, not interpreted: {', '.join(quant['unread'])})"
    return text


def is_fp8_checkpoint(d: dict[str, Any]) -> bool:
    """True for a block-FP8 checkpoint (``quantization_config.quant_method`` fp8, 128x128 blocks)."""
    return quantization_config(d) is not None


def quantises_activations(numerics: Any) -> bool:
    """Whether a model run with ``numerics`` quantises any activation with jds's activation scales
    (fp8 linears re-quantise their inputs, the FP8 indexer its q/k, the FP8 caches their records)."""
    return bool(numerics.fp8_linear or numerics.indexer_fp8 or numerics.kv_cache_dtype == "fp8")


def override_numerics(numerics: Any, over: dict[str, Any]) -> Any:
    """``numerics`` with fields replaced; an unknown field or a bad value is a ValueError naming it.
    ``fp8_linear`` is not among them: it follows the stored weights (``dequantize``)."""
    names = {f.name for f in dataclasses.fields(numerics)} - {"fp8_linear"}
    for k in over:
        if k not in names:
            raise ValueError(f"invalid numerics field {k!r}: choose from {sorted(names)} (fp8_linear follows the "
                             "stored weights: --dequantize)")
    return dataclasses.replace(numerics, **over)


def apply_scale_fmt(quant: dict[str, Any] | None, numerics: Any, arch: str, explicit: bool) -> Any:
    """The numerics with the checkpoint's activation scale format: its FP8 linears, indexer q / k and (V3.2)
    latent records quantise with ``quantization_config.scale_fmt`` ("ue8m0", or absent: DeepSeek's plain
    amax/448), as the model's own ``act_quant(..., scale_fmt)`` does. A preset name takes it over; an explicit
    Numerics that disagrees is a ValueError (a departure must be spelled out, not converted silently).
    """
    if quant is None:
        return numerics
    fmt = quant["scale_fmt"]
    if arch == "v4" and fmt != "ue8m0":
        raise ValueError(f"invalid config field 'quantization_config.scale_fmt': {fmt!r} (plain amax/448) for a "
                         "DeepSeek-V4 checkpoint; V4's caches store e8m0 scale exponents, so jds's V4 runs "
                         "'ue8m0' scales only")
    if explicit:
        bad = [f for f in ("act_scale_fmt",) + (("latent_scale_fmt",) if arch == "v32" else ())
               if getattr(numerics, f) != fmt and quantises_activations(numerics)]
        if bad:
            raise ValueError(f"numerics.{bad[0]}={getattr(numerics, bad[0])!r} differs from the checkpoint's "
                             f"'quantization_config.scale_fmt' ({fmt!r})")
        return numerics
    over = {"act_scale_fmt": fmt} | ({"latent_scale_fmt": fmt} if arch == "v32" else {})
    return dataclasses.replace(numerics, **over)


def check_rope_mscale(d: dict[str, Any]) -> None:
    """jds (like DeepSeek's reference) scales the YaRN softmax by ``mscale`` alone; HF's modeling code uses
    ``mscale_all_dim`` there and rescales cos/sin by their ratio. The two agree only when they are equal."""
    rs = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(rs, dict) or rs.get("mscale_all_dim") is None:
        return
    if rs.get("rope_type", rs.get("type", "default")) in (None, "default"):
        return
    mscale = 1.0 if rs.get("mscale") is None else rs["mscale"]  # absent: DeepSeek's reference default
    all_dim = rs["mscale_all_dim"]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (mscale, all_dim))
    if not numbers or float(all_dim) != float(mscale):
        raise ValueError(f"invalid config field 'rope_scaling.mscale_all_dim': {all_dim!r} differs from "
                         f"rope_scaling.mscale={mscale!r}; jds implements only mscale_all_dim == mscale")


def _int_field(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if isinstance(v, list) and v:
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"invalid config field {key!r}: missing from config.json or not an integer ({v!r})")
    return v


def make_numerics(numerics: Any, fp8: bool) -> Any:
    from jds.config import Numerics

    if isinstance(numerics, str):
        if numerics not in NUMERICS:
            raise ValueError(f"invalid config field 'numerics': {numerics!r}, choose one of {NUMERICS}")
        numerics = getattr(Numerics, numerics)()
    return dataclasses.replace(numerics, fp8_linear=fp8)


def hf_model_config(hf: Any, *, layers: int | None = None, dequantize: bool = False, numerics: Any = "reference",
                    overrides: dict[str, Any] | None = None, numerics_overrides: dict[str, Any] | None = None,
                    stored_experts: str | None = None, stored_compressor: str | None = None,
                    stored_weights_proj: str | None = None) -> Any:
    """The jds ModelConfig of a HF config.json (path, directory or dict).

    ``layers`` keeps the first N layers; ``numerics`` is a Numerics or a preset name whose ``fp8_linear`` is
    set to (checkpoint is FP8 and not ``dequantize``) and whose scale formats follow the checkpoint
    (:func:`apply_scale_fmt`); ``numerics_overrides`` then replaces Numerics fields (explicit departures, e.g.
    ``{"indexer_hadamard": False}``; an unknown field is a ValueError); ``overrides`` sets ModelConfig or
    attention-config fields that config.json lacks (e.g. ``{"block_size": 16}``). ``stored_experts``: the
    safetensors dtype of the first routed expert's weight (``convert_hf_checkpoint`` reads it from the headers):
    "F8_E4M3" with a preset-named ``numerics`` keeps the V3-style block's routed experts FP8 as stored
    (``Numerics.experts_fp8``); None or another dtype dequantises them. ``stored_compressor``: the safetensors
    dtype of V4's first compressor weight: "F32" with a preset-named ``numerics`` holds the compressors in float32
    as stored (``Numerics.compressor_float32``); otherwise they are held in the activation dtype.
    ``stored_weights_proj``: the same for the first indexer's ``weights_proj`` (``Numerics.weights_proj_float32``).
    """
    from jds.config import V32Config, V4Config, _hf_int, _load_json
    from jds.model import ModelConfig

    d = _load_json(hf)
    arch = hf_arch(d)
    if arch == "v4":
        d = normalize_v4_config(d)
    attn_cls = V32Config if arch == "v32" else V4Config
    attn_fields = {f.name for f in dataclasses.fields(attn_cls)}
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"arch", "attn", "numerics"}
    attn_ovr, model_ovr = {}, {}
    for k, v in (overrides or {}).items():
        if k in attn_fields:
            attn_ovr[k] = tuple(v) if isinstance(v, list) else v
        elif k in model_fields:
            model_ovr[k] = v
        else:
            raise ValueError(f"invalid config field {k!r}: not a field of ModelConfig or {attn_cls.__name__}")
    attn = attn_cls.from_hf_config(d, **attn_ovr)
    n_hf = _int_field(d, "num_hidden_layers")
    n = n_hf if layers is None else layers
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= n_hf:
        raise ValueError(f"invalid config field 'layers': {n!r} must be in [1, num_hidden_layers={n_hf}]")
    n_routed = _hf_int(d, "n_routed_experts", 0) if d.get("n_routed_experts") else 0
    if n_routed < 0:
        raise ValueError(f"invalid config field 'n_routed_experts': {n_routed!r} must be >= 0")
    first_dense = (_hf_int(d, "first_k_dense_replace", 0) if d.get("first_k_dense_replace") else 0) if n_routed else n
    if n_routed and d.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"invalid config field 'moe_layer_freq': {d['moe_layer_freq']!r}, jds supports 1")
    if n_routed and 0 < first_dense < n:
        raise ValueError(f"invalid config field 'first_k_dense_replace': layers 0..{first_dense - 1} are dense and "
                         f"the rest MoE, but the jds Decoder uses one FFN kind in every layer; convert with "
                         f"layers <= {first_dense} (all dense)")
    moe = bool(n_routed) and first_dense == 0
    kw: dict[str, Any] = dict(arch=arch, attn=attn, n_layers=n, vocab_size=_int_field(d, "vocab_size"),
                              n_routed_experts=int(n_routed) if moe else 0)
    if d.get("intermediate_size") is not None or not moe:
        kw["intermediate_size"] = _int_field(d, "intermediate_size")
    for field_, key in (("n_shared_experts", "n_shared_experts"), ("moe_topk", "num_experts_per_tok"),
                        ("moe_intermediate_size", "moe_intermediate_size")):
        if d.get(key) is not None or moe:
            kw[field_] = _int_field(d, key)
    if moe and kw["n_shared_experts"] < 1:
        raise ValueError("invalid config field 'n_shared_experts': jds's MoE always has a shared expert (>= 1)")
    for field_, key, default in (("bos_token_id", "bos_token_id", 0), ("eos_token_id", "eos_token_id", 1)):
        kw[field_] = _int_field(d, key) if d.get(key) is not None else default
    if arch == "v4" and moe:
        kw.update(_v4_block_fields(d))
    check_rope_mscale(d)
    quant = quantization_config(d)
    kw["numerics"] = apply_scale_fmt(quant, make_numerics(numerics, quant is not None and not dequantize), arch,
                                     explicit=not isinstance(numerics, str))
    if arch == "v4" and isinstance(numerics, str) and kw["numerics"].indexer_fp8:
        # the released V4 indexer quantises q and keys to MXFP4 (a preset that quantises the indexer does so)
        kw["numerics"] = dataclasses.replace(kw["numerics"], indexer_fp4=True)
    block = model_ovr.get("block", kw.get("block", "v3"))
    if expert_dtype(d) == "fp4" and block == "v4" and isinstance(numerics, str) and not dequantize:
        # the release's routed experts are packed FP4: held as stored (the V3-style block dequantises them)
        kw["numerics"] = dataclasses.replace(kw["numerics"], experts_fp4=True)
    if (stored_experts == "F8_E4M3" and block == "v3" and moe and quant is not None and not dequantize
            and isinstance(numerics, str) and _int_field(d, "hidden_size") % 128 == 0
            and kw["moe_intermediate_size"] % 128 == 0):
        # the routed experts as the checkpoint stores them, run by the grouped FP8 GEMM
        kw["numerics"] = dataclasses.replace(kw["numerics"], experts_fp8=True)
    if arch == "v4" and stored_compressor == "F32" and isinstance(numerics, str):
        # float32 compressor weights as the checkpoint stores them (rounding them to bf16 would change them)
        kw["numerics"] = dataclasses.replace(kw["numerics"], compressor_float32=True)
    if stored_weights_proj == "F32" and isinstance(numerics, str):
        # a float32 weights_proj as stored (the checkpoints seen store it BF16)
        kw["numerics"] = dataclasses.replace(kw["numerics"], weights_proj_float32=True)
    if numerics_overrides:
        kw["numerics"] = override_numerics(kw["numerics"], numerics_overrides)
    if arch == "v4" and block == "v4" and mtp_layers(d):
        kw["mtp_layers"] = mtp_layers(d)  # the MTP modules ride with DeepSeek-V4's block only (jds.mtp)
    kw.update(model_ovr)
    return ModelConfig(**kw)


_MTP_KEYS = ("num_nextn_predict_layers", "n_mtp_layers")  # HF config.json, then the release's ModelArgs name


def mtp_layers(d: dict[str, Any]) -> int:
    """The number of MTP modules a config.json declares (0 if absent); a non-integer or negative value, or two
    spellings that disagree, is a ValueError naming the field."""
    given = [(k, d[k]) for k in _MTP_KEYS if d.get(k) is not None]
    for k, v in given:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"invalid config field {k!r}: {v!r} must be an integer >= 0")
    if len({v for _, v in given}) > 1:
        raise ValueError(f"invalid config field {given[0][0]!r}: {given[0][1]!r} disagrees with "
                         f"{given[1][0]!r}={given[1][1]!r}")
    return given[0][1] if given else 0


def expert_dtype(d: dict[str, Any]) -> str | None:
    """config.json's ``expert_dtype``: "fp4" (V4 releases: routed experts stored as packed e2m1 + e8m0 scales)
    or absent / null (experts stored like the other weights); anything else is a ValueError naming the field."""
    v = d.get("expert_dtype")
    if v not in EXPERT_DTYPES:
        raise ValueError(f"invalid config field 'expert_dtype': {v!r}, expected 'fp4' or absent/null")
    return v


# ModelConfig field <- config.json keys (HF-transformers spelling first, then the release's inference/config.json)
_V4_BLOCK_KEYS: dict[str, tuple[str, ...]] = {
    "hc_mult": ("hc_mult",), "hc_sinkhorn_iters": ("hc_sinkhorn_iters",), "hc_eps": ("hc_eps",),
    "route_scale": ("routed_scaling_factor", "route_scale"), "scoring": ("scoring_func", "score_func"),
    "n_hash_layers": ("num_hash_layers", "n_hash_layers"), "swiglu_limit": ("swiglu_limit",),
}


def _v4_block_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The V4-block ModelConfig fields of a V4 MoE config.json. A config with ``hc_mult`` describes DeepSeek-V4's
    block (``block="v4"``); one without it (jds's V3-style decoder around V4 attention) keeps ``block="v3"``.
    Two spellings of one field that disagree are a ValueError naming both."""
    from jds.config import _hf_float

    if d.get("hc_mult") is None:
        return {}
    out: dict[str, Any] = {"block": "v4"}
    for field_, keys in _V4_BLOCK_KEYS.items():
        given = [(k, d[k]) for k in keys if d.get(k) is not None]
        if len({json.dumps(v) for _, v in given}) > 1:
            raise ValueError(f"invalid config field {given[0][0]!r}: {given[0][1]!r} disagrees with "
                             f"{given[1][0]!r}={given[1][1]!r}")
        if given:
            out[field_] = (_hf_float(d, given[0][0], 0.0) if field_ in ("hc_eps", "route_scale", "swiglu_limit")
                           else given[0][1])
    return out


def hf_config_dict(cfg: Any, *, fp8: bool | None = None) -> dict[str, Any]:
    """A HF config.json for ``cfg`` (inverse of :func:`hf_model_config` up to jds-only fields)."""
    a = cfg.attn
    fp8 = cfg.numerics.fp8_linear if fp8 is None else fp8
    d: dict[str, Any] = {
        "num_hidden_layers": cfg.n_layers, "vocab_size": cfg.vocab_size, "hidden_size": a.hidden_size,
        "num_attention_heads": a.n_heads, "q_lora_rank": a.q_lora_rank,
        "index_n_heads": a.index_n_heads, "index_head_dim": a.index_head_dim, "index_topk": a.index_topk,
        "rope_theta": a.rope_theta, "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.rms_norm_eps,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.n_routed_experts or None, "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.moe_topk, "first_k_dense_replace": 0 if cfg.n_routed_experts else cfg.n_layers,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    if cfg.arch == "v32":
        d.update(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], kv_lora_rank=a.kv_lora_rank,
                 qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
                 rope_scaling={"type": "yarn", "factor": a.rope_factor, "original_max_position_embeddings":
                               a.original_seq_len, "beta_fast": a.beta_fast, "beta_slow": a.beta_slow,
                               "mscale": a.mscale, "mscale_all_dim": a.mscale})
        if a.indexer_rope_interleave:
            d["indexer_rope_interleave"] = True
    else:
        d.update(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], head_dim=a.head_dim,
                 qk_rope_head_dim=a.rope_head_dim, o_lora_rank=a.o_lora_rank, o_groups=a.o_groups,
                 sliding_window=a.window_size, compress_ratios=list(a.compress_ratios),
                 compress_rope_theta=a.compress_rope_theta,
                 rope_scaling={"type": "yarn", "factor": a.rope_factor, "original_max_position_embeddings":
                               a.original_seq_len, "beta_fast": a.beta_fast, "beta_slow": a.beta_slow})
        if cfg.block == "v4":
            d.update(hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                     routed_scaling_factor=cfg.route_scale, scoring_func=cfg.scoring,
                     num_hash_layers=cfg.n_hash_layers, swiglu_limit=cfg.swiglu_limit,
                     num_nextn_predict_layers=cfg.mtp_layers)
    if cfg.numerics.experts_fp4:
        d["expert_dtype"] = "fp4"
    if fp8:
        d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0"}
    return d


# ----- numeric conversions -----------------------------------------------------------------------------
def scale_to_f32(s: np.ndarray) -> np.ndarray:
    """A block-scale tensor (F32, BF16 or ue8m0 F8_E8M0) as float32; all three convert exactly."""
    return np.asarray(s).astype(np.float32)


def dequant_fp8_blocks(w: np.ndarray, scale: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """float32 W = W_e4m3 * scale[i // block, j // block] (the same float32 product as jds.ops.quant)."""
    o, i = w.shape
    s = np.repeat(np.repeat(scale_to_f32(scale), block, axis=0)[:o], block, axis=1)[:, :i]
    return np.asarray(w).astype(np.float32) * s


def dequant_fp4_e2m1(packed: np.ndarray, scale: np.ndarray, block: int = FP4_BLOCK) -> np.ndarray:
    """float32 W [out, in] from int8-packed e2m1 [out, in/2] (low nibble = even column) and 1x``block`` scales."""
    b = np.asarray(packed).view(np.uint8)
    o, half = b.shape
    vals = np.empty((o, 2 * half), np.float32)
    vals[:, 0::2] = _FP4_VALUES[b & 0x0F]
    vals[:, 1::2] = _FP4_VALUES[b >> 4]
    return vals * np.repeat(scale_to_f32(scale), block, axis=1)


# ----- validation (headers only) and conversion ----------------------------------------------------------
@dataclass
class _Job:
    entry: Entry
    modes: list[str]  # per HF source: fp8 | float | dequant | fp4 (dequantised) | fp4_stored (kept)
    out: list[tuple[str, tuple[int, ...], np.dtype]]  # jds tensors produced
    nbytes: int
    n_experts: int = 0  # an index job's range of expert ids


def _block_shape(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, int]:
    return (-(-shape[0] // block), -(-shape[1] // block))


def _check_linear(src: SafetensorsDir, hf: str, shape: tuple[int, ...], fp8: bool, suffix: str, jds: str,
                  consumed: set[str]) -> str:
    """Check one HF linear (weight + optional scale) from its header; return how to convert it."""
    wname, sname = hf + ".weight", hf + suffix
    if wname not in src:
        raise ValueError(f"HF checkpoint {src.path!r}: missing tensor {wname!r} (for jds {jds!r})")
    dt, shp = src.info(wname)
    has_scale = sname in src
    consumed.add(wname)
    if has_scale:
        consumed.add(sname)

    def need_shape(want: tuple[int, ...]) -> None:
        if tuple(shp) != tuple(want):
            raise ValueError(f"HF tensor {wname!r} has shape {tuple(shp)}, expected {tuple(want)} (for jds {jds!r})")

    def need_scale(want: tuple[int, ...]) -> None:
        if not has_scale:
            raise ValueError(f"HF checkpoint {src.path!r}: missing tensor {sname!r}, the block scale of the {dt} "
                             f"weight {wname!r}")
        sdt, sshp = src.info(sname)
        if sdt not in SCALE_DTYPES:
            raise ValueError(f"HF tensor {sname!r} has dtype {sdt}, expected one of {SCALE_DTYPES}")
        if tuple(sshp) != tuple(want):
            raise ValueError(f"HF tensor {sname!r} has shape {tuple(sshp)}, expected {tuple(want)} "
                             f"(the block scales of {wname!r})")

    if fp8:
        if dt != "F8_E4M3":
            raise ValueError(f"HF tensor {wname!r} has dtype {dt}, expected F8_E4M3 with a {suffix!r} block scale "
                             f"(the fp8 model keeps e4m3 weights for jds {jds!r}; convert with --dequantize "
                             "for a bf16 model)")
        need_shape(shape)
        need_scale(_block_shape(shape))
        return "fp8"
    if dt in FLOAT_DTYPES:
        need_shape(shape)
        if has_scale:
            raise ValueError(f"HF tensor {wname!r} has dtype {dt} but also a block scale {sname!r}")
        return "float"
    if dt == "F8_E4M3":
        need_shape(shape)
        need_scale(_block_shape(shape))
        return "dequant"
    if dt in ("I8", "U8") and has_scale and len(shape) == 2 and shape[1] % FP4_BLOCK == 0 \
            and tuple(shp) == (shape[0], shape[1] // 2):
        need_scale((shape[0], shape[1] // FP4_BLOCK))
        return "fp4"
    raise ValueError(f"HF tensor {wname!r} has dtype {dt}{list(shp)}; expected {list(shape)} as one of "
                     f"{FLOAT_DTYPES} or F8_E4M3 with a block scale (for jds {jds!r})")


def _check_fp4_expert(src: SafetensorsDir, hf: str, shape: tuple[int, int], suffix: str, jds: str,
                      consumed: set[str]) -> str:
    """Check one routed expert matrix that the model holds as stored FP4 (logical [out, in] = ``shape``):
    ``{hf}.weight`` I8/U8 [out, in/2] and ``{hf}{suffix}`` F8_E8M0 [out, in/32], from the headers."""
    wname, sname = hf + ".weight", hf + suffix
    o, i = shape
    if wname not in src:
        raise ValueError(f"HF checkpoint {src.path!r}: missing tensor {wname!r} (for jds {jds!r})")
    dt, shp = src.info(wname)
    consumed.add(wname)
    off = "import with experts_fp4 off (dequantize, or numerics_overrides experts_fp4=False) for bf16 experts"
    if dt not in FP4_WEIGHT_DTYPES or tuple(shp) != (o, i // 2):
        raise ValueError(f"HF tensor {wname!r} is {dt}{list(shp)}, expected packed FP4 "
                         f"({' or '.join(FP4_WEIGHT_DTYPES)} {[o, i // 2]}: two e2m1 codes a byte) for jds {jds!r} "
                         f"with numerics.experts_fp4; {off}")
    if sname not in src:
        raise ValueError(f"HF checkpoint {src.path!r}: missing tensor {sname!r}, the 1x{FP4_BLOCK} e8m0 scales of the "
                         f"packed FP4 weight {wname!r}")
    consumed.add(sname)
    sdt, sshp = src.info(sname)
    if sdt != "F8_E8M0" or tuple(sshp) != (o, i // FP4_BLOCK):
        raise ValueError(f"HF tensor {sname!r} is {sdt}{list(sshp)}, expected F8_E8M0 {[o, i // FP4_BLOCK]} (one "
                         f"power-of-two scale per 1x{FP4_BLOCK} block of {wname!r}, held as stored for jds {jds!r})")
    return "fp4_stored"


INT_DTYPES = ("I32", "I64", "I16", "U8", "I8")


def _check_tensor(src: SafetensorsDir, hf: str, shape: tuple[int, ...], jds: str, consumed: set[str],
                  dtypes: tuple[str, ...], what: str) -> None:
    """``hf`` exists with one of ``dtypes`` (``what`` names them in the error) and ``shape``; marks it consumed."""
    if hf not in src:
        raise ValueError(f"HF checkpoint {src.path!r}: missing tensor {hf!r} (for jds {jds!r})")
    dt, shp = src.info(hf)
    consumed.add(hf)
    if dt not in dtypes:
        raise ValueError(f"HF tensor {hf!r} has dtype {dt}, expected {what} ({', '.join(dtypes)}) for jds {jds!r}")
    if tuple(shp) != tuple(shape):
        raise ValueError(f"HF tensor {hf!r} has shape {tuple(shp)}, expected {tuple(shape)} (for jds {jds!r})")


def _check_param(src: SafetensorsDir, hf: str, shape: tuple[int, ...], jds: str, consumed: set[str]) -> str:
    _check_tensor(src, hf, shape, jds, consumed, FLOAT_DTYPES, "a float tensor")
    return "float"


def _check_index(src: SafetensorsDir, hf: str, shape: tuple[int, ...], jds: str, consumed: set[str]) -> str:
    _check_tensor(src, hf, shape, jds, consumed, INT_DTYPES, "an integer tensor")
    return "index"


def _validate(src: SafetensorsDir, e: Entry, spec: dict[str, Any], suffix: str, consumed: set[str],
              n_experts: int = 0) -> _Job:
    shape, dt = spec[e.jds]
    if e.kind == "param":
        if len(e.hf) > 1:  # alternative spellings: the first the checkpoint has
            e = dataclasses.replace(e, hf=(next((h for h in e.hf if h in src), e.hf[0]),))
        modes = [_check_param(src, e.hf[0], shape, e.jds, consumed)]
    elif e.kind == "index":
        modes = [_check_index(src, e.hf[0], shape, e.jds, consumed)]
    elif e.kind == "linear":
        modes = [_check_linear(src, e.hf[0], shape, dt == E4M3, suffix, e.jds, consumed)]
    else:
        n_exp = shape[0]
        if len(e.hf) != n_exp:
            raise ValueError(f"internal: {e.jds} expects {n_exp} experts, mapping has {len(e.hf)}")
        if e.kind == "experts_oi" and e.jds + ".scale" in spec and dt == E4M3:  # FP8 experts held as stored
            modes = [_check_linear(src, h, (shape[1], shape[2]), True, suffix, e.jds, consumed) for h in e.hf]
        elif e.kind == "experts_oi" and e.jds + ".scale" in spec:  # FP4 experts held as stored (experts_fp4)
            modes = [_check_fp4_expert(src, h, (shape[1], 2 * shape[2]), suffix, e.jds, consumed) for h in e.hf]
        else:  # float experts: bf16 / FP8 / FP4 sources all dequantised
            d_out, d_in = (shape[1], shape[2]) if e.kind == "experts_oi" else (shape[2], shape[1])
            modes = [_check_linear(src, h, (d_out, d_in), False, suffix, e.jds, consumed) for h in e.hf]
    out = [(e.jds, shape, dt)]
    if e.jds + ".scale" in spec and e.kind in ("linear", "experts_oi"):
        out.append((e.jds + ".scale",) + spec[e.jds + ".scale"])
    return _Job(e, modes, out, sum(math.prod(s) * d.itemsize for _, s, d in out), n_experts)


def _read_linear(src: SafetensorsDir, hf: str, mode: str, dtype: np.dtype, suffix: str) -> np.ndarray:
    w = src.get(hf + ".weight")
    if mode == "float":
        return w.astype(dtype, copy=False)
    s = src.get(hf + suffix)
    full = dequant_fp8_blocks(w, s) if mode == "dequant" else dequant_fp4_e2m1(w, s)
    return full.astype(dtype, copy=False)


def _convert(src: SafetensorsDir, job: _Job, suffix: str) -> list[tuple[str, np.ndarray]]:
    e = job.entry
    name, shape, dt = job.out[0]
    if e.kind == "param":
        return [(name, src.get(e.hf[0]).astype(dt, copy=False))]
    if e.kind == "index":
        table = np.asarray(src.get(e.hf[0]))
        if table.size and (table.min() < 0 or table.max() >= _n_experts_of(job)):
            raise ValueError(f"HF tensor {e.hf[0]!r}: expert ids must lie in [0, {_n_experts_of(job)}), got "
                             f"[{table.min()}, {table.max()}]")
        return [(name, table.astype(dt))]
    if e.kind == "linear":
        if job.modes[0] == "fp8":
            return [(name, src.get(e.hf[0] + ".weight")),
                    (name + ".scale", scale_to_f32(src.get(e.hf[0] + suffix)))]
        return [(name, _read_linear(src, e.hf[0], job.modes[0], dt, suffix))]
    if job.modes[0] == "fp8":  # FP8 experts as stored: the e4m3 matrices and their block scales, stacked
        sname, sshape, sdt = job.out[1]
        stack, scales = np.empty(shape, dt), np.empty(sshape, sdt)
        for j, h in enumerate(e.hf):
            stack[j] = src.get(h + ".weight")
            scales[j] = scale_to_f32(src.get(h + suffix))
        return [(name, stack), (sname, scales)]
    if job.modes[0] == "fp4_stored":  # the packed codes and e8m0 bytes, stacked as they are
        sname, sshape, _ = job.out[1]
        codes, scales = np.empty(shape, np.uint8), np.empty(sshape, np.uint8)
        for j, h in enumerate(e.hf):
            codes[j] = np.asarray(src.get(h + ".weight")).view(np.uint8)
            scales[j] = np.asarray(src.get(h + suffix)).view(np.uint8)
            if np.any(scales[j] == 0xFF):
                raise ValueError(f"HF tensor {h + suffix!r}: e8m0 scale byte 0xFF (NaN) at block "
                                 f"{np.argwhere(scales[j] == 0xFF)[0].tolist()}")
        return [(name, codes), (sname, scales)]
    stack = np.empty(shape, dt)
    for j, (h, mode) in enumerate(zip(e.hf, job.modes)):
        w = _read_linear(src, h, mode, dt, suffix)
        stack[j] = w if e.kind == "experts_oi" else w.T
    return [(name, stack)]


def _n_experts_of(job: _Job) -> int:
    return job.n_experts




class _Progress:
    """A plain stderr progress bar (bytes written / total), redrawn at most 10 times a second."""

    def __init__(self, total: int, enabled: bool, stream: Any = None):
        self.total, self.enabled, self.stream = max(total, 1), enabled, stream or sys.stderr
        self.done, self.t0, self.last = 0, time.perf_counter(), 0.0

    def update(self, n: int, label: str) -> None:
        self.done += n
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.1 and self.done < self.total):
            return
        self.last = now
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        self.stream.write(f"\r[{bar}] {100 * frac:5.1f}% {self.done / 2**20:9.1f}/{self.total / 2**20:.1f} MiB "
                          f"{now - self.t0:6.1f}s  {label[:48]:<48}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _stored_expert_dtype(reader: SafetensorsDir, hf_cfg: dict[str, Any]) -> str | None:
    """The header dtype of layer 0's first routed expert (HF V3.2 naming), or None where there is none."""
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    if hf_arch(hf_cfg) != "v32" or not hf_cfg.get("n_routed_experts") or name not in reader:
        return None
    return reader.info(name)[0]


def _first_dtype(reader: SafetensorsDir, pattern: str) -> str | None:
    """The header dtype of the first tensor whose name matches ``pattern`` in full, or None where none does."""
    rx = re.compile(pattern)
    name = next((n for n in reader.names() if rx.fullmatch(n)), None)
    return reader.info(name)[0] if name else None


def _stored_compressor_dtype(reader: SafetensorsDir, hf_cfg: dict[str, Any]) -> str | None:
    """The header dtype of the first V4 compressor's ``wkv`` weight, or None where there is none."""
    if hf_arch(hf_cfg) != "v4":
        return None
    return _first_dtype(reader, r"(?:model\.)?layers\.\d+\.attn\.compressor\.wkv\.weight")


def _stored_weights_proj_dtype(reader: SafetensorsDir, hf_cfg: dict[str, Any]) -> str | None:
    """The header dtype of the first indexer's ``weights_proj`` weight (V3.2 and V4 names), or None."""
    return _first_dtype(reader, r"(?:model\.)?layers\.\d+\.(?:self_attn|attn)\.indexer\.weights_proj\.weight")


def convert_hf_checkpoint(src: str | os.PathLike, out: str | os.PathLike, *, layers: int | None = None,
                          dequantize: bool = False, numerics: Any = "reference",
                          overrides: dict[str, Any] | None = None,
                          numerics_overrides: dict[str, Any] | None = None, overwrite: bool = False,
                          shard_bytes: int = DEFAULT_SHARD_BYTES, allow_unexpected: bool = False,
                          progress: bool = True, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Convert a HF DeepSeek-V3.2/V4 directory into a jds orbax checkpoint at ``out``; returns a report.

    The checkpoint's validated ``quantization_config`` (see :func:`quantization_config`) is stored in the
    checkpoint's ``extra["quantization"]`` and returned as ``report["quantization"]``, so the activation-scale
    path can be chosen from it later; ``extra`` adds caller entries (e.g. a cache fingerprint).

    Every tensor is checked (name, shape, dtype, scale) from the safetensors headers before anything is
    written; conversion then streams tensor by tensor into orbax shards of about ``shard_bytes``. Errors are
    ValueErrors naming the tensor or config field; ``out`` is then left absent (or untouched).
    """
    t0 = time.perf_counter()
    src, out = os.fspath(src), os.fspath(out)
    if os.path.abspath(src) == os.path.abspath(out):
        raise ValueError("the output directory must differ from the HF checkpoint directory")
    cfg_path = os.path.join(src, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"HF checkpoint {src!r}: no config.json")
    hf_cfg = read_json(cfg_path, f"HF checkpoint {src!r}")
    if not isinstance(hf_cfg, dict):
        raise ValueError(f"HF checkpoint {src!r}: config.json is not a JSON object (got {type(hf_cfg).__name__})")
    quant = quantization_config(hf_cfg)
    reader = SafetensorsDir(src)
    cfg = hf_model_config(hf_cfg, layers=layers, dequantize=dequantize, numerics=numerics, overrides=overrides,
                          numerics_overrides=numerics_overrides, stored_experts=_stored_expert_dtype(reader, hf_cfg),
                          stored_compressor=_stored_compressor_dtype(reader, hf_cfg),
                          stored_weights_proj=_stored_weights_proj_dtype(reader, hf_cfg))
    spec = target_spec(cfg)
    entries = plan(cfg)
    _check_plan(entries, spec)
    suffix = SCALE_SUFFIX[cfg.arch]
    consumed: set[str] = set()
    jobs = [_validate(reader, e, spec, suffix, consumed, cfg.n_routed_experts) for e in entries]
    skipped: dict[str, list[str]] = {}
    unexpected = []
    for name in reader.names():
        if name in consumed:
            continue
        why = skip_reason(name, cfg.arch, cfg.n_layers, cfg.block, cfg.mtp_layers)
        if why is None:
            unexpected.append(name)
        else:
            skipped.setdefault(why, []).append(name)
    if unexpected and not allow_unexpected:
        raise ValueError(f"HF checkpoint {src!r}: tensor {unexpected[0]!r} has no place in the jds model "
                         f"({len(unexpected)} such tensors; allow_unexpected / --allow-unexpected skips them)")
    if unexpected:
        skipped["not mapped (allowed)"] = unexpected
    stored = {"source": os.path.abspath(src), "hf_model_type": hf_cfg.get("model_type"),
             "hf_num_hidden_layers": hf_cfg.get("num_hidden_layers"), "layers": cfg.n_layers,
             "dequantized": bool(dequantize), "fp8_source": quant is not None, "quantization": quant,
             "skipped": {k: len(v) for k, v in skipped.items()}, **(extra or {})}
    log.info("HF checkpoint %s: %s", src, describe_quantization(quant))
    bar = _Progress(sum(j.nbytes for j in jobs), progress)
    try:
        with CheckpointWriter(out, cfg, extra=stored, shard_bytes=shard_bytes, overwrite=overwrite) as w:
            for job in jobs:
                produced = _convert(reader, job, suffix)
                for (name, arr), (want, shape, dt) in zip(produced, job.out):
                    if name != want or arr.shape != tuple(shape) or arr.dtype != dt:
                        raise ValueError(f"internal: converted {name!r} as {arr.dtype}{arr.shape}, expected "
                                         f"{dt}{tuple(shape)}")
                    w.add(name, arr)
                bar.update(job.nbytes, job.entry.jds)
    finally:
        bar.close()
    return {"out": os.path.abspath(out), "config": cfg, "quantization": quant,
            "tensors": sum(len(j.out) for j in jobs), "used": sorted(consumed),
            "bytes": sum(j.nbytes for j in jobs), "skipped": skipped, "seconds": time.perf_counter() - t0}


# ----- convert on first use (scripts/serve.py --model) ---------------------------------------------------
CACHE_VERSION = 3  # bump when the conversion's output changes for the same input (2: V4 mtp.* imported;
# 3: the V4 block's shared expert kept FP8 as stored)


def source_fingerprint(src: str | os.PathLike, **options: Any) -> str:
    """A hash of what a conversion depends on: config.json and the index (contents), every safetensors
    file's name, size and mtime (not its bytes: hashing hundreds of GB would cost minutes), the
    conversion ``options`` and the converter's format version."""
    import hashlib

    src = os.fspath(src)
    h = hashlib.sha256(json.dumps({"version": CACHE_VERSION, "options": options}, sort_keys=True).encode())
    for name in ("config.json", INDEX_NAME):
        path = os.path.join(src, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            st = os.stat(os.path.join(src, name))
            h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def default_cache_root(src: str | os.PathLike) -> str:
    """Converted checkpoints of ``src`` live beside it, in ``<src>.jds/``."""
    return os.path.abspath(os.fspath(src)).rstrip(os.sep) + ".jds"


def cached_conversion(src: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                      layers: int | None = None, dequantize: bool = False, numerics: str = "reference",
                      overrides: dict[str, Any] | None = None, numerics_overrides: dict[str, Any] | None = None,
                      progress: bool = True, say: Any = None) -> tuple[str, bool]:
    """The jds checkpoint of HF directory ``src``: converted on first use, then reused; returns (path, hit).

    The converted checkpoint is ``<cache_dir or src.jds>/<name>-<layers>L-<fingerprint[:16]>``; a changed
    source (config, index, a shard's size or mtime) or other options give another directory, and a hit is
    only taken when the stored full fingerprint matches. Conversion is atomic (no partial cache entry).
    """
    say = say or (lambda msg: log.info("%s", msg))
    src = os.fspath(src)
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise ValueError(f"--model {src!r}: not a HF checkpoint directory (no config.json)")
    options = {"layers": layers, "dequantize": bool(dequantize), "numerics": numerics,
               "overrides": dict(sorted((overrides or {}).items()))}
    if numerics_overrides:  # only when given, so the fingerprints of earlier cache entries stay valid
        options["numerics_overrides"] = dict(sorted(numerics_overrides.items()))
    fp = source_fingerprint(src, **options)
    root = os.fspath(cache_dir) if cache_dir is not None else default_cache_root(src)
    base = os.path.basename(os.path.abspath(src).rstrip(os.sep)) or "model"
    path = os.path.join(root, f"{base}-{layers if layers else 'all'}L-{fp[:16]}")

    def hit() -> bool:
        if not os.path.exists(path):
            return False
        from jds.checkpoint import read_meta

        extra = read_meta(path).get("extra", {})  # a ValueError naming the path if not a jds checkpoint
        if extra.get("cache_fingerprint") != fp:
            raise ValueError(f"cache entry {path!r} was written for another source or options (fingerprint "
                             "mismatch); remove it or choose another --cache-dir")
        say(f"using the cached conversion {path}; {describe_quantization(extra.get('quantization'))}")
        return True

    if hit():
        return path, True
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cache directory {root!r} cannot be created ({e.strerror or e}); pass --cache-dir") from None
    say(f"converting {src} to a jds checkpoint at {path} (first use; layers={layers or 'all'})")
    try:
        rep = convert_hf_checkpoint(src, path, layers=layers, dequantize=dequantize, numerics=numerics,
                                    overrides=overrides, numerics_overrides=numerics_overrides, progress=progress,
                                    extra={"cache_fingerprint": fp, "cache_options": options})
    except ValueError:
        if os.path.exists(path) and hit():  # another process converted it meanwhile
            return path, True
        raise
    say(f"converted {rep['tensors']} tensors ({rep['bytes'] / 2**20:.1f} MiB) in {rep['seconds']:.1f}s; "
        f"{describe_quantization(rep['quantization'])}")
    return path, False


# ----- export (the inverse; writes synthetic HF checkpoints for tests) -----------------------------------
def export_hf(model: Any, out_dir: str | os.PathLike, *, n_shards: int = 2, routing_bias: bool = True) -> None:
    """Write ``model`` (a jds Decoder) as a HF-layout directory: config.json, ``n_shards`` safetensors files
    and ``model.safetensors.index.json``. fp8 linears are written as F8_E4M3 + float32 scales under the HF
    scale name; experts are written one [out, in] matrix each (FP4 experts: I8 [out, in/2] + F8_E8M0 scales, as
    the V4 release stores them). With ``routing_bias`` the MoE routing-bias
    tensors real checkpoints carry (zeros here) are added, so the importer's skip path is exercised.
    """
    from jds.nn import export_weights

    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"export_hf: {out_dir!r} exists and is not empty")
    os.makedirs(out_dir, exist_ok=True)
    cfg = model.cfg
    weights = export_weights(model)
    suffix = SCALE_SUFFIX[cfg.arch]
    tensors: list[tuple[str, np.ndarray]] = []
    for e in plan(cfg):
        if e.kind in ("param", "index"):
            tensors.append((e.hf[0], weights[e.jds]))
        elif e.kind == "linear":
            w, s = weights[e.jds], weights.get(e.jds + ".scale")
            if s is None and released_fp8(cfg, e.jds):  # stored FP8 as released, run in bf16 by the model
                from jds.ops.quant import quantize_weight_blocks

                w, s = quantize_weight_blocks(np.asarray(w, np.float32), fmt="ue8m0")
            tensors.append((e.hf[0] + ".weight", w))
            if s is not None:
                tensors.append((e.hf[0] + suffix, s))
        elif e.jds + ".scale" in weights and weights[e.jds].dtype == ml_dtypes.float8_e4m3fn:  # FP8 experts
            for j, h in enumerate(e.hf):
                tensors += [(h + ".weight", np.ascontiguousarray(weights[e.jds][j])),
                            (h + suffix, np.ascontiguousarray(weights[e.jds + ".scale"][j]))]
        elif e.jds + ".scale" in weights:  # FP4 experts as stored: int8 codes + F8_E8M0 scales, as released
            codes, scales = weights[e.jds], weights[e.jds + ".scale"]
            for j, h in enumerate(e.hf):
                tensors += [(h + ".weight", np.ascontiguousarray(codes[j]).view(np.int8)),
                            (h + suffix, np.ascontiguousarray(scales[j]).view(ml_dtypes.float8_e8m0fnu))]
        else:
            tensors += [(h + ".weight", np.ascontiguousarray(weights[e.jds][j] if e.kind == "experts_oi"
                                                             else weights[e.jds][j].T)) for j, h in enumerate(e.hf)]
    if routing_bias and cfg.n_routed_experts and cfg.block == "v3":
        for i in range(cfg.n_layers):
            name = (f"model.layers.{i}.mlp.gate.e_score_correction_bias" if cfg.arch == "v32"
                    else f"layers.{i}.ffn.gate.bias")
            tensors.append((name, np.zeros(cfg.n_routed_experts, np.float32)))
    total = sum(a.nbytes for _, a in tensors)
    n_shards = max(1, min(n_shards, len(tensors)))
    groups: list[list[tuple[str, np.ndarray]]] = [[] for _ in range(n_shards)]
    acc = 0
    for name, arr in tensors:
        k = min(n_shards - 1, acc * n_shards // max(total, 1))
        groups[k].append((name, arr))
        acc += arr.nbytes
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        write_safetensors(os.path.join(out_dir, fname), group, metadata={"format": "pt"})
        weight_map.update({name: fname for name, _ in group})
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f, indent=1)
