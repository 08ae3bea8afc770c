"""Helpers shared by the fused norm/RoPE/cache-insert kernels (fused_insert_v32.py, fused_insert_v4.py) and the V4
compressor's kernels (compressor_pool.py).

Backend: the Pallas *Triton* lowering (``pl.pallas_call`` with ``jax.experimental.pallas.triton``
compiler params; ``interpret=True`` on the CPU), not Mosaic GPU. Why (jax 0.11.2, Hopper):

* the cache records are byte rows mixing e4m3 values, fp32 scales / UE8M0 exponent bytes and bf16 rope
  values in one ``uint8`` array. Mosaic GPU has no ref bitcast (its lowering knows no bitcast transform)
  and register bitcasts must keep the element width, so each fp32/bf16 would have to be split into bytes
  and stored through strided SMEM views of 4- to 64-element arrays, which the warpgroup layouts reject;
* per-token scatter targets are small and unaligned for TMA: the indexer scale is 4 bytes at
  ``bs*128 + 4*j`` and V4's scale group 8 bytes at ``bs*576 + 8*j`` (TMA needs 16-byte granules), and
  Mosaic GPU rejects vector indices on Hopper ("Arrays are not supported as indices"; TMA gather/scatter
  is sm100 only), so every row would be a separate scalar-indexed copy;
* Triton expresses all of it directly: per-element pointer arithmetic with masks (slot -1 and the
  token tail write nothing), same-width bitcasts plus shifts for the byte split, RNE f32->e4m3;
* and the Triton lowering runs on a CPU-only machine (``check_triton_lowering``), so the kernels are
  lowered to Triton IR in the CPU tests; Mosaic GPU's lowering needs the CUDA plugin.

Every load/store uses *array* indices only (no strided slices: interpret mode rejects strides), on
the arrays' natural 2-D/3-D shapes so that the Triton lowering widens offsets to 64 bits when a cache
exceeds 4 GiB. Masked-out store lanes are pointed one past the first axis (an out-of-range index that
interpret mode's scatter drops); masked-out load lanes are clamped to valid rows.
"""

from __future__ import annotations

import functools

import math
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jds.ops.dispatch import check_array, describe
from jds.ops.dispatch import resolve_interpret  # re-exported: the Triton kernels call C.resolve_interpret
from jds.ops.quant import FP8, FP8_MAX, true_divide, ue8m0_scale_bits
from jds.ops.records import IndexerRecord132, MlaRecord584

F32 = jnp.float32




def is_pow2(n: int) -> bool:
    """n is a positive power of two (False for anything not an int: a float or bool setting is not a size)."""
    return isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def check_rope_tables(op: str, cos: Any, sin: Any, t: int) -> int:
    """ValueError naming the table unless cos and sin are float [T, rd/2] of one shape (rd >= 2); returns rd."""
    check_array(f"{op}: cos", cos, (("T", t), ("rd/2", None)), "float")
    check_array(f"{op}: sin", sin, (("T", t), ("rd/2", cos.shape[1])), "float")
    if cos.shape[1] < 1:
        raise ValueError(f"{op}: cos and sin must have at least one column (rd/2 >= 1), got {describe(cos)}")
    return 2 * cos.shape[1]


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def log2(n: int) -> int:
    assert is_pow2(n), n
    return int(math.log2(n))


# split_phases=None: the parts split (``phases``) when a call has at most this many programs unsplit. On the
# H200 (benchmarks/results/archive/insert_parts_split_h200_2026-12-03.json, "split") the split won at 1 to 64
# programs, tied at 1024 (the fused q at T = 1024) and lost at 512 (kv insert, T = 8192) and 8192 (fused q).
SPLIT_MAX_PROGRAMS = 256


def split_phases(split: bool | None, programs: int, op: str) -> bool:
    """``split`` as given, or (None) whether a grid of ``programs`` is small enough that latency, not throughput,
    sets the call's time."""
    if split not in (None, False, True):
        raise ValueError(f"{op}: split_phases must be None, False or True, got {split!r}")
    return programs <= SPLIT_MAX_PROGRAMS if split is None else split


