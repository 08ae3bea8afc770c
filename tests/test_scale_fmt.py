"""A checkpoint's activation scale format (``quantization_config.scale_fmt``: "ue8m0", or absent = DeepSeek's
plain amax/448) reaches every activation quantiser: the FP8 linears, the indexer q and the indexer key record.

The quantisers are checked byte for byte against an independent numpy re-derivation of the format (IEEE
float32 division, RNE into e4m3: exact by construction); a whole V3.2 layer against the float64 oracle
(tests/reference/torch_v32.py) under the same numerics; the Pallas kernels, which implement ue8m0, refuse
amax so that ``implementation="auto"`` runs the XLA form."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jds.config import Numerics, V32Config
from jds.ops.dispatch import Unsupported
from jds.ops.quant import fp8_linear, quantize_weight_blocks
from jds.ops.records import IndexerRecord132
from jds.ops.rope import cached_inv_freqs, rope_cos_sin
from pallas_kernels.fused_insert_v32 import fused_kv_insert_v32, fused_q_v32
from tests.v32_harness import assert_sets_match, make_layer, max_rel_err, random_inputs, run_jax, run_torch

F32, E4M3 = np.float32, ml_dtypes.float8_e4m3fn
FMTS = ("ue8m0", "amax")


def ref_quant(x: np.ndarray, block: int, fmt: str, floor: float = 1e-4) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's act_quant in numpy: a = max(amax, floor); s = a * fp32(1/448) (ue8m0: the next power of
    two, from the exact float64 log2 of that float32); q = e4m3_RNE(clip(x / s, +-448)), x / s in float32."""
    g = x.astype(F32).reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    a = np.maximum(np.abs(g).max(-1), F32(floor)).astype(F32)
    v = (a * F32(1.0 / 448.0)).astype(F32)
    s = (2.0 ** np.ceil(np.log2(v.astype(np.float64)))).astype(F32) if fmt == "ue8m0" else v
    q = np.clip(g / s[..., None], -448, 448).astype(F32).astype(E4M3)
    return q.reshape(x.shape), s


def _rows(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    """Rows over many magnitudes, one all-zero and one below the 1e-4 amax floor."""
    x = rng.normal(size=(n, d)) * np.exp(rng.uniform(-8, 6, size=(n, 1)))
    x[0], x[1] = 0.0, x[1] * 1e-7
    return x.astype(ml_dtypes.bfloat16).astype(F32)


@pytest.mark.parametrize("fmt", FMTS)
def test_indexer_key_record_bytes(fmt: str) -> None:
    x = _rows(np.random.default_rng(0), 64, 128)
    rec = np.asarray(IndexerRecord132(16, 128, scale_fmt=fmt).pack(jnp.asarray(x)))
    q, s = ref_quant(x, 128, fmt)
    np.testing.assert_array_equal(rec[:, :128], q.view(np.uint8))
    np.testing.assert_array_equal(rec[:, 128:].copy().view(F32), s)
    if fmt == "amax":  # really the amax format: most scales are not powers of two
        assert (np.frexp(s)[0] != 0.5).mean() > 0.9


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_linear_activation_scales(fmt: str) -> None:
    """The block-scaled GEMM re-quantises its input in ``fmt`` (float64 sum of the dequantised operands)."""
    rng = np.random.default_rng(1)
    x = _rows(rng, 8, 256)
    w = rng.normal(size=(192, 256)).astype(F32) * 0.05
    wq, ws = quantize_weight_blocks(w)
    got = np.asarray(fp8_linear(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(ws), jnp.float32, fmt))
    q, s = ref_quant(x, 128, fmt)
    xd = (q.astype(np.float64).reshape(8, 2, 128) * s[..., None]).reshape(8, 256)
    wd = wq.astype(np.float64) * np.repeat(np.repeat(ws.astype(np.float64), 128, 0)[:192], 128, 1)[:, :256]
    want = xd @ wd.T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    other = "amax" if fmt == "ue8m0" else "ue8m0"  # and the format makes a difference
    alt = np.asarray(fp8_linear(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(ws), jnp.float32, other))
    assert not np.array_equal(got, alt)


def _q_inputs(t: int = 6):
    cfg = V32Config.tiny()
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(t, cfg.n_heads, 192)), jnp.bfloat16)
    iq = jnp.asarray(rng.normal(size=(t, cfg.index_n_heads, 128)), jnp.bfloat16)
    iw = jnp.asarray(rng.normal(size=(t, cfg.index_n_heads)), jnp.float32)
    cos, sin = rope_cos_sin(cached_inv_freqs(cfg.rope, 64), jnp.asarray(rng.integers(0, 2000, t), jnp.int32))
    return (q, iq, iw, cos, sin), dict(nope_dim=128, dtype=jnp.bfloat16, indexer_interleave=False, hadamard=False,
                                       fp8=True)


