"""File listings, diffs and documents in the text plan (issue 22, item 4): the lines a
turn refers to, diff hunks whole, signatures as the skeleton; the sentences carrying the
call's query terms, the ones the conversation quotes, and the headings."""

from __future__ import annotations

import json
import random

import pytest

from proxy.core.compress import (
    TextPlan,
    compress_tool_output,
    query_terms,
    text_kind,
)
from proxy.core.items import Item, chat_item
from proxy.core.memory import extract, referenced_values
from proxy.core.tokens import TokenCounter

BUG = "    days_in_year = 365"


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o")


WORDS = "rate period start count offset total ledger invoice month week span fee base".split()


def source_file(seed: int, lines: int = 400) -> tuple[list[str], int]:
    """A Python module of about `lines` lines, each function with its own names (few
    lines share a template, as in real code), BUG at a random position inside a function
    and `days_in_year` used in many other lines; and BUG's index."""
    rng = random.Random(seed)
    body: list[str] = ['"""Billing calendar."""', "", "import datetime", ""]
    block = 0
    while len(body) < lines:
        a, b, c = (f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{rng.choice(WORDS)}" for _ in "abc")
        body += [
            f"def period_{block}({a}, {b}):",
            f'    """The {rng.choice(WORDS)} of the {rng.choice(WORDS)} calendar."""',
            f"    {c} = {a} + {b} * {rng.choice(WORDS)}",
            f"    {c} = {c} / days_in_year + {rng.choice(WORDS)}",
            f"    if {c} > {rng.choice(WORDS)}_{rng.choice(WORDS)}:",
            f"        {c} -= {rng.choice(WORDS)}",
            f"    return {c}",
            "",
        ]
        block += 1
    at = rng.randrange(10, len(body) - 10)
    while body[at].startswith("def") or not body[at].startswith("    "):
        at += 1
    body.insert(at, BUG)
    return body, at


def call(call_id: str, name: str, arguments: dict[str, object]) -> Item:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return chat_item(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }
    )


def excerpt_of(
    text: str, said: str, counter: TokenCounter, arguments: dict[str, object] | None = None
) -> str:
    output = chat_item({"role": "tool", "tool_call_id": "call_1", "content": text})
    referenced = referenced_values([chat_item({"role": "assistant", "content": said})])
    small = compress_tool_output(
        output, call("call_1", "read", arguments or {}), 800, counter, referenced
    )
    assert counter.item(small) <= 800
    return str(json.loads(small.raw["content"])["excerpt"])


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_line_of_an_identifier_the_turn_names_survives(
    counter: TokenCounter, seed: int
) -> None:
    """`days_in_year` is used in fifty lines; the line defining it is the one named."""
    lines, _ = source_file(seed)
    shown = excerpt_of("\n".join(lines), "The culprit is `days_in_year`: no leap years.", counter)
    assert BUG in shown


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_line_named_by_its_number_survives(counter: TokenCounter, seed: int) -> None:
    lines, at = source_file(seed)
    numbered = "\n".join(f"{n + 1:6d}\t{line}" for n, line in enumerate(lines))
    shown = excerpt_of(numbered, f"Line {at + 1} hardcodes the year length.", counter)
    assert f"{at + 1:6d}\t{BUG}" in shown


def test_an_unnumbered_listing_line_by_its_number(counter: TokenCounter) -> None:
    lines, at = source_file(5)
    shown = excerpt_of("\n".join(lines), f"See app.py:{at + 1}, it ignores leap years.", counter)
    assert BUG in shown


def test_signatures_are_the_skeleton(counter: TokenCounter) -> None:
    lines, _ = source_file(6)
    signatures = [line for line in lines if line.startswith("def ")]
    room = sum(len(s) + 40 for s in signatures) + 200  # each with its gap mark
    shown = TextPlan.of("\n".join(lines)).render(room)
    assert len(signatures) == 50
    assert all(s in shown for s in signatures)
    assert lines[-3] not in shown  # the bodies give way
    assert "lines elided by threadkeeper" in shown


