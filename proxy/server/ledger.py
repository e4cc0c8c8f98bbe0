"""The side-effect ledger at the edge (SPEC 6): the pure rules of proxy/core/ledger.py
applied to what the provider answers and what the client sends.

Per request, a `LedgerGuard` (tenant policy, store, thread scope):

- `record_outputs`: the client's tool outputs complete their entries (`output_outcome`
  says completed or failed); `ledger_resolve` only changes an `issued` entry, so a second
  output for one call id is ignored.
- `restore_calls`: on a stored thread, an output for a call the thread never saw (its
  turn was cut off after the call went out) gets the call item back from the ledger, as
  a function or a custom tool call.
- `answer_dangling`: a call sent without an output (the client crashed after receiving
  it, then wrote again) gets one before anything is sent, since the provider refuses an
  unpaired call: "outcome unknown, check first" from the ledger, or "no output was
  recorded" for an unguarded call on a stored thread. On stored threads the answer is
  kept with the turn (Chat reconciliation skips it: the client never saw it).
- `judge`: every side-effecting call the provider emits is issued in the ledger (write
  ahead, committed before its bytes reach the client) and decided. HAND_OUT goes to the
  client; REPLAY / BLOCK / UNKNOWN_OUTCOME never do: `model_output` answers the model.
  FAILED_BEFORE re-arms the failed entry (conditional failed -> issued, new call id,
  attempts + 1) and hands the call out when that update won; a loser decides again.
- `settle`: runs the continuation rules (proxy/core/continuation.py): while every call
  of an answer is withheld, the turn continues upstream with the synthetic outputs (at
  most `policy.idempotency.max_replays` rounds); the client gets the last answer with
  the withheld calls stripped.

Stored threads: Responses threads (conversation, previous_response_id) log the whole
trajectory (every round's output items and the synthetic outputs), so the model sees
next turn what was replayed. Chat threads (X-Thread-Id) log what the client saw: Chat
clients resend their history and the thread reconciles it by content
(threads.new_chat_messages), so messages the client never saw would break that match;
the ledger still guards a repeated call in a later turn.

The ledger's rewriters of a turn (proxy/server/turn.py, `rewrite`; the list a handler
gives is turn.REWRITERS):

    restore_ledger_calls     a stored thread's lost call put back before its output
    refuse_orphans           an output for an unknown call is a 400 (SPEC 6)
    answer_dangling_calls    a call that would reach the provider unanswered gets an output

The operator endpoints over these entries are in proxy/server/ledger_routes.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from proxy.core.continuation import Judge, Settled, continuation
from proxy.core.items import Item
from proxy.core.ledger import (
    CallKind,
    Decision,
    ToolCall,
    ToolRule,
    dangling_calls,
    dangling_decision,
    decide,
    ledger_result,
    ledger_scope,
    model_output,
    output_outcome,
    outputs_in,
    place_answers,
    render_idempotency_key,
    unanswered_output,
)
from proxy.policy import Policy
from proxy.server.api import ApiShape
from proxy.server.errors import invalid
from proxy.server.state import LOG_FIELDS, METRICS, NAMESPACE, STORE, TENANT_POLICY
from proxy.server.validate import JsonDict
from proxy.store.base import LedgerEntry, LedgerStore
from proxy.threads import first_orphan

if TYPE_CHECKING:
    from proxy.server.turn import New, Turn, Window

log = structlog.get_logger("threadkeeper.ledger")

AskUpstream = Callable[[JsonDict], Awaitable[JsonDict | None]]
REARM_ATTEMPTS = 3


def custom_tool_names(tools: Iterable[Any]) -> frozenset[str]:
    """Names of the request's custom tools, in Chat's ({"type": "custom", "custom": {...}})
    or Responses' ({"type": "custom", "name": ...}) shape."""
    names: set[str] = set()
    for tool in tools:
        if isinstance(tool, Mapping) and tool.get("type") == "custom":
            nested = tool.get("custom")
            name = (nested if isinstance(nested, Mapping) else tool).get("name")
            if isinstance(name, str):
                names.add(name)
    return frozenset(names)


def tool_rules(policy: Policy) -> dict[str, ToolRule]:
    """The policy's side-effecting tools as the core's rules."""
    return {
        name: ToolRule(
            side_effect=tool.side_effect,
            idempotency_key=tool.idempotency_key,
            scope=tool.scope,
            on_duplicate=tool.on_duplicate,
        )
        for name, tool in policy.side_effect_tools.items()
    }


@dataclass(frozen=True)
class LedgerDecision:
    """One emitted call, decided. `output` is the model's answer when it is withheld."""

    call: ToolCall
    decision: Decision
    entry: LedgerEntry
    output: JsonDict | None

    @property
    def withheld(self) -> bool:
        return self.output is not None


