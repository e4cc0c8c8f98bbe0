"""HTML of the thread inspector's pages (proxy/server/inspector.py serves them).

Pure functions from the operator data of proxy/admin.py to a page. Thread text is hostile
input: every value goes through `esc` (text and attributes alike), nothing is marked safe.
No external assets: the style sheet and the one script are inline, and the script is only
a nicety (expand or collapse every text at once); <details> elements expand without it,
so every page reads with JavaScript off. The Content-Security-Policy allows that one
script by its hash and nothing else.
"""

from __future__ import annotations

import base64
import hashlib
import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from proxy import admin
from proxy.namespaces import is_caller, label

PREFIX = "/threadkeeper/ui"
FULL_TEXT_MAX = 20_000  # characters of one item's text on the timeline

SCRIPT = """\
document.querySelectorAll("[data-toggle-all]").forEach(function (button) {
  button.hidden = false;
  button.addEventListener("click", function () {
    var open = button.getAttribute("data-toggle-all") === "open";
    document.querySelectorAll("details").forEach(function (d) { d.open = open; });
  });
});
"""
_SCRIPT_HASH = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; "
        f"script-src 'sha256-{_SCRIPT_HASH}'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

STYLE = """\
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#fafbfc}
header{background:#1d2330;color:#fff;padding:.5em 1em;display:flex;flex-wrap:wrap;gap:.3em 1.5em;
align-items:center}header a{color:#fff}header .meta{color:#c8d0dc}header form{margin-left:auto}
main{padding:1em 1.5em;max-width:1200px}h1,.meta,td,th,.badge{overflow-wrap:anywhere}
table{border-collapse:collapse;margin:.5em 0;display:block;max-width:100%;overflow-x:auto}
td,th{border-bottom:1px solid #dde;padding:.25em .6em;text-align:left;vertical-align:top}
input{max-width:100%;box-sizing:border-box}
@media (max-width:600px){main{padding:.6em}header{padding:.4em .6em;gap:.3em .8em}h1{font-size:1.4em}}
pre{white-space:pre-wrap;word-break:break-word;margin:.3em 0;
background:#f0f2f5;padding:.4em}ol.timeline{list-style:none;padding:0}
.timeline li{border-left:3px solid #9ab;padding:.2em .6em;margin:.2em 0;background:#fff}
.timeline li.cut-away{opacity:.6;border-left-color:#ccc}.timeline li.pinned{border-left-color:#d90}
.timeline li.cut{border:0;border-top:2px dashed #c33;color:#c33;font-weight:bold;background:none}
.timeline li.summary{border-left-color:#36c;background:#eef3ff}
.timeline li.ledger{border-left-color:#a3a;background:#fbf0fb;margin-left:2em}
.badge{display:inline-block;padding:0 .4em;border-radius:3px;background:#dde;font-size:12px}
.badge.issued{background:#fd8}.badge.completed{background:#8d8}.badge.failed{background:#f99}
.meta{color:#556}.bar{display:flex;height:2.4em;border:1px solid #889;margin:.6em 0;width:100%}
.seg{overflow:hidden;white-space:nowrap;font-size:11px;padding:0;flex:none;line-height:2.4em;
color:#fff;min-width:0;text-indent:2px}.seg-pinned{background:#c80}.seg-summary{background:#36c}
.seg-tools{background:#a5c}.seg-history{background:#2a8}.seg-current{background:#7a3}
.seg-output-reserve{background:#999}
.seg-margin{background:#bbb;color:#333}.seg-free{background:#eee;color:#555}
"""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def quoted(value: str) -> str:
    return quote(value, safe="")


def tenant_label(namespace: str) -> str:
    """How every page names the tenant a thread, request or ledger entry lives under (its
    store namespace): the one place a page decides it, by the naming rule of
    proxy/namespaces.py."""
    return label(namespace)


def _tenant(namespace: str) -> str:
    return f'<span class="tenant">{esc(tenant_label(namespace))}</span>'


