"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends at most ``max_num_tokens`` tokens over at most ``max_num_seqs`` running requests:
decodes first (one token each, oldest first), then the rest of unfinished prefills, then new or
preempted requests from the waiting queue (FIFO, preempted ones at its front) in prefill chunks.
When a running request needs a page and none is free, the newest running request is preempted: its
pages are freed, its progress reset to 0 and it goes back to the front of the queue to be recomputed
(prompt + the tokens it already produced). Pages of the others are never touched, and a step in which
something was preempted admits nothing new, so the pool cannot thrash.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from jds.engine.blocks import BlockManager
from jds.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """The requests of one step, in row order, with how many tokens each contributes."""

    reqs: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.reqs)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_tokens < 1:
            raise ValueError("max_num_seqs and max_num_tokens must be >= 1")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self._admit_counter = 0
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drop ``req`` from the queues and free its pages (finish, abort or failure)."""
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.blocks.free(req.request_id)
        req.status = RequestStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.num_computed = 0
        req.draft = -1  # the recompute's prefill drafts afresh
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_tokens
        chosen: dict[str, int] = {}
        preempted: list[Request] = []
        # A request whose in-flight token is certainly its last (async stepping) gets nothing more.
        live = [r for r in self.running if not r.finishing]
        decodes = [r for r in live if r.num_remaining == 1]
        prefills = [r for r in live if r.num_remaining > 1]
        for req in decodes + prefills:
            if req.status is not RequestStatus.RUNNING or budget == 0:
                continue
            # a decode with a speculative draft asks for 2 tokens (last token + draft); a shrink to 1 drops the draft
            n = min(req.num_remaining + (req.draft >= 0 and req.num_remaining == 1), budget)
            while not self.blocks.can_allocate(req.request_id, req.num_computed + n):
                if n > 1:  # a prefill chunk shrinks to the pages it can get before anyone is preempted
                    fit = self.blocks.max_tokens_fit(req.request_id) - req.num_computed
                    if fit >= 1:
                        n = min(n, fit)
                        continue
                victim = self.running[-1]
                if victim.request_id in chosen:
                    budget += chosen.pop(victim.request_id)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                self.blocks.allocate(req.request_id, req.num_computed + n)
                chosen[req.request_id] = n
                budget -= n
        if not preempted:
            budget = self._admit(chosen, budget)
        out = SchedulerOutput(preempted=preempted)
        now = time.monotonic()
        for req in self.running:  # rows follow admission order
            if req.request_id in chosen:
                out.reqs.append(req)
                out.num_tokens.append(chosen[req.request_id])
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
        return out

    def _admit(self, chosen: dict[str, int], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_remaining, budget)
            if not self.blocks.can_allocate(req.request_id, n):
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.blocks.allocate(req.request_id, n)
            req.status = RequestStatus.RUNNING
            req.admit_seq = self._admit_counter
            self._admit_counter += 1
            self.running.append(req)
            chosen[req.request_id] = n
            budget -= n
        return budget
