"""The one implementation switch of every op (fused inserts, indexer top-k, top-k select, sparse MQA).

Each op has one public entry point (in pallas_kernels/, next to its kernels) that takes
``implementation=``: ``"xla"`` runs the pure-JAX implementation (in jds/ops), ``"pallas"`` the kernel,
``"auto"`` the kernel where it takes the call's config and XLA elsewhere. A kernel that cannot take a
config raises ``Unsupported`` (a NotImplementedError); ``"auto"`` then moves on, an explicit ``"pallas"``
lets it surface. Only ``Unsupported`` moves "auto" on: any other error (a lowering bug, say) surfaces.

Why here (the lowest layer): the kernels and the layers both import it, and nothing it needs sits above.
"""

from __future__ import annotations

from typing import Callable, Literal, Mapping, TypeVar

import jax

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