@dataclass(frozen=True)
class Chrome:
    """What every page's header needs: who is signed in, and the CSRF token for forms."""

    who: str
    csrf: str
    signed_in: bool


def _layout(title: str, body: str, chrome: Chrome | None) -> str:
    nav = ""
    if chrome is not None:
        logout = (
            f'<form method="post" action="{PREFIX}/logout">{_csrf(chrome)}'
            '<button type="submit">Sign out</button></form>'
            if chrome.signed_in
            else ""
        )
        nav = (
            f'<header><strong>threadkeeper</strong><a href="{PREFIX}/">Threads</a>'
            f'<a href="{PREFIX}/ledger">Unknown outcomes</a>'
            f'<span class="meta" id="who">{esc(chrome.who)}</span>{logout}</header>'
        )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · threadkeeper</title><style>{STYLE}</style></head>"
        f"<body>{nav}<main><h1>{esc(title)}</h1>{body}</main>"
        f"<script>{SCRIPT}</script></body></html>"
    )


def _csrf(chrome: Chrome) -> str:
    return f'<input type="hidden" name="csrf" value="{esc(chrome.csrf)}">'


def _table(columns: Sequence[str], rows: Iterable[str], table_id: str) -> str:
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def thread_url(namespace: str, thread_id: str) -> str:
    return f"{PREFIX}/thread?{urlencode({'namespace': namespace, 'id': thread_id})}"


def namespace_url(namespace: str) -> str:
    """The threads list filtered to one namespace (one passthrough caller's, say)."""
    return f"{PREFIX}/?{urlencode({'namespace': namespace})}"


def request_url(request_id: str) -> str:
    return f"{PREFIX}/requests/{quoted(request_id)}"


def _toggles() -> str:
    return (
        '<p><button type="button" data-toggle-all="open" hidden>Expand all</button> '
        '<button type="button" data-toggle-all="close" hidden>Collapse all</button></p>'
    )


# --- pages --------------------------------------------------------------------------------


def message_page(title: str, text: str) -> str:
    return _layout(
        title, f'<p id="message">{esc(text)}</p><p><a href="{PREFIX}/">Threads</a></p>', None
    )


def unauthorized_page() -> str:
    return _layout(
        "Sign in required",
        f"<p>The inspector needs the operator token or a tenant API key: "
        f'<a href="{PREFIX}/login">sign in</a>, or send <code>Authorization: Bearer</code>.</p>',
        None,
    )


def login_page(*, failed: bool) -> str:
    problem = '<p id="login-failed" class="badge failed">Token not accepted.</p>' if failed else ""
    return _layout(
        "Sign in",
        f"{problem}"
        f'<form method="post" action="{PREFIX}/login" id="login">'
        "<label>Operator token or tenant API key "
        '<input type="password" name="token" id="token" autocomplete="off" required></label> '
        '<button type="submit" id="sign-in">Sign in</button></form>'
        "<p class=meta>The operator token shows every tenant; a tenant's key only its own threads.</p>",
        None,
    )


def threads_page(
    threads: Sequence[Mapping[str, Any]],
    *,
    query: str,
    tenant: str | None,
    tenants: Sequence[str],
    chrome: Chrome,
    namespace: str | None = None,
) -> str:
    tenant_field = ""
    if tenants:  # operators filter by tenant; a tenant's key sees its own only
        # a tenant matches its passthrough callers too; a namespace one caller (namespaces.py)
        options = "".join(f'<option value="{esc(t)}">' for t in tenants)
        tenant_field = (
            f'<label>tenant <input name="tenant" list="tenants" value="{esc(tenant or "")}">'
            f'</label><datalist id="tenants">{options}</datalist> '
            f'<label>namespace <input name="namespace" value="{esc(namespace or "")}"></label> '
        )
    search = (
        f'<form method="get" action="{PREFIX}/" id="search">'
        f'<label>thread id <input name="q" value="{esc(query)}"></label> {tenant_field}'
        '<button type="submit">Search</button></form>'
    )
    rows = (
        f'<tr data-thread="{esc(t["id"])}" data-namespace="{esc(t["namespace"])}">'
        f"<td>{_tenant(t['namespace'])}</td>"
        f"<td>{_namespace_cell(t['namespace'])}</td>"
        f'<td><a href="{esc(thread_url(t["namespace"], t["id"]))}">{esc(t["id"])}</a></td>'
        f"<td>{esc(t['kind'])}</td><td>{esc(t['items'])}</td>"
        f"<td>{esc('-' if t['window_start'] is None else t['window_start'])}</td>"
        f"<td>{esc(t['created_at'])}</td></tr>"
        for t in threads
    )
    body = search + (
        _table(
            ("Tenant", "Namespace", "Thread", "Kind", "Items", "Window from", "Created"),
            rows,
            "threads",
        )
        if threads
        else '<p id="no-threads">No threads found.</p>'
    )
    return _layout("Threads", body, chrome)


