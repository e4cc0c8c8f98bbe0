"""A scripted OpenAI-compatible provider on loopback (aiohttp's examples/fake_server.py idea).

Used by the end-to-end tests, `threadkeeper demo` and the benchmarks: it speaks the real
wire format (JSON bodies, SSE event sequences, error envelopes, `x-request-id`), records
every request it receives, and answers model requests from a FIFO script of `Reply`s,
falling back to a short echo when the script is empty. `FakeProvider(light=True)` is the
benchmarks' stub: it spends as little CPU per request as it can (see its docstring).

>>> provider = FakeProvider()
>>> base_url = await provider.start()          # "http://127.0.0.1:<port>/v1"
>>> provider.script.append(Reply(tool_calls=[("refund_order", '{"order_id": 7}')]))
>>> ...                                          # point the proxy's upstream at base_url
>>> provider.requests[-1].json["messages"]
>>> await provider.stop()
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core.items import (
    Item,
    JsonDict,
    chat_item,
    items_from_responses_input,
    message_text,
    responses_item,
)
from proxy.core.tokens import TokenCounter
from proxy.sse import DONE, encode_event, encode_json_event

log = logging.getLogger(__name__)

DEFAULT_MODEL = "gpt-4o-mini"
MODELS = ("gpt-4o-mini", "gpt-4o", "gpt-4.1-mini")
ECHO_CHARS = 40
EMBEDDING = (0.125, -0.25, 0.5, 0.0625)  # exactly representable in float32
FINGERPRINT = "fp_threadkeeper_fake"
MAX_BODY_BYTES = 64 * 1024 * 1024
LIGHT_CACHE_ITEMS = 65536  # the light stub's item counts kept (then it starts afresh)


class AnswerBuilder(Protocol):
    """(request body, reply) -> the answer; `prompt_tokens`: its usage's prompt count,
    else the fake counts the body's prompt."""

    def __call__(
        self, body: JsonDict, reply: Reply, *, prompt_tokens: int | None = None
    ) -> JsonDict: ...


# (request body, answer) -> its SSE frames.
FrameBuilder = Callable[[JsonDict, JsonDict], list[bytes]]


@dataclass
class Reply:
    """One scripted answer to a model request (POST /v1/chat/completions or /v1/responses).

    `text` and `tool_calls` shape a normal answer; `body` replaces it with exact JSON;
    `status >= 400` gives OpenAI's error envelope (message = `text` when set; `raw` and
    a `content-type` in `headers` give any other error body). For
    misbehaving providers: `raw` is the exact body bytes (sent as JSON; with
    `disconnect_after`, the connection drops after that many bytes of a longer declared
    Content-Length), `frames` the exact bytes of an event stream, one write each, then EOF.
    """

    status: int = 200
    body: JsonDict | None = None
    text: str | None = None
    tool_calls: list[tuple[str, str]] | None = None  # (name, arguments JSON)
    # Chat answers: the model's reasoning before its answer, under `reasoning_key`
    # (vLLM's and DeepSeek's `reasoning_content`, Ollama's `reasoning`).
    reasoning: str | None = None
    reasoning_key: str = "reasoning_content"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # before the response headers
    stream_chunk_delay: float = 0.0  # between stream events
    disconnect_after: int | None = None  # streams: drop the connection after N events
    retry_after: str | None = None  # value of the Retry-After header
    raw: bytes | None = None
    frames: list[bytes] | None = None
    release: asyncio.Event | None = None  # the answer waits until the test sets it
    # With `release`: a stream sends this many events first, then waits for it.
    release_after: int | None = None


