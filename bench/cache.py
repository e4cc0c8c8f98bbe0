"""Prompt-cache friendliness of sticky cuts (SPEC section 5, "Cache-aware trimming").

    python bench/cache.py [--turns 120] [--write]

Drives one long agent conversation through the projection turn by turn and measures,
for every request, the share of its input tokens that repeat the previous request's
prefix (what a provider's prompt cache can reuse). Compared: the sticky cut (cut down
to target_fill of the budget and keep the cut), a stateless client's requests (no cut
carried over: the cut replayed from the history, summary blocks appended) and trimming
the minimum every turn (target_fill 1.0, no cut carried over). With --write, replaces the
"## Prompt cache" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from results import write_section

from proxy.core.items import Item, chat_item
from proxy.core.projection import CutPoint, ProjectionPolicy, ProjectionRequest, project_context
from proxy.core.tokens import TokenCounter

WINDOW, OUTPUT, MARGIN = 16000, 2000, 500


def turn_messages(turn: int) -> list[dict[str, Any]]:
    call_id = f"call_{turn}"
    return [
        {"role": "user", "content": f"Turn {turn}: check order ORD-{turn} and tell me its status."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_order", "arguments": json.dumps({"id": turn})},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call_id,
            "content": json.dumps(
                {"id": turn, "status": "shipped", "log": [f"scan {i}" for i in range(30)]}
            ),
        },
        {"role": "assistant", "content": f"Order ORD-{turn} has shipped."},
    ]


def shared_prefix_tokens(previous: list[Item], current: list[Item], counter: TokenCounter) -> int:
    shared = 0
    for a, b in zip(previous, current, strict=False):
        if a.raw != b.raw:
            break
        shared += counter.item(b)
    return shared


def run(turns: int, sticky: bool, stateless: bool = False) -> list[float]:
    """Prefix reuse per request; `stateless`: no cut is carried over and the requests are
    projected as a stateless client's (the cut replayed from the history)."""
    counter = TokenCounter.for_model("gpt-4o")
    if sticky or stateless:
        policy = ProjectionPolicy(keep_recent_turns=2, target_fill=0.65)
    else:  # the minimum every time, and no opening head kept
        policy = ProjectionPolicy(keep_recent_turns=2, target_fill=1.0, keep_opening_share=0)
    history: list[Item] = [chat_item({"role": "system", "content": "You are an order assistant."})]
    cut: CutPoint | None = None
    previous: list[Item] = []
    shares: list[float] = []
    for turn in range(turns):
        question, call, result, answer = (chat_item(m) for m in turn_messages(turn))
        # A client's two requests of the turn: the question, then the tool result.
        for asked in ([question], [call, result]):
            history.extend(asked)
            request = ProjectionRequest(
                items=list(history),
                window=WINDOW,
                output=OUTPUT,
                epsilon=MARGIN,
                cut=cut if sticky else None,
                stateless=stateless,
            )
            projection = project_context(request, counter, policy)
            cut = projection.cut
            sent = list(projection.items)
            total = counter.items(sent)
            if previous:
                shares.append(shared_prefix_tokens(previous, sent, counter) / total)
            previous = sent
        history.append(answer)
    return shares


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=120)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    sticky, minimal = run(args.turns, True), run(args.turns, False)
    stateless = run(args.turns, False, stateless=True)
    section = "\n".join(
        [
            "## Prompt cache",
            "",
            f"`python bench/cache.py --write`: one agent conversation of {args.turns} turns "
            f"(4 items each: question, tool call, tool result, answer) under a {WINDOW}-token "
            "window, two requests a turn (the question, then the tool result). Per request: "
            "the share of its input tokens equal to the previous request's prefix (reusable "
            "by the provider's prompt cache). Trimming the minimum keeps no opening head.",
            "",
            "| strategy | mean prefix reuse | median | requests with < 50% reuse |",
            "|---|---:|---:|---:|",
            _row("sticky cut to 65% of the budget (threadkeeper)", sticky),
            _row(
                "stateless client: cut replayed, summary blocks appended (threadkeeper)", stateless
            ),
            _row("trim the minimum every turn", minimal),
            "",
        ]
    )
    print(section)
    if args.write:
        write_section("Prompt cache", section)


def _row(name: str, shares: list[float]) -> str:
    low = sum(1 for s in shares if s < 0.5)
    return (
        f"| {name} | {statistics.mean(shares):.1%} | {statistics.median(shares):.1%} | "
        f"{low} of {len(shares)} |"
    )


if __name__ == "__main__":
    main()
