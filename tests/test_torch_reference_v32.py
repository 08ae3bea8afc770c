"""Self-checks of the PyTorch oracle tests/reference/torch_v32.py (CPU, a few seconds).

The oracle is only useful if it is right, so it is checked against things it does not share code
with: a brute-force nearest-e4m3 search, its own two attention forms, its own chunking, and a dense
float64 MLA + indexer written here from the spec.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from jds.config import Numerics, V32Config
from tests.reference.torch_v32 import (
    TorchMLA,
    act_quant,
    block_dequant_weight,
    dequant,
    fp8_linear,
    hadamard,
)

CFG = V32Config.tiny()
FP8_ABLE = ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "indexer.wq_b", "indexer.wk")


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def make_weights(cfg: V32Config, seed: int) -> dict[str, np.ndarray]:
    """Random [out, in] weights with std in**-0.5 (unit-scale activations), norms ~1."""
    rng = np.random.default_rng(seed)

    def lin(o: int, i: int) -> np.ndarray:
        return (rng.standard_normal((o, i)) * i ** -0.5).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    H, hid = cfg.n_heads, cfg.hidden_size
    return {
        "wq_a": lin(cfg.q_lora_rank, hid),
        "q_norm": norm(cfg.q_lora_rank),
        "wq_b": lin(H * cfg.qk_head_dim, cfg.q_lora_rank),
        "wkv_a": lin(cfg.kv_record_dim, hid),
        "kv_norm": norm(cfg.kv_lora_rank),
        "wkv_b": lin(H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "wo": lin(hid, H * cfg.v_head_dim),
        "indexer.wq_b": lin(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
        "indexer.wk": lin(cfg.index_head_dim, hid),
        "indexer.k_norm.weight": norm(cfg.index_head_dim),
        "indexer.k_norm.bias": (0.1 * rng.standard_normal(cfg.index_head_dim)).astype(np.float32),
        "indexer.weights_proj": lin(cfg.index_n_heads, hid),
    }


def to_fp8_weights(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Quantise the fp8-able weights per 128x128 block (scale = amax/448) into e4m3 + .scale."""
    out = dict(w)
    for name in FP8_ABLE:
        W = torch.from_numpy(w[name])
        o, i = W.shape
        nbo, nbi = -(-o // 128), -(-i // 128)
        S = torch.zeros(nbo, nbi)
        for a in range(nbo):
            for b in range(nbi):
                S[a, b] = W[a * 128:(a + 1) * 128, b * 128:(b + 1) * 128].abs().max() / 448
        Srep = S.repeat_interleave(128, 0)[:o].repeat_interleave(128, 1)[:, :i]
        W8 = (W / Srep).to(torch.float8_e4m3fn).float().numpy().astype(ml_dtypes.float8_e4m3fn)
        out[name], out[name + ".scale"] = W8, S.numpy()
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def topk_sets(t: torch.Tensor) -> list:
    return [[sorted(v for v in row.tolist() if v >= 0) for row in b] for b in t]


def e4m3_positive_grid() -> tuple[np.ndarray, np.ndarray]:
    """All finite non-negative e4m3fn values (ascending) and their codes, read from the bit patterns."""
    codes = np.arange(0, 0x7F, dtype=np.uint8)  # 0x7F is NaN in e4m3fn
    vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return vals, codes


def brute_e4m3(y: np.ndarray) -> np.ndarray:
    """Nearest e4m3 value to each y (|y| <= 448), ties to the even code, by exhaustive search."""
    vals, codes = e4m3_positive_grid()
    out = np.empty_like(y, dtype=np.float64)
    for n, v in enumerate(y.astype(np.float64).ravel()):
        d = np.abs(vals - abs(v))
        cand = np.flatnonzero(d == d.min())
        if len(cand) > 1:
            cand = [c for c in cand if codes[c] % 2 == 0]
            assert len(cand) == 1
        out.flat[n] = math.copysign(vals[cand[0]], v)
    return out


def brute_scale(amax: float, fmt: str, floor: float) -> float:
    a = np.float32(max(np.float32(amax), np.float32(floor)))
    v = float(a * np.float32(1.0 / 448.0))  # fp32 multiply by fp32(1/448)
    if fmt == "amax":
        return v
    k = -160
    while 2.0 ** k < v:  # smallest power of two >= v
        k += 1
    return 2.0 ** k


# ------------------------------------------------------------------------------------------
# primitives
# ------------------------------------------------------------------------------------------


def _quant_blocks() -> np.ndarray:
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal(128) * 10.0 ** rng.uniform(-3, 3) for _ in range(40)]
    blocks.append(np.zeros(128))  # all zero: floor scale, q = 0
    blocks.append(rng.standard_normal(128) * 1e-7)  # below the 1e-4 floor
    sub = rng.standard_normal(128) * 2.0 ** -12  # lands in the e4m3 subnormal range
    sub[0] = 448.0
    blocks.append(sub)
    big = rng.standard_normal(128) * 1e5
    big[:4] = [1e4, -3e5, 449.0, -448.5]  # values above 448
    blocks.append(big)
    tie = np.full(128, 1.0)
    tie[0] = 256.0  # amax 256 -> ue8m0 scale 1, so the entries below are exact e4m3 midpoints
    tie[1:9] = [1.0625, 1.1875, -1.0625, 3.25 + 0.125, 0.0068359375, 240.0 + 8.0, 0.0009765625 * 1.5, -17.0]
    blocks.append(tie)
    neg = -np.abs(rng.standard_normal(128)) * 3.0
    blocks.append(neg)
    # an amax whose fp32 product with fp32(1/448) is an exact power of two (frexp mantissa 0.5).
    a = np.float32(448.0)
    for _ in range(64):
        if float(a * np.float32(1 / 448)) == 1.0:
            break
        a = np.nextafter(a, np.float32(np.inf))
    assert float(a * np.float32(1 / 448)) == 1.0
    p2 = rng.standard_normal(128)
    p2[5] = -float(a)
    blocks.append(p2)
    return np.stack(blocks).astype(np.float32)


