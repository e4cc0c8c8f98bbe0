"""Provider faults: retries, bounded failure, streaming relay, disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp import web

from proxy.fake_provider import Reply
from tests.server.conftest import TENANT_KEY


async def test_429_then_success_is_retried(proxy) -> None:
    proxy.provider.script.extend([Reply(status=429, retry_after="0"), Reply(text="second try")])
    client = proxy.client()
    completion = await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
    )
    assert completion.choices[0].message.content == "second try"
    assert len(proxy.provider.requests) == 2


async def test_500_forever_returns_the_provider_error_after_bounded_attempts(proxy) -> None:
    proxy.provider.script.extend([Reply(status=500) for _ in range(10)])
    client = proxy.client()
    with pytest.raises(openai.InternalServerError) as info:
        await asyncio.wait_for(
            client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "x"}]
            ),
            timeout=20,
        )
    assert info.value.status_code == 500
    assert len(proxy.provider.requests) == 3  # the policy's max_attempts
    assert info.value.response.headers.get("x-request-id")


async def test_unreachable_provider_is_a_502_in_openai_shape(make_proxy) -> None:
    proxy = await make_proxy(upstream_url="http://127.0.0.1:9/v1")
    client = proxy.client()
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.status_code in (502, 504)
    assert info.value.body["type"] == "server_error"  # type: ignore[index]


class GatedStream:
    """A provider whose stream waits for the test between chunks, so buffering would hang."""

    def __init__(self) -> None:
        self.first_chunk_seen = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.finished = False

    async def handler(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            chunk = {
                "id": "c1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "gpt-4o",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": "first"},
                        "finish_reason": None,
                    }
                ],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.wait_for(self.first_chunk_seen.wait(), timeout=10)
            chunk["choices"][0]["delta"] = {"content": " second"}  # type: ignore[index]
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(30)  # a slow provider: only a disconnect ends this early
            await response.write(b"data: [DONE]\n\n")
            self.finished = True
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.set()
            raise
        return response


@pytest.fixture
async def gated() -> AsyncIterator[tuple[GatedStream, str]]:
    stub = GatedStream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", stub.handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield stub, f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


async def test_stream_is_relayed_chunk_by_chunk_and_disconnect_cancels_upstream(
    make_proxy, gated
) -> None:
    stub, url = gated
    proxy = await make_proxy(upstream_url=url)
    client = proxy.client()
    stream = await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks = aiter(stream)
    first = await asyncio.wait_for(anext(chunks), timeout=10)
    # The provider has not finished (it is waiting for us): the proxy did not buffer.
    assert first.choices[0].delta.content == "first"
    assert not stub.finished
    stub.first_chunk_seen.set()
    second = await asyncio.wait_for(anext(chunks), timeout=10)
    assert second.choices[0].delta.content == " second"
    await stream.close()  # the client goes away mid-stream
    await asyncio.wait_for(stub.cancelled.wait(), timeout=10)
    assert not stub.finished


async def test_provider_cut_mid_stream_ends_with_an_error_event(proxy) -> None:
    proxy.provider.script.append(Reply(text="a b c d e f g h", disconnect_after=3))
    async with proxy.http() as http:
        async with http.stream(
            "POST",
            "/v1/responses",
            json={"model": "gpt-4o", "input": "hi", "stream": True},
            headers={"Authorization": f"Bearer {TENANT_KEY}"},
        ) as response:
            body = b"".join([chunk async for chunk in response.aiter_bytes()])
    events = [block for block in body.decode().split("\n\n") if block.strip()]
    last = events[-1]
    assert last.startswith("event: error")
    payload = json.loads(last.split("data: ", 1)[1])
    assert payload["type"] == "error"
    assert payload["code"] == "upstream_stream_error"
    assert payload["error"]["code"] == "upstream_stream_error"
