"""DeepSeek-V4 attention (jds.v4 + jds.ops.compressor) against the PyTorch oracle tests/reference/torch_v4.py.

CPU, V4Config.tiny() (real 512-d heads, 584-byte records, window 16, C4/C128 compressors, top-8 indexer,
block_size 128 -> 32 C4 entries / 1 C128 entry per page), fresh random weights and inputs per test.
Every layer call goes through one jitted step per runner (the eager check_inputs runs first, as a server
would), so shapes are bucketed with padding tokens to keep compiles few.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from jds.attention import weights_proj_dtype
from jds.batch import Chunk, make_batch, replace
from jds.config import Numerics, V32Config, V4Config
from jds.nn import export_weights, load_weights
from jds.ops.paging import read_records, write_records
from jds.ops.records import MlaRecord584
from jds.ops.sparse_mqa import sparse_mqa
from jds.v4 import V4Attention, V4Cache, compressor_dtype
from tests.reference.torch_v4 import (TorchV4Attention, dequantize_wo_a, make_random_v4_weights,
                                      quantize_weights_fp8)

CFG = V4Config.tiny()
KINDS = [0, 1, 2]  # layer ids of tiny(): ratio 0 (window only), 4 (C4 + indexer), 128 (C128)
# Sequence length per kind: SWA crosses the 16-token window; C4 closes 17 blocks (top-8 of up to 17 entries);
# C128 closes blocks 0 and 1 (positions 127 and 255), so > 256 tokens.
SEQ = {0: 40, 1: 70, 2: 300}
ORACLE_MAXLEN = 512
EXACT_RTOL = 1e-5


def _weights(layer_id: int, seed: int, numerics: Numerics, sink_scale: float = 1.0) -> dict[str, np.ndarray]:
    w = make_random_v4_weights(CFG, layer_id, seed=seed, sink_scale=sink_scale)
    if compressor_dtype(numerics) == jnp.bfloat16:  # the compressors' weights as the layer holds them (bf16)
        w = {k: v.astype(ml_dtypes.bfloat16) if k.endswith(("compressor.wkv", "compressor.wgate")) else v
             for k, v in w.items()}
    if weights_proj_dtype(numerics) == jnp.bfloat16 and "indexer.weights_proj" in w:  # as held (bf16, as stored)
        w = {**w, "indexer.weights_proj": w["indexer.weights_proj"].astype(ml_dtypes.bfloat16)}
    if not numerics.fp8_linear:
        return w
    # the checkpoint's FP8 linears; wo_a as the release converts it (bf16), unless the numerics keep it FP8
    return quantize_weights_fp8(w) if numerics.wo_a_fp8 else dequantize_wo_a(quantize_weights_fp8(w))


# one jit for every Runner (the graphdef static): layers of one config share the compiled step of a shape
_step = jax.jit(lambda gd, st, x, b, c: nnx.merge(gd, st)(x, b, c), static_argnums=0)
# the record reads / writes of the checks, compiled (as the layers run them) instead of an eager op per primitive
_read = jax.jit(read_records, static_argnums=1)
_write = jax.jit(write_records, static_argnums=1)


class Runner:
    """A V4 layer with its cache and one jitted forward; steps are host-built paged batches."""

    def __init__(self, layer_id: int, numerics: Numerics, weights: dict, num_blocks: int):
        self.layer = V4Attention(CFG, numerics, layer_id, rngs=nnx.Rngs(0))
        load_weights(self.layer, weights)
        gd, self.params = nnx.split(self.layer)
        self.fn = lambda st, x, b, c: _step(gd, st, x, b, c)
        self.cache = self.layer.init_cache(num_blocks)

    def step(self, xs: list[np.ndarray], chunks: list[Chunk], bt: np.ndarray, pad_to: int | None = None,
             pad_pos: int = 0, pad_req: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """xs[i] = hidden states of chunks[i]; returns (y, topk) of the real tokens (float32, int32).

        Padding tokens (slot -1) get position ``pad_pos`` and request row ``pad_req``."""
        batch = make_batch(chunks, bt, CFG.block_size, pad_to)
        x = np.concatenate(xs, axis=0)
        n = x.shape[0]
        pad = np.arange(batch.num_tokens) >= n
        batch = replace(batch, positions=jnp.where(pad, pad_pos, batch.positions),
                        req_idx=jnp.where(pad, pad_req, batch.req_idx))
        x = np.pad(x, ((0, batch.num_tokens - n), (0, 0)))
        x = jnp.asarray(x)
        self.layer.check_inputs(x, batch, self.cache)
        res = self.fn(self.params, x, batch, self.cache)
        self.cache = res.cache
        return np.asarray(res.y.astype(jnp.float32))[:n], np.asarray(res.topk)[:n]


def _oracle(layer_id: int, weights: dict, numerics: Numerics, max_batch: int) -> TorchV4Attention:
    return TorchV4Attention(CFG, layer_id, weights, numerics, max_batch, ORACLE_MAXLEN)


def _pages(rng: np.random.Generator, rows: int, width: int, num_blocks: int) -> np.ndarray:
    """Shuffled, non-contiguous page ids: a permutation of the pool cut into block-table rows."""
    return rng.permutation(num_blocks)[: rows * width].reshape(rows, width).astype(np.int32)


def _assert_exact(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Every element within 1e-5 relative (to itself, floored at 1e-5 of the tensor's scale)."""
    np.testing.assert_allclose(a, b, rtol=EXACT_RTOL, atol=EXACT_RTOL * float(np.abs(b).max()), err_msg=what)


