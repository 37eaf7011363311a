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

from sim.sweep.cells import Cell, _poollab_version

__all__ = ["CellStore"]


class CellStore:
    """Records of finished cells under ``out_dir/cells``, by cell key."""

    def __init__(self, out_dir: str | Path):
        self.dir = Path(out_dir) / "cells"

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def load(self, key: str) -> dict[str, Any] | None:
        """The stored record, or None when there is none (an unreadable one is warned about and ignored)."""
        p = self.path(key)
        try:
            text = p.read_text()
        except FileNotFoundError:
            return None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            warnings.warn(f"{p}: unreadable cell record ({exc}); the cell runs again", RuntimeWarning, stacklevel=2)
            return None
        return record if isinstance(record, dict) and record.get("key") == key else None

    def save(self, cell: Cell, record: dict[str, Any]) -> Path:
        """Store ``record`` (from ``run_cell``) with the cell's inputs, for the record's reader."""
        assert record["key"] == cell.key
        self.dir.mkdir(parents=True, exist_ok=True)
        doc = {**record, "cell": asdict(cell), "poollab_version": _poollab_version(),
               "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        p = self.path(cell.key)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str, allow_nan=True) + "\n")
        os.replace(tmp, p)  # readers see the old record or the new one, never half of one
        return p
