"""The range of step features a step-time fit saw, and the simulated steps that lie past it.

A fitted step law (``sim.serving.step_fit``) is linear in the step's counts, so it extrapolates
to any step; how far it carries is another matter. Why this check (issue 31, session 18): fits
on the 10 s synthetic recordings (at most 45k KV tokens a step) judged on the 60 s runs (median
98-128k, up to 265k) miss TPOT p50 by +19-25 %, because the exposed-KV tail's slope, fitted past
~30k, is extrapolated six-fold (``benchmarks/RESULTS.md``, "Session 18 (t1)"). The calibration
records what each feature covered (``FittedRange``: the largest value, ``RANGE_QUANTILE`` and
the smallest nonzero value); the step-time model counts the steps it prices past the largest or
under the smallest (``RangeCount``), how far past (the largest it priced: the judged run's
largest KV tokens over the fit's, ``extrapolation_ratio``, tells an Azure fit on a 60 s run,
2.7x and 8 % of figures missed, from a 10 s fit, 5.9x and 30 %), and the run says so
(``RangeCount.warning``). A calibration without a range (written before it was recorded) is not
checked; one without minima (written before session 19) is not checked below.

The shares are of the steps *priced*, not of those run (``RangeCount.num_steps`` against the
summary's ``n_steps``): the server's fast path prices a quiet decode stretch a few steps ahead
and prices again, after an arrival, the steps the arrival cut off, so a run prices a few steps
more than it runs (1-4 % on three recorded pairs) and counts some twice. A user reads a share
of steps as one of the run's (the ``n_steps`` beside it), so the names say which: the columns
are ``priced_past_range_frac`` and ``priced_below_range_frac`` over ``n_priced_steps``, and the
warning says "68 % of the 673 steps priced". Counting run steps would take the server's hot loop
reporting the steps it commits; measured against runs with the fast path off (every step priced
once, as it runs; results identical), the priced shares were within 1.6 points of the run's
(``benchmarks/RESULTS.md``, "Session 20 (t4)"). ``calibrate requests``' range
(``sim.serving.engine_runs.priced_range``) is taken with the fast path off: of the run's steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from traces.errors import shown
from traces.knobs import is_finite_number

__all__ = [
    "BELOW_WARN_FRAC",
    "RANGE_FEATURES",
    "RANGE_QUANTILE",
    "RANGE_TABLE_COLUMNS",
    "RENAMED_RANGE_COLUMNS",
    "FittedRange",
    "RangeCount",
    "StepFeatureLog",
    "range_warning_lines",
    "step_range_features",
]

#: The features whose range is recorded, in the step profile's counts (context columns count
#: the new tokens too); ``kv_tokens`` is every KV token the step's attention reads (prefill and
#: decode context: what the per-KV and exposed-KV terms multiply).
RANGE_FEATURES = (
    "num_prefill_tokens",
    "prefill_context_tokens",
    "num_decode_seqs",
    "decode_context_tokens",
    "kv_tokens",
)
#: The summary's range columns a terminal table shows beside a run's figures (``sweep``'s pareto
#: fronts, ``gpu serve --sim``'s comparison; ``sim.serving.simulate.CALIBRATION_COLUMNS`` has
#: them all): the shares of the priced steps past and under the fit's range, and how far past.
RANGE_TABLE_COLUMNS = ("priced_past_range_frac", "extrapolation_ratio", "priced_below_range_frac")
#: The shares' names before session 21 (they did not say their base), old name -> new: a sweep
#: resumed over cell records written then reads them under the new names.
RENAMED_RANGE_COLUMNS = {
    "extrapolated_step_frac": "priced_past_range_frac",
    "below_range_step_frac": "priced_below_range_frac",
}
#: How each feature reads in a warning.
_WORDS = {
    "num_prefill_tokens": "prefill tokens",
    "prefill_context_tokens": "prefill context tokens",
    "num_decode_seqs": "decode sequences",
    "decode_context_tokens": "decode context tokens",
    "kv_tokens": "KV tokens",
}
#: The largest value a range records: past it a float no longer counts one by one, and no step
#: reads that many tokens (``1e30`` in a file is an edit or corruption, not a fit).
MAX_FEATURE_VALUE = 2**53
#: The high quantile recorded beside each maximum (how far the bulk of the steps reached).
RANGE_QUANTILE = 0.99
#: The share of steps under the range from which the warning names them (they are counted from
#: the first): held out over 25 recordings (RESULTS.md, "Session 19 (t5)"), nearly every judged
#: run had a few steps under its fit's smallest (a short prefill, a tail of small batches: 0-18 %
#: of its steps), and its figures were missed no more often than those of runs with none (4.7 %
#: against 5.6 %): a step law's small end is its fixed term, which every step determines. A
#: warning on every run would say nothing; a fit on large batches used on small ones is flagged.
BELOW_WARN_FRAC = 0.25


def step_range_features(steps: pd.DataFrame) -> dict[str, np.ndarray]:
    """Each of ``RANGE_FEATURES`` for every step of a profile (``traces.engine_profile``)."""
    out = {name: steps[name].to_numpy(np.float64) for name in RANGE_FEATURES if name != "kv_tokens"}
    out["kv_tokens"] = out["prefill_context_tokens"] + out["decode_context_tokens"]
    return out


#: ``FittedRange.steps``: the steps a range was taken from.
RANGE_STEPS = {
    "recorded": "the recorded steps the fit kept",
    "simulated": "the steps the fitted terms priced, simulating the request table",
}


@dataclass(frozen=True)
class FittedRange:
    """What each of ``RANGE_FEATURES`` reached in the fitted steps: ``max`` and ``quantile``
    (``RANGE_QUANTILE``), and ``min``, the smallest nonzero value (a step without the feature,
    a decode-only step's prefill tokens, is another kind of step, not a small one), feature ->
    value; a feature missing from ``min`` (a file written before it was recorded) is not
    checked below. ``steps``: a key of ``RANGE_STEPS``, what the range was taken from."""

    max: Mapping[str, float]
    quantile: Mapping[str, float] = field(default_factory=dict)
    min: Mapping[str, float] = field(default_factory=dict)
    steps: str = "recorded"

    @classmethod
    def of_features(
        cls, features: Mapping[str, np.ndarray], steps: str = "recorded"
    ) -> FittedRange:
        """The range of ``step_range_features``' arrays (one value a step, at least one step)."""
        return cls(
            max={k: float(v.max()) for k, v in features.items()},
            quantile={k: float(np.quantile(v, RANGE_QUANTILE)) for k, v in features.items()},
            min={k: float(v[v > 0].min()) if (v > 0).any() else 0.0 for k, v in features.items()},
            steps=steps,
        )

    @classmethod
    def of_profile(cls, steps: pd.DataFrame) -> FittedRange:
        """The range of a profile's steps (a pool's: its concatenated steps)."""
        return cls.of_features(step_range_features(steps))

    def to_json(self) -> dict[str, Any]:
        """The calibration's ``fit.feature_range`` (``from_json`` reads it back)."""
        return {
            "steps": self.steps,
            "quantile": RANGE_QUANTILE,
            "features": {
                k: {
                    "max": self.max[k],
                    "quantile": self.quantile.get(k, self.max[k]),
                    **({"min": self.min[k]} if k in self.min else {}),
                }
                for k in RANGE_FEATURES
            },
        }

    def describe(self) -> str:
        """One line: each feature's smallest nonzero value to its largest (``calibrate steps``
        prints it)."""
        words = [
            f"{_WORDS[k]} {_short(self.min[k]) + '-' if k in self.min else 'up to '}"
            f"{_short(self.max[k])}"
            for k in RANGE_FEATURES
        ]
        return f"range of {RANGE_STEPS[self.steps]} (smallest nonzero-largest): " + ", ".join(words)

    @classmethod
    def from_json(cls, data: Any, where: str) -> FittedRange:
        """``to_json``'s object; ValueError naming ``where`` and the key path
        (``cal.json: fit.feature_range.features.kv_tokens.max: ...``) when it is not.

        ``steps``, ``quantile`` and each feature's ``min`` may be missing (files written before
        they were recorded); any other key missing, or a key this version does not know (a newer
        poollab's file), is refused, and so is a value that is no finite count in
        ``[0, MAX_FEATURE_VALUE]`` (JSON's ``NaN``, ``Infinity``, ``1e30``, ``10**400``, a
        string)."""
        path = "fit.feature_range"
        if not isinstance(data, dict):
            raise ValueError(f"{where}: {path}: must be an object, got {shown(data)}")
        _known_keys(data, ("steps", "quantile", "features"), where, path)
        steps = data.get("steps", "recorded")
        if steps not in RANGE_STEPS:
            raise ValueError(
                f"{where}: {path}.steps: must be one of {list(RANGE_STEPS)}, got {shown(steps)}"
            )
        quantile = data.get("quantile", RANGE_QUANTILE)
        if not is_finite_number(quantile) or not 0 < quantile <= 1:
            raise ValueError(
                f"{where}: {path}.quantile: must be a number in (0, 1], got {shown(quantile)}"
            )
        features = data.get("features")
        if not isinstance(features, dict):
            raise ValueError(
                f"{where}: {path}.features: must be an object of {list(RANGE_FEATURES)}, "
                f"got {shown(features)}"
            )
        _known_keys(features, RANGE_FEATURES, where, f"{path}.features")
        missing = [k for k in RANGE_FEATURES if k not in features]
        if missing:
            raise ValueError(f"{where}: {path}.features: missing {missing}")
        values: dict[str, dict[str, float]] = {"max": {}, "quantile": {}, "min": {}}
        for name, entry in features.items():
            at = f"{path}.features.{name}"
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: {at}: must be an object, got {shown(entry)}")
            _known_keys(entry, tuple(values), where, at)
            for key in values:
                v = entry.get(key)
                if key == "min" and v is None:
                    continue  # written before the minima were recorded: not checked below
                if v is None:
                    raise ValueError(f"{where}: {at}.{key}: missing")
                if not is_finite_number(v) or not 0 <= v <= MAX_FEATURE_VALUE:
                    raise ValueError(
                        f"{where}: {at}.{key}: not a finite count in [0, 2**53], got {shown(v)}"
                    )
                values[key][name] = float(v)
            # a range is ordered: its smallest nonzero value and its quantile lie at or under its
            # largest (the quantile, over steps with zeros, may lie under the smallest nonzero
            # value); one that does not was edited or corrupted, and would count steps wrongly
            top = values["max"][name]
            if not (values["min"].get(name, 0.0) <= top and values["quantile"][name] <= top):
                raise ValueError(
                    f"{where}: {at}: min and quantile must be <= max, got "
                    f"min {values['min'].get(name)!r}, quantile {values['quantile'][name]!r}, "
                    f"max {top!r}"
                )
        return cls(max=values["max"], quantile=values["quantile"], min=values["min"], steps=steps)

    def limits(self) -> tuple[float, ...]:
        """The maxima in ``RANGE_FEATURES`` order (``RangeCount``'s check)."""
        return tuple(self.max[k] for k in RANGE_FEATURES)

    def lower_limits(self) -> tuple[float, ...]:
        """The smallest nonzero values in ``RANGE_FEATURES`` order, 0 where not recorded
        (nothing is under 0: not checked)."""
        return tuple(self.min.get(k, 0.0) for k in RANGE_FEATURES)


def _known_keys(data: Mapping[str, Any], known: Iterable[str], where: str, path: str) -> None:
    """ValueError naming the keys of ``data`` (at key path ``path``) not in ``known``."""
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ValueError(
            f"{where}: {path}: unknown key(s) {shown(unknown)} (a newer poollab's file?); "
            f"known: {', '.join(known)}"
        )


class RangeCount:
    """The steps a calibrated step-time model priced and those past its ``FittedRange``: over
    any maximum (``num_past``) or under any smallest nonzero value (``num_below``), each
    feature's count, and how far: the largest value priced of each feature passed
    (``largest``), the smallest of each under (``smallest``), and the largest KV tokens of any
    priced step (``max_kv_tokens``, for ``extrapolation_ratio``). ``add`` is called once a
    priced step: a few comparisons while the step lies inside."""

    __slots__ = (
        "fitted",
        "_limits",
        "_lows",
        "num_steps",
        "num_past",
        "past_by_feature",
        "largest",
        "num_below",
        "below_by_feature",
        "smallest",
        "max_kv_tokens",
    )

    def __init__(self, fitted: FittedRange):
        self.fitted = fitted
        self._limits = fitted.limits()
        self._lows = fitted.lower_limits()
        self.num_steps = 0
        self.num_past = 0
        self.past_by_feature = [0] * len(RANGE_FEATURES)
        self.largest = [0.0] * len(RANGE_FEATURES)
        self.num_below = 0
        self.below_by_feature = [0] * len(RANGE_FEATURES)
        self.smallest = [math.inf] * len(RANGE_FEATURES)
        self.max_kv_tokens = 0

    def add(self, p: int, d: int, c: int, pc: int) -> None:
        """One step of ``StepTimeModel.step_time_s``'s counts: ``p`` prefill tokens after
        ``pc`` cached ones, ``d`` decode sequences over ``c`` context tokens. (Comparisons
        written out, no loop: it runs once a calibrated step.)"""
        self.num_steps += 1
        prefill_context = pc + p
        decode_context = c + d
        kv = prefill_context + decode_context
        if kv > self.max_kv_tokens:
            self.max_kv_tokens = kv
        mp, mpc, md, mdc, mkv = self._limits
        if p > mp or prefill_context > mpc or d > md or decode_context > mdc or kv > mkv:
            self.num_past += 1
            by, hi = self.past_by_feature, self.largest
            if p > mp:
                by[0] += 1
                if p > hi[0]:
                    hi[0] = p
            if prefill_context > mpc:
                by[1] += 1
                if prefill_context > hi[1]:
                    hi[1] = prefill_context
            if d > md:
                by[2] += 1
                if d > hi[2]:
                    hi[2] = d
            if decode_context > mdc:
                by[3] += 1
                if decode_context > hi[3]:
                    hi[3] = decode_context
            if kv > mkv:
                by[4] += 1
                if kv > hi[4]:
                    hi[4] = kv
        # under a smallest nonzero value (a feature the step lacks, 0, is another step kind)
        lp, lpc, ld, ldc, lkv = self._lows
        if (
            0 < p < lp
            or 0 < prefill_context < lpc
            or 0 < d < ld
            or 0 < decode_context < ldc
            or (kv < lkv)
        ):
            self.num_below += 1
            by, lo = self.below_by_feature, self.smallest
            if 0 < p < lp:
                by[0] += 1
                if p < lo[0]:
                    lo[0] = p
            if 0 < prefill_context < lpc:
                by[1] += 1
                if prefill_context < lo[1]:
                    lo[1] = prefill_context
            if 0 < d < ld:
                by[2] += 1
                if d < lo[2]:
                    lo[2] = d
            if 0 < decode_context < ldc:
                by[3] += 1
                if decode_context < lo[3]:
                    lo[3] = decode_context
            if kv < lkv:
                by[4] += 1
                if kv < lo[4]:
                    lo[4] = kv

    @property
    def frac(self) -> float:
        """Share of the priced steps past a maximum (0.0 when none was priced)."""
        return self.num_past / self.num_steps if self.num_steps else 0.0

    @property
    def below_frac(self) -> float:
        """Share of the priced steps under a smallest nonzero value (0.0 when none was priced)."""
        return self.num_below / self.num_steps if self.num_steps else 0.0

    @property
    def extrapolation_ratio(self) -> float | None:
        """The largest KV tokens a priced step read over the largest the fit saw (above 1: the
        KV terms are extrapolated that far); None when no step was priced or the fit saw none."""
        most = self.fitted.max["kv_tokens"]
        return self.max_kv_tokens / most if self.num_steps and most > 0 else None

    def warning(self) -> str:
        """One line for the terminal ("" when every step lay inside the range): the share past
        the feature most steps lay past, how far past (and the others' shares), the same for the
        steps under the range where they are ``BELOW_WARN_FRAC`` of the steps or more, and what
        would cover them."""
        parts = []
        if self.num_past:
            parts.append(self._clause(self.past_by_feature, above=True))
        if self.num_below >= BELOW_WARN_FRAC * self.num_steps and self.num_below:
            parts.append(self._clause(self.below_by_feature, above=False))
        if not parts:
            return ""
        return "; ".join(parts) + "; calibrate on a profile that covers such steps"

    def _clause(self, by: list[int], *, above: bool) -> str:
        """``warning``'s words for the steps over (``above``) or under the range."""
        # the most passed; of a tie, the KV tokens (what the KV terms multiply) first
        i = max(range(len(by)), key=lambda j: (by[j], RANGE_FEATURES[j] == "kv_tokens"))
        name = RANGE_FEATURES[i]
        kv = name.endswith("tokens") and name != "num_prefill_tokens"
        share = f"{_percent(by[i] / self.num_steps)} of the {self.num_steps:,} steps priced"
        others = [
            f"{_WORDS[n]} {_percent(c / self.num_steps)}"
            for n, c in zip(RANGE_FEATURES, by)
            if c and n != name
        ]
        terms = f"its {'KV ' if kv else ''}terms are extrapolated"
        if above:
            most = self.fitted.max[name]
            far = f", up to {_times(self.largest[i] / most)} its largest" if most > 0 else ""
            return (
                f"{share} {'read more' if kv else 'had more'} "
                f"{_WORDS[name]} than the calibration saw{far} (max {_short(most)}; "
                f"{100 * RANGE_QUANTILE:.0f} % of its steps under "
                f"{_short(self.fitted.quantile.get(name, most))}): {terms}"
                + (f" (past the range too: {', '.join(others)})" if others else "")
            )
        return (
            f"{share} {'read fewer' if kv else 'had fewer'} "
            f"{_WORDS[name]} than the calibration's smallest ({_short(self.fitted.min[name])}; "
            f"down to {_short(self.smallest[i])}): {terms} down"
            + (f" (under the range too: {', '.join(others)})" if others else "")
        )


class StepFeatureLog:
    """``RangeCount``'s ``add``, keeping every step's counts instead: put in a step-time
    model's ``range_count`` to take the range of the steps a simulation priced
    (``fitted_range``; ``calibrate requests``, whose fit never sees a step)."""

    def __init__(self) -> None:
        self._rows: list[tuple[int, int, int, int]] = []

    def add(self, p: int, d: int, c: int, pc: int) -> None:
        """One priced step (``RangeCount.add``'s arguments)."""
        self._rows.append((p, d, c, pc))

    @property
    def num_steps(self) -> int:
        """Steps logged."""
        return len(self._rows)

    def fitted_range(self) -> FittedRange:
        """The range of the logged steps (``FittedRange.steps`` "simulated"); ValueError when
        none was logged."""
        if not self._rows:
            raise ValueError("no step was priced: no range to record")
        p, d, c, pc = np.asarray(self._rows, dtype=np.float64).T
        steps = pd.DataFrame(
            {
                "num_prefill_tokens": p,
                "prefill_context_tokens": pc + p,
                "num_decode_seqs": d,
                "decode_context_tokens": c + d,
            }
        )
        return FittedRange.of_features(step_range_features(steps), steps="simulated")


def range_warning_lines(runs: Iterable[tuple[str, Any]], max_lines: int | None = None) -> list[str]:
    """The terminal's lines for the ``range_warning`` of several runs (``(name, warning)`` pairs;
    "", None or NaN: none): one line per distinct warning, naming the runs it is of, in the order
    first seen (``simulate``, ``colocate``, ``sweep``, ``gpu serve --sim``). With ``max_lines``,
    at most that many, then one line counting the rest (a sweep's cells differ in their shares,
    so nearly every warning is distinct)."""
    groups: dict[str, list[str]] = {}
    for name, text in runs:
        if isinstance(text, str) and text:
            groups.setdefault(text, []).append(str(name))
    lines = [f"warning: {text} (under {', '.join(names)})" for text, names in groups.items()]
    if max_lines is not None and len(lines) > max_lines:
        rest = len(lines) - max_lines
        num_runs = sum(len(names) for names in list(groups.values())[max_lines:])
        lines = lines[:max_lines] + [
            f"warning: and {rest} more such warnings, of {num_runs} more runs "
            "(the range_warning column of summary.csv)"
        ]
    return lines


def _times(ratio: float) -> str:
    """``5.9x``, ``12x``: how far past a maximum."""
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def _percent(share: float) -> str:
    """``37 %``, ``0.4 %``: a share of steps (never 0 % for a share above 0)."""
    return f"{100 * share:.0f} %" if share >= 0.01 else f"{100 * share:.1g} %"


def _short(count: float) -> str:
    """``45k``, ``1.2M``, ``512``: a count in a warning."""
    if count >= 1e6:
        return f"{count / 1e6:.1f}M"
    if count >= 1e4:
        return f"{count / 1e3:.0f}k"
    if count >= 1e3:
        return f"{count / 1e3:.1f}k"
    return f"{count:.0f}"
