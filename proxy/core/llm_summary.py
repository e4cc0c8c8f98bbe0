"""What the summarizer model is asked, and what its answer may become (issue 10, item 1).

The model writes structured state, not prose: the user's standing constraints word for
word, decisions taken, verified tool facts with their values, current preferences (an
earlier one only as "changed from"), open tasks and pending side-effecting calls,
entities. Its JSON answer is read into the memory state of proxy/core/memory.py and
rendered by the same `render` as the deterministic digest, so both kinds of summary
read alike and the same state always gives the same bytes. The guard (`memory.guard`)
first appends to its section, verbatim, every must-keep string the model left out (the
deterministic extractor's: ids, amounts, rules, preferences, pending calls, decisions);
a summary that cannot hold them all in its limit is not used.

An answer that is not JSON, not an object, or has a field of the wrong type gives None:
the caller keeps the deterministic digest. Pure: the call itself is proxy/summarizer.py.

>>> messages = summary_messages(items, instructions=None)     # Chat Completions messages
>>> written = summary_from_answer(answer_text, items, counter, max_tokens=800)
>>> written.item if written is not None else deterministic_digest
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from proxy.core import memory
from proxy.core.compress import head_and_tail, output_text, tool_name
from proxy.core.items import Item, JsonDict
from proxy.core.tokens import TokenCounter

# One item's text in the transcript; a longer one keeps its head and tail.
ITEM_CHARS = 6_000

# The fields of the answer: name -> (what it holds, the JSON type of each entry).
FIELDS: dict[str, tuple[str, type]] = {
    "constraints": ("the user's standing rules and constraints, copied word for word", str),
    "preferences": (
        'the user\'s current preferences: {"preference", "changed_from"} where '
        "changed_from is the earlier preference it replaced, or null",
        dict,
    ),
    "decisions": ("decisions taken or agreed, with their ids, amounts and dates", str),
    "open_tasks": ("work asked for and not yet done", str),
    "pending_calls": (
        'side-effecting calls made without a result seen: {"tool", "arguments"}',
        dict,
    ),
    "facts": (
        'verified tool results: {"tool", "values": {name: value}} with the ids, '
        "amounts, statuses and dates the result holds (never transport metadata)",
        dict,
    ),
    "entities": ("ids, references, e-mail addresses and amounts the conversation uses", str),
}

SYSTEM_PROMPT = (
    "You write the memory of a conversation whose earlier part will no longer be sent "
    "to the assistant. Answer with one JSON object and nothing else, with these keys, "
    "each a list (empty when there is nothing):\n"
    + "\n".join(f'- "{name}": {what}' for name, (what, _) in FIELDS.items())
    + "\nRules: copy constraints, ids, amounts and dates exactly as written; never "
    "invent anything; a later preference replaces an earlier one; a tool result is a "
    "fact only when the tool returned it; what the assistant merely said is a decision "
    "only when the user agreed or it was carried out; a call whose result appears is "
    "no longer pending. When a memory so far is given, answer with the whole memory: "
    "everything of it that still holds, updated by the conversation."
)


@dataclass(frozen=True)
class Written:
    """An LLM summary that passed the guard: the item to send and the state behind it."""

    item: Item
    state: JsonDict  # memory.to_json of the state the model wrote, as an object
    appended: tuple[str, ...]  # must-keep strings the guard added (empty: none missing)


def summary_messages(
    items: Sequence[Item], instructions: str | None, previous: Item | None = None
) -> list[JsonDict]:
    """The Chat Completions messages asking for the state of `items`; `previous` is the
    summary they follow, which the answer must carry forward."""
    system = SYSTEM_PROMPT if not instructions else f"{SYSTEM_PROMPT}\n{instructions}"
    parts = []
    if previous is not None:
        parts.append(
            f"Memory so far (carry everything still true into your answer):\n{previous.text()}\n"
        )
    parts.append("Conversation to remember:\n" + transcript(items))
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(parts)}]


def transcript(items: Sequence[Item]) -> str:
    """One line per item: who, what kind, its text (calls with their arguments)."""
    calls = {call_id: item for item in items for call_id in item.call_ids}
    return "\n".join(_line(item, calls) for item in items)


def _line(item: Item, calls: Mapping[str, Item]) -> str:
    if item.kind == "tool_output":
        name = tool_name(item, calls.get(item.output_for or ""))
        body = output_text(item)
        return f"[tool result {name} {item.output_for}] {head_and_tail(body, ITEM_CHARS)}"
    text = head_and_tail(item.text(), ITEM_CHARS)
    if item.kind == "tool_calls":
        shown = [f"{name}({head_and_tail(args, ITEM_CHARS)})" for name, args in _calls(item)]
        said = f" {text}" if text else ""
        return f"[{item.role or 'assistant'} calls {', '.join(shown)}]{said}"
    return f"[{item.role or item.type or 'item'}] {text}"


def _calls(item: Item) -> list[tuple[str, str]]:
    """(name call_id, arguments) of each call an item makes, both APIs."""
    raw = item.raw
    found = []
    for call in raw.get("tool_calls") or []:
        if isinstance(call, Mapping):
            function = call.get("function")
            if not isinstance(function, Mapping):
                function = {}
            found.append((f"{function.get('name', '?')} {call.get('id')}", _text(function)))
    if not found:
        name = item.name or item.type or "call"
        found.append((f"{name} {','.join(item.call_ids)}", _text(raw)))
    return found


def _text(raw: Mapping[str, Any]) -> str:
    value = raw.get("arguments", raw.get("input", ""))
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def parse_answer(text: str) -> JsonDict | None:
    """The answer's fields when it is the JSON object asked for, else None."""
    try:
        value = json.loads(_unfenced(text))
    except (ValueError, TypeError):
        return None
    if not isinstance(value, dict) or not any(name in value for name in FIELDS):
        return None
    answer: JsonDict = {}
    for name, (_, entry_type) in FIELDS.items():
        entries = value.get(name, [])
        if entries is None:
            entries = []
        if not isinstance(entries, list) or not all(isinstance(e, entry_type) for e in entries):
            return None
        answer[name] = entries
    return answer