def _namespace_cell(namespace: str) -> str:
    """A passthrough caller's namespace links to the list of that caller's threads."""
    if not is_caller(namespace):
        return esc(namespace)
    return f'<a class="namespace" href="{esc(namespace_url(namespace))}">{esc(namespace)}</a>'


def thread_page(
    shown: Mapping[str, Any],
    ledger: Sequence[Mapping[str, Any]],
    requests: Sequence[Mapping[str, Any]],
    *,
    chrome: Chrome,
    page_items: int,
) -> str:
    start = shown["window_start"]
    meta = (
        f'<p class="meta" id="thread-meta" data-tenant="{esc(shown["tenant"])}" '
        f'data-namespace="{esc(shown["namespace"])}" '
        f'data-window-start="{esc("" if start is None else start)}">{_tenant(shown["namespace"])} · '
        f"{esc(shown['kind'])} · {esc(shown['items'])} items · created {esc(shown['created_at'])}"
        f" · {'never cut' if start is None else f'the model sees items from seq {esc(start)} on'}</p>"
    )
    compressed = {c["seq"]: c for c in shown["compressed"]}
    by_call: dict[str, list[Mapping[str, Any]]] = {}
    for entry in ledger:
        by_call.setdefault(entry["call_id"], []).append(entry)
    placed: set[tuple[str, str]] = set()
    lines: list[str] = []
    for item in shown["log"]:
        if start is not None and item["seq"] == start:
            lines.append(_cut_line(start, shown["summary"]))
        lines.append(_item_line(item, compressed.get(item["seq"])))
        for call_id in item.get("call_ids", ()):
            for entry in by_call.pop(call_id, ()):
                placed.add((entry["scope"], entry["key"]))
                lines.append(_ledger_line(entry, chrome))
    if start is not None and start >= shown["items"]:
        lines.append(_cut_line(start, shown["summary"]))
    rest = [e for e in ledger if (e["scope"], e["key"]) not in placed]
    lines += [_ledger_line(entry, chrome) for entry in rest]
    body = (
        meta
        + _toggles()
        + _pages(shown, page_items)
        + f'<ol class="timeline" id="timeline">{"".join(lines)}</ol>'
        + "<h2>Recent requests on this thread</h2>"
        + _requests_table(requests)
    )
    return _layout(f"Thread {shown['id']}", body, chrome)


def _pages(shown: Mapping[str, Any], page_items: int) -> str:
    """Links to the items before and after this page of a long thread (admin.show_thread's
    max_items); nothing when the page holds the whole log."""
    log = shown["log"]
    if not log:
        return ""
    first, last = log[0]["seq"], log[-1]["seq"]
    url = thread_url(shown["namespace"], shown["id"])
    links = []
    if first > 0:
        links.append(
            f'<a id="earlier" href="{esc(url)}&amp;from={max(0, first - page_items)}">earlier items</a>'
        )
    if last < shown["items"] - 1:
        links.append(f'<a id="later" href="{esc(url)}&amp;from={last + 1}">later items</a>')
    if not links:
        return ""
    return f'<p class="meta">items {first}–{last} of {shown["items"]} · {" · ".join(links)}</p>'


