"""Which counter a request's model gets: the one place that reads `tokenizer:` (SPEC round 3).

    counter = await counter_for(policy, "Qwen/Qwen2.5-7B-Instruct")

A model entry's tokenizer (tiktoken:, hf:, mistral:, loaded with the policy) counts for
it; an entry that names none counts a Mistral API model name with the tokenizer
mistral-common maps it to (proxy/native_tokenizers.py, `mistral_default`), OpenAI model
names with their tiktoken encoding and every other name with the o200k_base estimate. That estimate is the seam the calibration
from provider usage (issue 21, item 2) wraps.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Mapping

from proxy.core.budget import Learned
from proxy.core.items import Item
from proxy.core.tokens import TokenCounter, vocabulary_loaded
from proxy.native_tokenizers import is_mistral_name, mistral_default, mistral_default_known
from proxy.policy import Policy


@functools.lru_cache(maxsize=1024)  # a counter holds no state of its own: one per model
def estimate_counter(model: str) -> TokenCounter:
    """The counter of a model whose entry names no tokenizer (built on first use)."""
    return TokenCounter.for_model(model)


async def counter_for(policy: Policy | None, model: str) -> TokenCounter:
    """The model's counter under `policy` (None: no tenant, the default rule). The first
    use of a bundled tiktoken vocabulary or a Mistral default loads it (a third of a
    second): not on the loop."""
    named = policy.tokenizer_for(model) if policy is not None else None
    if named is not None:
        return TokenCounter(model, named)
    if is_mistral_name(model):
        known, native = mistral_default_known(model)
        if not known:
            native = await asyncio.to_thread(mistral_default, model)
        if native is not None:
            return TokenCounter(model, native)
    if vocabulary_loaded(model):
        return estimate_counter(model)
    return await asyncio.to_thread(estimate_counter, model)


class CalibratedCounter(TokenCounter):
    """`base`'s counts with the per-item overhead the provider's usage taught
    (`Learned.item_overhead`) added to every item and to instructions (one more message).
    The raw counts stay `base`'s, cached and stored under its tokenizer's identity, so a
    changed correction never re-encodes anything; the ratio is applied to the window
    (budget.corrected_window) or to the total (`provider_count`)."""

    def __init__(self, base: TokenCounter, learned: Learned) -> None:
        super().__init__(base.model, base.tokenizer)
        self.base = base
        self.learned = learned
        self.extra = learned.item_overhead
        # What the projection caches by counter (made summaries, replays) is its own;
        # item counts go to `base`, under the tokenizer's identity.
        self.tokenizer_id = f"{base.tokenizer_id}+{self.extra}/item"

    def item(self, item: Item) -> int:
        return self.base.item(item) + self.extra

    def instructions(self, text: str | None) -> int:
        counted = super().instructions(text)
        return counted + self.extra if counted else 0


def calibrated_counter(counter: TokenCounter, learned: Learned | None) -> TokenCounter:
    """The budget's counter: `counter` itself until an answer taught an overhead."""
    if learned is None or learned.item_overhead <= 0:
        return counter
    return CalibratedCounter(counter, learned)


def raw_count(counter: TokenCounter, counted: int, items: int) -> int:
    """What `counter` counted as `counted` over `items` items, without its overhead."""
    extra = counter.extra if isinstance(counter, CalibratedCounter) else 0
    return counted - extra * items


def provider_count(counter: TokenCounter, learned: Learned | None, counted: int, items: int) -> int:
    """The provider's count of a prompt `counter` counted as `counted` over `items` items:
    the proxy's own count until usage or a refusal taught a correction. A
    `ProviderCounter`'s counts are the provider's (and the calibrated estimate's) divided
    by its scale: multiplied back."""
    if isinstance(counter, ProviderCounter):
        return math.ceil(counted * counter.scale - 1e-9)
    if learned is None or (learned.answers == 0 and learned.ratio <= 1.0):
        return counted
    return learned.provider_count(raw_count(counter, counted, items), items)


class ProviderCounter(CalibratedCounter):
    """The budget's counter for `tokenizer: provider`. An item the provider counted
    (`counted`, by digest) costs that count brought to the proxy's scale (divided by the
    ratio usage taught, as `budget.corrected_window` divides the window by it, so the
    provider's count is what fills the provider's window); any other item, instructions
    and tools cost the calibrated estimate (`CalibratedCounter`), which is what the
    projection's own text counts (summaries, compression) stay consistent with. `prompt`:
    what the provider's template adds once per prompt (proxy/server/model_budget.py);
    None, the estimate's reply cost."""

    def __init__(
        self,
        base: TokenCounter,
        learned: Learned | None,
        counted: Mapping[str, int],
        prompt: int | None,
    ) -> None:
        super().__init__(base, learned if learned is not None else Learned())
        self.scale = max(1.0, self.learned.ratio)
        self.counted = counted
        if prompt is not None:
            self.reply_tokens = self._scaled(prompt)
        # Projection caches keyed by counter (made summaries, replays) must not mix these
        # counts with the estimate's, nor with a turn's that knew fewer of them.
        self.tokenizer_id = f"provider:{self.tokenizer_id}:{len(counted)}:{prompt}"

    def _scaled(self, count: int) -> int:
        return math.ceil(count / self.scale - 1e-9)

    def item(self, item: Item) -> int:
        found = self.counted.get(item.digest)
        return self._scaled(found) if found is not None else super().item(item)
