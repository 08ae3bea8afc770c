"""Where a model step's device time goes, kernel by kernel, with each kernel's source line in jds.

The step of the 8-layer benchmark stack (``jds.bench.stack``, fused mode, one captured executable per step) runs
``--steps`` times under ``jax.profiler``; the GPU timeline's kernels are split into steps
(``jds.bench.timing.split_calls``) and summed per kernel name (median over steps). Each name is looked up in the
runner's optimised HLO (``RunnerConfig.dump_dir``): an XLA fusion's kernel carries its instruction's name, whose
``metadata`` names the jax op and the source line that made it. Kernels are then summed per source line, which
is what one reads to find a stage that costs more than it should (the sixty-fourth session found V3.2's
float32 absorption and V4's float32 compressor GEMM this way, by hand).

A cuBLAS GEMM's kernel is named by cuBLAS (``sm90_xmma_gemm_...``, ``nvjet_...``), not by its instruction; such
kernels are listed by name alone. A Pallas kernel is ``<kernel_name>_mosaic_gpu_kernel`` or its Triton name.

    python3 scripts/diag/step_kernels.py --arch v4 --layers 8 [--fp8-weights] \
        [--shapes ttft_128 decode_b64_ctx4096] [--steps 10] [--top 40] --out F.json

Native only (the timeline needs a GPU). Two runs' outputs compared (any machine), shape by shape, by source
function (line numbers left out: they move between the trees an A/B compares):

    python3 scripts/diag/step_kernels.py --diff BASE.json NEW.json [--top 12]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from typing import Any

_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}')
_TABLE_ROW = re.compile(r'^(\d+) (.*)$')


def _tables(text: str) -> dict[str, dict[int, str]]:
    """The HLO text's source tables (FileNames, FunctionNames, FileLocations, StackFrames): row id -> text."""
    tables: dict[str, dict[int, str]] = {}
    cur: dict[int, str] | None = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            cur = tables.setdefault(line, {})
        elif cur is not None:
            m = _TABLE_ROW.match(line)
            if m:
                cur[int(m.group(1))] = m.group(2)
            else:
                cur = None
    return tables


def _frames(tables: dict[str, dict[int, str]], depth: int) -> dict[int, str]:
    """Stack frame id -> its innermost ``depth`` frames in jds / pallas_kernels (runner.py left out), innermost
    first. A frame row's parent_frame_id is one more than its parent's row id (0: none)."""
    files = {i: v.strip('"') for i, v in tables.get("FileNames", {}).items()}
    funcs = {i: v.strip('"') for i, v in tables.get("FunctionNames", {}).items()}
    locs = {}
    for i, v in tables.get("FileLocations", {}).items():
        kv = dict(re.findall(r"(\w+)=(\d+)", v))
        f = files.get(int(kv.get("file_name_id", 0)), "")
        short = f[f.rfind("/jds/") + 1:] if "/jds/" in f else f[f.rfind("/pallas_kernels/") + 1:] \
            if "/pallas_kernels/" in f else ""
        if short and short != "jds/runner.py":
            fn = funcs.get(int(kv.get("function_name_id", 0)), "").rsplit(".", 1)[-1]
            locs[i] = f"{short.split('/', 1)[1]}:{kv.get('line', '')}({fn})"
    parents = {}
    for i, v in tables.get("StackFrames", {}).items():
        kv = dict(re.findall(r"(\w+)=(\d+)", v))
        parents[i] = (int(kv.get("file_location_id", 0)), int(kv.get("parent_frame_id", 0)) - 1)
    out = {}
    for i in parents:
        chain, j, seen = [], i, set()
        while j > 0 and j not in seen and len(chain) < depth:
            seen.add(j)
            loc, j = parents.get(j, (0, 0))
            if loc in locs:
                chain.append(locs[loc])
        out[i] = " < ".join(chain)
    return out


def kernel_key(name: str) -> str:
    """An instruction's name as its GPU kernel is named (XLA sanitises '.' and '-' to '_')."""
    return re.sub(r"[.\-]", "_", name)


