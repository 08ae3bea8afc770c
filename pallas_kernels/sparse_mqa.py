"""Token-level sparse MQA over the paged caches on Hopper (Pallas Mosaic GPU), with the pure-JAX path
(``implementation="xla"``: ``jds.ops.sparse_mqa.paged_sparse_mqa_xla``) as reference.

For every query token t, one float32 softmax over the candidates of all its lists (global cache slots,
-1 = masked), all heads at once (the KV row is shared by every head):

    l[h, s] = scale * q[t, h] . K[s]
    o[t, h] = sum_s e^{l[h,s]-m} K[s, :v_dim] / (sum_s e^{l[h,s]-m} + e^{sink[h]-m})

V3.2 (absorbed MLA): one list over the 656-byte ``MlaRecord656`` cache, K = [latent 512; rope 64], V = the
latent. V4: two lists, window and compressed candidates, each over its own 584-byte ``MlaRecord584`` cache
(``caches``/``formats``/``slots`` are sequences; the lists are concatenated into one softmax, window first),
K = V = 512, plus the per-head attention sink. The bf16 ``FloatRows`` caches of both models work too.
Rows with no valid candidate (and no sink) give zeros; with a sink and nothing valid the output is zero as well.
Returns [T, H, v_dim] (float32 unless ``out_dtype``). Decode (one token per request) and prefill (every
token its own lists) are the same call: the kernel never looks at requests, only at each token's slot lists.

Kernel (``plgpu.kernel``, Lane lowering semantics, two compute warpgroups per CTA):
- CTA = (token, tile of 64 heads, candidate split). Heads are padded to a multiple of 64 (wgmma needs
  M >= 64; padded heads get q = 0 and sink -inf, and are sliced away). Blocks of 64 candidates stream
  through SMEM. Each list's blocks past its last valid slot are skipped (``_extents``, computed by every warp
  of the CTA from the slot rows with the register producer, else before the kernel; the kernel maps its k-th
  block to a list's block by scalar arithmetic), so prefill tokens early
  in the sequence, short contexts and masked rows cost only their live blocks. ``num_splits`` cuts each
  token's sequence of live blocks into CTAs (small decode batches need them to fill the GPU). Two splits of the
  register producer run as a 2-CTA cluster that merges through distributed shared memory (``merge``); other
  split counts write their normalised rows (fp32 unless ``split_dtype``) with their (m, l), merged with the sink
  by one more kernel (``pallas_kernels.split_combine``; with one split the CTA writes the final rows itself).
  Merging through global memory instead, by each head tile's last split to finish, measured slower at V4
  decode batch 64 and was removed (docs/perf-log.md).
- Row gather: Hopper has no gather TMA, so every candidate row is one (V3.2, bf16 rows) or two (V4: data,
  UE8M0 exponents) contiguous bulk TMA copies ``cache[page, start:start+n] -> staging[row]`` with the page
  and byte offset computed from the slot by scalar code. Each warp issues 8 of the block's 64 rows under
  warp-level semantics (``plgpu.warp_map``): the scalar code runs once per row, not in all four warps of a
  warpgroup. Its 32 lanes arrive on the barrier for the warpgroup with n/128 bytes each, so n must divide
  by 128: the copies over-fetch
  (V3.2: 768 bytes from 112 bytes before the record, or from the page start for the first entry; V4:
  640 bytes of token data, 128 bytes of the scale region ending at the entry's 16-byte group) and the
  destination offset inside the staging row is chosen so that the record always lands at the same column.
- Dequantisation in registers: Mosaic GPU bitcasts only between equal widths and SMEM only through
  ``RefUnion``, and XLA materialises a different-width bitcast of the whole cache, so the fp32 scales (V3.2)
  are rebuilt from their bytes: scale = bitcast(sum_j byte_j << 8j) via a masked row reduction; a UE8M0
  exponent e gives bitcast(e << 23). The bf16 rope values are read through a bf16 view of the staging rows
  (a ``RefUnion`` member aliasing the byte rows). GPU interpret mode does not alias ``RefUnion`` members, so
  there they are rebuilt as bitcast(((hi << 8) | lo) << 16), where (lo + 256 hi) comes exactly out of a
  small wgmma of the byte values (0..255, exact in bf16) against a 0/1/256 selection matrix (pairs of
  adjacent bytes cannot be combined elementwise in the WGMMA register layout).
  The e4m3 latent/NoPE bytes are bitcast to float8_e4m3fn, converted, scaled per 128 (V3.2) / 64 (V4)
  columns and stored as bf16 into the swizzled K tile [64, 576|512].
- Per block: warpgroup w computes S_w = wgmma(Q [64, Dk] SMEM, K tile[32w:32w+32]^T) in fp32 for its half
  of the candidates; the two exchange their row maxima through SMEM, run the masked online
  softmax in base 2 with the common maximum, and each writes its half of P (bf16) into SMEM; then
  PV = wgmma(P [64, 64], K tile[:, wg half]) into each warpgroup's [64, v_dim/2] fp32 accumulator (a
  [64, 512] fp32 accumulator would need all 256 KB of registers, so each warpgroup owns half of the value
  columns; the two also dequantise half of the K tile each). Each warpgroup's running sum covers its own
  candidates; the two sums are added at the end (same maxima, so the same scale). The tiles are swizzled
  over 64 bytes (32 columns), so that a half of P is whole tiles. The next block's rows are copied while the
  current block is multiplied; their copies are issued while the tensor cores run QK. QK split over the head
  dim instead (each warpgroup all 64 candidates, the fp32 partial scores exchanged) measured slower with the
  register producer and level with TMA's, and was removed (docs/perf-log.md, forty-second session).
  ``scores="one"`` (the default since 2026-12-07, faster at every case timed on an H100; "split" stays a switch)
  divides it unevenly instead: warpgroup 0 alone scores all 64 candidates and runs the softmax, then publishes P
  with each row's rescale factor and maximum; warpgroup 1 rescales its accumulator and runs its PV, and frees P's
  buffer for the next block.
- wgmma descriptors: the q and K tiles are [1, rows, dk] buffers indexed by a zero the compiler cannot fold
  (block id >> 20), so the operands' shared-memory descriptors are rebuilt in each block from uniform
  registers. Computed once before the loop, the compiler held all of them across it and spilled them to
  local memory (docs/perf-log.md, twelfth session: that variant, both warpgroups computing the whole S, and
  each feeding its P from registers all lost at every measured shape, so they were removed).
- Numerics: q and K enter the tensor cores as bf16 (the pure-JAX path multiplies in fp32; K is
  bf16-exact for bf16 rows and power-of-two fp8 scales, rounded to bf16 with vLLM's amax scales), P is
  rounded to bf16 for PV, softmax statistics stay fp32 (exp2.approx). A masked candidate reads slot 0 (as
  the pure-JAX path does) and gets p = 0, so a non-finite value stored there would poison the row in both.
- GPU interpret mode lacks ``run_state``: under interpret the PV product goes through a fresh accumulator
  and is added (same sum); compiled, it accumulates in place (a second [64, 256] fp32 accumulator would not
  fit in the registers). With the rope's byte path above, that is all that differs between the modes.

Why Mosaic GPU and not Triton: the per-row bulk TMA expresses the gather on sm90; the Triton backend is
deprecated since jax 0.11. P goes through SMEM (one [64, 64] bf16 tile per block, each warpgroup writing
its half): PV needs both halves in each warpgroup. Warpgroup lowering
semantics was tried first: its layout inference assigns tiled/swizzled layouts to the staging buffers that
the row copies must fill linearly (and crashes on the row subviews), so the kernel uses Lane semantics
with explicit register layouts and no automatic barriers (``unsafe_no_auto_barriers``; the mbarrier
protocol below orders every SMEM reuse).

Synchronisation per block k (both warpgroups; mbarriers; as ``scores="split"`` runs it: "one" replaces the maxima
exchange and P's halves with P published by warpgroup 0 and freed by warpgroup 1). Before the loop each warpgroup
fills its half of the K tile with block 0. Then per block: a proxy fence (the slots' generic reads before
warpgroup 0's next async copy into their idx slot), arrive/wait "ready" (K complete, its staging rows and slots
read by both); issue QK; warpgroup w issues the row copies of block k+1 for its 32 rows and warpgroup 0 the slot
copy of block k+2; wait QK; write the row maxima, arrive/wait "stats", read the other's; softmax; write P's half,
fence, arrive/wait "P"; PV; then wait rows(k+1) landed and fill its half of the K tile with block k+1 (fence). A
warpgroup overwrites only the columns its own, finished PV(k) read; the other's QK(k) finished before "P" and the
other's PV(k) reads only its own columns, so no "K free" barrier is needed (it measured the same as converting
block k+1 while PV(k) runs, which was removed). After the loop, the running sums go through "stats" once more.
Block k+1's maxima are written only after both warpgroups passed its "ready", so one buffer serves every block.
Every barrier phase is waited once per waiter (GPU interpret mode checks this; its race detector passes at the
test shapes, ``test_no_races``).

The register producer (``producer="registers"``, natively the default for the fp8 records, V3.2's one
``MlaRecord656`` list and V4's one or two ``MlaRecord584`` lists): a third warpgroup gathers and dequantises
each block with per-thread loads, coalesced so that a warp's load reads whole lines of two or four records,
into one of two K tiles (``pallas_kernels.record_gather``, after FlashMLA's sm90 sparse decode
design), so no staging rows and no conversion in the compute warpgroups; they wait "full"[k % 2], compute,
and arrive "free"[k % 2] after PV. The producer is one software-pipelined loop over raw mbarriers: it carries
the next block's slot (its load sits in no block's chain; block ids are arithmetic) and prefetches the
next block's records into L2 (decode reads its records from DRAM, and the per-thread loads alone keep too few
bytes in flight to hide that latency). Registers: setmaxnreg moves them only inside the 384-thread CTA's
launch pool (3 x 168 per thread), so producer + 2 x compute <= 504; an "increase" past it never returns (the
first native run hung on it). SMEM: q 72 KB + two K tiles 144 KB. Removed after measuring slower
(docs/perf-log.md): a per-block producer, loops that loaded half a record row per thread (both formats), and a
2-CTA cluster producer that gathered each block once for both head tiles of a token.

Shared memory (of 227 KB): q 72 KB + K tile 72 KB + staging 55 KB + P 8 KB + statistics 1 KB (V3.2 fp8,
compiled, 208 KB; interpret mode adds the rope byte tile and the selection matrix, unaliased); bf16 rows with
dim 576 leave under 2 KB, so they get no bank-skew padding. One CTA per SM.

Requirements (``supports``): MlaRecord656 with the standard 512 + 64 dims and >= 2 entries per page;
MlaRecord584 with 448 + 64 dims, 64-wide scale blocks and an even number of entries per page (16-byte
aligned pages); FloatRows in bfloat16 with dim % 64 == 0 and dim <= 576; all lists in one format kind and
width; v_dim a multiple of 128 and <= dim. Caches up to 2^31 pages; offsets inside a page are int32.
``interpret=None`` runs GPU interpret mode off-GPU (the same kernel on the CPU, slow: tests only).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Literal, Sequence

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jds.ops.dispatch import (Implementation, Unsupported, check_array, check_implementation, check_int,
                              mosaic_interpret, run_op)
from jds.ops.paging import RecordFormat, check_cache
from jds.ops.records import FloatRows, MlaRecord584, MlaRecord656
from jds.ops.sparse_mqa import paged_sparse_mqa_xla
from pallas_kernels import fused_insert_common as C
from pallas_kernels import record_gather
from pallas_kernels.fp8_gemm import generic_reads_fence
from pallas_kernels.split_combine import split_combine

Producer = Literal["tma", "registers"]
OutStore = Literal["direct", "tma"]
Merge = Literal["rows", "cluster"]
Scores = Literal["split", "one"]


PROFILE_RANGES = 64  # per warpgroup and call: ``profile_dir``'s regions (4 per block, 2 more per warpgroup)
HEAD_TILE = 64  # wgmma M
BLOCK_K = 64  # candidates per block (the dequantised [64, 64] chunks use the WGMMA register layout)
NUM_WG = 2  # compute warpgroups per CTA, each owns v_dim / 2 output columns
ROWS_PER_WARP = BLOCK_K // NUM_WG // 4  # row copies each warp issues per block
NUM_SMS = 132  # H100/H200; only steers the automatic num_splits
MIN_BLOCKS_PER_SPLIT = 2
LOG2E = 1.4426950408889634
# producer="registers": the producer warpgroup's registers per thread (the rest: compute), its rounds of loads
# (96 words per lane and block in all) and whether each round is loaded while the previous one is converted
# (``producer_overlap``): V3.2's records two overlapped rounds in 152 registers, V4's one round in 136 (timings:
# the ``producer_overlap`` docstring).
PRODUCER_REGS = {"mla656": 152, "mla584": 136}
PRODUCER_PHASES = {"mla656": 2, "mla584": 1}
PRODUCER_OVERLAP = {"mla656": True, "mla584": False}
# scores="one": warpgroup 0's registers per thread above the even split (its [64, 64] fp32 scores and bf16 P beside
# the [64, 256] accumulator), taken from warpgroup 1 (the accumulator and one row vector)
SCORES_ONE_REGS = 16


def compute_regs(producer_regs: int) -> int:
    """The compute warpgroups' registers per thread beside one producer warpgroup keeping ``producer_regs``.
    A CTA of n warpgroups is launched with 65536 / (128 n) registers per thread (rounded down to 8), and
    setmaxnreg only moves registers inside that pool (an "increase" past it never returns): 3 warpgroups
    share 3 x 168 = 504 per thread. (Two producer warpgroups, 4 in all, were tried: the launch limit of 128
    registers per thread is below what ptxas needs for the [64, 256] wgmma, so that kernel does not build.)"""
    return (launch_regs() * (NUM_WG + 1) - producer_regs) // NUM_WG // 8 * 8


def launch_regs() -> int:
    """Registers per thread at launch of a CTA of the compute warpgroups and one producer warpgroup."""
    return 65536 // (128 * (NUM_WG + 1)) // 8 * 8


M_INIT = -1e30  # finite running-max start: exp2(m_old - m_new) never sees -inf - -inf


# ----------------------------------------------------------------------------------------------------
# formats
@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What the kernel needs to know about one cache: record kind, entries per page, K width."""

    kind: Literal["mla656", "mla584", "rows"]
    entries_per_page: int
    dim: int
    page_elems: int
    pow2_scales: bool = False  # the records' fp32 scales are powers of two (MlaRecord656 "ue8m0")


