"""Device-side input preparation: the packed step buffer expanded by ``unpack_step`` (inside the captured
executable) equals the host's ``make_batch``, field for field, for randomised mixed batches; and the
runner's incremental block-table updates keep the device's tables equal to the host's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.batch import Chunk, make_batch, pack_step, unpack_step
from jds.config import Numerics
from jds.model import Decoder, preset
from jds.runner import BoundaryRunner
from jds.sampling import greedy_tokens


def _random_step(rng: np.random.Generator, rows: int, max_blocks: int, bs: int, pool: int):
    """A mixed batch: a random subset of rows, each a prefill, a prefill chunk or a decode."""
    used = np.sort(rng.choice(rows, size=rng.integers(1, rows + 1), replace=False))
    chunks = []
    for r in used:
        start = int(rng.integers(0, max_blocks * bs - 1))
        n = int(rng.integers(1, min(max_blocks * bs - start, 40) + 1)) if rng.random() < 0.5 else 1
        chunks.append(Chunk(int(r), start, n))
    bt = rng.integers(0, pool, (rows, max_blocks)).astype(np.int32)
    return chunks, bt


@pytest.mark.parametrize("seed", [*range(10), *(pytest.param(s, marks=pytest.mark.slow) for s in range(10, 25))])
def test_unpack_equals_make_batch(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, max_blocks, bs, pool, cap = 6, 9, 4, 64, 80
    chunks, bt = _random_step(rng, rows, max_blocks, bs, pool)
    t = sum(c.num_tokens for c in chunks)
    tb = t + int(rng.integers(0, 20))
    ids = rng.integers(0, 1000, t).astype(np.int32)
    want = make_batch(chunks, bt, bs, pad_to=tb, host=True)
    # the device holds an older table; the buffer carries exactly the entries that differ
    old = bt.copy()
    flip = rng.random(bt.shape) < 0.15
    old[flip] = rng.integers(0, pool, int(flip.sum()))
    r_idx, c_idx = np.nonzero(bt != old)
    buf = pack_step(ids, chunks, (r_idx, c_idx, bt[r_idx, c_idx]), num_tokens=tb, num_rows=rows,
                    update_capacity=cap)
    tokens, batch, li, new_bt = jax.jit(unpack_step, static_argnames=("num_rows", "update_capacity", "block_size"))(
        jnp.asarray(buf), jnp.asarray(old), num_rows=rows, update_capacity=cap, block_size=bs)
    np.testing.assert_array_equal(np.asarray(new_bt), bt)
    for f in dataclasses.fields(want):
        np.testing.assert_array_equal(np.asarray(getattr(batch, f.name)), getattr(want, f.name), err_msg=f.name)
    exp_tokens = np.zeros(tb, np.int32)
    exp_tokens[:t] = ids
    np.testing.assert_array_equal(np.asarray(tokens), exp_tokens)
    exp_li = np.zeros(rows, np.int32)
    exp_li[: len(chunks)] = np.cumsum([c.num_tokens for c in chunks]) - 1
    np.testing.assert_array_equal(np.asarray(li), exp_li)


def test_unpack_has_no_loop() -> None:
    """The device-side preparation is straight-line code: an XLA while loop (jnp.searchsorted's default scan
    was one) cannot live in a command buffer, so the host would run it, reading its predicate back from the
    device each iteration, before it could launch the rest of the step (H200 thunk dump, 2026-12-01)."""
    rows, cap, bs, tb = 4, 8, 4, 32
    buf = pack_step(np.arange(5, dtype=np.int32), [Chunk(0, 0, 5)], (np.zeros(0, int),) * 3, num_tokens=tb,
                    num_rows=rows, update_capacity=cap)
    hlo = jax.jit(unpack_step, static_argnames=("num_rows", "update_capacity", "block_size")).lower(
        jnp.asarray(buf), jnp.zeros((rows, 3), jnp.int32), num_rows=rows, update_capacity=cap,
        block_size=bs).as_text()
    assert "while" not in hlo


def test_pack_step_rejects_overflow() -> None:
    with pytest.raises(ValueError, match="exceeds the buffer"):
        pack_step(np.zeros(5, np.int32), [Chunk(0, 0, 5)], (np.zeros(0), np.zeros(0), np.zeros(0)),
                  num_tokens=4, num_rows=2, update_capacity=4)


def _runner(input_prep: str, update_capacity: int = 0, step_buffer: str = "auto") -> BoundaryRunner:
    cfg = dataclasses.replace(preset("v32-tiny"), numerics=Numerics.exact())
    return BoundaryRunner(model=Decoder(cfg, seed=0), mode="fused", num_blocks=24, max_num_seqs=4,
                          max_num_tokens=64, max_model_len=96, input_prep=input_prep,
                          update_capacity=update_capacity, step_buffer=step_buffer)


@pytest.mark.parametrize("capacity", [0, 2])
def test_device_tables_follow_the_host(capacity: int) -> None:
    """Rows that change between steps (a request leaves, another takes its row, pages are appended) keep
    the device's tables equal to the host's, with a small update capacity (whole-table upload) too, and
    the logits equal the host-prepared path's."""
    rng = np.random.default_rng(3)
    dev, host = _runner("device", capacity), _runner("host")
    pages = rng.permutation(24).astype(np.int32)
    tables = [pages[:6].reshape(2, 3), pages[[0, 1, 2, 9, 10, 11]].reshape(2, 3),
              np.stack([pages[[0, 1, 2, 12]], pages[[13, 14, 15, 16]], pages[[17, 18, 19, 20]]])]
    steps = [([Chunk(0, 0, 9), Chunk(1, 0, 5)], tables[0]),
             ([Chunk(0, 9, 1), Chunk(1, 0, 7)], tables[1]),
             ([Chunk(0, 10, 3), Chunk(1, 7, 1), Chunk(2, 0, 11)], tables[2])]
    for chunks, bt in steps:
        ids = rng.integers(0, 256, sum(c.num_tokens for c in chunks)).astype(np.int32)
        a = dev.execute(ids, chunks, bt)
        b = host.execute(ids, chunks, bt)
        np.testing.assert_array_equal(a, b)
        want = np.zeros_like(dev._bt_host)
        want[: bt.shape[0], : bt.shape[1]] = bt
        np.testing.assert_array_equal(np.asarray(dev._bt_state), want)
        np.testing.assert_array_equal(dev._bt_host, want)


