"""The turn's stages pass frozen values (proxy/server/turn.py): no stage, rewriter or
observer can write what another stage made."""

from __future__ import annotations

import dataclasses

import pytest

from proxy.core.items import responses_item
from proxy.server.turn import Finished, Forwarded, Load, New, Plan, Projected, Turn, Window

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
