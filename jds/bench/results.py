"""Benchmark result files: every benchmark writes its JSON through ``write_json``."""

from __future__ import annotations

import json
import os
from typing import Any


def error_text(e: BaseException, limit: int = 800) -> str:
    """A failed row's ``error`` field: the exception's type and the start of its message."""
    return f"{type(e).__name__}: {str(e)[:limit]}"


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` to ``path`` atomically (temp file + rename), creating the folder.

    Why: the benchmarks save after every row or mode so a run cut short by a device time limit keeps what
    it measured; the rename means a kill mid-write never leaves a truncated file behind.
    """
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)
