"""Request validation and OpenAI-style error bodies.

Every bad field becomes an ``ApiError`` (HTTP status + ``{"error": {message, type, param, code}}``)
before anything reaches the engine, so bad input never costs pages or a step, and no client input can
produce a 5xx: the body must be strict UTF-8 JSON whose nesting depth is measured without recursion
before it is parsed, NaN / Infinity are refused, every string that reaches the tokenizer must be
encodable (no lone surrogates), and fields the server cannot honour are refused by name rather than
ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from jds.engine.sampling import SamplingParams
from jds.server.stop import MAX_STOP_CHARS, MAX_STOP_STRINGS

MAX_TEMPERATURE = 2.0
MAX_JSON_DEPTH = 32  # a chat body with content parts is ~5 deep; json.loads recurses once per level
MAX_STOP_TOKEN_IDS = 256  # the engine tests each sampled token against this list
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """An HTTP error answer; ``code`` is OpenAI's machine-readable string (or None), never the status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape. ``code`` is a string or null: the HTTP status travels on the response
    itself, so an int given here (an old call site) is dropped rather than sent as a code."""
    if not isinstance(code, str):
        code = None
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- the body: UTF-8, bounded depth, finite numbers ----------------------------------------------------
# A JSON string literal, or an unterminated one running to the end of the body. Every alternative starts
# with a distinct character and the quantifiers are possessive, so each quote starts exactly one linear
# match: scanning a hostile body (``"\"\"\"...``) stays linear instead of retrying from every quote.
_STRING = re.compile(rb'"(?:[^"\\]++|\\[\s\S])*+(?:"|\\?\Z)')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_CHUNK = 1 << 20


def json_depth(raw: bytes, limit: int | None = None) -> int:
    """Deepest ``[``/``{`` nesting of ``raw`` outside string literals, by a prefix sum over the brackets:
    linear time, no recursion, so it is safe on input that would overflow ``json.loads``'s stack.
    Stops early once ``limit`` is exceeded. (On malformed JSON the number is only an estimate; the
    parser rejects such a body anyway.)"""
    brackets = np.frombuffer(_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), np.uint8)
    depth = deepest = 0
    for i in range(0, brackets.size, _CHUNK):
        c = brackets[i:i + _CHUNK]
        run = depth + np.cumsum(np.where((c == ord("[")) | (c == ord("{")), 1, -1))
        deepest = max(deepest, int(run.max()))
        depth = int(run[-1])
        if limit is not None and deepest > limit:
            break
    return deepest


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} is out of range for a 64-bit float")
    return v


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not valid JSON (RFC 8259 has no NaN or Infinity)")


_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_no_constant)


def parse_json_body(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode a request body: strict UTF-8, nesting checked before parsing, finite numbers only."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"invalid JSON body: not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})")
    depth = json_depth(raw, max_depth)
    if depth > max_depth:
        raise ApiError(400, f"invalid JSON body: nested deeper than {max_depth} levels")
    try:
        return _DECODER.decode(text)
    except ValueError as e:  # JSONDecodeError, NaN / Infinity, over-long integers
        raise ApiError(400, f"invalid JSON body: {e}") from None


def check_content_type(header: str | None) -> None:
    """JSON bodies only (as vLLM): a missing header is read as JSON, any other media type is a 415
    (curl's ``-d`` sends a form type unless told ``-H 'Content-Type: application/json'``)."""
    if header is None or not header.strip():
        return
    media, _, params = header.partition(";")
    media = media.strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        for p in params.split(";"):  # the body is read as UTF-8 (RFC 8259), so no other charset is honoured
            key, _, value = p.partition("=")
            charset = value.strip().strip('"').lower()
            if key.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
                raise ApiError(415, f"Content-Type charset must be utf-8 (JSON is UTF-8), got {_short(charset)}",
                               code="unsupported_media_type")
        return
    raise ApiError(415, f"Content-Type must be application/json, got {_short(media)} (with curl, add "
                        "-H 'Content-Type: application/json')", code="unsupported_media_type")


def check_content_encoding(header: str | None) -> None:
    """aiohttp decodes exactly one of gzip / deflate (br / zstd where their libraries are installed) and
    passes any other coding through undecoded: refuse those (415) rather than read the body as plain JSON."""
    if header is None:
        return
    enc = header.strip().lower()
    if enc not in ("", "identity", "gzip", "deflate", "br", "zstd"):
        raise ApiError(415, f"Content-Encoding {_short(header.strip(), 40)} is not supported (gzip, deflate or none)",
                       code="unsupported_media_type")


# -- fields ----------------------------------------------------------------------------------------------
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
    return_token_ids: bool = False
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from (chat: max_completion_tokens)


def _bad(msg: str, param: str | None) -> ApiError:
    return ApiError(400, msg, param=param)


def _short(v: Any, n: int = 60) -> str:
    """A bounded repr of client data for an error message."""
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def _clip(name: str, n: int = 40) -> str:
    """A client-chosen field name, bounded for an error message and its param."""
    return name if len(name) <= n else name[: n - 3] + "..."


def _text(v: str, param: str) -> str:
    """``v`` if it is encodable text; a lone UTF-16 surrogate (JSON ``"\\ud800"``) is not."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(f"'{param}' is not valid Unicode text: it holds a lone surrogate U+{ord(v[e.start]):04X} "
                   f"at character {e.start}", param) from None
    return v


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


def _is_int(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _int_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise _bad(f"'{name}' must be a list of integers", name)
    return list(v)


def _messages_to_text(messages: Any) -> list[dict]:
    """Chat messages as ``{"role", "content"}`` with text content; anything the plain template cannot
    render faithfully (unknown roles, image / audio parts, tool calls) is refused, naming the field."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{at} must be an object with 'role' and 'content'", at)
        role = m.get("role")
        if not isinstance(role, str):
            raise _bad(f"{at}.role must be a string (one of {', '.join(CHAT_ROLES)})", f"{at}.role")
        _text(role, f"{at}.role")
        if role in ("tool", "function"):
            raise _bad(f"{at}.role {role!r}: tool / function messages are not supported by this server",
                       f"{at}.role")
        if role not in CHAT_ROLES:
            raise _bad(f"{at}.role {_short(role)} is not a chat role (one of {', '.join(CHAT_ROLES)})",
                       f"{at}.role")
        for key, v in m.items():  # tool_calls, function_call, audio, refusal, ... (null / [] say nothing)
            if key not in ("role", "content", "name") and v is not None and v != []:
                k = _clip(key)
                raise _bad(f"{at}.{k} is not supported by this server", f"{at}.{k}")
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise _bad(f"{at}.name must be a string", f"{at}.name")
            _text(name, f"{at}.name")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not c:
                raise _bad(f"{at}.content must not be an empty list", f"{at}.content")
            texts = []
            for j, p in enumerate(c):
                pat = f"{at}.content[{j}]"
                if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                    raise _bad(f"{pat} must be an object with a string 'type'", pat)
                if p["type"] != "text":
                    raise _bad(f"{pat}.type {_short(p['type'])} is not supported: this model reads text "
                               "parts only", f"{pat}.type")
                if not isinstance(p.get("text"), str):
                    raise _bad(f"{pat}.text must be a string", f"{pat}.text")
                texts.append(_text(p["text"], f"{pat}.text"))
            c = "".join(texts)
        elif not isinstance(c, str):
            raise _bad(f"{at}.content must be a string or a list of text parts", f"{at}.content")
        out.append({"role": role, "content": _text(c, f"{at}.content"), **({"name": name} if name else {})})
    return out


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("'prompt' is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > 1:  # a batch: ["a", "b"] or [[1, 2], [3]]
            raise _bad(f"'prompt' holds a batch of {len(p)} prompts; this server takes one prompt per request "
                       "(a string or a list of token ids): send them as separate requests", "prompt")
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise _bad("'prompt' must not be empty", "prompt")
        return _text(p, "prompt"), None
    if isinstance(p, list):
        if not p:
            raise _bad("'prompt' must not be empty", "prompt")
        return None, _int_list(p, "prompt")
    raise _bad(f"'prompt' must be a string or a list of token ids, got {type(p).__name__}", "prompt")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    for s in stop:
        if not s:  # it would match before any text: a stop at once, or (dropped) a stop never asked for
            raise _bad("each 'stop' string must hold at least one character, got ''", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise _bad(f"each 'stop' string may hold at most {MAX_STOP_CHARS} characters, got {len(s)}", "stop")
        _text(s, "stop")
    return list(stop)


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = float(_get(body, name, (int, float), default, what="a number"))
    if not (lo < v if lo_open else lo <= v) or not v <= hi:
        raise _bad(f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}", name)
    return v


# Every field a body may hold; any other with a value is refused by name (as OpenAI does), so a misspelt or
# unsupported option (``max_new_tokens``, ``min_p``, ``reasoning_effort``) is never silently dropped.
_FIELDS = frozenset((
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream", "stream_options", "stop",
    "stop_token_ids", "ignore_eos", "return_token_ids", "user",
    # refused unless neutral (_refuse_unsupported)
    "logprobs", "top_logprobs", "echo", "suffix", "tools", "tool_choice", "functions", "function_call",
    "logit_bias", "min_tokens", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "audio",
    "prediction", "modalities", "presence_penalty", "frequency_penalty", "repetition_penalty", "best_of",
    "response_format", "store",
    # OpenAI fields that do not change the output: checked for type, otherwise unused
    "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
))
_CHAT_FIELDS = _FIELDS | {"messages", "max_completion_tokens"}
_COMPLETION_FIELDS = _FIELDS | {"prompt"}


def _refuse_unknown(body: dict, chat: bool) -> None:
    known, other = (_CHAT_FIELDS, _COMPLETION_FIELDS) if chat else (_COMPLETION_FIELDS, _CHAT_FIELDS)
    for name, v in body.items():
        if name in known or v is None:
            continue
        shown = _clip(name)
        if name in other:
            here, there = ("/v1/chat/completions", "/v1/completions") if chat else (
                "/v1/completions", "/v1/chat/completions")
            hint = "; this route takes 'max_tokens'" if name == "max_completion_tokens" else ""
            raise _bad(f"'{shown}' is a {there} field, not one of {here}{hint}", shown)
        raise _bad(f"Unrecognized request argument supplied: '{shown}' (this server does not support it)", shown)
    _get(body, "metadata", (dict,), None, what="an object")
    _get(body, "parallel_tool_calls", (bool,), None, what="a boolean")
    for name in ("service_tier", "prompt_cache_key", "safety_identifier"):
        v = _get(body, name, (str,), None, what="a string")
        if v is not None:
            _text(v, name)


def _refuse_unsupported(body: dict) -> None:
    """Fields whose non-default values change the output: refused by name, never ignored."""
    def off(name: str, *neutral: Any) -> None:
        v = body.get(name)
        if v is None or any(v is n or (type(v) is type(n) and v == n) for n in neutral):
            return
        raise _bad(f"'{name}' is not supported by this server (got {_short(v)})", name)

    off("logprobs", False)
    off("top_logprobs", 0)
    off("echo", False)
    off("suffix", "")
    off("tools", [])
    off("tool_choice", "none")
    off("functions", [])
    off("function_call", "none")
    off("logit_bias", {})
    off("min_tokens", 0)
    off("guided_json")
    off("guided_regex")
    off("guided_choice")
    off("guided_grammar")
    off("audio")
    off("prediction")
    off("store", False)
    if body.get("modalities") not in (None, ["text"]):
        raise _bad(f"'modalities' must be [\"text\"], got {_short(body['modalities'])}", "modalities")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise _bad(f"'{name}' is not supported by this server (only 0)", name)
    if _number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True) != 1.0:
        raise _bad("'repetition_penalty' is not supported by this server (only 1)", "repetition_penalty")
    best_of = body.get("best_of")
    if best_of is not None and not (_is_int(best_of) and best_of == 1):
        raise _bad("only best_of=1 is supported", "best_of")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise _bad("'response_format' must be an object with a string 'type'", "response_format")
        if rf["type"] != "text":
            raise _bad(f"'response_format' type {_short(rf['type'])} is not supported: this server has no "
                       "structured output (json_object / json_schema); only {\"type\": \"text\"}",
                       "response_format")


def parse_request(body: Any, *, chat: bool) -> tuple[GenerationRequest, list[dict] | None]:
    """Validate a /v1/completions or /v1/chat/completions body (limits that need the prompt length
    are checked later in ``check_length``). Returns the request and, for chat, the messages."""
    if not isinstance(body, dict):
        raise _bad(f"request body must be a JSON object, got {type(body).__name__}", None)
    model = _get(body, "model", (str,), None, what="a string")
    if model is not None:
        _text(model, "model")
    _refuse_unknown(body, chat)
    messages = None
    prompt_text, prompt_ids = None, None
    if chat:
        messages = _messages_to_text(body.get("messages"))
    else:
        prompt_text, prompt_ids = _prompt(body)
    name = "max_tokens"
    max_tokens = _get(body, name, (int,), None, what="an integer")
    if chat and body.get("max_completion_tokens") is not None:
        mct = _get(body, "max_completion_tokens", (int,), None, what="an integer")
        if max_tokens is not None and max_tokens != mct:
            raise _bad(f"'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({mct}) disagree; send one of them",
                       "max_tokens")
        name, max_tokens = "max_completion_tokens", mct
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"'{name}' must be at least 1, got {max_tokens}", name)
    temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _get(body, "top_k", (int,), -1, what="an integer")
    if top_k < -1:
        raise _bad(f"'top_k' must be -1 (off), 0 (off) or >= 1, got {top_k}", "top_k")
    top_k = top_k if top_k < 2**31 else -1  # beyond any vocabulary: off (check_length maps >= the vocabulary too)
    seed = _get(body, "seed", (int,), None, what="an integer")
    if seed is not None and not -2**63 <= seed < 2**63:  # the engine keys its RNG by the seed's 64 bits
        raise _bad(f"'seed' must be a 64-bit integer (in [-2^63, 2^63)), got {_short(seed, 40)}", "seed")
    n = _get(body, "n", (int,), 1, what="an integer")
    if n != 1:
        raise _bad(f"only n=1 is supported, got {n}", "n")
    stream = _get(body, "stream", (bool,), False, what="a boolean")
    so = _get(body, "stream_options", (dict,), {}, what="an object")
    if so and not stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    for key in so:
        if key != "include_usage":
            raise _bad(f"'stream_options.{_short(key, 40)}' is not supported (only include_usage)",
                       "stream_options")
    include_usage = so.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")
    stop_ids = _int_list(body["stop_token_ids"], "stop_token_ids") if body.get("stop_token_ids") is not None else []
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise _bad(f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}",
                   "stop_token_ids")
    ignore_eos = _get(body, "ignore_eos", (bool,), False, what="a boolean")
    return_ids = _get(body, "return_token_ids", (bool,), False, what="a boolean")
    stop = _stop(body)
    if body.get("user") is not None:
        _text(_get(body, "user", (str,), None, what="a string"), "user")
    _refuse_unsupported(body)
    params = SamplingParams(max_tokens=max_tokens or 1, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos)
    return GenerationRequest(prompt_text, prompt_ids, params, max_tokens is not None, stream, include_usage,
                             stop, model, chat, return_ids, name), messages


def check_length(req: GenerationRequest, prompt_len: int, *, max_seq_len: int, vocab_size: int) -> SamplingParams:
    """Fill in / check max_tokens against the context limit; returns the final SamplingParams.

    Without ``max_tokens`` a completion gets ``DEFAULT_COMPLETION_MAX_TOKENS`` (as OpenAI and vLLM) and a
    chat request the rest of the context (as vLLM), each capped by the room the prompt leaves."""
    if prompt_len == 0:
        raise _bad("the prompt is empty", "prompt" if not req.chat else "messages")
    if req.prompt_ids is not None and any(not 0 <= t < vocab_size for t in req.prompt_ids):
        raise _bad(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if any(not 0 <= t < vocab_size for t in req.params.stop_token_ids):
        raise _bad(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    params = req.params
    if params.top_k >= vocab_size:  # keeps every token: the same as off (and fits the engine's int32 rows)
        params = dataclasses.replace(params, top_k=-1)
    param = "messages" if req.chat else "prompt"
    if prompt_len >= max_seq_len:
        raise ApiError(400, f"This model's maximum context length is {max_seq_len} tokens; the prompt has "
                            f"{prompt_len} tokens, leaving no room for output.", param=param,
                       code="context_length_exceeded")
    room = max_seq_len - prompt_len
    if not req.max_tokens_given:
        return dataclasses.replace(params, max_tokens=room if req.chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room))
    if prompt_len + params.max_tokens > max_seq_len:
        raise ApiError(400, f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
                            f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                            f"{params.max_tokens} for the completion).", param=req.max_tokens_param,
                       code="context_length_exceeded")
    return params
