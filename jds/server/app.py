"""The aiohttp application: OpenAI completions/chat routes (JSON and SSE), models, health, metrics.

Requests are validated and tokenized on the event loop, then handed to ``EngineLoop.generate``; each
engine output (one token) becomes one SSE chunk, so TTFT/ITL seen by a client match the engine's.
Leaving the generator for any reason (client gone, stop string, handler cancelled) aborts the request
in the engine, which frees its pages.

Shutdown (``OpenAIServer.drain``): new requests and queued ones that never started get a 503 with an
OpenAI error body; running ones may finish until ``ServerConfig.shutdown_timeout``, after which each
still open stream gets an error event and ``[DONE]`` and each non-stream request a 503, so no client
is left with a bare connection close.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from jds.engine.loop import SHUTDOWN, EngineLoop
from jds.engine.request import RequestOutput
from jds.server.metrics import ServerMetrics
from jds.server.protocol import (ApiError, GenerationRequest, check_content_encoding, check_content_type,
                                 check_length, error_body, parse_json_body, parse_request)
from jds.server.stop import StopChecker
from jds.server.tokenizer import ChatTemplateError, Tokenizer, render_chat

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    model_name: str = "jds-v32-tiny"
    max_queue_len: int = 256  # requests beyond max_num_seqs that may wait; more -> 429
    shutdown_timeout: float = 30.0  # seconds running requests may take to finish once draining starts


class ServerShuttingDown(ApiError):
    """A request refused or ended because the server is draining (always a 503)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, type_="service_unavailable", code="server_shutting_down")


class _ClientGone(Exception):
    pass


