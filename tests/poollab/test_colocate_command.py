"""``poollab colocate``: per-tenant rows for each layout; one line and exit 2 for bad input."""

import pandas as pd
import pytest


def test_colocate_writes_one_row_per_layout_and_tenant(trace, tmp_path, cli_ok):
    out_dir = tmp_path / "out"
    out = cli_ok(
        ["colocate", str(trace), "--tenants", "3", "--model", "Llama-3.2-1B", "--out", str(out_dir)]
    ).out
    summary = pd.read_csv(out_dir / "summary.csv")
    assert list(summary["tenant_layout"]) == ["static"] * 3 + ["shared"] * 3 + ["sleep"] * 3
    assert list(summary["tenant"]) == ["t0", "t1", "t2"] * 3
    assert (summary.groupby("tenant_layout")["n_requests"].sum() == 12).all()
    requests = pd.read_parquet(out_dir / "requests.parquet")
    assert len(requests) == 36 and {"tenant", "tenant_layout"} <= set(requests.columns)
    assert "static: 12 of 12 finished" in out


def test_tenant_rate_scales_and_compute_reach_the_run(trace, tmp_path, cli_ok):
    out_dir = tmp_path / "out"
    out = cli_ok(
        [
            "colocate",
            str(trace),
            "--tenants",
            "2",
            "--tenant-rate-scale",
            "1,3",
            "--compute",
            "independent",
            "--layout",
            "shared",
            "--model",
            "Llama-3.2-1B",
            "--out",
            str(out_dir),
        ]
    ).out
    assert "compute independent" in out
    requests = pd.read_parquet(out_dir / "requests.parquet")
    last = requests.groupby("tenant")["arrival_s"].max()
    assert last["t1"] < last["t0"] / 2  # t1's share arrives three times as densely
    assert set(pd.read_csv(out_dir / "summary.csv")["tenant_compute"]) == {"independent"}


def test_two_traces_are_two_tenants(trace, tmp_path, cli_ok):
    out_dir = tmp_path / "out"
    cli_ok(
        [
            "colocate",
            str(trace),
            str(trace),
            "--layout",
            "shared",
            "--model",
            "Llama-3.2-1B",
            "--model",
            "Llama-3-8B",
            "--out",
            str(out_dir),
        ]
    )
    summary = pd.read_csv(out_dir / "summary.csv")
    assert list(summary["model"]) == ["Llama-3.2-1B", "Llama-3-8B"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tenants", "2", "SECOND"], "--tenants deals ONE trace"),
        (["--kv-capacity", "1GiB"], "--kv-capacity does not apply"),
        (["--tenants", "40"], "cannot be shared among 40"),
        (["--layout", "shared", "-p", "best-fit"], "contiguous"),
        (["--model", "Llama-3-70B", "--model", "Llama-3-70B", "--tenants", "2"], "do not fit"),
        (["-p", "nope"], "nope"),
        (["--tenants", "3", "--tenant-rate-scale", "1,2"], "2 rate scales for 3 tenants"),
        (["--tenants", "3", "--tenant-rate-scale", "1,x,2"], "x is not a number"),
        (["--tenants", "2", "--tenant-rate-scale", "1,-2"], "-2 is not in"),
        (["--compute", "mps"], "mps"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(trace, tmp_path, extra, message, cli):
    extra = [str(trace) if a == "SECOND" else a for a in extra]
    code, _, err = cli(["colocate", str(trace), *extra, "--out", str(tmp_path / "o")])
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
