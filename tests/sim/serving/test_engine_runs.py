"""``sim.serving.engine_runs``: a real engine's run replayed, judged, and its step time inferred
from requests alone."""

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.serving.engine_runs import (
    fit_from_requests,
    latency_errors,
    predict_served,
    priced_range,
    served_trace,
    simulate_served,
)
from sim.serving.steptime import StepCalibration, StepTerms, default_calibration

ENGINE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "engine"
needs_engine_data = pytest.mark.skipif(
    not ENGINE.is_dir(), reason="../shared/data/engine is not beside the repository"
)

TERMS = StepTerms(fixed_s=0.08, per_token_s=2e-5, per_kv_token_s=1.2e-6, per_query_kv_s=1.5e-9)


def _cal(terms=TERMS, warmup_s=0.0):
    return StepCalibration(
        default_calibration(),
        terms=terms,
        warmup_s=warmup_s,
        engine="transformers",
        model="Llama-3-8B",
        gpu="H200",
        tp=1,
    )


def _served(n=24, seed=0):
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "arrival_s": np.sort(rng.uniform(0, 20, n)),
            "prompt_tokens": rng.integers(64, 3000, n),
            "output_tokens": rng.integers(4, 40, n),
        }
    )


def _as_measured(served, predicted, ttft_scale=1.0):
    """``served`` with the first-token and finish times ``predicted`` gives (its TTFT scaled)."""
    arrival = served["arrival_s"].to_numpy()
    return served.assign(
        first_token_s=arrival + ttft_scale * predicted["ttft_s"].to_numpy(),
        finish_s=arrival + predicted["e2e_s"].to_numpy(),
    )


def test_the_warm_up_is_paid_once_on_the_first_step():
    trace = served_trace(_served())
    cold = predict_served(trace, _cal(warmup_s=1.5))
    warm = predict_served(trace, _cal())
    assert cold["ttft_s"].iloc[0] == pytest.approx(warm["ttft_s"].iloc[0] + 1.5)
    # long after, only the steps' phase differs: a fraction of one step, not the warm-up
    assert cold["ttft_s"].iloc[-1] == pytest.approx(warm["ttft_s"].iloc[-1], abs=0.05)


def test_latency_errors_are_predicted_over_measured():
    served = _served()
    predicted = predict_served(served_trace(served), _cal())
    measured = _as_measured(served, predicted, ttft_scale=1 / 1.1)
    errors = latency_errors(measured, predicted).set_index("metric")
    assert list(errors.index) == [
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
        "e2e_p50_s",
        "e2e_p99_s",
    ]
    assert errors.loc["e2e_p50_s", "error_%"] == pytest.approx(0, abs=1e-9)
    assert errors.loc["ttft_p50_s", "error_%"] == pytest.approx(10, rel=1e-9)


def test_terms_are_recovered_from_a_request_table_alone():
    served = _served(n=40, seed=2)
    truth = StepTerms(
        fixed_s=0.06,
        per_seq_s=0.0,
        per_token_s=3e-5,
        per_kv_token_s=1.41e-6,
        per_pair_s=2.05e-9,
        per_query_kv_s=1.68e-09,
    )
    predicted = predict_served(served_trace(served), _cal(truth, warmup_s=1.0))
    measured = _as_measured(served, predicted)
    fit = fit_from_requests(measured, max_evaluations=120)
    assert fit.calibration.terms.fixed_s == pytest.approx(0.06, rel=0.1)
    assert fit.errors["error_%"].abs().max() < 5
    assert set(fit.cv_errors["half"]) == {0, 1}
    # the range of the steps it infers (those its terms price on the table), checked as a step
    # fit's: the table's own requests lie inside it, a longer table's past it
    fitted = fit.calibration.fitted_range
    assert fitted is not None and fitted.steps == "simulated"
    assert fitted == priced_range(served_trace(measured), fit.calibration)
    assert fitted.min["num_decode_seqs"] >= 1 and fitted.max["kv_tokens"] > 0
    same = simulate_served(served_trace(measured), fit.calibration).summary
    assert same["priced_past_range_frac"] == 0 and same["priced_below_range_frac"] == 0
    longer = _served(n=40, seed=2).assign(output_tokens=lambda d: 10 * d["output_tokens"])
    past = simulate_served(served_trace(longer), fit.calibration).summary
    assert past["priced_past_range_frac"] > 0 and past["extrapolation_ratio"] > 1


