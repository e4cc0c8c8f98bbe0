"""Suite-wide guards."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from proxy.logs import _JsonLinesHandler

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


@pytest.fixture(autouse=True)
def logging_config_restored() -> Iterator[None]:
    """A test that configures logging (proxy.logs.configure_logging, which caches each
    logger on first use) leaves the configuration it found: a logger first used after it
    would otherwise be built once and never reach a later test's capture_logs."""
    saved = structlog.get_config()
    yield
    if structlog.get_config() != saved:
        structlog.configure(**saved)
        root = logging.getLogger()
        for handler in [h for h in root.handlers if isinstance(h, _JsonLinesHandler)]:
            root.removeHandler(handler)
