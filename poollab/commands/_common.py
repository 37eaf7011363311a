"""Shared by sub-commands: policy lists, step-time and cost files, reading a trace of the right
kind. (The options several commands take are declared in ``poollab.options``.)"""

from __future__ import annotations

from pathlib import Path

import policies
import traces
from poollab.errors import UsageError
from poollab.options import BYTES, ByteSize  # noqa: F401 (the commands' size type, re-exported)
from traces.formats import ALLOC, REQUEST

#: What ``--policy`` means when it is not given: the five built-in policies.
DEFAULT_POLICIES = ("first-fit", "best-fit", "size-class", "paged", "elastic")


def check_specs(specs: tuple[str, ...] | list[str]) -> list[str]:
    """Fail early, before any work, on an unknown policy or parameter."""
    out = list(specs) or list(DEFAULT_POLICIES)
    for spec in out:
        policies.create(spec)  # raises PolicyError naming the spec
    return out


def load_calibration(path: Path | None):
    """The ``--calibration`` file, read once (``sim.serving.steptime.load_step_calibration``), or
    None for the bundled roofline; a bad file is a UsageError. Commands pass the loaded object on,
    never the path: a FIFO or ``/dev/stdin`` can be read only once (a second open of a FIFO waits
    for a writer that never comes)."""
    if path is None:
        return None
    from sim.serving.steptime import load_step_calibration

    try:
        return load_step_calibration(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def step_time_line(calibration) -> str:
    """What prices the steps, for a command's settings: the calibration (a ``StepCalibration``,
    ``load_calibration``'s) and what it describes, or the bundled roofline (None: a CUDA-graph,
    vLLM-class engine)."""
    if calibration is None:
        return (
            "step time: bundled roofline "
            "(a CUDA-graph, vLLM-class engine; --calibration to describe yours)"
        )
    return calibration.describe()


def read_alloc_or_explain(path: Path, fmt: str | None, *, reading=None):
    """``traces.read_alloc_trace``, or a UsageError pointing to `poollab simulate` for a request
    trace. ``reading``: the same read started ahead (``traces.read_ahead.start_read(path,
    format=fmt)``), whose result it takes."""
    try:
        if reading is not None:
            return reading.result()
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
