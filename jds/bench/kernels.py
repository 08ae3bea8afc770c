"""Kernel benchmarks (issues 6-8): each kernel against its XLA implementation in the same run, with
achieved bandwidth / FLOP/s as fractions of the ceilings measured in the same run.

    python -m jds.bench.kernels [--only fused_insert sparse_indexer sparse_mqa] [--quick] --out FILE.json

Each kernel module ``jds/bench/kernels_<name>.py`` provides ``benchmark(quick: bool) -> Iterator[dict]``
whose rows hold at least: kernel, case, impl ("pallas" | "xla"), median_us, bytes, flops.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys

from jds.bench.results import write_json

KERNELS = ("fused_insert", "sparse_indexer", "sparse_mqa", "fp8_gemm")


def _fractions(r: dict, time_key: str, prefix: str, ceil: dict) -> None:
    """Bytes/s and FLOP/s of row ``r`` at its ``time_key`` time, as fractions of the measured ceilings."""
    t = r[time_key] * 1e-6 if r.get(time_key) else None
    r[prefix + "bandwidth_frac"] = r["bytes"] / t / ceil["copy_bytes_per_s"] if t and r.get("bytes") else None
    r[prefix + "flops_frac"] = r["flops"] / t / ceil["bf16_flops_per_s"] if t and r.get("flops") else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", nargs="+", default=None, help="only these case names (modules that support it)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import jax

    from jds.bench.timing import measure_ceilings, measure_floors

    ceil = measure_ceilings(a.quick)
    cmd = " ".join(["python -m jds.bench.kernels"] + (sys.argv[1:] if argv is None else argv))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "command": cmd, **ceil,
            # what each device-time method reads for a trivial call
            "device_time_floors_us": measure_floors(a.quick), "complete": False}
    rows = []
    for name in a.only:
        mod = importlib.import_module(f"jds.bench.kernels_{name}")
        for r in mod.benchmark(a.quick, **({"cases": a.cases} if a.cases else {})):
            _fractions(r, "median_us", "", ceil)  # absent on a row that records an error
            if r.get("device_unrolled_us"):  # device time alone (timing.device_row)
                _fractions(r, "device_unrolled_us", "device_unrolled_", ceil)
            if r.get("profile_span_us"):  # device time per call from the GPU's timeline (timing.profiled_device_us)
                _fractions(r, "profile_span_us", "profile_", ceil)
            rows.append(r)
            print(json.dumps(r), flush=True)
            write_json(a.out, {"meta": meta, "rows": rows})  # after every row: a cut-short run keeps them
    write_json(a.out, {"meta": {**meta, "complete": True}, "rows": rows})


if __name__ == "__main__":
    main()
