"""Sparse MQA benchmark (issue 8): the Pallas kernel against the XLA gather implementation in the same run.

    python -m jds.bench.kernels --only sparse_mqa [--quick] \
        --out benchmarks/results/kernels_sparse_mqa_<device>_<date>.json

Cases (``quick``: tiny shapes, for a CPU smoke run in GPU interpret mode):
- v32: DeepSeek-V3.2 absorbed MLA, 128 heads, q 576 / v 512, top-2048 over the 656-byte FP8 cache
  (64 tokens per page). Decode batches of 1, 8, 64, 128 tokens (one request each, 8K-token contexts,
  2048 distinct random slots per token) and a 4K-token prefill of one request (token i reads
  min(i + 1, 2048) random positions <= i, the rest of its list is -1).
- v4: DeepSeek-V4-Flash C4 layer, 64 heads, K = V = 512, window 128 (584-byte records, 256 per page)
  + top-512 compressed entries (584-byte records, 64 per page), attention sink. Decode batches as above
  (8K contexts: 2048 compressed entries each) and a 4K-token prefill (window [i-127, i], top-min((i+1)//4, 512)).

Per row: kernel, case, impl ("pallas" | "xla"), median_us (jds.bench.timing.time_fn), bytes (the
unavoidable traffic: valid records gathered once per token + bf16 q + fp32 output), flops
(2 * heads * valid candidates * (d_qk + d_v), summed over tokens), tokens, heads, candidates (mean valid
per token) and, on the pallas row, max_abs_err / ref_max against the XLA output of the same inputs.
"""

from __future__ import annotations

import functools
import gc
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jds.ops.paging import empty_cache, write_records
from jds.ops.records import MlaRecord584, MlaRecord656
from pallas_kernels import sparse_mqa as mqa
from jds.bench.timing import device_row, time_fn

CTX = 8192  # decode context length per request
PREFILL = 4096
XLA_TOKEN_CHUNK = 512  # fallback when the XLA path's full-batch intermediates do not fit


