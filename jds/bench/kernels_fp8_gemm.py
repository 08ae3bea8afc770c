"""FP8 block-scaled linear benchmark (issue 19 item 3): the Pallas kernel (``pallas_kernels.fp8_gemm``)
against the XLA path, torch's FP8 GEMM and a bf16 matmul, in the same run.

    python -m jds.bench.kernels_fp8_gemm --out benchmarks/results/kernels_fp8_gemm_<device>_<date>.json
        [--shapes q_a q_b wo mlp] [--ms 1 16 64 128 2048 4096 8192] [--sweep] [--quick]

Shapes: DeepSeek-V3.2 linears, y [M, out] = x [M, in] W^T: q_a 7168->1536, q_b 1536->24576, wo 16384->7168,
mlp 7168->18432, x_proj 7168->2304 (wq_a, the indexer's wk and wkv_a as the model stores them, fused: 1536 + 128 +
576 rows), q_kv_a 7168->2176 (its form before the indexer's wk joined: wq_a and wkv_a, with zero rows to whole scale
blocks) (W e4m3 with amax/448 128x128 block scales, as the checkpoints; x bf16, re-quantised per
1x128 with UE8M0 scales; bf16 out), for M in (1, 16, 64, 128, 2048, 4096, 8192).

Per (shape, M), one row per impl (each in its own try/except: a failing variant records ``error`` and the
others still run):
- ``pallas``: ``fp8_gemm.fp8_linear(implementation="pallas")`` (default tiles; the act_quant of x included,
  ``act_quant_us`` times it alone);
  at M <= 128 also the other ``stage_scales`` choice than the default's (the scales staged in SMEM by TMA) and
  the other ``act_quant`` (x quantised by one kernel, ``fp8_gemm.quantize_rows``, or XLA's three), the other ``stream_k``
  choice up to 128 rows (``quantize_x=True``, x quantised inside the GEMM kernel, measured slower on 2026-12-01:
  ``--rows`` still runs it), and ``pallas[x=quantized]``: x handed over quantised (a ``QuantizedRows``, as the
  model's norms give it to the linears behind them: ``jds.nn.norm_into``), so the call is the GEMM kernel alone
  (its bytes: x in e4m3 with its scales);
  ``--sweep`` adds ``pallas[block_n=..,split_k=..]`` rows for M <= 128 and ``pallas[block_n=..,stages=..,
  group_m=..]`` rows for M >= 2048 (tile tuning data).
- ``xla``: ``jds.ops.quant.fp8_linear`` (dequantise both to fp32, one HIGHEST matmul: the current path).
- ``torch``: ``torch._scaled_mm`` on the same e4m3 operands: blockwise scales (1x128 x, 128x128 W, as the
  kernel) where this torch/cuBLAS takes them, else rowwise (x per row, W per column), else per-tensor
  scales; ``variant`` says which (only "blockwise" computes the same function; the others are the cuBLAS
  FP8 speed reference). x is quantised outside the timed call.
- ``bf16``: ``x @ W_bf16^T`` in jnp (W dequantised to bf16 once, outside the timing).
Fields: median_us (jds.bench.timing.time_fn; torch: CUDA events over back-to-back calls), device_unrolled_us (calls
under 200 us, jds.bench.timing.device_row), profile_span_us / profile_busy_us / profile_kernels and hbm_frac_profile
(kernel rows at M <= 128: the call's device time from the GPU's timeline, jds.bench.timing.profiled_device_us, the
call compiled as one CUDA graph: ``profile_captured``, the calls taking ``profile_weight_copies`` copies of the
weights in turn, together twice the L2; where the profile names the kernels, ``gemm_kernel_us`` /
``hbm_frac_kernel``: the GEMM kernel alone, as torch's row is timed, its bytes ``gemm_kernel_bytes`` with x in
e4m3, and ``quantize_kernel_us``: x's quantisation kernel), tflops (2 M in out / time), fp8_peak_frac (of the FP8
peak measured in this run: torch._scaled_mm per-tensor at 8192^3, bf16 out), bytes (weights + scales + x + y in their stored dtypes: the
unavoidable traffic), hbm_frac (of the copy bandwidth measured in this run: a 1 GiB jnp add), and, vs the XLA output
of the same inputs: max_abs_err, ref_max_abs and err_abssum_max (max |y - ref| / sum_k |x_k W_k|: the tests' metric;
the native test bound is 2^-9). The kernel's accuracy is measured on an extra fp32-output call with the same tiles
(the timed call stores bf16); bf16 / torch rows compare their bf16 output, so their errors include the output
rounding. The XLA row is the reference.
meta: date, jax, torch, command, device, copy_bytes_per_s, bf16_flops_per_s, fp8_flops_per_s (+ how).
``--quick``: tiny shapes for a CPU smoke run (kernel in GPU interpret mode, no torch).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import sys
import time
import traceback
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jds.bench.results import error_text, write_json
from jds.bench.timing import (CAPTURED_OPTIONS, device_row, measure_ceilings, named_kernel_us, profiled_device_us,
                              rotation_copies, time_fn)
from jds.ops import quant
from pallas_kernels import fp8_gemm

SHAPES = {"q_a": (7168, 1536), "q_b": (1536, 24576), "wo": (16384, 7168), "mlp": (7168, 18432),
          "x_proj": (7168, 2304), "q_kv_a": (7168, 2176)}  # (in, out)
MS = (1, 16, 64, 128, 2048, 4096, 8192)
QUICK_SHAPES = {"tiny": (512, 384)}
QUICK_MS = (1, 130)
SWEEP = [dict(block_n=bn, split_k=s) for bn in (64, 128) for s in (1, 4, 8, 14, 28)]
# M >= 2048 (compute bound): column tile x TMA ring depth x rasterisation group; SMEM per stage is
# (128 + block_n) x 128 bytes, so 256-wide tiles take at most 4 stages
SWEEP_LARGE = [dict(block_n=bn, stages=st, group_m=g) for bn, sts in ((128, (4, 6)), (256, (3, 4)))
               for st in sts for g in (8, 16)]
# ... and the persistent forms (one CTA per SM over whole tiles), forty-seventh session; the scales through the
# ring on and off (fifty-third)
SWEEP_LARGE += [dict(persistent=True), dict(persistent=False), dict(ring_scales=False), dict(k_pairs=False),
                dict(persistent=True, block_n=256), dict(persistent=True, group_m=8)]


def _torch():
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        return torch
    except Exception:  # noqa: BLE001 - torch missing or broken: the row records it
        return None


def _to_torch(torch, a: jax.Array):
    """A device array as a torch CUDA tensor (dlpack; e4m3 through a uint8 view where dlpack lacks it)."""
    if a.dtype == jnp.float8_e4m3fn:
        u = jax.lax.bitcast_convert_type(a, jnp.uint8)
        return torch.from_dlpack(u).view(torch.float8_e4m3fn)
    return torch.from_dlpack(a)


def _torch_time_us(torch, fn, iters: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return float(np.median(times))


def fp8_peak(torch, n: int = 8192) -> dict:
    """FP8 tensor-core FLOP/s of this device as cuBLAS reaches it: torch._scaled_mm, per-tensor scales, n^3."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda", dtype=torch.float32)
    us = _torch_time_us(torch, lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                        iters=20)
    return {"fp8_flops_per_s": 2 * n ** 3 / (us * 1e-6), "fp8_peak_how": f"torch._scaled_mm per-tensor {n}^3 bf16 out"}


