"""The usage correction (proxy/core/budget.py `fit`, `calibrated`): a ratio and a per-item
overhead that bound the provider's count from above, robust to an outlier, over a
bounded window of recent samples."""

from __future__ import annotations

import pytest

from proxy.core.budget import (
    MAX_SAMPLES,
    PER_BAND,
    Learned,
    Sample,
    calibrated,
    corrected_window,
    fit,
)


def provider(estimate: int, items: int) -> int:
    return int(1.35 * estimate) + 14 * items


SAMPLES = tuple(Sample(e, n, provider(e, n)) for e, n in [(300, 1), (900, 3), (2000, 5), (1200, 8)])


def test_a_ratio_and_an_overhead_are_told_apart() -> None:
    ratio, overhead = fit(SAMPLES)
    assert ratio == pytest.approx(1.35, abs=0.01)
    assert overhead == pytest.approx(14, abs=0.5)


def test_the_fit_bounds_every_recent_sample_from_above() -> None:
    ratio, overhead = fit(SAMPLES)
    learned = Learned(ratio=ratio, overhead=overhead)
    assert all(learned.provider_count(s.estimate, s.items) >= s.actual for s in SAMPLES)


def test_one_sample_gives_a_ratio_alone_that_bounds_it() -> None:
    assert fit((Sample(1000, 4, 1406),)) == (pytest.approx(1.406), 0.0)


def test_alike_samples_fit_a_ratio_alone() -> None:
    # Every request the same shape: the columns cannot be told apart.
    same = tuple(Sample(100 * k, k, provider(100 * k, k)) for k in range(1, 6))
    ratio, overhead = fit(same)
    assert overhead == 0.0
    assert all(ratio * s.estimate >= s.actual for s in same)


def test_one_outlier_in_twenty_is_not_what_the_bound_follows() -> None:
    steady = [
        Sample(e, n, provider(e, n)) for e, n in [(300 + 97 * i, 1 + i % 7) for i in range(39)]
    ]
    outlier = Sample(500, 2, 5000)  # a provider hiccup: ten times its usual count
    ratio, overhead = fit((*steady, outlier))
    assert ratio * 500 + overhead * 2 < 2000  # a mean or a max would follow it


def test_samples_are_a_bounded_window_and_answers_all_count() -> None:
    learned = None
    for i in range(MAX_SAMPLES + 10):
        estimate = 64 << (i % 10)  # ten size bands
        learned = calibrated(learned, Sample(estimate, 1 + i % 5, provider(estimate, 1 + i % 5)))
    assert learned is not None
    assert len(learned.samples) == MAX_SAMPLES
    assert learned.answers == MAX_SAMPLES + 10


def test_a_refusals_window_survives_calibration() -> None:
    learned = calibrated(Learned(window=3000, ratio=1.5), Sample(1000, 2, 1200))
    assert learned.window == 3000
    assert learned.ratio == pytest.approx(1.2)


def test_the_overhead_reaches_the_budget_through_the_counter_not_the_window() -> None:
    learned = Learned(ratio=1.35, overhead=14.0)
    assert learned.item_overhead == 11  # ceil(14 / 1.35), in the proxy's tokens
    assert corrected_window(12000, 1000, learned) == 1000 + int(11000 / 1.35)
    assert learned.provider_count(1000, 3) == 1350 + 42


def test_a_run_of_long_prompts_keeps_the_short_ones() -> None:
    learned = None
    short = [Sample(60 + i, 2, provider(60 + i, 2)) for i in range(PER_BAND)]
    for sample in short:
        learned = calibrated(learned, sample)
    for i in range(3 * MAX_SAMPLES):
        learned = calibrated(learned, Sample(8000 + i, 40, provider(8000 + i, 40)))
    assert learned is not None
    assert set(short) <= set(learned.samples)
    assert len(learned.samples) == 2 * PER_BAND  # two size bands, PER_BAND each


def test_long_prompts_vocabulary_drift_is_not_taken_for_a_per_item_cost() -> None:
    # A real vocabulary (issue 21, the Mistral rows): a template of 2 tokens per item, and a
    # ratio that drifts with content on long prompts (digits in later turns, summaries).
    # There the ratio and the per-item term trade freely; the short prompts tell them apart.
    def real(estimate: int, items: int) -> int:
        return round(1.1 * estimate + 2 * items)

    short = [Sample(e, n, real(e, n)) for e, n in [(50, 2), (120, 3), (260, 4), (400, 2)]]
    long = [
        Sample(e, n, real(e, n) + 3 * (n - 30))
        for e, n in [(5000 + 320 * k, 30 + 2 * k) for k in range(12)]
    ]
    ratio, overhead = fit((*short, *long))
    assert overhead < 3  # an absolute least squares puts 4.2 here
    for s in short:
        assert (
            abs(
                Learned(ratio=ratio, overhead=overhead).provider_count(s.estimate, s.items)
                - s.actual
            )
            <= 0.03 * s.actual
        )
