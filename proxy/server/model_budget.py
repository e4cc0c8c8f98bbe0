"""The budget of a model: what the proxy knows, besides the policy, of each (tenant,
upstream, model)'s context window and of how its provider counts tokens. Every budget
reads it (proxy/server/turn.py, `rebuild`); the provider's answers, listings and refusals write
it.

What the proxy has learnt (`LearnedLimits`): one small place that every budget reads,
that a context-length refusal writes, that every answer's usage calibrates
(observe.Usage) and that window discovery fills in (proxy/server/discovery.py).

Kept in memory, per process, bounded (the least recently used entry goes first), and in
the store so replicas and restarts share it. The store is never on every turn's path: an
entry is read on its first use and again after TTL_SECONDS, and written when the
correction changed meaningfully, after WRITE_EVERY answers otherwise, and at shutdown;
an answer's write (`save_soon`) runs in a task of its own, so no answer waits for it.

Counting in the provider's own tokens (`ProviderCounts`) for a model whose entry says
`tokenizer: provider` (issue 21, item 1; docs/integrations.md, "Counting with the
provider").

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
SLOW_BACKOFF_SECONDS.

A provider's context-length refusal (SPEC round 3): read it, learn from it, and say
what the client gets when the turn cannot be made to fit. The retry itself is a step of
the request path (proxy/server/turn.py, `_forward`): once, before any byte reaches the
client, under a budget strictly smaller than what was refused."""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

# -- what was learnt ----------------------------------------------------------------------
from proxy.core.budget import (
    MAX_SAMPLES,
    Learned,
    Sample,
    calibrated,
    corrected_window,
    learned_from_refusal,
)
from proxy.core.items import Item
from proxy.core.projection import ProjectionReport
from proxy.core.provider_errors import Overflow, ProviderError, read_provider_error
from proxy.core.tokens import TokenCounter, is_openai_model
from proxy.counting import ProviderCounter, calibrated_counter, raw_count
from proxy.policy import Policy
from proxy.server.discovery import ask_provider, discover
from proxy.server.errors import ApiError
from proxy.server.explain import provider_error
from proxy.server.relay import upstream_base
from proxy.server.state import LEARNED, LOG_FIELDS, METRICS, PROVIDER_COUNTS, STORE, TENANT_POLICY
from proxy.server.validate import JsonDict
from proxy.store.base import LearnedRecord, LearnedStore, StoreError
from proxy.upstream import Deadline, UpstreamResponse

# -- a context-length refusal -----------------------------------------------------------------


learned_log = structlog.get_logger("threadkeeper.learned")

MAX_MODELS = 4096  # model names come from clients: never an unbounded map
TTL_SECONDS = 60.0  # how long a process trusts its copy before reading the store again
# Answers between writes while the correction holds still. The store's copy never lags
# the correction by MEANINGFUL (`changed` compares with what was written, so small moves
# that add up are written too): these writes bring only the samples and the answer
# count up to date, a SQLite transaction each (at 8, one every 8 answers on a busy model).
WRITE_EVERY = 64
MEANINGFUL = 0.01  # a ratio that moved by this share is written at once
DISCOVERY_TTL_SECONDS = 3600.0  # how long a provider's listed window is trusted

Key = tuple[str, str, str]  # (tenant, upstream base URL, model)


@dataclass
class _Entry:
    learned: Learned
    read_at: float  # when the store was last read for it (monotonic seconds)
    written: Learned | None = None  # what the store holds, as far as this process knows
    pending: int = 0  # changes since the last write
    asked_at: float | None = None  # when the provider was last asked for its window


