"""Write a random-initialised model of a preset as a jds checkpoint directory (for serve.py --checkpoint).

    python scripts/make_checkpoint.py --preset v32-tiny --seed 0 --out /tmp/ckpt
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="v32-tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from jds.checkpoint import save_checkpoint
    from jds.model import Decoder
    from jds.runner import load_model_config

    cfg = load_model_config(a.preset, moe=a.moe)
    save_checkpoint(Decoder(cfg, seed=a.seed), a.out, extra={"preset": a.preset, "seed": a.seed, "moe": a.moe})
    print(f"wrote {a.out} ({cfg.arch}, {cfg.n_layers} layers)")


if __name__ == "__main__":
    main()
