"""Engine tests (CPU): block manager, sampling, scheduler invariants, preemption, abort, stop rules,
step faults — on the deterministic FakeRunner — and decode consistency / preemption on the real tiny
V3.2 model through ``jds.runner.ModelRunner``."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jds.batch import Chunk  # noqa: E402
from jds.engine import BlockManager, Engine, SamplingParams, sample  # noqa: E402
from jds.engine.fake import FakeRunner  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n: int, lo: int = 3, hi: int = 30, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def run_all(engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    """Add every request, step until idle; per request: tokens, finish_reason, error."""
    for rid, (p, sp) in reqs.items():
        engine.add_request(rid, p, sp)
    res = {rid: {"tokens": [], "reason": None, "error": None} for rid in reqs}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for o in engine.step():
            r = res.setdefault(o.request_id, {"tokens": [], "reason": None, "error": None})
            r["tokens"] += o.new_token_ids
            if o.finished:
                r["reason"], r["error"] = o.finish_reason, o.error
    assert not engine.has_work(), "engine did not drain"
    return res


def greedy_rollout(fake: FakeRunner, prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(int(np.argmax(fake.reference_logits(ctx))))
    return ctx[len(prompt):]


def _check_rows(chunks, block_tables, max_num_seqs: int, block_size: int) -> None:
    """Persistent rows: chunks in strictly increasing row order, each row inside the table, and each
    chunk's row holds a page for every position up to the last one it writes."""
    rows = [c.req for c in chunks]
    assert rows == sorted(set(rows)) and 0 <= rows[0] and rows[-1] < max_num_seqs
    assert block_tables.shape[0] == max_num_seqs
    for c in chunks:
        assert (block_tables[c.req, : (c.start + c.num_tokens - 1) // block_size + 1] >= 0).all()


class CheckingRunner:
    """Wraps a runner and asserts the scheduler's per-step contract on every call."""

    def __init__(self, inner, fail_on_call: int | None = None) -> None:
        self.inner = inner
        self.fail_on_call = fail_on_call
        self.calls: list[list[Chunk]] = []
        for k in ("block_size", "num_blocks", "vocab_size", "max_model_len", "max_num_tokens", "max_num_seqs",
                  "eos_token_id"):
            setattr(self, k, getattr(inner, k))

    def execute(self, token_ids, chunks, block_tables):
        self.calls.append(list(chunks))
        assert len(token_ids) == sum(c.num_tokens for c in chunks) <= self.max_num_tokens
        assert 1 <= len(chunks) <= self.max_num_seqs
        _check_rows(chunks, block_tables, self.max_num_seqs, self.block_size)
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise RuntimeError("injected fault")
        return self.inner.execute(token_ids, chunks, block_tables)

    def submit(self, token_ids, chunks, block_tables, sampling, feed):
        """The async-step entry point, under the same per-step checks (placeholders -1 allowed)."""
        self.calls.append(list(chunks))
        assert len(token_ids) == sum(c.num_tokens for c in chunks) <= self.max_num_tokens
        assert 1 <= len(chunks) <= self.max_num_seqs and len(sampling) == len(chunks)
        _check_rows(chunks, block_tables, self.max_num_seqs, self.block_size)
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise RuntimeError("injected fault")
        return self.inner.submit(token_ids, chunks, block_tables, sampling, feed)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_steps(request) -> bool:
    return request.param


# ---------------------------------------------------------------------------------------------------
def test_block_manager():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.pages_for(1) == 1 and bm.pages_for(4) == 1 and bm.pages_for(5) == 2
    a = bm.allocate("a", 5)
    assert len(a) == 2 and bm.num_used == 2 and bm.usage() == pytest.approx(0.4)
    assert bm.allocate("a", 8) == a and bm.num_used == 2  # still fits in its two pages
    bm.allocate("b", 12)
    assert bm.num_free == 0 and not bm.can_allocate("a", 9)
    with pytest.raises(MemoryError):
        bm.allocate("a", 9)
    assert len(bm.blocks_of("a")) == 2  # all-or-nothing
    assert set(bm.blocks_of("a")).isdisjoint(bm.blocks_of("b"))
    assert bm.free("b") == 3 and bm.free("b") == 0 and bm.num_free == 3
    bm.free("a")
    assert bm.num_used == 0 and bm.usage() == 0.0


def test_sampling_rules():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(100).astype(np.float32)
    top = int(np.argmax(logits))
    assert sample(logits, SamplingParams(temperature=0.0), 0, 0) == top
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1), 5, 3) == top
    assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), 5, 3) == top
    sp = SamplingParams(temperature=0.8, seed=7)
    assert [sample(logits, sp, 7, i) for i in range(20)] == [sample(logits, sp, 7, i) for i in range(20)]
    draws = {sample(logits, sp, 7, i) for i in range(200)}
    assert len(draws) > 5  # it does sample
    top5 = set(np.argsort(-logits)[:5].tolist())
    assert {sample(logits, SamplingParams(temperature=2.0, top_k=5), 3, i) for i in range(200)} <= top5
    # top_p: only the smallest prefix of the sorted distribution reaching the mass is drawable
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p)
    k = int(np.searchsorted(np.cumsum(p[order]), 0.5)) + 1
    allowed = set(order[:k].tolist())
    assert {sample(logits, SamplingParams(top_p=0.5), 11, i) for i in range(300)} <= allowed
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    for field, bad in (("top_k", 2**31), ("top_k", -2**31 - 1), ("seed", 2**63), ("seed", -2**63 - 1)):
        with pytest.raises(ValueError, match=field):  # a step's int32 top-k rows; the RNG's 64-bit seed
            SamplingParams(**{field: bad})
    SamplingParams(top_k=2**31 - 1, seed=-2**63)  # the ends of both ranges are accepted


