"""Deterministic compression of tool results and digests of dropped turns (seed section 8).

Summarizing loses exact parameters, negations, times and sources; structured
compression keeps them as fields (seed 8.3). So a compressed tool result keeps the
tool's name, the call id and the time, the top-level scalar facts of a JSON result
verbatim, and replaces long arrays and strings by explicit elision markers. A digest of
dropped turns keeps the user's requests and constraints, the verified facts from tool
results and the calls still waiting for a result, and keeps tool facts apart from what
was merely said. Both are pure functions of their input: the same history always
gives the same bytes, which keeps the provider's prompt cache warm.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.core.items import Api, Item, JsonDict, chat_item, message_text, responses_item
from proxy.core.tokens import TokenCounter

COMPRESSED_KEY = "threadkeeper_compressed"
SUMMARY_MARKER = "[threadkeeper summary of earlier conversation]"
ELIDED = "elided by threadkeeper"

# Responses outputs whose `output` is text (or text parts) and can become a string;
# computer/shell outputs carry screenshots or structured logs and keep their shape.
COMPRESSIBLE_RESPONSES_TYPES = frozenset({"function_call_output", "custom_tool_call_output"})

# Sentences that constrain the rest of the task (seed 7.1: "all amounts in CNY, tax
# included by default" must survive trimming).
CONSTRAINT_WORDS = re.compile(
    r"\b(must|never|always|only|default|don'?t|do not|should|required?|make sure|all|every|each|tax(?:es)? included)\b"
    r"|所有|必须|不要|不能|默认|只能|只要|总是|永远|务必|禁止|一律",
    re.IGNORECASE,
)
SENTENCE_END = re.compile(r"(?<=[.!?。！？\n])\s*")
WHITESPACE = re.compile(r"\s+")


def is_compressible(item: Item) -> bool:
    if item.kind != "tool_output":
        return False
    return item.api == "chat" or item.type in COMPRESSIBLE_RESPONSES_TYPES


def is_summary(item: Item) -> bool:
    """A digest made by a Summarizer (its text starts with SUMMARY_MARKER)."""
    return item.is_instruction and item.text().startswith(SUMMARY_MARKER)


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
_compressed: dict[tuple[str, str, str, int, str, str], Item] = {}
COMPRESSED_CACHE_MAX = 8192


def compress_tool_output(
    item: Item, call: Item | None, max_tokens: int, counter: TokenCounter, now: str
) -> Item:
    """A replacement for a tool result that is at most max_tokens (item overhead included).

    Only when max_tokens is below the size of the bare source marker is the result
    larger; the caller compares sizes before using it.
    """
    key = (
        item.api,
        item.digest,
        call.digest if call is not None else "",
        max_tokens,
        counter.encoding.name,
        now,
    )
    cached = _compressed.get(key)
    if cached is None:
        cached = _compress(item, call, max_tokens, counter, now)
        if len(_compressed) >= COMPRESSED_CACHE_MAX:
            _compressed.clear()
        _compressed[key] = cached
    return cached


def _compress(
    item: Item, call: Item | None, max_tokens: int, counter: TokenCounter, now: str
) -> Item:
    text = output_text(item)
    source = {
        "tool": tool_name(item, call),
        "call_id": item.output_for,
        "time": now,
        "original_tokens": counter.item(item),
    }
    candidate = item
    for body in _bodies(text, source, max_tokens):
        candidate = _with_output(item, json.dumps(body, ensure_ascii=False))
        if _count(candidate, counter) <= max_tokens:
            return candidate
    return candidate


def _bodies(text: str, source: JsonDict, max_tokens: int) -> Iterator[JsonDict]:
    """Ever smaller compressed forms, ending with the bare source marker."""
    parsed = _json_container(text)
    if parsed is not None:
        for limits in JSON_LIMITS:
            yield {COMPRESSED_KEY: source, **_structured(parsed, limits)}
    chars = min(len(text), max(max_tokens, 0) * 4)
    while chars >= 16:
        yield {COMPRESSED_KEY: source, "excerpt": head_and_tail(text, chars)}
        chars //= 2
    yield {COMPRESSED_KEY: source}
    yield {COMPRESSED_KEY: {"tool": source["tool"], "call_id": source["call_id"]}}


def _json_container(text: str) -> dict[str, Any] | list[Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict | list) else None


def _structured(value: dict[str, Any] | list[Any], limits: _Limits) -> JsonDict:
    """Verified facts (top-level scalars, kept) apart from the elided rest."""
    if isinstance(value, list):
        return {"verified_facts": {"item_count": len(value)}, "rest": _elide(value, limits)}
    facts = {k: _elide(v, limits) for k, v in value.items() if _is_scalar(v)}
    rest = {k: v for k, v in value.items() if not _is_scalar(v)}
    body: JsonDict = {"verified_facts": facts}
    if rest:
        body["rest"] = _elide(rest, limits)
    return body


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


# --- digests of dropped turns -------------------------------------------------------------


class Summarizer(Protocol):
    """Replaces dropped history by one instruction item at most max_tokens long.

    The item's text must start with SUMMARY_MARKER. `previous_summary` is the digest the
    dropped items are added to. An LLM summarizer plugs in here (SPEC section 5, step 2);
    `summarize_turns` is the deterministic default.
    """

    def __call__(
        self,
        items: Sequence[Item],
        counter: TokenCounter,
        max_tokens: int,
        previous_summary: Item | None,
        /,
    ) -> Item: ...


# Sections of a digest, in the order they are written; the priority decides what
# survives when the digest is over budget (constraints last to go).
SECTIONS: tuple[tuple[str, int], ...] = (
    ("Constraints stated by the user (their words):", 5),
    ("Verified facts from tool results:", 3),
    ("Pending actions (called, no result seen):", 4),
    ("User requests:", 2),
    ("Said by the assistant (not verified):", 1),
    ("Earlier summary:", 0),
)
HEADER = re.compile(re.escape(SUMMARY_MARKER) + r" Stands for (\d+) earlier items")
REQUEST_CHARS = 240
FACT_CHARS = 160
STATEMENT_CHARS = 160
MAX_ENTRIES = 200  # newest entries per section considered; bounds the work


def summarize_turns(
    items: Sequence[Item],
    counter: TokenCounter,
    max_tokens: int,
    previous_summary: Item | None = None,
) -> Item:
    """Deterministic digest of `items` (plus the previous digest), at most max_tokens
    when max_tokens leaves room for the header line."""
    api = _api_of(items, previous_summary)
    sections = _previous_sections(previous_summary)
    for title, entries in _sections_of(items).items():
        sections[title].extend(entries)
    count = len(items) + _previous_count(previous_summary)
    header = (
        f"{SUMMARY_MARKER} Stands for {count} earlier items no longer sent verbatim. "
        "Tool facts are verified results; everything else is what was said, not checked."
    )
    return _fit_digest(api, header, sections, counter, max_tokens)


def _api_of(items: Sequence[Item], previous: Item | None) -> Api:
    if items:
        return items[0].api
    if previous is not None:
        return previous.api
    raise ValueError("summarize_turns needs items or a previous summary")


def summary_item(api: Api, text: str) -> Item:
    """Chat: a system message; Responses: a developer message."""
    if api == "chat":
        return chat_item({"role": "system", "content": text})
    return responses_item({"type": "message", "role": "developer", "content": text})


def _empty_sections() -> dict[str, list[str]]:
    return {title: [] for title, _ in SECTIONS}


def _previous_sections(previous: Item | None) -> dict[str, list[str]]:
    """Entries of a digest this module wrote; any other text becomes one earlier entry."""
    sections = _empty_sections()
    if previous is None:
        return sections
    text = previous.text()
    title = None
    for line in text.splitlines()[1:]:
        if line in sections:
            title = line
        elif title is not None and line.startswith("- "):
            sections[title].append(line[2:])
    if not HEADER.match(text):
        sections["Earlier summary:"].append(_one_line(text, FACT_CHARS * 4))
    return sections


def _previous_count(previous: Item | None) -> int:
    match = HEADER.match(previous.text()) if previous is not None else None
    return int(match.group(1)) if match else 0


def _sections_of(items: Sequence[Item]) -> dict[str, list[str]]:
    sections = _empty_sections()
    answered = {item.output_for for item in items if item.output_for is not None}
    calls = {call_id: item for item in items for call_id in item.call_ids}
    for item in items:
        if item.is_user_message:
            text = item.text()
            sections["User requests:"].append(_one_line(text, REQUEST_CHARS))
            sections["Constraints stated by the user (their words):"].extend(constraints(text))
        elif item.kind == "tool_output":
            call = calls.get(item.output_for or "")
            sections["Verified facts from tool results:"].append(_fact(item, call))
        elif item.kind == "tool_calls":
            for call_id in item.call_ids:
                if call_id not in answered:
                    sections["Pending actions (called, no result seen):"].append(
                        _pending(item, call_id)
                    )
            if item.text():
                sections["Said by the assistant (not verified):"].append(
                    _one_line(item.text(), STATEMENT_CHARS)
                )
        elif item.kind == "message" and item.role == "assistant" and item.text():
            sections["Said by the assistant (not verified):"].append(
                _one_line(item.text(), STATEMENT_CHARS)
            )
    return sections


def constraints(text: str) -> list[str]:
    """The user's sentences that constrain the task, kept word for word."""
    found = []
    for sentence in SENTENCE_END.split(text):
        sentence = sentence.strip()
        if sentence and CONSTRAINT_WORDS.search(sentence):
            found.append(_one_line(sentence, REQUEST_CHARS))
    return found


