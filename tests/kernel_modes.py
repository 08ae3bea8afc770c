"""Shared parametrisation of kernel tests: the same test runs in GPU interpret mode on the CPU (CI)
and natively (marked ``gpu``) on a CUDA machine."""

from __future__ import annotations

import re

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"
MODES = ["interpret", pytest.param("native", marks=pytest.mark.gpu)]


def interpret_for(mode: str) -> bool:
    """True for interpret mode; skips the mode that does not apply on this backend."""
    if mode == "native" and not ON_GPU:
        pytest.skip("native kernel needs a CUDA GPU")
    if mode == "interpret" and ON_GPU:
        pytest.skip("interpret mode is the CPU CI's stand-in for the native run")
    return mode == "interpret"


# jaxpr primitives of a Pallas kernel: pallas_call (Triton and interpret-mode pallas_call kernels) and the
# Mosaic GPU ``plgpu.kernel`` form (an mpmd_map / core_map over the GPU mesh, in both native and interpret mode)
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map", "core_map")


def pallas_calls(method, module, *args) -> int:
    """How many Pallas kernels (``KERNEL_PRIMITIVES``) a fresh trace of ``method(module, *args)`` contains,
    nested jaxprs included.

    Why: a spy on a kernel wrapper counts only calls made while tracing, and a cached ``nnx.jit`` /
    ``jax.jit`` trace makes no calls, so a spy can miss a kernel that runs or count one that does not.
    ``jax.make_jaxpr`` always traces anew, so this is a direct look at what the layer's step would run."""
    from flax import nnx

    graphdef, state = nnx.split(module)

    def f(state, *args):
        return method(nnx.merge(graphdef, state), *args)

    text = str(jax.make_jaxpr(f)(state, *args))
    return len(re.findall(r"\b(?:" + "|".join(KERNEL_PRIMITIVES) + r")\[", text))
