"""The indexer's top-k below ``AUTO_PALLAS_TOPK_ELEMS``: ``lax.top_k`` against the Pallas radix select and the
row-in-registers select (``rows``: ``pallas_kernels.topk_rows``; rows past its ``MAX_COLS`` record the error), as
the indexer calls them (``topk_from_logits``, set order, ``select_config_for``'s config, each row's visible length).

Why: "auto" runs ``lax.top_k`` under 512K logits, a size where the kernel was never measured; decode at 4K
context is 64 x ~4K logits a layer (``scripts/diag/step_kernels.py`` put V3.2's 8 lax.top_k calls at 224 µs of a
3.8-ms decode step on an H100).

    python3 scripts/diag/topk_small.py [--shapes 64x4096:2048 ...] [--rows-warps 4 8] [--rows-bits 1 2] --out F.json

A shape ``RxN:k`` is R rows with N visible logits each (random normal float32) in a row padded with -inf to the
indexer's tile (``sparse_indexer.TILE``), top ``k``. Each row: the GPU timeline's µs per call
(``profiled_device_us``) and whether the two sets are equal (every row, as sorted index sets). Native only.
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
from pallas_kernels.sparse_indexer import TILE, topk_from_logits
from pallas_kernels.topk_rows import topk_rows

SHAPES = ["1x4096:2048", "16x4096:2048", "64x4096:2048", "128x4096:2048", "64x8192:2048", "16x16384:2048",
          "64x16384:2048", "1x65536:2048", "64x1024:512", "64x2048:512", "64x4096:512", "128x1024:512"]


def _forms(nv: jax.Array, k: int, rows_warps: list[int], rows_bits: list[int]) -> dict:
    forms = {"lax": jax.jit(lambda lg: topk_from_logits(lg, k, algorithm="lax", order="set")),
             "pallas": jax.jit(lambda lg: topk_from_logits(lg, k, algorithm="pallas_radix", order="set",
                                                           splits=None, lengths=nv)),
             "rows": jax.jit(lambda lg: topk_from_logits(lg, k, algorithm="pallas_rows", order="set"))}
    for w in rows_warps:  # the row kernel at a fixed warp count (its set; "rows" is its default count)
        forms[f"rows_w{w}"] = jax.jit(lambda lg, w=w: topk_rows(lg, k, num_warps=w)[1])
    for b in rows_bits:  # the row kernel deciding b bits of the k-th key a round
        forms[f"rows_b{b}"] = jax.jit(lambda lg, b=b: topk_rows(lg, k, bits=b)[1])
    return forms


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--rows-warps", nargs="*", type=int, default=[], help="forms rows_wN: topk_rows at N warps")
    ap.add_argument("--rows-bits", nargs="*", type=int, default=[], help="forms rows_bN: topk_rows at bits=N")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "command": " ".join(["python3 scripts/diag/topk_small.py"] + sys.argv[1:]),
                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}, "rows": []}
    rng = np.random.default_rng(0)
    for shape in a.shapes:
        dims, k = shape.split(":")
        r, n = map(int, dims.split("x"))
        k = int(k)
        width = -(-n // TILE) * TILE + TILE  # the runner's page rounding leaves a tail past the longest row
        lg = np.full((r, width), -np.inf, np.float32)
        lg[:, :n] = rng.standard_normal((r, n), np.float32)
        lg, nv = jnp.asarray(lg), jnp.full((r,), n, jnp.int32)
        sets = {}
        for form, fn in _forms(nv, k, a.rows_warps, a.rows_bits).items():
            row = {"shape": shape, "rows": r, "visible": n, "width": width, "k": k, "form": form}
            try:
                idx = np.asarray(fn(lg))
                sets[form] = np.sort(idx, axis=1)
                row.update(profiled_device_us(fn, lg, calls=30, by_kernel=True))
            except Exception as e:  # noqa: BLE001 - a form that fails records why; the others still run
                row["error"] = f"{type(e).__name__}: {e}"[:1500]
            if form != "lax" and "lax" in sets and form in sets:
                row["same_sets"] = bool(np.array_equal(sets["lax"], sets[form]))
            res["rows"].append(row)
            print(json.dumps({kk: row.get(kk) for kk in ("shape", "form", "profile_span_us", "profile_kernels",
                                                          "same_sets", "error")}), flush=True)
        write_json(a.out, res)


if __name__ == "__main__":
    main()
