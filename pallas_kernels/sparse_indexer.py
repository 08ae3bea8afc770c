"""Paged FP8 lightning-indexer logits on Hopper (Pallas Mosaic GPU), plus the top-k selection around it.

    I(t, s) = k_scale[s] * sum_h w'[t, h] * relu(q8[t, h] . k8[s])          fp32 accumulation

over the 132-byte indexer cache (``jds.ops.records.IndexerRecord132``: a page holds ``epp`` keys as
[epp x 128 e4m3 values][epp x fp32 UE8M0 scales]) read through the block table. Key s of token t is
visible iff s < n_visible[t]: V3.2 passes positions + 1 (keys = tokens, causal [0, p]); V4 C4 layers
pass (positions + 1) // 4 (keys = compressed entries, b < (p+1)//4) with epp = block_size // 4. Decode,
prefill and chunked prefill are the same call: every token reads its own request's keys.

Numerics. ``quantize_q`` turns the dequantised query the layers hand over (q = q8 * s_q, s_q a power of
two) back into (q8, w' = w * s_q) exactly; the kernel multiplies e4m3 x e4m3 in the tensor core (wgmma,
fp32 accumulator), applies relu, weights each head with w', sums the heads in fp32 and scales by the
key's fp32 scale. The pure-JAX reference (``jds.ops.indexer.index_scores``) sums in another order, so
logits agree to fp32 rounding, not bit for bit (on Hopper the FP8 MMA accumulates with ~2^-14 relative
precision inside its K = 128 chain, as DeepGEMM's indexer logits do; interpret mode is exact fp32).

Tie rule (all implementations): ``lax.top_k`` over the logits row, so among equal scores the lower key
index wins; invisible keys are -inf and come back as -1 (also when fewer than k keys are visible).
``IndexerKernelConfig.topk_segment`` switches to an exact two-stage top-k (per-segment top-k, then top-k
of the winners in segment order), ``topk_algorithm="radix"`` to radix selection (``jds.ops.select``:
counting passes, then a sort of the k winners only), ``"pallas_radix"`` to the same selection as a Pallas
kernel (``pallas_kernels.topk_select``): same indices, same order, same tie rule; ``"pallas_rows"`` to a
select of rows held in registers (``pallas_kernels.topk_rows``). ``"auto"`` picks among ``lax``,
``pallas_radix`` and ``pallas_rows`` by shape (``resolve_topk_algorithm``), and is the default.

Kernel layout (Mosaic GPU, one warpgroup per CTA):
- grid = (query groups, key splits). A *group* is up to G consecutive tokens of one request (G = 1 for
  decode, 2-4 for prefill so that one key tile feeds G MMAs; G * Hp <= 256 so the G accumulators fit in
  registers); a *split* is ``tiles_per_cta`` tiles of 64 keys. Each CTA streams its tiles through a
  ``num_buffers``-deep TMA ring and writes every logit of its (group, split) rectangle: computed where
  some key is visible, -inf elsewhere (tiles wholly past the group's visibility are not read).
- per tile: keys = wgmma A operand [64 keys x 128] (SMEM), q = B operand [128 x Hp] (the group's token g,
  heads padded to Hp = 64k), acc [64 x Hp] fp32 -> relu * w' -> row sum -> * k_scale -> mask -> TMA store
  of a [64] row per token (epilogues of a partial group's missing tokens are skipped, the MMAs are not:
  an in-flight accumulator must not cross a branch).
- Key sources (``IndexerKernelConfig.key_source``). The cache is uint8. Mosaic GPU copies only between
  refs of one dtype and bitcasts SMEM only through ``plgpu.RefUnion``, and XLA materialises
  ``bitcast_convert_type`` of the whole cache (a copy per call: seen in the CPU backend's optimised HLO,
  assumed on the GPU). So:
  * ``"paged"`` (default on the GPU): the kernel TMA-copies the page bytes into uint8 members of a
    RefUnion whose other group holds the e4m3 [64, 128] key tile and the fp32 [64] scale vector at the
    same SMEM offsets (each group starts at offset 0 and packs its refs in order; checked in the lowered
    module). The uint8 key member is [64, 1, 128] tiled (1, 128) with the 128-byte swizzle: the same
    bytes as the (8, 128)-tiled swizzled e4m3 tile (TMA and wgmma swizzle by SMEM address), but its GMEM
    view [pages, rows, 1, 128] satisfies Mosaic's rule that a tiled copy's GMEM dims divide by the tile
    (a page is epp * 132 / 128 rows, e.g. 66, never a multiple of 8). Keys are read once, in place.
  * ``"views"`` (default in interpret mode, which models RefUnion members as separate buffers): XLA
    bitcasts the cache to e4m3 / fp32 views (copies of the pool, fine on the CPU) and the same paged
    addressing copies straight into the e4m3 / fp32 refs (race detector clean). Interpret mode only.
  * ``"gathered"`` (fallback, native and interpret): one XLA gather fusion first copies each request's
    keys into contiguous e4m3 / fp32 arrays (vLLM's prefill does the same), then the kernel reads 64-key
    blocks. No SMEM aliasing; costs an extra write + read of the keys.
  The "paged" mode is checked on the CPU only by lowering it for CUDA (``test_lowers_for_cuda``: Mosaic's
  layout, TMA and wgmma rules); the aliasing itself first runs in the ``gpu``-marked tests, which also
  run "gathered" so that a failure of the aliasing alone is told apart.
- Why not Triton: the page-granular access needs no vector gather (one TMA per page and tile), which is
  the one thing Mosaic GPU cannot express on Hopper; the Triton backend is deprecated since jax 0.11.

Requirements (``supports``): head dim 128, Hi <= 256, an ``IndexerRecord132`` cache whose
entries_per_page is a multiple of 32 that divides or is divided by 64 (V3.2: 64, V4 C4: 64, V4 tiny: 32;
V3.2 tiny's 16 is not: the layers fall back to the XLA path). Tokens of one request row must be
contiguous in the batch (``jds.batch`` builds them so; padding tokens form their own runs).

Bounded memory: ``indexer_topk`` cuts the tokens into chunks whose [chunk x keys] fp32 logits fit in
``max_logits_bytes`` and runs logits + top-k chunk by chunk (``lax.map``), for both implementations
(the XLA path budgets its gathered fp32 keys too, and is the layers' unchunked path when one chunk fits).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jds.ops.dispatch import (Implementation, Unsupported, check_array, check_int, describe, num_sms,
                              mosaic_interpret, run_op)
from jds.ops.paging import check_cache
from jds.ops.indexer import (dequant_index_q, indexer_topk_xla, map_token_chunks, masked_index_logits,
                             visible_topk_indices)
from jds.ops.select import radix_topk
from jds.ops.quant import FP8, act_quant
from jds.ops.records import IndexerRecord132
from pallas_kernels.topk_rows import topk_rows
from pallas_kernels.topk_select import TopkSelectConfig, select_config_for, select_unsorted, topk_select

TILE = 64  # keys per MMA tile (wgmma M)
HEAD_DIM = 128
DEFAULT_MAX_LOGITS_BYTES = 512 << 20

KeySource = Literal["auto", "paged", "views", "gathered"]
TopkAlgorithm = Literal["auto", "lax", "radix", "pallas_radix", "pallas_rows"]
TOPK_ALGORITHMS = ("auto", "lax", "radix", "pallas_radix", "pallas_rows")
TopkOrder = Literal["sorted", "set"]
TOPK_ORDERS = ("sorted", "set")
AUTO_PALLAS_TOPK_ELEMS = 1 << 19  # rows x candidates from which "auto" selects with the Pallas kernel
AUTO_ROWS_TOPK_COLS = 16384 + TILE  # rows of up to this many candidates: the row-in-registers select (topk_rows)


@dataclasses.dataclass(frozen=True)
class IndexerKernelConfig:
    """Tuning knobs of the logits kernel and the chunking around it (None = chosen from the shapes)."""

    queries_per_cta: int | None = None  # G: tokens of one request sharing a key tile (1..4)
    tiles_per_cta: int | None = None  # 64-key tiles per CTA (key split length)
    num_buffers: int = 3  # TMA ring depth
    max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES  # fp32 logits workspace of one chunk of tokens
    key_source: KeySource = "auto"  # "paged" on the GPU, "views" when interpreting (see module doc)
    topk_segment: int | None = None  # two-stage top-k: lax.top_k per segment of this many keys, then
    #                                  over the segments' winners (exact, same tie rule); None = one stage
    topk_algorithm: TopkAlgorithm = "auto"  # "auto": resolve_topk_algorithm (on the GPU the row select up to 16K
    #                                  columns, the radix select from 512K logits, else lax.top_k); "lax";
    #                                  "radix": jds.ops.select; "pallas_radix": pallas_kernels.topk_select;
    #                                  "pallas_rows": pallas_kernels.topk_rows (all exact, same order)
    topk_order: TopkOrder = "set"  # "set": the same keys in any order (pallas_radix then skips its sort of the
    #                                k winners; the sparse MQA takes a set); "sorted": lax.top_k's order
    topk_splits: int | None = None  # pallas_radix: programs per row for its prefilter pass (TopkSelectConfig.splits;
    #                                 a power of 2); None: topk_select.select_config_for(rows, cols), by the
    #                                 batch (split_for's splits, with its measured loop knobs where it splits)
    topk_split_finish: bool = True  # pallas_radix with topk_splits=None: select_config_for's split finish (the
    #                                 finish spread over the row's split programs; one more kernel, faster at every
    #                                 batch timed: select_config_for); False: the one-program finish
    topk_invisible_in_kernel: bool = False  # pallas_radix, "set" order: the kernel writes -1 for invisible (-inf)
    #                                  keys, so no gather of the kept values follows it (one XLA kernel fewer)
    topk_lengths: bool = True  # pallas_radix: each token's n_visible goes to the kernel as its row's -inf tail
    #                            (topk_select's ``lengths``), so the split prefilter spreads a short request's keys
    #                            over its programs and skips the tail. Without it a short request's candidates all
    #                            land in its first split, and a batch holding a request of 3000 or 6000 tokens
    #                            ran the top-k's kernels twice as long as a full one; with it, the 6000-token batch
    #                            was level and full batches level or slightly slower (H200 timeline,
    #                            archive/topk_knobs_lengths_h200_2026-12-05.json; with today's config on an H100:
    #                            archive/topk_knobs_fine_h100_2026-12-05.json, topk_knobs_spec_h100_2026-12-05.json)
    # Why "set" and None by default: on the H200 both were at least as fast as "sorted" / 1 at every measured
    # k = 2048 shape, full and mixed batches (archive/kernels_sparse_indexer_h200_2026-12-02.json, rows
    # ..._pallas_radix_set and ..._split*_set; archive/kernels_select_h200_2026-12-02_partial.json), within a few
    # percent at 64 x 32K

    def __post_init__(self) -> None:
        for name in ("queries_per_cta", "tiles_per_cta", "num_buffers", "max_logits_bytes", "topk_segment",
                     "topk_splits"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                none = "" if name in ("num_buffers", "max_logits_bytes") else " or None"
                raise ValueError(f"{name} must be an int{none}, got {v!r}")
        for name in ("topk_split_finish", "topk_invisible_in_kernel", "topk_lengths"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.queries_per_cta is not None and not 1 <= self.queries_per_cta <= 4:
            raise ValueError(f"queries_per_cta must be in 1..4, got {self.queries_per_cta}")
        if self.tiles_per_cta is not None and self.tiles_per_cta < 1:
            raise ValueError(f"tiles_per_cta must be >= 1, got {self.tiles_per_cta}")
        if self.num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {self.num_buffers}")
        if self.max_logits_bytes < 4 * TILE:
            raise ValueError(f"max_logits_bytes must be >= {4 * TILE}, got {self.max_logits_bytes}")
        if self.topk_segment is not None and self.topk_segment < 1:
            raise ValueError(f"topk_segment must be >= 1, got {self.topk_segment}")
        if self.topk_algorithm not in TOPK_ALGORITHMS:
            raise ValueError(f"topk_algorithm must be one of {TOPK_ALGORITHMS}, got {self.topk_algorithm!r}")
        if self.topk_order not in TOPK_ORDERS:
            raise ValueError(f"topk_order must be one of {TOPK_ORDERS}, got {self.topk_order!r}")
        sp = self.topk_splits
        if sp is not None and (isinstance(sp, bool) or not isinstance(sp, int) or sp < 1 or sp & (sp - 1)):
            raise ValueError(f"topk_splits must be a power of 2 or None, got {sp!r}")
        if self.key_source not in ("auto", "paged", "views", "gathered"):
            raise ValueError(f"key_source must be auto, paged, views or gathered, got {self.key_source!r}")


def default_config() -> IndexerKernelConfig:
    """The config used when none is passed. Another key source or top-k algorithm in the layers goes
    through their constructors (``Decoder(..., indexer_config=IndexerKernelConfig(...))``)."""
    return IndexerKernelConfig()


def supports(fmt: object, head_dim: int = HEAD_DIM) -> bool:
    """Whether the kernel handles this indexer cache format (else callers use the XLA path)."""
    if not isinstance(fmt, IndexerRecord132) or fmt.dim != HEAD_DIM or head_dim != HEAD_DIM:
        return False
    e = fmt.entries_per_page
    return e % 32 == 0 and (TILE % e == 0 or e % TILE == 0)


# ----- query side ---------------------------------------------------------------------------------
def quantize_q(index_q: jax.Array, index_w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dequantised indexer q [T, Hi, 128] (q8 * power-of-two scale) and folded weights [T, Hi] ->
    (q8 e4m3 [T, Hi, 128], w' = w * s_q fp32 [T, Hi]).

    Re-quantising q8 * s with UE8M0 returns s or s/2 (the latter when |q8| <= 224 everywhere), and
    2 * q8 is exact in e4m3, so q8' * s' == q exactly: the kernel scores the same real numbers.
    """
    q8, s = act_quant(index_q.astype(jnp.float32), HEAD_DIM, "ue8m0", 1e-4)
    return q8, index_w.astype(jnp.float32) * s[..., 0]


