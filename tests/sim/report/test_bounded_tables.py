"""The report's tables read bounded: downsampled per run with peaks kept, columns read one at a
time."""

import numpy as np
import pandas as pd
import pytest

from sim.report.bounded_tables import read_drawn_table


def _timeseries(n: int) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    parts = []
    for policy in ("best-fit", "paged"):
        live = rng.integers(0, 1 << 30, n)
        parts.append(
            pd.DataFrame(
                {
                    "trace": "t",
                    "policy": policy,
                    "backend": "sim",
                    "event": np.arange(n),
                    "time_us": np.arange(n) * 10,
                    "live_bytes": live,
                    "reserved_bytes": live + 5,
                    "frag_ext": rng.random(n),
                }
            )
        )
    return pd.concat(parts, ignore_index=True)


def test_long_runs_keep_max_points_rows_each_and_their_peaks(tmp_path):
    ts = _timeseries(10_007)
    ts.loc[4321, "live_bytes"] = 1 << 40  # a spike in best-fit that a stride sample would miss
    ts.to_parquet(tmp_path / "timeseries.parquet", index=False)
    got = read_drawn_table(tmp_path / "timeseries.parquet", max_points=100)
    assert got.groupby("policy", sort=False).size().to_dict() == {"best-fit": 100, "paged": 100}
    assert list(got.columns) == list(ts.columns)
    for policy, run in got.groupby("policy"):
        full = ts[ts["policy"] == policy]
        assert run["live_bytes"].max() == full["live_bytes"].max()
        assert run["frag_ext"].max() == full["frag_ext"].max()
        assert run["time_us"].iloc[0] == 0 and run["time_us"].is_monotonic_increasing
    assert (got["live_bytes"] == 1 << 40).sum() == 1


def test_short_runs_come_back_unchanged(tmp_path):
    ts = _timeseries(50)
    ts.to_parquet(tmp_path / "timeseries.parquet", index=False)
    got = read_drawn_table(tmp_path / "timeseries.parquet", max_points=100)
    pd.testing.assert_frame_equal(got, ts, check_dtype=False)


def test_numeric_nulls_become_nan_and_are_skipped_by_the_maximum(tmp_path):
    ts = _timeseries(300).assign(running=pd.array([None, 3] * 300, dtype="Int64"))
    ts.to_parquet(tmp_path / "timeseries.parquet", index=False)
    got = read_drawn_table(tmp_path / "timeseries.parquet", max_points=10)
    assert (got["running"] == 3).all()


def test_latency_samples_keep_the_distribution_at_evenly_spaced_ranks(tmp_path):
    rng = np.random.default_rng(1)
    lat = rng.lognormal(0, 1, 20_000)
    t = pd.DataFrame(
        {
            "trace": "t",
            "policy": "p",
            "backend": "sim",
            "op": np.repeat(["alloc", "free"], 10_000),
            "latency_us": lat,
        }
    )
    t.to_parquet(tmp_path / "latency_samples.parquet", index=False)
    got = read_drawn_table(tmp_path / "latency_samples.parquet", max_points=501)
    assert got.groupby("op").size().to_dict() == {"alloc": 501, "free": 501}
    alloc = got.loc[got["op"] == "alloc", "latency_us"].to_numpy()
    assert alloc[0] == lat[:10_000].min() and alloc[-1] == lat[:10_000].max()
    assert np.median(alloc) == pytest.approx(np.median(lat[:10_000]), rel=0.02)


def test_latency_ranks_stay_within_a_bin_over_many_batches_and_interleaved_runs(
    tmp_path, monkeypatch
):
    """Read in small batches (the streaming path): every rank within 0.05 % of the exact value;
    a run with at most max_points calls comes back exactly, sorted; runs in order of first sight."""
    import sim.report.bounded_tables as bt

    monkeypatch.setattr(bt, "_BATCH_ROWS", 997)
    rng = np.random.default_rng(2)
    n = 30_000
    lat = np.concatenate([rng.lognormal(0, 2, n), rng.lognormal(3, 0.5, n), rng.random(300) * 50])
    policy = np.concatenate(
        [np.where(rng.random(n) < 0.5, "a", "b"), np.full(n, "c"), np.full(300, "d")]
    )
    lat[5] = 0.0  # a zero-time call sits in the underflow bin, and is the exact minimum
    t = pd.DataFrame(
        {"trace": "t", "policy": policy, "backend": "sim", "op": "alloc", "latency_us": lat}
    )
    t.to_parquet(tmp_path / "latency_samples.parquet", index=False)
    got = read_drawn_table(tmp_path / "latency_samples.parquet", max_points=400)
    assert list(dict.fromkeys(got["policy"])) == list(dict.fromkeys(policy))
    for name, run in got.groupby("policy"):
        v = np.sort(lat[policy == name])
        g = run["latency_us"].to_numpy()
        if len(v) <= 400:
            np.testing.assert_array_equal(g, v)
            continue
        want = v[np.linspace(0, len(v) - 1, 400).round().astype(np.int64)]
        assert len(g) == 400 and g[0] == v[0] and g[-1] == v[-1]
        inner = want[1:-1] > 1e-3
        np.testing.assert_allclose(g[1:-1][inner], want[1:-1][inner], rtol=6e-4)


def test_requests_keep_only_drawn_columns(tmp_path):
    t = pd.DataFrame(
        {
            "trace": "t",
            "policy": "p",
            "request_id": range(30),
            "status": "finished",
            "ttft_s": np.linspace(0, 1, 30),
            "prompt_tokens": 5,
        }
    )
    t.to_parquet(tmp_path / "requests.parquet", index=False)
    got = read_drawn_table(tmp_path / "requests.parquet", max_points=1)
    assert list(got.columns) == ["trace", "policy", "status", "ttft_s"]
    assert len(got) == 10 and got["ttft_s"].iloc[0] == 0.0


def test_a_table_the_report_does_not_draw_is_not_read(tmp_path):
    (tmp_path / "bounds.parquet").write_bytes(b"not parquet at all")
    assert read_drawn_table(tmp_path / "bounds.parquet") is None


def test_a_damaged_table_is_a_value_error_naming_it(tmp_path):
    (tmp_path / "timeseries.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="timeseries.parquet"):
        read_drawn_table(tmp_path / "timeseries.parquet")
