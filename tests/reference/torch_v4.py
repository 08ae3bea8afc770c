"""Independent plain-PyTorch oracle for one DeepSeek-V4 attention layer.

Written from ``shared/spec/deepseek_v4_attention.md`` (sections 2, 3, 9), the V3.2 spec's primitive
definitions (section 3) and ``docs/DESIGN.md``; it deliberately shares no code with the JAX implementation
in ``jds`` (only the config dataclasses are read), so the two can check each other.

The layer keeps DeepSeek's "full sequence" interface: ``forward(x[B, S, hidden], start_pos)`` with
per-batch-row history, so prefill, token-by-token decode and chunked prefill (``start_pos > 0``, ``S > 1``)
can be mixed freely. History is kept as the raw per-position quantities (window KV, compressor kv/score
state) in buffers indexed by absolute position; compressed entries are computed once, when the token that
closes their block is processed, from those buffers.

Rounding contract (``numerics.dtype`` = activation dtype; everything is computed in float32 and rounded
to ``dtype`` at these stage ends):
  x on entry; every fp8-able linear output; RMSNorm outputs; q after the weightless head norm and after
  RoPE; window kv after RoPE (then the cache format); compressor pooled vector after RMSNorm and after
  RoPE (kv/score projections and the pooling itself stay float32); indexer q after its linear, RoPE and
  Hadamard; indexer k after RoPE and Hadamard; attention output, inverse RoPE, ``wo_a`` and ``wo_b`` outputs.
  ``indexer.weights_proj``, index scores, attention logits and softmax stay float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np
import torch

from jds.config import Numerics, RopeConfig, V4Config

__all__ = [
    "TorchV4Attention",
    "make_random_v4_weights",
    "quantize_weights_fp8",
    "dequantize_wo_a",
    "FP8_LINEAR_NAMES",
]

_F32 = torch.float32
_E4M3_MAX = 448.0
_INV_E4M3_MAX = float(np.float32(1.0) / np.float32(448.0))  # fp32(1/448), multiplied (as in [R] act_quant)

# Linears that DESIGN.md marks fp8-able (weights may come as e4m3 + 128x128 block scales).
FP8_LINEAR_NAMES: tuple[str, ...] = ("wq_a", "wkv", "wq_b", "wo_a", "wo_b", "indexer.wq_b")


# --------------------------------------------------------------------------------------------------
# primitives (private: the V3.2 oracle has its own copies, on purpose)
# --------------------------------------------------------------------------------------------------


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round a float32 tensor to ``dtype`` and back: models a stage that stores its result in ``dtype``."""
    if dtype == _F32:
        return x.to(_F32)
    return x.to(dtype).to(_F32)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32: x * rsqrt(mean(x^2) + eps) (* weight when given; V4's q head norm has none)."""
    x = x.to(_F32)
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(_F32)
    return y


def _yarn_correction_dim(n_rot: float, dim: int, base: float, orig_len: int) -> float:
    """Index (in 0..dim) of the frequency that makes ``n_rot`` full turns over ``orig_len`` positions."""
    return dim * math.log(orig_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def _rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies [dim/2] (fp32), YaRN-interpolated when ``rope.yarn`` (no mscale)."""
    freqs = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=_F32) / dim))
    if rope.yarn:
        low = math.floor(_yarn_correction_dim(rope.beta_fast, dim, rope.theta, rope.original_seq_len))
        high = math.ceil(_yarn_correction_dim(rope.beta_slow, dim, rope.theta, rope.original_seq_len))
        low, high = max(low, 0), min(high, dim - 1)
        hi = high + 0.001 if low == high else high
        ramp = ((torch.arange(dim // 2, dtype=_F32) - low) / (hi - low)).clamp(0.0, 1.0)
        smooth = 1.0 - ramp
        freqs = freqs / rope.factor * (1.0 - smooth) + freqs * smooth
    return freqs


def _rope_table(rope: RopeConfig, dim: int, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [n_pos, dim/2] in fp32 (angle = fp32(p) * f_i, no magnitude scaling)."""
    ang = torch.outer(torch.arange(n_pos, dtype=_F32), _rope_inv_freq(rope, dim))
    return torch.cos(ang), torch.sin(ang)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the LAST 2*cos.shape[-1] dims of x; the rest passes through.

    cos/sin must broadcast against x[..., :rope/2]; ``inverse`` rotates by the negative angle.
    """
    r = 2 * cos.shape[-1]
    x = x.to(_F32)
    head, tail = x[..., :-r], x[..., -r:]
    u, v = tail[..., 0::2], tail[..., 1::2]
    s = -sin if inverse else sin
    ru = u * cos - v * s
    rv = u * s + v * cos
    rot = torch.stack([ru, rv], dim=-1).flatten(-2)
    return torch.cat([head, rot], dim=-1)


def _hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix (natural order, entries +-1), n a power of two."""
    if n & (n - 1) or n <= 0:
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=_F32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """y = x @ H_n * n^-0.5 along the last dim (orthonormal, so dot products are preserved)."""
    n = x.shape[-1]
    return (x.to(_F32) @ _hadamard_matrix(n)) * (n ** -0.5)


def _ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax * fp32(1/448))) computed exactly from the exponent bits (no log2 rounding)."""
    t = amax.to(_F32) * _INV_E4M3_MAX
    mant, exp = torch.frexp(t)  # t = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(t), e)


def _act_quant(
    x: torch.Tensor,
    block: int = 128,
    fmt: str = "ue8m0",
    amax_floor: float = 1e-4,
    bf16_round: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8-e4m3 quantisation along the last dim.

    Returns (q, s): q holds the e4m3 values as float32 (same shape as x), s the fp32 scales
    [..., n/block]; x ~= q * s. ``fmt`` "ue8m0" gives power-of-two scales, "amax" gives amax/448.
    ``bf16_round`` rounds x through bf16 before taking the amax (vLLM's V4 cache/indexer writers).
    """
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"act_quant: last dim {n} is not a multiple of block {block}")
    x = x.to(_F32)
    if bf16_round:
        x = _round(x, torch.bfloat16)
    xb = x.reshape(*x.shape[:-1], n // block, block)
    amax = xb.abs().amax(dim=-1).clamp_min(amax_floor)
    if fmt == "ue8m0":
        s = _ue8m0_scale(amax)
    elif fmt == "amax":
        s = amax * _INV_E4M3_MAX
    else:
        raise ValueError(f"unknown scale format {fmt!r}")
    q = (xb / s[..., None]).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).to(_F32)
    return q.reshape(x.shape), s


