"""`threadkeeper` command line: serve, demo, count, project, policy, threads, ledger,
compaction, models."""

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
    threads = sub.add_parser(
        "threads", help="list, show, find, fork, export, import, delete threads"
    )
    verbs = threads.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="threads, newest first")
    _scope_options(listing, "threads")
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
            command.add_argument(
                "--at", metavar="ITEM", help="the last item to copy: its id or its seq"
            )
        if name == "delete":
            command.add_argument(
                "--erase",
                action="store_true",
                help="also its responses, idempotency records, ledger entries, explain "
                "records and summaries (works on a deleted thread's id with --tenant)",
            )
        if name == "export":
            command.add_argument("--format", choices=("jsonl", "openai"), default="jsonl")
    explaining = verbs.add_parser("explain", help="what one model request sent, and why")
    explaining.add_argument("request_id", help="the x-threadkeeper-request-id header")
    explaining.add_argument("--tenant")
    finding = verbs.add_parser(
        "find", help="the thread behind a response id (resp_...) or a request id (req_...)"
    )
    finding.add_argument("id", help="a response id, or an x-threadkeeper-request-id")
    finding.add_argument("--tenant", help="needed only when the id exists in two tenants")
    importing = verbs.add_parser(
        "import", help="a new thread from what `threads export` printed (jsonl or openai)"
    )
    importing.add_argument("file", help="the export file, or - for stdin")
    importing.add_argument("--tenant", help="a configured tenant, instead of the file's")
    importing.add_argument(
        "--namespace",
        help="import into this store namespace even though no policy names it "
        "(a passthrough caller's)",
    )
    importing.add_argument("--id", help="instead of the file's thread id")
    importing.add_argument("--policies", help="the policies directory naming the tenants")
    for command in verbs.choices.values():
        _store_options(command)

    ledger = sub.add_parser("ledger", help="side-effecting calls: list, show, resolve")
    ledger_verbs = ledger.add_subparsers(dest="verb", required=True)
    listing = ledger_verbs.add_parser("list", help="entries, oldest first")
    _scope_options(listing, "the entries'")
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
    _scope_options(show, "the item's")
    _store_options(show)  # the key: THREADKEEPER_COMPACTION_KEY, else the store's

    models = sub.add_parser(
        "models",
        help="per model: its window and where it came from, its tokenizer, and the count "
        "correction the provider's answers taught",
    )
    models.add_argument("--tenant", help="one tenant (default: every tenant)")
    models.add_argument("--policies", help="policy directory (as for serve)")
    models.add_argument("--limit", type=int, default=1000)
    _store_options(models)


def _scope_options(command: argparse.ArgumentParser, what: str) -> None:
    """A tenant (its passthrough callers included) or one namespace (proxy/namespaces.py)."""
    command.add_argument(
        "--tenant", help=f"{what} tenant; `default` includes every passthrough caller"
    )
    command.add_argument(
        "--namespace", help="one namespace, e.g. a passthrough caller's default:<hash>"
    )


def _scope(args: argparse.Namespace) -> Any:
    from proxy.admin import AdminError
    from proxy.namespaces import Scope

    try:
        return Scope(tenant=args.tenant, namespace=args.namespace)
    except ValueError as exc:
        raise AdminError(str(exc)) from None


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
        "check", help="validate a policy directory; exit 2 listing each file, field and problem"
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
            "file", help="JSON file (- for stdin): a Chat/Responses request or a list of messages"
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
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at exit
    except BrokenPipeError:
        # Not a failure of the command: stop writing, quietly, as a program killed by
        # SIGPIPE would (Python ignores the signal and raises this instead).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    return code


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        from proxy.demo import run_demo

        return run_demo(turns=args.turns, window=args.window, serve=args.serve)
    if args.command == "policy":
        return _policy(args)
    if args.command in ("threads", "ledger", "compaction", "models"):
        return _operator(args)
    from proxy.admin import AdminError

    try:
        request = _load_request(args.file, args.model)
    except AdminError as exc:
        print(f"threadkeeper: {exc}", file=sys.stderr)
        return 2
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
        return 2
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
    store = await _open_store(args, create=args.command == "threads" and args.verb == "import")
    try:
        if args.command == "ledger":
            return await _ledger(store, args)
        if args.command == "models":
            return await _models(store, args)
        return await _threads(store, args)
    finally:
        await store.close()