def _cut_line(start: int, summary: Sequence[Mapping[str, Any]]) -> str:
    blocks = "".join(
        f'<li class="summary" data-tokens="{esc(b["tokens"])}"><span class="badge">'
        f"{esc(b['type'])} · {esc(b['tokens'])} tokens · "
        f"{'opening turn, sent verbatim' if b.get('opening') else 'sent before the window'}"
        f'</span><pre class="summary-text">{esc(b["text"])}</pre></li>'
        for b in summary
    )
    return (
        f'<li class="cut" id="cut" data-window-start="{esc(start)}">cut: the model sees items '
        f"from seq {esc(start)} on; the items above are not sent"
        f"{', the blocks below stand for them' if summary else ''}</li>{blocks}"
    )


def _item_line(item: Mapping[str, Any], compressed: Mapping[str, Any] | None) -> str:
    classes = ["item"]
    badges = []
    if item["cut"]:  # before the window: pinned items are carried, the rest not sent
        classes.append("cut-away")
        text = "carried before the window" if item["pinned"] else "not sent"
        badges.append(f'<span class="badge">{text}</span>')
    if item["pinned"]:
        classes.append("pinned")
        badges.append('<span class="badge pinned-badge">pinned</span>')
    sent_form = ""
    if compressed is not None:
        classes.append("compressed")
        badges.append(
            f'<span class="badge">compressed {esc(compressed["original_tokens"])} → '
            f"{esc(compressed['tokens'])} tokens</span>"
        )
        sent_form = (
            '<details class="compressed-form"><summary>sent form (compressed)</summary>'
            f"<pre>{esc(compressed['text'])}</pre></details>"
        )
    return (
        f'<li class="{" ".join(classes)}" data-seq="{esc(item["seq"])}" '
        f'data-type="{esc(item["type"])}" data-tokens="{esc(item["tokens"])}">'
        f'<span class="meta">#{esc(item["seq"])} · {esc(item["type"])} · {esc(item["tokens"])} '
        f"tokens</span> {' '.join(badges)}"
        f'<details class="text"><summary>{esc(item["text"]) or "(no text)"}</summary>'
        f'<pre class="full-text">{esc(_bounded(item.get("full", item["text"])))}</pre></details>'
        f"{sent_form}</li>"
    )


def _bounded(text: str) -> str:
    """An item's text on the page, up to FULL_TEXT_MAX characters (export has it all)."""
    if len(text) <= FULL_TEXT_MAX:
        return text
    rest = len(text) - FULL_TEXT_MAX
    return f"{text[:FULL_TEXT_MAX]}\n[... {rest} more characters: threadkeeper threads export]"


def _ledger_line(entry: Mapping[str, Any], chrome: Chrome) -> str:
    form = _resolve_form(entry, chrome) if entry["status"] == "issued" else ""
    return (
        f'<li class="ledger" data-key="{esc(entry["key"])}" data-status="{esc(entry["status"])}">'
        f"ledger: <strong>{esc(entry['tool'])}</strong> {esc(entry['key'])} "
        f'<span class="badge {esc(entry["status"])}">{esc(entry["status"])}</span> '
        f'<span class="meta">call {esc(entry["call_id"])} · attempts {esc(entry["attempts"])}</span>'
        f"{form}</li>"
    )


def _requests_table(requests: Sequence[Mapping[str, Any]]) -> str:
    if not requests:
        return "<p>No explain records kept for this thread.</p>"
    rows = (
        f'<tr><td><a href="{esc(request_url(r["id"]))}">{esc(r["id"])}</a></td>'
        f"<td>{esc(r.get('created_at', ''))}</td><td>{esc(r.get('status', ''))}</td>"
        f"<td>{esc(r.get('estimated_input_tokens', '-'))}</td>"
        f"<td>{esc(r.get('usage_input_tokens', '-'))}</td></tr>"
        for r in requests
    )
    return _table(
        ("Request", "Created", "Status", "Prompt tokens (estimate)", "Reported"), rows, "requests"
    )


