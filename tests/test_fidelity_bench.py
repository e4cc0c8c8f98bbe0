"""bench/fidelity.py measures what it says: its metrics on hand-checked cases, one short
scenario end to end through the proxy, and its section written only where it is told."""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import fidelity
from families import FAMILIES, HELDOUT_SEEDS, TUNING_SEEDS
from fidelity import (
    Call,
    Fact,
    Row,
    Scenario,
    Sent,
    Turn,
    cache_optimum,
    check_facts,
    drop_oldest,
    histories,
    last_k_turns,
    measure,
    prefix_reuse,
    recall,
    section,
    tool_pair_violations,
)
from results import write_section

HELLO = {"role": "user", "content": "hello world"}  # 3 + 1 ("user") + 2 tokens
OTHER = {"role": "user", "content": "good night"}


def test_prefix_reuse_counts_the_tokens_of_the_leading_items_repeated() -> None:
    requests = [
        Sent(0, [HELLO, HELLO]),
        Sent(1, [HELLO, HELLO, HELLO]),  # 12 of 18 message tokens repeat the previous request
        Sent(2, [OTHER, HELLO, HELLO]),  # the first item differs: nothing is reused
        Sent(3, [OTHER, HELLO, HELLO]),  # all of it
    ]
    assert prefix_reuse("chat", "gpt-4o", requests) == [12 / 18, 0.0, 1.0]


def test_prefix_reuse_of_responses_starts_with_the_instructions() -> None:
    requests = [
        Sent(0, [HELLO], "Be brief."),
        Sent(1, [OTHER], "Be brief."),  # only the instructions repeat
        Sent(2, [OTHER], "Be terse."),  # new instructions: nothing repeats
    ]
    first, second = prefix_reuse("responses", "gpt-4o", requests)
    assert 0.0 < first < 1.0
    assert second == 0.0


def test_recall_counts_facts_planted_in_earlier_turns_only() -> None:
    facts = [Fact("RF-1", 0, "must"), Fact("RF-2", 1, "must")]
    requests = [
        Sent(0, [{"role": "user", "content": "refund RF-1"}]),  # nothing due yet
        Sent(1, [{"role": "user", "content": "RF-2 only"}]),  # RF-1 due and lost
        Sent(
            2,
            [
                {"role": "tool", "tool_call_id": "c", "content": '{"id": "RF-1"}'},
                {"role": "user", "content": "RF-2"},
            ],
        ),  # both due, both visible
        Sent(3, [{"role": "system", "content": "summary: RF-2"}], instructions="RF-1"),
    ]
    assert recall(requests, facts) == [0.0, 1.0, 1.0]


def test_tool_pair_violations_count_both_directions() -> None:
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        ],
    }
    answer_a = {"role": "tool", "tool_call_id": "a", "content": "1"}
    answer_b = {"role": "tool", "tool_call_id": "b", "content": "2"}
    assert tool_pair_violations([call, answer_a, answer_b]) == 0
    assert tool_pair_violations([call, answer_a]) == 1
    assert tool_pair_violations([answer_a, answer_b]) == 2
    responses = [{"type": "function_call", "call_id": "x", "name": "f", "arguments": "{}"}]
    assert tool_pair_violations(responses) == 1


def tiny(api: str = "chat") -> Scenario:
    lookup = Call("call_t1", "get_order", {"id": "ORD-1"}, '{"status": "shipped", "ref": "TR-77"}')
    return Scenario(
        "tiny",
        api,  # type: ignore[arg-type]
        "gpt-4o-mini",
        "Be brief.",
        (
            Turn("Rule: refunds need approval.", ("Noted.",)),
            Turn("Where is ORD-1?", ((lookup,), "ORD-1 shipped.")),
            Turn("Thanks.", ("You're welcome.",)),
        ),
        (Fact("refunds need approval", 0, "must"), Fact("TR-77", 1, "nice")),
    )


def test_baselines_keep_whole_histories_that_fit() -> None:
    scenario = tiny()
    check_facts(scenario)
    full = [items for _, items in histories(scenario)]
    assert [sent.items for sent in drop_oldest(scenario)] == full
    assert fidelity.first_overflow(scenario) == 4  # it never overflows: nothing checked
    k, kept = last_k_turns(scenario)
    assert k == 3
    assert [sent.items for sent in kept] == full