@pytest.mark.parametrize("fmt,floor", [("ue8m0", 1e-4), ("amax", 1e-4), ("amax", float(np.finfo(np.float32).tiny))])
def test_act_quant_matches_brute_force(fmt: str, floor: float) -> None:
    x = _quant_blocks()
    q, s = act_quant(torch.from_numpy(x), 128, fmt, floor)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (x.shape[0], 1)
    for r in range(x.shape[0]):
        s_ref = brute_scale(float(np.abs(x[r]).max()), fmt, floor)
        assert float(s[r, 0]) == s_ref, (r, float(s[r, 0]), s_ref)
        y = np.clip(x[r] / np.float32(s_ref), -448, 448)  # fp32 division, then clamp
        np.testing.assert_array_equal(q[r].float().numpy().astype(np.float64), brute_e4m3(y))
    np.testing.assert_array_equal(dequant(q, s).numpy(), q.float().numpy() * s.numpy())


def test_act_quant_multi_block_and_ties() -> None:
    x = torch.ones(2, 3, 256)
    x[..., 0] = 256.0
    x[..., 1] = 1.0625  # tie between 1.0 (even) and 1.125
    x[..., 2] = 1.1875  # tie between 1.125 and 1.25 (even)
    q, s = act_quant(x)
    assert s.shape == (2, 3, 2)
    assert float(s[0, 0, 0]) == 1.0 and float(q[0, 0, 1].float()) == 1.0 and float(q[0, 0, 2].float()) == 1.25


def test_hadamard() -> None:
    n = 128
    eye = torch.eye(n)
    H = hadamard(eye) * n ** 0.5
    pc = torch.tensor([[bin(a & b).count("1") % 2 for b in range(n)] for a in range(n)])
    assert torch.equal(H.round(), (1 - 2 * pc).float())
    x = torch.randn(5, n)
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-5)
    assert hadamard(x.bfloat16()).dtype == torch.bfloat16


