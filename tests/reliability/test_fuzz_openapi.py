"""Fuzzing from OpenAI's specification: schemathesis against the running proxy.

Every operation threadkeeper answers itself (chat completions, responses and their
sub-routes, conversations and their items: openai-subset.json, cut from OpenAI's
OpenAPI document by make_spec.py) gets valid and invalid requests generated from its
schema, sent over a real socket to the proxy with the fake provider behind it. Two
guarantees hold for every case:

- no status >= 500 (the fake provider never fails, so there is no upstream 502/504 to
  excuse either);
- a 4xx changes nothing in the store (storecheck digests every table around the call).

Path ids are real about half the time (a conversation with items and a stored response
made for the case), so item creation, listing and deletion run on existing threads
rather than always stopping at a 404. Generation is derandomized with a fixed seed: the
same cases run on every machine.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis import Case
from schemathesis.config import SchemathesisConfig

from tests.reliability.live import LiveProxy, live_proxy
from tests.reliability.make_spec import OPERATIONS, refs
from tests.reliability.storecheck import diff, settled_snapshot, snapshot
from tests.server.conftest import TENANT_KEY

SPEC = Path(__file__).with_name("openai-subset.json")
SEED = 20260821  # the spec's date; any fixed value keeps CI deterministic
MAX_EXAMPLES = 100  # per operation, fuzzing phase; the examples phase adds the spec's own
AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}

CONFIG = SchemathesisConfig.from_dict(
    {
        "seed": SEED,
        "generation": {
            "mode": "all",
            "max-examples": MAX_EXAMPLES,
            "deterministic": True,
            "database": "none",
            "no-shrink": True,  # a failing case is reported as generated (bounded CI time)
        },
        "phases": {
            "examples": {"enabled": True},
            "coverage": {"enabled": False},  # thousands of cases on CreateResponse alone
            "fuzzing": {"enabled": True},
            "stateful": {"enabled": False},
        },
        "request-timeout": 60,
    }
)
schema = schemathesis.openapi.from_path(SPEC, config=CONFIG)


class Tally:
    def __init__(self) -> None:
        self.cases = 0
        self.by_status: dict[int, int] = {}

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.by_status.items() if status >= 500)


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Tally]:
    counts = Tally()
    yield counts
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    line = (
        f"openapi fuzz: {counts.cases} cases, {counts.server_errors} with status >= 500, "
        f"by status {dict(sorted(counts.by_status.items()))}"
    )
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # the figure the closing note asks for
            reporter.write_line(line)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    with live_proxy(tmp_path_factory.mktemp("fuzz")) as proxy:
        yield proxy


def _wants_real_id(value: Any) -> bool:
    """Deterministic coin: whether this case's generated id is swapped for a real one."""
    return zlib.crc32(repr(value).encode("utf-8", "surrogatepass")) % 2 == 0


def _seed_ids(live: LiveProxy, case: Case) -> None:
    """Swap generated path ids for ids that exist, for about half the cases."""
    params = case.path_parameters or {}
    with httpx.Client(base_url=live.base_url, headers=AUTH, timeout=60) as client:
        if "conversation_id" in params and _wants_real_id(params["conversation_id"]):
            items = [
                {"type": "message", "role": "user", "content": "Where is my order 7?"},
                {"type": "message", "role": "assistant", "content": "Checking order 7."},
            ]
            created = client.post("/conversations", json={"items": items})
            created.raise_for_status()
            conversation_id = created.json()["id"]
            params["conversation_id"] = conversation_id
            if "item_id" in params and _wants_real_id(params["item_id"]):
                listed = client.get(f"/conversations/{conversation_id}/items")
                listed.raise_for_status()
                params["item_id"] = listed.json()["data"][0]["id"]
        if "response_id" in params and _wants_real_id(params["response_id"]):
            created = client.post("/responses", json={"model": "gpt-4o", "input": "hello"})
            created.raise_for_status()
            params["response_id"] = created.json()["id"]


@schema.parametrize()
def test_openapi_fuzz(case: Case, live: LiveProxy, tally: Tally) -> None:
    _seed_ids(live, case)
    # The seeding, or the case before, may still be writing its learned limits.
    before = settled_snapshot(live.store_path)
    response = case.call(base_url=live.base_url, headers=AUTH)
    tally.cases += 1
    tally.by_status[response.status_code] = tally.by_status.get(response.status_code, 0) + 1
    where = f"{case.method} {case.formatted_path} -> {response.status_code}"
    assert response.status_code < 500, f"{where}: {response.text[:500]}\n{case.as_curl_command()}"
    if 400 <= response.status_code < 500:
        error = json.loads(response.content)["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
        changed = diff(before, snapshot(live.store_path))
        assert not changed, f"{where} changed the store: {changed}\n{case.as_curl_command()}"


def test_subset_is_the_served_operations_and_self_contained() -> None:
    """openai-subset.json holds exactly make_spec.OPERATIONS, and every reference in it
    resolves inside it (no component was lost in the cut)."""
    spec = json.loads(SPEC.read_text(encoding="utf-8"))
    served = {(path, method) for path, ops in spec["paths"].items() for method in ops}
    assert served == set(OPERATIONS)
    for ref in refs(spec):
        _, _, section, name = ref.split("/", 3)
        assert name in spec["components"][section], ref
