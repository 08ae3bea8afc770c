"""Serving on a device mesh (jds.sharding): sharded runners give the single-device logits and greedy tokens.

The mesh runs on 4 virtual CPU devices in a subprocess (``jax_num_cpu_devices`` must be set before the
backend starts, and this pytest process has already started it). Numerics are float32 without quantisation,
so a sharded step differs from one device only by the reduction order of the split contractions (the
all-reduce after ``wo`` / ``w2``, the vocabulary-split head): the logits are compared with a float32
reduction-order bound and the greedy tokens exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from jds import sharding
from jds.config import Numerics, RunnerConfig, preset, replace
from jds.model import Decoder
from jds.runner import BoundaryRunner

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 4
# float32 logits whose inputs are contractions of up to ~1k terms summed in another order: a few ulps of the
# largest logit at most (seen: about 1e-6 of it)
RTOL = 2e-5


def _config(arch: str, moe: bool):
    cfg = dataclasses.replace(preset(f"{arch}-tiny"), numerics=Numerics.exact())
    if moe:
        cfg = dataclasses.replace(cfg, n_routed_experts=4, moe_topk=2)
    return cfg


def _compiled(runner: BoundaryRunner) -> int:
    return sum(f._cache_size() for f in runner._jits.values())


def _rollout(arch: str, moe: bool, mode: str, settings: dict, warm: bool = False) -> tuple[list, list]:
    from tests.test_runner import greedy_rollout

    rng = np.random.default_rng(0)
    lens = [40, 23, 9] if arch == "v32" else [300, 140, 17]
    prompts = [rng.integers(0, 256, n) for n in lens]
    bt = rng.permutation(24)[:15].reshape(3, 5).astype(np.int32)
    runner = BoundaryRunner(Decoder(_config(arch, moe), seed=0), mode=mode, num_blocks=24, max_num_seqs=4,
                            max_num_tokens=512, max_model_len=640 if arch == "v4" else 256, **settings)
    if runner.mesh is not None:  # the placement really is split as the rules say
        shardings = {str(leaf.sharding.spec) for leaf in runner._whole[1]}
        assert len(shardings) > 1 or settings.get("data_parallel", 1) > 1, shardings
    # after warm-up, steps compile nothing more: the placed layouts are the ones the steps return (not yet
    # true of a data-only mesh, where XLA reports replicated outputs as P(None, None) against the placed P():
    # one more compile per bucket on its second use; see docs/DESIGN.md)
    if warm:
        runner.warmup()
        compiled = _compiled(runner)
    logits, toks = greedy_rollout(runner, prompts, steps=2, block_tables=bt)
    if warm:
        assert _compiled(runner) == compiled, (compiled, _compiled(runner))
    if runner.mesh is not None:  # the pools stay in their layout step after step (pinned in the executables)
        want = P("data") if settings.get("data_parallel", 1) > 1 else P()
        for leaf in jax.tree.leaves(runner.caches):
            if leaf.size == 0:  # a V4 layer kind's absent cache: no pages, XLA lays it out as it likes
                continue
            assert leaf.sharding.mesh.shape == runner.mesh.shape and leaf.sharding.is_equivalent_to(
                NamedSharding(runner.mesh, want), leaf.ndim), (leaf.sharding, want)
    return logits, toks


def _worker(cases: list[dict]) -> None:
    """Subprocess entry: compare each case with the single-device fused runner; print one JSON line per case."""
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    refs: dict = {}
    for c in cases:
        key = (c["arch"], c["moe"])
        if key not in refs:
            refs[key] = _rollout(c["arch"], c["moe"], "fused", {})
        ref_logits, ref_toks = refs[key]
        logits, toks = _rollout(c["arch"], c["moe"], c["mode"], c["settings"], c.get("warm", False))
        scale = max(float(np.abs(b).max()) for b in ref_logits)
        err = max(float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits))
        print(json.dumps({"case": c, "tokens_equal": toks == ref_toks, "rel_err": err / scale}), flush=True)


def _run(cases: list[dict]) -> list[dict]:
    code = f"import json; from tests.test_sharding import _worker; _worker(json.loads({json.dumps(json.dumps(cases))}))"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(out) == len(cases), proc.stdout[-2000:]
    return out


def _check(results: list[dict]) -> None:
    for r in results:
        print(r)
        assert r["tokens_equal"], f"greedy tokens differ: {r['case']}"
        assert r["rel_err"] <= RTOL, f"logits differ by {r['rel_err']:.2e} of the largest: {r['case']}"


def _case(arch: str, mode: str, moe: bool = False, warm: bool = False, **settings: object) -> dict:
    return {"arch": arch, "moe": moe, "mode": mode, "settings": settings, "warm": warm}


def test_sharded_equals_one_device() -> None:
    """The quick set: dp x tp fused in two segments, after warm-up (the eager regions of narrow / wide: the slow
    test_v32_every_mode_and_layout_equals_one_device; the MoE layouts: test_moe_expert_parallel_equals_one_device
    and test_v4_sharded_equals_one_device)."""
    # two buckets: warm-up compiles every bucket's segments, and the rollout uses one prefill and one decode bucket
    _check(_run([_case("v32", "fused", tensor_parallel=2, data_parallel=2, segments=2, warm=True,
                       token_buckets=(16, 512), key_block_buckets=(16,))]))


@pytest.mark.slow
def test_v32_every_mode_and_layout_equals_one_device() -> None:
    """Every boundary mode at tp=2 (narrow after warm-up), and tp=4, dp=2 in both kinds of input prep."""
    cases = [_case("v32", m, tensor_parallel=2, warm=m == "narrow") for m in ("wide", "narrow", "fused")]
    cases += [_case("v32", m, tensor_parallel=4) for m in ("wide", "narrow", "fused")]
    cases += [_case("v32", m, data_parallel=2) for m in ("wide", "narrow", "fused")]
    cases += [_case("v32", "wide", input_prep="device", tensor_parallel=2, data_parallel=2)]
    _check(_run(cases))


@pytest.mark.slow
def test_moe_expert_parallel_equals_one_device() -> None:
    """Routed experts over the expert axis (with and without tensor-split expert widths), every mode."""
    cases = [_case("v32", "fused", moe=True, expert_parallel=2, tensor_parallel=2),
             _case("v32", "fused", moe=True, expert_parallel=2),
             _case("v32", "narrow", moe=True, expert_parallel=2, tensor_parallel=2),
             _case("v32", "wide", moe=True, expert_parallel=4)]
    _check(_run(cases))


@pytest.mark.slow
def test_v4_sharded_equals_one_device() -> None:
    cases = [_case("v4", m, tensor_parallel=2) for m in ("wide", "narrow", "fused")]
    cases += [_case("v4", "narrow", tensor_parallel=4), _case("v4", "fused", data_parallel=2),
              _case("v4", "fused", data_parallel=2, tensor_parallel=2, warm=True),
              _case("v4", "fused", moe=True, expert_parallel=2, tensor_parallel=2)]
    _check(_run(cases))


# ----- in-process checks (one device is enough: they fail before a mesh is built) ---------------------
def test_parallel_settings_are_validated() -> None:
    for field in ("tensor_parallel", "data_parallel", "expert_parallel"):
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match=field):
                RunnerConfig(**{field: bad})


@pytest.mark.parametrize("settings, field", [
    ({"tensor_parallel": 3}, "tensor_parallel"),  # 4 heads
    ({"expert_parallel": 2}, "expert_parallel"),  # a dense model
    ({"data_parallel": 5}, "num_blocks"),  # 24 pages
    ({"data_parallel": 2, "token_buckets": (3,)}, "token_buckets"),
    ({"tensor_parallel": 2, "data_parallel": 2, "expert_parallel": 1, "num_blocks": 64}, "devices"),
])
def test_indivisible_or_unavailable_layouts_are_refused(settings: dict, field: str) -> None:
    cfg = _config("v32", moe=False)
    with pytest.raises(ValueError, match=field):
        BoundaryRunner(Decoder(cfg, seed=0), mode="fused", num_blocks=settings.pop("num_blocks", 24),
                       max_num_seqs=4, max_num_tokens=64, max_model_len=256, **settings)


def test_moe_indivisible_experts_are_refused() -> None:
    cfg = _config("v32", moe=True)  # 4 experts
    with pytest.raises(ValueError, match="expert_parallel"):
        sharding.check_divisible(cfg, RunnerConfig(expert_parallel=3))


def test_partition_rules() -> None:
    """Heads over tensor (rows of wq_b / wkv_b, columns of wo), MLP and expert splits, the indexer whole."""
    mesh = AbstractMesh((1, 2, 2), sharding.AXES)
    cfg = _config("v32", moe=True)
    spec = lambda path, shape: sharding.param_spec(path, shape, cfg, mesh)  # noqa: E731
    assert spec("layers/0/attn/wq_b/weight/value", (768, 256)) == P("tensor", None)
    assert spec("layers/1/attn/wkv_b/weight/value", (1024, 512)) == P("tensor", None)
    # the runner's held W_UK / W_UV [2, H, 128, kv_lora] (jds.v32.AbsorbedHeads): heads, as wkv_b's rows
    assert spec("layers/1/attn/absorbed/value", (2, 4, 128, 512)) == P(None, "tensor", None, None)
    assert spec("layers/0/attn/wo/weight/value", (256, 512)) == P(None, "tensor")
    assert spec("layers/0/attn/wo/scale/value", (2, 3)) == P(None, None)  # 3 scale columns do not split
    assert spec("layers/0/attn/indexer/wq_b/weight/value", (512, 256)) == P(None, None)
    assert spec("layers/0/attn/wkv_a/weight/value", (576, 256)) == P(None, None)
    assert spec("layers/0/ffn/w1/value", (4, 256, 256)) == P("expert", None, "tensor")
    assert spec("layers/0/ffn/w2/value", (4, 256, 256)) == P("expert", "tensor", None)
    assert spec("layers/0/ffn/shared/w2/weight/value", (256, 256)) == P(None, "tensor")
    # the V4 block stores routed experts [E, out, in]: the width is dim 1 of w1 / w3 and dim 2 of w2, also for the
    # FP4 codes [E, out, in/2] and their e8m0 scales [E, out, in/32]
    v4m = dataclasses.replace(_config("v4", moe=True), block="v4")
    for name in ("w1/value", "w3/weight/value", "w1/scale/value"):
        assert sharding.param_spec(f"layers/0/ffn/{name}", (4, 256, 64), v4m, mesh) == P("expert", "tensor", None)
    assert sharding.param_spec("layers/0/ffn/w2/weight/value", (4, 256, 128), v4m, mesh) == P("expert", None, "tensor")
    assert spec("layers/0/ffn/gate/weight/value", (4, 256)) == P(None, None)
    assert spec("embed/weight/value", (512, 256)) == P("tensor", None)
    assert spec("layers/0/attn_norm/weight/value", (256,)) == P(None)
    v4 = _config("v4", moe=False)  # o_groups=2: wo_a splits by groups at tp=2, stays whole at tp=4
    assert sharding.param_spec("layers/0/attn/wo_a/weight/value", (256, 1024), v4, mesh) == P("tensor", None)
    wide = AbstractMesh((1, 4, 1), sharding.AXES)
    assert sharding.param_spec("layers/0/attn/wo_a/weight/value", (256, 1024), v4, wide) == P(None, None)
    assert sharding.param_spec("layers/0/attn/attn_sink/value", (4,), v4, wide) == P("tensor")


def test_one_device_config_builds_no_mesh() -> None:
    r = BoundaryRunner(Decoder(_config("v32", moe=False), seed=0), RunnerConfig(mode="fused", num_blocks=8,
                       max_num_seqs=2, max_num_tokens=16, max_model_len=64))
    assert r.mesh is None
    assert replace(r.config, tensor_parallel=1).tensor_parallel == 1


@pytest.mark.slow
def test_sharded_server_answers(tmp_path, monkeypatch) -> None:
    """``serve.py --tensor-parallel-size 2 --data-parallel-size 2`` on 4 virtual CPU devices serves a request."""
    import httpx

    from tests.test_serve_model_dir import _start, _stop

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    argv = ["--preset", "v32-tiny", "--mode", "fused", "--tensor-parallel-size", "2", "--data-parallel-size", "2",
            "--num-blocks", "16", "--max-num-seqs", "2", "--max-num-tokens", "64", "--max-model-len", "128"]
    proc, base = _start(argv, tmp_path / "serve.log")
    try:
        body = {"model": "jds-v32-tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        _stop(proc)


def test_serve_flags_reach_the_runner_config() -> None:
    from tests.test_serve_model_dir import SERVE

    a = SERVE.parse_args(["--tensor-parallel-size", "2", "--data-parallel-size", "4", "--expert-parallel-size", "8"])
    cfg = SERVE.runner_config(a)
    assert (cfg.tensor_parallel, cfg.data_parallel, cfg.expert_parallel) == (2, 4, 8)
    assert SERVE.runner_config(SERVE.parse_args([])).tensor_parallel == 1


def test_bench_flags_reach_the_runner_config(monkeypatch) -> None:
    """The benches hand --tensor-parallel / --data-parallel / --expert-parallel to make_runner."""
    import jds.bench.stack as stack
    from jds.bench import ttft

    seen: dict = {}

    def fake_time_variant(model, mode, prep, segments, n, moe=False, parallel=None, shape="ttft_128", **flags):
        seen.update(parallel)
        return {}

    monkeypatch.setattr(stack, "build_stack", lambda *a, **k: None)
    monkeypatch.setattr(ttft, "time_variant", fake_time_variant)
    ttft.main(["--size", "tiny", "--tensor-parallel", "2", "--expert-parallel", "4", "--variants", "fused:host",
               "--out", os.devnull])
    assert seen == {"tensor_parallel": 2, "data_parallel": 1, "expert_parallel": 4}