# ----- group metadata ----------------------------------------------------------------------------
def _group_metadata(req_idx: jax.Array, n_visible: jax.Array, g: int, n_groups: int) -> jax.Array:
    """Split the tokens into groups of <= g consecutive tokens of one request row.

    Returns int32 [4, n_groups]: first token, token count (0 = empty group), request row, max visible.
    Groups follow token order, so each group ends where the next begins (empty groups sit at the end
    with first token = T). One scatter for g > 1; elementwise for g = 1.
    """
    t = req_idx.shape[0]
    req_idx = req_idx.astype(jnp.int32)
    n_visible = n_visible.astype(jnp.int32)
    if g == 1:
        assert n_groups == t
        return jnp.stack([jnp.arange(t, dtype=jnp.int32), jnp.ones((t,), jnp.int32), req_idx, n_visible])
    ar = jnp.arange(t, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones((1,), bool), req_idx[1:] != req_idx[:-1]])
    run_start = lax.cummax(jnp.where(new_run, ar, 0))
    starts = ((ar - run_start) % g) == 0
    gid = jnp.cumsum(starts.astype(jnp.int32)) - 1  # < n_groups when request rows are contiguous
    tok0 = jnp.full((n_groups,), t, jnp.int32).at[jnp.where(starts, gid, n_groups)].set(ar, mode="drop")
    ntok = jnp.concatenate([tok0[1:], jnp.full((1,), t, jnp.int32)]) - tok0
    safe = jnp.minimum(tok0, t - 1)
    req = req_idx[safe]
    vis = jnp.zeros((n_groups,), jnp.int32)
    for i in range(g):
        vis = jnp.maximum(vis, jnp.where(i < ntok, n_visible[jnp.minimum(tok0 + i, t - 1)], 0))
    return jnp.stack([tok0, ntok, req, vis])


