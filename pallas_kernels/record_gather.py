"""Register gather of V3.2 cache records into a swizzled bf16 K tile (Pallas Mosaic GPU, inline PTX).

The sparse MQA's producer job, done the way FlashMLA's sm90 sparse decode does it: no TMA per row and no
staging rows in shared memory. One warpgroup gathers a block of 64 ``MlaRecord656`` records (512 e4m3 latent
values, 4 fp32 scales per 128, 64 bf16 rope values) with per-thread 128-bit global loads, dequantises the
latent in registers and stores the bf16 rows straight into the MQA's K tile layout. Lane semantics has no
per-thread address, so the body is Mosaic GPU code inside ``plgpu.inline_mgpu``: each thread's addresses come
from its thread index and the block's slots.

- Thread t of the warpgroup serves row t // 2: latent columns 256 (t % 2) .. + 255 with its record's scales
  2 (t % 2) and 2 (t % 2) + 1, and rope values 32 (t % 2) .. + 31.
- e4m3 -> bf16: ``cvt.rn.f16x2.e4m3x2`` (exact), float32 multiply by the scale, ``cvt.rn.bf16x2.f32``: the
  same values as ``MlaRecord656.unpack`` (checked bit for bit on the H200 by ``scripts/diag/gather_probe.py
  --dequant``, benchmarks/results/archive/gather_probe_h200_2026-12-02.json).
- K tile layout ([64, 576] bf16, ``K_TILE_TRANSFORMS``): (8, 32) tiles of 512 bytes, row-tile major; inside a
  tile row r is 64 bytes and its 16-byte unit u sits at u ^ ((r >> 1) & 3) (the 64-byte swizzle).
- Record address: slot * 656 from the cache's base (a page holds ``entries_per_page`` records back to back,
  so the page offset need not be computed). A masked slot (< 0) reads record 0, as the pure-JAX path does.

Native only (inline PTX); GPU interpret mode cannot run it.
"""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu

REC656 = 656  # MlaRecord656: 512 e4m3 | 4 fp32 scales | 64 bf16 rope
LATENT, ROPE = 512, 64
K_COLS = LATENT + ROPE  # the K tile's columns (bf16)
BLOCK = 64  # rows per block (the MQA's candidates per block)
K_TILE_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))

# one 16-byte chunk of e4m3 (4 words) times an fp32 scale -> 16 bf16 (8 words); element order kept (the low
# byte / half of a word first)
_DQ_ASM = (
    "{ .reg .b16 h<8>; .reg .b32 f<8>; .reg .f16 x<16>; .reg .f32 y<16>;\n"
    + "".join(f"mov.b32 {{h{2 * i}, h{2 * i + 1}}}, ${8 + i};\n" for i in range(4))
    + "".join(f"cvt.rn.f16x2.e4m3x2 f{i}, h{i};\n" for i in range(8))
    + "".join(f"mov.b32 {{x{2 * i}, x{2 * i + 1}}}, f{i};\n" for i in range(8))
    + "".join(f"cvt.f32.f16 y{i}, x{i};\nmul.f32 y{i}, y{i}, $12;\n" for i in range(16))
    + "".join(f"cvt.rn.bf16x2.f32 ${i}, y{2 * i + 1}, y{2 * i};\n" for i in range(8))
    + "}")