# rope_pairs=None (the V3.2 kv insert): the indexer key's rope partners are found in registers when a call has at
# most this many programs, else loaded again. The native build compiles the register form to far more registers
# per thread than the loaded one (Nsight Compute; the CPU's Triton does not): faster where one program's latency
# sets the time (T = 1 to 1024: 64 programs), slower at 512 (T = 8192)
# (benchmarks/results/archive/insert_parts_variants_h200_2026-12-04.json, pairs_loads / pairs_registers).
REGISTER_PAIRS_MAX_PROGRAMS = 256

RopePairs = Literal["registers", "loads"] | None


def rope_pairs_in_registers(choice: RopePairs, programs: int, op: str) -> bool:
    """``choice`` as given, or (None) whether a grid of ``programs`` is small enough for the register form."""
    if choice not in (None, "registers", "loads"):
        raise ValueError(f"{op}: rope_pairs must be None, 'registers' or 'loads', got {choice!r}")
    return programs <= REGISTER_PAIRS_MAX_PROGRAMS if choice is None else choice == "registers"


NUM_WARPS: dict[str, int] = {}  # kernel name -> num_warps of its last launch (for compile_sm90_report)


def pallas_call(kernel: Any, *, out_shape: Any, grid: tuple[int, ...], aliases: dict[int, int],
                interpret: bool, name: str, num_warps: int = 4) -> Any:
    """pl.pallas_call on the Triton backend (explicit Triton params; GPU interpret mode on the CPU)."""
    NUM_WARPS[name] = num_warps
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, input_output_aliases=aliases,
                          interpret=interpret, name=name,
                          compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1))


# ----- kernel-side helpers (traced inside kernel bodies) ----------------------------------------------
def phases(split: bool, *parts: Callable[[], None]) -> None:
    """A kernel's independent parts (their own loads, math and stores): one after the other in every program,
    or, with ``split``, each in its own programs along grid axis 1 (the caller's grid has ``len(parts)`` there).
    Why: a load after a store stays after it (the compiler cannot tell that the outputs and the inputs do not
    alias), so in one program the parts' memory round trips add up; split, a program waits on one part's. That
    is what sets the time of a call with few programs (decode)."""
    if not split:
        for f in parts:
            f()
        return
    ph = pl.program_id(1)
    for i, f in enumerate(parts):
        pl.when(ph == i)(f)


def phases_loads_first(split: bool, first: Callable[[], None], loads: Callable[[], Any],
                       second: Callable[[Any], None]) -> None:
    """Two parts as ``phases``; where they share a program, the second part's DRAM loads (``loads()``, handed to
    ``second``) are issued before the first part: after its stores they would wait behind them."""
    if split:
        phases(True, first, lambda: second(loads()))
        return
    inputs = loads()
    first()
    second(inputs)


def iota(shape: tuple[int, ...], dim: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def store(ref: Any, idx: tuple[jax.Array, ...], val: jax.Array, mask: jax.Array) -> None:
    """Masked scatter store; all index arrays are broadcast to the value's shape."""
    idx = tuple(jnp.broadcast_to(i, val.shape) for i in idx)
    plt.store(ref.at[idx], val, mask=jnp.broadcast_to(mask, val.shape))


def load(ref: Any, idx: tuple[jax.Array, ...], shape: tuple[int, ...], mask: jax.Array | None = None,
         other: float | int = 0) -> jax.Array:
    """Gather load at in-range indices (optionally masked, masked lanes = ``other``)."""
    idx = tuple(jnp.broadcast_to(i, shape) for i in idx)
    if mask is None:
        return ref[idx]
    return plt.load(ref.at[idx], mask=jnp.broadcast_to(mask, shape), other=other)


def div_rn(x: jax.Array, y: jax.Array, interpret: bool) -> jax.Array:
    """IEEE round-to-nearest x / y (same shape): jds.ops.quant.true_divide on the CPU, PTX div.rn.f32
    on the GPU (Triton lowers ``/`` to an approximate division)."""
    if interpret:
        return true_divide(x, y)
    return plt.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[x.astype(F32), y.astype(F32)],
                                      constraints="=r,r,r", pack=1,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, F32)])[0]


