"""Benchmarks of the paged FP8 indexer logits kernel and the indexer top-k (issue 7), each against the
XLA implementation in the same run. Driven by ``python -m jds.bench.kernels`` (``--only sparse_indexer``).

Cases (full run; ``quick`` uses tiny shapes and few iterations, e.g. to smoke-test on the CPU):
- decode_logits / decode_select: batch B in {1, 16, 64} x context C in {4K, 32K, 128K}, one token per
  request at position C - 1 (all C keys visible), 64 heads, 64-entry pages shuffled in the pool.
  *_logits = the logits alone; *_select = logits + top-2048 (``indexer_topk``, what ``select`` runs).
- select (only when asked for; ``select_split``: only its ``_auto`` and ``_set_split*`` rows): decode_select at
  B in {16, 64} x C in {32K, 128K} with
  ``topk_algorithm="auto"`` (``_auto``, the default; field ``topk``: what it resolved to), with
  ``lax.top_k`` (no suffix), and XLA; ``_set``: ``topk_algorithm="pallas_radix"`` with ``topk_order="set"`` (no sort of
  the k winners), one program per row; ``_set_split``: that with the indexer's split config (``select_config_for``)
  and the one-program finish; ``_set_split_sf``: with its split finish (``topk_split_finish``, the default since
  2026-12-05); ``_set_split_inv``: the indexer's config with the invisible keys marked by the kernel
  (``topk_invisible_in_kernel``: no gather of the kept values);
  ``_mixed``: the same batch with one request of 1000 tokens.
- prefill_select: one request, a chunk of Q in {1K, 4K, 8K} queries at positions C-Q..C-1 over
  C in {8K, 32K, 64K} (Q <= C), causal; logits bounded by the 512 MiB default workspace (pallas) and an
  8 GiB workspace for the XLA path (its gathered fp32 keys are 129x the logits).
- prefill_logits: the kernel alone on a 1K-query chunk (XLA only where its [Q, C, 128] fp32 gather fits).
- topk: ``lax.top_k`` (k = 2048) alone over [B, C] logits rows, with ``bytes`` = one read of the logits,
  so ``bandwidth_frac`` says how close top-k gets to reading its input once (issue target: >= 0.5 at
  B = 64, C = 64K); ``_seg*`` rows: the exact two-stage variant (``IndexerKernelConfig.topk_segment``);
  ``_radix*``: jds.ops.select in XLA; ``_pallas_radix``: the same selection as a Pallas kernel
  (pallas_kernels/topk_select.py, default config: sampled-pivot prefilter), ``_pallas_radix_set``: the same
  without the sort of the k winners, ``_pallas_radix_direct``: that kernel without the prefilter; ``_mixed``:
  row 0 holds 1000 finite logits and -inf after them (lax and the two radix rows), against the full batch;
  ``_pallas_radix_split*_set``: the unsorted select with its prefilter split over ``split_for(B, C)`` programs
  and no other knob; ``_pallas_radix_indexer_set``: the config the indexer runs (``select_config_for``: that split
  with its measured loop knobs), where it splits; every top-k row also records the GPU timeline (one-knob rows:
  scripts/diag/topk_knobs.py).
- topk_pallas: the topk rows without the XLA radix, ``_seg*`` and ``_pallas_radix_direct`` rows (all six shapes fit
  one 10-minute call).

``bytes`` / ``flops`` are the kernel's own model for both implementations (so the fractions compare):
FP8 key bytes read once per query group (132 B per key and group, groups of G tokens), the fp32 logits
written once (select adds the top-k's read of them), 2 * 64 * 128 FLOPs per visible (token, key) pair.
"""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jds.ops.indexer import dequant_index_q
from jds.ops.quant import FP8
from jds.ops.records import IndexerRecord132
from jds.ops.select import radix_topk
from pallas_kernels import sparse_indexer as si
from jds.bench.results import error_text
from jds.bench.timing import device_row, profiled_device_us, time_fn
from pallas_kernels.topk_select import TopkSelectConfig, select_config_for, split_for, topk_select

HI = 64
EPP = 64
K = 2048


