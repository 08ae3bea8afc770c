"""The dense FP8 GEMM's tile variants on the GPU timeline: per (case, variant) the Pallas kernel's µs and the
whole call's, per GEMM of ``--rotations`` weight copies a timed call (q_b's 37.7 MB fit the 50 MB L2; two copies
or more stream from HBM), and the largest difference from the XLA form on the same inputs (a wrong tile path
shows there before any time is read).

    python3 scripts/diag/fp8_tiles_time.py --cases q_b:128 mlp:128 --variants '[{}, {"block_n": 192}]'
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jds.bench.kernels_fp8_gemm import SHAPES
from jds.bench.results import tiles_sweep_main
from jds.bench.timing import named_kernel_us, profiled_device_us
from pallas_kernels import fp8_gemm


def _case(shape: str, m: int, rotations: int):
    k, n = SHAPES[shape]
    kw, kx = jax.random.split(jax.random.key(0))
    ws_ = []
    for i in range(rotations):
        wq = (jax.random.normal(jax.random.fold_in(kw, i), (n, k), jnp.float32) * 0.5).astype(jnp.float8_e4m3fn)
        # block scales that differ between neighbouring blocks, so that a tile path applying a neighbour's scale
        # (ragged tiles scale per column) shows in max_abs_diff_vs_xla
        b = np.add.outer(np.arange(n // 128), np.arange(k // 128)) % 3
        ws_.append((wq, jnp.asarray(2.0 ** (-6.0 - b), jnp.float32)))
    return jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16), ws_


def _bytes(shape: str, m: int) -> int:
    """HBM bytes of one call: e4m3 weights and their fp32 block scales, bf16 x and y."""
    k, n = SHAPES[shape]
    return n * k + 4 * (n // 128) * (k // 128) + 2 * m * (k + n)


def _measure(shape: str, m: int, rotations: int, tiles: dict, calls: int) -> dict:
    x, ws_ = _case(shape, m, rotations)
    call = functools.partial(fp8_gemm.fp8_linear, implementation="pallas", **tiles)
    fn = jax.jit(lambda x, ws_: [call(x, wq, sw) for wq, sw in ws_])
    got = np.asarray(fn(x, ws_)[0], np.float32)
    want = np.asarray(fp8_gemm.fp8_linear(x, *ws_[0], implementation="xla"), np.float32)
    r = profiled_device_us(fn, x, ws_, calls=calls, by_kernel=True)
    per = lambda v: None if v is None else v / rotations  # noqa: E731
    return {"max_abs_diff_vs_xla": float(np.abs(got - want).max()), "max_abs_xla": float(np.abs(want).max()),
            "kernel_us": per(named_kernel_us(r.get("profile_kernel_us"), fp8_gemm.GEMM_KERNEL)),
            "call_span_us": per(r.get("profile_span_us")), "bytes": _bytes(shape, m),
            "raw": r}


def main() -> None:
    tiles_sweep_main(__doc__, _measure, "fp8_tiles_time", cases=["q_b:128", "mlp:128"],
                     variants='[{}, {"block_n": 192}]', rotations=2,
                     rotations_help="weight copies per timed call (cold weights)")


if __name__ == "__main__":
    main()