@dataclass
class ContextWindow:
    """A window the fake enforces on model requests, as vLLM does: a prompt (counted
    `inflation` times the o200k count, a heavier vocabulary) plus the requested output
    above `tokens` is refused with vLLM's flat error body, before any scripted reply is
    taken. `refusals` counts them."""

    tokens: int
    inflation: float = 1.0
    refusals: int = 0
    per_message: int = 0  # a chat template's tokens around each message or item
    # What `GET /v1/models` lists for the fake's models as its window ({"max_model_len":
    # 8192}: vLLM's ModelCard; "context_length": OpenRouter's; "max_context_length": LM
    # Studio's); `ollama_show`: what `POST /api/show` answers (None: a 404).
    listed: dict[str, int] | None = None
    ollama_show: dict[str, object] | None = None
    # Ollama's OpenAI endpoint cuts a prompt above this many tokens without an error and
    # reports only what it kept.
    truncate_at: int | None = None
    # The provider's own count of a request's prompt, when it is not the inflated o200k
    # count (a test's model tokenizer and chat template).
    count: Callable[[JsonDict], int] | None = None

    def prompt(self, body: JsonDict) -> int:
        """The prompt as this provider counts it (its vocabulary and template)."""
        if self.count is not None:
            return self.count(body)
        if "messages" in body:
            counted, items = chat_prompt_tokens(body), len(body.get("messages") or [])
        else:
            counted = responses_prompt_tokens(body)
            given = body.get("input")
            items = len(given) if isinstance(given, list) else 1
            items += 1 if body.get("instructions") else 0
        return int(counted * self.inflation) + self.per_message * items


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: str
    headers: CIMultiDictProxy[str]  # case-insensitive: headers["Authorization"] works
    json: Any  # the parsed body, None when it is not JSON
    raw: bytes


