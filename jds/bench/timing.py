"""Timing helpers shared by the kernel benchmarks (``python -m jds.bench.kernels``): median of many runs after
warm-up, device time from the GPU's own timeline (``profiled_device_us``), and the device ceilings (copy
bandwidth, bf16 matmul FLOP/s) measured in the same run."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


# XLA captures an executable's thunks as one CUDA graph only from xla_gpu_graph_min_graph_size of them on (its
# default: 5). A standalone op call of fewer kernels is then launched kernel by kernel and the GPU waits on the
# host between them, which a timeline span counts. With this, any call is one graph, as the op is inside the
# model's captured step (the eager executables' direct launches are the step benchmarks' to measure).
CAPTURED_OPTIONS = {"xla_gpu_graph_min_graph_size": 1}


def time_fn(fn: Callable[..., Any], *args: Any, warmup: int = 5, iters: int = 50) -> dict[str, float]:
    """Per-call time of ``fn(*args)`` in microseconds, two ways.

    ``median_us``: median over rounds of ``iters`` back-to-back calls with one block at the end, divided by
    ``iters`` (the device is kept busy, so for calls longer than JAX's dispatch cost this is device time);
    ``sync_median_us`` / p10 / p90: each call blocked on alone (adds dispatch + synchronisation latency,
    which dominates kernels of a few microseconds: compare the two keys of a small row in any
    ``benchmarks/results/kernels_*.json``).
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    ts.sort()
    n = max(2, min(iters, 20))
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        # one device stream runs the calls in order, so the last result being ready means all are; the
        # earlier results may already be donated to later calls (benchmarks that thread caches)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t0) / n)
        del out
    return {"median_us": 1e6 * statistics.median(rounds), "sync_median_us": 1e6 * statistics.median(ts),
            "p10_us": 1e6 * ts[len(ts) // 10], "p90_us": 1e6 * ts[(9 * len(ts)) // 10], "iters": iters,
            "pipelined_calls": n}


def device_loop(fn: Callable[..., Any], args: Sequence[Any], thread: Sequence[tuple[int, int]] = (),
                unroll: int | None = None) -> Callable[..., Any]:
    """``run(n, *args)``: one executable running ``fn`` ``n`` times back to back and returning the last
    outputs (see ``device_time_us``). ``unroll=None``: a ``fori_loop`` with ``n`` a runtime value (one
    compile serves every count); ``unroll=m``: ``m`` copies in straight-line code (``run`` ignores its
    ``n``, which must equal ``m``), so no while loop and its per-iteration predicate check sits between
    the calls. Arguments that are not arrays (formats, ints: ``fn``'s static arguments) are bound as
    constants; pass all of ``args`` as given."""
    dyn = [i for i, a in enumerate(args)
           if (leaves := jax.tree.leaves(a)) and all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)]
    pos = {i: j for j, i in enumerate(dyn)}

    def call(cur: Sequence[Any]) -> Any:
        full = list(args)
        for i, x in zip(dyn, cur):
            full[i] = x
        return fn(*full)

    def body(_: Any, carry: Any) -> Any:
        cur, _prev = carry
        out = call(cur)
        nxt = list(cur)
        for ai, oi in thread:
            nxt[pos[ai]] = out[oi]
        return lax.optimization_barrier((tuple(nxt), out))

    outs0 = jax.eval_shape(lambda *c: call(c), *[args[i] for i in dyn])

    @jax.jit
    def loop(n: jax.Array, *d: Any) -> Any:
        carry = (tuple(d), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), outs0))
        if unroll is None:
            return lax.fori_loop(0, n, body, carry)[1]
        # straight-line copies: an output nothing reads would be dead code, so every copy's outputs are
        # returned (the threaded caches only once: each copy consumes the previous one's)
        fed = {oi for _, oi in thread}
        kept = []
        for i in range(unroll):
            carry = body(i, carry)
            out = carry[1]
            kept.append([o for k, o in enumerate(out) if k not in fed] if fed else out)
        return carry[1], kept

    def run(n: int, *a: Any) -> Any:
        if unroll is not None and n != unroll:
            raise ValueError(f"this executable is unrolled {unroll} times, asked for n={n}")
        res = loop(jnp.int32(n), *[a[i] for i in dyn])
        return res if unroll is None else res[0]

    run.lower = lambda n, *a: loop.lower(jnp.int32(n), *[a[i] for i in dyn])  # type: ignore[attr-defined]
    return run


