"""`threadkeeper` command line: serve, demo, count, project, policy, threads, ledger,
compaction."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _store_options(command: argparse.ArgumentParser) -> None:
    """The store `serve` would open: --store, else THREADKEEPER_STORE, else the config."""
    command.add_argument("--store", help="sqlite:///path or postgresql://... (as for serve)")
    command.add_argument("--config", help="YAML config file (as for serve)")
    command.add_argument("--json", action="store_true", help="JSON for scripts")


def _operator_commands(sub: Any) -> None:
    threads = sub.add_parser("threads", help="list, show, fork, export, import, delete threads")
    verbs = threads.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="threads, newest first")
    listing.add_argument("--tenant")
    listing.add_argument("--limit", type=int, default=50)
    for name, text in (
        ("show", "the log, the cut point, the summaries and compressed results"),
        ("delete", "delete the thread and its items"),
        ("fork", "a new thread with a copy of the items (up to --at ITEM)"),
        ("export", "print the thread: jsonl (re-importable) or openai (Responses input)"),
    ):
        command = verbs.add_parser(name, help=text)
        command.add_argument("id")
        command.add_argument("--tenant", help="needed only when the id exists in two tenants")
        if name == "fork":
            command.add_argument("--at", metavar="ITEM", help="last item id to copy")
        if name == "export":
            command.add_argument("--format", choices=("jsonl", "openai"), default="jsonl")
    explaining = verbs.add_parser("explain", help="what one model request sent, and why")
    explaining.add_argument("request_id", help="the x-threadkeeper-request-id header")
    explaining.add_argument("--tenant")
    importing = verbs.add_parser("import", help="a new thread from an exported jsonl file")
    importing.add_argument("file", type=Path)
    importing.add_argument("--tenant", help="instead of the file's tenant")
    importing.add_argument("--id", help="instead of the file's thread id")
    for command in verbs.choices.values():
        _store_options(command)

    ledger = sub.add_parser("ledger", help="side-effecting calls: list, show, resolve")
    ledger_verbs = ledger.add_subparsers(dest="verb", required=True)
    listing = ledger_verbs.add_parser("list", help="entries, oldest first")
    listing.add_argument("--tenant")
    listing.add_argument("--status", choices=("issued", "completed", "failed"))
    listing.add_argument("--limit", type=int, default=50)
    for name, text in (
        ("show", "one entry"),
        ("resolve", "settle an issued entry whose outcome the client never reported"),
    ):
        command = ledger_verbs.add_parser(name, help=text)
        command.add_argument("scope", help="tenant or thread:<id>")
        command.add_argument("key")
        command.add_argument("--tenant", required=True)
        if name == "resolve":
            command.add_argument("--status", choices=("completed", "failed"), required=True)
            command.add_argument("--result", help="the tool's result, when completed")
    for command in ledger_verbs.choices.values():
        _store_options(command)

    compaction = sub.add_parser("compaction", help="read threadkeeper's compaction items")
    compaction_verbs = compaction.add_subparsers(dest="verb", required=True)
    show = compaction_verbs.add_parser(
        "show", help="the decrypted summary a compaction item holds, for the tenant owning it"
    )
    show.add_argument(
        "source",
        help="an encrypted_content (tkc1....), or a file holding one, a compaction item, "
        "or an answer holding compaction items",
    )
    show.add_argument("--tenant", required=True)
    _store_options(show)  # the key: THREADKEEPER_COMPACTION_KEY, else the store's


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
    serve.add_argument(
        "--operator-token",
        help="turns on the thread inspector at /threadkeeper/ui/ for this token "
        "(prefer THREADKEEPER_OPERATOR_TOKEN)",
    )

    demo = sub.add_parser("demo", help="run the proxy against a built-in scripted provider")
    demo.add_argument("--turns", type=int, default=8)
    demo.add_argument("--window", type=int, default=3000)
    demo.add_argument(
        "--serve",
        action="store_true",
        help="keep running afterwards with the thread inspector on (prints its URL and token)",
    )

    policy = sub.add_parser("policy", help="validate policy files or print their JSON Schema")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    check = policy_sub.add_parser(
        "check", help="validate a policy directory; exit 1 listing file, field and problem"
    )
    check.add_argument("directory", type=Path)
    schema = policy_sub.add_parser("schema", help="print the policy JSON Schema (editors, CI)")
    schema.add_argument(
        "--markdown", action="store_true", help="the policy reference (docs/policy.md) instead"
    )

    _operator_commands(sub)

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
    if args.command == "demo":
        from proxy.demo import run_demo

        return run_demo(turns=args.turns, window=args.window, serve=args.serve)
    if args.command == "policy":
        return _policy(args)
    if args.command in ("threads", "ledger", "compaction"):
        return _operator(args)
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
        "operator-token": args.operator_token,
        "workers": args.workers,
    }
    try:
        settings = load_settings(cli, os.environ)
        configure_logging(settings.log_level)
        return serve(settings)
    except (SettingsError, PolicyError) as exc:
        print(f"threadkeeper: cannot start: {exc}", file=sys.stderr)
        return 2


def _policy(args: argparse.Namespace) -> int:
    from proxy.policy import PolicyError, check_directory, policy_schema

    if args.policy_command == "schema":
        if args.markdown:
            from proxy.policydoc import policy_reference

            print(policy_reference(), end="")
        else:
            print(json.dumps(policy_schema(), indent=2, sort_keys=True))
        return 0
    try:
        tenants, errors = check_directory(args.directory)
    except PolicyError as exc:
        print(f"threadkeeper: {exc}", file=sys.stderr)
        return 2
    for error in errors:
        print(error, file=sys.stderr)
    if errors:
        return 1
    print(f"ok: {len(tenants)} tenant policies ({', '.join(tenants)})")
    return 0


def _operator(args: argparse.Namespace) -> int:
    import asyncio

    from proxy.admin import AdminError
    from proxy.settings import SettingsError
    from proxy.store.base import StoreError

    try:
        output = asyncio.run(_run_operator(args))
    except (AdminError, SettingsError, StoreError) as exc:
        print(f"threadkeeper: {exc}", file=sys.stderr)
        return 2
    print(output)
    return 0


async def _run_operator(args: argparse.Namespace) -> str:
    from proxy import admin

    if getattr(args, "limit", 1) < 1:
        raise admin.AdminError("--limit must be at least 1")
    if args.command == "compaction":
        return await _compaction(args)
    store = await _open_store(args)
    try:
        if args.command == "ledger":
            return await _ledger(store, args)
        return await _threads(store, args)
    finally:
        await store.close()


async def _open_store(args: argparse.Namespace) -> Any:
    import sqlite3

    from proxy.admin import AdminError
    from proxy.settings import load_settings
    from proxy.store import open_store

    settings = load_settings({"store": args.store, "config": args.config}, os.environ)
    try:
        store = await open_store(
            settings.store_url,
            connect_timeout=settings.store_connect_timeout,
            command_timeout=settings.store_command_timeout,
        )
    except (ValueError, OSError, sqlite3.Error) as exc:
        raise AdminError(f"cannot open the store {settings.store_url!r}: {exc}") from None
    await store.migrate()
    return store


async def _threads(store: Any, args: argparse.Namespace) -> str:
    from proxy import admin

    if args.verb == "list":
        threads = await admin.list_threads(store, args.tenant, args.limit)
        return _shown(args, threads, lambda: admin.table(admin.threads_table(threads)))
    if args.verb == "show":
        shown = await admin.show_thread(store, args.id, args.tenant)
        return _shown(args, shown, lambda: admin.show_text(shown))
    if args.verb == "delete":
        deleted = await admin.delete_thread(store, args.id, args.tenant)
        return _shown(args, deleted, lambda: f"deleted thread {deleted['id']}")
    if args.verb == "fork":
        fork = await admin.fork_thread(store, args.id, args.tenant, args.at)
        return _shown(args, fork, lambda: f"forked into {fork['id']} ({fork['items']} items)")
    if args.verb == "explain":
        record = await admin.explain_request(store, args.request_id, args.tenant)
        return _shown(args, record, lambda: admin.explain_text(record))
    if args.verb == "export":
        lines = await admin.export_thread(store, args.id, args.tenant, args.format)
        if args.format == "openai":
            return json.dumps(lines, ensure_ascii=False, indent=2)
        return "\n".join(json.dumps(line, ensure_ascii=False) for line in lines)
    try:
        text = args.file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise admin.AdminError(f"cannot read {args.file}: {exc}") from None
    imported = await admin.import_thread(store, text.splitlines(), args.tenant, args.id)
    return _shown(
        args, imported, lambda: f"imported thread {imported['id']} ({imported['items']} items)"
    )


async def _ledger(store: Any, args: argparse.Namespace) -> str:
    from proxy import admin

    if args.verb == "list":
        entries = await admin.ledger_list(store, args.tenant, args.status, args.limit)
        return _shown(args, entries, lambda: admin.table(admin.ledger_table(entries)))
    if args.verb == "show":
        entry = await admin.ledger_show(store, args.tenant, args.scope, args.key)
    else:
        entry = await admin.ledger_resolve(
            store, args.tenant, args.scope, args.key, args.status, args.result
        )
    return _shown(args, entry, lambda: "\n".join(f"{k}: {v}" for k, v in entry.items()))


async def _compaction(args: argparse.Namespace) -> str:
    """The compactions `args.source` holds, opened with the key `serve` uses."""
    from proxy.admin import AdminError
    from proxy.clock import SYSTEM_CLOCK
    from proxy.core.compaction import CompactionError, CompactionKey
    from proxy.server.compaction import shown, stored_key
    from proxy.settings import load_settings

    blobs = compaction_blobs(args.source)
    settings = load_settings({"store": args.store, "config": args.config}, os.environ)
    if settings.compaction_key is not None:
        key = CompactionKey(settings.compaction_key)
    else:
        store = await _open_store(args)
        try:
            key = await stored_key(store, SYSTEM_CLOCK, create=False)
        except LookupError as exc:
            raise AdminError(str(exc)) from None
        finally:
            await store.close()
    try:
        entries = [shown(key, args.tenant, key.open(args.tenant, blob)) for blob in blobs]
    except CompactionError as exc:
        raise AdminError(f"compaction show: {exc}") from None
    data = entries if len(entries) > 1 else entries[0]
    return _shown(args, data, lambda: "\n".join(map(_compaction_text, entries)))


def _compaction_text(entry: dict[str, Any]) -> str:
    head = f"compaction {entry['id']}  tenant {entry['tenant']}  covers {entry['covers']} items"
    return f"{head}\n{entry['text']}"


def compaction_blobs(source: str) -> list[str]:
    """The encrypted_content values `source` gives: itself when it is one, else those in
    the file it names (a bare blob, a compaction item, or an answer holding items)."""
    from proxy.admin import AdminError
    from proxy.core.compaction import BLOB_PREFIX

    if source.startswith(BLOB_PREFIX):
        return [source]
    try:
        text = Path(source).read_text(encoding="utf-8").strip()
        found = [text] if text.startswith(BLOB_PREFIX) else _blobs_in(json.loads(text))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AdminError(f"cannot read {source}: {exc}") from None
    if not found:
        raise AdminError(f"{source} holds no compaction item")
    return found


def _blobs_in(value: Any) -> list[str]:
    if isinstance(value, dict):
        if value.get("type") == "compaction" and isinstance(value.get("encrypted_content"), str):
            return [value["encrypted_content"]]
        return [blob for inner in value.values() for blob in _blobs_in(inner)]
    if isinstance(value, list):
        return [blob for inner in value for blob in _blobs_in(inner)]
    return []


def _shown(args: argparse.Namespace, data: Any, human: Any) -> str:
    return json.dumps(data, ensure_ascii=False, indent=2) if args.json else str(human())


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
                "encoding": counter.tokenizer_id,
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
        instructions_tokens=counter.instructions(instructions),
        reply_tokens=counter.reply_tokens,
        stateless=True,  # one request on its own, as a stateless client's is projected
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
