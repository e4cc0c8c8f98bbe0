"""OpenTelemetry traces, off unless configured the standard way.

Set `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) and every
request becomes a trace: one server span per request, with child spans for auth, the
thread load, the projection, summarizer calls, the model call (`chat gpt-4o`, with the
OpenTelemetry GenAI attributes), each upstream attempt, the relay and the commit. An
incoming `traceparent` is the parent, and each upstream attempt sends its own
`traceparent` to the provider. The exporter reads the usual `OTEL_*` variables itself
(headers, protocol, timeouts); `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`
turns tracing off again.

Off, `Tracing.span` returns one shared empty context manager: the request path pays an
attribute check per span, and the SDK is never imported.

    tracing = Tracing.from_env(os.environ)
    with tracing.span("projection", {"threadkeeper.budget.window": 128000}) as span:
        ...
        set_attributes(span, {"threadkeeper.budget.history_after": 4100})
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

SERVICE_NAME = "threadkeeper"
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")

_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()

Attributes = Mapping[str, str | int | float | bool]
Kind = Literal["internal", "server", "client"]


class Tracing:
    """The app's tracer, or nothing at all."""

    def __init__(self, tracer: Tracer | None = None, provider: TracerProvider | None = None):
        self.tracer = tracer
        self.provider = provider

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Tracing:
        """On when an OTLP endpoint is configured and the SDK is not disabled."""
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls()
        if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
            return cls()
        if not any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES):
            return cls()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        return cls.with_processor(BatchSpanProcessor(OTLPSpanExporter()), env)

    @classmethod
    def with_processor(cls, processor: Any, env: Mapping[str, str] | None = None) -> Tracing:
        """Tracing into `processor` (tests pass a SimpleSpanProcessor over an
        InMemorySpanExporter)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        name = (env or {}).get("OTEL_SERVICE_NAME") or SERVICE_NAME
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        provider.add_span_processor(processor)
        return cls(provider.get_tracer("threadkeeper"), provider)

    @property
    def on(self) -> bool:
        return self.tracer is not None

    def span(
        self,
        name: str,
        attributes: Attributes | None = None,
        *,
        kind: Kind = "internal",
        parent_headers: Mapping[str, str] | None = None,
    ) -> contextlib.AbstractContextManager[Span | None]:
        """A child of the current span (or of the `traceparent` in `parent_headers`)."""
        if self.tracer is None:
            return _OFF
        return self._span(name, attributes, kind, parent_headers)

    @contextlib.contextmanager
    def _span(
        self,
        name: str,
        attributes: Attributes | None,
        kind: Kind,
        parent_headers: Mapping[str, str] | None,
    ) -> Iterator[Span]:
        from opentelemetry.trace import SpanKind

        assert self.tracer is not None
        context = None
        if parent_headers is not None:
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            context = TraceContextTextMapPropagator().extract(dict(parent_headers))
        with self.tracer.start_as_current_span(
            name, context=context, kind=getattr(SpanKind, kind.upper()), attributes=attributes
        ) as span:
            yield span

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """The current span as `traceparent` (and `tracestate`) in outgoing headers."""
        if self.tracer is None:
            return
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        TraceContextTextMapPropagator().inject(headers)

    def shutdown(self) -> None:
        """Flush what is buffered (the process is stopping)."""
        if self.provider is not None:
            self.provider.shutdown()


NO_TRACING = Tracing()


def set_attributes(span: Span | None, attributes: Mapping[str, Any]) -> None:
    """Sets the attributes that have a value (None is skipped: OTel rejects it)."""
    if span is None:
        return
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(key, value)


# --- OpenTelemetry GenAI semantic conventions ------------------------------------------------

OUTPUT_LIMIT_KEYS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def genai_request(body: Mapping[str, Any], conversation: str | None) -> dict[str, Any]:
    """gen_ai.* attributes of a Chat Completions or Responses request body."""
    limit = next((body[k] for k in OUTPUT_LIMIT_KEYS if isinstance(body.get(k), int)), None)
    return {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": _text(body.get("model")),
        "gen_ai.request.max_tokens": limit,
        "gen_ai.request.temperature": _number(body.get("temperature")),
        "gen_ai.request.top_p": _number(body.get("top_p")),
        "gen_ai.conversation.id": conversation,
    }


def genai_response(answer: Mapping[str, Any]) -> dict[str, Any]:
    """gen_ai.* attributes of a provider's answer (a Chat completion or a Response)."""
    usage = answer.get("usage")
    usage = usage if isinstance(usage, Mapping) else {}
    choices = answer.get("choices")
    if isinstance(choices, list):
        reasons = [c.get("finish_reason") for c in choices if isinstance(c, Mapping)]
    else:
        reasons = [answer.get("status")]
    return {
        "gen_ai.response.id": _text(answer.get("id")),
        "gen_ai.response.model": _text(answer.get("model")),
        "gen_ai.response.finish_reasons": [r for r in reasons if isinstance(r, str)] or None,
        "gen_ai.usage.input_tokens": _count(usage, "prompt_tokens", "input_tokens"),
        "gen_ai.usage.output_tokens": _count(usage, "completion_tokens", "output_tokens"),
    }


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _count(usage: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
