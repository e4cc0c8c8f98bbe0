"""The turn's observers (proxy/server/turn.py, `Observer`): shown the turn's values,
they never change them.

- `Usage`: the provider's reported prompt tokens on the request's log line (the budget
  breakdown is logged where the projection is made, proxy/server/turn.py `rebuild_turn`),
  and the truth every answer tells about the provider's count (issue 21, item 2): its prompt
  tokens against the proxy's own count of exactly what was sent, a sample of the model's
  correction (proxy/server/model_budget.py). Cached tokens are part of the prompt tokens and
  change nothing; a request with hosted tools (web search, file search...) is no sample,
  as the provider adds their results to the prompt it counts. An answer far below what
  was sent is a provider that cut the prompt without a word (Ollama at its num_ctx):
  warned once per model, counted, never a sample.
- `SummariesAhead`: once the answer reached the client, past the high-water mark, the
  chunk the next cut is predicted to take is summarized in the background (the LLM
  summaries a projection uses come from the rewriter `attach_ready_summaries` and
  turn.with_found_summaries). A block already sent with the deterministic digest is not
  summarized again: its LLM summary would change the prefix the provider caches (a
  stored thread keeps its cut; a stateless client's replayed cut keeps its blocks the
  same way). Nothing here waits for a summarizer call, and nothing here raises into the
  turn: a failure to start summaries is logged and the deterministic digest stands.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import structlog
from aiohttp import web

from proxy.core.budget import Sample, calibrated
from proxy.core.items import Item
from proxy.core.memory import MemoryState
from proxy.core.projection import Projection, SummaryChunk, request_ends
from proxy.core.tokens import TokenCounter
from proxy.counting import calibrated_counter, raw_count
from proxy.policy import Policy
from proxy.server.auth import bearer_token
from proxy.server.model_budget import Key, counted_by_provider, learned_key
from proxy.server.relay import provider_key, upstream_base
from proxy.server.state import (
    CLOCK,
    LEARNED,
    LOG_FIELDS,
    METRICS,
    NAMESPACE,
    STORE,
    SUMMARIES,
    TENANT_POLICY,
)
from proxy.server.summaries import (
    BackgroundSummaries,
    Job,
    bounded_put,
    kept_for,
    replayed,
    sent_chunks,
)
from proxy.server.turn import Finished, Observer, Projected, Turn, is_small, rebuild, sent_items
from proxy.server.validate import JsonDict
from proxy.summarizer import Target

log = structlog.get_logger("threadkeeper.summaries")
usage_log = structlog.get_logger("threadkeeper.usage")

# How many turns like the current one a stateful thread's next cut is looked for in.
LOOKAHEAD_TURNS = 4


class SummariesAhead(Observer):
    """On every model turn; does nothing for a tenant without a summarizer."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.policy: Policy = request[TENANT_POLICY]
        self.background: BackgroundSummaries | None = request.app.get(SUMMARIES)
        self.answer: JsonDict | None = None  # set once the answer reached the client
        self.target: Target | None = None

    def answered(self, turn: Turn, projected: Projected, answer: JsonDict) -> None:
        self.answer = answer

    async def finished(self, finished: Finished) -> None:
        """After the answer was relayed: start what later requests will want."""
        turn, projected = finished.turn, finished.projected
        if self.answer is None or turn is None or projected is None:
            return
        if self.policy.memory.summarizer is None or self.background is None:
            return
        if turn.verbatim:
            return  # truncation "disabled": this client's requests are never cut
        try:
            self.target = self._target()
            self._keep_used(finished, projected.projection)
            if self._past_high_water(projected.projection):
                self._predict_next_cut(finished, turn, projected, self.answer)
        except Exception:
            log.exception("summaries_not_started", tenant=self.policy.tenant)

    def _keep_used(self, finished: Finished, projection: Projection) -> None:
        """The LLM summaries a thread's projection used (written for another thread or
        request with the same history) are kept for this thread too."""
        thread_id = finished_for(finished)
        used = [chunk.digest for chunk in projection.chunks if chunk.ready]
        if thread_id is not None and used and self.background is not None:
            prefix = (self.request[NAMESPACE], self._model(), self._api(finished))
            self.background.keep_later(self.policy.tenant, prefix, thread_id, used)

    def _past_high_water(self, projection: Projection) -> bool:
        settings = self.policy.memory.summarizer
        assert settings is not None
        report = projection.report
        return report.history_after >= settings.high_water * report.history_budget > 0

    def _predict_next_cut(
        self, finished: Finished, turn: Turn, projected: Projected, answer: JsonDict
    ) -> None:
        """Past the high-water mark: the coming requests are projected ahead, in the
        background: this turn and its reply join the history, and the turns until the
        cut are assumed to be like this one (copies of it; a copy of its user message is
        the current turn). The chunk the first projected cut takes gets its LLM summary
        now, so the request that makes the cut sends it from the start and the prefix
        never changes for it. When the real cut takes the same chunk (same items, limit
        and previous summary: the same digest) it sends the LLM summary; otherwise the
        deterministic digest, as without a summarizer. Stateful threads and stateless
        clients alike (whose cut is replayed from the history, so the real cut matches
        whenever the turns ahead are like the assumed ones)."""
        assert self.background is not None
        projection = projected.projection
        reply = [turn.api.item(raw) for raw in turn.api.reply(answer) or []]
        real = [*projected.window.items, *projected.new.items, *reply]
        asked = [i for i, item in enumerate(real) if item.is_user_message]
        if not asked:
            return
        # The turn so far, from its user message (a tool loop's later requests carry its
        # results: the large part of an agent's turn); calls still unanswered left out.
        start = asked[-1]
        answered = {item.output_for for item in real[start:] if item.output_for}
        turn_items = [
            item
            for item in real[start:]
            if not item.call_ids or any(c in answered for c in item.call_ids)
        ]
        this_turn = [item.raw for item in turn_items]
        api = turn.api
        loaded = projected.window.loaded
        cut, first_position = None, 0  # a stateless client's next request: none stored
        stateless = replayed(loaded)
        if loaded is not None and not stateless:
            cut, first_position = projection.cut or loaded.cut(), loaded.first_position
        inputs = turn.inputs
        namespace = self.request[NAMESPACE]
        thread = loaded.thread_id if loaded is not None else real[start].digest
        known = projection.cut
        after = (namespace, thread), known.start if known is not None else -1
        if self.background.predicted.get(after[0]) == after[1]:
            return  # predicted since the thread was last cut: the same chunk again
        background = self.background
        ready = background.ready(namespace, self._model(), turn.api.name)
        sent = {chunk.digest for chunk in projection.chunks}  # kept as they were sent

        # The requests of a turn like this one: up to each user message or batch of tool
        # results the model answers (a cut mostly comes when a large result arrives).
        steps = request_ends(turn_items)
        # The same correction as the real turns' budgets, so the predicted cut is theirs.
        learned = self.request.app[LEARNED].get(learned_key(self.request, inputs.model))

        async def predict() -> None:
            for ahead, step in itertools.product(range(LOOKAHEAD_TURNS), steps):
                assumed = [api.item(dict(raw)) for raw in [*this_turn * ahead, *this_turn[:step]]]
                history = [*real, *assumed]
                ahead_projection, _ = await rebuild(
                    self.policy,
                    inputs.model,
                    history,
                    tools=inputs.tools,
                    requested_output=inputs.requested_output,
                    instructions=inputs.instructions,
                    first_position=first_position,
                    cut=cut,
                    stateless=stateless,
                    summaries=ready,
                    background=True,
                    learned=learned,
                )
                self._keep_used(finished, ahead_projection)
                chunks = [c for c in sent_chunks(ahead_projection) if c.digest not in sent]
                if chunks:
                    await self._summarize_predicted(finished, chunks, real)
                    bounded_put(background.predicted, *after)
                    return

        key = (namespace, "predict", thread)  # the namespace first: the caps count it
        self.background.spawn(namespace, self.policy.tenant, key, predict)

    async def _summarize_predicted(
        self, finished: Finished, chunks: Sequence[SummaryChunk], real: Sequence[Item]
    ) -> None:
        """The predicted chunks made of the thread's own items (never of the assumed
        turns ahead, which the real cut will hold other items for)."""
        assert self.background is not None
        own = {id(item) for item in real}
        for chunk in chunks:
            if all(id(item) in own for item in chunk.items):
                await self.background.run_now(self._job(finished, chunk))

    def _job(self, finished: Finished, chunk: SummaryChunk) -> Job:
        assert finished.projected is not None and self.target is not None
        what = (chunk.digest, chunk.items, chunk.max_tokens, chunk.previous)
        thread_id, api = finished_for(finished), self._api(finished)
        return summary_job(
            self.request, self.target, thread_id, api, finished.projected.counter, what
        )

    def _api(self, finished: Finished) -> str:
        assert finished.turn is not None
        return finished.turn.api.name

    def _model(self) -> str:
        settings = self.policy.memory.summarizer
        assert settings is not None
        return settings.model

    def _target(self) -> Target:
        return summarizer_target(self.request, self.policy)