def _filled_cache(fmt, num_slots: int, dim: int, key: jax.Array) -> jax.Array:
    """A cache whose every slot holds a packed random row (written in chunks to bound memory)."""
    nb = -(-num_slots // fmt.entries_per_page)
    n = nb * fmt.entries_per_page
    cache = empty_cache(fmt, nb)
    chunk = min(n, 1 << 16)

    @jax.jit
    def write(cache, start, key):
        rows = jax.random.normal(key, (chunk, dim), jnp.float32)
        slots = start + jnp.arange(chunk, dtype=jnp.int32)
        return write_records(cache, fmt, jnp.where(slots < n, slots, -1), rows)

    for i, start in enumerate(range(0, n, chunk)):
        cache = write(cache, jnp.int32(start), jax.random.fold_in(key, i))
    return cache


def _random_subset(key, t: int, pool: int, k: int, limit: jax.Array | None = None) -> jax.Array:
    """[t, k] distinct random indices in [0, pool) (in [0, limit[t]) with -1 beyond when limit is given)."""
    u = jax.random.uniform(key, (t, pool))
    if limit is not None:
        u = jnp.where(jnp.arange(pool)[None, :] < limit[:, None], u, 2.0)
    idx = jnp.argsort(u, axis=1)[:, :k].astype(jnp.int32)
    if idx.shape[1] < k:  # fewer positions than k: the list ends in -1
        idx = jnp.pad(idx, ((0, 0), (0, k - idx.shape[1])), constant_values=-1)
        limit = jnp.full((t,), pool, jnp.int32) if limit is None else jnp.minimum(limit, pool)
    if limit is not None:
        idx = jnp.where(jnp.arange(k)[None, :] < jnp.minimum(limit, k)[:, None], idx, -1)
    return idx


def _v32_case(t: int, prefill: bool, quick: bool, key, scale_fmt: str = "amax"):
    h, topk, epp = (64, 128, 64) if quick else (128, 2048, 64)
    fmt = MlaRecord656(epp, scale_fmt)  # "amax": vLLM's writer; "ue8m0": DeepSeek's power-of-two scales
    k1, k2, k3 = jax.random.split(key, 3)
    if prefill:
        n = t
        slots = _random_subset(k2, t, n, topk, limit=jnp.arange(1, t + 1, dtype=jnp.int32))
    else:
        ctx = 4 * topk if quick else CTX
        n = t * ctx
        slots = _random_subset(k2, t, ctx, topk) + (jnp.arange(t, dtype=jnp.int32) * ctx)[:, None]
    cache = _filled_cache(fmt, n, 576, k1)
    q = jax.random.normal(k3, (t, h, 576), jnp.float32).astype(jnp.bfloat16)
    return dict(q=q, caches=[cache], fmts=[fmt], slots=[slots], sink=None, scale=576 ** -0.5, v_dim=512,
                heads=h, dk=576, rec_bytes=[656])


def _v4_case(t: int, prefill: bool, quick: bool, key):
    h, win, topk, ew, ec = (64, 16, 64, 256, 64) if quick else (64, 128, 512, 256, 64)
    fw, fc = MlaRecord584(ew), MlaRecord584(ec)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    if prefill:
        pos = jnp.arange(t, dtype=jnp.int32)
        n_w, n_c = t, t // 4
        w = pos[:, None] - win + 1 + jnp.arange(win, dtype=jnp.int32)
        w_slots = jnp.where(w >= 0, w, -1)
        c_slots = _random_subset(k2, t, max(n_c, 1), topk, limit=(pos + 1) // 4)
    else:
        ctx = 4 * 4 * topk if quick else CTX
        n_w, n_c = t * ctx, t * ctx // 4
        base = jnp.arange(t, dtype=jnp.int32)[:, None]
        w_slots = base * ctx + ctx - win + jnp.arange(win, dtype=jnp.int32)[None, :]
        c_slots = _random_subset(k2, t, ctx // 4, topk) + base * (ctx // 4)
    cw = _filled_cache(fw, n_w, 512, k1)
    cc = _filled_cache(fc, max(n_c, ec), 512, k3)
    q = jax.random.normal(k4, (t, h, 512), jnp.float32).astype(jnp.bfloat16)
    sink = jax.random.normal(k5, (h,), jnp.float32)
    return dict(q=q, caches=[cw, cc], fmts=[fw, fc], slots=[w_slots, c_slots], sink=sink, scale=512 ** -0.5,
                v_dim=512, heads=h, dk=512, rec_bytes=[584, 584])


def _run_case(kernel_case: str, name: str, c: dict, quick: bool) -> list[dict]:
    fmts, scale, v_dim = c["fmts"], c["scale"], c["v_dim"]
    q, caches, slots, sink = c["q"], c["caches"], c["slots"], c["sink"]
    t, h, dk = q.shape
    valid = [np.asarray(jnp.sum(s >= 0, axis=1)) for s in slots]
    n_valid = sum(valid)  # [T] valid candidates per token
    flops = float(np.sum(2.0 * h * n_valid * (dk + v_dim)))
    nbytes = float(sum(np.sum(v) * rb for v, rb in zip(valid, c["rec_bytes"])) + t * h * dk * 2 + t * h * v_dim * 4)
    common = dict(kernel="sparse_mqa", case=name, tokens=t, heads=h, candidates=float(np.mean(n_valid)),
                  candidate_lists=[int(s.shape[1]) for s in slots], bytes=nbytes, flops=flops)
    def call(impl, q, caches, slots, sink, **kw):
        return mqa.sparse_mqa(q, caches, fmts, slots, scale=scale, v_dim=v_dim, sink=sink, implementation=impl,
                              **kw)

    def chunked_xla(q, caches, slots, sink, n=XLA_TOKEN_CHUNK):
        """The XLA path over token chunks (its [T, K, record] intermediates of a 4K prefill can exceed HBM)."""
        pad = -t % n
        qs = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(-1, n, h, dk)
        ss = [jnp.pad(s, ((0, pad), (0, 0)), constant_values=-1).reshape(-1, n, s.shape[1]) for s in slots]
        out = jax.lax.map(lambda a: call("xla", a[0], caches, a[1], sink), (qs, ss))
        return out.reshape(-1, h, v_dim)[:t]

    args = (q, caches, slots, sink)
    fns = {"pallas": jax.jit(lambda *a: call("pallas", *a)), "xla": jax.jit(lambda *a: call("xla", *a))}
    xla_note = {}
    try:
        ref = np.asarray(fns["xla"](*args))
    except Exception as e:  # noqa: BLE001 - typically RESOURCE_EXHAUSTED on the 4K prefill
        fns["xla"] = jax.jit(chunked_xla)
        xla_note = dict(xla_token_chunk=XLA_TOKEN_CHUNK, xla_full_error=str(e).splitlines()[0][:200])
        ref = np.asarray(fns["xla"](*args))
    errs = {}
    for impl in fns:
        if impl != "xla":
            got = np.asarray(fns[impl](*args))
            errs[impl] = dict(max_abs_err=float(np.abs(got - ref).max()), ref_max=float(np.abs(ref).max()),
                              nonfinite=int((~np.isfinite(got)).sum()))
            del got
    del ref
    rows = []
    timing = dict(warmup=1, iters=3) if quick else dict(warmup=5, iters=30)
    for impl in fns:
        r = dict(common, impl=impl, **time_fn(fns[impl], *args, **timing))
        r.update(device_row(fns[impl], *args, median_us=r["median_us"], quick=quick))
        r.update(errs.get(impl, xla_note))
        rows.append(r)
    return rows


def case(name: str, quick: bool = False) -> dict:
    """One of the benchmark's inputs by name, for the diagnostic scripts: "v32_decode_64", "v4_prefill_4096",
    ...; "v32u_...": V3.2 records with power-of-two (ue8m0) scales. Key 0 (the benchmark folds in a case
    index instead)."""
    arch, kind, t = name.split("_")
    make = {"v32": _v32_case, "v32u": functools.partial(_v32_case, scale_fmt="ue8m0"), "v4": _v4_case}.get(arch)
    if make is None or kind not in ("decode", "prefill"):
        raise ValueError(f"case: unknown arch or kind in {name!r} (v32 / v32u / v4, decode / prefill)")
    return make(int(t), kind == "prefill", quick, jax.random.key(0))


def benchmark(quick: bool, cases: Sequence[str] | None = None) -> Iterator[dict]:
    """Rows case by case (a generator: the caller records each as it comes). ``cases``: run only the
    named cases (e.g. ``v32_decode_64``)."""
    decode = (1, 2) if quick else (1, 8, 64, 128)
    prefill = 8 if quick else PREFILL
    key = jax.random.key(0)
    for arch, make in (("v32", _v32_case), ("v4", _v4_case)):
        for i, (t, pre) in enumerate([(b, False) for b in decode] + [(prefill, True)]):
            name = f"{arch}_{'prefill' if pre else 'decode'}_{t}"
            if cases and name not in cases:
                continue
            c = make(t, pre, quick, jax.random.fold_in(key, 1000 * (arch == "v4") + i))
            yield from _run_case("sparse_mqa", name, c, quick)
            del c
            gc.collect()
