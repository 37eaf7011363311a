"""``sim.serving.fit_range``: the range a fit's steps covered, read back, and the steps past it."""

import dataclasses

import numpy as np
import pandas as pd
import pytest

from sim.serving.fit_range import (
    BELOW_WARN_FRAC,
    RANGE_FEATURES,
    RANGE_QUANTILE,
    FittedRange,
    RangeCount,
    StepFeatureLog,
)

STEPS = pd.DataFrame(
    {
        "num_prefill_tokens": [0, 512, 0, 100],
        "prefill_context_tokens": [0, 2048, 0, 100],
        "num_decode_seqs": [4, 0, 26, 3],
        "decode_context_tokens": [4000, 0, 44749, 900],
    }
)


def test_the_range_is_each_features_max_and_high_quantile_kv_the_sum_of_contexts():
    r = FittedRange.of_profile(STEPS)
    assert r.max == {
        "num_prefill_tokens": 512,
        "prefill_context_tokens": 2048,
        "num_decode_seqs": 26,
        "decode_context_tokens": 44749,
        "kv_tokens": 44749,
    }
    kv = STEPS["prefill_context_tokens"] + STEPS["decode_context_tokens"]
    assert r.quantile["kv_tokens"] == pytest.approx(np.quantile(kv, RANGE_QUANTILE))
    assert r.quantile["kv_tokens"] < r.max["kv_tokens"]


def test_the_range_reads_back_and_a_bad_one_is_named():
    r = FittedRange.of_profile(STEPS)
    assert FittedRange.from_json(r.to_json(), "cal.json") == r
    bad = r.to_json()
    bad["features"]["kv_tokens"]["max"] = -1
    with pytest.raises(ValueError, match=r"cal.json: fit.feature_range.features.kv_tokens.max: "):
        FittedRange.from_json(bad, "cal.json")
    for key, value in (("min", 1e12), ("quantile", 1e12)):  # above the largest: not a range
        unordered = r.to_json()
        unordered["features"]["decode_context_tokens"][key] = value
        with pytest.raises(ValueError, match=r"tokens: min and quantile must be <= max"):
            FittedRange.from_json(unordered, "cal.json")
    del bad["features"]["kv_tokens"]
    with pytest.raises(ValueError, match=r"cal.json: fit.feature_range.features: missing \['kv_"):
        FittedRange.from_json(bad, "cal.json")


def test_a_step_past_any_maximum_counts_once_and_under_each_feature_it_passes():
    count = RangeCount(FittedRange.of_profile(STEPS))
    count.add(0, 26, 44749 - 26, 0)  # at the maxima: inside
    count.add(100, 3, 897, 0)  # at the smallest nonzero values: inside
    assert (count.num_steps, count.num_past, count.frac) == (2, 0, 0.0)
    assert count.warning() == ""
    count.add(0, 30, 60_000, 0)  # more decode sequences and more KV
    count.add(600, 0, 0, 0)  # more prefill tokens alone
    assert (count.num_steps, count.num_past) == (4, 2)
    by = dict(zip(RANGE_FEATURES, count.past_by_feature))
    assert by == {
        "num_prefill_tokens": 1,
        "prefill_context_tokens": 0,
        "num_decode_seqs": 1,
        "decode_context_tokens": 1,
        "kv_tokens": 1,
    }
    assert count.frac == 0.5


def test_the_warning_names_the_share_the_feature_and_the_fits_maximum():
    count = RangeCount(FittedRange.of_profile(STEPS))
    for _ in range(3):
        count.add(0, 20, 60_000, 0)  # more KV, not more sequences
    count.add(0, 3, 997, 0)
    line = count.warning()
    assert line.startswith(
        "75 % of the 4 steps priced read more KV tokens than the calibration saw, up to 1.3x its "
        "largest (max 45k;"
    )
    assert "its KV terms are extrapolated" in line
    assert "decode context tokens 75 %" in line  # the other feature it passed
    assert line.endswith("calibrate on a profile that covers such steps")


def test_the_range_records_each_features_smallest_nonzero_value_and_old_files_lack_it():
    r = FittedRange.of_profile(STEPS)
    assert r.min == {
        "num_prefill_tokens": 100,  # decode-only steps (0) are another kind, not small ones
        "prefill_context_tokens": 100,
        "num_decode_seqs": 3,
        "decode_context_tokens": 900,
        "kv_tokens": 1000,
    }
    old = r.to_json()
    for entry in old["features"].values():
        del entry["min"]
    del old["steps"]
    back = FittedRange.from_json(old, "old.json")  # a file of session 18: loads, not checked below
    assert back.min == {} and back.max == r.max and back.steps == "recorded"
    count = RangeCount(back)
    count.add(1, 1, 0, 0)  # under every smallest: nothing to check it against
    assert count.num_below == 0 and count.warning() == ""
    bad = r.to_json()
    bad["features"]["num_decode_seqs"]["min"] = "3"
    with pytest.raises(ValueError, match=r"fit.feature_range.features.num_decode_seqs.min: "):
        FittedRange.from_json(bad, "cal.json")
    with pytest.raises(ValueError, match=r"cal.json: fit.feature_range.steps: must be one of"):
        FittedRange.from_json({**r.to_json(), "steps": "guessed"}, "cal.json")


