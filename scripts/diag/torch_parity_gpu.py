"""Issue 18 diagnostic: why torch-on-CUDA and jds-on-GPU logits differ by 3-4% (V3.2 tiny, serving numerics).

Runs the comparison of tests/test_compare_torch.py under several precision settings and on both devices, and
prints, per step: max|dlogits|/max|logits| for every pair, top-k set differences per layer, and the fraction of
differing cache bytes per layer (the first diverging layer)."""
import contextlib
import json
import os
import sys

import jax
import numpy as np
import torch

sys.path.insert(0, os.getcwd())
from tests.test_compare_torch import _compare, _differ as topk_diff, _rel as rel  # noqa: E402
from jds.config import Numerics  # noqa: E402


def cache_bytes(res):
    """per layer: {name: (jds bytes, torch bytes)} after the last step."""
    arch = res["model"].cfg.arch
    out = []
    for i, c in enumerate(res["caches"]):
        pages = res["torch"]["eager"].cache_pages(i)
        d = {}
        for name, got in pages.items():
            j = np.asarray(getattr(c, name) if arch == "v4" else {"kv": c.kv, "index_k": c.index_k}[name])
            d[name] = float((got.view(np.uint8) != j.view(np.uint8)).mean())
        out.append(d)
    return out


def run(arch, device, jax_prec=None, torch_reduced=True, jax_dev=None):
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = torch_reduced
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = torch_reduced
    ctx = contextlib.ExitStack()
    if jax_prec:
        ctx.enter_context(jax.default_matmul_precision(jax_prec))
    if jax_dev is not None:
        ctx.enter_context(jax.default_device(jax_dev))
    with ctx:
        res = _compare(arch, Numerics.serving(), ("eager",), device=device)
    return res


report = {}
for arch in ("v32", "v4"):
    gpu = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script
    runs = {
        "gpu_default": run(arch, gpu),
        "gpu_highest_noreduced": run(arch, gpu, "highest", False),
        "cpu": run(arch, "cpu", jax_dev=jax.devices("cpu")[0]),
    }
    r = {}
    for name, res in runs.items():
        r[name] = {
            "jds_vs_torch_logits": [rel(lt["eager"], lj) for lj, lt in res["logits"]],
            "topk_differ_per_layer": [topk_diff(tj, tt["eager"]) for tj, tt in res["topk"]],
            "cache_byte_diff_frac": cache_bytes(res),
        }
    g, c = runs["gpu_default"], runs["cpu"]
    r["jds_gpu_vs_jds_cpu"] = [rel(a[0], b[0]) for a, b in zip(g["logits"], c["logits"])]
    r["torch_gpu_vs_torch_cpu"] = [rel(a[1]["eager"], b[1]["eager"]) for a, b in zip(g["logits"], c["logits"])]
    r["jds_gpu_vs_torch_cpu"] = [rel(a[0], b[1]["eager"]) for a, b in zip(g["logits"], c["logits"])]
    r["torch_gpu_vs_jds_cpu"] = [rel(a[1]["eager"], b[0]) for a, b in zip(g["logits"], c["logits"])]
    h = runs["gpu_highest_noreduced"]
    r["jds_gpu_highest_vs_default"] = [rel(a[0], b[0]) for a, b in zip(h["logits"], g["logits"])]
    r["torch_gpu_noreduced_vs_default"] = [rel(a[1]["eager"], b[1]["eager"]) for a, b in zip(h["logits"], g["logits"])]
    r["topk_jds_gpu_vs_cpu"] = [topk_diff(a[0], b[0]) for a, b in zip(g["topk"], c["topk"])]
    r["topk_torch_gpu_vs_cpu"] = [topk_diff(a[1]["eager"], b[1]["eager"]) for a, b in zip(g["topk"], c["topk"])]
    report[arch] = r
    print(arch, json.dumps(r), flush=True)

out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, "torch_parity_gpu.json"), "w") as f:
    json.dump(report, f, indent=1)