def device_time_us(fn: Callable[..., Any], *args: Any, thread: Sequence[tuple[int, int]] = (),
                   reps: tuple[int, int] = (5, 25), iters: int = 5, unrolled: bool = False) -> float:
    """Device time per call of the traceable ``fn(*args)``, in microseconds, without host dispatch.

    Why: ``time_fn``'s pipelined rounds cannot go below JAX's per-call dispatch cost (the ``median_us`` of
    the smallest rows in ``benchmarks/results/kernels_*.json``), so kernels shorter than that read as equal. Here one
    executable runs ``fn`` ``n`` times; the time difference between ``reps[1]`` and ``reps[0]`` calls,
    divided by their difference, cancels launch and synchronisation.
    ``unrolled=False``: a ``fori_loop`` (one compile); each iteration also pays the loop's own overhead
    (``measure_floors`` measures it with a trivial body). ``unrolled=True``: straight-line copies (two
    compiles, one per count), no loop overhead; what remains per call is the launch of a kernel node
    inside the captured command buffer.
    Each call's arguments and outputs pass through ``lax.optimization_barrier``, so XLA can neither
    hoist or merge the loop-invariant calls nor drop outputs it would not otherwise need.
    ``thread``: (argument index, output index) pairs fed back each call (donated caches).
    Caveat: the same inputs every call, so inputs that fit the 50 MB L2 are read from L2.
    """
    if not 0 < reps[0] < reps[1]:
        raise ValueError(f"reps must be two increasing positive counts, got {reps}")
    fs = ([device_loop(fn, args, thread, unroll=n) for n in reps] if unrolled
          else [device_loop(fn, args, thread)] * 2)
    for f, n in zip(fs, reps):
        jax.block_until_ready(f(n, *args))  # compile + warm
    per = []
    for f, n in zip(fs, reps):
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(n, *args))
            ts.append(time.perf_counter() - t0)
        per.append(statistics.median(ts))
    return max(0.0, 1e6 * (per[1] - per[0]) / (reps[1] - reps[0]))


def device_row(fn: Callable[..., Any], *args: Any, median_us: float, thread: Sequence[tuple[int, int]] = (),
               quick: bool = False, below_us: float = 200.0) -> dict[str, float]:
    """``{"device_unrolled_us": ...}`` (``device_time_us``, unrolled, 8 vs 48 calls) for calls whose
    pipelined time is under ``below_us`` (where per-call dispatch can hide the kernel), else ``{}``: above
    it dispatch is a small share.

    Why unrolled only: on the H200 the loop method's floor for a trivial call is of the order of the
    small kernels themselves, the unrolled one's near zero (``meta.device_time_floors_us`` of
    ``benchmarks/results/archive/kernels_fused_insert_*.json``), so small loop rows measured the loop. 40 extra
    calls keep the host's timing jitter below the kernels compared; 100 made the compiles too slow for one
    10-minute call. Above ``below_us`` the pipelined median already matched the unrolled time (rows with
    both ``median_us`` and ``device_unrolled_us`` in the same file), so those rows skip the two extra
    compiles."""
    if median_us >= below_us:
        return {}
    reps, iters = ((1, 2), 1) if quick else ((8, 48), 7)
    return {"device_unrolled_us": device_time_us(fn, *args, thread=thread, reps=reps, iters=iters, unrolled=True)}


