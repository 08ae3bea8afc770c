"""Shared test base of the ops (jds.ops.dispatch): every implementation of an op against one reference at the
same cases.

An ``OpCase`` names an op's public entry point, builds its inputs, computes an independent reference (numpy
or the op's own definition, never the implementation under test) and checks an output against it; optional
``unsupported`` inputs are a config the kernel cannot take. ``IMPLEMENTATIONS`` parametrises a test over
``"xla"``, ``"pallas"`` in GPU interpret mode (CPU) and ``"pallas"`` native (marked ``gpu``);
``call`` runs one of them under jit.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Callable

import jax
import pytest

from tests.kernel_modes import KERNEL_PRIMITIVES, interpret_for

IMPLEMENTATIONS = [
    pytest.param("xla", "-", id="xla"),
    pytest.param("pallas", "interpret", id="pallas-interpret"),
    pytest.param("pallas", "native", id="pallas-native", marks=pytest.mark.gpu),
]


@dataclass(frozen=True)
class OpCase:
    """One op at one config. ``make()`` -> (args, static kwargs); ``reference(args, kw)`` -> expected output;
    ``check(got, want, args, kw, impl)`` asserts (``impl`` picks the tolerance: the XLA implementation is
    held tighter than a kernel). ``unsupported()``: inputs the kernel cannot take (None: it takes all)."""

    name: str
    op: Callable[..., Any]
    make: Callable[[], tuple[tuple, dict]]
    reference: Callable[[tuple, dict], Any]
    check: Callable[[Any, Any, tuple, dict, str], None]
    unsupported: Callable[[], tuple[tuple, dict]] | None = None
    slow_interpret: bool = False  # the interpret-mode kernel takes long on the CPU: mark its cases slow


def call(case: OpCase, impl: str, mode: str, args: tuple, kw: dict) -> Any:
    """The op under jit with ``implementation=impl`` (and the interpret flag of ``mode`` for the kernel)."""
    extra: dict = {}
    if impl != "xla":
        extra["interpret"] = interpret_for(mode)
    f = jax.jit(functools.partial(case.op, **kw, implementation=impl, **extra))
    return jax.block_until_ready(f(*args))


def kernel_count(case: OpCase, impl: str, args: tuple, kw: dict, interpret: bool = True) -> int:
    """Pallas kernels in a fresh trace of the op (tracing only: nothing runs)."""
    extra = {} if impl == "xla" else {"interpret": interpret}
    text = str(jax.make_jaxpr(functools.partial(case.op, **kw, implementation=impl, **extra))(*args))
    return len(re.findall(r"\b(?:" + "|".join(KERNEL_PRIMITIVES) + r")\[", text))
