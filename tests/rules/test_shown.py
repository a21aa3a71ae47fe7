"""Values in error messages: cut, never formatted whole (issue 54: a 4,300-digit number raised while its range check
formatted it, and a 404 echoed a 60 KB id)."""

from __future__ import annotations

import pytest

from h3serve.rules import limits
from h3serve.rules.shown import MAX_SHOWN_CHARS, shown
from h3serve.rules.validate import RequestError
from h3serve.rules.validate.resolve import check_int


@pytest.mark.parametrize("value, expected", [
    (7, "7"), ("abc", "'abc'"), (1.5, "1.5"), (None, "None"), (True, "True"), ("é", "'\\xe9'"),
    (10**4299, "an integer of about 4,300 digits"), (-(10**5000), "a negative integer of about 5,001 digits"),
    (list(range(1000)), "a list of 1,000 items"), ([10**5000], "a list holding a very long number"),
], ids=lambda v: v if isinstance(v, str) else type(v).__name__)
def test_a_value_is_shown_short(value, expected):
    assert shown(value) == expected


def test_a_long_text_is_cut():
    text = shown("v" * 60_000)
    assert len(text) == MAX_SHOWN_CHARS and text.endswith("...")


@pytest.mark.parametrize("value", [10**5000, -(10**5000), 2**63, "1" * 5000], ids=["huge", "-huge", "2**63", "text"])
def test_an_integer_check_never_formats_an_unbounded_value(value):
    with pytest.raises(RequestError) as refused:
        check_int("seed", value, limits.SEED_MIN, limits.SEED_MAX, 0)
    assert len(str(refused.value)) < 200 and refused.value.field == "seed"
