"""Tokenizers for the server: byte-level by default, HuggingFace ``tokenizer.json`` when present.

Streaming needs incremental decoding: a UTF-8 character may be split over several byte tokens (and an
HF byte-fallback / BPE token may end mid-character), so text is only emitted once it is complete.

Chat prompts are built the way the model was trained to read them: a model directory's own Jinja
``chat_template`` (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``) is rendered
as HF transformers' ``apply_chat_template`` does (sandboxed Jinja, ``trim_blocks`` / ``lstrip_blocks``,
``loopcontrols``, a ``tojson`` filter, ``raise_exception`` / ``strftime_now``, the ``{% generation %}`` tag;
variables ``messages``, ``add_generation_prompt=True`` and the special-token strings ``bos_token``,
``eos_token``, ...), and the text is then encoded without added special tokens, so the template alone
places BOS (as HF and vLLM do for chat). BOS/EOS ids come from ``tokenizer_config.json``'s special tokens,
looked up in ``tokenizer.json``. The plain ``role: content`` template is the byte tokenizer's; a model
directory without a template falls back to it with a logged warning.
"""

from __future__ import annotations

import codecs
import datetime
import json
import logging
import os
from typing import Any, Protocol

log = logging.getLogger(__name__)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered by the model's template (e.g. its ``raise_exception``)."""


class ChatFormat(Protocol):
    description: str

    def render(self, messages: list[dict]) -> str: ...


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None
    chat_format: ChatFormat

    def encode(self, text: str) -> list[int]: ...
    def decoder(self) -> "IncrementalDecoder": ...


class IncrementalDecoder(Protocol):
    def feed(self, token_ids: list[int]) -> str: ...
    def flush(self) -> str: ...


class ByteTokenizer:
    """ids 0..255 are bytes; ``bos``/``eos`` (and anything else >= 256) decode to nothing."""

    def __init__(self, bos_token_id: int = 256, eos_token_id: int = 257, add_bos: bool = False) -> None:
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_format: ChatFormat = PlainChatFormat()

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decoder(self) -> "_ByteDecoder":
        return _ByteDecoder()


class _ByteDecoder:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: list[int]) -> str:
        return self._dec.decode(bytes(t for t in token_ids if 0 <= t < 256))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class HFTokenizer:
    """Wraps ``tokenizers.Tokenizer`` (optional dependency) loaded from a ``tokenizer.json``."""

    def __init__(self, path: str, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 chat_format: "ChatFormat | None" = None) -> None:
        from tokenizers import Tokenizer as _Tok  # optional: pip install tokenizers

        self._tok = _Tok.from_file(path)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_format: ChatFormat = chat_format or PlainChatFormat()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decoder(self) -> "_HFDecoder":
        return _HFDecoder(self)


class _HFDecoder:
    """Decode a short window of recent tokens and emit what the newest ones added.

    Decoding the whole sequence per token costs the event loop time proportional to the output, so a
    long reply would cost quadratic time overall; a token decoded alone can lose its leading space
    (SentencePiece) or be half a character (byte fallback). So each step decodes from ``_prefix`` (the
    start of the last emitted piece, which keeps the context that spacing needs) to the end, compares
    with the already-emitted part ``_prefix:_read``, and holds back text that ends in U+FFFD, for at
    most ``MAX_HOLD`` tokens (a character spans at most 4 byte tokens; longer runs are real U+FFFDs, and
    holding them would grow the window again).
    """

    MAX_HOLD = 8

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0  # window start: first token of the last emitted piece
        self._read = 0  # tokens up to here have been emitted as text

    def _step(self, final: bool) -> str:
        seen = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        held = len(self._ids) - self._read
        if len(text) <= len(seen):  # nothing new (e.g. special tokens): keep the window short all the same
            if held >= self.MAX_HOLD:
                self._prefix = self._read = len(self._ids)
            return ""
        if text.endswith("\ufffd") and not final and held < self.MAX_HOLD:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen):]

    def feed(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)


def load_tokenizer(model_dir: str | None, *, bos_token_id: int, eos_token_id: int) -> Tokenizer:
    """HF tokenizer when ``model_dir/tokenizer.json`` exists and ``tokenizers`` imports, else bytes.

    For an HF tokenizer, ``tokenizer_config.json`` (when present) gives the special tokens (BOS/EOS ids
    override the given ones) and the chat template; ``bos_token_id`` / ``eos_token_id`` are the model's."""
    if model_dir:
        path = os.path.join(model_dir, "tokenizer.json")
        if os.path.isfile(path):
            try:
                tok = HFTokenizer(path, bos_token_id, eos_token_id)
            except ImportError:
                log.warning("%s exists but the 'tokenizers' package is missing: using the byte tokenizer "
                            "and the plain chat template (pip install tokenizers)", path)
            else:
                _configure_from_dir(tok, model_dir)
                return tok
        elif any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer_config.json", "tokenizer.model")):
            log.warning("%s has a tokenizer but no tokenizer.json (the only format jds reads): using the byte "
                        "tokenizer and the plain chat template", model_dir)
    return ByteTokenizer(bos_token_id, eos_token_id)


