"""The resumable store: one JSON record per finished cell, ``DIR/cells/<key>.json``.

A record is written once its cell is done (atomically: a temporary file renamed into place),
so a sweep stopped at any moment keeps every cell it finished and a re-run skips them. Only the
process that plans the sweep writes here: workers, local or on a cluster, just return records.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sim.sweep.cells import STATUS_FAILED, STATUS_OK, Cell, _poollab_version

__all__ = ["CellStore", "CellRecordWarning", "record_problem"]

#: What a stored record's status may be (lost cells are never stored).
_STORED_STATUSES = (STATUS_OK, STATUS_FAILED)


class CellRecordWarning(RuntimeWarning):
    """A stored cell record cannot be used; its cell runs again (``poollab sweep`` prints one
    line)."""


def record_problem(record: Any, key: str) -> str | None:
    """What makes ``record`` no usable record of cell ``key`` (None: it is one)."""
    if not isinstance(record, dict):
        return f"not a cell record (a JSON object), but {type(record).__name__}"
    if record.get("key") != key:
        return f"the record of another cell ({str(record.get('key'))[:40]!r}, not {key!r})"
    if record.get("status") not in _STORED_STATUSES:
        return (
            f"not a cell record: status {record.get('status')!r}, "
            f"expected one of {', '.join(_STORED_STATUSES)}"
            if "status" in record
            else "not a cell record: no status"
        )
    summary = record.get("summary", {})
    if summary is not None and not isinstance(summary, dict):
        return f"not a cell record: its summary is {type(summary).__name__}, not an object"
    bad = [
        k
        for k, v in (summary or {}).items()
        if not isinstance(v, (str, int, float, bool, type(None)))
    ]
    if bad:
        return (
            f"not a cell record: summary field {bad[0]!r} is {type(summary[bad[0]]).__name__}, "
            "not a plain value"
        )
    if record["status"] == STATUS_OK and not summary:
        return "not a cell record: status ok without a summary"
    if not isinstance(record.get("error"), (str, type(None))):
        return f"not a cell record: its error is {type(record['error']).__name__}, not text"
    if not isinstance(record.get("elapsed_s"), (int, float, type(None))) or isinstance(
        record.get("elapsed_s"), bool
    ):
        return "not a cell record: elapsed_s is not a number"
    return None


class CellStore:
    """Records of finished cells under ``out_dir/cells``, by cell key."""

    def __init__(self, out_dir: str | Path):
        self.dir = Path(out_dir) / "cells"

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def load(self, key: str) -> dict[str, Any] | None:
        """The stored record, or None when there is none.

        A record that is not one (not JSON, not UTF-8, a folder, another cell's, no status, a
        summary that is no mapping of plain values) is warned about (``CellRecordWarning``,
        naming the file) and counts as missing: the cell runs again and its record is rewritten,
        so one damaged file cannot stop every later run.
        """
        p = self.path(key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:  # a folder, or a file we may not read: run it; saving then says why
            return self._unusable(p, exc.strerror or type(exc).__name__)
        try:
            record = json.loads(data)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            return self._unusable(p, f"unreadable cell record ({' '.join(str(exc).split())[:120]})")
        problem = record_problem(record, key)
        return record if problem is None else self._unusable(p, problem)

    @staticmethod
    def _unusable(path: Path, reason: str) -> None:
        warnings.warn(f"{path}: {reason}; the cell runs again", CellRecordWarning, stacklevel=3)
        return None

    def save(self, cell: Cell, record: dict[str, Any]) -> Path:
        """Store ``record`` (from ``run_cell``) with the cell's inputs, for the record's reader."""
        assert record["key"] == cell.key
        self.dir.mkdir(parents=True, exist_ok=True)
        doc = {
            **record,
            "cell": asdict(cell),
            "poollab_version": _poollab_version(),
            "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        p = self.path(cell.key)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str, allow_nan=True) + "\n")
        os.replace(tmp, p)  # readers see the old record or the new one, never half of one
        return p
