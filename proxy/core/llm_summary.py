"""What the summarizer model is asked, and what its answer may become (issue 10, item 1).

The model writes structured state, not prose: the user's standing constraints word for
word, decisions taken, verified tool facts with their values, current preferences (an
earlier one only as "changed from"), open tasks and pending side-effecting calls,
entities. Its JSON answer is read into the memory state of proxy/core/memory.py and
rendered by the same `render` as the deterministic digest, so both kinds of summary
read alike and the same state always gives the same bytes.

The model's words are not trusted (issue 20, item 1: a summarizer steered by a prompt
injection in a page it summarized). Each entry is checked against the chunk
(`Evidence`): a user rule or preference must be a verbatim span of a user message, a
verified fact must name a tool call of the chunk and give values its result holds, and
so on; what fails is kept only as the summarizer's notes, a section titled as the
model's own unverified words and not instructions, ranked below everything else. The
guard (`memory.guard`) then appends to its section, verbatim, every must-keep string
the model left out (the deterministic extractor's: ids, amounts, rules, preferences,
pending calls, decisions); a summary that cannot hold them all in its limit is not used.

Sizes are bounded in tokens: an answer over `ANSWER_SLACK` times what the call asked for
is not read (`answer_fits`), and the state kept (stored, sealed in a compaction) holds
only the model's entries its max_tokens rendering shows, beside the guard's (`_as_sent`).

An answer that is not JSON, not an object, nested past the parser's depth, or has a
field of the wrong type gives None: the caller keeps the deterministic digest. Pure: the
call itself is proxy/summarizer.py.

>>> messages = summary_messages(items, instructions=None)     # Chat Completions messages
>>> written = summary_from_answer(answer_text, items, counter, max_tokens=800)
>>> written.item if written is not None else deterministic_digest
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from proxy.core import memory
from proxy.core.compress import head_and_tail, json_container, output_text, tool_name
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
    unverified: tuple[str, ...] = ()  # what the chunk does not bear out: notes only


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
    return [(f"{name} {call_id}", arguments) for name, call_id, arguments in _each_call(item)]


def _each_call(item: Item) -> list[tuple[str, str, str]]:
    """(name, call id, arguments) of each call an item makes, both APIs."""
    raw = item.raw
    found = []
    for call in raw.get("tool_calls") or []:
        if isinstance(call, Mapping):
            function = call.get("function")
            if not isinstance(function, Mapping):
                function = {}
            found.append((str(function.get("name", "?")), str(call.get("id")), _text(function)))
    if not found:
        name = item.name or item.type or "call"
        found.append((name, ",".join(item.call_ids), _text(raw)))
    return found


def _text(raw: Mapping[str, Any]) -> str:
    value = raw.get("arguments", raw.get("input", ""))
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def parse_answer(text: str) -> JsonDict | None:
    """The answer's fields when it is the JSON object asked for, else None (nested past
    the parser's depth included)."""
    try:
        value = json.loads(_unfenced(text))
    except (ValueError, TypeError, RecursionError):
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


def answer_fits(answer: str, counter: TokenCounter, max_tokens: int) -> bool:
    """Whether an answer is at most max_tokens long: what the call asked the model for
    (with room for a tokenizer other than the summarizer's). Longer, the provider did
    not honour the limit, and the answer is not read; a cheap length check first keeps
    a huge answer from being tokenized at all."""
    allowed = max_tokens * ANSWER_SLACK
    return len(answer) <= allowed * CHARS_PER_TOKEN and counter.text(answer) <= allowed


# The counter may not be the summarizer model's tokenizer: an answer is refused only past
# twice the tokens it was asked for. No tokenizer averages CHARS_PER_TOKEN characters a
# token on JSON text, so a longer answer is over its limit without counting.
ANSWER_SLACK = 2
CHARS_PER_TOKEN = 16


