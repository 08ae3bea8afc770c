"""Hostile input against the HTTP server (CPU, in-process on the fake runner, no JAX).

Every malformed or hostile request must get a 4xx with OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``, ``code`` a string or null) and leave the server
answering ``/health``; a 5xx is a defect. The table grows with each case found. The API gaps of
issue 23 (model retrieve, Retry-After, response_format, default max_tokens, a client leaving right
after ``[DONE]``, a busy port) are checked here too.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import subprocess
import sys
import time

import httpx
import pytest
from aiohttp import web

from jds.engine.fake import FakeRunner
from jds.server.protocol import MAX_JSON_DEPTH, json_depth, parse_json_body
from jds.server.stop import MAX_STOP_CHARS, MAX_STOP_STRINGS, StopChecker
from tests.test_server import MODEL, ROOT, InProcess, sse_events

CTX = 256  # the fake runner's max_model_len


@pytest.fixture(scope="module")
def srv():
    s = InProcess(FakeRunner(block_size=16, max_model_len=CTX))
    assert s.loop.ready.wait(10)
    with httpx.Client(base_url=s.base, timeout=30) as c:
        c.inproc = s
        yield c
    s.close()


def raw(text: str) -> bytes:
    """A body written as JSON text by hand (lone surrogate escapes, NaN, ...), sent as is."""
    return text.encode("utf-8")


C, CH = "/v1/completions", "/v1/chat/completions"
P = {"model": MODEL, "prompt": "hi"}
U = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"model": MODEL, "messages": U, **kw}


def msg(**m):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi", **m}]}


def parts(*ps):
    return {"model": MODEL, "messages": [{"role": "user", "content": list(ps)}]}


# (id, method, path, body: dict | bytes | None, content-type or None, status, param)
JSON = "application/json"
CASES = [
    # -- text that cannot be encoded: lone UTF-16 surrogates --------------------------------------
    ("surrogate-prompt", "POST", C, raw('{"prompt": "a\\ud800b"}'), JSON, 400, "prompt"),
    ("surrogate-low-prompt-batch1", "POST", C, raw('{"prompt": ["\\udc00"]}'), JSON, 400, "prompt"),
    ("surrogate-content", "POST", CH, raw('{"messages": [{"role": "user", "content": "\\ud800"}]}'), JSON, 400,
     "messages[0].content"),
    ("surrogate-role", "POST", CH, raw('{"messages": [{"role": "\\ud800", "content": "hi"}]}'), JSON, 400,
     "messages[0].role"),
    ("surrogate-part", "POST", CH, raw('{"messages": [{"role": "user", "content": [{"type": "text", '
                                       '"text": "x\\udfff"}]}]}'), JSON, 400, "messages[0].content[0].text"),
    ("surrogate-name", "POST", CH, raw('{"messages": [{"role": "user", "name": "\\ud800", "content": "hi"}]}'),
     JSON, 400, "messages[0].name"),
    ("surrogate-stop", "POST", C, raw('{"prompt": "hi", "stop": ["\\ud800"]}'), JSON, 400, "stop"),
    ("surrogate-model", "POST", C, raw('{"model": "\\ud800", "prompt": "hi"}'), JSON, 400, "model"),
    # -- the body itself ------------------------------------------------------------------------------
    ("deep-100k-array", "POST", C, b"[" * 100_000 + b"]" * 100_000, JSON, 400, None),
    ("deep-100k-object", "POST", CH, b'{"a":' * 100_000 + b"1" + b"}" * 100_000, JSON, 400, None),
    ("deep-in-field", "POST", C, raw('{"prompt": "hi", "x": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" *
                                     (MAX_JSON_DEPTH + 1) + "}"), JSON, 400, None),
    ("deep-unclosed", "POST", C, b"[" * 1_000_000, JSON, 400, None),
    ("quotes-unterminated", "POST", C, b'"' + b'\\"' * 1_000_000 + b"\\", JSON, 400, None),
    ("nan", "POST", C, raw('{"prompt": "hi", "temperature": NaN}'), JSON, 400, None),
    ("infinity", "POST", C, raw('{"prompt": "hi", "max_tokens": Infinity}'), JSON, 400, None),
    ("-infinity", "POST", C, raw('{"prompt": "hi", "top_p": -Infinity}'), JSON, 400, None),
    ("float-overflow", "POST", C, raw('{"prompt": "hi", "temperature": 1e999}'), JSON, 400, None),
    ("int-5000-digits", "POST", C, raw('{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}"), JSON, 400, None),
    ("not-json", "POST", C, b"{not json", JSON, 400, None),
    ("truncated", "POST", C, b'{"prompt": "hi"', JSON, 400, None),
    ("empty-body", "POST", C, b"", JSON, 400, None),
    ("invalid-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', JSON, 400, None),
    ("overlong-utf8", "POST", C, b'{"prompt": "\xc0\xaf"}', JSON, 400, None),
    ("utf16-body", "POST", C, '{"prompt": "hi"}'.encode("utf-16"), JSON, 400, None),
    ("body-array", "POST", C, b"[1, 2]", JSON, 400, None),
    ("body-string", "POST", C, b'"hi"', JSON, 400, None),
    ("body-number", "POST", CH, b"123", JSON, 400, None),
    ("body-null", "POST", CH, b"null", JSON, 400, None),
    ("body-true", "POST", C, b"true", JSON, 400, None),
    # -- content type ---------------------------------------------------------------------------------
    ("ctype-text", "POST", C, json.dumps(P).encode(), "text/plain", 415, None),
    ("ctype-form", "POST", C, json.dumps(P).encode(), "application/x-www-form-urlencoded", 415, None),
    ("ctype-multipart", "POST", CH, json.dumps(chat()).encode(), "multipart/form-data; boundary=x", 415, None),
    ("ctype-xml", "POST", C, b"<prompt>hi</prompt>", "application/xml", 415, None),
    ("ctype-charset-utf16", "POST", C, '{"prompt": "hi"}'.encode("utf-16-le"), "application/json; charset=utf-16le",
     415, None),
    ("ctype-charset-latin1", "POST", C, json.dumps(P).encode(), "application/json; charset=ISO-8859-1", 415, None),
    # -- routes and methods ---------------------------------------------------------------------------
    ("unknown-route", "GET", "/v1/nothing", None, None, 404, None),
    ("get-completions", "GET", C, None, None, 405, None),
    ("delete-models", "DELETE", "/v1/models", None, None, 405, None),
    ("put-chat", "PUT", CH, json.dumps(chat()).encode(), JSON, 405, None),
    ("retrieve-unknown-model", "GET", "/v1/models/gpt-4", None, None, 404, "model"),
    ("retrieve-unknown-slash", "GET", "/v1/models/org/" + MODEL, None, None, 404, "model"),
    # -- prompt ---------------------------------------------------------------------------------------
    ("prompt-missing", "POST", C, {"model": MODEL}, None, 400, "prompt"),
    ("prompt-null", "POST", C, {"prompt": None}, None, 400, "prompt"),
    ("prompt-number", "POST", C, {"prompt": 5}, None, 400, "prompt"),
    ("prompt-bool", "POST", C, {"prompt": True}, None, 400, "prompt"),
    ("prompt-object", "POST", C, {"prompt": {"text": "hi"}}, None, 400, "prompt"),
    ("prompt-empty", "POST", C, {"prompt": ""}, None, 400, "prompt"),
    ("prompt-empty-list", "POST", C, {"prompt": []}, None, 400, "prompt"),
    ("prompt-batch-strings", "POST", C, {"prompt": ["a", "b"]}, None, 400, "prompt"),
    ("prompt-batch-ids", "POST", C, {"prompt": [[1, 2], [3]]}, None, 400, "prompt"),
    ("prompt-mixed-list", "POST", C, {"prompt": [1, "a"]}, None, 400, "prompt"),
    ("prompt-float-ids", "POST", C, {"prompt": [1.5]}, None, 400, "prompt"),
    ("prompt-bool-ids", "POST", C, {"prompt": [True]}, None, 400, "prompt"),
    ("prompt-negative-id", "POST", C, {"prompt": [-1]}, None, 400, "prompt"),
    ("prompt-id-beyond-vocab", "POST", C, {"prompt": [10**6]}, None, 400, "prompt"),
    ("prompt-huge-id", "POST", C, {"prompt": [10**30]}, None, 400, "prompt"),
    ("prompt-too-long", "POST", C, {"prompt": "x" * CTX}, None, 400, "prompt"),
    # -- messages -------------------------------------------------------------------------------------
    ("messages-missing", "POST", CH, {"model": MODEL}, None, 400, "messages"),
    ("messages-empty", "POST", CH, {"messages": []}, None, 400, "messages"),
    ("messages-string", "POST", CH, {"messages": "hi"}, None, 400, "messages"),
    ("message-not-object", "POST", CH, {"messages": ["hi"]}, None, 400, "messages[0]"),
    ("message-no-role", "POST", CH, {"messages": [{"content": "hi"}]}, None, 400, "messages[0].role"),
    ("message-role-number", "POST", CH, {"messages": [{"role": 1, "content": "hi"}]}, None, 400, "messages[0].role"),
    ("message-role-unknown", "POST", CH, {"messages": [{"role": "wizard", "content": "hi"}]}, None, 400,
     "messages[0].role"),
    ("message-role-tool", "POST", CH, {"messages": [*U, {"role": "tool", "content": "x", "tool_call_id": "1"}]},
     None, 400, "messages[1].role"),
    ("message-content-missing", "POST", CH, {"messages": [{"role": "user"}]}, None, 400, "messages[0].content"),
    ("message-content-number", "POST", CH, msg(content=5), None, 400, "messages[0].content"),
    ("message-content-object", "POST", CH, msg(content={"text": "hi"}), None, 400, "messages[0].content"),
    ("message-parts-empty", "POST", CH, parts(), None, 400, "messages[0].content"),
    ("message-image-only", "POST", CH, parts({"type": "image_url", "image_url": {"url": "http://x/y.png"}}), None,
     400, "messages[0].content[0].type"),
    ("message-text-then-image", "POST", CH, parts({"type": "text", "text": "look"},
                                                  {"type": "image_url", "image_url": {"url": "data:,"}}), None,
     400, "messages[0].content[1].type"),
    ("message-audio-part", "POST", CH, parts({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
     None, 400, "messages[0].content[0].type"),
    ("message-part-not-object", "POST", CH, parts("hi"), None, 400, "messages[0].content[0]"),
    ("message-part-no-type", "POST", CH, parts({"text": "hi"}), None, 400, "messages[0].content[0]"),
    ("message-part-no-text", "POST", CH, parts({"type": "text"}), None, 400, "messages[0].content[0].text"),
    ("message-name-number", "POST", CH, msg(name=5), None, 400, "messages[0].name"),
    ("message-refusal", "POST", CH, msg(refusal="I can't"), None, 400, "messages[0].refusal"),
    ("message-reasoning-content", "POST", CH, msg(reasoning_content="thinking"), None, 400,
     "messages[0].reasoning_content"),
    ("message-tool-call-id-on-user", "POST", CH, msg(tool_call_id="1"), None, 400, "messages[0].tool_call_id"),
    ("message-tool-calls", "POST", CH, {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, None, 400,
     "messages[0].tool_calls"),
    ("messages-too-long", "POST", CH, {"messages": [{"role": "user", "content": "x" * CTX}]}, None, 400, "messages"),
    # -- max_tokens -----------------------------------------------------------------------------------
    ("max-tokens-negative", "POST", C, {**P, "max_tokens": -5}, None, 400, "max_tokens"),
    ("max-tokens-zero", "POST", C, {**P, "max_tokens": 0}, None, 400, "max_tokens"),
    ("max-tokens-string", "POST", C, {**P, "max_tokens": "8"}, None, 400, "max_tokens"),
    ("max-tokens-float", "POST", C, {**P, "max_tokens": 2.5}, None, 400, "max_tokens"),
    ("max-tokens-bool", "POST", C, {**P, "max_tokens": True}, None, 400, "max_tokens"),
    ("max-tokens-huge", "POST", C, {**P, "max_tokens": 10**30}, None, 400, "max_tokens"),
    ("max-tokens-over-context", "POST", C, {**P, "max_tokens": CTX}, None, 400, "max_tokens"),
    ("max-completion-tokens-zero", "POST", CH, chat(max_completion_tokens=0), None, 400, "max_completion_tokens"),
    ("max-completion-tokens-over-context", "POST", CH, chat(max_completion_tokens=CTX), None, 400,
     "max_completion_tokens"),
    ("max-tokens-disagrees-with-max-completion-tokens", "POST", CH, chat(max_tokens=3, max_completion_tokens=5), None,
     400, "max_tokens"),
    ("max-tokens-string-beside-max-completion-tokens", "POST", CH, chat(max_tokens="8", max_completion_tokens=5),
     None, 400, "max_tokens"),
    ("max-completion-tokens-on-completions", "POST", C, {**P, "max_completion_tokens": 3}, None, 400,
     "max_completion_tokens"),
    # -- sampling -------------------------------------------------------------------------------------
    ("temperature-negative", "POST", C, {**P, "temperature": -0.1}, None, 400, "temperature"),
    ("temperature-big", "POST", C, {**P, "temperature": 1e308}, None, 400, "temperature"),
    ("temperature-string", "POST", C, {**P, "temperature": "hot"}, None, 400, "temperature"),
    ("top-p-zero", "POST", C, {**P, "top_p": 0}, None, 400, "top_p"),
    ("top-p-big", "POST", C, {**P, "top_p": 1.5}, None, 400, "top_p"),
    ("top-p-list", "POST", C, {**P, "top_p": [0.5]}, None, 400, "top_p"),
    ("top-k-negative", "POST", C, {**P, "top_k": -2}, None, 400, "top_k"),
    ("top-k-float", "POST", C, {**P, "top_k": 2.5}, None, 400, "top_k"),
    ("seed-string", "POST", C, {**P, "seed": "1"}, None, 400, "seed"),
    ("seed-float", "POST", C, {**P, "seed": 1.5}, None, 400, "seed"),
    ("seed-2^64", "POST", C, {**P, "seed": 2**64}, None, 400, "seed"),
    ("seed-below-int64", "POST", C, {**P, "seed": -2**63 - 1}, None, 400, "seed"),
    ("seed-10^30", "POST", CH, chat(seed=10**30), None, 400, "seed"),
    ("n-zero", "POST", C, {**P, "n": 0}, None, 400, "n"),
    ("n-negative", "POST", C, {**P, "n": -1}, None, 400, "n"),
    ("n-two", "POST", CH, chat(n=2), None, 400, "n"),
    ("n-string", "POST", C, {**P, "n": "1"}, None, 400, "n"),
    ("n-bool", "POST", C, {**P, "n": True}, None, 400, "n"),
    ("best-of-3", "POST", C, {**P, "best_of": 3}, None, 400, "best_of"),
    ("logprobs-int", "POST", C, {**P, "logprobs": 5}, None, 400, "logprobs"),
    ("logprobs-zero", "POST", C, {**P, "logprobs": 0}, None, 400, "logprobs"),
    ("logprobs-negative", "POST", C, {**P, "logprobs": -1}, None, 400, "logprobs"),
    ("logprobs-string", "POST", C, {**P, "logprobs": "yes"}, None, 400, "logprobs"),
    ("logprobs-chat-true", "POST", CH, chat(logprobs=True), None, 400, "logprobs"),
    ("top-logprobs", "POST", CH, chat(top_logprobs=3), None, 400, "top_logprobs"),
    ("echo", "POST", C, {**P, "echo": True}, None, 400, "echo"),
    ("suffix", "POST", C, {**P, "suffix": "end"}, None, 400, "suffix"),
    ("tools", "POST", CH, chat(tools=[{"type": "function", "function": {"name": "f"}}]), None, 400, "tools"),
    ("tool-choice", "POST", CH, chat(tool_choice="required"), None, 400, "tool_choice"),
    ("logit-bias", "POST", C, {**P, "logit_bias": {"65": 100}}, None, 400, "logit_bias"),
    ("presence-penalty", "POST", C, {**P, "presence_penalty": 0.5}, None, 400, "presence_penalty"),
    ("frequency-penalty-range", "POST", C, {**P, "frequency_penalty": 3}, None, 400, "frequency_penalty"),
    ("frequency-penalty-string", "POST", C, {**P, "frequency_penalty": "x"}, None, 400, "frequency_penalty"),
    ("repetition-penalty", "POST", C, {**P, "repetition_penalty": 1.2}, None, 400, "repetition_penalty"),
    ("min-tokens", "POST", C, {**P, "min_tokens": 4}, None, 400, "min_tokens"),
    ("modalities-audio", "POST", CH, chat(modalities=["text", "audio"]), None, 400, "modalities"),
    ("response-format-json-object", "POST", CH, chat(response_format={"type": "json_object"}), None, 400,
     "response_format"),
    ("response-format-json-schema", "POST", CH, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}), None, 400, "response_format"),
    ("response-format-completions", "POST", C, {**P, "response_format": {"type": "json_object"}}, None, 400,
     "response_format"),
    ("response-format-string", "POST", CH, chat(response_format="text"), None, 400, "response_format"),
    ("response-format-no-type", "POST", CH, chat(response_format={}), None, 400, "response_format"),
    # -- stop -----------------------------------------------------------------------------------------
    ("stop-number", "POST", C, {**P, "stop": 5}, None, 400, "stop"),
    ("stop-list-of-numbers", "POST", C, {**P, "stop": [1]}, None, 400, "stop"),
    ("stop-empty-string", "POST", C, {**P, "stop": ""}, None, 400, "stop"),
    ("stop-list-with-empty", "POST", C, {**P, "stop": ["a", ""]}, None, 400, "stop"),
    ("stop-five", "POST", C, {**P, "stop": ["a", "b", "c", "d", "e"]}, None, 400, "stop"),
    ("stop-300k", "POST", C, {**P, "stop": [f"s{i}" for i in range(300_000)]}, None, 400, "stop"),
    ("stop-too-long", "POST", C, {**P, "stop": "x" * (MAX_STOP_CHARS + 1)}, None, 400, "stop"),
    ("stop-token-ids-float", "POST", C, {**P, "stop_token_ids": [1.5]}, None, 400, "stop_token_ids"),
    ("stop-token-ids-beyond-vocab", "POST", C, {**P, "stop_token_ids": [10**6]}, None, 400, "stop_token_ids"),
    ("stop-token-ids-many", "POST", C, {**P, "stop_token_ids": list(range(300)) * 2}, None, 400, "stop_token_ids"),
    # -- flags and streaming options ------------------------------------------------------------------
    ("stream-string", "POST", C, {**P, "stream": "yes"}, None, 400, "stream"),
    ("stream-int", "POST", C, {**P, "stream": 1}, None, 400, "stream"),
    ("stream-options-without-stream", "POST", C, {**P, "stream_options": {"include_usage": True}}, None, 400,
     "stream_options"),
    ("stream-options-string", "POST", C, {**P, "stream": True, "stream_options": "x"}, None, 400, "stream_options"),
    ("stream-options-usage-string", "POST", C, {**P, "stream": True, "stream_options": {"include_usage": "y"}},
     None, 400, "stream_options"),
    ("stream-options-unknown", "POST", C, {**P, "stream": True, "stream_options": {"continuous": True}}, None, 400,
     "stream_options"),
    ("ignore-eos-string", "POST", C, {**P, "ignore_eos": "no"}, None, 400, "ignore_eos"),
    ("return-token-ids-int", "POST", C, {**P, "return_token_ids": 1}, None, 400, "return_token_ids"),
    ("user-number", "POST", C, {**P, "user": 5}, None, 400, "user"),
    ("model-number", "POST", C, {**P, "model": 5}, None, 400, "model"),
    # -- fields the server does not know: refused by name (as OpenAI does), never dropped -------------
    ("unknown-field", "POST", C, {**P, "max_new_tokens": 5}, None, 400, "max_new_tokens"),
    ("unknown-min-p", "POST", CH, chat(min_p=0.1), None, 400, "min_p"),
    ("unknown-reasoning-effort", "POST", CH, chat(reasoning_effort="high"), None, 400, "reasoning_effort"),
    ("unknown-include-stop-str", "POST", C, {**P, "include_stop_str_in_output": True}, None, 400,
     "include_stop_str_in_output"),
    ("unknown-surrogate-key", "POST", C, raw('{"prompt": "hi", "\\ud800": 1}'), JSON, 400, "\ud800"),
    ("messages-on-completions", "POST", C, {**P, "messages": U}, None, 400, "messages"),
    ("prompt-on-chat", "POST", CH, chat(prompt="hi"), None, 400, "prompt"),
    ("store-true", "POST", CH, chat(store=True), None, 400, "store"),
    ("metadata-string", "POST", CH, chat(metadata="x"), None, 400, "metadata"),
    ("parallel-tool-calls-string", "POST", CH, chat(parallel_tool_calls="yes"), None, 400, "parallel_tool_calls"),
    ("service-tier-number", "POST", CH, chat(service_tier=1), None, 400, "service_tier"),
    ("model-unknown", "POST", C, {**P, "model": "gpt-4"}, None, 404, "model"),
    ("model-unknown-chat", "POST", CH, chat(model="x" * 10_000), None, 404, "model"),
]


def check_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and len(err["message"]) < 1000
    assert isinstance(err["type"], str) and err["type"]
    assert err["code"] is None or isinstance(err["code"], str), err
    assert err["param"] == param, err
    return err


def send(client: httpx.Client, method: str, path: str, body, ctype: str | None) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return client.request(method, path, json=body)
    headers = {"Content-Type": ctype} if ctype else {}
    return client.request(method, path, content=body, headers=headers)


def test_cases_have_unique_ids():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("name,method,path,body,ctype,status,param", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_gets_4xx_and_server_lives(srv, name, method, path, body, ctype, status, param):
    t = time.perf_counter()
    r = send(srv, method, path, body, ctype)
    took = time.perf_counter() - t
    check_error(r, status, param)
    assert took < 10, f"{name}: {took:.1f}s"  # linear-time parsing: a quadratic scan would take hours
    assert srv.get("/health").status_code == 200


def test_messages_name_fields(srv):
    """Error messages name the field, and the batch-prompt message says what to do."""
    err = check_error(srv.post(C, json={"prompt": ["a", "b"]}), 400, "prompt")
    assert "batch of 2 prompts" in err["message"] and "one prompt per request" in err["message"]
    err = check_error(srv.post(CH, json=chat(response_format={"type": "json_object"})), 400, "response_format")
    assert "json_object" in err["message"] and "not supported" in err["message"]
    err = check_error(srv.post(CH, json=parts({"type": "image_url", "image_url": {"url": "x"}})), 400,
                      "messages[0].content[0].type")
    assert "image_url" in err["message"]
    err = check_error(srv.post(C, content=raw('{"prompt": "a\\ud800"}'), headers={"Content-Type": JSON}), 400,
                      "prompt")
    assert "surrogate U+D800" in err["message"]
    err = check_error(srv.post(C, content=b"[" * 1000, headers={"Content-Type": JSON}), 400, None)
    assert f"deeper than {MAX_JSON_DEPTH}" in err["message"]
    err = check_error(srv.post(C, json={**P, "stop": list("abcde")}), 400, "stop")
    assert f"at most {MAX_STOP_STRINGS}" in err["message"]
    err = check_error(srv.post(C, content=json.dumps(P), headers={"Content-Type": "application/x-www-form-urlencoded"}),
                      415, None)
    assert "-H 'Content-Type: application/json'" in err["message"]
    err = check_error(srv.post(C, json={**P, "max_new_tokens": 5}), 400, "max_new_tokens")
    assert "Unrecognized request argument" in err["message"] and "'max_new_tokens'" in err["message"]
    err = check_error(srv.post(C, json={**P, "max_completion_tokens": 5}), 400, "max_completion_tokens")
    assert "/v1/chat/completions field" in err["message"] and "'max_tokens'" in err["message"]
    err = check_error(srv.post(CH, json=chat(max_tokens=3, max_completion_tokens=5)), 400, "max_tokens")
    assert "'max_completion_tokens' (5)" in err["message"]
    err = check_error(srv.post(C, json={**P, "seed": 2**64}), 400, "seed")
    assert "64-bit" in err["message"]
    err = check_error(srv.post(CH, json=chat(max_completion_tokens=CTX)), 400, "max_completion_tokens")
    assert err["code"] == "context_length_exceeded"


def test_health_stays_fast_under_stop_string_floods(srv):
    """Floods of 4 MB stop lists are refused at parse time; /health answers meanwhile."""
    import threading

    body = json.dumps({**P, "stop": [f"s{i}" for i in range(300_000)]}).encode()
    done = threading.Event()
    codes = []

    def flood():
        with httpx.Client(base_url=str(srv.base_url), timeout=60) as c:
            while not done.is_set():
                codes.append(c.post(C, content=body, headers={"Content-Type": JSON}).status_code)

    th = threading.Thread(target=flood)
    th.start()
    try:
        lat = []
        for _ in range(8):
            t = time.perf_counter()
            assert srv.get("/health").status_code == 200
            lat.append(time.perf_counter() - t)
            time.sleep(0.01)
    finally:
        done.set()
        th.join(60)
    assert codes and set(codes) == {400}
    assert sorted(lat)[len(lat) // 2] < 0.5, lat


# --- accepted inputs that used to be ignored or missing -----------------------------------------------
def test_models_retrieve(srv):
    d = srv.get(f"/v1/models/{MODEL}").json()
    assert d["id"] == MODEL and d["object"] == "model" and d["max_model_len"] == CTX
    assert srv.get("/v1/models").json()["data"] == [d]
    err = check_error(srv.get("/v1/models/nope"), 404, "model")
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"


def test_completion_default_max_tokens_is_16(srv):
    body = {"prompt": "hi", "temperature": 0, "ignore_eos": True}
    assert srv.post(C, json=body).json()["usage"]["completion_tokens"] == 16
    near_end = {**body, "prompt": "x" * (CTX - 5)}  # 5 tokens of room left: capped, not refused
    assert srv.post(C, json=near_end).json()["usage"]["completion_tokens"] == 5
    # chat keeps its default: the rest of the context (as vLLM)
    d = srv.post(CH, json={"messages": U, "temperature": 0, "ignore_eos": True}).json()
    assert d["usage"]["prompt_tokens"] + d["usage"]["completion_tokens"] == CTX


def test_text_only_options_are_accepted(srv):
    base = {"messages": U, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    ref_body = srv.post(CH, json=base).json()
    ref, ref_usage = ref_body["choices"][0]["message"]["content"], ref_body["usage"]
    for extra in ({"response_format": {"type": "text"}}, {"logprobs": False, "top_logprobs": 0},
                  {"presence_penalty": 0, "frequency_penalty": 0.0, "tools": [], "tool_choice": "none"},
                  {"messages": [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text",
                                                                                             "text": "i"}]}]},
                  {"stop": []}, {"user": "u1", "seed": 3},
                  # OpenAI fields with no effect on the output, null for an unknown field, an SDK message dump
                  {"metadata": {"k": "v"}, "service_tier": "auto", "parallel_tool_calls": False, "store": False,
                   "prompt_cache_key": "c", "safety_identifier": "s", "some_extension": None},
                  {"max_completion_tokens": 4},
                  {"messages": [{"role": "user", "content": "hi", "refusal": None, "annotations": [],
                                 "tool_calls": None, "audio": None}]}):
        r = srv.post(CH, json={**base, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["message"]["content"] == ref, extra
    named = srv.post(CH, json={**base, "messages": [{"role": "user", "content": "hi", "name": "alice"}]}).json()
    assert named["usage"]["prompt_tokens"] == ref_usage["prompt_tokens"] + len(" (alice)")  # rendered, not dropped
    for role in ("system", "developer", "assistant"):
        r = srv.post(CH, json={**base, "messages": [{"role": role, "content": "x"}, *U]})
        assert r.status_code == 200, (role, r.text)


def test_seed_and_top_k_extremes(srv):
    """The 64-bit seed range is accepted whole; a top_k beyond the vocabulary keeps every token (as off) instead
    of overflowing the engine's int32 sampling rows, which failed the step for every request batched with it."""
    base = {"prompt": "hi", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True}
    for seed in (-2**63, 2**63 - 1):
        assert srv.post(C, json={**base, "seed": seed}).status_code == 200, seed
    ref = srv.post(C, json={**base, "seed": 5}).json()["choices"][0]["token_ids"]
    for top_k in (512, 2**31, 2**63, 10**30):
        r = srv.post(C, json={**base, "seed": 5, "top_k": top_k})
        assert r.status_code == 200, (top_k, r.text)
        assert r.json()["choices"][0]["token_ids"] == ref, top_k