def _torch_scaled_mm(torch, xq, sx, wq, ws, out_dtype):
    """(callable, variant, errors of the variants tried before): the first of these that runs once:
    blockwise 1x128 (x) x 128x128 (W) through ``torch.nn.functional.scaled_mm`` (torch >= 2.10; cuBLASLt
    >= 12.9 on sm90), the same through the legacy ``torch._scaled_mm`` (recipe inferred from the scale
    shapes), then rowwise, then per-tensor scales (speed references only: not the same function)."""
    a = _to_torch(torch, xq)  # [M, K] row-major
    b = _to_torch(torch, wq).t()  # [K, N] column-major
    m, n, kb = a.shape[0], b.shape[1], a.shape[1] // 128
    sa = _to_torch(torch, sx).t().contiguous().t()  # [M, K/128], M-major ("outer-dim-major")
    l4 = -(-kb // 4) * 4
    sb = torch.nn.functional.pad(_to_torch(torch, ws), (0, l4 - kb)).contiguous().t()  # [L4, N/128]
    f32 = dict(device="cuda", dtype=torch.float32)
    F = torch.nn.functional
    cands = []
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        st, sw = F.ScalingType, F.SwizzleType
        cands.append(("blockwise", lambda: F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, st.BlockWise128x128,
                                                       sw.NO_SWIZZLE, sw.NO_SWIZZLE, output_dtype=out_dtype)))
    cands += [
        ("blockwise_legacy", lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)),
        ("blockwise_legacy_kn", lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=_to_torch(torch, ws).t(),
                                                         out_dtype=out_dtype)),
        ("rowwise", lambda: torch._scaled_mm(a, b, scale_a=torch.ones((m, 1), **f32),
                                             scale_b=torch.ones((1, n), **f32), out_dtype=out_dtype)),
        ("per_tensor", lambda: torch._scaled_mm(a, b, scale_a=torch.ones((), **f32), scale_b=torch.ones((), **f32),
                                                out_dtype=out_dtype)),
    ]
    errors = {}
    for name, fn in cands:
        try:
            fn()
            torch.cuda.synchronize()
            return fn, name, errors
        except Exception as e:  # noqa: BLE001 - try the next scaling mode
            errors[name] = error_text(e)
    return None, None, errors


