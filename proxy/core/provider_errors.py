"""A provider's error answer, read: OpenAI's envelope for the client, and the overflow it
states (SPEC round 3: a context-length refusal is retried once under the budget it
states; provider error bodies reach clients in OpenAI's envelope).

Providers disagree on both. vLLM answered with a flat body (`{"object": "error",
"message", "type", "param", "code": 400}`) before it nested it; llama.cpp's server and
OpenRouter nest it but put a number in `code`; LM Studio, Ollama and TGI send
`{"error": "<text>"}`; a gateway sends plain text or HTML. The window and the count are
only in the message, in each server's words (`_OVERFLOWS`, each with its source).

>>> error = read_provider_error(400, "application/json", body)
>>> error.envelope            # {"error": {"message", "type", "param", "code"}}
>>> error.overflow            # Overflow(window=8192, requested=9000, ...) or None
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from typing import Any

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# What is parsed of a body; a longer one is read as text, its message cut.
BODY_MAX = 64 * 1024
MESSAGE_MAX = 4000


@dataclass(frozen=True)
class Overflow:
    """What a context-length refusal says, in the provider's own tokens; None where the
    message does not say it."""

    window: int | None = None  # N: the model's context window
    requested: int | None = None  # M: all the request asked for (prompt + completion)
    messages_tokens: int | None = None  # X: the provider's count of the prompt
    completion_tokens: int | None = None  # Y: the output it reserved for the answer

    @property
    def prompt_tokens(self) -> int | None:
        """The provider's count of what the proxy sent (X, or M less Y)."""
        if self.messages_tokens is not None:
            return self.messages_tokens
        if self.requested is not None:
            return self.requested - (self.completion_tokens or 0)
        return None


@dataclass(frozen=True)
class ProviderError:
    status: int
    envelope: dict[str, Any]  # {"error": {"message", "type", "param", "code"}}
    overflow: Overflow | None
    # The body must be replaced by `envelope`: it is not OpenAI's envelope, or it is an
    # overflow whose code is not context_length_exceeded (clients test that code).
    rewrite: bool

    @property
    def message(self) -> str:
        return str(self.envelope["error"]["message"])


