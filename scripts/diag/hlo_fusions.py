"""What XLA put into named kernels: the instructions and fused computations of an ``--xla_dump_to`` dump.

A step's profile (scripts/diag/step_kernels.py) names kernels by their HLO instruction (``loop_reduce_fusion_5``)
and the source line of its first op; what the fusion computes is only in the optimized HLO. This prints, for each
name, its instruction line from every ``*after_optimizations.txt`` module of the dump, its users and the
computation it calls (nested fusions' computations too, up to ``--depth``). ``--from-step-kernels F --source
REGEX``: the names of F's top kernels whose source matches REGEX (XLA's own kernels only: not Pallas / Mosaic
ones).

    python3 scripts/diag/hlo_fusions.py DUMP --from-step-kernels sk.json --source 'v4.py:91' [--names N ...]

A runner's executables take their dump directory from ``RunnerConfig.dump_dir`` (a per-executable option that
``XLA_FLAGS=--xla_dump_to`` does not reach): ``step_kernels.py --fusions REGEX`` keeps this tool's text for its
top kernels whose source matches REGEX in its output (``fusions``), from the dump it reads anyway.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def computations(text: str) -> dict[str, list[str]]:
    """Each computation's lines (header to closing brace) by name."""
    out: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if cur is None and m and not line.startswith(" "):
            cur = out.setdefault(m.group(1), [])
        if cur is not None:
            cur.append(line)
            if line.strip() == "}":
                cur = None
    return out


def _norm(name: str) -> str:
    """An instruction's name as a kernel carries it on the timeline (``fusion.2`` / ``fusion-2`` -> ``fusion_2``)."""
    return re.sub(r"[.\-]", "_", name)


def describe(text: str, names: list[str], depth: int, width: int) -> list[str]:
    comps = computations(text)
    wanted = {_norm(n) for n in names}
    lines: list[str] = []
    for comp_lines in comps.values():
        for line in comp_lines:
            m = _INSTR.match(line)
            if not m or _norm(m.group(1)) not in wanted:
                continue
            lines.append(f"== {m.group(1)}: {line.strip()[:width]}")
            use = re.compile(rf"[(,]\s*%{re.escape(m.group(1))}[,)]")
            lines += [f"  used by: {u.strip()[:200]}" for u in comp_lines if use.search(u.split("=", 1)[-1])]
            todo = [(c, 1) for c in _CALLS.findall(line)]
            while todo:
                c, d = todo.pop(0)
                for body in comps.get(c, []):
                    lines.append("    " * d + body.strip()[:width])
                    if d < depth:
                        todo += [(cc, d + 1) for cc in _CALLS.findall(body)]
    return lines


def describe_dump(dump: str, names: list[str], depth: int = 2, width: int = 400, module: str = "") -> list[str]:
    """``describe`` over every after-optimisation module of ``dump`` whose file name contains ``module``."""
    out: list[str] = []
    for path in sorted(glob.glob(os.path.join(dump, "*after_optimizations.txt"))):
        if module in os.path.basename(path):
            found = describe(open(path).read(), names, depth, width)
            out += [f"# {os.path.basename(path)}"] + found if found else []
    return out


def names_from_step_kernels(path: str, source: str) -> list[str]:
    d = json.load(open(path))
    rx = re.compile(source)
    out = []
    for shape in d.get("shapes", {}).values():
        for k in shape.get("top_kernels", []):
            if rx.search(k.get("source", "")) and "mosaic" not in k["kernel"] and k["kernel"] not in out:
                out.append(k["kernel"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dump")
    ap.add_argument("--names", nargs="*", default=[])
    ap.add_argument("--from-step-kernels", default=None)
    ap.add_argument("--source", default=".")
    ap.add_argument("--module", default="", help="only modules whose file name contains this")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--width", type=int, default=400)
    a = ap.parse_args(argv)
    names = list(a.names)
    if a.from_step_kernels:
        names += names_from_step_kernels(a.from_step_kernels, a.source)
    print("names:", " ".join(names))
    print("\n".join(describe_dump(a.dump, names, a.depth, a.width, a.module)))


if __name__ == "__main__":
    main()
