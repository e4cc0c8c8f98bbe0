"""Text results by template (issue 22, item 1): a rare line among frequent ones survives
compression and the digest wherever it sits; frequent templates collapse to one example
with their count and ranges; a stack trace keeps its exception and innermost frames."""

from __future__ import annotations

import json
import random

import pytest

from proxy.core.compress import ERROR_LINE, LOCATION_LINE, TextPlan, compress_tool_output
from proxy.core.items import Item, chat_item
from proxy.core.memory import ENTITY, extract, summarize_turns
from proxy.core.templates import WILDCARD, mine, outlier_lines
from proxy.core.tokens import TokenCounter

RARE = "ERROR db.pool: connection pool exhausted (max_connections=200 reached) pid=31337"
COMMAND = "$ logs query --service checkout --since 1h --level>=WARN"


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o")


def incident_log(seed: int) -> str:
    """The issue's log: ~50 routine 502 errors, routine warnings, one rare failure placed
    at random (seeded)."""
    rng = random.Random(seed)
    lines = []
    for i in range(100):
        stamp = (
            f"2026-11-30T10:{i // 2 % 60:02d}:{rng.randrange(60):02d}.{rng.randrange(1000):03d}Z"
        )
        if i % 2 == 0:
            lines.append(
                f"{stamp} ERROR gateway req={rng.randrange(16**8):08x} host=edge-{rng.randrange(9)}"
                f" upstream 502 Bad Gateway after {rng.randrange(20, 900)}ms"
            )
        else:
            lines.append(
                f"{stamp} WARN checkout retry attempt={rng.randrange(1, 4)}"
                f" order=ORD-{rng.randrange(10**5)} latency={rng.randrange(900)}ms"
            )
    lines.insert(rng.randrange(len(lines) + 1), f"2026-11-30T10:17:03.514Z {RARE}")
    return "\n".join([COMMAND, *lines])


def log_turn(seed: int) -> list[Item]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "query_logs", "arguments": "{}"},
    }
    return [
        chat_item({"role": "user", "content": "Why is checkout failing?"}),
        chat_item({"role": "assistant", "content": None, "tool_calls": [call]}),
        chat_item({"role": "tool", "tool_call_id": "call_1", "content": incident_log(seed)}),
    ]


def test_mining_groups_lines_by_template_and_keeps_ranges() -> None:
    lines = incident_log(3).splitlines()
    templates, owner = mine(lines)
    by_count = sorted(templates, key=lambda t: t.count)
    assert [t.count for t in by_count][-2:] == [50, 50]
    rare = [t for t in templates if t.count == 1 and "exhausted" in t.tokens]
    assert len(rare) == 1 and lines[rare[0].example].endswith(RARE)
    gateway = next(t for t in templates if "Gateway" in t.tokens)
    assert gateway.tokens[1:3] == ["ERROR", "gateway"] and gateway.tokens[0] == WILDCARD
    assert "502" in gateway.ranges() and "after" not in gateway.ranges()
    assert len(owner) == len(lines) and all(o >= 0 for o in owner)


@pytest.mark.parametrize("seed", range(6))
def test_the_rare_line_survives_compression_wherever_it_sits(
    counter: TokenCounter, seed: int
) -> None:
    output = log_turn(seed)[2]
    assert 3000 <= counter.item(output) <= 4200  # the issue's ~3.6k-token log
    small = compress_tool_output(output, log_turn(seed)[1], 800, counter)
    assert counter.item(small) <= 800
    shown = json.loads(small.raw["content"])["excerpt"]
    assert RARE in shown
    assert shown.startswith(COMMAND)  # the query that produced the output
    assert "(x50 lines like this, elided by threadkeeper" in shown  # the 502s, collapsed


@pytest.mark.parametrize("seed", range(6))
def test_the_digest_leads_with_the_rare_line(counter: TokenCounter, seed: int) -> None:
    state = extract(log_turn(seed))
    fact = next(f for f in state.facts if f.startswith("query_logs"))
    assert RARE in fact
    assert fact.index(RARE) < fact.index("upstream 502 Bad Gateway")  # then one per template
    assert fact in state.must_keep()
    summary = summarize_turns(log_turn(seed), counter, 400, None)
    assert RARE in summary.text()


@pytest.mark.parametrize("seed", range(3))
def test_the_digest_of_a_compressed_log_still_leads_with_the_rare_line(
    counter: TokenCounter, seed: int
) -> None:
    """A turn compressed first, summarized later: rarity is read back from the marks."""
    call, output = log_turn(seed)[1:]
    small = compress_tool_output(output, call, 800, counter)
    state = extract([log_turn(seed)[0], call, small])
    assert any(RARE in f for f in state.facts)


def test_a_python_trace_keeps_its_exception_and_innermost_frames() -> None:
    frames = []
    for depth in range(30):
        frames += [
            f'  File "/app/svc/layer{depth}.py", line {10 + depth}, in step{depth}',
            f"    step{depth + 1}()",
        ]
    lines = [
        *(f"INFO tick {i} ok" for i in range(200)),
        "Traceback (most recent call last):",
        *frames,
        "KeyError: 'tenant_id'",
        *(f"INFO tick {i} ok" for i in range(200, 400)),
    ]
    shown = TextPlan.of("\n".join(lines)).render(900)
    assert "KeyError: 'tenant_id'" in shown
    assert 'File "/app/svc/layer29.py", line 39, in step29' in shown  # innermost
    assert 'File "/app/svc/layer28.py", line 38, in step28' in shown
    assert 'layer5.py", line 15, in step5\n' not in shown  # the outer frames give way
    assert "(x30 lines like this" in shown  # counted in one line


