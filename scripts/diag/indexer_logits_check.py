"""The indexer logits kernel against float64 scores, row by row, on test_ops' indexer case and variants of it.

    python scripts/diag/indexer_logits_check.py [--out F]

Why: tests/test_ops.py::...[indexer_topk-pallas-native] failed on the H200 (2026-12-02, tenth session) while the
interpret-mode case passes. Interpret mode reads keys through XLA views (``key_source="views"``), the GPU through
paged TMA (``"paged"``), so this prints, for each variant (pages per request, tile-aligned or not, tokens per
CTA), every row's largest error against float64 and the columns where it sits.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from jds.ops.records import IndexerRecord132
from pallas_kernels.sparse_indexer import IndexerKernelConfig, paged_logits, quantize_q, xla_logits
from tests.test_ops import _indexer, _indexer_reference


def check(epp: int, nblk: int, seed: int, nvis: list[int], cfg: IndexerKernelConfig | None) -> dict:
    """test_ops' indexer case with these pages, seed and visible counts: each row's kernel and XLA logits against
    the float64 scores."""
    args, kw = _indexer(IndexerRecord132(epp), nblk, seed, tuple(nvis))
    qd, wf, cache, bt, req, nv = args
    ref = _indexer_reference(args, kw)[0]
    q8, w8 = quantize_q(qd, wf)
    got = np.asarray(jax.jit(lambda *a: paged_logits(*a, entries_per_page=epp, config=cfg))(
        q8, w8, cache, bt, req, nv), np.float64)
    xla = np.asarray(jax.jit(xla_logits, static_argnums=3)(qd, wf, cache, kw["fmt"], bt, req, nv), np.float64)
    rows = []
    for t in range(got.shape[0]):
        n = int(nv[t])
        d = np.abs(got[t, :n] - ref[t, :n])
        dx = np.abs(xla[t, :n] - ref[t, :n])
        bad = np.nonzero(d > 1e-5 * max(1e-30, np.abs(ref[t, :n]).max()))[0]
        rows.append(dict(t=t, nvis=n, max_err=float(d.max()) if n else 0.0,
                         xla_max_err=float(dx.max()) if n else 0.0, bad_cols=bad[:40].tolist(),
                         tail_finite=int(np.isfinite(got[t, n:]).sum())))
    return dict(rows=rows, n_bad_rows=sum(1 for r in rows if r["bad_cols"] or r["tail_finite"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    base_nvis = [3, 10, 20, 39, 40, 5, 30, 50, 69, 70]
    variants = [("test_ops", 32, 3, 8, base_nvis, None)]
    for seed in (1, 2, 3):
        variants.append((f"epp32_nblk3_s{seed}", 32, 3, seed, base_nvis, None))
    variants += [("epp32_nblk4 (whole tiles)", 32, 4, 8, [3, 10, 20, 39, 40, 5, 30, 50, 69, 90], None),
                 ("epp64_nblk2", 64, 2, 8, [3, 10, 20, 39, 40, 5, 30, 50, 69, 100], None),
                 ("test_ops g=1", 32, 3, 8, base_nvis, IndexerKernelConfig(queries_per_cta=1)),
                 ("test_ops nbuf=1", 32, 3, 8, base_nvis, IndexerKernelConfig(num_buffers=1)),
                 ("test_ops tpc=1", 32, 3, 8, base_nvis, IndexerKernelConfig(tiles_per_cta=1)),
                 ("test_ops gathered", 32, 3, 8, base_nvis, IndexerKernelConfig(key_source="gathered"))]
    out = {}
    for name, epp, nblk, seed, nvis, cfg in variants:
        try:
            r = check(epp, nblk, seed, nvis, cfg)
        except Exception as e:  # noqa: BLE001 - a diag: report and go on
            r = dict(error=f"{type(e).__name__}: {e}"[:500])
        out[name] = r
        bad = [x for x in r.get("rows", []) if x["bad_cols"] or x["tail_finite"]]
        print(name, "ERROR " + r["error"] if "error" in r else f"bad rows {len(bad)}", flush=True)
        for x in bad:
            print("   ", x, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
