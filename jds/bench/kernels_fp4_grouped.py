"""The FP4 grouped expert GEMM benchmark: ``jds.bench.kernels_grouped`` with ``--format fp4``.

    python -m jds.bench.kernels_fp4_grouped [--out benchmarks/results/kernels_fp4_grouped_<device>_<date>.json]
        [--shapes w1 w2] [--tokens 1 8 32 64 4096] [--sweep] [--quick]
"""

from jds.bench.kernels_grouped import main

if __name__ == "__main__":
    main(fmt="fp4")
