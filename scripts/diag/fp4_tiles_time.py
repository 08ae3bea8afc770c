"""The FP4 grouped GEMM's tile variants on the GPU timeline: per (case, variant) the call's device span, its
busy time and each kernel's median, one process, no profiler in the way (Nsight Compute's sweep serialises
and can hang a call when a variant deadlocks; each row here is timed in the order given and printed as it ends).

    python3 scripts/diag/fp4_tiles_time.py --cases w1:1 w1:8 w2:8 w1:64 \
        --variants '[{"x_fp8": true}, {"x_fp8": true, "block_n": 256}]' --out OUT/fp4_tiles.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jds.bench.results import measured_row, save_rows  # noqa: E402
from jds.bench.timing import profiled_device_us  # noqa: E402
from ncu_kernels import _grouped  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["w1:1", "w1:8", "w2:8", "w1:64"], help="shape:tokens")
    ap.add_argument("--variants", default='[{"x_fp8": true}, {"x_fp8": true, "block_n": 256}]',
                    help="JSON list of tile dicts (x_fp8: e4m3 x, the kernel's fp8 route)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for case in a.cases:
        shape, tokens = case.split(":")
        for v in json.loads(a.variants):
            def measure(shape=shape, tokens=int(tokens), v=v):
                f, args = _grouped("fp4", shape, tokens, v)
                return profiled_device_us(f, *args, calls=a.calls, by_kernel=True)
            rows.append(measured_row({"case": case, "tiles": v}, measure))
            save_rows(a.out, rows, False, bench="fp4_tiles_time")
    save_rows(a.out, rows, True, bench="fp4_tiles_time")


if __name__ == "__main__":
    main()
