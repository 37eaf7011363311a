"""Result folders (issue 29): a replace killed at any step leaves the old run or the new one; files
the tool did not write are kept or refused, never deleted; symlinks followed; modes from the umask;
errors name the file; folders that are not what they claim are one line, exit 2."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from sim.replay.schema import read_results, write_results
from traces import atomic
from traces.atomic import MANIFEST_NAME, replacing_folder

REPO = Path(__file__).resolve().parents[2]
TRACE = "time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,0,4096,0,\n5,free,0,4096,0,\n"


def _tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(root.rglob("*"))
    }


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("poollab: error: ") and "Traceback" not in err, (
        err
    )
    return lines[0]


# -- a kill at every step of the replace ------------------------------------------------------

#: Run in a subprocess: replace ``out`` (old run: a.csv, b.parquet; the user's notes.txt and a
#: sweep's cells/) with a new run (a.csv, c.parquet), SIGKILLed at file-system step ``k``.
CRASH_SCRIPT = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    import traces.atomic as A

    out, k, exchange = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "exchange"
    steps = [0]

    def step():
        steps[0] += 1
        if steps[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)

    def hooked(fn):
        def run(*args, **kwargs):
            step()
            result = fn(*args, **kwargs)
            step()
            return result
        return run

    for mod, name in [(os, "rename"), (os, "replace"), (os, "link"), (os, "mkdir"), (os, "symlink"),
                      (shutil, "rmtree"), (shutil, "copy2")]:
        setattr(mod, name, hooked(getattr(mod, name)))
    if hasattr(A, "_rename_exchange"):
        A._rename_exchange = hooked(A._rename_exchange) if exchange else (lambda a, b: False)
    with A.replacing_folder(out, **({"legacy_outputs": None} if hasattr(A, "written_files") else {})) as tmp:
        (tmp / "a.csv").write_text("new a")
        step()
        (tmp / "c.parquet").write_text("new c")
        step()
    print("done", steps[0])
""")  # noqa: E501


def _old_run(out: Path) -> None:
    with replacing_folder(out) as tmp:
        (tmp / "a.csv").write_text("old a")
        (tmp / "b.parquet").write_text("old b")
    (out / "notes.txt").write_text("the user's")
    (out / "cells").mkdir()
    (out / "cells" / "k1.json").write_text('{"key": "k1"}')


def _state(out: Path) -> str:
    """'old', 'new', or what is wrong."""
    if not out.is_dir():
        return "missing"
    files = {k: v for k, v in _tree(out).items() if k != MANIFEST_NAME}
    mine = {"notes.txt": b"the user's", "cells": None, "cells/k1.json": b'{"key": "k1"}'}
    if files == {**mine, "a.csv": b"old a", "b.parquet": b"old b"}:
        return "old"
    if files == {**mine, "a.csv": b"new a", "c.parquet": b"new c"}:
        return "new"
    return f"mixed: {sorted(files)}"


