"""Bad inputs to the V3.2 layer and the paged-batch builders raise ValueError with a clear message.

The checks are eager (V32Attention.check_inputs -> jds.batch.validate_batch); under jit they are skipped
because the values are abstract, which the last test pins down.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jds.batch import Chunk, PagedBatch, make_batch, replace, validate_batch
from jds.config import Numerics, V32Config
from jds.ops.paging import empty_cache
from jds.ops.records import IndexerRecord132, MlaRecord656
from jds.v32 import V32Attention, V32Cache

CFG = V32Config.tiny()  # hidden 256, block_size 16, max_seq_len 2048
BS = CFG.block_size
NB = 8  # pages in the pool
TABLES = np.array([[5, 2, 7], [0, 6, 3]], np.int32)  # shuffled pages of two request rows


@pytest.fixture(scope="module")
def layer() -> V32Attention:
    return V32Attention(CFG, Numerics.exact(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def cache(layer: V32Attention) -> V32Cache:
    return layer.init_cache(NB)


def good_batch() -> PagedBatch:
    """Row 0: a 5-token prefill; row 1: 3 tokens at positions 17..19 (a chunk after an earlier one)."""
    return make_batch([Chunk(0, 0, 5), Chunk(1, 17, 3)], TABLES, BS)


def x_for(batch: PagedBatch, hidden: int = CFG.hidden_size, seed: int = 0) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((batch.num_tokens, hidden)), jnp.float32)


def check(layer: V32Attention, cache: V32Cache, batch: PagedBatch, match: str, x=None) -> None:
    """The layer's eager entry point raises ValueError whose message matches ``match``."""
    with pytest.raises(ValueError, match=match):
        layer(x_for(batch) if x is None else x, batch, cache)


def with_array(batch: PagedBatch, field: str, index, value) -> PagedBatch:
    a = np.array(getattr(batch, field))
    a[index] = value
    return replace(batch, **{field: jnp.asarray(a)})


# ------------------------------------------------------------------------------------------
# the layer's input checks
# ------------------------------------------------------------------------------------------


def test_good_batch_passes_checks(layer, cache) -> None:
    """The baseline every other test corrupts in one place (the layer itself runs in test_layer_under_jit)."""
    b = good_batch()
    np.testing.assert_array_equal(np.asarray(b.slot_mapping), [80, 81, 82, 83, 84, 97, 98, 99])
    np.testing.assert_array_equal(np.asarray(b.seq_lens), [5, 20])
    np.testing.assert_array_equal(np.asarray(b.query_start_loc), [0, 5, 8])
    layer.check_inputs(x_for(b), b, cache)
    padded = make_batch([Chunk(0, 0, 5), Chunk(1, 17, 3)], TABLES, BS, pad_to=12)  # padding: slot -1
    np.testing.assert_array_equal(np.asarray(padded.slot_mapping)[8:], -1)
    layer.check_inputs(x_for(padded), padded, cache)


def test_x_wrong_hidden_size(layer, cache) -> None:
    b = good_batch()
    check(layer, cache, b, r"x must be \[T, hidden_size=256\], got shape \(8, 128\)", x_for(b, 128))
    check(layer, cache, b, r"hidden_size=256", jnp.zeros((8 * 256,), jnp.float32))


def test_token_count_mismatch(layer, cache) -> None:
    b = good_batch()
    check(layer, cache, b, "8 tokens but the hidden states have 9", jnp.zeros((9, 256), jnp.float32))
    check(layer, cache, b, "8 tokens but the hidden states have 7", jnp.zeros((7, 256), jnp.float32))


def test_position_beyond_max_seq_len(layer, cache) -> None:
    check(layer, cache, with_array(good_batch(), "positions", 0, CFG.max_seq_len),
          r"position outside \[0, max_seq_len=2048\)")
    check(layer, cache, with_array(good_batch(), "positions", 2, -1), "position outside")
    # a position at or beyond its request's seq_len (keys it could not see)
    check(layer, cache, with_array(good_batch(), "positions", 4, 5), "at or beyond its request's seq_len")


def test_slot_outside_pool(layer, cache) -> None:
    check(layer, cache, with_array(good_batch(), "slot_mapping", 3, NB * BS),
          r"slot_mapping holds a slot outside the pool of 128 slots")
    check(layer, cache, with_array(good_batch(), "slot_mapping", 3, -2), "outside the pool")


def test_block_table_too_short(layer, cache) -> None:
    with pytest.raises(ValueError, match="block_tables row 0 is too short for position 48"):
        make_batch([Chunk(0, 40, 9)], TABLES, BS)  # position 48 needs a 4th page
    b = with_array(good_batch(), "seq_lens", 0, 3 * BS + 1)
    check(layer, cache, b, r"block_tables is too short: 3 blocks of 16 cannot hold seq_len 49")


def test_page_outside_pool(layer, cache) -> None:
    # a decode at position 20 of row 0 reads pages 0..1 of its table; page 0 is outside the pool
    for bad in (NB, NB + 3, -1):
        t = TABLES.copy()
        t[0, 0] = bad
        b = make_batch([Chunk(0, 20, 1)], t, BS)
        check(layer, cache, b, rf"block_tables row 0 holds a page outside \[0, {NB}\)")
    # the token's own page outside the pool: its slot is out of the pool too
    t = TABLES.copy()
    t[1, 1] = NB + 1
    check(layer, cache, make_batch([Chunk(1, 17, 3)], t, BS), "outside the pool")
    # table entries past the pages a request needs are not read and may hold anything
    t = TABLES.copy()
    t[0, 2] = -1
    validate_batch(make_batch([Chunk(0, 20, 1)], t, BS), num_blocks=NB, block_size=BS, max_seq_len=2048)


