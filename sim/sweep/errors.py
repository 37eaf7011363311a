"""What a sweep reports as the user's mistake (a bad SWEEP.yaml, an unusable scheduler)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["SweepError", "SweepSpecError"]


class SweepError(ValueError):
    """Bad sweep input: the command line prints it as one line and exits with status 2."""


class SweepSpecError(SweepError):
    """A problem in a SWEEP.yaml, located by file, line (when known) and key.

    Printed as ``sweep.yaml, line 7: policies[1].params.high: must be a number``.
    """

    def __init__(self, path: str | Path, line: int | None, key: str | None, reason: str):
        self.path, self.line, self.key, self.reason = str(path), line, key, reason
        where = self.path + (f", line {line}" if line is not None else "")
        super().__init__(f"{where}: {key}: {reason}" if key else f"{where}: {reason}")
