"""Does a captured executable's host launch cost depend on whether its input buffers move?

On the H200 (2026-11-29) the fused step (one executable, one command buffer holding about 220 kernels)
took 6.3 ms of host time to enqueue, where replaying a CUDA graph should cost tens of microseconds.
Hypothesis: XLA updates the recorded command buffer whenever a buffer it uses sits at a new address,
and every step's inputs (tokens, positions, slot mapping, block tables) are fresh device buffers.

This script times the host enqueue of the same step (a V3.2 stack, 128-token prefill) in four ways:
  fresh_inputs            the inputs rebuilt and transferred every step (what the runner does)
  same_inputs             the very same device arrays passed every step (stable addresses)
  fresh_inputs_no_graph   as fresh_inputs, compiled with command buffers off (direct launches)
  same_inputs_no_graph    as same_inputs, command buffers off
  fresh_inputs_stable_buffers   the runner's ``stable_inputs``: fresh values copied into persistent buffers
                                (the candidate fix; its enqueue time includes preparing and staging)
  fresh_inputs_update_<MODE>    fresh inputs, captured executables compiled with XLA's
                                ``xla_gpu_command_buffer_update_mode`` = MODE (SKIP_TEMP, SKIP_PROFILED:
                                XLA keeps buffers at fixed virtual addresses instead of updating the graph)
If same_inputs is much cheaper than fresh_inputs with command buffers, but the two are alike without
them, input address changes drive the launch cost; the fix is to keep step inputs in persistent,
donated device buffers.

    python scripts/probe_graph_updates.py --layers 4 --out probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def measure(runner, ids, chunks, bt, same: bool, n: int, stage_in_timing: bool = False) -> dict:
    """Host time to enqueue one step (inputs prepared outside the timed region, except with
    ``stage_in_timing``, where preparing, which then includes the in-place staging dispatch, is timed
    too), and the wall time."""
    import jax

    fixed = runner.prepare_inputs(ids, chunks, bt)
    enq, wall = [], []
    for i in range(n + 5):
        t0 = time.perf_counter()
        inputs = fixed if same else runner.prepare_inputs(ids, chunks, bt)
        if not stage_in_timing:
            jax.block_until_ready(inputs)
            t0 = time.perf_counter()
        logits = runner.step(*inputs)
        t1 = time.perf_counter()
        jax.block_until_ready(logits)
        t2 = time.perf_counter()
        if i >= 5:
            enq.append(t1 - t0)
            wall.append(t2 - t0)
    return {"enqueue_ms_median": 1e3 * statistics.median(enq), "wall_ms_median": 1e3 * statistics.median(wall),
            "n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--size", choices=("bench", "tiny"), default="bench")
    ap.add_argument("--modes", nargs="+", default=["fused", "narrow"], choices=("wide", "narrow", "fused"))
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--update-modes", nargs="*", default=["SKIP_TEMP", "SKIP_PROFILED"],
                    choices=("ALWAYS_UPDATE", "SKIP_TEMP", "SKIP_PROFILED"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import jax
    import numpy as np

    from bench_boundary import build, make_runner
    from jds.batch import Chunk

    def save(res: dict) -> None:  # after every row: a run cut short by its time limit keeps what it measured
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    model = build("v32", a.layers, 2048 if a.size == "bench" else 64, a.size)
    ids = np.arange(128, dtype=np.int32) % 256
    chunks = [Chunk(0, 0, 128)]
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
                    "device": str(jax.devices()[0].device_kind), "command": " ".join(["python"] + sys.argv)},
           "modes": {}}
    for mode in a.modes:
        for graphs in (True, False):
            r = make_runner(model, mode, 64, 512)
            if not graphs:  # every executable of this runner compiled as the eager ones are
                orig = r._jit

                def jit_no_graphs(key, fn, *, eager, donate=(), _orig=orig):
                    return _orig(key, fn, eager=True, donate=donate)

                r._jit = jit_no_graphs
            bt = np.arange(r.max_num_seqs * r.max_blocks, dtype=np.int32).reshape(r.max_num_seqs, -1)
            bt = bt[:1] % r.num_blocks
            tag = "" if graphs else "_no_graph"
            res["modes"].setdefault(mode, {})
            for same in (False, True):
                key = f"{'same' if same else 'fresh'}_inputs{tag}"
                res["modes"][mode][key] = measure(r, ids, chunks, bt, same, a.n)
                print(json.dumps({mode: {key: res["modes"][mode][key]}}), flush=True)
                save(res)
            if graphs:  # the candidate fix: fresh values written into persistent buffers (one extra dispatch)
                r.stable_inputs = True
                key = "fresh_inputs_stable_buffers"
                res["modes"][mode][key] = measure(r, ids, chunks, bt, False, a.n, stage_in_timing=True)
                print(json.dumps({mode: {key: res["modes"][mode][key]}}), flush=True)
                save(res)
            del r
            jax.clear_caches()
        for um in a.update_modes:
            r = make_runner(model, mode, 64, 512)
            r.graph_update_mode = um  # read when the executables are first built
            bt = np.arange(r.max_num_seqs * r.max_blocks, dtype=np.int32).reshape(r.max_num_seqs, -1)[:1] % r.num_blocks
            key = f"fresh_inputs_update_{um}"
            res["modes"][mode][key] = measure(r, ids, chunks, bt, False, a.n)
            print(json.dumps({mode: {key: res["modes"][mode][key]}}), flush=True)
            save(res)
            del r
            jax.clear_caches()
    save(res)


if __name__ == "__main__":
    main()
