"""DeepSeek-V4's compressor kernels, Pallas on GPU, in step order: the state write, the entries, their records.

``write_state``: each token's state row ``[kv | score + ape[p % r]]`` (float32) from the projection, written at
its slot of the state pages in one launch (XLA: the sum and concatenation, then a scatter).

``pool_norm_rope``: for each row n with ``blocks[n] >= 0``, block ``blocks[n]`` of request row ``req[n]`` is
softmax-pooled per channel over its candidate state rows (read through the block table from the fp32 state
cache; at ratio 4 also the previous block's, jds/ops/compressor.py says which channels), RMSNorm'ed with the
learned weight and RoPE'd (interleaved, the last 2 * cos.shape[-1] dims). Rows with block < 0 are written as
zeros and read nothing: at decode most rows close no block, and the XLA implementation
(``jds.ops.compressor.pool_norm_rope_xla``) gathers, exponentiates and sums every row's candidates anyway.
Programs: (row, channel block). The candidates go in chunks with an online softmax (running max, sum and
weighted sum per channel, float32). A program holding a whole row (ratio 4's 8 candidates) norms and rotates
it as well; at ratio 128 a row's channels are spread over programs and XLA norms and rotates the pooled rows.

``insert_entries``: entries [N, d] written into V4's kv cache format at their slots (``MlaRecord584``'s packing in
registers, or float rows) in one launch (XLA: the packing's kernels, then a scatter); ``insert_index_keys`` the
same for the indexer compressor's keys (``IndexerRecord132`` or float rows).

Backend: the Triton lowering, as the fused inserts (pallas_kernels/fused_insert_common.py): every candidate
row is a data-dependent gather through the block table and the records mix byte-sized values (Mosaic GPU on
Hopper takes no vector indices), and the kernels then lower and run in interpret mode on a CPU-only machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jds.ops.compressor import norm_rope, overlap_factor, pool_norm_rope_xla, state_format, write_state_xla
from jds.ops.dispatch import Implementation, Unsupported, check_array, check_int, run_op
from jds.ops.paging import RecordFormat, check_cache, write_records
from jds.ops.indexer import prepare_indexer_k
from jds.ops.records import FloatRows, IndexerRecord132, MlaRecord584
from pallas_kernels import fused_insert_common as C

F32 = jnp.float32


def _pool_kernel(state_ref, bt_ref, req_ref, blk_ref, w_ref, cos_ref, sin_ref, out_ref, *, r, c, d, db, bs, nb,
                 ch, eps, dtype):
    n, jc = pl.program_id(0), pl.program_id(1)
    row = C.iota((1, 1), 0) + n
    b = blk_ref[n]
    col = jc * db + C.iota((1, db), 1)  # this program's channels
    width = 2 * c * d
    whole = db == d  # the whole row here: RMSNorm and RoPE too; else the pooled channels (float32) only

    @pl.when(b < 0)
    def _skip():
        C.store(out_ref, (row, col), jnp.zeros((1, db), out_ref.dtype), True)

    @pl.when(b >= 0)
    def _pool():
        req = req_ref[n]

        def chunk(i, carry):
            m, l, acc = carry
            s = i * ch + C.iota((ch, 1), 0)  # candidate index: block b - (c - 1) + s // r, token s % r
            part = s // r if c == 2 else jnp.zeros_like(s)
            blk = b - (c - 1) + part
            ok = blk >= 0
            pos = jnp.maximum(blk, 0) * r + s % r  # request-local token position
            page = C.load(bt_ref, (req, jnp.minimum(pos // bs, nb - 1)), (ch, 1))
            off = (pos % bs) * width + part * d + col  # kv channels; the score's are c * d further on
            kv = C.load(state_ref, (page, off), (ch, db))
            sc = jnp.where(ok, C.load(state_ref, (page, off + c * d), (ch, db)), -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(sc, axis=0, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no candidate yet: every weight is 0
            p = jnp.exp(sc - m_safe)
            alpha = jnp.exp(m - m_safe)
            return m_new, l * alpha + jnp.sum(p, axis=0, keepdims=True), acc * alpha + jnp.sum(p * kv, axis=0,
                                                                                                keepdims=True)

        init = (jnp.full((1, db), -jnp.inf, F32), jnp.zeros((1, db), F32), jnp.zeros((1, db), F32))
        n_chunks = c * r // ch
        carry = chunk(0, init) if n_chunks == 1 else jax.lax.fori_loop(0, n_chunks, chunk, init)
        x = carry[2] / carry[1]
        if not whole:
            C.store(out_ref, (row, col), x, True)
            return
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * C.load(w_ref, (col,), (1, d))
        y = y.astype(dtype).astype(F32)  # rms_norm's output, then rope_part on it (jds.ops.compressor)
        half = cos_ref.shape[1]
        j = C.iota((1, d // 2), 1)  # pair j: columns (2j, 2j + 1); the rope pairs are the last ``half``
        fj = jnp.maximum(j - (d // 2 - half), 0)
        cs, sn = C.load(cos_ref, (row, fj), (1, d // 2)), C.load(sin_ref, (row, fj), (1, d // 2))
        u, v = C.split_pairs(y)
        e, o = C.rope_pair(u, v, cs, sn)
        rot = j >= d // 2 - half
        out = C.join_pairs(jnp.where(rot, e, u), jnp.where(rot, o, v))
        C.store(out_ref, (row, col), out.astype(dtype), True)


def pool_norm_rope(state_cache, block_tables, req, blocks, norm_weight, cos, sin, *, ratio: int, d: int,
                   block_size: int, eps: float, dtype, implementation: Implementation = "pallas",
                   interpret: bool | None = None, channel_block: int | None = None, chunk: int | None = None,
                   num_warps: int | None = None):
    """The compressor's entries [N, d] in ``dtype`` (jds.ops.compressor.pool_norm_rope_xla's outputs; rows with
    block < 0 are zeros here and unspecified there: their slot is -1, nothing writes them).

    state_cache: fp32 pages of ``state_format(ratio, d, block_size)``; block_tables [R, nb] int32; req, blocks
    [N] int32; norm_weight [d]; cos / sin [N, rope_dim / 2] float32 at each entry's position.
    ``channel_block``: channels per program. ``d`` (the default at ratio 4: c * r = 8 candidates) keeps a row in
    one program, which also norms and rotates it; fewer (32, the default at ratio 128) spread a row's many
    candidates over d / channel_block programs, which only pool (a loop over 128 candidates in one program
    waited on one chunk's loads after another), and XLA norms and rotates (``norm_rope``).
    ``chunk``: candidates per online-softmax step (a power of two dividing c * ratio; default: a tile of at most
    4096 values per operand).
    """
    args = (state_cache, block_tables, req, blocks, norm_weight, cos, sin)
    _check_inputs(*args, ratio=ratio, d=d, block_size=block_size)
    kw = dict(ratio=ratio, d=d, block_size=block_size, eps=eps, dtype=dtype)
    return run_op("pool_norm_rope", implementation, {
        "xla": lambda: pool_norm_rope_xla(*args, **kw),
        "pallas": lambda: _pallas(*args, **kw, interpret=interpret, channel_block=channel_block, chunk=chunk,
                                  num_warps=num_warps)})


def _check_inputs(state_cache, block_tables, req, blocks, norm_weight, cos, sin, *, ratio, d, block_size) -> None:
    """Input errors of every implementation (ValueError naming the argument; static shapes and dtypes only)."""
    op = "pool_norm_rope"
    check_int(f"{op}: ratio", ratio, 1)
    check_int(f"{op}: d", d, 1)
    check_int(f"{op}: block_size", block_size, 1)
    if block_size % ratio:
        raise ValueError(f"{op}: block_size {block_size} must be a multiple of ratio {ratio}")
    check_cache(f"{op}: state_cache", state_cache, state_format(ratio, d, block_size), "state format")
    check_array(f"{op}: block_tables", block_tables, (("R", None), ("max_blocks", None)), "int")
    check_array(f"{op}: req", req, (("N", None),), "int")
    n = req.shape[0]
    check_array(f"{op}: blocks", blocks, (("N", n),), "int")
    check_array(f"{op}: norm_weight", norm_weight, (("d", d),), "float")
    rd = C.check_rope_tables(op, cos, sin, n)
    if rd > d:
        raise ValueError(f"{op}: d {d} must be at least the rope dim {rd} (2 * cos.shape[-1])")


def _pallas(state_cache, block_tables, req, blocks, norm_weight, cos, sin, *, ratio, d, block_size, eps, dtype,
            interpret, channel_block, chunk, num_warps):
    interpret = C.resolve_interpret(interpret)
    for name, v in (("d", d), ("ratio", ratio), ("rope dim", 2 * cos.shape[-1])):
        if not C.is_pow2(v):
            raise Unsupported(f"pool_norm_rope: {name} {v} is not a power of 2")
    c = overlap_factor(ratio)
    cands = c * ratio
    db = channel_block or (d if cands <= 8 else min(d, 32))
    ch = chunk or min(cands, max(1, 4096 // db))
    for name, v in (("channel_block", db), ("chunk", ch), ("num_warps", num_warps or 1)):
        if not C.is_pow2(v):  # a tile setting, not a shape: an error under "auto" too
            raise ValueError(f"pool_norm_rope: {name} must be a power of 2 (or None), got {v!r}")
    if cands % ch:
        raise ValueError(f"pool_norm_rope: chunk {ch} must divide the {cands} candidates of ratio {ratio}")
    if d % db:
        raise ValueError(f"pool_norm_rope: channel_block {db} must divide d {d}")
    n = req.shape[0]
    dt = jnp.dtype(dtype)
    if n == 0:
        return jnp.zeros((0, d), dt)
    kernel = functools.partial(_pool_kernel, r=ratio, c=c, d=d, db=db, bs=block_size, nb=block_tables.shape[1],
                               ch=ch, eps=eps, dtype=dt)
    args = (state_cache, block_tables.astype(jnp.int32), req.astype(jnp.int32), blocks.astype(jnp.int32),
            norm_weight.astype(F32), cos.astype(F32), sin.astype(F32))
    out = C.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n, d), dt if db == d else F32), grid=(n, d // db),
                        aliases={}, interpret=interpret, name="compressor_pool_norm_rope" if db == d else
                        "compressor_pool", num_warps=num_warps or (8 if db * ch >= 4096 else 4))(*args)
    return out if db == d else norm_rope(out, norm_weight, cos, sin, eps=eps, dtype=dt)


def _state_kernel(proj_ref, ape_ref, pos_ref, slot_ref, _cache_in, c_out, *, T, BT, W, r, fmt):
    pid = pl.program_id(0)
    t = pid * BT + C.iota((BT, 1), 0)
    tc = jnp.minimum(t, T - 1)
    col = C.iota((1, W), 1)
    slot = C.load(slot_ref, (tc,), (BT, 1))
    ok = (t < T) & (slot >= 0)
    half = W // 2
    x = C.load(proj_ref, (tc, col), (BT, W)).astype(F32)  # [kv | score]
    phase = jax.lax.rem(C.load(pos_ref, (tc,), (BT, 1)), r)
    ape = C.load(ape_ref, (phase, jnp.maximum(col - half, 0)), (BT, W), mask=col >= half).astype(F32)
    C.store_kv_record(c_out, jnp.where(col >= half, x + ape, x), slot, ok, fmt, False)  # FloatRows: float32 rows


def write_state(state_cache, proj, ape, positions, slot_mapping, *, ratio: int, d: int, block_size: int,
                implementation: Implementation = "pallas", interpret: bool | None = None,
                rows_per_program: int | None = None, num_warps: int | None = None):
    """The state cache with this step's rows written (jds.ops.compressor.write_state_xla's result, bit for bit:
    one float32 sum per score element in either).

    state_cache: fp32 pages of ``state_format(ratio, d, block_size)`` (donate it: updated in place); proj
    [T, 2*c*d] float ([kv | score]); ape [ratio, c*d]; positions, slot_mapping [T] int32 (slot -1 writes nothing).
    ``rows_per_program``: tokens a program writes (default: a tile of at most 4096 values)."""
    op = "write_state"
    fmt = state_format(ratio, d, block_size)
    width = check_cache(f"{op}: state_cache", state_cache, fmt, "state format")
    check_array(f"{op}: proj", proj, (("T", None), ("2*c*d", width)), "float")
    t = proj.shape[0]
    check_array(f"{op}: ape", ape, (("ratio", ratio), ("c*d", width // 2)), "float")
    check_array(f"{op}: positions", positions, (("T", t),), "int")
    check_array(f"{op}: slot_mapping", slot_mapping, (("T", t),), "int")
    args = (state_cache, proj, ape, positions, slot_mapping)
    kw = dict(ratio=ratio, d=d, block_size=block_size)
    return run_op(op, implementation, {
        "xla": lambda: write_state_xla(*args, **kw),
        "pallas": lambda: _write_state_pallas(*args, fmt=fmt, interpret=interpret, rows_per_program=rows_per_program,
                                              num_warps=num_warps)})


def _write_state_pallas(state_cache, proj, ape, positions, slot_mapping, *, fmt, interpret, rows_per_program,
                        num_warps):
    interpret = C.resolve_interpret(interpret)
    t, w = proj.shape
    if not C.is_pow2(w):
        raise Unsupported(f"write_state: state row width {w} is not a power of 2")
    bt = rows_per_program or max(1, 4096 // w)
    for name, v in (("rows_per_program", bt), ("num_warps", num_warps or 1)):
        if not C.is_pow2(v):  # a tile setting, not a shape: an error under "auto" too
            raise ValueError(f"write_state: {name} must be a power of 2 (or None), got {v!r}")
    if t == 0:
        return state_cache
    kernel = functools.partial(_state_kernel, T=t, BT=bt, W=w, r=ape.shape[0], fmt=fmt)
    args = (proj, ape.astype(F32), positions.astype(jnp.int32), slot_mapping.astype(jnp.int32), state_cache)
    return C.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(state_cache.shape, state_cache.dtype),
                         grid=(pl.cdiv(t, bt),), aliases={4: 0}, interpret=interpret, name="compressor_write_state",
                         num_warps=num_warps or 4)(*args)


def _entries_kernel(e_ref, slot_ref, _cache_in, c_out, *, N, BT, D, fmt, interpret):
    t = pl.program_id(0) * BT + C.iota((BT, 1), 0)
    tc = jnp.minimum(t, N - 1)
    slot = C.load(slot_ref, (tc,), (BT, 1))
    k = C.load(e_ref, (tc, C.iota((1, D), 1)), (BT, D))
    C.store_kv_record(c_out, k, slot, (t < N) & (slot >= 0), fmt, interpret)


def insert_entries(cache, entries, slots, *, fmt: RecordFormat, implementation: Implementation = "pallas",
                   interpret: bool | None = None, rows_per_program: int | None = None, num_warps: int | None = None):
    """``cache`` with ``entries`` [N, D] written at ``slots`` [N] int32 (-1 writes nothing) in ``fmt``:
    ``jds.ops.paging.write_records``' result, bit for bit (the same packing: bf16 rounding, UE8M0 block exponents
    by bits, e4m3 round to nearest even). For the compressors' entries, which only ``pool_norm_rope`` computes.
    cache: pages of ``fmt`` (donate it: updated in place). ``fmt``: ``MlaRecord584`` or ``FloatRows`` (else
    ``Unsupported``, and "auto" runs XLA). ``rows_per_program``: entries a program writes (default 4)."""
    op = "insert_entries"
    width = check_cache(f"{op}: cache", cache, fmt, "fmt")
    check_array(f"{op}: entries", entries, (("N", None), ("D", width)), "float")
    check_array(f"{op}: slots", slots, (("N", entries.shape[0]),), "int")
    return run_op(op, implementation, {
        "xla": lambda: write_records(cache, fmt, slots, entries),
        "pallas": lambda: _insert_entries_pallas(cache, entries, slots, fmt=fmt, interpret=interpret,
                                                 rows_per_program=rows_per_program, num_warps=num_warps)})


def _insert_entries_pallas(cache, entries, slots, *, fmt, interpret, rows_per_program, num_warps):
    interpret = C.resolve_interpret(interpret)
    d = entries.shape[1]
    if not isinstance(fmt, (MlaRecord584, FloatRows)):
        raise Unsupported(f"insert_entries: format {fmt} (the kernel writes MlaRecord584 or FloatRows)")
    if not C.is_pow2(d) or (isinstance(fmt, MlaRecord584) and (d % fmt.block or d // fmt.block < fmt.scale_bytes)):
        raise Unsupported(f"insert_entries: row width {d} (a power of 2; with {fmt}, whole blocks, one a scale byte)")
    return _rows_call("insert_entries", _entries_kernel, entries, slots, cache, bt=rows_per_program or 4,
                      num_warps=num_warps, interpret=interpret, fmt=fmt)


def _rows_call(op: str, body, x, slots, cache, *, bt: int, num_warps: int | None, interpret: bool, **kw):
    """One launch of the record kernel ``body`` over the rows of ``x`` [N, D], ``bt`` a program, writing ``cache``
    in place at ``slots``."""
    for name, v in (("rows_per_program", bt), ("num_warps", num_warps or 1)):
        if not C.is_pow2(v):  # a tile setting, not a shape: an error under "auto" too
            raise ValueError(f"{op}: {name} must be a power of 2 (or None), got {v!r}")
    n, d = x.shape
    if n == 0:
        return cache
    kernel = functools.partial(body, N=n, BT=bt, D=d, interpret=interpret, **kw)
    return C.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype), grid=(pl.cdiv(n, bt),),
                         aliases={2: 0}, interpret=interpret, name=f"compressor_{op}",
                         num_warps=num_warps or 4)(x, slots.astype(jnp.int32), cache)


def _index_keys_kernel(k_ref, slot_ref, _cache_in, c_out, *, N, BT, D, dtype, fmt, interpret):
    t = pl.program_id(0) * BT + C.iota((BT, 1), 0)
    tc = jnp.minimum(t, N - 1)
    col = C.iota((1, D), 1)
    slot = C.load(slot_ref, (tc,), (BT, 1))
    k = C.load(k_ref, (tc, col), (BT, D)).astype(dtype)  # prepare_indexer_k without the Hadamard
    C.store_index_record(c_out, [k], [col], slot, (t < N) & (slot >= 0), fmt, interpret)


def insert_index_keys(cache, keys, slots, *, fmt: RecordFormat, hadamard: bool, dtype,
                      implementation: Implementation = "pallas", interpret: bool | None = None,
                      rows_per_program: int | None = None, num_warps: int | None = None):
    """``cache`` with the indexer keys [N, D] (``prepare_indexer_k``'d: rounded to ``dtype``, Hadamard-rotated
    with ``hadamard``) written at ``slots`` [N] int32 (-1 writes nothing) in ``fmt``: ``write_records``' result,
    bit for bit. The kernel takes ``IndexerRecord132`` with ue8m0 scales or ``FloatRows`` and no Hadamard (the
    serving numerics); otherwise ``Unsupported`` ("auto" runs XLA). cache: donate it (updated in place)."""
    op = "insert_index_keys"
    width = check_cache(f"{op}: cache", cache, fmt, "fmt")
    check_array(f"{op}: keys", keys, (("N", None), ("D", width)), "float")
    check_array(f"{op}: slots", slots, (("N", keys.shape[0]),), "int")
    return run_op(op, implementation, {
        "xla": lambda: write_records(cache, fmt, slots, prepare_indexer_k(keys, hadamard=hadamard, dtype=dtype)),
        "pallas": lambda: _insert_index_keys_pallas(cache, keys, slots, fmt=fmt, hadamard=hadamard, dtype=dtype,
                                                    interpret=interpret, rows_per_program=rows_per_program,
                                                    num_warps=num_warps)})


def _insert_index_keys_pallas(cache, keys, slots, *, fmt, hadamard, dtype, interpret, rows_per_program, num_warps):
    interpret = C.resolve_interpret(interpret)
    d = keys.shape[1]
    if hadamard:
        raise Unsupported("insert_index_keys: the kernel writes keys without the Hadamard rotation")
    if not (isinstance(fmt, FloatRows) or (isinstance(fmt, IndexerRecord132) and fmt.scale_fmt == "ue8m0")):
        raise Unsupported(f"insert_index_keys: format {fmt} (the kernel writes IndexerRecord132 with ue8m0 scales "
                          "or FloatRows)")
    if not C.is_pow2(d):
        raise Unsupported(f"insert_index_keys: key width {d} is not a power of 2")
    return _rows_call("insert_index_keys", _index_keys_kernel, keys, slots, cache, bt=rows_per_program or 8,
                      num_warps=num_warps, interpret=interpret, dtype=jnp.dtype(dtype), fmt=fmt)
