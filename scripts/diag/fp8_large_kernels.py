"""The FP8 GEMM at large M, variant by variant: the whole call's device time and its GEMM kernel's alone (GPU
timeline, ``profiled_device_us(by_kernel=True)``), beside torch's blockwise FP8 GEMM on the same e4m3 operands
(CUDA events; x quantised outside, as torch's row of ``jds.bench.kernels_fp8_gemm``), rounds interleaved.

    python scripts/diag/fp8_large_kernels.py --shapes q_b wo mlp --m 2048 \
        --variants '[{}, {"ring_scales": true}]' --rounds 2 --out OUT.json

Why: the benchmark's pallas row times the call, act_quant of x included (two passes over x in XLA's kernels at
large M), while torch's row times the GEMM alone; the GEMM kernel's own share of the FP8 peak is what the
kernel's changes move. Each row also records the fp32-output call's error against the XLA reference.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import shlex
import sys

import jax
import jax.numpy as jnp

from jds.bench import kernels_fp8_gemm as b
from jds.bench.results import error_text, write_json
from jds.bench.timing import named_kernel_us, profiled_device_us
from pallas_kernels import fp8_gemm


def _kernel_us(by_kernel: dict) -> float | None:
    """The GEMM kernel's time per call (named apart from quantize_rows' since 2026-12-07; the runs before summed
    every Mosaic kernel of the call, quantize_rows' with act_quant="kernel")."""
    return named_kernel_us(by_kernel, fp8_gemm.GEMM_KERNEL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["q_b", "wo", "mlp"], choices=list(b.SHAPES))
    ap.add_argument("--m", type=int, nargs="+", default=[2048])
    ap.add_argument("--variants", default='[{}]', help="JSON list of fp8_linear keyword sets")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--num-sms", type=int, default=None,
                    help="fp8_gemm.NUM_SMS for this run: the persistent loop's CTA count (e.g. 128: q_b's 3072 "
                         "tiles in 24 equal rounds instead of 23 full ones and one of 36 CTAs)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.num_sms is not None:
        if a.num_sms < 1:
            raise SystemExit(f"--num-sms must be positive, got {a.num_sms}")
        fp8_gemm.NUM_SMS = a.num_sms
    variants = json.loads(a.variants)
    torch = None if a.no_torch else b._torch()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__, "variants": variants, "complete": False,
            "num_sms": fp8_gemm.NUM_SMS}
    if torch is not None:
        meta.update(b.fp8_peak(torch))
    rows = []
    for shape in a.shapes:
        k, n = b.SHAPES[shape]
        for m in a.m:
            c = b._case(shape, k, n, m, False, jax.random.key(0))
            x, wq, ws = c["x"], c["wq"], c["ws"]
            flops = 2.0 * m * n * k

            def rates(key: str, t: float | None) -> dict:
                """``t`` µs as TFLOP/s and, where the run measured it, as a share of the FP8 peak."""
                if not t:
                    return {}
                r = {f"{key}_tflops": flops / (t * 1e-6) / 1e12}
                if meta.get("fp8_flops_per_s"):
                    r[f"{key}_peak_frac"] = flops / (t * 1e-6) / meta["fp8_flops_per_s"]
                return r

            ref, ab = b._reference(x, wq, ws)
            fns = {}
            for v in variants:
                name = b._name(v)
                try:
                    f = jax.jit(functools.partial(fp8_gemm.fp8_linear, out_dtype=jnp.bfloat16,
                                                  implementation="pallas", **v))
                    f32 = jax.jit(functools.partial(fp8_gemm.fp8_linear, out_dtype=jnp.float32,
                                                    implementation="pallas", **v))
                    acc = b._accuracy(f32(x, wq, ws), ref, ab)
                    jax.block_until_ready(f(x, wq, ws))
                    fns[name] = (f, acc)
                except Exception as e:  # noqa: BLE001 - one variant's failure is its row
                    rows.append({"shape": shape, "m": m, "impl": name, "error": error_text(e)})
            tfn = None
            if torch is not None:
                xq, sx = jax.jit(functools.partial(b.quant.act_quant, block=128, fmt="ue8m0"))(x)
                tfn, tvar, _ = b._torch_scaled_mm(torch, xq, sx, wq, ws, torch.bfloat16)
            for rnd in range(a.rounds):
                for name, (f, acc) in fns.items():
                    p = profiled_device_us(f, x, wq, ws, calls=10, by_kernel=True)
                    kus = _kernel_us(p.get("profile_kernel_us", {}))
                    r = {"shape": shape, "m": m, "impl": name, "round": rnd, **acc,
                         "call_us": p.get("profile_span_us"), "kernel_us": kus,
                         "kernel_us_by_name": p.get("profile_kernel_us"),
                         **rates("call", p.get("profile_span_us")), **rates("kernel", kus)}
                    rows.append(r)
                    print(json.dumps({q: r.get(q) for q in ("shape", "m", "impl", "round", "call_us", "kernel_us",
                                                            "kernel_peak_frac", "call_peak_frac",
                                                            "err_abssum_max")}), flush=True)
                if tfn is not None:
                    us = b._torch_time_us(torch, tfn, iters=10)
                    r = {"shape": shape, "m": m, "impl": "torch", "variant": tvar, "round": rnd, "kernel_us": us,
                         **rates("kernel", us)}
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            write_json(a.out, {"meta": meta, "rows": rows})  # a run cut short keeps its rows
    meta["complete"] = True
    write_json(a.out, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
