"""The command-line layer's shared pieces: the only place that edits the process environment for XLA, and
the flags that several entry points turn into configs.

Why here: the library (``jds/*.py``, ``jds.ops``, ``jds.engine``, ``jds.server``, ``pallas_kernels``) takes
every setting through a constructor (``ModelConfig``, ``RunnerConfig``, kernel configs) and reads no
environment variable; process-wide switches that XLA reads only from ``XLA_FLAGS`` at client creation are
set by the scripts and benchmarks (``scripts/serve.py``, ``jds.bench.*``) through this module.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

# Values of XLA's DebugOptions.CommandBufferUpdateMode in jax 0.11.2's XLA (read from the enum
# descriptor in jaxlib; an unknown value is rejected when XLA parses its flags).
GRAPH_UPDATE_MODES = ("ALWAYS_UPDATE", "SKIP_TEMP", "SKIP_PROFILED")

# ``--moe``: the MoE FFN the benchmarks and tests have used (8 routed experts, top-2, one shared expert).
MOE_ALIAS: dict[str, int] = {"n_routed_experts": 8, "moe_topk": 2, "n_shared_experts": 1}


def use_graph_update_mode(mode: str) -> None:
    """Process-wide ``--xla_gpu_command_buffer_update_mode``; call before JAX initialises its backends.

    Why: with the default ALWAYS_UPDATE, XLA patches a recorded CUDA graph whenever a buffer it uses
    moves (fresh inputs, new temp and output allocations), and re-traces library commands (GEMMs).
    SKIP_TEMP pins temp buffers, SKIP_PROFILED also the parameters and outputs that kept their address
    over the first calls, at fixed virtual addresses. Both need XLA's VMM allocator, which XLA selects
    only when the mode is in XLA_FLAGS at client creation: as a per-executable compiler option
    (``RunnerConfig.captured_compiler_options``) it would silently fall back (openxla/xla
    gpu_executable_va_remap_allocator.cc, 2026), hence a process-wide flag set here, at the command line.
    Neither mode removed the per-step ``command_buffer::update`` of a fused step whose inputs are fresh
    device arrays (benchmarks/results/host_profile_h200_2026-11-30.json, variants SKIP_TEMP / SKIP_PROFILED
    against default), so it stays an option, off by default.
    """
    if mode not in GRAPH_UPDATE_MODES:
        raise ValueError(f"graph_update_mode must be one of {GRAPH_UPDATE_MODES}, got {mode!r}")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("graph_update_mode must be set before JAX initialises its backends")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_command_buffer_update_mode={mode}".strip()


def numerics_fields(items: list[str]) -> dict[str, object]:
    """``FIELD=VALUE`` strings -> Numerics field overrides, typed by the field (booleans: true/false); an
    unknown field or a bad value is a ValueError naming it (Numerics validates the values themselves)."""
    import dataclasses

    from jds.config import Numerics

    defaults = {f.name: f.default for f in dataclasses.fields(Numerics)}
    out: dict[str, object] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in defaults:
            raise ValueError(f"--numerics-field {item!r}: expected FIELD=VALUE with FIELD one of {sorted(defaults)}")
        if isinstance(defaults[name], bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--numerics-field {name}: expected true or false, got {text!r}")
            out[name] = text.lower() in ("true", "1")
        else:
            out[name] = text
    Numerics(**{**defaults, **out})  # the values' own checks, naming the field
    return out


def int_at_least(lo: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``lo``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


positive_int = int_at_least(1)  # a zero or negative pool / batch / length is refused at start-up


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def add_moe_flags(p: argparse.ArgumentParser) -> None:
    """``--moe-experts N --moe-topk K --moe-shared S`` (a DeepSeek-style MoE FFN instead of the dense MLP),
    and ``--moe``, the alias of the 8 / 2 / 1 MoE. Read them back with :func:`moe_overrides`."""
    g = p.add_argument_group("MoE FFN (default: the dense MLP)")
    g.add_argument("--moe-experts", type=positive_int, default=None, metavar="N",
                   help="routed experts per layer (ModelConfig.n_routed_experts)")
    g.add_argument("--moe-topk", type=positive_int, default=None, metavar="K",
                   help="experts routed per token (ModelConfig.moe_topk; default 2)")
    g.add_argument("--moe-shared", type=positive_int, default=None, metavar="S",
                   help="always-on shared experts (ModelConfig.n_shared_experts; default 1)")
    g.add_argument("--moe", action="store_true",
                   help="alias for --moe-experts 8 --moe-topk 2 --moe-shared 1 (an explicit --moe-* flag "
                        "replaces its part)")


def moe_overrides(a: argparse.Namespace) -> dict[str, Any]:
    """The ModelConfig fields the MoE flags set ({} for the dense MLP). A ``--moe-topk`` or ``--moe-shared``
    without ``--moe-experts`` / ``--moe`` is a ValueError, since a dense model would ignore it."""
    given = {"n_routed_experts": a.moe_experts, "moe_topk": a.moe_topk, "n_shared_experts": a.moe_shared}
    given = {k: v for k, v in given.items() if v is not None}
    if not a.moe and "n_routed_experts" not in given:
        if given:
            raise ValueError("--moe-topk / --moe-shared need --moe-experts N (or --moe): the dense MLP has no experts")
        return {}
    return {**(MOE_ALIAS if a.moe else {}), **given}