def test_how_far_past_the_largest_kv_tokens_of_any_priced_step_over_the_fits():
    count = RangeCount(FittedRange.of_profile(STEPS))
    assert count.extrapolation_ratio is None  # nothing priced
    count.add(0, 10, 10_000, 0)
    assert count.extrapolation_ratio == pytest.approx(10_010 / 44749)  # inside: under 1
    count.add(0, 20, 89_478, 0)  # 89,498 KV tokens: 2.0x
    count.add(0, 20, 60_000, 0)
    assert count.extrapolation_ratio == pytest.approx(89_498 / 44749)
    assert count.largest[RANGE_FEATURES.index("kv_tokens")] == 89_498
    assert ", up to 2.0x its largest (max 45k;" in count.warning()


def test_steps_under_the_smallest_are_counted_apart_and_warned_with_how_far_down():
    count = RangeCount(FittedRange.of_profile(STEPS))
    count.add(0, 1, 2000, 0)  # one decode sequence: fewer than the fit's 3
    count.add(0, 2, 10, 0)  # two over 12 tokens: fewer sequences, less context, less KV
    count.add(0, 26, 44749 - 26, 0)  # inside
    count.add(0, 30, 60_000, 0)  # over: counted apart
    assert (count.num_steps, count.num_past, count.num_below) == (4, 1, 2)
    assert count.below_frac == 0.5 and count.frac == 0.25
    by = dict(zip(RANGE_FEATURES, count.below_by_feature))
    assert by == {
        "num_prefill_tokens": 0,
        "prefill_context_tokens": 0,
        "num_decode_seqs": 2,
        "decode_context_tokens": 1,
        "kv_tokens": 1,
    }
    assert count.smallest[RANGE_FEATURES.index("num_decode_seqs")] == 1
    line = count.warning()
    assert line.startswith("25 % of the 4 steps priced ")  # the step over the range, first
    assert line.endswith(
        "; 50 % of the 4 steps priced had fewer decode sequences than the calibration's smallest "
        "(3; down to 1): its terms are extrapolated down (under the range too: decode context "
        "tokens 25 %, KV tokens 25 %); calibrate on a profile that covers such steps"
    )


def test_a_log_of_priced_steps_gives_their_range_as_simulated_steps():
    log = StepFeatureLog()
    with pytest.raises(ValueError, match="no step was priced"):
        log.fitted_range()
    log.add(0, 4, 3996, 0)  # the profile's first step, in step_time_s's counts
    log.add(512, 0, 0, 1536)
    log.add(0, 26, 44749 - 26, 0)
    log.add(100, 3, 897, 0)
    r = log.fitted_range()
    assert r == dataclasses.replace(FittedRange.of_profile(STEPS), steps="simulated")
    assert FittedRange.from_json(r.to_json(), "cal.json") == r
    assert r.describe().startswith(
        "range of the steps the fitted terms priced, simulating the request table "
        "(smallest nonzero-largest): prefill tokens 100-512, "
    )
    assert "KV tokens 1.0k-45k" in r.describe()


def test_a_few_steps_under_the_range_are_counted_but_not_warned_of():
    count = RangeCount(FittedRange.of_profile(STEPS))
    count.add(0, 1, 2000, 0)  # one decode sequence: fewer than the fit's 3
    for _ in range(4):
        count.add(0, 26, 44749 - 26, 0)  # inside
    assert count.below_frac == 0.2 < BELOW_WARN_FRAC
    assert count.warning() == ""
    count.add(0, 1, 2000, 0)  # two of six: a third, warned
    assert count.warning().startswith("33 % of the 6 steps priced had fewer decode sequences")


def test_the_warning_says_its_shares_are_of_the_steps_priced_and_how_many():
    """A user reads a share of steps as one of the run's; the run prices some steps twice (the
    fast path's quiet stretches), so the warning names its base: the steps priced, counted."""
    count = RangeCount(FittedRange.of_profile(STEPS))
    for _ in range(1200):
        count.add(0, 26, 44749 - 26, 0)  # inside
    for _ in range(300):
        count.add(0, 20, 60_000, 0)  # past the largest KV tokens
    assert count.frac == 0.2
    assert count.warning().startswith("20 % of the 1,500 steps priced read more KV tokens ")