async def _models(store: Any, args: argparse.Namespace) -> str:
    """What `threadkeeper models` prints: one row per (tenant, upstream, model) the store
    holds something about, read with the tenant's policy (its window and tokenizer)."""
    from proxy import admin
    from proxy.core.tokens import encoding_name_for_model
    from proxy.native_tokenizers import is_mistral_name, mistral_default
    from proxy.policy import PolicyError, PolicyRegistry
    from proxy.server.model_budget import from_state, model_window
    from proxy.settings import load_settings

    cli = {"store": args.store, "config": args.config, "policies": args.policies}
    settings = load_settings(cli, os.environ)
    try:
        registry = PolicyRegistry.load(settings.policies_dir)
    except PolicyError as exc:
        raise admin.AdminError(f"cannot read the policies: {exc}") from None
    rows = []
    for record in await store.learned_list(args.tenant, limit=args.limit):
        learned = from_state(record.state)
        policy = registry.get(record.tenant)
        if policy is not None:
            window, source = model_window(policy, record.model, learned)
            named = policy.tokenizer_for(record.model)
            if named is None and is_mistral_name(record.model):
                named = mistral_default(record.model)
            tokenizer = named.name if named is not None else None
            if policy.counts_with_provider(record.model):
                tokenizer = "provider"
        else:
            window, source, tokenizer = learned.window or learned.discovered or 0, "learned", None
        rows.append(
            {
                "tenant": record.tenant,
                "upstream": record.upstream,
                "model": record.model,
                "window": window,
                "window_source": source,
                "tokenizer": tokenizer or f"tiktoken:{encoding_name_for_model(record.model)}",
                "ratio": round(learned.ratio, 4),
                "overhead_per_item": round(learned.overhead, 2),
                "answers": learned.answers,
                "updated_at": record.updated_at,
            }
        )
    if args.json:
        return json.dumps(rows, indent=2)
    if not rows:
        return "nothing learnt yet: no model has answered through the proxy"
    columns = ("tenant", "model", "window", "from", "tokenizer", "ratio", "+/item", "answers")
    cells = tuple(
        (
            r["tenant"],
            r["model"],
            str(r["window"]),
            r["window_source"],
            r["tokenizer"],
            f"{r['ratio']:.3f}",
            f"{r['overhead_per_item']:.1f}",
            str(r["answers"]),
        )
        for r in rows
    )
    return admin.table(admin.Row(columns, cells))


async def _open_store(args: argparse.Namespace, *, create: bool = False) -> Any:
    """The store `serve` would open. Only a command that writes a thread (`create`) makes
    a SQLite file that is not there: the others would read an empty store and answer as
    if it held nothing, leaving a stray file behind."""
    import sqlite3

    from proxy.admin import AdminError
    from proxy.settings import load_settings
    from proxy.store import open_store

    settings = load_settings({"store": args.store, "config": args.config}, os.environ)
    if not create:
        _refuse_a_missing_sqlite_file(settings.store_url)
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


def _refuse_a_missing_sqlite_file(url: str) -> None:
    from proxy.admin import AdminError
    from proxy.store.sqlite import MEMORY, sqlite_path

    try:
        path = sqlite_path(url)
    except ValueError:  # not a SQLite URL, or a bad one: open_store says what is wrong
        return
    if path != MEMORY and not Path(path).exists():
        raise AdminError(
            f"there is no store at {path} ({url}): pass --store, or set THREADKEEPER_STORE "
            "or the config file's store:, as for serve"
        )


async def _threads(store: Any, args: argparse.Namespace) -> str:
    from proxy import admin

    if args.verb == "list":
        threads = await admin.list_threads(store, _scope(args), args.limit)
        return _shown(args, threads, lambda: admin.table(admin.threads_table(threads)))
    if args.verb == "show":
        shown = await admin.show_thread(store, args.id, args.tenant)
        return _shown(args, shown, lambda: admin.show_text(shown))
    if args.verb == "delete" and args.erase:
        erased = await admin.erase_thread(store, args.id, args.tenant)
        return _shown(args, erased, lambda: admin.erased_text(erased))
    if args.verb == "delete":
        deleted = await admin.delete_thread(store, args.id, args.tenant)
        return _shown(args, deleted, lambda: f"deleted thread {deleted['id']}")
    if args.verb == "fork":
        fork = await admin.fork_thread(store, args.id, args.tenant, args.at)
        return _shown(args, fork, lambda: f"forked into {fork['id']} ({fork['items']} items)")
    if args.verb == "explain":
        record = await admin.explain_request(store, args.request_id, args.tenant)
        return _shown(args, record, lambda: admin.explain_text(record))
    if args.verb == "find":
        found = await admin.find_thread(store, args.id, args.tenant)
        return _shown(args, found, lambda: admin.find_text(found))
    if args.verb == "export":
        lines = await admin.export_thread(store, args.id, args.tenant, args.format)
        if args.format == "openai":
            return json.dumps(lines, ensure_ascii=False, indent=2)
        return "\n".join(json.dumps(line, ensure_ascii=False) for line in lines)
    imported = await admin.import_thread(
        store,
        read_input(args.file),
        tenants=[] if args.namespace is not None else _configured_tenants(args),
        tenant=args.tenant,
        namespace=args.namespace,
        thread_id=args.id,
    )
    return _shown(
        args, imported, lambda: f"imported thread {imported['id']} ({imported['items']} items)"
    )