@pytest.mark.parametrize("mode", ["exchange", "two-renames"])
def test_a_replace_killed_at_any_step_leaves_the_old_run_or_the_new_one(tmp_path, mode):
    out = tmp_path / "res" / "out"
    seen = []
    for k in range(1, 200):
        if out.parent.exists():
            atomic.shutil.rmtree(out.parent)
        _old_run(out)
        proc = subprocess.run(
            [sys.executable, "-c", CRASH_SCRIPT, str(out), str(k), mode],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert proc.returncode in (0, -9), proc.stderr
        state = _state(out)
        if (
            mode == "exchange"
        ):  # at every instant: the old run or the whole new one, the user's files in both
            assert state in ("old", "new"), f"killed at step {k}: {state}"
        # the next replace cleans up after the dead run (and, without the exchange, puts the old run
        # back)
        atomic._remove_dead_temporaries(out.parent)
        state = _state(out)
        assert state in ("old", "new"), f"killed at step {k}, then repaired: {state}"
        assert [p.name for p in out.parent.iterdir()] == ["out"], (
            f"killed at step {k}: temporaries left"
        )
        seen.append(state)
        if proc.returncode == 0:
            break
    assert proc.returncode == 0 and seen[0] == "old" and seen[-1] == "new" and len(seen) > 10


# -- files the tool did not write -------------------------------------------------------------


def _summary(policy: str = "p") -> pd.DataFrame:
    return pd.DataFrame({"trace": ["t"], "policy": [policy], "backend": ["sim"]})


def test_a_file_the_user_put_in_the_folder_is_kept_and_is_no_table(tmp_path):
    out = tmp_path / "res"
    write_results(out, _summary(), extra_tables={"requests": _summary()}, meta={"command": "x"})
    (out / "mine.parquet").write_bytes(
        (out / "requests.parquet").read_bytes()
    )  # the user's own table
    write_results(out, _summary("q"), timeseries=_summary(), meta={"command": "x"})
    assert (out / "mine.parquet").exists()  # kept: poollab did not write it
    assert not (out / "requests.parquet").exists()  # the earlier run's table is gone
    assert sorted(read_results(out)) == [
        "summary",
        "timeseries",
    ]  # and the user's file is not read as one


def test_a_file_of_the_users_with_a_result_name_is_refused_not_replaced(tmp_path, cli):
    (tmp_path / "a.csv").write_text(TRACE)
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.csv").write_text("my own summary, not poollab's\n")
    before = _tree(tmp_path)
    code, _, err = cli(
        ["replay", str(tmp_path / "a.csv"), "-p", "first-fit", "--out", str(out), "--no-progress"]
    )
    line = _one_error_line(err)
    assert code == 2 and f"{out}/summary.csv" in line and "did not write it" in line
    assert _tree(tmp_path) == before


def test_a_folder_written_before_the_list_of_files_has_its_tables_replaced(tmp_path):
    out = tmp_path / "res"
    out.mkdir()
    _summary("old").to_csv(out / "summary.csv", index=False)
    _summary().to_parquet(out / "requests.parquet")
    (out / "run.json").write_text('{"command": "replay"}')
    (out / "notes.txt").write_text("mine")
    write_results(out, _summary("new"), meta={"command": "replay"})
    assert sorted(p.name for p in out.iterdir()) == [
        MANIFEST_NAME,
        "notes.txt",
        "run.json",
        "summary.csv",
    ]
    assert read_results(out)["summary"]["policy"].tolist() == ["new"]


# -- where --out points ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_a_symlinked_out_is_followed(tmp_path, cli, how):
    (tmp_path / "a.csv").write_text(TRACE)
    real = tmp_path / "elsewhere" / "results"
    real.mkdir(parents=True)
    (real / "kept.txt").write_text("mine")
    link = tmp_path / "out"
    link.symlink_to(real if how == "absolute" else Path("elsewhere") / "results")
    for _ in range(2):  # a new folder, then a replace
        assert (
            cli(
                [
                    "replay",
                    str(tmp_path / "a.csv"),
                    "-p",
                    "first-fit",
                    "--out",
                    str(link),
                    "--no-progress",
                ]
            )[0]
            == 0
        )
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert (real / "summary.csv").is_file() and (real / "kept.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "elsewhere", "out"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["results"]  # no hidden folders


@pytest.mark.parametrize("out", [".", ".."])
@pytest.mark.parametrize("command", ["replay", "sweep"])
def test_the_current_folder_as_out_is_refused_before_any_work(
    tmp_path, cli, monkeypatch, out, command
):
    work = tmp_path / "work"
    work.mkdir()
    (work / "a.csv").write_text(TRACE)
    (work / "sw.yaml").write_text("mode: replay\ntraces: [a.csv]\npolicies: [first-fit]\n")
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    argv = (
        ["replay", "a.csv", "-p", "first-fit"]
        if command == "replay"
        else ["sweep", "sw.yaml", "--scheduler", "serial"]
    )
    code, out_text, err = cli([*argv, "--out", out, "--no-progress"])
    line = _one_error_line(err)
    assert out_text == ""  # refused at parse time: nothing ran
    assert code == 2 and "current folder" in line and "--out" in line
    assert _tree(tmp_path) == before


def test_a_250_character_folder_name_works(tmp_path, cli):
    (tmp_path / "a.csv").write_text(TRACE)
    out = tmp_path / ("r" * 250)
    for _ in range(2):
        assert (
            cli(
                [
                    "replay",
                    str(tmp_path / "a.csv"),
                    "-p",
                    "first-fit",
                    "--out",
                    str(out),
                    "--no-progress",
                ]
            )[0]
            == 0
        )
    assert (out / "summary.csv").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "r" * 250]


def test_modes_follow_the_umask(tmp_path, cli):
    (tmp_path / "a.csv").write_text(TRACE)
    old = os.umask(0o022)
    try:
        assert (
            cli(
                [
                    "replay",
                    str(tmp_path / "a.csv"),
                    "-p",
                    "first-fit",
                    "--out",
                    str(tmp_path / "out"),
                    "--no-progress",
                ]
            )[0]
            == 0
        )
        assert (
            cli(
                [
                    "report",
                    str(tmp_path / "out"),
                    "--out",
                    str(tmp_path / "report.html"),
                    "--no-progress",
                    "--static",
                ]
            )[0]
            == 0
        )
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "out") == 0o755
    assert (
        mode(tmp_path / "out" / "summary.csv") == 0o644 and mode(tmp_path / "report.html") == 0o644
    )


