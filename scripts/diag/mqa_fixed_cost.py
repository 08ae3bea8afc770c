"""The sparse MQA kernel's per-CTA fixed cost and per-block cost, from its device time at several list lengths.

    python scripts/diag/mqa_fixed_cost.py [--out F] [--quick]

Why: at V4 decode 64 the Pallas kernel takes 28.2 µs for 5 blocks per CTA and 38.9 µs for 10 (one split), so a
large part of each CTA's time does not scale with its blocks (docs/perf-log.md, twenty-first session). This
times the kernel alone (``profile_kernel_us`` of the Mosaic kernel, GPU timeline) at one split for lists of
n blocks, each case's lists the benchmark's decode-64 lists cut to their first n blocks, and fits
time = fixed + n * per_block by least squares per arch.
"""

from __future__ import annotations

import argparse
import functools

import jax
import numpy as np

from jds.bench import kernels_sparse_mqa as b
from jds.bench.results import measured_row, run_meta, write_json
from jds.bench.timing import CAPTURED_OPTIONS, profiled_device_us
from pallas_kernels import sparse_mqa

# arch -> total blocks per token (one split); V4 keeps its 2-block window list and cuts the compressed one
BLOCKS = {"v32": (2, 8, 32), "v4": (3, 6, 10)}


def _cut(c: dict, arch: str, n: int) -> list:
    bk = sparse_mqa.BLOCK_K
    if arch == "v32":
        return [c["slots"][0][:, : n * bk]]
    w, comp = c["slots"]
    return [w, comp[:, : (n - w.shape[1] // bk) * bk]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="small shapes: a CPU check of the script (no times)")
    a = ap.parse_args()
    rows, fits = [], {}
    for arch, ns in BLOCKS.items():
        c = b.case(f"{arch}_decode_{2 if a.quick else 64}", a.quick)
        call = functools.partial(sparse_mqa.sparse_mqa, formats=c["fmts"], scale=c["scale"], v_dim=c["v_dim"],
                                 num_splits=1)
        pts = []
        for n in ns:
            slots = _cut(c, arch, n)
            if any(s.shape[1] == 0 for s in slots) or sum(s.shape[1] for s in slots) != n * sparse_mqa.BLOCK_K:
                continue  # (--quick: the small lists are shorter)
            f = jax.jit(lambda q, cs, ss, sk: call(q, cs, slots=ss, sink=sk), compiler_options=CAPTURED_OPTIONS)
            ref = jax.jit(lambda q, cs, ss, sk: call(q, cs, slots=ss, sink=sk, implementation="xla"))

            def measure(f=f, ref=ref, slots=slots) -> dict:
                got, want = (np.asarray(g(c["q"], c["caches"], slots, c["sink"])) for g in (f, ref))
                m = profiled_device_us(f, c["q"], c["caches"], slots, c["sink"], by_kernel=True)
                kern = sum(v for k, v in m.get("profile_kernel_us", {}).items() if "mosaic" in k) or None
                return dict(max_abs_err=float(np.abs(got - want).max()), ref_max=float(np.abs(want).max()),
                            kernel_us=kern, **m)

            row = measured_row({"arch": arch, "blocks_per_cta": n, "ctas": int(c["q"].shape[0]) * (
                c["heads"] // sparse_mqa.HEAD_TILE)}, measure)
            rows.append(row)
            if row.get("kernel_us"):
                pts.append((n, row["kernel_us"]))
        if len(pts) >= 2:
            x, y = np.array(pts, float).T
            per_block, fixed = np.polyfit(x, y, 1)
            fits[arch] = {"fixed_us": float(fixed), "per_block_us": float(per_block),
                          "max_residual_us": float(np.abs(np.polyval([per_block, fixed], x) - y).max())}
            print(arch, fits[arch], flush=True)
    if a.out:
        write_json(a.out, {"meta": run_meta(), "fits": fits, "rows": rows})


if __name__ == "__main__":
    main()
