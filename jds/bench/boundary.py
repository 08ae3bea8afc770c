"""The seeds' experiment in JAX: short-prefill TTFT, saturated throughput and decode step latency for
a V3.2 and a V4-Flash-pattern stack at real head dims, in the wide / narrow / fused boundary modes.

    python -m jds.bench.boundary --arch v32 v4 --layers 8 --out benchmarks/results/boundary_<arch>_<device>_<date>.json
    python -m jds.bench.boundary --dump /tmp/xla_dump --out dump.json   # thunk/launch counts only
    python -m jds.bench.boundary --backend jax torch --arch v32 --out both.json   # jds beside PyTorch, one table

TTFT here is the model-step part of TTFT: host input preparation + dispatch + device time + logits
back to the host, for one 128-token prompt at concurrency 1 (no HTTP, no tokenizer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Callable

from jds.bench.results import write_json
from jds.bench.stack import block_table, build_stack, make_runner, step_shapes
from jds.bench.stats import summarize

MODES = ("wide", "narrow", "fused")


def _stats(xs: list[float]) -> dict[str, float]:
    """Step times in seconds -> ``mean_ms`` / ``median_ms`` / ``p50_ms`` / ``p99_ms`` / ``std_ms`` and ``n``."""
    s = summarize(xs)
    return {"n": s.pop("n"), **{f"{k}_ms": v for k, v in s.items()}}


STEP_ENDS = ("logits", "ids")


def time_steps(runner, chunks, n_warm: int, n: int, end: str = "logits") -> tuple[dict, dict]:
    """Wall time per step and host-side enqueue time of the step call. ``end``: "logits" (inputs -> the
    chunks' logits rows on the host) or "ids" (inputs -> their greedy ids on the host, read as the engine
    reads them: the sampler's pinned-host copy)."""
    import jax
    import numpy as np

    from jds.sampling import greedy_tokens_host

    bt = block_table(runner, runner.max_num_seqs)
    t_tok = sum(c.num_tokens for c in chunks)
    ids = np.random.default_rng(0).integers(0, 256, t_tok).astype(np.int32)
    walls, enq = [], []
    for i in range(n_warm + n):
        t0 = time.perf_counter()
        logits = runner.step(*runner.prepare_inputs(ids, chunks, bt[: len(chunks)]))
        t1 = time.perf_counter()
        if end == "ids":
            np.asarray(greedy_tokens_host(logits)[1])[: len(chunks)]
        else:
            np.asarray(logits[: len(chunks)])
        t2 = time.perf_counter()
        if i >= n_warm:
            walls.append(t2 - t0)
            enq.append(t1 - t0)
    jax.block_until_ready(runner.caches)
    return (_stats(walls), _stats(enq)) if walls else ({}, {})


def bench_arch(arch: str, layers: int, inter: int | None, ctx: int, quick: bool,
               modes: tuple[str, ...] = MODES, warm_only: bool = False, size: str = "bench",
               on_mode: Callable[[dict], None] | None = None, implementation: str = "auto",
               stable_inputs: bool = False, parallel: dict[str, int] | None = None,
               step_end: str = "logits", fused_segments: int = 1, fp8_weights: bool = False) -> dict:
    """Time every step shape in each mode, each step ending as ``step_end`` says (``time_steps``);
    ``fp8_weights``: the linears (and routed experts) as an FP8 checkpoint stores them (``build_stack``);
    ``fused_segments``: the fused mode's step as that many captured executables (RunnerConfig.segments).
    ``warm_only``: run each shape once (compiles, fills the persistent compilation cache for a later timed run)
    and time nothing. ``on_mode`` gets the partial result after each mode (the caller saves it, so a run cut short by a time limit keeps full stats)."""
    import jax

    model = build_stack(arch, layers, intermediate=inter, size=size, implementation=implementation,
                        fp8_weights=fp8_weights)
    out: dict = {"arch": arch, "layers": layers, "config": str(model.cfg), "modes": {}}
    n_ttft, n_dec, n_tp = (30, 30, 5) if quick else (300, 100, 20)
    shapes = step_shapes(ctx)
    for mode in modes:
        t0 = time.perf_counter()
        seg = {"segments": fused_segments} if mode == "fused" and fused_segments > 1 else {}
        r = make_runner(model, mode, 64, ctx, stable_inputs=stable_inputs, **(parallel or {}), **seg)
        if warm_only:
            for chunks in shapes.values():
                time_steps(r, chunks, 1, 0)
            out["modes"][mode] = {"warm_seconds": time.perf_counter() - t0}
            del r
            continue
        res = {}
        ttft, enq = time_steps(r, shapes["ttft_128"], 20, n_ttft, step_end)
        res["ttft_128"] = ttft
        res["ttft_128_host_enqueue"] = enq
        res["dispatches_per_step"] = {"captured": r.last_dispatch.captured, "eager": r.last_dispatch.eager}
        # saturated: 64 concurrent 128-token prompts prefilled in one 8192-token step
        tp, _ = time_steps(r, shapes["prefill_64x128_step"], 3, n_tp, step_end)
        res["prefill_64x128_step"] = tp
        res["throughput_req_per_s"] = 64e3 / tp["mean_ms"]
        for b in (1, 64):
            d, e = time_steps(r, shapes[f"decode_b{b}_ctx{ctx}"], 10, n_dec, step_end)
            res[f"decode_b{b}_ctx{ctx}"] = d
            res[f"decode_b{b}_ctx{ctx}_host_enqueue"] = e
        res["bench_seconds"] = time.perf_counter() - t0
        out["modes"][mode] = res
        print(json.dumps({arch: {mode: {k: (v["mean_ms"] if isinstance(v, dict) and "mean_ms" in v else v)
                                         for k, v in res.items()}}}), flush=True)
        if on_mode:
            on_mode(out)
        del r
        jax.clear_caches()
    m = out["modes"]
    if not warm_only and "wide" in m:
        out["ratios"] = {f"{a}/wide_{k}": m[a][k]["mean_ms"] / m["wide"][k]["mean_ms"]
                         for a in ("narrow", "fused") if a in m
                         for k in ("ttft_128", f"decode_b1_ctx{ctx}", f"decode_b64_ctx{ctx}", "prefill_64x128_step")}
    return out


def precompile(archs: list[str], modes: tuple[str, ...], a: argparse.Namespace, cache_dir: str) -> dict:
    """Compile every (arch, mode) in its own process (an arch's modes at once) into the persistent cache.

    Why: compiling is host work, one executable at a time per process, and a V4 stack's executables
    (three layer kinds, their pairs, four step shapes, three modes) took longer than a device session's
    call limit when compiled one after another. The timed run then loads them from the cache.
    """
    import subprocess

    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    report = {}
    for arch in archs:  # one arch at a time: its modes' processes share the GPU memory
        procs = {}
        for mode in modes:
            cmd = [sys.executable, "-m", "jds.bench.boundary", "--arch", arch, "--modes", mode, "--layers",
                   str(a.layers), "--ctx", str(a.ctx), "--size", a.size, "--implementation", a.implementation,
                   "--compile-cache", cache_dir, "--warm-only", "--out", os.devnull]
            if a.intermediate:
                cmd += ["--intermediate", str(a.intermediate)]
            if a.stable_inputs:
                cmd += ["--stable-inputs"]
            if a.fp8_weights:
                cmd += ["--fp8-weights"]
            cmd += ["--segments", str(a.segments), "--tensor-parallel", str(a.tensor_parallel),
                    "--data-parallel", str(a.data_parallel),
                    "--expert-parallel", str(a.expert_parallel)]
            procs[mode] = (subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True), time.perf_counter())
        for mode, (p, t0) in procs.items():
            text, _ = p.communicate()
            report[f"{arch}/{mode}"] = {"rc": p.returncode, "seconds": time.perf_counter() - t0}
            if p.returncode:
                report[f"{arch}/{mode}"]["log_tail"] = text[-2000:]
    return report


