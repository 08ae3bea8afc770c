"""FP8 linears that share one input x: separate GEMMs in one executable against one fused GEMM (issue 19).

Two questions about V3.2's layer, answered from the GPU timeline (``jds.bench.timing.profiled_device_us``, each
variant one executable compiled as one CUDA graph, the weights cycled through copies spanning twice the L2):

- ``x``: the projections of the normed x. ``three``: wq_a + wkv_a fused (2176 rows, zero rows to whole scale
  blocks, the form before the indexer's wk joined) beside wk (128 rows) as a second GEMM; ``one``: the three as
  one GEMM (2304 rows, the model's ``wq_a_wk_wkv_a`` now).
- ``qc``: the normed q latent's two linears, wq_b (24576 rows) and the indexer's wq_b (8192). ``two``: two GEMMs,
  as the model runs them (wq_b is split over ``tensor`` by heads, the indexer's is replicated: one fused weight
  would not shard); ``one``: one GEMM of 32768 rows, for reference. ``profile_kernels`` says whether XLA merged the
  two identical quantisations of x into one kernel (CSE of the side-effect-free custom calls): 3 kernels, not 4.
- ``comp``: a V4 compressor's fp32 projection of x (V4-Flash's C4 compressor: wkv and wgate 1024 x 4096 each).
  ``concat``: the two weights concatenated inside the step, then one fp32 GEMM (the form before the compressor
  stored them as one weight); ``stored``: one GEMM on the stored [2048, 4096] weight; ``stored_bf16``: the same
  weight held in bf16 (``Numerics.compressor_float32`` off), bf16 operands with an fp32 output.

- ``woa``: V4's grouped wo_a in the forms XLA could be given and on ``pallas_kernels.group_linear``'s kernel
  (``run_wo_a``), beside a copy of the weight (``copy``: read and write, the rate ceiling measured in the run).

    python3 scripts/diag/shared_x_gemms.py [--ms 1 64 128] [--cases x qc comp woa] [--woa-variants V ...]
        [--out F.json]

Per (case, variant, rows): ``profile_span_us`` (first kernel start -> last end), ``profile_busy_us``,
``profile_kernels`` and ``profile_kernel_us`` (per kernel name). Native only (the timeline needs a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jds.bench.timing import CAPTURED_OPTIONS, profiled_device_us, rotation_copies
from jds.ops.quant import quantize_weight_blocks
from pallas_kernels.fp8_gemm import fp8_linear, pad_out_rows

CASES = {"x": (7168, {"three": (2176, 128), "one": (2304,)}),  # in, variant -> the GEMMs' out rows
         "qc": (1536, {"two": (24576, 8192), "one": (32768,)})}


def _weight(rng: np.random.Generator, n: int, k: int, out_rows: int | None = None) -> tuple[jax.Array, jax.Array]:
    """An e4m3 weight with 128 x 128 block scales; ``out_rows``: the real rows (the rest zero, as stored)."""
    w = rng.standard_normal((out_rows or n, k), np.float32) * k ** -0.5
    wq, s = quantize_weight_blocks(w)
    return pad_out_rows(jnp.asarray(wq)), jnp.asarray(s)


def _timed_row(r: dict, fc, x: jax.Array, weights: list[jax.Array], nbytes: int) -> dict:
    """``r`` with ``fc(x, *weights)``'s GPU-timeline row, the weights cycled through copies spanning twice the L2
    (an error is the row's ``error``, not the end of the run); printed as it is done."""
    rot = [[x] + [jnp.array(a, copy=True) for a in weights] for _ in range(rotation_copies(nbytes) - 1)]
    try:
        r.update(profiled_device_us(fc, x, *weights, by_kernel=True, rotate=rot), weight_copies=1 + len(rot))
    except Exception as e:  # noqa: BLE001
        r["error"] = f"{type(e).__name__}: {e}"[:400]
    print(json.dumps(r), flush=True)
    return r


def run(ms: tuple[int, ...], cases: list[str]) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for case in cases:
        k, variants = CASES[case]
        for variant, outs in variants.items():
            # the 2176-row GEMM is wq_a + wkv_a: 2112 real rows, zero rows to 2176 (as the model stored it)
            ws = [_weight(rng, n, k, 2112 if n == 2176 else None) for n in outs]
            nbytes = sum(int(w.size) for w, _ in ws)

            def call(x, *wss):
                return tuple(fp8_linear(x, w, s, implementation="pallas") for w, s in zip(wss[::2], wss[1::2]))

            fc = jax.jit(call, compiler_options=CAPTURED_OPTIONS)
            flat = [a for w, s in ws for a in (w, s)]
            for m in ms:
                x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
                r = {"case": case, "variant": variant, "m": m, "k": k, "outs": list(outs), "weight_bytes": nbytes}
                rows.append(_timed_row(r, fc, x, flat, nbytes))
    return rows


def run_compressor(ms: tuple[int, ...], hidden: int = 4096, rows: int = 1024) -> list[dict]:
    """The ``comp`` case: fp32 x W^T (HIGHEST) on [wkv; wgate] concatenated per call or stored as one weight."""
    rng = np.random.default_rng(1)
    hi = jax.lax.Precision.HIGHEST
    a, b = (jnp.asarray(rng.standard_normal((rows, hidden), np.float32)) for _ in range(2))
    w = jnp.concatenate([a, b], axis=0)
    wb = w.astype(jnp.bfloat16)
    fns = {"concat": (lambda x, a, b: jnp.einsum("ti,oi->to", x.astype(jnp.float32), jnp.concatenate([a, b], 0),
                                                 precision=hi), (a, b)),
           "stored": (lambda x, w: jnp.einsum("ti,oi->to", x.astype(jnp.float32), w, precision=hi), (w,)),
           "stored_bf16": (lambda x, w: jnp.einsum("ti,oi->to", x, w, preferred_element_type=jnp.float32), (wb,))}
    out = []
    for variant, (fn, ws) in fns.items():
        fc = jax.jit(fn, compiler_options=CAPTURED_OPTIONS)
        nbytes = sum(int(v.size) * v.dtype.itemsize for v in ws)
        for m in ms:
            x = jnp.asarray(rng.standard_normal((m, hidden), np.float32), jnp.bfloat16)
            r = {"case": "comp", "variant": variant, "m": m, "k": hidden, "outs": [2 * rows], "weight_bytes": nbytes}
            out.append(_timed_row(r, fc, x, list(ws), nbytes))
    return out


def run_wo_a(ms: tuple[int, ...], groups: int = 8, o_lora: int = 1024, k: int = 4096,
             variants: list[str] | None = None) -> list[dict]:
    """The ``woa`` case: V4's grouped wo_a (V4-Flash: 8 groups of [1024, 4096], bf16 as the release runs it),
    y[t, g] = W_g x[t, g], in the forms XLA could be given: ``f32out`` (the model's einsum with an fp32 output, then
    rounded), ``bf16out`` (the same einsum writing bf16; XLA's GPU GEMMs sum in fp32 either way), ``gmajor``
    (x made group-major first), ``splitk2`` (K in two halves, summed in fp32), ``cublas`` (``f32out`` with XLA's
    Triton GEMMs off), ``fp8`` (the grouped FP8 GEMM on an e4m3 copy of the weight, as vLLM's fp8_einsum runs it;
    a departure from the release's bf16, for reference), ``kernel`` (``group_linear``'s kernel at its defaults;
    ``kernel_bn32`` / ``_bn128`` other tile widths, ``kernel_s6`` a 6-stage ring) and ``copy`` (-w: the weight
    read and written once, for the copy rate)."""
    from pallas_kernels.fp8_grouped_gemm import fp8_grouped_linear
    from pallas_kernels.group_linear import group_linear

    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((groups, o_lora, k), np.float32) * k ** -0.5, jnp.bfloat16)
    wq, ws = zip(*(quantize_weight_blocks(np.asarray(w[g], np.float32)) for g in range(groups)))
    wq, ws = jnp.asarray(np.stack(wq)), jnp.asarray(np.stack(ws))
    f32 = jnp.float32

    def gmajor(x, w):
        y = jnp.einsum("gti,goi->gto", jnp.swapaxes(x, 0, 1), w, preferred_element_type=f32)
        return jnp.swapaxes(y, 0, 1).astype(jnp.bfloat16)

    def splitk2(x, w):
        t = x.shape[0]
        y = jnp.einsum("tgsi,gosi->tgso", x.reshape(t, groups, 2, k // 2), w.reshape(groups, o_lora, 2, k // 2),
                       preferred_element_type=f32)
        return y.sum(axis=2).astype(jnp.bfloat16)

    def fp8(x, wq, ws):
        t = x.shape[0]
        rows = jnp.swapaxes(x, 0, 1).reshape(groups * t, k)
        y = fp8_grouped_linear(rows, jnp.full((groups,), t, jnp.int32), wq, ws, implementation="pallas")
        return jnp.swapaxes(y.reshape(groups, t, o_lora), 0, 1)

    einsum = lambda x, w, dt: jnp.einsum("tgi,goi->tgo", x, w, preferred_element_type=dt)  # noqa: E731
    fns = {"f32out": (lambda x, w: einsum(x, w, f32).astype(jnp.bfloat16), (w,), CAPTURED_OPTIONS),
           "bf16out": (lambda x, w: einsum(x, w, jnp.bfloat16), (w,), CAPTURED_OPTIONS),
           "gmajor": (gmajor, (w,), CAPTURED_OPTIONS), "splitk2": (splitk2, (w,), CAPTURED_OPTIONS),
           "cublas": (lambda x, w: einsum(x, w, f32).astype(jnp.bfloat16), (w,),
                      {**CAPTURED_OPTIONS, "xla_gpu_enable_triton_gemm": False}),
           "fp8": (fp8, (wq, ws), CAPTURED_OPTIONS),
           "copy": (lambda x, w: -w, (w,), CAPTURED_OPTIONS)}
    kern = {"kernel": {}, "kernel_bn32": dict(block_n=32), "kernel_bn128": dict(block_n=128),
            "kernel_s6": dict(stages=6)}
    for name, kw in kern.items():
        fns[name] = (lambda x, w, kw=kw: group_linear(x, w.reshape(groups * o_lora, k), implementation="pallas", **kw),
                     (w,), CAPTURED_OPTIONS)
    fns = {v: f for v, f in fns.items() if variants is None or v in variants}
    out = []
    xs = {m: jnp.asarray(rng.standard_normal((m, groups, k), np.float32), jnp.bfloat16) for m in ms}
    want = {m: np.asarray(einsum(x, w, f32).astype(jnp.bfloat16), np.float32) for m, x in xs.items()}
    for variant, (fn, wts, opts) in fns.items():
        fc = jax.jit(fn, compiler_options=opts)
        nbytes = sum(int(v.size) * v.dtype.itemsize for v in wts)
        for m, x in xs.items():
            r = {"case": "woa", "variant": variant, "m": m, "k": k, "outs": [groups * o_lora], "weight_bytes": nbytes}
            try:  # against the model's form: bf16 rounding apart, except fp8 (x and W quantised); copy: none
                if variant != "copy":
                    r["max_abs_vs_f32out"] = float(np.abs(np.asarray(fc(x, *wts), np.float32) - want[m]).max())
                    r["max_abs_f32out"] = float(np.abs(want[m]).max())
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {e}"[:400]
            out.append(_timed_row(r, fc, x, list(wts), nbytes))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 64, 128])
    ap.add_argument("--cases", nargs="+", default=["x", "qc", "comp", "woa"], choices=["x", "qc", "comp", "woa"])
    ap.add_argument("--woa-variants", nargs="+", default=None, help="the woa case's variants (default: all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("shared_x_gemms: needs a GPU (the timeline's kernel records)")
    rows = run(tuple(a.ms), [c for c in a.cases if c in CASES])
    rows += run_compressor(tuple(a.ms)) if "comp" in a.cases else []
    rows += run_wo_a(tuple(a.ms), variants=a.woa_variants) if "woa" in a.cases else []
    if a.out:
        meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
                "jax": jax.__version__,
                "command": "python3 scripts/diag/shared_x_gemms.py " + " ".join(argv or sys.argv[1:])}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
