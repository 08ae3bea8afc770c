"""Where a sparse MQA CTA spends its time: Mosaic GPU's in-kernel profiler over the kernel's named regions.

    python scripts/diag/mqa_regions.py [--cases v4_decode_64 ...] [--splits 2 1] [--out F]

Why: at V4 decode 64 a CTA computes 5 blocks, and a fit over list lengths puts about 10 µs of each CTA's time
outside its blocks (``mqa_fixed_cost.py``). The GPU timeline and ncu see the kernel as a whole. This runs the
kernel with ``profile_dir`` (``pallas_kernels.sparse_mqa``): one Perfetto trace per call, a begin / end
timestamp per region and warpgroup (warpgroups 0 and 1 compute: prologue, per block wait_full / qk / softmax /
pv, epilogue; warpgroup 2 produces: produce). Per case it reports each region's median µs per occurrence and
per CTA, the CTAs' median span, how far apart the CTAs start and end, and the kernel's span. Native only
(shared memory holds the profiler's buffer, so V3.2's fp8 kernel cannot run it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
from collections import defaultdict
from typing import Any, Callable

import jax
import numpy as np

from jds.bench import kernels_sparse_mqa as b
from jds.bench.results import case_variant_rows, measured_row, run_meta, write_json
from pallas_kernels import sparse_mqa

WARPGROUPS = sparse_mqa.NUM_WG + 1  # the traces per CTA: the compute warpgroups, then the producer


def profiled_events(run: Callable[[str], Any]) -> list[dict]:
    """The trace events of the last of three calls of ``run(profile_dir)`` (compile, warm up, traced call): a
    kernel built with Mosaic GPU's profiler writes one Perfetto trace per call under the directory."""
    with tempfile.TemporaryDirectory() as d:
        for _ in range(3):
            jax.block_until_ready(run(d))
        traces = sorted(glob.glob(os.path.join(d, "*-trace.json")), key=os.path.getmtime)
        if not traces:
            raise RuntimeError(f"no trace written under {d}")
        with open(traces[-1]) as fh:
            return json.load(fh)["traceEvents"]


def regions_sweep_main(doc: str, measure: Callable[[str, int, dict], dict], bench: str, cases: list[str],
                       variants: str, shown: tuple[str, ...] = ()) -> None:
    """The command line of a GEMM regions script (``fp4_regions.py``, ``fp8_regions.py``): --cases shape:count,
    --variants JSON tile dicts, --out; a row per (case, variant) (``case_variant_rows``), ``shown`` fields of each
    printed."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=cases, help="shape:count")
    ap.add_argument("--variants", default=variants, help="JSON list of tile dicts")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    for r in case_variant_rows(a.cases, json.loads(a.variants), measure, a.out, bench):
        if shown:
            print(json.dumps({k: r.get(k) for k in (*shown, "error")}))


def summarize(events: list[dict], traces_per_cta: int = WARPGROUPS) -> dict:
    """A Mosaic GPU profiler trace (``traceEvents``: name, ph "B" / "E", ts in µs, tid = 1 + trace index) ->
    per region and warpgroup the median µs per occurrence and per CTA, occurrences per CTA; the CTAs' median span
    (first begin to last end over their warpgroups), the spread of their starts and ends, the kernel's span."""
    by_tid: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        by_tid[int(e["tid"])].append(e)
    per_occ: dict[tuple[str, int], list[float]] = defaultdict(list)
    per_cta: dict[tuple[str, int], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    cta_first: dict[int, float] = {}
    cta_last: dict[int, float] = {}
    for tid, evs in by_tid.items():
        cta, wg = divmod(tid - 1, traces_per_cta)
        stack: list[dict] = []
        for e in sorted(evs, key=lambda x: (x["ts"], x["ph"] == "B")):  # an end before a begin at the same time
            if e["ph"] == "B":
                stack.append(e)
                continue
            if not stack or stack[-1]["name"] != e["name"]:
                raise ValueError(f"unbalanced trace: {e['name']} ends in trace {tid} without its begin")
            d = e["ts"] - stack.pop()["ts"]
            per_occ[(e["name"], wg)].append(d)
            per_cta[(e["name"], wg)][cta] += d
        cta_first[cta] = min(cta_first.get(cta, np.inf), min(e["ts"] for e in evs))
        cta_last[cta] = max(cta_last.get(cta, -np.inf), max(e["ts"] for e in evs))
    if not cta_first:
        return {}
    regions = {f"{name}/wg{wg}": {"median_us": statistics.median(v), "per_cta_median_us":
                                  statistics.median(per_cta[(name, wg)].values()),
                                  "per_cta": len(v) / len(per_cta[(name, wg)])}
               for (name, wg), v in sorted(per_occ.items())}
    firsts, lasts = np.array(list(cta_first.values())), np.array(list(cta_last.values()))
    return {"regions": regions, "ctas": len(cta_first),
            "cta_span_median_us": float(np.median([cta_last[c] - cta_first[c] for c in cta_first])),
            "cta_start_spread_us": float(firsts.max() - firsts.min()),
            "cta_end_spread_us": float(lasts.max() - lasts.min()),
            "kernel_span_us": float(lasts.max() - firsts.min())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=["v4_decode_64"])
    ap.add_argument("--splits", nargs="+", type=int, default=[2, 1], help="num_splits per run (0: automatic)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for name in a.cases:
        c = b.case(name)
        for splits in a.splits:
            def measure(splits=splits) -> dict:
                fns: dict[str, Any] = {}

                def run(d: str):
                    if d not in fns:  # built once per trace directory: the three calls share one compile
                        fns[d] = jax.jit(lambda q, cs, ss, sk: sparse_mqa.sparse_mqa(
                            q, cs, c["fmts"], ss, scale=c["scale"], v_dim=c["v_dim"], sink=sk,
                            num_splits=splits or None, profile_dir=d))
                    return fns[d](c["q"], c["caches"], c["slots"], c["sink"])
                return summarize(profiled_events(run))

            rows.append(measured_row({"case": name, "num_splits": splits}, measure))
    if a.out:
        write_json(a.out, {"meta": run_meta(), "rows": rows})


if __name__ == "__main__":
    main()