def summarizer_target(request: web.Request, policy: Policy) -> Target:
    """The tenant's upstream with the key its turns use (the client's own bearer in
    passthrough mode, which a turn forwards too)."""
    key = provider_key(request, policy) or bearer_token(request) or ""
    return Target(upstream_base(request, policy), key)


def summary_job(
    request: web.Request,
    target: Target,
    thread_id: str | None,
    api: str,
    counter: TokenCounter,
    chunk: tuple[str, Sequence[Item], int, Item | None],
    base: MemoryState | None = None,
) -> Job:
    """A summary job of the request's tenant (its store namespace and policy) for `target`:
    `chunk` is the digest, the items, the room the summary gets and the summary the items
    extend (None: the first); `base`, the state that summary renders."""
    digest, items, max_tokens, previous = chunk
    policy = request[TENANT_POLICY]
    namespace = request[NAMESPACE]
    return Job(
        namespace,
        thread_id,
        policy,
        target,
        api,
        digest,
        items,
        max_tokens,
        previous,
        counter,
        base,
    )


def finished_for(finished: Finished) -> str | None:
    """The thread a finished turn's summaries are kept for (summaries.kept_for)."""
    projected = finished.projected
    loaded = projected.window.loaded if projected is not None else None
    return kept_for(loaded, finished.committed)