# (pattern, names of its groups in order). Matched against the message, case-insensitively.
_OVERFLOWS: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE | re.DOTALL), names)
    for pattern, names in (
        # vLLM's newest (vllm/renderers/params.py, TokenizeParams._token_len_check).
        (
            r"you passed (\d+) input tokens and requested (\d+) output tokens\. however, the "
            r"model's context length is only (\d+) tokens",
            ("messages_tokens", "completion_tokens", "window"),
        ),
        # vLLM, the same check before tokenizing (_text_len_check): no token count.
        (
            r"you passed \d+ input characters and requested (\d+) output tokens\. however, "
            r"the model's context length is only (\d+) tokens",
            ("completion_tokens", "window"),
        ),
        # vLLM 0.12+ (VLLMValidationError, as its servers answer it).
        (
            r"maximum context length is (\d+) tokens\. however, you requested (\d+) output "
            r"tokens and your prompt contains at least (\d+) input tokens",
            ("window", "completion_tokens", "messages_tokens"),
        ),
        # vLLM ~0.9-0.11: max_tokens larger than the room the prompt leaves.
        (
            r"'max_tokens' or 'max_completion_tokens' is too large: (\d+)\. this model's "
            r"maximum context length is (\d+) tokens and your request has (\d+) input tokens",
            ("completion_tokens", "window", "messages_tokens"),
        ),
        # vLLM 0.6-0.8: "However, your request has X input tokens."
        (
            r"maximum context length is (\d+) tokens\. however, your request has (\d+) input "
            r"tokens",
            ("window", "messages_tokens"),
        ),
        # vLLM <= 0.5 (vllm/entrypoints/openai/serving_engine.py), OpenAI, Azure OpenAI:
        # "...you requested M tokens (X in the messages, Y in the completion)".
        (
            r"maximum context length is (\d+) tokens[.,] however,? you requested (\d+) tokens "
            r"\((\d+) in the messages, (\d+) in the completion\)",
            ("window", "requested", "messages_tokens", "completion_tokens"),
        ),
        # vLLM <= 0.5, no max_tokens: "you requested X tokens in the messages".
        (
            r"maximum context length is (\d+) tokens[.,] however,? you requested (\d+) tokens "
            r"in the messages",
            ("window", "messages_tokens"),
        ),
        # OpenRouter: "This endpoint's maximum context length is N tokens. However, you
        # requested about M tokens (X of text input, [T of tool input,] Y in the output)."
        (
            r"maximum context length is (\d+) tokens\. however, you requested about (\d+) "
            r"tokens \([^)]*?(\d+) in the output\)",
            ("window", "requested", "completion_tokens"),
        ),
        (
            r"maximum context length is (\d+) tokens\. however, you requested about (\d+) "
            r"tokens",
            ("window", "requested"),
        ),
        # OpenAI and Azure OpenAI: "However, your messages resulted in M tokens" (the
        # messages, functions included: a prompt count).
        (
            r"maximum context length is (\d+) tokens\. however, your messages resulted in "
            r"(\d+) tokens",
            ("window", "messages_tokens"),
        ),
        # OpenAI gpt-5: "Input tokens exceed the configured limit of N tokens. Your
        # messages resulted in M tokens."
        (
            r"exceed the configured limit of (\d+) tokens\. your messages resulted in (\d+) "
            r"tokens",
            ("window", "messages_tokens"),
        ),
        # OpenAI, older: "...however you requested M tokens (X in your prompt; Y for the
        # completion)".
        (
            r"maximum context length is (\d+) tokens, however you requested (\d+) tokens "
            r"\((\d+) in your prompt; (\d+) for the completion\)",
            ("window", "requested", "messages_tokens", "completion_tokens"),
        ),
        # Any of the above without the counts (OpenRouter, Groq, a bare OpenAI message).
        (r"maximum context length is (\d+) tokens", ("window",)),
        # llama.cpp server (tools/server/server-context.cpp, ERROR_TYPE_EXCEED_CONTEXT_SIZE).
        (
            r"request \((\d+) tokens\) exceeds the available context size \((\d+) tokens\)",
            ("messages_tokens", "window"),
        ),
        (
            r"input \((\d+) tokens\) is larger than the max context size \((\d+) tokens\)",
            ("messages_tokens", "window"),
        ),
        # LM Studio (its server's error, lmstudio-ai/lmstudio-bug-tracker#237, #546).
        (
            r"trying to keep the first (\d+) tokens when context the overflows\. however, the "
            r"model is loaded with context length of only (\d+) tokens",
            ("messages_tokens", "window"),
        ),
        (
            r"cannot truncate prompt with n_keep \((\d+)\) >= n_ctx \((\d+)\)",
            ("messages_tokens", "window"),
        ),
        # Hugging Face TGI (router/src/validation.rs), also served by Together (422).
        (
            r"`inputs` tokens \+ `max_new_tokens` must be <= (\d+)\. given: (\d+) `inputs` "
            r"tokens and (\d+) `max_new_tokens`",
            ("window", "messages_tokens", "completion_tokens"),
        ),
        (
            r"`inputs` must have less than (\d+) tokens\. given: (\d+)",
            ("window", "messages_tokens"),
        ),
        # Anthropic's OpenAI-compatible endpoint: "prompt is too long: X tokens > N maximum".
        (r"prompt is too long: (\d+) tokens > (\d+) maximum", ("messages_tokens", "window")),
    )
)
# Refusals that give no figures: llama.cpp's older server, Ollama, OpenAI's Responses API.
_OVERFLOW_WORDS = re.compile(
    r"exceeds the available context size|the input length exceeds the context length"
    r"|input exceeds context length|exceeds the context window of this model"
    r"|reduce the length of the messages",
    re.IGNORECASE,
)
_OVERFLOW_TYPES = frozenset({"exceed_context_size_error", CONTEXT_LENGTH_EXCEEDED})
# Statuses a context-length refusal comes with (413: gateways; 422: TGI, Together).
_OVERFLOW_STATUSES = frozenset({400, 413, 422})

_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "not_found"),
    409: ("invalid_request_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", None),
    429: ("requests", "rate_limit_exceeded"),
}


