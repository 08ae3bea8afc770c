"""V4 block pieces (jds.v4_block) against an independent float64 numpy re-derivation of the released semantics.

The numpy functions below are written from DeepSeek V4-Flash's ``inference/model.py`` (Block.hc_pre / hc_post,
ParallelHead.hc_head, Gate, Expert, MoE) and ``kernel.py`` (hc_split_sinkhorn) as read, never by calling the
JAX code. Where the reference rounds to the activation dtype (bf16) the numpy side rounds at the same points
(``_r``) and computes everything else in float64, so a difference can only come from float32-vs-float64
noise, which the bounds below account for:

* a float32 sum of n terms is off by at most gamma_n = n u sum|terms| (u = 2^-24), the classic bound;
* one rounding to bf16 is at most half an ulp, so a bf16 result is within 1 ulp of the float64 value when the
  float32 noise before the rounding is below half an ulp, and otherwise a one-ulp flip.
Fresh random weights per test (fixed seeds, so runs are reproducible).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jds.nn import export_weights
from jds.v4_block import (HCHead, HyperConnection, V4Block, V4BlockConfig, V4Gate, V4MoE, block, expand_streams,
                          sinkhorn_split, swiglu, validate_tid2eid)
from tests.tolerances import assert_within_ulps, ulp

U32 = 2.0 ** -24  # float32 unit round-off
BF16 = ml_dtypes.bfloat16


def _r(a: np.ndarray, dtype) -> np.ndarray:
    """Round float64 values to ``dtype`` and back (the reference's ``.to(dtype)`` points)."""
    return np.asarray(a, np.float64) if np.dtype(dtype) == np.float64 else \
        np.asarray(np.asarray(a).astype(dtype), np.float64)


def _np(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _params(module: nnx.Module) -> dict[str, np.ndarray]:
    return {k: (np.asarray(v, np.float64) if np.issubdtype(np.asarray(v).dtype, np.floating)
                or np.asarray(v).dtype == BF16 else np.asarray(v))
            for k, v in export_weights(module).items()}


# ------------------------------------------------------------------------------------------------------------
# float64 re-derivation


def np_sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def np_sinkhorn(mixes, scale, base, hc: int, iters: int, eps: float, col_sums_before_last: list | None = None):
    pre = np_sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * np_sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    z = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(mixes.shape[:-1] + (hc, hc))
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    c = e / e.sum(axis=-1, keepdims=True) + eps
    for it in range(iters):
        if it:
            c = c / (c.sum(axis=-1, keepdims=True) + eps)
        if col_sums_before_last is not None and it == iters - 1:
            col_sums_before_last.append(c.sum(axis=-2))
        c = c / (c.sum(axis=-2, keepdims=True) + eps)
    return pre, post, c


def np_mixes(streams, fn, norm_eps):
    """(flat streams, mixes, the float32 error bound of each mix: gamma_n * sum|fn x| * rsqrt)."""
    flat = streams.reshape(streams.shape[:-2] + (-1,))
    rs = 1.0 / np.sqrt(np.mean(flat ** 2, axis=-1, keepdims=True) + norm_eps)
    n = flat.shape[-1]
    return flat, flat @ fn.T * rs, (n + 4) * U32 * (np.abs(flat) @ np.abs(fn).T) * rs


def np_hc_pre(streams, fn, scale, base, hc, iters, hc_eps, norm_eps):
    _, mixes, em = np_mixes(streams, fn, norm_eps)
    pre, post, comb = np_sinkhorn(mixes, scale, base, hc, iters, hc_eps)
    return (pre[..., None] * streams).sum(axis=-2), pre, post, comb, mixes, em


def np_hc_post(out, streams, post, comb):
    # new stream k = post_k out + sum_j comb[j, k] stream_j
    return post[..., :, None] * out[..., None, :] + np.einsum("...jk,...jd->...kd", comb, streams)


def np_rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps) * w


def np_scores(x, w, scoring):
    z = x @ w.T
    if scoring == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, z))
    if scoring == "sigmoid":
        return np_sigmoid(z)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_gate(x, p, cfg: V4BlockConfig, tokens=None):
    """(weights, indices, scores, biased selection scores or None)."""
    s = np_scores(x, p["weight"], cfg.scoring)
    if "tid2eid" in p:
        idx, sel = p["tid2eid"][tokens].astype(np.int64), None
    else:
        sel = s + p["bias"]
        idx = np.argsort(-sel, axis=-1, kind="stable")[:, :cfg.moe_topk]
    w = np.take_along_axis(s, idx, axis=-1)
    if cfg.scoring != "softmax":
        w = w / w.sum(axis=-1, keepdims=True)
    return w * cfg.route_scale, idx, s, sel


