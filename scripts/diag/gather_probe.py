"""Probe: a per-thread register gather of cache rows in a Pallas Mosaic GPU kernel (issue 20's MQA plan).

The sparse MQA gathers each block's 64 candidate rows by one bulk TMA copy per row into staging SMEM
(``pallas_kernels/sparse_mqa.py``), and that staging (55 KB) is what keeps a second K tile out of SMEM.
FlashMLA's sm90 sparse decode gathers with plain 128-bit global loads into registers instead. Lane semantics
has no per-thread address, so this probe writes the gather inside ``plgpu.inline_mgpu`` (GMEM refs as memrefs,
each thread's addresses from its thread index and the block's slots, ``ld.global.nc.v4`` / ``st.global.v4``
in PTX) and checks two things on the GPU before the MQA is built on it:

- correctness: the gathered rows equal ``cache[slots]`` byte for byte (any row length that is a multiple of 16
  bytes: 656 is V3.2's ``MlaRecord656``);
- speed: GPU-timeline device µs of the gather (one CTA per SM, each looping over its blocks), against XLA's
  ``jnp.take`` of the same rows and the copy bandwidth of the bytes moved, with the loads of a block issued
  before its stores (``--ilp``) or load-store pairs (``--no-ilp``).

    python3 scripts/diag/gather_probe.py [--rows 262144] [--row-bytes 656] [--blocks 4096] [--out F.json]

``--dequant``: the MQA producer's whole job for V3.2 records (``record_gather.dequant_blocks``: what the
sparse MQA's ``producer="registers"`` runs, with the fp32 or the power-of-two dequantisation): gather a block's 64 records, dequantise them in registers and store
the bf16 rows at the addresses of the MQA's swizzled K tile, then TMA the tile out: equal to XLA's
dequantisation of the gathered records bit for bit only if the swizzle is right.

Native only (inline PTX); ``--lower-only`` lowers the kernels for an H200 on any machine.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from jds.ops.dispatch import num_sms
from pallas_kernels import record_gather

BLOCK = 64  # rows per block (the MQA's candidates per block)
THREADS = 128  # one warpgroup
VEC = 16  # bytes per load


def _gather_call(n_blocks: int, row_bytes: int, ilp: bool, ctas: int):
    """The kernel: CTA c gathers blocks c, c + ctas, ...; in a block, thread t serves row t // 2 and every
    second 16-byte vector of it from t % 2 on."""
    if row_bytes % VEC:
        raise ValueError(f"row_bytes must be a multiple of {VEC}, got {row_bytes}")
    nvec = row_bytes // VEC
    tpr = THREADS // BLOCK  # threads per row
    per_thread = -(-nvec // tpr)

    def kernel(slots_ref, cache_ref, out_ref):
        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
        def gather(_, slots, cache, out):
            from jax._src.lib.mlir import ir  # noqa: PLC0415 - lowering-time imports
            from jax._src.lib.mlir.dialects import arith, llvm, scf  # noqa: PLC0415
            from jax.experimental.mosaic.gpu import utils as mu  # noqa: PLC0415

            i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
            v4 = llvm.StructType.get_literal([i32] * 4)
            void = ir.Type.parse("!llvm.void")

            def addr(memref) -> ir.Value:
                return llvm.ptrtoint(i64, mu.memref_ptr(memref))

            def c64(v: int) -> ir.Value:
                return arith.constant(i64, v)

            slots_base, cache_base, out_base = addr(slots), addr(cache), addr(out)
            tid = mu.thread_idx()
            row = arith.extui(i64, arith.divui(tid, arith.constant(i32, tpr)))
            part = arith.extui(i64, arith.remui(tid, arith.constant(i32, tpr)))
            cta = arith.extui(i64, mu.block_idx())
            n_mine = (n_blocks - 1) // ctas + 1  # an upper bound: blocks past n_blocks are skipped

            loop = scf.ForOp(c64(0), c64(n_mine), c64(1))
            with ir.InsertionPoint(loop.body):
                blk = arith.addi(cta, arith.muli(loop.induction_variable, c64(ctas)))
                live = arith.cmpi(arith.CmpIPredicate.ult, blk, c64(n_blocks))
                body_if = scf.IfOp(live)
                with ir.InsertionPoint(body_if.then_block):
                    r = arith.addi(arith.muli(blk, c64(BLOCK)), row)
                    slot_ptr = arith.addi(slots_base, arith.muli(r, c64(4)))
                    slot = llvm.inline_asm(i32, [slot_ptr], "ld.global.nc.u32 $0, [$1];", "=r,l")
                    src = arith.addi(cache_base, arith.muli(arith.extui(i64, slot), c64(row_bytes)))
                    dst = arith.addi(out_base, arith.muli(r, c64(row_bytes)))
                    pending = []
                    for j in range(per_thread):
                        v = arith.addi(part, c64(tpr * j))  # this thread's j-th vector of the row
                        off = arith.muli(v, c64(VEC))
                        ok = arith.cmpi(arith.CmpIPredicate.ult, v, c64(nvec))
                        okw = arith.extui(i32, ok)  # the PTX predicate's source: a 32-bit 0 / 1
                        # predicated load (a thread past the row's end loads nothing and gets zeros)
                        regs = llvm.inline_asm(
                            v4, [arith.addi(src, off), okw],
                            "{ .reg .pred p; setp.ne.u32 p, $5, 0; mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; "
                            "mov.u32 $3, 0; @p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4]; }",
                            "=r,=r,=r,=r,l,r")
                        pending.append((arith.addi(dst, off), okw, regs))
                        if not ilp:
                            _store(pending.pop(), llvm, i32, void)
                    for item in pending:
                        _store(item, llvm, i32, void)
                    scf.yield_([])
                scf.yield_([])

        gather(slots_ref, cache_ref, out_ref)

    out_shape = jax.ShapeDtypeStruct((n_blocks * BLOCK, row_bytes), jnp.uint8)
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=out_shape, grid=(ctas,), grid_names=("cta",), compiler_params=params)


def _store(item, llvm, i32, void) -> None:
    ptr, okw, regs = item
    words = [llvm.extractvalue(i32, regs, [k]) for k in range(4)]
    llvm.inline_asm(void, [ptr, *words, okw],
                    "{ .reg .pred p; setp.ne.u32 p, $5, 0; @p st.global.v4.u32 [$0], {$1, $2, $3, $4}; }",
                    "l,r,r,r,r,r", has_side_effects=True)


REC, KT_COLS = record_gather.REC656, record_gather.K_COLS


def dequant_rows(cache: jax.Array, slots: jax.Array, *, pow2_scales: bool = False,
                 ctas: int | None = None) -> jax.Array:
    """``record_gather.dequant_blocks`` with one CTA per SM."""
    return record_gather.dequant_blocks(cache, slots, pow2_scales=pow2_scales,
                                        ctas=ctas or min(num_sms(), slots.shape[0]))


def dequant_reference(cache: jax.Array, slots: jax.Array) -> jax.Array:
    """XLA: the records' latent e4m3 times its scale, rounded to bf16, then the bf16 rope values."""
    from jds.ops.records import MlaRecord656  # noqa: PLC0415

    fmt = MlaRecord656(entries_per_page=1)
    recs = jnp.take(cache, slots.reshape(-1), axis=0)
    return fmt.unpack(recs).astype(jnp.bfloat16)


