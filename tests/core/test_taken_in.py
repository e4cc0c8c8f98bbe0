"""A value a later turn names, in the summary (issue 22, item 3): a summary block written
before anybody named a value of its items could not know it; when a later turn names it
(by value, or by describing its line) and the summary region lacks it, the fact holding
it is taken in (memory.taken_in), as one small block after the chain (projection
`_take_in`), so the prefix before it repeats byte for byte."""

from __future__ import annotations

from dataclasses import replace

import pytest

from proxy.core.items import Item, chat_item
from proxy.core.memory import extract, is_summary, may_take_in, render, taken_in
from proxy.core.projection import (
    CutPoint,
    Projection,
    ProjectionPolicy,
    ProjectionRequest,
    project_context,
)
from proxy.core.tokens import TokenCounter
from tests.core.test_salience import RAISE, call, manifest

LIMIT = "memory: 320Mi"


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.for_model("gpt-4o")


def manifest_turn() -> list[Item]:
    return [
        chat_item({"role": "user", "content": "Show me the ledger deployment."}),
        call("c0", "kubectl", {"args": "get deploy ledger -o yaml"}),
        chat_item({"role": "tool", "tool_call_id": "c0", "content": manifest()}),
        chat_item({"role": "assistant", "content": "The deployment runs one container."}),
    ]


def written(items: list[Item], counter: TokenCounter) -> str:
    return render(extract(items), counter, 400)


def test_a_later_description_takes_in_the_line_the_block_lacks(counter: TokenCounter) -> None:
    """Summarized before the user said "the memory limit we saw", the block keeps the
    first `memory:` line (128Mi, the request); the later turn takes in the limit."""
    sources = manifest_turn()
    block = written(sources, counter)
    assert LIMIT not in block
    later = [chat_item({"role": "user", "content": RAISE})]
    [fact] = taken_in(sources, later, block)
    assert fact.startswith("kubectl(args=get deploy ledger -o yaml) -> ") and LIMIT in fact


def test_a_value_named_later_is_taken_in_by_value(counter: TokenCounter) -> None:
    """Named by its value (a code span), not described: the same rule."""
    sources = manifest_turn()
    later = [chat_item({"role": "user", "content": "Why is `CACHE_TTL_17` set at all?"})]
    [fact] = taken_in(sources, later, written(sources, counter))
    assert "CACHE_TTL_17" in fact


def test_nothing_is_taken_in_that_the_summary_holds_or_nobody_names(
    counter: TokenCounter,
) -> None:
    sources = manifest_turn()
    block = written(sources, counter)
    quiet = [chat_item({"role": "user", "content": "Thanks, and the weather?"})]
    assert taken_in(sources, quiet, block) == ()
    named = [chat_item({"role": "user", "content": RAISE})]
    assert taken_in(sources, named, f"{block}\n- ... {LIMIT}") == ()


def test_a_value_the_result_does_not_hold_is_not_taken_in(counter: TokenCounter) -> None:
    sources = manifest_turn()
    later = [chat_item({"role": "user", "content": "Is `retry_budget_ms` configured?"})]
    assert taken_in(sources, later, written(sources, counter)) == ()


def pod_turn(n: int) -> list[Item]:
    events = "\n".join(
        f"Event {i} pod ledger-{n}: Normal Pulled image ok node-{i % 3}" for i in range(60)
    )
    return [
        chat_item({"role": "user", "content": f"Step {n}: check pod {n}."}),
        call(f"c{n}", "kubectl", {"args": f"describe pod ledger-{n}"}),
        chat_item({"role": "tool", "tool_call_id": f"c{n}", "content": events}),
        chat_item({"role": "assistant", "content": f"Pod {n} is healthy."}),
    ]


def history() -> list[Item]:
    items = [chat_item({"role": "system", "content": "You are an infra agent."})]
    items += manifest_turn()
    for n in range(1, 7):
        items += pod_turn(n)
    return [*items, chat_item({"role": "user", "content": RAISE})]


def sent(items: list[Item], counter: TokenCounter) -> tuple[Item, ...]:
    policy = ProjectionPolicy(keep_recent_turns=2, tool_result_max_tokens=300)
    request = ProjectionRequest(items, window=2500, output=300, epsilon=50, stateless=True)
    return project_context(request, counter, policy).items


