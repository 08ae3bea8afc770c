"""Ports for the tests' server processes.

``bind(("127.0.0.1", 0))`` and release hands out a port from the kernel's ephemeral range, where another
pytest-xdist worker's port-0 bind or any outgoing connection (the tests' HTTP clients) can take it before the
server binds it: a server then failed with "Address already in use" (2026-12-01). These ports come from below
that range, a disjoint block per xdist worker, each checked free by a bind.
"""

from __future__ import annotations

import itertools
import os
import socket

_SPAN = 1000  # ports per worker
_WORKERS = 8  # worker blocks (more workers share blocks, still checked by bind)
_next = itertools.count()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port no socket holds now, from this worker's block below the ephemeral range."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    w = int(worker[2:]) % _WORKERS if worker[2:].isdigit() else 0
    base = max(1024, _ephemeral_low() - _WORKERS * _SPAN) + w * _SPAN
    for _ in range(_SPAN):
        port = base + next(_next) % _SPAN
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in [{base}, {base + _SPAN})")
