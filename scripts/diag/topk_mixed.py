"""The indexer's decode select (paged logits + top-k, the default ``topk_algorithm="auto"``) on full batches and on
mixed ones (one short request, ``--short`` tokens, among full-length ones), GPU timeline per kernel, and the top-k's
path per row. Issue 20 asks that a mixed batch be no slower than a full one.

    python3 scripts/diag/topk_mixed.py --shapes 16x32768 16x131072 64x32768 64x131072 --short 1000 3000 \
        [--variants default no_lengths] --out OUT/topk_mixed.json

Each row: device µs per call (``profile_span_us``), each kernel's median (``profile_kernel_us``: the logits
kernel, the top-k's fill and finish kernels), and the top-k paths of the batch's rows (``paths``: counts of
``topk_select.PATHS``, from ``select_unsorted`` on the same logits with the indexer's config).
"""

from __future__ import annotations

import argparse
import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jds.bench import kernels_sparse_indexer as ksi
from jds.bench.results import measured_row, save_rows
from jds.bench.timing import profiled_device_us
from jds.ops.records import IndexerRecord132
from pallas_kernels import sparse_indexer as si
from pallas_kernels.topk_select import PATHS, select_config_for, select_unsorted


# IndexerKernelConfig fields ("no_lengths": the kernel reads each row whole, as before the forty-fifth session)
VARIANTS = {"default": {}, "lengths": {"topk_lengths": True}, "no_lengths": {"topk_lengths": False}}


# one executable per config (and shape), shared by a shape's batches: a closure jitted per row compiled the whole
# select again for each row (about 110 s a row on a cold H100 process, the forty-fifth session)
@functools.lru_cache(maxsize=None)
def _logits_fn(config: si.IndexerKernelConfig, interpret: bool):
    """The paged logits."""
    return jax.jit(lambda *a: si.paged_logits(*a, entries_per_page=ksi.EPP, config=config, interpret=interpret))


@functools.lru_cache(maxsize=None)
def _paths_fn(b: int, c: int, hint: bool, interpret: bool):
    """The top-k's path per row with the indexer's config (``select_unsorted``'s fourth output)."""
    cfg = select_config_for(b, c)
    return jax.jit(lambda logits, nvis: select_unsorted(logits, ksi.K, config=cfg, interpret=interpret,
                                                        lengths=nvis if hint else None)[3])


def _measure(b: int, c: int, short: int | None, variant: str = "default") -> dict:
    config = si.IndexerKernelConfig(topk_algorithm="auto", **VARIANTS[variant])
    interpret = jax.default_backend() != "gpu"  # a CPU smoke run: interpret mode, no timeline
    bt, cache, q8, qs, iw, req = ksi._decode_inputs(jax.random.key(b * 7 + c), b, c)
    vis = np.full(b, c) if short is None else np.r_[short, np.full(b - 1, c)]
    nvis = jnp.asarray(vis, jnp.int32)
    # the jitted select itself (its static arguments passed along): one executable per config and shape
    r = profiled_device_us(si.indexer_topk_jit, q8, iw, cache, IndexerRecord132(ksi.EPP), bt, req, nvis, ksi.K,
                           "pallas", config, interpret, qs, calls=20, by_kernel=True)
    logits = _logits_fn(config, interpret)(q8, iw * qs, cache, bt, req, nvis)
    paths = np.asarray(_paths_fn(b, c, bool(config.topk_lengths), interpret)(logits, nvis))
    return {"topk": si.resolve_topk_algorithm(b, c), "paths": dict(collections.Counter(PATHS[p] for p in paths)),
            **r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["16x32768", "16x131072", "64x32768", "64x131072"])
    ap.add_argument("--short", type=int, nargs="+", default=[1000],
                    help="the mixed batches' short request (tokens), one batch each")
    ap.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS),
                    help="IndexerKernelConfig switches (no_lengths: the top-k without each token's n_visible as its "
                         "hint, the default before the forty-fifth session)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows: list[dict] = []
    for shape in a.shapes:
        b, c = (int(v) for v in shape.split("x"))
        for short in (None, *a.short):
            for v in a.variants:
                row = {"case": f"select_b{b}_c{c}" + ("" if short is None else f"_mixed{short}"), "variant": v}
                rows.append(measured_row(row, lambda: _measure(b, c, short, v)))
                save_rows(a.out, rows, complete=False)
    save_rows(a.out, rows, complete=True)


if __name__ == "__main__":
    main()
