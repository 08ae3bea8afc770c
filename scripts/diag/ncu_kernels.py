"""One profiled call of a jds GEMM kernel, for Nsight Compute (`ncu --profile-from-start off`).

    ncu --clock-control none --profile-from-start off --set full -o OUT/fp4_t8 \
        python3 scripts/diag/ncu_kernels.py fp4 --shape w1 --tokens 8 [--tiles '{"dequant": "bf16"}']
    ncu --clock-control none --profile-from-start off --set full -o OUT/fp8_m64 \
        python3 scripts/diag/ncu_kernels.py fp8 --shape q_b --m 64
    ncu ... python3 scripts/diag/ncu_kernels.py fp8g --shape w1 --tokens 8      # the grouped FP8 expert GEMM
    ncu ... python3 scripts/diag/ncu_kernels.py topk --m 64 --cols 65536 --tiles '{"splits": 2}'  # the radix select
    ncu ... python3 scripts/diag/ncu_kernels.py mqa --shape v32 --m 64 [--tiles '{"num_splits": 2}']  # sparse MQA decode
    ncu ... python3 scripts/diag/ncu_kernels.py insert --shape v32_fused_q --m 8192  # a fused insert

The call is compiled and run a few times first; only the last call runs between cuProfilerStart and
cuProfilerStop, so the report holds that call's kernels (the Pallas kernel and the wrapper's XLA ops).

    ncu --clock-control none --profile-from-start off --csv --page raw \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python3 scripts/diag/ncu_kernels.py fp8sweep --cases wo:1 mlp:64 --variants '[{}, {"split_k": 2}]' \
        --order OUT/order.json > OUT/sweep.csv

``fp8sweep`` (``fp4sweep`` / ``fp8gsweep``: the grouped expert GEMMs, cases shape:tokens): every (case,
variant) call of the GEMM profiled once in one process, each preceded by a
marker kernel (``sin(v) * 3``: XLA's ``loop_multiply_fusion``), so the report's kernels split into calls; ``--order`` names them in order.
Kernel durations from the profiler are exact where the pipelined timings of these ~50 us calls are not.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

_SWAP_ROWS_OUT_DEFAULT: int | None = None  # fp8_gemm.SWAP_ROWS_OUT_UP_TO as imported (``_fp8``)


def _grouped(fmt: str, shape: str, tokens: int, tiles: dict):
    """A grouped expert GEMM call ("fp4" / "fp8"), 256 experts, the benchmark's format (top-k routing).
    ``tiles`` {"x_fp8": true} (fp4): x given as act_quant's e4m3 + scales (the kernel's "fp8" route), quantised
    outside the profiled call, as the V4 MoE's expert input is quantised before it anyway."""
    from jds.bench import kernels_grouped as b
    from jds.ops import quant
    f = b.FORMATS[fmt]
    k, n = f.shapes[shape]
    w, ws = f.experts(k, n, 256, jax.random.key(0))
    x, sizes = b._routing(256, k, tokens, f.top_k, jax.random.key(1))
    tiles = dict(tiles)
    if tiles.pop("x_fp8", False):
        xq, sx = quant.act_quant(x, 128, "ue8m0")
        call = functools.partial(f.op, implementation="pallas", **tiles)
        return jax.jit(lambda xq, sz, w, ws, sx: call(xq, sz, w, ws, x_scale=sx)), (xq, jnp.asarray(sizes), w, ws, sx)
    return jax.jit(functools.partial(f.op, implementation="pallas", **tiles)), (x, jnp.asarray(sizes), w, ws)