def state_from_answer(
    fields: Mapping[str, list[Any]],
    items: Sequence[Item],
    previous: memory.MemoryState | None = None,
) -> memory.MemoryState | None:
    """The memory state the model's fields describe of `items` (which follow `previous`),
    each entry checked against them (`Evidence`): what they do not bear out goes to the
    summarizer's notes, never to the user's words or the verified facts. None when an
    entry lacks what it must hold."""
    evidence = Evidence.of(items, previous)
    notes: list[str] = []

    def checked(entries: list[Any], holds: Callable[[str], bool]) -> tuple[str, ...]:
        kept: list[str] = []
        for text in _texts(entries):
            (kept if holds(text) else notes).append(text)
        return tuple(kept)

    try:
        constraints = checked(fields["constraints"], evidence.from_user)
        preferences = []
        for entry in fields["preferences"]:
            preference = _preference(entry)
            if evidence.from_user(preference.text) and (
                not preference.changed_from or evidence.from_user(preference.changed_from)
            ):
                preferences.append(preference)
            else:
                notes.append(preference.rendered())
        decisions = checked(fields["decisions"], evidence.said)
        open_tasks = checked(fields["open_tasks"], evidence.said)
        pending = []
        for entry in fields["pending_calls"]:
            text = _call(entry, "arguments")
            call_id = evidence.open_call(entry)
            if call_id is None:
                notes.append(text)
            else:
                pending.append(memory.Pending(text, call_id))
        facts: list[str] = []
        for entry in fields["facts"]:
            text = _call(entry, "values", " -> ")
            (facts if evidence.result_holds(entry) else notes).append(text)
        entities = checked(fields["entities"], evidence.seen)
    except (KeyError, TypeError, ValueError):
        return None
    base = previous or memory.MemoryState()
    return memory.MemoryState(
        count=base.count + len(items),
        constraints=constraints,
        preferences=tuple(preferences),
        decisions=decisions,
        open_tasks=open_tasks,
        pending=tuple(dict.fromkeys(pending)),
        facts=tuple(dict.fromkeys(facts)),
        entities=entities,
        notes=tuple(dict.fromkeys(" ".join(n.split()) for n in notes)),
    )


@dataclass(frozen=True)
class Evidence:
    """What a summary of a chunk may claim, read from the chunk as the model was shown it
    (`transcript`: each item's head and tail) and from the summary it follows (its
    entries, never its notes). White space is collapsed everywhere, and a claim must be
    word-bounded ("9999" is not in "99990"):

    - a constraint or preference of the user: a span of a user message, or of an earlier
      summary's constraints, preferences or requests;
    - a decision or open task: a span of a message (anyone's words, a call's text
      included), or of an earlier summary's rules, requests, decisions, tasks or what
      it said the assistant said;
    - a pending call: names a call of the chunk without a result in it (or one pending
      in the earlier summary), and its argument values occur in that call's arguments;
    - a verified fact: names a tool whose result is in the chunk (or an earlier verified
      fact of that tool), and every value occurs in that result; a key occurs there too
      or is a short label (a word, no spaces);
    - an entity: occurs anywhere in the chunk or in the earlier summary."""

    user: str
    words: str
    everything: str
    results: Mapping[str, str]  # tool name (and "name call_id") -> its results
    calls: Mapping[str, tuple[str, str]]  # the same -> (call id, arguments) of open calls

    @classmethod
    def of(cls, items: Sequence[Item], previous: memory.MemoryState | None) -> Evidence:
        user: list[str] = []
        words: list[str] = []
        everything: list[str] = []
        results: dict[str, list[str]] = {}
        calls: dict[str, tuple[str, str]] = {}
        answered = {item.output_for for item in items if item.output_for is not None}
        by_id: dict[str, Item] = {}
        for item in items:
            by_id.update(dict.fromkeys(item.call_ids, item))  # an id may be reused later
            if item.kind == "tool_output":
                name = tool_name(item, by_id.get(item.output_for or ""))
                shown = _shown_result(item)
                for key in (name, f"{name} {item.output_for}"):
                    results.setdefault(key, []).append(shown)
                everything.append(shown)
                continue
            text = _collapsed(head_and_tail(item.text(), ITEM_CHARS))
            words.append(text)
            everything.append(text)
            if item.is_user_message:
                user.append(text)
            if item.kind == "tool_calls":
                for name, call_id, arguments in _each_call(item):
                    shown = _collapsed(head_and_tail(arguments, ITEM_CHARS))
                    everything.append(shown)
                    if call_id not in answered:
                        for key in (name, f"{name} {call_id}"):
                            calls[key] = (call_id, shown)
        earlier = previous or memory.MemoryState()
        theirs = [*earlier.constraints, *earlier.requests]
        theirs += [t for p in earlier.preferences for t in (p.text, p.changed_from) if t]
        said = [*theirs, *earlier.decisions, *earlier.open_tasks, *earlier.said, *earlier.earlier]
        user += theirs
        words += said
        everything += [*said, *earlier.facts, *earlier.entities]
        everything += [p.text for p in earlier.pending]
        for fact in earlier.facts:
            results.setdefault(_tool_of(fact), []).append(fact)
        for call in earlier.pending:
            if call.call_id not in answered:
                calls.setdefault(_tool_of(call.text), (call.call_id, call.text))
        return cls(
            "\n".join(user),
            "\n".join(words),
            "\n".join(everything),
            {name: "\n".join(shown) for name, shown in results.items()},
            calls,
        )

    def from_user(self, text: str) -> bool:
        return _occurs(text, self.user)

    def said(self, text: str) -> bool:
        return _occurs(text, self.words)

    def seen(self, text: str) -> bool:
        return _occurs(text, self.everything)

    def result_holds(self, entry: Mapping[str, Any]) -> bool:
        """Whether a fact names a tool whose result holds every value it gives."""
        result = self.results.get(str(entry.get("tool", "")).strip())
        return result is not None and _holds(entry.get("values"), result)

    def open_call(self, entry: Mapping[str, Any]) -> str | None:
        """The id of the open call a pending entry names (of one pending earlier: the id
        it kept, if any), when its arguments hold what the entry gives; else None."""
        found = self.calls.get(str(entry.get("tool", "")).strip())
        if found is None or not _holds(entry.get("arguments"), found[1]):
            return None
        return found[0]