def cache_spec(fmt: RecordFormat) -> CacheSpec | None:
    """The kernel's view of ``fmt``; None when the kernel cannot read it."""
    if isinstance(fmt, MlaRecord656):
        if fmt.latent_dim == 512 and fmt.rope_dim == 64 and fmt.entries_per_page >= 2:
            return CacheSpec("mla656", fmt.entries_per_page, 576, fmt.page_elems, fmt.scale_fmt == "ue8m0")
    elif isinstance(fmt, MlaRecord584):
        if (fmt.nope_dim == 448 and fmt.rope_dim == 64 and fmt.block == 64 and fmt.entries_per_page >= 2
                and fmt.entries_per_page % 2 == 0):
            return CacheSpec("mla584", fmt.entries_per_page, 512, fmt.page_elems)
    elif isinstance(fmt, FloatRows):
        if jnp.dtype(fmt.dtype) == jnp.bfloat16 and fmt.dim % 64 == 0 and 128 <= fmt.dim <= 576:
            return CacheSpec("rows", fmt.entries_per_page, fmt.dim, fmt.page_elems)
    return None


def supports(formats: Sequence[RecordFormat], v_dim: int) -> bool:
    """True when the Pallas kernel handles these cache formats (one per candidate list) and v_dim."""
    specs = [cache_spec(f) for f in formats]
    if not specs or any(s is None for s in specs):
        return False
    kinds = {(s.kind, s.dim) for s in specs}
    dim = specs[0].dim
    return len(kinds) == 1 and v_dim % (64 * NUM_WG) == 0 and v_dim <= dim


# staging-row geometry (bytes for fp8 records, elements for bf16 rows)
_M656_W, _M656_REC, _M656_COPY, _M656_BACK = 880, 112, 768, 112  # record at column 112 of an 880-byte row
_M584_W, _M584_REC, _M584_COPY, _M584_BACK = 880, 64, 640, 64  # data at column 64; scale window at 704
_M584_SC, _M584_SC_COPY = 704, 128


def _copies_per_row(kind: str) -> int:
    return 2 if kind == "mla584" else 1


