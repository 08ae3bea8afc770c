"""FP4 grouped (MoE) GEMM benchmark: the Pallas kernel (``pallas_kernels.fp4_grouped_gemm``) against the XLA path
(dequantise the expert stack to bf16 + ``ragged_dot_general``), in the same run as the copy-bandwidth ceiling.

    python -m jds.bench.kernels_fp4_grouped [--out benchmarks/results/kernels_fp4_grouped_<device>_<date>.json]
        [--shapes w1 w2] [--tokens 1 8 32 64 4096] [--sweep] [--quick]

Shapes: DeepSeek-V4-Flash routed experts, E = 256, y [M, N] = x [M, K] W[e]^T with W FP4 (uint8 [E, N, K/2] +
e8m0 bytes [E, N, K/32], as the checkpoint): w1 (= w3) K 4096 -> N 2048, w2 K 2048 -> N 4096. Tokens 1, 8, 32,
64 (decode) and 4096 (prefill), each routed to 6 distinct random experts: M = 6 tokens rows sorted by expert.

Per (shape, tokens), one row per impl (each in its own try/except: a failing variant records ``error``):
- ``pallas``: ``fp4_grouped_linear(implementation="pallas")`` with the default tiles (``block_t`` ...
  ``split_k`` recorded) and the default dequantisation (natively "lop3", PTX on 32-bit words);
  ``pallas[dequant=f16]`` the portable route (the default before 2026-12-01, later); ``--sweep`` adds ``pallas[...]`` rows for other tiles (tuning data).
- ``xla``: ``implementation="xla"`` (the current model path: the whole stack dequantised every call).
Fields: median_us (jds.bench.timing.time_fn), device_unrolled_us (calls under 200 us: timing.device_row),
bytes (packed weights + scales of the experts that have rows, + x and y in bf16: the unavoidable traffic),
l2_rotations (each timed call cycles this many routings of the same batch, so that the weights stream from
HBM and not the 50 MB L2; times and bytes are per routing, active_experts their mean),
hbm_frac (of the copy bandwidth measured in this run: a 1 GiB jnp add), hbm_frac_nominal (of 4.8 TB/s),
active_experts, and vs a float64 numpy reference on ``ref_rows`` rows (all rows up to 32, else 32 sampled;
nibbles decoded with a lookup table): max_abs_err, ref_max_abs, err_abssum_max (max |y - ref| / sum_k |x_k W_k|;
bf16 output, so about 2^-9 of |y| is its rounding).
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
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jds.bench.results import error_text, write_json
from jds.bench.timing import device_row, measure_ceilings, time_fn
from jds.ops import quant
from pallas_kernels import fp4_grouped_gemm as fp4g

SHAPES = {"w1": (4096, 2048), "w2": (2048, 4096)}  # (K, N)
TOKENS = (1, 8, 32, 64, 4096)
N_EXPERTS, TOP_K = 256, 6
QUICK_SHAPES = {"tiny": (512, 128)}
QUICK_TOKENS = (1, 4)
QUICK_EXPERTS, QUICK_TOP_K = 8, 2
NOMINAL_HBM = 4.8e12  # H200 HBM3e, bytes/s
REF_ROWS = 32
L2_BYTES = 50 * 2 ** 20
SWEEP = [dict(block_k=bk, split_k=s, block_n=bn) for bk in (128, 256, 512) for s in (1, 2, 4, 8) for bn in (64, 128)]
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def default_out() -> str:
    """benchmarks/results/kernels_fp4_grouped_<device>_<date>.json (device: "NVIDIA H200" -> "h200")."""
    kind = jax.devices()[0].device_kind.lower().replace("nvidia", "").strip().replace(" ", "_") or "cpu"
    return os.path.join("benchmarks", "results", f"kernels_fp4_grouped_{kind}_{datetime.date.today().isoformat()}.json")


def _experts(k: int, n: int, e: int, key) -> tuple[jax.Array, jax.Array]:
    """Random FP4 experts (uniform codes, jittered block scales), drawn on the device."""
    return jax.jit(functools.partial(quant.random_fp4_weight, shape=(e, n, k), std=k ** -0.5))(key)


def _routing(e: int, k: int, tokens: int, top_k: int, key) -> tuple[jax.Array, np.ndarray]:
    """(x [tokens * top_k, k] bf16, group sizes [e]): random top-k routing, distinct experts per token."""
    kx, kr = jax.random.split(key)
    choice = jax.vmap(lambda kk: jax.random.choice(kk, e, (top_k,), replace=False))(jax.random.split(kr, tokens))
    sizes = np.bincount(np.asarray(choice).reshape(-1), minlength=e).astype(np.int32)
    return jax.random.normal(kx, (tokens * top_k, k), jnp.float32).astype(jnp.bfloat16), sizes


def _case(shape: str, k: int, n: int, tokens: int, top_k: int, wp: jax.Array, ws: jax.Array, key,
          quick: bool = False) -> dict:
    """One routing over the experts ``wp`` / ``ws`` (x rows sorted by expert), plus more routings of the same
    batch for timing when one call's bytes would fit in L2 (``_rotations``; none in a quick run)."""
    e = wp.shape[0]
    keys = jax.random.split(key, 1 if quick else _rotations(e, k, n, tokens, top_k))
    routes = [_routing(e, k, tokens, top_k, kk) for kk in keys]
    x, sizes = routes[0]
    return {"shape": shape, "k": k, "n": n, "tokens": tokens, "top_k": top_k, "e": e, "x": x,
            "sizes": jnp.asarray(sizes), "sizes_np": sizes, "wp": wp, "ws": ws,
            "xs": [r[0] for r in routes], "sizes_all": [jnp.asarray(r[1]) for r in routes],
            "active_all": [int((r[1] > 0).sum()) for r in routes]}


