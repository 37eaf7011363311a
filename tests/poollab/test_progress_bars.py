"""Every long command shows a progress bar on a terminal, and nothing on a pipe or with
--no-progress.

The bar is ``sim.replay.progress.progress_bar``'s (tqdm, drawn on stderr only when it is a
terminal): these tests put a terminal stand-in in stderr's place and run the command in-process.
"""

from __future__ import annotations

import io
import sys

import pytest

from poollab.cli import main
from sim.replay.progress import NullBar, progress_bar, time_bar
from traces import bundled_path, generate_alloc_trace, write_alloc_trace

SLICE = str(bundled_path("llama1b_generate_slice.pickle.gz"))


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def _run(argv: list[str], err: io.StringIO, monkeypatch) -> str:
    monkeypatch.setattr(sys, "stderr", err)
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    return err.getvalue()


@pytest.fixture
def small_alloc_trace(tmp_path):
    """A few hundred events of a tiny model: ``gpu replay --validate`` writes and checks every byte
    the policy hands out, so a Llama-3.2-1B-shaped trace (2.4 GiB of weights) cost ~25 s a run."""
    path = tmp_path / "small.csv"
    trace = generate_alloc_trace(
        num_requests=2,
        max_batch=2,
        num_layers=2,
        hidden_size=256,
        vocab_size=1024,
        prompt_tokens=(32, 64),
        output_tokens=(4, 8),
        seed=1,
    )
    write_alloc_trace(trace, path)
    return str(path)


@pytest.fixture
def request_trace(tmp_path):
    from tests.poollab.conftest import AZURE_TRACE

    path = tmp_path / "azure.csv"
    path.write_text(AZURE_TRACE)
    return str(path)


def _commands(tmp_path, small_alloc_trace, request_trace):
    out = str(tmp_path / "out")
    return {
        "replay": (["replay", SLICE, "-p", "best-fit", "-p", "paged", "--out", out], "best-fit"),
        "replay in workers": (
            ["replay", SLICE, "-p", "best-fit", "-p", "paged", "--workers", "2", "--out", out],
            "2 policies, 2 workers",
        ),
        "gpu replay --validate": (
            [
                "gpu",
                "replay",
                small_alloc_trace,
                "-p",
                "paged",
                "--backend",
                "host",
                "--validate",
                "--sim",
                "--out",
                out,
            ],
            "paged",
        ),
        "colocate": (
            [
                "colocate",
                request_trace,
                "--tenants",
                "2",
                "--layout",
                "shared",
                "--model",
                "Llama-3.2-1B",
                "--out",
                out,
            ],
            "colocate · shared",
        ),
        "fidelity": (["fidelity", SLICE], "torch-caching"),
        "simulate": (
            ["simulate", request_trace, "-p", "paged", "--model", "Llama-3.2-1B", "--out", out],
            "sim-s",
        ),
    }


@pytest.mark.parametrize(
    "name",
    ["replay", "replay in workers", "gpu replay --validate", "colocate", "fidelity", "simulate"],
)
def test_a_long_command_shows_progress_on_a_terminal_only(
    name, tmp_path, small_alloc_trace, request_trace, monkeypatch
):
    argv, title = _commands(tmp_path, small_alloc_trace, request_trace)[name]
    shown = _run(argv, Terminal(), monkeypatch)
    assert title in shown and "%|" in shown, shown[-500:]
    assert _run(argv, Pipe(), monkeypatch) == ""  # a pipe: nothing
    assert _run(argv + ["--no-progress"], Terminal(), monkeypatch) == ""


def test_the_helper_draws_on_a_terminal_and_does_nothing_when_disabled():
    tty = Terminal()
    with progress_bar(100, "work", file=tty) as bar:
        bar.update(40)
    assert "work" in tty.getvalue()
    pipe = Pipe()
    with progress_bar(100, "work", file=pipe) as bar:
        bar.update(40)
    assert pipe.getvalue() == ""
    assert isinstance(progress_bar(100, "work", enabled=False), NullBar)
    with time_bar(10.0, "sim", enabled=False) as advance:
        assert advance is None


def test_colocate_results_are_the_same_with_a_bar(request_trace):
    from sim.serving.tenants import colocate
    from traces import read_request_trace

    trace = read_request_trace(request_trace)
    kwargs = dict(tenant_names=["a", "b"], models=["Llama-3.2-1B"], gpu="H200", layout="sleep")
    seen = []
    with_bar = colocate([trace, trace], "page-pool", progress=seen.append, **kwargs)
    without = colocate([trace, trace], "page-pool", **kwargs)
    assert len(seen) >= 100 and seen == sorted(seen)
    timing = [c for c in without[0].columns if c == "wall_s" or c.endswith("_us")]
    import pandas as pd

    pd.testing.assert_frame_equal(with_bar[0].drop(columns=timing), without[0].drop(columns=timing))
    pd.testing.assert_frame_equal(with_bar[1], without[1])
    pd.testing.assert_frame_equal(with_bar[2], without[2])
