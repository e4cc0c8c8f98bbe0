"""The LLM summarizer: one stateless Chat Completions call through the tenant's upstream.

Never on a turn's path: proxy/server/summaries.py runs it in the background and the
projection uses what it stored. A compaction (proxy/server/compaction.py) is the one
request that waits for it, at most `timeout_seconds`, through the same object. The call
goes to the tenant's provider (its base URL and key, as a turn would use them) through
the provider seam a turn uses (proxy/upstream.py: aiohttp, its retry policy with the
tenant's `retry` settings, its key scrubbing), on a pool of the summarizer's own, inside
one overall `timeout_seconds`, which bounds the retries and reading the answer too (its
parsing runs in a thread, off the loop).
What it answers passes proxy/core/llm_summary.py (parse into the memory state, check
it against the chunk, render, guard); anything else is None and the deterministic
digest stands. Every call is logged and counted per tenant, by one outcome:

- ok: used as written; guarded: used with must-keep strings the model left out put
  back; unverified: used, with what the chunk does not bear out only in the
  summarizer's notes (a model steered by text it summarized, or one that paraphrases);
- error (the provider's, or a bug here), timeout (the call and the reading together);
- invalid: the completion is not the shape OpenAI's API gives (not JSON, no choices, a
  message that is null or not an object, content not a string), or it is longer than
  asked: a body past `max_body_bytes` is not read further, an answer past
  `llm_summary.answer_fits` is not parsed; usage that is not token counts is logged and
  counted as zero tokens, and the summary still used;
- unparseable: no answer, or one that is not the state asked for (not JSON, nested past
  the parser's depth, wrong types), or whose must-keep strings do not fit.

>>> summarizer = LlmSummarizer(metrics)  # or LlmSummarizer(metrics, upstream) to share one
>>> written = await summarizer.write(policy, Target(base_url, key), items, counter, 1000)
>>> await summarizer.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import structlog

from proxy.core.items import Item
from proxy.core.llm_summary import (
    ANSWER_SLACK,
    CHARS_PER_TOKEN,
    Written,
    answer_fits,
    summary_from_answer,
    summary_messages,
)
from proxy.core.memory import MemoryState
from proxy.core.models import is_reasoning_model
from proxy.core.tokens import TokenCounter
from proxy.metrics import Metrics
from proxy.policy import Policy
from proxy.tracing import NO_TRACING, Tracing, set_attributes
from proxy.upstream import (
    Deadline,
    RetrySettings,
    Upstream,
    UpstreamRequest,
    UpstreamResponse,
    UpstreamUnavailable,
)

log = structlog.get_logger("threadkeeper.summarizer")

Outcome = Literal["ok", "guarded", "unverified", "error", "timeout", "unparseable", "invalid"]
# The model may spend this many times the summary's size on the JSON it answers with
# (keys, quotes): the call's token limit. The rendering is cut to max_tokens.
ANSWER_ALLOWANCE = 2
POOL_SIZE = 32  # summarizer calls in flight at once, every tenant together
CHAT_PATH = "/chat/completions"


@dataclass(frozen=True)
class Target:
    """Where a tenant's summaries are written: its upstream, with the key a turn uses."""

    base_url: str
    api_key: str = field(repr=False)


class ProviderError(Exception):
    """The provider answered the summarizer call with an error status."""

    def __init__(self, status: int) -> None:
        super().__init__(status_error(status))
        self.status = status


@dataclass(frozen=True)
class Call:
    """One summarizer call: what came of it and what the provider reported."""

    outcome: Outcome
    written: Written | None
    tokens_in: int = 0
    tokens_out: int = 0


