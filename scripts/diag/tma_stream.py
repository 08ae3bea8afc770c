"""How fast TMA streams a decode GEMM's weight tiles, by weight layout: row-major [N, K] against tiles stored
contiguously [N / bn, K / 128, bn, 128].

    python3 scripts/diag/tma_stream.py --out OUT/tma_stream.json

Why: the FP8 GEMM's decode calls (M <= 128) sit at 40-55% of copy bandwidth whatever their split-K or column
tile (docs/perf-log.md), and cuBLAS at about 60%. A [bn, 128] tile of a row-major e4m3 weight is bn separate
128-byte rows, 16 KB apart at K = 16384; stored tiled, the same tile is one contiguous 16 KB. This kernel
does nothing but the GEMM's weight pipeline (``plgpu.emit_pipeline``, one warpgroup, ``stages`` TMA copies in
flight per CTA, CTA = (K split, column tile) as the GEMM's), so its time is the read alone. Rows: layout x
column tile x split-K x stages, each with its device time (``device_time_us``, unrolled: the pipelined
``median_us`` of a call this short can be the host's dispatch), GB/s and the fraction of the copy bandwidth
measured in the run.
The GEMM's own decode calls are compared by exact kernel durations instead: ``ncu_kernels.py fp8sweep``.
``--interpret``: a small shape in GPU interpret mode (CPU smoke run).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

BLOCK = 128


@functools.lru_cache(maxsize=None)
def stream_call(layout: str, n: int, k: int, bn: int, splits: int, stages: int, interpret: bool):
    """``layout``: "rows" / "tiles" (the weight alone, one warpgroup's plain pipeline); "rows+x": also a
    [64, 128] activation tile per step, as the GEMM's decode path loads (M padded to 64); "rows_ws" /
    "rows_ws+x": the same through the GEMM's warp-specialised pipeline (a producer warpgroup, two consumer
    warpgroups that do nothing)."""
    nk = k // BLOCK
    kps, n_tiles = nk // splits, n // bn
    swz = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(128))
    with_x = layout.endswith("+x")
    ws = layout.startswith("rows_ws")

    def kernel(w_ref, x_ref, o_ref):
        pid = lax.axis_index("cta")
        si, ni = pid // n_tiles, pid % n_tiles
        w_spec = plgpu.BlockSpec((bn, BLOCK), lambda s: (0, s), transforms=swz)
        x_spec = plgpu.BlockSpec((64, BLOCK), lambda s: (0, s), transforms=swz)
        w_win = w_ref.at[pl.ds(ni * bn, bn), pl.ds(si * kps * BLOCK, kps * BLOCK)]
        x_win = x_ref.at[:, pl.ds(si * kps * BLOCK, kps * BLOCK)]
        if ws:
            def wbody(idx, *refs_and_carry):
                return refs_and_carry[-1]

            pipe = plgpu.emit_pipeline_warp_specialized(
                wbody, grid=(kps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
                max_concurrent_steps=min(stages, kps), compute_context=lambda run: run(()),
                in_specs=[w_spec, x_spec] if with_x else [w_spec])
            pipe(w_win, x_win) if with_x else pipe(w_win)
        elif layout == "tiles":
            pipe = plgpu.emit_pipeline(lambda idx, w_s: None, grid=(kps,), max_concurrent_steps=min(stages, kps),
                                       in_specs=[plgpu.BlockSpec((pl.squeezed, bn, BLOCK), lambda s: (s, 0, 0),
                                                                 transforms=swz)])
            pipe(w_ref.at[ni, pl.ds(si * kps, kps)])
        elif with_x:
            pipe = plgpu.emit_pipeline(lambda idx, w_s, x_s: None, grid=(kps,),
                                       max_concurrent_steps=min(stages, kps), in_specs=[w_spec, x_spec])
            pipe(w_win, x_win)
        else:
            pipe = plgpu.emit_pipeline(lambda idx, w_s: None, grid=(kps,), max_concurrent_steps=min(stages, kps),
                                       in_specs=[w_spec])
            pipe(w_win)

        @pl.when(pid == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    extra = dict(num_threads=3, thread_name="wg") if ws else {}
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((128,), jnp.float32), grid=(splits * n_tiles,),
                        grid_names=("cta",), compiler_params=params, **extra,
                        interpret=plgpu.InterpretGPUParams() if interpret else False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--k", type=int, default=16384)
    ap.add_argument("--bns", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--layouts", nargs="+", default=["rows", "tiles", "rows+x", "rows_ws", "rows_ws+x"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from jds.bench.timing import device_time_us, measure_ceilings, time_fn

    ceil = measure_ceilings(quick=a.interpret)
    n, k = (256, 512) if a.interpret else (a.n, a.k)
    w = jax.random.randint(jax.random.key(0), (n, k), -100, 100, jnp.int32).astype(jnp.float8_e4m3fn)
    rows = []
    x = jnp.zeros((64, k), jnp.float8_e4m3fn)
    for bn in a.bns:
        tiled = w.reshape(n // bn, bn, k // BLOCK, BLOCK).transpose(0, 2, 1, 3)  # [N/bn, K/128, bn, 128]
        tiled = jax.block_until_ready(jnp.asarray(tiled))
        for layout, arr in [(lay, tiled if lay == "tiles" else w) for lay in a.layouts]:
            for s in a.splits:
                if (k // BLOCK) % s:
                    continue
                for st in a.stages:
                    row = {"layout": layout, "block_n": bn, "split_k": s, "stages": st, "ctas": s * (n // bn)}
                    try:
                        fn = jax.jit(stream_call(layout, n, k, bn, s, st, a.interpret))
                        t = time_fn(fn, arr, x, iters=3 if a.interpret else 50)["median_us"]
                        d = device_time_us(fn, arr, x, unrolled=True, reps=(1, 2) if a.interpret else (8, 48))
                        row.update(median_us=t, device_us=d, gb_s=n * k / d * 1e-3,
                                   of_copy=n * k / (d * 1e-6) / ceil["copy_bytes_per_s"])
                    except Exception as e:  # noqa: BLE001 - a diag: record and go on
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
                    "device": str(jax.devices()[0].device_kind), "n": n, "k": k, "bytes": n * k, **ceil,
                    "timing": "device_us: device_time_us, unrolled 8 vs 48 calls",
                    "command": "python3 scripts/diag/tma_stream.py " + " ".join(sys.argv[1:])}, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
