"""How projection cost scales with thread length (SPEC section 5, "Performance").

A store passes only the live window (the items from the sticky cut on) plus the
CutPoint, so projecting a 10,000-item thread should cost about what a 100-item thread
costs. Histories of 100, 1,000 and 10,000 items are timed with a live window of about
200 items; the full history without a cut is timed for information. The token cache is
warmed by one projection of each case before timing (a store keeps counts with items).

    python bench/projection.py [--write]    # prints a table; --write replaces
                                            # "## Projection" in bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

from results import write_section

from proxy.core.items import Item, chat_item
from proxy.core.memory import summarize_turns
from proxy.core.projection import (
    CutPoint,
    ProjectionPolicy,
    ProjectionRequest,
    project_context,
)
from proxy.core.tokens import TokenCounter

SIZES = (100, 1_000, 10_000)
LIVE_WINDOW = 200
WINDOW = 128_000
OUTPUT, EPSILON = 2_000, 500
REPEATS = 101
FULL_REPEATS = 7
POLICY = ProjectionPolicy()


def thread(size: int) -> list[Item]:
    """A system prompt, then turns of user / tool call / tool result / answer."""
    items = [chat_item({"role": "system", "content": "You are a support agent. Use CNY."})]
    n = 0
    while len(items) < size - 1:
        function = {"name": "lookup_order", "arguments": json.dumps({"order": n})}
        result = {"status": "shipped", "order": n, "lines": [f"sku-{i}" for i in range(30)]}
        items += [
            chat_item({"role": "user", "content": f"Where is order {n}? Answer in CNY."}),
            chat_item(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": f"call_{n}", "type": "function", "function": function}],
                }
            ),
            chat_item({"role": "tool", "tool_call_id": f"call_{n}", "content": json.dumps(result)}),
            chat_item({"role": "assistant", "content": f"Order {n} has shipped."}),
        ]
        n += 1
    items = items[: size - 1]
    return [*items, chat_item({"role": "user", "content": "And the newest order?"})]


def live_window_request(
    items: list[Item], counter: TokenCounter, live: int = LIVE_WINDOW
) -> ProjectionRequest:
    """What a store sends: the items from the cut on, and the cut kept from earlier."""
    start = max(1, len(items) - live)
    while start > 1 and not items[start].is_user_message:
        start -= 1
    if start == 1:
        return ProjectionRequest(items, WINDOW, OUTPUT, EPSILON)
    digest = summarize_turns(items[1:start], counter, 1000, None)
    cut = CutPoint(start=start, summary=(items[0], digest))
    return ProjectionRequest(items[start:], WINDOW, OUTPUT, EPSILON, first_position=start, cut=cut)


def full_history_request(items: list[Item]) -> ProjectionRequest:
    # A window the whole history does not fit, so the projection must cut.
    return ProjectionRequest(items, min(WINDOW, 40_000), OUTPUT, EPSILON)


def interleaved_medians(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms per case, the cases timed round-robin so machine load hits them alike."""
    for run in runs.values():
        run()  # warm-up: token counts cached, as a store keeps them with its items
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - began) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def measure() -> dict[int, dict[str, float]]:
    counter = TokenCounter.for_model("gpt-4o")
    live: dict[str, Callable[[], object]] = {}
    full: dict[str, Callable[[], object]] = {}
    sizes: dict[int, float] = {}
    for size in SIZES:
        items = thread(size)
        request = live_window_request(items, counter)
        sizes[size] = float(len(request.items))
        live[str(size)] = partial(project_context, request, counter, POLICY)
        full[str(size)] = partial(project_context, full_history_request(items), counter, POLICY)
    # The largest thread again with a window as small as the smallest thread, for a
    # ratio between equal windows.
    small_window = live_window_request(thread(SIZES[-1]), counter, SIZES[0])
    live["equal"] = partial(project_context, small_window, counter, POLICY)
    live_ms = interleaved_medians(live, REPEATS)
    full_ms = interleaved_medians(full, FULL_REPEATS)
    results = {
        size: {
            "live_items": sizes[size],
            "live_ms": live_ms[str(size)],
            "full_ms": full_ms[str(size)],
        }
        for size in SIZES
    }
    results[0] = {"live_items": float(len(small_window.items)), "live_ms": live_ms["equal"]}
    return results


def section(results: dict[int, dict[str, float]]) -> str:
    small, middle, large, equal = (results[size] for size in (*SIZES, 0))
    rows = "\n".join(
        f"| {size:,} | {int(r['live_items'])} | {r['live_ms']:.2f} | "
        f"{1000 * r['live_ms'] / r['live_items']:.1f} | {r['full_ms']:.2f} |"
        for size, r in results.items()
        if size
    )
    return f"""## Projection

`python bench/projection.py --write` (Python {platform.python_version()}, {platform.machine()}).
Median of {REPEATS} runs of `project_context` ({FULL_REPEATS} for the full history), the
cases timed round-robin after one warm-up run each (token counts cached, as a store
keeps them with its items). "Live window" is what a store passes: the items from the
sticky cut on plus the CutPoint (window {WINDOW:,} tokens, so the live window fits). The
100-item thread is shorter than a {LIVE_WINDOW}-item live window and is passed whole.
"Full history" passes every item with no cut under a 40,000-token window, so the
projection must compress and summarize (informational).

| thread items | live window items | live window ms | us per live item | full history ms |
|---:|---:|---:|---:|---:|
{rows}

| ratio | value |
|---|---:|
| 10,000 / 100 items, live windows as above ({int(large["live_items"])} vs {int(small["live_items"])} items) | {large["live_ms"] / small["live_ms"]:.2f} |
| 10,000 / 100 items, equal live windows ({int(equal["live_items"])} items: {equal["live_ms"]:.2f} ms) | **{equal["live_ms"] / small["live_ms"]:.2f}** |
| 10,000 / 1,000 items, equal live windows | {large["live_ms"] / middle["live_ms"]:.2f} |
| full history 10,000 / 1,000 items (linear would be 10) | {large["full_ms"] / middle["full_ms"]:.2f} |

Target: 10,000 / 100 <= 1.5 with equal live windows. The cost follows the live window,
not the thread; with twice the items in the window it is about twice the cost.
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    text = section(measure())
    print(text)
    if args.write:
        write_section("Projection", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
