"""``swiglu_quant``'s kernel against what it replaces, by row count: XLA's SwiGLU fusion followed by the FP8 GEMM's
quantisation kernel (``fp8_gemm.quantize_rows``), at the bench models' intermediate widths (V4 2048, V3.2 18432).

Why: the MLP quantises its activation in the kernel up to ``swiglu_quant.AUTO_MAX_ROWS`` rows; this times both
forms per (width, rows) and the kernel's tile (``--chunks`` blocks of 128 a program, ``--warps``), so that the limit
and the defaults follow the measurements.

    python3 scripts/diag/swiglu_quant_rows.py [--widths 2048 18432] [--rows 64 128 256 512 2048] \
        [--chunks 8 16 32] [--warps 4 8] --out F.json

Each row: the kernels' busy µs per call on the GPU timeline (``profiled_device_us``: the kernels alone, so the
launch gap between XLA's two kernels does not count against it), for XLA's form (``xla``), the kernel at its
defaults (``kernel``) and at each (chunk, warps) (``kernel_cC_wW``), each kernel form's h checked against XLA's
(``h_max_ulps``, ``h_diff_frac``: the share of elements that differ). Native only.
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
from pallas_kernels.fp8_gemm import quantize_rows
from pallas_kernels.swiglu_quant import padded_rows, swiglu, swiglu_quant


def _case(m: int, width: int, tiles: list[tuple[int, int]]) -> dict:
    k = jax.random.split(jax.random.key(m * 7 + width), 2)
    g = (jax.random.normal(k[0], (m, width), jnp.float32) * 2).astype(jnp.bfloat16)
    u = (jax.random.normal(k[1], (m, width), jnp.float32) * 2).astype(jnp.bfloat16)
    mp = padded_rows(m)

    def xla(g, u):  # what the model ran before: XLA's activation, then the quantisation kernel
        h = swiglu(g, u, jnp.bfloat16)
        return h, quantize_rows(h, mp, "ue8m0")

    row = {"rows": m, "width": width}
    fx = jax.jit(xla, compiler_options={"xla_allow_excess_precision": False})  # as the runner compiles
    h_ref = np.asarray(fx(g, u)[0], np.float64)
    row["xla"] = profiled_device_us(fx, g, u, calls=30).get("profile_busy_us")
    for name, kw in [("kernel", {})] + [(f"kernel_c{c}_w{w}", {"chunk": c, "num_warps": w}) for c, w in tiles]:
        f = jax.jit(lambda g, u, kw=kw: swiglu_quant(g, u, want_h=True, implementation="pallas", **kw))
        try:
            xq, h = f(g, u)
            d = np.abs(np.asarray(h, np.float64) - h_ref)
            spacing = np.spacing(np.abs(h_ref).astype(np.float32)).astype(np.float64) * 2.0 ** 16  # bf16 ulp
            row[f"{name}_h_max_ulps"] = float(np.max(d / np.maximum(spacing, 2.0 ** -133)))
            row[f"{name}_h_diff_frac"] = float(np.mean(d > 0))
            g2 = jax.jit(lambda g, u, kw=kw: swiglu_quant(g, u, implementation="pallas", **kw)[0])
            row[name] = profiled_device_us(g2, g, u, calls=30).get("profile_busy_us")
        except Exception as e:  # noqa: BLE001 - a form that fails records why; the others still run
            row[name] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", nargs="*", type=int, default=[2048, 18432])
    ap.add_argument("--rows", nargs="*", type=int, default=[64, 128, 256, 512, 2048])
    ap.add_argument("--chunks", nargs="*", type=int, default=[])
    ap.add_argument("--warps", nargs="*", type=int, default=[4])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    tiles = [(c, w) for c in a.chunks for w in a.warps]
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "command": " ".join(["python3 scripts/diag/swiglu_quant_rows.py"] + (argv or sys.argv[1:])),
                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}, "rows": []}
    for width in a.widths:
        for m in a.rows:
            row = _case(m, width, tiles)
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
            write_json(a.out, res)


if __name__ == "__main__":
    main()
