"""MTP speculative decoding (``Engine(speculative="mtp")``, jds.engine.core): greedy token streams are the same with
and without it on a tiny V4-block model with an MTP module (random weights), for prompts of several lengths, chunked
prefill, concurrent requests, max_tokens and EOS / stop-token stops; an oracle draft (the reference run's next
token) exercises the accept path (2 tokens per step, a stop on the first of the pair); unsupported configurations
are refused with a ValueError naming the field.

Both runners are batch-invariant (one token bucket), so the verify steps (2 tokens per decode) and the plain decode
steps run the same shapes and the comparison is exact, not subject to last-bit differences between buckets.
"""

from __future__ import annotations

import numpy as np
import pytest

from jds.config import RunnerConfig, preset
from jds.engine import Engine, SamplingParams
from jds.engine.fake import FakeRunner
from jds.model import Decoder
from jds.runner import ModelRunner
from tests.test_engine import run_all

CFG = RunnerConfig(mode="fused", num_blocks=8, max_num_seqs=4, max_num_tokens=24, max_model_len=256,
                   batch_invariant=True)


class _EosRunner(ModelRunner):
    """A runner whose EOS id the test picks (the random model's own EOS is never its greedy token)."""

    eos: int = 257

    @property
    def eos_token_id(self) -> int:
        return self.eos


class _SmallPool:
    """``runner`` as an engine sees it with a pool of ``num_blocks`` pages (everything else is the runner's)."""

    def __init__(self, runner: _EosRunner, num_blocks: int) -> None:
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "num_blocks", num_blocks)

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def __setattr__(self, name: str, value) -> None:  # _run sets the eos id on the runner itself
        setattr(self._runner, name, value)


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder(preset("v4-tiny-block", mtp_layers=1), seed=3)


@pytest.fixture(scope="module")
def runners(model: Decoder) -> tuple[_EosRunner, _EosRunner]:
    """(plain, speculative): two runners (own caches) over one model."""
    return _EosRunner(model, CFG), _EosRunner(model, CFG)


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    return {f"p{n}": rng.integers(0, 256, size=n).tolist() for n in (1, 5, 17, 40)}  # 40 > max_num_tokens: chunked


def _run(runner: _EosRunner, reqs: dict, eos: int = 257, oracle: dict[str, list[int]] | None = None,
         speculative: str | None = "mtp") -> tuple[dict, Engine]:
    runner.eos = eos
    eng = Engine(runner, async_steps=False, speculative=speculative)
    if oracle is not None:  # the draft is the reference's next token: every draft is accepted
        eng.propose = lambda req, d: (oracle[req.request_id][len(req.output_ids)]
                                      if len(req.output_ids) < len(oracle[req.request_id]) else d)
    return run_all(eng, reqs), eng


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def test_same_tokens_with_and_without_mtp(runners) -> None:
    plain, spec = runners
    reqs = {rid: (p, _greedy(n, ignore_eos=True)) for (rid, p), n in zip(_prompts().items(), (9, 14, 1, 20))}
    ref, _ = _run(plain, reqs, speculative=None)
    got, eng = _run(spec, reqs)
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in ref.items()}
    assert all(v["reason"] == "length" and len(v["tokens"]) == reqs[r][1].max_tokens for r, v in got.items())
    assert eng.stats().num_draft_tokens > 0  # drafts were verified (the random MTP's are mostly rejected)
    # accept path: oracle drafts, every one accepted, two tokens a step, max_tokens exact (odd and even)
    got, eng = _run(spec, reqs, oracle={r: v["tokens"] for r, v in ref.items()})
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in ref.items()}
    st = eng.stats()
    assert st.num_draft_tokens > 10 and st.num_accepted_tokens == st.num_draft_tokens


def test_stops_on_eos_and_stop_token_inside_an_accepted_pair(runners) -> None:
    plain, spec = runners
    prompt = _prompts()["p5"]
    ref, _ = _run(plain, {"a": (prompt, _greedy(24, ignore_eos=True))}, speculative=None)
    toks = ref["a"]["tokens"]
    # with oracle drafts the steps emit outputs 0 | 1,2 | 3,4 | ...: an odd index is the first of an accepted pair
    k = next(i for i in range(1, len(toks)) if i % 2 == 1 and toks[i] not in toks[:i])
    eos = toks[k]
    ref_eos, _ = _run(plain, {"a": (prompt, _greedy(24))}, eos=eos, speculative=None)
    assert ref_eos["a"]["tokens"] == toks[: k + 1] and ref_eos["a"]["reason"] == "stop"
    for oracle in (None, {"a": toks}):
        got, _ = _run(spec, {"a": (prompt, _greedy(24))}, eos=eos, oracle=oracle)
        assert got["a"]["tokens"] == toks[: k + 1] and got["a"]["reason"] == "stop"
        got, _ = _run(spec, {"a": (prompt, _greedy(24, ignore_eos=True, stop_token_ids=(eos,)))}, oracle=oracle)
        assert got["a"]["tokens"] == toks[: k + 1] and got["a"]["reason"] == "stop"


