"""Per-call kernel durations from an ``ncu --csv --page raw`` report of ``ncu_kernels.py fp8sweep``.

    python3 scripts/diag/ncu_sweep_table.py OUT/sweep.csv OUT/order.json [OUT/sweep2.csv OUT/order2.json ...] > OUT/sweep.json

Several (report, order) pairs (one profiled process per tile variant) give one table; a report cut short by a
crashed process gives the calls it holds.

Splits the report's kernels at the marker kernels (``sin(v) * 3``, the report's first kernel: the same name,
grid and block each time; the GEMM's own fusions may share its name, not its launch shape) into the calls
named by the order file, and gives
per call: the GEMM kernel's duration and DRAM throughput, the wrapper's XLA kernels' durations, and their sum.
"""

from __future__ import annotations

import csv
import json
import sys


def _calls(report: str, order_file: str) -> list[dict]:
    try:
        order = json.load(open(order_file))
    except (OSError, ValueError):
        return []
    rows = list(csv.DictReader(line for line in open(report) if line.startswith('"')))
    rows = [r for r in rows if r.get("Kernel Name") and r.get("gpu__time_duration.sum", "").replace(",", "").replace(".", "").isdigit()]
    if not rows:
        return []
    calls, cur = [], None
    sig = lambda r: (r["Kernel Name"], r["Grid Size"], r["Block Size"])  # noqa: E731
    marker = sig(rows[0])
    for r in rows:
        if sig(r) == marker:
            cur = []
            calls.append(cur)
        elif cur is not None:
            cur.append(r)
    out = []
    for meta, ks in zip(order, calls):
        ns = [float(k["gpu__time_duration.sum"].replace(",", "")) for k in ks]
        dur = [(k["Kernel Name"][:40], t) for k, t in zip(ks, ns)]
        # the GEMM: the longest Mosaic kernel (an FP8 call may quantise its activations in a Mosaic kernel first)
        main_t, main_k = max(((t, k) for k, t in zip(ks, ns) if "mosaic" in k["Kernel Name"]),
                             key=lambda tk: tk[0], default=(None, None))
        if main_k is None and str(meta.get("case", "")).startswith(("copy", "read")):  # a ceiling: its one XLA kernel
            main_t, main_k = max(zip(ns, ks), key=lambda tk: tk[0], default=(None, None))
        unit = 1e-3  # ncu reports ns by default
        variant = {k: v for k, v in meta.items() if k != "case"}
        out.append({"case": meta.get("case"), "variant": variant,
                    "kernel_us": main_t * unit if main_k else None,
                    "kernel_dram_pct": float(main_k["dram__throughput.avg.pct_of_peak_sustained_elapsed"]) if main_k else None,
                    "call_kernels_us": sum(d for _, d in dur) * unit, "kernels": [(n, d * unit) for n, d in dur]})
    return out


def main() -> None:
    pairs = sys.argv[1:]
    if not pairs or len(pairs) % 2:
        raise SystemExit("usage: ncu_sweep_table.py REPORT.csv ORDER.json [REPORT.csv ORDER.json ...]")
    out = [c for i in range(0, len(pairs), 2) for c in _calls(pairs[i], pairs[i + 1])]
    json.dump(out, sys.stdout, indent=1)
    print(file=sys.stderr)
    for o in out:
        print(o["case"], o["variant"],
              "kernel %.1f us (%.0f%% DRAM), call kernels %.1f us, %d kernels" % (o["kernel_us"] or -1, o["kernel_dram_pct"] or -1,
                                                                            o["call_kernels_us"], len(o["kernels"])), file=sys.stderr)


if __name__ == "__main__":
    main()
