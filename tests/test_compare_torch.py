"""The PyTorch comparator (jds/compare) against jds itself: the same cache bytes, the same logits within
the numerics' tolerance, the same top-k sets, in every boundary mode; on a GPU, the captured modes.

tests/reference/ stays the float64 oracle of jds; here the two implementations are compared with each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jds.batch import Chunk, make_batch  # noqa: E402
from jds.compare import TORCH_MODES  # noqa: E402
from jds.compare import torch_kernels as K  # noqa: E402
from jds.compare.torch_stack import TorchDecoder, TorchStepRunner, to_torch, torch_to_numpy  # noqa: E402
from jds.config import Numerics  # noqa: E402
from jds.model import Decoder, preset  # noqa: E402
from jds.ops.records import FloatRows, IndexerRecord132, MlaRecord584, MlaRecord656  # noqa: E402

NB = 8  # pages per cache


def _jds_forward(model: Decoder):
    """jds's step, jitted, returning the logits, the new caches and every layer's top-k."""
    gd, st = nnx.split(model)

    @jax.jit
    def fwd(st, ids, batch, caches, li):
        m = nnx.merge(gd, st)
        h, new, topks = m.embed(ids), [], []
        for layer, cache in zip(m.layers, caches):
            inp = layer.pre_attention(h)
            query, cache = layer.attn.prepare(inp, batch, cache)
            topk = layer.attn.select(query, batch, cache)
            h = layer.post_attention(h, layer.attn.attend(query, topk, batch, cache))
            new.append(cache)
            topks.append(topk)
        return m.head(h, li), new, topks

    return lambda *a: fwd(st, *a)


def _steps(arch: str) -> list[list[Chunk]]:
    # a prefill of two requests (V4: past one 128-token compressor block), then a decode of both
    n = 150 if arch == "v4" else 40
    return [[Chunk(0, 0, n), Chunk(1, 0, 20)], [Chunk(0, n, 1), Chunk(1, 20, 1)]]


def _inputs(arch: str, cfg):
    """Per step: (token ids, chunks, block table, the jds PagedBatch, logits indices); the same for every run.

    The jds batch of every step is padded to the prefill's token count (padding tokens: slot -1, as the runner
    buckets its steps), so jds's forward compiles one shape for both steps."""
    bt = np.arange(NB, dtype=np.int32).reshape(2, -1)
    rng = np.random.default_rng(1)
    pad_to = max(sum(c.num_tokens for c in chunks) for chunks in _steps(arch))
    for chunks in _steps(arch):
        ids = rng.integers(0, 256, sum(c.num_tokens for c in chunks)).astype(np.int32)
        w = -(-max(c.start + c.num_tokens for c in chunks) // cfg.block_size)
        b = make_batch(chunks, bt[:, :w], cfg.block_size, pad_to)
        yield ids, chunks, bt, b, jnp.asarray(np.asarray(b.query_start_loc[1:]) - 1)


def _jds_run(model: Decoder, arch: str) -> tuple[list[np.ndarray], list[list[np.ndarray]], list[Any]]:
    """jds's steps: per step the logits and every layer's top-k (of the real tokens); the final caches."""
    fwd, caches, logits, topks = _jds_forward(model), model.init_caches(NB), [], []
    for ids, _, _, b, li in _inputs(arch, model.cfg):
        n = len(ids)
        lj, caches, tj = fwd(jnp.asarray(np.pad(ids, (0, b.num_tokens - n))), b, caches, li)
        logits.append(np.asarray(lj))
        topks.append([np.asarray(t)[:n] for t in tj])
    return logits, topks, caches


def _model(arch: str, numerics: Numerics, moe: bool) -> Decoder:
    over = {"numerics": numerics}
    if moe:
        over.update(n_routed_experts=4, moe_topk=2, moe_intermediate_size=128)
    return Decoder(preset(f"{arch}-tiny", **over), seed=0, implementation="xla")


def _compare(arch: str, numerics: Numerics, modes: tuple[str, ...], moe: bool = False, device: str = "cpu") -> dict:
    model = _model(arch, numerics, moe)
    lj, tj, caches = _jds_run(model, arch)
    tm = {m: TorchDecoder.from_jds(model, NB, device) for m in modes}
    runners = {m: TorchStepRunner(tm[m], m) for m in modes}
    out = {"logits": [], "topk": [], "counts": []}
    for step, (ids, chunks, bt, _, _) in enumerate(_inputs(arch, model.cfg)):
        lt, tt, counts = {}, {}, {}
        for m, r in runners.items():
            key = r.prepare_inputs(ids, chunks, bt)
            if device != "cpu":  # a shape's first step captures the graphs; count and check the replay
                r.step(key)
                key = r.prepare_inputs(ids, chunks, bt)
            counts[m] = r.count_step(key)["launches"]
            lt[m] = r.last_env["logits"].cpu().numpy()
            tt[m] = [r.last_env[f"L{i}.topk"].cpu().numpy() for i in range(model.cfg.n_layers)]
        out["logits"].append((lj[step], lt))
        out["topk"].append((tj[step], tt))
        out["counts"].append(counts)
    out["model"], out["caches"], out["torch"] = model, caches, tm
    return out


def _ulp_nudged(model: Decoder, seed: int) -> Decoder:
    """``model`` with every nonzero embedding entry moved one bf16 ulp up or down at random: an input change of
    the size of one rounding, i.e. of what any change of summation order (another GEMM, another device) can do."""
    w = np.asarray(model.embed.weight[...])
    bits = w.view(np.uint16).astype(np.int32)
    step = np.random.default_rng(seed).choice(np.array([-1, 1], np.int32), size=bits.shape)
    bits = np.where((bits & 0x7FFF) != 0, bits + step, bits).astype(np.uint16)
    model.embed.weight.set_value(jnp.asarray(bits.view(w.dtype)))
    return model


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max() / np.abs(b.astype(np.float64)).max())