def request_page(
    record: Mapping[str, Any],
    *,
    tenant: str,
    stood_for: Mapping[int, int | None],
    chrome: Chrome,
) -> str:
    """`tenant` is the store namespace the record is kept under (the record's own
    `tenant` field is the policy's, as in the log); `stood_for` the tokens of what each
    summary block stands for, by block index (inspector.py reads them from the thread)."""
    projection = record["projection"]
    thread_id = record.get("thread_id")
    namespace = tenant
    thread = (
        f' · thread <a id="thread-link" href="{esc(thread_url(namespace, thread_id))}">{esc(thread_id)}</a>'
        if thread_id
        else ""
    )
    meta = (
        f'<p class="meta" id="request-meta">{_tenant(namespace)}{thread} · '
        f"{esc(record.get('method', ''))} "
        f"{esc(record.get('path', ''))} · status {esc(record.get('status', ''))} · "
        f"{esc(record.get('latency_ms', ''))} ms · retries {esc(record.get('retries', '-'))} · "
        f"{esc(record.get('created_at', ''))}</p>"
    )
    usage = (
        f'<p id="usage">prompt tokens: estimated <strong id="estimated">'
        f'{esc(projection["prompt_tokens"])}</strong>, provider reported <strong id="reported">'
        f"{esc(record.get('usage_input_tokens', '-'))}</strong></p>"
    )
    formula = (
        f'<p class="meta" id="formula">window {esc(projection["window"])} = pinned '
        f"{esc(projection['system'])} + tools {esc(projection['tools'])} + history "
        f"{esc(projection['history_after'])} (budget {esc(projection['history_budget'])}, was "
        f"{esc(projection['history_before'])}) + current turn {esc(projection['current'])} + "
        f"output reserve {esc(projection['output'])} + margin {esc(projection['epsilon'])}</p>"
    )
    blocks = _table(
        ("Block", "Items", "Original tokens", "Sent tokens", "Decision"),
        (_block_row(b, stood_for.get(index)) for index, b in enumerate(projection["blocks"])),
        "blocks",
    )
    stand_ins = (
        "".join(
            f'<div class="stand-in" data-kind="{esc(s["kind"])}" data-position="{esc(s["position"])}">'
            f'<p class="meta">{esc(s["kind"])} sent at position {esc(s["position"])}</p>'
            f"<pre>{esc(s['text'])}</pre></div>"
            for s in record.get("stand_ins", [])
        )
        or "<p>Nothing stood in for history.</p>"
    )
    verdicts = record.get("ledger", [])
    ledger = (
        _table(
            ("Tool", "Key", "Verdict"),
            (
                f"<tr><td>{esc(v.get('tool', ''))}</td><td>{esc(v.get('key', ''))}</td>"
                f"<td>{esc(v.get('verdict', ''))}</td></tr>"
                for v in verdicts
            ),
            "verdicts",
        )
        if verdicts
        else "<p>No guarded tool calls.</p>"
    )
    body = (
        meta
        + usage
        + token_bar(record)
        + formula
        + "<h2>Blocks</h2>"
        + blocks
        + "<h2>Sent in place of history</h2>"
        + stand_ins
        + "<h2>Ledger verdicts</h2>"
        + ledger
    )
    return _layout(f"Request {record['id']}", body, chrome)


def _block_row(block: Mapping[str, Any], stood_for: int | None) -> str:
    """One block: what its items weigh (for a summary, the items it stands for, when the
    thread still has them) and what was sent in their place."""
    original = block["tokens_before"] if stood_for is None else stood_for
    return (
        f'<tr class="block" data-kind="{esc(block["kind"])}" data-action="{esc(block["action"])}" '
        f'data-original="{esc(original)}" data-sent="{esc(block["tokens_after"])}">'
        f"<td>{esc(block['kind'])}</td><td>{esc(block['first'])}–{esc(block['last'])}</td>"
        f"<td>{esc(original)}</td><td>{esc(block['tokens_after'])}</td>"
        f"<td>{esc(block['action'])}</td></tr>"
    )


