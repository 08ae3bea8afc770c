"""Stop strings on streamed text: hold back a possible stop-string prefix until it is decided.

The check runs on the event loop once per token, so its cost must not grow with what a client sends:
the number of strings and their length are capped (OpenAI allows 4), and each ``feed`` searches only
the held-back tail (shorter than the longest stop string) plus the new text, never the whole output.
"""

from __future__ import annotations

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # per string; bounds the held-back window and so each search


class StopChecker:
    def __init__(self, stops: list[str], *, max_strings: int = MAX_STOP_STRINGS,
                 max_chars: int = MAX_STOP_CHARS) -> None:
        stops = list(dict.fromkeys(s for s in stops if s))  # empty strings never match; duplicates cost twice
        if len(stops) > max_strings:
            raise ValueError(f"stop: at most {max_strings} strings, got {len(stops)}")
        if any(len(s) > max_chars for s in stops):
            raise ValueError(f"stop: each string may hold at most {max_chars} characters")
        self.stops = stops
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text now safe to emit; sets ``stopped`` (and drops the rest) when a stop string appears."""
        if not self.stops or self.stopped:
            return "" if self.stopped else text
        buf = self._pending + text  # the pending tail holds < longest-stop characters: a bounded search
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return buf[: min(hits)]
        cut = max(0, len(buf) - self._hold)
        self._pending = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