# ----------------------------------------------------------------------------------------------------
# public entry point
def sparse_mqa(q: jax.Array, caches: Sequence[jax.Array], formats: Sequence[RecordFormat],
               slots: Sequence[jax.Array], *, scale: float, v_dim: int, sink: jax.Array | None = None,
               implementation: Implementation = "pallas", num_splits: int | None = None,
               out_dtype: jnp.dtype = jnp.float32,
               interpret: bool | plgpu.InterpretGPUParams | None = None, producer: Producer | None = None,
               producer_regs: int | None = None, producer_phases: int | None = None,
               producer_pow2: bool | None = None, producer_overlap: bool | None = None,
               profile_dir: str | None = None,
               combine: Implementation = "auto", split_dtype: jnp.dtype | None = None,
               out_store: OutStore | None = None, extents: Literal["xla", "pallas", "kernel"] | None = None,
               merge: Merge | None = None, q_multicast: bool | None = None,
               k_prescale: bool | None = None, producer_prefetch: int | None = None,
               scores: Scores | None = None, q_rope: jax.Array | None = None) -> jax.Array:
    """Sparse MQA of q [T, H, Dk] over candidate lists ``slots[i]`` [T, K_i] (global slots of cache
    ``caches[i]`` in ``formats[i]``, -1 = masked), one softmax over all lists; [T, H, v_dim] in
    ``out_dtype`` (the fp32 result rounded once; the kernel stores it directly in that dtype; with candidate
    splits, the merge of the splits' rows rounds it).
    ``split_dtype``: the splits' rows (None: float32). A 16-bit dtype halves the bytes they take, but on the
    H200 its stores cost the MQA kernel more than the merge saves (docs/perf-log.md).
    ``extents``: the lists' live blocks (``_extents``) as one XLA reduction per list, or one Triton kernel for
    all lists ("pallas"), or inside the MQA kernel itself, from the slot rows each CTA reads anyway ("kernel":
    the native register producer only; no kernel runs before the MQA). None: "kernel" with the native register
    producer (faster than both others at V3.2 / V4 decode 64 and 4K prefill,
    benchmarks/results/archive/mqa_variants_defaults_fiftieth_h100_2026-12-06.json), else "pallas" for
    several lists (faster at both V4 decode cases timed,
    benchmarks/results/archive/mqa_variants_wrapper_h200_2026-12-05.json), "xla" for one.
    ``out_store`` (rows stored in bf16 only): "direct", each thread stores its registers to GMEM (a quad of
    threads covers 16 bytes of a row: half a 32-byte sector per store); "tma", each warpgroup writes its rows
    into the q tile (free once both warpgroups' last QK is done) and one TMA store copies them out in whole
    lines. None: "tma" where the kernel stores bf16 rows (one split, bf16 out: it removed the bf16 rows' cost
    at V3.2 decode 64 and V4 prefill 4096 in the same run), else "direct".

    ``q_rope`` [T, H, R]: the query's last R columns apart, q then being its first Dk - R (V3.2's absorbed
    latent and its roped part come from different ops): the kernel copies each into its columns of its q tile,
    so no concatenated q is written and read again; XLA concatenates them. A column range of the tiled q tile
    is contiguous only within an 8-row group: each part takes a copy per group (no multicast to the cluster's
    pair). Each part in a tile of its own (one copy and one wgmma each) measured no faster natively and was
    removed (docs/perf-log.md, sixty-seventh session).

    ``implementation="xla"``: gather + dequantise with ``read_records`` and the pure-JAX softmax
    (``jds.ops.sparse_mqa.paged_sparse_mqa_xla``); ``"auto"``: the kernel where ``supports``, else XLA.
    ``num_splits``: candidate splits per (token, head tile); None picks enough CTAs for the GPU.
    ``interpret``: GPU interpret mode (True or an ``InterpretGPUParams``, e.g. with ``detect_races``);
    None = whenever the default backend is not a GPU.
    ``producer``: who fills the K tile. "tma": the two compute warpgroups, from rows staged by per-row bulk
    copies (the module docstring). "registers" (one ``MlaRecord656`` list, or natively one or two
    ``MlaRecord584`` lists): a third warpgroup gathers and dequantises each block into one of two K tiles with
    coalesced per-thread global loads, one software-pipelined loop that also prefetches the next block's
    records into L2 (``pallas_kernels.record_gather.produce_tile``; GPU interpret mode emulates V3.2's with the
    staged copies), so the next block is filled while the compute warpgroups multiply the current one. It keeps
    ``producer_regs`` (None: ``PRODUCER_REGS`` of the format) registers per thread and gives the rest to the
    compute warpgroups, and loads a block in ``producer_phases`` rounds (1, 2 or 4; None: ``PRODUCER_PHASES``).
    None: "registers" natively for fp8 records, else "tma" (interpret mode: "tma", whose emulation blocks no
    third thread; the register producer's needs one CPU per warpgroup).
    ``producer_overlap`` (native register producer): each round's loads issued before the previous round is
    converted (``record_gather.produce_tile``'s ``overlap``; with ``producer_phases`` 2 or 4). None:
    ``PRODUCER_OVERLAP`` of the format. V3.2's records: on, in two rounds with 152 registers (``PRODUCER_PHASES``,
    ``PRODUCER_REGS``), faster at every V3.2 case timed (decode 64 / 128, ue8m0 scales, 4K prefill:
    benchmarks/results/archive/mqa_variants_defaults_fiftieth_h100_2026-12-06.json); V4's: off (slower at
    V4 decode 64 with 136 or 152 registers, benchmarks/results/archive/mqa_variants_overlap_h100_2026-12-06.json).
    ``producer_pow2``: the register producers' dequantisation without conversion instructions, exact only for
    power-of-two scales (``record_gather._DQ_POW2_ASM``); None = where the records' scales are ("ue8m0").
    ``combine``: the implementation of the splits' merge (``pallas_kernels.split_combine``; "auto": its
    kernel where the row width is a power of 2).
    ``merge`` (two candidate splits): "rows", each split writes its normalised rows and (m, l) and
    ``split_combine`` merges them; "cluster" (native, register producer), the two splits of a (token, head
    tile) run as a 2-CTA cluster and merge in the kernel: each CTA keeps half of the value columns, receives
    the peer's unnormalised accumulator of that half and its (m, l) into its K tiles (free once both loops are
    done) by ``st.async`` through distributed shared memory, and writes the final rows, so the split rows never
    reach GMEM and no merge kernel runs. None: "cluster" where it applies (faster at V4 decode batch 64,
    benchmarks/results/archive/mqa_variants_cluster_h100_2026-12-05.json), else "rows".
    ``q_multicast`` (``merge="cluster"`` only): the pair's common q tile loaded once, each CTA fetching half
    of it by a TMA multicast into both, instead of each CTA loading all of it. None: with the cluster merge
    (faster at V4 decode 64 in two runs:
    benchmarks/results/archive/mqa_variants_defaults_fiftieth_h100_2026-12-06.json,
    archive/mqa_variants_pending_h100_2026-12-06.json).
    ``profile_dir`` (diagnostic, native): Mosaic GPU's profiler records the kernel's named regions per
    warpgroup (prologue, the block loop's wait_full / qk / softmax / pv, epilogue; produce) and writes a
    Perfetto trace under this folder per call (``scripts/diag/mqa_regions.py``). Its buffer takes shared
    memory, which V3.2's fp8 kernel has no room for.
    ``k_prescale`` (the native register producer's power-of-two dequantisation: V4's records, V3.2's with ue8m0
    scales): the producer writes the keys times 2^-60 (``record_gather.K_SHIFT``), one bf16 product per word
    instead of two, and the kernel multiplies its scores and rows by 2^60 (exact: powers of two, no value
    leaves the normal range for the cache writer's scales). None: on where it applies (faster at V4 decode and
    prefill and V3.2 ue8m0 decode: benchmarks/results/archive/mqa_k_prescale_ab_h100_2026-12-06.json).
    ``producer_prefetch`` (native register producer): how many blocks ahead the producer prefetches records into
    L2 while it loads block k, 1 or 2 (``record_gather.produce_tile``'s ``prefetch_ahead``). None: 1 (2 was
    level at V3.2 in the eighteenth session; on an H100 it was slightly faster at V4 4K prefill and slower at V4
    and V3.2 ue8m0 decode 64: benchmarks/results/archive/mqa_variants_pf2_h100_2026-12-06.json).
    ``scores``: who computes a block's scores and softmax. "split": each compute warpgroup scores its half of the
    candidates (a [64, 32] wgmma that reads all of q) and the two exchange row maxima, then each publishes its
    half of P. "one": warpgroup 0 scores all 64 candidates (a [64, 64] wgmma: q read once a block, the shape
    whose shared-memory reads match the tensor cores' rate), runs the softmax alone and publishes P with each
    row's rescale factor and maximum; warpgroup 1 only rescales and multiplies its value columns, and gives
    P's buffer back once its PV is done. No maxima exchange and half the q reads, for an uneven split of the
    work (FlashMLA's SM90 sparse decode kernel divides it this way). Warpgroup 0 then holds the [64, 64]
    scores beside its accumulator: natively it takes ``SCORES_ONE_REGS`` registers per thread more than the
    even split, warpgroup 1 that many fewer. None: "one" (faster than "split" at V3.2 and V4 decode 64 and 4K
    prefill on an H100, not yet timed on the H200; the timings: docs/perf-log.md, sixty-first session).
    """
    check_implementation(combine, "combine")
    caches, formats, slots = tuple(caches), tuple(formats), tuple(slots)
    v_dim = _check_inputs(q, caches, formats, slots, v_dim, sink, q_rope)
    return run_op("sparse_mqa", implementation, {
        "xla": lambda: _xla(q if q_rope is None else jnp.concatenate([q, q_rope.astype(q.dtype)], axis=-1),
                            caches, formats, slots, scale=scale, v_dim=v_dim, sink=sink, out_dtype=out_dtype),
        "pallas": lambda: _pallas(q if q_rope is None else (q, q_rope), caches, formats, slots, scale=scale,
                                  v_dim=v_dim, sink=sink, num_splits=num_splits, out_dtype=out_dtype,
                                  interpret=interpret,
                                  producer=producer, producer_regs=producer_regs,
                                  producer_phases=producer_phases, producer_pow2=producer_pow2,
                                  producer_overlap=producer_overlap,
                                  profile_dir=profile_dir, combine=combine, split_dtype=split_dtype,
                                  out_store=out_store, extents=extents, merge=merge, q_multicast=q_multicast,
                                  k_prescale=k_prescale, producer_prefetch=producer_prefetch,
                                  scores=scores)})


def _check_inputs(q, caches, formats, slots, v_dim, sink, q_rope=None) -> int:
    """Input errors of every implementation (ValueError naming the argument; static shapes and dtypes only).
    Returns ``v_dim`` as an int."""
    if not (len(caches) == len(formats) == len(slots) >= 1):
        raise ValueError(f"caches, formats and slots must be sequences of the same non-zero length, got "
                         f"{len(caches)}, {len(formats)} and {len(slots)}")
    check_array("q", q, (("T", None), ("H", None), ("Dk", None)), "float")
    t, h, dk = q.shape
    if q_rope is not None:
        check_array("q_rope", q_rope, (("T", t), ("H", h), ("R", None)), "float")
        dk += q_rope.shape[2]
    widths = []
    for i, (c, f, s) in enumerate(zip(caches, formats, slots)):
        widths.append(check_cache(f"caches[{i}]", c, f, f"formats[{i}]"))
        check_array(f"slots[{i}]", s, (("T", t), (f"K_{i}", None)), "int")
    if any(w != dk for w in widths):
        raise ValueError(f"q head dim Dk = {dk} must equal the row width of every format (q_rope's columns "
                         f"included), got widths {widths} for formats {list(formats)}")
    v_dim = check_int("v_dim", v_dim, 1, dk)
    if sink is not None:
        check_array("sink", sink, (("H", h),), "float")
    return v_dim


def _xla(q, caches, formats, slots, *, scale, v_dim, sink, out_dtype):
    if sum(s.shape[1] for s in slots) == 0:  # no candidate at all: every row has no mass (zeros, as the kernel)
        return jnp.zeros((q.shape[0], q.shape[1], v_dim), out_dtype)
    return paged_sparse_mqa_xla(q, caches, formats, slots, scale=scale, v_dim=v_dim, sink=sink).astype(out_dtype)


