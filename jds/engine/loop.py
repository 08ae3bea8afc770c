"""Runs the engine in a background thread and bridges it to asyncio.

The model step blocks for milliseconds to seconds, so it must not run on the event loop. Commands (add,
abort) go to the thread through a ``queue.SimpleQueue``; outputs come back to each request's
``asyncio.Queue`` through ``loop.call_soon_threadsafe``. The thread warms the runner up first and sets
``ready`` when done (``/health`` reads it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from jds.engine.core import Engine, EngineStats
from jds.engine.request import RequestOutput
from jds.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

_STOP = object()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ready = threading.Event()
        self.warmup_error: BaseException | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._sinks_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, warmup: Callable[[], None] | None = None) -> None:
        """Start the thread; it runs ``warmup`` (e.g. ``runner.warmup``) before taking requests."""
        self._thread = threading.Thread(target=self._run, args=(warmup,), name="jds-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._cmds.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> EngineStats:
        """Snapshot taken by the engine thread after its last step or command (safe to read anywhere)."""
        return self._stats

    # -- requests -------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until one is finished; leaving early aborts it (frees pages)."""
        q: asyncio.Queue = asyncio.Queue()
        with self._sinks_lock:
            if request_id in self._sinks:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._sinks[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            self._cmds.put(("add", request_id, prompt_ids, params,
                            time.monotonic() if arrival_time is None else arrival_time))
            while True:
                out: RequestOutput = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            with self._sinks_lock:
                self._sinks.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    # -- the thread -----------------------------------------------------------------------------
    def _deliver(self, *outs: RequestOutput) -> None:
        """Hand outputs to their requests' queues: one thread-safe wake-up per event loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._sinks_lock:
            for out in outs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    by_loop.setdefault(sink[0], []).append((sink[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed (server shutting down)
                pass

    def _handle(self, cmd) -> bool:
        if cmd is _STOP:
            return False
        if cmd[0] == "add":
            _, rid, prompt, params, arrival = cmd
            try:
                self.engine.add_request(rid, prompt, params, arrival)
            except Exception as e:  # noqa: BLE001 - report to the caller, keep serving
                self._deliver(RequestOutput(rid, [], finished=True, finish_reason="error", error=str(e)))
        elif cmd[0] == "abort":
            out = self.engine.abort_request(cmd[1])
            if out is not None:
                self._deliver(out)
        return True

    def _run(self, warmup: Callable[[], None] | None) -> None:
        if warmup is not None:
            try:
                warmup()
            except BaseException as e:  # noqa: BLE001 - surfaced through /health and the log
                self.warmup_error = e
                log.exception("warmup failed")
                return
        self.ready.set()
        running = True
        while running:
            # Idle: block for the next command. Busy: drain whatever arrived, then step.
            if not self.engine.has_work():
                running = self._handle(self._cmds.get())
            while running:
                try:
                    running = self._handle(self._cmds.get_nowait())
                except queue.Empty:
                    break
            if running and self.engine.has_work():
                try:
                    outs = self.engine.step()
                except Exception:  # noqa: BLE001 - scheduler bug: log, do not spin or die
                    log.exception("engine step raised outside the runner")
                    outs = []
                    time.sleep(0.01)
                self._deliver(*outs)
            self._stats = self.engine.stats()
