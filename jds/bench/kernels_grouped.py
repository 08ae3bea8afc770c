"""Grouped (MoE) expert GEMM benchmark: the Pallas kernels (``pallas_kernels.fp4_grouped_gemm``,
``fp8_grouped_gemm``) against their XLA paths, in the same run as the copy-bandwidth ceiling.

    python -m jds.bench.kernels_fp4_grouped [--out ...] [--shapes w1 w2] [--tokens 1 8 32 64 4096] [--sweep] [--quick]
    python -m jds.bench.kernels_fp8_grouped [...]        (= python -m jds.bench.kernels_grouped --format fp8 ...)

Formats, E = 256 routed experts, y [M, N] = x [M, K] W[e]^T:
- fp4: DeepSeek-V4-Flash, W packed e2m1 (uint8 [E, N, K/2] + e8m0 bytes [E, N, K/32], as the checkpoint),
  w1 (= w3) K 4096 -> N 2048, w2 K 2048 -> N 4096, top-6; XLA: the stack dequantised to bf16 + ragged dot.
- fp8: DeepSeek-V3.2, W e4m3 [E, N, K] with float32 128 x 128 block scales, x re-quantised per 128 (ue8m0),
  w1 (= w3) K 7168 -> N 2048, w2 K 2048 -> N 7168, top-8; XLA: both dequantised to float32 + ragged dot.
Tokens 1, 8, 32, 64 (decode) and 4096 (prefill), each routed to top_k distinct random experts: M = top_k x
tokens rows sorted by expert.

Per (shape, tokens), one row per impl (each in its own try/except: a failing variant records ``error``):
- ``pallas``: the kernel with the default tiles (``block_t`` ... ``split_k`` recorded); fp4 also
  ``pallas[dequant=f16]``, the portable dequantisation route (the default is "lop3" at decode tiles), and
  ``pallas[x=e4m3]``, x given as act_quant's e4m3 + scales (the "fp8" route, as the V4 MoE calls it; the
  quantisation outside the timed call, its reference the product of the quantised x);
  the rows' bookkeeping (``grouped_rows.row_layout``) in the other form than the default: fp4
  ``pallas[layout=xla]`` (XLA's ops; the default natively is one kernel), fp8 ``pallas[layout=pallas]`` (one kernel);
  ``--sweep`` adds ``pallas[...]`` rows for other tiles (tuning data).
- ``xla``: ``implementation="xla"``.
Fields: median_us (jds.bench.timing.time_fn), device_unrolled_us (calls under 200 us: timing.device_row),
profile_span_us / profile_busy_us / profile_kernels and hbm_frac_profile (per call, from the GPU's timeline:
timing.profiled_device_us),
bytes (weights + scales of the experts that have rows, + x and y in bf16: the unavoidable traffic),
l2_rotations (each timed call cycles this many routings of the same batch, so that the weights stream from
HBM and not the 50 MB L2; times and bytes are per routing, active_experts their mean),
hbm_frac (of the copy bandwidth measured in this run: a 1 GiB jnp add), hbm_frac_nominal (of 4.8 TB/s),
active_experts, and vs a float64 numpy reference on ``ref_rows`` rows (all rows up to 32, else 32 sampled;
fp4 nibbles decoded with a lookup table, fp8 from act_quant's xq / sx): max_abs_err, ref_max_abs,
err_abssum_max (max |y - ref| / sum_k |x_k W_k|; bf16 output, so about 2^-9 of |y| is its rounding).
meta: date, jax, command, device, copy_bytes_per_s, bf16_flops_per_s, nominal_hbm_bytes_per_s.
``--quick``: tiny shapes for a CPU smoke run (kernel in GPU interpret mode).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jds.bench.results import error_text, write_json
from jds.bench.timing import device_row, measure_ceilings, profiled_device_us, time_fn
from jds.ops import quant
from pallas_kernels import fp4_grouped_gemm as fp4g
from pallas_kernels import fp8_grouped_gemm as fp8g

TOKENS = (1, 8, 32, 64, 4096)
N_EXPERTS = 256
QUICK_SHAPES = {"tiny": (512, 128)}  # (K, N)
QUICK_TOKENS = (1, 4)
QUICK_EXPERTS, QUICK_TOP_K = 8, 2
NOMINAL_HBM = 4.8e12  # H200 HBM3e, bytes/s
REF_ROWS = 32
L2_BYTES = 50 * 2 ** 20
SWEEP = [dict(block_k=bk, split_k=s, block_n=bn) for bk in (128, 256, 512) for s in (1, 2, 4, 8) for bn in (64, 128)]
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def _fp4_experts(k: int, n: int, e: int, key) -> tuple[jax.Array, jax.Array]:
    """Random FP4 experts (uniform codes, jittered block scales), drawn on the device."""
    return jax.jit(functools.partial(quant.random_fp4_weight, shape=(e, n, k), std=k ** -0.5))(key)


def _fp4_dense(wp: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """float64 W [N, K] of one FP4 expert (nibbles by lookup table)."""
    w = np.empty((wp.shape[0], 2 * wp.shape[1]))
    w[:, 0::2], w[:, 1::2] = E2M1[wp & 0xF], E2M1[wp >> 4]
    return w * np.repeat(np.exp2(ws.astype(np.float64) - 127), 32, axis=-1)


def _fp8_experts(k: int, n: int, e: int, key) -> tuple[jax.Array, jax.Array]:
    """Random FP8 experts as a checkpoint stores them (``quant.random_fp8_weight``), drawn on the device."""
    return jax.jit(functools.partial(quant.random_fp8_weight, shape=(e, n, k), std=k ** -0.5))(key)


def _fp8_dense(wq: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """float64 W [N, K] of one FP8 expert."""
    return wq.astype(np.float64) * np.repeat(np.repeat(ws.astype(np.float64), 128, axis=0), 128, axis=1)


@dataclass(frozen=True)
class Format:
    """What differs between the FP4 and FP8 grouped GEMMs in this benchmark."""
    name: str
    shapes: dict[str, tuple[int, int]]  # (K, N)
    top_k: int
    op: Callable[..., jax.Array]
    pick_tiles: Callable[..., tuple[int, int, int, int]]
    experts: Callable[[int, int, int, Any], tuple[jax.Array, jax.Array]]
    dense: Callable[[np.ndarray, np.ndarray], np.ndarray]  # one expert's weights in float64
    weight_bytes: Callable[[int, int], float]  # per expert, weights + scales
    x_ref: Callable[[jax.Array], np.ndarray]  # the float64 x the reference multiplies
    variants: tuple[tuple[str, dict], ...]  # kernel rows besides the default "pallas"


def _fp8_x(x: jax.Array) -> np.ndarray:
    """The x the FP8 GEMM multiplies: act_quant's xq * sx (exact in float32: ue8m0 scales are powers of two)."""
    return np.asarray(quant.dequant(*quant.act_quant(x, 128, "ue8m0")), np.float64)


