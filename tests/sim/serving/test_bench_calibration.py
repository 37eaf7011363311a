"""``benchmarks/bench_calibration.py``: the held-out table recomputed from recordings (figures:
RESULTS.md)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sim.serving.engine_runs import predict_served, served_trace
from sim.replay.hardware import load_gpu
from sim.replay.models import load_model
from sim.serving.steptime import StepCalibration, StepTerms, default_calibration

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_step_fit import synthetic_profile  # noqa: E402


def _load():
    spec = importlib.util.spec_from_file_location(
        "bench_calibration", BENCH / "bench_calibration.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recording(tmp_path, name, fixed_s, seed, **more_terms):
    """A run of an engine whose steps follow known terms: its profile and its request table."""
    terms = StepTerms(
        fixed_s=fixed_s,
        per_seq_s=2e-4,
        per_token_s=2e-5,
        per_kv_token_s=1e-6,
        per_pair_s=3e-9,
        per_query_kv_s=1.5e-9,
        **more_terms,
    )
    steps = synthetic_profile(
        n=90, seed=seed, terms=terms, model_gpu=(load_model("Llama-3-8B"), load_gpu("H200"))
    )
    steps.to_csv(tmp_path / f"{name}_steps.csv", index=False)
    served = pd.DataFrame(
        {
            "arrival_s": [0.5 * i for i in range(16)],
            "prompt_tokens": [200 + 150 * i for i in range(16)],
            "output_tokens": [5 + 2 * i for i in range(16)],
        }
    )
    cal = StepCalibration(default_calibration(), terms=terms, model="Llama-3-8B", gpu="H200", tp=1)
    predicted = predict_served(served_trace(served), cal)
    served.assign(
        first_token_s=served["arrival_s"] + predicted["ttft_s"],
        finish_s=served["arrival_s"] + predicted["e2e_s"],
    ).to_csv(tmp_path / f"{name}_requests.csv", index=False)


def test_the_table_judges_each_run_by_the_others_fits_with_the_spread(tmp_path, capsys):
    _recording(tmp_path, "a", 0.07, 0)
    _recording(tmp_path, "b", 0.07, 1)
    _recording(tmp_path, "slow", 0.09, 2)
    assert _load().main(["--no-shared", "--runs-dir", str(tmp_path), "--repeat", "a,b"]) == 0
    out = capsys.readouterr().out
    # exact up to rounding: a 1e-16 error prints as -0 % or +0 %
    # no step of b's requests lies past what a's profile covered (its batches are larger)
    # and how far: b's largest KV tokens a small share of a's (a ratio under 1); its small
    # first steps, under a's smallest, are counted apart
    assert re.search(
        r"\| calibrate steps a \| b \| held out \| 0 % \| 0\.\d+x \| \d+ % \|( [+-]0 % \|){6}",
        out,
    )
    assert re.search(r"\| none \(bundled roofline\) \| b \| baseline \| - \| - \| - \|", out)
    head = "| within target / figures | misses |\n|---|---|---|\n"
    assert f"| steps past the fit's range {head}| none | " in out
    assert f"| largest KV tokens over the fit's {head}| inside (up to 1x) | " in out
    assert f"| steps under the fit's range {head}| " in out
    assert (
        "| calibrate steps a | slow | held out |" in out and "✗" in out
    )  # 0.07 s steps for a 0.09 s engine
    assert "| a | a, b | 0 % | 0 % | 0 % | 0 % | 0 % | 0 % |" in out  # a and b: the same engine
    assert "calibrate steps: " in out and "held-out figures within target" in out


def test_a_condition_of_three_runs_widens_the_target_of_its_runs_only(tmp_path, capsys):
    """(max - min) / median over a condition's runs is its spread: a run of it is judged against
    that where it exceeds 15 %; the same engine outside any condition against 15 % alone."""
    bench = _load()
    for name, fixed_s in [
        ("w_10s_1", 0.05),
        ("w_10s_2", 0.075),
        ("w_10s_3", 0.1),
        ("w_10s_lone", 0.1),
    ]:
        _recording(tmp_path, name, fixed_s, 0)
    args = ["--no-shared", "--runs-dir", str(tmp_path), "--repeat", "w_10s_1,w_10s_2,w_10s_3"]
    assert bench.main(args + ["--skip", "lone"]) == 0
    skipped = capsys.readouterr().out
    assert "w_10s_lone" not in skipped
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    rows = {
        line.split(" | ")[1]: line
        for line in out.splitlines()
        if line.startswith("| calibrate steps w_10s_1 |")
    }
    spread_row = next(
        line
        for line in out.splitlines()
        if line.startswith("| w_10s | w_10s_1, w_10s_2, w_10s_3 |")
    )
    ttft_spread = float(spread_row.split(" | ")[2].rstrip(" %"))
    # after the share past, how far, and the share under
    ttft_error = float(rows["w_10s_3"].split(" | ")[6].split(" %")[0])
    assert (
        15 < abs(ttft_error) <= ttft_spread
    )  # 0.05 s steps for a 0.1 s engine: within its runs' spread
    assert "✗" not in rows["w_10s_3"].split(" | ")[6] and "✗" in rows["w_10s_lone"].split(" | ")[6]
    assert "on another workload" not in out  # one workload: w, its name up to the duration


def test_add_and_drop_reach_the_step_fit(tmp_path, capsys):
    """``--add`` fits the exposed-KV tail where it gains little (a law without one: an empty
    tail, the same table); ``--drop`` holds a term at 0 (the fixed cost: these runs' 70 ms steps
    are then missed); unknown terms exit 2."""
    bench = _load()
    for name, seed in [("a", 0), ("b", 1)]:
        _recording(tmp_path, name, 0.07, seed)
    args = ["--no-shared", "--runs-dir", str(tmp_path)]

    def row(extra):
        assert bench.main(args + extra) == 0
        out = capsys.readouterr().out
        return next(r for r in out.splitlines() if r.startswith("| calibrate steps a | b |"))

    plain = row([])
    assert re.search(r"held out \| 0 % \| 0\.\d+x \| \d+ % \|( [+-]0 % \|){6}", plain)
    assert row(["--add", "per_exposed_kv_token_s"]) == plain
    assert row(["--drop", "per_exposed_kv_token_s"]) == plain
    assert "✗" in row(["--drop", "fixed_s"])
    for bad, says in (("--add", "no such optional term"), ("--drop", "no such term")):
        with pytest.raises(SystemExit) as info:
            bench.main(args + [bad, "per_nothing_s"])
        assert info.value.code == 2 and says in capsys.readouterr().err


def test_a_runs_workload_is_its_name_up_to_the_duration():
    workload = _load().workload
    assert workload("azure_code_60s_x2_b") == "azure_code"
    assert workload("synth_mixed_10s_x1_a") == workload("synth_mixed_60s") == "synth_mixed"
    assert workload("lone") == "lone"


def test_a_runs_pair_group_is_its_workload_and_duration():
    group = _load().workload_pair_group
    assert group("azure_code_60s_x2_b") == group("azure_code_60s") == "azure_code_60s"
    assert group("synth_mixed_10s_x1_a") == "synth_mixed_10s"
    assert group("lone") == "lone"


def test_oracle_judges_each_run_by_its_own_step_times_and_counts_pairs(tmp_path, capsys):
    """``--oracle``: a recording whose profile is not the steps of its requests (the synthetic
    profile here) shows its mismatched steps; the pair table adds up to the totals."""
    _recording(tmp_path, "a_10s_x", 0.07, 0)
    _recording(tmp_path, "b_20s_x", 0.07, 1)
    assert _load().main(["--no-shared", "--runs-dir", str(tmp_path), "--oracle"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (a_10s_x|b_20s_x) \| 90 \| (\d+) \((\d+|-)\) \|", out, re.M)
    assert [r[0] for r in rows] == ["a_10s_x", "b_20s_x"]
    assert all(int(n) > 0 for _, n, _ in rows)  # 90 random steps are not these requests' steps
    assert re.search(r"recorded step times: \d+ of 12 figures within target", out)
    total = re.search(r"calibrate steps: (\d+) of 12 held-out", out).group(1)
    assert "a_10s fits: b_20s" in out and "b_20s fits: a_10s" in out
    assert re.search(rf"\| calibrate steps \| - \| \d+ / 6 \| \d+ / 6 \| - \| {total} / 12 ", out)


def test_a_bad_recording_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "x_steps.csv").write_text("duration_s,num_prefill_seqs\n0.1,1\n")
    (tmp_path / "x_requests.csv").write_text("arrival_s\n0\n")
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_calibration.py"),
            "--no-shared",
            "--runs-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=BENCH.parent,
    )
    assert (
        run.returncode == 2 and len(run.stderr.splitlines()) == 1 and "missing column" in run.stderr
    )


def test_pooled_fits_judge_the_other_conditions_and_the_other_workload(tmp_path, capsys):
    """``--pooled``: a fit on both repeats of a condition, in-sample on them and held out on the
    other condition's runs; a fit on all runs of a workload, held out on the other workload's;
    each counted apart from the single-run fits, in a pair table of its own."""
    bench = _load()
    for name, fixed_s, seed in [
        ("a_10s_1", 0.07, 0),
        ("a_10s_2", 0.07, 1),
        ("b_10s_1", 0.07, 2),
        ("b_10s_2", 0.07, 3),
    ]:
        _recording(tmp_path, name, fixed_s, seed)
    args = ["--no-shared", "--runs-dir", str(tmp_path)]
    args += ["--repeat", "a_10s_1,a_10s_2", "--repeat", "b_10s_1,b_10s_2"]
    assert bench.main(args) == 0
    plain = capsys.readouterr().out
    assert "pooled" not in plain
    assert bench.main(args + ["--pooled"]) == 0
    out = capsys.readouterr().out
    rows = [
        line.split(" | ")[:3] for line in out.splitlines() if "| calibrate steps pooled" in line
    ]
    condition = [r[1:] for r in rows if r[0] == "| calibrate steps pooled a_10s (2 runs)"]
    assert condition == [
        ["a_10s_1", "in-sample"],
        ["a_10s_2", "in-sample"],
        ["b_10s_1", "held out"],
        ["b_10s_2", "held out"],
    ]
    by_workload = [r[1:] for r in rows if r[0] == "| calibrate steps pooled b (2 runs)"]
    assert [kind for _, kind in by_workload] == ["held out", "held out", "in-sample", "in-sample"]
    # one engine: every pooled prediction within target, 4 conditions' runs x 6 figures
    assert "calibrate steps pooled by condition: 24 of 24 held-out figures within target" in out
    assert "calibrate steps pooled by workload on another workload: 24 of 24" in out
    assert (
        "| calibrate steps pooled by workload | - | 12 / 12 | 12 / 12 | - | 24 / 24 (100 %) |"
        in out
    )
    # the single-run fits' rows and counts are as without --pooled
    assert out.startswith(plain[: plain.index("| none (bundled roofline)")])
    assert re.search(r"calibrate steps: (\d+) of 72 held-out", out)


def test_the_misses_are_tabled_by_fit_with_the_runs_they_miss(tmp_path, capsys):
    """Each fit's held-out misses, most first, each with the judged run, figure and error; a
    table of one engine's runs misses none."""
    bench = _load()
    _recording(tmp_path, "a", 0.07, 0)
    _recording(tmp_path, "b", 0.07, 1)
    assert bench.main(["--no-shared", "--runs-dir", str(tmp_path)]) == 0
    assert "| (none) | 0 | - |" in capsys.readouterr().out
    _recording(tmp_path, "slow", 0.12, 2)
    assert bench.main(["--no-shared", "--runs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Held-out misses by fit") :]
    rows = re.findall(r"^\| calibrate steps (\w+) \| (\d+) / 12 \| (.*) \|$", table, re.M)
    # the slow engine's fit misses the other two, and theirs miss it, its TPOT priced low
    assert rows[0][0] == "slow" and int(rows[0][1]) > 0
    assert "a: TPOT p50 +" in rows[0][2] and "b: TPOT p50 +" in rows[0][2]
    assert {name for name, _, _ in rows} == {"a", "b", "slow"}
    assert all("slow: TPOT p50 -" in cells for name, _, cells in rows if name != "slow")
    counts = [int(n) for _, n, _ in rows]
    assert counts == sorted(counts, reverse=True)
    assert "(none)" not in table