def test_the_range_of_a_request_fit_is_of_the_steps_run_each_once(monkeypatch):
    """``priced_range`` logs each step the simulation runs once: not the steps the fast path
    prices ahead in a quiet stretch and prices again after an arrival (more than it runs)."""
    import sim.serving.engine_runs as engine_runs
    from sim.serving.fit_range import StepFeatureLog

    trace, cal = served_trace(_served(n=40, seed=2)), _cal()
    cal = dataclasses.replace(cal, fit={"feature_range": priced_range(trace, cal).to_json()})
    run = simulate_served(trace, cal).summary
    # the fast path prices more steps than it runs on this table (else nothing is tested)
    assert run["n_priced_steps"] > run["n_steps"]
    logs = []

    class Log(StepFeatureLog):
        def __init__(self):
            super().__init__()
            logs.append(self)

    monkeypatch.setattr(engine_runs, "StepFeatureLog", Log)
    fitted = priced_range(trace, cal)
    assert [log.num_steps for log in logs] == [run["n_steps"]]
    assert fitted == cal.fitted_range


def test_simulate_served_is_the_simulation_of_the_engines_schedule():
    """``simulate_served`` and ``simulate`` with the engine preset's options: the same run."""
    from sim.serving.simulate import simulate

    trace, cal = served_trace(_served()), _cal()
    ours = simulate_served(trace, cal, max_num_seqs=3).summary
    theirs = simulate(
        trace,
        "paged",
        model="Llama-3-8B",
        gpu="H200",
        calibration=cal,
        **engine_runs_options(max_num_seqs=3),
    ).summary
    for key in ("n_steps", "n_priced_steps", "ttft_p50_s", "tpot_p99_s", "e2e_p99_s"):
        assert ours[key] == theirs[key], key


def engine_runs_options(**options):
    from sim.replay.hardware import load_gpu
    from sim.replay.models import load_model
    from sim.serving.engine_runs import _engine_options

    return _engine_options("transformers", load_model("Llama-3-8B"), load_gpu("H200"), 1, options)


@needs_engine_data
def test_calibrated_on_one_workload_the_other_is_predicted_far_better_than_by_the_roofline():
    from sim.serving.step_fit import fit_step_profile
    from sim.replay.hardware import load_gpu
    from sim.replay.models import load_model
    from traces.engine_profile import read_served_requests, read_step_profile

    steps = read_step_profile(ENGINE / "transformers_cb_synth_mixed_60s_steps.csv")
    cal = fit_step_profile(
        steps, load_model("Llama-3-8B"), load_gpu("H200"), engine="transformers"
    ).calibration
    served = read_served_requests(ENGINE / "transformers_cb_azure_code_60s_requests.csv")
    calibrated = latency_errors(served, predict_served(served_trace(served), cal)).set_index(
        "metric"
    )["error_%"]
    roofline = latency_errors(served, predict_served(served_trace(served), None)).set_index(
        "metric"
    )["error_%"]
    assert (roofline < -70).all()  # issue 31: the CUDA-graph roofline is 95-99 % low on this engine
    assert (calibrated.abs() < 25).all(), calibrated


