"""The Decoder with ``block="v4"`` (jds.model.V4DecoderLayer / V4Embedding / V4Head): one whole layer against
the float64 re-derivation of DeepSeek-V4's block in tests/test_v4_block.py, the head likewise, the runner's
execution modes agreeing on the stream hidden state, and the config fields' validation.

The attention inside the layer is jds's V4 attention (tested against its own references elsewhere); here its
output is taken as given and everything around it (hyper-connections, norms, router incl. the hash layer,
experts) is re-derived in float64 from the same streams.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jds.batch import Chunk, make_batch
from jds.config import ModelConfig, Numerics, V32Config, V4Config, preset, replace
from jds.model import Decoder, V4DecoderLayer, V4Hidden, v4_block_config
from jds.runner import BoundaryRunner
from jds.v4_block import V4Block
from tests.test_runner import greedy_rollout
from tests.test_v4_block import (BF16, U32, _np, _params, _r, np_block, np_hc_pre, np_mixes, np_rms_norm,
                                 np_sigmoid)


def _cfg(dtype: str) -> ModelConfig:
    numerics = Numerics.exact() if dtype == "float32" else Numerics.bf16()
    return dataclasses.replace(preset("v4-tiny-block"), numerics=numerics)


@pytest.mark.parametrize("layer_id,dtype", [
    (0, "float32"), pytest.param(0, "bfloat16", marks=pytest.mark.slow), (1, "bfloat16"),
    pytest.param(1, "float32", marks=pytest.mark.slow)])  # CI time: each layer kind once, each dtype once
# 0: window-only, hash-routed; 1: C4, score-routed with bias
def test_decoder_layer_vs_float64(dtype: str, layer_id: int) -> None:
    cfg = _cfg(dtype)
    model = Decoder(cfg, seed=5 + layer_id)
    layer = model.layers[layer_id]
    assert isinstance(layer, V4DecoderLayer) and layer.ffn.gate.hash == (layer_id < cfg.n_hash_layers)
    bcfg = v4_block_config(cfg)
    dt = jnp.float32 if dtype == "float32" else jnp.bfloat16
    rng = np.random.default_rng(layer_id)
    t, bs = 24, cfg.block_size
    tokens = np.asarray(rng.integers(0, cfg.vocab_size, t), np.int32)
    streams = jnp.asarray(rng.normal(size=(t, cfg.hc_mult, cfg.hidden_size)), jnp.float32).astype(dt)
    h = V4Hidden(streams, jnp.asarray(tokens))
    batch = make_batch([Chunk(0, 0, t)], np.arange(1, dtype=np.int32)[None], bs)
    cache = model.init_caches(1)[layer_id]

    got, _ = layer(h, batch, cache)
    assert got.streams.shape == streams.shape and got.streams.dtype == dt
    np.testing.assert_array_equal(np.asarray(got.tokens), tokens)

    # jds's attention on jds's attention input (the stages the runner calls); its output is the given.
    attn = layer.attn
    query, c = attn.prepare(layer.pre_attention(h), batch, cache)
    a_out = attn.project_out(attn.attend(query, attn.select(query, batch, c), batch, c)).astype(dt)

    p = {k: v for k, v in _params(layer).items() if not k.startswith("attn.")}
    s64 = _np(streams)
    ndt = np.float64 if dtype == "float32" else BF16
    want, _, widx = np_block(s64, p, bcfg, lambda x, _dt: _np(a_out), ndt, tokens)
    scale = np.abs(want).max()
    if dtype == "float32":
        # the same bound as tests/test_v4_block.py's whole-block test: float32 noise through chained sub-steps
        assert np.abs(_np(got.streams) - want).max() <= 512 * U32 * 2 * scale
    else:
        # Every bf16 rounding point is mirrored, so most elements agree exactly. A float32-noise flip at one of
        # them (an expert's output, the MoE sum, the intermediate streams: one bf16 ulp of *that* value) reaches
        # the output scaled by post (<= 2) and the comb mixing, i.e. a few ulps of the FFN output's magnitude,
        # not of the element's: bounded against the layer's magnitude, and such flips must stay rare.
        g = _np(got.streams)
        assert np.mean(g != want) <= 0.1
        assert np.abs(g - want).max() <= 4 * 2.0 ** -8 * scale

    # The attention's input is attn_norm(hc pre-mix) of the streams.
    a = {k[len("hc_attn."):]: v for k, v in p.items() if k.startswith("hc_attn.")}
    x, *_ = np_hc_pre(s64, a["fn"], a["scale"], a["base"], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                      bcfg.norm_eps)
    xn = _r(np_rms_norm(_r(x, ndt), p["attn_norm"], bcfg.norm_eps), ndt)
    got_x = _np(V4Block.pre_attention(layer, streams)[0])
    tol = 64 * U32 if dtype == "float32" else 2 * 2.0 ** -8
    assert np.abs(got_x - xn).max() <= tol * np.abs(xn).max()
    # Routing: on the hash layer the experts are tid2eid[token], whatever the scores.
    if layer_id < cfg.n_hash_layers:
        np.testing.assert_array_equal(widx, p["ffn.gate.tid2eid"][tokens])


def test_head_and_embedding_vs_float64() -> None:
    cfg = _cfg("float32")
    model = Decoder(cfg, seed=2)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, 6), jnp.int32)
    e = model.embed(tokens)
    emb = np.asarray(model.embed.weight[...])[np.asarray(tokens)]
    np.testing.assert_array_equal(np.asarray(e.streams), np.repeat(emb[:, None], cfg.hc_mult, axis=1))
    streams = jnp.asarray(rng.normal(size=(6, cfg.hc_mult, cfg.hidden_size)), jnp.float32)
    li = jnp.asarray([5, 0, 3], jnp.int32)
    got = np.asarray(model.head(V4Hidden(streams, tokens), li), np.float64)
    p = _params(model.head)
    s64 = _np(streams)[np.asarray(li)]
    _, mixes, _ = np_mixes(s64, p["hc.fn"], cfg.attn.rms_norm_eps)
    pre = np_sigmoid(mixes * p["hc.scale"][0] + p["hc.base"]) + cfg.hc_eps
    x = np_rms_norm((pre[..., None] * s64).sum(-2), p["norm"], cfg.attn.rms_norm_eps)
    want = x @ p["lm_head"].T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def _runner(mode: str, n_layers: int = 3, **kw) -> BoundaryRunner:
    model = Decoder(replace(_cfg("float32"), n_layers=n_layers), seed=0)
    kw = {"max_num_tokens": 256, "max_model_len": 640, **kw}
    if "token_buckets" in kw:
        kw["max_num_tokens"] = max(kw["token_buckets"])
        kw["max_model_len"] = 128
    return BoundaryRunner(model=model, mode=mode, num_blocks=24, max_num_seqs=4, **kw)


def _rollout(runner: BoundaryRunner, lens: tuple[int, ...] = (150, 20)) -> tuple[list[np.ndarray], list[list[int]]]:
    """150 tokens: past the C128 layer's first compression."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n) for n in lens]
    mb = runner.max_blocks
    bt = rng.permutation(24)[:2 * mb].reshape(2, mb).astype(np.int32)
    return greedy_rollout(runner, prompts, steps=2, block_tables=bt)