def to_e4m3(x_scaled: jax.Array, interpret: bool) -> jax.Array:
    """clip(x, +-448) -> float8_e4m3fn, round to nearest even (jds.ops.quant.quantize_e4m3). On the GPU without
    the clip: Triton converts with ``cvt.rn.satfinite``, which clamps to +-448 itself (and keeps a NaN a NaN, as
    XLA's clamp does, where Triton's min / max would turn it into +-448), so the two compares per element were
    redundant instructions; interpret mode's XLA conversion does not saturate, so it keeps the clip."""
    if interpret:
        x_scaled = jnp.clip(x_scaled, -FP8_MAX, FP8_MAX)
    return x_scaled.astype(FP8)


def e4m3_bytes(x_scaled: jax.Array, interpret: bool) -> jax.Array:
    """``to_e4m3``'s uint8 bit patterns."""
    return jax.lax.bitcast_convert_type(to_e4m3(x_scaled, interpret), jnp.uint8)


def u16_bytes(x_bf16: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Little-endian (low, high) bytes of bf16 values."""
    u = jax.lax.bitcast_convert_type(x_bf16, jnp.uint16)
    return (u & 0xFF).astype(jnp.uint8), jax.lax.shift_right_logical(u, jnp.uint16(8)).astype(jnp.uint8)


def f32_bytes(xs: list[jax.Array]) -> jax.Array:
    """fp32 columns [rows, 1] each -> their bytes, little-endian, side by side [rows, 4 len(xs)] (uint8): a record's
    scales as one contiguous store."""
    sc = iota((1, 4 * len(xs)), 1)
    words = [jax.lax.bitcast_convert_type(x, jnp.uint32) for x in xs]
    word = functools.reduce(lambda w, b: jnp.where(sc // 4 == b, words[b], w), range(1, len(words)), words[0])
    return (jax.lax.shift_right_logical(word, (8 * (sc % 4)).astype(jnp.uint32)) & 0xFF).astype(jnp.uint8)


def page_entry(out: Any, slot: jax.Array, ok: jax.Array, entries_per_page: int) -> tuple[jax.Array, jax.Array]:
    """A slot's (page, entry in page) in the cache ``out``; rows not ``ok`` get the page one past the last (an
    out-of-range index their masked stores drop) and entry 0, whatever their slot."""
    safe = jnp.where(ok, slot, 0)
    return jnp.where(ok, jax.lax.div(safe, entries_per_page), out.shape[0]), jax.lax.rem(safe, entries_per_page)


def store_kv_record(c_out: Any, k: jax.Array, slot: jax.Array, ok: jax.Array, fmt: Any, interpret: bool) -> None:
    """Store rows ``k`` [BT, D] at their slots [BT, 1] (``ok`` [BT, 1]: rows to write; a masked row's slot may be
    anything) of a cache ``c_out`` of V4's row formats: the 584-byte ``MlaRecord584`` (its ``pack``: e4m3 NoPE in
    64-wide UE8M0 blocks of the bf16-rounded values, bf16 rope, exponent bytes and a zero pad byte) or
    ``FloatRows(D)`` (float window / compressed caches, the compressor state)."""
    bt, d = k.shape
    col = iota((1, d), 1)
    epp = fmt.entries_per_page
    page, j = page_entry(c_out, slot, ok, epp)
    if not isinstance(fmt, MlaRecord584):  # FloatRows(D)
        store(c_out, (page, j * fmt.dim + col), k.astype(c_out.dtype), ok)
        return
    nope, blk, data = fmt.nope_dim, fmt.block, fmt.data_bytes
    nblk = d // blk  # NoPE blocks plus the rope block(s), whose scales are not stored
    kb = k.astype(jnp.bfloat16)
    nf = kb.astype(F32).reshape(bt, nblk, blk)
    _, inv, e = ue8m0_scale_bits(jnp.max(jnp.abs(nf), axis=-1))  # [BT, nblk]
    q8 = e4m3_bytes(nf * inv[..., None], interpret).reshape(bt, d)
    lo, hi = u16_bytes(kb)
    is_nope = col < nope
    roff = nope + 2 * (col - nope)
    base = j * data
    store(c_out, (page, base + jnp.where(is_nope, col, roff)), jnp.where(is_nope, q8, lo), ok)
    store(c_out, (page, jnp.where(is_nope, c_out.shape[1], base + roff + 1)), hi, ok & ~is_nope)
    # scale bytes: nblk >= n_scales + 1 (one pad byte per entry, written as 0)
    b = iota((1, nblk), 1)
    ebytes = jnp.where(b < fmt.n_scales, e, 0).astype(jnp.uint8)
    store(c_out, (page, epp * data + j * fmt.scale_bytes + b), ebytes, ok & (b < fmt.scale_bytes))


def store_index_record(ix_out: Any, ks: list[jax.Array], cols: list[jax.Array], slot: jax.Array, ok: jax.Array,
                       fmt: Any, interpret: bool) -> None:
    """Store indexer keys, given as column groups ``ks[i]`` [BT, gw] at columns ``cols[i]`` [1, gw], at their slots
    [BT, 1] (``ok``: rows to write) of an indexer cache ``ix_out``: ``IndexerRecord132`` (e4m3 values, one UE8M0
    fp32 scale over the whole key: its ``pack`` with ue8m0 scales) or ``FloatRows``."""
    epp = fmt.entries_per_page
    page, j = page_entry(ix_out, slot, ok, epp)
    if not isinstance(fmt, IndexerRecord132):  # FloatRows
        for c, k in zip(cols, ks):
            store(ix_out, (page, j * fmt.dim + c), k.astype(ix_out.dtype), ok)
        return
    kf = [k.astype(F32) for k in ks]
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(k), axis=-1, keepdims=True) for k in kf])
    s, inv, _ = ue8m0_scale_bits(amax)  # [BT, 1]
    for c, k in zip(cols, kf):
        store(ix_out, (page, j * fmt.dim + c), e4m3_bytes(k * inv, interpret), ok)
    store(ix_out, (page, epp * fmt.dim + j * 4 + iota((1, 4), 1)), f32_bytes([s]), ok)


def rope_rows(y: jax.Array, yp: jax.Array, cs: jax.Array, sn: jax.Array, first_of_pair: jax.Array,
              in_rope: jax.Array) -> jax.Array:
    """RoPE on whole rows given each element's pair partner ``yp`` (float32 in, float32 out).

    jds.ops.rope.apply_rope computes (u*c - v*s, u*s + v*c) for a pair (u, v): the first element of a pair
    gets y*c - yp*s, the second yp*s + y*c (the same products and sum). Outside ``in_rope`` y passes through.
    """
    rot = jnp.where(first_of_pair, y * cs - yp * sn, yp * sn + y * cs)
    return jnp.where(in_rope, rot, y)


def rope_pair(u: jax.Array, v: jax.Array, cs: jax.Array, sn: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Interleaved RoPE of pairs (u, v) = (x[2j], x[2j + 1]) with frequency j's cos / sin (float32): the rotated
    (even, odd) elements, jds.ops.rope.apply_rope's products and sums, (u c - v s, u s + v c); ``rope_rows``
    without the partner loads, for a rope slice read as its pairs."""
    return u * cs - v * sn, v * cs + u * sn


