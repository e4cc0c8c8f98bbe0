"""The turn's stages pass frozen values (proxy/server/turn.py): no stage, rewriter or
observer can write what another stage made."""

from __future__ import annotations

import dataclasses

import pytest

from proxy.core.items import responses_item
from proxy.server.turn import (
    Finished,
    ForItems,
    Forwarded,
    Load,
    New,
    Plan,
    Projected,
    Turn,
    Window,
)
from proxy.threads import Loaded

VALUES = (Load, Turn, Window, New, Projected, Forwarded, Finished, Plan)


@pytest.mark.parametrize("value", VALUES, ids=lambda v: v.__name__)
def test_every_value_a_stage_returns_is_frozen(value: type) -> None:
    assert dataclasses.is_dataclass(value)
    assert value.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_a_rewriter_gets_a_new_value_and_the_old_one_stays() -> None:
    first = New((responses_item({"role": "user", "content": "hi"}),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.items = ()  # type: ignore[misc]
    second = dataclasses.replace(first, items=())
    assert first.items and not second.items


def _counting() -> tuple[list[int], ForItems]:
    calls: list[int] = []

    async def rewriter(turn: Turn, window: Window, new: New) -> tuple[Window, New]:
        calls.append(1)
        return window, dataclasses.replace(new, items=())

    return calls, ForItems(frozenset({"compaction"}), rewriter)


COMPACTION = {"type": "compaction", "id": "cmp_1", "encrypted_content": "x"}
USER = {"role": "user", "content": "hi"}


async def test_a_rewriter_for_items_is_called_for_a_new_item_of_its_type() -> None:
    calls, gated = _counting()
    new = New((responses_item(USER), responses_item(COMPACTION)))
    _, out = await gated(None, Window(), new)  # type: ignore[arg-type]
    assert calls == [1] and out.items == ()


async def test_a_rewriter_for_items_is_called_for_a_stored_item_of_its_type() -> None:
    calls, gated = _counting()
    stored = Loaded("t", "thread_1", "responses", None, items=(responses_item(COMPACTION),))
    new = New((responses_item(USER),))
    _, out = await gated(None, Window(stored), new)  # type: ignore[arg-type]
    assert calls == [1] and out.items == ()


async def test_a_rewriter_for_items_is_passed_by_for_a_turn_without_one() -> None:
    calls, gated = _counting()
    stored = Loaded("t", "thread_1", "responses", None, items=(responses_item(USER),))
    window, new = Window(stored), New((responses_item(USER),))
    assert await gated(None, window, new) == (window, new)  # type: ignore[arg-type]
    assert calls == []
