"""`threadkeeper` command line: serve, demo, count, project, compaction show."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="threadkeeper", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--policies", help="directory of tenant policy files")
    serve.add_argument("--store", help="sqlite:///path or postgresql://...")
    serve.add_argument("--upstream", help="provider base URL, e.g. https://api.openai.com/v1")
    serve.add_argument("--config", help="YAML config file")
    serve.add_argument(
        "--workers",
        help="serving processes on the one port (SO_REUSEPORT), default 1",
    )
    serve.add_argument(
        "--metrics-token",
        help="bearer token GET /metrics requires (prefer THREADKEEPER_METRICS_TOKEN)",
    )

    compaction = sub.add_parser("compaction", help="read threadkeeper's compaction items")
    compaction_sub = compaction.add_subparsers(dest="compaction_command", required=True)
    show = compaction_sub.add_parser(
        "show", help="print the decrypted summary a compaction item holds (operators)"
    )
    show.add_argument(
        "source",
        help="an encrypted_content (tkc1....), or a file holding one, a compaction item, "
        "or a compact / Responses answer",
    )
    show.add_argument("--tenant", required=True, help="the tenant the compaction belongs to")
    show.add_argument("--store", help="the store `serve` uses (for the key it created)")
    show.add_argument("--config", help="YAML config file, as for `serve`")
    show.add_argument("--json", action="store_true", help="JSON for scripts")

    demo = sub.add_parser("demo", help="run the proxy against a built-in scripted provider")
    demo.add_argument("--turns", type=int, default=8)
    demo.add_argument("--window", type=int, default=4000)

    for name, text in (
        ("count", "count the prompt tokens of a JSON request or message list"),
        ("project", "rebuild a JSON request or message list under a window and print the report"),
    ):
        command = sub.add_parser(name, help=text)
        command.add_argument(
            "file", help="JSON file: a Chat/Responses request or a list of messages"
        )
        command.add_argument("--model", default=None)
        if name == "project":
            command.add_argument("--window", type=int, required=True)
            command.add_argument("--output", type=int, default=2000, help="output reserve O")
            command.add_argument("--margin", type=int, default=500, help="safety margin epsilon")
            command.add_argument("--keep-recent-turns", type=int, default=3)
            command.add_argument("--tool-result-max-tokens", type=int, default=800)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "compaction":
        return _compaction_show(args)
    if args.command == "demo":
        from proxy.demo import run_demo

        return run_demo(turns=args.turns, window=args.window)
    request = _load_request(Path(args.file), args.model)
    if args.command == "count":
        return _count(request)
    return _project(request, args)


def _serve(args: argparse.Namespace) -> int:
    from proxy.logs import configure_logging
    from proxy.policy import PolicyError
    from proxy.server.workers import serve
    from proxy.settings import SettingsError, load_settings

    cli = {
        "host": args.host,
        "port": args.port,
        "policies": args.policies,
        "store": args.store,
        "upstream": args.upstream,
        "config": args.config,
        "metrics-token": args.metrics_token,
        "workers": args.workers,
    }
    try:
        settings = load_settings(cli, os.environ)
        configure_logging(settings.log_level)
        return serve(settings)
    except (SettingsError, PolicyError) as exc:
        print(f"threadkeeper: cannot start: {exc}", file=sys.stderr)
        return 2


def _compaction_show(args: argparse.Namespace) -> int:
    """Exit 2 with one line on stderr when the source, settings, store or key is wrong."""
    import asyncio

    from proxy.core.compaction import CompactionError
    from proxy.settings import SettingsError, load_settings

    try:
        settings = load_settings({"store": args.store, "config": args.config}, os.environ)
        blobs = compaction_blobs(args.source)
        try:
            key = asyncio.run(_compaction_key(settings))
        except LookupError:
            raise
        except Exception as exc:  # an unreachable or foreign store: one line, not a trace
            raise LookupError(f"cannot read the compaction key from the store: {exc}") from None
        shown = [_shown_compaction(key, args.tenant, blob) for blob in blobs]
    except (SettingsError, CompactionError, LookupError, OSError, ValueError) as exc:
        print(f"threadkeeper: compaction show: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(shown if len(shown) > 1 else shown[0], indent=2, ensure_ascii=False))
        return 0
    for entry in shown:
        print(f"compaction {entry['id']}  tenant {entry['tenant']}  covers {entry['covers']} items")
        print(entry["text"])
    return 0


def compaction_blobs(source: str) -> list[str]:
    """The encrypted_content values `source` gives: itself when it is one, else those in
    the file it names (a bare blob, a compaction item, or an answer holding items)."""
    from proxy.core.compaction import BLOB_PREFIX

    if source.startswith(BLOB_PREFIX):
        return [source]
    text = Path(source).read_text(encoding="utf-8").strip()
    if text.startswith(BLOB_PREFIX):
        return [text]
    found: list[str] = []
    _collect_blobs(json.loads(text), found)
    if not found:
        raise ValueError(f"{source} holds no compaction item")
    return found


def _collect_blobs(value: Any, found: list[str]) -> None:
    if isinstance(value, dict):
        if value.get("type") == "compaction" and isinstance(value.get("encrypted_content"), str):
            found.append(value["encrypted_content"])
            return
        for inner in value.values():
            _collect_blobs(inner, found)
    elif isinstance(value, list):
        for inner in value:
            _collect_blobs(inner, found)


async def _compaction_key(settings: Any) -> Any:
    """The configured key, else the one the store holds (never created here)."""
    from proxy.clock import SYSTEM_CLOCK
    from proxy.core.compaction import CompactionKey
    from proxy.server.compaction import stored_key
    from proxy.store import open_store

    if settings.compaction_key is not None:
        return CompactionKey(settings.compaction_key)
    store = await open_store(
        settings.store_url,
        connect_timeout=settings.store_connect_timeout,
        command_timeout=settings.store_command_timeout,
    )
    try:
        return await stored_key(store, SYSTEM_CLOCK, create=False)
    finally:
        await store.close()


def _shown_compaction(key: Any, tenant: str, blob: str) -> dict[str, Any]:
    from proxy.server.compaction import shown

    result: dict[str, Any] = shown(key, tenant, key.open(tenant, blob))
    return result


def _load_request(path: Path, model: str | None) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if isinstance(data, list):
        data = {"messages": data}
    data["model"] = model or data.get("model") or "gpt-4o"
    return data


def _items_of(request: dict[str, Any]):  # type: ignore[no-untyped-def]
    from proxy.core.items import items_from_chat, items_from_responses_input

    if "messages" in request:
        return items_from_chat(request["messages"]), "chat"
    return list(items_from_responses_input(request.get("input") or []).items), "responses"


def _count(request: dict[str, Any]) -> int:
    from proxy.core.tokens import TokenCounter

    counter = TokenCounter.for_model(request["model"])
    items, api = _items_of(request)
    tools = request.get("tools") or []
    if api == "chat":
        total = counter.chat_prompt([i.raw for i in items], tools)
    else:
        total = counter.responses_prompt(items, request.get("instructions"), tools)
    print(
        json.dumps(
            {
                "model": request["model"],
                "encoding": counter.encoding.name,
                "items": len(items),
                "tools_tokens": counter.tools(tools),
                "prompt_tokens": total,
            },
            indent=2,
        )
    )
    return 0


def _project(request: dict[str, Any], args: argparse.Namespace) -> int:
    from proxy.core.projection import (
        ContextLengthExceeded,
        ProjectionPolicy,
        ProjectionRequest,
        project_context,
    )
    from proxy.core.tokens import TokenCounter

    counter = TokenCounter.for_model(request["model"])
    items, _ = _items_of(request)
    instructions = request.get("instructions")
    projection_request = ProjectionRequest(
        items=items,
        window=args.window,
        output=args.output,
        epsilon=args.margin,
        tools_tokens=counter.tools(request.get("tools") or []),
        instructions_tokens=counter.text(instructions) + 3 if instructions else 0,
    )
    policy = ProjectionPolicy(
        keep_recent_turns=args.keep_recent_turns,
        tool_result_max_tokens=args.tool_result_max_tokens,
    )
    try:
        projection = project_context(projection_request, counter, policy)
    except ContextLengthExceeded as exc:
        print(json.dumps({"error": str(exc), "report": exc.report.as_dict()}, indent=2))
        return 1
    print(json.dumps(projection.report.as_dict(), indent=2))
    return 0