def _case(shape: str, k: int, n: int, m: int, quick: bool, key) -> dict:
    kw, kx = jax.random.split(key)

    @jax.jit
    def make(kw, kx):
        w = jax.random.normal(kw, (n, k), jnp.float32) * 0.02
        wq, ws = quant.quantize_weight_blocks_jax(w, 128, "amax")
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        return x, wq, ws

    x, wq, ws = make(kw, kx)
    return {"shape": shape, "in": k, "out": n, "m": m, "x": x, "wq": wq, "ws": ws}


@functools.partial(jax.jit, static_argnames=("scale_fmt",))
def _reference(x, wq, ws, scale_fmt="ue8m0"):
    y = quant.fp8_linear(x, wq, ws, jnp.float32, scale_fmt)
    xd = quant.fake_quant(x, 128, scale_fmt)
    wd = quant.dequant_weight_blocks(wq, ws)
    ab = jnp.einsum("mi,oi->mo", jnp.abs(xd), jnp.abs(wd), precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)
    return y, ab


def _accuracy(y, ref, ab) -> dict:
    y = jnp.asarray(y, jnp.float32)
    d = jnp.abs(y - ref)
    return {"max_abs_err": float(jnp.max(d)), "ref_max_abs": float(jnp.max(jnp.abs(ref))),
            "err_abssum_max": float(jnp.max(d / jnp.maximum(ab, 1e-30)))}


def _rates(r: dict, flops: float, nbytes: float, ceil: dict, kernel_bytes: float | None = None) -> None:
    """Rates of a timed row. ``kernel_bytes``: what the GEMM kernel alone moves (x already e4m3 with its scales),
    for ``hbm_frac_kernel``, its share of the copy bandwidth from its own time on the timeline."""
    t = r.get("median_us")
    if not t:
        return
    r["tflops"] = flops / (t * 1e-6) / 1e12
    if ceil.get("fp8_flops_per_s"):
        r["fp8_peak_frac"] = flops / (t * 1e-6) / ceil["fp8_flops_per_s"]
    r["bytes"] = nbytes
    r["hbm_frac"] = nbytes / (t * 1e-6) / ceil["copy_bytes_per_s"]
    if r.get("profile_span_us"):  # the call's device time from the GPU timeline (profiled_device_us)
        r["hbm_frac_profile"] = nbytes / (r["profile_span_us"] * 1e-6) / ceil["copy_bytes_per_s"]
    by = r.get("profile_kernel_us")
    gemm, q = named_kernel_us(by, fp8_gemm.GEMM_KERNEL), named_kernel_us(by, fp8_gemm.QUANTIZE_KERNEL)
    if gemm:  # the GEMM kernel alone, as torch's row is timed (x quantised outside)
        r["gemm_kernel_us"] = gemm
        if kernel_bytes:
            r["gemm_kernel_bytes"] = kernel_bytes
            r["hbm_frac_kernel"] = kernel_bytes / (gemm * 1e-6) / ceil["copy_bytes_per_s"]
    if q:
        r["quantize_kernel_us"] = q