class LedgerGuard:
    """The ledger's rules for one request; `active` is false when no tool is guarded."""

    def __init__(
        self,
        request: web.Request,
        *,
        api: ApiShape,
        thread_id: str | None,
        now: Callable[[], str],
    ) -> None:
        policy = request[TENANT_POLICY]
        self.tenant = policy.tenant  # metrics labels and logs
        self.namespace = request[NAMESPACE]  # every store call
        self.rules = tool_rules(policy)
        self.max_replays = policy.idempotency.max_replays
        self.store: LedgerStore = request.app[STORE]
        self.metrics = request.app[METRICS]
        self.api = api
        self.thread_id = thread_id
        self.now = now
        self.log_fields = request[LOG_FIELDS]

    @property
    def active(self) -> bool:
        return bool(self.rules)

    def guarded(self, tool_name: Any) -> bool:
        return isinstance(tool_name, str) and tool_name in self.rules

    async def record_outputs(self, messages_or_items: str | Sequence[Mapping[str, Any]]) -> None:
        """The client's outputs complete their issued entries; a repeat changes nothing."""
        if not self.active:
            return
        for call_id, output in outputs_in(messages_or_items, self.api.name):
            entry = await self.store.ledger_by_call(self.namespace, call_id)
            if entry is None or entry.status != "issued" or output is None:
                continue
            result = ledger_result(output)
            await self.store.ledger_resolve(
                self.namespace,
                entry.scope,
                entry.key,
                status=output_outcome(output),
                result=result,
                now=self.now(),
            )

    async def restore_calls(
        self, known: Iterable[Item], new: Sequence[Item], custom_tools: Collection[str] = ()
    ) -> list[Item]:
        """`new` with the ledger's call item put back before each output whose call the
        thread never saw (a turn cut off after the call went out). Other orphans stay:
        first_orphan turns them into the 400 of SPEC 6.

        The call comes back in the kind it was made: a custom tool call when the output
        is a custom_tool_call_output or the request declares the tool `custom`
        (`custom_tools`), else a function call."""
        seen = {call_id for item in (*known, *new) for call_id in item.call_ids}
        restored: list[Item] = []
        for item in new:
            call_id = item.output_for
            if item.kind == "tool_output" and call_id is not None and call_id not in seen:
                entry = await self.store.ledger_by_call(self.namespace, call_id)
                if entry is not None:
                    custom = item.type == "custom_tool_call_output" or entry.tool in custom_tools
                    restored.append(
                        self._call_item(entry, call_id, "custom" if custom else "function")
                    )
                    seen.add(call_id)
            restored.append(item)
        return restored

    def _call_item(self, entry: LedgerEntry, call_id: str, kind: CallKind) -> Item:
        return self.api.call_item(entry.tool, call_id, entry.arguments, kind)

    async def answer_dangling(
        self, known: Sequence[Item], new: Sequence[Item], *, unguarded_too: bool
    ) -> list[Item]:
        """`new` with an output for every call that would otherwise be sent without one
        (a client that crashed after receiving it, then wrote again): the provider refuses
        an unpaired call. A call the ledger knows is answered from its entry (issued:
        "outcome unknown, check first", logged and counted; completed/failed: its recorded
        result). Any other function/custom call is answered "no output was recorded"
        when `unguarded_too` (stored threads, which the client cannot edit), else left
        for the provider to judge (a stateless request's history is the client's)."""
        answers: dict[str, Item] = {}
        for call in dangling_calls(known, new):
            entry = await self.store.ledger_by_call(self.namespace, call.call_id)
            if entry is not None:
                output = self._decided(call, dangling_decision(entry.status), entry).output
            elif unguarded_too:
                closed = {"call_id": call.call_id, "thread_id": self.thread_id}
                self._log(log.warning, "unanswered_call_closed", call, **closed)
                output = unanswered_output(call)
            else:
                continue
            if output is not None:
                answers[call.call_id] = self.api.item(output)
        return place_answers(new, answers) if answers else list(new)

    async def judge(
        self, calls: Sequence[ToolCall], response_id: str | None
    ) -> list[LedgerDecision]:
        return [await self.judge_call(call, response_id) for call in calls]

    async def judge_call(self, call: ToolCall, response_id: str | None) -> LedgerDecision:
        """Write ahead, then decide (ledger.decide's table); the entry is committed when
        this returns, so the caller may hand the call out."""
        rule = self.rules[call.name]
        rendered = render_idempotency_key(rule, call)
        if rendered.fallback:
            self._log(
                log.warning, "ledger_fallback_key", call, key=rendered.key, reason=rendered.reason
            )
        scope = ledger_scope(rule, self.thread_id)
        now = self.now()
        fresh = LedgerEntry(
            tenant=self.namespace,
            scope=scope,
            key=rendered.key,
            tool=call.name,
            call_id=call.call_id,
            thread_id=self.thread_id,
            response_id=response_id,
            status="issued",
            arguments=call.arguments,
            result=None,
            attempts=1,
            created_at=now,
            updated_at=now,
        )
        for _ in range(REARM_ATTEMPTS):
            entry, created = await self.store.ledger_issue(fresh)
            decision = decide(entry.status, created, entry.call_id, call.call_id, rule)
            if decision is not Decision.FAILED_BEFORE:
                return self._decided(call, decision, entry)
            if await self.store.ledger_rearm(
                self.namespace, scope, rendered.key, call_id=call.call_id, now=now
            ):
                rearmed = replace(
                    entry, status="issued", call_id=call.call_id, result=None, updated_at=now
                )
                return self._decided(call, Decision.HAND_OUT, rearmed)
        # Re-arms kept losing to other replicas: never risk a second hand-out.
        return self._decided(call, Decision.UNKNOWN_OUTCOME, entry)

    def _log(self, level: Callable[..., Any], event: str, call: ToolCall, **fields: Any) -> None:
        level(event, tenant=self.tenant, tool=call.name, **fields)

    def _decided(self, call: ToolCall, decision: Decision, entry: LedgerEntry) -> LedgerDecision:
        # What the ledger decided, on the request's log line and in its explain record.
        verdict = {"tool": call.name, "call_id": call.call_id, "key": entry.key}
        self.log_fields.setdefault("ledger", []).append({**verdict, "verdict": decision.value})
        if decision is Decision.HAND_OUT:
            return LedgerDecision(call, decision, entry, None)
        about = {
            "tenant": self.tenant,
            "tool": call.name,
            "key": entry.key,
            "call_id": call.call_id,
        }
        if decision is Decision.UNKNOWN_OUTCOME:
            log.warning(
                "ledger_unknown_outcome",
                **about,
                scope=entry.scope,
                earlier_call_id=entry.call_id,
                issued_at=entry.created_at,
            )
            self.metrics.ledger_unknown_outcome.labels(self.tenant, call.name).inc()
        else:
            log.info("ledger_duplicate_withheld", **about, decision=decision.value)
        output = model_output(
            call, decision, entry.result, entry.call_id, entry.created_at, entry.key
        )
        return LedgerDecision(call, decision, entry, output)


