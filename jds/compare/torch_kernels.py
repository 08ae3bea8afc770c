"""The comparator's stages as plain torch ops, with the semantics of jds's stages (jds/ops, jds/v32.py,
jds/v4.py) and the byte layouts of jds/ops/records.py.

Why torch ops and not vLLM's kernels: vLLM cannot be installed on the GPU machine, and FlashMLA / DeepGEMM
are not pip-installable there either. Each stage below names the vLLM kernel it stands in for and the
performance gap expected from the substitution (an estimate from the work each does); what each stage
costs on the GPU is measured per stage by ``python -m jds.compare.torch_profile`` (benchmarks/results/
torch_stages_*; docs/perf-log.md sets it beside the expectations). Every function is CUDA-graph safe: static shapes, no host synchronisation, no boolean-mask
indexing, cache writes in place.

Caches: a layer's paged cache is one flat 1-D tensor ``storage`` of ``num_blocks * page_elems`` elements
(the same bytes as jds's ``[num_blocks, page_elems]`` array) plus a scratch tail of one record, where the
writes of padding tokens (slot -1) land. vLLM's insert kernels skip slot -1 inside the kernel; an
unfused torch scatter cannot skip, so it writes somewhere harmless instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

FP8_MAX = 448.0
FLT_MIN = float(np.finfo(np.float32).tiny)
F32 = torch.float32
BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn


_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm(..., out_dtype=) (CUDA, recent torch)


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": F32, "bfloat16": BF16}[name]


# ----- dense math ------------------------------------------------------------------------------------
def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., in] @ w[out, in]^T in w's dtype with fp32 accumulation, rounded once to ``out_dtype``.

    A bf16 weight with an fp32 output keeps the fp32 accumulator (jds: ``preferred_element_type``): on
    CUDA through ``torch.mm(..., out_dtype=float32)``; on the CPU, which lacks that overload, by an fp32
    matmul of the bf16 values (exact products, fp32 sums: the same result up to summation order).
    """
    out_dtype = out_dtype or w.dtype
    xs = x.to(w.dtype)
    if out_dtype == w.dtype:
        return torch.nn.functional.linear(xs, w)
    if w.dtype == BF16 and out_dtype == F32 and x.is_cuda and _MM_OUT_DTYPE:
        y = torch.mm(xs.reshape(-1, xs.shape[-1]), w.t(), out_dtype=F32)
        return y.reshape(xs.shape[:-1] + (w.shape[0],))
    return torch.nn.functional.linear(xs.to(F32), w.to(F32)).to(out_dtype)


