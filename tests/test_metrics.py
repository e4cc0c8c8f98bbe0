"""Prometheus metrics: own registry per app, every documented name exported."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = metrics.render()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def test_render_exports_every_metric_in_prometheus_text_format() -> None:
    metrics = Metrics()
    metrics.requests.labels(route="/v1/responses", status="200", tenant="acme").inc()
    metrics.upstream_latency.labels(route="/v1/responses").observe(0.3)
    metrics.context_tokens.labels(route="/v1/responses").observe(900_000)
    metrics.trimmed.labels(kind="compressed").inc(1200)
    metrics.upstream_retries.labels(route="/v1/chat/completions").inc()
    metrics.rebuild_seconds.observe(0.002)
    metrics.ledger_unknown_outcome.labels(tenant="acme", tool="refund_order").inc()
    metrics.summarizer_calls.labels(tenant="acme", outcome="guarded").inc()
    metrics.summarizer_tokens.labels(tenant="acme", direction="in").inc(900)
    metrics.summaries_skipped.labels(tenant="acme").inc()
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    text = body.decode()
    for name in (
        "threadkeeper_requests_total",
        "threadkeeper_upstream_latency_seconds_bucket",
        "threadkeeper_context_tokens_bucket",
        "threadkeeper_tokens_trimmed_total",
        "threadkeeper_upstream_retries_total",
        "threadkeeper_rebuild_seconds_bucket",
        "threadkeeper_ledger_unknown_outcome_total",
        "threadkeeper_summarizer_calls_total",
        "threadkeeper_summarizer_tokens_total",
        "threadkeeper_summaries_skipped_total",
    ):
        assert name in text
    found = samples(metrics)
    requests = (("route", "/v1/responses"), ("status", "200"), ("tenant", "acme"))
    assert found[("threadkeeper_requests_total", requests)] == 1
    assert found[("threadkeeper_tokens_trimmed_total", (("kind", "compressed"),))] == 1200
    # a 900k-token prompt lands in a finite bucket (buckets reach 1M)
    buckets = {
        float(dict(labels)["le"]): value
        for (name, labels), value in found.items()
        if name == "threadkeeper_context_tokens_bucket"
    }
    assert buckets[1_000_000] == 1
    assert buckets[400_000] == 0


def test_every_trim_kind_is_exported_from_the_start() -> None:
    found = samples(Metrics())
    for kind in ("dropped", "compressed", "summarized"):
        assert found[("threadkeeper_tokens_trimmed_total", (("kind", kind),))] == 0


def test_two_apps_do_not_share_counts() -> None:
    first, second = Metrics(), Metrics()
    first.upstream_retries.labels(route="/v1/responses").inc(3)
    key = ("threadkeeper_upstream_retries_total", (("route", "/v1/responses"),))
    assert samples(first)[key] == 3
    assert key not in samples(second)


def test_a_kept_child_is_the_registrys_series() -> None:
    """Metrics.child keeps `labels(...)`'s child: increments through it and through
    `labels` land on one series, and each label set has its own."""
    metrics = Metrics()
    first = metrics.child(metrics.requests, "chat.completions", "200", "acme")
    assert metrics.child(metrics.requests, "chat.completions", "200", "acme") is first
    first.inc()
    metrics.requests.labels("chat.completions", "200", "acme").inc()
    metrics.child(metrics.requests, "chat.completions", "500", "acme").inc()
    metrics.child(metrics.count_correction, "acme", "gpt-4o", "ratio").set(1.25)
    shown = samples(metrics)
    labels = (("route", "chat.completions"), ("status", "200"), ("tenant", "acme"))
    assert shown[("threadkeeper_requests_total", labels)] == 2
    failed = (("route", "chat.completions"), ("status", "500"), ("tenant", "acme"))
    assert shown[("threadkeeper_requests_total", failed)] == 1
    ratio = (("model", "gpt-4o"), ("part", "ratio"), ("tenant", "acme"))
    assert shown[("threadkeeper_count_correction", ratio)] == 1.25
