"""The engine step profile and served-request table: the shared data reads, bad cells are named."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from traces.engine_profile import (
    SERVED_REQUEST_COLUMNS,
    STEP_COLUMNS,
    read_served_requests,
    read_step_profile,
    write_served_requests,
    write_step_profile,
)
from traces.errors import TraceFormatError

ENGINE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "engine"
needs_engine_data = pytest.mark.skipif(
    not ENGINE.is_dir(), reason="../shared/data/engine is not beside the repository"
)


@needs_engine_data
@pytest.mark.parametrize("workload", ["azure_code_60s", "synth_mixed_60s"])
def test_shared_profiles_read(workload):
    steps = read_step_profile(ENGINE / f"transformers_cb_{workload}_steps.csv")
    assert tuple(steps.columns[:6]) == STEP_COLUMNS and "start_s" in steps
    assert (steps["duration_s"] > 0).all() and steps["num_prefill_tokens"].dtype.kind == "i"
    requests = read_served_requests(ENGINE / f"transformers_cb_{workload}_requests.csv")
    assert tuple(requests.columns[:5]) == SERVED_REQUEST_COLUMNS
    assert (requests["finish_s"] >= requests["first_token_s"]).all()


def _steps(**override):
    row = dict(
        start_s=0.0,
        duration_s=0.1,
        num_prefill_seqs=1,
        num_prefill_tokens=10,
        prefill_context_tokens=10,
        num_decode_seqs=2,
        decode_context_tokens=40,
    )
    row.update(override)
    return pd.DataFrame([row, dict(row, start_s=0.1)])


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".csv.gz"])
def test_round_trip(tmp_path, suffix):
    path = write_step_profile(_steps(), tmp_path / f"s{suffix}")
    back = read_step_profile(path)
    pd.testing.assert_frame_equal(back, _steps()[list(back.columns)], check_dtype=False)


def test_cpu_time_column_round_trips_and_is_checked(tmp_path):
    """``cpu_s`` (the engine thread's CPU time in a step) is kept when present, checked."""
    steps = _steps(cpu_s=0.08)
    back = read_step_profile(write_step_profile(steps, tmp_path / "s.csv"))
    assert back["cpu_s"].tolist() == [0.08, 0.08]
    bad = steps.assign(cpu_s=[0.08, -0.01])
    bad.to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(TraceFormatError, match=r"bad.csv:3: cpu_s .*must be >= 0"):
        read_step_profile(tmp_path / "bad.csv")


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(duration_s=0.0), "duration_s.*> 0"),
        (dict(num_prefill_tokens=1.5), "num_prefill_tokens.*whole number"),
        (dict(decode_context_tokens=float("nan")), "decode_context_tokens '': missing value"),
        (dict(decode_context_tokens=float("inf")), "finite"),
        (dict(num_decode_seqs=-1), "must be >= 0"),
        (dict(num_prefill_tokens=10**30), "corrupt count"),
        (dict(prefill_context_tokens=5), "prefill_context_tokens.*below num_prefill_tokens"),
        (dict(num_prefill_seqs=0), "num_prefill_tokens.*num_prefill_seqs 0"),
    ],
)
def test_bad_cells_name_line_and_column(tmp_path, override, match):
    df = _steps()
    for column, value in override.items():
        df[column] = df[column].astype(object)
        df.loc[1, column] = value
    path = tmp_path / "bad.csv"
    df.to_csv(path, index=False)
    with pytest.raises(TraceFormatError, match=f"bad.csv:3: .*{match}"):
        read_step_profile(path)


def test_text_and_boolean_cells(tmp_path):
    path = tmp_path / "t.csv"
    _steps().assign(num_decode_seqs=["two", "2"]).to_csv(path, index=False)
    with pytest.raises(TraceFormatError, match=r"t.csv:2: num_decode_seqs 'two': not a number"):
        read_step_profile(path)
    pq = tmp_path / "b.parquet"
    _steps().assign(num_decode_seqs=[True, False]).to_parquet(pq)
    with pytest.raises(TraceFormatError, match=r"row 1.*boolean"):
        read_step_profile(pq)
    huge = tmp_path / "h.csv"
    _steps().assign(num_decode_seqs=["9" * 5000, "2"]).to_csv(huge, index=False)
    with pytest.raises(TraceFormatError, match="sensible size"):
        read_step_profile(huge)


def test_missing_columns_and_files(tmp_path):
    path = tmp_path / "m.csv"
    _steps().drop(columns=["decode_context_tokens"]).to_csv(path, index=False)
    with pytest.raises(TraceFormatError, match="m.csv:1: missing column.*decode_context_tokens"):
        read_step_profile(path)
    with pytest.raises(TraceFormatError, match="no such file"):
        read_step_profile(tmp_path / "absent.csv")
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(TraceFormatError, match="empty file"):
        read_step_profile(tmp_path / "e.csv")
    (tmp_path / "x.txt").write_text("a")
    with pytest.raises(TraceFormatError, match="x.txt:1: missing column"):
        read_step_profile(tmp_path / "x.txt")


def test_a_profile_from_a_pipe_reads_as_from_its_file(tmp_path):
    """Read once from any stream (a pipe, ``<(...)``), its format told from the content."""
    import subprocess
    import sys

    path = write_step_profile(_steps(), tmp_path / "s.parquet")
    code = (
        "import sys; from traces.engine_profile import read_step_profile; "
        "print(len(read_step_profile('/dev/stdin')))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code],
        stdin=path.open("rb"),
        capture_output=True,
        text=True,
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": ""},
        timeout=60,
    )
    assert out.stdout.strip() == "2", out.stderr


def test_served_requests_allow_unfinished_and_refuse_time_travel(tmp_path):
    df = pd.DataFrame(
        dict(
            request=[0, 1],
            arrival_s=[0.0, 1.0],
            prompt_tokens=[10, 20],
            output_tokens=[5, 5],
            first_token_s=[0.5, float("nan")],
            finish_s=[1.0, float("nan")],
        )
    )
    path = write_served_requests(df, tmp_path / "r.csv")
    back = read_served_requests(path)
    assert back["finish_s"].isna().tolist() == [False, True]
    write_served_requests(df.assign(first_token_s=[0.5, 0.5]), path)
    with pytest.raises(TraceFormatError, match="r.csv:3: first_token_s 0.5 is before arrival_s"):
        read_served_requests(path)
    write_served_requests(df.assign(first_token_s=[0.5, 1.5], finish_s=[0.2, 2.0]), path)
    with pytest.raises(TraceFormatError, match="r.csv:2: finish_s 0.2 is before first_token_s"):
        read_served_requests(path)
