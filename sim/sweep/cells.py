"""One sweep cell: its inputs, the key its result is stored under, and running it.

A ``Cell`` is a plain, picklable record of everything one run depends on (the same object goes
to a local worker process or a Dask worker). ``run_cell`` never raises for a failing run: the
error becomes part of the returned record, so one bad cell cannot stop a sweep. Workers must
see the same files at the same paths as the machine that planned the sweep (a shared file
system on a cluster).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policies.spec import parse_spec

__all__ = [
    "FileRef",
    "Cell",
    "file_ref",
    "cell_key",
    "run_cell",
    "run_cells",
    "cell_columns",
    "KEY_SCHEMA",
    "MODES",
    "STATUS_OK",
    "STATUS_FAILED",
    "STATUS_LOST",
    "lost_record",
]

#: Bumped when what a key covers changes, so old stores are not mistaken for new results.
KEY_SCHEMA = 1
MODES = ("replay", "simulate")
STATUS_OK, STATUS_FAILED, STATUS_LOST = "ok", "failed", "lost"
#: Hex digits of the SHA-256 kept in a key: 80 bits, no collision in any sweep a person runs.
_KEY_HEX = 20
_HASH_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class FileRef:
    """A file input and its fingerprint: ``sha256:<hex>`` of the content, or
    ``stat:<path>:<size>:<mtime_ns>`` (cheaper for huge files, but moving or touching the file
    invalidates it)."""

    path: str
    fingerprint: str


@functools.lru_cache(maxsize=256)
def _content_hash(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def file_ref(path: str | Path, how: str = "content") -> FileRef:
    """Fingerprint ``path`` (absolute) by its content (``how="content"``) or its stat
    (``"stat"``)."""
    p = Path(path).resolve()
    st = p.stat()
    if how == "stat":
        return FileRef(str(p), f"stat:{p}:{st.st_size}:{st.st_mtime_ns}")
    assert how == "content", how
    return FileRef(str(p), "sha256:" + _content_hash(str(p), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=1)
def _poollab_version() -> str:
    """The installed distribution's version, else (a source checkout on PYTHONPATH) the one in
    its ``pyproject.toml``: read from below, since ``sim`` must not import the ``poollab`` CLI."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("poollab")
    except PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


@dataclass(frozen=True)
class Cell:
    """Everything one run depends on; ``key`` is derived from all of it (see ``cell_key``).

    Attributes:
        mode: "replay" (an allocation trace) or "simulate" (a request trace through the server).
        trace: the trace file; trace_name: the report's ``trace`` column; trace_format: its reader.
        policy: the policy spec string (parameters spelled out).
        capacity_bytes: replay: the pool's limit; simulate: the KV budget (None: no limit /
            derived).
        sample_every: replay: stats stride in events (None: the default).
        costs: driver cost model file (None: the bundled H200 figures).
        model, gpu: simulate: a preset name or a JSON file.
        calibration: simulate: step-time calibration file (None: bundled factors).
        rate_scale: simulate: arrival-rate multiplier.
        options: simulate: ``ServerConfig`` knobs as sorted ``(name, value)`` pairs.
    """

    mode: str
    trace: FileRef
    trace_name: str
    trace_format: str | None
    policy: str
    capacity_bytes: int | None = None
    sample_every: int | None = None
    costs: FileRef | None = None
    model: str | FileRef | None = None
    gpu: str | FileRef | None = None
    calibration: FileRef | None = None
    rate_scale: float | None = None
    options: tuple[tuple[str, Any], ...] = ()
    key: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        assert self.mode in MODES, self.mode
        object.__setattr__(self, "key", cell_key(self))


def _key_value(value: Any) -> Any:
    if isinstance(value, FileRef):
        return value.fingerprint  # content, not location: a moved trace keeps its results
    if isinstance(value, tuple):
        return [_key_value(v) for v in value]
    return value


