"""The command line: exit status 2 and one line for bad input, tables and files for good input."""

from traces import bundled_path


def test_policies_lists_every_registered_policy(cli_ok):
    import policies

    out, _ = cli_ok(["policies"])
    for name in policies.available():
        assert name in out


def test_replay_writes_summary_and_prints_a_table(tmp_path, cli_ok):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,1,4096,0,\n5,alloc,2,70000,0,\n9,free,1,4096,0,\n12,free,2,70000,0,\n"
    )
    out, _ = cli_ok(
        [
            "replay",
            str(trace),
            "-p",
            "first-fit",
            "-p",
            "paged:page_bytes=65536",
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
        ]
    )
    assert "first-fit" in out and "paged" in out
    assert (tmp_path / "out" / "summary.csv").exists()
    assert (tmp_path / "out" / "timeseries.parquet").exists()
    assert (
        tmp_path / "out" / "latency_samples.parquet"
    ).exists()  # one row per call, for the report


def test_unknown_policy_is_one_line_and_exit_2(tmp_path, cli):
    code, out, err = cli(
        [
            "replay",
            str(bundled_path("llama1b_generate_slice.pickle.gz")),
            "-p",
            "no-such-policy",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 2
    assert "unknown policy 'no-such-policy'" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unknown_policy_parameter_is_exit_2(tmp_path, cli):
    code, _, err = cli(
        [
            "replay",
            str(bundled_path("llama1b_generate_slice.pickle.gz")),
            "-p",
            "best-fit:bogus=1",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 2 and "bogus" in err


def test_malformed_trace_names_file_and_line(tmp_path, cli):
    trace = tmp_path / "bad.csv"
    trace.write_text("time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,1,4096,0,\n5,explode,2,7,0,\n")
    code, _, err = cli(["replay", str(trace), "--out", str(tmp_path / "o")])
    assert code == 2
    assert f"{trace}:3" in err and "Traceback" not in err


def test_missing_trace_file_is_exit_2(tmp_path, cli):
    code, _, err = cli(["replay", str(tmp_path / "nope.csv"), "--out", str(tmp_path / "o")])
    assert code == 2 and "nope.csv" in err


def test_bad_capacity_is_exit_2(tmp_path, cli):
    code, _, err = cli(["replay", "x.csv", "--capacity", "lots"])
    assert code == 2 and "lots" in err


def test_a_request_trace_given_to_replay_points_to_simulate(cli):
    code, _, err = cli(["replay", str(bundled_path("azure_code_slice.csv"))])
    assert code == 2 and "request trace" in err and "poollab simulate" in err


def test_an_allocation_trace_given_to_simulate_points_to_replay(cli):
    code, _, err = cli(["simulate", str(bundled_path("llama1b_generate_slice.pickle.gz"))])
    assert code == 2 and "allocation trace" in err and "poollab replay" in err


def test_latency_sample_times_a_share_of_the_calls_and_is_checked(tmp_path, cli, cli_ok):
    import pandas as pd

    trace = bundled_path("llama1b_generate_slice.pickle.gz")
    cli_ok(
        [
            "replay",
            str(trace),
            "-p",
            "best-fit",
            "--latency-sample",
            "0.5",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ]
    )
    row = pd.read_csv(tmp_path / "o" / "summary.csv").iloc[0]
    samples = pd.read_parquet(tmp_path / "o" / "latency_samples.parquet")
    assert 0.45 < row["latency_sampled_frac"] < 0.55
    assert len(samples) == round(row["latency_sampled_frac"] * (row["n_alloc"] + row["n_free"]))
    for bad in ("0", "1.5", "half"):
        code, _, err = cli(
            ["replay", str(trace), "--latency-sample", bad, "--out", str(tmp_path / "x")]
        )
        assert code == 2 and "--latency-sample" in err and "Traceback" not in err
