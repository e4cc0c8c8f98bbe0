"""Is the LLM summarizer off the critical path? (issue 10, item 2)

    python bench/summary_latency.py [--turns 24] [--write]

One stateful support thread (X-Thread-Id), the same scripted turns twice, in one process:
a tenant without a summarizer, and a tenant whose summarizer model answers only after
SUMMARY_DELAY seconds. Once the thread crosses the high-water mark, each turn of the second
tenant starts a background summary; the client's latency of those turns is compared with
the same turns of the first tenant. With --write, replaces the "Summary latency" section
of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results import write_section
from proxy.fake_provider import FakeProvider, Reply
from proxy.logs import configure_logging
from proxy.server.app import bound_port, create_app, start
from proxy.server.state import SUMMARIES
from proxy.settings import Settings

SUMMARIZER = "bench-summarizer"
SUMMARY_DELAY = 0.5  # seconds the summarizer model takes to answer
POLICY = """\
tenant: {tenant}
api_keys: ["{key_hash}"]
models: {{"*": {{context_window: 6000, max_output_tokens: 1000}}}}
budget: {{reserve_output_tokens: 500, safety_margin_tokens: 100}}
memory: {{keep_recent_turns: 2{summarizer}}}
"""
SUMMARIZER_POLICY = f", summarizer: {{model: {SUMMARIZER}, max_tokens: 300, timeout_seconds: 10}}"


def user_turn(number: int) -> str:
    detail = " The parcel arrived crushed and the contents are scratched." * 30
    return f"Order ORD-{1000 + number} arrived broken; refund rfd_{5000 + number}.{detail}"


async def run(turns: int) -> dict[str, list[float]]:
    import hashlib

    provider = FakeProvider()
    await provider.start()
    answer = {"constraints": [], "decisions": ["Refund each broken order."], "facts": []}
    provider.scripts[SUMMARIZER] = [
        Reply(text=json.dumps(answer), delay=SUMMARY_DELAY) for _ in range(4 * turns)
    ]
    latencies: dict[str, list[float]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory() as tmp:
        policies = Path(tmp)
        for tenant, extra in (("plain", ""), ("summarized", SUMMARIZER_POLICY)):
            key_hash = hashlib.sha256(f"sk-{tenant}".encode()).hexdigest()
            (policies / f"{tenant}.yaml").write_text(
                POLICY.format(tenant=tenant, key_hash=key_hash, summarizer=extra)
            )
        settings = Settings(
            port=0,
            policies_dir=policies,
            store_url=f"sqlite:///{policies / 'bench.db'}",
            upstream_url=provider.base_url,
            policy_reload_interval=0,
            explain=False,
        )
        app = create_app(settings, env={})
        runner = await start(settings, app)
        url = f"http://127.0.0.1:{bound_port(runner)}/v1/chat/completions"
        try:
            async with aiohttp.ClientSession() as http:
                # Interleaved turn by turn, so drift (a warmer process, a bigger file)
                # hits both tenants alike.
                for number in range(turns):
                    for name, tenant in (("without", "plain"), ("with", "summarized")):
                        body = {
                            "model": "gpt-4o",
                            "messages": [{"role": "user", "content": user_turn(number)}],
                        }
                        headers = {
                            "Authorization": f"Bearer sk-{tenant}",
                            "X-Thread-Id": f"t-{tenant}",
                        }
                        started = time.perf_counter()
                        async with http.post(url, json=body, headers=headers) as response:
                            await response.read()
                            assert response.status == 200, await response.text()
                        latencies[name].append(time.perf_counter() - started)
            summaries = len(
                [r for r in provider.model_requests if r.json.get("model") == SUMMARIZER]
            )
            await app[SUMMARIES].idle()
        finally:
            await runner.cleanup()
            await provider.stop()
    latencies["summaries"] = [float(summaries)]
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=24)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    configure_logging("warning")
    result = asyncio.run(run(args.turns))
    skip = args.turns // 3  # the early turns, before the high-water mark, are not compared
    without, with_ = result["without"][skip:], result["with"][skip:]
    rows = [
        ("no summarizer", without),
        (f"summarizer answering after {SUMMARY_DELAY} s, in the background", with_),
    ]
    lines = [
        "## Summary latency",
        "",
        f"`python bench/summary_latency.py --write`: one stateful thread, {args.turns} turns, "
        f"the same turns for a tenant without and with an LLM summarizer whose model answers "
        f"after {SUMMARY_DELAY} s, interleaved turn by turn; turns {skip + 1}-{args.turns} compared (past the high-water "
        f"mark). The summarizer was called {int(result['summaries'][0])} times while the "
        "turns ran.",
        "",
        "| tenant | client latency p50 | p90 | max |",
        "|---|---:|---:|---:|",
    ]
    for name, values in rows:
        ordered = sorted(values)
        p50 = statistics.median(ordered) * 1000
        p90 = ordered[int(0.9 * (len(ordered) - 1))] * 1000
        lines.append(f"| {name} | {p50:.1f} ms | {p90:.1f} ms | {max(ordered) * 1000:.1f} ms |")
    ratio = statistics.median(with_) / statistics.median(without)
    lines += ["", f"Ratio of the p50s (with / without): {ratio:.2f}."]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.write:
        write_section("Summary latency", section)


if __name__ == "__main__":
    main()
