"""Cache-aware trimming (SPEC section 5): sticky cuts repeat the previous prefix, and so
do a stateless client's requests (cuts at whole chunks of the history); the summary
blocks form a chain that each cut extends (issue 10)."""

from __future__ import annotations

import statistics
import sys
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from cache import MARGIN, OUTPUT, WINDOW, run, turn_messages

from proxy.core.items import Item, chat_item
from proxy.core.memory import SUMMARY_MARKER, is_summary
from proxy.core.projection import CutPoint, ProjectionPolicy, ProjectionRequest, project_context
from proxy.core.tokens import TokenCounter

POLICY = ProjectionPolicy(keep_recent_turns=2, target_fill=0.65)


def test_sticky_cuts_keep_most_of_the_previous_prefix() -> None:
    sticky, minimal = run(120, sticky=True), run(120, sticky=False)
    assert statistics.mean(sticky) > 0.85
    assert statistics.mean(sticky) > statistics.mean(minimal) + 0.2


def test_stateless_requests_keep_most_of_the_previous_prefix() -> None:
    stateless, minimal = run(120, sticky=False, stateless=True), run(120, sticky=False)
    assert statistics.mean(stateless) > 0.85
    assert statistics.mean(stateless) > statistics.mean(minimal) + 0.2


def stands_for(block: Item) -> int:
    header = block.text().removeprefix(SUMMARY_MARKER + " Stands for ")
    return int(header.split(" ", 1)[0])


def chains(turns: int, stateless: bool) -> list[tuple[Item, ...]]:
    """The summary blocks of each request of one long conversation (a stateful thread
    passes its cut on; a stateless client does not), checking on the way that the two
    recent turns and the current one are sent verbatim (they always fit here)."""
    counter = TokenCounter.for_model("gpt-4o")
    history: list[Item] = [chat_item({"role": "system", "content": "You are an order assistant."})]
    cut: CutPoint | None = None
    sent_chains = []
    for turn in range(turns):
        # A request ends with the user's message, as a client's does (the answer follows).
        user, *answer = (chat_item(m) for m in turn_messages(turn))
        history.append(user)
        request = ProjectionRequest(
            history, WINDOW, OUTPUT, MARGIN, cut=None if stateless else cut, stateless=stateless
        )
        projection = project_context(request, counter, POLICY)
        cut = projection.cut
        recent = history[-9:]  # two closed turns of 4 items and the current message
        assert [i.raw for i in projection.items[-9:]] == [i.raw for i in recent]
        assert projection.report.dropped == 0
        sent_chains.append(tuple(i for i in projection.items if is_summary(i)))
        history.extend(answer)
    return sent_chains


def test_each_cut_extends_the_summary_chain_except_at_a_consolidation() -> None:
    """Across many cuts, each request's summary blocks are the previous request's blocks,
    byte for byte, with new ones after them; only a consolidation rewrites the chain from
    its first block, and it then stands for more than its first block did."""
    for stateless in (False, True):
        requests = chains(300, stateless)
        extended = consolidated = 0
        for before, after in pairwise(requests):
            if after == before:
                continue
            if after[: len(before)] == before:
                extended += 1
                continue
            consolidated += 1
            assert stands_for(after[0]) > stands_for(before[0])
            assert sum(map(stands_for, after)) > sum(map(stands_for, before))
        assert extended >= 5, stateless
        assert 1 <= consolidated <= extended, stateless


def big_turn(turn: int) -> list[Item]:
    """A turn of about a quarter of the history budget below (2,200 tokens)."""
    rows = " ".join(f"row{turn}-{i} fare {i % 7} seat {i % 31}" for i in range(220))
    return [
        chat_item({"role": "user", "content": f"Search day trip {turn}."}),
        chat_item(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{turn}",
                        "type": "function",
                        "function": {"name": "search", "arguments": "{}"},
                    }
                ],
            }
        ),
        chat_item({"role": "tool", "tool_call_id": f"call_{turn}", "content": rows}),
        chat_item({"role": "assistant", "content": f"Trip {turn}: trains hourly."}),
    ]


def test_a_cut_leaves_room_for_more_turns_the_size_of_the_recent_ones() -> None:
    """Turns of a quarter of the budget: a cut to target_fill left room for one more, so
    every second turn cut again and changed the prefix after the summary chain (travel in
    bench/fidelity.py: a cut every turn). A cut now leaves room for two more such turns,
    and compressing their tool results (SPEC 5 step 1) defers the next cut further; a
    compression changes the prefix only from the tool results it compresses on."""
    counter = TokenCounter.for_model("gpt-4o")
    policy = ProjectionPolicy(keep_recent_turns=1, target_fill=0.65)
    history: list[Item] = [chat_item({"role": "system", "content": "You plan trips."})]
    cut: CutPoint | None = None
    sent: list[list[dict[str, object]]] = []
    for turn in range(40):
        history.extend(big_turn(turn))
        request = ProjectionRequest(history, 12_000, 1000, 200, cut=cut)
        projection = project_context(request, counter, policy)
        cut = projection.cut
        sent.append([i.raw for i in projection.items])
    chains = [[m for m in items if is_summary(chat_item(m))] for items in sent]
    cuts = [n for n, (a, b) in enumerate(pairwise(chains), 1) if b != a]
    assert len(cuts) >= 4  # the thread outgrew its window again and again
    # Later the summary chain, growing with every cut until it is consolidated, takes
    # some of that room.
    assert all(later - earlier >= 3 for earlier, later in pairwise(cuts[:5])), cuts
    for n, (before, after) in enumerate(pairwise(sent), 1):
        if n in cuts or after[: len(before)] == before:
            continue
        changed = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
        assert "threadkeeper_compressed" in str(after[changed]["content"])
