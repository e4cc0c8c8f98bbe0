"""Deterministic compression of tool results (seed section 8).

Summarizing loses exact parameters, negations, times and sources; structured
compression keeps them as fields (seed 8.3). So a compressed tool result keeps the
tool's name, the call id and the time, and what a later turn may need: for JSON the
identifying values wherever they are nested (ids, amounts, statuses; lists by the ids of
their elements, and their shape: proxy/core/shapes.py), never transport metadata
(request ids, hosts, generation times); for text the lines by template (TextPlan: rare
lines verbatim, errors by rarity, frequent templates collapsed with their count and
ranges; a file listing by the lines referred to, its diff hunks and signatures; a
document by the sentences carrying the call's query terms) and the lines holding values
the rest of the turn refers to. The rest is
replaced by explicit elision markers. A pure function of its input: the same history always gives the same bytes,
which keeps the provider's prompt cache warm. Digests of dropped turns live in
proxy/core/memory.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice, pairwise
from typing import Any

from proxy.core.items import Item, JsonDict, chat_item, message_text, responses_item
from proxy.core.shapes import FEW_IDS, SHAPE_MIN, outlier_records, shape
from proxy.core.templates import Template, mine, outlier_lines
from proxy.core.tokens import TokenCounter, leaf_texts

COMPRESSED_KEY = "threadkeeper_compressed"
ELIDED = "elided by threadkeeper"

# Responses outputs whose `output` is text (or text parts) and can become a string;
# computer/shell outputs carry screenshots or structured logs and keep their shape.
COMPRESSIBLE_RESPONSES_TYPES = frozenset({"function_call_output", "custom_tool_call_output"})

# Keys whose values describe the transport of an answer, not the answer itself.
TRANSPORT_KEY = re.compile(
    r"^(?:x[-_].*"
    r"|(?:request|req|trace|span|correlation|idempotency|parent)[-_]?ids?"
    r"|served[-_]?by|server|host(?:name)?|node|pod|region[-_]?served"
    r"|(?:generated|fetched|served|received|retrieved|cached|updated|created|processed|sent)[-_]?(?:at|on)"
    r"|timestamp|ts|latency(?:[-_]?ms)?|elapsed(?:[-_]?ms)?|took(?:[-_]?ms)?|duration[-_]?ms"
    r"|etag|api[-_]?version|schema[-_]?version|object|rate[-_]?limit.*|retry[-_]?after"
    r"|next[-_]?cursor|cursor|has[-_]?more|page|per[-_]?page|page[-_]?size)$",
    re.IGNORECASE,
)
# Objects under these keys are transport or debugging detail as a whole.
TRANSPORT_SUBTREES = frozenset(
    {"meta", "_meta", "metadata", "debug", "trace", "tracing", "headers", "pagination"}
    | {"links", "_links", "diagnostics", "telemetry"}
)
# Keys whose values identify something or state an outcome: kept before any other.
IMPORTANT_KEY = re.compile(
    r"(?:^|[-_])(?:ids?|no|number|code|ref|reference|status|state|amount|total|price|cost"
    r"|fee|balance|currency|email|sku|pnr|booking|confirmation|tracking|error|reason|result"
    r"|outcome|approved|refund|quantity|qty|seat|flight|date|name|title|version|decision)"
    r"(?:$|[-_])|[a-z]Id$",
    re.IGNORECASE,
)
# Values that look like identifiers (ORD-1, YT123456, cus_8842) wherever they are.
ID_VALUE = re.compile(
    r"^(?:(?!\d{4}-\d\d-\d\d)(?=[A-Z0-9_/-]*\d)(?=[A-Z0-9_/-]*[A-Z])[A-Z0-9]+(?:[-_/][A-Z0-9]+)+"
    r"|(?=[A-Z0-9]*\d)(?=[A-Z0-9]*[A-Z])[A-Z0-9]{5,}"
    r"|[a-z]{2,}_(?=[A-Za-z0-9]*\d)[A-Za-z0-9]{3,})$"
)
# Lines of text output that report errors, failures and where they happened. A code
# location starts where a run of path characters starts (the look-behind), so a long run
# without one is scanned once, not from each of its characters (linear, not quadratic).
_PATH = r"(?<![\w./-])[\w./-]+\.(?:py|pyx|js|mjs|ts|tsx|go|rs|java|kt|rb|c|cc|cpp|h|hpp|cs|php|swift|scala):\d+"
ERROR_LINE = re.compile(
    r"[Ee]rror\b|ERROR\b|[Ee]xception\b|Traceback|\bFAIL(?:ED|URE)?\b|\bfail(?:ed|ure|s)\b"
    r"|\bexhausted\b|\b[Ff]atal\b|\bFATAL\b|\bCRITICAL\b|\bPANIC\b|\bpanic"
    r"|\btimed out\b|\brefused\b|\bdenied\b|\babort|\bWARN(?:ING)?\b|\b[Ww]arning\b"
    r"|^E {2,}\S|File \"[^\"]+\", line \d+|" + _PATH,
)
# Lines of a traceback (a frame, or the exception it ended with) rank above other errors.
LOCATION_LINE = re.compile(
    r"^\s*File \"[^\"]+\", line \d+|^\s*" + _PATH + r"|[Ee]rror\b|[Ee]xception\b|^Traceback"
)


def is_compressible(item: Item) -> bool:
    if item.kind != "tool_output":
        return False
    return item.api == "chat" or item.type in COMPRESSIBLE_RESPONSES_TYPES


# --- tool results -----------------------------------------------------------------------


def output_text(item: Item) -> str:
    value = item.raw.get("content" if item.api == "chat" else "output")
    if value is None:
        return ""
    if isinstance(value, str | list):
        return message_text(value)
    return json.dumps(value, ensure_ascii=False)


def tool_name(output: Item, call: Item | None) -> str:
    """The function's name, read from the call that the output answers."""
    if output.api == "chat" and output.role == "function":
        return output.name or "function"
    if call is None:
        return "unknown"
    if call.api == "responses":
        return call.name or call.type or "unknown"
    for tool_call in call.raw.get("tool_calls") or []:
        if isinstance(tool_call, Mapping) and tool_call.get("id") == output.output_for:
            function = tool_call.get("function")
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                return function["name"]
    legacy = call.raw.get("function_call")
    if isinstance(legacy, Mapping) and isinstance(legacy.get("name"), str):
        return legacy["name"]
    return "unknown"


def call_arguments(output: Item, call: Item | None) -> str:
    """The arguments (JSON text) of the call that `output` answers."""
    if call is None:
        return ""
    arguments: Any = call.raw.get("arguments", call.raw.get("input", ""))
    for tool_call in call.raw.get("tool_calls") or []:
        if isinstance(tool_call, Mapping) and tool_call.get("id") == output.output_for:
            function = tool_call.get("function")
            if isinstance(function, Mapping):
                arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return arguments


# Words of a query that carry no subject: a sentence holding them says nothing of it.
STOPWORDS = frozenset(
    "the and for with from that this what which who whom how why when where are was were"
    " is be been has have had does did not any all can could should would will about into"
    " over under than then them they their there our your you his her its one out get"
    " https http www com org html page site search query find show list".split()
)
WORD = re.compile(r"[^\W_][\w'-]*[^\W_]|[^\W_]")


def query_terms(arguments: str) -> frozenset[str]:
    """The words of a call's string arguments (its query, its url) that name a subject:
    lower case, at least three characters, no stop words, in their stem form."""
    parsed = json_container(arguments)
    leaves = leaf_texts(parsed if parsed is not None else arguments, numbers=False)
    strings = [text[:QUERY_CHARS] for text in islice(leaves, QUERY_STRINGS)]
    words = (w.lower() for text in strings for w in WORD.findall(text.replace("-", " ")))
    return frozenset(_stem(w) for w in words if len(w) >= 3 and w not in STOPWORDS)


