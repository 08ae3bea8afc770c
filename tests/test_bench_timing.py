"""jds.bench.timing.time_fn works for calls that donate and thread their inputs (the fused-insert
benchmark's caches): pipelined rounds must not touch results a later call has already donated."""

from __future__ import annotations

import re

import pytest

import jax
import jax.numpy as jnp
import numpy as np

from jds.bench.kernels_fused_insert import _threaded
from jds.bench.timing import time_fn


def test_time_fn_with_threaded_donation() -> None:
    step = jax.jit(lambda x, c: (x * 2.0, c + 1.0), donate_argnums=(1,))
    run = _threaded(step, (1,), [jnp.ones(8), jnp.zeros(1024)], (1,))
    t = time_fn(run, warmup=2, iters=7)
    assert t["median_us"] > 0 and t["sync_median_us"] > 0 and t["pipelined_calls"] == 7
    assert float(run()[1][0]) == 2 + 7 + 5 * 7 + 1  # every call ran once, in order, on the threaded cache


def _while_body_ops(hlo: str) -> str:
    """The text of the while loop's body computation and of every computation it calls."""
    comps, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            name = m.group(1)
            comps[name] = []
        elif name:
            comps[name].append(line)
    todo = [re.search(r"body=%?([\w.\-]+)", hlo).group(1)]
    seen, text = set(), []
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        body = "\n".join(comps[c])
        text.append(body)
        todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", body)
    return "\n".join(text)


def test_device_loop_runs_every_iteration() -> None:
    """The looped call is neither hoisted nor dropped: a threaded counter advances once per iteration, an
    unthreaded call still runs inside the while body, and device_time_us gives a finite positive time."""
    from jds.bench.timing import device_loop, device_time_us

    def step(x, c):
        return jnp.sin(x) * 2.0, c + 1.0

    x, c = jnp.ones(8), jnp.zeros(4096)
    looped = device_loop(step, (x, c), thread=[(1, 1)])
    assert float(looped(6, x, c)[1][0]) == 6.0 and float(looped(2, x, c)[1][0]) == 2.0  # one compile, any n
    f = device_loop(step, (x, c))  # nothing threaded: the same inputs each iteration
    assert "sine" in _while_body_ops(f.lower(6, x, c).compile().as_text())  # sin was not hoisted out of the loop
    np.testing.assert_allclose(np.asarray(f(6, x, c)[0]), np.sin(1.0) * 2.0, rtol=1e-6)
    us = device_time_us(step, x, c, thread=[(1, 1)], reps=(2, 6), iters=2)
    assert 0 <= us < 1e6
    unrolled = device_loop(step, (x, c), thread=[(1, 1)], unroll=5)
    assert float(unrolled(5, x, c)[1][0]) == 5.0  # every straight-line copy ran, none merged
    assert unrolled.lower(5, x, c).compile().as_text().count("sine") >= 5
    with pytest.raises(ValueError, match="unrolled 5 times"):
        unrolled(6, x, c)
    assert 0 <= device_time_us(step, x, c, thread=[(1, 1)], reps=(2, 6), iters=2, unrolled=True) < 1e6


def test_measure_floors_reports_both_methods() -> None:
    from jds.bench.timing import measure_floors

    floors = measure_floors(quick=True)
    assert set(floors) == {"loop_floor_us", "loop_threaded_floor_us", "unrolled_floor_us",
                           "unrolled_threaded_floor_us"}
    assert all(0 <= v < 1e6 for v in floors.values())


def test_device_time_us_rejects_bad_reps() -> None:
    import pytest

    from jds.bench.timing import device_time_us

    with pytest.raises(ValueError, match="reps"):
        device_time_us(lambda x: x, jnp.ones(2), reps=(5, 5))


def test_device_loop_binds_static_arguments() -> None:
    """Non-array arguments (record formats, sizes: the kernels' static arguments) are constants of the loop."""
    from jds.bench.timing import device_loop, device_row

    f = jax.jit(lambda x, k: x * k, static_argnums=1)
    x = jnp.arange(4.0)
    np.testing.assert_allclose(np.asarray(device_loop(f, (x, 3))(3, x, 3)), np.arange(4.0) * 3)
    row = device_row(f, x, 3, median_us=10.0, quick=True)
    assert row["device_unrolled_us"] >= 0
    assert device_row(f, x, 3, median_us=5000.0, quick=True) == {}  # long calls: no loop needed


