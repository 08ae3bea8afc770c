"""DeepSeek-V3.2 producer kernels (vLLM's ``fused_norm_rope`` and ``fused_q`` stages), Pallas on GPU.

* ``fused_kv_insert_v32`` — per token: kv latent RMSNorm + interleaved RoPE on k_pe -> the MLA cache
  record at ``slot_mapping`` (656-byte ``fp8_ds_mla``, UE8M0 or vLLM amax scales, or bf16/f32 rows);
  indexer key LayerNorm -> RoPE on the first rope dims (NeoX, or interleaved for GLM) -> Hadamard ->
  FP8 quantisation -> the 132-byte indexer record (or float rows). Slot -1 writes nothing. Both caches
  are updated in place (``input_output_aliases``: donate them to keep XLA from copying).
  XLA implementation: ``jds.ops.fused_insert.kv_insert_v32_xla``.
* ``fused_q_v32`` — MLA q_pe interleaved RoPE; indexer q RoPE -> Hadamard -> per-(token, head) FP8
  quantisation with the q scale folded into the head weights (w * q_scale * Di^-1/2 * Hi^-1/2).
  XLA implementation: ``jds.ops.fused_insert.q_v32_xla``.

Backend and layout rules: see pallas_kernels/fused_insert_common.py (Triton lowering; why not Mosaic GPU).
``implementation``: see jds.ops.dispatch (``"xla"``, ``"pallas"`` — GPU interpret mode off-GPU — or ``"auto"``).
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jds.ops.hadamard import hadamard_matrix
from jds.ops.dispatch import Implementation, Unsupported, check_array, check_int, run_op
from jds.ops.fused_insert import kv_insert_v32_xla, q_v32_xla
from jds.ops.paging import RecordFormat, check_cache, record_dim
from jds.ops.quant import FLT_MIN, FP8, FP8_MAX, ue8m0_scale_bits
from jds.ops.records import IndexerRecord132, MlaRecord656
from pallas_kernels import fused_insert_common as C

F32 = jnp.float32
SCALE_FMTS = ("ue8m0", "amax")  # the indexer q's activation scale formats (jds.ops.quant.ScaleFmt)


# =====================================================================================================
# kv latent + rope key -> MLA cache; indexer key -> indexer cache
# =====================================================================================================
# the XLA implementation: jds.ops.fused_insert.kv_insert_v32_xla (the name below is kept for the tests)
fused_kv_insert_v32_reference = kv_insert_v32_xla


def _kv_insert_kernel(kv_ref, ik_ref, cos_ref, sin_ref, slot_ref, kvw_ref, knw_ref, knb_ref, *rest,
                      T, BT, lat, rd, di, eps, dtype, kv_fmt, idx_fmt, ilv, hadamard, dot_dtype, interpret, split,
                      pairs_in_registers, halves, kc=0, ic=0):
    """``kc`` / ``ic``: the first column of the rows in ``kv_ref`` / ``ik_ref``."""
    if hadamard:
        h_ref, _, _, kv_out, ix_out = rest
    else:
        h_ref = None
        _, _, kv_out, ix_out = rest
    pid = pl.program_id(0)
    t = pid * BT + C.iota((BT, 1), 0)  # [BT, 1]
    tc = jnp.minimum(t, T - 1)
    slot = C.load(slot_ref, (tc,), (BT, 1))
    ok = (t < T) & (slot >= 0)

    def mla():
        # ---- MLA: latent RMSNorm (weighted) and k_pe RoPE ----
        # The latent as its 128-column quantisation blocks, [BT, 128] each in one register layout: a [BT, lat]
        # tile reshaped to [BT, lat / 128, 128] for the per-block amax made Triton convert it (and its e4m3
        # bytes) through shared memory, barrier by barrier.
        nblk = lat // 128 if isinstance(kv_fmt, MlaRecord656) else 1
        bw = lat // nblk
        cols = [b * bw + C.iota((1, bw), 1) for b in range(nblk)]
        xs = [C.load(kv_ref, (tc, kc + cb), (BT, bw)).astype(F32) for cb in cols]
        ss = functools.reduce(jnp.add, [jnp.sum(xb * xb, axis=-1, keepdims=True) for xb in xs])
        r = jax.lax.rsqrt(ss * np.float32(1 / lat) + eps)
        # the weights loaded as [BT, bw] (rows of L1 hits): a [1, bw] load gets a layout of its own, and the
        # product took it, converting every block through shared memory
        cs_ = [(xb * r * C.load(kvw_ref, (cb,), (BT, bw)).astype(F32)).astype(dtype) for xb, cb in zip(xs, cols)]
        p, jp = C.iota((1, rd), 1), C.iota((1, rd // 2), 1)  # rope columns, their pairs
        u, v = C.split_pairs(C.load(kv_ref, (tc, kc + lat + p), (BT, rd)).astype(F32))  # interleaved pairs
        cs, sn = C.load(cos_ref, (tc, jp), (BT, rd // 2)), C.load(sin_ref, (tc, jp), (BT, rd // 2))
        pe = C.join_pairs(*C.rope_pair(u, v, cs, sn)).astype(dtype)

        page, j = C.page_entry(kv_out, slot, ok, kv_fmt.entries_per_page)
        if isinstance(kv_fmt, MlaRecord656):
            base = j * kv_fmt.record_bytes
            scales = []  # each block's fp32 scale [BT, 1]
            for cb, c in zip(cols, cs_):
                cf = c.astype(F32)
                amax = jnp.max(jnp.abs(cf), axis=-1, keepdims=True)
                if kv_fmt.scale_fmt == "ue8m0":
                    s, inv, _ = ue8m0_scale_bits(amax)
                    q = C.e4m3_bytes(cf * inv, interpret)
                else:  # vLLM: max(amax / 448, FLT_MIN), then a true division
                    s = jnp.maximum(C.div_rn(amax, jnp.full(amax.shape, FP8_MAX, F32), interpret), FLT_MIN)
                    q = C.e4m3_bytes(C.div_rn(cf, jnp.broadcast_to(s, cf.shape), interpret), interpret)
                C.store(kv_out, (page, base + cb), q, ok)
                scales.append(s)
            C.store(kv_out, (page, base + lat + C.iota((1, 4 * nblk), 1)), C.f32_bytes(scales), ok)
            lo, hi = C.u16_bytes(pe.astype(jnp.bfloat16))  # the rope's bf16 bytes, little-endian: one store
            C.store(kv_out, (page, base + lat + 4 * nblk + C.iota((1, 2 * rd), 1)), C.join_pairs(lo, hi), ok)
        else:  # FloatRows(lat + rd)
            base = j * kv_fmt.dim
            C.store(kv_out, (page, base + cols[0]), cs_[0].astype(kv_out.dtype), ok)
            C.store(kv_out, (page, base + lat + p), pe.astype(kv_out.dtype), ok)

    # the indexer key's columns as one group, or as two halves (the Hadamard by ``hadamard_halves``); the rope lies
    # in the first group
    ng = 2 if halves else 1
    gw = di // ng
    icols = [g * gw + C.iota((1, gw), 1) for g in range(ng)]

    def indexer_inputs() -> tuple[list[jax.Array], tuple[jax.Array, ...]]:
        """The indexer key's DRAM inputs: its row's column groups and the rope's cos / sin (with loaded partners,
        those too)."""
        xs = [C.load(ik_ref, (tc, ic + c), (BT, gw)) for c in icols]
        if pairs_in_registers:
            f = C.rope_freqs(gw, rd, ilv)
            return xs, (C.load(cos_ref, (tc, f), (BT, f.shape[1])), C.load(sin_ref, (tc, f), (BT, f.shape[1])))
        in_rope, pci, fci, _ = C.rope_partner(icols[0], 0, rd, ilv)
        return xs, (C.load(ik_ref, (tc, ic + pci), (BT, gw), mask=in_rope), C.load(cos_ref, (tc, fci), (BT, gw)),
                    C.load(sin_ref, (tc, fci), (BT, gw)))

    def indexer(inputs: tuple[list[jax.Array], tuple[jax.Array, ...]]) -> None:
        # ---- indexer key: LayerNorm -> RoPE (first rd dims) -> Hadamard -> quantise ----
        xs, rope_in = [x.astype(F32) for x in inputs[0]], inputs[1]
        mu = sum(jnp.sum(x, axis=-1, keepdims=True) for x in xs) * np.float32(1 / di)
        var = sum(jnp.sum(jnp.square(x - mu), axis=-1, keepdims=True) for x in xs) * np.float32(1 / di)
        rs = jax.lax.rsqrt(var + eps)

        def norm(cols: jax.Array, x: jax.Array) -> jax.Array:
            w, b = C.load(knw_ref, (cols,), (BT, gw)), C.load(knb_ref, (cols,), (BT, gw))
            return ((x - mu) * rs * w + b).astype(dtype)

        ks = [norm(c, x) for c, x in zip(icols, xs)]
        if pairs_in_registers:  # the partners by reshaping in registers (``rope_row_block``)
            ks[0] = C.rope_row_block(ks[0].astype(F32), lambda _: rope_in, rd, ilv).astype(dtype)
        else:  # the partners loaded again, permuted (an L1 hit), and normalised alike
            in_rope, pci, _, firsti = C.rope_partner(icols[0], 0, rd, ilv)
            kp = norm(pci, rope_in[0].astype(F32))
            ks[0] = C.rope_rows(ks[0].astype(F32), kp.astype(F32), *rope_in[1:], firsti, in_rope).astype(dtype)
        if hadamard:
            ks = (C.hadamard_halves(*ks, h_ref, dot_dtype, dtype) if halves
                  else [C.hadamard(ks[0], h_ref, dot_dtype, dtype)])

        C.store_index_record(ix_out, ks, icols, slot, ok, idx_fmt, interpret)

    C.phases_loads_first(split, mla, indexer_inputs, indexer)


def supports(latent_dim: int, rope_dim: int, index_head_dim: int) -> bool:
    """Whether both V3.2 kernels take these dims (Triton blocks are powers of two). Otherwise the kernels
    raise ``Unsupported`` and ``implementation="auto"`` runs the XLA implementation. The indexer rows are handled
    as two halves (``fused_insert_common.hadamard_halves``), the rope in the first: rope_dim <= index_head_dim / 2,
    and halves of at least 16 columns (tl.dot's smallest K)."""
    return (all(C.is_pow2(n) for n in (latent_dim, rope_dim, index_head_dim))
            and _indexer_halves_fit(rope_dim, index_head_dim))


def _indexer_halves_fit(rd: int, di: int) -> bool:
    return rd <= di // 2 and di >= 32


def _check_indexer_dims(op: str, rd: int, di: int) -> None:
    if not _indexer_halves_fit(rd, di):
        raise Unsupported(f"{op}: the indexer rows run as halves with the rope in the first: rope dim {rd} must be "
                          f"at most half the indexer head dim {di}, which must be at least 32")


def fused_kv_insert_v32(kv, index_k, cos, sin, slot_mapping, kv_cache, index_cache, kv_norm_w, k_norm_w,
                        k_norm_b, *, kv_format: RecordFormat, index_format: RecordFormat, eps: float, dtype,
                        indexer_interleave: bool, hadamard: bool, implementation: Implementation = "pallas",
                        interpret: bool | None = None, block_tokens: int | None = None, num_warps: int = 4,
                        split_phases: bool | None = None, rope_pairs: C.RopePairs = None,
                        hadamard_halves: bool | None = None, kv_col: int | None = None,
                        index_col: int | None = None):
    """Same inputs/outputs as ``fused_kv_insert_v32_reference``; returns (kv_cache, index_cache).

    Tiles: ``block_tokens`` tokens per program (None: ``kv_block_tokens``), ``num_warps``; 4 warps were faster
    than 2 or 8 on the GPU timeline (``benchmarks/results/archive/insert_parts_warps_h200_2026-12-04.json``).
    ``split_phases``: the MLA record and the indexer key in separate programs (``fused_insert_common.phases``);
    None: where the grid is small (``fused_insert_common.split_phases``). ``rope_pairs``: the indexer key's rope
    partners found in registers ("registers") or loaded again ("loads"); None: by grid size
    (``rope_pairs_in_registers``).
    ``hadamard_halves``: the indexer key as two halves with the Hadamard by ``fused_insert_common.hadamard_halves``
    (a quarter of the matrix per program), or as one row and one dot; None: halves where the parts are not split
    (a large grid, where every program's load of the matrix counts), one dot where they are (the halves' second
    dot and its shared-memory staging lengthen a small grid's latency chain).

    kv [T, lat + rd], index_k [T, Di] in ``dtype``; cos/sin [T, rd/2] float32 (jds.ops.rope.rope_cos_sin);
    slot_mapping [T] int32 (-1 = padding); caches [num_blocks, page_elems] of their formats.
    ``kv_col`` / ``index_col``: kv (index_k) holds the rows in its columns from there on, as wide as its
    format's rows: the layer's fused input projection passed whole, which the kernel reads in place (a slice
    passed instead is a copy XLA makes before the kernel). None: the whole array is the rows.
    """
    kv_rows = C.columns("kv", "kv_col", kv, kv_col, record_dim(kv_format, "kv_format"))
    index_rows = C.columns("index_k", "index_col", index_k, index_col, record_dim(index_format, "index_format"))
    tail = (cos, sin, slot_mapping, kv_cache, index_cache, kv_norm_w, k_norm_w, k_norm_b)
    _check_kv_inputs(kv_rows, index_rows, *tail, kv_format=kv_format, index_format=index_format, hadamard=hadamard)
    kw = dict(kv_format=kv_format, index_format=index_format, eps=eps, dtype=dtype,
              indexer_interleave=indexer_interleave, hadamard=hadamard)
    return run_op("fused_kv_insert_v32", implementation, {
        "xla": lambda: kv_insert_v32_xla(kv_rows, index_rows, *tail, **kw),
        "pallas": lambda: _kv_insert_pallas(kv, index_k, *tail, **kw, interpret=interpret, block_tokens=block_tokens,
                                            num_warps=num_warps, split=split_phases, rope_pairs=rope_pairs,
                                            halves=hadamard_halves, kv_col=kv_col or 0,
                                            index_col=index_col or 0)})


def _check_kv_inputs(kv, index_k, cos, sin, slot_mapping, kv_cache, index_cache, kv_norm_w, k_norm_w, k_norm_b, *,
                     kv_format, index_format, hadamard) -> None:
    """Input errors of every implementation (ValueError naming the argument; static shapes and dtypes only)."""
    op = "fused_kv_insert_v32"
    check_array(f"{op}: kv", kv, (("T", None), ("lat + rd", None)), "float")
    t, width = kv.shape
    rd = C.check_rope_tables(op, cos, sin, t)
    check_array(f"{op}: index_k", index_k, (("T", t), ("Di", None)), "float")
    di = index_k.shape[1]
    if not rd < width:
        raise ValueError(f"{op}: kv width {width} must exceed the rope dim {rd} (2 * cos.shape[-1]): kv is "
                         "[T, lat + rd]")
    if rd > di:
        raise ValueError(f"{op}: index_k head dim {di} must be at least the rope dim {rd} (2 * cos.shape[-1])")
    if hadamard and not C.is_pow2(di):
        raise ValueError(f"{op}: hadamard=True needs a power-of-2 index_k head dim, got {di}")
    check_array(f"{op}: slot_mapping", slot_mapping, (("T", t),), "int")
    kv_width = check_cache(f"{op}: kv_cache", kv_cache, kv_format, "kv_format")
    if kv_width != width:
        raise ValueError(f"{op}: kv width {width} must equal kv_format's row width {kv_width} ({kv_format})")
    index_width = check_cache(f"{op}: index_cache", index_cache, index_format, "index_format")
    if index_width != di:
        raise ValueError(f"{op}: index_k head dim {di} must equal index_format's row width {index_width} "
                         f"({index_format})")
    check_array(f"{op}: kv_norm_w", kv_norm_w, (("lat", width - rd),), "float")
    check_array(f"{op}: k_norm_w", k_norm_w, (("Di", di),), "float")
    check_array(f"{op}: k_norm_b", k_norm_b, (("Di", di),), "float")


def kv_block_tokens(t: int) -> int:
    """The kv insert's default tokens per program: 16, or 8 where 8-token programs are more than
    ``SPLIT_MAX_PROGRAMS`` (T > 2048), so that such a call runs unsplit (at T = 4096 the 16-token grid falls
    under the split rule). On the H200 8 tokens were faster at T = 4096 and 16384, level at 8192, and slower at
    2048 (benchmarks/results/archive/insert_parts_block_tokens_h200_2026-12-04.json)."""
    return 8 if pl.cdiv(t, 8) > C.SPLIT_MAX_PROGRAMS else 16


def _kv_insert_pallas(kv, index_k, cos, sin, slot_mapping, kv_cache, index_cache, kv_norm_w, k_norm_w, k_norm_b,
                      *, kv_format, index_format, eps, dtype, indexer_interleave, hadamard, interpret, block_tokens,
                      num_warps, split, rope_pairs=None, halves=None, kv_col=0, index_col=0):
    for name, n in (("block_tokens", 1 if block_tokens is None else block_tokens), ("num_warps", num_warps)):
        if not C.is_pow2(n):  # a tile setting, not a shape: an error under "auto" too
            raise ValueError(f"fused_kv_insert_v32: {name} must be a power of 2 (or None), got {n!r}")
    if isinstance(index_format, IndexerRecord132) and index_format.scale_fmt != "ue8m0":
        raise Unsupported(f"fused_kv_insert_v32: indexer key scale_fmt {index_format.scale_fmt!r} "
                          "(the kernel implements 'ue8m0')")
    interpret = C.resolve_interpret(interpret)
    t = kv.shape[0]
    width = record_dim(kv_format)  # the rows' columns of kv (from kv_col)
    rd = 2 * cos.shape[-1]
    lat = width - rd
    di = k_norm_w.shape[-1]
    block_tokens = kv_block_tokens(t) if block_tokens is None else block_tokens
    for name, n in (("latent dim", lat), ("rope dim", rd), ("indexer head dim", di)):
        if not C.is_pow2(n):
            raise Unsupported(f"fused_kv_insert_v32: {name} {n} is not a power of 2")
    _check_indexer_dims("fused_kv_insert_v32", rd, di)
    if isinstance(kv_format, MlaRecord656) and (kv_format.latent_dim != lat or kv_format.rope_dim != rd):
        raise ValueError(f"kv_format {kv_format} does not match kv width {width}")
    if t == 0:  # no tokens: nothing to write (and no empty grid)
        return kv_cache, index_cache
    dt = jnp.dtype(dtype)
    bt = block_tokens
    dot_dtype = F32 if (interpret or dt == F32) else jnp.bfloat16
    split = C.split_phases(split, pl.cdiv(t, bt), "fused_kv_insert_v32")
    in_registers = C.rope_pairs_in_registers(rope_pairs, pl.cdiv(t, bt), "fused_kv_insert_v32")
    if halves not in (None, False, True):
        raise ValueError(f"fused_kv_insert_v32: hadamard_halves must be None, False or True, got {halves!r}")
    halves = not split if halves is None else halves
    args = [kv, index_k, cos.astype(F32), sin.astype(F32), slot_mapping.astype(jnp.int32),
            kv_norm_w.astype(F32), k_norm_w.astype(F32), k_norm_b.astype(F32)]
    if hadamard:
        args.append(jnp.asarray(hadamard_matrix(di // 2 if halves else di), dot_dtype))
    n_in = len(args)
    args += [kv_cache, index_cache]
    kernel = functools.partial(
        _kv_insert_kernel, T=t, BT=bt, lat=lat, rd=rd, di=di, eps=eps, dtype=dt, kv_fmt=kv_format,
        idx_fmt=index_format, ilv=indexer_interleave, hadamard=hadamard, dot_dtype=dot_dtype, interpret=interpret,
        split=split, pairs_in_registers=in_registers, halves=halves, kc=kv_col, ic=index_col)
    out_shape = (jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
                 jax.ShapeDtypeStruct(index_cache.shape, index_cache.dtype))
    grid = (pl.cdiv(t, bt), 2) if split else (pl.cdiv(t, bt),)
    return C.pallas_call(kernel, out_shape=out_shape, grid=grid, aliases={n_in: 0, n_in + 1: 1},
                         interpret=interpret, name="v32_kv_insert", num_warps=num_warps)(*args)


# =====================================================================================================
# MLA q_pe RoPE + indexer q prep
# =====================================================================================================
# the XLA implementation: jds.ops.fused_insert.q_v32_xla (the name below is kept for the tests)
fused_q_v32_reference = q_v32_xla


def _q_kernel(q_ref, iq_ref, iw_ref, cos_ref, sin_ref, *rest, T, BT, H, HP, Hi, HiP, nope, rd, di, dtype,
              ilv, hadamard, fp8, dot_dtype, split, interpret):
    h_ref = rest[0] if hadamard else None
    qpe_out, iq_out, is_out, iw_out = rest[1:] if hadamard else rest
    pid = pl.program_id(0)

    def rows(hp: int, h: int):
        """The program's rows, token-major with ``hp`` (padded) heads per token: (token, in range, clamped
        token, clamped head), each [BT * hp, 1]."""
        r = C.iota((BT * hp, 1), 0)
        tok = pid * BT + jax.lax.shift_right_logical(r, C.log2(hp))
        head = r & (hp - 1)
        return tok, (tok < T) & (head < h), jnp.minimum(tok, T - 1), jnp.minimum(head, h - 1)

    def q_pe():
        # ---- MLA q_pe: interleaved RoPE on the last rd dims of every head ----
        tok, ok, tc, hc = rows(HP, H)
        # one contiguous load / store per row, split into (even, odd) pairs [rows, rd / 2] in registers: each
        # element loaded once, not once more as its partner
        j, c = C.iota((1, rd // 2), 1), C.iota((1, rd), 1)
        u, v = C.split_pairs(C.load(q_ref, (tc, hc, nope + c), (BT * HP, rd)).astype(F32))
        even, odd = C.rope_pair(u, v, *C.cos_sin(cos_ref, sin_ref, tc, j, (BT * HP, rd // 2), pid, T, BT))
        tok_out = jnp.where(ok, tok, T)
        C.store(qpe_out, (tok_out, hc, c), C.join_pairs(even.astype(dtype), odd.astype(dtype)), ok)

    irows = rows(HiP, Hi)  # the indexer q's rows, for its loads and its stores

    def indexer_inputs() -> tuple[jax.Array, ...]:
        """The indexer q's DRAM inputs: its rows' halves, the rope's cos / sin and the head weights."""
        _, _, tc, hc = irows
        r = BT * HiP
        half = di // 2
        f = C.rope_freqs(half, rd, ilv)
        return (*(C.load(iq_ref, (tc, hc, g * half + C.iota((1, half), 1)), (r, half)) for g in range(2)),
                *C.cos_sin(cos_ref, sin_ref, tc, f, (r, f.shape[1]), pid, T, BT), C.load(iw_ref, (tc, hc), (r, 1)))

    def indexer(inputs: tuple[jax.Array, ...]) -> None:
        # ---- indexer q: RoPE (first rd dims) -> Hadamard -> per-head FP8 with the scale folded into w ----
        tok, ok, _, hc = irows
        r = BT * HiP
        xa, xb, cs, sn, w = inputs
        # each element loaded once, the rope pairs found in registers (``rope_row_block``); the rows as two
        # halves, the rope in the first (``fused_insert_common.hadamard_halves``)
        half = di // 2
        cols = (C.iota((1, half), 1), half + C.iota((1, half), 1))
        ks = (C.rope_row_block(xa.astype(F32), lambda _: (cs, sn), rd, ilv).astype(dtype), xb.astype(dtype))
        if hadamard:
            ks = C.hadamard_halves(*ks, h_ref, dot_dtype, dtype)
        wf = w.astype(F32) * (di ** -0.5) * (Hi ** -0.5)
        tok_s = jnp.where(ok, tok, T)
        if fp8:
            kf = [k.astype(F32) for k in ks]
            s, inv, _ = ue8m0_scale_bits(jnp.maximum(*(jnp.max(jnp.abs(k), axis=-1, keepdims=True) for k in kf)))
            qv = [C.to_e4m3(k * inv, interpret) for k in kf]
            wf = wf * s
        else:
            qv, s = ks, jnp.ones((r, 1), F32)
        for c, q in zip(cols, qv):
            C.store(iq_out, (tok_s, hc, c), q, ok)
        C.store(is_out, (tok_s, hc), s, ok)
        C.store(iw_out, (tok_s, hc), wf, ok)

    # the indexer's loads ahead of q_pe where they share a program (with the Hadamard in halves the registers allow
    # it: faster up to T = 1024, slightly slower at 8192; docs/perf-log.md, twenty-ninth session)
    C.phases_loads_first(split, q_pe, indexer_inputs, indexer)


def fused_q_v32(q, index_q, index_w, cos, sin, *, nope_dim: int, dtype, indexer_interleave: bool,
                hadamard: bool, fp8: bool, scale_fmt: str = "ue8m0", implementation: Implementation = "pallas",
                interpret: bool | None = None, rows_per_program: int = 64, num_warps: int = 4,
                split_phases: bool | None = None):
    """Same inputs/outputs as ``fused_q_v32_reference``. ``split_phases``: q_pe and the indexer q in separate
    programs (``fused_insert_common.phases``); None: where the grid is small (``fused_insert_common.split_phases``).

    Tiling: ``rows_per_program`` // max(H, Hi) tokens per program (at least one, and at least 16
    indexer rows for the Hadamard dot). One token per program and 4 warps each beat two tokens with 8 warps
    (the previous default) at T = 8192 with bit-identical outputs (``benchmarks/results/kernels_fused_insert_*.json``,
    rows with ``tiles``; ``archive/fused_insert_defaults_h200_2026-11-29.json``: new against old default)."""
    args = (q, index_q, index_w, cos, sin)
    _check_q_inputs(*args, nope_dim=nope_dim, hadamard=hadamard, scale_fmt=scale_fmt)
    kw = dict(nope_dim=nope_dim, dtype=dtype, indexer_interleave=indexer_interleave, hadamard=hadamard, fp8=fp8)
    return run_op("fused_q_v32", implementation, {
        "xla": lambda: q_v32_xla(*args, **kw, scale_fmt=scale_fmt),
        "pallas": lambda: _q_pallas(*args, **kw, scale_fmt=scale_fmt, interpret=interpret,
                                    rows_per_program=rows_per_program, num_warps=num_warps,
                                    split=split_phases)})


def _check_q_inputs(q, index_q, index_w, cos, sin, *, nope_dim, hadamard, scale_fmt) -> None:
    """Input errors of every implementation (ValueError naming the argument; static shapes and dtypes only)."""
    op = "fused_q_v32"
    check_array(f"{op}: q", q, (("T", None), ("H", None), ("nope + rd", None)), "float")
    t, _, qk = q.shape
    rd = C.check_rope_tables(op, cos, sin, t)
    nope = check_int(f"{op}: nope_dim", nope_dim, 0)
    if qk != nope + rd:
        raise ValueError(f"{op}: q head dim {qk} must equal nope_dim {nope} + the rope dim {rd} (2 * cos.shape[-1])")
    check_array(f"{op}: index_q", index_q, (("T", t), ("Hi", None), ("Di", None)), "float")
    _, hi, di = index_q.shape
    if rd > di:
        raise ValueError(f"{op}: index_q head dim {di} must be at least the rope dim {rd} (2 * cos.shape[-1])")
    if hadamard and not C.is_pow2(di):
        raise ValueError(f"{op}: hadamard=True needs a power-of-2 index_q head dim, got {di}")
    check_array(f"{op}: index_w", index_w, (("T", t), ("Hi", hi)), "float")
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"{op}: scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")


def _q_pallas(q, index_q, index_w, cos, sin, *, nope_dim, dtype, indexer_interleave, hadamard, fp8, scale_fmt,
              interpret, rows_per_program, num_warps, split):
    if not C.is_pow2(num_warps):  # a tile setting, not a shape: an error under "auto" too
        raise ValueError(f"fused_q_v32: num_warps must be a power of 2, got {num_warps!r}")
    if fp8 and scale_fmt != "ue8m0":  # the kernel quantises with power-of-two scales (an exact multiply)
        raise Unsupported(f"fused_q_v32: indexer q scale_fmt {scale_fmt!r} (the kernel implements 'ue8m0')")
    interpret = C.resolve_interpret(interpret)
    t, h, qk = q.shape
    _, hi, di = index_q.shape
    rd = 2 * cos.shape[-1]
    if qk != nope_dim + rd:
        raise ValueError(f"q head dim {qk} != nope {nope_dim} + rope {rd}")
    for name, n in (("rope dim", rd), ("indexer head dim", di)):
        if not C.is_pow2(n):
            raise Unsupported(f"fused_q_v32: {name} {n} is not a power of 2")
    _check_indexer_dims("fused_q_v32", rd, di)
    if t == 0:  # no tokens: empty outputs (and no empty grid)
        return (jnp.zeros((0, h, rd), dtype), jnp.zeros((0, hi, di), FP8 if fp8 else dtype),
                jnp.zeros((0, hi), F32), jnp.zeros((0, hi), F32))
    hp, hip = C.next_pow2(h), C.next_pow2(hi)
    # tokens per program: >= 16 indexer rows (tl.dot's minimum M), at most ``rows_per_program`` rows
    bt = max(1, C.next_pow2(max(16, rows_per_program) // max(hp, hip)))
    bt = max(bt, C.next_pow2(-(-16 // hip)))
    dt = jnp.dtype(dtype)
    dot_dtype = F32 if (interpret or dt == F32) else jnp.bfloat16
    args = [q, index_q, index_w.astype(F32), cos.astype(F32), sin.astype(F32)]
    if hadamard:
        args.append(jnp.asarray(hadamard_matrix(di // 2), dot_dtype))  # ``hadamard_halves``
    split = C.split_phases(split, pl.cdiv(t, bt), "fused_q_v32")
    kernel = functools.partial(_q_kernel, T=t, BT=bt, H=h, HP=hp, Hi=hi, HiP=hip, nope=nope_dim, rd=rd, di=di,
                               dtype=dt, ilv=indexer_interleave, hadamard=hadamard, fp8=fp8, dot_dtype=dot_dtype,
                               split=split, interpret=interpret)
    out_shape = (jax.ShapeDtypeStruct((t, h, rd), dt), jax.ShapeDtypeStruct((t, hi, di), FP8 if fp8 else dt),
                 jax.ShapeDtypeStruct((t, hi), F32), jax.ShapeDtypeStruct((t, hi), F32))
    grid = (pl.cdiv(t, bt), 2) if split else (pl.cdiv(t, bt),)
    return C.pallas_call(kernel, out_shape=out_shape, grid=grid, aliases={}, interpret=interpret, name="v32_fused_q",
                         num_warps=num_warps)(*args)
