"""Paged KV block manager.

Every cache of every layer is addressed through one block table per request (DESIGN.md: "all caches of
a layer share one block table"), so a single pool of page ids covers them all: a request that holds
``n`` tokens owns ``ceil(n / block_size)`` pages, in order.
"""

from __future__ import annotations


class BlockManager:
    """Free list of page ids plus the pages each request owns (host bookkeeping only)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: low page ids are handed out first, which keeps test traces readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owned: dict[str, list[int]] = {}

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of pages in use (vLLM's ``kv_cache_usage_perc`` is this fraction, 0..1)."""
        return self.num_used / self.num_blocks

    def blocks_of(self, req_id: str) -> list[int]:
        return self._owned.get(req_id, [])

    def extra_needed(self, req_id: str, num_tokens: int) -> int:
        """Pages still to allocate so that ``req_id`` can hold ``num_tokens`` tokens."""
        return max(0, self.pages_for(num_tokens) - len(self.blocks_of(req_id)))

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        return self.extra_needed(req_id, num_tokens) <= len(self._free)

    def allocate(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow ``req_id`` to cover ``num_tokens`` tokens; all-or-nothing (raises, changing nothing)."""
        n = self.extra_needed(req_id, num_tokens)
        if n > len(self._free):
            raise MemoryError(f"request {req_id!r} needs {n} more pages, {len(self._free)} free")
        pages = self._owned.setdefault(req_id, [])
        for _ in range(n):
            pages.append(self._free.pop())
        return pages

    def free(self, req_id: str) -> int:
        """Return every page of ``req_id`` to the pool; returns how many (0 when it held none)."""
        pages = self._owned.pop(req_id, [])
        self._free.extend(reversed(pages))
        return len(pages)

    def max_tokens_fit(self, req_id: str) -> int:
        """Most tokens ``req_id`` could hold if it took every free page."""
        return (len(self.blocks_of(req_id)) + len(self._free)) * self.block_size
