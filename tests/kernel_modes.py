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
