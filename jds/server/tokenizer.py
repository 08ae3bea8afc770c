"""Tokenizers for the server: byte-level by default, HuggingFace ``tokenizer.json`` when present.

Streaming needs incremental decoding: a UTF-8 character may be split over several byte tokens (and an
HF byte-fallback / BPE token may end mid-character), so text is only emitted once it is complete.
"""

from __future__ import annotations

import codecs
import os
from typing import Protocol


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None

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

    def __init__(self, path: str, bos_token_id: int | None = None, eos_token_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _Tok  # optional: pip install tokenizers

        self._tok = _Tok.from_file(path)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decoder(self) -> "_HFDecoder":
        return _HFDecoder(self)


class _HFDecoder:
    """Decode the whole sequence and emit the new suffix, holding it back while it ends in U+FFFD."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._emitted = 0

    def feed(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new, self._emitted = text[self._emitted:], len(text)
        return new

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        new, self._emitted = text[self._emitted:], len(text)
        return new


def load_tokenizer(model_dir: str | None, *, bos_token_id: int, eos_token_id: int) -> Tokenizer:
    """HF tokenizer when ``model_dir/tokenizer.json`` exists and ``tokenizers`` imports, else bytes."""
    if model_dir:
        path = os.path.join(model_dir, "tokenizer.json")
        if os.path.isfile(path):
            try:
                return HFTokenizer(path, bos_token_id, eos_token_id)
            except ImportError:
                pass
    return ByteTokenizer(bos_token_id, eos_token_id)


def apply_chat_template(messages: list[dict]) -> str:
    """Plain template: one ``role: content`` line per message, then ``assistant: `` to answer."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant: "
