"""The PyTorch side of the jds-vs-PyTorch comparison (issue 18).

``torch_stack`` rebuilds the jds decoder stacks (V3.2, the V4-Flash pattern; dense or MoE FFN) in PyTorch
from a jds ``Decoder``'s own parameters, over paged caches in the same byte formats, and runs a step in
vLLM's boundary modes (``eager`` / ``wide`` / ``narrow`` / ``full``); ``torch_kernels`` holds its stages;
``torch_bench`` times it beside jds for ``python -m jds.bench.boundary --backend jax torch``. Its linears run as
the model stores them: bf16, or an FP8 checkpoint's e4m3 weights with 128 x 128 scales (``--fp8-weights``:
torch's blockwise-scaled GEMM on CUDA, ``torch_kernels.fp8_linear``), FP8 routed experts dequantised for its
every-expert FFN; V4's FP8 ``wo_a`` (a departure from the release) and V4's FP4 indexer are not implemented there,
and are refused by name.

PyTorch is an optional dependency of the package (the ``test`` extra): nothing here imports torch at
package import time, so ``import jds.compare`` works without it.
"""

from __future__ import annotations

TORCH_MODES = ("eager", "wide", "narrow", "full")