def _same_sets(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """[layers, tokens] bool: whether a token's top-k sets agree at a layer."""
    return np.array([[set(x[x >= 0].tolist()) == set(y[y >= 0].tolist()) for x, y in zip(p, q)]
                     for p, q in zip(a, b)]).reshape(len(a), -1)


def _differ(a: list[np.ndarray], b: list[np.ndarray]) -> list[int]:
    """Per layer: the number of tokens whose top-k sets differ."""
    return [int(n) for n in (~_same_sets(a, b)).sum(1)]


def _check_topk(tj: list[np.ndarray], tt: list[np.ndarray], max_frac: float) -> None:
    for i, (a, b, differ) in enumerate(zip(tj, tt, _differ(tj, tt))):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert differ <= max_frac * a.shape[0], f"layer {i}: top-k sets differ for {differ}/{a.shape[0]} tokens"


@pytest.mark.parametrize("arch,moe", [pytest.param("v32", True, marks=pytest.mark.slow), ("v4", True)])
def test_exact_numerics_match_jds(arch: str, moe: bool) -> None:
    """fp32, no quantisation: the two sides agree to fp32 rounding, with identical top-k sets and caches."""
    res = _compare(arch, Numerics.exact(), ("eager",), moe=moe)
    for lj, lt in res["logits"]:
        np.testing.assert_allclose(lt["eager"], lj, rtol=0, atol=2e-4 * np.abs(lj).max())
    for tj, tt in res["topk"]:
        _check_topk(tj, tt["eager"], 0.0)
    for i, c in enumerate(res["caches"]):
        pages = res["torch"]["eager"].cache_pages(i)
        for name, got in pages.items():
            np.testing.assert_allclose(got, np.asarray(getattr(c, name) if arch == "v4" else
                                                       {"kv": c.kv, "index_k": c.index_k}[name]),
                                       rtol=0, atol=1e-4, err_msg=f"layer {i} cache {name}")


def _comparable_rows(topk_a: list[list[np.ndarray]], topk_b: list[list[np.ndarray]], rows: list[np.ndarray]
                     ) -> list[np.ndarray]:
    """Per step, the logits rows whose values two runs can be held to: those of tokens whose top-k sets agree at
    every layer, in steps before which (and in which) no token's sets differed at any layer but the last.

    A different pick of a near-tie key changes that token's attention output by a step, not by a rounding;
    below the last layer it also changes the keys the token writes for the layers above, which every later
    token reads. At the last layer it reaches only the token's own logits (the caches hold the layers' inputs)."""
    out, clean = [], True
    for ta, tb, r in zip(topk_a, topk_b, rows):
        same = _same_sets(ta, tb)
        clean = clean and bool(same[:-1].all())
        out.append(np.flatnonzero(same.all(0)[r]) if clean else np.zeros(0, int))
    return out


def _check_within_rounding_sensitivity(res: dict, arch: str, numerics: Numerics | None = None) -> None:
    """Every torch mode equals torch eager, and jds and torch differ by no more than jds differs from itself under
    a one-ulp change of its input; out-of-graph launches eager > wide > narrow > full = 0.

    A fixed tolerance does not fit here: with FP8 caches and a top-k indexer, one rounding difference (another
    summation order) flips a quantised value or a near-tie pick, and the random tiny model amplifies that through
    the layers by an amount that depends on its weights and the device's arithmetic. So the bound is measured:
    twice the largest distance between jds and six ulp-nudged copies of itself, for the logits and for the number
    of tokens whose top-k sets differ (at least a tenth of the tokens, and one: a decode step of two tokens had one
    near-tie pick that none of the nudges moved); the greedy tokens must match wherever no nudge moved jds's own.
    Logits past that bound pass only where jds and torch picked different near-tie keys (in this step or before),
    and then only on the rows no differing pick reaches (``_comparable_rows``): a near-tie pick moves its token's
    output by a step that depends on the tie, not on rounding (docs/perf-log.md, sixty-fourth session). That the
    two sides compute the same function is the exact-numerics comparison."""
    base_l = [lj for lj, _ in res["logits"]]
    base_t = [tj for tj, _ in res["topk"]]
    noise_l, noise_t = [0.0] * len(base_l), [[0] * len(t) for t in base_t]
    noise_g = [np.zeros(lj.shape[0], bool) for lj in base_l]  # rows whose greedy pick a nudge moved
    for seed in range(6):
        ln, tn, _ = _jds_run(_ulp_nudged(_model(arch, numerics or Numerics.serving(), False), seed), arch)
        for s in range(len(base_l)):
            noise_l[s] = max(noise_l[s], _rel(ln[s], base_l[s]))
            noise_t[s] = [max(a, b) for a, b in zip(noise_t[s], _differ(tn[s], base_t[s]))]
            noise_g[s] |= ln[s].argmax(-1) != base_l[s].argmax(-1)
    torch_t = [tt["eager"] for _, tt in res["topk"]]
    comparable = _comparable_rows(torch_t, base_t, [np.asarray(li) for *_, li in _inputs(arch, res["model"].cfg)])
    picked_apart = False  # jds and torch picked different keys somewhere, in this step or before
    for s, ((lj, lt), tj) in enumerate(zip(res["logits"], base_t)):
        for m in TORCH_MODES:
            np.testing.assert_array_equal(lt[m], lt["eager"], err_msg=m)
        differ = _differ(tj, torch_t[s])
        for i, (d, n) in enumerate(zip(differ, noise_t[s])):
            assert d <= max(2 * n, 0.1 * tj[i].shape[0], 1), (s, i, d, n)
        picked_apart = picked_apart or any(differ)
        rows = np.arange(lj.shape[0])
        if _rel(lt["eager"], lj) > 2 * noise_l[s]:
            assert picked_apart, (s, "logits past the bound with every top-k pick the same", _rel(lt["eager"], lj),
                                  noise_l[s])
            rows = comparable[s]
            if rows.size:
                assert _rel(lt["eager"][rows], lj[rows]) <= 2 * noise_l[s], (s, rows, noise_l[s])
        assert ((lt["eager"].argmax(-1) == lj.argmax(-1)) | noise_g[s])[rows].all(), (s, rows, noise_g[s])
    for c in res["counts"]:
        assert c["eager"] > c["wide"] > c["narrow"] > c["full"] == 0, c


@pytest.mark.parametrize("arch", ["v32", pytest.param("v4", marks=pytest.mark.slow)])
def test_serving_numerics_every_mode(arch: str) -> None:
    """bf16 + FP8 caches and indexer (656/584/132-byte records) on the CPU: every mode bit-identical, jds within
    its own rounding sensitivity (``_check_within_rounding_sensitivity``).

    The MoE FFN is checked in fp32 only (test_exact_numerics_match_jds): with bf16 + FP8, one rounding flip
    changes an expert choice, and the layers after it amplify that past any tolerance meaningful here."""
    _check_within_rounding_sensitivity(_compare(arch, Numerics.serving(), TORCH_MODES), arch)


@pytest.mark.parametrize("arch,fmt", [("v32", "amax"), pytest.param("v32", "ue8m0", marks=pytest.mark.slow),
                                      pytest.param("v4", "ue8m0", marks=pytest.mark.slow)])
def test_fp8_linear_numerics_every_mode(arch: str, fmt: str) -> None:
    """The checkpoint's own numerics (FP8 linears, activations re-quantised per 128 with the checkpoint's scale
    format, FP8 caches and indexer): every torch mode bit-identical, jds within its own rounding sensitivity."""
    numerics = Numerics(dtype="bfloat16", kv_cache_dtype="fp8", fp8_linear=True, indexer_fp8=True,
                        act_scale_fmt=fmt)
    _check_within_rounding_sensitivity(_compare(arch, numerics, TORCH_MODES), arch, numerics)


@pytest.mark.parametrize("fmt", ["ue8m0", "amax"])
def test_fp8_linear_matches_jds(fmt: str) -> None:
    """``K.fp8_linear`` (its dequantised form off CUDA) against jds's ``fp8_linear`` on fresh random rows and a
    weight with zero rows past its out features: x quantised to the same bytes and scales, y within float32
    summation order of the same terms (a few float32 ulps of the largest output)."""
    from jds.nn import pad_out_rows
    from jds.ops import quant

    rng = np.random.default_rng(5)
    for m, k, n in ((5, 256, 384), (33, 512, 200)):
        wq, ws = quant.quantize_weight_blocks_jax(jnp.asarray(rng.standard_normal((n, k)), jnp.float32) * 0.05,
                                                  128, "amax")
        wq = pad_out_rows(wq)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32).astype(jnp.bfloat16)
        xq, sx = quant.act_quant(x, 128, fmt)
        tq, ts = K.act_quant(to_torch(x), 128, fmt)
        np.testing.assert_array_equal(tq.view(torch.uint8).numpy(), np.asarray(xq).view(np.uint8))
        np.testing.assert_array_equal(ts.numpy(), np.asarray(sx))
        want = np.asarray(quant.fp8_linear(x, wq, ws, jnp.float32, fmt))
        got = K.fp8_linear(to_torch(x), to_torch(wq), to_torch(ws), torch.float32, fmt).numpy()
        assert got.shape == want.shape == (m, wq.shape[0])
        np.testing.assert_allclose(got, want, rtol=0, atol=k * 2.0 ** -23 * np.abs(want).max())
        assert not got[:, n:].any()  # the zero rows' outputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["v32", "v4"])
