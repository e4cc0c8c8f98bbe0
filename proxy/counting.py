"""Which counter a request's model gets: the one place that reads `tokenizer:` (SPEC round 3).

    counter = await counter_for(policy, "Qwen/Qwen2.5-7B-Instruct")

A model entry's tokenizer (tiktoken:, hf:, mistral:, loaded with the policy) counts for
it; an entry that names none counts OpenAI model names with their tiktoken encoding and
every other name with the o200k_base estimate. That estimate is the seam the calibration
from provider usage (issue 21, item 2) wraps.
"""

from __future__ import annotations

import asyncio

from proxy.core.tokens import TokenCounter, vocabulary_loaded
from proxy.policy import Policy


def estimate_counter(model: str) -> TokenCounter:
    """The counter of a model whose entry names no tokenizer (built on first use)."""
    return TokenCounter.for_model(model)


async def counter_for(policy: Policy | None, model: str) -> TokenCounter:
    """The model's counter under `policy` (None: no tenant, the default rule). The first
    use of a bundled tiktoken vocabulary loads it (a third of a second): not on the loop."""
    named = policy.tokenizer_for(model) if policy is not None else None
    if named is not None:
        return TokenCounter(model, named)
    if vocabulary_loaded(model):
        return estimate_counter(model)
    return await asyncio.to_thread(estimate_counter, model)
