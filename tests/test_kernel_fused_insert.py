"""Fused norm / RoPE / cache-insert kernels (pallas_kernels/fused_insert_v32.py, fused_insert_v4.py) against
their pure-JAX references, and the layers' ``implementation="pallas"`` prepare against ``"xla"``.

Modes: ``interpret`` (GPU interpret mode, any backend) and ``gpu`` (compiled Triton kernels; marked ``gpu``,
skipped unless jax.default_backend() == "gpu").

Tolerances (see tests/tolerances.py). In interpret mode the kernel body runs as XLA CPU ops that mirror the
reference op by op, so with bf16 activations the caches and q outputs are *nearly* bit-identical to the
reference; but whether CPU float code is bit-identical depends on the machine's vector ISA and XLA's fusion
choices (an AVX2 machine showed one bf16 ulp in 40,960 elements). So the "tight" comparisons allow one step of
the storage format (one bf16 ulp; one e4m3 step of the block scale for decoded FP8 records) on a small fraction
of elements, never more. Looser tolerances remain for:
* the Hadamard rotation: the kernel's dots (one against H128, or two against H64 and their sum and difference)
  accumulate in a different order than the reference einsum, so a bf16 rounding (and then an e4m3 byte) differs
  more often;
* float32 activations: differences from reduction order / FMA contraction inside XLA CPU fusions.
On the GPU every comparison uses the loose tolerances: Triton's reduction trees and FMA contraction differ from
XLA's. Bytes the step does not write (other slots, padding tokens' slots) are compared exactly in every mode:
they are copied, never computed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jds.batch import Chunk, make_batch
from jds.config import Numerics, V32Config, V4Config
from jds.ops.paging import read_records
from jds.ops.records import FloatRows, IndexerRecord132, MlaRecord584, MlaRecord656
from jds.ops.rope import cached_inv_freqs, rope_cos_sin
from pallas_kernels import fused_insert_common as C
from pallas_kernels.fused_insert_v32 import fused_kv_insert_v32, fused_q_v32
from pallas_kernels.fused_insert_v4 import fused_qnorm_rope_kv_insert_v4
from tests.kernel_modes import pallas_calls
from tests.tolerances import assert_decoded_within_step, assert_e4m3_within_step, assert_within_ulps

ON_GPU = jax.default_backend() == "gpu"
MODES = [pytest.param("interpret", id="interpret"),
         pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu,
                                              pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")])]
BF16, F32 = jnp.bfloat16, jnp.float32


def _interpret(mode: str) -> bool:
    return mode == "interpret"


def _slots(rng: np.random.Generator, t: int, n_slots: int) -> np.ndarray:
    """Shuffled distinct slots, two of them padding (-1)."""
    s = rng.permutation(n_slots)[:t].astype(np.int32)
    s[1] = -1
    s[t // 2] = -1
    return s


def _noise_cache(rng: np.random.Generator, fmt, num_blocks: int) -> jax.Array:
    if jnp.dtype(fmt.dtype) == jnp.uint8:
        return jnp.asarray(rng.integers(0, 256, (num_blocks, fmt.page_elems)), jnp.uint8)
    return jnp.asarray(rng.normal(size=(num_blocks, fmt.page_elems)), fmt.dtype)


def _written_mask(fmt, cache_shape, slots: np.ndarray) -> np.ndarray:
    m = np.zeros(int(np.prod(cache_shape)), bool)
    off = np.asarray(_offsets(fmt, jnp.asarray(slots[slots >= 0])))
    m[off.reshape(-1)] = True
    return m.reshape(cache_shape)


# the checks' decoding in one compiled program per format and shape (eagerly, every op would compile on its own)
_offsets = jax.jit(lambda fmt, slots: fmt.offsets(slots), static_argnums=0)
_read = jax.jit(read_records, static_argnums=1)


# tight mode: rounding flips of one storage step are rare (a few per 10^4 in practice); 2% caps a systematic bias
FLIP_FRAC = 0.02


def assert_cache_match(fmt, got, want, slots: np.ndarray, tight: bool, what: str) -> None:
    """Unwritten bytes exactly (copied, never computed); the written records decoded, within one storage
    step (``tight``) or within the loose GPU / Hadamard / f32 tolerances."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    written = _written_mask(fmt, got.shape, slots)
    np.testing.assert_array_equal(got[~written].view(np.uint8), want[~written].view(np.uint8),
                                  err_msg=f"{what}: bytes outside this step's records changed")
    valid = jnp.asarray(slots[slots >= 0])
    g = np.asarray(_read(jnp.asarray(got), fmt, valid))
    w = np.asarray(_read(jnp.asarray(want), fmt, valid))
    if tight:
        assert_decoded_within_step(fmt, g, w, what, max_frac=FLIP_FRAC)
        return
    quantised = jnp.dtype(fmt.dtype) == jnp.uint8
    rtol = 0.13 if quantised else (2e-2 if jnp.dtype(fmt.dtype) == BF16 else 2e-5)
    atol = 2e-2 * np.abs(w).max() if quantised else 1e-5
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=what)
    if quantised:  # rare rounding flips only
        assert (got != want).mean() < 0.02, f"{what}: {(got != want).mean():.3%} bytes differ"


