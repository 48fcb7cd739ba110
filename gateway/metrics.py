"""Prometheus metrics of the gateway (prometheus_client, one registry per app).

Gateway-side: requests by finish reason, prompt / generation tokens, TTFT, TPOT
and end-to-end latency histograms. Engine-side values come from the EngineStats
snapshot fetched (utility call) when /metrics is scraped: running / waiting
requests, KV blocks and usage, prefix cache, preemptions, grammar compiles,
compile cache hits, compile and bitmask seconds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from formwork.schemas.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class RequestTimer:
    """Times one request on the gateway's clock (time.monotonic)."""
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    num_tokens: int = 0

    def on_tokens(self, n: int) -> None:
        if n and self.first_token is None:
            self.first_token = time.monotonic()
        self.num_tokens += n


class _EngineCollector:
    """Exposes the latest EngineStats snapshot (set by `Metrics.render`)."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self):
        s = self.stats
        if s is None:
            return
        held = s.kv_total_blocks - s.kv_free_blocks     # kv_free_blocks: allocatable
        gauges = {
            "num_requests_running": ("Requests in the running batch.", s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", s.num_waiting),
            "num_requests_waiting_for_grammar": ("Requests whose grammar is compiling.",
                                                 s.num_waiting_for_grammar),
            "kv_cache_total_blocks": ("KV cache blocks in the pool.", s.kv_total_blocks),
            "kv_cache_free_blocks": ("KV blocks not held by a request (incl. prefix-cached).",
                                     s.kv_free_blocks),
            "kv_cache_cached_blocks": ("Free KV blocks that still hold a prefix-cache entry.",
                                       s.kv_cached_blocks),
            "kv_cache_held_blocks": ("KV blocks held by requests.", held),
            "kv_cache_usage_perc": ("Share of KV blocks held by requests (0-1).",
                                    held / max(1, s.kv_total_blocks)),
            "forward_threads": ("CPU threads of the forward now, sized to the cores other "
                                "processes leave free (0: fixed).", s.forward_threads),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(f"formwork_{name}", doc)
            g.add_metric([], value)
            yield g
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            "num_preemptions": ("Requests preempted for KV space.", s.num_preemptions),
            "grammar_compiles": ("Grammars compiled.", s.grammar_compiles),
            "grammar_cache_hits": ("Grammar compile-cache hits.", s.grammar_cache_hits),
            "grammar_compile_seconds": ("Seconds spent compiling grammars.", s.grammar_compile_seconds),
            "grammar_bitmask_seconds": ("Seconds spent filling grammar bitmasks.", s.bitmask_seconds),
            "engine_steps": ("Engine steps run.", s.steps),
            "forward_thread_resizes": ("Times the forward's thread team was resized.",
                                       s.thread_resizes),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(f"formwork_{name}", doc)
            c.add_metric([], value)
            yield c


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name
        self._requests = Counter("formwork_request_success", "Finished completions by finish reason.",
                                 labels + ["finished_reason"], registry=r)
        self._errors = Counter("formwork_request_errors", "Requests answered with an error status.",
                               labels + ["status"], registry=r)
        self._prompt = Counter("formwork_prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self._gen = Counter("formwork_generation_tokens", "Tokens generated.", labels, registry=r)
        self._ttft = Histogram("formwork_time_to_first_token_seconds", "Time to first token.",
                               labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._tpot = Histogram("formwork_time_per_output_token_seconds",
                               "Mean time per output token after the first.", labels,
                               buckets=_TPOT_BUCKETS, registry=r)
        self._e2e = Histogram("formwork_e2e_request_latency_seconds", "End-to-end request latency.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)

    def observe_finished(self, timer: RequestTimer, prompt_tokens: int,
                         finish_reasons: list[str | None]) -> None:
        now, m = time.monotonic(), self.model_name
        for reason in finish_reasons:
            self._requests.labels(m, reason or "unknown").inc()
        self._prompt.labels(m).inc(prompt_tokens)
        self._gen.labels(m).inc(timer.num_tokens)
        self._e2e.labels(m).observe(now - timer.arrival)
        if timer.first_token is not None:
            self._ttft.labels(m).observe(timer.first_token - timer.arrival)
            if timer.num_tokens > 1:
                self._tpot.labels(m).observe((now - timer.first_token) / (timer.num_tokens - 1))

    def observe_error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    def render(self, stats: EngineStats | None) -> bytes:
        self._engine.stats = stats
        return generate_latest(self.registry)
