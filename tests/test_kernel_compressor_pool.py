"""pallas_kernels.compressor_pool: ``pool_norm_rope`` (V4's compressor entries: pool, RMSNorm, RoPE) against a
float64 reference computed candidate by candidate from the state pages, every element of every closing row
(rows that close no block must come out as zeros); ``write_state``, ``insert_entries`` and ``insert_index_keys``
against their XLA forms, bit for bit. Interpret mode on the CPU, natively on a GPU (``gpu``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds.ops import compressor as comp
from jds.ops.records import FloatRows, IndexerRecord132, MlaRecord584
from pallas_kernels import fused_insert_common as C
from pallas_kernels.compressor_pool import insert_entries, insert_index_keys, pool_norm_rope, write_state
from tests.kernel_modes import MODES, interpret_for
from tests.tolerances import ulp

EPS = 1e-6


def _case(rng: np.random.Generator, ratio: int, d: int, rd: int, bs: int, n: int, num_blocks: int = 12,
          reqs: int = 3, max_blocks: int = 4):
    fmt = comp.state_format(ratio, d, block_size=bs)
    state = rng.standard_normal((num_blocks, fmt.page_elems)).astype(np.float32)
    state[:, 1::7] *= 4.0  # spread the scores so that the softmax weights are far from uniform
    bt = rng.permutation(num_blocks)[: reqs * max_blocks].reshape(reqs, max_blocks).astype(np.int32)
    req = rng.integers(0, reqs, n).astype(np.int32)
    blocks = rng.integers(0, max_blocks * bs // ratio, n).astype(np.int32)
    blocks[rng.random(n) < 0.4] = -1  # rows that close nothing
    blocks[0] = 0  # block 0: at ratio 4 the previous block's candidates are all masked
    w = rng.standard_normal(d).astype(np.float32)
    freqs = 1.0 / (10000.0 ** (np.arange(0, rd, 2) / rd))
    return state, bt, req, blocks, w, freqs


def _reference(state, bt, req, blocks, w, cos, sin, *, ratio, d, bs, out_dtype) -> tuple[np.ndarray, np.ndarray]:
    """float64, candidate by candidate: softmax-pool, RMSNorm (rounded to ``out_dtype`` as the op's norm output
    is), interleaved RoPE on the last 2 * cos.shape[1] dims with the op's cos / sin inputs.

    Also each element's scale for the error bound: the normed weighted sum of |kv| (a float32 sum errs relative
    to its terms, not to a result that cancels), the larger of a rotated pair's two."""
    c = comp.overlap_factor(ratio)
    width = 2 * c * d
    rd = 2 * cos.shape[1]
    cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    out, scale = np.zeros((len(req), d)), np.zeros((len(req), d))
    for i, (r_, b) in enumerate(zip(req, blocks)):
        if b < 0:
            continue
        kv, sc = [], []
        for part in range(c):  # ratio 4: part 0 the previous block (channels [0:d]), part 1 this block's [d:2d]
            blk = b - (c - 1) + part
            if blk < 0:
                continue
            for t in range(ratio):
                p = blk * ratio + t
                row = state[bt[r_, p // bs], (p % bs) * width:(p % bs + 1) * width].astype(np.float64)
                kv.append(row[part * d:(part + 1) * d])
                sc.append(row[c * d + part * d: c * d + (part + 1) * d])
        kv, sc = np.array(kv), np.array(sc)
        a = np.exp(sc - sc.max(axis=0))
        x = (a * kv).sum(axis=0) / a.sum(axis=0)
        inv_rms = 1.0 / np.sqrt(np.mean(x * x) + EPS)
        y = x * inv_rms * w
        m = (a * np.abs(kv)).sum(axis=0) / a.sum(axis=0) * inv_rms * np.abs(w)
        m[d - rd:] = np.repeat(np.maximum(m[d - rd::2], m[d - rd + 1::2]), 2)
        scale[i] = np.maximum(m, np.abs(y))
        y = np.asarray(jnp.asarray(y, jnp.float32).astype(out_dtype).astype(jnp.float32), np.float64)
        u, v = y[d - rd::2].copy(), y[d - rd + 1::2].copy()
        y[d - rd::2], y[d - rd + 1::2] = u * cos[i] - v * sin[i], u * sin[i] + v * cos[i]
        out[i] = y
    return out, scale


def assert_close(got, want, scale, dtype, n_f32: int, what: str) -> None:
    """|got - want| <= n_f32 float32 ulps of ``scale`` (the float32 arithmetic) + 2 ``dtype`` ulps of ``scale``
    (the norm output's rounding, then the rotation's), elementwise."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    bound = n_f32 * ulp(scale, np.float32) + (2 * ulp(scale, dtype) if dtype != jnp.float32 else 0)
    err = np.abs(got - want)
    bad = err > bound
    k = np.argmax(err / bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {err.size} elements off; worst {err.flat[k]:.3e} against "
                           f"{bound.flat[k]:.3e} (got {got.flat[k]:.6e}, want {want.flat[k]:.6e}, "
                           f"scale {scale.flat[k]:.3e})")


# (ratio, d, rope dim, page size): V4's main compressors (ratio 4 overlapping, ratio 128) and the indexer's
CASES = [(4, 128, 64, 64), (128, 64, 16, 128), (4, 64, 16, 16)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ratio,d,rd,bs", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pool_norm_rope(mode, ratio, d, rd, bs, dtype):
    interpret = interpret_for(mode)
    rng = np.random.default_rng([ratio, d, rd, bs])
    state, bt, req, blocks, w, freqs = _case(rng, ratio, d, rd, bs, n=9)
    cos, sin = comp.entry_rope(freqs, jnp.asarray(blocks), ratio)
    got = pool_norm_rope(jnp.asarray(state), jnp.asarray(bt), jnp.asarray(req), jnp.asarray(blocks), jnp.asarray(w),
                         cos, sin, ratio=ratio, d=d, block_size=bs, eps=EPS, dtype=dtype, implementation="pallas",
                         interpret=interpret)
    assert got.dtype == jnp.dtype(dtype) and got.shape == (len(req), d)
    want, scale = _reference(state, bt, req, blocks, w, cos, sin, ratio=ratio, d=d, bs=bs, out_dtype=dtype)
    ok = blocks >= 0
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32))[~ok], 0.0, err_msg="rows closing no block")
    # a softmax-weighted sum of c * ratio terms (each a rounded exp and product), the norm and a rotation
    assert_close(np.asarray(got.astype(jnp.float32))[ok], want[ok], scale[ok], dtype,
                 n_f32=4 * comp.overlap_factor(ratio) * ratio, what="entries")


@pytest.mark.parametrize("mode", MODES)
def test_pool_norm_rope_matches_xla(mode):
    """The kernel at several tilings (a row in one program or spread; chunk sizes) against the op's XLA
    implementation (the layer's fallback), which is itself checked against the reference; closing rows only."""
    interpret = interpret_for(mode)
    ratio, d, rd, bs = 128, 64, 16, 128
    rng = np.random.default_rng(7)
    state, bt, req, blocks, w, freqs = _case(rng, ratio, d, rd, bs, n=6)
    cos, sin = comp.entry_rope(freqs, jnp.asarray(blocks), ratio)
    args = (jnp.asarray(state), jnp.asarray(bt), jnp.asarray(req), jnp.asarray(blocks), jnp.asarray(w), cos, sin)
    kw = dict(ratio=ratio, d=d, block_size=bs, eps=EPS, dtype=jnp.float32)
    xla = np.asarray(pool_norm_rope(*args, **kw, implementation="xla"))
    want, scale = _reference(state, bt, req, blocks, w, cos, sin, ratio=ratio, d=d, bs=bs, out_dtype=jnp.float32)
    ok = blocks >= 0
    assert_close(xla[ok], want[ok], scale[ok], jnp.float32, n_f32=4 * ratio, what="xla")
    for cb, chunk in ((64, 2), (64, 32), (16, 128), (8, 16)):  # d = 64: one program per row, then 4 and 8
        got = np.asarray(pool_norm_rope(*args, **kw, implementation="pallas", interpret=interpret, chunk=chunk,
                                        channel_block=cb))
        assert_close(got[ok], xla[ok], scale[ok], jnp.float32, n_f32=8 * ratio, what=f"{cb} channels, chunk {chunk}")


def test_pool_norm_rope_input_errors():
    rng = np.random.default_rng(1)
    state, bt, req, blocks, w, freqs = _case(rng, 4, 64, 16, 16, n=3)
    cos, sin = comp.entry_rope(freqs, jnp.asarray(blocks), 4)
    args = [jnp.asarray(state), jnp.asarray(bt), jnp.asarray(req), jnp.asarray(blocks), jnp.asarray(w), cos, sin]
    kw = dict(ratio=4, d=64, block_size=16, eps=EPS, dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="state_cache"):
        pool_norm_rope(args[0][:, :-1], *args[1:], **kw)
    with pytest.raises(ValueError, match="blocks"):
        pool_norm_rope(*args[:3], args[3][:2], *args[4:], **kw)
    with pytest.raises(ValueError, match="norm_weight"):
        pool_norm_rope(*args[:4], args[4][:8], *args[5:], **kw)
    with pytest.raises(ValueError, match="chunk"):
        pool_norm_rope(*args, **kw, chunk=3)
    with pytest.raises(ValueError, match="channel_block"):
        pool_norm_rope(*args, **kw, channel_block=128)
    with pytest.raises(ValueError, match="block_size"):
        pool_norm_rope(*args, **{**kw, "block_size": 18})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ratio,d,bs,t,rows", [(4, 64, 16, 11, None), (128, 32, 128, 5, None), (4, 16, 16, 9, 2)])
def test_write_state(mode, ratio, d, bs, t, rows):
    """The state write equals the XLA form's bit for bit (one float32 sum per score element in both, the kv
    copied), every byte of the pages: written rows, untouched ones and the padding tokens' (slot -1)."""
    interpret = interpret_for(mode)
    rng = np.random.default_rng([ratio, d, t])
    c = comp.overlap_factor(ratio)
    fmt = comp.state_format(ratio, d, bs)
    num_blocks = 5
    cache = jnp.asarray(rng.standard_normal((num_blocks, fmt.page_elems)), jnp.float32)
    proj = rng.standard_normal((t, 4 * c * d // 2)).astype(np.float32)
    proj[0, :3] = -0.0  # signed zeros stay as they are
    slots = rng.permutation(num_blocks * bs)[:t].astype(np.int32)
    slots[1] = -1
    pos = rng.integers(0, 10 * ratio, t).astype(np.int32)
    ape = jnp.asarray(rng.standard_normal((ratio, c * d)), jnp.float32)
    args = (cache, jnp.asarray(proj), ape, jnp.asarray(pos), jnp.asarray(slots))
    kw = dict(ratio=ratio, d=d, block_size=bs)
    want = write_state(*args, **kw, implementation="xla")
    got = write_state(*args, **kw, implementation="pallas", interpret=interpret, rows_per_program=rows)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
    assert not np.array_equal(np.asarray(want), np.asarray(cache))  # something was written


def test_write_state_input_errors():
    fmt = comp.state_format(4, 16, 16)
    cache = jnp.zeros((2, fmt.page_elems), jnp.float32)
    proj, ape = jnp.zeros((3, 64), jnp.float32), jnp.zeros((4, 32), jnp.float32)
    pos = slots = jnp.zeros((3,), jnp.int32)
    kw = dict(ratio=4, d=16, block_size=16, interpret=True)
    with pytest.raises(ValueError, match="proj"):
        write_state(cache, proj[:, :32], ape, pos, slots, **kw)
    with pytest.raises(ValueError, match="ape"):
        write_state(cache, proj, ape[:2], pos, slots, **kw)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_state(cache, proj, ape, pos, slots[:2], **kw)
    with pytest.raises(ValueError, match="state_cache"):
        write_state(cache[:, :-1], proj, ape, pos, slots, **kw)
    with pytest.raises(ValueError, match="rows_per_program"):
        write_state(cache, proj, ape, pos, slots, **kw, rows_per_program=3)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU-side lowering check (the gpu tests compile for real)")
@pytest.mark.parametrize("ratio,d", [(4, 512), (128, 512), (4, 128)])  # V4's main compressors, the indexer's
def test_lowers_for_cuda(ratio, d):
    """The kernels lower to Triton for CUDA at V4's shapes (decode batch 64, 256-token pages)."""
    bs, n, rd = 256, 64, 64
    c = comp.overlap_factor(ratio)
    fmt = comp.state_format(ratio, d, bs)
    sds = jax.ShapeDtypeStruct
    cache, bt = sds((200, fmt.page_elems), jnp.float32), sds((n, 64), jnp.int32)
    rows, tab = sds((n,), jnp.int32), sds((n, rd // 2), jnp.float32)
    pool = functools.partial(pool_norm_rope, ratio=ratio, d=d, block_size=bs, eps=EPS, dtype=jnp.bfloat16,
                             interpret=False)
    assert "__gpu$xla.gpu.triton" in C.check_triton_lowering(pool, cache, bt, rows, rows, sds((d,), jnp.float32),
                                                             tab, tab)
    state = functools.partial(write_state, ratio=ratio, d=d, block_size=bs, interpret=False)
    assert "__gpu$xla.gpu.triton" in C.check_triton_lowering(state, cache, sds((n, 2 * c * d), jnp.float32),
                                                             sds((ratio, c * d), jnp.float32), rows, rows)
    if d == 512:  # the main compressors' entries into the 584-byte records
        fmt = MlaRecord584(bs // ratio)
        ins = functools.partial(insert_entries, fmt=fmt, interpret=False)
        assert "__gpu$xla.gpu.triton" in C.check_triton_lowering(ins, sds((200, fmt.page_elems), jnp.uint8),
                                                                 sds((n, d), jnp.bfloat16), rows)
    else:  # the indexer's keys into the 132-byte records
        fmt = IndexerRecord132(bs // ratio, d)
        ins = functools.partial(insert_index_keys, fmt=fmt, hadamard=False, dtype=jnp.bfloat16, interpret=False)
        assert "__gpu$xla.gpu.triton" in C.check_triton_lowering(ins, sds((200, fmt.page_elems), jnp.uint8),
                                                                 sds((n, d), jnp.bfloat16), rows)


@pytest.mark.parametrize("ratio", [4, 128])
def test_closing_blocks(ratio):
    """The (request, block) pairs a step's tokens close, against a loop: compacted when the bound is under the token
    count (prefill), token by token when it covers them all (decode); padding tokens (slot -1) close nothing."""
    rng = np.random.default_rng(ratio)
    for chunks in ([(0, 3 * ratio - 5, 2 * ratio + 7), (1, 0, 9)], [(r, int(p), 1) for r, p in
                                                                   enumerate(rng.integers(0, 5 * ratio, 12))]):
        req = np.concatenate([np.full(n, r) for r, _, n in chunks] + [np.zeros(3, int)]).astype(np.int32)
        pos = np.concatenate([np.arange(p, p + n) for _, p, n in chunks] + [np.zeros(3, int)]).astype(np.int32)
        pos[-8] = ratio - 1  # one more closing token (a real one: the last three are padding)
        slots = np.where(np.arange(len(pos)) < len(pos) - 3, 1, -1).astype(np.int32)
        max_out = comp.max_closing(len(pos), len(chunks), ratio)
        got_r, got_b = (np.asarray(a) for a in comp.closing_blocks(jnp.asarray(pos), jnp.asarray(req),
                                                                   jnp.asarray(slots), ratio, max_out))
        assert got_r.shape == got_b.shape == (max_out,)
        want = sorted((int(r), int(p) // ratio) for r, p, s in zip(req, pos, slots) if s >= 0 and (p + 1) % ratio == 0)
        assert sorted((int(r), int(b)) for r, b in zip(got_r, got_b) if b >= 0) == want
        if max_out >= len(pos):  # token by token: row t is token t's
            closes = (slots >= 0) & ((pos + 1) % ratio == 0)
            np.testing.assert_array_equal(got_b[:len(pos)], np.where(closes, pos // ratio, -1))


def _record_case(rng: np.random.Generator, fmt, d: int, n: int, dead: list[int], num_blocks: int = 6):
    """Rows [n, d] of several binades (float64), a cache of ``fmt`` full of noise, and n distinct slots with ``dead``
    ones -1."""
    x = rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-6, 3, (n, 1))
    if jnp.dtype(fmt.dtype) == jnp.uint8:
        cache = jnp.asarray(rng.integers(0, 256, (num_blocks, fmt.page_elems)), jnp.uint8)
    else:
        cache = jnp.asarray(rng.standard_normal((num_blocks, fmt.page_elems)), fmt.dtype)
    slots = rng.permutation(num_blocks * fmt.entries_per_page)[:n].astype(np.int32)
    slots[dead] = -1
    return x, cache, jnp.asarray(slots)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt,dtype", [(MlaRecord584(4), jnp.bfloat16), (MlaRecord584(2), jnp.float32),
                                       (FloatRows(64, 4, jnp.bfloat16), jnp.bfloat16),
                                       (FloatRows(64, 4, jnp.float32), jnp.float32)])
def test_insert_entries(mode, fmt, dtype):
    """Entries written by the kernel equal ``write_records``' bytes, every byte of the cache (written records,
    untouched ones, slot -1 rows); the rows span several binades (per-block exponents) and tiny ones (the floor)."""
    interpret = interpret_for(mode)
    d = fmt.nope_dim + fmt.rope_dim if isinstance(fmt, MlaRecord584) else fmt.dim
    x, cache, slots = _record_case(np.random.default_rng(5), fmt, d, n=9, dead=[1, 5])
    x[2, :64] *= 1e-7  # a block under the amax floor
    entries = jnp.asarray(x, dtype)
    want = insert_entries(cache, entries, slots, fmt=fmt, implementation="xla")
    got = insert_entries(cache, entries, slots, fmt=fmt, implementation="pallas", interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert not np.array_equal(np.asarray(want), np.asarray(cache))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt,dtype", [(IndexerRecord132(8), jnp.bfloat16), (IndexerRecord132(4), jnp.float32),
                                       (FloatRows(128, 8, jnp.bfloat16), jnp.bfloat16)])
def test_insert_index_keys(mode, fmt, dtype):
    """The indexer compressor's keys written by the kernel equal ``prepare_indexer_k`` + ``write_records``, every
    byte of the cache; rows of several binades and one under the amax floor. The Hadamard form and amax scales
    are the kernel's ``Unsupported`` (XLA under "auto")."""
    interpret = interpret_for(mode)
    x, cache, slots = _record_case(np.random.default_rng(8), fmt, fmt.dim, n=11, dead=[0, 7])
    x[3] *= 1e-7
    keys = jnp.asarray(x, jnp.float32)
    kw = dict(fmt=fmt, hadamard=False, dtype=dtype)
    want = insert_index_keys(cache, keys, slots, **kw, implementation="xla")
    got = insert_index_keys(cache, keys, slots, **kw, implementation="pallas", interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert not np.array_equal(np.asarray(want), np.asarray(cache))
    kw["hadamard"] = True
    with pytest.raises(NotImplementedError, match="Hadamard"):
        insert_index_keys(cache, keys, slots, **kw, implementation="pallas", interpret=interpret)
    auto = insert_index_keys(cache, keys, slots, **kw, implementation="auto", interpret=interpret)
    xla = insert_index_keys(cache, keys, slots, **kw, implementation="xla")
    np.testing.assert_array_equal(np.asarray(auto).view(np.uint8), np.asarray(xla).view(np.uint8))
