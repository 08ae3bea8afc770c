#!/usr/bin/env python
"""Batch invariance and its cost: the same requests alone and together under page pressure, per runner
configuration, plus decode throughput; one JSON.

    python scripts/bench_batch_invariant.py --preset v32-bench            # the H200 run (issue 23)
    python scripts/bench_batch_invariant.py --preset v32-tiny --greedy 6 --seeded 4 --num-blocks 16 \
        --prompt-len 8 60 --max-tokens 12 --throughput-seqs 4 --throughput-prompt-len 32 \
        --throughput-tokens 16 --max-model-len 128 --max-num-tokens 32                      # CPU smoke run

Configurations (``--configs``), each one runner, one warmup, then the measurements:
  default     the runner's bucket ladders (token buckets and key-block buckets)
  token_only  one token bucket (max_num_tokens), the default key-block ladder: shows whether fixing the
              GEMM shapes alone is enough on this device
  invariant   ``batch_invariant=True`` (one token bucket and one key-block bucket)

Invariance: ``--greedy`` greedy and ``--seeded`` seeded (temperature 1, top-p 0.95) requests are run one
at a time ("alone", the reference) and then all at once in a pool of ``--num-blocks`` pages, which
forces chunked prefills, co-batching and preemption by recompute; a request counts as identical when
its whole token list equals its alone run. The first ``--repeat`` requests are also run alone a second
time (run-to-run determinism, a control). Throughput: ``--throughput-seqs`` greedy requests decode
together (no preemption); decode tokens/s counts the steps in which every request decodes.
Results are saved after each configuration (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from jds.bench.cli import add_moe_flags, moe_overrides  # noqa: E402
from jds.bench.results import write_json  # noqa: E402

CONFIGS = ("default", "token_only", "invariant")


def make_requests(a: argparse.Namespace) -> dict[str, tuple[list[int], Any]]:
    from jds.engine import SamplingParams

    rng = np.random.default_rng(a.seed)
    lo, hi = a.prompt_len
    out = {}
    for i in range(a.greedy + a.seeded):
        p = rng.integers(0, 256, size=int(rng.integers(lo, hi + 1))).tolist()
        if i < a.greedy:
            sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
            out[f"greedy{i}"] = (p, sp)
        else:
            sp = SamplingParams(max_tokens=a.max_tokens, temperature=1.0, top_p=0.95, seed=10_000 + i, ignore_eos=True)
            out[f"seeded{i - a.greedy}"] = (p, sp)
    return out


def drain(engine: Any, reqs: dict[str, tuple[list[int], Any]]) -> tuple[dict[str, list[int]], list[tuple[float, int, bool]]]:
    """Run ``reqs`` to completion; tokens per request and, per step, (seconds, new tokens, all decoding)."""
    for rid, (p, sp) in reqs.items():
        engine.add_request(rid, p, sp)
    toks: dict[str, list[int]] = {rid: [] for rid in reqs}
    steps = []
    while engine.has_work():
        running = engine.scheduler.running
        all_decode = bool(running) and not engine.scheduler.waiting and all(r.num_remaining == 1 for r in running)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        n = 0
        for o in outs:
            if o.error:
                raise RuntimeError(f"request {o.request_id}: {o.error}")
            toks[o.request_id] += o.new_token_ids
            n += len(o.new_token_ids)
        steps.append((dt, n, all_decode))
    return toks, steps


def first_diff(x: list[int], y: list[int]) -> int:
    for i, (u, v) in enumerate(zip(x, y)):
        if u != v:
            return i
    return min(len(x), len(y)) if len(x) != len(y) else -1


def build(a: argparse.Namespace, config: str, num_blocks: int):
    from jds.config import RunnerConfig
    from jds.runner import ModelRunner

    kw: dict[str, Any] = {}
    if config == "token_only":
        kw["token_buckets"] = (a.max_num_tokens,)
    elif config == "invariant":
        kw["batch_invariant"] = True
    runner = RunnerConfig(mode=a.mode, num_blocks=num_blocks, max_num_seqs=a.max_num_seqs,
                          max_num_tokens=a.max_num_tokens, max_model_len=a.max_model_len, **kw)
    return ModelRunner.build(preset=a.preset, model_overrides=moe_overrides(a), implementation=a.implementation,
                             seed=0, runner=runner)


def run_config(a: argparse.Namespace, config: str, reqs: dict[str, tuple[list[int], Any]]) -> dict:
    from jds.engine import Engine, SamplingParams

    rec: dict[str, Any] = {"config": config}
    t0 = time.perf_counter()
    runner = build(a, config, a.num_blocks)
    runner.warmup()
    rec.update(warmup_s=time.perf_counter() - t0, token_buckets=list(runner.token_buckets),
               key_block_buckets=list(runner.key_block_buckets))

    t0 = time.perf_counter()
    alone = {rid: drain(Engine(runner), {rid: r})[0][rid] for rid, r in reqs.items()}
    rec["alone_s"] = time.perf_counter() - t0
    rep = list(reqs)[: a.repeat]
    again = {rid: drain(Engine(runner), {rid: reqs[rid]})[0][rid] for rid in rep}
    rec["repeat_identical"] = f"{sum(again[r] == alone[r] for r in rep)}/{len(rep)}"

    eng = Engine(runner)
    t0 = time.perf_counter()
    together, steps = drain(eng, reqs)
    rec["together_s"] = time.perf_counter() - t0
    rec["num_preemptions"] = eng.stats().num_preemptions
    rec["num_steps_together"] = len(steps)
    for kind in ("greedy", "seeded"):
        ids = [r for r in reqs if r.startswith(kind)]
        same = [r for r in ids if together[r] == alone[r]]
        rec[f"{kind}_identical"] = len(same)
        rec[f"{kind}_total"] = len(ids)
        rec[f"{kind}_differing"] = {r: first_diff(together[r], alone[r]) for r in ids if r not in same}

    # Decode throughput: a pool large enough that nothing is preempted.
    n = a.throughput_seqs
    rng = np.random.default_rng(a.seed + 1)
    tp = {f"t{i}": (rng.integers(0, 256, a.throughput_prompt_len).tolist(),
                    SamplingParams(max_tokens=a.throughput_tokens, temperature=0.0, ignore_eos=True))
          for i in range(n)}
    need = n * -(-(a.throughput_prompt_len + a.throughput_tokens) // runner.block_size)
    if need > runner.num_blocks:
        runner = build(a, config, need)
        runner.warmup()
    drain(Engine(runner), dict(list(tp.items())[:1]))  # first steps of this runner's caches, untimed
    _, steps = drain(Engine(runner), tp)
    dec = [(dt, k) for dt, k, all_dec in steps if all_dec and k == n]
    secs = sum(dt for dt, _ in dec)
    rec["throughput"] = {"seqs": n, "prompt_len": a.throughput_prompt_len, "max_tokens": a.throughput_tokens,
                         "decode_steps": len(dec), "decode_tok_s": sum(k for _, k in dec) / secs if secs else None,
                         "decode_step_ms_median": float(np.median([dt for dt, _ in dec]) * 1e3) if dec else None,
                         "total_s": sum(dt for dt, _, _ in steps)}
    return rec


def device_tag() -> str:
    import jax

    kind = str(jax.devices()[0].device_kind)
    m = re.search(r"(h100|h200|a100|b200|gb200|l40s?)", kind.lower())
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or jax.default_backend()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v32-bench")
    ap.add_argument("--mode", choices=("wide", "narrow", "fused"), default="narrow")
    ap.add_argument("--implementation", choices=("auto", "xla", "pallas"), default="auto")
    add_moe_flags(ap)
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--greedy", type=int, default=24)
    ap.add_argument("--seeded", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("LO", "HI"))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=64, help="page pool of the invariance run (pressure)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=4, help="requests run alone twice (determinism control)")
    ap.add_argument("--throughput-seqs", type=int, default=16)
    ap.add_argument("--throughput-prompt-len", type=int, default=128)
    ap.add_argument("--throughput-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default benchmarks/results/batch_invariant_<device>_<date>.json")
    a = ap.parse_args(argv)
    try:
        moe_overrides(a)
    except ValueError as e:
        ap.error(str(e))
    lo, hi = a.prompt_len
    if not 1 <= lo <= hi:
        ap.error(f"--prompt-len needs 1 <= LO <= HI, got {lo} {hi}")
    if a.greedy < 0 or a.seeded < 0 or a.greedy + a.seeded < 1:
        ap.error("--greedy and --seeded must be >= 0 with at least one request")
    if hi + a.max_tokens > a.max_model_len:
        ap.error(f"--prompt-len HI ({hi}) + --max-tokens ({a.max_tokens}) exceeds --max-model-len ({a.max_model_len})")
    if a.throughput_prompt_len + a.throughput_tokens > a.max_model_len:
        ap.error(f"--throughput-prompt-len + --throughput-tokens exceeds --max-model-len ({a.max_model_len})")
    if a.throughput_seqs > a.max_num_seqs:
        ap.error(f"--throughput-seqs ({a.throughput_seqs}) exceeds --max-num-seqs ({a.max_num_seqs})")

    import jax

    date = datetime.datetime.now(datetime.timezone.utc)
    out = a.out or os.path.join(ROOT, "benchmarks", "results", f"batch_invariant_{device_tag()}_{date:%Y-%m-%d}.json")
    res: dict[str, Any] = {"meta": {"date": date.isoformat(), "device": str(jax.devices()[0].device_kind),
                                    "backend": jax.default_backend(), "jax": jax.__version__, "args": vars(a),
                                    "command": " ".join(["python scripts/bench_batch_invariant.py"] + sys.argv[1:]),
                                    "complete": False},
                           "configs": []}
    reqs = make_requests(a)
    for config in a.configs:
        t0 = time.perf_counter()
        rec = run_config(a, config, reqs)
        rec["wall_s"] = time.perf_counter() - t0
        res["configs"].append(rec)
        tp = rec["throughput"]["decode_tok_s"]
        print(f"[{config}] greedy {rec['greedy_identical']}/{rec['greedy_total']}, seeded "
              f"{rec['seeded_identical']}/{rec['seeded_total']} identical (preemptions {rec['num_preemptions']}, "
              f"repeat {rec['repeat_identical']}); decode {tp and round(tp, 1)} tok/s; {rec['wall_s']:.1f} s",
              flush=True)
        base = next((c for c in res["configs"] if c["config"] == "default"), None)
        if base and base["throughput"]["decode_tok_s"]:
            for c in res["configs"]:
                if c["throughput"]["decode_tok_s"]:
                    c["throughput"]["vs_default"] = c["throughput"]["decode_tok_s"] / base["throughput"]["decode_tok_s"]
        write_json(out, res)
    res["meta"]["complete"] = True
    write_json(out, res)
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
