"""Issue 18 diagnostic 2: on one device, (a) exact numerics (fp32, no quantisation) jds vs torch in every mode;
(b) serving numerics: jds vs torch against the model's own sensitivity: jds vs jds with every embedding entry
moved by one bf16 ulp (the size of difference any summation-order change can cause)."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

sys.path.insert(0, os.getcwd())
from tests.test_compare_torch import _compare, _jds_forward, _steps, NB  # noqa: E402
from jds.batch import make_batch  # noqa: E402
from jds.compare import TORCH_MODES  # noqa: E402
from jds.config import Numerics  # noqa: E402
from jds.model import Decoder, preset  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() / np.abs(np.asarray(b)).max())


def jds_logits(model, arch):
    cfg = model.cfg
    fwd = _jds_forward(model)
    caches = model.init_caches(NB)
    bt = np.arange(NB, dtype=np.int32).reshape(2, -1)
    rng = np.random.default_rng(1)
    out = []
    for chunks in _steps(arch):
        ids = rng.integers(0, 256, sum(c.num_tokens for c in chunks)).astype(np.int32)
        w = -(-max(c.start + c.num_tokens for c in chunks) // cfg.block_size)
        b = make_batch(chunks, bt[:, :w], cfg.block_size)
        lj, caches, tj = fwd(jnp.asarray(ids), b, caches, jnp.asarray(np.asarray(b.query_start_loc[1:]) - 1))
        out.append(np.asarray(lj))
    return out


def nudge(model, seed):
    w = np.asarray(model.embed.weight[...])
    bits = w.view(np.uint16).copy()
    step = np.random.default_rng(seed).choice(np.array([-1, 1], np.int16), size=bits.shape).astype(np.int32)
    nz = (bits & 0x7FFF) != 0
    bits = np.where(nz, (bits.astype(np.int32) + step).astype(np.uint16), bits)
    model.embed.weight.set_value(jnp.asarray(bits.view(w.dtype)))
    return model


report = {"device": dev}
for arch in ("v32", "v4"):
    r = {}
    ex = _compare(arch, Numerics.exact(), TORCH_MODES, moe=True, device=dev)
    r["exact_logits"] = [{m: rel(lt[m], lj) for m in lt} for lj, lt in ex["logits"]]
    r["exact_topk_differ"] = [{m: [int(sum(set(x[x >= 0].tolist()) != set(y[y >= 0].tolist()) for x, y in zip(a, b)))
                                   for a, b in zip(tj, tt[m])] for m in tt} for tj, tt in ex["topk"]]
    sv = _compare(arch, Numerics.serving(), ("eager",), device=dev)
    r["serving_jds_vs_torch"] = [rel(lt["eager"], lj) for lj, lt in sv["logits"]]
    base = [lj for lj, _ in sv["logits"]]
    cfg = preset(f"{arch}-tiny", numerics=Numerics.serving())
    r["serving_jds_nudged_vs_jds"] = {}
    for seed in range(4):
        lg = jds_logits(nudge(Decoder(cfg, seed=0, implementation="xla"), seed), arch)
        r["serving_jds_nudged_vs_jds"][seed] = [rel(a, b) for a, b in zip(lg, base)]
        r.setdefault("serving_argmax_equal_nudged", {})[seed] = [bool((a.argmax(-1) == b.argmax(-1)).all()) for a, b in zip(lg, base)]
    r["serving_argmax_equal_torch"] = [bool((lt["eager"].argmax(-1) == lj.argmax(-1)).all()) for lj, lt in sv["logits"]]
    report[arch] = r
    print(arch, json.dumps(r), flush=True)

with open(os.path.join(os.environ.get("OUT", "/tmp"), "torch_parity_gpu2.json"), "w") as f:
    json.dump(report, f, indent=1)
