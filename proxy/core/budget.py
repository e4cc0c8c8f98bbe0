"""The token budget of one request (SPEC section 4, seed section 4.2).

    S + T + U + H + O + epsilon <= W    so    B_H = W - S - T - U - O - epsilon

W is the model's context window, S the pinned instructions (system/developer messages,
Responses `instructions`, pinned user messages, reply priming), T the tool definitions,
U the current turn, O the output reserve and epsilon a safety margin. History H only
has to shrink when H > B_H.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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


@dataclass(frozen=True)
class Learned:
    """What the provider taught about one (tenant, upstream, model): its window, in its own
    tokens, and how many of its tokens one of the proxy's counts (never below 1: a count
    that runs high is left as it is). Learnt from its refusals (proxy/server/overflow.py);
    usage calibration and window discovery are to refine the same value."""

    window: int | None = None
    ratio: float = 1.0


def corrected_window(
    window: int, output: int, learned: Learned | None, provider_output: int = 0
) -> int:
    """W for the budget formula, in the proxy's own tokens: the policy's window, or less
    when the provider has a smaller one or counts more. `output` is O as the formula
    subtracts it; `provider_output` the output the provider reserves when that is more
    (a client's max_tokens above the policy's cap). Never above `window`."""
    if learned is None:
        return window
    limit = min(window, learned.window) if learned.window is not None else window
    reserve = max(output, provider_output)
    prompt_room = max(0, limit - reserve)
    return min(window, output + math.floor(prompt_room / max(1.0, learned.ratio)))


# With no figures in a refusal, the window is taken to be this share of what was refused.
UNSTATED_WINDOW_SHARE = 0.8


def learned_from_refusal(
    previous: Learned | None,
    *,
    window: int | None,
    provider_prompt: int | None,
    completion: int | None,
    estimate: int,
    output: int,
) -> Learned:
    """What a context-length refusal teaches: the window it states, and the ratio of its
    count of the prompt to the proxy's `estimate` of the same request (the larger of that
    and what was known). A refusal that states no window gives one: UNSTATED_WINDOW_SHARE
    of what the provider was asked for by its count."""
    ratio = previous.ratio if previous is not None else 1.0
    if provider_prompt is not None and estimate > 0:
        ratio = max(ratio, provider_prompt / estimate)
    if window is None:
        asked = math.ceil(estimate * ratio) + (completion if completion is not None else output)
        window = math.floor(asked * UNSTATED_WINDOW_SHARE)
        if previous is not None and previous.window is not None:
            window = min(window, previous.window)
    return Learned(window=window, ratio=ratio)
