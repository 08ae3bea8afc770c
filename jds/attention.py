"""What the V3.2 and V4 attention layers share above the primitives: the result type and the stage
order of a forward pass (the boundary runner calls the same stages one by one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jax
from flax import nnx

from jds.batch import PagedBatch

Implementation = Literal["xla", "pallas", "auto"]


def resolve_implementation(implementation: str) -> Literal["xla", "pallas"]:
    """``"auto"``: the Pallas kernels on a GPU backend, the pure-JAX stages elsewhere (the kernels only run
    in interpret mode off-GPU: correct but slow). Each kernel wrapper still falls back to its XLA reference
    for shapes it does not support (see each kernel's ``supports``)."""
    if implementation == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if implementation not in ("xla", "pallas"):
        raise ValueError(f"implementation must be 'xla', 'pallas' or 'auto', got {implementation!r}")
    return implementation  # type: ignore[return-value]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionResult:
    y: jax.Array  # [T, hidden]
    cache: Any  # the layer's cache pytree after this step's inserts
    topk: jax.Array  # [T, index_topk] request-local indices (-1 padded); [T, 0] for layers without an indexer


class StagedAttention(nnx.Module):
    """Base of both layers: ``__call__`` is the list of stages every subclass implements."""

    def __call__(self, x: jax.Array, batch: PagedBatch, cache: Any) -> AttentionResult:
        self.check_inputs(x, batch, cache)
        inp = self.project_in(x)
        query, cache = self.prepare(inp, batch, cache)
        topk = self.select(query, batch, cache)
        o = self.attend(query, topk, batch, cache)
        return AttentionResult(y=self.project_out(o), cache=cache, topk=topk)
