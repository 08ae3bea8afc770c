"""How often does XLA re-record a captured step's command buffer, and how many allocations moved?

    python -m jds.bench.graph_updates --arch v32 --layers 8 --intermediate 18432 \
        --variants fused:device fused:host fused:device:4 --update-modes ALWAYS_UPDATE SKIP_TEMP \
        --out benchmarks/results/graph_updates_<device>_<date>.json

Why: a host trace of the fused step (``host_profile``) named ``command_buffer::update`` + ``cuGraphLaunch`` as
the launch cost that grows with depth, and device-side input preparation did not shrink the launch. The
trace cannot say *which* buffers moved. XLA's CommandBufferThunk logs at VLOG(3) one line per execution
and, before it, one line per update with the number of buffer allocations whose address changed
(openxla/xla ``command_buffer_thunk.cc``). Counting those lines per step says whether updates happen at all,
how many allocations move, and how long the re-recording takes (``Updated command buffer in N μs``).

Each update mode runs in its own child process (the mode picks XLA's allocator at client creation, and
the VLOG setting must be in the environment before XLA loads). Per runner variant, three phases of ``n``
steps after warm-up:
  serial_drop   each step (launch + greedy sample on the device) waits for its tokens, dropped before the next
  serial_keep   each step waits, and the previous step's tokens stay alive during the next (what a caller
                holding its result does)
  in_flight_2   step i+1 is launched before step i's tokens are read (the async engine's pattern)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

MARK = "JDS_GRAPH_PHASE"
_UPDATE = re.compile(r"Update command buffer .*updated_allocs=(\d+)")
_UPDATED = re.compile(r"Updated command buffer in (\d+)")
_EXEC = re.compile(r"Execute command buffer")


def parse_log(text: str) -> dict[str, dict[str, Any]]:
    """Per phase (between ``MARK`` lines): executions, updates, moved allocations and re-record time."""
    phases: dict[str, dict[str, Any]] = {}
    cur: dict[str, Any] | None = None
    for line in text.splitlines():
        if MARK in line:
            name = line.split(MARK, 1)[1].strip()
            cur = None if name == "end" else phases.setdefault(
                name, {"executions": 0, "updates": 0, "updated_allocs": [], "update_us": 0, "lines": []})
            continue
        if cur is None:
            continue
        if "command buffer" in line.lower() and len(cur["lines"]) < 6:
            cur["lines"].append(line[-300:])  # a sample, to check what XLA logged
        if m := _UPDATE.search(line):
            cur["updates"] += 1
            cur["updated_allocs"].append(int(m.group(1)))
        elif m := _UPDATED.search(line):
            cur["update_us"] += int(m.group(1))
        elif _EXEC.search(line):
            cur["executions"] += 1
    return phases


def top_level_lines(dump_dir: str, limit: int = 40) -> dict[str, list[str]]:
    """Per dumped captured module: its top-level thunk lines (what is not inside a command buffer, and where
    the command buffers split), from XLA's ``*thunk_sequence_after_thunk_passes.txt``."""
    import glob

    out = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence_after_thunk_passes.txt"))):
        with open(path) as f:
            lines = [ln.rstrip() for ln in f if ln.strip()]
        base = min((len(ln) - len(ln.lstrip()) for ln in lines), default=0)
        out[os.path.basename(path).split(".thunk_sequence")[0]] = [
            ln.strip()[:200] for ln in lines if len(ln) - len(ln.lstrip()) == base][:limit]
    return out


def _phase(name: str) -> None:
    print(f"{MARK} {name}", file=sys.stderr, flush=True)