def np_swiglu(g, u, limit):
    if limit > 0:
        u = np.clip(u, -limit, limit)
        g = np.minimum(g, limit)
    return g * np_sigmoid(g) * u


def np_expert(x, w1, w3, w2, limit, dt, weight=None):
    h = np_swiglu(_r(x @ w1.T, dt), _r(x @ w3.T, dt), limit)
    if weight is not None:
        h = weight * h
    return _r(_r(h, dt) @ w2.T, dt)


def np_moe(x, p, cfg: V4BlockConfig, dt, tokens=None):
    """The MoE output (rounded once to dt at the end) and the routing it used."""
    w, idx, _, _ = np_gate(x, {k[5:]: v for k, v in p.items() if k.startswith("gate.")}, cfg, tokens)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(cfg.moe_topk):
            e = idx[t, j]
            y[t] += np_expert(x[t:t + 1], p["w1"][e], p["w3"][e], p["w2"][e], cfg.swiglu_limit, dt, w[t, j])[0]
    if cfg.n_shared_experts:
        lim = cfg.swiglu_limit if cfg.shared_swiglu_limit else 0.0
        y += np_expert(x, p["shared.w1"], p["shared.w3"], p["shared.w2"], lim, dt)
    return _r(y, dt), idx


def _topk_margin(sel: np.ndarray, k: int) -> float:
    """Smallest gap between the k-th and (k+1)-th selection score of any row (ties would make top-k ambiguous)."""
    s = -np.sort(-sel, axis=-1)
    return float(np.min(s[:, k - 1] - s[:, k])) if s.shape[-1] > k else np.inf


# ------------------------------------------------------------------------------------------------------------
# config


def test_config_defaults_are_v4_flash():
    c = V4BlockConfig()
    assert (c.hidden_size, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps) == (4096, 4, 20, 1e-6)
    assert (c.n_routed_experts, c.n_shared_experts, c.moe_topk, c.moe_intermediate_size) == (256, 1, 6, 2048)
    assert (c.scoring, c.route_scale, c.swiglu_limit, c.n_hash_layers) == ("sqrtsoftplus", 1.5, 10.0, 3)
    assert c.mix_hc == 24 and c.is_hash_layer(2) and not c.is_hash_layer(3)


@pytest.mark.parametrize("field,value", [
    ("hidden_size", 0), ("vocab_size", -1), ("hc_mult", 0), ("hc_sinkhorn_iters", 0), ("hc_sinkhorn_iters", 2.5),
    ("n_routed_experts", 0), ("moe_topk", 0), ("moe_topk", 17), ("moe_intermediate_size", 0),
    ("n_shared_experts", 2), ("n_shared_experts", -1), ("n_hash_layers", -1), ("hc_eps", -1e-6),
    ("hc_eps", float("nan")), ("norm_eps", 0.0), ("route_scale", 0.0), ("route_scale", float("inf")),
    ("swiglu_limit", -1.0), ("scoring", "relu"), ("dtype", "float16"), ("moe_impl", "dense"),
    ("shared_swiglu_limit", 1), ("hidden_size", True),
])
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        V4BlockConfig.tiny(**{field: value})


def test_tid2eid_validation():
    validate_tid2eid(np.zeros((5, 2), np.int32), 5, 2, 4)
    with pytest.raises(ValueError, match="tid2eid"):
        validate_tid2eid(np.zeros((5, 3), np.int32), 5, 2, 4)
    with pytest.raises(ValueError, match="tid2eid"):
        validate_tid2eid(np.full((5, 2), 4, np.int32), 5, 2, 4)
    with pytest.raises(ValueError, match="tid2eid"):
        validate_tid2eid(np.zeros((5, 2), np.float32), 5, 2, 4)


# ------------------------------------------------------------------------------------------------------------
# hyper-connections


@pytest.mark.parametrize("spread,iters,eps", [(0.5, 20, 1e-6), (2.0, 20, 1e-6), (2.0, 1, 1e-6), (1.0, 3, 1e-6),
                                              (1.0, 20, 1e-2)])