def assert_q_match(got, want, tight: bool, what: str, rtol: float) -> None:
    """``tight``: within one ulp of the outputs' dtype on at most FLIP_FRAC of the elements."""
    if tight:
        assert_within_ulps(got, want, jnp.asarray(want).dtype, 1, what, max_frac=FLIP_FRAC)
        return
    got, want = np.asarray(jnp.asarray(got).astype(F32)), np.asarray(jnp.asarray(want).astype(F32))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max() * 1e-2, err_msg=what)


def _rtol(dt) -> float:
    return 2e-2 if dt == BF16 else 2e-5


def _run(fn, static, *args):
    """Both implementations under jit (the caches donated, as the layer's runner does)."""
    outs = {}
    for impl, extra in (("xla", {}), ("pallas", static.pop("_kernel", {}))):
        f = jax.jit(functools.partial(fn, implementation=impl, **static, **extra))
        outs[impl] = jax.block_until_ready(f(*args))
    return outs["pallas"], outs["xla"]


# ----- V3.2: kv latent + rope key -> MLA cache, indexer key -> indexer cache ------------------------------
V32_KV_CASES = [  # kv format, index format, dtype, hadamard, indexer interleave, tokens
    pytest.param(MlaRecord656(16, "ue8m0"), IndexerRecord132(16), BF16, False, False, 20, id="656ue8m0-132-bf16"),
    pytest.param(MlaRecord656(16, "amax"), IndexerRecord132(16), BF16, True, True, 7, id="656amax-132-had-ilv"),
    pytest.param(FloatRows(576, 16, BF16), FloatRows(128, 16, BF16), BF16, True, False, 7, id="rows-bf16-had"),
    pytest.param(MlaRecord656(16, "ue8m0"), FloatRows(128, 16, F32), F32, False, False, 20, id="656-f32"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kv_fmt,idx_fmt,dt,had,ilv,t", V32_KV_CASES)
def test_v32_kv_insert(mode, kv_fmt, idx_fmt, dt, had, ilv, t):
    cfg = V32Config.tiny()
    rng = np.random.default_rng(t)
    nb = 4
    kv = jnp.asarray(rng.normal(size=(t, 576)) * 2, dt)
    ik = jnp.asarray(rng.normal(size=(t, 128)), dt)
    cos, sin = rope_cos_sin(cached_inv_freqs(cfg.rope, 64), jnp.asarray(rng.integers(0, 2000, t), jnp.int32))
    slots = _slots(rng, t, nb * 16)
    w, kw, kb = (jnp.asarray(1 + 0.1 * rng.normal(size=512), F32), jnp.asarray(1 + 0.1 * rng.normal(size=128), F32),
                 jnp.asarray(0.1 * rng.normal(size=128), F32))
    kc, ic = _noise_cache(rng, kv_fmt, nb), _noise_cache(rng, idx_fmt, nb)
    static = dict(kv_format=kv_fmt, index_format=idx_fmt, eps=1e-6, dtype=dt, indexer_interleave=ilv, hadamard=had,
                  _kernel=dict(interpret=_interpret(mode)))
    got, want = _run(fused_kv_insert_v32, static, kv, ik, cos, sin, jnp.asarray(slots), kc, ic, w, kw, kb)
    exact = mode == "interpret" and dt == BF16
    assert_cache_match(kv_fmt, got[0], want[0], slots, exact, "MLA cache")
    assert_cache_match(idx_fmt, got[1], want[1], slots, exact and not had, "indexer cache")


@pytest.mark.parametrize("mode", MODES)
def test_v32_kv_insert_reads_columns_in_place(mode):
    """kv_col / index_col: V3.2's kv insert reads its rows in place from a wider array (the layer's fused input
    projection, passed whole) and writes what it writes from the rows sliced out, bit for bit, in each
    implementation; columns that do not fit are a ValueError naming the argument."""
    cfg, rng, t, nb = V32Config.tiny(), np.random.default_rng(5), 20, 4
    proj = jnp.asarray(rng.normal(size=(t, 96 + 128 + 576)) * 2, BF16)  # [q latent | indexer key | kv]
    kv, ik = proj[:, 224:], proj[:, 96:224]
    cos, sin = rope_cos_sin(cached_inv_freqs(cfg.rope, 64), jnp.asarray(rng.integers(0, 2000, t), jnp.int32))
    slots = jnp.asarray(_slots(rng, t, nb * 16))
    fmt, ifmt = MlaRecord656(16, "ue8m0"), IndexerRecord132(16)
    w, kw, kb = (jnp.asarray(1 + 0.1 * rng.normal(size=n), F32) for n in (512, 128, 128))
    caches = _noise_cache(rng, fmt, nb), _noise_cache(rng, ifmt, nb)
    static = dict(kv_format=fmt, index_format=ifmt, eps=1e-6, dtype=BF16, indexer_interleave=False, hadamard=True)
    for impl in ("xla", "pallas"):
        f = functools.partial(fused_kv_insert_v32, **static, implementation=impl, interpret=_interpret(mode))
        sliced = f(kv, ik, cos, sin, slots, *caches, w, kw, kb)
        whole = f(proj, proj, cos, sin, slots, *caches, w, kw, kb, kv_col=224, index_col=96)
        for g, s_, what in zip(whole, sliced, ("MLA cache", "indexer cache")):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(s_), err_msg=f"{impl} {what}")
    with pytest.raises(ValueError, match=r"kv_col = 300: kv's rows take columns \[kv_col, kv_col \+ 576\) of its 800"):
        fused_kv_insert_v32(proj, proj, cos, sin, slots, *caches, w, kw, kb, **static, kv_col=300, index_col=96)
    with pytest.raises(ValueError, match="index_col must be an int or None"):
        fused_kv_insert_v32(proj, proj, cos, sin, slots, *caches, w, kw, kb, **static, kv_col=224, index_col=1.5)


# ----- V3.2: q_pe RoPE + indexer q --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dt,had,ilv,fp8,t", [
    pytest.param(BF16, False, False, True, 20, id="bf16-fp8"),
    pytest.param(BF16, True, True, True, 5, id="bf16-had-ilv-fp8"),
    pytest.param(BF16, True, False, False, 5, id="bf16-had-nofp8"),
    pytest.param(F32, True, False, True, 5, id="f32-had-fp8"),
])
def test_v32_fused_q(mode, dt, had, ilv, fp8, t):
    cfg = V32Config.tiny()
    rng = np.random.default_rng(10 + t)
    q = jnp.asarray(rng.normal(size=(t, cfg.n_heads, 192)), dt)
    iq = jnp.asarray(rng.normal(size=(t, cfg.index_n_heads, 128)), dt)
    iw = jnp.asarray(rng.normal(size=(t, cfg.index_n_heads)), F32)
    cos, sin = rope_cos_sin(cached_inv_freqs(cfg.rope, 64), jnp.asarray(rng.integers(0, 2000, t), jnp.int32))
    static = dict(nope_dim=128, dtype=dt, indexer_interleave=ilv, hadamard=had, fp8=fp8,
                  _kernel=dict(interpret=_interpret(mode)))
    (qpe, q8, s, wf), (rqpe, rq8, rs, rwf) = _run(fused_q_v32, static, q, iq, iw, cos, sin)
    exact = mode == "interpret" and dt == BF16
    assert q8.dtype == (jnp.float8_e4m3fn if fp8 else dt) and qpe.shape == (t, cfg.n_heads, 64)
    assert_q_match(qpe, rqpe, exact, "q_pe", _rtol(dt))
    deq = lambda qq, ss: np.asarray(qq.astype(F32)) * np.asarray(ss)[..., None]
    g, w = deq(q8, s), deq(rq8, rs)
    if exact and not had:  # one e4m3 step (or bf16 ulp without fp8) where the quantiser's input flipped
        if fp8:
            assert_e4m3_within_step(g, w, 128, "index q", max_frac=FLIP_FRAC)
        else:
            assert_within_ulps(q8, rq8, dt, 1, "index q", max_frac=FLIP_FRAC)
        # the weights are the same f32 products on both paths, up to the scale they are folded with
        np.testing.assert_allclose(np.asarray(wf) / np.asarray(s), np.asarray(rwf) / np.asarray(rs), rtol=2.0 ** -22,
                                   err_msg="index weights")
    else:  # dequantised q and the unfolded weights (w'' / s) within rounding
        np.testing.assert_allclose(g, w, rtol=0.13, atol=2e-2 * np.abs(w).max())
        np.testing.assert_allclose(np.asarray(wf) / np.asarray(s), np.asarray(rwf) / np.asarray(rs), rtol=1e-6)


