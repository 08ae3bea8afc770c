"""The synchronous engine: schedule a step, run it through the runner, sample, report.

``Engine.step()`` is single-threaded and deterministic (tests drive it directly); ``jds.engine.loop``
runs it in a background thread for the HTTP server. An exception raised by ``runner.execute`` fails
exactly the requests of that step (their pages are freed, each gets a finished output with
``finish_reason="error"``) and the engine carries on with the rest.
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
from jds.engine.sampling import SamplingParams, sample
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


class Engine:
    def __init__(self, runner: Runner, *, metrics: MetricsSink | None = None) -> None:
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=runner.max_num_seqs,
                                   max_num_tokens=runner.max_num_tokens)
        self.max_blocks_per_seq = -(-runner.max_model_len // runner.block_size)
        self.metrics = metrics
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_step_failures = 0

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
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), b.num_used, b.num_free,
                           b.num_blocks, b.usage(), self.scheduler.num_preemptions, self.num_steps,
                           self.num_step_failures)

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched:
            return []
        self.num_steps += 1
        if self.metrics:
            for req in sched.reqs:
                if not req.queue_time_reported:
                    req.queue_time_reported = True
                    self.metrics.on_scheduled(req.first_scheduled_time - req.arrival_time)
        chunks, toks = [], []
        table = np.full((len(sched.reqs), self.max_blocks_per_seq), -1, np.int32)
        for row, (req, n) in enumerate(zip(sched.reqs, sched.num_tokens)):
            chunks.append(Chunk(req=row, start=req.num_computed, num_tokens=n))
            toks.extend(req.token_slice(req.num_computed, n))
            pages = self.blocks.blocks_of(req.request_id)
            table[row, : len(pages)] = pages
        try:
            logits = np.asarray(self.runner.execute(np.asarray(toks, np.int32), chunks, table))
            if logits.shape[0] != len(chunks):
                raise RuntimeError(f"runner returned {logits.shape[0]} logit rows for {len(chunks)} chunks")
            return self._advance(sched.reqs, sched.num_tokens, logits)
        except Exception as e:  # noqa: BLE001 - a failed step must not take the engine down
            self.num_step_failures += 1
            msg = f"step failed: {type(e).__name__}: {e}"
            outs = []
            for req in sched.reqs:
                if self.requests.pop(req.request_id, None) is not None:
                    self.scheduler.remove(req)
                    out = self._final(req, [], "error")
                    out.error = msg
                    outs.append(out)
            return outs

    def _advance(self, reqs: list[Request], num_tokens: list[int], logits: np.ndarray) -> list[RequestOutput]:
        eos = self.runner.eos_token_id
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
            self._token_metrics(req, now)
            reason, on_token = None, False
            if (tok == eos and not p.ignore_eos) or tok in p.stop_token_ids:
                reason, on_token = "stop", True
            elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_seq_len:
                reason = "length"
            if reason is None:
                outs.append(RequestOutput(req.request_id, [tok], num_prompt_tokens=len(req.prompt_ids),
                                          num_output_tokens=len(req.output_ids)))
            else:
                self.requests.pop(req.request_id, None)
                self.scheduler.remove(req)
                out = self._final(req, [tok], reason)
                out.stopped_on_token = on_token
                outs.append(out)
        return outs

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