# -- usage ------------------------------------------------------------------------------

# Reported prompt tokens below this share of the proxy's own count of what it sent: the
# provider did not read all of it (no tokenizer counts a text at under half of o200k's).
TRUNCATED_SHARE = 0.5
_warned: set[Key] = set()  # models warned about in this process (bounded by MAX_WARNED)
MAX_WARNED = 4096


class Usage(Observer):
    """The provider's count of each answer (the module's docstring)."""

    def __init__(self) -> None:
        self.key: Key | None = None

    def answered(self, turn: Turn, projected: Projected, answer: JsonDict) -> None:
        tokens = turn.api.usage_input_tokens(answer)
        if tokens is None:
            return
        turn.request[LOG_FIELDS]["usage_input_tokens"] = tokens
        if tokens <= 0:
            return
        if provider_added_input(turn.body):
            return
        request = turn.request
        limits = request.app.get(LEARNED)
        if limits is None:
            return
        inputs = turn.inputs
        model = inputs.model
        key = learned_key(request, model)
        learned = limits.get(key)
        report = projected.projection.report
        items = sent_items(turn, projected.projection)
        if counted_by_provider(request, model):
            # The budget counted in the provider's tokens; the sample is of the estimate
            # (what counts what the provider could not: summaries made here, late items),
            # so what was sent is counted again with it (each item's count is cached).
            sent = projected.projection.items
            if not is_small(([i.raw for i in sent], inputs.tools, inputs.instructions)):
                return  # not on the loop: the next small turn is a sample
            base = projected.counter
            estimate = (
                base.items(sent)
                + base.instructions(inputs.instructions)
                + base.tools(inputs.tools)
                + base.reply_tokens
            )
        else:
            counter = calibrated_counter(projected.counter, learned)
            estimate = raw_count(counter, report.prompt_tokens, items)
        if estimate <= 0:
            return
        if tokens < TRUNCATED_SHARE * estimate:
            truncated(request, model, key, tokens, estimate)
            return
        updated = calibrated(learned, Sample(estimate, items, tokens))
        limits.put(key, updated)
        self.key = key
        tenant = request[TENANT_POLICY].tenant
        metrics = request.app[METRICS]
        gauge = metrics.count_correction
        metrics.child(gauge, tenant, model, "ratio").set(round(updated.ratio, 4))
        metrics.child(gauge, tenant, model, "overhead").set(round(updated.overhead, 3))
        metrics.child(gauge, tenant, model, "answers").set(updated.answers)

    async def finished(self, finished: Finished) -> None:
        """The correction is written when it moved meaningfully or enough answers piled
        up (LearnedLimits.save), in a task of its own: the answer does not wait for it."""
        if self.key is None or finished.turn is None:
            return
        app = finished.turn.request.app
        app[LEARNED].save_soon(self.key, app.get(STORE), app[CLOCK].iso())


# Tools whose results the provider adds to the prompt itself (Responses' hosted tools):
# its usage then counts text the proxy never sent, and is no sample of its count.
OWN_TOOLS = frozenset({"function", "custom"})


def provider_added_input(body: JsonDict) -> bool:
    """Whether the provider may have put text of its own in the prompt it reports."""
    if body.get("web_search_options") is not None:  # Chat's search models
        return True
    tools = body.get("tools")
    return isinstance(tools, list) and any(
        isinstance(tool, dict) and tool.get("type") not in OWN_TOOLS for tool in tools
    )


def truncated(request: web.Request, model: str, key: Key, tokens: int, estimate: int) -> None:
    tenant = request[TENANT_POLICY].tenant
    request.app[METRICS].silent_truncations.labels(tenant, model).inc()
    request[LOG_FIELDS]["silent_truncation"] = {"reported": tokens, "sent": estimate}
    if key in _warned:
        return
    if len(_warned) >= MAX_WARNED:
        _warned.clear()
    _warned.add(key)
    usage_log.warning(
        "provider_silent_truncation",
        model=model,
        reported_prompt_tokens=tokens,
        sent_prompt_tokens=estimate,
        hint="the provider cut the prompt without an error; on Ollama set num_ctx "
        "(docs/integrations.md): the proxy then budgets to it",
    )