class OpenAIServer:
    def __init__(self, loop: EngineLoop, tokenizer: Tokenizer, cfg: ServerConfig,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine_loop = loop
        self.engine = loop.engine
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.metrics = metrics or ServerMetrics(cfg.model_name, loop.stats,
                                                speculative=bool(getattr(self.engine, "speculative", None)))
        if self.engine.metrics is None:
            self.engine.metrics = self.metrics
        self.in_flight = 0
        self.max_in_flight = self.engine.runner.max_num_seqs + cfg.max_queue_len
        self._ids = itertools.count()
        self.created = int(time.time())
        self.draining = False

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model_info)  # served names may hold a '/'
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_route)
        app.router.add_get("/engine/stats", self.engine_stats)
        return app

    # -- plumbing -------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            resp = web.json_response(e.body(), status=e.status, headers=e.headers)
            if e.headers and e.headers.get("Connection") == "close":
                resp.force_close()
            return resp
        except web.HTTPException as e:  # 404/405 from routing, 413 from the body limit
            if e.status < 400:
                raise
            if e.status == 404:
                msg = f"Invalid URL ({request.method} {request.path[:200]})"
            elif e.status == 405:
                msg = f"Method {request.method} is not allowed for {request.path[:200]}"
            else:
                msg = e.text if e.status == 413 and e.text else e.reason
            keep = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
            return web.json_response(error_body(msg, "invalid_request_error"), status=e.status, headers=keep)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as e:  # noqa: BLE001 - a bug in one request must not look like a dead server
            log.exception("unhandled error in %s", request.path)
            return web.json_response(error_body(f"internal error: {type(e).__name__}: {e}", "internal_server_error"),
                                     status=500)

    def _check_ready(self) -> None:
        if self.engine_loop.warmup_error is not None:
            raise ApiError(503, f"model failed to start: {self.engine_loop.warmup_error}",
                           type_="service_unavailable")
        if not self.engine_loop.ready.is_set():
            raise ApiError(503, "model is still loading / compiling", type_="service_unavailable")

    # -- simple routes ----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        ok = self.engine_loop.ready.is_set() and self.engine_loop.warmup_error is None
        return web.json_response({"status": "ok" if ok else "loading"}, status=200 if ok else 503)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "jds",
                "root": self.cfg.model_name, "max_model_len": self.engine.max_seq_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}`` (the client's ``models.retrieve``)."""
        model_id = request.match_info["model_id"]
        if model_id != self.cfg.model_name:
            raise ApiError(404, f"The model '{model_id[:200]}' does not exist", param="model",
                           code="model_not_found")
        return web.json_response(self._model_card())

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def engine_stats(self, request: web.Request) -> web.Response:
        return web.json_response({**asdict(self.engine_loop.stats()), "in_flight": self.in_flight})

    # -- generation -----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _parse(self, request: web.Request, chat: bool) -> tuple[GenerationRequest, list[int], Any]:
        check_content_type(request.headers.get("Content-Type"))
        check_content_encoding(request.headers.get("Content-Encoding"))
        try:
            raw = await request.read()
        except web.RequestPayloadError as e:  # e.g. a Content-Encoding: gzip body that is not gzip
            # The connection's parser is broken from here: answer, then close. Marking the payload read stops
            # aiohttp from draining it after the answer (which re-raises this error and logs a traceback).
            request.content.feed_eof()
            cause = getattr(e.__cause__, "message", None) or str(e)
            raise ApiError(400, f"invalid request body: {' '.join(str(cause).split())[:200]}",
                           headers={"Connection": "close"}) from None
        body = parse_json_body(raw)
        gen, messages = parse_request(body, chat=chat)
        if gen.model is not None and gen.model != self.cfg.model_name:
            raise ApiError(404, f"The model `{gen.model[:200]}` does not exist.", param="model",
                           code="model_not_found")
        if chat:
            try:
                prompt = render_chat(self.tokenizer, messages)  # the model's own chat template
            except ChatTemplateError as e:
                raise ApiError(400, str(e), param="messages") from None
            ids = self.tokenizer.encode(prompt)
        elif gen.prompt_ids is not None:
            ids = gen.prompt_ids
        else:
            ids = self.tokenizer.encode(gen.prompt_text)
        params = check_length(gen, len(ids), max_seq_len=self.engine.max_seq_len,
                              vocab_size=self.engine.runner.vocab_size)
        spec = getattr(self.engine, "speculative", None)
        if spec and not params.greedy:  # the engine would refuse it too; a 400 names the field
            raise ApiError(400, f"temperature: this server runs speculative decoding ({spec}), which supports greedy "
                                f"sampling only (temperature 0 or top_k 1)", param="temperature")
        gen.params = params
        return gen, ids, body

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival = time.monotonic()
        self._check_accepting()
        self._check_ready()
        gen, ids, body = await self._parse(request, chat)
        if self.in_flight >= self.max_in_flight:
            raise ApiError(429, f"server is at capacity ({self.max_in_flight} requests in flight); retry later",
                           type_="rate_limit_error", code="too_many_requests", headers={"Retry-After": "1"})
        want_ids = gen.return_token_ids
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.in_flight += 1
        stream = self._run(rid, gen, ids, arrival)
        try:
            if gen.stream:
                return await self._stream(request, rid, gen, ids, stream, want_ids)
            return await self._collect(rid, gen, ids, stream, want_ids)
        finally:
            self.in_flight -= 1
            await stream.aclose()

    async def _run(self, rid: str, gen: GenerationRequest, ids: list[int], arrival: float):
        """Engine outputs as (text delta, new token ids, finish_reason, error) with stop strings applied."""
        decoder = self.tokenizer.decoder()
        stops = StopChecker(gen.stop)
        agen = self.engine_loop.generate(rid, ids, gen.params, arrival)
        try:
            async for out in agen:
                if out.finish_reason == SHUTDOWN:
                    raise ServerShuttingDown(out.error or "the server is shutting down")
                toks = out.new_token_ids
                text_ids = toks[:-1] if out.stopped_on_token else toks
                text = stops.feed(decoder.feed(text_ids))
                if stops.stopped:
                    yield text, toks, "stop", None, out
                    return
                if out.finished:
                    text += stops.feed(decoder.flush())
                    if stops.stopped:
                        yield text, toks, "stop", None, out
                        return
                    text += stops.flush()
                yield text, toks, out.finish_reason if out.finished else None, out.error, out
        finally:
            await agen.aclose()  # aborts the request in the engine unless it finished

    def _usage(self, prompt_len: int, out: RequestOutput | None) -> dict[str, int]:
        n = out.num_output_tokens if out else 0
        return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}

    async def _collect(self, rid: str, gen: GenerationRequest, ids: list[int], stream, want_ids: bool
                       ) -> web.Response:
        texts, toks, reason, last = [], [], None, None
        async for text, new, fin, err, out in stream:
            last = out
            if err is not None:
                raise ApiError(500, err, type_="internal_server_error")
            texts.append(text)
            toks.extend(new)
            reason = fin
        text = "".join(texts)
        if gen.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
        if want_ids:
            choice["token_ids"] = toks
        body = {"id": rid, "object": "chat.completion" if gen.chat else "text_completion",
                "created": int(time.time()), "model": self.cfg.model_name, "choices": [choice],
                "usage": self._usage(len(ids), last)}
        return web.json_response(body)

    async def _stream(self, request: web.Request, rid: str, gen: GenerationRequest, ids: list[int], stream,
                      want_ids: bool) -> web.StreamResponse:
        created = int(time.time())
        obj = "chat.completion.chunk" if gen.chat else "text_completion"
        resp: web.StreamResponse | None = None
        last = None

        def chunk(text: str | None, new: list[int], reason: str | None, first: bool) -> dict:
            if gen.chat:
                delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
                if reason is not None and not text and not first:
                    delta = {}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            if want_ids:
                choice["token_ids"] = new
            c = {"id": rid, "object": obj, "created": created, "model": self.cfg.model_name, "choices": [choice]}
            if gen.include_usage:
                c["usage"] = None
            return c

        async def send(obj_: Any) -> None:
            data = obj_ if isinstance(obj_, str) else json.dumps(obj_, separators=(",", ":"))
            try:
                await resp.write(f"data: {data}\n\n".encode())
            except (ConnectionResetError, ConnectionError, RuntimeError) as e:
                raise _ClientGone() from e

        first = True
        try:
            async for text, new, fin, err, out in stream:
                last = out
                if resp is None:
                    if err is not None:  # failed before anything was sent: a plain 500
                        raise ApiError(500, err, type_="internal_server_error")
                    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
                    await resp.prepare(request)
                if err is not None:
                    await send(error_body(err, "internal_server_error"))
                    break
                await send(chunk(text, new, fin, first))
                first = False
            if resp is None:
                raise ApiError(500, "the engine finished the request without output", type_="internal_server_error")
            if gen.include_usage and (last is None or last.error is None):
                await send({"id": rid, "object": obj, "created": created, "model": self.cfg.model_name,
                            "choices": [], "usage": self._usage(len(ids), last)})
            await send("[DONE]")
            await resp.write_eof()
        except (_ClientGone, ConnectionError):  # prepare / write_eof too: a client may leave right after [DONE]
            log.info("client of %s disconnected; aborted", rid)
        except ServerShuttingDown as e:
            if resp is None:  # nothing sent yet: a plain 503
                raise
            await self._end_stream(resp, e)
        return resp

    # -- shutdown -------------------------------------------------------------------------------
    def _check_accepting(self) -> None:
        if self.draining:
            raise ServerShuttingDown("the server is shutting down and accepts no new requests")

    @staticmethod
    async def _end_stream(resp: web.StreamResponse, e: ApiError) -> None:
        """End a stream that already sent its 200: an error event, then ``[DONE]``."""
        body = json.dumps(e.body(), separators=(",", ":"))
        try:
            await resp.write(f"data: {body}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client left meanwhile

    async def drain(self, timeout: float | None = None) -> int:
        """Shut the request side down within ``timeout`` (default ``cfg.shutdown_timeout``) seconds.

        Refuses new and never-started requests at once, waits for running ones, and ends the rest
        (an error event + ``[DONE]`` for a stream, a 503 otherwise) ``shutdown_reserve(timeout)`` before
        the deadline; half of that reserve lets their handlers run, the other half is for the
        listener's close (``serve``'s ``shutdown_timeout``). Returns how many requests were ended."""
        timeout = self.cfg.shutdown_timeout if timeout is None else max(0.0, timeout)
        t0 = time.monotonic()
        reserve = shutdown_reserve(timeout)
        self.draining = True
        self.engine_loop.drain()
        deadline = t0 + timeout - reserve
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        ended = 0
        if self.in_flight:
            ended = self.engine_loop.fail_all()
            log.warning("shutdown timeout: ended %d unfinished request(s)", ended)
            while self.in_flight and time.monotonic() < t0 + timeout - reserve / 2:
                await asyncio.sleep(0.01)
        return ended


def shutdown_reserve(timeout: float) -> float:
    """Seconds at the end of a ``timeout``-second shutdown kept for ending unfinished requests and
    closing connections (running requests get the rest)."""
    return min(2.0, 0.25 * timeout)


def build_app(loop: EngineLoop, tokenizer: Tokenizer, cfg: ServerConfig) -> tuple[web.Application, OpenAIServer]:
    srv = OpenAIServer(loop, tokenizer, cfg)
    app = srv.app()

    async def _cleanup(_: web.Application) -> None:
        if not loop.stop_requested:  # serve.py stops the engine itself, with its own deadline
            await asyncio.get_running_loop().run_in_executor(None, loop.shutdown)

    app.on_cleanup.append(_cleanup)
    return app, srv


async def serve(app: web.Application, host: str, port: int, *, shutdown_timeout: float = 60.0) -> web.AppRunner:
    """Start listening (handler cancellation on, so a vanished client cancels its handler).

    ``shutdown_timeout``: how long ``cleanup()`` lets handlers still running finish before it cancels
    them (after ``OpenAIServer.drain`` only the last writes are left)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
