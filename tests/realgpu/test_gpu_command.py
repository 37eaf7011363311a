"""``poollab gpu``: one-line refusals without a GPU, and the whole replay path on the host
backend."""

from pathlib import Path

import pandas as pd
import pytest

import realgpu.cuda as rcuda
from poollab.cli import main

BUNDLED = str(
    Path(__file__).resolve().parents[2] / "traces" / "data" / "llama1b_generate_slice.pickle.gz"
)


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setattr(rcuda, "cupy", None)
    monkeypatch.setattr(rcuda, "_IMPORT_ERROR", ImportError("No module named 'cupy'"))


@pytest.mark.parametrize(
    "argv", [["gpu", "replay", BUNDLED], ["gpu", "calibrate", "--out", "x.json"]]
)
def test_without_cupy_gpu_commands_exit_2_with_one_line(argv, no_cupy, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert (
        err.count("\n") == 1
        and err.startswith("poollab: error: ")
        and "install poollab[gpu]" in err
    )


def test_host_backend_replays_and_writes_gpu_and_sim_rows(tmp_path, capsys):
    out = tmp_path / "gpu"
    main(
        [
            "gpu",
            "replay",
            BUNDLED,
            "--backend",
            "host",
            "-p",
            "paged",
            "-p",
            "first-fit",
            "--sim",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    summary = pd.read_csv(out / "summary.csv")
    assert list(zip(summary["policy"], summary["backend"])) == [
        ("paged", "gpu"),
        ("paged", "sim"),
        ("first-fit", "gpu"),
        ("first-fit", "sim"),
    ]
    for _, pair in summary.groupby("policy"):
        assert pair["peak_reserved_bytes"].nunique() == 1 and pair["n_failed"].nunique() == 1
    assert "wrote" in capsys.readouterr().out


def test_baselines_need_the_cuda_backend(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "gpu",
                "replay",
                BUNDLED,
                "--backend",
                "host",
                "-b",
                "cupy.memorypool",
                "--out",
                str(tmp_path),
            ]
        )
    assert info.value.code == 2 and "--backend cuda" in capsys.readouterr().err


def test_unknown_device_kind_is_one_line_naming_the_option_and_the_kinds(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "gpu",
                "replay",
                BUNDLED,
                "--backend",
                "host",
                "--device-kind",
                "paged",
                "--out",
                str(tmp_path),
            ]
        )
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "'--device-kind'" in err and "segment, page-mapped" in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_unknown_baseline_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(
            [
                "gpu",
                "replay",
                BUNDLED,
                "--backend",
                "host",
                "-b",
                "jemalloc",
                "--out",
                str(tmp_path),
            ]
        )
    assert info.value.code == 2 and "'jemalloc'" in capsys.readouterr().err


def test_host_backend_replays_arenas_released_by_the_retry(tmp_path):
    # issue 11: arena served the 2 MiB request from an arena its trim-and-retry had released,
    # and the host backend died on an AssertionError in realgpu/segments.py
    trace = tmp_path / "arena.csv"
    trace.write_text(
        "time_us,op,alloc_id,nbytes,stream,tag\n"
        "0,alloc,0,1048576,0,\n1,free,0,1048576,0,\n2,alloc,1,104857600,0,\n"
        "3,alloc,2,2097152,0,\n4,free,1,104857600,0,\n5,free,2,2097152,0,\n"
    )
    out = tmp_path / "gpu"
    main(
        [
            "gpu",
            "replay",
            str(trace),
            "--backend",
            "host",
            "-p",
            "arena",
            "--capacity",
            "128MiB",
            "--sim",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    summary = pd.read_csv(out / "summary.csv").set_index("backend")
    for backend in ("gpu", "sim"):
        row = summary.loc[backend]
        assert row["n_failed"] == 1 and row["peak_live_bytes"] <= row["peak_reserved_bytes"]


@pytest.mark.parametrize("validate", [["--validate"], []], ids=["validate", "plain"])
def test_page_pool_replays_on_the_host_backend(tmp_path, capsys, validate):
    """Issue 29: a 1 MiB then a 3 MiB allocation under page-pool on ``--backend host`` stopped with
    "offset 12582912 lies past segment [10485760, 12582912)" (an AssertionError traceback): the
    policy got a modelled page-mapped device over the segment device, whose offsets were not the
    device's. It runs on the page-mapped device now, agreeing with the simulator."""
    trace = tmp_path / "one-then-three.csv"
    trace.write_text(
        "time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,0,1048576,0,\n1,alloc,1,3145728,0,\n"
        "2,free,0,1048576,0,\n3,free,1,3145728,0,\n"
    )
    out = tmp_path / "gpu"
    main(
        [
            "gpu",
            "replay",
            str(trace),
            "--backend",
            "host",
            "-p",
            "page-pool",
            "--sim",
            "--out",
            str(out),
            "--no-progress",
            *validate,
        ]
    )
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary["device_kind"]) == ["page-mapped", "page-mapped"] and list(
        summary["n_failed"]
    ) == [0, 0]
    assert summary["peak_reserved_bytes"].nunique() == 1
