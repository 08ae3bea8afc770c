"""Load generator following vLLM's ``bench serve`` definitions, against any OpenAI-compatible URL.

    python -m jds.bench.serve --url http://127.0.0.1:8000/v1/completions \
        --input-len 128 --output-len 1 --num-prompts 200 --max-concurrency 64 --ignore-eos

Definitions (as vLLM): streaming with ``stream_options.include_usage``; TTFT = send -> first SSE chunk
carrying ``choices``; ITL = gaps between later chunks; TPOT = (E2EL - TTFT) / (output tokens - 1);
E2EL = send -> ``[DONE]``; output tokens come from the final ``usage`` chunk; request rate is Poisson
(gamma with ``--burstiness``), ``inf`` sends everything at once; ``--max-concurrency`` caps requests
in flight; warm-ups are sent first and not counted. Prompts are random (ASCII letters and spaces, one
byte-level token per character), or exact random token ids with ``--prompt-format ids``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime

import aiohttp
import numpy as np

from jds.bench.results import write_json
from jds.bench.stats import summarize as summary_stats


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0


def random_prompts(n: int, input_len: int, output_len: int, ratio: float, fmt: str, vocab: int,
                   seed: int) -> list[tuple[object, int, int]]:
    """(prompt, prompt_len, output_len) triples; lengths uniform in [len*(1-ratio), len*(1+ratio)]."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    out = []
    for _ in range(n):
        il = max(1, rng.randint(math.floor(input_len * (1 - ratio)), math.ceil(input_len * (1 + ratio))))
        ol = max(1, rng.randint(math.floor(output_len * (1 - ratio)), math.ceil(output_len * (1 + ratio))))
        if fmt == "ids":
            prompt: object = [rng.randrange(vocab) for _ in range(il)]
        else:
            prompt = "".join(rng.choice(letters) for _ in range(il))
        out.append((prompt, il, ol))
    return out


