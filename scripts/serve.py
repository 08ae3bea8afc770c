#!/usr/bin/env python
"""Serve a jds model over an OpenAI-compatible HTTP API (the project's main job).

    python scripts/serve.py                      # tiny V3.2, random weights, 127.0.0.1:8000, CPU ok
    python scripts/serve.py --preset v32-bench --mode fused --max-num-seqs 64 --num-blocks 4096
    python scripts/serve.py --model /models/DeepSeek-V3.2 --num-layers 3   # a HF checkpoint directory

``--model HF_DIR`` converts the HF checkpoint to a jds checkpoint on first use (a progress bar on stderr),
caches it beside the directory (``HF_DIR.jds/``) or under ``--cache-dir``, and reuses it on later starts; the
directory's tokenizer.json, tokenizer_config.json and chat template serve the requests.

The port opens at once (``/health`` answers 503); the step's shape buckets are compiled with progress
printed, then ``/health`` turns 200 and requests are served.

SIGINT (Ctrl-C) or SIGTERM drains: new and still-queued requests get 503, running ones may finish for
``--shutdown-timeout`` seconds, then the rest are ended (an error event and ``[DONE]`` for a stream).
A warm-up stops at its next compile boundary. The exit code is 130 after SIGINT and 0 after SIGTERM;
a second signal exits at once.

Every exit goes through ``os._exit`` after flushing (and, when the engine thread has ended, after the
``atexit`` callbacks): letting the interpreter finalize while a thread is inside XLA is what crashed
(SIGSEGV / SIGABRT), a compile cannot be interrupted, and even after a clean stop the native teardown
of JAX only costs seconds on a loaded machine. Nothing is left to clean up by then: requests are
answered, sockets closed, output flushed.
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

def _exit_code(signum: int) -> int:
    """SIGINT -> 130 (the shell's Ctrl-C convention); SIGTERM -> 0 (a requested, orderly stop)."""
    return 130 if signum == signal.SIGINT else 0


def _leave(code: int, message: str | None = None) -> None:
    """Print, flush and exit without finalizing the interpreter (no native teardown under a live thread)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, RuntimeError, ValueError):  # a reentrant flush from a signal handler, a closed pipe
        pass
    if message:
        try:
            os.write(1, f"[serve] {message}\n".encode())
        except OSError:
            pass
    os._exit(code)


def _exit_during_startup(signum: int, frame: object = None) -> None:
    """Until the server drains properly (nothing is served yet), a signal just ends the process."""
    _leave(_exit_code(signum), f"{signal.Signals(signum).name} during start-up: exiting")


if __name__ == "__main__":  # before the heavy imports, so a signal during them also exits cleanly
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _exit_during_startup)

from jds.engine.core import Engine  # noqa: E402
from jds.engine.loop import EngineLoop  # noqa: E402
from jds.bench.cli import (GRAPH_UPDATE_MODES, add_moe_flags, moe_overrides, numerics_fields,  # noqa: E402
                           positive_int, use_graph_update_mode)
from jds.config import PRESETS, RunnerConfig, load_model_config  # noqa: E402
from jds.server.app import ServerConfig, build_app, serve, shutdown_reserve  # noqa: E402
from jds.server.tokenizer import load_tokenizer  # noqa: E402


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
    p.add_argument("--batch-invariant", action="store_true",
                   help="one token bucket and one key-block bucket, so a request's tokens do not depend on "
                        "its batch, chunking or preemption (costs throughput; see jds.runner.invariant_buckets)")
    p.add_argument("--excess-precision", action="store_true",
                   help="let XLA keep bf16 intermediates in float32 inside fusions (its own default); without it "
                        "the step rounds to bf16 where the model casts, as the eager forward and DeepSeek's "
                        "reference do")
    p.add_argument("--input-prep", choices=("auto", "device", "host"), default="auto",
                   help="step inputs: one packed buffer with the batch built on the device, or make_batch on the "
                        "host (auto: device for fused, host for wide / narrow)")
    p.add_argument("--segments", type=positive_int, default=1,
                   help="fused + device prep: launch each step as this many captured executables")
    p.add_argument("--first-segment-layers", type=int, default=0,
                   help="with --segments: layers in the first segment (0: an even split); the rest split evenly")
    p.add_argument("--compile-workers", type=positive_int, default=RunnerConfig.compile_workers,
                   help="fused + device prep: threads compiling the step's executables at start-up")
    p.add_argument("--tensor-parallel-size", "--tensor-parallel", "-tp", dest="tensor_parallel",
                   type=positive_int, default=1,
                   help="devices the attention heads, MLP and vocabulary are split over (jds.sharding)")
    p.add_argument("--data-parallel-size", "--data-parallel", "-dp", dest="data_parallel", type=positive_int,
                   default=1, help="devices the token rows and the KV page pool are split over")
    p.add_argument("--expert-parallel-size", "--expert-parallel", dest="expert_parallel", type=positive_int,
                   default=1, help="devices the MoE routed experts are split over")
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
    p.add_argument("--no-async", dest="async_steps", action="store_false",
                   help="synchronous stepping (host sampling, no overlap of host and device work) for comparison")
    p.add_argument("--speculative", choices=("mtp",), default=None,
                   help="speculative decoding with the model's MTP module (one draft token per step). First version, "
                        "exact but restricted: greedy requests only (others get a 400), --no-async, --mode fused "
                        "with --segments 1, one device, a block-v4 model with MTP layers (a checkpoint's, or "
                        "--mtp-layers on a v4 preset); anything else is refused at startup")
    p.add_argument("--mtp-layers", type=positive_int, default=None,
                   help="give a random-weight v4 preset this many MTP modules (ModelConfig.mtp_layers)")
    p.add_argument("--runner", choices=("model", "fake"), default="model",
                   help="'fake': deterministic numpy stand-in (front-end testing without JAX)")
    p.add_argument("--fake-step-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--fake-warmup-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests may take to finish after SIGINT/SIGTERM (then they are "
                        "ended with an error) and the bound on the whole exit")
    add_model_dir_args(p)
    add_moe_flags(p)
    a = p.parse_args(argv)
    check_model_dir_args(p, a)
    if a.preset is not None and a.preset not in PRESETS:
        p.error(f"--preset {a.preset!r}: choose one of {', '.join(PRESETS)}")
    if a.served_model_name is not None and not a.served_model_name.strip():
        p.error("--served-model-name must not be empty")
    if a.tokenizer is not None and not os.path.isfile(os.path.join(a.tokenizer, "tokenizer.json")):
        p.error(f"--tokenizer {a.tokenizer!r}: no tokenizer.json there (a directory holding a HF tokenizer.json)")
    try:  # the model and runner settings are checked here, before minutes of model building
        a.model_overrides = moe_overrides(a)
        if a.mtp_layers is not None:
            a.model_overrides = {**a.model_overrides, "mtp_layers": a.mtp_layers}
        if a.speculative and a.async_steps:
            raise ValueError("--speculative mtp runs only in the synchronous loop: add --no-async")
        a.runner_config = runner_config(a)
        if a.runner == "model" and a.model is None and not checkpoint_alone(a):  # the config ModelRunner.build makes
            load_model_config(a.preset or "v32-tiny", a.config, **a.model_overrides)
    except ValueError as e:
        p.error(str(e))
    if not 0 <= a.port <= 65535:
        p.error(f"--port must be in 0..65535, got {a.port}")
    if not 0 <= a.shutdown_timeout < float("inf"):
        p.error(f"--shutdown-timeout must be a finite number >= 0, got {a.shutdown_timeout}")
    return a


def add_model_dir_args(p: argparse.ArgumentParser) -> None:
    """``--model`` / ``--cache-dir`` / ``--num-layers``: serve a HF checkpoint directory as it is stored."""
    g = p.add_argument_group("HF checkpoint directory")
    g.add_argument("--model", default=None, metavar="HF_DIR",
                   help="HF DeepSeek-V3.2 / V4 checkpoint directory (config.json + *.safetensors, its tokenizer "
                        "and chat template); converted to a jds checkpoint on first use and cached")
    g.add_argument("--cache-dir", default=None,
                   help="where converted checkpoints are cached (default: beside the model, HF_DIR.jds/)")
    g.add_argument("--num-layers", type=positive_int, default=None,
                   help="load only the first N layers of --model (converted and cached per N)")
    g.add_argument("--numerics", choices=("reference", "serving", "bf16", "exact"), default=None,
                   help="numerics preset for --model (default reference: the checkpoint's own quantisation, "
                        "FP8 weights as stored, the indexer's Hadamard rotation, its activation scale format)")
    g.add_argument("--dequantize", action="store_true",
                   help="departure: dequantise the stored FP8 weights to bf16 (bf16 GEMMs)")
    g.add_argument("--no-indexer-hadamard", action="store_true",
                   help="departure: skip the indexer's Hadamard rotation of q / k (what vLLM does)")
    g.add_argument("--numerics-field", action="append", default=[], metavar="FIELD=VALUE",
                   help="set one Numerics field (e.g. kv_cache_dtype=bfloat16, indexer_fp8=false); repeatable")


def check_model_dir_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.model is None:
        for flag, v in (("--cache-dir", a.cache_dir), ("--num-layers", a.num_layers), ("--numerics", a.numerics),
                        ("--dequantize", a.dequantize or None), ("--no-indexer-hadamard", a.no_indexer_hadamard or None),
                        ("--numerics-field", a.numerics_field or None)):
            if v is not None:
                p.error(f"{flag} needs --model")
        return
    try:
        a.numerics_overrides = numerics_fields(a.numerics_field)
    except ValueError as e:
        p.error(str(e))
    if "fp8_linear" in a.numerics_overrides:
        p.error("--numerics-field fp8_linear: it follows the stored weights (FP8 unless --dequantize)")
    if a.no_indexer_hadamard:
        a.numerics_overrides["indexer_hadamard"] = False
    for flag, v in (("--checkpoint", a.checkpoint), ("--preset", a.preset), ("--config", a.config),
                    ("--moe", a.moe or None), ("--moe-experts", a.moe_experts), ("--mtp-layers", a.mtp_layers)):
        if v is not None:
            p.error(f"--model takes the model from the HF directory; {flag} cannot be combined with it")
    if a.runner == "fake":
        p.error("--model needs --runner model")
    if not os.path.isfile(os.path.join(a.model, "config.json")):  # before the tokenizer's warning and any build
        p.error(f"--model {a.model!r}: not a HF checkpoint directory (no config.json)")


def checkpoint_alone(a: argparse.Namespace) -> bool:
    """``--checkpoint`` without a preset, config or model overrides: the model is the checkpoint's stored config."""
    return bool(a.checkpoint) and a.preset is None and not a.config and not a.model_overrides


def open_tokenizer(path: str | None, *, bos_token_id: int, eos_token_id: int):
    """``load_tokenizer``; a tokenizer.json the ``tokenizers`` package cannot load (it raises a bare Exception)
    is a ValueError naming the file."""
    try:
        return load_tokenizer(path, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers.Tokenizer.from_file raises Exception
        raise ValueError(f"{os.path.join(path or '', 'tokenizer.json')}: cannot be loaded "
                         f"({type(e).__name__}: {e})") from None


def prepare_model_dir(a: argparse.Namespace, say) -> None:
    """For ``--model``: point ``a.checkpoint`` at the (cached or freshly converted) jds checkpoint and the
    tokenizer at the HF directory; a ValueError names what is wrong with the directory."""
    if a.model is None:
        return
    from jds.hf_import import cached_conversion

    if a.tokenizer is None:
        a.tokenizer = a.model
        if not os.path.isfile(os.path.join(a.model, "tokenizer.json")):
            say(f"WARNING: {a.model} has no tokenizer.json: serving with the byte-level tokenizer "
                "(pass --tokenizer DIR for the model's own)")
    open_tokenizer(a.tokenizer, bos_token_id=0, eos_token_id=0)  # a bad tokenizer fails before converting
    a.checkpoint, _ = cached_conversion(a.model, cache_dir=a.cache_dir, layers=a.num_layers, say=say,
                                        numerics=a.numerics or "reference", dequantize=a.dequantize,
                                        numerics_overrides=a.numerics_overrides or None)
    if a.served_model_name is None:
        a.served_model_name = os.path.basename(os.path.abspath(a.model).rstrip(os.sep))


def describe_tokenizer(tok, runner) -> str:
    """The tokenizer, its chat format, and a warning when its EOS is not the model's (generation stops on
    the model's ``eos_token_id``)."""
    fmt = getattr(tok, "chat_format", None)
    text = f"{type(tok).__name__}; chat: {fmt.description if fmt else 'plain'}"
    eos = getattr(runner, "eos_token_id", None)
    if tok.eos_token_id is not None and eos is not None and tok.eos_token_id != eos:
        text += (f"; WARNING: the tokenizer's eos_token_id {tok.eos_token_id} differs from the model config's "
                 f"{eos} (generation stops on {eos})")
    return text


def runner_config(a: argparse.Namespace) -> RunnerConfig:
    """The runner's settings from the flags (validated: a bad combination is a ValueError naming the field)."""
    return RunnerConfig(mode=a.mode, num_blocks=a.num_blocks, max_num_seqs=a.max_num_seqs,
                        max_num_tokens=a.max_num_tokens, max_model_len=a.max_model_len,
                        token_buckets=tuple(a.token_buckets), key_block_buckets=tuple(a.key_block_buckets),
                        stable_inputs=a.stable_inputs, batch_invariant=a.batch_invariant,
                        excess_precision=a.excess_precision, input_prep=a.input_prep, segments=a.segments,
                        compile_workers=a.compile_workers,
                        first_segment_layers=a.first_segment_layers,
                        tensor_parallel=a.tensor_parallel,
                        data_parallel=a.data_parallel, expert_parallel=a.expert_parallel)


def build_runner(a: argparse.Namespace):
    if a.graph_update_mode:
        use_graph_update_mode(a.graph_update_mode)  # before anything touches a device
    if a.runner == "fake":
        from jds.engine.fake import FakeRunner

        return FakeRunner(block_size=16, num_blocks=a.num_blocks, max_model_len=a.max_model_len,
                          max_num_tokens=a.max_num_tokens, max_num_seqs=a.max_num_seqs,
                          step_delay=a.fake_step_delay, warmup_delay=a.fake_warmup_delay)
    from jds.runner import ModelRunner

    return ModelRunner.build(preset=a.preset, config_path=a.config, checkpoint=a.checkpoint,
                             model_overrides=a.model_overrides, implementation=a.implementation, seed=a.seed,
                             runner=a.runner_config, progress=load_progress())


def load_progress():
    """A one-line progress bar for a checkpoint loaded straight into shards (printed every 10%)."""
    last = [-1]

    def show(done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth != last[0]:
            last[0] = tenth
            bar = "#" * tenth + "." * (10 - tenth)
            print(f"[serve] loading into shards [{bar}] {done}/{total} tensors", flush=True)
    return show


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


async def main(a: argparse.Namespace) -> int:
    """Serve until a signal (or a failed warm-up); returns the exit code, or leaves via ``os._exit``."""
    say = lambda msg: print(f"[serve] {msg}", flush=True)  # noqa: E731
    why = check_port(a.host, a.port)
    if why:
        fail(why)
    if a.compile_cache:  # JAX only warns, at each compile, about a cache directory it cannot use
        try:
            os.makedirs(a.compile_cache, exist_ok=True)
        except OSError as e:
            fail(f"--compile-cache {a.compile_cache!r}: cannot create it ({e.strerror or e})")
        if not os.access(a.compile_cache, os.W_OK | os.X_OK):
            fail(f"--compile-cache {a.compile_cache!r}: not writable")
    try:
        prepare_model_dir(a, say)
        if a.model is None and (a.tokenizer or a.checkpoint):  # a bad tokenizer fails before building
            open_tokenizer(a.tokenizer or a.checkpoint, bos_token_id=0, eos_token_id=0)
    except ValueError as e:
        fail(str(e))
    t0 = time.perf_counter()
    label = a.preset or ("checkpoint" if a.checkpoint else "v32-tiny")
    say(f"building {a.runner if a.runner == 'fake' else label} (mode={a.mode}, impl={a.implementation}, "
        f"moe={a.model_overrides or 'off'}, num_blocks={a.num_blocks}, max_num_seqs={a.max_num_seqs}, "
        f"max_num_tokens={a.max_num_tokens}, max_model_len={a.max_model_len}, async={a.async_steps})")
    if a.compile_cache:
        from jds.runner import enable_compile_cache

        enable_compile_cache(a.compile_cache)
    try:
        runner = build_runner(a)
    except ValueError as e:  # a checkpoint that does not match its config, a mesh that does not divide the model
        fail(str(e))
    say(f"built in {time.perf_counter() - t0:.1f}s; block_size={runner.block_size}, vocab={runner.vocab_size}")
    if getattr(runner, "model", None) is not None:  # which numerics run (departures from a checkpoint show here)
        say(f"numerics: {runner.model.cfg.numerics}; XLA excess precision "
            f"{'on (bf16 intermediates may stay float32)' if runner.excess_precision else 'off'}")
    try:
        engine = Engine(runner, async_steps=a.async_steps, speculative=a.speculative)
    except ValueError as e:  # an unsupported model / runner for --speculative, named by its field
        fail(str(e))
    loop = EngineLoop(engine)
    try:
        tok = open_tokenizer(a.tokenizer or a.checkpoint, bos_token_id=getattr(runner, "bos_token_id", 256),
                             eos_token_id=runner.eos_token_id)
    except ValueError as e:
        fail(str(e))
    say(f"tokenizer: {describe_tokenizer(tok, runner)}")
    name = a.served_model_name or f"jds-{label}"
    app, srv = build_app(loop, tok, ServerConfig(model_name=name, max_queue_len=a.max_queue_len,
                                                 shutdown_timeout=a.shutdown_timeout))
    got, stop = _install_drain_signals(say)
    try:
        site = await serve(app, a.host, a.port, shutdown_timeout=shutdown_reserve(a.shutdown_timeout) / 2)
    except OSError as e:  # taken between the check and now
        fail(listen_error(a.host, a.port, e))
    say(f"listening on http://{a.host}:{a.port} (model id {name!r}); /health is 503 until compiled")

    def warmup() -> None:
        t = time.perf_counter()

        def progress(m: str) -> None:
            say(f"warmup: {m}")
            loop.checkpoint()  # a shutdown request ends the warm-up here, between two compiles

        if a.speculative:  # the speculative engine runs only its own executables (verify, draft)
            runner.warmup_speculative(progress)
        else:
            runner.warmup(progress)
        if a.async_steps and hasattr(runner, "warmup_submit"):
            runner.warmup_submit(progress)
        say(f"ready after {time.perf_counter() - t:.1f}s of warmup; /health is 200")

    if not got:  # a signal during the listener's start: no warm-up to begin
        loop.start(warmup)
    code = 0
    while not stop.is_set():  # a failed warmup ends the process instead of serving 503 forever
        if loop.warmup_error is not None:
            say(f"warmup failed: {loop.warmup_error!r}")
            code = 1
            break
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    return await _shut_down(srv, loop, site, code if not got else _exit_code(got[0]), a.shutdown_timeout, say)


def _install_drain_signals(say) -> tuple[list[int], asyncio.Event]:
    """Route SIGINT/SIGTERM to a drain (first signal) or an immediate exit (second signal)."""
    got: list[int] = []
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if got:
            _leave(_exit_code(got[0]), f"{signal.Signals(signum).name} again: exiting now")
        got.append(signum)
        say(f"{signal.Signals(signum).name}: shutting down")
        stop.set()

    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aloop.add_signal_handler(sig, on_signal, sig)
    return got, stop


async def _shut_down(srv, loop: EngineLoop, site, code: int, timeout: float, say) -> int:
    """Drain requests, stop the engine thread and the listener, all within ``timeout`` seconds."""
    t0 = time.monotonic()
    if srv.in_flight or loop.ready.is_set():
        say(f"draining: {srv.in_flight} request(s) in flight, up to {timeout:g}s")
    ended = await srv.drain(timeout)
    if ended:
        say(f"ended {ended} unfinished request(s) at the shutdown timeout")
    loop.shutdown(0.0)  # ask the engine thread to stop while the listener closes
    if not loop.ready.is_set() and loop.warmup_error is None:
        left = max(0.0, t0 + timeout - time.monotonic())
        say(f"stopping the warm-up at its next compile boundary (at most {left:.0f}s; signal again to exit now)")
    await site.cleanup()
    remaining = max(0.2, t0 + timeout - time.monotonic())
    stopped = await asyncio.get_running_loop().run_in_executor(None, loop.shutdown, remaining)
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the exit is decided: a late signal changes nothing
        aloop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    if not stopped:
        _leave(code, "the engine thread is still inside a compile or a step: exiting without finalizing")
    say("stopped")
    return code


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_code = asyncio.run(main(parse_args()))
    logging.shutdown()  # the engine thread has ended: flush the log handlers before leaving without finalizing
    _leave(exit_code)
