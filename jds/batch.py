"""The paged, flattened batch a server step hands to the attention layers.

T tokens from R request rows (prefills, prefill chunks and decodes mixed). Every cache of a layer is
addressed through the same ``block_tables`` ([R, max_blocks] of page ids); ``slot_mapping`` is each
token's write slot (-1 = padding: writes nothing, its output is garbage-free but ignored).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedBatch:
    positions: jax.Array  # [T] int32, absolute position of the token in its request
    req_idx: jax.Array  # [T] int32, row of block_tables / seq_lens
    slot_mapping: jax.Array  # [T] int32, cache slot (block_size granularity), -1 = padding
    block_tables: jax.Array  # [R, max_blocks] int32
    seq_lens: jax.Array  # [R] int32, keys visible after this step
    query_start_loc: jax.Array  # [R + 1] int32, token offsets of each request row

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_reqs(self) -> int:
        return int(self.block_tables.shape[0])


@dataclass(frozen=True)
class Chunk:
    """``num_tokens`` consecutive tokens of request row ``req`` starting at position ``start``."""

    req: int
    start: int
    num_tokens: int


def make_batch(chunks: Sequence[Chunk], block_tables: np.ndarray, block_size: int,
               pad_to: int | None = None, *, host: bool = False) -> PagedBatch:
    """Host-side builder: one chunk per request row (row = ``chunk.req``), tokens in chunk order.

    Rows of ``block_tables`` without a chunk get seq_len 0. ``pad_to`` appends padding tokens
    (slot -1, position 0, request row 0) so shapes can be bucketed. ``host=True`` leaves the fields as
    numpy arrays, so a caller can check them and move a whole step's inputs in one transfer.
    """
    block_tables = np.asarray(block_tables, np.int32)
    r = block_tables.shape[0]
    # vectorised over chunks: a 64-request decode step is built in tens of microseconds, not a Python loop
    req = np.fromiter((c.req for c in chunks), np.int64, len(chunks))
    start = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
    n_tok = np.fromiter((c.num_tokens for c in chunks), np.int64, len(chunks))
    bad = np.flatnonzero((req < 0) | (req >= r))
    if bad.size:
        raise ValueError(f"chunk.req={int(req[bad[0]])} outside block_tables rows [0, {r})")
    rows, seen = np.unique(req, return_counts=True)
    if (seen > 1).any():
        raise ValueError(f"chunk.req={int(rows[seen > 1][0])} appears twice; one chunk per request row per step")
    bad = np.flatnonzero((start < 0) | (n_tok < 1))
    if bad.size:
        raise ValueError(f"chunk for req {int(req[bad[0]])}: start must be >= 0 and num_tokens >= 1")
    last = start + n_tok - 1
    bad = np.flatnonzero(last // block_size >= block_tables.shape[1])
    if bad.size:
        raise ValueError(f"block_tables row {int(req[bad[0]])} is too short for position {int(last[bad[0]])}")
    if (np.diff(req) < 0).any():
        raise ValueError("chunks must be given in increasing request-row order")
    seq_lens = np.zeros(r, np.int32)
    seq_lens[req] = start + n_tok
    counts = np.zeros(r, np.int32)
    counts[req] = n_tok
    qsl = np.zeros(r + 1, np.int32)
    qsl[1:] = np.cumsum(counts)
    tok_start = np.cumsum(n_tok) - n_tok  # each chunk's first token in the flat batch
    req_idx = np.repeat(req, n_tok).astype(np.int32)
    positions = (np.arange(int(n_tok.sum())) - np.repeat(tok_start - start, n_tok)).astype(np.int32)
    slots = block_tables[req_idx, positions // block_size] * block_size + positions % block_size
    if pad_to is not None:
        n = pad_to - positions.shape[0]
        if n < 0:
            raise ValueError(f"pad_to={pad_to} is smaller than the {positions.shape[0]} tokens")
        positions = np.concatenate([positions, np.zeros(n, np.int32)])
        req_idx = np.concatenate([req_idx, np.zeros(n, np.int32)])
        slots = np.concatenate([slots, np.full(n, -1, np.int32)])
    batch = PagedBatch(positions=positions, req_idx=req_idx, slot_mapping=slots.astype(np.int32),
                       block_tables=block_tables, seq_lens=seq_lens, query_start_loc=qsl)
    return batch if host else jax.tree.map(jnp.asarray, batch)


def validate_batch(batch: PagedBatch, *, num_blocks: int, block_size: int, max_seq_len: int,
                   num_tokens: int | None = None) -> None:
    """Eager (host) checks of everything jit cannot check; raises ValueError naming the field.

    Checked: shapes and dtypes agree; positions within [0, max_seq_len) and below the request's
    seq_len; every non-padding slot inside the pool, equal to the block-table slot of its position and
    written by one token only; block-table rows long enough for seq_lens; page ids inside the pool.
    Not checkable inside jit: all of the above on traced values — call this before jitting.
    """
    pos = np.asarray(batch.positions)
    req = np.asarray(batch.req_idx)
    slot = np.asarray(batch.slot_mapping)
    bt = np.asarray(batch.block_tables)
    sl = np.asarray(batch.seq_lens)
    t = pos.shape[0]
    for name, a in (("req_idx", req), ("slot_mapping", slot)):
        if a.shape != (t,):
            raise ValueError(f"batch.{name} has shape {a.shape}, expected ({t},) like positions")
    if num_tokens is not None and t != num_tokens:
        raise ValueError(f"batch.positions has {t} tokens but the hidden states have {num_tokens}")
    if bt.ndim != 2:
        raise ValueError(f"batch.block_tables must be 2-D [R, max_blocks], got shape {bt.shape}")
    r = bt.shape[0]
    if sl.shape != (r,):
        raise ValueError(f"batch.seq_lens has shape {sl.shape}, expected ({r},)")
    if np.asarray(batch.query_start_loc).shape != (r + 1,):
        raise ValueError(f"batch.query_start_loc must have shape ({r + 1},)")
    real = slot >= 0
    if ((req < 0) | (req >= r)).any():
        raise ValueError("batch.req_idx holds a row outside block_tables")
    if ((pos < 0) | (pos >= max_seq_len)).any():
        raise ValueError(f"batch.positions holds a position outside [0, max_seq_len={max_seq_len})")
    if (real & (pos >= sl[req])).any():
        raise ValueError("batch.positions holds a position at or beyond its request's seq_len")
    if (sl > bt.shape[1] * block_size).any():
        raise ValueError(f"batch.block_tables is too short: {bt.shape[1]} blocks of {block_size} cannot hold "
                         f"seq_len {int(sl.max())}")
    if (sl > max_seq_len).any():
        raise ValueError(f"batch.seq_lens exceeds max_seq_len={max_seq_len}")
    if (slot >= num_blocks * block_size).any() or (slot < -1).any():
        raise ValueError(f"batch.slot_mapping holds a slot outside the pool of {num_blocks * block_size} slots")
    need = -(-sl // block_size)
    for i in range(r):
        pages = bt[i, : need[i]]
        if ((pages < 0) | (pages >= num_blocks)).any():
            raise ValueError(f"batch.block_tables row {i} holds a page outside [0, {num_blocks})")
    if real.any():
        expect = bt[req[real], pos[real] // block_size] * block_size + pos[real] % block_size
        if (expect != slot[real]).any():
            raise ValueError("batch.slot_mapping disagrees with block_tables for some token")
        uniq, counts = np.unique(slot[real], return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"batch.slot_mapping writes slot {int(uniq[counts > 1][0])} more than once "
                             "(a request row's token appears twice in the step)")


def replace(batch: PagedBatch, **kw) -> PagedBatch:
    return dataclasses.replace(batch, **kw)


# ----- one packed int32 buffer per step (the runner's device-side input preparation) -------------------
_HEADER = 3  # num_tokens, num_chunks, num_block_table_updates


def step_buffer_len(num_tokens: int, num_rows: int, update_capacity: int) -> int:
    """Length of the packed step buffer for a ``num_tokens`` bucket (see ``pack_step``)."""
    return _HEADER + 2 * num_tokens + 3 * num_rows + 3 * update_capacity


def pack_step(token_ids: np.ndarray, chunks: Sequence[Chunk], updates: tuple[np.ndarray, np.ndarray, np.ndarray],
              *, num_tokens: int, num_rows: int, update_capacity: int, feed: np.ndarray | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """The host's whole per-step input as one int32 array: what ``unpack_step`` expands on the device.

    Layout: [num_tokens, num_chunks, num_updates | token ids (padded to the bucket) | feed (-1: none; padded) | chunk
    rows | chunk starts | chunk lengths (each padded to ``num_rows``) | update rows | update columns | update pages
    (each padded to ``update_capacity``)]. The padding is zeros in a new buffer; written into ``out``, it keeps
    what was there (``unpack_step`` reads nothing past the counts). ``updates`` are the block-table entries that changed since the last step
    (rows, columns, page ids). ``feed[i] >= 0`` makes token i the one the previous step sampled for its row
    ``feed[i]`` (asynchronous stepping: the host never waits for it). Why one array: each host-to-device transfer
    costs tens of microseconds of host time whatever its size, and an argument whose address changes makes XLA
    update every recorded graph command that reads it; the packed buffer is read only by the first few.
    """
    t = len(token_ids)
    c = len(chunks)
    rows, cols, pages = updates
    u = len(rows)
    if t > num_tokens or c > num_rows or u > update_capacity:
        raise ValueError(f"step of {t} tokens / {c} chunks / {u} block-table updates exceeds the buffer's "
                         f"{num_tokens} / {num_rows} / {update_capacity}")
    n = step_buffer_len(num_tokens, num_rows, update_capacity)
    if out is None:
        buf = np.zeros(n, np.int32)
    elif out.shape != (n,) or out.dtype != np.int32:
        raise ValueError(f"out must be int32 of shape ({n},), got {out.dtype} {out.shape}")
    else:  # not cleared: what lies past the counts is masked by unpack_step (one numpy call fewer per step)
        buf = out
    if feed is not None and len(feed) != t:
        raise ValueError(f"feed has {len(feed)} entries for {t} tokens")
    # one write per section: each numpy call costs host time on the step's critical path
    buf[:_HEADER] = (t, c, u)
    o = _HEADER
    buf[o:o + t] = token_ids
    o += num_tokens
    buf[o:o + t] = -1 if feed is None else feed
    o += num_tokens
    buf[o:o + 3 * num_rows].reshape(3, num_rows)[:, :c] = [[ch.req for ch in chunks], [ch.start for ch in chunks],
                                                          [ch.num_tokens for ch in chunks]]
    o += 3 * num_rows
    if u:
        buf[o:o + 3 * update_capacity].reshape(3, update_capacity)[:, :u] = (rows, cols, pages)
    return buf


def unpack_step(buf: jax.Array, block_tables: jax.Array, *, num_rows: int, update_capacity: int,
                block_size: int, prev_tokens: jax.Array | None = None
                ) -> tuple[jax.Array, PagedBatch, jax.Array, jax.Array]:
    """Device-side ``make_batch``: (token ids, the step's PagedBatch, logits indices, block tables after
    this step's updates) from a ``pack_step`` buffer and the persistent block tables [num_rows, max_blocks].
    ``prev_tokens`` [rows] are the previous step's sampled tokens that the buffer's feed entries name.

    Traced inside the step's captured executable, so positions, slots, request rows, query offsets,
    sequence lengths and logits indices cost no host time. Equal to ``make_batch`` field for field
    (tests/test_batch.py checks randomised mixed batches).
    """
    r = num_rows
    tb = (buf.shape[0] - step_buffer_len(0, r, update_capacity)) // 2
    t, c, nu = buf[0], buf[1], buf[2]
    o = _HEADER
    i = jnp.arange(tb, dtype=jnp.int32)
    real = i < t
    tokens = buf[o:o + tb]
    o += tb
    if prev_tokens is not None:
        feed = buf[o:o + tb]
        fed = prev_tokens[jnp.clip(feed, 0, prev_tokens.shape[0] - 1)].astype(tokens.dtype)
        tokens = jnp.where(feed >= 0, fed, tokens)
    tokens = jnp.where(real, tokens, 0)  # the padding is whatever an earlier step left in a reused buffer
    o += tb
    ch_row, ch_start, ch_len = buf[o:o + r], buf[o + r:o + 2 * r], buf[o + 2 * r:o + 3 * r]
    o += 3 * r
    u = update_capacity
    up_row, up_col, up_page = buf[o:o + u], buf[o + u:o + 2 * u], buf[o + 2 * u:o + 3 * u]
    live = jnp.arange(u) < nu
    bt = block_tables.at[jnp.where(live, up_row, r), up_col].set(up_page, mode="drop")
    is_chunk = jnp.arange(r) < c
    row_of_chunk = jnp.where(is_chunk, ch_row, r)  # r: out of range, dropped by the scatters
    counts = jnp.zeros(r, jnp.int32).at[row_of_chunk].set(ch_len, mode="drop")
    starts = jnp.zeros(r, jnp.int32).at[row_of_chunk].set(ch_start, mode="drop")
    seq_lens = jnp.where(counts > 0, starts + counts, 0)
    qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    # compare_all, not the default scan: the scan is an XLA while loop, which a command buffer cannot hold, so
    # the host would run it (one device->host read of the predicate per iteration) before launching the rest
    req = jnp.where(real, jnp.searchsorted(qsl[1:], i, side="right", method="compare_all").astype(jnp.int32), 0)
    pos = jnp.where(real, starts[req] + i - qsl[req], 0)
    slot = jnp.where(real, bt[req, pos // block_size] * block_size + pos % block_size, -1)
    li = jnp.where(is_chunk, qsl[jnp.minimum(row_of_chunk, r - 1)] + ch_len - 1, 0)
    batch = PagedBatch(positions=pos, req_idx=req, slot_mapping=slot, block_tables=bt, seq_lens=seq_lens,
                       query_start_loc=qsl)
    return tokens, batch, li.astype(jnp.int32), bt