def _assert_topk(ours: np.ndarray, ref: np.ndarray, scores: np.ndarray) -> None:
    """Same selected sets per token, except swaps between entries whose oracle scores tie with the k-th."""
    ours, ref, scores = ours.reshape(-1, ours.shape[-1]), ref.reshape(-1, ref.shape[-1]), scores.reshape(
        -1, scores.shape[-1])
    n_sel = 0
    for t in range(ours.shape[0]):
        a, b = set(ours[t].tolist()) - {-1}, set(ref[t].tolist()) - {-1}
        n_sel += len(b)
        if a == b:
            continue
        assert len(a) == len(b), f"token {t}: {len(a)} selected vs oracle {len(b)}"
        kth = min(scores[t, list(b)])
        for e in a ^ b:
            assert abs(scores[t, e] - kth) <= 1e-5 * abs(kth) + 1e-6, f"token {t}: entry {e} is no tie"
    assert n_sel > 0


def _both_prefill(layer_id: int, num: Numerics, seed: int) -> tuple:
    """One two-request prefill of ``SEQ[layer_id]`` tokens through jds (shuffled pages) and the oracle, in
    ``num``: (runner, oracle, oracle result, jds output [2*S, hidden], jds top-k, block table)."""
    rng = np.random.default_rng(seed)
    s = SEQ[layer_id]
    w = _weights(layer_id, seed=int(rng.integers(1 << 30)), numerics=num, sink_scale=2.0)
    x = rng.standard_normal((2, s, CFG.hidden_size)).astype(np.float32)
    orc = _oracle(layer_id, w, num, 2)
    ref = orc.forward(torch.from_numpy(x), 0)
    run = Runner(layer_id, num, w, num_blocks=8)
    bt = _pages(rng, 2, 4, 8)
    y, topk = run.step([x[0], x[1]], [Chunk(0, 0, s), Chunk(1, 0, s)], bt)
    return run, orc, ref, y, topk, bt


def _seq_chunks(x: np.ndarray, sizes: list[int]) -> list[tuple[int, np.ndarray]]:
    out, p = [], 0
    for n in sizes:
        out.append((p, x[:, p:p + n]))
        p += n
    assert p == x.shape[1]
    return out


# ------------------------------------------------------------------------------------------ weights


@pytest.mark.parametrize("numerics", [Numerics.exact(), Numerics.reference()], ids=["exact", "fp8"])
def test_weight_names_shapes_and_roundtrip(numerics: Numerics) -> None:
    for lid in KINDS:
        w = _weights(lid, seed=100 + lid, numerics=numerics)
        layer = V4Attention(CFG, numerics, lid, rngs=nnx.Rngs(lid))
        ex = export_weights(layer)
        assert set(ex) == set(w), sorted(set(ex) ^ set(w))
        assert {k: (v.shape, v.dtype) for k, v in ex.items()} == {k: (v.shape, v.dtype) for k, v in w.items()}
        load_weights(layer, w)
        back = export_weights(layer)
        for k in w:  # the fused wq_a|wkv splits back into the exact checkpoint tensors
            assert np.array_equal(back[k].view(np.uint8), np.asarray(w[k]).view(np.uint8)), k
        with pytest.raises(ValueError):
            load_weights(layer, {k: v for k, v in w.items() if k != "wkv"})


