"""Async stepping (CPU): the device sampler against the host sampler, and the engine with async stepping
on and off giving identical streams — on the FakeRunner (greedy and seeded, eos, stop tokens,
max_tokens, preemption, aborts and faults in flight, stop strings through the server) and on the real
tiny V3.2 ModelRunner in every boundary mode (greedy, eos, stop tokens, max_tokens, preemption)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import httpx
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jds.engine import Engine, SamplingParams, sample  # noqa: E402
from jds.engine.fake import FakeRunner  # noqa: E402
from jds.engine.sampling import SamplingRows  # noqa: E402
from jds.sampling import greedy_tokens, sample_tokens, split_seeds  # noqa: E402
from tests.test_engine import greedy_rollout, prompts  # noqa: E402


# --- the device sampler ------------------------------------------------------------------------------
def device_sample(logits: np.ndarray, params: list[SamplingParams], seeds: list[int], index: list[int],
                  *, all_greedy: bool = False) -> np.ndarray:
    if all_greedy:
        return np.asarray(greedy_tokens(logits))
    rows = SamplingRows.build(params, seeds, index)
    return np.asarray(sample_tokens(logits, rows.greedy, rows.temperature.astype(np.float32), rows.top_k,
                                    rows.top_p.astype(np.float32), split_seeds(rows.seed), rows.index))


def test_device_greedy_equals_host_including_ties():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 300)).astype(np.float32)
    logits[3, [7, 90, 200]] = logits[3].max() + 1.0  # a three-way tie: the lowest id wins, as np.argmax
    logits[5, :] = 0.25  # all equal
    greedy = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)] * 8
    want = [sample(logits[i], greedy[i], 0, 0) for i in range(16)]
    assert want[3] == 7 and want[5] == 0
    for all_greedy in (False, True):
        got = device_sample(logits, greedy, list(range(16)), [0] * 16, all_greedy=all_greedy)
        assert got.dtype == np.int32 and got.tolist() == want


def test_device_sampling_deterministic_per_seed_and_index():
    rng = np.random.default_rng(1)
    logits = np.repeat(rng.standard_normal((1, 64)).astype(np.float32), 12, axis=0)
    sp = [SamplingParams(temperature=1.5)] * 12
    seeds, idx = [5] * 6 + [2**62 + 11] * 6, list(range(6)) * 2
    a = device_sample(logits, sp, seeds, idx)
    assert a.tolist() == device_sample(logits, sp, seeds, idx).tolist()
    perm = rng.permutation(12)  # the batch position does not matter, only (seed, index)
    b = device_sample(logits[perm], [sp[i] for i in perm], [seeds[i] for i in perm], [idx[i] for i in perm])
    assert b.tolist() == a[perm].tolist()
    assert len(set(a.tolist())) > 3  # it does sample


def _allowed(x: np.ndarray, p: SamplingParams) -> set[int]:
    """The ids the host sampler can draw (its own top-k, then top-p rule), computed independently."""
    z = x.astype(np.float64) / p.temperature
    order = np.lexsort((np.arange(z.size), -z))
    if 0 < p.top_k < z.size:
        order = order[: p.top_k]
    q = np.exp(z[order] - z[order[0]])
    q /= q.sum()
    if p.top_p < 1.0:
        before = np.cumsum(q) - q
        order = order[before < p.top_p]
    return set(order.tolist())


@pytest.mark.parametrize("p", [SamplingParams(temperature=2.0, top_k=5), SamplingParams(temperature=0.7, top_p=0.6),
                               SamplingParams(temperature=1.3, top_k=12, top_p=0.8),
                               SamplingParams(temperature=5.0, top_k=40, top_p=0.3)])
def test_device_sampling_support_is_exact(p: SamplingParams):
    """Over many draws the device sampler never leaves the allowed set and covers most of it."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal(200).astype(np.float32) * 2
    x[[10, 11]] = x.max() + 0.5  # a tie at the top
    allowed = _allowed(x, p)
    n = 2000
    got = device_sample(np.repeat(x[None], n, 0), [p] * n, [9] * n, list(range(n)))
    assert set(got.tolist()) <= allowed
    host = {sample(x, p, 9, i) for i in range(n)}
    assert host <= allowed
    assert len(set(got.tolist())) >= min(len(allowed), 3)


@pytest.mark.parametrize("p", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=4),
                               SamplingParams(temperature=1.5, top_p=0.7)])
