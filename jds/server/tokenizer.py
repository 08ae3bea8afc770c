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
    """Plain template: one ``role: content`` line per message (``role (name): content`` when the message
    names its participant), then ``assistant: `` to answer."""
    lines = [f"{m['role']} ({m['name']}): {m['content']}" if m.get("name") else f"{m['role']}: {m['content']}"
             for m in messages]
    return "\n".join(lines) + "\nassistant: "