def _iters(flops: float) -> int:
    return 50 if flops < 2e11 else 10


def _name(tiles: dict) -> str:
    """A kernel row's impl: 'pallas' for the defaults, else 'pallas[a=1,b=True,c=kernel]' (``_tiles_of`` inverts)."""
    return "pallas[" + ",".join(f"{a}={b}" for a, b in tiles.items()) + "]" if tiles else "pallas"


def _tiles_of(name: str) -> dict:
    """'pallas[a=1,b=True,c=kernel]' -> {'a': 1, 'b': True, 'c': 'kernel'}."""
    out = {}
    for kv in name[len("pallas["):-1].split(","):
        key, v = kv.split("=")
        out[key] = {"True": True, "False": False}.get(v, int(v) if v.isdigit() else v)
    return out


def run_case(c: dict, ceil: dict, quick: bool, sweep: bool, torch, rows: Sequence[str] | None = None) -> Iterator[dict]:
    m, k, n = c["m"], c["in"], c["out"]
    x, wq, ws = c["x"], c["wq"], c["ws"]
    flops = 2.0 * m * n * k
    scale_bytes = 4.0 * ws.size
    fp8_bytes = n * k + scale_bytes + 2.0 * m * k + 2.0 * m * n  # W e4m3 + scales + x bf16 + y bf16
    gemm_bytes = n * k + scale_bytes + m * k + 4.0 * m * (k // 128) + 2.0 * m * n  # the kernel's: x e4m3 + scales
    base = {"kernel": "fp8_gemm", "case": f"{c['shape']}_m{m}", "shape": c["shape"], "m": m, "in": k, "out": n,
            "flops": flops}
    try:
        ref, ab = _reference(x, wq, ws)
    except Exception as e:  # noqa: BLE001
        ref = ab = None
        yield {**base, "impl": "reference", "error": error_text(e)}
    iters = _iters(flops)
    # the decode timeline's further weight sets (copies: the same values), so that no call reads L2-resident weights
    rot = [(x, jnp.array(wq, copy=True), jnp.array(ws, copy=True))
           for _ in range(rotation_copies(n * k) - 1)] if m <= 128 and not quick else []

    # (a) the kernel (default tiles, plus the sweep)
    # the default stages the scales below STAGE_SCALES_BELOW rows: time the other choice beside it at decode sizes
    tile_sets = [{}]
    if m <= 128:  # beside the defaults, the other choice of staged scales, of stream-K (one even wave) and of
        #           act_quant (one kernel or XLA's three)
        tile_sets += [dict(stage_scales=m >= fp8_gemm.STAGE_SCALES_BELOW),
                      dict(stream_k=not fp8_gemm._auto_stream_k(m, n, k // 128, None, None, None, None)),
                      dict(act_quant="xla" if fp8_gemm._auto_act_quant(m) == "kernel" else "kernel"),
                      dict(x="quantized")]  # x arriving quantised, as the model's norms hand it over
    table = (SWEEP if m <= 128 else SWEEP_LARGE if m >= 2048 else []) if sweep else []
    tile_sets += [v for v in table if (k // 128) % v.get("split_k", 1) == 0 and n % v["block_n"] == 0]
    variants = [(_name(v), v) for v in tile_sets]
    if rows is not None:  # named rows outside the default list (e.g. 'pallas[quantize_x=True]')
        variants += [(r, _tiles_of(r)) for r in rows if r.startswith("pallas[") and r not in dict(variants)]
    wanted = (lambda name: rows is None or name in rows)  # noqa: E731
    for name, tiles in variants:
        if not wanted(name):
            continue
        r = {**base, "impl": name}
        tiles = dict(tiles)
        pre = tiles.pop("x", None) == "quantized"  # x as a QuantizedRows: the call is the GEMM kernel alone
        xa = quant.quantize_rows_xla(x, fp8_gemm.padded_x_rows(m), "ue8m0") if pre else x
        try:
            f = jax.jit(functools.partial(fp8_gemm.fp8_linear, out_dtype=jnp.bfloat16, implementation="pallas",
                                          interpret=True if quick else None, **tiles))
            jax.block_until_ready(f(xa, wq, ws))
            bm, bn, sk = fp8_gemm._pick_tiles(m, n, k // 128, tiles.get("block_m"), tiles.get("block_n"),
                                              tiles.get("split_k"))
            r.update(block_m=bm, block_n=bn, split_k=sk, stages=tiles.get("stages", fp8_gemm.STAGES),
                     group_m=tiles.get("group_m", fp8_gemm.GROUP_M))
            if tiles.get("stream_k", fp8_gemm._auto_stream_k(m, n, k // 128, tiles.get("block_m"), tiles.get(
                    "block_n"), tiles.get("split_k"), tiles.get("stage_scales"))):  # no K split: a wave shares the units
                r.update(split_k=None, stream_k_ctas=fp8_gemm.stream_k_ctas(n // bn, k // 128))
            if ref is not None:  # fp32 out (same tiles), so that bf16 output rounding does not hide the sums
                f32 = jax.jit(functools.partial(fp8_gemm.fp8_linear, out_dtype=jnp.float32, implementation="pallas",
                                                interpret=True if quick else None, **tiles))
                r.update(_accuracy(f32(xa, wq, ws), ref, ab))
            r.update(time_fn(f, xa, wq, ws, iters=3 if quick else iters))
            if not quick:
                r.update(device_row(f, xa, wq, ws, median_us=r["median_us"]))
                if m <= 128:  # decode calls of tens of µs: their device time from the GPU's timeline too, the
                    # call one CUDA graph as inside the model's captured step (no host gap between its kernels)
                    fc = jax.jit(functools.partial(fp8_gemm.fp8_linear, out_dtype=jnp.bfloat16, implementation="pallas",
                                                   **tiles), compiler_options=CAPTURED_OPTIONS)
                    # weight copies spanning twice the L2 in turn: q_b's 36 MiB would otherwise stay in L2
                    rot_a = [(xa, w, s) for _, w, s in rot]
                    r.update(profiled_device_us(fc, xa, wq, ws, by_kernel=True, rotate=rot_a), profile_captured=True,
                             profile_weight_copies=1 + len(rot))
            if name == "pallas":  # act_quant of x alone in XLA (the call quantises x; torch's row excludes it)
                aq = jax.jit(functools.partial(quant.act_quant, block=128, fmt="ue8m0"))
                r["act_quant_us"] = time_fn(aq, x, iters=3 if quick else 20)["median_us"]
            _rates(r, flops, gemm_bytes if pre else fp8_bytes, ceil, gemm_bytes)
        except Exception as e:  # noqa: BLE001
            r["error"] = error_text(e)
            r["traceback"] = traceback.format_exc()[-2000:]
        yield r

    # (b) the XLA path
    if wanted("xla"):
        r = {**base, "impl": "xla"}
        try:
            f = jax.jit(functools.partial(fp8_gemm.fp8_linear, out_dtype=jnp.bfloat16, implementation="xla"))
            jax.block_until_ready(f(x, wq, ws))
            r.update(time_fn(f, x, wq, ws, iters=3 if quick else iters))
            _rates(r, flops, fp8_bytes, ceil)
        except Exception as e:  # noqa: BLE001
            r["error"] = error_text(e)
        yield r

    # (c) torch._scaled_mm on the same e4m3 operands
    if torch is not None and wanted("torch"):
        r = {**base, "impl": "torch"}
        try:
            xq, sx = jax.jit(functools.partial(quant.act_quant, block=128, fmt="ue8m0"))(x)
            fn, variant, errors = _torch_scaled_mm(torch, xq, sx, wq, ws, torch.bfloat16)
            r["variant"], r["variant_errors"] = variant, errors
            if fn is not None:
                if variant.startswith("blockwise") and ref is not None:
                    # bf16 out: its error includes the output rounding (~2^-9 |y|), unlike the kernel's row
                    y = jnp.asarray(np.asarray(fn().float().cpu()))
                    r.update(_accuracy(y, ref, ab))
                r["median_us"] = _torch_time_us(torch, fn, iters=iters)
                _rates(r, flops, fp8_bytes, ceil)
        except Exception as e:  # noqa: BLE001
            r["error"] = error_text(e)
        yield r

    # (d) bf16 matmul
    if not wanted("bf16"):
        return
    r = {**base, "impl": "bf16"}
    try:
        wb = jax.jit(lambda a, s: quant.dequant_weight_blocks(a, s).astype(jnp.bfloat16))(wq, ws)
        f = jax.jit(lambda a, b: a @ b.T)
        y = jax.block_until_ready(f(x, wb))
        if ref is not None:
            r.update(_accuracy(y, ref, ab))
        r.update(time_fn(f, x, wb, iters=3 if quick else iters))
        _rates(r, flops, 2.0 * n * k + 2.0 * m * k + 2.0 * m * n, ceil)
        del wb
    except Exception as e:  # noqa: BLE001
        r["error"] = error_text(e)
    yield r


def benchmark(quick: bool, cases: Sequence[str] | None = None, ms: Sequence[int] | None = None,
              sweep: bool = False, ceil: dict | None = None, rows: Sequence[str] | None = None) -> Iterator[dict]:
    """Rows for ``jds.bench.kernels`` (``cases``: shape names) or this module's ``main``."""
    shapes = QUICK_SHAPES if quick else SHAPES
    names = [s for s in shapes if cases is None or s in cases]
    ceil = ceil if ceil is not None else {**measure_ceilings(quick), **_peak(quick)}
    torch = None if quick else _torch()
    key = jax.random.key(0)
    for name in names:
        k, n = shapes[name]
        for m in (ms or (QUICK_MS if quick else MS)):
            key, sub = jax.random.split(key)
            try:
                c = _case(name, k, n, m, quick, sub)
            except Exception as e:  # noqa: BLE001
                yield {"kernel": "fp8_gemm", "case": f"{name}_m{m}", "impl": "setup", "error": error_text(e)}
                continue
            yield from run_case(c, ceil, quick, sweep, torch, rows)
            del c
            gc.collect()


def _peak(quick: bool) -> dict:
    torch = None if quick else _torch()
    if torch is None:
        return {"fp8_flops_per_s": None, "fp8_peak_how": "torch with CUDA not available"}
    try:
        return fp8_peak(torch)
    except Exception as e:  # noqa: BLE001
        return {"fp8_flops_per_s": None, "fp8_peak_how": error_text(e)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES) + sorted(QUICK_SHAPES))
    ap.add_argument("--ms", nargs="+", type=int, default=None)
    ap.add_argument("--sweep", action="store_true", help="also time tile variants for M <= 128 and M >= 2048")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, CPU smoke run (interpret mode)")
    ap.add_argument("--rows", nargs="+", default=None, help="only these rows (impl names: pallas, "
                    "'pallas[act_quant=kernel]', ..., xla, torch, bf16); default all")
    a = ap.parse_args(argv)
    t0 = time.time()
    ceil = {**measure_ceilings(a.quick), **_peak(a.quick)}
    try:
        import torch as torch_mod
        torch_version = torch_mod.__version__
    except Exception:  # noqa: BLE001
        torch_version = None
    cmd = " ".join(["python -m jds.bench.kernels_fp8_gemm"] + (sys.argv[1:] if argv is None else argv))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
            "torch": torch_version, "torch_cuda": _torch() is not None, "device": jax.devices()[0].device_kind, "command": cmd,
            **ceil, "complete": False}
    rows = []
    for r in benchmark(a.quick, a.shapes, a.ms, a.sweep, ceil, a.rows):
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "traceback"}), flush=True)
        write_json(a.out, {"meta": meta, "rows": rows})  # after every row: a cut-short run keeps them
    write_json(a.out, {"meta": {**meta, "complete": True, "wall_s": time.time() - t0}, "rows": rows})


if __name__ == "__main__":
    main()