# ----- V3.2: the parts in separate programs (split_phases) --------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t", [2, 20])
def test_v32_split_phases(mode, t):
    """Each part in its own programs computes what it computes in a shared program, op for op, and the kv insert's
    indexer rope partners found in registers equal the ones loaded again: every output byte equal."""
    cfg = V32Config.tiny()
    rng = np.random.default_rng(30 + t)
    cos, sin = rope_cos_sin(cached_inv_freqs(cfg.rope, 64), jnp.asarray(rng.integers(0, 2000, t), jnp.int32))
    kv_fmt, idx_fmt = MlaRecord656(16, "ue8m0"), IndexerRecord132(16)
    kv_args = (jnp.asarray(rng.normal(size=(t, 576)) * 2, BF16), jnp.asarray(rng.normal(size=(t, 128)), BF16),
               cos, sin, jnp.asarray(_slots(rng, t, 64)), _noise_cache(rng, kv_fmt, 4), _noise_cache(rng, idx_fmt, 4),
               jnp.asarray(1 + 0.1 * rng.normal(size=512), F32), jnp.asarray(1 + 0.1 * rng.normal(size=128), F32),
               jnp.asarray(0.1 * rng.normal(size=128), F32))
    q_args = (jnp.asarray(rng.normal(size=(t, cfg.n_heads, 192)), BF16),
              jnp.asarray(rng.normal(size=(t, cfg.index_n_heads, 128)), BF16),
              jnp.asarray(rng.normal(size=(t, cfg.index_n_heads)), F32), cos, sin)
    kv_forms = [dict(split_phases=sp, rope_pairs=rp) for sp in (False, True) for rp in ("loads", "registers")]
    for fn, static, args, forms in (
            (fused_kv_insert_v32, dict(kv_format=kv_fmt, index_format=idx_fmt, eps=1e-6, dtype=BF16,
                                       indexer_interleave=False, hadamard=True), kv_args, kv_forms),
            (fused_kv_insert_v32, dict(kv_format=kv_fmt, index_format=idx_fmt, eps=1e-6, dtype=BF16,
                                       indexer_interleave=True, hadamard=False), kv_args, kv_forms[:2]),
            (fused_q_v32, dict(nope_dim=128, dtype=BF16, indexer_interleave=False, hadamard=True, fp8=True), q_args,
             [dict(split_phases=False), dict(split_phases=True)])):
        outs = [jax.jit(functools.partial(fn, implementation="pallas", interpret=_interpret(mode), **form,
                                          **static))(*args) for form in forms]
        for form, got in zip(forms[1:], outs[1:]):
            for a, b in zip(outs[0], got):
                np.testing.assert_array_equal(np.asarray(a.view(jnp.uint8) if a.dtype.itemsize == 1 else a),
                                              np.asarray(b.view(jnp.uint8) if b.dtype.itemsize == 1 else b),
                                              err_msg=f"{fn.__name__} t={t} {form}")