def _configured_tenants(args: argparse.Namespace) -> list[str]:
    """The tenants the policies directory `serve` reads defines (its bad files aside)."""
    from proxy.admin import AdminError
    from proxy.policy import PolicyError, check_directory
    from proxy.settings import load_settings

    cli = {"store": args.store, "config": args.config, "policies": args.policies}
    directory = load_settings(cli, os.environ).policies_dir
    try:
        tenants, _ = check_directory(directory)
    except PolicyError as exc:
        raise AdminError(f"{exc}: pass --policies DIR, or --namespace NS") from None
    return tenants


def read_input(name: str) -> str:
    """The text of file `name`, or of stdin for "-"; unreadable: one AdminError line."""
    from proxy.admin import AdminError

    try:
        if name == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        return Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        shown = "stdin" if name == "-" else name
        raise AdminError(f"cannot read {shown}: {exc}") from None


async def _ledger(store: Any, args: argparse.Namespace) -> str:
    from proxy import admin

    if args.verb == "list":
        entries = await admin.ledger_list(store, _scope(args), args.status, args.limit)
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
    scope = _scope(args)
    if scope.tenant is None and scope.namespace is None:
        raise AdminError("compaction show: pass --tenant or --namespace")
    settings = load_settings({"store": args.store, "config": args.config}, os.environ)
    if settings.compaction_key is not None and scope.namespace is not None:
        key, namespaces = CompactionKey(settings.compaction_key), [scope.namespace]
    else:  # the store holds the key, or the namespaces of the tenant's callers
        store = await _open_store(args)
        try:
            if settings.compaction_key is not None:
                key = CompactionKey(settings.compaction_key)
            else:
                key = await stored_key(store, SYSTEM_CLOCK, create=False)
            namespaces = await compaction_namespaces(store, scope)
        except LookupError as exc:
            raise AdminError(str(exc)) from None
        finally:
            await store.close()
    entries = []
    for blob in blobs:
        problem = None
        for namespace in namespaces:
            try:
                entries.append(shown(key, namespace, key.open(namespace, blob)))
                break
            except CompactionError as exc:
                problem = problem or exc
        else:
            raise AdminError(f"compaction show ({scope.describe()}): {problem}")
    data = entries if len(entries) > 1 else entries[0]
    return _shown(args, data, lambda: "\n".join(map(_compaction_text, entries)))


CALLER_NAMESPACES_TRIED = 100_000  # compaction show --tenant: at most this many namespaces


async def compaction_namespaces(store: Any, scope: Any) -> list[str]:
    """The namespaces a compaction item may be sealed for: the one asked, or the tenant's
    own, then its passthrough callers' that hold a thread or a response (a caller's item
    is sealed for its namespace, so `--tenant default` finds it)."""
    if scope.namespace is not None:
        return [scope.namespace]
    known = await store.namespaces(scope.tenant, limit=CALLER_NAMESPACES_TRIED)
    return list(dict.fromkeys([scope.tenant, *known]))


def _compaction_text(entry: dict[str, Any]) -> str:
    from proxy.namespaces import label

    head = f"compaction {entry['id']}  {label(entry['namespace'])}  covers {entry['covers']} items"
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


def _load_request(name: str, model: str | None) -> dict[str, Any]:
    """The request in file `name` (- for stdin), through the HTTP API's checks of what
    the count reads: a problem is one AdminError line."""
    from proxy.admin import AdminError
    from proxy.core.validate import (
        ApiError,
        NotJson,
        check_json_tree,
        json_type,
        list_of_objects,
        load_json,
        optional,
        validate_chat_message,
        validate_input_item,
    )

    shown = "stdin" if name == "-" else name
    try:
        data = load_json(read_input(name))
    except NotJson as exc:
        raise AdminError(f"{shown}: not JSON ({exc})") from None
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict):
        raise AdminError(
            f"{shown}: expected a Chat or Responses request (an object) or a list of "
            f"messages, got {json_type(data)}"
        )
    try:
        check_json_tree(data)
        if "messages" in data:
            for index, message in enumerate(list_of_objects(data["messages"], "messages")):
                validate_chat_message(message, f"messages[{index}]")
        elif not isinstance(data.get("input"), str | None):
            for index, item in enumerate(list_of_objects(data["input"], "input")):
                validate_input_item(item, f"input[{index}]")
        list_of_objects(optional(data, "tools", list) or [], "tools")
        optional(data, "instructions", str)
        data["model"] = model or optional(data, "model", str) or "gpt-4o"
    except ApiError as exc:
        raise AdminError(f"{shown}: {exc.message}") from None
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
