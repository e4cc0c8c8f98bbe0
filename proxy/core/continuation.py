"""The ledger's continuation rules (SPEC 6) as a pure generator, sans I/O.

A provider answer whose side-effecting calls are all withheld (a replayed or blocked
duplicate, an outcome unknown) must not reach the client as is: the model gets the
synthetic outputs and the turn continues upstream, at most `max_replays` rounds. When a
withheld call sits beside a handed-out one the turn cannot continue (the handed-out call
has no output yet): the withheld call is stripped. An incomplete answer is not continued.

The generator yields commands and receives their results, like httpx's auth flow:

- `Judge(calls, answer_id)`: decide these calls in the ledger (write ahead); send back
  one `Judged` per call (its `output` is the model's answer when the call is withheld).
- `Ask(body)`: send this request upstream, not streamed; send back the checked answer,
  or None when the provider failed it (the client then gets the last answer).

It returns `Settled`. The answer's shape (where its calls are, how it is stripped or
extended) comes from an `AnswerShape` (proxy/server/api.py implements one per API).

>>> flow = continuation(shape, sent, answer, rules, max_replays=2)
>>> command = next(flow)            # Judge(...)
>>> command = flow.send(judged)     # Ask(...) while every call was withheld
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.core.items import JsonDict
from proxy.core.ledger import ToolCall, ToolRule


class AnswerShape(Protocol):
    """What the continuation reads and writes of one API's answers and requests."""

    def calls(self, answer: JsonDict, rules: Mapping[str, ToolRule]) -> list[ToolCall]: ...

    def call_count(self, answer: JsonDict) -> int: ...

    def stripped(self, answer: JsonDict, call_ids: set[str]) -> JsonDict: ...

    def answer_items(self, answer: JsonDict) -> list[JsonDict]: ...

    def continued_body(self, sent: JsonDict, added: Sequence[JsonDict]) -> JsonDict: ...

    def finished(self, answer: JsonDict) -> bool: ...


class Judged(Protocol):
    """One call, decided by the ledger; `output` is set when the call is withheld."""

    @property
    def call(self) -> ToolCall: ...

    @property
    def output(self) -> JsonDict | None: ...


@dataclass(frozen=True)
class Judge:
    calls: list[ToolCall]
    answer_id: str | None  # the turn's first answer id (ledger entries name it)


@dataclass(frozen=True)
class Ask:
    body: JsonDict


@dataclass(frozen=True)
class Settled:
    """The turn's end: what the client gets, and (Responses) what the thread logs."""

    answer: JsonDict
    log: list[JsonDict]  # every round's answer items and the synthetic outputs
    withheld: tuple[Any, ...]  # the Judged calls that were withheld
    rounds: int  # continuation requests sent upstream

    @property
    def continued(self) -> bool:
        """Whether the turn went back to the provider rather than only stripping
        withheld calls."""
        return self.rounds > 0


Command = Judge | Ask


def continuation(
    shape: AnswerShape,
    sent: JsonDict,
    answer: JsonDict,
    rules: Mapping[str, ToolRule],
    *,
    max_replays: int,
    judged: Sequence[Judged] | None = None,
) -> Generator[Command, Any, Settled]:
    """Settles `answer` (the reply to `sent`). `judged`: its calls were already decided
    (a stream's holdback judges each call as it completes)."""
    first_id = answer.get("id")
    log: list[JsonDict] = []
    withheld_all: list[Judged] = []
    rounds = 0
    while True:
        if judged is None:
            judged = yield Judge(shape.calls(answer, rules), first_id)
        withheld = [j for j in judged if j.output is not None]
        withheld_all.extend(withheld)
        outputs = [j.output for j in withheld if j.output is not None]
        added = [*shape.answer_items(answer), *outputs]
        log += added
        ids = {j.call.call_id for j in withheld}
        done = not withheld or len(withheld) < shape.call_count(answer)
        if done or rounds >= max_replays or not shape.finished(answer):
            return Settled(shape.stripped(answer, ids), log, tuple(withheld_all), rounds)
        sent = shape.continued_body(sent, added)
        following = yield Ask(sent)
        if following is None:
            return Settled(shape.stripped(answer, ids), log, tuple(withheld_all), rounds)
        answer = {**following, "id": first_id}
        judged = None
        rounds += 1