def test_unchanged_tables_are_not_diffed_and_changes_are_seen() -> None:
    """Block tables equal to the ones the device holds skip the pad / range check / diff (the same padded
    table object is reused); a table changed in place, a discarded preparation that replaced the device's whole
    table, and a page outside the pool that only a later step writes are all still seen."""
    dev, host = _runner("device", update_capacity=2), _runner("host")
    bs = dev.block_size
    bt = np.arange(6, dtype=np.int32).reshape(2, 3)
    rng = np.random.default_rng(7)

    def run(chunks: list[Chunk], table: np.ndarray) -> None:
        ids = rng.integers(0, 256, sum(c.num_tokens for c in chunks)).astype(np.int32)
        np.testing.assert_array_equal(dev.execute(ids, chunks, table), host.execute(ids, chunks, table))
        want = np.zeros_like(dev._bt_host)
        want[: table.shape[0], : table.shape[1]] = np.maximum(table, 0)
        np.testing.assert_array_equal(np.asarray(dev._bt_state), want)

    run([Chunk(0, 0, 5), Chunk(1, 0, 3)], bt)
    inp = dev.prepare_inputs(np.zeros(2, np.int32), [Chunk(0, 5, 1), Chunk(1, 3, 1)], bt)[0]
    assert inp.block_tables is dev._bt_host  # the fast path
    dev.step(inp)
    host.execute(np.zeros(2, np.int32), [Chunk(0, 5, 1), Chunk(1, 3, 1)], bt)
    bt[0, 1] = 11  # changed in place: same object, new contents
    run([Chunk(0, bs, 2), Chunk(1, 4, 1)], bt)
    # a preparation that replaced the whole table on the device (more changes than update_capacity), discarded
    other = np.arange(12, 18, dtype=np.int32).reshape(2, 3)
    dev.prepare_inputs(np.zeros(1, np.int32), [Chunk(0, 0, 1)], other)
    run([Chunk(0, bs + 2, 1), Chunk(1, 5, 1)], bt)
    # a page outside the pool in a block the first step does not write, the second does
    far = bt.copy()
    far[1, 2] = 99
    run([Chunk(0, bs + 3, 1)], far)
    with pytest.raises(ValueError, match="outside the pool"):
        dev.execute(np.zeros(1, np.int32), [Chunk(1, 2 * bs, 1)], far)


