"""``sim.serving.step_fit``: the fit recovers known terms, refuses what a profile cannot determine,
reports by step kind."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.replay.hardware import load_gpu
from sim.replay.models import load_model
from sim.serving.step_fit import (
    OPTIONAL_TERMS,
    OTHER_PROFILES_SPLIT,
    ROBUST_REL_ERROR,
    SLOW_STEP_WEIGHT,
    TAIL_TRIAL_KV_SHARE,
    UnderdeterminedProfile,
    fit_step_profile,
    profile_features,
    step_kinds,
)
from sim.serving.steptime import (
    STEP_TERM_NAMES,
    StepCalibration,
    StepTerms,
    StepTimeModel,
    default_calibration,
    load_step_calibration,
)

#: the real recordings (``shared/data/README.md``), beside the repository in CI and here
ENGINE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "engine"
needs_engine_data = pytest.mark.skipif(
    not ENGINE.is_dir(), reason="../shared/data/engine is not beside the repository"
)

TRUE = StepTerms(
    fixed_s=0.07,
    per_seq_s=2e-4,
    per_token_s=2e-5,
    per_kv_token_s=1e-6,
    per_pair_s=3e-9,
    per_query_kv_s=1.5e-9,
)


@pytest.fixture(scope="module")
def llama_h200():
    return load_model("Llama-3-8B"), load_gpu("H200")


def synthetic_profile(n=400, seed=0, terms=TRUE, noise=0.0, model_gpu=None):
    """Steps of random prefill, decode and mixed composition, timed by the ``StepTimeModel`` of
    ``terms``."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        kind = i % 3
        k = int(rng.integers(1, 6)) if kind != 1 else 0
        p = int(rng.integers(k, 8192)) if k else 0
        cached = int(rng.integers(0, 4000)) * k if k and rng.random() < 0.5 else 0
        d = int(rng.integers(1, 200)) if kind != 0 else 0
        c = d * int(rng.integers(10, 4000)) if d else 0
        rows.append((p, k, cached, d, c))
    model, gpu = model_gpu
    stm = StepTimeModel(model, gpu, calibration=StepCalibration(default_calibration(), terms=terms))
    out = []
    for p, k, cached, d, c in rows:
        t = stm.step_time_s(p, d, c, cached, k) * (1 + noise * rng.standard_normal())
        out.append(
            {
                "duration_s": t,
                "num_prefill_seqs": k,
                "num_prefill_tokens": p,
                "prefill_context_tokens": cached + p,
                "num_decode_seqs": d,
                "decode_context_tokens": c + d,
            }
        )
    return pd.DataFrame(out)


def test_the_fit_recovers_known_terms(llama_h200):
    fit = fit_step_profile(synthetic_profile(model_gpu=llama_h200), *llama_h200)
    for name in STEP_TERM_NAMES:
        assert getattr(fit.terms, name) == pytest.approx(getattr(TRUE, name), rel=0.02), name
    errors = fit.errors.set_index(["split", "kind"])
    assert errors.loc[("cross-validated", "all"), "mean_abs_err_%"] < 0.5
    assert set(errors.loc["in-sample"].index) == {"prefill", "decode", "mixed", "all"}


def test_noise_and_a_cold_first_step_leave_the_terms_close_and_become_the_warm_up(llama_h200):
    steps = synthetic_profile(model_gpu=llama_h200, noise=0.03, seed=1)
    steps.loc[0, "duration_s"] += 1.5  # the engine's warm-up
    fit = fit_step_profile(steps, *llama_h200)
    assert fit.num_outliers >= 1
    assert fit.calibration.warmup_s == pytest.approx(1.5, abs=0.1)
    assert fit.terms.fixed_s == pytest.approx(TRUE.fixed_s, rel=0.05)
    assert fit.terms.per_query_kv_s == pytest.approx(TRUE.per_query_kv_s, rel=0.1)