def _one_line(text: str, chars: int) -> str:
    return _elide_string(WHITESPACE.sub(" ", text).strip(), chars)


def _fact(output: Item, call: Item | None) -> str:
    """tool call_id: the top-level scalar facts of the result (or an excerpt of text)."""
    name = tool_name(output, call)
    text = output_text(output)
    parsed = _json_container(text)
    if isinstance(parsed, dict):
        if isinstance(parsed.get(COMPRESSED_KEY), dict):
            parsed = parsed.get("verified_facts") or {}
        facts = {k: v for k, v in parsed.items() if _is_scalar(v)}
        shown = json.dumps(facts, ensure_ascii=False) if facts else "(no scalar facts)"
    elif isinstance(parsed, list):
        shown = f"a list of {len(parsed)} items"
    else:
        shown = json.dumps(_one_line(text, FACT_CHARS), ensure_ascii=False)
    return f"{name} {output.output_for}: {_elide_string(shown, FACT_CHARS * 2)}"


def _pending(call: Item, call_id: str) -> str:
    arguments: Any = call.raw.get("arguments", call.raw.get("input", ""))
    for tool_call in call.raw.get("tool_calls") or []:
        if isinstance(tool_call, Mapping) and tool_call.get("id") == call_id:
            function = tool_call.get("function")
            if isinstance(function, Mapping):
                arguments = function.get("arguments", "")
                name = function.get("name", "unknown")
                return f"{name} {call_id} {_one_line(str(arguments), FACT_CHARS)}"
    name = call.name or call.type or "unknown"
    return f"{name} {call_id} {_one_line(str(arguments), FACT_CHARS)}"


