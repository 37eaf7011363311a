"""Fit a serving engine's step time from its step profile (``traces.engine_profile``).

The model is ``sim.serving.steptime``'s: ``max(roofline, StepTerms)``, six non-negative linear terms
(fixed, per sequence, per token, per KV token read, per causal pair inside a sequence, per
query x KV pair of the whole step) over the roofline of the model and GPU as the floor. The
terms are fitted by non-negative least squares on relative error (each step weighs by
1 / its duration, so 70 ms decode steps count as much as 1 s prefills) with a Huber loss (a
step more than ``ROBUST_REL_ERROR`` off weighs as if its error grew linearly, not squared:
iteratively reweighted; past that, a step slower than the law weighs ``SLOW_STEP_WEIGHT`` of
one as much faster: the engine's stalls only ever slow a step), then once more without the
outliers the first fit shows (a warm-up
step, a pause: more than ``OUTLIER_REL_ERROR`` off), which are counted, not hidden.

**The exposed-KV tail** (``per_exposed_kv_token_s`` past ``num_hidden_kv_tokens``): an engine
without CUDA graphs is bound by its kernel launches until a step's attention work outgrows them;
past that KV count each token costs more than the launch-bound steps show. The fit prices it as
a second stage: the five-term law above is fitted as always, on every step; then, with that law
held, the tail's one slope is fitted (the same Huber loss) to what the law misses on the steps
past the count. The count is chosen by how the tail extrapolates, within the profile: fitted
(law and tail) on the steps that read at most ``TAIL_TRIAL_KV_SHARE`` of its largest KV count,
the count whose fit misses the steps past them least wins. The tail is kept only where it lowers
that loss by ``EXPOSED_MIN_GAIN`` or more (``add`` keeps it anyway), so a profile whose large
steps the law already fits prices every step as before. A second stage, not a
joint fit: a joint fit lets the tail reshape the small steps' law too, and a profile whose
small steps were slow or fast for that run alone then carries that to every run it judges
(session 14's opt-in joint fit lost figures in four workload pairs held out; this one in none).

Why the tail (issue 31, session 15): with each step lasting what the engine's own step took
(``sim.serving.engine_runs.replay_recorded_steps``), the simulator is within 5 % of every
recording on every figure, so what a held-out prediction misses is the step law; most of it was
fits of small-batch profiles (decode batches under ~40, KV under ~40k tokens a step) judged on
the synthetic 60 s runs (batches of 50-140 over 100-250k KV tokens), 15-25 % low: the tail lifts
the held-out count on 17 recordings from 1,243 to 1,305 of 1,380, no workload pair worse.

Why the Huber loss (issue 31, session 14): the engine's own stalls (a stretch of small steps
at 130 ms where its twin run took 75 ms; dozens of steps a run 10-70 % slow) are part of each
condition's run-to-run spread, not its step law; squared error let the ones under the outlier
cut set the terms, so a fit carried a run's accidents to the others
(held out on 17 recordings: 1,194 -> 1,243 of 1,380 figures, no workload pair worse;
``benchmarks/RESULTS.md``).

Why NNLS with the roofline as the floor, not the roofline as a seventh feature nor a Vidur-style
random forest: every term is a physical cost that cannot be negative, so NNLS keeps the fit
meaningful and extrapolates linearly to batches the profile never saw (a forest predicts at
most the largest step it was shown); as a feature the roofline is nearly a mix of the fixed,
per-token and per-KV-token terms: on six transformers recordings it took weight 0 to 0.89 and
moved the held-out step error by 0.4 points at most (``benchmarks/bench_calibration.py
--variants``, RESULTS.md), while as a floor it keeps the uncalibrated CUDA-graph engine exactly
what it was.

A profile that cannot determine a term (its column is zero, or a mix of the others: decode
steps alone cannot tell a per-sequence cost from a per-token one) is refused with
``UnderdeterminedProfile`` naming the term and the steps that would determine it, unless the
term is left out (``drop``: held at 0).

Errors are reported by step kind (``prefill``: no decode sequence; ``decode``: no prefill
token; ``mixed``) in-sample and cross-validated over contiguous blocks of steps (each block
predicted by a fit on the others, so neighbouring steps do not leak).

**A pool of profiles** (several recordings of one engine, a mapping of source to profile): their
steps are concatenated and fitted as one profile, each step weighing as in a profile of its own.
Why (issue 31, session 18): a fit carries the share of slow launch-bound steps of the run it was
recorded in (the host's noise, ``benchmarks/RESULTS.md`` sessions 16 and 17); several runs
average it out. Each profile's first step may be its engine's warm-up: the pool's ``warmup_s`` is
the median over the profiles that started cold. The cross-validation blocks are contiguous
within each profile (block i: the i-th part of every profile), and each profile is also
predicted by the fit on the others (``fit on the other profiles``), the error to expect on a new
recording; ``StepFit.profile_errors`` tables each profile's steps apart.

The calibration records the range of step features the fit's steps covered
(``fit.feature_range``, ``sim.serving.fit_range``): a simulated step past it is counted as
extrapolated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from sim.replay.hardware import GpuSpec
from sim.replay.models import ModelSpec
from sim.serving.fit_range import FittedRange
from sim.serving.steptime import (
    STEP_TERM_NAMES,
    StepCalibration,
    StepTerms,
    StepTimeModel,
    default_calibration,
    step_pairs,
    term_features,
)

__all__ = [
    "UnderdeterminedProfile",
    "StepFit",
    "fit_step_profile",
    "profile_features",
    "step_kinds",
    "STEP_KINDS",
    "OPTIONAL_TERMS",
    "EXPOSED_MIN_GAIN",
    "TAIL_TRIAL_KV_SHARE",
    "OUTLIER_REL_ERROR",
    "ROBUST_REL_ERROR",
    "SLOW_STEP_WEIGHT",
    "error_table",
    "OTHER_PROFILES_SPLIT",
]

STEP_KINDS = ("prefill", "decode", "mixed")
#: A step the first fit misses by more than this (relative) is an outlier: left out of the refit.
OUTLIER_REL_ERROR = 0.5
#: Where the fit's loss turns from squared to linear (relative error of a step): the typical
#: step-to-step jitter of an eager engine's launch-bound steps (robust std 3-9 % in most of
#: the H200 recordings), so ordinary steps fit by least squares and stalls weigh less.
ROBUST_REL_ERROR = 0.1
#: Past ``ROBUST_REL_ERROR``, a step slower than the law weighs this share of what a step as far
#: faster weighs (the law's fit, ``_nnls_terms``; not the tail's slope). Why (issue 31, session
#: 20): the engine's noise is one-sided -- stretches of launch-bound steps 20-60 % slow on some
#: hosts, over a floor common to every run (``benchmarks/RESULTS.md``, session 16, t4) -- so a
#: symmetric loss lifts a noisy run's fixed and per-sequence terms and lowers its per-token and
#: query x KV ones in trade, and carries both to every run it judges. Held out on 25 recordings:
#: 3,077 -> 3,100 of 3,204 single-run, 664 -> 665 of 672 pooled by condition, 149 of 150 by
#: workload (0.25 and 0.4: 3,102 and 3,109, 666 and 667; 0.75: 3,065; session 20, t5).
SLOW_STEP_WEIGHT = 0.5
#: Reweighting rounds of the Huber fit (it stops earlier when the weights settle).
_ROBUST_ROUNDS = 10
#: A term whose (scaled) column the others reproduce within this relative residual is undetermined.
_COLLINEAR = 0.02
#: Contiguous blocks of the cross-validation.
DEFAULT_FOLDS = 5
#: The error split of a pool's profiles, each predicted by the fit on the other profiles.
OTHER_PROFILES_SPLIT = "fit on the other profiles"

#: What data determines each term (the refusal names it).
_WHAT_DETERMINES = {
    "fixed_s": "steps of different sizes, small ones included (a decode step of one sequence)",
    "per_seq_s": "prefill steps whose sequences have more than one token each, beside decode steps",
    "per_token_s": "steps whose token count varies apart from their sequence count "
    "(prefills of different lengths)",
    "per_kv_token_s": "decode steps of one batch size at different context lengths",
    "per_pair_s": "prefill chunks of different lengths after different cached contexts",
    "per_query_kv_s": "steps whose query tokens and KV tokens vary apart "
    "(mixed prefill and decode steps, batches of different sizes and contexts)",
    "per_exposed_kv_token_s": "decode steps of few sequences and of many (a few and dozens), "
    "so that some read fewer KV tokens than the engine's kernel launches hide and some more",
}
#: Terms fitted only where they earn their place (the exposed-KV tail: ``EXPOSED_MIN_GAIN``);
#: ``add`` (``--add``) fits them anyway, ``drop`` holds them at 0.
OPTIONAL_TERMS = ("per_exposed_kv_token_s",)
#: The exposed-KV tail is kept when it lowers the profile's Huber loss (since session 19: of the
#: steps past the trial steps, ``TAIL_TRIAL_KV_SHARE``) by this share or more. On the 17 H200
#: recordings (in-sample loss, session 15) the tails that gain less (0-0.2 %: profiles whose
#: large steps the five-term law already fits) carry slopes of 0-0.13 us a token that only move
#: other runs' predictions; at 0.5-1 % the held-out count is 1,305 of 1,380, at 2 % 1,286,
#: without the rule 1,295 (``benchmarks/RESULTS.md``, session 15, T5).
EXPOSED_MIN_GAIN = 0.01
#: The exposed-KV tail is tried on the steps reading at most this share of the profile's largest
#: KV count and scored on the rest (``_choose_hidden_kv_tokens``). Why (issue 31, session 19):
#: chosen by the loss of all steps, a tail placed near the profile's top is a steep slope over
#: few steps that another run extrapolates six-fold (fits on the 10 s runs judged on the 60 s
#: runs, +19-28 %); scored on steps it was not fitted to, held out on 25 recordings the count
#: rises 3,037 -> 3,077 of 3,204 single-run, 646 -> 664 of 672 pooled by condition (shares 0.5
#: and 0.77: 3,058 and 3,079, 664 and 663; ``benchmarks/RESULTS.md``, session 19, t1).
TAIL_TRIAL_KV_SHARE = 2 / 3
_EXPOSED = STEP_TERM_NAMES.index("per_exposed_kv_token_s")
#: Where the fit tries ``num_hidden_kv_tokens``: these quantiles of the KV tokens per step of
#: the trial steps (``TAIL_TRIAL_KV_SHARE``).
_HIDDEN_KV_QUANTILES = np.linspace(0.0, 0.9, 19)
#: ... and this many counts between the best one's neighbours.
_HIDDEN_KV_REFINE = 21


class UnderdeterminedProfile(ValueError):
    """The profile cannot determine ``term``; ``hint`` says what steps would."""

    def __init__(self, term: str, hint: str, why: str):
        self.term, self.hint = term, hint
        leave_out = f"fit without --add {term}" if term in OPTIONAL_TERMS else f"--drop {term}"
        super().__init__(
            f"the step profile cannot determine {term} ({why}); it needs {hint}, "
            f"or leave the term out: {leave_out}"
        )


def step_kinds(steps: pd.DataFrame) -> np.ndarray:
    """``"prefill"``, ``"decode"`` or ``"mixed"`` for each step of a profile."""
    has_p = steps["num_prefill_tokens"].to_numpy() > 0
    has_d = steps["num_decode_seqs"].to_numpy() > 0
    return np.where(has_p & has_d, "mixed", np.where(has_p, "prefill", "decode"))


def profile_features(steps: pd.DataFrame, num_hidden_kv_tokens: float = 0.0) -> np.ndarray:
    """``(n_steps, len(STEP_TERM_NAMES))``: what each ``StepTerms`` term multiplies, from the
    profile's counts (its context columns count the new tokens, as ``StepTimeModel``'s ``kv``
    does)."""
    p = steps["num_prefill_tokens"].to_numpy(np.float64)
    k = steps["num_prefill_seqs"].to_numpy(np.float64)
    pc = steps["prefill_context_tokens"].to_numpy(np.float64)
    d = steps["num_decode_seqs"].to_numpy(np.float64)
    dc = steps["decode_context_tokens"].to_numpy(np.float64)
    return np.column_stack(
        term_features(p, d, k, pc + dc, step_pairs(p, k, pc - p, dc), num_hidden_kv_tokens)
    )


def roofline_s(steps: pd.DataFrame, roofline: StepTimeModel) -> np.ndarray:
    """The roofline's time of each profile step (the fitted model's floor)."""
    out = np.empty(len(steps))
    cols = [
        steps[c].to_numpy(np.int64)
        for c in (
            "num_prefill_tokens",
            "num_decode_seqs",
            "decode_context_tokens",
            "prefill_context_tokens",
            "num_prefill_seqs",
        )
    ]
    for i, (p, d, dc, pc, k) in enumerate(zip(*cols)):
        out[i] = roofline.step_time_s(int(p), int(d), int(dc - d), int(pc - p), int(k))
    return out


@dataclass
class StepFit:
    """A fit: the terms, what it left out, and its errors (``error_table``'s frame);
    ``num_downweighted``: the steps kept in the fit that its Huber loss weighed less (more than
    ``ROBUST_REL_ERROR`` off the final fit); ``profile_errors`` (a pool of profiles only, else
    empty): ``error_table``'s rows of each profile's steps, a ``profile`` column (its source)
    first; a pool's ``errors`` and ``profile_errors`` add the split ``OTHER_PROFILES_SPLIT``."""

    terms: StepTerms
    num_steps: int
    num_outliers: int
    dropped: tuple[str, ...]
    errors: pd.DataFrame
    calibration: StepCalibration
    predicted_s: np.ndarray = field(repr=False, default_factory=lambda: np.empty(0))
    num_downweighted: int = 0
    profile_errors: pd.DataFrame = field(repr=False, default_factory=pd.DataFrame)


def _check_determined(x: np.ndarray, active: list[int], only: int | None = None) -> None:
    """Raise ``UnderdeterminedProfile`` for the first active column the others reproduce
    (``only``: check that column alone)."""
    for j in active if only is None else [only]:
        col = x[:, j]
        norm = np.linalg.norm(col)
        if norm == 0:
            raise UnderdeterminedProfile(
                STEP_TERM_NAMES[j],
                _WHAT_DETERMINES[STEP_TERM_NAMES[j]],
                "no step has what it multiplies",
            )
        others = [i for i in active if i != j]
        if not others:
            continue
        a = x[:, others]
        coef, *_ = np.linalg.lstsq(a, col, rcond=None)
        if np.linalg.norm(col - a @ coef) / norm < _COLLINEAR:
            raise UnderdeterminedProfile(
                STEP_TERM_NAMES[j],
                _WHAT_DETERMINES[STEP_TERM_NAMES[j]],
                "in these steps it moves with the other terms",
            )


def _scaled(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Columns as the fit weighs them (relative to each step's time), each scaled to at most 1."""
    a = x / y[:, None]
    return a / np.maximum(np.abs(a).max(axis=0), 1e-300)


def _huber_loss(rel: np.ndarray) -> float:
    """The fit's loss of relative errors ``rel``: squared within ``ROBUST_REL_ERROR``, linear
    beyond (the two meet smoothly)."""
    a, r = np.abs(rel), ROBUST_REL_ERROR
    return float(np.sum(np.where(a <= r, a * a, 2 * r * a - r * r)))


def _extrapolation_loss(
    x: np.ndarray, y: np.ndarray, floor: np.ndarray, active: list[int], train: np.ndarray
) -> float:
    """The Huber loss, on the steps outside ``train``, of ``_fit``'s terms fitted on ``train``."""
    coef, _ = _fit(x[train], y[train], floor[train], active)
    test = ~train
    return _huber_loss(np.maximum(x[test] @ coef, floor[test]) / y[test] - 1)


def _choose_hidden_kv_tokens(
    steps: pd.DataFrame, y: np.ndarray, floor: np.ndarray, active: list[int], *, force: bool
) -> float | None:
    """``num_hidden_kv_tokens``, chosen by how well a tail extrapolates: each count is tried on
    the steps that read at most ``TAIL_TRIAL_KV_SHARE`` of the profile's largest KV count (the
    five-term law and the tail fitted there, ``_fit``) and scored by the Huber loss on the steps
    past them. The counts tried are the trial steps' KV counts (``_HIDDEN_KV_QUANTILES``, then
    ``_HIDDEN_KV_REFINE`` counts between the best one's neighbours); one where the exposed-KV
    column is a mix of the others on the trial steps is not tried. None (no tail) when no count
    is left or the best one lowers the score of the fit without a tail by less than
    ``EXPOSED_MIN_GAIN``; with ``force`` (``add``) those raise ``UnderdeterminedProfile`` and
    keep the tail, respectively."""
    kv = (steps["prefill_context_tokens"] + steps["decode_context_tokens"]).to_numpy(np.float64)
    j = _EXPOSED
    train = kv <= TAIL_TRIAL_KV_SHARE * kv.max()
    # too few trial steps to fit the terms on (or none past them): no count can be scored
    can_score = train.sum() >= 2 * len(active) and not train.all()

    def loss(hidden: float) -> float:
        x = profile_features(steps, hidden)
        try:
            _check_determined(_scaled(x[train], y[train]), active, only=j)
        except UnderdeterminedProfile:
            return math.inf
        return _extrapolation_loss(x, y, floor, active, train)

    if can_score:
        grid = np.unique(np.round(np.quantile(kv[train], _HIDDEN_KV_QUANTILES)))
        losses = [loss(h) for h in grid]
    else:
        grid, losses = np.zeros(1), [math.inf]
    i = int(np.argmin(losses))
    if not math.isfinite(losses[i]):
        if not force:
            return None
        raise UnderdeterminedProfile(
            STEP_TERM_NAMES[j],
            _WHAT_DETERMINES[STEP_TERM_NAMES[j]],
            "at no KV count do its steps' times turn from flat to rising apart from "
            "the other terms",
        )
    fine = np.unique(
        np.round(
            np.linspace(grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)], _HIDDEN_KV_REFINE)
        )
    )
    fine_losses = [loss(h) for h in fine]
    k = int(np.argmin(fine_losses))
    hidden, best = (
        (float(fine[k]), fine_losses[k])
        if fine_losses[k] < losses[i]
        else (float(grid[i]), losses[i])
    )
    if not force:
        law = [t for t in active if t != j]
        without = _extrapolation_loss(profile_features(steps), y, floor, law, train)
        if best > (1 - EXPOSED_MIN_GAIN) * without:
            return None
    return hidden


def _tail_slope(column: np.ndarray, y: np.ndarray, law_s: np.ndarray, keep: np.ndarray) -> float:
    """The exposed-KV tail's slope (>= 0) with the law held: the Huber fit (relative, as
    ``_nnls_terms``) of ``column`` (KV tokens past the hidden count) to what ``law_s`` misses,
    over the steps of ``keep`` that have a tail."""
    m = keep & (column > 0)
    if m.sum() < 2:
        return 0.0
    a, miss = column[m] / y[m], 1 - law_s[m] / y[m]
    huber = np.ones(int(m.sum()))
    slope = 0.0
    for _ in range(_ROBUST_ROUNDS):
        slope = max(0.0, float(np.sum(huber * a * miss) / np.sum(huber * a * a)))
        rel = np.abs(a * slope - miss)
        weights = np.where(rel <= ROBUST_REL_ERROR, 1.0, ROBUST_REL_ERROR / np.maximum(rel, 1e-300))
        if np.allclose(weights, huber, rtol=1e-6, atol=0):
            break
        huber = weights
    return slope


def _nnls_terms(x: np.ndarray, y: np.ndarray, active: list[int]) -> np.ndarray:
    """Non-negative coefficients minimising the Huber loss of the relative error (squared
    within ``ROBUST_REL_ERROR``, linear beyond, and beyond it a step slower than the law weighs
    ``SLOW_STEP_WEIGHT`` of a step as much faster; iteratively reweighted least squares),
    inactive terms 0."""
    a = x[:, active] / y[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    huber = np.ones(len(y))
    for _ in range(_ROBUST_ROUNDS):
        root = np.sqrt(huber)
        coef, _ = nnls(a * root[:, None], root)
        signed = a @ coef - 1
        rel = np.abs(signed)
        weights = np.where(rel <= ROBUST_REL_ERROR, 1.0, ROBUST_REL_ERROR / np.maximum(rel, 1e-300))
        # a step far slower than the law is more likely a stall than its cost (SLOW_STEP_WEIGHT)
        weights = np.where(
            (signed < 0) & (rel > ROBUST_REL_ERROR), SLOW_STEP_WEIGHT * weights, weights
        )
        if np.allclose(weights, huber, rtol=1e-6, atol=0):
            break
        huber = weights
    out = np.zeros(x.shape[1])
    out[active] = coef / scale
    return out


def _fit(
    x: np.ndarray, y: np.ndarray, floor: np.ndarray, active: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """``(coefficients, outlier mask)``: the law of the active terms but the exposed-KV tail by
    NNLS, then NNLS again without the outliers of the first; then, when the tail is active, its
    slope with that law held (``_tail_slope``, the module docstring)."""
    law = [j for j in active if j != _EXPOSED]
    coef = _nnls_terms(x, y, law)
    rel = np.maximum(x @ coef, floor) / y - 1
    outliers = np.abs(rel) > OUTLIER_REL_ERROR
    if outliers.any() and (~outliers).sum() >= len(law):
        coef = _nnls_terms(x[~outliers], y[~outliers], law)
    if _EXPOSED in active:
        coef[_EXPOSED] = _tail_slope(x[:, _EXPOSED], y, np.maximum(x @ coef, floor), ~outliers)
    return coef, outliers


def _predicted_apart(
    x: np.ndarray, y: np.ndarray, floor: np.ndarray, active: list[int], blocks: list[np.ndarray]
) -> np.ndarray:
    """Each block of steps predicted by the fit (``_fit``) on the steps of the other blocks."""
    out = np.empty(len(y))
    for block in blocks:
        train = np.ones(len(y), bool)
        train[block] = False
        c, _ = _fit(x[train], y[train], floor[train], active)
        out[block] = np.maximum(x[block] @ c, floor[block])
    return out


def error_table(
    measured_s: np.ndarray,
    predicted_s: np.ndarray,
    kinds: np.ndarray,
    *,
    split: str,
    keep: np.ndarray | None = None,
) -> pd.DataFrame:
    """Rows per step kind (and ``all``): steps, mean absolute relative error and the bias of
    the summed time (predicted / measured - 1), both in %; ``keep`` masks the steps counted."""
    keep = np.ones(len(measured_s), bool) if keep is None else keep
    rows = []
    for kind in (*STEP_KINDS, "all"):
        m = keep & ((kinds == kind) if kind != "all" else True)
        if not m.any():
            continue
        rel = predicted_s[m] / measured_s[m] - 1
        rows.append(
            {
                "split": split,
                "kind": kind,
                "n_steps": int(m.sum()),
                "mean_abs_err_%": float(100 * np.mean(np.abs(rel))),
                "sum_bias_%": float(100 * (predicted_s[m].sum() / measured_s[m].sum() - 1)),
            }
        )
    return pd.DataFrame(rows)


def _pool(
    steps: pd.DataFrame | Mapping[str, pd.DataFrame], source: str
) -> tuple[pd.DataFrame, list[str], list[np.ndarray]]:
    """The profile, or a pool's profiles concatenated; the sources; each one's step indices."""
    if isinstance(steps, pd.DataFrame):
        return steps, [source], [np.arange(len(steps))]
    if not steps:
        raise ValueError("no step profile to fit")
    empty = [name for name, frame in steps.items() if frame.empty]
    if empty:
        raise ValueError(f"{empty[0]}: the step profile has no steps")
    frames = list(steps.values())
    ends = np.cumsum([len(f) for f in frames])
    return (
        pd.concat(frames, ignore_index=True),
        [str(name) for name in steps],
        [np.arange(end - len(f), end) for f, end in zip(frames, ends)],
    )


def fit_step_profile(
    steps: pd.DataFrame | Mapping[str, pd.DataFrame],
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    tensor_parallel: int = 1,
    drop: Iterable[str] = (),
    add: Iterable[str] = (),
    folds: int = DEFAULT_FOLDS,
    engine: str | None = None,
    source: str = "",
) -> StepFit:
    """Fit ``StepTerms`` to a step profile (``traces.engine_profile.read_step_profile``'s frame),
    or to a pool of them (source -> profile: their steps concatenated; the module docstring).

    Args:
        steps: the profile, or the pool (two or more profiles: ``StepFit.profile_errors``).
        model, gpu, tensor_parallel: what the engine ran (the roofline floor's).
        drop: terms held at 0 (names from ``STEP_TERM_NAMES``; ``drop`` wins over ``add``).
        add: ``OPTIONAL_TERMS`` to fit even where they gain less than ``EXPOSED_MIN_GAIN``
            (the exposed-KV tail and its ``num_hidden_kv_tokens``: ``_choose_hidden_kv_tokens``),
            and to raise ``UnderdeterminedProfile`` where the profile cannot place them.
        folds: contiguous blocks of the cross-validation (fewer when the profile is short).
        engine, source: recorded in the calibration (what engine, which file; a pool's
            sources are its keys, joined with " + ").

    Raises ``UnderdeterminedProfile`` (a ValueError) for a term the steps cannot determine,
    ValueError for an unknown term name or an empty pool.
    """
    steps, sources, members = _pool(steps, source)
    pooled = len(sources) > 1
    drop, add = tuple(drop), tuple(add)
    unknown = [t for t in drop if t not in STEP_TERM_NAMES]
    if unknown:
        raise ValueError(f"--drop {unknown[0]}: no such term; terms: {', '.join(STEP_TERM_NAMES)}")
    unknown = [t for t in add if t not in OPTIONAL_TERMS]
    if unknown:
        raise ValueError(
            f"--add {unknown[0]}: no such optional term; optional terms: "
            f"{', '.join(OPTIONAL_TERMS)}"
        )
    held = set(drop)
    active = [j for j, name in enumerate(STEP_TERM_NAMES) if name not in held]
    if not active:
        raise ValueError("every term dropped: nothing to fit")
    y = steps["duration_s"].to_numpy(np.float64)
    if len(y) < 2 * len(active):
        raise ValueError(
            f"the step profile has {len(y)} steps; "
            f"fitting {len(active)} terms needs at least {2 * len(active)}"
        )
    exposed = _EXPOSED
    # every other term first: the exposed-KV column depends on where it starts, chosen below
    _check_determined(_scaled(profile_features(steps), y), [j for j in active if j != exposed])
    floor = roofline_s(
        steps,
        StepTimeModel(
            model, gpu, calibration=default_calibration(), tensor_parallel=tensor_parallel
        ),
    )
    # the CV folds keep this count: it is chosen once, on the whole profile
    hidden = (
        _choose_hidden_kv_tokens(steps, y, floor, active, force=STEP_TERM_NAMES[exposed] in add)
        if exposed in active
        else None
    )
    if hidden is None:  # no tail: held at 0, as a dropped term
        active = [j for j in active if j != exposed]
        hidden = 0.0
    x = profile_features(steps, hidden)
    kinds = step_kinds(steps)
    coef, outliers = _fit(x, y, floor, active)
    predicted = np.maximum(x @ coef, floor)
    # block i: the i-th part of every profile (one profile: its contiguous blocks)
    num_blocks = max(2, min(folds, len(y) // (2 * len(active))))
    parts = [np.array_split(member, num_blocks) for member in members]
    blocks = [np.concatenate([p[i] for p in parts]) for i in range(num_blocks)]
    cv = _predicted_apart(x, y, floor, active, blocks)
    splits = [("in-sample", predicted, ~outliers), ("cross-validated", cv, ~outliers)]
    if pooled:
        splits.append(
            (OTHER_PROFILES_SPLIT, _predicted_apart(x, y, floor, active, members), ~outliers)
        )
    errors = pd.concat(
        [error_table(y, pred, kinds, split=split, keep=keep) for split, pred, keep in splits]
        + [error_table(y, predicted, kinds, split="in-sample, outliers too")],
        ignore_index=True,
    )
    profile_errors = (
        pd.concat(
            [
                error_table(y[m], pred[m], kinds[m], split=split, keep=keep[m]).assign(profile=name)
                for name, m in zip(sources, members)
                for split, pred, keep in splits
            ],
            ignore_index=True,
        )[["profile", *errors.columns]]
        if pooled
        else pd.DataFrame()
    )
    terms = StepTerms(
        **{name: float(c) for name, c in zip(STEP_TERM_NAMES, coef)}, num_hidden_kv_tokens=hidden
    )
    downweighted = int(np.sum(~outliers & (np.abs(predicted / y - 1) > ROBUST_REL_ERROR)))
    # a cold first step (the engine's warm-up) is an outlier the simulator should still pay once
    warmups = [
        float(y[i] - predicted[i]) if outliers[i] and y[i] > predicted[i] else 0.0
        for i in (m[0] for m in members)
    ]
    warmup_s = float(np.median([w for w in warmups if w > 0])) if any(warmups) else 0.0
    fit_info: dict[str, Any] = {
        "num_steps": int(len(y)),
        "num_outliers": int(outliers.sum()),
        "dropped": list(drop),
        "added": list(add),
        "first_step_s": float(y[0]),
        "warmup_s": warmup_s,
        "outlier_rel_error": OUTLIER_REL_ERROR,
        "robust_rel_error": ROBUST_REL_ERROR,
        "slow_step_weight": SLOW_STEP_WEIGHT,
        "num_downweighted": downweighted,
        "folds": len(blocks),
        "errors": errors.round(3).to_dict(orient="records"),
        # what the steps the fit kept covered: a simulated step past it is extrapolated
        "feature_range": FittedRange.of_profile(steps[~outliers]).to_json(),
    }
    if pooled:
        fit_info["sources"] = [
            {
                "source": name,
                "num_steps": len(m),
                "num_outliers": int(outliers[m].sum()),
                "first_step_s": float(y[m[0]]),
                "warmup_s": w,
            }
            for name, m, w in zip(sources, members, warmups)
        ]
        fit_info["profile_errors"] = profile_errors.round(3).to_dict(orient="records")
    cal = StepCalibration(
        factors=default_calibration(),
        terms=terms,
        warmup_s=warmup_s,
        engine=engine,
        model=model.name,
        gpu=gpu.name,
        tp=tensor_parallel,
        fit=fit_info,
        source=" + ".join(sources),
    )
    return StepFit(
        terms=terms,
        num_steps=len(y),
        num_outliers=int(outliers.sum()),
        dropped=drop,
        errors=errors,
        calibration=cal,
        predicted_s=predicted,
        num_downweighted=downweighted,
        profile_errors=profile_errors,
    )
