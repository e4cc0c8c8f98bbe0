"""Model-native counting: hf: tokenizer files made here, mistral-common's shipped ones,
and the policy's `tokenizer:` field that names them (issue 21, item 1)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from tokenizers import Tokenizer

from proxy.core.items import chat_item
from proxy.core.tokens import DEFAULT_TEMPLATE_COST, TokenCounter
from proxy.counting import counter_for
from proxy.native_tokenizers import (
    MISTRAL_VERSIONS,
    TokenizerError,
    load_native,
    mistral_default,
    mistral_release,
)
from proxy.policy import PolicyError, load_policy_file
from tests.tokenizer_files import byte_bpe, template_count, word_level

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather in Paris today?"},
    {"role": "assistant", "content": "It is sunny and 21 degrees in Paris."},
    {"role": "user", "content": "Please tell me the next step for order 42."},
]


def hf_counter(directory: Path) -> TokenCounter:
    return TokenCounter("Qwen/Qwen2.5-7B-Instruct", load_native(f"hf:{directory}", Path("/")))


# -- hf: -------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [word_level, byte_bpe])
def test_hf_counts_a_chat_prompt_as_its_template_renders_it(tmp_path: Path, build) -> None:  # type: ignore[no-untyped-def]
    directory = build(tmp_path / "model")
    counter = hf_counter(directory)
    assert counter.chat_prompt(CONVERSATION) == template_count(directory, CONVERSATION)
    # The o200k estimate it replaces is another number for the same prompt.
    o200k = TokenCounter.for_model("gpt-4o").chat_prompt(CONVERSATION)
    assert o200k != template_count(directory, CONVERSATION)


def test_hf_text_is_the_tokenizers_own_count(tmp_path: Path) -> None:
    directory = byte_bpe(tmp_path / "model")
    real = Tokenizer.from_file(str(directory / "tokenizer.json"))
    text = "Refund order 42, then tell me: is it done? Ünïcode ✓"
    assert hf_counter(directory).text(text) == len(real.encode(text, add_special_tokens=False))


def test_hf_takes_the_file_or_its_directory(tmp_path: Path) -> None:
    directory = word_level(tmp_path / "model")
    by_dir = load_native(f"hf:{directory}", Path("/"))
    by_file = load_native(f"hf:{directory / 'tokenizer.json'}", Path("/"))
    assert by_dir.name == by_file.name
    assert by_dir.name.startswith("hf:")


def test_hf_chat_template_jinja_file_wins_over_the_config(tmp_path: Path) -> None:
    directory = word_level(tmp_path / "model")
    before = load_native(f"hf:{directory}", Path("/"))
    # Llama-3 style: header tokens around the role, two more than ChatML's.
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|><|im_start|>{{ m['role'] }}<|im_end|>"
        "{{ m['content'] }}<|im_end|><|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant<|im_end|>{% endif %}"
    )
    after = load_native(f"hf:{directory}", Path("/"))
    assert after.name != before.name  # the identity covers the template
    assert after.message_tokens == before.message_tokens + 3


def test_hf_without_a_template_uses_the_documented_constant(tmp_path: Path) -> None:
    directory = word_level(tmp_path / "model", template=None)
    tokenizer = load_native(f"hf:{directory}", Path("/"))
    assert (tokenizer.message_tokens, tokenizer.reply_tokens) == (
        DEFAULT_TEMPLATE_COST.message_tokens,
        DEFAULT_TEMPLATE_COST.reply_tokens,
    )


def test_a_template_that_raises_falls_back_to_the_constant(tmp_path: Path) -> None:
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    tokenizer = load_native(f"hf:{word_level(tmp_path / 'model', template)}", Path("/"))
    assert tokenizer.message_tokens == DEFAULT_TEMPLATE_COST.message_tokens


def test_a_template_cannot_escape_the_sandbox(tmp_path: Path) -> None:
    template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tokenizer = load_native(f"hf:{word_level(tmp_path / 'model', template)}", Path("/"))
    assert tokenizer.message_tokens == DEFAULT_TEMPLATE_COST.message_tokens  # refused, not run


def test_truncation_saved_in_the_file_does_not_cap_counts(tmp_path: Path) -> None:
    directory = word_level(tmp_path / "model")
    real = Tokenizer.from_file(str(directory / "tokenizer.json"))
    real.enable_truncation(max_length=8)
    real.enable_padding(length=8)
    real.save(str(directory / "tokenizer.json"))
    assert hf_counter(directory).text("word " * 100) == 100


def test_lone_surrogates_and_nul_are_counted_not_raised(tmp_path: Path) -> None:
    counter = hf_counter(byte_bpe(tmp_path / "model"))
    assert counter.text("a\ud800b\x00c") > 0
    assert counter.chat_message({"role": "user", "content": "\udfff" * 3}) > 0


def test_missing_or_broken_hf_files_are_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        load_native(f"hf:{tmp_path / 'nowhere'}", Path("/"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a tokenizers file"):
        load_native(f"hf:{tmp_path / 'broken'}", Path("/"))


# -- the cache is keyed by the tokenizer --------------------------------------------------------


def test_counts_never_cross_tokenizers(tmp_path: Path) -> None:
    hf = hf_counter(byte_bpe(tmp_path / "model"))
    o200k = TokenCounter.for_model("gpt-4o")
    raw = {"role": "user", "content": f"Please summarise order {uuid.uuid4()} today."}
    o200k_count = o200k.item(chat_item(raw))
    assert hf.item(chat_item(raw)) == hf.chat_message(raw) != o200k_count
    # A count stored with the item for o200k_base is not taken for another tokenizer.
    stored = chat_item(raw)
    object.__setattr__(stored, "tokens", o200k_count)
    object.__setattr__(stored, "encoding", "o200k_base")
    assert hf.item(stored) == hf.chat_message(raw)
    assert o200k.item(stored) == o200k_count


def test_tools_count_as_their_json_for_a_native_tokenizer(tmp_path: Path) -> None:
    counter = hf_counter(byte_bpe(tmp_path / "model"))
    tool = {"type": "function", "function": {"name": "refund_order", "parameters": {}}}
    assert counter.tools([tool]) == counter.text(json.dumps(tool)) + counter.tokenizer.tools_tokens


# -- mistral: ---------------------------------------------------------------------------------


def _shipped(version: str) -> MistralTokenizer:
    method, options = MISTRAL_VERSIONS[version]
    return getattr(MistralTokenizer, method)(**options)  # type: ignore[no-any-return]


@pytest.mark.parametrize("version", sorted(MISTRAL_VERSIONS))
def test_mistral_counts_within_its_format_of_mistral_commons_own(version: str) -> None:
    counter = TokenCounter("mistral-large-latest", load_native(f"mistral:{version}", Path("/")))
    request = ChatCompletionRequest.model_validate({"messages": CONVERSATION})
    theirs = len(_shipped(version).encode_chat_completion(request).tokens)
    ours = counter.chat_prompt(CONVERSATION)
    # Errs high, by at most a token per message (the role the counter encodes and
    # mistral's format does not spell out).
    assert theirs <= ours <= theirs + len(CONVERSATION)


@pytest.mark.parametrize(
    ("model", "release", "version"),
    [
        ("mistral-large-2407", "mistral-large-2407", "v3"),  # a release the table lists
        ("mistral-large-latest", "mistral-large-2411", "v7"),  # an alias: the latest listed
        ("mistral-large", "mistral-large-2411", "v7"),
        ("mistral-small-2402", "mistral-small-2402", "v2"),
        ("mistral-small-2501", "mistral-small-2409", "v3-tekken"),  # the latest before it
        ("open-mistral-nemo", "open-mistral-nemo-2407", "v3-tekken"),
        ("codestral-latest", "codestral-2405", "v3"),
        ("mistralai/mistral-large-2407", "mistral-large-2407", "v3"),  # a gateway's prefix
    ],
)
def test_a_mistral_api_name_maps_to_mistral_commons_tokenizer_for_it(
    model: str, release: str, version: str
) -> None:
    from mistral_common.tokens.tokenizers.mistral import MODEL_NAME_TO_TOKENIZER_CLS

    assert mistral_release(model) == release
    native = mistral_default(model)
    assert native is not None and native.name == f"mistral:{version}"
    # The very tokenizer mistral-common builds for that release counts the text.
    theirs = MODEL_NAME_TO_TOKENIZER_CLS[release]().instruct_tokenizer.tokenizer
    text = "Order 4711 shipped on 2024-07-18; refund 12.50 EUR?"
    assert native.count(text) == len(theirs.encode(text, bos=False, eos=False))


@pytest.mark.parametrize(
    "model", ["Mistral-7B-Instruct-v0.3", "open-mistral-7b", "gpt-4o", "llama3.1:8b"]
)
def test_names_mistral_common_does_not_map_keep_the_estimate(model: str) -> None:
    assert mistral_default(model) is None


async def test_a_policy_that_names_no_tokenizer_counts_a_mistral_name_natively(
    tmp_path: Path,
) -> None:
    path = tmp_path / "acme.yaml"
    path.write_text(
        "tenant: acme\napi_keys: []\nmodels:\n"
        '  "*": {context_window: 128000}\n'
        '  "mistral-large-2407": {context_window: 32000}\n'
        '  "codestral-2405": {context_window: 32000, tokenizer: "tiktoken:o200k_base"}\n'
    )
    policy = load_policy_file(path)
    assert (await counter_for(policy, "mistral-large-2407")).tokenizer_id == "mistral:v3"
    assert (await counter_for(policy, "mistral-small-latest")).tokenizer_id == "mistral:v3-tekken"
    # An explicit tokenizer always wins.
    assert (await counter_for(policy, "codestral-2405")).tokenizer_id == "o200k_base"


def test_unknown_mistral_version_is_an_error() -> None:
    with pytest.raises(TokenizerError, match=r"unknown mistral version 'v99' \(shipped: v1"):
        load_native("mistral:v99", Path("/"))


# -- the policy field -------------------------------------------------------------------------


def policy_with(tmp_path: Path, entry: str) -> Path:
    path = tmp_path / "acme.yaml"
    path.write_text(f'tenant: acme\nmodels:\n  "*": {{context_window: 8000}}\n  {entry}\n')
    return path


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("hf:./no-such-model", "no-such-model does not exist"),
        ("mistral:v9", "unknown mistral version 'v9'"),
        ("tiktoken:p50k_base", "unknown tiktoken encoding 'p50k_base'"),
        (
            "sentencepiece:x",
            "expected tiktoken:<encoding>, hf:<path>, mistral:<version> or provider",
        ),
        ("hf:", "expected tiktoken:<encoding>"),
    ],
)
def test_a_bad_tokenizer_is_a_load_error_naming_file_and_field(
    tmp_path: Path, spec: str, problem: str
) -> None:
    path = policy_with(tmp_path, f'qwen: {{context_window: 8192, tokenizer: "{spec}"}}')
    with pytest.raises(PolicyError) as caught:
        load_policy_file(path)
    assert caught.value.file == str(path)
    assert caught.value.field == "models.qwen.tokenizer"
    assert problem in caught.value.problem


def test_an_hf_path_is_relative_to_the_policy_file(tmp_path: Path) -> None:
    word_level(tmp_path / "models" / "qwen")
    path = policy_with(tmp_path, 'Qwen/: {context_window: 8192, tokenizer: "hf:models/qwen"}')
    policy = load_policy_file(path)
    tokenizer = policy.tokenizer_for("Qwen/Qwen2.5-7B-Instruct")  # the prefix entry's
    assert tokenizer is not None
    assert tokenizer.name.startswith("hf:")
    assert policy.tokenizer_for("gpt-4o") is None  # "*" names none: the default rule


def test_tiktoken_names_an_encoding_for_any_model(tmp_path: Path) -> None:
    path = policy_with(
        tmp_path, 'my-gpt4: {context_window: 8192, tokenizer: "tiktoken:cl100k_base"}'
    )
    tokenizer = load_policy_file(path).tokenizer_for("my-gpt4-proxy")
    assert tokenizer is not None
    assert tokenizer.name == "cl100k_base"
