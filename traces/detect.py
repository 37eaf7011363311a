"""Which reader a file needs, told from its first bytes (the name may lie), and the one entry point.

=================  ===========================================================================
format             recognised by
=================  ===========================================================================
pytorch-snapshot   a pickle (``0x80`` protocol opcode), plain or inside gzip (``1f 8b``)
rmm-log            first line ``Thread,Time,Action,Pointer,Size,Stream`` (plain or gzipped)
csv                first line starting with ``time_us,op,alloc_id,nbytes,stream,tag``
parquet            the ``PAR1`` magic
=================  ===========================================================================

The file is read once (``traces.source.open_source``): from a pipe, a FIFO or ``<(...)`` too,
and a gzip stream is looked into by its content, whatever its name.
"""

from __future__ import annotations

from pathlib import Path

from traces.alloc_table import CSV_FORMAT, PARQUET_FORMAT, read_table_csv, read_table_parquet
from traces.errors import TraceFormatError
from traces.events import EVENT_COLUMNS, AllocTrace
from traces.pytorch_snapshot import SNAPSHOT_FORMAT, read_pytorch_snapshot
from traces.rmm_log import RMM_FORMAT, RMM_HEADER, read_rmm_log
from traces.source import TraceSource, open_source

__all__ = ["ALLOC_FORMATS", "detect_alloc_format", "read_alloc_trace"]

ALLOC_FORMATS = (SNAPSHOT_FORMAT, RMM_FORMAT, CSV_FORMAT, PARQUET_FORMAT)
_HEAD_BYTES = 4096


def detect_alloc_format(path: str | Path | TraceSource) -> str:
    """The format of an allocation-trace file, from its content (read once, ``traces.source``).

    Raises:
        TraceFormatError: the content matches none of ``ALLOC_FORMATS``, or the file is over the
            size limit.
    """
    return _detect(open_source(path))


def _detect(src: TraceSource) -> str:
    head = src.head(_HEAD_BYTES)
    if not head:
        if src.damage is not None:  # a damaged gzip stream that yields nothing
            raise TraceFormatError(src.path, None, src.damage)
        raise TraceFormatError(src.path, None, "gzip stream holds nothing" if src.gzipped else "empty file")
    if not src.gzipped and head[:4] == b"PAR1":
        return PARQUET_FORMAT
    if _is_pickle(head):
        return SNAPSHOT_FORMAT
    first = head.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8-sig", errors="replace")
    fields = [c.strip() for c in first.split(",")]
    if fields == RMM_HEADER:
        return RMM_FORMAT
    if fields[: len(EVENT_COLUMNS)] == EVENT_COLUMNS:
        return CSV_FORMAT
    raise TraceFormatError(src.path, 1, f"cannot tell the format from the first line {first[:80]!r}: expected a "
                                        f"PyTorch snapshot pickle, an RMM log ({','.join(RMM_HEADER)}), our CSV "
                                        f"({','.join(EVENT_COLUMNS)}) or Parquet")


def read_alloc_trace(path: str | Path | TraceSource, *, format: str | None = None, device: int | None = None,
                     lenient: bool = False) -> AllocTrace:
    """Read an allocation trace of any supported format.

    Args:
        path: the file (a regular file, pipe or FIFO, plain or gzipped), or its ``TraceSource``;
            it is read once, for detection and reading alike.
        format: one of ``ALLOC_FORMATS``; None detects it from the content.
        device: PyTorch snapshots only: which device's trace (default: the one with events).
        lenient: RMM logs only: drop frees of pointers that are not live instead of raising.

    Raises:
        TraceFormatError: the file is malformed (names the file, line or record, and why).
    """
    if format is not None and format not in ALLOC_FORMATS:
        raise TraceFormatError(path, None, f"unknown format {format!r}; choose one of {', '.join(ALLOC_FORMATS)}")
    src = open_source(path)
    fmt = _detect(src) if format is None else format
    if fmt == SNAPSHOT_FORMAT:
        return read_pytorch_snapshot(src, device=device)
    if fmt == RMM_FORMAT:
        return read_rmm_log(src, lenient=lenient)
    if fmt == CSV_FORMAT:
        return read_table_csv(src)
    return read_table_parquet(src)


def _is_pickle(head: bytes) -> bool:
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5  # PROTO opcode, protocols 2-5
