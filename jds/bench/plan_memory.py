"""Per-device memory of a model on a (data, tensor, expert) mesh, from abstract shapes only (no weights).

    python scripts/plan_memory.py --tp 8 --ep 1 --batch 64 --context 8192    # DeepSeek-V3.2 on 8 devices
    python scripts/plan_memory.py --config HF_DIR/config.json --tp 2 --ep 4 --dp 1 --batch 64 --context 8192

The mesh has dp x tp x ep devices (jds's axes multiply; vLLM's expert parallelism reuses the tensor ranks).

Weights: every parameter of ``Decoder(cfg)`` as a runner holds it, with what it derives once (``serving_copy``: V3.2's
dequantised W_UK / W_UV beside an FP8 ``wkv_b``) (the model under ``nnx.eval_shape``: FP8 linears and
routed experts as e4m3 + block scales, as an FP8 V3.2 checkpoint imports; bf16 with ``--dequantize``; norms in
float32), split by the partition rules of
``jds.sharding`` (the same ``param_spec`` the runner places them with; a split that does not divide is
dropped, as there). KV pages: ``batch`` requests of ``context`` tokens in each layer's page formats, pages
split over ``data`` and whole on every tensor / expert rank (the layout of ``jds.sharding``: MLA latent and
indexer caches are replicated over ``tensor``). Activations: an estimate of the largest step's live buffers
(named terms, not a measurement). The built-in model is DeepSeek-V3.2 at its released dims with every layer
MoE (the release's first 3 layers are dense, so the expert bytes are an overestimate of 3/61).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any

from jds.bench.cli import positive_float, positive_int

GIB = 2**30


class _MeshShape:
    """The axis sizes ``jds.sharding.param_spec`` reads (``mesh.shape``), without devices."""

    def __init__(self, dp: int, tp: int, ep: int) -> None:
        self.shape = {"data": dp, "tensor": tp, "expert": ep}


def deepseek_v32() -> Any:
    """DeepSeek-V3.2 at the released dims (config.json of deepseek-ai/DeepSeek-V3.2-Exp): 61 layers, 256
    routed experts of width 2048 (top 8) + 1 shared, vocabulary 129280, FP8 linears and routed experts (as its
    checkpoint imports: ``jds.hf_import``)."""
    from jds.config import ModelConfig, Numerics, V32Config

    return ModelConfig("v32", V32Config(), n_layers=61, vocab_size=129280, intermediate_size=18432,
                       n_routed_experts=256, n_shared_experts=1, moe_topk=8, moe_intermediate_size=2048,
                       numerics=dataclasses.replace(Numerics.reference(), experts_fp8=True))


def _abstract(cfg: Any) -> Any:
    """``Decoder(cfg)`` as a runner holds it (``jds.runner.serving_copy``: with what it derives once, V3.2's
    dequantised W_UK / W_UV), shapes only (``nnx.eval_shape``): parameters in the dtypes jds holds them."""
    from flax import nnx

    from jds.model import Decoder
    from jds.runner import serving_copy

    return nnx.eval_shape(lambda: serving_copy(Decoder(cfg), None))


def weight_bytes(cfg: Any, dp: int, tp: int, ep: int) -> dict[str, float]:
    """Per-device bytes of the parameters, by family, and the total (one device of the mesh): each leaf of the
    abstract model's state split by ``jds.sharding.param_spec`` at its own path, as the runner places it."""
    import jax
    from flax import nnx

    from jds.sharding import param_spec

    mesh = _MeshShape(dp, tp, ep)
    sizes = {"data": dp, "tensor": tp, "expert": ep}
    out: dict[str, float] = {}
    for key, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(_abstract(cfg)))[0]:
        path = jax.tree_util.keystr(key, simple=True, separator="/")
        spec = param_spec(path, tuple(leaf.shape), cfg, mesh)
        nbytes = leaf.size * leaf.dtype.itemsize / math.prod(sizes[a] for a in spec if a is not None)
        fam = ("routed experts" if leaf.ndim == 3 else "embedding + head" if path.startswith(("embed", "head"))
               else "attention" if "/attn/" in path else "ffn (dense / shared)" if "/ffn/" in path else "norms")
        out[fam] = out.get(fam, 0.0) + nbytes
    out["total"] = sum(out.values())
    return out


def kv_bytes(cfg: Any, dp: int, batch: int, context: int) -> dict[str, float]:
    """Per-device bytes of the page pools for ``batch`` x ``context`` tokens (pages split over ``data``)."""
    import jax

    model = _abstract(cfg)
    pages = batch * math.ceil(context / cfg.block_size)
    caches = jax.eval_shape(lambda: model.init_caches(1))
    per_page = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(caches))
    return {"pages": pages, "bytes_per_page_all_layers": per_page, "total": pages * per_page / dp}