def test_content_encoding(srv, caplog):
    """gzip / deflate bodies are read; a coding aiohttp would pass through undecoded is a 415; a body that does
    not decode is a 400 (it was a 500 with two tracebacks in the log), and the server keeps serving."""
    import gzip
    import zlib

    body = json.dumps({**P, "max_tokens": 2}).encode()
    for enc, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)), ("identity", body)):
        r = srv.post(C, content=data, headers={"Content-Type": JSON, "Content-Encoding": enc})
        assert r.status_code == 200, (enc, r.text)
    for enc in ("x-gzip", "compress", "gzip, gzip", "foo"):
        err = check_error(srv.post(C, content=body, headers={"Content-Type": JSON, "Content-Encoding": enc}), 415,
                          None)
        assert enc in err["message"]
    with caplog.at_level(logging.INFO):
        for data in (b"not gzip", gzip.compress(body)[:5] + b"\xff" * 20):
            err = check_error(srv.post(C, content=data, headers={"Content-Type": JSON, "Content-Encoding": "gzip"}),
                              400, None)
            assert "content-encoding: gzip" in err["message"]
            assert srv.get("/health").status_code == 200
        time.sleep(0.1)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    ok = srv.post(C, content=body, headers={"Content-Type": "Application/JSON; Charset=\"UTF-8\""})
    assert ok.status_code == 200, ok.text


