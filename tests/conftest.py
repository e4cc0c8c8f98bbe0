"""Suite-wide guards."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "RESULTS.md"


def _digest() -> str | None:
    return hashlib.sha256(RESULTS.read_bytes()).hexdigest() if RESULTS.exists() else None


@pytest.fixture(scope="session", autouse=True)
def results_file_untouched() -> Iterator[None]:
    """bench/RESULTS.md holds measured figures; only a bench run with --write changes it.
    Tests that exercise the benches' writers pass a path of their own."""
    before = _digest()
    yield
    assert _digest() == before, "a test rewrote bench/RESULTS.md (write to tmp_path instead)"