def test_sinkhorn_split(spread, iters, eps):
    hc, t = 4, 64
    rng = np.random.default_rng(int(spread * 10) + iters)
    mixes = rng.normal(size=(t, (2 + hc) * hc)) * spread
    scale = rng.uniform(0.5, 1.5, 3)
    base = rng.normal(size=(2 + hc) * hc) * 0.5
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    mixes, scale, base = (np.asarray(f32(a), np.float64) for a in (mixes, scale, base))
    pre, post, comb = (_np(a) for a in sinkhorn_split(jnp.asarray(f32(mixes)), jnp.asarray(f32(scale)),
                                                        jnp.asarray(f32(base)), hc, iters, eps))
    last = []
    wpre, wpost, wcomb = np_sinkhorn(mixes, scale, base, hc, iters, eps, last)
    # sigmoid(z) with z = m s + b rounded in float32 (|dz| <= 2 u |z|): |d sigmoid| <= sig (1 - sig) 2 u |z|,
    # plus ~4 roundings of its own exp / add / divide.
    def sig_bound(z):
        sg = np_sigmoid(z)
        return sg * (1 - sg) * 2 * U32 * (np.abs(z) + 1) + 8 * U32 * sg

    assert np.all(np.abs(pre - wpre) <= sig_bound(mixes[:, :hc] * scale[0] + base[:hc]) + 2 * U32 * wpre)
    assert np.all(np.abs(post - wpost) <= 2 * sig_bound(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc]))
    # comb: softmax (~4 roundings) then 2 * iters - 1 normalisations, each a sum of hc terms and a divide;
    # relative error grows at most additively, ~ (hc + 2) ulps per step.
    assert_within_ulps(comb, wcomb, np.float32, n=8 + (hc + 2) * 2 * iters, what="comb")
    # What the reference guarantees: the last step normalises columns, so each column sums to
    # S / (S + eps) with S its sum before that step; rows are only as balanced as Sinkhorn has converged.
    cols, rows = comb.sum(axis=-2), comb.sum(axis=-1)
    noise = (8 + (hc + 2) * 2 * iters) * hc * U32 * 2
    np.testing.assert_allclose(1 - wcomb.sum(axis=-2), eps / (last[0] + eps), rtol=1e-9)
    assert np.all(np.abs(cols - 1) <= eps / last[0] + noise), np.abs(cols - 1).max()
    np.testing.assert_allclose(rows, wcomb.sum(axis=-1), rtol=0, atol=noise)
    if spread <= 0.5 and iters == 20 and eps < 1e-4:
        assert np.abs(rows - 1).max() < 1e-5  # converged for mild logits
    assert np.all(wcomb > 0) and np.all(post > 0) and np.all(post < 2) and np.all(pre > eps)


def _streams(rng, cfg, t, dtype) -> tuple[jax.Array, np.ndarray]:
    s = jnp.asarray(rng.normal(size=(t, cfg.hc_mult, cfg.hidden_size)), jnp.float32).astype(dtype)
    return s, _np(s)


