"""Prometheus metrics under vLLM's names, so existing dashboards work unchanged; and the same
metrics as Python objects (vLLM's ``LLM.get_metrics()`` types: ``Counter``, ``Gauge``,
``Histogram``)."""

from __future__ import annotations

import dataclasses

import prometheus_client as prom

from engine.entrypoints.async_engine import EngineSnapshot
from engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclasses.dataclass(frozen=True)
class Metric:
    """One metric of one label set (vLLM's ``vllm.v1.metrics.reader.Metric``)."""

    name: str
    labels: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Counter(Metric):
    value: int


@dataclasses.dataclass(frozen=True)
class Gauge(Metric):
    value: float


@dataclasses.dataclass(frozen=True)
class Histogram(Metric):
    """``buckets``: each upper bound (as Prometheus writes it, "+Inf" last) → observations up
    to it, cumulative."""

    count: int
    sum: float
    buckets: dict[str, int]


class Metrics:
    """Gauges read from the engine's latest snapshot; counters and histograms fed per request."""

    def __init__(self, model_name: str, block_size: int):
        self.registry = prom.CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name, doc):
            return prom.Gauge(name, doc, labels, registry=self.registry).labels(**labels)

        def counter(name, doc):
            return prom.Counter(name, doc, labels, registry=self.registry).labels(**labels)

        def histogram(name, doc, buckets=_LATENCY_BUCKETS):
            return prom.Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests being computed.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.")
        self.swapped = gauge("vllm:num_requests_swapped", "Requests swapped out to host memory.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of device KV blocks in use (1 = full).")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions since start.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens computed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache (in whole blocks).")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.block_size = block_size
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first generated token.")
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.")
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Tokens generated per finished request (all its choices).",
                                                   _TOKEN_BUCKETS)
        self._success = prom.Counter("vllm:request_success", "Finished choices, by why they finished.",
                                     [*labels, "finished_reason"], registry=self.registry)
        self._labels = labels
        self._seen = {"preemptions": 0, "prompt": 0, "generation": 0, "prefix_queries": 0, "prefix_hits": 0}

    def refresh(self, snapshot: EngineSnapshot) -> None:
        """Bring gauges and counters up to the engine's latest snapshot."""
        stats = snapshot.scheduler
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_usage)
        for key, counter, value in [("preemptions", self.preemptions, stats.num_preemptions),
                                    ("prompt", self.prompt_tokens, snapshot.prompt_tokens),
                                    ("generation", self.generation_tokens, snapshot.generation_tokens),
                                    ("prefix_queries", self.prefix_cache_queries,
                                     stats.blocks.prefix_cache_queries * self.block_size),
                                    ("prefix_hits", self.prefix_cache_hits,
                                     stats.blocks.prefix_cache_hits * self.block_size)]:
            counter.inc(max(0, value - self._seen[key]))
            self._seen[key] = max(value, self._seen[key])

    def observe_finished(self, output: RequestOutput, choices: list[tuple[int, str | None]] | None = None) -> None:
        """Latency and size histograms of a finished request, and its choices' finish reasons.
        ``choices``: each choice's (tokens generated, finish reason) when ``output`` does not hold
        them whole (the last of a stream's deltas); by default, ``output``'s."""
        if choices is None:
            choices = [(len(c.token_ids), c.finish_reason) for c in output.outputs]
        for _, reason in choices:
            if reason is not None:
                self._success.labels(**self._labels, finished_reason=reason).inc()
        if output.error is None:
            self.request_prompt_tokens.observe(len(output.prompt_token_ids))
            self.request_generation_tokens.observe(sum(tokens for tokens, _ in choices))
        metrics = output.metrics
        if metrics is None or metrics.first_token_time is None or metrics.finished_time is None:
            return
        self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        self.e2e.observe(metrics.finished_time - metrics.arrival_time)
        generated = max((tokens for tokens, _ in choices), default=0)
        if generated > 1:
            self.tpot.observe((metrics.finished_time - metrics.first_token_time) / (generated - 1))

    def exposition(self, snapshot: EngineSnapshot) -> bytes:
        self.refresh(snapshot)
        return prom.generate_latest(self.registry)

    def collect(self, snapshot: EngineSnapshot) -> list[Metric]:
        """Every metric ``exposition`` serves, as objects: a Counter, Gauge or Histogram per
        metric and label set (counters named without Prometheus' ``_total`` suffix, as vLLM's)."""
        self.refresh(snapshot)
        metrics: list[Metric] = []
        for family in self.registry.collect():
            if family.type == "histogram":
                metrics += _histograms(family)
            elif family.type in ("counter", "gauge"):
                kind = Counter if family.type == "counter" else Gauge
                metrics += [kind(family.name, dict(sample.labels),
                                 int(sample.value) if kind is Counter else float(sample.value))
                            for sample in family.samples if sample.name in (family.name, family.name + "_total")]
        return metrics


def _histograms(family) -> list[Histogram]:
    """One Histogram per label set of a Prometheus histogram family."""
    parts: dict[tuple, dict] = {}
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        part = parts.setdefault(tuple(sorted(labels.items())), {"labels": labels, "buckets": {}})
        if sample.name.endswith("_bucket"):
            part["buckets"][sample.labels["le"]] = int(sample.value)
        elif sample.name.endswith("_count"):
            part["count"] = int(sample.value)
        elif sample.name.endswith("_sum"):
            part["sum"] = float(sample.value)
    return [Histogram(family.name, p["labels"], p.get("count", 0), p.get("sum", 0.0), p["buckets"])
            for p in parts.values()]