def unified_diff(hunks: int = 6, context: int = 60) -> tuple[str, list[str]]:
    """A diff whose hunks carry long context; and its changed lines."""
    lines = ["diff --git a/billing.py b/billing.py", "--- a/billing.py", "+++ b/billing.py"]
    changed: list[str] = []
    for hunk in range(hunks):
        start = 100 * hunk + 1
        lines.append(f"@@ -{start},{context + 2} +{start},{context + 2} @@ def period_{hunk}():")
        lines += [f"     value_{hunk}_{n} = compute({n}, {hunk})" for n in range(context // 2)]
        pair = [f"-    rate = {hunk}.0 / 365", f"+    rate = {hunk}.0 / days_in_year"]
        lines += pair
        changed += pair
        lines += [f"     other_{hunk}_{n} = compute({n}, {hunk})" for n in range(context // 2)]
    return "\n".join(lines), changed


def test_diff_hunks_survive_whole(counter: TokenCounter) -> None:
    text, changed = unified_diff()
    assert text_kind(text.splitlines())[0] == "diff"
    shown = excerpt_of(text, "Review the change.", counter)
    assert "--- a/billing.py" in shown and "+++ b/billing.py" in shown
    for line in changed:
        assert line in shown
    assert "@@ -501,62 +501,62 @@ def period_5():" in shown
    assert "     value_3_7 = compute(7, 3)" not in shown  # context gives way


SUBJECTS = ["Our stores", "Gift cards", "The loyalty programme", "Most parcels", "Returns"]
VERBS = ["usually take", "can include", "are handled within", "depend on", "may require"]
OBJECTS = ["three to five days", "the original receipt", "one point per euro", "a signature"]
PLACES = ["in Europe", "at the checkout", "online and in stores", "on weekdays", "by post"]


def filler(rng: random.Random) -> str:
    """A routine sentence of a help page, one of many different ones."""
    return (
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        f" {rng.choice(PLACES)}, as noted in section {rng.randint(1, 99)}."
    )


ANSWER = (
    "The X200 headphones carry a warranty period of 24 months from the date of purchase,"
    " covering defects in materials and workmanship."
)
QUOTED = "Batteries are consumables and are excluded from any claim after six months"


def web_page(seed: int) -> str:
    """A help page: a title, headings, long paragraphs (one line each) of routine
    sentences; the answer and the quoted sentence at random places."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    for _ in range(40):
        paragraphs.append(" ".join(filler(rng) for _ in range(6)))
    first, second = rng.sample(range(5, 40), 2)
    words = paragraphs[first].split(". ")
    paragraphs[first] = ". ".join([*words[:3], ANSWER.rstrip("."), *words[3:]])
    paragraphs[second] += " " + QUOTED + "."
    lines = ["# Help centre: products and services", ""]
    for index, paragraph in enumerate(paragraphs):
        if index % 10 == 0:
            lines += [f"## Section {index // 10 + 1}", ""]
        lines += [paragraph, ""]
    return "\n".join(lines)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_sentence_with_the_query_terms_survives(counter: TokenCounter, seed: int) -> None:
    text = web_page(seed)
    assert text_kind(text.splitlines())[0] == "prose"
    arguments = {"query": "X200 headphones warranty period"}
    shown = excerpt_of(text, "Let me read the page.", counter, arguments)
    assert ANSWER in shown
    assert "# Help centre: products and services" in shown
    assert "## Section 3" in shown
    assert "sentences elided by threadkeeper" in shown


def test_the_sentence_the_conversation_quotes_survives(counter: TokenCounter) -> None:
    said = f'The page says "{QUOTED}", so the battery is not covered.'
    shown = excerpt_of(web_page(4), said, counter, {"url": "https://example.com/help"})
    assert QUOTED in shown


def test_query_terms_are_the_words_of_the_arguments() -> None:
    terms = query_terms(json.dumps({"query": "What is the warranty for X200 headphones?"}))
    assert terms == {"warranty", "x200", "headphone"}  # "headphones" as its stem
    assert query_terms("") == frozenset()


def test_a_log_is_neither_code_nor_prose() -> None:
    log = [
        f"2024-05-01T10:{i % 60:02d}:00Z ERROR upstream 502 Bad Gateway id={i}" for i in range(99)
    ]
    assert text_kind(log)[0] == "log"
    retries = [f"WARN worker-{i % 7}: job {i} retry scheduled, backoff in {i}s." for i in range(99)]
    assert text_kind(retries)[0] == "log"
    lines, _ = source_file(1)
    assert text_kind(lines)[0] == "code"


@pytest.mark.parametrize("numbered", ["{n:>4} | {line}", "{n:>4}| {line}", "{n}: {line}"])
def test_a_listing_numbered_with_a_spaced_pipe_is_code(numbered: str) -> None:
    """`   7 | def f():` is a listing's number and its line: the number goes, the line's
    own indentation stays, and the listing is code (its lines named by number are kept
    as code lines, its signatures are its skeleton)."""
    lines, at = source_file(3, 120)
    listing = [numbered.format(n=n, line=line) for n, line in enumerate(lines, start=1)]
    kind, numbers = text_kind(["==> billing/calendar.py <==", *listing])
    assert kind == "code"
    assert numbers[at + 1] == at + 1


def test_a_listings_odd_statement_survives_before_anyone_names_it(counter: TokenCounter) -> None:
    """Helpers that all say the same and one statement that says something else: the
    compressed listing and the digest keep that statement before any turn names it
    (rare by template where the others repeat, as in a log)."""
    lines = ['"""billing/tax.py: billing helpers."""', "from decimal import Decimal", ""]
    for n in range(22):
        lines += [
            f"def {WORDS[n % 13]}_{WORDS[(n * 5) % 13]}(value, factor=Decimal('{n}.25')):",
            '    """Return the value scaled by factor."""',
            "    value = Decimal(value) * factor",
            "    return value.quantize(Decimal('0.01'))",
            "",
        ]
    lines.insert(40, "    cache_ttl = 0")
    listing = "\n".join(f"{n:>4} | {line}" for n, line in enumerate(lines, start=1))
    text = "==> billing/tax.py <==\n" + listing
    assert text_kind(text.splitlines())[0] == "code"
    item = chat_item({"role": "tool", "tool_call_id": "c1", "content": text})
    shown = compress_tool_output(item, None, 300, counter).text()
    assert "cache_ttl = 0" in shown
    function = {"name": "read_file", "arguments": '{"path": "billing/tax.py"}'}
    first = chat_item(
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": function}],
        }
    )
    fact = extract([first, item]).facts[0]
    assert "cache_ttl = 0" in fact


def test_many_rare_statements_are_not_odd_ones(counter: TokenCounter) -> None:
    """Forty statements of their own in a file of repeated helpers are its code, not
    its odd lines: the listing still compresses to its skeleton (the signatures)."""
    lines = []
    for n in range(160):
        lines += [f"def helper_{n}(value, factor=Decimal('{n}.25')):"]
        odd = f"    {WORDS[n % 13]}_{WORDS[n // 13]} = value.{WORDS[(n * 7) % 13]}()"
        lines += [odd] if n % 5 == 0 else []
        lines += ["    value = Decimal(value) * factor", "    return value", ""]
    item = chat_item({"role": "tool", "tool_call_id": "c1", "content": "\n".join(lines)})
    shown = compress_tool_output(item, None, 300, counter).text()
    assert shown.count("def helper_") >= 5