def launches_per_step(modules: dict[str, dict], kinds: list[str], mode: str) -> int:
    """Direct launches of one step, from the thunk counts of the executables its first step compiled.

    Executables are compiled in first-use order and XLA numbers modules in compile order, so the k-th
    eager (or mid) module by number belongs to the k-th distinct layer kind (or kind transition) the
    step meets; the step then calls each once per layer (per transition) of that kind.
    """
    def by_tag(tag: str) -> list[int]:
        hits = sorted((int(k.split(".")[0].split("_")[-1]), v["direct_launches"]) for k, v in modules.items()
                      if k.endswith("." + tag))
        return [n for _, n in hits]

    if mode == "fused":
        return sum(by_tag("jit_full"))
    eager = by_tag("jit_consume" if mode == "narrow" else "jit_prepare_and_consume")
    mids = by_tag("jit_mid")
    kind_order = list(dict.fromkeys(kinds))
    pairs = list(zip(kinds, kinds[1:]))
    pair_order = list(dict.fromkeys(pairs))
    if len(eager) != len(kind_order) or len(mids) != len(pair_order):
        raise ValueError(f"{mode}: {len(eager)} eager / {len(mids)} mid executables in the dump for layer kinds "
                         f"{kind_order} and transitions {pair_order}")
    return (sum(by_tag("jit_first")) + sum(by_tag("jit_last"))
            + sum(eager[kind_order.index(k)] for k in kinds) + sum(mids[pair_order.index(p)] for p in pairs))


