"""A history that fits whole is not projected (proxy/server/turn.py, `whole_fit`): what
it answers is exactly what the full projection returns for the same request, and it
answers whenever, and only when, the full projection sends the history as given."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from proxy.core.blocks import segment
from proxy.core.budget import Learned
from proxy.core.invariants import InvariantViolation, check_invariants, check_sent_as_given
from proxy.core.items import chat_item, responses_item
from proxy.core.projection import (
    ContextLengthExceeded,
    CutPoint,
    ProjectionPolicy,
    ProjectionRequest,
    project_context,
)
from proxy.core.tokens import REPLY_PRIMING
from proxy.counting import CalibratedCounter
from proxy.server.turn import whole_fit
from tests.core.test_invariants import verdict
from tests.core.test_projection_properties import (
    COUNTER,
    EPSILON,
    OUTPUT,
    POLICY,
    PROPERTY_SETTINGS,
    TOOLS,
    Case,
    cases,
    window_for,
)


def asked(case: Case, window: int, first_position: int, instructions: int) -> ProjectionRequest:
    return ProjectionRequest(
        case.items,
        window,
        OUTPUT,
        EPSILON,
        tools_tokens=TOOLS,
        instructions_tokens=instructions,
        first_position=first_position,
        stateless=case.stateless,
    )


def exact_window(case: Case, instructions: int) -> int:
    """The smallest window the whole history fits in."""
    counted = COUNTER.items(case.items) + instructions + TOOLS + REPLY_PRIMING
    return counted + OUTPUT + EPSILON


@PROPERTY_SETTINGS
@given(
    cases(),
    st.sampled_from([0, 0, 3, 40]),
    st.sampled_from([0, 0, 25]),
    st.one_of(st.none(), st.integers(-3, 3)),
)
def test_the_fit_is_the_full_projection_whenever_it_answers(
    case: Case, first_position: int, instructions: int, nudge: int | None
) -> None:
    """Random windows, and windows a few tokens either side of the exact fit."""
    if nudge is None:
        window = window_for(case) + instructions
    else:
        window = exact_window(case, instructions) + nudge
    request = asked(case, window, first_position, instructions)
    fit = whole_fit(request, COUNTER, POLICY)
    try:
        full = project_context(request, COUNTER, POLICY)
    except ContextLengthExceeded:
        event("full projection: refused")
        assert fit is None
        return
    sent_as_given = full.cut is None and not full.changed
    event(f"fit: {'answered' if fit is not None else 'none'}")
    assert (fit is not None) == sent_as_given
    if fit is not None:
        assert fit == full
        assert all(a is b for a, b in zip(fit.items, case.items, strict=True))


@PROPERTY_SETTINGS
@given(cases())
def test_a_stored_cut_is_always_projected(case: Case) -> None:
    request = replace(
        asked(case, window_for(case) * 10, 0, 0),
        cut=CutPoint(0, ()),
        stateless=False,
    )
    assert whole_fit(request, COUNTER, POLICY) is None
    assert whole_fit(replace(request, cut=None, verbatim=True), COUNTER, POLICY) is None


@PROPERTY_SETTINGS
@given(
    cases(),
    st.lists(st.tuples(st.integers(0, 400), st.integers(0, 400)), max_size=3),
    st.booleans(),
)
def test_a_history_sent_as_given_breaks_only_what_check_sent_as_given_sees(
    case: Case, swaps: list[tuple[int, int]], mixed: bool
) -> None:
    """Items moved (an output before its call, a turn out of place) and APIs mixed: the
    two checks of a context sent as given refuse exactly what check_invariants refuses."""
    items = list(case.items)
    for a, b in swaps:
        a, b = a % len(items), b % len(items)
        items[a], items[b] = items[b], items[a]
    if mixed:
        other = chat_item if case.api == "responses" else responses_item
        items.insert(len(items) // 2, other({"role": "user", "content": "other API"}))
    blocks = segment(items, POLICY.pin_patterns)
    pinned = [p for b in blocks if b.kind == "pinned" for p in b.positions]
    current = [p for b in blocks if b.kind == "current" for p in b.positions]
    found = verdict(lambda: check_sent_as_given(items))
    event(f"violation: {found.split(' ')[0] if found else 'none'}")
    assert found == verdict(lambda: check_invariants(items, items, pinned, current))


def test_an_output_before_its_call_is_refused_by_both() -> None:
    """The fit checks the invariants the projection checks: what breaks them is never sent."""
    items = [
        responses_item({"type": "message", "role": "user", "content": "go"}),
        responses_item({"type": "function_call_output", "call_id": "c1", "output": "done"}),
        responses_item({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}),
        responses_item({"type": "message", "role": "user", "content": "and?"}),
    ]
    request = ProjectionRequest(items, 100_000, OUTPUT, EPSILON)
    with pytest.raises(InvariantViolation):
        project_context(request, COUNTER, POLICY)
    with pytest.raises(InvariantViolation):
        whole_fit(request, COUNTER, POLICY)


UNPINNED = replace(POLICY, pin_patterns=())  # pin patterns: no blocks are settled


@PROPERTY_SETTINGS
@given(
    cases(),
    st.lists(st.integers(0, 8), min_size=2, max_size=6),
    st.sampled_from([0, 7]),
    st.sampled_from([POLICY, UNPINNED, UNPINNED]),
)
def test_a_window_growing_turn_by_turn_fits_as_the_full_projection(
    case: Case, steps: list[int], first_position: int, policy: ProjectionPolicy
) -> None:
    """A stored window's memo (Loaded.memo) carried from turn to turn, its first items the
    same objects, the turn's new items after them: each fit is the full projection's."""
    memo: dict[str, object] = {}
    window = 0
    for grow in steps:
        window = min(len(case.items), window + grow)
        history = case.items[: window + 2]
        request = replace(asked(case, 10**9, first_position, 0), items=history, stateless=False)
        try:
            full = project_context(request, COUNTER, policy)
        except ContextLengthExceeded:
            assert whole_fit(request, COUNTER, policy, memo, window) is None
            continue
        except InvariantViolation:
            with pytest.raises(InvariantViolation):
                whole_fit(request, COUNTER, policy, memo, window)
            continue
        fit = whole_fit(request, COUNTER, policy, memo, window)
        if fit is not None:
            assert fit == full


def test_a_memo_of_a_window_that_changed_is_not_used() -> None:
    """The window's items are not the ones the memo settled (compacted, an item erased,
    another worker's turn stored in between): the fit is made from the items themselves."""

    def turn(n: int) -> list:
        return [
            responses_item({"role": "user", "content": f"q{n}"}),
            responses_item(
                {"type": "function_call", "call_id": f"c{n}", "name": "f", "arguments": "{}"}
            ),
            responses_item(
                {"type": "function_call_output", "call_id": f"c{n}", "output": "ok " * n}
            ),
        ]  # turns of different sizes: a block of another turn reports other tokens

    def user(text: str):
        return responses_item({"role": "user", "content": text})

    memo: dict[str, object] = {}
    window = [item for n in range(4) for item in turn(n)]
    fits = []
    for items, first in (
        (window, 0),
        ([*window[:3], *window[6:]], 0),  # q1's turn erased
        ([*window[:3], *(user(t) for t in "abc"), *window[6:]], 0),  # as many, other turns
        ([responses_item({"role": "system", "content": "summary"}), *window[6:]], 6),
    ):
        history = [*items, responses_item({"role": "user", "content": "next"})]
        request = ProjectionRequest(
            history, 10**9, OUTPUT, EPSILON, tools_tokens=TOOLS, first_position=first
        )
        fit = whole_fit(request, COUNTER, UNPINNED, memo, len(items))
        assert fit == project_context(request, COUNTER, UNPINNED)
        assert memo  # settled blocks kept each time
        fits.append(fit)
    assert fits[1] is not None and len(fits[1].report.blocks) == 4


def test_a_memo_counted_by_another_counter_is_not_used() -> None:
    """The calibration taught a per-item overhead between two turns (another counter):
    the settled items are counted again, and the fit is the full projection's."""
    items = [responses_item({"role": "user", "content": f"question {n}"}) for n in range(6)]
    memo: dict[str, object] = {}
    calibrated = CalibratedCounter(COUNTER, Learned(overhead=5.0))
    unpinned = replace(POLICY, pin_patterns=())
    for counter, window in ((COUNTER, 4), (calibrated, 5), (COUNTER, 6)):
        request = ProjectionRequest(items[:window], 10**9, OUTPUT, EPSILON, tools_tokens=TOOLS)
        fit = whole_fit(request, counter, unpinned, memo, window - 1)
        assert fit == project_context(request, counter, unpinned)
        assert memo
