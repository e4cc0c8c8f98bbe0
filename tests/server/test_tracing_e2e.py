"""OpenTelemetry traces: one server span per request, children for each step, GenAI
attributes on the model call, and the trace carried in from the client and on to the
provider (traceparent), per upstream attempt."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.fake_provider import FakeProvider, Reply
from proxy.tracing import Tracing

from .conftest import TENANT_KEY, Proxy

AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def traced(
    make_proxy: Callable[..., Awaitable[Proxy]], exporter: InMemorySpanExporter
) -> Proxy:
    return await make_proxy(tracing=Tracing.with_processor(SimpleSpanProcessor(exporter)))


async def post_chat(proxy: Proxy, headers: dict[str, str] | None = None, **extra: Any) -> Any:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}], **extra}
    async with proxy.http() as http:
        answer = await http.post(
            "/v1/chat/completions", json=body, headers={**AUTH, **(headers or {})}
        )
    assert answer.status_code == 200, answer.text
    return answer.json()


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exporter.get_finished_spans()}


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_a_request_is_one_trace_continuing_the_clients_and_reaching_the_provider(
    traced: Proxy, exporter: InMemorySpanExporter, provider: FakeProvider
) -> None:
    answer = await post_chat(traced, {"traceparent": TRACEPARENT}, max_tokens=50)
    spans = by_name(exporter)
    root = spans["POST /v1/chat/completions"]
    assert {span.context.trace_id for span in spans.values()} == {int(TRACE_ID, 16)}
    assert parent_of(root) == int(CLIENT_SPAN, 16)
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["threadkeeper.tenant"] == "acme"

    model_call = spans["chat gpt-4o"]
    for name in ("auth", "projection", "chat gpt-4o"):
        assert parent_of(spans[name]) == root.context.span_id, name
    attempt = spans["POST upstream"]
    assert parent_of(attempt) == model_call.context.span_id
    assert parent_of(spans["relay"]) == model_call.context.span_id
    assert attempt.attributes["http.request.resend_count"] == 0

    assert model_call.attributes["gen_ai.operation.name"] == "chat"
    assert model_call.attributes["gen_ai.request.model"] == "gpt-4o"
    assert model_call.attributes["gen_ai.request.max_tokens"] == 50
    assert model_call.attributes["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert (
        model_call.attributes["gen_ai.usage.output_tokens"]
        == (answer["usage"]["completion_tokens"])
    )
    assert model_call.attributes["gen_ai.response.id"] == answer["id"]
    projection = spans["projection"]
    assert projection.attributes["threadkeeper.budget.window"] == 16000
    assert projection.attributes["threadkeeper.budget.prompt_tokens"] > 0

    sent = provider.model_requests[-1].headers["traceparent"]
    assert sent == f"00-{TRACE_ID}-{attempt.context.span_id:016x}-01"


async def test_each_upstream_attempt_is_a_span(
    traced: Proxy, exporter: InMemorySpanExporter, provider: FakeProvider
) -> None:
    provider.script += [Reply(status=500), Reply(text="second try")]
    await post_chat(traced)
    attempts = [s for s in exporter.get_finished_spans() if s.name == "POST upstream"]
    assert [a.attributes["http.request.resend_count"] for a in attempts] == [0, 1]
    assert [a.attributes["http.response.status_code"] for a in attempts] == [500, 200]
    sent = [r.headers["traceparent"].split("-")[2] for r in provider.model_requests]
    assert sent == [f"{a.context.span_id:016x}" for a in attempts]


async def test_a_stored_thread_traces_its_load_and_commit(
    traced: Proxy, exporter: InMemorySpanExporter
) -> None:
    await post_chat(traced, {"X-Thread-Id": "t-traced"})
    spans = by_name(exporter)
    assert spans["thread.load"].attributes["threadkeeper.thread_id"] == "t-traced"
    assert spans["thread.commit"].attributes["threadkeeper.thread.items_added"] == 2
    assert spans["chat gpt-4o"].attributes["gen_ai.conversation.id"] == "t-traced"


async def test_untraced_proxies_send_the_clients_traceparent_as_it_came(
    proxy: Proxy, provider: FakeProvider
) -> None:
    await post_chat(proxy, {"traceparent": TRACEPARENT})
    assert provider.model_requests[-1].headers["traceparent"] == TRACEPARENT


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_tracing_is_configured_the_standard_way(env: dict[str, str], on: bool) -> None:
    tracing = Tracing.from_env(env)
    assert tracing.on is on
    tracing.shutdown()


async def test_a_background_summary_is_a_span_of_the_request_that_started_it(
    make_proxy: Callable[..., Awaitable[Proxy]], exporter: InMemorySpanExporter
) -> None:
    from .test_llm_summaries_e2e import (
        MEMORY,
        SUMMARIZER,
        background,
        summarizer_answer,
        summarizer_requests,
        user_turn,
    )

    tracing = Tracing.with_processor(SimpleSpanProcessor(exporter))
    proxy = await make_proxy(window=5000, memory_extra=MEMORY, tracing=tracing)
    proxy.provider.scripts[SUMMARIZER] = [summarizer_answer() for _ in range(8)]
    client = proxy.client()
    for number in range(30):
        await client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": user_turn(number)}],
            extra_headers={"X-Thread-Id": "t-traced-summary"},
        )
        await background(proxy).idle()
        if summarizer_requests(proxy):
            break
    spans = exporter.get_finished_spans()
    [summary] = [s for s in spans if s.name == f"summarize {SUMMARIZER}"][:1]
    # A summary used (the answer's paraphrased decision is only a note: unverified).
    assert summary.attributes["threadkeeper.summary.outcome"] in ("ok", "guarded", "unverified")
    assert summary.attributes["gen_ai.usage.input_tokens"] > 0
    roots = {s.context.span_id: s for s in spans if s.name == "POST /v1/chat/completions"}
    assert summary.parent is not None and summary.parent.span_id in roots
