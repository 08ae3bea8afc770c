"""Checkpoint loading straight into shards (``jds.checkpoint.restore_sharded``, used by ``ModelRunner.build``
with a parallel RunnerConfig): on 4 virtual CPU devices, every parameter equals the unsharded restore bit for
bit, only fused parameters pass through a host buffer, carries the runner's partition spec, each device holds the bytes ``plan_memory`` predicts, and a sharded
runner built from the checkpoint gives the unsharded runner's logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import dataclasses, json, sys, tempfile
import jax, numpy as np
from flax import nnx
from jds import sharding
from jds.bench.plan_memory import weight_bytes
from jds.batch import Chunk
from jds.checkpoint import restore_model, restore_sharded, save_checkpoint
from jds.config import Numerics, RunnerConfig, preset
from jds.model import Decoder
from jds.runner import ModelRunner
out = {}
for name in sys.argv[1:]:
    cfg = dataclasses.replace(preset(name), numerics=Numerics.reference(), n_routed_experts=4, moe_topk=2,
                              moe_intermediate_size=256)
    d = tempfile.mkdtemp() + "/ck"
    save_checkpoint(Decoder(cfg, seed=3), d)
    rc = RunnerConfig(mode="fused", num_blocks=8, max_num_seqs=2, max_num_tokens=32, max_model_len=64,
                      tensor_parallel=2, expert_parallel=2)
    mesh = sharding.make_mesh(rc)
    ticks, via_host = [], []
    _cb = jax.make_array_from_callback
    jax.make_array_from_callback = lambda *a, **k: via_host.append(a[0]) or _cb(*a, **k)
    got = restore_sharded(d, mesh, progress=lambda i, n: ticks.append((i, n)))
    jax.make_array_from_callback = _cb
    from jds.nn import _param_paths
    fused = {id(getattr(o, at)) for o, at, rows in _param_paths(got).values() if rows is not None}
    ref = restore_model(d)
    fa = jax.tree_util.tree_flatten_with_path(nnx.state(ref))[0]
    fb = jax.tree_util.tree_flatten_with_path(nnx.state(got))[0]
    same = all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)) for (_, x), (_, y) in zip(fa, fb))
    specs = all(y.sharding.spec == sharding.param_spec(jax.tree_util.keystr(k, simple=True, separator="/"),
                tuple(y.shape), cfg, mesh) for k, y in fb)
    dev = jax.devices()[0]
    on_dev = sum(s.data.nbytes for _, y in fb for s in y.addressable_shards if s.device == dev)
    a = ModelRunner.build(checkpoint=d, runner=dataclasses.replace(rc, tensor_parallel=1, expert_parallel=1))
    b = ModelRunner.build(checkpoint=d, runner=rc)
    bt = (np.arange(2 * a.max_blocks, dtype=np.int32) % 8).reshape(2, -1)
    ids = np.arange(1, 11, dtype=np.int32)
    la = a.execute(ids, [Chunk(0, 0, 6), Chunk(1, 0, 4)], bt)
    lb = b.execute(ids, [Chunk(0, 0, 6), Chunk(1, 0, 4)], bt)
    # what the sharded runner holds: the restored parameters and what it derives from them once (V3.2's W_UK / W_UV)
    served = sum(s.data.nbytes for y in jax.tree.leaves(nnx.state(b._served)) for s in y.addressable_shards
                 if s.device == dev)
    out[name] = {"same": same, "specs": specs, "on_dev": on_dev, "served": served,
                 "plan": weight_bytes(cfg, 1, 2, 2)["total"],
                 "ticks": ticks[-1], "via_host": len(via_host), "fused": len(fused), "n_ticks": len(ticks), "logit_err": float(np.abs(la - lb).max()),
                 "logit_scale": float(np.abs(la).max()), "sharded": len(b.model.embed.weight[...].sharding.device_set)}
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", ["v32-tiny", pytest.param("v4-tiny", marks=pytest.mark.slow)])
def test_restore_into_shards(name: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip())
    p = subprocess.run([sys.executable, "-c", WORKER, name], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        assert r["same"] and r["specs"], name
        assert r["served"] == r["plan"] and r["on_dev"] <= r["served"], (name, r["on_dev"], r["served"], r["plan"])
        assert r["ticks"][0] == r["ticks"][1] == r["n_ticks"]  # one progress call per tensor
        # only fused parameters (several stored tensors, one GEMM) pass through the host; every other one is
        # restored by orbax straight into its shards
        assert r["via_host"] == r["fused"] and r["fused"] < r["n_ticks"] // 4, (name, r["via_host"], r["fused"])
        assert r["sharded"] == 4  # the runner's parameters span the mesh
        # one device vs an SPMD-partitioned step in FP8 numerics: another summation order can move a value
        # across an e4m3 step (2^-3 of it) where activations are re-quantised, and that propagates (V4 measured
        # 2.2% of max|logit| here); exact equality of sharded and one-device steps is tests/test_sharding.py's
        assert r["logit_err"] <= 5e-2 * r["logit_scale"], (name, r["logit_err"], r["logit_scale"])