# -- errors that name the file ------------------------------------------------------------------


def test_a_full_disk_names_the_file(tmp_path, cli, monkeypatch):
    (tmp_path / "a.csv").write_text(TRACE)
    out = tmp_path / "out"

    def no_space(self, path, *args, **kwargs):  # what write() raises on a full disk: no file name
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", no_space)
    code, _, err = cli(
        ["replay", str(tmp_path / "a.csv"), "-p", "first-fit", "--out", str(out), "--no-progress"]
    )
    line = _one_error_line(err)
    assert code == 2 and f"{out}/timeseries.parquet: No space left on device" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv"]


# -- result folders that are not what they claim ------------------------------------------------


@pytest.mark.parametrize(
    "run_json, what", [("[1, 2]", "a list"), ("null", "null"), ('"replay"', "a string")]
)
def test_report_refuses_a_run_json_that_is_no_object(tmp_path, cli, run_json, what):
    res = tmp_path / "res"
    res.mkdir()
    (res / "summary.csv").write_text("trace,policy,backend\nt,p,sim\n")
    (res / "run.json").write_text(run_json)
    before = _tree(tmp_path)
    code, _, err = cli(["report", str(res), "--out", str(tmp_path / "r.html"), "--no-progress"])
    line = _one_error_line(err)
    assert code == 2 and f"{res}/run.json" in line and what in line
    assert _tree(tmp_path) == before


def test_a_broken_list_of_written_files_is_one_line(tmp_path, cli):
    res = tmp_path / "res"
    res.mkdir()
    (res / "summary.csv").write_text("trace,policy,backend\nt,p,sim\n")
    (res / MANIFEST_NAME).write_text(json.dumps({"files": "summary.csv"}))
    code, _, err = cli(["report", str(res), "--out", str(tmp_path / "r.html"), "--no-progress"])
    line = _one_error_line(err)
    assert code == 2 and MANIFEST_NAME in line


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: {k: v for k, v in r.items() if k != "status"},
        lambda r: {**r, "summary": [1, 2]},
        lambda r: {**r, "status": "maybe"},
        lambda r: {**r, "summary": {**r["summary"], "policy": {"nested": 1}}},
        lambda r: [r],
        lambda r: None,
    ],
    ids=["no-status", "summary-list", "status-unknown", "summary-nested", "a-list", "null"],
)
def test_a_broken_cell_record_is_named_run_again_and_poisons_nothing(tmp_path, damage):
    (tmp_path / "a.csv").write_text(TRACE)
    (tmp_path / "sw.yaml").write_text(
        "mode: replay\ntraces: [a.csv]\npolicies: [first-fit, best-fit]\n"
    )
    argv = [
        sys.executable,
        "-m",
        "poollab",
        "sweep",
        str(tmp_path / "sw.yaml"),
        "--out",
        str(tmp_path / "out"),
        "--scheduler",
        "serial",
        "--no-progress",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert subprocess.run(argv, capture_output=True, timeout=120, env=env).returncode == 0
    record = sorted((tmp_path / "out" / "cells").glob("*.json"))[0]
    record.write_text(json.dumps(damage(json.loads(record.read_text()))))
    for attempt in range(
        2
    ):  # the damaged record is named once, its cell runs again, the next run is clean
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        warned = [
            line for line in proc.stderr.splitlines() if line.startswith("poollab: warning: ")
        ]
        if attempt == 0:
            assert len(warned) == 1 and str(record) in warned[0] and "runs again" in warned[0], (
                proc.stderr
            )
            assert "1 run on serial, 1 already done" in proc.stdout
        else:
            assert warned == [] and "0 run on serial, 2 already done" in proc.stdout
    assert json.loads(record.read_text())["status"] == "ok"