def test_device_prep_checks_like_the_host() -> None:
    r = _runner("device")
    bt = np.arange(8, dtype=np.int32).reshape(2, 4)
    with pytest.raises(ValueError, match="token_ids"):
        r.execute(np.zeros(3, np.int32), [Chunk(0, 0, 4)], bt)
    with pytest.raises(ValueError, match="increasing request-row order"):
        r.execute(np.zeros(2, np.int32), [Chunk(1, 0, 1), Chunk(0, 0, 1)], bt)
    with pytest.raises(ValueError, match="outside the pool"):
        r.execute(np.zeros(2, np.int32), [Chunk(0, 0, 2)], np.full((1, 4), 99, np.int32))
    with pytest.raises(ValueError, match="input_prep"):
        BoundaryRunner(model=r.model, mode="fused", num_blocks=4, max_num_seqs=2, max_num_tokens=16,
                       max_model_len=64, input_prep="gpu")


@pytest.mark.parametrize("segments, first", [pytest.param(3, 0, marks=pytest.mark.slow),  # CI budget; V4:
                                             pytest.param(2, 1, marks=pytest.mark.slow)])  # test_v4_decoder
def test_fused_segments_equal_one_executable(segments: int, first: int) -> None:
    """A fused step launched as several captured executables (an even split, or a short first segment) gives
    the one-executable step's logits."""
    cfg = dataclasses.replace(preset("v4-tiny"), numerics=Numerics.exact())
    model = Decoder(cfg, seed=0)
    kw = dict(model=model, mode="fused", num_blocks=8, max_num_seqs=2, max_num_tokens=256, max_model_len=320)
    one, split = BoundaryRunner(**kw), BoundaryRunner(**kw, segments=segments, first_segment_layers=first)
    bt = np.arange(2 * one.max_blocks, dtype=np.int32).reshape(2, -1)
    rng = np.random.default_rng(0)
    for chunks in ([Chunk(0, 0, 150), Chunk(1, 0, 30)], [Chunk(0, 150, 1), Chunk(1, 30, 1)]):
        ids = rng.integers(0, 256, sum(c.num_tokens for c in chunks)).astype(np.int32)
        np.testing.assert_array_equal(split.execute(ids, chunks, bt), one.execute(ids, chunks, bt))
    assert split.last_dispatch.captured == segments
    # the segment boundary, the block tables and the caches live in persistent buffers: the same
    # addresses step after step
    key = min(split._carry)  # the decode step's (token bucket, key blocks)
    state = lambda: (split._carry[key], split._bt_state, split.caches)  # noqa: E731
    before = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state())]
    ids = rng.integers(0, 256, 2).astype(np.int32)
    np.testing.assert_array_equal(split.execute(ids, [Chunk(0, 151, 1), Chunk(1, 31, 1)], bt),
                                  one.execute(ids, [Chunk(0, 151, 1), Chunk(1, 31, 1)], bt))
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state())] == before
    # the logits too: the last segment writes them into the runner's persistent output buffer
    a = split.step(*split.prepare_inputs(ids, [Chunk(0, 152, 1), Chunk(1, 32, 1)], bt))
    pa = a.unsafe_buffer_pointer()
    b = split.step(*split.prepare_inputs(ids, [Chunk(0, 153, 1), Chunk(1, 33, 1)], bt))
    assert b.unsafe_buffer_pointer() == pa and a.is_deleted()
    with pytest.raises(ValueError, match="segments"):
        BoundaryRunner(**{**kw, "mode": "narrow"}, segments=2)


