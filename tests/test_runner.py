"""The execution boundary on CPU: wide / narrow / fused give the same logits and greedy tokens over a
multi-step mixed batch, and each mode issues the number of host dispatches the design says."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jds.batch import Chunk
from jds.config import Numerics
from jds.model import Decoder, preset
from jds.config import RunnerConfig
from jds.runner import MODES, BoundaryRunner, ModelRunner


def make_runner(arch: str, mode: str, moe: bool = False, input_prep: str = "device") -> BoundaryRunner:
    cfg = dataclasses.replace(preset(f"{arch}-tiny"), numerics=Numerics.exact())
    if moe:
        cfg = dataclasses.replace(cfg, n_routed_experts=4, moe_topk=2)
    model = Decoder(cfg, seed=0)
    # V3.2: the rollouts' steps (<= 52 tokens) in one token bucket, so each mode compiles one shape per region;
    # V4 (300-token prompts) in the default buckets up to 512
    tokens = dict(max_num_tokens=512) if arch == "v4" else dict(max_num_tokens=64, token_buckets=(64,))
    return BoundaryRunner(model=model, mode=mode, num_blocks=24, max_num_seqs=4,
                          max_model_len=640 if arch == "v4" else 256, input_prep=input_prep, **tokens)


def greedy_rollout(runner: BoundaryRunner, prompts: list[np.ndarray], steps: int,
                   block_tables: np.ndarray) -> tuple[list[np.ndarray], list[list[int]]]:
    """Prefill all prompts (one chunked into two steps), then decode greedily; all mixed in one batch."""
    logits_log: list[np.ndarray] = []
    toks: list[list[int]] = [[] for _ in prompts]
    # step 1: request 0 only half its prompt, the others whole
    half = len(prompts[0]) // 2
    chunks = [Chunk(0, 0, half)] + [Chunk(i, 0, len(p)) for i, p in enumerate(prompts) if i > 0]
    ids = np.concatenate([prompts[0][:half]] + [p for p in prompts[1:]])
    lg = runner.execute(ids, chunks, block_tables)
    logits_log.append(lg)
    for i in range(1, len(prompts)):
        toks[i].append(int(np.argmax(lg[i])))
    # step 2: rest of request 0's prompt mixed with decodes of the others
    chunks = [Chunk(0, half, len(prompts[0]) - half)] + [Chunk(i, len(p), 1) for i, p in enumerate(prompts) if i > 0]
    ids = np.concatenate([prompts[0][half:]] + [np.array([toks[i][-1]]) for i in range(1, len(prompts))])
    lg = runner.execute(ids, chunks, block_tables)
    logits_log.append(lg)
    toks[0].append(int(np.argmax(lg[0])))
    for i in range(1, len(prompts)):
        toks[i].append(int(np.argmax(lg[i])))
    for _ in range(steps):
        chunks = [Chunk(i, len(p) + len(toks[i]) - 1, 1) for i, p in enumerate(prompts)]
        ids = np.array([toks[i][-1] for i in range(len(prompts))])
        lg = runner.execute(ids, chunks, block_tables)
        logits_log.append(lg)
        for i in range(len(prompts)):
            toks[i].append(int(np.argmax(lg[i])))
    return logits_log, toks


@pytest.mark.parametrize("arch", ["v32", pytest.param("v4", marks=pytest.mark.slow)])  # v4: long prompts (C128)
def test_modes_agree(arch: str) -> None:
    rng = np.random.default_rng(0)
    lens = [40, 23, 9] if arch == "v32" else [300, 140, 17]
    prompts = [rng.integers(0, 256, n) for n in lens]
    bt = rng.permutation(24)[:15].reshape(3, 5).astype(np.int32)
    results = {}
    for mode in MODES:
        runner = make_runner(arch, mode)
        results[mode] = greedy_rollout(runner, prompts, steps=3, block_tables=bt)
        n_layers = runner.model.cfg.n_layers
        if mode == "fused":
            assert (runner.last_dispatch.captured, runner.last_dispatch.eager) == (1, 0)
        else:
            assert (runner.last_dispatch.captured, runner.last_dispatch.eager) == (n_layers + 1, n_layers)
    base_logits, base_toks = results["wide"]
    for mode in ("narrow", "fused"):
        logits, toks = results[mode]
        # float32 numerics: a greedy flip needs a top-2 logit gap within float32 rounding (not seen; the
        # logits below agree to 1e-6)
        assert toks == base_toks, f"{mode} greedy tokens differ from wide"
        for a, b in zip(logits, base_logits):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max())


def test_moe_ffn_runs_and_modes_agree() -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n) for n in (20, 7)]
    bt = np.arange(8, dtype=np.int32).reshape(2, 4)
    out = {}
    for mode in ("narrow", "fused"):
        out[mode] = greedy_rollout(make_runner("v32", mode, moe=True), prompts, steps=2, block_tables=bt)
    assert out["narrow"][1] == out["fused"][1]
    for a, b in zip(out["narrow"][0], out["fused"][0]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max())


def test_runner_rejects_bad_steps() -> None:
    r = make_runner("v32", "narrow")
    bt = np.arange(8, dtype=np.int32).reshape(2, 4)
    with pytest.raises(ValueError, match="token_ids"):
        r.execute(np.zeros(3, np.int32), [Chunk(0, 0, 4)], bt)
    with pytest.raises(ValueError, match="max_model_len"):
        r.execute(np.zeros(4, np.int32), [Chunk(0, 254, 4)], np.zeros((1, 16), np.int32))
    with pytest.raises(ValueError, match="mode"):
        BoundaryRunner(model=r.model, mode="eager", num_blocks=4, max_num_seqs=2, max_num_tokens=16, max_model_len=64)


def test_compile_buckets_always_cover_the_largest_step() -> None:
    """Given buckets are sorted and extended by the maximum; out-of-range ones name the field."""
    model = Decoder(preset("v32-tiny"), seed=0)
    r = BoundaryRunner(model=model, mode="narrow", num_blocks=8, max_num_seqs=2, max_num_tokens=32,
                       max_model_len=64, token_buckets=(16, 8), key_block_buckets=(2,))
    assert r.token_buckets == (8, 16, 32) and r.key_block_buckets == (2, r.max_blocks)
    with pytest.raises(ValueError, match="token_buckets"):
        BoundaryRunner(model=model, mode="narrow", num_blocks=8, max_num_seqs=2, max_num_tokens=32,
                       max_model_len=64, token_buckets=(64,))
    with pytest.raises(ValueError, match="key_block_buckets"):
        BoundaryRunner(model=model, mode="narrow", num_blocks=8, max_num_seqs=2, max_num_tokens=32,
                       max_model_len=64, key_block_buckets=(0,))


@pytest.mark.parametrize("arch", ["v32", "v4"])
def test_narrow_eager_region_reads_the_caches_only(arch: str) -> None:
    """The narrow eager call returns the attention output alone: handing back a cache it was not given
    to donate makes XLA copy every page (measured on the CPU: 51 ms -> 0.7 ms per C4 layer, v4-tiny)."""
    import jax

    r = make_runner(arch, "narrow", input_prep="host")
    tokens, batch, li, small = r.prepare_inputs(np.arange(9, dtype=np.int32), [Chunk(0, 0, 9)],
                                                np.arange(4 * r.max_blocks, dtype=np.int32).reshape(4, -1) % 24)
    h, x, cache = r._first(r._kinds[0])(r._embed[1], r._layers[0][1], tokens, batch, r.caches[0])
    out = r._eager(r._kinds[0])(r._layers[0][1], x, small, cache)
    assert isinstance(out, jax.Array) and out.shape[0] == tokens.shape[0]


@pytest.mark.parametrize("mode", ["narrow", pytest.param("fused", marks=pytest.mark.slow)])  # same input buffers
def test_stable_inputs_same_logits_same_addresses(mode: str) -> None:
    """stable_inputs writes each step's inputs into the previous step's buffers (in place: the device
    addresses do not move) and changes nothing else: the same logits over a multi-step mixed rollout."""
    prompts = [np.random.default_rng(i).integers(0, 256, n).astype(np.int32) for i, n in enumerate((13, 7, 20))]
    bt = np.arange(24, dtype=np.int32)[:18].reshape(3, 6)
    plain, stable = make_runner("v32", mode, input_prep="host"), make_runner("v32", mode, input_prep="host")
    stable.stable_inputs = True
    want, _ = greedy_rollout(plain, prompts, 3, bt)
    got, _ = greedy_rollout(stable, prompts, 3, bt)
    for a, b in zip(got, want):  # the same compiled steps on the same inputs: exact by construction
        np.testing.assert_array_equal(a, b)
    ids, chunks = np.arange(5, dtype=np.int32), [Chunk(0, 0, 5)]
    first = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(stable.prepare_inputs(ids, chunks, bt[:1]))]
    again = stable.prepare_inputs(ids + 1, chunks, bt[:1])
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(again)] == first
    assert int(again[0][0]) == 1




def test_runner_takes_one_runner_config() -> None:
    """A RunnerConfig and the same settings as keywords build the same runner; keywords replace the
    config's fields; ``runner.config`` gives the resolved settings back (and builds an equal runner)."""
    model = Decoder(preset("v32-tiny"), seed=0)
    rc = RunnerConfig(mode="fused", num_blocks=8, max_num_seqs=2, max_num_tokens=32, max_model_len=64)
    a = BoundaryRunner(model, rc)
    b = BoundaryRunner(model=model, mode="fused", num_blocks=8, max_num_seqs=2, max_num_tokens=32, max_model_len=64)
    assert a.config == b.config == BoundaryRunner.from_config(model, rc).config
    assert a.config == dataclasses.replace(rc, input_prep="device", token_buckets=(16, 32), key_block_buckets=(4,),
                                           update_capacity=4 * 2 + 64, step_buffer="pinned")
    assert BoundaryRunner(model, a.config).config == a.config
    c = BoundaryRunner(model, rc, mode="narrow", max_num_tokens=16)
    assert (c.mode, c.input_prep, c.max_num_tokens, c.num_blocks) == ("narrow", "host", 16, 8)
    with pytest.raises(ValueError, match="'mode'"):
        BoundaryRunner(model, rc, mode="eager")
    with pytest.raises(ValueError, match="'num_block'"):  # a misspelt setting is not ignored
        BoundaryRunner(model, rc, num_block=4)
    with pytest.raises(ValueError, match="RunnerConfig"):
        BoundaryRunner(model, {"mode": "fused"})
    with pytest.raises(ValueError, match="segments"):  # needs the model: 2 layers
        BoundaryRunner(model, rc, segments=3)