def _choose_g(t: int, r: int) -> int:
    if t <= r:
        return 1
    return 2 if t <= 2 * r else 4


def _q_padding(t: int, hi: int, r: int, config: IndexerKernelConfig) -> tuple[int, int, int]:
    """(rows, padded heads, tokens per group g) of the q the kernel reads: [T + g, hp, 128] where a group holds
    g > 1 tokens (its g rows are read from any first token; rows past T are zeros, never stored); [T, hp, 128] for
    one token a group (a group's row is its token's, always below T)."""
    hp = -(-hi // 64) * 64
    # g accumulators of [64, hp] fp32 live in registers at once: keep g * hp <= 256 (128 regs / thread)
    g = max(1, min(config.queries_per_cta or _choose_g(t, r), 256 // hp))
    return (t if g == 1 else t + g), hp, g


def logits_q_shape(t: int, hi: int, requests: int, config: IndexerKernelConfig | None = None) -> tuple[int, int]:
    """(rows, heads) of the q8 / w that ``paged_logits`` reads for T tokens of ``hi`` heads over ``requests``
    block-table rows: a caller that quantises q can pad its input to them (zeros), so that the padding is part of
    the quantisation's fusion instead of a copy of q8 of its own."""
    rows, hp, _ = _q_padding(t, hi, requests, config or default_config())
    return rows, hp


# ----- the kernel ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    g: int  # tokens per group
    hp: int  # padded heads
    epp: int  # entries per page
    nb: int  # pages in the pool
    nblk: int  # block-table width
    n_tiles: int  # 64-key tiles per row (output columns / 64)
    tpc: int  # tiles per CTA
    n_splits: int
    n_groups: int
    nbuf: int
    mode: str  # key source: "paged" | "views" | "gathered"

    @property
    def rows_pp(self) -> int:  # 128-byte rows per page
        return self.epp * 132 // 128

    @property
    def ppt(self) -> int:  # pages per tile (a gathered "page" is one tile)
        return 1 if self.mode == "gathered" else max(1, TILE // self.epp)


def _logits_kernel(plan: _Plan, t_rows: int, interpret: plgpu.InterpretGPUParams | None):
    p = plan
    g_, hp, epp, ppt, nbuf = p.g, p.hp, p.epp, p.ppt, p.nbuf
    keys_per_copy = TILE // ppt
    srows_per_copy = 2 // ppt  # 64 keys * 4 B = 2 rows of 128 B
    swz = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    swz1 = (plgpu.TilingTransform((1, 128)), plgpu.SwizzleTransform(128))
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    def body(meta_ref, nvis_ref, bt_ref, q_ref, w_ref, kv_ref, ks_ref, out_ref, scratch):
        (k_u8, s_u8, k_f8, s_f32), q_s, w_s, o_s, kbar, qbar = scratch
        grp = lax.axis_index("group")
        split = lax.axis_index("split")
        tok0 = meta_ref[0, grp]
        ntok = meta_ref[1, grp]
        req = meta_ref[2, grp]
        maxvis = meta_ref[3, grp]
        nvis = [nvis_ref[tok0 + i] for i in range(g_)]
        tile0 = split * p.tpc
        # tiles this CTA owns (>= 1 by the grid); an empty group (ntok = 0) writes nothing
        n_here = jnp.where(ntok > 0, jnp.minimum(p.tpc, p.n_tiles - tile0), 0)
        n_vis_tiles = (maxvis + (TILE - 1)) // TILE
        n_comp = jnp.clip(n_vis_tiles - tile0, 0, n_here)  # tiles with a visible key

        def issue(step):
            slot = lax.rem(step, nbuf)
            tile = tile0 + step
            if p.mode == "gathered":  # contiguous [request, tile] key blocks
                plgpu.copy_gmem_to_smem(kv_ref.at[req * p.n_tiles + tile], k_f8.at[slot], kbar.at[slot])
                plgpu.copy_gmem_to_smem(ks_ref.at[req * p.n_tiles + tile], s_f32.at[slot], kbar.at[slot])
                return
            for i in range(ppt):
                key = tile * TILE + i * keys_per_copy
                col = jnp.minimum(key // epp, p.nblk - 1)
                page = jnp.clip(bt_ref[req, col], 0, p.nb - 1)
                off = lax.rem(key, epp)
                if p.mode == "paged":
                    plgpu.copy_gmem_to_smem(kv_ref.at[page, pl.ds(off, keys_per_copy)],
                                            k_u8.at[slot, pl.ds(i * keys_per_copy, keys_per_copy)], kbar.at[slot])
                    plgpu.copy_gmem_to_smem(ks_ref.at[page, pl.ds(epp + off // 32, srows_per_copy)],
                                            s_u8.at[slot, pl.ds(i * srows_per_copy, srows_per_copy)], kbar.at[slot])
                else:
                    plgpu.copy_gmem_to_smem(kv_ref.at[page, pl.ds(off, keys_per_copy)],
                                            k_f8.at[slot, pl.ds(i * keys_per_copy, keys_per_copy)], kbar.at[slot])
                    plgpu.copy_gmem_to_smem(ks_ref.at[page, pl.ds(epp * 32 + off, keys_per_copy)],
                                            s_f32.at[slot, pl.ds(i * keys_per_copy, keys_per_copy)], kbar.at[slot])

        # the group's queries and weights (rows past the group belong to other tokens: never stored)
        @pl.when(n_comp > 0)
        def _load_q():
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(tok0, g_)], q_s, qbar.at[0])
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(tok0, g_)], w_s, qbar.at[0])

        @pl.loop(0, jnp.minimum(n_comp, nbuf))
        def _prologue(step):
            issue(step)

        @pl.when(n_comp > 0)
        def _wait_q():
            plgpu.barrier_wait(qbar.at[0])

        def store(ob, tile):
            plgpu.commit_smem()
            for i in range(g_):
                @pl.when(i < ntok)
                def _store_row():
                    row = jnp.minimum(tok0 + i, t_rows - 1)  # rows < tok0 + ntok <= T
                    plgpu.copy_smem_to_gmem(o_s.at[ob, i], out_ref.at[row, pl.ds(tile * TILE, TILE)],
                                            commit_group=False)
            plgpu.commit_smem_to_gmem_group()

        @pl.loop(0, n_here)
        def _tiles(step):
            tile = tile0 + step
            ob = lax.rem(step, 2)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # o_s[ob] is free again
            kid = tile * TILE + plgpu.broadcasted_iota(jnp.int32, (TILE,), 0, layout=row_layout)

            @pl.when(step < n_comp)
            def _compute():
                slot = lax.rem(step, nbuf)
                plgpu.barrier_wait(kbar.at[slot])

                def mma_epilogue(*accs):
                    # all g MMAs unconditionally (an in-flight accumulator must not cross an scf.if);
                    # only the epilogues of the group's real tokens run
                    for i in range(g_):
                        plgpu.wgmma(accs[i], k_f8.at[slot], q_s.at[i].T)
                    plgpu.wgmma_wait(0)
                    scale = plgpu.load(s_f32.at[slot], layout=row_layout)

                    @pl.when(step + nbuf < n_comp)
                    def _refill():  # the slot's keys and scales are consumed
                        # every thread's generic read of the scales before the copy's async-proxy write of
                        # the slot: a proxy fence and the warpgroup's barrier (one thread issues the copy)
                        plgpu.commit_smem()
                        issue(step + nbuf)

                    for i in range(g_):
                        @pl.when(i < ntok)
                        def _epilogue():
                            w = plgpu.load(w_s.at[i], layout=col_layout)
                            r = jnp.maximum(accs[i][...], 0.0) * lax.broadcast_in_dim(w, (TILE, hp), [1])
                            row = jnp.sum(r, axis=1) * scale
                            o_s[ob, i] = jnp.where(kid < nvis[i], row, -jnp.inf)

                pl.run_scoped(mma_epilogue, *[plgpu.ACC((TILE, hp), jnp.float32) for _ in range(g_)])
                store(ob, tile)

            @pl.when(step >= n_comp)
            def _masked():
                ninf = plgpu.layout_cast(jnp.full((TILE,), -jnp.inf, jnp.float32), row_layout)
                for i in range(g_):
                    o_s[ob, i] = ninf
                store(ob, tile)

        plgpu.wait_smem_to_gmem(0)

    u8_keys = plgpu.SMEM((nbuf, TILE, 1, 128), jnp.uint8, transforms=swz1)
    u8_scl = plgpu.SMEM((nbuf, 2, 1, 128), jnp.uint8)
    f8_keys = plgpu.SMEM((nbuf, TILE, 128), FP8, transforms=swz)
    f32_scl = plgpu.SMEM((nbuf, TILE), jnp.float32)
    if p.mode == "paged":
        # group 0 is written by TMA, group 1 read by wgmma / load: same offsets (see module doc)
        keys_scratch = plgpu.RefUnion((u8_keys, u8_scl), (f8_keys, f32_scl))
    else:
        keys_scratch = (None, None, f8_keys, f32_scl)
    scratch = (
        keys_scratch,
        plgpu.SMEM((g_, hp, 128), FP8, transforms=swz),
        plgpu.SMEM((g_, hp), jnp.float32),
        plgpu.SMEM((2, g_, TILE), jnp.float32),
        plgpu.Barrier(num_arrivals=2 * ppt, num_barriers=nbuf),
        plgpu.Barrier(num_arrivals=2, num_barriers=1),
    )

    def entry(*refs):
        def scoped(keys, *rest):
            if p.mode == "paged":
                (k_u8, s_u8), (k_f8, s_f32) = keys
                keys = (k_u8, s_u8, k_f8, s_f32)
            body(*refs, (keys, *rest))

        pl.run_scoped(scoped, *scratch)

    kw = {} if interpret is None else {"interpret": interpret}
    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((t_rows, p.n_tiles * TILE), jnp.float32),
        grid=(p.n_groups, p.n_splits),
        grid_names=("group", "split"),
        **kw,
    )


def paged_logits(q8: jax.Array, w: jax.Array, cache: jax.Array, block_tables: jax.Array, req_idx: jax.Array,
                 n_visible: jax.Array, *, entries_per_page: int, config: IndexerKernelConfig | None = None,
                 interpret: bool | plgpu.InterpretGPUParams | None = None) -> jax.Array:
    """One kernel launch: q8 [T, Hi, 128] e4m3, w [T, Hi] fp32 (= w * s_q), cache uint8 [pages, epp*132],
    block_tables [R, nblk], req_idx [T], n_visible [T] -> logits fp32 [T, ceil(nblk*epp / 64) * 64]
    (-inf at invisible keys and at the padding columns). q8 / w may come with the rows and heads the kernel reads
    (``logits_q_shape``: zeros past T and Hi), else they are padded here; T is req_idx's length.

    The tokens of one request row must be contiguous (as ``jds.batch.PagedBatch`` lays them out, padding
    last): the grid holds ceil(T / G) + R + 1 groups, and rows of groups beyond that would stay unwritten.
    ``interpret``: GPU interpret mode (True, or an ``InterpretGPUParams``: e.g. its race detector).
    """
    interpret = mosaic_interpret(interpret)  # None: native; else interpret mode's parameters
    config = config or default_config()
    epp = entries_per_page
    t = req_idx.shape[0]
    _, hi, d = q8.shape
    if d != HEAD_DIM:
        raise ValueError(f"indexer head dim must be {HEAD_DIM}, got {d}")
    if hi > 256:
        raise ValueError(f"at most 256 indexer heads, got {hi}")
    if not supports(IndexerRecord132(epp)):
        raise ValueError(f"entries_per_page={epp} unsupported (multiple of 32 dividing or divided by 64)")
    nb = cache.shape[0]
    if cache.dtype != jnp.uint8 or cache.shape[1] != epp * 132:
        raise ValueError(f"cache must be uint8 [pages, {epp * 132}], got {cache.dtype}{cache.shape}")
    r, nblk = block_tables.shape
    n_cols = nblk * epp
    n_tiles = -(-n_cols // TILE)
    rows, hp, g = _q_padding(t, hi, r, config)
    if q8.shape[0] not in (t, rows) or w.shape != (q8.shape[0], hi) or n_visible.shape != (t,):
        raise ValueError(f"q8 must have T = {t} rows (req_idx's) or {rows} (``logits_q_shape``), w the same rows and "
                         f"n_visible T: got q8 {q8.shape}, w {w.shape}, n_visible {n_visible.shape}")
    n_groups = t if g == 1 else max(1, min(t, -(-t // g) + r + 1))
    if g > 1 and not isinstance(req_idx, jax.core.Tracer):  # eager callers: check the contiguity contract
        ri = np.asarray(req_idx)
        if t and 1 + int((ri[1:] != ri[:-1]).sum()) > r + 1:
            raise ValueError("tokens of a request row must be contiguous in req_idx (padding last)")
    tpc = config.tiles_per_cta
    if tpc is None:
        # about two CTAs' worth of work per SM and wave, at most 32 tiles (256 KiB of keys) per CTA
        tpc = int(np.clip((n_groups * n_tiles) // (2 * num_sms()), 1, 32))
    tpc = min(tpc, n_tiles)
    n_splits = -(-n_tiles // tpc)
    mode = config.key_source
    if mode == "auto":
        mode = "views" if interpret is not None else "paged"
    if mode == "views" and interpret is None:
        raise ValueError("key_source='views' is for interpret mode (its GMEM view breaks Mosaic's TMA tiling rule)")
    plan = _Plan(g=g, hp=hp, epp=epp, nb=nb, nblk=nblk, n_tiles=n_tiles, tpc=tpc, n_splits=n_splits,
                 n_groups=n_groups, nbuf=min(config.num_buffers, tpc), mode=mode)

    meta = _group_metadata(req_idx, n_visible, g, n_groups)
    nvis = jnp.pad(n_visible.astype(jnp.int32), (0, rows - t))  # a group's g tokens' from its first (empty: T)
    pad_rows = rows - q8.shape[0]  # 0 where the caller made q8 with the rows the kernel reads (``logits_q_shape``)
    qp, wp = q8.astype(FP8), w.astype(jnp.float32)
    if pad_rows or hp != hi:
        qp = jnp.pad(qp, ((0, pad_rows), (0, hp - hi), (0, 0)))
        wp = jnp.pad(wp, ((0, pad_rows), (0, hp - hi)))
    rows_pp = plan.rows_pp
    if mode == "paged":
        kv = cache.reshape(nb, rows_pp, 1, 128)  # free reshape: pages of 128-byte rows
        ks = kv
    elif mode == "views":  # XLA bitcasts (copies of the pool): interpret mode / debugging only
        kv = lax.bitcast_convert_type(cache, FP8).reshape(nb, rows_pp, 128)
        ks = lax.bitcast_convert_type(cache.reshape(nb, epp * 33, 4), jnp.float32)
    else:
        kv, ks = gather_keys(cache, block_tables, epp, n_tiles)
    call = _logits_kernel(plan, t, interpret)
    return call(meta, nvis, block_tables.astype(jnp.int32), qp, wp, kv, ks)


def gather_keys(cache: jax.Array, block_tables: jax.Array, epp: int, n_tiles: int) -> tuple[jax.Array, jax.Array]:
    """The "gathered" key source: every request's first n_tiles * 64 keys copied (one XLA gather fusion)
    into contiguous e4m3 [R * n_tiles, 64, 128] values and fp32 [R * n_tiles, 64] scales."""
    nb = cache.shape[0]
    r, nblk = block_tables.shape
    j = jnp.arange(n_tiles * TILE, dtype=jnp.int32)
    page = jnp.clip(block_tables[:, jnp.minimum(j // epp, nblk - 1)], 0, nb - 1)  # [R, n_tiles * 64]
    off = j % epp
    vals = cache[:, : epp * 128].reshape(nb, epp, 128)[page, off]  # [R, n, 128] uint8
    scl = cache[:, epp * 128:].reshape(nb, epp, 4)[page, off]  # [R, n, 4] uint8
    kv = lax.bitcast_convert_type(vals, FP8).reshape(r * n_tiles, TILE, 128)
    ks = lax.bitcast_convert_type(scl, jnp.float32).reshape(r * n_tiles, TILE)
    return kv, ks


# the XLA logits (reference of the kernel): jds.ops.indexer.masked_index_logits (this name is kept for the tests)
xla_logits = masked_index_logits


def resolve_topk_algorithm(rows: int, cols: int, backend: str | None = None) -> str:
    """What ``topk_algorithm="auto"`` runs for a [rows, cols] logits block: on the GPU the row-in-registers select
    (``pallas_kernels.topk_rows``) for rows of up to ``AUTO_ROWS_TOPK_COLS`` columns, else the Pallas radix select
    from ``AUTO_PALLAS_TOPK_ELEMS`` elements and ``lax.top_k`` below; ``lax.top_k`` off the GPU (where the kernels
    would only run interpreted).

    Why the rows' limit: on an H100 (``benchmarks/results/archive/topk_small_rows_h100_2026-12-07.json``, the
    indexer's set order, GPU timeline) the row select beat both others at every shape measured with 4160-16448
    columns (1 to 1024 rows, k = 512 and 2048); above it a row's keys no longer fit the registers
    (``topk_rows.MAX_COLS``).

    Why the elements' threshold: on the H200 at k = 2048 the Pallas radix select beats ``lax.top_k`` at every shape
    measured from 1M logits (``benchmarks/results/kernels_sparse_indexer_*.json``, rows ``topk_k2048_b*_c*``
    against ``..._pallas_radix*``), and at 16 x 32K (512K logits) in the indexer's unsorted order with
    ``select_config_for``'s split config (``topk_knobs_h200_*.json``, GPU timeline); below that it is unmeasured.
    Both give the same indices (in the same order when sorted).

    Why it is the default (since 2026-12-01): the decode select (logits + top-k, ``kernels_select_h200_*.json``,
    rows ``decode_select_*_auto`` against the lax rows) was faster with "auto" at every point from 512K logits
    (16 x 32K since the eleventh session's run), and from 1M logits a mixed batch (one request of 1000 tokens
    among full rows: its row is mostly -inf) was no slower than the full one, because the kernel's short-row paths
    no longer read such a row twice (at 16 x 32K the pipelined medians were too noisy to tell: docs/perf-log.md).
    """
    backend = backend or jax.default_backend()
    if backend != "gpu":
        return "lax"
    if cols <= AUTO_ROWS_TOPK_COLS:
        return "pallas_rows"
    return "pallas_radix" if rows * cols >= AUTO_PALLAS_TOPK_ELEMS else "lax"


def topk_from_logits(logits: jax.Array, k: int, segment: int | None = None,
                     algorithm: TopkAlgorithm = "lax", order: TopkOrder = "sorted",
                     splits: int | None = 1, split_finish: bool = True,
                     invisible_in_kernel: bool = False, lengths: jax.Array | None = None) -> jax.Array:
    """lax.top_k of rows already -inf at invisible keys: int32 [T, k], -1 where fewer are visible.

    ``order="set"``: the same keys, in any order (``"pallas_radix"`` then returns them in ascending key order,
    without its sort of the k winners; the other algorithms sort anyway; rows of at most k keys keep every key, in
    column order, without a selection). The -1 entries are wherever the invisible keys fall, not necessarily at the
    end (the sparse MQA masks each entry).

    ``algorithm="radix"``: ``jds.ops.select.radix_topk`` (counting passes instead of a sort), identical
    output; ``"pallas_radix"``: the same selection as a Pallas kernel (``pallas_kernels.topk_select``,
    GPU interpret mode off-GPU), identical output; ``"pallas_rows"``: ``pallas_kernels.topk_rows`` (a row held
    in registers, for k a large part of short rows; the same set, in ascending key order unless sorted);
    ``"auto"``: ``resolve_topk_algorithm``. ``segment``
    applies to ``"lax"`` only, ``splits``, ``split_finish`` and ``invisible_in_kernel`` (``IndexerKernelConfig``'s
    ``topk_splits`` / ``topk_split_finish`` / ``topk_invisible_in_kernel``) to ``"pallas_radix"`` only, the last
    one with ``order="set"``: the kernel marks the invisible keys itself (``minus_one_for_neg_inf``), so the kept
    values are never gathered. ``lengths`` (int32 [T], ``"pallas_radix"`` only; the others read whole rows): each row
    is -inf from that column on (``topk_select``'s hint).

    Tie rule: among equal scores the lower key index wins (lax.top_k's order). With ``segment``, a
    two-stage selection: top-k of each segment of ``segment`` keys, then top-k of the concatenated winners
    (in segment order). The result is the same set and order: the global top-k lies in the union of the
    segments' top-k, and equal scores keep ascending key order in both stages.
    """
    t, n = logits.shape
    kk = min(k, n)
    if kk == n and order == "set":  # every key is kept (short contexts): no selection to run, in any algorithm
        return visible_topk_indices(logits, jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (t, n)), k)
    if algorithm == "auto":  # an explicit segment asks for the two-stage lax selection
        algorithm = "lax" if segment is not None else resolve_topk_algorithm(t, n)
    if algorithm == "radix":
        vals, idx = radix_topk(logits, kk)
    elif algorithm == "pallas_radix":
        cfg = (select_config_for(t, n, split_finish=split_finish) if splits is None
               else TopkSelectConfig(splits=splits))
        if invisible_in_kernel and order == "set":
            idx = select_unsorted(logits, kk, config=dataclasses.replace(cfg, minus_one_for_neg_inf=True),
                                  lengths=lengths)[0]
            return jnp.pad(idx, ((0, 0), (0, k - kk)), constant_values=-1) if kk < k else idx
        vals, idx = topk_select(logits, kk, sort=order == "sorted", config=cfg, lengths=lengths)
    elif algorithm == "pallas_rows":
        vals, idx = topk_rows(logits, kk)
        if order == "sorted":  # values descending, equal values by ascending key (lax.top_k's order)
            vals, j = lax.top_k(vals, kk)
            idx = jnp.take_along_axis(idx, j, axis=1)
    elif segment is None or n <= segment or segment < kk:
        vals, idx = lax.top_k(logits, kk)
    else:
        ns = -(-n // segment)
        x = jnp.pad(logits, ((0, 0), (0, ns * segment - n)), constant_values=-jnp.inf).reshape(t, ns, segment)
        v1, i1 = lax.top_k(x, kk)  # [t, ns, kk]
        i1 = (i1 + segment * jnp.arange(ns, dtype=jnp.int32)[:, None]).reshape(t, ns * kk)
        vals, j = lax.top_k(v1.reshape(t, ns * kk), kk)
        idx = jnp.take_along_axis(i1, j, axis=1)
    return visible_topk_indices(vals, idx, k)


def indexer_topk(index_q: jax.Array, index_w: jax.Array, cache: jax.Array, fmt, block_tables: jax.Array,
                 req_idx: jax.Array, n_visible: jax.Array, k: int, *, implementation: Implementation = "pallas",
                 config: IndexerKernelConfig | None = None, interpret: bool | None = None,
                 index_q_scale: jax.Array | None = None) -> jax.Array:
    """Top-k request-local key indices [T, k] int32 (-1 padded) among each token's first n_visible keys.

    index_q [T, Hi, 128] and index_w [T, Hi] as the layers prepare them: float q (``prepare_indexer_q``), or e4m3
    q with its float32 scales [T, Hi] in ``index_q_scale`` (``prepare_indexer_q8``: the kernel scores those bytes;
    a float q is quantised for it with UE8M0 scales, exact for a q that is e4m3 times a power of two).
    Tokens are processed in chunks whose fp32 logits fit ``config.max_logits_bytes``.
    ``implementation="pallas"`` needs an FP8 ``IndexerRecord132`` cache (see ``supports``); ``"auto"`` runs
    the XLA implementation (``jds.ops.indexer.indexer_topk_xla``) for other caches.
    """
    k = _check_inputs(index_q, index_w, cache, fmt, block_tables, req_idx, n_visible, k, config, index_q_scale)
    config = config or default_config()
    args = (index_w, cache, fmt, block_tables, req_idx, n_visible, k)
    real_q = (lambda: index_q) if index_q_scale is None else (lambda: dequant_index_q(index_q, index_q_scale))
    return run_op("indexer_topk", implementation, {
        # the XLA workspace: each chunk's gathered fp32 keys plus its logits
        "xla": lambda: indexer_topk_xla(real_q(), *args, max_workspace_bytes=config.max_logits_bytes),
        "pallas": lambda: _indexer_topk_pallas(index_q, *args, config=config, interpret=interpret,
                                               q_scale=index_q_scale)})


def _check_inputs(index_q, index_w, cache, fmt, block_tables, req_idx, n_visible, k, config,
                  index_q_scale=None) -> int:
    """Input errors of every implementation (ValueError naming the argument; static shapes and dtypes only).
    Returns ``k`` as an int."""
    check_array("index_q", index_q, (("T", None), ("Hi", None), ("D", None)), "float")
    t, hi, d = index_q.shape
    check_array("index_w", index_w, (("T", t), ("Hi", hi)), "float")
    if index_q_scale is not None:
        check_array("index_q_scale", index_q_scale, (("T", t), ("Hi", hi)), "float")
        if jnp.dtype(index_q.dtype) != jnp.dtype(FP8):
            raise ValueError(f"index_q must be float8_e4m3fn where index_q_scale is given, got {describe(index_q)}")
    width = check_cache("cache", cache, fmt, "fmt")
    if width != d:
        raise ValueError(f"index_q head dim D = {d} must equal the key width {width} of fmt = {fmt}")
    check_array("block_tables", block_tables, (("R", None), ("max_blocks", None)), "int")
    if min(block_tables.shape) < 1:
        raise ValueError(f"block_tables must have at least one request row and one block column, got "
                         f"{describe(block_tables)}")
    check_array("req_idx", req_idx, (("T", t),), "int")
    check_array("n_visible", n_visible, (("T", t),), "int")
    if config is not None and not isinstance(config, IndexerKernelConfig):
        raise ValueError(f"config must be an IndexerKernelConfig or None, got {config!r}")
    return check_int("k", k, 1)


def _indexer_topk_pallas(index_q, index_w, cache, fmt, block_tables, req_idx, n_visible, k, *, config, interpret,
                         q_scale=None):
    if not supports(fmt, index_q.shape[-1]):
        raise Unsupported(f"the Pallas indexer kernel does not support {fmt} (see supports)")
    t = index_q.shape[0]
    if t == 0:  # no tokens: no kernel (an empty grid)
        return jnp.zeros((0, k), jnp.int32)
    n_cols = block_tables.shape[1] * fmt.entries_per_page
    width = -(-n_cols // TILE) * TILE
    chunk = max(1, config.max_logits_bytes // (4 * width))
    if t <= chunk:  # one launch: q padded to the rows / heads it reads ahead of its quantisation (one fusion)
        rows, hp = logits_q_shape(t, index_q.shape[1], block_tables.shape[0], config)
        if (rows, hp) != index_q.shape[:2]:
            pads = ((0, rows - t), (0, hp - index_q.shape[1]))
            index_q = jnp.pad(index_q, (*pads, (0, 0)))
            index_w = jnp.pad(index_w, pads)
            q_scale = None if q_scale is None else jnp.pad(q_scale, pads)
    # the FP8 q as the model quantised it, its scale folded into the weights (exact: the scores' real numbers)
    q8, w8 = (quantize_q(index_q, index_w) if q_scale is None
              else (index_q, index_w.astype(jnp.float32) * q_scale.astype(jnp.float32)))

    def fn(q, w, r, nv):
        lg = paged_logits(q, w, cache, block_tables, r, nv, entries_per_page=fmt.entries_per_page,
                          config=config, interpret=interpret)
        return topk_from_logits(lg, k, config.topk_segment, config.topk_algorithm, config.topk_order,
                                config.topk_splits, config.topk_split_finish, config.topk_invisible_in_kernel,
                                nv if config.topk_lengths else None)

    return map_token_chunks(fn, t, chunk, (q8, w8, req_idx, n_visible), (0, 0, 0, 0))


@functools.partial(jax.jit, static_argnames=("fmt", "k", "implementation", "config", "interpret"))
def indexer_topk_jit(index_q, index_w, cache, fmt, block_tables, req_idx, n_visible, k, implementation="pallas",
                     config=None, interpret=None, index_q_scale=None):
    """jit wrapper of ``indexer_topk`` (benchmarks, tests)."""
    return indexer_topk(index_q, index_w, cache, fmt, block_tables, req_idx, n_visible, k,
                        implementation=implementation, config=config, interpret=interpret,
                        index_q_scale=index_q_scale)