def _kv_insert_forms(mode: str, seed: int, forms: list[dict]) -> tuple[np.ndarray, list[tuple[jax.Array, ...]]]:
    """(slots, the kv insert's (kv cache, index cache) per form) on one random 40-token step: real dims, noisy
    caches, the default static arguments plus each form's keyword arguments."""
    t = 40
    rng = np.random.default_rng(seed)
    cos, sin = rope_cos_sin(cached_inv_freqs(V32Config.tiny().rope, 64),
                            jnp.asarray(rng.integers(0, 2000, t), jnp.int32))
    kv_fmt, idx_fmt = MlaRecord656(16, "ue8m0"), IndexerRecord132(16)
    slots = _slots(rng, t, 64)
    args = (jnp.asarray(rng.normal(size=(t, 576)), BF16), jnp.asarray(rng.normal(size=(t, 128)) * 3, BF16),
            cos, sin, jnp.asarray(slots), _noise_cache(rng, kv_fmt, 4), _noise_cache(rng, idx_fmt, 4),
            jnp.asarray(1 + 0.1 * rng.normal(size=512), F32), jnp.asarray(1 + 0.1 * rng.normal(size=128), F32),
            jnp.asarray(0.1 * rng.normal(size=128), F32))
    return slots, [jax.jit(functools.partial(
        fused_kv_insert_v32, kv_format=kv_fmt, index_format=idx_fmt, eps=1e-6, dtype=BF16, indexer_interleave=False,
        hadamard=True, implementation="pallas", interpret=_interpret(mode), **form))(*args) for form in forms]