def _shown_result(item: Item) -> str:
    """A result as the transcript shows it, and, when it is a JSON text short enough to
    be shown whole, its values unescaped (a model copies "café", not "caf\\u00e9")."""
    text = output_text(item)
    shown = _collapsed(head_and_tail(text, ITEM_CHARS))
    if len(text) <= ITEM_CHARS and (parsed := json_container(text)) is not None:
        shown += "\n" + _collapsed(json.dumps(parsed, ensure_ascii=False))
    return shown


def _holds(values: Any, text: str) -> bool:
    """Whether every value (and key: a short label, or found too) occurs in `text`."""
    if values is None:
        return True
    if not isinstance(values, Mapping):
        return _occurs(_collapsed(_value(values)), text)
    return all(
        (LABEL.fullmatch(str(key)) is not None or _occurs(_collapsed(str(key)), text))
        and _occurs(_collapsed(_value(value)), text)
        for key, value in values.items()
    )


LABEL = re.compile(r"[A-Za-z_][\w.-]{0,31}")


def _tool_of(text: str) -> str:
    """The tool an earlier fact ("name(arguments) -> values", "name -> values") or
    pending call ("name(arguments)") names."""
    return re.split(r"\(| -> ", text, maxsplit=1)[0].strip()


def _collapsed(text: str) -> str:
    return " ".join(text.split())


def _occurs(needle: str, text: str) -> bool:
    """Whether `needle` is a span of `text` that starts and ends at word boundaries.
    Bounded: after CANDIDATES places where it occurs inside a word, it does not."""
    if not needle:
        return False
    first, last = _is_word(needle[0]), _is_word(needle[-1])
    at = text.find(needle)
    for _ in range(CANDIDATES):
        if at < 0:
            return False
        end = at + len(needle)
        if not (first and at and _is_word(text[at - 1])) and not (
            last and end < len(text) and _is_word(text[end])
        ):
            return True
        at = text.find(needle, at + 1)
    return False


CANDIDATES = 1_000


def _is_word(char: str) -> bool:
    return char.isalnum() or char == "_"


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
    state = state_from_answer(fields, items, earlier)
    if state is None:
        return None
    reference = memory.extract(items, earlier)
    keep = reference.must_keep()
    appended = missing(memory.render(replace(state, notes=()), counter, WHOLE), keep)
    # The model's own entries rank with the must-keep ones when rendered; when they
    # crowd a must-keep string out of the limit, the ones that are not must-keep go.
    for candidate in (state, _only_kept(state, keep)):
        guarded = memory.guard(candidate, reference)
        item = memory.fit_summary(items[0].api, guarded, counter, max_tokens)
        if _tokens(item, counter) <= max_tokens and not missing(item.text(), keep):
            sent = _as_sent(candidate, guarded, item.text())
            return Written(item, json.loads(memory.to_json(sent)), appended, state.notes)
    return None


def _as_sent(
    candidate: memory.MemoryState, guarded: memory.MemoryState, text: str
) -> memory.MemoryState:
    """`guarded` without the model's entries its rendering `text` left out: what is kept
    (stored, sealed in a compaction) is at most the summary's max_tokens of the model's
    words plus the deterministic entries the guard added (bounded by the extractor),
    whatever the model answered. It renders to the same text: an entry left out of a
    rendering takes no room from the others."""
    lines = set(text.splitlines())
    cut: dict[str, Any] = {}
    for section in memory.SECTIONS:
        written = len(getattr(candidate, section.name))
        entries = getattr(guarded, section.name)
        shown = section.entries(guarded)
        cut[section.name] = tuple(
            entry
            for index, (entry, rendered) in enumerate(zip(entries, shown, strict=True))
            if index >= written or f"- {rendered}" in lines
        )
    return replace(guarded, **cut)


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
