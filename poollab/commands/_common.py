"""Shared by sub-commands: option types, policy lists, output folders, reading a trace of the right
kind."""

from __future__ import annotations

from pathlib import Path

import click

import policies
import traces
from poollab.errors import UsageError
from poollab.options import BYTES, ByteSize  # noqa: F401 (the commands' size type, re-exported)
from traces.atomic import check_out_folder
from traces.formats import ALLOC, REQUEST

#: What ``--policy`` means when it is not given: the five built-in policies.
DEFAULT_POLICIES = ("first-fit", "best-fit", "size-class", "paged", "elastic")


def check_specs(specs: tuple[str, ...] | list[str]) -> list[str]:
    """Fail early, before any work, on an unknown policy or parameter."""
    out = list(specs) or list(DEFAULT_POLICIES)
    for spec in out:
        policies.create(spec)  # raises PolicyError naming the spec
    return out


def out_option(
    default: str,
    help: str = "Folder for summary.csv and the other tables (an earlier run's are "
    "replaced; files you put there are kept).",
):
    """``--out``: a result folder, checked before any work (``check_out``)."""
    return click.option(
        "--out",
        "out_dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=default,
        show_default=True,
        callback=check_out,
        help=help,
    )


def check_out(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A ``--out`` that no run can replace (the current folder or one holding it, the root, a
    file) fails now, not after the run. (A file of the user's in the way is found at the end,
    when the run's outputs are known: nothing is changed then either.)"""
    if value is not None and not ctx.resilient_parsing:
        check_out_folder(value)
    return value


def model_file_options(command):
    """``--calibration`` and ``--costs``: the step-time and cost-model files of a simulation."""
    command = click.option(
        "--costs",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Driver and PCIe cost model JSON (default: bundled H200 figures).",
    )(command)
    return click.option(
        "--calibration",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Step-time calibration JSON (default: bundled factors).",
    )(command)


def step_time_line(calibration: Path | None) -> str:
    """What prices the steps, for a command's settings: the calibration file and what it
    describes, or the bundled roofline (a CUDA-graph, vLLM-class engine). A bad file is a
    UsageError."""
    if calibration is None:
        return (
            "step time: bundled roofline (a CUDA-graph, vLLM-class engine; --calibration to "
            "describe yours)"
        )
    from sim.serving.steptime import load_step_calibration

    try:
        return load_step_calibration(calibration).describe()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def read_alloc_or_explain(path: Path, fmt: str | None):
    """``traces.read_alloc_trace``, or a UsageError pointing to `poollab simulate` for a request
    trace."""
    try:
        return traces.read_alloc_trace(path, format=fmt)
    except traces.TraceFormatError:
        other = None if fmt else REQUEST.recognises(path)
        if other:
            raise UsageError(
                f"{path}: this is a request trace ({other}); replay takes allocation traces: "
                f"simulate it with `poollab simulate {path}`"
            ) from None
        raise


def read_requests_or_explain(path: Path, fmt: str | None):
    """``traces.read_request_trace``, or a UsageError pointing to `poollab replay` for an allocation
    trace."""
    try:
        return traces.read_request_trace(path, format=fmt)
    except traces.TraceFormatError:
        other = None if fmt else ALLOC.recognises(path)
        if other:
            raise UsageError(
                f"{path}: this is an allocation trace ({other}); simulate takes request traces: "
                f"replay it with `poollab replay {path}`"
            ) from None
        raise


def load_costs(path: Path | None):
    """``sim.replay.costs.CostModel.load(path)`` (None: the bundled figures); a bad file is a
    UsageError."""
    from sim.replay.costs import CostModel

    if path is None:
        return None
    try:
        return CostModel.load(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
