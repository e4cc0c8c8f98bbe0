"""Counting in the provider's own tokens for a model whose entry says `tokenizer: provider`
(issue 21, item 1; docs/integrations.md, "Counting with the provider").

The provider counts a whole request; the projection needs each item's count. Each item is
asked once, alone, and kept by content digest (a bounded LRU), so a turn asks only about
the items it has never seen (the new user message, the last answer):

- Chat items: vLLM's and SGLang's `POST /tokenize` (at the server root, beside /v1) with
  `{"model", "messages": [item]}`; it applies the chat template and answers
  `{"count": N, "max_model_len": M, "tokens": [...]}` (vllm/entrypoints/openai/protocol.py,
  TokenizeChatRequest / TokenizeResponse);
- Responses items: `POST {base}/responses/input_tokens` with `{"model", "input": [item]}`,
  answered `{"object": "response.input_tokens", "input_tokens": N}` (OpenAI's
  TokenCountsResource).

A one-item request also carries what the template adds once per prompt (a BOS, a default
system prompt, the generation prompt). That share, P, is measured once per (upstream,
model, API) from two probes: P = count([a]) + count([b]) - count([a, b]); an item's count
is count([item]) - P, and P is the prompt's reply cost.

Every question of a turn shares one bounded timeout (`upstream.count_timeout_seconds`);
what is not answered by then is counted with the calibrated estimate. A 404 or 405, or an
answer of the wrong shape, means the provider has no such endpoint: remembered per
(upstream, API) and never asked again by this process; so does a refusal of the probes.
A refusal of one item (a template that will not render a tool result alone) leaves that
item to the estimate, never asked again. A timeout stops the asking for
SLOW_BACKOFF_SECONDS."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
from aiohttp import web

from proxy.core.budget import Learned
from proxy.core.items import Item
from proxy.core.tokens import TokenCounter
from proxy.counting import ProviderCounter, calibrated_counter
from proxy.policy import Policy
from proxy.server.discovery import ask_provider
from proxy.server.relay import upstream_base
from proxy.server.state import PROVIDER_COUNTS, TENANT_POLICY
from proxy.upstream import Deadline

counts_log = structlog.get_logger("threadkeeper.provider_counts")

MAX_ITEM_COUNTS = 65536  # item counts kept; item digests come from clients: bounded
MAX_ASKS_PER_TURN = 16  # items asked about in one turn (the newest); the rest estimated
CONCURRENCY = 4  # questions in flight at once for one turn
SLOW_BACKOFF_SECONDS = 300.0  # a provider that did not answer in time is left alone this long
MISSING_STATUSES = frozenset({404, 405})
UNCOUNTABLE = -1  # kept for an item the provider refused to count alone: not asked again

PROBES: tuple[dict[str, Any], dict[str, Any]] = (
    {"role": "user", "content": "a"},
    {"role": "user", "content": "b"},
)

Where = tuple[str, str]  # (upstream base URL, "chat" or "responses")


class ProviderCounts:
    """Per process: item counts by (upstream, model, API, digest), the per-prompt share P by
    (upstream, model, API), and which upstreams have no counting endpoint."""

    def __init__(
        self, max_entries: int = MAX_ITEM_COUNTS, *, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._counts: OrderedDict[tuple[str, str, str, str], int] = OrderedDict()
        self._max = max_entries
        self.prompts: dict[tuple[str, str, str], int] = {}
        self._missing: set[Where] = set()
        self._slow_until: dict[Where, float] = {}
        self._now = monotonic

    def get(self, key: tuple[str, str, str, str]) -> int | None:
        found = self._counts.get(key)
        if found is not None:
            self._counts.move_to_end(key)
        return found

    def put(self, key: tuple[str, str, str, str], count: int) -> None:
        self._counts[key] = count
        self._counts.move_to_end(key)
        while len(self._counts) > self._max:
            self._counts.popitem(last=False)

    def __len__(self) -> int:
        return len(self._counts)

    def usable(self, where: Where) -> bool:
        if where in self._missing:
            return False
        return self._slow_until.get(where, 0.0) <= self._now()

    def missing(self, where: Where) -> None:
        if where not in self._missing:
            counts_log.info("provider_counting_unavailable", upstream=where[0], api=where[1])
        self._missing.add(where)

    def slow(self, where: Where) -> None:
        counts_log.info("provider_counting_slow", upstream=where[0], api=where[1])
        self._slow_until[where] = self._now() + SLOW_BACKOFF_SECONDS


class Counted:
    """What one turn knows in the provider's tokens: item counts by digest and P (None
    until measured)."""

    def __init__(self, items: Mapping[str, int], prompt: int | None) -> None:
        self.items = items
        self.prompt = prompt


def count_in(answer: Any, api: str) -> int | None:
    """The count in a counting endpoint's answer; None when it is not that shape."""
    if not isinstance(answer, dict):
        return None
    value = answer.get("count" if api == "chat" else "input_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


class _Missing(Exception):
    """The endpoint is not there (404/405) or answers something else."""


async def _count(
    request: web.Request, base: str, model: str, api: str, raws: Sequence[Any], deadline: Deadline
) -> int | None:
    if api == "chat":
        url = f"{base.removesuffix('/v1')}/tokenize"
        body: dict[str, Any] = {"model": model, "messages": list(raws)}
    else:
        url = f"{base}/responses/input_tokens"
        body = {"model": model, "input": list(raws)}
    status, answer = await ask_provider(request, "POST", url, body, deadline)
    if status in MISSING_STATUSES:
        raise _Missing(f"{status}")
    if status is None or status >= 500:
        return None  # a passing failure: asked again on a later turn
    if status >= 400:
        return UNCOUNTABLE  # this request (a template that refuses a lone tool message)
    found = count_in(answer, api)
    if found is None:
        raise _Missing("not a counting answer")
    return found


async def provider_counts(
    request: web.Request, model: str, items: Sequence[Item]
) -> Counted | None:
    """The provider's counts of `items` it knows or can tell within the timeout; None when
    the model is not counted by the provider."""
    policy = request[TENANT_POLICY]
    counts = request.app.get(PROVIDER_COUNTS)
    if counts is None or not policy.counts_with_provider(model):
        return None
    base = upstream_base(request, policy)
    apis = {item.api for item in items} or {"chat"}
    found: dict[str, int] = {}
    asks: list[tuple[Where, Item]] = []
    for item in reversed(items):  # the newest first: the ones the projection keeps
        if not item.digest:
            continue  # nothing to keep its count by: the estimate counts it
        key = (base, model, item.api, item.digest)
        cached = counts.get(key)
        if cached is not None:
            if cached != UNCOUNTABLE:
                found[item.digest] = cached
        elif counts.usable((base, item.api)) and len(asks) < MAX_ASKS_PER_TURN:
            asks.append(((base, item.api), item))
    prompt_known = {api: counts.prompts.get((base, model, api)) for api in apis}
    probes = [api for api, p in prompt_known.items() if p is None and counts.usable((base, api))]
    if asks or probes:
        await _ask_all(request, counts, base, model, asks, probes, policy)
        for _, item in asks:
            cached = counts.get((base, model, item.api, item.digest))
            if cached is not None and cached != UNCOUNTABLE:
                found[item.digest] = cached
    api = next(iter(apis)) if len(apis) == 1 else "chat"
    return Counted(found, counts.prompts.get((base, model, api)))


async def _ask_all(
    request: web.Request,
    counts: ProviderCounts,
    base: str,
    model: str,
    asks: Sequence[tuple[Where, Item]],
    probes: Sequence[str],
    policy: Policy,
) -> None:
    seconds = policy.upstream.count_timeout_seconds
    deadline = Deadline.after(seconds)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(where: Where, raws: Sequence[Any]) -> int | None:
        """The count; None when the provider did not give one (UNCOUNTABLE: it refused)."""
        async with gate:
            if not counts.usable(where):
                return None
            try:
                return await _count(request, base, model, where[1], raws, deadline)
            except _Missing as exc:
                counts_log.info("provider_counting_missing", upstream=base, reason=str(exc))
                counts.missing(where)
                return None

    async def probe(api: str) -> None:
        where = (base, api)
        a = await one(where, PROBES[:1])
        b = await one(where, PROBES[1:])
        both = await one(where, PROBES)
        if UNCOUNTABLE in (a, b, both):
            counts.missing(where)  # refused plain user messages: no counting to be had here
        elif a is not None and b is not None and both is not None:
            counts.prompts[(base, model, api)] = max(0, a + b - both)

    async def item(where: Where, it: Item, prompt: int) -> None:
        alone = await one(where, [it.raw])
        if alone == UNCOUNTABLE:
            counts.put((base, model, it.api, it.digest), UNCOUNTABLE)
        elif alone is not None:
            counts.put((base, model, it.api, it.digest), max(1, alone - prompt))

    # The probes first: an item's count means nothing without P.
    probing = [asyncio.ensure_future(probe(api)) for api in probes]
    pending: set[asyncio.Future[None]] = set()
    if probing:
        _, pending = await asyncio.wait(probing, timeout=seconds)
    # An item's count means nothing without P: none is asked for before P is known.
    known = {api: counts.prompts.get((base, model, api)) for api in {w[1] for w, _ in asks}}
    tasks = [
        asyncio.ensure_future(item(w, it, prompt))
        for w, it in asks
        if (prompt := known[w[1]]) is not None
    ]
    if pending:
        tasks = []
    remaining = max(0.0, deadline.remaining())
    if tasks:
        _, late = await asyncio.wait(tasks, timeout=remaining)
        pending |= late
    if pending:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for api in {*probes, *(w[1] for w, _ in asks)}:
            counts.slow((base, api))


async def budget_counter(
    request: web.Request,
    model: str,
    base: TokenCounter,
    learned: Learned | None,
    items: Sequence[Item],
) -> TokenCounter:
    """The counter a prompt of `items` is counted with where nothing is projected
    (`POST /responses/input_tokens`, a compaction threshold): the provider's counts for
    `tokenizer: provider` (asked and cached as for a budget, same timeout, the calibrated
    estimate for what it does not tell), else the calibrated estimate. Its counts are
    brought to the provider's by `proxy.counting.provider_count`."""
    provider = await provider_counts(request, model, items)
    if provider is not None:
        return ProviderCounter(base, learned, provider.items, provider.prompt)
    return calibrated_counter(base, learned)


def counted_by_provider(request: web.Request, model: str) -> bool:
    """Whether this turn's budget was counted by the provider (its usage is then no sample
    of the estimate's error: calibration learns only while the estimate counts)."""
    counts = request.app.get(PROVIDER_COUNTS)
    policy = request[TENANT_POLICY]
    if counts is None or not policy.counts_with_provider(model):
        return False
    base = upstream_base(request, policy)
    return counts.usable((base, "chat")) or counts.usable((base, "responses"))