def test_summarize_is_the_one_stats_helper() -> None:
    """Seconds in, scaled summary out; percentiles interpolate linearly; an empty list gives n = 0."""
    from jds.bench.stats import median, summarize

    s = summarize([0.004, 0.001, 0.003, 0.002], percentiles=(50, 99))
    assert s["n"] == 4
    np.testing.assert_allclose([s["mean"], s["median"], s["p50"], s["p99"], s["std"]],
                               [2.5, 2.5, 2.5, 3.97, np.std([1.0, 2.0, 3.0, 4.0])], rtol=1e-12)
    assert summarize([], percentiles=(99,)) == {"n": 0, "mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}
    assert median([3.0, 1.0, 2.0], 1e3) == 2000.0
    with pytest.raises(ValueError, match="empty"):
        median([])


def test_split_calls_cuts_at_the_longest_gaps() -> None:
    """Serial calls on the GPU timeline: cut at the calls - 1 longest idle gaps; per call the span (gaps inside
    the call included), the busy time (overlapping kernels counted once) and the kernel count, as medians."""
    from jds.bench.timing import split_calls

    us = 1000
    kernels = [(0, 10 * us), (11 * us, 5 * us),  # call 1: span 16, busy 15
               (100 * us, 10 * us), (104 * us, 2 * us), (112 * us, 3 * us),  # call 2: overlap; span 15, busy 13
               (300 * us, 9 * us)]  # call 3: span 9, busy 9
    got = split_calls(list(reversed(kernels)), 3)
    assert got == {"profile_span_us": 15.0, "profile_busy_us": 13.0, "profile_kernels": 2, "profile_calls": 3}
    assert split_calls([], 3) == {}
    assert split_calls(kernels, 1)["profile_span_us"] == 309.0  # one call: everything
    names = ["mqa", "combine", "mqa", "prep", "combine", "mqa"]  # per record; call 3 has no "combine"
    got = split_calls(kernels, 3, names)
    assert got["profile_kernel_us"] == {"combine": 3.0, "mqa": 10.0, "prep": 0.0}
    assert got["profile_kernel_launches"] == {"combine": 1, "mqa": 1, "prep": 0}
    with pytest.raises(ValueError, match="names"):
        split_calls(kernels, 3, names[:2])


def test_profiled_device_us_without_a_gpu_is_empty() -> None:
    """A CPU trace holds no GPU kernel records: no numbers rather than made-up ones."""
    from jds.bench.timing import profiled_device_us

    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the trace has kernel records")
    assert profiled_device_us(lambda a: a * 2.0 + 1.0, jnp.ones((64,)), calls=2, warmup=1) == {}


def test_profiled_device_us_rotates_argument_sets() -> None:
    """``rotate``: the calls (warm-up and timed) take the argument sets in turn; sets of another arity, or beside
    ``thread``, are a ValueError; ``rotation_copies`` spans twice the L2."""
    from jds.bench.timing import L2_BYTES, profiled_device_us, rotation_copies

    seen = []

    class Spy:  # a compiled-looking callable: profiled_device_us calls it as it is
        lower = None

        def __call__(self, a, b):
            seen.append((float(a[0]), float(b)))
            return a

    sets = [(jnp.full((4,), float(i)), jnp.float32(10 * i)) for i in range(3)]
    profiled_device_us(Spy(), *sets[0], calls=4, warmup=2, rotate=sets[1:])
    assert seen == [(float(i % 3), 10.0 * (i % 3)) for i in range(6)]
    with pytest.raises(ValueError, match="rotate"):
        profiled_device_us(Spy(), *sets[0], calls=2, rotate=[sets[1][:1]])
    with pytest.raises(ValueError, match="rotate"):
        profiled_device_us(Spy(), *sets[0], calls=2, rotate=sets[1:], thread=((0, 0),))
    assert rotation_copies(36 * 2**20) == 3 and rotation_copies(126 * 2**20) == 1
    assert rotation_copies(L2_BYTES) == 2
    with pytest.raises(ValueError, match="nbytes"):
        rotation_copies(0)


def test_kernel_events_keep_a_copy_streams_kernels() -> None:
    """A stream line named for its copies too keeps its kernels; copies, memsets and non-stream lines are dropped."""
    from types import SimpleNamespace as NS

    from jds.bench.timing import kernel_events

    ev = lambda name: NS(name=name, start_ns=0, duration_ns=1)  # noqa: E731
    lines = [NS(name="Stream #14(Compute,MemcpyH2D)", events=[ev("MemcpyH2D"), ev("topk_radix_prefilter")]),
             NS(name="Stream #7(Compute)", events=[ev("loop_select_fusion"), ev("Memset")]),
             NS(name="Stream #9(MemcpyD2H)", events=[ev("MemcpyD2H")]),
             NS(name="XLA Ops", events=[ev("select.1")])]
    assert [e.name for e in kernel_events(lines)] == ["topk_radix_prefilter", "loop_select_fusion"]


def test_named_kernel_us_matches_a_mosaic_kernels_timeline_name() -> None:
    from jds.bench.kernels_fp8_gemm import _rates
    from jds.bench.timing import named_kernel_us
    from pallas_kernels import fp8_gemm

    by = {"fp8_gemm_mosaic_gpu_kernel": 12.5, "fp8_quantize_rows_mosaic_gpu_kernel": 1.5, "loop_reduce_fusion": 2.0}
    assert named_kernel_us(by, fp8_gemm.GEMM_KERNEL) == 12.5
    assert named_kernel_us(by, fp8_gemm.QUANTIZE_KERNEL) == 1.5
    assert named_kernel_us(by, "loop_reduce_fusion") == 2.0
    assert named_kernel_us(by, "fp8") is None and named_kernel_us(None, "fp8_gemm") is None
    # the benchmark row: the call's share of the copy bandwidth from its span, the kernel's from its own time
    r = {"median_us": 20.0, "profile_span_us": 16.0, "profile_kernel_us": by}
    _rates(r, 1e9, 4e7, {"copy_bytes_per_s": 4e12}, kernel_bytes=3.8e7)
    assert r["hbm_frac_profile"] == pytest.approx(4e7 / 16e-6 / 4e12)
    assert r["gemm_kernel_us"] == 12.5 and r["quantize_kernel_us"] == 1.5
    assert r["hbm_frac_kernel"] == pytest.approx(3.8e7 / 12.5e-6 / 4e12)
