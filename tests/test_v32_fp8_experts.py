"""FP8 routed experts in the V3-style MoE (``Numerics.experts_fp8``): the expert stacks held as an FP8 checkpoint
stores them (e4m3 [E, out, in] + float32 128 x 128 block scales) and multiplied by the grouped FP8 GEMM.

* ``FP8Experts.ragged`` against a float64 numpy product of the dequantised operands (the inputs re-quantised
  per 128 by ``act_quant``, tested on its own), within float32 summation error; which expert, which layout
  ([E, out, in]) and which scale block each weight uses is what this pins.
* The MoE with FP8 experts against the same MoE written out here in numpy float64 from the module's routing:
  w1 / w3 outputs computed on in float32, the SwiGLU product rounded to the activation dtype, re-quantised for
  ``w2`` (as DeepSeek's ``Expert.forward`` with its FP8 ``linear()``), within a bound of the roundings.
* Export to a HF directory (F8_E4M3 experts + float32 block scales, one [out, in] matrix each, as a V3.2 FP8
  checkpoint) and import with ``experts_fp8`` on: bit for bit; with it off (the default), the same experts
  dequantised exactly as before.
* Config errors name the field.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jds import hf_import
from jds.checkpoint import read_checkpoint
from jds.config import Numerics, preset
from jds.model import Decoder, FP8Experts, MoE
from jds.nn import export_weights
from jds.ops.quant import act_quant
from jds.safetensors_io import SafetensorsDir
from tests.test_checkpoint import assert_same_weights


def fp8_cfg(fp8_linear: bool = False, **kw):
    """A V3.2 tiny config with 4 routed experts of width 128 (the FP8 blocks), FP8 experts on (and FP8 linears,
    as in a V3.2 FP8 checkpoint, with ``fp8_linear``)."""
    base = preset("v32-tiny")
    num = dataclasses.replace(base.numerics, experts_fp8=True, fp8_linear=fp8_linear)
    return dataclasses.replace(base, numerics=num, n_routed_experts=4, moe_intermediate_size=128, moe_topk=2,
                               n_shared_experts=1, **kw)


def dense(w: FP8Experts) -> np.ndarray:
    """float64 [E, out, in] of an expert stack."""
    wq = np.asarray(w.weight[...].astype(jnp.float32), np.float64)
    s = np.asarray(w.scale[...], np.float64)
    return wq * np.repeat(np.repeat(s, 128, axis=1), 128, axis=2)


def quantised(x: jax.Array, fmt: str) -> np.ndarray:
    xq, sx = act_quant(x, 128, fmt)
    return np.asarray(xq.astype(jnp.float32), np.float64) * np.repeat(np.asarray(sx, np.float64), 128, axis=-1)


@pytest.mark.parametrize("fmt", ["ue8m0", "amax"])
def test_fp8_experts_ragged_vs_float64(fmt: str):
    e, o, i = 3, 256, 384
    w = FP8Experts((e, o, i), i, nnx.Rngs(3), fmt)
    rng = np.random.default_rng(1)
    sizes = np.array([2, 0, 5])
    x = jnp.asarray(rng.standard_normal((8, i)) * rng.uniform(0.1, 4, (8, 1)), jnp.bfloat16)
    got = np.asarray(w.ragged(x, jnp.asarray(sizes, jnp.int32)), np.float64)
    xd, wd = quantised(x, fmt), dense(w)
    ex = np.repeat(np.arange(e), sizes)
    ref = np.stack([xd[r] @ wd[ex[r]].T for r in range(len(ex))] + [np.zeros(o)])
    ab = np.stack([np.abs(xd[r]) @ np.abs(wd[ex[r]]).T for r in range(len(ex))] + [np.zeros(o)])
    assert got.dtype == np.float64 and got.shape == (8, o)
    assert np.all(np.abs(got - ref) <= (i + 8) * 2.0 ** -24 * ab + 1e-30)
    assert (got[len(ex):] == 0).all()


def test_moe_with_fp8_experts_vs_float64():
    cfg = fp8_cfg()
    moe = MoE(cfg, jnp.bfloat16, nnx.Rngs(5))
    rng = np.random.default_rng(2)
    t, h = 12, cfg.hidden_size
    x = jnp.asarray(rng.standard_normal((t, h)) * rng.uniform(0.2, 3, (t, 1)), jnp.bfloat16)
    y = np.asarray(nnx.jit(lambda m, a: m(a))(moe, x), np.float64)
    # the routing as the module computes it (sigmoid scores, top-k, normalised), then the experts in float64
    scores = jax.nn.sigmoid(moe.gate(x.astype(jnp.float32), jnp.float32))
    wt, idx = jax.lax.top_k(scores, cfg.moe_topk)
    wt, idx = np.asarray(wt / wt.sum(-1, keepdims=True), np.float64), np.asarray(idx)
    w1, w3, w2 = dense(moe.w1), dense(moe.w3), dense(moe.w2)
    xd = quantised(x, cfg.numerics.act_scale_fmt)
    ref, bound = np.zeros((t, h)), np.zeros((t, h))
    for r in range(t):
        for k in range(cfg.moe_topk):
            e = idx[r, k]
            g, u = w1[e] @ xd[r], w3[e] @ xd[r]
            a = (g / (1 + np.exp(-g)) * u).astype(np.float32).astype(ml_dtypes.bfloat16)
            ad = quantised(jnp.asarray(a)[None], cfg.numerics.act_scale_fmt)[0]
            ref[r] += wt[r, k] * (w2[e] @ ad)
            # a's bf16 rounding and its e4m3 re-quantisation may flip against jds's float32 g and u: one e4m3
            # step (1/8 relative) of each element, through |w2|
            bound[r] += wt[r, k] * (np.abs(w2[e]) @ (np.abs(ad) * 2.0 ** -3 + 1e-6))
    shared = np.asarray(moe.shared(x).astype(jnp.float32), np.float64)
    err = np.abs(y - (ref + shared))
    assert np.all(err <= bound + 2.0 ** -7 * np.abs(ref + shared) + 1e-6)
    # and most elements far tighter: the bound only covers rare rounding flips
    assert np.mean(err <= 2.0 ** -7 * np.abs(ref + shared) + 1e-3 * np.abs(ref).max()) > 0.9


def test_decoder_holds_fp8_experts_and_sets_their_gemm():
    m = Decoder(fp8_cfg(), seed=0)
    w1 = m.layers[0].ffn.w1
    assert isinstance(w1, FP8Experts) and w1.weight[...].dtype == jnp.float8_e4m3fn
    assert w1.weight.shape == (4, 128, 256) and w1.scale.shape == (4, 1, 2)
    assert w1.implementation == ("xla" if jax.default_backend() != "gpu" else w1.implementation)
    names = export_weights(m)
    assert names["layers.0.ffn.w2"].shape == (4, 256, 128) and names["layers.0.ffn.w2.scale"].shape == (4, 2, 1)


def test_export_import_as_stored(tmp_path):
    cfg = fp8_cfg(fp8_linear=True)
    model = Decoder(cfg, seed=4)
    weights = export_weights(model)
    hf = tmp_path / "hf"
    hf_import.export_hf(model, hf)
    src = SafetensorsDir(hf)
    name = "model.layers.0.mlp.experts.2.up_proj"
    assert src.info(name + ".weight") == ("F8_E4M3", (128, 256))
    assert src.get(name + ".weight").tobytes() == weights["layers.0.ffn.w3"][2].tobytes()
    np.testing.assert_array_equal(src.get(name + ".weight_scale_inv"), weights["layers.0.ffn.w3.scale"][2])
    over = {"block_size": cfg.block_size}
    # stored e4m3, the experts import as stored by default (the convert script, as scripts/serve.py --model)
    from tests.test_convert_checkpoint import CONVERT

    rep = CONVERT.main([str(hf), str(tmp_path / "fp8"), "--override", f"block_size={cfg.block_size}", "--no-progress"])
    assert rep["config"].numerics.experts_fp8
    got = read_checkpoint(tmp_path / "fp8")
    assert_same_weights({k: v for k, v in weights.items() if "ffn" in k},
                        {k: v for k, v in got.items() if "ffn" in k})
    # experts_fp8 off (a named departure): the experts dequantised into the V3 layout [E, in, out]
    rep = hf_import.convert_hf_checkpoint(hf, tmp_path / "deq", overrides=over, progress=False,
                                          numerics_overrides={"experts_fp8": False})
    assert not rep["config"].numerics.experts_fp8
    deq = read_checkpoint(tmp_path / "deq")
    assert "layers.0.ffn.w3.scale" not in deq
    want = np.swapaxes(dense(model.layers[0].ffn.w3), 1, 2).astype(deq["layers.0.ffn.w3"].dtype)
    np.testing.assert_array_equal(deq["layers.0.ffn.w3"], want)


def test_bf16_stored_experts_import_dequantised(tmp_path):
    """An FP8 checkpoint whose routed experts are stored bf16 (linears FP8) imports them as bf16: the default
    follows what the experts' headers say, not only config.json's quantization_config."""
    cfg = fp8_cfg(fp8_linear=True)
    cfg = dataclasses.replace(cfg, numerics=dataclasses.replace(cfg.numerics, experts_fp8=False))
    model = Decoder(cfg, seed=5)
    hf = tmp_path / "hf"
    hf_import.export_hf(model, hf)
    assert SafetensorsDir(hf).info("model.layers.0.mlp.experts.0.gate_proj.weight")[0] == "BF16"
    rep = hf_import.convert_hf_checkpoint(hf, tmp_path / "out", overrides={"block_size": cfg.block_size},
                                          progress=False)
    assert rep["config"].numerics.fp8_linear and not rep["config"].numerics.experts_fp8


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="invalid config field 'experts_fp8'"):
        Numerics(experts_fp8=1)
    fp8 = dataclasses.replace(preset("v32-tiny").numerics, experts_fp8=True)
    with pytest.raises(ValueError, match="invalid config field 'numerics.experts_fp8'.*routed experts"):
        preset("v32-tiny", numerics=fp8)  # a dense MLP
    with pytest.raises(ValueError, match="invalid config field 'moe_intermediate_size'.*multiple of 128"):
        dataclasses.replace(fp8_cfg(), moe_intermediate_size=64)
    v4 = dataclasses.replace(preset("v4-tiny-block").numerics, experts_fp8=True)
    with pytest.raises(ValueError, match="invalid config field 'numerics.experts_fp8'.*block 'v3'"):
        preset("v4-tiny-block", numerics=v4)


def test_fp8_expert_stacks_shard_as_out_in():
    """FP8 expert stacks are [E, out, in] (as the V4 block's), not the bf16 stacks' [E, in, out]: the expert axis
    over ``expert`` and each expert's width (out for w1 / w3, in for w2) over ``tensor``."""
    from jds.sharding import _routed_expert_spec
    from jax.sharding import PartitionSpec as P

    cfg, bf16 = fp8_cfg(), preset("v32-tiny")
    assert _routed_expert_spec("ffn/w1/weight", cfg) == P("expert", "tensor", None)
    assert _routed_expert_spec("ffn/w2/scale", cfg) == P("expert", None, "tensor")
    assert _routed_expert_spec("ffn/w1/value", bf16) == P("expert", None, "tensor")  # bf16 [E, in, out]
