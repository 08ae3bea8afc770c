"""The engine: schedule a step, run it through the runner, sample, report.

``Engine.step()`` is single-threaded and deterministic (tests drive it directly); ``jds.engine.loop``
runs it in a background thread for the HTTP server. An exception raised by the runner fails exactly
the requests of that step (their pages are freed, each gets a finished output with
``finish_reason="error"``) and the engine carries on with the rest.

Two ways to step:
  sync   ``runner.execute`` returns host logits; the engine samples and advances. The device idles while
         the host samples, schedules and prepares the next step.
  async  (vLLM's async scheduling) ``runner.submit`` samples on the device and returns a handle. One
         ``step()`` plans step N+1 as if every request of step N got its token (that token is a
         placeholder -1 the runner fills on the device from step N's sampled row), submits N+1, and only
         then reads step N's tokens and applies the stop rules. So the host's work for N+1 overlaps the
         device's work for N, and tokens reach the streams one step late, in order.

Exactness of async stepping:
  * A request that stops on step N's token (eos, stop token, max_tokens, length, abort, error) may
    already sit in step N+1; its row there is computed and discarded: a finished request's outputs
    are never applied again. A token that is certainly the last (max_tokens, length) is known when
    step N is submitted (``Request.finishing``), so such a request is not scheduled in N+1 at all.
  * Pages. A stopped, aborted or preempted request's pages return to the pool while steps that still
    write into them may be in flight. They can only be handed out by a later ``schedule()``, i.e. to a
    step submitted after those: every step consumes the caches the previous one produced (a device
    data dependency, and the fake runner computes eagerly in order), so the stale writes land before
    the new owner's, and a row reads only slots its own request wrote. A step already submitted never
    gets a page freed after its submission: its block tables are fixed at submit time.
  * Preemption with a step in flight: the victim's in-flight token is still read and appended (it was
    computed from a correct context), then the victim is recomputed from its full token list. A step
    that preempts admits nothing new (the scheduler's rule), so a victim with an unread token is never
    rescheduled before that token is read.
  * Failure: an exception from ``submit`` fails that step's requests after the previous step's tokens
    are applied; an exception from ``result()`` fails the requests of the step it belongs to.

Speculative decoding (``speculative="mtp"``, DeepSeek-V4's MTP module, ``jds.mtp``), one draft token per request
per step. A decode with a draft d feeds [last token, d]; the main model's greedy tokens (a0, a1) at both positions
verify it: a0 == d accepts d and emits (a0, a1), else only the corrected a0 is emitted and the draft position's
cache entries are rewritten when that position is processed again (they are keyed by position; nothing reads them
before). Then the MTP runs over the accepted positions only (``runner.draft``: a rejected row writes no MTP cache
entry) and drafts the next token; a prefill's last chunk drafts too. A draft is only made when both tokens may be
emitted (max_tokens, the sequence limit), and emission stops at the first stop token, so the token stream is the
non-speculative greedy stream. Bitwise so when the runner is batch-invariant (``--batch-invariant``): otherwise the
2-token verify steps run other shapes than 1-token decodes, with the co-batching caveat of ``jds.engine.sampling``.
First version, restricted to what is exact: greedy requests only (others are refused at ``add_request``), the
synchronous loop (``async_steps`` False), and the runner's own restrictions (``ModelRunner.enable_mtp``: block-v4
with an MTP module, mode fused, one segment, no mesh).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from jds.batch import Chunk
from jds.engine.blocks import BlockManager
from jds.engine.request import Request, RequestOutput, RequestStatus
from jds.engine.sampling import SamplingParams, SamplingRows, sample
from jds.engine.scheduler import Scheduler


class Runner(Protocol):
    """The part of ``jds.runner.ModelRunner`` the engine uses."""

    block_size: int
    num_blocks: int
    vocab_size: int
    max_model_len: int
    max_num_tokens: int
    max_num_seqs: int
    eos_token_id: int

    def execute(self, token_ids: np.ndarray, chunks: list[Chunk], block_tables: np.ndarray) -> np.ndarray: ...

    def submit(self, token_ids: np.ndarray, chunks: list[Chunk], block_tables: np.ndarray,
               sampling: SamplingRows, feed: np.ndarray) -> "Pending":
        """Enqueue one step with sampling on the device; return before it runs.

        ``token_ids[i] == -1`` is a placeholder for the token that row ``feed[i]`` sampled in the previously
        submitted step (``feed[i] == -1`` elsewhere). Only needed for async stepping."""
        ...


class Pending(Protocol):
    def result(self) -> np.ndarray:
        """Block until the step is done; its sampled token ids, int32 [number of chunks]."""
        ...


class MetricsSink(Protocol):
    """Where the engine reports per-request timings (``jds.server.metrics.ServerMetrics``)."""

    def on_scheduled(self, queue_time: float) -> None: ...
    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None: ...
    def on_token(self, itl: float | None) -> None: ...
    def on_finished(self, e2e: float, reason: str) -> None: ...


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    num_steps: int
    num_step_failures: int
    num_draft_tokens: int = 0  # speculative: drafts verified by the main model
    num_accepted_tokens: int = 0  # speculative: of those, accepted


@dataclass
class _InFlight:
    """A submitted async step: its handle and, per row, the request and how many tokens it fed."""

    pending: Pending
    reqs: list[Request]
    num_tokens: list[int]
    samples: list[bool]  # row reached the end of its known tokens, so its sampled token is real


class Engine:
    def __init__(self, runner: Runner, *, metrics: MetricsSink | None = None,
                 async_steps: bool | None = None, speculative: str | None = None) -> None:
        """``async_steps``: None = on when the runner has ``submit`` (off with ``speculative``); True requires
        it; False = sync. ``speculative``: None or "mtp" (see the module docstring for its restrictions)."""
        if speculative not in (None, "mtp"):
            raise ValueError(f"speculative: expected None or 'mtp', got {speculative!r}")
        has_submit = callable(getattr(runner, "submit", None))
        if speculative:
            if async_steps:
                raise ValueError("async_steps: speculative 'mtp' runs only in the synchronous loop "
                                 "(async_steps=False, serve.py --no-async)")
            if not all(callable(getattr(runner, f, None)) for f in ("enable_mtp", "verify", "draft")):
                raise ValueError(f"speculative: 'mtp' needs a runner with enable_mtp / verify / draft "
                                 f"(jds.runner.ModelRunner); {type(runner).__name__} has not")
            runner.enable_mtp()  # raises a ValueError naming the field for an unsupported model or runner config
            async_steps = False
        if async_steps and not has_submit:
            raise ValueError(f"async_steps=True needs a runner with submit(); {type(runner).__name__} has none")
        self.speculative = speculative
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.async_steps = has_submit if async_steps is None else bool(async_steps)
        self._inflight: _InFlight | None = None
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=runner.max_num_seqs,
                                   max_num_tokens=runner.max_num_tokens)
        self.max_blocks_per_seq = -(-runner.max_model_len // runner.block_size)
        self.metrics = metrics
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_step_failures = 0
        # Persistent rows (vLLM's persistent batch): a running request keeps its block-table row from
        # admission to finish or preemption, so a step's block tables differ from the last step's only by
        # appended pages and by rows that changed hands; a runner that keeps the tables on the device then
        # sends only those entries.
        self._row_of: dict[str, int] = {}

    # -- limits the front end validates against ----------------------------------------------
    @property
    def max_seq_len(self) -> int:
        """Longest prompt + output a request may reach: the model limit and the whole page pool."""
        return min(self.runner.max_model_len, self.runner.num_blocks * self.runner.block_size)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not prompt_ids:
            raise ValueError("prompt must hold at least one token")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds "
                             f"{self.max_seq_len} tokens")
        if self.speculative and not params.greedy:
            raise ValueError(f"temperature: speculative '{self.speculative}' supports greedy sampling only "
                             f"(temperature 0 or top_k 1), got temperature={params.temperature}, top_k={params.top_k}")
        v = self.runner.vocab_size
        if any(not 0 <= t < v for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {v})")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = Request(request_id, list(prompt_ids), params, seed,
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop the request and free its pages; None when it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.remove(req)
        return self._final(req, [], "abort")

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), b.num_used, b.num_free,
                           b.num_blocks, b.usage(), self.scheduler.num_preemptions, self.num_steps,
                           self.num_step_failures, self.num_draft_tokens, self.num_accepted_tokens)

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step (sync) or: plan and submit the next step, then apply the previous one (async)."""
        if self.speculative:
            return self._step_speculative()
        return self._step_async() if self.async_steps else self._step_sync()

    def _inputs(self, sched) -> tuple[list[Chunk], list[int], np.ndarray]:
        self.num_steps += 1
        if self.metrics:
            for req in sched.reqs:
                if not req.queue_time_reported:
                    req.queue_time_reported = True
                    self.metrics.on_scheduled(req.first_scheduled_time - req.arrival_time)
        rows = self._assign_rows()
        order = sorted(range(len(sched.reqs)), key=lambda i: rows[sched.reqs[i].request_id])
        sched.reqs[:] = [sched.reqs[i] for i in order]  # chunks go in increasing row order
        sched.num_tokens[:] = [sched.num_tokens[i] for i in order]
        chunks, toks = [], []
        table = np.full((self.runner.max_num_seqs, self.max_blocks_per_seq), -1, np.int32)
        for req in self.scheduler.running:  # every running request's row, scheduled this step or not
            pages = self.blocks.blocks_of(req.request_id)
            table[rows[req.request_id], : len(pages)] = pages
        for req, n in zip(sched.reqs, sched.num_tokens):
            chunks.append(Chunk(req=rows[req.request_id], start=req.num_computed, num_tokens=n))
            toks.extend(req.token_slice(req.num_computed, n))
        return chunks, toks, table

    def _assign_rows(self) -> dict[str, int]:
        """Release the rows of requests no longer running (finished, aborted, failed, preempted) and give
        each newly running request the lowest free row."""
        running = {r.request_id for r in self.scheduler.running}
        for rid in [rid for rid in self._row_of if rid not in running]:
            del self._row_of[rid]
        free = sorted(set(range(self.runner.max_num_seqs)) - set(self._row_of.values()))
        for req in self.scheduler.running:
            if req.request_id not in self._row_of:
                self._row_of[req.request_id] = free.pop(0)
        return self._row_of

    def _fail(self, reqs: list[Request], e: Exception) -> list[RequestOutput]:
        """Fail the still-live requests of a failed step (pages freed, one error output each)."""
        self.num_step_failures += 1
        msg = f"step failed: {type(e).__name__}: {e}"
        outs = []
        for req in reqs:
            if req.status is not RequestStatus.FINISHED and self.requests.get(req.request_id) is req:
                self.requests.pop(req.request_id)
                self.scheduler.remove(req)
                out = self._final(req, [], "error")
                out.error = msg
                outs.append(out)
        return outs

    def _step_sync(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched:
            return []
        chunks, toks, table = self._inputs(sched)
        try:
            logits = np.asarray(self.runner.execute(np.asarray(toks, np.int32), chunks, table))
            if logits.shape[0] != len(chunks):
                raise RuntimeError(f"runner returned {logits.shape[0]} logit rows for {len(chunks)} chunks")
            return self._advance(sched.reqs, sched.num_tokens, logits)
        except Exception as e:  # noqa: BLE001 - a failed step must not take the engine down
            return self._fail(sched.reqs, e)

    def _step_speculative(self) -> list[RequestOutput]:
        """One synchronous step with MTP drafts: verify (main model), draft (MTP), then emit (module docstring)."""
        sched = self.scheduler.schedule()
        if not sched:
            return []
        chunks, toks, table = self._inputs(sched)
        verified = []  # per row: the draft this step verifies, or -1
        off = 0
        for req, n in zip(sched.reqs, sched.num_tokens):
            d = req.draft if (n == 2 and req.num_remaining == 1 and req.draft >= 0) else -1
            if d >= 0:
                toks[off + 1] = d  # token_slice gave the placeholder -1 for the position past the known tokens
            req.draft = -1  # used now, or dropped (the scheduler shrank the decode to 1 token)
            verified.append(d)
            off += n
        try:
            greedy = np.asarray(self.runner.verify(np.asarray(toks, np.int32), chunks, table))
            if greedy.shape != (len(chunks), 2):
                raise RuntimeError(f"runner.verify returned shape {greedy.shape} for {len(chunks)} chunks")
            nxt, keep, draft_rows, draft_reqs, emitted = [], [], [], [], []
            off = 0
            for row, (req, n, d) in enumerate(zip(sched.reqs, sched.num_tokens, verified)):
                a0, a1 = int(greedy[row, 0]), int(greedy[row, 1])
                if d >= 0:
                    self.num_draft_tokens += 1
                    if a0 == d:  # accepted: the bonus token a1 comes from the draft's position
                        self.num_accepted_tokens += 1
                        req.num_computed += 2
                        nxt += [a0, a1]
                        keep += [True, True]
                        out = [a0, a1]
                    else:  # rejected: the draft position's KV is recomputed with a0 next step
                        req.num_computed += 1
                        nxt += [a0, 0]
                        keep += [True, False]
                        out = [a0]
                    draft_rows.append(off + len(out) - 1)
                    draft_reqs.append(req)
                else:
                    start = req.num_computed
                    req.num_computed += n
                    if req.num_remaining > 0:  # a prefill chunk short of the end: its last row pairs the next token
                        nxt += toks[off + 1: off + n] + req.token_slice(start + n, 1)
                        out = []
                    else:
                        a = a1  # the chunk's last row (a 1-token chunk repeats it)
                        nxt += toks[off + 1: off + n] + [a]
                        out = [a]
                        draft_rows.append(off + n - 1)
                        draft_reqs.append(req)
                    keep += [True] * n
                emitted.append(out)
                off += n
            drafts = np.asarray(self.runner.draft(np.asarray(nxt, np.int32), np.asarray(keep, bool),
                                                  np.asarray(draft_rows, np.int32)))
            if drafts.shape != (len(draft_rows),):
                raise RuntimeError(f"runner.draft returned shape {drafts.shape} for {len(draft_rows)} rows")
            outs = []
            now = time.monotonic()
            for req, out in zip(sched.reqs, emitted):
                merged = None
                for tok in out:
                    req.output_ids.append(tok)
                    o = self._check_stop(req, tok, now)
                    if merged is not None:
                        o.new_token_ids = merged.new_token_ids + o.new_token_ids
                    merged = o
                    if o.finished:
                        break  # a token after a stop (or past a limit) is never emitted
                if merged is not None:
                    outs.append(merged)
            for req, d in zip(draft_reqs, drafts.tolist()):
                p = req.params
                if (req.status is RequestStatus.RUNNING and len(req.output_ids) + 2 <= p.max_tokens
                        and req.num_tokens + 1 <= self.max_seq_len):  # both tokens of the next step may be emitted
                    d = self.propose(req, int(d))
                    req.draft = d if 0 <= d < self.runner.vocab_size else -1
            return outs
        except Exception as e:  # noqa: BLE001 - a failed step must not take the engine down
            return self._fail(sched.reqs, e)

    def propose(self, req: Request, mtp_draft: int) -> int:
        """The draft for ``req``'s next output token (the MTP's greedy token). A hook: tests replace it with an
        oracle to exercise acceptance; any value in [0, vocab) keeps the output exact, only the speed changes."""
        return mtp_draft

    def _step_async(self) -> list[RequestOutput]:
        prev, new = self._inflight, None  # prev stays recorded until the new step replaces it
        sched = self.scheduler.schedule()
        failed: tuple[list[Request], Exception] | None = None
        if sched:
            chunks, toks, table = self._inputs(sched)
            feed = np.full(len(toks), -1, np.int32)
            params, seeds, index, samples = [], [], [], []
            off = 0
            for req, n in zip(sched.reqs, sched.num_tokens):
                known = len(req.prompt_ids) + len(req.output_ids)
                if req.num_computed + n > known:  # the unread token of the step in flight
                    assert prev is not None and req.num_pending == 1 and req.num_computed + n == known + 1
                    feed[off + n - 1] = req.pending_row
                off += n
                params.append(req.params)
                seeds.append(req.seed)
                index.append(len(req.output_ids) + req.num_pending)
                samples.append(req.num_computed + n == req.num_tokens)
            try:
                pending = self.runner.submit(np.asarray(toks, np.int32), chunks, table,
                                             SamplingRows.build(params, seeds, index), feed)
            except Exception as e:  # noqa: BLE001 - failed after the previous step's tokens are applied
                failed = (sched.reqs, e)
            else:
                for row, (req, n, s) in enumerate(zip(sched.reqs, sched.num_tokens, samples)):
                    req.num_computed += n
                    if s:
                        req.num_pending += 1
                        req.pending_row = row
                        p = req.params
                        req.finishing = (len(req.output_ids) + req.num_pending >= p.max_tokens
                                         or req.num_tokens >= self.max_seq_len)
                new = _InFlight(pending, sched.reqs, sched.num_tokens, samples)
        self._inflight = new
        outs = self._read(prev) if prev is not None else []
        if failed is not None:
            outs += self._fail(*failed)
        return outs

    def _read(self, step: _InFlight) -> list[RequestOutput]:
        """Wait for a submitted step's tokens and apply them to the requests still alive."""
        try:
            toks = np.asarray(step.pending.result())
            if toks.shape[0] != len(step.reqs):
                raise RuntimeError(f"runner returned {toks.shape[0]} tokens for {len(step.reqs)} rows")
        except Exception as e:  # noqa: BLE001
            for req, s in zip(step.reqs, step.samples):
                if s:
                    req.num_pending -= 1
            return self._fail(step.reqs, e)
        outs = []
        now = time.monotonic()
        for req, s, tok in zip(step.reqs, step.samples, toks.tolist()):
            if not s:
                continue
            req.num_pending -= 1
            if req.status is RequestStatus.FINISHED:
                continue  # stopped, aborted or failed after this step was submitted: emits nothing
            req.output_ids.append(int(tok))  # ``finishing`` stays: it describes the newest pending token
            out = self._check_stop(req, int(tok), now)
            outs.append(out)
        return outs

    def _advance(self, reqs: list[Request], num_tokens: list[int], logits: np.ndarray) -> list[RequestOutput]:
        outs = []
        now = time.monotonic()
        argmax = logits.argmax(axis=-1)  # one vectorised pass for every greedy row
        for row, (req, n) in enumerate(zip(reqs, num_tokens)):
            req.num_computed += n
            if req.num_remaining > 0:
                continue  # a prefill chunk that did not reach the end: nothing to sample yet
            p = req.params
            tok = int(argmax[row]) if p.greedy else sample(logits[row], p, req.seed, len(req.output_ids))
            req.output_ids.append(tok)
            outs.append(self._check_stop(req, tok, now))
        return outs

    def _check_stop(self, req: Request, tok: int, now: float) -> RequestOutput:
        """``tok`` was just appended to ``req``: report it, finishing the request if a stop rule holds."""
        self._token_metrics(req, now)
        p = req.params
        reason, on_token = None, False
        if (tok == self.runner.eos_token_id and not p.ignore_eos) or tok in p.stop_token_ids:
            reason, on_token = "stop", True
        elif len(req.output_ids) >= p.max_tokens or len(req.prompt_ids) + len(req.output_ids) >= self.max_seq_len:
            reason = "length"
        if reason is None:
            return RequestOutput(req.request_id, [tok], num_prompt_tokens=len(req.prompt_ids),
                                 num_output_tokens=len(req.output_ids))
        self.requests.pop(req.request_id, None)
        self.scheduler.remove(req)
        out = self._final(req, [tok], reason)
        out.stopped_on_token = on_token
        return out

    def _token_metrics(self, req: Request, now: float) -> None:
        first = req.first_token_time is None
        itl = None if first else now - req.last_token_time
        if first:
            req.first_token_time = now
        req.last_token_time = now
        if self.metrics:
            if first:
                self.metrics.on_first_token(now - req.arrival_time, len(req.prompt_ids))
            self.metrics.on_token(itl)

    def _final(self, req: Request, new: list[int], reason: str) -> RequestOutput:
        req.status = RequestStatus.FINISHED
        if self.metrics:
            self.metrics.on_finished(time.monotonic() - req.arrival_time, reason)
        return RequestOutput(req.request_id, new, finished=True, finish_reason=reason,
                             num_prompt_tokens=len(req.prompt_ids), num_output_tokens=len(req.output_ids))
