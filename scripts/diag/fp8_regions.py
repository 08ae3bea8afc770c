"""Where an FP8 GEMM CTA (decode) spends its time: Mosaic GPU's in-kernel profiler over the kernel's named regions,
per warpgroup (``fp8_gemm.fp8_linear(..., profile_dir=...)``).

    python scripts/diag/fp8_regions.py [--cases q_b:1 mlp:1] [--variants '[{}]'] [--out F]

Why: under Nsight Compute the weight stream alone (the GEMM's CTA grid and TMA ring with no MMA,
``ncu_kernels.py streamsweep``) takes 11.7 µs at q_b and 32.8 at mlp, the GEMM 13.4-14.1 and 37.1-38.7
(docs/perf-log.md, twenty-sixth session); issuing a K block's chunk MMAs together was slower. The kernel-level
numbers cannot say whether the compute warpgroups hold the ring (step bodies as long as the arrival interval) or
the stream starts late and ends late (first fill, store). Per case: the generic region table (``mqa_regions``),
and per compute warpgroup the median over CTAs of the first fill (``all`` begin to the first ``step``), the step
body, the gap between steps (waiting for data), the tail (last step to ``all`` end, the store inside it).
Native only.
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mqa_regions import profiled_events, regions_sweep_main, summarize  # noqa: E402

TRACES_PER_CTA = 3  # two compute warpgroups, then the producer


def phases(events: list[dict]) -> dict:
    """Per compute warpgroup, medians over CTAs: first fill, step body, gap between steps, tail, store (µs)."""
    by_tid: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        by_tid[int(e["tid"])].append(e)
    acc: dict[str, list[float]] = defaultdict(list)
    for tid, evs in by_tid.items():
        wg = (tid - 1) % TRACES_PER_CTA
        if wg == TRACES_PER_CTA - 1:
            continue
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        open_: dict[str, list[float]] = defaultdict(list)
        for e in sorted(evs, key=lambda x: (x["ts"], x["ph"] == "B")):
            if e["ph"] == "B":
                open_[e["name"]].append(e["ts"])
            elif open_[e["name"]]:
                spans[e["name"]].append((open_[e["name"]].pop(), e["ts"]))
        steps = sorted(spans.get("step", []))
        if not steps or not spans.get("all"):
            continue
        a0, a1 = spans["all"][0]
        acc[f"first_fill/wg{wg}"].append(steps[0][0] - a0)
        acc[f"step/wg{wg}"].append(statistics.median(e - b for b, e in steps))
        if len(steps) > 1:
            acc[f"gap/wg{wg}"].append(statistics.median(steps[i + 1][0] - steps[i][1] for i in range(len(steps) - 1)))
        acc[f"tail/wg{wg}"].append(a1 - steps[-1][1])
        if spans.get("store"):
            acc[f"store/wg{wg}"].append(spans["store"][0][1] - spans["store"][0][0])
        acc[f"span/wg{wg}"].append(a1 - a0)
    return {k: statistics.median(v) for k, v in sorted(acc.items())}


def _measure(shape: str, m: int, tiles: dict) -> dict:
    from jds.bench import kernels_fp8_gemm as b
    from pallas_kernels import fp8_gemm
    k, n = b.SHAPES[shape]
    kw, kx = jax.random.split(jax.random.key(0))
    wq = (jax.random.normal(kw, (n, k), jnp.float32) * 0.5).astype(jnp.float8_e4m3fn)
    ws = jnp.full((n // 128, k // 128), 2.0 ** -7, jnp.float32)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    fns: dict[str, object] = {}

    def run(d: str):
        if d not in fns:  # built once per trace directory: the three calls share one compile
            fns[d] = jax.jit(functools.partial(fp8_gemm.fp8_linear, implementation="pallas", profile_dir=d, **tiles))
        return fns[d](x, wq, ws)
    events = profiled_events(run)
    return {**summarize(events, traces_per_cta=TRACES_PER_CTA), "phases": phases(events)}


def main() -> None:
    regions_sweep_main(__doc__, _measure, "fp8_regions", ["q_b:1", "mlp:1"], "[{}]",
                       shown=("case", "tiles", "phases", "kernel_span_us", "cta_start_spread_us", "cta_end_spread_us"))


if __name__ == "__main__":
    main()