def _bound_bf16_or_f32(got, want, mag, dt, n_terms: int, what: str):
    """|got - want| <= 1 ulp of dt at the result + gamma_{n_terms} * mag (float32 accumulation before it)."""
    g, w = _np(got), np.asarray(want, np.float64)
    one = ulp(np.maximum(np.abs(g), np.abs(w)), np.dtype(dt).name) if np.dtype(dt) != np.float32 else \
        ulp(np.maximum(np.abs(g), np.abs(w)), "float32")
    bound = one + (n_terms + 2) * U32 * mag
    err = np.abs(g - w)
    assert np.all(err <= bound), f"{what}: worst {err.max():.3e}, {int((err > bound).sum())} over bound"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_hc_pre_post(dtype):
    # hc_eps and norm_eps made large and distinct so that using one for the other would show.
    cfg = V4BlockConfig.tiny(dtype="bfloat16" if dtype == jnp.bfloat16 else "float32", hc_eps=1e-2, norm_eps=0.05)
    hc_mod = HyperConnection(cfg, nnx.Rngs(1))
    p = _params(hc_mod)
    rng = np.random.default_rng(2)
    streams, s64 = _streams(rng, cfg, 10, dtype)
    x, post, comb = hc_mod.pre(streams)
    assert x.dtype == dtype and post.dtype == jnp.float32 and comb.shape == (10, 4, 4)
    wx, wpre, wpost, wcomb, mixes, em = np_hc_pre(s64, p["fn"], p["scale"], p["base"], cfg.hc_mult,
                                                  cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
    # post = 2 sigmoid(s1 m + b): its error <= 2 * 1/4 * s1 * (error of m) + a few ulps.
    tol_post = 0.5 * p["scale"][1] * em[..., 4:8] + 8 * U32 * 2
    assert np.all(np.abs(_np(post) - wpost) <= tol_post)
    tol_comb = (2 * p["scale"][2] * em[..., 8:].max(-1)[..., None, None] + 2 * (8 + 6 * 2 * 20) * U32) * 2
    assert np.all(np.abs(_np(comb) - wcomb) <= tol_comb)
    # x = sum_j pre_j s_j: pre's error (<= s0/4 * em + ulps) times |s_j|, plus hc float32 terms.
    pre_err = 0.25 * p["scale"][0] * em[..., :4] + 8 * U32
    mag = (np.abs(s64) * (wpre + pre_err)[..., None]).sum(-2)
    extra = (pre_err[..., None] * np.abs(s64)).sum(-2)
    g = _np(x)
    bound = ulp(np.maximum(np.abs(g), np.abs(wx)), "bfloat16" if dtype == jnp.bfloat16 else "float32") \
        + extra + 8 * U32 * mag
    assert np.all(np.abs(g - wx) <= bound), np.abs(g - wx).max()

    out = jnp.asarray(rng.normal(size=(10, cfg.hidden_size)), jnp.float32).astype(dtype)
    new = HyperConnection.post(out, streams, post, comb)
    assert new.dtype == dtype and new.shape == streams.shape
    # Feed the JAX post / comb to the re-derivation to test hc_post alone.
    want = np_hc_post(_np(out), s64, _np(post), _np(comb))
    mag = np.abs(_np(post))[..., None] * np.abs(_np(out))[..., None, :] + \
        np.einsum("...jk,...jd->...kd", np.abs(_np(comb)), np.abs(s64))
    _bound_bf16_or_f32(new, want, mag, dtype, cfg.hc_mult + 1, "hc_post")

    # The wrapper composes pre -> inner -> post (identical ops, so bit-equal).
    inner = lambda v: (v * 2).astype(v.dtype)  # noqa: E731
    np.testing.assert_array_equal(_np(hc_mod(streams, inner)),
                                  _np(HyperConnection.post(inner(x), streams, post, comb)))


def test_hc_head_and_expand():
    cfg = V4BlockConfig.tiny(dtype="float32", hc_eps=1e-2, norm_eps=0.05)
    head = HCHead(cfg, nnx.Rngs(3))
    p = _params(head)
    rng = np.random.default_rng(4)
    h = jnp.asarray(rng.normal(size=(6, cfg.hidden_size)), jnp.float32)
    s = expand_streams(h, cfg.hc_mult)
    assert s.shape == (6, cfg.hc_mult, cfg.hidden_size)
    np.testing.assert_array_equal(np.asarray(s), np.repeat(np.asarray(h)[:, None], cfg.hc_mult, axis=1))
    streams, s64 = _streams(rng, cfg, 6, jnp.float32)
    y = head(streams)
    _, mixes, em = np_mixes(s64, p["fn"], cfg.norm_eps)
    pre = np_sigmoid(mixes * p["scale"][0] + p["base"]) + cfg.hc_eps
    want = (pre[..., None] * s64).sum(-2)
    pre_err = 0.25 * p["scale"][0] * em + 8 * U32
    bound = ((pre_err + 8 * U32 * pre)[..., None] * np.abs(s64)).sum(-2) + ulp(want, "float32")
    assert np.all(np.abs(_np(y) - want) <= bound)
    # On identical streams the head returns (sum_j pre_j) * h.
    same = head(s)
    _, m2, _ = np_mixes(_np(s), p["fn"], cfg.norm_eps)
    tot = (np_sigmoid(m2 * p["scale"][0] + p["base"]) + cfg.hc_eps).sum(-1)
    np.testing.assert_allclose(_np(same), tot[:, None] * _np(h), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------
# router


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_router_scores_topk_bias_route_scale(scoring):
    cfg = V4BlockConfig.tiny(scoring=scoring, dtype="float32", route_scale=1.5)
    gate = V4Gate(cfg, layer_id=cfg.n_hash_layers, rngs=nnx.Rngs(5))
    assert not gate.hash
    # A bias large enough to matter: expert 3 strongly favoured, expert 7 strongly penalised.
    bias = np.asarray(gate.bias[...]).copy()
    bias[3], bias[7] = 5.0, -5.0
    gate.bias.set_value(jnp.asarray(bias, jnp.float32))
    p = _params(gate)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(32, cfg.hidden_size)), jnp.float32)
    w, idx = gate(x)
    assert w.dtype == jnp.float32 and idx.dtype == jnp.int32 and idx.shape == (32, cfg.moe_topk)
    ww, widx, ws, sel = np_gate(_np(x), p, cfg)
    # The logits are float32 sums of d terms; their error bound, carried through the score function
    # (sqrt(softplus) and sigmoid have slope <= 1/2 for |z| of this size; softmax <= 1) plus a few ulps.
    zmag = np.abs(_np(x)) @ np.abs(p["weight"]).T
    ez = (cfg.hidden_size + 2) * U32 * zmag
    tol_s = ez + 8 * U32 * np.abs(ws) if scoring != "softmax" else 2 * ez.max(-1, keepdims=True) * ws + 8 * U32 * ws
    np.testing.assert_array_less(np.abs(_np(gate.scores(x)) - ws), tol_s + 1e-300)
    # Selection: provably identical when the k-th / (k+1)-th gap exceeds both sides' score errors.
    assert _topk_margin(sel, cfg.moe_topk) > 3 * tol_s.max()
    np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(widx, -1))
    assert np.any(np.asarray(idx) == 3, axis=-1).all()
    assert not np.any(np.asarray(idx) == 7)
    # Weights come from the unbiased scores: compare per (token, expert).
    order_j, order_w = np.argsort(np.asarray(idx), -1), np.argsort(widx, -1)
    wj = np.take_along_axis(_np(w), order_j, -1)
    wn = np.take_along_axis(ww, order_w, -1)
    # w_i = s_i / sum_j s_j: relative error <= rel(s_i) + max_j rel(s_j) + a few ulps.
    rel_s = np.take_along_axis(tol_s / ws, widx, -1).max()
    np.testing.assert_allclose(wj, wn, rtol=2 * rel_s + 16 * U32, atol=0)
    if scoring != "softmax":
        np.testing.assert_allclose(_np(w).sum(-1), cfg.route_scale, rtol=16 * U32)
    # Unbiased-score weights: expert 3's weight is its own (small) score share, not boosted by the bias.
    t3 = np.asarray(idx) == 3
    s3 = np.repeat(ws[:, 3:4], cfg.moe_topk, 1)[t3]
    denom = np.take_along_axis(ws, widx, -1).sum(-1, keepdims=True).repeat(cfg.moe_topk, 1)[t3]
    want3 = s3 / denom * cfg.route_scale if scoring != "softmax" else s3 * cfg.route_scale
    np.testing.assert_allclose(_np(w)[t3], want3, rtol=2 * rel_s + 16 * U32)


