import numpy as np
import pandas as pd
import pytest

import policies
from sim.replay.schema import SUMMARY_COLUMNS, TIMESERIES_COLUMNS, read_results, write_results
from sim.replay.serving_metrics import SERVING_COLUMNS
from sim.serving.simulate import simulate, simulate_many
from traces.requests import RequestTrace, make_requests

MODEL, GPU = "Llama-3.2-1B", "H200"
BPT = 32768  # Llama-3.2-1B: 2 x 16 layers x 8 kv heads x 64 x 2 B
FIVE = ["first-fit", "best-fit", "size-class", "paged", "elastic"]


def synth(n=60, rate=50.0, seed=0, prompt=(50, 400), output=(20, 200), hash_ids=None):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    p = rng.integers(*prompt, n)
    o = rng.integers(*output, n)
    return RequestTrace(
        make_requests(t, p, o, hash_ids=hash_ids),
        name=f"synth{seed}",
        meta={"hash_block_tokens": 64},
    )


def sim(spec, trace=None, **kw):
    return simulate(trace if trace is not None else synth(), spec, model=MODEL, gpu=GPU, **kw)


def test_summary_has_the_report_schema_and_the_serving_columns():
    s = sim("paged").summary
    assert set(SUMMARY_COLUMNS + SERVING_COLUMNS) <= set(s)
    assert (s["backend"], s["policy"], s["trace"]) == ("sim", "paged", "synth0")


def test_timeseries_and_requests_tables():
    res = sim("best-fit")
    assert set(TIMESERIES_COLUMNS) <= set(res.timeseries.columns)
    assert {"running", "waiting", "kv_token_bytes", "kv_reserved_bytes", "free_pages"} <= set(
        res.timeseries.columns
    )
    assert len(res.requests) == 60
    assert {
        "arrival_s",
        "first_token_s",
        "finish_s",
        "ttft_s",
        "tpot_s",
        "e2e_s",
        "num_preemptions",
        "status",
    } <= set(res.requests.columns)


@pytest.mark.parametrize("spec", FIVE)
def test_every_request_finishes_with_enough_memory(spec):
    s = sim(spec).summary
    assert (s["n_finished"], s["n_rejected"], s["n_preempted"]) == (60, 0, 0)


def test_tpot_follows_its_definition():
    r = sim("paged").requests
    multi = r[r.output_tokens > 1]
    assert np.allclose(multi.tpot_s, (multi.e2e_s - multi.ttft_s) / (multi.output_tokens - 1))


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("spec", ["paged", "best-fit"])
def test_memory_pressure_preempts_and_every_request_still_finishes(spec, preemption):
    s = sim(spec, kv_capacity_bytes=3000 * BPT, preemption=preemption).summary
    assert s["n_preempted"] > 0
    assert s["n_finished"] == 60 and s["n_rejected"] == 0
    if preemption == "swap":
        assert s["n_swap_outs"] > 0


def test_a_request_larger_than_the_kv_pool_is_rejected_and_counted():
    t = synth(n=20)
    df = t.requests.copy()
    df.loc[5, "prompt_tokens"] = 5000
    res = sim("paged", RequestTrace(df, name="big"), kv_capacity_bytes=4000 * BPT)
    assert res.summary["n_rejected"] == 1 and res.summary["n_finished"] == 19
    assert res.requests.loc[5, "status"] == "rejected"


def test_prefix_caching_hits_shared_hash_ids_and_saves_bytes():
    n = 40
    hash_ids = [
        (1, 2, 3, 100 + i) for i in range(n)
    ]  # a 192-token shared prefix, then a block of its own
    t = synth(n=n, rate=20.0, prompt=(256, 300), hash_ids=hash_ids)
    on = sim("paged", t).summary
    off = sim("paged", t, prefix_caching=False).summary
    assert on["prefix_hit_rate"] > 0.5 and off["prefix_hit_rate"] == 0
    assert on["prefix_saved_bytes"] > 0 and off["prefix_saved_bytes"] == 0
    assert on["ttft_p50_s"] < off["ttft_p50_s"]  # fewer prompt tokens to compute