def hlo_sources(dump_dir: str, depth: int = 3) -> dict[str, dict[str, str]]:
    """Instruction name -> {op_name, source} from every after-optimisation HLO text in ``dump_dir``; source:
    the innermost ``depth`` frames of the jax call stack that made it, in jds / pallas_kernels."""
    out: dict[str, dict[str, str]] = {}
    for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        with open(path) as f:
            text = f.read()
        frames = _frames(_tables(text), depth)
        for line in text.splitlines():
            m = _INSTR.match(line)
            if not m:
                continue
            op = re.search(r'op_name="([^"]*)"', m.group(2))
            fid = re.search(r"stack_frame_id=(\d+)", m.group(2))
            out.setdefault(kernel_key(m.group(1)), {"op_name": op.group(1) if op else "",
                                        "source": frames.get(int(fid.group(1)), "") if fid else ""})
    return out


def profile_steps(runner: Any, ids: Any, chunks: Any, bt: Any, steps: int) -> dict[str, Any]:
    """The steps' kernels off the GPU timeline, per name (``timeline_calls``), after three steps of warm-up."""
    import numpy as np

    from jds.bench.timing import timeline_calls

    def step() -> None:
        np.asarray(runner.step(*runner.prepare_inputs(ids, chunks, bt)))

    for _ in range(3):
        step()
    return timeline_calls(step, steps, by_kernel=True)