def _rotations(e: int, k: int, n: int, tokens: int, top_k: int) -> int:
    """Routings cycled per timed call: enough that their weights (about min(E, tokens * top_k) experts each)
    exceed 3x the 50 MB L2, so repeated calls stream from HBM, not L2 (decode at 1 token: 6 experts, ~27 MB)."""
    per_call = min(e, tokens * top_k) * n * (k // 2 + k // 32)
    return int(min(16, max(1, -(-L2_BYTES * 3 // per_call))))


def _reference_rows(c: dict, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 (y, sum_k |x_k W_k|) of the given rows, one expert's dequantised weights at a time."""
    sizes = c["sizes_np"]
    ends = np.cumsum(sizes)
    experts = np.searchsorted(ends, rows, side="right")
    x = np.asarray(jnp.asarray(c["x"], jnp.float32), np.float64)[rows]
    y, ab = np.zeros((len(rows), c["n"])), np.zeros((len(rows), c["n"]))
    for ex in np.unique(experts):
        p, s = np.asarray(c["wp"][ex]), np.asarray(c["ws"][ex])
        w = np.empty((p.shape[0], 2 * p.shape[1]))
        w[:, 0::2], w[:, 1::2] = E2M1[p & 0xF], E2M1[p >> 4]
        w *= np.repeat(np.exp2(s.astype(np.float64) - 127), 32, axis=-1)
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


def run_case(c: dict, ceil: dict, quick: bool, sweep: bool) -> Iterator[dict]:
    k, n, e, m = c["k"], c["n"], c["e"], c["x"].shape[0]
    rot = len(c["xs"])
    active = float(np.mean(c["active_all"]))  # per call, over the timed routings
    nbytes = active * n * (k // 2 + k // 32) + 2.0 * m * k + 2.0 * m * n
    base = {"kernel": "fp4_grouped", "case": f"{c['shape']}_t{c['tokens']}", "shape": c["shape"], "k": k, "n": n,
            "experts": e, "top_k": c["top_k"], "tokens": c["tokens"], "m": m, "active_experts": active,
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
    variants = [("pallas", {})] + ([] if quick else [("pallas[dequant=f16]", dict(dequant="f16"))])
    if sweep and m <= 512:
        variants += [(f"pallas[{','.join(f'{a}={b}' for a, b in v.items())}]", v) for v in SWEEP
                     if (k // 512) % v["split_k"] == 0 and n % v["block_n"] == 0]
    variants.append(("xla", None))
    for name, tiles in variants:
        r = {**base, "impl": name}
        try:
            if tiles is None:
                f = jax.jit(functools.partial(fp4g.fp4_grouped_linear, implementation="xla"))
            else:
                f = jax.jit(functools.partial(fp4g.fp4_grouped_linear, implementation="pallas",
                                              interpret=True if quick else None, **tiles))
                bt, bn, bk, s = fp4g._pick_tiles(m, e, n, k, tiles.get("block_t"), tiles.get("block_n"),
                                                 tiles.get("block_k"), tiles.get("split_k"))
                r.update(block_t=bt, block_n=bn, block_k=bk, split_k=s)
            y = jax.block_until_ready(f(*args))
            if ref is not None:
                r.update(_accuracy(y, rows, ref, ab))
            del y
            # one timed call = ``rot`` calls on different routings (weights not L2-resident), time per call
            g = jax.jit(lambda xs, szs, wp, ws: [f(a, b, wp, ws) for a, b in zip(xs, szs)])
            targs = (c["xs"], c["sizes_all"], c["wp"], c["ws"])
            t = time_fn(g, *targs, iters=iters)
            r.update({key: v / rot if key.endswith("_us") else v for key, v in t.items()})
            if not quick:
                d = device_row(g, *targs, median_us=t["median_us"])
                r.update({key: v / rot for key, v in d.items()})
            _rates(r, nbytes, ceil)
        except Exception as ex:  # noqa: BLE001
            r["error"] = error_text(ex)
            r["traceback"] = traceback.format_exc()[-2000:]
        yield r


def benchmark(quick: bool, cases: Sequence[str] | None = None, tokens: Sequence[int] | None = None,
              sweep: bool = False, ceil: dict | None = None) -> Iterator[dict]:
    """Rows for ``jds.bench.kernels`` (``cases``: shape names) or this module's ``main``."""
    shapes = QUICK_SHAPES if quick else SHAPES
    e, top_k = (QUICK_EXPERTS, QUICK_TOP_K) if quick else (N_EXPERTS, TOP_K)
    ceil = ceil if ceil is not None else measure_ceilings(quick)
    key = jax.random.key(0)
    for name in [s for s in shapes if cases is None or s in cases]:
        k, n = shapes[name]
        key, sub = jax.random.split(key)
        try:
            wp, ws = _experts(k, n, e, sub)  # one stack per shape (1 GiB packed for V4-Flash's w1)
        except Exception as ex:  # noqa: BLE001
            yield {"kernel": "fp4_grouped", "case": name, "impl": "setup", "error": error_text(ex)}
            continue
        for t in (tokens or (QUICK_TOKENS if quick else TOKENS)):
            key, sub = jax.random.split(key)
            try:
                c = _case(name, k, n, t, top_k, wp, ws, sub, quick)
            except Exception as ex:  # noqa: BLE001
                yield {"kernel": "fp4_grouped", "case": f"{name}_t{t}", "impl": "setup", "error": error_text(ex)}
                continue
            yield from run_case(c, ceil, quick, sweep)
            del c
            gc.collect()
        del wp, ws
        gc.collect()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/kernels_fp4_grouped_"
                                                "<device>_<date>.json)")
    ap.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES) + sorted(QUICK_SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=None)
    ap.add_argument("--sweep", action="store_true", help="also time tile variants for M <= 512")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, CPU smoke run (interpret mode)")
    a = ap.parse_args(argv)
    if jax.default_backend() != "gpu" and not a.quick:
        raise SystemExit("kernels_fp4_grouped: no GPU backend (jax.default_backend() == "
                         f"{jax.default_backend()!r}); use --quick for a CPU smoke run in interpret mode")
    out = a.out or default_out()
    t0 = time.time()
    ceil = measure_ceilings(a.quick)
    cmd = " ".join(["python -m jds.bench.kernels_fp4_grouped"] + (sys.argv[1:] if argv is None else argv))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "command": cmd, **ceil, "nominal_hbm_bytes_per_s": NOMINAL_HBM,
            "complete": False}
    rows = []
    for r in benchmark(a.quick, a.shapes, a.tokens, a.sweep, ceil):
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "traceback"}), flush=True)
        write_json(out, {"meta": meta, "rows": rows})  # after every row: a cut-short run keeps them
    write_json(out, {"meta": {**meta, "complete": True, "wall_s": time.time() - t0}, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