QUERY_STRINGS = 16  # string arguments read for query terms
QUERY_CHARS = 400  # characters of each read


def _stem(word: str) -> str:
    """A crude stem, so that a query's "warranties" finds a page's "warranty"."""
    for suffix in ("ies", "ing", "ed", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)] + ("y" if suffix == "ies" else "")
    return word


@dataclass(frozen=True, slots=True)
class _Limits:
    """How much of a JSON value survives: list items, characters per string, depth."""

    items: int
    chars: int
    depth: int


JSON_LIMITS = (
    _Limits(8, 400, 4),
    _Limits(4, 200, 3),
    _Limits(2, 100, 2),
    _Limits(1, 60, 1),
    _Limits(0, 40, 0),
)


# Compressed forms already computed: deterministic in these inputs, and a stateless client
# resends the same old tool results every turn. Bounded; cleared when full.
_compressed: dict[tuple[str, str, str, int, str, frozenset[str]], Item] = {}
COMPRESSED_CACHE_MAX = 8192


def compress_tool_output(
    item: Item,
    call: Item | None,
    max_tokens: int,
    counter: TokenCounter,
    referenced: frozenset[str] = frozenset(),
) -> Item:
    """A replacement for a tool result that is at most max_tokens (item overhead included).

    `referenced` holds tokens the later conversation mentions (ids, values): the lines
    and list elements holding them are kept before others. Only when max_tokens is
    below the size of the bare source marker is the result larger; the caller compares
    sizes before using it.
    """
    key = (
        item.api,
        item.digest,
        call.digest if call is not None else "",
        max_tokens,
        counter.tokenizer_id,
        referenced,
    )
    cached = _compressed.get(key)
    if cached is None:
        cached = _compress(item, call, max_tokens, counter, referenced)
        if len(_compressed) >= COMPRESSED_CACHE_MAX:
            _compressed.clear()
        _compressed[key] = cached
    return cached


def _compress(
    item: Item,
    call: Item | None,
    max_tokens: int,
    counter: TokenCounter,
    referenced: frozenset[str],
) -> Item:
    text = output_text(item)
    source = {
        "tool": tool_name(item, call),
        "call_id": item.output_for,
        "original_tokens": counter.item(item),
    }
    candidate = item
    query = query_terms(call_arguments(item, call))
    for body in _bodies(text, source, max_tokens, referenced, query):
        candidate = _with_output(item, json.dumps(body, ensure_ascii=False))
        if _count(candidate, counter) <= max_tokens:
            return candidate
    return candidate


def _bodies(
    text: str,
    source: JsonDict,
    max_tokens: int,
    referenced: frozenset[str],
    query: frozenset[str] = frozenset(),
) -> Iterator[JsonDict]:
    """Ever smaller compressed forms, ending with the bare source marker."""
    parsed = json_container(text)
    inner = embedded_text(parsed)
    if inner is not None and isinstance(parsed, dict):
        yield from _embedded_bodies(parsed, inner, source, max_tokens, referenced, query)
        text, parsed = "", None  # then only the bare markers
    if parsed is not None:
        for limits in JSON_LIMITS:
            yield {COMPRESSED_KEY: source, **_structured(parsed, limits, referenced)}
        facts = dict(key_values(parsed, max_values=6, list_items=3, referenced=referenced))
        yield {COMPRESSED_KEY: source, "verified_facts": facts}
    chars = min(len(text), max(max_tokens, 0) * 4)
    plan: TextPlan | None = None
    while chars >= 16:
        # Built as soon as the text must be cut: a dense text (numbers, hex ids) of fewer
        # than 4 characters a token is cut too, by its plan, not replaced by a bare marker.
        if plan is None and len(text) > chars:
            plan = TextPlan.of(text, referenced, query)
        shown = plan.render(chars) if plan is not None else text
        yield {COMPRESSED_KEY: source, "excerpt": shown}
        chars //= 2
    yield {COMPRESSED_KEY: source}
    yield {COMPRESSED_KEY: {"tool": source["tool"], "call_id": source["call_id"]}}


EMBEDDED_LINES = 20  # a string of a JSON object with this many lines is a text in itself
EMBEDDED_CHARS = 2000  # or this many characters (a page's body on one line)
EMBEDDED_SHARE = 0.5  # and at least this share of the result's characters


def embedded_text(parsed: Any) -> tuple[str, str] | None:
    """The key and value of the one string of a JSON object that is a text in itself (a
    file's content, a page's body, a command's output): many lines or characters, most
    of the result.
    It is compressed as text (TextPlan), not cut after its first characters."""
    if not isinstance(parsed, dict):
        return None
    strings = [(k, v) for k, v in parsed.items() if isinstance(v, str)]
    if not strings:
        return None
    key, value = max(strings, key=lambda kv: len(kv[1]))
    total = sum(len(str(v)) for v in parsed.values())
    long = value.count("\n") + 1 >= EMBEDDED_LINES or len(value) >= EMBEDDED_CHARS
    if not long or len(value) < EMBEDDED_SHARE * total:
        return None
    return key, value


def _embedded_bodies(
    parsed: dict[str, Any],
    inner: tuple[str, str],
    source: JsonDict,
    max_tokens: int,
    referenced: frozenset[str],
    query: frozenset[str],
) -> Iterator[JsonDict]:
    """A JSON object around one text (a file's content, a page's body): its other scalar
    values as verified facts, the text cut by its plan (TextPlan) at ever smaller sizes."""
    key, body = inner
    others = {k: v for k, v in parsed.items() if k != key and _is_scalar(v)}
    facts = dict(key_values(others, max_values=8, referenced=referenced))
    chars = max(max_tokens, 0) * 4
    plan = TextPlan.of(body, referenced, query)
    while chars >= 16:
        yield {COMPRESSED_KEY: source, "verified_facts": facts, "excerpt": plan.render(chars)}
        chars //= 2