class LlmSummarizer:
    """Writes summaries with the tenant's summarizer model. One provider client serves
    every tenant: `upstream` when given (its owner closes it), else a pool of its own,
    opened by the first call and closed by `aclose`."""

    def __init__(
        self,
        metrics: Metrics,
        upstream: Upstream | None = None,
        tracing: Tracing = NO_TRACING,
    ) -> None:
        self.metrics = metrics
        self._upstream = upstream
        self._owns_upstream = upstream is None
        self.tracing = tracing

    @property
    def upstream(self) -> Upstream:
        """The provider client; a proxy with no summarizer configured never opens one."""
        if self._upstream is None:
            self._upstream = Upstream(pool_size=POOL_SIZE)
        return self._upstream

    async def write(
        self,
        policy: Policy,
        target: Target,
        items: Sequence[Item],
        counter: TokenCounter,
        max_tokens: int,
        previous: Item | None = None,
        base: MemoryState | None = None,
    ) -> Written | None:
        """The guarded LLM summary of `items` (following `previous`, rendered from
        `base` when given: llm_summary.summary_from_answer) in at most max_tokens and the
        policy's own max_tokens, or None (the deterministic digest stands)."""
        settings = policy.memory.summarizer
        model = settings.model if settings is not None else ""
        attributes: dict[str, str | int] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": model,
            "threadkeeper.summary.items": len(items),
        }
        with self.tracing.span(f"summarize {model}", attributes, kind="client") as span:
            started = time.perf_counter()
            try:
                call = await self._call(policy, target, items, counter, max_tokens, previous, base)
            except Exception:  # a bug, not an answer: still one counted call
                log.exception("summarizer_failed", tenant=policy.tenant)
                call = Call("error", None)
            self._observe(policy, call, time.perf_counter() - started, len(items))
            set_attributes(
                span,
                {
                    "threadkeeper.summary.outcome": call.outcome,
                    "gen_ai.usage.input_tokens": call.tokens_in,
                    "gen_ai.usage.output_tokens": call.tokens_out,
                },
            )
        return call.written

    async def _call(
        self,
        policy: Policy,
        target: Target,
        items: Sequence[Item],
        counter: TokenCounter,
        max_tokens: int,
        previous: Item | None,
        base: MemoryState | None = None,
    ) -> Call:
        settings = policy.memory.summarizer
        assert settings is not None
        asked = settings.max_tokens * ANSWER_ALLOWANCE
        request = summary_request(
            target,
            settings.model,
            summary_messages(items, settings.instructions, previous),
            asked,
            Deadline.after(settings.timeout_seconds),
        )
        # One deadline for the call and for reading its answer: a compaction waits for both.
        deadline = asyncio.get_running_loop().time() + settings.timeout_seconds
        retry = RetrySettings(**policy.retry.model_dump())  # the same fields
        try:
            async with asyncio.timeout_at(deadline):
                body = await self._fetch(request, retry, max_body_bytes(asked))
        except TimeoutError:
            return Call("timeout", None)
        except UpstreamUnavailable as exc:
            if exc.status == 504:  # the request's deadline, or a read that timed out
                return Call("timeout", None)
            log.warning("summarizer_error", tenant=policy.tenant, error=CONNECTION_ERROR)
            return Call("error", None)
        except ProviderError as exc:
            log.warning("summarizer_error", tenant=policy.tenant, error=status_error(exc.status))
            return Call("error", None)
        if body is None:
            log.warning("summarizer_invalid", tenant=policy.tenant, problem="body too large")
            return Call("invalid", None)
        limit = min(max_tokens, settings.max_tokens)
        tokens = (0, 0)
        try:
            async with asyncio.timeout_at(deadline):
                # Parsing, checking against the chunk, guarding: not on the loop.
                completion = await asyncio.to_thread(_parsed, body)
                usage = _usage(completion)
                if usage is None:
                    log.warning("summarizer_invalid", tenant=policy.tenant, problem="usage")
                tokens = usage or (0, 0)
                answer = _answer(completion)
                if answer is None:
                    problem = "not a chat completion"
                    log.warning("summarizer_invalid", tenant=policy.tenant, problem=problem)
                    return Call("invalid", None, *tokens)
                outcome, written = await asyncio.to_thread(
                    _read, answer, asked, items, counter, limit, previous, base
                )
        except TimeoutError:
            return Call("timeout", None, *tokens)
        if outcome == "invalid":
            log.warning("summarizer_invalid", tenant=policy.tenant, problem="answer too long")
        return Call(outcome, written, *tokens)

    async def _fetch(
        self, request: UpstreamRequest, retry: RetrySettings, limit: int
    ) -> bytes | None:
        """The answer's body, None past `limit` bytes (the rest is not read: streamed, so a
        huge body is neither read whole nor parsed on the loop); ProviderError for an
        answer that is not a 2xx once the retries are spent."""
        response = await self.upstream.send(request, retry)
        try:
            if not 200 <= response.status < 300:
                raise ProviderError(response.status)
            return await _body(response, limit)
        finally:
            await response.aclose()

    def _observe(self, policy: Policy, call: Call, seconds: float, items: int) -> None:
        tenant = policy.tenant
        self.metrics.summarizer_calls.labels(tenant, call.outcome).inc()
        self.metrics.summarizer_tokens.labels(tenant, "in").inc(call.tokens_in)
        self.metrics.summarizer_tokens.labels(tenant, "out").inc(call.tokens_out)
        assert policy.memory.summarizer is not None
        log.info(
            "summarizer_call",
            tenant=tenant,
            model=policy.memory.summarizer.model,
            outcome=call.outcome,
            items=items,
            tokens_in=call.tokens_in,
            tokens_out=call.tokens_out,
            appended=len(call.written.appended) if call.written is not None else 0,
            unverified=len(call.written.unverified) if call.written is not None else 0,
            latency_ms=round(seconds * 1000, 3),
        )

    async def aclose(self) -> None:
        if self._owns_upstream and self._upstream is not None:
            await self._upstream.aclose()


