"""The guard on an LLM summary: every must-keep string ends up in it, verbatim."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.guard import GUARD_TITLE, guarded, missing


def test_nothing_missing_leaves_the_text_as_it_is() -> None:
    text = "Refund 42.50 EUR for order #1234 approved."
    assert guarded(text, ("order #1234", "42.50 EUR")) == (text, ())


def test_missing_strings_are_appended_verbatim_once_in_order() -> None:
    keep = ("rfd_981", "No refunds above 100 EUR without approval.", "rfd_981", "")
    text, appended = guarded("The refund was made.\n", keep)
    assert appended == ("rfd_981", "No refunds above 100 EUR without approval.")
    assert text == (
        f"The refund was made.\n{GUARD_TITLE}\n- rfd_981\n"
        "- No refunds above 100 EUR without approval."
    )


def test_presence_is_an_exact_substring_not_a_paraphrase() -> None:
    assert missing("order 1234", ("order #1234",)) == ("order #1234",)
    assert missing("ORDER #1234", ("order #1234",)) == ("order #1234",)


@given(st.text(), st.lists(st.text(min_size=1), max_size=8))
def test_every_must_keep_string_is_in_the_guarded_text(text: str, keep: list[str]) -> None:
    result, appended = guarded(text, keep)
    assert all(s in result for s in keep)
    assert set(appended) == {s for s in keep if s not in text}
    assert result.startswith(text.rstrip("\n"))
