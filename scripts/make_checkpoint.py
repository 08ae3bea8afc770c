"""Write a random-initialised model of a preset as a jds (orbax) checkpoint directory, config included.

    python scripts/make_checkpoint.py --preset v32-tiny --seed 0 --out /tmp/ckpt
    python scripts/serve.py --checkpoint /tmp/ckpt

An existing jds checkpoint at --out is replaced (atomically); any other existing directory is refused.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    from jds.bench.cli import add_moe_flags, moe_overrides

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v32-tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    add_moe_flags(ap)
    a = ap.parse_args(argv)
    if not a.out.strip():
        ap.error("--out must not be empty")
    from jds.checkpoint import save_checkpoint
    from jds.config import load_model_config
    from jds.model import Decoder

    moe = moe_overrides(a)
    cfg = load_model_config(a.preset, **moe)
    save_checkpoint(Decoder(cfg, seed=a.seed), a.out, extra={"preset": a.preset, "seed": a.seed, "moe": moe})
    print(f"wrote {a.out} ({cfg.arch}, {cfg.n_layers} layers)")


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
