"""Any provider, exact budget (issue 21): a 40-turn thread and a 20-request stateless run
on fake providers that count differently from the proxy, with and without calibration
from usage and window discovery, in one run.

    python bench/calibration.py [--write]

Baseline ("main"): the proxy as it was before calibration and discovery (its overflow
recovery included): the same code with `calibrated` returning what was known and
discovery answering nothing. Figures per provider and mode:

- client-visible context-length errors (400 context_length_exceeded reaching the client);
- provider refusals (the fake's window enforcement), and silent truncations (Ollama);
- mean fill of the real window over the thread's last 10 turns (the provider's count of
  what it got, over its window);
- input_tokens error at p95 on 20 probes after both runs, against the provider's count.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.results import write_section
from proxy.core.budget import Learned, Sample
from proxy.fake_provider import ContextWindow, FakeProvider
from proxy.logs import configure_logging
from proxy.server import model_budget, observe
from proxy.server.app import bound_port, create_app, start
from proxy.settings import Settings

KEY = "sk-bench"
WORDS = " ".join(f"fact{i} about the order" for i in range(60))  # ~300 o200k tokens
POLICY = """\
tenant: bench
api_keys: ["{key_hash}"]
models:
  "*": {{context_window: 128000, max_output_tokens: 1000}}{extra}
budget: {{reserve_output_tokens: 1000, safety_margin_tokens: 200}}
"""


def mistral_count() -> Callable[[dict[str, Any]], int]:
    """A Mistral server's count of a prompt: mistral-common's shipped v3 tokenizer for the
    text, and its instruct format's control tokens (<s>, then [INST] ... [/INST] around
    each user or system turn and </s> after each answer)."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    text_tokenizer = MistralTokenizer.v3().instruct_tokenizer.tokenizer

    def text_of(content: Any) -> str:
        if isinstance(content, str):
            return content
        parts = content if isinstance(content, list) else []
        return " ".join(str(p.get("text") or "") for p in parts if isinstance(p, dict))

    def count(body: dict[str, Any]) -> int:
        turns: list[tuple[str, str]] = []
        if "messages" in body:
            turns = [(m.get("role", ""), text_of(m.get("content"))) for m in body["messages"]]
        else:
            if body.get("instructions"):
                turns.append(("system", str(body["instructions"])))
            given = body.get("input")
            items = [{"role": "user", "content": given}] if isinstance(given, str) else given
            turns += [(i.get("role", "user"), text_of(i.get("content"))) for i in items or []]
        total = 1  # <s>
        for role, text in turns:
            total += len(text_tokenizer.encode(text, bos=False, eos=False))
            total += 1 if role == "assistant" else 2
        return total

    return count


@dataclass(frozen=True)
class Provider:
    name: str
    model: str
    window: ContextWindow
    policy_entry: str = ""  # the model's entry in the policy (empty: only "*" names it)


def providers() -> list[Provider]:
    return [
        Provider(
            "heavy vocabulary + template (1.35x o200k + 14/message), window 12k in the policy",
            "llama-3-8b",
            ContextWindow(12000, inflation=1.35, per_message=14),
            '\n  "llama-3-8b": {context_window: 12000, max_output_tokens: 1000}',
        ),
        Provider(
            "Mistral (mistral-common's v3 tokenizer and instruct format) served as "
            "`mistralai/Mistral-7B-Instruct-v0.3` (a name mistral-common does not map), "
            "window 12k in the policy, no tokenizer named",
            "mistralai/Mistral-7B-Instruct-v0.3",
            ContextWindow(12000, count=mistral_count()),
            '\n  "mistralai/Mistral-7B-Instruct-v0.3": {context_window: 12000, '
            "max_output_tokens: 1000}",
        ),
        Provider(
            "the same Mistral server as `mistral-large-2407`, no tokenizer named "
            "(mistral-common maps it to v3)",
            "mistral-large-2407",
            ContextWindow(12000, count=mistral_count()),
            '\n  "mistral-large-2407": {context_window: 12000, max_output_tokens: 1000}',
        ),
        Provider(
            "the same Mistral server, `tokenizer: mistral:v3` in the policy",
            "mistral-small-latest",
            ContextWindow(12000, count=mistral_count()),
            '\n  "mistral-small-latest": {context_window: 12000, max_output_tokens: 1000, '
            'tokenizer: "mistral:v3"}',
        ),
        Provider(
            "vLLM-shaped (1.15x + 8/message), max_model_len 8192 listed, policy only *",
            "Qwen/Qwen2.5-7B-Instruct",
            ContextWindow(8192, inflation=1.15, per_message=8, listed={"max_model_len": 8192}),
        ),
        Provider(
            "Ollama-shaped (1.2x + 10/message), num_ctx 8192 in /api/show, cuts silently",
            "llama3.1:8b",
            ContextWindow(
                8192,
                inflation=1.2,
                per_message=10,
                truncate_at=8192,
                ollama_show={
                    "parameters": "num_ctx 8192",
                    "model_info": {"llama.context_length": 131072},
                },
            ),
        ),
    ]


@contextmanager
def as_main() -> Iterator[None]:
    """The proxy without calibration and discovery (what main had)."""

    def known(previous: Learned | None, sample: Sample) -> Learned:
        return previous if previous is not None else Learned()

    async def nothing(request: Any, model: str, key: Any, limits: Any) -> Learned | None:
        return limits.get(key)

    saved = (observe.calibrated, model_budget.calibrated, model_budget.discover)
    observe.calibrated = known  # type: ignore[attr-defined]
    model_budget.calibrated = known  # type: ignore[attr-defined]
    model_budget.discover = nothing  # type: ignore[assignment]
    try:
        yield
    finally:
        observe.calibrated, model_budget.calibrated, model_budget.discover = saved  # type: ignore[attr-defined,assignment]


