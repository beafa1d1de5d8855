"""Prometheus metrics of a server, in llama-server's style (`jaxinfer:requests_processing`,
`jaxinfer:slots_busy`, ...).

Two kinds: what the HTTP side sees (requests by outcome, tokens, latency histograms) is
recorded as requests finish; what the engine knows (slots, queue, KV pages, graph reuse,
recompiles by kind, compiles, the prefix cache and its host tier) is read from a snapshot the
engine thread takes for each scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine import Engine
from ..runtime.request import Result

P = "jaxinfer:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def process_counters(engine: Engine, compiles_at_ready: int) -> dict:
    """What each process of a group counts for itself (a follower's heartbeats carry them):
    its compiles and recompiles."""
    stats = engine.perf_stats()
    return {
        "recompiles": {
            "same_shape": stats.recompiles_same,
            "changed_shape": stats.recompiles_diff,
            "sharding": stats.recompiles_sharding,
        },
        "programs": stats.programs,
        "executables_loaded": stats.loaded,
        "compiles_after_warmup": stats.programs + stats.untracked_compiles - compiles_at_ready,
        "compile_seconds": stats.compile_seconds,
    }


def engine_snapshot(engine: Engine, compiles_at_ready: int) -> dict:
    """What the engine knows now (taken on the engine thread); with a process group, the
    compile counters summed over its processes (the followers' from their last heartbeat)."""
    stats, kv, now = engine.perf_stats(), engine.kv_stats(), engine.activity()
    counters = process_counters(engine, compiles_at_ready)
    leader = engine.executor.lockstep
    followers = leader.counters() if leader else []
    for other in followers:
        for key, value in other.items():
            if key == "recompiles":
                for kind, n in value.items():
                    counters["recompiles"][kind] += n
            elif key in counters:
                counters[key] += value
    return {
        "processes": 1 + len(followers),
        "lockstep_calls": leader.calls if leader else 0,
        "lockstep_bytes": leader.bytes_sent if leader else 0,
        "slots_total": engine.slots or 1,
        "slots_busy": now["running"],
        "requests_deferred": now["queued"],
        "kv_pages_used": kv["pages_in_use"],
        "kv_pages_total": kv["pages_total"],
        "prefix_cache_queries": kv["prefix_queries"],
        "prefix_cache_hits": kv["prefix_hits"],
        "host_cache_bytes": kv["host_bytes"],
        "host_cache_capacity": kv["host_capacity"],
        "host_cache_hits": kv["host_hits"],
        "host_cache_evictions": kv["host_evictions"],
        "graphs_reused": stats.graphs_reused,
        **counters,
        "decode_tokens": stats.eval_tokens,
        "spec_draft_tokens": stats.draft_tokens,
        "spec_accepted_tokens": stats.accepted_tokens,
        "requests_preempted": stats.preempted,
    }


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.snapshot: dict | None = None  # None while the engine loads
        r = self.registry
        self.requests = Counter(
            f"{P}requests", "Requests finished, by finish reason (stop, length, cancelled, error)",
            ["finish_reason"], registry=r,
        )  # fmt: skip
        self.refused = Counter(
            f"{P}requests_refused", "Requests refused with an HTTP error, by status code",
            ["code"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(f"{P}prompt_tokens", "Prompt tokens processed", registry=r)
        self.predicted = Counter(f"{P}tokens_predicted", "Tokens generated", registry=r)
        self.ttft = Histogram(
            f"{P}time_to_first_token_seconds", "From arrival to the first generated token",
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            f"{P}e2e_request_latency_seconds", "From arrival to the last generated token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            f"{P}request_queue_time_seconds", "From arrival to a free slot",
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_EngineCollector(self))

    def finished(self, result: Result) -> None:
        self.requests.labels(result.finish_reason).inc()
        self.prompt_tokens.inc(len(result.prompt_ids))
        self.predicted.inc(len(result.token_ids))
        if result.token_ids:
            self.ttft.observe((result.queue_ms + result.prompt_ms) / 1e3)
            self.latency.observe((result.queue_ms + result.prompt_ms + result.decode_ms) / 1e3)
        self.queue_time.observe(result.queue_ms / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine snapshot as gauges and counters (nothing while the engine loads)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []  # values exist only once the engine is up; nothing to check at register

    def collect(self):
        s = self.metrics.snapshot
        if s is None:
            return
        for name, key, doc in (  # data: (metric, snapshot key, help) per gauge
            ("processes", "processes", "Processes the engine spans (jax.distributed)"),
            ("slots_total", "slots_total", "Slots (requests decoded together)"),
            ("slots_busy", "slots_busy", "Slots serving a request"),
            ("requests_processing", "slots_busy", "Requests being processed"),
            ("requests_deferred", "requests_deferred", "Requests waiting for a slot"),
            ("kv_cache_pages_used", "kv_pages_used", "KV cache pages in use"),
            ("kv_cache_pages_total", "kv_pages_total", "KV cache pages in the pool"),
            ("host_cache_bytes", "host_cache_bytes", "Bytes the prefix cache's host tier holds"),
            (
                "host_cache_capacity_bytes",
                "host_cache_capacity",
                "Bytes the prefix cache's host tier may hold (--cache-ram)",
            ),
        ):
            yield GaugeMetricFamily(f"{P}{name}", doc, value=s[key])
        yield GaugeMetricFamily(
            f"{P}kv_cache_usage_ratio", "KV cache pages in use / pages in the pool",
            value=s["kv_pages_used"] / max(s["kv_pages_total"], 1),
        )  # fmt: skip
        for name, key, doc in (  # data: (metric, snapshot key, help) per counter
            ("graphs_reused", "graphs_reused", "Compiled-program calls that reused a program"),
            ("programs_compiled", "programs", "Programs compiled (warmup included)"),
            ("executables_loaded", "executables_loaded", "Programs loaded, not compiled"),
            ("compiles_after_warmup", "compiles_after_warmup", "Compiles after warmup (want 0)"),
            ("compile_seconds", "compile_seconds", "Seconds spent compiling"),
            ("decode_tokens", "decode_tokens", "Tokens produced by decode calls"),
            ("spec_draft_tokens", "spec_draft_tokens", "Speculative draft tokens verified"),
            ("spec_accepted_tokens", "spec_accepted_tokens", "Speculative drafts accepted"),
            ("requests_preempted", "requests_preempted", "Requests preempted (resumed later)"),
            ("lockstep_calls", "lockstep_calls", "Device calls process 0 sent its followers"),
            (
                "lockstep_bytes",
                "lockstep_bytes",
                "Bytes of the device calls process 0 sent each follower",
            ),
            (
                "prefix_cache_queries",
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
            ),
            ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            (
                "host_cache_hits",
                "host_cache_hits",
                "Prompt tokens found in the prefix cache's host tier (in prefix_cache_hits too)",
            ),
            (
                "host_cache_evictions",
                "host_cache_evictions",
                "Pages dropped from the prefix cache's host tier for room",
            ),
        ):
            yield CounterMetricFamily(f"{P}{name}", doc, value=s[key])
        family = CounterMetricFamily(
            f"{P}recompiles", "Recompiles by kind (same_shape: a program that should have been "
            "reused; changed_shape: a new bucket; sharding: a reshard)", labels=["kind"],
        )  # fmt: skip
        for kind, n in s["recompiles"].items():
            family.add_metric([kind], n)
        yield family
