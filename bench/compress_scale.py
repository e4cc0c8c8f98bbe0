"""Compression time of one very large tool result (issue 22: bounded and linear).

    python bench/compress_scale.py

A 1 MB log (routine lines of a few templates, varying numbers and ids, one rare error)
a 20,000-record JSON list, a 1 MB text of distinct lines (the miner's worst case) and a
1 MB Python source file (signatures kept as its skeleton), each compressed once to tool_result_max_tokens 800 by
proxy/core/compress.py; CPU time of the one call (process time: the machine may be shared) (the projection runs it in a worker
thread for inputs this large, see proxy/server/turn.py, `off_the_loop`), and whether the rare line
and the outlier survive. The same inputs at half the size show the growth factor.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.core import compress
from proxy.core.compress import compress_tool_output
from proxy.core.items import chat_item
from proxy.core.tokens import TokenCounter

RARE = "ERROR db.pool: connection pool exhausted (max_connections=200 reached) pid=31337"


def log(size: int, rng: random.Random) -> str:
    lines: list[str] = []
    total = 0
    while total < size:
        minute, second = rng.randrange(60), rng.randrange(60)
        kind = rng.randrange(3)
        if kind == 0:
            line = f"2026-11-30T10:{minute:02}:{second:02}Z INFO http: GET /api/orders/{rng.randrange(10**6)} 200 {rng.randrange(900)}ms"
        elif kind == 1:
            line = f"2026-11-30T10:{minute:02}:{second:02}Z ERROR gateway: upstream 502 Bad Gateway req={rng.randrange(16**8):08x}"
        else:
            line = f"2026-11-30T10:{minute:02}:{second:02}Z WARN cache: miss ratio {rng.random():.2f} shard={rng.randrange(64)}"
        lines.append(line)
        total += len(line) + 1
    lines.insert(rng.randrange(len(lines)), f"2026-11-30T10:17:03Z {RARE}")
    return "\n".join(lines)


def records(count: int, rng: random.Random) -> str:
    rows = [
        {
            "id": f"INV-{i:05}",
            "status": rng.choice(["paid", "open"]),
            "amount": round(rng.gauss(100, 5), 2),
        }
        for i in range(count)
    ]
    rows[rng.randrange(count)]["amount"] = 98765.0
    return json.dumps(rows)


def distinct(size: int, rng: random.Random) -> str:
    """Lines of one length and one start that share no template: the miner's worst case
    (every line compared with LEAF_CLUSTERS templates)."""
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(6)) for _ in range(5000)]
    lines: list[str] = []
    total = 0
    while total < size:
        lines.append("GET /api " + " ".join(rng.choice(words) for _ in range(12)))
        total += len(lines[-1]) + 1
    return "\n".join(lines)


def source(size: int, rng: random.Random) -> str:
    """A Python file of distinct functions (few lines share a template): a file listing."""
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(6)) for _ in range(2000)]
    lines: list[str] = []
    total = 0
    block = 0
    while total < size:
        a, b, c = (rng.choice(words) for _ in "abc")
        lines += [
            f"def {a}_{block}({b}, {c}):",
            f'    """The {rng.choice(words)} of {rng.choice(words)}."""',
            f"    {a} = {b} * {c} + {rng.choice(words)}",
            f"    return {a} / {rng.choice(words)}",
            "",
        ]
        total += sum(len(line) + 1 for line in lines[-5:])
        block += 1
    lines.insert(len(lines) // 2 + 1, "    days_in_year = 365")
    return "\n".join(lines)


def timed(text: str, counter: TokenCounter) -> tuple[float, str]:
    compress._compressed.clear()
    item = chat_item({"role": "tool", "tool_call_id": "call_1", "content": text})
    started = time.process_time()
    small = compress_tool_output(item, None, 800, counter)
    return time.process_time() - started, str(small.raw["content"])


def main() -> int:
    counter = TokenCounter.for_model("gpt-4o")
    rng = random.Random(7)
    for name, make, size, keep in (
        ("log", log, 1_000_000, "max_connections=200"),
        ("json", records, 20_000, "98765"),
        ("distinct lines", distinct, 1_000_000, "GET /api"),
        ("source file", source, 1_000_000, "def "),
    ):
        half, _ = timed(make(size // 2, random.Random(rng.random())), counter)
        full, body = timed(make(size, random.Random(rng.random())), counter)
        print(
            f"{name}: {size:,} -> {full:.2f} s (half size {half:.2f} s, growth x{full / half:.2f});"
            f" kept {keep!r}: {keep in body}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
