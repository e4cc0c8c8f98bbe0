"""The OpenAI Agents SDK's compaction session through the proxy, against a provider that
has no compaction of its own (issue 10, item 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from agents import (
    Agent,
    OpenAIResponsesCompactionSession,
    OpenAIResponsesModel,
    Runner,
    SQLiteSession,
    set_tracing_disabled,
)
from agents.memory.openai_responses_compaction_session import OpenAIResponsesCompactionMode

from proxy.core.memory import SUMMARY_MARKER
from proxy.fake_provider import Reply

from .conftest import Proxy
from .test_compaction_e2e import sent_item_types

TURNS = 24  # the default hook compacts at 10 candidates: twice


@pytest.mark.parametrize("mode", ["auto", "input", "previous_response_id"])
async def test_the_agents_sdk_compaction_session_runs_many_turns_through_the_proxy(
    proxy: Proxy, tmp_path: Path, mode: OpenAIResponsesCompactionMode
) -> None:
    set_tracing_disabled(True)  # no trace export: the machine has no internet
    client = proxy.client()
    agent = Agent(
        name="support",
        instructions="You help with refunds.",
        model=OpenAIResponsesModel(model="gpt-4o", openai_client=client),
    )
    underlying = SQLiteSession("thread-1", str(tmp_path / "agents.db"))
    session = OpenAIResponsesCompactionSession(
        "thread-1", underlying, client=client, model="gpt-4o", compaction_mode=mode
    )
    for turn in range(TURNS):
        proxy.provider.script.append(Reply(text=f"Noted, step {turn}: " + "details " * 30))
        message = f"Step {turn}: order ORD-{7700 + turn} needs a refund of {10 + turn}.50 EUR."
        result = await Runner.run(agent, message, session=session)
        assert result.final_output.startswith(f"Noted, step {turn}")

    compactions = [r for r in proxy.provider.requests if r.path.endswith("/responses/compact")]
    assert compactions == []  # served by the proxy, never by the provider
    items = await underlying.get_items()
    kinds = [item.get("type") for item in items]
    assert kinds.count("compaction") == 1  # compacted (twice: the second replaced the first)
    assert "compaction" not in sent_item_types(proxy.provider)
    # What the provider got after the compaction: the summary as text, with the facts.
    last = proxy.provider.model_requests[-1].json
    developer = [i for i in last["input"] if i.get("role") == "developer"]
    assert len(developer) == 1 and developer[0]["content"].startswith(SUMMARY_MARKER)
    assert "Noted, step 0" in developer[0]["content"]  # an answer the compaction stands for
    assert "Stands for 20 earlier items" in developer[0]["content"]  # both compactions' answers
    assert "ORD-7700" in json.dumps(last["input"])  # the user's words stay verbatim
    assert len(proxy.provider.model_requests) == TURNS
