"""The one summary statistic helper of the benchmarks: every timing list goes through ``summarize``."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def summarize(xs: Sequence[float], percentiles: Sequence[float] = (50, 99), scale: float = 1e3) -> dict[str, float]:
    """``n``, ``mean``, ``median``, ``std`` and ``p<q>`` (linear interpolation) of ``xs`` times ``scale``.

    ``scale`` turns the measured unit into the reported one (seconds -> ms by default); callers name the
    keys (``mean_ms``, ``mean_ttft_ms``, ...). An empty list summarises as zeros with ``n = 0``, so a run
    whose every request failed still writes a complete record.
    """
    arr = np.asarray(xs, np.float64) * scale
    if arr.size == 0:
        return {"n": 0, "mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{q:g}": 0.0 for q in percentiles}}
    return {"n": int(arr.size), "mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std()),
            **{f"p{q:g}": float(np.percentile(arr, q)) for q in percentiles}}


def median(xs: Sequence[float], scale: float = 1.0) -> float:
    """The median of ``xs`` times ``scale`` (the figure every benchmark table reports)."""
    if len(xs) == 0:
        raise ValueError("median of an empty list")
    return float(np.median(np.asarray(xs, np.float64))) * scale
