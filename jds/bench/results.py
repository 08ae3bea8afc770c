"""Benchmark result files: every benchmark writes its JSON through ``write_json``."""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any, Callable


def error_text(e: BaseException, limit: int = 800) -> str:
    """A failed row's ``error`` field: the exception's type and the start of its message."""
    return f"{type(e).__name__}: {str(e)[:limit]}"


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` to ``path`` atomically (temp file + rename), creating the folder.

    Why: the benchmarks save after every row or mode so a run cut short by a device time limit keeps what
    it measured; the rename means a kill mid-write never leaves a truncated file behind.
    """
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def run_meta(**extra: Any) -> dict[str, Any]:
    """A result file's ``meta`` for a script run: device kind, jax version, UTC date, the command line as run and
    ``complete`` (True: a script that is cut short writes nothing), plus ``extra`` (e.g. the variants timed)."""
    import jax

    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + " ".join(sys.argv), "complete": True, **extra}


def save_rows(path: str | None, rows: list[dict[str, Any]], complete: bool, **meta: Any) -> None:
    """A diag script's result file ``{"meta": run_meta(**meta), "rows": rows}`` at ``path`` (nothing when None):
    written after every row with ``complete=False`` so that a run cut short keeps its rows, then once complete."""
    if path:
        write_json(path, {"meta": run_meta(**meta, complete=complete), "rows": rows})


def measured_row(row: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``row`` with ``measure()``'s fields, or with ``error`` when it raises (a diag script goes on to its next row);
    printed as one JSON line, so a run cut short still shows what it measured."""
    try:
        row = {**row, **measure()}
    except Exception as e:  # noqa: BLE001 - recorded in the row
        row = {**row, "error": error_text(e, 400)}
    print(json.dumps(row), flush=True)
    return row


def case_variant_rows(cases: list[str], variants: list[dict[str, Any]], measure: Callable[[str, int, dict], dict],
                      out: str | None, bench: str, meta: dict[str, Any] | None = None,
                      **row: Any) -> list[dict[str, Any]]:
    """A diag script's sweep: per case "shape:count" and tile dict, ``measure(shape, count, tiles)`` as a row
    (``measured_row``: a failure is recorded and the sweep goes on) with ``row``'s fields, saved after each with
    ``meta`` in the file's meta."""
    rows: list[dict[str, Any]] = []
    for case in cases:
        shape, count = case.split(":")
        for v in variants:
            rows.append(measured_row({"case": case, "tiles": v, **row}, lambda: measure(shape, int(count), v)))
            save_rows(out, rows, False, bench=bench, **(meta or {}))
    save_rows(out, rows, True, bench=bench, **(meta or {}))
    return rows


def tiles_sweep_main(doc: str, measure: Callable[[str, int, int, dict, int], dict], bench: str, *, cases: list[str],
                     variants: str, rotations: int, rotations_help: str) -> None:
    """The command line of a tile-variant timing script (``scripts/diag/fp4_tiles_time.py``, ``fp8_tiles_time.py``):
    --cases shape:count, --variants JSON tile dicts, --rotations (weight sets a timed call cycles through), --calls,
    --out; ``measure(shape, count, rotations, tiles, calls)`` per row (``case_variant_rows``). A row whose
    measure gives ``bytes`` (HBM bytes per GEMM) and ``kernel_us`` gets ``kernel_copy_frac``: of the copy
    bandwidth measured at the start of the same run (``timing.measure_ceilings``, GPU only)."""
    import argparse

    import jax

    from jds.bench.timing import measure_ceilings

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=cases, help="shape:count")
    ap.add_argument("--variants", default=variants, help="JSON list of tile dicts")
    ap.add_argument("--rotations", type=int, default=rotations, help=rotations_help)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    copy = measure_ceilings()["copy_bytes_per_s"] if jax.default_backend() == "gpu" else None

    def row(shape: str, count: int, v: dict) -> dict:
        r = measure(shape, count, a.rotations, v, a.calls)
        if copy and r.get("bytes") and r.get("kernel_us"):
            r["kernel_copy_frac"] = r["bytes"] / (r["kernel_us"] * 1e-6) / copy
        return r

    case_variant_rows(a.cases, json.loads(a.variants), row, a.out, bench, meta={"copy_bytes_per_s": copy},
                      rotations=a.rotations)
