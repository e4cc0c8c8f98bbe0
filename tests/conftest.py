"""Suite-wide guards."""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from structlog._config import BoundLoggerLazyProxy

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
        _uncache_loggers()


def _uncache_loggers() -> None:
    """The module-level loggers (`log = structlog.get_logger(...)`) the test used under
    that configuration assemble themselves again on their next use: a cached one keeps
    the processors it was built with, and a later test's capture_logs would see nothing
    it logs. structlog caches a logger by setting `bind` on its lazy proxy."""
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if isinstance(value, BoundLoggerLazyProxy) and "bind" in vars(value):
                del value.bind