class _Logged:
    """A step-time model that logs each step it prices: the engine whose profile is recorded."""

    warmup_s = 0.0  # its first step logs the model's warm-up itself

    def __init__(self, model):
        self.model, self.rows = model, []

    def step_time_s(self, p, d, c, pc=0, k=None):
        k = (1 if p else 0) if k is None else k
        dt = self.model.step_time_s(p, d, c, pc, k) + (
            self.model.warmup_s if not self.rows else 0.0
        )
        self.rows.append(
            {
                "duration_s": dt,
                "num_prefill_seqs": k,
                "num_prefill_tokens": p,
                "prefill_context_tokens": pc + p,
                "num_decode_seqs": d,
                "decode_context_tokens": c + d,
            }
        )
        return dt

    def copy_time_s(self, nbytes):
        return self.model.copy_time_s(nbytes)

    def swap_time_s(self, nbytes):
        return self.model.swap_time_s(nbytes)


def _engine_run(cal, served):
    """``served`` run by a simulated engine priced by ``cal``: its request table and step profile
    (as ``poollab gpu serve`` records them)."""
    import dataclasses

    import simpy

    from sim.replay.hardware import load_gpu
    from sim.replay.models import load_model
    from sim.serving.engines import load_engine
    from sim.serving.server import Server
    from sim.serving.simulate import build_serving, serving_result

    model, gpu = load_model("Llama-3-8B"), load_gpu("H200")
    opts = load_engine("transformers").server_options(model, gpu)
    setup = build_serving(
        served_trace(served), "paged", model=model, gpu=gpu, calibration=cal, **opts
    )
    logged = _Logged(setup.server.step_model)
    server = Server(
        setup.requests,
        setup.scheduler,
        setup.pools,
        logged,
        setup.server.model,
        setup.cfg,
        env=simpy.Environment(),
    )
    setup = dataclasses.replace(setup, server=server)
    table = serving_result(setup, end_s=server.run(), wall_s=0.0).requests
    return _as_measured(served, table), pd.DataFrame(logged.rows)


def test_the_recorded_step_times_reproduce_the_run_they_were_recorded_in():
    """The oracle replays a run whose engine schedules as the simulator does: every step is the
    recorded one and every latency the measured one, the warm-up included (the recorded first
    step holds it, so the oracle adds none)."""
    from sim.serving.engine_runs import replay_recorded_steps

    measured, steps = _engine_run(_cal(warmup_s=0.7), _served())
    table, oracle = replay_recorded_steps(measured, steps)
    assert oracle.num_mismatched_steps == 0 and oracle.first_mismatch is None
    assert len(oracle.simulated) == len(steps)
    errors = latency_errors(measured, table)
    assert errors["error_%"].abs().max() < 1e-6, errors
    # judged by another step law, the same run misses: the oracle is what sets the latencies
    slow, oracle = replay_recorded_steps(
        measured, steps.assign(duration_s=1.3 * steps["duration_s"])
    )
    assert (latency_errors(measured, slow)["error_%"].abs() > 10).all()


def test_steps_unlike_the_recorded_ones_are_counted_from_the_first():
    from sim.serving.engine_runs import replay_recorded_steps

    measured, steps = _engine_run(_cal(), _served())
    # a profile missing its 6th step: every simulated step from there is priced by its neighbour
    shifted = steps.drop(index=5).reset_index(drop=True)
    _, oracle = replay_recorded_steps(measured, shifted)
    assert oracle.first_mismatch is not None and oracle.first_mismatch <= 5
    assert oracle.num_mismatched_steps >= 1
    assert len(oracle.simulated) >= len(shifted)  # the steps past the profile: the fallback's


@needs_engine_data
def test_the_recorded_step_times_of_a_real_run_leave_a_few_percent():
    """issue 31: with its own step times the simulator is within 2 % of transformers' run on
    every figure (the scheduling is not where calibrated predictions miss)."""
    from sim.serving.engine_runs import replay_recorded_steps
    from traces.engine_profile import read_served_requests, read_step_profile

    served = read_served_requests(ENGINE / "transformers_cb_azure_code_60s_requests.csv")
    steps = read_step_profile(ENGINE / "transformers_cb_azure_code_60s_steps.csv")
    table, oracle = replay_recorded_steps(served, steps)
    assert oracle.num_mismatched_steps == 0
    assert latency_errors(served, table)["error_%"].abs().max() < 2