def test_client_leaving_right_after_done_logs_no_error(srv, caplog, monkeypatch):
    """The client closes as soon as it reads ``[DONE]``: the final write fails with a connection error,
    which must end the request quietly (aiohttp logs an ERROR with a traceback for any exception a
    handler raises). The race is forced by failing write_eof; a real socket loop runs as well."""
    real = web.StreamResponse.write_eof

    async def gone(self, data=b""):
        if self.content_type == "text/event-stream":
            raise ConnectionResetError("Cannot write to closing transport")
        return await real(self, data)

    body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True, "stream": True}
    with caplog.at_level(logging.INFO):
        monkeypatch.setattr(web.StreamResponse, "write_eof", gone)
        with srv.stream("POST", C, json=body) as r:
            lines = []
            for line in r.iter_lines():  # the body never ends cleanly: stop at [DONE], as the client did
                lines.append(line)
                if line == "data: [DONE]":
                    break
            ev = sse_events(lines)
        # the handler calls write_eof after sending [DONE]: keep the failing one in place until it has (undoing
        # it as soon as the client read [DONE] raced with the handler on a loaded machine)
        deadline = time.monotonic() + 10
        while not any("disconnected" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.undo()
        assert ev[-1] == "[DONE]"
        port = srv.inproc.port
        payload = json.dumps(body).encode()
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
                got = b""
                while b"[DONE]" not in got:
                    chunk = c.recv(65536)
                    assert chunk, got
                    got += chunk
        time.sleep(0.2)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert any("disconnected" in r.getMessage() for r in caplog.records)
    assert srv.get("/health").status_code == 200


def test_busy_port_fails_before_building():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "serve.py"), "--runner", "fake",
                            "--port", str(port)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 1
    assert "building" not in r.stdout  # found before the model is built
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0] and "--port" in lines[0]


