"""Prometheus metrics of the gateway (prometheus_client, one registry per app).

Gateway-side: requests by finish reason, prompt / generation tokens, TTFT, TPOT
and end-to-end latency histograms. Engine-side values come from the EngineStats
snapshot fetched (utility call) when /metrics is scraped: running / waiting
requests, KV blocks and usage, prefix cache, preemptions, grammar compiles,
compile cache hits, compile and bitmask seconds. Re-validated constrained outputs:
formwork_constrained_outputs_total{result="valid|invalid|unchecked"}.

vLLM's names are exposed beside formwork's (same values, `model_name` label), so
dashboards built for vLLM work: vllm:num_requests_running / _waiting,
vllm:kv_cache_usage_perc and its old name vllm:gpu_cache_usage_perc (a 0-1
fraction whatever the device), vllm:prefix_cache_queries_total /
_hits_total, vllm:num_preemptions_total, vllm:prompt_tokens_total,
vllm:generation_tokens_total, vllm:request_success_total{finished_reason},
vllm:time_to_first_token_seconds, vllm:time_per_output_token_seconds and
vllm:e2e_request_latency_seconds (histograms).

Under data parallelism the engine-side values above are the engines' sum, and
per-engine series carry an `engine` label (its index): formwork_dp_engine_up,
formwork_dp_engine_restarts_total, formwork_dp_engine_num_requests_running /
_waiting, formwork_dp_engine_kv_cache_usage_perc (engine reports),
formwork_dp_requests_in_flight, formwork_dp_outstanding_tokens (gateway
counters the router uses) and
formwork_dp_requests_routed_total{engine, reason="affinity|load"}.
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

    def __init__(self, model_name: str) -> None:
        self.stats: EngineStats | None = None
        self.model_name = model_name

    def _vllm_gauges(self, s: EngineStats, usage: float):
        """vLLM's names for the same values, labelled by model_name as vLLM's."""
        gauges = {
            "num_requests_running": ("Requests in the running batch.", s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled (incl. grammar).",
                                     s.num_waiting + s.num_waiting_for_grammar),
            "kv_cache_usage_perc": ("KV-cache usage (0-1).", usage),
            "gpu_cache_usage_perc": ("KV-cache usage (0-1); vLLM's older name, kept for "
                                     "dashboards (CPU too).", usage),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                     s.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            "num_preemptions": ("Requests preempted for KV space.", s.num_preemptions),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c

    def collect(self):
        s = self.stats
        if s is None:
            return
        held = s.kv_total_blocks - s.kv_free_blocks     # kv_free_blocks: allocatable
        yield from self._vllm_gauges(s, held / max(1, s.kv_total_blocks))
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
            "grammar_deferred_checks": ("Constrained picks made without the grammar mask, then "
                                        "checked by the matcher.", s.grammar_deferred_checks),
            "grammar_deferred_refused": ("Deferred picks the grammar refused (picked again).",
                                         s.grammar_deferred_refused),
            "grammar_deferred_rescued": ("Refused greedy picks replaced by the row's next best "
                                         "allowed token, without a mask.", s.grammar_deferred_rescued),
            "engine_steps": ("Engine steps run.", s.steps),
            "forward_thread_resizes": ("Times the forward's thread team was resized.",
                                       s.thread_resizes),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(f"formwork_{name}", doc)
            c.add_metric([], value)
            yield c


@dataclass(slots=True)
class EngineSample:
    """One data-parallel engine as /metrics shows it (a snapshot, read-only)."""
    index: int
    up: bool
    restarts: int
    stats: EngineStats | None
    requests: int                   # in flight, gateway-side
    tokens: int                     # outstanding, gateway-side
    routed: dict[str, int]          # reason -> requests routed


class _DPCollector:
    """Per-engine series (label `engine`), from the samples set by `Metrics.render`."""

    def __init__(self) -> None:
        self.samples: list[EngineSample] = []

    def _gauge(self, name: str, doc: str, value) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"formwork_dp_{name}", doc, labels=["engine"])
        for s in self.samples:
            v = value(s)
            if v is not None:
                g.add_metric([str(s.index)], v)
        return g

    def collect(self):
        if not self.samples:
            return
        yield self._gauge("engine_up", "1 while the engine serves (state ready).",
                          lambda s: float(s.up))
        yield self._gauge("engine_num_requests_running", "Requests in the engine's batch.",
                          lambda s: s.stats and s.stats.num_running)
        yield self._gauge("engine_num_requests_waiting", "Requests waiting in the engine "
                          "(incl. grammar).", lambda s: s.stats and
                          s.stats.num_waiting + s.stats.num_waiting_for_grammar)
        yield self._gauge("engine_kv_cache_usage_perc", "Share of the engine's KV blocks held "
                          "(0-1).", lambda s: s.stats and (s.stats.kv_total_blocks
                          - s.stats.kv_free_blocks) / max(1, s.stats.kv_total_blocks))
        yield self._gauge("requests_in_flight", "Requests the gateway has in flight on the "
                          "engine.", lambda s: s.requests)
        yield self._gauge("outstanding_tokens", "Prompt plus remaining max_tokens of the "
                          "engine's requests in flight (the router's load).", lambda s: s.tokens)
        restarts = CounterMetricFamily("formwork_dp_engine_restarts", "Engine restarts.",
                                       labels=["engine"])
        routed = CounterMetricFamily("formwork_dp_requests_routed",
                                     "Requests routed to the engine, by reason.",
                                     labels=["engine", "reason"])
        for s in self.samples:
            restarts.add_metric([str(s.index)], s.restarts)
            for reason, n in sorted(s.routed.items()):
                routed.add_metric([str(s.index), reason], n)
        yield restarts
        yield routed


class _RequestMetrics:
    """The gateway's request metrics under one naming: `formwork_*`, and the same
    values under vLLM's `vllm:*` names so that existing dashboards work."""

    def __init__(self, r: CollectorRegistry, prefix: str) -> None:
        labels = ["model_name"]
        self._requests = Counter(f"{prefix}request_success", "Finished requests by finish reason.",
                                 labels + ["finished_reason"], registry=r)
        self._prompt = Counter(f"{prefix}prompt_tokens", "Prompt tokens processed.", labels,
                               registry=r)
        self._gen = Counter(f"{prefix}generation_tokens", "Tokens generated.", labels, registry=r)
        self._ttft = Histogram(f"{prefix}time_to_first_token_seconds", "Time to first token.",
                               labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._tpot = Histogram(f"{prefix}time_per_output_token_seconds",
                               "Mean time per output token after the first.", labels,
                               buckets=_TPOT_BUCKETS, registry=r)
        self._e2e = Histogram(f"{prefix}e2e_request_latency_seconds", "End-to-end request latency.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name
        self._errors = Counter("formwork_request_errors", "Requests answered with an error status.",
                               labels + ["status"], registry=r)
        self._constrained = Counter("formwork_constrained_outputs",
                                    "Finished constrained choices by re-validation result.",
                                    labels + ["result"], registry=r)
        self._families = (_RequestMetrics(r, "formwork_"), _RequestMetrics(r, "vllm:"))
        self._engine = _EngineCollector(model_name)
        r.register(self._engine)
        self._dp = _DPCollector()
        r.register(self._dp)

    def observe_finished(self, timer: RequestTimer, prompt_tokens: int,
                         finish_reasons: list[str | None]) -> None:
        now, m = time.monotonic(), self.model_name
        for family in self._families:
            for reason in finish_reasons:
                family._requests.labels(m, reason or "unknown").inc()
            family._prompt.labels(m).inc(prompt_tokens)
            family._gen.labels(m).inc(timer.num_tokens)
            family._e2e.labels(m).observe(now - timer.arrival)
            if timer.first_token is not None:
                family._ttft.labels(m).observe(timer.first_token - timer.arrival)
                if timer.num_tokens > 1:
                    family._tpot.labels(m).observe(
                        (now - timer.first_token) / (timer.num_tokens - 1))

    def observe_constrained(self, result: str) -> None:
        """One finished constrained choice: "valid" | "invalid" | "unchecked"."""
        self._constrained.labels(self.model_name, result).inc()

    def observe_error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    def set_engine_stats(self, stats: EngineStats | None,
                         engines: list[EngineSample] | None = None) -> None:
        """What the engine-side series show from now on. `stats`: the engine's (under
        data parallelism: the engines' sum); `engines`: per-engine samples, data
        parallelism only."""
        self._engine.stats = stats
        self._dp.samples = engines or []

    def render(self, stats: EngineStats | None,
               engines: list[EngineSample] | None = None) -> bytes:
        self.set_engine_stats(stats, engines)
        return generate_latest(self.registry)
