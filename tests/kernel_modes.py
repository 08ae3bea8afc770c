"""Shared parametrisation of kernel tests: the same test runs in GPU interpret mode on the CPU (CI)
and natively (marked ``gpu``) on a CUDA machine."""

from __future__ import annotations

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


def pallas_calls(method, module, *args) -> int:
    """How many ``pallas_call``s a fresh trace of ``method(module, *args)`` contains (nested jaxprs included).

    Why: a spy on a kernel wrapper counts only calls made while tracing, and a cached ``nnx.jit`` /
    ``jax.jit`` trace makes no calls, so a spy can miss a kernel that runs or count one that does not.
    ``jax.make_jaxpr`` always traces anew, so this is a direct look at what the layer's step would run."""
    from flax import nnx

    graphdef, state = nnx.split(module)

    def f(state, *args):
        return method(nnx.merge(graphdef, state), *args)

    return str(jax.make_jaxpr(f)(state, *args)).count("pallas_call")
