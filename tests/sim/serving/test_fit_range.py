"""``sim.serving.fit_range``: the range a fit's steps covered, read back, and the steps past it."""

import numpy as np
import pandas as pd
import pytest

from sim.serving.fit_range import RANGE_FEATURES, RANGE_QUANTILE, FittedRange, RangeCount

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
    with pytest.raises(ValueError, match=r"cal.json: fit.feature_range kv_tokens.max"):
        FittedRange.from_json(bad, "cal.json")
    del bad["features"]["kv_tokens"]
    with pytest.raises(ValueError, match="cal.json: 'fit.feature_range' must be"):
        FittedRange.from_json(bad, "cal.json")


def test_a_step_past_any_maximum_counts_once_and_under_each_feature_it_passes():
    count = RangeCount(FittedRange.of_profile(STEPS))
    count.add(0, 26, 44749 - 26, 0)  # at the maxima: inside
    count.add(100, 3, 0, 0)  # small: inside
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
    count.add(0, 3, 100, 0)
    line = count.warning()
    assert line.startswith("75 % of steps read more KV tokens than the calibration saw (max 45k;")
    assert "its KV terms are extrapolated" in line
    assert "decode context tokens 75 %" in line  # the other feature it passed
    assert line.endswith("calibrate on a profile that covers such steps")
