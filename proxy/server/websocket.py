"""GET /v1/responses with `Upgrade: websocket`: OpenAI's Responses WebSocket mode.

The upgrade is authenticated like any request (auth.authorize, a 401 before the
switch). Each `response.create` client event runs the one Responses turn
(responses.respond) through the same middlewares as an HTTP request, on a clone of the
upgrade request that is a POST of its body with `stream: true`; the relay writes its SSE
frames to this socket's EventSink (relay.EVENT_SINK) instead of an HTTP body, and each
event goes out as one text message, unchanged but for the `stream_id` echo.

- Lanes: events with one `stream_id` (none is a lane too) run one after another, FIFO;
  lanes run at once, at most `websocket_max_concurrent_responses` per socket.
- `store: false`: the last such response of each lane, with the input it was given,
  is kept in the socket's memory only, so `previous_response_id` naming it continues it
  on this socket (OpenAI's connection-local cache); a failed turn evicts its lane's, and
  a chain larger than max_body_bytes is not kept.
- Bad messages (not JSON, an unknown type, bad fields) get an `error` event in the
  spec's ResponseWsError shape and the socket stays open; a message larger than
  `websocket_max_message_bytes` closes it with 1009. `response.steer` is answered
  `response.steer.failed` (steering_not_supported).
- A client that leaves cancels its running turns, as an HTTP disconnect does: the
  response ends `incomplete` and nothing of it is committed.
- A socket lives at most `websocket_max_lifetime` (OpenAI closes its sockets after 60
  minutes): past it, the responses running finish, what is queued or sent after gets an
  error event (websocket_connection_limit_reached), and the socket closes with 1000.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import orjson
import structlog
from aiohttp import WSCloseCode, WSMsgType, web
from multidict import CIMultiDict

from proxy.core import events as ev
from proxy.core import fastjson
from proxy.server import responses
from proxy.server.errors import ApiError, invalid
from proxy.server.relay import EVENT_SINK
from proxy.server.state import CLOCK, SETTINGS
from proxy.server.validate import JsonDict, json_object, missing, unsupported_value, wrong_type
from proxy.sse import SSEDecoder

log = structlog.get_logger("threadkeeper.websocket")

CLIENT_EVENTS = ("response.create", "response.steer")
# Queued `response.create` events per lane (beyond them: an error event).
QUEUED_PER_LANE = 16
# Headers of the upgrade that are the socket's, not the turn's (never forwarded).
SOCKET_HEADERS = frozenset({"upgrade", "connection"})
# The open sockets of this process (closed at shutdown).
SOCKETS: web.AppKey[set[Socket]] = web.AppKey("websockets")
STREAM_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


def add_routes(app: web.Application) -> None:
    app[SOCKETS] = set()
    app.router.add_get("/v1/responses", responses_socket, name="responses.websocket")
    app.on_shutdown.append(close_sockets)


async def close_sockets(app: web.Application) -> None:
    """At shutdown, before aiohttp waits for handlers: every open socket is closed (1001),
    so its turns are cancelled as at a client's disconnect rather than after the shutdown
    timeout."""
    for socket in app[SOCKETS].copy():
        await socket.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")


def is_upgrade(request: web.Request) -> bool:
    return request.headers.get("Upgrade", "").lower() == "websocket"


async def responses_socket(request: web.Request) -> web.StreamResponse:
    """The WebSocket's life: read client events until it closes or idles out."""
    if not is_upgrade(request):
        raise ApiError(
            405,
            "GET /v1/responses is the Responses WebSocket: send 'Upgrade: websocket' "
            "(POST /v1/responses creates a response over HTTP).",
            code="method_not_allowed",
        )
    settings = request.app[SETTINGS]
    ws = web.WebSocketResponse(max_msg_size=settings.websocket_max_message_bytes)
    await ws.prepare(request)
    socket = Socket(
        request,
        ws,
        settings.websocket_max_concurrent_responses,
        settings.max_body_bytes,
        settings.websocket_max_lifetime,
    )
    request.app[SOCKETS].add(socket)
    try:
        await socket.serve(settings.websocket_idle_timeout)
    finally:
        request.app[SOCKETS].discard(socket)
        await socket.aclose()
    return ws


@dataclass
class Unstored:
    """A `store: false` response the socket keeps for its continuation: what a request
    naming it continues from (`base`, a stored response or None) and the items after it."""

    response_id: str
    base: str | None
    items: list[JsonDict]
    size: int  # bytes of the items' JSON


