"""Where V3.2's fused inserts lose to V4's: each kernel's variants beside a copy of the same bytes, on the GPU
timeline.

    python scripts/diag/insert_parts.py [--ts 1 1024 8192] [--variants default split] [--out F]

Why: at one token the two V3.2 kernels take several times V4's insert's device time, and at T >= 1024 they stay
below the share of the copy bandwidth that V4's reaches (docs/perf-log.md, twenty-second session).
Variants: ``split`` / ``unsplit``, each kernel's parts (MLA / indexer) in their own programs or not
(``split_phases``); ``btN``: the kv insert at N tokens per program (``block_tokens``); ``pairs_loads`` /
``pairs_registers``: its indexer key's rope partners loaded again or found in registers (``rope_pairs``);
``halves`` / ``one_dot``: its indexer key's Hadamard as two dots against H_64 or one against H_128
(``hadamard_halves``); ``w2`` / ``w8``: 2 / 8 warps per program; ``split_w8``: both (the fused q at 64
registers in pip triton's compile for sm_90a, against 96 by default, 80 with 8 warps and 90 split);
``q_rows256`` (``_w8``): the fused q at two tokens per program (half the programs); ``no_hadamard``, not the
model's numerics, says what the indexer's Hadamard costs. The copy row (``a + 1`` on float32, half the case's
bytes: read + written = the case's bytes; a uint8 array copies far slower) is the same-size ceiling: a small
call sits at its launch and latency floor, which the one large copy of ``measure_ceilings`` does not show.
"""

from __future__ import annotations

import argparse
import functools
import inspect

import jax
import jax.numpy as jnp

from jds.bench.kernels_fused_insert import _cases
from jds.bench.results import measured_row, save_rows
from jds.bench.timing import CAPTURED_OPTIONS, measure_ceilings, profiled_device_us

KERNELS = ("v32_kv_insert", "v32_fused_q", "v4_qnorm_rope_kv_insert")
VARIANTS = {"default": {}, "no_hadamard": {"hadamard": False}, "split": {"split_phases": True},
            "unsplit": {"split_phases": False}, "bt4": {"block_tokens": 4}, "bt8": {"block_tokens": 8},
            "bt16": {"block_tokens": 16},
            "bt32": {"block_tokens": 32}, "pairs_loads": {"rope_pairs": "loads"},
            "pairs_registers": {"rope_pairs": "registers"}, "bt32_loads": {"block_tokens": 32, "rope_pairs": "loads"},
            "w2": {"num_warps": 2}, "w8": {"num_warps": 8}, "split_w8": {"split_phases": True, "num_warps": 8},
            "q_rows256": {"rows_per_program": 256},
            "q_rows256_w8": {"rows_per_program": 256, "num_warps": 8}, "halves": {"hadamard_halves": True},
            "one_dot": {"hadamard_halves": False}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ts", nargs="+", type=int, default=[1, 1024, 8192])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ceil = measure_ceilings()
    rows = []
    for kernel, case, fn, static, args, cache_pos, out_pos, nbytes in _cases(False, tuple(a.ts)):
        if kernel not in KERNELS:
            continue
        for name in a.variants:
            kw = VARIANTS[name]
            if any(k not in inspect.signature(fn).parameters for k in kw):
                continue  # (V4's insert has no Hadamard and one part)
            if name.startswith("q_") and kernel != "v32_fused_q":
                continue  # the fused q's own tiles
            call = functools.partial(fn, **{**static, **kw}, implementation="pallas")

            def measure(call=call, args=args, cache_pos=cache_pos, out_pos=out_pos, nbytes=nbytes) -> dict:
                m = profiled_device_us(call, *[jnp.array(x, copy=True) for x in args],
                                       thread=tuple(zip(cache_pos, out_pos)))
                return dict(**m, bandwidth_frac=nbytes / (m["profile_span_us"] * 1e-6) / ceil["copy_bytes_per_s"])
            rows.append(measured_row(dict(kernel=kernel, case=case, variant=name, bytes=nbytes), measure))

        def copy(nbytes=nbytes) -> dict:
            x = jnp.zeros((max(1, nbytes // 8),), jnp.float32)
            m = profiled_device_us(jax.jit(lambda v: v + 1, compiler_options=CAPTURED_OPTIONS), x)
            return dict(**m, bandwidth_frac=nbytes / (m["profile_span_us"] * 1e-6) / ceil["copy_bytes_per_s"])
        rows.append(measured_row(dict(kernel=kernel, case=case, variant="same_size_copy", bytes=nbytes), copy))
        save_rows(a.out, rows, False, **ceil)
    save_rows(a.out, rows, True, **ceil)


if __name__ == "__main__":
    main()
