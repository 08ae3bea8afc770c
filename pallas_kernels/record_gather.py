"""Register gather of DeepSeek cache records into a swizzled bf16 K tile (Pallas Mosaic GPU, inline PTX).

The sparse MQA's producer job, done the way FlashMLA's sm90 sparse decode does it: no TMA per row and no
staging rows in shared memory. One warpgroup gathers a block of 64 records (V3.2's ``MlaRecord656``: 512 e4m3
latent values, 4 fp32 scales per 128, 64 bf16 rope values; V4's ``MlaRecord584``: 448 e4m3 NoPE values, 64
bf16 rope values, 7 UE8M0 exponents in the page's exponent region) with per-thread 128-bit global loads,
dequantises the values in registers and stores the bf16 rows straight into the MQA's K tile layout. Lane
semantics has no per-thread address, so the body is Mosaic GPU code inside ``plgpu.inline_mgpu``: each
thread's addresses come from its thread index and the block's slots.

- ``dequant_blocks`` (the bit-exact check of the dequantisation, and ``scripts/diag/gather_probe.py``) maps
  threads to half rows of V3.2's records: thread t of the warpgroup serves row t // 2, latent columns
  256 (t % 2) .. + 255 with its record's scales 2 (t % 2) and 2 (t % 2) + 1, and rope values 32 (t % 2) .. + 31.
- e4m3 -> bf16: ``cvt.rn.f16x2.e4m3x2`` (exact), float32 multiply by the scale, ``cvt.rn.bf16x2.f32``: the
  same values as ``MlaRecord656.unpack`` (checked bit for bit on the H200 by ``scripts/diag/gather_probe.py
  --dequant``, benchmarks/results/archive/gather_probe_h200_2026-12-02.json).
- K tile layout ([64, 576] bf16, ``K_TILE_TRANSFORMS``): (8, 32) tiles of 512 bytes, row-tile major; inside a
  tile row r is 64 bytes and its 16-byte unit u sits at u ^ ((r >> 1) & 3) (the 64-byte swizzle).
- Record address: slot * 656 from the cache's base (a page holds ``entries_per_page`` records back to back,
  so the page offset need not be computed). A masked slot (< 0) reads record 0, as the pure-JAX path does.

- The MQA's producer (``produce_tile``): the whole loop over a token's blocks as one software-pipelined
  ``scf.for`` that carries the next block's slot, so its load sits in no block's chain (block ids are
  arithmetic on the lists' extents). Its barriers are raw PTX mbarriers in a shared int32 row
  (``init_barriers``, ``wait_full``, ``arrive_free``), waited with CTA-scope acquire (a cluster-scope acquire
  costs an L1 invalidation after every wait). Its loads are coalesced (``coalesced_lane``): a warp serves 16
  rows and each load instruction reads whole lines of two or four records. The half-row mapping of
  ``dequant_blocks`` saturated L1/TEX inside the loop (sectors half used, 14-way shared store conflicts);
  its loops for both formats lost to this one and were removed, as was a 2-CTA cluster form
  (docs/perf-log.md, nineteenth and twentieth sessions).

Native only (inline PTX); GPU interpret mode cannot run it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

REC656 = 656  # MlaRecord656: 512 e4m3 | 4 fp32 scales | 64 bf16 rope
LATENT, ROPE = 512, 64
K_COLS = LATENT + ROPE  # the K tile's columns (bf16)
BLOCK = 64  # rows per block (the MQA's candidates per block)
K_TILE_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))

# one 16-byte chunk of e4m3 (4 words) times an fp32 scale -> 16 bf16 (8 words); element order kept (the low
# byte / half of a word first). ``swap``: per lane, the chunk's two 8-byte halves exchanged (input word j read
# as word (j + 2) % 4) where the selector $13 says so, by the byte permute the dequantisation does anyway or one
# per input word, rather than eight selects of the results (the coalesced producer's stores alternate halves
# between lanes to spread banks; fewer instructions in the producer's loop: docs/perf-log.md, fifty-first session)
def _dq_asm(swap: bool) -> str:
    src = [f"w{j}" for j in range(4)] if swap else [f"${8 + j}" for j in range(4)]
    return ("{ .reg .b16 h<8>; .reg .b32 f<8>, w<4>; .reg .f16 x<16>; .reg .f32 y<16>;\n"
            + ("".join(f"prmt.b32 w{j}, ${8 + j}, ${8 + (j + 2) % 4}, $13;\n" for j in range(4)) if swap else "")
            + "".join(f"mov.b32 {{h{2 * i}, h{2 * i + 1}}}, {src[i]};\n" for i in range(4))
            + "".join(f"cvt.rn.f16x2.e4m3x2 f{i}, h{i};\n" for i in range(8))
            + "".join(f"mov.b32 {{x{2 * i}, x{2 * i + 1}}}, f{i};\n" for i in range(8))
            + "".join(f"cvt.f32.f16 y{i}, x{i};\nmul.f32 y{i}, y{i}, $12;\n" for i in range(16))
            + "".join(f"cvt.rn.bf16x2.f32 ${i}, y{2 * i + 1}, y{2 * i};\n" for i in range(8))
            + "}")


# the same for power-of-two scales without a conversion instruction (exact): each e4m3 byte b becomes the bf16
# bit pattern (b & 0x80) << 8 | (b & 0x7F) << 4, whose value is exactly b's times 2^-120 for normal and subnormal b
# alike (the exponent biases differ by 120, and the mantissa bits line up). One byte permute puts a byte pair into
# the halves' low bytes with its sign replicated over the high bytes (sign-extended to 16 bits), then a shift by 4
# and one mask (``_PLACE_MASK``) keep the sign at bit 15 and the magnitude at bits 10:4: three integer
# instructions a word where masking sign and magnitude apart took four (docs/perf-log.md, fifty-second session).
# Then two exact bf16 products: by scale * 2^60 ($12, both halves) and by 2^60 (split so that no intermediate
# leaves bf16's range). ``swap``: the byte permute reads the other half's word where selectors $13 / $14
# (``dq_swap_selectors``) say so.
_BF16X2_2P60 = 0x5D805D80
_PLACE_MASK = 0x87F087F0  # after the shift: each half's sign (bit 15) and magnitude (bits 10:4)
_PLACE_SEL = (0x9180, 0xB3A2)  # bytes 0, 1 / 2, 3 -> halves' low bytes, sign-replicated (selector bit 3) above
_OTHER_WORD = 0x4444  # added to a selector: each nibble's byte taken from prmt's second word (bytes 4..7)
_SEL_EVEN, _SEL_ODD = ((sel, sel + _OTHER_WORD) for sel in _PLACE_SEL)  # (own word, other word)


def _dq_pow2_asm(swap: bool, shifted: bool = False) -> str:
    """``shifted``: the second product left out, so the words hold the values times 2^-60 (``K_SHIFT``; exact
    for the cache writer's scales, >= 2^-24: the smallest product, 2^-9 * 2^-24 * 2^-60, is a normal bf16)."""
    def prmt(j: int, odd: int) -> str:
        if swap:
            return f"prmt.b32 t, ${8 + j}, ${8 + (j + 2) % 4}, ${13 + odd};\n"
        return f"prmt.b32 t, ${8 + j}, 0, {_PLACE_SEL[odd]:#x};\n"

    def products(o: int) -> str:
        if shifted:
            return f"mul.rn.bf16x2 ${o}, t, $12;\n"
        return f"mul.rn.bf16x2 t, t, $12;\nmul.rn.bf16x2 ${o}, t, s2;\n"

    return (f"{{ .reg .b32 t, s2; mov.b32 s2, {_BF16X2_2P60:#x};\n"
            + "".join(prmt(j, odd) + f"shl.b32 t, t, 4;\nand.b32 t, t, {_PLACE_MASK:#x};\n" + products(2 * j + odd)
                      for j in range(4) for odd in (0, 1))
            + "}")


_DQ_ASM, _DQ_SWAP_ASM = _dq_asm(False), _dq_asm(True)
_DQ_POW2_ASM, _DQ_POW2_SWAP_ASM = _dq_pow2_asm(False), _dq_pow2_asm(True)
_DQ_POW2_SHIFTED = {swap: _dq_pow2_asm(swap, True) for swap in (False, True)}
K_SHIFT = 60  # ``produce_tile(k_shift=True)``: the K tile holds the keys times 2^-K_SHIFT
_BF16X2_2M60 = 0x21802180  # bf16 2^-60 in both halves (the rope values' factor under ``k_shift``)
_SCALE_2P60 = 60 << 23  # added to a normal fp32's bits: times 2^60
_UE8M0_2P60 = 60 << 7 | 60 << 23  # added to bf16x2 bits whose exponent fields hold e: times 2^60 (sign clear: e <= 195)


_UE8M0_SEL, _UE8M0_SEL_STEP = 0x0404, 0x1010  # ``ue8m0_selector(k)`` = _UE8M0_SEL + k * _UE8M0_SEL_STEP


def ue8m0_selector(k: int) -> int:
    """``prmt`` selector placing byte k of a word at bytes 1 and 3, zeros (b = 0) at bytes 0 and 2."""
    return _UE8M0_SEL + k * _UE8M0_SEL_STEP


class _Emit:
    """Lowering-time PTX helpers (inside an ``inline_mgpu`` body): constants, loads, stores, dequantisation and
    the K tile's swizzled addresses."""

    def __init__(self):
        from jax._src.lib.mlir import ir  # noqa: PLC0415 - lowering-time imports
        from jax._src.lib.mlir.dialects import arith, llvm  # noqa: PLC0415
        from jax.experimental.mosaic.gpu import utils as mu  # noqa: PLC0415

        self.arith, self.llvm, self.mu = arith, llvm, mu
        self.i32, self.i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        self.void = ir.Type.parse("!llvm.void")

    def c32(self, v: int):
        return self.arith.constant(self.i32, v)

    def c64(self, v: int):
        return self.arith.constant(self.i64, v)

    def asm(self, text: str, args, constraints: str, outs: int = 0):
        """One inline PTX statement: ``outs`` 32-bit results (a list), or none (a side effect)."""
        llvm = self.llvm
        if not outs:
            llvm.inline_asm(self.void, list(args), text, constraints, has_side_effects=True)
            return []
        ty = self.i32 if outs == 1 else llvm.StructType.get_literal([self.i32] * outs)
        v = llvm.inline_asm(ty, list(args), text, constraints)
        return [v] if outs == 1 else [llvm.extractvalue(self.i32, v, [j]) for j in range(outs)]

    def smem_addr(self, ref):
        return self.llvm.ptrtoint(self.i32, self.mu.memref_ptr(ref))

    def gmem_addr(self, ref):
        return self.llvm.ptrtoint(self.i64, self.mu.memref_ptr(ref))

    def loads(self, addr, offsets: list[int]) -> list[list]:
        """16-byte loads at ``addr`` + each offset, all in one asm statement: they are issued back to back (as
        separate statements the compiler interleaved them with the conversions, each load's latency exposed)."""
        n = len(offsets)
        text = "".join(f"ld.global.nc.v4.u32 {{${4 * j}, ${4 * j + 1}, ${4 * j + 2}, ${4 * j + 3}}}, [${4 * n}+{o}];\n"
                       for j, o in enumerate(offsets))
        words = self.asm(text, [addr], ",".join(["=r"] * (4 * n) + ["l"]), 4 * n)
        return [words[4 * j:4 * j + 4] for j in range(n)]

    def slot_record(self, slots_ref, cache_ref, row):
        """Row ``row``'s raw slot (-1 kept) from GMEM ``slots_ref`` and its record's address (slot 0's if masked)."""
        arith = self.arith
        ptr = arith.addi(self.gmem_addr(slots_ref), arith.extui(self.i64, arith.muli(row, self.c32(4))))
        raw = self.ld32(ptr)
        slot = arith.maxsi(raw, self.c32(0))
        return raw, arith.addi(self.gmem_addr(cache_ref), arith.muli(arith.extui(self.i64, slot), self.c64(REC656)))

    def dequant(self, words, scale, pow2: bool = False, swap=None, shifted: bool = False):
        """16 e4m3 (4 words) times an fp32 scale -> 16 bf16 (8 words); ``pow2``: ``scale`` is
        ``pow2_scale(fp32 scale)`` of a power-of-two scale (``_DQ_POW2_ASM``). ``swap``: this lane's selectors
        (``dq_swap_selectors``), the chunk's 8-byte halves exchanged where they say so. ``shifted`` (``pow2``):
        the values times 2^-K_SHIFT, by one product instead of two."""
        if shifted:
            text = _DQ_POW2_SHIFTED[swap is not None]
        elif swap is None:
            text = _DQ_POW2_ASM if pow2 else _DQ_ASM
        else:
            text = _DQ_POW2_SWAP_ASM if pow2 else _DQ_SWAP_ASM
        sel = [] if swap is None else list(swap)
        return self.asm(text, [*words, scale, *sel], ",".join(["=r"] * 8 + ["r"] * (5 + len(sel))), 8)

    def mul_bf16x2(self, word, const: int):
        """bf16x2 ``word`` times the bf16x2 constant ``const`` (both halves)."""
        return self.asm(f"{{ .reg .b32 c; mov.b32 c, {const:#x}; mul.rn.bf16x2 $0, $1, c; }}", [word], "=r,r", 1)[0]

    def dq_swap_selectors(self, swapped, pow2: bool) -> tuple:
        """``dequant``'s ``swap`` for a lane whose halves are exchanged where ``swapped`` (i1): the byte permute
        selectors of ``_DQ_POW2_SWAP_ASM`` ($13, $14) or ``_DQ_SWAP_ASM`` ($13)."""
        arith, c32 = self.arith, self.c32
        pairs = (_SEL_EVEN, _SEL_ODD) if pow2 else ((0x3210, 0x3210 + _OTHER_WORD),)
        return tuple(arith.select(swapped, c32(other), c32(own)) for own, other in pairs)

    def pow2_scale(self, bits):
        """A power-of-two fp32 scale (its bits) -> bf16x2 of scale * 2^60 in both halves (exact): the high half
        of bits + 2^60's exponent, copied to both halves by one byte permute."""
        return self.asm(f"{{ .reg .b32 t; add.u32 t, $1, {_SCALE_2P60:#x}; prmt.b32 $0, t, 0, 0x3232; }}",
                        [bits], "=r,r", 1)[0]

    def ue8m0_scale(self, word, sel):
        """Byte k of an exponent word (UE8M0 e) -> bf16x2 of 2^(e - 127) * 2^60 in both halves: the byte
        permuted to bits 8..15 of both halves (``ue8m0_selector(k)``), shifted to bf16's exponent field and
        biased by 60."""
        return self.asm(f"{{ .reg .b32 t; prmt.b32 t, $1, 0, $2; shr.b32 t, t, 1; add.u32 $0, t, {_UE8M0_2P60:#x}; }}",
                        [word, sel], "=r,r,r", 1)[0]

    def store16(self, addr, words, pred=None) -> None:
        """16 bytes to shared address ``addr`` (where ``pred``, i32, is nonzero)."""
        if pred is None:
            self.asm("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", [addr, *words], "r,r,r,r,r")
        else:
            self.asm("{ .reg .pred p; setp.ne.u32 p, $5, 0; @p st.shared.v4.b32 [$0], {$1, $2, $3, $4}; }",
                     [addr, *words, pred], "r,r,r,r,r,r")

    def k_row(self, k_base, row, cols: int = K_COLS):
        """(row's address in a K tile of ``cols`` bf16 columns at ``k_base``, its swizzle) for
        ``K_TILE_TRANSFORMS``."""
        arith, c32 = self.arith, self.c32
        r8 = arith.remui(row, c32(8))
        row_off = arith.addi(arith.muli(arith.divui(row, c32(8)), c32((cols // 32) * 512)), arith.muli(r8, c32(64)))
        return arith.addi(k_base, row_off), arith.andi(arith.shrui(r8, c32(1)), c32(3))

    def k_addr(self, row_base, sw, col0, col: int):
        """Shared address of the 8 bf16 at columns col0 + col .. + 7 of the row at ``row_base`` (col0 dynamic;
        col0 + col a multiple of 8)."""
        arith, c32 = self.arith, self.c32
        c = arith.addi(col0, c32(col))
        unit = arith.xori(arith.andi(arith.shrui(c, c32(3)), c32(3)), sw)
        return arith.addi(row_base, arith.addi(arith.muli(arith.shrui(c, c32(5)), c32(512)), arith.muli(unit, c32(16))))

    def prefetch(self, addr, offsets) -> None:
        for off in offsets:
            self.asm("prefetch.global.L2 [$0];", [self.arith.addi(addr, self.c64(off))], "l")

    def wait_parity(self, bar, parity, pred=None) -> None:
        """Spin until the mbarrier at shared address ``bar`` completes the phase of ``parity`` (where ``pred``,
        i32, is nonzero); acquire at CTA scope (at cluster scope the H200 adds an L1 invalidation, CCTL.IVALL,
        after every wait)."""
        skip = "setp.eq.u32 q, $2, 0;\n@q bra DONE;\n" if pred is not None else ""
        self.asm("{ .reg .pred p, q;\n" + skip
                 + "WAIT:\nmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [$0], $1;\n"
                 "@!p bra WAIT;\nDONE:\n}", [bar, parity] + ([pred] if pred is not None else []),
                 "r,r,r" if pred is not None else "r,r")

    def shfl(self, v, src_lane):
        """``v`` of lane ``src_lane`` (i32) of this warp."""
        return self.asm("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", [v, src_lane], "=r,r,r", 1)[0]

    def ld32(self, addr):
        return self.asm("ld.global.nc.u32 $0, [$1];", [addr], "=r,l", 1)[0]

    def store_slot_at(self, base, row, raw, pred) -> None:
        """The raw slot into int32 ``row`` of the shared buffer at ``base`` where ``pred`` (i32, nonzero) holds."""
        addr = self.arith.addi(base, self.arith.muli(row, self.c32(4)))
        self.asm("{ .reg .pred p; setp.ne.u32 p, $2, 0; @p st.shared.u32 [$0], $1; }", [addr, raw, pred], "r,r,r")


def fill_k_tile_656(slots_ref, cache_ref, k_ref, *, pow2_scales: bool = False) -> None:
    """From one warpgroup (all 128 threads): the bf16 K rows of the 64 records ``slots_ref`` (GMEM int32 [64])
    of ``cache_ref`` (GMEM uint8, records at slot * 656) into ``k_ref`` (SMEM [64, 576] bf16 with
    ``K_TILE_TRANSFORMS``), two threads per row (the module docstring), every load of a thread in flight at
    once. ``pow2_scales``: the records' scales are powers of two (``MlaRecord656(scale_fmt="ue8m0")``),
    dequantised without conversion instructions (``_DQ_POW2_ASM``; the same bits). The caller makes the
    stores visible (``plgpu.commit_smem``) and synchronises."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(K_TILE_TRANSFORMS)))
    def fill(_, slots, cache, k):
        e = _Emit()
        arith, c32, c64 = e.arith, e.c32, e.c64
        tid = arith.remui(e.mu.thread_idx(), c32(128))  # the thread in its warpgroup
        row, half = arith.divui(tid, c32(2)), arith.remui(tid, c32(2))
        _, rec = e.slot_record(slots, cache, row)
        row_base, sw = e.k_row(e.smem_addr(k), row)
        half64 = arith.extui(e.i64, half)
        first_half = arith.cmpi(arith.CmpIPredicate.eq, half, c32(0))
        scales = e.loads(arith.addi(rec, c64(LATENT)), [0])[0]
        rope = e.loads(arith.addi(rec, arith.addi(arith.muli(half64, c64(64)), c64(LATENT + 16))), [0, 16, 32, 48])
        lat = e.loads(arith.addi(rec, arith.muli(half64, c64(256))), [16 * i for i in range(16)])
        if pow2_scales:
            scales = [e.pow2_scale(w) for w in scales]
        col_lat = arith.muli(half, c32(256))
        for i in range(16):
            words = e.dequant(lat[i], arith.select(first_half, scales[i // 8], scales[2 + i // 8]), pow2_scales)
            e.store16(e.k_addr(row_base, sw, col_lat, 16 * i), words[:4])
            e.store16(e.k_addr(row_base, sw, col_lat, 16 * i + 8), words[4:])
        col_rope = arith.addi(c32(LATENT), arith.muli(half, c32(32)))
        for q in range(4):
            e.store16(e.k_addr(row_base, sw, col_rope, 8 * q), rope[q])

    fill(slots_ref, cache_ref, k_ref)


@functools.lru_cache(maxsize=None)
def _dequant_call(n_blocks: int, ctas: int, pow2_scales: bool):
    """CTA c fills its K tile with blocks c, c + ctas, ... (``fill_k_tile_656``) and TMAs each one out."""

    def kernel(slots_ref, cache_ref, out_ref, k_s):
        cta = lax.axis_index("cta")

        @pl.loop(0, (n_blocks - 1) // ctas + 1)
        def _(j):
            blk = cta + j * ctas

            @pl.when(blk < n_blocks)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous block's TMA read the tile
                fill_k_tile_656(slots_ref.at[blk], cache_ref, k_s, pow2_scales=pow2_scales)
                plgpu.commit_smem()  # the threads' st.shared visible to the TMA
                plgpu.copy_smem_to_gmem(k_s, out_ref.at[pl.ds(blk * BLOCK, BLOCK)])

        plgpu.wait_smem_to_gmem(0)

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((n_blocks * BLOCK, K_COLS), jnp.bfloat16),
                        grid=(ctas,), grid_names=("cta",), compiler_params=params,
                        scratch_types=[plgpu.SMEM((BLOCK, K_COLS), jnp.bfloat16, transforms=K_TILE_TRANSFORMS)])


def dequant_blocks(cache: jax.Array, slots: jax.Array, *, pow2_scales: bool = False, ctas: int = 132) -> jax.Array:
    """The bf16 K rows [n * 64, 576] of the records ``slots`` [n, 64] (in range) of ``cache`` [rows, 656] (uint8
    ``MlaRecord656`` records), through the MQA producer's register path and its swizzled K tile: the whole
    producer job on its own, so that it can be checked bit for bit against ``MlaRecord656.unpack`` and timed.
    Native only."""
    if slots.ndim != 2 or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"slots must be int32 [n, {BLOCK}], got {slots.dtype} {slots.shape}")
    n_blocks, rows = slots.shape
    if rows != BLOCK or cache.dtype != jnp.uint8 or cache.ndim != 2 or cache.shape[1] != REC656:
        raise ValueError(f"slots must be [n, {BLOCK}] and cache uint8 [rows, {REC656}], got slots {slots.shape}, "
                         f"cache {cache.dtype} {cache.shape}")
    return _dequant_call(n_blocks, min(ctas, n_blocks), pow2_scales)(slots.astype(jnp.int32), cache)


# ---- the producer as one software-pipelined loop (raw mbarriers) ------------------------------------------
FULL_ARRIVALS = 128  # every thread of the producer warpgroup arrives on "full"
FREE_ARRIVALS = 8  # lane 0 of each of the 2 x 4 compute warps arrives on "free"


def init_barriers(bars_ref) -> None:
    """From every thread of the CTA, before any warpgroup specialises: thread 0 initialises the raw mbarriers
    at ``bars_ref`` (SMEM int32, 2 words each): "full" 0 / 1 (``FULL_ARRIVALS``) and "free" 0 / 1
    (``FREE_ARRIVALS``), then the CTA syncs, so that no thread reaches an uninitialised barrier."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def init(_, bars):
        e = _Emit()
        base = e.smem_addr(bars)
        is0 = e.arith.extui(e.i32, e.arith.cmpi(e.arith.CmpIPredicate.eq, e.mu.thread_idx(), e.c32(0)))
        counts = (FULL_ARRIVALS,) * 2 + (FREE_ARRIVALS,) * 2
        text = "{ .reg .pred p; setp.ne.u32 p, $1, 0;\n" + "".join(
            f"@p mbarrier.init.shared::cta.b64 [$0+{8 * b}], {n};\n" for b, n in enumerate(counts)) + \
            "@p fence.mbarrier_init.release.cluster; }"
        e.asm(text, [base, is0], "r,r")
        e.asm("bar.sync 0;", [], "")  # every thread of the CTA is here (the kernel body before it specialises)

    init(bars_ref)


def arrive_free(bar_ref) -> None:
    """Every thread of a compute warpgroup, after its last read of a K tile: lane 0 of each warp arrives on the
    "free" mbarrier at ``bar_ref``."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def arrive(_, bar):
        e = _Emit()
        addr = e.smem_addr(bar)
        lane0 = e.arith.extui(e.i32, e.arith.cmpi(e.arith.CmpIPredicate.eq,
                                                  e.arith.remui(e.mu.thread_idx(), e.c32(32)), e.c32(0)))
        e.asm("{ .reg .pred p; bar.warp.sync -1; setp.ne.u32 p, $1, 0;\n"
              "@p mbarrier.arrive.release.cta.shared::cta.b64 _, [$0]; }", [addr, lane0], "r,r")

    arrive(bar_ref)


def wait_full(bar_ref, parity) -> None:
    """Every thread of a warpgroup: wait until the mbarrier at ``bar_ref`` (SMEM int32 [2]) completes the phase
    of ``parity`` (int32 scalar, 0 or 1)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=())))
    def wait(_, bar, par):
        e = _Emit()
        e.wait_parity(e.smem_addr(bar), par.registers.item())

    wait(bar_ref, parity)


def list_extents(slot_rows, widths: tuple[int, ...]) -> list[jax.Array]:
    """Per list, one token's live blocks (the MQA's ``_extents``: 1 + the last block holding a valid slot, 0 if
    none) from its slot rows (GMEM int32, ``widths[i]`` slots, a multiple of ``BLOCK``), computed in the kernel so
    that no extents kernel runs before it. Every warp computes them alone, so every thread holds them without a
    barrier: lane l reads slots 4 l .. 4 l + 3 of each 128 (one 16-byte load each, all in flight at once; the
    other warps find the row in L1), keeps its block's number if any of them is valid, and ``redux.sync.max``
    gives the warp's largest. Native only (PTX); int32 scalars."""
    for w in widths:
        if w <= 0 or w % BLOCK:
            raise ValueError(f"list_extents: slot row widths must be positive multiples of {BLOCK}, got {widths}")
    if len(slot_rows) != len(widths):
        raise ValueError(f"list_extents: {len(slot_rows)} slot rows for {len(widths)} widths")
    scalar = plgpu.Layout.WG_SPLAT(shape=())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(widths),
                       return_type=[plgpu.ShapeDtypeStruct((), jnp.int32, layout=scalar)] * len(widths))
    def extents(_, *rows):
        from jax.experimental.mosaic import gpu as mgpu  # noqa: PLC0415 - lowering-time import

        e = _Emit()
        arith, c32 = e.arith, e.c32
        lane = arith.remui(e.mu.thread_idx(), c32(32))
        blk_in_128 = arith.addi(arith.shrui(lane, c32(4)), c32(1))  # 1 + the block of slots 4 lane .. 4 lane + 3
        # the loads of every list in one statement: (list, chunk, lane's address, whether the lane's slots exist)
        addrs, plan = [], []
        for li, (row, w) in enumerate(zip(rows, widths)):
            for ch in range(-(-w // 128)):
                rem = min(128, w - 128 * ch) // 4  # lanes with slots in this chunk (32, or 16 for its last 64)
                mine = lane if rem == 32 else arith.minui(lane, c32(rem - 1))  # in bounds: the lane's or the last
                off = arith.extui(e.i64, arith.addi(c32(512 * ch), arith.muli(mine, c32(16))))
                addrs.append(arith.addi(e.gmem_addr(row), off))
                plan.append((li, ch, rem))
        n = len(addrs)
        text = "".join(f"ld.global.nc.v4.u32 {{${4 * j}, ${4 * j + 1}, ${4 * j + 2}, ${4 * j + 3}}}, [${4 * n + j}];\n"
                       for j in range(n))
        words = e.asm(text, addrs, ",".join(["=r"] * (4 * n) + ["l"] * n), 4 * n)
        best = [c32(0)] * len(widths)
        for j, (li, ch, rem) in enumerate(plan):
            top = functools.reduce(arith.maxsi, words[4 * j:4 * j + 4])  # a valid slot is >= 0
            live = arith.cmpi(arith.CmpIPredicate.sge, top, c32(0))
            if rem < 32:
                live = arith.andi(live, arith.cmpi(arith.CmpIPredicate.ult, lane, c32(rem)))
            best[li] = arith.maxsi(best[li], arith.select(live, arith.addi(blk_in_128, c32(2 * ch)), c32(0)))
        out = []
        for b in best:
            v = e.asm("redux.sync.max.s32 $0, $1, 0xffffffff;", [b], "=r,r", 1)[0]
            out.append(mgpu.FragmentedArray.splat(v, (), layout=mgpu.WGSplatFragLayout(()), is_signed=True))
        return out

    return extents(*slot_rows)


def kernel_extents(lists: Sequence[jax.Array]) -> list[jax.Array]:
    """``list_extents`` on its own: each token's live blocks per list ([T] int32 each) of the slot lists
    ``lists`` ([T, K_i] int32, K_i a multiple of ``BLOCK``), one CTA per token, so that the in-kernel
    computation can be checked integer for integer against ``sparse_mqa._extents``. Native only."""
    if not lists or any(s.ndim != 2 or s.dtype != jnp.int32 or s.shape[0] != lists[0].shape[0] for s in lists):
        raise ValueError(f"lists must be int32 [T, K_i] with one T, got {[(s.dtype, s.shape) for s in lists]}")
    t, widths = lists[0].shape[0], tuple(int(s.shape[1]) for s in lists)
    nc = len(lists)

    def kernel(*refs):
        rows, out = refs[:nc], refs[nc]
        ti = lax.axis_index("tok")
        exts = list_extents(tuple(r.at[ti] for r in rows), widths)
        for i, x in enumerate(exts):
            out[ti, i] = x

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    out = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((t, nc), jnp.int32), grid=(t,), grid_names=("tok",),
                       compiler_params=params)(*lists)
    return [out[:, i] for i in range(nc)]


class _Loop:
    """What the software-pipelined producer loop needs (inside its ``inline_mgpu`` body): each list's slots (GMEM
    int32 rows; list i's blocks start at ``starts[i]`` in the concatenated lists) and the live blocks of all
    lists but the last (``exts``, int32 scalars: ``sparse_mqa.block_of``'s walk, of ``nblocks`` blocks), the
    first cache, the K tiles and the idx buffer (slot rows 0 / 1, raw mbarriers in row 2: "full" at +0 / +8,
    "free" at +16 / +24), and the loop itself."""

    def __init__(self, e: _Emit, slots, starts, exts, nblocks, cache, k, idx, first, n):
        arith, c32 = e.arith, e.c32
        self.e, self.first, self.n, self.starts, self.exts, self.nblocks = e, first, n, starts, exts, nblocks
        self.tid = arith.remui(e.mu.thread_idx(), c32(128))
        self.cache = e.gmem_addr(cache)
        self.slots = [e.gmem_addr(x) for x in slots]
        self.last = arith.maxsi(arith.subi(n, c32(1)), c32(0))
        self.k_base, self.idx_base = e.smem_addr(k), e.smem_addr(idx)
        self.full0 = arith.addi(self.idx_base, c32(2 * BLOCK * 4))
        self.free0 = arith.addi(self.full0, c32(16))

    def ld_at(self, base, i):  # int32 element i of a GMEM row
        e = self.e
        return e.ld32(e.arith.addi(base, e.arith.extui(e.i64, e.arith.muli(i, e.c32(4)))))

    def block_of(self, kk):  # the k-th live block's id (past the end: the last one again, a harmless re-read)
        arith, c32 = self.e.arith, self.e.c32
        pos = arith.addi(self.first, arith.minsi(kk, self.last))
        blk, cum = pos, c32(0)
        for ext, start in zip(self.exts, self.starts[1:]):  # list i from position exts[0] + .. + exts[i - 1] on
            cum = arith.addi(cum, ext)
            there = arith.cmpi(arith.CmpIPredicate.sge, pos, cum)
            blk = arith.select(there, arith.addi(c32(start), arith.subi(pos, cum)), blk)
        return arith.minsi(blk, c32(self.nblocks - 1))

    def slot_of(self, blk, r):  # slot r of block blk (in the concatenated lists): one of its list's slot rows
        arith, c32 = self.e.arith, self.e.c32
        base, local = self.slots[0], blk
        for x, start in zip(self.slots[1:], self.starts[1:]):
            there = arith.cmpi(arith.CmpIPredicate.sge, blk, c32(start))
            base, local = arith.select(there, x, base), arith.select(there, arith.subi(blk, c32(start)), local)
        return self.ld_at(base, arith.addi(arith.muli(local, c32(BLOCK)), r))

    def record(self, raw):  # a masked slot (< 0) reads record 0, as the pure-JAX path does
        e = self.e
        slot = e.arith.extui(e.i64, e.arith.maxsi(raw, e.c32(0)))
        return e.arith.addi(self.cache, e.arith.muli(slot, e.c64(REC656)))

    def tile(self, b, cols: int = K_COLS):
        return self.e.arith.addi(self.k_base, self.e.arith.muli(b, self.e.c32(BLOCK * cols * 2)))

    def wait_free(self, kk, b8) -> None:
        """Tile k % 2 (and idx row k % 2) is free once the consumers are done with block k - 2."""
        e, arith, c32 = self.e, self.e.arith, self.e.c32
        parity = arith.remui(arith.addi(arith.divui(kk, c32(2)), c32(1)), c32(2))
        e.wait_parity(arith.addi(self.free0, b8), parity,
                      arith.extui(e.i32, arith.cmpi(arith.CmpIPredicate.sge, kk, c32(2))))

    def arrive_full(self, b8) -> None:
        """Every thread: its stores visible to the tensor cores, then arrive."""
        full = self.e.arith.addi(self.full0, b8)
        self.e.asm("{ fence.proxy.async.shared::cta;\nmbarrier.arrive.release.cta.shared::cta.b64 _, [$0]; }",
                   [full], "r")

    def run(self, init: list, body) -> None:
        """``body(k, carried) -> carried`` for k in [0, n) as one ``scf.for``, then the "free" phases of the
        last two blocks."""
        from jax._src.lib.mlir import ir  # noqa: PLC0415 - lowering-time imports
        from jax._src.lib.mlir.dialects import scf  # noqa: PLC0415

        e, arith, c32 = self.e, self.e.arith, self.e.c32
        index = ir.IndexType.get()
        loop = scf.ForOp(arith.constant(index, 0), arith.index_cast(index, self.n), arith.constant(index, 1), init)
        with ir.InsertionPoint(loop.body):
            scf.yield_(body(arith.index_cast(e.i32, loop.induction_variable), list(loop.inner_iter_args)))
        for back in (2, 1):
            j = arith.subi(self.n, c32(back))
            jc = arith.maxsi(j, c32(0))
            e.wait_parity(arith.addi(self.free0, arith.muli(arith.remui(jc, c32(2)), c32(8))),
                          arith.remui(arith.divui(jc, c32(2)), c32(2)),
                          arith.extui(e.i32, arith.cmpi(arith.CmpIPredicate.sge, j, c32(0))))



def _lists_loop(starts: tuple[int, ...], nblocks: int, emit):
    """A producer loop's ``inline_mgpu`` over (a slot row per list, a cache per list, K tiles, idx, b0, n, the
    live blocks of every list but the last), list i's blocks starting at ``starts[i]`` of ``nblocks``; its body
    ``emit(e, lp, bases)`` with the caches' GMEM addresses (``_Loop`` reads the first as its cache)."""
    nc = len(starts)
    scalar = plgpu.Layout.WG_SPLAT(shape=())
    types = ((plgpu.RefType(),) * (2 * nc) + (plgpu.RefType(K_TILE_TRANSFORMS), plgpu.RefType(), scalar, scalar)
             + (scalar,) * (nc - 1))

    @plgpu.inline_mgpu(arg_types=types)
    def produce(_, *rest):
        slots, caches, (k, idx, b0_fa, n_fa), ext_fa = (rest[:nc], rest[nc:2 * nc], rest[2 * nc:2 * nc + 4],
                                                        rest[2 * nc + 4:])
        e = _Emit()
        lp = _Loop(e, slots, starts, [x.registers.item() for x in ext_fa], nblocks, caches[0], k, idx,
                   b0_fa.registers.item(), n_fa.registers.item())
        emit(e, lp, [e.gmem_addr(c) for c in caches])

    return produce


# ---- V4's MlaRecord584 --------------------------------------------------------------------------------------
REC584_DATA, NOPE584, SCALES584 = 576, 448, 8  # per entry: 448 e4m3 + 64 bf16 rope | 7 UE8M0 exponents + pad
K_COLS_584 = 512  # the K tile: 448 NoPE + 64 rope


def _record_584(e: _Emit, bases, lists, raw, blk):
    """(data address, exponent address) of slot ``raw`` (masked: slot 0) of block ``blk``'s list: ``bases`` the
    lists' caches (GMEM addresses), ``lists`` as ``produce_tile``'s. Two lists whose pages hold a power of 2 of
    entries: the block's list constants (base, shift, mask, page bytes) are selected first and one address is
    computed, rather than both lists' addresses and a select of each (fewer instructions in the producer's loop)."""
    arith, c32, c64, i64 = e.arith, e.c32, e.c64, e.i64
    slot = arith.maxsi(raw, c32(0))
    pow2 = all(epp & (epp - 1) == 0 for _, epp, _ in lists)
    if len(lists) == 2 and pow2:
        second = arith.cmpi(arith.CmpIPredicate.sge, blk, c32(lists[1][0]))
        (_, epp0, pb0), (_, epp1, pb1) = lists

        def pick(a, b):
            return arith.select(second, b, a)

        shift = pick(c32(epp0.bit_length() - 1), c32(epp1.bit_length() - 1))
        page = arith.extui(i64, arith.shrui(slot, shift))
        j = arith.extui(i64, arith.andi(slot, pick(c32(epp0 - 1), c32(epp1 - 1))))
        # both factors zero-extended from 32 bits: one mul.wide.u32
        page_bytes = arith.extui(i64, pick(c32(pb0), c32(pb1)))
        page_base = arith.addi(pick(bases[0], bases[1]), arith.muli(page, page_bytes))
        data = arith.addi(page_base, arith.muli(j, c64(REC584_DATA)))
        exps = arith.addi(arith.addi(page_base, pick(c64(epp0 * REC584_DATA), c64(epp1 * REC584_DATA))),
                          arith.muli(j, c64(SCALES584)))
        return data, exps
    out = []
    for base, (_, epp, page_bytes) in zip(bases, lists):
        page = arith.extui(i64, arith.divui(slot, c32(epp)))
        j = arith.extui(i64, arith.remui(slot, c32(epp)))
        page_base = arith.addi(base, arith.muli(page, c64(page_bytes)))
        out.append((arith.addi(page_base, arith.muli(j, c64(REC584_DATA))),
                    arith.addi(page_base, arith.addi(c64(epp * REC584_DATA), arith.muli(j, c64(SCALES584))))))
    if len(out) == 1:
        return out[0]
    second = arith.cmpi(arith.CmpIPredicate.sge, blk, c32(lists[1][0]))
    return tuple(arith.select(second, b, a) for a, b in zip(*out))


# ---- the producer's coalesced loads, both record formats ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Coalesced:
    """A record format as the coalesced producer reads it: K columns, 16-byte e4m3 NoPE chunks per record, the
    rope's first byte in the record's data and its first K column, and the scale kind: "fp32" (V3.2: an fp32
    scale per 8 chunks after the latent) or "ue8m0" (V4: an exponent byte per 4 chunks in the page's exponent
    region)."""
    cols: int
    nope_chunks: int
    rope_byte: int
    rope_col: int
    scales: str
    prefetch_split: int  # lanes 16..31 prefetch the record's lines from this byte on
    prefetch_offsets: tuple[int, ...]


_C656 = _Coalesced(K_COLS, LATENT // 16, LATENT + 16, LATENT, "fp32", 384, (0, 128, 256, 271))
_C584 = _Coalesced(K_COLS_584, NOPE584 // 16, NOPE584, NOPE584, "ue8m0", 288, (0, 128, 256, 287))


def coalesced_lane(lane: int) -> dict[str, int]:
    """The coalesced producer's roles of ``lane`` (0..31) of a warp, which owns 16 rows of a block (the emitter
    computes the same from the thread index; the CPU test checks coverage and bank spread from this). Latent
    loads: rows 2 p + ``h`` of the warp for row pair p, 16-byte chunk 16 j + ``c`` (j = 0, 1), so each load
    instruction reads 256 contiguous bytes of two rows; the chunk's bf16 halves are stored in the order
    ``swap`` (quarter-warps then hit eight distinct 16-byte bank slots). Rope loads: row 4 q + ``rope_row``,
    chunk ``rc`` of the 128 rope bytes, for q = 0..3."""
    c = lane >> 1
    return {"h": lane & 1, "c": c, "group_lo": c >> 3, "swap": (c >> 1) & 1,
            "rope_row": (lane & 1) + 2 * (lane >> 4), "rc": (lane >> 1) & 7}


def produce_tile(slots_refs, cache_refs, k_ref, idx_ref, b0, nblk, *, exts=(), nblocks: int, lists=None,
                 phases: int = 1, pow2_scales: bool = False, overlap: bool = False, k_shift: bool = False,
                 prefetch_ahead: int = 1) -> None:
    """The producer loop of a single CTA (one warpgroup, all 128 threads) for one ``MlaRecord656`` cache
    (``lists=None``) or one or two ``MlaRecord584`` caches (window, compressed; ``lists[i]`` = (the list's
    first block in the concatenated lists, entries per page, page bytes)). For k < ``nblk``: the block at
    position ``b0 + k`` of the token's live blocks (``sparse_mqa.block_of`` of ``exts``, the live blocks of all
    lists but the last, of ``nblocks`` in the concatenated lists) of ``slots_refs``
    (GMEM int32, a row per list, 64 slots per block) into K tile k % 2 of ``k_ref`` (SMEM [2, 64, cols] bf16,
    ``K_TILE_TRANSFORMS``), its raw slots into ``idx_ref`` row k % 2 (SMEM int32 [3, 64]; row 2: the raw
    mbarriers of ``init_barriers``).

    Coalesced loads (``coalesced_lane``): each load instruction of a warp reads whole 128-byte lines of two
    (NoPE) or four (rope) records. A warp serves 16 rows; a lane holds its row's slot (lane % 16) and gets the
    others' by ``shfl.sync``. 96 words per lane and block, loaded in ``phases`` rounds (1, 2 or 4) of row pairs
    and rope rows. V4's second NoPE load of a row pair has 12 chunks for 16 lanes: the other 4 read rope bytes
    and store nothing. V4's UE8M0 scales make the conversion-free dequantisation exact (``_DQ_POW2_ASM``).

    ``overlap``: each round's loads are issued before the previous round is converted, and a block's first
    round during its predecessor's last, so that a load's latency runs under the conversion instead of before
    it (a lone producer warp per scheduler has nothing else to issue meanwhile: Nsight Compute, V4 decode 64,
    benchmarks/results/archive/ncu_mqa_v4_b64_regions_h100_2026-12-06.txt). Two rounds' words are then live at
    once: with one round, all of a block's twice. The MQA's default for V3.2's records (``sparse_mqa.PRODUCER_OVERLAP``;
    V4's records lost with it).

    ``k_shift`` (power-of-two scales only): the tile holds the keys times 2^-K_SHIFT, so that the dequantisation
    takes one bf16 product instead of two (the rope values take one product each); the MQA scales its scores
    and rows back (``sparse_mqa``'s ``k_prescale``).

    ``prefetch_ahead``: the block whose records go into L2 while block k is loaded, k + 1 or k + 2 (block k + 2's
    slot is then loaded a block earlier and carried; block 1 is prefetched before the loop). Why: V4 decode's
    consumers wait on "full" much of their time, and fewer producer instructions did not shorten it
    (docs/perf-log.md, fifty-second session), so the loads' latency may set the pace."""
    if phases not in (1, 2, 4):
        raise ValueError(f"phases must be 1, 2 or 4, got {phases}")
    if prefetch_ahead not in (1, 2):
        raise ValueError(f"prefetch_ahead must be 1 or 2, got {prefetch_ahead}")
    nc = len(cache_refs)
    if nc != 1 if lists is None else (len(lists) != nc or not 1 <= nc <= 2):
        raise ValueError(f"MlaRecord656: one cache and lists=None; MlaRecord584: one or two caches and their lists "
                         f"(got {nc} caches, lists {lists})")
    fmt = _C656 if lists is None else _C584
    if k_shift and not (pow2_scales or fmt.scales == "ue8m0"):
        raise ValueError("k_shift=True needs the power-of-two dequantisation (ue8m0 scales, or pow2_scales=True)")

    def emit(e: _Emit, lp: _Loop, bases: list) -> None:
        arith, c32, c64, i64 = e.arith, e.c32, e.c64, e.i64
        lane, warp = arith.remui(lp.tid, c32(32)), arith.divui(lp.tid, c32(32))
        row0 = arith.muli(warp, c32(16))  # this warp's first row
        h, c = arith.andi(lane, c32(1)), arith.shrui(lane, c32(1))  # the roles of ``coalesced_lane``
        swap = arith.andi(arith.shrui(c, c32(1)), c32(1))
        pow2 = pow2_scales or fmt.scales == "ue8m0"
        dq_swap = e.dq_swap_selectors(arith.cmpi(arith.CmpIPredicate.ne, swap, c32(0)), pow2)
        rope_row = arith.addi(h, arith.muli(arith.shrui(lane, c32(4)), c32(2)))
        rc = arith.andi(c, c32(7))
        my_row = arith.addi(row0, arith.andi(lane, c32(15)))  # the row whose slot this lane holds
        hi16 = arith.extui(i64, arith.shrui(arith.andi(lane, c32(16)), c32(4)))
        nope_off = arith.extui(i64, arith.muli(c, c32(16)))
        rope_off = arith.extui(i64, arith.addi(c32(fmt.rope_byte), arith.muli(rc, c32(16))))
        if fmt.scales == "fp32":  # the fp32 scale of chunk 16 j + c: + 8 j from here
            sc_off = arith.extui(i64, arith.addi(c32(LATENT), arith.muli(arith.shrui(c, c32(3)), c32(4))))
        else:  # the exponent word of chunk 16 j + c: + 4 j from the entry's exponents; its byte c // 4
            sc_off = c64(0)
            sc_sel = arith.addi(c32(_UE8M0_SEL), arith.muli(arith.shrui(c, c32(2)), c32(_UE8M0_SEL_STEP)))
        last_live = arith.extui(e.i32, arith.cmpi(arith.CmpIPredicate.ult, c, c32(fmt.nope_chunks - 16)))
        publisher = arith.extui(e.i32, arith.cmpi(arith.CmpIPredicate.ult, lane, c32(16)))
        pairs, ropes = 8 // phases, 4 // phases

        def record(raw, blk):
            """(data address, scale address) of slot ``raw`` (masked: slot 0) of block ``blk``'s list."""
            if lists is not None:
                return _record_584(e, bases, lists, raw, blk)
            data = lp.record(raw)
            return data, data

        def scale_of(word):
            if fmt.scales == "fp32":
                return e.pow2_scale(word) if pow2_scales else word
            return e.ue8m0_scale(word, sc_sel)  # bf16 of 2^(e - 127) * 2^60, both halves

        def round_loads(s_cur, blk, p0: int, q0: int):
            """One asm statement: the NoPE chunks and scale words of row pairs p0.. and the rope chunks of rope
            rows q0..; -> per pair (2 x 4 NoPE words, 2 scale words), per rope row 4 words."""
            addrs, text, n_out, plan = [], "", 0, []
            for p in range(p0, p0 + pairs):
                data, sbase = record(e.shfl(s_cur, arith.addi(c32(2 * p), h)), blk)
                addrs += [arith.addi(data, nope_off), arith.addi(sbase, sc_off)]
                plan.append((len(addrs) - 2, len(addrs) - 1))
            for q in range(q0, q0 + ropes):
                data, _ = record(e.shfl(s_cur, arith.addi(c32(4 * q), rope_row)), blk)
                addrs.append(arith.addi(data, rope_off))
                plan.append((len(addrs) - 1,))
            n_in = len(addrs)
            for item in plan:
                if len(item) == 2:
                    for j in range(2):
                        text += (f"ld.global.nc.v4.u32 {{${n_out}, ${n_out + 1}, ${n_out + 2}, ${n_out + 3}}}, "
                                 f"[${{A{item[0]}}}+{256 * j}];\n")
                        n_out += 4
                    for j in range(2):
                        step = 8 if fmt.scales == "fp32" else 4
                        text += f"ld.global.nc.u32 ${n_out}, [${{A{item[1]}}}+{step * j}];\n"
                        n_out += 1
                else:
                    text += (f"ld.global.nc.v4.u32 {{${n_out}, ${n_out + 1}, ${n_out + 2}, ${n_out + 3}}}, "
                             f"[${{A{item[0]}}}];\n")
                    n_out += 4
            for a in range(n_in):
                text = text.replace(f"${{A{a}}}", f"${n_out + a}")
            words = e.asm(text, addrs, ",".join(["=r"] * n_out + ["l"] * n_in), n_out)
            out, i = [], 0
            for item in plan:
                if len(item) == 2:
                    out.append((words[i:i + 4], words[i + 4:i + 8], words[i + 8], words[i + 9]))
                    i += 10
                else:
                    out.append(words[i:i + 4])
                    i += 4
            return out

        def flat(got) -> list:  # ``round_loads``' words as one list (the loop carries them), and back
            return [w for it in got for w in ([*it[0], *it[1], it[2], it[3]] if isinstance(it, tuple) else it)]

        def unflat(words: list) -> list:
            return ([(words[10 * p:10 * p + 4], words[10 * p + 4:10 * p + 8], words[10 * p + 8], words[10 * p + 9])
                     for p in range(pairs)] + [words[10 * pairs + 4 * q:10 * pairs + 4 * q + 4] for q in range(ropes)])

        far = prefetch_ahead == 2
        n_slots = 6 if far else 5  # carried: slots / block ids k, k + 1, block id k + 2 (and its slot if ``far``)

        def prefetch(s_blk, blk) -> None:
            ndata, nsc = record(s_blk, blk)
            e.prefetch(arith.addi(ndata, arith.muli(hi16, c64(fmt.prefetch_split))), fmt.prefetch_offsets)
            if fmt.scales == "ue8m0":
                e.prefetch(nsc, (0,))

        def body(kk, carried):
            s_cur, blk_cur, s_next, blk_next, blk_nn = carried[:5]
            s_nn = carried[5] if far else None  # block k + 2's slot, loaded a block ago
            ahead = unflat(carried[n_slots:]) if overlap else None  # ``overlap``: this block's first round, loaded
            b = arith.remui(kk, c32(2))
            b8 = arith.muli(b, c32(8))
            tile = lp.tile(b, fmt.cols)
            out = {}
            for r in range(phases):
                if overlap:  # the next round's loads (the next block's first after the last round) go out first
                    got = ahead
                    s_ld, blk_ld, r_ld = (s_cur, blk_cur, r + 1) if r + 1 < phases else (s_next, blk_next, 0)
                    ahead = round_loads(s_ld, blk_ld, r_ld * pairs, r_ld * ropes)
                else:
                    got = round_loads(s_cur, blk_cur, r * pairs, r * ropes)
                if r == 0:  # block k + 2's slot (k + 3's if ``far``), block k + 3's id, the records of block
                    # k + 1 (k + 2) into L2, tile b free
                    if far:
                        out["blk_nnn"] = lp.block_of(arith.addi(kk, c32(3)))
                        out["s_nnn"] = lp.slot_of(out["blk_nnn"], my_row)
                        prefetch(s_nn, blk_nn)
                    else:
                        out["s_nn"] = lp.slot_of(blk_nn, my_row)
                        out["blk_nnn"] = lp.block_of(arith.addi(kk, c32(3)))
                        prefetch(s_next, blk_next)
                    lp.wait_free(kk, b8)
                    e.store_slot_at(arith.addi(lp.idx_base, arith.muli(b, c32(BLOCK * 4))), my_row, s_cur,
                                    publisher)
                for n, p in enumerate(range(r * pairs, (r + 1) * pairs)):
                    nope = got[n]
                    row_base, sw = e.k_row(tile, arith.addi(row0, arith.addi(c32(2 * p), h)), fmt.cols)
                    col = arith.addi(arith.muli(c, c32(16)), arith.muli(swap, c32(8)))
                    for j in range(2):
                        words = e.dequant(nope[j], scale_of(nope[2 + j]), pow2, dq_swap, k_shift)  # lo, hi
                        lo, hi = words[:4], words[4:]
                        live = last_live if 16 * (j + 1) > fmt.nope_chunks else None
                        e.store16(e.k_addr(row_base, sw, col, 256 * j), lo, live)
                        e.store16(e.k_addr(row_base, sw, arith.xori(col, c32(8)), 256 * j), hi, live)
                for n, q in enumerate(range(r * ropes, (r + 1) * ropes)):
                    row_base, sw = e.k_row(tile, arith.addi(row0, arith.addi(c32(4 * q), rope_row)), fmt.cols)
                    rope = [e.mul_bf16x2(x, _BF16X2_2M60) for x in got[pairs + n]] if k_shift else got[pairs + n]
                    e.store16(e.k_addr(row_base, sw, arith.muli(rc, c32(8)), fmt.rope_col), rope)
            lp.arrive_full(b8)
            slots = ([s_next, blk_next, s_nn, blk_nn, out["blk_nnn"], out["s_nnn"]] if far else
                     [s_next, blk_next, out["s_nn"], blk_nn, out["blk_nnn"]])
            return slots + (flat(ahead) if overlap else [])

        blk0, blk1, blk2 = lp.block_of(c32(0)), lp.block_of(c32(1)), lp.block_of(c32(2))
        s0 = lp.slot_of(blk0, my_row)
        first = flat(round_loads(s0, blk0, 0, 0)) if overlap else []  # block 0's first round (or a re-read)
        s1 = lp.slot_of(blk1, my_row)
        init = [s0, blk0, s1, blk1, blk2]
        if far:  # block 1's records into L2 here (the loop's first prefetch is block 2's), block 2's slot carried
            prefetch(s1, blk1)
            init.append(lp.slot_of(blk2, my_row))
        lp.run(init + first, body)

    if len(slots_refs) != nc or len(exts) != nc - 1:
        raise ValueError(f"a slot row per list and the live blocks of all but the last: got {len(slots_refs)} slot "
                         f"rows and {len(exts)} extents for {nc} caches")
    starts = (0,) if lists is None else tuple(x[0] for x in lists)
    _lists_loop(starts, nblocks, emit)(*slots_refs, *cache_refs, k_ref, idx_ref, b0, nblk, *exts)
