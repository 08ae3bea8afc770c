"""Request validation and OpenAI-style error bodies.

Every bad field becomes an ``ApiError`` (HTTP status + ``{"error": {message, type, param, code}}``)
before anything reaches the engine, so bad input never costs pages or a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jds.engine.sampling import SamplingParams

MAX_TEMPERATURE = 2.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code if code is not None else status

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class GenerationRequest:
    """A validated completion / chat request: prompt (text or ids), sampling and streaming options."""

    prompt_text: str | None
    prompt_ids: list[int] | None
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    stop: list[str]
    model: str | None
    chat: bool


def _bad(msg: str, param: str | None) -> ApiError:
    return ApiError(400, msg, param=param)


def _get(body: dict, name: str, types: tuple[type, ...], default: Any, *, what: str) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    # bool is an int subclass: reject it where a number is expected.
    if isinstance(v, bool) and bool not in types:
        raise _bad(f"'{name}' must be {what}, got {v!r}", name)
    if not isinstance(v, types):
        raise _bad(f"'{name}' must be {what}, got {type(v).__name__}", name)
    return v


def _int_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise _bad(f"'{name}' must be a list of integers", name)
    return list(v)


def _messages_to_text(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        c = m.get("content")
        if isinstance(c, list):  # content parts: keep the text ones
            parts = [p.get("text") for p in c if isinstance(p, dict) and p.get("type") == "text"]
            if not all(isinstance(p, str) for p in parts):
                raise _bad(f"messages[{i}].content parts must carry string 'text'", "messages")
            c = "".join(parts)
        if not isinstance(c, str):
            raise _bad(f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": c})
    return out


def parse_request(body: Any, *, chat: bool) -> tuple[GenerationRequest, list[dict] | None]:
    """Validate a /v1/completions or /v1/chat/completions body (limits that need the prompt length
    are checked later in ``check_length``). Returns the request and, for chat, the messages."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    model = _get(body, "model", (str,), None, what="a string")
    messages = None
    prompt_text, prompt_ids = None, None
    if chat:
        messages = _messages_to_text(body.get("messages"))
    else:
        if "prompt" not in body or body["prompt"] is None:
            raise _bad("'prompt' is required", "prompt")
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            prompt_text = p
        elif isinstance(p, list) and p:
            prompt_ids = _int_list(p, "prompt")
        else:
            raise _bad("'prompt' must be a non-empty string or list of token ids (one prompt per request)",
                       "prompt")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, name, (int,), None, what="an integer")
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"'{name}' must be at least 1, got {max_tokens}", name)
    temperature = float(_get(body, "temperature", (int, float), 1.0, what="a number"))
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise _bad(f"'temperature' must be in [0, {MAX_TEMPERATURE}], got {temperature}", "temperature")
    top_p = float(_get(body, "top_p", (int, float), 1.0, what="a number"))
    if not 0.0 < top_p <= 1.0:
        raise _bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _get(body, "top_k", (int,), -1, what="an integer")
    if top_k < -1:
        raise _bad(f"'top_k' must be -1 (off), 0 (off) or >= 1, got {top_k}", "top_k")
    seed = _get(body, "seed", (int,), None, what="an integer")
    n = _get(body, "n", (int,), 1, what="an integer")
    if n != 1:
        raise _bad("only n=1 is supported", "n")
    stream = _get(body, "stream", (bool,), False, what="a boolean")
    so = _get(body, "stream_options", (dict,), {}, what="an object")
    include_usage = so.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")
    stop_ids = _int_list(body["stop_token_ids"], "stop_token_ids") if body.get("stop_token_ids") is not None else []
    ignore_eos = _get(body, "ignore_eos", (bool,), False, what="a boolean")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    stop = [s for s in stop if s]
    for unsupported in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "logit_bias"):
        if body.get(unsupported):
            raise _bad(f"'{unsupported}' is not supported by this server", unsupported)
    if body.get("best_of") not in (None, 1):
        raise _bad("only best_of=1 is supported", "best_of")
    params = SamplingParams(max_tokens=max_tokens or 1, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos)
    return GenerationRequest(prompt_text, prompt_ids, params, max_tokens is not None, stream, include_usage,
                             stop, model, chat), messages


def check_length(req: GenerationRequest, prompt_len: int, *, max_seq_len: int, vocab_size: int) -> SamplingParams:
    """Fill in / check max_tokens against the context limit; returns the final SamplingParams."""
    import dataclasses

    if prompt_len == 0:
        raise _bad("the prompt is empty", "prompt" if not req.chat else "messages")
    if req.prompt_ids is not None and any(not 0 <= t < vocab_size for t in req.prompt_ids):
        raise _bad(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    param = "messages" if req.chat else "prompt"
    if prompt_len >= max_seq_len:
        raise ApiError(400, f"This model's maximum context length is {max_seq_len} tokens; the prompt has "
                            f"{prompt_len} tokens, leaving no room for output.", param=param,
                       code="context_length_exceeded")
    if not req.max_tokens_given:
        return dataclasses.replace(req.params, max_tokens=max_seq_len - prompt_len)
    if prompt_len + req.params.max_tokens > max_seq_len:
        raise ApiError(400, f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
                            f"{prompt_len + req.params.max_tokens} tokens ({prompt_len} in the prompt, "
                            f"{req.params.max_tokens} for the completion).", param="max_tokens",
                       code="context_length_exceeded")
    return req.params
