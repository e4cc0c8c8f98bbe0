"""Through the socket: a model whose entry says `tokenizer: provider` is budgeted in the
provider's own tokens, each item counted once by its counting endpoint (issue 21, item 1).

The fake is vLLM-shaped: `POST /tokenize` takes `{"model", "messages"}` and answers
`{"count", "max_model_len", "tokens"}` (vllm/entrypoints/openai/protocol.py,
TokenizeChatRequest / TokenizeResponse), counting 1.35 times o200k plus 14 tokens per
message, the count it also enforces its window with."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from proxy.fake_provider import ContextWindow, FakeProvider, Reply
from proxy.server.state import LEARNED, PROVIDER_COUNTS

from .conftest import Proxy

MODEL = "llama-3-8b"
WINDOW = 6000
ENTRY = f'\n  "{MODEL}": {{context_window: {WINDOW}, max_output_tokens: 1000, tokenizer: provider}}'
WORDS = " ".join(f"fact{i} about the order" for i in range(60))  # ~300 o200k tokens


def heavy(provider: FakeProvider) -> ContextWindow:
    provider.window = ContextWindow(WINDOW, inflation=1.35, per_message=14)
    return provider.window


def tokenize_asks(provider: FakeProvider) -> int:
    return len([r for r in provider.requests if r.path == "/tokenize"])


async def chat_thread(proxy: Proxy, turns: int, thread: str) -> list[int]:
    """`turns` turns of a thread (a client-visible error raises); the provider's count of
    each request it answered."""
    client = proxy.client()
    window = proxy.provider.window
    assert window is not None
    messages: list[Any] = []
    counts = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: {WORDS}"})
        completion = await client.chat.completions.create(
            model=MODEL, messages=messages, extra_headers={"X-Thread-Id": thread}
        )
        messages.append({"role": "assistant", "content": completion.choices[0].message.content})
        counts.append(window.prompt(proxy.provider.model_requests[-1].json))
    return counts


async def test_a_thread_counted_by_the_provider_never_overflows_and_fills_the_window(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(models_extra=ENTRY)
    window = heavy(provider)
    counts = await chat_thread(proxy, 20, "t-provider")
    # Budgeted in the provider's tokens from the first turn: not even one refusal to learn from.
    assert window.refusals == 0
    # Each item asked once, alone (a turn's new user message and the last answer), plus the
    # three probes that measure the template's per-prompt share: never the whole thread again.
    assert tokenize_asks(provider) <= 3 + 2 * 20
    assert max(counts) <= WINDOW - 1000
    fill = sum(counts[-5:]) / 5 / WINDOW
    assert fill >= 0.6  # trimmed, and not over-corrected


async def test_a_provider_without_tokenize_falls_back_and_is_asked_once(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(models_extra=ENTRY)
    heavy(provider)
    provider.counting = "missing"  # a 404, as any server without vLLM's /tokenize
    await chat_thread(proxy, 8, "t-missing")  # any client error would raise here
    assert tokenize_asks(provider) == 1  # remembered: never asked again
    # The calibrated estimate counts instead, learning from every answer's usage.
    learned = proxy.app[LEARNED].get(("acme", provider.base_url, MODEL))  # type: ignore[arg-type]
    assert learned is not None and learned.answers >= 7


async def test_a_tokenize_that_hangs_does_not_hang_the_turn(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(models_extra=ENTRY, upstream_extra=", count_timeout_seconds: 0.2")
    heavy(provider)
    provider.counting = "hang"
    await chat_thread(proxy, 3, "t-hang")  # each turn answered: the count was given up
    assert tokenize_asks(provider) == 1  # the slow provider is left alone afterwards
    assert len(proxy.app[PROVIDER_COUNTS]) == 0


async def test_a_wrong_shaped_answer_falls_back(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(models_extra=ENTRY)
    heavy(provider)
    provider.counting = "garbled"  # a 200 that is no count: a gateway's page
    await chat_thread(proxy, 3, "t-shape")
    assert tokenize_asks(provider) == 1


async def test_a_responses_conversation_is_counted_by_input_tokens(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(models_extra=ENTRY)
    window = heavy(provider)
    client = proxy.client()
    previous = None
    for i in range(12):
        response = await client.responses.create(
            model=MODEL,
            input=f"Question {i}: {WORDS}",
            previous_response_id=previous,
        )
        previous = response.id
    assert window.refusals == 0
    asked = [r for r in provider.requests if r.path == "/v1/responses/input_tokens"]
    assert 3 < len(asked) <= 3 + 2 * 12  # the probes, then each new item once
    assert tokenize_asks(provider) == 0


async def test_an_item_the_template_refuses_alone_is_estimated_and_asked_once(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(models_extra=ENTRY)
    heavy(provider)
    client = proxy.client()
    thread = {"X-Thread-Id": "t-tool"}
    tools: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    messages: list[Any] = [{"role": "user", "content": f"Look it up: {WORDS}"}]
    provider.script += [Reply(tool_calls=[("lookup", "{}")])]
    first = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, extra_headers=thread
    )
    [call] = first.choices[0].message.tool_calls or []
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "found: " + WORDS},
    ]
    for i in range(4):
        completion = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, extra_headers=thread
        )
        messages += [
            {"role": "assistant", "content": completion.choices[0].message.content},
            {"role": "user", "content": f"And {i}?"},
        ]
    lone_tool = [
        r
        for r in provider.requests
        if r.path == "/tokenize" and r.json["messages"][0].get("role") == "tool"
    ]
    assert len(lone_tool) == 1  # refused once (a 400), then left to the estimate


def estimate_of(body: dict[str, Any]) -> int:
    """The o200k estimate of a Responses request, as the proxy counts it without help."""
    return ContextWindow(0).prompt(body)


async def test_input_tokens_is_the_providers_count_before_any_answer(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(models_extra=ENTRY)
    window = heavy(provider)
    client = proxy.client()
    given: Any = [
        {"role": "user", "content": f"Question: {WORDS}"},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "And now?"},
    ]
    counted = await client.responses.input_tokens.count(model=MODEL, input=given)
    body = {"model": MODEL, "input": given}
    truth = window.prompt(body)
    # Each item counted by the provider (instructions would be the estimate's): within a
    # token or two of its whole count, where the estimate alone is a quarter under.
    assert abs(counted.input_tokens - truth) <= 0.02 * truth, (counted.input_tokens, truth)
    assert estimate_of(body) < 0.8 * truth
    assert [r for r in provider.requests if r.path == "/v1/responses/input_tokens"]


async def test_input_tokens_falls_back_to_the_estimate_without_a_counting_endpoint(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(models_extra=ENTRY)
    heavy(provider)
    provider.counting = "missing"
    given: Any = [{"role": "user", "content": f"Question: {WORDS}"}]
    counted = await proxy.client().responses.input_tokens.count(model=MODEL, input=given)
    assert counted.input_tokens == estimate_of({"model": MODEL, "input": given})


async def test_a_compaction_threshold_is_compared_with_the_providers_count(
    make_proxy: Callable[..., Awaitable[Proxy]], provider: FakeProvider
) -> None:
    proxy = await make_proxy(models_extra=ENTRY)
    window = heavy(provider)
    given: Any = []
    for i in range(4):
        given += [
            {"role": "user", "content": f"Question {i}: {WORDS}"},
            {"role": "assistant", "content": f"Noted {i}."},
        ]
    given.append({"role": "user", "content": "And now?"})
    body = {"model": MODEL, "input": given}
    # Over the threshold by the provider's count, under it by the estimate's.
    threshold = (estimate_of(body) + window.prompt(body)) // 2
    answer = await proxy.client().responses.create(
        model=MODEL,
        input=given,
        extra_body={"context_management": [{"type": "compaction", "compact_threshold": threshold}]},
    )
    assert answer.output[0].type == "compaction"