def _fit_digest(
    api: Api,
    header: str,
    sections: dict[str, list[str]],
    counter: TokenCounter,
    max_tokens: int,
) -> Item:
    """Keeps the highest-priority, newest entries that fit; recounts the exact result."""
    candidates = _ranked_entries(sections, counter.text)
    item = summary_item(api, header)
    room = max_tokens - _count(item, counter)
    while room > 0:
        chosen = _choose(candidates, room)
        item = summary_item(api, _render(header, sections, chosen))
        excess = _count(item, counter) - max_tokens
        if excess <= 0:
            return item
        room -= excess + 8
    return summary_item(api, header)


@dataclass(frozen=True, slots=True)
class _Entry:
    title: str
    index: int
    rank: tuple[int, int]
    tokens: int


def _ranked_entries(
    sections: dict[str, list[str]], count_text: Callable[[str], int]
) -> list[_Entry]:
    """Entries best first: by section priority, then newest first."""
    priority = dict(SECTIONS)
    entries = []
    for title, lines in sections.items():
        start = max(0, len(lines) - MAX_ENTRIES)
        for index in range(start, len(lines)):
            tokens = count_text(f"- {lines[index]}\n")
            entries.append(_Entry(title, index, (-priority[title], -index), tokens))
    entries.sort(key=lambda entry: entry.rank)
    return entries


def _choose(entries: list[_Entry], room: int) -> set[tuple[str, int]]:
    chosen: set[tuple[str, int]] = set()
    used: set[str] = set()
    for entry in entries:
        cost = entry.tokens + (0 if entry.title in used else 10)  # 10: the section title
        if cost <= room:
            room -= cost
            chosen.add((entry.title, entry.index))
            used.add(entry.title)
    return chosen


def _render(header: str, sections: dict[str, list[str]], chosen: set[tuple[str, int]]) -> str:
    lines = [header]
    for title, _ in SECTIONS:
        kept = [line for i, line in enumerate(sections[title]) if (title, i) in chosen]
        if kept:
            lines.append(title)
            lines.extend(f"- {line}" for line in kept)
    return "\n".join(lines)
