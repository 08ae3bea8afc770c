"""``rms_norm_quant``'s kernel against what it replaces, by row count: XLA's norm (after the residual add) followed by
the FP8 GEMM's quantisation kernel (``fp8_gemm.quantize_rows``), at the model's widths.

Why: the model quantises in the norm up to ``norm_quant.AUTO_MAX_ROWS`` rows, where the 8-layer steps measured it
(64 and 128 rows, an H100); above, the kernel is untimed against XLA's form (at 2048 x 7168 it took about twice
what its reads and writes need at the copy rate: docs/perf-log.md, seventieth session). This times both forms per
(width, rows, residual) so that the limit can follow the measurements.

    python3 scripts/diag/norm_quant_rows.py [--widths 1536 4096 7168] [--rows 64 128 256 512 2048] \
        [--warps 8 16] --out F.json

Each row: the kernels' busy µs per call on the GPU timeline (``profiled_device_us``: the kernels alone, so the
launch gaps of a lone waited call do not count against XLA's form, whose kernels sit in one executable), for the
kernel at its default warps (``kernel``), at each of ``--warps`` (``kernel_wN``) and for XLA's form (``xla``), each
kernel form's y checked against XLA's (``y_max_ulps``). Native only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jds.bench.results import write_json
from jds.bench.timing import profiled_device_us
from jds.ops.norms import rms_norm
from pallas_kernels.fp8_gemm import padded_x_rows, quantize_rows
from pallas_kernels.norm_quant import rms_norm_quant

EPS = 1e-6


def _case(m: int, width: int, residual: bool, warps: list[int]) -> dict:
    k = jax.random.split(jax.random.key(m * 7 + width), 3)
    x = (jax.random.normal(k[0], (m, width), jnp.float32) * 2).astype(jnp.bfloat16)
    r = jax.random.normal(k[1], (m, width), jnp.float32).astype(jnp.bfloat16) if residual else None
    w = 1 + 0.1 * jax.random.normal(k[2], (width,), jnp.float32)
    mp = padded_x_rows(m)

    def xla(x, r, w):  # what the model ran before: the add and the norm in XLA, then the quantisation kernel
        h = x if r is None else x + r
        y = rms_norm(h, w, EPS)
        return y, quantize_rows(y, mp, "ue8m0")

    row = {"rows": m, "width": width, "residual": residual}
    # as the runner compiles: no excess precision (x + r rounded to bf16 before the norm, as the kernel does)
    opts = {"xla_allow_excess_precision": False}
    fx = jax.jit(xla, compiler_options=opts)
    y_ref = np.asarray(fx(x, r, w)[0], np.float64)
    row["xla"] = profiled_device_us(fx, x, r, w, calls=30).get("profile_busy_us")
    for name, nw in [("kernel", None)] + [(f"kernel_w{n}", n) for n in warps]:
        f = jax.jit(lambda x, r, w, nw=nw: rms_norm_quant(x, w, EPS, residual=r, want_y=r is None,
                                                          implementation="pallas", num_warps=nw))
        try:
            out = f(x, r, w)
            if out.y is not None:
                d = np.abs(np.asarray(out.y, np.float64) - y_ref)
                spacing = np.spacing(np.abs(y_ref).astype(np.float32)).astype(np.float64) * 2.0 ** 16  # bf16 ulp
                row[f"{name}_y_max_ulps"] = float(np.max(d / spacing))
            row[name] = profiled_device_us(f, x, r, w, calls=30).get("profile_busy_us")
        except Exception as e:  # noqa: BLE001 - a form that fails records why; the others still run
            row[name] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", nargs="*", type=int, default=[1536, 4096, 7168])
    ap.add_argument("--rows", nargs="*", type=int, default=[64, 128, 256, 512, 2048])
    ap.add_argument("--warps", nargs="*", type=int, default=[])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "command": " ".join(["python3 scripts/diag/norm_quant_rows.py"] + (argv or sys.argv[1:])),
                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}, "rows": []}
    for width in a.widths:
        for m in a.rows:
            for residual in (False, True):
                row = _case(m, width, residual, a.warps)
                print(json.dumps(row), flush=True)
                res["rows"].append(row)
                write_json(a.out, res)


if __name__ == "__main__":
    main()