def profiled_device_us(fn: Callable[..., Any], *args: Any, calls: int = 20, warmup: int = 3,
                       thread: Sequence[tuple[int, int]] = (), by_kernel: bool = False,
                       rotate: Sequence[Sequence[Any]] = ()) -> dict[str, Any]:
    """Device time per call of ``fn(*args)`` read off the GPU's timeline: ``calls`` calls, each waited for,
    under ``jax.profiler`` (CUPTI's kernel records), split into calls at the ``calls - 1`` longest idle gaps
    (the host's wait and dispatch between two calls; a call's own kernels follow each other closely).

    Returns the medians over calls of ``profile_span_us`` (first kernel start -> last kernel end: the call's
    device time, gaps between its kernels included), ``profile_busy_us`` (kernel time alone) and
    ``profile_kernels`` (kernels per call); ``{}`` when the trace holds no GPU kernels (a CPU run), and only
    ``profile_lines`` (the GPU planes' line names and event counts) when it has GPU lines but no stream's kernels.
    ``by_kernel``: also ``profile_kernel_us``, each kernel name's median time per call (which of a call's
    kernels costs what: the wrapper's XLA fusions beside a Pallas kernel).

    Why: a ~40-µs call's pipelined median moved by 30% between identical runs on the H200, and the unrolled
    difference of two long executables read some rows above the HBM peak (docs/perf-log.md, 2026-12-01, sixth
    session); the kernels' own records do not depend on the host's timing.

    ``thread``: (argument, output) index pairs of buffers updated in place (a cache the call's kernel aliases):
    the argument is donated and replaced by that output after each call, so that no call copies it.

    ``rotate``: further argument sets (each as ``args``); the calls take ``args`` and these in turn, so that an
    operand smaller than the L2 cache (a 36-MiB weight on a 50-MiB L2) is not read from L2 by the next call, as a
    model's next layer reads its own weights (``rotation_copies``)."""
    if thread and rotate:
        raise ValueError("rotate: argument sets to cycle through, not with thread (one state updated in place)")
    if thread:
        jf = jax.jit(fn, donate_argnums=tuple(i for i, _ in thread))
        state = [jnp.array(a, copy=True) if i in dict(thread) else a for i, a in enumerate(args)]
    else:
        jf, state = (fn if hasattr(fn, "lower") else jax.jit(fn)), list(args)
    sets = [list(args)] + [list(r) for r in rotate]
    if any(len(r) != len(args) for r in sets):
        raise ValueError(f"rotate: every argument set needs {len(args)} arguments, got {[len(r) for r in sets]}")
    turn = [0]

    def call() -> None:
        if rotate:
            state[:] = sets[turn[0] % len(sets)]
            turn[0] += 1
        outs = jf(*state)
        for i, o in thread:
            state[i] = outs[o]
        jax.block_until_ready(outs)

    for _ in range(warmup):
        call()
    return timeline_calls(call, calls, by_kernel)


def timeline_calls(call: Callable[[], None], calls: int, by_kernel: bool = False) -> dict[str, Any]:
    """``call()`` run ``calls`` times under ``jax.profiler``, each waited for by ``call`` itself, reduced by
    ``split_calls`` (``profiled_device_us``'s return, which see); the timed part of ``profiled_device_us`` and of
    ``scripts/diag/step_kernels.py`` (a runner's whole steps)."""
    import glob
    import os
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for _ in range(calls):
                call()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return {}
        pd = ProfileData.from_file(max(files, key=os.path.getmtime))
        lines = [line for plane in pd.planes if plane.name.startswith("/device:GPU") for line in plane.lines]
        events = kernel_events(lines)
        if lines and not events:  # the lines the trace has instead
            return {"profile_lines": {line.name: sum(1 for _ in line.events) for line in lines}}
    kernels = [(int(e.start_ns), int(e.duration_ns)) for e in events]
    return split_calls(kernels, calls, [e.name for e in events] if by_kernel else None)


L2_BYTES = 50 * 2**20  # H100 / H200


