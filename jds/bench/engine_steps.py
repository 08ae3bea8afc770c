"""Decode through the engine alone (no HTTP server): time per output token at concurrency 1 and where the
engine thread spends it, with async stepping on and off, on one runner.

    python -m jds.bench.engine_steps --preset v32-bench --out benchmarks/results/engine_steps_<device>_<date>.json

Why: the server's time per output token at concurrency 1 (``jds.bench.serve_modes``) is above the device
step. This splits the difference: if the engine loop alone decodes at the device step, the rest is the
server's (event loop, GIL hand-offs); if not, the split says which engine phase holds the host. Per step:
the runner's ``submit`` (input packing, launch, sampling dispatch; ``execute`` when synchronous) and the rest
(scheduling, waiting for the previous step's tokens, applying them). The runner settings are the server's defaults for the
``--num-blocks`` / bucket flags given.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any

import numpy as np


def decode_requests(engine: Any, n: int, prompt_len: int, out_len: int, seed: int = 0) -> dict[str, Any]:
    """``n`` requests one after another; per-step wall time and its phases over the decode steps."""
    from jds.bench.stats import median
    from jds.engine.request import SamplingParams

    rng = np.random.default_rng(seed)
    runner = engine.runner
    t_sub: list[float] = []

    def timed(fn: Any) -> Any:  # the runner's entry point, its host time recorded per call
        def call(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t_sub.append(time.perf_counter() - t)
        return call

    # instance attributes shadowing the methods, removed below
    runner.submit, runner.execute = timed(getattr(runner, "submit", None)), timed(runner.execute)
    steps: list[float] = []
    subs: list[float] = []
    try:
        for i in range(n):
            prompt = rng.integers(1, 250, prompt_len).tolist()
            engine.add_request(f"bench-{seed}-{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0.0,
                                                                            ignore_eos=True), time.monotonic())
            first = True
            while engine.has_work():
                t_sub.clear()
                t = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t
                if not first:  # the prefill step is not a decode step
                    steps.append(dt)
                    subs.append(sum(t_sub))
                first = False
    finally:
        del runner.submit, runner.execute
    med = lambda xs: median(xs, 1e3) if xs else None  # noqa: E731
    return {"decode_steps": len(steps), "ms_per_step_median": med(steps), "ms_per_step_mean": 1e3 * float(np.mean(steps)),
            "submit_or_execute_ms_median": med(subs),
            "rest_ms_median": med([s - u for s, u in zip(steps, subs)])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v32-bench")
    ap.add_argument("--mode", default="fused", choices=("wide", "narrow", "fused"))
    ap.add_argument("--num-blocks", type=int, default=600)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--token-buckets", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--key-block-buckets", type=int, nargs="+", default=[4])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run (the GIL hand-off period; Python's default is 0.005)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    import jax

    from jds.bench.results import write_json
    from jds.config import RunnerConfig
    from jds.engine.core import Engine
    from jds.runner import ModelRunner

    cfg = RunnerConfig(mode=a.mode, num_blocks=a.num_blocks, max_num_seqs=a.max_num_seqs,
                       max_num_tokens=a.max_num_tokens, max_model_len=a.max_model_len,
                       token_buckets=tuple(a.token_buckets), key_block_buckets=tuple(a.key_block_buckets))
    t0 = time.perf_counter()
    runner = ModelRunner.build(preset=a.preset, runner=cfg)
    runner.warmup()
    runner.warmup_submit()
    res: dict[str, Any] = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                    "command": " ".join(["python -m jds.bench.engine_steps"] + sys.argv[1:]),
                                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
                                    "backend": jax.default_backend(), "build_and_warmup_s": time.perf_counter() - t0,
                                    "switch_interval": sys.getswitchinterval(), "complete": False},
                           "engines": {}}
    for name, async_steps in (("async", True), ("sync", False)):
        engine = Engine(runner, async_steps=async_steps)
        decode_requests(engine, 1, a.prompt_len, 8, seed=99)  # warm the path
        res["engines"][name] = decode_requests(engine, a.requests, a.prompt_len, a.output_len)
        print(name, res["engines"][name], flush=True)
        write_json(a.out, res)
    res["meta"]["complete"] = True
    write_json(a.out, res)


if __name__ == "__main__":
    main()