async def run_one(spec: Provider, tmp: Path) -> dict[str, Any]:
    fake = FakeProvider(models=(spec.model,))
    window = ContextWindow(**{**spec.window.__dict__, "refusals": 0})
    fake.window = window
    await fake.start()
    key_hash = hashlib.sha256(KEY.encode()).hexdigest()
    (tmp / "bench.yaml").write_text(POLICY.format(key_hash=key_hash, extra=spec.policy_entry))
    settings = Settings(
        port=0,
        policies_dir=tmp,
        store_url=f"sqlite:///{tmp / 'bench.db'}",
        upstream_url=fake.base_url,
        policy_reload_interval=0,
        explain=False,
    )
    app = create_app(settings, env={})
    runner = await start(settings, app)
    base = f"http://127.0.0.1:{bound_port(runner)}/v1"
    headers = {"Authorization": f"Bearer {KEY}"}
    errors = 0
    fills: list[float] = []
    truncated = 0

    def provider_count() -> int:
        return window.prompt(fake.model_requests[-1].json)

    try:
        async with aiohttp.ClientSession() as http:

            async def chat(messages: list[Any], extra: dict[str, str]) -> str | None:
                nonlocal errors, truncated
                body = {"model": spec.model, "messages": messages}
                async with http.post(
                    f"{base}/chat/completions", json=body, headers={**headers, **extra}
                ) as response:
                    answer = await response.json()
                if response.status != 200:
                    if (answer.get("error") or {}).get("code") == "context_length_exceeded":
                        errors += 1
                    return None
                if window.truncate_at is not None and provider_count() > window.truncate_at:
                    truncated += 1
                return str(answer["choices"][0]["message"]["content"])

            messages: list[Any] = []
            for turn in range(40):
                messages.append({"role": "user", "content": f"Question {turn}: {WORDS}"})
                reply = await chat(messages, {"X-Thread-Id": "bench-thread"})
                messages.append({"role": "assistant", "content": reply or "(none)"})
                if turn >= 30 and reply is not None:
                    fills.append(min(provider_count(), window.tokens) / window.tokens)
            for request in range(20):
                history: list[Any] = []
                for turn in range(8 + 2 * request):
                    history.append({"role": "user", "content": f"Stateless {turn}: {WORDS}"})
                    history.append({"role": "assistant", "content": "Noted."})
                history.append({"role": "user", "content": "And now?"})
                await chat(history, {})
            probe_errors = []
            for probe in range(20):
                given = [
                    {"role": "user", "content": f"Probe {probe}: " + WORDS[: 150 * (probe + 1)]},
                    {"role": "assistant", "content": "Sure. " * (1 + probe % 4)},
                    {"role": "user", "content": "Go on."},
                ][: 1 + probe % 3]
                body = {"model": spec.model, "input": given, "instructions": "Be brief."}
                async with http.post(
                    f"{base}/responses/input_tokens", json=body, headers=headers
                ) as response:
                    counted = (await response.json())["input_tokens"]
                truth = window.prompt(body)
                probe_errors.append(abs(counted - truth) / truth)
    finally:
        await runner.cleanup()
        await fake.stop()
    probe_errors.sort()
    return {
        "errors": errors,
        "refusals": window.refusals,
        "truncated": truncated,
        "fill": sum(fills) / len(fills) if fills else 0.0,
        "p95": probe_errors[math.ceil(0.95 * len(probe_errors)) - 1],
    }


async def measure() -> list[tuple[str, str, dict[str, Any]]]:
    rows = []
    for spec in providers():
        for mode in ("main", "calibrated"):
            with tempfile.TemporaryDirectory() as tmp:
                if mode == "main":
                    with as_main():
                        result = await run_one(spec, Path(tmp))
                else:
                    result = await run_one(spec, Path(tmp))
            rows.append((spec.name, mode, result))
    return rows


def section(rows: list[tuple[str, str, dict[str, Any]]]) -> str:
    lines = [
        "## Calibration",
        "",
        "`python bench/calibration.py --write`: per fake provider, a 40-turn chat thread "
        "(~300-token turns) then 20 stateless requests with growing histories, then 20 "
        "`input_tokens` probes; `main` is the proxy without calibration from usage and "
        "window discovery (its overflow recovery kept), in the same run.",
        "",
        "| provider | mode | client context-length errors | provider refusals | silent "
        "truncations | mean fill, last 10 turns | input_tokens error p95 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, mode, r in rows:
        lines.append(
            f"| {name} | {mode} | {r['errors']} | {r['refusals']} | {r['truncated']} | "
            f"{100 * r['fill']:.0f}% | {100 * r['p95']:.1f}% |"
        )
    lines += [
        "",
        "Targets: 0 client errors, at most 1 refusal per model, fill >= 60%, input_tokens "
        "p95 <= 3%. Fill is the provider's count of what it got over its window (the output "
        "reserve of 1,000 and the 200-token margin are part of the rest); against a "
        "provider that cuts silently (Ollama) a fill of 100% means prompts were cut, "
        "counted under silent truncations. Without calibration the overflow recovery "
        "keeps client errors at 0 by one refusal per model, but input_tokens stays as far "
        "off as the vocabulary and template are.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    configure_logging("error")
    text = section(asyncio.run(measure()))
    print(text)
    if args.write:
        write_section("Calibration", text)


if __name__ == "__main__":
    main()
