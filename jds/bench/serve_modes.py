"""The seeds' end-to-end experiment in one command: for each boundary mode, start ``scripts/serve.py``,
wait for ``/health``, run the load generator (``jds.bench.serve``) at concurrency 1 and 64 (128-token
prompts, 1 output token), stop the server; one JSON with every run and a markdown table of the ratios to wide.

    python -m jds.bench.serve_modes --preset v32-bench --modes wide narrow fused \
        --num-prompts 300 --out benchmarks/results/serve_v32_<device>_<date>.json -- --num-blocks 1200

Arguments after ``--`` go to serve.py unchanged (e.g. ``--runner fake`` for a front-end smoke run).
A mode whose server fails to start or become healthy is recorded with its error; the others still run.
``--parallel-startup`` compiles all modes' servers at once (compilation is host work; the timed
benchmarks still run one mode at a time).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from jds.bench import serve as bench_serve
from jds.bench.results import write_json

# The server entry point lives in the repository's scripts/ folder, beside the package.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll /health until 200; ValueError if the server exits or the timeout passes first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise ValueError(f"server exited with code {proc.returncode} before /health turned 200")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise ValueError(f"/health not 200 after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Server:
    """One serve.py subprocess in one boundary mode, logging to ``log_dir/serve_<mode>.log``."""

    def __init__(self, mode: str, a: argparse.Namespace, serve_args: list[str], log_dir: str, env: dict):
        self.mode, self.port = mode, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), "--preset", a.preset, "--mode",
                    mode, "--port", str(self.port), "--max-num-seqs", str(a.max_num_seqs), "--max-num-tokens",
                    str(a.max_num_tokens), *serve_args]
        self.log_path = os.path.join(log_dir, f"serve_{mode}.log")
        self.t0 = time.monotonic()
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": ROOT, **env})
        self.record: dict = {"mode": mode, "server_command": " ".join(self.cmd), "server_log": self.log_path}

    def wait_ready(self, timeout: float) -> bool:
        try:
            wait_healthy(self.base, self.proc, timeout)
            self.record["startup_s"] = time.monotonic() - self.t0
            return True
        except ValueError as e:
            self.record["error"] = str(e)
            self.stop()
            return False

    def stop(self) -> None:
        stop(self.proc)
        self.log.close()


def bench(server: Server, a: argparse.Namespace) -> None:
    for conc in a.concurrency:
        server.record[f"c{conc}"] = bench_serve.main(
            ["--base-url", server.base, "--input-len", str(a.input_len), "--output-len", str(a.output_len),
             "--num-prompts", str(a.num_prompts), "--max-concurrency", str(conc), "--num-warmups",
             str(a.num_warmups), "--ignore-eos", "--disable-tqdm", "--label", f"{server.mode} c={conc}"])


def run_modes(a: argparse.Namespace, serve_args: list[str], log_dir: str, save) -> list[dict]:
    """Sequential: start, benchmark, stop each mode in turn. ``--parallel-startup``: start (and compile)
    every mode's server at once, each with a share of GPU memory, then benchmark them one at a time
    (the idle ones wait on an empty queue) and stop each after its runs."""
    if a.parallel_startup:
        share = {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.9 / len(a.modes):.2f}"}
        servers = [Server(m, a, serve_args, log_dir, share) for m in a.modes]
        started = list(zip(servers, [s.wait_ready(a.startup_timeout) for s in servers]))
    else:  # lazily: each server starts only when the previous one has been benchmarked and stopped
        started = ((s, s.wait_ready(a.startup_timeout))
                   for s in (Server(m, a, serve_args, log_dir, {}) for m in a.modes))
    runs: list[dict] = []
    for s, ready in started:
        if ready:
            try:
                bench(s, a)
            finally:
                s.stop()
        runs.append(s.record)
        save(runs)
    return runs


def table(runs: list[dict], concurrency: list[int]) -> str:
    """Mean / P50 / P99 TTFT and request throughput per mode, with the ratio to wide where present."""
    wide = next((r for r in runs if r["mode"] == "wide" and "error" not in r), None)
    lines = ["| mode | concurrency | TTFT mean / P50 / P99 (ms) | req/s | failed | TTFT mean / wide |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['mode']} | — | error: {r['error']} | | | |")
            continue
        for c in concurrency:
            s = r[f"c{c}"]
            ratio = f"{s['mean_ttft_ms'] / wide[f'c{c}']['mean_ttft_ms']:.2f}" if wide else "—"
            lines.append(f"| {r['mode']} | {c} | {s['mean_ttft_ms']:.2f} / {s['median_ttft_ms']:.2f} / "
                         f"{s['p99_ttft_ms']:.2f} | {s['request_throughput']:.1f} | {s['failed']} | {ratio} |")
    return "\n".join(lines)


def _device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip() or "cpu"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    raw = list(argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v32-tiny")
    ap.add_argument("--modes", nargs="+", default=["wide", "narrow", "fused"], choices=("wide", "narrow", "fused"))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--num-warmups", type=int, default=20)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-tokens", type=int, default=2048)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--parallel-startup", action="store_true",
                    help="start and compile every mode's server at once (GPU memory split between them)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if any(c < 1 for c in a.concurrency) or a.num_prompts < 1:
        ap.error("--concurrency and --num-prompts must be >= 1")
    log_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(log_dir, exist_ok=True)
    import jax  # version only: initialising a backend here would take GPU memory from the servers

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "jax": jax.__version__,
            "device": _device_name(), "command": " ".join(["python -m jds.bench.serve_modes", *raw]),
            "preset": a.preset, "serve_args": serve_args}
    def save(runs: list[dict]) -> None:  # after every mode: a cut-short run keeps what it measured
        write_json(a.out, {"meta": meta, "runs": runs})

    runs = run_modes(a, serve_args, log_dir, save)
    meta["complete"] = all("error" not in r for r in runs)
    save(runs)
    md = table(runs, a.concurrency)
    print(md)
    return {"meta": meta, "runs": runs, "table": md}


if __name__ == "__main__":
    main()
