"""Plain-PyTorch test oracle for DeepSeek-V3.2 attention (MLA + lightning indexer, DSA top-k).

Written from ``shared/spec/deepseek_v32_attention.md`` (sections 3-6, 9: DeepSeek [R-fix] semantics)
and ``docs/DESIGN.md`` (weight names, Numerics contract). It deliberately shares no code with
``jds`` (only the config dataclasses are used, and only by duck typing) so that it can catch
mistakes there. It is written for clarity, not speed: contiguous [batch, seq] caches, the top-k
turned into an additive -inf mask, dense einsums over every cached key.

Precision rules (see ``Numerics`` in jds/config.py):
* every tensor between stages is float32 holding a value rounded to ``numerics.dtype``;
* norms, RoPE, quantisation, the Hadamard, index scores, attention scores and softmax are float32;
* dot products / reductions over a contracted axis are summed in float64 and rounded once to
  float32 (``_dot``). That is an "ideal" fp32 accumulation: it makes the oracle independent of
  BLAS blocking (so chunked and one-shot prefill score identically) and is at least as accurate as
  any fp32 kernel it is compared with;
* deliberate deviation from [R-fix]: scores and softmax are float32, not bf16.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # only for annotations: the oracle must not depend on the jds implementation
    from jds.config import Numerics, V32Config

E4M3_MAX = 448.0
FP32_TINY = float(torch.finfo(torch.float32).tiny)
# fp32(1/448): [R] multiplies amax by this fp32 constant instead of dividing by 448.
_INV448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)

# Linears that [R] stores as fp8 + 128x128 block scales (DESIGN.md table).
FP8_LINEARS = ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "indexer.wq_b", "indexer.wk")


# ----------------------------------------------------------------------------------------------
# primitives
# ----------------------------------------------------------------------------------------------


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """Exact 2**ceil(log2 v) for positive normal fp32 v (UE8M0 scale), via frexp, no float log2.

    frexp gives v = m * 2**e with m in [0.5, 1): ceil(log2 v) is e-1 when m == 0.5 (v is a power
    of two) and e otherwise. The result is assembled from exponent bits so it is exact.
    """
    v = v.float()
    if not bool((v > 0).all()):
        raise ValueError("UE8M0 scale needs positive amax (use a positive amax_floor)")
    m, e = torch.frexp(v)
    k = e.to(torch.int32) - (m == 0.5).to(torch.int32)
    if bool((k < -126).any()) or bool((k > 127).any()):
        raise ValueError("UE8M0 scale outside the fp32 normal range")
    return ((k + 127) << 23).view(torch.float32)


def act_quant(
    x: torch.Tensor, block: int = 128, fmt: str = "ue8m0", amax_floor: float = 1e-4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 quantisation along the last dim ([R] ``act_quant``, spec section 3).

    amax = max(max|x_blk|, floor) in fp32; "ue8m0": s = 2**ceil(log2(amax * fp32(1/448))) exactly;
    "amax": s = amax * fp32(1/448). q = e4m3_RNE(clamp(fp32(x) / s, -448, 448)).
    Returns q (float8_e4m3fn, x's shape) and s (float32, [..., n // block]).
    """
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of block {block}")
    g = x.float().reshape(*x.shape[:-1], n // block, block)
    amax = g.abs().amax(dim=-1).clamp_min(amax_floor)
    v = amax * _INV448
    if fmt == "ue8m0":
        s = _pow2_ceil(v)
    elif fmt == "amax":
        s = v
    else:
        raise ValueError(f"unknown scale format {fmt!r}")
    q = (g / s.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), s


def dequant(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of act_quant: fp32(q) * s per block of ``block`` along the last dim (float32)."""
    n = q.shape[-1]
    g = q.float().reshape(*q.shape[:-1], n // block, block)
    return (g * s.float().unsqueeze(-1)).reshape(q.shape)


def sylvester_hadamard(n: int) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix in natural order: H[i, j] = (-1)**popcount(i & j)."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    i = torch.arange(n)
    parity = torch.zeros(n, n, dtype=torch.int64)
    a = i[:, None] & i[None, :]
    while bool(a.any()):
        parity ^= a & 1
        a = a >> 1
    return (1 - 2 * parity).to(torch.float32)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """y = x @ H_n * n**-0.5 over the last dim in fp32 (one rounding), cast back to x.dtype."""
    n = x.shape[-1]
    y = _dot("...i,ij->...j", x.float(), sylvester_hadamard(n)) * torch.tensor(n ** -0.5, dtype=torch.float32)
    return y.to(x.dtype)


def block_dequant_weight(w8: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """W[i, j] = fp32(W8[i, j]) * S[i // block, j // block] (float32)."""
    out, inp = w8.shape
    s = scale.float().repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return w8.float() * s


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: int = 128,
               fmt: str = "ue8m0") -> torch.Tensor:
    """[R] ``linear`` with an fp8 weight, unrounded float32 result.

    (xq, sx) = act_quant(x, 128, fmt) (the checkpoint's scale_fmt; [R]'s V3.2 config: "ue8m0"); y[m, n] = sum_kb sx[m, kb] * S_W[n // 128, kb] *
    (xq[m, kb-block] . Wq[n, kb-block]), each block dot in fp32, the outer sum in fp32.
    ``w8`` holds the e4m3 values (any float dtype), ``w_scale`` is [ceil(out/128), ceil(in/128)].
    """
    n_out, n_in = w8.shape
    xq, sx = act_quant(x, block, fmt)
    nb = n_in // block
    xq = xq.float().reshape(*x.shape[:-1], nb, block)
    wq = w8.float().reshape(n_out, nb, block)
    sw = w_scale.float().repeat_interleave(block, 0)[:n_out]  # [n_out, nb]
    y = torch.zeros(*x.shape[:-1], n_out, dtype=torch.float32)
    for kb in range(nb):
        d = _dot("...c,nc->...n", xq[..., kb, :], wq[:, kb, :])
        y = y + d * (sx[..., kb : kb + 1] * sw[:, kb])
    return y


def _dot(eq: str, *ops: torch.Tensor) -> torch.Tensor:
    """einsum summed in float64 and rounded once to float32 (an order-independent fp32 dot)."""
    return torch.einsum(eq, *[o.double() for o in ops]).float()


def rope_table(cfg: "V32Config", n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n_pos, rope_dim/2] of [R]'s (YaRN-corrected when cfg.yarn_active) table, fp32.

    f_i = theta**(-2i/d) in fp32; with YaRN, f_i <- f_i/factor*(1-smooth_i) + f_i*smooth_i with
    smooth = 1 - clamp((i - low)/(high - low), 0, 1), low/high = floor/ceil of the YaRN correction
    dims for beta_fast/beta_slow (clipped to [0, d-1] as in YaRN). Angle = fp32(p) * f_i (fp32).
    """
    rc = cfg.rope
    d = cfg.qk_rope_head_dim
    freqs = 1.0 / (rc.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if rc.yarn:
        def corr_dim(n_rot: float) -> float:
            return d * math.log(rc.original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(rc.theta))

        low = max(math.floor(corr_dim(rc.beta_fast)), 0)
        high = min(math.ceil(corr_dim(rc.beta_slow)), d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / rc.factor * (1 - smooth) + freqs * smooth
    ang = torch.outer(torch.arange(n_pos, dtype=torch.float32), freqs)
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate pairs of x [B, S, ..., d] by the per-position angles (cos/sin [S, d/2]), fp32.

    Interleaved pairs are (x[2i], x[2i+1]) (MLA); non-interleaved/NeoX pairs are (x[i], x[i+d/2])
    and the half-split layout is kept (indexer in [R-fix]).
    """
    x = x.float()
    shape = [1, cos.shape[0]] + [1] * (x.dim() - 3) + [cos.shape[1]]
    c, s = cos.reshape(shape), sin.reshape(shape)
    if interleaved:
        u, v = x[..., 0::2], x[..., 1::2]
        return torch.stack([u * c - v * s, u * s + v * c], dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    u, v = x[..., :h], x[..., h:]
    return torch.cat([u * c - v * s, u * s + v * c], dim=-1)


def _np_to_f32(a: Any) -> torch.Tensor:
    """numpy (float32 / ml_dtypes bf16 / ml_dtypes e4m3) -> float32 tensor, exactly."""
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a).astype(np.float32)))