def test_fused_logits_stay_in_one_buffer() -> None:
    """The one-executable fused step (device prep) returns its logits in the same device buffer every step,
    also while the caller holds the previous step's array (which that step then gives back: deleted), and the
    values equal host preparation's."""
    dev, host = _runner("device"), _runner("host")
    bt = np.arange(8, dtype=np.int32).reshape(2, 4)
    rng = np.random.default_rng(3)
    ptrs, prev = set(), None
    for i in range(4):
        chunks = [Chunk(0, 0, 5)] if i == 0 else [Chunk(0, 4 + i, 1)]
        ids = rng.integers(0, 256, sum(c.num_tokens for c in chunks)).astype(np.int32)
        logits = dev.step(*dev.prepare_inputs(ids, chunks, bt))
        ptrs.add(logits.unsafe_buffer_pointer())
        if prev is not None:
            assert prev.is_deleted()
        np.testing.assert_array_equal(np.asarray(logits[:1]), host.execute(ids, chunks, bt))
        prev = logits
    assert len(ptrs) == 1


def test_pinned_step_buffer_equals_transfer_in_flight() -> None:
    """step_buffer="pinned" (the packed step written in place into persistent pinned-host buffers that the
    executable copies) gives the transfer path's tokens bit for bit over a mixed run of prefills, decodes and
    changing block tables, with every step enqueued before any result is read (the buffers take turns, each
    rewritten only once the step that read it is done), and keeps one address per buffer."""
    pinned, xfer = _runner("device", step_buffer="pinned"), _runner("device", step_buffer="transfer")
    assert (pinned.step_buffer, xfer.step_buffer) == ("pinned", "transfer")
    rng = np.random.default_rng(5)
    pages = rng.permutation(24).astype(np.int32)
    steps = [([Chunk(0, 0, 9), Chunk(1, 0, 5)], pages[:6].reshape(2, 3))]
    steps += [([Chunk(0, 9 + i, 1), Chunk(1, 5 + i, 1)], pages[[0, 1, 2, 9, 10, 11]].reshape(2, 3)) for i in range(5)]
    steps += [([Chunk(0, 14, 3), Chunk(1, 10, 1)], pages[[0, 1, 2, 12, 13, 14]].reshape(2, 3))]
    feeds = [rng.integers(0, 256, sum(c.num_tokens for c in ch)).astype(np.int32) for ch, _ in steps]
    got = {}
    for name, r in (("pinned", pinned), ("transfer", xfer)):
        toks = [greedy_tokens(r.step(*r.prepare_inputs(ids, ch, bt))) for (ch, bt), ids in zip(steps, feeds)]
        got[name] = np.stack([np.asarray(t) for t in toks])
    np.testing.assert_array_equal(got["pinned"], got["transfer"])
    ptrs = {slot[0].unsafe_buffer_pointer() for ring in pinned._pinned.values() for slot in ring}
    assert len(ptrs) == 2 * len(pinned._pinned)
    ids = feeds[-1][:2]
    later = [pinned.prepare_inputs(ids, [Chunk(0, 17 + i, 1), Chunk(1, 11 + i, 1)], steps[-1][1]) for i in range(2)]
    assert {inp[0].packed.unsafe_buffer_pointer() for inp in later} <= ptrs


def test_pinned_step_buffer_refuses_stale_inputs() -> None:
    """Inputs prepared before another prepare_inputs of the same bucket name a buffer that may hold the newer
    step: stepping them is a ValueError, not a silent run of the wrong step; the setting is validated."""
    r = _runner("device", step_buffer="pinned")
    bt = np.arange(8, dtype=np.int32).reshape(2, 4)
    old = r.prepare_inputs(np.zeros(2, np.int32), [Chunk(0, 0, 2)], bt)
    new = r.prepare_inputs(np.ones(2, np.int32), [Chunk(0, 0, 2)], bt)
    with pytest.raises(ValueError, match="stale"):
        r.step(*old)
    r.step(*new)
    with pytest.raises(ValueError, match="step_buffer"):
        BoundaryRunner(model=r.model, mode="fused", num_blocks=4, max_num_seqs=2, max_num_tokens=16,
                       max_model_len=64, step_buffer="mapped")