class LearnedLimits:
    def __init__(
        self,
        max_entries: int = MAX_MODELS,
        *,
        ttl: float = TTL_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._max = max_entries
        self._ttl = ttl
        self._now = monotonic
        self._saving: dict[Key, asyncio.Task[None]] = {}  # save_soon's writes in flight

    def get(self, key: Key) -> Learned | None:
        found = self._entries.get(key)
        if found is None:
            return None
        self._entries.move_to_end(key)
        return found.learned

    def put(self, key: Key, learned: Learned) -> None:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(learned, self._now())
        entry.learned = learned
        entry.pending += 1
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    async def load(self, key: Key, store: LearnedStore | None) -> Learned | None:
        """The entry, read from the store on first use and once its copy is older than the
        TTL (what another replica learnt since). Changes not yet written stay this
        process's; a store that fails is logged and the copy in memory serves."""
        entry = self._entries.get(key)
        fresh = entry is not None and self._now() - entry.read_at < self._ttl
        if store is None or fresh:
            return self.get(key)
        try:
            record = await store.learned_get(*key)
        except StoreError as exc:
            # Read again after the TTL, not on every request while the store is down.
            learned_log.warning("learned_limits_unreadable", model=key[2], error=str(exc))
            if entry is None:
                entry = self._entries[key] = _Entry(Learned(), self._now())
            entry.read_at = self._now()
            return self.get(key)
        entry = self._entries.get(key)  # another request may have put it meanwhile
        stored = from_state(record.state) if record is not None else None
        if entry is None:
            if stored is None:
                entry = _Entry(Learned(), self._now())
            else:
                entry = _Entry(stored, self._now(), written=stored)
            self._entries[key] = entry
        else:
            entry.read_at = self._now()
            if stored is not None and entry.pending == 0:
                entry.learned = entry.written = stored
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
        return entry.learned

    def write_due(self, key: Key) -> bool:
        entry = self._entries.get(key)
        if entry is None or entry.pending == 0:
            return False
        return entry.pending >= WRITE_EVERY or changed(entry.written, entry.learned)

    async def save(
        self, key: Key, store: LearnedStore | None, now: str, *, force: bool = False
    ) -> None:
        """Writes the entry when a write is due (or `force`, with anything unwritten)."""
        entry = self._entries.get(key)
        if store is None or entry is None or entry.pending == 0:
            return
        if not force and not self.write_due(key):
            return
        learned = entry.learned
        try:
            await store.learned_put(LearnedRecord(*key, to_state(learned), now))
        except StoreError as exc:
            learned_log.warning("learned_limits_unwritten", model=key[2], error=str(exc))
            return
        entry.written, entry.pending = learned, 0

    def save_soon(self, key: Key, store: LearnedStore | None, now: str) -> None:
        """`save` in a task of its own when a write is due, off the answer's path (a
        SQLite write waits for the write lock behind other writers); one per key at a
        time, a later due answer writes what this one did not."""
        if store is None or key in self._saving or not self.write_due(key):
            return
        task = asyncio.get_running_loop().create_task(self.save(key, store, now))
        self._saving[key] = task

        def done(finished: asyncio.Task[None]) -> None:
            self._saving.pop(key, None)
            if not finished.cancelled() and (error := finished.exception()) is not None:
                learned_log.error("learned_limits_unwritten", model=key[2], error=repr(error))

        task.add_done_callback(done)

    async def settled(self) -> None:
        """Until the writes `save_soon` started have ended."""
        while self._saving:
            await asyncio.wait(list(self._saving.values()))

    async def flush(self, store: LearnedStore | None, now: str) -> None:
        """Everything not yet written (at shutdown), once the writes in flight ended."""
        await self.settled()
        for key in [k for k, e in self._entries.items() if e.pending]:
            await self.save(key, store, now, force=True)

    def discovery_due(self, key: Key) -> bool:
        """Whether the provider is to be asked for the model's window now: once per
        DISCOVERY_TTL_SECONDS, whatever it answered (nothing listed included)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(Learned(), self._now())
        if entry.asked_at is not None and self._now() - entry.asked_at < DISCOVERY_TTL_SECONDS:
            return False
        entry.asked_at = self._now()
        return True


def learned_key(request: web.Request, model: str) -> Key:
    """Where what the provider taught about `model` is kept: per tenant and upstream."""
    policy = request[TENANT_POLICY]
    return (policy.tenant, upstream_base(request, policy), model)


async def learned_for(request: web.Request, model: str) -> Learned | None:
    """What is known of the model: read from the store on first use (and after a TTL), and,
    when only the policy's "*" names it, what the provider lists (asked once per TTL)."""
    limits = request.app.get(LEARNED)
    if limits is None:
        return None
    key = learned_key(request, model)
    learned = await limits.load(key, request.app.get(STORE))
    # OpenAI lists no windows: its own model names are never asked about.
    unnamed = not request[TENANT_POLICY].names_model(model) and not is_openai_model(model)
    if unnamed and limits.discovery_due(key):
        learned = await discover(request, model, key, limits)
    return learned


def changed(before: Learned | None, after: Learned) -> bool:
    """Whether the store's copy is meaningfully behind: a new window, another per-item
    overhead, or a ratio that moved by MEANINGFUL or more."""
    if before is None:
        return True
    if (before.window, before.discovered, before.item_overhead) != (
        after.window,
        after.discovered,
        after.item_overhead,
    ):
        return True
    return abs(after.ratio - before.ratio) >= MEANINGFUL * before.ratio


def model_window(policy: Policy, model: str, learned: Learned | None) -> tuple[int, str]:
    """The model's window before any correction, and where it came from: the policy's
    entry when it names the model, else the window the provider lists for it, else the
    policy's "*". ("learned": a refusal stated a smaller one, applied by the budget.)"""
    window = policy.limits_for(model).context_window
    source = "policy"
    if not policy.names_model(model) and learned is not None and learned.discovered:
        window, source = learned.discovered, "discovered"
    if learned is not None and learned.window is not None and learned.window < window:
        return learned.window, "learned"
    return window, source


# --- the store's JSON form ---------------------------------------------------------------


def to_state(learned: Learned) -> dict[str, Any]:
    return {
        "window": learned.window,
        "ratio": learned.ratio,
        "overhead": learned.overhead,
        "discovered": learned.discovered,
        "answers": learned.answers,
        "samples": [[s.estimate, s.items, s.actual] for s in learned.samples],
    }


def from_state(state: dict[str, Any]) -> Learned:
    """A stored state; anything malformed is left out (it is only ever a better guess)."""

    def count(value: Any) -> int | None:
        return (
            value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
        )

    def number(value: Any, default: float) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return float(value) if ok and math.isfinite(value) and value >= 0 else default

    samples = []
    raw = state.get("samples")
    for row in raw[-MAX_SAMPLES:] if isinstance(raw, list) else []:
        if isinstance(row, list) and len(row) == 3 and all(count(v) is not None for v in row):
            samples.append(Sample(*row))
    return Learned(
        window=count(state.get("window")),
        ratio=max(number(state.get("ratio"), 1.0), 1e-3),
        overhead=number(state.get("overhead"), 0.0),
        discovered=count(state.get("discovered")),
        answers=count(state.get("answers")) or 0,
        samples=tuple(samples),
    )


# -- counting in the provider's tokens --------------------------------------------------------

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


overflow_log = structlog.get_logger("threadkeeper.overflow")

CODE = "context_length_exceeded"


@dataclass(frozen=True)
class Refusal:
    error: ProviderError
    overflow: Overflow
    shown: JsonDict  # what the log line and the explain record keep (explain.provider_error)


async def context_refusal(upstream: UpstreamResponse) -> Refusal | None:
    """The provider's answer when it refuses the request for its length. Error bodies are
    read whole before `send()` returns (proxy/upstream.py), so this waits on nothing."""
    if upstream.status < 400:
        return None
    body = await upstream.aread()
    content_type = upstream.provider_headers.get("content-type", "")
    error = read_provider_error(upstream.status, content_type, body)
    if error.overflow is None:
        return None
    return Refusal(error, error.overflow, provider_error(upstream.status, body))


def learn(
    request: web.Request,
    model: str,
    overflow: Overflow,
    report: ProjectionReport,
    base: TokenCounter,
    items: int,
) -> Learned:
    """The provider's window and its count against the proxy's, kept for the model's next
    budgets (proxy/server/model_budget.py). `base`: the counter of the refused projection,
    uncorrected; `items`: how many items it sent."""
    limits = request.app[LEARNED]
    key = learned_key(request, model)
    before = limits.get(key)
    learned = learned_from_refusal(
        before,
        window=overflow.window,
        provider_prompt=overflow.prompt_tokens,
        completion=overflow.completion_tokens,
        estimate=report.prompt_tokens,
        output=report.output,
    )
    if overflow.prompt_tokens and items > 0:
        # The refusal's own count is a sample like any answer's usage: the correction
        # fitted next bounds it too.
        counter = calibrated_counter(base, before)
        estimate = raw_count(counter, report.prompt_tokens, items)
        if estimate > 0:
            learned = calibrated(learned, Sample(estimate, items, overflow.prompt_tokens))
    limits.put(key, learned)
    overflow_log.info(
        "provider_context_refusal",
        model=model,
        window=overflow.window,
        provider_prompt_tokens=overflow.prompt_tokens,
        estimated_prompt_tokens=report.prompt_tokens,
        learned_window=learned.window,
        learned_ratio=round(learned.ratio, 4),
    )
    return learned


def retry_window(
    request: web.Request, model: str, learned: Learned, overflow: Overflow, report: ProjectionReport
) -> int:
    """W for the retry: the policy's window corrected by what was learnt, and in any case
    strictly less than what was refused (its prompt at least one token smaller)."""
    window = model_window(request[TENANT_POLICY], model, learned)[0]
    corrected = corrected_window(
        window, report.output, learned, provider_output=overflow.completion_tokens or 0
    )
    return min(corrected, report.prompt_tokens - 1 + report.output + report.epsilon)


def observe(request: web.Request, route: str, outcome: str, **facts: object) -> None:
    """The metric, and what the log line and the explain record say of the retry."""
    request.app[METRICS].overflow_retries.labels(route, outcome).inc()
    request[LOG_FIELDS]["overflow_retry"] = {"outcome": outcome, **facts}


def cannot_fit(error: ProviderError, exc: ApiError) -> ApiError:
    """The turn's pinned text and current turn do not fit the window the provider states."""
    return ApiError(
        400,
        f"The provider refused this request for its length ({error.message.rstrip('.')}). "
        f"Under the window it states: {exc.message}",
        param=exc.param,
        code=CODE,
    )


def refused_again(error: ProviderError, report: ProjectionReport, param: str) -> ApiError:
    """The retry, smaller, was refused too: the client gets the breakdown of what was sent."""
    return ApiError(
        400,
        f"The provider refused this request for its length even after its history was "
        f"reduced to {report.prompt_tokens} tokens by the proxy's count (pinned "
        f"{report.system}, tools {report.tools}, current turn {report.current}, history "
        f"{report.history_after}, output reserve {report.output}): "
        f"{error.message}",
        param=param,
        code=CODE,
    )
