"""On a GPU: the captured segments really run as CUDA graphs (kCommandBuffer in the thunk dump), the
eager regions run as direct launches, and narrow issues fewer direct launches per step than wide.

The dump is the runner's own (``--dump`` -> ``RunnerConfig.dump_dir`` -> every executable's ``xla_dump_to``
option): the child process gets no ``--xla_dump_to`` in ``XLA_FLAGS``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_command_buffers_and_direct_launches(tmp_path) -> None:
    out = tmp_path / "dump.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_boundary.py"), "--arch", "v32", "v4",
                    "--layers", "4", "--dump", str(tmp_path / "xla"), "--out", str(out)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": " ".join(
                       f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_dump_to"))})
    res = json.loads(out.read_text())["archs"]
    if os.environ.get("JDS_GPU_OUT"):  # keep the evidence (device runs copy this dir back)
        (Path(os.environ["JDS_GPU_OUT"]) / "thunk_counts.json").write_text(out.read_text())
        names = sorted(p.name for p in (tmp_path / "xla").iterdir() if "thunk_sequence" in p.name)
        (Path(os.environ["JDS_GPU_OUT"]) / "thunk_files.txt").write_text("\n".join(names) + "\n")
    problems = []
    for arch, modes in res.items():
        for mode, r in modes.items():
            mods = r["modules"]
            captured = {k: v for k, v in mods.items() if any(t in k for t in ("jit_first", "jit_mid", "jit_last", "jit_full"))}
            eager = {k: v for k, v in mods.items() if "consume" in k}
            if not captured:
                problems.append(f"{arch}/{mode}: no captured modules in the dump")
            for k, v in captured.items():
                if not (v["command_buffers"] >= 1 and v["in_graphs"] > 0):
                    problems.append(f"{arch}/{mode}/{k} not captured: {v}")
            for k, v in eager.items():
                if v["command_buffers"] != 0:
                    problems.append(f"{arch}/{mode}/{k}: eager region was captured: {v}")
        if not modes["narrow"]["direct_launches_per_step"] < modes["wide"]["direct_launches_per_step"]:
            problems.append(f"{arch}: narrow does not launch fewer kernels directly than wide")
        if not modes["fused"]["direct_launches_per_step"] <= 3:
            problems.append(f"{arch}: fused launches {modes['fused']['direct_launches_per_step']} directly")
    assert not problems, "\n".join(problems)
