"""The store by concern (proxy/store/base.py): `Store` is exactly the union of one
Protocol per concern, no method is in two concerns, and the SQL store implements each.

Which concern a consumer uses is checked statically: it annotates the narrow protocol
(`store: LedgerStore`), and `mypy proxy` refuses a call outside it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Protocol

from proxy.store import base
from proxy.store.base import Store
from proxy.store.sqlstore import SqlStore

CONCERNS = [
    base.StoreLifecycle,
    base.ThreadStore,
    base.ResponseStore,
    base.BackgroundStore,
    base.HeartbeatStore,
    base.LedgerStore,
    base.IdempotencyStore,
    base.SummaryStore,
    base.ExplainStore,
    base.SecretStore,
    base.UpstreamApiStore,
    base.InspectorSessionStore,
    base.LearnedStore,
]


def methods(protocol: type) -> set[str]:
    """The methods a protocol declares itself (not those it inherits)."""
    return {name for name, value in vars(protocol).items() if inspect.iscoroutinefunction(value)}


def test_store_is_the_union_of_disjoint_concerns() -> None:
    assert set(Store.__bases__) - {Protocol} == set(CONCERNS)
    assert methods(Store) == set()  # the union declares nothing of its own
    seen: dict[str, str] = {}
    for concern in CONCERNS:
        for name in methods(concern):
            assert name not in seen, f"{name} is in {seen.get(name)} and {concern.__name__}"
            seen[name] = concern.__name__
    every = {n for n in dir(Store) if inspect.iscoroutinefunction(getattr(Store, n))}
    assert set(seen) == every


def test_the_sql_store_implements_every_concern_with_its_signatures() -> None:
    for concern in CONCERNS:
        for name in methods(concern):
            implemented = getattr(SqlStore, name)
            assert inspect.iscoroutinefunction(implemented), name
            declared = inspect.signature(getattr(concern, name))
            assert list(inspect.signature(implemented).parameters) == list(declared.parameters), (
                name
            )


# What opens, holds or runs the whole store; every other module names its concern.
WHOLE_STORE = {"proxy/store/__init__.py", "proxy/server/state.py", "proxy/server/app.py"}
NAMES_STORE = re.compile(r"(?::|->|\[|\|)\s*Store\b(?!\.)|import .*\bStore\b(?!\w)")


def test_only_what_holds_the_whole_store_names_it() -> None:
    root = Path(__file__).resolve().parents[2]
    naming = {
        str(path.relative_to(root))
        for path in (root / "proxy").rglob("*.py")
        if path.name != "base.py" and NAMES_STORE.search(path.read_text(encoding="utf-8"))
    }
    assert naming <= WHOLE_STORE, naming - WHOLE_STORE