def test_the_calibration_records_the_range_its_kept_steps_covered(llama_h200, tmp_path):
    steps = synthetic_profile(model_gpu=llama_h200, seed=1)
    big = len(steps)  # a step far larger than the rest, far too slow: the fit leaves it out
    steps.loc[big] = steps.loc[1]
    steps.loc[big, ["num_decode_seqs", "decode_context_tokens"]] = (900, 9_000_000)
    steps.loc[big, "duration_s"] = 100.0
    fit = fit_step_profile(steps, *llama_h200)
    kept = steps.drop(index=big)
    r = fit.calibration.fitted_range
    kv = kept["prefill_context_tokens"] + kept["decode_context_tokens"]
    assert r.max["kv_tokens"] == kv.max() < 9_000_000
    assert r.max["num_decode_seqs"] == kept["num_decode_seqs"].max() < 900
    assert r.max["num_prefill_tokens"] == kept["num_prefill_tokens"].max()
    assert r.quantile["kv_tokens"] == pytest.approx(np.quantile(kv, 0.99))
    # and it reads back from the file
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(fit.calibration.to_json()))
    assert load_step_calibration(path).fitted_range == r


def stalled_profile(llama_h200, seed, stall=0.45, every=5):
    """``synthetic_profile`` (2 % noise) with every ``every``-th step ``stall`` slower: the
    engine's stalls, under the 50 % outlier cut, so only the loss can keep them from setting the
    terms; and the steps' true times."""
    steps = synthetic_profile(model_gpu=llama_h200, noise=0.02, seed=seed)
    stalled = steps.index % every == 3
    steps.loc[stalled, "duration_s"] *= 1 + stall
    true_s = synthetic_profile(model_gpu=llama_h200, seed=seed)["duration_s"].to_numpy()
    return steps, stalled, true_s


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_stalls_under_the_outlier_cut_do_not_set_the_step_law(llama_h200, seed):
    steps, stalled, true_s = stalled_profile(llama_h200, seed)
    fit = fit_step_profile(steps, *llama_h200)
    assert fit.num_outliers == 0  # all of them within the cut: the Huber loss is what holds
    clean = ~stalled
    # squared error put the clean steps 4.6-5.1 % high here; the Huber loss 1.5-1.9 %
    assert np.median(fit.predicted_s[clean] / true_s[clean] - 1) < 0.025
    assert fit.terms.fixed_s == pytest.approx(TRUE.fixed_s, rel=0.03)
    # the stalled steps are more than 10 % off the fit, and counted as weighed less
    assert fit.num_downweighted >= stalled.sum()
    assert fit.calibration.fit["robust_rel_error"] == ROBUST_REL_ERROR


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_a_hosts_stalls_on_the_small_steps_do_not_lift_the_law_there(llama_h200, seed):
    """Half of the smaller half of the steps 40 % slow (a noisy host's launch-bound stretches;
    the large steps, GPU-bound, untouched): the fit prices the small steps that ran clean
    within 3.5 % (2.1-3.1 % here); a symmetric loss (``SLOW_STEP_WEIGHT`` 1) put them 4.1-6.2 %
    high, and the fixed term 7-11 % high against 4-6 %."""
    steps = synthetic_profile(model_gpu=llama_h200, noise=0.02, seed=seed)
    true_s = synthetic_profile(model_gpu=llama_h200, seed=seed)["duration_s"].to_numpy()
    small = true_s < np.median(true_s)
    stalled = small & (np.random.default_rng(seed).random(len(steps)) < 0.5)
    steps.loc[stalled, "duration_s"] *= 1.4
    fit = fit_step_profile(steps, *llama_h200)
    assert fit.num_outliers == 0  # within the outlier cut: the loss is what holds them
    clean_small = small & ~stalled
    assert np.median(fit.predicted_s[clean_small] / true_s[clean_small] - 1) < 0.035
    assert fit.terms.fixed_s == pytest.approx(TRUE.fixed_s, rel=0.065)
    assert fit.calibration.fit["slow_step_weight"] == SLOW_STEP_WEIGHT < 1


