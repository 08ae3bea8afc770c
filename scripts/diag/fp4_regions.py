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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp4_tiles_time import _case  # noqa: E402
from mqa_regions import profiled_events, regions_sweep_main, summarize  # noqa: E402


def _measure(shape: str, tokens: int, tiles: dict) -> dict:
    calls: dict[str, tuple] = {}

    def run(d: str):
        if d not in calls:  # built once per trace directory: the three calls share one compile
            calls[d] = _case(shape, tokens, 1, {**tiles, "profile_dir": d})
        fn, args = calls[d]
        return fn(*args)
    # traces per CTA: a compute warpgroup per 64 weight rows (the route's default tiles are 128 rows), the producer
    return summarize(profiled_events(run), traces_per_cta=tiles.get("block_n", 128) // 64 + 1)


def main() -> None:
    regions_sweep_main(__doc__, _measure, "fp4_regions", ["w1:1", "w1:8"], '[{}, {"split_k": 2}, {"split_k": 8}]')


if __name__ == "__main__":
    main()