def dump_counts(dump_dir: str, arch: str, layers: int, implementation: str = "auto",
                stable_inputs: bool = False) -> dict:
    """One step per mode with XLA dumping on (every executable of the runners, through
    ``RunnerConfig.dump_dir``); count graphs and direct launches per step."""
    import numpy as np

    from jds.batch import Chunk
    from jds.bench.thunks import read_dump

    model = build_stack(arch, layers, intermediate=2048, implementation=implementation)
    result = {}
    seen: set[str] = set(read_dump(dump_dir)) if os.path.isdir(dump_dir) else set()  # earlier archs' modules
    for mode in ("wide", "narrow", "fused"):
        r = make_runner(model, mode, 2, 256, stable_inputs=stable_inputs, dump_dir=dump_dir)
        ids = np.arange(128, dtype=np.int32)
        bt = np.arange(2 * r.max_blocks, dtype=np.int32).reshape(2, -1)
        r.execute(ids, [Chunk(0, 0, 128)], bt[:1])
        mods = read_dump(dump_dir)
        new = {k: v for k, v in mods.items() if k not in seen}
        seen |= set(mods)
        per = {k: {"command_buffers": v.command_buffers, "direct_launches": v.direct_launches,
                   "top_level": len(v.top_level), "in_graphs": len(v.in_graphs)} for k, v in new.items()}
        kinds = [model.cfg.layer_kind(i) for i in range(layers)]
        step = launches_per_step(per, kinds, mode)
        result[mode] = {"modules": per, "direct_launches_per_step": step, "layer_kinds": kinds}
    return result


def _bench_torch(arch: str, a: argparse.Namespace, inter: int, results: dict, save: Callable) -> None:
    """The PyTorch comparator on the same stack and step shapes (``--backend ... torch``)."""
    from jds.compare.torch_bench import bench_torch_arch

    def save_torch(partial: dict) -> None:
        results.setdefault("torch", {})[arch] = partial
        save()

    results.setdefault("torch", {})[arch] = bench_torch_arch(arch, a.layers, inter, a.ctx, a.quick,
                                                             tuple(a.torch_modes), a.size, on_mode=save_torch,
                                                             indexer_kernel=a.torch_indexer, step_end=a.step_end,
                                                             fp8_weights=a.fp8_weights)
    save()


def _parallel(a: argparse.Namespace) -> dict[str, int]:
    """The mesh flags as RunnerConfig fields."""
    return {"tensor_parallel": a.tensor_parallel, "data_parallel": a.data_parallel,
            "expert_parallel": a.expert_parallel}


