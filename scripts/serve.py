#!/usr/bin/env python
"""Serve a jds model over an OpenAI-compatible HTTP API (the project's main job).

    python scripts/serve.py                      # tiny V3.2, random weights, 127.0.0.1:8000, CPU ok
    python scripts/serve.py --preset v32-bench --mode fused --max-num-seqs 64 --num-blocks 4096

The port opens at once (``/health`` answers 503); the step's shape buckets are compiled with progress
printed, then ``/health`` turns 200 and requests are served.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import time
from typing import NoReturn

from jds.engine.core import Engine
from jds.engine.loop import EngineLoop
from jds.runner import GRAPH_UPDATE_MODES, use_graph_update_mode
from jds.server.app import ServerConfig, build_app, serve
from jds.server.tokenizer import load_tokenizer


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a zero or negative pool/batch/length is refused at start-up)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None,
                   help="v32-tiny (default), v4-tiny, v32-bench, v4-bench; with --checkpoint alone, the "
                        "checkpoint's stored config")
    p.add_argument("--config", default=None, help="HF config.json replacing the preset's attention config")
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (a tokenizer.json there is used)")
    p.add_argument("--mode", choices=("wide", "narrow", "fused"), default="narrow", help="execution boundary")
    p.add_argument("--implementation", choices=("auto", "xla", "pallas"), default="auto",
                   help="attention kernels: auto = Pallas on a GPU, pure JAX elsewhere")
    p.add_argument("--moe", action="store_true", help="DeepSeek-style MoE FFN instead of the dense MLP")
    p.add_argument("--max-num-seqs", type=positive_int, default=16, help="max request rows per step")
    p.add_argument("--num-blocks", type=positive_int, default=256, help="KV pages in the pool")
    p.add_argument("--max-num-tokens", type=positive_int, default=256, help="token budget per step")
    p.add_argument("--max-model-len", type=positive_int, default=1024, help="longest prompt + output")
    p.add_argument("--max-queue-len", type=positive_int, default=256, help="waiting requests beyond the batch (then 429)")
    p.add_argument("--token-buckets", type=positive_int, nargs="+", default=(),
                   help="step sizes (tokens) to compile; --max-num-tokens is always added (default: x4 ladder)")
    p.add_argument("--key-block-buckets", type=positive_int, nargs="+", default=(),
                   help="key-block counts to compile for the eager region; the maximum is always added")
    p.add_argument("--stable-inputs", action="store_true",
                   help="keep step inputs in persistent device buffers (fixed addresses for the CUDA graphs)")
    p.add_argument("--graph-update-mode", default=None, choices=GRAPH_UPDATE_MODES,
                   help="XLA command-buffer update mode (process-wide XLA flag; default: XLA's ALWAYS_UPDATE)")
    p.add_argument("--compile-cache", default=None,
                   help="persistent XLA compilation cache directory (a restart or a second server reuses it)")
    p.add_argument("--tokenizer", default=None,
                   help="directory holding a HF tokenizer.json (default: the checkpoint dir; else byte-level)")
    p.add_argument("--seed", type=int, default=0, help="random-weight seed")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default jds-<preset>)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--runner", choices=("model", "fake"), default="model",
                   help="'fake': deterministic numpy stand-in (front-end testing without JAX)")
    p.add_argument("--fake-step-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not 0 <= a.port <= 65535:
        p.error(f"--port must be in 0..65535, got {a.port}")
    return a


def build_runner(a: argparse.Namespace):
    if a.graph_update_mode:
        use_graph_update_mode(a.graph_update_mode)  # before anything touches a device
    if a.runner == "fake":
        from jds.engine.fake import FakeRunner

        return FakeRunner(block_size=16, num_blocks=a.num_blocks, max_model_len=a.max_model_len,
                          max_num_tokens=a.max_num_tokens, max_num_seqs=a.max_num_seqs,
                          step_delay=a.fake_step_delay)
    from jds.runner import ModelRunner

    return ModelRunner.build(preset=a.preset, config_path=a.config, checkpoint=a.checkpoint, mode=a.mode,
                             implementation=a.implementation, num_blocks=a.num_blocks, max_num_seqs=a.max_num_seqs,
                             max_num_tokens=a.max_num_tokens, max_model_len=a.max_model_len, seed=a.seed,
                             moe=a.moe, token_buckets=tuple(a.token_buckets),
                             key_block_buckets=tuple(a.key_block_buckets), stable_inputs=a.stable_inputs)


def check_port(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (None if it can): bound and released here, before minutes
    of model building, with the same address reuse as the server's own listener."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"cannot resolve host {host!r}: {e.strerror or e}"
    for family, type_, proto, _, addr in infos:
        with socket.socket(family, type_, proto) as s:
            if hasattr(socket, "SO_REUSEADDR") and os.name == "posix":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
                s.listen(1)
            except OSError as e:
                return listen_error(host, port, e)
    return None


def listen_error(host: str, port: int, e: OSError) -> str:
    hint = " (another server is running there? pick another --port)" if e.errno == errno.EADDRINUSE else ""
    return f"cannot listen on {host}:{port}: {e.strerror or e}{hint}"


def fail(msg: str) -> NoReturn:
    """One line on stderr and exit 1: start-up errors are the user's to fix, not a traceback to read."""
    print(f"serve.py: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


async def main(a: argparse.Namespace) -> None:
    say = lambda msg: print(f"[serve] {msg}", flush=True)  # noqa: E731
    why = check_port(a.host, a.port)
    if why:
        fail(why)
    t0 = time.perf_counter()
    label = a.preset or ("checkpoint" if a.checkpoint else "v32-tiny")
    say(f"building {a.runner if a.runner == 'fake' else label} (mode={a.mode}, impl={a.implementation}, "
        f"moe={a.moe}, num_blocks={a.num_blocks}, max_num_seqs={a.max_num_seqs}, "
        f"max_num_tokens={a.max_num_tokens}, max_model_len={a.max_model_len})")
    if a.compile_cache:
        from jds.runner import enable_compile_cache

        enable_compile_cache(a.compile_cache)
    runner = build_runner(a)
    say(f"built in {time.perf_counter() - t0:.1f}s; block_size={runner.block_size}, vocab={runner.vocab_size}")
    engine = Engine(runner)
    loop = EngineLoop(engine)
    tok = load_tokenizer(a.tokenizer or a.checkpoint, bos_token_id=getattr(runner, "bos_token_id", 256),
                         eos_token_id=runner.eos_token_id)
    say(f"tokenizer: {type(tok).__name__}")
    name = a.served_model_name or f"jds-{label}"
    app, _ = build_app(loop, tok, ServerConfig(model_name=name, max_queue_len=a.max_queue_len))
    try:
        site = await serve(app, a.host, a.port)
    except OSError as e:  # taken between the check and now
        fail(listen_error(a.host, a.port, e))
    say(f"listening on http://{a.host}:{a.port} (model id {name!r}); /health is 503 until compiled")

    def warmup() -> None:
        t = time.perf_counter()
        runner.warmup(lambda m: say(f"warmup: {m}"))
        say(f"ready after {time.perf_counter() - t:.1f}s of warmup; /health is 200")

    loop.start(warmup)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    while not stop.is_set():  # a failed warmup ends the process instead of serving 503 forever
        if loop.warmup_error is not None:
            say(f"warmup failed: {loop.warmup_error!r}")
            await site.cleanup()
            raise SystemExit(1)
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    say("shutting down")
    await site.cleanup()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(main(parse_args()))