def _fp8(shape: str, m: int, tiles: dict):
    from jds.bench import kernels_fp8_gemm as b
    from pallas_kernels import fp8_gemm
    k, n = b.SHAPES[shape]
    kw, kx = jax.random.split(jax.random.key(0))
    wq = (jax.random.normal(kw, (n, k), jnp.float32) * 0.5).astype(jnp.float8_e4m3fn)
    ws = jnp.full((n // 128, k // 128), 2.0 ** -7, jnp.float32)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    global _SWAP_ROWS_OUT_DEFAULT
    if _SWAP_ROWS_OUT_DEFAULT is None:  # the module's own value, read before any variant changes it
        _SWAP_ROWS_OUT_DEFAULT = fp8_gemm.SWAP_ROWS_OUT_UP_TO
    tiles = dict(tiles)
    # swap_ab's direct row store up to this many rows (the module's threshold), set for every case so that one
    # variant's value does not carry over to the next in the same process
    fp8_gemm.SWAP_ROWS_OUT_UP_TO = tiles.pop("rows_out_up_to", _SWAP_ROWS_OUT_DEFAULT)
    f = jax.jit(functools.partial(fp8_gemm.fp8_linear, implementation="pallas", **tiles))
    return f, (x, wq, ws)


def _topk(rows: int, cols: int, tiles: dict):
    """The indexer's Pallas radix select over [rows, cols] random normal fp32 logits (the benchmark's), k = 2048,
    without its sort of the winners (the indexer's default order); ``tiles``: TopkSelectConfig fields."""
    from pallas_kernels.topk_select import TopkSelectConfig, topk_select
    x = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32)
    f = jax.jit(lambda v: topk_select(v, 2048, sort=False, config=TopkSelectConfig(**tiles))[1])
    return f, (x,)


def _mqa(arch: str, tokens: int, tiles: dict):
    """The sparse MQA decode call of ``bench_kernels`` (``v32_decode_<tokens>`` / ``v4_decode_<tokens>``: 2048 /
    128 + 512 candidates per token over a 4K context each); ``tiles``: keyword arguments of ``sparse_mqa``."""
    from jds.bench import kernels_sparse_mqa as b
    from pallas_kernels import sparse_mqa
    c = b.case(f"{arch}_decode_{tokens}")
    f = jax.jit(lambda q, caches, slots, sink: sparse_mqa.sparse_mqa(
        q, caches, c["fmts"], slots, scale=c["scale"], v_dim=c["v_dim"], sink=sink, implementation="pallas", **tiles))
    return f, (c["q"], c["caches"], c["slots"], c["sink"])


def _insert(kernel: str, tokens: int, tiles: dict):
    """A fused insert call of ``bench_kernels`` (``v32_kv_insert`` / ``v32_fused_q`` / ``v4_qnorm_rope_kv_insert``
    at ``tokens`` tokens); ``tiles``: keyword arguments of the kernel (e.g. ``{"hadamard": false}``)."""
    from jds.bench.kernels_fused_insert import _cases
    for name, _, fn, static, args, _, _, _ in _cases(False, (tokens,)):
        if name == kernel:
            f = jax.jit(functools.partial(fn, **{**static, **tiles}, implementation="pallas"))
            return (lambda *a: f(*a)[0]), args
    raise ValueError(f"unknown insert kernel {kernel!r}")


def _stream(shape: str, tiles: dict):
    """The FP8 GEMM's weight stream alone (``tma_stream.stream_call``: the GEMM's CTA grid and TMA ring, no MMA)
    for the weight ``shape`` of ``kernels_fp8_gemm``; ``tiles``: layout ("rows_ws+x" = the GEMM's warp-specialised
    pipeline with its 64-row activation tile, "rows", "tiles", ...), block_n (192), split_k (1), stages (4)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tma_stream import stream_call

    from jds.bench import kernels_fp8_gemm as b
    k, n = b.SHAPES[shape]
    t = {"layout": "rows_ws+x", "block_n": 192, "split_k": 1, "stages": 4, **tiles}
    bn = t["block_n"]
    w = jnp.zeros((n, k), jnp.float8_e4m3fn)
    if t["layout"] == "tiles":
        w = jnp.zeros((n // bn, k // 128, bn, 128), jnp.float8_e4m3fn)
    x = jnp.zeros((64, k), jnp.float8_e4m3fn)
    return jax.jit(stream_call(t["layout"], n, k, bn, t["split_k"], t["stages"], False)), (w, x)


def _ceiling(kind: str, mib: int):
    """The same run's DRAM ceilings beside the GEMM rows (a sweep's cases copy:MiB, read:MiB): XLA's elementwise
    copy (y = 2 a) of a bfloat16 array of ``mib`` MiB, or its sum (a read of it), on random data."""
    a = jax.random.normal(jax.random.key(1), (mib * 2 ** 19,), jnp.float32).astype(jnp.bfloat16)
    if kind == "copy":
        return jax.jit(lambda v: v * 2), (a,)
    return jax.jit(lambda v: jnp.sum(v.reshape(-1, 4096).astype(jnp.float32), axis=1)), (a,)


def _sweep(a: argparse.Namespace) -> None:
    """fp8sweep: cases shape:rows of the FP8 GEMM (and copy:MiB / read:MiB, ``_ceiling``); fp4sweep / fp8gsweep:
    shape:tokens of the grouped GEMMs; streamsweep: shape:0, the FP8 GEMM's weight stream alone (``_stream``)."""
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in a.cases]
    variants = json.loads(a.variants)
    marker = jax.jit(lambda v: jnp.sin(v) * 3.0)
    mv = jnp.ones((1000,), jnp.float32)
    calls = []
    for shape, m in cases:
        for v in variants:
            name = {"fp8sweep": f"{shape}_m{m}", "streamsweep": f"{shape}_stream"}.get(a.kernel, f"{shape}_t{m}")
            try:
                if shape in ("copy", "read"):
                    f, args = _ceiling(shape, m)
                elif a.kernel == "streamsweep":
                    f, args = _stream(shape, v)
                elif a.kernel == "fp8sweep":
                    f, args = _fp8(shape, m, v)
                else:
                    f, args = _grouped("fp4" if a.kernel == "fp4sweep" else "fp8", shape, m, v)
                for _ in range(3):
                    jax.block_until_ready(f(*args))
                calls.append(({"case": name, **v}, f, args))
            except Exception as e:  # noqa: BLE001 - a diag: record and go on
                print(json.dumps({"case": name, **v, "error": f"{type(e).__name__}: {str(e)[:200]}"}))
    jax.block_until_ready(marker(mv))
    # the order goes out first: a process that dies under the profiler keeps the calls it profiled
    with open(a.order, "w") as fh:
        json.dump([c for c, _, _ in calls], fh)
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for _, f, args in calls:
        jax.block_until_ready(marker(mv))
        jax.block_until_ready(f(*args))
    cuda.cuProfilerStop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=("fp4", "fp8", "fp8g", "topk", "mqa", "insert", "fp8sweep", "fp4sweep",
                                       "fp8gsweep", "streamsweep"))
    ap.add_argument("--shape", default=None, help="GEMM shape (default wo / w1); mqa: v32 or v4 (default v32); "
                                                  "insert: the kernel (v32_kv_insert, v32_fused_q, ...)")
    ap.add_argument("--cases", nargs="+", default=None,
                    help="fp8sweep: shape:rows (default wo and mlp at 1, 64, 128); fp4sweep / fp8gsweep: "
                         "shape:tokens (default w1 and w2 at 1, 8, 64)")
    ap.add_argument("--variants", default="[{}]", help="fp8sweep: JSON list of tile dicts")
    ap.add_argument("--order", default="/tmp/fp8sweep_order.json", help="fp8sweep: where the call order goes")
    ap.add_argument("--tokens", type=int, default=8, help="fp4 / fp8g: tokens (x 6 / 8 routed rows each)")
    ap.add_argument("--m", type=int, default=64, help="fp8, topk: rows; mqa: decode tokens; insert: tokens")
    ap.add_argument("--cols", type=int, default=65536, help="topk: logits per row")
    ap.add_argument("--tiles", default="{}", help="JSON dict of keyword arguments for the kernel")
    a = ap.parse_args()
    if a.kernel.endswith("sweep"):
        if a.cases is None:
            a.cases = ([f"{s}:{m}" for s in ("wo", "mlp") for m in (1, 64, 128)] if a.kernel == "fp8sweep"
                       else ["q_b:0", "mlp:0"] if a.kernel == "streamsweep"
                       else [f"{s}:{t}" for s in ("w1", "w2") for t in (1, 8, 64)])
        return _sweep(a)
    tiles = json.loads(a.tiles)
    gemm = a.shape or ("w1" if a.kernel in ("fp4", "fp8g") else "wo")
    make = {"fp4": lambda: _grouped("fp4", gemm, a.tokens, tiles),
            "fp8g": lambda: _grouped("fp8", gemm, a.tokens, tiles),
            "fp8": lambda: _fp8(gemm, a.m, tiles),
            "topk": lambda: _topk(a.m, a.cols, tiles),
            "mqa": lambda: _mqa(a.shape or "v32", a.m, tiles),
            "insert": lambda: _insert(a.shape or "v32_kv_insert", a.m, tiles)}
    f, args = make[a.kernel]()
    for _ in range(3):
        jax.block_until_ready(f(*args))
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    y = jax.block_until_ready(f(*args))
    cuda.cuProfilerStop()
    print(json.dumps({"kernel": a.kernel, "shape": a.shape, "out": list(y.shape),
                      "finite": bool(np.isfinite(np.asarray(y, np.float32)).all())}))


if __name__ == "__main__":
    main()
