"""The one knob validator: what it accepts, and one message shape naming the knob."""

import numpy as np
import pytest

import policies
from policies.errors import PolicyError
from traces.knobs import check_flag, check_int


@pytest.mark.parametrize("value", [1, 7, np.int64(3), 1 << 62])
def test_whole_numbers_pass_as_plain_ints(value):
    out = check_int("num_pages", value)
    assert out == value and type(out) is int


@pytest.mark.parametrize(
    "value, kwargs, message",
    [
        (0, {}, r"^num_pages\(=0\) must be an integer >= 1$"),
        (True, {}, r"^num_pages\(=True\) must be an integer >= 1$"),  # a bool is not a number here
        (2.0, {}, r"^num_pages\(=2.0\) must be an integer >= 1$"),
        ("4", {}, r"^num_pages\(='4'\) must be an integer >= 1$"),
        (None, {}, r"^num_pages\(=None\) must be an integer >= 1$"),
        (-1, {"low": 0, "none_ok": True}, r"^num_pages\(=-1\) must be an integer >= 0 or None$"),
        (9, {"low": 1, "high": 8}, r"^num_pages\(=9\) must be an integer in \[1, 8\]$"),
        (
            3000,
            {"low": 2048, "multiple_of": 2048},
            r"^num_pages\(=3000\) must be a positive multiple of 2,048$",
        ),
        (
            2048,
            {"low": 4096, "multiple_of": 2048},
            r"^num_pages\(=2048\) must be a multiple of 2,048 >= 4096$",
        ),
        (0, {"where": "preset.json: "}, r"^preset\.json: num_pages\(=0\) must be an integer >= 1$"),
    ],
)
def test_refusals_name_the_knob_in_one_shape(value, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_int("num_pages", value, **kwargs)


def test_none_passes_only_when_allowed_and_the_callers_error_is_raised():
    assert check_int("capacity_bytes", None, none_ok=True) is None
    with pytest.raises(PolicyError):
        check_int("capacity_bytes", 0, error=PolicyError)


def test_flags_take_only_true_or_false():
    assert check_flag("virtual", True) is True and check_flag("virtual", np.bool_(False)) is False
    with pytest.raises(ValueError, match=r"^virtual\(=1\) must be true or false$"):
        check_flag("virtual", 1)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("first-fit:segment_bytes=0", r"segment_bytes\(=0\) must be an integer >= 1"),
        ("compacting:base=[best-fit],idle_only=3", r"idle_only\(=3\) must be true or false"),
        (
            "torch-caching:max_non_split_rounding_bytes=5",
            r"max_non_split_rounding_bytes\(=5\) must be an integer >= ",
        ),
    ],
)
def test_policies_refuse_knobs_through_it(spec, message):
    with pytest.raises(PolicyError, match=message):
        policies.create(spec)
