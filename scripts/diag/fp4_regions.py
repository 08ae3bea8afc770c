"""Where an FP4 grouped GEMM CTA (e4m3-x route) spends its time: Mosaic GPU's in-kernel profiler over the kernel's
named regions, per warpgroup: each work unit (``unit``: the producer's TMA issue loop, or a compute warpgroup's
steps, waits and store), inside it the compute warpgroups' ``step`` bodies (conversion, MMAs, promotion) and
``store``. A compute warpgroup's ``unit`` time minus its ``step`` and ``store`` time is time spent waiting for data.

    python scripts/diag/fp4_regions.py [--cases w1:1 w1:8] [--variants '[{}, {"split_k": 2}]'] [--out F]

Why: at 1 token the kernel streams 57% of the copy bandwidth, one-step units cost about 1.7 µs more each than
two-step ones, and neither four compute warpgroups nor a deeper ring helped (docs/perf-log.md, twenty-fourth
session): the GPU timeline and Nsight Compute see only the kernel as a whole. Native only.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp4_tiles_time import _case  # noqa: E402
from mqa_regions import summarize  # noqa: E402

from jds.bench.results import case_variant_rows  # noqa: E402


def _measure(shape: str, tokens: int, tiles: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        fn, args = _case(shape, tokens, 1, {**tiles, "profile_dir": d})
        for _ in range(3):  # compile, warm up; the last call's trace is read
            jax.block_until_ready(fn(*args))
        traces = sorted(glob.glob(os.path.join(d, "*-trace.json")), key=os.path.getmtime)
        if not traces:
            raise RuntimeError(f"no trace written under {d}")
        with open(traces[-1]) as fh:
            events = json.load(fh)["traceEvents"]
    # traces per CTA: a compute warpgroup per 64 weight rows (the route's default tiles are 128 rows), the producer
    return summarize(events, traces_per_cta=tiles.get("block_n", 128) // 64 + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["w1:1", "w1:8"], help="shape:tokens")
    ap.add_argument("--variants", default='[{}, {"split_k": 2}, {"split_k": 8}]', help="JSON list of tile dicts")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    case_variant_rows(a.cases, json.loads(a.variants), _measure, a.out, "fp4_regions")


if __name__ == "__main__":
    main()