async def settle(
    guard: LedgerGuard,
    api: ApiShape,
    sent: JsonDict,
    answer: JsonDict,
    ask: AskUpstream,
    *,
    response_id: str | None,
    judged: Sequence[LedgerDecision] | None = None,
) -> Settled:
    """Runs the continuation rules (proxy/core/continuation.py) against the ledger and
    the provider: the guard judges, `ask` sends a continuation upstream."""
    flow = continuation(
        api, sent, answer, guard.rules, max_replays=guard.max_replays, judged=judged
    )
    reply: Any = None
    try:
        while True:
            command = flow.send(reply)
            if isinstance(command, Judge):
                reply = await guard.judge(command.calls, response_id or command.answer_id)
            else:
                reply = await ask(command.body)
    except StopIteration as stop:
        settled: Settled = stop.value
        return settled


# -- the ledger's rewriters of a turn (proxy/server/turn.py, `rewrite`) ---------------------


async def restore_ledger_calls(turn: Turn, window: Window, new: New) -> tuple[Window, New]:
    """On a stored thread: the ledger's call before an output the thread never saw (its
    turn was cut off after the call went out)."""
    guard = turn.guard
    if window.loaded is None or not guard.active:
        return window, new
    custom = custom_tool_names(turn.inputs.tools)
    restored = await guard.restore_calls(window.loaded.items, new.items, custom)
    return window, replace(new, items=tuple(restored))


async def refuse_orphans(turn: Turn, window: Window, new: New) -> tuple[Window, New]:
    """A new tool output answering no call before it is OpenAI's 400 (SPEC 6); a
    stateless request's output for a call it never shows is the provider's to judge."""
    orphan = first_orphan(window.items, new.items, stateless=window.loaded is None)
    if orphan is not None:
        raise invalid(turn.api.orphan_message(orphan), param=turn.api.history)
    return window, new


async def answer_dangling_calls(turn: Turn, window: Window, new: New) -> tuple[Window, New]:
    """Stored threads always (the client cannot edit them); a stateless request only for
    the calls the ledger guards (its history is the client's)."""
    stored = window.loaded is not None
    if not (stored or turn.guard.active):
        return window, new
    answered = await turn.guard.answer_dangling(window.items, new.items, unguarded_too=stored)
    return window, replace(new, items=tuple(answered))
