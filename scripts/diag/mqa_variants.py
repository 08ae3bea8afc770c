"""The sparse MQA kernel's variants at the benchmark's shapes, device time from the GPU timeline, one call.

    python scripts/diag/mqa_variants.py [--cases v32_decode_64 v4_decode_64 ...] [--variants default held preg ...]
        [--out F]

Why: ``bench_kernels --only sparse_mqa`` times the default and the register-P kernel beside XLA with the pipelined
method. This times any of the kernel's switches (``VARIANTS``) at the named cases with the GPU timeline
(``profile_span_us``, as ``topk_knobs.py``), checks each against the XLA path (``max_abs_err`` relative to the
output's largest value) and gives the effective TFLOP/s (2 * heads * valid candidates * (dk + v_dim) per token).
"""

from __future__ import annotations

import argparse
import functools

import jax
import numpy as np

from jds.bench import kernels_sparse_mqa as b
from jds.bench.results import measured_row, save_rows
from jds.bench.timing import CAPTURED_OPTIONS, profiled_device_us
from pallas_kernels import sparse_mqa

# the kernel's switch sets by name (keyword arguments of sparse_mqa; "default" picks the candidate splits itself:
# one at V3.2 batch 64, two at V4 batch 64, whose partial rows the wrapper merges in XLA). The twelfth session's
# switches (descriptors held across the loop, both warpgroups computing the whole S, register P) all lost and were
# removed, as was the twentieth's (the next block's QK issued behind the PV; docs/perf-log.md).
VARIANTS = {"default": {}, "scores_one": dict(scores="one"), "bf16_out_scores_one": dict(out_dtype="bfloat16", scores="one"),
            # the default before 2026-12-07 (each compute warpgroup scores half of a block's candidates)
            "scores_split": dict(scores="split"), "bf16_out_scores_split": dict(out_dtype="bfloat16", scores="split"),
            "splits1": dict(num_splits=1), "splits2": dict(num_splits=2),
            "splits4": dict(num_splits=4),
            # the layers' output dtype (split rows fp32 by default; ``split_dtype`` bf16: half their bytes)
            "bf16_out": dict(out_dtype="bfloat16"), "bf16_out_splits1": dict(out_dtype="bfloat16", num_splits=1),
            "bf16_out_split_bf16": dict(out_dtype="bfloat16", split_dtype="bfloat16"),
            # the splits' merge as XLA's fusions instead of the one-kernel default (``split_combine``)
            "combine_xla": dict(combine="xla"), "bf16_out_combine_xla": dict(out_dtype="bfloat16", combine="xla"),
            "bf16_out_split_bf16_combine_xla": dict(out_dtype="bfloat16", split_dtype="bfloat16", combine="xla"),
            # bf16 rows through the q tile and TMA copies (``out_store``; the bf16 default since 2026-12-05, so
            # "bf16_out" rows of one split measured before then are "bf16_out_direct")
            "bf16_out_tma": dict(out_dtype="bfloat16", out_store="tma"),
            "bf16_out_direct": dict(out_dtype="bfloat16", out_store="direct"),
            "bf16_out_split_bf16_tma": dict(out_dtype="bfloat16", split_dtype="bfloat16", out_store="tma"),
            # the lists' extents as one Triton kernel instead of an XLA reduction per list (V4's two lists; the
            # default for several lists since 2026-12-05: "default" rows of V4 before then are "extents_xla")
            "extents_xla": dict(extents="xla"), "extents_pallas": dict(extents="pallas"),
            # ... or in the MQA kernel from the slot rows (no kernel before it; the register producer only)
            "ext_kernel": dict(extents="kernel"), "bf16_out_ext_kernel": dict(out_dtype="bfloat16", extents="kernel"),
            # two splits as a 2-CTA cluster merging through distributed shared memory (no split rows, no merge
            # kernel; ``merge``)
            "cluster": dict(num_splits=2, merge="cluster"), "rows": dict(merge="rows"),
            "bf16_out_rows": dict(out_dtype="bfloat16", merge="rows"),
            "bf16_out_cluster": dict(out_dtype="bfloat16", num_splits=2, merge="cluster"),
            # ... with the pair's q tile by one multicast TMA (``q_multicast``), and the extents in the kernel
            "q_mc": dict(num_splits=2, merge="cluster", q_multicast=True),
            "bf16_out_q_mc": dict(out_dtype="bfloat16", num_splits=2, merge="cluster", q_multicast=True),
            "bf16_out_q_mc_ext_kernel": dict(out_dtype="bfloat16", num_splits=2, merge="cluster", q_multicast=True,
                                             extents="kernel"),
            # the q tile loaded by each CTA of the pair (the default multicasts it since 2026-12-06)
            "no_q_mc": dict(q_multicast=False), "bf16_out_no_q_mc": dict(out_dtype="bfloat16", q_multicast=False),
            "bf16_out_extents_xla": dict(out_dtype="bfloat16", extents="xla"),
            # the producer's rounds of loads issued one ahead of their conversion (``producer_overlap``)
            "ovl2": dict(producer_phases=2, producer_overlap=True),
            "ovl4": dict(producer_phases=4, producer_overlap=True),
            "ovl2_r152": dict(producer_phases=2, producer_overlap=True, producer_regs=152),
            "bf16_out_ovl2": dict(out_dtype="bfloat16", producer_phases=2, producer_overlap=True),
            "p2": dict(producer_phases=2),
            "ovl2_r160": dict(producer_phases=2, producer_overlap=True, producer_regs=160),
            "ovl4_r152": dict(producer_phases=4, producer_overlap=True, producer_regs=152),
            # V3.2's producer before 2026-12-06 (one round, not overlapped, 144 registers)
            "v32_p1_r144": dict(producer_phases=1, producer_overlap=False, producer_regs=144),
            # the keys times 2^-60 in the K tile, one bf16 product per dequantised word (``k_prescale``; V4 and
            # V3.2 ue8m0 records; the default since 2026-12-06, so these equal "default" / "bf16_out" now)
            "k_pre": dict(k_prescale=True), "bf16_out_k_pre": dict(out_dtype="bfloat16", k_prescale=True),
            # the keys unscaled, two products per word (the default before 2026-12-06)
            "no_k_pre": dict(k_prescale=False),
            # the records prefetched into L2 two blocks ahead instead of one (``producer_prefetch``)
            "pf2": dict(producer_prefetch=2), "bf16_out_pf2": dict(out_dtype="bfloat16", producer_prefetch=2),
            # the wrapper as main's layers ran it before 2026-12-05 (bf16 split rows, XLA's merge, direct stores)
            "before_1205": dict(out_dtype="bfloat16", split_dtype="bfloat16", combine="xla", out_store="direct",
                                extents="xla"), "bf16_out_extents_pallas": dict(out_dtype="bfloat16",
                                                                                     extents="pallas"),
            # who fills the K tile: "tma" (the compute warpgroups, from bulk-copied rows) or "registers" (the
            # default for fp8 records natively: a third warpgroup, one software-pipelined loop of coalesced loads)
            "tma": dict(producer="tma"), "registers": dict(producer="registers"),
            "registers_splits1": dict(producer="registers", num_splits=1),  # V4 b64
            # the fp32 dequantisation (conversion instructions) where the default takes the power-of-two one
            "registers_f32": dict(producer="registers", producer_pow2=False),
            # the register producer's rounds of loads (96 words per lane and block) and registers
            **{f"registers_p{p}r{r}": dict(producer="registers", producer_phases=p, producer_regs=r)
               for p, r in ((1, 136), (1, 144), (1, 152), (2, 136), (4, 80))}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=["v32_decode_64", "v32_decode_128", "v4_decode_64"])
    ap.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS))
    ap.add_argument("--quick", action="store_true", help="the benchmark's small shapes (a CPU check of the script)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows: list[dict] = []
    variants = {n: VARIANTS[n] for n in a.variants}
    for name in a.cases:
        c = b.case(name, a.quick)
        q, caches, slots, sink = c["q"], c["caches"], c["slots"], c["sink"]
        t, h, dk = q.shape
        n_valid = sum(np.asarray((s >= 0).sum(axis=1)) for s in slots)
        flops = float(np.sum(2.0 * h * n_valid * (dk + c["v_dim"])))
        call = functools.partial(sparse_mqa.sparse_mqa, formats=c["fmts"], scale=c["scale"], v_dim=c["v_dim"])
        ref = np.asarray(jax.jit(lambda q, cs, ss, sk: call(q, cs, slots=ss, sink=sk, implementation="xla"))(
            q, caches, slots, sink))
        for v in a.variants:
            f = jax.jit(lambda q, cs, ss, sk, kw=VARIANTS[v]: call(q, cs, slots=ss, sink=sk, **kw),
                        compiler_options=CAPTURED_OPTIONS)  # one CUDA graph however few its kernels

            def measure(f=f) -> dict:
                got = np.asarray(f(q, caches, slots, sink)).astype(np.float32)
                m = dict(max_abs_err=float(np.abs(got - ref).max()), ref_max=float(np.abs(ref).max()),
                         **profiled_device_us(f, q, caches, slots, sink, by_kernel=True))
                return dict(m, tflops=flops / m["profile_span_us"] / 1e6) if "profile_span_us" in m else m

            rows.append(measured_row({"case": name, "variant": v, **VARIANTS[v], "flops": flops}, measure))
            save_rows(a.out, rows, False, variants=variants)  # a run cut short keeps its rows
    save_rows(a.out, rows, True, variants=variants)


if __name__ == "__main__":
    main()
