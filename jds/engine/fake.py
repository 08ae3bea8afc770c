"""A deterministic stand-in for ``jds.runner.ModelRunner`` (no JAX): engine and server tests run fast.

It keeps a real paged "KV cache" (the token id written at each slot) and computes each chunk's logits
from the tokens it reads back through the block table, so a scheduler or block-manager bug that
loses, overwrites or mis-addresses a page changes the output, as it would with the real model.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from jds.batch import Chunk
from jds.engine.sampling import SamplingRows, sample_rows

_MASK = (1 << 61) - 1


class FakeRunner:
    def __init__(self, *, block_size: int = 4, num_blocks: int = 64, vocab_size: int = 512,
                 max_model_len: int = 256, max_num_tokens: int = 64, max_num_seqs: int = 8,
                 eos_token_id: int = 257, step_delay: float = 0.0, eos_bias: float = 0.0,
                 warmup_delay: float = 0.0, warmup_buckets: int = 4) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.eos_token_id = eos_token_id
        self.step_delay = step_delay
        self.eos_bias = eos_bias
        self.warmup_delay = warmup_delay  # total seconds the fake "compile" takes (shutdown tests)
        self.warmup_buckets = warmup_buckets
        self.cache = np.full(num_blocks * block_size, -1, np.int64)
        self.num_calls = 0
        self._prev_sampled: np.ndarray | None = None  # the last submitted step's tokens (placeholder source)

    def warmup(self, progress: Callable[[str], None] | None = None) -> None:
        """Nothing to compile; with ``warmup_delay`` it sleeps in ``warmup_buckets`` parts and reports
        each, like ``ModelRunner.warmup``, so a test can land a signal inside a warm-up."""
        if not self.warmup_delay:
            if progress:
                progress("fake runner: nothing to compile")
            return
        for n in range(1, self.warmup_buckets + 1):
            time.sleep(self.warmup_delay / self.warmup_buckets)
            if progress:
                progress(f"fake bucket {n}/{self.warmup_buckets}")

    def _context_logits(self, ctx: np.ndarray) -> np.ndarray:
        h = 1469598103934665603
        for t in ctx.tolist():
            h = (h * 1099511628211 + int(t) + 7) & _MASK
        logits = np.random.default_rng(h).standard_normal(self.vocab_size).astype(np.float32) * 3.0
        logits[self.eos_token_id] += self.eos_bias
        return logits

    def execute(self, token_ids: np.ndarray, chunks: list[Chunk], block_tables: np.ndarray) -> np.ndarray:
        self.num_calls += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        token_ids = np.asarray(token_ids)
        bs = self.block_size
        if token_ids.shape[0] != sum(c.num_tokens for c in chunks):
            raise ValueError("token_ids length != sum of chunk lengths")
        if token_ids.shape[0] > self.max_num_tokens or len(chunks) > self.max_num_seqs:
            raise ValueError("step exceeds the compiled token / row budget")
        if [c.req for c in chunks] != sorted({c.req for c in chunks}):
            raise ValueError("chunks must be sorted by row, one per row")
        out = np.zeros((len(chunks), self.vocab_size), np.float32)
        off = 0
        for i, c in enumerate(chunks):
            end = c.start + c.num_tokens
            if end > self.max_model_len:
                raise ValueError("position beyond max_model_len")
            pos = np.arange(end)
            pages = block_tables[c.req, pos // bs]
            if (pages < 0).any() or (pages >= self.num_blocks).any():
                raise ValueError(f"row {c.req}: block table does not cover {end} tokens")
            slots = pages * bs + pos % bs
            self.cache[slots[c.start:]] = token_ids[off:off + c.num_tokens]
            off += c.num_tokens
            ctx = self.cache[slots]
            if (ctx < 0).any():
                raise ValueError(f"row {c.req}: reads a slot never written")
            out[i] = self._context_logits(ctx)
        return out

    def submit(self, token_ids: np.ndarray, chunks: list[Chunk], block_tables: np.ndarray,
               sampling: SamplingRows, feed: np.ndarray) -> "DonePending":
        """The async-step contract of ``jds.runner.BoundaryRunner.submit``, computed eagerly.

        A token id -1 is a placeholder for the token sampled by row ``feed[i]`` of the previously submitted
        step; the runner resolves it itself (the engine never saw that token). Errors raise here.
        """
        tokens = resolve_placeholders(token_ids, feed, self._prev_sampled)
        if len(sampling) != len(chunks):
            raise ValueError(f"sampling has {len(sampling)} rows for {len(chunks)} chunks")
        sampled = sample_rows(self.execute(tokens, chunks, block_tables), sampling)
        self._prev_sampled = sampled
        return DonePending(sampled)

    def reference_logits(self, tokens: list[int]) -> np.ndarray:
        """The logits the fake produces after ``tokens`` when its cache is intact (for tests)."""
        return self._context_logits(np.asarray(tokens))


class DonePending:
    """A step whose sampled tokens are already on the host."""

    def __init__(self, tokens: np.ndarray) -> None:
        self._tokens = tokens

    def result(self) -> np.ndarray:
        return self._tokens


def resolve_placeholders(token_ids: np.ndarray, feed: np.ndarray, prev: np.ndarray | None) -> np.ndarray:
    """Host version of the device-side feed: token -1 at i becomes ``prev[feed[i]]``; checks the contract."""
    tokens = np.asarray(token_ids, np.int64).copy()
    feed = np.asarray(feed)
    if feed.shape != tokens.shape:
        raise ValueError(f"feed has shape {feed.shape}, token_ids {tokens.shape}")
    hole = tokens == -1
    if (hole != (feed >= 0)).any():
        raise ValueError("feed must be >= 0 exactly where token_ids holds the placeholder -1")
    if hole.any():
        if prev is None:
            raise ValueError("token_ids holds placeholders but no step was submitted before")
        if feed[hole].max() >= prev.shape[0]:
            raise ValueError(f"feed names row {int(feed[hole].max())} of a step with {prev.shape[0]} rows")
        tokens[hole] = prev[feed[hole]]
    return tokens