class FakeProvider:
    """An OpenAI-compatible server on loopback with scripted answers.

    `light`: a benchmark's stub, whose CPU per request should be the wire's, not the
    fake's: model requests are not recorded (`requests` stays empty), not checked for
    dangling tool calls, and their usage counts each message or item once by its JSON
    text (the same count, so the proxy learns no correction a real provider would not
    teach; a history sent again costs a lookup an item)."""

    def __init__(
        self, models: Sequence[str] = MODELS, *, chat_only: bool = False, light: bool = False
    ) -> None:
        self.models = tuple(models)
        self.light = light
        self._item_tokens: dict[bytes, int] = {}
        # Ollama, llama.cpp, TGI...: /v1/responses is a 404, and Chat requests are held
        # to Chat's own rules (chat_rules_error).
        self.chat_only = chat_only
        # Chat request fields this provider refuses with a 400, and in whose words:
        # "openai" (`Unsupported parameter: 'max_tokens' ...`), "vllm" (pydantic's
        # extra_forbidden in vLLM's flat error body).
        self.refused_params: dict[str, Literal["openai", "vllm"]] = {}
        self.requests: list[RecordedRequest] = []
        self.script: list[Reply] = []
        # Replies for requests of one model, taken before `script` (a summarizer model's
        # calls then never take a turn's reply, whatever order they arrive in).
        self.scripts: dict[str, list[Reply]] = {}
        self.base_url: str | None = None
        self.window: ContextWindow | None = None
        # Answers whose client (the proxy) had gone when their `release` was set.
        self.aborted = 0
        # vLLM's `POST /tokenize` and `POST /v1/responses/input_tokens`: "count" answers
        # with this provider's count (ContextWindow.prompt), "missing" is a 404, "hang"
        # never answers, "garbled" is a 200 that is no count (a gateway's HTML page).
        self.counting: Literal["count", "missing", "hang", "garbled"] = "count"
        self._app = self._build_app()
        self._runner: web.AppRunner | None = None

    @property
    def app(self) -> web.Application:
        return self._app

    @property
    def model_requests(self) -> list[RecordedRequest]:
        """The requests that consumed (or would have consumed) a scripted reply."""
        return [r for r in self.requests if r.method == "POST" and r.path in MODEL_PATHS]

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self._app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound_port = self._runner.addresses[0][1]
        self.base_url = f"http://{host}:{bound_port}/v1"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeProvider:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # --- routing ----------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        # OpenAI takes request bodies far above aiohttp's 1 MiB default (long histories).
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.on_response_prepare.append(_add_request_id)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/api/show", self._ollama_show)  # Ollama's, beside its /v1
        app.router.add_post("/tokenize", self._tokenize)  # vLLM's, beside its /v1
        app.router.add_post("/v1/responses/input_tokens", self._input_tokens)
        app.router.add_route("*", "/{tail:.*}", self._echo)
        return app

    async def _record(self, request: web.Request) -> RecordedRequest:
        raw = await request.read()
        recorded = RecordedRequest(
            method=request.method,
            path=request.path,
            query=request.rel_url.raw_query_string,
            headers=CIMultiDictProxy(CIMultiDict(request.headers)),
            json=_parse_json(raw),
            raw=raw,
        )
        self.requests.append(recorded)
        return recorded

    def _next_reply(self, body: JsonDict) -> Reply:
        own = self.scripts.get(body.get("model") or "")
        if own:
            return own.pop(0)
        return self.script.pop(0) if self.script else Reply()

    # --- model endpoints --------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._model_request(request, chat_completion, chat_stream_frames)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        if self.chat_only:
            await self._record(request)
            return web.json_response({"detail": "Not Found"}, status=404)
        return await self._model_request(request, response_object, response_stream_frames)

    async def _model_request(
        self, request: web.Request, build: AnswerBuilder, frames: FrameBuilder
    ) -> web.StreamResponse:
        prompt_tokens: int | None = None
        if self.light:
            body = _parse_json_fast(await request.read())
            prompt_tokens = self._light_prompt(body) if isinstance(body, dict) else None
        else:
            body = (await self._record(request)).json
        if not isinstance(body, dict):
            return error_response(400, "We could not parse the JSON body of your request.")
        if self.chat_only and (broken := chat_rules_error(body)) is not None:
            return error_response(400, broken[0], param=broken[1])
        for param, words in self.refused_params.items():
            if param in body:
                return web.json_response(refused_param_body(param, body[param], words), status=400)
        unpaired = None if self.light else unpaired_call_error(request.path, body)
        if unpaired is not None:  # refused before any reply is generated, as OpenAI does
            return error_response(
                400, unpaired, param="messages" if "messages" in body else "input"
            )
        refused = self._over_window(body)
        if refused is not None:
            return refused
        reply = self._next_reply(body)
        if reply.delay:
            await asyncio.sleep(reply.delay)
        if reply.release is not None and reply.release_after is None:
            await reply.release.wait()
            if request.transport is None or request.transport.is_closing():
                self.aborted += 1
        headers = reply_headers(reply)
        if reply.status >= 400 and reply.raw is None:
            return error_response(reply.status, reply.text, headers, reply.body)
        if reply.body is not None:
            return web.json_response(reply.body, status=reply.status, headers=headers)
        if reply.raw is not None:
            return await self._raw(request, reply, headers)
        if reply.frames is not None:
            return await self._stream(request, reply, headers, reply.frames)
        result = self._own_usage(body, build(body, reply, prompt_tokens=prompt_tokens))
        if not body.get("stream"):
            return web.json_response(result, status=reply.status, headers=headers)
        return await self._stream(request, reply, headers, frames(body, result))

    def _light_prompt(self, body: JsonDict) -> int | None:
        """chat_prompt_tokens or responses_prompt_tokens of a list of messages or items,
        each counted once by its JSON text; None (count it the usual way) for anything
        else."""
        chat = "messages" in body
        given = body.get("messages" if chat else "input")
        if not isinstance(given, list) or not all(isinstance(one, dict) for one in given):
            return None
        counter = _counter(str(body.get("model") or DEFAULT_MODEL))
        count = counter.chat_message if chat else counter.responses_item
        known = self._item_tokens
        if len(known) > LIGHT_CACHE_ITEMS:
            known.clear()
        try:
            total = 0
            for one in given:
                key = orjson.dumps(one)
                tokens = known.get(key)
                if tokens is None:
                    tokens = known[key] = count(one)
                total += tokens
            total += counter.reply_tokens + counter.tools(body.get("tools") or ())
            if not chat:
                total += counter.instructions(body.get("instructions"))
        except (TypeError, ValueError, AttributeError, AssertionError, KeyError):
            return None  # malformed: the usual count's fallbacks decide
        return total

    def _over_window(self, body: JsonDict) -> web.Response | None:
        window = self.window
        if window is None:
            return None
        prompt = window.prompt(body)
        if window.truncate_at is not None:
            return None  # Ollama: no refusal, the prompt is cut (see `_own_usage`)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        asked = asked or body.get("max_output_tokens") or 0
        completion = asked if isinstance(asked, int) else 0
        if prompt + completion <= window.tokens:
            return None
        window.refusals += 1
        message = (  # vLLM's words (vllm/entrypoints/openai/serving_engine.py, <= 0.5)
            f"This model's maximum context length is {window.tokens} tokens. However, you "
            f"requested {prompt + completion} tokens ({prompt} in the messages, {completion} "
            "in the completion). Please reduce the length of the messages or completion."
        )
        flat = {
            "object": "error",
            "message": message,
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        return web.json_response(flat, status=400)

    def _own_usage(self, body: JsonDict, result: JsonDict) -> JsonDict:
        """The answer's usage in the provider's own count, as a real one reports it."""
        window = self.window
        usage = result.get("usage")
        if window is None or not isinstance(usage, dict):
            return result
        prompt = window.prompt(body)
        if window.truncate_at is not None:
            prompt = min(prompt, window.truncate_at)
        key = "prompt_tokens" if "prompt_tokens" in usage else "input_tokens"
        output = usage.get("completion_tokens") or usage.get("output_tokens") or 0
        usage.update({key: prompt, "total_tokens": prompt + output})
        return result

    async def _stream(
        self, request: web.Request, reply: Reply, headers: dict[str, str], frames: list[bytes]
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            status=reply.status,
            headers={"content-type": "text/event-stream; charset=utf-8", **headers},
        )
        response.headers.setdefault("cache-control", "no-cache")
        await response.prepare(request)
        for sent, frame in enumerate(frames):
            if reply.disconnect_after is not None and sent >= reply.disconnect_after:
                return _drop_connection(request, response)
            if sent and reply.stream_chunk_delay:
                await asyncio.sleep(reply.stream_chunk_delay)
            if reply.release is not None and sent == reply.release_after:
                await reply.release.wait()
            # One write per event: each reaches the socket as its own chunk.
            await response.write(frame)
        await response.write_eof()
        return response

    async def _raw(
        self, request: web.Request, reply: Reply, headers: dict[str, str]
    ) -> web.StreamResponse:
        assert reply.raw is not None
        response = web.StreamResponse(
            status=reply.status, headers={"content-type": "application/json", **headers}
        )
        response.content_length = len(reply.raw)
        await response.prepare(request)
        if reply.disconnect_after is not None:
            await response.write(reply.raw[: reply.disconnect_after])
            return _drop_connection(request, response)
        await response.write(reply.raw)
        await response.write_eof()
        return response

    # --- other endpoints --------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        await self._record(request)
        listed = self.window.listed if self.window is not None else None
        data = [
            {
                "id": model,
                "object": "model",
                "created": 1700000000,
                "owned_by": "threadkeeper",
                **(listed or {}),
            }
            for model in self.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def _counting(self, request: web.Request) -> tuple[JsonDict | None, web.Response | None]:
        body = (await self._record(request)).json
        if self.counting == "missing":
            return None, web.json_response({"detail": "Not Found"}, status=404)
        if self.counting == "hang":
            await asyncio.Event().wait()  # until the client goes (the proxy's timeout)
        if self.counting == "garbled":
            return None, web.Response(text="<html>It works!</html>", content_type="text/html")
        if not isinstance(body, dict):
            return None, error_response(400, "expected a JSON object")
        return body, None

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's TokenizeChatRequest ({"model", "messages"}) -> TokenizeResponse
        ({"count", "max_model_len", "tokens"}: vllm/entrypoints/openai/protocol.py)."""
        body, refused = await self._counting(request)
        if body is None:
            assert refused is not None
            return refused
        messages = body.get("messages")
        if not isinstance(messages, list):
            return error_response(400, "messages: expected a list", param="messages")
        if messages and isinstance(messages[0], dict) and messages[0].get("role") == "tool":
            # As a chat template that raises on a tool result with no call before it.
            body = {"object": "error", "message": "Unexpected tool message", "code": 400}
            return web.json_response(body, status=400)
        prompt = {"model": body.get("model"), "messages": messages}
        count = self.window.prompt(prompt) if self.window else chat_prompt_tokens(prompt)
        window = self.window.tokens if self.window else 0
        return web.json_response(
            {"count": count, "max_model_len": window, "tokens": list(range(count))}
        )

    async def _input_tokens(self, request: web.Request) -> web.Response:
        """OpenAI's TokenCountsBody -> TokenCountsResource."""
        body, refused = await self._counting(request)
        if body is None:
            assert refused is not None
            return refused
        prompt = {"model": body.get("model"), "input": body.get("input")}
        if body.get("instructions"):
            prompt["instructions"] = body["instructions"]
        count = self.window.prompt(prompt) if self.window else responses_prompt_tokens(prompt)
        return web.json_response({"object": "response.input_tokens", "input_tokens": count})

    async def _ollama_show(self, request: web.Request) -> web.Response:
        await self._record(request)
        shown = self.window.ollama_show if self.window is not None else None
        if shown is None:
            return web.json_response({"error": "model not found"}, status=404)
        return web.json_response(shown)

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = (await self._record(request)).json
        if not isinstance(body, dict) or "input" not in body:
            return error_response(400, "Missing required parameter: 'input'.", param="input")
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        if inputs and isinstance(inputs[0], int):
            inputs = [inputs]  # one input given as a token array
        as_base64 = body.get("encoding_format") == "base64"
        data = [
            {"object": "embedding", "index": i, "embedding": _embedding(as_base64)}
            for i in range(len(inputs))
        ]
        model = str(body.get("model") or "text-embedding-3-small")
        tokens = sum(_embedding_input_tokens(model, value) for value in inputs)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return web.json_response({"object": "list", "data": data, "model": model, "usage": usage})

    async def _echo(self, request: web.Request) -> web.Response:
        recorded = await self._record(request)
        body: Any = recorded.json
        if body is None and recorded.raw:
            body = recorded.raw.decode("utf-8", "replace")
        echo = {
            "method": recorded.method,
            "path": recorded.path,
            "query": recorded.query,
            "body": body,
        }
        return web.json_response(echo)


MODEL_PATHS = frozenset({"/v1/chat/completions", "/v1/responses"})


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.setdefault("x-request-id", new_id("req_"))


def _drop_connection(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Close the socket mid-body: the client sees a chunked body that never ends."""
    if request.transport is not None:
        request.transport.close()
    response.force_close()
    return response


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def reply_headers(reply: Reply) -> dict[str, str]:
    headers = dict(reply.headers)
    if reply.retry_after is not None:
        headers["retry-after"] = reply.retry_after
    return headers


def _parse_json(raw: bytes) -> Any | None:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _parse_json_fast(raw: bytes) -> Any | None:
    """orjson's parse, the stdlib's for what orjson refuses (an integer beyond 64 bits)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _parse_json(raw)


# --- errors -------------------------------------------------------------------------------


def unpaired_call_error(path: str, body: JsonDict) -> str | None:
    """OpenAI's 400 for a tool call sent without its output (a history left dangling)."""
    chat = path.endswith("/chat/completions")
    raws = body.get("messages") if chat else body.get("input")
    make: Callable[[JsonDict], Item] = chat_item if chat else responses_item
    if not isinstance(raws, list):
        return None
    items: list[Item] = [make(raw) for raw in raws if isinstance(raw, dict)]
    answered = {item.output_for for item in items if item.output_for is not None}
    # A pending MCP approval request is no dangling call: the next turn may answer it.
    calls = [item for item in items if item.kind == "tool_calls"]
    missing = [call_id for item in calls for call_id in item.call_ids if call_id not in answered]
    if not missing:
        return None
    if chat:
        return (
            "An assistant message with 'tool_calls' must be followed by tool messages "
            "responding to each 'tool_call_id'. The following tool_call_ids did not have "
            f"response messages: {', '.join(missing)}"
        )
    return f"No tool output found for function call {missing[0]}."


# CreateChatCompletionRequest's properties (/work/shared/openapi): anything else is refused.
CHAT_PARAMS = frozenset(
    {
        "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
        "max_completion_tokens", "max_tokens", "messages", "metadata", "modalities", "model",
        "moderation", "n", "parallel_tool_calls", "prediction", "presence_penalty",
        "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
        "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier",
        "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
        "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
    }
)  # fmt: skip
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def chat_rules_error(body: JsonDict) -> tuple[str, str] | None:
    """Chat Completions' own 400s (message, param), as OpenAI words them: an unknown
    param, a bad role, a tool message that does not answer a call of the assistant
    message right before it, a `tools` entry not of Chat's shape."""
    for key in body:
        if key not in CHAT_PARAMS:
            return f"Unrecognized request argument supplied: {key}", key
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "Missing required parameter: 'messages'.", "messages"
    open_calls: set[str] = set()
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        where = f"messages[{index}]"
        if role not in CHAT_ROLES:
            return f"Invalid value: '{role}'. Supported values are: {sorted(CHAT_ROLES)}.", where
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in open_calls:
                return (
                    "Invalid parameter: messages with role 'tool' must be a response to a "
                    "preceeding message with 'tool_calls'.",
                    where,
                )
            open_calls.discard(call_id)
            continue
        open_calls = {call.get("id") for call in message.get("tool_calls") or ()}
    for index, tool in enumerate(body.get("tools") or ()):
        if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            return "Missing required parameter: 'tools[0].function'.", f"tools[{index}]"
    return None


def refused_param_body(param: str, value: Any, words: Literal["openai", "vllm"]) -> JsonDict:
    """A provider's 400 for a request field it does not take, as OpenAI words it (for
    `max_tokens` on its reasoning models) or as vLLM's request model does."""
    if words == "openai":
        other = "max_completion_tokens" if param == "max_tokens" else "max_tokens"
        message = (
            f"Unsupported parameter: '{param}' is not supported with this model. "
            f"Use '{other}' instead."
        )
        error = {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": "unsupported_parameter",
        }
        return {"error": error}
    detail = (
        f"[{{'type': 'extra_forbidden', 'loc': ('body', '{param}'), "
        f"'msg': 'Extra inputs are not permitted', 'input': {value!r}}}]"
    )
    return {
        "object": "error",
        "message": detail,
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


_ERROR_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "not_found"),
    409: ("invalid_request_error", "conflict"),
    422: ("invalid_request_error", None),
    429: ("requests", "rate_limit_exceeded"),
}


def error_envelope(status: int, message: str | None = None, param: str | None = None) -> JsonDict:
    kind, code = _ERROR_KINDS.get(status, ("server_error", None))
    text = message or f"Scripted error {status} from the fake provider."
    return {"error": {"message": text, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str | None = None,
    headers: dict[str, str] | None = None,
    body: JsonDict | None = None,
    param: str | None = None,
) -> web.Response:
    payload = body if body is not None else error_envelope(status, message, param)
    return web.json_response(payload, status=status, headers=headers)


# --- token counts -----------------------------------------------------------------------


def _counter(model: str) -> TokenCounter:
    return TokenCounter.for_model(model)


def chat_prompt_tokens(body: JsonDict) -> int:
    counter = _counter(str(body.get("model") or DEFAULT_MODEL))
    try:
        return counter.chat_prompt(body.get("messages") or [], body.get("tools") or ())
    except (TypeError, ValueError, AttributeError, AssertionError):
        # A malformed request still gets an answer: the fake is not a validator.
        return counter.text(json.dumps(body.get("messages")))


def responses_prompt_tokens(body: JsonDict) -> int:
    counter = _counter(str(body.get("model") or DEFAULT_MODEL))
    try:
        items = items_from_responses_input(body.get("input") or []).items
        return counter.responses_prompt(items, body.get("instructions"), body.get("tools") or ())
    except (TypeError, ValueError, AttributeError, AssertionError, KeyError):
        return counter.text(json.dumps(body.get("input")))


def reply_tokens(model: str, text: str | None, calls: Iterable[tuple[str, str]]) -> int:
    counter = _counter(model)
    total = counter.text(text) if text else 0
    return total + sum(counter.text(name) + counter.text(args) for name, args in calls)


def _embedding_input_tokens(model: str, value: Any) -> int:
    if isinstance(value, list):
        return len(value)
    return _counter(model).text(str(value))


def _embedding(as_base64: bool) -> list[float] | str:
    if not as_base64:
        return list(EMBEDDING)
    return base64.b64encode(struct.pack(f"<{len(EMBEDDING)}f", *EMBEDDING)).decode("ascii")


# --- answers ------------------------------------------------------------------------------


def echo_text(last_user_text: str) -> str:
    text = " ".join(last_user_text.split())
    if len(text) > ECHO_CHARS:
        text = text[:ECHO_CHARS] + "..."
    return f"ok: {text}"


def reply_text(reply: Reply, last_user_text: str) -> str | None:
    """The assistant text: scripted, none when only tool calls are scripted, else an echo."""
    if reply.text is not None:
        return reply.text
    if reply.tool_calls:
        return None
    return echo_text(last_user_text)


def last_chat_user_text(messages: Any) -> str:
    for message in reversed(messages if isinstance(messages, list) else []):
        if isinstance(message, dict) and message.get("role") == "user":
            return message_text(message.get("content"))
    return ""


def last_responses_user_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    for item in reversed(value if isinstance(value, list) else []):
        if isinstance(item, dict) and item.get("role") == "user":
            return message_text(item.get("content"))
    return ""


def chat_completion(body: JsonDict, reply: Reply, *, prompt_tokens: int | None = None) -> JsonDict:
    """The non-streaming `chat.completion`; the stream is derived from it."""
    model = str(body.get("model") or DEFAULT_MODEL)
    text = reply_text(reply, last_chat_user_text(body.get("messages")))
    calls = reply.tool_calls or []
    message: JsonDict = {"role": "assistant", "content": text, "refusal": None}
    if reply.reasoning is not None:
        message[reply.reasoning_key] = reply.reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": new_id("call_"),
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            for name, args in calls
        ]
    prompt = chat_prompt_tokens(body) if prompt_tokens is None else prompt_tokens
    completion = reply_tokens(model, text, calls) + reply_tokens(model, reply.reasoning, [])
    return {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if calls else "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        "service_tier": "default",
        "system_fingerprint": FINGERPRINT,
    }


def text_pieces(text: str) -> list[str]:
    """Word-sized deltas, as a model streams them."""
    return re.findall(r"\s*\S+|\s+$", text) or [text]


def argument_pieces(arguments: str, parts: int = 3) -> list[str]:
    """Arguments split into a few deltas, so accumulation is exercised."""
    size = max(1, -(-len(arguments) // parts))
    return [arguments[i : i + size] for i in range(0, len(arguments), size)] or [""]


def chat_stream_chunks(body: JsonDict, completion: JsonDict) -> list[JsonDict]:
    """The `chat.completion.chunk` objects OpenAI would stream for this completion."""
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    choice = completion["choices"][0]
    message = choice["message"]
    base = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion["created"],
        "model": completion["model"],
        "service_tier": completion["service_tier"],
        "system_fingerprint": completion["system_fingerprint"],
    }

    def chunk(delta: JsonDict, finish: str | None = None) -> JsonDict:
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        extra = {"usage": None} if include_usage else {}
        return {**base, "choices": choices, **extra}

    first_content = "" if message["content"] is not None else None
    chunks = [chunk({"role": "assistant", "content": first_content, "refusal": None})]
    for key in ("reasoning_content", "reasoning"):
        if isinstance(message.get(key), str):
            chunks.extend(chunk({key: piece}) for piece in text_pieces(message[key]))
    if message["content"]:
        chunks.extend(chunk({"content": piece}) for piece in text_pieces(message["content"]))
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call["function"]
        opening = {
            "index": index,
            "id": call["id"],
            "type": "function",
            "function": {"name": function["name"], "arguments": ""},
        }
        chunks.append(chunk({"tool_calls": [opening]}))
        for piece in argument_pieces(function["arguments"]):
            delta = {"index": index, "function": {"arguments": piece}}
            chunks.append(chunk({"tool_calls": [delta]}))
    chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        chunks.append({**base, "choices": [], "usage": completion["usage"]})
    return chunks


def chat_stream_frames(body: JsonDict, completion: JsonDict) -> list[bytes]:
    frames = [encode_json_event(chunk) for chunk in chat_stream_chunks(body, completion)]
    return [*frames, encode_event(DONE)]


def response_object(body: JsonDict, reply: Reply, *, prompt_tokens: int | None = None) -> JsonDict:
    """The completed Response; the event stream is derived from it."""
    model = str(body.get("model") or DEFAULT_MODEL)
    text = reply_text(reply, last_responses_user_text(body.get("input")))
    calls = reply.tool_calls or []
    output: list[JsonDict] = []
    if text is not None:
        output.append(output_message(text))
    output.extend(function_call_item(name, args) for name, args in calls)
    prompt = responses_prompt_tokens(body) if prompt_tokens is None else prompt_tokens
    completion = reply_tokens(model, text, calls)
    now = int(time.time())
    return {
        "id": new_id("resp_"),
        "object": "response",
        "created_at": now,
        "status": "completed",
        "completed_at": now,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "service_tier": "default",
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": body.get("truncation", "disabled"),
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
        "user": body.get("user"),
    }


def output_message(text: str) -> JsonDict:
    return {
        "id": new_id("msg_"),
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def function_call_item(name: str, arguments: str) -> JsonDict:
    return {
        "id": new_id("fc_"),
        "type": "function_call",
        "status": "completed",
        "call_id": new_id("call_"),
        "name": name,
        "arguments": arguments,
    }


def response_stream_events(response: JsonDict) -> list[JsonDict]:
    """OpenAI's event sequence for this Response, numbered by `sequence_number`."""
    started = {**response, "status": "in_progress", "completed_at": None, "output": []}
    started["usage"] = None
    events: list[tuple[str, JsonDict]] = [
        ("response.created", {"response": started}),
        ("response.in_progress", {"response": started}),
    ]
    for index, item in enumerate(response["output"]):
        events.extend(_item_events(index, item))
    events.append(("response.completed", {"response": response}))
    return [
        {"type": kind, **data, "sequence_number": number}
        for number, (kind, data) in enumerate(events)
    ]


def _item_events(index: int, item: JsonDict) -> list[tuple[str, JsonDict]]:
    if item["type"] == "function_call":
        added = {**item, "status": "in_progress", "arguments": ""}
        where = {"item_id": item["id"], "output_index": index}
        events = [("response.output_item.added", {"output_index": index, "item": added})]
        events.extend(
            ("response.function_call_arguments.delta", {**where, "delta": piece})
            for piece in argument_pieces(item["arguments"])
        )
        done = {**where, "name": item["name"], "arguments": item["arguments"]}
        events.append(("response.function_call_arguments.done", done))
    else:
        added = {**item, "status": "in_progress", "content": []}
        events = [("response.output_item.added", {"output_index": index, "item": added})]
        for part_index, part in enumerate(item.get("content") or ()):
            events.extend(_text_part_events(item["id"], index, part_index, part))
    events.append(("response.output_item.done", {"output_index": index, "item": item}))
    return events


def _text_part_events(
    item_id: str, index: int, part_index: int, part: JsonDict
) -> list[tuple[str, JsonDict]]:
    where = {"item_id": item_id, "output_index": index, "content_index": part_index}
    events = [("response.content_part.added", {**where, "part": {**part, "text": ""}})]
    events.extend(
        ("response.output_text.delta", {**where, "delta": piece, "logprobs": []})
        for piece in text_pieces(part["text"])
    )
    events.append(("response.output_text.done", {**where, "text": part["text"], "logprobs": []}))
    events.append(("response.content_part.done", {**where, "part": part}))
    return events


def response_stream_frames(body: JsonDict, response: JsonDict) -> list[bytes]:
    events = response_stream_events(response)
    return [encode_json_event(event, event=event["type"]) for event in events]
