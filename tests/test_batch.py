"""make_batch (vectorised) against a per-token construction, and its input errors."""

from __future__ import annotations

import numpy as np
import pytest

from jds.batch import Chunk, make_batch


def _naive(chunks: list[Chunk], bt: np.ndarray, bs: int) -> tuple[list[int], list[int], list[int]]:
    pos, req, slot = [], [], []
    for c in chunks:
        for p in range(c.start, c.start + c.num_tokens):
            pos.append(p)
            req.append(c.req)
            slot.append(int(bt[c.req, p // bs]) * bs + p % bs)
    return pos, req, slot


@pytest.mark.parametrize("seed", range(5))
def test_make_batch_matches_per_token_construction(seed: int) -> None:
    rng = np.random.default_rng(seed)
    r, nb, bs = 6, 8, 4
    bt = rng.permutation(r * nb).reshape(r, nb).astype(np.int32)
    rows = sorted(rng.choice(r, size=int(rng.integers(1, r + 1)), replace=False).tolist())
    chunks = []
    for q in rows:
        start = int(rng.integers(0, nb * bs - 1))
        chunks.append(Chunk(q, start, int(rng.integers(1, nb * bs - start + 1))))
    t = sum(c.num_tokens for c in chunks)
    b = make_batch(chunks, bt, bs, pad_to=t + 3, host=True)
    pos, req, slot = _naive(chunks, bt, bs)
    np.testing.assert_array_equal(b.positions, pos + [0, 0, 0])
    np.testing.assert_array_equal(b.req_idx, req + [0, 0, 0])
    np.testing.assert_array_equal(b.slot_mapping, slot + [-1, -1, -1])
    lens = np.zeros(r, np.int32)
    counts = np.zeros(r, np.int32)
    for c in chunks:
        lens[c.req], counts[c.req] = c.start + c.num_tokens, c.num_tokens
    np.testing.assert_array_equal(b.seq_lens, lens)
    np.testing.assert_array_equal(b.query_start_loc, np.concatenate([[0], np.cumsum(counts)]))


@pytest.mark.parametrize("chunks, match", [
    ([Chunk(3, 0, 1)], "outside block_tables rows"),
    ([Chunk(0, 0, 1), Chunk(0, 1, 1)], "appears twice"),
    ([Chunk(0, -1, 1)], "start must be >= 0"),
    ([Chunk(0, 0, 0)], "num_tokens >= 1"),
    ([Chunk(1, 0, 9)], "too short for position 8"),
    ([Chunk(1, 0, 1), Chunk(0, 0, 1)], "increasing request-row order"),
])
def test_make_batch_errors(chunks: list[Chunk], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_batch(chunks, np.zeros((2, 2), np.int32), 4)
