"""The FP8 grouped expert GEMM benchmark: ``jds.bench.kernels_grouped`` with ``--format fp8``.

    python -m jds.bench.kernels_fp8_grouped [--out benchmarks/results/kernels_fp8_grouped_<device>_<date>.json]
        [--shapes w1 w2] [--tokens 1 8 32 64 4096] [--sweep] [--quick]
"""

from jds.bench.kernels_grouped import main

if __name__ == "__main__":
    main(fmt="fp8")
