"""``poollab calibrate``: a calibration file from a step profile or a request table; simulate reads
it."""

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from sim.replay.hardware import load_gpu
from sim.replay.models import load_model

ENGINE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "engine"
needs_engine_data = pytest.mark.skipif(
    not ENGINE.is_dir(), reason="../shared/data/engine is not beside the repository"
)


@pytest.fixture
def profile(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim" / "serving"))
    from test_step_fit import synthetic_profile

    path = tmp_path / "steps.csv"
    synthetic_profile(n=120, model_gpu=(load_model("Llama-3-8B"), load_gpu("H200"))).to_csv(
        path, index=False
    )
    return path


def test_steps_writes_a_calibration_and_prints_errors_by_step_kind(profile, tmp_path, cli_ok):
    out_file = tmp_path / "cal.json"
    out, _ = cli_ok(
        [
            "calibrate",
            "steps",
            str(profile),
            "--model",
            "Llama-3-8B",
            "--gpu",
            "H200",
            "--out",
            str(out_file),
        ]
    )
    data = json.loads(out_file.read_text())
    assert (
        data["format"] == "poollab-step-time/2"
        and data["model"] == "Llama-3-8B"
        and data["tp"] == 1
    )
    assert data["terms"]["fixed_s"] == pytest.approx(0.07, rel=0.02)
    for word in ("in-sample", "cross-validated", "prefill", "decode", "mixed", "fixed_s 0.07"):
        assert word in out
    # the range the fit saw, one line, the file's figures
    features = data["fit"]["feature_range"]["features"]
    assert data["fit"]["feature_range"]["steps"] == "recorded"
    (line,) = [x for x in out.splitlines() if x.startswith("range of ")]
    assert line.startswith(
        "range of the recorded steps the fit kept (smallest nonzero-largest): prefill tokens "
    )
    assert f"decode sequences {features['num_decode_seqs']['min']:.0f}-" in line
    # the Huber loss says how many steps it weighed less (none here: a noiseless profile)
    assert "0 more than 10% off weighed less (Huber loss)" in out.splitlines()[0]


def test_an_underdetermined_profile_is_refused_in_one_line(profile, tmp_path, cli):
    steps = pd.read_csv(profile)
    steps = steps[steps["num_prefill_seqs"] == 0]
    steps.to_csv(profile, index=False)
    code, out, err = cli(["calibrate", "steps", str(profile), "--out", str(tmp_path / "cal.json")])
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "cannot determine per_" in err and "--drop" in err and str(profile) in err
    assert not (tmp_path / "cal.json").exists()


def test_a_bad_cell_names_file_line_and_column(profile, tmp_path, cli):
    lines = profile.read_text().splitlines()
    lines[3] = "-1" + lines[3][lines[3].index(",") :]
    profile.write_text("\n".join(lines) + "\n")
    code, _, err = cli(["calibrate", "steps", str(profile), "--out", str(tmp_path / "cal.json")])
    assert code == 2 and f"{profile}:4" in err and "duration_s" in err


def test_an_unknown_drop_term_and_engine_are_named(profile, tmp_path, cli):
    code, _, err = cli(
        ["calibrate", "steps", str(profile), "--drop", "per_banana_s", "--out", str(tmp_path / "c")]
    )
    assert code == 2 and "per_banana_s" in err
    code, _, err = cli(
        ["calibrate", "steps", str(profile), "--engine", "nope", "--out", str(tmp_path / "c")]
    )
    assert code == 2 and "--engine" in err and "vllm, transformers" in err


def test_add_fits_the_exposed_kv_term_and_the_file_reads_back(profile, tmp_path, cli, cli_ok):
    from test_step_fit import EXPOSED, synthetic_profile  # beside the profile fixture's import

    from sim.serving.steptime import load_step_calibration

    # an engine whose steps past 20k KV tokens cost more: the tail's slope is not 0 (without
    # one, a slope of 0 is what the fit should find, and the terms line leaves it out)
    synthetic_profile(
        n=120, terms=EXPOSED, model_gpu=(load_model("Llama-3-8B"), load_gpu("H200"))
    ).to_csv(profile, index=False)
    out_file = tmp_path / "cal.json"
    out, _ = cli_ok(
        [
            "calibrate",
            "steps",
            str(profile),
            "--add",
            "per_exposed_kv_token_s",
            "--out",
            str(out_file),
        ]
    )
    terms = json.loads(out_file.read_text())["terms"]
    assert "per_exposed_kv_token_s" in terms and terms["num_hidden_kv_tokens"] > 0
    assert "num_hidden_kv_tokens" in out
    assert (
        load_step_calibration(out_file).terms.num_hidden_kv_tokens == terms["num_hidden_kv_tokens"]
    )
    code, _, err = cli(
        [
            "calibrate",
            "steps",
            str(profile),
            "--add",
            "per_kv_token_s",
            "--out",
            str(tmp_path / "c"),
        ]
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--add per_kv_token_s" in err


def test_simulate_prices_steps_with_the_calibration_and_names_it(profile, tmp_path, trace, cli_ok):
    cal = tmp_path / "cal.json"
    cli_ok(["calibrate", "steps", str(profile), "--out", str(cal)])
    out, _ = cli_ok(
        [
            "simulate",
            str(trace),
            "-p",
            "paged",
            "--engine",
            "transformers",
            "--calibration",
            str(cal),
            "--no-progress",
            "--out",
            str(tmp_path / "fitted"),
        ]
    )
    assert f"step time: fitted from {cal}" in out and "engine transformers" in out
    assert "--max-num-seqs 1024" in out and "--tokens-per-page 256" in out
    cli_ok(
        ["simulate", str(trace), "-p", "paged", "--no-progress", "--out", str(tmp_path / "default")]
    )
    fitted = pd.read_csv(tmp_path / "fitted" / "summary.csv")
    default = pd.read_csv(tmp_path / "default" / "summary.csv")
    # ~70 ms a step against the CUDA-graph roofline's ~5 ms
    assert fitted["tpot_p50_s"].iloc[0] > 5 * default["tpot_p50_s"].iloc[0]


def test_simulate_warns_when_its_steps_pass_the_range_the_fit_saw(profile, tmp_path, trace, cli_ok):
    cal = tmp_path / "cal.json"
    cli_ok(["calibrate", "steps", str(profile), "--out", str(cal)])
    data = json.loads(cal.read_text())
    assert set(data["fit"]["feature_range"]["features"]) >= {"kv_tokens", "num_decode_seqs"}
    args = ["simulate", str(trace), "-p", "paged", "--engine", "transformers", "--no-progress"]
    # the profile's range: this trace's steps lie within it, no warning
    _, err = cli_ok([*args, "--calibration", str(cal), "--out", str(tmp_path / "in")])
    assert "than the calibration saw" not in err
    inside = pd.read_csv(tmp_path / "in" / "summary.csv").iloc[0]
    assert inside["priced_past_range_frac"] == 0 and inside["extrapolation_ratio"] < 1
    # ... but under it: the profile's batches hold 2 sequences or more, this trace's mostly 1
    under = inside["priced_below_range_frac"]
    assert under > 0.5
    (line,) = [x for x in err.splitlines() if "than the calibration's smallest" in x]
    # (the share of the feature named: the summary's counts steps under any feature)
    assert re.match(
        rf"warning: \d+ % of the {inside['n_priced_steps']:,} steps priced had fewer decode "
        r"sequences than the calibration's "
        r"smallest \(2; down to 1\): its terms are extrapolated down \(under the range too: ",
        line,
    )
    # a fit that saw at most 100 KV tokens a step: most steps read more, up to how far; a
    # file without minima (written before session 19): not checked below
    for entry in data["fit"]["feature_range"]["features"].values():
        del entry["min"]
    data["fit"]["feature_range"]["features"]["kv_tokens"] = {"max": 100, "quantile": 90}
    narrow = tmp_path / "narrow.json"
    narrow.write_text(json.dumps(data))
    _, err = cli_ok([*args, "--calibration", str(narrow), "--out", str(tmp_path / "past")])
    past = pd.read_csv(tmp_path / "past" / "summary.csv").iloc[0]
    share, ratio = past["priced_past_range_frac"], past["extrapolation_ratio"]
    assert share > 0.5 and ratio > 1 and pd.isna(past["priced_below_range_frac"])
    (line,) = [x for x in err.splitlines() if "than the calibration saw" in x]
    assert re.fullmatch(
        rf"warning: {100 * share:.0f} % of the {past['n_priced_steps']:,} steps priced read more "
        r"KV tokens than the "
        rf"calibration saw, up to {ratio:.1f}x its largest "
        r"\(max 100; 99 % of its steps under 90\): its KV terms are extrapolated; calibrate on a "
        r"profile that covers such steps \(under paged\)",
        line,
    )
    # a file written before the range was recorded: not checked, no warning
    del data["fit"]["feature_range"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    _, err = cli_ok([*args, "--calibration", str(old), "--out", str(tmp_path / "old")])
    assert "than the calibration saw" not in err
    assert pd.read_csv(tmp_path / "old" / "summary.csv")["priced_past_range_frac"].isna().all()


def test_simulate_without_calibration_says_it_prices_a_cuda_graph_engine(trace, tmp_path, cli_ok):
    out, _ = cli_ok(
        ["simulate", str(trace), "-p", "paged", "--no-progress", "--out", str(tmp_path / "o")]
    )
    assert "step time: bundled roofline (a CUDA-graph, vLLM-class engine" in out


def test_an_old_calibration_file_still_works_in_simulate(trace, tmp_path, cli_ok):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"step_overhead_s": 0.05}))
    out, _ = cli_ok(
        [
            "simulate",
            str(trace),
            "-p",
            "paged",
            "--calibration",
            str(old),
            "--no-progress",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert f"step time: roofline with factors from {old}" in out
    assert pd.read_csv(tmp_path / "o" / "summary.csv")["tpot_p50_s"].iloc[0] > 0.05


def test_a_calibration_for_another_model_is_refused_in_one_line(profile, tmp_path, trace, cli):
    cal = tmp_path / "cal.json"
    cli(["calibrate", "steps", str(profile), "--out", str(cal)])
    code, _, err = cli(
        [
            "simulate",
            str(trace),
            "-p",
            "paged",
            "--model",
            "Llama-3.2-1B",
            "--calibration",
            str(cal),
            "--no-progress",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 2 and "fitted for Llama-3-8B on H200" in err and "Traceback" not in err


def test_colocate_reads_a_fitted_calibration(profile, tmp_path, trace, cli_ok):
    cal = tmp_path / "cal.json"
    cli_ok(["calibrate", "steps", str(profile), "--out", str(cal)])
    out, _ = cli_ok(
        [
            "colocate",
            str(trace),
            "--tenants",
            "2",
            "--layout",
            "static",
            "--model",
            "Llama-3-8B",
            "--calibration",
            str(cal),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert f"step time: fitted from {cal}" in out


@pytest.fixture
def narrow_calibration(profile, tmp_path, cli_ok):
    """A step fit of ``profile`` whose range says it saw at most 100 KV tokens a step: every
    simulated step of the ``trace`` fixture reads more."""
    cal = tmp_path / "narrow.json"
    cli_ok(["calibrate", "steps", str(profile), "--out", str(cal)])
    data = json.loads(cal.read_text())
    data["fit"]["feature_range"]["features"]["kv_tokens"] = {"max": 100, "quantile": 90}
    cal.write_text(json.dumps(data))
    return cal


def test_colocate_warns_of_each_tenants_steps_past_the_fits_range(
    narrow_calibration, tmp_path, trace, cli_ok
):
    cal = narrow_calibration
    args = ["colocate", str(trace), "--tenants", "2", "--layout", "static", "--model"]
    _, err = cli_ok([*args, "Llama-3-8B", "--calibration", str(cal), "--out", str(tmp_path / "o")])
    lines = [x for x in err.splitlines() if re.search(r"than the calibration saw, up to \d", x)]
    assert all("its largest (max 100;" in x for x in lines)
    assert lines and all(x.startswith("warning: ") for x in lines)
    assert "t0 static" in err and "t1 static" in err


def test_requests_writes_the_same_calibration_with_its_expected_error(tmp_path, trace, cli_ok):
    # a request table as an engine that steps in ~80 ms would log it: simulate one, then fit to it
    from sim.serving.engine_runs import predict_served, served_trace
    from sim.serving.steptime import StepCalibration, StepTerms, default_calibration
    from traces import read_request_trace

    requests = read_request_trace(trace).requests
    cal = StepCalibration(
        default_calibration(),
        terms=StepTerms(fixed_s=0.08, per_token_s=2e-5),
        model="Llama-3-8B",
        gpu="H200",
        tp=1,
    )
    predicted = predict_served(served_trace(requests), cal)
    table = requests[["arrival_s", "prompt_tokens", "output_tokens"]].assign(
        first_token_s=predicted["first_token_s"].to_numpy(),
        finish_s=predicted["finish_s"].to_numpy(),
    )
    path = tmp_path / "requests.csv"
    table.to_csv(path, index=False)
    out_file = tmp_path / "cal.json"
    out, _ = cli_ok(
        ["calibrate", "requests", str(path), "--max-evaluations", "60", "--out", str(out_file)]
    )
    data = json.loads(out_file.read_text())
    assert data["format"] == "poollab-step-time/2" and data["fit"]["from"] == "requests"
    assert data["terms"]["fixed_s"] == pytest.approx(0.08, rel=0.25)
    assert "expected error" in out and "tpot_p50_s" in out
    # the range of the steps it infers, recorded and printed as a step fit's: simulate checks it
    from sim.serving.steptime import load_step_calibration

    fitted = load_step_calibration(out_file).fitted_range
    assert fitted.steps == "simulated" and fitted.max["kv_tokens"] > 0
    assert fitted.describe() in out.splitlines()


def test_sweep_reads_a_fitted_calibration(profile, tmp_path, trace, cli, cli_ok):
    import textwrap

    cal = tmp_path / "cal.json"
    cli_ok(["calibrate", "steps", str(profile), "--out", str(cal)])
    results = {}
    for name, line in (("fitted", f"calibration: {cal}"), ("default", "")):
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(
            textwrap.dedent(f"""
            mode: simulate
            traces: [{trace}]
            policies: [paged]
            models: [Llama-3-8B]
            """)
            + line
            + "\n"
        )
        code, _, err = cli(
            [
                "sweep",
                str(spec),
                "--out",
                str(tmp_path / name),
                "--scheduler",
                "serial",
                "--no-progress",
            ]
        )
        assert code == 0, err
        results[name] = pd.read_parquet(tmp_path / name / "results.parquet")["tpot_p50_s"].iloc[0]
    assert results["fitted"] > 5 * results["default"]


def test_sweep_warns_once_per_distinct_range_warning_of_its_cells(
    narrow_calibration, tmp_path, trace, cli
):
    """A sweep over loads past the fit's range says so, as ``simulate`` does: one stderr line
    per distinct warning, naming its cells by what varies (the load); cached cells too; the
    table carries the columns."""
    import textwrap

    cal = narrow_calibration
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        textwrap.dedent(f"""
        mode: simulate
        traces: [{trace}]
        policies: [paged]
        models: [Llama-3-8B]
        rate_scales: [1, 4]
        calibration: {cal}
        """)
    )
    args = ["sweep", str(spec), "--out", str(tmp_path / "o"), "--scheduler", "serial"]
    code, out, err = cli([*args, "--no-progress"])
    assert code == 0, err
    # the terminal's fronts show each point's range columns (shares of the steps priced)
    assert "priced_past_range_frac_%" in out and "extrapolation_ratio" in out
    results = pd.read_parquet(tmp_path / "o" / "results.parquet")
    for column in ("n_priced_steps", "priced_past_range_frac", "extrapolation_ratio"):
        assert column in results and results[column].notna().all(), column
    summary = pd.read_csv(tmp_path / "o" / "summary.csv")
    assert "range_warning" in summary and "priced_below_range_frac" in summary
    lines = [x for x in err.splitlines() if "than the calibration saw" in x]
    texts = list(dict.fromkeys(results["range_warning"]))
    assert len(lines) == len(texts) and all(x.startswith("warning: ") for x in lines)
    for text, line in zip(texts, lines):
        scales = results.loc[results["range_warning"] == text, "cell_rate_scale"]
        names = ", ".join(f"{trace.stem} paged rate_scale={r:g}" for r in scales)
        assert line == f"warning: {text} (under {names})"
    # resumed: every cell cached, the same lines
    code, _, again = cli([*args, "--no-progress"])
    assert code == 0 and [x for x in again.splitlines() if "than the calibration saw" in x] == lines
    # cell records written before session 21 name the shares without their base: read as now
    for record in (tmp_path / "o" / "cells").rglob("*.json"):
        text = record.read_text()
        record.write_text(
            text.replace("priced_past_range_frac", "extrapolated_step_frac").replace(
                "priced_below_range_frac", "below_range_step_frac"
            )
        )
    code, _, err = cli([*args, "--no-progress"])
    assert code == 0, err
    old = pd.read_parquet(tmp_path / "o" / "results.parquet")
    assert "extrapolated_step_frac" not in old and "below_range_step_frac" not in old
    pd.testing.assert_series_equal(old["priced_past_range_frac"], results["priced_past_range_frac"])


def test_range_warning_lines_are_capped_with_a_count_of_the_rest():
    from sim.serving.fit_range import range_warning_lines

    runs = [(f"c{i}", f"w{i % 3}") for i in range(7)] + [("none", ""), ("nan", float("nan"))]
    assert range_warning_lines(runs) == [
        "warning: w0 (under c0, c3, c6)",
        "warning: w1 (under c1, c4)",
        "warning: w2 (under c2, c5)",
    ]
    assert range_warning_lines(runs, max_lines=1) == [
        "warning: w0 (under c0, c3, c6)",
        "warning: and 2 more such warnings, of 4 more runs (the range_warning column of "
        "summary.csv)",
    ]


def test_simulate_names_an_unknown_engine_by_its_option(trace, tmp_path, cli):
    code, _, err = cli(
        ["simulate", str(trace), "--engine", "nope", "--no-progress", "--out", str(tmp_path / "o")]
    )
    assert (
        code == 2
        and err.strip()
        == "poollab: error: --engine: unknown engine 'nope'; engines: vllm, transformers"
    )


@pytest.fixture
def two_profiles(profile, tmp_path):
    """``profile`` and a second recording of the same engine on a host 10 % slower."""
    second = tmp_path / "other" / "steps_b.csv"
    second.parent.mkdir()
    steps = pd.read_csv(profile)
    steps.assign(duration_s=steps["duration_s"] * 1.1).to_csv(second, index=False)
    return profile, second


def test_steps_pools_several_profiles_into_one_calibration(two_profiles, tmp_path, cli_ok):
    out_file = tmp_path / "cal.json"
    out, _ = cli_ok(["calibrate", "steps", *map(str, two_profiles), "--out", str(out_file)])
    data = json.loads(out_file.read_text())
    assert data["source"] == " + ".join(map(str, two_profiles))
    assert [s["source"] for s in data["fit"]["sources"]] == list(map(str, two_profiles))
    assert data["terms"]["fixed_s"] == pytest.approx(0.07 * 1.05, rel=0.03)  # between the hosts
    first = out.splitlines()[0]
    assert first.startswith(f"{two_profiles[0]} + {two_profiles[1]}: 240 steps pooled from 2")
    assert "over the pool:" in out and "fit on the other profiles" in out
    # and by profile, each named by its file
    by_profile = out[out.index("... and by profile") :]
    for name in ("steps.csv", "steps_b.csv"):
        assert re.search(rf"^ *{name} +in-sample +all +120 ", by_profile, re.M), name


def test_a_bad_profile_among_several_is_named_with_its_line(two_profiles, tmp_path, cli):
    bad = two_profiles[1]
    lines = bad.read_text().splitlines()
    lines[5] = "0" + lines[5][lines[5].index(",") :]
    bad.write_text("\n".join(lines) + "\n")
    out_file = tmp_path / "cal.json"
    code, _, err = cli(["calibrate", "steps", *map(str, two_profiles), "--out", str(out_file)])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"{bad}:6" in err and "duration_s" in err and not out_file.exists()


def test_a_profile_given_twice_or_of_another_tp_is_refused(two_profiles, tmp_path, cli):
    first, second = two_profiles
    code, _, err = cli(["calibrate", "steps", str(first), str(first), "--out", str(tmp_path / "c")])
    assert code == 2 and f"{first}: given twice" in err
    pd.read_csv(second).assign(tp=2).to_csv(second, index=False)
    code, _, err = cli(
        ["calibrate", "steps", str(first), str(second), "--out", str(tmp_path / "c")]
    )
    assert code == 2 and "the tp column holds [1, 2]" in err and f"{second}: [2]" in err
    assert "--tp" in err and len(err.strip().splitlines()) == 1