def test_fp8_linear_equals_dequantised_product() -> None:
    w = to_fp8_weights(make_weights(CFG, 1))
    W8, S = torch.from_numpy(w["wkv_a"].astype(np.float32)), torch.from_numpy(w["wkv_a.scale"])
    x = torch.randn(3, 5, CFG.hidden_size)
    xq, sx = act_quant(x, 128, "ue8m0")
    ref = dequant(xq, sx).double() @ block_dequant_weight(W8, S).double().T
    got = fp8_linear(x, W8, S)
    assert rel_err(got, ref) < 1e-6


# ------------------------------------------------------------------------------------------
# the layer, exact numerics
# ------------------------------------------------------------------------------------------


def _layer(w: dict, numerics: Numerics = Numerics.exact(), cfg: V32Config = CFG) -> TorchMLA:
    return TorchMLA(cfg, w, numerics, max_batch=2, max_seq_len=64)


def test_mha_equals_absorbed() -> None:
    w = make_weights(CFG, 2)
    g = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn(2, 13, CFG.hidden_size, generator=g), torch.randn(2, 6, CFG.hidden_size, generator=g)
    a, b = _layer(w), _layer(w)
    for x, sp in ((x1, 0), (x2, 13)):  # prefill, then a second chunk at start_pos 13
        ra, rb = a.forward(x, sp, form="mha"), b.forward(x, sp, form="absorbed")
        assert rel_err(ra["out"], rb["out"]) < 1e-5
        assert torch.equal(ra["topk"], rb["topk"])
        assert torch.equal(ra["index_scores"], rb["index_scores"])
    assert (ra["topk"] >= 0).sum(-1).max() == CFG.index_topk  # sparsity really engaged


def test_chunked_prefill_and_decode_match_one_shot() -> None:
    w = make_weights(CFG, 3)
    N = 20
    x = torch.randn(2, N, CFG.hidden_size, generator=torch.Generator().manual_seed(3))
    full = _layer(w).forward(x, 0)

    chunked = _layer(w)
    parts = [chunked.forward(x[:, :7], 0), chunked.forward(x[:, 7:], 7)]
    # prefill 5, decode 6 single tokens, then a chunk of 9 (caches persist across all of it)
    mixed_layer = _layer(w)
    mixed = [mixed_layer.forward(x[:, :5], 0)]
    mixed += [mixed_layer.forward(x[:, p:p + 1], p) for p in range(5, 11)]
    mixed.append(mixed_layer.forward(x[:, 11:], 11))
    dec_layer = _layer(w)
    dec = [dec_layer.forward(x[:, p:p + 1], p) for p in range(N)]

    for name, outs in (("chunked", parts), ("mixed", mixed), ("decode", dec)):
        out = torch.cat([o["out"] for o in outs], dim=1)
        topk = torch.cat([o["topk"] for o in outs], dim=1)
        assert rel_err(out, full["out"]) < 1e-5, name
        assert topk_sets(topk) == topk_sets(full["topk"]), name
        last = outs[-1]["index_scores"]
        assert torch.allclose(last, full["index_scores"][:, -last.shape[1]:], rtol=1e-6, atol=1e-7), name
    # top-k bookkeeping: first K positions see every key 0..p, later ones exactly K keys, -1 padded.
    K = CFG.index_topk
    for p in range(N):
        got = topk_sets(full["topk"][:, p:p + 1])
        if p + 1 <= K:
            assert got == [[list(range(p + 1))]] * 2
        else:
            assert all(len(r[0]) == K and max(r[0]) <= p for r in got)
    assert full["topk"].shape == (2, N, K) and full["topk"].dtype == torch.int64


# --- independent dense float64 MLA + indexer, written from the spec ---------------------------


