"""Small Flax NNX building blocks with DeepSeek's numerics, and weight-dictionary import/export.

Matrices are stored [out, in] (PyTorch/HF orientation) so checkpoints and the PyTorch reference
exchange weights without transposes. Exported names follow docs/DESIGN.md: a Linear or RMSNorm's
``weight`` is exported under the module's own name; fp8 scales as ``<name>.scale``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jds.ops.norms import layer_norm, rms_norm
from jds.ops.quant import fp8_linear, quantize_weight_blocks

HIGHEST = jax.lax.Precision.HIGHEST


def jdtype(name: str) -> jnp.dtype:
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def matmul(x: jax.Array, w: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """x [..., in] @ w[out, in]^T with float32 accumulation; full precision for float32 operands."""
    prec = HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), precision=prec, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


class Linear(nnx.Module):
    """y = x W^T. With ``fp8=True`` W is e4m3 + 128x128 block scales and x is re-quantised per 128."""

    _flat_export = True

    def __init__(self, in_features: int, out_features: int, *, dtype: jnp.dtype, fp8: bool, rngs: nnx.Rngs,
                 std: float | None = None):
        std = in_features ** -0.5 if std is None else std
        w = np.asarray(jax.random.normal(rngs.params(), (out_features, in_features), jnp.float32)) * std
        self.fp8 = fp8
        self.dtype = dtype
        if fp8:
            wq, s = quantize_weight_blocks(w)
            self.weight = nnx.Param(jnp.asarray(wq))
            self.scale = nnx.Param(jnp.asarray(s))
        else:
            self.weight = nnx.Param(jnp.asarray(w, dtype))

    def __call__(self, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
        out_dtype = out_dtype or self.dtype
        if self.fp8:
            return fp8_linear(x, self.weight[...], self.scale[...], out_dtype)
        return matmul(x.astype(self.dtype), self.weight[...], out_dtype)

    def dense_weight(self) -> jax.Array:
        """The weight as float32 [out, in] (dequantised if fp8), e.g. for MLA absorption."""
        if self.fp8:
            from jds.ops.quant import dequant_weight_blocks
            return dequant_weight_blocks(self.weight[...], self.scale[...])
        return self.weight[...].astype(jnp.float32)


class RMSNorm(nnx.Module):
    _flat_export = True

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, jitter: float = 0.1):
        w = 1.0 + jitter * jax.random.normal(rngs.params(), (dim,), jnp.float32)
        self.weight = nnx.Param(w)
        self.eps = eps

    def __call__(self, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, out_dtype)


class LayerNorm(nnx.Module):
    _flat_export = False

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, jitter: float = 0.1):
        self.weight = nnx.Param(1.0 + jitter * jax.random.normal(rngs.params(), (dim,), jnp.float32))
        self.bias = nnx.Param(jitter * jax.random.normal(rngs.params(), (dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
        return layer_norm(x, self.weight[...], self.bias[...], self.eps, out_dtype)


def _param_paths(module: nnx.Module) -> dict[str, tuple[Any, str]]:
    """Exported name -> (owning module, attribute)."""
    out: dict[str, tuple[Any, str]] = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param) and path:
            owner = module
            for p in path[:-1]:
                owner = owner[p] if isinstance(p, int) else getattr(owner, p)
            names = [str(p) for p in path]
            if getattr(owner, "_flat_export", False) and names[-1] == "weight":
                names = names[:-1]
            out[".".join(names)] = (owner, str(path[-1]))
    return out


def export_weights(module: nnx.Module) -> dict[str, np.ndarray]:
    """All parameters as numpy arrays under their DESIGN.md names."""
    return {k: np.asarray(getattr(o, a).get_value()) for k, (o, a) in _param_paths(module).items()}


def load_weights(module: nnx.Module, weights: dict[str, Any], *, strict: bool = True) -> None:
    """Replace parameters from a name -> array dict; shapes and dtypes must match exactly."""
    paths = _param_paths(module)
    if strict:
        missing = sorted(set(paths) - set(weights))
        extra = sorted(set(weights) - set(paths))
        if missing or extra:
            raise ValueError(f"weights: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, v in weights.items():
        if k not in paths:
            continue
        owner, attr = paths[k]
        var = getattr(owner, attr)
        cur = var.get_value()
        arr = jnp.asarray(v)
        if arr.shape != cur.shape:
            raise ValueError(f"weights[{k!r}] has shape {arr.shape}, expected {cur.shape}")
        if arr.dtype != cur.dtype:
            raise ValueError(f"weights[{k!r}] has dtype {arr.dtype}, expected {cur.dtype}")
        var.set_value(arr)