@pytest.mark.parametrize("mode", MODES)
def test_v32_kv_insert_hadamard_halves(mode):
    """The indexer key's Hadamard as two dots against H_64 ([a H + b H, a H - b H]) against one dot with H_128:
    the same exact products, float32 sums in another order, so the records agree within one storage step (a
    rounding flip at most), in both split forms; the MLA records byte for byte."""
    for split in (False, True):
        slots, ((kv1, ix1), (kv2, ix2)) = _kv_insert_forms(
            mode, 7, [dict(split_phases=split, hadamard_halves=h) for h in (True, False)])
        np.testing.assert_array_equal(np.asarray(kv1), np.asarray(kv2), err_msg=f"MLA records, split={split}")
        assert_cache_match(IndexerRecord132(16), ix1, ix2, slots, True, f"indexer records, split={split}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_tokens", [8, 32])
def test_v32_kv_insert_block_tokens(mode, block_tokens):
    """Programs of 8 tokens (the indexer dot then has fewer rows than tl.dot's 16) or 32 write what 16-token
    programs write: each row's math is the same, so the records agree within one storage step, split or not."""
    for split in (False, True):
        slots, ((kv1, ix1), (kv2, ix2)) = _kv_insert_forms(
            mode, 11, [dict(split_phases=split, block_tokens=bt) for bt in (block_tokens, 16)])
        assert_cache_match(MlaRecord656(16, "ue8m0"), kv1, kv2, slots, True, f"MLA records, split={split}")
        assert_cache_match(IndexerRecord132(16), ix1, ix2, slots, True, f"indexer records, split={split}")