def _agree(a: tuple, b: tuple, what: str) -> None:
    assert a[1] == b[1], f"{what}: greedy tokens differ"
    for x, y in zip(a[0], b[0]):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6 * np.abs(y).max(), err_msg=what)


@pytest.mark.slow  # every mode compiles the whole V4-block model
def test_runner_modes_agree_on_streams() -> None:
    """wide / narrow / fused and fused in 2 segments (the persistent stream carry) give the same logits."""
    base = _rollout(_runner("wide"))
    for mode, kw in (("narrow", {}), ("fused", {}), ("fused", {"segments": 2, "input_prep": "device"})):
        _agree(_rollout(_runner(mode, **kw)), base, f"{mode} {kw}")


def test_fused_segments_carry_streams() -> None:
    """The fused step in 2 segments passes the V4Hidden carry between its executables unchanged."""
    # two layers (window-only + hash routing, C4), one compiled shape: a test of seconds
    one = {"n_layers": 2, "token_buckets": (96,), "key_block_buckets": (1,)}
    runner = _runner("fused", segments=2, input_prep="device", **one)
    carry = runner.model.zero_hidden(16)
    assert isinstance(carry, V4Hidden) and carry.streams.shape == (16, 4, 256) and carry.tokens.dtype == jnp.int32
    lens = (60, 9)  # C4 compresses, with a chunked prefill and decodes mixed in
    _agree(_rollout(runner, lens), _rollout(_runner("fused", **one), lens), "segments=2")


@pytest.mark.parametrize("kw,field", [
    ({"block": "v5"}, "block"), ({"hc_mult": 0}, "hc_mult"), ({"hc_sinkhorn_iters": -1}, "hc_sinkhorn_iters"),
    ({"hc_eps": -1.0}, "hc_eps"), ({"route_scale": 0.0}, "route_scale"), ({"scoring": "relu"}, "scoring"),
    ({"n_hash_layers": -1}, "n_hash_layers"), ({"swiglu_limit": float("nan")}, "swiglu_limit"),
    ({"moe_impl": "dense"}, "moe_impl"), ({"shared_swiglu_limit": 1}, "shared_swiglu_limit"),
    ({"n_routed_experts": 0}, "n_routed_experts"), ({"n_shared_experts": 2}, "n_shared_experts"),
])
def test_block_fields_validated(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"'{field}'"):
        replace(preset("v4-tiny-block"), **kw)


def test_block_v4_needs_arch_v4_and_round_trips_json() -> None:
    with pytest.raises(ValueError, match="'block'"):
        ModelConfig("v32", V32Config.tiny(), n_layers=1, block="v4", n_routed_experts=4)
    cfg = replace(preset("v4-tiny-block"), route_scale=2.5, scoring="sigmoid", moe_impl="gather",
                  shared_swiglu_limit=False)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    d = cfg.to_dict()
    assert d["block"] == "v4" and d["hc_mult"] == 4 and d["n_hash_layers"] == 1
    old = {k: v for k, v in preset("v4-tiny").to_dict().items() if k not in ("block", "hc_mult", "scoring")}
    assert ModelConfig.from_dict(old).block == "v3"  # a config written before the field loads as before
    with pytest.raises(ValueError, match="'scoring'"):
        ModelConfig.from_dict({**d, "scoring": 3})
    assert preset("v4-tiny-block").attn == V4Config.tiny()
