"""Timing helpers shared by the kernel benchmarks (scripts/bench_kernels.py): median of many runs after
warm-up, and the device ceilings (copy bandwidth, bf16 matmul FLOP/s) measured in the same run."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


def time_fn(fn: Callable[..., Any], *args: Any, warmup: int = 5, iters: int = 50) -> dict[str, float]:
    """Per-call time of ``fn(*args)`` in microseconds, two ways.

    ``median_us``: median over rounds of ``iters`` back-to-back calls with one block at the end, divided by
    ``iters`` (the device is kept busy, so for calls longer than JAX's dispatch cost this is device time);
    ``sync_median_us`` / p10 / p90: each call blocked on alone (adds dispatch + synchronisation latency,
    tens of microseconds on the H200 host, which dominates kernels of a few microseconds).
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
