"""The one implementation switch of every op (fused inserts, compressor entries, indexer top-k, top-k select,
sparse MQA).

Each op has one public entry point (in pallas_kernels/, next to its kernels) that takes
``implementation=``: ``"xla"`` runs the pure-JAX implementation (in jds/ops), ``"pallas"`` the kernel,
``"auto"`` the kernel where it takes the call's config and XLA elsewhere. A kernel that cannot take a
config raises ``Unsupported`` (a NotImplementedError); ``"auto"`` then moves on, an explicit ``"pallas"``
lets it surface. Only ``Unsupported`` moves "auto" on: any other error (a lowering bug, say) surfaces.

Why here (the lowest layer): the kernels and the layers both import it, and nothing it needs sits above.
"""

from __future__ import annotations

import operator
from typing import Callable, Literal, Mapping, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

Implementation = Literal["auto", "pallas", "xla"]
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "pallas", "xla")
T = TypeVar("T")


class Unsupported(NotImplementedError, ValueError):
    """An implementation cannot take this config (shapes, formats). A NotImplementedError so that "auto"
    moves on to the next implementation, and a ValueError because, asked for explicitly, it is bad input."""


def check_implementation(value: object, field: str = "implementation",
                         allowed: tuple[str, ...] = IMPLEMENTATIONS) -> str:
    """``value`` if it is one of ``allowed``, else a ValueError naming ``field``."""
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value  # type: ignore[return-value]


def describe(x: object) -> str:
    """``x``'s dtype and shape for an error message ("float32 [4, 8]"), or its type when it is not an array."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return f"{type(x).__name__} {x!r}"[:120]
    return f"{dtype} [{', '.join(map(str, shape))}]"


_KINDS = {"float": ("float", jnp.floating), "int": ("int32", jnp.signedinteger)}


def check_array(name: str, x: object, dims: tuple[tuple[str, int | None], ...], kind: str) -> None:
    """ValueError naming ``name`` unless ``x`` is an array of ``kind`` ("float": any floating dtype; "int": a signed
    integer dtype, int32 as documented) with one axis per ``dims`` entry, each (label, size) with ``size`` None for
    any size. Static (shapes and dtypes only), so it holds at trace time under ``jax.jit``."""
    word, base = _KINDS[kind]
    want = f"{word} [{', '.join(lab if n is None else f'{lab}={n}' for lab, n in dims)}]"
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    ok = (shape is not None and dtype is not None and len(shape) == len(dims)
          and all(n is None or s == n for s, (_, n) in zip(shape, dims)) and jnp.issubdtype(dtype, base))
    if not ok:
        raise ValueError(f"{name} must be {want}, got {describe(x)}")


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int (a bool is refused) in [minimum, maximum], else a ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        want = (f"in [{minimum}, {maximum}]" if minimum is not None and maximum is not None
                else f">= {minimum}" if minimum is not None else f"<= {maximum}")
        raise ValueError(f"{name} must be {want}, got {v}")
    return v


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


H200_SMS = 132


def num_sms() -> int:
    """Streaming multiprocessors of the default GPU (a persistent kernel's grid, a split's target); off-GPU
    (interpret mode, lowering for an H200 on a CPU host) the H200's 132."""
    d = jax.devices()[0]
    if d.platform != "gpu":
        return H200_SMS
    return int(getattr(d, "core_count", 0) or H200_SMS)


def resolve_interpret(interpret: bool | None) -> bool:
    """None -> GPU interpret mode unless the default backend is a GPU (kernels off-GPU: tests only)."""
    return not on_gpu() if interpret is None else bool(interpret)


def mosaic_interpret(interpret: object) -> object:
    """A Mosaic GPU kernel's ``interpret`` argument resolved: None to run natively, else the interpreter's
    ``plgpu.InterpretGPUParams`` (given ones kept; True or, as ``resolve_interpret``, None off the GPU: defaults)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415 - the lowest layer imports no kernels

    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if resolve_interpret(interpret) else None


def resolve_layer_implementation(implementation: str) -> Literal["xla", "pallas"]:
    """A layer's setting: ``"auto"`` is the kernels on a GPU backend and XLA elsewhere (off-GPU the kernels
    only run in interpret mode: correct but slow). A layer on "pallas" still runs XLA for a config a
    kernel cannot take (it calls each op with ``op_implementation``)."""
    check_implementation(implementation)
    if implementation == "auto":
        return "pallas" if on_gpu() else "xla"
    return implementation  # type: ignore[return-value]


def op_implementation(layer_implementation: str) -> Implementation:
    """What a layer on ``layer_implementation`` asks each op for: kernels where they fit, or XLA."""
    return "auto" if resolve_layer_implementation(layer_implementation) == "pallas" else "xla"


def run_op(name: str, implementation: str, impls: Mapping[str, Callable[[], T]]) -> T:
    """Run the ``implementation`` of op ``name`` from ``impls`` (``"pallas"`` then ``"xla"`` for ``"auto"``,
    moving on when one raises ``Unsupported``)."""
    check_implementation(implementation)
    order = ("pallas", "xla") if implementation == "auto" else (implementation,)
    for i, impl in enumerate(order):
        try:
            return impls[impl]()
        except Unsupported:
            if i + 1 == len(order):
                raise
    raise AssertionError(f"{name}: no implementation ran")  # unreachable: the loop returns or raises
