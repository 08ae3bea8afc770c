"""The torch side of ``python -m jds.bench.boundary --backend jax torch``: the same stacks (same preset, seed
and weights as jds's ``build_stack``), the same step shapes, timed the same way (host inputs -> logits on
the host), in the four torch boundary modes; and the one comparison table of both sides."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from jds.compare import TORCH_MODES

# jds mode -> the torch mode it is compared with
PAIRS = {"wide": "wide", "narrow": "narrow", "fused": "full"}


def _stats(xs: list[float]) -> dict[str, float]:
    from jds.bench.stats import summarize

    s = summarize(xs)
    return {"n": s.pop("n"), **{f"{k}_ms": v for k, v in s.items()}}


def time_torch_steps(runner: Any, chunks: list, bt: np.ndarray, n_warm: int, n: int, end: str = "logits") -> dict:
    """Wall time per step: host inputs -> the logits on the host, or (``end="ids"``) their greedy ids, argmax on
    the device (the first warm step captures the graphs)."""
    import torch

    ids = np.random.default_rng(0).integers(0, 256, sum(c.num_tokens for c in chunks)).astype(np.int32)
    walls = []
    for i in range(n_warm + n):
        t0 = time.perf_counter()
        logits = runner.step(runner.prepare_inputs(ids, chunks, bt))
        (logits.argmax(-1).to(torch.int32) if end == "ids" else logits).cpu()
        if i >= n_warm:
            walls.append(time.perf_counter() - t0)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return _stats(walls) if walls else {}


def torch_stack(arch: str, layers: int, inter: int | None, ctx: int, size: str = "bench",
                device: str | None = None, fp8_weights: bool = False
                ) -> tuple[Any, Any, dict, int, np.ndarray, dict[str, int]]:
    """jds's benchmark stack (``jds.bench.stack.build_stack``) as torch parameters on ``device`` (default: CUDA
    if there is one), with the page count and the [64, pages] block table of 64 rows of ``ctx`` tokens:
    (device, config, params, num_blocks, block_tables, the FP8 linears' out features: ``fp8_out_features``)."""
    import torch

    from jds.bench.stack import build_stack
    from jds.compare.torch_stack import fp8_out_features, params_to_torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = build_stack(arch, layers, intermediate=inter, size=size, implementation="xla", fp8_weights=fp8_weights)
    cfg = model.cfg
    params, outs = params_to_torch(model, dev), fp8_out_features(model)
    del model
    max_blocks = -(-(ctx + cfg.block_size) // cfg.block_size)
    nb = 64 * max_blocks + 8
    return dev, cfg, params, nb, np.arange(64 * max_blocks, dtype=np.int32).reshape(64, -1) % nb, outs


def bench_torch_arch(arch: str, layers: int, inter: int | None, ctx: int, quick: bool,
                     modes: tuple[str, ...] = TORCH_MODES, size: str = "bench", device: str | None = None,
                     on_mode: Callable[[dict], None] | None = None, indexer_kernel: str = "torch",
                     step_end: str = "logits", fp8_weights: bool = False) -> dict:
    """Every step shape of jds.bench.boundary in each torch mode; ``launches_per_step``: aten ops run
    outside graphs in one step (kernel-launching ops; view/metadata ops separately)."""
    import torch

    from jds.bench.stack import step_shapes
    from jds.compare import torch_kernels as K
    from jds.compare.torch_stack import TorchDecoder, TorchStepRunner

    dev, cfg, params, nb, bt, outs = torch_stack(arch, layers, inter, ctx, size, device, fp8_weights)
    out: dict = {"arch": arch, "layers": layers, "device": str(dev), "torch": torch.__version__,
                 "indexer_kernel": indexer_kernel, "step_end": step_end,
                 "config": str(cfg), "modes": {}}
    n_ttft, n_dec, n_tp = (30, 30, 5) if quick else (300, 100, 20)
    shapes = step_shapes(ctx)
    for mode in modes:
        t0 = time.perf_counter()
        r = TorchStepRunner(TorchDecoder(cfg, params, nb, dev, indexer_kernel, outs), mode)
        res: dict = {}
        res["ttft_128"] = time_torch_steps(r, shapes["ttft_128"], bt, 20, n_ttft, step_end)
        res["launches_per_step"] = {"ttft_128": r.count_step(r.prepare_inputs(
            np.zeros(128, np.int32), shapes["ttft_128"], bt))}
        res["prefill_64x128_step"] = time_torch_steps(r, shapes["prefill_64x128_step"], bt, 3, n_tp, step_end)
        res["throughput_req_per_s"] = 64e3 / res["prefill_64x128_step"]["mean_ms"]
        for b in (1, 64):
            name = f"decode_b{b}_ctx{ctx}"
            res[name] = time_torch_steps(r, shapes[name], bt, 10, n_dec, step_end)
        res["launches_per_step"][f"decode_b64_ctx{ctx}"] = r.count_step(r.prepare_inputs(
            np.zeros(64, np.int32), shapes[f"decode_b64_ctx{ctx}"], bt))
        res["bench_seconds"] = time.perf_counter() - t0
        out["modes"][mode] = res
        if fp8_weights:  # which FP8 GEMM the linears ran (torch's blockwise scaled_mm, or why not)
            out["fp8_gemm"] = dict(K.FP8_GEMM) if dev.type == "cuda" else {"path": "dequantised", "error": "not CUDA"}
        if on_mode:
            on_mode(out)
        del r
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def comparison(jax_res: dict | None, torch_res: dict | None, ctx: int, stat: str = "mean_ms") -> dict:
    """jds beside torch per step, ``stat`` of each timing record: ``cols`` (``jax:<mode>`` then ``torch:<mode>``),
    ``pairs`` (the jds/torch ratio columns: paired modes, then ``best/best`` when both sides ran), ``rows``
    (metric, values per col, ratios per pair), ``launches`` (jds's out-of-executable dispatches and torch's
    out-of-graph aten ops per TTFT step, per col) and ``ratios`` (by name, plus torch's narrow/wide and full/wide
    TTFT: the upstream check)."""
    metrics = ["ttft_128", "prefill_64x128_step", f"decode_b1_ctx{ctx}", f"decode_b64_ctx{ctx}"]
    jm = (jax_res or {}).get("modes", {})
    tm = (torch_res or {}).get("modes", {})
    pairs = [(j, t) for j, t in PAIRS.items() if j in jm and t in tm]
    out: dict = {"cols": [f"jax:{m}" for m in jm] + [f"torch:{m}" for m in tm],
                 "pairs": [f"{j}/{t}" for j, t in pairs] + (["best/best"] if jm and tm else []),
                 "rows": [], "ratios": {}}
    for k in metrics:
        jv = {m: jm[m].get(k, {}).get(stat) for m in jm}
        tv = {m: tm[m].get(k, {}).get(stat) for m in tm}
        qs = []
        for j, t in pairs:
            qs.append(jv[j] / tv[t] if jv[j] and tv[t] else None)
            out["ratios"][f"{k}:{j}/{t}"] = qs[-1]
        if jm and tm:
            jb = min((v for v in jv.values() if v), default=None)
            tb = min((v for v in tv.values() if v), default=None)
            qs.append(jb / tb if jb and tb else None)
            out["ratios"][f"{k}:best/best"] = qs[-1]
        out["rows"].append((k, list(jv.values()) + list(tv.values()), qs))
    out["launches"] = ([jm[m].get("dispatches_per_step", {}).get("eager", "") for m in jm]
                       + [tm[m].get("launches_per_step", {}).get("ttft_128", {}).get("launches", "") for m in tm])
    for a, b in (("narrow", "wide"), ("full", "wide")):  # the upstream check: torch narrow/wide TTFT 0.40-0.60
        if a in tm and b in tm and tm[a].get("ttft_128") and tm[b].get("ttft_128"):
            out["ratios"][f"ttft_128:torch_{a}/torch_{b}"] = tm[a]["ttft_128"][stat] / tm[b]["ttft_128"][stat]
    return out


def comparison_table(jax_res: dict | None, torch_res: dict | None, ctx: int) -> tuple[str, dict]:
    """One text table per arch (metric rows; jax modes, torch modes, jds/torch per paired mode and best vs
    best; means) and the ratios as a dict (``comparison``)."""
    c = comparison(jax_res, torch_res, ctx)
    head = ["metric (ms)"] + c["cols"] + c["pairs"]
    rows = [[k] + [_f(v) for v in vals] + [_f(q, 3) for q in qs] for k, vals, qs in c["rows"]]
    rows.append(["launches/step (ttft)"] + [str(x) for x in c["launches"]] + [""] * len(c["pairs"]))
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    text = "\n".join("  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths)))
                     for r in [head] + rows)
    extra = [f"{k}: {v:.3f}" for k, v in c["ratios"].items() if ":torch_" in k]
    return text + ("\n" + "  ".join(extra) if extra else ""), c["ratios"]


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