def split_pairs(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows [r, 2n] as their (even, odd) columns [r, n] each: in registers (Triton's split), so that an interleaved
    rope slice is read with one contiguous load, not two stride-2 loads that each use half of every sector."""
    r, n2 = x.shape
    return tuple(jnp.unstack(x.reshape(r, n2 // 2, 2), axis=-1))


def join_pairs(even: jax.Array, odd: jax.Array) -> jax.Array:
    """``split_pairs``' inverse: [r, n] + [r, n] -> [r, 2n] interleaved (Triton's join), for one contiguous store
    where two stride-2 stores would send each sector to L2 twice, half-filled."""
    r, n = even.shape
    return jnp.stack([even, odd], axis=-1).reshape(r, 2 * n)


def rope_row_block(x: jax.Array, cos_sin_at: Callable[[jax.Array], tuple[jax.Array, jax.Array]], rope_dim: int,
                   interleaved: bool) -> jax.Array:
    """RoPE on the first ``rope_dim`` columns of rows ``x`` [rows, width] (float32), the rest passed through, with
    every element loaded once: the pair partners are found by reshaping in registers (interleaved: columns
    (2j, 2j + 1); NeoX: j and j + rope_dim / 2), not by a second, permuted load of the slice.
    ``cos_sin_at(freqs)``: cos / sin [1 or rows, n] of the rows' tokens at frequency columns ``freqs`` [1, n]
    (all below rope_dim / 2). The products and sums are ``rope_rows``'."""
    r, width = x.shape
    half = rope_dim // 2
    freqs = rope_freqs(width, rope_dim, interleaved)
    if interleaved:  # pairs (2j, 2j + 1): pair index j along axis 1, rope where j < half
        u, v = split_pairs(x)
        j = iota((1, width // 2), 1)
        e, o = rope_pair(u, v, *cos_sin_at(freqs))
        return join_pairs(jnp.where(j < half, e, u), jnp.where(j < half, o, v))
    # NeoX: [rows, width / rope_dim, 2, half] -> the pair's halves on the last axis, split in registers
    g = width // rope_dim
    y = jnp.swapaxes(x.reshape(r, g, 2, half), 2, 3)  # [rows, g, half, 2]
    u, v = jnp.unstack(y, axis=-1)  # [rows, g, half] each: first / second halves of each rope_dim group
    c3, s3 = (c.reshape(c.shape[0], 1, half) for c in cos_sin_at(freqs))
    first, second = rope_pair(u, v, c3, s3)
    in_rope = iota((1, g, 1), 1) == 0
    out = jnp.stack([jnp.where(in_rope, first, u), jnp.where(in_rope, second, v)], axis=-1)  # [rows, g, half, 2]
    return jnp.swapaxes(out, 2, 3).reshape(r, width)


def _dot_f32(x: jax.Array, h: jax.Array, dot_dtype: Any) -> jax.Array:
    return jax.lax.dot(x.astype(dot_dtype), h, precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)


def hadamard(x: jax.Array, h_ref: Any, dot_dtype: Any, dtype: Any) -> jax.Array:
    """Rows ``x`` [rows, n] times the Sylvester H_n in ``h_ref``, scaled by n^-1/2 (jds.ops.hadamard): one dot."""
    return (_dot_f32(x, h_ref[...], dot_dtype) * np.float32(x.shape[-1] ** -0.5)).astype(dtype)


def hadamard_halves(a: jax.Array, b: jax.Array, h_ref: Any, dot_dtype: Any, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Rows [a | b] (two halves of width n / 2) times the Sylvester H_n, scaled by n^-1/2 (jds.ops.hadamard), as
    H_n = [[H, H], [H, -H]] with H = H_{n/2} in ``h_ref``: [a H + b H, a H - b H]. The products of +-1 and a
    bf16 are exact and the sums are float32, as in one [rows, n] x H_n dot, but a program loads a quarter of the
    matrix (a [16, 128] x H_128 dot loaded 32 KB per program for 4 KB of payload) and the tensor cores do half
    the work."""
    h = h_ref[...]
    pa, pb = (_dot_f32(x, h, dot_dtype) for x in (a, b))
    scale = np.float32((2 * a.shape[-1]) ** -0.5)
    return ((pa + pb) * scale).astype(dtype), ((pa - pb) * scale).astype(dtype)


def rope_freqs(width: int, rope_dim: int, interleaved: bool) -> jax.Array:
    """The frequency columns [1, n] that ``rope_row_block`` asks its ``cos_sin_at`` for: a caller can load the
    cos / sin early (before a store that its loads would otherwise wait behind) and hand them back."""
    half = rope_dim // 2
    if interleaved:
        return jnp.minimum(iota((1, width // 2), 1), half - 1)
    return iota((1, half), 1)


def cos_sin(cos_ref: Any, sin_ref: Any, tc: jax.Array, cols: jax.Array, shape: tuple[int, int], pid: jax.Array,
            T: int, BT: int) -> tuple[jax.Array, jax.Array]:
    """cos / sin at columns ``cols`` for rows of tokens ``tc`` ([rows, 1]), ``shape`` = (rows, columns); with one
    token per program (``BT`` 1: the default tilings) loaded once as a row that broadcasts over its heads."""
    if BT == 1:
        shape, tc = (1, shape[1]), jnp.minimum(pid, T - 1)
    return load(cos_ref, (tc, cols), shape), load(sin_ref, (tc, cols), shape)


def rope_partner(col: jax.Array, start: int, rope_dim: int, interleaved: bool) -> tuple[
        jax.Array, jax.Array, jax.Array, jax.Array]:
    """For columns ``col`` of a row whose rope slice is [start, start + rope_dim):
    (in_rope, partner column, cos/sin column, first-of-pair) (outside the slice: itself, 0, True)."""
    rel = col - start
    in_rope = (rel >= 0) & (rel < rope_dim)
    half = rope_dim // 2
    if interleaved:
        partner = start + (rel ^ 1)
        freq = jax.lax.shift_right_logical(rel, 1)
        first = (rel & 1) == 0
    else:
        first = rel < half
        partner = jnp.where(first, col + half, col - half)
        freq = jnp.where(first, rel, rel - half)
    return (in_rope, jnp.where(in_rope, partner, col), jnp.where(in_rope, freq, 0), first)


def check_triton_lowering(fn: Any, *args: Any) -> str:
    """Lower ``fn(*args)`` for CUDA (an abstract H200) on any machine and return the HLO text.

    This runs the Pallas -> Triton IR lowering (every primitive needs a Triton rule, every array a
    power-of-2 size, f32->e4m3 casts need sm89+), not ptxas: a CPU-side check of what the H200 run
    compiles. Pass ``interpret=False`` through ``fn``.
    """
    from jax.sharding import AbstractDevice, AbstractMesh

    dev = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=dev)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def compile_sm90_report(fn: Any, *args: Any, sass: bool = False) -> list[dict[str, Any]]:
    """Lower ``fn(*args)`` for CUDA, then compile every Pallas Triton kernel in it for sm_90a with the pip
    ``triton`` package (PTX + ptxas, no GPU needed). Returns [{name, registers, spill_bytes, smem_bytes,
    layout_conversions}] (the last: ``ttg.convert_layout`` ops in its TTGIR, register data moved between layouts,
    most through shared memory), and with ``sass`` each kernel's disassembly (``nvdisasm -c``, bundled with pip
    triton) under "sass".

    A development check, not the H200 gate: XLA compiles the same Triton IR with the Triton bundled in
    the CUDA plugin, whose version differs from pip's. Raises ImportError without pip ``triton``.
    Captures the IR through jax's private Pallas Triton lowering module (jax 0.11.2).
    """
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from jax._src.pallas.triton import pallas_call_registration as reg
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import compiler as nvc

    mods: list[str] = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a: Any, **k: Any) -> Any:
        res = orig(*a, **k)
        mods.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        check_triton_lowering(fn, *args)
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    ptxas = nvc.get_ptxas(90).path
    out = []
    with tempfile.TemporaryDirectory() as d:
        for i, m in enumerate(mods):
            src = f"{d}/k{i}.ttir"
            with open(src, "w") as f:
                f.write(m)
            name = re.search(r"module @(\w+)", m).group(1)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": NUM_WARPS.get(name, 4), "num_stages": 1})
            ptx = f"{d}/k{i}.ptx"
            with open(ptx, "w") as f:
                f.write(k.asm["ptx"])
            log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", f"{d}/k{i}.cubin"],
                                 capture_output=True, text=True, check=True).stderr
            regs = re.search(r"Used (\d+) registers", log)
            spill = re.search(r"(\d+) bytes spill stores", log)
            out.append({"name": name, "num_warps": NUM_WARPS.get(name, 4), "registers": int(regs.group(1)),
                        "spill_bytes": int(spill.group(1)), "smem_bytes": int(k.metadata.shared),
                        "layout_conversions": k.asm["ttgir"].count("ttg.convert_layout")})
            if sass:
                nvdisasm = os.path.join(os.path.dirname(ptxas), "nvdisasm")
                out[-1]["sass"] = subprocess.run([nvdisasm, "-c", f"{d}/k{i}.cubin"], capture_output=True, text=True,
                                                 check=True).stdout
    return out


def columns(name: str, arg: str, x: jax.Array, col: int | None, width: int) -> jax.Array:
    """x's columns [col, col + width): the rows an op reads in place from a wider array ``name`` (its argument
    ``arg`` gives col); x itself for col None. A ValueError names ``arg`` where they do not fit."""
    if col is None:
        return x
    if isinstance(col, bool) or not isinstance(col, (int, np.integer)):
        raise ValueError(f"{arg} must be an int or None, got {col!r}")
    check_array(name, x, (("T", None), ("columns", None)), "float")
    if not 0 <= col <= x.shape[1] - width:
        raise ValueError(f"{arg} = {col}: {name}'s rows take columns [{arg}, {arg} + {width}) of its {x.shape[1]}")
    return x[:, col: col + width]
