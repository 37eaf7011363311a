"""Settings files that are streams: a FIFO fed once or ``/dev/stdin`` works (each file is read
once, whole, and the loaded content passed on), through the real entry point with a timeout: a
command that opened its ``--calibration`` twice waited forever on the second open of a FIFO
(session 21: killed after 2 h). ``/dev/zero``, folders and the rest are in the corpus
(``test_bad_inputs.py``: ``settings-dev-zero-*``, ``sweep-calibration-fifo``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sim.serving.fit_range import RANGE_FEATURES
from traces.errors import TraceFormatError
from traces.source import MAX_SETTINGS_BYTES, read_settings_bytes

REPO = Path(__file__).resolve().parents[2]
REQUESTS = "arrival_s,prompt_tokens,output_tokens\n0,100,10\n0.5,200,20\n1.0,300,5\n"
#: A fitted calibration (no model named: any run may use it).
CALIBRATION = {
    "format": "poollab-step-time/2",
    "engine": "transformers",
    "terms": {"fixed_s": 0.05, "per_token_s": 1e-5},
    "factors": {},
    "fit": {
        "feature_range": {
            "steps": "recorded",
            "quantile": 0.99,
            "features": {
                name: {"max": 1e5, "quantile": 9e4, "min": 1.0} for name in RANGE_FEATURES
            },
        }
    },
}


def _poollab(argv: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "poollab", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # the defect was a hang: a timeout here is the failure
        **kw,
    )


def _feed_once(fifo: Path, data: bytes) -> threading.Thread:
    """A writer that opens ``fifo`` once, writes ``data`` and closes it (a second reader's open
    then waits for a writer that never comes)."""

    def write():
        with open(fifo, "wb") as f:
            f.write(data)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def _release(fifo: Path) -> None:
    """Let a writer still blocked in ``open`` go (the command never opened the FIFO)."""
    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("command", ["simulate", "colocate"])
def test_a_calibration_fifo_fed_once_is_read_once(command: str, tmp_path: Path):
    (tmp_path / "q.csv").write_text(REQUESTS)
    fifo = tmp_path / "cal.json"
    os.mkfifo(fifo)
    writer = _feed_once(fifo, json.dumps(CALIBRATION).encode())
    argv = [command, "q.csv", "--model", "Llama-3.2-1B", "--calibration", str(fifo)]
    argv += ["-p", "paged"] if command == "simulate" else ["--tenants", "2"]
    try:
        proc = _poollab(argv + ["--out", "out"], tmp_path)
    finally:
        _release(fifo)
        writer.join(5)
    assert proc.returncode == 0, proc.stderr
    assert f"step time: fitted from {fifo} (transformers engine" in proc.stdout


def test_a_calibration_on_stdin_is_read_once(tmp_path: Path):
    (tmp_path / "q.csv").write_text(REQUESTS)
    argv = ["simulate", "q.csv", "-p", "paged", "--model", "Llama-3.2-1B"]
    argv += ["--calibration", "/dev/stdin", "--costs", "/dev/stdin", "--out", "out"]
    # both options name the one stream: the second read gets the bytes of the first, so the cost
    # file is refused for what it holds (a calibration), not for a second read that never ends
    proc = _poollab(argv, tmp_path, input=json.dumps(CALIBRATION))
    assert proc.returncode == 2
    assert proc.stderr.startswith("poollab: error: /dev/stdin: ")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_settings_bytes_come_from_a_fifo_once_and_stop_at_the_limit(tmp_path: Path):
    fifo = tmp_path / "s.json"
    os.mkfifo(fifo)
    writer = _feed_once(fifo, b'{"a": 1}')
    assert read_settings_bytes(fifo) == b'{"a": 1}'
    assert read_settings_bytes(fifo) == b'{"a": 1}'  # the same stream again: its bytes, no wait
    writer.join(5)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MAX_SETTINGS_BYTES + 1))
    with pytest.raises(TraceFormatError, match="on a settings file"):
        read_settings_bytes(big)
    with pytest.raises(TraceFormatError, match="on a settings file"):
        read_settings_bytes("/dev/zero")


# ---------------------------------------------------------------- a sweep spec on standard input
SWEEP = "mode: replay\ntraces: [a.csv]\npolicies: [first-fit]\n"
ALLOC = "time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,0,4096,0,\n5,free,0,4096,0,\n"


@pytest.mark.parametrize("how", ["pipe", "redirect"])
def test_a_sweep_on_stdin_takes_relative_paths_from_the_current_directory(how: str, tmp_path: Path):
    """They were taken from /dev, stdin's "folder": ``no such file: /dev/a.csv``."""
    (tmp_path / "a.csv").write_text(ALLOC)
    argv = ["sweep", "/dev/stdin", "--dry-run", "--out", "out"]
    if how == "pipe":
        proc = _poollab(argv, tmp_path, input=SWEEP)
    else:  # /dev/stdin is then the file itself, elsewhere: still no folder of the user's
        spec = tmp_path / "elsewhere" / "sweep.yaml"
        spec.parent.mkdir()
        spec.write_text(SWEEP)
        with open(spec) as f:
            proc = _poollab(argv, tmp_path, stdin=f)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("/dev/stdin: 1 replay cells")


def test_a_sweep_on_stdin_names_its_line_for_a_relative_path_not_there(tmp_path: Path):
    (tmp_path / "a.csv").write_text(ALLOC)
    text = SWEEP + "costs: nope.json\n"
    proc = _poollab(["sweep", "/dev/stdin", "--dry-run", "--out", "out"], tmp_path, input=text)
    assert proc.returncode == 2
    assert proc.stderr == (
        f"poollab: error: /dev/stdin, line 4: costs: no such file: {tmp_path / 'nope.json'} "
        "(a relative path in a sweep read from /dev/stdin is from the current directory)\n"
    )


def test_a_sweep_file_takes_relative_paths_from_its_own_folder(tmp_path: Path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "sweep.yaml").write_text(SWEEP)
    (tmp_path / "a.csv").write_text(ALLOC)  # in the current directory, not the file's folder
    proc = _poollab(["sweep", "sub/sweep.yaml", "--dry-run", "--out", "out"], tmp_path)
    assert proc.returncode == 2
    assert "sub/sweep.yaml, line 2: traces[0]: no such file: sub/a.csv\n" in proc.stderr


@pytest.mark.parametrize(
    "path, base",
    [("/dev/stdin", None), ("/dev/fd/63", None), ("/proc/self/fd/0", None), ("s/w.yaml", "s")],
)
def test_relative_base_of_a_descriptor_is_the_current_directory(path: str, base):
    from sim.sweep.spec import relative_base

    assert relative_base(path) == (Path.cwd() if base is None else Path(base))