def test_model_runner_build_takes_a_runner_config() -> None:
    rc = RunnerConfig(mode="wide", num_blocks=4, max_num_seqs=2, max_num_tokens=16, max_model_len=64)
    r = ModelRunner.build(preset="v4-tiny", model_overrides={"n_layers": 2, "n_routed_experts": 4}, runner=rc)
    assert (r.model.cfg.arch, r.model.cfg.n_layers, r.model.cfg.n_routed_experts) == ("v4", 2, 4)
    assert r.config == dataclasses.replace(rc, input_prep="host", token_buckets=(16,), key_block_buckets=(1,),
                                           update_capacity=72, step_buffer="pinned")
    cfg = preset("v32-tiny", n_layers=1)
    assert ModelRunner.build(model_config=cfg, runner=rc).model.cfg == cfg
    with pytest.raises(ValueError, match="model_config"):
        ModelRunner.build(model_config=cfg, preset="v32-tiny", runner=rc)
    with pytest.raises(ValueError, match="'moe'"):  # the old shortcut is a command-line alias now
        ModelRunner.build(preset="v32-tiny", model_overrides={"moe": True}, runner=rc)


def test_compiler_options_and_dump_dir_reach_their_executables(tmp_path, no_compile_cache) -> None:
    """Captured and eager executables take their own XLA options from the RunnerConfig, and ``dump_dir``
    dumps every executable of the runner (no XLA_FLAGS involved). (XLA dumps while compiling: no
    persistent-cache hits here, tests/conftest.py.)"""
    model = Decoder(preset("v32-tiny"), seed=0)
    ids, chunks, bt = np.arange(5, dtype=np.int32), [Chunk(0, 0, 5)], np.arange(8, dtype=np.int32).reshape(2, 4)
    kw = dict(mode="narrow", num_blocks=8, max_num_seqs=2, max_num_tokens=16, max_model_len=64)

    def modules(d) -> set[str]:
        return {p.name.split(".")[1] for p in d.iterdir() if p.name.endswith(".before_optimizations.txt")}

    r = BoundaryRunner(model, RunnerConfig(**kw, captured_compiler_options={"xla_dump_to": str(tmp_path / "cap")},
                                           eager_compiler_options={"xla_dump_to": str(tmp_path / "eager")}))
    r.execute(ids, chunks, bt)
    assert modules(tmp_path / "cap") == {"jit_first", "jit_mid", "jit_last"}
    assert modules(tmp_path / "eager") == {"jit_consume"}
    r = BoundaryRunner(model, RunnerConfig(**kw, dump_dir=str(tmp_path / "all")))
    r.execute(ids, chunks, bt)
    assert modules(tmp_path / "all") == {"jit_first", "jit_mid", "jit_last", "jit_consume"}


