"""Issue 18 diagnostic 2: on one device, (a) exact numerics (fp32, no quantisation) jds vs torch in every mode;
(b) serving numerics: jds vs torch against the model's own sensitivity: jds vs jds with every embedding entry
moved by one bf16 ulp (the size of difference any summation-order change can cause).

The pieces are tests/test_compare_torch.py's (the GPU tests assert on the same quantities)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from tests.test_compare_torch import _compare, _differ, _jds_run, _model, _rel, _ulp_nudged  # noqa: E402
from jds.compare import TORCH_MODES  # noqa: E402
from jds.config import Numerics  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
report = {"device": dev}
for arch in ("v32", "v4"):
    r = {}
    ex = _compare(arch, Numerics.exact(), TORCH_MODES, moe=True, device=dev)
    r["exact_logits"] = [{m: _rel(lt[m], lj) for m in lt} for lj, lt in ex["logits"]]
    r["exact_topk_differ"] = [{m: _differ(tj, tt[m]) for m in tt} for tj, tt in ex["topk"]]
    sv = _compare(arch, Numerics.serving(), ("eager",), device=dev)
    r["serving_jds_vs_torch"] = [_rel(lt["eager"], lj) for lj, lt in sv["logits"]]
    base = [lj for lj, _ in sv["logits"]]
    r["serving_jds_nudged_vs_jds"], r["serving_argmax_equal_nudged"] = {}, {}
    for seed in range(4):
        lg, _, _ = _jds_run(_ulp_nudged(_model(arch, Numerics.serving(), False), seed), arch)
        r["serving_jds_nudged_vs_jds"][seed] = [_rel(a, b) for a, b in zip(lg, base)]
        r["serving_argmax_equal_nudged"][seed] = [bool((a.argmax(-1) == b.argmax(-1)).all()) for a, b in zip(lg, base)]
    r["serving_argmax_equal_torch"] = [bool((lt["eager"].argmax(-1) == lj.argmax(-1)).all()) for lj, lt in sv["logits"]]
    report[arch] = r
    print(arch, json.dumps(r), flush=True)

with open(os.path.join(os.environ.get("OUT", "/tmp"), "torch_parity_gpu2.json"), "w") as f:
    json.dump(report, f, indent=1)