def _act_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_act_quant``: q * s broadcast over each block."""
    block = q.shape[-1] // s.shape[-1]
    return (q.reshape(*s.shape, block) * s[..., None]).reshape(q.shape)


def _fp8_roundtrip(x: torch.Tensor, block: int, fmt: str = "ue8m0", amax_floor: float = 1e-4,
                   bf16_round: bool = False) -> torch.Tensor:
    """Quantise-dequantise through e4m3 (what a consumer of an FP8 cache/GEMM actually sees)."""
    q, s = _act_quant(x, block, fmt, amax_floor, bf16_round)
    return _act_dequant(q, s)


_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # index parity = mantissa bit: even index = even


def _fp4_roundtrip(x: torch.Tensor, block: int = 32, amax_floor: float = 1e-4) -> torch.Tensor:
    """MXFP4 quantise-dequantise along the last dim: s = 2^ceil(log2(max(amax, floor) / 6)) per ``block``,
    x / s clamped to +-6 and rounded to the nearest e2m1 value, ties to the even code (float64 search)."""
    n = x.shape[-1]
    xb = x.to(torch.float64).reshape(*x.shape[:-1], n // block, block)
    amax = xb.abs().amax(-1).clamp_min(amax_floor)
    s = 2.0 ** torch.ceil(torch.log2(amax.to(torch.float32).to(torch.float64) / 6.0))
    v = (xb / s[..., None]).clamp(-6.0, 6.0)
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float64)
    d = (v.abs()[..., None] - grid).abs()
    best = d.min(-1, keepdim=True).values
    # among the nearest grid points (one, or two at a tie) take the even index
    cand = torch.where(d == best, torch.arange(8) % 2, torch.full_like(d, 9, dtype=torch.long))
    idx = (cand * 8 + torch.arange(8)).argmin(-1)
    q = grid[idx] * torch.sign(v)
    return (q * s[..., None]).reshape(x.shape).to(_F32)


def _v4_kv_cache_format(v: torch.Tensor, cfg: V4Config, kv_cache_dtype: str) -> torch.Tensor:
    """What a V4 window/compressed record reads back as (the 584-byte fp8_ds_mla layout for "fp8").

    fp8: NoPE dims -> bf16 -> per-``quant_block`` UE8M0 e4m3 (amax floor 1e-4, clamp 448), RoPE dims -> bf16.
    bfloat16: all dims rounded to bf16. float32: unchanged.
    """
    if kv_cache_dtype == "float32":
        return v.to(_F32)
    if kv_cache_dtype == "bfloat16":
        return _round(v, torch.bfloat16)
    if kv_cache_dtype != "fp8":
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    nope = cfg.head_dim - cfg.rope_head_dim
    nope_part = _fp8_roundtrip(v[..., :nope], cfg.quant_block, "ue8m0", 1e-4, bf16_round=True)
    rope_part = _round(v[..., nope:], torch.bfloat16)
    return torch.cat([nope_part, rope_part], dim=-1)


def _to_f32_tensor(a: Any) -> torch.Tensor:
    """numpy (incl. ml_dtypes bfloat16 / float8) or torch array -> float32 torch tensor (exact upcast)."""
    if isinstance(a, torch.Tensor):
        return a.detach().to("cpu", _F32)
    arr = np.asarray(a)
    if arr.dtype.kind not in "fiub":  # ml_dtypes types are kind 'V'; their astype(float32) is exact
        arr = arr.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr).astype(np.float32))


def _block_dequant_weight(w8: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """W_real[i, j] = W8[i, j] * scale[i // block, j // block]."""
    out_f, in_f = w8.shape
    s = scale.repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return w8 * s


# --------------------------------------------------------------------------------------------------
# weights helpers (numpy in, numpy out; usable by parity tests on both sides)
# --------------------------------------------------------------------------------------------------


def make_random_v4_weights(cfg: V4Config, layer_id: int, seed: int = 0, sink_scale: float = 1.0
                           ) -> dict[str, np.ndarray]:
    """Random float32 weights for one V4 layer with DESIGN.md names/shapes, scaled to keep activations O(1)."""
    rng = np.random.default_rng(seed)
    ratio = cfg.compress_ratios[layer_id]
    hd, hid = cfg.head_dim, cfg.hidden_size

    def lin(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) / math.sqrt(in_f)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "wq_a": lin(cfg.q_lora_rank, hid),
        "wkv": lin(hd, hid),
        "q_norm": norm(cfg.q_lora_rank),
        "kv_norm": norm(hd),
        "wq_b": lin(cfg.n_heads * hd, cfg.q_lora_rank),
        "wo_a": lin(cfg.o_groups * cfg.o_lora_rank, (cfg.n_heads // cfg.o_groups) * hd),
        "wo_b": lin(hid, cfg.o_groups * cfg.o_lora_rank),
        "attn_sink": (sink_scale * rng.standard_normal(cfg.n_heads)).astype(np.float32),
    }
    if ratio:
        c = 2 if ratio == 4 else 1
        w["compressor.wkv"] = lin(c * hd, hid)
        w["compressor.wgate"] = lin(c * hd, hid)
        w["compressor.ape"] = (0.5 * rng.standard_normal((ratio, c * hd))).astype(np.float32)
        w["compressor.norm"] = norm(hd)
    if ratio == 4:
        di = cfg.index_head_dim
        w["indexer.wq_b"] = lin(cfg.index_n_heads * di, cfg.q_lora_rank)
        w["indexer.weights_proj"] = lin(cfg.index_n_heads, hid)
        w["indexer.compressor.wkv"] = lin(2 * di, hid)
        w["indexer.compressor.wgate"] = lin(2 * di, hid)
        w["indexer.compressor.ape"] = (0.5 * rng.standard_normal((4, 2 * di))).astype(np.float32)
        w["indexer.compressor.norm"] = norm(di)
    return w


def quantize_weights_fp8(weights: Mapping[str, np.ndarray], fmt: str = "ue8m0", block: int = 128
                         ) -> dict[str, np.ndarray]:
    """Return a copy where every fp8-able linear is e4m3 (ml_dtypes) plus ``<name>.scale`` [ceil/128, ceil/128].

    Scales are per 128x128 block, power-of-two (ue8m0, as the V4 checkpoint) or amax/448.
    """
    import ml_dtypes

    out = dict(weights)
    for name in FP8_LINEAR_NAMES:
        if name not in weights:
            continue
        w = _to_f32_tensor(weights[name])
        o, i = w.shape
        po, pi = -o % block, -i % block
        wp = torch.nn.functional.pad(w, (0, pi, 0, po))
        blocks = wp.reshape((o + po) // block, block, (i + pi) // block, block).permute(0, 2, 1, 3)
        amax = blocks.abs().amax(dim=(-1, -2)).clamp_min(1e-4)
        s = _ue8m0_scale(amax) if fmt == "ue8m0" else amax * _INV_E4M3_MAX
        full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:o, :i]
        q = (w / full).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
        out[name] = q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        out[name + ".scale"] = s.numpy().astype(np.float32)
    return out


def dequantize_wo_a(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The release's conversion of ``wo_a``: the stored e4m3 weight times its block scales, rounded once to
    bf16, scale dropped. The layer then runs it as a plain bf16 einsum."""
    import ml_dtypes

    out = dict(weights)
    if "wo_a.scale" in out:
        w = _block_dequant_weight(_to_f32_tensor(out.pop("wo_a")), _to_f32_tensor(out.pop("wo_a.scale")))
        out["wo_a"] = w.numpy().astype(ml_dtypes.bfloat16)
    return out


# --------------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------------


class _Linear:
    """y = x @ W.T with the project's two numerics: plain (W in dtype, fp32 accumulate) or DeepSeek fp8."""

    def __init__(self, name: str, weights: Mapping[str, Any], numerics: Numerics, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype
        w = _to_f32_tensor(weights[name])
        scale_key = name + ".scale"
        has_scale = scale_key in weights
        if has_scale:
            w = _block_dequant_weight(w, _to_f32_tensor(weights[scale_key]))
        self.fp8 = bool(numerics.fp8_linear)
        if self.fp8 and not has_scale:
            raise ValueError(f"numerics.fp8_linear is on but {scale_key!r} is missing "
                             f"(use quantize_weights_fp8 to build fp8 weights)")
        # fp8 weights are exact in fp32 after dequantisation; plain weights live in the activation dtype.
        self.weight = w if self.fp8 else _round(w, dtype)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """What the GEMM sees of x: per-128 UE8M0 e4m3 re-quantisation on the fp8 path (DeepSeek linear())."""
        return _fp8_roundtrip(x, 128, "ue8m0", 1e-4) if self.fp8 else x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _round(self.input(x) @ self.weight.T, self.dtype)


class _Compressor:
    """Gated-softmax pooling of r-token blocks (spec 3.4), with per-position fp32 state buffers."""

    def __init__(self, prefix: str, weights: Mapping[str, Any], d: int, ratio: int, max_batch: int,
                 max_seq_len: int) -> None:
        self.d, self.r = d, ratio
        self.c = 2 if ratio == 4 else 1
        g = lambda n: _to_f32_tensor(_get(weights, f"{prefix}.{n}"))  # noqa: E731
        self.wkv, self.wgate, self.ape, self.norm = g("wkv"), g("wgate"), g("ape"), g("norm")
        cd = self.c * d
        if self.wkv.shape[0] != cd or self.ape.shape != (ratio, cd):
            raise ValueError(f"{prefix}: expected wkv [{cd}, hidden] and ape [{ratio}, {cd}], "
                             f"got {tuple(self.wkv.shape)} and {tuple(self.ape.shape)}")
        self.kv_state = torch.zeros(max_batch, max_seq_len, cd, dtype=_F32)
        self.score_state = torch.zeros(max_batch, max_seq_len, cd, dtype=_F32)

    def reset(self) -> None:
        self.kv_state.zero_()
        self.score_state.zero_()

    def project(self, x: torch.Tensor, start_pos: int) -> None:
        """Store kv_t = x W_kv^T and s_t = x W_gate^T + ape[p mod r] (fp32, unquantised) for each position."""
        bsz, seqlen, _ = x.shape
        pos = torch.arange(start_pos, start_pos + seqlen)
        self.kv_state[:bsz, pos] = x @ self.wkv.T
        self.score_state[:bsz, pos] = x @ self.wgate.T + self.ape[pos % self.r]

    def pool(self, bsz: int, blocks: torch.Tensor) -> torch.Tensor:
        """Pooled (pre-norm) vectors [bsz, nb, d] of the given blocks, all of whose tokens are projected."""
        r, d = self.r, self.d
        cur = blocks[:, None] * r + torch.arange(r)  # [nb, r]
        kv = self.kv_state[:bsz, cur]  # [B, nb, r, c*d]
        s = self.score_state[:bsz, cur]
        if self.c == 1:
            cand_kv, cand_s = kv, s
        else:
            prev = ((blocks - 1).clamp_min(0))[:, None] * r + torch.arange(r)
            pkv = self.kv_state[:bsz, prev][..., :d]
            ps = self.score_state[:bsz, prev][..., :d]
            ps = torch.where((blocks == 0)[None, :, None, None], torch.full_like(ps, -math.inf), ps)
            cand_kv = torch.cat([pkv, kv[..., d:]], dim=2)  # [B, nb, 2r, d]
            cand_s = torch.cat([ps, s[..., d:]], dim=2)
        a = torch.softmax(cand_s, dim=2)
        return (a * cand_kv).sum(dim=2)


def _get(weights: Mapping[str, Any], name: str) -> Any:
    """Look a tensor up by its DESIGN.md name, accepting a checkpoint-style ``.weight`` suffix for norms."""
    if name in weights:
        return weights[name]
    if name + ".weight" in weights:
        return weights[name + ".weight"]
    raise KeyError(f"weight {name!r} missing")


class TorchV4Attention:
    """One DeepSeek-V4 attention layer (window / C4 + indexer / C128), full-sequence form with history.

    Public state after each ``forward`` (rows ``:B``, absolute positions / entry indices):
      ``kv_window`` [max_batch, max_seq_len, head_dim]: window K=V as read back from the cache;
      ``kv_compressed`` [max_batch, max_seq_len // ratio, head_dim]: main compressed entries (ratio > 0);
      ``index_k`` / ``index_k_scale`` [.., max_seq_len // 4, index_head_dim] / [.., max_seq_len // 4]:
      indexer keys (e4m3 values as fp32 and their scales with ``indexer_fp8``; float values and 1 otherwise).
    """

    def __init__(self, cfg: V4Config, layer_id: int, weights: dict[str, np.ndarray], numerics: Numerics,
                 max_batch: int, max_seq_len: int) -> None:
        self.cfg, self.numerics = cfg, numerics
        self.layer_id = layer_id
        self.ratio = int(cfg.compress_ratios[layer_id])
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.dtype = _torch_dtype(numerics.dtype)
        self.scale = cfg.softmax_scale
        self.eps = cfg.rms_norm_eps
        self.query_chunk = 256  # queries per attention/indexer pass (memory bound only; results identical)
        hd = cfg.head_dim

        lin = lambda n: _Linear(n, weights, numerics, self.dtype)  # noqa: E731
        self.wq_a, self.wkv, self.wq_b = lin("wq_a"), lin("wkv"), lin("wq_b")
        # the release dequantises wo_a to bf16 and runs it without activation quantisation (unless wo_a_fp8)
        wo_a_num = numerics if getattr(numerics, "wo_a_fp8", False) else dataclasses.replace(numerics, fp8_linear=False)
        self.wo_a, self.wo_b = _Linear("wo_a", weights, wo_a_num, self.dtype), lin("wo_b")
        self.q_norm = _to_f32_tensor(_get(weights, "q_norm"))
        self.kv_norm = _to_f32_tensor(_get(weights, "kv_norm"))
        self.attn_sink = _to_f32_tensor(weights["attn_sink"])
        self.cos, self.sin = _rope_table(cfg.rope_for(self.ratio), cfg.rope_head_dim, max_seq_len)

        self.kv_window = torch.zeros(max_batch, max_seq_len, hd, dtype=_F32)
        self.compressor: _Compressor | None = None
        self.indexer_compressor: _Compressor | None = None
        if self.ratio:
            n_ent = max_seq_len // self.ratio
            self.compressor = _Compressor("compressor", weights, hd, self.ratio, max_batch, max_seq_len)
            self.kv_compressed = torch.zeros(max_batch, n_ent, hd, dtype=_F32)
        if self.ratio == 4:
            di = cfg.index_head_dim
            self.indexer_wq_b = lin("indexer.wq_b")
            self.weights_proj = _to_f32_tensor(weights["indexer.weights_proj"])
            self.indexer_compressor = _Compressor("indexer.compressor", weights, di, 4, max_batch, max_seq_len)
            self.index_k = torch.zeros(max_batch, max_seq_len // 4, di, dtype=_F32)
            self.index_k_scale = torch.ones(max_batch, max_seq_len // 4, dtype=_F32)

    # ---------------------------------------------------------------- helpers
    def reset(self) -> None:
        """Forget all history (start a new batch of sequences)."""
        self.kv_window.zero_()
        if self.compressor is not None:
            self.compressor.reset()
            self.kv_compressed.zero_()
        if self.indexer_compressor is not None:
            self.indexer_compressor.reset()
            self.index_k.zero_()
            self.index_k_scale.fill_(1.0)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, head_axis: bool, inverse: bool = False) -> torch.Tensor:
        """RoPE of x [B, S, (H,) D] at absolute positions pos [S] on the last rope_head_dim dims."""
        cos, sin = self.cos[pos], self.sin[pos]
        if head_axis:
            cos, sin = cos[:, None, :], sin[:, None, :]
        return _apply_rope(x, cos, sin, inverse)

    def _index_quant(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer q/k as the scorer sees them: (values, scale per 128-vector). MXFP4 (``indexer_fp4``): the
        dequantised values, which carry their own per-32 scales, and 1."""
        if getattr(self.numerics, "indexer_fp4", False):
            return _fp4_roundtrip(v), torch.ones(v.shape[:-1], dtype=_F32)
        if self.numerics.indexer_fp8:
            q, s = _act_quant(v, v.shape[-1], "ue8m0", 1e-4, bf16_round=True)
            return q, s[..., 0]
        return v, torch.ones(v.shape[:-1], dtype=_F32)

    def _emit_blocks(self, bsz: int, start_pos: int, end: int) -> None:
        """Compute the compressed entries whose block closes at a position in [start_pos, end)."""
        r = self.ratio
        blocks = torch.arange(start_pos // r, end // r)
        if blocks.numel() == 0:
            return
        bpos = blocks * r  # rope position of entry b is the first token of its block
        c = _round(_rms_norm(self.compressor.pool(bsz, blocks), self.compressor.norm, self.eps), self.dtype)
        c = _round(self._rope(c, bpos, head_axis=False), self.dtype)
        self.kv_compressed[:bsz, blocks] = _v4_kv_cache_format(c, self.cfg, self.numerics.kv_cache_dtype)
        if self.indexer_compressor is not None:
            ic = self.indexer_compressor
            k = _round(_rms_norm(ic.pool(bsz, blocks), ic.norm, self.eps), self.dtype)
            k = _round(self._rope(k, bpos, head_axis=False), self.dtype)
            if self.numerics.indexer_hadamard:
                k = _round(_hadamard(k), self.dtype)
            kq, ks = self._index_quant(k)
            self.index_k[:bsz, blocks] = kq
            self.index_k_scale[:bsz, blocks] = ks

    def _indexer(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, end: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Lightning-indexer scores [B, S, max_seq_len//4] (-inf if invisible) and top-k [B, S, k] (-1 pad)."""
        cfg = self.cfg
        bsz, seqlen, _ = x.shape
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        qi = self.indexer_wq_b(qr).view(bsz, seqlen, hi, di)
        qi = _round(self._rope(qi, pos, head_axis=True), self.dtype)
        if self.numerics.indexer_hadamard:
            qi = _round(_hadamard(qi), self.dtype)
        q8, qs = self._index_quant(qi)  # [B, S, Hi, Di], [B, S, Hi]
        w = (x @ self.weights_proj.T) * qs * (di ** -0.5) * (hi ** -0.5)  # fp32 [B, S, Hi]
        n_all = self.index_k.shape[1]
        n_ent = end // 4
        k8 = self.index_k[:bsz, :n_ent]
        dots = torch.relu(torch.einsum("bshd,bnd->bshn", q8, k8))
        scores = torch.einsum("bsh,bshn->bsn", w, dots) * self.index_k_scale[:bsz, None, :n_ent]
        visible = torch.arange(n_ent)[None, :] < ((pos + 1) // 4)[:, None]  # [S, n_ent]
        full = torch.full((bsz, seqlen, n_all), -math.inf, dtype=_F32)
        full[:, :, :n_ent] = torch.where(visible[None], scores, torch.full_like(scores, -math.inf))
        # Stable descending sort: exact ties (e.g. several all-ReLU-zero entries) go to the lower index.
        k = cfg.index_topk
        order = torch.sort(full, dim=-1, descending=True, stable=True).indices[..., :k]
        if order.shape[-1] < k:
            order = torch.cat([order, order.new_full((bsz, seqlen, k - order.shape[-1]), -1)], dim=-1)
        n_vis = ((pos + 1) // 4).clamp_max(k)  # k_eff = min(index_topk, visible count)
        keep = torch.arange(k)[None, :] < n_vis[:, None]
        topk = torch.where(keep[None], order, torch.full_like(order, -1)).to(torch.int64)
        return full, topk

    @staticmethod
    def _sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                        scale: float) -> torch.Tensor:
        """fp32 softmax over masked candidates plus a value-less per-head sink logit; empty rows give 0.

        q [B, S, H, D], keys [B, N, D] (K = V), mask [B, S, N] bool, sink [H].
        """
        logits = torch.einsum("bshd,bnd->bshn", q, keys) * scale
        logits = logits.masked_fill(~mask[:, :, None, :], -math.inf)
        m = torch.maximum(logits.amax(dim=-1), sink[None, None, :])  # [B, S, H]
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        e = torch.exp(logits - m[..., None])
        denom = e.sum(dim=-1) + torch.exp(sink[None, None, :] - m)
        o = torch.einsum("bshn,bnd->bshd", e, keys)
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        return torch.where((denom > 0)[..., None], o / safe[..., None], torch.zeros_like(o))

    def _attend(self, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, pos: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Attention of the queries at consecutive positions ``pos`` over window + compressed candidates.

        Keys: window positions [k0, end) then compressed entries [0, end // ratio) (all already written).
        Returns o [B, s, H, D] fp32 (not rounded) and, for C4, index scores and top-k.
        """
        cfg = self.cfg
        bsz, seqlen = q.shape[:2]
        end = int(pos[-1]) + 1
        k0 = max(0, int(pos[0]) - cfg.window_size + 1)
        kpos = torch.arange(k0, end)
        win_mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - cfg.window_size)
        keys = self.kv_window[:bsz, k0:end]
        mask = win_mask[None].expand(bsz, -1, -1)
        scores = topk = None
        if self.ratio:
            n_ent = end // self.ratio
            if self.ratio == 4:
                scores, topk = self._indexer(x, qr, pos, end)
                sel = torch.zeros(bsz, seqlen, n_ent + 1, dtype=torch.bool)
                sel.scatter_(2, torch.where(topk >= 0, topk, n_ent), True)  # -1 -> dummy column
                cmask = sel[..., :n_ent]
            else:
                ent = torch.arange(n_ent)
                cmask = (ent[None, :] < ((pos + 1) // self.ratio)[:, None])[None].expand(bsz, -1, -1)
            keys = torch.cat([keys, self.kv_compressed[:bsz, :n_ent]], dim=1)
            mask = torch.cat([mask, cmask], dim=2)
        return self._sink_attention(q, keys, mask, self.attn_sink, self.scale), scores, topk

    # ---------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, x: torch.Tensor, start_pos: int, return_debug: bool = False) -> dict[str, torch.Tensor]:
        """Process tokens at positions start_pos..start_pos+S-1 of each of the B sequences.

        Returns "out" [B, S, hidden] fp32; C4 layers add "topk" [B, S, index_topk] int64 (local compressed
        indices, -1 padded) and "index_scores" [B, S, max_seq_len // 4] fp32 (-inf where invisible).
        ``return_debug`` adds "q" (post-RoPE queries) and "o" (attention output before inverse RoPE).
        """
        cfg = self.cfg
        bsz, seqlen, _ = x.shape
        end = start_pos + seqlen
        if bsz > self.max_batch or end > self.max_seq_len or start_pos < 0:
            raise ValueError(f"batch {bsz} / positions [{start_pos}, {end}) exceed the layer's buffers "
                             f"(max_batch={self.max_batch}, max_seq_len={self.max_seq_len})")
        h, hd = cfg.n_heads, cfg.head_dim
        pos = torch.arange(start_pos, end)
        x = x if isinstance(x, torch.Tensor) else _to_f32_tensor(x)
        x = _round(x.detach().to("cpu", _F32), self.dtype)

        # projections and norms (3.1)
        qr = _round(_rms_norm(self.wq_a(x), self.q_norm, self.eps), self.dtype)
        kv = _round(_rms_norm(self.wkv(x), self.kv_norm, self.eps), self.dtype)
        q = self.wq_b(qr).view(bsz, seqlen, h, hd)
        q = _round(_rms_norm(q, None, self.eps), self.dtype)
        q = _round(self._rope(q, pos, head_axis=True), self.dtype)

        # window KV (3.3): written before attention, so a query sees itself
        kwin = _round(self._rope(kv, pos, head_axis=False), self.dtype)
        self.kv_window[:bsz, start_pos:end] = _v4_kv_cache_format(kwin, cfg, self.numerics.kv_cache_dtype)

        # compressors (3.4): store per-token state, then emit blocks closed by this call's tokens
        result: dict[str, torch.Tensor] = {}
        if self.ratio:
            self.compressor.project(x, start_pos)
            if self.indexer_compressor is not None:
                self.indexer_compressor.project(x, start_pos)
            self._emit_blocks(bsz, start_pos, end)

        # candidate set (3.6) and attention, in query chunks (rows are independent; bounds memory)
        o_parts: list[torch.Tensor] = []
        sc_parts: list[torch.Tensor] = []
        tk_parts: list[torch.Tensor] = []
        for s0 in range(0, seqlen, self.query_chunk):
            s1 = min(seqlen, s0 + self.query_chunk)
            o_c, sc_c, tk_c = self._attend(x[:, s0:s1], qr[:, s0:s1], q[:, s0:s1], pos[s0:s1])
            o_parts.append(o_c)
            if sc_c is not None:
                sc_parts.append(sc_c)
                tk_parts.append(tk_c)
        o = torch.cat(o_parts, dim=1)
        if sc_parts:
            result["topk"] = torch.cat(tk_parts, dim=1)
            result["index_scores"] = torch.cat(sc_parts, dim=1)
        o = _round(o, self.dtype)
        if return_debug:
            result["q"], result["o"] = q, o

        # output projection (3.7): inverse RoPE, grouped low-rank wo_a, then wo_b
        o = _round(self._rope(o, pos, head_axis=True, inverse=True), self.dtype)
        g = cfg.o_groups
        og = o.reshape(bsz, seqlen, g, (h // g) * hd)
        wa = self.wo_a.weight.view(g, cfg.o_lora_rank, (h // g) * hd)
        z = _round(torch.einsum("bsgi,goi->bsgo", self.wo_a.input(og), wa), self.dtype)
        y = self.wo_b(z.reshape(bsz, seqlen, g * cfg.o_lora_rank))
        result["out"] = y.to(_F32)
        return result

    __call__ = forward