def json_container(text: str) -> dict[str, Any] | list[Any] | None:
    """The JSON object or array a tool result holds, if it is one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        return None
    return value if isinstance(value, dict | list) else None


def _structured(
    value: dict[str, Any] | list[Any], limits: _Limits, referenced: frozenset[str]
) -> JsonDict:
    """Verified facts (identifying values found anywhere, kept) apart from the elided rest."""
    facts = dict(
        key_values(
            value,
            max_values=max(limits.items * 2, 4),
            list_items=max(limits.items, 2),
            referenced=referenced,
        )
    )
    if isinstance(value, list):
        body: JsonDict = {"verified_facts": {"item_count": len(value), **facts}}
        if limits.items:
            body["rest"] = _elide(value, limits)
        return body
    rest = {k: v for k, v in value.items() if not _is_scalar(v) and not _is_transport(k)}
    body = {"verified_facts": facts}
    if rest and limits.items:
        body["rest"] = _elide(rest, limits)
    return body


# --- the values that matter in JSON --------------------------------------------------------


def key_values(
    value: Any,
    max_values: int = 12,
    list_items: int = 8,
    referenced: frozenset[str] = frozenset(),
    shapes: bool = True,
) -> list[tuple[str, Any]]:
    """The identifying and outcome values of a JSON result, wherever they are nested.

    Ids, amounts, statuses and values `referenced` later come first; transport metadata
    never. A list becomes the identifying values of its first `list_items` elements (and
    of any later element holding a referenced value), and with `shapes` a list of records
    or numbers also its shape (proxy/core/shapes.py), the records holding a referenced
    value whole. At most `max_values` pairs, in the order they appear; a label is the
    key, prefixed by its parent's for generic keys.
    """
    found: list[tuple[int, str, Any]] = []  # (tier, label, value) in document order
    _walk(value, "", found, list_items, referenced, shapes)
    chosen = sorted(range(len(found)), key=lambda i: (found[i][0], i))[:max_values]
    pairs: list[tuple[str, Any]] = []
    seen: dict[str, int] = {}
    for index in sorted(chosen):
        _, label, kept = found[index]
        seen[label] = seen.get(label, 0) + 1
        pairs.append((label if seen[label] == 1 else f"{label}#{seen[label]}", kept))
    return pairs


GENERIC_KEYS = frozenset(
    {"id", "status", "state", "name", "type", "code", "amount", "value", "total", "number"}
    | {"date", "title", "result", "items", "data", "reason", "message", "currency"}
)


SIGNAL_TIER = -1  # a list's outlier records and rare strings: kept before other values


def standing_out(value: Any) -> list[tuple[str, Any]]:
    """What stands out of the lists of a JSON result (SIGNAL_TIER of key_values): the
    records of their shapes' outliers, whole, and their strings of a rare template,
    labelled by list and index; what a digest leads a tool fact with."""
    found: list[tuple[int, str, Any]] = []
    _walk(value, "", found, 0, frozenset(), True)
    return [(label, kept) for tier, label, kept in found if tier == SIGNAL_TIER]


MAX_WALK_DEPTH = 16  # nesting levels searched for values; deeper objects are skipped


def _walk(
    value: Any,
    parent: str,
    found: list[tuple[int, str, Any]],
    list_items: int,
    referenced: frozenset[str],
    shapes: bool,
    depth: int = 0,
) -> None:
    if depth > MAX_WALK_DEPTH:
        return
    if isinstance(value, list):
        few = min(FEW_IDS, list_items * 4)
        described = shape(value, _identifies, _is_transport, few) if shapes else None
        named = parent or "items"
        if described is not None:
            found.append((0, f"{named}_shape", described))
        if described is None or not any(k.endswith("s") and k != "count" for k in described):
            summary = _list_summary(value, list_items, referenced)
            if summary:
                found.append((0 if _has_ids(summary) else 1, named, summary))
        whole = _referenced_records(value, referenced if shapes else frozenset())
        for index, element in whole:
            found.append((0, f"{named}[{index}]", _elide(element, REFERENCED_RECORD)))
        # What stands out of a list ranks above every other value (SIGNAL_TIER): the
        # records of its shape's outliers, whole, and its strings of a rare template.
        known = {index for index, _ in whole}
        for index in outlier_records(value, _is_transport) if shapes else ():
            if index not in known:
                element = _elide(value[index], REFERENCED_RECORD)
                found.append((SIGNAL_TIER, f"{named}[{index}]", element))
        for index in rare_strings(value) if shapes else ():
            found.append((SIGNAL_TIER, f"{named}[{index}]", _short(value[index])))
        return
    if not isinstance(value, dict):
        return
    for key, child in value.items():
        if not isinstance(key, str) or _is_transport(key):
            continue
        label = f"{parent}.{key}" if parent and key.lower() in GENERIC_KEYS else key
        if _is_scalar(child):
            if child is None or child == "":
                continue
            tier = 0 if _important(key, child, referenced) else 1
            found.append((tier, label, _short(child)))
        elif isinstance(child, dict | list):
            _walk(child, label, found, list_items, referenced, shapes, depth + 1)


RARE_STRINGS = 4  # elements of a list of strings kept for their rare template, at most


def rare_strings(value: list[Any]) -> list[int]:
    """The indexes of a list of strings (log lines, activity notes) whose template (Drain,
    proxy/core/templates.py) is rare among them: the one `connection pool exhausted` among
    many `502 Bad Gateway` lines, the one legal hold among routine notes. Only where
    the others repeat (at most a quarter of the elements rare), at most RARE_STRINGS,
    in order."""
    if len(value) < SHAPE_MIN or not all(isinstance(v, str) for v in value):
        return []
    mined, owner = mine(value)
    counts = [mined[t].count if t >= 0 else 0 for t in owner]
    rare = [i for i, n in enumerate(counts) if 0 < n <= RARE_COUNT]
    if not rare or 4 * len(rare) > len(value):
        return []
    errors = [i for i in rare if ERROR_LINE.search(value[i])]
    return sorted((errors + [i for i in rare if i not in errors])[:RARE_STRINGS])


REFERENCED_RECORDS = 3  # records of a list kept whole because the conversation names them
REFERENCED_RECORD = _Limits(4, 120, 2)


def _referenced_records(value: list[Any], referenced: frozenset[str]) -> list[tuple[int, Any]]:
    """The records (objects) of a list holding a value the conversation names, whole."""
    if not referenced:
        return []
    rows = [
        {str(v) for v in e.values() if _is_scalar(v) and v not in (None, "")}
        if isinstance(e, dict)
        else set()
        for e in value
    ]
    named = {t for t in referenced if 0 < sum(t in row for row in rows) <= REFERENCE_MAX}
    found: list[tuple[int, Any]] = []
    for index, element in enumerate(value):
        if not isinstance(element, dict):
            continue
        if not rows[index].isdisjoint(named):
            found.append((index, element))
            if len(found) >= REFERENCED_RECORDS:
                break
    return found


def _identifies(key: str, value: Any) -> bool:
    """Whether a column's value identifies its record: an id-like value or an id key."""
    if isinstance(value, str) and ID_VALUE.match(value):
        return True
    return isinstance(value, str | int) and ID_KEY.search(key) is not None


ID_KEY = re.compile(r"(?:^|[-_])(?:ids?|no|number|ref|reference|sku|pnr)$|[a-z]Id$", re.I)


def _is_transport(key: Any) -> bool:
    return isinstance(key, str) and (
        key.lower() in TRANSPORT_SUBTREES or TRANSPORT_KEY.match(key) is not None
    )


def _important(key: str, value: Any, referenced: frozenset[str]) -> bool:
    if IMPORTANT_KEY.search(key):
        return True
    return isinstance(value, str) and (
        ID_VALUE.match(value) is not None
        or value in referenced
        or ERROR_LINE.search(value) is not None
    )


def _short(value: Any) -> Any:
    return _elide_string(value, 200) if isinstance(value, str) else value


def _has_ids(values: list[Any]) -> bool:
    return any(isinstance(v, str) and ID_VALUE.match(v.split(" ")[0]) for v in values)


def _list_summary(value: list[Any], list_items: int, referenced: frozenset[str]) -> list[Any]:
    """A list by the identifying values of its elements, with the count of the rest; past
    the first `list_items`, the elements a referenced value singles out."""
    idents = [_identity(element) for element in value] if referenced else []
    tokens = singling_out(referenced, [i for i in idents if isinstance(i, str)])
    shown: list[Any] = []
    for index, element in enumerate(value):
        if index >= list_items and not tokens:
            break
        ident = idents[index] if idents else _identity(element)
        if ident is None:
            continue
        if index < list_items or (
            isinstance(ident, str) and any(holds(ident, token) for token in tokens)
        ):
            shown.append(ident)
    if len(value) > len(shown):
        shown.append(f"(+{len(value) - len(shown)} more)")
    return shown


REFERENCE_MAX = 3  # a referenced value found in more places than this singles none out
PLAIN_WORD = re.compile(r"^[A-Za-z]+$")