def _cache(key, n_pages: int) -> jax.Array:
    """Random FP8 key pages (no NaN codes) with power-of-two fp32 scales, laid out as IndexerRecord132."""
    kv, ks = jax.random.split(key)
    vals = jax.random.randint(kv, (n_pages, EPP * 128), 0, 256, jnp.int32).astype(jnp.uint8)
    vals = jnp.where((vals & 0x7F) == 0x7F, vals ^ 0x01, vals)  # 0x7f / 0xff are e4m3 NaN
    scales = jnp.exp2(jax.random.randint(ks, (n_pages, EPP), -10, 0).astype(jnp.float32))
    sbytes = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(n_pages, EPP * 4)
    return jnp.concatenate([vals, sbytes], axis=1)


def _queries(key, t: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q8 e4m3 [t, HI, 128], its power-of-two scales [t, HI], folded weights [t, HI]): the FP8 q as the layers hand
    it to the select (``prepare_indexer_q8``)."""
    kq, kw = jax.random.split(key)
    # clipped to the e4m3 range: an out-of-range value casts to NaN, and a NaN query makes its whole logits
    # row NaN (before 2026-11-29 about 1 row in 20 was; it sent the Pallas top-k to its slow fallback)
    q8 = jnp.clip(jax.random.normal(kq, (t, HI, 128)) * 100, -448, 448).astype(FP8)
    s = jnp.exp2(jax.random.randint(kw, (t, HI), -12, -6).astype(jnp.float32))
    index_w = jax.random.normal(kw, (t, HI), jnp.float32) * (128 ** -0.5) * (HI ** -0.5)
    return q8, s, index_w


def _tables(key, rows: int, width: int) -> tuple[jax.Array, int]:
    nb = rows * width + 1
    return jax.random.permutation(key, nb)[: rows * width].reshape(rows, width).astype(jnp.int32), nb


def _decode_inputs(key, b: int, c: int) -> tuple[jax.Array, ...]:
    """(block tables, cache, q8, q scales, index_w, req_idx) of b decode requests over c-key contexts."""
    k1, k2, k3 = jax.random.split(key, 3)
    bt, nb = _tables(k1, b, c // EPP)
    q8, qs, iw = _queries(k3, b)
    return bt, _cache(k2, nb), q8, qs, iw, jnp.arange(b, dtype=jnp.int32)


def _model(t: int, n_cols: int, vis: np.ndarray, g: int, req: np.ndarray, select: bool) -> tuple[int, int]:
    """(bytes, flops): keys once per group of g consecutive same-request tokens, logits written once."""
    key_reads = 0
    for r in np.unique(req):
        v = vis[req == r]
        key_reads += int(sum(v[i: i + g].max() for i in range(0, len(v), g)))
    logits = 4 * t * n_cols
    nbytes = 132 * key_reads + logits + t * HI * (128 + 4)
    if select:
        nbytes += logits + 4 * t * K
    return nbytes, 2 * HI * 128 * int(vis.sum())


def _row(case: str, impl: str, fn, args, nbytes: int, flops: int, quick: bool, big: bool = False,
         profile: bool = False, **extra) -> dict:
    """One row: the pipelined median, the unrolled device time of short calls, and with ``profile`` the GPU
    timeline's device time per call (``profiled_device_us``: no extra compile; the select rows, whose pipelined
    medians moved by up to 20% between identical configs in one run, docs/perf-log.md)."""
    warm, iters = (1, 3) if quick else ((2, 5) if big else (5, 30))
    r = time_fn(fn, *args, warmup=warm, iters=iters)
    r.update(device_row(fn, *args, median_us=r["median_us"], quick=quick))
    if profile and not quick:
        r.update(profiled_device_us(fn, *args, calls=10 if big else 20))
    return {"kernel": "sparse_indexer", "case": case, "impl": impl, **r, "bytes": nbytes, "flops": flops, **extra}


def benchmark(quick: bool, cases: Sequence[str] | None = None) -> Iterator[dict]:
    """Rows as they are measured. ``cases``: only these sections ("decode", "select", "select_split", "topk",
    "prefill"; "select" and "select_split" run only when asked for)."""
    want = set(cases or ("decode", "topk", "prefill"))
    if not want <= {"decode", "select", "select_split", "topk", "topk_pallas", "prefill"}:
        raise ValueError(f"cases for sparse_indexer are decode / select / select_split / topk / topk_pallas / "
                         f"prefill, got {sorted(want)}")
    lean_topk = "topk_pallas" in want and "topk" not in want  # the top-k rows without the XLA radix / segment rows
    interpret = jax.default_backend() != "gpu"
    fmt = IndexerRecord132(EPP)
    cfg = si.IndexerKernelConfig()
    xla_cfg = si.IndexerKernelConfig(max_logits_bytes=8 << 30)
    key = jax.random.key(0)

    logits_p = jax.jit(functools.partial(si.paged_logits, entries_per_page=EPP, config=cfg, interpret=interpret))
    logits_x = jax.jit(si.xla_logits, static_argnums=3)

    def selector(impl: str, config: si.IndexerKernelConfig):
        def run(q8, qs, iw, cache, bt, req, nvis):  # the layers' FP8 q: e4m3 + scales
            return si.indexer_topk_jit(q8, iw, cache, fmt, bt, req, nvis, K, impl, config, interpret, qs)
        return run

    select_p, select_x = selector("pallas", cfg), selector("xla", xla_cfg)
    topk = jax.jit(si.topk_from_logits, static_argnums=(1, 2, 3))
    radix = jax.jit(radix_topk, static_argnums=(1, 2))
    pallas_radix = {name: jax.jit(functools.partial(topk_select, interpret=interpret, config=c2, sort=srt),
                                  static_argnums=1)
                    for name, c2, srt in (("pallas_radix", None, True), ("pallas_radix_set", None, False),
                                          ("pallas_radix_direct", TopkSelectConfig(capacity=0), True))}

    # ----- decode -----
    decode = [(1, 1024), (4, 1024)] if quick else [(b, c) for b in (1, 16, 64) for c in (4096, 32768, 131072)]
    decode = decode if "decode" in want else []
    for b, c in decode:
        k, key = jax.random.split(key)
        bt, cache, q8, qs, iw, req = _decode_inputs(k, b, c)
        iq, w8 = dequant_index_q(q8, qs), iw * qs
        nvis = jnp.full((b,), c, jnp.int32)
        vis_np, req_np = np.full(b, c), np.arange(b)
        nbytes, flops = _model(b, c, vis_np, 1, req_np, False)
        case = f"decode_logits_b{b}_c{c}"
        yield (_row(case, "pallas", logits_p, (q8, w8, cache, bt, req, nvis), nbytes, flops, quick))
        big_x = b * c * 129 * 4 * 3 > (60 << 30)
        if not big_x:
            yield (_row(case, "xla", logits_x, (iq, iw, cache, fmt, bt, req, nvis), nbytes, flops, quick,
                             big=b * c >= (1 << 21)))
        nbytes, flops = _model(b, c, vis_np, 1, req_np, True)
        case = f"decode_select_b{b}_c{c}"
        args = (q8, qs, iw, cache, bt, req, nvis)
        yield (_row(case, "pallas", select_p, args, nbytes, flops, quick))
        yield (_row(case, "xla", select_x, args, nbytes, flops, quick, big=b * c >= (1 << 21)))
        if (b, c) in ((64, 32768), (64, 131072), (16, 131072)):  # tuning sweep at and beyond the target point
            nbytes, flops = _model(b, c, vis_np, 1, req_np, False)
            # b64 / 32K: the tpc / buffer variants against the default (kernels_sparse_indexer_*.json, rows
            # decode_logits_b64_c32768_tpc*, key bandwidth_frac); the other points say whether a smaller
            # default cap would hold at long context
            sweep = [(f"tpc{tpc}_nbuf{nbuf}", si.IndexerKernelConfig(tiles_per_cta=tpc, num_buffers=nbuf))
                     for tpc, nbuf in ((8, 2), (16, 3), (32, 4), (64, 4))]
            if c == 32768:
                sweep.append(("gathered", si.IndexerKernelConfig(key_source="gathered")))  # fallback key source
            for name, c2 in sweep:
                f = jax.jit(functools.partial(si.paged_logits, entries_per_page=EPP, config=c2, interpret=interpret))
                yield (_row(f"decode_logits_b{b}_c{c}_{name}", "pallas", f,
                                 (q8, w8, cache, bt, req, nvis), nbytes, flops, quick))
        del cache

    # ----- decode logits + top-k with each selection, one run ("auto" against the default lax) -----
    # "select_split" alone: the default and the split configs' rows, without lax.top_k's, the one-program-a-row
    # select's and XLA's (the slow ones: the whole case ran past a 540 s call at 64 x 32K, 2026-12-05)
    split_only = "select_split" in want and "select" not in want
    sel = [(b, c) for b in (16, 64) for c in (32768, 131072)] if want & {"select", "select_split"} and not quick else []
    sel_auto = selector("pallas", si.IndexerKernelConfig(topk_algorithm="auto"))
    sel_lax = selector("pallas", si.IndexerKernelConfig(topk_algorithm="lax"))
    sel_set = selector("pallas", si.IndexerKernelConfig(topk_algorithm="pallas_radix", topk_order="set",
                                                        topk_splits=1))
    sel_split = selector("pallas", si.IndexerKernelConfig(topk_algorithm="pallas_radix", topk_order="set",
                                                          topk_splits=None, topk_split_finish=False))
    sel_sf = selector("pallas", si.IndexerKernelConfig(topk_algorithm="pallas_radix", topk_order="set",
                                                       topk_splits=None, topk_split_finish=True))
    sel_inv = selector("pallas", si.IndexerKernelConfig(topk_algorithm="pallas_radix", topk_order="set",
                                                        topk_splits=None, topk_invisible_in_kernel=True))
    for b, c in sel:
        k, key = jax.random.split(key)
        bt, cache, q8, qs, iw, req = _decode_inputs(k, b, c)
        # full rows, then one request of 1000 tokens among full ones (its row is mostly -inf: the Pallas
        # top-k's prefilter fails on it and that row reads itself again)
        for tag, vis in (("", np.full(b, c)), ("_mixed", np.r_[1000, np.full(b - 1, c)])):
            nvis = jnp.asarray(vis, jnp.int32)
            nbytes, flops = _model(b, c, vis, 1, np.arange(b), True)
            args = (q8, qs, iw, cache, bt, req, nvis)
            case = f"decode_select_b{b}_c{c}{tag}"
            yield _row(case + "_auto", "pallas", sel_auto, args, nbytes, flops, quick, profile=True,
                       topk=si.resolve_topk_algorithm(b, c))
            if not split_only:
                yield _row(case, "pallas", sel_lax, args, nbytes, flops, quick, profile=True, topk="lax")
                yield _row(case + "_set", "pallas", sel_set, args, nbytes, flops, quick, profile=True,
                           topk="pallas_radix, unsorted")
            if split_for(b, c) > 1:
                yield _row(case + "_set_split", "pallas", sel_split, args, nbytes, flops, quick, profile=True,
                           topk=f"pallas_radix, unsorted, {split_for(b, c)} splits")
                yield _row(case + "_set_split_sf", "pallas", sel_sf, args, nbytes, flops, quick, profile=True,
                           topk=f"pallas_radix, unsorted, {split_for(b, c)} splits, split finish")
                yield _row(case + "_set_split_inv", "pallas", sel_inv, args, nbytes, flops, quick, profile=True,
                           topk=f"pallas_radix, unsorted, {split_for(b, c)} splits, -1s from the kernel")
            if not tag and not split_only:
                yield _row(case, "xla", select_x, args, nbytes, flops, quick, big=True, profile=True, topk="lax")
        del cache

    # ----- top-k alone over logits rows -----
    tk = [(4, 1024)] if quick else [(b, c) for b in (16, 64) for c in (32768, 65536, 131072)]
    tk = tk if want & {"topk", "topk_pallas"} else []
    for b, c in tk:
        k1, key = jax.random.split(key)
        lg = jax.random.normal(k1, (b, c), jnp.float32)
        yield (_row(f"topk_k{K}_b{b}_c{c}", "xla", topk, (lg, K, None, "lax"), 4 * b * c, 0, quick, profile=True))
        for bits in () if lean_topk else (1, 2, 4):  # counting passes of radix select: 32 / bits, each 2^bits compares per key
            yield (_row(f"topk_k{K}_b{b}_c{c}_radix{bits}", "xla", radix, (lg, min(K, c), bits), 4 * b * c, 0,
                        quick))
        sp = split_for(b, c)
        # topk_pallas leaves out the direct kernel (no prefilter: 4-7x the prefiltered one at every shape, 2026-12-02)
        radix_rows = {n: f for n, f in pallas_radix.items() if not (lean_topk and n == "pallas_radix_direct")}
        if sp > 1:  # the prefilter's pass over sp programs per row (two kernels), unsorted
            radix_rows[f"pallas_radix_split{sp}_set"] = jax.jit(functools.partial(
                topk_select, interpret=interpret, config=TopkSelectConfig(splits=sp), sort=False), static_argnums=1)
            # what the indexer runs (IndexerKernelConfig.topk_splits=None): the split with its measured loop knobs
            radix_rows["pallas_radix_indexer_set"] = jax.jit(functools.partial(
                topk_select, interpret=interpret, config=select_config_for(b, c), sort=False), static_argnums=1)
        def radix_row(case, f, x):  # a lowering failure is a result too; the other rows still get measured
            try:
                return _row(case, "pallas", f, (x, min(K, c)), 4 * b * c, 0, quick, profile=True)
            except Exception as e:  # noqa: BLE001
                return {"kernel": "sparse_indexer", "case": case, "impl": "pallas", "bytes": 4 * b * c, "flops": 0,
                        "error": error_text(e, 2000)}

        for name, f in radix_rows.items():  # radix select as one Pallas kernel (+ a sort of the k winners)
            yield radix_row(f"topk_k{K}_b{b}_c{c}_{name}", f, lg)
        # one short row (1000 finite logits, -inf after: a short request) among full ones: lax against the
        # radix select, whose short-row path must not set the batch's time
        lgm = lg.at[0, 1000:].set(-jnp.inf) if c > 1000 else lg
        yield (_row(f"topk_k{K}_b{b}_c{c}_mixed", "xla", topk, (lgm, K, None, "lax"), 4 * b * c, 0, quick,
                    profile=True))
        for name in [r for r in radix_rows if r != "pallas_radix_direct"]:
            yield radix_row(f"topk_k{K}_b{b}_c{c}_mixed_{name}", radix_rows[name], lgm)
        del lgm
        for seg in () if lean_topk else ((1024,) if quick else (8192, 16384)):  # two-stage (exact) variant
            yield (_row(f"topk_k{K}_b{b}_c{c}_seg{seg}", "xla", topk, (lg, K, seg, "lax"), 4 * b * c, 0, quick))
        del lg

    # ----- prefill (one request, the last Q positions of a C-token context) -----
    prefill = [(128, 512)] if quick else [(q, c) for c in (8192, 32768, 65536) for q in (1024, 4096, 8192) if q <= c]
    prefill = prefill if "prefill" in want else []
    for q, c in prefill:
        k1, k2, k3, key = jax.random.split(key, 4)
        bt, nb = _tables(k1, 1, c // EPP)
        cache = _cache(k2, nb)
        q8, qs, iw = _queries(k3, q)
        iq = dequant_index_q(q8, qs)
        req = jnp.zeros((q,), jnp.int32)
        pos = np.arange(c - q, c)
        nvis = jnp.asarray(pos + 1, jnp.int32)
        vis_np, req_np = pos + 1, np.zeros(q, np.int64)
        g = 4
        if q == (128 if quick else 1024):
            w8 = iw * qs
            nbytes, flops = _model(q, c, vis_np, g, req_np, False)
            case = f"prefill_logits_q{q}_c{c}"
            yield (_row(case, "pallas", logits_p, (q8, w8, cache, bt, req, nvis), nbytes, flops, quick))
            if q * c * 129 * 4 * 3 <= (60 << 30):
                yield (_row(case, "xla", logits_x, (iq, iw, cache, fmt, bt, req, nvis), nbytes, flops, quick,
                                 big=True))
        nbytes, flops = _model(q, c, vis_np, g, req_np, True)
        case = f"prefill_select_q{q}_c{c}"
        args = (q8, qs, iw, cache, bt, req, nvis)
        yield (_row(case, "pallas", select_p, args, nbytes, flops, quick, big=q * c >= (1 << 27)))
        yield (_row(case, "xla", select_x, args, nbytes, flops, quick, big=True))
        del cache


if __name__ == "__main__":  # pragma: no cover
    import json

    for r in benchmark(quick=True):
        print(json.dumps(r))