def read_provider_error(status: int, content_type: str, body: bytes) -> ProviderError:
    """The error answer of a model endpoint, as OpenAI's envelope, and what it says of the
    context window when it is a context-length refusal."""
    fields, shaped = _fields(content_type, body)
    message = fields.get("message") or _no_message(status)
    overflow = overflow_of(status, message, fields)
    kind, code = _KINDS.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None)
    )
    if overflow is not None:
        kind, code = "invalid_request_error", CONTEXT_LENGTH_EXCEEDED
    elif isinstance(fields.get("code"), str) and fields["code"]:
        code = fields["code"]
    if isinstance(fields.get("type"), str) and fields["type"] and shaped and overflow is None:
        kind = fields["type"]
    param = fields.get("param") if isinstance(fields.get("param"), str) else None
    envelope = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    rewrite = not shaped or (overflow is not None and fields.get("code") != CONTEXT_LENGTH_EXCEEDED)
    return ProviderError(status, envelope, overflow, rewrite)


def overflow_of(status: int, message: str, fields: dict[str, Any] | None = None) -> Overflow | None:
    """The refusal's figures, when `message` (or its fields) says the context is too long."""
    if status not in _OVERFLOW_STATUSES:
        return None
    fields = fields or {}
    for pattern, names in _OVERFLOWS:
        found = pattern.search(message)
        if found is not None:
            return _complete(dict(zip(names, map(int, found.groups()), strict=True)))
    # llama.cpp's newer server puts the figures beside the message.
    n_ctx, n_prompt = fields.get("n_ctx"), fields.get("n_prompt_tokens")
    typed = fields.get("type") in _OVERFLOW_TYPES or fields.get("code") in _OVERFLOW_TYPES
    if typed or _OVERFLOW_WORDS.search(message):
        return _complete(
            {
                "window": n_ctx if _is_count(n_ctx) else None,
                "messages_tokens": n_prompt if _is_count(n_prompt) else None,
            }
        )
    return None


def _complete(found: dict[str, int | None]) -> Overflow:
    overflow = Overflow(**found)
    if overflow.requested is None and None not in (
        overflow.messages_tokens,
        overflow.completion_tokens,
    ):
        return Overflow(
            overflow.window,
            (overflow.messages_tokens or 0) + (overflow.completion_tokens or 0),
            overflow.messages_tokens,
            overflow.completion_tokens,
        )
    return overflow


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _fields(content_type: str, body: bytes) -> tuple[dict[str, Any], bool]:
    """The error's fields (message, type, param, code, n_ctx...) and whether the body is
    OpenAI's envelope (`{"error": {...}}` with a message)."""
    parsed = _json(body) if len(body) <= BODY_MAX else None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict):
            fields = dict(error)
            message = fields.get("message")
            fields["message"] = _cut(message) if isinstance(message, str) else None
            return fields, isinstance(message, str)
        if isinstance(error, str):  # LM Studio, Ollama, TGI: {"error": "<text>"}
            return {**parsed, "message": _cut(error)}, False
        for name in ("message", "detail", "msg"):  # vLLM's flat body; FastAPI's detail
            if isinstance(parsed.get(name), str):
                return {**parsed, "message": _cut(parsed[name])}, False
    text = body[:BODY_MAX].decode("utf-8", "replace")
    if "html" in content_type.lower() or text.lstrip()[:1] == "<":
        text = _html_text(text)
    return {"message": _cut(text) if text.strip() else None}, False


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_TAGS = re.compile(r"<script.*?</script>|<style.*?</style>|<[^>]*>", re.IGNORECASE | re.DOTALL)


def _html_text(text: str) -> str:
    """A gateway's HTML page as one line: its title, else its text."""
    title = _TITLE.search(text)
    shown = title.group(1) if title is not None and title.group(1).strip() else _TAGS.sub(" ", text)
    return " ".join(html.unescape(shown).split())


def _cut(text: str) -> str:
    text = " ".join(text.split()) if "\n" in text[:MESSAGE_MAX] else text
    return text[:MESSAGE_MAX]


def _no_message(status: int) -> str:
    return f"The provider answered with status {status} and no error message."