def _yarn_freqs(cfg: V32Config) -> np.ndarray:
    d = cfg.qk_rope_head_dim
    f = cfg.rope_theta ** (-np.arange(0, d, 2) / d)
    if cfg.max_seq_len > cfg.original_seq_len and cfg.rope_factor > 1:
        def cdim(r: float) -> float:
            return d * math.log(cfg.original_seq_len / (r * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
        lo, hi = max(math.floor(cdim(cfg.beta_fast)), 0), min(math.ceil(cdim(cfg.beta_slow)), d - 1)
        ramp = np.clip((np.arange(d // 2) - lo) / (hi - lo), 0, 1)
        f = f / cfg.rope_factor * ramp + f * (1 - ramp)
    return f


def _rope64(x: np.ndarray, pos: np.ndarray, interleaved: bool) -> np.ndarray:
    """x [..., S, (heads,) d] with positions on axis 1 (batch first); complex rotation in float64."""
    d = x.shape[-1]
    ang = pos[:, None] * _yarn_freqs(CFG)[None, :]  # [S, d/2]
    rot = np.exp(1j * ang).reshape((1, len(pos)) + (1,) * (x.ndim - 3) + (d // 2,))
    if interleaved:
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * rot
        return np.stack([z.real, z.imag], -1).reshape(x.shape)
    z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * rot
    return np.concatenate([z.real, z.imag], -1)


def _dense_reference(w: dict, x: np.ndarray, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Float64 MLA over keys `allowed[b, s, t]` (default: causal) and indexer scores (masked -inf)."""
    c = CFG
    B, S, _ = x.shape
    H, Dn, Dr, Dv, C = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    W = {k: v.astype(np.float64) for k, v in w.items()}
    pos = np.arange(S, dtype=np.float64)

    def rms(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return g * v / np.sqrt((v ** 2).mean(-1, keepdims=True) + c.rms_norm_eps)

    cq = rms(x @ W["wq_a"].T, W["q_norm"])
    q = (cq @ W["wq_b"].T).reshape(B, S, H, Dn + Dr)
    q = np.concatenate([q[..., :Dn], _rope64(q[..., Dn:], pos, True)], -1)
    kv = x @ W["wkv_a"].T
    lat = rms(kv[..., :C], W["kv_norm"])
    kpe = _rope64(kv[..., C:], pos, True)
    kvb = (lat @ W["wkv_b"].T).reshape(B, S, H, Dn + Dv)
    k = np.concatenate([kvb[..., :Dn], np.broadcast_to(kpe[:, :, None, :], (B, S, H, Dr))], -1)
    mscale = 0.1 * math.log(c.rope_factor) + 1.0
    scale = (Dn + Dr) ** -0.5 * mscale ** 2
    logits = np.einsum("bshd,bthd->bhst", q, k) * scale
    if allowed is None:
        allowed = np.broadcast_to(np.tril(np.ones((S, S), bool)), (B, S, S))
    logits = np.where(allowed[:, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhst,bthd->bshd", p, kvb[..., Dn:]).reshape(B, S, H * Dv)
    out = o @ W["wo"].T

    # indexer (no fp8, with Hadamard as Numerics.exact() has it): NeoX rope on the FIRST 64 dims.
    Hi, Di = c.index_n_heads, c.index_head_dim
    Hn = np.array([[(-1) ** bin(i & j).count("1") for j in range(Di)] for i in range(Di)], np.float64) / Di ** 0.5
    qi = (cq @ W["indexer.wq_b"].T).reshape(B, S, Hi, Di)
    qi = np.concatenate([_rope64(qi[..., :Dr], pos, False), qi[..., Dr:]], -1) @ Hn
    ki = x @ W["indexer.wk"].T
    mu, var = ki.mean(-1, keepdims=True), ki.var(-1, keepdims=True)
    ki = (ki - mu) / np.sqrt(var + 1e-6) * W["indexer.k_norm.weight"] + W["indexer.k_norm.bias"]
    ki = np.concatenate([_rope64(ki[..., :Dr], pos, False), ki[..., Dr:]], -1) @ Hn
    hw = (x @ W["indexer.weights_proj"].T) * Hi ** -0.5 * Di ** -0.5
    I = np.einsum("bsh,bsht->bst", hw, np.maximum(np.einsum("bshd,btd->bsht", qi, ki), 0))
    I = np.where(np.tril(np.ones((S, S), bool))[None], I, -np.inf)
    return out, I


def test_dense_when_few_tokens() -> None:
    """<= index_topk tokens: DSA is exactly dense causal MLA (spec section 6)."""
    w = make_weights(CFG, 4)
    N = CFG.index_topk
    x = torch.randn(2, N, CFG.hidden_size, generator=torch.Generator().manual_seed(4))
    ref_out, ref_I = _dense_reference(w, x.double().numpy(), None)
    for form in ("mha", "absorbed"):
        r = _layer(w).forward(x, 0, form=form)
        assert rel_err(r["out"], torch.from_numpy(ref_out)) < 1e-5, form
        fin = np.isfinite(ref_I)
        assert np.array_equal(torch.isfinite(r["index_scores"]).numpy(), fin)
        assert rel_err(r["index_scores"][torch.from_numpy(fin)], torch.from_numpy(ref_I[fin])) < 1e-5


def test_sparse_uses_exactly_the_topk_set() -> None:
    """> index_topk tokens: output = dense MLA restricted to the reported keys; top-k = best scores."""
    w = make_weights(CFG, 5)
    N = 3 * CFG.index_topk
    x = torch.randn(2, N, CFG.hidden_size, generator=torch.Generator().manual_seed(5))
    r = _layer(w).forward(x, 0)
    allowed = np.zeros((2, N, N), bool)
    for b in range(2):
        for s in range(N):
            for t in r["topk"][b, s].tolist():
                if t >= 0:
                    allowed[b, s, t] = True
    ref_out, ref_I = _dense_reference(w, x.double().numpy(), allowed)
    assert rel_err(r["out"], torch.from_numpy(ref_out)) < 1e-5
    K = CFG.index_topk
    for b in range(2):
        for s in range(N):
            sel = r["topk"][b, s]
            sel = sel[sel >= 0].numpy()
            assert len(sel) == min(K, s + 1) and len(set(sel.tolist())) == len(sel)
            # every selected key scores at least as high (float64 reference) as every unselected one
            if s + 1 > K:
                rest = np.setdiff1d(np.arange(s + 1), sel)
                assert ref_I[b, s, sel].min() >= ref_I[b, s, rest].max() - 1e-6 * np.abs(ref_I[b, s, : s + 1]).max()


# ------------------------------------------------------------------------------------------
# quantised numerics: smoke + chunking consistency
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("numerics", [Numerics.reference(), Numerics.serving(), Numerics.bf16()])
def test_quantised_numerics_run_and_chunk_consistently(numerics: Numerics) -> None:
    w = make_weights(CFG, 6)
    if numerics.fp8_linear:
        w = to_fp8_weights(w)
    N = 14
    x = torch.randn(1, N, CFG.hidden_size, generator=torch.Generator().manual_seed(6))
    full_layer = TorchMLA(CFG, w, numerics, max_batch=1, max_seq_len=32)
    full = full_layer.forward(x, 0)
    part = TorchMLA(CFG, w, numerics, max_batch=1, max_seq_len=32)
    outs = [part.forward(x[:, :6], 0), part.forward(x[:, 6:], 6)]
    out = torch.cat([o["out"] for o in outs], 1)
    assert torch.isfinite(full["out"]).all()
    assert rel_err(out, full["out"]) < 1e-2
    exact = _layer(make_weights(CFG, 6)).forward(x, 0)
    assert rel_err(full["out"], exact["out"]) < 0.2  # same function up to bf16/fp8 noise
    dec = full_layer.forward(x[:, :1] * 0.5, N)  # decode (absorbed form) after an MHA prefill
    assert torch.isfinite(dec["out"]).all() and dec["out"].dtype == torch.float32
    if numerics.dtype == "bfloat16":
        assert torch.equal(full["out"], full["out"].bfloat16().float())  # values are bf16-rounded
    if numerics.kv_cache_dtype == "fp8":  # cached latent is exactly e4m3 * per-128 scale
        c = full_layer.kv_cache[0, :N].reshape(N, -1, 128)
        amax = c.abs().amax(-1, keepdim=True)
        if numerics.latent_scale_fmt == "ue8m0":
            s = 2.0 ** torch.ceil(torch.log2(amax.double() / 448))
            y = c.double() / s
            assert torch.equal(y, y.float().to(torch.float8_e4m3fn).double())
