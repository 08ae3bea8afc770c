"""On a GPU: the captured segments really run as CUDA graphs (kCommandBuffer in the thunk dump), the
eager regions run as direct launches, and narrow issues fewer direct launches per step than wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_command_buffers_and_direct_launches(tmp_path) -> None:
    out = tmp_path / "dump.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_boundary.py"), "--arch", "v32", "v4",
                    "--layers", "4", "--dump", str(tmp_path / "xla"), "--out", str(out)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT})
    res = json.loads(out.read_text())["archs"]
    for arch, modes in res.items():
        for mode, r in modes.items():
            mods = r["modules"]
            captured = {k: v for k, v in mods.items() if any(t in k for t in ("jit_first", "jit_mid", "jit_last", "jit_full"))}
            eager = {k: v for k, v in mods.items() if "consume" in k}
            assert captured, f"{arch}/{mode}: no captured modules in the dump"
            for k, v in captured.items():
                assert v["command_buffers"] >= 1 and v["in_graphs"] > 0, f"{arch}/{mode}/{k} not captured: {v}"
            for k, v in eager.items():
                assert v["command_buffers"] == 0, f"{arch}/{mode}/{k}: eager region was captured"
        assert modes["narrow"]["direct_launches_per_step"] < modes["wide"]["direct_launches_per_step"], arch
        assert modes["fused"]["direct_launches_per_step"] <= 3, arch
