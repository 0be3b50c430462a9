"""An upload's ``expires_after`` (gateway.files.expiry_seconds): OpenAI's rules, with the
lower bound an operator sets (``gateway.min_file_expiry_s``)."""

from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.files import MAX_EXPIRY_S, expiry_seconds

DEFAULT = 30 * 86400


def test_no_expires_after_takes_the_default():
    assert expiry_seconds(None, None, DEFAULT) == DEFAULT


@pytest.mark.parametrize(
    ("anchor", "seconds", "min_s"),
    [
        ("created_at", 3599, 3600),  # under OpenAI's hour
        ("created_at", 59, 60),  # under a lowered minimum
        ("created_at", MAX_EXPIRY_S + 1, 60),  # over 30 days
        ("created_at", "soon", 60),
        ("last_active_at", 7200, 3600),  # the one anchor is created_at
        (None, 7200, 3600),
    ],
)
def test_out_of_bounds_or_malformed_is_a_400_naming_the_field(anchor, seconds, min_s):
    with pytest.raises(APIError) as caught:
        expiry_seconds(anchor, seconds, DEFAULT, min_s)
    assert caught.value.status == 400 and caught.value.param == "expires_after"


def test_the_bounds_themselves_are_accepted():
    assert expiry_seconds("created_at", "3600", DEFAULT) == 3600
    assert expiry_seconds("created_at", "60", DEFAULT, min_s=60) == 60
    assert expiry_seconds("created_at", str(MAX_EXPIRY_S), DEFAULT, min_s=60) == MAX_EXPIRY_S