def gather_rows(cache: jax.Array, slots: jax.Array, *, ilp: bool = True, ctas: int | None = None) -> jax.Array:
    """Rows ``slots`` [n_blocks, 64] (int32, in range) of ``cache`` [rows, row_bytes] (uint8): [n_blocks * 64,
    row_bytes], by the register-gather kernel."""
    n_blocks, rows = slots.shape
    if rows != BLOCK or cache.dtype != jnp.uint8 or cache.ndim != 2:
        raise ValueError(f"slots must be [n, {BLOCK}] and cache uint8 [rows, row_bytes], got {slots.shape} "
                         f"{cache.dtype} {cache.shape}")
    call = _gather_call(n_blocks, cache.shape[1], ilp, ctas or min(num_sms(), n_blocks))
    return call(slots.astype(jnp.int32), cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=262144, help="cache rows (262144 x 656 B = 172 MB, past L2)")
    ap.add_argument("--row-bytes", type=int, default=656)
    ap.add_argument("--blocks", type=int, default=4096, help="blocks of 64 gathered rows per call")
    ap.add_argument("--dequant", action="store_true", help="the V3.2 record -> swizzled bf16 K tile probe")
    ap.add_argument("--lower-only", action="store_true", help="lower for an H200 (any machine) and stop")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.lower_only:
        from jax.sharding import AbstractDevice, AbstractMesh  # noqa: PLC0415

        dev = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
        args = (jax.ShapeDtypeStruct((a.rows, a.row_bytes), jnp.uint8),
                jax.ShapeDtypeStruct((a.blocks, BLOCK), jnp.int32))
        with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=dev)):
            for ilp in (True, False):
                text = jax.jit(functools.partial(gather_rows, ilp=ilp, ctas=132)).trace(*args).lower(
                    lowering_platforms=("cuda",)).as_text()
                print("lowered", "ilp" if ilp else "no-ilp", "mosaic_gpu" in text)
            args = (jax.ShapeDtypeStruct((a.rows, REC), jnp.uint8), args[1])
            for pow2 in (False, True):
                text = jax.jit(functools.partial(dequant_rows, ctas=132, pow2_scales=pow2)).trace(*args).lower(
                    lowering_platforms=("cuda",)).as_text()
                print("lowered dequant", "pow2" if pow2 else "f32", "mosaic_gpu" in text)
        return

    from jds.bench.results import measured_row, run_meta, write_json  # noqa: PLC0415
    from jds.bench.timing import measure_ceilings, profiled_device_us  # noqa: PLC0415

    rng = np.random.default_rng(0)
    ceil = measure_ceilings()
    slots = jnp.asarray(rng.integers(0, a.rows, (a.blocks, BLOCK), dtype=np.int32))
    if a.dequant:  # real records: random rows packed as the cache writer packs them
        from jds.ops.records import MlaRecord656  # noqa: PLC0415

        rows_f = jax.random.normal(jax.random.key(0), (a.rows, KT_COLS), jnp.float32)
        cache = jax.jit(MlaRecord656(entries_per_page=1).pack)(rows_f)
        want = np.asarray(dequant_reference(cache, slots))
        moved = a.blocks * BLOCK * (REC + 2 * KT_COLS)  # records read, bf16 rows written
        impls = {"register_dequant": jax.jit(dequant_rows),
                 "register_dequant_pow2": jax.jit(functools.partial(dequant_rows, pow2_scales=True)),
                 "xla_dequant": jax.jit(dequant_reference)}
    else:
        cache = jnp.asarray(rng.integers(0, 256, (a.rows, a.row_bytes), dtype=np.uint8))
        want = np.asarray(cache)[np.asarray(slots).reshape(-1)]
        moved = 2 * a.blocks * BLOCK * a.row_bytes  # read + write
        impls = {"register_gather_ilp": jax.jit(functools.partial(gather_rows, ilp=True)),
                 "register_gather_pairs": jax.jit(functools.partial(gather_rows, ilp=False)),
                 "xla_take": jax.jit(lambda c, s: jnp.take(c, s.reshape(-1), axis=0))}
    rows = []
    for name, f in impls.items():
        def measure(f=f) -> dict:
            got = np.asarray(f(cache, slots))
            m = profiled_device_us(f, cache, slots)
            if "profile_span_us" in m:
                m["copy_frac"] = moved / (m["profile_span_us"] * 1e-6) / ceil["copy_bytes_per_s"]
            bad = got.view(np.uint16) != want.view(np.uint16) if got.dtype == jnp.bfloat16 else got != want
            return dict(equal=not bool(bad.any()), mismatches=int(bad.sum()), **m)

        rows.append(measured_row(dict(impl=name, rows=a.rows, row_bytes=REC if a.dequant else a.row_bytes,
                                      blocks=a.blocks, bytes=moved), measure))
    if a.out:
        write_json(a.out, {"meta": run_meta(**ceil), "rows": rows})


if __name__ == "__main__":
    main()
