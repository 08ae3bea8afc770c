"""Batch-invariant mode (CPU): the same greedy or seeded request gives identical tokens alone, co-batched
with others, chunked into small prefill pieces and preempted (recomputed), driving the real Engine with
the real ModelRunner built with ``batch_invariant=True``.

Exact token equality is asserted because it holds by construction in this mode: every step runs the
same executables (one token bucket, one key-block bucket), every op is row-local, prefill and decode
both read a position's keys back from the cache they wrote, and the sampler keys its RNG by
(seed, output index). Built without the mode, the V3.2 checks here fail on the CPU (a step's token
bucket changes how a row rounds, and the argmax or the seeded draw flips for a request or two), so
they test the mode itself; scripts/bench_batch_invariant.py counts identical requests in both modes.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jds.engine import Engine, SamplingParams  # noqa: E402
from jds.runner import ModelRunner, invariant_buckets  # noqa: E402


def _requests(n: int, lo: int, hi: int, max_tokens: int, seed: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Even ids greedy, odd ids seeded sampling (temperature 1, top-p 0.95): both must be invariant."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        p = rng.integers(0, 256, size=int(rng.integers(lo, hi))).tolist()
        sp = (SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=1000 + i, ignore_eos=True))
        out[f"r{i}"] = (p, sp)
    return out


def _drain(engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (p, sp) in reqs.items():
        engine.add_request(rid, p, sp)
    toks: dict[str, list[int]] = {rid: [] for rid in reqs}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error is None, o.error
            toks[o.request_id] += o.new_token_ids
    assert not engine.has_work(), "engine did not drain"
    return toks


def _check_all_conditions(runner: ModelRunner, reqs: dict[str, tuple[list[int], SamplingParams]],
                          chunk: int) -> None:
    alone = {rid: _drain(Engine(runner), {rid: r})[rid] for rid, r in reqs.items()}
    assert all(len(t) == sp.max_tokens for t, (_, sp) in zip(alone.values(), reqs.values()))

    together = Engine(runner)  # co-batched; the pool is too small for all of them: preemption by recompute
    got = _drain(together, reqs)
    assert together.stats().num_preemptions > 0, "the pool was meant to force preemption"
    assert got == alone

    # Chunked: the scheduler hands the same runner (same compiled shape) prefill pieces of `chunk` tokens.
    chunked = Engine(runner)
    chunked.scheduler.max_num_tokens = chunk
    assert max(len(p) for p, _ in reqs.values()) > chunk
    assert _drain(chunked, reqs) == alone

    # Co-batched in reverse arrival order: every request sits in other rows next to other neighbours.
    assert _drain(Engine(runner), dict(reversed(list(reqs.items())))) == alone


def test_invariant_buckets_are_single_and_refuse_others():
    assert invariant_buckets((), (), 64, 16) == ((64,), (16,))
    assert invariant_buckets((64,), (16,), 64, 16) == ((64,), (16,))
    with pytest.raises(ValueError, match="token_buckets"):
        invariant_buckets((16, 64), (), 64, 16)
    with pytest.raises(ValueError, match="key_block_buckets"):
        invariant_buckets((), (4,), 64, 16)


@pytest.fixture(scope="module")
def v32_runner() -> ModelRunner:
    # 16 pages of 16 tokens for 8 requests of up to 59 + 16 tokens: preemption is certain.
    return ModelRunner.build(preset="v32-tiny", num_blocks=16, max_num_seqs=8, max_num_tokens=32,
                             max_model_len=128, batch_invariant=True)


def test_runner_compiles_one_shape(v32_runner):
    r = v32_runner
    assert r.token_buckets == (r.max_num_tokens,) and r.key_block_buckets == (r.max_blocks,)


def test_v32_alone_cobatched_chunked_preempted_identical(v32_runner):
    _check_all_conditions(v32_runner, _requests(8, lo=5, hi=60, max_tokens=16, seed=2), chunk=5)


@pytest.mark.parametrize("mode", [pytest.param("wide", marks=pytest.mark.slow), "fused"])  # CI time: wide is slow
def test_v32_other_modes_identical(mode):
    r = ModelRunner.build(preset="v32-tiny", mode=mode, num_blocks=12, max_num_seqs=8, max_num_tokens=32,
                          max_model_len=128, batch_invariant=True)
    _check_all_conditions(r, _requests(6, lo=5, hi=50, max_tokens=10, seed=4), chunk=7)


def test_v32_moe_identical():
    r = ModelRunner.build(preset="v32-tiny", model_overrides=dict(n_routed_experts=8, moe_topk=2, n_shared_experts=1),
                          num_blocks=12, max_num_seqs=8, max_num_tokens=32,
                          max_model_len=128, batch_invariant=True)
    _check_all_conditions(r, _requests(6, lo=5, hi=50, max_tokens=10, seed=5), chunk=6)


@pytest.mark.slow
def test_v32_many_requests_identical(v32_runner):
    _check_all_conditions(v32_runner, _requests(16, lo=5, hi=60, max_tokens=24, seed=3), chunk=5)


@pytest.mark.slow
def test_v4_alone_cobatched_chunked_preempted_identical():
    # Pages of 128 tokens: prompts of 100-124 tokens cross into a second page while decoding, and 4 pages
    # cannot hold 4 such requests: preemption. Covers the window, C4 (indexer) and C128 layers.
    r = ModelRunner.build(preset="v4-tiny", num_blocks=4, max_num_seqs=4, max_num_tokens=32, max_model_len=256,
                          batch_invariant=True)
    _check_all_conditions(r, _requests(4, lo=100, hi=125, max_tokens=12, seed=6), chunk=9)


@pytest.mark.slow
def test_bench_script_runs_on_cpu(tmp_path):
    """scripts/bench_batch_invariant.py end to end on the tiny preset (the H200 run uses the same code)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_batch_invariant as bench

    out = tmp_path / "bi.json"
    res = bench.main(["--preset", "v32-tiny", "--configs", "invariant", "--greedy", "4", "--seeded", "2",
                      "--num-blocks", "6", "--prompt-len", "20", "40", "--max-tokens", "16", "--max-model-len", "128",
                      "--max-num-tokens", "32", "--throughput-seqs", "4", "--throughput-prompt-len", "16",
                      "--throughput-tokens", "8", "--repeat", "1", "--out", str(out)])
    rec = res["configs"][0]
    assert out.exists() and rec["num_preemptions"] > 0
    assert (rec["greedy_identical"], rec["seeded_identical"]) == (4, 2)
    assert rec["throughput"]["decode_tok_s"] > 0


def test_serve_flag_reaches_the_runner():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import serve

    a = serve.parse_args(["--batch-invariant", "--num-blocks", "8", "--max-num-tokens", "32", "--max-model-len", "64"])
    r = serve.build_runner(a)
    assert r.batch_invariant and r.token_buckets == (32,) and r.key_block_buckets == (r.max_blocks,)
    assert not serve.parse_args([]).batch_invariant
