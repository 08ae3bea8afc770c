"""Paged-cache plumbing shared by every cache: slot arithmetic, record read/write, per-request gathers.

A cache is an array ``[num_blocks, page_elems]``; a *record format* maps a global slot to the element
offsets of its record inside the flattened cache and packs/unpacks rows. Writes are one scatter with
out-of-range offsets dropped (slot -1 = padding writes nothing); reads are one gather.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp

from jds.ops.dispatch import describe


class RecordFormat(Protocol):
    """How one cache stores one row per slot."""

    entries_per_page: int
    page_elems: int
    dtype: jnp.dtype

    def segments(self, slots: jax.Array) -> tuple[tuple[jax.Array, int], ...]:
        """The record's contiguous parts: (start offset [...] in the flattened cache, length) each."""

    def offsets(self, slots: jax.Array) -> jax.Array:
        """[..., rec] element offsets of each slot's record in the flattened cache."""

    def pack(self, rows: jax.Array) -> jax.Array:
        """[..., D] rows -> [..., rec] stored elements."""

    def unpack(self, recs: jax.Array) -> jax.Array:
        """[..., rec] stored elements -> [..., D] float32 rows (dequantised)."""


def global_slots(block_tables: jax.Array, req_idx: jax.Array, local: jax.Array, entries_per_page: int) -> jax.Array:
    """Request-local entry index -> global slot through the block table; local < 0 stays -1.

    ``local`` is [T, ...] and ``req_idx`` [T]: each token uses its own request's row.
    """
    safe = jnp.maximum(local, 0)
    rows = block_tables[req_idx]  # [T, max_blocks]
    page = jnp.take_along_axis(rows, (safe // entries_per_page).reshape(safe.shape[0], -1), axis=1).reshape(safe.shape)
    slot = page * entries_per_page + safe % entries_per_page
    return jnp.where(local >= 0, slot, -1).astype(jnp.int32)


def write_records(cache: jax.Array, fmt: RecordFormat, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """Store ``rows`` [N, D] at ``slots`` [N]; slot -1 writes nothing.

    One windowed scatter per contiguous segment of the record (a whole 656-byte record, or a
    split page's value and scale parts), so each token moves as a few contiguous windows rather
    than as one index per byte.
    """
    flat = cache.reshape(-1)
    vals = fmt.pack(rows).astype(cache.dtype)
    pos = 0
    for start, n in fmt.segments(jnp.maximum(slots, 0)):
        start = jnp.where(slots >= 0, start, flat.shape[0])  # out of bounds -> window dropped
        flat = jax.lax.scatter(flat, start[:, None].astype(jnp.int32), vals[:, pos: pos + n], _SCATTER,
                               indices_are_sorted=False, unique_indices=False,
                               mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
        pos += n
    return flat.reshape(cache.shape)


def read_records(cache: jax.Array, fmt: RecordFormat, slots: jax.Array) -> jax.Array:
    """Gather and dequantise the rows at ``slots`` (any shape); slot -1 reads slot 0 (mask it yourself)."""
    flat = cache.reshape(-1)
    parts = []
    for start, n in fmt.segments(jnp.maximum(slots, 0)):
        g = jax.lax.gather(flat, start.reshape(-1, 1).astype(jnp.int32), _GATHER, slice_sizes=(n,),
                           mode=jax.lax.GatherScatterMode.CLIP)
        parts.append(g.reshape(slots.shape + (n,)))
    return fmt.unpack(jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0])


_GATHER = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,))
_SCATTER = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(),
                                           scatter_dims_to_operand_dims=(0,))


def gather_request_rows(cache: jax.Array, fmt: RecordFormat, block_tables: jax.Array, max_entries: int) -> jax.Array:
    """All of each request's first ``max_entries`` entries: [R, max_entries, D] float32 (unmasked)."""
    r = block_tables.shape[0]
    local = jnp.broadcast_to(jnp.arange(max_entries, dtype=jnp.int32), (r, max_entries))
    slots = global_slots(block_tables, jnp.arange(r, dtype=jnp.int32), local, fmt.entries_per_page)
    return read_records(cache, fmt, slots)


_FORMAT_ATTRS = ("entries_per_page", "page_elems", "dtype", "segments", "pack", "unpack")


def _check_format(name: str, fmt: object) -> None:
    if not all(hasattr(fmt, a) for a in _FORMAT_ATTRS):
        raise ValueError(f"{name} must be a record format (jds.ops.records: FloatRows, MlaRecord656, ...), got {fmt!r}")


@functools.lru_cache(maxsize=None)
def _record_dim(fmt: RecordFormat) -> int:
    rows = jax.eval_shape(lambda c: read_records(c, fmt, jnp.zeros((1,), jnp.int32)),
                          jax.ShapeDtypeStruct((1, fmt.page_elems), fmt.dtype))
    return int(rows.shape[-1])


def record_dim(fmt: RecordFormat, name: str = "fmt") -> int:
    """The row width D that ``fmt`` packs and unpacks (``read_records`` traced on abstract shapes: static)."""
    _check_format(name, fmt)
    try:
        return _record_dim(fmt)
    except TypeError:  # an unhashable format: no memo
        return _record_dim.__wrapped__(fmt)


def check_cache(name: str, cache: object, fmt: RecordFormat, fmt_name: str = "fmt") -> int:
    """ValueError naming ``name`` (or ``fmt_name``) unless ``cache`` is a page pool of ``fmt``: ``fmt.dtype``
    [num_blocks >= 1, fmt.page_elems]. Returns the format's row width (``record_dim``). Static (shapes, dtypes)."""
    _check_format(fmt_name, fmt)
    shape, dtype = getattr(cache, "shape", None), getattr(cache, "dtype", None)
    if (shape is None or dtype is None or len(shape) != 2 or shape[0] < 1 or shape[1] != fmt.page_elems
            or jnp.dtype(dtype) != jnp.dtype(fmt.dtype)):
        raise ValueError(f"{name} must be {jnp.dtype(fmt.dtype)} [num_blocks >= 1, {fmt.page_elems}] (pages of "
                         f"{fmt_name} = {fmt}), got {describe(cache)}")
    return record_dim(fmt, fmt_name)


def empty_cache(fmt: RecordFormat, num_blocks: int) -> jax.Array:
    return jnp.zeros((num_blocks, fmt.page_elems), fmt.dtype)
