"""Prometheus metrics under vLLM's names, in a private registry per server.

Histograms and counters are fed by the engine thread (``prometheus_client`` is thread-safe) at the
moment tokens are sampled; the gauges read the engine's latest stats snapshot when scraped.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from jds.engine.core import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _Preemptions(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model: str) -> None:
        self._stats, self._model = stats, model

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemptions", labels=["model_name"])
        c.add_metric([self._model], self._stats().num_preemptions)
        yield c


class _SpecDecode(Collector):
    """Speculative decoding's draft counters (vLLM's names), read from the engine's stats snapshot: acceptance
    rate = accepted / draft tokens. Exported only when the engine runs with ``speculative``."""

    def __init__(self, stats: Callable[[], EngineStats], model: str) -> None:
        self._stats, self._model = stats, model

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = self._stats()
        for name, doc, value in (("vllm:spec_decode_num_draft_tokens", "Draft tokens verified by the main model",
                                  s.num_draft_tokens),
                                 ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                  s.num_accepted_tokens)):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], value)
            yield c


class ServerMetrics:
    """Implements ``jds.engine.core.MetricsSink`` and renders ``/metrics``."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], *, speculative: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab, m = self.registry, ["model_name"], model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (arrival to first token)",
                              lab, registry=r, buckets=TTFT_BUCKETS).labels(m)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens",
                             lab, registry=r, buckets=ITL_BUCKETS).labels(m)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", lab, registry=r,
                             buckets=REQUEST_BUCKETS).labels(m)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled step", lab,
                               registry=r, buckets=REQUEST_BUCKETS).labels(m)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens", lab, registry=r).labels(m)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", lab, registry=r).labels(m)
        self.success = Counter("vllm:request_success", "Finished requests by reason", lab + ["finished_reason"],
                               registry=r)
        self._model = m
        Gauge("vllm:num_requests_running", "Requests in the running batch", lab, registry=r).labels(m) \
            .set_function(lambda: stats().num_running)
        Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", lab, registry=r).labels(m) \
            .set_function(lambda: stats().num_waiting)
        Gauge("vllm:kv_cache_usage_perc", "KV-cache page usage (fraction 0..1, as vLLM)", lab, registry=r) \
            .labels(m).set_function(lambda: stats().kv_cache_usage)
        r.register(_Preemptions(stats, m))
        if speculative:
            r.register(_SpecDecode(stats, m))

    # -- MetricsSink (called from the engine thread) ------------------------------------------
    def on_scheduled(self, queue_time: float) -> None:
        self.queue.observe(queue_time)

    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_token(self, itl: float | None) -> None:
        self.generation_tokens.inc()
        if itl is not None:
            self.itl.observe(itl)

    def on_finished(self, e2e: float, reason: str) -> None:
        self.e2e.observe(e2e)
        self.success.labels(self._model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