def activation_bytes(cfg: Any, tokens: int, context: int, dp: int, tp: int) -> dict[str, float]:
    """An estimate of the live buffers of the largest step (``tokens`` rows, keys up to ``context``): terms are
    named so the assumption is visible. bf16 activations, float32 scores."""
    a = cfg.attn
    t = tokens / dp
    heads = a.n_heads / tp
    width = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(cfg.moe_topk, 1)) / tp
    terms = {
        "hidden state (residual + normed, bf16)": 2 * t * a.hidden_size * 2,
        "q / absorbed q (bf16)": t * heads * (a.kv_lora_rank + a.qk_rope_head_dim) * 2,
        "indexer scores (fp32, one chunk of all keys)": t * context * 4,
        "top-k indices (int32)": t * a.index_topk * 4,
        "ffn intermediate (bf16, w1 and w3 outputs)": 2 * t * width * 2,
        "logits (fp32, one row per request)": 0.0,
    }
    terms["total"] = sum(terms.values())
    return terms


def plan(cfg: Any, dp: int, tp: int, ep: int, batch: int, context: int, tokens: int,
         hbm_gib: float) -> dict[str, Any]:
    from jds.config import RunnerConfig
    from jds.sharding import check_divisible

    check_divisible(cfg, RunnerConfig(tensor_parallel=tp, data_parallel=dp, expert_parallel=ep,
                                      num_blocks=dp * max(1, batch)))
    w = weight_bytes(cfg, dp, tp, ep)
    kv = kv_bytes(cfg, dp, batch, context)
    act = activation_bytes(cfg, tokens, context, dp, tp)
    act["logits (fp32, one row per request)"] = batch / dp * cfg.vocab_size * 4
    act["total"] = sum(v for k, v in act.items() if k != "total")
    total = w["total"] + kv["total"] + act["total"]
    return {"weights": w, "kv": kv, "activations": act, "per_device_total": total, "hbm_bytes": hbm_gib * GIB,
            "fits": total <= hbm_gib * GIB}


def render(res: dict[str, Any], head: str) -> str:
    g = lambda b: f"{b / GIB:8.2f} GiB"  # noqa: E731
    lines = [head, "", "per device:"]
    for fam, b in res["weights"].items():
        if fam != "total":
            lines.append(f"  weights  {fam:<44} {g(b)}")
    lines.append(f"  weights  {'total':<44} {g(res['weights']['total'])}")
    kv = res["kv"]
    lines.append(f"  KV pages {kv['pages']} pages x {kv['bytes_per_page_all_layers'] / 2**20:.2f} MiB (all layers)"
                 f"{'':<6} {g(kv['total'])}")
    for k, b in res["activations"].items():
        if k != "total":
            lines.append(f"  act      {k:<44} {g(b)}")
    lines.append(f"  act      {'total (estimate)':<44} {g(res['activations']['total'])}")
    lines.append(f"  {'TOTAL':<53} {g(res['per_device_total'])}  of {res['hbm_bytes'] / GIB:.0f} GiB: "
                 f"{'fits' if res['fits'] else 'DOES NOT FIT'}")
    return "\n".join(lines)


def model_config(config: str | None, dequantize: bool) -> Any:
    """The planned model: a HF config.json (or its directory), else ``deepseek_v32()``; ``dequantize``: the FP8
    linears and routed experts held in bf16 (as a ``--dequantize`` import holds them)."""
    if config:
        from jds.hf_import import hf_model_config

        # the headers are not read here: the routed experts are taken as stored like the linears (FP8 V3.2)
        return hf_model_config(config, dequantize=dequantize, stored_experts="F8_E4M3")
    cfg = deepseek_v32()
    if dequantize:
        cfg = dataclasses.replace(cfg, numerics=dataclasses.replace(cfg.numerics, fp8_linear=False,
                                                                    experts_fp8=False))
    return cfg


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="a HF config.json (or its directory); default: DeepSeek-V3.2")
    ap.add_argument("--dequantize", action="store_true", help="the FP8 linears and routed experts held in bf16 (--dequantize import)")
    ap.add_argument("--tp", type=positive_int, default=8)
    ap.add_argument("--ep", type=positive_int, default=1)
    ap.add_argument("--dp", type=positive_int, default=1)
    ap.add_argument("--batch", type=positive_int, default=64, help="requests resident at once")
    ap.add_argument("--context", type=positive_int, default=8192, help="tokens per request")
    ap.add_argument("--max-num-tokens", type=positive_int, default=8192, help="rows of the largest step")
    ap.add_argument("--hbm-gib", type=positive_float, default=141.0, help="memory per device (H200: 141 GB)")
    a = ap.parse_args(argv)
    try:  # an unreadable --config, a mesh that does not divide the model: one line naming the field
        cfg = model_config(a.config, a.dequantize)
        res = plan(cfg, a.dp, a.tp, a.ep, a.batch, a.context, a.max_num_tokens, a.hbm_gib)
    except ValueError as e:
        ap.error(str(e))
    label = a.config or "DeepSeek-V3.2 (built-in dims)"
    head = (f"{label}: {cfg.n_layers} layers, {cfg.n_routed_experts} routed experts; mesh data={a.dp} "
            f"tensor={a.tp} expert={a.ep} ({a.dp * a.tp * a.ep} devices: the axes multiply); {a.batch} requests x "
            f"{a.context} tokens; fp8_linear="
            f"{cfg.numerics.fp8_linear}, routed experts "
            f"{'fp8' if cfg.numerics.experts_fp8 else 'fp4' if cfg.numerics.experts_fp4 else 'bf16'}")
    print(render(res, head))
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
