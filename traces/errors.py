"""The one error a reader raises for bad input: it names the file, the line or record, and why."""

from __future__ import annotations

import gzip
import zlib

#: What reading a damaged gzip file raises, wherever it is cut (one tuple for every text reader).
DAMAGED_GZIP: tuple[type[Exception], ...] = (EOFError, zlib.error, gzip.BadGzipFile)


class TraceFormatError(ValueError):
    """A trace file could not be read.

    Attributes:
        path: the file.
        line: 1-based line (text formats) or record number (binary formats), or None.
        reason: what is wrong, in words.
    """

    def __init__(self, path: object, line: int | None, reason: str, *, unit: str = "line"):
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}" if unit == "line" else f"{self.path} ({unit} {line})"
        super().__init__(f"{where}: {reason}")