def child(a: argparse.Namespace) -> None:
    import jax
    import numpy as np

    from jds.bench.stack import block_table, build_stack, make_runner, step_shapes
    from jds.bench.stats import median
    from jds.sampling import greedy_tokens

    model = build_stack(a.arch, a.layers, intermediate=a.intermediate, size=a.size, implementation=a.implementation,
                        moe_experts=a.moe_experts, moe_topk=a.moe_topk)
    chunks = step_shapes(512)["ttft_128"]
    ids = np.random.default_rng(0).integers(0, 256, 128).astype(np.int32)
    out: dict[str, Any] = {}
    for v in a.variants:
        parts = v.split(":")
        dump = os.path.join(a.dump, v.replace(":", "_")) if a.dump else None
        runner = make_runner(model, parts[0], 64, 512, input_prep=parts[1],
                             segments=int(parts[2]) if len(parts) > 2 else 1, dump_dir=dump)
        bt = block_table(runner, 1)
        # a step as the engine runs it: launch, then the greedy sample on the device (its tokens are what a
        # caller keeps; the logits are valid until the next step); launch time = the runner's step call
        launch: dict[str, list[float]] = {"serial_drop": [], "serial_keep": [], "in_flight_2": []}

        def step(phase: str | None = None) -> jax.Array:
            inputs = runner.prepare_inputs(ids, chunks, bt)
            t = time.perf_counter()
            logits = runner.step(*inputs)
            if phase:
                launch[phase].append(time.perf_counter() - t)
            return greedy_tokens(logits)

        for _ in range(5):
            np.asarray(step())
        _phase(f"{v}|serial_drop")
        for _ in range(a.n):
            np.asarray(step("serial_drop"))
        _phase(f"{v}|serial_keep")
        tok = step()
        np.asarray(tok)
        for _ in range(a.n):
            nxt = step("serial_keep")
            np.asarray(nxt)
            tok = nxt
        _phase(f"{v}|in_flight_2")
        prev = step()
        for _ in range(a.n):
            nxt = step("in_flight_2")
            np.asarray(prev)
            prev = nxt
        np.asarray(prev)
        _phase("end")
        out[v] = {k: median(x, 1e3) for k, x in launch.items()}
        if dump:
            out[v]["top_level_thunks"] = top_level_lines(dump)
        del runner, tok, nxt, prev
        jax.clear_caches()
    print("JDS_RESULT " + json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="v32", choices=("v32", "v4"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--size", default="bench", choices=("bench", "tiny"))
    ap.add_argument("--moe-experts", type=int, default=0, help="routed experts per layer (0: dense MLP)")
    ap.add_argument("--moe-topk", type=int, default=8)
    ap.add_argument("--implementation", default="auto", choices=("auto", "xla", "pallas"))
    ap.add_argument("--variants", nargs="+", default=["fused:device", "fused:host"])
    ap.add_argument("--update-modes", nargs="+", default=["ALWAYS_UPDATE"])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per child process")
    ap.add_argument("--dump", default=None, help="XLA dump directory: record each captured module's top-level thunks")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the update mode of this child
    a = ap.parse_args(argv)
    if a.child:
        if a.child != "ALWAYS_UPDATE":
            from jds.bench.cli import use_graph_update_mode

            use_graph_update_mode(a.child)
        child(a)
        return
    from jds.bench.results import write_json

    res: dict[str, Any] = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                    "command": " ".join(["python -m jds.bench.graph_updates"] + sys.argv[1:]),
                                    "arch": a.arch, "layers": a.layers, "intermediate": a.intermediate,
                                    "moe_experts": a.moe_experts, "moe_topk": a.moe_topk,
                                    "n": a.n, "complete": False}, "update_modes": {}}
    env = {**os.environ, "TF_CPP_VMODULE": "command_buffer_thunk=3", "TF_CPP_MIN_LOG_LEVEL": "0"}
    for mode in a.update_modes:
        cmd = [sys.executable, "-m", "jds.bench.graph_updates", "--child", mode, "--arch", a.arch,
               "--layers", str(a.layers), "--size", a.size, "--moe-experts", str(a.moe_experts),
               "--moe-topk", str(a.moe_topk)] + (["--dump", os.path.join(a.dump, mode)] if a.dump else []) + [
               "--implementation", a.implementation, "--n", str(a.n),
               "--variants", *a.variants] + (["--intermediate", str(a.intermediate)] if a.intermediate else [])
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
            rc, stdout, stderr = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
            stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
        phases = parse_log(stderr)
        launch = {}
        for line in stdout.splitlines():
            if line.startswith("JDS_RESULT "):
                launch = json.loads(line[len("JDS_RESULT "):])
        rows: dict[str, Any] = {v: {"top_level_thunks": r["top_level_thunks"]}
                                for v, r in launch.items() if "top_level_thunks" in r}
        for key, ph in phases.items():
            v, phase = key.split("|")
            steps = a.n if phase == "serial_drop" else a.n + 1  # the later phases start one step early
            rows.setdefault(v, {})[phase] = {
                "steps": steps, "executions_logged": ph["executions"], "updates": ph["updates"],
                "updates_per_step": ph["updates"] / steps,
                "updated_allocs_mean": (sum(ph["updated_allocs"]) / len(ph["updated_allocs"])
                                        if ph["updated_allocs"] else 0.0),
                "update_us_per_step": ph["update_us"] / steps,
                "launch_ms_median": launch.get(v, {}).get(phase), "log_sample": ph["lines"]}
        res["update_modes"][mode] = {"rc": rc, "variants": rows,
                                     "vlog_seen": any(p["lines"] for p in phases.values()),
                                     "stderr_tail": stderr[-1500:] if rc != 0 else ""}
        print(json.dumps({mode: rows}), flush=True)
        if a.out:
            write_json(a.out, res)
    res["meta"]["complete"] = all(m["rc"] == 0 and m["vlog_seen"] for m in res["update_modes"].values())
    if a.out:
        write_json(a.out, res)


if __name__ == "__main__":
    main()