def test_kv_token_util_orders_paged_above_pow2_above_max():
    t = synth(n=150, rate=200.0)
    util = {
        s: sim(
            spec,
            t,
            kv_strategy=s if spec != "paged" else "pow2",
            kv_capacity_bytes=6000 * BPT,
            max_model_len=2048,
        ).summary["kv_token_util"]
        for spec, s in (("paged", "paged"), ("best-fit", "pow2"), ("best-fit", "max"))
    }
    assert util["paged"] > util["pow2"] > util["max"]


def test_same_input_gives_identical_results():
    a, b = sim("elastic", synth(seed=3)), sim("elastic", synth(seed=3))
    pd.testing.assert_frame_equal(a.requests, b.requests)
    pd.testing.assert_frame_equal(a.timeseries, b.timeseries)
    timing = {"wall_s", "alloc_p50_us", "alloc_p99_us", "free_p50_us", "free_p99_us"}
    same = {k: v for k, v in a.summary.items() if k not in timing}
    assert list(same) == [k for k in b.summary if k not in timing]
    assert {k: repr(v) for k, v in same.items()} == {
        k: repr(b.summary[k]) for k in same
    }  # NaN equals NaN


def test_different_seeds_give_different_traffic():
    assert (
        not sim("paged", synth(seed=1))
        .requests["e2e_s"]
        .equals(sim("paged", synth(seed=2)).requests["e2e_s"])
    )


@pytest.mark.parametrize("spec", ["paged", "best-fit"])
def test_shared_pool_holds_weights_and_activations_too(spec):
    s = sim(spec, pool_layout="shared").summary
    assert s["n_finished"] == 60
    assert s["peak_live_bytes"] > 1.2e9 * 2  # the weights live in the pool under test
    assert s["aux_peak_reserved_bytes"] == 0


def test_paged_policy_gets_the_models_bytes_per_token():
    res = sim("paged")
    assert res.policy.page_size_bytes == 16 * BPT


def test_simulate_many_writes_the_report_tables(tmp_path):
    summary, ts, reqs = simulate_many(synth(n=20), ["paged", "first-fit"], model=MODEL, gpu=GPU)
    assert list(summary["policy"]) == ["paged", "first-fit"]
    assert list(summary.columns[: len(SUMMARY_COLUMNS)]) == SUMMARY_COLUMNS
    write_results(tmp_path, summary, ts, extra_tables={"requests": reqs})
    back = read_results(tmp_path)
    assert set(back) == {"summary", "timeseries", "requests"}
    assert len(back["requests"]) == 40 and set(back["timeseries"]["policy"]) == {
        "paged",
        "first-fit",
    }


def test_unknown_policy_model_and_option_are_clear_errors():
    with pytest.raises(policies.PolicyError, match="no-such"):
        sim("no-such")
    with pytest.raises(ValueError, match="unknown model"):
        simulate(synth(n=2), "paged", model="gpt-17", gpu=GPU)
    with pytest.raises(ValueError, match="kv_stratgy"):
        sim("paged", kv_stratgy="max")


def test_first_hit_rate_leaves_out_a_preempted_requests_own_blocks():
    """Two 4-block prompts with hash ids of their own grow past a small KV budget: the later one
    is preempted and, admitted again, finds its own blocks cached (hits for ``prefix_hit_rate``,
    not first-time hits). A third request, after both, repeats the first one's prompt: the only
    first-time hit, 4 of the 12 blocks looked up at first admissions."""
    prompt = 4 * 512  # four 512-token hash blocks
    t = RequestTrace(
        make_requests(
            [0.0, 0.0, 100.0],
            [prompt] * 3,
            [3000, 3000, 10],
            hash_ids=[(1, 2, 3, 4), (5, 6, 7, 8), (1, 2, 3, 4)],
        ),
        name="preempted",
    )
    res = sim("paged", t, kv_capacity_bytes=7200 * BPT)
    s, req = res.summary, res.requests
    assert req["num_preemptions"].iloc[1] >= 1 and req["num_preemptions"].iloc[[0, 2]].tolist() == [
        0,
        0,
    ]
    assert (req["status"] == "finished").all()
    num_readmissions = int(req["num_preemptions"].iloc[1])
    assert s["prefix_first_hit_rate"] == pytest.approx(4 / 12)
    # every re-admission of the preempted request hit all four of its own blocks
    assert s["prefix_hit_rate"] == pytest.approx(
        (4 + 4 * num_readmissions) / (12 + 4 * num_readmissions)
    )
    off = sim("paged", t, kv_capacity_bytes=7200 * BPT, prefix_caching=False).summary
    assert off["prefix_hit_rate"] == 0 and off["prefix_first_hit_rate"] == 0


