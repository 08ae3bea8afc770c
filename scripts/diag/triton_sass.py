"""A Pallas Triton kernel's SASS for sm_90a on a machine without a GPU: registers, spills, instruction count and,
per loop, its body's length and opcode mix.

    python scripts/diag/triton_sass.py topk [--rows 64] [--cols 65536] [--tiles '{"range_margin": 1}'] [--lengths]
    python scripts/diag/triton_sass.py insert [--kernel v32_kv_insert] [--t 8192] [--tiles '{"num_warps": 8}']
    ... [--out DIR]   # each kernel's listing as DIR/NAME.sass
    ... [--json FILE]  # the counts appended to a JSON list (a record per run, with its arguments)

Why: the Triton kernels (top-k, fused inserts) are bound by instruction issue and its latency, and a change's
instruction count is the first thing to know about it. pip's triton compiles the same Triton IR for sm_90a here
(its ptxas, then its nvdisasm); the CUDA plugin's Triton on the H200 differs in version, so counts are a guide for
comparing variants, not the native numbers. Loops are the spans of backward branches (``BRA`` to an earlier
label), innermost first as nvdisasm lays them out; one that a compiler rotates may show up split.
``--tiles`` for ``topk`` are ``TopkSelectConfig`` fields over the indexer's config (``select_config_for``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ncu_sass_regions import opcode  # noqa: E402  (an instruction's base opcode, its predicate skipped)

INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


MEMORY_SYNC = ("BAR", "SHFL", "LDS", "STS", "LDG", "STG")  # each loop's counts of these, whatever their rank


def loops(sass: str) -> tuple[int, list[dict]]:
    """(instructions, loops): each loop {first, last (instruction indices), body, opcodes (top 10), memory_sync
    (``MEMORY_SYNC``'s counts)}."""
    ins, labels = [], {}
    for line in sass.splitlines():
        m = LABEL.match(line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = INSTR.match(line)
        if m:
            ins.append(m.group(2))
    out = []
    for i, text in enumerate(ins):
        m = BRANCH.search(text)
        if m and labels.get(m.group(1), len(ins)) < i:
            j = labels[m.group(1)]
            ops = collections.Counter(opcode(x) for x in ins[j:i + 1])
            out.append({"first": j, "last": i, "body": i + 1 - j, "opcodes": dict(ops.most_common(10)),
                        "memory_sync": {op: ops[op] for op in MEMORY_SYNC}})
    return len(ins), out


def _topk(a: argparse.Namespace):
    import jax
    import jax.numpy as jnp
    from pallas_kernels.topk_select import select_config_for, select_unsorted
    cfg = dataclasses.replace(select_config_for(a.rows, a.cols), **json.loads(a.tiles))
    x = jax.ShapeDtypeStruct((a.rows, a.cols), jnp.float32)
    if a.lengths:  # the indexer's lengths hint (IndexerKernelConfig.topk_lengths)
        return (lambda x, ln: select_unsorted(x, a.k, interpret=False, config=cfg, lengths=ln),
                [x, jax.ShapeDtypeStruct((a.rows,), jnp.int32)])
    return functools.partial(select_unsorted, k=a.k, interpret=False, config=cfg), [x]


def _insert(a: argparse.Namespace):
    import jax
    from jds.bench.kernels_fused_insert import _cases
    for kernel, _, fn, static, args, *_ in _cases(False, (a.t,)):
        if kernel == a.kernel:
            return (functools.partial(fn, **{**static, **json.loads(a.tiles)}, implementation="pallas",
                                      interpret=False),
                    [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args])
    raise ValueError(f"kernel must be one of the fused-insert benchmark's, got {a.kernel!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["topk", "insert"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=65536)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--tiles", default="{}", help="topk: TopkSelectConfig fields (JSON) over select_config_for's; "
                    "insert: the kernel's keyword arguments over the benchmark's (num_warps, split_phases, ...)")
    ap.add_argument("--lengths", action="store_true", help="topk: with the rows' lengths hint, as the indexer runs it")
    ap.add_argument("--kernel", default="v32_kv_insert")
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--out", default=None, help="a folder for each kernel's listing")
    ap.add_argument("--json", default=None, help="a JSON list file to append this run's counts to")
    a = ap.parse_args()
    import triton
    from pallas_kernels import fused_insert_common as C
    fn, args = (_topk if a.what == "topk" else _insert)(a)
    record = {"args": {k: v for k, v in vars(a).items() if k not in ("out", "json")},
              "triton": triton.__version__, "target": "sm_90a", "kernels": []}
    for k in C.compile_sm90_report(fn, *args, sass=True):
        n, found = loops(k["sass"])
        whole = collections.Counter(opcode(m.group(2)) for m in map(INSTR.match, k["sass"].splitlines()) if m)
        record["kernels"].append({**{f: k[f] for f in ("name", "num_warps", "registers", "spill_bytes",
                                                       "layout_conversions")}, "instructions": n,
                                  "memory_sync": {op: whole[op] for op in MEMORY_SYNC}, "loops": found})
        print(f"{k['name']}: {k['registers']} registers, {k['spill_bytes']} bytes of spill, {n} instructions, "
              f"{k['layout_conversions']} layout conversions")
        for lp in found:
            print(f"  loop {lp['first']}..{lp['last']}: {lp['body']} instructions {lp['opcodes']}")
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, f"{k['name']}.sass"), "w") as f:
                f.write(k["sass"])
    if a.json:
        runs = json.loads(Path(a.json).read_text()) if Path(a.json).exists() else []
        Path(a.json).write_text("[\n" + ",\n".join(json.dumps(r) for r in runs + [record]) + "\n]\n")  # a line a run


if __name__ == "__main__":
    main()