def rotation_copies(nbytes: int, l2_bytes: int = L2_BYTES) -> int:
    """How many copies of an operand of ``nbytes`` a timed call cycles through (``profiled_device_us``'s
    ``rotate``) so that together they span twice the L2: what the calls between two uses of one copy read
    then evicts it."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    return max(1, -(-2 * l2_bytes // nbytes))


COPY_EVENTS = ("memcpy", "memset")  # a stream's events that are no kernels (CUPTI's names start with these)


def kernel_events(lines: Sequence[Any]) -> list[Any]:
    """The kernel records of a GPU plane's lines (``.name``, ``.events`` each ``.name``): every stream line's
    events but its copies and memsets. Why by event, not by line: a stream that also ran a host-to-device copy
    is named so (``Stream #14(Compute,MemcpyH2D)``), and dropping such lines by name lost every kernel of a call
    (lax.top_k at 64 x 32K on an H100: docs/perf-log.md, forty-third session)."""
    return [e for line in lines if "stream" in line.name.lower() for e in line.events
            if not e.name.lower().startswith(COPY_EVENTS)]


def split_calls(kernels: list[tuple[int, int]], calls: int, names: Sequence[str] | None = None) -> dict[str, Any]:
    """``profiled_device_us``'s reduction: (start_ns, duration_ns) kernel records of ``calls`` serial calls ->
    the medians of each call's span, busy time and kernel count (``{}`` without records); with ``names`` (one
    per record) also ``profile_kernel_us``: per name, the median over calls of its summed µs in the call."""
    if not kernels:
        return {}
    if names is not None and len(names) != len(kernels):
        raise ValueError(f"names: {len(names)} for {len(kernels)} kernel records")
    order = sorted(range(len(kernels)), key=lambda i: kernels[i])
    kernels = [kernels[i] for i in order]
    names = None if names is None else [names[i] for i in order]
    ends, end = [], 0
    for s, d in kernels:  # running end: a kernel may finish after a later-starting one on another stream
        end = max(end, s + d)
        ends.append(end)
    gaps = sorted(range(1, len(kernels)), key=lambda i: kernels[i][0] - ends[i - 1], reverse=True)
    cuts = sorted(gaps[: max(0, calls - 1)])
    spans, busy, counts, per_name, launches = [], [], [], [], []
    for lo, hi in zip([0] + cuts, cuts + [len(kernels)]):
        run = kernels[lo:hi]
        spans.append((max(s + d for s, d in run) - run[0][0]) / 1e3)
        busy.append(_union_ns(run) / 1e3)
        counts.append(len(run))
        if names is not None:
            call: dict[str, float] = {}
            count: dict[str, int] = {}
            for n, (_, d) in zip(names[lo:hi], run):
                call[n] = call.get(n, 0.0) + d / 1e3
                count[n] = count.get(n, 0) + 1
            per_name.append(call)
            launches.append(count)
    out: dict[str, Any] = {"profile_span_us": statistics.median(spans), "profile_busy_us": statistics.median(busy),
                           "profile_kernels": statistics.median(counts), "profile_calls": len(spans)}
    if names is not None:  # a name missing from a call counts 0 there
        every = sorted({n for c in per_name for n in c})
        out["profile_kernel_us"] = {n: statistics.median(c.get(n, 0.0) for c in per_name) for n in every}
        out["profile_kernel_launches"] = {n: statistics.median(c.get(n, 0) for c in launches) for n in every}
    return out


def named_kernel_us(by_kernel: dict[str, float] | None, name: str) -> float | None:
    """The µs per call of the kernels called ``name`` in ``profile_kernel_us``: a Mosaic GPU kernel given
    ``kernel_name=name`` appears on the timeline as ``<name>_mosaic_gpu_kernel`` (one without it under its body
    function's name, e.g. ``kernel_mosaic_gpu_kernel``); None where the call ran none of them."""
    hits = [v for k, v in (by_kernel or {}).items() if k == name or k.startswith(f"{name}_mosaic_gpu")]
    return sum(hits) if hits else None


def _union_ns(run: list[tuple[int, int]]) -> int:
    """Nanoseconds covered by at least one of the (start, duration) intervals (sorted by start)."""
    total, cur_s, cur_e = 0, None, None
    for s, d in run:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, s + d
        else:
            cur_e = max(cur_e, s + d)
    return total + (cur_e - cur_s if cur_e is not None else 0)


def measure_floors(quick: bool = False) -> dict[str, float]:
    """What each ``device_time_us`` method reports for a trivial call (one add on a 1 KiB array), threaded
    and not: the per-call overhead of the method itself, to read small rows against."""
    x = jnp.ones((256,), jnp.float32)
    reps, iters = ((1, 2), 1) if quick else ((8, 48), 7)
    out = {}
    for unrolled in (False, True):
        name = "unrolled" if unrolled else "loop"
        out[f"{name}_floor_us"] = device_time_us(lambda a: a + 1.0, x, reps=reps, iters=iters, unrolled=unrolled)
        out[f"{name}_threaded_floor_us"] = device_time_us(lambda a: (a + 1.0,), x, thread=[(0, 0)], reps=reps,
                                                          iters=iters, unrolled=unrolled)
    return out


def measure_ceilings(quick: bool = False) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s on this device."""
    n = (1 << 28) if not quick else (1 << 20)
    x = jnp.ones((n,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    t = time_fn(copy, x, iters=20 if not quick else 3)["median_us"] * 1e-6
    bw = 2 * 4 * n / t
    m = 8192 if not quick else 256
    a = jnp.ones((m, m), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    t = time_fn(mm, a, a, iters=20 if not quick else 3)["median_us"] * 1e-6
    return {"copy_bytes_per_s": bw, "bf16_flops_per_s": 2 * m ** 3 / t}
