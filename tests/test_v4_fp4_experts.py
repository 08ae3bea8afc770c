"""DeepSeek-V4's FP4 routed experts (``Numerics.experts_fp4``): the forward against an independent float64 numpy
re-derivation, the HF import / export of the packed tensors as stored, and bad inputs.

The oracle is written from the release (``inference/convert.py``: FP4_TABLE, low nibble first, scale [out, in/32];
``model.py``: ``linear()`` = ``act_quant(x, 128, "ue8m0")`` then ``fp4_gemm``, ``Expert.forward``: w1 / w3
outputs in bf16, computed on in float32, up clamped to +-limit and gate from above, the routing weight applied
before ``w2``, whose bf16 input is re-quantised; ``kernel.py``: e4m3 = RNE of clamp(x / s, +-448), s =
2^ceil(log2(max(amax, 1e-4) * (1/448)))), never by calling jds's quantisers. Every value carries a float64
value v and a bound eps on |jds - v|:

* a float32 dot of n terms is exact when every term is a multiple of a power of two Q and sum |terms| < 2^24 Q
  (checked per element), else off by at most gamma = (n + 2) u sum |terms| (u = 2^-24); an input error eps_x
  adds |w| eps_x;
* a rounding R (bf16, float32, e4m3 at scale s) of a value within eps of v equals R(v) when R(v - eps) ==
  R(v + eps) (R is monotone), else it is within eps + ulp(|v| + eps) of R(v); an activation block whose amax
  is uncertain may take either of two scales, bounded with the larger one's ulp.

The test input puts each row's magnitudes in one octave (zero, tiny and amax-floor rows aside), so the e4m3
codes of x span few binades and the w1 / w3 dots are exact in float32: the chain then stays exact up to the
rare bf16 / e4m3 rounding that float32 transcendental noise can flip, and the bound stays at float32 noise
plus the last rounding for almost every element (asserted), tight enough that dropping the activation
quantisation or swapping the nibbles is caught (asserted too). The model runs jitted; on the gather path XLA
fuses away the rounding of each expert's output to bf16 (seen on CPU), which gets one more ulp of each.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jds import hf_import
from jds.checkpoint import read_checkpoint
from jds.config import ModelConfig, Numerics, preset
from jds.model import Decoder
from jds.nn import export_weights
from jds.ops import quant
from jds.ops.quant import e8m0_to_f32, fp4_dequant, fp4_unpack, random_fp4_weight
from jds.safetensors_io import SafetensorsDir
from jds.v4_block import FP4Experts, V4BlockConfig, V4MoE, _expert_input
from tests.test_checkpoint import assert_same_weights
from tests.test_convert_checkpoint import _rewrite_shard, assert_refused

U32 = 2.0 ** -24
BF16 = ml_dtypes.bfloat16
# The release's FP4_TABLE (inference/convert.py): the e2m1 value of each 4-bit code; code 8 is -0.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


# ------------------------------------------------------------------------------------------------------------
# float64 re-derivation


def np_fp4_weight(packed: np.ndarray, scale: np.ndarray, high_first: bool = False) -> np.ndarray:
    """[..., out, in/2] code bytes + [..., out, in/32] e8m0 bytes -> float64 [..., out, in]."""
    b = packed.astype(np.int64)
    lo, hi = E2M1[b & 0xF], E2M1[b >> 4]
    pair = (hi, lo) if high_first else (lo, hi)
    vals = np.stack(pair, axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))
    return vals * np.repeat(np.exp2(scale.astype(np.float64) - 127.0), 32, axis=-1)


def _ulp(a: np.ndarray, p: int, emin: int) -> np.ndarray:
    """Spacing of a float format with p significand bits and min normal exponent emin at |a|."""
    a = np.abs(a)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    return np.exp2(np.maximum(np.where(a > 0, e, emin), emin) - (p - 1))


def _rne(v: np.ndarray, p: int, emin: int) -> np.ndarray:
    q = _ulp(v, p, emin)
    return np.round(v / q) * q  # np.round: half to even


def r_bf16(v):
    return _rne(v, 8, -126)


def r_f32(v):
    return np.asarray(v, np.float32).astype(np.float64)


def r_e4m3(v):  # on values already within +-448
    return _rne(v, 4, -6)


def ulp_for(dt) -> Callable[[np.ndarray], np.ndarray]:
    return (lambda a: _ulp(a, 8, -126)) if dt == BF16 else (lambda a: _ulp(a, 24, -126))


def round_to(v: np.ndarray, eps: np.ndarray, dt) -> tuple[np.ndarray, np.ndarray]:
    """(R(v), bound on |R(jds) - R(v)|) for a rounding to the activation dtype."""
    r = r_bf16 if dt == BF16 else r_f32
    same = r(v - eps) == r(v + eps)
    return r(v), np.where(same, 0.0, eps + ulp_for(dt)(np.abs(v) + eps))


def ue8m0_scale(amax: np.ndarray) -> np.ndarray:
    """kernel.py act_quant with round_scale: 2^ceil(log2(max(amax, 1e-4) * f32(1/448))), the product in float32."""
    a = np.maximum(amax, 1e-4).astype(np.float32) * np.float32(1.0 / 448.0)
    m, e = np.frexp(a.astype(np.float64))
    return np.exp2(np.where(m == 0.5, e - 1, e).astype(np.float64))


def act_quant(v: np.ndarray, eps: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Dequantised e4m3 per ``block`` (ue8m0 scales) and its bound."""
    shp = v.shape
    vb, eb = v.reshape(shp[:-1] + (-1, block)), eps.reshape(shp[:-1] + (-1, block))
    amax = np.abs(vb).max(-1)
    s = ue8m0_scale(amax)[..., None]
    s_lo = ue8m0_scale(np.maximum(np.abs(vb) - eb, 0).max(-1))[..., None]
    s_hi = ue8m0_scale((np.abs(vb) + eb).max(-1))[..., None]
    q = s * r_e4m3(vb / s)
    same = (s_lo == s_hi) & (r_e4m3((vb - eb) / s) == r_e4m3((vb + eb) / s))
    step = s_hi * np.exp2(np.maximum(np.floor(np.log2(np.maximum(np.abs(vb) + eb, 1e-300) / s_hi)), -6) - 3)
    return q.reshape(shp), np.where(same, 0.0, eb + step).reshape(shp)


