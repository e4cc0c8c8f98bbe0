"""The side-effect ledger (SPEC 6) at the turn's named points: calls restored before the
orphan check, dangling calls answered before the projection, the client's outputs
recorded before forwarding, and the answer relayed through the holdback
(proxy/server/holdback.py) when the tenant's policy guards a tool."""

from __future__ import annotations

from aiohttp import web

from proxy.server.api import ApiShape
from proxy.server.holdback import Guarded
from proxy.server.ledger import LedgerGuard, custom_tool_names
from proxy.server.relay import Transformer
from proxy.server.state import CLOCK
from proxy.server.turn import Turn, TurnHook


class LedgerHook(TurnHook):
    def __init__(self, request: web.Request, api: ApiShape) -> None:
        self.guard = LedgerGuard(request, api=api, thread_id=None, now=request.app[CLOCK].iso)

    async def restore(self, turn: Turn) -> None:
        """On a stored thread: the ledger's call before an output the thread never saw."""
        if turn.loaded is None:
            return
        self.guard.thread_id = turn.loaded.thread_id
        if self.guard.active:
            custom = custom_tool_names(turn.api.budget_inputs(turn.body).tools)
            turn.new = await self.guard.restore_calls(turn.loaded.items, turn.new, custom)

    async def close_calls(self, turn: Turn) -> None:
        """Stored threads always (the client cannot edit them); a stateless request only
        for the calls the ledger guards (its history is the client's)."""
        stored = turn.loaded is not None
        if stored or self.guard.active:
            turn.new = await self.guard.answer_dangling(turn.known, turn.new, unguarded_too=stored)

    async def before_forward(self, turn: Turn) -> None:
        await self.guard.record_outputs(turn.outputs)

    def transformer(self, turn: Turn, current: Transformer) -> Transformer:
        if not self.guard.active:
            return current
        assert turn.sent is not None
        guarded = Guarded(
            turn.request, turn.api, self.guard, turn.sent, turn.keeper, turn.response_id
        )
        return turn.api.holdback(guarded)
