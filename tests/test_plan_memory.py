"""``scripts/plan_memory.py``: the per-device weight bytes it derives from abstract shapes equal what the runner
really places on one device of a mesh (4 virtual CPU devices, a tiny MoE model, FP8 linears), and its page
bytes equal the runner's page pools; the DeepSeek-V3.2 plan runs from abstract shapes alone."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jds.bench import plan_memory
from jds.bench.plan_memory import model_config, deepseek_v32, kv_bytes, main, weight_bytes
from jds.config import Numerics, preset

ROOT = Path(__file__).resolve().parents[1]

PLACED = """
import dataclasses, json, sys
import jax
import numpy as np
from flax import nnx
from jds.config import Numerics, RunnerConfig, preset
from jds.model import Decoder
from jds.runner import BoundaryRunner
dp, tp, ep = (int(v) for v in sys.argv[1:4])
cfg = dataclasses.replace(preset("v32-tiny"), numerics=Numerics.reference(), n_routed_experts=4, moe_topk=2,
                          moe_intermediate_size=256)
# the bytes placed depend on the parameters' shapes, dtypes and paths, not their values: the model's own init traced
# (nnx.eval_shape) and its parameters zeros, instead of a fresh process's eager init (each op compiled: most of
# this test's time)
gd, st = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, seed=0)))
model = nnx.merge(gd, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), st))
r = BoundaryRunner(model, RunnerConfig(mode="fused", num_blocks=8, max_num_seqs=2, max_num_tokens=32,
                   max_model_len=64, tensor_parallel=tp, data_parallel=dp, expert_parallel=ep))
dev = jax.devices()[0]
def on_dev(tree):
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev)
print(json.dumps({"weights": on_dev(nnx.state(r._served)), "caches": on_dev(r.caches)}))
"""


def _cfg():
    return dataclasses.replace(preset("v32-tiny"), numerics=Numerics.reference(), n_routed_experts=4, moe_topk=2,
                               moe_intermediate_size=256)


def test_plan_equals_the_runner_placement() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip())
    for dp, tp, ep in ((2, 2, 1),):  # (1, 2, 2): tests/test_restore_sharded.py checks the plan there too
        p = subprocess.run([sys.executable, "-c", PLACED, str(dp), str(tp), str(ep)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        placed = json.loads(p.stdout.strip().splitlines()[-1])
        assert weight_bytes(_cfg(), dp, tp, ep)["total"] == placed["weights"], (dp, tp, ep)
        # 8 pages in all, split over data: the plan's per-page bytes times the device's share
        per_page = kv_bytes(_cfg(), 1, 1, _cfg().block_size)["bytes_per_page_all_layers"]
        assert per_page * 8 / dp == placed["caches"]


def test_deepseek_v32_plan_from_abstract_shapes(capsys, monkeypatch) -> None:
    # the plan traces the 61-layer model twice (weights, then pages) for the same config: once is enough here
    # (``_abstract`` is a pure function of the config; both consumers still read the abstract model)
    monkeypatch.setattr(plan_memory, "_abstract", functools.lru_cache(maxsize=None)(plan_memory._abstract))
    res = main(["--tp", "8", "--ep", "1", "--batch", "64", "--context", "8192"])
    out = capsys.readouterr().out
    assert "8 devices" in out and ("fits" in out)
    cfg = deepseek_v32()
    a = cfg.attn
    # the page pools: 64 x 8192 tokens x 61 layers x (656-byte MLA + 132-byte indexer record), whole per device
    assert res["kv"]["total"] == 64 * 8192 * cfg.n_layers * (656 + 132)
    # the routed experts as the checkpoint stores them: e4m3 plus a float32 scale per 128 x 128 block, split 8-way
    # over tensor (their width)
    h, f = a.hidden_size, cfg.moe_intermediate_size
    experts = cfg.n_layers * cfg.n_routed_experts * 3 * (h * f + (h // 128) * (f // 128) * 4) / 8
    assert res["weights"]["routed experts"] == experts and "routed experts fp8" in out
    deq = model_config(None, dequantize=True).numerics  # --dequantize: every weight bf16 (as the import)
    assert not deq.fp8_linear and not deq.experts_fp8


def test_flag_errors_are_one_line(tmp_path, capsys) -> None:
    """A zero or negative size was planned (negative bytes, "fits"), --tp 0 and a mesh that does not divide the
    model were tracebacks, as was an unreadable --config; now each is one argparse error line, exit 2."""
    from jds.hf_import import hf_config_dict

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(_cfg())))  # 4 heads, 4 routed experts
    cfg = ["--config", str(tmp_path / "config.json"), "--tp", "1", "--ep", "1"]
    cases = [
        (["--tp", "0"], "argument --tp: must be >= 1, got 0"),
        (["--batch", "-4"], "argument --batch: must be >= 1, got -4"),
        (["--context", "0"], "argument --context: must be >= 1"),
        (["--dp", "0"], "argument --dp: must be >= 1"),
        (["--max-num-tokens", "-1"], "argument --max-num-tokens: must be >= 1"),
        (["--hbm-gib", "nan"], "argument --hbm-gib: must be a finite number > 0"),
        (["--config", str(tmp_path / "missing.json")], "missing.json': cannot read it as JSON"),
        ([*cfg, "--tp", "3"], "tensor_parallel: 3 does not divide the 4 attention heads"),
        ([*cfg, "--ep", "3"], "expert_parallel: 3"),
    ]
    for argv, pattern in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and ": error:" in err and pattern in err and "Traceback" not in err, (argv, err)
    res = main([*cfg, "--batch", "2", "--context", "128", "--max-num-tokens", "64"])
    assert res["per_device_total"] > 0 and "fits" in capsys.readouterr().out
