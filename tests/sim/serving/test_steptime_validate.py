"""benchmarks/steptime/validate.py on a synthetic grid: the fit recovers known factors, the held-out
error is reported, a bad CSV is one line and exit status 2."""

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "steptime" / "validate.py"
TRUE = {
    "mfu_prefill": 0.5,
    "mfu_decode": 0.4,
    "hbm_efficiency": 0.7,
    "layer_overhead_s": 4e-5,
    "step_overhead_s": 0.0,
}


@pytest.fixture(scope="module")
def validate():
    spec = importlib.util.spec_from_file_location("steptime_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_grid(validate, noise=0.02, seed=1):
    rows = [
        ("decode", b, c, 0) for b in (1, 16, 64, 256) for c in (128, 2048, 8192) if b * c <= 1 << 19
    ]
    rows += [("prefill", 1, c, n) for n in (256, 2048, 8192) for c in (0, 8192)]
    grid = pd.DataFrame(rows, columns=["kind", "batch", "context_tokens", "prefill_tokens"])
    rng = np.random.default_rng(seed)
    grid["measured_s"] = validate.predict(grid, TRUE) * np.exp(rng.normal(0, noise, len(grid)))
    return grid


def test_fit_recovers_the_factors_that_made_the_grid(validate):
    grid = synthetic_grid(validate, noise=0.0)
    fitted = validate.fit(
        grid, {k: 0.8 if k != "layer_overhead_s" else 1e-5 for k in validate.FITTED}
    )
    for name in validate.FITTED:
        assert fitted[name] == pytest.approx(TRUE[name], rel=0.03), name


def test_report_on_held_out_points(validate, tmp_path, capsys):
    path = tmp_path / "grid.csv"
    synthetic_grid(validate).to_csv(path, index=False)
    assert validate.main([str(path), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "| held out, fitted model |" in out and "What the model leaves out" in out
    held = [line for line in out.splitlines() if line.startswith(("| decode ", "| prefill "))]
    grid = validate.read_grid(path)
    assert len(held) == int((~validate.split(grid, "random", 3, 2048)).sum()) > 0
    errors = [abs(float(line.split("|")[4].strip().rstrip("%"))) for line in held]
    assert max(errors) < 10  # 2 % noise: the fitted model is close on every held-out point


def test_context_split_holds_out_the_long_contexts(validate):
    grid = synthetic_grid(validate)
    fit = validate.split(grid, "context", 0, 2048)
    assert (grid.loc[~fit, "context_tokens"] > 2048).all() and (
        grid.loc[fit, "context_tokens"] <= 2048
    ).all()


def test_a_model_that_cannot_follow_the_grid_misses_the_goal(validate, tmp_path, capsys):
    grid = synthetic_grid(validate, noise=0.0)
    grid.loc[grid["kind"] == "decode", "measured_s"] *= np.where(grid["batch"] > 16, 3.0, 1.0)[
        grid["kind"] == "decode"
    ]
    path = tmp_path / "grid.csv"
    grid.to_csv(path, index=False)
    assert validate.main([str(path)]) == 1
    assert "NOT met" in capsys.readouterr().out


def test_a_bad_csv_is_one_line_and_status_2(validate, tmp_path, capsys):
    path = tmp_path / "grid.csv"
    path.write_text(
        "kind,batch,context_tokens,prefill_tokens,measured_s\ndecode,1,128,0,0.005\nencode,1,1,0,1\n"
    )
    assert validate.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"validate.py: error: {path}: line 3: kind must be decode or prefill"