def test_a_decode_only_profile_cannot_tell_a_sequence_from_a_token(llama_h200):
    steps = synthetic_profile(model_gpu=llama_h200)
    decode = steps[steps["num_prefill_seqs"] == 0].reset_index(drop=True)
    with pytest.raises(UnderdeterminedProfile) as info:
        fit_step_profile(decode, *llama_h200)
    assert info.value.term in ("per_seq_s", "per_token_s", "per_pair_s", "per_kv_token_s")
    assert "--drop" in str(info.value) and "needs" in str(info.value)


def test_dropping_the_undetermined_terms_fits_a_decode_only_profile(llama_h200):
    terms = StepTerms(fixed_s=0.05, per_token_s=3e-4, per_kv_token_s=2e-6)
    steps = synthetic_profile(model_gpu=llama_h200, terms=terms)
    decode = steps[steps["num_prefill_seqs"] == 0].reset_index(drop=True)
    fit = fit_step_profile(decode, *llama_h200, drop=("per_seq_s", "per_pair_s", "per_query_kv_s"))
    assert fit.terms.per_seq_s == 0 and fit.terms.per_pair_s == 0
    assert fit.terms.fixed_s == pytest.approx(0.05, rel=0.02)
    assert fit.terms.per_kv_token_s == pytest.approx(2e-6, rel=0.02)


def test_a_profile_without_prefill_tokens_names_the_term_it_cannot_fit(llama_h200):
    steps = synthetic_profile(model_gpu=llama_h200)
    same = steps.assign(
        num_prefill_seqs=0,
        num_prefill_tokens=0,
        prefill_context_tokens=0,
        num_decode_seqs=8,
        decode_context_tokens=8000,
    )
    with pytest.raises(UnderdeterminedProfile, match="cannot determine"):
        fit_step_profile(same, *llama_h200, drop=("per_seq_s",))


#: an engine whose attention hides under its kernel launches up to 20,000 KV tokens a step
EXPOSED = dataclasses.replace(TRUE, per_exposed_kv_token_s=1.2e-6, num_hidden_kv_tokens=20_000)
ADD = ("per_exposed_kv_token_s",)


def _cv_error(fit):
    return fit.errors.set_index(["split", "kind"]).loc[("cross-validated", "all"), "mean_abs_err_%"]


def test_the_fit_prices_a_tail_past_the_launch_bound_steps_and_where_it_starts(llama_h200):
    """An engine launch-bound on 80 % of its steps, whose attention shows past that KV count: the
    default fit finds where (within 10 %) and the tail's slope (within 15 %: the law, fitted on
    every step first, takes a part of it, its per-KV term 11 % high and the count 7 % high, as
    with session 15's choice of the count), and halves the cross-validated error of the fit
    without the tail. (The count lies among the steps the tail is tried on,
    ``TAIL_TRIAL_KV_SHARE``: one past them is the next test's.)"""
    kv = profile_features(synthetic_profile(model_gpu=llama_h200))[:, 3]
    hidden = float(np.quantile(kv, 0.8))
    assert hidden < TAIL_TRIAL_KV_SHARE * kv.max()
    law = dataclasses.replace(TRUE, per_exposed_kv_token_s=1.2e-6, num_hidden_kv_tokens=hidden)
    steps = synthetic_profile(model_gpu=llama_h200, terms=law)
    fit = fit_step_profile(steps, *llama_h200)
    assert fit.terms.num_hidden_kv_tokens == pytest.approx(hidden, rel=0.1)
    assert fit.terms.per_exposed_kv_token_s == pytest.approx(1.2e-6, rel=0.15)
    for name in ("fixed_s", "per_query_kv_s"):
        assert getattr(fit.terms, name) == pytest.approx(getattr(TRUE, name), rel=0.05), name
    assert fit.terms.per_kv_token_s == pytest.approx(TRUE.per_kv_token_s, rel=0.15)
    plain = fit_step_profile(steps, *llama_h200, drop=ADD)
    assert plain.terms.per_exposed_kv_token_s == 0 and plain.terms.num_hidden_kv_tokens == 0
    assert _cv_error(fit) < 0.6 * _cv_error(plain)