def test_device_sampling_distribution_matches_host(p: SamplingParams):
    """Same distribution as the host sampler (different RNGs): total variation against the exact
    probabilities and against the host's empirical frequencies, 8000 draws of a 10-token vocabulary."""
    x = np.array([1.0, 0.5, 0.2, 0.0, -0.3, -0.5, -1.0, -1.5, 0.9, 0.1], np.float32)
    n, v = 8000, x.size
    z = x.astype(np.float64) / p.temperature
    order = np.lexsort((np.arange(v), -z))
    k = p.top_k if 0 < p.top_k < v else v
    q = np.exp(z[order] - z[order].max())
    q[k:] = 0
    q /= q.sum()
    if p.top_p < 1.0:
        q[(np.cumsum(q) - q) >= p.top_p] = 0
        q /= q.sum()
    exact = np.zeros(v)
    exact[order] = q
    dev = np.bincount(device_sample(np.repeat(x[None], n, 0), [p] * n, [123] * n, list(range(n))), minlength=v) / n
    host = np.bincount([sample(x, p, 123, i) for i in range(n)], minlength=v) / n
    assert 0.5 * np.abs(dev - exact).sum() < 0.03, (dev, exact)
    assert 0.5 * np.abs(dev - host).sum() < 0.045, (dev, host)
    assert (dev[exact == 0] == 0).all()


