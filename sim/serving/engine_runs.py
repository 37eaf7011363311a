"""A real engine's run, replayed in the simulator: predict its served-request table and judge the
prediction.

``predict_served`` simulates the requests of a served-request table
(``traces.engine_profile.read_served_requests``: arrival, prompt and output tokens) with an
engine preset's scheduling (``sim.serving.engines``) and a step-time calibration; ``latency_errors``
compares TTFT, TPOT and e2e at p50 and p99 with what the engine measured.
``fit_from_requests`` infers the step-time terms from the request table alone, by simulating
it and fitting the terms to its latencies (``poollab calibrate requests``).

``replay_recorded_steps`` is the oracle that splits a prediction's error in two: the same
simulation with each step lasting what the engine's own step of that index lasted
(``RecordedStepTimes``), so that what it still misses is the simulator's scheduling (admission,
chunking, when a first token counts), and what a calibrated prediction misses beyond it is the
step-time model's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import minimize

from sim.serving.engines import load_engine
from sim.serving.fit_range import FittedRange, StepFeatureLog
from sim.replay.hardware import DEFAULT_GPU, load_gpu
from sim.replay.models import DEFAULT_MODEL, load_model
from sim.replay.serving_metrics import add_latencies, latency_percentiles
from sim.serving.steptime import STEP_TERM_NAMES, StepCalibration, StepTerms, default_calibration
from traces.requests import RequestTrace, make_requests

__all__ = [
    "served_trace",
    "predict_served",
    "simulate_served",
    "served_setup",
    "latency_errors",
    "fit_from_requests",
    "priced_range",
    "LATENCY_METRICS",
    "RequestFit",
    "RecordedStepTimes",
    "replay_recorded_steps",
]

#: The figures a prediction is judged on (``sim.replay.serving_metrics.latency_percentiles``' keys).
LATENCY_METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "e2e_p99_s")
#: Terms ``fit_from_requests`` fits: request latencies determine these four; the per-sequence
#: and per-pair terms move with them at a request table's resolution and stay 0.
REQUEST_FIT_TERMS = ("fixed_s", "per_token_s", "per_kv_token_s", "per_query_kv_s")


def served_trace(served: pd.DataFrame, name: str = "served") -> RequestTrace:
    """The requests of a served-request table, as a trace to simulate."""
    df = make_requests(
        served["arrival_s"].to_numpy(np.float64),
        served["prompt_tokens"].to_numpy(np.int64),
        served["output_tokens"].to_numpy(np.int64),
    )
    return RequestTrace(requests=df, name=name, format="served")


def predict_served(trace: RequestTrace, calibration: Any, **kwargs: Any) -> pd.DataFrame:
    """The simulated request table (``add_latencies``' columns) of ``trace`` served as the
    engine schedules, steps priced by ``calibration`` (a file, ``StepCalibration`` or None);
    ``kwargs`` are ``simulate_served``'s."""
    return simulate_served(trace, calibration, **kwargs).requests


def simulate_served(trace: RequestTrace, calibration: Any, **kwargs: Any) -> Any:
    """``predict_served``'s run whole: its ``SimResult`` (the summary row too: how many steps the
    calibration priced past what its fit saw, ``priced_past_range_frac``); ``kwargs`` are
    ``served_setup``'s."""
    from sim.serving.simulate import serving_result

    wall0 = time.perf_counter()
    setup = served_setup(trace, calibration, **kwargs)
    end_s = setup.server.run()
    return serving_result(setup, end_s=end_s, wall_s=time.perf_counter() - wall0)


def served_setup(
    trace: RequestTrace,
    calibration: Any,
    *,
    engine: str = "transformers",
    model: Any = DEFAULT_MODEL,
    gpu: Any = DEFAULT_GPU,
    tensor_parallel: int = 1,
    policy: str = "paged",
    **options: Any,
) -> Any:
    """The simulated server (``sim.serving.simulate.build_serving``'s ``ServingSetup``, not run)
    that serves ``trace`` as ``engine`` schedules it, on ``model`` and ``gpu``, its steps priced
    by ``calibration`` (a file, ``StepCalibration`` or None); ``options`` (``ServerConfig``
    knobs) win over the engine preset's. The one setup of ``simulate_served`` and
    ``priced_range``."""
    from sim.serving.simulate import build_serving

    model, gpu = load_model(model), load_gpu(gpu)
    opts = _engine_options(engine, model, gpu, tensor_parallel, options)
    return build_serving(trace, policy, model=model, gpu=gpu, calibration=calibration, **opts)


def _engine_options(
    engine: str, model: Any, gpu: Any, tensor_parallel: int, options: dict[str, Any]
) -> dict[str, Any]:
    """``simulate``'s options for ``engine``'s preset, ``options`` winning."""
    return load_engine(engine).server_options(
        model,
        gpu,
        explicit={"tensor_parallel": tensor_parallel, **options},
        tensor_parallel=tensor_parallel,
    )


#: The columns of a step profile that say what a step computed (``traces.engine_profile``), in
#: ``StepTimeModel.step_time_s``'s terms: prefill tokens, decode sequences, prefill sequences.
_COMPOSITION_COLUMNS = ("num_prefill_tokens", "num_decode_seqs", "num_prefill_seqs")


class RecordedStepTimes:
    """An oracle step time: the i-th simulated step lasts the engine's i-th recorded step
    (``steps``, a step profile), the warm-up included (the recorded first step holds it); steps
    past the recording cost what ``fallback`` (a ``StepTimeModel``) says. Copies and swaps are
    ``fallback``'s.

    It answers "with the step times right, how far off is the simulation?" only while the
    simulated steps are the recorded ones: ``num_mismatched_steps`` counts the steps whose
    composition (prefill tokens, decode sequences, prefill sequences) differs from the recorded
    step of that index, ``first_mismatch`` the first (None: every step matched).
    """

    warmup_s = 0.0  # the recorded first step's duration holds the engine's warm-up

    def __init__(self, steps: pd.DataFrame, fallback: Any):
        self._durations_s = steps["duration_s"].to_numpy(np.float64)
        self._recorded = steps[list(_COMPOSITION_COLUMNS)].to_numpy(np.int64)
        self._fallback = fallback
        self.simulated: list[tuple[int, int, int]] = []

    def step_time_s(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        context_tokens: int,
        prefill_context_tokens: int = 0,
        num_prefill_seqs: int | None = None,
    ) -> float:
        """The recorded duration of the step of this index (``StepTimeModel.step_time_s``'s
        arguments, recorded for the composition check)."""
        k = (1 if prefill_tokens else 0) if num_prefill_seqs is None else num_prefill_seqs
        i = len(self.simulated)
        self.simulated.append((prefill_tokens, decode_seqs, k))
        if i < len(self._durations_s):
            return float(self._durations_s[i])
        return self._fallback.step_time_s(
            prefill_tokens, decode_seqs, context_tokens, prefill_context_tokens, num_prefill_seqs
        )

    def decode_step_times_s(
        self, decode_seqs: int, context_tokens: int, num_steps: int
    ) -> list[float]:
        """Not offered: a quiet decode run asks for more steps than it may take, which would
        shift the index (``replay_recorded_steps`` turns those runs off)."""
        raise NotImplementedError("RecordedStepTimes prices one step at a time")

    def copy_time_s(self, nbytes: int) -> float:
        return self._fallback.copy_time_s(nbytes)

    def swap_time_s(self, nbytes: int) -> float:
        return self._fallback.swap_time_s(nbytes)

    @property
    def _mismatched(self) -> np.ndarray:
        n = min(len(self.simulated), len(self._recorded))
        sim = np.array(self.simulated[:n], np.int64).reshape(n, len(_COMPOSITION_COLUMNS))
        return np.flatnonzero((sim != self._recorded[:n]).any(axis=1))

    @property
    def num_mismatched_steps(self) -> int:
        """Simulated steps whose composition is not the recorded step's of the same index, plus
        the steps one side has and the other has not."""
        return len(self._mismatched) + abs(len(self.simulated) - len(self._recorded))

    @property
    def first_mismatch(self) -> int | None:
        """Index of the first step that differs (or that one side lacks); None when none does."""
        m = self._mismatched
        if len(m):
            return int(m[0])
        if len(self.simulated) != len(self._recorded):
            return min(len(self.simulated), len(self._recorded))
        return None


def replay_recorded_steps(
    served: pd.DataFrame,
    steps: pd.DataFrame,
    *,
    engine: str = "transformers",
    model: Any = DEFAULT_MODEL,
    gpu: Any = DEFAULT_GPU,
    tensor_parallel: int = 1,
    policy: str = "paged",
    **options: Any,
) -> tuple[pd.DataFrame, RecordedStepTimes]:
    """The oracle: ``predict_served`` of ``served``'s requests with each step timed as the
    engine's recorded step of that index (``RecordedStepTimes`` over ``steps``, the same run's
    step profile). Returns the simulated request table and the oracle (its composition check).

    ``latency_errors(served, table)`` is then the simulator's own share of a prediction's error;
    the rest of a calibrated prediction's error is the step-time model's."""
    import simpy

    from sim.serving.server import Server
    from sim.serving.simulate import build_serving, serving_result

    model, gpu = load_model(model), load_gpu(gpu)
    opts = _engine_options(engine, model, gpu, tensor_parallel, options)
    setup = build_serving(served_trace(served), policy, model=model, gpu=gpu, **opts)
    built = setup.server  # not run: the same server again, timed by the oracle
    oracle = RecordedStepTimes(steps, built.step_model)
    # an environment of its own turns the fast path off: one step_time_s call per step, in
    # order, no closed-form decode runs (the results are the same either way for a
    # StepTimeModel, tests/sim/serving/test_step_fast_path.py)
    server = Server(
        setup.requests,
        setup.scheduler,
        setup.pools,
        oracle,
        built.model,
        setup.cfg,
        env=simpy.Environment(),
    )
    setup = dataclasses.replace(setup, server=server)
    end_s = server.run()
    return serving_result(setup, end_s=end_s, wall_s=0.0).requests, oracle


def latency_errors(measured: pd.DataFrame, predicted: pd.DataFrame) -> pd.DataFrame:
    """One row per ``LATENCY_METRICS`` figure: measured and predicted seconds and the error in %
    (predicted / measured - 1). ``measured`` is a served-request table; both get latencies added."""
    m = latency_percentiles(add_latencies(measured.copy()))
    p = latency_percentiles(
        add_latencies(predicted.copy()) if "ttft_s" not in predicted else predicted
    )
    return pd.DataFrame(
        [
            {
                "metric": k,
                "measured_s": m[k],
                "predicted_s": p[k],
                "error_%": 100 * (p[k] / m[k] - 1) if m[k] else math.nan,
            }
            for k in LATENCY_METRICS
        ]
    )


class RequestFit:
    """``fit_from_requests``' result: the calibration and its expected error.

    Attributes:
        calibration: the fitted ``StepCalibration`` (``fit`` holds the errors below).
        errors: ``latency_errors`` of the fitted terms on the whole table (in-sample).
        cv_errors: the same for each half of the requests predicted by terms fitted to the
            other half's latencies (``half`` column: 0 even requests, 1 odd); empty without
            ``two_fold``.
    """

    def __init__(self, calibration: StepCalibration, errors: pd.DataFrame, cv_errors: pd.DataFrame):
        self.calibration, self.errors, self.cv_errors = calibration, errors, cv_errors


def _calibration(x: np.ndarray, start: dict[str, float], **meta: Any) -> StepCalibration:
    """The calibration at search point ``x``: log-multipliers of ``start``'s terms, then of its
    warm-up."""
    scaled = {name: start[name] * math.exp(v) for name, v in zip(REQUEST_FIT_TERMS, x)}
    terms = StepTerms(
        **{name: scaled.get(name, start[name]) for name in start if name != "warmup_s"}
    )
    return StepCalibration(
        default_calibration(), terms=terms, warmup_s=start["warmup_s"] * math.exp(x[-1]), **meta
    )


def _loss(measured: pd.DataFrame, predicted: pd.DataFrame, mask: np.ndarray) -> float:
    """Squared log-ratio of predicted to measured TTFT, TPOT and e2e, per request of ``mask``,
    plus the same for their p50 and p99 (the figures a user reads)."""
    total = 0.0
    for col in ("ttft_s", "tpot_s", "e2e_s"):
        m = measured[col].to_numpy(np.float64)[mask]
        p = predicted[col].to_numpy(np.float64)[mask]
        ok = np.isfinite(m) & np.isfinite(p) & (m > 0) & (p > 0)
        if ok.any():
            total += float(np.mean(np.log(p[ok] / m[ok]) ** 2))
            for q in (50, 99):
                total += float(np.log(np.percentile(p[ok], q) / np.percentile(m[ok], q)) ** 2)
    return total


def fit_from_requests(
    served: pd.DataFrame,
    *,
    engine: str = "transformers",
    model: Any = DEFAULT_MODEL,
    gpu: Any = DEFAULT_GPU,
    tensor_parallel: int = 1,
    source: str = "",
    max_evaluations: int = 200,
    two_fold: bool = True,
) -> RequestFit:
    """Infer ``StepTerms`` from a served-request table alone: simulate its requests as
    ``engine`` schedules them and fit ``REQUEST_FIT_TERMS`` (Nelder-Mead on their logarithms,
    so they stay positive; the warm-up too) to its per-request TTFT, TPOT and e2e. Start: the
    preset's ``typical_terms`` (a fitted step time of that engine), else half the median TPOT
    as the fixed cost and small other terms. Expected error: the in-sample errors and a two-fold
    check (terms fitted on the even requests' latencies judge the odd ones', and back); the
    simulation serves every request either way, since each one's latency depends on the others in
    its batches; ``two_fold`` False skips that check, a third of the work.

    Raises ValueError when fewer than 4 requests finished (nothing to fit).
    """
    model_spec, gpu_spec = load_model(model), load_gpu(gpu)
    measured = add_latencies(served.copy().reset_index(drop=True))
    done = measured["finish_s"].notna().to_numpy()
    if done.sum() < 4:
        raise ValueError(
            f"the request table has {int(done.sum())} finished requests; fitting needs at least 4"
        )
    trace = served_trace(served)
    order = np.argsort(
        served["arrival_s"].to_numpy(), kind="stable"
    )  # simulated rows are in arrival order
    measured = measured.iloc[order].reset_index(drop=True)
    done = done[order]

    preset = load_engine(engine)
    start = {name: 0.0 for name in STEP_TERM_NAMES}
    start.update(preset.typical_terms)
    tpot0 = (
        float(np.nanmedian(measured["tpot_s"])) if np.isfinite(measured["tpot_s"]).any() else 0.05
    )
    fallback = {
        "fixed_s": 0.5 * tpot0,
        "per_token_s": 1e-6,
        "per_kv_token_s": 1e-8,
        "per_query_kv_s": 1e-12,
    }
    for (
        name
    ) in REQUEST_FIT_TERMS:  # a term the preset does not know starts small, so that it can grow
        start[name] = start[name] or fallback[name]
    start["warmup_s"] = preset.typical_warmup_s or max(tpot0, 1e-3)
    meta = dict(engine=engine, model=model_spec.name, gpu=gpu_spec.name, tp=tensor_parallel)

    def simulate_terms(x: np.ndarray) -> pd.DataFrame:
        return predict_served(
            trace,
            _calibration(x, start, **meta),
            engine=engine,
            model=model_spec,
            gpu=gpu_spec,
            tensor_parallel=tensor_parallel,
        )

    def fit(mask: np.ndarray) -> np.ndarray:
        x0 = np.zeros(len(REQUEST_FIT_TERMS) + 1)
        simplex = np.vstack(
            [x0, x0 + np.eye(len(x0)) * 0.7]
        )  # each term x2 up front: a wide first look
        res = minimize(
            lambda x: _loss(measured, simulate_terms(x), mask),
            x0,
            method="Nelder-Mead",
            options={
                "maxfev": max_evaluations,
                "xatol": 0.01,
                "fatol": 1e-5,
                "initial_simplex": simplex,
            },
        )
        return res.x

    x = fit(done)
    errors = latency_errors(measured, simulate_terms(x))
    halves = []
    idx = np.arange(len(measured))
    for half in (0, 1) if two_fold else ():
        train = done & (idx % 2 != half)
        predicted = simulate_terms(fit(train))
        test = idx % 2 == half
        e = latency_errors(measured[test], predicted[test])
        e.insert(0, "half", half)
        halves.append(e)
    cv_errors = (
        pd.concat(halves, ignore_index=True)
        if halves
        else pd.DataFrame(columns=["half", *errors.columns])
    )
    fit_info = {
        "from": "requests",
        "num_requests": int(len(measured)),
        "num_finished": int(done.sum()),
        "fitted_terms": list(REQUEST_FIT_TERMS),
        "errors": errors.round(4).to_dict(orient="records"),
        "two_fold_errors": cv_errors.round(4).to_dict(orient="records"),
    }
    final = _calibration(x, start, **meta)
    # the range of the steps the fitted terms price on this table (the steps it infers), so
    # that a run of this calibration is checked as a step fit's is (sim.serving.fit_range)
    fit_info["feature_range"] = priced_range(
        trace, final, engine=engine, model=model_spec, gpu=gpu_spec, tensor_parallel=tensor_parallel
    ).to_json()
    cal = dataclasses.replace(final, fit=fit_info, source=source)
    return RequestFit(cal, errors, cv_errors)


def priced_range(trace: RequestTrace, calibration: StepCalibration, **kwargs: Any) -> FittedRange:
    """The range of the step features (``sim.serving.fit_range``) of the steps ``calibration``
    prices when ``trace`` is simulated as ``served_setup`` (``kwargs``) builds it: what a fit
    that never saw a step, ``fit_from_requests``, can know of its steps. The run's steps, each
    once: the server's fast path (``Server.fast_path``, results identical without it) prices a
    quiet decode stretch a few steps ahead and prices again those an arrival cut off, which
    would log steps never run (the larger contexts of a stretch's end) and some twice; off, each
    step is priced as it runs."""
    setup = served_setup(trace, calibration, **kwargs)
    log = StepFeatureLog()
    setup.server.step_model.range_count = log
    setup.server.fast_path = False
    setup.server.run()
    return log.fitted_range()
