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
        if not -2**31 <= self.top_k < 2**31:  # a step's rows hold it as int32 (SamplingRows); >= vocab: off
            raise ValueError(f"top_k must fit int32 (>= the vocabulary size keeps every token), got {self.top_k}")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:  # the RNG is keyed by the seed's 64 bits
            raise ValueError(f"seed must be a 64-bit integer in [-2^63, 2^63), got {self.seed}")

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


@dataclass(frozen=True)
class SamplingRows:
    """One step's sampling parameters, one entry per request row (what a runner's ``submit`` samples with).

    Plain numpy so the engine stays free of JAX; a runner moves them to its device. ``index`` is the
    output position of the token each row samples (it keys the RNG together with ``seed``).
    """

    greedy: np.ndarray  # [R] bool
    temperature: np.ndarray  # [R] float64 (exactly the request's value; a device casts)
    top_k: np.ndarray  # [R] int32, <= 0: off
    top_p: np.ndarray  # [R] float64
    seed: np.ndarray  # [R] uint64
    index: np.ndarray  # [R] int32

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], indices: list[int]) -> "SamplingRows":
        return cls(greedy=np.fromiter((p.greedy for p in params), bool, len(params)),
                   temperature=np.fromiter((p.temperature for p in params), np.float64, len(params)),
                   top_k=np.fromiter((p.top_k for p in params), np.int32, len(params)),
                   top_p=np.fromiter((p.top_p for p in params), np.float64, len(params)),
                   seed=np.fromiter((s & 0xFFFFFFFFFFFFFFFF for s in seeds), np.uint64, len(seeds)),
                   index=np.fromiter(indices, np.int32, len(indices)))

    def __len__(self) -> int:
        return int(self.greedy.shape[0])

    def params(self, row: int) -> SamplingParams:
        """The row's rules as ``SamplingParams`` (for the host sampler)."""
        return SamplingParams(temperature=float(self.temperature[row]), top_k=int(self.top_k[row]),
                              top_p=float(self.top_p[row]))


def sample_rows(logits: np.ndarray, rows: SamplingRows) -> np.ndarray:
    """Host reference of a runner's device sampling: ``sample`` per row, greedy rows by one argmax."""
    logits = np.asarray(logits)
    out = logits.argmax(axis=-1).astype(np.int32)
    for i in np.flatnonzero(~rows.greedy):
        out[i] = sample(logits[i], rows.params(int(i)), int(rows.seed[i]), int(rows.index[i]))
    return out
