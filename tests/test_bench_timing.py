"""pallas_kernels.timing.time_fn works for calls that donate and thread their inputs (the fused-insert
benchmark's caches): pipelined rounds must not touch results a later call has already donated."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.bench_fused_insert import _threaded
from pallas_kernels.timing import time_fn


def test_time_fn_with_threaded_donation() -> None:
    step = jax.jit(lambda x, c: (x * 2.0, c + 1.0), donate_argnums=(1,))
    run = _threaded(step, (1,), [jnp.ones(8), jnp.zeros(1024)], (1,))
    t = time_fn(run, warmup=2, iters=7)
    assert t["median_us"] > 0 and t["sync_median_us"] > 0 and t["pipelined_calls"] == 7
    assert float(run()[1][0]) == 2 + 7 + 5 * 7 + 1  # every call ran once, in order, on the threaded cache
