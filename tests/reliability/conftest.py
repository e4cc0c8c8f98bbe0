"""Reliability suites (fuzzing, hostile input, chaos) reuse the end-to-end fixtures."""

from tests.server.conftest import default_store_url, make_proxy, provider, proxy

__all__ = ["default_store_url", "make_proxy", "provider", "proxy"]
