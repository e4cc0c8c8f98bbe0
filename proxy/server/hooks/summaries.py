"""LLM summaries at the turn's named points (proxy/server/summaries.py does the work).

- load: the projection gets the LLM summaries ready for its chunks (`turn.summaries`);
- projected: digests it asked for and lacked are read from the store (another process
  wrote them); when some were there, the projection is made again with them. A
  stateless request then stores the deterministic digests it sends as their chunks'
  summaries (`BackgroundSummaries.claim`), unless another process stored one first,
  which it then sends instead;
- answered: the answer reached the client;
- finished: only then, past the high-water mark, the chunk the next cut is predicted to
  take is summarized in the background. A block already sent with the deterministic
  digest is not summarized again: its LLM summary would change the prefix the
  provider caches (a stored thread keeps its cut; a stateless client's replayed cut
  keeps its blocks the same way).

Nothing here waits for a summarizer call, and nothing here raises into the turn: a
failure to read or start summaries is logged and the deterministic digest stands.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import structlog
from aiohttp import web

from proxy.core.items import Item
from proxy.core.projection import Projection, SummaryChunk, request_ends
from proxy.policy import Policy
from proxy.server.auth import bearer_token
from proxy.server.rebuild import budget_log_fields, learned_key, rebuild
from proxy.server.relay import provider_key, upstream_base
from proxy.server.state import LEARNED, LOG_FIELDS, NAMESPACE, SUMMARIES, TENANT_POLICY
from proxy.server.summaries import BackgroundSummaries, Job, Ready, bounded_put
from proxy.server.turn import Turn, TurnHook, project
from proxy.server.validate import JsonDict
from proxy.summarizer import Target

log = structlog.get_logger("threadkeeper.summaries")

# How many turns like the current one a stateful thread's next cut is looked for in.
LOOKAHEAD_TURNS = 4
# Projections a stateless request makes at most while other processes' summaries for its
# chunks turn up (each found one may change the digests of the blocks after it).
CLAIM_ROUNDS = 3


class SummaryHook(TurnHook):
    """Present on every model turn; does nothing for a tenant without a summarizer."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.policy: Policy = request[TENANT_POLICY]
        self.background: BackgroundSummaries | None = request.app.get(SUMMARIES)
        self.ready: Ready | None = None
        self.answer: JsonDict | None = None  # set once the answer reached the client
        self.target: Target | None = None

    async def load(self, turn: Turn) -> None:
        settings = self.policy.memory.summarizer
        if settings is None or self.background is None:
            return
        namespace = self.request[NAMESPACE]
        self.ready = self.background.ready(namespace, settings.model, turn.api.name)
        turn.summaries = self.ready

    async def projected(self, turn: Turn) -> None:
        if self.ready is None or self.background is None or turn.projection is None:
            return
        try:
            found = await self.background.fetch(self.ready) if self.ready.missing() else 0
            if found:
                await self._project_again(turn)
            # A stateless request's digests, once sent, stay: no process may send an
            # LLM summary for the same chunk later (the replayed cut would change its
            # prefix). A summary stored first is sent instead; it may change the
            # digests of the blocks after it, which are claimed in turn.
            for _ in range(CLAIM_ROUNDS if stateless(turn) else 0):
                assert turn.projection is not None
                chunks = sent_chunks(turn.projection)
                if not chunks or not await self.background.claim(self.ready, chunks):
                    break
                await self._project_again(turn)
        except Exception:
            log.exception("summaries_store_failed", tenant=self.policy.tenant)

    async def _project_again(self, turn: Turn) -> None:
        """With the summaries found: observed once, the request's log line gets the
        projection it sends."""
        turn.projection, turn.counter = await project(turn, observe=False)
        self.request[LOG_FIELDS].update(budget_log_fields(turn.projection))

    def answered(self, turn: Turn, answer: JsonDict) -> None:
        self.answer = answer

    async def finished(self, turn: Turn) -> None:
        """After the answer was relayed: start what later requests will want."""
        if self.answer is None or self.ready is None or turn.projection is None:
            return
        if turn.verbatim:
            return  # truncation "disabled": this client's requests are never cut
        try:
            self.target = self._target()
            self._keep_used(turn, turn.projection)
            if self._past_high_water(turn.projection):
                self._predict_next_cut(turn, self.answer)
        except Exception:
            log.exception("summaries_not_started", tenant=self.policy.tenant)

    def _keep_used(self, turn: Turn, projection: Projection) -> None:
        """The LLM summaries a thread's projection used (written for another thread or
        request with the same history) are kept for this thread too."""
        thread_id = kept_for(turn)
        used = [chunk.digest for chunk in projection.chunks if chunk.ready]
        if thread_id is not None and used and self.background is not None:
            prefix = (self.request[NAMESPACE], self._model(), turn.api.name)
            self.background.keep_later(self.policy.tenant, prefix, thread_id, used)

    def _past_high_water(self, projection: Projection) -> bool:
        settings = self.policy.memory.summarizer
        assert settings is not None
        report = projection.report
        return report.history_after >= settings.high_water * report.history_budget > 0

    def _predict_next_cut(self, turn: Turn, answer: JsonDict) -> None:
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
        assert turn.projection is not None and self.background is not None
        reply = [turn.api.item(raw) for raw in turn.api.reply(answer) or []]
        real = [*turn.known, *turn.new, *reply]
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
        loaded = turn.loaded
        cut, first_position = None, 0  # a stateless client's next request: none stored
        replayed = stateless(turn)
        if loaded is not None and not replayed:
            cut, first_position = turn.projection.cut or loaded.cut(), loaded.first_position
        inputs = turn.api.budget_inputs(turn.body)
        namespace = self.request[NAMESPACE]
        thread = loaded.thread_id if loaded is not None else real[start].digest
        known = turn.projection.cut
        after = (namespace, thread), known.start if known is not None else -1
        if self.background.predicted.get(after[0]) == after[1]:
            return  # predicted since the thread was last cut: the same chunk again
        background = self.background
        ready = background.ready(namespace, self._model(), turn.api.name)
        sent = {chunk.digest for chunk in turn.projection.chunks}  # kept as they were sent

        # The requests of a turn like this one: up to each user message or batch of tool
        # results the model answers (a cut mostly comes when a large result arrives).
        steps = request_ends(turn_items)
        # The same correction as the real turns' budgets, so the predicted cut is theirs.
        learned = self.request.app[LEARNED].get(learned_key(self.request, inputs.model))

        async def predict() -> None:
            for ahead, step in itertools.product(range(LOOKAHEAD_TURNS), steps):
                assumed = [api.item(dict(raw)) for raw in [*this_turn * ahead, *this_turn[:step]]]
                history = [*real, *assumed]
                projection, _ = await rebuild(
                    self.policy,
                    inputs.model,
                    history,
                    tools=inputs.tools,
                    requested_output=inputs.requested_output,
                    instructions=inputs.instructions,
                    first_position=first_position,
                    cut=cut,
                    stateless=replayed,
                    summaries=ready,
                    background=True,
                    learned=learned,
                )
                self._keep_used(turn, projection)
                chunks = [c for c in sent_chunks(projection) if c.digest not in sent]
                if chunks:
                    await self._summarize_predicted(turn, chunks, real)
                    bounded_put(background.predicted, *after)
                    return

        key = (namespace, "predict", thread)  # the namespace first: the caps count it
        self.background.spawn(namespace, self.policy.tenant, key, predict)

    async def _summarize_predicted(
        self, turn: Turn, chunks: Sequence[SummaryChunk], real: Sequence[Item]
    ) -> None:
        """The predicted chunks made of the thread's own items (never of the assumed
        turns ahead, which the real cut will hold other items for)."""
        assert self.background is not None
        own = {id(item) for item in real}
        for chunk in chunks:
            if all(id(item) in own for item in chunk.items):
                await self.background.run_now(self._job(turn, chunk))

    def _job(self, turn: Turn, chunk: SummaryChunk) -> Job:
        assert turn.counter is not None and self.target is not None
        return Job(
            namespace=self.request[NAMESPACE],
            thread_id=kept_for(turn),
            policy=self.policy,
            target=self.target,
            api=turn.api.name,
            digest=chunk.digest,
            items=chunk.items,
            max_tokens=chunk.max_tokens,
            previous=chunk.previous,
            counter=turn.counter,
        )

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


def kept_for(turn: Turn) -> str | None:
    """The thread the turn's summaries are kept for (deleted with it): the stored thread,
    or the one this turn's commit created; None for a stateless request and for one that
    stored nothing (a Responses `store: false` request starting no chain)."""
    loaded = turn.loaded
    if loaded is None or (loaded.thread is None and not turn.committed):
        return None
    return loaded.thread_id


def sent_chunks(projection: Projection) -> list[SummaryChunk]:
    """The blocks the projection sends as the deterministic digest (Projection.chunks
    lists only blocks sent; `ready` ones are LLM summaries already)."""
    return [chunk for chunk in projection.chunks if not chunk.ready]


def stateless(turn: Turn) -> bool:
    """Whether the turn's history is the client's alone, its cut replayed with no
    stored cut: no thread, or one not stored yet (a Responses `store: false` request
    without a previous response is sent again whole; a new thread that is stored is not,
    and only wastes one summary when it arrives over budget)."""
    return turn.loaded is None or turn.loaded.thread is None
