"""jds.bench.boundary (through its scripts/bench_boundary.py entry point) end to end on the CPU at tiny sizes:
the parallel precompile into the persistent compilation cache, then the timed modes, the JSON and the ratios
(the GPU runs the same code at real dims, so a break here would otherwise first show in device time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a whole bench run; the boundary modes are covered by tests/test_runner.py
def test_tiny_precompiled_run(tmp_path) -> None:
    out = tmp_path / "b.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_boundary.py"), "--arch", "v32",
                    "--size", "tiny", "--layers", "2", "--intermediate", "64", "--ctx", "128", "--quick",
                    "--precompile", "--modes", "wide", "narrow", "--out", str(out)],
                   check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=900,
                   capture_output=True)
    res = json.loads(out.read_text())
    pre = res["meta"]["precompile"]
    assert set(pre) == {"v32/wide", "v32/narrow"} and all(v["rc"] == 0 for v in pre.values()), pre
    modes = res["archs"]["v32"]["modes"]
    for mode in ("wide", "narrow"):
        assert modes[mode]["ttft_128"]["n"] == 30 and modes[mode]["ttft_128"]["mean_ms"] > 0
        assert modes[mode]["dispatches_per_step"] == {"captured": 3, "eager": 2}
    assert set(res["archs"]["v32"]["ratios"]) >= {"narrow/wide_ttft_128", "narrow/wide_decode_b64_ctx128"}


def test_launches_per_step_counts_each_layer_kind() -> None:
    """Mixed layer kinds (V4: window-only, C4, C128) each use their own eager executable's launch count."""
    from jds.bench.boundary import launches_per_step

    def m(n: int) -> dict:
        return {"direct_launches": n}

    mods = {"module_10.jit_first": m(1), "module_20.jit_consume": m(7), "module_30.jit_mid": m(1),
            "module_40.jit_mid": m(1), "module_50.jit_consume": m(20), "module_60.jit_mid": m(1),
            "module_70.jit_consume": m(8), "module_80.jit_last": m(1)}
    # swa->swa, swa->c4, c4->c128: three transitions, each compiled once
    assert launches_per_step(mods, ["swa", "swa", "c4", "c128"], "narrow") == 1 + 7 + 7 + 20 + 8 + 3 + 1
    assert launches_per_step({"module_1.jit_full": m(1)}, ["swa"], "fused") == 1
