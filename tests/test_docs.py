"""The operator docs name what the code really has: every registered metric is listed in
docs/metrics.md, and the Grafana dashboard queries only metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

from proxy.metrics import Metrics
from proxy.policydoc import policy_reference

DOCS = Path(__file__).parent.parent / "docs"


def _exposed_names() -> set[str]:
    """The names a scrape shows: counters get their `_total` suffix."""
    names = set()
    for family in Metrics().registry.collect():
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def test_every_metric_is_documented() -> None:
    documented = set(
        re.findall(r"^\| `(threadkeeper_\w+)`", (DOCS / "metrics.md").read_text(), re.M)
    )
    assert documented == _exposed_names()


def test_the_dashboard_queries_only_metrics_that_exist() -> None:
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried.update(re.findall(r"threadkeeper_\w+", target["expr"]))
    suffixes = ("_bucket", "_sum", "_count")
    bases = {next((q[: -len(s)] for s in suffixes if q.endswith(s)), q) for q in queried}
    assert bases and bases <= _exposed_names()


def test_the_policy_reference_is_generated_from_the_schema() -> None:
    """Regenerate with `threadkeeper policy schema --markdown > docs/policy.md`."""
    assert (DOCS / "policy.md").read_text() == policy_reference()


def test_every_policy_field_says_what_it_does() -> None:
    rows = [line for line in policy_reference().splitlines() if line.startswith("| `")]
    assert rows and all(not row.rstrip().endswith("|  |") for row in rows), [
        row.split("|")[1] for row in rows if row.rstrip().endswith("|  |")
    ]
