"""The split top-k select on mixed batches (one 1000-token row among full ones) against full batches and lax.

    python scripts/diag/topk_split_mixed.py [--shapes 16x32768 16x65536 64x65536] [--out F]

Why: the split prefilter's finish kernel took a short row's whole -inf tail as its merged buffer when each
split fit its own buffer (16 x 32K and 16 x 64K mixed, 2026-12-01 eighth session: docs/perf-log.md);
this checks the fix on the GPU (pipelined medians, jds.bench.timing.time_fn) and that the sets equal lax's.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jds.bench.timing import time_fn
from pallas_kernels.topk_select import TopkSelectConfig, split_for, topk_select

K = 2048


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["16x32768", "16x65536", "64x65536"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lax_topk = jax.jit(jax.lax.top_k, static_argnums=1)
    rows = []
    for shape in a.shapes:
        b, c = (int(v) for v in shape.split("x"))
        sp = split_for(b, c)
        fns = {"lax": lax_topk,
               "set": jax.jit(functools.partial(topk_select, sort=False), static_argnums=1),
               f"set_split{sp}": jax.jit(functools.partial(topk_select, sort=False,
                                                           config=TopkSelectConfig(splits=sp)), static_argnums=1)}
        lg = jax.random.normal(jax.random.key(b * c), (b, c), jnp.float32)
        for tag, x in (("", lg), ("_mixed", lg.at[0, 1000:].set(-jnp.inf))):
            want = np.sort(np.asarray(lax_topk(x, K)[1]), axis=1)
            for name, f in fns.items():
                got = np.sort(np.asarray(f(x, K)[1]), axis=1)
                r = {"case": f"topk_b{b}_c{c}{tag}_{name}", "same_set_as_lax": bool((got == want).all()),
                     **time_fn(f, x, K, warmup=5, iters=30)}
                rows.append(r)
                print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"meta": {"device": jax.devices()[0].device_kind, "jax": jax.__version__}, "rows": rows}, fh)


if __name__ == "__main__":
    main()