def test_hash_routing():
    cfg = V4BlockConfig.tiny(dtype="float32", n_hash_layers=2)
    gate = V4Gate(cfg, layer_id=1, rngs=nnx.Rngs(7))
    assert gate.hash and not hasattr(gate, "bias")
    p = _params(gate)
    validate_tid2eid(p["tid2eid"], cfg.vocab_size, cfg.moe_topk, cfg.n_routed_experts)
    assert all(len(set(r)) == cfg.moe_topk for r in p["tid2eid"])  # distinct experts per token
    rng = np.random.default_rng(8)
    tokens = np.array([0, 5, 5, 96, 42, 17, 3, 5], np.int32)
    x = jnp.asarray(rng.normal(size=(len(tokens), cfg.hidden_size)), jnp.float32)
    w, idx = gate(x, jnp.asarray(tokens))
    ww, widx, ws, _ = np_gate(_np(x), p, cfg, tokens)
    np.testing.assert_array_equal(np.asarray(idx), widx)  # integers: exact
    np.testing.assert_array_equal(np.asarray(idx), p["tid2eid"][tokens])
    np.testing.assert_allclose(_np(w), ww, rtol=(cfg.hidden_size + 16) * U32 * 4)
    # Same token, different activations -> same experts, different weights.
    np.testing.assert_array_equal(np.asarray(idx)[1], np.asarray(idx)[2])
    assert not np.allclose(_np(w)[1], _np(w)[2])
    # Under jit the routing is the same (the eager token check is skipped there).
    wj, ij = jax.jit(lambda xx, tt: nnx.merge(*nnx.split(gate))(xx, tt))(x, jnp.asarray(tokens))
    np.testing.assert_array_equal(np.asarray(ij), widx)
    with pytest.raises(ValueError, match="tokens"):
        gate(x, None)
    with pytest.raises(ValueError, match="tokens"):
        gate(x[:1], jnp.asarray([cfg.vocab_size], jnp.int32))
    with pytest.raises(ValueError, match="tokens"):
        gate(x[:1], jnp.asarray([-1], jnp.int32))
    # Layers at or past n_hash_layers are score-routed.
    assert not V4Gate(cfg, layer_id=2, rngs=nnx.Rngs(0)).hash


# ------------------------------------------------------------------------------------------------------------
# experts


def test_swiglu_limit_elementwise():
    g = np.array([-30.0, -10.5, -3.0, 0.0, 2.0, 9.9, 10.0, 10.5, 40.0])
    u = np.array([-40.0, 12.0, -10.5, 3.0, -2.0, 9.0, -11.0, 50.0, -0.5])
    for limit in (10.0, 0.0, 1.0):
        got = _np(swiglu(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32), limit))
        want = np_swiglu(g, u, limit)
        assert_within_ulps(got, want, np.float32, n=4, what=f"limit {limit}")
    got = _np(swiglu(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32), 10.0))
    # gate clamped from above only: gate -30 stays -30 (silu(-30) ~ -2.8e-12, times clipped up -10).
    assert got[0] == pytest.approx(-30.0 / (1 + np.exp(30.0)) * -10.0, rel=1e-5)
    assert got[7] == pytest.approx(10.0 / (1 + np.exp(-10.0)) * 10.0, rel=1e-6)  # both clamped
    assert got[1] == pytest.approx(-10.5 / (1 + np.exp(10.5)) * 10.0, rel=1e-5)  # gate below -limit untouched


