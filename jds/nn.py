"""Small Flax NNX building blocks with DeepSeek's numerics, and weight-dictionary import/export.

Matrices are stored [out, in] (PyTorch/HF orientation) so checkpoints and the PyTorch reference
exchange weights without transposes. Exported names follow docs/DESIGN.md: a Linear or RMSNorm's
``weight`` is exported under the module's own name; fp8 scales as ``<name>.scale``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jds.ops.norms import layer_norm, rms_norm
from jds.ops.quant import QuantizedRows, act_quant, dequant, quantize_weight_blocks_jax
from pallas_kernels.fp8_gemm import fp8_linear, pad_out_rows
from pallas_kernels.fp8_grouped_gemm import fp8_grouped_linear
from pallas_kernels.group_linear import group_linear
from pallas_kernels.norm_quant import AUTO_MAX_ROWS, NormQuant, residual_norm, rms_norm_quant
from pallas_kernels.swiglu_quant import kernel_wins as swiglu_kernel_wins
from pallas_kernels.swiglu_quant import swiglu, swiglu_quant

HIGHEST = jax.lax.Precision.HIGHEST


def jdtype(name: str) -> jnp.dtype:
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def matmul(x: jax.Array, w: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """x [..., in] @ w[out, in]^T with float32 accumulation; full precision for float32 operands."""
    prec = HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), precision=prec, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


class Linear(nnx.Module):
    """y = x W^T. With ``fp8=True`` W is e4m3 + 128x128 block scales and x is re-quantised per 128 with
    ``scale_fmt`` scales (``Numerics.act_scale_fmt``: the checkpoint's ``quantization_config.scale_fmt``).

    ``implementation`` picks the FP8 GEMM (``pallas_kernels.fp8_gemm.fp8_linear``: "xla", "pallas" or
    "auto"); a ``Decoder`` sets it on every linear from its own ``implementation``.

    An FP8 weight whose out is no multiple of 128 (V3.2's ``wkv_a``, 576) is stored with zero rows up to whole
    128-row scale blocks, as its scale grid already is, so that the kernel reads it as it is instead of padding a
    copy on every call; y is cut to ``out_features``. Export and load see the ``out_features`` rows only."""

    _flat_export = True

    def __init__(self, in_features: int, out_features: int, *, dtype: jnp.dtype, fp8: bool, rngs: nnx.Rngs,
                 std: float | None = None, scale_fmt: str = "ue8m0", implementation: str = "xla"):
        if scale_fmt not in ("ue8m0", "amax"):
            raise ValueError(f"scale_fmt must be 'ue8m0' or 'amax', got {scale_fmt!r}")
        self.scale_fmt = scale_fmt
        self.implementation = implementation
        std = in_features ** -0.5 if std is None else std
        w = jax.random.normal(rngs.params(), (out_features, in_features), jnp.float32) * std
        self.fp8 = fp8
        self.dtype = dtype
        self.out_features = out_features
        if fp8:
            wq, s = quantize_weight_blocks_jax(w)  # traceable: an FP8 model builds under nnx.eval_shape
            self.weight = nnx.Param(pad_out_rows(wq))
            self.scale = nnx.Param(jnp.asarray(s))
        else:
            self.weight = nnx.Param(jnp.asarray(w, dtype))

    def stored_rows(self, attr: str) -> tuple[int, int] | None:
        """The rows of parameter ``attr`` that export / load exchange, where the stored one has more (an FP8
        weight's zero rows past ``out_features``); None: all of it."""
        if attr == "weight" and self.fp8 and self.out_features % 128:
            return 0, self.out_features
        return None

    def __call__(self, x: jax.Array | QuantizedRows, out_dtype: jnp.dtype | None = None, *,
                 padded: bool = False) -> jax.Array:
        """x @ W^T [..., out_features]; x may come quantised (``QuantizedRows``, FP8 weights only: ``norm_into``).
        ``padded``: with an FP8 weight, the outputs of its stored rows, the zero rows past ``out_features``
        included (for consumers that read their columns in place: trimmed, the output is copied)."""
        out_dtype = out_dtype or self.dtype
        if isinstance(x, QuantizedRows) and not self.fp8:
            raise ValueError("Linear: a QuantizedRows input needs an FP8 weight (this one is held in "
                             f"{self.weight.dtype})")
        if self.fp8:
            y = fp8_linear(x, self.weight[...], self.scale[...], out_dtype=out_dtype, scale_fmt=self.scale_fmt,
                           implementation=self.implementation)
            return y if padded or self.out_features % 128 == 0 else y[..., :self.out_features]
        return matmul(x.astype(self.dtype), self.weight[...], out_dtype)

    def grouped(self, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
        """Block-diagonal use of the weight: x [..., G, in] with W viewed as [G, out/G, in].

        y[..., g, :] = W_g x[..., g, :] (V4's grouped ``wo_a``): ``pallas_kernels.group_linear`` (off the "xla"
        implementation its kernel, which reads a 16-bit weight near the copy rate at serving row counts). With
        ``fp8`` the input is re-quantised per 128 along ``in`` exactly as ``__call__`` would quantise each group's
        slice; off "xla", on the FP8 grouped GEMM where each group's rows span whole 128-row scale blocks.
        """
        out_dtype = out_dtype or self.dtype
        g = x.shape[-2]
        if self.fp8 and self.implementation != "xla" and self.out_features % (128 * g) == 0:
            return self._grouped_kernel(x, out_dtype)
        if not self.fp8:
            return group_linear(x.astype(self.dtype), self.weight[...], out_dtype=out_dtype,
                                implementation=self.implementation)
        xq, sx = act_quant(x, 128, self.scale_fmt)
        w = self.dense_weight().reshape(g, -1, x.shape[-1])
        y = jnp.einsum("...gi,goi->...go", dequant(xq, sx, 128), w, precision=HIGHEST,
                       preferred_element_type=jnp.float32)
        return y.astype(out_dtype)

    def _grouped_kernel(self, x: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
        """``grouped`` with an FP8 weight on the FP8 grouped GEMM (the MoE experts' kernel, the G groups as
        experts of T rows each): it reads the e4m3 weight as stored, where the XLA form dequantises all of it
        to float32 and runs a float32 batched dot every step. x's groups go group-major (one copy) and back."""
        lead, (g, k) = x.shape[:-2], x.shape[-2:]
        t = int(np.prod(lead, dtype=np.int64))
        n = self.weight.shape[0] // g
        xt = jnp.swapaxes(x.reshape(t, g, k), 0, 1).reshape(g * t, k)
        wq = self.weight[...].reshape(g, n, k)
        ws = self.scale[...].reshape(g, -(-n // 128), self.scale.shape[1])
        y = fp8_grouped_linear(xt, jnp.full((g,), t, jnp.int32), wq, ws, out_dtype=out_dtype,
                               scale_fmt=self.scale_fmt, implementation=self.implementation)
        return jnp.swapaxes(y.reshape(g, t, n), 0, 1).reshape(*lead, g, n)

    def dense_weight(self) -> jax.Array:
        """The weight as float32 [out, in] (dequantised if fp8), e.g. for MLA absorption."""
        if self.fp8:
            from jds.ops.quant import dequant_weight_blocks
            return dequant_weight_blocks(self.weight[...], self.scale[...])[:self.out_features]
        return self.weight[...].astype(jnp.float32)


class FusedLinear(Linear):
    """Several checkpoint linears that share one input, stored row-concatenated and run as one GEMM.

    ``parts`` = ((name, out_features), ...) in row order. export_weights/load_weights never see the fused
    module's own name: each part is exported/loaded under ``name`` (and ``name.scale``) as a sibling of
    this module, so checkpoints keep their separate tensors while the step does a single matmul (its consumers
    read their part's columns of the output, by ``row_ranges``: kernels in place, XLA fusions through a slice).
    With ``fp8`` every part but the last must span whole 128-row scale blocks.
    """

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int]], *, dtype: jnp.dtype, fp8: bool,
                 rngs: nnx.Rngs, scale_fmt: str = "ue8m0"):
        parts = tuple((str(n), int(o)) for n, o in parts)
        if fp8 and any(o % 128 for _, o in parts[:-1]):
            raise ValueError(f"FusedLinear parts {parts}: with fp8 weights every part but the last needs a "
                             "multiple of 128 rows (one scale block must not straddle two parts)")
        super().__init__(in_features, sum(o for _, o in parts), dtype=dtype, fp8=fp8, rngs=rngs, scale_fmt=scale_fmt)
        self.parts = parts

    def row_ranges(self, scale: bool = False) -> list[tuple[str, int, int]]:
        """(name, first row, end row) of each part in the weight (or, with ``scale``, in the scale grid)."""
        out, r = [], 0
        for n, o in self.parts:
            out.append((n, r, r + o) if not scale else (n, r // 128, -(-(r + o) // 128)))
            r += o
        return out


class RMSNorm(nnx.Module):
    _flat_export = True

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, jitter: float = 0.1):
        w = 1.0 + jitter * jax.random.normal(rngs.params(), (dim,), jnp.float32)
        self.weight = nnx.Param(w)
        self.eps = eps

    def __call__(self, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, out_dtype)


def norm_into(norm: RMSNorm | tuple[jax.Array, float], x: jax.Array, linears: Sequence[Linear], *,
              residual: jax.Array | None = None, col: int = 0, width: int | None = None, want_y: bool = True,
              out_dtype: jnp.dtype | None = None) -> tuple[NormQuant, jax.Array | QuantizedRows]:
    """``norm`` (an ``RMSNorm``, or its (weight, eps)) of x's columns ``col`` to ``col + width`` (of x + ``residual``
    where given) for ``linears``, which all
    read it: (the ``NormQuant`` of ``pallas_kernels.norm_quant``, the input to pass them). Where every linear is FP8
    with one scale format, the norm quantises its output for them once and they take the ``QuantizedRows``: on the
    kernels (the linears' own implementation setting) up to ``AUTO_MAX_ROWS`` rows, where one kernel measured
    faster than XLA's norm and the linears' quantisation (an H100: in the model's step at 64 and 128 rows, alone at
    64 to 2048 rows and the model's widths); always on "xla", where both forms compute the same values. Else the
    plain norm's output. ``want_y``: a caller that reads the normed rows itself (always computed on the plain path)."""
    weight, eps = (norm.weight[...], norm.eps) if isinstance(norm, RMSNorm) else norm
    fmts = {lin.scale_fmt for lin in linears if lin.fp8}
    impl = linears[0].implementation if linears else "xla"
    if (linears and all(lin.fp8 for lin in linears) and len(fmts) == 1
            and (impl == "xla" or x.shape[0] <= AUTO_MAX_ROWS)):
        nq = rms_norm_quant(x, weight, eps, scale_fmt=fmts.pop(), residual=residual, col=col,
                            width=width, want_y=want_y, out_dtype=out_dtype,
                            implementation="xla" if impl == "xla" else "auto")
        return nq, nq.x
    h, y = residual_norm(x, weight, eps, residual=residual, col=col, width=width, out_dtype=out_dtype)
    return NormQuant(h=h, y=y, x=None), y


def swiglu_into(gate: jax.Array, up: jax.Array, linear: Linear) -> jax.Array | QuantizedRows:
    """The MLP's activation (``pallas_kernels.swiglu_quant.swiglu``) as ``linear`` takes it: quantised for an FP8
    ``linear`` in the same kernel (on the linear's kernels where ``swiglu_quant.kernel_wins``, as measured in the
    model's step; always on "xla", where both forms compute the same values), else the bf16 rows."""
    dt = linear.dtype
    if linear.fp8 and gate.ndim == 2 and (linear.implementation == "xla" or swiglu_kernel_wins(*gate.shape)):
        xq, _ = swiglu_quant(gate.astype(dt), up.astype(dt), scale_fmt=linear.scale_fmt,
                             implementation="xla" if linear.implementation == "xla" else "auto")
        return xq
    return swiglu(gate, up, dt)


class LayerNorm(nnx.Module):
    _flat_export = False

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, jitter: float = 0.1):
        self.weight = nnx.Param(1.0 + jitter * jax.random.normal(rngs.params(), (dim,), jnp.float32))
        self.bias = nnx.Param(jitter * jax.random.normal(rngs.params(), (dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
        return layer_norm(x, self.weight[...], self.bias[...], self.eps, out_dtype)


def _param_paths(module: nnx.Module) -> dict[str, tuple[Any, str, tuple[int, int] | None]]:
    """Exported name -> (owning module, attribute, row range of the parameter or None for all of it)."""
    out: dict[str, tuple[Any, str, tuple[int, int] | None]] = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param) and path:
            owner = module
            for p in path[:-1]:
                owner = owner[p] if isinstance(p, int) else getattr(owner, p)
            names = [str(p) for p in path]
            if isinstance(owner, FusedLinear):
                attr = str(path[-1])
                for n, a, b in owner.row_ranges(scale=attr == "scale"):
                    leaf = [n] if attr == "weight" else [n, attr]
                    out[".".join(names[:-2] + leaf)] = (owner, attr, (a, b))
                continue
            if getattr(owner, "_flat_export", False) and names[-1] == "weight":
                names = names[:-1]
            rows = owner.stored_rows(str(path[-1])) if isinstance(owner, Linear) else None
            out[".".join(names)] = (owner, str(path[-1]), rows)
    return out


def export_weights(module: nnx.Module) -> dict[str, np.ndarray]:
    """All parameters as numpy arrays under their DESIGN.md names."""
    out = {}
    for k, (o, a, rows) in _param_paths(module).items():
        v = np.asarray(getattr(o, a).get_value())
        out[k] = v if rows is None else v[rows[0]:rows[1]]
    return out


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
        owner, attr, rows = paths[k]
        var = getattr(owner, attr)
        full = var.get_value()
        cur = full if rows is None else full[rows[0]:rows[1]]
        arr = jnp.asarray(v)
        if arr.shape != cur.shape:
            raise ValueError(f"weights[{k!r}] has shape {arr.shape}, expected {cur.shape}")
        if arr.dtype != cur.dtype:
            raise ValueError(f"weights[{k!r}] has dtype {arr.dtype}, expected {cur.dtype}")
        var.set_value(arr if rows is None else full.at[rows[0]:rows[1]].set(arr))