def test_hosts_tables_each_runs_launch_bound_steps_against_one_pooled_law(tmp_path, capsys):
    """``--hosts``: a run whose every step pays more fixed (host) time reads above the law over
    all runs, the others below it; each run's own fit's fixed term beside it."""
    bench = _load()
    _recording(tmp_path, "a", 0.07, 0)
    _recording(tmp_path, "b", 0.07, 1)
    _recording(tmp_path, "slow", 0.11, 2)
    assert bench.main(["--no-shared", "--runs-dir", str(tmp_path), "--hosts"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Each run's decode steps reading at most ")
    assert "against the law fitted on all 3 runs' steps pooled" in out.splitlines()[0]
    rows = {
        m[0]: (float(m[1]), [float(v) for v in m[2].split()], float(m[3]))
        for m in re.findall(
            r"^\| (\w+) \| \d+ \| ([\d.]+) \| ([\d. ]+) \| ([\d.]+) ms \|$", out, re.M
        )
    }
    assert set(rows) == {"a", "b", "slow"}
    assert rows["slow"][0] > 1.1 * max(rows["a"][0], rows["b"][0])
    assert rows["a"][0] < 1 < rows["slow"][0]
    assert min(rows["slow"][1]) > max(rows["a"][1])  # slow in every fifth of its run
    assert rows["slow"][2] == pytest.approx(110, rel=0.05)
    assert rows["a"][2] == pytest.approx(70, rel=0.05)
    # the held-out table follows, as without --hosts
    assert "| measured (s) | condition |" in out
