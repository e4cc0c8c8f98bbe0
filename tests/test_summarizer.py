"""The LLM summarizer's call through the tenant's upstream (proxy/summarizer.py): the
upstream is a small aiohttp app on port 0 that answers from a script, so the call goes
through proxy/upstream.py as in production."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from proxy.core import memory
from proxy.core.tokens import TokenCounter
from proxy.metrics import Metrics
from proxy.policy import Policy
from proxy.summarizer import CHAT_PATH, LlmSummarizer, Target, answer_limits
from proxy.upstream import RetrySettings, Upstream, UpstreamRequest
from tests.core.test_llm_summary import REFUND, RULE, good_answer, support_items
from tests.test_upstream import Handler, Provider, provider
from tests.test_upstream import reply as upstream_reply

__all__ = ["provider"]  # test_upstream's fixture, used here: the tenant's upstream

KEY = "sk-tenant-provider-key-0123456789"


def policy(**summarizer: Any) -> Policy:
    settings = {"model": "gpt-4.1-mini", "max_tokens": 600, "timeout_seconds": 5, **summarizer}
    return Policy.model_validate(
        {
            "tenant": "acme",
            "memory": {"summarizer": settings},
            "retry": {"max_attempts": 2, "initial_backoff": 0.01, "max_backoff": 0.01},
        }
    )


def reply(status: int, body: bytes, content_type: str = "application/json") -> Handler:
    return upstream_reply(status, body, {"content-type": content_type})


def as_json(status: int, value: Any) -> Handler:
    return reply(status, json.dumps(value).encode())


def completion_body(content: str | None, prompt: int = 321, answer: int = 54) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4.1-mini",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": content},
            }
        ],
        "usage": {"prompt_tokens": prompt, "completion_tokens": answer, "total_tokens": 1},
    }


def completion(content: str | None, prompt: int = 321, answer: int = 54) -> Handler:
    return as_json(200, completion_body(content, prompt, answer))


@pytest.fixture
async def summarizer() -> AsyncIterator[LlmSummarizer]:
    summarizer = LlmSummarizer(Metrics())
    yield summarizer
    await summarizer.aclose()


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o-mini")


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = metrics.render()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def calls(metrics: Metrics, outcome: str) -> float:
    key = ("threadkeeper_summarizer_calls_total", (("outcome", outcome), ("tenant", "acme")))
    return samples(metrics).get(key, 0.0)


async def write(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider, **settings: Any
) -> Any:
    return await summarizer.write(
        policy(**settings),
        Target(provider.url.removesuffix(CHAT_PATH), KEY),
        support_items(),
        counter,
        1000,
    )


async def test_a_good_answer_is_used_and_the_call_is_stateless_chat_completions(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider
) -> None:
    provider.script = [completion(good_answer())]
    with capture_logs() as logs:
        written = await write(summarizer, counter, provider, instructions="Keep ticket numbers.")
    assert written is not None and written.appended == ()
    request = provider.calls[-1]
    assert request.path_qs == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {KEY}"
    body = json.loads(request.body)
    assert body["model"] == "gpt-4.1-mini"
    assert body["response_format"] == {"type": "json_object"}
    assert body["max_tokens"] == 1200  # twice the summary's size, for the JSON around it
    assert body["messages"][0]["content"].endswith("Keep ticket numbers.")
    assert "store" not in body and "tools" not in body  # nothing of the client's turn
    metrics = summarizer.metrics
    assert calls(metrics, "ok") == 1
    tokens = samples(metrics)
    assert (
        tokens[("threadkeeper_summarizer_tokens_total", (("direction", "in"), ("tenant", "acme")))]
        == 321
    )
    assert (
        tokens[("threadkeeper_summarizer_tokens_total", (("direction", "out"), ("tenant", "acme")))]
        == 54
    )
    logged = [entry for entry in logs if entry["event"] == "summarizer_call"]
    assert logged[0]["outcome"] == "ok" and logged[0]["tokens_in"] == 321
    assert KEY not in json.dumps(logs, default=str)


@pytest.mark.parametrize("model", ["o1", "o3-mini", "o4-mini", "gpt-5-mini"])
async def test_a_reasoning_model_gets_max_completion_tokens_and_its_default_temperature(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider, model: str
) -> None:
    """OpenAI's reasoning models answer 400 to `max_tokens` and to a temperature other
    than the default: the call must not carry either, or every summary falls back."""
    provider.script = [completion(good_answer())]
    written = await write(summarizer, counter, provider, model=model)
    assert written is not None
    body = json.loads(provider.calls[-1].body)
    assert body["model"] == model
    assert body["max_completion_tokens"] == 1200
    assert "max_tokens" not in body and "temperature" not in body


async def test_another_model_keeps_max_tokens_and_temperature_zero(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider
) -> None:
    """Providers other than OpenAI behind the same API may not know
    `max_completion_tokens`: a non-reasoning model keeps `max_tokens`."""
    provider.script = [completion(good_answer())]
    assert await write(summarizer, counter, provider, model="gpt-4o-mini") is not None
    body = json.loads(provider.calls[-1].body)
    assert body["max_tokens"] == 1200 and body["temperature"] == 0
    assert "max_completion_tokens" not in body


@pytest.mark.parametrize(
    ("model", "limits"),
    [
        ("o1", {"max_completion_tokens": 10}),
        ("o3", {"max_completion_tokens": 10}),
        ("o4-mini-2025-04-16", {"max_completion_tokens": 10}),
        ("gpt-5", {"max_completion_tokens": 10}),
        ("gpt-4o-mini", {"max_tokens": 10, "temperature": 0}),
        ("gpt-4.1", {"max_tokens": 10, "temperature": 0}),
        ("llama-3.1-70b", {"max_tokens": 10, "temperature": 0}),
    ],
)
def test_answer_limits_by_model_family(model: str, limits: dict[str, int]) -> None:
    assert answer_limits(model, 10) == limits


@pytest.mark.parametrize(
    ("changes", "dropped", "outcome"),
    [
        # The paraphrased decision is the model's own: only a note, counted as unverified.
        (
            {"entities": ["100 EUR"], "decisions": ["A refund was approved."], "facts": []},
            REFUND,
            "unverified",
        ),
        ({"constraints": []}, RULE, "guarded"),
    ],
)
async def test_an_answer_that_drops_must_keep_facts_is_guarded(
    summarizer: LlmSummarizer,
    counter: TokenCounter,
    provider: Provider,
    changes: dict[str, Any],
    dropped: str,
    outcome: str,
) -> None:
    provider.script = [completion(good_answer(**changes))]
    written = await write(summarizer, counter, provider)
    assert written is not None and dropped in written.appended
    assert all(kept in written.item.text() for kept in memory.must_keep(support_items()))
    assert calls(summarizer.metrics, outcome) == 1


@pytest.mark.parametrize(
    "content",
    ["The refund was approved and the customer is happy.", '{"constraints": [', None, "{}"],
)
async def test_prose_invalid_json_or_no_answer_keeps_the_digest(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider, content: str | None
) -> None:
    provider.script = [completion(content)]
    assert await write(summarizer, counter, provider) is None
    assert calls(summarizer.metrics, "unparseable") == 1


async def test_a_provider_that_never_answers_times_out(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider
) -> None:
    async def hang(request: web.Request) -> web.StreamResponse:
        await provider.release.wait()
        raise AssertionError("unreachable")

    provider.script = [hang]
    assert await write(summarizer, counter, provider, timeout_seconds=0.05) is None
    assert calls(summarizer.metrics, "timeout") == 1


async def test_retries_are_bounded_by_the_tenant_policy(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider
) -> None:
    provider.script = [as_json(500, {"error": {}})]
    with capture_logs() as logs:
        assert await write(summarizer, counter, provider) is None
    assert len(provider.calls) == 2  # retry.max_attempts
    assert calls(summarizer.metrics, "error") == 1
    assert [e["error"] for e in logs if e["event"] == "summarizer_error"] == [
        "InternalServerError 500"
    ]


async def test_a_500_then_an_answer_is_retried(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider
) -> None:
    provider.script = [as_json(500, {"error": {}}), completion(good_answer())]
    assert await write(summarizer, counter, provider) is not None
    assert len(provider.calls) == 2 and calls(summarizer.metrics, "ok") == 1


@pytest.mark.parametrize(
    ("status", "logged"),
    [(400, "BadRequestError 400"), (401, "AuthenticationError 401"), (418, "APIStatusError 418")],
)
async def test_a_refusal_is_not_retried_and_is_logged_by_its_status(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider, status: int, logged: str
) -> None:
    provider.script = [as_json(status, {"error": {"message": f"no, {KEY}"}})]
    with capture_logs() as logs:
        assert await write(summarizer, counter, provider) is None
    assert len(provider.calls) == 1 and calls(summarizer.metrics, "error") == 1
    assert [e["error"] for e in logs if e["event"] == "summarizer_error"] == [logged]
    assert KEY not in json.dumps(logs, default=str)


# --- hostile answers (issue 20, item 5): each a counted outcome, never a traceback ---------


def hostile(**changes: Any) -> Handler:
    """A chat completion with some of its fields replaced."""
    body = completion_body(good_answer())
    for path, value in changes.items():
        target = body
        *parents, last = path.split("__")
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[last] = value
    return as_json(200, body)


@pytest.mark.parametrize(
    ("response", "outcome"),
    [
        (hostile(choices__0__message=None), "invalid"),
        (hostile(choices__0__message="the summary"), "invalid"),
        (hostile(choices=[]), "invalid"),
        (hostile(choices=None), "invalid"),
        (hostile(choices__0__message__content={"constraints": []}), "invalid"),
        (hostile(choices__0__message__content=["a", "b"]), "invalid"),
        (as_json(200, ["not", "a", "completion"]), "invalid"),
        (reply(200, b"<html>busy</html>", "text/html"), "invalid"),
        (reply(200, b"[" * 100_000), "invalid"),
        (reply(200, b'{"choices": "' + b"x" * 5_000_000 + b'"}'), "invalid"),
        # Nested past the parser's depth: within the answer's limit, then past it.
        (hostile(choices__0__message__content="[" * 2_000 + "]" * 2_000), "unparseable"),
        (hostile(choices__0__message__content="[" * 200_000 + "]" * 200_000), "invalid"),
        (
            hostile(
                choices__0__message__content=json.dumps(
                    {"constraints": [f"Never do thing {n}." for n in range(5_000)]}
                )
            ),
            "invalid",
        ),
        (hostile(choices__0__message__content='{"constraints": "never"}'), "unparseable"),
    ],
)
async def test_a_hostile_answer_is_a_counted_outcome(
    summarizer: LlmSummarizer,
    counter: TokenCounter,
    provider: Provider,
    response: Handler,
    outcome: str,
) -> None:
    provider.script = [response]
    with capture_logs() as logs:
        assert await write(summarizer, counter, provider) is None
    assert calls(summarizer.metrics, outcome) == 1
    assert sum(calls(summarizer.metrics, o) for o in OUTCOMES) == 1
    assert not [e for e in logs if e.get("log_level") in ("error", "critical")], logs


OUTCOMES = ("ok", "guarded", "unverified", "error", "timeout", "unparseable", "invalid")


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": "lots", "completion_tokens": 54, "total_tokens": 1},
        {"prompt_tokens": -1, "completion_tokens": 54, "total_tokens": 1},
        {"prompt_tokens": True, "completion_tokens": None, "total_tokens": 1},
        "lots",
    ],
)
async def test_usage_that_is_not_token_counts_keeps_the_summary(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider, usage: Any
) -> None:
    """The summary was written and then thrown away by a TypeError counting its tokens."""
    provider.script = [hostile(usage=usage)]
    with capture_logs() as logs:
        written = await write(summarizer, counter, provider)
    assert written is not None
    assert calls(summarizer.metrics, "ok") == 1
    tokens = samples(summarizer.metrics)
    key = ("threadkeeper_summarizer_tokens_total", (("direction", "in"), ("tenant", "acme")))
    assert tokens.get(key, 0.0) == 0
    assert [e["problem"] for e in logs if e["event"] == "summarizer_invalid"] == ["usage"]


async def test_reading_the_answer_is_inside_the_timeout(
    summarizer: LlmSummarizer,
    counter: TokenCounter,
    provider: Provider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guard's work ran after the timeout, unbounded: a compaction waited for it."""
    import threading

    from proxy import summarizer as module

    reading = threading.Event()
    done = threading.Event()

    def slow(*args: Any) -> Any:
        reading.set()
        done.wait(30)  # released below; bounded against a hang
        return None

    monkeypatch.setattr(module, "summary_from_answer", slow)
    provider.script = [completion(good_answer())]
    try:
        assert await write(summarizer, counter, provider, timeout_seconds=0.5) is None
        assert reading.is_set()
        assert calls(summarizer.metrics, "timeout") == 1
        tokens = samples(summarizer.metrics)
        key = ("threadkeeper_summarizer_tokens_total", (("direction", "in"), ("tenant", "acme")))
        assert tokens[key] == 321  # the call was made and paid for
    finally:
        done.set()


