"""Convert a HuggingFace DeepSeek-V3.2 / V4 checkpoint directory into a jds orbax checkpoint.

    python scripts/convert_checkpoint.py HF_DIR OUT_DIR [--layers N] [--dequantize] [--numerics reference]
                                         [--override block_size=64] [--numerics-field experts_fp8=true]
                                         [--overwrite] [--shard-mb 1024]

HF_DIR holds config.json and *.safetensors (with or without model.safetensors.index.json). FP8 weights keep
their e4m3 bits and 128x128 scales (a model with fp8_linear on) unless --dequantize, which writes bf16 weights
(fp8_linear off). --layers N keeps the first N layers (the written config has n_layers=N). Tensors are read
one at a time (memory-mapped) and written to orbax shards of about --shard-mb; every name / shape / dtype is
checked from the headers first, and on any error no OUT_DIR is left behind. The checkpoint's
quantization_config (fmt, scale_fmt, weight_block_size, activation_scheme) is validated, printed and stored in
the output; a scale_fmt jds does not implement (plain amax/448 activation scales) is refused. Serve the result with
``scripts/serve.py --checkpoint OUT_DIR``. The name mapping is documented in jds/hf_import.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jds.bench.cli import positive_float


def _override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--override {text!r}: expected KEY=VALUE")
    k, v = text.split("=", 1)
    try:
        return k.strip(), json.loads(v)
    except json.JSONDecodeError:
        return k.strip(), v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", help="HF checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("out", help="output jds checkpoint directory (must not exist unless --overwrite)")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument("--dequantize", action="store_true", help="dequantise FP8 weights to bf16 (fp8_linear off)")
    ap.add_argument("--numerics", default="reference", choices=["reference", "bf16", "serving", "exact"],
                    help="jds Numerics preset of the written config (fp8_linear follows the weights)")
    ap.add_argument("--override", type=_override, action="append", default=[], metavar="KEY=VALUE",
                    help="set a ModelConfig / attention-config field config.json lacks, e.g. block_size=64")
    ap.add_argument("--numerics-field", action="append", default=[], metavar="FIELD=VALUE",
                    help="set a Numerics field (an explicit departure or opt-in), e.g. experts_fp8=true")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing jds checkpoint at OUT")
    ap.add_argument("--shard-mb", type=positive_float, default=1024.0, help="orbax shard size (memory bound), MiB")
    ap.add_argument("--allow-unexpected", action="store_true",
                    help="skip HF tensors that have no place in the jds model instead of failing")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = ap.parse_args(argv)
    for name, v in (("hf_dir", a.hf_dir), ("out", a.out)):
        if not v.strip():
            ap.error(f"{name} must not be empty")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the conversion; raises ValueError (naming the tensor or field) on bad input."""
    a = parse_args(argv)
    from jds.bench.cli import numerics_fields
    from jds.hf_import import convert_hf_checkpoint, describe_quantization

    rep = convert_hf_checkpoint(a.hf_dir, a.out, layers=a.layers, dequantize=a.dequantize, numerics=a.numerics,
                                overrides=dict(a.override), numerics_overrides=numerics_fields(a.numerics_field) or None,
                                overwrite=a.overwrite,
                                shard_bytes=max(1, int(a.shard_mb * 2**20)), allow_unexpected=a.allow_unexpected,
                                progress=not a.no_progress)
    cfg = rep["config"]
    print(f"wrote {rep['out']}: {cfg.arch}, {cfg.n_layers} layers, {rep['tensors']} tensors, "
          f"{rep['bytes'] / 2**20:.1f} MiB, fp8_linear={cfg.numerics.fp8_linear}, {rep['seconds']:.1f}s")
    print(f"  {describe_quantization(rep['quantization'])}")
    for why, names in rep["skipped"].items():
        print(f"  skipped {len(names)} HF tensors ({why}), e.g. {names[0]}")
    return rep


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