def holds(text: str, value: str) -> bool:
    """Whether `text` carries the referenced `value`. A plain word (`orders`, a service a
    later call queries) counts only where it stands as a word of its own, not as a part
    of a path, a host or a compound (`/v2/orders`, `orders-db`): a word is common, and
    inside another value it names that value, not this one. Any other value (an id, an
    amount, a phrase) is distinctive wherever it stands."""
    if value not in text:
        return False
    if PLAIN_WORD.match(value) is None:
        return True
    return _standalone(value).search(text) is not None


@lru_cache(maxsize=256)
def _standalone(word: str) -> re.Pattern[str]:
    return re.compile(r"(?<![\w/-])" + re.escape(word) + r"(?![\w/-]|\.\w)")


def singling_out(referenced: frozenset[str], texts: Sequence[str]) -> frozenset[str]:
    """The referenced values found in at most REFERENCE_MAX of `texts` (holds): a value
    that a later message names and that every line holds (the flight of every fare) tells
    nothing about which line matters; one that names one line or record does."""
    if not referenced:
        return referenced
    kept = set()
    for token in sorted(referenced):
        found = 0
        for text in texts:
            if holds(text, token):
                found += 1
                if found > REFERENCE_MAX:
                    break
        if 0 < found <= REFERENCE_MAX:
            kept.add(token)
    return frozenset(kept)


LIST_TEXT_CHARS = 48  # a text element of a list is named by its beginning


def _identity(element: Any) -> Any:
    """An element of a list as its identifying values (at most three, joined)."""
    if _is_scalar(element):
        return _elide_string(element, LIST_TEXT_CHARS) if isinstance(element, str) else element
    if not isinstance(element, dict):
        return f"[{len(element)} items]" if isinstance(element, list) else None
    scalars = [
        (k, v)
        for k, v in element.items()
        if isinstance(k, str) and _is_scalar(v) and v not in (None, "") and not _is_transport(k)
    ]
    important = [v for k, v in scalars if _important(k, v, frozenset())]
    values = (important or [v for _, v in scalars])[:3]
    if not values:
        return f"{{{len(element)} keys}}"
    return " ".join(str(_short(v)) for v in values)


# --- text results ---------------------------------------------------------------------------


WHITESPACE = re.compile(r"\s+")
ABBREVIATIONS = frozenset(
    "e.g i.e etc mr mrs ms dr prof sr jr st vs approx nr inc ltd co corp fig al cf resp"
    " dept est no tel ca".split()
)
# A sentence ends at ., ! or ? followed by white space (so never inside an e-mail
# address, a version, a decimal or a URL), at CJK full stops, and at line ends.
_BOUNDARY = re.compile(r"[.!?]+[\"'’”)\]]*(?=\s)|[。！？]+|\n+")
_BULLET = re.compile(r"^(?:[-*•·]|\d{1,3}[.)])\s+")
_LAST_WORD = re.compile(r"([\w.]+)$")


def sentences(text: str) -> list[str]:
    """The sentences of `text`, bullets stripped, white space collapsed."""
    found: list[str] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        piece = text[start : match.end()]
        if match.group().startswith(".") and _is_abbreviation(text[start : match.start()]):
            continue
        if re.fullmatch(r"\s*(?:\d{1,3}|[A-Za-z])[.)]\s*", piece):
            continue  # a list number or an initial, not a sentence
        _append_sentence(found, piece)
        start = match.end()
    _append_sentence(found, text[start:])
    return found


def _is_abbreviation(before: str) -> bool:
    match = _LAST_WORD.search(before)
    if match is None:
        return False
    word = match.group(1).lower().rstrip(".")
    return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def _append_sentence(found: list[str], piece: str) -> None:
    piece = _BULLET.sub("", WHITESPACE.sub(" ", piece).strip())
    if piece:
        found.append(piece)


def excerpt(text: str, chars: int, referenced: frozenset[str] = frozenset()) -> str:
    """About `chars` characters of `text`, chosen by TextPlan."""
    if len(text) <= chars:
        return text
    return TextPlan.of(text, referenced).render(chars)


LINE_CHARS = 300  # a kept line longer than this is cut (marked)
RARE_COUNT = 2  # a template seen at most this often is rare: its lines are kept verbatim
INNERMOST_FRAMES = 2  # frames of a stack trace kept with its exception, the innermost
# A line that starts with a shell or REPL prompt: the command that produced the output.
COMMAND_LINE = re.compile(r"^\s*(?:\$|>>>|#|>|mysql>|postgres=#|sqlite>)\s+\S")
FRAME_LINE = re.compile(r"^\s+(?:at |File \")|^\s*#\d+\s|^\s*" + _PATH)
# The mark of a collapsed template in an excerpt; a digest reads the count back.
COLLAPSED = re.compile(r" \(x(\d+) lines like this, elided by threadkeeper(?:; [^\n]*)?\)$")


@dataclass(frozen=True, slots=True)
class _Entry:
    """A line kept by a plan: its rank (tier, then the rarity of its template, or for the
    other rare lines of a log minus the words they alone hold), and for a frequent
    template the note standing for its other lines."""

    tier: int
    rarity: int
    index: int
    note: str = ""
    template: int = -1
    group: int = -1  # a diff hunk: its lines are kept all together or after the rest
    outlier: bool = False  # kept for a number far from its column's others


