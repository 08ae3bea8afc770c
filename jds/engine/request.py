"""A request's state inside the engine and the deltas the engine reports for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from jds.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Token ids, how many have KV in the cache (``num_computed``) and timing for the metrics."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    admit_seq: int = -1  # order of (re)admission to the running set; the largest is the newest
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    queue_time_reported: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Async stepping: output tokens sampled on the device but not read back yet (0 or 1 at planning time;
    # they count as tokens, as placeholders -1), the row that sampled the newest one in its step, and
    # whether that token is certainly the last (max_tokens / length), so nothing is scheduled after it.
    num_pending: int = 0
    pending_row: int = -1
    finishing: bool = False
    # Speculative decoding (Engine(speculative="mtp")): the drafted next output token, -1 = none. It is not a
    # token of the request (``num_tokens`` leaves it out); the scheduler gives a decode with a draft 2 tokens.
    draft: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_remaining(self) -> int:
        """Tokens whose KV is not yet computed (1 for a request in decode)."""
        return self.num_tokens - self.num_computed

    def token_slice(self, start: int, n: int) -> list[int]:
        """Token ids [start, start + n); a pending (not yet read) output token is the placeholder -1."""
        known = len(self.prompt_ids) + len(self.output_ids)
        if start + n > known:
            head = self.token_slice(start, known - start) if start < known else []
            return head + [-1] * (n - len(head))
        p = len(self.prompt_ids)
        if start + n <= p:
            return self.prompt_ids[start:start + n]
        if start >= p:  # decode: only output tokens (no O(length) concatenation per step)
            return self.output_ids[start - p:start - p + n]
        return self.prompt_ids[start:] + self.output_ids[: start + n - p]


@dataclass
class RequestOutput:
    """What happened to one request in one step: new tokens and/or that it finished.

    ``finish_reason``: "stop" (eos or a stop token; that token is the last of ``new_token_ids`` and
    ``stopped_on_token`` is set), "length", "abort" or "error" (``error`` holds the message).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stopped_on_token: bool = False
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
