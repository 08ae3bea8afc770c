"""jds.bench.probe_graph_updates (``python -m``) end to end on the CPU at tiny size: one process per variant (XLA flags
included), every row written, so the H200 run does not first break in device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a whole probe script run; the graph-update modes are covered by tests/test_runner.py
def test_probe_tiny(tmp_path) -> None:
    out = tmp_path / "p.json"
    subprocess.run([sys.executable, "-m", "jds.bench.probe_graph_updates", "--size", "tiny",
                    "--layers", "1", "--n", "2", "--modes", "fused", "--variants", "base", "skip_profiled",
                    "--out", str(out)], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=900,
                   capture_output=True)
    res = json.loads(out.read_text())["variants"]
    assert res["base"]["rc"] == 0 and res["skip_profiled"]["rc"] == 0
    assert "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED" in res["skip_profiled"]["xla_flags"]
    assert set(res["base"]["modes"]["fused"]) == {"fresh_inputs", "same_inputs", "stable_buffers",
                                                  "no_graph_fresh_inputs", "no_graph_same_inputs",
                                                  "fusion_only_fresh_inputs", "fusion_only_same_inputs"}
    assert set(res["skip_profiled"]["modes"]["fused"]) == {"fresh_inputs", "same_inputs", "stable_buffers"}
    assert all(r["enqueue_ms_median"] > 0 for r in res["base"]["modes"]["fused"].values())
    assert res["base"]["modes"]["fused"]["fresh_inputs"]["prepare_ms_median"] > 0  # fresh rows time preparing too
