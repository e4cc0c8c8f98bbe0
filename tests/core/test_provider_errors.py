"""Provider error bodies read as each provider really sends them (proxy/core/provider_errors.py).
Every case names where its words come from."""

from __future__ import annotations

import json

import pytest

from proxy.core.provider_errors import Overflow, read_provider_error

JSON = "application/json"


def body(value: object) -> bytes:
    return json.dumps(value).encode()


def flat(message: str) -> bytes:
    """vLLM's flat ErrorResponse (vllm/entrypoints/openai/serving_engine.py,
    create_error_response: ErrorResponse(message, type, code))."""
    return body(
        {
            "object": "error",
            "message": message,
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    )


OVERFLOWS = [
    pytest.param(
        400,
        body(
            {
                "error": {
                    "message": "This model's maximum context length is 8192 tokens. However, you "
                    "requested 8334 tokens (338 in the messages, 7996 in the completion). Please "
                    "reduce the length of the messages or completion.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            }
        ),
        Overflow(8192, 8334, 338, 7996),
        id="openai: langroid/langroid#820, the API's own body",
    ),
    pytest.param(
        400,
        body(
            {
                "error": {
                    "message": "This model's maximum context length is 16385 tokens. However, "
                    "your messages resulted in 31228 tokens. Please reduce the length of the "
                    "messages.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            }
        ),
        Overflow(16385, None, 31228, None),
        id="azure openai: portkey.ai error library azure-openai #10012",
    ),
    pytest.param(
        400,
        flat(
            "This model's maximum context length is 8192 tokens. However, you requested 9000 "
            "tokens (8000 in the messages, 1000 in the completion). Please reduce the length of "
            "the messages or completion."
        ),
        Overflow(8192, 9000, 8000, 1000),
        id="vllm <= 0.5: vllm/entrypoints/openai/serving_engine.py _validate_prompt_and_tokenize",
    ),
    pytest.param(
        400,
        flat(
            "This model's maximum context length is 4096 tokens. However, you requested 5000 "
            "tokens in the messages, Please reduce the length of the messages."
        ),
        Overflow(4096, None, 5000, None),
        id="vllm <= 0.5 without max_tokens: same file",
    ),
    pytest.param(
        400,
        flat(
            "This model's maximum context length is 1536 tokens. However, your request has 4176 "
            "input tokens. Please reduce the length of the input messages."
        ),
        Overflow(1536, None, 4176, None),
        id="vllm 0.6-0.8: whois-api-llc/web-categorization-v2 docs, vLLM's log",
    ),
    pytest.param(
        400,
        body(
            {
                "error": {
                    "message": "'max_tokens' or 'max_completion_tokens' is too large: 8000. This "
                    "model's maximum context length is 4096 tokens and your request has 2778 input "
                    "tokens (8000 > 4096 - 2778). None",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            }
        ),
        Overflow(4096, 10778, 2778, 8000),
        id="vllm 0.9-0.11: andrewcho-dev/opsconductor-ng TOKEN_LIMIT_FIX.md, the server's body",
    ),
    pytest.param(
        400,
        body(
            {
                "error": {
                    "message": "This model's maximum context length is 48000 tokens. However, you "
                    "requested 16384 output tokens and your prompt contains at least 31617 input "
                    "tokens, for a total of at least 48001 tokens. Please reduce the length of the "
                    "input prompt or the number of requested output tokens. "
                    "(parameter=input_tokens, value=31617)",
                    "type": "BadRequestError",
                    "param": "input_tokens",
                    "code": 400,
                }
            }
        ),
        Overflow(48000, 48001, 31617, 16384),
        id="vllm 0.12+: VLLMValidationError, pentagi context-window test (LiteLLM -> vLLM)",
    ),
    pytest.param(
        400,
        flat(
            "You passed 9000 input tokens and requested 1000 output tokens. However, the model's "
            "context length is only 8192 tokens, resulting in a maximum input length of 7192 "
            "tokens. Please reduce the length of the input prompt."
        ),
        Overflow(8192, 10000, 9000, 1000),
        id="vllm newest: vllm/renderers/params.py TokenizeParams._token_len_check",
    ),
    pytest.param(
        400,
        flat(
            "You passed 90000 input characters and requested 1000 output tokens. However, the "
            "model's context length is only 8192 tokens, resulting in a maximum input length of "
            "7192 tokens (at most 28768 characters). Please reduce the length of the input prompt."
        ),
        Overflow(8192, None, None, 1000),
        id="vllm newest, before tokenizing: vllm/renderers/params.py _text_len_check",
    ),
    pytest.param(
        400,
        body(
            {
                "error": {
                    "message": "This endpoint's maximum context length is 16384 tokens. However, "
                    "you requested about 26265 tokens (26255 of text input, 10 in the output). "
                    "Please reduce the length of either one, or use the context-compression "
                    "plugin to compress your prompt automatically.",
                    "code": 400,
                    "metadata": {"provider_name": None},
                }
            }
        ),
        Overflow(16384, 26265, None, 10),
        id="openrouter: its error shape (openrouter.ai/docs/api/errors), a live body quoted by a client test",
    ),
    pytest.param(
        400,
        body(
            {
                "error": {
                    "message": "Please reduce the length of the messages or completion.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            }
        ),
        Overflow(),
        id="groq: OpenDevin/OpenDevin#1902, GroqException body",
    ),
    pytest.param(
        422,
        body(
            {
                "error": {
                    "message": "Input validation error: `inputs` tokens + `max_new_tokens` must be "
                    "<= 2048. Given: 1218 `inputs` tokens and 1500 `max_new_tokens`"
                }
            }
        ),
        Overflow(2048, 2718, 1218, 1500),
        id="together (422): TGI's router/src/validation.rs MaxTotalTokens, as Together serves it",
    ),
    pytest.param(
        422,
        body(
            {
                "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= "
                "1512. Given: 30 `inputs` tokens and 3984 `max_new_tokens`",
                "error_type": "validation",
            }
        ),
        Overflow(1512, 4014, 30, 3984),
        id="hugging face tgi: router/src/validation.rs, its flat body (discourse-ai spec)",
    ),
    pytest.param(
        400,
        body(
            {
                "error": {
                    "code": 400,
                    "message": "request (13392 tokens) exceeds the available context size (8192 "
                    "tokens), try increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": 13392,
                    "n_ctx": 8192,
                }
            }
        ),
        Overflow(8192, None, 13392, None),
        id="llama.cpp server: tools/server/server-context.cpp send_error, server-task.cpp to_json",
    ),
    pytest.param(
        400,
        body(
            {
                "error": {
                    "code": 400,
                    "message": "the request exceeds the available context size, try increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": 5000,
                    "n_ctx": 4096,
                }
            }
        ),
        Overflow(4096, None, 5000, None),
        id="llama.cpp server, older wording: figures only in n_prompt_tokens / n_ctx",
    ),
    pytest.param(
        400,
        body(
            {
                "error": "Trying to keep the first 14538 tokens when context the overflows. "
                "However, the model is loaded with context length of only 2048 tokens, which is "
                "not enough. Try to load the model with a larger context length, or provide a "
                "shorter input"
            }
        ),
        Overflow(2048, None, 14538, None),
        id="lm studio: dyad-sh/dyad#925, lmstudio-ai/lmstudio-bug-tracker#546",
    ),
    pytest.param(
        400,
        body({"error": "Cannot truncate prompt with n_keep (15028) >= n_ctx (7424)"}),
        Overflow(7424, None, 15028, None),
        id="lm studio 0.4: anomalyco/opencode#11141",
    ),
    pytest.param(
        400,
        body({"error": "the input length exceeds the context length"}),
        Overflow(),
        id="ollama: its API's refusal as its clients quote it (no figures)",
    ),
    pytest.param(
        400,
        body(
            {
                "error": {
                    "message": "Your input exceeds the context window of this model. Please "
                    "adjust your input and try again.",
                    "type": "invalid_request_error",
                    "param": "input",
                    "code": "context_length_exceeded",
                }
            }
        ),
        Overflow(),
        id="openai responses api: its context_length_exceeded without figures",
    ),
]


@pytest.mark.parametrize(("status", "raw", "expected"), OVERFLOWS)
def test_each_providers_context_refusal_is_read(
    status: int, raw: bytes, expected: Overflow
) -> None:
    error = read_provider_error(status, JSON, raw)
    assert error.overflow == expected
    assert error.envelope["error"]["code"] == "context_length_exceeded"
    assert error.envelope["error"]["type"] == "invalid_request_error"
    assert set(error.envelope["error"]) == {"message", "type", "param", "code"}


def test_vllms_flat_body_becomes_the_envelope_with_its_message() -> None:
    message = "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens (8000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion."
    error = read_provider_error(400, JSON, flat(message))
    assert error.rewrite
    assert error.envelope == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "context_length_exceeded",
        }
    }


def test_openais_own_envelope_is_left_as_it_came() -> None:
    raw = OVERFLOWS[0].values[1]
    assert isinstance(raw, bytes)
    assert not read_provider_error(400, JSON, raw).rewrite


def test_an_envelope_whose_overflow_lacks_openais_code_is_rewritten() -> None:
    raw = OVERFLOWS[13].values[1]  # llama.cpp: code 400, type exceed_context_size_error
    assert isinstance(raw, bytes)
    error = read_provider_error(400, JSON, raw)
    assert error.rewrite and error.envelope["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("status", "raw", "code", "kind"),
    [
        (429, flat("Rate limit reached, retry later."), "rate_limit_exceeded", "requests"),
        (401, body({"error": "unauthorized"}), "invalid_api_key", "invalid_request_error"),
        (400, flat("temperature must be in [0, 2]"), None, "invalid_request_error"),
        (503, b"Service Unavailable", None, "server_error"),
    ],
)
def test_other_errors_get_a_mapped_code_and_no_overflow(
    status: int, raw: bytes, code: str | None, kind: str
) -> None:
    error = read_provider_error(status, "text/plain", raw)
    assert error.overflow is None
    assert (error.envelope["error"]["code"], error.envelope["error"]["type"]) == (code, kind)


def test_a_context_phrase_on_a_5xx_is_not_an_overflow() -> None:
    raw = flat("This model's maximum context length is 8192 tokens.")
    assert read_provider_error(500, JSON, raw).overflow is None


def test_a_gateways_html_page_becomes_its_title() -> None:
    page = b"<html><head><title>504 Gateway Time-out</title></head><body><h1>504</h1></body></html>"
    error = read_provider_error(504, "text/html", page)
    assert error.message == "504 Gateway Time-out"
    assert error.rewrite


def test_an_empty_body_still_gets_a_message() -> None:
    error = read_provider_error(502, "", b"")
    assert "502" in error.message and error.envelope["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe not utf-8 \x00",
        b"[" * 100_000,  # deeper than the JSON parser goes
        b'{"error": {"message": 7}}',  # wrong-shaped
        b'{"error": ["x"]}',
        b"x" * 1_000_000,
    ],
)
def test_hostile_bodies_become_a_bounded_envelope(raw: bytes) -> None:
    error = read_provider_error(400, JSON, raw)
    assert isinstance(error.message, str) and len(error.message) <= 4000
    assert error.rewrite
