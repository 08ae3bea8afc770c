"""How long ``BoundaryRunner.warmup`` takes with its executables compiled one at a time and on threads.

    python3 scripts/diag/warmup_time.py --layers 8 --workers 1 4 --segments 1 --out OUT/warmup_time.json

Why: a server compiles every (token bucket x key-block bucket) executable before it takes requests, and a
segmented fused step has one executable per segment and bucket; ``RunnerConfig.compile_workers`` compiles them
on threads (XLA's compile releases the GIL). Per worker count: the wall time of ``warmup()`` on a fresh runner
(JAX's caches cleared before each), and that the first real step afterwards compiles nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="v32", choices=("v32", "v4"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--size", default="bench", choices=("bench", "tiny"))
    ap.add_argument("--segments", type=int, default=1)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--token-buckets", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import jax
    import numpy as np

    from jds.batch import Chunk
    from jds.bench.stack import block_table, build_stack, make_runner

    model = build_stack(a.arch, a.layers, intermediate=a.intermediate, size=a.size)
    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda ev, s, **kw: compiles.append(s) if ev == "/jax/core/compile/backend_compile_duration" else None)
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
                    "device": jax.devices()[0].device_kind, "command": " ".join(["python3"] + sys.argv),
                    "layers": a.layers, "segments": a.segments}, "rows": []}
    for w in a.workers:
        jax.clear_caches()
        runner = make_runner(model, "fused", 16, 512, segments=a.segments, compile_workers=w,
                             token_buckets=tuple(a.token_buckets))
        n0, t0 = len(compiles), time.perf_counter()
        runner.warmup()
        row = {"workers": w, "warmup_s": time.perf_counter() - t0, "executables_compiled": len(compiles) - n0,
               "buckets": len(runner.token_buckets) * len(runner.key_block_buckets),
               "compile_s_summed": sum(compiles[n0:])}
        n1 = len(compiles)
        ids = np.arange(100, dtype=np.int32) % 256
        jax.block_until_ready(runner.step(*runner.prepare_inputs(ids, [Chunk(0, 0, 100)], block_table(runner, 1))))
        row["compiles_after_warmup"] = len(compiles) - n1
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        del runner
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
