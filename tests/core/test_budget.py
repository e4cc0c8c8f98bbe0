from proxy.core.budget import history_budget, output_reserve


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
