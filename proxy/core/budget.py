"""The token budget of one request (SPEC section 4, seed section 4.2).

    S + T + U + H + O + epsilon <= W    so    B_H = W - S - T - U - O - epsilon

W is the model's context window, S the pinned instructions (system/developer messages,
Responses `instructions`, pinned user messages, reply priming), T the tool definitions,
U the current turn, O the output reserve and epsilon a safety margin. History H only
has to shrink when H > B_H.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


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
class Sample:
    """One answer's truth: the proxy's own count of exactly what it sent (`estimate`, its
    raw count, no correction), how many items (messages, instructions) that was, and the
    provider's reported prompt tokens (`actual`; cached tokens are part of it)."""

    estimate: int
    items: int
    actual: int


# Samples a correction is fitted over: the most recent ones (a provider's tokenizer or
# template can change with a deploy; a bounded window forgets the old one), at most
# PER_BAND of each prompt size (a power of two of the estimate), so that a run of long
# prompts does not evict the short ones, the only ones that show a per-item cost.
MAX_SAMPLES = 32
PER_BAND = 4
# The share of recent samples the fitted correction bounds from above (nearest rank): with
# fewer than 20 samples, every one of them.
QUANTILE = 0.95
# A per-item overhead beyond this many provider tokens is not a chat template: noise.
MAX_OVERHEAD = 64.0
# Below this cosine distance between the estimate and item-count columns, the samples
# cannot tell a ratio from a per-item overhead: only a ratio is fitted.
MIN_SPREAD = 1e-4


@dataclass(frozen=True)
class Learned:
    """What the provider taught about one (tenant, upstream, model): its window, in its own
    tokens, and how its count relates to the proxy's: `ratio` times the proxy's raw count
    plus `overhead` per item. Refusals (proxy/server/model_budget.py) and every answer's usage
    (`calibrated`) write it; `discovered` is the window the provider lists for the model
    (proxy/server/discovery.py), used when only the policy's "*" names it. `answers`:
    how many samples the correction rests on, ever; `samples`: the recent ones."""

    window: int | None = None
    ratio: float = 1.0
    overhead: float = 0.0
    discovered: int | None = None
    answers: int = 0
    samples: tuple[Sample, ...] = ()

    @property
    def item_overhead(self) -> int:
        """The per-item overhead in the proxy's tokens, as the budget's counter adds it to
        every item (rounded up: the count errs high). See `corrected_window`."""
        return math.ceil(self.overhead / max(1.0, self.ratio) - 1e-9)

    def provider_count(self, estimate: int, items: int) -> int:
        """The provider's count of a prompt the proxy counts `estimate` (raw) over `items`."""
        return math.ceil(self.ratio * estimate + self.overhead * items - 1e-9)


def fit(samples: tuple[Sample, ...]) -> tuple[float, float]:
    """(ratio, overhead) with ratio * estimate + overhead * items at or above the actual
    count of QUANTILE of `samples`: least squares through the origin on the two columns,
    then scaled up to the high quantile of actual / fitted (the bound). Too few or too
    alike samples for two columns: a ratio alone.

    The squares are of relative errors (each sample weighted by 1 / actual^2). In real
    traffic text and items grow together (a turn adds both), so on long prompts a ratio
    and a per-item term trade against each other freely, and an absolute fit lets the
    longest prompts' vocabulary drift (summaries, digits, code: tens of tokens) decide a
    per-item cost of one or two: 9 tokens per item where a format costs 1-2 (issue 21).
    The per-item term shows only where items are many for their text, in short prompts;
    weighting by relative error gives each answer the same say whatever its size, which
    is also what the budget and input_tokens promise (a share of the count), and the
    sample window keeps short prompts (PER_BAND) for it to see."""
    points = [s for s in samples if s.estimate > 0 and s.actual > 0]
    if not points:
        return 1.0, 0.0
    terms = []  # each point's five products, summed by column below (sum's own order)
    for s in points:
        w = 1.0 / (s.actual * s.actual)
        r, n, y = s.estimate, s.items, s.actual
        terms.append((w * r * r, w * n * n, w * r * n, w * r * y, w * n * y))
    srr, snn, srn, sry, sny = map(sum, zip(*terms, strict=True))
    ratio, overhead = sry / srr, 0.0
    det = srr * snn - srn * srn
    if len(points) >= 3 and snn > 0 and det > MIN_SPREAD * srr * snn:
        a = (sry * snn - sny * srn) / det
        b = (srr * sny - srn * sry) / det
        if a > 0 and b >= 0:
            ratio, overhead = a, min(b, MAX_OVERHEAD)
    scales = sorted(s.actual / (ratio * s.estimate + overhead * s.items) for s in points)
    scale = scales[max(0, math.ceil(QUANTILE * len(scales)) - 1)]
    return ratio * scale, overhead * scale


def kept_samples(samples: tuple[Sample, ...], sample: Sample) -> tuple[Sample, ...]:
    """The window with `sample` added: the oldest of its size band leaves when the band
    holds PER_BAND, then the oldest of all beyond MAX_SAMPLES."""
    band = sample.estimate.bit_length()
    same = [s for s in samples if s.estimate.bit_length() == band]
    if len(same) >= PER_BAND:
        drop = same[0]
        samples = tuple(s for s in samples if s is not drop)
    return (*samples, sample)[-MAX_SAMPLES:]


def calibrated(previous: Learned | None, sample: Sample) -> Learned:
    """`previous` with one more answer's usage: the correction fitted again over the recent
    samples. A refusal's window and the discovered one are kept."""
    base = previous if previous is not None else Learned()
    samples = kept_samples(base.samples, sample)
    ratio, overhead = fit(samples)
    return replace(base, ratio=ratio, overhead=overhead, answers=base.answers + 1, samples=samples)


def corrected_window(
    window: int, output: int, learned: Learned | None, provider_output: int = 0
) -> int:
    """W for the budget formula, in the proxy's own tokens: the model's window, or less
    when the provider has a smaller one or counts more. `output` is O as the formula
    subtracts it; `provider_output` the output the provider reserves when that is more
    (a client's max_tokens above the policy's cap). Never above `window`. The per-item
    overhead is not here: the budget's counter adds it to every item
    (proxy/counting.py, CalibratedCounter), so ratio * count bounds the provider's."""
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