@pytest.mark.parametrize("mode, settings", [("fused", {"segments": 2, "first_segment_layers": 1}), ("narrow", {})])
def test_warmup_leaves_nothing_to_compile(mode: str, settings: dict, no_compile_cache) -> None:
    """After ``warmup`` + ``warmup_submit``, real steps (execute, submit with and without the device token
    feed, a whole block-table replacement) compile nothing: every persistent buffer is made committed to
    the device as the steps' outputs are, and jit keys its executables on that (a server's first request
    after start-up compiled the whole step again). Without persistent-cache hits (tests/conftest.py): a
    recompile of an identical module would load from the cache and not be counted."""
    from jds.engine.sampling import SamplingParams, SamplingRows

    cfg = dataclasses.replace(preset("v32-tiny", n_layers=3), numerics=Numerics.exact())
    r = ModelRunner(Decoder(cfg, seed=0), mode=mode, num_blocks=8, max_num_seqs=2, max_num_tokens=16,
                    max_model_len=32, token_buckets=(16,), key_block_buckets=(2,), update_capacity=2, **settings)
    with pytest.raises(ValueError, match="buckets"):
        r.warmup(buckets=[(999, 2)])
    r.warmup()
    r.warmup_submit()
    compiles: list[str] = []

    def count(event: str, secs: float, **kw: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        table = np.array([[0, 1], [2, 3]], np.int32)
        greedy = SamplingRows.build([SamplingParams(temperature=0)] * 2, [0, 0], [0, 0])
        r.execute(np.array([5, 6, 7]), [Chunk(0, 0, 2), Chunk(1, 0, 1)], table)
        r.submit(np.array([5, 6, 7]), [Chunk(0, 0, 2), Chunk(1, 0, 1)], table, greedy, np.full(3, -1))
        r.submit(np.array([-1, -1]), [Chunk(0, 2, 1), Chunk(1, 1, 1)], table, greedy, np.array([0, 1]))
        sampled = SamplingRows.build([SamplingParams(temperature=0.8)] * 2, [1, 2], [1, 1])
        r.submit(np.array([-1, -1]), [Chunk(0, 3, 1), Chunk(1, 2, 1)], table, sampled, np.array([0, 1])).result()
        r.execute(np.array([1, 2]), [Chunk(0, 0, 1), Chunk(1, 0, 1)], np.array([[7, 6], [5, 4]], np.int32))
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == []


def test_segment_bounds() -> None:
    """An even split, or ``first_segment_layers`` first and the rest split evenly; every segment non-empty."""
    model = Decoder(dataclasses.replace(preset("v32-tiny", n_layers=7), numerics=Numerics.exact()), seed=0)
    kw = dict(mode="fused", num_blocks=4, max_num_seqs=2, max_num_tokens=16, max_model_len=32)
    assert BoundaryRunner(model, segments=3, **kw)._segment_bounds() == [(0, 2), (2, 5), (5, 7)]
    assert BoundaryRunner(model, segments=3, first_segment_layers=1, **kw)._segment_bounds() == [(0, 1), (1, 4), (4, 7)]
    assert BoundaryRunner(model, segments=7, first_segment_layers=1, **kw)._segment_bounds() == [(i, i + 1) for i in range(7)]
    with pytest.raises(ValueError, match="first_segment_layers"):
        BoundaryRunner(model, segments=3, first_segment_layers=6, **kw)
    with pytest.raises(ValueError, match="first_segment_layers"):
        RunnerConfig(mode="fused", first_segment_layers=1)


def test_runner_holds_v32_absorbed_weights(monkeypatch) -> None:
    """With an FP8 ``wkv_b`` the runner's copy of a V3.2 model holds W_UK / W_UV dequantised once
    (``V32Attention.hold_absorbed``), the caller's model is left as it was, and the logits equal those of a
    runner that dequantises them every step (the same bf16 values reach the same einsums)."""
    from jds.v32 import V32Attention

    model = Decoder(dataclasses.replace(preset("v32-tiny"), numerics=Numerics.reference()), seed=0)
    kw = dict(mode="fused", num_blocks=8, max_num_seqs=2, max_model_len=64, max_num_tokens=32, token_buckets=(32,))
    held = BoundaryRunner(model=model, **kw)
    for layer, served in zip(model.layers, held._served.layers):
        assert layer.attn.absorbed is None and served.attn.absorbed is not None
        uk, uv = layer.attn._dequant_heads()
        w = np.asarray(served.attn.absorbed[...])
        assert np.array_equal(w[0], np.asarray(uk)) and np.array_equal(w[1], np.asarray(uv))
    monkeypatch.setattr(V32Attention, "hold_absorbed", lambda self: None)
    per_step = BoundaryRunner(model=model, **kw)
    assert all(served.attn.absorbed is None for served in per_step._served.layers)
    ids = np.arange(1, 13, dtype=np.int32)
    bt = np.arange(8, dtype=np.int32).reshape(2, 4)
    chunks = [Chunk(0, 0, 7), Chunk(1, 0, 5)]
    a, b = held.execute(ids, chunks, bt), per_step.execute(ids, chunks, bt)
    assert np.array_equal(a, b)