def _quantum_lb(a: np.ndarray, axis: int = -1) -> np.ndarray:
    """A power of two dividing every element along ``axis`` (inf for an all-zero row)."""
    m, e = np.frexp(np.where(a == 0, 1.0, a))
    mi = np.abs(m * 2.0 ** 53).astype(np.int64)
    tz = np.log2((mi & -mi).astype(np.float64))
    q = np.where(a == 0, np.inf, np.exp2(e - 53 + tz))
    return q.min(axis=axis)


def dot(x: np.ndarray, ex: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [n] (bound ex) . w [o, n]^T with float32 accumulation: (float64 value, bound)."""
    v = w @ x
    mag = np.abs(w) @ (np.abs(x) + ex)
    exact = (ex.max() == 0) & (mag < 2.0 ** 24 * _quantum_lb(w, -1) * _quantum_lb(x, -1))
    return v, np.where(exact, 0.0, (w.shape[-1] + 2) * U32 * mag) + np.abs(w) @ ex


def np_swiglu(g, u, limit):
    if limit > 0:
        u = np.clip(u, -limit, limit)
        g = np.minimum(g, limit)
    return g / (1.0 + np.exp(-g)) * u


def np_routed(x: np.ndarray, weights: np.ndarray, idx: np.ndarray, p: dict[str, np.ndarray], limit: float, dt,
              act_q: bool = True, high_first: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """sum_k expert_{idx_k}(x) (float32 sum) as the release computes it: (float64 value [T, d], bound, and
    sum_k ulp(expert output) in the activation dtype: the slack for a graph that skips that last rounding)."""
    w = {n: np_fp4_weight(p[n], p[n + ".scale"], high_first) for n in ("w1", "w3", "w2")}
    zero = np.zeros_like(x)
    xq, ex = act_quant(x, zero) if act_q else (x, zero)
    out, bound, slack = np.zeros_like(x), np.zeros_like(x), np.zeros_like(x)
    for t in range(x.shape[0]):
        ys, es = [], []
        for j, e in enumerate(idx[t]):
            g, eg = round_to(*dot(xq[t], ex[t], w["w1"][e]), dt)
            u, eu = round_to(*dot(xq[t], ex[t], w["w3"][e]), dt)
            wt = float(weights[t, j])
            h = wt * np_swiglu(g, u, limit)
            uc = np.clip(np.abs(u), 0, limit) if limit else np.abs(u)
            sg = np.abs(np_swiglu(g, np.ones_like(u), limit))
            # |d silu| <= 1.1; float32 silu (exp, divide) and two products: <= 16 u relative
            eh = wt * (1.1 * eg * (uc + eu) + sg * eu) + 16 * U32 * np.abs(h)
            h, eh = round_to(h, eh, dt)
            hq, ehq = act_quant(h, eh) if act_q else (h, eh)
            y, ey = round_to(*dot(hq, ehq, w["w2"][e]), dt)
            ys.append(y)
            es.append(ey)
        ys, es = np.array(ys), np.array(es)
        out[t] = ys.sum(0)
        bound[t] = es.sum(0) + (len(ys) + 1) * U32 * (np.abs(ys) + es).sum(0)
        slack[t] = ulp_for(dt)(np.abs(ys) + es).sum(0)
    return out, bound, slack


# ------------------------------------------------------------------------------------------------------------
# the quantisation helpers


def test_fp4_decoding_helpers():
    codes = np.arange(256, dtype=np.uint8)[None, :]
    got = np.asarray(fp4_unpack(jnp.asarray(codes)), np.float64)[0]
    want = np.stack([E2M1[codes[0] & 0xF], E2M1[codes[0] >> 4]], -1).reshape(-1)  # low nibble first
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[16]) and got[16] == 0  # code 8 (byte 0x08, low nibble) is -0
    e = np.arange(1, 255, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(e8m0_to_f32(jnp.asarray(e)), np.float64), np.exp2(e - 127.0))
    # the step's dequantisation against the oracle's (float64) and the importer's numpy one (float32)
    packed, scale = random_fp4_weight(jax.random.key(0), (3, 64, 96), 0.05)
    packed, scale = np.asarray(packed), np.asarray(scale)
    w64 = np_fp4_weight(packed, scale)
    np.testing.assert_array_equal(np.asarray(fp4_dequant(jnp.asarray(packed), jnp.asarray(scale), jnp.bfloat16)
                                             .astype(jnp.float32), np.float64), w64)  # exact in bf16
    np.testing.assert_array_equal(hf_import.dequant_fp4_e2m1(packed[1].view(np.int8),
                                                             scale[1].view(ml_dtypes.float8_e8m0fnu)), w64[1])
    # the random init: all 16 codes, three scale exponents, RMS within sqrt(2) of the std asked for
    assert len(np.unique(np.concatenate([packed & 0xF, packed >> 4]))) == 16
    assert np.ptp(scale.astype(int)) == 2
    assert 0.05 / 2 ** 0.5 < np.sqrt(np.mean(w64 ** 2)) < 0.05 * 2 ** 0.5
    with pytest.raises(ValueError, match="scale shape"):
        fp4_dequant(jnp.asarray(packed), jnp.asarray(scale[..., :2]))


def test_config_fields_validated():
    with pytest.raises(ValueError, match="moe_intermediate_size must be a multiple of 128 with experts_fp4"):
        V4BlockConfig.tiny(hidden_size=128, experts_fp4=True)
    with pytest.raises(ValueError, match="experts_fp4 must be a bool"):
        V4BlockConfig.tiny(experts_fp4=1)
    with pytest.raises(ValueError, match="invalid config field 'experts_fp4'"):
        Numerics(experts_fp4="yes")
    fp4 = dataclasses.replace(Numerics.reference(), experts_fp4=True)
    with pytest.raises(ValueError, match="invalid config field 'numerics.experts_fp4'.*block 'v4'"):
        preset("v4-tiny", numerics=fp4)
    with pytest.raises(ValueError, match="invalid config field 'moe_intermediate_size'.*multiple of 128"):
        preset("v4-tiny-block", numerics=fp4)  # its experts are 64 wide
    cfg = preset("v4-tiny-block", numerics=fp4, moe_intermediate_size=128)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


# ------------------------------------------------------------------------------------------------------------
# the forward


def _inputs(cfg: V4BlockConfig, dtype: str, seed: int):
    rng = np.random.default_rng(seed)
    t, d, k = 16, cfg.hidden_size, cfg.moe_topk
    # per row: magnitudes within one octave below 2^a (random a, random signs), so x's e4m3 codes use few binades;
    # row 0 is zero, row 1 falls under the 1e-4 amax floor
    amp = np.exp2(rng.uniform(-2.0, 3.0, (t, 1)))
    x = amp * rng.uniform(0.55, 1.0, (t, d)) * rng.choice([-1.0, 1.0], (t, d))
    x[0], x[1] = 0.0, x[1] * 2e-5
    x = jnp.asarray(x, jnp.float32).astype(dtype)
    idx = np.stack([rng.permutation(cfg.n_routed_experts)[:k] for _ in range(t)]).astype(np.int32)
    weights = rng.uniform(0.2, 1.5, (t, k)).astype(np.float32)
    return x, jnp.asarray(weights), jnp.asarray(idx)


@pytest.fixture(scope="module")
def fp4_moe() -> V4MoE:
    """One FP4 MoE (bf16 gate and shared expert); the routed experts' dtype is the input's."""
    cfg = V4BlockConfig.tiny(hidden_size=256, moe_intermediate_size=128, n_routed_experts=8, moe_topk=3,
                             swiglu_limit=3.0, experts_fp4=True)
    moe = V4MoE(cfg, 1, nnx.Rngs(5))
    assert isinstance(moe.w2, FP4Experts)
    return moe


def _with_impl(moe: V4MoE, impl: str) -> V4MoE:
    if impl == moe.cfg.moe_impl:
        return moe
    other = nnx.clone(moe)
    other.cfg = dataclasses.replace(moe.cfg, moe_impl=impl)
    return other


@pytest.mark.parametrize("dtype,impl", [("bfloat16", "ragged"), ("bfloat16", "gather"), ("float32", "ragged")])
def test_fp4_routed_experts_vs_float64(fp4_moe, dtype: str, impl: str):
    moe = _with_impl(fp4_moe, impl)
    cfg = moe.cfg
    x, weights, idx = _inputs(cfg, dtype, seed=5)
    p = {k: v for k, v in export_weights(moe).items() if k.startswith("w")}
    assert p["w1"].dtype == np.uint8 and p["w1"].shape == (8, 128, 128) and p["w2.scale"].shape == (8, 256, 4)
    dt = BF16 if dtype == "bfloat16" else np.float32
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    w64, i64 = np.asarray(weights, np.float64), np.asarray(idx)
    want, bound, slack = np_routed(x64, w64, i64, p, cfg.swiglu_limit, dt)
    # the bound is tight: float32 noise or the last rounding for most elements, not a blanket tolerance
    rel = bound[2:] / np.maximum(np.abs(want[2:]), 1e-30)
    assert np.mean(rel <= 2.0 ** -10) > 0.8, np.mean(rel <= 2.0 ** -10)
    got = np.asarray(jax.jit(moe.routed)(x, weights, idx), np.float64)
    if impl == "gather":
        # XLA fuses away the rounding of each expert's output to bf16 where it feeds the float32 sum directly
        # (seen on CPU; eager op-by-op runs keep it): one ulp of each expert output more
        bound = bound + slack
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound):.3e} at {worst}"
    assert np.all(got[0] == 0)
    # the clamps bite in this case
    g = np.einsum("ti,efi->tef", x64, np_fp4_weight(p["w1"], p["w1.scale"]))
    assert (g > cfg.swiglu_limit).mean() > 0.02 and (g < -cfg.swiglu_limit).mean() > 0.02
    # and the check has teeth: the release without its e4m3 input quantisation, or with the other nibble order,
    # falls outside the bound
    for variant in (dict(act_q=False), dict(high_first=True)):
        other, _, _ = np_routed(x64, w64, i64, p, cfg.swiglu_limit, dt, **variant)
        assert np.mean(np.abs(got - other) > bound) > 0.3, variant


def test_fp4_moe_call_and_paths_agree(fp4_moe):
    """The whole MoE (gate, FP4 routed experts, bf16 shared expert), jitted: the call is its parts composed, and
    the gather path agrees with the ragged one."""
    x, _, _ = _inputs(fp4_moe.cfg, "bfloat16", seed=9)
    tokens = jnp.arange(x.shape[0], dtype=jnp.int32)
    call = nnx.jit(lambda m, a, t: m(a, t))
    y = call(fp4_moe, x, tokens)
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape
    parts = nnx.jit(lambda m, a, t: (m.routed(a, *m.gate(a, t)) + m.shared(a).astype(jnp.float32)).astype(a.dtype))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(parts(fp4_moe, x, tokens), np.float32))
    # the jitted gather path may keep its 3 expert outputs unrounded (see above): a few bf16 ulps of the largest
    # expert output, which cancellation can make many ulps of a small sum
    g = np.asarray(call(_with_impl(fp4_moe, "gather"), x, tokens), np.float64)
    y64 = np.asarray(y, np.float64)
    assert np.abs(g - y64).max() <= 3 * 2.0 ** -8 * np.abs(y64).max()
    assert np.mean(g == y64) > 0.5


def test_gate_up_one_call_same_routed_output(fp4_moe):
    """``gate_up_one_call``: w1 and w3 as one grouped call give the routed output of two calls, bit for bit."""
    x, weights, idx = _inputs(fp4_moe.cfg, "bfloat16", seed=11)
    one, two = nnx.clone(fp4_moe), nnx.clone(fp4_moe)
    one.cfg = dataclasses.replace(fp4_moe.cfg, gate_up_one_call=True)
    two.cfg = dataclasses.replace(fp4_moe.cfg, gate_up_one_call=False)
    routed = nnx.jit(lambda m, a, w, i: m.routed(a, w, i))
    np.testing.assert_array_equal(np.asarray(routed(one, x, weights, idx)),
                                  np.asarray(routed(two, x, weights, idx)))


# ------------------------------------------------------------------------------------------------------------
# import / export as stored

LAYER_EXPERT = "layers.0.ffn.experts.2.w3"


def fp4_cfg():
    """One hash-routed V4-block layer with FP4 experts, in the numerics a preset-named import of a checkpoint
    without FP8 linears produces (bf16 attention linears keep the model's construction cheap)."""
    num = dataclasses.replace(Numerics.reference(), fp8_linear=False, indexer_fp4=True, experts_fp4=True)
    return preset("v4-tiny-block", numerics=num, moe_intermediate_size=128, n_layers=1)


@pytest.fixture(scope="module")
def fp4_source(tmp_path_factory) -> tuple[Any, dict[str, np.ndarray], Path]:
    cfg = fp4_cfg()
    model = Decoder(cfg, seed=4)
    hf = tmp_path_factory.mktemp("fp4") / "hf"
    hf_import.export_hf(model, hf)
    return cfg, export_weights(model), hf


def test_fp4_experts_round_trip_as_stored(tmp_path, fp4_source):
    cfg, weights, hf = fp4_source
    assert weights["layers.0.ffn.w1"].dtype == np.uint8  # the Decoder's V4 layers hold FP4Experts
    src = SafetensorsDir(hf)
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    assert json.loads((hf / "config.json").read_text())["expert_dtype"] == "fp4"
    assert src.info(LAYER_EXPERT + ".weight") == ("I8", (f, d // 2))
    assert src.info(LAYER_EXPERT + ".scale") == ("F8_E8M0", (f, d // 32))
    assert src.info("layers.0.ffn.experts.2.w2.scale") == ("F8_E8M0", (d, f // 32))
    # the HF bytes are the model's bytes
    assert src.get(LAYER_EXPERT + ".weight").tobytes() == weights["layers.0.ffn.w3"][2].tobytes()
    assert src.get(LAYER_EXPERT + ".scale").tobytes() == weights["layers.0.ffn.w3.scale"][2].tobytes()
    # a preset-named import of an FP4 release holds them as stored (experts_fp4 on), bit for bit
    rep = hf_import.convert_hf_checkpoint(hf, tmp_path / "out", overrides={"block_size": cfg.block_size},
                                          progress=False)
    assert rep["config"] == cfg and rep["config"].numerics.experts_fp4
    assert LAYER_EXPERT + ".scale" in rep["used"]
    assert_same_weights(weights, read_checkpoint(tmp_path / "out"))
    # experts_fp4 off (an explicit departure): the same experts dequantised, exactly, into a bf16 model
    rep = hf_import.convert_hf_checkpoint(hf, tmp_path / "bf16", overrides={"block_size": cfg.block_size},
                                          numerics_overrides={"experts_fp4": False}, progress=False)
    assert not rep["config"].numerics.experts_fp4
    got = read_checkpoint(tmp_path / "bf16")
    assert "layers.0.ffn.w3.scale" not in got and got["layers.0.ffn.w3"].dtype == BF16
    want = np_fp4_weight(weights["layers.0.ffn.w3"], weights["layers.0.ffn.w3.scale"])
    np.testing.assert_array_equal(got["layers.0.ffn.w3"].astype(np.float64), want)


def _replace(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[Path], None]:
    return lambda hf: _rewrite_shard(hf, name, lambda t: t.__setitem__(name, fn(t[name])))


def _edit_config(fn: Callable[[dict], Any]) -> Callable[[Path], None]:
    def go(hf: Path) -> None:
        d = json.loads((hf / "config.json").read_text())
        fn(d)
        (hf / "config.json").write_text(json.dumps(d))
    return go


W, S = LAYER_EXPERT + ".weight", LAYER_EXPERT + ".scale"
FP4_BAD: dict[str, tuple[Callable[[Path], None], str]] = {
    "scale_shape": (_replace(S, lambda a: a[:, :-1]),
                    re.escape(f"HF tensor '{S}' is F8_E8M0[128, 7], expected F8_E8M0 [128, 8]")),
    "scale_dtype": (_replace(S, lambda a: a.astype(np.float32)),
                    re.escape(f"HF tensor '{S}' is F32[128, 8], expected F8_E8M0 [128, 8]")),
    "scale_nan": (_replace(S, lambda a: np.where(np.arange(a.size).reshape(a.shape) == 9, np.uint8(0xFF),
                                                 a.view(np.uint8)).view(ml_dtypes.float8_e8m0fnu)),
                  re.escape(f"HF tensor '{S}': e8m0 scale byte 0xFF (NaN) at block [1, 1]")),
    "scale_missing": (lambda hf: _rewrite_shard(hf, S, lambda t: t.pop(S), index=True),
                      re.escape(f"missing tensor '{S}', the 1x32 e8m0 scales of the packed FP4 weight '{W}'")),
    "weight_bf16": (_replace(W, lambda a: np.zeros((a.shape[0], 2 * a.shape[1]), BF16)),
                    re.escape(f"HF tensor '{W}' is BF16[128, 256], expected packed FP4 (I8 or U8 [128, 128]")),
    "weight_shape": (_replace(W, lambda a: a[:, :-2]),
                     re.escape(f"HF tensor '{W}' is I8[128, 126], expected packed FP4")),
    "expert_dtype": (_edit_config(lambda d: d.update(expert_dtype="fp8")),
                     re.escape("invalid config field 'expert_dtype': 'fp8'")),
}


@pytest.mark.parametrize("case", list(FP4_BAD))
def test_fp4_bad_input_names_the_tensor(tmp_path, fp4_source, case: str):
    assert_refused(tmp_path, fp4_source[2], *FP4_BAD[case])


def test_lone_fp4_expert_without_expert_dtype_dequantises(tmp_path, fp4_source):
    """A checkpoint whose config.json does not say ``expert_dtype: fp4`` imports bf16 experts; an FP4-stored
    expert among them is dequantised exactly (as in jds's V3-style block)."""
    cfg, weights, hf0 = fp4_source
    hf = tmp_path / "hf"
    shutil.copytree(hf0, hf)
    _edit_config(lambda d: d.pop("expert_dtype"))(hf)
    rep = hf_import.convert_hf_checkpoint(hf, tmp_path / "out", overrides={"block_size": 128}, progress=False)
    assert not rep["config"].numerics.experts_fp4
    got = read_checkpoint(tmp_path / "out")["layers.0.ffn.w3"][2].astype(np.float64)
    want = np_fp4_weight(weights["layers.0.ffn.w3"][2], weights["layers.0.ffn.w3.scale"][2])
    np.testing.assert_array_equal(got, want)


def test_fp4_experts_run_the_grouped_kernel_where_set():
    """``FP4Experts.ragged`` dispatches on its ``implementation`` (which a ``Decoder`` sets from its own, "xla"
    off a GPU): the kernel (GPU interpret mode here) and the XLA path give the same grouped product, to fp32
    summation order then one bf16 rounding; float32 rows stay on the dequantised float32 product."""
    e, n, k = 3, 64, 512  # the kernel's smallest shapes: N a multiple of 64, K of 512
    experts = FP4Experts((e, n, k), k, nnx.Rngs(5))
    assert experts.implementation == "xla"
    x = jax.random.normal(jax.random.key(6), (9, k), jnp.float32).astype(jnp.bfloat16)
    sizes = jnp.array([4, 0, 5], jnp.int32)
    want = np.asarray(experts.ragged(x, sizes), np.float32)
    experts.implementation = "pallas"
    got = np.asarray(experts.ragged(x, sizes), np.float32)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=1e-6)
    # e4m3 rows with their scales (the MoE's decode path): the kernel's e4m3 route against XLA's float32 product
    xq, sx = quant.act_quant(x, 128, "ue8m0")
    got8 = np.asarray(experts.ragged(xq, sizes, x_scale=sx, out_dtype=jnp.float32), np.float64)
    experts.implementation = "xla"
    want8 = np.asarray(experts.ragged(xq, sizes, x_scale=sx, out_dtype=jnp.float32), np.float64)
    np.testing.assert_allclose(got8, want8, rtol=2.0 ** -18, atol=1e-6)
    experts.implementation = "pallas"
    f32 = experts.ragged(x.astype(jnp.float32), sizes)  # exact numerics: not the bf16 kernel
    assert f32.dtype == jnp.float32
    ref = np.concatenate([np.asarray(x[:4], np.float32) @ np.asarray(experts.dequant(jnp.float32)[0]).T,
                          np.asarray(x[4:], np.float32) @ np.asarray(experts.dequant(jnp.float32)[2]).T])
    np.testing.assert_allclose(np.asarray(f32), ref, rtol=1e-5, atol=1e-5)
    model = Decoder(fp4_cfg(), seed=4, implementation="pallas")  # off a GPU every GEMM stays on XLA
    stacks = [m for _, m in nnx.iter_modules(model) if isinstance(m, FP4Experts)]
    assert stacks and all(m.implementation == ("auto" if jax.default_backend() == "gpu" else "xla")
                          for m in stacks)


# CI time: the kernel's weight sets run in test_kernel_fp4_grouped_gemm.py's test_fp8_route_weight_sets
@pytest.mark.parametrize("implementation", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_ragged_pair_equals_two_calls(implementation: str) -> None:
    """``FP4Experts.ragged_pair`` (w1 and w3 in one grouped call, the MoE's gate / up at e4m3 rows) equals the
    two single calls bit for bit, for the XLA path and the kernel (GPU interpret mode off a GPU)."""
    e, n, k = 3, 64, 512
    w1, w3 = FP4Experts((e, n, k), k, nnx.Rngs(7)), FP4Experts((e, n, k), k, nnx.Rngs(8))
    w1.implementation = w3.implementation = implementation
    x = jax.random.normal(jax.random.key(9), (9, k), jnp.float32).astype(jnp.bfloat16)
    xq, sx = quant.act_quant(x, 128, "ue8m0")
    sizes = jnp.array([4, 0, 5], jnp.int32)
    got = np.asarray(w1.ragged_pair(w3, xq, sizes, sx, jnp.bfloat16), np.float32)
    want = np.concatenate([np.asarray(w.ragged(xq, sizes, x_scale=sx, out_dtype=jnp.bfloat16), np.float32)
                           for w in (w1, w3)], axis=1)
    np.testing.assert_array_equal(got, want)


def test_expert_rows_e4m3_at_every_size(fp4_moe):
    """bf16 expert inputs go to the FP4 kernel as act_quant's (e4m3, scales) pair at decode and prefill sizes
    (the route measured faster at both), standing for the values ``_expert_input`` gives; float32 inputs (exact
    numerics) stay float32 rows."""
    d = fp4_moe.cfg.hidden_size
    for n_rows in (16, 64 * fp4_moe.cfg.n_routed_experts):
        x = jax.random.normal(jax.random.key(n_rows), (n_rows, d), jnp.float32).astype(jnp.bfloat16)
        got = fp4_moe._expert_rows(x)
        assert isinstance(got, tuple)
        vals = quant.dequant(*got, 128)
        np.testing.assert_array_equal(np.asarray(vals), np.asarray(_expert_input(x, True).astype(jnp.float32)))
    x32 = jax.random.normal(jax.random.key(1), (16, d), jnp.float32)
    assert not isinstance(fp4_moe._expert_rows(x32), tuple)
