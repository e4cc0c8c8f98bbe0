"""A proxy killed with SIGKILL in the middle of a streamed turn (SPEC 7): after a restart
on the same SQLite file the cut-off response is `incomplete`, the conversation holds only
the completed turn (no partial items) and the next turn continues from it.

The proxy runs as a real `python -m proxy serve` child process; the fake provider runs in
the test process so the test decides when the stream is slow."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from proxy.fake_provider import FakeProvider, Reply

from .conftest import PROVIDER_KEY, TENANT_KEY, write_policies

READY_TIMEOUT = 30.0
STREAM_TIMEOUT = 30.0
SLOW_TEXT = " ".join(f"word{i}" for i in range(60))  # 0.3 s per event: ~20 s if not cut


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One `python -m proxy serve` child process on the test's SQLite file (or the given
    store), with any extra flags."""

    def __init__(
        self,
        workdir: Path,
        upstream: str,
        *,
        store_url: str | None = None,
        args: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        self.upstream = upstream
        self.store_url = store_url or f"sqlite:///{workdir / 'tk.db'}"
        self.args = list(args)
        self.port = free_port()
        self.log = workdir / f"server-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        command = [
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--port",
            str(self.port),
            "--store",
            self.store_url,
            "--policies",
            str(self.workdir / "policies"),
            "--upstream",
            self.upstream,
            *self.args,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("THREADKEEPER_")}
        env["ACME_OPENAI_KEY"] = PROVIDER_KEY
        env["PYTHONUNBUFFERED"] = "1"  # log lines of several workers stay whole
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        async with httpx.AsyncClient(timeout=2) as http:
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise AssertionError(f"the proxy exited early:\n{self.output()}")
                try:
                    ready = await http.get(f"http://127.0.0.1:{self.port}/readyz")
                    if ready.status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"the proxy was not ready in {READY_TIMEOUT} s:\n{self.output()}")

    def kill(self) -> None:
        """SIGKILL: no cleanup handler of the proxy runs."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextmanager
def running(server: Server) -> Iterator[Server]:
    server.start()
    try:
        yield server
    finally:
        server.kill()


@asynccontextmanager
async def client_of(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=server.base_url, api_key=TENANT_KEY, max_retries=0, timeout=STREAM_TIMEOUT
    )
    try:
        yield client
    finally:
        await client.close()


def texts(items: list[Any]) -> list[str]:
    """The text of each message item (SDK models or raw dicts), in order."""
    out = []
    for item in items:
        content = item["content"] if isinstance(item, dict) else item.content
        if isinstance(content, str):
            out.append(content)
        else:
            parts = [p["text"] if isinstance(p, dict) else p.text for p in content]
            out.append("".join(parts))
    return out


async def conversation_texts(client: openai.AsyncOpenAI, conversation_id: str) -> list[str]:
    items = [item async for item in client.conversations.items.list(conversation_id, order="asc")]
    return texts(items)


async def stream_until_first_delta(
    client: openai.AsyncOpenAI, conversation_id: str, server: Server
) -> str:
    """Starts a slow streamed turn, kills the proxy once text reaches the client, and
    returns the response id from its `response.created` event."""
    stream = await client.responses.create(
        model="gpt-4o", conversation=conversation_id, input="Tell me a long story.", stream=True
    )
    try:
        response_id = await read_until_first_delta(stream)
        server.kill()
    finally:
        await stream.close()
    return response_id


async def read_until_first_delta(stream: Any) -> str:
    """Reads a Responses stream until its first text delta; the `response.created` id."""
    response_id = None
    async with asyncio.timeout(STREAM_TIMEOUT):
        async for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.output_text.delta":
                break
    assert response_id is not None, "no response.created event before the text"
    return response_id


async def test_sigkill_mid_stream_leaves_an_incomplete_response_and_no_partial_items(
    tmp_path: Path, provider: FakeProvider
) -> None:
    write_policies(tmp_path / "policies")
    assert provider.base_url is not None
    with running(Server(tmp_path, provider.base_url)) as first:
        await first.wait_ready()
        async with client_of(first) as client:
            conversation = await client.conversations.create()
            done = await client.responses.create(
                model="gpt-4o", conversation=conversation.id, input="My order is ORD-7."
            )
            assert done.status == "completed"
            provider.script.append(Reply(text=SLOW_TEXT, stream_chunk_delay=0.3))
            cut_id = await stream_until_first_delta(client, conversation.id, first)
    assert first.process is not None and first.process.returncode == -signal.SIGKILL

    completed_turn = ["My order is ORD-7.", done.output_text]
    with running(Server(tmp_path, provider.base_url)) as second:
        await second.wait_ready()
        async with client_of(second) as client:
            cut = await client.responses.retrieve(cut_id)
            assert cut.status == "incomplete"
            assert await conversation_texts(client, conversation.id) == completed_turn

            after = await client.responses.create(
                model="gpt-4o", conversation=conversation.id, input="Which order was it?"
            )
            assert after.status == "completed"
            sent = provider.model_requests[-1].json
            assert texts(sent["input"]) == [*completed_turn, "Which order was it?"]
            assert await conversation_texts(client, conversation.id) == [
                *completed_turn,
                "Which order was it?",
                after.output_text,
            ]