# --- parsing primitives --------------------------------------------------------------------------------
def _depth(o) -> int:
    if isinstance(o, dict):
        return 1 + max(map(_depth, o.values()), default=0)
    if isinstance(o, list):
        return 1 + max(map(_depth, o), default=0)
    return 0


def test_json_depth_matches_parsed_depth():
    """Against the depth of the parsed object (an independent recursive count), on random documents
    whose strings are full of brackets, quotes and backslashes."""
    rng = random.Random(0)
    atoms = [1, -2.5, None, True, "", "[{", '"]}', "\\", '\\"[', "✓[", "\\u005b"]

    def gen(d):
        r = rng.random()
        if d > 7 or r < 0.3:
            return rng.choice(atoms)
        if r < 0.65:
            return [gen(d + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["k", "[", '}"', "\\"]) + str(i): gen(d + 1) for i in range(rng.randint(0, 3))}

    for i in range(1500):
        o = gen(0)
        text = json.dumps(o, ensure_ascii=bool(i % 2), indent=None if i % 3 else 1).encode()
        assert json_depth(text) == _depth(o), text
        assert parse_json_body(text) == o


def test_json_depth_linear_on_hostile_bodies():
    for body in (b'"' * 4_000_000, b'"' + b'\\"' * 2_000_000, b'"' + b'\\"' * 2_000_000 + b"\\",
                 b"[" * 8_000_000, b'["' * 2_000_000):
        t = time.perf_counter()
        json_depth(body, MAX_JSON_DEPTH)
        assert time.perf_counter() - t < 5


def test_stop_checker_limits_and_window():
    with pytest.raises(ValueError, match="at most 4"):
        StopChecker(["a", "b", "c", "d", "e"])
    with pytest.raises(ValueError, match="characters"):
        StopChecker(["x" * (MAX_STOP_CHARS + 1)])
    sc = StopChecker(["END", "STOP"])
    out = []
    text = "abc" * 10_000 + "xxSTO"
    for ch in text:  # one character per token: the held-back tail never exceeds longest stop - 1
        out.append(sc.feed(ch))
        assert len(sc._pending) <= 3
    out.append(sc.feed("P and more"))
    assert sc.stopped and "".join(out) == "abc" * 10_000 + "xx"
    assert sc.feed("later") == "" and sc.flush() == ""
    sc = StopChecker(["ab", "b"])  # the earliest match wins, whichever string it is
    assert sc.feed("xab") == "x" and sc.stopped
    sc = StopChecker(["zz"])
    assert sc.feed("az") == "a" and sc.feed("b") == "z" and sc.flush() == "b"