def test_v32_kv_block_tokens_default() -> None:
    """block_tokens=None: 16 tokens per program up to T = 2048, 8 beyond, where 8-token grids exceed the split
    rule's program count and run unsplit."""
    from pallas_kernels import fused_insert_common as C
    from pallas_kernels.fused_insert_v32 import kv_block_tokens
    assert [kv_block_tokens(t) for t in (1, 64, 1024, 2048, 2049, 4096, 16384)] == [16, 16, 16, 16, 8, 8, 8]
    assert all(not C.split_phases(None, -(-t // kv_block_tokens(t)), "x") for t in (2049, 4096, 8192))


def test_v32_split_phases_rejects_unknown_forms() -> None:
    """Neither op takes a split form other than None / False / True: a ValueError naming the op."""
    from jds.bench.kernels_fused_insert import _cases
    (_, _, kv_fn, kv_static, kv_args, *_), (_, _, q_fn, q_static, q_args, *_), _ = _cases(False, (2,))
    with pytest.raises(ValueError, match="fused_kv_insert_v32: split_phases"):
        kv_fn(*kv_args, **kv_static, interpret=True, split_phases="kernels")
    with pytest.raises(ValueError, match="fused_kv_insert_v32: hadamard_halves"):
        kv_fn(*kv_args, **kv_static, interpret=True, hadamard_halves="auto")
    with pytest.raises(ValueError, match="fused_q_v32: split_phases"):
        q_fn(*q_args, **q_static, interpret=True, split_phases="programs")


# ----- V4: q head norm + RoPE, window kv RoPE + FP8 insert -------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt,dt,t", [
    pytest.param(MlaRecord584(128), BF16, 5, id="584-bf16-decode"),
    pytest.param(MlaRecord584(128), BF16, 20, id="584-bf16-prefill"),
    pytest.param(FloatRows(512, 128, BF16), BF16, 20, id="rows-bf16"),
    pytest.param(MlaRecord584(128), F32, 5, id="584-f32"),
])
def test_v4_qnorm_rope_kv_insert(mode, fmt, dt, t, tiles=None):
    cfg = V4Config.tiny()
    rng = np.random.default_rng(20 + t)
    nb = 3
    q = jnp.asarray(rng.normal(size=(t, cfg.n_heads, 512)) * 3, dt)
    kv = jnp.asarray(rng.normal(size=(t, 512)), dt)
    w = jnp.asarray(1 + 0.1 * rng.normal(size=512), F32)
    cos, sin = rope_cos_sin(cached_inv_freqs(cfg.rope_for(4), 64), jnp.asarray(rng.integers(0, 4000, t), jnp.int32))
    slots = _slots(rng, t, nb * 128)
    cache = _noise_cache(rng, fmt, nb)
    static = dict(window_format=fmt, eps=1e-6, dtype=dt, _kernel=dict(interpret=_interpret(mode), **(tiles or {})))
    (gq, gc), (wq, wc) = _run(fused_qnorm_rope_kv_insert_v4, static, q, kv, cos, sin, jnp.asarray(slots), cache, w)
    exact = mode == "interpret" and dt == BF16
    assert_q_match(gq, wq, exact, "q", _rtol(dt))
    assert_cache_match(fmt, gc, wc, slots, exact, "window cache")


@pytest.mark.parametrize("mode", MODES)
def test_v4_kv_insert_reads_columns_in_place(mode):
    """kv_col: V4's window insert reads kv in place from a wider array (the layer's fused input projection, passed
    whole) and writes what it writes from the rows sliced out, bit for bit, in each implementation; columns that
    do not fit are a ValueError naming the argument."""
    cfg, rng, t, nb = V4Config.tiny(), np.random.default_rng(6), 20, 3
    proj = jnp.asarray(rng.normal(size=(t, 96 + 512)) * 2, BF16)  # [q latent | kv]
    q = jnp.asarray(rng.normal(size=(t, cfg.n_heads, 512)) * 3, BF16)
    w = jnp.asarray(1 + 0.1 * rng.normal(size=512), F32)
    cos, sin = rope_cos_sin(cached_inv_freqs(cfg.rope_for(4), 64), jnp.asarray(rng.integers(0, 4000, t), jnp.int32))
    slots = jnp.asarray(_slots(rng, t, nb * 128))
    fmt = MlaRecord584(128)
    cache = _noise_cache(rng, fmt, nb)
    for impl in ("xla", "pallas"):
        f = functools.partial(fused_qnorm_rope_kv_insert_v4, window_format=fmt, eps=1e-6, dtype=BF16,
                              implementation=impl, interpret=_interpret(mode))
        sliced = f(q, proj[:, 96:], cos, sin, slots, cache, w)
        whole = f(q, proj, cos, sin, slots, cache, w, kv_col=96)
        for g, s_, what in zip(whole, sliced, ("q", "window cache")):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(s_), err_msg=f"{impl} {what}")
    with pytest.raises(ValueError, match=r"kv_col = 100: kv's rows take columns \[kv_col, kv_col \+ 512\) of its 608"):
        fused_qnorm_rope_kv_insert_v4(q, proj, cos, sin, slots, cache, w, window_format=fmt, eps=1e-6, dtype=BF16,
                                      kv_col=100)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tiles", [  # heads first (several heads of a token per program), with token tails
    pytest.param(dict(rows_per_program=8, heads_per_program=4), id="h4xt2"),
    pytest.param(dict(rows_per_program=16, heads_per_program=16), id="h16(all)xt1"),
    pytest.param(dict(rows_per_program=32, heads_per_program=8, num_warps=4), id="h8xt4-w4"),
])
def test_v4_tilings(mode, tiles):
    """Every tiling of the sweep in bench_fused_insert computes the same records (T = 20 tokens: a partial
    token block, two padding slots)."""
    test_v4_qnorm_rope_kv_insert(mode, MlaRecord584(128), BF16, 20, tiles)


# ----- the layers: implementation="pallas" prepare == "xla" prepare ------------------------------------------
def _prepare(m, x, b, c):
    return m.prepare(m.project_in(x), b, c)