def test_gpu_exact_every_mode_matches_jds(arch: str) -> None:
    """On the GPU, fp32 without quantisation (MoE FFN): each torch mode (graphs captured, then replayed) computes
    jds's function: logits to fp32 rounding, identical top-k sets in every layer."""
    res = _compare(arch, Numerics.exact(), TORCH_MODES, moe=True, device="cuda")
    for lj, lt in res["logits"]:
        for m in TORCH_MODES:
            np.testing.assert_allclose(lt[m], lj, rtol=0, atol=2e-4 * np.abs(lj).max(), err_msg=m)
    for tj, tt in res["topk"]:
        for m in TORCH_MODES:
            _check_topk(tj, tt[m], 0.0)
    for c in res["counts"]:
        assert c["eager"] > c["wide"] > c["narrow"] > c["full"] == 0, c


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["v32", "v4"])
def test_gpu_serving_every_mode_within_rounding_sensitivity(arch: str) -> None:
    """On the GPU, bf16 + FP8 (656/584/132-byte caches): as ``test_serving_numerics_every_mode``, with the graphs
    captured and replayed (``_check_within_rounding_sensitivity``; that the two sides compute the same function is
    test_gpu_exact_every_mode_matches_jds)."""
    _check_within_rounding_sensitivity(_compare(arch, Numerics.serving(), TORCH_MODES, device="cuda"), arch)


