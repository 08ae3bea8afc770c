"""Random-weight decoder stacks at real attention dims and runners over them, for the step benchmarks."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from jds.batch import Chunk


def build_stack(arch: str, layers: int, *, intermediate: int | None = None, size: str = "bench",
                implementation: str = "auto", moe_experts: int = 0, moe_topk: int = 8,
                moe_intermediate: int = 2048, seed: int = 0, fp8_weights: bool = False) -> Any:
    """A ``Decoder`` from the ``{arch}-{size}`` preset with serving numerics (``fp8_weights``: with the
    checkpoints' FP8 block-scaled linears and routed experts, run by the FP8 GEMMs, instead of bf16 weights).

    ``moe_experts > 0`` swaps the dense MLP for a DeepSeek-style MoE FFN (routed experts of width
    ``moe_intermediate``, top-``moe_topk`` routing, one shared expert).
    """
    from jds.config import Numerics
    from jds.model import Decoder, preset

    numerics = Numerics.serving()
    if fp8_weights:  # as an FP8 checkpoint stores them: the linears and, in a MoE FFN, the routed experts
        numerics = dataclasses.replace(numerics, fp8_linear=True, experts_fp8=moe_experts > 0)
    over: dict[str, Any] = {"n_layers": layers, "numerics": numerics}
    if intermediate:
        over["intermediate_size"] = intermediate
    if moe_experts:
        over.update(n_routed_experts=moe_experts, moe_topk=moe_topk, n_shared_experts=1,
                    moe_intermediate_size=moe_intermediate)
    return Decoder(preset(f"{arch}-{size}", **over), seed=seed, implementation=implementation)


def make_runner(model: Any, mode: str, max_seqs: int, ctx: int, **settings: Any) -> Any:
    """A ``BoundaryRunner`` for ``ctx``-token contexts and up to ``max_seqs`` rows of 128-token prompts;
    ``settings`` are further ``RunnerConfig`` fields (input_prep, segments, compiler options, dump_dir, ...)."""
    from jds.config import RunnerConfig, replace
    from jds.runner import BoundaryRunner

    bs = model.cfg.block_size
    max_len = ctx + bs
    nb = max_seqs * (-(-max_len // bs)) + 8
    config = RunnerConfig(mode=mode, num_blocks=nb, max_num_seqs=max_seqs, max_num_tokens=max_seqs * 128,
                          max_model_len=max_len, token_buckets=(16, 64, 128, max_seqs * 128),
                          key_block_buckets=tuple(sorted({-(-128 // bs), -(-ctx // bs), -(-max_len // bs)})))
    return BoundaryRunner(model, replace(config, **settings))


def block_table(runner: Any, rows: int) -> np.ndarray:
    """Distinct pages for ``rows`` request rows (wrapping inside the pool)."""
    bt = np.arange(runner.max_num_seqs * runner.max_blocks, dtype=np.int32).reshape(runner.max_num_seqs, -1)
    return (bt % runner.num_blocks)[:rows]


def step_shapes(ctx: int) -> dict[str, list[Chunk]]:
    """The steps the benchmarks time, by name."""
    return {"ttft_128": [Chunk(0, 0, 128)],
            "prefill_64x128_step": [Chunk(i, 0, 128) for i in range(64)],
            f"decode_b1_ctx{ctx}": [Chunk(0, ctx - 1, 1)],
            f"decode_b64_ctx{ctx}": [Chunk(i, ctx - 1, 1) for i in range(64)]}


def time_steps(runner: Any, ids: np.ndarray, chunks: list[Chunk], bt: np.ndarray, n: int, warm: int = 10,
               parts: dict[str, list[float]] | None = None, put: bool = False, spin: bool = False,
               host_ids: bool = True) -> tuple[list[float], list[float], list[float]]:
    """Seconds per step, over ``n`` steps after ``warm``: (wall: inputs -> the greedy next token of every
    chunk on the host, host input preparation, host launch of ``runner.step``).

    The wall time ends at the first token on the host, as a server's TTFT does: the argmax runs on the device
    and only the chunks' ids come back, not the [max_num_seqs, vocab] float32 logits (8 MiB at 64 rows x 32K,
    whose copy would be timed as part of the step otherwise).

    ``parts``: also filled with the host seconds of the greedy dispatch (``sample``) and of the wait for its ids
    (``wait``), and, for a segmented fused step, of each segment's dispatch (``seg0``, ``seg1``, ...).
    ``put``: the packed step buffer goes to the device by ``jax.device_put`` inside the timed preparation,
    instead of as a numpy argument of the first dispatch (device input preparation only). ``spin``: the host
    polls the ids' readiness instead of sleeping in the blocking wait, so its core stays awake for the next
    step's preparation. ``host_ids``: the ids come back through the sampler's pinned-host copy
    (``jds.sampling.greedy_tokens_host``), as the engine reads them; False: a transfer of the device array.
    """
    import jax

    from jds.sampling import greedy_tokens, greedy_tokens_host

    walls, preps, launches = [], [], []
    r = len(chunks)
    restore = _time_segments(runner, parts) if parts is not None else None
    try:
        for i in range(warm + n):
            a = time.perf_counter()
            inputs = runner.prepare_inputs(ids, chunks, bt)
            if put:
                inputs = (dataclasses.replace(inputs[0], packed=jax.device_put(inputs[0].packed)),)
            b = time.perf_counter()
            logits = runner.step(*inputs)
            c = time.perf_counter()
            tok = greedy_tokens_host(logits)[1] if host_ids else greedy_tokens(logits)
            d = time.perf_counter()
            if spin:
                while not tok.is_ready():
                    pass
            np.asarray(tok)[:r]
            e = time.perf_counter()
            if i >= warm:
                walls.append(e - a)
                preps.append(b - a)
                launches.append(c - b)
                if parts is not None:
                    parts.setdefault("sample", []).append(d - c)
                    parts.setdefault("wait", []).append(e - d)
            elif parts is not None:
                for k in [k for k in parts if k.startswith("seg")]:
                    parts[k].clear()
    finally:
        if restore is not None:
            restore()
    return walls, preps, launches


def _time_segments(runner: Any, parts: dict[str, list[float]]) -> Any:
    """Wrap a segmented runner's segment executables so that each dispatch's host time lands in
    ``parts[f"seg{k}"]``; returns the function that undoes it."""
    if getattr(runner, "segments", 1) <= 1:
        return None
    orig = runner._segment

    def timed(k: int, kb: int) -> Any:
        f = orig(k, kb)

        def call(*args: Any) -> Any:
            t = time.perf_counter()
            out = f(*args)
            parts.setdefault(f"seg{k}", []).append(time.perf_counter() - t)
            return out
        return call
    runner._segment = timed
    return lambda: delattr(runner, "_segment")