def _batch(block_size: int, seed: int):
    """Two requests (a 6-token prefill chunk at 3 and a decode token at 20) + 2 padding tokens, shuffled pages."""
    rng = np.random.default_rng(seed)
    per_row = -(-21 // block_size)
    nb = 2 * per_row + 2
    tables = rng.permutation(nb)[: 2 * per_row].reshape(2, per_row).astype(np.int32)
    return make_batch([Chunk(0, 3, 6), Chunk(1, 20, 1)], tables, block_size, pad_to=9), nb


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("numerics", [  # fp8_linear off: it only changes the projections, and compiles slowly
    pytest.param(Numerics(fp8_linear=False, latent_scale_fmt="amax"), id="fp8cache-hadamard-amax",
                 marks=pytest.mark.slow),
    pytest.param(Numerics.serving(), id="serving")])
def test_v32_layer_prepare(mode, numerics, monkeypatch):
    from jds.v32 import V32Attention

    monkeypatch.setattr(C, "resolve_interpret", lambda interpret: _interpret(mode) if interpret is None else interpret)
    cfg = V32Config.tiny()
    batch, nb = _batch(cfg.block_size, 1)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(9, cfg.hidden_size)), BF16)
    res = {}
    for impl in ("xla", "pallas"):
        layer = V32Attention(cfg, numerics, rngs=nnx.Rngs(0), implementation=impl)
        # the kernel is in a fresh trace of the pallas layer's step, and only there
        assert (pallas_calls(_prepare, layer, x, batch, layer.init_cache(nb)) > 0) == (impl == "pallas"), impl
        res[impl] = nnx.jit(_prepare)(layer, x, batch, layer.init_cache(nb))
    (gq, gc), (wq, wc) = res["pallas"], res["xla"]
    # tolerances: inside one jit XLA fuses the reference's RoPE with its neighbours, which moves f32 roundings
    # (FMA contraction) and now and then flips a bf16 / e4m3 rounding; the kernel tests above check exactness
    slots = np.asarray(batch.slot_mapping)
    layer = V32Attention(cfg, numerics, rngs=nnx.Rngs(0))
    assert_cache_match(layer.kv_format, gc.kv, wc.kv, slots, False, "MLA cache")
    assert_cache_match(layer.index_format, gc.index_k, wc.index_k, slots, False, "indexer cache")
    assert_q_match(gq.full_q(), wq.full_q(), False, "q", 2e-2)
    assert_q_match(gq.index_w, wq.index_w, True, "index_w", 0)  # f32: one ulp on a few elements
    np.testing.assert_allclose(np.asarray(gq.indexer_q()), np.asarray(wq.indexer_q()), rtol=0.13,
                               atol=2e-2 * float(np.abs(np.asarray(wq.indexer_q())).max()))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer_id", [pytest.param(0, id="swa"), pytest.param(1, id="c4"),
                                      pytest.param(2, id="c128")])
def test_v4_layer_prepare(mode, layer_id, monkeypatch):
    from jds.v4 import V4Attention

    monkeypatch.setattr(C, "resolve_interpret", lambda interpret: _interpret(mode) if interpret is None else interpret)
    cfg = V4Config.tiny()
    batch, nb = _batch(cfg.block_size, 3)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(9, cfg.hidden_size)), BF16)
    res = {}
    for impl in ("xla", "pallas"):
        layer = V4Attention(cfg, Numerics(fp8_linear=False), layer_id, rngs=nnx.Rngs(0), implementation=impl)
        # the kernel is in a fresh trace of the pallas layer's step, and only there
        assert (pallas_calls(_prepare, layer, x, batch, layer.init_cache(nb)) > 0) == (impl == "pallas"), impl
        res[impl] = nnx.jit(_prepare)(layer, x, batch, layer.init_cache(nb))
    (gq, gc), (wq, wc) = res["pallas"], res["xla"]
    layer = V4Attention(cfg, Numerics(fp8_linear=False), layer_id, rngs=nnx.Rngs(0))
    assert_q_match(gq.q, wq.q, False, "q", 2e-2)  # tolerances: see test_v32_layer_prepare
    assert_cache_match(layer.window_format, gc.window, wc.window, np.asarray(batch.slot_mapping), False, "window")
    for name in ("state", "index_state"):  # write_state at "pallas" is XLA's bit for bit ([nb, 0] for the SWA layer)
        np.testing.assert_array_equal(np.asarray(getattr(gc, name)), np.asarray(getattr(wc, name)), err_msg=name)
    # the compressors' entries (pallas_kernels/compressor_pool.py at "pallas"), every record of the caches
    for name, fmt in layer.cache_formats().items():
        if name in ("compressed", "index_k"):
            every = np.arange(getattr(gc, name).shape[0] * fmt.entries_per_page)
            assert_cache_match(fmt, getattr(gc, name), getattr(wc, name), every, False, name)
    np.testing.assert_array_equal(np.asarray(gq.indexer_q()), np.asarray(wq.indexer_q()))


