"""Where the torch comparator's step spends its GPU time, per stage: the measured side of each stand-in's
expected gap (the docstrings of ``torch_kernels`` / ``triton_kernels`` say what each stage stands in for).

    python -m jds.compare.torch_profile --arch v32 --layers 8 --out torch_stages.json

Each step runs in ``eager`` mode (every op launched by the host, so the profiler attributes each kernel to
the stage that launched it) under ``torch.profiler`` with one ``record_function`` range per stage; a
stage's device time is the sum of the durations of the kernels launched inside its range (one stream, so
they do not overlap), per step, summed over the layers. The graph modes run the same kernels; only their launch cost differs.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections import defaultdict
from typing import Any, Callable

import numpy as np

# piece function name (jds.compare.torch_stack) -> stage label in the table
STAGES = {"inputs": "inputs", "embed": "embed",
          "pre": "attn norm + q/kv projections",
          "prep": "norm / RoPE / cache insert + indexer prep",
          "sel": "indexer logits + top-k",
          "att": "sparse MQA + W_UV",
          "post": "wo + FFN",
          "head": "final norm + lm_head"}
PREFIX = "jds.stage."


def _named(fn: Callable[[dict], dict], name: str) -> Callable[[dict], dict]:
    import torch

    def run(env: dict) -> dict:
        with torch.profiler.record_function(PREFIX + name):
            return fn(env)

    return run


def instrument(model: Any) -> None:
    """Wrap every piece of ``model`` (a ``TorchDecoder``) in a profiler range named by its stage."""
    orig = model.pieces

    def pieces() -> list[tuple[str, Callable[[dict], dict]]]:
        out = []
        for role, fn in orig():
            name = fn.__name__ if fn.__name__ in STAGES else "head"
            out.append((role, _named(fn, name)))
        return out

    model.pieces = pieces


def stage_times(runner: Any, ids: np.ndarray, chunks: list, bt: np.ndarray, n: int = 5, warm: int = 3
                ) -> dict[str, dict[str, float]]:
    """Per stage: device µs and host µs per step (means over ``n`` profiled steps), plus ``total``."""
    import torch

    for _ in range(warm):
        runner.execute(ids, chunks, bt)
    cuda = runner.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(runner.device)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            runner.execute(ids, chunks, bt)
        if cuda:
            torch.cuda.synchronize(runner.device)
    dev: dict[str, float] = defaultdict(float)
    host: dict[str, float] = defaultdict(float)
    for e in prof.events():
        # the CPU-side range only: the profiler also puts a same-named annotation on the GPU timeline, which
        # spans the idle gaps between the range's kernels (an eager step is host-bound)
        if e.name.startswith(PREFIX) and e.device_type == torch.autograd.DeviceType.CPU:
            s = e.name[len(PREFIX):]
            dev[s] += e.device_time_total if cuda else 0.0
            host[s] += e.cpu_time_total
    out = {s: {"device_us": dev[s] / n, "host_us": host[s] / n} for s in STAGES if s in host}
    out["total"] = {"device_us": sum(v["device_us"] for v in out.values()),
                    "host_us": sum(v["host_us"] for v in out.values())}
    return out


def profile_arch(arch: str, layers: int, inter: int | None, ctx: int, shapes: list[str], size: str = "bench",
                 indexer_kernel: str = "torch", n: int = 5, fp8_weights: bool = False) -> dict:
    """``stage_times`` of the comparator's eager step for each named step shape of ``jds.bench.stack``."""
    import torch

    from jds.bench.stack import step_shapes
    from jds.compare.torch_bench import torch_stack
    from jds.compare.torch_stack import TorchDecoder, TorchStepRunner

    dev, cfg, params, nb, bt, outs = torch_stack(arch, layers, inter, ctx, size, fp8_weights=fp8_weights)
    tm = TorchDecoder(cfg, params, nb, dev, indexer_kernel, outs)
    instrument(tm)
    runner = TorchStepRunner(tm, "eager")
    all_shapes = step_shapes(ctx)
    out: dict = {"arch": arch, "layers": layers, "indexer_kernel": indexer_kernel, "torch": torch.__version__,
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "shapes": {}}
    for name in shapes:
        if name not in all_shapes:
            raise ValueError(f"shape must be one of {sorted(all_shapes)}, got {name!r}")
        chunks = all_shapes[name]
        ids = np.random.default_rng(0).integers(0, 256, sum(c.num_tokens for c in chunks)).astype(np.int32)
        out["shapes"][name] = stage_times(runner, ids, chunks, bt[: len(chunks)], n=n)
    return out


def table(res: dict) -> str:
    """One text table: stage rows, device ms per step for each shape (share of the step in brackets); host
    ms where no kernel time was recorded (a CPU run)."""
    shapes = list(res["shapes"])
    key = "device_us" if any(d["total"]["device_us"] for d in res["shapes"].values()) else "host_us"
    rows = [[f"stage ({key[:-3]} ms / step)"] + shapes]
    for s, label in list(STAGES.items()) + [("total", "total")]:
        cells = []
        for sh in shapes:
            d = res["shapes"][sh]
            if s not in d:
                cells.append("-")
                continue
            tot = d["total"][key] or 1.0
            cells.append(f"{d[s][key] / 1e3:.3f} ({100 * d[s][key] / tot:.0f}%)")
        rows.append([label] + cells)
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)) for r in rows)


def main(argv: list[str] | None = None) -> None:
    from jds.bench.results import write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="+", default=["v32"], choices=("v32", "v4"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default: v32 18432, v4 2048)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--size", choices=("bench", "tiny"), default="bench")
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="step shapes (default: ttft_128, prefill_64x128_step, decode_b1/b64 at --ctx)")
    ap.add_argument("--torch-indexer", nargs="+", default=["torch", "triton"], choices=("torch", "triton"))
    ap.add_argument("--n", type=int, default=5, help="profiled steps per shape")
    ap.add_argument("--fp8-weights", action="store_true",
                    help="the linears as an FP8 checkpoint stores them (torch_kernels.fp8_linear)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    shapes = a.shapes or ["ttft_128", "prefill_64x128_step", f"decode_b1_ctx{a.ctx}", f"decode_b64_ctx{a.ctx}"]
    cmd = " ".join(["python -m jds.compare.torch_profile"] + (sys.argv[1:] if argv is None else argv))
    res: dict = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "command": cmd,
                          "fp8_weights": a.fp8_weights, "complete": False}, "runs": {}}
    for arch in a.arch:
        inter = a.intermediate or (18432 if arch == "v32" else 2048)
        for kern in a.torch_indexer:
            r = profile_arch(arch, a.layers, inter, a.ctx, shapes, a.size, kern, a.n, a.fp8_weights)
            res["meta"].setdefault("device", r["device"])
            res["meta"].setdefault("torch", r["torch"])
            res["runs"][f"{arch}/{kern}"] = r
            write_json(a.out, res)
            print(f"\n== {arch}, {a.layers} layers, indexer {kern}: torch eager step, device time per stage ==\n"
                  + table(r), flush=True)
    res["meta"]["complete"] = True
    write_json(a.out, res)


if __name__ == "__main__":
    main()
