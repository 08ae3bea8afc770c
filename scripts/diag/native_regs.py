"""Registers per thread of the fused inserts' kernels as the GPU build compiles them (no run, no profiler).

    python scripts/diag/native_regs.py [--ts 8192] [--variants default pairs_loads ...]

Why: the CPU check (``fused_insert_common.compile_sm90_report``) compiles the Triton IR with pip's Triton, whose
register allocation can differ from the Triton bundled in the CUDA plugin: the kv insert with its rope pairs
found in registers compiled to 96 registers on the CPU and ran with 185 on the H200 (Nsight Compute). Here XLA
compiles each variant with its own Triton and dumps the module's PTX (``--xla_dump_to``, set before jax starts),
and ptxas -v reports each kernel's registers, spills and stack frame.
"""

from __future__ import annotations

import argparse
import functools
import glob
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="native_regs_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}").strip()

import jax  # noqa: E402 - after XLA_FLAGS
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
from insert_parts import VARIANTS  # noqa: E402

from jds.bench.kernels_fused_insert import _cases  # noqa: E402


def _ptxas() -> str:
    """The CUDA plugin's own ptxas first (its PTX may carry an ISA version older ptxas builds reject), then PATH,
    then pip triton's."""
    import site
    roots = [os.path.join(os.path.dirname(jax.__file__), "..")] + site.getsitepackages()
    hits = sorted({os.path.realpath(h) for r in roots for h in glob.glob(os.path.join(r, "nvidia", "**", "bin", "ptxas"),
                                                                      recursive=True)})
    if hits:
        return hits[-1]
    if shutil.which("ptxas"):
        return shutil.which("ptxas")
    from triton.backends.nvidia import compiler as nvc
    return nvc.get_ptxas(90).path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ts", nargs="+", type=int, default=[8192])
    ap.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS))
    a = ap.parse_args()
    ptxas = _ptxas()
    print(f"ptxas: {ptxas}; dump: {DUMP}", flush=True)
    for kernel, case, fn, static, args, *_ in _cases(False, tuple(a.ts)):
        if kernel not in ("v32_kv_insert", "v32_fused_q"):
            continue
        for name in a.variants:
            kw = VARIANTS[name]
            if any(k not in inspect.signature(fn).parameters for k in kw):
                continue
            before = set(glob.glob(f"{DUMP}/*.ptx"))
            call = functools.partial(fn, **{**static, **kw}, implementation="pallas")
            jax.jit(call).lower(*[jnp.asarray(x) for x in args]).compile()
            new = sorted(set(glob.glob(f"{DUMP}/*.ptx")) - before)
            if not new:
                print(f"{kernel} {case[:8]} {name}: no PTX dumped ({len(os.listdir(DUMP))} files in {DUMP})", flush=True)
            for ptx in new:
                res = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.devnull],
                                     capture_output=True, text=True)
                log = res.stderr
                if res.returncode:
                    print(f"{kernel} {case[:8]} {name}: ptxas ({ptxas}) failed on {os.path.basename(ptx)}: "
                          f"{log.strip()[:300]}", flush=True)
                for fn_name, body in re.findall(r"Compiling entry function '(\w+)'.*?\n(.*?)(?=ptxas info\s+: Compiling|\Z)",
                                                log, re.S):
                    regs = re.search(r"Used (\d+) registers", body)
                    stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", body)
                    print(f"{kernel} {case[:8]} {name}: {fn_name} registers {regs.group(1) if regs else '?'} "
                          f"stack {stack.group(1) if stack else '?'} spills {stack.group(2) if stack else '?'}",
                          flush=True)


if __name__ == "__main__":
    main()
