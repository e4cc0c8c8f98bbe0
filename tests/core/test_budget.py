import math

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.budget import (
    MAX_OVERHEAD,
    MIN_SPREAD,
    QUANTILE,
    Learned,
    Sample,
    corrected_window,
    fit,
    history_budget,
    learned_from_refusal,
    output_reserve,
)


def test_history_budget_matches_the_seed_worked_example() -> None:
    # seed section 4.3: W 16000, S 1200, T 1000, U 800, O 2000, eps 500 -> B_H 10500
    assert history_budget(16000, 1200, 1000, 800, 2000, 500) == 10500


def test_history_budget_is_negative_when_fixed_parts_overflow() -> None:
    assert history_budget(1000, 600, 0, 500, 100, 0) == -200


def test_output_reserve_prefers_the_request() -> None:
    assert output_reserve(500, 2000, None) == 500


def test_output_reserve_falls_back_to_the_policy_reserve() -> None:
    assert output_reserve(None, 2000, None) == 2000


def test_output_reserve_is_capped_by_the_model() -> None:
    assert output_reserve(50000, 2000, 16384) == 16384
    assert output_reserve(None, 20000, 16384) == 16384
    assert output_reserve(100, 2000, 16384) == 100


def test_nothing_learnt_leaves_the_policy_window() -> None:
    assert corrected_window(16000, 1000, None) == 16000
    assert corrected_window(16000, 1000, Learned()) == 16000


def test_a_smaller_provider_window_and_a_heavier_count_shrink_w() -> None:
    # The provider's 3000 less the 1000 reserved is 2000 of its tokens: 1538 of ours at 1.3.
    assert corrected_window(16000, 1000, Learned(window=3000, ratio=1.3)) == 1000 + 1538


def test_a_learnt_window_never_raises_the_policys() -> None:
    assert corrected_window(4000, 500, Learned(window=128000, ratio=1.0)) == 4000


def test_the_providers_larger_output_reserve_is_taken() -> None:
    # The client asked 3000 output tokens; the policy caps O at 1000 for its own formula.
    assert corrected_window(16000, 1000, Learned(window=8000), provider_output=3000) == 6000


def test_a_refusal_teaches_the_window_and_the_ratio() -> None:
    learned = learned_from_refusal(
        None, window=8192, provider_prompt=9100, completion=0, estimate=7000, output=1000
    )
    assert learned == Learned(window=8192, ratio=1.3)


def test_a_count_that_runs_high_keeps_the_ratio_at_one() -> None:
    learned = learned_from_refusal(
        None, window=8192, provider_prompt=6000, completion=0, estimate=7000, output=1000
    )
    assert learned.ratio == 1.0


def test_a_refusal_without_figures_takes_a_window_below_what_was_refused() -> None:
    learned = learned_from_refusal(
        None, window=None, provider_prompt=None, completion=None, estimate=9000, output=1000
    )
    assert learned.window == 8000  # 80% of the 10000 asked
    again = learned_from_refusal(
        learned, window=None, provider_prompt=None, completion=None, estimate=5000, output=1000
    )
    assert again.window == 4800  # each refusal lowers it, never raises it


def _sums_by_generator(points: tuple[Sample, ...]) -> tuple[float, ...]:
    """fit's five weighted sums as it wrote them before its one pass (h-pass)."""
    weights = [1.0 / (s.actual * s.actual) for s in points]
    pairs = list(zip(weights, points, strict=True))
    return (
        sum(w * s.estimate * s.estimate for w, s in pairs),
        sum(w * s.items * s.items for w, s in pairs),
        sum(w * s.estimate * s.items for w, s in pairs),
        sum(w * s.estimate * s.actual for w, s in pairs),
        sum(w * s.items * s.actual for w, s in pairs),
    )


_samples = st.lists(
    st.builds(
        Sample,
        st.integers(min_value=0, max_value=10**6),
        st.integers(min_value=0, max_value=600),
        st.integers(min_value=0, max_value=10**6),
    ),
    max_size=32,
)


@given(_samples)
def test_the_fit_is_the_same_float_for_float(samples: list[Sample]) -> None:
    """The fit's sums in one pass are the generator sums to the last bit, so a stored
    correction does not move with the code's shape."""
    points = tuple(s for s in samples if s.estimate > 0 and s.actual > 0)
    ratio, overhead = fit(tuple(samples))
    if not points:
        assert (ratio, overhead) == (1.0, 0.0)
        return
    srr, snn, srn, sry, sny = _sums_by_generator(points)
    expected_ratio, expected_overhead = sry / srr, 0.0
    det = srr * snn - srn * srn
    if len(points) >= 3 and snn > 0 and det > MIN_SPREAD * srr * snn:
        a = (sry * snn - sny * srn) / det
        b = (srr * sny - srn * sry) / det
        if a > 0 and b >= 0:
            expected_ratio, expected_overhead = a, min(b, MAX_OVERHEAD)
    scales = sorted(
        s.actual / (expected_ratio * s.estimate + expected_overhead * s.items) for s in points
    )
    scale = scales[max(0, math.ceil(QUANTILE * len(scales)) - 1)]
    assert (ratio, overhead) == (expected_ratio * scale, expected_overhead * scale)
