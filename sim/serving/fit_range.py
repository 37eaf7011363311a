"""The range of step features a step-time fit saw, and the simulated steps that lie past it.

A fitted step law (``sim.serving.step_fit``) is linear in the step's counts, so it extrapolates
to any step; how far it carries is another matter. Why this check (issue 31, session 18): fits
on the 10 s synthetic recordings (at most 45k KV tokens a step) judged on the 60 s runs (median
98-128k, up to 265k) miss TPOT p50 by +19-25 %, because the exposed-KV tail's slope, fitted past
~30k, is extrapolated six-fold (``benchmarks/RESULTS.md``, "Session 18 (t1)"). The calibration
records what each feature covered (``FittedRange``: the largest value and ``RANGE_QUANTILE``);
the step-time model counts the steps it prices past the largest (``RangeCount``) and the run
says so (``RangeCount.warning``). A calibration without a range (written before it was recorded)
is not checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import pandas as pd

__all__ = ["RANGE_FEATURES", "RANGE_QUANTILE", "FittedRange", "RangeCount", "step_range_features"]

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
#: How each feature reads in a warning.
_WORDS = {
    "num_prefill_tokens": "prefill tokens",
    "prefill_context_tokens": "prefill context tokens",
    "num_decode_seqs": "decode sequences",
    "decode_context_tokens": "decode context tokens",
    "kv_tokens": "KV tokens",
}
#: The high quantile recorded beside each maximum (how far the bulk of the steps reached).
RANGE_QUANTILE = 0.99


def step_range_features(steps: pd.DataFrame) -> dict[str, np.ndarray]:
    """Each of ``RANGE_FEATURES`` for every step of a profile (``traces.engine_profile``)."""
    out = {name: steps[name].to_numpy(np.float64) for name in RANGE_FEATURES if name != "kv_tokens"}
    out["kv_tokens"] = out["prefill_context_tokens"] + out["decode_context_tokens"]
    return out


@dataclass(frozen=True)
class FittedRange:
    """What each of ``RANGE_FEATURES`` reached in the fitted steps: ``max`` and ``quantile``
    (``RANGE_QUANTILE``), feature -> value."""

    max: Mapping[str, float]
    quantile: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of_profile(cls, steps: pd.DataFrame) -> FittedRange:
        """The range of a profile's steps (a pool's: its concatenated steps)."""
        features = step_range_features(steps)
        return cls(
            max={k: float(v.max()) for k, v in features.items()},
            quantile={k: float(np.quantile(v, RANGE_QUANTILE)) for k, v in features.items()},
        )

    def to_json(self) -> dict[str, Any]:
        """The calibration's ``fit.feature_range`` (``from_json`` reads it back)."""
        return {
            "quantile": RANGE_QUANTILE,
            "features": {
                k: {"max": self.max[k], "quantile": self.quantile.get(k, self.max[k])}
                for k in RANGE_FEATURES
            },
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> FittedRange:
        """``to_json``'s object; ValueError naming ``where`` and the feature when it is not."""
        features = data.get("features") if isinstance(data, dict) else None
        if not isinstance(features, dict) or set(features) != set(RANGE_FEATURES):
            raise ValueError(
                f"{where}: 'fit.feature_range' must be an object whose 'features' are "
                f"{list(RANGE_FEATURES)}, each with 'max' and 'quantile'"
            )
        values: dict[str, dict[str, float]] = {"max": {}, "quantile": {}}
        for name, entry in features.items():
            for key in values:
                v = entry.get(key) if isinstance(entry, dict) else None
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                    raise ValueError(
                        f"{where}: fit.feature_range {name}.{key} must be a number >= 0, got {v!r}"
                    )
                values[key][name] = float(v)
        return cls(max=values["max"], quantile=values["quantile"])

    def limits(self) -> tuple[float, ...]:
        """The maxima in ``RANGE_FEATURES`` order (``RangeCount``'s check)."""
        return tuple(self.max[k] for k in RANGE_FEATURES)


class RangeCount:
    """The steps a calibrated step-time model priced and those past its ``FittedRange``'s
    maxima (any feature), with each feature's count. ``add`` is called once a priced step: a
    few comparisons."""

    __slots__ = ("fitted", "_limits", "num_steps", "num_past", "past_by_feature")

    def __init__(self, fitted: FittedRange):
        self.fitted = fitted
        self._limits = fitted.limits()
        self.num_steps = 0
        self.num_past = 0
        self.past_by_feature = [0] * len(RANGE_FEATURES)

    def add(self, p: int, d: int, c: int, pc: int) -> None:
        """One step of ``StepTimeModel.step_time_s``'s counts: ``p`` prefill tokens after
        ``pc`` cached ones, ``d`` decode sequences over ``c`` context tokens. (Comparisons
        written out, no loop: it runs once a calibrated step.)"""
        self.num_steps += 1
        prefill_context = pc + p
        decode_context = c + d
        kv = prefill_context + decode_context
        mp, mpc, md, mdc, mkv = self._limits
        if p > mp or prefill_context > mpc or d > md or decode_context > mdc or kv > mkv:
            self.num_past += 1
            by = self.past_by_feature
            if p > mp:
                by[0] += 1
            if prefill_context > mpc:
                by[1] += 1
            if d > md:
                by[2] += 1
            if decode_context > mdc:
                by[3] += 1
            if kv > mkv:
                by[4] += 1

    @property
    def frac(self) -> float:
        """Share of the priced steps past the range (0.0 when none was priced)."""
        return self.num_past / self.num_steps if self.num_steps else 0.0

    def warning(self) -> str:
        """One line for the terminal ("" when no step lay past the range): the share past the
        feature most steps lay past (and the others'), and what would cover it."""
        if not self.num_past:
            return ""
        by = self.past_by_feature
        # the most passed; of a tie, the KV tokens (what the KV terms multiply) first
        i = max(range(len(by)), key=lambda j: (by[j], RANGE_FEATURES[j] == "kv_tokens"))
        name = RANGE_FEATURES[i]
        kv = name.endswith("tokens") and name != "num_prefill_tokens"
        others = [
            f"{_WORDS[n]} {_percent(c / self.num_steps)}"
            for n, c in zip(RANGE_FEATURES, self.past_by_feature)
            if c and n != name
        ]
        return (
            f"{_percent(self.past_by_feature[i] / self.num_steps)} of steps "
            f"{'read more' if kv else 'had more'} {_WORDS[name]} than the calibration saw "
            f"(max {_short(self.fitted.max[name])}; {100 * RANGE_QUANTILE:.0f} % of its steps "
            f"under {_short(self.fitted.quantile.get(name, self.fitted.max[name]))}): its "
            f"{'KV ' if kv else ''}terms are extrapolated"
            + (f" (past the range too: {', '.join(others)})" if others else "")
            + "; calibrate on a profile that covers such steps"
        )


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