def test_the_tail_leaves_the_law_and_the_steps_under_it_as_they_were(llama_h200):
    """A second stage, not a joint fit: the five-term law is the fit's without the tail, so every
    step that reads no more KV tokens than the hidden count is priced as before."""
    kv = profile_features(synthetic_profile(model_gpu=llama_h200))[:, 3]
    law = dataclasses.replace(
        TRUE, per_exposed_kv_token_s=1.2e-6, num_hidden_kv_tokens=float(np.quantile(kv, 0.9))
    )
    steps = synthetic_profile(model_gpu=llama_h200, terms=law, noise=0.03)
    fit = fit_step_profile(steps, *llama_h200)
    plain = fit_step_profile(steps, *llama_h200, drop=ADD)
    assert fit.terms.per_exposed_kv_token_s > 0
    for name in STEP_TERM_NAMES[:-1]:
        assert getattr(fit.terms, name) == getattr(plain.terms, name), name
    under = kv <= fit.terms.num_hidden_kv_tokens
    assert 0 < under.sum() < len(kv)
    assert np.array_equal(fit.predicted_s[under], plain.predicted_s[under])
    assert (fit.predicted_s[~under] > plain.predicted_s[~under]).all()


def test_the_tail_is_chosen_by_how_it_extrapolates_to_the_profiles_top_steps(llama_h200):
    """A rise only on the steps past ``TAIL_TRIAL_KV_SHARE`` of the largest KV count: no tail
    fitted on the steps under that share predicts it, so the default fit keeps none (chosen by
    the loss of every step, it would place a steep tail there, the slope that another run's
    larger steps extrapolate); ``add`` places its tail among the trial steps."""
    kv = profile_features(synthetic_profile(model_gpu=llama_h200))[:, 3]
    top = float(np.quantile(kv, 0.99))
    assert top > TAIL_TRIAL_KV_SHARE * kv.max()
    law = dataclasses.replace(TRUE, per_exposed_kv_token_s=1.2e-6, num_hidden_kv_tokens=top)
    steps = synthetic_profile(model_gpu=llama_h200, terms=law)
    fit = fit_step_profile(steps, *llama_h200)
    assert fit.terms.per_exposed_kv_token_s == 0 and fit.terms.num_hidden_kv_tokens == 0
    added = fit_step_profile(steps, *llama_h200, add=ADD)
    assert 0 < added.terms.num_hidden_kv_tokens <= TAIL_TRIAL_KV_SHARE * kv.max()


def test_a_profile_the_law_already_fits_keeps_no_tail_unless_added(llama_h200):
    """No tail in the engine: the default fit keeps none (it would gain less than
    EXPOSED_MIN_GAIN) and is the fit without it; ``add`` fits one anyway."""
    steps = synthetic_profile(model_gpu=llama_h200, noise=0.02)
    fit = fit_step_profile(steps, *llama_h200)
    assert fit.terms == fit_step_profile(steps, *llama_h200, drop=ADD).terms
    assert fit.terms.per_exposed_kv_token_s == 0 and fit.terms.num_hidden_kv_tokens == 0
    added = fit_step_profile(steps, *llama_h200, add=ADD)
    assert added.terms.num_hidden_kv_tokens > 0 and added.calibration.fit["added"] == list(ADD)


