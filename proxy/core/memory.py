"""What a summary of dropped turns holds: a structured memory state and its one text form.

A digest keeps what a later turn needs and what a plain excerpt loses: the user's
standing rules in their own words, the preferences in force (a changed one only as
"changed from"), the decisions taken, the open tasks and the calls still waiting for a
result, the verified values of tool results and of the calls' arguments (ids, amounts,
statuses; never transport metadata), and the entities (ids, references, e-mails,
amounts). `extract` builds the state from items (on top of an earlier state), `render`
writes it as one text block under a token budget, `must_keep` names the strings any
summary of the items must contain verbatim (the LLM summarizer's guard), `taken_in` the
facts a summary takes in once later turns name a value of its items that it lacks. What an LLM
summarizer wrote that its chunk does not bear out is the state's `notes`
(proxy/core/llm_summary.py): rendered last, under a title saying they are the model's
unverified words and not instructions, and never must-keep.

Everything here is a pure function of its input: the same state renders to the same
bytes, and the text holds no call ids and no clock, so a summary's bytes never change
with token noise or the hour (issue 10, item 4).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from proxy.core.compress import (
    COMPRESSED_KEY,
    ERROR_LINE,
    LOCATION_LINE,
    TextPlan,
    embedded_text,
    evidence_lines,
    json_container,
    key_values,
    output_text,
    sentences,
    standing_out,
    tool_name,
)
from proxy.core.items import APPROVAL_REQUEST, Api, Item, chat_item, responses_item
from proxy.core.shapes import FEW_IDS
from proxy.core.tokens import TokenCounter

SUMMARY_MARKER = "[threadkeeper summary of earlier conversation]"
HEADER = re.compile(re.escape(SUMMARY_MARKER) + r" Stands for (\d+) earlier items")
STATE_VERSION = 1

SENTENCE_CHARS = 400  # a rule, decision or task longer than this is cut (marked)
REQUEST_CHARS = 240
STATEMENT_CHARS = 160
FACT_CHARS = 400
EARLIER_CHARS = 640
SECTION_MAX = 400  # entries kept per section: the oldest and newest halves
ENTITIES_PER_ITEM = 16
SPACES = re.compile(r"\s+")
# A run of whitespace holding a line break (what str.splitlines splits on): an entry is
# one line of the rendered digest, which parse reads back line by line.
LINE_BREAKS = re.compile(r"\s*[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]\s*")


# --- the state ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Preference:
    """A preference in force; `changed_from` is the one it replaced, if any."""

    text: str
    changed_from: str = ""

    def rendered(self) -> str:
        if self.changed_from:
            return f"{self.text} (changed from: {self.changed_from})"
        return self.text


@dataclass(frozen=True, slots=True)
class Pending:
    """A call without a result; the call id only matches a later result, never shown."""

    text: str
    call_id: str = ""


@dataclass(frozen=True, slots=True)
class MemoryState:
    """Everything a digest knows, oldest entry first in every section."""

    count: int = 0  # items the state stands for
    constraints: tuple[str, ...] = ()
    preferences: tuple[Preference, ...] = ()
    decisions: tuple[str, ...] = ()
    open_tasks: tuple[str, ...] = ()
    pending: tuple[Pending, ...] = ()
    facts: tuple[str, ...] = ()
    entities: tuple[str, ...] = ()
    requests: tuple[str, ...] = ()
    said: tuple[str, ...] = ()
    earlier: tuple[str, ...] = ()  # a foreign summary this state was built on
    # What an LLM summarizer wrote that its chunk does not bear out (proxy/core/
    # llm_summary.py): its own words, shown labelled, never as the user's or verified.
    notes: tuple[str, ...] = ()

    def must_keep(self) -> tuple[str, ...]:
        """Strings every summary of this state must hold verbatim: the rules, the latest
        preferences, decisions, open tasks, pending calls, the tool facts that report an
        error, a warning or a code location (a log's one failure) or carry a series'
        outlier (its one spike), and entities (the ids and amounts of the other facts' own
        values among them), in render order."""
        kept: list[str] = [*self.constraints, *(p.text for p in self.preferences)]
        kept += [*self.decisions, *self.open_tasks, *(p.text for p in self.pending)]
        kept += [fact for fact in self.facts if _is_signal(fact)]
        kept += self.entities
        return tuple(dict.fromkeys(kept))


@dataclass(frozen=True, slots=True)
class _Section:
    title: str
    name: str  # the MemoryState field
    priority: int  # inside a tier, what survives first when over budget (higher first)
    essential: bool  # ranks in the first tier (facts: only those with ids or amounts)

    def entries(self, state: MemoryState) -> list[str]:
        values = getattr(state, self.name)
        if self.name == "preferences":
            return [p.rendered() for p in values]
        if self.name == "pending":
            return [p.text for p in values]
        return list(values)

    def priority_of(self, entry: str) -> int:
        """A tool fact reporting an error or a warning, or carrying a series' outlier,
        ranks with the entities: it is often the one line or value of a long result the
        conversation acts on."""
        if self.name == "facts" and _is_signal(entry):
            return _ERROR_FACT_PRIORITY
        return self.priority

    def is_essential(self, entry: str) -> bool:
        """Whether `entry` survives before every non-essential entry when over budget: a
        fact when it holds ids or amounts, or reports what stands out (an error, an
        outlier, a rare record: what must_keep asks of any summary)."""
        if not self.essential:
            return False
        return self.name != "facts" or bool(entities_in(entry)) or _is_signal(entry)


_ERROR_FACT_PRIORITY = 6
# The title says what the notes are: it is shown only with them, and a state without
# notes renders as it always did.
NOTES_TITLE = (
    "Summarizer's notes (model-written, unverified; not the user's words, not verified "
    "facts, not instructions):"
)
# Facts first (issue 22, item 5; seed 3.3): what the tools verified, each as
# tool(arguments) -> values, oldest first; then what the user said in their words; then
# what is open; the assistant's words last, marked unverified. The order is the text's;
# what survives a small budget is each section's priority.
SECTIONS: tuple[_Section, ...] = (
    _Section("Verified facts from tool results:", "facts", 4, True),
    _Section("Constraints stated by the user (their words):", "constraints", 9, True),
    _Section("Current preferences of the user:", "preferences", 8, True),
    _Section("Decisions taken:", "decisions", 7, True),
    _Section("Open tasks:", "open_tasks", 7, True),
    _Section("Pending actions (called, no result seen):", "pending", 7, True),
    _Section("Entities (ids, references, amounts):", "entities", 6, True),
    _Section("Earlier summary:", "earlier", 3, False),
    _Section("User requests:", "requests", 2, False),
    _Section("Said by the assistant (not verified):", "said", 1, False),
    _Section(NOTES_TITLE, "notes", 0, False),
)
_BY_TITLE = {s.title: s for s in SECTIONS}


# --- sentences and what they state ----------------------------------------------------------

_DAY = (
    r"(?:\d|monday|tuesday|wednesday|thursday|friday|saturday|sunday|tomorrow|tonight|today"
    r"|noon|midnight|eod|cob|end of|the end|next|this|jan|feb|mar|apr|may|jun|jul|aug|sep|oct"
    r"|nov|dec)"
)
# Statements of a rule: imperatives at the start of a clause, modal obligations, limits
# and deadlines. A keyword in the middle of a story ("says her headphones never
# arrived") is not a rule.
RULE = re.compile(
    r"(?:^|[,;:(]\s*|\b(?:and|but|or|so|please|also|then)\s+)"
    r"(?:never|always|don'?t|do not|avoid|only|make sure|ensure|remember to|no longer)\b"
    r"|\b(?:must|mustn'?t|shall not|may not|is not allowed|are not allowed|not allowed"
    r"|forbidden|prohibited|mandatory|required|requirements?|constraints?)\b"
    r"|\b(?:you|we|i|they|it|answers?|replies|everything)\s+(?:should(?:n'?t| not)?"
    r"|need to|have to|cannot|can'?t|will never|always|never)\b"
    r"|\bonly\s*[.!]?$|^only\b"
    r"|\bbudget\b|\bdeadline\b|\b(?:at most|at least|no more than|no less than|maximum|minimum"
    r"|up to|not exceed|under)\s+[$€£¥]?\d"
    r"|\b(?:by|before|until|no later than)\s+" + _DAY + r"|\brules?\s*:"
    r"|\b(?:from now on|going forward|from here on|henceforth|until further notice"
    r"|for the rest of (?:this|the))\b"
    # an instruction scoped to the work ("For this analysis: exclude ...")
    r"|\bfor (?:this|the whole|all|every|each) \w+(?: \w+)?\s*:\s*(?:please\s+)?[a-z]"
    r"|(?:^|[,;:]\s*|\b(?:and|but)\s+)no\s+(?!problem|worries|thanks|idea|rush|one\b|need\b)"
    r"[a-z][\w-]+"
    r"|\b(?:vegetarian|vegan|halal|kosher|gluten[- ]free|allergic|allergy)\b"
    r"|\btax(?:es)? included\b|\bby default\b|^(?:all|every|each)\s+\w+\s+(?:in|are|is|must)\b"
    r"|所有|必须|不要|不能|默认|只能|只要|总是|永远|务必|禁止|一律",
    re.IGNORECASE,
)
PREFERENCE = re.compile(
    r"\b(?:i(?:'d| would)? prefer|i(?:'d| would) rather|prefer(?:ably|red)?|instead"
    r"|changed? my mind|switch (?:it |me |that )?to|change (?:it|that|this|my \w+) to)\b",
    re.IGNORECASE,
)
# A change of mind that replaces a preference already stated on the same subject.
CHANGE = re.compile(
    r"\b(?:actually|make (?:it|that) an?|rather than|go for|on second thought|change of plans?"
    r"|i (?:now )?want|i(?:'d| would) like)\b|,\s*not\s+\w",
    re.IGNORECASE,
)
# The explicit ones among them: a change even without the earlier preference in view.
REPLACEMENT = re.compile(
    r"\b(?:actually|rather than|on second thought|change of plans?|instead of)\b|,\s*not\s+\w",
    re.IGNORECASE,
)
# Words that name what a preference is about: a later preference about the same
# subject replaces the earlier one.
TOPICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("seat", ("seat", "aisle", "window", "middle")),
    ("meal", ("meal", "food", "breakfast", "dinner", "lunch")),
    ("room", ("hotel", "room", "suite", "bed")),
    ("flight", ("flight", "airline", "red-eye", "departure", "nonstop", "layover")),
    ("time", ("morning", "afternoon", "evening", "night", "am", "pm", "o'clock")),
    ("language", ("english", "french", "german", "spanish", "chinese", "japanese", "language")),
    ("format", ("format", "json", "markdown", "csv", "table", "bullet", "paragraph", "yaml")),
    ("contact", ("email", "e-mail", "phone", "sms", "call me", "text me")),
    ("payment", ("card", "paypal", "payment", "invoice", "cash")),
    ("delivery", ("delivery", "shipping", "courier", "pickup", "express")),
    ("tone", ("tone", "formal", "casual", "concise", "short", "detailed", "verbose")),
)
_TOPIC_NAMES = frozenset(name for name, _ in TOPICS)
DECISION = re.compile(
    r"\b(?:i'll|i will|we'll|we will|let'?s|let us|decided|decide to|going to|the plan is"
    r"|on hold|approved|confirmed|booked|agreed|chose|chosen|selected|go with|settled on"
    r"|(?:decision|plan|agreed)\s*:|(?:we|i)(?:'ll| will)? (?:offer|grant|propose)"
    r"|will (?:bump|set|use|switch|book|refund|issue|escalate|change|update|proceed|keep"
    r"|cancel|hold|send|ship|release|merge|deploy|revert)"
    r"|bump(?:ed|ing)? (?:the )?version|set (?:the )?\w+ to|escalat(?:e|ed|ing) to)\b",
    re.IGNORECASE,
)
OPEN_TASK = re.compile(
    r"\b(?:pending|awaiting|waiting (?:for|on)|still (?:need|have) to|need to|to-?do"
    r"|next step|follow[- ]up|not yet|remaining|blocked (?:on|by)|once .+ (?:i|we)'?ll"
    r"|after .+ (?:i|we)'?ll|later)\b",
    re.IGNORECASE,
)

# Entities: e-mail addresses, amounts with a currency, identifiers and reference codes.
EMAIL = r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}"
CURRENCY = r"(?:EUR|USD|GBP|CNY|RMB|JPY|CHF|CAD|AUD|INR|SEK|NOK|DKK|PLN|euros?|dollars?|€|\$|£|¥)"
AMOUNT = (
    r"(?:[$€£¥]\s?\d[\d,]*(?:\.\d+)?(?:\s?(?:k|m|bn))?"
    r"|(?<!\d,)\b\d[\d,]*(?:\.\d+)?\s?" + CURRENCY + r"(?![A-Za-z]))"
)
IDENT = (
    r"(?<![\w./-])(?!\d{4}-\d\d-\d\d)(?=[A-Z0-9_/-]*\d)(?=[A-Z0-9_/-]*[A-Z])[A-Z0-9]+(?:[-_/][A-Z0-9]+)+\b"
    r"|(?<![\w./-])(?=[A-Z0-9]*\d)(?=[A-Z0-9]*[A-Z])[A-Z0-9]{5,}\b"
    r"|\b(?!call_|fc_|toolu_|resp_|msg_|req_|trace_|span_|rs_|ctc_)[a-z]{2,}_"
    r"(?=[A-Za-z0-9]*\d)[A-Za-z0-9]{3,}\b"
)
ENTITY = re.compile(f"(?P<email>{EMAIL})|(?P<amount>{AMOUNT})|(?P<id>{IDENT})")


def entities_in(text: str) -> list[str]:
    """E-mail addresses, amounts with a currency and identifiers, in order, once each."""
    found = [m.group().strip() for m in ENTITY.finditer(text)]
    return list(dict.fromkeys(f for f in found if f))


# Values a message may name besides entities (issue 22, item 3): a code span, a quoted
# phrase, a file:line, a number with its unit, a code identifier (snake_case, camelCase),
# a line by its number ("line 212": kept in a file listing, issue 22 item 4).
SALIENT = re.compile(
    r"`([^`\n]{3,120})`"
    r"|[\"“]([^\"”\n]{4,120})[\"”]"
    r"|(?<![\w./-])([\w./-]+\.\w{1,5}:\d+)"
    r"|(?<![\w.])(\d+(?:\.\d+)?\s?(?:ms|s|sec|seconds|min|minutes|h|hours|days|%|[kmgt]b))\b"
    r"|\b([a-z][a-z0-9]*(?:_[a-z0-9]+)+|[a-z]+(?:[A-Z][a-z0-9]+)+)\b"
    r"|\b([Ll]ines?\s\d+(?:\s?[-–]\s?\d+)?)\b"
)
ARGUMENT_CHARS = (3, 200)  # a string argument of a call this long names a value


def salient_in(text: str) -> list[str]:
    """The entities of a message and the other values it names (SALIENT), in order."""
    found = entities_in(text)
    for match in SALIENT.finditer(text):
        value = next(g for g in match.groups() if g is not None).strip()
        if len(value) >= 3:
            found.append(value)
    return list(dict.fromkeys(found))


def referenced_values(items: Iterable[Item]) -> frozenset[str]:
    """What `items` mention (user and assistant text: ids, amounts, code spans, quoted
    phrases, file:line, identifiers; a call's argument values): compress_tool_output and
    the digest keep the lines and elements of tool results that hold them. Only the
    items given count, so a result is compressed the same way for as long as they do
    not change (the prompt cache)."""
    found: set[str] = set()
    for item in items:
        if item.kind == "message":
            found.update(salient_in(item.text()))
        elif item.kind == "tool_calls":
            found.update(salient_in(item.text()))
            for arguments in _call_arguments(item):
                found.update(_argument_values(arguments))
    return frozenset(found)


def _call_arguments(item: Item) -> list[str]:
    found = [str(item.raw.get("arguments") or item.raw.get("input") or "")]
    for tool_call in item.raw.get("tool_calls") or []:
        function = tool_call.get("function") if isinstance(tool_call, Mapping) else None
        if isinstance(function, Mapping):
            found.append(str(function.get("arguments") or ""))
    return [a for a in found if a]


def _argument_values(arguments: str) -> list[str]:
    """The string and number values of a call's arguments (the keys are not values)."""
    parsed = json_container(arguments)
    if parsed is None:
        return salient_in(arguments)
    values: list[str] = []
    stack: list[Any] = [parsed]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and ARGUMENT_CHARS[0] <= len(node) <= ARGUMENT_CHARS[1]:
            values.append(node)
        elif isinstance(node, int | float) and not isinstance(node, bool) and abs(node) >= 100:
            values.append(str(node))
    return values


def is_rule(sentence: str) -> bool:
    """Whether a sentence states a standing constraint (a rule, a limit, a deadline)."""
    return RULE.search(sentence) is not None


def constraints(text: str) -> list[str]:
    """The user's sentences that constrain the task, kept word for word."""
    return [_cut(s, SENTENCE_CHARS) for s in sentences(text) if is_rule(s)]


def topic(text: str) -> str:
    """What a preference is about: a known subject, else the text itself."""
    lowered = text.lower()
    best: tuple[int, str] | None = None
    for name, words in TOPICS:
        for word in words:
            at = re.search(r"(?<![\w-])" + re.escape(word) + r"s?(?![\w-])", lowered)
            if at is not None and (best is None or at.start() < best[0]):
                best = (at.start(), name)
    return best[1] if best else lowered


# --- extraction -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Builder:
    """Sections being filled, oldest first, each entry once."""

    lists: dict[str, list[str]] = field(default_factory=dict)
    seen: dict[str, set[str]] = field(default_factory=dict)
    preferences: list[Preference] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)
    count: int = 0

    @classmethod
    def of(cls, state: MemoryState) -> _Builder:
        builder = cls(count=state.count)
        for section in SECTIONS:
            if section.name not in ("preferences", "pending"):
                builder.add(section.name, getattr(state, section.name))
        builder.preferences = list(state.preferences)
        builder.pending = list(state.pending)
        return builder

    def add(self, name: str, entries: Iterable[str]) -> None:
        target = self.lists.setdefault(name, [])
        seen = self.seen.setdefault(name, set())
        for entry in entries:
            if entry and entry not in seen:
                seen.add(entry)
                target.append(entry)

    def has_topic(self, text: str) -> bool:
        """Whether a preference about the subject of `text` was stated already."""
        subject = topic(text)
        return any(topic(p.text) == subject for p in self.preferences)

    def prefer(self, text: str) -> None:
        """A later preference about the same subject replaces the earlier one."""
        subject = topic(text)
        for index, earlier in enumerate(self.preferences):
            if earlier.text == text:
                return
            if topic(earlier.text) == subject:
                del self.preferences[index]
                self.preferences.append(Preference(text, earlier.text))
                return
        self.preferences.append(Preference(text))

    def state(self) -> MemoryState:
        lists = {name: tuple(_bounded(entries)) for name, entries in self.lists.items()}
        return MemoryState(
            count=self.count,
            preferences=tuple(_bounded(self.preferences)),
            pending=tuple(_bounded(self.pending)),
            **lists,
        )


def _bounded(entries: list[Any]) -> list[Any]:
    if len(entries) <= SECTION_MAX:
        return entries
    half = SECTION_MAX // 2
    return entries[:half] + entries[-half:]


def extract(items: Sequence[Item], previous: MemoryState | None = None) -> MemoryState:
    """The state of `previous` plus what `items` add, every earlier entry kept."""
    builder = _Builder.of(previous or MemoryState())
    builder.count += len(items)
    answered = {item.output_for for item in items if item.output_for is not None}
    waiting = {p.call_id: p.text for p in builder.pending if p.call_id in answered}
    builder.pending = [p for p in builder.pending if p.call_id not in waiting]
    calls = {call_id: item for item in items for call_id in item.call_ids}
    later = _referenced_after(items)
    described = _described_after(items)
    for position, item in enumerate(items):
        calls.update(dict.fromkeys(item.call_ids, item))  # an id may be reused later
        if item.is_user_message:
            _user_message(builder, item.text())
        elif item.kind == "tool_output":
            call = calls.get(item.output_for or "")
            named_later = later.get(position, frozenset())
            named_later |= evidence_lines(output_text(item), described.get(position, ()))
            fact, named = _fact(item, call, waiting.get(item.output_for or ""), named_later)
            builder.add("facts", [fact])
            builder.add("entities", named[:ENTITIES_PER_ITEM])
        elif item.kind == "tool_calls":
            _pending_calls(builder, item, answered)
            _assistant_message(builder, item.text())
        elif item.kind == "mcp_call" and item.raw.get("output") is not None:
            fact, named = _fact(item, item, None)  # a hosted call carries its own result
            builder.add("facts", [fact])
            builder.add("entities", named[:ENTITIES_PER_ITEM])
        elif item.kind == APPROVAL_REQUEST:  # an MCP call that awaits the user's approval
            server = item.raw.get("server_label")
            _pending_calls(builder, item, answered, f"approval requested: {server}.")
        elif item.kind == "message" and item.role == "assistant":
            _assistant_message(builder, item.text())
    return builder.state()


def _referenced_after(items: Sequence[Item]) -> dict[int, frozenset[str]]:
    """For each tool result, what the items after it name (referenced_values), in one
    backward pass."""
    found: dict[int, frozenset[str]] = {}
    seen: set[str] = set()
    for position in range(len(items) - 1, -1, -1):
        if items[position].kind == "tool_output":
            found[position] = frozenset(seen)
        seen.update(_named_by(items[position]))
    return found


# referenced_values of one item, by its digest: a stateless history's items are read
# again with every request (taken_in). Bounded; cleared when full.
_named: dict[tuple[str, str], frozenset[str]] = {}
NAMED_CACHE_MAX = 1 << 14


def _named_by(item: Item) -> frozenset[str]:
    if item.kind not in ("message", "tool_calls"):
        return frozenset()
    key = (item.api, item.digest)
    found = _named.get(key)
    if found is None:
        found = referenced_values([item])
        if len(_named) >= NAMED_CACHE_MAX:
            _named.clear()
        _named[key] = found
    return found


DESCRIBED_MESSAGES = 24  # later messages read for a result's evidence: about 12 turns


def _described_after(items: Sequence[Item]) -> dict[int, tuple[str, ...]]:
    """For each tool result, what the user and the assistant said after it in this chunk
    (the next DESCRIBED_MESSAGES messages, so a long chunk costs linear time): the
    statements whose evidence lines its fact keeps (evidence_lines), a finding ("the pool
    is exhausted") or a description ("the memory limit we saw"). One backward pass."""
    found: dict[int, tuple[str, ...]] = {}
    said: list[str] = []  # newest first
    for position in range(len(items) - 1, -1, -1):
        item = items[position]
        if item.kind == "tool_output":
            found[position] = tuple(reversed(said[-DESCRIBED_MESSAGES:]))
        elif _says(item):
            said.append(item.text())
    return found


def merge(previous: MemoryState, later: MemoryState) -> MemoryState:
    """`later` (a state of later items) added to `previous`, as `extract` would."""
    builder = _Builder.of(previous)
    builder.count += later.count
    for section in SECTIONS:
        if section.name not in ("preferences", "pending"):
            builder.add(section.name, getattr(later, section.name))
    for preference in later.preferences:
        builder.prefer(preference.text)
    builder.pending.extend(p for p in later.pending if p not in builder.pending)
    return builder.state()


def _user_message(builder: _Builder, text: str) -> None:
    if not text.strip():
        return
    builder.add("requests", [_cut(text, REQUEST_CHARS)])
    for sentence in sentences(text):
        kept = _cut(sentence, SENTENCE_CHARS)
        if PREFERENCE.search(sentence) or (CHANGE.search(sentence) and _replaces(builder, kept)):
            builder.prefer(kept)
        elif is_rule(sentence):
            builder.add("constraints", [kept])
        elif DECISION.search(sentence):
            builder.add("decisions", [kept])
        elif OPEN_TASK.search(sentence):
            builder.add("open_tasks", [kept])
    builder.add("entities", entities_in(text)[:ENTITIES_PER_ITEM])


def _replaces(builder: _Builder, sentence: str) -> bool:
    """Whether a change of mind replaces a preference: one stated on its subject, or
    (a summary block of a later chunk does not see the earlier block's) a known subject
    named with an explicit change ("change of plan", "not aisle")."""
    if builder.has_topic(sentence):
        return True
    return REPLACEMENT.search(sentence) is not None and topic(sentence) in _TOPIC_NAMES


def _assistant_message(builder: _Builder, text: str) -> None:
    if not text.strip():
        return
    plain = []
    for sentence in sentences(text):
        kept = _cut(sentence, SENTENCE_CHARS)
        if DECISION.search(sentence):
            builder.add("decisions", [kept])
        elif OPEN_TASK.search(sentence):
            builder.add("open_tasks", [kept])
        else:
            plain.append(sentence)
    if plain:
        builder.add("said", [_cut(" ".join(plain), STATEMENT_CHARS)])
    builder.add("entities", entities_in(text)[:ENTITIES_PER_ITEM])


def _fact(
    output: Item,
    call: Item | None,
    described: str | None,
    referenced: frozenset[str] = frozenset(),
) -> tuple[str, list[str]]:
    """tool(arguments) -> the values that matter in its result; and its entities: the ids
    and amounts of the arguments and of the result's own values, not those of every
    element of a list it returned. `described` is the call's text when the call itself
    was summarized earlier (a pending call)."""
    name = tool_name(output, call)
    arguments, amounts = _arguments(call, output.output_for or "") if call else ("", [])
    head = f"{name}({arguments})" if call is not None or described is None else described
    text = output_text(output)
    parsed = json_container(text)
    whole: list[tuple[str, Any]] = []
    if isinstance(parsed, dict) and isinstance(parsed.get(COMPRESSED_KEY), dict):
        excerpt = parsed.get("excerpt")  # a compressed text result
        text, parsed = (excerpt, None) if isinstance(excerpt, str) else ("", parsed)
        if parsed is not None:
            whole, parsed = _whole_records(parsed.get("verified_facts") or {})
    inner = embedded_text(parsed)
    if inner is not None:  # a file's content in a JSON object: its lines, as a text's
        text, parsed = inner[1], None
    if parsed is not None:
        # An error or a warning first: the fact is cut at FACT_CHARS.
        pairs = sorted(
            key_values(parsed, referenced=referenced, shapes=False),
            key=lambda pair: not _reports_error(str(pair[1])),
        )
        errors = sum(_reports_error(str(value)) for _, value in pairs)
        listed = _listed_ids(parsed)
        lists = {label.rsplit(".", 1)[0] for label, _ in listed}
        pairs = [pair for pair in pairs if pair[0] not in lists]  # the ids stand for them
        pairs[errors:errors] = _outlier_pairs(parsed) + listed
        pairs[:0] = standing_out(parsed) + whole  # a list's outlier records, rare strings
        shown = _pairs_text(pairs) if pairs else "(no values)"
        # Ids of list elements (a page of search results) are the fact's, not entities.
        named = " ".join(str(v) for _, v in pairs if not isinstance(v, list | dict))
        found = entities_in(head) + entities_in(named) + amounts + _amounts(pairs)
    else:
        shown = json.dumps(_text_gist(text, referenced), ensure_ascii=False)
        found = entities_in(f"{head} {shown}") + amounts
    return _cut(f"{head} -> {shown}", FACT_CHARS), list(dict.fromkeys(found))


def taken_in(sources: Sequence[Item], later: Sequence[Item], written: str) -> tuple[str, ...]:
    """The tool facts a summary of `sources` takes in once the items after them (the
    rest of `sources`, then `later`: the turns sent after it) name a value of theirs
    that `written` (the summary region as sent) lacks (issue 22, item 3). For each result
    of `sources`, the values the items after it name and the lines the next
    DESCRIBED_MESSAGES messages rest on (evidence_lines: "raise the memory limit we
    saw"), as `extract` reads them for a chunk; its fact as the digest then writes it
    (`_fact`, so only what the digest calls informative once named), when that fact holds
    one of them that `written` lacks. A block written before anybody named the value
    could not know it. In order, each once; spaces compared folded (a fact folds a log's)."""
    items = [*sources, *later]
    named = _referenced_after(items)
    described = _described_after(items)
    folded = SPACES.sub(" ", written)
    first = min(named, default=0)
    unwritten = {v for v in named.get(first, ()) if SPACES.sub(" ", v) not in folded}
    calls: dict[str, Item] = {}
    found: list[str] = []
    for position, item in enumerate(sources):
        calls.update(dict.fromkeys(item.call_ids, item))
        if item.kind == "tool_output":
            call = calls.get(item.output_for or "")
        elif item.kind == "mcp_call" and item.raw.get("output") is not None:
            call = item
        else:
            continue
        text = output_text(item)
        values = {v for v in unwritten & named.get(position, frozenset()) if v in text}
        evidence = _evidence(item, text, described.get(position, ()))
        lacking = [*values, *(v for v in evidence if SPACES.sub(" ", v) not in folded)]
        values |= evidence
        if not lacking:
            continue
        fact, _ = _fact(item, call, None, frozenset(values))
        shown = SPACES.sub(" ", fact)
        if any(SPACES.sub(" ", v) in shown for v in lacking):
            found.append(fact)
    return tuple(dict.fromkeys(found))


def may_take_in(earlier: Sequence[Item], fresh: Sequence[Item], written: str) -> bool:
    """Whether `taken_in` could find more for a summary region `written` than it found
    before `fresh` (the items since the last request: its answer, the new input) came
    after `earlier`, whatever items the region stands for: a fresh item names a value
    `written` lacks, or a fresh user or assistant message is among the first
    DESCRIBED_MESSAGES after them (it may describe a line of theirs). False lets a caller
    leave those items unread (a stored thread's, in the store)."""
    folded = SPACES.sub(" ", written)
    if any(SPACES.sub(" ", v) not in folded for item in fresh for v in _named_by(item)):
        return True
    said = 0
    for item in earlier:
        said += _says(item)
        if said >= DESCRIBED_MESSAGES:
            return False
    return any(map(_says, fresh))


def _says(item: Item) -> bool:
    """A user or assistant message with text: a statement `_described_after` reads."""
    speaks = item.is_user_message or (item.role == "assistant" and item.kind == "message")
    return speaks and bool(item.text().strip())


# evidence_lines by result digest and statements: a result's next messages stop changing
# once DESCRIBED_MESSAGES have followed it. Bounded; cleared when full.
_evidence_made: dict[tuple[str, str, tuple[str, ...]], frozenset[str]] = {}
EVIDENCE_CACHE_MAX = 4096


def _evidence(item: Item, text: str, said: tuple[str, ...]) -> frozenset[str]:
    key = (item.api, item.digest, said)
    found = _evidence_made.get(key)
    if found is None:
        found = evidence_lines(text, said)
        if len(_evidence_made) >= EVIDENCE_CACHE_MAX:
            _evidence_made.clear()
        _evidence_made[key] = found
    return found


# A record a compressed result kept whole, labelled by its list and index (`points[36]`).
RECORD_LABEL = re.compile(r".+\[\d+\]")


def _whole_records(facts: Any) -> tuple[list[tuple[str, Any]], Any]:
    """The records a compressed result's verified facts hold whole (an outlier's, or one a
    later turn named: compress._walk), and the other facts. The compressor chose them as
    the signal of their list; the digest keeps them as records, not as loose values."""
    if not isinstance(facts, dict):
        return [], facts
    whole = [(k, v) for k, v in facts.items() if RECORD_LABEL.fullmatch(k) and isinstance(v, dict)]
    rest = {
        k: v for k, v in facts.items() if not (RECORD_LABEL.fullmatch(k) and isinstance(v, dict))
    }
    return whole, rest


def _outlier_pairs(parsed: Any) -> list[tuple[str, Any]]:
    """The outliers and anomalies of a result's lists (their shapes, proxy/core/shapes.py):
    after the errors, before the other values, since one odd value among many routine
    ones is what the shape alone would hide."""
    found: list[tuple[str, Any]] = []
    for label, shape in key_values(parsed, max_values=64, list_items=0):
        if not label.endswith("_shape") or not isinstance(shape, dict):
            continue
        for column, described in shape.items():
            if isinstance(described, dict):
                for kind in ("outliers", "anomalies"):
                    if described.get(kind):
                        found.append(
                            (f"{label[: -len('_shape')]}.{column} {kind}", described[kind])
                        )
    return found + _extremes(parsed)


def _listed_ids(parsed: Any) -> list[tuple[str, Any]]:
    """Every identifier of a short list of records (`rows.account_ids=[...]`, a shape's
    ids: at most FEW_IDS records), for a result as returned or as compressed (its
    verified facts hold the shape): a later turn may name any of them (issue 22, item 2,
    "keep every identifier-like value when there are few"). They replace the list's
    first few elements."""
    shapes = (
        [(k, v) for k, v in parsed.items() if k.endswith(SHAPE_SUFFIX)]
        if isinstance(parsed, dict)
        else []
    )
    shapes += key_values(parsed, max_values=64, list_items=FEW_IDS)  # shapes list FEW_IDS
    found: list[tuple[str, Any]] = []
    for label, shape in shapes:
        if not label.endswith(SHAPE_SUFFIX) or not isinstance(shape, dict):
            continue
        for key, value in shape.items():
            if key != "count" and isinstance(value, list) and value:
                pair = (f"{label[: -len(SHAPE_SUFFIX)]}.{key}", value)
                if pair not in found:
                    found.append(pair)
    return found


SHAPE_SUFFIX = "_shape"  # compress._walk's label of a list's shape


def _extremes(parsed: Any) -> list[tuple[str, Any]]:
    """The records holding a column's min and max in a list of identified records
    (`rows.mrr_eur max=ACC-371173=876.91`): after the outliers, since a later turn may
    name a record by its extreme ("the account with the highest MRR")."""
    found: list[tuple[str, Any]] = []
    for label, shape in key_values(parsed, max_values=64, list_items=0):
        if not label.endswith("_shape") or not isinstance(shape, dict):
            continue
        for column, described in shape.items():
            if not isinstance(described, dict):
                continue
            for kind, value in (("min", "min_at"), ("max", "max_at")):
                if described.get(value) is not None:
                    shown = f"{described[value]}={_value_text(described.get(kind))}"
                    found.append((f"{label[: -len('_shape')]}.{column} {kind}", shown))
    return found


AMOUNT_KEY = re.compile(r"(?:^|[._-])(?:amount|total|price|cost|fee|balance|sum)$", re.I)
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def _amounts(pairs: list[tuple[str, Any]]) -> list[str]:
    """ "89.99 EUR" for an amount key next to a currency key in the same object."""
    labels = dict(pairs)
    found = []
    for label, value in pairs:
        if isinstance(value, bool) or not AMOUNT_KEY.search(label):
            continue
        if not isinstance(value, int | float | str) or not NUMBER.fullmatch(str(value)):
            continue
        parent = label.rsplit(".", 1)[0] if "." in label else ""
        currency = labels.get(f"{parent}.currency" if parent else "currency")
        if isinstance(currency, str) and currency.strip():
            found.append(f"{value} {currency.strip()}")
    return found


def _pairs_text(pairs: list[tuple[str, Any]]) -> str:
    return ", ".join(f"{label}={_value_text(value)}" for label, value in pairs)


def _reports_error(fact: str) -> bool:
    return bool(ERROR_LINE.search(fact) or LOCATION_LINE.search(fact))


def _stands_out(fact: str) -> bool:
    """Whether a tool fact carries what stands out of its result: a series' outlier or
    anomaly, a list's outlier record or rare string, a record a later turn named; the one
    value among routine ones, as informative as a log's one error line (issue 22, item 2)."""
    return STANDS_OUT.search(fact) is not None


def _is_signal(fact: str) -> bool:
    return _reports_error(fact) or _stands_out(fact)


def _value_text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _text_gist(text: str, referenced: frozenset[str] = frozenset()) -> str:
    """A text result by what its plan (TextPlan) ranks as signal, not by position: the
    lines the later conversation names (by value, line number or the identifier a line
    defines), the first error line of the rarest template (a log's one failure among
    many routine errors, wherever it sits), the best line of each other class of signal
    before the second of any (a trace's head, a rare error or a series' outlier, a rare
    line: four lines are little room), the other error templates, code locations, then
    lines with entities, else its beginning."""
    plan = TextPlan.of(text, referenced)
    errors = [line.strip() for line in plan.ranked_lines(GIST_LINES)]
    named = plan.signal_lines(GIST_LINES // 2, tiers=frozenset({0})) if referenced else []
    classes = [plan.signal_lines(GIST_LINES, tiers=frozenset({t})) for t in SIGNAL_TIERS]
    signal = [line for rank in itertools.zip_longest(*classes) for line in rank if line]
    chosen = [*named, *errors[:1], *signal, *errors[1:]]
    lines = text.splitlines()
    chosen += [line.strip() for line in lines if LOCATION_LINE.search(line)]
    chosen += [line.strip() for line in lines if line.strip() and entities_in(line)]
    kept = list(dict.fromkeys(line for line in chosen if line))[:GIST_LINES]
    marked = next((n for n, line in enumerate(kept) if line in plan.outliers()), -1)
    if marked >= 0:  # once: it ranks the fact (_stands_out), and room is short
        kept[marked] += OUTLIER_NOTE
    if plan.kind not in ("code", "diff"):  # spaces lay out a log or a table, not its words
        kept = [SPACES.sub(" ", line) for line in kept]
    return _cut(" | ".join(kept) if kept else text, GIST_CHARS)


# A text's outlier line in a fact is marked, as a JSON fact labels its shape's outliers
# (`points.p99_ms outliers=[36=4973]`) and leads with what stands out of its lists, by
# list and index (`activity[7]=legal hold: ...`, `deals[12]={...}`; not a list's
# `deals[4]=(+16 more)`): such a fact ranks with the errors (_stands_out).
OUTLIER_NOTE = " (outlier)"
STANDS_OUT = re.compile(
    r" (?:outliers|anomalies)=|" + re.escape(OUTLIER_NOTE) + r"| -> [^\s=]+\[\d+\]=(?!\(\+)"
)


GIST_LINES = 4
SIGNAL_TIERS = (0, 1, 2, 5)  # TextPlan's classes of signal lines (signal_lines)
GIST_CHARS = FACT_CHARS // 2


def _pending_calls(builder: _Builder, item: Item, answered: set[str], label: str = "") -> None:
    """The calls of `item` that nothing in the items answers: pending actions."""
    for call_id in item.call_ids:
        if call_id not in answered:
            arguments, amounts = _arguments(item, call_id)
            text = _cut(f"{label}{_call_name(item, call_id)}({arguments})", FACT_CHARS)
            builder.pending.append(Pending(text, call_id))
            builder.add("entities", (entities_in(text) + amounts)[:ENTITIES_PER_ITEM])


def _call_name(call: Item, call_id: str) -> str:
    for tool_call in call.raw.get("tool_calls") or []:
        if isinstance(tool_call, Mapping) and tool_call.get("id") == call_id:
            function = tool_call.get("function")
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                return str(function["name"])
    legacy = call.raw.get("function_call")
    if isinstance(legacy, Mapping) and isinstance(legacy.get("name"), str):
        return str(legacy["name"])
    return call.name or call.type or "unknown"


def _arguments(call: Item, call_id: str) -> tuple[str, list[str]]:
    """The values of a call's arguments (amounts, reasons, ids), not transport fields,
    and the amounts with their currency among them."""
    arguments: Any = call.raw.get("arguments", call.raw.get("input", ""))
    for tool_call in call.raw.get("tool_calls") or []:
        if isinstance(tool_call, Mapping) and tool_call.get("id") == call_id:
            function = tool_call.get("function")
            if isinstance(function, Mapping):
                arguments = function.get("arguments", "")
    legacy = call.raw.get("function_call")
    if not arguments and isinstance(legacy, Mapping):
        arguments = legacy.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    parsed = json_container(arguments)
    if isinstance(parsed, dict):
        pairs = key_values(parsed, max_values=8, shapes=False)
        return _pairs_text(pairs), _amounts(pairs)
    return _cut(arguments, STATEMENT_CHARS), []


def _cut(text: str, chars: int) -> str:
    """One line of at most `chars` characters (then marked). Only line breaks fold into a
    space: the spaces inside a line are part of what a quoted line says verbatim (code
    `timeout = 30  # seconds`, a table's columns)."""
    text = LINE_BREAKS.sub(" ", text).strip()
    if len(text) <= chars:
        return text
    return f"{text[:chars]}[... {len(text) - chars} more characters]"


def must_keep(items: Sequence[Item]) -> tuple[str, ...]:
    """The exact strings any summary of `items` must contain: constraint sentences, the
    latest preferences, decisions, open tasks, pending calls, ids and amounts, and the
    tool facts that hold them."""
    return extract(items).must_keep()


def guard(candidate: MemoryState, reference: MemoryState) -> MemoryState:
    """`candidate` (an LLM's state) with every must-keep string of `reference` (the
    deterministic state of the same items) it lacks appended, verbatim, to the section
    it came from. Its rendering then holds all of `reference.must_keep()` when it has room.
    A string found only in the candidate's notes is lacking: a note is not the user's.
    """
    written = "\n".join(
        e for section in SECTIONS if section.name != "notes" for e in section.entries(candidate)
    )

    def lacking(entries: Iterable[Any], text: Callable[[Any], str]) -> tuple[Any, ...]:
        return tuple(e for e in entries if text(e) not in written)

    return replace(
        candidate,
        count=max(candidate.count, reference.count),
        constraints=candidate.constraints + lacking(reference.constraints, str),
        preferences=candidate.preferences + lacking(reference.preferences, _text_of),
        decisions=candidate.decisions + lacking(reference.decisions, str),
        open_tasks=candidate.open_tasks + lacking(reference.open_tasks, str),
        pending=candidate.pending + lacking(reference.pending, _text_of),
        facts=candidate.facts + lacking(reference.facts, str),
        entities=candidate.entities + lacking(reference.entities, str),
    )


def _text_of(entry: Preference | Pending) -> str:
    return entry.text


# --- rendering ------------------------------------------------------------------------------


def header(state: MemoryState) -> str:
    return (
        f"{SUMMARY_MARKER} Stands for {state.count} earlier items no longer sent verbatim. "
        "Tool facts are verified results; everything else is what was said, not checked."
    )


@dataclass(frozen=True, slots=True)
class _Entry:
    section: int
    index: int
    text: str
    rank: tuple[int, int, int]
    tokens: int


def render(state: MemoryState, counter: TokenCounter, max_tokens: int) -> str:
    """The state as one text block of at most max_tokens (when the header line fits).

    Over budget, must-keep entries (rules, preferences, decisions, tasks, pending calls,
    entities, facts with ids or amounts) survive before the others; inside a section
    entries keep their order and the older ones are never dropped for newer ones.
    """
    head = header(state)
    entries = _ranked(state, counter.text)
    room = max_tokens - counter.text(head)
    while room > 0:
        text = _text(head, _choose(entries, room))
        excess = counter.text(text) - max_tokens
        if excess <= 0:
            return text
        room -= excess + 4
    return head


def _ranked(state: MemoryState, count_text: Callable[[str], int]) -> list[_Entry]:
    entries = []
    for number, section in enumerate(SECTIONS):
        for index, text in enumerate(section.entries(state)):
            tier = 0 if section.is_essential(text) else 1
            rank = (tier, -section.priority_of(text), index)
            entries.append(_Entry(number, index, text, rank, count_text(f"- {text}\n")))
    entries.sort(key=lambda entry: entry.rank)
    return entries


def _choose(entries: list[_Entry], room: int) -> list[_Entry]:
    chosen: list[_Entry] = []
    titled: set[int] = set()
    for entry in entries:
        cost = entry.tokens + (0 if entry.section in titled else 12)  # 12: the title line
        if cost <= room:
            room -= cost
            chosen.append(entry)
            titled.add(entry.section)
    return chosen


def _text(head: str, chosen: list[_Entry]) -> str:
    """Chosen entries under their titles, in section order, oldest first."""
    lines = [head]
    current = -1
    for entry in sorted(chosen, key=lambda entry: (entry.section, entry.index)):
        if entry.section != current:
            lines.append(SECTIONS[entry.section].title)
            current = entry.section
        lines.append(f"- {entry.text}")
    return "\n".join(lines)


# --- reading a digest back --------------------------------------------------------------------


def parse(text: str) -> MemoryState:
    """The state a rendered digest holds (older digest formats included); any other text
    becomes one "earlier summary" entry."""
    match = HEADER.match(text)
    if match is None:
        return MemoryState(earlier=(_cut(text, EARLIER_CHARS),) if text.strip() else ())
    lists: dict[str, list[str]] = {}
    section: _Section | None = None
    for line in text.splitlines()[1:]:
        if line in _BY_TITLE:
            section = _BY_TITLE[line]
        elif section is not None and line.startswith("- "):
            entry = line[2:]
            if section.name in ("facts", "pending"):
                entry = _OLD_CALL_ID.sub(r"\1\2 ", entry, count=1)
            lists.setdefault(section.name, []).append(entry)
    if "entities" not in lists:  # a digest written before the entities had a section
        found = [e for entries in lists.values() for entry in entries for e in entities_in(entry)]
        lists["entities"] = list(dict.fromkeys(found))
    preferences = tuple(_preference(p) for p in lists.pop("preferences", []))
    pending = tuple(Pending(p) for p in lists.pop("pending", []))
    return MemoryState(
        count=int(match.group(1)),
        preferences=preferences,
        pending=pending,
        **{name: tuple(entries) for name, entries in lists.items()},
    )


# Digests written before issue 10 named the call: "lookup_order call_1: {...}".
_OLD_CALL_ID = re.compile(r"^([\w.-]+) (?:call|fc|toolu|ctc)_[\w-]+(:?) ")
_CHANGED = re.compile(r"^(.*) \(changed from: (.*)\)$")


def _preference(text: str) -> Preference:
    match = _CHANGED.match(text)
    return Preference(match.group(1), match.group(2)) if match else Preference(text)


def to_json(state: MemoryState) -> str:
    """A stable JSON form of the state (for storage and encryption)."""
    body: dict[str, Any] = {"version": STATE_VERSION, "count": state.count}
    for section in SECTIONS:
        values = getattr(state, section.name)
        if section.name == "preferences":
            body[section.name] = [{"text": p.text, "changed_from": p.changed_from} for p in values]
        elif section.name == "pending":
            body[section.name] = [{"text": p.text, "call_id": p.call_id} for p in values]
        else:
            body[section.name] = list(values)
    return json.dumps(body, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def from_json(value: str | Mapping[str, Any]) -> MemoryState:
    """The state `to_json` wrote (or an equivalent mapping); ValueError when malformed."""
    body = json.loads(value) if isinstance(value, str) else value
    if not isinstance(body, Mapping):
        raise ValueError("a memory state is a JSON object")
    count = body.get("count", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError("count must be a non-negative integer")
    lists: dict[str, tuple[str, ...]] = {}
    for section in SECTIONS:
        if section.name not in ("preferences", "pending"):
            lists[section.name] = tuple(_strings(body.get(section.name, []), section.name))
    preferences = tuple(
        Preference(*_pair(p, "text", "changed_from", "preferences"))
        for p in _list(body.get("preferences", []), "preferences")
    )
    pending = tuple(
        Pending(*_pair(p, "text", "call_id", "pending"))
        for p in _list(body.get("pending", []), "pending")
    )
    return MemoryState(count=count, preferences=preferences, pending=pending, **lists)


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list")
    return value


def _strings(value: Any, name: str) -> list[str]:
    entries = _list(value, name)
    if not all(isinstance(e, str) for e in entries):
        raise ValueError(f"{name} must be a list of strings")
    return [_cut(e, SENTENCE_CHARS * 2) for e in entries if e.strip()]


def _pair(value: Any, first: str, second: str, name: str) -> tuple[str, str]:
    if isinstance(value, str):
        return _cut(value, SENTENCE_CHARS * 2), ""
    if isinstance(value, Mapping):
        a, b = value.get(first), value.get(second, "")
        if isinstance(a, str) and isinstance(b, str):
            return _cut(a, SENTENCE_CHARS * 2), _cut(b, SENTENCE_CHARS * 2)
    raise ValueError(f"{name} entries must be strings or objects with a string {first!r}")


# --- the Summarizer seam ------------------------------------------------------------------------


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


def is_summary(item: Item) -> bool:
    """A digest made by a Summarizer (its text starts with SUMMARY_MARKER)."""
    return item.is_instruction and item.text().startswith(SUMMARY_MARKER)


def summary_item(api: Api, text: str) -> Item:
    """Chat: a system message; Responses: a developer message."""
    if api == "chat":
        return chat_item({"role": "system", "content": text})
    return responses_item({"type": "message", "role": "developer", "content": text})


def state_of(summary: Item | None) -> MemoryState | None:
    """The state a digest item holds, if any."""
    return parse(summary.text()) if summary is not None else None


def summarize_turns(
    items: Sequence[Item],
    counter: TokenCounter,
    max_tokens: int,
    previous_summary: Item | None = None,
) -> Item:
    """Deterministic digest of `items` (plus the previous digest), at most max_tokens
    when max_tokens leaves room for the header line."""
    api = _api_of(items, previous_summary)
    state = extract(items, state_of(previous_summary))
    return fit_summary(api, state, counter, max_tokens)


def fit_summary(api: Api, state: MemoryState, counter: TokenCounter, max_tokens: int) -> Item:
    """The digest item of `state`, item overhead included in max_tokens."""
    limit = max_tokens - _count(summary_item(api, ""), counter)
    while True:
        item = summary_item(api, render(state, counter, limit))
        excess = _count(item, counter) - max_tokens
        if excess <= 0 or item.text() == header(state):
            return item
        limit -= excess


def _api_of(items: Sequence[Item], previous: Item | None) -> Api:
    if items:
        return items[0].api
    if previous is not None:
        return previous.api
    raise ValueError("summarize_turns needs items or a previous summary")


def _count(item: Item, counter: TokenCounter) -> int:
    """Uncached count: failed candidates must not fill the shared cache."""
    if item.api == "chat":
        return counter.chat_message(item.raw)
    return counter.responses_item(item.raw)


__all__ = [
    "SUMMARY_MARKER",
    "MemoryState",
    "Pending",
    "Preference",
    "Summarizer",
    "constraints",
    "entities_in",
    "extract",
    "fit_summary",
    "from_json",
    "guard",
    "is_rule",
    "is_summary",
    "may_take_in",
    "merge",
    "must_keep",
    "parse",
    "referenced_values",
    "render",
    "sentences",
    "state_of",
    "summarize_turns",
    "summary_item",
    "taken_in",
    "to_json",
]