def _pallas(q: jax.Array | tuple[jax.Array, ...], caches, formats, slots, *, scale, v_dim, sink, num_splits,
            out_dtype, interpret, producer=None, producer_regs=None, producer_phases=None, producer_pow2=None,
            producer_overlap=None, profile_dir=None,
            combine="auto", split_dtype=None, out_store=None, extents=None, merge=None, q_multicast=None,
            k_prescale=None, producer_prefetch=None, scores=None):
    if producer not in (None, "tma", "registers"):
        raise ValueError(f'producer must be "tma" or "registers", got {producer!r}')
    if split_dtype is not None and jnp.dtype(split_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                                                  jnp.dtype(jnp.float16)):
        raise ValueError(f"split_dtype must be float32, bfloat16 or float16, got {split_dtype}")
    if producer_phases not in (None, 1, 2, 4):
        raise ValueError(f"producer_phases must be 1, 2 or 4, got {producer_phases}")
    if producer_overlap not in (None, True, False):
        raise ValueError(f"producer_overlap must be a bool or None, got {producer_overlap!r}")
    if num_splits is not None:
        check_int("num_splits", num_splits, 1)
    if producer_regs is not None and not (isinstance(producer_regs, int) and 24 <= producer_regs <= 256
                                          and producer_regs % 8 == 0 and compute_regs(producer_regs) >= 24):
        raise ValueError(f"producer_regs must be a multiple of 8 in [24, 256] (got {producer_regs!r})")
    if not supports(formats, v_dim):
        raise Unsupported(f"sparse_mqa kernel: unsupported formats {formats} / v_dim {v_dim} "
                          "(see pallas_kernels.sparse_mqa.supports)")
    specs = tuple(cache_spec(f) for f in formats)
    one_656 = len(specs) == 1 and specs[0].kind == "mla656"
    v4_lists = len(specs) <= 2 and all(sp.kind == "mla584" for sp in specs)
    if producer == "registers" and not (one_656 or v4_lists):
        raise ValueError(f'producer="registers" reads one MlaRecord656 cache or one or two MlaRecord584 caches '
                         f'(got {formats})')
    if producer_pow2 and not (one_656 and specs[0].pow2_scales):
        raise ValueError("producer_pow2=True needs MlaRecord656 records with power-of-two (ue8m0) scales, "
                         f"got {formats}")
    qs = q if isinstance(q, tuple) else (q,)  # q's row in column parts (``q_rope``)
    q_parts = tuple(x.shape[-1] for x in qs)
    t, h, dk = qs[0].shape[0], qs[0].shape[1], sum(q_parts)
    if dk != specs[0].dim:
        raise ValueError(f"q head dim {dk} does not match the cache rows ({specs[0].dim})")
    if len(qs) > 1 and any(w % (BLOCK_K // NUM_WG) for w in q_parts):
        raise Unsupported(f"sparse_mqa kernel: q parts {q_parts} (each a multiple of {BLOCK_K // NUM_WG} columns: "
                          "whole tiles)")
    for c, f in zip(caches, formats):
        if c.ndim != 2 or c.shape[1] != f.page_elems:
            raise ValueError(f"cache of shape {c.shape} is not [num_blocks, {f.page_elems}]")
    if t == 0:
        return jnp.zeros((0, h, v_dim), out_dtype)
    interpret = mosaic_interpret(interpret)
    if profile_dir is not None and interpret:
        raise ValueError("profile_dir: Mosaic GPU's profiler runs natively only (interpret mode has no trace)")
    if producer == "registers" and interpret and not one_656:
        raise ValueError('producer="registers" over MlaRecord584 caches is native only (GPU interpret mode '
                         "emulates V3.2's register producer alone)")
    if producer is None:
        producer = "registers" if (one_656 or v4_lists) and not interpret else "tma"
    native_reg = producer == "registers" and not interpret  # what the cluster, in-kernel extents and overlap need
    if producer_phases is None:
        producer_phases = PRODUCER_PHASES[specs[0].kind] if producer == "registers" else 1
    if producer_overlap is None:
        producer_overlap = PRODUCER_OVERLAP[specs[0].kind] if native_reg else False
    if producer_overlap and not native_reg:
        raise ValueError(f"producer_overlap=True overlaps the native register producer's loads (got producer "
                         f"{producer!r}, interpret {bool(interpret)})")
    pow2 = specs[0].pow2_scales if producer_pow2 is None else producer_pow2
    if k_prescale not in (None, True, False):
        raise ValueError(f"k_prescale must be a bool or None, got {k_prescale!r}")
    kpre_applies = native_reg and (v4_lists or pow2)
    if k_prescale is None:  # on where it applies (faster: docstring)
        k_prescale = kpre_applies
    if k_prescale and not kpre_applies:
        raise ValueError(f"k_prescale=True scales the keys in the native register producer's power-of-two "
                         f"dequantisation (V4's records, or V3.2's with ue8m0 scales; got {formats}, producer "
                         f"{producer!r}, interpret {bool(interpret)})")
    if scores not in (None, "split", "one"):
        raise ValueError(f'scores must be "split" or "one", got {scores!r}')
    if producer_prefetch not in (None, 1, 2) or isinstance(producer_prefetch, bool):
        raise ValueError(f"producer_prefetch must be 1, 2 or None, got {producer_prefetch!r}")
    if producer_prefetch == 2 and not native_reg:
        raise ValueError(f"producer_prefetch=2 is the native register producer's prefetch distance (got producer "
                         f"{producer!r}, interpret {bool(interpret)})")
    if producer_regs is None:  # (no producer warpgroup with "tma": 0, unused)
        producer_regs = PRODUCER_REGS[specs[0].kind] if producer == "registers" else 0
    hp = -(-h // HEAD_TILE) * HEAD_TILE
    qps = [jnp.pad(x.astype(jnp.bfloat16), ((0, 0), (0, hp - h), (0, 0))) for x in qs]
    padded, list_blocks = [], []
    for s in slots:
        k = s.shape[1]
        kp = max(BLOCK_K, -(-k // BLOCK_K) * BLOCK_K)
        padded.append(jnp.pad(s.astype(jnp.int32), ((0, 0), (0, kp - k)), constant_values=-1))
        list_blocks.append(kp // BLOCK_K)
    nb = sum(list_blocks)
    g = hp // HEAD_TILE
    if num_splits is None:
        num_splits = max(1, min(NUM_SMS // max(1, t * g), nb // MIN_BLOCKS_PER_SPLIT))
    bps = -(-nb // max(1, min(num_splits, nb)))
    n_splits = -(-nb // bps)
    if merge is None:
        merge = "cluster" if n_splits == 2 and native_reg else "rows"
    if merge not in ("rows", "cluster"):
        raise ValueError(f'merge must be "rows" or "cluster", got {merge!r}')
    cluster = merge == "cluster"
    if q_multicast is None:  # (q's parts copied into one tile by row groups: no multicast)
        q_multicast = cluster and len(qs) == 1
    if q_multicast and not cluster:
        raise ValueError(f'q_multicast=True shares the q tile within the pair of merge="cluster" (got merge '
                         f'{merge!r})')
    if q_multicast and len(qs) > 1:
        raise ValueError("q_multicast=True takes a whole q (with q_rope, q's parts are copied by 8-row groups)")
    if cluster and (n_splits != 2 or not native_reg):
        raise ValueError(f'merge="cluster" merges exactly two candidate splits of the native register producer '
                         f'(got {n_splits} splits, producer {producer!r}, interpret {bool(interpret)}); '
                         f'pass num_splits=2')
    split_dtype = jnp.dtype(jnp.float32 if split_dtype is None else split_dtype)
    stored = jnp.dtype(out_dtype) if n_splits == 1 or cluster else split_dtype
    if extents is None:  # in the kernel where it can (faster at V4 decode 64: docstring); else before it
        extents = "kernel" if native_reg else "pallas" if len(slots) > 1 else "xla"
    out_store = ("tma" if stored == jnp.dtype(jnp.bfloat16) else "direct") if out_store is None else out_store
    if extents not in ("xla", "pallas", "kernel"):
        raise ValueError(f'extents must be "xla", "pallas" or "kernel", got {extents!r}')
    if extents == "kernel" and not native_reg:
        raise ValueError(f'extents="kernel" computes the extents in the native register producer\'s kernel (got '
                         f'producer {producer!r}, interpret {bool(interpret)})')
    if out_store not in ("direct", "tma"):
        raise ValueError(f'out_store must be "direct" or "tma", got {out_store!r}')
    if out_store == "tma" and stored != jnp.dtype(jnp.bfloat16):
        raise ValueError(f'out_store="tma" stores bfloat16 rows (through the q tile); these rows are {stored}')
    has_sink = sink is not None
    sink_p = (jnp.pad(sink.astype(jnp.float32), (0, hp - h), constant_values=-jnp.inf) if has_sink
              else jnp.zeros((hp,), jnp.float32))
    call = _build_call(specs=specs, list_blocks=tuple(list_blocks), t=t, hp=hp, dv=v_dim, scale=float(scale),
                       has_sink=has_sink, n_splits=n_splits, bps=bps, out_dtype=jnp.dtype(out_dtype),
                       split_dtype=split_dtype, out_store=out_store,
                       interpret=interpret or None, producer=producer, producer_regs=producer_regs,
                       producer_phases=producer_phases, producer_overlap=bool(producer_overlap),
                       pow2=pow2, profile_dir=profile_dir, cluster=cluster, kernel_extents=extents == "kernel",
                       q_multicast=bool(q_multicast), k_shift=bool(k_prescale),
                       prefetch_ahead=producer_prefetch or 1, scores_one=scores in (None, "one"),
                       q_parts=q_parts if len(qs) > 1 else None)
    # the lists' slots apart: no concatenated copy
    exts = [] if extents == "kernel" else _extents(padded, extents, bool(interpret))
    outs = call(*qps, *padded, *exts, sink_p, *caches)
    if n_splits == 1 or cluster:
        return outs[:, :h]
    o, m, l = outs
    return split_combine(o, m, l, sink.astype(jnp.float32) if has_sink else None, heads=h, out_dtype=out_dtype,
                         implementation=combine, interpret=bool(interpret))


def _extents(padded: Sequence[jax.Array], implementation: str = "xla",
             interpret: bool = False) -> list[jax.Array]:
    """Per list, each token's blocks to compute: up to its last block with a valid slot ([T] int32). Top-k lists
    end in -1, so this skips what matters (prefill tokens early in the sequence, short contexts, fully masked
    rows) without a sort; the kernel walks list 0's first extent blocks, then list 1's, ... (``block_of``). A
    dead block inside a list's extent is computed, its weights 0.

    "xla": one reduction per list (XLA makes each its own kernel; stacking the lists first added a concatenate
    kernel). "pallas" (several lists): one Triton kernel for all of them (``_extents_kernel``)."""
    if implementation == "pallas" and len(padded) > 1:
        return _extents_pallas(padded, interpret)
    out = []
    for s in padded:
        j = lax.broadcasted_iota(jnp.int32, s.shape, 1)
        out.append(jnp.max(jnp.where(s >= 0, j // BLOCK_K + 1, 0), axis=1).astype(jnp.int32))
    return out


EXTENTS_TILE = 4096  # slots per program of ``_extents_kernel``


def _extents_kernel(*refs, T: int, TB: int, widths: tuple[int, ...]):
    """``TB`` tokens' rows of every list (padded to a power of 2 wide, masked), each list's extent stored. The
    Triton lowering, not Mosaic GPU: a row reduction over [TB, K] int32 tiles of a few rows, with masked
    loads past a list's width, which Triton expresses directly (and lowers on a CPU-only machine)."""
    n = len(widths)
    slots, outs = refs[:n], refs[n:]
    tok = pl.program_id(0) * TB + C.iota((TB, 1), 0)
    ok = tok < T
    tc = jnp.minimum(tok, T - 1)
    for s_ref, o_ref, k in zip(slots, outs, widths):
        col = C.iota((1, C.next_pow2(k)), 1)
        s = C.load(s_ref, (tc, jnp.minimum(col, k - 1)), (TB, col.shape[1]), col < k, other=-1)
        ext = jnp.max(jnp.where(s >= 0, col // BLOCK_K + 1, 0), axis=1, keepdims=True)
        C.store(o_ref, (jnp.where(ok, tok, T),), ext, ok)


def _extents_pallas(padded: Sequence[jax.Array], interpret: bool) -> list[jax.Array]:
    t = padded[0].shape[0]
    widths = tuple(s.shape[1] for s in padded)
    tb = max(1, min(16, EXTENTS_TILE // sum(C.next_pow2(k) for k in widths)))
    tb = 1 << (tb.bit_length() - 1)  # a power of 2
    kernel = functools.partial(_extents_kernel, T=t, TB=tb, widths=widths)
    return list(C.pallas_call(kernel, out_shape=tuple(jax.ShapeDtypeStruct((t,), jnp.int32) for _ in padded),
                              grid=(pl.cdiv(t, tb),), aliases={}, interpret=interpret,
                              name="mqa_extents")(*padded))


def block_of(pos, exts: Sequence, list_blocks: Sequence[int]):
    """The block (in the concatenated lists) at position ``pos`` of a token's sequence of live blocks, whose
    lists have ``exts`` live blocks: list 0's first ``exts[0]``, then list 1's, ...; positions past the last
    live block give some block of the last list, so that reading its slots stays in bounds. Plain arithmetic
    on scalars or arrays (the kernel's consumers; the producer emits the same)."""
    blk, cum, start = pos, 0, 0
    for i in range(1, len(list_blocks)):
        cum, start = cum + exts[i - 1], start + list_blocks[i - 1]
        blk = jnp.where(pos >= cum, start + pos - cum, blk)
    return jnp.minimum(blk, sum(list_blocks) - 1)


# ----------------------------------------------------------------------------------------------------
# the kernel
@functools.lru_cache(maxsize=None)
def _build_call(*, specs: tuple[CacheSpec, ...], list_blocks: tuple[int, ...], t: int, hp: int, dv: int,
                scale: float, has_sink: bool, n_splits: int, bps: int, out_dtype: jnp.dtype,
                split_dtype: jnp.dtype, out_store: OutStore = "direct",
                interpret: plgpu.InterpretGPUParams | None, producer: Producer = "tma",
                producer_regs: int = 144, producer_phases: int = 1, producer_overlap: bool = False,
                pow2: bool = False, profile_dir: str | None = None, cluster: bool = False,
                kernel_extents: bool = False, q_multicast: bool = False, k_shift: bool = False,
                prefetch_ahead: int = 1, scores_one: bool = False, q_parts: tuple[int, ...] | None = None):
    """``producer="registers"``: warpgroup NUM_WG fills K tile k % 2 with block k and arrives on "full"[k % 2];
    the compute warpgroups wait on it, read the block's slots from its idx slot (written by the producer),
    compute as below and arrive on "free"[k % 2] after their PV, which the producer waits for before it refills
    that tile with block k + 2. No "ready" barrier and no staging rows natively. Natively the producer is one
    software-pipelined loop (``record_gather.produce_tile``) and "full" and "free"
    are raw mbarriers in the idx buffer's third row (``record_gather.init_barriers``); interpret mode emulates
    it with the staged copies, the compute warpgroups' conversion and Pallas barriers.
    ``q_parts``: the widths of the (at most two) q inputs whose rows, side by side, are q's (None: one input of
    ``dk``), copied into their columns of the q tile by 8-row groups (a column range of the tiled tile is
    contiguous only within a group), all on the "q landed" barrier."""
    reg = producer == "registers"
    raw = reg and interpret is None  # the producer's inline PTX loop over raw mbarriers
    kind, dk = specs[0].kind, specs[0].dim
    q_parts = (dk,) if q_parts is None else tuple(q_parts)  # (checked by ``_pallas``: at most two, summing to dk)
    nq = len(q_parts)
    # the q copies, each an arrival on "q landed"
    q_copies = nq if nq == 1 else nq * (HEAD_TILE // 8)
    emulate = reg and interpret is not None  # the producer's register gather is PTX: interpret mode stages rows
    nc = len(specs)
    if sum(list_blocks) >= 1 << 20:  # the descriptors' opaque zero is block_id >> 20
        raise ValueError(f"sparse_mqa kernel: {sum(list_blocks)} candidate blocks per token (at most 2^20 - 1)")
    list_start = [sum(list_blocks[:i]) for i in range(nc)]
    G = hp // HEAD_TILE
    BK = BLOCK_K
    dvw = dv // NUM_WG
    HALF = BK // NUM_WG  # candidates per warpgroup in QK and the softmax
    fp8 = kind != "rows"
    # rope values: compiled, read as bf16 through a second (aliased) view of the staging rows; GPU interpret mode
    # does not alias RefUnion members, so there they are rebuilt from their bytes by the selection-matrix wgmma
    rope_mm = fp8 and interpret is not None
    nch = dk // 64  # 64-column chunks of the K tile (the last one is the rope for fp8 records)
    wg_chunks = (list(range(0, nch // 2)), list(range(nch // 2, nch)))
    copies = _copies_per_row(kind)
    # bf16 rows: a 16-byte pad per staging row spreads the rows over the SMEM banks (no room at 576)
    rows_w = dk + 8 if dk <= 512 else dk
    L = plgpu.Layout.WGMMA
    ROW, COL = L.reduce(1), L.reduce(0)
    # 64-byte swizzled tiles of 32 columns, so that each warpgroup's half of P is whole tiles (a column slice must
    # cover whole tiles, and wgmma takes both operands in one swizzle)
    SW = (plgpu.TilingTransform((8, HALF)), plgpu.SwizzleTransform(2 * HALF))
    PIB = plgpu.OOBFillMode.PROMISE_IN_BOUNDS
    o_scale = 2.0 ** record_gather.K_SHIFT if k_shift else 1.0  # K (and V, its columns) shifted back
    s2 = scale * LOG2E * o_scale  # scores in base 2

    def issue_row_copies(cache_refs, st, idx_s, islot, gb, w, bar_kv):
        """Bulk-copy the records of rows [w*BK/2, (w+1)*BK/2) of global block gb into the staging rows. Each warp
        of the warpgroup issues its own quarter of the rows (warp-level semantics: its 32 lanes arrive for the
        whole warpgroup), so the scalar address code runs once per row, not once per row in every warp."""

        def one_cache(ci, warp):
            spec, ref = specs[ci], cache_refs[ci]
            epp = spec.entries_per_page
            first_row = w * (BK // NUM_WG) + warp * ROWS_PER_WARP

            # every source / destination offset below is a multiple of 16 bytes (bulk-copy alignment); Mosaic GPU
            # has no pl.multiple_of under warp-level semantics to say so
            @pl.loop(first_row, first_row + ROWS_PER_WARP)
            def _(i):
                slot = jnp.maximum(idx_s[islot, i], 0)
                page, j = slot // epp, slot % epp
                first = j == 0
                if kind == "mla656":
                    src = jnp.where(first, 0, j * 656 - _M656_BACK)
                    dst = jnp.where(first, _M656_REC, 0)
                    plgpu.copy_gmem_to_smem(ref.at[page, pl.ds(src, _M656_COPY)], st.at[i, pl.ds(dst, _M656_COPY)],
                                            bar_kv, oob_mode=PIB)
                elif kind == "mla584":
                    src = jnp.where(first, 0, j * 576 - _M584_BACK)
                    dst = jnp.where(first, _M584_REC, 0)
                    plgpu.copy_gmem_to_smem(ref.at[page, pl.ds(src, _M584_COPY)], st.at[i, pl.ds(dst, _M584_COPY)],
                                            bar_kv, oob_mode=PIB)
                    sc = epp * 576 + 8 * j
                    win = (sc // 16) * 16 - 112
                    plgpu.copy_gmem_to_smem(ref.at[page, pl.ds(win, _M584_SC_COPY)],
                                            st.at[i, pl.ds(_M584_SC, _M584_SC_COPY)], bar_kv, oob_mode=PIB)
                else:
                    src = j * dk
                    plgpu.copy_gmem_to_smem(ref.at[page, pl.ds(src, dk)], st.at[i, pl.ds(0, dk)], bar_kv,
                                            oob_mode=PIB)

        @plgpu.warp_map
        def _(warp):
            if nc == 1:
                one_cache(0, warp)
            else:
                for ci in range(nc):
                    lo, hi = list_start[ci], list_start[ci] + list_blocks[ci]
                    pl.when((gb >= lo) & (gb < hi))(functools.partial(one_cache, ci, warp))

    def convert(w, st, slot_row, chunks):
        """The bf16 values of K tile chunks ``chunks`` (this warpgroup's, never the rope chunk) from the staged
        records: [(chunk, [BK, 64] bf16)]. Registers only: the caller stores them."""
        if kind == "rows":
            return [(c, plgpu.load(st.at[:, pl.ds(64 * c, 64)], layout=L, optimized=rows_w != dk)) for c in chunks]
        col = plgpu.broadcasted_iota(jnp.int32, (BK, 16), 1, layout=L)
        if kind == "mla656":
            b = plgpu.load(st.at[:, pl.ds(_M656_REC + 512, 16)], layout=L, optimized=True).astype(jnp.int32)
            wb = lax.shift_left(b, 8 * (col & 3))
            scales = {}
            for c in chunks:
                if c // 2 not in scales:
                    v = jnp.sum(jnp.where(lax.shift_right_logical(col, 2) == c // 2, wb, 0), axis=1)
                    scales[c // 2] = lax.bitcast_convert_type(v, jnp.float32)
            data_col = _M656_REC
            scale_of = lambda c: scales[c // 2]
        else:
            b = plgpu.load(st.at[:, pl.ds(_M584_SC + 112, 16)], layout=L, optimized=True).astype(jnp.int32)
            h8 = lax.broadcast_in_dim(8 * (jnp.maximum(slot_row, 0) & 1), (BK, 16), [0])
            scales = {}
            for c in chunks:
                e = jnp.sum(jnp.where(col == h8 + c, b, 0), axis=1)
                scales[c] = lax.bitcast_convert_type(lax.shift_left(e, 23), jnp.float32)
            data_col = _M584_REC
            scale_of = lambda c: scales[c]
        out = []
        for c in chunks:
            x8 = plgpu.load(st.at[:, pl.ds(data_col + 64 * c, 64)], layout=L, optimized=True)
            x = lax.bitcast_convert_type(x8, jnp.float8_e4m3fn).astype(jnp.float32)
            x = x * lax.broadcast_in_dim(scale_of(c), (BK, 64), [0])
            out.append((c, x.astype(jnp.bfloat16)))
        return out

    def store_rope(st, st16, k_s, pb_s, sel_s):
        """The rope chunk of the K tile: the record's bf16 rope values (fp8 records; its warpgroup only)."""
        rope_chunk, rope_col = nch - 1, (_M656_REC + 512 + 16 if kind == "mla656" else _M584_REC + 448)
        if not rope_mm:
            k_s[:, pl.ds(64 * rope_chunk, 64)] = plgpu.load(st16.at[:, pl.ds(rope_col // 2, 64)], layout=L,
                                                            optimized=True)
            return
        rb = plgpu.load(st.at[:, pl.ds(rope_col, 128)], layout=L, optimized=True)
        pb_s[...] = rb.astype(jnp.int32).astype(jnp.float32).astype(jnp.bfloat16)
        plgpu.commit_smem()

        def pair(half):
            def mm(acc):
                plgpu.wgmma(acc, pb_s.at[:, pl.ds(64 * half, 64)], sel_s)
                plgpu.wgmma_wait(0)
                return acc[...]
            return pl.run_scoped(mm, plgpu.ACC((BK, 64), jnp.float32))

        lo, hi = pair(0), pair(1)
        u16 = jnp.concatenate([lo[:, :32], hi[:, :32]], axis=1).astype(jnp.int32)
        pe = lax.bitcast_convert_type(lax.shift_left(u16, 16), jnp.float32)
        k_s[:, pl.ds(64 * rope_chunk, 64)] = pe.astype(jnp.bfloat16)

    n_ext = 0 if kernel_extents else nc  # extents given per list, or computed here (``kernel_extents``)

    def kernel(*refs):
        q_refs, rest = refs[:nq], refs[nq:]
        slots_refs, ext_refs, sink_ref, rest = rest[:nc], rest[nc:nc + n_ext], rest[nc + n_ext], rest[nc + n_ext + 1:]
        cache_refs, rest = rest[:nc], rest[nc:]
        if n_splits == 1 or cluster:
            (o_ref,), scratch = rest[:1], rest[1:]
        else:
            (o_ref, m_ref, l_ref), scratch = rest[:3], rest[3:]
        st16 = pb_s = sel_s = st = bar_i = bar_kv = bar_ready = xacc = xml = bar_xfree = bar_xfull = None
        if cluster:  # the K tiles and, aliased, the peer's half accumulator and statistics; their barriers
            *scratch, bar_xfree, bar_xfull = scratch
            scratch[1], (xacc, xml) = scratch[1]
        bar_pfree = None
        if scores_one:  # P's buffer and the rescale factors read by warpgroup 1 (``scores="one"``)
            *scratch, bar_pfree = scratch
        *scratch, stat_s, bar_stat = scratch
        if reg:
            q_s1, k_s1, p_s, idx_s, bar_q, bar_full, bar_free, bar_p, *staged = scratch
            if emulate:  # the producer's staging rows, rope byte tile and selection matrix; then the barriers
                *per_prod, bar_i, bar_kv = staged
        elif rope_mm:
            q_s1, k_s1, st, p_s, pb_s, sel_s, idx_s, bar_q, bar_i, bar_kv, bar_ready, bar_p = scratch
        elif fp8:
            q_s1, k_s1, (st, st16), p_s, idx_s, bar_q, bar_i, bar_kv, bar_ready, bar_p = scratch
        else:
            q_s1, k_s1, st, p_s, idx_s, bar_q, bar_i, bar_kv, bar_ready, bar_p = scratch
        q_s, k_s = q_s1.at[0], k_s1.at[0]  # [1, rows, dk]: index 0 statically (copies, dequantisation)
        pid = lax.axis_index("cta")
        if cluster:  # the grid is over (token, head tile) pairs; the split is the CTA's rank in its cluster
            gi, ti, si = pid % G, pid // G, lax.axis_index("pair")
        else:
            gi, ti, si = pid % G, (pid // G) % t, pid // (G * t)
        if kernel_extents:  # this token's live blocks per list (``_extents``): every warp computes them
            exts = record_gather.list_extents(tuple(r.at[ti] for r in slots_refs),
                                              tuple(BK * b for b in list_blocks))
        else:
            exts = [r[ti] for r in ext_refs]
        b0 = si * bps  # this split's first position in the token's sequence of live blocks
        nblk = jnp.clip(functools.reduce(jnp.add, exts) - b0, 0, bps)
        wg = lax.axis_index("wg")
        if raw:  # every thread: the raw "full" / "free" mbarriers initialised, then the CTA in step
            record_gather.init_barriers(idx_s.at[2])

        def init_selection(sel_s=sel_s):
            """Interpret mode's byte-pair selection matrix for the rope values (``store_rope``)."""
            r = plgpu.broadcasted_iota(jnp.int32, (64, 64), 0, layout=L)
            c = plgpu.broadcasted_iota(jnp.int32, (64, 64), 1, layout=L)
            sel = jnp.where(lax.shift_right_logical(r, 1) == c, jnp.where((r & 1) == 0, 1.0, 256.0), 0.0)
            sel_s[...] = sel.astype(jnp.bfloat16)
            plgpu.commit_smem()

        def block_id(k):  # k-th block of this split -> block index in the concatenated candidate lists
            return block_of(b0 + k, exts, list_blocks)

        def idx_copy(k, islot):
            gb = block_id(k)

            def one_list(ci):
                start = pl.multiple_of((gb - list_start[ci]) * BK, BK)
                plgpu.copy_gmem_to_smem(slots_refs[ci].at[ti, pl.ds(start, BK)], idx_s.at[islot], bar_i.at[islot])

            if nc == 1:
                one_list(0)
            else:
                for ci in range(nc):
                    lo, hi = list_start[ci], list_start[ci] + list_blocks[ci]
                    pl.when((gb >= lo) & (gb < hi))(functools.partial(one_list, ci))

        def run(w):
            latent = [c for c in wg_chunks[w] if not (fp8 and c == nch - 1)]  # chunks converted in registers
            has_rope = fp8 and nch - 1 in wg_chunks[w]

            def slot_row(islot):  # V4's scale bytes sit in the record pair's 16-byte group: the slot's parity
                return plgpu.load(idx_s.at[islot], layout=ROW, optimized=False) if kind == "mla584" else None

            def fill_k(islot):
                """This warpgroup's chunks of the K tile from the rows staged now (their slots in ``islot``),
                and the rope chunk; then make them visible to the tensor cores."""
                for c, v in convert(w, st, slot_row(islot), latent):
                    k_s[:, pl.ds(64 * c, 64)] = v
                if has_rope:
                    store_rope(st, st16, k_s, pb_s, sel_s)
                plgpu.commit_smem()

            # ---- prologue
            with jax.named_scope("prologue"):  # regions of the Mosaic GPU profiler (``profile_dir``)
                if reg and not emulate:
                    n = compute_regs(producer_regs) + (SCORES_ONE_REGS * (1 - 2 * w) if scores_one else 0)
                    if n != launch_regs():
                        plgpu.set_max_registers(n, action="increase" if n > launch_regs() else "decrease")
                if w == 0:
                    # q_multicast: both CTAs of the pair need this tile; each fetches half of it into both
                    if nq == 1:
                        plgpu.copy_gmem_to_smem(q_refs[0].at[ti, pl.ds(gi * HEAD_TILE, HEAD_TILE)], q_s,
                                                bar_q.at[0], collective_axes="pair" if q_multicast else None)
                    else:  # q's parts into their columns, by 8-row groups (a group's columns are contiguous)
                        for r, (i, c0) in itertools.product(range(HEAD_TILE // 8), ((0, 0), (1, q_parts[0]))):
                            plgpu.copy_gmem_to_smem(q_refs[i].at[ti, pl.ds(gi * HEAD_TILE + 8 * r, 8)],
                                                    q_s.at[pl.ds(8 * r, 8), pl.ds(c0, q_parts[i])], bar_q.at[0])
                    if not reg:
                        @pl.when(nblk > 0)
                        def _():
                            idx_copy(0, 0)

                        @pl.when(nblk > 1)
                        def _():
                            idx_copy(1, 1)
                elif rope_mm and not reg:
                    init_selection()

                if not reg:
                    @pl.when(nblk > 0)
                    def _():
                        plgpu.barrier_wait(bar_i.at[0])
                        issue_row_copies(cache_refs, st, idx_s, 0, block_id(0), w, bar_kv.at[0])
                        plgpu.barrier_wait(bar_kv.at[0])
                        fill_k(0)  # block 0's K chunks; each iteration fills the next block's after its PV
                if has_sink and n_splits == 1:
                    sk = plgpu.load(sink_ref.at[pl.ds(gi * HEAD_TILE, HEAD_TILE)], layout=ROW, optimized=False) * LOG2E
                    m0 = jnp.maximum(sk, M_INIT)
                    l0 = jnp.exp2(sk - m0) * (1.0 if w == 0 else 0.0)  # counted once, in warpgroup 0's sum
                else:
                    m0 = plgpu.layout_cast(jnp.full((HEAD_TILE,), M_INIT, jnp.float32), ROW)
                    l0 = plgpu.layout_cast(jnp.full((HEAD_TILE,), 0.0, jnp.float32), ROW)
                acc0 = plgpu.layout_cast(jnp.full((HEAD_TILE, dvw), 0.0, jnp.float32), L)
                plgpu.barrier_wait(bar_q.at[0])

            # this warpgroup's candidates (``scores="one"``: warpgroup 0 scores all, warpgroup 1 none)
            scorer = not scores_one or w == 0
            width = BK if scores_one else HALF
            own = pl.ds(0 if scores_one else w * HALF, width)

            def body(k, carry):
                acc, m, l = carry
                islot = k % 2
                nxt = k + 1 < nblk
                # the wgmma operands go through a zero the compiler cannot fold (block ids < 2^20, checked when
                # built): their descriptors are rebuilt where used, not held across the loop
                z = lax.shift_right_logical(block_id(k), 20)
                if reg:  # block k in K tile k % 2, its slots in idx slot k % 2 (both from the producer)
                    if raw:
                        # the producer filled K tile k % 2 with block k (raw mbarriers)
                        with jax.named_scope("wait_full"):
                            record_gather.wait_full(idx_s.at[2, pl.ds(2 * islot, 2)], (k // 2) % 2)
                    else:
                        plgpu.barrier_wait(bar_full.at[islot])
                    q_mm, k_mm = q_s1.at[z], k_s1.at[islot + z]
                else:
                    q_mm, k_mm = q_s1.at[z], k_s1.at[z]
                if scorer:
                    valid = plgpu.load(idx_s.at[islot, own], layout=COL, optimized=False) >= 0
                if not reg:  # K tile of block k complete (both halves), its staging rows and slots read by both
                    # the slots' generic reads before warpgroup 0's slot copy of block k + 2 into this idx slot
                    # (an async-proxy write): ordered only across a proxy fence
                    generic_reads_fence(interpret)
                    plgpu.barrier_arrive(bar_ready.at[0])
                    plgpu.barrier_wait(bar_ready.at[0])

                def prefetch():
                    """Rows of block k+1 (their slots landed in the other idx slot), slots of block k+2."""
                    @pl.when(nxt)
                    def _():
                        plgpu.barrier_wait(bar_i.at[1 - islot])
                        issue_row_copies(cache_refs, st, idx_s, 1 - islot, block_id(k + 1), w, bar_kv.at[0])

                    if w == 0:
                        @pl.when(k + 2 < nblk)
                        def _():
                            idx_copy(k + 2, islot)

                # S = Q K^T (the prefetch is issued while the tensor cores run it), masked online softmax (base 2)
                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_mm, k_mm.at[own].T)
                    if not reg:
                        prefetch()
                    plgpu.wgmma_wait(0)
                    return acc_ref[...]

                v_ref = k_mm.at[:, pl.ds(w * dvw, dvw)]
                if not scorer:  # scores="one", warpgroup 1: block k's P, rescale factors and maxima from warpgroup 0
                    if not reg:
                        prefetch()
                    with jax.named_scope("softmax"):
                        plgpu.barrier_wait(bar_p.at[0])
                        alpha = plgpu.load(stat_s.at[0, 0], layout=ROW, optimized=False)
                        m_new = plgpu.load(stat_s.at[0, 1], layout=ROW, optimized=False)
                        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                else:
                    with jax.named_scope("qk"):
                        sc = pl.run_scoped(qk, plgpu.ACC((HEAD_TILE, width), jnp.float32)) * s2
                    with jax.named_scope("softmax"):  # and the exchanges of the row maxima and of P
                        sc = jnp.where(lax.broadcast_in_dim(valid, sc.shape, [1]), sc, -jnp.inf)
                        mx = sc.max(axis=1)
                        if not scores_one:  # the row maximum over both halves: one exchange through shared memory
                            stat_s.at[0, w][...] = mx
                            plgpu.barrier_arrive(bar_stat.at[0])
                            plgpu.barrier_wait(bar_stat.at[0])
                            mx = jnp.maximum(mx, plgpu.load(stat_s.at[0, 1 - w], layout=ROW, optimized=False))
                        m_new = jnp.maximum(m, mx)
                        alpha = jnp.exp2(m - m_new)
                        p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
                        l = l * alpha + p.sum(axis=1)
                        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                        if scores_one:
                            # P's buffer and the statistics row are free once warpgroup 1's PV of block k - 1
                            # is done (it read the statistics before that PV)
                            @pl.when(k > 0)
                            def _():
                                plgpu.barrier_wait(bar_pfree.at[0])

                            p_s[...] = p.astype(jnp.bfloat16)
                            stat_s.at[0, 0][...] = alpha
                            stat_s.at[0, 1][...] = m_new
                            plgpu.commit_smem()
                            plgpu.barrier_arrive(bar_p.at[0])
                        else:  # each warpgroup publishes its half of P's columns; PV takes the whole P
                            p_s.at[:, own][...] = p.astype(jnp.bfloat16)
                            plgpu.commit_smem()
                            plgpu.barrier_arrive(bar_p.at[0])
                            plgpu.barrier_wait(bar_p.at[0])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_s, v_ref)
                    plgpu.wgmma_wait(0)

                if interpret:  # interpret mode has no run_state: same sum, through a fresh accumulator
                    def pv_fresh(acc_ref):
                        pv(acc_ref)
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv_fresh, plgpu.ACC((HEAD_TILE, dvw), jnp.float32))
                else:  # in place: a second [64, 256] fp32 accumulator would not fit the registers
                    with jax.named_scope("pv"):
                        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                if not scorer:  # P and the statistics row read: warpgroup 0 may write block k + 1's
                    plgpu.barrier_arrive(bar_pfree.at[0])

                if raw:  # done with K tile k % 2 (and its slots): the producer may refill it
                    record_gather.arrive_free(idx_s.at[2, pl.ds(4 + 2 * islot, 2)])
                elif reg:  # this warpgroup is done with K tile k % 2 (and its slots): the producer may refill it
                    plgpu.barrier_arrive(bar_free.at[islot])
                else:
                    # block k+1's K chunks of this warpgroup, once its PV(k) is done: PV(k) reads this
                    # warpgroup's value columns, the very chunks it writes; the other warpgroup's QK(k) finished
                    # before the P exchange and its PV(k) reads only its own columns (so no "K free" barrier)
                    @pl.when(nxt)
                    def _():
                        plgpu.barrier_wait(bar_kv.at[0])
                        fill_k(1 - islot)
                return acc, m_new, l

            acc, m, l = lax.fori_loop(0, nblk, body, (acc0, m0, l0))
            if scores_one and w == 0:  # the last block's "P free" (a waiting thread observes every phase)
                @pl.when(nblk > 0)
                def _():
                    plgpu.barrier_wait(bar_pfree.at[0])
            with jax.named_scope("epilogue"):
                # each warpgroup summed its halves' weights (same maxima): the total is the sum of both
                stat_s.at[1, w][...] = l
                plgpu.barrier_arrive(bar_stat.at[0])
                plgpu.barrier_wait(bar_stat.at[0])
                l = l + plgpu.load(stat_s.at[1, 1 - w], layout=ROW, optimized=False)
                heads = pl.ds(gi * HEAD_TILE, HEAD_TILE)
                cols = pl.ds(w * dvw, dvw)
                if cluster:
                    merge_in_cluster(w, acc, m, l, heads, o_ref.at[ti, heads, cols])
                    return
                inv = jnp.where(l > 0, o_scale / jnp.where(l > 0, l, 1.0), 0.0)
                o = acc * lax.broadcast_in_dim(inv, acc.shape, [0])  # normalised, so a split's rows fit its dtype
                dst = o_ref.at[ti, heads, cols] if n_splits == 1 else o_ref.at[si, ti, heads, cols]
                store_rows(w, dst, [(0, o)])
                if n_splits > 1 and w == 0:
                    m_ref.at[si, ti, heads][...] = m
                    l_ref.at[si, ti, heads][...] = l
                if out_store == "tma":
                    plgpu.wait_smem_to_gmem(0)  # the q tile stays until the copy has read it

        def store_rows(w, dst, parts):
            """Warpgroup w's rows [64, dvw] into ``dst``, given as [(first column, [64, n] fp32)]: directly, or
            through its columns of the q tile (free: both warpgroups passed the statistics barrier) and TMA
            copies, whose reads the caller waits for."""
            for c0, o in parts:
                if out_store == "tma":
                    q_s.at[:, pl.ds(w * dvw + c0, o.shape[1])][...] = o.astype(jnp.bfloat16)
                else:
                    dst.at[:, pl.ds(c0, o.shape[1])][...] = o.astype(dst.dtype)
            if out_store == "tma":
                plgpu.commit_smem()
                for r in range(HEAD_TILE // 8):  # an 8-row group of the tiled q tile is contiguous
                    rows = pl.ds(8 * r, 8)
                    plgpu.copy_smem_to_gmem(q_s.at[rows, pl.ds(w * dvw, dvw)], dst.at[rows])

        def merge_in_cluster(w, acc, m, l, heads, dst):
            """merge="cluster": CTA si finalises the value columns of its warpgroup si. Its other warpgroup
            sends its unnormalised accumulator and (m, l) to the peer, once the peer's loops are done (its K
            tiles, which hold the received values, are then free); warpgroup si announces that for this CTA,
            waits for the peer's half and writes the merged rows. ``st.async`` completes on the receiver's
            barrier with the bytes it carries, and the receiver reads them only after waiting on that barrier,
            so no cluster-scope fence is needed. (m, l) travel as one [64, 32] tile: m in columns 0-15, l in
            16-31."""
            col = plgpu.broadcasted_iota(jnp.int32, (HEAD_TILE, 32), 1, layout=L)

            @pl.when(si != w)
            def _send():
                plgpu.barrier_wait(bar_xfree)
                ml = jnp.where(col < 16, lax.broadcast_in_dim(m, col.shape, [0]),
                               lax.broadcast_in_dim(l, col.shape, [0]))
                plgpu.async_store_smem(acc, xacc, bar_xfull, cluster_idx=1 - si, cluster_dim="pair")
                plgpu.async_store_smem(ml, xml, bar_xfull, cluster_idx=1 - si, cluster_dim="pair")

            @pl.when(si == w)
            def _receive():
                plgpu.barrier_arrive(bar_xfree)  # in both CTAs: this one's loops are done
                plgpu.barrier_wait(bar_xfull)
                ml = xml[...]
                m_peer = jnp.where(col < 16, ml, -jnp.inf).max(axis=1)
                l_peer = jnp.where(col >= 16, ml, -jnp.inf).max(axis=1)
                mt = jnp.maximum(m, m_peer)
                if has_sink:
                    sk = plgpu.load(sink_ref.at[heads], layout=ROW, optimized=False) * LOG2E
                    mt = jnp.maximum(mt, sk)
                a0, a1 = jnp.exp2(m - mt), jnp.exp2(m_peer - mt)
                lt = l * a0 + l_peer * a1
                if has_sink:
                    lt = lt + jnp.exp2(sk - mt)
                inv = jnp.where(lt > 0, o_scale / jnp.where(lt > 0, lt, 1.0), 0.0)
                w0 = lax.broadcast_in_dim(a0 * inv, (HEAD_TILE, 64), [0])
                w1 = lax.broadcast_in_dim(a1 * inv, (HEAD_TILE, 64), [0])
                # 64 columns at a time: the peer's whole half beside this one's would not fit the registers
                parts = [(c0, acc[:, c0:c0 + 64] * w0 + xacc.at[:, pl.ds(c0, 64)][...] * w1)
                         for c0 in range(0, dvw, 64)]
                store_rows(w, dst, parts)
                if out_store == "tma":
                    plgpu.wait_smem_to_gmem(0)

        def produce():
            """producer="registers": block k into K tile k % 2 (and its slots into idx slot k % 2), once the
            compute warpgroups freed that tile of block k - 2."""
            if raw:  # natively: one inline PTX loop, its own waits and arrivals
                plgpu.set_max_registers(producer_regs, action="decrease")
                lists = (tuple((list_start[i], specs[i].entries_per_page, specs[i].page_elems) for i in range(nc))
                         if kind == "mla584" else None)
                with jax.named_scope("produce"):
                    record_gather.produce_tile(tuple(x.at[ti] for x in slots_refs), tuple(cache_refs), k_s1, idx_s, b0,
                                               nblk, exts=tuple(exts[:-1]), nblocks=sum(list_blocks), lists=lists,
                                               phases=producer_phases, pow2_scales=pow2,
                                               overlap=producer_overlap, k_shift=k_shift,
                                               prefetch_ahead=prefetch_ahead)
                return
            st, pb_s, sel_s = per_prod
            init_selection(sel_s)

            @pl.loop(0, nblk)
            def _(k):
                b = k % 2

                @pl.when(k >= 2)
                def _():
                    plgpu.barrier_wait(bar_free.at[b])

                # interpret mode: the same values through the staged rows (it cannot run the producer's PTX)
                idx_copy(k, b)
                plgpu.barrier_wait(bar_i.at[b])
                for half in range(NUM_WG):
                    issue_row_copies(cache_refs, st, idx_s, b, block_id(k), half, bar_kv.at[0])
                plgpu.barrier_wait(bar_kv.at[0])
                kb = k_s1.at[b]
                for c, v in convert(0, st, None, list(range(nch - 1))):
                    kb[:, pl.ds(64 * c, 64)] = v
                store_rope(st, st16, kb, pb_s, sel_s)
                plgpu.commit_smem()
                plgpu.barrier_arrive(bar_full.at[b])

            # the "free" phases of its last fills (of the last two blocks): a thread waiting on a barrier
            # observes every phase of it
            @pl.loop(jnp.maximum(nblk - 2, 0), nblk)
            def _(k):
                plgpu.barrier_wait(bar_free.at[k % 2])

        for w in range(NUM_WG):
            pl.when(wg == w)(functools.partial(run, w))
        if reg:
            pl.when(wg == NUM_WG)(produce)

    if kind == "mla656":
        st_t = plgpu.SMEM((BK, _M656_W), jnp.uint8)
    elif kind == "mla584":
        st_t = plgpu.SMEM((BK, _M584_W), jnp.uint8)
    else:
        st_t = plgpu.SMEM((BK, rows_w), jnp.bfloat16)
    p_t = plgpu.SMEM((HEAD_TILE, BK), jnp.bfloat16, transforms=SW)
    if fp8 and not rope_mm:  # the staging rows as bytes (copies, latent, scales) and as bf16 (rope values)
        st_t = plgpu.RefUnion(st_t, plgpu.SMEM((BK, st_t.shape[1] // 2), jnp.bfloat16))
    if rope_mm:  # interpret mode only: the rope byte tile (its own: the other warpgroup's PV may still read P
        # while the rope is converted) and the byte-pair selection matrix
        mid = [p_t, plgpu.SMEM((BK, 128), jnp.bfloat16, transforms=SW),
               plgpu.SMEM((64, 64), jnp.bfloat16, transforms=SW)]
    else:
        mid = [p_t]
    scratch = [
        plgpu.SMEM((1, HEAD_TILE, dk), jnp.bfloat16, transforms=SW),  # q tile
        plgpu.SMEM((1, BK, dk), jnp.bfloat16, transforms=SW),  # dequantised K tile (V = its first dv columns)
        st_t, *mid,
        plgpu.SMEM((2, BK), jnp.int32),  # slots of the current and next block
        plgpu.Barrier(num_arrivals=q_copies, num_barriers=1),  # q landed (each copy)
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # slots landed (per idx slot)
        plgpu.Barrier(num_arrivals=BK * copies, num_barriers=1),  # all row copies of a block landed
        plgpu.Barrier(num_arrivals=NUM_WG, num_barriers=1),  # K tile complete, staging/slots read
        plgpu.Barrier(num_arrivals=1 if scores_one else NUM_WG, num_barriers=1),  # P published (both halves)
        # row maxima, then the final sums (block k+1's maxima are written only after both warpgroups
        # passed block k's "ready" barrier, by then both read block k's)
        plgpu.SMEM((2, NUM_WG, HEAD_TILE), jnp.float32),
        plgpu.Barrier(num_arrivals=NUM_WG, num_barriers=1),  # both warpgroups' statistics written
    ]
    if reg:  # two K tiles and no staging rows (natively: SMEM 226 KB of 227 at V3.2's 576 columns)
        scratch = [
            plgpu.SMEM((1, HEAD_TILE, dk), jnp.bfloat16, transforms=SW),  # q tile
            plgpu.SMEM((2, BK, dk), jnp.bfloat16, transforms=SW),  # K tiles of blocks k and k + 1
            p_t,
            # the two blocks' slots (-1 = masked), written by the producer; with raw barriers a third row holds
            # "full" and "free" (the buffer's 1 KB of shared memory has room)
            plgpu.SMEM((3 if raw else 2, BK), jnp.int32),
            plgpu.Barrier(num_arrivals=q_copies, num_barriers=1),  # q landed (each copy)
            plgpu.Barrier(num_arrivals=1, num_barriers=2),  # "full": the producer filled K tile / idx slot b
            plgpu.Barrier(num_arrivals=NUM_WG, num_barriers=2),  # "free": the compute warpgroups are done with b
            plgpu.Barrier(num_arrivals=1 if scores_one else NUM_WG, num_barriers=1),  # P published (both halves)
        ]
        if emulate:  # the producer's staged rows and interpret mode's rope tiles; slots and rows landed
            scratch += [st_t, *mid[1:], plgpu.Barrier(num_arrivals=1, num_barriers=2),
                        plgpu.Barrier(num_arrivals=BK * copies, num_barriers=1)]
        scratch += [plgpu.SMEM((2, NUM_WG, HEAD_TILE), jnp.float32), plgpu.Barrier(num_arrivals=NUM_WG, num_barriers=1)]
    if scores_one:  # warpgroup 1 is done with P and the statistics row (``scores="one"``)
        scratch.append(plgpu.Barrier(num_arrivals=1, num_barriers=1))
    if cluster:  # the peer's half accumulator and its (m, l) in the K tiles' memory; "both CTAs' loops done"
        # (each CTA's receiving warpgroup arrives in both) and "the peer's two stores landed"
        f32_tiles = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
        scratch[1] = plgpu.RefUnion(scratch[1], (plgpu.SMEM((HEAD_TILE, dvw), jnp.float32, transforms=f32_tiles),
                                                 plgpu.SMEM((HEAD_TILE, 32), jnp.float32, transforms=f32_tiles)))
        scratch += [plgpu.ClusterBarrier(collective_axes=("pair",), num_arrivals=1),
                    plgpu.Barrier(num_arrivals=2, num_barriers=1)]
    if n_splits == 1 or cluster:
        out_type = jax.ShapeDtypeStruct((t, hp, dv), out_dtype)
    else:
        out_type = (jax.ShapeDtypeStruct((n_splits, t, hp, dv), split_dtype),
                    jax.ShapeDtypeStruct((n_splits, t, hp), jnp.float32),
                    jax.ShapeDtypeStruct((n_splits, t, hp), jnp.float32))
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, unsafe_no_auto_barriers=True,
                                  approx_math=True, reduction_scratch_bytes=0,  # row reductions stay in-warp
                                  **(dict(profile_space=PROFILE_RANGES, profile_dir=profile_dir) if profile_dir
                                     else {}))
    grid = dict(grid=(t * G,), grid_names=("cta",), cluster=(2,), cluster_names=("pair",)) if cluster else dict(
        grid=(n_splits * t * G,), grid_names=("cta",))
    return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, **grid,
                        num_threads=NUM_WG + reg, thread_name="wg", compiler_params=params,
                        interpret=interpret if interpret is not None else False)