def test_the_fitted_exposed_kv_term_prices_the_simulators_steps(llama_h200):
    """10 decode sequences over 19,990 cached tokens read 20,000 KV tokens: none exposed; 10,000
    more cached tokens are all exposed."""
    with_term, without = (
        StepTimeModel(*llama_h200, calibration=StepCalibration(default_calibration(), terms=t))
        for t in (EXPOSED, dataclasses.replace(EXPOSED, per_exposed_kv_token_s=0.0))
    )

    def exposed_s(cached):
        return (
            with_term.step_cost(0, 10, cached).fitted_s - without.step_cost(0, 10, cached).fitted_s
        )

    assert exposed_s(19_990) == pytest.approx(0.0, abs=1e-12)
    assert exposed_s(29_990) == pytest.approx(10_000 * 1.2e-6, rel=1e-9)


def test_a_profile_of_two_kv_counts_cannot_place_the_exposed_kv_term(llama_h200):
    """Decode steps that read 8,000 or 30,000 KV tokens and nothing else: any start of the
    exposed-KV term is a mix of the fixed and per-KV-token terms, so the fit names it."""
    d = np.arange(120) % 60 + 1
    kv = np.where(np.arange(120) % 2 == 0, 8_000, 30_000)
    terms = StepTerms(fixed_s=0.07, per_token_s=2e-5, per_kv_token_s=1e-6, per_query_kv_s=1e-9)
    stm = StepTimeModel(
        *llama_h200, calibration=StepCalibration(default_calibration(), terms=terms)
    )
    steps = pd.DataFrame(
        {
            "duration_s": [stm.step_time_s(0, int(n), int(c - n)) for n, c in zip(d, kv)],
            "num_prefill_seqs": 0,
            "num_prefill_tokens": 0,
            "prefill_context_tokens": 0,
            "num_decode_seqs": d,
            "decode_context_tokens": kv,
        }
    )
    drop = ("per_seq_s", "per_pair_s")
    default = fit_step_profile(steps, *llama_h200, drop=drop)  # no tail placed: none kept
    assert default.terms.fixed_s == pytest.approx(0.07)
    assert default.terms.per_exposed_kv_token_s == 0
    with pytest.raises(UnderdeterminedProfile) as info:
        fit_step_profile(steps, *llama_h200, drop=drop, add=ADD)
    message = str(info.value)
    assert info.value.term == "per_exposed_kv_token_s" and len(message.splitlines()) == 1
    assert "needs decode steps of few sequences and of many" in message
    assert "fit without --add per_exposed_kv_token_s" in message


def test_a_profile_of_one_kv_count_has_no_steps_to_try_a_tail_on(llama_h200):
    """Every step reads 30,000 KV tokens: none lies under ``TAIL_TRIAL_KV_SHARE`` of the largest,
    so no tail is kept and ``add`` names the term (not an error from an empty trial set)."""
    d = np.arange(60) % 30 + 1
    steps = pd.DataFrame(
        {
            "duration_s": 0.07 + 1e-4 * d,
            "num_prefill_seqs": 0,
            "num_prefill_tokens": 0,
            "prefill_context_tokens": 0,
            "num_decode_seqs": d,
            "decode_context_tokens": 30_000,
        }
    )
    drop = ("per_seq_s", "per_pair_s", "per_kv_token_s", "per_query_kv_s")
    fit = fit_step_profile(steps, *llama_h200, drop=drop)
    assert fit.terms.per_exposed_kv_token_s == 0 and fit.terms.num_hidden_kv_tokens == 0
    assert fit.terms.fixed_s == pytest.approx(0.07)
    with pytest.raises(UnderdeterminedProfile) as info:
        fit_step_profile(steps, *llama_h200, drop=drop, add=ADD)
    assert info.value.term == "per_exposed_kv_token_s"


def test_only_an_optional_term_can_be_added(llama_h200):
    assert OPTIONAL_TERMS == ADD
    with pytest.raises(ValueError, match="--add per_kv_token_s: no such optional term"):
        fit_step_profile(
            synthetic_profile(model_gpu=llama_h200, n=30), *llama_h200, add=("per_kv_token_s",)
        )


