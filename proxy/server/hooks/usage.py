"""Usage: the provider's reported prompt tokens on the request's log line (the budget
breakdown is logged where the projection is made, proxy/server/rebuild.py), and the
truth every answer tells about the provider's count (issue 21, item 2): its prompt
tokens against the proxy's own count of exactly what was sent, a sample of the model's
correction (proxy/server/learned.py). Cached tokens are part of the prompt tokens and
change nothing; a request with hosted tools (web search, file search...) is no sample,
as the provider adds their results to the prompt it counts. An answer far below what was sent is a provider that cut the prompt
without a word (Ollama at its num_ctx): warned once per model, counted, never a sample."""

from __future__ import annotations

import structlog
from aiohttp import web

from proxy.core.budget import Sample, calibrated
from proxy.counting import calibrated_counter, raw_count
from proxy.server.learned import Key
from proxy.server.provider_counts import counted_by_provider
from proxy.server.rebuild import is_small, learned_key
from proxy.server.state import CLOCK, LEARNED, LOG_FIELDS, METRICS, STORE, TENANT_POLICY
from proxy.server.turn import Turn, TurnHook, sent_items
from proxy.server.validate import JsonDict

log = structlog.get_logger("threadkeeper.usage")

# Reported prompt tokens below this share of the proxy's own count of what it sent: the
# provider did not read all of it (no tokenizer counts a text at under half of o200k's).
TRUNCATED_SHARE = 0.5
_warned: set[Key] = set()  # models warned about in this process (bounded by MAX_WARNED)
MAX_WARNED = 4096


class UsageHook(TurnHook):
    def __init__(self) -> None:
        self.key: Key | None = None

    def answered(self, turn: Turn, answer: JsonDict) -> None:
        tokens = turn.api.usage_input_tokens(answer)
        if tokens is None:
            return
        turn.request[LOG_FIELDS]["usage_input_tokens"] = tokens
        if turn.projection is None or turn.counter is None or tokens <= 0:
            return
        if provider_added_input(turn.body):
            return
        request = turn.request
        limits = request.app.get(LEARNED)
        if limits is None:
            return
        inputs = turn.api.budget_inputs(turn.body)
        model = inputs.model
        key = learned_key(request, model)
        learned = limits.get(key)
        report = turn.projection.report
        items = sent_items(turn)
        if counted_by_provider(request, model):
            # The budget counted in the provider's tokens; the sample is of the estimate
            # (what counts what the provider could not: summaries made here, late items),
            # so what was sent is counted again with it (each item's count is cached).
            sent = turn.projection.items
            if not is_small(([i.raw for i in sent], inputs.tools, inputs.instructions)):
                return  # not on the loop: the next small turn is a sample
            base = turn.counter
            estimate = (
                base.items(sent)
                + base.instructions(inputs.instructions)
                + base.tools(inputs.tools)
                + base.reply_tokens
            )
        else:
            counter = calibrated_counter(turn.counter, learned)
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
        gauge = request.app[METRICS].count_correction
        gauge.labels(tenant, model, "ratio").set(round(updated.ratio, 4))
        gauge.labels(tenant, model, "overhead").set(round(updated.overhead, 3))
        gauge.labels(tenant, model, "answers").set(updated.answers)

    async def finished(self, turn: Turn) -> None:
        """The correction is written when it moved meaningfully or enough answers piled
        up (LearnedLimits.save): most turns never touch the store here."""
        if self.key is None:
            return
        app = turn.request.app
        await app[LEARNED].save(self.key, app.get(STORE), app[CLOCK].iso())


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
    log.warning(
        "provider_silent_truncation",
        model=model,
        reported_prompt_tokens=tokens,
        sent_prompt_tokens=estimate,
        hint="the provider cut the prompt without an error; on Ollama set num_ctx "
        "(docs/integrations.md): the proxy then budgets to it",
    )
