"""The one error a reader raises for bad input: it names the file, the line or record, and why."""

from __future__ import annotations

import gzip
import reprlib
import zlib
from typing import Any

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
        where = (
            self.path
            if line is None
            else f"{self.path}:{line}"
            if unit == "line"
            else f"{self.path} ({unit} {line})"
        )
        super().__init__(f"{where}: {reason}")


_REPR = reprlib.Repr()  # keyword arguments need Python 3.12
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 60


def shown(value: Any, limit: int = 120) -> str:
    """``repr(value)`` for an error message: bounded in depth and length (a 5,000-digit number, a
    list nested 10^5 deep or a megabyte of text cost nothing), cut to ``limit`` characters."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