class TextPlan:
    """What to keep of a text result, by the templates of its lines (issue 22, item 1).

    The lines of a template seen at most RARE_COUNT times are kept verbatim; a frequent
    template becomes one example line with its count and the range of its variable parts.
    Under a budget, in this order: the command that produced the output and the lines
    holding values referenced later; a stack trace's exception and innermost frames; the
    error and warning lines of rare templates, the rarest first (not the first ones); the
    first and the last line; the frequent error templates, the rarer first; the other rare
    lines, those saying most that no other template's line says first (_own_words); the
    other frequent templates, the larger first; then any other line. Kept lines are shown
    in their order, every gap marked as elided; room left over shows the other lines in
    order. Built once (linear in the text), rendered
    at any size.

    A file listing, a diff or a document (text_kind, item 4) has its own classes of lines
    instead of the log's: for code, the lines referenced by number or defining a
    referenced identifier, then its odd statements (_odd_code_lines), then the signatures (the skeleton, bodies elided); for a diff,
    its file headers and each hunk's header with its +/- lines, a hunk kept whole or
    after everything else; for a document, whose units are sentences, the title, the
    sentences carrying the most query terms, then the headings."""

    __slots__ = ("_command", "_entries", "_kind", "_lines", "_rare", "_text", "_unit")

    def __init__(
        self,
        text: str,
        lines: list[str],
        entries: list[_Entry],
        command: int,
        kind: str = "log",
        rare: tuple[int, ...] = (),
    ) -> None:
        self._text = text
        self._lines = lines
        self._entries = entries
        self._command = command
        self._kind = kind
        self._rare = rare  # a log's rare lines (not frames), those saying most first
        self._unit = "sentence" if kind == "prose" else "line"

    @classmethod
    def of(
        cls,
        text: str,
        referenced: frozenset[str] = frozenset(),
        query: frozenset[str] = frozenset(),
    ) -> TextPlan:
        """`query` holds the terms of the call that produced the text (query_terms)."""
        lines = text.splitlines()
        kind, numbers = text_kind(lines)
        headings: list[bool] = []
        if kind == "prose":
            lines, headings = prose_units(lines)
        mined, owner = mine(lines)
        counts = [_collapsed_count(line) or 1 for line in lines]
        total = [0] * len(mined)
        for index, number in enumerate(owner):
            if number >= 0:
                total[number] += counts[index]
        logs = kind == "log"
        errors = [
            logs and owner[i] >= 0 and ERROR_LINE.search(line) is not None
            for i, line in enumerate(lines)
        ]
        entries: list[_Entry] = []
        taken: set[int] = set()

        def keep(
            tier: int, index: int, note: str = "", rarity: int | None = None, outlier: bool = False
        ) -> None:
            if index not in taken and owner[index] >= 0:
                taken.add(index)
                rank = total[owner[index]] if rarity is None else rarity
                entries.append(_Entry(tier, rank, index, note, owner[index], outlier=outlier))

        first = next((i for i, t in enumerate(owner) if t >= 0), -1)
        command = first if logs and first >= 0 and COMMAND_LINE.match(lines[first]) else -1
        if command >= 0:
            keep(0, command)
        named = singling_out(referenced, lines)
        if named:
            for index, line in enumerate(lines):
                if any(holds(line, token) for token in named):
                    keep(0, index)
        if kind in ("code", "diff"):
            for index in _referenced_code(lines, numbers, referenced):
                keep(0, index)
        if kind == "diff":
            for group, indexes in enumerate(diff_hunks(lines)):
                for index in indexes:
                    if index not in taken and owner[index] >= 0:
                        taken.add(index)
                        entries.append(_Entry(1, 0, index, group=group))
        if kind == "code":
            for index in _odd_code_lines(lines, numbers, owner, total):
                keep(1, index)
            for index, line in enumerate(lines):
                if is_signature(_unnumbered(line, numbers[index])):
                    keep(2, index, rarity=0)
        if kind == "prose":
            if first >= 0:
                keep(0, first)
            # A sentence said again adds nothing (only its first time is kept by rank); in
            # a page that repeats itself, the sentences of a rare template are the news.
            again = _repeated(lines)
            for index in _rare_units(lines, owner, total, again):
                keep(1, index, rarity=-len(query) - 1)
            wanted = min(2, len(query))
            hits_of = _query_hits(lines, query)
            for index, hits in enumerate(hits_of):
                if hits >= wanted > 0 and not again[index]:
                    keep(1, index, rarity=-hits)
            for index, heading in enumerate(headings):
                if heading:
                    keep(2, index, rarity=0)
            for index, hits in enumerate(hits_of):
                if hits and not again[index]:
                    keep(3, index, rarity=-hits)
        for index in _trace_heads(lines, errors) if logs else ():
            keep(1, index)
        for index in range(len(lines)):
            if errors[index] and total[owner[index]] <= RARE_COUNT:
                keep(2, index)
        for index in outlier_lines(mined, lines) if logs else ():  # rare by its value
            keep(2, index, rarity=RARE_COUNT + 1, outlier=True)
        last = next((i for i in range(len(lines) - 1, -1, -1) if owner[i] >= 0), -1)
        for index in (first, last):
            if index >= 0:
                keep(3, index, rarity=0 if not logs else None)
        for number, template in enumerate(mined if logs else ()):
            if total[number] > RARE_COUNT and template.example not in taken:
                example = template.example
                note = f" (x{total[number]} lines like this, {ELIDED}"
                ranges = template.ranges()
                note += f"; {ranges})" if ranges else ")"
                keep(4 if errors[example] else 7, example, note)
        own = _own_words(lines, owner, mined, total) if logs else {}
        for index, words in own.items():
            keep(5 if not FRAME_LINE.match(lines[index]) else 6, index, rarity=-words)
        for index in range(len(lines)):  # what room is left: the other lines, in order
            keep(8, index)
        entries.sort(key=_rank)
        # The other rare lines (tier 5), with those kept by position (tier 3) among them.
        tier = {e.index: e.tier for e in entries}
        rare = sorted(
            (i for i in own if tier[i] >= 3 and not FRAME_LINE.match(lines[i])),
            key=lambda i: (-own[i], i),
        )
        return cls(text, lines, entries, command, kind, tuple(rare))

    def render(self, chars: int) -> str:
        """At most about `chars` characters (a kept line costs its length and a gap mark)."""
        if len(self._text) <= chars:
            return self._text
        chosen: dict[int, _Entry] = {}
        room = chars
        hunks: dict[int, int] = {}  # a diff hunk's cost, all its lines
        for entry in self._entries:
            if entry.group >= 0:
                hunks[entry.group] = hunks.get(entry.group, 0) + len(self._shown(entry)) + 1
        taken: dict[int, bool] = {}
        deferred: list[_Entry] = []
        for entry in self._entries:
            if entry.group >= 0:
                if entry.group not in taken:
                    taken[entry.group] = hunks[entry.group] + GAP_CHARS <= room
                    room -= hunks[entry.group] + GAP_CHARS if taken[entry.group] else 0
                if taken[entry.group]:
                    chosen[entry.index] = entry
                else:  # too large whole: its lines compete after all the others
                    deferred.append(entry)
                continue
            cost = len(self._shown(entry)) + GAP_CHARS
            if cost <= room:
                room -= cost
                chosen[entry.index] = entry
        for entry in deferred:
            cost = len(self._shown(entry)) + GAP_CHARS
            if cost <= room:
                room -= cost
                chosen[entry.index] = entry
        if len([line for line in self._lines if line.strip()]) <= 2 or not chosen:
            return head_and_tail(self._text, chars)
        parts: list[str] = []
        position = 0
        for index in sorted(chosen):
            if index > position:
                parts.append(_gap(index - position, self._unit))
            parts.append(self._shown(chosen[index]))
            position = index + 1
        if position < len(self._lines):
            parts.append(_gap(len(self._lines) - position, self._unit))
        return "\n".join(parts)

    def ranked_lines(self, limit: int) -> list[str]:
        """The first `limit` error lines (not the command), one per template, the rarest
        template first, then by rank and position: what a digest of the text leads with."""
        found = [
            e
            for e in self._entries
            if e.index != self._command and ERROR_LINE.search(self._lines[e.index])
        ]
        found.sort(key=lambda e: (e.rarity, not e.note, e.tier, e.index))
        shown: list[str] = []
        templates: set[int] = set()
        for entry in found:  # one line per template: a collapsed one by its example
            if entry.template not in templates and len(shown) < limit:
                templates.add(entry.template)
                shown.append(self._shown(entry))
        return shown

    def signal_lines(self, limit: int, tiers: frozenset[int] | None = None) -> list[str]:
        """At most `limit` lines a digest of the text carries besides its errors, by the
        plan's rank: the lines the conversation names (not the command), a stack trace's
        head, the rare error lines and a series' outliers, a listing's odd statements,
        then (in a log) the lines of the rare templates. Never a collapsed template's example or a code signature:
        those are the routine the rest stands for. `tiers` narrows them."""
        wanted = {0, 1, 2, 5} if self._kind == "log" else {0} if self._kind == "diff" else {0, 1}
        wanted &= tiers if tiers is not None else wanted
        found = [
            e.index
            for e in self._entries
            if e.tier in wanted - {5} and e.index != self._command and e.group < 0
        ]
        # A rare line is signal wherever the plan ranked it: the last line of a list of
        # hotels may be the one step-free hotel (kept by position in render, tier 3).
        found += self._rare if 5 in wanted else ()
        shown: list[str] = []
        for index in found:
            if len(shown) >= limit:
                break
            line = self._lines[index].strip()
            if line and line not in shown and index != self._command:
                shown.append(line)
        return shown

    @property
    def kind(self) -> str:
        """What the text is (text_kind): "log", "code", "diff" or "prose"."""
        return self._kind

    def outliers(self) -> frozenset[str]:
        """The lines kept for a number far from the others of its column (outlier_lines),
        stripped: a digest marks them, since one such line among routine ones is what a
        later turn asks about ("that spike")."""
        return frozenset(self._lines[e.index].strip() for e in self._entries if e.outlier)

    def command(self) -> str:
        """The command line that produced the output, if it starts with one."""
        return self._lines[self._command] if self._command >= 0 else ""

    def _shown(self, entry: _Entry) -> str:
        return _elide_string(self._lines[entry.index], LINE_CHARS) + entry.note


