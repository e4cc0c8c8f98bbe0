"""Usage logging: the provider's reported prompt tokens on the request's log line (the
budget breakdown is logged where the projection is made, proxy/server/rebuild.py)."""

from __future__ import annotations

from proxy.server.state import LOG_FIELDS
from proxy.server.turn import Turn, TurnHook
from proxy.server.validate import JsonDict


class UsageHook(TurnHook):
    def answered(self, turn: Turn, answer: JsonDict) -> None:
        tokens = turn.api.usage_input_tokens(answer)
        if tokens is not None:
            turn.request[LOG_FIELDS]["usage_input_tokens"] = tokens