@pytest.mark.parametrize("fmt", ["ue8m0", "amax"])
def test_fp8_experts_match_jds(fmt: str) -> None:
    """FP8 routed experts (``experts_fp8``: e4m3 [E, out, in] + 128 x 128 scales, inputs re-quantised per 128):
    the comparator's every-expert FFN against jds's MoE (the grouped FP8 GEMM's XLA form) on the same rows, the
    routing the same (an fp32 router on the same values). The bound is one e4m3 step of a re-quantised activation
    (2^-3 of one of the 128 terms of a sum), which a bf16 rounding of the activation in another summation order
    can move; a wrong layout or scale would be off by O(1)."""
    num = Numerics(dtype="bfloat16", kv_cache_dtype="fp8", fp8_linear=True, indexer_fp8=True, experts_fp8=True,
                   act_scale_fmt=fmt)
    model = Decoder(preset("v32-tiny", n_layers=1, numerics=num, n_routed_experts=4, moe_topk=2,
                           moe_intermediate_size=128), seed=1, implementation="xla")
    x = jnp.asarray(np.random.default_rng(2).standard_normal((24, model.cfg.hidden_size)), jnp.float32)
    x = x.astype(jnp.bfloat16)
    want = np.asarray(model.layers[0].ffn(x).astype(jnp.float32))
    got = TorchDecoder.from_jds(model, 4).layers[0].ffn(to_torch(x)).float().numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -5 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["v32", "v4"])