def test_an_unknown_term_is_named(llama_h200):
    with pytest.raises(ValueError, match="no such term"):
        fit_step_profile(
            synthetic_profile(model_gpu=llama_h200, n=30), *llama_h200, drop=("per_banana_s",)
        )


def test_features_count_what_the_step_time_model_counts(llama_h200):
    steps = synthetic_profile(model_gpu=llama_h200, n=30)
    x = profile_features(steps)
    stm = StepTimeModel(*llama_h200, calibration=StepCalibration(default_calibration(), terms=TRUE))
    floor = StepTimeModel(*llama_h200)
    for i, row in steps.iterrows():
        args = (
            int(row.num_prefill_tokens),
            int(row.num_decode_seqs),
            int(row.decode_context_tokens - row.num_decode_seqs),
            int(row.prefill_context_tokens - row.num_prefill_tokens),
            int(row.num_prefill_seqs),
        )
        linear = float(x[i] @ np.array([getattr(TRUE, n) for n in STEP_TERM_NAMES]))
        assert stm.step_time_s(*args) == pytest.approx(
            max(linear, floor.step_time_s(*args)), rel=1e-9
        )
    assert list(step_kinds(steps[:3])) == ["prefill", "decode", "mixed"]


@needs_engine_data
def test_the_shared_transformers_recording_fits_within_15_percent_cross_validated(llama_h200):
    from traces.engine_profile import read_step_profile

    steps = read_step_profile(ENGINE / "transformers_cb_synth_mixed_60s_steps.csv")
    fit = fit_step_profile(steps, *llama_h200)
    errors = fit.errors.set_index(["split", "kind"])
    assert errors.loc[("cross-validated", "all"), "mean_abs_err_%"] < 15
    assert 0.05 < fit.terms.fixed_s < 0.15  # ~100 ms a step even at batch 2: no CUDA graphs
    assert fit.terms.per_query_kv_s > 0  # attention over the whole packed step


def test_a_pool_of_one_profile_is_that_profiles_fit(llama_h200):
    steps = synthetic_profile(model_gpu=llama_h200, noise=0.02, seed=5)
    alone = fit_step_profile(steps, *llama_h200, source="a.csv")
    pooled = fit_step_profile({"a.csv": steps}, *llama_h200)
    assert pooled.terms == alone.terms
    pd.testing.assert_frame_equal(pooled.errors, alone.errors)
    assert pooled.calibration.to_json() == alone.calibration.to_json()
    assert pooled.profile_errors.empty and "sources" not in pooled.calibration.fit


def test_a_pool_fits_one_law_over_its_profiles_and_tables_each(llama_h200):
    """Two runs of one engine, one on a host 25 % slower: the pool prices steps between the two
    hosts and is the fit of their steps concatenated; each profile's errors are tabled, and
    each is predicted by the fit on the other."""
    quiet = synthetic_profile(model_gpu=llama_h200, seed=6, noise=0.02)
    noisy = synthetic_profile(model_gpu=llama_h200, seed=7, noise=0.02)
    noisy["duration_s"] *= 1.25
    fit = fit_step_profile({"quiet.csv": quiet, "noisy.csv": noisy}, *llama_h200, source="x")
    concatenated = fit_step_profile(pd.concat([quiet, noisy], ignore_index=True), *llama_h200)
    assert fit.terms == concatenated.terms and fit.num_steps == len(quiet) + len(noisy)
    assert fit.calibration.source == "quiet.csv + noisy.csv"
    assert [s["source"] for s in fit.calibration.fit["sources"]] == ["quiet.csv", "noisy.csv"]
    assert [s["num_steps"] for s in fit.calibration.fit["sources"]] == [400, 400]
    per = fit.profile_errors.set_index(["profile", "split", "kind"])
    assert list(fit.profile_errors.columns[:2]) == ["profile", "split"]
    assert per.loc[("quiet.csv", "in-sample", "all"), "n_steps"] == 400
    # the pool prices each run between the two hosts: the quiet one high, the noisy one low
    assert 5 < per.loc[("quiet.csv", "in-sample", "all"), "sum_bias_%"] < 20
    assert -15 < per.loc[("noisy.csv", "in-sample", "all"), "sum_bias_%"] < -5
    # judged by the fit on the other run alone, each run is off by the other's host
    apart = {
        p: per.loc[(p, OTHER_PROFILES_SPLIT, "all"), "sum_bias_%"]
        for p in ("quiet.csv", "noisy.csv")
    }
    assert apart["quiet.csv"] == pytest.approx(25, abs=2)
    assert apart["noisy.csv"] == pytest.approx(-20, abs=2)
    pooled_rows = fit.errors.set_index(["split", "kind"])
    assert pooled_rows.loc[(OTHER_PROFILES_SPLIT, "all"), "n_steps"] == 800
    assert fit.calibration.fit["profile_errors"][0]["profile"] == "quiet.csv"