# --- the engine on the fake runner ----------------------------------------------------------------
class Recorder:
    """Wraps a runner for async steps: checks each submit's contract, can fail a submit or a result."""

    def __init__(self, inner, fail_submit: int | None = None, fail_result: int | None = None) -> None:
        self.inner = inner
        self.fail_submit, self.fail_result = fail_submit, fail_result
        self.calls: list[tuple[list, np.ndarray, np.ndarray]] = []
        for k in ("block_size", "num_blocks", "vocab_size", "max_model_len", "max_num_tokens", "max_num_seqs",
                  "eos_token_id"):
            setattr(self, k, getattr(inner, k))

    def submit(self, token_ids, chunks, block_tables, sampling, feed):
        self.calls.append((list(chunks), np.array(token_ids), np.array(feed)))
        assert len(token_ids) == sum(c.num_tokens for c in chunks) <= self.max_num_tokens
        rows = [c.req for c in chunks]  # persistent rows: strictly increasing, inside the table
        assert rows == sorted(set(rows)) and rows[-1] < self.max_num_seqs and len(sampling) == len(chunks)
        off = 0
        for c in chunks:  # placeholders only as the single token of a decode row
            hole = np.flatnonzero(np.asarray(token_ids[off:off + c.num_tokens]) == -1)
            assert hole.size == 0 or (c.num_tokens == 1 and feed[off] >= 0)
            off += c.num_tokens
        used = [p for c in chunks for p in block_tables[c.req][: -(-(c.start + c.num_tokens) // self.block_size)]]
        assert len(used) == len(set(used)), "two rows of one step share a page"
        n = len(self.calls)
        if n == self.fail_submit:
            raise RuntimeError("injected submit fault")
        pending = self.inner.submit(token_ids, chunks, block_tables, sampling, feed)
        if n == self.fail_result:
            class Bad:
                def result(self):
                    raise RuntimeError("injected result fault")
            return Bad()
        return pending


def drive(engine: Engine, reqs: dict, abort_at: dict[int, str] | None = None) -> dict[str, dict]:
    """Add the requests, step until idle; per request: tokens, reason, error. Asserts that nothing is
    emitted for a request after its finished output, and that no page is left in use."""
    for rid, (p, sp) in reqs.items():
        engine.add_request(rid, p, sp)
    res = {rid: {"tokens": [], "reason": None, "error": None} for rid in reqs}
    for step in range(10_000):
        if not engine.has_work():
            break
        outs = engine.step()
        if abort_at and step in abort_at:
            o = engine.abort_request(abort_at[step])
            outs = outs + ([o] if o is not None else [])
        for o in outs:
            r = res[o.request_id]
            assert r["reason"] is None, f"{o.request_id} emitted after it finished"
            r["tokens"] += o.new_token_ids
            if o.finished:
                r["reason"], r["error"] = o.finish_reason, o.error
    assert not engine.has_work(), "engine did not drain"
    assert engine.blocks.num_used == 0
    return res


def both(make_runner, reqs: dict, **kw) -> tuple[dict, dict, Engine, Engine]:
    sync = Engine(make_runner(), async_steps=False)
    a = drive(sync, reqs, **kw)
    asy = Engine(make_runner(), async_steps=True)
    b = drive(asy, reqs, **kw)
    return a, b, sync, asy


def mixed_requests(make_runner, n: int, seed: int = 0) -> dict:
    """Greedy and seeded rows, eos on/off, stop tokens taken from a plain run's streams, varied max_tokens."""
    ps = prompts(n, lo=3, hi=30, seed=seed)
    sps = [SamplingParams(max_tokens=3 + (i * 5) % 17, temperature=0.0 if i % 3 else 0.8,
                          top_k=-1 if i % 4 else 20, seed=1000 + i, ignore_eos=i % 5 == 0) for i in range(n)]
    plain = drive(Engine(make_runner(), async_steps=False),
                  {str(i): (p, dataclasses.replace(sp, max_tokens=20, ignore_eos=True))
                   for i, (p, sp) in enumerate(zip(ps, sps))})
    return {str(i): (p, dataclasses.replace(sp, stop_token_ids=(plain[str(i)]["tokens"][2 + i % 5],) if i % 3 == 1
                                            else ()))
            for i, (p, sp) in enumerate(zip(ps, sps))}


def test_fake_async_equals_sync_with_every_stop_rule_and_preemption(monkeypatch):
    from jds.engine.scheduler import Scheduler

    victims_in_flight = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt",
                        lambda self, req: (victims_in_flight.append(req.num_pending), preempt(self, req)))
    make = lambda: FakeRunner(block_size=4, num_blocks=14, max_num_tokens=24, max_num_seqs=6,  # noqa: E731
                              eos_bias=4.0)
    eos = make().eos_token_id
    reqs = mixed_requests(make, 24)
    a, b, sync, asy = both(make, reqs)
    assert a == b
    assert any(r["reason"] == "length" for r in a.values())
    assert any(r["reason"] == "stop" and r["tokens"][-1] == eos for r in a.values()), "no eos stop"
    assert any(r["reason"] == "stop" and r["tokens"][-1] != eos for r in a.values()), "no stop-token stop"
    assert sync.stats().num_preemptions > 0 and asy.stats().num_preemptions > 0
    assert any(victims_in_flight), "no request was preempted with its token still in flight"


def test_fake_async_greedy_matches_rollout_and_overlaps():
    """Chunked prefill + decodes: every stream equals its solo rollout; every decode row after the first
    takes its input token from the step in flight (a placeholder) rather than from the host."""
    fake = FakeRunner(block_size=4, num_blocks=256, max_num_tokens=16, max_num_seqs=4)
    rec = Recorder(fake)
    ps = prompts(12)
    res = drive(Engine(rec), {str(i): (p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
                              for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert res[str(i)]["tokens"] == greedy_rollout(fake, p, 10), i
    decode_rows = sum(c.num_tokens == 1 and c.start > 0 for chunks, _, _ in rec.calls for c in chunks)
    holes = sum(int((toks == -1).sum()) for _, toks, _ in rec.calls)
    assert holes > 0.8 * decode_rows > 0


def test_fake_async_no_wasted_row_after_max_tokens():
    """A request whose in-flight token is its last (max_tokens) is not scheduled again."""
    rec = Recorder(FakeRunner(block_size=4, num_blocks=64))
    drive(Engine(rec), {"a": ([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))})
    assert len(rec.calls) == 4  # prefill + 3 decodes, no fifth step


def test_fake_async_abort_in_flight():
    """An abort while the request's row is in flight: nothing more is emitted for it (its tokens lag one
    step behind sync, so it has one fewer), its pages are freed, the others are untouched."""
    make = lambda: FakeRunner(block_size=4, num_blocks=64, max_num_seqs=4)  # noqa: E731
    reqs = {str(i): (p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts(4, seed=4))}
    a, b, _, _ = both(make, reqs, abort_at={3: "1", 5: "2"})
    for rid in ("0", "3"):
        assert a[rid] == b[rid] and a[rid]["reason"] == "length"
    for rid in ("1", "2"):
        assert a[rid]["reason"] == b[rid]["reason"] == "abort"
        assert b[rid]["tokens"] == a[rid]["tokens"][:-1] and len(b[rid]["tokens"]) >= 1


@pytest.mark.parametrize("where", ["submit", "result"])
def test_fake_async_fault_fails_exactly_that_step(where: str):
    fake = FakeRunner(block_size=4, num_blocks=64, max_num_tokens=64, max_num_seqs=2)
    rec = Recorder(fake, **{f"fail_{where}": 4})
    eng = Engine(rec)
    ps = prompts(5, seed=9)
    res = drive(eng, {str(i): (p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
                      for i, p in enumerate(ps)})
    failed = {rid for rid, r in res.items() if r["reason"] == "error"}
    assert failed and len(failed) == len(rec.calls[3][0])
    assert all(f"injected {where} fault" in res[r]["error"] for r in failed)
    for i in range(len(ps)):
        want = greedy_rollout(fake, ps[i], 12)
        got = res[str(i)]["tokens"]
        assert got == want if str(i) not in failed else got == want[: len(got)]
    assert eng.stats().num_step_failures == 1


def test_async_flag():
    class NoSubmit:
        block_size, num_blocks, max_model_len, max_num_tokens, max_num_seqs = 4, 8, 64, 16, 2
    assert Engine(FakeRunner()).async_steps and not Engine(FakeRunner(), async_steps=False).async_steps
    assert not Engine(NoSubmit()).async_steps
    with pytest.raises(ValueError, match="submit"):
        Engine(NoSubmit(), async_steps=True)


# --- stop strings through the server (fake runner, in process) --------------------------------------
def test_server_stop_strings_and_eos_async_equals_sync():
    from tests.test_server import InProcess, sse_events

    texts = {}
    for async_steps in (False, True):
        s = InProcess(FakeRunner(block_size=16, eos_bias=6.0))
        s.engine.async_steps = async_steps  # before any request: nothing is in flight yet
        s.loop.ready.wait(10)
        try:
            body = {"prompt": [65, 66, 67], "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            full = httpx.post(s.base + "/v1/completions", json=body).json()["choices"][0]
            visible = [i for i, ch in enumerate(full["text"]) if ch.isprintable() and ch != "\ufffd"]
            stop = full["text"][visible[len(visible) // 2]]
            r = httpx.post(s.base + "/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
            with httpx.stream("POST", s.base + "/v1/completions",
                              json={**body, "stop": stop, "stream": True}) as resp:
                ev = sse_events(resp.iter_lines())
            streamed = "".join(e["choices"][0]["text"] for e in ev[:-1])
            eos = httpx.post(s.base + "/v1/completions", json={**body, "ignore_eos": False}).json()["choices"][0]
            texts[async_steps] = (full, stop, r, streamed, eos)
            assert r["finish_reason"] == "stop" and r["text"] == full["text"][: full["text"].index(stop)]
            assert streamed == r["text"]
            time.sleep(0.05)
            assert s.engine.blocks.num_used == 0
        finally:
            s.close()
    assert texts[False] == texts[True]
    assert texts[True][4]["finish_reason"] == "stop" and texts[True][4]["token_ids"][-1] == 257  # an eos stop


# --- the real tiny model in every boundary mode ---------------------------------------------------
class EosAs:
    """The runner with another eos id (random weights rarely produce the real one)."""

    def __init__(self, inner, eos: int) -> None:
        self._inner, self.eos_token_id = inner, eos

    def __getattr__(self, k):
        return getattr(self._inner, k)


# wide: slow (CI budget; it shares narrow's device-prepared path, first region + layer loop: the async engine's
# side is the same, and the modes' own equality is tests/test_runner.py's)
# fused + host prep: slow too (CI budget; host prep's runner equality is tests/test_runner.py's, and the async
# engine's side does not depend on where the inputs are prepared)
@pytest.mark.parametrize("mode,input_prep", [pytest.param("wide", "device", marks=pytest.mark.slow),
                                             ("narrow", "device"), ("fused", "device"),
                                             pytest.param("fused", "host", marks=pytest.mark.slow)])
def test_real_model_async_equals_sync(mode: str, input_prep: str):
    """Greedy streams identical with async on and off: eos, stop tokens, max_tokens and preemption
    (5 pages of 16 tokens for 8 requests). One token bucket and one key-block bucket keep compiles short."""
    from jds.runner import ModelRunner

    r = ModelRunner.build(preset="v32-tiny", mode=mode, num_blocks=5, max_num_seqs=8, max_num_tokens=16,
                          max_model_len=48, input_prep=input_prep)
    ps = prompts(8, lo=10, hi=30, seed=1)
    base = drive(Engine(r, async_steps=False),
                 {str(i): (p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for i, p in enumerate(ps)})
    eos = base["3"]["tokens"][2]  # request 3 (eos on, max_tokens 13) stops on it by its third token
    reqs = {}
    for i, p in enumerate(ps):
        toks = base[str(i)]["tokens"]
        reqs[str(i)] = (p, SamplingParams(max_tokens=min(10 + i, 47 - len(p)), temperature=0,
                                          ignore_eos=i % 2 == 0, stop_token_ids=(toks[3],) if i % 4 == 1 else ()))
    a, b, sync, asy = both(lambda: EosAs(r, eos), reqs)
    assert a == b
    assert any(v["reason"] == "stop" and v["tokens"][-1] == eos for v in a.values()), "no eos stop"
    assert any(v["reason"] == "length" for v in a.values())
    assert sync.stats().num_preemptions > 0 and asy.stats().num_preemptions > 0


def test_real_model_async_seeded_sampling():
    """Device sampling through the real runner: seeded streams repeat exactly and do not depend on what
    they were batched with or on preemption (the key is (seed, output index)); top-k / top-p rows too."""
    from jds.runner import ModelRunner

    r = ModelRunner.build(preset="v32-tiny", mode="fused", num_blocks=5, max_num_seqs=8, max_num_tokens=16,
                          max_model_len=48)
    ps = prompts(6, lo=10, hi=30, seed=2)
    reqs = {str(i): (p, SamplingParams(max_tokens=12, temperature=0.9, top_k=20 if i % 2 else -1,
                                       top_p=0.8 if i % 3 else 1.0, seed=77 + i, ignore_eos=True))
            for i, p in enumerate(ps)}
    eng = Engine(r, async_steps=True)
    a = drive(eng, reqs)
    assert eng.stats().num_preemptions > 0
    assert a == drive(Engine(r, async_steps=True), reqs)
    for rid in ("0", "1", "5"):
        assert drive(Engine(r, async_steps=True), {rid: reqs[rid]})[rid] == a[rid], rid
    assert len({t for v in a.values() for t in v["tokens"]}) > 12  # it does sample


def test_serve_no_async_flag():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import serve

    assert serve.parse_args([]).async_steps is True
    assert serve.parse_args(["--no-async"]).async_steps is False


def test_runner_submit_rejects_bad_feed():
    """The placeholder contract is checked on the host before anything is dispatched."""
    from jds.batch import Chunk
    from jds.runner import ModelRunner

    r = ModelRunner.build(preset="v32-tiny", mode="fused", num_blocks=4, max_num_seqs=2, max_num_tokens=16,
                          max_model_len=32)
    rows = SamplingRows.build([SamplingParams(temperature=0)], [0], [0])
    table = np.array([[0, 1]], np.int32)
    for toks, feed, msg in [([5, -1], [-1, -1], "feed must be"), ([5, 6], [-1, 0], "feed must be"),
                            ([5, -1], [-1, 0], "no step was submitted"), ([5, 6], [-1], "shape"),
                            ([5, 10**6], [-1, -1], "token_ids must be")]:
        with pytest.raises(ValueError, match=msg):
            r.submit(np.array(toks), [Chunk(0, 0, 2)], table, rows, np.array(feed))
    fake = FakeRunner()
    with pytest.raises(ValueError, match="no step was submitted"):
        fake.submit(np.array([5, -1]), [Chunk(0, 0, 2)], table, rows, np.array([-1, 0]))


def test_runner_submit_feeds_placeholders_on_the_device():
    """Three submits before any result is read: each placeholder takes the previous step's sampled row
    (checked against a teacher-forced execute() on other pages); greedy and sampled steps alike."""
    from jds.batch import Chunk
    from jds.runner import ModelRunner

    r = ModelRunner.build(preset="v32-tiny", mode="fused", num_blocks=8, max_num_seqs=2, max_num_tokens=16,
                          max_model_len=32)
    greedy = SamplingRows.build([SamplingParams(temperature=0)] * 2, [0, 0], [0, 0])
    table = np.array([[0, 1], [2, 3]], np.int32)
    prompt = [5, 6, 7]
    p1 = r.submit(np.array(prompt + prompt[:2]), [Chunk(0, 0, 3), Chunk(1, 0, 2)], table, greedy,
                  np.full(5, -1))
    p2 = r.submit(np.array([-1, prompt[2]]), [Chunk(0, 3, 1), Chunk(1, 2, 1)], table, greedy, np.array([0, -1]))
    p3 = r.submit(np.array([-1, -1]), [Chunk(0, 4, 1), Chunk(1, 3, 1)], table,
                  SamplingRows.build([SamplingParams(temperature=0.8), SamplingParams(temperature=0)], [1, 2], [2, 1]),
                  np.array([0, 1]))
    t1, t2, t3 = p1.result(), p2.result(), p3.result()
    assert t1.dtype == np.int32 and t1.shape == (2,) and t3.shape == (2,)
    assert t2[1] == t1[0]  # row 1 reaches row 0's prompt one step later (its last token from the host)
    fresh = np.array([[4, 5], [6, 7]], np.int32)  # teacher-forced on other pages through execute()
    lg = r.execute(np.array(prompt + [t1[0]]), [Chunk(0, 0, 4)], fresh[:1])
    assert int(np.argmax(lg[0])) == t2[0]
    assert t3[1] == t2[0]  # row 1 (greedy) in a sampled step: its placeholder came from step 2's row 1
