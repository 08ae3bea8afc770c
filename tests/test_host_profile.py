"""The host-profile trace reduction's clock alignment and idle-gap listing (synthetic events)."""

from jds.bench.host_profile import _largest_gaps, _mark_offset


def test_mark_offset_finds_the_unnamed_step_events():
    off = 123_456_789
    marks = [("jds_step", 1_000_000, 3_000_000), ("jds_launch", 1_100_000, 1_500_000),
             ("jds_step", 5_000_000, 6_500_000)]
    events = [("x", 10, 50), ("<UNKNOWN>", 1_000_000 - off - 3_000, 2_000_000 + 4_000),
              ("y", 1_100_000 - off, 1_000), ("<UNKNOWN>", 5_000_000 - off - 2_000, 1_500_000 + 3_000)]
    got = _mark_offset(marks, events)
    assert got is not None and abs(got - (-off)) <= 5_000


def test_mark_offset_none_when_nothing_lines_up():
    marks = [("jds_step", 0, 2_000_000), ("jds_step", 5_000_000, 7_000_000)]
    assert _mark_offset(marks, [("a", 0, 10_000), ("b", 100, 2_000_000)]) is None


def test_largest_gaps_orders_idle_stretches():
    kernels = [(0, 100), (50, 100), (400, 10), (1000, 5), (1010, 5)]  # ns; overlap, 250 idle, 590, 5
    gaps = _largest_gaps(kernels)
    assert [g["idle_us"] for g in gaps] == [0.59, 0.25, 0.005]
    assert gaps[0]["after_kernel"] == 2


def test_device_steps_from_copies():
    from jds.bench.host_profile import device_steps

    us = 1000
    kernels, copies = [], []
    for t0 in (0, 1000 * us, 2000 * us):  # three equal steps: copy in, 3 kernels (one idle gap), copy out
        copies += [("H2D", t0 + 5 * us, 1 * us), ("D2H", t0 + 420 * us, 5 * us)]
        kernels += [(t0 + 10 * us, 100 * us), (t0 + 120 * us, 50 * us), (t0 + 400 * us, 10 * us)]
    got = device_steps(kernels, copies)
    assert got["steps"] == 3 and got["kernels_per_step"] == 3
    assert abs(got["copy_in_to_first_kernel_ms"] - 0.005) < 1e-12
    assert abs(got["kernel_span_ms"] - 0.4) < 1e-12 and abs(got["kernel_busy_ms"] - 0.16) < 1e-12
    assert abs(got["last_kernel_to_copy_out_end_ms"] - 0.015) < 1e-12 and abs(got["step_span_ms"] - 0.42) < 1e-12
    assert [g["idle_us"] for g in got["largest_idle_gaps_us_median_step"]] == [230.0, 10.0]


def test_device_steps_from_idle_gaps():
    """Without copies on the memcpy streams (pinned step buffer, host ids) steps split at long idle stretches."""
    from jds.bench.host_profile import device_steps

    us = 1000
    kernels = []
    for t0 in (0, 1000 * us, 2000 * us):
        kernels += [(t0 + 10 * us, 100 * us), (t0 + 120 * us, 50 * us), (t0 + 220 * us, 10 * us)]
    got = device_steps(kernels, [])
    assert got["steps"] == 3 and got["kernels_per_step"] == 3
    assert abs(got["kernel_span_ms"] - 0.22) < 1e-12 and abs(got["kernel_busy_ms"] - 0.16) < 1e-12
    assert got["copy_in_to_first_kernel_ms"] is None and got["last_kernel_to_copy_out_end_ms"] is None