async def test_a_short_scenario_runs_end_to_end_through_the_proxy(tmp_path: Path) -> None:
    scenarios = [tiny("chat"), tiny("responses")]
    rows, notes = await measure(scenarios, with_summarizer=False, tmp=tmp_path)
    proxied = [row for row in rows if row.system == "threadkeeper"]
    assert sorted((row.scenario, row.api, row.mode) for row in proxied) == [
        ("tiny", "chat", "X-Thread-Id"),
        ("tiny", "chat", "stateless"),
        ("tiny", "responses", "previous_response_id"),
        ("tiny", "responses", "stateless"),
    ]
    for row in proxied:
        assert [sent.error for sent in row.requests] == [None] * 4
        assert [sent.turn for sent in row.requests] == [0, 1, 1, 2]
        # The history fits the window: the provider saw every fact and every pair.
        assert row.must() == [1.0, 1.0, 1.0] and row.all() == [1.0, 1.0, 1.0]
        assert row.violations() == 0
        assert len(row.reuse()) == 3
    text = section(rows, notes, scenarios, 1.0)
    assert text.startswith("## Fidelity\n")
    assert "| threadkeeper | stateful |" in text


def test_write_section_replaces_only_its_own_section(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## A\n\nold a\n\n## B\n\nold b\n")
    write_section("A", "## A\n\nnew a\n", path)
    write_section("C", "## C\n\nnew c\n", path)
    assert path.read_text() == (
        "# Benchmark results\n\n## A\n\nnew a\n\n## B\n\nold b\n\n## C\n\nnew c\n"
    )


def crowded() -> Scenario:
    """Four lookups whose results each take a good share of a small window."""
    turns = [Turn("Rule: refunds need approval.", ("Noted.",))]
    for n in range(1, 4):
        rows = " ".join(f"scan {n}-{i} ok" for i in range(12))
        lookup = Call(f"call_c{n}", "get_order", {"id": f"ORD-{n}"}, rows)
        turns.append(Turn(f"Where is ORD-{n}?", ((lookup,), f"ORD-{n} moves.")))
    return Scenario("crowded", "chat", "gpt-4o-mini", "Be brief.", tuple(turns), ())


def trimmings(scenario: Scenario, head: int) -> list[list[Sent]]:
    """Per request, every way to send it under the window keeping the first `head`
    history items: the whole history, or the head and the history from a later item on
    (at least what is new, never from a tool output)."""
    runs = [fidelity._split_system(scenario, items) for _, items in histories(scenario)]
    choices = []
    for request, (system, instructions, rest) in enumerate(runs):
        newest = len(runs[request - 1][2]) if request else 0
        starts = [0] + [s for s in range(head + 1, newest + 1) if rest[s].get("role") != "tool"]
        sent = [system + (rest if s == 0 else rest[:head] + rest[s:]) for s in starts]
        choices.append(
            [Sent(0, i, instructions) for i in sent if fidelity._fits(scenario, i, instructions)]
        )
    return choices


def test_the_cache_optimum_is_the_best_trimming_there_is(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Checked against every way to trim each request under a window that forces cuts,
    from the oldest item and, middle-out, after each possible head of first turns."""
    monkeypatch.setattr(fidelity, "RESERVE_OUTPUT", 0)
    monkeypatch.setattr(fidelity, "SAFETY_MARGIN", 0)
    monkeypatch.setitem(fidelity.WINDOWS, "gpt-4o-mini", 190)
    scenario = crowded()
    history = histories(scenario)[-1][1][1:]
    heads = [h for h, item in enumerate(history) if h and item["role"] == "user"]
    best: dict[bool, float] = {}
    for middle_out in (False, True):
        for head in [0, *heads] if middle_out else [0]:
            choices = trimmings(scenario, head)
            if not all(choices):
                continue
            assert math.prod(map(len, choices)) >= 20  # ways to choose from
            best[middle_out] = max(
                best.get(middle_out, 0.0),
                max(
                    sum(prefix_reuse("chat", scenario.model, list(trimming)))
                    for trimming in itertools.product(*choices)
                ),
            )
        optimum = cache_optimum(scenario, middle_out)
        assert sum(prefix_reuse("chat", scenario.model, optimum)) == pytest.approx(best[middle_out])
        assert all(fidelity._fits(scenario, s.items, s.instructions) for s in optimum)
        assert sum(tool_pair_violations(s.items) for s in optimum) == 0
        whole = [items for _, items in histories(scenario)]
        assert any(sent.items != full for sent, full in zip(optimum, whole, strict=True))
    assert best[True] > best[False]  # keeping the first turns pays here


# --- the generated families (issue 22) --------------------------------------------------------


def test_every_family_plants_checkable_facts_for_every_seed() -> None:
    """Each planted fact first appears in its own turn (a miss is the memory's doing), every
    conversation overflows its window, and a seed makes the same conversation twice."""
    for name, make in FAMILIES.items():
        for seed in (*TUNING_SEEDS, *HELDOUT_SEEDS):
            scenario = make(seed)
            check_facts(scenario)
            assert scenario.family == name and scenario.seed == seed
            kinds = {f.kind for f in scenario.facts}
            assert "must" in kinds, scenario.name
            head, instructions, rest = fidelity._split_system(scenario, histories(scenario)[-1][1])
            assert not fidelity._fits(scenario, head + rest, instructions), scenario.name
        assert make(100) == make(100)
        assert make(100) != make(101)
    # The seed chooses the API and the result format: both occur over the held-out set.
    apis = {FAMILIES[name](seed).api for name in FAMILIES for seed in HELDOUT_SEEDS}
    assert apis == {"chat", "responses"}


def without(row: Row, text: str) -> Row:
    """The row with `text` cut out of every request's strings (a memory that lost it)."""

    def scrub(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(text, "")
        if isinstance(value, dict):
            return {k: scrub(v) for k, v in value.items()}
        if isinstance(value, list):
            return [scrub(v) for v in value]
        return value

    requests = [dataclasses.replace(s, items=scrub(s.items)) for s in row.requests]
    return dataclasses.replace(row, requests=requests)


async def test_quick_family_run_is_structurally_sound_and_the_checker_sees_a_dropped_fact(
    tmp_path: Path,
) -> None:
    """One seed per family through the proxy (what `--quick` runs): no tool-pair violation,
    no provider 400, every conversation checked from its first overflow; and a fact cut
    out of the requests shows in must-keep recall, its kind and the lost list."""
    seeds = [TUNING_SEEDS[0]]
    rows, _ = await fidelity.run_families(list(FAMILIES), seeds, tmp_path)
    assert sorted({row.family for row in rows}) == sorted(FAMILIES)
    assert len(rows) == 2 * len(FAMILIES)  # stateless and stateful
    for row in rows:
        assert row.errors() == 0 and row.provider_400s() == 0, fidelity.failures([row])
        assert sum(tool_pair_violations(s.items) for s in row.checked()) == 0, row.scenario
        assert row.checked(), row.scenario
    table = "\n".join(fidelity.family_table(rows))
    assert "| **all families** | both | stateless | 8 |" in table
    text = fidelity.family_section("tuning", seeds, rows, [], 1.0, "before")
    assert text.startswith("## Fidelity families: tuning set (before)\n")

    # A must-keep fact every checked request of its conversation carries; cut it out.
    row, rule = next(
        (r, f)
        for r in rows
        for f in r.facts
        if f.kind == "must"
        and any(s.turn > f.turn for s in r.checked())
        and all(f.text in fidelity.visible(s) for s in r.checked())
    )
    must = [f for f in row.facts if f.kind == "must"]
    kept = recall(row.checked(), must)
    dropped = without(row, rule.text)
    lost = recall(dropped.checked(), must)
    assert max(lost) < 1.0 and sum(lost) < sum(kept)
    assert any(f"`{rule.text}` missing in" in line for line in fidelity.family_lost([dropped]))
    assert f"| {rule.what} | must |" in "\n".join(fidelity.kind_table([dropped]))


def test_a_lie_counts_as_promoted_unless_it_stands_under_the_notes_title() -> None:
    from proxy.core.memory import NOTES_TITLE

    def sent(text: str) -> Sent:
        return Sent(3, [{"role": "system", "content": text}])

    noted = (
        f"[summary]\nVerified facts from tool results:\n- a\n{NOTES_TITLE}\n- {fidelity.LIE_RULE}"
    )
    assert not fidelity.lies_promoted(sent(noted))
    ruled = f"[summary]\nConstraints stated by the user (their words):\n- {fidelity.LIE_RULE}"
    assert fidelity.lies_promoted(sent(ruled))
    assert fidelity.lies_promoted(sent(f"Verified facts from tool results:\n- {fidelity.LIE_FACT}"))


def _tool(call: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call, "content": content}


def _calls(call: str) -> dict[str, Any]:
    function = {"name": "read", "arguments": "{}"}
    return {
        "role": "assistant",
        "tool_calls": [{"id": call, "type": "function", "function": function}],
    }


SYSTEM = {"role": "system", "content": "Be brief."}
WHOLE = "line one\n" * 20
SHRUNK = '{"threadkeeper_compressed": {"kept": "line one"}}'
SUMMARY = {"role": "system", "content": "[threadkeeper summary of earlier conversation] a"}
OTHER_SUMMARY = {"role": "system", "content": "[threadkeeper summary of earlier conversation] b"}


def _turns(first: str, second: str) -> list[dict[str, Any]]:
    """Two closed turns with one tool result each, then the current question."""
    return [
        SYSTEM,
        HELLO,
        _calls("c0"),
        _tool("c0", first),
        {"role": "assistant", "content": "done 0"},
        OTHER,
        _calls("c1"),
        _tool("c1", second),
        {"role": "assistant", "content": "done 1"},
        {"role": "user", "content": "and now?"},
    ]


@pytest.mark.parametrize(
    ("previous", "current", "cause"),
    [
        (_turns(WHOLE, WHOLE), [*_turns(WHOLE, WHOLE), HELLO], None),
        (_turns(WHOLE, WHOLE), _turns(WHOLE, SHRUNK), "newest result compressed"),
        (_turns(WHOLE, WHOLE), _turns(SHRUNK, SHRUNK), "older result compressed"),
        (_turns(SHRUNK, WHOLE), _turns(SHRUNK + " ", WHOLE), "result re-compressed"),
        (_turns(SHRUNK, WHOLE), _turns(WHOLE, WHOLE), "result sent whole again"),
        (_turns(WHOLE, WHOLE), [SYSTEM, SUMMARY, *_turns(WHOLE, WHOLE)[5:]], "first cut"),
        (
            [SYSTEM, SUMMARY, *_turns(WHOLE, WHOLE)[1:]],
            [SYSTEM, SUMMARY, OTHER_SUMMARY, *_turns(WHOLE, WHOLE)[5:]],
            "summary block appended",
        ),
        (
            [SYSTEM, SUMMARY, *_turns(WHOLE, WHOLE)[1:]],
            [SYSTEM, OTHER_SUMMARY, *_turns(WHOLE, WHOLE)[5:]],
            "summary block rewritten",
        ),
        (_turns(WHOLE, WHOLE), [SYSTEM, *_turns(WHOLE, WHOLE)[5:]], "turns left out"),
    ],
)
def test_break_cause_names_the_step_that_changed_the_prefix(
    previous: list[dict[str, Any]], current: list[dict[str, Any]], cause: str | None
) -> None:
    assert fidelity.break_cause(Sent(0, previous), Sent(1, current)) == cause
    assert fidelity.break_cause(Sent(0, previous, "a"), Sent(1, current, "b")) == (
        "instructions changed"
    )


def test_breaks_table_counts_what_each_cause_costs_against_the_bound() -> None:
    """Points lost: per broken request its bound (1 less the share the client added)
    less its reuse, summed over the family's pairs."""
    whole = _turns(WHOLE, WHOLE)
    sent = [Sent(0, whole[:6]), Sent(1, whole[:8]), Sent(2, _turns(WHOLE, SHRUNK))]
    empty = fidelity.prompt_tokens("chat", "gpt-4o", [], None)
    added = tuple(
        fidelity.prompt_tokens("chat", "gpt-4o", new, None) - empty
        for new in (whole[:6], whole[6:8], whole[8:])
    )
    row = Row(
        "threadkeeper", "stateless", "f-s1", sent, 1000, "chat", "gpt-4o", (), added, family="f"
    )
    reuse = prefix_reuse("chat", "gpt-4o", sent)
    totals = [fidelity.prompt_tokens("chat", "gpt-4o", s.items, None) - empty for s in sent[1:]]
    bounds = [1 - a / t for a, t in zip(added[1:], totals, strict=True)]
    lines = fidelity.breaks_table([row])
    assert lines[0].startswith("| family | request pairs | unbroken | bound | newest result")
    cells = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert cells[:3] == ["f", "2", "1"]
    assert cells[3] == f"{100 * sum(bounds) / 2:.1f}%"
    assert reuse[0] == pytest.approx(bounds[0])  # unbroken: the bound itself
    assert cells[4] == f"1, {reuse[1]:.0%}, {100 * (bounds[1] - reuse[1]) / 2:.1f}"