def by_source(per_kernel: dict[str, float], sources: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """Kernel µs per step summed by source line (kernels without one by their own name)."""
    acc: dict[str, dict[str, Any]] = defaultdict(lambda: {"us": 0.0, "kernels": 0, "ops": set()})
    for name, us in per_kernel.items():
        s = sources.get(kernel_key(name), {})
        key = s.get("source") or name
        acc[key]["us"] += us
        acc[key]["kernels"] += 1
        if s.get("op_name"):
            acc[key]["ops"].add(s["op_name"].rsplit("/", 1)[-1])
    rows = [{"source": k, "us": v["us"], "kernels": v["kernels"], "ops": sorted(v["ops"])[:6]} for k, v in acc.items()]
    return sorted(rows, key=lambda r: -r["us"])


def source_key(source: str, frames: int = 2) -> str:
    """A by_source row's name without line numbers, its innermost ``frames`` frames (``v32.py:194(_per_head) <
    v32.py:200(_absorb_uk) < ...`` -> ``v32.py(_per_head) < v32.py(_absorb_uk)``); kernel names pass unchanged."""
    return " < ".join(re.sub(r":\d+\(", "(", f) for f in source.split(" < ")[:frames])


def diff_runs(base: dict[str, Any], new: dict[str, Any], top: int = 12) -> dict[str, Any]:
    """Per shape both runs have: busy µs of each, and the ``top`` source keys whose µs per step changed most."""
    out: dict[str, Any] = {}
    for shape, b in base.get("shapes", {}).items():
        n = new.get("shapes", {}).get(shape)
        if n is None or "by_source" not in b or "by_source" not in n:
            continue
        sums: list[dict[str, float]] = []
        for run in (b, n):
            acc: dict[str, float] = defaultdict(float)
            for r in run["by_source"]:
                acc[source_key(r["source"])] += r["us"]
            sums.append(acc)
        keys = sorted(set(sums[0]) | set(sums[1]), key=lambda k: -abs(sums[1].get(k, 0.0) - sums[0].get(k, 0.0)))
        out[shape] = {"busy_us": (b.get("profile_busy_us"), n.get("profile_busy_us")),
                      "changes": [(k, sums[0].get(k, 0.0), sums[1].get(k, 0.0)) for k in keys[:top]]}
    return out


def print_diff(diff: dict[str, Any]) -> None:
    for shape, d in diff.items():
        b, n = d["busy_us"]
        print(f"== {shape}: busy {b:.1f} -> {n:.1f} us ({n - b:+.1f})")
        for k, ub, un in d["changes"]:
            print(f"  {ub:9.1f} -> {un:9.1f} ({un - ub:+8.1f})  {k[:100]}")


def _fusions(dump: str, per_kernel: dict[str, float], sources: dict[str, dict[str, str]], regex: str | None,
             top: int) -> list[str]:
    """``--fusions``: hlo_fusions.py's text for the top kernels whose source matches ``regex``."""
    if not regex:
        return []
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # this directory's tool, whether this script runs by path or is loaded as a module
        sys.path.insert(0, here)
    from hlo_fusions import describe_dump  # noqa: PLC0415

    rx = re.compile(regex)
    names = [kernel_key(k) for k, _ in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
             if rx.search(sources.get(kernel_key(k), {}).get("source", ""))]
    return describe_dump(dump, names) if names else []


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--diff":
        dp = argparse.ArgumentParser(description="two step_kernels.py outputs compared by source function")
        dp.add_argument("--diff", nargs=2, metavar=("BASE", "NEW"), required=True)
        dp.add_argument("--top", type=int, default=12)
        d = dp.parse_args(argv)
        with open(d.diff[0]) as fb, open(d.diff[1]) as fn:
            print_diff(diff_runs(json.load(fb), json.load(fn), d.top))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="v4", choices=("v32", "v4"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--fp8-weights", action="store_true")
    ap.add_argument("--size", default="bench", choices=("bench", "tiny"))
    ap.add_argument("--shapes", nargs="+", default=["ttft_128", "decode_b64_ctx4096"])
    ap.add_argument("--ctx", type=int, default=4096, help="the runner's context (decode shapes name theirs)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--captured-options", default=None,
                    help="JSON of XLA options for the captured step (RunnerConfig.captured_compiler_options), e.g. "
                         "'{\"xla_gpu_enable_triton_gemm\": false}'")
    ap.add_argument("--fusions", default=None, metavar="REGEX",
                    help="keep the optimised HLO (scripts/diag/hlo_fusions.py) of the top kernels whose source "
                         "matches REGEX, per shape, in the output's 'fusions'")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import jax
    import numpy as np

    from jds.bench.results import write_json
    from jds.bench.stack import block_table, build_stack, make_runner, step_shapes
    from jds.runner import StepInputs

    model = build_stack(a.arch, a.layers, intermediate=a.intermediate, size=a.size, fp8_weights=a.fp8_weights)
    res: dict[str, Any] = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                    "command": " ".join(["python3 scripts/diag/step_kernels.py"] + argv),
                                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
                                    "arch": a.arch, "layers": a.layers, "fp8_weights": a.fp8_weights,
                                    "steps": a.steps, "captured_options": a.captured_options}, "shapes": {}}
    for shape in a.shapes:
        with tempfile.TemporaryDirectory() as dump:
            try:
                opts = json.loads(a.captured_options) if a.captured_options else None
                runner = make_runner(model, "fused", 64, a.ctx, input_prep="device", dump_dir=dump,
                                     captured_compiler_options=opts)
                chunks = step_shapes(a.ctx)[shape]
                bt = block_table(runner, len(chunks))
                ids = np.random.default_rng(0).integers(0, 256, sum(c.num_tokens for c in chunks)).astype(np.int32)
                first = runner.prepare_inputs(ids, chunks, bt)[0]
                if isinstance(first, StepInputs):
                    runner.warmup(buckets=[(first.token_bucket, first.key_blocks)])
                prof = profile_steps(runner, ids, chunks, bt, a.steps)
                sources = hlo_sources(dump)
                fusions = _fusions(dump, prof.get("profile_kernel_us", {}), sources, a.fusions, a.top)
            except Exception as e:  # noqa: BLE001 - a shape that fails records why; the others still run
                res["shapes"][shape] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                print(json.dumps({shape: res["shapes"][shape]}), flush=True)
                continue
            finally:
                jax.clear_caches()
        per_kernel = prof.pop("profile_kernel_us", {})
        launches = prof.pop("profile_kernel_launches", {})
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:a.top]
        row = {**prof, "by_source": by_source(per_kernel, sources)[:a.top],
               "top_kernels": [{"kernel": k, "us": us, "launches": launches.get(k), **sources.get(kernel_key(k), {})}
                               for k, us in top],
               **({"fusions": fusions} if fusions else {})}
        res["shapes"][shape] = row
        print(f"== {shape}: span {prof.get('profile_span_us', 0):.1f} us, busy {prof.get('profile_busy_us', 0):.1f},"
              f" {prof.get('profile_kernels')} kernels", flush=True)
        for r in row["by_source"][:25]:
            print(f"  {r['us']:9.1f} us  {r['kernels']:4d}  {r['source'][:70]:70s} {','.join(r['ops'])[:80]}")
        write_json(a.out, res)


if __name__ == "__main__":
    main()