def _moe_case(cfg: V4BlockConfig, layer_id: int, seed: int, t: int = 12, amp: float = 1.0):
    moe = V4MoE(cfg, layer_id, nnx.Rngs(seed))
    if amp != 1.0:  # larger expert weights so the swiglu clamps bite
        for name in ("w1", "w3"):  # routed stacks hold Params, the shared expert Linears
            for var in (getattr(moe, name), getattr(moe.shared, name).weight):
                var.set_value((var.get_value().astype(jnp.float32) * amp).astype(cfg.jdtype))
    rng = np.random.default_rng(seed + 100)
    x = jnp.asarray(rng.normal(size=(t, cfg.hidden_size)), jnp.float32).astype(cfg.jdtype)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, t), jnp.int32)
    return moe, x, tokens


def _moe_bound(x64, p, cfg, idx, w, dt) -> np.ndarray:
    """Per-element bound for MoE outputs: the final rounding (1 ulp) plus, per contributing expert, its own
    rounding to dt (1 ulp of its output) and the float32 accumulation of w2 (gamma_f * sum|w2 h|), plus a
    one-ulp flip of any intermediate rounding (g, u, weighted h) carried through w2 (|w2| |h| * 2 ulp(dt))."""
    rel = 2.0 ** -7 if dt == BF16 else 2.0 ** -23
    f, d = cfg.moe_intermediate_size, cfg.hidden_size
    tot = np.zeros_like(x64)

    def one(xr, w1, w3, w2, limit, wt):
        g, u = xr @ w1.T, xr @ w3.T
        gm, um = np.abs(xr) @ np.abs(w1).T, np.abs(xr) @ np.abs(w3).T
        h = np.abs(np_swiglu(g, u, limit)) * wt
        # an input error of e_g, e_u to swiglu moves h by <= (|silu'(g)| e_g |u| + |silu(g)| e_u) * wt
        eg = (d + 2) * U32 * gm + rel * np.abs(g)
        eu = (d + 2) * U32 * um + rel * np.abs(u)
        ul = np.clip(np.abs(u), 0, limit) if limit else np.abs(u)
        dh = (1.1 * eg * ul + np.abs(g) * eu + 1e-30) * wt + rel * (h + 1e-30)
        yo = np.abs(w2) @ h
        return rel * yo + np.abs(w2) @ dh + (f + 2) * U32 * yo

    for t in range(x64.shape[0]):
        for j in range(cfg.moe_topk):
            e = idx[t, j]
            tot[t] += one(x64[t], p["w1"][e], p["w3"][e], p["w2"][e], cfg.swiglu_limit, w[t, j])
    if cfg.n_shared_experts:
        lim = cfg.swiglu_limit if cfg.shared_swiglu_limit else 0.0
        for t in range(x64.shape[0]):
            tot[t] += one(x64[t], p["shared.w1"], p["shared.w3"], p["shared.w2"], lim, 1.0)
    return tot