FORMATS = {
    "fp4": Format("fp4", {"w1": (4096, 2048), "w2": (2048, 4096)}, 6, fp4g.fp4_grouped_linear, fp4g._pick_tiles,
                  _fp4_experts, _fp4_dense, lambda k, n: n * (k // 2 + k // 32),
                  lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64),
                  (("pallas[x=e4m3]", dict(x_fp8=True)), ("pallas[dequant=f16]", dict(dequant="f16")),
                   ("pallas[layout=xla]", dict(layout="xla")))),
    "fp8": Format("fp8", {"w1": (7168, 2048), "w2": (2048, 7168)}, 8, fp8g.fp8_grouped_linear, fp8g._pick_tiles,
                  _fp8_experts, _fp8_dense, lambda k, n: n * k + 4 * (n // 128) * (k // 128), _fp8_x,
                  (("pallas[layout=pallas]", dict(layout="pallas")),)),
}


def default_out(fmt: str = "fp4") -> str:
    """benchmarks/results/kernels_<fmt>_grouped_<device>_<date>.json (device: "NVIDIA H200" -> "h200")."""
    kind = jax.devices()[0].device_kind.lower().replace("nvidia", "").strip().replace(" ", "_") or "cpu"
    return os.path.join("benchmarks", "results", f"kernels_{fmt}_grouped_{kind}_{datetime.date.today().isoformat()}.json")


def _routing(e: int, k: int, tokens: int, top_k: int, key) -> tuple[jax.Array, np.ndarray]:
    """(x [tokens * top_k, k] bf16, group sizes [e]): random top-k routing, distinct experts per token."""
    kx, kr = jax.random.split(key)
    choice = jax.vmap(lambda kk: jax.random.choice(kk, e, (top_k,), replace=False))(jax.random.split(kr, tokens))
    sizes = np.bincount(np.asarray(choice).reshape(-1), minlength=e).astype(np.int32)
    return jax.random.normal(kx, (tokens * top_k, k), jnp.float32).astype(jnp.bfloat16), sizes


def _case(fmt: Format, shape: str, k: int, n: int, tokens: int, top_k: int, wp: jax.Array, ws: jax.Array, key,
          quick: bool = False) -> dict:
    """One routing over the experts ``wp`` / ``ws`` (x rows sorted by expert), plus more routings of the same
    batch for timing when one call's bytes would fit in L2 (``_rotations``; none in a quick run)."""
    e = wp.shape[0]
    keys = jax.random.split(key, 1 if quick else _rotations(e, tokens, top_k, fmt.weight_bytes(k, n)))
    routes = [_routing(e, k, tokens, top_k, kk) for kk in keys]
    x, sizes = routes[0]
    return {"fmt": fmt, "shape": shape, "k": k, "n": n, "tokens": tokens, "top_k": top_k, "e": e, "x": x,
            "sizes": jnp.asarray(sizes), "sizes_np": sizes, "wp": wp, "ws": ws,
            "xs": [r[0] for r in routes], "sizes_all": [jnp.asarray(r[1]) for r in routes],
            "active_all": [int((r[1] > 0).sum()) for r in routes]}


def _rotations(e: int, tokens: int, top_k: int, expert_bytes: float) -> int:
    """Routings cycled per timed call: enough that their weights (about min(E, tokens * top_k) experts each)
    exceed 3x the 50 MB L2, so repeated calls stream from HBM, not L2 (FP4 decode at 1 token: 6 experts, ~27 MB)."""
    per_call = min(e, tokens * top_k) * expert_bytes
    return int(min(16, max(1, -(-L2_BYTES * 3 // per_call))))


def _reference_rows(c: dict, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 (y, sum_k |x_k W_k|) of the given rows, one expert's dequantised weights at a time."""
    sizes = c["sizes_np"]
    ends = np.cumsum(sizes)
    experts = np.searchsorted(ends, rows, side="right")
    x = c["fmt"].x_ref(c["x"])[rows]
    y, ab = np.zeros((len(rows), c["n"])), np.zeros((len(rows), c["n"]))
    for ex in np.unique(experts):
        w = c["fmt"].dense(np.asarray(c["wp"][ex]), np.asarray(c["ws"][ex]))
        sel = experts == ex
        y[sel], ab[sel] = x[sel] @ w.T, np.abs(x[sel]) @ np.abs(w).T
    return y, ab


def _accuracy(y: jax.Array, rows: np.ndarray, ref: np.ndarray, ab: np.ndarray) -> dict:
    g = np.asarray(jnp.asarray(y, jnp.float32), np.float64)[rows]
    d = np.abs(g - ref)
    return {"max_abs_err": float(d.max()), "ref_max_abs": float(np.abs(ref).max()),
            "err_abssum_max": float((d / np.maximum(ab, 1e-300)).max()), "ref_rows": int(len(rows))}


def _rates(r: dict, nbytes: float, ceil: dict) -> None:
    t = r.get("median_us")
    if not t:
        return
    r["bytes"] = nbytes
    r["hbm_frac"] = nbytes / (t * 1e-6) / ceil["copy_bytes_per_s"]
    r["hbm_frac_nominal"] = nbytes / (t * 1e-6) / NOMINAL_HBM
    if r.get("device_unrolled_us"):
        r["device_unrolled_hbm_frac"] = nbytes / (r["device_unrolled_us"] * 1e-6) / ceil["copy_bytes_per_s"]
    if r.get("profile_span_us"):  # the call's device time from the GPU's timeline (profiled_device_us)
        r["hbm_frac_profile"] = nbytes / (r["profile_span_us"] * 1e-6) / ceil["copy_bytes_per_s"]


def run_case(c: dict, ceil: dict, quick: bool, sweep: bool) -> Iterator[dict]:
    fmt: Format = c["fmt"]
    k, n, e, m = c["k"], c["n"], c["e"], c["x"].shape[0]
    rot = len(c["xs"])
    active = float(np.mean(c["active_all"]))  # per call, over the timed routings
    nbytes = active * fmt.weight_bytes(k, n) + 2.0 * m * k + 2.0 * m * n
    base = {"kernel": f"{fmt.name}_grouped", "case": f"{c['shape']}_t{c['tokens']}", "shape": c["shape"], "k": k,
            "n": n, "experts": e, "top_k": c["top_k"], "tokens": c["tokens"], "m": m, "active_experts": active,
            "l2_rotations": rot, "flops": 2.0 * m * n * k}
    rng = np.random.default_rng(0)
    rows = np.arange(m) if m <= REF_ROWS else np.sort(rng.choice(m, REF_ROWS, replace=False))
    try:
        ref, ab = _reference_rows(c, rows)
    except Exception as ex:  # noqa: BLE001
        ref = ab = None
        yield {**base, "impl": "reference", "error": error_text(ex)}
    args = (c["x"], c["sizes"], c["wp"], c["ws"])
    iters = 3 if quick else (50 if m <= 512 else 10)
    # a quick run keeps the e4m3-x route (a different kernel path), not the tile / dequantisation variants
    variants = [("pallas", {})] + [v for v in fmt.variants if not quick or v[1].get("x_fp8")]
    if sweep and m <= 512:
        variants += [(f"pallas[{','.join(f'{a}={b}' for a, b in v.items())}]", v) for v in SWEEP
                     if (k // 512) % v["split_k"] == 0 and n % v["block_n"] == 0
                     and (fmt.name == "fp4" or v["block_k"] <= 256)]
    variants.append(("xla", None))
    for name, tiles in variants:
        r = {**base, "impl": name}
        try:
            x_fp8 = bool(tiles and tiles.get("x_fp8"))
            if tiles is None:
                f = jax.jit(functools.partial(fmt.op, implementation="xla"))
            else:
                tiles = {a: b for a, b in tiles.items() if a != "x_fp8"}
                f = jax.jit(functools.partial(fmt.op, implementation="pallas", interpret=True if quick else None,
                                              **tiles))
                bt, bn, bk, s = fmt.pick_tiles(m, e, n, k, tiles.get("block_t"), tiles.get("block_n"),
                                               tiles.get("block_k"), tiles.get("split_k"),
                                               **({"fp8": True} if x_fp8 else {}))
                r.update(block_t=bt, block_n=bn, block_k=bk, split_k=s)
            if x_fp8:  # fp4 with e4m3 x: act_quant outside the timed call (the V4 MoE quantises its input anyway)
                q8 = jax.jit(lambda x: quant.act_quant(x, 128, "ue8m0"))
                fq = f
                f = jax.jit(lambda xq, sz, wp, ws, sx: fq(xq, sz, wp, ws, x_scale=sx))
                xs_q = [q8(x) for x in c["xs"]]
                y = jax.block_until_ready(f(xs_q[0][0], c["sizes"], c["wp"], c["ws"], xs_q[0][1]))
                if ref is not None:  # against the product of the quantised x
                    r.update(_accuracy(y, rows, *_reference_rows({**c, "fmt": replace(fmt, x_ref=_fp8_x)}, rows)))
                g = jax.jit(lambda xs, szs, wp, ws: [f(a[0], b, wp, ws, a[1]) for a, b in zip(xs, szs)])
                targs = (xs_q, c["sizes_all"], c["wp"], c["ws"])
                nb = nbytes - 1.0 * m * k + 4.0 * m * k / 128  # e4m3 x and its scales instead of bf16 x
            else:
                y = jax.block_until_ready(f(*args))
                if ref is not None:
                    r.update(_accuracy(y, rows, ref, ab))
                # one timed call = ``rot`` calls on different routings (weights not L2-resident), time per call
                g = jax.jit(lambda xs, szs, wp, ws: [f(a, b, wp, ws) for a, b in zip(xs, szs)])
                targs = (c["xs"], c["sizes_all"], c["wp"], c["ws"])
                nb = nbytes
            del y
            t = time_fn(g, *targs, iters=iters)
            r.update({key: v / rot if key.endswith("_us") else v for key, v in t.items()})
            if not quick:
                d = device_row(g, *targs, median_us=t["median_us"])
                r.update({key: v / rot for key, v in d.items()})
                d = profiled_device_us(g, *targs)  # per timed call of ``rot`` calls, from the GPU's timeline
                r.update({key: v / rot if key != "profile_calls" and isinstance(v, (int, float)) else v
                          for key, v in d.items()})
            _rates(r, nb, ceil)
        except Exception as ex:  # noqa: BLE001
            r["error"] = error_text(ex)
            r["traceback"] = traceback.format_exc()[-2000:]
        yield r


def benchmark(quick: bool, cases: Sequence[str] | None = None, tokens: Sequence[int] | None = None,
              sweep: bool = False, ceil: dict | None = None, fmt: str = "fp4") -> Iterator[dict]:
    """Rows for ``jds.bench.kernels`` (``cases``: shape names) or this module's ``main``."""
    f = FORMATS[fmt]
    shapes = QUICK_SHAPES if quick else f.shapes
    e, top_k = (QUICK_EXPERTS, QUICK_TOP_K) if quick else (N_EXPERTS, f.top_k)
    ceil = ceil if ceil is not None else measure_ceilings(quick)
    key = jax.random.key(0)
    for name in [s for s in shapes if cases is None or s in cases]:
        k, n = shapes[name]
        key, sub = jax.random.split(key)
        try:
            wp, ws = f.experts(k, n, e, sub)  # one stack per shape (1 GiB packed for V4-Flash's w1)
        except Exception as ex:  # noqa: BLE001
            yield {"kernel": f"{fmt}_grouped", "case": name, "impl": "setup", "error": error_text(ex)}
            continue
        for t in (tokens or (QUICK_TOKENS if quick else TOKENS)):
            key, sub = jax.random.split(key)
            try:
                c = _case(f, name, k, n, t, top_k, wp, ws, sub, quick)
            except Exception as ex:  # noqa: BLE001
                yield {"kernel": f"{fmt}_grouped", "case": f"{name}_t{t}", "impl": "setup", "error": error_text(ex)}
                continue
            yield from run_case(c, ceil, quick, sweep)
            del c
            gc.collect()
        del wp, ws
        gc.collect()


def main(argv: list[str] | None = None, fmt: str | None = None) -> None:
    """``fmt``: the format of the ``kernels_fp4_grouped`` / ``kernels_fp8_grouped`` entry points (else
    ``--format``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if fmt is None:
        ap.add_argument("--format", default="fp4", choices=sorted(FORMATS))
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/kernels_<format>_grouped_"
                                                "<device>_<date>.json)")
    ap.add_argument("--shapes", nargs="+", default=None, choices=sorted({"w1", "w2"} | set(QUICK_SHAPES)))
    ap.add_argument("--tokens", nargs="+", type=int, default=None)
    ap.add_argument("--sweep", action="store_true", help="also time tile variants for M <= 512")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, CPU smoke run (interpret mode)")
    a = ap.parse_args(argv)
    fmt = fmt or a.format
    entry = f"jds.bench.kernels_{fmt}_grouped"
    if jax.default_backend() != "gpu" and not a.quick:
        raise SystemExit(f"{entry}: no GPU backend (jax.default_backend() == {jax.default_backend()!r}); use "
                         "--quick for a CPU smoke run in interpret mode")
    out = a.out or default_out(fmt)
    t0 = time.time()
    ceil = measure_ceilings(a.quick)
    cmd = " ".join([f"python -m {entry}"] + (sys.argv[1:] if argv is None else argv))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "command": cmd, **ceil, "nominal_hbm_bytes_per_s": NOMINAL_HBM,
            "complete": False}
    rows = []
    for r in benchmark(a.quick, a.shapes, a.tokens, a.sweep, ceil, fmt):
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "traceback"}), flush=True)
        write_json(out, {"meta": meta, "rows": rows})  # after every row: a cut-short run keeps them
    write_json(out, {"meta": {**meta, "complete": True, "wall_s": time.time() - t0}, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
