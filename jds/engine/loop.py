"""Runs the engine in a background thread and bridges it to asyncio.

The model step blocks for milliseconds to seconds, so it must not run on the event loop. Commands (add,
abort) go to the thread through a ``queue.SimpleQueue``; outputs come back to each request's
``asyncio.Queue`` through ``loop.call_soon_threadsafe``. The thread warms the runner up first and sets
``ready`` when done (``/health`` reads it).

Shutdown is staged so that no response is lost and the interpreter never finalizes while this thread
is inside native code (XLA): ``drain`` refuses new requests and answers those that never reached a
step with a ``SHUTDOWN`` output (the server turns it into a 503); ``fail_all`` ends the rest at the
deadline from the event loop's side, even if the thread is stuck in a long step; ``shutdown`` asks
the thread to stop and reports whether it did, so the caller can ``os._exit`` when it did not. A
warm-up stops between compiles by calling ``checkpoint`` (a compile itself cannot be interrupted).
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
_DRAIN = object()

#: ``RequestOutput.finish_reason`` of a request ended because the server is shutting down; ``error``
#: holds the message. Only this module produces it.
SHUTDOWN = "shutdown"


class WarmupCancelled(Exception):
    """Raised by ``EngineLoop.checkpoint`` inside a warm-up once shutdown was requested."""


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
        self._stop_requested = threading.Event()
        self._draining = False  # set on the caller's side by drain(); read by generate()
        self._engine_draining = False  # the engine thread's copy, set when it handles _DRAIN
        self._drain_message = "the server is shutting down; the request was not started"

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, warmup: Callable[[], None] | None = None) -> None:
        """Start the thread; it runs ``warmup`` (e.g. ``runner.warmup``) before taking requests."""
        self._thread = threading.Thread(target=self._run, args=(warmup,), name="jds-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Ask the thread to stop after its current step (or warm-up unit) and wait up to ``timeout``.

        Returns True when the thread has ended. False means it is still inside a step or a compile:
        the process must then leave with ``os._exit`` rather than let the interpreter finalize under
        it (that crashes in native code)."""
        if not self._stop_requested.is_set():
            self._stop_requested.set()
            self._cmds.put(_STOP)
        if self._thread is None:
            return True
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    def checkpoint(self) -> None:
        """Call between warm-up units (e.g. from the progress callback): raises ``WarmupCancelled``
        once shutdown was requested, so a warm-up ends at the next compile boundary."""
        if self._stop_requested.is_set():
            raise WarmupCancelled("shutdown requested during warm-up")

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self, message: str | None = None) -> None:
        """Stop taking requests: new ones, and queued ones no step has touched yet, finish at once
        with a ``SHUTDOWN`` output carrying ``message``. Running requests go on."""
        if message is not None:
            self._drain_message = message
        self._draining = True
        self._cmds.put(_DRAIN)

    def fail_all(self, message: str = "the server shut down before the request finished") -> int:
        """End every request still waiting for output with a ``SHUTDOWN`` output, delivered straight to
        its queue (it does not wait for the engine thread, which may be inside a long step), and ask
        the engine to abort it. Returns how many were ended."""
        with self._sinks_lock:
            sinks = list(self._sinks.items())
        for rid, (loop, q) in sinks:
            out = RequestOutput(rid, [], finished=True, finish_reason=SHUTDOWN, error=message)
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass
            self._cmds.put(("abort", rid))
        return len(sinks)

    def stats(self) -> EngineStats:
        """Snapshot taken by the engine thread after its last step or command (safe to read anywhere)."""
        return self._stats

    # -- requests -------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until one is finished; leaving early aborts it (frees pages)."""
        if self._draining or self._stop_requested.is_set():
            yield RequestOutput(request_id, [], finished=True, finish_reason=SHUTDOWN, error=self._drain_message)
            return
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
        """Hand outputs to their requests' queues: one thread-safe wake-up per event loop per step.

        The stats snapshot is refreshed first, so a client that got its output never reads stats older
        than that output (e.g. pages still counted as used after its request finished)."""
        self._stats = self.engine.stats()
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

    def _drain_unstarted(self) -> None:
        """Answer every request that no step has scheduled yet (engine thread only)."""
        self._engine_draining = True
        unstarted = [rid for rid, req in self.engine.requests.items() if req.first_scheduled_time is None]
        outs = []
        for rid in unstarted:
            out = self.engine.abort_request(rid)
            if out is not None:
                out.finish_reason, out.error = SHUTDOWN, self._drain_message
                outs.append(out)
        self._deliver(*outs)

    def _handle(self, cmd) -> bool:
        if cmd is _STOP:
            return False
        if cmd is _DRAIN:
            self._drain_unstarted()
            return True
        if cmd[0] == "add":
            _, rid, prompt, params, arrival = cmd
            if self._engine_draining:  # raced with drain(): refuse, as drain would have
                self._deliver(RequestOutput(rid, [], finished=True, finish_reason=SHUTDOWN,
                                            error=self._drain_message))
                return True
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
                self.checkpoint()
                warmup()
            except WarmupCancelled:
                log.info("warm-up cancelled by shutdown")
                return
            except BaseException as e:  # noqa: BLE001 - surfaced through /health and the log
                self.warmup_error = e
                log.exception("warmup failed")
                return
        self.ready.set()
        running = not self._stop_requested.is_set()
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
