"""Per-request sampling in numpy: greedy, temperature, top-k, top-p, seeded.

Randomness is drawn from ``default_rng([seed, i])`` for the i-th output token, and every row is sampled
on its own, so the draw never depends on the batch: given the same logits, a seeded request gets the
same tokens whatever it was batched with and however often it was preempted.

The logits themselves are the same only when the runner is batch-invariant
(``ModelRunner.build(batch_invariant=True)``, ``scripts/serve.py --batch-invariant``; see
``jds.runner.invariant_buckets``). With the default bucket ladders a row's logits can differ in the
last bits with the step's token bucket (co-batching, chunked prefill, recompute after preemption), so
a greedy token at a near tie or a seeded draw near a probability boundary can change, and the rest of
that request diverges from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


def sample(logits: np.ndarray, params: SamplingParams, seed: int, index: int) -> int:
    """Draw one token id from float ``logits`` [V]; ``index`` is the output position (keys the RNG)."""
    logits = np.asarray(logits, np.float64)
    if params.greedy:
        return int(np.argmax(logits))
    x = logits / params.temperature
    v = x.shape[0]
    if 0 < params.top_k < v:
        cand = np.argpartition(-x, params.top_k - 1)[: params.top_k]
    else:
        cand = np.arange(v)
    # Descending by logit, ties by id, so the candidate order (and so the draw) is deterministic.
    cand = cand[np.lexsort((cand, -x[cand]))]
    z = x[cand] - x[cand[0]]
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(p)
        keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1  # smallest prefix with mass >= top_p
        cand, p = cand[:keep], p[:keep] / p[:keep].sum()
    rng = np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, index])
    i = int(np.searchsorted(np.cumsum(p), rng.random(), side="right"))
    return int(cand[min(i, len(cand) - 1)])
