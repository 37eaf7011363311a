"""A real engine's run against ``simulate``: the same requests, the same KV bytes and engine limits,
compared column by column (``poollab gpu serve --sim``).

``realgpu.serve`` runs the engine and hands its runs here (``compare_with_engine``); this side
builds the matching ``ServerConfig`` (``engine_config``), simulates each run's policy and reports
measured against predicted (``measured_against_predicted``). ``realgpu`` imports only the replay
room, so the serving simulator is reached from this side (the command passes
``compare_with_engine`` to ``realgpu.serve.serve_trace``).

What an engine run must offer (``realgpu.serve.ServeRun`` does): ``spec`` (the name its
comparison is filed under), ``policy_spec`` (the poollab policy that stands for its allocator in
the simulator) and ``summary`` (its summary row, with ``kv_bytes`` and the serving columns). Its
settings (``realgpu.serve.ServeSettings``): ``model``, ``block_tokens``, ``max_num_seqs``,
``max_batch_tokens`` and ``max_len_tokens`` (resolved: an int).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import pandas as pd

from sim.replay.hardware import DEFAULT_GPU
from sim.replay.serving_metrics import LATENCY_COLUMNS
from sim.serving.config import ServerConfig
from sim.serving.fit_range import RANGE_TABLE_COLUMNS, range_warning_lines
from sim.serving.simulate import simulate

__all__ = ["COMPARED_COLUMNS", "engine_config", "measured_against_predicted", "compare_with_engine"]

#: Serving columns a comparison holds, measured against predicted.
COMPARED_COLUMNS = (*LATENCY_COLUMNS, "output_tok_s", "n_finished")


def engine_config(*, kv_capacity_bytes: int, settings: Any) -> ServerConfig:
    """The ``simulate`` settings that match a real run: its KV bytes, block size, step budget,
    sequence limit and longest sequence; no prefix sharing (the engine's prompts are random)."""
    if settings.max_len_tokens is None:
        raise ValueError(
            "an engine run's settings need the resolved longest sequence (max_len_tokens)"
        )
    return ServerConfig(
        kv_capacity_bytes=int(kv_capacity_bytes),
        tokens_per_page=settings.block_tokens,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_batch_tokens,
        max_model_len=int(settings.max_len_tokens),
        prefix_caching=False,
    )


def measured_against_predicted(
    measured: dict[str, Any], predicted: dict[str, Any], columns: Sequence[str] = COMPARED_COLUMNS
) -> pd.DataFrame:
    """One row per column: measured, predicted and the prediction's error in percent of the
    measured."""
    rows = []
    for c in columns:
        m, p = float(measured.get(c, math.nan)), float(predicted.get(c, math.nan))
        err = (p - m) / m * 100 if m and math.isfinite(m) and math.isfinite(p) else math.nan
        rows.append({"column": c, "measured": m, "predicted": p, "error_%": err})
    return pd.DataFrame(rows)


def compare_with_engine(
    runs: Iterable[Any],
    plan: pd.DataFrame,
    settings: Any,
    *,
    gpu: Any = DEFAULT_GPU,
    calibration: Any = None,
    trace_name: str = "requests",
    warn: Callable[[str], None] | None = None,
) -> dict[str, pd.DataFrame]:
    """``simulate`` the planned requests (``plan``: ``request``, ``arrival_s``, ``prompt_tokens``,
    ``output_tokens``) once per engine run, with the run's KV bytes and the engine's limits
    (``engine_config``) and the run's policy, on ``settings.model``'s shape and ``gpu``; each
    run's ``measured_against_predicted`` table, by ``run.spec``, with a row (predicted only: an
    engine has no range) for each of ``RANGE_TABLE_COLUMNS`` that a fitted ``calibration``'s
    range check filled, so that a prediction priced past its fit's range says so beside its
    errors. ``warn`` is called with each
    distinct range warning of the runs (a fitted ``calibration``'s steps past what its fit saw:
    ``sim.serving.fit_range.range_warning_lines``), after all of them ran."""
    requests = plan[["request", "arrival_s", "prompt_tokens", "output_tokens"]].rename(
        columns={"request": "request_id"}
    )
    out, warnings = {}, []
    for run in runs:
        predicted = simulate(
            requests,
            run.policy_spec,
            model=settings.model,
            gpu=gpu,
            calibration=calibration,
            config=engine_config(kv_capacity_bytes=int(run.summary["kv_bytes"]), settings=settings),
            trace_name=trace_name,
        )
        checked = [c for c in RANGE_TABLE_COLUMNS if predicted.summary.get(c) is not None]
        out[run.spec] = measured_against_predicted(
            run.summary, predicted.summary, (*COMPARED_COLUMNS, *checked)
        )
        warnings.append((run.spec, predicted.summary.get("range_warning")))
    if warn is not None:
        for line in range_warning_lines(warnings):
            warn(line)
    return out
