"""The FP4 grouped GEMM's tile variants on the GPU timeline: per (case, variant) the GEMM kernel's µs and the
whole call's, one process, no profiler in the way (Nsight Compute's sweep serialises, and a variant that
deadlocks hangs its whole call; here each row prints as it ends).

    python3 scripts/diag/fp4_tiles_time.py --cases w1:1 w1:8 w2:8 w1:64 \
        --variants '[{}, {"block_n": 256}]' --rotations 4 --out OUT/fp4_tiles.json

x is e4m3 with act_quant's scales (the kernel's "fp8" route, as the V4 MoE calls it), quantised outside the
timed call. A tile dict's "sets": S stacks in one call (the MoE's w1 and w3: compare with twice S = 1's time).
``--rotations R``: one timed call runs R routings of the same tokens (different experts, so
different weights), and each row reports per-GEMM µs (the call's / R): with R = 1 the same experts run back to
back and part of their weights sit in the 50 MB L2 (the first run of this script, 2026-12-03, was so).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jds.bench import kernels_grouped as kg
from jds.bench.results import tiles_sweep_main
from jds.bench.timing import profiled_device_us
from jds.ops import quant

KERNEL = "kernel_mosaic_gpu_kernel"  # the GEMM's name on the timeline (the wrapper's are XLA fusions)


def _case(shape: str, tokens: int, rotations: int, tiles: dict):
    """``tiles["sets"]`` = S > 1: S expert stacks in one call (an MoE's w1 and w3), y [M, S N]."""
    f = kg.FORMATS["fp4"]
    k, n = f.shapes[shape]
    tiles = dict(tiles)
    sets = tiles.pop("sets", 1)
    stacks = [f.experts(k, n, 256, jax.random.key(i)) for i in range(sets)]
    w, ws = (stacks[0] if sets == 1 else tuple(zip(*stacks)))
    routes = [kg._routing(256, k, tokens, f.top_k, kk) for kk in jax.random.split(jax.random.key(1), rotations)]
    xs = [quant.act_quant(x, 128, "ue8m0") for x, _ in routes]
    sizes = [jnp.asarray(s) for _, s in routes]
    call = functools.partial(f.op, implementation="pallas", **tiles)
    fn = jax.jit(lambda xs, sizes, w, ws: [call(xq, sz, w, ws, x_scale=sx) for (xq, sx), sz in zip(xs, sizes)])
    return fn, (xs, sizes, w, ws)


def gemm_bytes(shape: str, tokens: int, rotations: int, sets: int = 1) -> float:
    """HBM bytes per GEMM of ``_case``'s calls, averaged over its routings: the active experts' packed weights and
    scales (per set), e4m3 x with its scales, bf16 y."""
    f = kg.FORMATS["fp4"]
    k, n = f.shapes[shape]
    m = tokens * f.top_k
    active = [int((s > 0).sum()) for _, s in
              (kg._routing(256, k, tokens, f.top_k, kk) for kk in jax.random.split(jax.random.key(1), rotations))]
    return sum(active) / rotations * sets * f.weight_bytes(k, n) + m * k * (1 + 4 / 128) + 2 * m * sets * n


def _measure(shape: str, tokens: int, rotations: int, tiles: dict, calls: int) -> dict:
    fn, args = _case(shape, tokens, rotations, tiles)
    r = profiled_device_us(fn, *args, calls=calls, by_kernel=True)
    per = lambda v: None if v is None else v / rotations  # noqa: E731
    return {"kernel_us": per((r.get("profile_kernel_us") or {}).get(KERNEL)),
            "call_span_us": per(r.get("profile_span_us")), "call_busy_us": per(r.get("profile_busy_us")),
            "bytes": gemm_bytes(shape, tokens, rotations, tiles.get("sets", 1)), "raw": r}


def main() -> None:
    tiles_sweep_main(__doc__, _measure, "fp4_tiles_time", cases=["w1:1", "w1:8", "w2:8", "w1:64"],
                     variants='[{}, {"block_n": 256}]', rotations=4,
                     rotations_help="routings per timed call (cold weights)")


if __name__ == "__main__":
    main()
