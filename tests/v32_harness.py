"""Shared harness for V3.2 parity tests: run the JAX layer over a multi-step mixed schedule and the
PyTorch oracle per request, and compare per token."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from jds.batch import Chunk, make_batch
from jds.config import Numerics, V32Config
from jds.nn import export_weights
from jds.v32 import V32Attention
from tests.reference.torch_v32 import TorchMLA


@dataclasses.dataclass
class Run:
    out: dict[int, np.ndarray]  # request -> [len, hidden] float32
    topk: dict[int, np.ndarray]  # request -> [len, K]
    scores: dict[int, np.ndarray]  # torch only: request -> [len, len] (final-call rows stitched)


def shuffled_tables(n_req: int, blocks_per_req: int, seed: int) -> tuple[np.ndarray, int]:
    """Non-contiguous, shuffled page ids (plus spare pages) for each request row."""
    num_blocks = n_req * blocks_per_req + 5
    perm = np.random.default_rng(seed).permutation(num_blocks)[: n_req * blocks_per_req]
    return perm.reshape(n_req, blocks_per_req).astype(np.int32), num_blocks


def _call(m: V32Attention, x: jax.Array, b, c):
    return m(x, b, c)


# one jit for every layer: layers of one config (graphdef) share the compiled steps of a shape
_jitted_call = nnx.jit(_call)


def run_jax(layer: V32Attention, xs: list[np.ndarray], schedule: list[list[Chunk]], seed: int = 0,
            jit: bool = False, pad: bool = False) -> Run:
    """``jit``: one compiled layer per step shape (on CPU several times faster than eager, which compiles
    every primitive of every step shape on its own); eager runs the same code op by op. ``pad``: every step
    padded to the schedule's largest with padding tokens (slot -1, as the runner's token buckets pad), so a
    jitted schedule compiles one shape; only the real tokens' outputs are read."""
    cfg = layer.cfg
    max_len = max(len(x) for x in xs)
    bt, nb = shuffled_tables(len(xs), -(-max_len // cfg.block_size) + 1, seed)
    cache = layer.init_cache(nb)
    out = {i: np.zeros((len(x), cfg.hidden_size), np.float32) for i, x in enumerate(xs)}
    topk = {i: np.zeros((len(x), cfg.index_topk), np.int32) for i, x in enumerate(xs)}
    fn = _jitted_call if jit else _call
    pad_to = max(sum(c.num_tokens for c in step) for step in schedule) if pad else None
    for step in schedule:
        batch = make_batch(step, bt, cfg.block_size, pad_to)
        x = np.concatenate([xs[c.req][c.start: c.start + c.num_tokens] for c in step])
        x = jnp.asarray(np.pad(x, ((0, batch.num_tokens - len(x)), (0, 0))), layer.dtype)
        if jit:  # the layer's eager input checks (skipped under jit) still see every step
            layer.check_inputs(x, batch, cache)
        res = fn(layer, x, batch, cache)
        cache = res.cache
        y, tk = np.asarray(res.y.astype(jnp.float32)), np.asarray(res.topk)
        o = 0
        for c in step:
            out[c.req][c.start: c.start + c.num_tokens] = y[o: o + c.num_tokens]
            topk[c.req][c.start: c.start + c.num_tokens] = tk[o: o + c.num_tokens]
            o += c.num_tokens
    return Run(out, topk, {})


def run_torch(cfg: V32Config, weights: dict, numerics: Numerics, xs: list[np.ndarray],
              schedule: list[list[Chunk]], form: str | None = None) -> Run:
    refs = {i: TorchMLA(cfg, weights, numerics, 1, len(x)) for i, x in enumerate(xs)}
    out = {i: np.zeros((len(x), cfg.hidden_size), np.float32) for i, x in enumerate(xs)}
    topk = {i: np.zeros((len(x), cfg.index_topk), np.int64) for i, x in enumerate(xs)}
    scores = {i: np.full((len(x), len(x)), -np.inf, np.float32) for i, x in enumerate(xs)}
    for step in schedule:
        for c in step:
            sl = slice(c.start, c.start + c.num_tokens)
            r = refs[c.req](torch.from_numpy(np.asarray(xs[c.req][sl], np.float32))[None], c.start, form=form)
            out[c.req][sl] = r["out"][0].float().numpy()
            topk[c.req][sl] = r["topk"][0].numpy()
            s = r["index_scores"][0].numpy()
            scores[c.req][sl, : s.shape[1]] = s
    return Run(out, topk, scores)


def make_layer(cfg: V32Config, numerics: Numerics, seed: int, form: str = "absorbed") -> tuple[V32Attention, dict]:
    layer = V32Attention(cfg, numerics, rngs=nnx.Rngs(seed), form=form)
    return layer, export_weights(layer)


def random_inputs(lengths: list[int], hidden: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, hidden)).astype(np.float32) for n in lengths]


def assert_sets_match(jax_topk: np.ndarray, ref_topk: np.ndarray, ref_scores: np.ndarray, rtol: float = 1e-5) -> int:
    """Selected sets must be equal except where the differing keys' reference scores tie (within rtol)
    with the k-th selected score. Returns the number of tie swaps seen."""
    swaps = 0
    for t in range(jax_topk.shape[0]):
        a = set(int(i) for i in jax_topk[t] if i >= 0)
        b = set(int(i) for i in ref_topk[t] if i >= 0)
        assert len(a) == len(b), f"token {t}: {len(a)} vs {len(b)} selected"
        if a == b:
            continue
        kth = min(ref_scores[t, i] for i in b)
        for i in a ^ b:
            assert abs(ref_scores[t, i] - kth) <= rtol * max(1.0, abs(kth)), (
                f"token {t}: key {i} differs (score {ref_scores[t, i]} vs k-th {kth}) — not a tie")
        swaps += 1
    return swaps


def max_rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
