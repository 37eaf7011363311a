"""Result folders and trace files are written all or nothing."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from poollab.cli import main
from sim.replay.schema import read_results, write_results

TRACE = "time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,0,4096,0,\n5,free,0,4096,0,\n"
REQUESTS = "arrival_s,prompt_tokens,output_tokens\n0,100,10\n0.5,200,20\n"


def _tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(root.rglob("*"))
    }


def _run(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exc:
        return exc.code
    return 0


def test_a_simulate_that_fails_while_writing_leaves_the_old_folder_exactly(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "q.csv").write_text(REQUESTS)
    keep = tmp_path / "keep"
    argv = [
        "simulate",
        str(tmp_path / "q.csv"),
        "-p",
        "paged",
        "--model",
        "Llama-3.2-1B",
        "--out",
        str(keep),
    ]
    assert _run(argv) == 0
    (keep / "old_table.parquet").write_bytes(
        (keep / "timeseries.parquet").read_bytes()
    )  # as a replay run leaves
    before = _tree(tmp_path)

    real = pd.DataFrame.to_parquet
    calls = []

    def fail_on_the_second_table(
        self, path, *a, **kw
    ):  # summary.csv and one table written, then the disk fills
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(path))
        return real(self, path, *a, **kw)

    monkeypatch.setattr(pd.DataFrame, "to_parquet", fail_on_the_second_table)
    code = _run(argv)
    err = capsys.readouterr().err
    assert code == 2 and "No space left on device" in err and len(err.strip().splitlines()) == 1
    assert len(calls) == 2
    assert _tree(tmp_path) == before  # same files, same bytes, no temporary folder beside it


def test_a_successful_run_replaces_the_old_tables_and_keeps_the_rest(tmp_path):
    out = tmp_path / "res"
    summary = pd.DataFrame({"trace": ["t"], "policy": ["p"], "backend": ["sim"]})
    write_results(out, summary, extra_tables={"requests": summary})
    (out / "cells").mkdir()
    (out / "cells" / "a.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    write_results(out, summary.assign(policy="q"), timeseries=summary)
    assert sorted(read_results(out)) == [
        "summary",
        "timeseries",
    ]  # the stale requests.parquet is gone
    assert read_results(out)["summary"]["policy"].tolist() == ["q"]
    assert (out / "cells" / "a.json").read_text() == "{}" and (
        out / "notes.txt"
    ).read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res"]  # no temporary folder left


def _file_size_limit(nbytes: int):
    def limit() -> None:
        signal.signal(
            signal.SIGXFSZ, signal.SIG_IGN
        )  # write() then fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return limit


@pytest.mark.parametrize(
    "argv",
    [
        ["traces", "synth", "--rate", "50", "--num-requests", "20000", "--out", "{d}/t.csv"],
        ["traces", "synth-alloc", "--num-requests", "64", "--out", "{d}/t.parquet"],
        ["replay", "{d}/a.csv", "-p", "first-fit", "--out", "{d}/out", "--no-progress"],
    ],
)
def test_a_full_disk_is_one_line_through_the_real_entry_point(argv, tmp_path):
    """A file-size limit stands in for a full disk: the write fails midway (EFBIG), in a real
    process."""
    (tmp_path / "a.csv").write_text(TRACE)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "summary.csv").write_text("old\n")
    before = _tree(tmp_path)
    exe = Path(sys.executable).with_name("poollab")
    proc = subprocess.run(
        [str(exe)] + [a.replace("{d}", str(tmp_path)) for a in argv],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_file_size_limit(1000),
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("poollab: error: ") and "File too large" in lines[0]
    ), proc.stderr
    assert "Traceback" not in proc.stderr
    assert _tree(tmp_path) == before


def test_ctrl_c_while_modules_import_is_one_line_and_exit_130(tmp_path):
    """SIGINT lands while the command's modules import (made certain by an import hook) in the real
    console script."""
    script = Path(sys.executable).with_name("poollab")
    prelude = (
        "import sys, os, signal, runpy\n"
        "class Hook:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith('poollab.commands.'):\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hook())\n"
        f"sys.argv = [{str(script)!r}, 'policies']\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "poollab: interrupted"
