"""Ctrl-C stops a running ``poollab sweep`` at once (exit 130), keeping every cell stored so far.

A real SIGINT to a real ``poollab sweep`` subprocess (its own session, as a terminal's process
group), repeated: to the whole group, as Ctrl-C sends it, and to the main process alone, as
``kill -INT`` does. Issue 29: the sweep hung in 2 of 8 tries (workers interrupted inside the
pool's queues left the others blocked), and the others waited for the running batches to end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from poollab.cli import main

#: Seconds from the SIGINT to the exit that count as "at once" here. The aim is well under 2 s
#: (see the report); the bound is loose for a loaded CI machine, yet far below what waiting for
#: the running batches takes (each is many cells of about a second) or a hang.
PROMPT_EXIT_S = 6.0
REPO = Path(__file__).resolve().parents[3]


def _run(argv: list[str]) -> None:
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "t.csv"
    # ~650k events: ~0.7 s a cell on an idle 2-core machine (2026-12), so the 30 cells left
    # outlast the last try's SIGINT (4 s after the plan line); 12 requests (~120k events), once
    # ~1 s a cell, finished the whole sweep in under 4 s there, before the signal was sent
    _run(["traces", "synth-alloc", "--num-requests", "80", "--out", str(path)])
    return path


def _sweep_file(folder: Path, trace: Path, capacities: list[str]) -> Path:
    path = folder / f"sweep{len(capacities)}.yaml"
    path.write_text(
        f"mode: replay\ntraces: [{trace}]\npolicies: [first-fit, best-fit]\n"
        f"capacities: [{', '.join(capacities)}]\n"
    )
    return path


def _live_in_group(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that still run (zombies do not): workers, fork server."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


def _records(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "cells").glob("*"))}


@pytest.mark.parametrize("target", ["group", "main"])
def test_sigint_exits_130_at_once_and_keeps_the_stored_cells(trace, tmp_path, target):
    first = tmp_path / "first"
    _run(
        [
            "sweep",
            str(_sweep_file(tmp_path, trace, ["64GiB"])),
            "--out",
            str(first),
            "--scheduler",
            "serial",
            "--no-progress",
        ]
    )
    stored = _records(first)
    assert len(stored) == 2
    big = _sweep_file(
        tmp_path, trace, [f"{64 + i}GiB" for i in range(16)]
    )  # 32 cells, 2 already stored
    for attempt in range(3):
        # each try from the same 2 stored cells: cells an earlier try stored would let a later one
        # finish before its SIGINT on a fast machine
        out = tmp_path / f"out{attempt}"
        shutil.copytree(first, out)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "poollab",
                "sweep",
                str(big),
                "--out",
                str(out),
                "--workers",
                "2",
                "--no-progress",
            ],
            cwd=tmp_path,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 120
            while (
                not lines and time.monotonic() < deadline
            ):  # the plan line: cells are about to start
                time.sleep(0.05)
            assert lines, "the sweep never started"
            time.sleep(1.0 + 1.5 * attempt)  # while workers start, then while cells run
            sent = time.monotonic()
            if target == "group":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                os.kill(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=60)
            took_s = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(10)
        err = "".join(lines)
        assert code == 130, err
        assert took_s < PROMPT_EXIT_S, f"exit {took_s:.1f} s after SIGINT"
        assert "Traceback" not in err and err.strip().splitlines()[-1] == "poollab: interrupted", (
            err
        )
        now = _records(out)
        assert {k: now[k] for k in stored} == stored  # what was stored is kept, byte for byte
        for name, data in now.items():  # and every record there is whole
            assert json.loads(data)["status"] in ("ok", "failed"), name
        assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temporaries left"
        if Path("/proc/self/stat").exists():  # no worker or fork server left running its cells
            deadline = time.monotonic() + 10
            while _live_in_group(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _live_in_group(proc.pid) == []
        last = now
    # the next run starts from what the last try stored
    proc = subprocess.run(
        [sys.executable, "-m", "poollab", "sweep", str(big), "--out", str(out), "--dry-run"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"32 replay cells, {len(last)} already done; {32 - len(last)} to run" in proc.stdout, (
        proc.stdout
    )


def test_stop_pool_leaves_the_pools_wakeup_pipe_closed_before_the_exit():
    # CPython 3.11's exit hook writes to a pool's wakeup pipe unless it is closed, without the
    # pool's lock: stop_pool joins the pool's thread so that the pipe is closed by then (a race
    # seen once in CI as a "Bad file descriptor" traceback after "poollab: interrupted")
    from concurrent.futures import ProcessPoolExecutor

    from sim.sweep.runner import stop_pool

    pool = ProcessPoolExecutor(1)
    pool.submit(time.sleep, 30)
    wakeup = getattr(pool, "_executor_manager_thread_wakeup", None)
    if wakeup is None or not hasattr(wakeup, "_closed"):
        pytest.skip("this Python's process pool has no wakeup pipe to check")
    stop_pool(pool)
    assert wakeup._closed