@dataclass
class Lane:
    queue: deque[JsonDict] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None


class Socket:
    def __init__(
        self,
        request: web.Request,
        ws: web.WebSocketResponse,
        max_lanes: int,
        keep_bytes: int,
        max_lifetime: float = float("inf"),
    ) -> None:
        self.request = request
        self.ws = ws
        self.clock = request.app[CLOCK]
        self.ends_at = self.clock.now() + timedelta(seconds=min(max_lifetime, 10**9))
        self.max_lanes = max_lanes
        self.keep_bytes = keep_bytes  # most an unstored chain may hold (max_body_bytes)
        self.lanes: dict[str | None, Lane] = {}
        self.unstored: dict[str | None, Unstored] = {}  # by lane

    def lived(self) -> bool:
        """Past websocket_max_lifetime: no response starts on this socket any more."""
        return self.clock.now() >= self.ends_at

    async def end_if_lived(self) -> bool:
        """Closes a socket past its lifetime once no response runs on it."""
        if not self.lived() or self.lanes:
            return False
        await self.ws.close(code=WSCloseCode.OK, message=LIFETIME_REASON)
        return True

    async def serve(self, idle_timeout: float) -> None:
        while not self.ws.closed:
            # Past its lifetime, the socket waits for its lanes (the last one closes it).
            left = (self.ends_at - self.clock.now()).total_seconds()
            wait = min(idle_timeout, left) if left > 0 else idle_timeout
            try:
                message = await self.ws.receive(timeout=wait)
            except TimeoutError:
                if await self.end_if_lived():
                    return
                if self.lanes or self.lived():  # a response runs: the client is not idle
                    continue
                await self.ws.close(code=WSCloseCode.OK, message=b"idle timeout")
                return
            if message.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                data = message.data
                await self.on_message(data.encode() if isinstance(data, str) else data)
            elif message.type == WSMsgType.ERROR:
                log.info("websocket_error", error=repr(message.data))
                return
            else:  # CLOSE, CLOSING, CLOSED
                return

    async def aclose(self) -> None:
        """The client is gone or the socket ends: running turns are cancelled, as an HTTP
        client's disconnect cancels its handler, and awaited (their rows end incomplete)."""
        tasks = [lane.task for lane in self.lanes.values() if lane.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.lanes.clear()
        self.unstored.clear()
        await self.ws.close()

    async def send(self, payload: JsonDict | str) -> None:
        text = payload if isinstance(payload, str) else fastjson.dumps(payload).decode()
        with contextlib.suppress(ConnectionError):  # the client left: serve() ends
            await self.ws.send_str(text)

    async def error(self, exc: ApiError, stream_id: str | None = None) -> None:
        await self.send(ws_error(exc.body()["error"], exc.status, stream_id))

    async def on_message(self, raw: bytes) -> None:
        event: JsonDict | None = None
        try:
            event = json_object(raw)
            kind = event.get("type")
            if kind is None:
                raise missing("type")
            if kind not in CLIENT_EVENTS:
                raise unsupported_value(kind, CLIENT_EVENTS, "type")
            if kind == "response.steer":
                await self.steer(event)
                return
            if self.lived():
                raise lifetime_reached()
            self.enqueue(event)
        except ApiError as exc:
            await self.error(exc, _lane_of(event))

    def enqueue(self, event: JsonDict) -> None:
        stream_id = event.get("stream_id")
        if stream_id is not None:
            valid_stream_id(stream_id)
        lane = self.lanes.get(stream_id)
        if lane is None:
            if len(self.lanes) >= self.max_lanes:
                raise invalid(
                    "This WebSocket connection has reached its stream limit "
                    f"({self.max_lanes} responses at once).",
                    param="stream_id",
                    code="websocket_stream_limit_reached",
                )
            lane = self.lanes[stream_id] = Lane()
            lane.task = asyncio.create_task(self.run_lane(stream_id, lane))
        if len(lane.queue) >= QUEUED_PER_LANE:
            raise invalid(
                f"Too many responses queued on this WebSocket lane (at most {QUEUED_PER_LANE}).",
                param="stream_id",
                code="websocket_queue_full",
            )
        lane.queue.append(event)

    async def run_lane(self, stream_id: str | None, lane: Lane) -> None:
        """One lane's events, FIFO; the lane is gone once its queue is empty."""
        try:
            while lane.queue:
                event = lane.queue.popleft()
                if self.lived():
                    await self.error(lifetime_reached(), stream_id)
                    continue
                await self.turn(stream_id, event)
        finally:
            if self.lanes.get(stream_id) is lane:
                del self.lanes[stream_id]
        await self.end_if_lived()

    async def turn(self, stream_id: str | None, event: JsonDict) -> None:
        sink = SocketSink(self, stream_id)
        try:
            body = self.turn_body(event, stream_id)
            request = self.turn_request()
            request[EVENT_SINK] = sink
            response = await in_request_context(
                request, lambda r: responses.respond(r, body, fastjson.dumps(body))
            )
            if isinstance(response, web.Response):  # not streamed: an error, or a refusal
                await sink.whole(response)
            await sink.flush()
        except ApiError as exc:  # the event itself is not a valid create (before any turn)
            await self.error(exc, stream_id)
        self.remember(stream_id, event, sink.completed)

    def turn_body(self, event: JsonDict, stream_id: str | None) -> JsonDict:
        """The `POST /v1/responses` body of a `response.create`: its envelope fields
        dropped, streamed, and a continuation of an unstored response of this socket
        rebuilt from what the socket kept of it."""
        if event.get("background") is True:
            raise invalid("Background mode is not supported over WebSocket.", param="background")
        body = {k: v for k, v in event.items() if k not in ("type", "stream_id")}
        body["stream"] = True
        previous = body.get("previous_response_id")
        kept = self.find_unstored(previous) if isinstance(previous, str) else None
        if kept is not None:
            given = body.get("input")
            if given is not None and not isinstance(given, str | list):
                raise wrong_type("input", "a string or an array", given)
            body["input"] = [*kept.items, *input_items(given)]
            if kept.base is None:
                del body["previous_response_id"]
            else:
                body["previous_response_id"] = kept.base
        return body

    def find_unstored(self, response_id: str) -> Unstored | None:
        for kept in self.unstored.values():
            if kept.response_id == response_id:
                return kept
        return None

    def remember(self, stream_id: str | None, event: JsonDict, completed: JsonDict | None) -> None:
        """After a turn: a completed `store: false` response is its lane's to continue;
        any other outcome evicts the lane's (OpenAI evicts on a failed turn)."""
        previous = event.get("previous_response_id")
        kept = self.find_unstored(previous) if isinstance(previous, str) else None
        self.unstored.pop(stream_id, None)
        if completed is None or event.get("store") is not False:
            return
        response_id = completed.get("id")
        output = completed.get("output")
        if not isinstance(response_id, str) or not isinstance(output, list):
            return
        base = kept.base if kept is not None else previous if isinstance(previous, str) else None
        added = [*input_items(event.get("input")), *output]
        size = (kept.size if kept is not None else 0) + len(fastjson.dumps(added))
        if size > self.keep_bytes:  # what HTTP would refuse to take back in one body
            log.info("websocket_unstored_dropped", response_id=response_id, bytes=size)
            return
        before = kept.items if kept is not None else []
        self.unstored[stream_id] = Unstored(response_id, base, [*before, *added], size)

    def turn_request(self) -> web.Request:
        """A POST /v1/responses of its own for one turn: its own request id, log line,
        deadline and state, the upgrade's headers (Authorization) but the socket's."""
        headers = CIMultiDict(
            (name, value)
            for name, value in self.request.headers.items()
            if name.lower() not in SOCKET_HEADERS and not name.lower().startswith("sec-websocket")
        )
        headers["Content-Type"] = "application/json"
        return self.request.clone(method="POST", headers=headers)

    async def steer(self, event: JsonDict) -> None:
        """Steering is not served: the client gets its input back, uncommitted."""
        previous = event.get("previous_response_id")
        if not isinstance(previous, str):
            raise missing("previous_response_id")
        if "input" not in event:
            raise missing("input")
        await self.send(
            {
                "type": "response.steer.failed",
                "sequence_number": 0,
                "error": {
                    "type": "invalid_request_error",
                    "code": "steering_not_supported",
                    "message": "threadkeeper does not support steering; send the input "
                    "in the next response.create.",
                },
                "steer": {"input": event["input"], "previous_response_id": previous},
            }
        )


LIFETIME_REASON = b"max lifetime reached"


def lifetime_reached() -> ApiError:
    return invalid(
        "This WebSocket connection has reached its maximum lifetime "
        "(websocket_max_lifetime); open a new connection and continue with "
        "previous_response_id.",
        code="websocket_connection_limit_reached",
    )


class SocketSink:
    """One turn's SSE frames as WebSocket text messages: each event's data, with the
    lane's `stream_id`, an error event in the WebSocket error shape. It keeps the
    completed response (for a `store: false` continuation)."""

    def __init__(self, socket: Socket, stream_id: str | None) -> None:
        self.socket = socket
        self.stream_id = stream_id
        self.decoder = SSEDecoder()
        self.completed: JsonDict | None = None

    async def frames(self, data: bytes) -> None:
        for event in self.decoder.feed(data):
            await self.event(event.data)

    async def flush(self) -> None:
        for event in self.decoder.flush():
            await self.event(event.data)

    async def whole(self, response: web.Response) -> None:
        event = whole_answer(response, self.stream_id)
        if event["type"] == ev.COMPLETED:
            self.completed = event["response"]
        await self.socket.send(event)

    async def event(self, data: str) -> None:
        if not data or data == "[DONE]":
            return
        payload = orjson.loads(data)  # the relay checked it: a JSON object
        kind = payload.get("type")
        if kind == ev.COMPLETED and isinstance(payload.get("response"), dict):
            self.completed = payload["response"]
        if kind == "error":
            await self.socket.send(stream_error(payload, self.stream_id))
        elif self.stream_id is not None:
            await self.socket.send({**payload, "stream_id": self.stream_id})
        else:
            await self.socket.send(data)


def ws_error(error: JsonDict, status: int | None, stream_id: str | None) -> JsonDict:
    """The spec's ResponseWsError: `{type: "error", status?, error: {...}, stream_id?}`."""
    event: JsonDict = {"type": "error"}
    if status is not None:
        event["status"] = status
    event["error"] = error
    if stream_id is not None:
        event["stream_id"] = stream_id
    return event


def stream_error(payload: JsonDict, stream_id: str | None) -> JsonDict:
    """A stream's error event (the provider's flat one, or the relay's) as ResponseWsError."""
    nested = payload.get("error")
    error = (
        nested
        if isinstance(nested, dict)
        else {
            "type": "server_error",
            "code": payload.get("code"),
            "message": payload.get("message") or "The response stream failed.",
            "param": payload.get("param"),
        }
    )
    event = ws_error(error, None, stream_id)
    if isinstance(payload.get("sequence_number"), int):
        event["sequence_number"] = payload["sequence_number"]
    return event


def whole_answer(response: web.Response, stream_id: str | None) -> JsonDict:
    """A turn answered with a whole body: an error envelope (the proxy's 4xx/5xx, the
    provider's refusal) as an error event with its status; a whole Response (a provider
    that did not stream) as its `response.completed`."""
    body: Any = None
    with contextlib.suppress(ValueError, TypeError):
        body = orjson.loads(bytes(response.body))  # type: ignore[arg-type]
    if response.status < 400 and isinstance(body, dict) and body.get("object") == "response":
        event: JsonDict = {"type": ev.COMPLETED, "sequence_number": 0, "response": body}
        if stream_id is not None:
            event["stream_id"] = stream_id
        return event
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {
            "type": "server_error",
            "code": None,
            "message": f"The response was answered with status {response.status}.",
            "param": None,
        }
    return ws_error(error, response.status, stream_id)


def input_items(given: Any) -> list[JsonDict]:
    """A create's `input` as items (a string is one user message, as OpenAI reads it)."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    return list(given)


def valid_stream_id(value: Any) -> None:
    if not isinstance(value, str):
        raise wrong_type("stream_id", "a string", value)
    if not 1 <= len(value) <= 256 or not set(value) <= STREAM_ID_CHARS:
        raise invalid(
            "Invalid 'stream_id': 1 to 256 characters of A-Z, a-z, 0-9, '_', '.' and '-'.",
            param="stream_id",
            code="invalid_value",
        )


def _lane_of(event: JsonDict | None) -> str | None:
    """The stream_id an invalid event named, to route its error event (when valid)."""
    value = event.get("stream_id") if event is not None else None
    if isinstance(value, str) and 1 <= len(value) <= 256 and set(value) <= STREAM_ID_CHARS:
        return value
    return None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def in_request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """`handler` under the steps an HTTP request passes: its request id and log line,
    OpenAI's error envelope, the bearer token checked again (a key revoked since the
    upgrade stops here)."""
    from proxy.server.app import in_context  # app imports this module

    return await in_context(request, handler, checked=False)