@pytest.mark.parametrize("impl", ["ragged", "gather"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hash_layer", [False, True])
def test_moe_vs_float64(impl, dtype, hash_layer):
    cfg = V4BlockConfig.tiny(moe_impl=impl, dtype=dtype)
    layer_id = 0 if hash_layer else 1
    moe, x, tokens = _moe_case(cfg, layer_id, seed=11 + hash_layer, amp=8.0)
    assert moe.gate.hash == hash_layer
    p = _params(moe)
    dt = BF16 if dtype == "bfloat16" else np.float64
    x64 = _np(x)
    want, widx = np_moe(x64, p, cfg, dt, np.asarray(tokens))
    got = moe(x, tokens)
    assert got.dtype == cfg.jdtype and got.shape == x.shape
    _, idx = moe.gate(x, tokens)
    np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(widx, -1))
    w, _, _, _ = np_gate(x64, {k[5:]: v for k, v in p.items() if k.startswith("gate.")}, cfg, np.asarray(tokens))
    bound = _moe_bound(x64, p, cfg, widx, w, dt) + ulp(want, "bfloat16" if dt == BF16 else "float32")
    err = np.abs(_np(got) - want)
    assert np.all(err <= bound), f"worst {err.max():.3e} vs bound there {bound.flat[np.argmax(err)]:.3e}"
    # The clamps are active in this case (so the test exercises swiglu_limit).
    g = np.einsum("ti,efi->tef", x64, p["w1"])
    assert (g > cfg.swiglu_limit).mean() > 0.02


def test_moe_paths_agree_and_jit():
    cfg = V4BlockConfig.tiny(dtype="bfloat16")
    moe, x, tokens = _moe_case(cfg, 1, seed=21, t=16)
    ragged = moe(x, tokens)
    moe_g = V4MoE(dataclasses.replace(cfg, moe_impl="gather"), 1, nnx.Rngs(21))
    nnx.update(moe_g, nnx.state(moe))
    gathered = moe_g(x, tokens)
    # Same roundings on both paths; only the float32 summation order of the k experts differs.
    assert_within_ulps(gathered, ragged, "bfloat16", n=1, max_frac=0.05, what="ragged vs gather")
    gd, st = nnx.split(moe)
    jitted = jax.jit(lambda s, a, b: nnx.merge(gd, s)(a, b))(st, x, tokens)
    assert_within_ulps(jitted, ragged, "bfloat16", n=1, max_frac=0.05, what="jit vs eager")


@pytest.mark.parametrize("shared_clamp", [True, False])
def test_shared_expert_clamp_option(shared_clamp):
    cfg = V4BlockConfig.tiny(dtype="float32", shared_swiglu_limit=shared_clamp, swiglu_limit=1.0)
    moe, x, _ = _moe_case(cfg, 1, seed=31, amp=4.0)
    p = _params(moe)
    x64 = _np(x)
    got = _np(moe.shared(x))
    want = np_expert(x64, p["shared.w1"], p["shared.w3"], p["shared.w2"], 1.0 if shared_clamp else 0.0, np.float64)
    other = np_expert(x64, p["shared.w1"], p["shared.w3"], p["shared.w2"], 0.0 if shared_clamp else 1.0, np.float64)
    mag = np.abs(want).max()
    assert np.abs(got - want).max() < 1e-4 * mag < np.abs(got - other).max()


# ------------------------------------------------------------------------------------------------------------
# the whole block around a toy attention


def _toy_attention(cfg: V4BlockConfig, seed: int):
    """Causal single-head attention with random projections, float32 inside, rounded to the block dtype;
    and its float64 twin."""
    rng = np.random.default_rng(seed)
    d = cfg.hidden_size
    ws = [rng.normal(size=(d, d)) * d ** -0.5 for _ in range(4)]
    jw = [jnp.asarray(w, jnp.float32) for w in ws]
    w64 = [np.asarray(np.float32(w), np.float64) for w in ws]

    def attn(x):
        xf = x.astype(jnp.float32)
        q, k, v = (jnp.dot(xf, w, precision="highest") for w in jw[:3])
        s = jnp.dot(q, k.T, precision="highest") / np.sqrt(d)
        s = jnp.where(np.tril(np.ones((x.shape[0],) * 2, bool)), s, -jnp.inf)
        o = jnp.dot(jax.nn.softmax(s, -1), v, precision="highest")
        return jnp.dot(o, jw[3], precision="highest").astype(x.dtype)

    def attn64(x, dt):
        q, k, v = (x @ w for w in w64[:3])
        s = q @ k.T / np.sqrt(d)
        s = np.where(np.tril(np.ones((x.shape[0],) * 2, bool)), s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        return _r((e / e.sum(-1, keepdims=True)) @ v @ w64[3], dt)

    return attn, attn64


def np_block(s64, p, cfg, attn64, dt, tokens):
    hp = lambda pre: {k[len(pre):]: v for k, v in p.items() if k.startswith(pre)}  # noqa: E731
    a = hp("hc_attn.")
    x, _, post, comb, _, _ = np_hc_pre(s64, a["fn"], a["scale"], a["base"], cfg.hc_mult, cfg.hc_sinkhorn_iters,
                                       cfg.hc_eps, cfg.norm_eps)
    o = attn64(_r(np_rms_norm(_r(x, dt), p["attn_norm"], cfg.norm_eps), dt), dt)
    s1 = _r(np_hc_post(o, s64, post, comb), dt)
    f = hp("hc_ffn.")
    x, _, post, comb, _, _ = np_hc_pre(s1, f["fn"], f["scale"], f["base"], cfg.hc_mult, cfg.hc_sinkhorn_iters,
                                       cfg.hc_eps, cfg.norm_eps)
    xn = _r(np_rms_norm(_r(x, dt), p["ffn_norm"], cfg.norm_eps), dt)
    y, idx = np_moe(xn, hp("ffn."), cfg, dt, tokens)
    return _r(np_hc_post(y, s1, post, comb), dt), xn, idx


@pytest.mark.parametrize("dtype,hash_layer", [pytest.param("float32", False, marks=pytest.mark.slow),  # CI time
                                              ("float32", True), ("bfloat16", False), ("bfloat16", True)])
def test_block_vs_float64(dtype, hash_layer):
    cfg = V4BlockConfig.tiny(dtype=dtype)
    layer_id = 0 if hash_layer else 1
    layer = V4Block(cfg, layer_id, nnx.Rngs(41 + hash_layer))
    p = _params(layer)
    attn, attn64 = _toy_attention(cfg, 43)
    rng = np.random.default_rng(44)
    t = 12
    tokens = np.asarray(rng.integers(0, cfg.vocab_size, t), np.int32)
    h = jnp.asarray(rng.normal(size=(t, cfg.hidden_size)), jnp.float32).astype(cfg.jdtype)
    streams = expand_streams(h, cfg.hc_mult)
    # Two layers deep, so the second sees distinct streams.
    s2 = layer(streams, attn, jnp.asarray(tokens))
    got = block(layer, s2, attn, jnp.asarray(tokens))
    assert got.shape == streams.shape and got.dtype == cfg.jdtype
    dt = BF16 if dtype == "bfloat16" else np.float64
    w1, _, _ = np_block(_np(streams), p, cfg, attn64, dt, tokens)
    want, xn, widx = np_block(w1, p, cfg, attn64, dt, tokens)
    _, idx = layer.ffn.gate(jnp.asarray(xn, cfg.jdtype), jnp.asarray(tokens))
    np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(widx, -1))
    scale = np.abs(want).max()

    def check(out, what):
        g = _np(out)
        if dtype == "float32":
            # float32 everywhere: a few hundred ulps of the magnitude through ~10 chained sub-steps
            # (two Sinkhorn splits, norms, attention, MoE) whose errors add.
            assert np.abs(g - want).max() <= 512 * U32 * 2 * scale, what
        else:
            # bf16: every rounding point is mirrored, so most elements agree exactly or within one ulp; a
            # float32-noise flip at an upstream bf16 rounding (relative 2^-8 of one intermediate) moves an
            # output by at most a few ulps of the magnitude.
            assert_within_ulps(out, want, "bfloat16", n=1, max_frac=0.2, what=what)
            assert np.abs(g - want).max() <= 4 * 2.0 ** -8 * scale, what

    check(got, "block")
    # The split halves compose to the same thing (identical ops: bit-equal).
    x, mix = layer.pre_attention(s2)
    np.testing.assert_array_equal(_np(layer.post_attention(s2, attn(x), mix, jnp.asarray(tokens))), _np(got))
    # And the block jits (XLA may fuse differently, so it is held to the same float64 bounds).
    gd, st = nnx.split(layer)
    check(jax.jit(lambda s, a, b: nnx.merge(gd, s)(a, attn, b))(st, s2, jnp.asarray(tokens)), "jitted block")


def test_block_rejects_bad_streams():
    cfg = V4BlockConfig.tiny()
    layer = V4Block(cfg, 1, nnx.Rngs(0))
    with pytest.raises(ValueError, match="streams"):
        layer(jnp.zeros((3, cfg.hidden_size), cfg.jdtype), lambda v: v)
    with pytest.raises(ValueError, match="streams"):
        layer(jnp.zeros((3, cfg.hc_mult + 1, cfg.hidden_size), cfg.jdtype), lambda v: v)


def test_shared_expert_fp8_as_released():
    """With FP8 linears the shared expert is the release's: three FP8 ``linear()``s (e4m3 weights with 128x128
    scales, inputs re-quantised to e4m3 per 128 with ue8m0 scales), bf16 between them; against the independent
    torch re-derivation of ``linear()`` (tests/reference/torch_v32.fp8_linear) and the float64 SwiGLU."""
    import torch

    from tests.reference.torch_v32 import fp8_linear as ref_fp8_linear

    cfg = V4BlockConfig.tiny(hidden_size=256, moe_intermediate_size=256, shared_fp8=True)
    moe = V4MoE(cfg, 1, nnx.Rngs(5))
    sh = moe.shared
    assert sh.w1.fp8 and sh.w2.weight[...].dtype == jnp.float8_e4m3fn
    x = jnp.asarray(np.random.default_rng(6).normal(size=(9, 256)) * 3, jnp.bfloat16)

    def lin(v: np.ndarray, m) -> np.ndarray:  # float32 result of linear(), rounded to bf16 as the release does
        w = torch.from_numpy(np.array(m.weight[...].astype(jnp.float32)))
        s = torch.from_numpy(np.array(m.scale[...]))
        y = ref_fp8_linear(torch.from_numpy(np.array(v, np.float32)), w, s).numpy()
        return y.astype(ml_dtypes.bfloat16).astype(np.float64)

    x32 = np.asarray(x.astype(jnp.float32))
    h = np_swiglu(lin(x32, sh.w1), lin(x32, sh.w3), cfg.swiglu_limit).astype(ml_dtypes.bfloat16)
    want = lin(h.astype(np.float32), sh.w2)
    # one rounding apart where a float32 summation order moves a value across a bf16 or e4m3 step
    assert_within_ulps(sh(x), want, "bfloat16", n=2, max_frac=0.05, what="shared expert fp8")
