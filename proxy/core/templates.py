"""Log template mining (Drain, He et al. 2017), written here so the pure core stays free of
dependencies.

A line of a log is a constant template with variable parts: timestamps, numbers, ids,
addresses. The lines of one template are routine; a template seen once or twice is the
signal (issue 22, item 1). Lines are grouped in one pass: each line's tokens are masked
(a token holding a digit, a hex run or a quoted value is a variable), then the line goes
down a fixed-depth tree (its token count, then its first masked tokens) to a leaf, where
it joins the most similar template (the share of equal constant tokens at least
SIMILARITY) or starts a new one. A leaf compares against at most LEAF_CLUSTERS templates
and an exact masked form is found by lookup, so the cost is linear in the text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from proxy.core.shapes import far_from_median

WILDCARD = "<*>"
SIMILARITY = 0.5  # share of a template's constant tokens a line must match to join it
TREE_DEPTH = 2  # masked first tokens that choose a leaf, after the token count
LEAF_CLUSTERS = 32  # templates compared per leaf; an exact masked form needs no comparison
MAX_TOKENS = 64  # tokens of a line that take part (a longer line's rest is one token)
DISTINCT_VALUES = 3  # values shown per non-numeric variable part, the rarest first
VALUE_CHARS = 40  # a shown value longer than this is cut
TRACKED_VALUES = 64  # values counted per variable part (the rest counted as "more")
OUTLIER_LINES = 3  # lines kept per column for a value far from the others
OUTLIER_MIN_LINES = 5  # a column needs this many rows before one of them stands out

_SPLIT = re.compile(r"\s+")
# A variable token: holds a digit, is a long hex run, or is quoted.
_VARIABLE = re.compile(r"\d|^[0-9a-fA-F]{8,}$|^[\"'`].*[\"'`]$")
_KEY_VALUE = re.compile(r"^([A-Za-z_][\w.-]{0,40}[=:])(.+)$")
_NUMBER = re.compile(r"^[-+]?\d+(?:\.\d+)?(?:ms|s|us|µs|ns|m|h|kb|mb|gb|b|%)?$", re.IGNORECASE)
_PUNCTUATION = ",;:()[]{}"
_NUMERIC_PART = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _mask(token: str) -> str:
    """The constant form of a token: WILDCARD for a variable, `key=<*>` for a key with a
    variable value (the key is part of the template)."""
    pair = _KEY_VALUE.match(token)
    if pair is not None and _VARIABLE.search(pair.group(2)):
        return pair.group(1) + WILDCARD
    return WILDCARD if _VARIABLE.search(token) else token


def tokens(line: str) -> list[str]:
    parts = _SPLIT.split(line.strip(), maxsplit=MAX_TOKENS - 1)
    return [p for p in parts if p]


@dataclass(slots=True)
class _Slot:
    """What one variable position of a template held: numeric range, values by count."""

    low: float | None = None
    high: float | None = None
    numeric: bool = True
    counts: dict[str, int] = field(default_factory=dict)
    more: int = 0

    def add(self, token: str) -> None:
        value = token.strip(_PUNCTUATION) or token
        if value in self.counts:
            self.counts[value] += 1
        elif len(self.counts) < TRACKED_VALUES:
            self.counts[value] = 1
        else:
            self.more += 1
        number = _NUMERIC_PART.search(value) if _NUMBER.match(value) else None
        if number is None:
            self.numeric = False
            return
        x = float(number.group())
        self.low = x if self.low is None else min(self.low, x)
        self.high = x if self.high is None else max(self.high, x)

    def distinct(self) -> int:
        return len(self.counts) + self.more

    def described(self) -> str:
        """`12..840` for numbers, else the rarest few values and how many there were."""
        if self.numeric and self.low is not None and self.high is not None:
            return (
                _number(self.low)
                if self.low == self.high
                else f"{_number(self.low)}..{_number(self.high)}"
            )
        ranked = sorted(self.counts, key=lambda v: (self.counts[v], v))[:DISTINCT_VALUES]
        shown = ", ".join(v if len(v) <= VALUE_CHARS else v[:VALUE_CHARS] + "..." for v in ranked)
        rest = self.distinct() - len(ranked)
        return f"{shown}, +{rest} other values" if rest > 0 else shown


def _number(x: float) -> str:
    return str(int(x)) if x == int(x) else f"{x:g}"


@dataclass(slots=True)
class Template:
    """A group of lines: their common tokens (variables as WILDCARD), how many there were,
    the first one (the example) and its line numbers."""

    tokens: list[str]
    example: int  # index of the first line
    lines: list[int] = field(default_factory=list)
    slots: dict[int, _Slot] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.lines)

    def text(self) -> str:
        return " ".join(self.tokens)

    def ranges(self) -> str:
        """The variable parts: `pos 3: 12..840; req=: a1f, 9c2, +38 other values`."""
        parts = []
        for position in sorted(self.slots):
            slot = self.slots[position]
            if slot.distinct() <= 1 and slot.numeric is False:
                continue
            label = self.tokens[position]
            name = label[: -len(WILDCARD)] if label.endswith(WILDCARD) and label != WILDCARD else ""
            parts.append(f"{name or '#' + str(position + 1)} {slot.described()}")
        return "; ".join(parts)


def outlier_lines(templates: Sequence[Template], lines: Sequence[str]) -> list[int]:
    """The lines whose number in some column is far from that column's others
    (shapes.far_from_median: a modified z-score): the day revenue fell to 2% in a table
    of routine days, the one request at 9 s among 80 ms ones, the one deal of 306,451 EUR
    among deals of 10,000. A column is the numbers at one position of the lines of one
    shape (column_key: as many tokens, numbers at the same positions with the same unit
    or key), whatever template they fall in: a table whose status column splits its rows
    into templates of four rows each is still one column of amounts. A frequent template
    collapses to its example and ranges, which name the extreme value but not its line;
    this keeps the line. At most OUTLIER_LINES per column, the farthest first; one pass
    over the lines of the templates holding numbers."""
    columns: dict[tuple[object, ...], tuple[list[int], list[list[float]]]] = {}
    for template in templates:
        key, positions = column_key(template)
        if not positions:
            continue
        rows, values = columns.setdefault(key, ([], [[] for _ in positions]))
        for index in template.lines:
            words = tokens(lines[index])
            rows.append(index)
            for column, position in zip(values, positions, strict=True):
                value = _value(words[position], template.tokens[position]).strip(_PUNCTUATION)
                number = _NUMERIC_PART.search(value)
                column.append(float(number.group()) if number else float("nan"))
    found: list[int] = []
    for rows, values in columns.values():
        if len(rows) < OUTLIER_MIN_LINES:
            continue
        for numbers in values:
            if any(x != x for x in numbers):  # a row without a number there: not one column
                continue
            for at in far_from_median(numbers)[:OUTLIER_LINES]:
                if rows[at] not in found:
                    found.append(rows[at])
    return found


def column_key(template: Template) -> tuple[tuple[object, ...], list[int]]:
    """A template's shape as a table row, and the positions of its numbers: its token
    count and, for each variable part holding numbers only (`306451`, `9030ms`,
    `took=1939ms`), its position and what names it (its key, else the next token: its
    unit, `EUR`)."""
    key: list[object] = [len(template.tokens)]
    positions: list[int] = []
    for position, slot in sorted(template.slots.items()):
        if not slot.numeric or slot.low is None:
            continue
        known = template.tokens[position]
        name = known[: -len(WILDCARD)]
        if not name:
            following = position + 1
            name = template.tokens[following] if following < len(template.tokens) else ""
        key += [position, name]
        positions.append(position)
    return tuple(key), positions


def _similarity(template: Sequence[str], masked: Sequence[str]) -> float:
    constant = 0
    equal = 0
    for known, token in zip(template, masked, strict=True):
        if known == WILDCARD:
            continue
        constant += 1
        equal += known == token
    return equal / constant if constant else 1.0


def mine(lines: Sequence[str]) -> tuple[list[Template], list[int]]:
    """The templates of `lines` (in order of first appearance) and each line's template
    index (-1 for a blank line)."""
    templates: list[Template] = []
    exact: dict[tuple[str, ...], int] = {}
    leaves: dict[tuple[str, ...], list[int]] = {}
    owner: list[int] = []
    for index, line in enumerate(lines):
        words = tokens(line)
        if not words:
            owner.append(-1)
            continue
        masked = tuple(_mask(w) for w in words)
        chosen = exact.get(masked)
        if chosen is None:
            leaf_key = (str(len(masked)), *masked[:TREE_DEPTH])
            leaf = leaves.setdefault(leaf_key, [])
            best, score = -1, SIMILARITY
            for candidate in leaf[:LEAF_CLUSTERS]:
                value = _similarity(templates[candidate].tokens, masked)
                if value >= score and (best < 0 or value > score):
                    best, score = candidate, value
            if best < 0:
                best = len(templates)
                templates.append(Template(list(masked), index))
                leaf.append(best)
            else:
                merged = templates[best].tokens
                for position, (known, token) in enumerate(zip(merged, masked, strict=True)):
                    if known != token and known != WILDCARD:
                        merged[position] = WILDCARD
                        _backfill(templates[best], lines, position)
            exact[masked] = best
            chosen = best
        template = templates[chosen]
        template.lines.append(index)
        for position, known in enumerate(template.tokens):
            if known.endswith(WILDCARD):
                slot = template.slots.setdefault(position, _Slot())
                slot.add(_value(words[position], known))
        owner.append(chosen)
    return templates, owner


def _backfill(template: Template, lines: Sequence[str], position: int) -> None:
    """A position that just became variable: the values its earlier lines held there.
    A position becomes variable at most once, so this adds at most one pass per token."""
    slot = template.slots.setdefault(position, _Slot())
    for earlier in template.lines:
        words = tokens(lines[earlier])
        slot.add(words[position])


def _value(token: str, known: str) -> str:
    if known != WILDCARD:
        prefix = known[: -len(WILDCARD)]
        if token.startswith(prefix):
            return token[len(prefix) :]
    return token