def cell_key(cell: Cell) -> str:
    """Hex key of a cell's inputs: file fingerprints, spec, capacity, every option, poollab's
    version."""
    inputs = {
        f.name: _key_value(getattr(cell, f.name))
        for f in dataclasses.fields(cell)
        if f.name != "key"
    }
    inputs["key_schema"] = KEY_SCHEMA
    inputs["poollab"] = _poollab_version()
    text = json.dumps(inputs, sort_keys=True, default=repr, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()[:_KEY_HEX]


def _label(value: str | FileRef | None) -> str | None:
    return value.path if isinstance(value, FileRef) else value


def cell_columns(cell: Cell) -> dict[str, Any]:
    """The cell's inputs as flat result columns: ``cell_*``, ``param_<knob>``, ``option_<knob>``."""
    name, params = parse_spec(cell.policy)
    cols: dict[str, Any] = {
        "cell_key": cell.key,
        "cell_mode": cell.mode,
        "cell_trace_file": cell.trace.path,
        "cell_policy_name": name,
        "cell_capacity_bytes": cell.capacity_bytes,
    }
    if cell.mode == "simulate":
        cols.update(
            cell_model=_label(cell.model),
            cell_gpu=_label(cell.gpu),
            cell_rate_scale=cell.rate_scale,
        )
    cols.update({f"param_{k}": v for k, v in params.items()})
    cols.update({f"option_{k}": v for k, v in cell.options})
    return cols


# Workers run many cells of the same trace: keep the last few parsed (a process-local cache).
@functools.lru_cache(maxsize=2)
def _alloc_trace(path: str, fmt: str | None, fingerprint: str):
    from traces import read_alloc_trace

    return read_alloc_trace(path, format=fmt)


@functools.lru_cache(maxsize=2)
def _request_trace(path: str, fmt: str | None, fingerprint: str):
    from traces import read_request_trace

    return read_request_trace(path, format=fmt)


@functools.lru_cache(maxsize=8)
def _cost_model(ref: FileRef | None):
    from sim.replay.costs import CostModel

    return CostModel.load(ref.path if ref is not None else None)


def _run_replay(cell: Cell) -> dict[str, Any]:
    from sim.replay.trace_replay import replay

    trace = _alloc_trace(cell.trace.path, cell.trace_format, cell.trace.fingerprint)
    trace = dataclasses.replace(trace, name=cell.trace_name)
    result = replay(
        trace,
        cell.policy,
        capacity_bytes=cell.capacity_bytes,
        costs=_cost_model(cell.costs),
        sample_every=cell.sample_every,
    )
    return result.summary


def _run_simulate(cell: Cell) -> dict[str, Any]:
    from sim.serving.simulate import simulate

    trace = _request_trace(cell.trace.path, cell.trace_format, cell.trace.fingerprint)
    if cell.rate_scale is not None and cell.rate_scale != 1.0:
        trace = trace.scale_rate(cell.rate_scale)
    options = dict(cell.options)
    if cell.capacity_bytes is not None:
        options["kv_capacity_bytes"] = cell.capacity_bytes
    result = simulate(
        trace,
        cell.policy,
        model=_label(cell.model),
        gpu=_label(cell.gpu),
        calibration=_label(cell.calibration),
        costs=_cost_model(cell.costs),
        trace_name=cell.trace_name,
        **options,
    )
    return result.summary


def _plain(value: Any) -> Any:
    """numpy scalars to Python ones, so records go through JSON and pickling unchanged."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def run_cell(cell: Cell) -> dict[str, Any]:
    """Run one cell; never raises for a failing run.

    Returns:
        A record: ``key``, ``status`` ("ok" or "failed"), ``error`` ("Type: message" or None),
        ``traceback``, ``elapsed_s``, ``host``, ``pid`` and ``summary`` (the report-schema row;
        empty when the run failed).
    """
    t0 = time.perf_counter()
    try:
        summary = _run_replay(cell) if cell.mode == "replay" else _run_simulate(cell)
        status, error, tb = STATUS_OK, None, None
    except Exception as exc:  # a failing cell is a result, not the end of the sweep
        summary, status, error, tb = (
            {},
            STATUS_FAILED,
            f"{type(exc).__name__}: {exc}",
            traceback.format_exc(),
        )
    elapsed_s = time.perf_counter() - t0
    return {
        "key": cell.key,
        "status": status,
        "error": error,
        "traceback": tb,
        "elapsed_s": elapsed_s,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "summary": _plain(summary),
    }


def run_cells(cells: list[Cell]) -> list[dict[str, Any]]:
    """``run_cell`` of each, in order: one task of a batched sweep (one round trip to a worker
    for several cells, which then share the worker's parsed trace)."""
    return [run_cell(cell) for cell in cells]


def lost_record(cell: Cell, exc: BaseException) -> dict[str, Any]:
    """The record of a cell whose worker died or vanished (not stored: a re-run retries it)."""
    message = str(exc)
    error = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return {
        "key": cell.key,
        "status": STATUS_LOST,
        "error": error,
        "traceback": None,
        "elapsed_s": math.nan,
        "host": None,
        "pid": None,
        "summary": {},
    }
