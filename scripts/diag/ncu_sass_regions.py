"""Where a warp-specialised kernel's warps stall, per warpgroup region, from an Nsight Compute source page.

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > K_sass.csv
    python scripts/diag/ncu_sass_regions.py K_sass.csv [--kernel mosaic] [--top 20]

Why: the sparse MQA runs two compute warpgroups and a producer in one kernel, and ncu's stall totals mix them. In
the SASS, each warpgroup's code lies between its ``setmaxnreg`` (USETMAXREG) and its EXIT, so the instructions
of a region belong to one role. For each region this prints its warp-stall samples, its instructions executed,
and the opcodes that collect the most samples. Then it prints the kernel's hottest instructions. A spin loop on
an mbarrier shows up as a hot ``BRA`` right after a ``SYNCS.PHASECHK`` (the waiting side of a full / free
protocol). It reads the CSV only; it does not need a GPU.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"
EXECUTED = "Instructions Executed"


def kernel_rows(path: str, name: str) -> tuple[dict[str, int], list[list[str]]]:
    """(column index by header, instruction rows) of the first kernel in the CSV whose name contains ``name``."""
    rows = list(csv.reader(open(path, newline="")))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name" and name in r[1]]
    if not starts:
        raise ValueError(f"no kernel whose name contains {name!r} in {path}")
    header = rows[starts[0] + 1]
    data = []
    for r in rows[starts[0] + 2:]:
        if r and r[0] == "Kernel Name":
            break
        if len(r) == len(header):
            data.append(r)
    return {h: i for i, h in enumerate(header)}, data


def opcode(source: str) -> str:
    parts = source.strip().split()
    op = parts[1] if parts and parts[0].startswith("@") and len(parts) > 1 else (parts[0] if parts else "")
    return op.split(".")[0]


def regions(col: dict[str, int], data: list[list[str]]) -> list[tuple[int, int, str]]:
    """[start, end) index ranges split at each USETMAXREG and EXIT, named by the instruction that opens them."""
    cuts = [(j, r[col["Source"]].strip()) for j, r in enumerate(data)
            if "SETMAXREG" in r[col["Source"]] or opcode(r[col["Source"]]) == "EXIT"]
    bounds = [(0, "prologue")] + cuts + [(len(data), "end")]
    return [(a, b, name) for (a, name), (b, _) in zip(bounds, bounds[1:]) if b > a]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--kernel", default="mosaic", help="a substring of the kernel's name")
    ap.add_argument("--top", type=int, default=20, help="the hottest instructions to list")
    a = ap.parse_args()
    col, data = kernel_rows(a.csv, a.kernel)
    num = lambda r, c: int(float(r[col[c]] or 0))  # noqa: E731
    total = sum(num(r, SAMPLES) for r in data)
    print(f"{len(data)} instructions, {total} stall samples")
    for start, end, name in regions(col, data):
        rows = data[start:end]
        samples = sum(num(r, SAMPLES) for r in rows)
        if not samples:
            continue
        ops, not_issued = collections.Counter(), collections.Counter()
        for r in rows:
            ops[opcode(r[col["Source"]])] += num(r, SAMPLES)
            not_issued[opcode(r[col["Source"]])] += num(r, NOT_ISSUED)
        print(f"\n[{start}, {end}) {name[:60]}: {samples} samples ({samples / max(total, 1):.0%}), "
              f"{sum(num(r, EXECUTED) for r in rows)} warp instructions executed")
        for op, v in ops.most_common(8):
            print(f"    {op:10s} {v:7d} samples ({v / samples:.0%}), {not_issued[op]} not issued")
    print(f"\nhottest {a.top} instructions (index, samples, executed, source):")
    for j in sorted(range(len(data)), key=lambda j: -num(data[j], SAMPLES))[:a.top]:
        r = data[j]
        print(f"  {j:5d} {num(r, SAMPLES):7d} {num(r, EXECUTED):9d}  {r[col['Source']].strip()[:90]}")


if __name__ == "__main__":
    sys.exit(main())