async def test_an_unexpected_failure_is_still_one_counted_call(
    summarizer: LlmSummarizer,
    counter: TokenCounter,
    provider: Provider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proxy import summarizer as module

    def broken(*args: Any) -> Any:
        raise IndexError("a bug")

    monkeypatch.setattr(module, "summary_from_answer", broken)
    provider.script = [completion(good_answer())]
    with capture_logs() as logs:
        assert await write(summarizer, counter, provider) is None
    assert calls(summarizer.metrics, "error") == 1
    assert [e["event"] for e in logs if e.get("log_level") == "error"] == ["summarizer_failed"]


async def test_an_injected_answer_is_used_with_its_claims_as_notes_and_counted(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider
) -> None:
    from tests.core.test_llm_summary import INJECTION, injected_answer

    provider.script = [completion(injected_answer())]
    written = await write(summarizer, counter, provider)
    assert written is not None and INJECTION in written.unverified
    assert calls(summarizer.metrics, "unverified") == 1 and calls(summarizer.metrics, "ok") == 0


async def test_a_body_longer_than_any_answer_asked_for_is_not_read_whole(
    summarizer: LlmSummarizer, counter: TokenCounter, provider: Provider
) -> None:
    """Parsed by the SDK on the event loop before; now it stops at max_body_bytes."""
    answer = json.dumps({"constraints": ["x" * 5_000_000]})
    provider.script = [completion(answer)]
    with capture_logs() as logs:
        assert await write(summarizer, counter, provider) is None
    assert calls(summarizer.metrics, "invalid") == 1
    problems = [e["problem"] for e in logs if e["event"] == "summarizer_invalid"]
    assert problems == ["body too large"]


def test_a_summarizer_call_loads_neither_the_sdk_nor_httpx() -> None:
    """The call goes through proxy/upstream.py (aiohttp): neither the openai SDK nor httpx
    is loaded, not even by a call (issue 23: one provider client, resident memory). The
    call here finds no provider (a port just closed) and is counted as an error."""
    code = """
import asyncio, socket, sys
import proxy.server.app
from proxy.core.items import item_of
from proxy.core.tokens import TokenCounter
from proxy.metrics import Metrics
from proxy.policy import Policy
from proxy.summarizer import LlmSummarizer, Target

free = socket.socket()
free.bind(("127.0.0.1", 0))
port = free.getsockname()[1]
free.close()
policy = Policy.model_validate({
    "tenant": "acme", "memory": {"summarizer": {"model": "m", "timeout_seconds": 5}},
    "retry": {"max_attempts": 1},
})
items = [item_of("chat", {"role": "user", "content": "hello"})]

async def main():
    summarizer = LlmSummarizer(Metrics())
    target = Target(f"http://127.0.0.1:{port}/v1", "sk-x")
    written = await summarizer.write(policy, target, items, TokenCounter.for_model("gpt-4o-mini"), 100)
    await summarizer.aclose()
    print(written, sorted(m for m in ("openai", "httpx") if m in sys.modules))

asyncio.run(main())
"""
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    *logged, printed = shown.stdout.strip().splitlines()
    assert printed == "None []", shown.stderr
    assert any("summarizer_error" in line and "APIConnectionError" in line for line in logged)


async def test_a_shared_upstream_is_used_and_left_open_for_its_owner(
    counter: TokenCounter, provider: Provider
) -> None:
    upstream = Upstream()
    try:
        summarizer = LlmSummarizer(Metrics(), upstream)
        provider.script = [completion(good_answer())]
        assert await write(summarizer, counter, provider) is not None
        assert summarizer.upstream is upstream and upstream.connections_in_use() == 0
        await summarizer.aclose()
        again = await upstream.send(UpstreamRequest("GET", provider.url, {}), RetrySettings())
        assert again.status == 200 and len(provider.calls) == 2
    finally:
        await upstream.aclose()
