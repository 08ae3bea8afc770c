"""The end-to-end driver (jds.bench.serve_modes) against serve.py's fake runner: every mode and
concurrency is measured and tabulated, and a server that cannot start is recorded, not fatal."""

from __future__ import annotations

import json

import pytest

from jds.bench import serve_modes as bench_serve_modes


@pytest.mark.parametrize("parallel", [False, True])
def test_all_modes_measured(tmp_path, parallel: bool) -> None:
    out = tmp_path / "serve.json"
    res = bench_serve_modes.main(["--num-prompts", "12", "--num-warmups", "1", "--concurrency", "1", "4",
                                  "--out", str(out)] + (["--parallel-startup"] if parallel else [])
                                 + ["--", "--runner", "fake"])
    runs = json.loads(out.read_text())["runs"]
    assert [r["mode"] for r in runs] == ["wide", "narrow", "fused"]
    for r in runs:
        assert "error" not in r, r
        for c in (1, 4):
            s = r[f"c{c}"]
            assert s["completed"] == 12 and s["failed"] == 0 and s["max_concurrency"] == c
            assert s["total_output_tokens"] == 12 and s["mean_ttft_ms"] > 0
    assert res["table"].count("\n") == 2 + 6 - 1


def test_failed_server_is_recorded(tmp_path) -> None:
    """A server refusing its flags is recorded as an error; the other mode still runs (parallel start)."""
    out = tmp_path / "serve.json"
    res = bench_serve_modes.main(["--modes", "narrow", "--num-prompts", "2", "--startup-timeout", "60",
                                  "--out", str(out), "--", "--runner", "fake", "--max-model-len", "-5"])
    (run,) = res["runs"]
    assert "error" in run and "exited" in run["error"]
    assert "error" in res["table"]
