"""Demo: run a tiny V3.2 (and V4) attention layer over a mixed paged batch and show what the
lightning indexer selected per request, plus the output norms.

    python scripts/demo.py [--arch v32|v4|both] [--seed N]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jds.batch import Chunk, make_batch
from jds.bench.cli import int_at_least
from jds.config import Numerics, V32Config, V4Config


def run_v32(seed: int) -> None:
    from jds.v32 import V32Attention

    cfg = V32Config.tiny()
    layer = V32Attention(cfg, Numerics.serving(), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    bt = rng.permutation(16)[:12].reshape(3, 4).astype(np.int32)  # shuffled pages
    cache = layer.init_cache(16)
    lens = [24, 6, 13]
    xs = [rng.standard_normal((n, cfg.hidden_size)).astype(np.float32) for n in lens]
    print(f"DeepSeek-V3.2 attention, tiny config (H={cfg.n_heads}, top-k={cfg.index_topk}, "
          f"block={cfg.block_size}), FP8 656-byte MLA cache + 132-byte indexer cache")
    # step 1: prefill all three; step 2: one decode token each (a mixed batch of decodes)
    res = layer(jnp.asarray(np.concatenate([x[:-1] for x in xs]), jnp.bfloat16),
                make_batch([Chunk(i, 0, n - 1) for i, n in enumerate(lens)], bt, cfg.block_size), cache)
    res = layer(jnp.asarray(np.stack([x[-1] for x in xs]), jnp.bfloat16),
                make_batch([Chunk(i, n - 1, 1) for i, n in enumerate(lens)], bt, cfg.block_size), res.cache)
    for i, n in enumerate(lens):
        keys = sorted(int(k) for k in np.asarray(res.topk[i]) if k >= 0)
        print(f"  request {i}: decode at position {n - 1}: indexer selected {len(keys)}/{n} keys {keys}; "
              f"|y| = {float(jnp.linalg.norm(res.y[i].astype(jnp.float32))):.3f}")


def run_v4(seed: int) -> None:
    from jds.v4 import V4Attention

    cfg = V4Config.tiny()
    rng = np.random.default_rng(seed)
    lens = [300, 40, 130]
    xs = [rng.standard_normal((n, cfg.hidden_size)).astype(np.float32) for n in lens]
    bt = rng.permutation(12)[:9].reshape(3, 3).astype(np.int32)
    print(f"DeepSeek-V4 attention, tiny config (window={cfg.window_size}, C4 top-k={cfg.index_topk}), "
          f"FP8 584-byte records")
    for layer_id, ratio in enumerate(cfg.compress_ratios):
        layer = V4Attention(cfg, Numerics.serving(), layer_id, rngs=nnx.Rngs(seed))
        cache = layer.init_cache(12)
        res = layer(jnp.asarray(np.concatenate([x[:-1] for x in xs]), jnp.bfloat16),
                    make_batch([Chunk(i, 0, n - 1) for i, n in enumerate(lens)], bt, cfg.block_size), cache)
        res = layer(jnp.asarray(np.stack([x[-1] for x in xs]), jnp.bfloat16),
                    make_batch([Chunk(i, n - 1, 1) for i, n in enumerate(lens)], bt, cfg.block_size), res.cache)
        kind = {0: "window-only", 4: "C4 + indexer", 128: "C128"}[ratio]
        for i, n in enumerate(lens):
            sel = sorted(int(k) for k in np.asarray(res.topk[i]) if k >= 0) if res.topk.shape[1] else []
            extra = f"indexer picked compressed entries {sel} of {n // 4}; " if ratio == 4 else ""
            print(f"  layer {layer_id} ({kind}) request {i} pos {n - 1}: {extra}"
                  f"|y| = {float(jnp.linalg.norm(res.y[i].astype(jnp.float32))):.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", choices=["v32", "v4", "both"], default="both")
    ap.add_argument("--seed", type=int_at_least(0), default=0)  # numpy takes no negative seed
    a = ap.parse_args(argv)
    if a.arch in ("v32", "both"):
        run_v32(a.seed)
    if a.arch in ("v4", "both"):
        run_v4(a.seed)


if __name__ == "__main__":
    main()