def test_indexer_q_scales_and_kernel_refusal() -> None:
    args, kw = _q_inputs()
    _, q8, s, _ = fused_q_v32(*args, **kw, scale_fmt="amax", implementation="xla")
    # the scale of each (token, head): amax/448 of the roped q (no Hadamard here), not a power of two
    roped = np.asarray(q8.astype(jnp.float32)) * np.asarray(s)[..., None]
    assert (np.frexp(np.asarray(s))[0] != 0.5).mean() > 0.9
    np.testing.assert_allclose(np.abs(roped).max(-1) / 448, np.asarray(s), rtol=2 ** -7)
    with pytest.raises(Unsupported, match="scale_fmt 'amax'"):
        fused_q_v32(*args, **kw, scale_fmt="amax", implementation="pallas", interpret=True)
    auto = fused_q_v32(*args, **kw, scale_fmt="amax", implementation="auto", interpret=True)
    for a, b in zip(auto, fused_q_v32(*args, **kw, scale_fmt="amax", implementation="xla")):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_kv_insert_kernel_refuses_amax_index_records() -> None:
    rng = np.random.default_rng(3)
    t, nb = 4, 2
    fmt = IndexerRecord132(16, 128, scale_fmt="amax")
    kv = jnp.asarray(rng.normal(size=(t, 576)), jnp.bfloat16)
    ik = jnp.asarray(rng.normal(size=(t, 128)), jnp.bfloat16)
    cos, sin = rope_cos_sin(cached_inv_freqs(V32Config.tiny().rope, 64), jnp.arange(t, dtype=jnp.int32))
    from jds.ops.paging import empty_cache
    from jds.ops.records import FloatRows

    kvf = FloatRows(576, 16, jnp.bfloat16)
    args = (kv, ik, cos, sin, jnp.arange(t, dtype=jnp.int32), empty_cache(kvf, nb), empty_cache(fmt, nb),
            jnp.ones(512, jnp.float32), jnp.ones(128, jnp.float32), jnp.zeros(128, jnp.float32))
    kw = dict(kv_format=kvf, index_format=fmt, eps=1e-6, dtype=jnp.bfloat16, indexer_interleave=False,
              hadamard=False)
    with pytest.raises(Unsupported, match="scale_fmt 'amax'"):
        fused_kv_insert_v32(*args, **kw, implementation="pallas", interpret=True)
    got = np.asarray(fused_kv_insert_v32(*args, **kw, implementation="auto", interpret=True)[1])
    np.testing.assert_array_equal(got, np.asarray(fused_kv_insert_v32(*args, **kw, implementation="xla")[1]))
    scales = got[0, 16 * 128: 16 * 128 + 4 * t].copy().view(F32)  # page 0: [16 x 128 values][16 x 4-byte scales]
    assert (scales > 0).all() and (np.frexp(scales)[0] != 0.5).all()


def test_v32_layer_amax_against_the_oracle() -> None:
    """A V3.2 layer whose every quantiser runs amax/448 (FP8 linears, indexer q / k, latent records) against
    the float64 oracle under the same numerics: outputs within the bf16 / e4m3 rounding of the amax latent
    (the ue8m0 reference case's bound, tests/test_v32_parity.py), top-k sets equal up to near-ties."""
    from jds.batch import Chunk
    from tests.test_v32_parity import CFG

    numerics = dataclasses.replace(Numerics.reference(), latent_scale_fmt="amax", act_scale_fmt="amax")
    layer, w = make_layer(CFG, numerics, seed=5)
    assert layer.index_format.scale_fmt == "amax" and layer.wq_a_wk_wkv_a.scale_fmt == "amax"
    xs = random_inputs([20, 11], CFG.hidden_size, seed=15)  # longer than index_topk = 8: sparse selection
    schedule = [[Chunk(0, 0, 13), Chunk(1, 0, 11)], [Chunk(0, 13, 7)]]  # a prefill chunk, then the rest
    j = run_jax(layer, xs, schedule, seed=6, jit=True, pad=True)
    t = run_torch(CFG, w, numerics, xs, schedule)
    for i in range(len(xs)):
        assert max_rel_err(j.out[i], t.out[i]) < 8e-2
        assert_sets_match(j.topk[i], t.topk[i], t.scores[i], rtol=1e-2)


def test_numerics_and_v4_name_the_field() -> None:
    with pytest.raises(ValueError, match="act_scale_fmt"):
        Numerics(act_scale_fmt="e5m2")
    from jds.model import Decoder, preset

    with pytest.raises(ValueError, match="act_scale_fmt='amax'.*V4"):
        Decoder(preset("v4-tiny", numerics=dataclasses.replace(Numerics.reference(), act_scale_fmt="amax")), seed=0)