def test_concurrent_requests_and_partial_acceptance(runners) -> None:
    """Several requests at once (chunked prefill next to decodes); the oracle for half of them only, so accepted
    and rejected drafts share steps."""
    plain, spec = runners
    ps = _prompts()
    reqs = {r: (p, _greedy(n, ignore_eos=True)) for (r, p), n in zip(ps.items(), (30, 7, 12, 25))}
    ref, _ = _run(plain, reqs, speculative=None)
    got, _ = _run(spec, reqs)
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in ref.items()}
    half = {r: v["tokens"] for r, v in ref.items() if r in ("p1", "p17")}
    eng_oracle = lambda req, d: (half[req.request_id][len(req.output_ids)]  # noqa: E731
                                 if req.request_id in half and len(req.output_ids) < len(half[req.request_id])
                                 else d)
    spec.eos = 257
    eng = Engine(spec, async_steps=False, speculative="mtp")
    eng.propose = eng_oracle
    got = run_all(eng, reqs)
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in ref.items()}
    st = eng.stats()
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_refusals(model: Decoder) -> None:
    with pytest.raises(ValueError, match="speculative"):
        Engine(FakeRunner(block_size=4, num_blocks=8), async_steps=False, speculative="mtp")
    with pytest.raises(ValueError, match="speculative"):
        Engine(FakeRunner(block_size=4, num_blocks=8), speculative="eagle")
    plain = ModelRunner(model, CFG)
    with pytest.raises(ValueError, match="async_steps"):
        Engine(plain, async_steps=True, speculative="mtp")
    with pytest.raises(ValueError, match="mode"):
        Engine(ModelRunner(model, CFG, mode="narrow"), async_steps=False, speculative="mtp")
    with pytest.raises(ValueError, match="mtp_layers"):
        Engine(ModelRunner(Decoder(preset("v4-tiny-block"), seed=3), CFG), async_steps=False, speculative="mtp")
    eng = Engine(plain, speculative="mtp")  # async_steps None: the synchronous loop
    assert not eng.async_steps
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request("x", [1, 2], SamplingParams(max_tokens=4, temperature=0.7))
    eng.add_request("y", [1, 2], SamplingParams(max_tokens=4, temperature=0.7, top_k=1))  # greedy by top_k


@pytest.mark.slow  # CI budget: the token streams (the requirement) are checked by the quick tests above
def test_mtp_drafts_match_a_from_scratch_mtp() -> None:
    """The MTP cache bookkeeping: every draft the engine's MTP proposes (after prefill chunks, accepted pairs and
    rejected drafts) equals the MTP's token computed in one pass over the request's accepted tokens, i.e. the MTP
    cache held exactly the accepted positions' entries (a rejected row's entry would change later drafts).

    In float32 (``Numerics.exact``): the engine's steps and the one-pass reference run other shapes, and in bf16
    the random MTP's logits move by tenths between them (its argmax flips at near ties); float32 keeps the
    difference to rounding, so a draft may differ from the reference only at a near tie."""
    import jax.numpy as jnp
    from flax import nnx

    from jds.batch import Chunk, make_batch
    from jds.config import Numerics

    model = Decoder(preset("v4-tiny-block", mtp_layers=1, numerics=Numerics.exact()), seed=3)
    plain, spec = _EosRunner(model, CFG), _EosRunner(model, CFG)
    ps = _prompts()
    reqs = {r: (ps[r], _greedy(16, ignore_eos=True)) for r in ("p17", "p40")}  # p40: a chunked prefill
    ref, _ = _run(plain, reqs, speculative=None)
    half = {r: v["tokens"] for r, v in ref.items() if r == "p40"}  # oracle drafts: accepted; p17's: rejected
    seen: dict[tuple[str, int], int] = {}

    def propose(req, d):
        seen[(req.request_id, len(req.output_ids))] = d
        o = half.get(req.request_id)
        return o[len(req.output_ids)] if o is not None and len(req.output_ids) < len(o) else d

    eng = Engine(spec, async_steps=False, speculative="mtp")
    eng.propose = propose
    got = run_all(eng, reqs)
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in ref.items()}
    assert 0 < eng.num_accepted_tokens < eng.num_draft_tokens

    @nnx.jit
    def one_pass(model, tokens, nxt, batch):
        h, _ = model.forward_hidden(tokens, batch, model.init_caches(1))
        mtp = model.mtp[0]
        t = tokens.shape[0]
        return mtp(h.streams, nxt, batch, mtp.init_cache(1), model.embed, model.head, jnp.arange(t)).logits

    checked = 0
    for rid, (prompt, _) in reqs.items():
        s = prompt + ref[rid]["tokens"]
        t = len(s) - 1  # positions 0..t-1 have main hidden states; row p pairs token p + 1
        batch = make_batch([Chunk(0, 0, t)], np.zeros((1, 1), np.int32), model.cfg.block_size)
        logits = np.asarray(one_pass(model, jnp.asarray(s[:t], jnp.int32), jnp.asarray(s[1:], jnp.int32), batch))
        for (r, k), d in seen.items():  # drafted after k outputs: the row of position len(prompt) + k - 2
            if r == rid:
                row = logits[len(prompt) + k - 2]
                assert d == int(row.argmax()) or row.max() - row[d] < 1e-4, (rid, k, d, int(row.argmax()))
                checked += 1
    assert checked >= 20