def fill_k_tile_656(slots_ref, cache_ref, k_ref, idx_ref=None, *, phases: int = 1, next_slots_ref=None) -> None:
    """From one warpgroup (all 128 threads): the bf16 K rows of the 64 records ``slots_ref`` (GMEM int32 [64])
    of ``cache_ref`` (GMEM uint8, records at slot * 656) into ``k_ref`` (SMEM [64, 576] bf16 with
    ``K_TILE_TRANSFORMS``); with ``idx_ref`` (SMEM int32 [64]) also the raw slots, for the consumers' mask.
    ``phases``: the latent's loads in that many rounds (1: every load of a thread in flight at once, 84
    registers of data; 2 or 4: a half or a quarter of them per round, for a smaller register budget).
    ``next_slots_ref`` (GMEM int32 [64]): the next block's slots, whose records are first prefetched into L2
    (no registers held), so the next call's loads wait on L2, not DRAM. The caller makes the stores visible
    (``plgpu.commit_smem``) and synchronises."""
    if phases not in (1, 2, 4):
        raise ValueError(f"phases must be 1, 2 or 4, got {phases}")
    has_idx, has_next = idx_ref is not None, next_slots_ref is not None
    refs = (slots_ref, cache_ref, k_ref) + ((idx_ref,) if has_idx else ()) + ((next_slots_ref,) if has_next else ())
    types = (plgpu.RefType(), plgpu.RefType(), plgpu.RefType(K_TILE_TRANSFORMS)) + \
        (plgpu.RefType(),) * (has_idx + has_next)

    @plgpu.inline_mgpu(arg_types=types)
    def fill(_, slots, cache, k, *extra):
        from jax._src.lib.mlir import ir  # noqa: PLC0415 - lowering-time imports
        from jax._src.lib.mlir.dialects import arith, llvm  # noqa: PLC0415
        from jax.experimental.mosaic.gpu import utils as mu  # noqa: PLC0415

        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        void = ir.Type.parse("!llvm.void")
        c32 = lambda v: arith.constant(i32, v)  # noqa: E731
        c64 = lambda v: arith.constant(i64, v)  # noqa: E731
        tid = arith.remui(mu.thread_idx(), c32(128))  # the thread in its warpgroup
        row, half = arith.divui(tid, c32(2)), arith.remui(tid, c32(2))

        def record_of(slots_ref):
            """This thread's row's raw slot (-1 kept) and the global address of its record (slot 0's if masked)."""
            ptr = arith.addi(llvm.ptrtoint(i64, mu.memref_ptr(slots_ref)), arith.extui(i64, arith.muli(row, c32(4))))
            raw_slot = llvm.inline_asm(i32, [ptr], "ld.global.nc.u32 $0, [$1];", "=r,l")
            slot = arith.maxsi(raw_slot, c32(0))
            base = llvm.ptrtoint(i64, mu.memref_ptr(cache))
            return raw_slot, arith.addi(base, arith.muli(arith.extui(i64, slot), c64(REC656)))

        raw, rec = record_of(slots)
        k_base = llvm.ptrtoint(i32, mu.memref_ptr(k))
        r8 = arith.remui(row, c32(8))
        row_off = arith.addi(arith.muli(arith.divui(row, c32(8)), c32((K_COLS // 32) * 512)),
                             arith.muli(r8, c32(64)))
        sw = arith.andi(arith.shrui(r8, c32(1)), c32(3))

        def k_addr(col0, col: int):
            """Shared address of the 8 bf16 at columns col0 + col .. + 7 (col0 dynamic, a multiple of 32)."""
            c = arith.addi(col0, c32(col))
            unit = arith.xori(arith.andi(arith.shrui(c, c32(3)), c32(3)), sw)
            return arith.addi(k_base, arith.addi(row_off, arith.addi(
                arith.muli(arith.shrui(c, c32(5)), c32(512)), arith.muli(unit, c32(16)))))

        def load16(off):
            v = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [arith.addi(rec, off)],
                                "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
            return [llvm.extractvalue(i32, v, [j]) for j in range(4)]

        def store16(addr, words) -> None:
            llvm.inline_asm(void, [addr, *words], "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r",
                            has_side_effects=True)

        idx = extra[:1] if has_idx else ()
        if has_next:  # the next block's record (this thread's half of it, 7 lines in all) into L2
            _, nrec = record_of(extra[-1])
            first = arith.addi(nrec, arith.muli(arith.extui(i64, half), c64(384)))
            for off in (0, 128, 256, 271):  # samples <= 128 bytes apart: every line; half 1's +271 is byte 655
                llvm.inline_asm(void, [arith.addi(first, c64(off))], "prefetch.global.L2 [$0];", "l",
                                has_side_effects=True)
        if idx:  # the raw slot (-1 kept) for the consumers' validity mask: one thread per row
            is_first = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.eq, half, c32(0)))
            addr = arith.addi(llvm.ptrtoint(i32, mu.memref_ptr(idx[0])), arith.muli(row, c32(4)))
            llvm.inline_asm(void, [addr, raw, is_first],
                            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p st.shared.u32 [$0], $1; }", "r,r,r",
                            has_side_effects=True)
        half64 = arith.extui(i64, half)
        lat0 = arith.muli(half64, c64(256))  # this thread's first latent byte
        scales = load16(c64(LATENT))
        rope = [load16(arith.addi(arith.muli(half64, c64(64)), c64(LATENT + 16 + 16 * q))) for q in range(4)]
        col_lat = arith.muli(half, c32(256))
        per = 16 // phases
        for p in range(phases):  # every load of the round first, then convert and store
            lat = [load16(arith.addi(lat0, c64(16 * i))) for i in range(p * per, (p + 1) * per)]
            for n, i in enumerate(range(p * per, (p + 1) * per)):
                sc = arith.select(arith.cmpi(arith.CmpIPredicate.eq, half, c32(0)), scales[i // 8],
                                  scales[2 + i // 8])
                out = llvm.inline_asm(llvm.StructType.get_literal([i32] * 8), [*lat[n], sc], _DQ_ASM,
                                      "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r")
                words = [llvm.extractvalue(i32, out, [j]) for j in range(8)]
                store16(k_addr(col_lat, 16 * i), words[:4])
                store16(k_addr(col_lat, 16 * i + 8), words[4:])
        col_rope = arith.addi(c32(LATENT), arith.muli(half, c32(32)))
        for q in range(4):
            store16(k_addr(col_rope, 8 * q), rope[q])

    fill(*refs)
