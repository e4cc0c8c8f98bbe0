"""Identifiers in OpenAI's style: a type prefix and 48 hex characters."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

# Prefix of the id an item gets when the client sent it without one.
ITEM_PREFIXES: Mapping[str, str] = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
    "computer_call": "cu",
    "computer_call_output": "cuo",
    "compaction": "cmp",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def item_id_for(raw: Mapping[str, Any]) -> str:
    """The item's own id when it has one, else a fresh id with its type's prefix."""
    existing = raw.get("id")
    if isinstance(existing, str) and existing:
        return existing
    kind = raw.get("type") or ("message" if "role" in raw else "item")
    return new_id(ITEM_PREFIXES.get(str(kind), "item"))