# ----------------------------------------------------------------------------------------------
# the layer
# ----------------------------------------------------------------------------------------------


class TorchMLA:
    """One DeepSeek-V3.2 attention layer in DeepSeek-reference form ([B, S] input + start_pos).

    Caches are contiguous [max_batch, max_seq_len, .] float32 tensors that persist across calls,
    so prefill, chunked prefill (start_pos > 0, S > 1) and decode can be freely interleaved; every
    call uses batch rows 0..B-1 and writes positions start_pos..start_pos+S-1 before attending.
    """

    def __init__(
        self,
        cfg: "V32Config",
        weights: dict[str, np.ndarray],
        numerics: "Numerics",
        max_batch: int,
        max_seq_len: int,
    ) -> None:
        self.cfg, self.num = cfg, numerics
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[numerics.dtype]
        if numerics.indexer_fp8 and cfg.index_head_dim != 128:
            raise NotImplementedError("fp8 indexer assumes one 128-block per head (index_head_dim == 128)")

        # Linears: ("fp8", w8 values as f32, scale) or ("dense", W rounded to the activation dtype).
        self.lin: dict[str, tuple[str, torch.Tensor, torch.Tensor | None]] = {}
        for name in FP8_LINEARS:
            w = _np_to_f32(weights[name])
            sc = weights.get(name + ".scale")
            if sc is not None:
                sc_t = _np_to_f32(sc)
                if numerics.fp8_linear:
                    self.lin[name] = ("fp8", w, sc_t)
                else:  # fp8 checkpoint but dense numerics: dequantise, then hold in dtype
                    self.lin[name] = ("dense", self._r(block_dequant_weight(w, sc_t)), None)
            else:
                if numerics.fp8_linear:
                    raise ValueError(f"numerics.fp8_linear needs {name!r} as e4m3 plus {name + '.scale'!r}")
                self.lin[name] = ("dense", self._r(w), None)
        # Norm weights and weights_proj stay float32 ([R]: fp32 norms, fp32 weights_proj).
        self.q_norm = _np_to_f32(self._get(weights, "q_norm"))
        self.kv_norm = _np_to_f32(self._get(weights, "kv_norm"))
        self.k_norm_w = _np_to_f32(weights["indexer.k_norm.weight"])
        self.k_norm_b = _np_to_f32(weights["indexer.k_norm.bias"])
        self.weights_proj = _np_to_f32(weights["indexer.weights_proj"])
        # wkv_b for the absorbed form, [H, nope + v, kv_lora]: in the activation dtype (held in float32 storage),
        # dequantised and rounded to it when fp8 ([R]'s weight_dequant gives bf16)
        kind, w, sc = self.lin["wkv_b"]
        wkv_b = self._r(block_dequant_weight(w, sc)) if kind == "fp8" else w
        self.wkv_b_heads = wkv_b.reshape(cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)

        self.cos, self.sin = rope_table(cfg, max_seq_len)
        self.reset()

    @staticmethod
    def _get(weights: dict[str, np.ndarray], name: str) -> np.ndarray:
        return weights[name] if name in weights else weights[name + ".weight"]

    def reset(self) -> None:
        """Zero all caches (fresh requests)."""
        cfg, B, T = self.cfg, self.max_batch, self.max_seq_len
        self.kv_cache = torch.zeros(B, T, cfg.kv_lora_rank)
        self.pe_cache = torch.zeros(B, T, cfg.qk_rope_head_dim)
        self.idx_k_cache = torch.zeros(B, T, cfg.index_head_dim)
        self.idx_scale_cache = torch.zeros(B, T)

    # --- stage helpers ----------------------------------------------------------------------

    def _r(self, x: torch.Tensor) -> torch.Tensor:
        """Round to the activation dtype (RNE), keep float32 storage."""
        return x.float().to(self.dt).float()

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """y = x W^T: fp8 block-scaled GEMM ([R] linear) or fp32 matmul; rounded to dtype."""
        kind, w, sc = self.lin[name]
        if kind == "fp8":
            return self._r(fp8_linear(x, w, sc, fmt=getattr(self.num, "act_scale_fmt", "ue8m0")))
        return self._r(_dot("...i,oi->...o", x, w))

    def _rmsnorm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return self._r(w * y)

    def _layernorm(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), self.k_norm_w, self.k_norm_b,
                                           self.cfg.rms_norm_eps)
        return self._r(y)

    def _latent_for_cache(self, c: torch.Tensor) -> torch.Tensor:
        """Latent as stored: fp8 cache -> quantise/dequantise per 128 ([R-fix] latent simulation)."""
        kvd = self.num.kv_cache_dtype
        if kvd == "fp8":
            fmt = self.num.latent_scale_fmt
            floor = 1e-4 if fmt == "ue8m0" else FP32_TINY
            q, s = act_quant(c, 128, fmt, floor)
            return self._r(dequant(q, s, 128))
        if kvd == "bfloat16":
            return self._r(c).to(torch.bfloat16).float()
        return self._r(c)

    def _pe_for_cache(self, k_pe: torch.Tensor) -> torch.Tensor:
        """k_pe is never quantised; the fp8 (656-B) record and a bf16 cache hold it as bf16."""
        k_pe = self._r(k_pe)
        if self.num.kv_cache_dtype in ("fp8", "bfloat16"):
            k_pe = k_pe.to(torch.bfloat16).float()
        return k_pe

    # --- indexer ------------------------------------------------------------------------------

    def _indexer(
        self, x: torch.Tensor, cq: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Lightning indexer (spec section 5) -> (index scores [B,S,end] with -inf above p, top-k)."""
        cfg, num = self.cfg, self.num
        B, S, _ = x.shape
        end = start_pos + S
        Hi, Di, Dr = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        il = cfg.indexer_rope_interleave

        qi = self._linear(cq, "indexer.wq_b").reshape(B, S, Hi, Di)
        qi = torch.cat([self._r(apply_rope(qi[..., :Dr], cos, sin, il)), qi[..., Dr:]], dim=-1)
        ki = self._layernorm(self._linear(x, "indexer.wk"))
        ki = torch.cat([self._r(apply_rope(ki[..., :Dr], cos, sin, il)), ki[..., Dr:]], dim=-1)
        if num.indexer_hadamard:
            qi = hadamard(qi.to(self.dt)).float()
            ki = hadamard(ki.to(self.dt)).float()
        if num.indexer_fp8:
            fmt = getattr(num, "act_scale_fmt", "ue8m0")  # [R]: act_quant(..., scale_fmt)
            q8, sq = act_quant(qi, Di, fmt)  # sq [B, S, Hi, 1]
            k8, sk = act_quant(ki, Di, fmt)  # sk [B, S, 1]
            q8, k8, sq, sk = q8.float(), k8.float(), sq[..., 0], sk[..., 0]
        else:
            q8, k8 = qi, ki
            sq, sk = torch.ones(B, S, Hi), torch.ones(B, S)
        self.idx_k_cache[:B, start_pos:end] = k8
        self.idx_scale_cache[:B, start_pos:end] = sk

        w = _dot("bsi,hi->bsh", x, self.weights_proj) * torch.tensor(Hi ** -0.5, dtype=torch.float32)
        w = w * sq * torch.tensor(Di ** -0.5, dtype=torch.float32)
        keys, kscale = self.idx_k_cache[:B, :end], self.idx_scale_cache[:B, :end]
        dots = _dot("bshd,btd->bsht", q8, keys)
        per_head = torch.relu(dots) * w[..., None]
        scores = per_head.double().sum(dim=2).float() * kscale[:, None, :]  # [B, S, end]
        p = start_pos + torch.arange(S)
        future = torch.arange(end)[None, :] > p[:, None]
        scores = scores.masked_fill(future[None], float("-inf"))
        return scores, self._topk(scores)

    def _topk(self, scores: torch.Tensor) -> torch.Tensor:
        """Top-min(K, end) by score, descending, ties -> lower position; -inf picks become -1; pad to K."""
        K = self.cfg.index_topk
        k = min(K, scores.shape[-1])
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        vals = torch.gather(scores, -1, order)
        idx = torch.where(torch.isneginf(vals), torch.full_like(order, -1), order)
        pad = torch.full((*idx.shape[:-1], K - k), -1, dtype=torch.int64)
        return torch.cat([idx, pad], dim=-1).to(torch.int64)

    # --- attention ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, start_pos: int, form: str | None = None) -> dict[str, torch.Tensor]:
        """Run the layer on x [B, S, hidden] at positions start_pos..start_pos+S-1.

        form: None = [R]'s choice (S > 1 -> "mha", S == 1 -> "absorbed"), or force one.
        Returns {"out": [B,S,hidden] f32, "topk": [B,S,K] int64 (-1 padded), "index_scores":
        [B,S,start_pos+S] f32 (-inf for keys after the query)}.
        """
        cfg = self.cfg
        B, S, hid = x.shape
        end = start_pos + S
        if hid != cfg.hidden_size or B > self.max_batch or start_pos < 0 or end > self.max_seq_len:
            raise ValueError(f"bad input shape {tuple(x.shape)} / start_pos {start_pos}")
        form = form or ("mha" if S > 1 else "absorbed")
        if form not in ("mha", "absorbed"):
            raise ValueError(f"unknown form {form!r}")
        H, Dn, Dr, Dv, C = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        cos, sin = self.cos[start_pos:end], self.sin[start_pos:end]
        x = self._r(x)

        # queries: c_q = q_norm(wq_a x) (shared with the indexer); rope on the LAST Dr of 192.
        cq = self._rmsnorm(self._linear(x, "wq_a"), self.q_norm)
        q = self._linear(cq, "wq_b").reshape(B, S, H, Dn + Dr)
        q_nope, q_pe = q[..., :Dn], self._r(apply_rope(q[..., Dn:], cos, sin, interleaved=True))
        # latent + shared rope key, written to the caches before attention.
        kv = self._linear(x, "wkv_a")
        c = self._rmsnorm(kv[..., :C], self.kv_norm)
        k_pe = self._r(apply_rope(kv[..., C:], cos, sin, interleaved=True))
        self.kv_cache[:B, start_pos:end] = self._latent_for_cache(c)
        self.pe_cache[:B, start_pos:end] = self._pe_for_cache(k_pe)

        scores, topk = self._indexer(x, cq, start_pos, cos, sin)
        allowed = torch.zeros(B, S, end + 1, dtype=torch.bool)
        allowed.scatter_(-1, torch.where(topk < 0, end, topk), True)  # -1 -> dummy column `end`
        bias = torch.zeros(B, S, end).masked_fill(~allowed[..., :end], float("-inf"))[:, :, None, :]

        c_all, pe_all = self.kv_cache[:B, :end], self.pe_cache[:B, :end]
        scale = torch.tensor(cfg.softmax_scale, dtype=torch.float32)
        if form == "mha":
            kvb = self._linear(c_all, "wkv_b").reshape(B, end, H, Dn + Dv)
            k_nope, v = kvb[..., :Dn], kvb[..., Dn:]
            k_pe_h = pe_all[:, :, None, :].expand(B, end, H, Dr)
            k = torch.cat([k_nope, k_pe_h], dim=-1)
            qf = torch.cat([q_nope, q_pe], dim=-1)
            logits = _dot("bshd,bthd->bsht", qf, k) * scale + bias
            prob = torch.softmax(logits, dim=-1)
            out = self._r(_dot("bsht,bthd->bshd", prob, v))
        else:
            w_uk, w_uv = self.wkv_b_heads[:, :Dn], self.wkv_b_heads[:, Dn:]
            q_abs = self._r(_dot("bshd,hdc->bshc", q_nope, w_uk))
            qf = torch.cat([q_abs, q_pe], dim=-1)  # [B,S,H,C+Dr] against the 576-d record [c; k_pe]
            rec = torch.cat([c_all, pe_all], dim=-1)
            logits = _dot("bshc,btc->bsht", qf, rec) * scale + bias
            prob = torch.softmax(logits, dim=-1)
            o_lat = self._r(_dot("bsht,btc->bshc", prob, c_all))
            out = self._r(_dot("bshc,hdc->bshd", o_lat, w_uv))
        y = self._linear(out.reshape(B, S, H * Dv), "wo")
        return {"out": y, "topk": topk, "index_scores": scores}

    __call__ = forward