# ----- lowering checks (any machine) ----------------------------------------------------------------------------
def _lowering_cases(t: int = 33):
    dt = BF16
    cos = jnp.zeros((t, 32), F32)
    slots = jnp.zeros((t,), jnp.int32)
    kv32 = functools.partial(fused_kv_insert_v32, kv_format=MlaRecord656(64), index_format=IndexerRecord132(64),
                             eps=1e-6, dtype=dt, indexer_interleave=False, hadamard=True, interpret=False)
    kv32_args = (jnp.zeros((t, 576), dt), jnp.zeros((t, 128), dt), cos, cos, slots,
                 jnp.zeros((4, 64 * 656), jnp.uint8), jnp.zeros((4, 64 * 132), jnp.uint8),
                 jnp.ones(512), jnp.ones(128), jnp.zeros(128))
    proj32 = jnp.zeros((t, 1536 + 128 + 576), dt)
    q32 = functools.partial(fused_q_v32, nope_dim=128, dtype=dt, indexer_interleave=False, hadamard=True, fp8=True,
                            interpret=False)
    q32_args = (jnp.zeros((t, 128, 192), dt), jnp.zeros((t, 64, 128), dt), jnp.zeros((t, 64), F32), cos, cos)
    v4 = functools.partial(fused_qnorm_rope_kv_insert_v4, window_format=MlaRecord584(256), eps=1e-6, dtype=dt,
                           interpret=False)
    v4_args = (jnp.zeros((t, 64, 512), dt), jnp.zeros((t, 512), dt), cos, cos, slots,
               jnp.zeros((2, 256 * 584), jnp.uint8), jnp.ones(512))
    return [pytest.param(kv32, kv32_args, True, id=f"v32_kv_insert-t{t}"),
            pytest.param(q32, q32_args, False, id=f"v32_fused_q-t{t}"),
            pytest.param(v4, v4_args, True, id=f"v4_qnorm_rope_kv_insert-t{t}"),
            pytest.param(functools.partial(kv32, split_phases=True), kv32_args, True, id=f"v32_kv_insert-split-t{t}"),
            pytest.param(functools.partial(kv32, rope_pairs="loads"), kv32_args, True, id=f"v32_kv_insert-loads-t{t}"),
            pytest.param(functools.partial(q32, split_phases=True), q32_args, False, id=f"v32_fused_q-split-t{t}"),
            # the rows read in place from the fused input projections' outputs (V3.2: 1536 + 128 + 576 columns)
            pytest.param(functools.partial(kv32, kv_col=1664, index_col=1536), (proj32, proj32) + kv32_args[2:], True,
                         id=f"v32_kv_insert-cols-t{t}"),
            # ... V4-Flash: 1024 + 512 columns
            pytest.param(functools.partial(v4, kv_col=1024), (v4_args[0], jnp.zeros((t, 1536), dt)) + v4_args[2:], True,
                         id=f"v4_qnorm_rope_kv_insert-cols-t{t}")]


@pytest.mark.parametrize("fn,args,inserts", _lowering_cases())
def test_triton_lowering_real_dims(fn, args, inserts):
    """Pallas -> Triton IR for an (abstract) H200 at real V3.2/V4 dims, with the caches aliased in place."""
    hlo = C.check_triton_lowering(fn, *args)
    assert "__gpu$xla.gpu.triton" in hlo
    assert ("output_operand_aliases" in hlo) == inserts  # the cache operands are updated in place


@pytest.mark.parametrize("fn,args,inserts", _lowering_cases(1) + _lowering_cases(33))
def test_sm90_compile_no_spills(fn, args, inserts):
    """Triton IR -> PTX -> ptxas (sm_90a) with pip triton, at the decode (1 token) and prefill tilings: no register
    spills (skipped without triton)."""
    pytest.importorskip("triton")
    for k in C.compile_sm90_report(fn, *args):
        assert k["spill_bytes"] == 0, k
        assert k["registers"] <= 255, k


def test_unsupported_dims_fall_back_to_xla_prepare() -> None:
    """A config the Triton kernels cannot take (a 384-dim indexer head) still prepares, through the pure-JAX
    steps, with identical results: ``implementation="auto"`` must not fail on a HF config."""
    import dataclasses

    from jds.v32 import V32Attention
    from pallas_kernels.fused_insert_v32 import supports

    cfg = dataclasses.replace(V32Config.tiny(), index_head_dim=384)
    assert not supports(cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim)
    batch, nb = _batch(cfg.block_size, 1)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(9, cfg.hidden_size)), BF16)
    res = {}
    for impl in ("xla", "pallas"):
        numerics = dataclasses.replace(Numerics.bf16(), indexer_hadamard=False)  # H_n needs n = 2^k
        layer = V32Attention(cfg, numerics, rngs=nnx.Rngs(0), implementation=impl)
        res[impl] = jax.jit(lambda x, b, c, m=layer: m.prepare(m.project_in(x), b, c))(x, batch, layer.init_cache(nb))
    for a, b in zip(jax.tree.leaves(res["pallas"]), jax.tree.leaves(res["xla"])):  # one code path: exact
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