def test_server_refuses_sampling_and_exports_draft_counters(runners) -> None:
    """Over HTTP: a non-greedy request is a 400 naming ``temperature``; greedy ones run, and /metrics carries the
    draft counters. (On the module's speculative runner: a fresh one would only compile the same steps again.)"""
    import asyncio
    import threading

    import httpx

    from jds.engine.loop import EngineLoop
    from jds.server.app import ServerConfig, build_app, serve
    from jds.server.tokenizer import ByteTokenizer
    from tests.test_server import free_port, metric

    spec = runners[1]
    spec.eos = 257
    engine = Engine(spec, async_steps=False, speculative="mtp")
    loop = EngineLoop(engine)
    app, _ = build_app(loop, ByteTokenizer(), ServerConfig("m"))
    port, aio, started = free_port(), asyncio.new_event_loop(), threading.Event()
    box = {}

    def main() -> None:
        asyncio.set_event_loop(aio)
        box["site"] = aio.run_until_complete(serve(app, "127.0.0.1", port))
        started.set()
        aio.run_forever()

    threading.Thread(target=main, daemon=True).start()
    assert started.wait(10)
    loop.start(engine.runner.warmup_speculative)  # as serve.py warms up with --speculative
    base = f"http://127.0.0.1:{port}"
    try:
        assert loop.ready.wait(30)
        r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        r = httpx.post(base + "/v1/completions", timeout=60, json={"prompt": [1, 2, 3], "max_tokens": 6,
                                                                  "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = httpx.get(base + "/metrics").text
        drafts = metric(text, "vllm:spec_decode_num_draft_tokens_total")
        assert drafts >= 1 and metric(text, "vllm:spec_decode_num_accepted_tokens_total") <= drafts
    finally:
        loop.shutdown()
        asyncio.run_coroutine_threadsafe(box["site"].cleanup(), aio).result(10)
        aio.call_soon_threadsafe(aio.stop)


def test_cli_flags() -> None:
    """serve.py: --speculative mtp needs --no-async (refused at parse time); --mtp-layers reaches the model."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "serve.py")
    spec = importlib.util.spec_from_file_location("jds_serve_cli", path)
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    with pytest.raises(SystemExit):
        serve.parse_args(["--preset", "v4-tiny-block", "--mtp-layers", "1", "--mode", "fused", "--speculative", "mtp"])
    a = serve.parse_args(["--preset", "v4-tiny-block", "--mtp-layers", "1", "--mode", "fused", "--speculative", "mtp",
                          "--no-async"])
    assert a.speculative == "mtp" and a.model_overrides["mtp_layers"] == 1 and not a.async_steps


def test_preemption_with_drafts(runners) -> None:
    """A pool too small for both requests: drafts that cross a page, preemption (the victim's draft dropped, its
    recompute drafting afresh) and the shrink of a drafted decode to 1 token keep the greedy streams.

    The reference is the module's plain runner (8 pages: no preemption; batch-invariant, so the streams do not
    depend on the pool or the page placement); only the speculative engine gets the small pool: the module's
    speculative runner seen through a 3-page pool (the engine allocates, preempts and places pages by the
    runner's ``num_blocks``; the runner's own cache simply has pages the engine never hands out), so its
    compiled steps serve here too instead of a 3-page runner compiling the same model again."""
    rng = np.random.default_rng(1)
    reqs = {f"r{i}": (rng.integers(0, 256, size=n).tolist(), _greedy(30, ignore_eos=True))
            for i, n in enumerate((100, 110))}
    ref, _ = _run(runners[0], reqs, speculative=None)
    oracle = {r: v["tokens"] for r, v in ref.items()}
    spec = _SmallPool(runners[1], 3)  # 3 pages of 128: two requests that each grow past 128 tokens need 4
    for o in (None, oracle):
        got, eng = _run(spec, reqs, oracle=o)
        assert {r: v["tokens"] for r, v in got.items()} == oracle
        assert eng.stats().num_preemptions > 0