def main(argv: list[str] | None = None) -> None:
    from jds.bench.cli import GRAPH_UPDATE_MODES, use_graph_update_mode  # no backend touched yet

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", nargs="+", default=["v32", "v4"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default: v32 18432, v4 2048)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", choices=("bench", "tiny"), default="bench",
                    help="bench = real head dims (the experiment); tiny = the CPU smoke test's presets")
    ap.add_argument("--dump", default=None, help="XLA dump dir: count thunks instead of timing")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--implementation", choices=("auto", "xla", "pallas"), default="auto",
                    help="attention stages (auto = the Pallas kernels on a GPU)")
    ap.add_argument("--stable-inputs", action="store_true",
                    help="step inputs in persistent device buffers (BoundaryRunner.stable_inputs)")
    ap.add_argument("--graph-update-mode", default=None, choices=GRAPH_UPDATE_MODES,
                    help="XLA command-buffer update mode, process-wide (jds.bench.cli.use_graph_update_mode)")
    ap.add_argument("--precompile", action="store_true",
                    help="first compile every (arch, mode) in parallel processes into a persistent cache")
    ap.add_argument("--compile-cache", default=None,
                    help="persistent compilation cache directory (default with --precompile: a new temp dir)")
    ap.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", nargs="+", default=["jax"], choices=("jax", "torch"),
                    help="jax = jds (default); torch = the PyTorch comparator (jds/compare) in the same run")
    ap.add_argument("--torch-modes", nargs="+", default=["eager", "wide", "narrow", "full"],
                    choices=("eager", "wide", "narrow", "full"))
    ap.add_argument("--torch-indexer", default="torch", choices=("torch", "triton"),
                    help="the comparator's indexer logits: torch ops, or the Triton paged FP8 kernel")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="RunnerConfig.tensor_parallel (devices)")
    ap.add_argument("--data-parallel", type=int, default=1, help="RunnerConfig.data_parallel (devices)")
    ap.add_argument("--expert-parallel", type=int, default=1, help="RunnerConfig.expert_parallel (devices)")
    ap.add_argument("--step-end", default="logits", choices=STEP_ENDS,
                    help="where a timed step ends, for both backends: the chunks' logits rows on the host, or their "
                         "greedy ids on the host (as the engine reads a token)")
    ap.add_argument("--segments", type=int, default=1,
                    help="the fused mode's step as this many captured executables (RunnerConfig.segments)")
    ap.add_argument("--fp8-weights", action="store_true",
                    help="the linears as an FP8 checkpoint stores them (e4m3 + 128x128 scales), on both backends")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if "torch" in a.backend:  # torch shares the GPU: jax must not preallocate most of its memory
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if a.graph_update_mode:  # into XLA_FLAGS, which the precompile processes inherit
        use_graph_update_mode(a.graph_update_mode)
    cache_dir = a.compile_cache
    if a.precompile and not cache_dir:
        import tempfile

        cache_dir = tempfile.mkdtemp(prefix="jds_xla_cache_")
    if cache_dir:
        from jds.runner import enable_compile_cache

        enable_compile_cache(cache_dir)
    import jax

    if a.precompile and not a.dump:
        # This process must not touch the GPU before the compile processes run (it would preallocate
        # most of the memory), and each arch is precompiled just before it is timed, so a run cut short
        # keeps the archs it finished.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    cmd = " ".join(["python -m jds.bench.boundary"] + (sys.argv[1:] if argv is None else argv))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
            "command": cmd, "precompile": {},
            "implementation": a.implementation, "stable_inputs": a.stable_inputs,
            "graph_update_mode": a.graph_update_mode, "parallel": _parallel(a), "step_end": a.step_end,
            "fused_segments": a.segments, "fp8_weights": a.fp8_weights,
            "complete": False}
    results = {"meta": meta, "archs": {}}
    for arch in a.arch:
        if a.precompile and not a.dump:
            meta["precompile"].update(precompile([arch], tuple(a.modes), a, cache_dir))
            print(json.dumps({"precompile": meta["precompile"]}), flush=True)
        meta.setdefault("device", str(jax.devices()[0].device_kind))
        meta.setdefault("backend", jax.default_backend())
        inter = a.intermediate or (18432 if arch == "v32" else 2048)

        def save(partial: dict | None = None) -> None:
            if partial is not None:
                results["archs"][arch] = partial
            write_json(a.out, results)

        if "jax" not in a.backend:
            pass
        elif a.dump:
            results["archs"][arch] = dump_counts(a.dump, arch, min(a.layers, 4), a.implementation, a.stable_inputs)
        else:
            results["archs"][arch] = bench_arch(arch, a.layers, inter, a.ctx, a.quick, tuple(a.modes), a.warm_only,
                                                 a.size, on_mode=save, implementation=a.implementation,
                                                 stable_inputs=a.stable_inputs, parallel=_parallel(a),
                                                 step_end=a.step_end, fused_segments=a.segments,
                                                 fp8_weights=a.fp8_weights)
        save()
        if "torch" in a.backend and not a.dump and not a.warm_only:
            _bench_torch(arch, a, inter, results, save)
    meta["complete"] = True
    write_json(a.out, results)
    if "torch" in a.backend and not a.dump and not a.warm_only:
        from jds.compare.torch_bench import comparison_table

        for arch in a.arch:
            text, ratios = comparison_table(results["archs"].get(arch), results["torch"].get(arch), a.ctx)
            results.setdefault("comparison", {})[arch] = ratios
            print(f"\n== {arch}: jds (jax) vs PyTorch, {a.layers} layers, ctx {a.ctx} ==\n{text}", flush=True)
        write_json(a.out, results)
        return
    print(json.dumps(results if a.dump else {k: v.get("ratios") for k, v in results["archs"].items()}, indent=1))


if __name__ == "__main__":
    main()