def test_gpu_fp8_linear_every_mode_within_rounding_sensitivity(arch: str) -> None:
    """On the GPU, the checkpoint's numerics (FP8 linears on torch's blockwise scaled_mm; V3.2 with amax
    activation scales, V4 with its ue8m0 ones): as ``test_fp8_linear_numerics_every_mode``, with the graphs
    captured and replayed."""
    numerics = Numerics(dtype="bfloat16", kv_cache_dtype="fp8", fp8_linear=True, indexer_fp8=True,
                        act_scale_fmt="amax" if arch == "v32" else "ue8m0")
    _check_within_rounding_sensitivity(_compare(arch, numerics, TORCH_MODES, device="cuda"), arch, numerics)
    assert K.FP8_GEMM["path"] == "blockwise", K.FP8_GEMM


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["ue8m0", "amax"])
def test_gpu_blockwise_fp8_linear_matches_dequantised(fmt: str) -> None:
    """torch's blockwise scaled_mm (``K.fp8_linear`` on CUDA) against the same linear as one fp32 matmul of the
    dequantised operands, at decode and prefill rows, and a weight of 320 rows stored as jds stores it (zero rows
    up to whole 128-row scale blocks)."""
    rng = np.random.default_rng(7)
    for m, k, n in ((1, 1536, 3072), (64, 7168, 2304), (200, 512, 320)):
        rows = -(-n // 128) * 128
        w = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32) * 0.02).cuda()
        w[n:] = 0
        ws = K.block_scale(w.reshape(-1, 128, k // 128, 128).abs().amax((1, 3)), "amax", 1e-12)
        wq = K.quantize_e4m3(w / ws.repeat_interleave(128, 0).repeat_interleave(128, 1))
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(torch.bfloat16).cuda()
        got = K.fp8_linear(x, wq, ws, torch.bfloat16, fmt).to(torch.float32)  # the comparator's output dtype
        assert K.FP8_GEMM["path"] == "blockwise", K.FP8_GEMM
        xq, sx = K.act_quant(x, 128, fmt)
        want = torch.nn.functional.linear(K.dequant(xq, sx, 128), K.dequant_weight(wq, ws))
        # bf16's rounding (up to 2^-8 of a value), and Hopper's FP8 MMA accumulating a K block's products in fewer
        # bits than fp32 (DeepSeek-V3's report: about 14): a bound of those widths; a wrong scale layout is off by O(1)
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= 2.0 ** -7 * scale, (m, k, n)


def _rows(fmt, n: int, rng) -> np.ndarray:
    d = {"FloatRows": getattr(fmt, "dim", 0), "MlaRecord656": 576, "IndexerRecord132": 128, "MlaRecord584": 512}
    x = rng.standard_normal((n, d[type(fmt).__name__])).astype(np.float32) * 3
    x[0] = 0.0  # an all-zero row: the scale floor
    x[1, :64] *= 1e-6  # a tiny block
    return x


@pytest.mark.parametrize("fmt", [MlaRecord656(4, "ue8m0"), MlaRecord656(4, "amax"), IndexerRecord132(4),
                                 MlaRecord584(4), FloatRows(96, 4, jnp.bfloat16)], ids=lambda f: type(f).__name__)
def test_record_bytes_match_jds(fmt) -> None:
    """The same rows written through the same slots give the same cache bytes, and read back the same."""
    from jds.ops.paging import empty_cache, read_records, write_records

    rng = np.random.default_rng(0)
    rows = _rows(fmt, 6, rng).astype(np.float32)
    if type(fmt).__name__ in ("MlaRecord656", "MlaRecord584"):  # the writers see bf16 rows
        rows = np.array(jnp.asarray(rows, jnp.bfloat16).astype(jnp.float32))
    slots = np.array([5, 0, -1, 11, 2, 7], np.int32)
    nb = 3
    # jds's side compiled, as its layers run it (eagerly every primitive would compile on its own)
    jc = jax.jit(write_records, static_argnums=1)(empty_cache(fmt, nb), fmt, jnp.asarray(slots), jnp.asarray(rows))
    st = K.new_storage(fmt, nb, torch.device("cpu"))
    K.write_records(st, fmt, torch.from_numpy(slots).long(), torch.from_numpy(rows))
    got = torch_to_numpy(st[: nb * fmt.page_elems].view(nb, -1))
    np.testing.assert_array_equal(got.view(np.uint8), np.asarray(jc).view(np.uint8))
    q = np.array([[5, 11], [0, 7]], np.int32)
    back = K.read_records(st, fmt, torch.from_numpy(q).long()).numpy()
    np.testing.assert_array_equal(back, np.asarray(jax.jit(read_records, static_argnums=1)(jc, fmt, jnp.asarray(q))))


def test_weights_bit_identical() -> None:
    model = Decoder(preset("v4-tiny", n_layers=2), seed=3, implementation="xla")
    t = TorchDecoder.from_jds(model, 2)
    w = np.asarray(model.layers[1].attn.wq_b.weight[...])
    np.testing.assert_array_equal(torch_to_numpy(t.params["layers.1.attn.wq_b.weight"]).view(np.uint16),
                                  w.view(np.uint16))
    assert to_torch(w).dtype == torch.bfloat16


def test_bad_mode_and_numerics() -> None:
    model = Decoder(preset("v32-tiny", n_layers=1), implementation="xla")
    with pytest.raises(ValueError, match="mode"):
        TorchStepRunner(TorchDecoder.from_jds(model, 2), "fused")
    fp8 = Decoder(preset("v4-tiny", n_layers=1, numerics=Numerics(dtype="bfloat16", kv_cache_dtype="fp8",
                                                                    fp8_linear=True, wo_a_fp8=True)),
                  implementation="xla")
    with pytest.raises(ValueError, match="wo_a_fp8"):
        TorchDecoder.from_jds(fp8, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["v32", "v4"])
def test_gpu_graph_modes_match_eager(arch: str) -> None:
    """On the GPU: every captured mode replays to the eager logits (twice: capture, then replay), and only
    the eager regions launch outside graphs."""
    cfg = preset(f"{arch}-tiny", numerics=Numerics.serving())
    model = Decoder(cfg, seed=0, implementation="xla")
    bt = np.arange(NB, dtype=np.int32).reshape(2, -1)
    rng = np.random.default_rng(2)
    logits, counts = {}, {}
    for m in TORCH_MODES:
        r = TorchStepRunner(TorchDecoder.from_jds(model, NB, "cuda"), m)
        logits[m] = []
        for chunks in _steps(arch):
            ids = np.random.default_rng(sum(c.num_tokens for c in chunks)).integers(0, 256, sum(
                c.num_tokens for c in chunks)).astype(np.int32)
            key = r.prepare_inputs(ids, chunks, bt)
            r.step(key)  # capture
            r.prepare_inputs(ids, chunks, bt)
            counts[m] = r.count_step(key)["launches"]  # replay
            logits[m].append(r.last_env["logits"].cpu().numpy())
    del rng
    for m in TORCH_MODES:
        for a, b in zip(logits[m], logits["eager"]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * np.abs(b).max(), err_msg=m)
    assert counts["eager"] > counts["wide"] > counts["narrow"] > counts["full"] == 0, counts


def test_comparison_table_pairs_modes_and_best() -> None:
    from jds.compare.torch_bench import comparison_table

    def m(ms: float) -> dict:
        return {k: {"mean_ms": ms} for k in ("ttft_128", "prefill_64x128_step", "decode_b1_ctx64",
                                              "decode_b64_ctx64")}

    jax_res = {"modes": {"wide": {**m(8.0), "dispatches_per_step": {"captured": 9, "eager": 8}},
                         "fused": m(4.0)}}
    torch_res = {"modes": {"eager": m(20.0), "wide": {**m(16.0), "launches_per_step": {"ttft_128": {"launches": 5}}},
                           "full": m(5.0)}}
    text, ratios = comparison_table(jax_res, torch_res, 64)
    assert ratios["ttft_128:wide/wide"] == 0.5 and ratios["ttft_128:fused/full"] == 0.8
    assert ratios["decode_b64_ctx64:best/best"] == 0.8
    assert "torch:eager" in text and "best/best" in text and "launches/step" in text


def test_step_rejects_mismatched_inputs() -> None:
    model = Decoder(preset("v32-tiny", n_layers=1), implementation="xla")
    r = TorchStepRunner(TorchDecoder.from_jds(model, 4), "narrow")
    bt = np.arange(4, dtype=np.int32).reshape(2, 2)
    with pytest.raises(ValueError, match="ids"):
        r.prepare_inputs(np.zeros(3, np.int32), [Chunk(0, 0, 4)], bt)
    with pytest.raises(ValueError, match="request rows"):
        r.prepare_inputs(np.zeros(4, np.int32), [Chunk(1, 0, 4)], bt)


_TRITON_CHECK = r"""
import torch
from jds.ops.records import IndexerRecord132
from jds.compare import torch_kernels as K
from jds.compare.triton_kernels import paged_indexer_logits
fmt = IndexerRecord132(16, 128)
st = K.new_storage(fmt, 6, torch.device("cpu"))
g = torch.Generator().manual_seed(0)
K.write_records(st, fmt, torch.arange(96), torch.randn(96, 128, generator=g))
bt, req = torch.tensor([[4, 1, 3], [0, 5, 2]]), torch.tensor([0, 1, 1, 0, 1])
q, w = torch.randn(5, 4, 128, generator=g), torch.randn(5, 4, generator=g)
got = paged_indexer_logits(q, w, st, fmt, bt, req, block_n=16)
ref = K.indexer_logits(q, w, K.gather_request_rows(st, fmt, bt, 48), req)
assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4 * float(ref.abs().max())), (got - ref).abs().max()
"""


def test_triton_paged_indexer_logits_interpreted() -> None:
    """The Triton kernel under Triton's CPU interpreter (its switch is an environment variable Triton
    reads at import, hence the subprocess) equals the torch-op path on random FP8 pages."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root}
    subprocess.run([sys.executable, "-c", _TRITON_CHECK], check=True, env=env, cwd=root, timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_triton_indexer_matches_torch_ops() -> None:
    """Compiled for the GPU, the Triton indexer gives the torch-op path's logits in a V3.2 stack."""
    cfg = preset("v32-tiny", numerics=Numerics.serving())
    model = Decoder(cfg, seed=0, implementation="xla")
    bt = np.arange(NB, dtype=np.int32).reshape(2, -1)
    out = {}
    for kern in ("torch", "triton"):
        r = TorchStepRunner(TorchDecoder.from_jds(model, NB, "cuda", indexer_kernel=kern), "eager")
        for chunks in _steps("v32"):
            ids = np.arange(sum(c.num_tokens for c in chunks), dtype=np.int32)
            out[kern] = r.execute(ids, chunks, bt).cpu().numpy()
    np.testing.assert_allclose(out["triton"], out["torch"], rtol=0, atol=1e-2 * np.abs(out["torch"]).max())


@pytest.mark.slow  # a whole (tiny) bench run of both sides: minutes on the CPU
def test_bench_boundary_both_backends_one_table(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "both.json"
    # with an FP8 checkpoint's linears on both sides (the bf16 ones are the other comparisons' of this file)
    p = subprocess.run([sys.executable, "-m", "jds.bench.boundary", "--backend", "jax", "torch", "--arch", "v32",
                        "--size", "tiny", "--layers", "1", "--intermediate", "128", "--ctx", "128", "--quick",
                        "--modes", "fused", "--torch-modes", "narrow", "full", "--fp8-weights", "--out", str(out)],
                       check=True, cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True,
                       timeout=1200)
    assert "fused/full" in p.stdout and "best/best" in p.stdout
    res = json.loads(out.read_text())
    assert res["meta"]["complete"] and set(res["torch"]["v32"]["modes"]) == {"narrow", "full"}
    assert res["torch"]["v32"]["modes"]["full"]["launches_per_step"]["ttft_128"]["launches"] == 0
    assert res["comparison"]["v32"]["ttft_128:fused/full"] > 0
    assert res["meta"]["fp8_weights"] and "fp8_linear=True" in res["torch"]["v32"]["config"]
    assert res["torch"]["v32"]["fp8_gemm"]["path"] == "dequantised"  # on the CPU
    from jds.bench.report import _boundary_vs_torch

    assert "same FP8 weights (torch's FP8 GEMM: dequantised)" in _boundary_vs_torch(res)[0]


class _FakeGraph:
    """A CPU stand-in for torch.cuda.CUDAGraph: the 'capture' runs the ops eagerly; once bound to its
    segment, a replay recomputes the segment from its static inputs and writes into its static outputs
    in place, which is what a real replay does to the captured addresses."""

    def __init__(self) -> None:
        self.seg = None

    def replay(self) -> None:
        if self.seg is None:
            return  # the replay right after capture: the eager 'capture' already computed the outputs
        cap = dict(self.seg.static_in)
        for f in self.seg.fns:
            cap.update(f(cap))
        for k, v in self.seg.static_out.items():
            v.copy_(cap[k])


@pytest.mark.parametrize("arch,mode", [("v32", "wide"), ("v4", "narrow"), pytest.param("v32", "narrow", marks=pytest.mark.slow),
                                       pytest.param("v32", "full", marks=pytest.mark.slow)])
def test_capture_bookkeeping_with_fake_graphs(arch: str, mode: str, monkeypatch) -> None:
    """The capture/replay path (static inputs copied in, re-produced keys such as the residual taken from
    the static outputs, eager regions in between), run on the CPU with fake graphs: equal to eager."""
    import contextlib

    class _Stream:
        def wait_stream(self, other) -> None:  # noqa: ANN001
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    cfg = preset(f"{arch}-tiny", numerics=Numerics.serving())
    model = Decoder(cfg, seed=0, implementation="xla")
    bt = np.arange(NB, dtype=np.int32).reshape(2, -1)
    ref = TorchStepRunner(TorchDecoder.from_jds(model, NB), "eager")
    fake = TorchStepRunner(TorchDecoder.from_jds(model, NB), mode)
    fake.use_graphs = True
    rng = np.random.default_rng(5)
    for chunks in _steps(arch) + [[Chunk(0, _steps(arch)[1][0].start + 1, 1), Chunk(1, 22, 1)]]:
        ids = rng.integers(0, 256, sum(c.num_tokens for c in chunks)).astype(np.int32)
        want = ref.execute(ids, chunks, bt).clone()
        key = fake.prepare_inputs(ids, chunks, bt)
        first = fake._shapes[key][1][0].graph is None
        got = fake.step(key).clone()
        for s in fake._shapes[key][1]:
            if s.graphed:
                s.graph.seg = s
        if first:  # the same shape again, now by replay (the caches' rewrite is idempotent)
            fake.prepare_inputs(ids, chunks, bt)
            got = fake.step(key).clone()
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_comparison_table_torch_only_reports_narrow_over_wide() -> None:
    from jds.compare.torch_bench import comparison_table

    tm = {"modes": {"wide": {"ttft_128": {"mean_ms": 10.0}}, "narrow": {"ttft_128": {"mean_ms": 4.6}}}}
    text, ratios = comparison_table(None, tm, 64)
    assert abs(ratios["ttft_128:torch_narrow/torch_wide"] - 0.46) < 1e-12 and "torch_narrow/torch_wide" in text


def test_torch_stage_profile_names_every_stage() -> None:
    """The per-stage profile of the comparator's eager step: every stage of the step is named once per layer
    and the totals add up (host time here; device time on a GPU)."""
    from jds.compare.torch_profile import STAGES, instrument, stage_times, table

    model = Decoder(preset("v32-tiny", n_layers=1, numerics=Numerics.serving()), seed=0, implementation="xla")
    tm = TorchDecoder.from_jds(model, NB)
    instrument(tm)
    r = TorchStepRunner(tm, "eager")
    bt = np.arange(NB, dtype=np.int32).reshape(2, -1)
    chunks = [Chunk(0, 0, 5), Chunk(1, 0, 3)]
    res = stage_times(r, np.arange(8, dtype=np.int32), chunks, bt, n=1, warm=1)
    assert set(res) == set(STAGES) | {"total"}
    assert all(v["host_us"] > 0 for v in res.values())
    assert res["total"]["host_us"] == pytest.approx(sum(res[s]["host_us"] for s in STAGES))
    assert "indexer logits + top-k" in table({"shapes": {"x": res}})


def test_step_end_ids_on_both_backends(monkeypatch) -> None:
    """--step-end ids: each backend's timed step ends at the chunks' greedy ids on the host (jds through the
    sampler's pinned-host copy, torch through argmax + .cpu()); "logits" reads the logits rows."""
    import jds.bench.boundary as boundary
    import jds.sampling
    from jds.bench.stack import block_table, make_runner, step_shapes
    from jds.compare import torch_bench

    model = Decoder(preset("v32-tiny", n_layers=1), implementation="xla")
    chunks = step_shapes(128)["ttft_128"]
    calls = []
    real = jds.sampling.greedy_tokens_host
    monkeypatch.setattr(jds.sampling, "greedy_tokens_host", lambda x: calls.append(1) or real(x))
    r = make_runner(model, "fused", 4, 128)
    for end, n_calls in (("ids", 3), ("logits", 3)):
        stats, _ = boundary.time_steps(r, chunks, 1, 2, end=end)
        assert stats["n"] == 2 and stats["mean_ms"] > 0 and len(calls) == n_calls
    tr = TorchStepRunner(TorchDecoder.from_jds(model, r.num_blocks), "eager")
    bt = block_table(r, 1)
    for end in ("ids", "logits"):
        assert torch_bench.time_torch_steps(tr, chunks, bt, 1, 2, end)["n"] == 2