def test_slot_mapping_disagrees_with_block_table(layer, cache) -> None:
    b = good_batch()
    s = np.array(b.slot_mapping)
    s[[0, 1]] = s[[1, 0]]  # two tokens' slots swapped: both in the pool, both wrong
    check(layer, cache, replace(b, slot_mapping=jnp.asarray(s)), "slot_mapping disagrees with block_tables")
    check(layer, cache, with_array(b, "slot_mapping", 6, 3 * BS + 2), "disagrees with block_tables")


def test_duplicate_request_rows(layer, cache) -> None:
    with pytest.raises(ValueError, match="chunk.req=0 appears twice"):
        make_batch([Chunk(0, 0, 3), Chunk(0, 3, 2)], TABLES, BS)
    with pytest.raises(ValueError, match="increasing request-row order"):
        make_batch([Chunk(1, 0, 3), Chunk(0, 0, 2)], TABLES, BS)
    with pytest.raises(ValueError, match="chunk.req=2 outside block_tables rows"):
        make_batch([Chunk(2, 0, 3)], TABLES, BS)
    with pytest.raises(ValueError, match="num_tokens >= 1"):
        make_batch([Chunk(0, 0, 0)], TABLES, BS)
    with pytest.raises(ValueError, match="pad_to=4 is smaller than the 8 tokens"):
        make_batch([Chunk(0, 0, 5), Chunk(1, 17, 3)], TABLES, BS, pad_to=4)
    # a hand-built batch repeating a request row's token writes one slot twice
    b = good_batch()
    dup = replace(b, positions=b.positions.at[1].set(0), slot_mapping=b.slot_mapping.at[1].set(b.slot_mapping[0]))
    check(layer, cache, dup, "writes slot 80 more than once")


def test_cache_of_wrong_shape(layer, cache) -> None:
    b = good_batch()
    bad = [
        V32Cache(kv=cache.kv[:, :-1], index_k=cache.index_k),  # record width
        V32Cache(kv=cache.kv, index_k=cache.index_k[:-1]),  # page counts differ
        V32Cache(kv=cache.kv.reshape(NB, BS, -1), index_k=cache.index_k),  # [blocks, bs, D] instead of flat pages
        V32Cache(kv=empty_cache(MlaRecord656(BS), NB), index_k=empty_cache(IndexerRecord132(BS), NB)),  # fp8 bytes
    ]
    for c in bad:
        with pytest.raises(ValueError, match="cache shapes .* do not match this layer's formats"):
            layer(x_for(b), b, c)


def test_malformed_batch_arrays(layer, cache) -> None:
    b = good_batch()
    check(layer, cache, replace(b, req_idx=b.req_idx[:-1]), r"batch.req_idx has shape \(7,\), expected \(8,\)")
    check(layer, cache, replace(b, slot_mapping=b.slot_mapping[:, None]), "batch.slot_mapping has shape")
    check(layer, cache, replace(b, block_tables=b.block_tables.reshape(-1)), "block_tables must be 2-D")
    check(layer, cache, replace(b, seq_lens=b.seq_lens[:1]), r"batch.seq_lens has shape \(1,\), expected \(2,\)")
    check(layer, cache, replace(b, query_start_loc=b.query_start_loc[:2]), r"query_start_loc must have shape \(3,\)")
    check(layer, cache, with_array(b, "req_idx", 0, 2), "req_idx holds a row outside block_tables")


# ------------------------------------------------------------------------------------------
# jit
# ------------------------------------------------------------------------------------------


def test_layer_under_jit(layer, cache) -> None:
    """Under jit the layer matches eager; check_inputs is skipped there (documented), so validate first."""
    b = good_batch()
    x = x_for(b, seed=3)
    fn = nnx.jit(lambda m, x, b, c: m(x, b, c))
    eager = layer(x, b, cache)
    jitted = fn(layer, x, b, cache)
    y0, y1 = np.asarray(eager.y), np.asarray(jitted.y)
    assert y1.shape == (8, CFG.hidden_size) and jitted.topk.shape == (8, CFG.index_topk)
    assert np.isfinite(y0).all()
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5 * np.abs(y0).max())
    # exact sets: float32 index scores of random keys; a swap needs two scores within a float32 ulp at the
    # k-th place (chance ~1e-5 over this batch), unlike bf16 where ties are common enough to need a tolerance
    np.testing.assert_array_equal(np.sort(np.asarray(jitted.topk), 1), np.sort(np.asarray(eager.topk), 1))
    np.testing.assert_allclose(np.asarray(jitted.cache.kv), np.asarray(eager.cache.kv), rtol=1e-6, atol=1e-6)
    # a slot outside the pool is not caught inside jit (values are abstract): the write is dropped instead
    bad = with_array(b, "slot_mapping", 3, NB * BS)
    fn(layer, x, bad, cache)
    with pytest.raises(ValueError, match="outside the pool"):
        validate_batch(bad, num_blocks=NB, block_size=BS, max_seq_len=CFG.max_seq_len, num_tokens=8)
