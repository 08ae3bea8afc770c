"""Save / load a model's weights as a directory: ``manifest.json`` (name -> dtype, shape, byte range)
plus one ``weights.bin`` of raw little-endian bytes. Every dtype the model uses (bf16, fp32, e4m3)
round-trips bit-exactly; names are the DESIGN.md names (``layers.3.attn.wq_a``...).

Loading checks every name, shape and dtype against the model it loads into and raises ValueError
naming the first mismatch, so a checkpoint of another preset never loads silently.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx

from jds.nn import export_weights, load_weights

_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
           "int32": np.int32, "float16": np.float16}
FORMAT = "jds-weights-v1"


def save_checkpoint(model: nnx.Module, path: str, *, extra: dict[str, Any] | None = None) -> None:
    """Write ``model``'s parameters under directory ``path`` (created if needed)."""
    os.makedirs(path, exist_ok=True)
    weights = export_weights(model)
    manifest: dict[str, Any] = {"format": FORMAT, "tensors": {}, "extra": extra or {}}
    offset = 0
    with open(os.path.join(path, "weights.bin"), "wb") as f:
        for name in sorted(weights):
            arr = np.ascontiguousarray(weights[name])
            if arr.dtype.name not in _DTYPES:
                raise ValueError(f"weights[{name!r}]: dtype {arr.dtype} cannot be saved")
            data = arr.tobytes()
            f.write(data)
            manifest["tensors"][name] = {"dtype": arr.dtype.name, "shape": list(arr.shape), "offset": offset,
                                         "nbytes": len(data)}
            offset += len(data)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


def read_checkpoint(path: str) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory as numpy arrays (memory-mapped, no copy until used)."""
    mpath = os.path.join(path, "manifest.json")
    if not os.path.exists(mpath):
        raise ValueError(f"checkpoint {path!r}: no manifest.json (is it a jds checkpoint directory?)")
    with open(mpath) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path!r}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    blob = np.memmap(os.path.join(path, "weights.bin"), dtype=np.uint8, mode="r")
    out = {}
    for name, t in manifest["tensors"].items():
        if t["dtype"] not in _DTYPES:
            raise ValueError(f"checkpoint tensor {name!r}: unknown dtype {t['dtype']!r}")
        if t["offset"] + t["nbytes"] > blob.size:
            raise ValueError(f"checkpoint tensor {name!r}: byte range beyond weights.bin (truncated file?)")
        raw = blob[t["offset"]: t["offset"] + t["nbytes"]]
        out[name] = raw.view(_DTYPES[t["dtype"]]).reshape(t["shape"])
    return out


def load_checkpoint(model: nnx.Module, path: str) -> None:
    """Load a checkpoint into ``model`` in place (strict: same names, shapes and dtypes)."""
    load_weights(model, read_checkpoint(path), strict=True)
