"""The operator docs name what the code really has: every registered metric is listed in
docs/metrics.md, the Grafana dashboard queries only metrics that exist, and every policy
snippet loads. (The Python snippets run against a proxy: tests/server/test_docs_snippets_e2e.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from proxy.metrics import Metrics
from proxy.policy import PolicyError, hash_key, load_policy_file
from proxy.policydoc import policy_reference

DOCS = Path(__file__).parent.parent / "docs"
PLACEHOLDER_HASH = re.compile(r"<sha256 hex[^>]*>")


def yaml_snippets() -> list[tuple[str, str]]:
    found = []
    for path in [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = path.read_text()
        for match in re.finditer(r"^```yaml\n(.*?)^```", text, re.M | re.S):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{path.name}:{line}", match.group(1)))
    return found


@pytest.mark.parametrize(("where", "snippet"), yaml_snippets(), ids=lambda v: str(v)[:24])
def test_every_policy_snippet_loads_once_its_key_hash_is_filled_in(
    where: str, snippet: str, tmp_path: Path
) -> None:
    tenant = re.search(r"^tenant: (\S+)", snippet, re.M)
    assert tenant, f"{where}: a policy snippet names its tenant"
    path = tmp_path / f"{tenant.group(1)}.yaml"
    path.write_text(snippet)
    if PLACEHOLDER_HASH.search(snippet):  # as pasted, the placeholder is refused by name
        with pytest.raises(PolicyError, match="placeholder"):
            load_policy_file(path)
    path.write_text(PLACEHOLDER_HASH.sub(hash_key(f"sk-tk-{where}"), snippet))
    policy = load_policy_file(path)
    assert policy.tenant == tenant.group(1)


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
