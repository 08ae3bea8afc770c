"""Where a step's host time goes: a host trace of one boundary-mode step at several depths.

    python -m jds.bench.host_profile --arch v32 --layers 2 8 16 --mode fused \
        --update-modes ALWAYS_UPDATE SKIP_TEMP SKIP_PROFILED --update-mode-layers 8 \
        --out benchmarks/results/host_profile_<device>_<date>.json

Each step runs inside ``TraceAnnotation`` windows (``jds_prepare``: input preparation, ``jds_launch``: the
runner's dispatch, ``jds_sync``: the greedy ids of the step back on the host, as TTFT ends).
``jax.profiler`` records XLA's and PjRt's own TraceMe events on every host thread and, on a GPU, CUPTI's
kernel records. The trace is read back with ``jax.profiler.ProfileData`` and reduced to, per step: the self
time of every host event name inside each window (self = its duration minus the events nested in it on the
same thread), when the first GPU kernel of the step started relative to the step's start (the host critical
path), and the device span and busy time. When the host side of the trace is unusable (event names lost, as
on the H200 since 2026-11-30), the steps are read off the GPU's own timeline instead (``device_steps``).
Names whose time grows with depth are what launch cost scales with.

Each command-buffer update mode runs in its own process: XLA picks its allocator from ``XLA_FLAGS`` at
client creation (``jds.bench.cli.use_graph_update_mode``).
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

WINDOWS = ("jds_prepare", "jds_launch", "jds_sync")


def _self_times(events: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """(name, start, self_ns) for events of one thread, nesting read from time containment."""
    events = sorted(events, key=lambda e: (e[1], -e[2]))
    out: list[list[Any]] = []
    stack: list[int] = []  # indices into out, innermost last
    for name, start, dur in events:
        while stack and out[stack[-1]][1] + out[stack[-1]][3] <= start:
            stack.pop()
        if stack:
            out[stack[-1]][2] -= min(dur, out[stack[-1]][1] + out[stack[-1]][3] - start)
        out.append([name, start, dur, dur])
        stack.append(len(out) - 1)
    return [(n, s, max(0, slf)) for n, s, slf, _ in out]


def _event_name(e: Any) -> str:
    """An event's name; an annotation whose name came back unresolved ("<UNKNOWN>", seen in an H200 trace of
    2026-12-01) is named by a string stat equal to one of ours, if it carries one."""
    name = str(e.name)
    if name in WINDOWS or name == "jds_step" or not name.startswith("<"):
        return name
    for _, v in e.stats:
        if isinstance(v, str) and (v in WINDOWS or v == "jds_step"):
            return v
    return name


def read_trace(trace_dir: str, marks: list[tuple[str, int, int]] | None = None) -> dict[str, Any]:
    """Reduce the xplane under ``trace_dir`` to per-step window times, host self times and GPU timing.

    ``marks``: the same windows as (name, start, end) read from ``time.time_ns()`` around them, used when the
    trace holds no named step annotation (H200 traces of 2026-11-30 and 12-01 came back with the
    annotations' names unresolved); the trace's timestamps are the same wall clock."""
    from jax.profiler import ProfileData

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
    pd = ProfileData.from_file(max(files, key=os.path.getmtime))
    host_lines: dict[str, list[tuple[str, int, int]]] = {}
    device_events: list[tuple[int, int]] = []
    compute_events: list[tuple[int, int]] = []
    copies: list[tuple[str, int, int]] = []  # (H2D / D2H, start, duration) on the GPU's memcpy lines
    device_lines: list[str] = []
    for plane in pd.planes:
        if plane.name == "/host:CPU":
            for line in plane.lines:
                host_lines[line.name] = [(_event_name(e), int(e.start_ns), int(e.duration_ns)) for e in line.events]
        elif plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                device_lines.append(f"{plane.name}|{line.name}")
                # CUPTI lines: kernels and memcpys per stream; skip the XLA op / module summary lines
                if "stream" not in line.name.lower():
                    continue
                evs = [(int(e.start_ns), int(e.duration_ns)) for e in line.events]
                device_events += evs
                if "compute" in line.name.lower():
                    compute_events += evs
                for kind in ("H2D", "D2H"):
                    if kind in line.name:
                        copies += [(kind, s, d) for s, d in evs]
    windows: dict[str, list[tuple[int, int]]] = {w: [] for w in WINDOWS}
    steps: list[tuple[int, int]] = []
    for evs in host_lines.values():
        for name, s, d in evs:
            if name in windows:
                windows[name].append((s, s + d))
            elif name == "jds_step":
                steps.append((s, s + d))
    source = "annotations"
    if not steps and marks:
        offset = _mark_offset(marks, [ev for evs in host_lines.values() for ev in evs])
        if offset is not None:
            source = "host_clock"
            for name, s0, s1 in marks:
                (steps if name == "jds_step" else windows[name]).append((s0 + offset, s1 + offset))
    steps.sort()
    n = len(steps)
    if not n and compute_events:
        return {"windows_from": "device_only", "window_ms": {}, "device_lines": device_lines,
                "gpu": device_steps(sorted(compute_events), sorted(copies))}
    if not n:
        seen = {f"{ln}": len(evs) for ln, evs in host_lines.items()}
        names = sorted({e[0] for evs in host_lines.values() for e in evs})[:60]
        unknown = [(line.name, [(str(e.name), list(e.stats)[:4]) for e in list(line.events)[:3]])
                   for plane in pd.planes if plane.name == "/host:CPU" for line in plane.lines
                   if any(str(e.name).startswith("<") for e in line.events)][:3]
        raise ValueError(f"the trace holds no jds_step annotation (unresolved names, first events and stats: "
                         f"{unknown}); planes {[p.name for p in pd.planes]}, "
                         f"host lines {seen}, files {files}, names {names}")
    for w in windows.values():
        w.sort()

    def window_of(t: int) -> str | None:
        for w, spans in windows.items():
            for s, e in spans:
                if s <= t < e:
                    return w
        return None

    step_starts = {s for s, _ in steps}  # the unnamed step annotations themselves (host_clock windows)
    self_ns: dict[tuple[str, str], int] = defaultdict(int)
    count: dict[tuple[str, str], int] = defaultdict(int)
    for evs in host_lines.values():
        for name, s, slf in _self_times(evs):
            if name in windows or name == "jds_step" or (
                    name.startswith("<") and any(abs(s - t) <= 20_000 for t in step_starts)):
                continue
            w = window_of(s)
            if w is None:
                continue
            self_ns[(w, name)] += slf
            count[(w, name)] += 1
    top = sorted(self_ns, key=lambda k: -self_ns[k])
    rows = [{"window": w, "name": name, "self_us_per_step": self_ns[(w, name)] / n / 1e3,
             "count_per_step": count[(w, name)] / n} for w, name in top[:40]]
    res: dict[str, Any] = {
        "steps": n,
        "windows_from": source,
        "window_ms": {w: sum(e - s for s, e in spans) / n / 1e6 for w, spans in windows.items()},
        "host_self_top": rows,
        "device_lines": device_lines,
    }
    if compute_events:
        compute_events.sort()
        first_after, span, busy, tail, gaps = [], [], [], [], []
        for i, (s0, s1) in enumerate(steps):
            nxt = steps[i + 1][0] if i + 1 < n else float("inf")
            mine = [(s, d) for s, d in compute_events if s0 <= s < nxt]
            if not mine:
                continue
            end = max(s + d for s, d in mine)
            first_after.append((mine[0][0] - s0) / 1e6)
            span.append((end - mine[0][0]) / 1e6)
            busy.append(sum(d for _, d in mine) / 1e6)
            tail.append((s1 - end) / 1e6)
            gaps.append(_largest_gaps(mine))
        med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
        res["gpu"] = {"first_kernel_after_step_start_ms": med(first_after), "device_span_ms": med(span),
                      "kernel_busy_ms": med(busy), "step_end_after_last_kernel_ms": med(tail),
                      "kernels_per_step": len(compute_events) / n,
                      "device_events_per_step": len(device_events) / n,
                      "largest_idle_gaps_us_median_step": gaps[len(gaps) // 2] if gaps else None}
    return res


def device_steps(kernels: list[tuple[int, int]], copies: list[tuple[str, int, int]],
                 split_gap_ns: int = 100_000) -> dict[str, Any]:
    """Steps read off the GPU's own timeline when the host side of a trace is unusable: a step ends with its
    device-to-host copy (the sampled ids) and starts with its first host-to-device copy after the previous
    one (the packed step buffer). Per step (medians): copy in -> first kernel, kernel span, kernel busy time,
    last kernel -> copy out done, and the step's longest idle stretches between kernels.

    Without device-to-host copies on the memcpy streams (the copies are commands of the step's own executables:
    the pinned step buffer and the sampler's host ids) a step is a run of kernels with no idle stretch longer
    than ``split_gap_ns`` (the host's wait and preparation separate TTFT steps), and the copy columns are None.
    """
    ends = [s + d for k, s, d in copies if k == "D2H"]
    if not ends and kernels:
        runs, cur = [], [kernels[0]]
        for k in kernels[1:]:
            if k[0] - max(s + d for s, d in cur) > split_gap_ns:
                runs.append(cur)
                cur = []
            cur.append(k)
        runs.append(cur)
        ends = [max(s + d for s, d in run) for run in runs]
        copies = []
    rows: list[dict[str, Any]] = []
    prev = -1
    for end in ends:
        mine = [(s, d) for s, d in kernels if prev < s <= end]
        h2d = [s for k, s, _ in copies if k == "H2D" and prev < s < end]
        prev = end
        if not mine:
            continue
        first, last = mine[0][0], max(s + d for s, d in mine)
        rows.append({"copy_in_to_first_kernel_ms": (first - h2d[0]) / 1e6 if h2d else None,
                     "kernel_span_ms": (last - first) / 1e6, "kernel_busy_ms": sum(d for _, d in mine) / 1e6,
                     "last_kernel_to_copy_out_end_ms": (end - last) / 1e6 if copies else None,
                     "step_span_ms": (end - (h2d[0] if h2d else first)) / 1e6,
                     "kernels": len(mine), "gaps": _largest_gaps(mine)})

    def med(key: str) -> float | None:
        xs = sorted(r[key] for r in rows if r[key] is not None)
        return xs[len(xs) // 2] if xs else None

    keys = ("copy_in_to_first_kernel_ms", "kernel_span_ms", "kernel_busy_ms", "last_kernel_to_copy_out_end_ms",
            "step_span_ms")
    out: dict[str, Any] = {k: med(k) for k in keys}
    out.update(steps=len(rows), kernels_per_step=med("kernels"),
               largest_idle_gaps_us_median_step=sorted(rows, key=lambda r: r["kernel_span_ms"])[len(rows) // 2]["gaps"]
               if rows else None)
    return out


def _mark_offset(marks: list[tuple[str, int, int]], events: list[tuple[str, int, int]],
                 tol_ns: int = 20_000) -> int | None:
    """trace time - wall clock, from the trace's events that match the step marks (the step annotations with
    their names lost: each step's outermost event lasts as long as its mark); None if they do not line up.

    ProfileData's timestamps count from the trace's start, so the marks need this offset."""
    steps = sorted((s0, s1 - s0) for name, s0, s1 in marks if name == "jds_step")
    if not steps:
        return None
    starts = sorted(s for _, s, _ in events)

    def near(t: int) -> bool:  # an event starts within tol_ns of t
        i = bisect.bisect_left(starts, t - tol_ns)
        return i < len(starts) and starts[i] <= t + tol_ns

    for cand_start, cand_dur in sorted((s, d) for _, s, d in events):
        if abs(cand_dur - steps[0][1]) > tol_ns:
            continue
        off = cand_start - steps[0][0]
        if all(near(s0 + off) for s0, _ in steps[1:]):
            return off
    return None


def _largest_gaps(kernels: list[tuple[int, int]], top: int = 8) -> list[dict[str, float]]:
    """The ``top`` longest idle stretches between consecutive kernels of one step: (after kernel #, µs)."""
    out, end = [], None
    for i, (s, d) in enumerate(sorted(kernels)):
        if end is not None and s > end:
            out.append({"after_kernel": i - 1, "idle_us": (s - end) / 1e3})
        end = s + d if end is None else max(end, s + d)
    return sorted(out, key=lambda g: -g["idle_us"])[:top]


def profile_depth(arch: str, layers: int, mode: str, steps: int, implementation: str,
                  runner_kw: dict[str, Any], size: str = "bench", intermediate: int | None = None,
                  moe_experts: int = 0, keep_trace: str | None = None) -> dict[str, Any]:
    """Build, warm up and trace ``steps`` TTFT steps (one 128-token prompt) of an ``layers``-deep stack."""
    import jax
    import numpy as np
    from jax import profiler

    from jds.bench.stack import block_table, build_stack, make_runner, step_shapes, time_steps
    from jds.sampling import greedy_tokens_host

    t0 = time.perf_counter()
    model = build_stack(arch, layers, implementation=implementation, size=size, intermediate=intermediate,
                        moe_experts=moe_experts)
    ctx = min(4096, model.cfg.max_seq_len // 2)
    runner = make_runner(model, mode, 64, ctx, **runner_kw)
    chunks = step_shapes(ctx)["ttft_128"]
    bt = block_table(runner, len(chunks))
    ids = np.random.default_rng(0).integers(0, 256, 128).astype(np.int32)
    t1 = time.perf_counter()
    np.asarray(runner.step(*runner.prepare_inputs(ids, chunks, bt)))
    compile_s = time.perf_counter() - t1
    walls, preps, launches = time_steps(runner, ids, chunks, bt, 30, warm=0)
    med = lambda xs: 1e3 * sorted(xs)[len(xs) // 2]  # noqa: E731
    trace_dir = tempfile.mkdtemp(prefix="jds_trace_")
    opts = profiler.ProfileOptions()
    opts.host_tracer_level = 2
    opts.python_tracer_level = 0
    marks: list[tuple[str, int, int]] = []
    now = time.time_ns
    profiler.start_trace(trace_dir, profiler_options=opts)
    for _ in range(steps):
        with profiler.TraceAnnotation("jds_step"):
            m0 = now()
            with profiler.TraceAnnotation("jds_prepare"):
                inputs = runner.prepare_inputs(ids, chunks, bt)
            m1 = now()
            with profiler.TraceAnnotation("jds_launch"):
                logits = runner.step(*inputs)
            m2 = now()
            with profiler.TraceAnnotation("jds_sync"):  # the greedy ids back, as TTFT (``time_steps``) ends
                np.asarray(greedy_tokens_host(logits)[1])
            m3 = now()
        marks += [("jds_step", m0, m3), ("jds_prepare", m0, m1), ("jds_launch", m1, m2), ("jds_sync", m2, m3)]
    profiler.stop_trace()
    with open(os.path.join(trace_dir, "jds_marks.json"), "w") as f:
        json.dump(marks, f)
    if keep_trace:  # the raw trace and the marks, flat, to re-read elsewhere (``read_trace(dir, marks)``)
        os.makedirs(keep_trace, exist_ok=True)
        name = f"{arch}_{mode}_{layers}l"
        for src in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
            shutil.copy(src, os.path.join(keep_trace, f"{name}.xplane.pb"))
        shutil.copy(os.path.join(trace_dir, "jds_marks.json"), os.path.join(keep_trace, f"{name}_marks.json"))
    try:
        res = read_trace(trace_dir, marks)
    except ValueError as e:  # a trace without the step annotations: keep the untraced timings
        res = {"trace_error": str(e)[:2000], "window_ms": {}}
    res.update(layers=layers, mode=mode, arch=arch, build_s=t1 - t0, first_step_s=compile_s,
               untraced_wall_ms_median=med(walls), untraced_prepare_ms_median=med(preps),
               untraced_launch_ms_median=med(launches),
               dispatches=vars(runner.last_dispatch))
    del runner
    jax.clear_caches()
    return res


def _child(a: argparse.Namespace) -> None:
    from jds.bench.results import write_json

    import jax

    out: dict[str, Any] = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "backend": jax.default_backend(),
                           "device": str(jax.devices()[0].device_kind), "depths": {}}
    kw = json.loads(a.runner_kw)
    for layers in a.layers:
        out["depths"][str(layers)] = profile_depth(a.arch, layers, a.mode, a.steps, a.implementation, kw, a.size,
                                                   a.intermediate, a.moe_experts, a.keep_trace)
        d = out["depths"][str(layers)]
        print(json.dumps({"layers": layers, "window_ms": d["window_ms"], "gpu": d.get("gpu"),
                          "wall_ms": d["untraced_wall_ms_median"]}), flush=True)
        write_json(a.child_out, out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="v32", choices=("v32", "v4"))
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--mode", default="fused", choices=("wide", "narrow", "fused"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--intermediate", type=int, default=None, help="dense MLP width (default: the preset's)")
    ap.add_argument("--moe-experts", type=int, default=0, help="routed experts per layer (0: dense MLP)")
    ap.add_argument("--size", default="bench", choices=("bench", "tiny"), help="tiny: the CPU presets")
    ap.add_argument("--implementation", default="auto", choices=("auto", "xla", "pallas"))
    ap.add_argument("--runner-kw", default="{}", help="JSON dict of extra RunnerConfig fields")
    ap.add_argument("--update-modes", nargs="*", default=[],
                    help="also profile under these command-buffer update modes (one process each)")
    ap.add_argument("--update-mode-layers", type=int, default=8)
    ap.add_argument("--no-graph", action="store_true", help="also profile with command buffers off")
    ap.add_argument("--keep-trace", default=None, help="copy each depth's raw trace (+ step marks) under this dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child_out:
        _child(a)
        return
    from jds.bench.results import write_json

    res: dict[str, Any] = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                    "command": " ".join(["python -m jds.bench.host_profile"] + sys.argv[1:]),
                                    "complete": False},
                           "variants": {}}
    variants = [("default", "", a.layers)]
    variants += [(m, f"--xla_gpu_command_buffer_update_mode={m}", [a.update_mode_layers]) for m in a.update_modes]
    if a.no_graph:
        variants.append(("no_command_buffers", "--xla_gpu_enable_command_buffer=", [a.update_mode_layers]))
    base = [sys.executable, "-m", "jds.bench.host_profile", "--arch", a.arch, "--mode", a.mode, "--steps",
            str(a.steps), "--size", a.size, "--moe-experts", str(a.moe_experts), "--implementation",
            a.implementation, "--runner-kw", a.runner_kw, "--out", a.out]
    if a.intermediate:
        base += ["--intermediate", str(a.intermediate)]
    if a.keep_trace:
        base += ["--keep-trace", a.keep_trace]
    for name, flags, layers in variants:
        part = os.path.abspath(f"{a.out}.{name}.part.json")
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        rc = subprocess.run(base + ["--layers", *map(str, layers), "--child-out", part], env=env).returncode
        res["variants"][name] = json.load(open(part)) if os.path.exists(part) else {}
        res["variants"][name]["rc"] = rc
        if os.path.exists(part):
            os.remove(part)
        write_json(a.out, res)
    res["meta"]["complete"] = all(v["rc"] == 0 for v in res["variants"].values())
    write_json(a.out, res)


if __name__ == "__main__":
    main()
