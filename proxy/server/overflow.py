"""A provider's context-length refusal (SPEC round 3): read it, learn from it, and say
what the client gets when the turn cannot be made to fit. The retry itself is a step of
the request path (proxy/server/turn.py, `_forward`): once, before any byte reaches the
client, under a budget strictly smaller than what was refused."""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from aiohttp import web

from proxy.core.budget import Learned, Sample, calibrated, corrected_window, learned_from_refusal
from proxy.core.projection import ProjectionReport
from proxy.core.provider_errors import Overflow, ProviderError, read_provider_error
from proxy.core.tokens import TokenCounter
from proxy.counting import calibrated_counter, raw_count
from proxy.server.errors import ApiError
from proxy.server.explain import provider_error
from proxy.server.model_budget import model_window
from proxy.server.rebuild import learned_key
from proxy.server.state import LEARNED, LOG_FIELDS, METRICS, TENANT_POLICY
from proxy.server.validate import JsonDict
from proxy.upstream import UpstreamResponse

overflow_log = structlog.get_logger("threadkeeper.overflow")

CODE = "context_length_exceeded"


@dataclass(frozen=True)
class Refusal:
    error: ProviderError
    overflow: Overflow
    shown: JsonDict  # what the log line and the explain record keep (explain.provider_error)


async def context_refusal(upstream: UpstreamResponse) -> Refusal | None:
    """The provider's answer when it refuses the request for its length. Error bodies are
    read whole before `send()` returns (proxy/upstream.py), so this waits on nothing."""
    if upstream.status < 400:
        return None
    body = await upstream.aread()
    content_type = upstream.provider_headers.get("content-type", "")
    error = read_provider_error(upstream.status, content_type, body)
    if error.overflow is None:
        return None
    return Refusal(error, error.overflow, provider_error(upstream.status, body))


def learn(
    request: web.Request,
    model: str,
    overflow: Overflow,
    report: ProjectionReport,
    base: TokenCounter,
    items: int,
) -> Learned:
    """The provider's window and its count against the proxy's, kept for the model's next
    budgets (proxy/server/model_budget.py). `base`: the counter of the refused projection,
    uncorrected; `items`: how many items it sent."""
    limits = request.app[LEARNED]
    key = learned_key(request, model)
    before = limits.get(key)
    learned = learned_from_refusal(
        before,
        window=overflow.window,
        provider_prompt=overflow.prompt_tokens,
        completion=overflow.completion_tokens,
        estimate=report.prompt_tokens,
        output=report.output,
    )
    if overflow.prompt_tokens and items > 0:
        # The refusal's own count is a sample like any answer's usage: the correction
        # fitted next bounds it too.
        counter = calibrated_counter(base, before)
        estimate = raw_count(counter, report.prompt_tokens, items)
        if estimate > 0:
            learned = calibrated(learned, Sample(estimate, items, overflow.prompt_tokens))
    limits.put(key, learned)
    overflow_log.info(
        "provider_context_refusal",
        model=model,
        window=overflow.window,
        provider_prompt_tokens=overflow.prompt_tokens,
        estimated_prompt_tokens=report.prompt_tokens,
        learned_window=learned.window,
        learned_ratio=round(learned.ratio, 4),
    )
    return learned


def retry_window(
    request: web.Request, model: str, learned: Learned, overflow: Overflow, report: ProjectionReport
) -> int:
    """W for the retry: the policy's window corrected by what was learnt, and in any case
    strictly less than what was refused (its prompt at least one token smaller)."""
    window = model_window(request[TENANT_POLICY], model, learned)[0]
    corrected = corrected_window(
        window, report.output, learned, provider_output=overflow.completion_tokens or 0
    )
    return min(corrected, report.prompt_tokens - 1 + report.output + report.epsilon)


def observe(request: web.Request, route: str, outcome: str, **facts: object) -> None:
    """The metric, and what the log line and the explain record say of the retry."""
    request.app[METRICS].overflow_retries.labels(route, outcome).inc()
    request[LOG_FIELDS]["overflow_retry"] = {"outcome": outcome, **facts}


def cannot_fit(error: ProviderError, exc: ApiError) -> ApiError:
    """The turn's pinned text and current turn do not fit the window the provider states."""
    return ApiError(
        400,
        f"The provider refused this request for its length ({error.message.rstrip('.')}). "
        f"Under the window it states: {exc.message}",
        param=exc.param,
        code=CODE,
    )


def refused_again(error: ProviderError, report: ProjectionReport, param: str) -> ApiError:
    """The retry, smaller, was refused too: the client gets the breakdown of what was sent."""
    return ApiError(
        400,
        f"The provider refused this request for its length even after its history was "
        f"reduced to {report.prompt_tokens} tokens by the proxy's count (pinned "
        f"{report.system}, tools {report.tools}, current turn {report.current}, history "
        f"{report.history_after}, output reserve {report.output}): "
        f"{error.message}",
        param=param,
        code=CODE,
    )