# ------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("layer_id", KINDS)
def test_prefill_parity_exact(layer_id: int) -> None:
    """Two requests on shuffled pages, one-shot prefill, every output element within 1e-5 of the oracle."""
    rng = np.random.default_rng(layer_id)
    s = SEQ[layer_id]
    w = _weights(layer_id, seed=int(rng.integers(1 << 30)), numerics=Numerics.exact(), sink_scale=2.0)
    x = rng.standard_normal((2, s, CFG.hidden_size)).astype(np.float32)
    ref = _oracle(layer_id, w, Numerics.exact(), 2).forward(torch.from_numpy(x), 0)
    run = Runner(layer_id, Numerics.exact(), w, num_blocks=8)
    bt = _pages(rng, 2, 4, 8)
    y, topk = run.step([x[0], x[1]], [Chunk(0, 0, s), Chunk(1, 0, s)], bt)
    _assert_exact(y.reshape(2, s, -1), ref["out"].numpy(), "prefill output")
    if layer_id == 1:
        assert topk.shape == (2 * s, CFG.index_topk)
        _assert_topk(topk.reshape(2, s, -1), ref["topk"].numpy(), ref["index_scores"].numpy())
        assert (topk[-1] >= 0).all()  # late tokens really select among > k entries
    else:
        assert topk.shape == (2 * s, 0)


CHUNKS = {  # chunk boundaries just before / at / after block closes
    0: [7, 1, 16, 16],
    1: [3, 1, 4, 5, 1, 56],  # positions 0-2 | 3 (closes alone) | 4-7 (closes at end) | 8-12 | 13 | 14-69
    2: [127, 1, 126, 2, 44],  # 0-126 | 127 (closes block 0 alone) | 128-253 | 254-255 (255 closes) | 256-299
}


@pytest.mark.parametrize("layer_id", KINDS)
def test_decode_and_chunked_prefill_equal_prefill(layer_id: int) -> None:
    """Token-by-token decode and chunked prefill reproduce one-shot prefill: outputs, top-k and every cache
    (window, compressed, compressor states, indexer keys), so state carried across steps is the same."""
    rng = np.random.default_rng(10 + layer_id)
    s = SEQ[layer_id]
    w = _weights(layer_id, seed=int(rng.integers(1 << 30)), numerics=Numerics.exact())
    x = rng.standard_normal((2, s, CFG.hidden_size)).astype(np.float32)
    bt = _pages(rng, 2, 4, 8)

    full = Runner(layer_id, Numerics.exact(), w, 8)
    y_full, tk_full = full.step([x[0], x[1]], [Chunk(0, 0, s), Chunk(1, 0, s)], bt)
    y_full, tk_full = y_full.reshape(2, s, -1), tk_full.reshape(2, s, -1)

    def replay(sizes: list[int], pad_to: int | None) -> tuple[np.ndarray, np.ndarray, V4Cache]:
        run = Runner(layer_id, Numerics.exact(), w, 8)
        ys, tks = [], []
        for p, xc in _seq_chunks(x, sizes):
            n = xc.shape[1]
            y, tk = run.step([xc[0], xc[1]], [Chunk(0, p, n), Chunk(1, p, n)], bt, pad_to)
            ys.append(y.reshape(2, n, -1))
            tks.append(tk.reshape(2, n, -1))
        return np.concatenate(ys, 1), np.concatenate(tks, 1), run.cache

    # the chunked steps padded to the one-shot prefill's 2 * s tokens: they run its compiled step (one shape less)
    for name, sizes, pad in (("decode", [1] * s, None), ("chunked", CHUNKS[layer_id], 2 * s)):
        y, tk, cache = replay(sizes, pad)
        _assert_exact(y, y_full, f"{name} output")
        if layer_id == 1:
            agree = (np.sort(tk, -1) == np.sort(tk_full, -1)).all(-1).mean()
            assert agree > 0.95, f"{name}: top-k differs on {1 - agree:.1%} of tokens"  # only near-ties may flip
        for field in ("window", "compressed", "state", "index_k", "index_state"):
            a, b = np.asarray(getattr(cache, field)), np.asarray(getattr(full.cache, field))
            assert a.shape == b.shape
            if b.size:
                _assert_exact(a, b, f"{name} cache.{field}")


