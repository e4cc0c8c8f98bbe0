"""The item rewriters of a turn (proxy/server/turn.py, `rewrite`): each takes the turn
and its (window, new) and returns the (window, new) the next one gets, named for what
it does. A handler lists them in order; a reader answers "what did the model see, and
why" by reading them in that order. Compaction's live with it (proxy/server/compaction.py:
serve_compaction_trigger, expand_compactions, compact_past).

    restore_ledger_calls     a stored thread's lost call put back before its output
    refuse_orphans           an output for an unknown call is a 400 (SPEC 6)
    answer_dangling_calls    a call that would reach the provider unanswered gets an output
    attach_ready_summaries   the LLM summaries ready for the projection's chunks
"""

from __future__ import annotations

from dataclasses import replace

from proxy.server.errors import invalid
from proxy.server.ledger import custom_tool_names
from proxy.server.state import NAMESPACE, SUMMARIES, TENANT_POLICY
from proxy.server.turn import New, Rewriter, Turn, Window
from proxy.threads import first_orphan


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


async def attach_ready_summaries(turn: Turn, window: Window, new: New) -> tuple[Window, New]:
    """The LLM summaries ready for the projection's chunks, for a tenant whose policy
    sets a summarizer (the projection asks it for each chunk it cuts)."""
    settings = turn.request[TENANT_POLICY].memory.summarizer
    background = turn.request.app.get(SUMMARIES)
    if settings is None or background is None:
        return window, new
    ready = background.ready(turn.request[NAMESPACE], settings.model, turn.api.name)
    return replace(window, summaries=ready), new


# Every turn's rewriters, in order (a Responses turn with local compaction adds its own).
REWRITERS: tuple[Rewriter, ...] = (
    restore_ledger_calls,
    refuse_orphans,
    answer_dangling_calls,
    attach_ready_summaries,
)
