"""CPU cost of counting with each tokenizer, as a ratio to tiktoken (issue 21, item 1).

    python bench/tokenizer_cost.py [--write]

Counts the same 200-item agent thread (user turns, tool calls, JSON tool results,
answers) with tiktoken's o200k_base, an hf: tokenizer and each mistral: version, and
reports the median of several runs as a ratio to o200k_base: from a cold cache (a
thread's first projection), and per turn (the thread counted again with its last turn's
four items new: what every later turn costs, as items are counted once and cached by
tokenizer and digest). No Hugging Face model is
on this machine: the hf: tokenizer is a byte-level BPE trained here (32k merges at most,
on the thread's own text), smaller than a real model's, so its ratio is indicative. With
--write, replaces the "## Tokenizer cost" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from results import write_section
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from proxy.core.items import Item, chat_item
from proxy.core.tokens import TokenCounter
from proxy.native_tokenizers import MISTRAL_VERSIONS, load_native

RUNS = 7


def thread(turns: int = 50) -> list[dict[str, Any]]:
    """Four items a turn: the question, a tool call, its JSON result, the answer."""
    messages: list[dict[str, Any]] = []
    for turn in range(turns):
        call_id = f"call_{turn}"
        rows = [
            {"sku": f"SKU-{turn}-{n}", "qty": n, "price": 9.5 + n, "status": "shipped"}
            for n in range(12)
        ]
        messages += [
            {
                "role": "user",
                "content": f"Turn {turn}: please check order ORD-{turn:05d}, compare it with "
                "last week's shipment and tell me whether the refund policy applies.",
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": "lookup_order",
                            "arguments": json.dumps({"order_id": f"ORD-{turn:05d}"}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"rows": rows})},
            {
                "role": "assistant",
                "content": f"Order ORD-{turn:05d} shipped {len(rows)} lines; the refund "
                "policy applies to the two damaged ones. Überprüft ✓ — next step: confirm.",
            },
        ]
    return messages


def trained_hf(directory: Path, corpus: list[str]) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=32000,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return directory


def cold_seconds(counter: TokenCounter, items: list[Item]) -> float:
    """Median seconds to count every item with nothing cached."""
    times = []
    counter.items(items)  # warm-up: lazy regexes and the like are built once per process
    for _ in range(RUNS):
        TokenCounter._cache.clear()
        started = time.process_time()
        counter.items(items)
        times.append(time.process_time() - started)
    return statistics.median(times)


TURN = 4  # items a turn adds (thread(): question, tool call, result, answer)


def turn_seconds(counter: TokenCounter, items: list[Item]) -> float:
    """Median seconds to count the thread again when only its last turn is new."""
    times = []
    for _ in range(RUNS):
        TokenCounter._cache.clear()
        counter.items(items[:-TURN])
        started = time.process_time()
        counter.items(items)
        times.append(time.process_time() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    raws = thread()
    items = [chat_item(raw) for raw in raws]
    corpus = [json.dumps(raw) for raw in raws]
    with tempfile.TemporaryDirectory() as tmp:
        counters = {"tiktoken o200k_base": TokenCounter.for_model("gpt-4o")}
        hf = load_native(f"hf:{trained_hf(Path(tmp), corpus)}", Path(tmp))
        counters["hf: (byte-level BPE, trained here)"] = TokenCounter("qwen", hf)
        for version in MISTRAL_VERSIONS:
            counters[f"mistral:{version}"] = TokenCounter(
                "mistral", load_native(f"mistral:{version}", Path(tmp))
            )
        measured = {
            name: (cold_seconds(counter, items), turn_seconds(counter, items))
            for name, counter in counters.items()
        }
        cold_base, turn_base = measured["tiktoken o200k_base"]
        rows = [
            f"| {name} | {counters[name].items(items)} | {cold * 1000:.1f} ms"
            f" | {cold / cold_base:.2f} | {turn * 1000:.2f} ms | {turn / turn_base:.2f} |"
            for name, (cold, turn) in measured.items()
        ]
    section = "\n".join(
        [
            "## Tokenizer cost",
            "",
            f"`python bench/tokenizer_cost.py --write`: one {len(items)}-item thread counted"
            f" from a cold cache, and per turn (the thread again with its last {TURN} items"
            f" new), median CPU time of {RUNS} runs, in one run.",
            "",
            "| tokenizer | tokens | CPU, cold | ratio to o200k_base | CPU per turn |"
            " ratio to o200k_base |",
            "|---|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Each item is counted once per tokenizer and cached, so a later turn counts only"
            " its new items and looks the others up. A Mistral API name with no tokenizer"
            " named (mistral-large-2407) counts with the mistral: version mistral-common maps"
            " it to, at that row's cost. The hf: tokenizer is trained on this machine (no"
            " model files here), so its ratio is indicative of the library, not of a given"
            " model.",
            "",
        ]
    )
    print(section)
    if args.write:
        write_section("Tokenizer cost", section)


if __name__ == "__main__":
    main()