def test_a_pools_cross_validation_blocks_lie_within_each_profile(llama_h200):
    """Block i holds the i-th part of every profile: the pool's CV error is the one of the
    concatenated steps interleaved so that each block is contiguous."""
    a = synthetic_profile(model_gpu=llama_h200, seed=8, noise=0.05, n=200)
    b = synthetic_profile(model_gpu=llama_h200, seed=9, noise=0.05, n=200)
    fit = fit_step_profile({"a": a, "b": b}, *llama_h200, drop=ADD)
    interleaved = pd.concat(
        [part for i in range(5) for part in (a[40 * i : 40 * i + 40], b[40 * i : 40 * i + 40])],
        ignore_index=True,
    )
    alone = fit_step_profile(interleaved, *llama_h200, drop=ADD)
    cv = ("cross-validated", "all")
    assert fit.errors.set_index(["split", "kind"]).loc[cv, "mean_abs_err_%"] == pytest.approx(
        alone.errors.set_index(["split", "kind"]).loc[cv, "mean_abs_err_%"]
    )


def test_a_pools_warm_up_is_the_median_of_its_cold_starts(llama_h200):
    cold_a, cold_b, warm = (
        synthetic_profile(model_gpu=llama_h200, seed=s, noise=0.02) for s in (10, 11, 12)
    )
    cold_a.loc[0, "duration_s"] += 1.0
    cold_b.loc[0, "duration_s"] += 2.0
    fit = fit_step_profile({"a": cold_a, "b": cold_b, "w": warm}, *llama_h200)
    assert fit.calibration.warmup_s == pytest.approx(1.5, abs=0.1)  # the warm run's 0 left out
    assert [s["warmup_s"] > 0 for s in fit.calibration.fit["sources"]] == [True, True, False]
    assert fit_step_profile({"w": warm, "w2": warm.copy()}, *llama_h200).calibration.warmup_s == 0


def test_a_pool_determines_a_term_its_profiles_alone_cannot(llama_h200):
    steps = synthetic_profile(model_gpu=llama_h200)
    decode = steps[steps["num_prefill_seqs"] == 0].reset_index(drop=True)
    prefill = steps[steps["num_prefill_seqs"] > 0].reset_index(drop=True)
    with pytest.raises(UnderdeterminedProfile):
        fit_step_profile({"d1": decode, "d2": decode.copy()}, *llama_h200)
    fit = fit_step_profile({"d": decode, "p": prefill}, *llama_h200)
    assert fit.terms.fixed_s == pytest.approx(TRUE.fixed_s, rel=0.02)


def test_an_empty_pool_or_profile_is_refused_by_name(llama_h200):
    with pytest.raises(ValueError, match="no step profile"):
        fit_step_profile({}, *llama_h200)
    steps = synthetic_profile(model_gpu=llama_h200, n=30)
    with pytest.raises(ValueError, match="^b.csv: the step profile has no steps"):
        fit_step_profile({"a.csv": steps, "b.csv": steps[:0]}, *llama_h200)