def _odd_code_lines(
    lines: Sequence[str], numbers: Sequence[int], owner: Sequence[int], total: Sequence[int]
) -> list[int]:
    """The statements of a file listing whose template is rare where the others repeat:
    the one `cache_ttl = 0` among helpers that all say `value = Decimal(x) * factor`.
    Only when they are few: at most ODD_STATEMENTS, and at most a quarter of the
    statements (not signatures, not blank); in code whose every line is its own,
    rarity says nothing."""
    statements = [
        i
        for i, line in enumerate(lines)
        if owner[i] >= 0
        and _unnumbered(line, numbers[i]).strip()
        and not is_signature(_unnumbered(line, numbers[i]))
    ]
    rare = [i for i in statements if total[owner[i]] <= RARE_COUNT]
    return rare if len(rare) <= ODD_STATEMENTS and 4 * len(rare) <= len(statements) else []


ODD_STATEMENTS = 4  # rare statements of a listing kept as odd ones, at most (as RARE_STRINGS)


def _own_words(
    lines: Sequence[str], owner: Sequence[int], mined: Sequence[Template], total: Sequence[int]
) -> dict[int, int]:
    """Per line of a rare template, how many of its words (_words) no other template
    holds: what the line alone says. Among lines that are each rare (a list of contacts,
    of hotels by name), rarity tells them apart no more than position; the one whose
    words are said nowhere else (`legal hold: do not contact until ...` among routine
    notes, the one hotel with `step-free: yes` and a name of its own) is the news. A
    frequent template holds the words of its constant tokens and of the values its
    variable parts were seen to hold (Template.slots), so its lines are not read again."""
    seen: dict[str, int] = {}  # a word: the template holding it, or -2 for several

    def mark(words: set[str], template: int) -> None:
        for word in words:
            if seen.setdefault(word, template) != template:
                seen[word] = -2

    for number, template in enumerate(mined):
        if total[number] > RARE_COUNT:
            values = (value for slot in template.slots.values() for value in slot.counts)
            mark(_words(" ".join([*template.tokens, *values])), number)
    rare = {
        i: _words(line)
        for i, line in enumerate(lines)
        if owner[i] >= 0 and total[owner[i]] <= RARE_COUNT
    }
    for index, words in rare.items():
        mark(words, owner[index])
    return {index: sum(seen[w] >= 0 for w in words) for index, words in rare.items()}


def _rank(entry: _Entry) -> tuple[int, int, int]:
    """Rarer first; the frequent templates larger first; the last tier in order."""
    if entry.tier == 7:
        return (entry.tier, -entry.rarity, entry.index)
    if entry.tier == 8:
        return (entry.tier, 0, entry.index)
    return (entry.tier, entry.rarity, entry.index)


GAP_CHARS = 40  # what a gap mark costs, about


def _gap(count: int, unit: str = "line") -> str:
    return f"[... {count} {unit}{'s' if count != 1 else ''} {ELIDED} ...]"


def _collapsed_count(line: str) -> int:
    """The count a collapsed template's example line carries (an excerpt read again)."""
    match = COLLAPSED.search(line)
    return int(match.group(1)) if match else 0


def _trace_heads(lines: list[str], errors: list[bool]) -> list[int]:
    """For each stack trace: its exception line and its INNERMOST_FRAMES innermost frames.

    A Python trace ("Traceback ...") lists the innermost frame last and ends with the
    exception; a Java or Node trace starts with the exception and lists the innermost
    frame first ("at ...")."""
    found: list[int] = []
    index = 0
    while index < len(lines):
        if not FRAME_LINE.match(lines[index]):
            index += 1
            continue
        start = index
        while index < len(lines) and (
            FRAME_LINE.match(lines[index]) or lines[index].startswith("    ")
        ):
            index += 1
        frames = [i for i in range(start, index) if FRAME_LINE.match(lines[i])]
        before = start - 1
        if before >= 0 and lines[before].startswith("Traceback"):
            after = index if index < len(lines) else -1
            if after >= 0 and errors[after]:
                found.append(after)
            for frame in frames[-INNERMOST_FRAMES:]:
                found += [frame, frame + 1] if frame + 1 < index else [frame]
        elif before >= 0 and errors[before]:
            found.append(before)
            found += frames[:INNERMOST_FRAMES]
    return found


# --- code, diffs and documents (issue 22, item 4) ----------------------------------------

# A unified diff's hunk header, and the lines naming the files it changes.
DIFF_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,\d+)? @@")
DIFF_FILE = re.compile(r"^(?:diff --git |--- \S|\+\+\+ \S|index [0-9a-f]+\.\.)")
# A listing's own line number before each line (`cat -n`, `12: x`, `12 | x`).
NUMBERED = re.compile(r"^\s*(\d{1,6})(?: *[:|]\s?|\t| +)")
# A declaration: a definition keyword (after modifiers), a decorator, or a C-like
# signature that opens its body ("public int size() {").
SIGNATURE = re.compile(
    r"^\s*(?:@[A-Za-z_]"
    r"|(?:(?:export|default|pub(?:\([\w:]+\))?|public|private|protected|internal|static|async"
    r"|abstract|final|override|virtual|inline|extern|unsafe)\s+)*"
    r"(?:def|class|function|fn|func|interface|struct|enum|trait|impl|module|namespace)\b"
    r"[\s*]*[\w<(])"
    r"|^[ \t]*(?!(?:if|for|while|switch|catch|return|else|do|try|await|new)\b)"
    r"[\w<>\[\],*&:.]+(?: [\w<>\[\],*&:.]+)* \*?\w+\s*\([^;]*\)\s*(?:const\s*)?"
    r"(?:->\s*[^{;]+|throws [\w., ]+)?\{\s*$"
)
# The shape of a line of code: opens or closes a block, ends a statement, starts with a
# keyword, a comment or an assignment.
CODE_SHAPE = re.compile(
    r"[{}();:,\[\]]\s*$|^\s*[}\])]"
    r"|^\s*(?:#|//|/\*|\*|@|(?:import|from|return|if|elif|else|for|while|try|except|catch"
    r"|const|let|var|raise|throw|yield|package|using|pass|break|continue)\b)"
    r"|^\s*[\w.\[\]]+\s*[-+*/|&]?=\s*\S"
)
# A reference to a line by its number: "line 212", "lines 40-44", "app.py:212".
LINE_REFERENCE = re.compile(r"^lines?\s+(\d+)(?:\s*[-–]\s*(\d+))?$|\.\w{1,5}:(\d+)$", re.I)
LINE_RANGE = 12  # lines kept for one referenced range at most
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{2,}$")
DEFINITIONS = 3  # lines kept as the definitions of one referenced identifier
HEADING = re.compile(r"^(?:#{1,6}\s+\S|<h[1-6]\b|<title>|title:\s*\S)", re.I)
UNDERLINE = re.compile(r"^(?:=+|-+)$")
PROSE_WORDS = 8  # a line of prose holds at least this many words
SENTENCE_MARK = re.compile(r"[a-z][,.;!?](?:\s|$)")  # and punctuation after a word


