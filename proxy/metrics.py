"""Prometheus metrics, one registry per app (no process-global state).

metrics = Metrics()
metrics.requests.labels(route="/v1/responses", status="200", tenant="acme").inc()
metrics.child(metrics.requests, "/v1/responses", "200", "acme").inc()  # the same, cached
body, content_type = metrics.render()      # GET /metrics
"""

from __future__ import annotations

from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# What a rebuild removed from the context (SPEC section 5, in relief order).
TRIM_KINDS = ("dropped", "compressed", "summarized")

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TOKEN_BUCKETS = (
    256, 1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000,
    128_000, 200_000, 400_000, 1_000_000,
)  # fmt: skip
M = TypeVar("M", Counter, Gauge, Histogram)

REBUILD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """The proxy's metrics, registered on their own CollectorRegistry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "threadkeeper_requests",
            "Requests answered, by route, HTTP status and tenant.",
            ("route", "status", "tenant"),
            registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "threadkeeper_upstream_latency_seconds",
            "Time from sending a request upstream to its response headers.",
            ("route",),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.context_tokens = Histogram(
            "threadkeeper_context_tokens",
            "Prompt tokens sent upstream per rebuilt request.",
            ("route",),
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.trimmed = Counter(
            "threadkeeper_tokens_trimmed",
            "Tokens removed from rebuilt contexts, by how (dropped, compressed, summarized).",
            ("kind",),
            registry=self.registry,
        )
        self.upstream_retries = Counter(
            "threadkeeper_upstream_retries",
            "Upstream attempts after the first.",
            ("route",),
            registry=self.registry,
        )
        self.overflow_retries = Counter(
            "threadkeeper_overflow_retries",
            "Context-length refusals of the provider, by route and what followed "
            "(retried: sent again under the budget it stated; refused: the turn cannot fit; "
            "not_retried: truncation disabled or the retry was refused too).",
            ("route", "outcome"),
            registry=self.registry,
        )
        # The usage correction (proxy/server/model_budget.py): one series per (tenant, model).
        self.count_correction = Gauge(
            "threadkeeper_count_correction",
            "How the provider's prompt count relates to the proxy's own, fitted from its "
            "answers' usage: `ratio` (times the proxy's count), `overhead` (provider tokens "
            "per item) and `answers` (how many samples it rests on).",
            ("tenant", "model", "part"),
            registry=self.registry,
        )
        self.silent_truncations = Counter(
            "threadkeeper_silent_truncations",
            "Answers whose reported prompt tokens fell far below what was sent: a provider "
            "that cut the prompt without an error (Ollama at its num_ctx).",
            ("tenant", "model"),
            registry=self.registry,
        )
        self.rebuild_seconds = Histogram(
            "threadkeeper_rebuild_seconds",
            "Time to project one request's context under its budget: counting its "
            "instructions and tool definitions, the projection and its invariant check "
            "(not the thread load, the tokenizer load or a retried commit's restate).",
            buckets=REBUILD_BUCKETS,
            registry=self.registry,
        )
        self.ledger_unknown_outcome = Counter(
            "threadkeeper_ledger_unknown_outcome",
            "Side-effecting calls repeated while their first outcome is unknown (SPEC 6).",
            ("tenant", "tool"),
            registry=self.registry,
        )
        # Read at scrape time from the pool (app.py wires it to Upstream.connections_in_use):
        # a number that does not fall back to 0 between requests is a leak.
        self.upstream_connections_in_use = Gauge(
            "threadkeeper_upstream_connections_in_use",
            "Upstream pool connections busy with a request (connecting, sending or answering).",
            registry=self.registry,
        )
        # The LLM summarizer (proxy/summarizer.py): every call it makes, off the request path.
        self.summarizer_calls = Counter(
            "threadkeeper_summarizer_calls",
            "Summarizer model calls by tenant and outcome (ok: used as written; guarded: "
            "used with must-keep lines appended; unverified: used, with what the chunk "
            "does not bear out only as the summarizer's notes; error, timeout, invalid, "
            "unparseable: the deterministic digest stands).",
            ("tenant", "outcome"),
            registry=self.registry,
        )
        self.summarizer_tokens = Counter(
            "threadkeeper_summarizer_tokens",
            "Tokens the summarizer model reported, by tenant and direction (in, out).",
            ("tenant", "direction"),
            registry=self.registry,
        )
        self.summaries_skipped = Counter(
            "threadkeeper_summaries_skipped",
            "Background summaries not started because the tenant's or the process's cap "
            "of running ones was reached (the deterministic digest stands).",
            ("tenant",),
            registry=self.registry,
        )
        for kind in TRIM_KINDS:  # export zeros so dashboards see every kind from the start
            self.trimmed.labels(kind=kind)

    def child(self, metric: M, *values: str) -> M:
        """`metric.labels(*values)`, kept: the request path asks for the same few series
        on every request, and prometheus_client's lookup (values checked, a lock) costs
        more than the increment. No series is ever removed, so a kept child stays the
        registry's."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child  # type: ignore[no-any-return]

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