# The sent segments of admin.token_bar (they add up to the prompt tokens); the rest of
# the window is what the request kept free.
SENT_SEGMENTS = ("pinned", "tools", "summary", "history", "current")
SEGMENT_LABELS = {
    "pinned": "pinned and instructions",
    "history": "history kept",
    "current": "current turn",
    "free": "unused",
}


def token_bar(record: Mapping[str, Any]) -> str:
    """The window as a stacked bar: each segment's width is its share of the window (of
    the sum when the segments overflow it); its tokens are in `data-tokens`."""
    window = record["projection"]["window"]
    segments = [
        (name.replace(" ", "-"), SEGMENT_LABELS.get(name, name), tokens, name in SENT_SEGMENTS)
        for name, tokens in admin.token_bar(record["projection"])
    ]
    total = max(window, sum(tokens for _, _, tokens, _ in segments), 1)
    bar = "".join(
        f'<div class="seg seg-{name}" data-segment="{name}" data-tokens="{tokens}" '
        f'data-sent="{"true" if sent else "false"}" style="width:{100 * tokens / total:.3f}%" '
        f'title="{esc(label)}: {tokens} tokens">{esc(label)} {tokens}</div>'
        for name, label, tokens, sent in segments
    )
    legend = _table(
        ("Segment", "Tokens", "Sent"),
        (
            f'<tr><td><span class="seg seg-{name}">&nbsp;&nbsp;</span> {esc(label)}</td>'
            f"<td>{tokens}</td><td>{'yes' if sent else 'kept free'}</td></tr>"
            for name, label, tokens, sent in segments
        ),
        "segments",
    )
    return f'<div class="bar" id="token-bar" data-window="{esc(window)}">{bar}</div>{legend}'


def ledger_page(
    entries: Sequence[Mapping[str, Any]], *, resolved: str | None, chrome: Chrome
) -> str:
    notice = (
        f'<p id="resolved" class="badge completed">Resolved {esc(resolved)}.</p>'
        if resolved
        else ""
    )
    intro = (
        "<p>Side-effecting tool calls the proxy let through whose outcome the client never "
        "reported. Resolve one once you know what happened, as "
        "<code>threadkeeper ledger resolve</code> does.</p>"
    )
    rows = (
        f'<tr class="entry" data-key="{esc(e["key"])}" data-status="{esc(e["status"])}">'
        f"<td>{_tenant(e['namespace'])}</td><td>{esc(e['scope'])}</td><td>{esc(e['key'])}</td>"
        f"<td>{esc(e['tool'])}<pre>{esc(e['arguments'])}</pre></td>"
        f"<td>{_thread_cell(e)}</td><td>{esc(e['created_at'])}</td>"
        f"<td>{_resolve_form(e, chrome)}</td></tr>"
        for e in entries
    )
    table = (
        _table(("Namespace", "Scope", "Key", "Tool", "Thread", "Issued", "Resolve"), rows, "ledger")
        if entries
        else '<p id="no-entries">No entries with an unknown outcome.</p>'
    )
    return _layout("Unknown outcomes", notice + intro + table, chrome)


def _thread_cell(entry: Mapping[str, Any]) -> str:
    if not entry.get("thread_id"):
        return "-"
    return f'<a href="{esc(thread_url(entry["namespace"], entry["thread_id"]))}">{esc(entry["thread_id"])}</a>'


def _resolve_form(entry: Mapping[str, Any], chrome: Chrome) -> str:
    return (
        f'<form method="post" action="{PREFIX}/ledger/resolve" class="resolve">{_csrf(chrome)}'
        f'<input type="hidden" name="namespace" value="{esc(entry["namespace"])}">'
        f'<input type="hidden" name="scope" value="{esc(entry["scope"])}">'
        f'<input type="hidden" name="key" value="{esc(entry["key"])}">'
        '<label><input type="radio" name="status" value="completed" required> completed</label> '
        '<label><input type="radio" name="status" value="failed"> failed</label> '
        '<input name="result" placeholder="result (when completed)"> '
        '<button type="submit">Resolve</button></form>'
    )
