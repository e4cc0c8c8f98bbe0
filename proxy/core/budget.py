"""The token budget of one request (SPEC section 4, seed section 4.2).

    S + T + U + H + O + epsilon <= W    so    B_H = W - S - T - U - O - epsilon

W is the model's context window, S the pinned instructions (system/developer messages,
Responses `instructions`, pinned user messages, reply priming), T the tool definitions,
U the current turn, O the output reserve and epsilon a safety margin. History H only
has to shrink when H > B_H.
"""

from __future__ import annotations


def history_budget(
    window: int, system: int, tools: int, current: int, output: int, epsilon: int
) -> int:
    """B_H: the tokens left for history. Negative when the fixed parts alone overflow."""
    return window - system - tools - current - output - epsilon


def output_reserve(requested: int | None, reserve: int, model_max: int | None) -> int:
    """O: the request's max output tokens, else the policy reserve, capped by the model."""
    wanted = requested if requested is not None else reserve
    if model_max is not None:
        return min(wanted, model_max)
    return wanted
