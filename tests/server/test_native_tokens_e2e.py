"""Through the socket: a model whose policy entry says `tokenizer: hf:<dir>` is budgeted
and counted with that tokenizer and its chat template, as a vLLM server counts it."""

from __future__ import annotations

from pathlib import Path

import httpx

from proxy.fake_provider import ContextWindow, Reply
from proxy.native_tokenizers import load_native
from proxy.server.state import STORE
from tests.server.conftest import TENANT_KEY, Proxy
from tests.tokenizer_files import template_count, word_level

MODEL = "Qwen/Qwen2.5-7B-Instruct"


async def qwen_proxy(make_proxy, tmp_path: Path, window: int = 16000) -> tuple[Proxy, Path]:  # type: ignore[no-untyped-def]
    directory = word_level(tmp_path / "qwen")
    entry = f'\n  "Qwen/": {{context_window: {window}, tokenizer: "hf:{directory}"}}'
    proxy = await make_proxy(models_extra=entry)
    # The fake reports usage as vLLM does: its template's count of what it got.
    proxy.provider.window = ContextWindow(
        10**9, count=lambda body: template_count(directory, body.get("messages") or [])
    )
    return proxy, directory


async def test_input_tokens_is_the_template_count(make_proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    proxy, directory = await qwen_proxy(make_proxy, tmp_path)
    given = [
        {"role": "user", "content": "What is the weather in Paris today?"},
        {"role": "assistant", "content": "It is sunny and 21 degrees in Paris."},
        {"role": "user", "content": "Please tell me the next step for order 42."},
    ]
    counted = await proxy.client().responses.input_tokens.count(
        model=MODEL,
        input=given,
        instructions="Be brief.",  # type: ignore[arg-type]
    )
    provider_count = template_count(directory, [{"role": "system", "content": "Be brief."}, *given])
    assert counted.input_tokens == provider_count
    # An OpenAI model on the same tenant still counts with tiktoken.
    gpt = await proxy.client().responses.input_tokens.count(
        model="gpt-4o",
        input=given,
        instructions="Be brief.",  # type: ignore[arg-type]
    )
    assert gpt.input_tokens != provider_count


async def test_a_chat_thread_is_budgeted_with_the_models_tokenizer(
    make_proxy, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    proxy, directory = await qwen_proxy(make_proxy, tmp_path)
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        for turn in range(3):
            proxy.provider.script.append(Reply(text=f"It is sunny in Paris on day {turn}."))
            answer = await http.post(
                "/chat/completions",
                headers={"Authorization": f"Bearer {TENANT_KEY}", "X-Thread-Id": "paris"},
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"What is the weather {turn}?"}],
                },
            )
            assert answer.status_code == 200, answer.text
            sent = proxy.provider.model_requests[-1].json["messages"]
            # What the proxy budgeted is what the provider's template counts for what it got.
            budgeted = int(answer.headers["x-threadkeeper-context-tokens"])
            assert budgeted == template_count(directory, sent)
    assert len(sent) == 5  # the whole thread was sent: 3 questions, 2 answers
    # Stored counts carry the tokenizer's identity, so no other tokenizer ever reuses them.
    window = await proxy.app[STORE].load_window("acme", "paris")  # type: ignore[index]
    assert window is not None and len(window.items) == 6
    name = load_native(f"hf:{directory}", Path("/")).name
    assert {item.encoding for item in window.items} == {name}
    assert all(item.tokens > 0 for item in window.items)


async def test_the_window_is_enforced_in_the_models_tokens(make_proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The trim follows the model's own count: what is sent always fits the window by the
    # count the provider makes of it.
    proxy, directory = await qwen_proxy(make_proxy, tmp_path, window=1000)
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=30) as http:
        for turn in range(8):
            proxy.provider.script.append(Reply(text="sunny " * 60))
            answer = await http.post(
                "/chat/completions",
                headers={"Authorization": f"Bearer {TENANT_KEY}", "X-Thread-Id": "long"},
                json={
                    "model": MODEL,
                    "max_tokens": 100,
                    "messages": [{"role": "user", "content": f"weather {turn} " + "Paris " * 60}],
                },
            )
            assert answer.status_code == 200, answer.text
            sent = proxy.provider.model_requests[-1].json["messages"]
            real = template_count(directory, sent)
            assert real == int(answer.headers["x-threadkeeper-context-tokens"])
            # W - O - margin (1000 - 100 - 200): never above, whatever the history.
            assert real <= 1000 - 100 - 200
    assert answer.headers["x-threadkeeper-trimmed"] != "dropped=0, compressed=0, summarized=0"
