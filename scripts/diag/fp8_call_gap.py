"""Is the idle gap inside an FP8 GEMM call a host-launch effect? (issue 19)

With ``act_quant="kernel"`` a waited decode call is two Mosaic GPU kernels, and the GPU timeline showed
5-8 µs of idle time between them (2026-12-01, seventh session), which made the call's span longer though its
kernels got shorter. If the gap is host-side launch work per Mosaic custom call, it vanishes when the calls
run from one executable (one command buffer), as they do in the model's step. This prints, per variant, the
span and busy time per call (a) of one waited call and (b) of ``--chain`` calls inside one jit (one call's
kernels: the chain's span / chain), from ``jds.bench.timing.profiled_device_us``:

    python3 scripts/diag/fp8_call_gap.py --shape wo --m 1 --out OUT/fp8_call_gap.json

Measured 2026-12-01 (eighth session, benchmarks/results/archive/fp8_call_gap_h200_2026-12-01.json): the gap is gone in
the chain, where the one-kernel act_quant is as fast or faster; it is the decode default since.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys

import jax
import jax.numpy as jnp

from jds.bench import kernels_fp8_gemm as b
from jds.bench.timing import profiled_device_us
from pallas_kernels import fp8_gemm

VARIANTS = {"act_quant=xla": {"act_quant": "xla"}, "act_quant=kernel": {"act_quant": "kernel"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["wo", "mlp"], choices=sorted(b.SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--chain", type=int, default=8, help="calls inside one jit for (b)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for shape in a.shape:
        k, n = b.SHAPES[shape]
        for m in a.m:
            c = b._case(shape, k, n, m, False, jax.random.key(0))  # the benchmark's operands
            x, wq, ws = c["x"], c["wq"], c["ws"]
            for name, tiles in VARIANTS.items():
                f = functools.partial(fp8_gemm.fp8_linear, implementation="pallas", **tiles)

                def chain(x, wq, ws, f=f):  # each call's x depends on the last output: calls stay in order
                    acc = jnp.zeros((), jnp.float32)
                    for _ in range(a.chain):
                        y = f(x + acc.astype(x.dtype), wq, ws)
                        acc = acc + y[0, 0].astype(jnp.float32) * 0.0
                    return acc

                one = profiled_device_us(jax.jit(f), x, wq, ws)
                many = profiled_device_us(jax.jit(chain), x, wq, ws)
                row = {"shape": shape, "m": m, "variant": name, "single": one,
                       "chained_per_call_span_us": many.get("profile_span_us", float("nan")) / a.chain,
                       "chained_per_call_busy_us": many.get("profile_busy_us", float("nan")) / a.chain,
                       "chained": many, "chain": a.chain}
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(a.out, "w") as fh:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": jax.devices()[0].device_kind,
                "jax": jax.__version__, "command": "python3 " + " ".join(sys.argv)}
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
