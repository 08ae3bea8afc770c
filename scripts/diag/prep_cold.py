"""Why a step's input preparation costs several times more in the step loop than alone, and two host levers.

    python3 scripts/diag/prep_cold.py --layers 8 --intermediate 18432 --segments 8 --n 60 --out OUT/prep_cold.json

Why: TTFT's host critical path is input preparation plus the first segment's dispatch (issue 16). Both run
right after the host waited for the previous step's ids, and both cost several times what they cost back to
back (preparation 0.18 ms in the loop against 0.02 ms alone; the first segment's dispatch about twice a later
one's). Per variant, in one process on one runner, the medians of: the whole step, preparation and its parts
(the chunks' checks, the step buffer's slot, the pack), the first segment's dispatch, and their
sum (the critical path). Variants:

- ``base``: the TTFT loop as ``jds.bench.ttft`` times it;
- ``double``: a throw-away preparation right before the real one (the real one then runs warm: how much of
  the in-loop cost is a cold cache, not work);
- ``pin``: the dispatching thread bound to one core (a thread woken from a wait may land on another core,
  whose caches hold none of its code or data);
- ``pin_excl``: as ``pin``, and every other thread of the process moved off that core;
- ``spin``: the host polls the ids' readiness instead of sleeping in the wait (its core never idles);
- ``spin_yield``: the same with ``sched_yield`` between polls;
- ``base_again``: affinity restored, the loop again (drift check).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time
from typing import Any


def _median_ms(xs: list[float]) -> float | None:
    return 1e3 * sorted(xs)[len(xs) // 2] if xs else None


def _instrument(runner: Any, parts: dict[str, list[float]]) -> Any:
    """Time the preparation's parts into ``parts``; returns the function that undoes it."""
    import jds.runner as jr

    orig_pack = jr.pack_step

    def timed(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = fn(*a, **k)
            parts.setdefault(name, []).append(time.perf_counter() - t)
            return out
        return call

    runner._check_chunks = timed("chunks", runner._check_chunks)
    runner._pinned_buffer = timed("slot", runner._pinned_buffer)
    jr.pack_step = timed("pack_step", jr.pack_step)

    def undo() -> None:
        jr.pack_step = orig_pack
        for name in ("_check_chunks", "_pinned_buffer"):
            runner.__dict__.pop(name, None)
    return undo


def _loop(runner: Any, ids: Any, chunks: list, bt: Any, n: int, double: bool, spin: str = "",
          warm: int = 10) -> dict[str, Any]:
    import numpy as np

    from jds.bench.stack import _time_segments
    from jds.sampling import greedy_tokens_host

    parts: dict[str, list[float]] = {}
    undo = _instrument(runner, parts)
    restore = _time_segments(runner, parts)
    walls, preps, crit = [], [], []
    try:
        for i in range(warm + n):
            if i < warm:
                for k in parts:
                    parts[k].clear()
            a = time.perf_counter()
            if double:
                runner.prepare_inputs(ids, chunks, bt)
                a = time.perf_counter()
            inputs = runner.prepare_inputs(ids, chunks, bt)
            b = time.perf_counter()
            logits = runner.step(*inputs)
            tok = greedy_tokens_host(logits)[1]
            if spin == "spin":
                while not tok.is_ready():
                    pass
            elif spin == "spin_yield":
                while not tok.is_ready():
                    os.sched_yield()
            np.asarray(tok)[: len(chunks)]
            e = time.perf_counter()
            if i >= warm:
                walls.append(e - a)
                preps.append(b - a)
                crit.append(b - a + parts["seg0"][-1])
    finally:
        if restore is not None:
            restore()
        undo()
    return {"wall_ms": _median_ms(walls), "prepare_ms": _median_ms(preps), "critical_ms": _median_ms(crit),
            "critical_p90_ms": 1e3 * sorted(crit)[int(0.9 * len(crit))],
            "parts_ms": {k: _median_ms(v) for k, v in sorted(parts.items())}, "n": n}


def _threads() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="v32", choices=("v32", "v4"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=18432)
    ap.add_argument("--size", default="bench", choices=("bench", "tiny"))
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--variants", nargs="+", default=["base", "double", "spin", "spin_yield", "pin", "pin_excl",
                                                          "base_again"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import jax
    import numpy as np

    from jds.bench.stack import block_table, build_stack, make_runner, step_shapes
    from jds.runner import StepInputs

    t0 = time.perf_counter()
    model = build_stack(a.arch, a.layers, intermediate=a.intermediate, size=a.size)
    runner = make_runner(model, "fused", 64, 512, input_prep="device", segments=a.segments)
    chunks = step_shapes(512)["ttft_128"]
    bt = block_table(runner, len(chunks))
    ids = np.random.default_rng(0).integers(0, 256, 128).astype(np.int32)
    first = runner.prepare_inputs(ids, chunks, bt)[0]
    if isinstance(first, StepInputs):
        runner.warmup(buckets=[(first.token_bucket, first.key_blocks)])
    np.asarray(runner.step(*runner.prepare_inputs(ids, chunks, bt)))
    res: dict[str, Any] = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                    "command": "python3 scripts/diag/prep_cold.py " + " ".join(sys.argv[1:]),
                                    "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                                    "cpus": sorted(os.sched_getaffinity(0)), "setup_s": time.perf_counter() - t0},
                           "variants": {}}
    everything = set(os.sched_getaffinity(0))
    main_tid = threading.get_native_id()
    core = max(everything)
    for v in a.variants:
        if v in ("pin", "pin_excl"):
            os.sched_setaffinity(main_tid, {core})
        if v == "pin_excl":
            for tid in _threads():
                if tid != main_tid:
                    try:
                        os.sched_setaffinity(tid, everything - {core})
                    except OSError:
                        pass
        if v == "base_again":
            for tid in _threads():
                try:
                    os.sched_setaffinity(tid, everything)
                except OSError:
                    pass
        row = _loop(runner, ids, chunks, bt, a.n, double=v == "double", spin=v if v.startswith("spin") else "")
        alone = []
        for _ in range(200):
            s = time.perf_counter()
            runner.prepare_inputs(ids, chunks, bt)
            alone.append(time.perf_counter() - s)
        row["prepare_alone_ms"] = _median_ms(alone)
        res["variants"][v] = row
        print(json.dumps({v: row}), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