def make_body(a: argparse.Namespace, model: str, prompt: object, out_len: int) -> dict:
    body: dict = {"model": model, "max_tokens": out_len, "temperature": a.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if a.chat:
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        body["messages"] = [{"role": "user", "content": text}]
        body["max_completion_tokens"] = body.pop("max_tokens")
    else:
        body["prompt"] = prompt
    if a.ignore_eos:
        body["ignore_eos"] = True
    return body


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, prompt_len: int) -> Result:
    r = Result(prompt_len=prompt_len)
    st = r.start = time.perf_counter()
    last = st
    chunks = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            buf = b""
            done = False
            async for piece in resp.content.iter_any():
                buf += piece
                while b"\n\n" in buf and not done:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.decode("utf-8").splitlines():
                        if not line or line.startswith(":") or not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        msg = json.loads(data)
                        if "error" in msg:
                            r.error = json.dumps(msg["error"])[:300]
                            return r
                        now = time.perf_counter()
                        if msg.get("choices"):
                            if chunks == 0:
                                r.ttft = now - st
                            else:
                                r.itl.append(now - last)
                            chunks += 1
                            last = now
                        if msg.get("usage"):
                            r.output_tokens = int(msg["usage"].get("completion_tokens", 0))
                if done:
                    break
            r.latency = time.perf_counter() - st
            if not r.output_tokens:
                r.output_tokens = chunks  # server sent no usage: one token per chunk
            r.ok = chunks > 0
            if not r.ok:
                r.error = "no chunk with choices"
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        r.error = f"{type(e).__name__}: {e}"
    return r


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.n, self.enabled, self.t0 = total, 0, enabled, time.perf_counter()

    def update(self) -> None:
        self.n += 1
        if self.enabled:
            w = 30
            f = int(w * self.n / max(self.total, 1))
            el = time.perf_counter() - self.t0
            sys.stderr.write(f"\r[{'#' * f}{'.' * (w - f)}] {self.n}/{self.total} {el:6.1f}s")
            if self.n == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run(a: argparse.Namespace) -> dict:
    url = a.url or (a.base_url.rstrip("/") + a.endpoint)
    if not (url.endswith("completions") or url.endswith("chat/completions")):
        raise SystemExit("the URL must end in 'completions' or 'chat/completions'")
    a.chat = url.endswith("chat/completions")
    timeout = aiohttp.ClientTimeout(total=a.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        model = a.model
        if model is None:
            base = url.split("/v1/")[0]
            async with s.get(base + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
        reqs = random_prompts(a.num_prompts + a.num_warmups, a.input_len, a.output_len, a.random_range_ratio,
                              a.prompt_format, a.vocab_size, a.seed)
        warm, reqs = reqs[: a.num_warmups], reqs[a.num_warmups:]
        # Readiness: a real request, retried until the server answers (as vLLM does).
        t_ready = time.perf_counter()
        while True:
            r = await one_request(s, url, make_body(a, model, reqs[0][0], 1), reqs[0][1])
            if r.ok:
                break
            if time.perf_counter() - t_ready > a.ready_check_timeout_sec:
                raise SystemExit(f"server not ready: {r.error}")
            await asyncio.sleep(1.0)
        if warm:
            print(f"warming up with {len(warm)} requests", file=sys.stderr)
            sem = asyncio.Semaphore(a.max_concurrency or len(warm))

            async def w(p):
                async with sem:
                    await one_request(s, url, make_body(a, model, p[0], p[2]), p[1])

            await asyncio.gather(*(w(p) for p in warm))
        sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        prog = Progress(len(reqs), not a.disable_tqdm)
        in_flight = peak = 0
        rng = np.random.default_rng(a.seed)

        async def go(p) -> Result:
            async def call() -> Result:
                nonlocal in_flight, peak
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await one_request(s, url, make_body(a, model, p[0], p[2]), p[1])
                finally:
                    in_flight -= 1
                    prog.update()
            if sem is None:
                return await call()
            async with sem:
                return await call()

        print(f"benchmark: {len(reqs)} requests, rate={a.request_rate}, burstiness={a.burstiness}, "
              f"max_concurrency={a.max_concurrency}", file=sys.stderr)
        t0 = time.perf_counter()
        tasks = []
        for p in reqs:
            tasks.append(asyncio.create_task(go(p)))
            if math.isfinite(a.request_rate):
                theta = 1.0 / (a.request_rate * a.burstiness)
                await asyncio.sleep(float(rng.gamma(shape=a.burstiness, scale=theta)))
        results: list[Result] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(a, url, model, results, duration, peak)


def _stats(name: str, xs: list[float], pcts: list[float]) -> dict:
    """vLLM's key names (``mean_ttft_ms``, ``p99_ttft_ms``, ...) over ``summarize`` of seconds."""
    s = summary_stats(xs, pcts)
    del s["n"]
    return {f"{k}_{name}_ms": v for k, v in s.items()}


def summarize(a, url: str, model: str, results: list[Result], duration: float, peak: int) -> dict:
    ok = [r for r in results if r.ok]
    pcts = [float(p) for p in a.metric_percentiles.split(",")]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    res = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "url": url, "model_id": model,
        "num_prompts": len(results), "input_len": a.input_len, "output_len": a.output_len,
        "request_rate": a.request_rate if math.isfinite(a.request_rate) else "inf", "burstiness": a.burstiness,
        "max_concurrency": a.max_concurrency, "duration": duration, "completed": len(ok),
        "failed": len(results) - len(ok), "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration, "max_concurrent_requests": peak,
        **_stats("ttft", [r.ttft for r in ok], pcts), **_stats("tpot", tpots, pcts),
        **_stats("itl", [x for r in ok for x in r.itl], pcts), **_stats("e2el", [r.latency for r in ok], pcts),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }
    if a.save_detailed:
        res["ttfts"] = [r.ttft for r in results]
        res["itls"] = [r.itl for r in results]
        res["output_lens"] = [r.output_tokens for r in results]
        res["errors_all"] = [r.error for r in results]
    return res


def report(res: dict, pcts: list[float]) -> None:
    line = lambda k, v: print(f"{k:<40}{str(v):<10}")  # noqa: E731
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    line("Successful requests:", res["completed"])
    line("Failed requests:", res["failed"])
    line("Maximum request concurrency:", res["max_concurrency"])
    line("Benchmark duration (s):", f"{res['duration']:.2f}")
    line("Total input tokens:", res["total_input_tokens"])
    line("Total generated tokens:", res["total_output_tokens"])
    line("Request throughput (req/s):", f"{res['request_throughput']:.2f}")
    line("Output token throughput (tok/s):", f"{res['output_throughput']:.2f}")
    line("Total token throughput (tok/s):", f"{res['total_token_throughput']:.2f}")
    line("Peak concurrent requests:", res["max_concurrent_requests"])
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{s:{c}^50}".format(s=f" {title} ", c="-"))
        line(f"Mean {key.upper()} (ms):", f"{res[f'mean_{key}_ms']:.2f}")
        line(f"Median {key.upper()} (ms):", f"{res[f'median_{key}_ms']:.2f}")
        for p in pcts:
            line(f"P{p:g} {key.upper()} (ms):", f"{res[f'p{p:g}_{key}_ms']:.2f}")
    print("=" * 50)
    if res["errors"]:
        print("errors:", *res["errors"], sep="\n  ")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="full endpoint URL (overrides --base-url/--endpoint)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prompt-format", choices=("text", "ids"), default="text")
    p.add_argument("--vocab-size", type=int, default=256, help="id range for --prompt-format ids")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson")
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, help="write the result JSON here")
    p.add_argument("--save-detailed", action="store_true", help="include per-request TTFT/ITL/lengths")
    p.add_argument("--request-timeout", type=float, default=6 * 3600)
    p.add_argument("--ready-check-timeout-sec", type=float, default=600)
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--label", default=None, help="free text stored in the JSON (e.g. the boundary mode)")
    a = p.parse_args(argv)
    if a.request_rate <= 0 or a.burstiness <= 0:
        p.error("--request-rate and --burstiness must be > 0")
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    res = asyncio.run(run(a))
    if a.label:
        res["label"] = a.label
    report(res, [float(x) for x in a.metric_percentiles.split(",")])
    if a.save_result:
        write_json(a.save_result, res)
        print(f"saved {a.save_result}")
    return res


if __name__ == "__main__":
    main()
