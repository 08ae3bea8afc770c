"""DeepSeek-V4's MTP module (jds.mtp): its forward against the float64 re-derivation in tests/reference/np_v4_mtp.py
(every element of each stage: the input mixing, the block, the logits), its own cache across calls, the import of
``mtp.*`` tensors from a synthetic V4-Flash HF directory (nothing skipped, the same bytes written back), and bad
input (a ValueError naming the tensor or field).

Stages are compared with the previous stage's jds output as the input of the float64 one ("taken as given"), so
each bound covers one stage's roundings only; the attention inside the block is jds's V4 attention (tested
against its own references elsewhere), its output taken as given as in tests/test_v4_decoder.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jds import hf_import
from jds.batch import Chunk, make_batch
from jds.checkpoint import read_checkpoint, restore_model
from jds.config import Numerics, preset, replace
from jds.model import Decoder, v4_block_config
from jds.mtp import MTPModule
from jds.nn import export_weights
from jds.safetensors_io import SafetensorsDir
from tests.reference import np_v4_mtp as ref
from tests.test_checkpoint import assert_same_weights
from tests.test_convert_checkpoint import _add, _config, _remove, _replace, assert_refused, tiny_cfg
from tests.test_v4_block import BF16, U32, _np, _params, _r, np_block
from tests.tolerances import ulp


def _cfg(dtype: str):
    return preset("v4-tiny-block", mtp_layers=1, numerics=Numerics.exact() if dtype == "float32" else Numerics.bf16())


def _inputs(cfg, t: int, seed: int):
    rng = np.random.default_rng(seed)
    dt = jnp.float32 if cfg.numerics.dtype == "float32" else jnp.bfloat16
    streams = jnp.asarray(rng.normal(size=(t, cfg.hc_mult, cfg.hidden_size)), jnp.float32).astype(dt)
    return streams, jnp.asarray(rng.integers(0, cfg.vocab_size, t), jnp.int32)


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])  # CI budget
def test_mtp_forward_vs_float64(dtype: str) -> None:
    cfg = _cfg(dtype)
    model = Decoder(cfg, seed=11)
    mtp = model.mtp[0]
    # the release's MTP layer: layer id n_layers (its ratio the appended last entry: window-only), score-routed
    assert isinstance(mtp, MTPModule) and mtp.layer_id == cfg.n_layers == cfg.mtp_layer_id(0)
    assert mtp.attn.ratio == 0 and not mtp.ffn.gate.hash
    t = 24  # past the 16-token window
    streams, nxt = _inputs(cfg, t, 12)
    batch = make_batch([Chunk(0, 0, t)], np.zeros((1, 1), np.int32), cfg.block_size)
    li = jnp.arange(t, dtype=jnp.int32)  # every row's logits
    out = mtp(streams, nxt, batch, mtp.init_cache(1), model.embed, model.head, li)
    assert out.logits.shape == (t, cfg.vocab_size) and out.logits.dtype == jnp.float32
    assert out.streams.shape == streams.shape and out.streams.dtype == streams.dtype

    p = _params(mtp)
    eps, hc_eps = cfg.attn.rms_norm_eps, cfg.hc_eps
    ndt = np.float64 if dtype == "float32" else BF16
    rnd = lambda a: _r(a, ndt)  # noqa: E731
    ul = lambda a: ulp(a, dtype)  # noqa: E731

    # 1. input mixing, from the embedding rows and the given streams
    x = mtp.combine(streams, nxt, model.embed)
    np.testing.assert_array_equal(np.asarray(x.tokens), np.asarray(nxt))
    emb = _np(model.embed.weight[...])[np.asarray(nxt)]
    want, bound = ref.combine(emb, _np(streams), p, eps, rnd, ul)
    err = np.abs(_np(x.streams) - want)
    assert (err <= bound).all(), f"combine: worst excess {np.max(err - bound):.3e}"
    if dtype == "bfloat16":
        assert np.mean(err > 0) <= 0.1, "rounding flips should be rare"

    # 2. the V4 block on jds's mixed streams, jds's attention output taken as given
    attn = mtp.attn
    query, c = attn.prepare(mtp.pre_attention(x), batch, mtp.init_cache(1))
    a_out = attn.project_out(attn.attend(query, attn.select(query, batch, c), batch, c)).astype(streams.dtype)
    blk = {k: v for k, v in p.items() if not k.startswith("attn.")}
    want_s, _, _ = np_block(_np(x.streams), blk, v4_block_config(cfg), lambda _x, _dt: _np(a_out), ndt,
                            np.asarray(nxt))
    got_s, scale = _np(out.streams), np.abs(want_s).max()
    if dtype == "float32":  # the bounds of tests/test_v4_decoder.py's whole-layer comparison
        assert np.abs(got_s - want_s).max() <= 512 * U32 * 2 * scale
    else:
        assert np.mean(got_s != want_s) <= 0.1
        assert np.abs(got_s - want_s).max() <= 4 * 2.0 ** -8 * scale

    # 3. the MTP's HC head and norm, then the shared LM head, on jds's block output
    lm = _params(model.head)["lm_head"]
    want_l, bound_l = ref.head(got_s, p, lm, eps, hc_eps, rnd, ul)
    err = np.abs(np.asarray(out.logits, np.float64) - want_l)
    assert (err <= bound_l).all(), f"logits: worst excess {np.max(err - bound_l):.3e}"
    # the head weight is the main model's: the MTP has no LM head or embedding of its own
    assert not any(k.startswith(("lm_head", "embed")) for k in p)

    # 4. the MTP's own window cache across calls: rows 0..22, then row 23 reading the first call's cache, give row
    # 23's logits of the one-call run (both calls padded to the same 24 rows: slot -1 rows write nothing)
    bt, bs = np.zeros((1, 1), np.int32), cfg.block_size
    pad = lambda a, n: jnp.concatenate([a, jnp.zeros((t - n,) + a.shape[1:], a.dtype)])  # noqa: E731
    first = mtp(pad(streams[:23], 23), pad(nxt[:23], 23), make_batch([Chunk(0, 0, 23)], bt, bs, pad_to=t),
                mtp.init_cache(1), model.embed, model.head, li)
    last = mtp(pad(streams[23:], 1), pad(nxt[23:], 1), make_batch([Chunk(0, 23, 1)], bt, bs, pad_to=t), first.cache,
               model.embed, model.head, li)
    w = np.asarray(out.logits)
    np.testing.assert_allclose(np.asarray(first.logits)[:23], w[:23], rtol=0, atol=1e-5 * np.abs(w).max())
    np.testing.assert_allclose(np.asarray(last.logits)[0], w[23], rtol=0, atol=1e-5 * np.abs(w).max())
    assert model.init_mtp_caches(2)[0].window.shape == mtp.init_cache(2).window.shape


# ----- import / export ------------------------------------------------------------------------------------
def mtp_source(root: Path, seed: int = 7):
    """A V4-block tiny model with one MTP module (FP8 linears as released) as a synthetic V4-Flash HF directory."""
    cfg = preset("v4-tiny-block", mtp_layers=1, numerics=tiny_cfg("v4", moe=False).numerics)
    model = Decoder(cfg, seed=seed)
    hf = root / "hf_mtp"
    hf_import.export_hf(model, hf)
    return cfg, model, hf


@pytest.fixture(scope="module")
def mtp_src(tmp_path_factory):
    return mtp_source(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def mtp_hf(mtp_src) -> Path:
    return mtp_src[2]


def test_mtp_import_round_trip(tmp_path, mtp_src) -> None:
    cfg, model, hf = mtp_src
    src = SafetensorsDir(hf)
    names = set(src.names())
    d = cfg.hidden_size
    # the release's names and kinds: FP8 e_proj / h_proj (+ scale), an FP8-stored wo_a, a window-only attention (no
    # compressor / indexer), the MTP's own HC head and norms, no copy of the shared embedding or head
    assert src.info("mtp.0.e_proj.weight") == ("F8_E4M3", (d, d)) and src.info("mtp.0.e_proj.scale")[1] == (2, 2)
    assert src.info("mtp.0.attn.wo_a.weight")[0] == "F8_E4M3" and src.info("mtp.0.hc_head_fn")[1] == (4, 4 * d)
    for n in ("mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.norm.weight",
              "mtp.0.hc_head_base", "mtp.0.hc_head_scale", "mtp.0.hc_attn_fn", "mtp.0.hc_ffn_scale",
              "mtp.0.attn.attn_sink", "mtp.0.attn_norm.weight", "mtp.0.ffn.gate.bias", "mtp.0.ffn.experts.7.w2.weight",
              "mtp.0.ffn.shared_experts.w1.weight"):
        assert n in names, n
    assert not any(n.startswith(("mtp.0.attn.compressor", "mtp.0.attn.indexer", "mtp.0.ffn.gate.tid2eid"))
                   for n in names)
    assert not any(n.startswith("mtp.") and ("emb" in n or n.endswith("head.weight")) for n in names)
    hfc = json.loads((hf / "config.json").read_text())
    assert hfc["num_nextn_predict_layers"] == 1 and hfc["compress_ratios"] == [0, 4, 128, 0]

    out = tmp_path / "out"
    rep = hf_import.convert_hf_checkpoint(hf, out, overrides={"block_size": cfg.block_size}, progress=False)
    assert rep["config"] == cfg and rep["skipped"] == {} and set(rep["used"]) == names  # nothing skipped
    assert_same_weights(export_weights(model), read_checkpoint(out))
    restored = restore_model(out)
    hf_import.export_hf(restored, tmp_path / "hf2")  # the same bytes out
    back = SafetensorsDir(tmp_path / "hf2")
    assert set(back.names()) == names
    for n in sorted(names):
        assert back.info(n) == src.info(n) and np.asarray(back.get(n)).tobytes() == np.asarray(src.get(n)).tobytes(), n
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == hfc

    # without MTP modules (an override) every mtp.* tensor is skipped with its reason, the rest still imports
    rep0 = hf_import.convert_hf_checkpoint(hf, tmp_path / "out0", overrides={"block_size": cfg.block_size,
                                                                             "mtp_layers": 0}, progress=False)
    mtp_names = {n for n in names if n.startswith("mtp.")}
    assert rep0["config"].mtp_layers == 0 and set(rep0["skipped"]) == {hf_import.MTP_REJECTED}
    assert set(rep0["skipped"][hf_import.MTP_REJECTED]) == mtp_names


MTP_BAD = {
    "e_proj_shape": (_replace("mtp.0.e_proj.weight", lambda a: a[:128]),
                     re.escape("HF tensor 'mtp.0.e_proj.weight' has shape (128, 256), expected (256, 256)")),
    "hc_head_shape": (_replace("mtp.0.hc_head_fn", lambda a: a[:, :256]),
                      re.escape("HF tensor 'mtp.0.hc_head_fn' has shape (4, 256), expected (4, 1024)")),
    "enorm_missing": (_remove("mtp.0.enorm.weight"), re.escape("missing tensor 'mtp.0.enorm.weight'")),
    "h_proj_scale_missing": (_remove("mtp.0.h_proj.scale"), re.escape("missing tensor 'mtp.0.h_proj.scale'")),
    # a window-only MTP layer has no compressor
    "compressor_on_window_layer": (_add("mtp.0.attn.wq_a.weight", "mtp.0.attn.compressor.ape",
                                        np.zeros((4, 512), np.float32)),
                                   re.escape("tensor 'mtp.0.attn.compressor.ape' has no place")),
    "count_negative": (_config(lambda c: c.update(num_nextn_predict_layers=-1)),
                       re.escape("invalid config field 'num_nextn_predict_layers'")),
    "spellings_disagree": (_config(lambda c: c.update(n_mtp_layers=2)),
                           re.escape("invalid config field 'num_nextn_predict_layers': 1 disagrees with "
                                     "'n_mtp_layers'")),
    # two MTP modules need two MTP entries at the end of compress_ratios
    "ratios_too_short": (_config(lambda c: c.update(num_nextn_predict_layers=2, n_mtp_layers=2)),
                         re.escape("invalid config field 'mtp_layers'")),
}


@pytest.mark.parametrize("case", list(MTP_BAD))
def test_mtp_bad_input_names_the_tensor(tmp_path, mtp_hf: Path, case: str) -> None:
    assert_refused(tmp_path, mtp_hf, *MTP_BAD[case])


def test_mtp_config_fields() -> None:
    base = preset("v4-tiny-block")
    assert base.mtp_layers == 0 and not hasattr(Decoder(replace(base, n_layers=1), seed=0), "mtp")
    with pytest.raises(ValueError, match="'mtp_layers'"):  # the tiny ratios list no MTP layer kind
        replace(base, mtp_layers=1)
    with pytest.raises(ValueError, match="'mtp_layers'"):  # jds's V3-style block has no MTP module
        preset("v4-tiny", mtp_layers=1)
    with pytest.raises(ValueError, match="'mtp_layers'"):
        replace(base, mtp_layers=-1)
    cfg = preset("v4-tiny-block", mtp_layers=2)
    assert cfg.attn.compress_ratios == (0, 4, 128, 0, 0) and [cfg.mtp_layer_id(k) for k in (0, 1)] == [3, 4]
    assert type(cfg).from_json(cfg.to_json()) == cfg
    # a truncated stack keeps the release's MTP kind: the last compress_ratios entries
    flash = replace(base, attn=replace(base.attn, compress_ratios=(0, 0, 4, 128, 4, 0)), n_layers=2, mtp_layers=1)
    assert flash.mtp_layer_id(0) == 5