def text_kind(lines: Sequence[str]) -> tuple[str, list[int]]:
    """What a text result is: "diff", "code" (a file listing), "prose" (a document or web
    page) or "log" (anything else), by its structure; and each line's number in the
    listing (its own number, its position in a listing, its new-side number in a diff;
    0 when none)."""
    numbers = _numbering(lines)
    blank = [not line.strip() for line in lines]
    nonblank = len(lines) - sum(blank)
    if nonblank == 0:
        return "log", [0] * len(lines)
    if any(DIFF_HUNK.match(line) for line in lines):
        return "diff", _diff_numbers(lines)
    body = [_unnumbered(line, numbers[i] if numbers else 0) for i, line in enumerate(lines)]
    signatures = sum(1 for line in body if is_signature(line))
    shaped = sum(
        1
        for i, line in enumerate(body)
        if not blank[i] and (line[:1] in (" ", "\t") or CODE_SHAPE.search(line) is not None)
    )
    if signatures and shaped * 2 >= nonblank:
        return "code", numbers or list(range(1, len(lines) + 1))
    size = sum(len(line) for line in lines)
    prose = sum(len(line) for line in lines if _is_prose(line))
    if prose * 5 >= size * 3 and not _repetitive(lines):
        return "prose", numbers or [0] * len(lines)
    return "log", numbers or [0] * len(lines)


def _repetitive(lines: Sequence[str]) -> bool:
    """Whether a fifth of the lines or more share frequent templates: a log, not prose."""
    mined, owner = mine(lines)
    sizes = [len(template.lines) for template in mined]
    return sum(1 for t in owner if t >= 0 and sizes[t] > RARE_COUNT) * 5 >= len(owner)


def is_signature(line: str) -> bool:
    return SIGNATURE.match(line) is not None


def _is_prose(line: str) -> bool:
    stripped = line.strip()
    if len(stripped) < 40 or stripped[:1].isdigit():
        return False
    letters = sum(1 for c in stripped if c.isalpha() or c == " ")
    return (
        letters * 10 >= len(stripped) * 8
        and len(WORD.findall(stripped)) >= PROSE_WORDS
        and SENTENCE_MARK.search(stripped) is not None
    )


def _numbering(lines: Sequence[str]) -> list[int]:
    """Each line's own number when the listing numbers its lines (most lines carry a
    number one more than the line before), else nothing."""
    found = [NUMBERED.match(line) for line in lines]
    numbered = [(i, int(m.group(1))) for i, m in enumerate(found) if m is not None]
    nonblank = sum(1 for line in lines if line.strip())
    if len(numbered) < 3 or len(numbered) * 5 < nonblank * 4:
        return []
    steps = sum(1 for (i, a), (j, b) in pairwise(numbered) if b - a == j - i)
    if steps * 5 < (len(numbered) - 1) * 4:
        return []
    return [int(m.group(1)) if m is not None else 0 for m in found]


def _unnumbered(line: str, number: int) -> str:
    """A line without the listing's own number before it."""
    match = NUMBERED.match(line) if number else None
    return line[match.end() :] if match is not None else line


def _diff_numbers(lines: Sequence[str]) -> list[int]:
    """Each line's number on the new side of a diff (0 for removed and header lines)."""
    numbers: list[int] = []
    current = 0
    for line in lines:
        match = DIFF_HUNK.match(line)
        if match is not None:
            current = int(match.group(1))
            numbers.append(0)
        elif current and line[:1] in (" ", "+") and not line.startswith("+++ "):
            numbers.append(current)
            current += 1
        else:
            numbers.append(0)
    return numbers


def diff_hunks(lines: Sequence[str]) -> list[list[int]]:
    """The lines of a diff kept together: each file's header lines, and each hunk's
    header with its added and removed lines (its context lines are kept later)."""
    groups: list[list[int]] = []
    inside = False
    for index, line in enumerate(lines):
        if DIFF_FILE.match(line) and not (inside and line[:1] in "+-" and _in_hunk(lines, index)):
            if not groups or inside:
                groups.append([])
            inside = False
            groups[-1].append(index)
        elif DIFF_HUNK.match(line):
            groups.append([index])
            inside = True
        elif inside and line[:1] in ("+", "-", "\\"):
            groups[-1].append(index)
        elif inside and line[:1] != " " and line:
            inside = False
    return groups


def _in_hunk(lines: Sequence[str], index: int) -> bool:
    """Whether a line that reads like a file header ("--- x") is a removed line: a file
    header is followed by its "+++" line."""
    line = lines[index]
    if line.startswith("--- "):
        return not (index + 1 < len(lines) and lines[index + 1].startswith("+++ "))
    if line.startswith("+++ "):
        return not (index > 0 and lines[index - 1].startswith("--- "))
    return True


def _referenced_code(
    lines: Sequence[str], numbers: Sequence[int], referenced: frozenset[str]
) -> list[int]:
    """The lines of a listing the conversation refers to by number ("line 212", a
    file:line) or by an identifier it defines (`days_in_year`: the line assigning or
    declaring it, even when many lines use it)."""
    wanted: set[int] = set()
    names: list[str] = []
    for token in sorted(referenced):
        match = LINE_REFERENCE.search(token)
        if match is not None:
            start = int(match.group(1) or match.group(3))
            end = int(match.group(2) or start)
            if 0 <= end - start < LINE_RANGE:
                wanted.update(range(start, end + 1))
        elif IDENTIFIER.match(token) and len(names) < QUERY_STRINGS:
            names.append(token)
    found = [i for i, number in enumerate(numbers) if number and number in wanted]
    for name in names:
        escaped = re.escape(name)
        definition = re.compile(
            r"\b(?:def|class|function|fn|func|struct|interface|enum|trait|type|const|let|var"
            r"|val)\s+" + escaped + r"\b|^\s*(?:[\w.]+\.)?" + escaped + r"\s*(?::[^=]+)?=(?!=)"
        )
        hits = 0
        for index, line in enumerate(lines):
            if name in line and definition.search(_unnumbered(line, numbers[index])):
                found.append(index)
                hits += 1
                if hits >= DEFINITIONS:
                    break
    return found


def prose_units(lines: Sequence[str]) -> tuple[list[str], list[bool]]:
    """A document as its units: headings (markdown, HTML, underlined, or a short line on
    its own) and the sentences of its paragraphs (lines joined, then split); and which
    units are headings."""
    units: list[str] = []
    headings: list[bool] = []
    paragraph: list[str] = []

    def flush() -> None:
        for sentence in sentences(" ".join(paragraph)):
            units.append(sentence)
            headings.append(False)
        paragraph.clear()

    for index, line in enumerate(lines):
        stripped = line.strip()
        after = lines[index + 1].strip() if index + 1 < len(lines) else ""
        before = lines[index - 1].strip() if index > 0 else ""
        if not stripped or UNDERLINE.match(stripped):
            flush()
        elif (
            HEADING.match(stripped)
            or (UNDERLINE.match(after) and len(stripped) < 120)
            or (len(stripped) < 80 and not before and not after and stripped[-1:] not in ".,;:")
        ):
            flush()
            units.append(stripped)
            headings.append(True)
        elif _BULLET.match(stripped):
            flush()
            paragraph.append(stripped)
            flush()
        else:
            paragraph.append(stripped)
    flush()
    return units, headings


def _repeated(units: Sequence[str]) -> list[bool]:
    """Per unit, whether the same text stood earlier."""
    seen: set[str] = set()
    found = []
    for unit in units:
        text = unit.strip()
        found.append(bool(text) and text in seen)
        seen.add(text)
    return found


def _rare_units(
    units: Sequence[str], owner: Sequence[int], total: Sequence[int], again: Sequence[bool]
) -> list[int]:
    """The units of a rare template (at most RARE_COUNT) in a text whose other units
    repeat (at least half of them said before): the one finding among boilerplate. In a
    text where every sentence is new, none is singled out."""
    if 2 * sum(again) < len(units):
        return []
    rare = [i for i, t in enumerate(owner) if t >= 0 and total[t] <= RARE_COUNT]
    return rare if 4 * len(rare) <= len(units) else []