def read_tokenizer_config(model_dir: str) -> dict[str, Any]:
    """``tokenizer_config.json`` of ``model_dir`` ({} when absent); malformed JSON is a ValueError naming it."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return d


def special_token_strings(tok_cfg: dict[str, Any], where: str = "tokenizer_config.json") -> dict[str, str]:
    """``bos_token`` etc. as strings (the config holds a string or an AddedToken object with ``content``)."""
    out = {}
    for key in SPECIAL_TOKENS:
        v = tok_cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if v is None:
            continue
        if not isinstance(v, str):
            raise ValueError(f"{where}: field {key!r} must be a string or an object with 'content', got {v!r}")
        out[key] = v
    return out


def template_source(model_dir: str, tok_cfg: dict[str, Any]) -> tuple[str, str] | None:
    """(Jinja source, where it came from) of the model's chat template, or None when it ships none.

    ``chat_template.jinja`` wins over ``tokenizer_config.json`` (newer transformers save it there); a list
    of named templates in the config gives the one named ``default``."""
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read(), jinja_path
    t = tok_cfg.get("chat_template")
    where = os.path.join(model_dir, "tokenizer_config.json")
    if t is None:
        return None
    if isinstance(t, list):
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        if "default" not in named:
            raise ValueError(f"{where}: field 'chat_template' is a list without a template named 'default' "
                             f"(names: {sorted(str(n) for n in named)})")
        t, where = named["default"], where + " (chat_template 'default')"
    if not isinstance(t, str):
        raise ValueError(f"{where}: field 'chat_template' must be a string or a list of named templates")
    return t, where


def _configure_from_dir(tok: "HFTokenizer", model_dir: str) -> None:
    """Special-token ids and the chat format of ``model_dir`` onto ``tok``."""
    tok_cfg = read_tokenizer_config(model_dir)
    specials = special_token_strings(tok_cfg)
    for key in ("bos_token", "eos_token"):
        if key not in specials:
            continue
        tid = tok.token_to_id(specials[key])
        if tid is None:
            raise ValueError(f"{os.path.join(model_dir, 'tokenizer_config.json')}: field {key!r} = "
                             f"{specials[key]!r} is not a token of tokenizer.json")
        setattr(tok, key + "_id", tid)
    src = template_source(model_dir, tok_cfg)
    if src is None:
        log.warning("%s ships no Jinja chat template (no chat_template in tokenizer_config.json, no "
                    "chat_template.jinja): chat requests use the plain 'role: content' template, which the "
                    "model was not trained on", model_dir)
        tok.chat_format = PlainChatFormat(note=f"fallback: {model_dir} has no chat template")
        return
    tok.chat_format = JinjaChatTemplate(src[0], specials, origin=src[1])


class PlainChatFormat:
    """The plain ``role: content`` template (the byte tokenizer's; a fallback elsewhere, see module doc)."""

    def __init__(self, note: str = "") -> None:
        self.description = "plain 'role: content' template" + (f" ({note})" if note else "")

    def render(self, messages: list[dict]) -> str:
        return apply_chat_template(messages)


class JinjaChatTemplate:
    """A model's Jinja chat template rendered as HF transformers' ``apply_chat_template`` renders it."""

    def __init__(self, source: str, special_tokens: dict[str, str], *, origin: str = "chat_template") -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_tag(), "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"{origin}: the chat template does not compile: {e}") from None
        self.special_tokens = dict(special_tokens)
        self.description = f"Jinja chat template from {origin}"

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            # tools / documents are None as HF passes them when a request has none (tools are refused upstream)
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # the template refused this conversation (sandbox, undefined, ...)
            raise ChatTemplateError(f"the model's chat template cannot render these messages: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the model's chat template failed on these messages: "
                                    f"{type(e).__name__}: {e}") from None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """HF's ``tojson`` filter: plain ``json.dumps`` (Jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_tag() -> type:
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (HF marks assistant spans with it): renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return GenerationTag


def render_chat(tokenizer: Any, messages: list[dict]) -> str:
    """The prompt text of ``messages`` in ``tokenizer``'s chat format (plain when it has none)."""
    fmt = getattr(tokenizer, "chat_format", None) or PlainChatFormat()
    return fmt.render(messages)


def apply_chat_template(messages: list[dict]) -> str:
    """Plain template: one ``role: content`` line per message (``role (name): content`` when the message
    names its participant), then ``assistant: `` to answer."""
    lines = [f"{m['role']} ({m['name']}): {m['content']}" if m.get("name") else f"{m['role']}: {m['content']}"
             for m in messages]
    return "\n".join(lines) + "\nassistant: "