def _unfenced(text: str) -> str:
    """A JSON object some models wrap in a ``` fence."""
    stripped = text.strip()
    if stripped.startswith("```"):
        stripped = stripped.split("\n", 1)[-1].rsplit("```", 1)[0]
    return stripped


def state_from_answer(
    fields: Mapping[str, list[Any]], count: int, previous: memory.MemoryState | None = None
) -> memory.MemoryState | None:
    """The memory state the model's fields describe (standing for `count` items); None
    when an entry lacks what it must hold."""
    try:
        preferences = tuple(_preference(e) for e in fields["preferences"])
        pending = tuple(memory.Pending(_call(e, "arguments")) for e in fields["pending_calls"])
        facts = tuple(_call(e, "values", " -> ") for e in fields["facts"])
    except (KeyError, TypeError, ValueError):
        return None
    base = previous or memory.MemoryState()
    return memory.MemoryState(
        count=base.count + count,
        constraints=_texts(fields["constraints"]),
        preferences=preferences,
        decisions=_texts(fields["decisions"]),
        open_tasks=_texts(fields["open_tasks"]),
        pending=pending,
        facts=facts,
        entities=_texts(fields["entities"]),
    )


def _texts(entries: list[Any]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(" ".join(e.split()) for e in entries if e.strip()))


def _preference(entry: Mapping[str, Any]) -> memory.Preference:
    text, before = entry.get("preference"), entry.get("changed_from")
    if not isinstance(text, str) or not text.strip() or not isinstance(before, str | None):
        raise ValueError("a preference is {preference: text, changed_from: text or null}")
    return memory.Preference(" ".join(text.split()), " ".join((before or "").split()))


def _call(entry: Mapping[str, Any], values: str, joiner: str = "") -> str:
    """tool(arguments) or tool -> name=value, ...: how the digest writes calls and facts."""
    tool = entry.get("tool")
    if not isinstance(tool, str) or not tool.strip():
        raise ValueError("a call or fact names its tool")
    given = entry.get(values)
    if isinstance(given, Mapping):
        shown = ", ".join(f"{k}={_value(v)}" for k, v in given.items())
    elif given is None:
        shown = ""
    else:
        shown = _value(given)
    return f"{tool.strip()}{joiner}{shown}" if joiner else f"{tool.strip()}({shown})"


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# A rendering budget no summary reaches: every entry of a state (to see what it holds).
WHOLE = 1 << 30


def summary_from_answer(
    answer: str,
    items: Sequence[Item],
    counter: TokenCounter,
    max_tokens: int,
    previous: Item | None = None,
    base: memory.MemoryState | None = None,
) -> Written | None:
    """The guarded summary item of `items` (extending `previous`, a summary they follow)
    from the model's answer, at most max_tokens; None when the answer is not the state
    asked for, or when the must-keep strings do not all fit (the deterministic digest
    stands). `base`: the state `previous` was rendered from, when the caller holds it
    (a compaction's: its text does not carry the pending calls' ids, so a call answered
    in `items` would stay pending if the text were read back)."""
    fields = parse_answer(answer)
    if fields is None or not items:
        return None
    earlier = base if base is not None else memory.state_of(previous)
    state = state_from_answer(fields, len(items), earlier)
    if state is None:
        return None
    reference = memory.extract(items, earlier)
    keep = reference.must_keep()
    appended = missing(memory.render(state, counter, WHOLE), keep)
    # The model's own entries rank with the must-keep ones when rendered; when they
    # crowd a must-keep string out of the limit, the ones that are not must-keep go.
    for candidate in (state, _only_kept(state, keep)):
        guarded = memory.guard(candidate, reference)
        item = memory.fit_summary(items[0].api, guarded, counter, max_tokens)
        if _tokens(item, counter) <= max_tokens and not missing(item.text(), keep):
            return Written(item, json.loads(memory.to_json(guarded)), appended)
    return None


def _only_kept(state: memory.MemoryState, keep: Sequence[str]) -> memory.MemoryState:
    """`state` without the entries of must-keep sections that are not must-keep strings
    (its facts stay: they rank below every must-keep section)."""
    kept = set(keep)
    return replace(
        state,
        constraints=tuple(e for e in state.constraints if e in kept),
        preferences=tuple(p for p in state.preferences if p.text in kept),
        decisions=tuple(e for e in state.decisions if e in kept),
        open_tasks=tuple(e for e in state.open_tasks if e in kept),
        pending=tuple(p for p in state.pending if p.text in kept),
        entities=tuple(e for e in state.entities if e in kept),
    )


def missing(text: str, must_keep: Sequence[str]) -> tuple[str, ...]:
    """The must-keep strings `text` does not hold verbatim, in order, each once."""
    return tuple(s for s in dict.fromkeys(must_keep) if s and s not in text)


def _tokens(item: Item, counter: TokenCounter) -> int:
    """Uncached: candidates that do not fit must not fill the shared count cache."""
    if item.api == "chat":
        return counter.chat_message(item.raw)
    return counter.responses_item(item.raw)