def test_the_request_after_the_naming_turn_carries_the_line_after_the_chain(
    counter: TokenCounter,
) -> None:
    """The manifest turn is summarized before the user names its limit; the request that
    names it carries the line, in a block after the chain, and everything before that
    block is the request before's, byte for byte."""
    items = history()
    before, after = sent(items[:-1], counter), sent(items, counter)
    text = "\n".join(str(item.raw.get("content")) for item in after)
    assert LIMIT not in "\n".join(str(item.raw.get("content")) for item in before)
    assert LIMIT in text
    [at] = [n for n, item in enumerate(after) if is_summary(item) and LIMIT in item.text()]
    assert "Stands for 0 earlier items" in after[at].text()
    assert [i.raw for i in after[:at]] == [i.raw for i in before[:at]]
    assert not is_summary(after[at + 1])  # last of the summary region


def test_a_turn_that_names_nothing_new_adds_no_block(counter: TokenCounter) -> None:
    items = history()
    items[-1] = chat_item({"role": "user", "content": "Step 7: any pod restarts?"})
    assert not any("Stands for 0 earlier items" in i.text() for i in sent(items, counter))


def stored(
    items: list[Item], cut: CutPoint, sources: list[Item], counter: TokenCounter
) -> Projection:
    """A stored thread's request: its window from the cut on, the chain's items given
    as the store holds them (`chain_sources`)."""
    policy = ProjectionPolicy(keep_recent_turns=2, tool_result_max_tokens=300)
    request = ProjectionRequest(
        items[cut.start :],
        window=2500,
        output=300,
        epsilon=50,
        first_position=cut.start,
        cut=cut,
        chain_sources=sources,
    )
    return project_context(request, counter, policy)


def test_a_stored_thread_takes_in_from_the_chain_items_the_store_gives(
    counter: TokenCounter,
) -> None:
    """The window starts at the cut, so the request holds none of the chain's items: with
    them given (`chain_sources`) the value is taken in, the block is kept in the cut,
    and the next turn, naming nothing new, sends it again as it was."""
    items = history()
    policy = ProjectionPolicy(keep_recent_turns=2, tool_result_max_tokens=300)
    first = ProjectionRequest(items[:-1], window=2500, output=300, epsilon=50, stateless=True)
    cut = project_context(first, counter, policy).cut
    assert cut is not None and cut.chain and not cut.opening
    sources = [item for item in items[1 : cut.start] if not item.is_instruction]
    alone = stored(items, cut, [], counter)
    assert LIMIT not in "\n".join(i.text() for i in alone.items if is_summary(i))
    taken = stored(items, cut, sources, counter)
    [block] = [i for i in taken.items if is_summary(i) and LIMIT in i.text()]
    assert taken.cut is not None and block in taken.cut.summary
    items.append(chat_item({"role": "assistant", "content": "Raised to 640Mi."}))
    items.append(chat_item({"role": "user", "content": "Thanks."}))
    again = stored(items, taken.cut, sources, counter)
    blocks = [i for i in again.items if is_summary(i) and "Stands for 0 earlier" in i.text()]
    assert [b.raw for b in blocks] == [block.raw]


def test_the_request_that_cuts_the_manifest_turn_takes_its_limit_in(
    counter: TokenCounter,
) -> None:
    """The request naming the limit is the one that cuts the manifest turn: the block made
    for that turn knows nothing of the current turn, so the take-in is made again after
    the cut, over the turns it summarizes now."""
    items = [*history()[: 5 + 4 * 3], chat_item({"role": "user", "content": RAISE})]
    policy = ProjectionPolicy(keep_recent_turns=2, tool_result_max_tokens=300)

    def sent_at(end: int) -> str:
        request = ProjectionRequest(items[:end], window=1400, output=300, epsilon=50)
        projection = project_context(replace(request, stateless=True), counter, policy)
        return "\n".join(str(item.raw.get("content")) for item in projection.items)

    assert "kubectl(args=get deploy" not in sent_at(len(items) - 4)  # the turn before
    after = sent_at(len(items))
    assert "kubectl(args=get deploy" in after and LIMIT in after


def test_a_take_in_is_possible_only_after_a_fresh_naming_or_statement() -> None:
    """may_take_in: a fresh item naming a value the region lacks, or a fresh statement
    among the first DESCRIBED_MESSAGES after the region's items; else their reading can
    be spared (a stored thread's, in the store)."""
    named = [chat_item({"role": "user", "content": "Why is `CACHE_TTL_17` set?"})]
    assert may_take_in([], named, "nothing of it")
    assert not may_take_in(
        [], [chat_item({"role": "tool", "tool_call_id": "c", "content": "x"})], ""
    )
    said = [chat_item({"role": "user", "content": "Thanks, and the weather?"})]
    assert may_take_in([], said, "")
    long_ago = [chat_item({"role": "user", "content": f"Turn {n}."}) for n in range(24)]
    assert not may_take_in(long_ago, said, "")
    assert not may_take_in(long_ago, named, "... `CACHE_TTL_17` ...")
    assert may_take_in(long_ago, named, "")
