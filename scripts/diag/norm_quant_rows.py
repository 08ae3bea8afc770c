"""The kernels that quantise for the FP8 linears where their input is made, against what each replaces, by row
count: ``rms_norm_quant`` (``--op norm``) against XLA's norm (after the residual add) then the FP8 GEMM's
quantisation kernel (``fp8_gemm.quantize_rows``), at the model's widths; ``swiglu_quant`` (``--op swiglu``) against
XLA's SwiGLU fusion then the same quantisation, at the bench models' intermediate widths (V4 2048, V3.2 18432).

Why: the model quantises in the norm up to ``norm_quant.AUTO_MAX_ROWS`` rows and in the activation up to
``swiglu_quant.AUTO_MAX_ROWS``, where they were measured; this times both forms per (width, rows[, residual]) and
the kernels' tiles, so that the limits and defaults follow the measurements (docs/perf-log.md, seventieth and
seventy-first sessions).

    python3 scripts/diag/norm_quant_rows.py [--op norm] [--widths 1536 4096 7168] [--rows 64 128 256 512 2048] \
        [--warps 8 16] --out F.json
    python3 scripts/diag/norm_quant_rows.py --op swiglu [--widths 2048 18432] [--chunks 8 16 32] [--warps 4 8] \
        --out F.json

Each row: the kernels' busy µs per call on the GPU timeline (``profiled_device_us``: the kernels alone, so the
launch gaps of a lone waited call do not count against XLA's form, whose kernels sit in one executable), for XLA's
form (``xla``), the kernel at its defaults (``kernel``) and at each tile (``kernel_wN``; swiglu ``kernel_cC_wW``),
each kernel form's output (y / h) checked against XLA's (``*_max_ulps``, ``*_diff_frac``: the share of elements
that differ). Native only.
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
from pallas_kernels.swiglu_quant import swiglu, swiglu_quant

EPS = 1e-6


def _forms(row: dict, ref: np.ndarray, forms: list[tuple[str, object, object]], args: tuple) -> None:
    """Each kernel form (name, the call returning its checked output, the call to time): its output against XLA's
    (``ref``) in bf16 ulps, then its busy µs; a form that fails records why and the others still run."""
    for name, checked, timed in forms:
        try:
            out = checked(*args)
            if out is not None:
                d = np.abs(np.asarray(out, np.float64) - ref)
                spacing = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64) * 2.0 ** 16  # bf16 ulp
                row[f"{name}_max_ulps"] = float(np.max(d / np.maximum(spacing, 2.0 ** -133)))
                row[f"{name}_diff_frac"] = float(np.mean(d > 0))
            row[name] = profiled_device_us(timed, *args, calls=30).get("profile_busy_us")
        except Exception as e:  # noqa: BLE001 - a form that fails records why; the others still run
            row[name] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]


# as the runner compiles: no excess precision (bf16 sums and products rounded where the kernels round them)
_OPTS = {"xla_allow_excess_precision": False}


def _norm_case(m: int, width: int, residual: bool, warps: list[int]) -> dict:
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
    fx = jax.jit(xla, compiler_options=_OPTS)
    y_ref = np.asarray(fx(x, r, w)[0], np.float64)
    row["xla"] = profiled_device_us(fx, x, r, w, calls=30).get("profile_busy_us")
    forms = []
    for name, nw in [("kernel", None)] + [(f"kernel_w{n}", n) for n in warps]:
        f = jax.jit(lambda x, r, w, nw=nw: rms_norm_quant(x, w, EPS, residual=r, want_y=r is None,
                                                          implementation="pallas", num_warps=nw))
        forms.append((name, lambda *a, f=f: f(*a).y, f))
    _forms(row, y_ref, forms, (x, r, w))
    return row


def _swiglu_case(m: int, width: int, tiles: list[tuple[int, int]]) -> dict:
    k = jax.random.split(jax.random.key(m * 7 + width), 2)
    g = (jax.random.normal(k[0], (m, width), jnp.float32) * 2).astype(jnp.bfloat16)
    u = (jax.random.normal(k[1], (m, width), jnp.float32) * 2).astype(jnp.bfloat16)
    mp = padded_x_rows(m)

    def xla(g, u):  # what the model ran before: XLA's activation, then the quantisation kernel
        h = swiglu(g, u, jnp.bfloat16)
        return h, quantize_rows(h, mp, "ue8m0")

    row = {"rows": m, "width": width}
    fx = jax.jit(xla, compiler_options=_OPTS)
    h_ref = np.asarray(fx(g, u)[0], np.float64)
    row["xla"] = profiled_device_us(fx, g, u, calls=30).get("profile_busy_us")
    forms = []
    for name, kw in [("kernel", {})] + [(f"kernel_c{c}_w{w}", {"chunk": c, "num_warps": w}) for c, w in tiles]:
        checked = jax.jit(lambda g, u, kw=kw: swiglu_quant(g, u, want_h=True, implementation="pallas", **kw)[1])
        timed = jax.jit(lambda g, u, kw=kw: swiglu_quant(g, u, implementation="pallas", **kw)[0])
        forms.append((name, checked, timed))
    _forms(row, h_ref, forms, (g, u))
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="norm", choices=("norm", "swiglu"))
    ap.add_argument("--widths", nargs="*", type=int, default=None, help="norm: 1536 4096 7168; swiglu: 2048 18432")
    ap.add_argument("--rows", nargs="*", type=int, default=[64, 128, 256, 512, 2048])
    ap.add_argument("--warps", nargs="*", type=int, default=[])
    ap.add_argument("--chunks", nargs="*", type=int, default=[], help="swiglu: blocks of 128 a program")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    widths = a.widths or ([1536, 4096, 7168] if a.op == "norm" else [2048, 18432])
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "command": " ".join(["python3 scripts/diag/norm_quant_rows.py"] + (argv or sys.argv[1:])),
                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "op": a.op}, "rows": []}
    for width in widths:
        for m in a.rows:
            if a.op == "norm":
                cases = [_norm_case(m, width, residual, a.warps) for residual in (False, True)]
            else:
                cases = [_swiglu_case(m, width, [(c, w) for c in a.chunks for w in (a.warps or [4])])]
            for row in cases:
                print(json.dumps(row), flush=True)
                res["rows"].append(row)
                write_json(a.out, res)


if __name__ == "__main__":
    main()