def _ranged(max_kv, min_kv=None):
    """A fitted calibration (70 ms a step and a KV term) whose fit saw up to ``max_kv`` KV tokens
    a step (every other feature unbounded), and at least ``min_kv`` (None: no minima recorded,
    a file of session 18)."""
    from sim.serving.fit_range import RANGE_FEATURES
    from sim.serving.steptime import StepCalibration, StepTerms, default_calibration

    top = dict.fromkeys(RANGE_FEATURES, 1e12) | {"kv_tokens": max_kv}
    low = {} if min_kv is None else dict.fromkeys(RANGE_FEATURES, 0) | {"kv_tokens": min_kv}
    return StepCalibration(
        default_calibration(),
        terms=StepTerms(fixed_s=0.07, per_kv_token_s=1e-7),
        fit={
            "feature_range": {
                "quantile": 0.99,
                "features": {
                    k: {"max": v, "quantile": v, **({"min": low[k]} if low else {})}
                    for k, v in top.items()
                },
            }
        },
    )


def test_a_calibrated_run_counts_the_steps_priced_past_the_fits_range():
    trace = synth(n=30)
    none = sim("paged", trace)
    assert none.summary["priced_past_range_frac"] is None and not none.summary["range_warning"]
    assert none.summary["extrapolation_ratio"] is None
    assert none.summary["priced_below_range_frac"] is None
    assert none.summary["n_priced_steps"] is None
    inside, past, some = (sim("paged", trace, calibration=_ranged(m)) for m in (1e12, 0, 3000))
    # the shares' base: every step run is priced, some of a quiet stretch more than once
    assert inside.summary["n_priced_steps"] >= inside.summary["n_steps"] > 0
    assert inside.summary["priced_past_range_frac"] == 0.0 and not inside.summary["range_warning"]
    assert 0 < inside.summary["extrapolation_ratio"] < 1e-6  # far inside
    assert inside.summary["priced_below_range_frac"] is None  # no minima recorded: not checked
    assert past.summary["priced_past_range_frac"] == 1.0
    assert past.summary["range_warning"].startswith(
        f"100 % of the {past.summary['n_priced_steps']:,} steps priced read more KV tokens"
    )
    assert past.summary["extrapolation_ratio"] is None  # a fit that saw no KV token: no ratio
    assert 0 < some.summary["priced_past_range_frac"] < 1
    # how far: the largest KV tokens a step read over the fit's 3,000, and the warning says it
    ratio = some.summary["extrapolation_ratio"]
    assert ratio > 1
    assert ratio * 3000 == pytest.approx(inside.summary["extrapolation_ratio"] * 1e12)
    assert f", up to {ratio:.1f}x its largest (max 3.0k;" in some.summary["range_warning"]
    # counting changes no figure
    assert inside.summary["tpot_p50_s"] == past.summary["tpot_p50_s"] == some.summary["tpot_p50_s"]


def test_a_calibrated_run_counts_the_steps_under_the_fits_smallest_apart():
    trace = synth(n=30)
    small = sim("paged", trace, calibration=_ranged(1e12, min_kv=5e6)).summary
    assert small["priced_below_range_frac"] == 1.0 and small["priced_past_range_frac"] == 0.0
    assert small["range_warning"].startswith(
        f"100 % of the {small['n_priced_steps']:,} steps priced read fewer KV tokens than the "
        "calibration's smallest "
        "(5.0M; down to "
    )
    covered = sim("paged", trace, calibration=_ranged(1e12, min_kv=1)).summary
    assert covered["priced_below_range_frac"] == 0.0 and not covered["range_warning"]
    assert small["tpot_p50_s"] == covered["tpot_p50_s"]  # counting changes no figure
