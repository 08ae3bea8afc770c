"""The grouped expert GEMM benchmark's quick run (both formats, kernel in interpret mode): every row runs and
matches the float64 reference to bf16 output rounding."""

import json

import pytest

from jds.bench import kernels_grouped


@pytest.mark.slow  # about 35 s a format on 2 cores (ceilings, interpret-mode kernel timing)
@pytest.mark.parametrize("fmt", sorted(kernels_grouped.FORMATS))
def test_quick_run(tmp_path, fmt: str) -> None:
    out = tmp_path / "r.json"
    kernels_grouped.main(["--quick", "--tokens", "4", "--out", str(out)], fmt=fmt)
    d = json.loads(out.read_text())
    assert d["meta"]["complete"] and d["meta"]["command"].startswith(f"python -m jds.bench.kernels_{fmt}_grouped")
    rows = d["rows"]
    want = {"pallas", "xla"} | ({"pallas[x=e4m3]"} if fmt == "fp4" else set())
    assert {r["impl"] for r in rows} == want and not [r for r in rows if "error" in r]
    assert all(r["kernel"] == f"{fmt}_grouped" and r["err_abssum_max"] < 2.0 ** -8 for r in rows)
