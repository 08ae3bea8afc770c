"""TTFT of one 128-token prompt, and its parts, for runner variants side by side in one process.

    python -m jds.bench.ttft --arch v32 --layers 8 --intermediate 18432 \
        --variants fused:host fused:device fused:device:2 fused:device:4 fused:device:8 narrow:host narrow:device \
        --out benchmarks/results/ttft_<device>_<date>.json

A variant is ``mode:input_prep[:segments[:put][:spin]]`` (``put``: the packed step buffer sent by
``jax.device_put`` as part of the timed preparation, not as a numpy argument of the first dispatch; ``spin``:
the host polls for the step's ids instead of sleeping in the wait: ``jds.bench.stack.time_steps``; ``freeze``:
``gc.freeze()`` before the timed steps; ``devids``: the ids read by a transfer of the device array, not from the sampler's pinned-host copy as the
engine reads them;
``transfer`` / ``pinned``: the runner's ``step_buffer``, else its default; ``firstN``: ``first_segment_layers=N``). Per variant, after warm-up: the median wall time of a step
(inputs -> the greedy first token on the host; ``jds.bench.stack.time_steps``), its host input preparation
and its launch (host time of ``runner.step``),
the host time of each segment's dispatch, of the greedy sample's dispatch and of the wait for its ids
(``parts_ms``), input preparation alone in a loop (``prepare_alone_ms``),
and the device-bound time per step (``n`` steps enqueued back to back, one wait). Every variant shares
the same model and weights, so the rows are comparable within the run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from typing import Any


def _median_ms(xs: list[float]) -> float:
    return 1e3 * sorted(xs)[len(xs) // 2]


def time_variant(model: Any, mode: str, prep: str, segments: int, n: int, moe: bool = False,
                 parallel: dict[str, int] | None = None, shape: str = "ttft_128", put: bool = False,
                 spin: bool = False, freeze: bool = False, host_ids: bool = True, step_buffer: str = "auto",
                 runners: dict[tuple, Any] | None = None) -> dict[str, Any]:
    """One variant's row. ``runners``: the runner of the previous variant, by (mode, preparation, segments,
    step buffer): reused when this variant shares them (its executables already compiled); otherwise dropped
    with JAX's caches and this variant's runner left there. Without it the runner is dropped afterwards."""
    import jax
    import numpy as np

    from jds.bench.stack import block_table, make_runner, step_shapes, time_steps
    from jds.runner import StepInputs

    t0 = time.perf_counter()
    key = (mode, prep, segments, step_buffer, tuple(sorted((parallel or {}).items())))
    runner = (runners or {}).get(key)
    if runner is None:
        if runners:
            runners.clear()
            jax.clear_caches()
        runner = make_runner(model, mode, 64, 512, input_prep=prep, segments=segments, step_buffer=step_buffer,
                             **(parallel or {}))
        if runners is not None:
            runners[key] = runner
    chunks = step_shapes(512)[shape]
    bt = block_table(runner, len(chunks))
    ids = np.random.default_rng(0).integers(0, 256, sum(c.num_tokens for c in chunks)).astype(np.int32)
    first = runner.prepare_inputs(ids, chunks, bt)[0]
    if isinstance(first, StepInputs):  # the timed step's executables, compiled on runner.compile_workers threads
        runner.warmup(buckets=[(first.token_bucket, first.key_blocks)])
    np.asarray(runner.step(*runner.prepare_inputs(ids, chunks, bt)))
    compile_s = time.perf_counter() - t0
    parts: dict[str, list[float]] = {}
    if freeze:  # the objects alive now leave the collector's generations (as a server after warm-up could)
        gc.collect()
        gc.freeze()
    try:
        walls, preps, launches = time_steps(runner, ids, chunks, bt, n, parts=parts, put=put, spin=spin,
                                              host_ids=host_ids)
    finally:
        if freeze:
            gc.unfreeze()
    alone = []  # input preparation with no step in between (the host's own speed, no device work around it)
    for _ in range(200):
        a = time.perf_counter()
        runner.prepare_inputs(ids, chunks, bt)
        alone.append(time.perf_counter() - a)
    reps = []
    for _ in range(5):  # device-bound: ten steps in flight, one wait
        a = time.perf_counter()
        for _ in range(10):
            out = runner.step(*runner.prepare_inputs(ids, chunks, bt))
        jax.block_until_ready(out)
        reps.append((time.perf_counter() - a) / 10)
    res = {"mode": mode, "input_prep": prep, "segments": segments, "put": put, "spin": spin, "gc_freeze": freeze,
           "host_ids": host_ids,
           "step_buffer": runner.step_buffer, "first_step_s": compile_s, "compile_workers": runner.compile_workers,
           "ttft_ms": _median_ms(walls), "prepare_ms": _median_ms(preps), "launch_ms": _median_ms(launches),
           "prepare_alone_ms": _median_ms(alone), "parts_ms": {k: _median_ms(v) for k, v in parts.items()},
           "back_to_back_step_ms": _median_ms(reps), "n": n,
           "dispatches": {"captured": runner.last_dispatch.captured, "eager": runner.last_dispatch.eager}}
    if runners is None:
        del runner
        jax.clear_caches()
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="v32", choices=("v32", "v4"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--moe-experts", type=int, default=0, help="routed experts per layer (0: dense MLP)")
    ap.add_argument("--moe-topk", type=int, default=8)
    ap.add_argument("--size", default="bench", choices=("bench", "tiny"))
    ap.add_argument("--implementation", default="auto", choices=("auto", "xla", "pallas"))
    ap.add_argument("--fp8-weights", action="store_true",
                    help="FP8 block-scaled linears (the checkpoints' storage; the FP8 GEMM kernel on a GPU)")
    ap.add_argument("--variants", nargs="+", default=["fused:host", "fused:device"])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--shape", default="ttft_128", help="the step timed (jds.bench.stack.step_shapes(512)): "
                    "ttft_128, decode_b1_ctx512, decode_b64_ctx512, prefill_64x128_step")
    ap.add_argument("--graph-update-mode", default=None,
                    help="XLA command-buffer update mode for the whole process (ALWAYS_UPDATE, SKIP_TEMP, SKIP_PROFILED)")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="RunnerConfig.tensor_parallel (devices)")
    ap.add_argument("--data-parallel", type=int, default=1, help="RunnerConfig.data_parallel (devices)")
    ap.add_argument("--expert-parallel", type=int, default=1, help="RunnerConfig.expert_parallel (devices)")
    ap.add_argument("--compile-workers", type=int, default=None,
                    help="RunnerConfig.compile_workers (threads compiling a fused device-prep step; default its default)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.graph_update_mode:  # before JAX creates its GPU client: XLA picks its allocator from it then
        from jds.bench.cli import use_graph_update_mode

        use_graph_update_mode(a.graph_update_mode)
    import jax

    from jds.bench.stack import build_stack
    from jds.bench.results import write_json

    parallel = {"tensor_parallel": a.tensor_parallel, "data_parallel": a.data_parallel,
                "expert_parallel": a.expert_parallel}
    if a.compile_workers is not None:
        parallel["compile_workers"] = a.compile_workers
    t0 = time.perf_counter()
    model = build_stack(a.arch, a.layers, intermediate=a.intermediate, size=a.size, implementation=a.implementation,
                        moe_experts=a.moe_experts, moe_topk=a.moe_topk, fp8_weights=a.fp8_weights)
    res: dict[str, Any] = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                    "command": " ".join(["python -m jds.bench.ttft"] + sys.argv[1:]),
                                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
                                    "backend": jax.default_backend(), "arch": a.arch, "layers": a.layers,
                                    "intermediate": a.intermediate, "moe_experts": a.moe_experts,
                                    "moe_topk": a.moe_topk, "fp8_weights": a.fp8_weights, "build_s": time.perf_counter() - t0, "shape": a.shape,
                                    "graph_update_mode": a.graph_update_mode, "parallel": parallel,
                                    "complete": False},
                           "variants": {}}
    runners: dict[tuple, Any] = {}  # variants that differ only in put / spin / freeze / ids share one runner
    for v in a.variants:
        parts = v.split(":")
        mode, prep = parts[0], parts[1]
        numeric = len(parts) > 2 and parts[2].isdigit()
        segments = int(parts[2]) if numeric else 1
        flags = set(parts[3:] if numeric else parts[2:])
        first = [f for f in flags if f.startswith("first") and f[5:].isdigit()]
        flags -= set(first)
        unknown = flags - {"put", "spin", "freeze", "devids", "transfer", "pinned"}
        if unknown:
            raise ValueError(f"variant {v!r}: unknown flags {sorted(unknown)}")
        put, spin, freeze, host_ids = "put" in flags, "spin" in flags, "freeze" in flags, "devids" not in flags
        step_buffer = "transfer" if "transfer" in flags else "pinned" if "pinned" in flags else "auto"
        if put and step_buffer != "transfer":
            raise ValueError(f"variant {v!r}: put needs the transfer step buffer (add :transfer)")
        try:
            settings = {**parallel, "first_segment_layers": int(first[0][5:])} if first else parallel
            res["variants"][v] = time_variant(model, mode, prep, segments, a.n, parallel=settings, shape=a.shape,
                                              put=put, spin=spin, freeze=freeze, host_ids=host_ids,
                                              step_buffer=step_buffer, runners=runners)
        except Exception as e:  # noqa: BLE001 - a variant that fails records why; the others still run
            res["variants"][v] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps({v: res["variants"][v]}), flush=True)
        write_json(a.out, res)
    stats = jax.devices()[0].memory_stats() or {}
    res["meta"]["memory_gib"] = {k: stats[k] / 2**30 for k in ("peak_bytes_in_use", "bytes_limit") if k in stats}
    res["meta"]["complete"] = all("error" not in r for r in res["variants"].values())
    write_json(a.out, res)


if __name__ == "__main__":
    main()