def per_head(spec: str, a: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch.einsum(spec, a, w)`` in w's dtype with fp32 accumulation, rounded once to ``out_dtype`` (jds's
    per-head matmuls, ``V32Attention._per_head``): on CUDA the einsum in w's dtype (cuBLAS accumulates bf16
    products in fp32); on the CPU the fp32 einsum of the same values (exact products, fp32 sums)."""
    a = a.to(w.dtype)
    if w.dtype == F32 or a.is_cuda:
        return torch.einsum(spec, a, w).to(out_dtype)
    return torch.einsum(spec, a.to(F32), w.to(F32)).to(out_dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
             ) -> torch.Tensor:
    """fp32 RMSNorm, one rounding (``w=None``: V4's weightless per-head norm).

    Stands in for vLLM's fused RMSNorm CUDA kernel (one read, one write); as 5-6 separate elementwise
    launches it reads the activation several times: expect a few times slower on large T, and one
    launch per op on small T (host-bound).
    """
    xf = x.to(F32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.to(F32)
    return y.to(out_dtype or x.dtype)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float, out_dtype: torch.dtype
               ) -> torch.Tensor:
    """fp32 LayerNorm with biased variance (the V3.2 indexer's k_norm)."""
    xf = x.to(F32)
    mu = xf.mean(-1, keepdim=True)
    var = (xf - mu).pow(2).mean(-1, keepdim=True)
    return ((xf - mu) * torch.rsqrt(var + eps) * w.to(F32) + b.to(F32)).to(out_dtype)


def rope_cos_sin(inv_freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ang = positions.to(F32)[:, None] * inv_freqs[None, :]
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the whole last axis in fp32 (pairs (2i, 2i+1) when interleaved, else (i, i + d/2))."""
    xf = x.to(F32)
    shape = cos.shape[:1] + (1,) * (xf.dim() - 2) + cos.shape[-1:]
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    if interleaved:
        u, v = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([u * c - v * s, u * s + v * c], dim=-1).reshape(xf.shape)
    else:
        h = xf.shape[-1] // 2
        u, v = xf[..., :h], xf[..., h:]
        out = torch.cat([u * c - v * s, u * s + v * c], dim=-1)
    return out.to(x.dtype)


def rope_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rope_dim: int, first: bool,
              interleaved: bool, inverse: bool = False) -> torch.Tensor:
    """RoPE on the first or last ``rope_dim`` dims. Stands in for vLLM's rotary-embedding CUDA kernel
    (in-place on the rope slice); here a slice, a dozen elementwise ops and a concatenation."""
    if first:
        return torch.cat([apply_rope(x[..., :rope_dim], cos, sin, interleaved=interleaved, inverse=inverse),
                          x[..., rope_dim:]], dim=-1)
    return torch.cat([x[..., :-rope_dim],
                      apply_rope(x[..., -rope_dim:], cos, sin, interleaved=interleaved, inverse=inverse)], dim=-1)


def hadamard_rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x @ H * n^-1/2 in fp32, one rounding; ``h`` the Sylvester matrix [n, n] fp32 (vLLM:
    fast_hadamard_transform; here one small GEMM)."""
    n = x.shape[-1]
    return (torch.matmul(x.to(F32), h) * (n ** -0.5)).to(x.dtype)


# ----- FP8 ------------------------------------------------------------------------------------------
def ue8m0_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 v) for positive fp32 v, exact (frexp)."""
    m, e = torch.frexp(v)
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(v), e)


def block_scale(amax: torch.Tensor, fmt: str, floor: float) -> torch.Tensor:
    a = torch.clamp(amax.to(F32), min=floor)
    v = torch.clamp(a * np.float32(1.0 / FP8_MAX), min=FLT_MIN)
    return ue8m0_ceil(v) if fmt == "ue8m0" else v


def quantize_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Clamp to +-448, round to nearest even into float8_e4m3fn."""
    return torch.clamp(x.to(F32), -FP8_MAX, FP8_MAX).to(E4M3)


def act_quant(x: torch.Tensor, block: int, fmt: str = "ue8m0", floor: float = 1e-4
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-``block`` quantisation of the last axis: (e4m3 [..., n], fp32 scales [..., n/block])."""
    n = x.shape[-1]
    xb = x.to(F32).reshape(x.shape[:-1] + (n // block, block))
    s = block_scale(xb.abs().amax(-1), fmt, floor)
    return quantize_e4m3(xb / s[..., None]).reshape(x.shape), s


def dequant(q: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    n = q.shape[-1]
    return (q.to(F32).reshape(q.shape[:-1] + (n // block, block)) * s[..., None]).reshape(q.shape)


def dequant_weight(wq: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """fp32 W = Wq * S[..., i // block, j // block] (an e4m3 weight [..., out, in] with its block scales: jds's
    ``Linear``, or a stack of experts' [E, out, in])."""
    o, i = wq.shape[-2:]
    s = scale.to(F32).repeat_interleave(block, -2)[..., :o, :].repeat_interleave(block, -1)[..., :i]
    return wq.to(F32) * s


# torch's blockwise-scaled FP8 GEMM (1x128 x scales, 128x128 weight scales: DeepGEMM's and vLLM's recipe), where
# this torch and device take it; else None. Found on the first CUDA call, kept for the process: a comparator
# step must not change its GEMM between calls (FP8_GEMM["path"] names the one in use, "error" why not blockwise).
FP8_GEMM: dict[str, Any] = {"path": None, "error": None}


def _blockwise_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = blockwise-scaled xq [M, K] @ wq [N, K]^T through ``torch.nn.functional.scaled_mm`` (torch >=
    2.10, cuBLASLt >= 12.9 on sm90): x scales M-major [M, K/128], weight scales [K/128 padded to 4, N/128]."""
    F = torch.nn.functional
    kb = xq.shape[1] // 128
    sa = sx.t().contiguous().t()
    sb = F.pad(ws.to(F32), (0, -(-kb // 4) * 4 - kb)).contiguous().t()
    st, sw = F.ScalingType, F.SwizzleType
    return F.scaled_mm(xq, wq.t(), sa, st.BlockWise1x128, sb, st.BlockWise128x128, sw.NO_SWIZZLE, sw.NO_SWIZZLE,
                       output_dtype=out_dtype)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype,
               scale_fmt: str = "ue8m0") -> torch.Tensor:
    """DeepSeek's ``linear()`` with an FP8 weight, as jds's ``fp8_linear``: x re-quantised per 1 x 128 with
    ``scale_fmt`` scales, e4m3 W [N, K] with 128 x 128 block scales, fp32 accumulation, one rounding to
    ``out_dtype``; y [..., N] (N: W's stored rows). vLLM runs DeepGEMM's / CUTLASS's blockwise FP8 GEMM here;
    the stand-in is torch's blockwise ``scaled_mm`` on CUDA where it runs (``FP8_GEMM``), else (the CPU, or a
    torch without it) one fp32 matmul of the dequantised operands: the same sums up to their order (exactly the
    same terms for power-of-two scales). x's quantisation is vLLM's one ``per_token_group_quant_fp8`` kernel; here
    it is several torch ops (amax, scale, divide, clamp, convert: launches of their own in eager mode), a gap of a
    few small kernels per linear, measured per stage by ``torch_profile --fp8-weights``."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, sx = act_quant(x.reshape(-1, k), 128, scale_fmt)
    if x.is_cuda and FP8_GEMM["path"] != "dequantised":
        try:
            y = _blockwise_mm(xq, sx, wq, ws, out_dtype)
            FP8_GEMM["path"] = "blockwise"
            return y.reshape(*lead, wq.shape[0])
        except Exception as e:  # noqa: BLE001 - this torch / cuBLAS lacks it: the dequantised form, said why
            if FP8_GEMM["path"] == "blockwise":
                raise
            FP8_GEMM.update(path="dequantised", error=f"{type(e).__name__}: {e}"[:300])
    y = torch.nn.functional.linear(dequant(xq, sx, 128), dequant_weight(wq, ws))
    return y.to(out_dtype).reshape(*lead, wq.shape[0])


def _u8(x: torch.Tensor) -> torch.Tensor:
    """Bytes of ``x`` (little-endian), the element bytes merged into the last axis."""
    x = x.contiguous()
    return x.view(torch.uint8).reshape(x.shape[:-1] + (x.shape[-1] * x.element_size(),))


def _from_u8(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b.contiguous().view(dtype)


# ----- record formats (the bytes of jds/ops/records.py) ---------------------------------------------
def _kind(fmt: Any) -> str:
    return type(fmt).__name__  # FloatRows | MlaRecord656 | IndexerRecord132 | MlaRecord584


def storage_dtype(fmt: Any) -> torch.dtype:
    if _kind(fmt) == "FloatRows":
        return {"float32": F32, "bfloat16": BF16}[np.dtype(fmt.dtype).name]
    return torch.uint8


def record_elems(fmt: Any) -> int:
    return fmt.page_elems // fmt.entries_per_page


def segments(fmt: Any, slots: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """(start offset in the flat cache, length) of each contiguous part of each slot's record."""
    k, epp = _kind(fmt), fmt.entries_per_page
    if k in ("FloatRows", "MlaRecord656"):
        n = record_elems(fmt)
        return [(slots * n, n)]
    page, j = torch.div(slots, epp, rounding_mode="floor"), slots % epp
    base = page * fmt.page_elems
    if k == "IndexerRecord132":
        return [(base + j * fmt.dim, fmt.dim), (base + epp * fmt.dim + j * 4, 4)]
    if k == "MlaRecord584":
        d, sb = fmt.data_bytes, fmt.scale_bytes
        return [(base + j * d, d), (base + epp * d + j * sb, sb)]
    raise ValueError(f"record format {k} is not supported by the torch comparator")


def pack(fmt: Any, rows: torch.Tensor) -> torch.Tensor:
    """[N, D] rows -> [N, record] stored elements, byte for byte what jds's ``fmt.pack`` stores."""
    k = _kind(fmt)
    if k == "FloatRows":
        return rows.to(storage_dtype(fmt))
    if k == "MlaRecord656":
        lat, pe = rows[..., : fmt.latent_dim], rows[..., fmt.latent_dim:]
        if fmt.scale_fmt == "ue8m0":
            q, s = act_quant(lat, 128, "ue8m0", 1e-4)
        else:  # vLLM's writer: scale = max(amax / 448, FLT_MIN) by true division, then x / scale
            lb = lat.to(F32).reshape(lat.shape[:-1] + (fmt.latent_dim // 128, 128))
            amax = lb.abs().amax(-1)
            # a tensor divisor: CUDA turns division by a Python scalar into a multiplication by its
            # reciprocal, an ulp off (the e4m3 rounding ties jds's true_divide guards against)
            s = torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=FLT_MIN)
            q = quantize_e4m3(lb / s[..., None]).reshape(lat.shape)
        return torch.cat([_u8(q), _u8(s), _u8(pe.to(BF16))], dim=-1)
    if k == "IndexerRecord132":
        q, s = act_quant(rows, fmt.dim, fmt.scale_fmt, 1e-4)
        return torch.cat([_u8(q), _u8(s)], dim=-1)
    if k == "MlaRecord584":
        nope = rows[..., : fmt.nope_dim].to(BF16).to(F32)
        nb = nope.reshape(nope.shape[:-1] + (fmt.n_scales, fmt.block))
        s = block_scale(nb.abs().amax(-1), "ue8m0", 1e-4)
        q = quantize_e4m3(nb / s[..., None]).reshape(nope.shape)
        _, e = torch.frexp(s)  # s = 0.5 * 2^e exactly
        eb = (e - 1 + 127).to(torch.uint8)
        pad = torch.zeros(eb.shape[:-1] + (1,), dtype=torch.uint8, device=eb.device)
        return torch.cat([_u8(q), _u8(rows[..., fmt.nope_dim:].to(BF16)), eb, pad], dim=-1)
    raise ValueError(f"record format {k} is not supported by the torch comparator")


def unpack(fmt: Any, recs: torch.Tensor) -> torch.Tensor:
    """[..., record] stored elements -> [..., D] fp32 rows (dequantised)."""
    k = _kind(fmt)
    if k == "FloatRows":
        return recs.to(F32)
    if k == "MlaRecord656":
        n_s = fmt.latent_dim // 128
        q = _from_u8(recs[..., : fmt.latent_dim], E4M3).to(F32)
        s = _from_u8(recs[..., fmt.latent_dim: fmt.latent_dim + 4 * n_s], F32)
        pe = _from_u8(recs[..., fmt.latent_dim + 4 * n_s:], BF16).to(F32)
        return torch.cat([dequant(q, s, 128), pe], dim=-1)
    if k == "IndexerRecord132":
        q = _from_u8(recs[..., : fmt.dim], E4M3).to(F32)
        return q * _from_u8(recs[..., fmt.dim:], F32)
    if k == "MlaRecord584":
        q = _from_u8(recs[..., : fmt.nope_dim], E4M3).to(F32)
        pe = _from_u8(recs[..., fmt.nope_dim: fmt.data_bytes], BF16).to(F32)
        e = recs[..., fmt.data_bytes: fmt.data_bytes + fmt.n_scales].to(torch.int32) - 127
        s = torch.ldexp(torch.ones(e.shape, dtype=F32, device=e.device), e)
        return torch.cat([dequant(q, s, fmt.block), pe], dim=-1)
    raise ValueError(f"record format {k} is not supported by the torch comparator")


def new_storage(fmt: Any, num_blocks: int, device: torch.device) -> torch.Tensor:
    """Flat cache of ``num_blocks`` pages plus a one-record scratch tail for padding writes."""
    return torch.zeros(num_blocks * fmt.page_elems + record_elems(fmt), dtype=storage_dtype(fmt), device=device)


def write_records(storage: torch.Tensor, fmt: Any, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Store ``rows`` [N, D] at ``slots`` [N] in place; slot -1 writes into the scratch tail.

    Stands in for vLLM's fused insert kernels (``concat_and_cache_mla`` with the fp8_ds_mla layout, the
    indexer's ``indexer_k_quant_and_cache``, V4's fused q-norm/RoPE/kv-insert). Unfused, the quantisation
    is ~20 elementwise launches and each record part one index_put: expect several times the fused
    kernel's time at large T and a launch-bound cost at small T.
    """
    vals = pack(fmt, rows).to(storage.dtype)
    scratch = storage.shape[0] - record_elems(fmt)
    pos = 0
    for start, n in segments(fmt, torch.clamp(slots, min=0)):
        ar = torch.arange(n, device=slots.device)
        off = torch.where((slots >= 0)[:, None], start[:, None] + ar, scratch + pos + ar)
        storage.index_put_((off.reshape(-1),), vals[:, pos: pos + n].reshape(-1))
        pos += n


def read_records(storage: torch.Tensor, fmt: Any, slots: torch.Tensor) -> torch.Tensor:
    """Gather and dequantise the records at ``slots`` (any shape); -1 reads slot 0 (mask it)."""
    parts = []
    for start, n in segments(fmt, torch.clamp(slots, min=0)):
        off = start[..., None] + torch.arange(n, device=slots.device)
        parts.append(storage[off])
    return unpack(fmt, torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])


def global_slots(block_tables: torch.Tensor, req_idx: torch.Tensor, local: torch.Tensor, epp: int
                 ) -> torch.Tensor:
    """Request-local entry index [T, ...] -> global slot through each token's block-table row; -1 stays."""
    safe = torch.clamp(local, min=0)
    rows = block_tables[req_idx]
    page = torch.gather(rows, 1, torch.div(safe, epp, rounding_mode="floor").reshape(safe.shape[0], -1))
    slot = page.reshape(safe.shape) * epp + safe % epp
    return torch.where(local >= 0, slot, torch.full_like(slot, -1))


def gather_request_rows(storage: torch.Tensor, fmt: Any, block_tables: torch.Tensor, max_entries: int
                        ) -> torch.Tensor:
    r = block_tables.shape[0]
    local = torch.arange(max_entries, device=block_tables.device).expand(r, max_entries)
    slots = global_slots(block_tables, torch.arange(r, device=block_tables.device), local, fmt.entries_per_page)
    return read_records(storage, fmt, slots)


# ----- indexer --------------------------------------------------------------------------------------
def prepare_indexer_q(q: torch.Tensor, w: torch.Tensor, *, head_dim: int, n_heads: int, fp8: bool,
                      hadamard: torch.Tensor | None, dtype: torch.dtype, scale_fmt: str = "ue8m0"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Roped indexer q -> (fp32 q for scoring, FP8-dequantised when ``fp8``; head weights with the
    constant scales folded in). Stands in for vLLM's ``_fused_indexer_q_rope_quant_kernel`` (Triton)."""
    q = q.to(dtype)
    if hadamard is not None:
        q = hadamard_rotate(q, hadamard)
    if fp8:
        q8, s = act_quant(q, head_dim, scale_fmt, 1e-4)
        q = dequant(q8, s, head_dim)
    return q.to(F32), w.to(F32) * (head_dim ** -0.5) * (n_heads ** -0.5)


def indexer_logits(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, req_idx: torch.Tensor
                   ) -> torch.Tensor:
    """I[t, s] = sum_h w[t, h] relu(q[t, h] . k[req[t], s]) in fp32: q [T, Hi, D], w [T, Hi],
    keys [R, N, D] (each request's keys), -> [T, N].

    Stands in for DeepGEMM's ``fp8_paged_mqa_logits`` (decode) / ``fp8_mqa_logits`` (prefill): those read
    the FP8 cache in place with FP8 MMAs; this dequantises every request's keys to fp32 first (a gather of
    4x the cache bytes), then runs an fp32 batched GEMM. Expect several times DeepGEMM's time at long
    contexts (fp32 vs FP8 tensor-core throughput and the extra materialised keys).
    """
    k = keys[req_idx]  # [T, N, D]
    dots = torch.bmm(q, k.transpose(1, 2))  # [T, Hi, N]
    return torch.bmm(w[:, None, :], torch.relu(dots)).squeeze(1)


def topk_visible(scores: torch.Tensor, n_visible: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k over the first ``n_visible[t]`` entries; int32 [T, k] request-local indices, -1 where fewer.

    Ties go to the lower index (jds's rule, e.g. rows of exact zeros after the relu) through a stable
    descending sort of the whole row, where torch.topk leaves the tie order unspecified. Stands in for
    vLLM's ``top_k_per_row`` CUDA kernels (radix select, one pass per digit): a full sort of 4K-64K
    entries per row, expect a few times their time at long contexts.
    """
    n = scores.shape[-1]
    kk = min(k, n)
    col = torch.arange(n, device=scores.device)
    masked = torch.where(col[None, :] < n_visible[:, None], scores, torch.full_like(scores, -torch.inf))
    vals, idx = torch.sort(masked, dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :kk], idx[:, :kk]
    idx = torch.where(vals > -torch.inf, idx, torch.full_like(idx, -1)).to(torch.int32)
    if kk < k:
        idx = torch.nn.functional.pad(idx, (0, k - kk), value=-1)
    return idx


# ----- sparse MQA -----------------------------------------------------------------------------------
def sparse_mqa(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, *, scale: float, v_dim: int,
               sink: torch.Tensor | None = None) -> torch.Tensor:
    """One shared KV head over gathered candidate rows: q [T, H, Dk], rows [T, K, Dk], valid [T, K] ->
    fp32 [T, H, v_dim]; fp32 softmax, optional per-head sink mass; rows without candidates give zeros.

    Stands in for FlashMLA's sparse decode/prefill kernels (``flash_mla_sparse_fwd``,
    ``flash_mla_with_kvcache`` with indices): those gather the FP8 records inside the kernel and run bf16
    MMAs with an online softmax. This materialises the dequantised fp32 rows, the fp32 logits and
    probabilities: expect it an order of magnitude slower at decode batch 64 / top-k 2048 and memory-heavy
    at large T.
    """
    logits = torch.bmm(q.to(F32), rows.to(F32).transpose(1, 2)) * scale  # [T, H, K]
    logits = torch.where(valid[:, None, :], logits, torch.full_like(logits, -torch.inf))
    m = logits.amax(-1)
    if sink is not None:
        m = torch.maximum(m, sink.to(F32)[None, :])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - m[..., None])
    denom = p.sum(-1)
    if sink is not None:
        denom = denom + torch.exp(sink.to(F32)[None, :] - m)
    out = torch.bmm(p, rows[..., :v_dim].to(F32))
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.where(denom[..., None] > 0, out / safe[..., None], torch.zeros_like(out))


# ----- V4 compressor --------------------------------------------------------------------------------
def closing_tokens(positions: torch.Tensor, slot_mapping: torch.Tensor, ratio: int, max_out: int
                   ) -> torch.Tensor:
    """Indices of the real tokens closing a block, ascending, -1 filled to ``max_out`` (graph-safe:
    a prefix sum and a scatter in place of nonzero)."""
    closes = ((positions + 1) % ratio == 0) & (slot_mapping >= 0)
    t = positions.shape[0]
    dest = torch.where(closes, torch.cumsum(closes.to(torch.int64), 0) - 1, torch.full_like(positions, max_out,
                                                                                          dtype=torch.int64))
    dest = torch.clamp(dest, max=max_out)
    buf = torch.full((max_out + 1,), -1, dtype=torch.int64, device=positions.device)
    buf.scatter_(0, dest, torch.arange(t, device=positions.device))
    return buf[:max_out]


def pool_blocks(state: torch.Tensor, fmt: Any, block_tables: torch.Tensor, req: torch.Tensor,
                blocks: torch.Tensor, *, ratio: int, d: int, block_size: int) -> torch.Tensor:
    """Per-channel softmax pooling of block ``blocks[n]`` (and at ratio 4 the block before) -> [N, d]."""
    c = 2 if ratio == 4 else 1
    j = torch.arange(ratio, device=blocks.device)

    def gather(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        local = torch.where((b >= 0)[:, None], b[:, None] * ratio + j, torch.full_like(b[:, None] * ratio + j, -1))
        return read_records(state, fmt, global_slots(block_tables, req, local, block_size)), local >= 0

    cur, _ = gather(blocks)
    kv = cur[..., (c - 1) * d: c * d]
    sc = cur[..., c * d + (c - 1) * d:]
    if c == 2:
        prev, ok = gather(torch.where(blocks >= 1, blocks - 1, torch.full_like(blocks, -1)))
        kv = torch.cat([prev[..., :d], kv], dim=1)
        psc = torch.where(ok[..., None], prev[..., c * d: c * d + d], torch.full_like(prev[..., :d], -torch.inf))
        sc = torch.cat([psc, sc], dim=1)
    return (torch.softmax(sc, dim=1) * kv).sum(1)


def compress(state: torch.Tensor, state_fmt: Any, proj: torch.Tensor, ape: torch.Tensor, *,
             positions: torch.Tensor, req_idx: torch.Tensor, slot_mapping: torch.Tensor,
             block_tables: torch.Tensor, ratio: int, d: int, block_size: int, norm_weight: torch.Tensor,
             eps: float, inv_freqs: torch.Tensor, rope_dim: int, dtype: torch.dtype, max_out: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Save this step's fp32 state rows [kv | gate + ape[p % r]], then pool, norm and rope every block a
    token of this step closes. Returns (entries [max_out, d] in ``dtype``, compressed slots, -1 unused).

    Stands in for vLLM V4's compressor path (a Triton state-save + pooling kernel, then the fused
    norm/RoPE/insert); unfused here: expect it launch-bound at decode and a few times slower at prefill.
    """
    kvp, score = proj.chunk(2, dim=-1)
    rows = torch.cat([kvp.to(F32), score.to(F32) + ape.to(F32)[positions % ratio]], dim=-1)
    write_records(state, state_fmt, slot_mapping, rows)
    idx = closing_tokens(positions, slot_mapping, ratio, max_out)
    valid = idx >= 0
    tok = torch.clamp(idx, min=0)
    req = req_idx[tok]
    block = torch.where(valid, torch.div(positions[tok], ratio, rounding_mode="floor"),
                        torch.full_like(positions[tok], -1))
    pooled = pool_blocks(state, state_fmt, block_tables, req, block, ratio=ratio, d=d, block_size=block_size)
    entry = rms_norm(pooled, norm_weight, eps, dtype)
    cos, sin = rope_cos_sin(inv_freqs, torch.clamp(block, min=0) * ratio)
    entry = rope_part(entry, cos, sin, rope_dim=rope_dim, first=False, interleaved=True)
    return entry, global_slots(block_tables, req, block, block_size // ratio)
