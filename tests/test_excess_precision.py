"""bf16 rounding under jit (``RunnerConfig.excess_precision``).

XLA's default ``xla_allow_excess_precision=True`` lets a fusion keep bf16 intermediates in float32, so a jitted
bf16 forward skips rounding points that the eager forward (and DeepSeek's reference, whose every bf16 op
rounds) makes. The runner compiles with it off by default; these tests pin the option and its effect on a V4
layer (hyper-connections, MoE: many bf16 casts) and on a whole step against the eager forward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jds.batch import Chunk, make_batch
from jds.config import Numerics, RunnerConfig, preset
from jds.model import Decoder, V4Hidden
from jds.runner import BoundaryRunner


def _v4_layer_case():
    cfg = dataclasses.replace(preset("v4-tiny-block"), numerics=Numerics.bf16())
    model = Decoder(cfg, seed=6)
    layer = model.layers[1]
    rng = np.random.default_rng(1)
    t = 24
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, t), jnp.int32)
    streams = jnp.asarray(rng.normal(size=(t, cfg.hc_mult, cfg.hidden_size)), jnp.float32).astype(jnp.bfloat16)
    batch = make_batch([Chunk(0, 0, t)], np.arange(1, dtype=np.int32)[None], cfg.block_size)
    return layer, V4Hidden(streams, tokens), batch, model.init_caches(1)[1]


@pytest.mark.slow  # 30 s of eager ops; test_bf16_step_matches_the_eager_forward covers the option in the default suite
def test_jitted_bf16_layer_rounds_like_eager_without_excess_precision() -> None:
    """Jitted with the runner's option, a bf16 V4 layer (C4 attention, MoE, hyper-connections) differs from its
    eager forward in under 2% of elements, by at most one bf16 ulp of the output's scale (summation order); with
    XLA's default, in most elements (kept float32 intermediates)."""
    layer, h, batch, cache = _v4_layer_case()
    eager = np.asarray(layer(h, batch, cache)[0].streams.astype(jnp.float32))
    gd, st = nnx.split(layer)

    def f(st, h, batch, cache):
        return nnx.merge(gd, st)(h, batch, cache)[0].streams.astype(jnp.float32)

    scale = np.abs(eager).max()
    ulp = 2.0 ** (np.floor(np.log2(scale)) - 7)
    out = {}
    for excess in (False, True):
        y = np.asarray(jax.jit(f, compiler_options={"xla_allow_excess_precision": excess})(st, h, batch, cache))
        out[excess] = (np.mean(y != eager), np.abs(y - eager).max())
    assert out[False][0] <= 0.02 and out[False][1] <= ulp, out
    assert out[True][0] > 0.2, out  # the effect this option exists for (if XLA changes, revisit the default)


@pytest.mark.parametrize("excess", [False, True])
def test_runner_executables_carry_the_option(excess: bool) -> None:
    model = Decoder(preset("v32-tiny", n_layers=1), seed=0)
    r = BoundaryRunner(model, RunnerConfig(mode="narrow", num_blocks=8, max_num_seqs=2, max_num_tokens=16,
                                           max_model_len=64, excess_precision=excess,
                                           captured_compiler_options={"xla_gpu_enable_command_buffer": "FUSION"}))
    for eager in (False, True):
        assert r._compiler_options(eager)["xla_allow_excess_precision"] is excess
    assert r._compiler_options(False)["xla_gpu_enable_command_buffer"] == "FUSION"
    with pytest.raises(ValueError, match="excess_precision"):
        RunnerConfig(excess_precision=1)


def test_bf16_step_matches_the_eager_forward() -> None:
    """A bf16 V3.2 prefill through the runner (fused: one executable) against the model's eager forward: with
    the bf16 casts kept, the logits agree to float32 noise (2e-7 of their scale on the CPU, 2026-12-01); with
    XLA's excess precision they differed by 7e-3 of it."""
    cfg = dataclasses.replace(preset("v32-tiny", n_layers=2), numerics=Numerics.bf16())
    model = Decoder(cfg, seed=0)
    ids = np.arange(5, dtype=np.int32) * 7 % cfg.vocab_size
    bt = np.arange(8, dtype=np.int32).reshape(2, 4)
    r = BoundaryRunner(model, RunnerConfig(mode="fused", num_blocks=8, max_num_seqs=2, max_num_tokens=16,
                                           max_model_len=64, input_prep="host"))
    got = r.execute(ids, [Chunk(0, 0, 5)], bt)[0]
    batch = make_batch([Chunk(0, 0, 5)], bt, cfg.block_size)
    want, _ = model(jnp.asarray(ids), batch, model.init_caches(2), jnp.asarray([4], jnp.int32))
    want = np.asarray(want[0])
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -16 * np.abs(want).max())