def test_a_java_trace_keeps_its_exception_and_innermost_frames() -> None:
    lines = [*(f"INFO tick {i} ok" for i in range(300))]
    lines += ['Exception in thread "main" java.lang.IllegalStateException: ledger closed']
    lines += [f"\tat com.acme.Ledger{d}.post(Ledger{d}.java:{40 + d})" for d in range(40)]
    shown = TextPlan.of("\n".join(lines)).render(700)
    assert "IllegalStateException: ledger closed" in shown
    assert "at com.acme.Ledger0.post(Ledger0.java:40)" in shown  # innermost first in Java
    assert "Ledger20.java" not in shown  # the outer frames give way


def test_error_lines_are_ranked_by_rarity_not_position() -> None:
    lines = [f"ERROR worker-{i % 7}: job {i} retry scheduled in {i % 30}s" for i in range(300)]
    lines.append("ERROR disk: /var/lib/pg is full (100%), writes refused")
    ranked = TextPlan.of("\n".join(lines)).ranked_lines(1)
    assert ranked == ["ERROR disk: /var/lib/pg is full (100%), writes refused"]


@pytest.mark.parametrize(
    "line", ["a." * 300_000, "A1" * 300_000, "a" * 600_000, "A-" * 300_000, "1," * 300_000]
)
def test_error_and_entity_patterns_are_linear_on_a_pathological_line(line: str) -> None:
    """The code-location and e-mail patterns once started a scan at every character of a
    long path-like run (quadratic: hours for these lines); they now start at a run's start."""
    assert ERROR_LINE.search(line) is None
    assert LOCATION_LINE.search(line) is None
    assert len(ENTITY.findall(line)) <= 1  # one run, matched once at most


def stock_report(big_row: int) -> str:
    """A warehouse report: its header, four pickers, a table of 16 stock rows whose
    status word splits them into four templates of four rows (each too few to stand out
    on its own), one quantity far above the others, then routine activity lines."""
    rng = random.Random(big_row)
    statuses = ("RESERVED", "ON_HAND", "INBOUND", "DAMAGED")
    lines = ["Warehouse WH-0412 (Tilburg)", "Pickers:", "  Anouk Smit", "  Joris Peeters"]
    lines += ["  Femke Jansen", "  Ruben de Wit", "Stock:"]
    for row in range(16):
        quantity = 95_000 if row == big_row else rng.randrange(120, 900)
        lines.append(f"  SKU-{10_000 + 37 * row}  {statuses[row % 4]:<9} {quantity:>6} pcs")
    lines.append("Activity:")
    for day in range(14):
        kind = ("cycle count", "restock", "pick wave")[day % 3]
        lines.append(f"  2026-11-{day + 3:02d}T08:{day * 4:02d}:00Z {kind} logged by ana: done")
    return "\n".join(lines)


def tool_turn(text: str) -> list[Item]:
    call = {"id": "call_1", "type": "function", "function": {"name": "report", "arguments": "{}"}}
    return [
        chat_item({"role": "assistant", "content": None, "tool_calls": [call]}),
        chat_item({"role": "tool", "tool_call_id": "call_1", "content": text}),
    ]


@pytest.mark.parametrize("big_row", [2, 9, 15])
def test_an_outlier_is_judged_against_its_column_not_its_template(big_row: int) -> None:
    """The one quantity of 95,000 among hundreds: its row's template (one status) has
    four rows, but its column (the quantities of all rows of that shape) has sixteen."""
    text = stock_report(big_row)
    big = next(line for line in text.splitlines() if " 95000 pcs" in line)
    lines = text.splitlines()
    assert [lines[i] for i in outlier_lines(mine(lines)[0], lines)] == [big]
    [fact] = extract(tool_turn(text)).facts
    assert " ".join(big.split()) in fact  # the digest collapses runs of spaces


def notes_log(note_at: int) -> str:
    """An account: contacts (each line its own template), then routine activity, with one
    note that says what no other line says, placed by `note_at`."""
    lines = ["Account ACC-5521 (Gouda)", "Contacts:"]
    lines += ["  Maud Visser - finance", "  Bram Kok - it", "  Lotte Kok - buyer"]
    lines += ["  Daan Bos - finance", "Activity:"]
    for day in range(18):
        kind = ("call", "e-mail", "meeting")[day % 3]
        lines.append(f"  2026-10-{day + 2:02d}T09:{day:02d}:00Z {kind} logged by ben: follow-up")
    lines.insert(7 + note_at, f"  2026-10-{note_at + 2:02d}T11:30:00Z {NOTE}")
    return "\n".join(lines)


NOTE = "compliance: account frozen pending audit review (case 4471)"


@pytest.mark.parametrize("note_at", [0, 8, 17])
def test_among_rare_lines_the_digest_keeps_the_one_that_says_most_of_its_own(
    note_at: int,
) -> None:
    """Every contact line is rare (its own template), so rarity ranks them no better
    than position; the note's words are said by no other line."""
    [fact] = extract(tool_turn(notes_log(note_at))).facts
    assert NOTE in fact
