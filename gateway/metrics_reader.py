"""`LLM.get_metrics()`: the offline engine's metrics as vLLM's reader returns them
(`vllm.v1.metrics.reader`: Counter, Gauge, Histogram, Vector dataclasses, each with
`name` and `labels`), read from the same prometheus_client registry that the
server's /metrics renders (gateway/metrics.py), so the names are the server's:
vLLM's (`vllm:prompt_tokens`, `vllm:generation_tokens`,
`vllm:request_success{finished_reason}`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, `vllm:e2e_request_latency_seconds`, ...) beside
formwork's (`formwork_num_preemptions`, `formwork_prefix_cache_hits`, grammar
compiles and mask time, ...). Importable as `formwork.v1.metrics.reader` too.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing count (float for the seconds counters)."""
    value: int | float


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""
    value: float


@dataclass
class Vector(Metric):
    """A list of counts (vLLM's for per-position counters; none is kept here)."""
    values: list[int]


@dataclass
class Histogram(Metric):
    """Observations in buckets: {upper bound as text: cumulative count}, '+Inf' among
    them; `count` is the '+Inf' bucket's, `sum` the observations' total."""
    count: int
    sum: float
    buckets: dict[str, int]


def _count(value: float) -> int | float:
    """A counter's value: an int as vLLM's reader gives, but seconds stay float."""
    return int(value) if float(value).is_integer() else float(value)


def snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every series of `registry` (its collectors run now), as vLLM's reader gives them."""
    out: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter":
            out += [Counter(family.name, dict(s.labels), _count(s.value))
                    for s in family.samples if s.name.endswith("_total")]
        elif family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples]
        elif family.type == "histogram":
            series: dict[tuple, dict] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                entry = series.setdefault(tuple(sorted(labels.items())),
                                          {"labels": labels, "buckets": {}, "sum": 0.0})
                if s.name.endswith("_bucket"):
                    entry["buckets"][s.labels["le"]] = int(s.value)
                elif s.name.endswith("_sum"):
                    entry["sum"] = float(s.value)
            out += [Histogram(family.name, e["labels"], e["buckets"].get("+Inf", 0), e["sum"],
                              e["buckets"]) for e in series.values()]
    return out
