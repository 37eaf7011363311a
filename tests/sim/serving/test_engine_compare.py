"""``sim.serving.engine_compare``: a real engine's run against ``simulate`` with matching settings
(``gpu serve --sim``), on a run made up here: no GPU, no engine."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from realgpu.serve import PYTORCH, ServeRun, ServeSettings
from sim.replay.hardware import DEFAULT_GPU
from sim.replay.models import DEFAULT_MODEL
from sim.serving.engine_compare import (
    COMPARED_COLUMNS,
    compare_with_engine,
    engine_config,
    measured_against_predicted,
)
from sim.serving.fit_range import RANGE_TABLE_COLUMNS
from sim.serving.simulate import simulate

KV_BLOCK_BYTES = 256 * 131072  # a 256-token block of Llama-3-8B in bf16


def test_measured_against_predicted_error_is_relative_to_the_measurement():
    table = measured_against_predicted(
        {"ttft_p50_s": 2.0, "tpot_p50_s": 0.0},
        {"ttft_p50_s": 1.5, "tpot_p50_s": 1.0},
        columns=("ttft_p50_s", "tpot_p50_s", "e2e_p50_s"),
    )
    assert table["error_%"][0] == pytest.approx(-25.0)
    assert math.isnan(table["error_%"][1]) and math.isnan(table["error_%"][2])


def test_engine_config_matches_the_real_engines_limits():
    cfg = engine_config(
        kv_capacity_bytes=3060 * KV_BLOCK_BYTES, settings=ServeSettings(max_len_tokens=8192)
    )
    assert (
        cfg.kv_capacity_bytes,
        cfg.tokens_per_page,
        cfg.max_num_batched_tokens,
        cfg.max_num_seqs,
        cfg.max_model_len,
        cfg.prefix_caching,
    ) == (3060 * KV_BLOCK_BYTES, 256, 8192, 1024, 8192, False)


def test_engine_config_needs_the_resolved_longest_sequence():
    with pytest.raises(ValueError, match="max_len_tokens"):
        engine_config(kv_capacity_bytes=KV_BLOCK_BYTES, settings=ServeSettings())


def _plan() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "request": range(6),
            "arrival_s": [0.0, 0.1, 0.2, 0.4, 0.8, 1.0],
            "prompt_tokens": [100, 300, 50, 700, 200, 120],
            "output_tokens": [20, 5, 40, 10, 30, 8],
        }
    )


def _run(spec: str, **summary) -> ServeRun:
    return ServeRun(
        spec=spec,
        summary={"kv_bytes": 64 * KV_BLOCK_BYTES, **summary},
        steps=pd.DataFrame(),
        served=pd.DataFrame(),
    )


def test_each_run_is_simulated_with_its_kv_bytes_and_policy_and_compared():
    """The comparison's predicted column is exactly what ``simulate`` gives with the run's KV bytes,
    the engine's limits and the run's policy (PyTorch's own: ``torch-caching``)."""
    plan = _plan()
    settings = ServeSettings(
        block_tokens=16, max_batch_tokens=512, max_num_seqs=4, max_len_tokens=1024
    )
    runs = [
        _run(PYTORCH, ttft_p50_s=0.05, n_finished=6),
        _run("best-fit", ttft_p50_s=0.05, n_finished=6),
    ]
    tables = compare_with_engine(runs, plan, settings, trace_name="t")
    assert list(tables) == [PYTORCH, "best-fit"]
    for run, policy in zip(runs, ("torch-caching", "best-fit")):
        assert run.policy_spec == policy
        expected = simulate(
            plan.rename(columns={"request": "request_id"}),
            policy,
            model=settings.model,
            gpu=DEFAULT_GPU,
            config=engine_config(kv_capacity_bytes=run.summary["kv_bytes"], settings=settings),
        ).summary
        table = tables[run.spec].set_index("column")
        assert list(table.index) == list(COMPARED_COLUMNS)
        for column in COMPARED_COLUMNS:
            assert table.loc[column, "predicted"] == pytest.approx(expected[column], nan_ok=True)
        assert table.loc["n_finished", "predicted"] == 6  # the small plan fits: all finish
        assert table.loc["n_finished", "measured"] == 6
        assert math.isnan(table.loc["e2e_p50_s", "measured"])  # not in the made-up summary


def test_a_run_is_read_through_its_declared_attributes_only():
    """Any object with ``spec``, ``policy_spec`` and ``summary`` is an engine run here."""
    run = SimpleNamespace(
        spec="engine-x", policy_spec="first-fit", summary={"kv_bytes": 64 * KV_BLOCK_BYTES}
    )
    settings = SimpleNamespace(
        model=DEFAULT_MODEL,
        block_tokens=16,
        max_num_seqs=4,
        max_batch_tokens=512,
        max_len_tokens=1024,
    )
    tables = compare_with_engine([run], _plan(), settings)
    assert list(tables) == ["engine-x"]
    assert tables["engine-x"].set_index("column").loc["n_finished", "predicted"] == 6


def test_a_fitted_calibrations_range_warning_is_handed_to_warn_once_per_distinct_text():
    """``gpu serve --sim`` with a calibration whose fit saw fewer KV tokens than the runs read:
    the warning reaches ``warn`` (the command's stderr), one line naming both runs."""
    from sim.serving.fit_range import FittedRange
    from sim.serving.steptime import StepCalibration, StepTerms, default_calibration

    features = {
        "num_prefill_tokens": [512.0],
        "prefill_context_tokens": [512.0],
        "num_decode_seqs": [4.0],
        "decode_context_tokens": [100.0],
        "kv_tokens": [100.0],
    }
    narrow = FittedRange.of_features({k: np.array(v) for k, v in features.items()})
    cal = StepCalibration(
        default_calibration(),
        terms=StepTerms(fixed_s=0.05, per_token_s=2e-5),
        model="Llama-3-8B",
        gpu="H200",
        tp=1,
        fit={"feature_range": narrow.to_json()},
    )
    settings = ServeSettings(
        block_tokens=16, max_batch_tokens=512, max_num_seqs=4, max_len_tokens=1024
    )
    runs = [_run(PYTORCH, n_finished=6), _run("best-fit", n_finished=6)]
    lines = []
    tables = compare_with_engine(runs, _plan(), settings, calibration=cal, warn=lines.append)
    (line,) = lines
    assert line.startswith("warning: ") and "than the calibration saw" in line
    assert line.endswith(f"(under {PYTORCH}, best-fit)")
    # each comparison carries the range beside its errors: predicted only (an engine has none)
    for table in tables.values():
        rows = table.set_index("column").loc[list(RANGE_TABLE_COLUMNS)]
        assert rows["measured"].isna().all() and rows["error_%"].isna().all()
        assert 0 < rows.loc["priced_past_range_frac", "predicted"] <= 1
        assert rows.loc["extrapolation_ratio", "predicted"] > 1
        assert rows.loc["priced_below_range_frac", "predicted"] >= 0
    quiet = []
    plain = compare_with_engine(runs, _plan(), settings, warn=quiet.append)  # the roofline
    assert quiet == []  # not checked: no warning, no range row
    assert all(list(t["column"]) == list(COMPARED_COLUMNS) for t in plain.values())
