"""`tokenizer: provider` without a socket: the counting endpoints' answers parsed, the
bounded cache and what it remembers of each upstream, and the budget's counter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.core.budget import Learned
from proxy.core.items import chat_item, content_digest
from proxy.core.tokens import TokenCounter
from proxy.counting import ProviderCounter
from proxy.policy import PolicyError, load_policy_file
from proxy.server.model_budget import SLOW_BACKOFF_SECONDS, ProviderCounts, count_in


@pytest.mark.parametrize(
    ("api", "answer", "expected"),
    [
        # vLLM's TokenizeResponse (vllm/entrypoints/openai/protocol.py): count, max_model_len, tokens.
        ("chat", {"count": 3, "max_model_len": 8192, "tokens": [1, 2, 3]}, 3),
        # OpenAI's TokenCountsResource (openapi: POST /responses/input_tokens).
        ("responses", {"object": "response.input_tokens", "input_tokens": 123}, 123),
        ("chat", {"input_tokens": 123}, None),  # the other endpoint's shape
        ("responses", {"count": 3}, None),
        ("chat", {"count": True}, None),
        ("chat", {"count": -1}, None),
        ("chat", {"count": "3"}, None),
        ("chat", ["count", 3], None),
        ("chat", None, None),  # not JSON (a gateway's page)
    ],
)
def test_a_count_is_read_only_from_its_endpoints_shape(
    api: str, answer: Any, expected: int | None
) -> None:
    assert count_in(answer, api) == expected


def test_the_cache_is_bounded_and_keeps_the_recently_used() -> None:
    counts = ProviderCounts(max_entries=2)
    counts.put(("u", "m", "chat", "a"), 1)
    counts.put(("u", "m", "chat", "b"), 2)
    assert counts.get(("u", "m", "chat", "a")) == 1  # a is now the most recent
    counts.put(("u", "m", "chat", "c"), 3)
    assert len(counts) == 2
    assert counts.get(("u", "m", "chat", "b")) is None
    assert counts.get(("u", "m", "chat", "a")) == 1


def test_a_missing_endpoint_is_remembered_per_upstream_and_a_slow_one_for_a_while() -> None:
    now = [0.0]
    counts = ProviderCounts(monotonic=lambda: now[0])
    counts.missing(("http://a/v1", "chat"))
    assert not counts.usable(("http://a/v1", "chat"))
    assert counts.usable(("http://a/v1", "responses"))
    assert counts.usable(("http://b/v1", "chat"))
    counts.slow(("http://b/v1", "chat"))
    assert not counts.usable(("http://b/v1", "chat"))
    now[0] += SLOW_BACKOFF_SECONDS
    assert counts.usable(("http://b/v1", "chat"))
    assert not counts.usable(("http://a/v1", "chat"))  # missing stays missing


def test_the_counter_takes_the_providers_counts_on_the_calibrated_scale() -> None:
    base = TokenCounter.for_model("llama-3-8b")
    known = chat_item({"role": "user", "content": "hello there"}, digest=content_digest({"k": 1}))
    other = chat_item(
        {"role": "user", "content": "general kenobi"}, digest=content_digest({"k": 2})
    )
    learned = Learned(ratio=1.25, overhead=10.0, answers=5)
    counter = ProviderCounter(base, learned, {known.digest: 100}, prompt=25)
    assert counter.item(known) == 80  # 100 provider tokens, in the proxy's scale (/1.25)
    assert counter.item(other) == base.item(other) + learned.item_overhead
    assert counter.reply_tokens == 20
    # Never cached under the estimate's identity, nor a turn's that knew fewer counts.
    fewer = ProviderCounter(base, learned, {}, prompt=25)
    assert len({counter.tokenizer_id, fewer.tokenizer_id, base.tokenizer_id}) == 3
    # Nothing learnt yet: the provider's counts as they are.
    assert ProviderCounter(base, None, {known.digest: 100}, prompt=None).item(known) == 100


def policy(tmp_path: Path, entry: str, upstream: str = "") -> Path:
    path = tmp_path / "acme.yaml"
    path.write_text(
        f'tenant: acme\nupstream: {{base_url: "http://vllm:8000/v1"{upstream}}}\n'
        f'models:\n  "*": {{context_window: 8000}}\n  {entry}\n'
    )
    return path


def test_a_policy_may_name_the_provider_as_tokenizer(tmp_path: Path) -> None:
    loaded = load_policy_file(
        policy(tmp_path, '"Qwen/": {context_window: 8192, tokenizer: provider}')
    )
    assert loaded.counts_with_provider("Qwen/Qwen2.5-7B-Instruct")
    assert not loaded.counts_with_provider("gpt-4o")
    assert loaded.tokenizer_for("Qwen/Qwen2.5-7B-Instruct") is None  # the estimate underneath
    assert loaded.upstream.count_timeout_seconds == 2.0


@pytest.mark.parametrize("seconds", ["0", "-1", "61"])
def test_the_count_timeout_is_bounded(tmp_path: Path, seconds: str) -> None:
    path = policy(
        tmp_path,
        '"Qwen/": {context_window: 8192, tokenizer: provider}',
        f", count_timeout_seconds: {seconds}",
    )
    with pytest.raises(PolicyError) as caught:
        load_policy_file(path)
    assert caught.value.field == "upstream.count_timeout_seconds"
