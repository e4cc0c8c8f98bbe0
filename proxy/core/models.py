"""Model families the proxy talks to differently.

OpenAI's reasoning models (o1, o3, o4-mini, the gpt-5 family) keep their reasoning in
items that can only be replayed statelessly with their encrypted content, refuse the
deprecated `max_tokens` of Chat Completions (they take `max_completion_tokens`) and
refuse a temperature other than the default.
"""

from __future__ import annotations

REASONING_PREFIXES = ("o1", "o3", "o4", "gpt-5")


def is_reasoning_model(model: str) -> bool:
    return model.startswith(REASONING_PREFIXES)