def summary_request(
    target: Target, model: str, messages: Any, asked: int, deadline: Deadline
) -> UpstreamRequest:
    """The stateless Chat Completions call: the chunk, JSON mode, the answer's limit;
    nothing of the client's turn. The provider key is scrubbed wherever it is echoed."""
    body = {
        "model": model,
        "messages": messages,
        "response_format": {"type": "json_object"},
        **answer_limits(model, asked),
    }
    headers = {
        "authorization": f"Bearer {target.api_key}",
        "content-type": "application/json",
        "accept": "application/json",
    }
    return UpstreamRequest(
        "POST",
        target.base_url.rstrip("/") + CHAT_PATH,
        headers,
        json.dumps(body).encode(),
        stream=True,
        deadline=deadline,
        secrets=(target.api_key,),
    )


def _parsed(body: bytes) -> Any:
    """The completion's JSON; None when the body is not JSON (then it is no completion)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _read(
    answer: str,
    asked: int,
    items: Sequence[Item],
    counter: TokenCounter,
    limit: int,
    previous: Item | None,
    base: MemoryState | None,
) -> tuple[Outcome, Written | None]:
    """What came of an answer: too long for what was asked (invalid, not parsed); none,
    not the state asked for, or without room for its must-keep strings (unparseable);
    or the summary and how it was used."""
    if not answer_fits(answer, counter, asked):
        return "invalid", None
    written = summary_from_answer(answer, items, counter, limit, previous, base) if answer else None
    if written is None:
        return "unparseable", None
    if written.unverified:
        return "unverified", written
    return ("guarded" if written.appended else "ok"), written


async def _body(response: UpstreamResponse, limit: int) -> bytes | None:
    """The response body, or None past `limit` bytes (the rest is not read)."""
    chunks: list[bytes] = []
    size = 0
    # aiter_bytes is an async generator (typed as an iterator): closed here, not by the GC.
    chunks_of = cast(AsyncGenerator[bytes], response.aiter_bytes())
    async with contextlib.aclosing(chunks_of) as body:
        async for chunk in body:
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
    return b"".join(chunks)


def max_body_bytes(asked: int) -> int:
    """The largest completion body an answer of `asked` tokens can come in: what
    `answer_fits` lets through, each character escaped (\\uXXXX twice, outside the
    basic plane), and the envelope around it."""
    return asked * ANSWER_SLACK * CHARS_PER_TOKEN * 12 + ENVELOPE_BYTES


ENVELOPE_BYTES = 64 * 1024


def _answer(completion: Any) -> str | None:
    """The answer's text ("" for none: content null), or None when the completion is not
    the shape OpenAI's API gives (no choices, a message that is not an object, content
    that is neither a string nor null)."""
    choices = completion.get("choices") if isinstance(completion, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    if content is None:
        return ""
    return content if isinstance(content, str) else None


def _usage(completion: Any) -> tuple[int, int] | None:
    """(prompt, completion) tokens the provider reported: (0, 0) without usage; None
    when they are not non-negative integers."""
    usage = completion.get("usage") if isinstance(completion, dict) else None
    if usage is None:
        return (0, 0)
    if not isinstance(usage, dict):
        return None
    counts = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
    if all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 53 for n in counts):
        return counts  # type: ignore[return-value]
    return None


def answer_limits(model: str, max_tokens: int) -> dict[str, Any]:
    """The length limit and sampling of a summarizer call, by model family: OpenAI's
    reasoning models take `max_completion_tokens` and only the default temperature;
    every other model gets `max_tokens` and temperature 0, which other providers behind
    an OpenAI-compatible API know (some do not know `max_completion_tokens`)."""
    if is_reasoning_model(model):
        return {"max_completion_tokens": max_tokens}
    return {"max_tokens": max_tokens, "temperature": 0}


# What the log calls a failed call: the names the openai SDK gave these errors, which this
# module used before it went through proxy/upstream.py, so the log reads as it did.
CONNECTION_ERROR = "APIConnectionError"
STATUS_ERRORS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
}


def status_error(status: int) -> str:
    """What went wrong, by the provider's status (never the request: it quotes the key)."""
    name = STATUS_ERRORS.get(status)
    if name is None:
        name = "InternalServerError" if status >= 500 else "APIStatusError"
    return f"{name} {status}"
