"""Reliability suites (fuzzing, hostile input, chaos) reuse the end-to-end fixtures."""

from tests.server.conftest import make_proxy, provider, proxy

__all__ = ["make_proxy", "provider", "proxy"]