def _mixed_plan() -> tuple[list[list[tuple[int, int]]], list[int]]:
    """Two server steps for 3 active requests (row 3 idle): (start, n) per request per step."""
    steps = [
        [(0, 255), (0, 130), (0, 9)],  # req0 stops just before C128 block 1 closes; req1 crosses 127; req2 short
        [(255, 1), (130, 70), (9, 120)],  # req0 decodes the closing token; req2's chunk closes 127 inside
    ]
    return steps, [255 + 1, 130 + 70, 9 + 120]


@pytest.mark.parametrize("layer_id", KINDS)
def test_mixed_batch_shuffled_pages(layer_id: int) -> None:
    """3 requests of different lengths (a decode, a chunk and a prefill in one step), shuffled pages,
    padding tokens and an idle row: each request matches its own oracle run; foreign pages stay zero."""
    rng = np.random.default_rng(20 + layer_id)
    w = _weights(layer_id, seed=int(rng.integers(1 << 30)), numerics=Numerics.exact(), sink_scale=2.0)
    steps, totals = _mixed_plan()
    xs = [rng.standard_normal((1, n, CFG.hidden_size)).astype(np.float32) for n in totals]
    nb = 12
    bt = _pages(rng, 4, 3, nb)
    used = {int(bt[r, i]) for r, n in enumerate(totals) for i in range(-(-n // CFG.block_size))}
    run = Runner(layer_id, Numerics.exact(), w, nb)
    oracles = [_oracle(layer_id, w, Numerics.exact(), 1) for _ in totals]
    for plan in steps:
        chunks = [Chunk(r, p, n) for r, (p, n) in enumerate(plan)]
        # padding tokens sit at a block-closing position request 1 never reaches, right after its last token
        # (C4: block 50 pools block 49's written state; C128: block 1 is partly written): they must still
        # write nothing, and a stray write would be non-zero (checked below)
        y, tk = run.step([xs[r][0, p:p + n] for r, (p, n) in enumerate(plan)], chunks, bt, pad_to=400,
                         pad_pos=203 if layer_id == 1 else 255, pad_req=1)
        off = 0
        for r, (p, n) in enumerate(plan):
            ref = oracles[r].forward(torch.from_numpy(xs[r][:, p:p + n]), p)
            _assert_exact(y[off:off + n], ref["out"].numpy()[0], f"request {r} at {p}")
            if layer_id == 1:
                _assert_topk(tk[off:off + n], ref["topk"].numpy()[0], ref["index_scores"].numpy()[0])
            off += n
    for field in ("window", "compressed", "state", "index_k", "index_state"):
        arr = np.asarray(getattr(run.cache, field))
        for page in set(range(nb)) - used:
            assert not arr[page].any(), f"cache.{field} page {page} was written (padding / idle row)"
    ratio = CFG.compress_ratios[layer_id]
    caches = [("compressed", run.layer.compressed_format)] if ratio else []
    caches += [("index_k", run.layer.index_format)] if ratio == 4 else []
    for field, fmt in caches:  # entries of blocks no token closed yet are unwritten
        for r, n in enumerate(totals):
            local = np.arange(n // ratio, -(-n // CFG.block_size) * fmt.entries_per_page)
            slots = bt[r, local // fmt.entries_per_page] * fmt.entries_per_page + local % fmt.entries_per_page
            assert not np.asarray(_read(getattr(run.cache, field), fmt, jnp.asarray(slots))).any(), (field, r)


# ------------------------------------------------------------------------------------------ sink


def test_sink_shrinks_output() -> None:
    """The sink adds exp(sink) to the softmax denominator with a zero value: o(sink) = o(no sink) *
    Z / (Z + exp(sink)), so the output shrinks monotonically and vanishes for a large sink."""
    lid, s = 2, 140
    rng = np.random.default_rng(30)
    w = _weights(lid, seed=31, numerics=Numerics.exact())
    layer = V4Attention(CFG, Numerics.exact(), lid, rngs=nnx.Rngs(0))
    gd, _ = nnx.split(layer)

    @jax.jit
    def attn(st, x, batch, cache):
        m = nnx.merge(gd, st)
        q, cache = m.prepare(m.project_in(x), batch, cache)
        o = m.attend(q, m.select(q, batch, cache), batch, cache)
        return o, q.q

    x = jnp.asarray(rng.standard_normal((s, CFG.hidden_size)).astype(np.float32))
    batch = make_batch([Chunk(0, 0, s)], _pages(rng, 1, 2, 4), CFG.block_size)
    norms = []
    for sink in (-60.0, 0.0, 3.0, 60.0):
        load_weights(layer, dict(w, attn_sink=np.full(CFG.n_heads, sink, np.float32)))
        o, q = attn(nnx.split(layer)[1], x, batch, layer.init_cache(4))
        norms.append(np.linalg.norm(np.asarray(o).reshape(s, CFG.n_heads, -1), axis=-1))  # [T, H]
    assert (norms[1] < norms[0]).all() and (norms[2] < norms[1]).all()
    assert (norms[3] < 1e-20 * norms[0] + 1e-30).all()
    assert np.isfinite(norms).all()
    # primitive check: a sink of -60 is no sink, a large sink scales rows by Z / (Z + e^sink)
    qq, rows = jnp.ones((1, 1, 8)), jnp.ones((1, 3, 8))
    valid = jnp.array([[True, True, False]])
    base = sparse_mqa(qq, rows, valid, scale=0.0, v_dim=8)
    withs = sparse_mqa(qq, rows, valid, scale=0.0, v_dim=8, sink=jnp.array([np.log(2.0)], jnp.float32))
    np.testing.assert_allclose(np.asarray(withs), np.asarray(base) * 0.5, rtol=1e-6)


# ------------------------------------------------------------------------------------------ fp8


@pytest.mark.parametrize("layer_id", [0, 1, pytest.param(2, marks=pytest.mark.slow)])  # C128: long prompts; its
# fp8 record path is the same as C4's, and C128 itself runs in the exact-numerics tests above
def test_fp8_reference_numerics(layer_id: int) -> None:
    """Numerics.reference(): bf16 activations, fp8 block-scaled linears, 584-byte window/compressed records,
    fp8 indexer with Hadamard, against the oracle in the same numerics.

    Tolerance: both sides round to bf16 / quantise to e4m3 at the same points, so they differ only where a
    different fp32 summation order puts an intermediate on the other side of a rounding boundary: one bf16
    ulp (2^-8 relative) or, rarely, one e4m3 step (2^-3 of that element, e.g. in q or a cached kv value),
    which then propagates through the softmax and two GEMMs into a few output elements. Measured on these
    inputs: <= 0.7% of output elements differ by more than one bf16 ulp of themselves, mean error ~1e-5 and
    max error ~6e-3 of max|y|. Bounds, with margin: every element within 2^-6 of max|y|, mean error below
    2^-12 of max|y|, at most 2% of elements beyond one bf16 ulp. A semantic bug (wrong channel, position,
    block or candidate) moves most elements by O(max|y|).
    """
    num = Numerics.reference()
    s = SEQ[layer_id]
    run, orc, ref, y, topk, bt = _both_prefill(layer_id, num, 40 + layer_id)
    assert run.cache.window.dtype == jnp.uint8 and run.cache.window.shape == (8, CFG.block_size * 584)
    r = ref["out"].numpy()
    err = np.abs(y.reshape(2, s, -1) - r)
    scale = float(np.abs(r).max())
    assert err.max() <= 2.0 ** -6 * scale, err.max() / scale
    assert err.mean() <= 2.0 ** -12 * scale, err.mean() / scale
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(r), 1e-30))) - 7)  # one bf16 ulp of each element
    assert (err > ulp).mean() <= 0.02, (err > ulp).mean()
    # the window cache holds what the oracle reads back from its cache (584-byte record round trip)
    fmt = run.layer.window_format
    pos = np.arange(s)
    slots = jnp.asarray(bt[0, pos // CFG.block_size] * CFG.block_size + pos % CFG.block_size)
    kv, okv = np.asarray(_read(run.cache.window, fmt, slots)), orc.kv_window[0, :s].numpy()
    assert (kv == okv).mean() > 0.99 and np.abs(kv - okv).max() <= 2.0 ** -3 * np.abs(okv).max()
    if layer_id == 1:
        same = np.mean([set(a) == set(b) for a, b in zip(topk.reshape(2 * s, -1), ref["topk"].numpy().reshape(
            2 * s, -1))])
        assert same > 0.9, same  # fp8 indexer: near-ties may flip, most sets agree


# ------------------------------------------------------------------------------------------ records


def test_mla_record584_layout_roundtrip() -> None:
    epp, nb = 4, 3
    fmt = MlaRecord584(epp)
    assert fmt.page_elems == epp * 584
    rng = np.random.default_rng(50)
    rows = rng.standard_normal((2, 512)).astype(np.float32)
    rows[0, :64] *= 1000.0  # a large block
    rows[0, 64:128] = 0.0  # an all-zero block: amax floor 1e-4
    rows[1, 128:192] *= 1e-3
    slots = np.array([2, 9])  # page 0 entry 2, page 2 entry 1
    cache = _write(jnp.zeros((nb, fmt.page_elems), jnp.uint8), fmt, jnp.asarray(slots), jnp.asarray(rows))
    flat = np.asarray(cache).reshape(-1)
    written = np.zeros(flat.shape, bool)
    for r, slot in enumerate(slots):
        page, j = divmod(int(slot), epp)
        base = page * fmt.page_elems
        data = flat[base + j * 576: base + (j + 1) * 576]
        scl = flat[base + epp * 576 + j * 8: base + epp * 576 + (j + 1) * 8]
        written[base + j * 576: base + (j + 1) * 576] = True
        written[base + epp * 576 + j * 8: base + epp * 576 + (j + 1) * 8] = True
        nope = rows[r, :448].astype(ml_dtypes.bfloat16).astype(np.float32).reshape(7, 64)
        amax = np.maximum(np.abs(nope).max(-1), 1e-4)
        e = np.ceil(np.log2(amax.astype(np.float64) / 448.0)).astype(np.int64)
        assert scl[:7].tolist() == (e + 127).tolist()  # UE8M0 exponent bytes
        assert scl[7] == 0  # pad byte
        q = (nope / np.exp2(e)[:, None]).astype(ml_dtypes.float8_e4m3fn).reshape(-1)
        assert np.array_equal(data[:448], q.view(np.uint8))
        assert np.array_equal(data[448:], rows[r, 448:].astype(ml_dtypes.bfloat16).view(np.uint8))  # LE bf16
    assert not flat[~written].any()  # nothing else touched
    back = np.asarray(_read(cache, fmt, jnp.asarray(slots)))
    np.testing.assert_array_equal(back[:, 448:], rows[:, 448:].astype(ml_dtypes.bfloat16).astype(np.float32))
    nope = rows[:, :448].reshape(2, 7, 64)
    tol = np.abs(nope).max(-1, keepdims=True) * 2.0 ** -3  # e4m3: 3 mantissa bits, scale <= 2x amax/448
    assert (np.abs(back[:, :448].reshape(2, 7, 64) - nope) <= tol + 1e-6).all()
    padded = np.asarray(_write(cache, fmt, jnp.asarray([-1]), jnp.ones((1, 512))))
    assert np.array_equal(padded, np.asarray(cache))  # slot -1 writes nothing


# ------------------------------------------------------------------------------------------ inputs


def test_check_inputs_rejects_bad_shapes() -> None:
    layer = V4Attention(CFG, Numerics.exact(), 1, rngs=nnx.Rngs(0))
    cache = layer.init_cache(4)
    assert cache.state.shape == (4, CFG.block_size * 2 * 2 * CFG.head_dim)
    swa = V4Attention(CFG, Numerics.exact(), 0, rngs=nnx.Rngs(0)).init_cache(4)
    assert swa.compressed.shape == (4, 0) and swa.index_state.shape == (4, 0)
    bt = np.arange(4, dtype=np.int32).reshape(1, 4)
    batch = make_batch([Chunk(0, 0, 5)], bt, CFG.block_size)
    x = jnp.zeros((5, CFG.hidden_size))
    layer.check_inputs(x, batch, cache)
    with pytest.raises(ValueError, match="hidden_size"):
        layer.check_inputs(jnp.zeros((5, 3)), batch, cache)
    with pytest.raises(ValueError, match="cache.compressed"):
        layer.check_inputs(x, batch, swa)
    with pytest.raises(ValueError, match="tokens"):
        layer.check_inputs(jnp.zeros((6, CFG.hidden_size)), batch, cache)


def test_wo_a_runs_in_bf16_as_released() -> None:
    """The release dequantises wo_a at conversion and runs a plain bf16 einsum: with FP8 linears on, jds's
    wo_a holds bf16 weights and does not quantise its input; ``Numerics.wo_a_fp8`` is the named departure."""
    import dataclasses

    rel = Numerics.reference()
    dep = dataclasses.replace(rel, wo_a_fp8=True)
    lid = KINDS[0]
    a = V4Attention(CFG, rel, lid, rngs=nnx.Rngs(3))
    b = V4Attention(CFG, dep, lid, rngs=nnx.Rngs(3))
    assert not a.wo_a.fp8 and a.wq_b.fp8 and b.wo_a.fp8 and "wo_a.scale" not in export_weights(a)
    # the model's wo_a lies on the release's FP8 grid (e4m3 x power-of-two block scales), exactly in bf16
    w = np.asarray(a.wo_a.weight[...], np.float32)
    from jds.ops.quant import quantize_weight_blocks

    q, s = quantize_weight_blocks(w, fmt="ue8m0")
    back = q.astype(np.float32) * np.repeat(np.repeat(s, 128, 0)[: w.shape[0]], 128, 1)[:, : w.shape[1]]
    np.testing.assert_array_equal(back, w)
    rng = np.random.default_rng(0)
    og = jnp.asarray(rng.normal(size=(5, CFG.o_groups, w.shape[1])), jnp.bfloat16)  # [T, groups, in]
    y_rel = np.asarray(a.wo_a.grouped(og).astype(jnp.float32))
    want = np.einsum("tgi,goi->tgo", np.asarray(og, np.float32), w.reshape(CFG.o_groups, -1, w.shape[1]))
    np.testing.assert_allclose(y_rel, want, rtol=2 ** -7, atol=2 ** -7 * np.abs(want).max())


# ------------------------------------------------------------------------------------------ MXFP4 indexer


def test_fp4_index_record_bytes() -> None:
    """The 68-byte MXFP4 key record: element 2i in the low nibble, one e8m0 byte per 32 values, values equal
    to the oracle's float64 nearest-even search on the e2m1 grid."""
    from jds.ops.records import IndexerRecordFP4
    from tests.reference.torch_v4 import _fp4_roundtrip

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((9, 128)) * np.exp(rng.uniform(-7, 5, (9, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, :8] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25]  # e2m1 midpoints at scale 1 (block amax 5)
    x[1, 8:32] = 0.0
    fmt = IndexerRecordFP4(16)
    rec = np.asarray(fmt.pack(jnp.asarray(x)))
    assert rec.shape == (9, 68) and fmt.page_elems == 16 * 68
    want = _fp4_roundtrip(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(np.asarray(fmt.unpack(jnp.asarray(rec))), want)
    np.testing.assert_array_equal(want[1, :8], [0, 1, 1, 2, 2, 4, 4, 0])  # ties to the even code
    assert rec[1, 64] == 127 and rec[1, 0] == (0b0010 << 4) | 0b0000  # 0.75 -> code 2 (1.0) high, 0.25 -> 0 low
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    lo, hi = rec[2, :64] & 15, rec[2, :64] >> 4
    vals = np.stack([grid[lo & 7] * np.where(lo & 8, -1, 1), grid[hi & 7] * np.where(hi & 8, -1, 1)], -1).reshape(-1)
    np.testing.assert_array_equal(vals * np.repeat(2.0 ** (rec[2, 64:].astype(int) - 127), 32), want[2])


def test_fp4_indexer_layer_against_the_oracle() -> None:
    """A C4 layer with the released MXFP4 indexer (Numerics.indexer_fp4) against the oracle in the same
    numerics: the 68-byte key cache, outputs within the fp8 reference's bounds, top-k sets equal except at
    ties of the oracle's scores. ``implementation="auto"`` scores in XLA (the Pallas kernel reads FP8 only)."""
    import dataclasses

    num = dataclasses.replace(Numerics.reference(), indexer_fp4=True)
    layer_id = 1
    s = SEQ[layer_id]
    run, orc, ref, y, topk, _ = _both_prefill(layer_id, num, 41)
    assert run.cache.index_k.shape == (8, (CFG.block_size // 4) * 68)
    r = ref["out"].numpy()
    err = np.abs(y.reshape(2, s, -1) - r)
    assert err.max() <= 2.0 ** -6 * float(np.abs(r).max())
    _assert_topk(topk.reshape(2, s, -1), ref["topk"].numpy(), ref["index_scores"].numpy())
    with pytest.raises(ValueError, match="indexer_fp4"):
        from jds.v32 import V32Attention

        V32Attention(V32Config.tiny(), num, rngs=nnx.Rngs(0))
