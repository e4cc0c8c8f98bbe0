"""Where a projection runs: a small one inline, a prediction (`background`) never on the
event loop, whatever its size: nobody waits for it, and requests must not wait behind it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import proxy.server.turn as turn_module
from proxy.core.items import chat_item
from proxy.policy import load_policy_file

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("background", [False, True])
async def test_a_prediction_is_projected_off_the_loop(
    monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    threads: list[threading.Thread] = []

    def recorded(work: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread())
            return work(*args, **kwargs)

        return run

    # a history that fits whole is not projected: whole_fit answers (turn.py)
    for name in ("project_context", "whole_fit"):
        monkeypatch.setattr(turn_module, name, recorded(getattr(turn_module, name)))
    policy = load_policy_file(REPO / "policies" / "default.yaml")
    items = [chat_item({"role": "user", "content": "hello"})]
    projection, _ = await turn_module.rebuild(
        policy, "gpt-4o-mini", items, small=True, background=background
    )
    assert projection.items == tuple(items)
    assert len(threads) == 1  # the fit found, nothing projected
    on_loop = threads == [threading.current_thread()]
    assert on_loop is not background


async def test_each_policy_projects_with_its_own_values() -> None:
    """What a policy fixes for a model is found once per policy (turn.policy_setup): a
    policy read again with other values projects with those, not the first one's."""
    policy = load_policy_file(REPO / "policies" / "default.yaml")
    items = [chat_item({"role": "user", "content": "hello"})]
    first, _ = await turn_module.rebuild(policy, "gpt-4o-mini", items, small=True)
    budget = policy.budget.model_copy(
        update={
            "reserve_output_tokens": 1000,
            "safety_margin_tokens": policy.budget.safety_margin_tokens + 7,
        }
    )
    limits = policy.models["gpt-4o-mini"].model_copy(update={"max_output_tokens": 900})
    reloaded = policy.model_copy(
        update={"budget": budget, "models": {**policy.models, "gpt-4o-mini": limits}}
    )
    again, _ = await turn_module.rebuild(reloaded, "gpt-4o-mini", items, small=True)
    assert again.report.epsilon == first.report.epsilon + 7
    assert (first.report.output, again.report.output) == (
        min(policy.budget.reserve_output_tokens, 16384),
        900,
    )
    setup = await turn_module.policy_setup(policy, "gpt-4o-mini")
    assert await turn_module.policy_setup(policy, "gpt-4o-mini") is setup
    assert (await turn_module.policy_setup(reloaded, "gpt-4o-mini")).max_output == 900
