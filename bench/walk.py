"""The walk of one stateful Responses request: which proxy/ files it passes through.

    python bench/walk.py [--json]

Starts the provider stub (proxy/fake_provider.py) and the proxy (SQLite) in this
process on loopback, seeds a `previous_response_id` chain with one turn, then sends the
next turn of the chain through the real socket under `sys.setprofile`: every Python
call whose code lives under proxy/ (the stub's own file left out: it is the provider)
is recorded in call order while the handler runs (responses.create_response, from its
entry to its return, which comes after the commit: the middlewares around it are left
out). Calls made meanwhile by the app's background loops (proxy/periodic.py: heartbeats,
sweeps, the background runs' cancel watch) are not the request's and are left out too.

A coroutine resumed after an await is not a call (the profiler reports each resume as
one, in every frame of the awaiting chain: the middlewares around the handler included).
Two scopes are counted: the request path's own modules (proxy/server/, proxy/store/,
proxy/threads.py: where a reader follows the turn) and everything under proxy/ (the
pure core and shared helpers such as proxy/sse.py included). Printed for each: the
calls, the distinct files, the visits (consecutive calls in one file are one visit) and
the re-entries (visits to a file the walk had left); then the request path's files in
the order first visited, and the files the stem (the handler's module and
proxy/server/turn.py, where a reader starts) calls into directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.fake_provider import FakeProvider  # noqa: E402
from proxy.server.app import bound_port, create_app, start  # noqa: E402
from proxy.settings import Settings  # noqa: E402

PROXY_DIR = ROOT / "proxy"
PROVIDER_FILE = PROXY_DIR / "fake_provider.py"
PERIODIC_FILE = str(PROXY_DIR / "periodic.py")
POLICY = """\
tenant: default
allow_unknown_keys: true
models:
  "*": {context_window: 128000, max_output_tokens: 1000}
"""
HEADERS = {"Authorization": "Bearer sk-walk", "Content-Type": "application/json"}


HANDLER = ("create_response", str(PROXY_DIR / "server" / "responses.py"))
REQUEST_PATH = ("proxy/server/", "proxy/store/", "proxy/threads.py")
# The stem a reader starts from: the handler's module and the turn's.
STEM = {str(PROXY_DIR / "server" / "responses.py"), str(PROXY_DIR / "server" / "turn.py")}


class Walk:
    """The proxy/ files of each Python call once the handler is entered, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stages: list[str] = []  # the files the stem (the handler, run_turn) calls into
        self.handler: FrameType | None = None
        self.done = False
        self.frames: dict[int, FrameType] = {}  # held, so an id is never reused meanwhile

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "return" and frame is self.handler and isinstance(arg, web.StreamResponse):
            self.done = True  # returned (not suspended): what follows is the middlewares'
        if event != "call" or self.done:
            return
        if id(frame) in self.frames:
            return  # a coroutine resumed after an await: not a call
        self.frames[id(frame)] = frame
        path = code.co_filename
        if self.handler is None and (code.co_name, path) == HANDLER:
            self.handler = frame
        if self.handler is None or not path.startswith(str(PROXY_DIR)):
            return
        if path == str(PROVIDER_FILE) or in_background_loop(frame):
            return
        here = str(Path(path).relative_to(ROOT))
        self.calls.append(here)
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if caller in STEM and here != str(Path(caller).relative_to(ROOT)):
            self.stages.append(here)

    def summary(self) -> dict[str, Any]:
        path = [f for f in self.calls if f.startswith(REQUEST_PATH)]
        return {
            "request_path": counted(path),
            "all_proxy": counted(self.calls),
            "stages": list(dict.fromkeys(self.stages)),
        }


def in_background_loop(frame: FrameType) -> bool:
    """Whether a call is made under one of the app's periodic loops (not the request)."""
    caller = frame.f_back
    while caller is not None:
        if caller.f_code.co_filename == PERIODIC_FILE:
            return True
        caller = caller.f_back
    return False


def counted(calls: list[str]) -> dict[str, Any]:
    visits = [f for i, f in enumerate(calls) if i == 0 or calls[i - 1] != f]
    order = list(dict.fromkeys(visits))
    return {
        "calls": len(calls),
        "files": len(order),
        "visits": len(visits),
        "reentries": len(visits) - len(order),
        "order": order,
    }


async def turn(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body, headers=HEADERS) as response:
        answer: dict[str, Any] = await response.json()
        assert response.status == 200, answer
        return answer


def settings(directory: Path, upstream: str) -> Settings:
    policies = directory / "policies"
    policies.mkdir()
    (policies / "default.yaml").write_text(POLICY)
    return Settings(
        port=0,
        policies_dir=policies,
        upstream_url=upstream,
        store_url=f"sqlite:///{directory / 'walk.db'}",
    )


async def walk() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        provider = FakeProvider()
        upstream = await provider.start()
        config = settings(Path(tmp), upstream)
        runner = await start(config, create_app(config))
        url = f"http://127.0.0.1:{bound_port(runner)}/v1/responses"
        try:
            async with aiohttp.ClientSession() as session:
                first = await turn(session, url, {"model": "gpt-4o-mini", "input": "Hello."})
                warm = {"model": "gpt-4o-mini", "input": "Again.", "previous_response_id": ""}
                warm["previous_response_id"] = first["id"]
                second = await turn(session, url, warm)  # warms caches the walk should not see
                await asyncio.sleep(0.5)  # the middlewares finish the warm turn's tail
                body = {"model": "gpt-4o-mini", "input": "And once more."}
                body["previous_response_id"] = second["id"]
                tracer = Walk()
                with profiled(tracer):
                    await turn(session, url, body)
        finally:
            await runner.cleanup()
            await provider.stop()
    return tracer.summary()


class profiled:
    """sys.setprofile for the duration of a `with` block."""

    def __init__(self, tracer: Walk) -> None:
        self.tracer = tracer

    def __enter__(self) -> None:
        sys.setprofile(self.tracer)

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


def lines(summary: dict[str, Any]) -> Iterator[str]:
    for scope in ("request_path", "all_proxy"):
        s = summary[scope]
        yield (
            f"{scope}: {s['calls']} calls, {s['files']} files, {s['visits']} visits, "
            f"{s['reentries']} re-entries into a file already left"
        )
    yield "request path files in the order first visited:"
    for index, path in enumerate(summary["request_path"]["order"], 1):
        yield f"  {index:2d}. {path}"
    yield "files the stem (responses.py, turn.py) calls into, in order:"
    for index, path in enumerate(summary["stages"], 1):
        yield f"  {index:2d}. {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    summary = asyncio.run(walk())
    print(json.dumps(summary, indent=1) if args.json else "\n".join(lines(summary)))


if __name__ == "__main__":
    main()