def test_greedy_concurrent_chunked_matches_rollout(async_steps):
    """20 requests, chunked prefill (budget 16 tokens), 4 rows: each equals its own greedy rollout."""
    fake = FakeRunner(block_size=4, num_blocks=256, max_num_tokens=16, max_num_seqs=4)
    runner = CheckingRunner(fake)
    ps = prompts(20)
    res = run_all(Engine(runner, async_steps=async_steps), {str(i): (p, GREEDY) for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert res[str(i)]["tokens"] == greedy_rollout(fake, p, 12), i
        assert res[str(i)]["reason"] == "length"
    assert any(c.num_tokens > 1 and c.start > 0 for call in runner.calls for c in call), "no chunked prefill"
    assert any(len(call) == 4 for call in runner.calls)


def test_decodes_scheduled_first_under_tight_budget():
    fake = FakeRunner(block_size=4, num_blocks=256, max_num_tokens=8, max_num_seqs=8)
    eng = Engine(fake)
    eng.add_request("a", list(range(5)), GREEDY)
    eng.step()  # a prefilled -> decoding
    eng.add_request("b", list(range(40)), GREEDY)  # long prefill competes for the 8-token budget
    for _ in range(3):
        sched_before = {r.request_id: r.num_remaining for r in eng.scheduler.running}
        eng.step()
        assert sched_before.get("a") == 1  # a was decoding and still got its token every step
    assert eng.requests["a"].num_tokens == 5 + 4


def test_preemption_tiny_pool_matches_solo_and_frees_everything(async_steps):
    fake = FakeRunner(block_size=4, num_blocks=12, max_num_tokens=32, max_num_seqs=8)  # 48 slots
    runner = CheckingRunner(fake)
    eng = Engine(runner, async_steps=async_steps)
    ps = prompts(10, lo=5, hi=20, seed=3)
    sp = {str(i): (p, SamplingParams(max_tokens=16, temperature=0.7 if i % 2 else 0.0, seed=100 + i,
                                     ignore_eos=True)) for i, p in enumerate(ps)}
    res = run_all(eng, sp)
    assert eng.stats().num_preemptions > 0, "the tiny pool did not force a preemption"
    assert eng.blocks.num_used == 0 and eng.stats().kv_cache_usage == 0.0
    solo_eng = Engine(FakeRunner(block_size=4, num_blocks=12, max_num_tokens=32, max_num_seqs=8))
    for rid, spec in sp.items():
        solo = run_all(solo_eng, {rid: spec})[rid]
        assert res[rid]["tokens"] == solo["tokens"], rid  # greedy and seeded sampling survive recompute
        assert res[rid]["reason"] == "length"
    assert solo_eng.stats().num_preemptions == 0


def test_preemption_takes_newest_and_touches_no_one_else():
    fake = FakeRunner(block_size=4, num_blocks=6, max_num_tokens=64, max_num_seqs=4)
    eng = Engine(fake)
    eng.add_request("old", list(range(7)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    eng.add_request("new", list(range(7)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    eng.step()  # both prefilled: 2 pages each, 2 free
    pages_old = list(eng.blocks.blocks_of("old"))
    preempted_seen = False
    while eng.has_work():
        eng.step()
        if eng.requests.get("new") is not None and eng.requests["new"].num_preemptions:
            preempted_seen = True
        if "old" in eng.requests:
            assert eng.blocks.blocks_of("old")[: len(pages_old)] == pages_old  # never moved or freed
            assert eng.requests["old"].num_preemptions == 0
    assert preempted_seen


def test_abort_frees_pages():
    fake = FakeRunner(block_size=4, num_blocks=64)
    eng = Engine(fake)
    eng.add_request("a", list(range(10)), GREEDY)
    eng.add_request("b", list(range(10)), GREEDY)
    eng.step()
    assert eng.blocks.num_used > 0
    out = eng.abort_request("a")
    assert out.finished and out.finish_reason == "abort"
    assert eng.blocks.blocks_of("a") == [] and eng.abort_request("a") is None
    res = run_all(eng, {})
    assert set(res) == {"b"} and res["b"]["reason"] == "length" and eng.blocks.num_used == 0
    eng.add_request("w", list(range(10)), GREEDY)  # abort while still waiting
    assert eng.abort_request("w").finish_reason == "abort" and not eng.has_work()


def test_stop_rules():
    fake = FakeRunner(block_size=4, num_blocks=64, eos_bias=100.0)  # eos is always the argmax
    eng = Engine(fake)
    res = run_all(eng, {
        "eos": ([1, 2, 3], SamplingParams(max_tokens=5, temperature=0)),
        "ignore": ([1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)),
    })
    assert res["eos"] == {"tokens": [fake.eos_token_id], "reason": "stop", "error": None}
    assert res["ignore"]["tokens"] == [fake.eos_token_id] * 5 and res["ignore"]["reason"] == "length"
    fake2 = FakeRunner(block_size=4, num_blocks=64)
    want = greedy_rollout(fake2, [9, 8, 7], 10)
    stop_tok = want[4]
    first = want.index(stop_tok)
    res = run_all(Engine(fake2), {"s": ([9, 8, 7], SamplingParams(max_tokens=10, temperature=0,
                                                                   stop_token_ids=(stop_tok,)))})
    assert res["s"]["tokens"] == want[: first + 1] and res["s"]["reason"] == "stop"


def test_rejects_impossible_requests():
    eng = Engine(FakeRunner(block_size=4, num_blocks=8, max_model_len=256))  # pool: 32 tokens
    with pytest.raises(ValueError):
        eng.add_request("x", list(range(30)), SamplingParams(max_tokens=3))
    with pytest.raises(ValueError):
        eng.add_request("y", [], SamplingParams())
    with pytest.raises(ValueError):
        eng.add_request("z", [600], SamplingParams())


def test_step_exception_fails_only_that_steps_requests(async_steps):
    fake = FakeRunner(block_size=4, num_blocks=64, max_num_tokens=64, max_num_seqs=2)
    runner = CheckingRunner(fake, fail_on_call=3)
    eng = Engine(runner, async_steps=async_steps)
    ps = prompts(5, seed=9)
    res = run_all(eng, {str(i): (p, GREEDY) for i, p in enumerate(ps)})
    failed_rows = len(runner.calls[2])
    failed = {rid for rid, r in res.items() if r["reason"] == "error"}
    assert len(failed) == failed_rows >= 1
    assert all("injected fault" in res[r]["error"] for r in failed)
    for i, p in enumerate(ps):
        if str(i) not in failed:
            assert res[str(i)]["tokens"] == greedy_rollout(fake, p, 12) and res[str(i)]["reason"] == "length"
    assert eng.blocks.num_used == 0 and eng.stats().num_step_failures == 1


# --- the real tiny model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_runner():
    from jds.runner import ModelRunner

    # one token bucket: prefill chunks and decodes run the same compiled steps (compiles: CI budget)
    return ModelRunner.build(preset="v32-tiny", num_blocks=12, max_num_seqs=8, max_num_tokens=32,
                             max_model_len=128, token_buckets=(32,))


def test_real_model_decode_consistency(model_runner):
    """Engine greedy output == a teacher-forced argmax rollout done with runner.execute directly:
    for each k, a fresh prefill of prompt + generated[:k] (in <= max_num_tokens chunks) must argmax to
    generated[k]."""
    r = model_runner
    prompt = prompts(1, lo=40, hi=41, seed=5)[0]  # 40 tokens: a chunked prefill in the engine
    n = 10
    gen = run_all(Engine(r), {"a": (prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))})
    gen = gen["a"]["tokens"]
    assert len(gen) == n
    bs = r.block_size
    table = np.full((1, -(-r.max_model_len // bs)), -1, np.int32)
    table[0, : r.num_blocks] = np.arange(r.num_blocks)[: table.shape[1]]
    for k in range(n):
        seq = np.asarray(prompt + gen[:k], np.int32)
        for s in range(0, len(seq), r.max_num_tokens):
            piece = seq[s: s + r.max_num_tokens]
            logits = r.execute(piece, [Chunk(0, s, len(piece))], table)
        assert int(np.argmax(logits[0])) == gen[k], f"token {k}"


def test_real_model_preemption_matches_solo(model_runner):
    """12 pages of 16 tokens for 10 concurrent requests: preemption + recompute on the real model."""
    ps = prompts(10, lo=5, hi=40, seed=1)
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    eng = Engine(model_runner)
    res = run_all(eng, {str(i): (p, sp) for i, p in enumerate(ps)})
    assert eng.stats().num_preemptions > 0
    assert eng.blocks.num_used == 0
    for i, p in enumerate(ps[:4]):
        solo = run_all(Engine(model_runner), {"s": (p, sp)})["s"]["tokens"]
        assert res[str(i)]["tokens"] == solo, i


def test_running_requests_keep_their_rows(async_steps):
    """Persistent rows: a request keeps its block-table row from admission to finish, a finished request's
    row goes to the next admitted one, and the rows stay within max_num_seqs."""
    fake = FakeRunner(block_size=4, num_blocks=256, max_num_tokens=32, max_num_seqs=3)
    eng = Engine(CheckingRunner(fake), async_steps=async_steps)
    for i, n in enumerate((2, 9, 4, 6, 3, 5)):
        eng.add_request(str(i), prompts(1, seed=i)[0], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    seen: dict[str, int] = {}
    for _ in range(200):
        if not eng.has_work():
            break
        eng.step()
        for rid, row in eng._row_of.items():
            assert seen.setdefault(rid, row) == row, f"request {rid} moved from row {seen[rid]} to {row}"
        assert sorted(eng._row_of.values()) == sorted(set(eng._row_of.values()))
    assert len(seen) == 6 and set(seen.values()) <= {0, 1, 2}
