"""A Mosaic GPU kernel's SASS, read on a machine without a GPU: registers, spills and an opcode histogram from
the PTX that a native run dumped.

    # on the GPU: any run that compiles the kernel, with Mosaic GPU's dump switches
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR python3 ...  # DIR/kernel_N.ptx, .ptxas
    # here
    python scripts/diag/mosaic_sass.py DIR/kernel_0.ptx [--lines A:B] [--between LDS.128 QGMMA] [--out F.sass]

Why: Nsight Compute needs the GPU and a device call per question, and the CPU machine cannot build a Mosaic
kernel (its PTX comes out of the CUDA plugin's compile). The PTX of one native run, assembled here with the
ptxas that pip's ``triton`` bundles (``--ptxas`` for another), gives the SASS to count instructions per loop body
between device sessions. The 2026-12-04 FP4 dump assembled to the registers the native ptxas reported.

The plugin emits a newer PTX ISA than pip triton's ptxas reads, so the ``.version`` line is rewritten to
``--ptx-version`` (8.8: CUDA 12.8); a kernel that uses an instruction newer than that fails to assemble here.
``--lines A:B`` restricts the histogram to SASS listing lines A..B (a loop body found in the ``--out`` file);
``--between OP1 OP2`` to each stretch from an OP1 instruction to the next OP2 (e.g. one pipeline step).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

INSTR = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def opcodes(sass: str, lines: tuple[int, int] | None = None) -> list[tuple[int, str]]:
    """(listing line number, full opcode with modifiers) of every instruction in ``cuobjdump -sass`` text
    (optionally only lines ``lines`` = (first, last), 1-based inclusive); predicates are skipped."""
    out = []
    for i, line in enumerate(sass.splitlines(), 1):
        if lines and not lines[0] <= i <= lines[1]:
            continue
        m = INSTR.match(line)
        if m:
            out.append((i, m.group(1)))
    return out


def histogram(ops: list[tuple[int, str]]) -> collections.Counter:
    """Instructions per base opcode (the part before the first '.')."""
    return collections.Counter(op.split(".")[0] for _, op in ops)


def stretches(ops: list[tuple[int, str]], start: str, end: str) -> list[list[tuple[int, str]]]:
    """Each run of instructions from one whose opcode starts with ``start`` up to (excluding) the next whose
    opcode starts with ``end`` after it."""
    out, cur = [], None
    for item in ops:
        if cur is None:
            if item[1].startswith(start):
                cur = [item]
        elif item[1].startswith(end):
            out.append(cur)
            cur = None
        else:
            cur.append(item)
    return out


def _triton_ptxas() -> str:
    """The ptxas pip's triton uses (as ``fused_insert_common.compile_sm90_report`` finds it)."""
    from triton.backends.nvidia import compiler as nvc  # noqa: PLC0415 - only this tool needs pip triton

    return nvc.get_ptxas(90).path


def assemble(ptx: str, *, arch: str, ptx_version: str, ptxas: str) -> tuple[str, str]:
    """(ptxas -v log, cuobjdump -sass text) of the PTX text, its .version line set to ``ptx_version``."""
    ptx = re.sub(r"^\.version \d+\.\d+", f".version {ptx_version}", ptx, count=1, flags=re.M)
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", src, "-o", cubin], capture_output=True,
                             text=True, check=True).stderr
        cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return log, sass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ptx")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--ptx-version", default="8.8")
    ap.add_argument("--ptxas", default=None, help="default: the ptxas bundled with pip's triton")
    ap.add_argument("--lines", default=None, help="A:B, SASS listing lines (1-based, inclusive)")
    ap.add_argument("--between", nargs=2, default=None, metavar=("START", "END"))
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None, help="write the SASS listing here")
    a = ap.parse_args()
    with open(a.ptx) as f:
        log, sass = assemble(f.read(), arch=a.arch, ptx_version=a.ptx_version, ptxas=a.ptxas or _triton_ptxas())
    if a.out:
        with open(a.out, "w") as f:
            f.write(sass)
    print(" ".join(line.strip() for line in log.splitlines() if "registers" in line or "spill" in line))
    lines = tuple(int(v) for v in a.lines.split(":")) if a.lines else None
    ops = opcodes(sass, lines)
    print(f"{len(ops)} instructions" + (f" in lines {a.lines}" if lines else ""))
    for op, n in histogram(ops).most_common(a.top):
        print(f"{n:6d} {op}")
    if a.between:
        runs = stretches(ops, *a.between)
        print(f"{len(runs)} stretches {a.between[0]} .. {a.between[1]}: instructions "
              f"{[len(r) for r in runs]}")


if __name__ == "__main__":
    main()
