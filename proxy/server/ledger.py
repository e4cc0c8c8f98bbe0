"""The side-effect ledger at the edge (SPEC 6): the pure rules of proxy/core/ledger.py
applied to what the provider answers and what the client sends (the operator endpoints
are proxy/server/ledger_routes.py).

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
- `settle`: the non-streamed answer loop: while every call of an answer is withheld, the
  turn continues upstream with the synthetic outputs (at most
  `policy.idempotency.max_replays` rounds); the client gets the last answer with the
  withheld calls stripped. When a withheld call sits beside a handed-out one the turn
  cannot continue (the handed-out call has no output yet): the withheld call is stripped.

Stored threads: Responses threads (conversation, previous_response_id) log the whole
trajectory (every round's output items and the synthetic outputs), so the model sees
next turn what was replayed. Chat threads (X-Thread-Id) log what the client saw: Chat
clients resend their history and the thread reconciles it by content
(threads.new_chat_messages), so messages the client never saw would break that match;
the ledger still guards a repeated call in a later turn.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import structlog
from aiohttp import web

from proxy.core.items import Api, Item, chat_item, responses_item
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
    side_effect_calls,
    unanswered_output,
)
from proxy.policy import Policy
from proxy.server.state import METRICS, NAMESPACE, STORE, TENANT_POLICY
from proxy.server.validate import JsonDict
from proxy.store.base import LedgerEntry

log = structlog.get_logger("threadkeeper.ledger")

Family = Literal["chat", "responses"]
_ARGUMENTS: Mapping[CallKind, str] = {"function": "arguments", "custom": "input"}
Ask = Callable[[JsonDict], Awaitable[JsonDict | None]]
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
        for name, tool in policy.tools.items()
        if tool.side_effect
    }


@dataclass(frozen=True)
class Verdict:
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
        self, request: web.Request, *, api: Api, thread_id: str | None, now: Callable[[], str]
    ) -> None:
        policy = request[TENANT_POLICY]
        self.tenant = policy.tenant  # metrics labels and logs
        self.namespace = request[NAMESPACE]  # every store call
        self.rules = tool_rules(policy)
        self.max_replays = policy.idempotency.max_replays
        self.store = request.app[STORE]
        self.metrics = request.app[METRICS]
        self.api = api
        self.thread_id = thread_id
        self.now = now

    @property
    def active(self) -> bool:
        return bool(self.rules)

    def guarded(self, tool_name: Any) -> bool:
        return isinstance(tool_name, str) and tool_name in self.rules

    async def record_outputs(self, messages_or_items: str | Sequence[Mapping[str, Any]]) -> None:
        """The client's outputs complete their issued entries; a repeat changes nothing."""
        if not self.active:
            return
        for call_id, output in outputs_in(messages_or_items, self.api):
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
        if self.api == "chat":
            body = {"name": entry.tool, _ARGUMENTS[kind]: entry.arguments}
            call = {"id": call_id, "type": kind, kind: body}
            return chat_item({"role": "assistant", "content": None, "tool_calls": [call]})
        item_type = "custom_tool_call" if kind == "custom" else "function_call"
        return responses_item(
            {
                "type": item_type,
                "call_id": call_id,
                "name": entry.tool,
                _ARGUMENTS[kind]: entry.arguments,
            }
        )

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
                output = self._verdict(call, dangling_decision(entry.status), entry).output
            elif unguarded_too:
                log.warning(
                    "unanswered_call_closed",
                    tenant=self.tenant,
                    tool=call.name,
                    call_id=call.call_id,
                    thread_id=self.thread_id,
                )
                output = unanswered_output(call)
            else:
                continue
            if output is not None:
                answers[call.call_id] = (
                    chat_item(output) if self.api == "chat" else responses_item(output)
                )
        return place_answers(new, answers) if answers else list(new)

    async def judge(self, calls: Sequence[ToolCall], response_id: str | None) -> list[Verdict]:
        return [await self.judge_call(call, response_id) for call in calls]

    async def judge_call(self, call: ToolCall, response_id: str | None) -> Verdict:
        """Write ahead, then decide (ledger.decide's table); the entry is committed when
        this returns, so the caller may hand the call out."""
        rule = self.rules[call.name]
        rendered = render_idempotency_key(rule, call)
        if rendered.fallback:
            log.warning(
                "ledger_fallback_key",
                tenant=self.tenant,
                tool=call.name,
                key=rendered.key,
                reason=rendered.reason,
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
                return self._verdict(call, decision, entry)
            if await self.store.ledger_rearm(
                self.namespace, scope, rendered.key, call_id=call.call_id, now=now
            ):
                rearmed = replace(
                    entry, status="issued", call_id=call.call_id, result=None, updated_at=now
                )
                return self._verdict(call, Decision.HAND_OUT, rearmed)
        # Re-arms kept losing to other replicas: never risk a second hand-out.
        return self._verdict(call, Decision.UNKNOWN_OUTCOME, entry)

    def _verdict(self, call: ToolCall, decision: Decision, entry: LedgerEntry) -> Verdict:
        if decision is Decision.HAND_OUT:
            return Verdict(call, decision, entry, None)
        if decision is Decision.UNKNOWN_OUTCOME:
            log.warning(
                "ledger_unknown_outcome",
                tenant=self.tenant,
                tool=call.name,
                key=entry.key,
                scope=entry.scope,
                earlier_call_id=entry.call_id,
                issued_at=entry.created_at,
                call_id=call.call_id,
            )
            self.metrics.ledger_unknown_outcome.labels(self.tenant, call.name).inc()
        else:
            log.info(
                "ledger_duplicate_withheld",
                tenant=self.tenant,
                tool=call.name,
                key=entry.key,
                decision=decision.value,
                call_id=call.call_id,
            )
        output = model_output(
            call, decision, entry.result, entry.call_id, entry.created_at, entry.key
        )
        return Verdict(call, decision, entry, output)


# -- answers: the shape of each API -----------------------------------------------------------


def answer_calls(family: Family, answer: JsonDict, rules: Mapping[str, ToolRule]) -> list[ToolCall]:
    if family == "chat":
        return side_effect_calls(chat_message(answer), rules)
    return side_effect_calls(list(answer.get("output") or ()), rules)


def call_count(family: Family, answer: JsonDict) -> int:
    """Every tool call of the answer, guarded or not."""
    if family == "chat":
        message = chat_message(answer)
        return len(message.get("tool_calls") or ()) + bool(message.get("function_call"))
    kinds = ("function_call", "custom_tool_call")
    return sum(1 for item in answer.get("output") or () if item.get("type") in kinds)


def chat_message(answer: JsonDict) -> JsonDict:
    choices = answer.get("choices") or [{}]
    message = choices[0].get("message")
    return message if isinstance(message, dict) else {}


def stripped(family: Family, answer: JsonDict, call_ids: set[str]) -> JsonDict:
    """The answer without the withheld calls (the client never receives them)."""
    if not call_ids:
        return answer
    if family == "responses":
        output = [i for i in answer.get("output") or () if i.get("call_id") not in call_ids]
        return {**answer, "output": output}
    choice = dict((answer.get("choices") or [{}])[0])
    message = dict(chat_message(answer))
    calls = [c for c in message.get("tool_calls") or () if c.get("id") not in call_ids]
    if calls:
        message["tool_calls"] = calls
    else:
        message.pop("tool_calls", None)
        if choice.get("finish_reason") == "tool_calls":
            choice["finish_reason"] = "stop"
    choice["message"] = message
    return {**answer, "choices": [choice, *(answer.get("choices") or [])[1:]]}


def answer_items(family: Family, answer: JsonDict) -> list[JsonDict]:
    """What the answer adds to the context of a continued request."""
    if family == "responses":
        return [dict(item) for item in answer.get("output") or ()]
    message = chat_message(answer)
    kept = ("role", "content", "refusal", "tool_calls", "function_call")
    reply = {k: message[k] for k in kept if message.get(k) is not None}
    reply.setdefault("role", "assistant")
    reply.setdefault("content", None)
    return [reply]


def continued_body(family: Family, sent: JsonDict, added: Sequence[JsonDict]) -> JsonDict:
    """The next provider request of the turn: the sent context plus `added`, not streamed."""
    body = {k: v for k, v in sent.items() if k not in ("stream", "stream_options")}
    if family == "chat":
        body["messages"] = [*sent.get("messages", ()), *added]
        return body
    given = sent.get("input")
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    body["input"] = [*(given or ()), *added]
    return body


@dataclass(frozen=True)
class Settled:
    """The turn's end: what the client gets, and (Responses) what the thread logs."""

    answer: JsonDict
    log: list[JsonDict]
    withheld: tuple[Verdict, ...]
    rounds: int  # continuation requests sent upstream


async def settle(
    guard: LedgerGuard,
    family: Family,
    sent: JsonDict,
    answer: JsonDict,
    ask: Ask,
    *,
    response_id: str | None,
    verdicts: Sequence[Verdict] | None = None,
) -> Settled:
    """Decide the answer's calls; continue the turn upstream while all are withheld."""
    first_id = answer.get("id")
    log_items: list[JsonDict] = []
    withheld_all: list[Verdict] = []
    rounds = 0
    while True:
        if verdicts is None:
            calls = answer_calls(family, answer, guard.rules)
            verdicts = await guard.judge(calls, response_id or first_id)
        withheld = [v for v in verdicts if v.withheld]
        withheld_all.extend(withheld)
        outputs = [v.output for v in withheld if v.output is not None]
        log_items += [*answer_items(family, answer), *outputs]
        ids = {v.call.call_id for v in withheld}
        done = not withheld or len(withheld) < call_count(family, answer)
        if done or rounds >= guard.max_replays or not _finished(family, answer):
            return Settled(stripped(family, answer, ids), log_items, tuple(withheld_all), rounds)
        sent = continued_body(family, sent, [*answer_items(family, answer), *outputs])
        following = await ask(sent)
        if following is None:
            return Settled(stripped(family, answer, ids), log_items, tuple(withheld_all), rounds)
        answer = {**following, "id": first_id}
        verdicts = None
        rounds += 1


def _finished(family: Family, answer: JsonDict) -> bool:
    if family == "responses":
        return answer.get("status", "completed") == "completed"
    return True
