"""Would the dense FP8 linear at decode run faster as the grouped kernel with one expert? GPU timeline.

    python scripts/diag/fp8_dense_grouped.py [--cases q_a:1 q_b:64 ...] [--out F]

Why: at M <= 128 the dense kernel (``fp8_gemm``: x as wgmma's A operand, a 64-row tile of which M rows are
real, promoted per 128 columns over [64, block_n] accumulators) reads its weights at about half the HBM
bandwidth (BENCHMARKS.md, fp8_decode_ncu_sweep), while the grouped kernel (``fp8_grouped_gemm``: roles swapped,
the weights as A, the tokens as an N = block_t operand, [64, block_t] accumulators) reaches 73-85% at 8 to 64
tokens per call. ``fp8_grouped_linear`` with ``sizes = [M]`` computes the same product (DeepSeek's per-128
promotion; its MMA multiplies the e4m3 values exactly in float16). Each row: device time per call, its kernels'
times, and the largest error against the XLA reference relative to sum_k |x_k W_k| (one element's bound).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jds.bench.kernels_fp8_gemm import SHAPES
from jds.bench.results import measured_row, save_rows
from jds.bench.timing import CAPTURED_OPTIONS, measure_ceilings, profiled_device_us
from jds.ops import quant
from pallas_kernels import fp8_gemm, fp8_grouped_gemm

VARIANTS = {"dense": {}, "grouped": {"persistent": None}, "grouped_per_cta": {"persistent": False},
            "grouped_persistent": {"persistent": True}}


def _operands(shape: str, m: int):
    k, n = SHAPES[shape]
    kw, kx = jax.random.split(jax.random.key(0))
    wq = (jax.random.normal(kw, (n, k), jnp.float32) * 0.5).astype(jnp.float8_e4m3fn)
    ws = jnp.exp2(jax.random.randint(jax.random.key(2), (n // 128, k // 128), -9, -5)).astype(jnp.float32)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    return x, wq, ws


def _call(variant: str):
    kw = VARIANTS[variant]
    if variant == "dense":
        return jax.jit(functools.partial(fp8_gemm.fp8_linear, implementation="pallas"),
                       compiler_options=CAPTURED_OPTIONS)

    def grouped(x, wq, ws):
        sizes = jnp.full((1,), x.shape[0], jnp.int32)
        return fp8_grouped_gemm.fp8_grouped_linear(x, sizes, wq[None], ws[None], implementation="pallas", **kw)
    return jax.jit(grouped, compiler_options=CAPTURED_OPTIONS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=[f"{s}:{m}" for s in ("q_b", "mlp", "wo", "q_a") for m in (1, 64, 128)])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ceil = measure_ceilings()
    rows = []
    for c in a.cases:
        shape, m = c.split(":")
        m = int(m)
        x, wq, ws = _operands(shape, m)
        nbytes = wq.size + ws.size * 4 + x.size * 2 + m * wq.shape[0] * 2
        ref = np.asarray(fp8_gemm.fp8_linear(x, wq, ws, implementation="xla", out_dtype=jnp.float32))
        xd = np.asarray(quant.dequant(*quant.act_quant(x, 128, "ue8m0"), 128), np.float64)
        wd = np.asarray(quant.dequant_weight_blocks(wq, ws, 128), np.float64)
        abssum = np.abs(xd) @ np.abs(wd).T
        for v in a.variants:
            f = _call(v)

            def measure(f=f) -> dict:
                got = np.asarray(f(x, wq, ws), np.float64)
                err = float(np.max(np.abs(got - ref) / np.maximum(abssum, 1e-30)))
                t = profiled_device_us(f, x, wq, ws, by_kernel=True)
                return dict(**t, err_rel_abssum_max=err,
                            bandwidth_frac=nbytes / (t["profile_span_us"] * 1e-6) / ceil["copy_bytes_per_s"])
            row = measured_row(dict(case=c, shape=shape, m=m, variant=v, bytes=nbytes), measure)
            rows.append(row)
            save_rows(a.out, rows, False, **ceil)
    save_rows(a.out, rows, True, **ceil)


if __name__ == "__main__":
    main()
