"""What makes a captured step's host launch cost milliseconds? Input addresses, graph updates, traced GEMMs.

The fused V3.2 step, one executable whose thunk sequence is one command buffer, takes milliseconds of host
time to enqueue on the H200 (``benchmarks/results/boundary_v32_*.json``:
``archs.v32.modes.fused.ttft_128_host_enqueue``), far more than a small jitted call.
XLA's CommandBufferThunk (openxla/xla, 2026) patches the recorded graph's nodes whenever a buffer they use
sits at a new address (with the default ``xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE``), and
re-captures library commands (cuBLAS GEMMs) whose addresses miss a small trace cache. Every step brings
fresh inputs and fresh temp/output allocations.

The 2-layer run (``benchmarks/results/archive/probe_graph_updates_2layers_h200_2026-11-29.json``,
``variants.*.modes.fused.*.enqueue_ms_median``) found fresh inputs, the same arrays and the other flags
within a fraction of a millisecond of each other, and no graphs slower: graph updates are not the cost
(docs/perf-log.md). Fresh rows now also time the input preparation (``prepare_ms_median``) to split the 8-layer
bench's enqueue into preparation and dispatch.

Each variant runs in its own process (the update modes choose XLA's allocator at client creation):
  base             default flags. Rows: fresh_inputs (what the runner does), same_inputs (the very same
                   device arrays every step), stable_buffers (the runner's ``stable_inputs``: fresh values
                   written in place into persistent buffers; its time includes preparing and staging),
                   no_graph_* (command buffers off: direct launches), fusion_only_* (captured executables
                   keep only fusions and custom calls in the graph: GEMMs run as direct launches, never
                   re-traced)
  trace_cache_128  --xla_cmd_buffer_trace_cache_size=128
  skip_temp        --xla_gpu_command_buffer_update_mode=SKIP_TEMP (temp buffers at fixed addresses)
  skip_profiled    --xla_gpu_command_buffer_update_mode=SKIP_PROFILED (also parameters / outputs that kept
                   their address over the first calls)
Reading: if same_inputs or an update mode is much cheaper than fresh_inputs while no_graph is not,
address-driven graph updates are the cost; if fusion_only or trace_cache_128 fixes it, GEMM re-tracing is.

    python -m jds.bench.probe_graph_updates --layers 2 --out probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

from jds.bench.results import write_json
from jds.bench.stack import block_table, build_stack, make_runner
from jds.bench.stats import median

VARIANTS = {  # name -> extra XLA_FLAGS of its process
    "base": "",
    "trace_cache_128": "--xla_cmd_buffer_trace_cache_size=128",
    "skip_temp": "--xla_gpu_command_buffer_update_mode=SKIP_TEMP",
    "skip_profiled": "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED",
}


def measure(runner, ids, chunks, bt, same: bool, n: int, stage_in_timing: bool = False) -> dict:
    """Host time to enqueue one step (inputs prepared outside the timed region, except with
    ``stage_in_timing``, where preparing, which then includes the in-place staging dispatch, is timed
    too), and the wall time."""
    import jax

    fixed = runner.prepare_inputs(ids, chunks, bt)
    enq, wall, prep = [], [], []
    for i in range(n + 5):
        t0 = time.perf_counter()
        inputs = fixed if same else runner.prepare_inputs(ids, chunks, bt)
        if not stage_in_timing:
            jax.block_until_ready(inputs)
            tp = time.perf_counter()
            if i >= 5 and not same:
                prep.append(tp - t0)
            t0 = tp
        logits = runner.step(*inputs)
        t1 = time.perf_counter()
        jax.block_until_ready(logits)
        t2 = time.perf_counter()
        if i >= 5:
            enq.append(t1 - t0)
            wall.append(t2 - t0)
    res = {"enqueue_ms_median": median(enq, 1e3), "wall_ms_median": median(wall, 1e3), "n": n}
    if prep:  # host preparation + transfer of fresh inputs, outside the enqueue above
        res["prepare_ms_median"] = median(prep, 1e3)
    return res


def _runner(model, mode: str, captured_opts: dict | None, all_eager: bool = False):
    """A runner whose captured executables get ``captured_opts`` (None = XLA's defaults); ``all_eager``
    compiles every executable as the eager ones are (command buffers off)."""
    return make_runner(model, mode, 64, 512, captured_compiler_options=captured_opts, all_eager=all_eager)


def child(a: argparse.Namespace) -> None:
    """One variant in this process: every row of it, for every mode; JSON saved after each row."""
    import jax
    import numpy as np

    from jds.batch import Chunk

    model = build_stack("v32", a.layers, intermediate=2048 if a.size == "bench" else 64, size=a.size)
    ids = np.arange(128, dtype=np.int32) % 256
    chunks = [Chunk(0, 0, 128)]
    res: dict = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "device": str(jax.devices()[0].device_kind),
                 "modes": {}}

    def row(mode: str, key: str, r, same: bool = False, staged: bool = False) -> None:
        bt = block_table(r, 1)
        if staged:
            r.stable_inputs = True
        res["modes"].setdefault(mode, {})[key] = measure(r, ids, chunks, bt, same, a.n, stage_in_timing=staged)
        print(json.dumps({a.child: {mode: {key: res["modes"][mode][key]}}}), flush=True)
        write_json(a.child_out, res)

    for mode in a.modes:
        r = _runner(model, mode, None)
        row(mode, "fresh_inputs", r)
        row(mode, "same_inputs", r, same=True)
        if a.child != "trace_cache_128":
            row(mode, "stable_buffers", r, staged=True)
        del r
        jax.clear_caches()
        if a.child == "base":
            r = _runner(model, mode, None, all_eager=True)
            row(mode, "no_graph_fresh_inputs", r)
            row(mode, "no_graph_same_inputs", r, same=True)
            del r
            jax.clear_caches()
            r = _runner(model, mode, {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL"})
            row(mode, "fusion_only_fresh_inputs", r)
            row(mode, "fusion_only_same_inputs", r, same=True)
            del r
            jax.clear_caches()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--size", choices=("bench", "tiny"), default="bench")
    ap.add_argument("--modes", nargs="+", default=["fused", "narrow"], choices=("wide", "narrow", "fused"))
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a)
        return
    out = os.path.abspath(a.out)
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "command": " ".join(["python -m jds.bench.probe_graph_updates"]
                                        + (sys.argv[1:] if argv is None else argv)),
                    "layers": a.layers, "size": a.size, "complete": False},
           "variants": {}}
    for v in a.variants:  # one process at a time: the timings never share the machine
        part = f"{out}.{v}.json"
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {VARIANTS[v]}".strip()}
        cmd = [sys.executable, "-m", "jds.bench.probe_graph_updates", "--child", v, "--child-out", part,
               "--layers", str(a.layers), "--size", a.size, "--n", str(a.n), "--modes", *a.modes, "--out", out]
        rc = subprocess.run(cmd, env=env).returncode
        res["variants"][v] = json.load(open(part)) if os.path.exists(part) else {}
        res["variants"][v]["rc"] = rc
        if os.path.exists(part):
            os.remove(part)
        write_json(out, res)
    res["meta"]["complete"] = all(r.get("rc") == 0 for r in res["variants"].values())
    write_json(out, res)


if __name__ == "__main__":
    main()
