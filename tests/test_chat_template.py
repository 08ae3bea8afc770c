"""Chat prompts in the model's own format: a synthetic tokenizer directory (byte-level ``tokenizer.json``
whose ids are the UTF-8 bytes, plus DeepSeek-style added special tokens, and a ``tokenizer_config.json`` with a
Jinja ``chat_template``) gives hand-derived token ids, directly and through ``/v1/chat/completions``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import numpy as np
import pytest

from jds.engine.fake import FakeRunner
from jds.server.tokenizer import (ByteTokenizer, ChatTemplateError, HFTokenizer, JinjaChatTemplate,
                                  load_tokenizer, render_chat)
from tests.test_server import MODEL, InProcess

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
SPECIAL_IDS = {BOS: 256, EOS: 257, USER: 258, ASSISTANT: 259}
# Block tags on their own, indented lines: compiled with trim_blocks + lstrip_blocks (as HF transformers does)
# they leave no spaces or newlines behind, while the newline after a ``{{ ... }}`` line stays.
TEMPLATE = """{% if tools is not none %}{{ raise_exception('no tools here') }}{% endif %}
{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'system' %}
        {% if not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}
{{ m['content'] }}
    {% elif m['role'] == 'user' %}
{{ '<｜User｜>' + m['content'] }}
    {% elif m['role'] == 'assistant' %}
{{ '<｜Assistant｜>' }}{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
{{ '<｜Assistant｜>' }}
{% endif %}"""


def write_tokenizer_dir(root: Path, template: str | None = TEMPLATE, **config) -> Path:
    """tokenizer.json: byte-level BPE with no merges whose ids are the bytes themselves, special tokens 256+."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_char = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    assert set(byte_char.values()) == set(alphabet)
    tok = tokenizers.Tokenizer(models.BPE(vocab={c: b for b, c in byte_char.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_IDS])
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    cfg = {"bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False, "rstrip": False},
           "eos_token": EOS, "add_bos_token": True, **({"chat_template": template} if template else {}), **config}
    (root / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return root


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (printable Latin-1 bytes map to themselves, the rest to
    U+0100 onwards in byte order): the alphabet byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello ✓"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]


def expected_ids(messages: list[dict]) -> list[int]:
    """The template's output derived by hand: BOS, system text, <User>text, <Assistant>text<EOS>, ...,
    <Assistant>, a newline after each line ending in an expression; text as its UTF-8 bytes."""
    nl = list(b"\n")
    ids = [SPECIAL_IDS[BOS]] + nl
    for m in messages:
        if m["role"] == "system":
            ids += list(m["content"].encode()) + nl
        elif m["role"] == "user":
            ids += [SPECIAL_IDS[USER]] + list(m["content"].encode()) + nl
        else:  # the line ends in {% endgeneration %}: no newline
            ids += [SPECIAL_IDS[ASSISTANT]] + list(m["content"].encode()) + [SPECIAL_IDS[EOS]]
    return ids + [SPECIAL_IDS[ASSISTANT]] + nl


def test_template_gives_the_expected_token_ids(tmp_path) -> None:
    tok = load_tokenizer(str(write_tokenizer_dir(tmp_path)), bos_token_id=0, eos_token_id=1)
    assert isinstance(tok, HFTokenizer) and isinstance(tok.chat_format, JinjaChatTemplate)
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)  # from tokenizer_config.json, not the defaults
    text = render_chat(tok, MESSAGES)
    assert text == f"{BOS}\nbe brief\n{USER}hello ✓\n{ASSISTANT}hi{EOS}{USER}again\n{ASSISTANT}\n"
    assert tok.encode(text) == expected_ids(MESSAGES)
    assert "tokenizer_config.json" in tok.chat_format.description
    with pytest.raises(ChatTemplateError, match="system message must come first"):
        render_chat(tok, MESSAGES[1:] + MESSAGES[:1])


def test_template_sources_and_helpers(tmp_path, caplog) -> None:
    # chat_template.jinja beside the config wins (newer transformers save the template there)
    d = write_tokenizer_dir(tmp_path / "a")
    (d / "chat_template.jinja").write_text("{{ bos_token }}{{ messages | tojson }}{{ strftime_now('%Y') | length }}")
    tok = load_tokenizer(str(d), bos_token_id=0, eos_token_id=1)
    msgs = [{"role": "user", "content": "ü"}]
    assert render_chat(tok, msgs) == BOS + '[{"role": "user", "content": "ü"}]4'  # tojson keeps non-ASCII
    assert "chat_template.jinja" in tok.chat_format.description
    # a list of named templates: the one named 'default'
    d = write_tokenizer_dir(tmp_path / "b", template=None,
                            chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert render_chat(load_tokenizer(str(d), bos_token_id=0, eos_token_id=1), msgs) == "D"
    # no template: the plain one, with a warning
    d = write_tokenizer_dir(tmp_path / "c", template=None)
    with caplog.at_level(logging.WARNING, logger="jds.server.tokenizer"):
        tok = load_tokenizer(str(d), bos_token_id=0, eos_token_id=1)
    assert "ships no Jinja chat template" in caplog.text and "fallback" in tok.chat_format.description
    assert render_chat(tok, msgs) == "user: ü\nassistant: "
    # the byte tokenizer keeps the plain template; a tokenizer jds cannot read is said so
    assert render_chat(ByteTokenizer(), msgs) == "user: ü\nassistant: "
    (d / "tokenizer.json").unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jds.server.tokenizer"):
        assert isinstance(load_tokenizer(str(d), bos_token_id=0, eos_token_id=1), ByteTokenizer)
    assert "no tokenizer.json" in caplog.text


@pytest.mark.parametrize("config,pattern", [
    ({"bos_token": "<nope>"}, r"field 'bos_token' = '<nope>' is not a token of tokenizer.json"),
    ({"chat_template": "{% for %}"}, "does not compile"),
    ({"chat_template": [{"name": "x", "template": "T"}]}, "without a template named 'default'"),
    ({"chat_template": 3}, "field 'chat_template' must be"),
    ({"eos_token": 5}, "field 'eos_token' must be a string"),
])
def test_bad_tokenizer_config_names_the_field(tmp_path, config, pattern) -> None:
    d = write_tokenizer_dir(tmp_path, **config)
    with pytest.raises(ValueError, match=pattern):
        load_tokenizer(str(d), bos_token_id=0, eos_token_id=1)


class RecordingRunner(FakeRunner):
    """Records every token id the engine feeds to the model."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.fed: list[np.ndarray] = []

    def execute(self, token_ids, chunks, block_tables):
        self.fed.append(np.asarray(token_ids).copy())
        return super().execute(token_ids, chunks, block_tables)


def test_chat_completions_apply_the_template_token_for_token(tmp_path) -> None:
    tok = load_tokenizer(str(write_tokenizer_dir(tmp_path)), bos_token_id=0, eos_token_id=1)
    runner = RecordingRunner(block_size=16)
    s = InProcess(runner, tokenizer=tok)
    s.loop.ready.wait(10)
    try:
        want = expected_ids(MESSAGES)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        r = httpx.post(s.base + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        assert np.concatenate(runner.fed)[: len(want)].tolist() == want  # what the model was fed
        # the template's raise_exception is the client's error: a 400 naming 'messages'
        r = httpx.post(s.base + "/v1/chat/completions", json={**body, "messages": MESSAGES[1:] + MESSAGES[:1]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "system message must come first" in err["message"]
    finally:
        s.close()