def _query_hits(units: Sequence[str], query: frozenset[str]) -> list[int]:
    """For each unit, how many of the query's terms it carries."""
    if not query:
        return [0] * len(units)
    return [
        len(query.intersection(_stem(w.lower()) for w in WORD.findall(unit.replace("-", " "))))
        for unit in units
    ]


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _elide(value: Any, limits: _Limits, depth: int = 0) -> Any:
    if isinstance(value, str):
        return _elide_string(value, limits.chars)
    if isinstance(value, list):
        if depth >= limits.depth:
            return f"[{len(value)} items {ELIDED}]" if value else []
        kept = [_elide(v, limits, depth + 1) for v in value[: limits.items]]
        if len(value) > limits.items:
            kept.append(f"[... {len(value) - limits.items} more items {ELIDED}]")
        return kept
    if isinstance(value, dict):
        if depth >= limits.depth:
            return f"[object with {len(value)} keys {ELIDED}]" if value else {}
        keys = list(value)[: max(limits.items * 4, 4)]
        kept_dict = {k: _elide(value[k], limits, depth + 1) for k in keys}
        if len(value) > len(keys):
            kept_dict["..."] = f"[... {len(value) - len(keys)} more keys {ELIDED}]"
        return kept_dict
    return value


def _elide_string(value: str, chars: int) -> str:
    if len(value) <= chars:
        return value
    return f"{value[:chars]}[... {len(value) - chars} more characters {ELIDED}]"


def head_and_tail(text: str, chars: int) -> str:
    """The first and last chars/2 characters around an explicit elision marker."""
    if len(text) <= chars:
        return text
    half = chars // 2
    return (
        f"{text[:half]}\n[... {len(text) - 2 * half} more characters {ELIDED} ...]\n{text[-half:]}"
    )


def _with_output(item: Item, body: str) -> Item:
    """Same keys as the original output, with the text replaced."""
    raw = dict(item.raw)
    if item.api == "chat":
        raw["content"] = body
        return chat_item(raw)
    raw["output"] = body
    return responses_item(raw)


def _count(item: Item, counter: TokenCounter) -> int:
    """Uncached count: failed candidates must not fill the shared cache."""
    if item.api == "chat":
        return counter.chat_message(item.raw)
    return counter.responses_item(item.raw)


# --- salience across turns (issue 22, item 3) -----------------------------------------------


def compressed_for(
    item: Item,
    call: Item | None,
    max_tokens: int,
    counter: TokenCounter,
    own: frozenset[str],
    later: frozenset[str] = frozenset(),
    said: Sequence[str] = (),
) -> Item:
    """The compressed form of a tool result: by what the rest of its own turn names
    (`own`), and by what later turns name (`later`) only where that form lacks it.

    A later turn may name a value of an old result ("line 42", an id, a quoted phrase, a
    call's argument): when the form made by its own turn already holds that evidence,
    the form stays byte for byte the same (the prompt cache); when it does not, the
    result is compressed again with those values too: one prefix break instead of a
    lost fact, and the form then stays the same for as long as no later turn names
    another value it lacks. `said`: what the assistant stated in the rest of the turn;
    the lines its findings rest on are kept (evidence_lines)."""
    own |= evidence_lines(output_text(item), said)
    base = compress_tool_output(item, call, max_tokens, counter, own)
    missing = lacking_evidence(item, base, later - own)
    if not missing:
        return base
    return compress_tool_output(item, call, max_tokens, counter, own | missing)


def lacking_evidence(item: Item, shown: Item, named: frozenset[str]) -> frozenset[str]:
    """The values of `named` that pick out part of `item`'s result which `shown` (its
    compressed form) does not carry: a value found in at most REFERENCE_MAX of its lines
    (singling_out) and absent from the form, or a listing's line named by its number or
    by the identifier it defines whose text the form lacks."""
    if not named:
        return named
    text = output_text(item)
    inner = embedded_text(json_container(text))
    if inner is not None:
        text = inner[1]
    kept = output_text(shown)
    parsed = json_container(kept)
    if parsed is not None:
        kept = "\n".join(leaf_texts(parsed))
    lines = text.splitlines()
    present = frozenset(token for token in named if token in text)
    missing = {token for token in singling_out(present, lines) if not holds(kept, token)}
    code = [t for t in sorted(named - missing) if LINE_REFERENCE.search(t) or t in present]
    if code and (inner is not None or json_container(text) is None):
        kind, numbers = text_kind(lines)
        if kind in ("code", "diff"):
            for token in code:
                chosen = _referenced_code(lines, numbers, frozenset({token}))
                if any(lines[i].strip() and lines[i].strip() not in kept for i in chosen):
                    missing.add(token)
    return frozenset(missing)


FINDING_WORDS = 2  # rare words a line shares with a statement to be its evidence
EVIDENCE_LINES = 2  # lines kept per statement


def evidence_lines(text: str, said: Sequence[str]) -> frozenset[str]:
    """The lines of a text result that statements (`said`: the assistant's "the pool is
    exhausted", a later "raise the memory limit we saw") rest on, as referenced values
    (issue 22, item 3): a line sharing at least FINDING_WORDS words with a sentence,
    counting only words found in at most REFERENCE_MAX of the result's lines (what the
    40 routine lines all say points at none). A line's words include those of the lines
    it is nested under (structure_words): in a manifest, `memory: 320Mi` under `limits:`
    is the memory limit, `memory: 128Mi` under `requests:` is not. At most
    EVIDENCE_LINES per sentence, the best first."""
    if not said or not text:
        return frozenset()
    inner = embedded_text(json_container(text))
    lines = (inner[1] if inner is not None else text).splitlines()
    if len(lines) < 2:
        return frozenset()
    where: dict[str, list[int]] = {}  # a word: the lines holding it, up to one too many
    for index, found in enumerate(structure_words(lines)):
        for word in found:
            holding = where.setdefault(word, [])
            if len(holding) <= REFERENCE_MAX:
                holding.append(index)
    kept: set[str] = set()
    for sentence in (s for statement in said for s in sentences(statement)):
        rare = [w for w in _words(sentence) if len(where.get(w, ())) <= REFERENCE_MAX]
        if len(rare) < FINDING_WORDS:
            continue
        scores: dict[int, int] = {}
        for word in rare:
            for index in where.get(word, ()):
                scores[index] = scores.get(index, 0) + 1
        best = sorted((-n, i) for i, n in scores.items() if n >= FINDING_WORDS)[:EVIDENCE_LINES]
        kept.update(lines[i].strip() for _, i in best if lines[i].strip())
    return frozenset(kept)


def structure_words(lines: Sequence[str]) -> list[set[str]]:
    """Each line's words (_words) with those of the lines it is nested under: the nearest
    line above with less indentation, and so on up (a YAML or JSON document's keys, a
    function's name for its body). A listing's own numbers are not indentation; a flat
    text (a log) has no nesting, each line its own words."""
    numbers = _numbering(lines)
    stack: list[tuple[int, set[str]]] = []  # (indentation, words with the ancestors')
    found: list[set[str]] = []
    for index, line in enumerate(lines):
        body = _unnumbered(line, numbers[index]) if numbers else line
        own = _words(body)
        if not body.strip():
            found.append(own)
            continue
        indent = len(body) - len(body.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        words = own | stack[-1][1] if stack else own
        stack.append((indent, words))
        found.append(words)
    return found


def _words(text: str) -> set[str]:
    found = (w.lower() for w in WORD.findall(text.replace(".", " ").replace("_", " ")))
    return {_stem(w) for w in found if len(w) >= 4 and w not in STOPWORDS}
