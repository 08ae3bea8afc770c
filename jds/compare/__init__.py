"""The PyTorch side of the jds-vs-PyTorch comparison (issue 18).

``torch_stack`` rebuilds the jds decoder stacks (V3.2, the V4-Flash pattern; dense or MoE FFN) in PyTorch
from a jds ``Decoder``'s own parameters, over paged caches in the same byte formats, and runs a step in
vLLM's boundary modes (``eager`` / ``wide`` / ``narrow`` / ``full``); ``torch_kernels`` holds its stages;
``torch_bench`` times it beside jds for ``python -m jds.bench.boundary --backend jax torch``.

PyTorch is an optional dependency of the package (the ``test`` extra): nothing here imports torch at
package import time, so ``import jds.compare`` works without it.
"""

from __future__ import annotations

TORCH_MODES = ("eager", "wide", "narrow", "full")
